"""Bounded dynamic shapes (issue 19): programs exported with
`torch.export.Dim`, compiled once, run at several sizes within the bound.

Each case runs at its smallest, its largest and an odd size, against eager
PyTorch at the same inputs:
- our `--backend cpu` `.pte` in ExecuTorch's own runtime (`executorch.runtime`);
- the same `.pte`, and the `--backend metal` one, with `etmetal run`;
- a `.pte` that ExecuTorch's `to_executorch()` made of the same program,
  with `etmetal run` (the encoding both sides share).

The modules: an MLP with a dynamic batch, a transformer block with a
dynamic sequence length, a decoder's prefill over a dynamic token count
(last-token logits), a conv net with a dynamic batch and one with a
dynamic image size, and some of the
seed backend's test modules (executorch/backends/apple/metal/tests/
test_modules.py, written out here: importing it needs macOS libraries)
with a dynamic dim. With `--backend metal` the dynamic nodes run on the GPU at
the run-time size (each case lists the ops that stay on the CPU, reason
"dynamic shape: <op> ... `<dim>`"), on a GPU adapter. Also: SymInts used as
tensor values and a KV-cache write of a dynamic number of rows follow the
size, and what the importer cannot handle symbolically is an error naming
the node.
"""

from __future__ import annotations

import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from executorch.exir import to_edge
from executorch.runtime import Runtime
from torch.export import Dim

from runner import RUN_TIMEOUT_S, to_npy
from test_parity import compare

ATOL = RTOL = 1e-5


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: causal attention over `seq`, then an MLP."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        heads = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.silu(self.up(self.ln2(x))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 1).flatten(1)
        return self.fc(x)


class Decoder(nn.Module):
    """An LLM prefill over `tokens`: embeddings and positions (arange), RMS
    norm, causal attention, logits of the last token and of the last three."""

    def __init__(self, vocab=50, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.pos, self.norm = nn.Embedding(vocab, d), nn.Embedding(64, d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.emb(tokens) + self.pos(torch.arange(t))
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        heads = lambda z: z.reshape(b, t, self.heads, -1).permute(0, 2, 1, 3)
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        logits = self.head(x + self.o(a.permute(0, 2, 1, 3).reshape(b, t, -1)))
        return logits[:, -1, :], logits[:, -3:, :]


# The seed's test modules (same definitions as test_modules.py).
class Add(nn.Module):
    def forward(self, x, y):
        return x + y


class LinearWithBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(7, 101, bias=True)

    def forward(self, x):
        return self.linear(x)


class SplitCat(nn.Module):
    def forward(self, x):
        a, b, c = torch.split(x, 2, dim=1)
        return torch.cat([a * 2.0, b + 1.0, c], dim=1)


class Conv1dNoBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 6, kernel_size=3, stride=1, padding=1, bias=False)

    def forward(self, x):
        return self.conv(x)


class SDPA(nn.Module):
    def forward(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)


class NarrowLastDim(nn.Module):
    def forward(self, x):
        half = x.shape[-1] // 2
        return x.narrow(-1, 0, half) * 2.0 + x.narrow(-1, half, half)


class TensorSplit(nn.Module):
    """tensor_split of a dynamic dim (Mamba and Mamba-2 split their scan's
    sequence so): at a SymInt index, at an index counted from the end, and into
    sections whose sizes follow the run-time size."""

    def forward(self, x, y):
        n = x.shape[-1]
        a, b, c = torch.tensor_split(x, (3, n - 1), dim=-1)
        d, e = torch.tensor_split(x, (-2,), dim=-1)
        f, g, h = torch.tensor_split(y, 3, dim=-1)
        return a * 2, b + 1, c * 3, d - 1, e * 4, f * 2, g + 1, h * 3


class TopK(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 8, bias=False)

    def forward(self, x):
        return torch.topk(self.linear(x), 2, dim=-1).values


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    # the inputs' shapes at size `n` of the dynamic dim
    shapes: Callable[[int], list[tuple[int, ...]]]
    # the dynamic_shapes of torch.export, given the Dim
    dims: Callable[[Dim], object]
    lo: int
    hi: int
    odd: int
    # the size the example inputs of the export have
    example: int | None = None
    # the ops `--backend metal` keeps on the CPU (all else runs on the GPU at
    # the run-time size): convolution and pooling over dynamic spatial dims,
    # attention over a dynamic number of non-causal keys, top-k, and the
    # arange a decoder makes of its length (no dynamic input to size it)
    metal_cpu: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.lo, self.hi, self.odd)


