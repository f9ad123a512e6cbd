//! `--dtype`: compile a float32 program in bfloat16 or float16, as eager
//! PyTorch runs it after `module.to(dtype)` with float inputs of that dtype.
//!
//! - Parameters, buffers, float inputs and float constants (lifted tensors,
//!   the 0-d scalars of binary ops, `full`, `arange`) switch to the target
//!   dtype, and so does every float32 value computed from them.
//! - The program's own explicit casts to float32 of a value that is not
//!   float32 (`positions.float()`, `mask.to(torch.float32)`) stay float32,
//!   as `module.to` leaves the forward's code alone; so do the ops computing
//!   from such values, ints and weights only (a rotary embedding's
//!   `inv_freq @ positions.float()`, `cos`, `sin`: positions past 256 are
//!   not integers in bfloat16). A parameter or buffer read there (directly
//!   or through ops on weights only) is rounded to the target dtype and
//!   read in float32, as eager's `.float()` or type promotion of the
//!   converted tensor does; other constants keep their float32 value
//!   (eager's Python scalars and lifted tensors are not converted).
//! - Where such a float32 value meets an activation (a value computed from
//!   a user input), the region ends: it is cast to the target dtype there,
//!   where the eager program casts back (`cos.to(x.dtype)`, a no-op in the
//!   float32 export). A float32 value written into a buffer or input is
//!   cast to the target dtype too (eager's `copy_`).
//!
//! A program with no such cast converts exactly as if every float32 value
//! and every op naming float32 (casts, `full`, `arange`) were switched.

use std::collections::{BTreeMap, BTreeSet};

use etmetal_core::{DType, Error, Op, Result};

use crate::ir::{Graph, InputKind, Node, OutputKind, ValueId};

pub fn convert_floats(graph: &mut Graph, to: DType) -> Result<()> {
    if !to.is_float() {
        return Err(Error::invalid_input(format!(
            "--dtype {}: only float dtypes (float32, bfloat16, float16)",
            to.name()
        )));
    }
    if to == DType::F32 {
        return Ok(());
    }
    let weights: BTreeSet<ValueId> = graph
        .inputs
        .iter()
        .filter(|(_, k)| matches!(k, InputKind::Parameter { .. } | InputKind::Buffer { .. }))
        .map(|(v, _)| *v)
        .collect();
    // Values that stay float32 (see the module doc).
    let mut kept = BTreeSet::new();
    // Values computed from a user input: activations, unlike weights.
    let mut from_user: BTreeSet<ValueId> = graph.user_inputs().collect();
    // A constant read in float32 (see `float32_copy`).
    let mut copies = BTreeMap::new();
    // A weight-derived value read in float32, and a kept value cast to the
    // target dtype where its region ends.
    let (mut cast_up, mut cast_back) = (BTreeMap::new(), BTreeMap::new());
    let old_nodes = std::mem::take(&mut graph.nodes);
    let mut nodes = Vec::with_capacity(old_nodes.len());
    for mut node in old_nodes {
        let explicit = matches!(node.op, Op::Cast { dtype: DType::F32 })
            && node
                .inputs
                .first()
                .copied()
                .flatten()
                .map(|v| graph.value(v).dtype)
                != Some(DType::F32);
        let reads_kept = node.inputs.iter().flatten().any(|v| kept.contains(v));
        let reads_activation = node.inputs.iter().flatten().any(|v| {
            !kept.contains(v) && from_user.contains(v) && graph.value(*v).dtype == DType::F32
        });
        if node.inputs.iter().flatten().any(|v| from_user.contains(v)) {
            from_user.extend(node.outputs.iter().copied());
        }
        if explicit || (reads_kept && !reads_activation) {
            for slot in node.inputs.iter_mut().flatten() {
                if kept.contains(slot) || graph.value(*slot).dtype != DType::F32 {
                    continue;
                }
                *slot = if graph.constants.contains_key(slot) {
                    let round = weights.contains(slot);
                    float32_copy(graph, &mut copies, *slot, round, to)?
                } else {
                    let target = node.target.clone();
                    cast(graph, &mut nodes, &mut cast_up, &target, *slot, DType::F32)
                };
                kept.insert(*slot);
            }
            for v in &node.outputs {
                if graph.value(*v).dtype == DType::F32 {
                    kept.insert(*v);
                }
            }
        } else {
            for slot in node.inputs.iter_mut().flatten() {
                if kept.contains(slot) {
                    *slot = cast(graph, &mut nodes, &mut cast_back, &node.target, *slot, to);
                }
            }
            if let Op::Cast { dtype } | Op::Full { dtype, .. } | Op::Arange { dtype, .. } =
                &mut node.op
            {
                if *dtype == DType::F32 {
                    *dtype = to;
                }
            }
        }
        nodes.push(node);
    }
    graph.nodes = nodes;
    let mut outputs = std::mem::take(&mut graph.outputs);
    for (v, kind) in &mut outputs {
        if kept.contains(v) && !matches!(kind, OutputKind::User) {
            let mut nodes = std::mem::take(&mut graph.nodes);
            *v = cast(graph, &mut nodes, &mut cast_back, "--dtype", *v, to);
            graph.nodes = nodes;
        }
    }
    graph.outputs = outputs;
    for (id, value) in graph.values.iter_mut().enumerate() {
        if value.dtype == DType::F32 && !kept.contains(&ValueId(id)) {
            value.dtype = to;
        }
    }
    for (id, tensor) in graph.constants.iter_mut() {
        if tensor.dtype() == DType::F32 && !kept.contains(id) {
            *tensor = tensor.cast(to)?;
        }
    }
    Ok(())
}

