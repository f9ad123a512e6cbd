//! The dispatcher's context, a leaf every kernel module reads: the op, its
//! input slots and the outputs the graph expects, with the errors that
//! name the op.

use etmetal_core::{DType, Error, Op, Result, Tensor};

/// What every kernel receives: the op (for messages), its input slots and the
/// dtypes and shapes the graph expects of its outputs.
pub(crate) struct Ctx<'a> {
    pub op: &'a Op,
    pub inputs: &'a [Option<&'a Tensor>],
    pub outputs: &'a [(DType, Vec<usize>)],
}

impl<'a> Ctx<'a> {
    pub fn name(&self) -> &'static str {
        self.op.name()
    }

    /// A required input slot.
    pub fn input(&self, slot: usize) -> Result<&'a Tensor> {
        self.inputs.get(slot).copied().flatten().ok_or_else(|| {
            Error::invalid_input(format!(
                "{}: required input slot {slot} is missing",
                self.name()
            ))
        })
    }

    /// An optional input slot (`None` when absent or beyond the list).
    pub fn optional(&self, slot: usize) -> Option<&'a Tensor> {
        self.inputs.get(slot).copied().flatten()
    }

    /// The dtype the graph expects of output `i`.
    pub fn out_dtype(&self, i: usize) -> Result<DType> {
        self.outputs.get(i).map(|o| o.0).ok_or_else(|| {
            Error::shape(format!(
                "{}: output {i} has no expected dtype and shape ({} given)",
                self.name(),
                self.outputs.len()
            ))
        })
    }

    /// Error unless the number of input slots lies in `min..=max`.
    pub fn arity(&self, min: usize, max: usize) -> Result<()> {
        let n = self.inputs.len();
        if n < min || n > max {
            let want = if min == max {
                format!("{min}")
            } else {
                format!("{min} to {max}")
            };
            return Err(Error::invalid_input(format!(
                "{}: expected {want} input slots, got {n}",
                self.name()
            )));
        }
        Ok(())
    }

    /// An `InvalidInput` error naming the op.
    pub fn invalid(&self, msg: impl std::fmt::Display) -> Error {
        Error::invalid_input(format!("{}: {msg}", self.name()))
    }

    /// An `Unsupported` error naming the op.
    pub fn unsupported(&self, msg: impl std::fmt::Display) -> Error {
        Error::unsupported(format!("{}: {msg}", self.name()))
    }
}
