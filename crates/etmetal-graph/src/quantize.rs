//! `--quantize int4`: every linear whose weight is a constant and whose K
//! divides by the group size becomes an [`Op::Int4Linear`] reading 4-bit
//! weights (the layout of [`etmetal_core::int4`], as int32 words), one
//! scale and one zero per group of each output channel, stored in the
//! weight's dtype.
//!
//! Which linears: `Op::Linear` (`x @ W.T + b`) and `Op::MatMul` of an
//! activation of rank >= 2 with a constant 2-D `B = W.T`. A weight is left
//! alone when K does not divide by the group, when the constant holds no
//! data, or when its name (parameter fqn, or value name) or the node's name
//! contains one of the skip patterns.
//!
//! Int4 linears of one input (q, k and v; gate and up) then become one
//! product of their weights concatenated along N, each output a slice of
//! it (`merge_siblings`).
//!
//! The embedding is never quantized: it is a gather, not a linear, and
//! reads one row a token, so 4 bits would save disk but no decode time.
//! The LM head is quantized by default, as the seed's `fpa4w` filter does
//! (every `nn.Linear`): it is the largest matmul of a decoder step, so it
//! gains most from 4-bit reads. Where it is tied to the embedding, the
//! float table stays for the embedding beside the int4 copy (the file grows
//! by the int4 copy); `--quantize-skip lm_head` keeps it in float, and for
//! a tied head, whose weight carries the embedding's name, the embedding's
//! name does (`--quantize-skip embed_tokens`). On Gemma 3 270M (tied,
//! 262144 x 640, 62% of the linears' weights) the head costs a fifth of
//! the loss (simulation below, 300 tokens: next-token agreement with bf16
//! 77.3% all int4, 80.0% with the head in float, 84.7% the head alone in
//! int4; mean KL 0.166, 0.133, 0.040), while keeping it in float stores the
//! 320 MiB bf16 transposed head in place of its 100 MiB int4 copy (file 0.59
//! -> about 0.85 of bf16's) and reads 3.2x the head's bytes per decoded
//! token.
//!
//! Each group (`w = code * scale + zero`, codes 0..15) is fitted by:
//! 1. asymmetric min-max (`zero = min`, `scale = (max - min) / 15`);
//! 2. refinement: alternately refit scale and zero by least squares to the
//!    codes and re-round the codes, keeping a group's new parameters only
//!    while its squared error drops (HQQ refines the zero with an l_p,
//!    p < 1, proximal step; we minimise l_2, the error the matmul sees);
//! 3. scale and zero rounded to the stored dtype, and the codes re-rounded
//!    to those stored values (the grid the kernels read).
//!
//! Relative error `|W - Ŵ|² / |W|²` (group 32, 256x4096): gaussian
//! min-max 6.12e-3, refined 5.23e-3; student-t(3) 8.35e-3, 6.97e-3.
//! On Gemma 3 270M (scripts/int4_sensitivity.py: every linear of eager
//! transformers replaced by its dequantized weight, against the bf16
//! weights, 600 tokens of tests/parity/data/around_the_world_ch1.txt;
//! next-token agreement, mean KL, perplexity (bf16: 23.92), weight error):
//!   min-max + refinement:             77.3%, 0.177, 28.76, 6.13e-3
//!   the same, codes re-rounded (3.):  78.3%, 0.179, 28.67, 6.12e-3
//! and on 300 tokens: min-max alone 70.3%, 0.248, 31.42, 7.21e-3; group
//! 64 67.7%, 0.318, 33.12, 9.48e-3 (group 32: 77.3%, 0.166, 28.71). Through
//! `etmetal compile` (scripts/eval_llm.py, 1165 tokens; perplexity of bf16
//! 30.55): before step 3 75.7%, 0.201, 37.57; with it 75.4%, 0.204, 37.71,
//! the same within the noise: step 3 is kept because it makes each code
//! the nearest on the grid the kernels read, for no cost.
//! Tried and left out:
//! - a clip search before the refinement, as llama.cpp's
//!   `make_qkx2_quants` (codes rounded with the step `(max - min) / r`,
//!   r over 14..16 and 10..13, least-squares refit, the group's best kept):
//!   weight error -8% (gaussian 4.80e-3, student-t 6.45e-3, Gemma 5.62e-3),
//!   but through `etmetal compile` on 1165 tokens (scripts/eval_llm.py)
//!   agreement 73.6% against refinement's 75.4%, KL 0.186 against
//!   0.204, perplexity 38.25 against 37.71, for 4x the quantization time;
//! - weighing each input channel's error by the square of the RMSNorm
//!   scale in front of the linear (data-free): worse (74.8%, 0.219);
//! - weighing it by the activations' mean square on the evaluated text
//!   itself, an upper bound for calibrated methods (AWQ, GPTQ-like):
//!   82.7%, 0.080, but it needs calibration data.
//!
//! So about 75% agreement is what per-group 4-bit rounding gives this
//! model without calibration. Sensitivity per tensor kind (300 tokens, one
//! kind in int4 at a time): v_proj 91.0%, up_proj 91.0%, gate_proj 91.7%,
//! down_proj 91.7%, q_proj 94.7%, k_proj 95.7%, o_proj 97.7% (Q4_K in the
//! GGUF: already on a 4-bit grid); the first or the last layer alone 95%.
//! What `etmetal compile` itself gives is measured by scripts/eval_llm.py
//! (BENCHMARKS.md).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use etmetal_core::int4::{as_words, pack, GROUP_SIZES};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use crate::decompose::eliminate_dead_code;
use crate::ir::{Graph, InputKind, Node, ValueId};

