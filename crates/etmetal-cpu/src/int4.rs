//! The weight-only quantized ops ([`Op::Int4Linear`], [`Op::Int8Linear`],
//! [`Op::GatherQmv`]) and the gated delta rule ([`Op::GatedDeltaRule`]).
//! The linears (one kernel for both code widths) dequantize one panel of
//! the weight at a time into f32 and run the GEMM on it, as llama.cpp and
//! candle do on CPU (measured faster than a direct packed dot product from
//! M = 1 up); a panel is the same bytes' work for int8 as for int4, so the
//! time per weight byte is the same. The gather reads each row's expert directly:
//! per group it takes `dot(x, q)` and `sum(x)`, so
//! `x · w = scale * dot(x, q) + zero * sum(x)` needs no dequantized weight.
//! Everything is computed in f32 and stored in the output dtype.
//!
//! [`Op::Int4Linear`]: etmetal_core::Op::Int4Linear
//! [`Op::Int8Linear`]: etmetal_core::Op::Int8Linear
//! [`Op::GatherQmv`]: etmetal_core::Op::GatherQmv
//! [`Op::GatedDeltaRule`]: etmetal_core::Op::GatedDeltaRule

use etmetal_core::quant::{check_activation, check_weight, QuantDims, QuantFormat};
use etmetal_core::{DType, Result, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::ctx::Ctx;
use crate::matmul::{Mat, MatElem};

/// Output channels per task of the linear: each task dequantizes a
/// `TILE_COLS × TILE_K` panel of the weight into its own f32 scratch and
/// hands it to the GEMM, so the whole dequantized weight never exists.
const TILE_COLS: usize = 64;
/// K per panel, rounded down to whole groups (at least one: an int8
/// group of a whole row makes the panel the row); 64 × 512 f32 (128 KiB)
/// stays in L2 while the GEMM packs it.
const TILE_K: usize = 512;

fn spec(t: &Tensor) -> (DType, &[usize]) {
    (t.dtype(), t.shape())
}

/// One quantized weight (or one expert's) as borrowed rows.
struct Weight<'a> {
    dims: QuantDims,
    packed: &'a [u8],
    scales: &'a [f32],
    zeros: &'a [f32],
}

impl Weight<'_> {
    /// `sum_k x[k] * w[n, k]` for row `n` of an int4 weight, `xsum` the
    /// per-group sums of `x`.
    fn dot_row(&self, n: usize, x: &[f32], xsum: &[f32]) -> f32 {
        let (k, gs, groups) = (self.dims.k, self.dims.group_size(), self.dims.groups());
        let row = &self.packed[n * k / 2..(n + 1) * k / 2];
        let mut acc = 0.0f32;
        for g in 0..groups {
            let bytes = &row[g * gs / 2..(g + 1) * gs / 2];
            let xs = &x[g * gs..(g + 1) * gs];
            let mut dq = 0.0f32;
            for (b, pair) in bytes.iter().zip(xs.chunks_exact(2)) {
                dq += pair[0] * (b & 15) as f32 + pair[1] * (b >> 4) as f32;
            }
            acc += self.scales[n * groups + g] * dq + self.zeros[n * groups + g] * xsum[g];
        }
        acc
    }

    /// Row `n`, columns `k0..k0 + out.len()` (whole groups), dequantized
    /// into `out` (the linear's panel).
    fn dequant_row(&self, n: usize, k0: usize, out: &mut [f32]) {
        let (k, gs, groups) = (self.dims.k, self.dims.group_size(), self.dims.groups());
        let per = self.dims.format.per_byte();
        let row = &self.packed[(n * k + k0) / per..(n * k + k0 + out.len()) / per];
        let g0 = n * groups + k0 / gs;
        for (g, (bytes, dst)) in row
            .chunks_exact(gs / per)
            .zip(out.chunks_exact_mut(gs))
            .enumerate()
        {
            let (s, z) = (self.scales[g0 + g], self.zeros[g0 + g]);
            match per {
                2 => {
                    for (b, pair) in bytes.iter().zip(dst.chunks_exact_mut(2)) {
                        pair[0] = (b & 15) as f32 * s + z;
                        pair[1] = (b >> 4) as f32 * s + z;
                    }
                }
                _ => {
                    for (b, d) in bytes.iter().zip(dst.iter_mut()) {
                        *d = *b as f32 * s + z;
                    }
                }
            }
        }
    }
}

