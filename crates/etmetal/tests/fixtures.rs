//! Every committed `.pt2` fixture runs on the CPU and matches the outputs
//! eager PyTorch gave for the same inputs (made by scripts/make_fixtures.py).

use std::path::{Path, PathBuf};

use etmetal::Model;
use etmetal_core::{npy, DType, Tensor};

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// `NAME.input_0.npy`, `NAME.input_1.npy`, … (or outputs) in order.
fn numbered(stem: &Path, kind: &str) -> Vec<Tensor> {
    (0..)
        .map(|i| {
            stem.with_file_name(format!(
                "{}.{kind}_{i}.npy",
                stem.file_name().unwrap().to_string_lossy()
            ))
        })
        .take_while(|p| p.exists())
        .map(|p| npy::read(&p).unwrap())
        .collect()
}

fn assert_close(name: &str, index: usize, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{name} output {index}: shape");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a - b).abs() <= tol + tol * b.abs() || (a.is_nan() && b.is_nan());
        assert!(ok, "{name} output {index}[{i}]: got {a}, PyTorch gave {b}");
    }
}

#[test]
fn every_fixture_matches_pytorch() {
    let mut count = 0;
    for entry in std::fs::read_dir(fixtures_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("pt2") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let stem = path.with_extension("");
        let mut model = Model::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        // a stateful fixture has the outputs of a second call too (`NAME.call2.output_i`)
        let calls = [stem.clone(), stem.with_extension("call2")];
        for (call, expected) in calls.iter().map(|s| numbered(s, "output")).enumerate() {
            if expected.is_empty() {
                continue;
            }
            let outputs = model
                .execute(numbered(&stem, "input"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(outputs.len(), expected.len(), "{name}: output count");
            for (i, (got, want)) in outputs.iter().zip(&expected).enumerate() {
                let tol = if got.dtype() == DType::BF16 {
                    1e-2
                } else {
                    1e-5
                };
                assert_close(&format!("{name} call {}", call + 1), i, got, want, tol);
            }
        }
        count += 1;
    }
    assert!(count >= 5, "only {count} fixtures found");
}

#[test]
fn wrong_inputs_are_named() {
    let mut model = Model::load(&fixtures_dir().join("mlp.pt2")).unwrap();
    let spec = model.inputs()[0].clone();
    let err = model.execute(vec![]).unwrap_err().to_string();
    assert!(err.contains("takes 1 input(s)"), "{err}");
    let mut shape = spec.shape.clone();
    shape[0] += 1;
    let bad = Tensor::zeros(spec.dtype, &shape).unwrap();
    let err = model.execute(vec![bad]).unwrap_err().to_string();
    let want = format!(
        "input 0: expected float32 {:?}, got float32 {shape:?}",
        spec.shape
    );
    assert!(err.contains(&want), "{err}");
    let bad = Tensor::zeros(DType::I64, &spec.shape).unwrap();
    let err = model.execute(vec![bad]).unwrap_err().to_string();
    assert!(err.contains("got int64"), "{err}");
}

#[test]
fn float32_inputs_round_into_bf16_programs() {
    let mut model = Model::load(&fixtures_dir().join("bf16_mlp.pt2")).unwrap();
    let spec = model.inputs()[0].clone();
    assert_eq!(spec.dtype, DType::BF16);
    let ones = Tensor::from_f64(
        DType::F32,
        &spec.shape,
        &vec![1.0; spec.shape.iter().product()],
    )
    .unwrap();
    let out = model.execute(vec![ones]).unwrap();
    assert_eq!(out[0].dtype(), DType::BF16);
}
