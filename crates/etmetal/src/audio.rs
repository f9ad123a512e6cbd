//! Audio in: a WAV file (any sample rate, channel count and sample
//! format `hound` reads: 8/16/24/32-bit integers, 32-bit floats) as mono
//! samples at the rate a speech model takes (16 kHz).
//!
//! Integers are scaled to [-1, 1) by 2^(bits-1), as soundfile and
//! torchaudio read them; channels are averaged (as `librosa.load(mono=True)`
//! and transformers' pipelines downmix); other rates are converted with
//! rubato's synchronous FFT resampler (band-limited, the delay trimmed).

use std::path::Path;

use etmetal_core::{Error, Result};

/// The rate Whisper, wav2vec2 and Parakeet take.
pub const SPEECH_RATE: u32 = 16_000;

/// Mono samples at a known rate.
#[derive(Clone, Debug)]
pub struct Audio {
    pub samples: Vec<f32>,
    pub rate: u32,
}

impl Audio {
    /// Seconds of audio.
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / self.rate.max(1) as f64
    }
}

fn bad(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::invalid_input(format!("{}: {what}", path.display()))
}

/// Read `path` as mono samples at `rate` Hz. A file that is not a WAV
/// (RIFF/WAVE, PCM or IEEE float), a sample rate or channel count of zero,
/// no samples, or samples that are all zero (nothing to hear) is an error
/// naming the file and what is wrong.
pub fn load_wav(path: &Path, rate: u32) -> Result<Audio> {
    let reader = hound::WavReader::open(path).map_err(|e| match e {
        hound::Error::IoError(io) if io.kind() != std::io::ErrorKind::UnexpectedEof => {
            Error::io(path.display(), io)
        }
        _ if header_rate(path) == Some(0) => {
            bad(path, "the WAV header gives a sample rate of 0 Hz")
        }
        e => bad(path, format!("not a WAV file that can be read ({e})")),
    })?;
    let spec = reader.spec();
    if spec.sample_rate == 0 {
        return Err(bad(path, "the WAV header gives a sample rate of 0 Hz"));
    }
    if spec.channels == 0 {
        return Err(bad(path, "the WAV header gives 0 channels"));
    }
    let interleaved =
        read_samples(reader).map_err(|e| bad(path, format!("reading samples: {e}")))?;
    let mono = downmix(&interleaved, spec.channels as usize);
    if mono.is_empty() {
        return Err(bad(path, "the WAV file has no samples"));
    }
    if mono.iter().all(|&x| x == 0.0) {
        return Err(bad(
            path,
            format!(
                "the audio is silent (all {} samples are 0): nothing to transcribe",
                mono.len()
            ),
        ));
    }
    let samples = resample(&mono, spec.sample_rate, rate)?;
    Ok(Audio { samples, rate })
}

/// The sample rate a RIFF/WAVE file's `fmt ` chunk states, where there is
/// one: to name a rate of 0, which hound refuses as an inconsistent chunk.
fn header_rate(path: &Path) -> Option<u32> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.get(0..4)? != b"RIFF" || bytes.get(8..12)? != b"WAVE" {
        return None;
    }
    let mut at = 12;
    while at + 8 <= bytes.len() {
        let size = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().ok()?) as usize;
        if &bytes[at..at + 4] == b"fmt " {
            return Some(u32::from_le_bytes(
                bytes.get(at + 12..at + 16)?.try_into().ok()?,
            ));
        }
        at = at.checked_add(8 + size + size % 2)?;
    }
    None
}

/// Every sample, interleaved, as f32 in [-1, 1).
fn read_samples<R: std::io::Read>(mut reader: hound::WavReader<R>) -> hound::Result<Vec<f32>> {
    let spec = reader.spec();
    match spec.sample_format {
        hound::SampleFormat::Float => reader.samples::<f32>().collect(),
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample.clamp(1, 32) - 1)) as f64;
            reader
                .samples::<i32>()
                .map(|s| s.map(|s| (s as f64 * scale) as f32))
                .collect()
        }
    }
}

/// The mean of each frame's `channels` samples (a last partial frame is
/// dropped).
pub fn downmix(interleaved: &[f32], channels: usize) -> Vec<f32> {
    if channels <= 1 {
        return interleaved.to_vec();
    }
    interleaved
        .chunks_exact(channels)
        .map(|frame| (frame.iter().map(|&x| x as f64).sum::<f64>() / channels as f64) as f32)
        .collect()
}

