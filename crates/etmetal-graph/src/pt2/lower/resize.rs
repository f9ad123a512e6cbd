//! `upsample_*` (`F.interpolate`) in nearest, nearest-exact, (bi)linear and
//! bicubic modes, one spatial dim at a time: each output position reads one
//! input position (nearest), two with weights (linear) or four (cubic), all
//! computed here from the static sizes, so the kernels are gathers,
//! multiplies and adds.

use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest,
    NearestExact,
    Linear { align_corners: bool },
    Cubic { align_corners: bool },
}

/// PyTorch's bicubic convolution weights (A = -0.75) of the four taps
/// around a source position `t` past its floor.
fn cubic_weights(t: f32) -> [f32; 4] {
    const A: f32 = -0.75;
    let near = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let far = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
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
            "upsample_bicubic2d" => {
                let align_corners = c.args.bool("align_corners", false)?;
                (Mode::Cubic { align_corners }, 2)
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
        let align = match mode {
            Mode::Linear { align_corners } | Mode::Cubic { align_corners } => align_corners,
            _ => false,
        };
        // float32 arithmetic, as PyTorch's kernels, so boundaries round alike
        let s = step(n, m, scale, align) as f32;
        let source = |j: usize| {
            if align {
                j as f32 * s
            } else {
                (j as f32 + 0.5) * s - 0.5
            }
        };
        // per tap: the input position and weight of each output position
        let taps: Vec<(Vec<i64>, Vec<f64>)> = match mode {
            Mode::Nearest | Mode::NearestExact => {
                let offset = if mode == Mode::NearestExact { 0.5 } else { 0.0 };
                let idx = (0..m)
                    .map(|j| (((j as f32 + offset) * s).floor() as i64).min(last))
                    .collect();
                let idx = self.index_table(c, &format!("nearest{dim}"), idx)?;
                return self.emit1(c, Op::IndexSelect { dim }, vec![Some(x), Some(idx)]);
            }
            Mode::Linear { .. } => {
                let mut taps = vec![(Vec::with_capacity(m), Vec::with_capacity(m)); 2];
                for j in 0..m {
                    let src = source(j).max(0.0);
                    let i0 = (src.floor() as i64).min(last);
                    let w = f64::from(src - i0 as f32);
                    taps[0].0.push(i0);
                    taps[0].1.push(1.0 - w);
                    taps[1].0.push((i0 + 1).min(last));
                    taps[1].1.push(w);
                }
                taps
            }
            Mode::Cubic { .. } => {
                // taps at floor - 1 ..= floor + 2, clamped into the input
                let mut taps = vec![(Vec::with_capacity(m), Vec::with_capacity(m)); 4];
                for j in 0..m {
                    let src = source(j);
                    let i0 = src.floor();
                    let w = cubic_weights(src - i0);
                    for (k, tap) in taps.iter_mut().enumerate() {
                        tap.0.push((i0 as i64 - 1 + k as i64).clamp(0, last));
                        tap.1.push(f64::from(w[k]));
                    }
                }
                taps
            }
        };
        let rank = self.rank(x);
        let mut wshape = vec![1; rank];
        wshape[dim] = m;
        let dtype = self.dtype(x);
        let mut sum = None;
        for (k, (idx, w)) in taps.into_iter().enumerate() {
            let w = Tensor::from_f64(dtype, &wshape, &w)?;
            let w = self.add_table(c, &format!("w{k}_{dim}"), w);
            let idx = self.index_table(c, &format!("tap{k}_{dim}"), idx)?;
            let v = self.emit1(c, Op::IndexSelect { dim }, vec![Some(x), Some(idx)])?;
            let v = self.emit1(c, Op::Binary(BinaryOp::Mul), vec![Some(v), Some(w)])?;
            sum = Some(match sum {
                None => v,
                Some(acc) => self.emit1(c, Op::Binary(BinaryOp::Add), vec![Some(acc), Some(v)])?,
            });
        }
        sum.ok_or_else(|| Error::shape("a resize with no taps"))
    }
}
