//! Elementwise ops: unary functions, broadcast binary ops and `where`.
//! Arithmetic runs in the domain of the output dtype (so `sqrt` of ints and
//! true division of ints compute in float); predicates compare in the domain
//! of the promoted input dtype.

use std::ops::{Add, Div, Mul, Neg, Rem, Sub};

use etmetal_core::shape::{broadcast_shapes, broadcast_strides};
use etmetal_core::{BinaryOp, DType, Result, Tensor, UnaryOp};

use crate::buf::{domain, load, Buf, Domain};
use crate::ctx::Ctx;
use crate::strided::for_each_offset;

/// The float operations kernels need, for f32 and f64 alike.
pub trait Real:
    Copy
    + PartialOrd
    + Send
    + Sync
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Rem<Output = Self>
    + Neg<Output = Self>
{
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    fn trunc(self) -> Self;
    fn round_even(self) -> Self;
    fn abs(self) -> Self;
    fn sqrt(self) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn tanh(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn is_nan(self) -> bool;
    fn copysign(self, sign: Self) -> Self;
    fn erf(self) -> Self {
        Self::of(erf(self.f64()))
    }
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            fn of(v: f64) -> Self {
                v as $t
            }
            fn f64(self) -> f64 {
                self as f64
            }
            fn floor(self) -> Self {
                <$t>::floor(self)
            }
            fn ceil(self) -> Self {
                <$t>::ceil(self)
            }
            fn trunc(self) -> Self {
                <$t>::trunc(self)
            }
            fn round_even(self) -> Self {
                <$t>::round_ties_even(self)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn copysign(self, sign: Self) -> Self {
                <$t>::copysign(self, sign)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// The error function, to f64 precision: erf(x) = 2/√π · e^(-x²) ·
/// Σ 2ⁿ x^(2n+1) / (1·3·…·(2n+1)). Every term is positive, so the sum has no
/// cancellation; beyond |x| = 6 erf is 1 in f64.
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= 6.0 {
        return 1f64.copysign(x);
    }
    let x2 = a * a;
    let (mut term, mut sum, mut n) = (a, a, 0.0);
    while term > sum * 1e-17 {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
    }
    (std::f64::consts::FRAC_2_SQRT_PI * (-x2).exp() * sum).copysign(x)
}

fn max_nan<T: Real>(a: T, b: T) -> T {
    if a.is_nan() || a > b {
        a
    } else if b.is_nan() {
        b
    } else if a == b {
        // max(-0, +0) is +0 whichever comes first
        if a.copysign(T::of(1.0)) > T::of(0.0) {
            a
        } else {
            b
        }
    } else {
        b
    }
}

fn min_nan<T: Real>(a: T, b: T) -> T {
    -max_nan(-a, -b)
}

pub(crate) fn unary_real<T: Real>(op: UnaryOp, x: T) -> T {
    let zero = T::of(0.0);
    let one = T::of(1.0);
    let sigmoid = |v: T| one / (one + (-v).exp());
    match op {
        UnaryOp::Relu => {
            if x.is_nan() || x > zero {
                x
            } else {
                zero
            }
        }
        UnaryOp::Gelu { tanh: false } => {
            T::of(0.5) * x * (one + (x * T::of(std::f64::consts::FRAC_1_SQRT_2)).erf())
        }
        UnaryOp::Gelu { tanh: true } => {
            let k = T::of((2.0 / std::f64::consts::PI).sqrt());
            T::of(0.5) * x * (one + (k * (x + T::of(0.044715) * x * x * x)).tanh())
        }
        UnaryOp::Silu => x * sigmoid(x),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => one / x.sqrt(),
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Reciprocal => one / x,
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Erf => x.erf(),
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        UnaryOp::Round => x.round_even(),
        UnaryOp::Sign => {
            if x > zero {
                one
            } else if x < zero {
                -one
            } else {
                zero
            }
        }
        UnaryOp::Hardswish => x * clamp_real(x + T::of(3.0), Some(0.0), Some(6.0)) / T::of(6.0),
        UnaryOp::Hardsigmoid => clamp_real(x + T::of(3.0), Some(0.0), Some(6.0)) / T::of(6.0),
        UnaryOp::LeakyRelu { slope } => {
            if x > zero {
                x
            } else {
                x * T::of(slope)
            }
        }
        UnaryOp::Clamp { min, max } => clamp_real(x, min, max),
        UnaryOp::PowScalar { exponent } => x.powf(T::of(exponent)),
        // bool-only ops are routed to the bool domain before this
        UnaryOp::LogicalNot | UnaryOp::BitwiseNot => x,
    }
}

/// `min(max(x, lo), hi)` as PyTorch's clamp: NaN stays NaN.
fn clamp_real<T: Real>(x: T, lo: Option<f64>, hi: Option<f64>) -> T {
    if x.is_nan() {
        return x;
    }
    let mut y = x;
    if let Some(lo) = lo {
        y = max_nan(y, T::of(lo));
    }
    if let Some(hi) = hi {
        y = min_nan(y, T::of(hi));
    }
    y
}

fn unary_int(op: UnaryOp, x: i64) -> Option<i64> {
    Some(match op {
        UnaryOp::Relu => x.max(0),
        UnaryOp::Neg => x.wrapping_neg(),
        UnaryOp::Abs => x.wrapping_abs(),
        UnaryOp::Sign => x.signum(),
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => x,
        UnaryOp::BitwiseNot => !x,
        UnaryOp::Clamp { min, max } => {
            let mut y = x;
            if let Some(lo) = min {
                y = y.max(lo as i64);
            }
            if let Some(hi) = max {
                y = y.min(hi as i64);
            }
            y
        }
        UnaryOp::PowScalar { exponent } if exponent >= 0.0 && exponent.fract() == 0.0 => {
            x.wrapping_pow(exponent.min(u32::MAX as f64) as u32)
        }
        _ => return None,
    })
}

pub fn unary(ctx: &Ctx, op: UnaryOp) -> Result<Tensor> {
    let x = ctx.input(0)?;
    let out = ctx.out_dtype(0)?;
    let shape = x.shape();
    let buf = match op {
        UnaryOp::LogicalNot => match load(x, Domain::Bool) {
            Buf::Bool(v) => Buf::Bool(v.into_iter().map(|b| !b).collect()),
            _ => unreachable!("load in the bool domain gives bools"),
        },
        _ => match load(x, domain(out)) {
            Buf::F32(v) => Buf::F32(v.into_iter().map(|e| unary_real(op, e)).collect()),
            Buf::F64(v) => Buf::F64(v.into_iter().map(|e| unary_real(op, e)).collect()),
            Buf::I64(v) => Buf::I64(
                v.into_iter()
                    .map(|e| unary_int(op, e))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        ctx.unsupported(format!(
                            "not defined for {} input with {out} output",
                            x.dtype()
                        ))
                    })?,
            ),
            Buf::Bool(v) => match op {
                UnaryOp::BitwiseNot => Buf::Bool(v.into_iter().map(|b| !b).collect()),
                UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => {
                    Buf::Bool(v)
                }
                _ => return Err(ctx.unsupported("not defined for bool output")),
            },
        },
    };
    buf.store(out, shape)
}

/// Map `f` over two operands broadcast to `shape`.
fn zip_map<T: Copy, U>(
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    shape: &[usize],
    f: impl Fn(T, T) -> U,
) -> Vec<U> {
    let mut out = Vec::with_capacity(shape.iter().product());
    for_each_offset(shape, [sa, sb], [0, 0], |[i, j]| out.push(f(a[i], b[j])));
    out
}

fn compare<T: PartialOrd>(op: BinaryOp, a: T, b: T) -> bool {
    match op {
        BinaryOp::Eq => a == b,
        BinaryOp::Ne => a != b,
        BinaryOp::Lt => a < b,
        BinaryOp::Le => a <= b,
        BinaryOp::Gt => a > b,
        _ => a >= b,
    }
}

fn logical(op: BinaryOp, a: bool, b: bool) -> bool {
    match op {
        BinaryOp::LogicalAnd | BinaryOp::BitwiseAnd => a && b,
        BinaryOp::LogicalOr | BinaryOp::BitwiseOr => a || b,
        _ => a != b,
    }
}

/// PyTorch's `div_floor_floating`: floor division that agrees with Python's
/// `//` on floats (including the sign of zero).
fn floor_div_real<T: Real>(a: T, b: T) -> T {
    let zero = T::of(0.0);
    if b == zero {
        return a / b;
    }
    let m = a % b;
    let mut div = (a - m) / b;
    if m != zero && ((b < zero) != (m < zero)) {
        div = div - T::of(1.0);
    }
    if div != zero {
        let f = div.floor();
        if div - f > T::of(0.5) {
            f + T::of(1.0)
        } else {
            f
        }
    } else {
        zero.copysign(a / b)
    }
}

pub(crate) fn arith_real<T: Real>(op: BinaryOp, a: T, b: T) -> T {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::FloorDiv => floor_div_real(a, b),
        BinaryOp::TruncDiv => (a / b).trunc(),
        BinaryOp::Remainder => {
            let m = a % b;
            if m != T::of(0.0) && ((b < T::of(0.0)) != (m < T::of(0.0))) {
                m + b
            } else {
                m
            }
        }
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Maximum => max_nan(a, b),
        _ => min_nan(a, b),
    }
}

