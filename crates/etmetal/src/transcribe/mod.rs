//! Speech to text: what `etmetal transcribe` runs.
//!
//! Two kinds of program:
//! - **Whisper** (`scripts/export_whisper.py`): method `encoder`
//!   (`input_features f32 [1, n_mels, frames]`) writes each decoder
//!   layer's cross-attention keys and values into the caches' state, and
//!   method `text_decoder` is a decoder step (`tokens int64 [1, 1],
//!   positions int64 [1] -> logits`, see [`crate::generate`]) over them.
//!   The audio goes in windows of `frames · 160` samples (30 s for every
//!   released Whisper), each window's log-mel features computed here
//!   ([`mel`]); per window the encoder runs once, then the prompt (start,
//!   language, task, no-timestamps) and greedy steps with transformers'
//!   logits rules for Whisper ([`WhisperRules`]) until the end of text.
//! - **CTC** (wav2vec2, HuBERT): `forward(input_values f32 [1, samples])
//!   -> logits [1, frames, vocab]`, decoded greedily ([`ctc`]).
//!
//! The files beside the program (or in `--tokenizer DIR`) give the
//! vocabulary and, for Whisper, the special tokens (`generation_config.json`
//! as transformers saves it).

pub mod ctc;
pub mod mel;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use etmetal_core::{DType, Error, Result, Tensor, TensorSpec};

use crate::audio::Audio;
use crate::generate::{
    Decoder, DecoderMethods, Next, Sampler, Sampling, TextStream, TextTokenizer,
};
use crate::Model;

/// Whisper's methods, as ExecuTorch's Whisper export names them.
pub const ENCODER: &str = "encoder";
pub const TEXT_DECODER: &str = "text_decoder";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Task {
    #[default]
    Transcribe,
    Translate,
}

/// What `transcribe` does besides the text.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Whisper's language (`en`, `english` or `<|en|>`); `None`: detected
    /// from the first window (multilingual models).
    pub language: Option<String>,
    pub task: Task,
    /// Whisper's timestamps: each segment on a line of its own, `[start
    /// --> end]` in seconds from the start of the file.
    pub timestamps: bool,
    /// Print each window's token ids (the decoder's whole sequence, as
    /// transformers' `generate()` returns it) instead of the text.
    pub ids: bool,
    /// Write each window's features as `window{k}.npy` into this folder.
    pub dump_features: Option<PathBuf>,
}

/// What a transcription took, for the real-time-factor line.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub audio_seconds: f64,
    pub seconds: f64,
    pub windows: usize,
    pub encoder_seconds: f64,
    pub tokens: usize,
    pub decoder_seconds: f64,
    pub language: Option<String>,
}

impl Report {
    /// Processing time over audio time (below 1: faster than real time).
    pub fn real_time_factor(&self) -> f64 {
        self.seconds / self.audio_seconds.max(1e-9)
    }

    pub fn line(&self) -> String {
        let mut line = format!(
            "{:.2} s of audio in {:.3} s: real-time factor {:.3} ({} window{}",
            self.audio_seconds,
            self.seconds,
            self.real_time_factor(),
            self.windows,
            if self.windows == 1 { "" } else { "s" }
        );
        if self.tokens > 0 {
            line += &format!(
                "; encoder {:.3} s, decoder {} tokens in {:.3} s",
                self.encoder_seconds, self.tokens, self.decoder_seconds
            );
        }
        if let Some(lang) = &self.language {
            line += &format!("; language {lang}");
        }
        line + ")"
    }
}

/// The kind of speech program `model` is, or an error naming what a
/// program needs.
pub fn kind(model: &Model) -> Result<Kind> {
    let names = model.method_names().join(", ");
    if model.has_method(ENCODER) || model.has_method(TEXT_DECODER) {
        for m in [ENCODER, TEXT_DECODER] {
            if !model.has_method(m) {
                return Err(Error::invalid_input(format!(
                    "the program has no method `{m}` (methods: {names}): a Whisper program \
                     needs `{ENCODER}` and `{TEXT_DECODER}` (scripts/export_whisper.py)"
                )));
            }
        }
        return Ok(Kind::Whisper);
    }
    if let Ok(inputs) = model.method_inputs("forward") {
        if let [TensorSpec {
            dtype: DType::F32,
            shape,
            ..
        }] = inputs.as_slice()
        {
            if shape.len() == 2 && shape[0] == 1 {
                return Ok(Kind::Ctc);
            }
        }
    }
    Err(Error::invalid_input(format!(
        "the program (methods: {names}) is not a speech model transcribe runs: it needs \
         methods `{ENCODER}` and `{TEXT_DECODER}` (Whisper: scripts/export_whisper.py), or a \
         CTC `forward(input_values float32 [1, samples]) -> logits [1, frames, vocab]`"
    )))
}

