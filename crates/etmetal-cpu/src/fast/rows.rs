//! f32 ops along the trailing dims, row by row: softmax and log-softmax
//! over the last dim, layer norm, and sum/mean reductions. Rows run in
//! parallel when there are many elements.

use etmetal_core::ReduceOp;

use super::{math, par_rows};
use crate::view::{View, ViewMut};

/// `f(x_row, y_row)` for each row of `n` elements of the first input (f32,
/// of the output's shape) and of the output; `false` when they are not so.
fn map_rows(
    inputs: &[Option<View>],
    out: &mut ViewMut,
    n: usize,
    f: impl Fn(&[f32], &mut [f32]) + Sync,
) -> bool {
    let x = match inputs.first() {
        Some(Some(x)) if x.shape == out.shape => x.f32s(),
        _ => None,
    };
    let (Some(x), Some(y)) = (x, out.f32s()) else {
        return false;
    };
    par_rows(
        y,
        n,
        n,
        #[inline(always)]
        |r, y| f(&x[r * n..(r + 1) * n], y),
    );
    true
}

pub fn softmax(dim: usize, log: bool, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let n = out.shape.last().copied().unwrap_or(1);
    if inputs.len() != 1 || dim + 1 != out.shape.len().max(1) {
        return false;
    }
    map_rows(
        inputs,
        out,
        n,
        #[inline(always)]
        |row, y| {
            let m = math::max(row);
            if log {
                let s: f32 = row.iter().map(|&v| math::exp(v - m)).sum();
                let shift = m + s.ln();
                y.iter_mut().zip(row).for_each(|(o, &v)| *o = v - shift);
            } else {
                y.iter_mut()
                    .zip(row)
                    .for_each(|(o, &v)| *o = math::exp(v - m));
                let inv = 1.0 / math::sum(y);
                y.iter_mut().for_each(|o| *o *= inv);
            }
        },
    )
}

/// Layer norm over the trailing `nd` dims, with an optional f32 weight and
/// bias of that many elements.
pub fn layer_norm(nd: usize, eps: f64, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let rank = out.shape.len();
    if nd > rank || inputs.len() > 3 {
        return false;
    }
    let n: usize = out.shape[rank - nd..].iter().product();
    let param = |i: usize| match inputs.get(i) {
        None | Some(None) => Some(None),
        Some(Some(p)) if p.numel() == n => p.f32s().map(Some),
        Some(Some(_)) => None,
    };
    let (Some(w), Some(b)) = (param(1), param(2)) else {
        return false;
    };
    map_rows(
        inputs,
        out,
        n,
        #[inline(always)]
        |row, y| {
            let mean = math::sum(row) / n as f32;
            y.iter_mut().zip(row).for_each(|(o, &v)| *o = v - mean);
            let var = math::sum_sq(y) / n as f32;
            let rstd = 1.0 / (var + eps as f32).sqrt();
            match (w, b) {
                (Some(w), Some(b)) => {
                    for ((o, &w), &b) in y.iter_mut().zip(w).zip(b) {
                        *o = *o * rstd * w + b;
                    }
                }
                (Some(w), None) => y.iter_mut().zip(w).for_each(|(o, &w)| *o *= rstd * w),
                (None, Some(b)) => y.iter_mut().zip(b).for_each(|(o, &b)| *o = *o * rstd + b),
                (None, None) => y.iter_mut().for_each(|o| *o *= rstd),
            }
        },
    )
}

/// Sum or mean over trailing dims (`dims` sorted or not, with or without
/// `keepdim`).
pub fn reduce(op: ReduceOp, dims: &[usize], inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(x)] = inputs else {
        return false;
    };
    let rank = x.shape.len();
    let trailing = !dims.is_empty()
        && (rank - dims.len().min(rank)..rank).all(|d| dims.contains(&d))
        && dims.len() <= rank;
    if !trailing || !matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
        return false;
    }
    let n: usize = x.shape[rank - dims.len()..].iter().product();
    let (Some(v), Some(y)) = (x.f32s(), out.f32s()) else {
        return false;
    };
    if n == 0 || y.len() * n != v.len() {
        return false;
    }
    let scale = if op == ReduceOp::Mean {
        1.0 / n as f32
    } else {
        1.0
    };
    par_rows(y, 1, n, |r, y| {
        y[0] = math::sum(&v[r * n..(r + 1) * n]) * scale
    });
    true
}
