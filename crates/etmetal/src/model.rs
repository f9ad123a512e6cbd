//! A loaded program, from a `.pt2` archive (evaluated node by node on the
//! CPU kernels) or a `.pte` file (run by `etmetal-runtime`).

use std::path::Path;

use etmetal_core::{check_inputs, Error, Result, Tensor, TensorSpec};
use etmetal_graph::{Graph, InputKind, OutputKind, ValueId};
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
    /// A `.pt2`'s mutated buffers and their initial values: the graph's
    /// constant holds the current state, replaced after each execute.
    graph_state: Vec<(ValueId, Tensor)>,
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
        if is_pte(path)? {
            return Model::from_pte_program(etmetal_runtime::Program::load(path)?, options)
                .map_err(|e| e.context(path.display().to_string()));
        }
        let mut graph = etmetal_graph::load_pt2(path)?;
        etmetal_graph::decompose(&mut graph, &|_| false);
        etmetal_graph::eliminate_dead_code(&mut graph);
        let graph_state = mutated_buffers(&graph)
            .into_iter()
            .filter_map(|(b, _)| graph.constants.get(&b).map(|t| (b, t.clone())))
            .collect();
        Ok(Model {
            program: Program::Graph(graph),
            graph_state,
        })
    }

    /// A `.pte` program held in memory (method `forward`), e.g. one just
    /// compiled from a `.pt2`.
    pub fn from_pte_bytes(bytes: &[u8], options: etmetal_runtime::LoadOptions) -> Result<Model> {
        Model::from_pte_program(etmetal_runtime::Program::from_bytes(bytes)?, options)
    }

    /// An already loaded `.pte` program (method `forward`), run with `options`.
    pub fn from_pte_program(
        program: etmetal_runtime::Program,
        options: etmetal_runtime::LoadOptions,
    ) -> Result<Model> {
        let program = program.with_options(options);
        let method = program.method("forward")?;
        Ok(Model {
            program: Program::Pte {
                program,
                method: Box::new(method),
            },
            graph_state: vec![],
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
                let mutated = mutated_buffers(graph);
                let mut user = vec![];
                for (t, (v, kind)) in all.into_iter().zip(graph.outputs.clone()) {
                    match kind {
                        OutputKind::User => user.push(t),
                        OutputKind::BufferMutation { .. } => {
                            if let Some((b, _)) = mutated.iter().find(|(_, new)| *new == v) {
                                graph.constants.insert(*b, t);
                            }
                        }
                        OutputKind::UserInputMutation { .. } => {}
                    }
                }
                Ok(user)
            }
            Program::Pte { method, .. } => method.execute(inputs),
        }
    }

    /// Put every mutated buffer (KV caches, counters) back to its initial
    /// value; otherwise state carries from one [`Model::execute`] to the next.
    pub fn reset_state(&mut self) -> Result<()> {
        match &mut self.program {
            Program::Graph(graph) => {
                for (b, t) in &self.graph_state {
                    graph.constants.insert(*b, t.clone());
                }
                Ok(())
            }
            Program::Pte { method, .. } => method.reset_state(),
        }
    }
}

/// `(buffer input, new value output)` of each buffer mutation of `graph`.
fn mutated_buffers(graph: &Graph) -> Vec<(ValueId, ValueId)> {
    graph
        .outputs
        .iter()
        .filter_map(|(new, kind)| {
            let OutputKind::BufferMutation { fqn } = kind else {
                return None;
            };
            graph.inputs.iter().find_map(|(v, k)| match k {
                InputKind::Buffer { fqn: f, .. } if f == fqn => Some((*v, *new)),
                _ => None,
            })
        })
        .collect()
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
