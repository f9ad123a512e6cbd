//! f32 convolution (1-D and 2-D, not transposed) written into the output.
//! Depthwise convolutions (one input channel per group and per output
//! channel) run directly, channel by channel; the others are a GEMM of the
//! weight with the input itself (1×1, stride 1, no padding) or with its
//! im2col columns, built in a reused scratch buffer. The bias is the
//! GEMM's starting value.

use std::cell::RefCell;

use etmetal_core::ConvAttrs;
use gemm::Parallelism;
use rayon::prelude::*;

use super::valid_range;
use crate::conv::geometry;
use crate::matmul::{Mat, MatElem};
use crate::simd;
use crate::view::{View, ViewMut};

/// A 2-D convolution's sizes (a 1-D one has height 1).
#[derive(Clone, Copy)]
struct Plane {
    ih: usize,
    iw: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
}

pub fn convolution(p: &ConvAttrs, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let (x, w, bias) = match inputs {
        [Some(x), Some(w)] => (x, w, None),
        [Some(x), Some(w), b] => (x, w, *b),
        _ => return false,
    };
    let Ok(g) = geometry(x.shape, w.shape, p) else {
        return false;
    };
    let oshape: Vec<usize> = [&[g.n, g.cout][..], &g.osp].concat();
    if p.transposed || g.insp.len() > 2 || oshape != out.shape {
        return false;
    }
    let two = |v: &[usize]| {
        if v.len() == 2 {
            (v[0], v[1])
        } else {
            (1, v[0])
        }
    };
    let one_or = |v: &[usize], unit: usize| {
        if v.len() == 2 {
            (v[0], v[1])
        } else {
            (unit, v[0])
        }
    };
    let plane = Plane {
        ih: two(&g.insp).0,
        iw: two(&g.insp).1,
        kh: two(&g.ksp).0,
        kw: two(&g.ksp).1,
        oh: two(&g.osp).0,
        ow: two(&g.osp).1,
        stride: one_or(&p.stride, 1),
        pad: one_or(&p.padding, 0),
        dil: one_or(&p.dilation, 1),
    };
    let bias = match bias.map(|b| (b.f32s(), b.numel())) {
        None => None,
        Some((Some(b), n)) if n == g.cout => Some(b),
        Some(_) => return false,
    };
    let (Some(xv), Some(wv), Some(y)) = (x.f32s(), w.f32s(), out.f32s()) else {
        return false;
    };
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    let (ins, os) = (plane.ih * plane.iw, plane.oh * plane.ow);
    let kk = plane.kh * plane.kw;
    if os == 0 {
        return true;
    }
    for img in 0..g.n {
        let x_img = &xv[img * g.cin * ins..(img + 1) * g.cin * ins];
        let y_img = &mut y[img * g.cout * os..(img + 1) * g.cout * os];
        if cin_g == 1 && cout_g == 1 {
            depthwise(&plane, x_img, wv, bias, y_img);
            continue;
        }
        if let Some(b) = bias {
            for (c, plane_out) in y_img.chunks_exact_mut(os).enumerate() {
                plane_out.fill(b[c]);
            }
        }
        let pointwise = kk == 1 && plane.stride == (1, 1) && plane.pad == (0, 0);
        for grp in 0..g.groups {
            let xg = &x_img[grp * cin_g * ins..(grp + 1) * cin_g * ins];
            let wg = Mat {
                data: &wv[grp * cout_g * cin_g * kk..],
                rs: cin_g * kk,
                cs: 1,
            };
            let yg = &mut y_img[grp * cout_g * os..(grp + 1) * cout_g * os];
            let gemm = |cols: &[f32], yg: &mut [f32]| {
                let cols = Mat {
                    data: cols,
                    rs: os,
                    cs: 1,
                };
                let par = Parallelism::Rayon(0);
                f32::gemm(yg, cout_g, os, cin_g * kk, wg, cols, bias.is_some(), par);
            };
            if pointwise {
                gemm(xg, yg);
            } else {
                with_scratch(cin_g * kk * os, |cols| {
                    im2col(&plane, xg, cols);
                    gemm(cols, yg);
                });
            }
        }
    }
    true
}

