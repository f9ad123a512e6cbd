//! WGSL for the elementwise functions: one expression per op, in the
//! compute types of [`compute_type`] (f32 for floats, i32 for integers,
//! bool), following PyTorch's definitions (Python-style remainder and floor
//! division, round half to even, `pow` of negative bases). int64 values
//! are computed as i32: the `*_checked` forms of its arithmetic (and of
//! every integer division) flag a result beyond i32, or a zero divisor, in
//! the kernel's status buffer (see `payload::Check`).

use etmetal_core::{BinaryOp, DType, Error, Result, Scalar, UnaryOp};

use crate::payload::Fault;

/// The WGSL type a value of `dtype` is computed in.
pub(crate) fn compute_type(dtype: DType) -> &'static str {
    if dtype == DType::Bool {
        "bool"
    } else if dtype.is_float() {
        "f32"
    } else {
        "i32"
    }
}

/// Helper functions the expressions call; a kernel includes those whose
/// name it calls.
pub(crate) const HELPERS: &[(&str, &str)] = &[
    (
        "is_nan",
        // On the bits: drivers that fold `x != x` to false (lavapipe) lose NaN.
        "fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }\n",
    ),
    (
        "max_nan",
        // max/min with NaN winning, as PyTorch's amax/amin and max pooling.
        "fn max_nan(a: f32, b: f32) -> f32 { return select(max(a, b), a + b, is_nan(a) || is_nan(b)); }\n",
    ),
    (
        "min_nan",
        "fn min_nan(a: f32, b: f32) -> f32 { return select(min(a, b), a + b, is_nan(a) || is_nan(b)); }\n",
    ),
    (
        "erf_",
        // Abramowitz & Stegun 7.1.26 refined (max error 1.2e-7).
        "fn erf_(x: f32) -> f32 {\n\
         \x20 let t = 1.0 / (1.0 + 0.5 * abs(x));\n\
         \x20 let y = 1.0 - t * exp(-x * x - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))));\n\
         \x20 return select(-y, y, x >= 0.0);\n}\n",
    ),
    (
        "tanh_",
        // WGSL's tanh may overflow to NaN for large |x| on some drivers.
        "fn tanh_(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }\n",
    ),
    (
        "rbf16",
        // Round to the nearest bfloat16 (ties to even), keeping inf/NaN.
        "fn rbf16(x: f32) -> f32 {\n\
         \x20 let u = bitcast<u32>(x);\n\
         \x20 if ((u & 0x7f800000u) == 0x7f800000u) { return x; }\n\
         \x20 return bitcast<f32>((u + 0x7fffu + ((u >> 16u) & 1u)) & 0xffff0000u);\n}\n",
    ),
    (
        "rf16",
        // Round to the nearest float16 (ties to even) without f16 shader
        // support: mantissa to 10 bits, subnormals to 2^-24, overflow to inf.
        "fn rf16(x: f32) -> f32 {\n\
         \x20 let u = bitcast<u32>(x);\n\
         \x20 if ((u & 0x7f800000u) == 0x7f800000u) { return x; }\n\
         \x20 if (abs(x) < 6.103515625e-05) { return round(x * 16777216.0) / 16777216.0; }\n\
         \x20 let r = bitcast<f32>((u + 0xfffu + ((u >> 13u) & 1u)) & 0xffffe000u);\n\
         \x20 if (abs(r) > 65504.0) { return bitcast<f32>((u & 0x80000000u) | 0x7f800000u); }\n\
         \x20 return r;\n}\n",
    ),
    (
        "f16dec",
        // float16 bits (low 16 of `h`) to f32.
        "fn f16dec(h: u32) -> f32 {\n\
         \x20 let s = (h & 0x8000u) << 16u;\n\
         \x20 let e = (h >> 10u) & 0x1fu;\n\
         \x20 let m = h & 0x3ffu;\n\
         \x20 if (e == 0u) { return select(1.0, -1.0, s != 0u) * f32(m) * 5.9604644775390625e-08; }\n\
         \x20 if (e == 31u) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }\n\
         \x20 return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));\n}\n",
    ),
    (
        "f16enc",
        // f32 to float16 bits, rounded to nearest even.
        "fn f16enc(x: f32) -> u32 {\n\
         \x20 let v = rf16(x);\n\
         \x20 let u = bitcast<u32>(v);\n\
         \x20 let s = (u >> 16u) & 0x8000u;\n\
         \x20 if (v != v) { return s | 0x7e00u; }\n\
         \x20 if (abs(v) > 65504.0) { return s | 0x7c00u; }\n\
         \x20 if (abs(v) < 6.103515625e-05) { return s | u32(abs(v) * 16777216.0); }\n\
         \x20 return s | ((((u >> 23u) & 0xffu) - 112u) << 10u) | ((u >> 13u) & 0x3ffu);\n}\n",
    ),
    (
        "powf_",
        // pow of a negative base: defined for integral exponents only.
        "fn powf_(a: f32, b: f32) -> f32 {\n\
         \x20 if (b == 0.0) { return 1.0; }\n\
         \x20 let p = pow(abs(a), b);\n\
         \x20 if (a >= 0.0) { return p; }\n\
         \x20 if (floor(b) != b) { return bitcast<f32>(0x7fc00000u); }\n\
         \x20 return select(p, -p, (abs(b) % 2.0) == 1.0);\n}\n",
    ),
    (
        "floordiv_i",
        "fn floordiv_i(a: i32, b: i32) -> i32 {\n\
         \x20 let q = a / b;\n\
         \x20 return select(q, q - 1, (a % b != 0) && ((a < 0) != (b < 0)));\n}\n",
    ),
    (
        "rem_i",
        "fn rem_i(a: i32, b: i32) -> i32 {\n\
         \x20 let r = a % b;\n\
         \x20 return select(r, r + b, (r != 0) && ((r < 0) != (b < 0)));\n}\n",
    ),
    (
        "flag_",
        // Report a failed check: bit `bit` of the kernel's status buffer.
        "fn flag_(bit: u32) { atomicOr(&st[bit >> 5u], 1u << (bit & 31u)); }\n",
    ),
    // Checked i32 arithmetic for int64 values: wrapping through u32 (no
    // signed-overflow UB in any backend), flagging a result beyond i32.
    (
        "add_ck",
        "fn add_ck(a: i32, b: i32, bit: u32) -> i32 {\n\
         \x20 let r = bitcast<i32>(bitcast<u32>(a) + bitcast<u32>(b));\n\
         \x20 if (((a ^ r) & (b ^ r)) < 0i) { flag_(bit); }\n\
         \x20 return r;\n}\n",
    ),
    (
        "sub_ck",
        "fn sub_ck(a: i32, b: i32, bit: u32) -> i32 {\n\
         \x20 let r = bitcast<i32>(bitcast<u32>(a) - bitcast<u32>(b));\n\
         \x20 if (((a ^ b) & (a ^ r)) < 0i) { flag_(bit); }\n\
         \x20 return r;\n}\n",
    ),
    (
        "mul_ck",
        // Without overflow r / a == b; with it r differs from a * b by a
        // nonzero multiple of 2^32 > |a|, so the quotient differs, except
        // -1 * MIN, whose quotient wraps back to MIN.
        "fn mul_ck(a: i32, b: i32, bit: u32) -> i32 {\n\
         \x20 let r = bitcast<i32>(bitcast<u32>(a) * bitcast<u32>(b));\n\
         \x20 if (a != 0i && (r / a != b || (a == -1i && b == (-2147483647i - 1i)))) { flag_(bit); }\n\
         \x20 return r;\n}\n",
    ),
    (
        "neg_ck",
        "fn neg_ck(a: i32, bit: u32) -> i32 {\n\
         \x20 if (a == (-2147483647i - 1i)) { flag_(bit); }\n\
         \x20 return bitcast<i32>(0u - bitcast<u32>(a));\n}\n",
    ),
    (
        "abs_ck",
        "fn abs_ck(a: i32, bit: u32) -> i32 {\n\
         \x20 if (a == (-2147483647i - 1i)) { flag_(bit); }\n\
         \x20 return select(a, bitcast<i32>(0u - bitcast<u32>(a)), a < 0i);\n}\n",
    ),
    (
        "quot_ck",
        // The dividend, after checking that the quotient MIN / -1 = 2^31
        // is not asked for.
        "fn quot_ck(a: i32, b: i32, bit: u32) -> i32 {\n\
         \x20 if (a == (-2147483647i - 1i) && b == -1i) { flag_(bit); }\n\
         \x20 return a;\n}\n",
    ),
    (
        "nz_ck",
        // The divisor, after checking it is not zero.
        "fn nz_ck(b: i32, bit: u32) -> i32 {\n\
         \x20 if (b == 0i) { flag_(bit); }\n\
         \x20 return b;\n}\n",
    ),
    (
        "f2i_ck",
        // float to int64 truncates toward zero; NaN and values beyond
        // i32 are flagged.
        "fn f2i_ck(x: f32, bit: u32) -> i32 {\n\
         \x20 if (!(x >= -2147483648.0 && x < 2147483648.0)) { flag_(bit); }\n\
         \x20 return i32(x);\n}\n",
    ),
    (
        "pow_i",
        "fn pow_i(a: i32, b: i32) -> i32 {\n\
         \x20 var r = 1; var base = a; var e = b;\n\
         \x20 if (e < 0) { return select(0, select(-1, 1, (e & 1) == 0), a == -1) + select(0, 1, a == 1); }\n\
         \x20 loop { if (e == 0) { break; } if ((e & 1) == 1) { r = r * base; } base = base * base; e = e >> 1u; }\n\
         \x20 return r;\n}\n",
    ),
];

