//! MetalBackend preprocess: one partition of a graph → a delegate
//! [`Payload`](crate::payload::Payload) (kernels, buffers, dispatch plan)
//! and the named data of its weights.
//!
//! Lowering walks the partition's nodes in order. Pointwise and layout ops
//! build [`expr::Lazy`] values (fused into whatever reads them); every
//! other op is a kernel template in [`kernels`] that reads its inputs
//! through lazy values and writes a buffer. A lazy value is *materialised*
//! (a flat kernel writes it to a buffer) when a template needs more than a
//! view of it, when several nodes read it, when it is a partition output,
//! or when inlining it would bind too many buffers (`budget`). Then arena
//! ranges are planned by lifetime, and each kernel is validated by naga
//! and translated to MSL.
//!
//! Layout, one way down: this module is the driver (the walk over the
//! nodes, which node becomes an expression and which goes to a template,
//! the deferred work at the end). `kernels` holds the templates (the GEMM
//! family in `kernels::gemm`); they record into the lowering context
//! (`lowering`: buffers, values, dispatches, the work waiting in
//! `deferred`), which names no template: where it finds deferred work due
//! or a node to lower ahead of its turn, it calls the driver's functions
//! ([`lowering::Driver`]). Below them: `options` (what a call takes),
//! `budget` (the binding rule), `coopmat` (the tensor-core primitives),
//! `expr` the lazy values, `pointwise` and `emit` the WGSL of expressions
//! and kernels, `sizes` the run-time sizes, `buffers` the buffer types,
//! `arena` the memory plan, `validate` the naga pass. Which ops become
//! expressions and which go to which template is `crate::op_table`, which
//! the partitioner reads too, so neither of the two imports the other for
//! it.

mod arena;
mod budget;
pub(crate) mod buffers;
pub(crate) mod coopmat;
mod deferred;
pub(crate) mod emit;
pub(crate) mod expr;
mod kernels;
mod lowering;
mod options;
pub(crate) mod pointwise;
pub(crate) mod sizes;
mod validate;

use etmetal_core::sym::SymExpr;
use etmetal_core::{BinaryOp, Error, Op, Result};
use etmetal_graph::{Graph, Node};

use crate::partitioner::Partition;
pub use coopmat::CoopForm;
use expr::{Kind, Lazy, LazyRef};
pub use kernels::GEMM_COOP_VARIANTS;
pub use lowering::Preprocessed;
use lowering::{Driver, Lowering};
pub use options::{Boundary, PreprocessOptions, ResidentBuffer};

/// The driver's part of lowering, which the context calls back.
const DRIVER: Driver = Driver {
    lower_node,
    row_mean: kernels::row_mean,
    scatter: kernels::scatter,
};

/// Compile `partition` of `graph` (decomposed as the partitioner saw it),
/// with the default [`Boundary`].
pub fn preprocess(
    graph: &Graph,
    partition: &Partition,
    options: &PreprocessOptions,
) -> Result<Preprocessed> {
    preprocess_with(graph, partition, options, &Boundary::default())
}

/// Compile `partition` of `graph` within `boundary`.
pub fn preprocess_with(
    graph: &Graph,
    partition: &Partition,
    options: &PreprocessOptions,
    boundary: &Boundary,
) -> Result<Preprocessed> {
    // A mutated buffer is an input of the partition and its new value an
    // output (the partitioner never takes it as a weight): the method keeps
    // the state and writes it back after the chain, unless it is resident.
    let mut lw = Lowering::new(graph, partition, options, boundary, DRIVER)?;
    for &n in &partition.nodes {
        let node = graph
            .nodes
            .get(n)
            .ok_or_else(|| Error::internal(format!("partition {} lists node {n}", partition.id)))?;
        if lw.is_absorbed(n) {
            lw.consume(node);
            continue;
        }
        lower_node(&mut lw, node).map_err(|e| {
            e.context(format!(
                "node `{}` ({}, {})",
                node.name,
                node.op.name(),
                node.target
            ))
        })?;
    }
    // the row writes still waiting, then a row mean that is a partition
    // output (no kernel read it)
    lw.flush_scatters()?;
    for &v in &partition.outputs {
        let mut read = vec![];
        lw.value(v)?.buffers(&mut read);
        lw.dispatch_row_means(&read)?;
    }
    let mut pre = lw.finish()?;
    let mut outputs = partition.outputs.clone();
    for r in boundary.resident {
        let input = partition.inputs.iter().position(|&v| v == r.buffer);
        let output = outputs.iter().position(|&v| v == r.new_value);
        let (Some(input), Some(output)) = (input, output) else {
            return Err(Error::internal(format!(
                "state `{}` is not an input and output of partition {}",
                r.fqn,
                partition.tag()
            )));
        };
        outputs.remove(output);
        pre.payload.keep_resident(&r.fqn, input, output)?;
    }
    Ok(pre)
}

