//! The binding budget: no kernel of a payload binds more storage buffers
//! than [`PreprocessOptions::max_bindings`](super::PreprocessOptions), so
//! the payload never requires more `max_storage_buffers_per_shader_stage`
//! than that. The default, 8, is wgpu's (and WebGPU's) default limit, which
//! every adapter offers (lavapipe offers 32): preprocess runs ahead of
//! time, with no device to ask, and a payload within the default loads
//! everywhere. It costs a few dispatches where an expression reads more:
//! DenseNet-121 has 471 dispatches instead of 419 (the extra ones slices
//! of its dense blocks' cats) and ran as fast on lavapipe.
//!
//! This module holds the rule; the lowering context applies it. An
//! expression whose inputs together read too many buffers is computed over
//! materialised inputs instead (it fuses less: `Lowering::split_inputs`),
//! and a cat of too many parts is written by several kernels, each writing
//! its slice of the output ([`cat_slices`]; a dense block's cat in
//! DenseNet-169 has 33 parts). Templates keep their fused inputs within it
//! themselves (the matrix and attention templates materialise the widest
//! until they fit, a reduction with two outputs counts both:
//! `Lowering::fused_within`); every dispatch is checked ([`check`]).

use etmetal_core::{Error, Result};

use super::buffers::BufferIdx;
use super::expr::{Kind, Lazy, LazyRef};

/// The storage buffers a flat kernel writing `lazy` binds: those it reads,
/// its output, and a status buffer when it has run-time checks.
pub(crate) fn flat_bindings(lazy: &Lazy) -> usize {
    let mut reads = vec![];
    lazy.buffers(&mut reads);
    reads.len() + 1 + usize::from(lazy.has_checks())
}

/// One kernel's share of a cat: the parts it writes (as a cat of them) and
/// where along the cat's dim they start in the output.
pub(crate) struct CatSlice {
    pub value: LazyRef,
    pub dim: usize,
    pub start: usize,
}

/// A cat (`lazy`) that one kernel would write over `budget` bindings,
/// as slices of consecutive parts that each fit (each part does alone:
/// it is a value that fusion kept within the budget); `None` for
/// anything else.
pub(crate) fn cat_slices(lazy: &LazyRef, budget: usize) -> Option<Vec<CatSlice>> {
    let Kind::Cat(parts, dim) = &lazy.kind else {
        return None;
    };
    if flat_bindings(lazy) <= budget {
        return None;
    }
    let dim = *dim;
    let mut slices: Vec<CatSlice> = vec![];
    let (mut group, mut group_start, mut start) = (vec![], 0, 0);
    for part in parts {
        let mut with = group.clone();
        with.push(part.clone());
        if !group.is_empty() && flat_bindings(&cat_of(&with, dim, lazy)) > budget {
            let value = cat_of(&group, dim, lazy);
            slices.push(CatSlice {
                value,
                dim,
                start: group_start,
            });
            group_start = start;
            with = vec![part.clone()];
        }
        group = with;
        start += part.shape[dim];
    }
    let value = cat_of(&group, dim, lazy);
    slices.push(CatSlice {
        value,
        dim,
        start: group_start,
    });
    Some(slices)
}

/// A dispatch binding `bindings` (its status buffer included) must
/// stay within `budget`; `label` names the op it lowers.
pub(crate) fn check(label: &str, bindings: &[BufferIdx], budget: usize) -> Result<()> {
    if bindings.len() > budget {
        return Err(Error::internal(format!(
            "a `{label}` kernel binds {} storage buffers, over the budget of {budget}",
            bindings.len(),
        )));
    }
    Ok(())
}

/// The cat of `parts` along `dim`, of `whole`'s dtype.
fn cat_of(parts: &[LazyRef], dim: usize, whole: &LazyRef) -> LazyRef {
    let mut shape = whole.shape.clone();
    shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
    Lazy::new(whole.dtype, shape, Kind::Cat(parts.to_vec(), dim))
}

/// The buffers `x` reads.
pub(crate) fn read_count(x: &Lazy) -> usize {
    let mut reads = vec![];
    x.buffers(&mut reads);
    reads.len()
}
