//! `upsample_*` (`F.interpolate`) in nearest, nearest-exact and (bi)linear
//! modes, one spatial dim at a time: each output position reads one input
//! position (nearest) or two with weights (linear), all computed here from
//! the static sizes, so the kernels are gathers, multiplies and adds.

use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest,
    NearestExact,
    Linear { align_corners: bool },
}

/// PyTorch's `area_pixel_compute_scale`: the input step per output step.
fn step(input: usize, output: usize, scale: Option<f64>, align_corners: bool) -> f64 {
    if align_corners {
        return if output > 1 {
            (input as f64 - 1.0) / (output as f64 - 1.0)
        } else {
            0.0
        };
    }
    match scale {
        Some(s) if s > 0.0 => 1.0 / s,
        _ => input as f64 / output as f64,
    }
}

impl Lowerer<'_> {
    /// The `upsample_*` targets; `Ok(false)` for other names.
    pub(super) fn upsample(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let (mode, spatial) = match name {
            "upsample_nearest1d" => (Mode::Nearest, 1),
            "upsample_nearest2d" => (Mode::Nearest, 2),
            "upsample_nearest3d" => (Mode::Nearest, 3),
            "_upsample_nearest_exact1d" => (Mode::NearestExact, 1),
            "_upsample_nearest_exact2d" => (Mode::NearestExact, 2),
            "_upsample_nearest_exact3d" => (Mode::NearestExact, 3),
            "upsample_linear1d" | "upsample_bilinear2d" | "upsample_trilinear3d" => {
                let align_corners = c.args.bool("align_corners", false)?;
                let spatial = match name {
                    "upsample_linear1d" => 1,
                    "upsample_bilinear2d" => 2,
                    _ => 3,
                };
                (Mode::Linear { align_corners }, spatial)
            }
            _ => return Ok(false),
        };
        let x = self.t(
            c,
            if c.args.is_tensor("input")? {
                "input"
            } else {
                "self"
            },
        )?;
        let shape = self.shape(x);
        let first = shape
            .len()
            .checked_sub(spatial)
            .filter(|&f| f >= 1)
            .ok_or_else(|| Error::shape(format!("{name} of a tensor of shape {shape:?}")))?;
        let input = &shape[first..];
        // `.vec` takes output_size or scale_factors; `.default` output_size and scales_*
        let factors: Vec<Option<f64>> = if overload == "vec" {
            match c.args.get("scale_factors")? {
                Some(("as_floats", v)) => v
                    .as_array()
                    .ok_or_else(|| Error::format("bad scale_factors"))?
                    .iter()
                    .map(|f| super::super::json::float(f).map(Some))
                    .collect::<Result<_>>()?,
                _ => vec![None; spatial],
            }
        } else {
            let names: &[&str] = match spatial {
                1 => &["scales"],
                2 => &["scales_h", "scales_w"],
                _ => &["scales_d", "scales_h", "scales_w"],
            };
            names
                .iter()
                .map(|n| c.args.opt_float(n))
                .collect::<Result<_>>()?
        };
        if factors.len() != spatial {
            return Err(Error::format(format!(
                "{name} with scale factors {factors:?}"
            )));
        }
        let output: Vec<usize> = match c.args.ints("output_size")? {
            Some(o) if !o.is_empty() => super::usizes(&o, "output_size")?,
            _ => input
                .iter()
                .zip(&factors)
                .map(|(&n, f)| match f {
                    Some(f) => Ok((n as f64 * f).floor() as usize),
                    None => Err(Error::format(format!(
                        "{name} with neither output_size nor scale factors"
                    ))),
                })
                .collect::<Result<_>>()?,
        };
        if output.len() != spatial || output.contains(&0) {
            return Err(Error::shape(format!("{name} to size {output:?}")));
        }
        // a scale given with an explicit output size still sets the step,
        // as in PyTorch; for `.vec` the factors always came with the size
        let mut v = x;
        for k in 0..spatial {
            let (n, m) = (input[k], output[k]);
            if n == m && factors[k].is_none_or(|f| f == 1.0) {
                continue;
            }
            v = self.resize_dim(c, v, first + k, (n, m), factors[k], mode)?;
        }
        if v == x {
            v = self.emit1(c, Op::Identity, vec![Some(x)])?;
        }
        self.bind(c, 0, v)?;
        Ok(true)
    }

    fn index_table(&mut self, c: &Ctx, what: &str, idx: Vec<i64>) -> Result<ValueId> {
        let t = Tensor::from_i64(DType::I64, &[idx.len()], &idx)?;
        Ok(self.add_table(c, what, t))
    }

    /// Dim `dim` of `x` resized from `n` to `m` (`sizes`).
    fn resize_dim(
        &mut self,
        c: &Ctx,
        x: ValueId,
        dim: usize,
        (n, m): (usize, usize),
        scale: Option<f64>,
        mode: Mode,
    ) -> Result<ValueId> {
        let last = n as i64 - 1;
        let (align, linear) = match mode {
            Mode::Linear { align_corners } => (align_corners, true),
            _ => (false, false),
        };
        // float32 arithmetic, as PyTorch's kernels, so boundaries round alike
        let s = step(n, m, scale, align) as f32;
        if !linear {
            let offset = if mode == Mode::NearestExact { 0.5 } else { 0.0 };
            let idx = (0..m)
                .map(|j| (((j as f32 + offset) * s).floor() as i64).min(last))
                .collect();
            let idx = self.index_table(c, &format!("nearest{dim}"), idx)?;
            return self.emit1(c, Op::IndexSelect { dim }, vec![Some(x), Some(idx)]);
        }
        let mut lo = Vec::with_capacity(m);
        let mut hi = Vec::with_capacity(m);
        let mut w_hi = Vec::with_capacity(m);
        for j in 0..m {
            let src = if align {
                j as f32 * s
            } else {
                ((j as f32 + 0.5) * s - 0.5).max(0.0)
            };
            let i0 = (src.floor() as i64).min(last);
            lo.push(i0);
            hi.push((i0 + 1).min(last));
            w_hi.push(f64::from(src - i0 as f32));
        }
        let rank = self.rank(x);
        let mut wshape = vec![1; rank];
        wshape[dim] = m;
        let dtype = self.dtype(x);
        let w_lo: Vec<f64> = w_hi.iter().map(|w| 1.0 - w).collect();
        let w_lo = Tensor::from_f64(dtype, &wshape, &w_lo)?;
        let w_lo = self.add_table(c, "w_lo", w_lo);
        let w_hi = Tensor::from_f64(dtype, &wshape, &w_hi)?;
        let w_hi = self.add_table(c, "w_hi", w_hi);
        let lo = self.index_table(c, &format!("lo{dim}"), lo)?;
        let hi = self.index_table(c, &format!("hi{dim}"), hi)?;
        let a = self.emit1(c, Op::IndexSelect { dim }, vec![Some(x), Some(lo)])?;
        let b = self.emit1(c, Op::IndexSelect { dim }, vec![Some(x), Some(hi)])?;
        let a = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(a), Some(w_lo)])?;
        let b = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(b), Some(w_hi)])?;
        self.emit1(c, Op::Binary(BinaryOp::Add), vec![Some(a), Some(b)])
    }
}
