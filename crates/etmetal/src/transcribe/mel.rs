//! Whisper's log-mel spectrogram, as transformers' `WhisperFeatureExtractor`
//! computes it (its torch path, `_torch_extract_fbank_features`, which the
//! numpy path matches): the window's samples zero-padded (or cut) to
//! `frames · hop`, a centred STFT (reflect padding of n_fft/2, a periodic
//! Hann window of n_fft = 400, hop 160) whose last frame is dropped, power
//! spectra through the Slaney-normalised Slaney-scale mel filter bank of
//! `mel_filter_bank(201, n_mels, 0, 8000, 16000, "slaney", "slaney")`,
//! `log10(max(mel, 1e-10))`, floored at the window's maximum minus 8, then
//! `(x + 4) / 4`.
//!
//! Computed here in f64 (transformers computes in f32): the parity suite
//! holds it within 1e-4 of transformers' features. It is computed on the
//! host rather than carried in the `.pte` as a method of its own (as
//! ExecuTorch's Whisper example exports its preprocessor): the STFT is an
//! FFT, which the GPU kernels do not have, and as a dense DFT it would be
//! 3000 × 400 × 201 multiply-adds a window, more than the FFT's few
//! milliseconds on one core; and features that do not depend on the
//! exported program are checked once, against transformers, for every
//! model.

use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

/// The STFT size and hop of every Whisper model.
pub const N_FFT: usize = 400;
pub const HOP: usize = 160;

/// A feature extractor for one mel bin count.
pub struct WhisperMel {
    n_mels: usize,
    /// `[n_mels][N_FFT / 2 + 1]`.
    filters: Vec<f64>,
    window: Vec<f64>,
    fft: Arc<dyn RealToComplex<f64>>,
}

/// transformers' `hertz_to_mel(mel_scale="slaney")`.
fn hertz_to_mel(f: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if f >= 1000.0 {
        15.0 + (f / 1000.0).ln() * logstep
    } else {
        3.0 * f / 200.0
    }
}

/// transformers' `mel_to_hertz(mel_scale="slaney")`.
fn mel_to_hertz(m: f64) -> f64 {
    let logstep = 6.4f64.ln() / 27.0;
    if m >= 15.0 {
        1000.0 * (logstep * (m - 15.0)).exp()
    } else {
        200.0 * m / 3.0
    }
}

/// numpy's `linspace(start, stop, n)`.
fn linspace(start: f64, stop: f64, n: usize) -> Vec<f64> {
    let step = (stop - start) / (n - 1) as f64;
    let mut v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
    v[n - 1] = stop;
    v
}

/// transformers' `mel_filter_bank(n_fft / 2 + 1, n_mels, 0, 8000, 16000,
/// norm="slaney", mel_scale="slaney")`, transposed: `[n_mels][bins]`.
fn filter_bank(n_mels: usize) -> Vec<f64> {
    let bins = N_FFT / 2 + 1;
    let mels = linspace(hertz_to_mel(0.0), hertz_to_mel(8000.0), n_mels + 2);
    let hz: Vec<f64> = mels.into_iter().map(mel_to_hertz).collect();
    let fft_freqs = linspace(0.0, 8000.0, bins);
    let mut out = vec![0.0; n_mels * bins];
    for m in 0..n_mels {
        let enorm = 2.0 / (hz[m + 2] - hz[m]);
        for (b, &f) in fft_freqs.iter().enumerate() {
            let down = (f - hz[m]) / (hz[m + 1] - hz[m]);
            let up = (hz[m + 2] - f) / (hz[m + 2] - hz[m + 1]);
            out[m * bins + b] = down.min(up).max(0.0) * enorm;
        }
    }
    out
}

impl WhisperMel {
    /// An extractor of `n_mels` bins (80, or 128 for large-v3 and turbo).
    pub fn new(n_mels: usize) -> WhisperMel {
        // torch.hann_window(400): periodic
        let window = (0..N_FFT)
            .map(|n| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos())
            .collect();
        WhisperMel {
            n_mels,
            filters: filter_bank(n_mels),
            window,
            fft: RealFftPlanner::<f64>::new().plan_fft_forward(N_FFT),
        }
    }