/// A WGSL literal of `value` in the compute type of `dtype`.
pub(crate) fn literal(value: Scalar, dtype: DType) -> Result<String> {
    Ok(match compute_type(dtype) {
        "bool" => (value.to_f64() != 0.0).to_string(),
        "f32" => float_literal(value.to_f64()),
        _ => {
            let v = match value {
                Scalar::Float(f) => f.trunc() as i64,
                other => other.to_i64(),
            };
            int_literal(v)?
        }
    })
}

pub(crate) fn float_literal(v: f64) -> String {
    let f = v as f32;
    if f.is_nan() {
        "bitcast<f32>(0x7fc00000u)".into()
    } else if f.is_infinite() {
        format!(
            "bitcast<f32>({:#010x}u)",
            if f > 0.0 { 0x7f80_0000u32 } else { 0xff80_0000 }
        )
    } else {
        format!("f32({f:?})")
    }
}

pub(crate) fn int_literal(v: i64) -> Result<String> {
    let v = i32::try_from(v).map_err(|_| {
        Error::unsupported(format!(
            "integer constant {v} does not fit the GPU's 32-bit integers"
        ))
    })?;
    Ok(if v == i32::MIN {
        "(-2147483647i - 1i)".into()
    } else {
        format!("{v}i")
    })
}

