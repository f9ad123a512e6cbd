"""etmetal benchmarks: GPU ops and models against PyTorch eager CUDA, the CPU
path against ExecuTorch's runtime, compile time, peak memory. BENCHMARKS.md
(README.md here says how) is written from the result JSON by `report`.

    python benchmarks/run.py prepare   # here (torch + executorch venv): .pt2/.pte files -> .bench/
    python benchmarks/run.py cpu       # here: CPU rows, compile time, memory -> results/cpu.json
    python3 benchmarks/run.py gpu      # GPU machine: ops + models vs PyTorch -> results/gpu.json
    python3 benchmarks/run.py report   # results/*.json -> BENCHMARKS.md (+ ratios.png with matplotlib)

Timing: each etmetal figure comes from `etmetal run --bench N --bench-json`
(median of N executes after warm-ups; per-kernel GPU time from timestamp
queries, the sum of every dispatch, median over N profiled executes).
PyTorch's GPU figure is its kernel time without launch overhead: the CUDA
kernels torch.profiler records over N calls, divided by N (CUDA events
around each call are kept as `torch_call_ms`); f32 runs with TF32 off.
Every figure is measured REPEAT (3) times, each a separate `etmetal run`
or profiler session: rows hold the median and `<field>_spread` [min, max].
Inputs are random (never zeros or ones).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "parity"))

WORK = REPO / ".bench"  # ignored: models, binary, scratch
RESULTS = HERE / "results"
# "int4": bf16 activations, weights compiled with `--quantize int4` (PyTorch
# runs the same product in bf16 with a float weight of the same shape)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int4": torch.bfloat16}
RUNS, WARMUP = 20, 5
# `gpu --portable-too`: op rows also measured with `--coop off`
PORTABLE_TOO = False
# `gpu --etmetal-only`: model rows without PyTorch's timings (its output
# is still the reference)
ETMETAL_ONLY = False
REPEAT = 3  # separate measurements of each figure: median and [min, max]
INT4_GROUP = 32
# HBM: the datasheet's 4.8 TB/s for ops' % of bandwidth; 4.3 TB/s (what a
# device-to-device copy reaches on the H200) for the decoder roofline, as
# the decode issue defines it
HBM_PEAK, HBM_ROOFLINE = 4.8e12, 4.3e12


# ---------------------------------------------------------------- the cases


class Mm(nn.Module):
    def forward(self, a, b):
        return torch.mm(a, b)


class Bmm(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


class Addmm(nn.Module):
    def forward(self, c, a, b):
        return torch.addmm(c, a, b)


class Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class LinearChain(nn.Module):
    """`n` dependent small linears: each its own dispatch (kernel launch),
    so the row's time over `n` is the fixed cost of one."""
    def __init__(self, n: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class CausalGqaSdpa(nn.Module):
    """A decoder's prefill attention: causal, query heads sharing kv heads."""
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def conv1d():
    # Whisper large-v3's first layer: 128 mel bins -> 1280 channels, k=3.
    return nn.Conv1d(128, 1280, 3, padding=1)


BMM_BATCH = 4


class OpCase(NamedTuple):
    """An op row: its module maker, input shapes, flop count and the fewest
    elements it moves (times the element size: its bytes), for `dtypes`;
    `memory_bound` rows report bandwidth, `int4_bytes` the bytes an int4
    row moves (its packed weight, scales and zeros, activations, output)."""
    make: Callable
    shapes: list
    flops: int
    elems: int
    dtypes: tuple = ("f32", "bf16")
    memory_bound: bool = False
    int4_bytes: int | None = None


def int4_linear_bytes(n: int, k: int, size=2) -> int:
    """Bytes of an int4 weight [n, k]: two codes a byte, a scale and a zero
    of the activation dtype per group of INT4_GROUP."""
    return n * k // 2 + 2 * n * (k // INT4_GROUP) * size


def op_cases() -> dict[str, OpCase]:
    cases = {}
    for s in (512, 1024, 4096):
        flops = 2 * s**3
        cases[f"mm_{s}"] = OpCase(Mm, [(s, s), (s, s)], flops, 3 * s * s)
        cases[f"addmm_{s}"] = OpCase(Addmm, [(s,), (s, s), (s, s)], flops, 3 * s * s + s)
        cases[f"bmm_{s}"] = OpCase(Bmm, [(BMM_BATCH, s, s)] * 2, BMM_BATCH * flops, BMM_BATCH * 3 * s * s)
    n, cin, length, cout, k = 10, 128, 3000, 1280, 3
    cases["conv1d_128to1280_10x3000"] = OpCase(
        conv1d, [(n, cin, length)], 2 * n * cout * length * cin * k,
        n * cin * length + cout * cin * k + n * cout * length)
    for name, q, kv in (("sdpa_1x20x1_kv1500", (1, 20, 1, 64), (1, 20, 1500, 64)),
                        ("sdpa_10x20x1500", (10, 20, 1500, 64), (10, 20, 1500, 64))):
        b, h, sq, d = q
        sk = kv[2]
        cases[name] = OpCase(Sdpa, [q, kv, kv], 4 * b * h * sq * sk * d, 2 * b * h * sq * d + 2 * b * h * sk * d,
                             memory_bound=sq == 1)
    # causal prefill, 32 query heads over 8 kv heads (Llama-3.2-1B's
    # attention): half the score matrix, so half the flops
    for t in (128, 2048):
        q, kv = (1, 32, t, 64), (1, 8, t, 64)
        cases[f"sdpa_causal_gqa_32x8x{t}"] = OpCase(
            CausalGqaSdpa, [q, kv, kv], 2 * 32 * t * t * 64, 2 * 32 * t * 64 + 2 * 8 * t * 64)
    # the fixed cost of a dispatch: a decode step is ~115 dependent ones
    chain, width = 128, 64
    cases[f"linear_chain_{chain}x{width}"] = OpCase(
        lambda: LinearChain(chain, width), [(1, width)], 2 * chain * width * width,
        chain * width * width + 2 * width, dtypes=("bf16",))
    # bf16 GEMV of a Llama-3.2-1B decode step (M = 1), K in, N out: q/k/v
    # merged, o, gate/up merged, down, the head; against cuBLAS's GEMV
    for k, n in ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)):
        cases[f"gemv_{k}x{n}"] = OpCase(
            lambda k=k, n=n: nn.Linear(k, n, bias=False), [(1, k)], 2 * k * n, k * n + k + n,
            dtypes=("bf16",), memory_bound=True)
    # int4 GEMV of decode (M = 1, bf16 activations): K in, N out, as the
    # int4 issue names them (4096x14336: Llama-3-8B's up-projection), and
    # the 1B step's gate/up and down without their prologues
    for k, n in ((4096, 4096), (4096, 14336), (2048, 16384), (8192, 2048)):
        cases[f"int4_gemv_{k}x{n}"] = OpCase(
            lambda k=k, n=n: nn.Linear(k, n, bias=False), [(1, k)], 2 * k * n, k * n + k + n,
            dtypes=("int4",), memory_bound=True, int4_bytes=int4_linear_bytes(n, k) + 2 * (k + n))
    return cases