fn group_sums(x: &[f32], gs: usize) -> Vec<f32> {
    x.chunks_exact(gs).map(|c| c.iter().sum()).collect()
}

/// `y [M, N] = x [M, K] @ W.T`.
fn linear_f32(w: &Weight, x: &[f32], m: usize) -> Vec<f32> {
    let (n, k) = (w.dims.n, w.dims.k);
    let gs = w.dims.group_size();
    // panels of whole groups
    let tile_k = ((TILE_K / gs).max(1) * gs).min(k);
    let mut y = vec![0.0f32; m * n];
    let blocks: Vec<(std::ops::Range<usize>, Vec<f32>)> = (0..n.div_ceil(TILE_COLS))
        .into_par_iter()
        .map_init(
            || vec![0.0f32; TILE_COLS * tile_k],
            |panel, blk| {
                let cols = blk * TILE_COLS..((blk + 1) * TILE_COLS).min(n);
                let nc = cols.len();
                let mut out = vec![0.0f32; m * nc];
                for k0 in (0..k).step_by(tile_k) {
                    let kc = tile_k.min(k - k0);
                    let panel = &mut panel[..nc * kc];
                    for (t, j) in cols.clone().enumerate() {
                        w.dequant_row(j, k0, &mut panel[t * kc..(t + 1) * kc]);
                    }
                    // out [M, nc] (+)= x[:, k0..k0 + kc] @ panel.T
                    let a = Mat {
                        data: &x[k0..],
                        rs: k,
                        cs: 1,
                    };
                    let b = Mat {
                        data: panel,
                        rs: 1,
                        cs: kc,
                    };
                    f32::gemm(&mut out, m, nc, kc, a, b, k0 > 0, Parallelism::None);
                }
                (cols, out)
            },
        )
        .collect();
    for (cols, out) in blocks {
        let nc = cols.len();
        for i in 0..m {
            y[i * n + cols.start..i * n + cols.end].copy_from_slice(&out[i * nc..(i + 1) * nc]);
        }
    }
    y
}

pub(crate) fn quant_linear(ctx: &Ctx, format: QuantFormat) -> Result<Tensor> {
    let x = ctx.input(0)?;
    check_activation("activations", x.dtype()).map_err(|e| e.context(ctx.name()))?;
    let k = *x.shape().last().ok_or_else(|| ctx.invalid("0-d input"))?;
    let (p, s, z) = (ctx.input(1)?, ctx.input(2)?, ctx.input(3)?);
    let dims = check_weight(format, k, spec(p), spec(s), spec(z), false)
        .map_err(|e| e.context(ctx.name()))?;
    let (scales, zeros) = (s.to_f32_vec(), z.to_f32_vec());
    let w = Weight {
        dims,
        packed: p.bytes(),
        scales: &scales,
        zeros: &zeros,
    };
    let m = x.numel() / k.max(1);
    let y = linear_f32(&w, &x.to_f32_vec(), m);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = dims.n;
    Tensor::from_f32(x.dtype(), &shape, &y)
}

