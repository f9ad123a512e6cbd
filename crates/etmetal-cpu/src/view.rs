//! Borrowed tensors: memory the caller owns (a planned arena, a mapped
//! file) seen as a dtype and a shape, so [`crate::execute_into`] reads its
//! inputs and writes its outputs in place.

use etmetal_core::{DType, Error, Result};
pub use etmetal_core::{View, ViewMut};

/// Error unless `bytes` holds exactly the elements of `dtype` and `shape`.
pub(crate) fn check_len(dtype: DType, shape: &[usize], bytes: usize, what: &str) -> Result<()> {
    let want = etmetal_core::shape::numel(shape)?.checked_mul(dtype.size());
    if want != Some(bytes) {
        return Err(Error::internal(format!(
            "{what}: {bytes} bytes given for a {dtype} tensor of shape {shape:?}"
        )));
    }
    Ok(())
}