def user_llama1b() -> nn.Module:
    """The decode issue's Llama-3.2-1B shape as a user writes it without
    transformers (tests/parity/models/decoders.py: the KV cache in
    registered buffers of LLAMA_CACHE positions written with
    `index_copy_`, GQA through `repeat_interleave`, a boolean mask over the
    cache), weights scaled as `full_decoder` does."""
    from models.decoders import Decoder

    c = LLAMA_1B
    m = Decoder(llama=True, vocab=c["vocab_size"], dim=c["hidden_size"], heads=c["num_attention_heads"],
                kv_heads=c["num_key_value_heads"], layers=c["num_hidden_layers"], max_len=LLAMA_CACHE,
                hidden=c["intermediate_size"])
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.0 / max(1, p.shape[-1] // 8) ** 0.5)
    return m


def vit_b16() -> nn.Module:
    """torchvision's own ViT-B/16 (random weights: the GPU machine has no
    network), its classifier drawn like the rest: torchvision starts it at
    zeros, which would leave nothing in the logits to compare."""
    from torchvision.models import vit_b_16

    model = vit_b_16()
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def full_decoder(llama: bool) -> nn.Module:
    """The KV-cache decoders of tests/parity/models/decoders.py at full size:
    Llama-style 1024 wide, 8 layers, GQA 16/4 heads, 32k vocabulary; GPT-2
    small's shape (768 wide, 12 layers, 12 heads, 50257 tokens). Weights
    scaled as the parity suite's `decoder()` does, so logits stay O(1)."""
    from models.decoders import Decoder

    if llama:
        m = Decoder(llama=True, vocab=32000, dim=1024, heads=16, kv_heads=4, layers=8, max_len=DECODE_LEN)
    else:
        m = Decoder(llama=False, vocab=50257, dim=768, heads=12, layers=12, max_len=DECODE_LEN)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.0 / max(1, p.shape[-1] // 8) ** 0.5)
    return m


PREFILL, DECODE_LEN = 128, 256

# The Llama-3.2-1B shape of the decode issue (16 layers, hidden 2048, 32/8
# heads of 64, MLP 8192, vocabulary 128256; the LM head untied, as in the
# issue's 2858 MiB), random weights, through transformers' ExecuTorch
# recipe (a static KV cache in buffers): a decode step at position 512 and
# a 512-token prefill.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                tie_word_embeddings=False)
LLAMA_CTX, LLAMA_CACHE = 512, 1024

# A Qwen3-MoE-shaped decoder (the decode issue's MoE row): Qwen3-30B-A3B's
# layer (hidden 2048, 32 query / 4 KV heads of 128 with per-head q and k
# RMSNorms, every layer's MLP a sparse block of experts of 768 behind a
# softmax top-k router whose top-k weights are renormalised, rope theta
# 1e6) and its untied head over Qwen3's 151936 tokens, with 8 experts
# routed top-2 (the 30B has 128, top-8) and 6 of its 48 layers. Why 6:
# the embedding and the head alone are 1.24 GB in bf16 and a layer 113 MB
# (of which 76 MB experts), so 6 layers keep the model under 2 GB (1.92 GB,
# less than LLAMA_1B's 3.0 GB: quick to make, export and compile on the GPU
# machine inside one device call), while a step's layers (attention,
# router, 2 experts) still read a third of its bytes beside the head. Random weights through the
# same recipe as LLAMA_1B: one decode step at LLAMA_CTX, LLAMA_CACHE
# positions.
QWEN3_MOE = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=6, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1000000.0,
                 tie_word_embeddings=False)


class Step(nn.Module):
    """A decoder step with positional inputs (tokens, positions), for export."""

    def __init__(self, module):
        super().__init__()
        self.m = module

    def forward(self, tokens, positions):
        return self.m(input_ids=tokens, cache_position=positions)


def recipe_decoder(arch: str, device="cpu", **config) -> nn.Module:
    """A random transformers decoder (`arch`: "Llama" or "Qwen3Moe", its
    `{arch}ForCausalLM` of `{arch}Config(**config)`) in bf16 behind
    transformers' static-cache recipe (scripts/export_llm.py) of
    LLAMA_CACHE positions. The cache takes the model's dtype and device
    when the recipe is made, and `.to(device)` does not move it afterwards,
    so the model is moved first (PyTorch 2.11 failed in `index_copy_` on a
    cache left on the CPU)."""
    import transformers

    sys.path.insert(0, str(REPO / "scripts"))
    from export_llm import recipe

    config = getattr(transformers, f"{arch}Config")(**config)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.bfloat16).eval().to(device)
    return Step(recipe(model, LLAMA_CACHE).model)


