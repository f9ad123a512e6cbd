"""Export a transformers decoder LM for `etmetal generate`, through
transformers' own ExecuTorch recipe (`TorchExportableModuleForDecoderOnlyLM`:
a static KV cache in buffers, the hybrid sliding-window cache for Gemma 3),
or, for the hybrid linear-attention and state-space LMs that recipe does
not take (Qwen3.5, Qwen3-Next, Mamba, Mamba-2, Jamba, Falcon-H1), through
transformers' cache API (`StateCacheRecipe`: a `StaticCache` whose KV,
convolution and recurrent states are buffers).

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
        [--dtype float32|bfloat16] [--non-strict]
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
    """transformers' ExecuTorch wrapper of `model`, or, for a model whose
    cache has linear-attention or state-space layers (Qwen3.5, Qwen3-Next,
    Mamba, Mamba-2, Jamba, Falcon-H1), which that recipe does not take,
    a `StateCacheRecipe`; its `.model` is the module that is exported (and
    run eagerly for comparisons)."""
    model.generation_config.cache_implementation = "static"
    if has_recurrent_layers(model):
        return StateCacheRecipe(model, max_cache_len)
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)


def has_recurrent_layers(model) -> bool:
    """Whether transformers' static cache of `model` has layers that keep a
    recurrent or convolution state (linear attention, state-space layers)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticCache

    cache = StaticCache(config=model.config, max_cache_len=1)
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


class CacheStep(torch.nn.Module):
    """A step `(input_ids [1, T], cache_position [T]) -> logits` of a model
    through transformers' own cache API: a `StaticCache`, whose KV layers
    hold `max_cache_len` positions and whose linear-attention and
    state-space layers hold their convolution and recurrent states. Every
    layer is initialized by one eager call (transformers creates the states
    of these layers on first use), then reset to zeros; its tensors are
    registered as buffers (`key_cache_{i}`, `value_cache_{i}`,
    `conv_state_{i}`, `recurrent_state_{i}`, the counters), as
    transformers' recipe registers its KV caches, so that an export keeps
    them as state under these names in every method. Each layer is marked
    as holding a previous state: a prefill then continues from the state
    (zeros after a reset, which is the same as starting afresh)."""

    def __init__(self, model, max_cache_len: int):
        import inspect

        from transformers import StaticCache

        super().__init__()
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "past_key_values" if "past_key_values" in params else "cache"
        self.takes_position = "cache_position" in params
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        with torch.no_grad():
            self(torch.zeros((1, 1), dtype=torch.long), torch.zeros(1, dtype=torch.long))
        self.cache.reset()
        names = {"keys": "key_cache", "values": "value_cache", "cumulative_length": "cumulative_length",
                 "cumulative_length_linear": "linear_length"}
        for i, layer in enumerate(self.cache.layers):
            for attr, name in names.items():
                t = getattr(layer, attr, None)
                if isinstance(t, torch.Tensor):
                    self.register_buffer(f"{name}_{i}", t, persistent=False)
            for kind, name in (("conv_states", "conv_state"), ("recurrent_states", "recurrent_state")):
                for k, t in (getattr(layer, kind, None) or {}).items():
                    if isinstance(t, torch.Tensor):
                        self.register_buffer(f"{name}_{i}" + (f"_{k}" if k else ""), t, persistent=False)
            for k in getattr(layer, "has_previous_state", {}):
                layer.has_previous_state[k] = True

    def forward(self, input_ids, cache_position):
        kwargs = {self.cache_arg: self.cache, "use_cache": True}
        if self.takes_position:
            kwargs["cache_position"] = cache_position
        return self.model(input_ids=input_ids, **kwargs).logits


class StateCacheRecipe:
    """The export recipe of `CacheStep`, shaped as transformers' (`.model`
    the module, `.export(input_ids=..., cache_position=...)`)."""

    def __init__(self, model, max_cache_len: int):
        self.model = CacheStep(model, max_cache_len)

    def export(self, input_ids=None, cache_position=None, dynamic_shapes=None, strict=None):
        kwargs = {"input_ids": input_ids, "cache_position": cache_position}
        return export_keeping_state(self.model, kwargs, dynamic_shapes, True if strict is None else strict)


def export_keeping_state(module, kwargs: dict, dynamic_shapes=None, strict: bool = True):
    """`torch.export.export(module, (), kwargs)` with `module`'s buffers put
    back as they were before it: tracing runs in-place ops whose operands
    are all real tensors (a cache's `cumulative_length.add_(T)`) for real,
    and the exported program holds those very tensors as its initial state."""
    saved = {name: b.clone() for name, b in module.named_buffers()}
    with torch.no_grad():
        ep = torch.export.export(module, args=(), kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
        for name, b in module.named_buffers():
            b.copy_(saved[name])
    return ep


def export_step(wrapper, tokens: int, start: int = 0, dynamic: bool = False,
                strict: bool | None = None) -> torch.export.ExportedProgram:
    """The recipe's export of a step that takes `tokens` tokens, or with
    `dynamic` any number from 1 to `tokens` (a copy, so the wrapper's cache
    is left as it was); `strict=False` exports as torch.export's
    non-strict mode does (the cache's tensors are then lifted constants,
    which etmetal keeps as state where the graph writes them)."""
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
        return wrapper.export(input_ids=input_ids, cache_position=cache_position, dynamic_shapes=shapes,
                              strict=strict)


def export_greedy_step(wrapper, strict: bool = True) -> torch.export.ExportedProgram:
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
    return export_keeping_state(step, kwargs, strict=strict)


def export(model, tokenizer, out: Path, max_cache_len: int, prefill: int, decode: bool = True,
           dynamic_prefill: bool = False, strict: bool = True) -> list[Path]:
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
        torch.export.save(export_step(wrapper, tokens, dynamic=dynamic, strict=strict), path)
        files.append(path)
    if decode:
        path = out / "decode.pt2"
        torch.export.save(export_greedy_step(wrapper, strict), path)
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
    ap.add_argument("--non-strict", action="store_true",
                    help="export with torch.export's non-strict mode (strict=False) instead of dynamo")
    args = ap.parse_args()
    model, tokenizer = load(args.model, args.gguf, getattr(torch, args.dtype))
    files = export(model, tokenizer, args.out, args.max_cache_len, args.prefill, args.decode,
                   args.dynamic_prefill, not args.non_strict)
    method = "".join(f" --method {f.stem}={f}" for f in files[1:])
    print(f"wrote {', '.join(map(str, files))} and the tokenizer files in {args.out}")
    print(f"next: etmetal compile {files[0]}{method} -o model.pte")
    print(f"then: etmetal generate model.pte --tokenizer {args.out / 'tokenizer.json'} --prompt TEXT")


if __name__ == "__main__":
    main()
