//! Pooling over the trailing spatial dims: max pool (optionally with
//! PyTorch's flat per-plane indices), average pool and adaptive average pool.
//! Inputs may be batched (`[N, C, *]`) or not (`[C, *]`).

use etmetal_core::shape::contiguous_strides;
use etmetal_core::{AvgPoolAttrs, MaxPoolAttrs, Result, Tensor};

use crate::buf::{with_ordered, Buf, Elem};
use crate::ctx::Ctx;
use crate::strided::{for_each_offset, window_table};

/// `(planes, spatial dims)` of an input with `sr` trailing spatial dims.
fn planes(ctx: &Ctx, x: &Tensor, sr: usize) -> Result<(usize, Vec<usize>)> {
    if sr == 0 || x.rank() < sr + 1 || x.rank() > sr + 2 {
        return Err(ctx.invalid(format!(
            "a {sr}-d pool needs a rank {} or {} input, got {:?}",
            sr + 1,
            sr + 2,
            x.shape()
        )));
    }
    let lead = x.rank() - sr;
    Ok((
        x.shape()[..lead].iter().product(),
        x.shape()[lead..].to_vec(),
    ))
}

pub fn max_pool(ctx: &Ctx, p: &MaxPoolAttrs) -> Result<Vec<Tensor>> {
    let x = ctx.input(0)?;
    let sr = p.spatial_rank();
    let (np, insp) = planes(ctx, x, sr)?;
    let w = p.window().map_err(|e| ctx.invalid(e))?;
    let osp = w.output_spatial(&insp).map_err(|e| ctx.invalid(e))?;
    let table = window_table(&osp, &w.kernel, &insp, &w.stride, &w.dilation, &w.padding);
    let (ins, os): (usize, usize) = (insp.iter().product(), osp.iter().product());
    let oshape: Vec<usize> = [&x.shape()[..x.rank() - sr], &osp[..]].concat();
    let (values, idx) = with_ordered!(x, v => {
        let mut vals = Vec::with_capacity(np * os);
        let mut idx = Vec::with_capacity(np * os);
        for plane in v.chunks_exact(ins.max(1)).take(np) {
            for o in 0..os {
                #[allow(clippy::eq_op)]
                let best = table.iter().skip(o).step_by(os).flatten().fold(None, |best: Option<usize>, &i| match best {
                    // NaN wins and stays, as in PyTorch
                    Some(b) if plane[b] != plane[b] || !(plane[i] > plane[b] || plane[i] != plane[i]) => Some(b),
                    _ => Some(i),
                });
                let b = best.unwrap_or(0);
                vals.push(plane[b]);
                idx.push(b as i64);
            }
        }
        (Elem::wrap(vals), idx)
    });
    let mut out = vec![values.store(ctx.out_dtype(0)?, &oshape)?];
    if p.with_indices {
        out.push(Buf::I64(idx).store(ctx.out_dtype(1)?, &oshape)?);
    }
    Ok(out)
}

pub fn avg_pool(ctx: &Ctx, p: &AvgPoolAttrs) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    if !out.is_float() {
        return Err(ctx.unsupported(format!(
            "average pooling needs a floating-point output dtype, got {out}"
        )));
    }
    let sr = p.spatial_rank();
    let (np, insp) = planes(ctx, x, sr)?;
    let w = p.window().map_err(|e| ctx.invalid(e))?;
    let osp = w.output_spatial(&insp).map_err(|e| ctx.invalid(e))?;
    let (stride, padding) = (&w.stride, &w.padding);
    if p.divisor_override == Some(0) {
        return Err(ctx.invalid("divisor_override must be non-zero"));
    }
    let table = window_table(&osp, &w.kernel, &insp, stride, &w.dilation, padding);
    let (ins, os): (usize, usize) = (insp.iter().product(), osp.iter().product());
    // the divisor of each output position: PyTorch clips the window to the
    // padded input for count_include_pad, to the input otherwise
    let mut divisors = Vec::with_capacity(os);
    let ostrides = contiguous_strides(&osp);
    for_each_offset(&osp, [&ostrides], [0], |[flat]| {
        let (mut padded, mut inside) = (1i64, 1i64);
        let mut rem = flat;
        for d in 0..sr {
            let o = rem / ostrides[d].max(1);
            rem -= o * ostrides[d];
            let start = (o * stride[d]) as i64 - padding[d] as i64;
            let end = (start + p.kernel[d] as i64).min((insp[d] + padding[d]) as i64);
            padded *= end - start;
            inside *= end.min(insp[d] as i64) - start.max(0);
        }
        divisors.push(p.divisor_override.unwrap_or(if p.count_include_pad {
            padded
        } else {
            inside
        }) as f64);
    });
    let v = x.to_f64_vec();
    let mut res = Vec::with_capacity(np * os);
    for plane in v.chunks_exact(ins.max(1)).take(np) {
        for (o, div) in divisors.iter().enumerate() {
            let sum: f64 = table
                .iter()
                .skip(o)
                .step_by(os)
                .flatten()
                .map(|&i| plane[i])
                .sum();
            res.push(sum / div);
        }
    }
    let oshape: Vec<usize> = [&x.shape()[..x.rank() - sr], &osp[..]].concat();
    Buf::F64(res).store(out, &oshape)
}

