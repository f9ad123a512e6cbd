//! etmetal's C API: `include/etmetal.h` (generated from this crate by
//! cbindgen), `libetmetal_capi.so`/`.dylib` and `libetmetal_capi.a`.
//!
//! A program (`EtmetalProgram`) is a `.pte` loaded from a path or from
//! bytes onto the device the `etmetal run --device` rule chooses
//! (`etmetal::device`), as an `etmetal::Model`; a method (`EtmetalMethod`)
//! has input and output specs and runs on the caller's buffers. Every
//! function runs inside a guard: a panic becomes an
//! `ETMETAL_STATUS_INTERNAL` error, and a failure leaves its status and a
//! one-line message as the calling thread's last error. Null pointers are
//! errors naming the argument. Each function's header comment says from
//! which threads it may be called. `docs/EMBEDDING.md` shows the use from
//! C, C++ and Swift.

mod counters;
mod error;
mod execute;
mod method;
mod program;
mod tensor;

pub use counters::{EtmetalMethodCounters, EtmetalProgramCounters};
pub use error::*;
pub use execute::{etmetal_method_execute, EtmetalInput, EtmetalOutput};
pub use method::*;
pub use program::*;
pub use tensor::*;

use std::ffi::c_char;

// The handles are shared by raw pointer between the caller's threads.
const _: () = {
    const fn shared_between_threads<T: Send + Sync>() {}
    shared_between_threads::<EtmetalProgram>();
    shared_between_threads::<EtmetalMethod>();
};

/// The library's version ("0.1.0"), a static string; `ETMETAL_VERSION` is
/// the header's.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn etmetal_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
