//! `etmetal compile --calibrate FILE`: the statistics calibrated
//! quantization needs (`etmetal_graph::quantize::Calibration`), gathered by
//! running the model itself on the CPU kernels over the user's tokens.
//!
//! The tokens: FILE is UTF-8 text, turned into tokens by `--tokenizer
//! tokenizer.json` (with the special tokens the tokenizer adds, as
//! `etmetal generate` encodes a prompt), or, without a tokenizer, token ids
//! (integers separated by whitespace or commas). At least [`MIN_TOKENS`]
//! are needed.
//!
//! The run: a decoder step method (`tokens int64 [1, T]`, with or without
//! `positions int64 [T]`, the KV cache in mutable buffers: the form
//! `etmetal generate` runs; the method of the largest T, `prefill` where
//! there is one) takes the tokens T a call, its state carried from call to
//! call. A stretch of context is at most [`CONTEXT`] tokens and what the
//! cache holds: then the state is reset, and the next stretch starts again
//! at position 0 (after the tokenizer's leading special tokens, a BOS,
//! again). A last call short of T tokens is padded with its last token, and
//! the padded rows are left out of the statistics. Nodes whose results
//! neither a calibrated linear nor the state needs (the LM head, the
//! logits) are not run. For each quantizable linear (the rule of
//! `quantize::linear_weight`) the activations it reads add to `Σ x xᵀ`,
//! one sum per input (q, k and v share theirs).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use etmetal_core::{DType, Error, Op, Result, Tensor};
use etmetal_graph::quantize::{linear_weight, weight_name, Calibration, InputStats};
use etmetal_graph::{Graph, InputKind, OutputKind, ValueId};

use crate::generate::TextTokenizer;

/// Fewer tokens than this are refused: the second moments of K up to a
/// few thousand channels would rest on too few samples.
pub const MIN_TOKENS: usize = 256;

/// The longest stretch of context a calibration call sees.
pub const CONTEXT: usize = 512;

/// The tokens of a calibration file: text through `tokenizer`, or token
/// ids. Also the leading special tokens each stretch of context starts
/// with (the tokenizer's BOS; none for ids).
pub fn read_tokens(path: &Path, tokenizer: Option<&Path>) -> Result<(Vec<u32>, Vec<u32>)> {
    let at =
        |what: String| Error::invalid_input(format!("calibration file {}: {what}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| Error::io(path.display(), e))?;
    let text = match std::str::from_utf8(&bytes) {
        Ok(text) => text,
        Err(e) => {
            let utf16 = bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff]);
            return Err(at(format!(
                "not UTF-8 (byte {} is not part of a UTF-8 character{}): give UTF-8 text",
                e.valid_up_to(),
                if utf16 {
                    "; the file starts with a UTF-16 byte-order mark"
                } else {
                    ""
                }
            )));
        }
    };
    let (tokens, prefix) = match tokenizer {
        Some(tok) => {
            let tokenizer = TextTokenizer::load(tok)?;
            let tokens = tokenizer.encode(text.strip_prefix('\u{feff}').unwrap_or(text))?;
            let prefix = tokenizer.encode("")?;
            (tokens, prefix)
        }
        None => {
            let mut ids = vec![];
            for (line, l) in text.lines().enumerate() {
                for word in l
                    .split(|c: char| c.is_whitespace() || c == ',')
                    .filter(|w| !w.is_empty())
                {
                    let id = word.parse::<u32>().map_err(|_| {
                        at(format!(
                            "`{}` on line {} is not a token id: without --tokenizer the file must \
                             hold token ids (integers separated by spaces or commas); give \
                             --tokenizer tokenizer.json to calibrate on text",
                            word.chars().take(40).collect::<String>(),
                            line + 1
                        ))
                    })?;
                    ids.push(id);
                }
            }
            (ids, vec![])
        }
    };
    if tokens.len() < MIN_TOKENS {
        return Err(at(format!(
            "{} tokens, fewer than the {MIN_TOKENS} calibration needs: give a longer text",
            tokens.len()
        )));
    }
    Ok((tokens, prefix))
}

/// How a method takes tokens: T a call, and whether it also takes their
/// positions.
struct Step {
    tokens: ValueId,
    positions: Option<ValueId>,
    t: usize,
}

