//! What a GEMM computes and how its callers plug in: the product's
//! description ([`Gemm`]), how each 16-bit operand becomes f16 for the
//! tensor cores ([`F16Scaling`]), and the reads and stores a caller
//! provides ([`GemmArgs`], [`GemvArgs`], [`Epilogue`]; burn's `MatmulArgs`
//! is the model). The leaf of the family: the emitters build on it.

use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Result};

use crate::payload::Size;
use crate::preprocess::emit::KernelBuilder;
use crate::preprocess::lowering::Lowering;

/// One batched product `C[bt, r, c] = Σ_k A[bt, r, k] · B[bt, k, c]`. The
/// caller's [`GemmArgs`] read the operands and store the results. When
/// its tiles are too few for a large GPU and `k` is deep, `k` is split
/// among workgroups (`split::split_k`).
pub(crate) struct Gemm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// A's elements along k are adjacent in memory (row-major `[m, k]`):
    /// tile loads walk k fastest so neighbouring invocations read
    /// neighbouring words.
    pub a_k_fast: bool,
    /// B's elements along k are adjacent (e.g. a `[n, k]` weight read as
    /// its transpose).
    pub b_k_fast: bool,
    /// How each operand becomes f16 for the tensor-core alternative
    /// (`coop`); `None`: the portable kernel only.
    pub coop: Option<[F16Scaling; 2]>,
    /// The run-time `(batch, m, n)` of a bounded-dynamic product (none:
    /// static); its dispatches then run only the tiles within them.
    pub dynamic: Option<[SymExpr; 3]>,
}

impl Gemm {
    /// Whether tiles run n-major (`tile % tiles_m` is the row block): only
    /// where n is dynamic and m static (a convolution's images), so that
    /// the valid tiles come first.
    fn n_major(&self) -> bool {
        self.dynamic
            .as_ref()
            .is_some_and(|[_, m, n]| m.as_const().is_some() && n.as_const().is_none())
    }

    /// The WGSL of a tile's origin (`m0`, `n0`) from its index `tile`.
    pub(super) fn tile_origin(&self, bm: usize, bn: usize) -> String {
        let (tiles_m, tiles_n) = (self.m.div_ceil(bm), self.n.div_ceil(bn));
        if self.n_major() {
            format!(
                "  let m0 = (tile % {tiles_m}u) * {bm}u;\n  let n0 = (tile / {tiles_m}u) * {bn}u;\n"
            )
        } else {
            format!(
                "  let m0 = (tile / {tiles_n}u) * {bm}u;\n  let n0 = (tile % {tiles_n}u) * {bn}u;\n"
            )
        }
    }

    /// The workgroups covering the valid tiles at run time (grid order:
    /// split, batch, then tiles as [`Self::tile_origin`] walks them).
    pub(super) fn groups(
        &self,
        lw: &Lowering,
        bm: usize,
        bn: usize,
        splits: usize,
    ) -> Result<Option<Size>> {
        let Some([batch, m, n]) = &self.dynamic else {
            return Ok(None);
        };
        let blocks = |e: &SymExpr, b: usize| {
            SymExpr::floor_div(
                e.clone() + SymExpr::Const(b as i64 - 1),
                SymExpr::Const(b as i64),
            )
        };
        let rows = (blocks(m, bm)?, self.m.div_ceil(bm));
        let cols = (blocks(n, bn)?, self.n.div_ceil(bn));
        let split = (SymExpr::Const(splits as i64), splits);
        let dims = match self.n_major() {
            true => [split, (batch.clone(), self.batch), cols, rows],
            false => [split, (batch.clone(), self.batch), rows, cols],
        };
        lw.sizes.groups(&dims, 1)
    }
}

/// How a 16-bit operand becomes f16 for the tensor cores (see the `coop`
/// module comment: the scaling keeps every element within f16's range).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum F16Scaling {
    /// Every element becomes a normal f16 (or zero) exactly once scaled by
    /// 2^s: a weight checked at compile time.
    Exact(i32),
    /// Scaled per row of A (column of B) by exponents that a pre-pass
    /// finds at run time.
    Lines,
}

/// Workgroups below which a tile is too big to fill a large GPU (an H200
/// runs two 256-invocation 128×128 workgroups on each of its 132 units).
/// Measured there in one run: 4096³ is fastest on 128×128 tiles (24.0 ms;
/// 128×64: 29.1, 64×64: 35.1), 1024³ on 64×64 (0.113 ms; 128×128: 0.166),
/// 512³ on 32×32 (0.034 ms; 64×64: 0.040).
pub(super) const FILL: u64 = 256;

