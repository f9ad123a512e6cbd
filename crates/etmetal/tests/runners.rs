//! `etmetal chat` and `etmetal transcribe` as a user runs them, on the
//! committed fixtures: a chat's second turn, run over the first turn's
//! cache, says what a fresh `generate` of the whole conversation says; and
//! bad input (not a WAV, a sample rate of 0, silence, a program that is no
//! speech model, a tokenizer without a chat template) is one clear line
//! and exit 2, never a panic.

use std::path::{Path, PathBuf};
use std::process::Output;

#[path = "common/cli.rs"]
mod cli_util;
use cli_util::{etmetal, fixture, ok, scratch};

fn compile(dir: &Path, model: &str, extra: &[&str]) -> PathBuf {
    let pte = dir.join(format!("{}.pte", model.replace('/', "-")));
    let source = fixture(&format!("{model}.pt2"));
    let mut args = vec![
        "compile",
        source.to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
    ];
    args.extend(extra);
    ok(&etmetal(&args));
    pte
}

fn fails_with(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(needle), "missing {needle:?} in {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// A 16-bit mono WAV of `samples` at `rate` Hz.
fn wav(path: &Path, rate: u32, samples: &[i16]) {
    let mut b = Vec::new();
    let data = (samples.len() * 2) as u32;
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + data).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&1u16.to_le_bytes()); // mono
    b.extend_from_slice(&rate.to_le_bytes());
    b.extend_from_slice(&(rate * 2).to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data.to_le_bytes());
    for s in samples {
        b.extend_from_slice(&s.to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn transcribe_names_bad_input() {
    let dir = scratch("runners", "transcribe");
    let mlp = compile(&dir, "mlp", &[]);
    let mlp = mlp.to_str().unwrap();
    let run = |audio: &Path| etmetal(&["transcribe", mlp, audio.to_str().unwrap()]);

    let text = dir.join("notes.wav");
    std::fs::write(&text, "not audio at all").unwrap();
    fails_with(&run(&text), "not a WAV file");

    let zero = dir.join("zero-rate.wav");
    wav(&zero, 0, &[1, 2, 3]);
    fails_with(&run(&zero), "sample rate of 0 Hz");

    let silent = dir.join("silent.wav");
    wav(&silent, 16000, &[0; 1600]);
    fails_with(&run(&silent), "silent");

    let missing = dir.join("missing.wav");
    fails_with(&run(&missing), "missing.wav");

    let tone: Vec<i16> = (0..1600)
        .map(|i| ((i as f32 * 0.1).sin() * 8000.0) as i16)
        .collect();
    let good = dir.join("tone.wav");
    wav(&good, 8000, &tone);
    fails_with(
        &run(&good),
        "is not a speech model transcribe runs: it needs methods `encoder` and `text_decoder`",
    );
}

/// The llm fixture's tokenizer folder with `template` as its chat template.
fn tokenizer_with(dir: &Path, template: Option<&str>) -> PathBuf {
    let folder = dir.join("tokenizer");
    std::fs::create_dir_all(&folder).unwrap();
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture(&format!("llm/{name}")), folder.join(name)).unwrap();
    }
    if let Some(t) = template {
        std::fs::write(folder.join("chat_template.jinja"), t).unwrap();
    }
    folder
}

fn chat(pte: &Path, folder: &Path, prompts: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "chat",
        pte.to_str().unwrap(),
        "--tokenizer",
        folder.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--device",
        "cpu",
    ];
    args.extend(extra);
    etmetal(&args)
}

#[test]
fn chat_second_turn_over_the_cache_equals_a_fresh_generate() {
    let dir = scratch("runners", "chat");
    // the program: forward and prefill of the fixture decoder
    let pte = dir.join("llm.pte");
    let prefill = format!("prefill={}", fixture("llm/prefill.pt2").display());
    ok(&etmetal(&[
        "compile",
        fixture("llm/forward.pt2").to_str().unwrap(),
        "--method",
        &prefill,
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
    ]));
    // the conversation as plain text: turn 2 renders user 1, the reply, user 2
    let folder = tokenizer_with(
        &dir,
        Some("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    );
    let prompts = dir.join("prompts.txt");
    let turns = ["The cat sat", " on the mat and"];
    std::fs::write(&prompts, turns.join("\n") + "\n").unwrap();
    let out = chat(&pte, &folder, &prompts, &["--max-tokens", "5"]);
    let stdout = ok(&out);
    let replies: Vec<&str> = stdout.lines().collect();
    assert_eq!(replies.len(), 2, "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let reused: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.split("; ").nth(1)?.strip_suffix(" from the cache)"))
        .collect();
    // turn 2 reuses what turn 1 ran (its prompt and all but its last token)
    assert_eq!(reused.len(), 2, "{stderr}");
    assert_eq!(reused[0], "0");
    assert!(reused[1].parse::<usize>().unwrap() > 3, "{stderr}");
    // a fresh generate of the whole conversation says the same
    let conversation = format!("{}{}{}", turns[0], replies[0], turns[1]);
    let fresh = etmetal(&[
        "generate",
        pte.to_str().unwrap(),
        "--tokenizer",
        folder.join("tokenizer.json").to_str().unwrap(),
        "--prompt",
        &conversation,
        "--max-tokens",
        "5",
        "--device",
        "cpu",
    ]);
    assert_eq!(ok(&fresh), format!("{conversation}{}\n", replies[1]));
}

#[test]
fn chat_names_a_missing_template() {
    let dir = scratch("runners", "chat-bad");
    let pte = dir.join("llm.pte");
    ok(&etmetal(&[
        "compile",
        fixture("llm/forward.pt2").to_str().unwrap(),
        "-o",
        pte.to_str().unwrap(),
        "--backend",
        "cpu",
    ]));
    let folder = tokenizer_with(&dir, None);
    let prompts = dir.join("prompts.txt");
    std::fs::write(&prompts, "Hello\n").unwrap();
    fails_with(
        &chat(&pte, &folder, &prompts, &[]),
        "the tokenizer has no chat template",
    );
    // a template that refuses the conversation: its own message
    std::fs::write(
        folder.join("chat_template.jinja"),
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system prompt is required') }}{% endif %}",
    )
    .unwrap();
    fails_with(
        &chat(&pte, &folder, &prompts, &[]),
        "a system prompt is required",
    );
}