/// Integer arithmetic; divisors were checked non-zero by the caller.
fn arith_int(op: BinaryOp, a: i64, b: i64) -> i64 {
    match op {
        BinaryOp::Add => a.wrapping_add(b),
        BinaryOp::Sub => a.wrapping_sub(b),
        BinaryOp::Mul => a.wrapping_mul(b),
        BinaryOp::FloorDiv => {
            let q = a.wrapping_div(b);
            if (a % b != 0) && ((a < 0) != (b < 0)) {
                q - 1
            } else {
                q
            }
        }
        BinaryOp::TruncDiv => a.wrapping_div(b),
        BinaryOp::Remainder => {
            let m = a.wrapping_rem(b);
            if m != 0 && ((m < 0) != (b < 0)) {
                m + b
            } else {
                m
            }
        }
        BinaryOp::Pow => match b {
            b if b >= 0 => a.wrapping_pow(b.min(u32::MAX as i64) as u32),
            // integer results of negative powers: only ±1 survive
            _ if a == 1 => 1,
            _ if a == -1 => {
                if b % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            _ => 0,
        },
        BinaryOp::Maximum => a.max(b),
        BinaryOp::Minimum => a.min(b),
        BinaryOp::BitwiseAnd => a & b,
        BinaryOp::BitwiseOr => a | b,
        _ => a ^ b,
    }
}

pub fn binary(ctx: &Ctx, op: BinaryOp) -> Result<Tensor> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    let out = ctx.out_dtype(0)?;
    let shape = broadcast_shapes(a.shape(), b.shape()).map_err(|e| ctx.invalid(e.message()))?;
    let (sa, sb) = (
        broadcast_strides(a.shape(), &shape),
        broadcast_strides(b.shape(), &shape),
    );
    let logical_op = matches!(
        op,
        BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor
    );
    let dom = if logical_op {
        Domain::Bool
    } else if op.is_predicate() || !out.is_float() {
        domain(DType::promote(a.dtype(), b.dtype()))
    } else {
        domain(out)
    };
    let bitwise = op.is_bitwise();
    let buf = match (load(a, dom), load(b, dom)) {
        (Buf::Bool(x), Buf::Bool(y)) => {
            if op.is_predicate() && !logical_op {
                Buf::Bool(zip_map(&x, &sa, &y, &sb, &shape, |p, q| compare(op, p, q)))
            } else if logical_op || bitwise {
                Buf::Bool(zip_map(&x, &sa, &y, &sb, &shape, |p, q| logical(op, p, q)))
            } else {
                // arithmetic on bools (add = or, mul = and, …) as integers
                let to_i = |v: Vec<bool>| v.into_iter().map(i64::from).collect::<Vec<_>>();
                int_binary(ctx, op, &to_i(x), &sa, &to_i(y), &sb, &shape)?
            }
        }
        (Buf::I64(x), Buf::I64(y)) => {
            if op.is_predicate() {
                Buf::Bool(zip_map(&x, &sa, &y, &sb, &shape, |p, q| compare(op, p, q)))
            } else {
                int_binary(ctx, op, &x, &sa, &y, &sb, &shape)?
            }
        }
        (Buf::F32(x), Buf::F32(y)) => real_binary(ctx, op, &x, &sa, &y, &sb, &shape, Buf::F32)?,
        (Buf::F64(x), Buf::F64(y)) => real_binary(ctx, op, &x, &sa, &y, &sb, &shape, Buf::F64)?,
        _ => unreachable!("both operands are loaded in one domain"),
    };
    buf.store(out, &shape)
}