/// Lower one node: an expression op becomes a lazy value fused into its
/// readers, any other goes to its kernel template.
fn lower_node(lw: &mut Lowering, node: &Node) -> Result<()> {
    lw.set_op_label(node.op.name());
    let out = node
        .outputs
        .first()
        .copied()
        .ok_or_else(|| Error::internal("node has no outputs"))?;
    let (_, dtype, shape) = lw.output_info(node, 0)?;
    let broadcast = |x: LazyRef| -> LazyRef {
        if x.shape == shape {
            x
        } else {
            Lazy::new(x.dtype, shape.clone(), Kind::Expand(x))
        }
    };
    let kind = match &node.op {
        Op::Unary(u) => Some(Kind::Unary(*u, lw.fused(node, 0)?)),
        Op::Binary(b) => {
            let a = lw.fused(node, 0)?;
            let c = lw.fused(node, 1)?;
            let (ia, ib) = (
                lw.graph.value(node.inputs[0].unwrap()),
                lw.graph.value(node.inputs[1].unwrap()),
            );
            let compute = if b.is_predicate() {
                etmetal_graph::infer::result_type(ia, ib)
            } else {
                dtype
            };
            // an integer plus 0 (`arange(1) + pos`, a decode step's
            // positions) is the integer: no overflow check to bind
            let add = matches!(b, BinaryOp::Add | BinaryOp::Sub);
            match (add && !compute.is_float(), a.is_zero(), c.is_zero()) {
                (true, _, true) => Some(Kind::Cast(broadcast(a))),
                (true, true, _) if *b == BinaryOp::Add => Some(Kind::Cast(broadcast(c))),
                _ => Some(Kind::Binary {
                    op: *b,
                    compute,
                    a: broadcast(a),
                    b: broadcast(c),
                }),
            }
        }
        Op::Where => Some(Kind::Where(
            broadcast(lw.fused(node, 0)?),
            broadcast(lw.fused(node, 1)?),
            broadcast(lw.fused(node, 2)?),
        )),
        Op::Cast { .. } | Op::Identity => Some(Kind::Cast(lw.fused(node, 0)?)),
        Op::Reshape { .. } => Some(Kind::Reshape(lw.fused(node, 0)?)),
        Op::Permute { dims } => Some(Kind::Permute(lw.fused(node, 0)?, dims.clone())),
        Op::Expand { .. } => Some(Kind::Expand(lw.fused(node, 0)?)),
        Op::Slice {
            dim, start, step, ..
        } => Some(Kind::Slice {
            x: lw.fused(node, 0)?,
            dim: *dim,
            start: position(lw, node, *dim, *start, true)?,
            step: *step,
        }),
        Op::Select { dim, index } => Some(Kind::Select {
            x: lw.fused(node, 0)?,
            dim: *dim,
            index: position(lw, node, *dim, *index, false)?,
        }),
        Op::Repeat { .. } => Some(Kind::Repeat(lw.fused(node, 0)?)),
        Op::Cat { dim } => {
            let parts = (0..node.inputs.len())
                .map(|i| lw.fused(node, i))
                .collect::<Result<Vec<_>>>()?;
            Some(Kind::Cat(parts, *dim))
        }
        Op::ConstantPad { pad, value } => {
            let x = lw.fused(node, 0)?;
            let rank = x.shape.len();
            let mut before = vec![0i64; rank];
            for (k, pair) in pad.chunks(2).enumerate() {
                before[rank - 1 - k] = pair[0];
            }
            Some(Kind::Pad {
                x,
                before,
                value: *value,
            })
        }
        Op::Triangle { upper, diagonal } => Some(Kind::Triangle {
            x: lw.fused(node, 0)?,
            upper: *upper,
            diagonal: *diagonal,
        }),
        Op::Full { value, .. } => Some(Kind::Literal(*value)),
        Op::Arange { start, step, .. } => Some(Kind::Iota {
            start: *start,
            step: *step,
        }),
        Op::Embedding => Some(Kind::Gather {
            src: lw.fused(node, 0)?,
            dim: 0,
            index: lw.fused(node, 1)?,
            at: expr::GatherAt::Leading,
            len: dim_len(lw, node, 0)?,
        }),
        Op::IndexSelect { dim } => Some(Kind::Gather {
            src: lw.fused(node, 0)?,
            dim: *dim,
            index: lw.fused(node, 1)?,
            at: expr::GatherAt::Dim,
            len: dim_len(lw, node, *dim)?,
        }),
        Op::Gather { dim } => Some(Kind::Gather {
            src: lw.fused(node, 0)?,
            dim: *dim,
            index: lw.fused(node, 1)?,
            at: expr::GatherAt::Same,
            len: dim_len(lw, node, *dim)?,
        }),
        _ => None,
    };
    match kind {
        Some(kind) => {
            let lazy = Lazy::of_node(dtype, shape, kind, &node.name);
            if lw.split_inputs(node, &lazy)? {
                // its inputs are buffers now: fuse it over them
                return lower_node(lw, node);
            }
            lw.define_fused(out, lazy)?;
        }
        None => kernels::lower(lw, node)?,
    }
    lw.consume(node);
    Ok(())
}