/// A speech program's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Whisper,
    Ctc,
}

/// Transcribe `audio` (16 kHz mono) with `model`, the vocabulary and
/// configuration read from `dir`, writing the text to `out` as it comes.
pub fn transcribe(
    model: &mut Model,
    dir: &Path,
    audio: &Audio,
    options: &Options,
    out: &mut dyn Write,
) -> Result<Report> {
    let t0 = Instant::now();
    let mut report = match kind(model)? {
        Kind::Whisper => whisper(model, dir, audio, options, out)?,
        Kind::Ctc => ctc_transcribe(model, dir, audio, options, out)?,
    };
    report.audio_seconds = audio.seconds();
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

fn write(out: &mut dyn Write, text: &str) -> Result<()> {
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Error::io("stdout", e))
}

fn dump(dir: Option<&Path>, k: usize, t: &Tensor) -> Result<()> {
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
        etmetal_core::npy::write(&dir.join(format!("window{k}.npy")), t)?;
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path.display(), e))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::invalid_input(format!("{}: {e}", path.display())))
}

/// The special tokens and rules of a Whisper model, from its
/// `generation_config.json` as transformers saves it.
#[derive(Clone, Debug)]
pub struct WhisperConfig {
    pub start: u32,
    pub end: u32,
    pub no_timestamps: u32,
    /// `<|en|>` → id.
    pub languages: Vec<(String, u32)>,
    pub transcribe: Option<u32>,
    pub translate: Option<u32>,
    pub multilingual: bool,
    pub suppress: Vec<u32>,
    pub begin_suppress: Vec<u32>,
    pub max_initial_timestamp: Option<usize>,
    /// Decoder positions (`max_length`).
    pub max_length: Option<usize>,
}

impl WhisperConfig {
    pub fn load(path: &Path) -> Result<WhisperConfig> {
        let c = read_json(path)?;
        let id = |key: &str| -> Result<u32> {
            let v = &c[key];
            v.as_u64()
                .or_else(|| v.as_array().and_then(|a| a.first()?.as_u64()))
                .map(|v| v as u32)
                .ok_or_else(|| {
                    Error::invalid_input(format!(
                        "{}: no `{key}`: Whisper's generation config names its special tokens",
                        path.display()
                    ))
                })
        };
        let ids = |key: &str| -> Vec<u32> {
            c[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_u64().map(|v| v as u32))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut languages: Vec<(String, u32)> = c["lang_to_id"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_u64()? as u32)))
                    .collect()
            })
            .unwrap_or_default();
        languages.sort_by_key(|l| l.1);
        Ok(WhisperConfig {
            start: id("decoder_start_token_id")?,
            end: id("eos_token_id")?,
            no_timestamps: id("no_timestamps_token_id")?,
            transcribe: c["task_to_id"]["transcribe"].as_u64().map(|v| v as u32),
            translate: c["task_to_id"]["translate"].as_u64().map(|v| v as u32),
            multilingual: c["is_multilingual"]
                .as_bool()
                .unwrap_or(!languages.is_empty()),
            languages,
            suppress: ids("suppress_tokens"),
            begin_suppress: ids("begin_suppress_tokens"),
            max_initial_timestamp: c["max_initial_timestamp_index"]
                .as_u64()
                .map(|v| v as usize),
            max_length: c["max_length"].as_u64().map(|v| v as usize),
        })
    }

    /// The first timestamp token (`<|0.00|>`).
    pub fn timestamp_begin(&self) -> u32 {
        self.no_timestamps + 1
    }

    /// The token of `language`: a code (`en`), `<|en|>`, or an English
    /// name of one (`english`, as transformers' `LANGUAGES` table).
    pub fn language_id(&self, language: &str) -> Result<u32> {
        let l = language.trim().to_lowercase();
        let code = match l.strip_prefix("<|").and_then(|x| x.strip_suffix("|>")) {
            Some(code) => code.to_string(),
            None => language_code(&l).unwrap_or(&l).to_string(),
        };
        let token = format!("<|{code}|>");
        self.languages
            .iter()
            .find(|(t, _)| *t == token)
            .map(|l| l.1)
            .ok_or_else(|| {
                let known: Vec<&str> = self
                    .languages
                    .iter()
                    .map(|l| l.0.as_str())
                    .take(12)
                    .collect();
                Error::invalid_input(match self.languages.is_empty() {
                    true => format!(
                        "--language {language}: this model is English-only (no language tokens)"
                    ),
                    false => format!(
                        "--language {language}: no token {token} (the model has {}: {}, ...)",
                        self.languages.len(),
                        known.join(" ")
                    ),
                })
            })
    }
}