/// Least-squares refinement rounds per group: the error stops dropping
/// after 3-4 on gaussian and heavy-tailed weights.
const REFINE_ROUNDS: usize = 6;

/// How [`quantize_weight`] fits each group's scale and zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// `zero = min`, `scale = (max - min) / 15`.
    MinMax,
    /// Min-max, then least-squares refinement: what `--quantize int4`
    /// uses.
    Refine,
}

/// An int4 weight `[N, K]`: packed codes `[N, K/2]`, scales and zeros
/// `[N, K/group]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Int4Weight {
    pub packed: Vec<u8>,
    pub scales: Vec<f32>,
    pub zeros: Vec<f32>,
}

/// Codes of one group for `scale`, `zero`, and their squared error.
fn codes(w: &[f32], scale: f32, zero: f32, q: &mut [u8]) -> f64 {
    let inv = 1.0 / scale;
    let mut err = 0.0f64;
    for (v, c) in w.iter().zip(q.iter_mut()) {
        *c = ((v - zero) * inv).round().clamp(0.0, 15.0) as u8;
        let d = (*c as f32 * scale + zero - v) as f64;
        err += d * d;
    }
    err
}

/// The `(scale, zero)` minimising the squared error of `w` for the codes
/// `q`; None when the codes do not determine a positive scale.
fn least_squares(w: &[f32], q: &[u8]) -> Option<(f32, f32)> {
    let n = w.len() as f64;
    let (mut sq, mut sqq, mut sw, mut sqw) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&v, &c) in w.iter().zip(q) {
        let (c, v) = (c as f64, v as f64);
        sq += c;
        sqq += c * c;
        sw += v;
        sqw += c * v;
    }
    let det = n * sqq - sq * sq;
    if det <= 0.0 {
        return None;
    }
    let scale = (n * sqw - sq * sw) / det;
    (scale > 1e-12).then(|| (scale as f32, ((sw - scale * sq) / n) as f32))
}

/// `(scale, zero)` of one group, its codes written into `q`; `trial` is
/// scratch of the group's length.
fn quantize_group(w: &[f32], fit: Fit, q: &mut [u8], trial: &mut [u8]) -> (f32, f32) {
    let (lo, hi) = w
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let mut best = (((hi - lo) / 15.0).max(1e-8), lo);
    let mut best_err = codes(w, best.0, best.1, q);
    if fit == Fit::MinMax {
        return best;
    }
    // Refinement: refit to the codes, re-round the codes, while the error
    // drops.
    trial.copy_from_slice(q);
    for _ in 0..REFINE_ROUNDS {
        let Some((scale, zero)) = least_squares(w, trial) else {
            break;
        };
        let err = codes(w, scale, zero, trial);
        if err >= best_err {
            break;
        }
        (best, best_err) = ((scale, zero), err);
        q.copy_from_slice(trial);
    }
    best
}

