//! Linears of one input (a layer's q, k and v; gate and up) as one product
//! of their constant weights concatenated along N, each output a slice of
//! its output: the input is read once, a decode step's products are one
//! kernel writing one buffer, and a reader of several of them (attention
//! reading q, k and v, which also writes the cache rows) binds that one
//! buffer instead of one each (kernels bind 8 buffers on every adapter).
//!
//! Float linears (`x @ W.T + b`) and the quantized ones of `quantize`
//! (packed codes, scales and zeros) alike: every constant operand of a
//! linear has N as its first dim, so each is concatenated along it. A
//! float linear read by a pointwise op keeps its own product
//! ([`computed_in_store`]).

use std::collections::{HashMap, HashSet};

use etmetal_core::quant::QuantFormat;
use etmetal_core::{DType, Error, Op, Result, Tensor};

use crate::decompose::eliminate_dead_code;
use crate::ir::{Graph, Node, ValueId};

/// The largest weight [`merge`] makes: wgpu's storage binding limit on
/// every adapter (the partitioner's default), so products the GPU takes
/// apart it takes merged.
const MERGED_MAX_BYTES: usize = 128 << 20;

/// What must agree for linears to merge: the op, and per operand after
/// the input whether it is there, its dtype and its dims after N.
type Key = (Op, Vec<Option<(DType, Vec<usize>)>>);

/// Values whose one reader is a pointwise op: a float linear with such an
/// output stays a product of its own, since the GPU computes the op in
/// the product's store (a SiLU gate, a residual add; its sibling products
/// share its dispatch all the same), which a slice of a merged product
/// cannot. (On an H100 a merged Llama-1B gate and up, the SiLU then in the
/// down product's input, made down 0.30 -> 0.34 ms a bf16 step.) The
/// quantized products merge regardless: apart they are a kernel each.
fn computed_in_store(graph: &Graph) -> HashSet<ValueId> {
    let mut readers: HashMap<ValueId, Vec<&Op>> = HashMap::new();
    for node in &graph.nodes {
        for v in node.inputs.iter().flatten() {
            readers.entry(*v).or_default().push(&node.op);
        }
    }
    let outputs: HashSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    readers
        .into_iter()
        .filter(|(v, ops)| {
            ops.len() == 1 && !outputs.contains(v) && matches!(ops[0], Op::Unary(_) | Op::Binary(_))
        })
        .map(|(v, _)| v)
        .collect()
}

/// `linears` (of one input, in order) in groups of one [`Key`], in order.
fn alike(graph: &Graph, linears: Vec<usize>) -> Vec<Vec<usize>> {
    let key = |i: usize| -> Key {
        let n = &graph.nodes[i];
        let operands = n.inputs[1..]
            .iter()
            .map(|w| {
                w.map(|w| {
                    let t = &graph.constants[&w];
                    (t.dtype(), t.shape()[1..].to_vec())
                })
            })
            .collect();
        (n.op.clone(), operands)
    };
    let mut groups: Vec<(Key, Vec<usize>)> = vec![];
    for i in linears {
        let k = key(i);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, group)) => group.push(i),
            None => groups.push((k, vec![i])),
        }
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

/// Merge the linears of each input of `graph` (see the module docs): those
/// of one op whose operands are constants alike ([`Key`]), while their
/// weights stay within [`MERGED_MAX_BYTES`]. The parts' constants are
/// dropped where nothing else reads them.
pub fn merge(graph: &mut Graph) -> Result<()> {
    let stores = computed_in_store(graph);
    // the mergeable linears of each input, in order
    let mut by_input: Vec<(ValueId, Vec<usize>)> = vec![];
    for (i, node) in graph.nodes.iter().enumerate() {
        let [Some(x), rest @ ..] = node.inputs.as_slice() else {
            continue;
        };
        let linear = QuantFormat::of_linear(&node.op).is_some()
            || (node.op == Op::Linear && !stores.contains(&node.outputs[0]));
        let constant = !rest.is_empty()
            && rest[0].is_some()
            && rest.iter().flatten().all(|w| {
                graph
                    .constants
                    .get(w)
                    .is_some_and(|t| !t.shape().is_empty())
            });
        if !linear || !constant || node.outputs.len() != 1 {
            continue;
        }
        match by_input.iter_mut().find(|(v, _)| v == x) {
            Some((_, found)) => found.push(i),
            None => by_input.push((*x, vec![i])),
        }
    }
    let mut replaced: HashMap<usize, Vec<Node>> = HashMap::new();
    let groups: Vec<Vec<usize>> = (by_input.into_iter())
        .flat_map(|(_, linears)| alike(graph, linears))
        .collect();
    for group in groups {
        let weight = |i: usize| &graph.constants[&graph.nodes[i].inputs[1].expect("checked")];
        let bytes: usize = group.iter().map(|&i| weight(i).bytes().len()).sum();
        if group.len() < 2 || bytes > MERGED_MAX_BYTES {
            continue;
        }
        let widths: Vec<usize> = group.iter().map(|&i| weight(i).shape()[0]).collect();
        let (merged, shape) = merged_node(graph, &group)?;
        let y = merged.outputs[0];
        let mut start = 0;
        for (k, (&i, &width)) in group.iter().zip(&widths).enumerate() {
            let n = &graph.nodes[i];
            let slice = Node {
                name: format!("{}.slice", n.name),
                target: n.target.clone(),
                op: Op::Slice {
                    dim: shape.len() - 1,
                    start,
                    end: start + width,
                    step: 1,
                },
                inputs: vec![Some(y)],
                outputs: n.outputs.clone(),
            };
            start += width;
            let at = replaced.entry(i).or_default();
            if k == 0 {
                at.push(merged.clone());
            }
            at.push(slice);
        }
    }
    if replaced.is_empty() {
        return Ok(());
    }
    let nodes = std::mem::take(&mut graph.nodes);
    for (i, node) in nodes.into_iter().enumerate() {
        match replaced.remove(&i) {
            Some(new) => graph.nodes.extend(new),
            None => graph.nodes.push(node),
        }
    }
    eliminate_dead_code(graph);
    Ok(())
}

