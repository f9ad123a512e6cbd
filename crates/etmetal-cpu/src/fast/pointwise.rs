//! Elementwise f32 ops written into the output: unary functions, binary
//! arithmetic with broadcasting, and `where`. Operands broadcast to the
//! output are walked as runs along the merged trailing dims, so the inner
//! loops are contiguous (or read one broadcast element) and vectorise.

use etmetal_core::shape::{broadcast_shapes, broadcast_strides};
use etmetal_core::{BinaryOp, DType, UnaryOp};
use rayon::prelude::*;

use super::{math, BLOCK, PAR_MIN};
use crate::elementwise::{arith_real, unary_real};
use crate::simd;
use crate::view::{View, ViewMut};

/// How `N` operands broadcast to an output walk it: runs of `len` output
/// elements (the merged trailing dims); for each run, operand `k` starts at
/// the offset its `strides` give the run's index in `outer` and advances
/// by `steps[k]` (1, or 0 where it is broadcast).
struct Runs<const N: usize> {
    outer: Vec<usize>,
    strides: [Vec<usize>; N],
    len: usize,
    steps: [usize; N],
}

impl<const N: usize> Runs<N> {
    /// `None` unless the operand shapes broadcast exactly to `out`.
    fn new(out: &[usize], ins: [&[usize]; N]) -> Option<Runs<N>> {
        let mut shape = ins[0].to_vec();
        for s in &ins[1..] {
            shape = broadcast_shapes(&shape, s).ok()?;
        }
        if shape != out {
            return None;
        }
        let all = ins.map(|s| broadcast_strides(s, out));
        // merge dim d into the one after it where every operand allows
        let (mut dims, mut strides): (Vec<usize>, [Vec<usize>; N]) =
            (vec![], std::array::from_fn(|_| vec![]));
        for (d, &size) in out.iter().enumerate() {
            if size == 1 {
                continue;
            }
            let merge = dims
                .last()
                .is_some_and(|_| (0..N).all(|k| strides[k].last() == Some(&(all[k][d] * size))));
            if merge {
                *dims.last_mut().expect("checked above") *= size;
                (0..N).for_each(|k| *strides[k].last_mut().expect("one per dim") = all[k][d]);
            } else {
                dims.push(size);
                (0..N).for_each(|k| strides[k].push(all[k][d]));
            }
        }
        let len = dims.pop().unwrap_or(1);
        let steps = std::array::from_fn(|k| strides[k].pop().unwrap_or(0));
        // a contiguous broadcast leaves unit or zero steps; anything else is not ours
        if steps.iter().any(|&s| s > 1) {
            return None;
        }
        Some(Runs {
            outer: dims,
            strides,
            len,
            steps,
        })
    }

    /// Operand offsets at the start of run `r`.
    fn offsets(&self, mut r: usize) -> [usize; N] {
        let mut offs = [0; N];
        for d in (0..self.outer.len()).rev() {
            let i = r % self.outer[d];
            r /= self.outer[d];
            (0..N).for_each(|k| offs[k] += i * self.strides[k][d]);
        }
        offs
    }

    /// Call `f(chunk, offsets)` for consecutive chunks of `out` (within one
    /// run each), in parallel for large outputs.
    fn for_each(&self, out: &mut [f32], f: impl Fn(&mut [f32], [usize; N]) + Sync) {
        let len = self.len.max(1);
        let at = |r: usize, start: usize| {
            let mut offs = self.offsets(r);
            (0..N).for_each(|k| offs[k] += start * self.steps[k]);
            offs
        };
        if out.len() < PAR_MIN {
            out.chunks_mut(len)
                .enumerate()
                .for_each(|(r, run)| f(run, at(r, 0)));
        } else if len > BLOCK {
            out.par_chunks_mut(len).enumerate().for_each(|(r, run)| {
                run.par_chunks_mut(BLOCK)
                    .enumerate()
                    .for_each(|(b, chunk)| f(chunk, at(r, b * BLOCK)))
            });
        } else {
            out.par_chunks_mut(len)
                .enumerate()
                .with_min_len(BLOCK / len)
                .for_each(|(r, run)| f(run, at(r, 0)));
        }
    }
}

/// `dst[i] = f(a[i·sa], b[i·sb])` for unit or zero steps, each case a loop
/// of its own so that it vectorises.
#[inline(always)]
fn zip(dst: &mut [f32], a: &[f32], b: &[f32], steps: [usize; 2], f: impl Fn(f32, f32) -> f32) {
    let n = dst.len();
    match steps {
        [1, 1] => {
            for ((o, &x), &y) in dst.iter_mut().zip(&a[..n]).zip(&b[..n]) {
                *o = f(x, y);
            }
        }
        [1, _] => {
            let y = b[0];
            for (o, &x) in dst.iter_mut().zip(&a[..n]) {
                *o = f(x, y);
            }
        }
        [_, 1] => {
            let x = a[0];
            for (o, &y) in dst.iter_mut().zip(&b[..n]) {
                *o = f(x, y);
            }
        }
        _ => dst.fill(f(a[0], b[0])),
    }
}

/// `dst[i] = f(x[i])`.
#[inline(always)]
fn map(dst: &mut [f32], x: &[f32], f: impl Fn(f32) -> f32) {
    for (o, &v) in dst.iter_mut().zip(x) {
        *o = f(v);
    }
}

