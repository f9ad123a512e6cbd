"""Modules exported with a dynamic dim, shared by the runtime fixtures
(`scripts/make_dynamic_fixtures.py`) and the parity test
(`test_dynamic_runtime.py`).

Each entry: (name, make, inputs_at, sizes) where `make()` returns
(module, example inputs, dynamic_shapes) and `inputs_at(size)` the inputs
at one size of the dynamic dim; `sizes` are the smallest, an odd one and
the largest of its range.
"""

import torch
from torch.export import Dim

from models.mlp import Mlp


class ViewSlice(torch.nn.Module):
    """sym_size, a SymInt product, a view of a dynamic dim, a slice ending
    at a SymInt and an arange of one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        z = y.view(y.shape[0] * 2, 3)
        return z[: x.shape[0]] * 2, torch.arange(x.shape[0]), z.reshape(-1, 2).sum(1)


class Attention(torch.nn.Module):
    """One attention block over a dynamic sequence length."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        return x + self.out(y)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(y.flatten(1))


class Decoder(torch.nn.Module):
    """A decoder step over a dynamic number of tokens: embedding, RMS norm,
    positions from an arange, a causal mask built at run time, SDPA, a cat
    and the last token's row."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.norm = torch.nn.RMSNorm(8)
        self.q = torch.nn.Linear(8, 8)
        self.k = torch.nn.Linear(8, 8)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.norm(self.emb(tokens))
        pos = torch.arange(t).unsqueeze(0).expand(b, t)
        q = self.q(x).view(b, t, 2, 4).transpose(1, 2)
        k = self.k(x).view(b, t, 2, 4).transpose(1, 2)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.cat([att @ k, att @ q], dim=-1).transpose(1, 2).reshape(b, t, 16)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        return y.mean(-1) + pos, y[:, -1], sdpa


def _mlp():
    return Mlp(), (torch.randn(3, 4),), {"x": {0: Dim("b", min=1, max=8)}}


def _view_slice():
    return ViewSlice(), (torch.randn(3, 4),), {"x": {0: Dim("b", min=1, max=8)}}


def _attention():
    return Attention(), (torch.randn(1, 5, 8),), {"x": {1: Dim("seq", min=1, max=16)}}


def _conv():
    return ConvNet(), (torch.randn(2, 2, 8, 8),), {"x": {0: Dim("b", min=1, max=4)}}


def _decoder():
    return Decoder(), (torch.randint(0, 20, (2, 5)),), {"tokens": {1: Dim("t", min=1, max=12)}}


MODULES = [
    ("dyn_mlp", _mlp, lambda n: (torch.randn(n, 4),), [1, 5, 8]),
    ("dyn_view_slice", _view_slice, lambda n: (torch.randn(n, 4),), [1, 3, 8]),
    ("dyn_attention", _attention, lambda n: (torch.randn(1, n, 8),), [1, 7, 16]),
    ("dyn_conv", _conv, lambda n: (torch.randn(n, 2, 8, 8),), [1, 3, 4]),
    ("dyn_decoder", _decoder, lambda n: (torch.randint(0, 20, (2, n)),), [1, 7, 12]),
]