/// The product of `group`'s operands concatenated along N (named after the
/// parts, as every method of a program names them, so methods share it),
/// with its output value, and that output's shape.
fn merged_node(graph: &mut Graph, group: &[usize]) -> Result<(Node, Vec<usize>)> {
    let first = graph.nodes[group[0]].clone();
    let (op, x, target) = (first.op.clone(), first.inputs[0], first.target.clone());
    let names: Vec<&str> = group
        .iter()
        .map(|&i| graph.nodes[i].name.as_str())
        .collect();
    let name = names.join("+");
    let mut operands = vec![x];
    for slot in 1..first.inputs.len() {
        let Some(w) = first.inputs[slot] else {
            operands.push(None);
            continue;
        };
        let of = |i: usize| graph.nodes[i].inputs[slot].expect("checked by the key");
        let t = &graph.constants[&w];
        let rows: usize = group
            .iter()
            .map(|&i| graph.constants[&of(i)].shape()[0])
            .sum();
        let mut shape = t.shape().to_vec();
        shape[0] = rows;
        // the parts' bytes one after the other, copied once
        let mut merged = Tensor::zeros(t.dtype(), &shape)?;
        let out = merged.bytes_mut();
        let mut at = 0;
        for &i in group {
            let part = graph.constants[&of(i)].bytes();
            let end = at + part.len();
            if end > out.len() {
                return Err(Error::internal(format!(
                    "merged linears {name}: parts of other widths"
                )));
            }
            out[at..end].copy_from_slice(part);
            at = end;
        }
        if at != out.len() {
            return Err(Error::internal(format!(
                "merged linears {name}: parts of other widths"
            )));
        }
        // (as quantized weights are: a copy of the graph shares them)
        let merged = merged.into_shared();
        let parts: Vec<&str> = group
            .iter()
            .map(|&i| graph.value(of(i)).name.as_str())
            .collect();
        operands.push(Some(graph.add_constant(parts.join("+"), merged)));
    }
    let mut node = Node {
        name: name.clone(),
        target,
        op,
        inputs: operands,
        outputs: vec![],
    };
    let (dtype, shape) = crate::infer::infer(graph, &node)?
        .into_iter()
        .next()
        .ok_or_else(|| Error::internal("a linear with no output"))?;
    let y = graph.add_value(format!("{name}.out"), dtype, shape.clone());
    node.outputs.push(y);
    crate::infer_sym::assign_sym(graph, &node)?;
    Ok((node, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::run_graph;
    use crate::ir::{InputKind, OutputKind};
    use crate::test_util::{ops, push, reinfers};
    use etmetal_core::{BinaryOp, UnaryOp};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    /// q without a bias, k and v with one, and a linear of another input:
    /// q, k and v become one product of concatenated weights and biases,
    /// each output the slice at its offset, with the same values; the
    /// other linear and the parts' weights are gone or kept as they were.
    #[test]
    fn float_linears_of_one_input_become_one_product() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![3, 16]);
        g.inputs.push((x, InputKind::User));
        let other = g.add_value("h", DType::F32, vec![3, 16]);
        g.inputs.push((other, InputKind::User));
        let constant = |g: &mut Graph, name: &str, shape: &[usize], seed| {
            let n = shape.iter().product();
            g.add_constant(
                name,
                Tensor::from_f32(DType::F32, shape, &values(n, seed)).unwrap(),
            )
        };
        let (wq, wk, wv, wo) = (
            constant(&mut g, "wq", &[16, 16], 1),
            constant(&mut g, "wk", &[8, 16], 2),
            constant(&mut g, "wv", &[8, 16], 3),
            constant(&mut g, "wo", &[16, 16], 4),
        );
        let (bk, bv) = (
            constant(&mut g, "bk", &[8], 5),
            constant(&mut g, "bv", &[8], 6),
        );
        let q = push(&mut g, "q", Op::Linear, vec![Some(x), Some(wq)]);
        let k = push(&mut g, "k", Op::Linear, vec![Some(x), Some(wk), Some(bk)]);
        let v = push(&mut g, "v", Op::Linear, vec![Some(x), Some(wv), Some(bv)]);
        let o = push(&mut g, "o", Op::Linear, vec![Some(other), Some(wo)]);
        for y in [q, k, v, o] {
            g.outputs.push((y, OutputKind::User));
        }
        let inputs = vec![
            Tensor::from_f32(DType::F32, &[3, 16], &values(48, 7)).unwrap(),
            Tensor::from_f32(DType::F32, &[3, 16], &values(48, 8)).unwrap(),
        ];
        let before = run_graph(&g, inputs.clone()).unwrap();
        merge(&mut g).unwrap();
        // q has no bias: it keeps a product of its own; k and v merge
        assert_eq!(ops(&g), ["linear", "linear", "slice", "slice", "linear"]);
        reinfers(&g);
        let merged = &g.nodes[1];
        assert_eq!(merged.name, "k+v");
        let w = &g.constants[&merged.inputs[1].unwrap()];
        assert_eq!(w.shape(), [16, 16]);
        assert_eq!(g.constants[&merged.inputs[2].unwrap()].shape(), [16]);
        let after = run_graph(&g, inputs).unwrap();
        for (a, b) in after.iter().zip(&before) {
            assert_eq!(a.to_f32_vec(), b.to_f32_vec());
        }
    }

    /// Linears of one input without biases, of one dtype, merge; another
    /// dtype keeps its own product; weights over the binding limit stay
    /// apart; a linear read by a pointwise op stays apart.
    #[test]
    fn only_alike_linears_merge() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::BF16, vec![1, 32]);
        g.inputs.push((x, InputKind::User));
        let w = |g: &mut Graph, name: &str, n: usize, dtype: DType| {
            g.add_constant(name, Tensor::zeros(dtype, &[n, 32]).unwrap())
        };
        let (a, b, c) = (
            w(&mut g, "a", 8, DType::BF16),
            w(&mut g, "b", 24, DType::BF16),
            w(&mut g, "c", 8, DType::F32),
        );
        for (name, wt) in [("ya", a), ("yb", b), ("yc", c)] {
            let y = push(&mut g, name, Op::Linear, vec![Some(x), Some(wt)]);
            g.outputs.push((y, OutputKind::User));
        }
        merge(&mut g).unwrap();
        assert_eq!(ops(&g), ["linear", "slice", "slice", "linear"]);
        assert_eq!(g.nodes[0].name, "ya+yb");
        // two linears whose merged weight passes the limit
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![1, 4096]);
        g.inputs.push((x, InputKind::User));
        for name in ["big0", "big1"] {
            let wt = g.add_constant(name, Tensor::zeros(DType::F32, &[5000, 4096]).unwrap());
            let y = push(&mut g, name, Op::Linear, vec![Some(x), Some(wt)]);
            g.outputs.push((y, OutputKind::User));
        }
        merge(&mut g).unwrap();
        assert_eq!(ops(&g), ["linear", "linear"]);
        // a gate read by its SiLU keeps its product (the SiLU in its store)
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![1, 32]);
        g.inputs.push((x, InputKind::User));
        let wg = g.add_constant("wg", Tensor::zeros(DType::F32, &[64, 32]).unwrap());
        let wu = g.add_constant("wu", Tensor::zeros(DType::F32, &[64, 32]).unwrap());
        let gate = push(&mut g, "gate", Op::Linear, vec![Some(x), Some(wg)]);
        let up = push(&mut g, "up", Op::Linear, vec![Some(x), Some(wu)]);
        let act = push(&mut g, "act", Op::Unary(UnaryOp::Silu), vec![Some(gate)]);
        let y = push(
            &mut g,
            "y",
            Op::Binary(BinaryOp::Mul),
            vec![Some(act), Some(up)],
        );
        g.outputs.push((y, OutputKind::User));
        merge(&mut g).unwrap();
        assert_eq!(ops(&g), ["linear", "linear", "silu", "mul"]);
    }
}
