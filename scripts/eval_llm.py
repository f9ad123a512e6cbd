"""What `etmetal compile --quantize` costs a decoder LM in accuracy, size
and speed: a bf16 `.pte` and quantized `.pte` files of the same bfloat16
export (scripts/export_llm.py --dtype bfloat16), and the eager transformers
model, on the same text.

    E=~/.cache/etmetal/gemma3-270m/export-bf16-1280-64
    python scripts/export_llm.py ~/.cache/etmetal/gemma3-270m --gguf gemma-3-270m-q4_k_m.gguf \
        --dtype bfloat16 --max-cache-len 1280 --prefill 64 -o $E
    python scripts/eval_llm.py --compile cpu --bf16 bf16.pte --quant int4=int4.pte \
        --quant int8=int8.pte --quant mixed=mixed.pte --quant int4-cal=int4-cal.pte \
        --quant mixed-cal=mixed-cal.pte --export $E \
        --model ~/.cache/etmetal/gemma3-270m --gguf gemma-3-270m-q4_k_m.gguf --device cpu

`--quant NAME=FILE` names a quantized `.pte` (repeatable; `--int4 FILE` is
`--quant int4=FILE`). With `--compile cpu|metal` the script makes every
file from `--export` first, the quantized ones by the recipe of their name
(RECIPES: `int4`, `int8`, `int8-g32`, `int8-g128`, `mixed`, `int4-cal`,
`mixed-cal`;
the calibrated ones on `--calibrate-text`, by default chapter II of the
same book, so the text scored is not the text calibrated on), e.g.

    etmetal compile $E/forward.pt2 --method prefill=$E/prefill.pt2 --backend cpu \
        --quantize mixed --calibrate tests/parity/data/around_the_world_ch2.txt \
        --tokenizer $E/tokenizer.json -o mixed-cal.pte

The export is bfloat16 rather than a float32 export compiled with `--dtype
bf16`: that flag also turns the program's explicit float32 casts into bf16,
among them the rotary embedding's positions, which bf16 holds exactly only
up to 256; on this text such a file's perplexity was 53.9 against eager
bf16's 30.6. A bfloat16 export keeps those casts, as eager bf16 does.

On a GPU machine, with the export and the GGUF there (both exceed what a
device call carries):

    python scripts/eval_llm.py --compile metal --max-buffer 2G --device vulkan \
        --bf16 bf16.pte --quant int4=int4.pte --export $E --model DIR --gguf FILE \
        --out benchmarks/results/quant_accuracy_h200.json
    # or the decode rate alone, from each .pte:
    etmetal generate int4.pte --tokenizer $E/tokenizer.json --device vulkan \
        --prompt "The capital of France is" --max-tokens 64

It measures:

- teacher forcing: the text (with the BOS the tokenizer adds) goes through
  each `.pte`'s `prefill` method chunk by chunk with the KV cache
  (`etmetal generate --replay`), and through the eager model in one call
  (float32, and a bfloat16 copy). Per model: perplexity (exp of the mean negative
  log-likelihood of each next token); per pair: next-token agreement (the
  argmax of both logits equal at a position) and the mean KL divergence
  KL(reference || other) of the next-token distributions;
- greedy text (`etmetal generate`, and eager `generate`) on a few prompts
  (`--no-greedy` leaves it out);
- decode tokens/s of each `.pte` on `--device` (`etmetal generate`'s
  stderr line, summed over the greedy prompts), and the size of each file.

The text: tests/parity/data/around_the_world_ch1.txt is the start of
chapter I of Jules Verne's *Around the World in Eighty Days* (English
translation, public domain; Project Gutenberg EBook #103), its paragraphs
unwrapped; around_the_world_ch2.txt the start of chapter II. Results go to
`--out` (JSON), which benchmarks/report.py renders into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "To make a cup of tea, first"]
GREEDY_TOKENS = 32


def binary() -> Path:
    """The etmetal binary: $ETMETAL_BIN, else the release build."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return Path(os.environ.get("ETMETAL_BIN") or (target if target.is_absolute() else REPO / target) / "release" / "etmetal")


