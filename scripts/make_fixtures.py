"""Write the small .pt2 fixtures under tests/fixtures/ with deterministic
inputs and eager PyTorch outputs (.npy), so Rust tests need no Python.

Run with the project venv: /root/.cache/etmetal/venv/bin/python scripts/make_fixtures.py [NAME...]
"""
import copy
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


class LlamaBlock(nn.Module):
    """Llama-style: RMSNorm, rotary embedding, grouped-query causal SDPA,
    SiLU-gated MLP, greedy next token."""

    def __init__(self, vocab=32, d=16, heads=4, kv_heads=2, t=6):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.emb = nn.Embedding(vocab, d)
        self.norm1 = nn.RMSNorm(d, eps=1e-6)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.norm2 = nn.RMSNorm(d, eps=1e-6)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        f = torch.outer(torch.arange(t).float(), inv)
        self.register_buffer("cos", torch.cat([f, f], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([f, f], -1).sin(), persistent=False)

    def rope(self, x):
        half = self.hd // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        t = x.shape[2]
        return x * self.cos[:t] + rot * self.sin[:t]

    def forward(self, ids):
        x = self.emb(ids)
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, x[:, -1].argmax(-1)


class BertBlock(nn.Module):
    """BERT-style: word+position+type embeddings, additive padding mask,
    GELU MLP, tanh pooler."""

    def __init__(self, vocab=30, d=16, t=8):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t, d)
        self.typ = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d, eps=1e-12)
        self.qkv = nn.Linear(d, 3 * d)
        self.ln2 = nn.LayerNorm(d, eps=1e-12)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.pool = nn.Linear(d, d)
        self.register_buffer("position_ids", torch.arange(t).expand(1, -1))

    def forward(self, ids, mask):
        b, t = ids.shape
        x = self.word(ids) + self.pos(self.position_ids[:, :t]) + self.typ(torch.zeros_like(ids))
        x = self.ln(x)
        ext = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=ext, scale=0.25)
        x = self.ln2(x + a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.out(F.gelu(self.fc(x)))
        return x, torch.tanh(self.pool(x[:, 0]))


class MobileBlock(nn.Module):
    """MobileNetV2-ish pieces plus group norm, transposed conv and pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding="same", groups=8)
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.c1d = nn.Conv1d(4, 4, 3, padding=2, dilation=2)
        self.fc = nn.Linear(4, 5)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x = F.relu6(self.bn(self.conv(x)))
        x = F.leaky_relu(self.gn(F.hardswish(self.dw(x))), 0.1)
        y, idx = F.max_pool2d(x, 2, return_indices=True)
        z = F.avg_pool2d(y, 3, 1, 1, count_include_pad=False)
        u = self.up(y)
        s = self.c1d(u.flatten(2)).mean(-1)
        p = F.adaptive_avg_pool2d(u, 1).flatten(1)
        return self.fc(self.drop(p + s)), idx, z


class OpsMisc(nn.Module):
    """Many small ops at once: views, indexing, reductions, scalars."""

    def forward(self, x, i):
        a, b = x.chunk(2, dim=-1)
        views = torch.cat([a, b, a], 1) + 0 * torch.stack([a, b, a], 0).sum(0).repeat(1, 3)
        e = x.unsqueeze(0).squeeze(0).permute(1, 0).t().expand(2, 4, 6).reshape(8, 6)[:, 1:5:2]
        g = torch.index_select(x, 0, i) + torch.gather(x, 1, i.view(-1, 1).expand(-1, 6)) + x[i]
        w = torch.where(x > 0.5, x, x * 2).masked_fill(x < 0.2, -1.0)
        el = x.pow(2) + x.rsqrt() + x.sqrt() + x.exp() + x.log() + x.tanh() - x.neg() + x.abs() + x.reciprocal()
        el = el + x.clamp(0.2, 0.8) + x.sin() + x.cos() + torch.erf(x) + torch.sigmoid(x)
        red = x.sum(1, keepdim=True) + x.amax(0) + x.amin(1, keepdim=True) + x.var(1, keepdim=True) + x.std(0)
        tv, ti = x.topk(2, dim=1)
        mv, mi = x.max(1)
        am = x.argmax(1) + x.argmin()
        q = x.to(torch.float16).to(torch.float32) + x.int().float() + x.tril() + x.triu(1)
        t = F.pad(x, (1, 1, 0, 2), value=1.0)
        m = (x > 0.3).any(1) | (x < 0.9).all(1)
        s = 1 - x + torch.add(x, x, alpha=2) - torch.sub(x, x, alpha=3) + x / 2 + x.mean()
        ints = (i * 2).sum() + torch.arange(3) + torch.full((3,), 2) + torch.zeros_like(i) + torch.ones(3, dtype=torch.int64)
        return views, e, g, w, el, red, tv, ti, mv, mi, am, q, t, m, s, x.cumsum(1), ints, x.unbind(0)[2], i / 2


class InPlaceState(nn.Module):
    """In-place ops as `torch.export.export` keeps them (saved without
    `run_decompositions`): `relu_` (torchvision's `ReLU(inplace=True)`),
    `add_` of an intermediate, a cache buffer written by `index_copy_` and by
    slice assignment, one of its rows scaled through a `select` view, and a
    counter `+= 1`. STATEFUL: outputs of a second call are saved too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)
        self.register_buffer("cache", torch.zeros(3, 6))
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x, pos):
        h = self.relu(self.fc(x))
        h.add_(0.5)
        self.cache.index_copy_(1, pos, h[:, :2])
        self.cache[:, 4:6] = h[:, 2:]
        self.cache[0].mul_(2)
        self.count += 1
        return h.sum(1) + self.cache.sum(1) * self.count


