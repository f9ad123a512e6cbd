//! Graph passes that shrink the op set the backends must implement.
//!
//! [`decompose`] rewrites, unless `keep(op)` says the backend takes the op
//! whole:
//! - `Linear` → `MatMul` with the transposed weight (a pre-transposed
//!   constant when the weight is constant, else a `Permute`) + `Add` of the
//!   bias;
//! - `Addmm` → `MatMul`, a `Mul` by `alpha`/`beta` where they are not 1, and
//!   an `Add` of the bias (dropped when `beta == 0`);
//! - `BatchNorm` with constant statistics → `Mul` by a per-channel scale and
//!   `Add` of a shift, both precomputed constants;
//! - `Identity` → its uses read the input directly (kept where its output is
//!   a graph output);
//! - `Cat` inputs without elements are dropped, whatever `keep` says (the
//!   empty half of transformers' partial-rotary split, which a GPU would
//!   refuse), and a cat left with one input is an `Identity`.
//!
//! A rewrite whose new nodes do not infer to the original output is skipped,
//! so the pass never breaks a graph that inferred before.

use std::collections::{HashMap, HashSet};

use etmetal_core::{BinaryOp, Error, Op, Result, Tensor};

use crate::ir::{Graph, InputKind, Node, OutputKind, ValueId};
use crate::rewrite::Rewrite;

/// Rewrite `graph` to core ops, keeping those `keep` accepts (see module docs).
pub fn decompose(graph: &mut Graph, keep: &dyn Fn(&Op) -> bool) {
    let nodes = std::mem::take(&mut graph.nodes);
    let graph_outputs: HashSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    let mut forward: HashMap<ValueId, ValueId> = HashMap::new();
    let mut out = Vec::with_capacity(nodes.len());
    for mut node in nodes {
        for slot in node.inputs.iter_mut().flatten() {
            if let Some(v) = forward.get(slot) {
                *slot = *v;
            }
        }
        if let Op::Cat { .. } = node.op {
            drop_empty_inputs(graph, &mut node);
        }
        if keep(&node.op) {
            out.push(node);
            continue;
        }
        if node.op == Op::Identity && !node.outputs.iter().any(|o| graph_outputs.contains(o)) {
            if let (Some(Some(src)), [dst]) = (node.inputs.first(), node.outputs.as_slice()) {
                forward.insert(*dst, *src);
                continue;
            }
        }
        match rewrite(graph, &node) {
            Ok(Some(new_nodes)) => out.extend(new_nodes),
            // not decomposable, or the rewrite would not infer: keep it whole
            Ok(None) | Err(_) => out.push(node),
        }
    }
    graph.nodes = out;
}

/// Drop the inputs of cat `node` that have no elements, when that changes
/// neither the result's dtype nor its shape; a single input left makes it an
/// `Identity`.
fn drop_empty_inputs(graph: &Graph, node: &mut Node) {
    let (Some(&out), Some(inputs)) = (node.outputs.first(), node.inputs.get(..)) else {
        return;
    };
    let want = graph.value(out).dtype;
    let kept: Vec<Option<ValueId>> = inputs
        .iter()
        .filter(|v| v.is_some_and(|v| !graph.value(v).shape.contains(&0)))
        .copied()
        .collect();
    let same_dtype = kept.iter().flatten().all(|&v| graph.value(v).dtype == want);
    if kept.is_empty() || kept.len() == inputs.len() || !same_dtype {
        return;
    }
    if kept.len() == 1 {
        node.op = Op::Identity;
    }
    node.inputs = kept;
}

/// `x * k` unless `k == 1`.
fn scaled(rw: &mut Rewrite, x: ValueId, k: f64) -> Result<ValueId> {
    if k == 1.0 {
        return Ok(x);
    }
    let dtype = rw.graph.value(x).dtype;
    let c = rw.scalar(k, dtype)?;
    rw.node(Op::Binary(BinaryOp::Mul), &[Some(x), Some(c)])
}

fn transposed(t: &Tensor) -> Result<Tensor> {
    let [rows, cols] = *t.shape() else {
        return Err(Error::internal("not 2-D"));
    };
    let e = t.dtype().size();
    let src = t.bytes();
    let mut dst = vec![0u8; src.len()];
    for r in 0..rows {
        for c in 0..cols {
            dst[(c * rows + r) * e..(c * rows + r + 1) * e]
                .copy_from_slice(&src[(r * cols + c) * e..(r * cols + c + 1) * e]);
        }
    }
    Tensor::from_bytes(t.dtype(), &[cols, rows], &dst)
}

