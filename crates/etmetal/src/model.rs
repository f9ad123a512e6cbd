//! A loaded program, from a `.pt2` archive (evaluated node by node on the
//! CPU kernels) or a `.pte` file (run by `etmetal-runtime`).
//!
//! A `.pte` may hold several methods (`forward` and `prefill` of one
//! decoder): all are loaded, and their mutable buffers of the same fully
//! qualified name are one state. When a call switches methods, the state
//! the previous method left (read back from the GPU where a delegate kept
//! it) is handed to the next one (uploaded again by its delegates at their
//! next execute); calls of one method move no state.

use std::path::Path;

use etmetal_core::{check_inputs, Error, Result, Tensor, TensorSpec, View};
use etmetal_graph::{Graph, InputKind, OutputKind, ValueId};
use etmetal_pte::PteFile;

enum Program {
    Graph(Graph),
    Pte {
        program: etmetal_runtime::Program,
        /// In the file's order; `forward` is among them.
        methods: Vec<etmetal_runtime::Method>,
        /// The method that ran last, which holds the current state.
        last: Option<usize>,
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
        let graph_state = graph
            .buffer_mutations()?
            .into_iter()
            .filter_map(|(b, _)| graph.constants.get(&b).map(|t| (b, t.clone())))
            .collect();
        Ok(Model {
            program: Program::Graph(graph),
            graph_state,
        })
    }

    /// A `.pte` program held in memory (every method), e.g. one just
    /// compiled from a `.pt2`.
    pub fn from_pte_bytes(bytes: &[u8], options: etmetal_runtime::LoadOptions) -> Result<Model> {
        Model::from_pte_program(etmetal_runtime::Program::from_bytes(bytes)?, options)
    }

