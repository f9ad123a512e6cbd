//! Shapes, strides, dim order and broadcasting, and PyTorch's shape rules
//! that more than one crate applies (the output sizes of convolutions and
//! pools, the attention batch with grouped-query heads). Shapes are
//! `[usize]`, strides are in elements (as PyTorch's) and may be zero for
//! expanded dims.

use crate::error::{Error, Result};
use crate::sym::SymExpr;

/// Number of elements, or an error when the product overflows.
pub fn numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d).ok_or_else(|| {
            Error::limit(format!(
                "shape {shape:?} has more elements than fit in memory"
            ))
        })
    })
}

/// Row-major strides of a contiguous tensor.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Whether `strides` describe a row-major contiguous layout of `shape`
/// (dims of size 1 may have any stride, as in PyTorch).
pub fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1usize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

/// Dim order (ExecuTorch's `dim_order`): dims sorted from the outermost
/// (largest stride) to the innermost. Contiguous tensors give `0..rank`.
pub fn dim_order(shape: &[usize], strides: &[usize]) -> Vec<u8> {
    let mut order: Vec<usize> = (0..shape.len()).collect();
    // stable sort keeps the natural order between equal strides
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    order.into_iter().map(|d| d as u8).collect()
}

/// NumPy/PyTorch broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(format!(
                    "shapes {a:?} and {b:?} do not broadcast"
                )))
            }
        };
    }
    Ok(out)
}

/// Strides (in elements) that read a contiguous tensor of shape `from` as if
/// it had the broadcast shape `to` (zero stride on broadcast dims).
pub fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    let src = contiguous_strides(from);
    let offset = to.len() - from.len();
    (0..to.len())
        .map(|i| {
            if i < offset || from[i - offset] == 1 {
                0
            } else {
                src[i - offset]
            }
        })
        .collect()
}

/// Normalise a possibly negative dim index against `rank`.
pub fn normalize_dim(dim: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r.max(1) {
        return Err(Error::shape(format!(
            "dim {dim} is out of range for a tensor of rank {rank}"
        )));
    }
    Ok(d as usize)
}

/// PyTorch's output size of a convolution along one spatial dim:
/// `⌊(input + 2·padding − dilation·(kernel − 1) − 1) / stride⌋ + 1`; the
/// dilated kernel must fit the padded input.
pub fn conv_output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Result<usize> {
    check_window(kernel, stride, dilation)?;
    let span = dilation * (kernel - 1) + 1;
    let padded = input + 2 * padding;
    if padded < span {
        return Err(Error::shape(format!(
            "input {input} with padding {padding} gives no output: the kernel spans {span} (kernel {kernel}, dilation {dilation})"
        )));
    }
    Ok((padded - span) / stride + 1)
}

/// [`conv_output_size`] of a symbolic input size (bounded dynamic shapes):
/// `⌊(input + 2·padding − dilation·(kernel − 1) − 1) / stride⌋ + 1`, also
/// a pool's without `ceil_mode`.
pub fn sym_conv_output_size(
    input: SymExpr,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Result<SymExpr> {
    check_window(kernel, stride, dilation)?;
    let span = (dilation * (kernel - 1) + 1) as i64;
    let num = input + SymExpr::Const(2 * padding as i64 - span);
    Ok(SymExpr::floor_div(num, SymExpr::Const(stride as i64))? + SymExpr::Const(1))
}

/// PyTorch's output size of a transposed convolution along one spatial dim:
/// `(input − 1)·stride − 2·padding + dilation·(kernel − 1) + output_padding + 1`,
/// which must be positive.
pub fn conv_transpose_output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    output_padding: usize,
) -> Result<usize> {
    check_window(kernel, stride, dilation)?;
    let [i, k, s, p, d, op] =
        [input, kernel, stride, padding, dilation, output_padding].map(|v| v as i64);
    let out = (i - 1) * s - 2 * p + d * (k - 1) + op + 1;
    if out <= 0 {
        return Err(Error::shape(format!(
            "input {input}, kernel {kernel}, stride {stride}, padding {padding} give no output"
        )));
    }
    Ok(out as usize)
}

