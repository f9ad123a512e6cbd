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
//! Lowering keeps to the budget in two ways: an expression whose inputs
//! together read too many buffers is computed over materialised inputs
//! instead (it fuses less: [`Lowering::split_inputs`]), and a cat of too
//! many parts is written by several kernels, each writing its slice of the
//! output ([`Lowering::cat_slices`]; a dense block's cat in DenseNet-169
//! has 33 parts). Templates keep their fused inputs within it themselves
//! (the matrix and attention templates materialise the widest until they
//! fit, a reduction with two outputs counts both: [`Lowering::fused_within`]);
//! every dispatch is checked ([`Lowering::check_budget`]).

use etmetal_core::{Error, Result};
use etmetal_graph::{Node, ValueId};

use super::buffers::BufferIdx;
use super::expr::{Kind, Lazy, LazyRef};
use super::Lowering;

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

impl Lowering<'_> {
    /// Materialise the inputs of expression node `node` (whose value is
    /// `lazy`), the ones reading the most buffers first, until a kernel
    /// writing it fits the budget. Whether any was: then `node` is lowered
    /// again over them. A cat is split instead ([`Self::cat_slices`]).
    pub(crate) fn split_inputs(&mut self, node: &Node, lazy: &LazyRef) -> Result<bool> {
        let budget = self.options.max_bindings;
        if matches!(lazy.kind, Kind::Cat(..)) || flat_bindings(lazy) <= budget {
            return Ok(false);
        }
        // the output and a status buffer besides the reads
        let fixed = flat_bindings(lazy) - read_count(lazy);
        let mut inputs: Vec<ValueId> = node.inputs.iter().flatten().copied().collect();
        inputs.sort();
        inputs.dedup();
        // materialising a view of one buffer would bind no fewer
        inputs.retain(|v| self.values.get(v).is_some_and(|x| read_count(x) > 1));
        inputs.sort_by_key(|v| std::cmp::Reverse(read_count(&self.values[v])));
        let mut split = false;
        for v in inputs {
            let mut union = vec![];
            for w in node.inputs.iter().flatten() {
                if let Some(x) = self.values.get(w) {
                    x.buffers(&mut union);
                }
            }
            if union.len() + fixed <= budget {
                break;
            }
            let x = self.values[&v].clone();
            self.materialize_value(v, x)?;
            split = true;
        }
        Ok(split)
    }

    /// Input `slot` of `node` fused into a template that binds `extra`
    /// buffers more than a flat kernel writing it would (a second output):
    /// materialised when that would bind over the budget.
    pub(crate) fn fused_within(
        &mut self,
        node: &Node,
        slot: usize,
        extra: usize,
    ) -> Result<LazyRef> {
        let x = self.fused(node, slot)?;
        if flat_bindings(&x) + extra <= self.options.max_bindings {
            return Ok(x);
        }
        let v = node.inputs[slot].expect("fused() checked the slot");
        self.materialize_value(v, x)
    }

    /// A cat (`lazy`) that one kernel would write over the budget, as
    /// slices of consecutive parts that each fit (each part does alone: it
    /// is a value that fusion kept within the budget); `None` for anything
    /// else.
    pub(crate) fn cat_slices(&self, lazy: &LazyRef) -> Option<Vec<CatSlice>> {
        let budget = self.options.max_bindings;
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
    /// stay within the budget; `label` names the op it lowers.
    pub(crate) fn check_budget(&self, label: &str, bindings: &[BufferIdx]) -> Result<()> {
        if bindings.len() > self.options.max_bindings {
            return Err(Error::internal(format!(
                "a `{label}` kernel binds {} storage buffers, over the budget of {}",
                bindings.len(),
                self.options.max_bindings
            )));
        }
        Ok(())
    }
}

/// The cat of `parts` along `dim`, of `whole`'s dtype.
fn cat_of(parts: &[LazyRef], dim: usize, whole: &LazyRef) -> LazyRef {
    let mut shape = whole.shape.clone();
    shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
    Lazy::new(whole.dtype, shape, Kind::Cat(parts.to_vec(), dim))
}

fn read_count(x: &Lazy) -> usize {
    let mut reads = vec![];
    x.buffers(&mut reads);
    reads.len()
}