/// The method's step inputs, or why it has none.
fn step_of(graph: &Graph) -> std::result::Result<Step, String> {
    let inputs: Vec<ValueId> = graph.user_inputs().collect();
    let info = |v: ValueId| graph.value(v);
    let int = |v: ValueId| matches!(info(v).dtype, DType::I64 | DType::I32);
    match inputs[..] {
        [tok] if int(tok) && info(tok).shape.len() == 2 && info(tok).shape[0] == 1 => Ok(Step {
            tokens: tok,
            positions: None,
            t: info(tok).shape[1],
        }),
        [tok, pos]
            if int(tok)
                && int(pos)
                && info(tok).shape.len() == 2
                && info(tok).shape[0] == 1
                && info(pos).shape == [info(tok).shape[1]] =>
        {
            Ok(Step {
                tokens: tok,
                positions: Some(pos),
                t: info(tok).shape[1],
            })
        }
        _ => {
            let list: Vec<String> = inputs
                .iter()
                .map(|&v| format!("{} {:?}", info(v).dtype, info(v).shape))
                .collect();
            Err(format!("it takes ({})", list.join(", ")))
        }
    }
}

/// The method calibration runs: the one taking the most tokens a call.
pub fn pick_method(methods: &[(&str, &Graph)]) -> Result<usize> {
    let mut why = vec![];
    let mut best: Option<(usize, usize)> = None;
    for (i, (name, graph)) in methods.iter().enumerate() {
        match step_of(graph) {
            Ok(step) if best.is_none_or(|(_, t)| step.t > t) => best = Some((i, step.t)),
            Ok(_) => {}
            Err(e) => why.push(format!("`{name}`: {e}")),
        }
    }
    best.map(|(i, _)| i).ok_or_else(|| {
        Error::invalid_input(format!(
            "--calibrate runs a decoder step, a method taking (tokens int64 [1, T]) or \
             (tokens int64 [1, T], positions int64 [T]); no method does ({})",
            why.join("; ")
        ))
    })
}

/// The nodes worth running: those the state's new values or a calibrated
/// linear's input need.
fn needed(graph: &Graph, observed: &[usize]) -> Vec<bool> {
    let mut want: Vec<bool> = vec![false; graph.values.len()];
    for (v, kind) in &graph.outputs {
        if matches!(kind, OutputKind::BufferMutation { .. }) {
            want[v.0] = true;
        }
    }
    for &i in observed {
        if let Some(Some(x)) = graph.nodes[i].inputs.first() {
            want[x.0] = true;
        }
    }
    let mut run = vec![false; graph.nodes.len()];
    for (i, node) in graph.nodes.iter().enumerate().rev() {
        if node.outputs.iter().any(|v| want[v.0]) {
            run[i] = true;
            for v in node.inputs.iter().flatten() {
                want[v.0] = true;
            }
        }
    }
    run
}