/// `samples` at `from` Hz converted to `to` Hz (rubato's FFT resampler;
/// the output has `len · to / from` samples, rounded up).
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>> {
    use rubato::audioadapter_buffers::direct::InterleavedSlice;
    use rubato::{Fft, FixedSync, Resampler};
    if from == to {
        return Ok(samples.to_vec());
    }
    let failed = |e: &dyn std::fmt::Display| {
        Error::internal(format!("resampling {from} Hz to {to} Hz: {e}"))
    };
    let mut resampler = Fft::<f32>::new(from as usize, to as usize, 1024, 1, FixedSync::Both)
        .map_err(|e| failed(&e))?;
    let input = InterleavedSlice::new(samples, 1, samples.len()).map_err(|e| failed(&e))?;
    let output = resampler
        .process_all(&input, samples.len(), None)
        .map_err(|e| failed(&e))?;
    Ok(output.take_data())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_wav(
        path: &Path,
        spec: hound::WavSpec,
        frames: usize,
        f: impl Fn(usize, usize) -> f64,
    ) {
        let mut w = hound::WavWriter::create(path, spec).unwrap();
        for i in 0..frames {
            for c in 0..spec.channels as usize {
                let x = f(i, c);
                match spec.sample_format {
                    hound::SampleFormat::Float => w.write_sample(x as f32).unwrap(),
                    hound::SampleFormat::Int => {
                        let full = (1i64 << (spec.bits_per_sample - 1)) as f64;
                        w.write_sample((x * full).round() as i32).unwrap()
                    }
                }
            }
        }
        w.finalize().unwrap();
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("etmetal-audio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    fn spec(channels: u16, rate: u32, bits: u16, float: bool) -> hound::WavSpec {
        hound::WavSpec {
            channels,
            sample_rate: rate,
            bits_per_sample: bits,
            sample_format: if float {
                hound::SampleFormat::Float
            } else {
                hound::SampleFormat::Int
            },
        }
    }

    #[test]
    fn formats_read_as_the_same_samples() {
        let tone = |i: usize, _| 0.5 * (i as f64 * 0.05).sin();
        for (bits, float, tol) in [
            (16, false, 1e-4),
            (24, false, 1e-6),
            (32, true, 1e-7),
            (8, false, 1e-2),
        ] {
            let path = scratch(&format!("tone-{bits}-{float}.wav"));
            write_wav(&path, spec(1, 16000, bits, float), 800, tone);
            let audio = load_wav(&path, 16000).unwrap();
            assert_eq!(audio.samples.len(), 800);
            for (i, &x) in audio.samples.iter().enumerate() {
                assert!(
                    (x as f64 - tone(i, 0)).abs() < tol,
                    "{bits} bits: sample {i}"
                );
            }
        }
    }

    #[test]
    fn stereo_is_averaged() {
        let path = scratch("stereo.wav");
        write_wav(&path, spec(2, 16000, 32, true), 100, |i, c| {
            if c == 0 {
                0.5
            } else {
                -0.25 + i as f64 * 0.0
            }
        });
        let audio = load_wav(&path, 16000).unwrap();
        assert_eq!(audio.samples.len(), 100);
        assert!(audio.samples.iter().all(|&x| (x - 0.125).abs() < 1e-7));
    }

    #[test]
    fn resampling_keeps_a_tone_and_the_duration() {
        // 440 Hz at 44.1 kHz, 1 s: 16000 samples at 16 kHz, the same tone
        let path = scratch("tone44k.wav");
        let f = |i: usize, _| 0.5 * (2.0 * std::f64::consts::PI * 440.0 * i as f64 / 44100.0).sin();
        write_wav(&path, spec(1, 44100, 16, false), 44100, f);
        let audio = load_wav(&path, 16000).unwrap();
        assert!(
            (audio.samples.len() as i64 - 16000).abs() <= 1,
            "{}",
            audio.samples.len()
        );
        // away from the ends: the tone's power and its zero crossings
        let mid = &audio.samples[1000..15000];
        let rms = (mid.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / mid.len() as f64).sqrt();
        assert!((rms - 0.5 / 2f64.sqrt()).abs() < 0.005, "rms {rms}");
        let crossings = mid
            .windows(2)
            .filter(|w| (w[0] < 0.0) != (w[1] < 0.0))
            .count();
        let want = 2.0 * 440.0 * mid.len() as f64 / 16000.0;
        assert!(
            (crossings as f64 - want).abs() <= 2.0,
            "{crossings} zero crossings, want {want}"
        );
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        let text = scratch("not.wav");
        std::fs::write(&text, "hello, I am not a WAV file at all").unwrap();
        let e = load_wav(&text, 16000).unwrap_err();
        assert!(
            e.is_user_error() && e.to_string().contains("not a WAV file"),
            "{e}"
        );

        let silent = scratch("silent.wav");
        write_wav(&silent, spec(1, 16000, 16, false), 1600, |_, _| 0.0);
        let e = load_wav(&silent, 16000).unwrap_err();
        assert!(e.is_user_error() && e.to_string().contains("silent"), "{e}");

        let empty = scratch("empty.wav");
        write_wav(&empty, spec(1, 16000, 16, false), 0, |_, _| 0.0);
        let e = load_wav(&empty, 16000).unwrap_err();
        assert!(
            e.is_user_error() && e.to_string().contains("no samples"),
            "{e}"
        );

        // a header whose sample rate is 0 (bytes 24..28 of a canonical WAV)
        let zero = scratch("zero-rate.wav");
        write_wav(&zero, spec(1, 16000, 16, false), 100, |i, _| {
            i as f64 / 200.0
        });
        let mut bytes = std::fs::read(&zero).unwrap();
        bytes[24..28].copy_from_slice(&0u32.to_le_bytes());
        std::fs::write(&zero, bytes).unwrap();
        let e = load_wav(&zero, 16000).unwrap_err();
        assert!(
            e.is_user_error() && e.to_string().contains("sample rate of 0"),
            "{e}"
        );

        let missing = scratch("missing.wav");
        assert!(load_wav(&missing, 16000).is_err());
    }
}