fn rewrite(graph: &mut Graph, node: &Node) -> Result<Option<Vec<Node>>> {
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let mut rw = Rewrite::new(graph, node);
    match &node.op {
        Op::Linear => {
            let (Some(x), Some(w)) = (input(0), input(1)) else {
                return Ok(None);
            };
            let wt = match rw.graph.constants.get(&w) {
                Some(t) => {
                    let t = transposed(t)?;
                    rw.constant("weight_t", t)
                }
                None => rw.node(Op::Permute { dims: vec![1, 0] }, &[Some(w)])?,
            };
            match input(2) {
                None => rw.finish_with(Op::MatMul, &[Some(x), Some(wt)]).map(Some),
                Some(b) => {
                    let mm = rw.node(Op::MatMul, &[Some(x), Some(wt)])?;
                    rw.finish_with(Op::Binary(BinaryOp::Add), &[Some(mm), Some(b)])
                        .map(Some)
                }
            }
        }
        Op::Addmm { beta, alpha } => {
            let (Some(bias), Some(a), Some(b)) = (input(0), input(1), input(2)) else {
                return Ok(None);
            };
            if *beta == 0.0 {
                if *alpha == 1.0 {
                    return rw.finish_with(Op::MatMul, &[Some(a), Some(b)]).map(Some);
                }
                let mm = rw.node(Op::MatMul, &[Some(a), Some(b)])?;
                let dtype = rw.graph.value(mm).dtype;
                let k = rw.scalar(*alpha, dtype)?;
                return rw
                    .finish_with(Op::Binary(BinaryOp::Mul), &[Some(mm), Some(k)])
                    .map(Some);
            }
            let mm = rw.node(Op::MatMul, &[Some(a), Some(b)])?;
            let mm = scaled(&mut rw, mm, *alpha)?;
            let bias = scaled(&mut rw, bias, *beta)?;
            rw.finish_with(Op::Binary(BinaryOp::Add), &[Some(mm), Some(bias)])
                .map(Some)
        }
        Op::BatchNorm { eps } => {
            let Some(x) = input(0) else { return Ok(None) };
            let param =
                |i: usize| input(i).map(|v| rw.graph.constants.get(&v).map(Tensor::to_f64_vec));
            let (Some(Some(mean)), Some(Some(var))) = (param(3), param(4)) else {
                return Ok(None);
            };
            let (w, b) = (param(1), param(2));
            if matches!(w, Some(None)) || matches!(b, Some(None)) {
                return Ok(None); // a weight or bias computed at run time
            }
            let c = mean.len();
            let (w, b) = (
                w.flatten().unwrap_or(vec![1.0; c]),
                b.flatten().unwrap_or(vec![0.0; c]),
            );
            if var.len() != c || w.len() != c || b.len() != c {
                return Ok(None);
            }
            let scale: Vec<f64> = (0..c).map(|i| w[i] / (var[i] + eps).sqrt()).collect();
            let shift: Vec<f64> = (0..c).map(|i| b[i] - mean[i] * scale[i]).collect();
            let xinfo = rw.graph.value(x);
            let (dtype, rank) = (xinfo.dtype, xinfo.shape.len());
            // [C, 1, …] broadcasts against [N, C, spatial…]
            let mut shape = vec![1usize; rank.saturating_sub(1)];
            if let Some(first) = shape.first_mut() {
                *first = c;
            }
            let s = rw.constant("scale", Tensor::from_f64(dtype, &shape, &scale)?);
            let t = rw.constant("shift", Tensor::from_f64(dtype, &shape, &shift)?);
            let y = rw.node(Op::Binary(BinaryOp::Mul), &[Some(x), Some(s)])?;
            rw.finish_with(Op::Binary(BinaryOp::Add), &[Some(y), Some(t)])
                .map(Some)
        }
        _ => Ok(None),
    }
}