#[allow(clippy::too_many_arguments)]
fn real_binary<T: Real>(
    ctx: &Ctx,
    op: BinaryOp,
    x: &[T],
    sa: &[usize],
    y: &[T],
    sb: &[usize],
    shape: &[usize],
    wrap: fn(Vec<T>) -> Buf,
) -> Result<Buf> {
    if op.is_predicate() {
        return Ok(Buf::Bool(zip_map(x, sa, y, sb, shape, |p, q| {
            compare(op, p, q)
        })));
    }
    if op.is_bitwise() {
        return Err(ctx.unsupported("bitwise ops are not defined for floating-point tensors"));
    }
    Ok(wrap(zip_map(x, sa, y, sb, shape, |p, q| {
        arith_real(op, p, q)
    })))
}

fn int_binary(
    ctx: &Ctx,
    op: BinaryOp,
    x: &[i64],
    sa: &[usize],
    y: &[i64],
    sb: &[usize],
    shape: &[usize],
) -> Result<Buf> {
    match op {
        BinaryOp::Div => {
            return Err(ctx.unsupported("true division needs a floating-point output dtype"))
        }
        BinaryOp::FloorDiv | BinaryOp::TruncDiv | BinaryOp::Remainder if y.contains(&0) => {
            return Err(ctx.invalid("integer division by zero"))
        }
        _ => {}
    }
    Ok(Buf::I64(zip_map(x, sa, y, sb, shape, |p, q| {
        arith_int(op, p, q)
    })))
}

