//! Everything a compile takes, in one value: the CLI's `compile` flags, the
//! Python plug-in's compile specs and the Rust API all fill a
//! [`CompileOptions`], and every stage of the pipeline reads its part.

use std::path::PathBuf;

use etmetal_core::{DType, Result};
use etmetal_graph::quantize::QuantizeOptions;
use etmetal_metal::partitioner::PartitionOptions;
use etmetal_metal::preprocess::PreprocessOptions;

/// Where the compiled program runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// GPU partitions through the Metal delegate, the rest on CPU kernels.
    #[default]
    Metal,
    /// ExecuTorch portable kernels only.
    Cpu,
}

#[derive(Clone, Debug)]
pub struct CompileOptions {
    pub backend: Backend,
    /// The float dtype the program computes in (`--dtype`): float32 inputs,
    /// weights and outputs become this dtype, as `module.to(dtype)` does
    /// (`etmetal_graph::precision`). `F32` keeps the program as exported.
    pub dtype: DType,
    /// Weight-only quantization of the linears (`--quantize`), if any.
    pub quantize: Option<Quantization>,
    /// Partition mode, ops kept off the GPU, and the device limits, which
    /// preprocess keeps too (every payload buffer fits where the
    /// partitioner checked the values fit).
    pub partition: PartitionOptions,
    /// Preprocess's own options; its `max_buffer_bytes` is always
    /// `partition.limits.max_buffer_bytes` (see [`CompileOptions::preprocess`]).
    pub preprocess: PreprocessOptions,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            backend: Backend::default(),
            dtype: DType::F32,
            quantize: None,
            partition: PartitionOptions::default(),
            preprocess: PreprocessOptions::default(),
        }
    }
}

/// `--quantize` and how it is calibrated.
#[derive(Clone, Debug)]
pub struct Quantization {
    pub options: QuantizeOptions,
    /// `--calibrate`: statistics from the model's own run over a text.
    pub calibration: Option<CalibrationText>,
}

/// The text a quantization is calibrated on (`--calibrate`, `--tokenizer`).
#[derive(Clone, Debug)]
pub struct CalibrationText {
    /// UTF-8 text with a tokenizer, else token ids.
    pub file: PathBuf,
    /// The `tokenizer.json` that turns `file` into tokens.
    pub tokenizer: Option<PathBuf>,
}

impl CompileOptions {
    /// Error on options that cannot work (a group size the scheme does not
    /// take), so a bad one is refused before any model is read.
    pub fn check(&self) -> Result<()> {
        match &self.quantize {
            Some(q) => q.options.check(),
            None => Ok(()),
        }
    }

    /// Preprocess's options within the partitioner's limits: the one place
    /// the buffer limit passes from the partitioner to preprocess.
    pub fn preprocess(&self) -> PreprocessOptions {
        self.preprocess.within(&self.partition.limits)
    }
}