def llama(device="cpu", **config) -> nn.Module:
    """A random transformers Llama of `config` (LLAMA_1B's keys), see `recipe_decoder`."""
    return recipe_decoder("Llama", device, **config)


def qwen3_moe(device="cpu", **config) -> nn.Module:
    """A random transformers Qwen3-MoE of `config` (QWEN3_MOE's keys), see `recipe_decoder`."""
    return recipe_decoder("Qwen3Moe", device, **config)


def decoder_roofline_bytes(config: dict, dtype: str, ctx: int, qk_norm: bool = False) -> dict:
    """Bytes one decode step at position `ctx` must read: the weights it
    uses and the K and V cache of the `ctx + 1` positions. Weights: each
    layer's attention (q, k, v, o), its MLP, its two norms (`qk_norm`: and
    the per-head q and k norms of Qwen3), the final norm, one embedding row
    and the head. An MoE config (`num_experts` in it, every layer sparse as
    in QWEN3_MOE) reads its router and only the `num_experts_per_tok`
    experts it routes to (the rest of `num_experts` stay unread), a dense
    one its MLP. int4: each linear's and each routed expert's packed
    weight, scales and zeros (`--quantize int4` takes the experts' stacked
    weights too, read by `gather_qmv`)."""
    c = config
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    # (n, k): n outputs over k inputs
    linears = [(q, h), (kv, h), (kv, h), (h, q)]
    experts = []
    if "num_experts" in c:
        i = c["moe_intermediate_size"]
        linears.append((c["num_experts"], h))  # the router
        experts = [(i, h), (i, h), (h, i)] * c["num_experts_per_tok"]  # gate, up, down of each active expert
    else:
        i = c["intermediate_size"]
        linears += [(i, h), (i, h), (h, i)]
    linears = linears * layers + [(c["vocab_size"], h)]
    experts = experts * layers
    size = 4 if dtype == "f32" else 2
    if dtype == "int4":
        weights = sum(int4_linear_bytes(n, k) for n, k in linears + experts)
    else:
        weights = sum(n * k for n, k in linears + experts) * size
    norms = ((2 * layers + 1) * h + (2 * layers * hd if qk_norm else 0)) * size
    cache = 2 * layers * kv * (ctx + 1) * size
    return {"weights": weights + norms + h * size, "kv_cache": cache}


class ModelCase(NamedTuple):
    """A model row: its maker, its input maker(generator), the dtypes it
    runs in, whether the CPU step runs it, and for a decode step the
    config and position its roofline counts, and for Qwen3 the per-head
    q/k norms (`decoder_roofline_bytes`'s arguments after the dtype);
    `recipe`: see `export_save`."""
    make: Callable
    inputs: Callable
    dtypes: tuple = ("f32", "bf16")
    cpu: bool = True
    roofline: tuple | None = None
    recipe: bool = False


def model_cases() -> dict[str, ModelCase]:
    """The real-models zoo (tests/parity/models/) and torchvision's ViT-B/16 at the issue's full sizes,
    batch 1. Decoders run twice: a prefill of 128 tokens and one decode step
    at position 128; the Llama-3.2-1B shape in bf16 and int4 (GPU only),
    and a Qwen3-MoE-shaped decode step and prefill (QWEN3_MOE) in bf16 and int4 (GPU only)."""
    from models.audio import whisper_tiny
    from models.cnn import MobileNetV2, ResNet
    from models.encoders import bert_base, bert_inputs

    image = lambda g: (torch.randn(1, 3, 224, 224, generator=g),)  # noqa: E731
    tokens = lambda vocab, n, first: lambda g: (  # noqa: E731
        torch.randint(0, vocab, (1, n), generator=g), torch.arange(first, first + n))
    vocab = LLAMA_1B["vocab_size"]
    return {
        "resnet18": ModelCase(ResNet, image),
        "mobilenet_v2": ModelCase(MobileNetV2, image),
        "bert_base": ModelCase(bert_base, lambda g: bert_inputs(g, batch=1, vocab=30522)),
        "whisper_tiny_encoder": ModelCase(whisper_tiny, lambda g: (torch.randn(1, 80, 3000, generator=g),)),
        "vit_b16": ModelCase(vit_b16, image),
        "llama_prefill128": ModelCase(lambda: full_decoder(True), tokens(32000, PREFILL, 0)),
        "llama_decode": ModelCase(lambda: full_decoder(True), tokens(32000, 1, PREFILL)),
        "gpt_prefill128": ModelCase(lambda: full_decoder(False), tokens(50257, PREFILL, 0)),
        "gpt_decode": ModelCase(lambda: full_decoder(False), tokens(50257, 1, PREFILL)),
        "llama1b_decode512": ModelCase(lambda device="cpu": llama(device, **LLAMA_1B), tokens(vocab, 1, LLAMA_CTX),
                                       dtypes=("bf16", "int4"), cpu=False, roofline=(LLAMA_1B, LLAMA_CTX),
                                       recipe=True),
        "llama1b_user_decode512": ModelCase(user_llama1b, tokens(vocab, 1, LLAMA_CTX),
                                            dtypes=("bf16", "int4", "f32"), cpu=False,
                                            roofline=(LLAMA_1B, LLAMA_CTX)),
        "llama1b_prefill512": ModelCase(lambda device="cpu": llama(device, **LLAMA_1B), tokens(vocab, LLAMA_CTX, 0),
                                        dtypes=("bf16", "int4"), cpu=False, recipe=True),
        "qwen3moe_decode512": ModelCase(lambda device="cpu": qwen3_moe(device, **QWEN3_MOE),
                                        tokens(QWEN3_MOE["vocab_size"], 1, LLAMA_CTX), dtypes=("bf16", "int4"),
                                        cpu=False, roofline=(QWEN3_MOE, LLAMA_CTX, True), recipe=True),
        # the same model's 512-token prefill: every expert's rows at once
        # (the grouped matmul's dense form; int4 experts as gather_qmv rows)
        "qwen3moe_prefill512": ModelCase(lambda device="cpu": qwen3_moe(device, **QWEN3_MOE),
                                         tokens(QWEN3_MOE["vocab_size"], LLAMA_CTX, 0), dtypes=("bf16", "int4"),
                                         cpu=False, recipe=True),
    }