/// `where(cond, a, b)`, all three broadcast together.
pub fn where_(ctx: &Ctx) -> Result<Tensor> {
    let (c, a, b) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    let out = ctx.out_dtype(0)?;
    let shape = broadcast_shapes(c.shape(), a.shape())
        .and_then(|s| broadcast_shapes(&s, b.shape()))
        .map_err(|e| ctx.invalid(e.message()))?;
    let strides = [c, a, b].map(|t| broadcast_strides(t.shape(), &shape));
    let Buf::Bool(cond) = load(c, Domain::Bool) else {
        unreachable!("bool domain")
    };
    fn pick<T: Copy>(
        cond: &[bool],
        x: &[T],
        y: &[T],
        s: &[Vec<usize>; 3],
        shape: &[usize],
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(shape.iter().product());
        for_each_offset(shape, [&s[0], &s[1], &s[2]], [0; 3], |[i, j, k]| {
            out.push(if cond[i] { x[j] } else { y[k] })
        });
        out
    }
    let buf = match (load(a, domain(out)), load(b, domain(out))) {
        (Buf::F32(x), Buf::F32(y)) => Buf::F32(pick(&cond, &x, &y, &strides, &shape)),
        (Buf::F64(x), Buf::F64(y)) => Buf::F64(pick(&cond, &x, &y, &strides, &shape)),
        (Buf::I64(x), Buf::I64(y)) => Buf::I64(pick(&cond, &x, &y, &strides, &shape)),
        (Buf::Bool(x), Buf::Bool(y)) => Buf::Bool(pick(&cond, &x, &y, &strides, &shape)),
        _ => unreachable!("both operands are loaded in one domain"),
    };
    buf.store(out, &shape)
}

// PyTorch's printed values are kept verbatim in the tests
#[cfg(test)]
#[allow(clippy::excessive_precision)]
mod tests {
    use crate::test_util::*;
    use etmetal_core::{BinaryOp, DType, ErrorKind, Op, UnaryOp};

    fn un(op: UnaryOp, x: &etmetal_core::Tensor, out: DType) -> Vec<f32> {
        run1(Op::Unary(op), &[x], out, x.shape())
            .unwrap()
            .to_f32_vec()
    }