/// PyTorch's output size of a max or average pool along one spatial dim
/// (`pooling_output_shape`): as a convolution's, rounded up in `ceil_mode`,
/// where a last window that would start in the right padding is dropped.
/// The padding is at most half the kernel.
pub fn pool_output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
) -> Result<usize> {
    check_window(kernel, stride, dilation)?;
    if padding > kernel / 2 {
        return Err(Error::shape(format!(
            "pooling padding {padding} is more than half the kernel {kernel}"
        )));
    }
    let span = dilation * (kernel - 1) + 1;
    let padded = input + 2 * padding;
    if padded < span {
        return Err(Error::shape(format!(
            "input size {input} is smaller than the kernel {kernel} (dilation {dilation}, padding {padding})"
        )));
    }
    let num = padded - span;
    let mut out = if ceil_mode {
        num.div_ceil(stride)
    } else {
        num / stride
    } + 1;
    if ceil_mode && (out - 1) * stride >= input + padding {
        out -= 1;
    }
    Ok(out)
}

fn check_window(kernel: usize, stride: usize, dilation: usize) -> Result<()> {
    if kernel == 0 || stride == 0 || dilation == 0 {
        return Err(Error::shape(format!(
            "kernel {kernel}, stride {stride} and dilation {dilation} must be positive"
        )));
    }
    Ok(())
}

/// How many query heads share one key/value head in grouped-query
/// attention (`enable_gqa`): query head `h` reads key/value head
/// `h / group`. The key/value head count must divide the query's.
pub fn gqa_group(q_heads: usize, kv_heads: usize) -> Result<usize> {
    if kv_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(Error::shape(format!(
            "{q_heads} query heads cannot share {kv_heads} key/value heads"
        )));
    }
    Ok(q_heads / kv_heads)
}

/// The batch of a scaled dot-product attention, from the batch dims (all
/// but the last two) of q, k and v.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionBatch {
    /// The output's batch dims: q's, k's and v's broadcast, after the
    /// grouped-query repeat.
    pub batch: Vec<usize>,
    /// Query heads per key head ([`gqa_group`]; 1 without grouping).
    pub k_group: usize,
    /// Query heads per value head.
    pub v_group: usize,
}

