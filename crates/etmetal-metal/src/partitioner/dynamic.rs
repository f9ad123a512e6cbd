//! Which nodes of dynamic shape (`torch.export.Dim`) the GPU takes.
//!
//! A GPU buffer keeps the layout of its upper bound (`preprocess::sizes`),
//! so a kernel is right at any size when each valid output element reads
//! only valid input elements at the positions it reads at the bound. That
//! holds for elementwise ops, views (a slice, select or gather counting
//! from a dynamic end reads the size at run time), rows over static dims,
//! reductions (past a dynamic end they read their identity; a mean's
//! divisor would be the bound), products
//! contracting a static dim, convolution and pooling over a dynamic batch,
//! and attention over a static number of keys (or causal attention over
//! as many keys as queries, where a valid query never reaches a key past
//! the actual length). Everything else stays on the CPU, whose kernels
//! take the actual sizes; the reason names the op and the dynamic dim.

use etmetal_core::sym::SymExpr;
use etmetal_core::{Op, ReduceOp};
use etmetal_graph::{Graph, Node, ValueId};

use crate::op_table::{form, Form};

/// `Err` with the reason when `node` touches a dynamic value in a way the
/// bound layout does not keep right.
pub(super) fn dynamic_supported(graph: &Graph, node: &Node) -> Result<(), String> {
    let touches = node
        .inputs
        .iter()
        .flatten()
        .chain(&node.outputs)
        .any(|&v| graph.is_dynamic(v));
    if !touches {
        return Ok(());
    }
    let name = node.op.name();
    let dims = |v: Option<&ValueId>| v.map(|&v| graph.sym_dims(v)).unwrap_or_default();
    let x = dims(node.inputs.first().and_then(Option::as_ref));
    let y = dims(node.outputs.first());
    // the first dynamic dim among `ds` of `x`, for the reason
    let dynamic_at = |x: &[SymExpr], ds: &mut dyn Iterator<Item = usize>| {
        ds.filter_map(|d| x.get(d))
            .find(|e| e.as_const().is_none())
            .cloned()
    };
    let refuse = |what: &str, e: &SymExpr| Err(format!("dynamic shape: {name} {what} `{e}`"));
    let dynamic_input = node.inputs.iter().flatten().any(|&v| graph.is_dynamic(v));
    if !dynamic_input {
        // (a GPU partition reads its sizes from the dims of its inputs)
        let e = dynamic_at(&y, &mut (0..y.len())).unwrap_or(SymExpr::Const(0));
        return refuse(
            "makes a value of dynamic size from no dynamic input: dim",
            &e,
        );
    }
    // (a slice or select counting from a dynamic end reads the size at run time)
    let counted = matches!(node.op, Op::Slice { .. } | Op::Select { .. });
    if let (Some(out), false) = (node.outputs.first(), counted) {
        if graph.sym.args.contains_key(out) {
            let e = dynamic_at(&x, &mut (0..x.len())).unwrap_or(SymExpr::Const(0));
            return refuse("counts from the end of dynamic dim", &e);
        }
    }
    match &node.op {
        Op::Reshape { .. } => {
            let with_bounds = |v: Option<&ValueId>, ds: &[SymExpr]| -> Vec<(SymExpr, usize)> {
                let bounds = v.map(|&v| graph.value(v).shape.clone()).unwrap_or_default();
                ds.iter().cloned().zip(bounds).collect()
            };
            let (bx, by) = (
                with_bounds(node.inputs.first().and_then(Option::as_ref), &x),
                with_bounds(node.outputs.first(), &y),
            );
            match bound_reshape(&bx, &by) {
                Some(e) => refuse("regroups the dims around dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::Cat { .. } | Op::Repeat { .. } => match placed_dynamic(graph, node) {
            Some(e) => refuse("places parts along dynamic dim", &e),
            None => Ok(()),
        },
        Op::ConstantPad { pad, .. } => {
            let r = x.len();
            let padded = (0..pad.len() / 2).map(|k| r - 1 - k);
            match dynamic_at(&x, &mut padded.into_iter()) {
                Some(e) => refuse("pads dynamic dim", &e),
                None => Ok(()),
            }
        }
        // (a gather counts negative indices back from the run-time size)
        Op::IndexSelect { .. } | Op::Gather { .. } => Ok(()),
        // (the rows written are the index's run-time count)
        Op::IndexCopy { .. } => Ok(()),
        // (past the run-time size a reduction reads its identity)
        Op::Reduce { op, .. } if *op != ReduceOp::Mean => Ok(()),
        Op::Reduce { dims: ds, .. } | Op::Var { dims: ds, .. } => {
            let all: Vec<usize> = if ds.is_empty() {
                (0..x.len()).collect()
            } else {
                ds.clone()
            };
            match dynamic_at(&x, &mut all.into_iter()) {
                Some(e) => refuse("reduces over dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::ArgReduce { dim, .. } => {
            let all: Vec<usize> = dim.map_or_else(|| (0..x.len()).collect(), |d| vec![d]);
            match dynamic_at(&x, &mut all.into_iter()) {
                Some(e) => refuse("reduces over dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::ReduceWithIndices { dim, .. } | Op::Softmax { dim, .. } => {
            match dynamic_at(&x, &mut std::iter::once(*dim)) {
                Some(e) => refuse("reduces over dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::LayerNorm {
            normalized_dims: n, ..
        }
        | Op::RmsNorm {
            normalized_dims: n, ..
        } => match dynamic_at(&x, &mut (x.len().saturating_sub(*n)..x.len())) {
            Some(e) => refuse("normalizes over dynamic dim", &e),
            None => Ok(()),
        },
        Op::BatchNorm { .. } | Op::GroupNorm { .. } => match dynamic_at(&x, &mut (1..x.len())) {
            Some(e) => refuse("normalizes over dynamic dim", &e),
            None => Ok(()),
        },
        Op::MatMul | Op::Linear => {
            // `a @ b`, `x @ w.T`: the contracted dim is a's last
            match dynamic_at(&x, &mut (x.len().saturating_sub(1)..x.len())) {
                Some(e) => refuse("contracts dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::Addmm { .. } => {
            let a = dims(node.inputs.get(1).and_then(Option::as_ref));
            match dynamic_at(&a, &mut (1..2)) {
                Some(e) => refuse("contracts dynamic dim", &e),
                None => Ok(()),
            }
        }
        Op::Convolution(_) | Op::MaxPool(_) | Op::AvgPool(_) | Op::AdaptiveAvgPool { .. } => {
            let w = dims(node.inputs.get(1).and_then(Option::as_ref));
            let weight = matches!(node.op, Op::Convolution(_))
                .then(|| dynamic_at(&w, &mut (0..w.len())))
                .flatten();
            match weight.or_else(|| dynamic_at(&x, &mut (1..x.len()))) {
                Some(e) => refuse("over dynamic dim (only the batch may be dynamic)", &e),
                None => Ok(()),
            }
        }
        Op::Sdpa { is_causal, .. } => {
            let (q, k) = (x, dims(node.inputs.get(1).and_then(Option::as_ref)));
            let keys = k.len().saturating_sub(2);
            let masked = node.inputs.get(3).is_some_and(Option::is_some);
            match dynamic_at(&k, &mut std::iter::once(keys)) {
                // causal over as many keys as queries: a valid query's keys are valid
                Some(e) if *is_causal && !masked && q.get(keys) == Some(&e) => Ok(()),
                Some(e) => refuse("attends over a dynamic number of keys", &e),
                None => Ok(()),
            }
        }
        op => match form(op) {
            Some(Form::Expression) => Ok(()),
            _ => {
                let e = dynamic_at(&x, &mut (0..x.len()))
                    .or_else(|| dynamic_at(&y, &mut (0..y.len())))
                    .unwrap_or(SymExpr::Const(0));
                refuse("has no GPU kernel of run-time size; dynamic dim", &e)
            }
        },
    }
}

/// The dynamic dim along which a cat places its parts (the offset of a
/// part after it moves with the size) or a repeat its copies (the period).
fn placed_dynamic(graph: &Graph, node: &Node) -> Option<SymExpr> {
    let inputs: Vec<Vec<SymExpr>> = node
        .inputs
        .iter()
        .flatten()
        .map(|&v| graph.sym_dims(v))
        .collect();
    let dynamic = |e: &&SymExpr| e.as_const().is_none();
    match node.op {
        Op::Cat { dim } => inputs
            .iter()
            .filter_map(|x| x.get(dim))
            .find(dynamic)
            .cloned(),
        _ => inputs.first().and_then(|x| x.iter().find(dynamic).cloned()),
    }
}

/// The dynamic dim a reshape from `x` to `y` (actual dims, bounds `bx`,
/// `by`) regroups so that its bound layout differs from its actual one, if
/// any: dims are matched in groups of equal product (1s dropped), and a
/// group may hold a dynamic dim only as its first dim, on both sides.
fn bound_reshape(x: &[(SymExpr, usize)], y: &[(SymExpr, usize)]) -> Option<SymExpr> {
    let x: Vec<_> = x.iter().filter(|d| d.1 != 1).collect();
    let y: Vec<_> = y.iter().filter(|d| d.1 != 1).collect();
    let first_dynamic = || {
        x.iter()
            .chain(&y)
            .find(|d| d.0.as_const().is_none())
            .map(|d| d.0.clone())
    };
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        let (gi, gj) = (i, j);
        let (mut px, mut py) = (x[i].1, y[j].1);
        (i, j) = (i + 1, j + 1);
        while px != py {
            if px < py && i < x.len() {
                px *= x[i].1;
                i += 1;
            } else if py < px && j < y.len() {
                py *= y[j].1;
                j += 1;
            } else {
                return first_dynamic();
            }
        }
        let product =
            |g: &[&(SymExpr, usize)]| g.iter().fold(SymExpr::Const(1), |p, d| p * d.0.clone());
        if product(&x[gi..i]) != product(&y[gj..j]) {
            return first_dynamic();
        }
        let late = |g: &[&(SymExpr, usize)]| {
            g.iter()
                .skip(1)
                .find(|d| d.0.as_const().is_none())
                .map(|d| d.0.clone())
        };
        if let Some(e) = late(&x[gi..i]).or_else(|| late(&y[gj..j])) {
            return Some(e);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::sym::SymRange;

    fn s() -> SymExpr {
        SymExpr::sym("s")
    }
    fn c(n: i64) -> SymExpr {
        SymExpr::Const(n)
    }

    /// Dims with `s` bounded at 8.
    fn d(xs: &[SymExpr]) -> Vec<(SymExpr, usize)> {
        xs.iter()
            .map(|e| {
                (
                    e.clone(),
                    e.upper_bound(&[("s".to_string(), SymRange { min: 1, max: 8 })].into())
                        .unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn a_reshape_keeps_the_bound_layout_when_a_dynamic_dim_leads_its_group() {
        // [1, s, 32] -> [s, 4, 8]; [s, 4, 8] -> [s * 32]; [2, s, 3] -> [2, 3s]
        assert_eq!(
            bound_reshape(&d(&[c(1), s(), c(32)]), &d(&[s(), c(4), c(8)])),
            None
        );
        assert_eq!(
            bound_reshape(&d(&[s(), c(4), c(8)]), &d(&[s() * c(32)])),
            None
        );
        assert_eq!(
            bound_reshape(&d(&[c(2), s(), c(3)]), &d(&[c(2), s() * c(3)])),
            None
        );
        // [2, s] -> [2s]: the static 2 leads, s moves with the size
        assert_eq!(
            bound_reshape(&d(&[c(2), s()]), &d(&[c(2) * s()])),
            Some(s())
        );
    }
}