/// Remove nodes whose outputs nothing reads, then the constants no live node
/// reads (with their parameter/buffer/constant inputs; user inputs stay, and
/// so do buffers the graph writes, whose old value may go unread:
/// transformers' cache counters are overwritten each call).
pub fn eliminate_dead_code(graph: &mut Graph) {
    let mut live: HashSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    let mut kept = Vec::with_capacity(graph.nodes.len());
    for node in std::mem::take(&mut graph.nodes).into_iter().rev() {
        if node.outputs.iter().any(|o| live.contains(o)) {
            live.extend(node.inputs.iter().flatten());
            kept.push(node);
        }
    }
    kept.reverse();
    let written: HashSet<&str> = graph
        .outputs
        .iter()
        .filter_map(|(_, k)| match k {
            OutputKind::BufferMutation { fqn } => Some(fqn.as_str()),
            _ => None,
        })
        .collect();
    for (v, k) in &graph.inputs {
        if matches!(k, InputKind::Buffer { fqn, .. } if written.contains(fqn.as_str())) {
            live.insert(*v);
        }
    }
    graph.nodes = kept;
    graph.constants.retain(|v, _| live.contains(v));
    graph
        .inputs
        .retain(|(v, kind)| *kind == InputKind::User || live.contains(v));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{ops, push, reinfers};
    use etmetal_core::DType;
    use etmetal_core::ReduceOp;

    fn linear_graph(const_weight: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![2, 3]);
        g.inputs.push((x, InputKind::User));
        let w = if const_weight {
            g.add_constant(
                "w",
                Tensor::from_f32(
                    DType::F32,
                    &[4, 3],
                    &(0..12).map(|i| i as f32).collect::<Vec<_>>(),
                )
                .unwrap(),
            )
        } else {
            let w = g.add_value("w", DType::F32, vec![4, 3]);
            g.inputs.push((w, InputKind::User));
            w
        };
        let b = g.add_constant("b", Tensor::from_f32(DType::F32, &[4], &[1.0; 4]).unwrap());
        let y = push(&mut g, "lin", Op::Linear, vec![Some(x), Some(w), Some(b)]);
        g.outputs.push((y, crate::ir::OutputKind::User));
        g
    }

    #[test]
    fn linear_with_constant_weight_uses_pretransposed_weight() {
        let mut g = linear_graph(true);
        decompose(&mut g, &|_| false);
        assert_eq!(ops(&g), ["mat_mul", "add"]);
        let wt = g.nodes[0].inputs[1].unwrap();
        let t = &g.constants[&wt];
        assert_eq!(t.shape(), &[3, 4]);
        assert_eq!(t.to_f32_vec()[..4], [0.0, 3.0, 6.0, 9.0]);
        assert_eq!(g.nodes[1].outputs, vec![g.outputs[0].0]);
        reinfers(&g);
    }

    #[test]
    fn linear_with_runtime_weight_gets_permute_and_keep_is_honoured() {
        let mut g = linear_graph(false);
        decompose(&mut g, &|_| false);
        assert_eq!(ops(&g), ["permute", "mat_mul", "add"]);
        reinfers(&g);
        let mut g = linear_graph(false);
        decompose(&mut g, &|op| matches!(op, Op::Linear));
        assert_eq!(ops(&g), ["linear"]);
    }

    #[test]
    fn empty_cat_inputs_are_dropped_even_for_kept_cats() {
        // q = cat(rotated, q[..., 8:]) with all 8 dims rotated: the pass-through half is empty
        let mut g = Graph::default();
        let q = g.add_value("q", DType::F32, vec![2, 8]);
        let k = g.add_value("k", DType::F32, vec![2, 4]);
        g.inputs
            .extend([(q, InputKind::User), (k, InputKind::User)]);
        let empty = push(
            &mut g,
            "pass",
            Op::Slice {
                dim: 1,
                start: 8,
                end: 8,
                step: 1,
            },
            vec![Some(q)],
        );
        let one = push(
            &mut g,
            "one",
            Op::Cat { dim: 1 },
            vec![Some(q), Some(empty)],
        );
        let two = push(
            &mut g,
            "two",
            Op::Cat { dim: 1 },
            vec![Some(empty), Some(k), Some(q)],
        );
        let y = push(
            &mut g,
            "y",
            Op::Binary(BinaryOp::Add),
            vec![Some(one), Some(q)],
        );
        g.outputs.push((y, crate::ir::OutputKind::User));
        g.outputs.push((two, crate::ir::OutputKind::User));
        decompose(&mut g, &|op| matches!(op, Op::Cat { .. }));
        eliminate_dead_code(&mut g);
        assert_eq!(ops(&g), ["cat", "add"], "the empty slice is dead");
        assert_eq!(g.nodes[0].inputs, [Some(k), Some(q)]);
        assert_eq!(
            g.nodes[1].inputs[0],
            Some(q),
            "a cat of one input is forwarded"
        );
        reinfers(&g);
    }

    #[test]
    fn a_buffer_overwritten_without_being_read_stays_an_input() {
        // `counter.fill_(3)` as a state update: the old value is dead, the buffer is not
        let mut g = Graph::default();
        let b = g.add_value("b_counter", DType::F32, vec![1]);
        g.constants
            .insert(b, Tensor::from_f64(DType::F32, &[1], &[0.0]).unwrap());
        g.inputs.push((
            b,
            InputKind::Buffer {
                fqn: "counter".into(),
                persistent: false,
            },
        ));
        let x = g.add_value("x", DType::F32, vec![1]);
        g.inputs.push((x, InputKind::User));
        let new = push(&mut g, "fill", Op::Identity, vec![Some(x)]);
        g.outputs.push((
            new,
            crate::ir::OutputKind::BufferMutation {
                fqn: "counter".into(),
            },
        ));
        eliminate_dead_code(&mut g);
        assert_eq!(g.inputs.len(), 2, "the buffer keeps its place");
        assert!(g.constants.contains_key(&b), "and its initial value");
    }

    #[test]
    fn addmm_scales_and_identity_forwarding() {
        let mut g = Graph::default();
        let a = g.add_value("a", DType::F32, vec![2, 3]);
        let b = g.add_value("b", DType::F32, vec![3, 5]);
        let bias = g.add_value("bias", DType::F32, vec![5]);
        let a2 = push(&mut g, "alias", Op::Identity, vec![Some(a)]);
        let y = push(
            &mut g,
            "mm",
            Op::Addmm {
                beta: 0.5,
                alpha: 2.0,
            },
            vec![Some(bias), Some(a2), Some(b)],
        );
        g.outputs.push((y, crate::ir::OutputKind::User));
        decompose(&mut g, &|_| false);
        assert_eq!(ops(&g), ["mat_mul", "mul", "mul", "add"]);
        assert_eq!(g.nodes[0].inputs[0], Some(a), "identity is forwarded");
        reinfers(&g);
    }

    #[test]
    fn batch_norm_folds_to_scale_and_shift() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![1, 2, 3, 3]);
        let c = |g: &mut Graph, v: &[f32]| {
            g.add_constant("p", Tensor::from_f32(DType::F32, &[2], v).unwrap())
        };
        let (w, b, m, var) = (
            c(&mut g, &[2.0, 1.0]),
            c(&mut g, &[0.5, 0.0]),
            c(&mut g, &[1.0, -1.0]),
            c(&mut g, &[4.0, 1.0]),
        );
        let y = push(
            &mut g,
            "bn",
            Op::BatchNorm { eps: 0.0 },
            vec![Some(x), Some(w), Some(b), Some(m), Some(var)],
        );
        g.outputs.push((y, crate::ir::OutputKind::User));
        decompose(&mut g, &|_| false);
        assert_eq!(ops(&g), ["mul", "add"]);
        let scale = &g.constants[&g.nodes[0].inputs[1].unwrap()];
        assert_eq!(scale.shape(), &[2, 1, 1]);
        assert_eq!(scale.to_f32_vec(), vec![1.0, 1.0]);
        assert_eq!(
            g.constants[&g.nodes[1].inputs[1].unwrap()].to_f32_vec(),
            vec![-0.5, 1.0]
        );
        reinfers(&g);
    }

    #[test]
    fn dead_code_and_unused_constants_are_removed() {
        let mut g = linear_graph(true);
        let x = g.inputs[0].0;
        push(
            &mut g,
            "unused",
            Op::Reduce {
                op: ReduceOp::Sum,
                dims: vec![],
                keepdim: false,
            },
            vec![Some(x)],
        );
        decompose(&mut g, &|_| false);
        let before = g.constants.len();
        eliminate_dead_code(&mut g);
        assert_eq!(ops(&g), ["mat_mul", "add"]);
        // the original [4,3] weight is no longer read after pre-transposing
        assert_eq!(g.constants.len(), before - 1);
        assert!(g.constants.values().all(|t| t.shape() != [4, 3]));
    }
}
