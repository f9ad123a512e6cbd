//! Epilogues: the pointwise chain that reads only a template's output (an
//! eval batch norm, an activation, a skip connection's add) computed in
//! the template's store, so it is no kernel of its own and the output
//! makes no round trip through memory.
//!
//! The chain's nodes are lowered ahead of their turn, as usual, over a
//! load of the buffer the store writes (the chain's end). The store rounds
//! the template's value to its dtype, as PyTorch stores it before the
//! chain reads it, and evaluates the chain with that load replaced by the
//! value ([`KernelBuilder::substitute_element`]).

use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::emit::{unravel, KernelBuilder};
use crate::preprocess::expr::{Kind, Lazy, LazyRef};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::cast;

/// `v`, a template's f32 value, rounded to `dtype` as PyTorch stores it
/// before anything reads it.
pub(super) fn rounded(v: &str, dtype: DType) -> String {
    cast(&format!("({v})"), DType::F32, dtype)
}

/// Where a template's store puts its value and what it computes first.
pub(super) struct Tail {
    /// The dtype of the template's own value.
    dtype: DType,
    /// The buffer the store writes: the template's output, or the end of
    /// the chain.
    pub out: BufferIdx,
    /// The chain's value, reading the template's as `out` at the element
    /// stored; none: the template's value is stored.
    chain: Option<LazyRef>,
}

/// The nodes after `node` (in order) that its store can compute, and the
/// buffers they read: each the sole reader of the one before, a float
/// unary or binary op or an eval batch norm of the output's shape and
/// dtype, its other inputs computed already (not reading `unwritten`,
/// buffers the same kernel writes); as many as a kernel reading `bound`
/// and binding `extra` buffers besides binds.
fn chain(
    lw: &Lowering,
    node: &Node,
    bound: &[BufferIdx],
    extra: usize,
    unwritten: &[BufferIdx],
) -> (Vec<usize>, Vec<BufferIdx>) {
    let Some(&first) = node.outputs.first() else {
        return (vec![], vec![]);
    };
    let info = lw.graph.value(first);
    if !info.dtype.is_float() {
        return (vec![], vec![]);
    }
    let (mut reads, mut checks) = (vec![], false);
    let (mut cur, mut found, mut size) = (first, vec![], 0);
    while let Some((n, next)) = lw.sole_reader(cur) {
        let fits = match &next.op {
            Op::Unary(_) => true,
            Op::Binary(b) => !b.is_predicate(),
            Op::BatchNorm { .. } => next.inputs.first() == Some(&Some(cur)),
            _ => false,
        };
        let Some(&y) = next.outputs.first() else {
            break;
        };
        let out = lw.graph.value(y);
        if !fits || next.outputs.len() != 1 || out.dtype != info.dtype || out.shape != info.shape {
            break;
        }
        let (mut more, mut more_checks) = (reads.clone(), checks);
        // (a batch norm's per-channel expression is about 20 tree nodes)
        let mut more_size = size + 1 + 20 * usize::from(matches!(next.op, Op::BatchNorm { .. }));
        let others = next.inputs.iter().flatten().filter(|&&v| v != cur);
        let mut ready = true;
        for &v in others {
            match lw.value(v) {
                Ok(x) => {
                    let mut read = vec![];
                    x.buffers(&mut read);
                    ready &= !read.iter().any(|b| unwritten.contains(b));
                    x.buffers(&mut more);
                    more_checks |= x.has_checks();
                    more_size += x.size() + 1;
                }
                Err(_) => ready = false,
            }
        }
        let mut all = bound.to_vec();
        all.extend(more.iter().filter(|b| !bound.contains(b)));
        // the kernel binds its output and a status buffer for checks too
        let bindings = all.len() + extra + 1 + usize::from(more_checks);
        if !ready || bindings > lw.options.max_bindings || more_size > lw.options.max_fused_size {
            break;
        }
        (reads, checks, size) = (more, more_checks, more_size);
        found.push(n);
        cur = y;
    }
    (found, reads)
}

