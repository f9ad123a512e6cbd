//! `--quantize` over a program's methods: calibrated where asked
//! (`crate::calibrate`), planned over all methods at once so that the
//! weights they share are quantized once, then each method's linears
//! rewritten (`etmetal_graph::quantize`).

use std::collections::BTreeSet;
use std::time::Instant;

use etmetal_core::Result;
use etmetal_graph::quantize::{Quantizer, Scheme};
use etmetal_graph::Graph;

use super::Quantization;
use crate::calibrate;

/// Quantize `graphs` (method `names[i]` is `graphs[i]`); `progress` hears
/// what was calibrated and what each method's linears became. Returns how
/// many linears each method has, quantized or kept in float.
pub(super) fn quantize_methods(
    q: &Quantization,
    names: &[&str],
    graphs: &mut [Graph],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<usize>> {
    q.options.check()?;
    let calibration = match &q.calibration {
        None => None,
        Some(text) => {
            let start = Instant::now();
            let (tokens, prefix) = calibrate::read_tokens(&text.file, text.tokenizer.as_deref())?;
            let methods: Vec<(&str, &Graph)> = names.iter().copied().zip(graphs.iter()).collect();
            let m = calibrate::pick_method(&methods)?;
            let name = names[m];
            let c = calibrate::calibrate(&graphs[m], &tokens, &prefix, &mut *progress)
                .map_err(|e| e.context(format!("method `{name}`")))?;
            progress(&format!(
                "calibrated on {} tokens of {} through method `{name}` in {:.1} s: \
                 statistics of {} weights",
                c.tokens,
                text.file.display(),
                start.elapsed().as_secs_f64(),
                c.stats.len()
            ));
            Some((c, m, tokens))
        }
    };
    let start = Instant::now();
    let mut quantizer = Quantizer::new(q.options.clone(), calibration.as_ref().map(|c| &c.0));
    {
        let all: Vec<&Graph> = graphs.iter().collect();
        match &calibration {
            // calibrated mixed: each weight measured on the model's logits
            Some((_, m, tokens)) if q.options.scheme == Scheme::Mixed => {
                let sweep = calibrate::Sweep::new(&graphs[*m], tokens)
                    .map_err(|e| e.context(format!("method `{}`", names[*m])))?;
                let (mut done, mut said) = (0, Instant::now());
                let mut measure = |name: &str, w: &[f32], n: usize, k: usize| {
                    let kl = sweep.kl(name, w, n, k);
                    done += 1;
                    if said.elapsed().as_secs() >= 20 {
                        progress(&format!("mixed: measured {done} weights in int4"));
                        said = Instant::now();
                    }
                    kl
                };
                quantizer.plan(&all, Some(&mut measure))?;
                progress(&format!(
                    "mixed: each weight's int4 form measured on {} tokens of logits",
                    sweep.rows()
                ));
            }
            _ => quantizer.plan(&all, None)?,
        }
    }
    if !quantizer.sensitivity.is_empty() {
        let int8: Vec<&str> = quantizer
            .sensitivity
            .iter()
            .filter(|s| s.int8)
            .map(|s| s.weight.as_str())
            .collect();
        progress(&format!(
            "mixed: {} of {} weights in int8, the most sensitive ({}): {}",
            int8.len(),
            quantizer.sensitivity.len(),
            if calibration.is_some() {
                "mean KL of the logits with the weight alone in calibrated int4"
            } else {
                "relative error of the weight in int4, data-free"
            },
            int8.join(", ")
        ));
    }
    let mut linears = Vec::with_capacity(graphs.len());
    for (name, graph) in names.iter().zip(graphs.iter_mut()) {
        let r = quantizer
            .quantize(graph)
            .map_err(|e| e.context(format!("method `{name}`")))?;
        let (experts, float_experts) = r.expert_weights();
        linears.push(r.quantized.len() + r.skipped.len() + experts + float_experts);
        if r.quantized.is_empty() && r.skipped.is_empty() && experts + float_experts == 0 {
            continue;
        }
        let formats: BTreeSet<_> = r
            .quantized
            .iter()
            .map(|(_, f)| (f.bits, f.group_size))
            .collect();
        let what = match (formats.len(), r.quantized.first()) {
            (1, Some((_, f))) => format!("in {} (group {})", f.name(), f.group_size),
            (0, _) if experts > 0 => format!("in int4 (group {})", quantizer.expert_group()),
            (0, _) => "quantized".to_string(),
            _ => format!("({})", r.summary()),
        };
        // stacked expert weights (a MoE layer's), each routed by gather_qmv
        let (and_experts, kept) = match (experts, float_experts) {
            (0, 0) => (String::new(), r.skipped.len().to_string()),
            (q, f) => (
                format!(
                    " and {q} expert weights ({} routed products)",
                    r.experts.len()
                ),
                format!("{} linears and {f} expert weights", r.skipped.len()),
            ),
        };
        progress(&format!(
            "method `{name}`: {} linears{and_experts} {what}, {kept} kept in float{}",
            r.quantized.len(),
            match r.calibrated.len() {
                0 => String::new(),
                n => format!("; {n} calibrated"),
            }
        ));
        if !r.reused.is_empty() {
            progress(&format!(
                "  {} of them reuse quantized weights already made (shared with an earlier method or node)",
                r.reused.len()
            ));
        }
        for node in &r.embeddings {
            progress(&format!(
                "  {node} gathers rows of the quantized table of the head tied to it"
            ));
        }
        for (node, why) in &r.skipped {
            progress(&format!("  {node} stays in float: {why}"));
        }
        for (node, weight, why) in &r.experts_skipped {
            progress(&format!(
                "  {node} (experts `{weight}`) stays in float: {why}"
            ));
        }
    }
    // (nothing found: the caller says what that means)
    if linears.iter().any(|&n| n > 0) {
        progress(&format!(
            "quantized in {:.1} s",
            start.elapsed().as_secs_f64()
        ));
    }
    Ok(linears)
}
