//! In-place ATen ops, as `torch.export.export` leaves them when the program
//! is saved without `run_decompositions` (`relu_` of torchvision's
//! `ReLU(inplace=True)`, `index_copy_` or slice assignment into a KV-cache
//! buffer): each is lowered as its functional form, and its result becomes
//! the new value of the tensor it wrote, as ExecuTorch's functionalization
//! does. A write through a `slice`/`select` view is scattered back into the
//! view's base; names that alias the written tensor follow it; views whose
//! data the write changed, and bases written through a view etmetal cannot
//! invert (`view`, `permute`, …), become stale: reading one is an error, not
//! an outdated value. A graph input written this way becomes a mutation
//! output (see [`Lowerer::mutation_outputs`]).

use std::collections::{HashMap, HashSet};

use etmetal_core::{op_table, Error, Op, Result};

use super::{Bound, Ctx, Lowerer};
use crate::ir::{InputKind, OutputKind, ValueId};

/// How a source name views the memory of another (its base).
#[derive(Clone)]
pub(super) enum Link {
    /// The same tensor: an in-place op's result, `alias`, `detach`.
    Same,
    /// A region that a write can be sent back through.
    Slice {
        dim: usize,
        start: usize,
        end: usize,
        step: usize,
    },
    Select {
        dim: usize,
        index: usize,
    },
    /// An `as_strided` view with no element twice: the storage position of
    /// each of its elements.
    Strided(Vec<i64>),
    /// A view etmetal does not invert (the op's target).
    Opaque(String),
}

#[derive(Clone)]
pub(super) struct View {
    base: String,
    link: Link,
}

/// Aliasing views by the name of the view.
pub(super) type Views = HashMap<String, View>;

/// ATen ops whose outputs may share their input's memory and are not
/// [`Link::Same`], `Slice` or `Select`.
const OPAQUE_VIEWS: &[&str] = &[
    "view",
    "_unsafe_view",
    "reshape",
    "_reshape_alias",
    "contiguous",
    "flatten",
    "unflatten",
    "permute",
    "transpose",
    "t",
    "swapaxes",
    "swapdims",
    "numpy_T",
    "mT",
    "mH",
    "movedim",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "broadcast_to",
    "view_as",
    "reshape_as",
    "unfold",
    "diagonal",
    "split",
    "split_with_sizes",
    "tensor_split",
    "chunk",
    "unbind",
    "hsplit",
    "vsplit",
    "view_as_real",
    "view_as_complex",
    "real",
    "imag",
];

/// `torch.ops.aten.relu_.default` → `torch.ops.aten.relu.default`: the
/// functional target of an in-place ATen target, `None` for other targets.
pub(crate) fn functional_target(target: &str) -> Option<String> {
    let short = target.strip_prefix("torch.ops.aten.")?;
    let (name, overload) = short.split_once('.').unwrap_or((short, "default"));
    let base = op_table::functional_aten(name)?;
    Some(format!("torch.ops.aten.{base}.{overload}"))
}

/// The op name of an ATen target (`slice` of `torch.ops.aten.slice.Tensor`).
fn op_name(target: &str) -> &str {
    let short = target.strip_prefix("torch.ops.aten.").unwrap_or(target);
    short.split_once('.').map_or(short, |(n, _)| n)
}