    /// An already loaded `.pte` program (every method: `forward`, or
    /// others such as Whisper's `encoder` and `text_decoder`), run with
    /// `options`.
    pub fn from_pte_program(
        program: etmetal_runtime::Program,
        options: etmetal_runtime::LoadOptions,
    ) -> Result<Model> {
        let program = program.with_options(options);
        if program.method_names().is_empty() {
            return Err(Error::invalid_input("the program has no methods"));
        }
        let methods = program
            .method_names()
            .into_iter()
            .map(|name| program.method(name))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            program: Program::Pte {
                program,
                methods,
                last: None,
            },
            graph_state: vec![],
        })
    }

    /// The program's method names (a `.pt2` has only `forward`).
    pub fn method_names(&self) -> Vec<&str> {
        match &self.program {
            Program::Graph(_) => vec!["forward"],
            Program::Pte { methods, .. } => methods.iter().map(|m| m.name()).collect(),
        }
    }

    pub fn has_method(&self, name: &str) -> bool {
        self.method_names().contains(&name)
    }

    /// The inputs of method `name`.
    pub fn method_inputs(&self, name: &str) -> Result<Vec<TensorSpec>> {
        match &self.program {
            Program::Graph(g) if name == "forward" => Ok(graph_inputs(g)),
            Program::Pte { methods, .. } => Ok(methods[self.method_index(name)?].input_specs()),
            Program::Graph(_) => Err(self.no_method(name)),
        }
    }

    /// The user outputs of method `name`.
    pub fn method_outputs(&self, name: &str) -> Result<Vec<TensorSpec>> {
        match &self.program {
            Program::Graph(g) if name == "forward" => Ok(g
                .user_outputs()
                .map(|v| TensorSpec {
                    dtype: g.value(v).dtype,
                    shape: g.value(v).shape.clone(),
                    dynamic: vec![],
                })
                .collect()),
            Program::Pte { methods, .. } => Ok(methods[self.method_index(name)?].output_specs()),
            Program::Graph(_) => Err(self.no_method(name)),
        }
    }

    fn method_index(&self, name: &str) -> Result<usize> {
        match &self.program {
            Program::Pte { methods, .. } => methods
                .iter()
                .position(|m| m.name() == name)
                .ok_or_else(|| self.no_method(name)),
            Program::Graph(_) if name == "forward" => Ok(0),
            Program::Graph(_) => Err(self.no_method(name)),
        }
    }

    fn no_method(&self, name: &str) -> Error {
        Error::invalid_input(format!(
            "no method `{name}` in the program (methods: {})",
            self.method_names().join(", ")
        ))
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

    /// The inputs of `forward` (none where the program has no `forward`).
    pub fn inputs(&self) -> Vec<TensorSpec> {
        self.method_inputs("forward").unwrap_or_default()
    }

    /// All-ones inputs of the declared shapes and dtypes.
    pub fn ones_inputs(&self) -> Result<Vec<Tensor>> {
        self.inputs().iter().map(TensorSpec::ones).collect()
    }

    /// Run `forward` and return its user outputs in order. Inputs are
    /// checked first (count, dtype, shape; float32 rounds into bf16/f16).
    pub fn execute(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.execute_method("forward", inputs)
    }

    /// Run method `name` (as [`Model::execute`] runs `forward`) on the
    /// state every method of the model shares.
    pub fn execute_method(&mut self, name: &str, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let index = self.method_index(name)?;
        match &mut self.program {
            Program::Graph(graph) => {
                let inputs = check_inputs(&graph_inputs(graph), inputs)?;
                let all = crate::eval::run_graph(graph, inputs)?;
                let mutated = graph.buffer_mutations()?;
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
            Program::Pte { methods, last, .. } => {
                enter(methods, last, index)?;
                methods[index].execute(inputs)
            }
        }
    }

    /// [`Model::execute_method`] on borrowed inputs, each of exactly its
    /// input's dtype, handing each output to `output` where the method keeps
    /// it (valid for the call only): a `.pte`'s inputs and outputs are
    /// copied once each, between the caller's memory and planned memory
    /// (`etmetal_runtime::Method::execute_borrowed`).
    pub fn execute_method_borrowed(
        &mut self,
        name: &str,
        inputs: &[View<'_>],
        output: &mut dyn FnMut(usize, View<'_>) -> Result<()>,
    ) -> Result<()> {
        let index = self.method_index(name)?;
        match &mut self.program {
            Program::Graph(_) => {
                let tensors = inputs
                    .iter()
                    .map(|t| Tensor::from_bytes(t.dtype, t.shape, t.bytes))
                    .collect::<Result<Vec<_>>>()?;
                let outputs = self.execute_method(name, tensors)?;
                outputs
                    .iter()
                    .enumerate()
                    .try_for_each(|(i, t)| output(i, View::of(t)))
            }
            Program::Pte { methods, last, .. } => {
                enter(methods, last, index)?;
                methods[index].execute_borrowed(inputs, output)
            }
        }
    }

    /// The current value of every named mutable buffer (KV caches,
    /// counters), by fully qualified name, as the method that ran last left
    /// it (read back from the GPU where a delegate keeps it).
    pub fn read_state(&mut self) -> Result<Vec<(String, Tensor)>> {
        match &mut self.program {
            Program::Graph(graph) => Ok(graph
                .inputs
                .iter()
                .filter_map(|(v, kind)| match kind {
                    InputKind::Buffer { fqn, .. }
                        if self.graph_state.iter().any(|(b, _)| b == v) =>
                    {
                        Some((fqn.clone(), graph.constants.get(v)?.clone()))
                    }
                    _ => None,
                })
                .collect()),
            Program::Pte { methods, last, .. } => methods[last.unwrap_or(0)].read_state(),
        }
    }

    /// Put every mutated buffer (KV caches, counters) of every method back
    /// to its initial value; otherwise state carries from one execute to the
    /// next.
    pub fn reset_state(&mut self) -> Result<()> {
        match &mut self.program {
            Program::Graph(graph) => {
                for (b, t) in &self.graph_state {
                    graph.constants.insert(*b, t.clone());
                }
                Ok(())
            }
            Program::Pte { methods, last, .. } => {
                *last = None;
                methods.iter_mut().try_for_each(|m| m.reset_state())
            }
        }
    }
}

/// Make method `index` the holder of the state, handing it what the
/// method that ran last left.
fn enter(
    methods: &mut [etmetal_runtime::Method],
    last: &mut Option<usize>,
    index: usize,
) -> Result<()> {
    if let Some(prev) = last.filter(|&p| p != index) {
        let state = methods[prev].read_state()?;
        methods[index].write_state(&state)?;
    }
    // a failed execute may have left the state half written, in this
    // method: it stays the holder either way
    *last = Some(index);
    Ok(())
}

fn graph_inputs(graph: &Graph) -> Vec<TensorSpec> {
    graph
        .user_inputs()
        .map(|v| TensorSpec {
            dtype: graph.value(v).dtype,
            shape: graph.value(v).shape.clone(),
            dynamic: vec![],
        })
        .collect()
}