/// `to` from a value `x` computed as `from`.
pub(crate) fn cast(x: &str, from: DType, to: DType) -> String {
    let v = match (compute_type(from), compute_type(to)) {
        (a, b) if a == b => x.to_string(),
        ("bool", "f32") => format!("select(0.0, 1.0, {x})"),
        ("bool", _) => format!("select(0i, 1i, {x})"),
        ("f32", "bool") => format!("({x} != 0.0)"),
        (_, "bool") => format!("({x} != 0i)"),
        (_, t) => format!("{t}({x})"),
    };
    // narrow integer dtypes wrap like PyTorch's casts
    match to {
        DType::U8 => format!("(({v}) & 255i)"),
        DType::I8 => format!("(((({v}) & 255i) ^ 128i) - 128i)"),
        _ => round_to(v, to),
    }
}

/// [`cast`] of a value `x` that already holds a `from` (an emitted
/// expression's value, rounded where it was made): none where the dtypes
/// agree, so no rounding is repeated (a bf16 kernel's elementwise chain ran
/// up to three `rbf16` an op).
pub(crate) fn convert(x: &str, from: DType, to: DType) -> String {
    match from == to {
        true => x.to_string(),
        false => cast(x, from, to),
    }
}

/// `x` rounded to the precision of `dtype` (16-bit floats are computed in
/// f32 and rounded where PyTorch would store them).
pub(crate) fn round_to(x: String, dtype: DType) -> String {
    match dtype {
        DType::BF16 => format!("rbf16({x})"),
        DType::F16 => format!("rf16({x})"),
        _ => x,
    }
}

