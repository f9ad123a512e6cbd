//! etmetal: load a program exported with `torch.export`, run it, inspect it.
//!
//! The library half of the `etmetal` command. [`Model::load`] reads a `.pt2`
//! archive into the graph IR (decomposed to the core op set) and
//! [`Model::execute`] evaluates it with the CPU kernels.

pub mod compile;
mod eval;
mod model;

pub use model::{InputSpec, Model};