/// A few English names of Whisper's languages (the codes work for all).
fn language_code(name: &str) -> Option<&'static str> {
    const NAMES: &[(&str, &str)] = &[
        ("english", "en"),
        ("chinese", "zh"),
        ("german", "de"),
        ("spanish", "es"),
        ("russian", "ru"),
        ("korean", "ko"),
        ("french", "fr"),
        ("japanese", "ja"),
        ("portuguese", "pt"),
        ("turkish", "tr"),
        ("polish", "pl"),
        ("dutch", "nl"),
        ("arabic", "ar"),
        ("swedish", "sv"),
        ("italian", "it"),
        ("indonesian", "id"),
        ("hindi", "hi"),
        ("finnish", "fi"),
        ("vietnamese", "vi"),
        ("hebrew", "he"),
        ("ukrainian", "uk"),
        ("greek", "el"),
        ("czech", "cs"),
        ("romanian", "ro"),
        ("danish", "da"),
        ("hungarian", "hu"),
        ("norwegian", "no"),
        ("thai", "th"),
    ];
    NAMES.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
}

/// transformers' logits processors for Whisper's greedy search, in its
/// order: `SuppressTokensAtBeginLogitsProcessor`,
/// `SuppressTokensLogitsProcessor`, then (with timestamps)
/// `WhisperTimeStampLogitsProcessor`.
pub struct WhisperRules<'a> {
    pub config: &'a WhisperConfig,
    pub timestamps: bool,
}

impl WhisperRules<'_> {
    /// Mask `logits` for the token after `sampled` (the tokens generated
    /// after the prompt so far).
    pub fn apply(&self, sampled: &[u32], logits: &mut [f32]) {
        let c = self.config;
        let ninf = f32::NEG_INFINITY;
        let mut mask = |id: u32| {
            if let Some(x) = logits.get_mut(id as usize) {
                *x = ninf;
            }
        };
        if sampled.is_empty() {
            c.begin_suppress.iter().for_each(|&t| mask(t));
        }
        c.suppress.iter().for_each(|&t| mask(t));
        if !self.timestamps {
            return;
        }
        let begin = c.timestamp_begin() as usize;
        let n = logits.len();
        logits[c.no_timestamps as usize] = ninf;
        let is_ts = |t: u32| t as usize >= begin;
        let last = sampled.last().is_some_and(|&t| is_ts(t));
        let penultimate = sampled.len() < 2 || is_ts(sampled[sampled.len() - 2]);
        if last {
            if penultimate {
                logits[begin.min(n)..].fill(ninf);
            } else {
                logits[..(c.end as usize).min(n)].fill(ninf);
            }
        }
        let mut ts_last = begin;
        if let Some(&t) = sampled.iter().rev().find(|&&t| is_ts(t)) {
            ts_last = if last && !penultimate {
                t as usize
            } else {
                t as usize + 1
            };
        }
        logits[begin.min(n)..ts_last.min(n)].fill(ninf);
        if sampled.is_empty() {
            logits[..begin.min(n)].fill(ninf);
            if let Some(m) = c.max_initial_timestamp {
                logits[(begin + m + 1).min(n)..].fill(ninf);
            }
        }
        // timestamps when their total probability beats every text token's
        let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = |xs: &[f32]| -> f64 {
            let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            if m == f64::NEG_INFINITY {
                return m;
            }
            m + xs.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let all = lse(logits);
        let ts = lse(&logits[begin.min(n)..]) - all;
        let text = logits[..begin.min(n)]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max) as f64
            - all;
        if top > f64::NEG_INFINITY && ts > text {
            logits[..begin.min(n)].fill(ninf);
        }
    }
}

