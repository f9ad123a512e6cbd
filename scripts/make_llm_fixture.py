"""Write tests/fixtures/llm/: a tiny random-weight Llama exported through
transformers' ExecuTorch recipe (scripts/export_llm.py: forward.pt2, a
prefill.pt2 and decode.pt2, the greedy step), a small byte-level BPE tokenizer.json trained here, and the
text eager transformers generates greedily from PROMPT (expected.txt), so
`cargo test` covers `etmetal generate` end to end with no Python.

Also tests/fixtures/llm_dynamic/: the same model's `prefill` exported with a
dynamic length (1 to DYNAMIC tokens; it goes with llm/'s forward.pt2 and
decode.pt2) and cases.json, the greedy text eager transformers gives for
prompts of 1 token, an odd length and DYNAMIC tokens, and a prompt of
DYNAMIC + 1 tokens (too long for it).

Run with the project venv: /root/.cache/etmetal/venv/bin/python scripts/make_llm_fixture.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import export_llm  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llm"
OUT_DYNAMIC = OUT.parent / "llm_dynamic"
PROMPT = "The cat sat"
MAX_TOKENS = 12
CACHE = 32
PREFILL = 8
# the dynamic prefill's bound, and the prompt lengths its cases take
DYNAMIC = 16
DYNAMIC_LENGTHS = [1, 7, DYNAMIC]
DYNAMIC_TOKENS = 6
# Greedy decoding on random weights: each step's best logit must lead the
# next by this much, so float rounding cannot flip a token.
MARGIN = 1e-2
TEXT = """The cat sat on the mat. The dog sat on the log. A bird sang in the tree,
and the cat looked up at the bird. Ein Vogel sang; le chat dormait. 猫が座った。
"""


def tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    bos = tok.token_to_id("<bos>")
    # as Llama's: the post-processor puts a BOS first
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


def deflate(path: Path):
    """Rewrite a .pt2 with its entries deflated (the graph's JSON, with its
    stack traces, is most of a tiny model's archive; etmetal reads both)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for info, data in entries:
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)


def greedy(model, ids, max_tokens: int):
    """Eager transformers' greedy ids after `ids` [1, n], or `None` where a
    step has a near tie."""
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    for scores in out.scores:
        top = scores[0].topk(2).values
        if top[0] - top[1] <= MARGIN:
            return None
    return out.sequences[0]


def prompts_of(tok, n: int):
    """Pieces of TEXT that encode to `n` tokens (BOS included), the
    shortest from each start."""
    for start in range(len(TEXT)):
        for end in range(start, len(TEXT) + 1):
            if len(tok(TEXT[start:end]).input_ids) == n:
                yield TEXT[start:end]
                break


def dynamic_fixture(model, tok):
    """llm_dynamic/: the dynamic prefill and the cases (see the docstring)."""
    OUT_DYNAMIC.mkdir(exist_ok=True)
    wrapper = export_llm.recipe(model, CACHE)
    path = OUT_DYNAMIC / "prefill.pt2"
    torch.export.save(export_llm.export_step(wrapper, DYNAMIC, dynamic=True), path)
    deflate(path)
    cases = []
    for n in DYNAMIC_LENGTHS:
        found = ((p, greedy(model, tok(p, return_tensors="pt"), DYNAMIC_TOKENS)) for p in prompts_of(tok, n))
        prompt, sequence = next((p, s) for p, s in found if s is not None)
        text = tok.decode(sequence, skip_special_tokens=True)
        cases.append({"prompt": prompt, "tokens": n, "max_tokens": DYNAMIC_TOKENS, "text": text})
    spec = {"bound": DYNAMIC, "cases": cases, "too_long": next(prompts_of(tok, DYNAMIC + 1))}
    (OUT_DYNAMIC / "cases.json").write_text(json.dumps(spec, ensure_ascii=False, indent=1) + "\n")
    total = sum(f.stat().st_size for f in OUT_DYNAMIC.iterdir())
    print(f"wrote {OUT_DYNAMIC} ({total} bytes)")
    if total > 600_000:
        sys.exit("the llm_dynamic fixture exceeds 600 KB")


def main():
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(os.environ.get("SEED", 3)))
    tok = tokenizer(OUT)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CACHE,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                         initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                              use_cache=True)
    ids = tok(PROMPT, return_tensors="pt")
    sequence = greedy(model, ids, MAX_TOKENS)
    assert sequence is not None, "a near tie; change the seed"
    text = tok.decode(sequence, skip_special_tokens=True)
    for pt2 in export_llm.export(model, tok, OUT, CACHE, PREFILL):
        deflate(pt2)
    (OUT / "expected.txt").write_text(text)
    new_ids = sequence[ids.input_ids.shape[1]:].tolist()
    spec = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "new_ids": new_ids}
    (OUT / "prompt.json").write_text(json.dumps(spec) + "\n")
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT} ({total} bytes): {text!r}")
    # three methods' graphs with their weights (forward, prefill, decode)
    if total > 600_000:
        sys.exit("the llm fixture exceeds 600 KB")
    dynamic_fixture(model, tok)


if __name__ == "__main__":
    main()
