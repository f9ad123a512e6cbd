//! Element types, numbered as ExecuTorch's `ScalarType` (`scalar_type.fbs`).

use crate::error::{Error, Result};

/// An element type. The discriminant is ExecuTorch's `ScalarType` value, so
/// `dtype as i8` is what a `.pte` stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i8)]
pub enum DType {
    U8 = 0,
    I8 = 1,
    I16 = 2,
    I32 = 3,
    I64 = 4,
    F16 = 5,
    F32 = 6,
    F64 = 7,
    Bool = 11,
    BF16 = 15,
}

impl DType {
    pub const ALL: [DType; 10] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::Bool,
        DType::BF16,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64
        )
    }

    /// The PyTorch name (`torch.float32` → `"float32"`).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::Bool => "bool",
            DType::BF16 => "bfloat16",
        }
    }

    /// Parse a PyTorch dtype name, with or without the `torch.` prefix.
    pub fn from_name(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        let alias = match name {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            other => other,
        };
        DType::ALL.into_iter().find(|d| d.name() == alias)
    }

    /// ExecuTorch `ScalarType` code.
    pub fn executorch_code(self) -> i8 {
        self as i8
    }

    pub fn from_executorch(code: i8) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| *d as i8 == code)
            .ok_or_else(|| Error::format(format!("unsupported ExecuTorch scalar type {code}")))
    }

    /// The torch.export serde `ScalarType` number (it differs from ExecuTorch's).
    pub fn from_torch_serde(code: i64) -> Result<DType> {
        Ok(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F16,
            7 => DType::F32,
            8 => DType::F64,
            12 => DType::Bool,
            13 => DType::BF16,
            other => {
                return Err(Error::unsupported(format!(
                    "torch.export scalar type {other} (complex, float8 and unsigned >8-bit types are not supported)"
                )))
            }
        })
    }

    /// PyTorch type promotion between two dtypes of the same standing
    /// (both dimensioned tensors; see [`result_type`] for mixed ones). bool < integers < floats; within floats
    /// f16 and bf16 promote to f32.
    pub fn promote(a: DType, b: DType) -> DType {
        use DType::*;
        if a == b {
            return a;
        }
        match (a, b) {
            (Bool, x) | (x, Bool) => x,
            (F64, _) | (_, F64) => F64,
            (F16, BF16) | (BF16, F16) => F32,
            (F32, _) | (_, F32) => F32,
            (F16, _) | (_, F16) => F16,
            (BF16, _) | (_, BF16) => BF16,
            (U8, I8) | (I8, U8) => I16,
            (x, y) => {
                // both integers: the wider signed type wins
                if x.size() >= y.size() {
                    x
                } else {
                    y
                }
            }
        }
    }
}

/// A scalar attribute (a Python number), kept exact for integers; here
/// beside the promotion rules that give it a dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Scalar {
    /// The dtype PyTorch gives a Python scalar on its own
    /// (`torch.tensor(v)`): int64, float32 (the default dtype) or bool.
    pub fn dtype(self) -> DType {
        match self {
            Scalar::Int(_) => DType::I64,
            Scalar::Float(_) => DType::F32,
            Scalar::Bool(_) => DType::Bool,
        }
    }
    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Int(v) => v as f64,
            Scalar::Float(v) => v,
            Scalar::Bool(v) => v as i64 as f64,
        }
    }
    pub fn to_i64(self) -> i64 {
        match self {
            Scalar::Int(v) => v,
            Scalar::Float(v) => v as i64,
            Scalar::Bool(v) => v as i64,
        }
    }
}

/// An operand of a PyTorch op, as type promotion ranks it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Operand {
    /// A tensor with at least one dim.
    Tensor(DType),
    /// A 0-d tensor.
    ZeroDim(DType),
    /// A Python number (a wrapped scalar); its dtype is [`Scalar::dtype`].
    Scalar(Scalar),
}

