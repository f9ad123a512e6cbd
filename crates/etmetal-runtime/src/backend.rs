//! Delegates: a registry of backends by id, each turning a delegate's
//! processed payload into a handle the method calls at `DelegateCall`s.

use std::sync::Arc;

use std::collections::HashMap;

use etmetal_core::{Error, Result, Tensor, View, ViewMut};
use etmetal_pte::{CompileSpec, PteFile};

/// One argument of a delegate call, as the method holds it.
#[derive(Debug)]
pub enum DelegateArg<'a> {
    /// An input tensor, lent from where the method keeps it (its planned
    /// memory, or the mapped file for a constant): the delegate converts
    /// it straight into its device's staging memory, with no copy between.
    Tensor(View<'a>),
    /// An output: the method's memory for it, which the delegate fills.
    Output(ViewMut<'a>),
    Int(i64),
    Double(f64),
    Bool(bool),
    /// A mutable buffer the delegate keeps resident (see
    /// [`DelegateHandle::resident_args`]) whose device copy is current: no
    /// host value is passed.
    Resident,
    /// `Null` and the list kinds, which delegates do not take.
    Other,
}

/// A delegate ready to run (made once at method load).
pub trait DelegateHandle: Send {
    /// Run with the call's arguments (inputs, then outputs, as the program
    /// lists them). The last [`DelegateHandle::output_count`] are
    /// [`DelegateArg::Output`]s: the delegate writes its results there, in
    /// place (no copy of a large output through a new tensor).
    fn execute(&mut self, args: &mut [DelegateArg<'_>]) -> Result<()>;

    /// How many of the call's arguments, at its end, are outputs.
    fn output_count(&self) -> usize;

    /// For a delegate of bounded-dynamic shapes: the shapes of its outputs
    /// when its inputs have `inputs` shapes (`None` where an argument is no
    /// tensor), or the error naming an input outside its range. `None`
    /// (the default): the delegate runs the static shapes it was compiled
    /// for, and its dynamic inputs must be at their bound.
    fn output_shapes(&self, _inputs: &[Option<&[usize]>]) -> Option<Result<Vec<Vec<usize>>>> {
        None
    }

    /// Put any state the delegate keeps across executes (device-resident
    /// mutable buffers) back to its initial value; stateless delegates
    /// have nothing to do.
    fn reset_state(&mut self) -> Result<()> {
        Ok(())
    }

    /// Argument positions (inputs) of the mutable buffers this delegate
    /// keeps on its device across executes, writing their new value there
    /// itself. The method then passes [`DelegateArg::Resident`] at such a
    /// position while the device copy is current, and the buffer's host
    /// value (written into the device copy) after a reset or when another
    /// method changed the state; no other instruction may touch the buffer.
    fn resident_args(&self) -> Vec<usize> {
        vec![]
    }

    /// The current device value of the resident buffer at argument `position`.
    fn read_state(&mut self, position: usize) -> Result<Tensor> {
        Err(Error::internal(format!(
            "the delegate keeps no state at argument {position}"
        )))
    }
}

/// The program's named data (weights a delegate payload refers to by key).
pub trait NamedData {
    /// The bytes of `key`; an error naming it when the program has none.
    fn get(&self, key: &str) -> Result<&[u8]>;

    /// The caller has copied `bytes` (part of what [`NamedData::get`]
    /// returned) to its device and will not read them again: a file mapping
    /// may give those pages back, so that loading does not hold the weights
    /// twice in host memory. Reading them later stays correct (the pages
    /// come back from the file). Held in memory: nothing to do.
    fn release(&self, _bytes: &[u8]) {}
}

impl NamedData for PteFile {
    fn get(&self, key: &str) -> Result<&[u8]> {
        self.named_data(key)
    }

    fn release(&self, bytes: &[u8]) {
        PteFile::release(self, bytes)
    }
}

/// Named data held in memory (for programs assembled by hand).
impl NamedData for HashMap<String, Vec<u8>> {
    fn get(&self, key: &str) -> Result<&[u8]> {
        HashMap::get(self, key).map(Vec::as_slice).ok_or_else(|| {
            Error::invalid_input(format!("named data `{key}` is not in the program"))
        })
    }
}

/// A delegate backend, looked up by the `BackendDelegate.id` it owns.
pub trait Backend: Send + Sync {
    fn id(&self) -> &str;
    /// Prepare one delegate: `processed` is its payload, `named_data` the
    /// program's named data (read during `init` only).
    fn init(
        &self,
        processed: &[u8],
        compile_specs: &[CompileSpec],
        named_data: &dyn NamedData,
    ) -> Result<Box<dyn DelegateHandle>>;
}

/// The backends a method may use; empty by default.
#[derive(Clone, Default)]
pub struct BackendRegistry {
    backends: Vec<Arc<dyn Backend>>,
}

impl BackendRegistry {
    pub fn new() -> BackendRegistry {
        BackendRegistry::default()
    }

    /// Add a backend; a second backend with the same id is an error.
    pub fn register(&mut self, backend: Arc<dyn Backend>) -> Result<()> {
        if self.get(backend.id()).is_some() {
            return Err(Error::invalid_input(format!(
                "backend `{}` is already registered",
                backend.id()
            )));
        }
        self.backends.push(backend);
        Ok(())
    }

    pub fn ids(&self) -> Vec<&str> {
        self.backends.iter().map(|b| b.id()).collect()
    }

    pub fn get(&self, id: &str) -> Option<&Arc<dyn Backend>> {
        self.backends.iter().find(|b| b.id() == id)
    }

    /// The backend for `id`, or an error naming it and the registered ids.
    pub fn require(&self, id: &str) -> Result<&Arc<dyn Backend>> {
        self.get(id).ok_or_else(|| {
            let ids = self.ids();
            let registered = if ids.is_empty() {
                "none".to_string()
            } else {
                ids.join(", ")
            };
            Error::unsupported(format!(
                "delegate backend `{id}` is not registered (registered: {registered})"
            ))
        })
    }
}