def seed_of(name: str) -> int:
    return sum(name.encode()) * 7919


def make_model(name: str, dtype: str, device="cpu"):
    """Module (eval, weights from the name's seed) and its inputs, both in
    `dtype` where floating; a recipe's module is made on `device` (its
    cache cannot be moved afterwards), the others on the CPU."""
    case = model_cases()[name]
    torch.manual_seed(seed_of(name))
    module = (case.make(device=device) if case.recipe else case.make()).eval()
    xs = case.inputs(torch.Generator().manual_seed(seed_of(name) + 1))
    if DTYPES[dtype] == torch.bfloat16:
        module = module.to(torch.bfloat16)
        xs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in xs)
    return module, xs


def make_op(name: str, dtype: str, device="cpu", seed=0):
    case = op_cases()[name]
    torch.manual_seed(seed_of(name))
    module = case.make().eval().to(device=device, dtype=DTYPES[dtype])
    g = torch.Generator(device=device).manual_seed(seed)
    xs = tuple(torch.randn(s, generator=g, device=device).to(DTYPES[dtype]) for s in case.shapes)
    return module, xs


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def quant_flags(dtype: str) -> list:
    return ["--quantize", "int4", "--group-size", INT4_GROUP] if dtype == "int4" else []


# ------------------------------------------------------------- helpers


def binary() -> Path:
    b = os.environ.get("ETMETAL_BIN")
    return Path(b) if b else WORK / "etmetal"


def sh(cmd: list, env=None, timeout=600) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"$ {' '.join(map(str, cmd))}\nexit {r.returncode}\n{r.stderr}{r.stdout}")
    return r


def to_npy(t: torch.Tensor) -> np.ndarray:
    """NumPy has no bf16: bf16 goes as float32 (exact); etmetal rounds it back."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()


def write_inputs(xs, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, x in enumerate(xs):
        p = folder / f"input_{i}.npy"
        np.save(p, to_npy(x))
        paths.append(p)
    return paths


def etmetal_bench(pte: Path, inputs: list[Path], device: str, runs=RUNS, warmup=WARMUP, env=None,
                  coop="auto") -> dict:
    """`etmetal run --bench` of `pte`: its JSON plus the first output.
    `coop`: `--coop` (auto: tensor cores where the GPU offers them)."""
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "bench.json"
        cmd = [binary(), "run", pte, "--device", device, "--output-dir", d,
               "--bench", runs, "--warmup", warmup, "--bench-json", js, "--trace"]
        if device != "cpu":
            cmd += ["--coop", coop]
        if inputs:
            cmd += ["--inputs", ",".join(map(str, inputs))]
        r = sh(cmd, env=env)
        out = json.loads(js.read_text())
        out["stderr"] = r.stderr.strip()
        out["trace"] = last_trace(r.stderr)
        out["output_0"] = np.load(Path(d) / "output_0.npy")
        return out


def last_trace(stderr: str) -> list[str]:
    """The host trace of the last traced execute (`run --trace` traces the
    first and one after the timed ones): its lines, each execute's opening
    with the inputs written into planned memory."""
    blocks = []
    for line in stderr.splitlines():
        if not line.startswith("trace:"):
            continue
        if "inputs into planned memory" in line or not blocks:
            blocks.append([])
        blocks[-1].append(line[len("trace:"):].rstrip())
    return blocks[-1] if blocks else []


def rel_err(got, want: torch.Tensor) -> float:
    got = torch.as_tensor(np.asarray(got), dtype=torch.float64)
    want = want.detach().double().cpu().reshape(got.shape)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def repeated(measure: Callable[[], dict], times=REPEAT) -> dict:
    """`measure()` (a dict of figures; None where it has none) `times`
    times: each figure's median, and `<figure>_spread` [min, max] where
    every measurement has it; other entries from the first measurement."""
    runs = [measure() for _ in range(times)]
    out = dict(runs[0])
    for key, v in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(v, float) and all(isinstance(x, float) for x in values):
            out[key] = median(values)
            out[f"{key}_spread"] = [min(values), max(values)]
    return out


def torch_kernel_ms(fn, runs=RUNS * 5, warmup=WARMUP * 2) -> float:
    """PyTorch's GPU time of `fn` without launch overhead: the device time
    of the CUDA kernels (and copies) torch.profiler records over `runs`
    calls, per call."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    us = 0.0
    for e in prof.key_averages():
        us += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return us / 1e3 / runs


