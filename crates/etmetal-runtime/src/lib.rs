//! Load and run ExecuTorch `.pte` programs on etmetal's CPU kernels.
//!
//! [`Program::load`] maps and verifies the file; [`Program::method`] prepares
//! one execution plan (arenas allocated, kernel calls decoded, delegates
//! initialised through a [`BackendRegistry`]); [`Method::execute`] runs it.
//!
//! ```no_run
//! # fn main() -> etmetal_core::Result<()> {
//! use etmetal_core::{Tensor, npy};
//! let program = etmetal_runtime::Program::load("model.pte")?;
//! let mut method = program.method("forward")?;
//! let inputs: Vec<Tensor> = method
//!     .input_specs()
//!     .iter()
//!     .map(|s| Tensor::zeros(s.dtype, &s.shape))
//!     .collect::<etmetal_core::Result<_>>()?;
//! for (i, t) in method.execute(inputs)?.iter().enumerate() {
//!     npy::write(format!("output_{i}.npy").as_ref(), t)?;
//! }
//! # Ok(())
//! # }
//! ```

mod backend;
mod method;
pub mod trace;
mod values;

use std::path::Path;

use etmetal_core::{Error, Result};
use etmetal_pte::PteFile;

pub use backend::{Backend, BackendRegistry, DelegateArg, DelegateHandle, NamedData};
pub use etmetal_core::TensorSpec;
pub use method::Method;
pub use values::copy_bytes;

/// Default cap on a method's planned memory.
pub const DEFAULT_MAX_ARENA_BYTES: u64 = 16 << 30;

/// How methods are loaded.
#[derive(Clone)]
pub struct LoadOptions {
    /// Refuse a method whose planned memory (all of `non_const_buffer_sizes`)
    /// is larger, before allocating any of it.
    pub max_arena_bytes: u64,
    pub backends: BackendRegistry,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions {
            max_arena_bytes: DEFAULT_MAX_ARENA_BYTES,
            backends: BackendRegistry::new(),
        }
    }
}

/// A verified `.pte` file.
pub struct Program {
    file: PteFile,
    options: LoadOptions,
}

impl Program {
    /// Memory-map and verify `path`; constants stay borrowed from the map.
    pub fn load(path: impl AsRef<Path>) -> Result<Program> {
        Ok(Program::from_file(PteFile::load(path)?))
    }

    /// Verify a program held in memory (copied once).
    pub fn from_bytes(bytes: &[u8]) -> Result<Program> {
        Ok(Program::from_file(etmetal_pte::parse(bytes)?))
    }

    pub fn from_file(file: PteFile) -> Program {
        Program {
            file,
            options: LoadOptions::default(),
        }
    }

    pub fn with_options(mut self, options: LoadOptions) -> Program {
        self.options = options;
        self
    }

    pub fn file(&self) -> &PteFile {
        &self.file
    }

    pub fn method_names(&self) -> Vec<&str> {
        self.file
            .program
            .execution_plan
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    }

    /// Prepare method `name` to run.
    pub fn method(&self, name: &str) -> Result<Method> {
        let plan = self
            .file
            .program
            .execution_plan
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| {
                Error::invalid_input(format!(
                    "no method `{name}` in the program (methods: {})",
                    self.method_names().join(", ")
                ))
            })?;
        Method::load(
            &self.file,
            plan,
            &self.options.backends,
            self.options.max_arena_bytes,
        )
        .map_err(|e| e.context(format!("method `{name}`")))
    }
}
