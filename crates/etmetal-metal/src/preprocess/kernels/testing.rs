//! Test helpers: one op node lowered as a partition of its own.

use etmetal_core::quant::QuantFormat;
use etmetal_core::sym::{SymExpr, SymRange};
use etmetal_core::{DType, Op, Result, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind};

use crate::partitioner::Partition;
use crate::preprocess::lowering::Preprocessed;
use crate::preprocess::options::PreprocessOptions;
use crate::preprocess::preprocess;

/// An operand of a one-node graph: a user input, or a weight (zeros).
#[derive(Clone)]
pub struct Operand {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub weight: bool,
    /// The dim that is the run-time size `s`, in `1..=` its bound.
    pub dynamic: Option<usize>,
}

pub fn input(dtype: DType, shape: &[usize]) -> Option<Operand> {
    Some(Operand {
        dtype,
        shape: shape.to_vec(),
        weight: false,
        dynamic: None,
    })
}

/// A user input whose dim `dim` is the run-time size `s` (one symbol for
/// every such input), in `1..=shape[dim]`.
pub fn dynamic_input(dtype: DType, shape: &[usize], dim: usize) -> Option<Operand> {
    Some(Operand {
        dynamic: Some(dim),
        ..input(dtype, shape)?
    })
}

pub fn weight(dtype: DType, shape: &[usize]) -> Option<Operand> {
    Some(Operand {
        dtype,
        shape: shape.to_vec(),
        weight: true,
        dynamic: None,
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
    lower_quant_linear(QuantFormat::int4(g), dtype, m, n, k)
}

/// A quantized linear of `format` (int32 words), as [`lower_int4_linear`].
pub fn lower_quant_linear(
    format: QuantFormat,
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Preprocessed> {
    let g = format.group_size;
    lower_one(
        format.linear_op(),
        vec![
            input(dtype, &[m, k]),
            weight(DType::I32, &[n, k / format.per_word()]),
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
        if let Some(d) = o.dynamic {
            let max = o.shape[d] as i64;
            graph
                .sym
                .ranges
                .insert("s".into(), SymRange { min: 1, max });
            let mut dims: Vec<SymExpr> =
                o.shape.iter().map(|&n| SymExpr::Const(n as i64)).collect();
            dims[d] = SymExpr::sym("s");
            graph.set_sym_dims(v, dims)?;
        }
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
    etmetal_graph::infer_sym::assign_sym(&mut graph, &node)?;
    graph.nodes.push(node);
    preprocess(&graph, &part, options)
}

/// Preprocess every node of `graph` (its inputs, constants and outputs
/// already listed) as one partition.
pub fn lower_graph(graph: &Graph) -> Result<Preprocessed> {
    let part = Partition {
        id: 0,
        nodes: (0..graph.nodes.len()).collect(),
        inputs: graph.inputs.iter().map(|(v, _)| *v).collect(),
        outputs: graph.outputs.iter().map(|(v, _)| *v).collect(),
        constants: graph.constants.keys().copied().collect(),
        mutated_buffers: vec![],
    };
    preprocess(graph, &part, &PreprocessOptions::default())
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

/// The dispatches of `p` that have alternatives, after checking that at
/// each of `sizes` (of its one symbol) every dispatch of an alternative
/// runs (has workgroups) exactly where the dispatch it replaces does: the
/// same size bucket.
pub fn alternatives_gated_alike(p: &crate::payload::Payload, sizes: &[i64]) -> usize {
    let runs = |d: &crate::payload::Dispatch, n: i64| match &d.groups {
        Some(g) => g.eval(&[n]).unwrap() > 0,
        None => true,
    };
    let with: Vec<_> = p
        .dispatches
        .iter()
        .filter(|d| !d.alternatives.is_empty())
        .collect();
    for (i, d) in with.iter().enumerate() {
        for &n in sizes {
            for inner in d.alternatives.iter().flat_map(|a| &a.dispatches) {
                let name = &p.kernels[inner.kernel].name;
                assert_eq!(runs(inner, n), runs(d, n), "{name} (of {i}) at {n}");
            }
        }
    }
    with.len()
}