def cuda_time_ms(fn, runs=RUNS * 5, warmup=WARMUP * 2) -> float:
    """Median of CUDA-event times around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return median(times)


def runs_for(first_ms: float, budget_ms=20_000) -> tuple[int, int]:
    """Timed runs and warm-ups for a case whose first run took `first_ms`:
    the usual counts, fewer where they would take over `budget_ms`."""
    runs = max(3, min(RUNS, int(budget_ms / max(first_ms, 1e-3))))
    return runs, min(WARMUP, max(1, runs // 4))


def wall_times_ms(fn, runs=RUNS, warmup=WARMUP) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def wall_time_ms(fn, runs=RUNS, warmup=WARMUP) -> float:
    return median(wall_times_ms(fn, runs, warmup))


# ------------------------------------------------------------- prepare (here)


def export_save(module, xs, path: Path, recipe=False):
    """`torch.export.export` as users call it, then `run_decompositions({})`,
    which turns in-place buffer updates (the decoders' KV caches) into buffer
    mutations as ExecuTorch's `to_edge` does; no op is decomposed. `recipe`:
    as transformers' ExecuTorch recipe exports (strict, no decompositions:
    the importer functionalizes the cache writes itself)."""
    if recipe:
        ep = torch.export.export(copy.deepcopy(module), xs, strict=True)
    else:
        ep = torch.export.export(copy.deepcopy(module), xs).run_decompositions({})
    torch.export.save(ep, str(path))
    return ep


SUMMARY = re.compile(r"EtMetalBackend: (\d+) partition\(s\), (\d+) node\(s\), (\d+) kernel\(s\); (\d+) node\(s\) on the cpu")


def compile_for_gpu(pt2: Path, pte: Path, dtype: str = "f32") -> dict:
    """`etmetal compile` for the H200 (tensors up to 2 GiB on the GPU; int4
    rows quantized): seconds and the delegation summary."""
    t = time.perf_counter()
    r = sh([binary(), "compile", pt2, "-o", pte, "--max-buffer", "2G", *quant_flags(dtype)])
    secs = time.perf_counter() - t
    m = SUMMARY.search(r.stdout)
    parts, nodes, kernels, cpu = (int(x) for x in m.groups()) if m else (0, 0, 0, -1)
    return {"compile_s": secs, "partitions": parts, "delegated_nodes": nodes, "kernels": kernels, "cpu_nodes": cpu}


def prepare(args):
    """Export every op (.pt2) and compile it for the GPU (.pte); export the
    f32 models for the CPU rows (`--only`: the cases whose names start so)."""
    _, wanted = resumed(args)
    (WORK / "ops").mkdir(parents=True, exist_ok=True)
    (WORK / "models").mkdir(parents=True, exist_ok=True)
    for name, case in op_cases().items():
        for dt in case.dtypes if wanted(name) else ():
            # Shapes only matter to export; the GPU run draws its own inputs.
            module, xs = make_op(name, dt)
            pt2 = WORK / "ops" / f"{name}.{dt}.pt2"
            export_save(module, xs, pt2)
            compile_for_gpu(pt2, pt2.with_suffix(".pte"), dt)
            pt2.unlink()  # the GPU machine needs the .pte only
            print(f"compiled {pt2.with_suffix('.pte')}", flush=True)
    # Models are exported where they run: full-size .pte files are too big
    # to carry to the GPU machine. The CPU rows take these f32 exports.
    (WORK / "pt2").mkdir(exist_ok=True)
    for name, case in model_cases().items():
        if case.cpu and wanted(name):
            module, xs = make_model(name, "f32")
            export_save(module, xs, WORK / "pt2" / f"{name}.f32.pt2")
            print(f"exported {name}", flush=True)
    print(f"prepared {WORK}")


# ------------------------------------------------------------- cpu (here)


def cpu_info() -> dict:
    model = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                  if l.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__}


def et_lower(pt2: Path, xnnpack: bool) -> tuple[bytes, float]:
    """ExecuTorch's lowering of `pt2` (portable kernels or XNNPACK): the .pte bytes and seconds taken."""
    from executorch.exir import to_edge, to_edge_transform_and_lower

    t = time.perf_counter()
    ep = torch.export.load(str(pt2))
    # no autograd: the lowering passes run the buffer write-backs (`copy_`) eagerly
    with torch.no_grad():
        if xnnpack:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            prog = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
        else:
            prog = to_edge(ep).to_executorch()
    return prog.buffer, time.perf_counter() - t


def et_bench(pte_bytes: bytes, xs) -> tuple[list[float], torch.Tensor]:
    """ExecuTorch's runtime on `pte_bytes`: the timed runs' ms and the output."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte_bytes)  # kept alive while the method runs
    method = program.load_method("forward")
    run = lambda: method.execute(list(xs))  # noqa: E731
    t = time.perf_counter()
    out = run()[0]
    return wall_times_ms(run, *runs_for((time.perf_counter() - t) * 1e3)), out


def spread_of(key: str, times: list[float]) -> dict:
    """`key`: the median of `times`, `key_spread`: [min, max]."""
    return {key: median(times), f"{key}_spread": [min(times), max(times)]}


def resumed(args) -> tuple[dict, callable]:
    """Rows of an earlier, interrupted run (`--resume`: its log of JSON
    lines) by (case, dtype), and whether `--only` asks for a case."""
    done = {}
    for line in Path(args.resume).read_text().splitlines() if args.resume else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[(row.get("op") or row.get("model"), row.get("dtype", "f32"))] = row
    return done, lambda name: not args.only or any(name.startswith(p) for p in args.only.split(","))


def cpu(args):
    threads = os.cpu_count()
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    rows = []
    done, wanted = resumed(args)
    for name, case in model_cases().items():
        if (name, "f32") in done or not wanted(name) or not case.cpu:
            rows.extend([done[name, "f32"]] if (name, "f32") in done else [])
            continue
        module, xs = make_model(name, "f32")
        pt2 = WORK / "pt2" / f"{name}.f32.pt2"
        with torch.no_grad():
            want = as_tuple(module(*xs))[0]
        row = {"model": name, "weight_bytes": weight_bytes(module)}
        # compile time, REPEAT times: etmetal (both backends) vs ExecuTorch
        # lowerings of the same .pt2 (the report pairs cpu with XNNPACK)
        cpu_pte = WORK / "models" / f"{name}.cpu.pte"
        for backend in ("cpu", "metal"):
            secs = []
            for _ in range(REPEAT):
                t = time.perf_counter()
                sh([binary(), "compile", pt2, "-o", cpu_pte if backend == "cpu" else WORK / "scratch.pte",
                    "--backend", backend], env=env)
                secs.append(time.perf_counter() - t)
            row.update(spread_of(f"compile_s_etmetal_{backend}", secs))
        inputs = write_inputs(xs, WORK / "inputs" / name)
        first = etmetal_bench(cpu_pte, inputs, "cpu", runs=1, warmup=0, env=env)["latency_ms"]["median"]
        runs, warmup = runs_for(first)
        b = etmetal_bench(cpu_pte, inputs, "cpu", runs=runs, warmup=warmup, env=env)
        row.update(runs=runs, **spread_of("etmetal_ms", b["times_ms"]), etmetal_err=rel_err(b["output_0"], want),
                   peak_rss_after_load=b["peak_rss_after_load_bytes"], peak_rss=b["peak_rss_bytes"])
        for kind, xnn in (("portable", False), ("xnnpack", True)):
            try:
                lowered = [et_lower(pt2, xnn) for _ in range(REPEAT)]
                row.update(spread_of(f"compile_s_et_{kind}", [secs for _, secs in lowered]))
                times, got = et_bench(lowered[0][0], xs)
                row.update(spread_of(f"et_{kind}_ms", times))
                row[f"et_{kind}_err"] = rel_err(got.numpy(), want)
            except Exception as e:  # a lowering or runtime refusal is a row, not a crash
                row[f"et_{kind}_error"] = f"{type(e).__name__}: {e}"[:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu.json").write_text(json.dumps({"machine": cpu_info(), "threads": threads, "runs": RUNS,
                                                  "warmup": WARMUP, "repeat": REPEAT, "models": rows},
                                                 indent=1) + "\n")


# ------------------------------------------------------------- gpu (H200)


def gpu_info() -> dict:
    p = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return {"gpu": p.name, "sms": p.multi_processor_count, "nvidia_smi": smi, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpu": cpu_info()["cpu"], "cores": os.cpu_count()}


def etmetal_repeated(pte: Path, inputs: list[Path], **bench) -> tuple[dict, dict]:
    """`etmetal run --bench` of `pte` REPEAT times: the kernel and end-to-end
    figures (median, spread) and the first run's JSON."""
    first = []

    def measure():
        b = etmetal_bench(pte, inputs, "auto", **bench)
        first.append(b)
        return {"etmetal_kernel_ms": (b.get("gpu") or {}).get("total_ms_median"),
                "etmetal_e2e_ms": b["latency_ms"]["median"]}

    figures = repeated(measure)
    return figures, first[0]


