//! The `etmetal` command as a user runs it: outputs on disk, exit codes,
//! one-line errors.

use std::path::Path;

#[path = "common/cli.rs"]
mod cli_util;
use cli_util::{etmetal, fixture, scratch};

#[test]
fn run_writes_outputs_that_match_pytorch() {
    let out = scratch("cli", "run");
    let model = fixture("resblock.pt2");
    let input = fixture("resblock.input_0.npy");
    let res = etmetal(&[
        "run",
        model.to_str().unwrap(),
        "--inputs",
        input.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        stdout.contains("output_0: float32 [1, 4, 6, 6]"),
        "{stdout}"
    );
    let got = etmetal_core::npy::read(&out.join("output_0.npy"))
        .unwrap()
        .to_f64_vec();
    let want = etmetal_core::npy::read(&fixture("resblock.output_0.npy"))
        .unwrap()
        .to_f64_vec();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "largest error {worst}");
}

#[test]
fn run_without_inputs_uses_ones() {
    let out = scratch("cli", "ones");
    let res = etmetal(&[
        "run",
        fixture("gpt_block.pt2").to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(out.join("output_0.npy").exists());
}

#[test]
fn inspect_lists_inputs_weights_and_ops() {
    let res = etmetal(&["inspect", fixture("gpt_block.pt2").to_str().unwrap()]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    for needle in [
        "inputs:",
        "outputs:",
        "parameters, buffers and constants:",
        "sdpa",
        "layer_norm",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let dir = scratch("cli", "bad");
    let junk = dir.join("junk.pt2");
    std::fs::write(&junk, b"this is not a zip archive").unwrap();
    let wrong = dir.join("wrong.npy");
    etmetal_core::npy::write(
        &wrong,
        &etmetal_core::Tensor::zeros(etmetal_core::DType::F32, &[7]).unwrap(),
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["run".into(), junk.display().to_string()], "junk.pt2"),
        (
            vec!["run".into(), dir.join("missing.pt2").display().to_string()],
            "missing.pt2",
        ),
        (
            vec![
                "run".into(),
                fixture("mlp.pt2").display().to_string(),
                "--inputs".into(),
                wrong.display().to_string(),
            ],
            "input 0",
        ),
    ];
    for (args, needle) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let res = etmetal(&args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    }
}

#[test]
fn a_pt2_runs_on_the_gpu_or_where_asked() {
    let out = scratch("cli", "pt2-gpu");
    let model = fixture("mlp.pt2");
    let run = |device: &str| {
        etmetal(&[
            "run",
            model.to_str().unwrap(),
            "--device",
            device,
            "--inputs",
            fixture("mlp.input_0.npy").to_str().unwrap(),
            "--output-dir",
            out.to_str().unwrap(),
        ])
    };
    // compiled in memory for the adapter this machine has
    let res = run("auto");
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&res.stdout).contains("ran on gpu"));
    assert!(worst_error(&out.join("output_0.npy"), "mlp.output_0.npy") < 1e-5);
    let res = run("cpu");
    assert!(res.status.success());
    assert!(String::from_utf8_lossy(&res.stdout).contains("ran on cpu in"));
    assert!(
        res.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    // an adapter kind this machine does not have is an error, not a fallback
    let res = run("metal");
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("metal"), "{stderr}");
}

#[test]
fn compiled_pte_runs_and_inspects() {
    let dir = scratch("cli", "compile");
    let pte = dir.join("resblock.pte");
    let res = etmetal(&[
        "compile",
        fixture("resblock.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let out = dir.join("out");
    let input = fixture("resblock.input_0.npy");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        input.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let got = etmetal_core::npy::read(&out.join("output_0.npy"))
        .unwrap()
        .to_f64_vec();
    let want = etmetal_core::npy::read(&fixture("resblock.output_0.npy"))
        .unwrap()
        .to_f64_vec();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst < 1e-5, "largest error {worst}");
    let res = etmetal(&["inspect", "--verbose", pte.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    for needle in [
        "method `forward`",
        "aten::convolution.out",
        "planned arenas",
        "chain 0",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

/// Largest absolute difference between an output and the fixture's.
fn worst_error(out: &Path, expected: &str) -> f64 {
    let got = etmetal_core::npy::read(out).unwrap().to_f64_vec();
    let want = etmetal_core::npy::read(&fixture(expected))
        .unwrap()
        .to_f64_vec();
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

#[test]
fn metal_compile_runs_on_the_gpu_inspects_and_emits_msl() {
    let dir = scratch("cli", "metal");
    let pte = dir.join("mlp.pte");
    let msl = dir.join("msl");
    let res = etmetal(&[
        "compile",
        fixture("mlp.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--emit-msl",
        msl.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(
        stdout.contains("EtMetalBackend: 1 partition(s)"),
        "{stdout}"
    );
    let metal: Vec<_> = std::fs::read_dir(&msl)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "metal"))
        .collect();
    assert!(!metal.is_empty());
    for file in &metal {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(text.contains("kernel void"), "{}", file.display());
        assert!(
            !text.contains("fake"),
            "placeholder bindings in {}",
            file.display()
        );
        assert!(file.with_extension("wgsl").exists());
    }
    let out = dir.join("out");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        fixture("mlp.input_0.npy").to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(String::from_utf8_lossy(&res.stdout).contains("ran on gpu"));
    let worst = worst_error(&out.join("output_0.npy"), "mlp.output_0.npy");
    assert!(worst < 1e-5, "largest error {worst}");
    let res = etmetal(&["inspect", "--verbose", pte.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    for needle in [
        "delegate 0: EtMetalBackend",
        "kernels,",
        "workgroups",
        "named data",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[test]
fn dtype_bf16_compiles_a_float32_model_in_bfloat16() {
    let dir = scratch("cli", "dtype");
    let pte = dir.join("mlp_bf16.pte");
    let res = etmetal(&[
        "compile",
        fixture("mlp.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let out = dir.join("out");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        fixture("mlp.input_0.npy").to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(stdout.contains("output_0: bfloat16"), "{stdout}");
    let worst = worst_error(&out.join("output_0.npy"), "mlp.output_0.npy");
    assert!(
        worst > 0.0 && worst < 5e-2,
        "largest error {worst} against float32"
    );
}

#[test]
fn partition_modes_and_skipped_ops() {
    let dir = scratch("cli", "partition");
    let pte = dir.join("m.pte");
    // mobile_block has a transposed convolution, which the GPU does not take
    let res = etmetal(&[
        "compile",
        fixture("mobile_block.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--partition",
        "whole",
    ]);
    assert_eq!(res.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        stderr.contains("conv_transpose2d") && stderr.contains("transposed"),
        "{stderr}"
    );
    // auto: GPU, CPU and GPU again, with the right numbers
    let res = etmetal(&[
        "compile",
        fixture("mobile_block.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(stdout.contains("cpu: `conv_transpose2d`"), "{stdout}");
    let out = dir.join("out");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        fixture("mobile_block.input_0.npy").to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    for k in 0..3 {
        let worst = worst_error(
            &out.join(format!("output_{k}.npy")),
            &format!("mobile_block.output_{k}.npy"),
        );
        assert!(worst < 1e-4, "output {k}: largest error {worst}");
    }
    let res = etmetal(&[
        "compile",
        fixture("mlp.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--skip-op",
        "linear",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(stdout.contains("`linear` is in skip_ops"), "{stdout}");
}

#[test]
fn max_buffer_keeps_larger_tensors_on_the_cpu() {
    let dir = scratch("cli", "max_buffer");
    let pte = dir.join("m.pte");
    let compile = |size: &str| {
        etmetal(&[
            "compile",
            fixture("mlp.pt2").to_str().unwrap(),
            "-o",
            pte.to_str().unwrap(),
            "--max-buffer",
            size,
        ])
    };
    let res = compile("1x");
    assert_eq!(res.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&res.stderr).contains("not a size"));
    // fc1's weight is [16, 8] f32 = 512 bytes: over a 256-byte limit
    let res = compile("256");
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        stdout.contains("`p_fc1_weight` of shape [16, 8] exceeds the 256 byte buffer limit"),
        "{stdout}"
    );
    let out = dir.join("out");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        fixture("mlp.input_0.npy").to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let worst = worst_error(&out.join("output_0.npy"), "mlp.output_0.npy");
    assert!(worst < 1e-5, "largest error {worst}");
}

#[test]
fn inspect_shows_delegates_it_cannot_run() {
    let pte = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../etmetal-pte/tests/fixtures/xnnpack_linear.pte");
    let res = etmetal(&["inspect", pte.to_str().unwrap()]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(String::from_utf8_lossy(&res.stdout)
        .contains("XnnpackBackend: 1 partition(s) (this build does not run them)"));
    let res = etmetal(&["inspect", "--verbose", pte.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&res.stdout).contains("delegate 0: XnnpackBackend"));
    let res = etmetal(&["run", pte.to_str().unwrap()]);
    assert_eq!(res.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&res.stderr).contains("`XnnpackBackend` is not registered"));
}

#[test]
fn inspect_of_a_pt2_says_what_the_gpu_would_take() {
    let res = etmetal(&["inspect", fixture("mobile_block.pt2").to_str().unwrap()]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    // as `compile` reports it (partition_modes_and_skipped_ops)
    assert!(
        stdout.contains("EtMetalBackend (compile's default options): ")
            && stdout.contains("in 2 partition(s); 2 on the cpu"),
        "{stdout}"
    );
    assert!(stdout.contains("cpu: `conv_transpose2d`"), "{stdout}");
}

#[test]
fn inspect_opens_with_a_summary_and_lists_everything_when_verbose() {
    let dir = scratch("cli", "inspect");
    let pte = dir.join("mobile_block.pte");
    // mobile_block: two GPU partitions around a transposed convolution and
    // a max pool with indices, which stay on the CPU
    let res = etmetal(&[
        "compile",
        fixture("mobile_block.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let res = etmetal(&["inspect", pte.to_str().unwrap()]);
    assert!(res.status.success());
    let summary = String::from_utf8_lossy(&res.stdout).to_string();
    let lines: Vec<&str> = summary.lines().collect();
    assert!(lines[1].starts_with("1 method(s); weights "), "{summary}");
    assert!(lines[1].contains("(13 keys)"), "{summary}");
    assert_eq!(lines[2], "method `forward`:", "{summary}");
    assert_eq!(lines[3], "  inputs:  float32 [1, 3, 12, 12]", "{summary}");
    assert_eq!(
        lines[4], "  outputs: float32 [1, 5], int64 [1, 8, 3, 3], float32 [1, 8, 3, 3]",
        "{summary}"
    );
    assert_eq!(
        lines[5], "  delegated: 2 delegate call(s), 2 CPU kernel call(s)",
        "{summary}"
    );
    assert!(
        lines[6].starts_with("  GPU (EtMetalBackend): 2 partition(s), "),
        "{summary}"
    );
    for op in ["aten::convolution.out", "aten::max_pool2d_with_indices.out"] {
        assert!(
            lines.iter().any(|l| l.trim_start() == format!("1  {op}")),
            "{op} missing in:\n{summary}"
        );
    }
    assert!(!summary.contains("segments:"), "{summary}");
    assert!(lines.len() < 15, "{summary}");
    // --verbose: the same summary, then the whole listing
    let res = etmetal(&["inspect", "--verbose", pte.to_str().unwrap()]);
    assert!(res.status.success());
    let verbose = String::from_utf8_lossy(&res.stdout);
    assert!(verbose.starts_with(&summary), "{verbose}");
    let rest = &verbose[summary.len()..];
    assert!(rest.trim_start().starts_with("segments:"), "{verbose}");
    for needle in [
        "named data `p_conv_weight`",
        "delegate 1: EtMetalBackend",
        "chain 0",
    ] {
        assert!(rest.contains(needle), "missing {needle:?} in:\n{verbose}");
    }
}

#[test]
fn compile_and_inspect_report_the_nodes_computed_at_compile_time() {
    // llama_block slices its rotary tables (buffers) by a constant length
    let dir = scratch("cli", "folded");
    let pt2 = fixture("llama_block.pt2");
    let pte = dir.join("llama_block.pte");
    let folded = |args: &[&str]| {
        let res = etmetal(args);
        let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        let line = stdout.lines().find(|l| l.contains("depend on no input"));
        line.map(str::trim)
            .map(str::to_string)
            .unwrap_or_else(|| panic!("{stdout}"))
    };
    let inspected = folded(&["inspect", pt2.to_str().unwrap()]);
    let compiled = folded(&[
        "compile",
        pt2.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
    ]);
    assert_eq!(inspected, compiled);
    assert!(!inspected.starts_with("0 "), "{inspected}");
}
