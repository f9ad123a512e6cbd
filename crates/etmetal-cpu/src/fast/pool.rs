//! f32 2-D max pooling written into the output (and PyTorch's flat
//! per-plane indices when asked for), planes in parallel.

use etmetal_core::DType;
use rayon::prelude::*;

use crate::pool::{per_dim, pool_out};
use crate::view::{View, ViewMut};

pub struct MaxPool<'a> {
    pub kernel: &'a [usize],
    pub stride: &'a [usize],
    pub padding: &'a [usize],
    pub dilation: &'a [usize],
    pub ceil_mode: bool,
}

pub fn max_pool(p: &MaxPool, inputs: &[Option<View>], outputs: &mut [ViewMut]) -> bool {
    let [Some(x)] = inputs else {
        return false;
    };
    let rank = x.shape.len();
    if p.kernel.len() != 2 || !(3..=4).contains(&rank) {
        return false;
    }
    let dims = |v, default: &[usize]| per_dim(v, 2, default, "").ok();
    let (Some(s), Some(pad), Some(d)) = (
        dims(p.stride, p.kernel),
        dims(p.padding, &[0, 0]),
        dims(p.dilation, &[1, 1]),
    ) else {
        return false;
    };
    let (ih, iw) = (x.shape[rank - 2], x.shape[rank - 1]);
    let size = |i, a: usize| pool_out(i, p.kernel[a], s[a], pad[a], d[a], p.ceil_mode).ok();
    let (Some(oh), Some(ow)) = (size(ih, 0), size(iw, 1)) else {
        return false;
    };
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
    // per output position along an axis: its first tap inside the input
    // and how many taps are inside (a window's inside taps are consecutive)
    let taps = |outs: usize, a: usize, size: usize| -> Vec<(usize, usize)> {
        (0..outs)
            .map(|o| {
                let inside = (0..p.kernel[a]).filter_map(|k| {
                    (o * s[a] + k * d[a])
                        .checked_sub(pad[a])
                        .filter(|&i| i < size)
                });
                let first = inside.clone().next().unwrap_or(0);
                (first, inside.count())
            })
            .collect()
    };
    let (rows, cols) = (taps(oh, 0, ih), taps(ow, 1, iw));
    let pool_plane = &|c: usize, yc: &mut [f32], mut ic: Option<&mut [i64]>| {
        let plane = &xv[c * ins..(c + 1) * ins];
        for (r, &(i0, ni)) in rows.iter().enumerate() {
            for (q, &(j0, nj)) in cols.iter().enumerate() {
                // the first NaN wins and stays, then the first maximum (PyTorch);
                // a window with no input inside reads element 0, as the reference
                let mut best = if ni * nj == 0 { 0 } else { i0 * iw + j0 };
                for ti in 0..ni {
                    let row = (i0 + ti * d[0]) * iw;
                    for tj in 0..nj {
                        let at = row + j0 + tj * d[1];
                        let (v, b) = (plane[at], plane[best]);
                        if !b.is_nan() && (v > b || v.is_nan()) {
                            best = at;
                        }
                    }
                }
                yc[r * ow + q] = plane[best];
                if let Some(ic) = ic.as_deref_mut() {
                    ic[r * ow + q] = best as i64;
                }
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
