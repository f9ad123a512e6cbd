//! Text generation with a decoder program: what `etmetal generate` runs.
//!
//! A decoder step is a method `(tokens int64 [1, T], positions int64 [T])
//! -> logits [1, T, vocab]` that keeps its KV cache in mutable buffers:
//! transformers' ExecuTorch recipe
//! (`TorchExportableModuleForDecoderOnlyLM`: `input_ids`, `cache_position`)
//! and decoders written by hand for on-device generation
//! (`forward(tokens, input_pos)`) both take it. `forward` is the decode
//! step (T = 1); an optional `prefill` method (T = P) takes the prompt P
//! tokens a call, the last chunk padded (see [`generate`]), or, exported
//! with a dynamic T (`Dim("seq", max=P)`), the whole prompt in one call at
//! its length; an optional
//! `decode` method is the decode step returning its greedy token (the
//! argmax of its logits, int64 [1]: scripts/export_llm.py exports it), so
//! greedy decoding reads back one token a step instead of the logits.
//!
//! [`Decoder`] drives these methods at the next positions and keeps what
//! the cache holds, and [`Sampler`] picks tokens: `generate` here, and
//! `chat` (a conversation over one cache) and `transcribe` (Whisper's
//! `text_decoder`, the same step signature) use them too.
//!
//! Text goes in and out through a Hugging Face `tokenizer.json`
//! ([`TextTokenizer`]); tokens are turned into text as they come
//! ([`TextStream`]), so a character split over several byte tokens is
//! printed whole.

use std::path::{Path, PathBuf};
use std::time::Instant;

use etmetal_core::{npy, DType, Error, Result, Tensor, TensorSpec};
use etmetal_metal_runtime::MetalBackend;

use crate::Model;

/// What a step of a decoder looks like: the rule every method is checked
/// against, stated once for the error messages.
const SIGNATURE: &str = "(tokens int64 [1, T], positions int64 [T]) -> logits [1, T, vocab] \
     (transformers' TorchExportableModuleForDecoderOnlyLM: input_ids, cache_position), \
     with the KV cache in mutable buffers";

/// The method that takes a decode step and returns its greedy token,
/// used instead of `forward` when sampling is greedy.
const GREEDY_METHOD: &str = "decode";

/// A tokenizer.json and the end-of-sequence tokens that go with it.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was read from, for messages.
    path: PathBuf,
    /// Token ids that end generation (from generation_config.json or
    /// tokenizer_config.json beside the tokenizer.json; may be empty).
    pub eos: Vec<u32>,
}

fn tok_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::invalid_input(format!("tokenizer {}: {e}", path.display()))
}

impl TextTokenizer {
    /// Read `path` (a tokenizer.json as transformers saves it). The
    /// end-of-sequence ids come from `generation_config.json` beside it
    /// (`eos_token_id`, one id or a list), else from
    /// `tokenizer_config.json`'s `eos_token`.
    pub fn load(path: &Path) -> Result<TextTokenizer> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| tok_error(path, e))?;
        let mut tokenizer = TextTokenizer {
            inner,
            path: path.to_path_buf(),
            eos: vec![],
        };
        tokenizer.eos = tokenizer.configured_eos()?;
        Ok(tokenizer)
    }

    fn configured_eos(&self) -> Result<Vec<u32>> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        if let Some(config) = read_json(&dir.join("generation_config.json"))? {
            let ids = match &config["eos_token_id"] {
                serde_json::Value::Array(ids) => ids.iter().filter_map(|i| i.as_u64()).collect(),
                id => id.as_u64().into_iter().collect::<Vec<_>>(),
            };
            if !ids.is_empty() {
                return Ok(ids.into_iter().map(|i| i as u32).collect());
            }
        }
        if let Some(config) = read_json(&dir.join("tokenizer_config.json"))? {
            let eos = &config["eos_token"];
            if let Some(text) = eos.as_str().or_else(|| eos["content"].as_str()) {
                return Ok(self.inner.token_to_id(text).into_iter().collect());
            }
        }
        Ok(vec![])
    }

    /// The id of `token`: a number, or a token's text (`<eos>`).
    pub fn token_id(&self, token: &str) -> Result<u32> {
        token
            .parse()
            .ok()
            .or_else(|| self.inner.token_to_id(token))
            .ok_or_else(|| tok_error(&self.path, format!("no token `{token}`")))
    }

    /// The prompt's token ids, with the special tokens (a BOS) the
    /// tokenizer's post-processor adds, as transformers' `tokenizer(text)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| tok_error(&self.path, e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The token ids of `text` as they are, no special tokens added (as
    /// `tokenizer(text, add_special_tokens=False)`: a rendered chat
    /// template writes its own).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| tok_error(&self.path, e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out (`decode(ids,
    /// skip_special_tokens=True)`).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| tok_error(&self.path, e))
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::invalid_input(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path.display(), e)),
    }
}

