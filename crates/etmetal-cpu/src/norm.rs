//! Normalisations: layer norm, RMS norm, eval-mode batch norm, group norm.
//! Statistics are computed in f64 and the result rounded once on store.

use etmetal_core::{DType, Result, Tensor};

use crate::buf::Buf;
use crate::ctx::Ctx;

/// The optional per-feature tensor in `slot`, checked to have `n` elements.
fn param(ctx: &Ctx, slot: usize, n: usize, what: &str) -> Result<Option<Vec<f64>>> {
    match ctx.optional(slot) {
        None => Ok(None),
        Some(t) if t.numel() == n => Ok(Some(t.to_f64_vec())),
        Some(t) => Err(ctx.invalid(format!(
            "{what} (slot {slot}) has shape {:?}, expected {n} elements",
            t.shape()
        ))),
    }
}

fn required_param(ctx: &Ctx, slot: usize, n: usize, what: &str) -> Result<Vec<f64>> {
    ctx.input(slot)?;
    Ok(param(ctx, slot, n, what)?.unwrap_or_default())
}

fn float_out(ctx: &Ctx) -> Result<DType> {
    let out = ctx.out_dtype(0)?;
    if !out.is_float() {
        return Err(ctx.unsupported(format!("needs a floating-point output dtype, got {out}")));
    }
    Ok(out)
}

/// Size of the trailing `nd` dims of `x`, the normalised group.
fn trailing(ctx: &Ctx, x: &Tensor, nd: usize) -> Result<usize> {
    if nd > x.rank() {
        return Err(ctx.invalid(format!(
            "normalises {nd} dims of a rank-{} input {:?}",
            x.rank(),
            x.shape()
        )));
    }
    Ok(x.shape()[x.rank() - nd..].iter().product())
}

/// `y = v * scale[i] * w[i] + b[i]` written over a group, `i` its feature index.
fn affine(
    y: &mut [f64],
    w: &Option<Vec<f64>>,
    b: &Option<Vec<f64>>,
    feature: impl Fn(usize) -> usize,
) {
    for (j, e) in y.iter_mut().enumerate() {
        let f = feature(j);
        if let Some(w) = w {
            *e *= w[f];
        }
        if let Some(b) = b {
            *e += b[f];
        }
    }
}

fn mean_var(g: &[f64]) -> (f64, f64) {
    let n = g.len().max(1) as f64;
    let mean = g.iter().sum::<f64>() / n;
    (
        mean,
        g.iter().map(|&e| (e - mean) * (e - mean)).sum::<f64>() / n,
    )
}

pub fn layer_norm(ctx: &Ctx, nd: usize, eps: f64) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = float_out(ctx)?;
    let m = trailing(ctx, x, nd)?;
    let (w, b) = (param(ctx, 1, m, "weight")?, param(ctx, 2, m, "bias")?);
    let mut v = x.to_f64_vec();
    if m > 0 {
        for g in v.chunks_exact_mut(m) {
            let (mean, var) = mean_var(g);
            let rstd = 1.0 / (var + eps).sqrt();
            g.iter_mut().for_each(|e| *e = (*e - mean) * rstd);
            affine(g, &w, &b, |j| j);
        }
    }
    Buf::F64(v).store(out, x.shape())
}

pub fn rms_norm(ctx: &Ctx, nd: usize, eps: Option<f64>) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = float_out(ctx)?;
    let m = trailing(ctx, x, nd)?;
    let w = param(ctx, 1, m, "weight")?;
    // PyTorch's default is the epsilon of the compute type: f32 for f32/bf16/f16
    let eps = eps.unwrap_or(if x.dtype() == DType::F64 {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    });
    let mut v = x.to_f64_vec();
    if m > 0 {
        for g in v.chunks_exact_mut(m) {
            let ms = g.iter().map(|e| e * e).sum::<f64>() / m as f64;
            let r = 1.0 / (ms + eps).sqrt();
            g.iter_mut().for_each(|e| *e *= r);
            affine(g, &w, &None, |j| j);
        }
    }
    Buf::F64(v).store(out, x.shape())
}

/// `(N, C, spatial)` of an `[N, C, *]` input.
fn nc(ctx: &Ctx, x: &Tensor) -> Result<(usize, usize, usize)> {
    if x.rank() < 2 {
        return Err(ctx.invalid(format!(
            "input must have a batch and a channel dim, got shape {:?}",
            x.shape()
        )));
    }
    Ok((x.shape()[0], x.shape()[1], x.shape()[2..].iter().product()))
}

pub fn batch_norm(ctx: &Ctx, eps: f64) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = float_out(ctx)?;
    let (_, c, sp) = nc(ctx, x)?;
    let (w, b) = (param(ctx, 1, c, "weight")?, param(ctx, 2, c, "bias")?);
    let mean = required_param(ctx, 3, c, "running_mean")?;
    let var = required_param(ctx, 4, c, "running_var")?;
    let mut v = x.to_f64_vec();
    if sp > 0 {
        for (p, plane) in v.chunks_exact_mut(sp).enumerate() {
            let ch = p % c;
            let rstd = 1.0 / (var[ch] + eps).sqrt();
            plane.iter_mut().for_each(|e| *e = (*e - mean[ch]) * rstd);
            affine(plane, &w, &b, |_| ch);
        }
    }
    Buf::F64(v).store(out, x.shape())
}