    #[test]
    fn unary_activations_match_pytorch() {
        let x = f32t(&[6], &ramp(6, 11, 7));
        // expected values from PyTorch 2.15
        close(
            &un(UnaryOp::Gelu { tanh: false }, &x, DType::F32),
            &[
                -0.15865529,
                0.58002955,
                -0.10032343,
                1.3997891,
                0.3457312,
                -0.15426879,
            ],
            1e-6,
        );
        close(
            &un(UnaryOp::Gelu { tanh: true }, &x, DType::F32),
            &[
                -0.15880799,
                0.57996058,
                -0.10032465,
                1.3995715,
                0.345714,
                -0.154286,
            ],
            1e-6,
        );
        close(
            &un(UnaryOp::Erf, &x, DType::F32),
            &[
                -0.84270078,
                0.71115565,
                -0.27632639,
                0.96610516,
                0.52049989,
                -0.52049989,
            ],
            1e-7,
        );
        close(
            &un(UnaryOp::Hardswish, &x, DType::F32),
            &[
                -0.33333334,
                0.46875,
                -0.11458334,
                1.125,
                0.29166666,
                -0.20833333,
            ],
            1e-7,
        );
        close(
            &un(UnaryOp::Silu, &x, DType::F32),
            &[
                -0.26894143,
                0.50938404,
                -0.10945588,
                1.2263616,
                0.31122968,
                -0.18877034,
            ],
            1e-6,
        );
    }

    #[test]
    fn erf_is_accurate_in_f64() {
        // erf(0.5), erf(2), erf(-3.5) to 16 digits
        assert!((super::erf(0.5) - 0.5204998778130465).abs() < 1e-15);
        assert!((super::erf(2.0) - 0.9953222650189527).abs() < 1e-15);
        assert!((super::erf(-3.5) + 0.9999992569016276).abs() < 1e-15);
        assert_eq!(super::erf(7.0), 1.0);
    }