pub fn binary(op: BinaryOp, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let (Some(Some(a)), Some(Some(b))) = (inputs.first(), inputs.get(1)) else {
        return false;
    };
    let Some(runs) = Runs::new(out.shape, [a.shape, b.shape]) else {
        return false;
    };
    let (Some(x), Some(y), Some(dst)) = (a.f32s(), b.f32s(), out.f32s()) else {
        return false;
    };
    // closures marked inline so that they compile into the wide function
    macro_rules! go {
        (|$p:ident, $q:ident| $body:expr) => {
            runs.for_each(dst, |d, [i, j]| {
                simd::dispatch(
                    #[inline(always)]
                    || {
                        zip(
                            d,
                            &x[i..],
                            &y[j..],
                            runs.steps,
                            #[inline(always)]
                            |$p: f32, $q: f32| $body,
                        )
                    },
                )
            })
        };
    }
    match op {
        BinaryOp::Add => go!(|p, q| p + q),
        BinaryOp::Sub => go!(|p, q| p - q),
        BinaryOp::Mul => go!(|p, q| p * q),
        BinaryOp::Div => go!(|p, q| p / q),
        BinaryOp::Maximum => go!(|p, q| arith_real(BinaryOp::Maximum, p, q)),
        BinaryOp::Minimum => go!(|p, q| arith_real(BinaryOp::Minimum, p, q)),
        _ => return false,
    }
    true
}

pub fn unary(op: UnaryOp, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let Some(Some(a)) = inputs.first() else {
        return false;
    };
    if a.shape != out.shape {
        return false;
    }
    let (Some(x), Some(dst)) = (a.f32s(), out.f32s()) else {
        return false;
    };
    let runs = Runs::<1> {
        outer: vec![],
        strides: [vec![]],
        len: dst.len(),
        steps: [1],
    };
    // closures marked inline so that they compile into the wide function
    macro_rules! go {
        (|$v:ident: f32| $body:expr) => {
            runs.for_each(dst, |d, [i]| {
                simd::dispatch(
                    #[inline(always)]
                    || {
                        map(
                            d,
                            &x[i..],
                            #[inline(always)]
                            |$v: f32| $body,
                        )
                    },
                )
            })
        };
    }
    match op {
        UnaryOp::Relu => go!(|v: f32| if v <= 0.0 { 0.0 } else { v }),
        // a NaN bound makes every element NaN, as `unary_real` below does
        UnaryOp::Clamp { min, max }
            if !min.is_some_and(f64::is_nan) && !max.is_some_and(f64::is_nan) =>
        {
            let lo = min.map_or(f32::NEG_INFINITY, |v| v as f32);
            let hi = max.map_or(f32::INFINITY, |v| v as f32);
            go!(|v: f32| {
                let v = if v < lo { lo } else { v };
                if v > hi {
                    hi
                } else {
                    v
                }
            })
        }
        UnaryOp::Gelu { tanh: false } => {
            go!(|v: f32| 0.5 * v * (1.0 + math::erf(v * std::f32::consts::FRAC_1_SQRT_2)))
        }
        UnaryOp::Gelu { tanh: true } => go!(|v: f32| {
            let k = (2.0 / std::f32::consts::PI).sqrt();
            let z = k * (v + 0.044715 * v * v * v);
            // 1 + tanh(z) = 2 − 2 / (e^2z + 1)
            0.5 * v * (2.0 - 2.0 / (math::exp(2.0 * z) + 1.0))
        }),
        UnaryOp::Sigmoid => go!(|v: f32| math::sigmoid(v)),
        UnaryOp::Silu => go!(|v: f32| v * math::sigmoid(v)),
        UnaryOp::Exp => go!(|v: f32| math::exp(v)),
        UnaryOp::Rsqrt => go!(|v: f32| 1.0 / v.sqrt()),
        UnaryOp::Neg => go!(|v: f32| -v),
        UnaryOp::PowScalar { exponent: 2.0 } => go!(|v: f32| v * v),
        UnaryOp::LogicalNot | UnaryOp::BitwiseNot => return false,
        _ => go!(|v: f32| unary_real(op, v)),
    }
    true
}

/// `where(cond, a, b)` on f32 with a bool condition.
pub fn where_(inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(c), Some(a), Some(b)] = inputs else {
        return false;
    };
    if c.dtype != DType::Bool {
        return false;
    }
    let Some(runs) = Runs::new(out.shape, [c.shape, a.shape, b.shape]) else {
        return false;
    };
    let (Some(x), Some(y), Some(dst)) = (a.f32s(), b.f32s(), out.f32s()) else {
        return false;
    };
    let cond = c.bytes;
    runs.for_each(dst, |d, [i, j, k]| {
        let (c, a, b) = (&cond[i..], &x[j..], &y[k..]);
        // each combination of unit and zero steps a loop of its own
        macro_rules! steps {
            ($(($sc:literal, $sa:literal, $sb:literal)),*) => {
                match runs.steps {
                    $([$sc, $sa, $sb] => simd::dispatch(
                        #[inline(always)]
                        || pick::<$sc, $sa, $sb>(d, c, a, b),
                    ),)*
                    _ => unreachable!("Runs has unit or zero steps"),
                }
            };
        }
        steps!(
            (1, 1, 1),
            (1, 1, 0),
            (1, 0, 1),
            (1, 0, 0),
            (0, 1, 1),
            (0, 1, 0),
            (0, 0, 1),
            (0, 0, 0)
        )
    });
    true
}

/// `dst[t] = if c[t·SC] { a[t·SA] } else { b[t·SB] }`.
#[inline(always)]
fn pick<const SC: usize, const SA: usize, const SB: usize>(
    dst: &mut [f32],
    c: &[u8],
    a: &[f32],
    b: &[f32],
) {
    for (t, o) in dst.iter_mut().enumerate() {
        *o = if c[t * SC] != 0 { a[t * SA] } else { b[t * SB] };
    }
}