def gpu_op(name: str, dt: str, scratch: Path) -> dict:
    case = op_cases()[name]
    module, xs = make_op(name, dt, device="cuda", seed=1)
    with torch.no_grad():
        torch_figures = repeated(lambda: {"torch_ms": torch_kernel_ms(lambda: module(*xs)),
                                          "torch_call_ms": cuda_time_ms(lambda: module(*xs))})
        # reference in f64 from the same (rounded) inputs; int4 rows: the
        # float weight's product, so err includes the quantization
        ref = module.double()(*(x.double() for x in xs)) if dt == "f32" else \
            module.float()(*(x.float() for x in xs))
    size = DTYPES[dt].itemsize
    moved = case.int4_bytes if dt == "int4" else case.elems * size
    # Above 64 MiB of operands an execute spends most of its time converting
    # and copying on the host (see the e2e column): fewer runs keep the whole
    # harness inside one device call.
    big = moved > 64 << 20
    pte, inputs = WORK / "ops" / f"{name}.{dt}.pte", write_inputs(xs, scratch / name)
    bench = dict(runs=5 if big else RUNS, warmup=2 if big else WARMUP)
    figures, b = etmetal_repeated(pte, inputs, **bench)
    if PORTABLE_TOO:
        # the same file with every kernel in its portable form
        portable, _ = etmetal_repeated(pte, inputs, coop="off", **bench)
        figures.update({f"{k}_portable": v for k, v in portable.items()})
    gpu = b.get("gpu") or {}
    return {"op": name, "dtype": dt, "flops": case.flops, "bytes": moved, "torch_bytes": case.elems * size,
            "bound": "memory" if case.memory_bound else "compute", **torch_figures, **figures,
            "dispatches": len(gpu.get("dispatches", [])), "gpu_timing": gpu.get("unavailable"),
            "err": rel_err(b["output_0"], ref), "adapter": b["device"]}


def torch_compiled_ms(m, xs, host_xs) -> dict:
    """`torch.compile` (default mode) of `m`: the first call's seconds
    (compilation), its kernel time on the GPU inputs `xs` and its end to
    end from the host inputs `host_xs` (inputs up, run, outputs down, as
    eager's end to end; REPEAT sessions each)."""
    try:
        cm = torch.compile(m)
        t = time.perf_counter()
        cm(*xs)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        e2e = lambda: [o.cpu() for o in as_tuple(cm(*(x.cuda() for x in host_xs)))]  # noqa: E731
        return {**repeated(lambda: {"torch_compile_ms": torch_kernel_ms(lambda: cm(*xs)),
                                    "torch_compile_e2e_ms": wall_time_ms(e2e)}),
                "torch_compile_first_s": first}
    except Exception as e:  # a compile failure is a figure, not a crash
        return {"torch_compile_error": f"{type(e).__name__}: {e}"[:300]}


def torch_side(name: str, dt: str, scratch: Path, shared: dict) -> dict:
    """A model row's export and PyTorch figures. int4 rows run PyTorch on
    the bf16 model, so a model's bf16 and int4 rows share both (`shared`
    keeps the last model's: the export, and PyTorch's eager, end-to-end
    and torch.compile figures)."""
    key = (name, DTYPES[dt])
    if key in shared:
        return shared[key]
    for old in shared.values():
        old["pt2"].unlink(missing_ok=True)
    shared.clear()
    case = model_cases()[name]
    module, xs = make_model(name, dt)
    pt2 = scratch / f"{name}.{dt}.pt2"
    export_save(module, xs, pt2, case.recipe)
    cuda_xs = tuple(x.cuda() for x in xs)
    # (a recipe's cache stays where it was made: the same seed, made on the GPU)
    m = make_model(name, dt, "cuda")[0] if case.recipe else module.cuda()
    with torch.no_grad():
        # decoders write the same cache slot every call, so outputs repeat
        want = as_tuple(m(*cuda_xs))[0]
        # what a caller sees: inputs up, run, outputs down
        e2e = lambda: [o.cpu() for o in as_tuple(m(*(x.cuda() for x in xs)))]  # noqa: E731
        torch_figures, compiled_torch = {}, {}
        if not ETMETAL_ONLY:
            torch_figures = repeated(lambda: {"torch_ms": torch_kernel_ms(lambda: m(*cuda_xs), RUNS, WARMUP),
                                              "torch_e2e_ms": wall_time_ms(e2e)})
            compiled_torch = torch_compiled_ms(copy.deepcopy(m), cuda_xs, xs)
    shared[key] = {"pt2": pt2, "xs": xs, "want": want, "weight_bytes": weight_bytes(module),
                   "figures": {**torch_figures, **compiled_torch}}
    return shared[key]


