//! ExecuTorch kernel call → Op (placeholder; being written).

use etmetal_core::{Error, Result};

use super::Decoded;
use crate::schema::{EValue, Operator};

/// Read a kernel call of `operator` with argument value indices `args`.
pub fn decode(_values: &[EValue], operator: &Operator, _args: &[i32]) -> Result<Decoded> {
    Err(Error::unsupported(format!("ExecuTorch operator {}", operator.qualified_name())))
}