/// The buffers the longest epilogue of `node` reads (a bound for a kernel
/// that will compute it).
pub(super) fn reads(lw: &Lowering, node: &Node) -> Vec<BufferIdx> {
    chain(lw, node, &[], 0, &[]).1
}

impl Tail {
    /// The epilogue of `node`'s output 0, whose kernel reads `bound`,
    /// binds `extra` buffers besides and writes `unwritten`: its chain
    /// ([`chain`]) is lowered now and the chain's end is the buffer stored.
    pub(super) fn plan(
        lw: &mut Lowering,
        node: &Node,
        bound: &[BufferIdx],
        extra: usize,
        unwritten: &[BufferIdx],
    ) -> Result<Tail> {
        let (_, dtype, shape) = lw.output_info(node, 0)?;
        let (nodes, _) = chain(lw, node, bound, extra, unwritten);
        let Some(&last) = nodes.last() else {
            return Tail::none(lw, node);
        };
        let graph = lw.graph;
        let end = &graph.nodes[last];
        let out = lw.output_buffer(end, 0)?;
        let dispatched = lw.dispatches.len();
        lw.define(node.outputs[0], Lazy::new(dtype, shape, Kind::Load(out)));
        for &n in &nodes {
            lw.lower_ahead(n)?;
        }
        let value = lw.value(end.outputs[0])?;
        lw.define(end.outputs[0], lw.load(out));
        // (the chain fits one kernel, so fusion wrote none of it out)
        if lw.dispatches[dispatched..]
            .iter()
            .any(|d| d.buffers.contains(&out))
        {
            return Err(Error::internal(format!(
                "the epilogue of `{}` was written out before the store",
                node.name
            )));
        }
        Ok(Tail {
            dtype,
            out,
            chain: Some(value),
        })
    }

    /// No epilogue: `node`'s output 0 is stored as it is.
    pub(super) fn none(lw: &mut Lowering, node: &Node) -> Result<Tail> {
        let (_, dtype, _) = lw.output_info(node, 0)?;
        Ok(Tail {
            dtype,
            out: lw.output_buffer(node, 0)?,
            chain: None,
        })
    }

    /// The buffer of a template without a chain and `v` (an f32 value)
    /// rounded to its dtype: for a store that substitutes its loads rather
    /// than writing it (`glu.rs`).
    pub(super) fn substituted(&self, v: &str) -> Result<(BufferIdx, String)> {
        if self.chain.is_some() {
            return Err(Error::internal("a substituted store with an epilogue"));
        }
        Ok((self.out, rounded(v, self.dtype)))
    }

    /// The buffers the chain reads besides the one stored.
    pub(super) fn buffers(&self, bufs: &mut Vec<BufferIdx>) {
        let mut read = vec![];
        if let Some(chain) = &self.chain {
            chain.buffers(&mut read);
        }
        for b in read {
            if b != self.out && !bufs.contains(&b) {
                bufs.push(b);
            }
        }
    }

    /// WGSL storing the f32 value `v` of the template's output element `e`
    /// (a flat u32 index): module-scope declarations, and the statements;
    /// its names end in `tag` (several stores of one kernel).
    pub(super) fn store(
        &self,
        kb: &mut KernelBuilder,
        e: &str,
        v: &str,
        tag: &str,
    ) -> Result<(String, String)> {
        let value = rounded(v, self.dtype);
        let Some(chain) = &self.chain else {
            return Ok((String::new(), kb.store(self.out, e, &value)?));
        };
        let (var, f) = (format!("gepi{tag}"), format!("vepi{tag}"));
        kb.substitute_element(self.out, &var);
        kb.value_fn(chain, &f)?;
        let at = unravel(e, &chain.shape).join(", ");
        let store = kb.store(self.out, e, &format!("{f}({at})"))?;
        Ok((
            format!("var<private> {var}: f32;\n\n"),
            format!("{var} = {value};\n  {store}"),
        ))
    }
}
