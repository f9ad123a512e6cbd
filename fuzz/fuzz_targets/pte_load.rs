//! `.pte` bytes -> verified file -> runtime program -> `forward` prepared.
//! Loading only: executing would fuzz the kernels, not the loader.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(file) = etmetal_pte::parse(data) {
        // same as `Program::from_bytes(data)` without parsing a second time
        let program = etmetal_runtime::Program::from_file(file);
        let _ = program.method("forward");
    }
});
