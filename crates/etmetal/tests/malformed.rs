//! The malformed-file corpus (`tests/malformed/`): every file is refused
//! with the typed error and message its manifest line names, through the
//! library (`Model::load`, `Payload::decode`) and through the CLI (exit 2,
//! one line, no panic). `MANIFEST.tsv` is written by the `make_malformed`
//! example; `REGRESSIONS.tsv` lists inputs the fuzzers found.

use std::path::{Path, PathBuf};
use std::process::Command;

use etmetal::Model;
use etmetal_metal::payload::Payload;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/malformed")
}

struct Entry {
    file: String,
    kind: String,
    want: String,
}

fn entries() -> Vec<Entry> {
    let mut out = Vec::new();
    for manifest in ["MANIFEST.tsv", "REGRESSIONS.tsv"] {
        let text = std::fs::read_to_string(corpus().join(manifest)).unwrap();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(
                cols.len(),
                3,
                "{manifest}: `{line}` is not file, kind, substring"
            );
            out.push(Entry {
                file: cols[0].to_string(),
                kind: cols[1].to_string(),
                want: cols[2].to_string(),
            });
        }
    }
    out
}

fn is_payload(e: &Entry) -> bool {
    e.file.starts_with("payload/")
}

/// The error loading `e` gives, as (kind, message); None if it loads.
fn load(e: &Entry) -> Option<(String, String)> {
    let path = corpus().join(&e.file);
    let err = if is_payload(e) {
        Payload::decode(&std::fs::read(&path).unwrap()).err()
    } else {
        Model::load(&path).err()
    }?;
    Some((format!("{:?}", err.kind()), err.to_string()))
}

#[test]
fn every_corpus_file_is_refused_with_its_error() {
    let entries = entries();
    assert!(entries.len() >= 50, "only {} corpus files", entries.len());
    let mut failures = Vec::new();
    for e in &entries {
        match load(e) {
            None => failures.push(format!("{}: loaded without an error", e.file)),
            Some((kind, msg)) if kind != e.kind || !msg.contains(&e.want) => {
                failures.push(format!(
                    "{}: got {kind} `{msg}`, want {} containing `{}`",
                    e.file, e.kind, e.want
                ))
            }
            Some(_) => {}
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn manifest_lists_every_corpus_file() {
    let listed: std::collections::HashSet<String> = entries().into_iter().map(|e| e.file).collect();
    for sub in ["pte", "pt2", "payload", "regress"] {
        let Ok(dir) = std::fs::read_dir(corpus().join(sub)) else {
            continue;
        };
        for f in dir {
            let name = format!("{sub}/{}", f.unwrap().file_name().to_string_lossy());
            assert!(listed.contains(&name), "{name} is in no manifest");
        }
    }
}

/// `etmetal ARGS FILE` exits 2 with one stderr line containing `want`.
fn assert_cli_refuses(args: &[&str], e: &Entry) {
    let path = corpus().join(&e.file);
    let out = Command::new(env!("CARGO_BIN_EXE_etmetal"))
        .args(args)
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let what = format!("etmetal {} {}: stderr `{stderr}`", args.join(" "), e.file);
    assert!(!stderr.contains("panicked"), "{what}");
    assert_eq!(out.status.code(), Some(2), "{what}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{what}");
    assert!(stderr.starts_with("etmetal: error: "), "{what}");
    assert!(stderr.contains(&e.want), "{what}: no `{}`", e.want);
}

#[test]
fn cli_exits_2_with_one_line_on_every_corpus_file() {
    let dir = std::env::temp_dir().join(format!("etmetal-malformed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out_dir = dir.to_str().unwrap();
    for e in entries().iter().filter(|e| !is_payload(e)) {
        assert_cli_refuses(&["run", "--device", "cpu", "--output-dir", out_dir], e);
        // inspect reads a .pte without preparing its method, so defects
        // only method preparation sees let it succeed.
        let bytes = std::fs::read(corpus().join(&e.file)).unwrap();
        if e.file.ends_with(".pte") && etmetal_pte::parse(&bytes).is_ok() {
            let out = Command::new(env!("CARGO_BIN_EXE_etmetal"))
                .arg("inspect")
                .arg(corpus().join(&e.file))
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(0), "etmetal inspect {}", e.file);
        } else {
            assert_cli_refuses(&["inspect"], e);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
