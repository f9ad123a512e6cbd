//! A loaded program: the graph, its user inputs and outputs, and execution.

use std::path::Path;

use etmetal_core::{DType, Error, Result, Tensor};
use etmetal_graph::{Graph, OutputKind};

/// What a user input must look like.
#[derive(Clone, Debug, PartialEq)]
pub struct InputSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// A program loaded from a `.pt2` archive, ready to run on the CPU.
pub struct Model {
    graph: Graph,
}

impl Model {
    /// Import a `.pt2` archive and decompose it to the core op set.
    pub fn load(path: &Path) -> Result<Model> {
        let mut graph = etmetal_graph::load_pt2(path)?;
        etmetal_graph::decompose(&mut graph, &|_| false);
        etmetal_graph::eliminate_dead_code(&mut graph);
        Ok(Model { graph })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    pub fn inputs(&self) -> Vec<InputSpec> {
        self.graph
            .user_inputs()
            .map(|v| {
                let info = self.graph.value(v);
                InputSpec {
                    name: info.name.clone(),
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                }
            })
            .collect()
    }

    /// All-ones inputs of the declared shapes and dtypes.
    pub fn ones_inputs(&self) -> Result<Vec<Tensor>> {
        self.inputs()
            .iter()
            .map(|spec| {
                let n = etmetal_core::shape::numel(&spec.shape)?;
                Tensor::from_f64(spec.dtype, &spec.shape, &vec![1.0; n])
            })
            .collect()
    }

    /// Check the inputs against the program: count, shape and dtype. A
    /// float32 tensor given for a bf16 or f16 input is rounded to it
    /// (NumPy has no bfloat16).
    pub fn check_inputs(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let specs = self.inputs();
        if inputs.len() != specs.len() {
            return Err(Error::invalid_input(format!(
                "the program takes {} input(s) ({}), {} given",
                specs.len(),
                specs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                inputs.len()
            )));
        }
        inputs
            .into_iter()
            .zip(&specs)
            .enumerate()
            .map(|(i, (t, spec))| {
                if t.shape() != spec.shape.as_slice() {
                    return Err(Error::invalid_input(format!(
                        "input {i} (`{}`): expected shape {:?}, got {:?}",
                        spec.name,
                        spec.shape,
                        t.shape()
                    )));
                }
                let rounds_down =
                    t.dtype() == DType::F32 && matches!(spec.dtype, DType::BF16 | DType::F16);
                if t.dtype() == spec.dtype {
                    Ok(t)
                } else if rounds_down {
                    t.cast(spec.dtype)
                } else {
                    Err(Error::invalid_input(format!(
                        "input {i} (`{}`): expected dtype {}, got {}",
                        spec.name,
                        spec.dtype,
                        t.dtype()
                    )))
                }
            })
            .collect()
    }

    /// Run the program and return its user outputs in order.
    pub fn execute(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let inputs = self.check_inputs(inputs)?;
        let all = crate::eval::run_graph(&self.graph, inputs)?;
        Ok(all
            .into_iter()
            .zip(&self.graph.outputs)
            .filter(|(_, (_, kind))| *kind == OutputKind::User)
            .map(|(t, _)| t)
            .collect())
    }
}