/// The float32 constant that a kept op reads for constant `w` (one per
/// constant; `w` itself still converts for its other readers): its value,
/// rounded to `to` first when `round` (a parameter or buffer).
fn float32_copy(
    graph: &mut Graph,
    copies: &mut BTreeMap<ValueId, ValueId>,
    w: ValueId,
    round: bool,
    to: DType,
) -> Result<ValueId> {
    if let Some(r) = copies.get(&w) {
        return Ok(*r);
    }
    let t = &graph.constants[&w];
    let t = if round {
        t.cast(to)?.cast(DType::F32)?
    } else {
        t.clone()
    };
    let name = format!("{}.f32", graph.value(w).name);
    let r = graph.add_constant(name, t);
    if graph.fake_constants.contains(&w) {
        graph.fake_constants.insert(r);
    }
    copies.insert(w, r);
    Ok(r)
}

/// `v` cast to `to` by a node appended to `nodes` (one per value in `casts`).
fn cast(
    graph: &mut Graph,
    nodes: &mut Vec<Node>,
    casts: &mut BTreeMap<ValueId, ValueId>,
    target: &str,
    v: ValueId,
    to: DType,
) -> ValueId {
    if let Some(c) = casts.get(&v) {
        return *c;
    }
    let name = format!("{}.{}", graph.value(v).name, to.name());
    let shape = graph.value(v).shape.clone();
    let c = graph.add_value(name.clone(), to, shape);
    if let Some(dims) = graph.sym.dims.get(&v).cloned() {
        graph.sym.dims.insert(c, dims);
    }
    nodes.push(Node {
        name,
        target: target.to_string(),
        op: Op::Cast { dtype: to },
        inputs: vec![Some(v)],
        outputs: vec![c],
    });
    casts.insert(v, c);
    c
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::infer::infer;
    use crate::ir::{InputKind, Node, OutputKind};
    use etmetal_core::{BinaryOp, Scalar, Tensor, UnaryOp};

    fn push(
        g: &mut Graph,
        name: &str,
        op: Op,
        inputs: &[ValueId],
        dtype: DType,
        shape: &[usize],
    ) -> ValueId {
        let out = g.add_value(name, dtype, shape.to_vec());
        g.nodes.push(Node {
            name: name.into(),
            target: "t".into(),
            op,
            inputs: inputs.iter().map(|v| Some(*v)).collect(),
            outputs: vec![out],
        });
        out
    }

    /// `cos = (inv_freq * positions.float()).cos()` and `sin` stay float32
    /// (positions past 256 are no integers in bfloat16), reading `inv_freq`
    /// rounded to bfloat16 as eager's `module.to(torch.bfloat16)` does; the
    /// activation `x * cos` is bfloat16, reading `cos` cast back.
    #[test]
    fn explicit_float32_casts_and_what_computes_from_them_stay_float32() {
        let mut g = Graph::default();
        let pos = g.add_value("pos", DType::I64, vec![3, 1]);
        let x = g.add_value("x", DType::F32, vec![3, 2]);
        g.inputs.push((pos, InputKind::User));
        g.inputs.push((x, InputKind::User));
        let inv = g.add_constant(
            "inv_freq",
            Tensor::from_f32(DType::F32, &[2], &[1.0, 0.1]).unwrap(),
        );
        g.inputs.push((
            inv,
            InputKind::Buffer {
                fqn: "inv_freq".into(),
                persistent: false,
            },
        ));
        let scale = g.add_constant("scale", Tensor::scalar_f64(DType::F32, 0.1).unwrap());
        let inv2 = push(
            &mut g,
            "inv2",
            Op::Reshape { shape: vec![1, 2] },
            &[inv],
            DType::F32,
            &[1, 2],
        );
        let pf = push(
            &mut g,
            "pf",
            Op::Cast { dtype: DType::F32 },
            &[pos],
            DType::F32,
            &[3, 1],
        );
        let f = push(
            &mut g,
            "f",
            Op::Binary(BinaryOp::Mul),
            &[pf, inv2],
            DType::F32,
            &[3, 2],
        );
        let fs = push(
            &mut g,
            "fs",
            Op::Binary(BinaryOp::Mul),
            &[f, scale],
            DType::F32,
            &[3, 2],
        );
        let cos = push(
            &mut g,
            "cos",
            Op::Unary(UnaryOp::Cos),
            &[fs],
            DType::F32,
            &[3, 2],
        );
        let sin = push(
            &mut g,
            "sin",
            Op::Unary(UnaryOp::Sin),
            &[f],
            DType::F32,
            &[3, 2],
        );
        let y = push(
            &mut g,
            "y",
            Op::Binary(BinaryOp::Mul),
            &[x, cos],
            DType::F32,
            &[3, 2],
        );
        for v in [cos, sin, y] {
            g.outputs.push((v, OutputKind::User));
        }
        convert_floats(&mut g, DType::BF16).unwrap();
        for v in [pf, f, fs, cos, sin] {
            assert_eq!(g.value(v).dtype, DType::F32, "{}", g.value(v).name);
        }
        for v in [x, y, inv, inv2, scale] {
            assert_eq!(g.value(v).dtype, DType::BF16, "{}", g.value(v).name);
        }
        assert_eq!(g.constants[&inv].to_f32_vec(), [1.0, 0.100_097_656]);
        let names: Vec<&str> = g.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "inv2",
                "pf",
                "inv2.float32",
                "f",
                "fs",
                "cos",
                "sin",
                "cos.bfloat16",
                "y"
            ]
        );
        // The buffer in bf16, read in f32; the lifted scalar at full value.
        assert_eq!(g.nodes[2].op, Op::Cast { dtype: DType::F32 });
        assert_eq!(g.nodes[2].inputs, [Some(inv2)]);
        assert_eq!(g.nodes[3].inputs, [Some(pf), Some(g.nodes[2].outputs[0])]);
        let s = g.nodes[4].inputs[1].unwrap();
        assert_eq!(g.constants[&s].dtype(), DType::F32);
        assert_eq!(g.constants[&s].to_f32_vec(), [0.1]);
        assert_eq!(g.nodes[7].op, Op::Cast { dtype: DType::BF16 });
        assert_eq!(g.nodes[7].inputs, [Some(cos)]);
        assert_eq!(g.nodes[8].inputs, [Some(x), Some(g.nodes[7].outputs[0])]);
        // Every node's values are what its op makes of its inputs.
        for node in &g.nodes {
            let want: Vec<DType> = infer(&g, node)
                .unwrap()
                .into_iter()
                .map(|(d, _)| d)
                .collect();
            let got: Vec<DType> = node.outputs.iter().map(|v| g.value(*v).dtype).collect();
            assert_eq!(got, want, "node {}", node.name);
        }
    }

    /// A float32 value written into a buffer is cast to the buffer's dtype.
    #[test]
    fn float32_buffer_writes_cast_back() {
        let mut g = Graph::default();
        let pos = g.add_value("pos", DType::I64, vec![2]);
        g.inputs.push((pos, InputKind::User));
        let buf = g.add_constant(
            "b",
            Tensor::from_f32(DType::F32, &[2], &[0.0, 0.0]).unwrap(),
        );
        g.inputs.push((
            buf,
            InputKind::Buffer {
                fqn: "b".into(),
                persistent: true,
            },
        ));
        let pf = push(
            &mut g,
            "pf",
            Op::Cast { dtype: DType::F32 },
            &[pos],
            DType::F32,
            &[2],
        );
        g.outputs
            .push((pf, OutputKind::BufferMutation { fqn: "b".into() }));
        convert_floats(&mut g, DType::BF16).unwrap();
        let (w, _) = g.outputs[0];
        assert_eq!(g.value(w).dtype, DType::BF16);
        assert_eq!(g.nodes.last().unwrap().inputs, [Some(pf)]);
        assert_eq!(g.nodes.last().unwrap().outputs, [w]);
    }

    #[test]
    fn float32_values_weights_and_ops_switch() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![2]);
        let idx = g.add_value("i", DType::I64, vec![2]);
        g.inputs.push((x, InputKind::User));
        g.inputs.push((idx, InputKind::User));
        let w = g.add_constant(
            "w",
            Tensor::from_f32(DType::F32, &[2], &[0.1, 2.0]).unwrap(),
        );
        let y = g.add_value("y", DType::F32, vec![2]);
        g.nodes.push(Node {
            name: "full".into(),
            target: "t".into(),
            op: Op::Full {
                shape: vec![2],
                value: Scalar::Float(1.0),
                dtype: DType::F32,
            },
            inputs: vec![],
            outputs: vec![y],
        });
        g.outputs.push((y, OutputKind::User));
        convert_floats(&mut g, DType::BF16).unwrap();
        assert_eq!(g.value(x).dtype, DType::BF16);
        assert_eq!(g.value(idx).dtype, DType::I64);
        assert_eq!(g.constants[&w].dtype(), DType::BF16);
        assert_eq!(g.constants[&w].to_f32_vec(), [0.100_097_656, 2.0]);
        assert!(matches!(
            g.nodes[0].op,
            Op::Full {
                dtype: DType::BF16,
                ..
            }
        ));
        assert!(convert_floats(&mut g, DType::I32).is_err());
    }
}
