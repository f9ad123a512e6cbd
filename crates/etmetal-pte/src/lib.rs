//! ExecuTorch `.pte` program files: read with full verification, write in
//! the exact layout ExecuTorch produces (FORMATS.md part A).
//!
//! - [`schema`]: owned structs mirroring `program.fbs` (ExecuTorch 1.5.1).
//! - [`read`]: [`parse`] / [`PteFile::load`] — identifier, `eh00` header,
//!   flatbuffer verifier, decoding, then [`verify`]'s semantic checks.
//! - [`write`]: [`serialize`] plus constant-segment and named-data helpers.
//! - [`named_data`]: [`NamedDataStore`], a program's weights deduplicated
//!   by key and bytes before they are written.
//! - `testing` (feature `testing`): programs the runtime crates' tests
//!   build by hand.

mod fb;
pub mod header;
pub mod kernels;
pub mod named_data;
pub mod read;
pub mod schema;
#[cfg(feature = "testing")]
pub mod testing;
pub mod verify;
pub mod write;

pub use header::ExtendedHeader;
pub use named_data::NamedDataStore;
pub use read::{parse, PteFile};
pub use schema::*;
pub use write::{
    add_named_data, constant_segment, layout_segments, serialize, serialize_as_is,
    serialize_to_file, Segment,
};