/// Run `graph` (a decoder step method, see the module comment) over
/// `tokens` and gather the statistics of every quantizable linear's input.
/// `prefix`: the tokens each stretch of context after the first starts
/// with. `progress` gets a line now and then.
pub fn calibrate(
    graph: &Graph,
    tokens: &[u32],
    prefix: &[u32],
    progress: &mut dyn FnMut(&str),
) -> Result<Calibration> {
    let step = step_of(graph).map_err(|e| Error::invalid_input(format!("--calibrate: {e}")))?;
    // the vocabulary: the rows of the table the tokens index
    let vocab = graph
        .nodes
        .iter()
        .find_map(|n| match (&n.op, &n.inputs[..]) {
            (Op::Embedding, [Some(w), Some(i)]) if *i == step.tokens => {
                Some(graph.value(*w).shape[0])
            }
            _ => None,
        });
    let outside = vocab.and_then(|v| tokens.iter().find(|&&t| t as usize >= v).map(|t| (t, v)));
    if let Some((bad, vocab)) = outside {
        return Err(Error::invalid_input(format!(
            "calibration token {bad} is outside the model's vocabulary of {vocab} (is the \
             tokenizer the model's?)"
        )));
    }
    // the mutable state, and where it starts
    let mutated = graph.buffer_mutations()?;
    let initial: HashMap<ValueId, Tensor> = mutated
        .iter()
        .filter_map(|(b, _)| graph.constants.get(b).map(|t| (*b, t.clone())))
        .collect();
    let names: HashMap<ValueId, &str> = graph
        .inputs
        .iter()
        .filter_map(|(v, k)| match k {
            InputKind::Buffer { fqn, .. } => Some((*v, fqn.as_str())),
            _ => None,
        })
        .collect();
    let cache = crate::generate::cache_positions(
        initial
            .iter()
            .filter_map(|(v, t)| Some((*names.get(v)?, t.shape()))),
    );
    let positions = match (step.positions, cache) {
        (None, _) => step.t,
        (Some(_), Some(c)) => c.min(CONTEXT),
        (Some(_), None) => CONTEXT,
    };
    // calls a stretch of context, at least one
    let calls_per = (positions / step.t).max(1);
    let observed: Vec<usize> = graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| linear_weight(graph, n).is_ok())
        .map(|(i, _)| i)
        .collect();
    if observed.is_empty() {
        return Err(Error::invalid_input(
            "--calibrate: the method has no linear layer to calibrate",
        ));
    }
    let run = needed(graph, &observed);
    let mut stats: HashMap<ValueId, InputStats> = HashMap::new();
    let mut state = initial.clone();
    let (mut at, mut call, mut done) = (0usize, 0usize, 0usize);
    let mut said = std::time::Instant::now();
    while done < tokens.len() {
        if call == calls_per {
            // a new stretch of context
            state = initial.clone();
            call = 0;
        }
        let lead: &[u32] = if call == 0 && done > 0 { prefix } else { &[] };
        let room = step.t.saturating_sub(lead.len()).max(1);
        let take = room.min(tokens.len() - done);
        let mut ids: Vec<i64> = lead
            .iter()
            .chain(&tokens[done..done + take])
            .map(|&t| t as i64)
            .collect();
        let valid = ids.len();
        ids.resize(step.t, *ids.last().unwrap_or(&0));
        if call == 0 {
            at = 0;
        }
        let tok_dtype = graph.value(step.tokens).dtype;
        let mut inputs = vec![Tensor::from_i64(tok_dtype, &[1, step.t], &ids)?];
        if let Some(p) = step.positions {
            let pos: Vec<i64> = (at as i64..(at + step.t) as i64).collect();
            inputs.push(Tensor::from_i64(graph.value(p).dtype, &[step.t], &pos)?);
        }
        let t = step.t;
        let mut observe = |node: &etmetal_graph::Node, args: &[Option<&Tensor>]| -> Result<()> {
            let (Ok(_), Some(Some(x)), Some(Some(xv))) = (
                linear_weight(graph, node),
                args.first(),
                node.inputs.first(),
            ) else {
                return Ok(());
            };
            let k = *x.shape().last().unwrap_or(&0);
            let rows = x.numel() / k.max(1);
            let values = x.to_f32_vec();
            // the rows of tokens that were not padding
            let kept: Vec<f32> = values
                .chunks_exact(k)
                .enumerate()
                .filter(|(r, _)| rows % t != 0 || r % t < valid)
                .flat_map(|(_, row)| row.iter().copied())
                .collect();
            stats
                .entry(*xv)
                .or_insert_with(|| InputStats::new(k))
                .add(&kept, kept.len() / k.max(1));
            Ok(())
        };
        let outputs =
            crate::eval::run_graph_observed(graph, inputs, &state, Some(&run), &mut observe)
                .map_err(|e| e.context(format!("calibrating on tokens {done}..{}", done + take)))?;
        for ((v, kind), t) in graph.outputs.iter().zip(outputs) {
            if let (OutputKind::BufferMutation { .. }, Some(t)) = (kind, t) {
                if let Some((b, _)) = mutated.iter().find(|(_, new)| new == v) {
                    state.insert(*b, t);
                }
            }
        }
        done += take;
        at += step.t;
        call += 1;
        if said.elapsed().as_secs() >= 20 {
            progress(&format!("calibration: {done} of {} tokens", tokens.len()));
            said = std::time::Instant::now();
        }
    }
    let shared: HashMap<ValueId, Arc<InputStats>> =
        stats.into_iter().map(|(v, s)| (v, Arc::new(s))).collect();
    let mut out = Calibration {
        stats: HashMap::new(),
        tokens: tokens.len(),
    };
    for &i in &observed {
        let node = &graph.nodes[i];
        let (Ok(w), Some(Some(x))) = (linear_weight(graph, node), node.inputs.first()) else {
            continue;
        };
        if let Some(s) = shared.get(x) {
            out.stats.insert(weight_name(graph, w.value), s.clone());
        }
    }
    Ok(out)
}

/// `--quantize mixed --calibrate`: what one weight's int4 form does to
/// the model. The step method runs once on the first T calibration tokens
/// (its `T`, from the start of the context) and keeps every value; a
/// weight is then measured by replacing it alone with its dequantized
/// int4 values and running again what it reaches
/// ([`crate::eval::rerun_from`]): the mean KL divergence
/// `KL(float ‖ int4)` of the next-token distributions over the T rows.
/// The logits are the method's first float output. Where a tied weight is
/// also an embedding's table (Gemma's head), the embedding reads the
/// replaced table too, as the quantized program's gather does.
pub struct Sweep<'g> {
    graph: &'g Graph,
    trace: crate::eval::Trace,
    logits: ValueId,
    /// Log-probabilities of the float run, `[rows, vocab]`.
    reference: Vec<f32>,
    vocab: usize,
    /// The rows that are real tokens (not padding).
    rows: usize,
    /// Each quantizable weight by name: its value, and whether it is
    /// stored as `W.T`.
    weights: HashMap<String, (ValueId, bool)>,
}