/// Turns tokens into text as they come: the text of a window of recent
/// tokens is decoded again with each new one, and what it adds is given
/// out once it is whole (not ending in U+FFFD, the mark of a character
/// whose bytes are still to come). The pieces add up to the text of all
/// tokens, prompt included.
pub struct TextStream {
    ids: Vec<u32>,
    /// The window starts here; the text of `ids[prefix..read]` was given out.
    prefix: usize,
    read: usize,
}

impl TextStream {
    /// A stream after `prompt`, whose text [`TextStream::prompt_text`] gives.
    pub fn new(prompt: &[u32]) -> TextStream {
        TextStream {
            ids: prompt.to_vec(),
            prefix: 0,
            read: 0,
        }
    }

    /// The text of the prompt (what comes before the first token's text).
    pub fn prompt_text(&mut self, tokenizer: &TextTokenizer) -> Result<String> {
        self.push_ids(tokenizer)
    }

    /// The text `id` completes, empty while a character is unfinished.
    pub fn push(&mut self, tokenizer: &TextTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        self.push_ids(tokenizer)
    }

    /// What is held back at the end: the text of bytes that never made a
    /// whole character (U+FFFD, as transformers' decode gives it).
    pub fn finish(&mut self, tokenizer: &TextTokenizer) -> Result<String> {
        self.next_piece(tokenizer, true)
    }

    fn push_ids(&mut self, tokenizer: &TextTokenizer) -> Result<String> {
        self.next_piece(tokenizer, false)
    }