/// PyTorch's `torch.result_type` of two operands. Tensors with dims decide;
/// 0-d tensors, then Python scalars, change the result only when they are of
/// a higher category (bool < integer < float): `int32 + 2.5` is float32,
/// `int32 + 0-d int64` int32, `float16 + 0-d float64` float16.
pub fn result_type(a: Operand, b: Operand) -> DType {
    // one promoted dtype per rank: dimensioned, 0-d, scalar
    let mut ranks: [Option<DType>; 3] = [None; 3];
    for o in [a, b] {
        let (rank, d) = match o {
            Operand::Tensor(d) => (0, d),
            Operand::ZeroDim(d) => (1, d),
            Operand::Scalar(s) => (2, s.dtype()),
        };
        ranks[rank] = Some(ranks[rank].map_or(d, |r| DType::promote(r, d)));
    }
    // PyTorch's combine_categories(higher, lower)
    let combine = |higher: Option<DType>, lower: Option<DType>| match (higher, lower) {
        (Some(h), Some(l)) if !h.is_float() && (h == DType::Bool || l.is_float()) => {
            Some(DType::promote(h, l))
        }
        (Some(h), _) => Some(h),
        (None, l) => l,
    };
    let [dims, zero, scalar] = ranks;
    // two operands fill at least one rank
    combine(dims, combine(zero, scalar)).unwrap_or(DType::F32)
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn executorch_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_executorch(d.executorch_code()).unwrap(), d);
        }
        assert_eq!(DType::F32 as i8, 6);
        assert_eq!(DType::BF16 as i8, 15);
        assert!(DType::from_executorch(9).is_err());
    }

    #[test]
    fn serde_codes_differ_from_executorch() {
        assert_eq!(DType::from_torch_serde(7).unwrap(), DType::F32);
        assert_eq!(DType::from_torch_serde(13).unwrap(), DType::BF16);
        assert_eq!(DType::from_torch_serde(12).unwrap(), DType::Bool);
        assert!(DType::from_torch_serde(10).is_err());
    }

    #[test]
    fn promotion_follows_pytorch() {
        use DType::*;
        assert_eq!(DType::promote(Bool, I64), I64);
        assert_eq!(DType::promote(I64, F32), F32);
        assert_eq!(DType::promote(BF16, F16), F32);
        assert_eq!(DType::promote(BF16, I64), BF16);
        assert_eq!(DType::promote(U8, I8), I16);
        assert_eq!(DType::promote(I32, I64), I64);
        assert_eq!(DType::promote(F32, F64), F64);
    }

    #[test]
    fn names_parse() {
        assert_eq!(DType::from_name("torch.float32"), Some(DType::F32));
        assert_eq!(DType::from_name("long"), Some(DType::I64));
        assert_eq!(DType::from_name("complex64"), None);
    }

    // Expected dtypes below are what PyTorch 2.15 gives for `a + b`.
    #[test]
    fn result_type_follows_pytorch() {
        use DType::*;
        use Operand::{Scalar as S, Tensor as T, ZeroDim as Z};
        let (int, float, bool) = (Scalar::Int(2), Scalar::Float(2.5), Scalar::Bool(true));
        let cases = [
            // tensor and Python scalar
            (T(I32), S(float), F32),
            (T(I32), S(int), I32),
            (T(Bool), S(int), I64),
            (T(Bool), S(float), F32),
            (T(Bool), S(bool), Bool),
            (T(F16), S(float), F16),
            (T(U8), S(bool), U8),
            // dimensioned tensor and 0-d tensor
            (T(I32), Z(F64), F64),
            (T(I32), Z(I64), I32),
            (T(Bool), Z(I32), I32),
            (T(F16), Z(F64), F16),
            (T(U8), Z(I8), U8),
            (T(BF16), Z(F16), BF16),
            (Z(F16), T(I64), F16),
            // 0-d tensors among themselves and with scalars
            (Z(I32), Z(I64), I64),
            (Z(I32), S(float), F32),
            (Z(I64), S(float), F32),
            (Z(Bool), Z(F16), F16),
            // dimensioned tensors among themselves
            (T(U8), T(I8), I16),
            (T(BF16), T(F16), F32),
        ];
        for (a, b, want) in cases {
            assert_eq!(result_type(a, b), want, "{a:?} + {b:?}");
            assert_eq!(result_type(b, a), want, "{b:?} + {a:?}");
        }
    }
}