/// PyTorch's attention batch: with `enable_gqa`, k's and v's head dim
/// (the last batch dim) is repeated to q's unless all three agree
/// (`pre_process_group_query_attention_input`); then the batch dims
/// broadcast.
pub fn attention_batch(
    q: &[usize],
    k: &[usize],
    v: &[usize],
    enable_gqa: bool,
) -> Result<AttentionBatch> {
    if k.len() != q.len() || v.len() != q.len() {
        return Err(Error::shape(format!(
            "attention batch dims q {q:?}, k {k:?}, v {v:?} differ in rank"
        )));
    }
    let (mut k, mut v) = (k.to_vec(), v.to_vec());
    let (mut k_group, mut v_group) = (1, 1);
    if let (true, Some(h)) = (enable_gqa, q.len().checked_sub(1)) {
        let (hq, hk, hv) = (q[h], k[h], v[h]);
        if hk != hq || hv != hq {
            k_group = gqa_group(hq, hk)?;
            v_group = gqa_group(hq, hv)?;
            k[h] = hq;
            v[h] = hq;
        }
    }
    let batch = broadcast_shapes(q, &k).and_then(|b| broadcast_shapes(&b, &v))?;
    Ok(AttentionBatch {
        batch,
        k_group,
        v_group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbolic_conv_output_size_is_the_static_one_at_every_size() {
        use std::collections::HashMap;
        for (k, st, p, dil) in [(3, 1, 1, 1), (3, 2, 0, 1), (2, 2, 0, 1), (5, 3, 2, 2)] {
            let e = sym_conv_output_size(SymExpr::sym("h"), k, st, p, dil).unwrap();
            for h in 5..40 {
                let got = e
                    .eval(&HashMap::from([("h".to_string(), h as i64)]))
                    .unwrap();
                let want = conv_output_size(h, k, st, p, dil).unwrap();
                assert_eq!(got, want as i64, "h={h} k={k} s={st} p={p} d={dil}");
            }
        }
        assert!(sym_conv_output_size(SymExpr::sym("h"), 3, 0, 0, 1).is_err());
    }

    #[test]
    fn strides_and_contiguity() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert!(is_contiguous(&[2, 3, 4], &[12, 4, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert!(is_contiguous(&[1, 3], &[99, 1]));
        assert_eq!(dim_order(&[2, 3], &[1, 2]), vec![1, 0]);
        assert_eq!(dim_order(&[2, 3, 4], &[12, 4, 1]), vec![0, 1, 2]);
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            broadcast_shapes(&[2, 1, 4], &[3, 1]).unwrap(),
            vec![2, 3, 4]
        );
        assert!(broadcast_shapes(&[2, 3], &[4]).is_err());
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
    }

    #[test]
    fn dims_and_overflow() {
        assert_eq!(normalize_dim(-1, 3).unwrap(), 2);
        assert!(normalize_dim(3, 3).is_err());
        assert!(numel(&[usize::MAX, 2]).is_err());
        assert_eq!(numel(&[]).unwrap(), 1);
    }

    // Expected sizes below are what PyTorch 2.15 gives (`F.max_pool1d`,
    // `F.conv1d`, `F.conv_transpose1d` on inputs of that size).

    #[test]
    fn pool_sizes_follow_pytorch_including_ceil_mode() {
        // (input, kernel, stride, padding, dilation, ceil_mode) → size
        let cases = [
            ((7, 3, 2, 1, 1, false), 4),
            ((7, 3, 2, 1, 1, true), 4),
            // ceil mode rounds up …
            ((6, 3, 2, 0, 1, true), 3),
            ((8, 5, 4, 2, 1, true), 3),
            // … but drops a last window that would start in the right padding
            ((5, 3, 3, 1, 1, true), 2),
            ((10, 2, 3, 1, 1, true), 4),
            ((9, 3, 2, 1, 2, true), 4),
            ((11, 4, 3, 2, 2, true), 4),
            ((1, 1, 2, 0, 1, true), 1),
        ];
        for ((i, k, s, p, d, ceil), want) in cases {
            let got = pool_output_size(i, k, s, p, d, ceil).unwrap();
            assert_eq!(got, want, "{:?}", (i, k, s, p, d, ceil));
        }
        // PyTorch: "padding should be at most half of kernel size"
        assert!(pool_output_size(5, 2, 1, 2, 1, false).is_err());
        assert!(pool_output_size(5, 0, 1, 0, 1, false).is_err());
        assert!(pool_output_size(2, 5, 1, 0, 1, false).is_err());
    }

    #[test]
    fn conv_sizes_follow_pytorch() {
        // (input, kernel, stride, padding, dilation) → size
        for ((i, k, s, p, d), want) in [
            ((10, 3, 3, 2, 2), 4),
            ((7, 1, 1, 0, 1), 7),
            ((5, 5, 1, 0, 1), 1),
            ((8, 3, 2, 0, 3), 1),
            ((4, 2, 5, 3, 1), 2),
        ] {
            assert_eq!(conv_output_size(i, k, s, p, d).unwrap(), want);
        }
        // PyTorch: "Kernel size can't be greater than actual input size"
        assert!(conv_output_size(2, 5, 1, 0, 1).is_err());
        assert!(conv_output_size(4, 2, 0, 0, 1).is_err());
        // (input, kernel, stride, padding, dilation, output_padding) → size
        for ((i, k, s, p, d, op), want) in [
            ((4, 3, 2, 1, 2, 1), 10),
            ((3, 2, 1, 0, 1, 0), 4),
            ((5, 3, 3, 2, 1, 2), 13),
            ((1, 1, 1, 0, 1, 0), 1),
        ] {
            assert_eq!(conv_transpose_output_size(i, k, s, p, d, op).unwrap(), want);
        }
        // PyTorch: "Calculated output size per channel: (1 x -1)"
        assert!(conv_transpose_output_size(1, 1, 1, 1, 1, 0).is_err());
    }

    #[test]
    fn attention_batches_repeat_grouped_heads_as_pytorch() {
        // q [1, 8, L, E] with k [1, 2, S, E] and v [1, 4, S, E]: PyTorch
        // repeats k's heads 4 times and v's twice
        let b = attention_batch(&[1, 8], &[1, 2], &[1, 4], true).unwrap();
        assert_eq!(
            b,
            AttentionBatch {
                batch: vec![1, 8],
                k_group: 4,
                v_group: 2
            }
        );
        // rank-3 inputs: the head dim is the only batch dim
        let b = attention_batch(&[6], &[2], &[2], true).unwrap();
        assert_eq!((b.batch, b.k_group, b.v_group), (vec![6], 3, 3));
        // PyTorch: "Number of heads in key and value must divide the number
        // of heads in query"
        assert!(attention_batch(&[1, 3], &[1, 2], &[1, 2], true).is_err());
        assert!(attention_batch(&[1, 3], &[1, 0], &[1, 0], true).is_err());
        // without grouping the batch dims broadcast, and 8 heads against 2
        // do not
        let b = attention_batch(&[2, 1], &[1, 4], &[2, 4], false).unwrap();
        assert_eq!((b.batch, b.k_group, b.v_group), (vec![2, 4], 1, 1));
        assert!(attention_batch(&[1, 8], &[1, 2], &[1, 2], false).is_err());
        assert_eq!(gqa_group(8, 2).unwrap(), 4);
    }
}
