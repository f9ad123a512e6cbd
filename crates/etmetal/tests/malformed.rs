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

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn mlp_pte() -> Vec<u8> {
    etmetal::compile::compile_pt2_cpu(&fixture("mlp.pt2")).unwrap()
}

#[test]
fn wrong_inputs_name_the_index_expected_and_got() {
    use etmetal_core::{DType, ErrorKind, Tensor};
    let program = etmetal_runtime::Program::from_bytes(&mlp_pte()).unwrap();
    let mut method = program.method("forward").unwrap();
    let good = etmetal_core::npy::read(&fixture("mlp.input_0.npy")).unwrap();
    let zeros = |dtype, shape: &[usize]| Tensor::zeros(dtype, shape).unwrap();
    for (inputs, want) in [
        (vec![], "takes 1 input(s), 0 given"),
        (
            vec![good.clone(), good.clone()],
            "takes 1 input(s), 2 given",
        ),
        (
            vec![zeros(DType::I64, &[2, 8])],
            "input 0: expected float32 [2, 8], got int64 [2, 8]",
        ),
        (
            vec![zeros(DType::F32, &[3, 8])],
            "input 0: expected float32 [2, 8], got float32 [3, 8]",
        ),
        (
            vec![zeros(DType::F32, &[16])],
            "input 0: expected float32 [2, 8], got float32 [16]",
        ),
    ] {
        let e = method.execute(inputs).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains(want), "`{e}` lacks `{want}`");
    }
    // A refused call leaves the method usable.
    let out = method.execute(vec![good]).unwrap();
    let want = etmetal_core::npy::read(&fixture("mlp.output_0.npy")).unwrap();
    assert_eq!(out[0].shape(), want.shape());
}

#[test]
fn cli_run_names_a_wrong_npy_input() {
    let dir = std::env::temp_dir().join(format!("etmetal-wrong-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pte = dir.join("mlp.pte");
    std::fs::write(&pte, mlp_pte()).unwrap();
    let wide = etmetal_core::Tensor::zeros(etmetal_core::DType::F32, &[3, 8]).unwrap();
    let wide_path = dir.join("wide.npy");
    etmetal_core::npy::write(&wide_path, &wide).unwrap();
    // The same bytes declared column-major: a layout etmetal does not take.
    let mut fortran = std::fs::read(fixture("mlp.input_0.npy")).unwrap();
    let (from, to) = (b"'fortran_order': False", b"'fortran_order': True ");
    let at = fortran.windows(from.len()).position(|w| w == from).unwrap();
    fortran[at..at + to.len()].copy_from_slice(to);
    let fortran_path = dir.join("fortran.npy");
    std::fs::write(&fortran_path, fortran).unwrap();
    for (inputs, want) in [
        (
            vec![&wide_path],
            "input 0: expected float32 [2, 8], got float32 [3, 8]".to_string(),
        ),
        (
            vec![&wide_path, &wide_path],
            "takes 1 input(s), 2 given".to_string(),
        ),
        (vec![&fortran_path], "Fortran order".to_string()),
    ] {
        let list: Vec<String> = inputs.iter().map(|p| p.display().to_string()).collect();
        let out = Command::new(env!("CARGO_BIN_EXE_etmetal"))
            .arg("run")
            .arg(&pte)
            .args(["--inputs", &list.join(","), "--output-dir"])
            .arg(dir.join("out"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&want), "`{stderr}` lacks `{want}`");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
