//! `--quantize mixed`: which weights go to int8, measured.
//!
//! Each weight is first quantized to int4 (with GPTQ where calibrated),
//! and its sensitivity is what that int4 form costs:
//! - with `--calibrate`, the model itself tells: the step method runs on
//!   the first calibration tokens with that weight alone in int4, and the
//!   cost is the mean KL divergence of its logits from the float run's
//!   (`etmetal::calibrate::Sweep`, through `Quantizer::plan`'s measure);
//! - without, the relative error of the weight, `|W - Ŵ|² / |W|²`
//!   ([`output_error`] with `H = I`).
//!
//! Then [`choose`] puts the most sensitive weights in int8 (per output
//! channel). A local measure does not rank an LM head against the layers:
//! the relative output error `Σ Δwᵀ H Δw / Σ wᵀ H w` with the calibration's
//! `H` ([`output_error`]) rated Gemma 3 270M's head the least sensitive of
//! its 127 weights, so int8 took every other weight and left the head
//! (63% of the elements) in int4: 88.0% next-token agreement with bf16
//! (scripts/eval_llm.py, 1165 tokens); with the head in int8 instead (the
//! rest as that order chose) 89.4%, and with int8's share at 0.8 91.8%.

use super::fit::QuantWeight;
use super::gptq::InputStats;
use etmetal_core::quant::unpack;

/// Rows of a weight [`output_error`] measures (evenly spaced): enough for
/// a stable ratio, few enough for the LM head (262144 rows on Gemma 3).
const SAMPLE_ROWS: usize = 512;

/// The share of the quantized elements that int8 weights may hold.
pub const INT8_SHARE: f64 = 0.7;

/// One weight's measurement, and the format [`choose`] gave it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sensitivity {
    /// The weight's name.
    pub weight: String,
    /// `N · K`.
    pub elements: usize,
    /// What its int4 form costs (module comment): the KL divergence of
    /// the logits, or the relative weight error.
    pub error: f64,
    /// Chosen for int8.
    pub int8: bool,
}

/// The relative error `Σ Δwᵀ H Δw / Σ wᵀ H w` over a sample of the rows of
/// `w [n, k]` quantized as `q` (`H = I` without `stats`).
pub fn output_error(
    w: &[f32],
    n: usize,
    k: usize,
    q: &QuantWeight,
    stats: Option<&InputStats>,
) -> f64 {
    let step = n.div_ceil(SAMPLE_ROWS).max(1);
    let gs = q.format.group_size;
    let per = q.format.per_byte();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let h: Option<Vec<f64>> = stats.map(|s| s.h.iter().map(|&v| v as f64).collect());
    let mut d = vec![0.0f64; k];
    let mut x = vec![0.0f64; k];
    for r in (0..n).step_by(step) {
        let codes = unpack(q.format.bits, &q.packed[r * k / per..(r + 1) * k / per]);
        for c in 0..k {
            let g = r * (k / gs) + c / gs;
            let v = w[r * k + c] as f64;
            x[c] = v;
            d[c] = v - (codes[c] as f64 * q.scales[g] as f64 + q.zeros[g] as f64);
        }
        match &h {
            None => {
                num += d.iter().map(|v| v * v).sum::<f64>();
                den += x.iter().map(|v| v * v).sum::<f64>();
            }
            Some(h) => {
                num += quadratic(h, &d);
                den += quadratic(h, &x);
            }
        }
    }
    num / den.max(f64::MIN_POSITIVE)
}

/// `vᵀ H v` for a symmetric `h [k, k]`.
fn quadratic(h: &[f64], v: &[f64]) -> f64 {
    let k = v.len();
    let mut total = 0.0;
    for (i, row) in h.chunks_exact(k).enumerate() {
        if v[i] == 0.0 {
            continue;
        }
        let dot: f64 = row.iter().zip(v).map(|(a, b)| a * b).sum();
        total += v[i] * dot;
    }
    total
}

/// The weights that go to int8: the most sensitive first, while the int8
/// weights hold at most [`INT8_SHARE`] of all the elements measured.
/// Returns the measurements, most sensitive first, `int8` set.
pub fn choose(mut measured: Vec<Sensitivity>) -> Vec<Sensitivity> {
    measured.sort_by(|a, b| b.error.total_cmp(&a.error));
    let total: usize = measured.iter().map(|s| s.elements).sum();
    let budget = (total as f64 * INT8_SHARE) as usize;
    let mut used = 0;
    for s in &mut measured {
        if used + s.elements <= budget {
            s.int8 = true;
            used += s.elements;
        }
    }
    measured
}

#[cfg(test)]
mod tests {
    use super::super::fit::tests::gaussian;
    use super::super::fit::{quantize_weight, Fit};
    use super::*;
    use etmetal_core::quant::QuantFormat;
    use etmetal_core::DType;

    #[test]
    fn output_error_weighs_channels_by_their_activations() {
        let (n, k) = (64, 128);
        let w = gaussian(1, n * k);
        let q = quantize_weight(&w, n, k, QuantFormat::int4(32), Fit::Refine, DType::F32).unwrap();
        let plain = output_error(&w, n, k, &q, None);
        // H = I gives the relative weight error
        let deq = super::super::fit::dequantize_weight(&q, k);
        let num: f64 = w
            .iter()
            .zip(&deq)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let den: f64 = w.iter().map(|a| (*a as f64).powi(2)).sum();
        assert!(
            (plain - num / den).abs() < 1e-6 * plain,
            "{plain} vs {}",
            num / den
        );
        // a scaled identity changes nothing; loud channels change the ratio
        let mut stats = InputStats::new(k);
        for i in 0..k {
            stats.h[i * k + i] = 3.0;
        }
        stats.count = 1;
        assert!((output_error(&w, n, k, &q, Some(&stats)) - plain).abs() < 1e-9 * plain);
        stats.h[0] = 1e6;
        assert_ne!(output_error(&w, n, k, &q, Some(&stats)), plain);
    }

    #[test]
    fn the_most_sensitive_weights_go_to_int8_within_the_share() {
        let s = |w: &str, elements, error| Sensitivity {
            weight: w.into(),
            elements,
            error,
            int8: false,
        };
        let got = choose(vec![
            s("a", 10, 0.01),
            s("head", 60, 0.05),
            s("b", 20, 0.03),
            s("c", 10, 0.02),
        ]);
        let names: Vec<(&str, bool)> = got.iter().map(|s| (s.weight.as_str(), s.int8)).collect();
        // 100 elements, 70 for int8: the head (60), then b (20) would pass
        // the share, c (10) fits
        assert_eq!(
            names,
            [("head", true), ("b", false), ("c", true), ("a", false)]
        );
    }
}