/// How a product's results are stored: the caller's epilogue (bias,
/// scaling, rounding to the output dtype) and write.
pub(crate) trait Epilogue {
    /// Emit `fn gstore(bt: u32, r: u32, c: u32, v: f32)` storing the f32
    /// sum `v` of output `(bt, r, c)`; returns its WGSL.
    fn store(&self, kb: &mut KernelBuilder) -> Result<String>;
}

/// How a [`Gemm`] reads its operands: the functions its kernels call,
/// emitted into the kernel being built (returning their WGSL).
pub(crate) trait GemmArgs: Epilogue {
    /// `ga(bt, r, k) -> f32` and `gb(bt, k, c) -> f32`, called with
    /// in-range indices only (the portable kernel).
    fn elements(&self, kb: &mut KernelBuilder) -> Result<String>;

    /// `ca(bt, j, q) -> vec4<f32>` and `cb(bt, j, q)`: the four elements
    /// from `q` (a multiple of 4) along the operand's contiguous dim (k
    /// where `a_k_fast`/`b_k_fast`, else A's rows or B's columns), `j` the
    /// other index, zeros past the end of that dim (the tensor-core
    /// kernel). `None`: no faster reader than four [`GemmArgs::elements`]
    /// calls.
    fn chunks(&self, _kb: &mut KernelBuilder) -> Result<Option<String>> {
        Ok(None)
    }
}

/// How a matrix-vector product (`Gemv`) reads its operands.
pub(crate) trait GemvArgs: Epilogue {
    /// `xa(bt, r, k)` and `xb(bt, c, k)`: elements `k … k+lanes-1` (`k` a
    /// multiple of `lanes`, zeros past the end) of row `r` of A and of
    /// column `c` of B, as a `vec4<f32>` (`lanes` 4) or an
    /// `array<vec4<f32>, 2>` (`lanes` 8, where [`GemvArgs::b_dtype`] is
    /// 16-bit: one 16-byte load of B). Products sharing a dispatch
    /// (`Gemv::lower_group`) append their tag to these names and to
    /// `gstore`'s.
    fn k_chunks(&self, kb: &mut KernelBuilder, lanes: usize) -> Result<String>;

    /// The element type of B, the operand whose bytes bound the kernel.
    fn b_dtype(&self) -> DType;

    /// Whether `xa` only reads a buffer along its contiguous dim (no math,
    /// no gather): cheaper to read again for each column group than to
    /// stage in workgroup memory.
    fn a_is_plain(&self) -> bool;

    /// What a workgroup of `threads` invocations computes before the
    /// product, called before the readers are emitted: `(module-level
    /// declarations, statements)` (row statistics of A it reads from
    /// workgroup memory).
    fn prologue(&self, _kb: &mut KernelBuilder, _threads: usize) -> Result<(String, String)> {
        Ok(Default::default())
    }

    /// Bytes of workgroup memory the prologue's declarations take.
    fn prologue_bytes(&self) -> usize {
        0
    }
}

impl Gemm {
    /// The `ca`/`cb` readers ([`GemmArgs::chunks`]) of `args`: its own, or
    /// four element reads each.
    pub(super) fn chunk_reads<A: GemmArgs + ?Sized>(
        &self,
        kb: &mut KernelBuilder,
        args: &A,
    ) -> Result<String> {
        if let Some(fns) = args.chunks(kb)? {
            return Ok(fns);
        }
        Ok(args.elements(kb)? + &self.element_chunks())
    }

    /// `ca`/`cb` as four calls of `ga`/`gb`.
    fn element_chunks(&self) -> String {
        let chunk = |name: &str, call: &dyn Fn(&str) -> String, len: usize| {
            let lanes: Vec<String> = (0..4)
                .map(|l| {
                    let q = format!("min(q + {l}u, {}u)", len - 1);
                    format!("select(0.0, {}, q + {l}u < {len}u)", call(&q))
                })
                .collect();
            format!(
                "fn {name}(bt: u32, j: u32, q: u32) -> vec4<f32> {{\n  return vec4<f32>({});\n}}\n\n",
                lanes.join(", ")
            )
        };
        let a = if self.a_k_fast {
            chunk("ca", &|q| format!("ga(bt, j, {q})"), self.k)
        } else {
            chunk("ca", &|q| format!("ga(bt, {q}, j)"), self.m)
        };
        let b = if self.b_k_fast {
            chunk("cb", &|q| format!("gb(bt, {q}, j)"), self.k)
        } else {
            chunk("cb", &|q| format!("gb(bt, j, {q})"), self.n)
        };
        a + &b
    }
}
