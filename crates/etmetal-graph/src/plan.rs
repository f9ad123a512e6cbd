//! Memory planning: every non-constant tensor (user inputs, intermediates,
//! outputs, kernel scratch) gets a byte offset in one arena, and tensors
//! whose lifetimes do not overlap share space.
//!
//! Lifetimes are in steps: step 0 defines the graph inputs, step `i + 1`
//! runs node `i` (reads its inputs, writes its outputs), step `n + 1` reads
//! the graph outputs. A node's inputs and outputs are therefore live at the
//! same step and never alias (ExecuTorch's portable kernels do not support
//! in-place calls). Placement is greedy by size, largest first, each at the
//! lowest 16-byte aligned offset free for its whole lifetime.

use std::collections::BTreeMap;

use etmetal_core::{shape::numel, Error, Result};

use crate::ir::{Graph, ValueId};

/// Alignment of every planned tensor (ExecuTorch's planner uses 16 too).
pub const ALIGNMENT: u64 = 16;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Byte offset of each planned value in the arena.
    pub offsets: BTreeMap<ValueId, u64>,
    /// Arena size in bytes (a multiple of [`ALIGNMENT`]).
    pub size: u64,
}

/// A value's live steps, inclusive, and its byte size.
#[derive(Clone, Copy, Debug)]
struct Live {
    first: usize,
    last: usize,
    bytes: u64,
}

/// Plan `graph`'s non-constant values; `scratch` lists extra values (not
/// node outputs) written by node `index` and dead right after it.
pub fn plan_memory(graph: &Graph, scratch: &[(usize, ValueId)]) -> Result<MemoryPlan> {
    let mut live: BTreeMap<ValueId, Live> = BTreeMap::new();
    let mut touch = |v: ValueId, step: usize| -> Result<()> {
        if graph.constants.contains_key(&v) {
            return Ok(());
        }
        let info = graph
            .values
            .get(v.0)
            .ok_or_else(|| Error::internal(format!("value id {} is not in the graph", v.0)))?;
        let bytes = (numel(&info.shape)? as u64)
            .checked_mul(info.dtype.size() as u64)
            .ok_or_else(|| Error::limit(format!("value `{}` is too large", info.name)))?;
        let entry = live.entry(v).or_insert(Live {
            first: step,
            last: step,
            bytes,
        });
        entry.first = entry.first.min(step);
        entry.last = entry.last.max(step);
        Ok(())
    };
    for (v, _) in &graph.inputs {
        touch(*v, 0)?;
    }
    for (i, node) in graph.nodes.iter().enumerate() {
        for v in node.inputs.iter().flatten().chain(&node.outputs) {
            touch(*v, i + 1)?;
        }
    }
    for &(i, v) in scratch {
        touch(v, i + 1)?;
    }
    let end = graph.nodes.len() + 1;
    for (v, _) in &graph.outputs {
        touch(*v, end)?;
    }

    let mut order: Vec<(ValueId, Live)> = live.into_iter().collect();
    order.sort_by(|a, b| b.1.bytes.cmp(&a.1.bytes).then(a.1.first.cmp(&b.1.first)));
    let mut placed: Vec<(u64, u64, Live)> = Vec::with_capacity(order.len()); // (offset, end, life)
    let mut plan = MemoryPlan::default();
    for (v, life) in order {
        let padded = aligned(life.bytes)?;
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|(_, _, o)| o.first <= life.last && life.first <= o.last)
            .map(|&(start, end, _)| (start, end))
            .collect();
        busy.sort_unstable();
        let mut offset = 0u64;
        for (start, end) in busy {
            if offset + padded <= start {
                break;
            }
            offset = offset.max(end);
        }
        let end = offset
            .checked_add(padded)
            .ok_or_else(|| Error::limit("the memory plan exceeds u64 bytes"))?;
        placed.push((offset, end, life));
        plan.offsets.insert(v, offset);
        plan.size = plan.size.max(end);
    }
    Ok(plan)
}