pub(crate) fn gather_qmv(ctx: &Ctx, group_size: usize) -> Result<Tensor> {
    let x = ctx.input(0)?;
    check_activation("activations", x.dtype()).map_err(|e| e.context(ctx.name()))?;
    let [pairs, k] = x.shape()[..] else {
        return Err(ctx.invalid(format!("activations {:?}: [P, K] expected", x.shape())));
    };
    let (p, s, z, idx) = (ctx.input(1)?, ctx.input(2)?, ctx.input(3)?, ctx.input(4)?);
    let dims = check_weight(
        QuantFormat::int4(group_size),
        k,
        spec(p),
        spec(s),
        spec(z),
        true,
    )
    .map_err(|e| e.context(ctx.name()))?;
    let experts = idx.to_i64_vec();
    if experts.len() != pairs {
        return Err(ctx.invalid(format!("{} expert indices for {pairs} rows", experts.len())));
    }
    if let Some(bad) = experts
        .iter()
        .find(|&&e| e < 0 || e as usize >= dims.experts)
    {
        return Err(ctx.invalid(format!(
            "expert index {bad} is out of range for {} experts",
            dims.experts
        )));
    }
    let (scales, zeros, xs) = (s.to_f32_vec(), z.to_f32_vec(), x.to_f32_vec());
    let (n, per_w, per_s) = (dims.n, dims.n * k / 2, dims.n * dims.groups());
    let y: Vec<f32> = (0..pairs)
        .into_par_iter()
        .flat_map_iter(|i| {
            let e = experts[i] as usize;
            let w = Weight {
                dims,
                packed: &p.bytes()[e * per_w..(e + 1) * per_w],
                scales: &scales[e * per_s..(e + 1) * per_s],
                zeros: &zeros[e * per_s..(e + 1) * per_s],
            };
            let xr = &xs[i * k..(i + 1) * k];
            let xsum = group_sums(xr, group_size);
            (0..n)
                .map(move |j| w.dot_row(j, xr, &xsum))
                .collect::<Vec<_>>()
        })
        .collect();
    Tensor::from_f32(x.dtype(), &[pairs, n], &y)
}

pub(crate) fn gated_delta_rule(ctx: &Ctx) -> Result<Vec<Tensor>> {
    let t: Vec<&Tensor> = (0..6).map(|i| ctx.input(i)).collect::<Result<_>>()?;
    let (q, k, v, g, beta, state) = (t[0], t[1], t[2], t[3], t[4], t[5]);
    let [b, steps, hk, dk] = q.shape()[..] else {
        return Err(ctx.invalid(format!("q {:?}: [B, T, Hk, Dk] expected", q.shape())));
    };
    let [_, _, hv, dv] = v.shape()[..] else {
        return Err(ctx.invalid(format!("v {:?}: [B, T, Hv, Dv] expected", v.shape())));
    };
    if k.shape() != q.shape()
        || g.shape() != [b, steps, hv]
        || beta.shape() != [b, steps, hv]
        || state.shape() != [b, hv, dv, dk]
        || hk == 0
        || !hv.is_multiple_of(hk)
    {
        return Err(ctx.invalid("q, k, v, g, beta and state shapes disagree"));
    }
    let (qf, kf, vf, gf, bf) = (
        q.to_f32_vec(),
        k.to_f32_vec(),
        v.to_f32_vec(),
        g.to_f32_vec(),
        beta.to_f32_vec(),
    );
    let mut s = state.to_f32_vec();
    let rep = hv / hk;
    let mut y = vec![0.0f32; b * steps * hv * dv];
    // Each (batch, value head) runs its own recurrence.
    let ys: Vec<Vec<f32>> = s
        .par_chunks_mut(dv * dk)
        .enumerate()
        .map(|(bh, s)| {
            let (bi, h) = (bh / hv, bh % hv);
            let kh = h / rep;
            let mut out = vec![0.0f32; steps * dv];
            for ti in 0..steps {
                let qk_at = ((bi * steps + ti) * hk + kh) * dk;
                let (qt, kt) = (&qf[qk_at..qk_at + dk], &kf[qk_at..qk_at + dk]);
                let v_at = ((bi * steps + ti) * hv + h) * dv;
                let vt = &vf[v_at..v_at + dv];
                let gb = (bi * steps + ti) * hv + h;
                let (gt, bt) = (gf[gb], bf[gb]);
                for (r, row) in s.chunks_exact_mut(dk).enumerate() {
                    let mut mem = 0.0f32;
                    for (sv, kv) in row.iter_mut().zip(kt) {
                        *sv *= gt;
                        mem += *sv * kv;
                    }
                    let delta = (vt[r] - mem) * bt;
                    let mut acc = 0.0f32;
                    for ((sv, kv), qv) in row.iter_mut().zip(kt).zip(qt) {
                        *sv += kv * delta;
                        acc += *sv * qv;
                    }
                    out[ti * dv + r] = acc;
                }
            }
            out
        })
        .collect();
    for (bh, out) in ys.iter().enumerate() {
        let (bi, h) = (bh / hv, bh % hv);
        for ti in 0..steps {
            let at = ((bi * steps + ti) * hv + h) * dv;
            y[at..at + dv].copy_from_slice(&out[ti * dv..(ti + 1) * dv]);
        }
    }
    Ok(vec![
        Tensor::from_f32(q.dtype(), &[b, steps, hv, dv], &y)?,
        Tensor::from_f32(state.dtype(), state.shape(), &s)?,
    ])
}

