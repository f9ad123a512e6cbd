"""Write the small .pt2 fixtures under tests/fixtures/ with deterministic
inputs and eager PyTorch outputs (.npy), so Rust tests need no Python.

Run with the project venv: /root/.cache/etmetal/venv/bin/python scripts/make_fixtures.py
"""
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class BasicBlock(nn.Module):
    """ResNet basic block: conv-bn-relu-conv-bn + residual, relu."""

    def __init__(self, c=4):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        for bn in (self.bn1, self.bn2):  # non-trivial running stats
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.2, 0.2)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + x)


class GptBlock(nn.Module):
    """Pre-norm GPT-2 block: layer norm, causal SDPA, GELU MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Bf16Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return F.silu(self.fc(x)) * 2.0


class TransposedWeight(nn.Module):
    """A parameter that is a transposed view: stored with strides [1, 4]."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3).t())  # shape [3, 4], strides [1, 3]
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32) + 1.0)

    def forward(self, x):
        return (x @ self.w) * self.scale


def fixtures():
    torch.manual_seed(0)
    yield "mlp", Mlp(), (torch.randn(2, 8),), False
    yield "mlp_decomposed", Mlp(), (torch.randn(2, 8),), True
    yield "resblock", BasicBlock().eval(), (torch.randn(1, 4, 6, 6),), False
    yield "resblock_decomposed", BasicBlock().eval(), (torch.randn(1, 4, 6, 6),), True
    yield "gpt_block", GptBlock().eval(), (torch.randn(1, 5, 16),), False
    yield "gpt_block_decomposed", GptBlock().eval(), (torch.randn(1, 5, 16),), True
    yield "bf16_mlp", Bf16Mlp().to(torch.bfloat16), (torch.randn(3, 8).to(torch.bfloat16),), False
    yield "transposed_weight", TransposedWeight(), (torch.randn(2, 3),), False


def save_npy(path, t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    np.save(path, t.numpy())


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, module, args, decompose in fixtures():
        ep = torch.export.export(module, args)
        if decompose:
            ep = ep.run_decompositions()
        torch.export.save(ep, os.path.join(OUT, name + ".pt2"))
        with torch.no_grad():
            outs = module(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i, a in enumerate(args):
            save_npy(os.path.join(OUT, f"{name}.input_{i}.npy"), a)
        for i, o in enumerate(outs):
            save_npy(os.path.join(OUT, f"{name}.output_{i}.npy"), o)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote fixtures: {total} bytes in {OUT}")
    if total > 1 << 20:
        sys.exit("fixtures exceed 1 MB")


if __name__ == "__main__":
    main()
