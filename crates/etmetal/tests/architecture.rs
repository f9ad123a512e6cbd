//! `docs/ARCHITECTURE.md`'s crate table names, for each crate (and the
//! Python plug-in), the crates it depends on: that column must match the
//! `Cargo.toml`s, so the picture the next engineer reads is the one the
//! build enforces.

use std::collections::BTreeSet;
use std::path::Path;

/// The workspace crates the `[dependencies]` (not dev or build) of the
/// manifest in `dir` name.
fn cargo_deps(dir: &Path) -> BTreeSet<String> {
    let manifest = dir.join("Cargo.toml");
    let toml = std::fs::read_to_string(&manifest)
        .unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let mut deps = BTreeSet::new();
    let mut in_deps = false;
    for line in toml.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
        } else if in_deps && line.starts_with("etmetal") {
            let name = line.split(['=', '.', ' ']).next().unwrap();
            deps.insert(name.to_string());
        }
    }
    deps
}

/// The crates under `crates/`.
fn workspace_crates(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The crates the table's last column names (`core` is `etmetal-core`;
/// words in parentheses are explanations). `all`: every other crate under
/// `crates/` that does not depend on `krate`.
fn documented_deps(cell: &str, krate: &str, root: &Path) -> BTreeSet<String> {
    if cell == "all" {
        return (workspace_crates(root).into_iter())
            .filter(|c| c != krate && !cargo_deps(&root.join("crates").join(c)).contains(krate))
            .collect();
    }
    let mut plain = String::new();
    let mut depth = 0;
    for c in cell.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    plain
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty() && *d != "—")
        .map(|d| match d {
            "etmetal" => d.to_string(),
            _ => format!("etmetal-{d}"),
        })
        .collect()
}

#[test]
fn the_crate_table_matches_the_cargo_manifests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let mut seen = BTreeSet::new();
    let rows = doc
        .lines()
        .filter(|l| l.starts_with("| `etmetal") || l.starts_with("| `python/`"));
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`');
        // a crate under crates/, or a folder of its own (the plug-in)
        let dir = match name.strip_suffix('/') {
            Some(folder) => root.join(folder),
            None => root.join("crates").join(name),
        };
        let column = cells[cells.len() - 2];
        assert_eq!(
            documented_deps(column, name, &root),
            cargo_deps(&dir),
            "docs/ARCHITECTURE.md's row for {name} (`{column}`) against its Cargo.toml"
        );
        seen.insert(name.to_string());
    }
    let mut expected = workspace_crates(&root);
    expected.insert("python/".into());
    assert_eq!(
        seen, expected,
        "docs/ARCHITECTURE.md's crate table against the workspace"
    );
}