pub fn adaptive_avg_pool(ctx: &Ctx, output_size: &[usize]) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    if !out.is_float() {
        return Err(ctx.unsupported(format!(
            "average pooling needs a floating-point output dtype, got {out}"
        )));
    }
    let sr = output_size.len();
    let (np, insp) = planes(ctx, x, sr)?;
    if insp.contains(&0) && !output_size.contains(&0) {
        return Err(ctx.invalid(format!("cannot pool an empty input {:?}", x.shape())));
    }
    let (ins, os): (usize, usize) = (insp.iter().product(), output_size.iter().product());
    let istrides = contiguous_strides(&insp);
    let ostrides = contiguous_strides(output_size);
    // each output position's window as (start offset, box shape)
    let mut windows = Vec::with_capacity(os);
    for_each_offset(output_size, [&ostrides], [0], |[flat]| {
        let (mut start, mut dims, mut rem) = (0, vec![], flat);
        for d in 0..sr {
            let o = rem / ostrides[d].max(1);
            rem -= o * ostrides[d];
            let (i, n) = (insp[d], output_size[d]);
            let (s, e) = (o * i / n, ((o + 1) * i).div_ceil(n));
            start += s * istrides[d];
            dims.push(e - s);
        }
        windows.push((start, dims));
    });
    let v = x.to_f64_vec();
    let mut res = Vec::with_capacity(np * os);
    for plane in v.chunks_exact(ins.max(1)).take(np) {
        for (start, dims) in &windows {
            let mut sum = 0.0;
            for_each_offset(dims, [&istrides], [*start], |[i]| sum += plane[i]);
            res.push(sum / dims.iter().product::<usize>() as f64);
        }
    }
    let oshape: Vec<usize> = [&x.shape()[..x.rank() - sr], output_size].concat();
    Buf::F64(res).store(out, &oshape)
}

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{AvgPoolAttrs, DType, MaxPoolAttrs, Op};

    // Expected values come from PyTorch 2.15 on x = ramp(50, 17, 5) as [1, 2, 5, 5].

    #[test]
    fn max_pool_ceil_mode_with_indices() {
        let x = f32t(&[1, 2, 5, 5], &ramp(50, 17, 5));
        let op = Op::MaxPool(MaxPoolAttrs {
            kernel: vec![3, 3],
            stride: vec![2, 2],
            padding: vec![1, 1],
            dilation: vec![1, 1],
            ceil_mode: true,
            with_indices: true,
        });
        let r = crate::execute(
            &op,
            &[Some(&x)],
            &[
                (DType::F32, vec![1, 2, 3, 3]),
                (DType::I64, vec![1, 2, 3, 3]),
            ],
        )
        .unwrap();
        assert_eq!(
            r[0].to_f32_vec(),
            vec![
                2.25, 2.75, 2.75, 3.0, 2.5, 2.5, 2.75, 2.25, 2.25, 2.5, 3.0, 2.0, 2.5, 2.75, 3.0,
                2.25, 2.5, 3.0
            ]
        );
        assert_eq!(
            r[1].to_i64_vec(),
            vec![6, 3, 3, 10, 13, 13, 20, 23, 23, 5, 2, 8, 5, 12, 19, 15, 22, 19]
        );
        // unbatched 1-D with an int dtype
        let i = i64t(&[1, 5], &[3, -1, 7, 7, 2]);
        let op = Op::MaxPool(MaxPoolAttrs {
            kernel: vec![2],
            stride: vec![],
            padding: vec![0],
            dilation: vec![1],
            ceil_mode: false,
            with_indices: false,
        });
        assert_eq!(
            run1(op, &[&i], DType::I64, &[1, 2]).unwrap().to_i64_vec(),
            vec![3, 7]
        );
    }

    #[test]
    fn avg_pool_divisor_rules() {
        let x = f32t(&[1, 2, 5, 5], &ramp(50, 17, 5));
        let avg = |k: usize,
                   s: usize,
                   p: usize,
                   ceil: bool,
                   cip: bool,
                   div: Option<i64>,
                   shape: &[usize]| {
            let op = Op::AvgPool(AvgPoolAttrs {
                kernel: vec![k, k],
                stride: vec![s, s],
                padding: vec![p, p],
                ceil_mode: ceil,
                count_include_pad: cip,
                divisor_override: div,
            });
            run1(op, &[&x], DType::F32, shape).unwrap().to_f32_vec()
        };
        close(
            &avg(3, 2, 1, true, true, None, &[1, 2, 3, 3])[..9],
            &[
                0.27777779, 0.72222221, 0.52777779, 1.0, 0.77777779, 0.66666669, 0.58333331,
                0.47222221, 0.3611111,
            ],
            1e-6,
        );
        close(
            &avg(3, 2, 1, true, false, None, &[1, 2, 3, 3])[..9],
            &[
                0.625, 1.0833334, 1.1875, 1.5, 0.77777779, 1.0, 1.3125, 0.70833331, 0.8125,
            ],
            1e-6,
        );
        close(
            &avg(2, 2, 0, false, true, Some(3), &[1, 2, 2, 2]),
            &[
                0.83333331, 1.3333334, 1.9166666, 1.0, 1.4166666, 1.9166666, 1.0833334, 1.5833334,
            ],
            1e-6,
        );
    }

    #[test]
    fn adaptive_avg_pool_windows() {
        let x = f32t(&[1, 2, 5, 5], &ramp(50, 17, 5));
        let y = run1(
            Op::AdaptiveAvgPool {
                output_size: vec![3, 2],
            },
            &[&x],
            DType::F32,
            &[1, 2, 3, 2],
        )
        .unwrap();
        close(
            &y.to_f32_vec(),
            &[
                0.54166669, 0.91666669, 0.94444442, 0.6111111, 0.875, 0.54166669, 1.3333334, 1.0,
                1.0277778, 1.1666666, 0.95833331, 1.3333334,
            ],
            1e-6,
        );
        let e = run1(
            Op::AdaptiveAvgPool {
                output_size: vec![3, 2],
            },
            &[&f32t(&[5], &[0.0; 5])],
            DType::F32,
            &[3, 2],
        )
        .unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
    }
}
