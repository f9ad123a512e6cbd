//! `etmetal generate` as a user runs it, on tests/fixtures/llm/ (a tiny
//! random-weight Llama exported through transformers' ExecuTorch recipe,
//! made by scripts/make_llm_fixture.py): the text must be exactly what
//! eager transformers generated greedily from the same prompt, whether
//! greedy steps return logits (`forward`) or their token (`decode`), and
//! with tests/fixtures/llm_dynamic/'s `prefill` of dynamic length at every
//! prompt length up to its bound.

use std::path::{Path, PathBuf};
use std::process::Output;

#[path = "common/cli.rs"]
mod cli_util;
use cli_util::{etmetal, ok, scratch};

fn llm(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llm")
        .join(name)
}

/// The fixture compiled with `backend`, with `forward` and its `methods`
/// (`prefill`, `decode`; each from the fixture's file of that name).
fn compile(dir: &Path, backend: &str, methods: &[&str]) -> PathBuf {
    let files: Vec<_> = methods
        .iter()
        .map(|&name| (name, llm(&format!("{name}.pt2"))))
        .collect();
    compile_files(dir, backend, &files, "")
}

/// [`compile`] with the methods' files given; `tag` tells the `.pte` apart.
fn compile_files(dir: &Path, backend: &str, methods: &[(&str, PathBuf)], tag: &str) -> PathBuf {
    let names: Vec<&str> = methods.iter().map(|m| m.0).collect();
    let pte = dir.join(format!("llm-{backend}-{}{tag}.pte", names.join("-")));
    let mut args = vec![
        "compile".to_string(),
        llm("forward.pt2").display().to_string(),
    ];
    for (name, file) in methods {
        let method = format!("{name}={}", file.display());
        args.extend(["--method".into(), method]);
    }
    args.extend([
        "-o".into(),
        pte.display().to_string(),
        "--backend".into(),
        backend.into(),
    ]);
    ok(&etmetal(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    pte
}

/// The fixture's prompt and token count.
fn prompt() -> (String, String) {
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(llm("prompt.json")).unwrap()).unwrap();
    (
        spec["prompt"].as_str().unwrap().to_string(),
        spec["max_tokens"].to_string(),
    )
}

fn generate(pte: &Path, device: &str, extra: &[&str]) -> Output {
    let (prompt, max_tokens) = prompt();
    generate_from(pte, device, &prompt, &max_tokens, extra)
}

fn generate_from(
    pte: &Path,
    device: &str,
    prompt: &str,
    max_tokens: &str,
    extra: &[&str],
) -> Output {
    let tokenizer = llm("tokenizer.json");
    let mut args = vec![
        "generate",
        pte.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--prompt",
        prompt,
        "--max-tokens",
        max_tokens,
        "--device",
        device,
    ];
    args.extend(extra);
    etmetal(&args)
}

#[test]
fn greedy_text_matches_eager_transformers_on_the_gpu_and_the_cpu() {
    let dir = scratch("gen", "greedy");
    let want = std::fs::read_to_string(llm("expected.txt")).unwrap() + "\n";
    for (backend, device) in [("metal", "auto"), ("cpu", "cpu")] {
        for methods in [&["prefill"][..], &[], &["decode"], &["prefill", "decode"]] {
            let pte = compile(&dir, backend, methods);
            let out = generate(&pte, device, &[]);
            assert_eq!(ok(&out), want, "{backend}, methods {methods:?}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            let how = if methods.contains(&"prefill") {
                "1 call of `prefill`"
            } else {
                "token by token"
            };
            // the greedy step's token, not its logits, where there is one
            let step = if methods.contains(&"decode") {
                "method `decode`"
            } else {
                "method `forward`"
            };
            assert!(
                stderr.contains("tokens/s") && stderr.contains(how) && stderr.contains(step),
                "{stderr}"
            );
        }
    }
}

#[test]
fn dynamic_prefill_takes_every_prompt_length_in_one_call() {
    let dir = scratch("gen", "dynamic");
    let fixture = llm("../llm_dynamic/cases.json");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let bound = spec["bound"].as_u64().unwrap();
    let methods = [
        ("prefill", llm("../llm_dynamic/prefill.pt2")),
        ("decode", llm("decode.pt2")),
    ];
    for (backend, device) in [("metal", "auto"), ("cpu", "cpu")] {
        let pte = compile_files(&dir, backend, &methods, "-dynamic");
        for case in spec["cases"].as_array().unwrap() {
            let prompt = case["prompt"].as_str().unwrap();
            let max_tokens = case["max_tokens"].to_string();
            let out = generate_from(&pte, device, prompt, &max_tokens, &[]);
            let want = format!("{}\n", case["text"].as_str().unwrap());
            assert_eq!(ok(&out), want, "{backend}, {} tokens", case["tokens"]);
            // the whole prompt in one call at its length, no token by token
            let stderr = String::from_utf8_lossy(&out.stderr);
            let line = format!("prefill: {} tokens", case["tokens"]);
            assert!(
                stderr.contains(&line) && stderr.contains("1 call of `prefill`"),
                "{stderr}"
            );
        }
        let too_long = spec["too_long"].as_str().unwrap();
        let out = generate_from(&pte, device, too_long, "4", &[]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let want = format!(
            "the prompt has {} tokens, more than method `prefill` takes (T <= {bound})",
            bound + 1
        );
        assert!(stderr.contains(&want), "{stderr}");
    }
}

#[test]
fn sampling_repeats_with_a_seed_and_eos_stops() {
    let dir = scratch("gen", "sample");
    let pte = compile(&dir, "cpu", &["prefill", "decode"]);
    let run = |seed: &str| {
        generate(
            &pte,
            "cpu",
            &["--temperature", "1.5", "--top-p", "0.9", "--seed", seed],
        )
    };
    let sample = |seed: &str| ok(&run(seed));
    // sampling needs the logits: `forward`, never the greedy `decode`
    let stderr = String::from_utf8_lossy(&run("5").stderr).to_string();
    assert!(stderr.contains("method `forward`"), "{stderr}");
    assert_eq!(sample("5"), sample("5"));
    assert_ne!(sample("5"), sample("6"));
    // the first greedy token as the end-of-sequence token: only the prompt
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(llm("prompt.json")).unwrap()).unwrap();
    let first = spec["new_ids"][0].to_string();
    assert_eq!(
        ok(&generate(&pte, "cpu", &["--eos", &first])),
        format!("{}\n", prompt().0)
    );
}

#[test]
fn errors_name_what_is_wrong() {
    let dir = scratch("gen", "errors");
    let pte = compile(&dir, "cpu", &[]);
    let fail = |out: Output, needle: &str| {
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "missing {needle:?} in {stderr}");
    };
    // the cache holds 32 positions
    let tokenizer = llm("tokenizer.json");
    let long = "The cat sat on the mat. ".repeat(20);
    fail(
        etmetal(&[
            "generate",
            pte.to_str().unwrap(),
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--prompt",
            &long,
            "--device",
            "cpu",
        ]),
        "more than the KV cache holds (32 positions)",
    );
    // a model that is not a decoder step
    let mlp = dir.join("mlp.pte");
    let fixture = llm("../mlp.pt2");
    let compiled = etmetal(&[
        "compile",
        fixture.to_str().unwrap(),
        "-o",
        mlp.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    ok(&compiled);
    fail(
        generate(&mlp, "cpu", &[]),
        "method `forward` is not a decoder step: it takes (float32 [2, 8]); expected (tokens int64 [1, T], positions int64 [T])",
    );
    fail(
        generate(&pte, "cpu", &["--eos", "<no such token>"]),
        "no token `<no such token>`",
    );
    // a `decode` that returns logits is no greedy step
    let wrong = dir.join("wrong-decode.pte");
    let method = format!("decode={}", llm("prefill.pt2").display());
    let forward = llm("forward.pt2");
    ok(&etmetal(&[
        "compile",
        forward.to_str().unwrap(),
        "--method",
        &method,
        "-o",
        wrong.to_str().unwrap(),
        "--backend",
        "cpu",
    ]));
    fail(
        generate(&wrong, "cpu", &[]),
        "method `decode` is not a decoder step: it takes 8 tokens and returns float32 [1, 8, 300]",
    );
}
