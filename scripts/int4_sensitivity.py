"""Where int4 (and int8) weight quantization loses a decoder LM's accuracy: the
arithmetic of crates/etmetal-graph/src/quantize/fit.rs reproduced in PyTorch
(fake quantization: each linear's weight replaced by its dequantized int4
form), the eager transformers model run on the first `--tokens` tokens of the
text scripts/eval_llm.py measures, each variant against the unquantized model.

    python scripts/int4_sensitivity.py --model ~/.cache/etmetal/gemma3-270m \
        --gguf gemma-3-270m-q4_k_m.gguf [--tokens 300] [--only REGEX]

`--only int8` runs the int8 variants alone (`--quantize int8`: codes
0..255, per output channel or per group of 32), per tensor kind, so a
missed int8 goal can be read weight by weight.

Both models run in float32 with the weights rounded to bfloat16 first (the
weights of the bfloat16 export `etmetal compile` quantizes), so the figures
are the weights' error alone, without bf16 activation rounding (which costs
eager bf16 ~3% agreement against float32 on this text). A variant is a
quantizer (below) and the set of weights it quantizes. Per variant: next-token
agreement with the reference (argmax equal), mean KL(reference || variant),
both perplexities, and the relative squared error |W - Ŵ|² / |W|² of the
quantized weights.

Quantizers (groups of `gs` along K, `w = code * scale + zero`, code 0..15):
- `minmax`: scale = (max - min) / 15, zero = min;
- `refine`: then alternately refit scale and zero by least squares to the
  codes and re-round the codes, per group while its error drops;
- `search`: llama.cpp's make_qkx2 search: for each candidate inverse scale
  r / (max - min), round the codes, refit scale and zero by least squares,
  keep the group's best; r over 14..16 step 0.2 (clipping the range a little,
  or widening it) and the integers 10..13 (a group whose values already sit
  on a 16-level grid using fewer than 16 levels, as the Q4_K tensors of a
  GGUF-dequantized model do, is then represented exactly). quantize/
  tried it and left it out (quantize/mod.rs's module comment has the figures);
- `h`: weigh each input channel's squared error (least squares and search
  alike) by `norm`, the square of the RMSNorm scale `1 + weight` feeding the
  linear (data-free; it made Gemma 3 worse), or `act`, the activations' mean
  square on the evaluated text itself (an oracle for calibration-based
  methods such as AWQ/GPTQ; `--calibrate` does GPTQ, quantize/gptq.rs);
- scale and zero are stored in the activation dtype (bf16): `round=after`
  rounds them after the codes are chosen (codes not re-rounded), `round=recode`
  re-rounds the codes to the rounded parameters, `round=none` keeps f32.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SEARCH_R = [14.0 + 0.2 * i for i in range(11)] + [float(r) for r in range(10, 14)]


def _codes(w, s, z, h, top=15):
    c = torch.round((w - z) / s).clamp_(0, top)
    return c, (h * (c * s + z - w) ** 2).sum(-1)


def _lsq(w, c, h):
    """Least-squares (scale, zero) of each group for codes `c` (errors
    weighted by `h`), and where valid."""
    n = h.sum(-1)
    sq, sqq, sw, sqw = (h * c).sum(-1), (h * c * c).sum(-1), (h * w).sum(-1), (h * c * w).sum(-1)
    det = n * sqq - sq * sq
    s = (n * sqw - sq * sw) / det.clamp(min=1e-30)
    z = (sw - s * sq) / n
    return s[:, None], z[:, None], (det > 1e-9 * n * sqq) & (s > 1e-12)


def quantize_groups(w: torch.Tensor, h: torch.Tensor, refine=True, search=False, rounds=6, round_params="after",
                    bits=4):
    """Dequantized `w [G, gs]`, one scale and zero per row; `h` weighs each
    element's squared error; codes of `bits` bits (the search: 4 only)."""
    w, h = w.double(), h.double()
    top = (1 << bits) - 1
    lo, hi = w.min(-1, keepdim=True).values, w.max(-1, keepdim=True).values
    s, z = ((hi - lo) / top).clamp(min=1e-8), lo
    c, err = _codes(w, s, z, h, top)
    if search:
        span = (hi - lo).clamp(min=1e-8)
        for r in SEARCH_R:
            tc = torch.round((w - lo) * (r / span)).clamp_(0, 15)
            ts, tz, ok = _lsq(w, tc, h)
            ts = torch.where(ok[:, None], ts, s)
            tz = torch.where(ok[:, None], tz, z)
            tc, terr = _codes(w, ts, tz, h)
            better = ok & (terr < err)
            s, z = torch.where(better[:, None], ts, s), torch.where(better[:, None], tz, z)
            c, err = torch.where(better[:, None], tc, c), torch.where(better, terr, err)
    if refine:
        trial, active = c.clone(), torch.ones_like(err, dtype=torch.bool)
        for _ in range(rounds):
            ts, tz, ok = _lsq(w, trial, h)
            active &= ok
            ts = torch.where(active[:, None], ts, s)
            tz = torch.where(active[:, None], tz, z)
            trial, terr = _codes(w, ts, tz, h, top)
            better = active & (terr < err)
            s, z = torch.where(better[:, None], ts, s), torch.where(better[:, None], tz, z)
            c, err = torch.where(better[:, None], trial, c), torch.where(better, terr, err)
            active &= better
            if not active.any():
                break
    if round_params != "none":
        s, z = s.to(torch.bfloat16).double(), z.to(torch.bfloat16).double()
        if round_params == "recode":
            c, _ = _codes(w, s, z, h, top)
    return (c * s + z).float()