class Recurrence:
    """Tensors held by a plain object, as transformers' cache layers hold
    their states: `torch.export`'s non-strict mode lifts them as
    constants."""

    def __init__(self):
        self.state = torch.zeros(2, 4)
        self.seen = torch.zeros(2, 1)


class LiftedState(nn.Module):
    """State held outside the module's attributes and written in place:
    `rec.state` is also registered as the buffer `state` (one tensor, two
    names, as transformers' recipe registers its caches), written through
    a `to` that returns it; `rec.seen` is registered nowhere, so the export
    keeps it as a lifted constant that the graph writes. Also tensor_split
    by indices and by sections, and eye (n, and n by m with a dtype).
    STATEFUL: outputs of a second call are saved too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rec = Recurrence()
        self.register_buffer("state", self.rec.state, persistent=False)

    def forward(self, x):
        a, b, _ = torch.tensor_split(x, [3, 4], dim=1)
        p, q = torch.tensor_split(x[:, :5], 2, dim=1)
        h = self.fc(torch.cat([a, b], 1))
        prev = self.rec.seen.clone()
        s = self.rec.state.to(torch.float32)
        s.copy_(s * 0.5 + h @ (torch.eye(4) * 0.5 + 0.25))
        self.rec.seen.copy_(b)
        e = torch.eye(2, 3, dtype=torch.float64).sum().float()
        return self.rec.state.sum(1) + prev.squeeze(1) + p.sum(1) * q.sum(1) + e


STATEFUL = {"inplace_state", "lifted_state"}


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
    yield "llama_block", LlamaBlock().eval(), (torch.randint(0, 32, (1, 6)),), False
    yield "bert_block", BertBlock().eval(), (torch.randint(0, 30, (1, 5)), torch.tensor([[1, 1, 1, 1, 0]])), False
    yield "mobile_block", MobileBlock().eval(), (torch.randn(1, 3, 12, 12),), False
    yield "mobile_block_decomposed", MobileBlock().eval(), (torch.randn(1, 3, 12, 12),), True
    ops_inputs = (torch.rand(4, 6) + 0.1, torch.tensor([0, 2, 3]))
    yield "ops_misc", OpsMisc(), ops_inputs, False
    yield "ops_misc_decomposed", OpsMisc(), ops_inputs, True
    yield "inplace_state", InPlaceState(), (torch.randn(3, 4), torch.tensor([3, 1])), False
    yield "lifted_state", LiftedState(), (torch.randn(2, 7),), False


# Bounded dynamic shapes, under dynamic/ (the static fixtures' tests run
# every top-level .pt2 at its example size): name -> (module, example
# inputs, dynamic_shapes).
def dynamic_fixtures():
    torch.manual_seed(0)
    seq = torch.export.Dim("seq", min=1, max=16)
    yield "dynamic/gpt_block_seq", GptBlock().eval(), (torch.randn(1, 5, 16),), ({1: seq},)


def save_npy(path, t):
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    np.save(path, t.numpy())


def all_fixtures():
    for name, module, args, decompose in fixtures():
        yield name, module, args, decompose, None
    for name, module, args, dynamic in dynamic_fixtures():
        yield name, module, args, False, dynamic


def main():
    """Write every fixture, or those named on the command line."""
    os.makedirs(OUT, exist_ok=True)
    only = set(sys.argv[1:])
    for name, module, args, decompose, dynamic in all_fixtures():
        if only and name not in only:
            continue
        # export a copy: exporting runs nothing, but a stateful module's
        # buffers must start from their initial values in eager below
        ep = torch.export.export(copy.deepcopy(module), args, dynamic_shapes=dynamic)
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
        if name in STATEFUL:
            with torch.no_grad():
                save_npy(os.path.join(OUT, f"{name}.call2.output_0.npy"), module(*args))
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"wrote fixtures: {total} bytes in {OUT}")
    if total > 1 << 20:
        sys.exit("fixtures exceed 1 MB")


if __name__ == "__main__":
    main()
