//! N-d convolution (1-D, 2-D, 3-D, …) and transposed convolution with
//! stride, padding, dilation and groups, as im2col / col2im around a GEMM per
//! (batch, group); batches run in parallel.

use etmetal_core::{Result, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::buf::{domain, numeric, Elem};
use crate::matmul::{Mat, MatElem};
use crate::strided::window_table;
use crate::Ctx;

pub struct ConvParams<'a> {
    pub stride: &'a [usize],
    pub padding: &'a [usize],
    pub dilation: &'a [usize],
    pub transposed: bool,
    pub output_padding: &'a [usize],
    pub groups: usize,
}

/// Checked sizes of one convolution.
struct Geometry {
    n: usize,
    cin: usize,
    cout: usize,
    groups: usize,
    insp: Vec<usize>,
    ksp: Vec<usize>,
    osp: Vec<usize>,
}

fn geometry(ctx: &Ctx, x: &Tensor, w: &Tensor, p: &ConvParams) -> Result<Geometry> {
    let sr = p.stride.len();
    let op = if p.output_padding.is_empty() {
        vec![0; sr]
    } else {
        p.output_padding.to_vec()
    };
    if p.padding.len() != sr || p.dilation.len() != sr || op.len() != sr || sr == 0 {
        return Err(ctx.invalid(format!(
            "stride {:?}, padding {:?}, dilation {:?} and output_padding {:?} need one entry per spatial dim",
            p.stride, p.padding, p.dilation, p.output_padding
        )));
    }
    if x.rank() != sr + 2 || w.rank() != sr + 2 {
        return Err(ctx.invalid(format!(
            "input {:?} and weight {:?} must both have rank {} (batch, channels, {sr} spatial dims)",
            x.shape(),
            w.shape(),
            sr + 2
        )));
    }
    if p.stride.contains(&0) || p.dilation.contains(&0) || p.groups == 0 {
        return Err(ctx.invalid("stride, dilation and groups must be positive"));
    }
    let (n, cin, g) = (x.shape()[0], x.shape()[1], p.groups);
    let insp = x.shape()[2..].to_vec();
    let ksp = w.shape()[2..].to_vec();
    let cout = if p.transposed {
        w.shape()[1] * g
    } else {
        w.shape()[0]
    };
    let wcin = if p.transposed {
        w.shape()[0]
    } else {
        w.shape()[1] * g
    };
    if cin != wcin || cin % g != 0 || cout % g != 0 {
        return Err(ctx.invalid(format!(
            "input {:?} and weight {:?} disagree on channels with {g} groups",
            x.shape(),
            w.shape()
        )));
    }
    let mut osp = vec![];
    for d in 0..sr {
        let span = (p.dilation[d] * ksp[d].saturating_sub(1)) as i64;
        let (i, s, pad) = (insp[d] as i64, p.stride[d] as i64, p.padding[d] as i64);
        let o = if p.transposed {
            (i - 1) * s - 2 * pad + span + op[d] as i64 + 1
        } else {
            let num = i + 2 * pad - span - 1;
            if num < 0 {
                0
            } else {
                num / s + 1
            }
        };
        if o <= 0 || ksp[d] == 0 {
            return Err(ctx.invalid(format!(
                "spatial dim {d}: input {i}, kernel {}, stride {s}, padding {pad} give no output",
                ksp[d]
            )));
        }
        osp.push(o as usize);
    }
    Ok(Geometry {
        n,
        cin,
        cout,
        groups: g,
        insp,
        ksp,
        osp,
    })
}

pub fn convolution(ctx: &Ctx, p: &ConvParams) -> Result<Tensor> {
    let (x, w) = (ctx.input(0)?, ctx.input(1)?);
    let geo = geometry(ctx, x, w, p)?;
    let bias = ctx.optional(2);
    if let Some(b) = bias {
        if b.numel() != geo.cout {
            return Err(ctx.invalid(format!(
                "bias of shape {:?} does not match {} output channels",
                b.shape(),
                geo.cout
            )));
        }
    }
    let oshape: Vec<usize> = [vec![geo.n, geo.cout], geo.osp.clone()].concat();
    etmetal_core::shape::numel(&oshape)?;
    let buf = numeric!(domain(ctx.out_dtype(0)?), T => {
        let b = bias.map(T::load);
        let (xv, wv) = (T::load(x), T::load(w));
        Elem::wrap(if p.transposed { conv_transposed(&geo, p, &xv, &wv, b.as_deref()) } else { conv_forward(&geo, p, &xv, &wv, b.as_deref()) })
    }, bool => return Err(ctx.unsupported("convolution of bool tensors")));
    buf.store(ctx.out_dtype(0)?, &oshape)
}

