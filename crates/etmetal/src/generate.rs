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
//! Text goes in and out through a Hugging Face `tokenizer.json`
//! ([`TextTokenizer`]); tokens are turned into text as they come
//! ([`TextStream`]), so a character split over several byte tokens is
//! printed whole.

use std::path::{Path, PathBuf};
use std::time::Instant;

use etmetal_core::{npy, DType, Error, Result, Tensor, TensorSpec};

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

/// Whether [`GREEDY_METHOD`] is a one-token step returning one int64
/// token (else an error saying what it is).
fn check_greedy_step(model: &Model) -> Result<()> {
    let method = GREEDY_METHOD;
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
fn step_token(outputs: &[Tensor]) -> Result<u32> {
    let token = outputs.first().map(|t| t.to_i64_vec());
    match token.as_deref() {
        Some(&[id]) => u32::try_from(id).map_err(|_| {
            Error::invalid_input(format!(
                "method `{GREEDY_METHOD}` returned token {id}, not a token id"
            ))
        }),
        _ => Err(Error::internal(format!(
            "method `{GREEDY_METHOD}` returned no token"
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
    Ok(model
        .read_state()?
        .iter()
        .filter(|(name, t)| name.to_lowercase().contains("cache") && t.rank() == 4)
        .map(|(_, t)| t.shape()[2])
        .filter(|&n| n > 0)
        .min())
}

/// Whether a prefill chunk may be padded past the prompt: every state
/// tensor of two or more dims is a KV cache (named like one), whose
/// entries past the prompt no earlier position reads and decode
/// overwrites. A recurrent or convolution state (linear attention,
/// state-space layers: `recurrent_state_0`, `conv_state_0`) takes in
/// every token it sees, padding included.
fn paddable(model: &mut Model) -> Result<bool> {
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

/// Run `prompt` through `model` (a fresh state: the cache is reset first),
/// then make up to `options.max_tokens` tokens, giving each to `on_token`
/// as it comes. The prompt goes through `prefill` where the program has
/// one, P tokens a call: the last call's unused places get the prompt's
/// last token at the positions after it (a causal decoder's earlier
/// positions do not see them, and decode overwrites their cache entries
/// before any position does), where that stays inside the cache and the
/// program keeps no recurrent state (see [`paddable`]); what is left goes
/// token by token through `forward`. A `prefill` of dynamic T
/// takes the whole prompt in one call at its length (up to its bound). With greedy sampling and a
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
    let (decode_t, _, _) = step_shape(model, "forward")?;
    if decode_t != 1 {
        return Err(Error::invalid_input(format!(
            "method `forward` takes {decode_t} tokens a call, not 1: it is not a decode step \
             (expected {SIGNATURE}, T = 1)"
        )));
    }
    let prefill = match model.has_method("prefill") {
        true => Some(step_shape(model, "prefill")?),
        false => None,
    };
    let greedy = options.sampling.temperature <= 0.0 && model.has_method(GREEDY_METHOD);
    if greedy {
        check_greedy_step(model)?;
    }
    let step_method = if greedy { GREEDY_METHOD } else { "forward" };
    model.reset_state()?;
    let cache = cache_len(model)?;
    let pad = paddable(model)?;
    if let Some(cache) = cache.filter(|&c| prompt.len() > c) {
        return Err(Error::invalid_input(format!(
            "the prompt has {} tokens, more than the KV cache holds ({cache} positions)",
            prompt.len()
        )));
    }
    if let Some((bound, _, true)) = prefill.filter(|&(p, _, _)| prompt.len() > p) {
        return Err(Error::invalid_input(format!(
            "the prompt has {} tokens, more than method `prefill` takes (T <= {bound})",
            prompt.len()
        )));
    }
    let tokens: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut stats = Stats {
        prompt_tokens: prompt.len(),
        decode_method: step_method.to_string(),
        ..Stats::default()
    };
    let mut rng = Rng(options.sampling.seed);
    let t0 = Instant::now();
    let mut pos = 0;
    let mut logits = vec![];
    if let Some((p, rows, dynamic)) = prefill {
        while pos < tokens.len() {
            let n = (tokens.len() - pos).min(p);
            // a dynamic prefill takes the chunk as it is; a static one pads
            // a short chunk only where its logits row is there, its
            // positions stay inside the cache and no recurrent state would
            // take in the padding
            let padded = if dynamic { n } else { p };
            let fits = n == padded || (pad && rows == p && cache.is_some_and(|c| pos + p <= c));
            if !fits {
                break;
            }
            let mut chunk = tokens[pos..pos + n].to_vec();
            chunk.resize(padded, tokens[pos + n - 1]);
            let outputs = model
                .execute_method("prefill", step_inputs(&chunk, pos)?)
                .map_err(|e| e.context(format!("prefill at position {pos}")))?;
            logits = logits_row(&outputs, if rows == 1 { 0 } else { n - 1 }, "prefill")?;
            stats.prefill_calls += 1;
            pos += n;
        }
    }
    // the token after the prompt: a greedy step's, else picked from logits
    let mut stepped = None;
    for (k, &t) in tokens.iter().enumerate().skip(pos) {
        let outputs = model
            .execute_method(step_method, step_inputs(&[t], k)?)
            .map_err(|e| e.context(format!("prompt token at position {k}")))?;
        if greedy {
            stepped = Some(step_token(&outputs)?);
        } else {
            logits = logits_row(&outputs, 0, step_method)?;
        }
    }
    let mut next = match stepped {
        Some(token) => token,
        None => pick(&logits, &options.sampling, &mut rng),
    };
    stats.prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut made = 0;
    while made < options.max_tokens && !options.eos.contains(&next) {
        on_token(next)?;
        made += 1;
        if made == options.max_tokens {
            break;
        }
        let at = prompt.len() + made - 1;
        if cache.is_some_and(|c| at >= c) {
            stats.cache_full = true;
            break;
        }
        let outputs = model
            .execute_method(step_method, step_inputs(&[next as i64], at)?)
            .map_err(|e| e.context(format!("decode at position {at}")))?;
        next = if greedy {
            step_token(&outputs)?
        } else {
            pick(
                &logits_row(&outputs, 0, step_method)?,
                &options.sampling,
                &mut rng,
            )
        };
        stats.decode_tokens += 1;
    }
    stats.decode_seconds = t1.elapsed().as_secs_f64();
    Ok(stats)
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
/// parity suite compares with eager PyTorch at every step.
pub fn replay(model: &mut Model, dir: &Path, steps: usize, repeat: usize) -> Result<()> {
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
            let outputs = model
                .execute_method(&method, inputs)
                .map_err(|e| e.context(format!("step {k} (method `{method}`)")))?;
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
}
