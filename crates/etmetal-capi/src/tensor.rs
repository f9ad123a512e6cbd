//! Element types and tensor specs as C sees them.

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use etmetal_core::{DType, Error, Result, TensorSpec};

/// The most dims a tensor of the API has (ExecuTorch's
/// `kTensorDimensionLimit`).
pub const ETMETAL_MAX_DIMS: usize = 16;

/// An element type, numbered as ExecuTorch's `ScalarType` (and PyTorch's
/// `c10::ScalarType`). An `int32_t`, so that any value a caller passes is
/// defined: an unknown one is an `ETMETAL_STATUS_INVALID_INPUT` error.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EtmetalDtype(pub i32);

pub const ETMETAL_DTYPE_UINT8: EtmetalDtype = EtmetalDtype(0);
pub const ETMETAL_DTYPE_INT8: EtmetalDtype = EtmetalDtype(1);
pub const ETMETAL_DTYPE_INT16: EtmetalDtype = EtmetalDtype(2);
pub const ETMETAL_DTYPE_INT32: EtmetalDtype = EtmetalDtype(3);
pub const ETMETAL_DTYPE_INT64: EtmetalDtype = EtmetalDtype(4);
pub const ETMETAL_DTYPE_FLOAT16: EtmetalDtype = EtmetalDtype(5);
pub const ETMETAL_DTYPE_FLOAT32: EtmetalDtype = EtmetalDtype(6);
pub const ETMETAL_DTYPE_FLOAT64: EtmetalDtype = EtmetalDtype(7);
/// One byte per element, 0 or 1.
pub const ETMETAL_DTYPE_BOOL: EtmetalDtype = EtmetalDtype(11);
/// The upper 16 bits of a float32, stored as 16-bit words.
pub const ETMETAL_DTYPE_BFLOAT16: EtmetalDtype = EtmetalDtype(15);

impl EtmetalDtype {
    pub(crate) fn of(dtype: DType) -> EtmetalDtype {
        EtmetalDtype(dtype.executorch_code() as i32)
    }

    /// The dtype, or an error naming `what` (an input) and the value.
    pub(crate) fn dtype(self, what: &str) -> Result<DType> {
        i8::try_from(self.0)
            .ok()
            .and_then(|code| DType::from_executorch(code).ok())
            .ok_or_else(|| {
                Error::invalid_input(format!("{what}: dtype {} is no ETMETAL_DTYPE_*", self.0))
            })
    }
}

/// What an input or output of a method holds.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EtmetalTensorSpec {
    pub dtype: EtmetalDtype,
    /// Dims used in `shape` and `dynamic`.
    pub rank: usize,
    /// Each dim's size; for a dynamic dim, its upper bound.
    pub shape: [usize; ETMETAL_MAX_DIMS],
    /// Whether each dim is dynamic: any size from 0 up to `shape[d]`
    /// (ExecuTorch's bounded dynamic shapes).
    pub dynamic: [bool; ETMETAL_MAX_DIMS],
    /// Bytes of the tensor at `shape`: enough for any size it may take.
    pub nbytes: usize,
}

impl EtmetalTensorSpec {
    /// The C form of `spec`; `what` names it in the error for a rank the
    /// API cannot hold.
    pub(crate) fn of(spec: &TensorSpec, what: &str) -> Result<EtmetalTensorSpec> {
        let rank = spec.shape.len();
        if rank > ETMETAL_MAX_DIMS {
            return Err(Error::unsupported(format!(
                "{what}: {rank} dims, more than the C API's {ETMETAL_MAX_DIMS}"
            )));
        }
        let mut c = EtmetalTensorSpec {
            dtype: EtmetalDtype::of(spec.dtype),
            rank,
            shape: [0; ETMETAL_MAX_DIMS],
            dynamic: [false; ETMETAL_MAX_DIMS],
            nbytes: nbytes(spec.dtype, &spec.shape)
                .ok_or_else(|| Error::limit(format!("{what}: too large")))?,
        };
        c.shape[..rank].copy_from_slice(&spec.shape);
        for (d, flag) in c.dynamic[..rank].iter_mut().enumerate() {
            *flag = spec.dim_is_dynamic(d);
        }
        Ok(c)
    }
}

/// Bytes of a `dtype` tensor of `shape`, if that fits a `usize`.
pub(crate) fn nbytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
}

/// The PyTorch name of `dtype` ("float32", "bfloat16", ...), a static
/// string; NULL for a value that is no `ETMETAL_DTYPE_*`.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn etmetal_dtype_name(dtype: EtmetalDtype) -> *const c_char {
    crate::error::guard("etmetal_dtype_name", std::ptr::null(), || {
        // PyTorch's names, as etmetal_core spells them, NUL-terminated once
        static NAMES: OnceLock<Vec<(DType, CString)>> = OnceLock::new();
        let d = dtype.dtype("etmetal_dtype_name")?;
        let names = NAMES.get_or_init(|| {
            DType::ALL
                .iter()
                .map(|&d| (d, CString::new(d.name()).expect("no NUL in a dtype name")))
                .collect()
        });
        let name = names.iter().find(|(n, _)| *n == d).map(|(_, c)| c);
        Ok(name.map_or(std::ptr::null(), |c| c.as_ptr()))
    })
}

/// Bytes per element of `dtype`; 0 for a value that is no
/// `ETMETAL_DTYPE_*`.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn etmetal_dtype_size(dtype: EtmetalDtype) -> usize {
    crate::error::guard("etmetal_dtype_size", 0, || {
        Ok(dtype.dtype("etmetal_dtype_size")?.size())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn every_dtype_has_its_executorch_number_and_name() {
        for d in DType::ALL {
            let c = EtmetalDtype::of(d);
            assert_eq!(c.dtype("x").unwrap(), d);
            // SAFETY: a static string.
            let name = unsafe { CStr::from_ptr(etmetal_dtype_name(c)) };
            assert_eq!(name.to_str().unwrap(), d.name());
            assert_eq!(etmetal_dtype_size(c), d.size());
        }
        assert_eq!(ETMETAL_DTYPE_FLOAT32, EtmetalDtype::of(DType::F32));
        assert_eq!(ETMETAL_DTYPE_BFLOAT16, EtmetalDtype::of(DType::BF16));
        assert!(etmetal_dtype_name(EtmetalDtype(9)).is_null());
        assert_eq!(etmetal_dtype_size(EtmetalDtype(300)), 0);
        let e = EtmetalDtype(300).dtype("input 1").unwrap_err().to_string();
        assert_eq!(e, "input 1: dtype 300 is no ETMETAL_DTYPE_*");
    }

    #[test]
    fn specs_carry_bounds_and_bytes() {
        let spec = TensorSpec {
            dtype: DType::F32,
            shape: vec![8, 3],
            dynamic: vec![true, true],
        };
        let c = EtmetalTensorSpec::of(&spec, "input 0").unwrap();
        assert_eq!((c.rank, &c.shape[..2], c.nbytes), (2, &[8, 3][..], 96));
        assert_eq!(&c.dynamic[..3], &[true, true, false]);
        let deep = TensorSpec::new(DType::U8, vec![1; 17]);
        let e = EtmetalTensorSpec::of(&deep, "output 2").unwrap_err();
        assert!(e.to_string().contains("output 2: 17 dims"), "{e}");
    }
}
