//! Scaled dot-product attention, as PyTorch's math path: per batch and head,
//! softmax(q·kᵀ·scale plus mask)·v, with bool (keep `true`) or additive float
//! masks broadcast over batch and heads, top-left causal masking, and
//! grouped-query attention. Rows with every position masked give zeros, as
//! eager PyTorch 2.15 on CPU does.

use etmetal_core::shape::{attention_batch, broadcast_shapes, broadcast_strides, AttentionBatch};
use etmetal_core::{DType, Result, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::buf::{domain, Buf, Domain, Elem};
use crate::ctx::Ctx;
use crate::elementwise::Real;
use crate::matmul::{Mat, MatElem};

/// The mask, as either kept positions or additive biases, in the full
/// `[batch…, L, S]` layout given by `strides`.
enum Mask<T> {
    None,
    Keep(Vec<bool>, Vec<usize>),
    Add(Vec<T>, Vec<usize>),
}

/// Offset of batch element `b` (row-major over `batch`) in an operand whose
/// batch dims are `dims` (right-aligned, size-1 dims broadcast), with
/// `mat` elements per matrix; `group` query heads share each of its heads.
fn batch_offset(b: usize, batch: &[usize], dims: &[usize], mat: usize, group: usize) -> usize {
    let lead = batch.len() - dims.len();
    let (mut rem, mut off, mut scale) = (b, 0, mat);
    for d in (0..batch.len()).rev() {
        let i = rem % batch[d].max(1);
        rem /= batch[d].max(1);
        if d >= lead {
            let size = dims[d - lead];
            // the last batch dim is the head dim; GQA shares each kv head
            let i = if d == batch.len() - 1 && group > 1 {
                i / group
            } else if size == 1 {
                0
            } else {
                i
            };
            off += i * scale;
            scale *= size;
        }
    }
    off
}

pub fn sdpa(ctx: &Ctx, is_causal: bool, scale: Option<f64>, enable_gqa: bool) -> Result<Tensor> {
    let (q, k, v) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    let mask = ctx.optional(3);
    if q.rank() < 2 || k.rank() != q.rank() || v.rank() != q.rank() {
        return Err(ctx.invalid(format!(
            "q {:?}, k {:?}, v {:?} need one rank of at least 2",
            q.shape(),
            k.shape(),
            v.shape()
        )));
    }
    if is_causal && mask.is_some() {
        return Err(ctx.invalid("an explicit mask cannot be combined with is_causal"));
    }
    let r = q.rank();
    let (l, e) = (q.shape()[r - 2], q.shape()[r - 1]);
    let (s, ek) = (k.shape()[r - 2], k.shape()[r - 1]);
    let (sv, ev) = (v.shape()[r - 2], v.shape()[r - 1]);
    if ek != e || sv != s {
        return Err(ctx.invalid(format!(
            "q {:?}, k {:?}, v {:?} disagree on the embedding or sequence size",
            q.shape(),
            k.shape(),
            v.shape()
        )));
    }
    let (qb, kb, vb) = (
        q.shape()[..r - 2].to_vec(),
        k.shape()[..r - 2].to_vec(),
        v.shape()[..r - 2].to_vec(),
    );
    let AttentionBatch {
        batch,
        k_group,
        v_group,
    } = attention_batch(&qb, &kb, &vb, enable_gqa).map_err(|e| ctx.invalid(e))?;
    let full: Vec<usize> = [&batch[..], &[l, s]].concat();
    let out_dtype = ctx.out_dtype(0)?;
    let dom = domain(out_dtype);
    let geo = Geo {
        batch: batch.clone(),
        qb,
        kb,
        vb,
        l,
        s,
        e,
        ev,
        k_group,
        v_group,
    };
    let scale = scale.unwrap_or(1.0 / (e as f64).sqrt());
    let buf = match dom {
        Domain::F32 => sdpa_in::<f32>(ctx, &geo, [q, k, v], mask, &full, is_causal, scale)?,
        Domain::F64 => sdpa_in::<f64>(ctx, &geo, [q, k, v], mask, &full, is_causal, scale)?,
        _ => {
            return Err(ctx.unsupported(format!(
                "attention needs a floating-point output dtype, got {out_dtype}"
            )))
        }
    };
    let oshape: Vec<usize> = [&batch[..], &[l, ev]].concat();
    buf.store(out_dtype, &oshape)
}

fn sdpa_in<T: MatElem + Real>(
    ctx: &Ctx,
    geo: &Geo,
    [q, k, v]: [&Tensor; 3],
    mask: Option<&Tensor>,
    full: &[usize],
    causal: bool,
    scale: f64,
) -> Result<Buf> {
    let mask = match mask {
        None => Mask::None,
        Some(m) => {
            if broadcast_shapes(m.shape(), full).ok().as_deref() != Some(full) {
                return Err(ctx.invalid(format!(
                    "mask of shape {:?} does not broadcast to {full:?}",
                    m.shape()
                )));
            }
            let st = broadcast_strides(m.shape(), full);
            match m.dtype() {
                DType::Bool => Mask::Keep(bool::load(m), st),
                d if d.is_float() => Mask::Add(T::load(m), st),
                d => {
                    return Err(
                        ctx.invalid(format!("mask dtype {d} must be bool or floating point"))
                    )
                }
            }
        }
    };
    let scale = <T as Real>::of(scale);
    Ok(Elem::wrap(attend::<T>(
        geo,
        &T::load(q),
        &T::load(k),
        &T::load(v),
        &mask,
        causal,
        scale,
    )))
}

struct Geo {
    batch: Vec<usize>,
    qb: Vec<usize>,
    kb: Vec<usize>,
    vb: Vec<usize>,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    /// Query heads per key and per value head ([`AttentionBatch`]).
    k_group: usize,
    v_group: usize,
}

fn attend<T: MatElem + Real>(
    g: &Geo,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: &Mask<T>,
    causal: bool,
    scale: T,
) -> Vec<T> {
    let (l, s, e, ev) = (g.l, g.s, g.e, g.ev);
    let nb: usize = g.batch.iter().product();
    let mut out = vec![T::default(); nb * l * ev];
    if l * ev == 0 {
        return out;
    }
    let ninf = <T as Real>::of(f64::NEG_INFINITY);
    out.par_chunks_mut(l * ev).enumerate().for_each(|(b, dst)| {
        let qo = batch_offset(b, &g.batch, &g.qb, l * e, 1);
        let ko = batch_offset(b, &g.batch, &g.kb, s * e, g.k_group);
        let vo = batch_offset(b, &g.batch, &g.vb, s * ev, g.v_group);
        let mut scores = vec![T::default(); l * s];
        // kᵀ is k read with swapped strides
        T::mm(
            &mut scores,
            l,
            s,
            e,
            Mat {
                data: &q[qo..],
                rs: e,
                cs: 1,
            },
            Mat {
                data: &k[ko..],
                rs: 1,
                cs: e,
            },
            Parallelism::None,
        );
        for i in 0..l {
            let row = &mut scores[i * s..(i + 1) * s];
            for (j, x) in row.iter_mut().enumerate() {
                *x = *x * scale;
                let masked = match mask {
                    Mask::None => false,
                    Mask::Keep(m, st) => !m[mask_at(b, i, j, &g.batch, st)],
                    Mask::Add(m, st) => {
                        *x = *x + m[mask_at(b, i, j, &g.batch, st)];
                        false
                    }
                };
                if masked || (causal && j > i) {
                    *x = ninf;
                }
            }
            let max = row
                .iter()
                .copied()
                .fold(ninf, |a, x| if x > a { x } else { a });
            if max == ninf {
                row.iter_mut().for_each(|x| *x = <T as Real>::of(0.0));
                continue;
            }
            let mut sum = <T as Real>::of(0.0);
            for x in row.iter_mut() {
                *x = (*x - max).exp();
                sum = sum + *x;
            }
            row.iter_mut().for_each(|x| *x = *x / sum);
        }
        T::mm(
            dst,
            l,
            ev,
            s,
            Mat {
                data: &scores,
                rs: s,
                cs: 1,
            },
            Mat {
                data: &v[vo..],
                rs: ev,
                cs: 1,
            },
            Parallelism::None,
        );
    });
    out
}

/// Flat offset of mask element (batch `b`, row `i`, column `j`).
fn mask_at(b: usize, i: usize, j: usize, batch: &[usize], st: &[usize]) -> usize {
    let n = batch.len();
    let (mut rem, mut off) = (b, 0);
    for d in (0..n).rev() {
        off += (rem % batch[d].max(1)) * st[d];
        rem /= batch[d].max(1);
    }
    off + i * st[n] + j * st[n + 1]
}

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, Op, Tensor};

    // Expected values come from F.scaled_dot_product_attention in PyTorch 2.15.

    fn qkv() -> (Tensor, Tensor, Tensor) {
        (
            f32t(&[1, 2, 3, 4], &ramp(24, 11, 7)),
            f32t(&[1, 1, 5, 4], &ramp(20, 13, 5)),
            f32t(&[1, 1, 5, 2], &ramp(10, 7, 3)),
        )
    }

    #[test]
    fn causal_grouped_query_attention() {
        let (q, k, v) = qkv();
        let op = Op::Sdpa {
            is_causal: true,
            scale: None,
            enable_gqa: true,
        };
        let y = run1(op, &[&q, &k, &v], DType::F32, &[1, 2, 3, 2]).unwrap();
        close(
            &y.to_f32_vec(),
            &[
                -1.0,
                -0.25,
                -0.50849754,
                -0.33191708,
                -0.21116166,
                -0.49079055,
                -1.0,
                -0.25,
                -0.32010722,
                -0.36331546,
                0.3507157,
                -0.50206709,
            ],
            1e-6,
        );
    }

    #[test]
    fn key_and_value_heads_may_differ_in_grouped_query_attention() {
        // 4 query heads over 2 key heads and 1 value head, as PyTorch's
        // `enable_gqa` repeats each separately
        let q = f32t(&[1, 4, 2, 3], &ramp(24, 11, 7));
        let k = f32t(&[1, 2, 3, 3], &ramp(18, 13, 5));
        let v = f32t(&[1, 1, 3, 2], &ramp(6, 7, 3));
        let op = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: true,
        };
        let y = run1(op, &[&q, &k, &v], DType::F32, &[1, 4, 2, 2]).unwrap();
        close(
            &y.to_f32_vec(),
            &[
                -0.087412313,
                -0.51613629,
                0.14967346,
                -0.64724249,
                0.13998276,
                -0.65510356,
                0.13276502,
                -0.66207373,
                0.18967143,
                -0.61413658,
                0.21639031,
                -0.60727763,
                0.24371478,
                -0.59963048,
                0.27112025,
                -0.59138179,
            ],
            1e-6,
        );
    }

    #[test]
    fn bool_mask_with_a_fully_masked_row_gives_zeros() {
        let (q, k, v) = qkv();
        let m = Tensor::from_i64(
            DType::Bool,
            &[3, 5],
            &[1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1],
        )
        .unwrap();
        let op = Op::Sdpa {
            is_causal: false,
            scale: Some(0.3),
            enable_gqa: false,
        };
        // k and v broadcast over the head dim
        let y = run1(op, &[&q, &k, &v, &m], DType::F32, &[1, 2, 3, 2]).unwrap();
        close(
            &y.to_f32_vec(),
            &[
                -0.22850764,
                -0.68111205,
                0.0,
                0.0,
                -0.17310181,
                -0.29034847,
                -0.19780216,
                -0.70219398,
                0.0,
                0.0,
                0.084322743,
                -0.58648926,
            ],
            1e-6,
        );
        // the same mask as an additive float mask
        let add: Vec<f32> = m
            .to_i64_vec()
            .iter()
            .map(|&b| if b == 1 { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let op = Op::Sdpa {
            is_causal: false,
            scale: Some(0.3),
            enable_gqa: false,
        };
        let y2 = run1(
            op,
            &[&q, &k, &v, &f32t(&[3, 5], &add)],
            DType::F32,
            &[1, 2, 3, 2],
        )
        .unwrap();
        assert_eq!(y.to_f32_vec(), y2.to_f32_vec());
        let op = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: false,
        };
        let e = run1(
            op,
            &[&q, &k, &v, &f32t(&[2, 5], &[0.0; 10])],
            DType::F32,
            &[1, 2, 3, 2],
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not broadcast"), "{e}");
    }
}
