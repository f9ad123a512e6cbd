//! `docs/ARCHITECTURE.md`'s crate table names, for each crate, the crates
//! it depends on: that column must match the crates' `Cargo.toml`s, so the
//! picture the next engineer reads is the one the build enforces.

use std::collections::BTreeSet;
use std::path::Path;

/// The workspace crates a crate's `[dependencies]` name (not dev or build).
fn cargo_deps(root: &Path, krate: &str) -> BTreeSet<String> {
    let toml = std::fs::read_to_string(root.join("crates").join(krate).join("Cargo.toml"))
        .unwrap_or_else(|e| panic!("{krate}/Cargo.toml: {e}"));
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

/// The crates the table's last column names (`core` is `etmetal-core`;
/// words in parentheses are explanations).
fn documented_deps(cell: &str) -> BTreeSet<String> {
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
    let mut seen = 0;
    for row in doc.lines().filter(|l| l.starts_with("| `etmetal")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let krate = cells[1].trim_matches('`');
        let column = cells[cells.len() - 2];
        if column == "all" {
            continue; // the facade
        }
        assert_eq!(
            documented_deps(column),
            cargo_deps(&root, krate),
            "docs/ARCHITECTURE.md's row for {krate} (`{column}`) against its Cargo.toml"
        );
        seen += 1;
    }
    let crates = std::fs::read_dir(root.join("crates")).unwrap().count();
    // every crate but the facade has its row
    assert_eq!(
        seen,
        crates - 1,
        "crates without a row in docs/ARCHITECTURE.md"
    );
}
