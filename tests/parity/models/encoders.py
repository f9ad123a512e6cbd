"""A BERT-style sentence encoder as sentence-transformers runs it, written out
(transformers is not in the venv): word + position + token-type embeddings,
layer norm, post-norm encoder layers (multi-head SDPA under a padding mask
built from an HF-style int64 `attention_mask`, erf-GELU MLP), then mean
pooling over the kept tokens. Random weights; `bert_base()` is BERT-base's
shape, the default is a CI-sized one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(dim, eps=1e-12), nn.LayerNorm(dim, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x, keep):  # keep: bool [B, 1, 1, S], True = attend
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, d)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=1000, dim=64, heads=4, layers=2, ffn=256, max_pos=512):
        super().__init__()
        self.word, self.pos, self.token_type = nn.Embedding(vocab, dim), nn.Embedding(max_pos, dim), nn.Embedding(2, dim)
        self.ln = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, ffn) for _ in range(layers))

    def forward(self, input_ids, attention_mask):  # int64 [B, S] both; mask 1 = token, 0 = padding
        s = input_ids.shape[1]
        positions = torch.arange(s, device=input_ids.device)
        # token_type_ids default to zeros, as in HF BertModel
        x = self.word(input_ids) + self.pos(positions)[None] + self.token_type(torch.zeros_like(input_ids))
        x = self.ln(x)
        keep = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        m = attention_mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / m.sum(1).clamp(min=1e-9)


def bert_base() -> SentenceEncoder:
    return SentenceEncoder(vocab=30522, dim=768, heads=12, layers=12, ffn=3072)


def bert_inputs(g: torch.Generator, batch=2, seq=128, vocab=1000):
    """Ids and an HF attention mask: row 0 unpadded, the others right-padded."""
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 4, seq, (batch,), generator=g)
    lengths[0] = seq
    return ids, (torch.arange(seq)[None, :] < lengths[:, None]).long()