/// `op(x)` computed in the type of `dtype` (it may call [`HELPERS`]).
pub(crate) fn unary(op: UnaryOp, x: &str, dtype: DType) -> Result<String> {
    let float = dtype.is_float();
    let int = compute_type(dtype) == "i32";
    let unsupported = || {
        Err(Error::unsupported(format!(
            "{op:?} of {} on the GPU",
            dtype.name()
        )))
    };
    Ok(match op {
        UnaryOp::Relu if float => format!("max({x}, 0.0)"),
        UnaryOp::Relu if int => format!("max({x}, 0i)"),
        UnaryOp::Gelu { tanh: false } if float => {
            format!("(0.5 * {x} * (1.0 + erf_({x} * 0.70710678118654752)))")
        }
        UnaryOp::Gelu { tanh: true } if float => format!(
            "(0.5 * {x} * (1.0 + tanh_(0.79788456080286536 * ({x} + 0.044715 * {x} * {x} * {x}))))"
        ),
        UnaryOp::Silu if float => format!("({x} / (1.0 + exp(-{x})))"),
        UnaryOp::Sigmoid if float => format!("(1.0 / (1.0 + exp(-{x})))"),
        UnaryOp::Tanh if float => format!("tanh_({x})"),
        UnaryOp::Exp if float => format!("exp({x})"),
        UnaryOp::Log if float => format!("log({x})"),
        UnaryOp::Sqrt if float => format!("sqrt({x})"),
        UnaryOp::Rsqrt if float => format!("inverseSqrt({x})"),
        UnaryOp::Sin if float => format!("sin({x})"),
        UnaryOp::Cos if float => format!("cos({x})"),
        UnaryOp::Erf if float => format!("erf_({x})"),
        UnaryOp::Reciprocal if float => format!("(1.0 / {x})"),
        UnaryOp::Floor if float => format!("floor({x})"),
        UnaryOp::Ceil if float => format!("ceil({x})"),
        UnaryOp::Round if float => format!("round({x})"),
        UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round if int => x.to_string(),
        UnaryOp::Neg if float || int => format!("(-{x})"),
        UnaryOp::Abs if float || int => format!("abs({x})"),
        UnaryOp::Sign if float => format!("sign({x})"),
        UnaryOp::Sign if int => format!("sign({x})"),
        UnaryOp::Hardswish if float => format!("({x} * clamp({x} + 3.0, 0.0, 6.0) / 6.0)"),
        UnaryOp::Hardsigmoid if float => format!("clamp({x} / 6.0 + 0.5, 0.0, 1.0)"),
        UnaryOp::LeakyRelu { slope } if float => {
            format!("select({x} * {}, {x}, {x} > 0.0)", float_literal(slope))
        }
        UnaryOp::Clamp { min, max } if float || int => {
            // integer values lie in i32, so a bound beyond clamps as i32's end
            let bound = |v: f64| {
                if int {
                    v.clamp(i32::MIN.into(), i32::MAX.into())
                } else {
                    v
                }
            };
            let lit = |v: f64| literal(Scalar::Float(bound(v)), dtype);
            let mut e = x.to_string();
            if let Some(lo) = min {
                e = format!("max({e}, {})", lit(lo)?);
            }
            if let Some(hi) = max {
                e = format!("min({e}, {})", lit(hi)?);
            }
            e
        }
        UnaryOp::PowScalar { exponent } if float => {
            if exponent == 2.0 {
                format!("({x} * {x})")
            } else if exponent == 1.0 {
                x.to_string()
            } else if exponent == 0.5 {
                format!("sqrt({x})")
            } else {
                format!("powf_({x}, {})", float_literal(exponent))
            }
        }
        UnaryOp::LogicalNot => match compute_type(dtype) {
            "bool" => format!("(!{x})"),
            "f32" => format!("({x} == 0.0)"),
            _ => format!("({x} == 0i)"),
        },
        UnaryOp::BitwiseNot if dtype == DType::Bool => format!("(!{x})"),
        UnaryOp::BitwiseNot if int => format!("(~{x})"),
        _ => return unsupported(),
    })
}