    fn next_piece(&mut self, tokenizer: &TextTokenizer, last: bool) -> Result<String> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = tokenizer.decode(&self.ids[self.prefix..])?;
        if now.len() <= before.len() || (now.ends_with('\u{FFFD}') && !last) {
            return Ok(String::new());
        }
        // A decoder that strips a leading space does so in both, so the
        // window's earlier text is a prefix of its later text.
        let piece = match now.strip_prefix(&before) {
            Some(piece) => piece.to_string(),
            None => now[before.len()..].to_string(),
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}

/// How the next token is chosen from a position's logits.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// 0: greedy (the largest logit, the first of equals, as
    /// `torch.argmax`); above 0, softmax(logits / temperature) is sampled.
    pub temperature: f32,
    /// Nucleus sampling: only the most likely tokens whose probabilities
    /// add up to `top_p` are drawn from (1: all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// SplitMix64: a seeded, reproducible source for sampling.
struct Rng(u64);

impl Rng {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The token `sampling` picks from `logits` (one position's).
fn pick(logits: &[f32], sampling: &Sampling, rng: &mut Rng) -> u32 {
    let argmax = logits
        .iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
    if sampling.temperature <= 0.0 {
        return argmax as u32;
    }
    let t = sampling.temperature as f64;
    let top = logits[argmax] as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (i, ((x as f64 - top) / t).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    // keep the fewest most likely tokens reaching top_p (at least one)
    let mut kept = 0.0;
    let mut n = 0;
    for (_, p) in &probs {
        n += 1;
        kept += p / total;
        if kept >= sampling.top_p as f64 {
            break;
        }
    }
    let mass: f64 = probs[..n].iter().map(|p| p.1).sum();
    let mut r = rng.next_f64() * mass;
    for &(i, p) in &probs[..n] {
        if r < p {
            return i as u32;
        }
        r -= p;
    }
    probs[n - 1].0 as u32
}

/// The inputs of a decoder step that takes tokens at `start..`.
fn step_inputs(tokens: &[i64], start: usize) -> Result<Vec<Tensor>> {
    let positions: Vec<i64> = (start as i64..(start + tokens.len()) as i64).collect();
    Ok(vec![
        Tensor::from_i64(DType::I64, &[1, tokens.len()], tokens)?,
        Tensor::from_i64(DType::I64, &[tokens.len()], &positions)?,
    ])
}

fn not_a_step(method: &str, what: String) -> Error {
    Error::invalid_input(format!(
        "method `{method}` is not a decoder step: {what}; expected {SIGNATURE}"
    ))
}

/// A decoder method's T (tokens a call, the bound where it is dynamic),
/// logits rows (T, or 1 where it returns the last position's only) and
/// whether T is dynamic, checked against [`SIGNATURE`].
fn step_shape(model: &Model, method: &str) -> Result<(usize, usize, bool)> {
    let bad = |what: String| not_a_step(method, what);
    let (t, dynamic) = step_tokens(model, method)?;
    let outputs = model.method_outputs(method)?;
    let logits = outputs
        .first()
        .ok_or_else(|| bad("it returns nothing".into()))?;
    let vocab = logits.shape.last().copied().unwrap_or(0);
    let rows = logits.shape.iter().product::<usize>() / vocab.max(1);
    if !logits.dtype.is_float() || vocab == 0 || (rows != t && rows != 1) {
        return Err(bad(format!(
            "its first output is {} {:?}",
            logits.dtype, logits.shape
        )));
    }
    Ok((t, rows, dynamic))
}

/// Whether the greedy step `method` takes one token and returns one int64
/// token (else an error saying what it is).
fn check_greedy_step(model: &Model, method: &str) -> Result<()> {
    let (t, _) = step_tokens(model, method)?;
    let outputs = model.method_outputs(method)?;
    match outputs.first() {
        Some(TensorSpec {
            dtype: DType::I64,
            shape,
            ..
        }) if t == 1 && shape.iter().product::<usize>() == 1 => Ok(()),
        first => Err(not_a_step(
            method,
            format!(
                "it takes {t} tokens and returns {}; the greedy step takes 1 and returns \
                 its next token, int64 [1]",
                first.map_or("nothing".into(), |s| format!("{} {:?}", s.dtype, s.shape))
            ),
        )),
    }
}

/// The token a greedy step returned.
fn step_token(outputs: &[Tensor], method: &str) -> Result<u32> {
    let token = outputs.first().map(|t| t.to_i64_vec());
    match token.as_deref() {
        Some(&[id]) => u32::try_from(id).map_err(|_| {
            Error::invalid_input(format!(
                "method `{method}` returned token {id}, not a token id"
            ))
        }),
        _ => Err(Error::internal(format!(
            "method `{method}` returned no token"
        ))),
    }
}

/// A decoder method's T (tokens a call, its bound where it is dynamic)
/// and whether it is dynamic, from its inputs.
fn step_tokens(model: &Model, method: &str) -> Result<(usize, bool)> {
    let bad = |what: String| not_a_step(method, what);
    let inputs = model.method_inputs(method)?;
    let t = match inputs.as_slice() {
        [spec @ TensorSpec {
            dtype: DType::I64,
            shape: tokens,
            ..
        }, TensorSpec {
            dtype: DType::I64,
            shape: positions,
            ..
        }] if tokens.len() == 2 && tokens[0] == 1 && positions.as_slice() == [tokens[1]] => {
            (tokens[1], spec.dynamic.get(1).copied().unwrap_or(false))
        }
        _ => {
            let list: Vec<String> = inputs
                .iter()
                .map(|s| format!("{} {:?}", s.dtype, s.shape))
                .collect();
            return Err(bad(format!("it takes ({})", list.join(", "))));
        }
    };
    Ok(t)
}

/// How many positions the KV cache holds: the sequence dimension (2) of
/// the mutable buffers named like a cache (`key_cache_0`,
/// `layers.0.attn.k_cache`: `[batch, heads, positions, head_dim]`); those
/// of length 0 (transformers' placeholders for layers that share another's
/// cache) are never read. `None` where no buffer looks like one.
fn cache_len(model: &mut Model) -> Result<Option<usize>> {
    let state = model.read_state()?;
    Ok(cache_positions(
        state.iter().map(|(name, t)| (name.as_str(), t.shape())),
    ))
}

/// [`cache_len`]'s rule over mutable buffers given as (name, shape).
pub(crate) fn cache_positions<'a>(
    buffers: impl Iterator<Item = (&'a str, &'a [usize])>,
) -> Option<usize> {
    buffers
        .filter(|(name, shape)| name.to_lowercase().contains("cache") && shape.len() == 4)
        .map(|(_, shape)| shape[2])
        .filter(|&n| n > 0)
        .min()
}

/// Whether the program's state is all KV caches: every state tensor of two
/// or more dims is named like a cache. Past a cache's prompt entries no
/// earlier position reads and later tokens overwrite, so a prefill chunk
/// may be padded and the decoder may go back to an earlier position. A
/// recurrent or convolution state (linear attention, state-space layers:
/// `recurrent_state_0`, `conv_state_0`) takes in every token it sees,
/// padding included, and cannot go back.
fn caches_only(model: &mut Model) -> Result<bool> {
    Ok(model
        .read_state()?
        .iter()
        .all(|(name, t)| t.rank() < 2 || name.to_lowercase().contains("cache")))
}

/// What [`generate`] did, for the tokens/s line.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    /// Calls of the `prefill` method (0: the prompt went token by token).
    pub prefill_calls: usize,
    /// Tokens made by decode steps (the first new token comes from prefill).
    pub decode_tokens: usize,
    pub decode_seconds: f64,
    /// Generation stopped at the end of the KV cache.
    pub cache_full: bool,
    /// The method that took the decode steps (`forward`, or `decode`
    /// returning its greedy token).
    pub decode_method: String,
}

impl Stats {
    /// One line: prefill and decode rates in tokens/s.
    pub fn line(&self) -> String {
        let rate = |n: usize, s: f64| n as f64 / s.max(1e-9);
        let how = match self.prefill_calls {
            0 => "token by token".to_string(),
            1 => "1 call of `prefill`".to_string(),
            n => format!("{n} calls of `prefill`"),
        };
        format!(
            "prefill: {} tokens in {:.3} s ({:.1} tokens/s, {how}); decode: {} tokens in {:.3} s ({:.1} tokens/s, method `{}`)",
            self.prompt_tokens,
            self.prefill_seconds,
            rate(self.prompt_tokens, self.prefill_seconds),
            self.decode_tokens,
            self.decode_seconds,
            rate(self.decode_tokens, self.decode_seconds),
            self.decode_method
        )
    }
}

/// Generation settings.
#[derive(Clone, Debug)]
pub struct Options {
    /// New tokens at most (the end-of-sequence token counts, as in
    /// transformers' `max_new_tokens`).
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end generation (not given to `on_token`).
    pub eos: Vec<u32>,
}

/// The last row of logits (a step's output; `rows` rows of `vocab`) or row `row`.
fn logits_row(outputs: &[Tensor], row: usize, method: &str) -> Result<Vec<f32>> {
    let logits = outputs
        .first()
        .ok_or_else(|| Error::internal(format!("method `{method}` returned nothing")))?;
    let vocab = *logits.shape().last().unwrap_or(&0);
    let all = logits.to_f32_vec();
    all.get(row * vocab..(row + 1) * vocab)
        .map(<[f32]>::to_vec)
        .ok_or_else(|| {
            Error::internal(format!(
                "method `{method}`: no logits row {row} in {:?}",
                logits.shape()
            ))
        })
}

/// Which methods of a program make up a decoder.
#[derive(Clone, Copy, Debug)]
pub struct DecoderMethods<'a> {
    /// The decode step: one token a call, logits out ([`SIGNATURE`]).
    pub step: &'a str,
    /// The prompt's method, P tokens a call, where the program has it.
    pub prefill: Option<&'a str>,
    /// The decode step returning its greedy token, where the program has it.
    pub greedy: Option<&'a str>,
}

impl DecoderMethods<'static> {
    /// A decoder LM as `scripts/export_llm.py` exports it: `forward`,
    /// `prefill`, `decode`.
    pub const LM: DecoderMethods<'static> = DecoderMethods {
        step: "forward",
        prefill: Some("prefill"),
        greedy: Some(GREEDY_METHOD),
    };
}