#[cfg(test)]
mod tests {
    use crate::execute;
    use etmetal_core::quant::{pack, QuantFormat, GROUP_SIZES};
    use etmetal_core::{DType, Op, Tensor};

    /// A deterministic pseudo-random stream in [-1, 1).
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Random int4 weight `[N, K]`: (q, packed, scales, zeros).
    fn weight(n: usize, k: usize, gs: usize) -> (Vec<u8>, Tensor, Vec<f32>, Vec<f32>) {
        weight_bits(4, n, k, gs)
    }

    /// Random weight `[N, K]` of `bits`-bit codes: (q, packed, scales, zeros).
    fn weight_bits(
        bits: u32,
        n: usize,
        k: usize,
        gs: usize,
    ) -> (Vec<u8>, Tensor, Vec<f32>, Vec<f32>) {
        let levels = 1u32 << bits;
        let q: Vec<u8> = noise(1, n * k)
            .iter()
            .map(|v| (((v + 1.0) * levels as f32 / 2.0) as u32 % levels) as u8)
            .collect();
        let scales: Vec<f32> = noise(2, n * k / gs)
            .iter()
            .map(|v| 0.05 + v.abs() * 0.1)
            .collect();
        let zeros: Vec<f32> = noise(3, n * k / gs)
            .iter()
            .map(|v| -0.5 * v.abs())
            .collect();
        let per = 8 / bits as usize;
        let packed = Tensor::from_slice(DType::U8, &[n, k / per], &pack(bits, &q)).unwrap();
        (q, packed, scales, zeros)
    }

