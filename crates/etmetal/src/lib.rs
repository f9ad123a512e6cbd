//! etmetal: load a program exported with `torch.export`, run it, inspect it.
//!
//! The library half of the `etmetal` command. [`Model::load`] reads a `.pt2`
//! archive into the graph IR (decomposed to the core op set) or a `.pte`
//! into `etmetal-runtime`, and [`Model::execute`] runs it on the CPU
//! kernels, with the `.pte`'s GPU delegates on the backends given to
//! [`Model::load_with`] (`etmetal_metal_runtime::MetalBackend`);
//! [`compile::compile_pt2_cpu`] writes a `.pt2` as a `.pte` of
//! ExecuTorch portable-kernel calls.

pub mod audio;
pub mod calibrate;
pub mod chat;
pub mod compile;
pub mod device;
pub mod generate;
mod model;
pub mod summary;
pub mod transcribe;

/// The graph interpreter, at home in `etmetal-graph` (its passes and tests
/// run graphs too); re-exported so that `etmetal::eval::run_graph` stays.
pub use etmetal_graph::eval;
pub use model::{is_pte, Model};