    #[test]
    fn rounding_sign_clamp_and_int_paths() {
        let x = f32t(&[5], &[2.5, -0.5, 1.5, f32::NAN, -3.0]);
        let r = un(UnaryOp::Round, &x, DType::F32);
        assert_eq!(&r[..3], &[2.0, -0.0, 2.0]);
        assert_eq!(un(UnaryOp::Sign, &x, DType::F32)[3], 0.0);
        let c = un(
            UnaryOp::Clamp {
                min: Some(-1.0),
                max: None,
            },
            &x,
            DType::F32,
        );
        assert!(c[3].is_nan());
        assert_eq!([c[0], c[4]], [2.5, -1.0]);
        let i = i64t(&[3], &[-4, 9, 0]);
        let s = un(UnaryOp::Sqrt, &i, DType::F32);
        assert!(s[0].is_nan() && s[1] == 3.0 && s[2] == 0.0);
        let a = run1(Op::Unary(UnaryOp::Abs), &[&i], DType::I64, &[3]).unwrap();
        assert_eq!(a.to_i64_vec(), vec![4, 9, 0]);
        let e = run1(Op::Unary(UnaryOp::Exp), &[&i], DType::I64, &[3]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
    }

    fn bin(
        op: BinaryOp,
        a: &etmetal_core::Tensor,
        b: &etmetal_core::Tensor,
        out: DType,
        shape: &[usize],
    ) -> etmetal_core::Tensor {
        run1(Op::Binary(op), &[a, b], out, shape).unwrap()
    }

    #[test]
    fn broadcasting_and_bf16_rounding() {
        let a = f32t(&[2, 1], &[1.0, 2.0]);
        let b = f32t(&[3], &[10.0, 20.0, 30.0]);
        assert_eq!(
            bin(BinaryOp::Sub, &a, &b, DType::F32, &[2, 3]).to_f32_vec(),
            vec![-9.0, -19.0, -29.0, -8.0, -18.0, -28.0]
        );
        // bf16 sums rounded to nearest even; from PyTorch 2.15: [1.0, 3.015625, 101.0]
        let x = etmetal_core::Tensor::from_f32(DType::BF16, &[3], &[1.0, 3.0, 100.5]).unwrap();
        let y = etmetal_core::Tensor::from_f32(DType::BF16, &[3], &[0.00390625, 0.01171875, 0.25])
            .unwrap();
        assert_eq!(
            bin(BinaryOp::Add, &x, &y, DType::BF16, &[3]).to_f32_vec(),
            vec![1.0, 3.015625, 101.0]
        );
        let e = run1(
            Op::Binary(BinaryOp::Add),
            &[&b, &f32t(&[4], &[0.0; 4])],
            DType::F32,
            &[3, 4],
        )
        .unwrap_err();
        assert!(e.to_string().contains("broadcast"), "{e}");
    }

    #[test]
    fn division_family_follows_python() {
        let a = i64t(&[4], &[-7, 7, -6, 5]);
        let b = i64t(&[4], &[2, -2, 3, 3]);
        assert_eq!(
            bin(BinaryOp::FloorDiv, &a, &b, DType::I64, &[4]).to_i64_vec(),
            vec![-4, -4, -2, 1]
        );
        assert_eq!(
            bin(BinaryOp::TruncDiv, &a, &b, DType::I64, &[4]).to_i64_vec(),
            vec![-3, -3, -2, 1]
        );
        assert_eq!(
            bin(BinaryOp::Remainder, &a, &b, DType::I64, &[4]).to_i64_vec(),
            vec![1, -1, 0, 2]
        );
        assert_eq!(
            bin(BinaryOp::Div, &a, &b, DType::F32, &[4]).to_f32_vec(),
            vec![-3.5, -3.5, -2.0, 5.0 / 3.0]
        );
        // PyTorch 2.15: div(rounding_mode='floor') of [-7.5, 7.5, -0.0, 5] by [2, -2, 3, 0]
        let fa = f32t(&[4], &[-7.5, 7.5, -0.0, 5.0]);
        let fb = f32t(&[4], &[2.0, -2.0, 3.0, 0.0]);
        let f = bin(BinaryOp::FloorDiv, &fa, &fb, DType::F32, &[4]).to_f32_vec();
        assert_eq!(f, vec![-4.0, -4.0, -0.0, f32::INFINITY]);
        assert!(f[2].is_sign_negative());
        assert_eq!(
            bin(BinaryOp::Remainder, &fa, &fb, DType::F32, &[4]).to_f32_vec()[..2],
            [0.5, -0.5]
        );
        // integer pow with negative exponents: PyTorch gives [0, -1, 1, 9]
        let p = bin(
            BinaryOp::Pow,
            &i64t(&[4], &[2, -1, 1, 3]),
            &i64t(&[4], &[-1, -3, -2, 2]),
            DType::I64,
            &[4],
        );
        assert_eq!(p.to_i64_vec(), vec![0, -1, 1, 9]);
        let e = run1(
            Op::Binary(BinaryOp::FloorDiv),
            &[&a, &i64t(&[], &[0])],
            DType::I64,
            &[4],
        )
        .unwrap_err();
        assert!(e.to_string().contains("division by zero"), "{e}");
    }

    #[test]
    fn predicates_logical_and_where() {
        let a = i64t(&[3], &[1, 2, 3]);
        let b = f32t(&[], &[2.0]);
        let lt = bin(BinaryOp::Lt, &a, &b, DType::Bool, &[3]);
        assert_eq!((lt.dtype(), lt.to_i64_vec()), (DType::Bool, vec![1, 0, 0]));
        let x = bin(
            BinaryOp::LogicalXor,
            &a,
            &i64t(&[3], &[0, 5, 0]),
            DType::Bool,
            &[3],
        );
        assert_eq!(x.to_i64_vec(), vec![1, 0, 1]);
        assert_eq!(
            bin(BinaryOp::BitwiseAnd, &a, &i64t(&[], &[6]), DType::I64, &[3]).to_i64_vec(),
            vec![0, 2, 2]
        );
        let m = bin(
            BinaryOp::Maximum,
            &f32t(&[2], &[f32::NAN, 1.0]),
            &f32t(&[2], &[0.0, 2.0]),
            DType::F32,
            &[2],
        )
        .to_f32_vec();
        assert!(m[0].is_nan() && m[1] == 2.0);
        let c = etmetal_core::Tensor::from_i64(DType::Bool, &[2, 1], &[1, 0]).unwrap();
        let w = run1(
            Op::Where,
            &[&c, &f32t(&[2], &[1.0, 2.0]), &f32t(&[], &[-1.0])],
            DType::F32,
            &[2, 2],
        )
        .unwrap();
        assert_eq!(w.to_f32_vec(), vec![1.0, 2.0, -1.0, -1.0]);
    }
}
