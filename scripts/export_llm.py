"""Export a transformers decoder LM for `etmetal generate`, through
transformers' own ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`:
a static KV cache in buffers, the hybrid sliding-window cache for Gemma 3).

Writes into OUT: `forward.pt2` (a decode step: input_ids [1, 1],
cache_position [1]), `prefill.pt2` (input_ids [1, P], cache_position [P];
with --dynamic-prefill, any length from 1 to P: `etmetal generate` then
runs a prompt in one call at its length, on CPU kernels, where a static
prefill pads it to P on the GPU) unless --prefill 0, `decode.pt2` (the decode step returning the next
greedy token, the argmax of its logits, int64 [1]: a greedy step then
reads back 8 bytes, not the vocabulary's logits) unless --no-decode, and
the tokenizer files (tokenizer.json, tokenizer_config.json,
generation_config.json). Then:

    etmetal compile OUT/forward.pt2 --method prefill=OUT/prefill.pt2 \
        --method decode=OUT/decode.pt2 -o model.pte
    etmetal generate model.pte --tokenizer OUT/tokenizer.json --prompt "..."

Usage (the project venv has torch, transformers, gguf and accelerate):
    python scripts/export_llm.py MODEL_DIR [--gguf FILE.gguf] -o OUT
        [--max-cache-len 256] [--prefill 32] [--dynamic-prefill] [--no-decode]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch


def load(model_dir: str | Path, gguf_file: str | None = None, dtype=torch.float32):
    """The model and tokenizer, as `from_pretrained` gives them (a GGUF file
    is dequantized to `dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.eval(), tokenizer


def recipe(model, max_cache_len: int):
    """transformers' ExecuTorch wrapper of `model`; its `.model` is the
    module that is exported (and run eagerly for comparisons)."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.cache_implementation = "static"
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)


def export_step(wrapper, tokens: int, start: int = 0, dynamic: bool = False) -> torch.export.ExportedProgram:
    """The recipe's export of a step that takes `tokens` tokens, or with
    `dynamic` any number from 1 to `tokens` (a copy, so the wrapper's cache
    is left as it was)."""
    wrapper = copy.deepcopy(wrapper)
    shapes = None
    if dynamic:
        seq = torch.export.Dim("seq", min=1, max=tokens)
        shapes = {"input_ids": {1: seq}, "cache_position": {0: seq}}
        if tokens < 2:
            raise ValueError(f"a dynamic prefill of up to {tokens} token(s): give a bound of 2 or more")
        # an example of 2 or more tokens (torch.export specializes a size of 1)
        tokens = max(2, tokens // 2)
    input_ids = torch.zeros((1, tokens), dtype=torch.long)
    cache_position = torch.arange(start, start + tokens, dtype=torch.long)
    with torch.no_grad():
        return wrapper.export(input_ids=input_ids, cache_position=cache_position, dynamic_shapes=shapes)


def export_greedy_step(wrapper) -> torch.export.ExportedProgram:
    """The decode step (one token) returning the argmax of its logits,
    int64 [1]. The exported module keeps the recipe's own (its class is
    swapped for a subclass), so its KV-cache buffers have the names of the
    other methods' and are one state with them in the program."""
    wrapper = copy.deepcopy(wrapper)
    step = wrapper.model

    class GreedyStep(type(step)):
        def forward(self, input_ids, cache_position):
            logits = super().forward(input_ids=input_ids, cache_position=cache_position)
            return logits[:, -1].argmax(-1)

    step.__class__ = GreedyStep
    kwargs = {"input_ids": torch.zeros((1, 1), dtype=torch.long),
              "cache_position": torch.zeros(1, dtype=torch.long)}
    with torch.no_grad():
        return torch.export.export(step, args=(), kwargs=kwargs, strict=True)


def export(model, tokenizer, out: Path, max_cache_len: int, prefill: int, decode: bool = True,
           dynamic_prefill: bool = False) -> list[Path]:
    """forward.pt2 (and prefill.pt2 when `prefill` > 0, of up to `prefill`
    tokens with `dynamic_prefill`; decode.pt2 when `decode`) plus the
    tokenizer files in `out`; the .pt2 paths, forward first."""
    out.mkdir(parents=True, exist_ok=True)
    wrapper = recipe(model, max_cache_len)
    files = []
    for name, tokens in [("forward", 1), ("prefill", prefill)]:
        if tokens == 0:
            continue
        path = out / f"{name}.pt2"
        dynamic = dynamic_prefill and name == "prefill"
        torch.export.save(export_step(wrapper, tokens, dynamic=dynamic), path)
        files.append(path)
    if decode:
        path = out / "decode.pt2"
        torch.export.save(export_greedy_step(wrapper), path)
        files.append(path)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a transformers model directory (or hub id where reachable)")
    ap.add_argument("--gguf", help="a GGUF file in MODEL (dequantized on load)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--max-cache-len", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=32, help="tokens a prefill call takes (0: none)")
    ap.add_argument("--dynamic-prefill", action="store_true",
                    help="export `prefill` for any prompt length from 1 to --prefill (its nodes run on the CPU)")
    ap.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                    help="also export `decode`, the step returning its greedy token (default: yes)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    model, tokenizer = load(args.model, args.gguf, getattr(torch, args.dtype))
    files = export(model, tokenizer, args.out, args.max_cache_len, args.prefill, args.decode,
                   args.dynamic_prefill)
    method = "".join(f" --method {f.stem}={f}" for f in files[1:])
    print(f"wrote {', '.join(map(str, files))} and the tokenizer files in {args.out}")
    print(f"next: etmetal compile {files[0]}{method} -o model.pte")
    print(f"then: etmetal generate model.pte --tokenizer {args.out / 'tokenizer.json'} --prompt TEXT")


if __name__ == "__main__":
    main()