thread_local! {
    /// im2col columns, kept between calls: a fresh allocation of this size
    /// would be mapped and page-faulted in at every call.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` on `len` elements of this thread's scratch buffer, or of a
/// fresh one when it is in use: a thread waiting inside `f` for its
/// parallel tasks may run another method's convolution meanwhile.
fn with_scratch(len: usize, f: impl FnOnce(&mut [f32])) {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            if s.len() < len {
                s.resize(len, 0.0);
            }
            f(&mut s[..len]);
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// `cols[(c·kh + ki)·kw + kj][oh·ow]`: the input under each kernel tap for
/// every output position, zero in the padding.
fn im2col(p: &Plane, x: &[f32], cols: &mut [f32]) {
    let (ins, os, kk) = (p.ih * p.iw, p.oh * p.ow, p.kh * p.kw);
    cols.par_chunks_mut(os).enumerate().for_each(|(row, col)| {
        let (c, ki, kj) = (row / kk, row % kk / p.kw, row % p.kw);
        let plane = &x[c * ins..(c + 1) * ins];
        let (lo, hi) = valid_range(p.ow, p.iw, kj, p.stride.1, p.pad.1, p.dil.1);
        for (oh, dst) in col.chunks_exact_mut(p.ow).enumerate() {
            let ih = (oh * p.stride.0 + ki * p.dil.0).checked_sub(p.pad.0);
            let Some(src) = ih
                .filter(|&i| i < p.ih)
                .map(|i| &plane[i * p.iw..(i + 1) * p.iw])
            else {
                dst.fill(0.0);
                continue;
            };
            dst[..lo].fill(0.0);
            dst[hi..].fill(0.0);
            if lo == hi {
                continue;
            }
            // first input column read, for output column `lo`
            let start = lo * p.stride.1 + kj * p.dil.1 - p.pad.1;
            if p.stride.1 == 1 {
                dst[lo..hi].copy_from_slice(&src[start..start + hi - lo]);
            } else {
                for (t, d) in dst[lo..hi].iter_mut().enumerate() {
                    *d = src[start + t * p.stride.1];
                }
            }
        }
    });
}

/// One filter per channel: `y[c] = bias[c] + Σ_taps w[c, tap] · x[c]`
/// shifted, accumulated row by row; channels in parallel. With a column
/// stride `s` > 1 each input row is first split into its `s` phases
/// (elements `r, r + s, r + 2s, …`), so that every tap reads a contiguous
/// run and the loop vectorises.
fn depthwise(p: &Plane, x: &[f32], w: &[f32], bias: Option<&[f32]>, y: &mut [f32]) {
    let (ins, os, kk, s) = (p.ih * p.iw, p.oh * p.ow, p.kh * p.kw, p.stride.1);
    // where phase r of a row starts: phases hold ceil((iw - r) / s) elements
    let phase_at: Vec<usize> = (0..s)
        .map(|r| (0..r).map(|q| p.iw.saturating_sub(q).div_ceil(s)).sum())
        .collect();
    y.par_chunks_mut(os).enumerate().for_each(|(c, yc)| {
        let (xc, wc) = (&x[c * ins..(c + 1) * ins], &w[c * kk..(c + 1) * kk]);
        let mut split = vec![];
        let rows = if s == 1 {
            xc
        } else {
            split.resize(ins, 0.0);
            for (src, dst) in xc.chunks_exact(p.iw).zip(split.chunks_exact_mut(p.iw)) {
                let mut at = 0;
                for r in 0..s {
                    for &v in src.iter().skip(r).step_by(s) {
                        dst[at] = v;
                        at += 1;
                    }
                }
            }
            &split
        };
        yc.fill(bias.map_or(0.0, |b| b[c]));
        simd::dispatch(
            #[inline(always)]
            || {
                for (oh, row) in yc.chunks_exact_mut(p.ow).enumerate() {
                    for ki in 0..p.kh {
                        let ih = (oh * p.stride.0 + ki * p.dil.0).checked_sub(p.pad.0);
                        let Some(ih) = ih.filter(|&i| i < p.ih) else {
                            continue;
                        };
                        let src = &rows[ih * p.iw..(ih + 1) * p.iw];
                        for kj in 0..p.kw {
                            let (lo, hi) = valid_range(p.ow, p.iw, kj, s, p.pad.1, p.dil.1);
                            if lo >= hi {
                                continue;
                            }
                            let wt = wc[ki * p.kw + kj];
                            // the first input column read, and where it is
                            let j = lo * s + kj * p.dil.1 - p.pad.1;
                            let start = phase_at[j % s] + j / s;
                            for (d, &v) in row[lo..hi].iter_mut().zip(&src[start..]) {
                                *d += wt * v;
                            }
                        }
                    }
                }
            },
        )
    });
}

#[cfg(test)]
mod tests {
    use super::with_scratch;

    #[test]
    fn scratch_in_use_gives_a_fresh_buffer() {
        with_scratch(4, |outer| {
            outer.fill(1.0);
            with_scratch(8, |inner| {
                assert_eq!(inner.len(), 8);
                inner.fill(2.0);
            });
            assert_eq!(outer, [1.0; 4]);
        });
    }
}
