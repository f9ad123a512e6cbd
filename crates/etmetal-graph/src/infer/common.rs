//! What the op families of shape inference share: reading input slots,
//! and the shape rules several families apply.

use etmetal_core::dtype::{self, Operand};
use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{DType, Error, Op, Result};

use crate::ir::ValueInfo;

pub(crate) type Out = Vec<(DType, Vec<usize>)>;

pub(crate) fn req<'a>(
    inputs: &[Option<&'a ValueInfo>],
    slot: usize,
    what: &str,
) -> Result<&'a ValueInfo> {
    inputs
        .get(slot)
        .copied()
        .flatten()
        .ok_or_else(|| Error::shape(format!("input {slot} ({what}) is missing")))
}

/// PyTorch's `result_type` for two tensors ([`dtype::result_type`]).
pub fn result_type(a: &ValueInfo, b: &ValueInfo) -> DType {
    let operand = |v: &ValueInfo| {
        if v.shape.is_empty() {
            Operand::ZeroDim(v.dtype)
        } else {
            Operand::Tensor(v.dtype)
        }
    };
    dtype::result_type(operand(a), operand(b))
}

/// Integer and bool inputs of float functions give float32.
pub(crate) fn float_of(d: DType) -> DType {
    if d.is_float() {
        d
    } else {
        DType::F32
    }
}

pub(crate) fn reduced(shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Vec<usize>> {
    for &d in dims {
        if d >= shape.len().max(1) {
            return Err(Error::shape(format!(
                "reduce dim {d} is out of range for shape {shape:?}"
            )));
        }
    }
    let all = dims.is_empty();
    Ok(shape
        .iter()
        .enumerate()
        .filter_map(|(i, &n)| match (all || dims.contains(&i), keepdim) {
            (false, _) => Some(n),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect())
}

pub(crate) fn check_dim(shape: &[usize], dim: usize, what: &str) -> Result<()> {
    if dim >= shape.len() {
        return Err(Error::shape(format!(
            "{what} dim {dim} is out of range for shape {shape:?}"
        )));
    }
    Ok(())
}

pub(crate) fn check_index_dtype(v: &ValueInfo, what: &str) -> Result<()> {
    if !matches!(v.dtype, DType::I64 | DType::I32) {
        return Err(Error::shape(format!(
            "{what} must be int64 or int32, got {}",
            v.dtype
        )));
    }
    Ok(())
}

pub(crate) fn matmul_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let mismatch = || {
        Error::shape(format!(
            "matmul of shapes {a:?} and {b:?}: inner dims differ"
        ))
    };
    if a.is_empty() || b.is_empty() {
        return Err(Error::shape(format!(
            "matmul needs tensors of rank >= 1, got {a:?} and {b:?}"
        )));
    }
    let (ak, bk) = (
        a[a.len() - 1],
        if b.len() == 1 { b[0] } else { b[b.len() - 2] },
    );
    if ak != bk {
        return Err(mismatch());
    }
    let a_batch = &a[..a.len().saturating_sub(2)];
    let b_batch = &b[..b.len().saturating_sub(2)];
    let mut out = broadcast_shapes(a_batch, b_batch)?;
    if a.len() >= 2 {
        out.push(a[a.len() - 2]);
    }
    if b.len() >= 2 {
        out.push(b[b.len() - 1]);
    }
    Ok(out)
}

pub(crate) fn spatial_split<'a>(
    x: &'a ValueInfo,
    spatial: usize,
    what: &str,
) -> Result<(&'a [usize], &'a [usize])> {
    if x.shape.len() != spatial + 1 && x.shape.len() != spatial + 2 {
        return Err(Error::shape(format!(
            "{what} with {spatial} spatial dims needs input of rank {} or {}, got {:?}",
            spatial + 1,
            spatial + 2,
            x.shape
        )));
    }
    Ok(x.shape.split_at(x.shape.len() - spatial))
}

/// Input slot 0, which most ops call their input.
pub(crate) fn first<'a>(inputs: &[Option<&'a ValueInfo>]) -> Result<&'a ValueInfo> {
    req(inputs, 0, "input")
}

/// One output of `v`'s dtype and shape.
pub(crate) fn same(v: &ValueInfo) -> Result<Out> {
    Ok(vec![(v.dtype, v.shape.clone())])
}

/// The error of a family's inference given an op of another family: the
/// dispatcher in `infer/mod.rs` and the families disagree (a bug).
pub(crate) fn not_in_family(op: &Op, family: &str) -> Error {
    Error::internal(format!("shape inference: `{}` is not {family}", op.name()))
}