/// Log-softmax of each row of `x` (`[rows, vocab]`), in f64, as f32.
fn log_softmax(x: &[f32], vocab: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(vocab) {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        let log_z = max + sum.ln();
        out.extend(row.iter().map(|&v| (v as f64 - log_z) as f32));
    }
    out
}

impl<'g> Sweep<'g> {
    /// Run `graph` (a decoder step method) on the first T of `tokens`.
    pub fn new(graph: &'g Graph, tokens: &[u32]) -> Result<Sweep<'g>> {
        let step = step_of(graph).map_err(|e| Error::invalid_input(format!("--calibrate: {e}")))?;
        let logits = graph
            .outputs
            .iter()
            .find(|(v, k)| matches!(k, OutputKind::User) && graph.value(*v).dtype.is_float())
            .map(|(v, _)| *v)
            .ok_or_else(|| {
                Error::invalid_input(
                    "--quantize mixed --calibrate measures each weight on the model's logits: \
                     the method has no float output",
                )
            })?;
        let rows = step.t.min(tokens.len());
        let mut ids: Vec<i64> = tokens[..rows].iter().map(|&t| t as i64).collect();
        ids.resize(step.t, *ids.last().unwrap_or(&0));
        let mut inputs = vec![Tensor::from_i64(
            graph.value(step.tokens).dtype,
            &[1, step.t],
            &ids,
        )?];
        if let Some(p) = step.positions {
            let pos: Vec<i64> = (0..step.t as i64).collect();
            inputs.push(Tensor::from_i64(graph.value(p).dtype, &[step.t], &pos)?);
        }
        let trace = crate::eval::Trace::new(graph, inputs, &HashMap::new())
            .map_err(|e| e.context("measuring the float model's logits"))?;
        let out = trace
            .value(logits)
            .ok_or_else(|| Error::internal("the logits were not computed"))?;
        let vocab = *out.shape().last().unwrap_or(&1);
        let all = out.numel() / vocab.max(1);
        // the logits of each token of the call: `[1, T, V]` (or `[T, V]`);
        // a method returning the last token's alone measures that one
        let rows = if all == step.t { rows } else { all };
        let reference = log_softmax(&out.to_f32_vec()[..rows * vocab], vocab);
        let mut weights = HashMap::new();
        for node in &graph.nodes {
            if let Ok(w) = linear_weight(graph, node) {
                weights.insert(weight_name(graph, w.value), (w.value, w.transposed));
            }
        }
        Ok(Sweep {
            graph,
            trace,
            logits,
            reference,
            vocab,
            rows,
            weights,
        })
    }

    /// Tokens (rows of logits) each measurement covers.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The mean KL divergence of the logits with weight `name` replaced by
    /// `w [n, k]`; `None` where the method does not read the weight.
    pub fn kl(&self, name: &str, w: &[f32], n: usize, k: usize) -> Result<Option<f64>> {
        let Some(&(value, transposed)) = self.weights.get(name) else {
            return Ok(None);
        };
        let old = &self.graph.constants[&value];
        let values = match transposed {
            false => w.to_vec(),
            true => {
                let mut t = vec![0.0f32; w.len()];
                for r in 0..n {
                    for c in 0..k {
                        t[c * n + r] = w[r * k + c];
                    }
                }
                t
            }
        };
        let tensor = Tensor::from_f32(old.dtype(), old.shape(), &values)?;
        let out = crate::eval::rerun_from(self.graph, &self.trace, value, &tensor, self.logits)
            .map_err(|e| e.context(format!("measuring `{name}` in int4")))?;
        let v = self.vocab;
        let got = log_softmax(&out.to_f32_vec()[..self.rows * v], v);
        let mut kl = 0.0f64;
        for (p, q) in self.reference.chunks_exact(v).zip(got.chunks_exact(v)) {
            kl += p
                .iter()
                .zip(q)
                .map(|(&a, &b)| (a as f64).exp() * (a as f64 - b as f64))
                .sum::<f64>();
        }
        Ok(Some(kl / self.rows.max(1) as f64))
    }
}
