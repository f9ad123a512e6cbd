"""Write tests/fixtures/decode/: one decode step (one token at position 5)
of the parity suite's Llama-style KV-cache decoder (tests/parity/models/
decoders.py: RMSNorm, rotary q/k, GQA, `index_copy_` cache updates in
buffers, SiLU-gated MLP) with 1 and 2 layers, tiny and random, so a test
can count the GPU dispatches a decoder layer costs (the difference between
them) without Python.

Run with the project venv: /root/.cache/etmetal/venv/bin/python scripts/make_decode_fixture.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "parity"))
from models.decoders import Decoder  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from make_llm_fixture import deflate  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "decode"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for layers in (1, 2):
        torch.manual_seed(layers)
        m = Decoder(llama=True, vocab=64, dim=32, heads=4, kv_heads=2, layers=layers, max_len=16).eval()
        ep = torch.export.export(m, (torch.tensor([[3]]), torch.tensor([5])))
        torch.export.save(ep, OUT / f"llama_{layers}.pt2")
        deflate(OUT / f"llama_{layers}.pt2")
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
