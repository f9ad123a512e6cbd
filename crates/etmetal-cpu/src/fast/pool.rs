//! f32 2-D max pooling written into the output (and PyTorch's flat
//! per-plane indices when asked for), planes in parallel.

use etmetal_core::{DType, MaxPoolAttrs};
use rayon::prelude::*;

use super::valid_range;
use crate::view::{View, ViewMut};

pub fn max_pool(p: &MaxPoolAttrs, inputs: &[Option<View>], outputs: &mut [ViewMut]) -> bool {
    let [Some(x)] = inputs else {
        return false;
    };
    let rank = x.shape.len();
    if p.spatial_rank() != 2 || !(3..=4).contains(&rank) {
        return false;
    }
    let Ok(w) = p.window() else {
        return false;
    };
    let Ok(&[oh, ow]) = w.output_spatial(&x.shape[rank - 2..]).as_deref() else {
        return false;
    };
    let (s, pad, d) = (&w.stride, &w.padding, &w.dilation);
    let (ih, iw) = (x.shape[rank - 2], x.shape[rank - 1]);
    let oshape = [&x.shape[..rank - 2], &[oh, ow][..]].concat();
    let (values, indices) = match outputs {
        [v] => (v, None),
        [v, i] if i.dtype == DType::I64 && i.shape == oshape.as_slice() => (v, Some(i)),
        _ => return false,
    };
    if values.shape != oshape.as_slice() {
        return false;
    }
    let indices = match indices.map(|i| bytemuck::try_cast_slice_mut::<u8, i64>(i.bytes)) {
        None => None,
        Some(Ok(i)) => Some(i),
        Some(Err(_)) => return false,
    };
    let (Some(xv), Some(y)) = (x.f32s(), values.f32s()) else {
        return false;
    };
    let (ins, os) = (ih * iw, oh * ow);
    if os == 0 {
        return true;
    }
    let pool_plane = &|c: usize, yc: &mut [f32], mut ic: Option<&mut [i64]>| {
        let plane = &xv[c * ins..(c + 1) * ins];
        // per output column of one row: the best value and its index (-1:
        // no tap inside yet); taps in the kernel's row-major order, as the
        // reference visits them, output columns side by side
        let mut best = vec![0f32; ow];
        let mut at = vec![-1i64; ow];
        for r in 0..oh {
            at.fill(-1);
            for ki in 0..p.kernel[0] {
                let Some(i) = (r * s[0] + ki * d[0])
                    .checked_sub(pad[0])
                    .filter(|&i| i < ih)
                else {
                    continue;
                };
                let src = &plane[i * iw..(i + 1) * iw];
                for kj in 0..p.kernel[1] {
                    let (lo, hi) = valid_range(ow, iw, kj, s[1], pad[1], d[1]);
                    for q in lo..hi {
                        let j = q * s[1] + kj * d[1] - pad[1];
                        let (v, b) = (src[j], best[q]);
                        // the first NaN wins and stays, then the first maximum
                        if at[q] < 0 || (!b.is_nan() && (v > b || v.is_nan())) {
                            best[q] = v;
                            at[q] = (i * iw + j) as i64;
                        }
                    }
                }
            }
            // a window with no input inside reads element 0, as the reference
            for q in 0..ow {
                if at[q] < 0 {
                    (best[q], at[q]) = (plane[0], 0);
                }
            }
            yc[r * ow..(r + 1) * ow].copy_from_slice(&best);
            if let Some(ic) = ic.as_deref_mut() {
                ic[r * ow..(r + 1) * ow].copy_from_slice(&at);
            }
        }
    };
    match indices {
        Some(idx) => y
            .par_chunks_mut(os)
            .zip(idx.par_chunks_mut(os))
            .enumerate()
            .for_each(|(c, (yc, ic))| pool_plane(c, yc, Some(ic))),
        None => y
            .par_chunks_mut(os)
            .enumerate()
            .for_each(|(c, yc)| pool_plane(c, yc, None)),
    }
    true
}
