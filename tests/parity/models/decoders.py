"""Decoders that keep their KV cache in registered buffers, as users write
them for on-device generation: `forward(tokens [1, T], input_pos [T])`
writes the new keys/values into the cache (`index_copy_` for the Llama
style, slice assignment through `index_put_` for the GPT style) and attends
causally over the cache. Random weights, CI-reduced sizes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(max_len: int, head_dim: int, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_len).float(), inv)
    return torch.cos(freqs), torch.sin(freqs)


def rotate(x, cos, sin):
    # x [B, H, T, D]; cos/sin [T, D/2] (interleaved halves, Llama's rotate_half)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    cos, sin = cos[None, None], sin[None, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, max_len, rope: bool, update: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.head_dim, bias=not rope)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=not rope)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=not rope)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=not rope)
        self.rope, self.update = rope, update
        shape = (1, kv_heads, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))
        self.register_buffer("positions", torch.arange(max_len))
        if rope:
            cos, sin = rotary_tables(max_len, self.head_dim)
            self.register_buffer("cos", cos)
            self.register_buffer("sin", sin)

    def forward(self, x, input_pos):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = self.cos[input_pos], self.sin[input_pos]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.update == "index_copy":
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
        else:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        # causal over the cache: key j is seen by the query at position p when j <= p
        mask = self.positions[None, :] <= input_pos[:, None]
        rep = self.heads // self.kv_heads
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, max_len, llama: bool, hidden=None):
        super().__init__()
        self.llama = llama
        norm = (lambda: RMSNorm(dim)) if llama else (lambda: nn.LayerNorm(dim))
        self.n1, self.n2 = norm(), norm()
        self.attn = Attention(dim, heads, kv_heads, max_len, rope=llama,
                              update="index_copy" if llama else "index_put")
        hidden = hidden or 2 * dim
        if llama:
            self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)
        else:
            self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x, input_pos):
        x = x + self.attn(self.n1(x), input_pos)
        h = self.n2(x)
        if self.llama:
            h = self.down(F.silu(self.gate(h)) * self.up(h))
        else:
            h = self.proj(F.gelu(self.fc(h), approximate="tanh"))
        return x + h


class Decoder(nn.Module):
    """`llama=True`: RMS norm, rotary embeddings, SiLU-gated MLP, GQA,
    `index_copy_` cache updates. `llama=False` (GPT): learned positions,
    layer norm, GELU MLP, multi-head attention, slice-assigned cache."""

    def __init__(self, llama: bool, vocab=64, dim=32, heads=4, kv_heads=2, layers=2, max_len=160, hidden=None):
        super().__init__()
        self.llama = llama
        self.tok = nn.Embedding(vocab, dim)
        if not llama:
            kv_heads = heads
            self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, max_len, llama, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.max_len = max_len

    def forward(self, tokens, input_pos):
        x = self.tok(tokens)
        if not self.llama:
            x = x + self.pos(input_pos)[None]
        for b in self.blocks:
            x = b(x, input_pos)
        return self.head(self.norm(x))


def decoder(kind: str, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    m = Decoder(llama=kind == "llama").eval()
    with torch.no_grad():
        for p in m.parameters():  # keep logits O(1) so 1e-4 is meaningful
            p.mul_(1.0 / math.sqrt(max(1, p.shape[-1] // 8)))
    return m