fn aligned(bytes: u64) -> Result<u64> {
    bytes
        .checked_next_multiple_of(ALIGNMENT)
        .ok_or_else(|| Error::limit(format!("a tensor of {bytes} bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{InputKind, Node, OutputKind};
    use etmetal_core::{DType, Op, Tensor, UnaryOp};

    /// x → relu → relu → … (`n` nodes) of `[len]` f32 values.
    fn chain(n: usize, len: usize) -> Graph {
        let mut g = Graph::default();
        let mut prev = g.add_value("x", DType::F32, vec![len]);
        g.inputs.push((prev, InputKind::User));
        for i in 0..n {
            let y = g.add_value(format!("y{i}"), DType::F32, vec![len]);
            g.nodes.push(Node {
                name: format!("n{i}"),
                target: "test".into(),
                op: Op::Unary(UnaryOp::Relu),
                inputs: vec![Some(prev)],
                outputs: vec![y],
            });
            prev = y;
        }
        g.outputs.push((prev, OutputKind::User));
        g
    }

    fn overlaps(g: &Graph, plan: &MemoryPlan, a: ValueId, b: ValueId) -> bool {
        let bytes = |v: ValueId| (g.value(v).shape.iter().product::<usize>() * 4) as u64;
        let (oa, ob) = (plan.offsets[&a], plan.offsets[&b]);
        oa < ob + bytes(b) && ob < oa + bytes(a)
    }

    #[test]
    fn chain_reuses_two_slots() {
        let g = chain(5, 10); // 40 bytes → 48 aligned
        let plan = plan_memory(&g, &[]).unwrap();
        assert_eq!(plan.offsets.len(), 6);
        assert_eq!(plan.size, 96, "{plan:?}");
        // each node's input and output are live together: never overlap
        for n in &g.nodes {
            assert!(!overlaps(&g, &plan, n.inputs[0].unwrap(), n.outputs[0]));
        }
        assert!(plan.offsets.values().all(|o| o % ALIGNMENT == 0));
    }

    #[test]
    fn live_values_never_overlap() {
        // a diamond: x feeds two branches joined at the end, plus a constant
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![8]);
        g.inputs.push((x, InputKind::User));
        let c = g.add_constant("c", Tensor::from_f32(DType::F32, &[8], &[1.0; 8]).unwrap());
        let push = |g: &mut Graph, op: Op, ins: Vec<ValueId>, len: usize| {
            let y = g.add_value(format!("v{}", g.values.len()), DType::F32, vec![len]);
            let name = format!("n{}", g.nodes.len());
            let inputs = ins.into_iter().map(Some).collect();
            g.nodes.push(Node {
                name,
                target: "t".into(),
                op,
                inputs,
                outputs: vec![y],
            });
            y
        };
        let add = Op::Binary(etmetal_core::BinaryOp::Add);
        let a = push(&mut g, add.clone(), vec![x, c], 8);
        let b = push(&mut g, Op::Unary(UnaryOp::Exp), vec![x], 8);
        let d = push(&mut g, Op::Unary(UnaryOp::Exp), vec![b], 8);
        let y = push(&mut g, add, vec![a, d], 8);
        g.outputs.push((y, OutputKind::User));
        let scratch = g.add_value("s", DType::F32, vec![4]);
        let plan = plan_memory(&g, &[(2, scratch)]).unwrap();
        assert!(!plan.offsets.contains_key(&c), "constants are not planned");
        // live at step 3 (node 2): a, b, d and the scratch
        for (p, q) in [
            (a, b),
            (a, d),
            (b, d),
            (scratch, a),
            (scratch, b),
            (scratch, d),
            (x, a),
            (x, b),
        ] {
            assert!(!overlaps(&g, &plan, p, q), "{p:?} {q:?} in {plan:?}");
        }
        // at most a, b, d and the scratch are live at once: the other two reuse space
        assert_eq!(plan.size, 3 * 32 + 16, "{plan:?}");
    }
}
