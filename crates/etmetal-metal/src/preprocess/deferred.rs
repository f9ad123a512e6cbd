//! Work the lowering context defers until a kernel binds the buffer it
//! writes (or the partition ends), as records: the context keeps them and
//! has the driver dispatch them just before that kernel
//! (`Lowering::add_dispatch_sized`), and the kernel modules that make
//! them (`kernels::reduce`, `kernels::scatter`) or fuse them
//! (`kernels::matmul`, `kernels::int4`) read them here. A leaf.

use super::buffers::BufferIdx;
use super::expr::LazyRef;
use crate::payload::Size;

/// A mean over the last dim of a few rows (an RMSNorm's mean of squares)
/// whose kernel waits until a dispatch binds its buffer: a matrix-vector
/// product reading it computes it itself (`kernels::matmul`), so when only
/// products read it, it is never dispatched. Measured on an H100
/// (2026-12-07, `benchmarks/results/binaries_prologue_h100.json`): with the
/// mean dispatched, or the whole RMSNorm written out by one kernel, the
/// products lost their prologue (int4 gate/up 0.47 → 0.36 ms a
/// Llama-1B step) but the extra dispatches cost more, the step 1.07–1.19×
/// slower in GPU time and 1.02–1.14× end to end.
#[derive(Clone)]
pub(crate) struct RowStat {
    pub buf: BufferIdx,
    /// The values averaged, `[rows, cols]` f32.
    pub x: LazyRef,
    pub rows: usize,
    pub cols: usize,
    /// The node's op, for the dispatch record.
    pub label: String,
    pub node: String,
}

/// An in-place row write not dispatched yet.
pub(crate) struct Scatter {
    /// The buffer written (holding `x`, row-major in `shape`).
    pub target: BufferIdx,
    pub shape: Vec<usize>,
    pub dim: usize,
    /// `[k]` integer positions along `dim`.
    pub index: LazyRef,
    /// `shape` with `dim` of size `k`.
    pub src: LazyRef,
    /// The run-time row count where the index is of dynamic length.
    pub rows: Option<Size>,
}

impl Scatter {
    /// Elements of `x` past `dim` (a row), before it and rows.
    pub(crate) fn geometry(&self) -> (usize, usize, usize) {
        let inner = self.shape[self.dim + 1..].iter().product();
        let outer = self.shape[..self.dim].iter().product();
        (outer, self.src.shape[self.dim], inner)
    }

    /// Whether it reads buffer `buf` (its positions or its rows).
    pub(crate) fn reads(&self, buf: BufferIdx) -> bool {
        let mut b = vec![];
        self.index.buffers(&mut b);
        self.src.buffers(&mut b);
        b.contains(&buf)
    }
}