/// Quantize `w [N, K]` (row-major) with groups of `group_size` along K,
/// scales and zeros stored in `dtype`: the codes are rounded to the
/// stored (rounded) parameters, which the kernels read.
pub fn quantize_weight(
    w: &[f32],
    n: usize,
    k: usize,
    group_size: usize,
    fit: Fit,
    dtype: DType,
) -> Result<Int4Weight> {
    let groups = n * (k / group_size);
    let mut q = vec![0u8; n * k];
    let mut scales = vec![0f32; groups];
    let mut zeros = vec![0f32; groups];
    // rows of groups split over the cores: each group is independent
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = groups.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (((w, q), s), z) in w
            .chunks(per * group_size)
            .zip(q.chunks_mut(per * group_size))
            .zip(scales.chunks_mut(per))
            .zip(zeros.chunks_mut(per))
        {
            scope.spawn(move || {
                let mut trial = vec![0u8; group_size];
                for (((wg, qg), s), z) in w
                    .chunks_exact(group_size)
                    .zip(q.chunks_exact_mut(group_size))
                    .zip(s.iter_mut())
                    .zip(z.iter_mut())
                {
                    (*s, *z) = quantize_group(wg, fit, qg, &mut trial);
                }
            });
        }
    });
    let stored = |v: &[f32]| -> Result<Vec<f32>> {
        Ok(Tensor::from_f32(dtype, &[v.len()], v)?.to_f32_vec())
    };
    let (scales, zeros) = (stored(&scales)?, stored(&zeros)?);
    for (i, (wg, qg)) in w
        .chunks_exact(group_size)
        .zip(q.chunks_exact_mut(group_size))
        .enumerate()
    {
        codes(wg, scales[i], zeros[i], qg);
    }
    Ok(Int4Weight {
        packed: pack(&q),
        scales,
        zeros,
    })
}

/// The float weight `[N, K]` an int4 weight stands for.
pub fn dequantize_weight(w: &Int4Weight, k: usize, group_size: usize) -> Vec<f32> {
    let groups = k / group_size;
    etmetal_core::int4::unpack(&w.packed)
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let g = (i / k) * groups + (i % k) / group_size;
            c as f32 * w.scales[g] + w.zeros[g]
        })
        .collect()
}

/// What [`quantize_int4`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizeReport {
    /// Nodes whose weight became int4.
    pub quantized: Vec<String>,
    /// `(node, why)` for linears left in float.
    pub skipped: Vec<(String, String)>,
    /// Quantized nodes whose int4 weight came from the cache (made for
    /// another method or node), a subset of `quantized`.
    pub reused: Vec<String>,
}

