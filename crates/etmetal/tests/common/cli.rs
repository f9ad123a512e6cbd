//! Running the `etmetal` binary as a user does, for the command-line tests
//! (`cli.rs`, `quantize.rs`, `generate.rs`; each includes this file with
//! `#[path]` and uses a subset, hence the allow).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `tests/fixtures/<name>` at the repository root.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The built `etmetal` binary run with `args`.
pub fn etmetal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_etmetal"))
        .args(args)
        .output()
        .unwrap()
}

/// A fresh scratch folder for one test (`tag`: the test binary's).
pub fn scratch(tag: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("etmetal-{tag}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The stdout of a run that must succeed (its stderr on failure).
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}