/// What a call of a decoder gives for the position after its last token.
#[derive(Clone, Debug)]
pub enum Next {
    /// The logits, to pick from.
    Logits(Vec<f32>),
    /// The greedy token (the program's greedy step picked it).
    Token(u32),
}

/// A decoder over a loaded [`Model`]: its methods, checked once, and the
/// tokens whose keys and values its KV cache holds (positions `0..len`).
/// Tokens fed go in at the next position, so a conversation or a window of
/// speech continues where the last call stopped; [`Decoder::rewind`] goes
/// back to an earlier position (the cache's later rows are then never read
/// before they are written again: attention is causal by position), or to
/// the start where the program keeps recurrent state.
pub struct Decoder {
    step: String,
    /// The prefill method: its name, T, logits rows and whether T is dynamic.
    prefill: Option<(String, usize, usize, bool)>,
    /// The greedy step's name, where it is used.
    greedy: Option<String>,
    /// Positions the cache holds (`None`: unknown).
    cache: Option<usize>,
    /// The tokens in the cache, by position.
    tokens: Vec<u32>,
    /// Calls of the prefill method so far.
    pub prefill_calls: usize,
    /// The program keeps recurrent state (not only KV caches): a prefill
    /// chunk is never padded, and a rewind goes back to the start.
    recurrent: bool,
    /// A rewind went back to the start of recurrent state: the next feed
    /// resets the model's state first.
    reset: bool,
}