    /// The eager reference: dequantize, then an f64 matmul.
    fn reference(
        x: &[f32],
        m: usize,
        w: &(Vec<u8>, Tensor, Vec<f32>, Vec<f32>),
        n: usize,
        k: usize,
        gs: usize,
    ) -> Vec<f32> {
        let (q, _, s, z) = w;
        let mut y = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for kk in 0..k {
                    let g = j * (k / gs) + kk / gs;
                    let wv = q[j * k + kk] as f64 * s[g] as f64 + z[g] as f64;
                    acc += x[i * k + kk] as f64 * wv;
                }
                y[i * n + j] = acc as f32;
            }
        }
        y
    }

    #[test]
    fn int4_linear_matches_the_dequantized_product() {
        for (m, n, k, gs) in [
            (1, 10, 64, 32),
            (3, 7, 128, 64),
            (20, 33, 256, 128),
            (9, 4, 256, 256),
        ] {
            let w = weight(n, k, gs);
            let x = noise(4, m * k);
            let want = reference(&x, m, &w, n, k, gs);
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
                let xt = Tensor::from_f32(dtype, &[m, k], &x).unwrap();
                let st = Tensor::from_f32(DType::F32, &[n, k / gs], &w.2).unwrap();
                let zt = Tensor::from_f32(DType::F32, &[n, k / gs], &w.3).unwrap();
                let out = execute(
                    &Op::Int4Linear { group_size: gs },
                    &[Some(&xt), Some(&w.1), Some(&st), Some(&zt)],
                    &[(dtype, vec![m, n])],
                )
                .unwrap();
                let xr = xt.to_f32_vec();
                let want = if dtype == DType::F32 {
                    want.clone()
                } else {
                    reference(&xr, m, &w, n, k, gs)
                };
                for (a, b) in out[0].to_f32_vec().iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= tol * (1.0 + b.abs()),
                        "{m}x{n}x{k} {dtype}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn int4_linear_matches_the_reference_at_odd_sizes_for_every_group_size() {
        // K is an odd number of groups past one 512-wide panel and N leaves
        // a partial block of output channels; M = 1 is a decoder step.
        for gs in GROUP_SIZES {
            let (n, k) = (67, gs * (512 / gs + 1 + (512 / gs) % 2));
            let w = weight(n, k, gs);
            let st = Tensor::from_f32(DType::F32, &[n, k / gs], &w.2).unwrap();
            let zt = Tensor::from_f32(DType::F32, &[n, k / gs], &w.3).unwrap();
            for m in [1, 13] {
                let x = noise(5, m * k);
                let want = reference(&x, m, &w, n, k, gs);
                let xt = Tensor::from_f32(DType::F32, &[m, k], &x).unwrap();
                let out = execute(
                    &Op::Int4Linear { group_size: gs },
                    &[Some(&xt), Some(&w.1), Some(&st), Some(&zt)],
                    &[(DType::F32, vec![m, n])],
                )
                .unwrap();
                for (a, b) in out[0].to_f32_vec().iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{m}x{n}x{k} group {gs}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// int8 per output channel (a group of all of K, not a divisor of the
    /// 512-wide panel) and per group, on uint8 bytes and their int32
    /// words: against the dequantized product.
    #[test]
    fn int8_linear_matches_the_dequantized_product() {
        for (m, n, k, gs) in [
            (1, 67, 640, 640),
            (5, 9, 2048, 2048),
            (13, 70, 768, 32),
            (2, 5, 1024, 128),
        ] {
            let w = weight_bits(8, n, k, gs);
            assert!(w.0.iter().any(|&q| q > 200), "codes use the 8-bit range");
            let st = Tensor::from_f32(DType::BF16, &[n, k / gs], &w.2).unwrap();
            let zt = Tensor::from_f32(DType::BF16, &[n, k / gs], &w.3).unwrap();
            // the reference reads the parameters as stored (bf16)
            let stored = (w.0.clone(), w.1.clone(), st.to_f32_vec(), zt.to_f32_vec());
            let x = noise(6, m * k);
            let want = reference(&x, m, &stored, n, k, gs);
            let words = etmetal_core::quant::as_words(&w.1).unwrap();
            for packed in [&w.1, &words] {
                let xt = Tensor::from_f32(DType::F32, &[m, k], &x).unwrap();
                let out = execute(
                    &QuantFormat::int8(gs).linear_op(),
                    &[Some(&xt), Some(packed), Some(&st), Some(&zt)],
                    &[(DType::F32, vec![m, n])],
                )
                .unwrap();
                for (a, b) in out[0].to_f32_vec().iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{m}x{n}x{k} group {gs}: {a} vs {b}"
                    );
                }
            }
        }
        // a group that is no multiple of 32 is named
        let w = weight_bits(8, 4, 96, 96);
        let s = Tensor::from_f32(DType::F32, &[4, 2], &[0.1; 8]).unwrap();
        let e = execute(
            &QuantFormat::int8(48).linear_op(),
            &[
                Some(&Tensor::from_f32(DType::F32, &[1, 96], &[0.5; 96]).unwrap()),
                Some(&w.1),
                Some(&s),
                Some(&s),
            ],
            &[(DType::F32, vec![1, 4])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("int8 group size 48"), "{e}");
    }

    #[test]
    fn gather_qmv_uses_each_rows_expert() {
        let (e, n, k, gs) = (3, 8, 64, 32);
        let ws: Vec<_> = (0..e).map(|_| weight(n, k, gs)).collect();
        // Distinct experts: scale expert i's scales by i + 1.
        let mut packed = vec![];
        let (mut sc, mut ze) = (vec![], vec![]);
        for (i, w) in ws.iter().enumerate() {
            packed.extend_from_slice(w.1.bytes());
            sc.extend(w.2.iter().map(|v| v * (i + 1) as f32));
            ze.extend(w.3.iter().copied());
        }
        let x = noise(9, 4 * k);
        let idx = [2i64, 0, 1, 2];
        let out = execute(
            &Op::GatherQmv { group_size: gs },
            &[
                Some(&Tensor::from_f32(DType::F32, &[4, k], &x).unwrap()),
                Some(&Tensor::from_slice(DType::U8, &[e, n, k / 2], &packed).unwrap()),
                Some(&Tensor::from_f32(DType::F32, &[e, n, k / gs], &sc).unwrap()),
                Some(&Tensor::from_f32(DType::F32, &[e, n, k / gs], &ze).unwrap()),
                Some(&Tensor::from_i64(DType::I64, &[4], &idx).unwrap()),
            ],
            &[(DType::F32, vec![4, n])],
        )
        .unwrap()[0]
            .to_f32_vec();
        for (p, &ex) in idx.iter().enumerate() {
            let ex = ex as usize;
            let mut w = ws[ex].clone();
            w.2.iter_mut().for_each(|v| *v *= (ex + 1) as f32);
            let want = reference(&x[p * k..(p + 1) * k], 1, &w, n, k, gs);
            for (a, b) in out[p * n..(p + 1) * n].iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "row {p}: {a} vs {b}"
                );
            }
        }
        let bad = Tensor::from_i64(DType::I64, &[4], &[0, 3, 0, 0]).unwrap();
        let e = execute(
            &Op::GatherQmv { group_size: gs },
            &[
                Some(&Tensor::from_f32(DType::F32, &[4, k], &x).unwrap()),
                Some(&Tensor::from_slice(DType::U8, &[e, n, k / 2], &packed).unwrap()),
                Some(&Tensor::from_f32(DType::F32, &[e, n, k / gs], &sc).unwrap()),
                Some(&Tensor::from_f32(DType::F32, &[e, n, k / gs], &ze).unwrap()),
                Some(&bad),
            ],
            &[(DType::F32, vec![4, n])],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("expert index 3 is out of range"),
            "{e}"
        );
    }

    #[test]
    fn gated_delta_rule_follows_the_recurrence() {
        // One head, Dk = Dv = 1: s = s*g + k*((v - s*g*k)*beta), y = s*q.
        let (b, t) = (1, 3);
        let q = [1.0f32, 2.0, -1.0];
        let k = [0.5f32, 1.0, 2.0];
        let v = [1.0f32, -1.0, 0.5];
        let g = [0.9f32, 0.5, 1.0];
        let beta = [1.0f32, 0.5, 0.25];
        let t4 = |d: &[f32]| Tensor::from_f32(DType::F32, &[b, t, 1, 1], d).unwrap();
        let t3 = |d: &[f32]| Tensor::from_f32(DType::F32, &[b, t, 1], d).unwrap();
        let s0 = Tensor::from_f32(DType::F32, &[1, 1, 1, 1], &[0.2]).unwrap();
        let out = execute(
            &Op::GatedDeltaRule,
            &[
                Some(&t4(&q)),
                Some(&t4(&k)),
                Some(&t4(&v)),
                Some(&t3(&g)),
                Some(&t3(&beta)),
                Some(&s0),
            ],
            &[
                (DType::F32, vec![1, 3, 1, 1]),
                (DType::F32, vec![1, 1, 1, 1]),
            ],
        )
        .unwrap();
        let mut s = 0.2f32;
        let mut want = vec![];
        for i in 0..3 {
            s *= g[i];
            let delta = (v[i] - s * k[i]) * beta[i];
            s += k[i] * delta;
            want.push(s * q[i]);
        }
        assert_eq!(out[0].to_f32_vec(), want);
        assert_eq!(out[1].to_f32_vec(), [s]);
    }
}
