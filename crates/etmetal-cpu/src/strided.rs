//! The one strided walk every kernel uses: visit each index of a shape in
//! row-major order while tracking the element offsets of several operands
//! (broadcast operands have stride 0 on their broadcast dims).

use etmetal_core::{Result, Tensor};

/// Call `f` with the offsets of every operand for each index of `shape`, in
/// row-major order. `strides[k]` has one entry per dim of `shape`.
pub fn for_each_offset<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    base: [usize; N],
    mut f: impl FnMut([usize; N]),
) {
    if shape.contains(&0) {
        return;
    }
    let Some(last) = shape.len().checked_sub(1) else {
        f(base);
        return;
    };
    let mut idx = vec![0usize; shape.len()];
    let mut off = base;
    loop {
        let mut o = off;
        for _ in 0..shape[last] {
            f(o);
            for k in 0..N {
                o[k] += strides[k][last];
            }
        }
        // advance the outer dims like an odometer
        let mut d = last;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            for k in 0..N {
                off[k] += strides[k][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for k in 0..N {
                off[k] -= strides[k][d] * shape[d];
            }
            idx[d] = 0;
        }
    }
}

/// Copy the elements of the strided view (`shape`, `strides`, `offset`) of
/// `src` into a contiguous vector.
pub fn gather<T: Copy>(src: &[T], shape: &[usize], strides: &[usize], offset: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(shape.iter().product());
    for_each_offset(shape, [strides], [offset], |[o]| out.push(src[o]));
    out
}

/// Run `$body` with `$T` bound to the unsigned integer type as wide as one
/// element of `$dtype` (or `width` bytes), for kernels that only move
/// elements around.
macro_rules! by_width {
    ($dtype:expr, $T:ident => $body:expr) => {
        by_width!(width $dtype.size(), $T => $body)
    };
    (width $width:expr, $T:ident => $body:expr) => {
        match $width {
            1 => {
                type $T = u8;
                $body
            }
            2 => {
                type $T = u16;
                $body
            }
            4 => {
                type $T = u32;
                $body
            }
            _ => {
                type $T = u64;
                $body
            }
        }
    };
}
pub(crate) use by_width;

/// A contiguous tensor with the elements of a strided view of `t`. The view
/// must lie inside `t` (callers build it from checked shapes).
pub fn materialize(
    t: &Tensor,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Result<Tensor> {
    let mut out = Tensor::zeros(t.dtype(), shape)?;
    copy_view(
        t.bytes(),
        out.bytes_mut(),
        t.dtype().size(),
        shape,
        strides,
        offset,
    );
    Ok(out)
}

/// Copy the strided view (`shape`, `strides`, `offset`, counted in elements
/// of `width` bytes) of `src` into the contiguous `dst`, which holds exactly
/// the view's elements. Trailing dims that are contiguous in `src` move as
/// one block. The view must lie inside `src`.
pub fn copy_view(
    src: &[u8],
    dst: &mut [u8],
    width: usize,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) {
    // fold the trailing dims the source holds contiguously into one run
    let (mut outer, mut run) = (shape.len(), 1);
    while outer > 0 && (shape[outer - 1] == 1 || strides[outer - 1] == run) {
        run *= shape[outer - 1];
        outer -= 1;
    }
    let (shape, strides) = (&shape[..outer], &strides[..outer]);
    by_width!(width width, T => {
        match (bytemuck::try_cast_slice::<u8, T>(src), bytemuck::try_cast_slice_mut::<u8, T>(dst)) {
            (Ok(s), Ok(d)) => copy_runs(s, d, run, shape, strides, offset),
            // unaligned bytes: the same walk on bytes
            _ => {
                let bytes: Vec<usize> = strides.iter().map(|s| s * width).collect();
                copy_runs(src, dst, run * width, shape, &bytes, offset * width)
            }
        }
    })
}

/// `dst` = the runs of `run` elements at each offset of the (`shape`,
/// `strides`) walk from `offset`.
fn copy_runs<T: Copy>(
    src: &[T],
    dst: &mut [T],
    run: usize,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) {
    let mut at = 0;
    if run == 1 {
        for_each_offset(shape, [strides], [offset], |[o]| {
            dst[at] = src[o];
            at += 1;
        });
    } else {
        for_each_offset(shape, [strides], [offset], |[o]| {
            dst[at..at + run].copy_from_slice(&src[o..o + run]);
            at += run;
        });
    }
}

/// The window table of sliding-window ops (convolution, pooling): for each
/// kernel position `kk` (row-major over `kernel`) and each position `a`
/// (row-major over `outer`), the flat row-major index into `bound` of
/// `a·stride + k·dilation − padding`, or `None` when that falls outside
/// `bound`. Entry `kk * numel(outer) + a`.
pub fn window_table(
    outer: &[usize],
    kernel: &[usize],
    bound: &[usize],
    stride: &[usize],
    dilation: &[usize],
    padding: &[usize],
) -> Vec<Option<usize>> {
    let multi = |dims: &[usize]| {
        let mut all = vec![];
        let strides = etmetal_core::shape::contiguous_strides(dims);
        for_each_offset(dims, [&strides], [0], |[flat]| {
            let mut rem = flat;
            all.push(
                strides
                    .iter()
                    .map(|&s| {
                        let i = rem / s.max(1);
                        rem -= i * s;
                        i
                    })
                    .collect::<Vec<_>>(),
            );
        });
        all
    };
    let (ks, os) = (multi(kernel), multi(outer));
    let bstrides = etmetal_core::shape::contiguous_strides(bound);
    let mut table = Vec::with_capacity(ks.len() * os.len());
    for k in &ks {
        for a in &os {
            let mut flat = Some(0usize);
            for d in 0..bound.len() {
                let p = (a[d] * stride[d] + k[d] * dilation[d]) as i64 - padding[d] as i64;
                flat = match flat {
                    Some(f) if p >= 0 && (p as usize) < bound[d] => {
                        Some(f + p as usize * bstrides[d])
                    }
                    _ => None,
                };
            }
            table.push(flat);
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_transposed_and_broadcast_views() {
        let src: Vec<u32> = (0..6).collect();
        // [2,3] viewed transposed as [3,2]
        assert_eq!(gather(&src, &[3, 2], &[1, 3], 0), vec![0, 3, 1, 4, 2, 5]);
        // row 1 broadcast to [2,3]
        assert_eq!(gather(&src, &[2, 3], &[0, 1], 3), vec![3, 4, 5, 3, 4, 5]);
        assert_eq!(gather(&src, &[], &[], 4), vec![4]);
        assert!(gather(&src, &[2, 0, 3], &[3, 1, 1], 0).is_empty());
        let mut pairs = vec![];
        for_each_offset(&[2, 2], [&[2, 1], &[0, 1]], [0, 10], |[a, b]| {
            pairs.push((a, b))
        });
        assert_eq!(pairs, vec![(0, 10), (1, 11), (2, 10), (3, 11)]);
    }

    #[test]
    fn window_table_marks_padding() {
        // 1-D: 2 outputs, kernel 2, input 3, stride 2, padding 1
        let t = window_table(&[2], &[2], &[3], &[2], &[1], &[1]);
        assert_eq!(t, vec![None, Some(1), Some(0), Some(2)]);
    }
}