impl Decoder {
    /// Check `methods` of `model` against [`SIGNATURE`]. With `greedy` and
    /// a greedy step in the program, the positions after a prompt go
    /// through it (a token read back, not the logits).
    pub fn new(model: &mut Model, methods: &DecoderMethods, greedy: bool) -> Result<Decoder> {
        let step = methods.step;
        let (decode_t, _, _) = step_shape(model, step)?;
        if decode_t != 1 {
            return Err(Error::invalid_input(format!(
                "method `{step}` takes {decode_t} tokens a call, not 1: it is not a decode step \
                 (expected {SIGNATURE}, T = 1)"
            )));
        }
        let prefill = match methods.prefill.filter(|p| model.has_method(p)) {
            Some(name) => {
                let (t, rows, dynamic) = step_shape(model, name)?;
                Some((name.to_string(), t, rows, dynamic))
            }
            None => None,
        };
        let greedy = match methods.greedy.filter(|g| greedy && model.has_method(g)) {
            Some(name) => {
                check_greedy_step(model, name)?;
                Some(name.to_string())
            }
            None => None,
        };
        Ok(Decoder {
            step: step.to_string(),
            prefill,
            greedy,
            cache: cache_len(model)?,
            tokens: vec![],
            prefill_calls: 0,
            recurrent: !caches_only(model)?,
            reset: false,
        })
    }

    /// The method that takes decode steps (the greedy one where used).
    pub fn step_method(&self) -> &str {
        self.greedy.as_deref().unwrap_or(&self.step)
    }

    /// Positions the KV cache holds, where the program tells.
    pub fn capacity(&self) -> Option<usize> {
        self.cache
    }

    /// Stop at `positions` (a cache whose buffers do not say how many
    /// positions the decoder's embeddings take: Whisper's `max_length`).
    pub fn limit_capacity(&mut self, positions: usize) {
        self.cache = Some(self.cache.map_or(positions, |c| c.min(positions)));
    }

