"""Parity of the importer's lowerings of what transformers, torchvision and
timm emit (device moves, eval-mode dropouts, diff, roll, einsum, norms,
weight norm, fills, as_strided, tensor_split, eye, ...): each small module is exported as it is
(no `run_decompositions`), run by etmetal on the CPU (`.pt2`) and compiled
for the GPU (`--backend metal`, run on this machine's adapter), and compared
with eager PyTorch in f32 (atol=rtol=1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo
from test_parity import compare, save

TOL = 1e-5


class Lambda(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *xs):
        return self.f(*xs)


class DeviceMoves(nn.Module):
    def forward(self, x, m):
        a = x.to(x.device)
        b = m.to(device=x.device, dtype=torch.float32)
        c = torch.ops.aten._to_copy(b, device=torch.device("cpu"))
        return a * c.type_as(x), m.type_as(x) + 1


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = nn.Dropout(0.3, inplace=True)
        self.f = nn.Dropout2d(0.5)
        self.a = nn.AlphaDropout(0.2)

    def forward(self, x):
        y = self.d(x * 2)
        return self.a(self.f(y)) + F.dropout(y, 0.4, training=False)


class WeightNormConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1), dim=2)

    def forward(self, x):
        return self.conv(x)


class Fills(nn.Module):
    def forward(self, x, y):
        z = x.clone()
        z[:, :1].zero_()
        w = y.clone().fill_(0.5)
        v = y.clone()
        v.fill_(x[0, 0])
        return z + w, v


class StridedViews(nn.Module):
    """Q, K and V as overlapping strided windows of one tensor, as the seed's
    strided-attention modules build them."""

    def forward(self, x):
        q = torch.as_strided(x, (2, 3, 4), (8, 4, 1))
        k = torch.as_strided(x, (2, 3, 4), (8, 2, 1), 2)
        return q * k, x.as_strided((4, 4), (1, 4))


class StridedWrite(nn.Module):
    """In-place writes through non-overlapping strided views reach the base."""

    def forward(self, x):
        y = x.clone()
        y.as_strided((2, 3), (8, 2), 1).mul_(3)
        y.as_strided((2,), (5,), 4).zero_()
        return y * 2


class Regions(nn.Module):
    """`torch.no_grad()` and disabled-autocast blocks, as transformers'
    rotary embeddings write them: a plain export keeps each as a region
    call (`wrap_with_set_grad_enabled`, `wrap_with_autocast`)."""

    def forward(self, x):
        y = x * 2
        with torch.no_grad():
            z = y.sin() + 1
            with torch.autocast("cpu", enabled=False):
                w = z.float() @ y.T
        return z * y, w


class Autocast(nn.Module):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ x.T


def r(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def ints(hi, *shape):
    return lambda g: torch.randint(0, hi, shape, generator=g)


# (name, module, input makers)
CASES = [
    ("device_moves", DeviceMoves, [r(2, 3), ints(2, 2, 3)]),
    ("expand_as_swapaxes", lambda: Lambda(lambda x, y: x.expand_as(y).swapaxes(0, 2) + y.swapdims(0, 2) + y.movedim(0, -1).movedim(-1, 0).swapaxes(0, 2)), [r(3, 1), r(2, 3, 4)]),
    ("dropouts_eval", Dropouts, [r(2, 3, 4, 4)]),
    ("diff", lambda: Lambda(lambda x, p: (torch.diff(x, dim=0, prepend=p), torch.diff(x, n=2), torch.diff(x > 0, dim=0))), [r(5, 4), r(1, 4)]),
    ("min_max_other", lambda: Lambda(lambda x, y: (torch.min(x, y), torch.max(x, y), torch.fmax(x, y), torch.fmin(x, y), torch.clamp(x, min=y, max=y + 0.5))), [r(3, 4), r(1, 4)]),
    ("fmax_nan", lambda: Lambda(lambda x, y: torch.fmax(torch.where(x > 0.5, float("nan"), x), y)), [r(3, 4), r(3, 4)]),
    ("roll", lambda: Lambda(lambda x: (torch.roll(x, (1, -2), (0, 2)), torch.roll(x, 5), torch.roll(x, -7, 1))), [r(3, 4, 5)]),
    ("einsum_attention", lambda: Lambda(lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k)), [r(2, 3, 4, 8), r(2, 3, 5, 8)]),
    ("einsum_misc", lambda: Lambda(lambda a, b, s: (torch.einsum("...ij,...jk->...ik", a, b), torch.einsum("ii->i", s), torch.einsum("ij->", s), torch.einsum("i,j->ij", s[0], s[1]), torch.einsum("bij,bjk,bkl->bil", a, b, b.transpose(1, 2)))), [r(2, 3, 4), r(2, 4, 5), r(4, 4)]),
    ("vector_norms", lambda: Lambda(lambda x: (torch.linalg.vector_norm(x), torch.linalg.vector_norm(x, 1, dim=1, keepdim=True), torch.linalg.vector_norm(x, float("inf"), dim=(0, 2)), torch.linalg.vector_norm(x, -float("inf"), dim=-1), torch.linalg.vector_norm(x, 3.5, dim=0), torch.linalg.vector_norm(x, 0, dim=1), torch.norm(x, dim=-1), F.normalize(x, dim=-1))), [r(3, 4, 5)]),
    ("weight_norm", WeightNormConv, [r(1, 4, 10)]),
    ("fills", Fills, [r(2, 3), r(2, 3)]),
    ("as_strided", StridedViews, [r(32)]),
    ("as_strided_write", StridedWrite, [r(4, 4)]),
    ("activations", lambda: Lambda(lambda x: (F.softplus(x, 2.0, 3.0), F.mish(x), F.logsigmoid(x), F.elu(x, 0.7), F.selu(x), F.celu(x, 1.3), torch.expm1(x), torch.log1p(x.abs()), F.hardshrink(x, 0.3), F.softshrink(x, 0.3), F.threshold(x, 0.1, -2.0), F.glu(x, 1), torch.trunc(x * 3), torch.frac(x * 3))), [r(3, 8)]),
    ("reductions_and_products", lambda: Lambda(lambda x, y: (torch.logsumexp(x, 1), torch.logsumexp(x, (0, 1), keepdim=True), torch.addcmul(x, x, y, value=0.5), torch.addcdiv(x, x, y.abs() + 1, value=-2), torch.baddbmm(x.unsqueeze(0), x.unsqueeze(0), y.unsqueeze(0).mT, beta=0.5, alpha=2.0), torch.outer(x[0], y[1]), x.mT @ y, torch.lerp(x, y, 0.3))), [r(4, 4), r(4, 4)]),
    ("nan_inf", lambda: Lambda(lambda x: (torch.isnan(x / x), torch.isinf(1 / x), torch.isfinite(1 / x), torch.nan_to_num(torch.log(x)), torch.nan_to_num(1 / x, nan=1.0, posinf=2.0, neginf=-3.0))), [lambda g: torch.tensor([[0.0, -1.0, 2.0], [float("inf"), -float("inf"), 0.5]])]),
    ("upsample", lambda: Lambda(lambda x: (F.interpolate(x, scale_factor=2), F.interpolate(x, size=(5, 7)), F.interpolate(x, size=(3, 10), mode="nearest-exact"), F.interpolate(x, scale_factor=1.5, mode="bilinear"), F.interpolate(x, size=(7, 5), mode="bilinear", align_corners=True), F.interpolate(x[:, :, 0], scale_factor=3, mode="linear"), F.upsample(x, scale_factor=(2, 3), mode="nearest"))), [r(1, 2, 4, 6)]),
    ("unfold", lambda: Lambda(lambda x: (x.unfold(1, 3, 2), x.unfold(-1, 2, 1) * 2, x.unfold(0, 2, 3))), [r(5, 7, 4)]),
    ("scatter_one_hot", lambda: Lambda(lambda x, i: (x.scatter(1, i, -x), x.scatter(0, i[:2].remainder(4), 7.5), torch.zeros(4, 5).scatter_add(1, i, x), F.one_hot(i, 5), F.one_hot(i[0, 0], 5))), [r(4, 5), lambda g: torch.stack([torch.randperm(5, generator=g) for _ in range(4)])]),
    ("index_add_accumulate", lambda: Lambda(lambda x, s: (x.index_add(1, torch.tensor([0, 2, 2, 4]), s, alpha=0.5), x.index_put((torch.tensor([3, 0, 3]),), s[0, :3].reshape(3, 1), accumulate=True))), [r(4, 5), r(4, 4)]),
    ("sort", lambda: Lambda(lambda x: (*torch.sort(x), *torch.sort(x, dim=0, descending=True), torch.argsort(x, dim=1, descending=True))), [r(5, 6)]),
    ("no_grad_autocast_regions", Regions, [r(3, 4)]),
    ("flip_prelu_pixel_shuffle", lambda: Lambda(lambda x, w: (torch.flip(x, (1, 3)), F.prelu(x, w), F.pixel_shuffle(x, 2), F.pixel_unshuffle(x, 2))), [r(1, 4, 4, 6), r(4)]),
]

def grouped_mm(x, w, ids):
    """transformers' MoE grouped matmul: `x`'s rows by their expert's
    weights, the groups counted by `histc` (ids past max=2 are dropped, so
    the last rows fall past every group and come out zero)."""
    import transformers.integrations.moe  # noqa: F401 - registers the op

    counts = torch.histc(ids.float(), bins=3, min=0, max=2)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs), counts


class MoeGroupedMm(nn.Module):
    def forward(self, x, w, ids):
        return grouped_mm(x, w, ids.sort().values)


CASES += [
    ("bicubic", lambda: Lambda(lambda x: (F.interpolate(x, scale_factor=1.5, mode="bicubic"), F.interpolate(x, size=(3, 5), mode="bicubic", align_corners=True), F.interpolate(x, size=(9, 4), mode="bicubic"))), [r(1, 2, 4, 6)]),
    ("histc", lambda: Lambda(lambda x: (torch.histc(x, bins=7, min=-1, max=1.5), torch.histc(torch.cat([x.flatten(), torch.tensor([1.5, -1.0, 3.0])]), bins=4, min=-1, max=1.5))), [r(3, 5)]),
    ("moe_grouped_mm", MoeGroupedMm, [r(7, 4), r(3, 4, 5), lambda g: torch.tensor([2, 0, 3, 1, 0, 2, 3])]),
    # fewer rows than experts (a decode step's): gathered experts, experts 0
    # and 1 empty, the row of id 3 past every group
    ("moe_grouped_mm_routed", MoeGroupedMm, [r(2, 4), r(3, 4, 5), lambda g: torch.tensor([3, 2])]),
    ("meshgrid", lambda: Lambda(lambda a, b, c: (*torch.meshgrid(a, b, indexing="xy"), *torch.meshgrid(a, b, c, indexing="ij"), *torch.meshgrid(a, c[0], indexing="xy"))), [r(3), r(4), r(2)]),
    ("pool_kernel_over_input", lambda: Lambda(lambda x: (F.avg_pool2d(x, 9, ceil_mode=True), F.avg_pool2d(x, 9, padding=2, ceil_mode=True), F.avg_pool2d(x, 9, padding=2, ceil_mode=True, count_include_pad=False), F.max_pool2d(x, (7, 3), ceil_mode=True), F.avg_pool1d(x[0], 8, ceil_mode=True))), [r(1, 2, 4, 6)]),
    ("im2col_col2im", lambda: Lambda(lambda x, cols: (F.unfold(x, 2, stride=2), F.unfold(x, (3, 2), dilation=(1, 2), padding=1, stride=(2, 1)), F.unfold(x[0], 3), F.fold(cols, (5, 6), (2, 3), dilation=(2, 1), padding=(1, 0), stride=(1, 2)), F.fold(F.unfold(x, 2, stride=2), (4, 6), 2, stride=2), F.fold(cols[0], (5, 6), (2, 3), dilation=(2, 1), padding=(1, 0), stride=(1, 2)))), [r(1, 2, 4, 6), r(1, 12, 10)]),
    # Mamba's and Qwen3.5's scans split off their sequential tail (often
    # empty, never read); Qwen3.5's chunked delta rule adds an eye
    ("tensor_split_eye", lambda: Lambda(lambda x: (*torch.tensor_split(x, [1, -2], dim=1), *torch.tensor_split(x, 3, dim=0)[::2], torch.tensor_split(x, [2, 9], dim=1)[0], torch.tensor_split(x, torch.tensor(4), dim=1)[3], x[:3, :3] @ torch.eye(3), torch.eye(3, 5, dtype=torch.int64) * 2, torch.eye(2, dtype=torch.bool) & (x[:2, :2] > 0))), [r(5, 6)]),
    ("view_like_aliases", lambda: Lambda(lambda x, y, i: (x.view_as(y), x.reshape_as(y) * 2, torch.broadcast_to(x[:1], (3, 2, 6)), torch.concat([x, x], 1), torch.cumsum(i, 0, dtype=torch.int32), torch.cumsum(x, 1, dtype=torch.float64))), [r(2, 6), r(3, 4), ints(5, 6)]),
]

# ops whose default export etmetal refuses with a hint to `run_decompositions()`,
# and whose decomposed export it runs
HINTED = [
    ("logit", lambda x: torch.logit(x.sigmoid(), eps=1e-3)),
    ("cosine_similarity", lambda x: F.cosine_similarity(x, x.flip(0) + 1, dim=1)),
]


# WGSL lets a GPU compiler assume no NaN is present, so the partitioner keeps
# NaN tests (`x != x`) on the CPU; these cases check that the rest still runs
# on the GPU and the whole matches eager.
CPU_ONLY: dict[str, str] = {}


@pytest.mark.parametrize(
    "name,make,makers,fmt",
    [pytest.param(*c, f, id=f"{c[0]}-{f}") for c in CASES for f in ("pt2", "gpu") if not (f == "gpu" and c[0] in CPU_ONLY)],
)
def test_lowering_parity(name, make, makers, fmt, etmetal, etmetal_gpu, tmp_path):
    torch.manual_seed(0)
    module = make().eval()
    g = torch.Generator().manual_seed(1)
    inputs = tuple(m(g) for m in makers)
    want = zoo.eager_outputs(module, inputs)
    ep = torch.export.export(module, inputs, strict=False)
    runner = etmetal if fmt == "pt2" else etmetal_gpu
    res = runner.run(save(ep, tmp_path / f"{name}.pt2"), inputs, tmp_path)
    where = f"{name} [{fmt}], ops: {', '.join(zoo.op_targets(ep))}"
    assert res.returncode == 0, f"{where}\n{res.describe()}"
    if fmt == "gpu":
        assert "ran on gpu" in res.stdout, f"{where}\ndelegates did not run on a GPU\n{res.describe()}"
    assert len(res.outputs) == len(want), f"{where}\n{res.describe()}"
    problems = [f"output {i}: {m}" for i, (o, w) in enumerate(zip(res.outputs, want)) if (m := compare(o, w, TOL, TOL))]
    assert not problems, f"{where}\n" + "\n".join(problems)


@pytest.mark.parametrize("name,f", HINTED, ids=[h[0] for h in HINTED])
def test_hinted_rewrite_works(name, f, etmetal, tmp_path):
    module = Lambda(f).eval()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    want = zoo.eager_outputs(module, (x,))
    ep = torch.export.export(module, (x,), strict=False)
    res = etmetal.run(save(ep, tmp_path / "default.pt2"), (x,), tmp_path / "default")
    assert res.returncode == 2 and "ep.run_decompositions()" in res.stderr, res.describe()
    res = etmetal.run(save(ep.run_decompositions(), tmp_path / "decomposed.pt2"), (x,), tmp_path / "decomposed")
    assert res.returncode == 0, res.describe()
    problem = compare(res.outputs[0], want[0], TOL, TOL)
    assert problem is None, problem


def test_enabled_autocast_is_refused_then_decomposed(etmetal, tmp_path):
    """An enabled autocast region changes dtypes, which only
    `run_decompositions()` spells out: the plain export is refused naming the
    rewrite, the decomposed one runs (bf16 products, so bf16's tolerance)."""
    module = Autocast().eval()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    want = zoo.eager_outputs(module, (x,))
    ep = torch.export.export(module, (x,), strict=False)
    assert "wrap_with_autocast" in str(ep.graph)
    res = etmetal.run(save(ep, tmp_path / "default.pt2"), (x,), tmp_path / "default")
    assert res.returncode == 2 and "torch.autocast" in res.stderr and "ep.run_decompositions()" in res.stderr, \
        res.describe()
    res = etmetal.run(save(ep.run_decompositions(), tmp_path / "decomposed.pt2"), (x,), tmp_path / "decomposed")
    assert res.returncode == 0, res.describe()
    problem = compare(res.outputs[0], want[0], 2e-2, 2e-2)
    assert problem is None, problem