def etmetal(exe: Path, *args, timeout=3600) -> subprocess.CompletedProcess:
    cmd = [str(exe), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)}\n{p.stderr}{p.stdout}")
    return p


CAL = "{calibrate}"
TOK = "{tokenizer}"
# the flags of each named quantized file (`--compile`); {calibrate} and
# {tokenizer}: --calibrate-text and the export's tokenizer.json
RECIPES = {
    "int4": ["--quantize", "int4", "--group-size", "32"],
    "int8": ["--quantize", "int8"],
    "int8-g32": ["--quantize", "int8", "--group-size", "32"],
    "int8-g128": ["--quantize", "int8", "--group-size", "128"],
    "mixed": ["--quantize", "mixed"],
    "int4-cal": ["--quantize", "int4", "--group-size", "32", "--calibrate", CAL, "--tokenizer", TOK],
    "mixed-cal": ["--quantize", "mixed", "--calibrate", CAL, "--tokenizer", TOK],
}


def compile_pte(exe: Path, export: Path, out: Path, backend: str, quant=(), extra=(), prefill_only=False,
                dry_run=False) -> str:
    """Compile the (bfloat16) export's forward and prefill, or its prefill
    alone as `forward`, with the `quant` flags (`dry_run`: not). The command."""
    args = ["compile", export / ("prefill.pt2" if prefill_only else "forward.pt2"), "-o", out,
            "--backend", backend, *extra]
    if not prefill_only:
        args += ["--method", f"prefill={export / 'prefill.pt2'}"]
    args += list(quant)
    if dry_run:
        return " ".join(map(str, ["etmetal", *args]))
    p = etmetal(exe, *args)
    for line in p.stderr.splitlines():
        if "calibrated on" in line or "mixed:" in line or "quantized in" in line:
            print(f"  {line[:400]}", flush=True)
    return " ".join(map(str, ["etmetal", *args]))


def chunk_of(exe: Path, pte: Path, method: str) -> int:
    """Tokens a call of `method` takes (its first input is int64 [1, T])."""
    shown = etmetal(exe, "inspect", pte).stdout
    m = re.search(rf"method `{method}`:\n  inputs:  int64 \[1, (\d+)\]", shown)
    if not m:
        raise RuntimeError(f"{pte}: no method `{method}` taking int64 [1, T]:\n{shown[:2000]}")
    return int(m.group(1))


def replay_logits(exe: Path, pte: Path, ids: list[int], device: str, method: str = "prefill") -> Iterator[np.ndarray]:
    """Logits [n, vocab] of `ids` teacher-forced through `pte`, one chunk
    (of the method's T tokens, the last padded with the last token) at a
    time, the KV cache carried from chunk to chunk; row i predicts ids[i + 1]."""
    chunk = chunk_of(exe, pte, method)
    with tempfile.TemporaryDirectory(prefix="eval_llm_") as work:
        work = Path(work)
        steps = 0
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            part = part + [part[-1]] * (chunk - len(part))
            (work / f"step{steps}_method.txt").write_text(method)
            np.save(work / f"step{steps}_input0.npy", np.array([part], dtype=np.int64))
            np.save(work / f"step{steps}_input1.npy", np.arange(start, start + chunk, dtype=np.int64))
            steps += 1
        etmetal(exe, "generate", pte, "--replay", work, "--steps", steps, "--device", device)
        # read all now, so that the files of one .pte at a time are on disk
        # (a vocabulary of 262144 makes 1.2 GB of float32 a thousand
        # tokens); values that float16 holds exactly (a bf16 program's) are
        # kept so
        chunks = []
        for k in range(steps):
            out = work / f"step{k}_output0.npy"
            logits = np.load(out)[0, : min(chunk, len(ids) - k * chunk)]
            out.unlink()
            half = logits.astype(np.float16)
            chunks.append(half if np.array_equal(half.astype(logits.dtype), logits) else logits)
    for logits in chunks:
        yield logits.astype(np.float32)