def batch0(n_inputs: int = 1):
    return lambda d: tuple({0: d} for _ in range(n_inputs))


CASES = [
    Case("mlp_batch", Mlp, lambda n: [(n, 16)], batch0(), 1, 32, 7),
    Case("block_seq", Block, lambda n: [(2, n, 32)], lambda d: ({1: d},), 1, 48, 13),
    Case("decoder_tokens", Decoder, lambda n: [(1, n)], lambda d: ({1: d},), 3, 64, 11, metal_cpu=("arange",)),
    Case("convnet_batch", ConvNet, lambda n: [(n, 3, 16, 16)], batch0(), 1, 4, 3),
    Case("convnet_image", ConvNet, lambda n: [(2, 3, n, n)], lambda d: ({2: d, 3: d},), 10, 32, 13, example=20,
         metal_cpu=("adaptive_avg_pool", "batch_norm", "convolution", "max_pool")),
    Case("seed_add", Add, lambda n: [(n,), (n,)], batch0(2), 1, 64, 37),
    Case("seed_linear_bias", LinearWithBias, lambda n: [(n, 7)], batch0(), 1, 256, 127),
    Case("seed_split_cat", SplitCat, lambda n: [(1, 6, n)], lambda d: ({2: d},), 1, 16, 5),
    Case("seed_conv1d_length", Conv1dNoBias, lambda n: [(1, 8, n)], lambda d: ({2: d},), 2, 64, 5,
         metal_cpu=("convolution",)),
    Case(
        "seed_sdpa_seq",
        SDPA,
        lambda n: [(2, 4, n, 64)] * 3,
        lambda d: ({2: d}, {2: d}, {2: d}),
        1,
        32,
        13,
        metal_cpu=("sdpa",),
    ),
    Case("seed_narrow_last_dim", NarrowLastDim, lambda n: [(2, 4, 2 * n)], lambda d: ({2: 2 * d},), 1, 16, 5),
    # (y's size 3n+1: sections of it are n+1, n and n)
    Case("tensor_split", TensorSplit, lambda n: [(2, n), (2, 3 * n + 1)], lambda d: ({1: d}, {1: 3 * d + 1}),
         6, 16, 11, example=8),
    Case("seed_topk_batch", TopK, lambda n: [(n, 64)], batch0(), 1, 16, 5, metal_cpu=("top_k",)),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def inputs_at(case: Case, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    if case.make is Decoder:
        return [torch.randint(0, 50, s, generator=g) for s in case.shapes(n)]
    return [torch.randn(*s, generator=g) for s in case.shapes(n)]


@functools.cache
def exported(name: str) -> tuple[nn.Module, torch.export.ExportedProgram]:
    case = CASES_BY_NAME[name]
    torch.manual_seed(0)
    module = case.make().eval()
    with torch.no_grad():
        for p in module.parameters():  # keep activations in a well-conditioned range
            p.mul_(0.5)
    d = Dim(f"{name}_n", min=case.lo, max=case.hi)
    example = case.example or max(case.lo, min(case.hi, 4 if case.lo < 4 else case.lo))
    ep = torch.export.export(module, tuple(inputs_at(case, example)), dynamic_shapes=case.dims(d))
    return module, ep


@functools.cache
def runtime() -> Runtime:
    return Runtime.get()


def work_dir(tmp_path_factory, name: str) -> Path:
    return tmp_path_factory.mktemp(name)


def etm(binary: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(binary), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


@functools.cache
def compiled(binary: Path, name: str, backend: str, root: Path) -> tuple[Path, str]:
    """The program compiled with `--backend backend` (once per session)."""
    _, ep = exported(name)
    pt2, pte = root / f"{name}.pt2", root / f"{name}.{backend}.pte"
    torch.export.save(ep, pt2)
    res = etm(binary, "compile", str(pt2), "-o", str(pte), "--backend", backend)
    assert res.returncode == 0, f"{name}: etmetal compile --backend {backend} failed:\n{res.stderr}"
    return pte, res.stdout


def eager(name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    module, _ = exported(name)
    with torch.no_grad():
        out = module(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check(where: str, got: list[np.ndarray], want: list[torch.Tensor]):
    assert len(got) == len(want), f"{where}: {len(got)} outputs, eager has {len(want)}"
    problems = [f"output {i}: {m}" for i, (g, w) in enumerate(zip(got, want)) if (m := compare(g, w, ATOL, RTOL))]
    assert not problems, f"{where}\n" + "\n".join(problems)


def run_etmetal_raw(binary: Path, pte: Path, inputs: list[torch.Tensor], work: Path) -> subprocess.CompletedProcess:
    """`etmetal run` of `inputs`, writing outputs to `work/out`."""
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, t in enumerate(inputs):
        paths.append(str(work / f"input_{i}.npy"))
        np.save(paths[-1], to_npy(t))
    return etm(binary, "run", str(pte), "--inputs", ",".join(paths), "--output-dir", str(work / "out"),
               "--device", "auto")


def run_etmetal(binary: Path, pte: Path, inputs: list[torch.Tensor], work: Path) -> list[np.ndarray]:
    res = run_etmetal_raw(binary, pte, inputs, work)
    assert res.returncode == 0, f"etmetal run {pte.name} failed (exit {res.returncode}):\n{res.stderr}"
    return read_outputs(work)


def read_outputs(work: Path) -> list[np.ndarray]:
    """The outputs a `run_etmetal_raw` of `work` wrote."""
    out, outputs = work / "out", []
    while (out / f"output_{len(outputs)}.npy").exists():
        outputs.append(np.load(out / f"output_{len(outputs)}.npy"))
    return outputs


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dynamic")


PARAMS = [pytest.param(c.name, n, id=f"{c.name}-{n}") for c in CASES for n in c.sizes]


@pytest.mark.parametrize("name,n", PARAMS)
def test_cpu_pte_runs_in_executorch_at_each_size(name, n, etmetal, root):
    """ExecuTorch interop: one `.pte` of ours serves every size in the bound."""
    pte, _ = compiled(etmetal.binary, name, "cpu", root)
    inputs = inputs_at(CASES_BY_NAME[name], n)
    method = runtime().load_program(pte).load_method("forward")
    got = [to_npy(t) for t in method.execute(inputs)]
    check(f"{name} at {n} in ExecuTorch's runtime", got, eager(name, inputs))


@pytest.mark.parametrize("backend", ["cpu", "metal"])
@pytest.mark.parametrize("name,n", PARAMS)
def test_etmetal_runs_each_size(name, n, backend, etmetal, root):
    pte, summary = compiled(etmetal.binary, name, backend, root)
    case = CASES_BY_NAME[name]
    inputs = inputs_at(case, n)
    work = root / f"{name}-{backend}-{n}"
    if backend == "metal":
        # the dynamic nodes run on the GPU, at this size: only the listed ops stay on the CPU
        cpu_ops = set(re.findall(r"  cpu: `[^`]*` \(([a-z_0-9]+)\)", summary))
        assert cpu_ops == set(case.metal_cpu), summary
        res = run_etmetal_raw(etmetal.binary, pte, inputs, work)
        # on a GPU adapter, unless no node is left for it (a lone CPU op)
        delegated = re.search(r"EtMetalBackend: [1-9]\d* partition", summary) is not None
        ran = "ran on gpu" if delegated else "ran on cpu"
        assert res.returncode == 0 and ran in res.stdout + res.stderr, res.stdout + res.stderr
        got = read_outputs(work)
    else:
        got = run_etmetal(etmetal.binary, pte, inputs, work)
    check(f"{name} at {n}, --backend {backend}, etmetal run", got, eager(name, inputs))


@pytest.mark.parametrize("name", ["mlp_batch", "block_seq", "decoder_tokens"])
def test_executorch_made_pte_runs_in_etmetal(name, etmetal, root):
    """The other direction of the shared encoding: `to_executorch()`'s file."""
    _, ep = exported(name)
    pte = root / f"{name}.executorch.pte"
    pte.write_bytes(to_edge(ep).to_executorch().buffer)
    case = CASES_BY_NAME[name]
    for n in case.sizes:
        inputs = inputs_at(case, n)
        got = run_etmetal(etmetal.binary, pte, inputs, root / f"{name}-et-{n}")
        check(f"{name} at {n}, ExecuTorch's .pte, etmetal run", got, eager(name, inputs))


class StaticAndDynamic(nn.Module):
    """A linear over a dynamic batch and a static one (GPU, one delegate)
    and a mean over the dynamic batch (CPU: its divisor is the run-time size)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(x).relu()
        return h, torch.tanh(self.fc(y)), h.mean(0)


def test_metal_delegates_dynamic_nodes_and_keeps_dynamic_reductions_on_the_cpu(etmetal, root):
    m = StaticAndDynamic().eval()
    ex = (torch.randn(4, 8), torch.randn(3, 8))
    ep = torch.export.export(m, ex, dynamic_shapes=({0: Dim("rows", min=1, max=16)}, None))
    pt2, pte = root / "mixed.pt2", root / "mixed.pte"
    torch.export.save(ep, pt2)
    res = etm(etmetal.binary, "compile", str(pt2), "-o", str(pte), "--backend", "metal")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    cpu_lines = [ln for ln in out.splitlines() if "cpu:" in ln]
    # the one CPU node: the mean over the dynamic batch, named with its dim
    assert len(cpu_lines) == 1 and "reduce_mean reduces over dynamic dim `s" in cpu_lines[0], out
    inspect = etm(etmetal.binary, "inspect", str(pte))
    assert inspect.returncode == 0, inspect.stderr
    assert "1 delegate call(s)" in inspect.stdout, inspect.stdout
    for n in (1, 16, 5):
        inputs = [torch.randn(n, 8), torch.randn(3, 8)]
        got = run_etmetal(etmetal.binary, pte, inputs, root / f"mixed-{n}")
        with torch.no_grad():
            check(f"mixed at {n}", got, list(m(*inputs)))
    # outside the range: an error naming the method, the input and the dim
    bad = run_etmetal_raw(etmetal.binary, pte, [torch.randn(17, 8), torch.randn(3, 8)], root / "mixed-17")
    assert bad.returncode == 2 and "forward" in bad.stderr and "input 0" in bad.stderr, bad.stderr


class SizeArithmetic(nn.Module):
    """Two symbols and the size arithmetic torch.export writes for them:
    sums (cat), floordiv, sym_max, a derived size in zeros, padding, expand
    with -1, repeat."""

    def forward(self, x, y):
        n = x.shape[0]
        a = torch.cat([x, y], 0)
        return (
            a[: n // 2 + 3],
            x.reshape(-1),
            F.pad(x, (0, 0, 1, 2)),
            torch.zeros(n * 2 - 1),
            torch.ones(torch.sym_max(n, 5), 2),
            x[1:].expand(2, -1, -1),
            x.unsqueeze(0).repeat(2, 1, 1).sum(0),
        )


def test_size_arithmetic_of_two_symbols(etmetal, root):
    m = SizeArithmetic()
    dims = ({0: Dim("rows", min=3, max=16)}, {0: Dim("more", min=1, max=8)})
    ep = torch.export.export(m, (torch.randn(6, 4), torch.randn(3, 4)), dynamic_shapes=dims)
    pt2, pte = root / "arith.pt2", root / "arith.pte"
    torch.export.save(ep, pt2)
    res = etm(etmetal.binary, "compile", str(pt2), "-o", str(pte), "--backend", "cpu")
    assert res.returncode == 0, res.stderr
    method = runtime().load_program(pte).load_method("forward")
    for n, k in ((3, 1), (16, 8), (7, 3)):
        inputs = [torch.randn(n, 4), torch.randn(k, 4)]
        want = list(m(*inputs))
        check(f"size arithmetic at {n}, {k} in ExecuTorch", [to_npy(t) for t in method.execute(inputs)], want)
        got = run_etmetal(etmetal.binary, pte, inputs, root / f"arith-{n}-{k}")
        check(f"size arithmetic at {n}, {k}, etmetal run", got, want)


class SymbolicScalar(nn.Module):
    def forward(self, x):
        # SymInts used as tensor values (as a KV cache's fill counter adds
        # the sequence length), one whose range crosses zero
        return x * x.shape[0], x * (x.shape[0] - 4)


class SymbolicFloat(nn.Module):
    def forward(self, x):
        return x * (x.shape[0] / 2)  # a SymFloat


class CacheWrite(nn.Module):
    """A decoder's KV-cache write of a dynamic number of rows at run-time
    positions (`index_put_` and `index_copy_` into static buffers)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 32, 4))
        self.register_buffer("v", torch.zeros(1, 2, 32, 4))

    def forward(self, x, pos):
        torch.ops.aten.index_put_(self.k, [None, None, pos], x)
        self.v.index_copy_(2, pos, 2 * x)
        return self.k.sum(2) + self.v.sum(2), self.k[:, :, :8] - self.v[:, :, :8]


def export_dynamic(module, inputs, shapes, pt2: Path):
    torch.export.save(torch.export.export(module, inputs, dynamic_shapes=shapes), pt2)


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_symint_values_follow_the_size(backend, etmetal, root):
    pt2, pte = root / "symbolic_scalar.pt2", root / f"symbolic_scalar.{backend}.pte"
    export_dynamic(SymbolicScalar(), (torch.randn(4, 2),), ({0: Dim("n", min=1, max=8)},), pt2)
    res = etm(etmetal.binary, "compile", str(pt2), "-o", str(pte), "--backend", backend)
    assert res.returncode == 0, res.stderr
    for n in [1, 3, 8]:
        x = torch.randn(n, 2)
        got = run_etmetal(etmetal.binary, pte, [x], root / f"symbolic-{backend}-{n}")
        check(f"SymInt values at {n}, --backend {backend}", got, list(SymbolicScalar()(x)))


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_kv_cache_write_of_dynamic_rows(backend, etmetal, root):
    pt2, pte = root / "cache_write.pt2", root / f"cache_write.{backend}.pte"
    seq = Dim("seq", min=1, max=16)
    export_dynamic(CacheWrite(), (torch.randn(1, 2, 5, 4), torch.arange(5)), ({2: seq}, {0: seq}), pt2)
    res = etm(etmetal.binary, "compile", str(pt2), "-o", str(pte), "--backend", backend)
    assert res.returncode == 0, res.stderr
    for n, start in [(1, 0), (5, 3), (16, 16)]:
        inputs = [torch.randn(1, 2, n, 4), torch.arange(start, start + n)]
        got = run_etmetal(etmetal.binary, pte, inputs, root / f"cache-{backend}-{n}")
        # a fresh module: each `etmetal run` starts from the initial buffers
        check(f"cache write of {n} rows at {start}, --backend {backend}", got, list(CacheWrite()(*inputs)))


def test_unsupported_symbolic_use_names_the_node(etmetal, root):
    pt2 = root / "symbolic_float.pt2"
    export_dynamic(SymbolicFloat(), (torch.randn(4, 2),), ({0: Dim("n", min=1, max=8)},), pt2)
    res = etm(etmetal.binary, "compile", str(pt2), "-o", str(root / "x.pte"), "--backend", "cpu")
    assert res.returncode == 2, res.stderr
    assert "node `mul`" in res.stderr and "symbolic float" in res.stderr, res.stderr


def test_llm_dynamic_prefill_runs_on_the_gpu(etmetal, root):
    """transformers' recipe prefill of a tiny random Llama with a dynamic
    token count (`scripts/export_llm.py --dynamic-prefill`): one GPU
    partition (only the aranges and the ones of the length, made from no
    input, stay on the CPU), whose
    logits match eager and the `--backend cpu` program at 1, an odd and the
    largest count."""
    import copy
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import export_llm

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                         num_hidden_layers=2)
    wrapper = export_llm.recipe(LlamaForCausalLM(config).eval(), 32)
    pt2 = root / "llm_prefill.pt2"
    torch.export.save(export_llm.export_step(wrapper, 16, dynamic=True), pt2)
    ptes = {b: root / f"llm_prefill.{b}.pte" for b in ("metal", "cpu")}
    for backend, pte in ptes.items():
        res = etm(etmetal.binary, "compile", str(pt2), "-o", str(pte), "--backend", backend)
        assert res.returncode == 0, res.stderr
        if backend == "metal":
            cpu_ops = set(re.findall(r"  cpu: `[^`]*` \(([a-z_0-9]+)\)", res.stdout))
            assert "1 partition(s)" in res.stdout and cpu_ops == {"arange", "full"}, res.stdout
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 16):
        inputs = [torch.randint(0, 96, (1, n), generator=g), torch.arange(n)]
        with torch.no_grad():
            want = [copy.deepcopy(wrapper).model(input_ids=inputs[0], cache_position=inputs[1])]
        work = root / f"llm-metal-{n}"
        res = run_etmetal_raw(etmetal.binary, ptes["metal"], inputs, work)
        assert res.returncode == 0 and "ran on gpu" in res.stdout, res.stdout + res.stderr
        gpu = read_outputs(work)
        assert gpu[0].shape == (1, n, 96), gpu[0].shape
        scale = float(np.abs(to_npy(want[0])).max())
        err = np.abs(gpu[0] - to_npy(want[0])).max()
        assert err <= 1e-4 * scale, f"{n} tokens: GPU logits differ from eager by {err:.3g}"
        cpu = run_etmetal(etmetal.binary, ptes["cpu"], inputs, root / f"llm-cpu-{n}")
        err = np.abs(gpu[0] - cpu[0]).max()
        assert err <= 1e-4 * scale, f"{n} tokens: GPU logits differ from the CPU program's by {err:.3g}"