def gpu_model(name: str, dt: str, scratch: Path, shared: dict) -> dict:
    case = model_cases()[name]
    side = torch_side(name, dt, scratch, shared)
    xs, want = side["xs"], side["want"]
    pte = scratch / f"{name}.{dt}.pte"
    compiled = compile_for_gpu(side["pt2"], pte, dt)
    figures, b = etmetal_repeated(pte, write_inputs(xs, scratch / name))
    pte.unlink()
    gpu = b.get("gpu") or {}
    top = sorted(gpu.get("dispatches", []), key=lambda k: -k["median_ms"])[:3]
    roofline, breakdown = None, None
    if case.roofline:
        config, ctx, *qk_norm = case.roofline
        roofline = decoder_roofline_bytes(config, dt, ctx, *qk_norm)
        if "num_experts" in config:  # its weights count the routed experts only: [routed, of all]
            roofline["active_experts"] = [config["num_experts_per_tok"], config["num_experts"]]
        # the decode issue asks for one step's per-kernel breakdown
        breakdown = [{"kernel": k["kernel"], "ms": k["median_ms"]} for k in gpu.get("dispatches", [])]
    return {"model": name, "dtype": dt, "weight_bytes": side["weight_bytes"], **side["figures"],
            **compiled, **figures, "roofline_bytes": roofline,
            "dispatches": len(gpu.get("dispatches", [])),
            "top_kernels": [{"kernel": k["kernel"], "ms": k["median_ms"], "share": k["share"]} for k in top],
            **({"dispatch_ms": breakdown} if breakdown else {}),
            "peak_rss": b["peak_rss_bytes"], "peak_rss_after_load": b["peak_rss_after_load_bytes"],
            "host_trace": b["trace"],
            "err": rel_err(b["output_0"], want)}


# Bounded dynamic shapes (issue 19): one program compiled for a range of
# sizes against a static program compiled for the size it runs at. A
# Llama-shaped prefill (LLAMA_1B's widths, DYN_LLAMA_LAYERS layers, bf16,
# transformers' static-cache recipe with a cache of the bound) with a dynamic
# sequence length up to 2048, run at 64, 512 and 2048 tokens; ResNet-18 (f32)
# with a dynamic batch up to 8, run at 1 and 8.
DYN_LLAMA_LAYERS = 4
DYN_PREFILL_BOUND, DYN_PREFILL_SIZES = 2048, (64, 512, 2048)
DYN_BATCH_BOUND, DYN_BATCH_SIZES = 8, (1, 8)


