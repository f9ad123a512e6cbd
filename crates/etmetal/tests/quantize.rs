//! `etmetal compile --quantize int4|int8|mixed [--calibrate FILE]` as a
//! user runs it, and the bad inputs it must name (numbers against PyTorch
//! are in tests/parity/test_int4.py and test_quant.py).

use std::path::{Path, PathBuf};

#[path = "common/cli.rs"]
mod cli_util;
use cli_util::{etmetal, fixture, ok, scratch};

#[test]
fn quantize_int4_writes_custom_calls_and_reports_skips() {
    let dir = std::env::temp_dir().join(format!("etmetal-int4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pte = dir.join("lb.pte");
    let model = fixture("llama_block.pt2");
    let args = [
        "compile",
        model.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
        "--quantize",
        "int4",
    ];
    let res = etmetal(&args);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    // most of llama_block's linears have K = 16, below the group
    assert!(
        err.contains("1 linears in int4 (group 32), 5 kept in float"),
        "{err}"
    );
    assert!(
        err.contains("linear stays in float: int4 group size 32 does not divide K = 16"),
        "{err}"
    );
    // a second method of the same weights quantizes none of them again
    let method = format!("prefill={}", model.display());
    let pte2 = dir.join("lb2.pte");
    let mut two = args.to_vec();
    two[3] = pte2.to_str().unwrap();
    two.extend(["--method", &method]);
    let res = etmetal(&two);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("method `prefill`: 1 linears in int4")
            && err.contains("1 of them reuse quantized weights already made"),
        "{err}"
    );
    let res = etmetal(&["inspect", pte.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&res.stdout);
    assert!(
        out.contains("torchao::_linear_fp_act_4bit_weight.out"),
        "{out}"
    );
    let input = fixture("llama_block.input_0.npy");
    let res = etmetal(&[
        "run",
        pte.to_str().unwrap(),
        "--inputs",
        input.to_str().unwrap(),
        "--output-dir",
        dir.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    // a group size the kernels do not take is refused before compiling
    let mut bad = args.to_vec();
    bad.extend(["--group-size", "48"]);
    let res = etmetal(&bad);
    assert_eq!(res.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&res.stderr).contains("48"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// tests/fixtures/llm/`name` (a tiny Llama: hidden 32, MLP 64, a BPE
/// tokenizer of 300 tokens; scripts/make_llm_fixture.py).
fn llm(name: &str) -> PathBuf {
    fixture("llm").join(name)
}

/// The calibration text the Gemma figures use (chapter II of *Around the
/// World in Eighty Days*).
fn text() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/data/around_the_world_ch2.txt")
}

/// `etmetal compile` of the llm fixture's forward and prefill with `extra`
/// flags into `dir/name.pte`.
fn compile_llm(dir: &Path, name: &str, extra: &[&str]) -> (std::process::Output, PathBuf) {
    let pte = dir.join(format!("{name}.pte"));
    let prefill = format!("prefill={}", llm("prefill.pt2").display());
    let forward = llm("forward.pt2");
    let mut args = vec![
        "compile",
        forward.to_str().unwrap(),
        "--method",
        &prefill,
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    args.extend(extra);
    (etmetal(&args), pte)
}

/// int8 (per output channel, and per group), mixed, and calibrated int4
/// and mixed on the tiny Llama: each compiles, says what it did, and
/// generates text.
#[test]
fn int8_mixed_and_calibrated_int4_compile_and_generate() {
    let dir = scratch("quantize", "schemes");
    let text = text();
    let tok = llm("tokenizer.json");
    let (text, tok) = (text.to_str().unwrap(), tok.to_str().unwrap());
    let cases: [(&str, &[&str], &str); 5] = [
        ("int8", &["--quantize", "int8"], "15 linears ("),
        (
            "int8g",
            &["--quantize", "int8", "--group-size", "32"],
            "15 linears in int8 (group 32)",
        ),
        ("mixed", &["--quantize", "mixed"], "mixed: "),
        (
            "int4cal",
            &[
                "--quantize",
                "int4",
                "--calibrate",
                text,
                "--tokenizer",
                tok,
            ],
            "15 linears in int4 (group 32), 0 kept in float; 15 calibrated",
        ),
        (
            "mixedcal",
            &[
                "--quantize",
                "mixed",
                "--calibrate",
                text,
                "--tokenizer",
                tok,
            ],
            "(mean KL of the logits with the weight alone in calibrated int4)",
        ),
    ];
    let mut sizes = vec![];
    for (name, flags, said) in cases {
        let (res, pte) = compile_llm(&dir, name, flags);
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(res.status.success(), "{name}: {err}");
        assert!(err.contains(said), "{name}: {err}");
        if flags.contains(&"--calibrate") {
            assert!(
                err.contains("calibrated on ") && err.contains("through method `prefill`"),
                "{name}: {err}"
            );
        }
        let out = ok(&etmetal(&[
            "generate",
            pte.to_str().unwrap(),
            "--tokenizer",
            tok,
            "--prompt",
            "The cat sat",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
        ]));
        assert!(!out.trim().is_empty(), "{name}: no text");
        sizes.push((name, std::fs::metadata(&pte).unwrap().len()));
    }
    // int8 per channel holds fewer scales than int8 per group of 32
    assert!(sizes[0].1 < sizes[1].1, "{sizes:?}");
    let shown = ok(&etmetal(&[
        "inspect",
        dir.join("int8.pte").to_str().unwrap(),
    ]));
    assert!(
        shown.contains("etmetal::_linear_fp_act_8bit_weight"),
        "{shown}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad input for quantization is a clear error (exit 2) naming what and
/// where, never a panic.
#[test]
fn bad_quantization_input_is_named() {
    let dir = scratch("quantize", "bad");
    let tok = llm("tokenizer.json");
    let tok = tok.to_str().unwrap();
    let refused = |args: &[&str]| -> String {
        let res = etmetal(args);
        let err = String::from_utf8_lossy(&res.stderr).to_string();
        assert_eq!(res.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    // a model with no linear layer
    let resblock = fixture("resblock.pt2");
    let pte = dir.join("r.pte");
    let err = refused(&[
        "compile",
        resblock.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--quantize",
        "int8",
    ]);
    assert!(
        err.contains("--quantize int8") && err.contains("resblock.pt2 has no linear layer"),
        "{err}"
    );
    // a calibration text too short
    let short = dir.join("short.txt");
    std::fs::write(&short, "Phileas Fogg lived at No. 7, Saville Row.").unwrap();
    let (res, _) = compile_llm(
        &dir,
        "short",
        &[
            "--quantize",
            "int4",
            "--calibrate",
            short.to_str().unwrap(),
            "--tokenizer",
            tok,
        ],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("short.txt") && err.contains("fewer than the 256 calibration needs"),
        "{err}"
    );
    // a calibration text in UTF-16
    let wide = dir.join("utf16.txt");
    let mut bytes = vec![0xff, 0xfe];
    for u in "Phileas Fogg lived at No. 7, Saville Row.".encode_utf16() {
        bytes.extend(u.to_le_bytes());
    }
    std::fs::write(&wide, bytes).unwrap();
    let (res, _) = compile_llm(
        &dir,
        "wide",
        &[
            "--quantize",
            "int4",
            "--calibrate",
            wide.to_str().unwrap(),
            "--tokenizer",
            tok,
        ],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("utf16.txt") && err.contains("not UTF-8") && err.contains("UTF-16"),
        "{err}"
    );
    // text without a tokenizer: token ids are expected, and named
    let (res, _) = compile_llm(
        &dir,
        "ids",
        &[
            "--quantize",
            "int4",
            "--calibrate",
            text().to_str().unwrap(),
        ],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("is not a token id") && err.contains("line 1"),
        "{err}"
    );
    // token ids outside the vocabulary
    let ids = dir.join("ids.txt");
    std::fs::write(&ids, "5 ".repeat(300) + "9999\n").unwrap();
    let (res, _) = compile_llm(
        &dir,
        "vocab",
        &["--quantize", "int4", "--calibrate", ids.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{err}");
    assert!(
        err.contains("token 9999 is outside the model's vocabulary"),
        "{err}"
    );
    // a model that is no decoder step
    let mlp = fixture("mlp.pt2");
    let err = refused(&[
        "compile",
        mlp.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--quantize",
        "int4",
        "--calibrate",
        ids.to_str().unwrap(),
    ]);
    assert!(err.contains("--calibrate runs a decoder step"), "{err}");
    // --calibrate without --quantize, and an int8 group that is no
    // multiple of 32
    refused(&[
        "compile",
        mlp.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--calibrate",
        ids.to_str().unwrap(),
    ]);
    let err = refused(&[
        "compile",
        mlp.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--quantize",
        "int8",
        "--group-size",
        "48",
    ]);
    assert!(err.contains("--group-size 48"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
