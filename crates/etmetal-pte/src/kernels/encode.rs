//! Op → ExecuTorch kernel call (placeholder; being written).

use etmetal_core::{Error, Op, Result};

use super::{Call, TensorMeta};

/// The out-variant kernel call ExecuTorch's portable library runs for `op`.
pub fn encode(op: &Op, _inputs: &[Option<TensorMeta>], _outputs: &[TensorMeta]) -> Result<Call> {
    Err(Error::unsupported(format!("no ExecuTorch kernel for {}", op.name())))
}
