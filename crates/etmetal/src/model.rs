//! A loaded program, from a `.pt2` archive (evaluated node by node on the
//! CPU kernels) or a `.pte` file (run by `etmetal-runtime`).

use std::path::Path;

use etmetal_core::{check_inputs, Error, Result, Tensor, TensorSpec};
use etmetal_graph::{Graph, OutputKind};
use etmetal_pte::PteFile;

enum Program {
    Graph(Graph),
    Pte {
        program: etmetal_runtime::Program,
        // boxed: a prepared method is much larger than a graph
        method: Box<etmetal_runtime::Method>,
    },
}

/// A program ready to run on the CPU.
pub struct Model {
    program: Program,
}

/// Whether `path` holds an ExecuTorch program (`ET??` at bytes 4..8; the
/// `.pte` reader names an identifier other than `ET12`).
pub fn is_pte(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut head = [0u8; 8];
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path.display(), e))?;
    let n = file
        .read(&mut head)
        .map_err(|e| Error::io(path.display(), e))?;
    Ok(n == 8 && &head[4..6] == b"ET")
}

impl Model {
    /// Load a `.pte` (method `forward`) or a `.pt2` archive; the format is
    /// told by the file's content, not its name.
    pub fn load(path: &Path) -> Result<Model> {
        Model::load_with(path, etmetal_runtime::LoadOptions::default())
    }

    /// [`Model::load`] with `options` for a `.pte` (its delegate backends).
    pub fn load_with(path: &Path, options: etmetal_runtime::LoadOptions) -> Result<Model> {
        let program = if is_pte(path)? {
            let program = etmetal_runtime::Program::load(path)?.with_options(options);
            let method = program
                .method("forward")
                .map_err(|e| e.context(path.display().to_string()))?;
            Program::Pte {
                program,
                method: Box::new(method),
            }
        } else {
            let mut graph = etmetal_graph::load_pt2(path)?;
            etmetal_graph::decompose(&mut graph, &|_| false);
            etmetal_graph::eliminate_dead_code(&mut graph);
            Program::Graph(graph)
        };
        Ok(Model { program })
    }

    /// A `.pte` program held in memory (method `forward`), e.g. one just
    /// compiled from a `.pt2`.
    pub fn from_pte_bytes(bytes: &[u8], options: etmetal_runtime::LoadOptions) -> Result<Model> {
        let program = etmetal_runtime::Program::from_bytes(bytes)?.with_options(options);
        let method = program.method("forward")?;
        Ok(Model {
            program: Program::Pte {
                program,
                method: Box::new(method),
            },
        })
    }

    /// The graph of a `.pt2` program.
    pub fn graph(&self) -> Option<&Graph> {
        match &self.program {
            Program::Graph(g) => Some(g),
            Program::Pte { .. } => None,
        }
    }

    /// The file of a `.pte` program.
    pub fn pte(&self) -> Option<&PteFile> {
        match &self.program {
            Program::Graph(_) => None,
            Program::Pte { program, .. } => Some(program.file()),
        }
    }

    pub fn inputs(&self) -> Vec<TensorSpec> {
        match &self.program {
            Program::Graph(g) => graph_inputs(g),
            Program::Pte { method, .. } => method.input_specs(),
        }
    }

    /// All-ones inputs of the declared shapes and dtypes.
    pub fn ones_inputs(&self) -> Result<Vec<Tensor>> {
        self.inputs().iter().map(TensorSpec::ones).collect()
    }

    /// Run the program and return its user outputs in order. Inputs are
    /// checked first (count, dtype, shape; float32 rounds into bf16/f16).
    pub fn execute(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match &mut self.program {
            Program::Graph(graph) => {
                let inputs = check_inputs(&graph_inputs(graph), inputs)?;
                let all = crate::eval::run_graph(graph, inputs)?;
                Ok(all
                    .into_iter()
                    .zip(&graph.outputs)
                    .filter(|(_, (_, kind))| *kind == OutputKind::User)
                    .map(|(t, _)| t)
                    .collect())
            }
            Program::Pte { method, .. } => method.execute(inputs),
        }
    }
}

fn graph_inputs(graph: &Graph) -> Vec<TensorSpec> {
    graph
        .user_inputs()
        .map(|v| TensorSpec {
            dtype: graph.value(v).dtype,
            shape: graph.value(v).shape.clone(),
        })
        .collect()
}