pub fn group_norm(ctx: &Ctx, groups: usize, eps: f64) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = float_out(ctx)?;
    let (_, c, sp) = nc(ctx, x)?;
    if groups == 0 || c % groups != 0 {
        return Err(ctx.invalid(format!("{c} channels do not split into {groups} groups")));
    }
    let (w, b) = (param(ctx, 1, c, "weight")?, param(ctx, 2, c, "bias")?);
    let cg = c / groups;
    let mut v = x.to_f64_vec();
    if cg * sp > 0 {
        for (gi, g) in v.chunks_exact_mut(cg * sp).enumerate() {
            let (mean, var) = mean_var(g);
            let rstd = 1.0 / (var + eps).sqrt();
            g.iter_mut().for_each(|e| *e = (*e - mean) * rstd);
            affine(g, &w, &b, |j| (gi % groups) * cg + j / sp);
        }
    }
    Buf::F64(v).store(out, x.shape())
}

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{DType, Op, Tensor};

    #[test]
    fn layer_group_and_rms_norm_match_pytorch() {
        let x = f32t(&[2, 3, 4], &ramp(24, 11, 7));
        let (w, b) = (
            f32t(&[4], &[1.0, 2.0, 0.5, -1.0]),
            f32t(&[4], &[0.0, 0.1, 0.2, 0.3]),
        );
        let y = run1(
            Op::LayerNorm {
                normalized_dims: 1,
                eps: 1e-5,
            },
            &[&x, &w, &b],
            DType::F32,
            &[2, 3, 4],
        )
        .unwrap();
        // F.layer_norm(x, [4], w, b, 1e-5), PyTorch 2.15
        close(
            &y.to_f32_vec()[..8],
            &[
                -1.3130571,
                1.1504457,
                -0.062611416,
                -1.013057,
                0.19999743,
                -2.699964,
                0.89999098,
                0.49999744,
            ],
            1e-5,
        );
        let g = f32t(&[2, 4, 3], &ramp(24, 11, 7));
        let (gw, gb) = (
            f32t(&[4], &[1.0, 2.0, 3.0, 4.0]),
            f32t(&[4], &[0.0, 1.0, 0.0, 1.0]),
        );
        let y = run1(
            Op::GroupNorm {
                groups: 2,
                eps: 1e-5,
            },
            &[&g, &gw, &gb],
            DType::F32,
            &[2, 4, 3],
        )
        .unwrap();
        close(
            &y.to_f32_vec()[..6],
            &[
                -1.3930421,
                0.6965211,
                -0.49751502,
                4.1840963,
                1.7960241,
                -0.59204817,
            ],
            1e-5,
        );
        let y = run1(
            Op::RmsNorm {
                normalized_dims: 2,
                eps: None,
            },
            &[&x],
            DType::F32,
            &[2, 3, 4],
        )
        .unwrap();
        close(
            &y.to_f32_vec()[12..16],
            &[0.91146529, -0.30382177, 1.8229306, 0.60764354],
            1e-6,
        );
    }

    #[test]
    fn rms_norm_of_bf16_uses_the_f32_epsilon() {
        // F.rms_norm(tensor([[1e-2, 2e-2, -3e-2]]).bfloat16(), [3]) == [0.462890625, 0.92578125, -1.390625]
        let x = Tensor::from_f32(DType::BF16, &[1, 3], &[1e-2, 2e-2, -3e-2]).unwrap();
        let y = run1(
            Op::RmsNorm {
                normalized_dims: 1,
                eps: None,
            },
            &[&x],
            DType::BF16,
            &[1, 3],
        )
        .unwrap();
        assert_eq!(y.to_f32_vec(), vec![0.462890625, 0.92578125, -1.390625]);
    }

    #[test]
    fn batch_norm_eval_and_errors() {
        let x = f32t(&[1, 2, 2], &[1.0, 3.0, -1.0, 5.0]);
        let (mean, var) = (f32t(&[2], &[1.0, 1.0]), f32t(&[2], &[4.0, 1.0]));
        let (w, b) = (f32t(&[2], &[2.0, 1.0]), f32t(&[2], &[0.0, 0.5]));
        let op = Op::BatchNorm { eps: 0.0 };
        let y = crate::execute(
            &op,
            &[Some(&x), Some(&w), Some(&b), Some(&mean), Some(&var)],
            &[(DType::F32, vec![1, 2, 2])],
        )
        .unwrap();
        assert_eq!(y[0].to_f32_vec(), vec![0.0, 2.0, -1.5, 4.5]);
        let e = crate::execute(
            &op,
            &[
                Some(&x),
                None,
                None,
                Some(&f32t(&[3], &[0.0; 3])),
                Some(&var),
            ],
            &[(DType::F32, vec![1, 2, 2])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("running_mean"), "{e}");
        let e = run1(
            Op::GroupNorm {
                groups: 3,
                eps: 1e-5,
            },
            &[&x],
            DType::F32,
            &[1, 2, 2],
        )
        .unwrap_err();
        assert!(e.to_string().contains("3 groups"), "{e}");
    }
}