def dyn_llama():
    """The recipe wrapper of the Llama-shaped model and its export at
    `n` tokens (`dynamic`: 1 to `n`), both as `scripts/export_llm.py` does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "scripts"))
    from export_llm import export_step, recipe

    torch.manual_seed(seed_of("dyn_llama_prefill"))
    config = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": DYN_LLAMA_LAYERS})
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    wrapper = recipe(model, DYN_PREFILL_BOUND)
    return lambda n, dynamic=False: export_step(wrapper, n, dynamic=dynamic)


def dyn_resnet():
    """ResNet-18 (f32) and its export at batch `n` (`dynamic`: 1 to `n`)."""
    from models.cnn import ResNet

    torch.manual_seed(seed_of("dyn_resnet18"))
    m = ResNet().eval()

    def export(n, dynamic=False):
        x = torch.randn(max(n // 2, 2) if dynamic else n, 3, 224, 224)
        shapes = ({0: torch.export.Dim("batch", min=1, max=n)},) if dynamic else None
        return torch.export.export(m, (x,), dynamic_shapes=shapes)

    return export


def dyn_cases() -> dict:
    """name -> (exporter maker, bound, sizes, inputs at a size)."""
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    tokens = lambda n: (torch.randint(0, LLAMA_1B["vocab_size"], (1, n), generator=g()),  # noqa: E731
                        torch.arange(n))
    images = lambda n: (torch.randn(n, 3, 224, 224, generator=g()),)  # noqa: E731
    return {
        "dyn_llama_prefill": (dyn_llama, DYN_PREFILL_BOUND, DYN_PREFILL_SIZES, tokens),
        "dyn_resnet18": (dyn_resnet, DYN_BATCH_BOUND, DYN_BATCH_SIZES, images),
    }


def gpu_dynamic(name: str, scratch: Path) -> list[dict]:
    """Rows of one dynamic case: at each size, etmetal's kernel and e2e
    time of the dynamic program (compiled once, bound `bound`) and of a
    static program compiled for that size, their ratios (dynamic / static;
    the issue asks for at most 1.1), and how far the two outputs differ."""
    make, bound, sizes, inputs = dyn_cases()[name]
    export = make()

    def compiled(tag: str, ep) -> tuple[Path, dict]:
        pt2, pte = scratch / f"{name}.{tag}.pt2", scratch / f"{name}.{tag}.pte"
        torch.export.save(ep, str(pt2))
        info = compile_for_gpu(pt2, pte)
        pt2.unlink()
        return pte, info

    dyn_pte, dyn_info = compiled("dynamic", export(bound, dynamic=True))
    rows = []
    for n in sizes:
        xs = write_inputs(inputs(n), scratch / f"{name}-{n}")
        static_pte, static_info = compiled(f"static{n}", export(n))
        static, sb = etmetal_repeated(static_pte, xs)
        dynamic, db = etmetal_repeated(dyn_pte, xs)
        static_pte.unlink()
        ratio = lambda k: (dynamic[k] / static[k]) if dynamic.get(k) and static.get(k) else None  # noqa: E731
        rows.append({
            "model": name, "size": n, "bound": bound,
            **{f"static_{k}": v for k, v in static.items()}, **{f"dynamic_{k}": v for k, v in dynamic.items()},
            "kernel_ratio": ratio("etmetal_kernel_ms"), "e2e_ratio": ratio("etmetal_e2e_ms"),
            "static_compile": static_info, "dynamic_compile": dyn_info,
            "static_dispatches": len((sb.get("gpu") or {}).get("dispatches", [])),
            "dynamic_dispatches": len((db.get("gpu") or {}).get("dispatches", [])),
            "dynamic_vs_static_err": rel_err(db["output_0"], torch.from_numpy(sb["output_0"])),
            "adapter": db["device"],
        })
        print(json.dumps(rows[-1]), flush=True)
    dyn_pte.unlink()
    return rows


def gpu(args):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ops, models, shared = [], [], {}
    done, wanted = resumed(args)
    with tempfile.TemporaryDirectory() as d:
        for name, case in op_cases().items():
            for dt in case.dtypes:
                if (name, dt) in done or not wanted(name):
                    ops.extend([done[name, dt]] if (name, dt) in done else [])
                    continue
                try:
                    ops.append(gpu_op(name, dt, Path(d)))
                except Exception as e:  # one failing case is a row with its error
                    ops.append({"op": name, "dtype": dt, "error": str(e)[-400:]})
                print(json.dumps(ops[-1]), flush=True)
        for name, case in model_cases().items():
            for dt in case.dtypes:
                if args.dtypes and dt not in args.dtypes.split(","):
                    continue
                if (name, dt) in done or not wanted(name):
                    models.extend([done[name, dt]] if (name, dt) in done else [])
                    continue
                try:
                    models.append(gpu_model(name, dt, Path(d), shared))
                except Exception as e:
                    models.append({"model": name, "dtype": dt, "error": str(e)[-400:]})
                print(json.dumps(models[-1]), flush=True)
        dynamic = []  # (measured again on --resume: a case's rows share its name)
        for name in dyn_cases():
            if not wanted(name):
                continue
            try:
                dynamic.extend(gpu_dynamic(name, Path(d)))
            except Exception as e:
                dynamic.append({"model": name, "bound": None, "error": str(e)[-400:]})
                print(json.dumps(dynamic[-1]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / "gpu.json"
    machine = gpu_info()
    run = {"run": time.strftime("%Y-%m-%d", time.gmtime()), "torch_timing": "profiler", "repeat": REPEAT,
           "card": machine["gpu"]}
    out.write_text(json.dumps({"machine": machine, "runs": RUNS, "warmup": WARMUP, **run,
                               "ops": [{**run, **o} for o in ops], "models": [{**run, **m} for m in models],
                               "dynamic": [{**run, **r} for r in dynamic]}, indent=1) + "\n")
    print(f"wrote {out}")


def merge(args):
    """Fold the rows of later `gpu` runs (`args.files`, e.g. ones that
    measured a few cases with `--only`) into results/gpu.json: a row
    measured again replaces the old one, the rest stay, each tagged with
    the run it came from (rows from before runs were tagged: the first
    run, with CUDA-event timing and one measurement)."""
    path = RESULTS / "gpu.json"
    base = json.loads(path.read_text())
    # each row keeps the card it ran on: H100 and H200 figures never share a ratio
    first = {"run": "2026-12-04", "torch_timing": base.get("torch_timing", "events"), "repeat": base.get("repeat", 1),
             "card": base["machine"]["gpu"]}
    for kind, key, variant in (("ops", "op", "dtype"), ("models", "model", "dtype"), ("dynamic", "model", "size")):
        rows = {(r[key], r.get(variant)): {**first, **r} for r in base.get(kind, [])}
        for f in args.files:
            run = json.loads(Path(f).read_text())
            for r in run.get(kind, []):
                r = {"card": run["machine"]["gpu"], **r}
                k = (r[key], r.get(variant))
                if "error" in r and k in rows and "error" not in rows[k]:
                    print(f"{f}: keeping the earlier {k[0]} {k[1]}: this run failed ({r['error'][-120:]})")
                    continue
                rows[k] = r
        base[kind] = list(rows.values())
    base["machine"] = json.loads(Path(args.files[-1]).read_text())["machine"] if args.files else base["machine"]
    path.write_text(json.dumps(base, indent=1) + "\n")
    print(f"merged {len(args.files)} run(s) into {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "cpu", "gpu", "merge", "report"])
    ap.add_argument("files", nargs="*", help="merge: gpu result files to fold into results/gpu.json")
    ap.add_argument("--out", help="gpu: where to write the JSON (default results/gpu.json)")
    ap.add_argument("--resume", help="cpu/gpu: keep the rows of this earlier run's log, measure the rest")
    ap.add_argument("--only", help="prepare/cpu/gpu: only the ops/models whose names start with one of these "
                    "(comma-separated)")
    ap.add_argument("--dtypes", help="gpu: only the model rows of these dtypes (comma-separated)")
    ap.add_argument("--portable-too", action="store_true",
                    help="gpu: measure each op row again with every kernel in its portable form (--coop off)")
    ap.add_argument("--etmetal-only", action="store_true",
                    help="gpu: model rows without PyTorch's timings (a device run that already has them)")
    a = ap.parse_args()
    PORTABLE_TOO = a.portable_too
    ETMETAL_ONLY = a.etmetal_only
    if a.step == "report":
        import report

        report.main()
    else:
        {"prepare": prepare, "cpu": cpu, "gpu": gpu, "merge": merge}[a.step](a)
