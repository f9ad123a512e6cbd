//! Borrowed tensors: memory the caller owns (a planned arena, a mapped
//! file) seen as a dtype and a shape, so [`crate::execute_into`] reads its
//! inputs and writes its outputs in place.

use etmetal_core::{DType, Error, Result, Tensor};

/// A contiguous tensor in borrowed memory.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// A contiguous tensor in borrowed memory that a kernel writes.
#[derive(Debug)]
pub struct ViewMut<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a mut [u8],
}

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

impl<'a> View<'a> {
    pub fn of(t: &'a Tensor) -> View<'a> {
        View {
            dtype: t.dtype(),
            shape: t.shape(),
            bytes: t.bytes(),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as f32, when the dtype is f32 and the bytes are aligned.
    pub(crate) fn f32s(&self) -> Option<&'a [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }
}

impl ViewMut<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as f32, when the dtype is f32 and the bytes are aligned.
    pub(crate) fn f32s(&mut self) -> Option<&mut [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        bytemuck::try_cast_slice_mut(self.bytes).ok()
    }
}