/// Seconds of timestamp token `id`.
fn timestamp_seconds(config: &WhisperConfig, id: u32) -> f64 {
    (id - config.timestamp_begin()) as f64 * 0.02
}

fn whisper(
    model: &mut Model,
    dir: &Path,
    audio: &Audio,
    options: &Options,
    out: &mut dyn Write,
) -> Result<Report> {
    let config_path = dir.join("generation_config.json");
    let config = WhisperConfig::load(&config_path)?;
    let tokenizer = TextTokenizer::load(&dir.join("tokenizer.json"))?;
    let features = model.method_inputs(ENCODER)?;
    let (n_mels, frames) = match features.as_slice() {
        [TensorSpec {
            dtype: DType::F32,
            shape,
            ..
        }] if shape.len() == 3 && shape[0] == 1 => (shape[1], shape[2]),
        other => {
            return Err(Error::invalid_input(format!(
                "method `{ENCODER}` takes {:?}; Whisper's encoder takes input_features \
                 float32 [1, n_mels, frames]",
                other
                    .iter()
                    .map(|s| format!("{} {:?}", s.dtype, s.shape))
                    .collect::<Vec<_>>()
            )))
        }
    };
    let mel = mel::WhisperMel::new(n_mels);
    let mut decoder = Decoder::new(
        model,
        &DecoderMethods {
            step: TEXT_DECODER,
            prefill: None,
            greedy: None,
        },
        false,
    )?;
    if let Some(n) = config.max_length {
        decoder.limit_capacity(n);
    }
    let mut language = match &options.language {
        Some(l) => Some(config.language_id(l)?),
        None => None,
    };
    let task = match options.task {
        Task::Transcribe => config.transcribe,
        Task::Translate => Some(config.translate.ok_or_else(|| {
            Error::invalid_input(
                "--task translate: this model has no translate token (English-only)",
            )
        })?),
    };
    let mut sampler = Sampler::new(Sampling::default());
    let rules = WhisperRules {
        config: &config,
        timestamps: options.timestamps,
    };
    let window = frames * mel::HOP;
    let mut report = Report::default();
    let mut started = false;
    for (k, chunk) in audio.samples.chunks(window).enumerate() {
        let offset = (k * window) as f64 / audio.rate as f64;
        let features = Tensor::from_f32(
            DType::F32,
            &[1, n_mels, frames],
            &mel.features(chunk, frames),
        )?;
        dump(options.dump_features.as_deref(), k, &features)?;
        let t0 = Instant::now();
        model
            .execute_method(ENCODER, vec![features])
            .map_err(|e| e.context(format!("window {k} (from {offset:.2} s)")))?;
        report.encoder_seconds += t0.elapsed().as_secs_f64();
        report.windows += 1;
        let t1 = Instant::now();
        decoder.rewind(0);
        let mut prompt = vec![config.start];
        let mut next = None;
        if config.multilingual {
            let lang = match language {
                Some(l) => l,
                None => {
                    // transformers' detect_language: the start token's
                    // most likely language token
                    let Next::Logits(logits) = decoder.feed(model, &prompt)? else {
                        return Err(Error::internal("the Whisper decoder returned no logits"));
                    };
                    let best = config
                        .languages
                        .iter()
                        .max_by(|a, b| logits[a.1 as usize].total_cmp(&logits[b.1 as usize]))
                        .ok_or_else(|| Error::invalid_input("the model has no language tokens"))?;
                    report.language = Some(best.0.trim_matches(['<', '|', '>']).to_string());
                    language = Some(best.1);
                    prompt.clear();
                    best.1
                }
            };
            prompt.push(lang);
            prompt.extend(task);
        }
        if !options.timestamps {
            prompt.push(config.no_timestamps);
        }
        if !prompt.is_empty() {
            next = Some(decoder.feed(model, &prompt)?);
        }
        let mut sampled: Vec<u32> = vec![];
        let mut stream = TextStream::new(&[]);
        let mut segment_start: Option<u32> = None;
        let mut segment: Vec<u32> = vec![];
        while let Some(Next::Logits(mut logits)) = next.take() {
            rules.apply(&sampled, &mut logits);
            let token = sampler.pick(&logits);
            sampled.push(token);
            if token == config.end {
                break;
            }
            if token >= config.timestamp_begin() {
                if options.timestamps && !options.ids {
                    match segment_start.take() {
                        None => segment_start = Some(token),
                        Some(start) => {
                            let text = tokenizer.decode(&segment)?;
                            write(
                                out,
                                &format!(
                                    "[{:.2} --> {:.2}] {}\n",
                                    offset + timestamp_seconds(&config, start),
                                    offset + timestamp_seconds(&config, token),
                                    text.trim()
                                ),
                            )?;
                            segment.clear();
                        }
                    }
                }
            } else if options.timestamps {
                segment.push(token);
            } else if !options.ids {
                let mut piece = stream.push(&tokenizer, token)?;
                if !started {
                    piece = piece.trim_start().to_string();
                    started = !piece.is_empty();
                }
                write(out, &piece)?;
            }
            // transformers stops when the sequence reaches max_length
            // (the last token taken, not run)
            if decoder
                .capacity()
                .is_some_and(|c| decoder.position() + 1 >= c)
            {
                break;
            }
            next = Some(decoder.feed(model, &[token])?);
        }
        report.tokens += sampled.len();
        report.decoder_seconds += t1.elapsed().as_secs_f64();
        if options.ids {
            // the last token sampled was never run
            let all: Vec<String> = (decoder.tokens().iter().chain(sampled.last()))
                .map(u32::to_string)
                .collect();
            write(out, &format!("{}\n", all.join(" ")))?;
        } else if options.timestamps {
            if !segment.is_empty() {
                let text = tokenizer.decode(&segment)?;
                let start = segment_start.map_or(0.0, |s| timestamp_seconds(&config, s));
                write(
                    out,
                    &format!("[{:.2} --> ...] {}\n", offset + start, text.trim()),
                )?;
            }
        } else {
            write(out, &stream.finish(&tokenizer)?)?;
        }
    }
    if !options.ids && !options.timestamps {
        write(out, "\n")?;
    }
    Ok(report)
}