fn weight_name(g: &Graph, v: ValueId) -> String {
    g.inputs
        .iter()
        .find_map(|(id, kind)| match kind {
            InputKind::Parameter { fqn }
            | InputKind::Buffer { fqn, .. }
            | InputKind::Constant { fqn }
                if *id == v =>
            {
                Some(fqn.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| g.value(v).name.clone())
}

/// A linear node's weight: its value, whether it is stored as `B = W.T`
/// (a matmul's), and `[N, K]`; or why it is not quantized.
fn linear_weight(
    g: &Graph,
    node: &Node,
) -> std::result::Result<(ValueId, bool, usize, usize), String> {
    let (w, transposed) = match &node.op {
        Op::Linear => (node.inputs.get(1).copied().flatten(), false),
        Op::MatMul => (node.inputs.get(1).copied().flatten(), true),
        _ => return Err("not a linear".into()),
    };
    let w = w.ok_or("no weight")?;
    let t = g.constants.get(&w).ok_or("its weight is not a constant")?;
    if g.fake_constants.contains(&w) {
        return Err("its weight holds no data".into());
    }
    if !t.dtype().is_float() || t.rank() != 2 {
        return Err(format!(
            "weight {} {:?} is not a float matrix",
            t.dtype(),
            t.shape()
        ));
    }
    let x = node.inputs[0].map(|x| g.value(x)).ok_or("no input")?;
    if x.shape.len() < 2 && transposed {
        return Err("a matmul of a vector".into());
    }
    let (r, c) = (t.shape()[0], t.shape()[1]);
    Ok(if transposed {
        (w, true, c, r)
    } else {
        (w, false, r, c)
    })
}

/// The weight `t` as `W [N, K]`, row-major f32.
fn weight_values(t: &Tensor, transposed: bool) -> Vec<f32> {
    let v = t.to_f32_vec();
    if !transposed {
        return v;
    }
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let mut wt = vec![0.0f32; r * c];
    for i in 0..r {
        for j in 0..c {
            wt[j * r + i] = v[i * c + j];
        }
    }
    wt
}

/// The int4 constants (packed codes, scales, zeros) already made from a
/// weight, so that a weight the methods of one program share (or two
/// nodes of one graph) is quantized once. Keyed by the weight's name, its
/// layout and group size, and a hash of its bytes: a method of another
/// model with a weight of the same name is quantized anew.
#[derive(Default)]
pub struct Int4Cache {
    done: HashMap<(String, bool, usize, u64), [Tensor; 3]>,
}

fn bytes_hash(t: &Tensor) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (t.dtype().name(), t.shape(), t.bytes()).hash(&mut h);
    h.finish()
}

/// Quantize every linear of `graph` to int4 (see the module comment).
pub fn quantize_int4(
    graph: &mut Graph,
    group_size: usize,
    skip_patterns: &[String],
) -> Result<QuantizeReport> {
    quantize_int4_cached(graph, group_size, skip_patterns, &mut Int4Cache::default())
}

/// [`quantize_int4`], reusing (and adding to) the int4 weights of `cache`:
/// call it with one cache for every method of a program.
pub fn quantize_int4_cached(
    graph: &mut Graph,
    group_size: usize,
    skip_patterns: &[String],
    cache: &mut Int4Cache,
) -> Result<QuantizeReport> {
    if !GROUP_SIZES.contains(&group_size) {
        return Err(Error::invalid_input(format!(
            "--group-size {group_size}: one of {GROUP_SIZES:?}"
        )));
    }
    let mut report = QuantizeReport::default();
    let mut nodes = Vec::with_capacity(graph.nodes.len());
    for node in std::mem::take(&mut graph.nodes) {
        if !matches!(node.op, Op::Linear | Op::MatMul) {
            nodes.push(node);
            continue;
        }
        let (w, transposed, n, k) = match linear_weight(graph, &node) {
            Ok(found) => found,
            Err(why) => {
                if matches!(node.op, Op::Linear) {
                    report.skipped.push((node.name.clone(), why));
                }
                nodes.push(node);
                continue;
            }
        };
        let name = weight_name(graph, w);
        if let Some(p) = skip_patterns
            .iter()
            .find(|p| name.contains(p.as_str()) || node.name.contains(p.as_str()))
        {
            report
                .skipped
                .push((node.name.clone(), format!("matches --quantize-skip {p}")));
            nodes.push(node);
            continue;
        }
        if k % group_size != 0 {
            report.skipped.push((
                node.name.clone(),
                format!("group size {group_size} does not divide K = {k}"),
            ));
            nodes.push(node);
            continue;
        }
        let t = &graph.constants[&w];
        let key = (name.clone(), transposed, group_size, bytes_hash(t));
        let [packed, scales, zeros] = match cache.done.get(&key) {
            Some(made) => {
                report.reused.push(node.name.clone());
                made.clone()
            }
            None => {
                let (dtype, groups) = (t.dtype(), k / group_size);
                let q = quantize_weight(
                    &weight_values(t, transposed),
                    n,
                    k,
                    group_size,
                    Fit::Refine,
                    dtype,
                )?;
                let made = [
                    as_words(&Tensor::from_slice(DType::U8, &[n, k / 2], &q.packed)?)?,
                    Tensor::from_f32(dtype, &[n, groups], &q.scales)?,
                    Tensor::from_f32(dtype, &[n, groups], &q.zeros)?,
                ];
                cache.done.insert(key, made.clone());
                made
            }
        };
        let packed = graph.add_constant(format!("{name}.int4"), packed);
        let scales = graph.add_constant(format!("{name}.int4_scales"), scales);
        let zeros = graph.add_constant(format!("{name}.int4_zeros"), zeros);
        let x = node.inputs[0];
        let bias = match node.op {
            Op::Linear => node.inputs.get(2).copied().flatten(),
            _ => None,
        };
        let quant = |outputs: Vec<ValueId>| Node {
            name: node.name.clone(),
            target: node.target.clone(),
            op: Op::Int4Linear { group_size },
            inputs: vec![x, Some(packed), Some(scales), Some(zeros)],
            outputs,
        };
        match bias {
            None => nodes.push(quant(node.outputs.clone())),
            Some(b) => {
                let out = node.outputs[0];
                let info = graph.value(out).clone();
                let mm = graph.add_value(format!("{}.int4_mm", node.name), info.dtype, info.shape);
                if let Some(dims) = graph.sym.dims.get(&out).cloned() {
                    graph.sym.dims.insert(mm, dims); // the sum has the product's sizes
                }
                nodes.push(quant(vec![mm]));
                nodes.push(Node {
                    name: format!("{}.bias", node.name),
                    target: node.target.clone(),
                    op: Op::Binary(BinaryOp::Add),
                    inputs: vec![Some(mm), Some(b)],
                    outputs: vec![out],
                });
            }
        }
        report.quantized.push(node.name.clone());
    }
    graph.nodes = nodes;
    merge_siblings(graph)?;
    eliminate_dead_code(graph);
    Ok(report)
}

/// The largest packed weight [`merge_siblings`] makes: wgpu's storage
/// binding limit on every adapter (the partitioner's default), so products
/// the GPU takes apart it takes merged.
const MERGED_MAX_BYTES: usize = 128 << 20;

/// Int4 linears of one input (q, k and v; gate and up) as one, its
/// weights, scales and zeros concatenated along N, each output a slice of
/// its outputs: the input is read once, and a decode step's products are
/// one kernel (a kernel binds three buffers a weight, so separate products
/// would be separate kernels).
fn merge_siblings(graph: &mut Graph) -> Result<()> {
    // the int4 linears of each input with constant weights, in order
    let mut by_input: Vec<(ValueId, Vec<usize>)> = vec![];
    for (i, node) in graph.nodes.iter().enumerate() {
        let (Op::Int4Linear { .. }, [Some(x), rest @ ..]) = (&node.op, node.inputs.as_slice())
        else {
            continue;
        };
        let constant = rest.len() == 3
            && rest
                .iter()
                .all(|w| w.is_some_and(|w| graph.constants.contains_key(&w)))
            && node.outputs.len() == 1;
        if !constant {
            continue;
        }
        match by_input.iter_mut().find(|(v, _)| v == x) {
            Some((_, found)) => found.push(i),
            None => by_input.push((*x, vec![i])),
        }
    }
    let mut replaced: HashMap<usize, Vec<Node>> = HashMap::new();
    for (_, group) in by_input {
        // one group size, K and scale dtype
        let key = |i: usize| {
            let n = &graph.nodes[i];
            let c = |slot: usize| &graph.constants[&n.inputs[slot].expect("checked above")];
            (n.op.clone(), c(1).shape()[1], c(2).dtype(), c(2).shape()[1])
        };
        let group: Vec<usize> = group
            .iter()
            .copied()
            .filter(|&i| key(i) == key(group[0]))
            .collect();
        let bytes: usize = group
            .iter()
            .map(|&i| {
                graph.constants[&graph.nodes[i].inputs[1].expect("checked")]
                    .bytes()
                    .len()
            })
            .sum();
        if group.len() < 2 || bytes > MERGED_MAX_BYTES {
            continue;
        }
        let first = &graph.nodes[group[0]];
        let (op, x) = (first.op.clone(), first.inputs[0]);
        let mut parts: [Vec<u8>; 3] = Default::default();
        let mut widths = vec![];
        for &i in &group {
            let n = &graph.nodes[i];
            for (slot, bytes) in parts.iter_mut().enumerate() {
                bytes.extend_from_slice(
                    graph.constants[&n.inputs[slot + 1].expect("checked")].bytes(),
                );
            }
            widths.push(graph.constants[&n.inputs[1].expect("checked")].shape()[0]);
        }
        let total: usize = widths.iter().sum();
        let names: Vec<&str> = group
            .iter()
            .map(|&i| graph.nodes[i].name.as_str())
            .collect();
        let name = names.join("+");
        let mut weights = vec![];
        for (slot, bytes) in parts.iter().enumerate() {
            let of = |i: usize| graph.nodes[i].inputs[slot + 1].expect("checked");
            let t = &graph.constants[&of(group[0])];
            let merged = Tensor::from_bytes(t.dtype(), &[total, t.shape()[1]], bytes)?;
            // named after the parts' weights (as every method names them)
            let parts: Vec<&str> = group
                .iter()
                .map(|&i| graph.value(of(i)).name.as_str())
                .collect();
            let name = parts.join("+");
            weights.push(Some(graph.add_constant(name, merged)));
        }
        let mut merged = Node {
            name: name.clone(),
            target: graph.nodes[group[0]].target.clone(),
            op,
            inputs: [vec![x], weights].concat(),
            outputs: vec![],
        };
        let (dtype, shape) = crate::infer::infer(graph, &merged)?
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("an int4 linear with no output"))?;
        let y = graph.add_value(format!("{name}.out"), dtype, shape.clone());
        merged.outputs.push(y);
        crate::infer_sym::assign_sym(graph, &merged)?;
        let mut start = 0;
        for (k, (&i, &width)) in group.iter().zip(&widths).enumerate() {
            let n = &graph.nodes[i];
            let slice = Node {
                name: format!("{}.slice", n.name),
                target: n.target.clone(),
                op: Op::Slice {
                    dim: shape.len() - 1,
                    start,
                    end: start + width,
                    step: 1,
                },
                inputs: vec![Some(y)],
                outputs: n.outputs.clone(),
            };
            start += width;
            let at = replaced.entry(i).or_default();
            if k == 0 {
                at.push(merged.clone());
            }
            at.push(slice);
        }
    }
    if replaced.is_empty() {
        return Ok(());
    }
    let nodes = std::mem::take(&mut graph.nodes);
    for (i, node) in nodes.into_iter().enumerate() {
        match replaced.remove(&i) {
            Some(new) => graph.nodes.extend(new),
            None => graph.nodes.push(node),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::OutputKind;
    use crate::test_util::{ops, push, reinfers};

    /// A deterministic stream of N(0, 1) samples (Box-Muller on an LCG).
    pub(crate) fn gaussian(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uniform = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }

    fn rel_error(w: &[f32], q: &Int4Weight, k: usize, gs: usize) -> f64 {
        let r = dequantize_weight(q, k, gs);
        let num: f64 = w
            .iter()
            .zip(&r)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
        num / den
    }

    /// Student-t with 3 degrees of freedom: heavy tails as in trained weights.
    fn heavy_tailed(seed: u64, n: usize) -> Vec<f32> {
        let chi = gaussian(seed + 1, n * 3);
        gaussian(seed, n)
            .iter()
            .zip(chi.chunks_exact(3))
            .map(|(a, c)| {
                a / ((c[0] * c[0] + c[1] * c[1] + c[2] * c[2]) / 3.0)
                    .sqrt()
                    .max(1e-3)
            })
            .collect()
    }

    #[test]
    fn refinement_lowers_the_error() {
        let (n, k) = (64, 1024);
        for w in [gaussian(7, n * k), heavy_tailed(7, n * k)] {
            let error = |fit| {
                let q = quantize_weight(&w, n, k, 32, fit, DType::F32).unwrap();
                rel_error(&w, &q, k, 32)
            };
            let (plain, refined) = (error(Fit::MinMax), error(Fit::Refine));
            assert!(
                refined < plain * 0.9,
                "refined {refined} vs min-max {plain}"
            );
            assert!(plain < 2e-2, "{plain}");
        }
    }

    #[test]
    fn codes_are_rounded_to_the_stored_parameters() {
        // bf16 scales and zeros move the grid a little from the f32 fit:
        // each value's code is the nearest on the grid the kernels read.
        let (n, k) = (64, 256);
        let w = heavy_tailed(11, n * k);
        let q = quantize_weight(&w, n, k, 32, Fit::Refine, DType::BF16).unwrap();
        for (i, (&v, &c)) in w
            .iter()
            .zip(&etmetal_core::int4::unpack(&q.packed))
            .enumerate()
        {
            let (s, z) = (q.scales[i / 32], q.zeros[i / 32]);
            assert_eq!(
                Tensor::from_f32(DType::BF16, &[1], &[s])
                    .unwrap()
                    .to_f32_vec(),
                [s]
            );
            let d = (c as f32 * s + z - v).abs();
            let nearest = (0..16)
                .map(|c| (c as f32 * s + z - v).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                d <= nearest,
                "value {i}: code {c} is {d} away, the nearest {nearest}"
            );
        }
    }

    #[test]
    fn codes_and_parameters_reconstruct_the_group() {
        for fit in [Fit::MinMax, Fit::Refine] {
            // A group on the 16-level grid is exact.
            let w: Vec<f32> = (0..32).map(|i| -1.0 + (i % 16) as f32 * 0.25).collect();
            let q = quantize_weight(&w, 1, 32, 32, fit, DType::BF16).unwrap();
            assert_eq!(dequantize_weight(&q, 32, 32), w, "{fit:?}");
            assert_eq!((q.scales[0], q.zeros[0]), (0.25, -1.0), "{fit:?}");
            // A constant group keeps its value.
            let c = vec![0.5f32; 64];
            let q = quantize_weight(&c, 2, 32, 32, fit, DType::F32).unwrap();
            assert!(dequantize_weight(&q, 32, 32)
                .iter()
                .all(|v| (v - 0.5).abs() < 1e-6));
        }
    }

    fn mlp(k: usize) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![3, k]);
        g.inputs.push((x, InputKind::User));
        let w1 = g.add_value("p_fc_weight", DType::F32, vec![64, k]);
        g.inputs.push((
            w1,
            InputKind::Parameter {
                fqn: "fc.weight".into(),
            },
        ));
        g.constants.insert(
            w1,
            Tensor::from_f32(DType::F32, &[64, k], &gaussian(1, 64 * k)).unwrap(),
        );
        let b1 = g.add_constant(
            "b",
            Tensor::from_f32(DType::F32, &[64], &[0.5; 64]).unwrap(),
        );
        let h = push(&mut g, "fc", Op::Linear, vec![Some(x), Some(w1), Some(b1)]);
        let w2 = g.add_constant(
            "lm_head",
            Tensor::from_f32(DType::F32, &[64, 16], &gaussian(2, 1024)).unwrap(),
        );
        let y = push(&mut g, "head", Op::MatMul, vec![Some(h), Some(w2)]);
        g.outputs.push((y, OutputKind::User));
        g
    }

    #[test]
    fn linears_and_constant_matmuls_become_int4() {
        let mut g = mlp(64);
        let r = quantize_int4(&mut g, 32, &[]).unwrap();
        assert_eq!(r.quantized, ["fc", "head"]);
        assert_eq!(ops(&g), ["int4_linear", "add", "int4_linear"]);
        reinfers(&g);
        // The float weights are gone; the head's B [64, 16] is W [16, 64].
        assert!(g.inputs.iter().all(|(_, k)| *k == InputKind::User));
        let packed = g.nodes[2].inputs[1].unwrap();
        assert_eq!(
            (g.value(packed).dtype, &g.value(packed).shape[..]),
            (DType::I32, &[16, 8][..])
        );
        assert_eq!(g.value(g.nodes[2].inputs[2].unwrap()).shape, [16, 2]);
    }

    #[test]
    fn a_cache_quantizes_shared_weights_once() {
        let mut cache = Int4Cache::default();
        let (mut a, mut b) = (mlp(64), mlp(64));
        let ra = quantize_int4_cached(&mut a, 32, &[], &mut cache).unwrap();
        let rb = quantize_int4_cached(&mut b, 32, &[], &mut cache).unwrap();
        assert!(ra.reused.is_empty());
        assert_eq!((&rb.quantized, &rb.reused), (&ra.quantized, &ra.quantized));
        let constants = |g: &Graph| {
            let mut c: Vec<_> = g
                .constants
                .iter()
                .map(|(v, t)| (g.value(*v).name.clone(), t.bytes().to_vec()))
                .collect();
            c.sort();
            c
        };
        assert_eq!(constants(&a), constants(&b));
        // same names, other values: quantized anew
        let mut c = mlp(64);
        let fc = c.nodes[0].inputs[1].unwrap();
        let t = Tensor::from_f32(DType::F32, &[64, 64], &gaussian(9, 64 * 64)).unwrap();
        c.constants.insert(fc, t);
        let rc = quantize_int4_cached(&mut c, 32, &[], &mut cache).unwrap();
        assert_eq!(rc.reused, ["head"]);
    }

    /// Two linears of one input (`q` without bias, `k` with one): one
    /// int4 product of the weights concatenated along N, its output
    /// sliced at each part's offset, the bias added after the slice.
    #[test]
    fn linears_of_one_input_become_one_int4_product() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![3, 64]);
        g.inputs.push((x, InputKind::User));
        let (wq, wk) = (gaussian(3, 64 * 64), gaussian(4, 32 * 64));
        let q_w = g.add_constant("q", Tensor::from_f32(DType::F32, &[64, 64], &wq).unwrap());
        let k_w = g.add_constant("k", Tensor::from_f32(DType::F32, &[32, 64], &wk).unwrap());
        let b = g.add_constant(
            "b",
            Tensor::from_f32(DType::F32, &[32], &[0.5; 32]).unwrap(),
        );
        let q = push(&mut g, "q_proj", Op::Linear, vec![Some(x), Some(q_w)]);
        let k = push(
            &mut g,
            "k_proj",
            Op::Linear,
            vec![Some(x), Some(k_w), Some(b)],
        );
        g.outputs.push((q, OutputKind::User));
        g.outputs.push((k, OutputKind::User));
        let r = quantize_int4(&mut g, 32, &[]).unwrap();
        assert_eq!(r.quantized, ["q_proj", "k_proj"]);
        assert_eq!(ops(&g), ["int4_linear", "slice", "slice", "add"]);
        reinfers(&g);
        let slices: Vec<_> = g.nodes[1..3].iter().map(|n| n.op.clone()).collect();
        let slice = |start, end| Op::Slice {
            dim: 1,
            start,
            end,
            step: 1,
        };
        assert_eq!(slices, [slice(0, 64), slice(64, 96)]);
        assert_eq!(g.nodes[1].outputs, [q]);
        // the parts' int4 weights, one after the other
        let parts = [(&wq, 64), (&wk, 32)]
            .map(|(w, n)| quantize_weight(w, n, 64, 32, Fit::Refine, DType::F32).unwrap());
        let packed: Vec<u8> = parts.iter().flat_map(|p| p.packed.clone()).collect();
        let scales: Vec<f32> = parts.iter().flat_map(|p| p.scales.clone()).collect();
        let merged = |slot: usize| &g.constants[&g.nodes[0].inputs[slot].unwrap()];
        let words = as_words(&Tensor::from_slice(DType::U8, &[96, 32], &packed).unwrap());
        assert_eq!(merged(1).bytes(), words.unwrap().bytes());
        assert_eq!(merged(2).to_f32_vec(), scales);
    }

    #[test]
    fn skips_are_reported() {
        let mut g = mlp(48);
        let r = quantize_int4(&mut g, 32, &["lm_head".into()]).unwrap();
        assert!(r.quantized.is_empty());
        assert_eq!(r.skipped[0].0, "fc");
        assert!(
            r.skipped[0].1.contains("does not divide K = 48"),
            "{:?}",
            r.skipped
        );
        assert!(
            r.skipped[1].1.contains("--quantize-skip lm_head"),
            "{:?}",
            r.skipped
        );
        assert_eq!(ops(&g), ["linear", "mat_mul"]);
        let mut g = mlp(64);
        let r = quantize_int4(&mut g, 32, &["fc.".into()]).unwrap();
        assert_eq!(
            r.skipped,
            [("fc".to_string(), "matches --quantize-skip fc.".to_string())]
        );
        assert_eq!(r.quantized, ["head"]);
        assert!(quantize_int4(&mut g, 48, &[]).is_err());
    }
}