    /// The tokens the cache holds, by position.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The next position.
    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    /// Forget the positions from `position` on, and return the position
    /// the next token goes to: `position`, or 0 where the program keeps
    /// recurrent state (it took in the later tokens, and cannot forget
    /// them: the next feed resets the model's state and starts over).
    pub fn rewind(&mut self, position: usize) -> usize {
        if self.recurrent && position < self.tokens.len() {
            self.tokens.clear();
            self.reset = true;
        }
        self.tokens.truncate(position);
        self.tokens.len()
    }

    /// The bound of a dynamic prefill (a prompt longer than it takes
    /// several calls).
    pub fn dynamic_prefill_bound(&self) -> Option<usize> {
        self.prefill.as_ref().filter(|p| p.3).map(|p| p.1)
    }

    /// Run `tokens` at the next positions and return what the last one
    /// predicts. They go through the prefill method where the program has
    /// one, P tokens a call: a static prefill's last call gets the last
    /// token again at the positions after the chunk (a causal decoder's
    /// earlier positions do not see them, and they are written again
    /// before any position reads them) where its logits row is there, the
    /// positions stay inside the cache and the program keeps no recurrent
    /// state (which would take in the padding); a dynamic prefill takes each
    /// chunk at its length. What is left goes token by token through the
    /// step (the greedy step where used: then the result is its token).
    pub fn feed(&mut self, model: &mut Model, tokens: &[u32]) -> Result<Next> {
        let Some(&last) = tokens.last() else {
            return Err(Error::invalid_input("no tokens to run"));
        };
        if std::mem::take(&mut self.reset) {
            model.reset_state()?;
        }
        let start = self.position();
        if let Some(cache) = self.cache.filter(|&c| start + tokens.len() > c) {
            return Err(Error::invalid_input(format!(
                "{} tokens after position {start} are more than the KV cache holds \
                 ({cache} positions)",
                tokens.len()
            )));
        }
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let mut done = 0;
        let mut next = None;
        if let Some((name, p, rows, dynamic)) = self.prefill.clone() {
            while done < ids.len() {
                let pos = start + done;
                let n = (ids.len() - done).min(p);
                let padded = if dynamic { n } else { p };
                let fits = n == padded
                    || (!self.recurrent && rows == p && self.cache.is_some_and(|c| pos + p <= c));
                if !fits {
                    break;
                }
                let mut chunk = ids[done..done + n].to_vec();
                chunk.resize(padded, ids[done + n - 1]);
                let outputs = model
                    .execute_method(&name, step_inputs(&chunk, pos)?)
                    .map_err(|e| e.context(format!("{name} at position {pos}")))?;
                let row = if rows == 1 { 0 } else { n - 1 };
                next = Some(Next::Logits(logits_row(&outputs, row, &name)?));
                self.prefill_calls += 1;
                done += n;
            }
        }
        for (k, &t) in ids.iter().enumerate().skip(done) {
            next = Some(self.step(model, t, start + k)?);
        }
        self.tokens.extend_from_slice(tokens);
        match next {
            Some(next) => Ok(next),
            None => Err(Error::internal(format!(
                "token {last} ran through no method"
            ))),
        }
    }

    fn step(&mut self, model: &mut Model, token: i64, pos: usize) -> Result<Next> {
        let method = self.step_method().to_string();
        let outputs = model
            .execute_method(&method, step_inputs(&[token], pos)?)
            .map_err(|e| e.context(format!("{method} at position {pos}")))?;
        Ok(match self.greedy {
            Some(_) => Next::Token(step_token(&outputs, &method)?),
            None => Next::Logits(logits_row(&outputs, 0, &method)?),
        })
    }

