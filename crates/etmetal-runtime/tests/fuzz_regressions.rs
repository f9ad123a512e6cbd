//! Inputs the fuzzers found (`fuzz/regressions/<target>/`), replayed under
//! the runtime's default options, which the `pte_load` fuzz target tightens
//! to keep libFuzzer inside its memory limit. Each must load, or be refused
//! with a typed error, without a panic and without allocating what the file
//! merely declares.

use std::path::Path;

use etmetal_runtime::{LoadOptions, Program};

#[test]
fn pte_load_regressions_load_under_the_default_limits() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/pte_load");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no regression inputs in {}",
        dir.display()
    );
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        let program = Program::from_bytes(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .with_options(LoadOptions::default());
        // The oom regression declares a 4 GiB arena that no tensor reaches:
        // the runtime allocates what planned tensors cover, so it loads.
        if let Err(e) = program.method("forward") {
            panic!("{}: {e}", file.display());
        }
    }
}