fn ctc_transcribe(
    model: &mut Model,
    dir: &Path,
    audio: &Audio,
    options: &Options,
    out: &mut dyn Write,
) -> Result<Report> {
    let spec = model.method_inputs("forward")?.remove(0);
    let bound = spec.shape[1];
    let dynamic = spec.dynamic.get(1).copied().unwrap_or(false);
    let logits_spec = model.method_outputs("forward")?;
    let vocab_size = logits_spec
        .first()
        .and_then(|s| s.shape.last().copied())
        .ok_or_else(|| Error::invalid_input("method `forward` returns nothing"))?;
    let vocab = ctc::Vocabulary::load(dir, vocab_size)?;
    let normalize = std::fs::read_to_string(dir.join("preprocessor_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|c| c["do_normalize"].as_bool())
        .unwrap_or(false);
    let mut report = Report::default();
    let mut text = String::new();
    for (k, chunk) in audio.samples.chunks(bound).enumerate() {
        let mut x = chunk.to_vec();
        if normalize {
            // Wav2Vec2FeatureExtractor's zero_mean_unit_var_norm
            let n = x.len() as f64;
            let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            let scale = 1.0 / (var + 1e-7).sqrt();
            x.iter_mut()
                .for_each(|v| *v = ((*v as f64 - mean) * scale) as f32);
        }
        let valid = x.len();
        if !dynamic {
            x.resize(bound, 0.0);
        }
        let input = Tensor::from_f32(DType::F32, &[1, x.len()], &x)?;
        dump(options.dump_features.as_deref(), k, &input)?;
        let outputs = model
            .execute_method("forward", vec![input])
            .map_err(|e| e.context(format!("window {k}")))?;
        let logits = outputs
            .first()
            .ok_or_else(|| Error::invalid_input("method `forward` returned nothing"))?;
        let rows = logits.shape().iter().rev().nth(1).copied().unwrap_or(0);
        // frames of the padding are left out
        let keep = (rows * valid).div_ceil(x.len().max(1));
        let ids = ctc::argmax_rows(&logits.to_f32_vec(), vocab_size);
        let ids = &ids[..keep.min(ids.len())];
        report.windows += 1;
        if options.ids {
            let line: Vec<String> = ids.iter().map(u32::to_string).collect();
            write(out, &format!("{}\n", line.join(" ")))?;
            continue;
        }
        let piece = vocab.decode(ids)?;
        if !piece.is_empty() {
            if !text.is_empty() {
                write(out, " ")?;
                text.push(' ');
            }
            write(out, &piece)?;
            text += &piece;
        }
    }
    if !options.ids {
        write(out, "\n")?;
    }
    Ok(report)
}
