//! N-d convolution (1-D, 2-D, 3-D, …) and transposed convolution with
//! stride, padding, dilation and groups, as im2col / col2im around a GEMM per
//! (batch, group); batches run in parallel.

use etmetal_core::{ConvAttrs, Error, Result, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::buf::{domain, numeric, Elem};
use crate::ctx::Ctx;
use crate::matmul::{Mat, MatElem};
use crate::strided::window_table;

/// Checked sizes of one convolution.
pub(crate) struct Geometry {
    pub n: usize,
    pub cin: usize,
    pub cout: usize,
    pub groups: usize,
    pub insp: Vec<usize>,
    pub ksp: Vec<usize>,
    pub osp: Vec<usize>,
}

/// Element counts of one spatial plane (input, output, kernel) and the
/// channels per group, as both convolution directions use them.
struct Sizes {
    ins: usize,
    os: usize,
    k: usize,
    cin_g: usize,
    cout_g: usize,
}

impl Geometry {
    fn sizes(&self) -> Sizes {
        Sizes {
            ins: self.insp.iter().product(),
            os: self.osp.iter().product(),
            k: self.ksp.iter().product(),
            cin_g: self.cin / self.groups,
            cout_g: self.cout / self.groups,
        }
    }
}

/// The sizes of a convolution of an input of shape `x` with a weight of
/// shape `w`, or why they do not fit together.
pub(crate) fn geometry(x: &[usize], w: &[usize], p: &ConvAttrs) -> Result<Geometry> {
    let sr = p.spatial_rank();
    if x.len() != sr + 2 || w.len() != sr + 2 {
        return Err(Error::shape(format!(
            "input {:?} and weight {:?} must both have rank {} (batch, channels, {sr} spatial dims)",
            x,
            w,
            sr + 2
        )));
    }
    let g = p.groups;
    if g == 0 {
        return Err(Error::shape("groups must be positive"));
    }
    let (n, cin) = (x[0], x[1]);
    let (wcin, cout) = p.channels(w);
    if cin != wcin || cin % g != 0 || cout % g != 0 {
        return Err(Error::shape(format!(
            "input {:?} and weight {:?} disagree on channels with {g} groups",
            x, w
        )));
    }
    let (insp, ksp) = (x[2..].to_vec(), w[2..].to_vec());
    let osp = p.output_spatial(&insp, &ksp)?;
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

pub fn convolution(ctx: &Ctx, p: &ConvAttrs) -> Result<Tensor> {
    let (x, w) = (ctx.input(0)?, ctx.input(1)?);
    let geo = geometry(x.shape(), w.shape(), p).map_err(|e| ctx.invalid(e))?;
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
    p: &ConvAttrs,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
) -> Vec<T> {
    let Sizes {
        ins,
        os,
        k,
        cin_g,
        cout_g,
    } = g.sizes();
    let table = window_table(&g.osp, &g.ksp, &g.insp, &p.stride, &p.dilation, &p.padding);
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
    p: &ConvAttrs,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
) -> Vec<T> {
    let Sizes {
        ins,
        os,
        k,
        cin_g,
        cout_g,
    } = g.sizes();
    // where input position i lands in the output for kernel position kk
    let table = window_table(&g.insp, &g.ksp, &g.osp, &p.stride, &p.dilation, &p.padding);
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

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{ConvAttrs, DType, Op, Tensor};

    fn conv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, op: Op, shape: &[usize]) -> Vec<f32> {
        crate::execute(&op, &[Some(x), Some(w), b], &[(DType::F32, shape.to_vec())]).unwrap()[0]
            .to_f32_vec()
    }

    fn params(
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
        transposed: bool,
        output_padding: &[usize],
        groups: usize,
    ) -> Op {
        Op::Convolution(ConvAttrs {
            stride: stride.to_vec(),
            padding: padding.to_vec(),
            dilation: dilation.to_vec(),
            transposed,
            output_padding: output_padding.to_vec(),
            groups,
        })
    }

    // Expected values below come from PyTorch 2.15 on the same ramp inputs.

    #[test]
    fn conv1d_with_stride_padding_dilation_bias() {
        let x = f32t(&[2, 3, 7], &ramp(42, 11, 7));
        let w = f32t(&[4, 3, 3], &ramp(36, 13, 5));
        let b = f32t(&[4], &[0.5, -0.25, 0.0, 1.0]);
        let y = conv(
            &x,
            &w,
            Some(&b),
            params(&[2], &[1], &[2], false, &[0], 1),
            &[2, 4, 3],
        );
        close(
            &y[..12],
            &[
                2.0625, 3.375, -1.5, 2.125, 1.875, 1.125, 0.75, 4.625, 2.3125, 0.125, 2.4375, 4.25,
            ],
            1e-6,
        );
        close(
            &y[12..],
            &[
                4.3125, 0.0, -0.0625, -3.0625, 0.375, 1.625, 3.5625, -3.9375, -1.375, -1.25,
                4.6875, -0.375,
            ],
            1e-6,
        );
    }

    #[test]
    fn conv2d_depthwise_and_grouped() {
        let x = f32t(&[1, 4, 5, 4], &ramp(80, 11, 7));
        let w = f32t(&[4, 1, 3, 2], &ramp(24, 13, 5));
        let y = conv(
            &x,
            &w,
            None,
            params(&[2, 1], &[1, 0], &[1, 1], false, &[], 4),
            &[1, 4, 3, 3],
        );
        close(
            &y[..9],
            &[
                -2.5, 3.375, 0.3125, -2.1875, 5.125, 1.4375, -2.1875, 2.375, -0.625,
            ],
            1e-6,
        );
        close(
            &y[27..],
            &[
                -1.0625, -0.375, 1.6875, 1.625, 0.3125, 0.375, 3.25, -1.3125, -0.375,
            ],
            1e-6,
        );
        let w = f32t(&[4, 2, 2, 3], &ramp(48, 13, 5));
        let b = f32t(&[4], &[1.0, 2.0, 3.0, 4.0]);
        let y = conv(
            &x,
            &w,
            Some(&b),
            params(&[1, 1], &[0, 1], &[1, 1], false, &[0, 0], 2),
            &[1, 4, 4, 4],
        );
        close(
            &y[..8],
            &[1.6875, 6.8125, 4.0625, 1.5, 2.5, 6.125, -0.75, -0.1875],
            1e-6,
        );
        close(
            &y[56..],
            &[8.875, 10.375, -2.5, 6.5, 7.1875, 0.125, 8.5625, 3.6875],
            1e-6,
        );
    }

    #[test]
    fn transposed_convolutions() {
        // x[:, :, :3, :3] of the ramp above
        let full = ramp(80, 11, 7);
        let x: Vec<f32> = (0..4)
            .flat_map(|c| (0..3).flat_map(move |i| (0..3).map(move |j| (c, i, j))))
            .map(|(c, i, j)| full[c * 20 + i * 4 + j])
            .collect();
        let x = f32t(&[1, 4, 3, 3], &x);
        let w = f32t(&[4, 3, 3, 2], &ramp(72, 13, 5));
        let b = f32t(&[3], &[0.1, 0.2, 0.3]);
        let y = conv(
            &x,
            &w,
            Some(&b),
            params(&[2, 2], &[1, 1], &[1, 1], true, &[1, 1], 1),
            &[1, 3, 6, 5],
        );
        close(
            &y[..6],
            &[
                -1.4,
                1.4125,
                2.9749999,
                -0.33750001,
                0.47499999,
                -0.52499998,
            ],
            1e-6,
        );
        close(
            &y[84..],
            &[0.98750001, 0.48750001, 3.1125, 1.05, 0.61250001, 0.23750001],
            1e-6,
        );
        // conv_transpose1d, groups 2, dilation 2 on x2[0, :, 0, :]
        let x1: Vec<f32> = (0..4)
            .flat_map(|c| (0..4).map(move |j| (c, j)))
            .map(|(c, j)| full[c * 20 + j])
            .collect();
        let x1 = f32t(&[1, 4, 4], &x1);
        let w1 = f32t(&[4, 1, 3], &ramp(12, 13, 5));
        let y = conv(
            &x1,
            &w1,
            None,
            params(&[1], &[0], &[2], true, &[0], 2),
            &[1, 2, 8],
        );
        close(
            &y,
            &[
                0.5, -0.75, 1.25, -1.6875, -0.3125, 2.0625, -2.375, 3.75, -0.25, 0.625, -0.4375,
                0.875, 1.625, -1.0625, -0.8125, 0.1875,
            ],
            1e-6,
        );
    }

    #[test]
    fn bad_geometry_is_an_error() {
        let x = f32t(&[1, 3, 4], &[0.0; 12]);
        let w = f32t(&[2, 2, 3], &[0.0; 12]);
        let e = crate::execute(
            &params(&[1], &[0], &[1], false, &[0], 1),
            &[Some(&x), Some(&w), None],
            &[(DType::F32, vec![1, 2, 2])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("channels"), "{e}");
        let w = f32t(&[2, 3, 5], &[0.0; 30]);
        let e = crate::execute(
            &params(&[1], &[0], &[1], false, &[0], 1),
            &[Some(&x), Some(&w), None],
            &[(DType::F32, vec![1, 2, 1])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("no output"), "{e}");
    }
}