    /// Make up to `options.max_tokens` tokens after a call that gave
    /// `next`, handing each to `on_token` (which may end generation by
    /// returning false) before it runs; an end-of-sequence token ends
    /// generation unseen, as does the end of the cache. The last token
    /// handed out is never run: it is not in the cache.
    pub fn generate(
        &mut self,
        model: &mut Model,
        next: Next,
        options: &Options,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<Stats> {
        let t0 = Instant::now();
        let mut stats = Stats {
            decode_method: self.step_method().to_string(),
            ..Stats::default()
        };
        let mut next = sampler.choose(next);
        let mut made = 0;
        while made < options.max_tokens && !options.eos.contains(&next) {
            let go_on = on_token(next)?;
            made += 1;
            if !go_on || made == options.max_tokens {
                break;
            }
            if self.cache.is_some_and(|c| self.position() >= c) {
                stats.cache_full = true;
                break;
            }
            let at = self.position();
            let out = self.step(model, next as i64, at)?;
            self.tokens.push(next);
            next = sampler.choose(out);
            stats.decode_tokens += 1;
        }
        stats.decode_seconds = t0.elapsed().as_secs_f64();
        Ok(stats)
    }
}

/// Picks tokens from logits by a [`Sampling`], with its seeded source.
pub struct Sampler {
    sampling: Sampling,
    rng: Rng,
}

impl Sampler {
    pub fn new(sampling: Sampling) -> Sampler {
        Sampler {
            sampling,
            rng: Rng(sampling.seed),
        }
    }

    /// The token `logits` give (see [`Sampling`]).
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        pick(logits, &self.sampling, &mut self.rng)
    }

    fn choose(&mut self, next: Next) -> u32 {
        match next {
            Next::Token(t) => t,
            Next::Logits(l) => self.pick(&l),
        }
    }
}

/// Run `prompt` through `model` (a fresh state: the cache is reset first),
/// then make up to `options.max_tokens` tokens, giving each to `on_token`
/// as it comes (see [`Decoder::feed`] and [`Decoder::generate`]). A
/// `prefill` of dynamic T takes the whole prompt in one call at its length
/// (a longer prompt is refused). With greedy sampling and a
/// [`GREEDY_METHOD`] in the program, the tokens after prefill and every
/// decode step go through it instead: the same step, which returns its
/// token rather than the logits.
pub fn generate(
    model: &mut Model,
    prompt: &[u32],
    options: &Options,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Stats> {
    if prompt.is_empty() {
        return Err(Error::invalid_input("the prompt has no tokens"));
    }
    let greedy = options.sampling.temperature <= 0.0;
    let mut decoder = Decoder::new(model, &DecoderMethods::LM, greedy)?;
    model.reset_state()?;
    if let Some(cache) = decoder.capacity().filter(|&c| prompt.len() > c) {
        return Err(Error::invalid_input(format!(
            "the prompt has {} tokens, more than the KV cache holds ({cache} positions)",
            prompt.len()
        )));
    }
    if let Some(bound) = decoder
        .dynamic_prefill_bound()
        .filter(|&p| prompt.len() > p)
    {
        return Err(Error::invalid_input(format!(
            "the prompt has {} tokens, more than method `prefill` takes (T <= {bound})",
            prompt.len()
        )));
    }
    let mut sampler = Sampler::new(options.sampling);
    let t0 = Instant::now();
    let next = decoder.feed(model, prompt)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let stats = decoder.generate(model, next, options, &mut sampler, &mut |id| {
        on_token(id).map(|()| true)
    })?;
    Ok(Stats {
        prompt_tokens: prompt.len(),
        prefill_seconds,
        prefill_calls: decoder.prefill_calls,
        ..stats
    })
}

/// Generate from `prompt`'s text and write the text to `out` as it comes:
/// the prompt's (special tokens left out), then each new piece, flushed,
/// then a newline. What is written is transformers'
/// `tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)`.
pub fn generate_text(
    model: &mut Model,
    tokenizer: &TextTokenizer,
    prompt: &str,
    options: &Options,
    out: &mut dyn std::io::Write,
) -> Result<Stats> {
    let ids = tokenizer.encode(prompt)?;
    let mut stream = TextStream::new(&ids);
    let mut write = |text: &str| -> Result<()> {
        out.write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("stdout", e))
    };
    write(&stream.prompt_text(tokenizer)?)?;
    let stats = generate(model, &ids, options, &mut |id| {
        write(&stream.push(tokenizer, id)?)
    })?;
    write(&stream.finish(tokenizer)?)?;
    write("\n")?;
    Ok(stats)
}