/// The size of dim `dim` of `node`'s input 0: at run time where dynamic.
fn dim_len(lw: &Lowering, node: &Node, dim: usize) -> Result<expr::Pos> {
    let x = node.inputs[0].ok_or_else(|| Error::internal("no input 0"))?;
    let e = lw.sizes.local(&lw.graph.sym_dims(x))[dim].clone();
    Ok(match e.as_const() {
        Some(n) => expr::Pos::At(n as usize),
        None => expr::Pos::Run(lw.sizes.size(&e)?),
    })
}

/// Where a slice (`slice`: its start, clamped into the dim) or a select
/// of `node` starts along `dim`: the op's own `at`, or, where the
/// program counts it from the end of a dynamic dim, that count at run
/// time.
fn position(lw: &Lowering, node: &Node, dim: usize, at: usize, slice: bool) -> Result<expr::Pos> {
    let args = node.outputs.first().and_then(|o| lw.graph.sym.args.get(o));
    let (Some(args), Some(x)) = (args, node.inputs.first().copied().flatten()) else {
        return Ok(expr::Pos::At(at));
    };
    let size = lw.sizes.local(&lw.graph.sym_dims(x))[dim].clone();
    let arg = args.first().cloned().unwrap_or(SymExpr::Const(0));
    let (lo, hi) = arg.bounds(&lw.graph.sym.ranges)?;
    let from_start = match (lo >= 0, hi < 0) {
        (true, _) => arg,
        (_, true) => size.clone() + arg,
        _ => {
            return Err(Error::unsupported(format!(
                "{} at `{arg}`, which may count from either end",
                node.op.name()
            )))
        }
    };
    let from_start = match slice {
        true => SymExpr::max(SymExpr::Const(0), SymExpr::min(from_start, size)),
        false => from_start,
    };
    let local = lw.sizes.local(std::slice::from_ref(&from_start));
    Ok(expr::Pos::Run(lw.sizes.size(&local[0])?))
}