/// Run `per_image(image_index, output_chunk, parallelism)` for each batch
/// image, in parallel across images when there are several.
fn per_image<T: Send>(out: &mut [T], n: usize, f: impl Fn(usize, &mut [T], Parallelism) + Sync) {
    let chunk = out.len() / n.max(1);
    if chunk == 0 {
        return;
    }
    if n == 1 {
        f(0, out, Parallelism::Rayon(0));
    } else {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, o)| f(i, o, Parallelism::None));
    }
}

fn add_bias<T: MatElem>(out: &mut [T], bias: Option<&[T]>, sp: usize) {
    if let Some(b) = bias {
        for (i, plane) in out.chunks_exact_mut(sp).enumerate() {
            let v = b[i % b.len()];
            plane.iter_mut().for_each(|e| *e = *e + v);
        }
    }
}

fn conv_forward<T: MatElem>(
    g: &Geometry,
    p: &ConvParams,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
) -> Vec<T> {
    let (ins, os, k): (usize, usize, usize) = (
        g.insp.iter().product(),
        g.osp.iter().product(),
        g.ksp.iter().product(),
    );
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    let table = window_table(&g.osp, &g.ksp, &g.insp, p.stride, p.dilation, p.padding);
    let mut out = vec![T::default(); g.n * g.cout * os];
    per_image(&mut out, g.n, |img, dst, par| {
        let mut cols = vec![T::default(); cin_g * k * os];
        for grp in 0..g.groups {
            let xg = &x[(img * g.cin + grp * cin_g) * ins..];
            for c in 0..cin_g {
                for (kk, row) in table.chunks_exact(os).enumerate() {
                    let col = &mut cols[(c * k + kk) * os..(c * k + kk + 1) * os];
                    for (dst, src) in col.iter_mut().zip(row) {
                        *dst = src.map_or(T::default(), |s| xg[c * ins + s]);
                    }
                }
            }
            let wg = Mat {
                data: &w[grp * cout_g * cin_g * k..],
                rs: cin_g * k,
                cs: 1,
            };
            let dst = &mut dst[grp * cout_g * os..(grp + 1) * cout_g * os];
            T::mm(
                dst,
                cout_g,
                os,
                cin_g * k,
                wg,
                Mat {
                    data: &cols,
                    rs: os,
                    cs: 1,
                },
                par,
            );
        }
    });
    add_bias(&mut out, bias, os);
    out
}

fn conv_transposed<T: MatElem>(
    g: &Geometry,
    p: &ConvParams,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
) -> Vec<T> {
    let (ins, os, k): (usize, usize, usize) = (
        g.insp.iter().product(),
        g.osp.iter().product(),
        g.ksp.iter().product(),
    );
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    // where input position i lands in the output for kernel position kk
    let table = window_table(&g.insp, &g.ksp, &g.osp, p.stride, p.dilation, p.padding);
    let mut out = vec![T::default(); g.n * g.cout * os];
    per_image(&mut out, g.n, |img, dst, par| {
        let mut cols = vec![T::default(); cout_g * k * ins];
        for grp in 0..g.groups {
            // cols[co*k + kk, i] = Σ_c w[c, co, kk] x[c, i]: the group's weight read transposed
            let wg = Mat {
                data: &w[grp * cin_g * cout_g * k..],
                rs: 1,
                cs: cout_g * k,
            };
            let xg = Mat {
                data: &x[(img * g.cin + grp * cin_g) * ins..],
                rs: ins,
                cs: 1,
            };
            T::mm(&mut cols, cout_g * k, ins, cin_g, wg, xg, par);
            for co in 0..cout_g {
                let plane = &mut dst[(grp * cout_g + co) * os..(grp * cout_g + co + 1) * os];
                for (kk, row) in table.chunks_exact(ins).enumerate() {
                    let col = &cols[(co * k + kk) * ins..(co * k + kk + 1) * ins];
                    for (v, o) in col.iter().zip(row) {
                        if let Some(o) = o {
                            plane[*o] = plane[*o] + *v;
                        }
                    }
                }
            }
        }
    });
    add_bias(&mut out, bias, os);
    out
}