def quantize(w: torch.Tensor, gs: int | None, h: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """`h [K]`: the importance of each input channel (ones if None); `gs`
    None: one group a row (per output channel)."""
    n, k = w.shape
    gs = gs or k
    groups = w.reshape(-1, gs)
    hg = (torch.ones(k) if h is None else h).reshape(1, k // gs, gs).expand(n, -1, -1).reshape(-1, gs)
    out = torch.empty_like(groups)
    step = 1 << 18
    for i in range(0, groups.shape[0], step):
        out[i:i + step] = quantize_groups(groups[i:i + step], hg[i:i + step], **kw)
    return out.reshape(n, k)


def linears(model) -> dict[str, torch.nn.Linear]:
    """Every linear of the decoder, by name (the tied LM head as `lm_head`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


ALL = lambda name: True  # noqa: E731
NO_HEAD = lambda name: name != "lm_head"  # noqa: E731
BASE = dict(refine=True, search=False, round_params="after", gs=32)


def by_kind(label: str, q: dict) -> list:
    """Variants quantizing one kind of weight with `q` each: all but the
    head, the head, attention, the MLPs, then each projection."""
    out = [
        (f"  {label}all but lm_head", NO_HEAD, q),
        (f"  {label}lm_head only", lambda n: n == "lm_head", q),
        (f"  {label}attention only (q,k,v,o)", lambda n: ".self_attn." in n, q),
        (f"  {label}mlp only (gate,up,down)", lambda n: ".mlp." in n, q),
    ]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        out.append((f"  {label}{proj} only", lambda n, p=proj: n.endswith(p), q))
    return out


def variants(layers: int):
    """(name, which weights, quantizer) of each variant."""
    last = layers - 1
    out = [("minmax+refine (quantize.rs before re-rounding), all", ALL, BASE), *by_kind("", BASE)]
    out += [
        ("  layer 0 only", lambda n: ".layers.0." in n, BASE),
        (f"  layer {last} only", lambda n, s=f".layers.{last}.": s in n, BASE),
        ("minmax, no refine", ALL, {**BASE, "refine": False}),
        ("minmax+refine, f32 scale/zero", ALL, {**BASE, "round_params": "none"}),
        ("minmax+refine, recode", ALL, {**BASE, "round_params": "recode"}),
        ("search+refine, recode", ALL, {**BASE, "search": True, "round_params": "recode"}),
        ("search+refine, recode, all but lm_head", NO_HEAD, {**BASE, "search": True, "round_params": "recode"}),
        ("norm-weighted refine, recode", ALL, {**BASE, "round_params": "recode", "h": "norm"}),
        ("activation-weighted refine, recode (oracle)", ALL, {**BASE, "round_params": "recode", "h": "act"}),
        ("minmax+refine, group 64", ALL, {**BASE, "gs": 64}),
        ("search+refine, recode, group 64", ALL, {**BASE, "search": True, "round_params": "recode", "gs": 64}),
    ]
    # --quantize int8: per output channel (the default) and per group of 32,
    # codes re-rounded to the stored scale and zero as quantize/fit.rs does
    int8 = {**BASE, "bits": 8, "round_params": "recode", "gs": None}
    out += [("int8 per channel, all", ALL, int8), ("int8 group 32, all", ALL, {**int8, "gs": 32})]
    return out + by_kind("int8 per channel, ", int8)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf")
    ap.add_argument("--text", type=Path, default=REPO / "tests/parity/data/around_the_world_ch1.txt")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--only", help="run the variants whose name matches this regex")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "scripts"))
    import export_llm

    torch.manual_seed(0)
    model, tokenizer = export_llm.load(args.model, args.gguf, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = tokenizer(args.text.read_text())["input_ids"][: args.tokens + 1]
    x, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    mods = linears(model)
    head_tied = model.lm_head.weight is model.get_input_embeddings().weight
    orig = {name: m.weight.detach().clone() for name, m in mods.items()}

    def run():
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=x).logits[0].double(), -1)

    # input-channel importance: the activations' mean square on this text
    # (an oracle: calibration data), or the square of the RMSNorm scale
    # `1 + weight` in front of the linear (no data)
    act = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: act.__setitem__(
        name, (a[0].double() ** 2).reshape(-1, a[0].shape[-1]).mean(0).float())) for name, m in mods.items()]
    ref = run()
    for hk in hooks:
        hk.remove()
    params = dict(model.named_parameters())

    def norm_scale(lname):
        norm = ("model.norm" if lname == "lm_head" else
                re.sub(r"self_attn\.[qkv]_proj$", "input_layernorm", re.sub(r"mlp\.(gate|up)_proj$", "pre_feedforward_layernorm", lname)))
        if norm + ".weight" not in params or norm == lname:
            return None
        return (1 + params[norm + ".weight"].detach().float()) ** 2

    importance = {"norm": {n: norm_scale(n) for n in mods}, "act": act}
    n = targets.shape[0]
    ref_ppl = torch.exp(-ref[torch.arange(n), targets].mean()).item()
    print(f"{n} tokens, reference perplexity {ref_ppl:.2f}, LM head tied: {head_tied}")
    print(f"{'variant':48} {'agree':>7} {'KL':>7} {'ppl':>7} {'rel err':>9} {'s':>4}")
    for name, which, q in variants(model.config.num_hidden_layers):
        if args.only and not re.search(args.only, name):
            continue
        t0 = time.time()
        q = dict(q)
        gs = q.pop("gs")
        hs = importance.get(q.pop("h", None), {})
        num = den = 0.0
        for lname, m in mods.items():
            w = orig[lname]
            new = quantize(w, gs, hs.get(lname), **q) if which(lname) else w
            if which(lname):
                num += ((new - w).double() ** 2).sum().item()
                den += (w.double() ** 2).sum().item()
            # untie the head: the embedding keeps its float table, as in etmetal
            m.weight = torch.nn.Parameter(new, requires_grad=False)
        lp = run()
        agree = (lp.argmax(-1) == ref.argmax(-1)).double().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        ppl = torch.exp(-lp[torch.arange(n), targets].mean()).item()
        print(f"{name:48} {agree:7.2%} {kl:7.4f} {ppl:7.2f} {num / max(den, 1e-30):9.2e} {time.time() - t0:4.0f}",
              flush=True)


if __name__ == "__main__":
    main()