/// Run a stateful program step by step on inputs from `dir`, through one
/// loaded model: step k reads `step{k}_input{i}.npy` (and its method's
/// name from `step{k}_method.txt`, `forward` without it) and writes
/// `step{k}_output{i}.npy`. With `repeat` R > 1 the state is reset and the
/// steps run again, run r writing `run{r}_step{k}_output{i}.npy`. What the
/// parity suite compares with eager PyTorch at every step. With `gpu` (the
/// backend the model's delegates run on) each step also writes
/// `step{k}_transfers.txt`: the bytes it uploaded to the GPU and read back
/// (`uploaded N` and `read_back M` lines), which show whether its state
/// stayed on the GPU.
pub fn replay(
    model: &mut Model,
    dir: &Path,
    steps: usize,
    repeat: usize,
    gpu: Option<&MetalBackend>,
) -> Result<()> {
    for r in 0..repeat {
        if r > 0 {
            model.reset_state()?;
        }
        let run = match r {
            0 => String::new(),
            r => format!("run{r}_"),
        };
        for k in 0..steps {
            let file = dir.join(format!("step{k}_method.txt"));
            let method = match std::fs::read_to_string(&file) {
                Ok(name) => name.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => "forward".to_string(),
                Err(e) => return Err(Error::io(file.display(), e)),
            };
            let inputs = (0..model.method_inputs(&method)?.len())
                .map(|i| npy::read(&dir.join(format!("step{k}_input{i}.npy"))))
                .collect::<Result<Vec<_>>>()?;
            let before = gpu.map(MetalBackend::stats);
            let outputs = model
                .execute_method(&method, inputs)
                .map_err(|e| e.context(format!("step {k} (method `{method}`)")))?;
            if let (Some(gpu), Some(before)) = (gpu, before) {
                let after = gpu.stats();
                let file = dir.join(format!("{run}step{k}_transfers.txt"));
                let text = format!(
                    "uploaded {}\nread_back {}\n",
                    after.bytes_uploaded - before.bytes_uploaded,
                    after.bytes_read_back - before.bytes_read_back
                );
                std::fs::write(&file, text).map_err(|e| Error::io(file.display(), e))?;
            }
            for (i, t) in outputs.iter().enumerate() {
                npy::write(&dir.join(format!("{run}step{k}_output{i}.npy")), t)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest() {
        let mut rng = Rng(1);
        assert_eq!(
            pick(&[0.0, 3.0, 3.0, 1.0], &Sampling::default(), &mut rng),
            1
        );
    }

    #[test]
    fn top_p_draws_only_from_the_nucleus_and_a_seed_repeats() {
        // probabilities about 0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps two
        let logits = [3.0, 2.0, 1.0, 0.0];
        let sampling = Sampling {
            temperature: 1.0,
            top_p: 0.8,
            seed: 7,
        };
        let draw = |seed| {
            let mut rng = Rng(seed);
            (0..200)
                .map(|_| pick(&logits, &sampling, &mut rng))
                .collect::<Vec<_>>()
        };
        let a = draw(7);
        assert!(a.iter().all(|&t| t < 2), "{a:?}");
        assert!(a.contains(&0) && a.contains(&1));
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
    }

    /// A decoder over KV caches goes back to any earlier position; one
    /// with recurrent state goes back to the start, and its next feed
    /// resets the state (a chat turn whose rendering differs from what the
    /// state took in runs the conversation again).
    #[test]
    fn rewind_goes_to_the_start_of_recurrent_state() {
        let decoder = |recurrent| Decoder {
            step: "forward".into(),
            prefill: None,
            greedy: None,
            cache: None,
            tokens: vec![5, 6, 7],
            prefill_calls: 0,
            recurrent,
            reset: false,
        };
        let mut caches = decoder(false);
        assert_eq!(caches.rewind(2), 2);
        assert_eq!((caches.tokens(), caches.reset), (&[5, 6][..], false));
        let mut recurrent = decoder(true);
        assert_eq!(recurrent.rewind(3), 3, "nothing to forget");
        assert!(!recurrent.reset);
        assert_eq!(recurrent.rewind(2), 0);
        assert_eq!((recurrent.tokens(), recurrent.reset), (&[][..], true));
    }
}
