//! `etmetal compile --quantize int4` as a user runs it (numbers against
//! PyTorch are in tests/parity/test_int4.py).

#[path = "common/cli.rs"]
mod cli_util;
use cli_util::{etmetal, fixture};

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
        err.contains("linear stays in float: group size 32 does not divide K = 16"),
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
            && err.contains("1 of them reuse int4 weights already made"),
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