/// `a op b` with both operands computed as `compute`.
pub(crate) fn binary(op: BinaryOp, a: &str, b: &str, compute: DType) -> Result<String> {
    let ty = compute_type(compute);
    let float = ty == "f32";
    let int = ty == "i32";
    let boolean = ty == "bool";
    Ok(match op {
        BinaryOp::Add if boolean => format!("({a} || {b})"),
        BinaryOp::Mul if boolean => format!("({a} && {b})"),
        BinaryOp::Add if !boolean => format!("({a} + {b})"),
        BinaryOp::Sub if !boolean => format!("({a} - {b})"),
        BinaryOp::Mul if !boolean => format!("({a} * {b})"),
        BinaryOp::Div if float => format!("({a} / {b})"),
        BinaryOp::FloorDiv if float => format!("floor({a} / {b})"),
        BinaryOp::FloorDiv if int => format!("floordiv_i({a}, {b})"),
        BinaryOp::TruncDiv if float => format!("trunc({a} / {b})"),
        BinaryOp::TruncDiv if int => format!("({a} / {b})"),
        BinaryOp::Remainder if float => format!("({a} - {b} * floor({a} / {b}))"),
        BinaryOp::Remainder if int => format!("rem_i({a}, {b})"),
        BinaryOp::Pow if float => format!("powf_({a}, {b})"),
        BinaryOp::Pow if int => format!("pow_i({a}, {b})"),
        BinaryOp::Maximum if !boolean => format!("max({a}, {b})"),
        BinaryOp::Minimum if !boolean => format!("min({a}, {b})"),
        BinaryOp::Maximum => format!("({a} || {b})"),
        BinaryOp::Minimum => format!("({a} && {b})"),
        BinaryOp::Eq => format!("({a} == {b})"),
        BinaryOp::Ne => format!("({a} != {b})"),
        BinaryOp::Lt if !boolean => format!("({a} < {b})"),
        BinaryOp::Le if !boolean => format!("({a} <= {b})"),
        BinaryOp::Gt if !boolean => format!("({a} > {b})"),
        BinaryOp::Ge if !boolean => format!("({a} >= {b})"),
        BinaryOp::Lt => format!("(!{a} && {b})"),
        BinaryOp::Le => format!("(!{a} || {b})"),
        BinaryOp::Gt => format!("({a} && !{b})"),
        BinaryOp::Ge => format!("({a} || !{b})"),
        BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor => {
            let t = |x: &str| match ty {
                "bool" => x.to_string(),
                "f32" => format!("({x} != 0.0)"),
                _ => format!("({x} != 0i)"),
            };
            let sym = match op {
                BinaryOp::LogicalAnd => "&&",
                BinaryOp::LogicalOr => "||",
                _ => "!=",
            };
            format!("({} {sym} {})", t(a), t(b))
        }
        BinaryOp::BitwiseAnd if !float => format!("({a} & {b})"),
        BinaryOp::BitwiseOr if !float => format!("({a} | {b})"),
        BinaryOp::BitwiseXor if int => format!("({a} ^ {b})"),
        BinaryOp::BitwiseXor if boolean => format!("({a} != {b})"),
        _ => {
            return Err(Error::unsupported(format!(
                "{op:?} of {} on the GPU",
                compute.name()
            )))
        }
    })
}