impl Lowerer<'_> {
    /// After node `c` is lowered: record the views it made, and when it is
    /// an in-place op (lowered as its functional form), make its result the
    /// new value of what it wrote.
    pub(super) fn track_aliases(&mut self, c: &Ctx, in_place: bool) -> Result<()> {
        let link = if in_place {
            Some(Link::Same)
        } else {
            let last = self.graph.nodes.last().map(|n| &n.op);
            match (op_name(&c.target), last) {
                ("alias" | "detach", _) => Some(Link::Same),
                (
                    "slice" | "narrow",
                    Some(&Op::Slice {
                        dim,
                        start,
                        end,
                        step,
                    }),
                ) => Some(Link::Slice {
                    dim,
                    start,
                    end,
                    step,
                }),
                ("select", Some(&Op::Select { dim, index })) => Some(Link::Select { dim, index }),
                ("to" | "type_as", Some(Op::Identity)) if self.returns_self(c)? => Some(Link::Same),
                ("as_strided", _) => Some(self.strided_link(c)?),
                (name, _) if OPAQUE_VIEWS.contains(&name) => Some(Link::Opaque(c.target.clone())),
                _ => None,
            }
        };
        let Some(link) = link else { return Ok(()) };
        let Some(self_name) = c.args.tensor_name("self")?.map(str::to_string) else {
            return Err(Error::format(format!(
                "node `{}` ({}) views or writes no `self` tensor",
                c.name, c.target
            )));
        };
        let outputs: Vec<String> = c.outputs.iter().flatten().cloned().collect();
        for out in &outputs {
            self.views.insert(
                out.clone(),
                View {
                    base: self_name.clone(),
                    link: link.clone(),
                },
            );
        }
        if in_place {
            let Some(out) = outputs.first() else {
                return Err(Error::format(format!(
                    "in-place node `{}` has no output",
                    c.name
                )));
            };
            let new = self.lookup(out)?;
            self.write(c, &self_name, new)?;
        }
        Ok(())
    }

    /// `name` now holds `new`: send it up through the views `name` is a
    /// region of, then update or retire every other name aliasing them.
    pub(super) fn write(&mut self, c: &Ctx, name: &str, new: ValueId) -> Result<()> {
        self.names.insert(name.to_string(), Bound::Value(new));
        let mut written = vec![name.to_string()];
        let (mut at, mut value) = (name.to_string(), new);
        while let Some(View { base, link }) = self.views.get(&at).cloned() {
            value = match link {
                Link::Same => value,
                Link::Slice {
                    dim,
                    start,
                    end,
                    step,
                } => {
                    let old = self.lookup(&base)?;
                    self.slice_scatter(c, old, value, dim, (start, end, step))?
                }
                Link::Select { dim, index } => {
                    let old = self.lookup(&base)?;
                    self.select_scatter(c, old, value, dim, index)?
                }
                Link::Strided(index) => {
                    let old = self.lookup(&base)?;
                    self.strided_scatter(c, old, value, &index)?
                }
                Link::Opaque(target) => {
                    written.extend(self.retire_upwards(&base, &at, &target));
                    break;
                }
            };
            self.names.insert(base.clone(), Bound::Value(value));
            written.push(base.clone());
            at = base;
        }
        self.follow_written(&written, name);
        Ok(())
    }

    /// Whether a conversion (`to`, `type_as`) that changes no dtype gives
    /// its input itself, as PyTorch's does unless asked to copy or to change
    /// the memory format of a tensor not already in it: a write into the
    /// result then writes the input (transformers' `initial_state.to(value)`
    /// of a cache's recurrent state, written back with `copy_`).
    fn returns_self(&self, c: &Ctx) -> Result<bool> {
        if c.args.bool("copy", false)? {
            return Ok(false);
        }
        // torch.export's serde numbers memory formats: 1 contiguous, 4 preserve
        Ok(match c.args.get("memory_format")? {
            None => true,
            Some(("as_memory_format", v)) => match v.as_i64() {
                Some(4) => true,
                Some(1) => c
                    .args
                    .tensor_name("self")?
                    .is_some_and(|n| self.contiguous.contains(n)),
                _ => false,
            },
            Some(_) => false,
        })
    }

    /// How an `as_strided` node's result views its input: strided when no
    /// element repeats; else opaque, since a write to one element would
    /// show at several.
    fn strided_link(&self, c: &Ctx) -> Result<Link> {
        let name = c.args.tensor_name("self")?.unwrap_or_default();
        let len = self
            .meta
            .get(name)
            .map_or(Ok(0), |(_, shape)| etmetal_core::shape::numel(shape))?;
        let index = self.strided_index(c, len)?;
        let mut seen = std::collections::HashSet::new();
        Ok(if index.iter().all(|i| seen.insert(*i)) {
            Link::Strided(index)
        } else {
            Link::Opaque(format!(
                "{}, whose strides overlap: a write to one element shows at several",
                c.target
            ))
        })
    }

    /// A write went through `view` (made by `target`) of `base`:
    /// `base` and everything it views hold data etmetal cannot compute.
    /// Returns the names retired.
    fn retire_upwards(&mut self, base: &str, view: &str, target: &str) -> Vec<String> {
        let reason = format!(
            "an in-place write through `{view}` ({target}), a view etmetal cannot send the \
             write back through to `{base}`; save the program after \
             `ep.run_decompositions({{}})`, which makes such writes functional"
        );
        let mut retired = vec![];
        let mut at = Some(base.to_string());
        while let Some(n) = at {
            self.names.insert(n.clone(), Bound::Stale(reason.clone()));
            at = self.views.get(&n).map(|v| v.base.clone());
            retired.push(n);
        }
        retired
    }

    /// After a write that changed every name in `written` (the written
    /// name, the bases it views, any retired ones): names that are the same
    /// tensor as one of them take its new value, other views of them (and
    /// aliases of retired ones) go stale.
    fn follow_written(&mut self, written: &[String], name: &str) {
        let written: HashSet<&String> = written.iter().collect();
        let mut updates = vec![];
        for view in self.views.keys() {
            if written.contains(view) {
                continue;
            }
            let (mut at, mut same) = (view, true);
            while let Some(v) = self.views.get(at) {
                same &= matches!(v.link, Link::Same);
                at = &v.base;
                if written.contains(at) {
                    updates.push((view.clone(), same.then(|| at.clone())));
                    break;
                }
            }
        }
        for (view, same_as) in updates {
            let bound = match same_as.map(|s| self.names.get(&s)) {
                Some(Some(Bound::Value(v))) => Bound::Value(*v),
                _ => Bound::Stale(format!(
                    "an in-place write to `{name}`, which changed the tensor `{view}` views"
                )),
            };
            self.names.insert(view, bound);
        }
    }

    /// Source name `name` is the graph input `base` under another name
    /// (one tensor in eager): it reads `base`'s value, and a write through
    /// either is a write of both.
    pub(crate) fn alias_input(&mut self, name: &str, base: &str) -> Result<()> {
        let id = self.lookup(base)?;
        self.names.insert(name.to_string(), Bound::Value(id));
        self.views.insert(
            name.to_string(),
            View {
                base: base.to_string(),
                link: Link::Same,
            },
        );
        Ok(())
    }

    /// Graph inputs `a` and `b` share part of one storage: eager would see
    /// a write to one in the other, which the separate values do not, so
    /// [`Self::mutation_outputs`] refuses a write to either.
    pub(crate) fn note_overlap(&mut self, a: &str, b: &str) {
        self.overlaps.push((a.to_string(), b.to_string()));
    }

    /// Mutation outputs for the graph inputs that in-place ops wrote (as a
    /// functional export's signature lists them). A written lifted
    /// constant becomes a (non-persistent) buffer: a non-strict export
    /// lifts as constants the tensors a module holds other than as
    /// attributes, such as a cache object's, and eager keeps what the
    /// graph writes into them for the next call, as it does a buffer's.
    /// An error for a written parameter, a written input that shares
    /// storage with another, or an input left stale.
    pub(crate) fn mutation_outputs(&mut self) -> Result<Vec<(ValueId, OutputKind)>> {
        let written = |me: &Self, name: &str| {
            me.graph
                .inputs
                .iter()
                .zip(&me.placeholders)
                .find(|(_, n)| n.as_str() == name)
                .is_some_and(
                    |((id, _), _)| !matches!(me.names.get(name), Some(Bound::Value(v)) if v == id),
                )
        };
        for (a, b) in &self.overlaps {
            if let Some(w) = [a, b].into_iter().find(|n| written(self, n)) {
                return Err(Error::unsupported(format!(
                    "an in-place op writes graph input `{w}`, whose data overlaps `{}` in \
                     one storage of the archive (a view of the other): etmetal keeps them \
                     as separate tensors, so the write would not show in the other as in eager",
                    if w == a { b } else { a }
                )));
            }
        }
        let mut out = vec![];
        for ((id, kind), name) in self.graph.inputs.iter_mut().zip(&self.placeholders) {
            let now = match self.names.get(name) {
                Some(Bound::Value(v)) if v == id => continue,
                Some(Bound::Value(v)) => *v,
                Some(Bound::Stale(reason)) => {
                    return Err(Error::unsupported(format!(
                        "graph input `{name}` is left unknown by {reason}"
                    )))
                }
                _ => continue,
            };
            out.push((
                now,
                match kind {
                    InputKind::Buffer { fqn, .. } => {
                        OutputKind::BufferMutation { fqn: fqn.clone() }
                    }
                    InputKind::User => OutputKind::UserInputMutation {
                        input_name: name.clone(),
                    },
                    InputKind::Constant { fqn } => {
                        let fqn = fqn.clone();
                        *kind = InputKind::Buffer {
                            fqn: fqn.clone(),
                            persistent: false,
                        };
                        OutputKind::BufferMutation { fqn }
                    }
                    InputKind::Parameter { fqn } => {
                        return Err(Error::unsupported(format!(
                            "an in-place op writes parameter `{fqn}`: only buffers and \
                             lifted constants keep state (register it as a buffer)"
                        )))
                    }
                },
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_targets_name_their_functional_form() {
        let f = |t: &str| functional_target(t);
        assert_eq!(
            f("torch.ops.aten.relu_.default").as_deref(),
            Some("torch.ops.aten.relu.default")
        );
        assert_eq!(
            f("torch.ops.aten.index_put_.default").as_deref(),
            Some("torch.ops.aten.index_put.default")
        );
        assert_eq!(
            f("torch.ops.aten.add_.Tensor").as_deref(),
            Some("torch.ops.aten.add.Tensor")
        );
        assert_eq!(f("torch.ops.aten.__and__.Tensor"), None);
        assert_eq!(f("torch.ops.aten.relu.default"), None);
        assert_eq!(f("torch.ops.aten._.default"), None);
        assert_eq!(f("torch.ops.other.relu_.default"), None);
    }
}
