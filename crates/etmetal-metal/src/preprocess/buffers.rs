//! The buffers of a partition being lowered: what each holds, where it
//! lives and how its elements are stored. A leaf: the emitter, the lazy
//! expressions, the arena planner and the lowering all read these types.

use etmetal_core::{DType, Result};

use crate::payload::{self, Access, GpuRepr, Role};

/// Index into [`Buffers::list`] (the payload's buffer ids).
pub(crate) type BufferIdx = usize;

/// How a buffer's elements are stored on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Storage {
    F32,
    /// i32, and int64/bool/u8/i8 widened or narrowed to i32.
    I32,
    /// f16/bf16 two a u32 (delegate inputs, outputs and weights only;
    /// 16-bit intermediates are kept in f32, see [`payload::Role`]).
    Packed16,
}

impl Storage {
    /// The storage of a buffer declaring `dtype` (a
    /// [`payload::buffer_dtype`]).
    fn of(dtype: DType) -> Result<Storage> {
        Ok(match GpuRepr::of(dtype)? {
            GpuRepr::F32 => Storage::F32,
            GpuRepr::Packed16 => Storage::Packed16,
            GpuRepr::I32 | GpuRepr::I64AsI32 | GpuRepr::Widened => Storage::I32,
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Input(usize),
    Output(usize),
    Weight(String),
    Temp,
    /// A dispatch's status words (see [`payload::Check`]).
    Status,
}

impl Place {
    /// Whether the host reads or writes the buffer: its values keep their
    /// host form.
    fn role(&self) -> Role {
        match self {
            Place::Temp => Role::Intermediate,
            _ => Role::Boundary,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct BufferDesc {
    pub name: String,
    /// The logical dtype of the values (loads and stores convert).
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub storage: Storage,
    pub place: Place,
}

impl BufferDesc {
    /// A buffer for values of `dtype` at `place`, stored as its role asks.
    pub fn new(name: &str, dtype: DType, shape: &[usize], place: Place) -> Result<BufferDesc> {
        let storage = Storage::of(payload::buffer_dtype(dtype, place.role()))?;
        Ok(BufferDesc {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            storage,
            place,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The dtype the payload declares (16-bit float intermediates are f32,
    /// unless stored packed: a partition output written in its host form,
    /// or a kernel's 16-bit scratch, [`Storage::Packed16`]).
    pub fn payload_dtype(&self) -> DType {
        match self.storage {
            Storage::Packed16 => self.dtype,
            _ => payload::buffer_dtype(self.dtype, self.place.role()),
        }
    }

    pub fn gpu_bytes(&self) -> Result<u64> {
        payload::gpu_bytes(self.payload_dtype(), self.numel())
    }
}

#[derive(Default)]
pub(crate) struct Buffers {
    pub list: Vec<BufferDesc>,
}

impl Buffers {
    pub fn access(&self, buf: BufferIdx) -> Access {
        match self.list[buf].place {
            Place::Weight(_) => Access::Read,
            _ => Access::ReadWrite,
        }
    }
}
