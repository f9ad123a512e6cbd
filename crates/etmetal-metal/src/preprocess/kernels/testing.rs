//! Test helpers: one op node lowered as a partition of its own.

use etmetal_core::{DType, Op, Result, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};

use crate::partitioner::Partition;
use crate::preprocess::{preprocess, PreprocessOptions, Preprocessed};

/// An operand of a one-node graph: a user input, or a weight (zeros).
#[derive(Clone)]
pub struct Operand {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub weight: bool,
}

pub fn input(dtype: DType, shape: &[usize]) -> Option<Operand> {
    Some(Operand {
        dtype,
        shape: shape.to_vec(),
        weight: false,
    })
}

pub fn weight(dtype: DType, shape: &[usize]) -> Option<Operand> {
    Some(Operand {
        dtype,
        shape: shape.to_vec(),
        weight: true,
    })
}

/// Preprocess the graph of one `op` node over `operands` (`None`: an
/// absent optional input) as one partition.
pub fn lower_one(op: Op, operands: Vec<Option<Operand>>) -> Result<Preprocessed> {
    lower_one_with(op, operands, &PreprocessOptions::default())
}

/// An int4 linear `[m, k] @ [n, k]ᵀ` with `dtype` activations, scales and
/// zeros, and groups of `g`, lowered with [`lower_one`].
pub fn lower_int4_linear(
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    g: usize,
) -> Result<Preprocessed> {
    lower_one(
        Op::Int4Linear { group_size: g },
        vec![
            input(dtype, &[m, k]),
            weight(DType::I32, &[n, k / 8]),
            weight(dtype, &[n, k / g]),
            weight(dtype, &[n, k / g]),
        ],
    )
}

/// [`lower_one`] with `options`.
pub fn lower_one_with(
    op: Op,
    operands: Vec<Option<Operand>>,
    options: &PreprocessOptions,
) -> Result<Preprocessed> {
    let mut graph = Graph::default();
    let mut part = Partition {
        id: 0,
        nodes: vec![0],
        inputs: vec![],
        outputs: vec![],
        constants: vec![],
        mutated_buffers: vec![],
    };
    let mut inputs = vec![];
    for (i, o) in operands.into_iter().enumerate() {
        let Some(o) = o else {
            inputs.push(None);
            continue;
        };
        let v = graph.add_value(format!("in{i}"), o.dtype, o.shape.clone());
        if o.weight {
            graph.constants.insert(v, Tensor::zeros(o.dtype, &o.shape)?);
            part.constants.push(v);
        } else {
            graph.inputs.push((v, InputKind::User));
            part.inputs.push(v);
        }
        inputs.push(Some(v));
    }
    let mut node = Node {
        name: "n0".into(),
        target: "test".into(),
        op,
        inputs,
        outputs: vec![],
    };
    for (k, (dtype, shape)) in etmetal_graph::infer::infer(&graph, &node)?
        .into_iter()
        .enumerate()
    {
        let v = graph.add_value(format!("out{k}"), dtype, shape);
        node.outputs.push(v);
        graph.outputs.push((v, OutputKind::User));
        part.outputs.push(v);
    }
    graph.nodes.push(node);
    preprocess(&graph, &part, options)
}

/// [`lower_one`] over user inputs of `(dtype, shape)` (`None`: an empty
/// slot).
pub fn lower_inputs(op: Op, inputs: &[Option<(DType, &[usize])>]) -> Result<Preprocessed> {
    lower_one(
        op,
        inputs
            .iter()
            .map(|s| s.and_then(|(d, shape)| input(d, shape)))
            .collect(),
    )
}