/// Whether `op` computed as `compute` is checked at run time: int64
/// add/sub/mul/division for results beyond i32, every integer division and
/// remainder for a zero divisor.
pub(crate) fn checks_binary(op: BinaryOp, compute: DType) -> bool {
    match op {
        BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul => compute == DType::I64,
        BinaryOp::FloorDiv | BinaryOp::TruncDiv | BinaryOp::Remainder => {
            compute_type(compute) == "i32"
        }
        _ => false,
    }
}

/// Whether `op` of an int64 value is checked (negating i32::MIN).
pub(crate) fn checks_unary(op: UnaryOp, dtype: DType) -> bool {
    dtype == DType::I64 && matches!(op, UnaryOp::Neg | UnaryOp::Abs)
}

/// Whether a cast is checked: floats to int64 beyond i32.
pub(crate) fn checks_cast(from: DType, to: DType) -> bool {
    to == DType::I64 && from.is_float()
}

/// [`binary`] with the checks of [`checks_binary`]; `bit(fault)` gives
/// each check its status bit.
pub(crate) fn binary_checked(
    op: BinaryOp,
    a: &str,
    b: &str,
    compute: DType,
    bit: &mut dyn FnMut(Fault) -> u32,
) -> Result<String> {
    if !checks_binary(op, compute) {
        return binary(op, a, b, compute);
    }
    Ok(match op {
        BinaryOp::Add => format!("add_ck({a}, {b}, {}u)", bit(Fault::Overflow)),
        BinaryOp::Sub => format!("sub_ck({a}, {b}, {}u)", bit(Fault::Overflow)),
        BinaryOp::Mul => format!("mul_ck({a}, {b}, {}u)", bit(Fault::Overflow)),
        _ => {
            let divisor = format!("nz_ck({b}, {}u)", bit(Fault::ZeroDivision));
            // int32 quotients wrap as PyTorch's; int64 ones must fit
            let dividend = if compute == DType::I64 && op != BinaryOp::Remainder {
                format!("quot_ck({a}, {b}, {}u)", bit(Fault::Overflow))
            } else {
                a.to_string()
            };
            binary(op, &dividend, &divisor, compute)?
        }
    })
}

/// [`unary`] with the check of [`checks_unary`].
pub(crate) fn unary_checked(
    op: UnaryOp,
    x: &str,
    dtype: DType,
    bit: &mut dyn FnMut(Fault) -> u32,
) -> Result<String> {
    match op {
        _ if !checks_unary(op, dtype) => unary(op, x, dtype),
        UnaryOp::Neg => Ok(format!("neg_ck({x}, {}u)", bit(Fault::Overflow))),
        _ => Ok(format!("abs_ck({x}, {}u)", bit(Fault::Overflow))),
    }
}

/// [`cast`] with the check of [`checks_cast`].
pub(crate) fn cast_checked(
    x: &str,
    from: DType,
    to: DType,
    bit: &mut dyn FnMut(Fault) -> u32,
) -> String {
    if checks_cast(from, to) {
        format!("f2i_ck({x}, {}u)", bit(Fault::Overflow))
    } else {
        cast(x, from, to)
    }
}
