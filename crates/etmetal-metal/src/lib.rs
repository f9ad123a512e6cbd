//! The etmetal Metal backend, compile-time half: the partitioner (which
//! nodes of a graph the GPU delegate takes), preprocess (a partition into
//! WGSL/MSL kernels and a dispatch plan), the delegate payload format and
//! the delegate's compile specs. Without the default `compiler` feature
//! only the payload format and compile specs build (what the GPU runtime
//! needs).
//!
//! Dependencies run one way: `payload` and `op_table` (which ops have a
//! GPU form, and which) are leaves; the partitioner reads both;
//! preprocess reads both and the partitioner's `Partition`. The size of a
//! value on the GPU, which the partitioner checks against the binding
//! limit, is `payload::value_gpu_bytes`, the rule preprocess's buffers
//! follow.
//!
//! ```no_run
//! use etmetal_metal::partitioner::{ops_to_not_decompose, partition, PartitionOptions};
//! # fn main() -> etmetal_core::Result<()> {
//! let mut graph = etmetal_graph::load_pt2("model.pt2".as_ref())?;
//! etmetal_graph::decompose(&mut graph, &ops_to_not_decompose);
//! let parts = partition(&graph, &PartitionOptions::default())?;
//! for p in &parts.partitions {
//!     println!("{}: {} nodes", p.tag(), p.nodes.len());
//! }
//! # Ok(())
//! # }
//! ```

pub mod compile_spec;
#[cfg(feature = "compiler")]
mod op_table;
#[cfg(feature = "compiler")]
pub mod partitioner;
pub mod payload;
#[cfg(feature = "compiler")]
pub mod preprocess;

/// The delegate id written into `.pte` files (our own, no other backend's).
pub const BACKEND_ID: &str = "EtMetalBackend";
