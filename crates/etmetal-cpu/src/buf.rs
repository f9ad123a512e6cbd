//! Compute domains: the element type a kernel computes in for a given dtype.
//! Floats below f64 compute in f32 (bf16/f16 are rounded to nearest even on
//! store), f64 in f64, integers exactly in i64, bool as bool.

use etmetal_core::{DType, Result, Tensor};
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    F32,
    F64,
    I64,
    Bool,
}

pub fn domain(dtype: DType) -> Domain {
    match dtype {
        DType::F64 => Domain::F64,
        d if d.is_float() => Domain::F32,
        DType::Bool => Domain::Bool,
        _ => Domain::I64,
    }
}

/// Elements of one compute domain.
#[derive(Clone, Debug, PartialEq)]
pub enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

/// The elements of `t` converted to `dom` (floats to int truncate toward zero,
/// anything to bool is `!= 0`).
pub fn load(t: &Tensor, dom: Domain) -> Buf {
    match dom {
        Domain::F32 => Buf::F32(t.to_f32_vec()),
        Domain::F64 => Buf::F64(t.to_f64_vec()),
        Domain::I64 => Buf::I64(t.to_i64_vec()),
        Domain::Bool if t.dtype().is_float() => {
            Buf::Bool(t.to_f64_vec().into_iter().map(|v| v != 0.0).collect())
        }
        Domain::Bool => Buf::Bool(t.to_i64_vec().into_iter().map(|v| v != 0).collect()),
    }
}

/// Element types that have a [`Buf`] variant, so generic kernels can hand
/// back their results.
pub trait Elem: Copy + PartialOrd + Send + Sync {
    fn wrap(v: Vec<Self>) -> Buf;
    /// The elements of `t` converted to this type (as [`load`]).
    fn load(t: &Tensor) -> Vec<Self>;
}

macro_rules! impl_elem {
    ($t:ty, $v:ident) => {
        impl Elem for $t {
            fn wrap(v: Vec<Self>) -> Buf {
                Buf::$v(v)
            }
            fn load(t: &Tensor) -> Vec<Self> {
                match load(t, Domain::$v) {
                    Buf::$v(v) => v,
                    _ => unreachable!("load gives the requested domain"),
                }
            }
        }
    };
}
impl_elem!(f32, F32);
impl_elem!(f64, F64);
impl_elem!(i64, I64);
impl_elem!(bool, Bool);

/// Run `$body` with `$T` bound to the numeric element type of domain `$dom`
/// (f32, f64 or i64); the bool domain runs `$on_bool` instead.
macro_rules! numeric {
    ($dom:expr, $T:ident => $body:expr, bool => $on_bool:expr) => {
        match $dom {
            $crate::buf::Domain::F32 => {
                type $T = f32;
                $body
            }
            $crate::buf::Domain::F64 => {
                type $T = f64;
                $body
            }
            $crate::buf::Domain::I64 => {
                type $T = i64;
                $body
            }
            $crate::buf::Domain::Bool => $on_bool,
        }
    };
}
pub(crate) use numeric;

/// Run `$body` with `$v` bound to the elements of `$t` in an ordered domain
/// (f64 for floats, i64 for integers and bool), for kernels that compare
/// values and return them unchanged.
macro_rules! with_ordered {
    ($t:expr, $v:ident => $body:expr) => {
        if $t.dtype().is_float() {
            let $v: Vec<f64> = $t.to_f64_vec();
            $body
        } else {
            let $v: Vec<i64> = $t.to_i64_vec();
            $body
        }
    };
}
pub(crate) use with_ordered;

impl Buf {
    /// A tensor of `dtype` and `shape` holding these elements.
    pub fn store(self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self {
            Buf::F32(v) => store_f32(&v, dtype, shape),
            Buf::F64(v) if dtype == DType::F32 => Tensor::from_slice(
                dtype,
                shape,
                &v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
            ),
            Buf::F64(v) => Tensor::from_f64(dtype, shape, &v),
            Buf::I64(v) => Tensor::from_i64(dtype, shape, &v),
            Buf::Bool(v) => {
                let bytes: Vec<u8> = v.iter().map(|&b| b as u8).collect();
                match dtype {
                    DType::Bool | DType::U8 => Tensor::from_bytes(dtype, shape, &bytes),
                    _ => Tensor::from_i64(
                        dtype,
                        shape,
                        &bytes.iter().map(|&b| b as i64).collect::<Vec<_>>(),
                    ),
                }
            }
        }
    }
}

/// f32 values stored as `dtype`; bf16/f16 round to nearest even.
pub fn store_f32(v: &[f32], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    match dtype {
        DType::F32 => Tensor::from_slice(dtype, shape, v),
        DType::BF16 => Tensor::from_slice(
            dtype,
            shape,
            &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
        ),
        DType::F16 => Tensor::from_slice(
            dtype,
            shape,
            &v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
        ),
        _ => Tensor::from_f64(
            dtype,
            shape,
            &v.iter().map(|&x| x as f64).collect::<Vec<_>>(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_and_round_trips() {
        assert_eq!(domain(DType::BF16), Domain::F32);
        assert_eq!(domain(DType::U8), Domain::I64);
        let t = Tensor::from_f32(DType::F32, &[3], &[0.5, -1.5, 0.0]).unwrap();
        assert_eq!(load(&t, Domain::Bool), Buf::Bool(vec![true, true, false]));
        assert_eq!(load(&t, Domain::I64), Buf::I64(vec![0, -1, 0]));
        // 1 + 2^-8 is a bf16 tie: rounds to the even 1.0
        let b = store_f32(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], DType::BF16, &[2]).unwrap();
        assert_eq!(b.to_f32_vec(), vec![1.0, 1.0 + 4.0 / 256.0]);
        let i = Buf::I64(vec![300, -1]).store(DType::U8, &[2]).unwrap();
        assert_eq!(i.to_i64_vec(), vec![44, 255]);
    }
}
