"""A Whisper-style audio encoder, written out: conv1d(80 -> d, k3) + GELU,
conv1d(d -> d, k3, stride 2) + GELU over a log-mel input [B, 80, T], fixed
sinusoidal positions (a buffer, as Whisper's), pre-norm attention blocks
(q/v/out with bias, k without; GELU MLP) and a final layer norm. Random
weights; `whisper_tiny()` is whisper-tiny's shape (T = 3000), the default a
CI-sized one."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's positional table [length, channels]: sin half then cos half."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class AudioEncoder(nn.Module):
    def __init__(self, mels=80, frames=300, dim=64, heads=4, layers=2):
        super().__init__()
        self.conv1 = nn.Conv1d(mels, dim, 3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.register_buffer("positions", sinusoids((frames + 1) // 2, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_post = nn.LayerNorm(dim)

    def forward(self, mel):  # [B, mels, frames]
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.positions.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


def whisper_tiny() -> AudioEncoder:
    return AudioEncoder(frames=3000, dim=384, heads=6, layers=4)
