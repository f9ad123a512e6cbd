//! `.pte` bytes -> verified file -> runtime program -> `forward` prepared.
//! Loading only: executing would fuzz the kernels, not the loader.
#![no_main]

use etmetal_runtime::{LoadOptions, Program};
use libfuzzer_sys::fuzz_target;

/// The default limit (16 GiB) lets one changed byte of a 2.8 KB file allocate
/// and zero gigabytes (see regressions/pte_load/), which libFuzzer reports as
/// an out-of-memory and stops at; below this cap the loader must refuse cleanly.
const MAX_ARENA_BYTES: u64 = 256 << 20;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = etmetal_pte::parse(data) {
        // same as `Program::from_bytes(data)` without parsing a second time
        let program = Program::from_file(file).with_options(LoadOptions {
            max_arena_bytes: MAX_ARENA_BYTES,
            ..LoadOptions::default()
        });
        let _ = program.method("forward");
    }
});