def eager_logits(model, ids: list[int], chunk: int) -> Iterator[np.ndarray]:
    """The eager model's logits of `ids` (one forward, no cache), `chunk` rows at a time."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    for start in range(0, len(ids), chunk):
        yield logits[start:start + chunk].float().numpy()


def teacher_forced(sources: dict[str, Iterator[np.ndarray]], targets: list[int],
                   pairs: list[tuple[str, str]]) -> dict:
    """Perplexity of each source and, per (reference, other) pair, next-token
    agreement and mean KL(reference || other), over len(targets) positions;
    the sources yield the same chunks of rows."""
    nll = {name: 0.0 for name in sources}
    agree = {p: 0 for p in pairs}
    kl = {p: 0.0 for p in pairs}
    n = 0
    for rows in zip(*sources.values()):
        logp = {name: torch.log_softmax(torch.from_numpy(r).double(), -1) for name, r in zip(sources, rows)}
        m = rows[0].shape[0]
        t = torch.tensor(targets[n:n + m])
        for name, lp in logp.items():
            nll[name] += -lp[torch.arange(m), t].sum().item()
        for a, b in pairs:
            agree[(a, b)] += (logp[a].argmax(-1) == logp[b].argmax(-1)).sum().item()
            kl[(a, b)] += (logp[a].exp() * (logp[a] - logp[b])).sum().item()
        n += m
    assert n == len(targets), (n, len(targets))
    return {
        "tokens": n,
        "perplexity": {name: float(np.exp(v / n)) for name, v in nll.items()},
        "agreement": {f"{b} vs {a}": agree[(a, b)] / n for a, b in pairs},
        "kl": {f"{b} vs {a}": kl[(a, b)] / n for a, b in pairs},
    }


def decode_rate(exe: Path, pte: Path, tokenizer: Path, prompt: str, device: str, tokens: int) -> tuple[str, dict]:
    """`etmetal generate`'s text and its prefill/decode figures."""
    p = etmetal(exe, "generate", pte, "--tokenizer", tokenizer, "--prompt", prompt, "--max-tokens", tokens,
                "--device", device)
    m = re.search(r"decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s", p.stderr)
    if not m:
        raise RuntimeError(f"no decode line in:\n{p.stderr}")
    return p.stdout.rstrip("\n"), {"decode_tokens": int(m.group(1)), "decode_s": float(m.group(2)),
                                   "decode_tokens_per_s": float(m.group(3))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", type=Path, required=True, help="the bf16 .pte")
    ap.add_argument("--int4", type=Path, help="the int4 .pte of the same export (--quant int4=FILE)")
    ap.add_argument("--quant", action="append", default=[], metavar="NAME=FILE",
                    help="a quantized .pte of the same export; with --compile, made by RECIPES[NAME]")
    ap.add_argument("--export", type=Path, required=True, help="export_llm.py's output (pt2 files, tokenizer)")
    ap.add_argument("--model", required=True, help="the transformers model directory")
    ap.add_argument("--gguf", help="a GGUF file in --model (dequantized on load)")
    ap.add_argument("--text", type=Path, default=REPO / "tests/parity/data/around_the_world_ch1.txt")
    ap.add_argument("--calibrate-text", type=Path, default=REPO / "tests/parity/data/around_the_world_ch2.txt")
    ap.add_argument("--device", default="cpu", help="as `etmetal run --device`")
    ap.add_argument("--compile", choices=["cpu", "metal"], help="make the .pte files from --export first")
    ap.add_argument("--max-buffer", help="passed to compile (metal)")
    ap.add_argument("--no-greedy", action="store_true", help="no greedy text, no decode rates")
    ap.add_argument("--keep-compiled", action="store_true",
                    help="with --compile: keep a file newer than the binary (its command is recorded, no time)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/quant_accuracy.json")
    args = ap.parse_args()
    exe = binary()

    sys.path.insert(0, str(REPO / "scripts"))
    import export_llm

    def rel(p: Path) -> str:
        return str(p.resolve().relative_to(REPO)) if p.resolve().is_relative_to(REPO) else str(p)

    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "device": args.device, "torch": torch.__version__},
              "model": args.gguf or args.model, "text": rel(args.text),
              "calibration_text": rel(args.calibrate_text),
              "command": " ".join(["python", *sys.argv])}
    quant = {}
    if args.int4:
        quant["int4"] = args.int4
    for q in args.quant:
        name, sep, path = q.partition("=")
        if not sep:
            ap.error(f"--quant {q}: NAME=FILE expected")
        quant[name] = Path(path)
    if not quant:
        ap.error("no quantized file: give --quant NAME=FILE (or --int4 FILE)")
    files = {"bf16": args.bf16, **quant}
    if args.compile:
        extra = ["--max-buffer", args.max_buffer] if args.max_buffer else []
        subst = {"{calibrate}": str(args.calibrate_text), "{tokenizer}": str(args.export / "tokenizer.json")}
        result["compile"] = {}
        for name, path in files.items():
            if name != "bf16" and name not in RECIPES:
                ap.error(f"--compile: no recipe for `{name}` (one of {', '.join(RECIPES)})")
            flags = [subst.get(a, a) for a in RECIPES.get(name, [])]
            if args.keep_compiled and path.is_file() and path.stat().st_mtime > exe.stat().st_mtime:
                cmd = compile_pte(exe, args.export, path, args.compile, flags, extra, dry_run=True)
                result["compile"][name] = {"command": cmd, "seconds": None}
                print(f"kept {path}", flush=True)
                continue
            t0 = time.time()
            cmd = compile_pte(exe, args.export, path, args.compile, flags, extra)
            result["compile"][name] = {"command": cmd, "seconds": round(time.time() - t0, 1)}
            print(f"compiled {path} in {time.time() - t0:.0f} s", flush=True)
    result["size_bytes"] = {name: path.stat().st_size for name, path in files.items()}
    result["size_ratio"] = {name: result["size_bytes"][name] / result["size_bytes"]["bf16"] for name in quant}

    model, tokenizer = export_llm.load(args.model, args.gguf, torch.float32)
    ids = tokenizer(args.text.read_text())["input_ids"]
    inputs, targets = ids[:-1], ids[1:]
    t0 = time.time()
    chunk = chunk_of(exe, args.bf16, "prefill")
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    sources = {f"etmetal {name}": replay_logits(exe, path, inputs, args.device) for name, path in files.items()}
    sources["eager f32"] = eager_logits(model, inputs, chunk)
    sources["eager bf16"] = eager_logits(bf16_model, inputs, chunk)
    pairs = [("etmetal bf16", f"etmetal {name}") for name in quant]
    pairs += [("eager bf16", "etmetal bf16"), ("eager f32", "eager bf16"), ("eager f32", "etmetal bf16")]
    pairs += [("eager f32", f"etmetal {name}") for name in quant]
    forced = teacher_forced(sources, targets, pairs)
    del bf16_model
    forced["seconds"] = round(time.time() - t0, 1)
    result["teacher_forced"] = forced
    print(json.dumps(forced, indent=1), flush=True)
    print(json.dumps({k: result[k] for k in ("size_bytes", "size_ratio")}, indent=1), flush=True)

    result["greedy"] = []
    if not args.no_greedy:
        tok_json = args.export / "tokenizer.json"
        decode = {name: {"decode_tokens": 0, "decode_s": 0.0} for name in files}
        for prompt in PROMPTS:
            enc = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=GREEDY_TOKENS, do_sample=False)
            row = {"prompt": prompt, "eager f32": tokenizer.decode(out[0], skip_special_tokens=True)}
            for name, path in files.items():
                row[f"etmetal {name}"], rate = decode_rate(exe, path, tok_json, prompt, args.device, GREEDY_TOKENS)
                for k in decode[name]:
                    decode[name][k] += rate[k]
            result["greedy"].append(row)
            print(json.dumps(row, indent=1), flush=True)
        for rate in decode.values():
            rate["decode_tokens_per_s"] = rate["decode_tokens"] / rate["decode_s"]
        result["decode"] = decode
        print(json.dumps(decode, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