    pub fn n_mels(&self) -> usize {
        self.n_mels
    }

    /// The features of one window, `[n_mels, frames]` row-major: `samples`
    /// (16 kHz) zero-padded or cut to `frames · HOP`.
    pub fn features(&self, samples: &[f32], frames: usize) -> Vec<f32> {
        let n = frames * HOP;
        let mut x: Vec<f64> = samples.iter().take(n).map(|&s| s as f64).collect();
        x.resize(n, 0.0);
        // reflect padding of N_FFT / 2 on each side (torch.stft, center=True)
        let pad = N_FFT / 2;
        let at = |i: isize| -> f64 {
            let last = n as isize - 1;
            let j = if i < 0 {
                -i
            } else if i > last {
                2 * last - i
            } else {
                i
            };
            x[j.clamp(0, last) as usize]
        };
        let bins = N_FFT / 2 + 1;
        let mut frame = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = vec![0.0f64; bins];
        let mut log = vec![0.0f64; self.n_mels * frames];
        for t in 0..frames {
            let start = (t * HOP) as isize - pad as isize;
            for (k, v) in frame.iter_mut().enumerate() {
                *v = at(start + k as isize) * self.window[k];
            }
            self.fft
                .process_with_scratch(&mut frame, &mut spectrum, &mut scratch)
                .expect("buffers made by the plan");
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = c.re * c.re + c.im * c.im;
            }
            for m in 0..self.n_mels {
                let row = &self.filters[m * bins..(m + 1) * bins];
                let mel: f64 = row.iter().zip(&power).map(|(w, p)| w * p).sum();
                log[m * frames + t] = mel.max(1e-10).log10();
            }
        }
        let top = log.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        log.into_iter()
            .map(|v| ((v.max(top - 8.0) + 4.0) / 4.0) as f32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slaney_scale_round_trips_and_bins_cover_the_band() {
        for f in [0.0, 200.0, 999.0, 1000.0, 4000.0, 8000.0] {
            assert!((mel_to_hertz(hertz_to_mel(f)) - f).abs() < 1e-9);
        }
        let bank = filter_bank(80);
        let bins = N_FFT / 2 + 1;
        // every filter has weight somewhere, and none at 0 Hz but the first's edge
        for m in 0..80 {
            assert!(
                bank[m * bins..(m + 1) * bins].iter().any(|&w| w > 0.0),
                "filter {m}"
            );
        }
        assert_eq!(filter_bank(128).len(), 128 * bins);
    }

    #[test]
    fn a_tone_peaks_in_its_mel_bin_and_padding_is_floored() {
        let mel = WhisperMel::new(80);
        // 1 s of 1 kHz in a 2 s window: the second half is padding
        let tone: Vec<f32> = (0..16000)
            .map(|i| (2.0 * std::f32::consts::PI * 1000.0 * i as f32 / 16000.0).sin())
            .collect();
        let frames = 200;
        let f = mel.features(&tone, frames);
        assert_eq!(f.len(), 80 * frames);
        let column = |t: usize| (0..80).map(|m| f[m * frames + t]).collect::<Vec<_>>();
        let mid = column(50);
        let peak = (0..80).max_by(|&a, &b| mid[a].total_cmp(&mid[b])).unwrap();
        // 1 kHz is mel 15 of 0..~45.2 over 82 points: bin ~26
        let want = (hertz_to_mel(1000.0) / hertz_to_mel(8000.0) * 81.0).round() as usize - 1;
        assert!(peak.abs_diff(want) <= 1, "peak {peak}, want {want}");
        let top = f.iter().copied().fold(f32::MIN, f32::max);
        // the padded frames sit at the floor: the maximum minus 8, scaled
        for v in column(190) {
            assert!((v - (top - 2.0)).abs() < 1e-6, "{v} vs {top}");
        }
    }
}
