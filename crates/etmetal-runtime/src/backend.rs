//! Delegates: a registry of backends by id, each turning a delegate's
//! processed payload into a handle the method calls at `DelegateCall`s.

use std::sync::Arc;

use etmetal_core::{Error, Result, Tensor};
use etmetal_pte::CompileSpec;

/// One argument of a delegate call, as the method holds it.
#[derive(Clone, Debug)]
pub enum DelegateArg {
    Tensor(Tensor),
    Int(i64),
    Double(f64),
    Bool(bool),
    /// `Null` and the list kinds, which delegates do not take.
    Other,
}

/// A delegate ready to run (made once at method load).
pub trait DelegateHandle: Send {
    /// Run with the call's arguments (inputs, then outputs, as the program
    /// lists them). Output tensors are replaced in `args`; the method copies
    /// them back into its planned memory (their dtype and shape must stay).
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()>;
}

/// A delegate backend, looked up by the `BackendDelegate.id` it owns.
pub trait Backend: Send + Sync {
    fn id(&self) -> &str;
    fn init(
        &self,
        processed: &[u8],
        compile_specs: &[CompileSpec],
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
