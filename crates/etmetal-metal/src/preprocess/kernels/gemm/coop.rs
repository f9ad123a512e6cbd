//! The cooperative-matrix (tensor-core) form of a [`Gemm`] with 16-bit
//! operands: a payload alternative (see `payload::Alternative`) for
//! devices whose subgroups
//! multiply 16×16 f16 matrices into f32 (wgpu's `wgpu_cooperative_matrix`,
//! `coop_mat16x16`: NVIDIA tensor cores through Vulkan). The runtime runs
//! it where the adapter reports that configuration, and the portable
//! kernel everywhere else.
//!
//! A second alternative, the [`CoopForm::Float8`] form (`coop_mat8x8` f32:
//! Apple GPUs' simdgroup matrices through Metal), follows it: the same
//! kernel over f32 stages, with no scaling. Its real primitives never run
//! here; both forms run on any adapter with their primitives emulated
//! (`preprocess::coopmat`, the test mode the GPU tests use).
//!
//! Kernel. A workgroup computes a `bm × bn` tile (128×128 in 8 subgroups
//! of 64×32, or 64×64 in 4 subgroups of 32×32, chosen by workgroup count
//! as the portable tiles are; 32 rows or columns for skinny products) over
//! 32-deep slices of k. Slices are staged
//! in workgroup memory as f16 in two alternating stages, each operand laid
//! out along its contiguous dim in memory (rows padded by 8 halves so the
//! matrix loads of a subgroup hit distinct banks), and the next slice is
//! read into registers in 4-element chunks while the current one is
//! multiplied: one barrier per slice. Each subgroup (`subgroup_id`) keeps
//! its 16×16 f32 accumulators as cooperative matrices; the kernel assumes
//! subgroups of exactly 32 invocations, so the runtime takes it only where
//! the adapter's subgroup size is fixed at 32. At the end a subgroup
//! stores its accumulators one at a time to workgroup memory, from where
//! its invocations apply the caller's [`super::Epilogue`] (`gstore`: bias,
//! alpha/beta, split-K partial sums, rounding to the output dtype).
//!
//! Variants ([`VARIANTS`], in the order of the payload's alternatives,
//! the 8×8 form after them; the runtime measures them all). The kernel
//! above stages each slice through the operands' chunk readers, scaling
//! and converting as it goes ([`Staging::Reader`]); on an H100 that
//! staging, not the tensor cores, took most of its time. The others read
//! f16 copies of the operands ([`F16Copy`]) that a conversion pass writes
//! after the range pre-pass, already scaled and padded to whole tiles and
//! slices: staged as they are ([`Staging::Copy`]), or with the fragments
//! loaded straight from them, no workgroup staging and no barrier in the
//! loop ([`Staging::Direct`]), over the same tiles or over 128×128 tiles
//! whose 4 subgroups take 64×64 each. Packed int4 weights are never
//! copied (they keep the first variant).
//!
//! Scaling ([`F16Scaling`]). The tensor cores take f16: |x| ≤ 65504,
//! normal from 2^-14, and on the H200 an f16 below 2^-14 (subnormal) is
//! flushed to zero in these products (measured by the GPU test `coop_bf16_range_scaling_beyond_f16`,
//! which prints whether they were kept). bf16 has f32's exponent range, so
//! a bf16 value converted as it is may overflow to infinity, and a small
//! f16 or bf16 value may be lost. So each row i of A (f16 or bf16) is
//! scaled by a power of two 2^s_i before the conversion (each column j of
//! B by 2^t_j), and output (i, j) by 2^-(s_i + t_j) after the f32
//! accumulation, with `s_i = clamp(14 − E_i, −126, 126)`,
//! `E_i = ⌊log2 max_l |A[i,l]|⌋` over the row's finite elements (found by
//! a pre-pass at run time):
//! - every scaled finite element is below 2^15, so nothing overflows,
//!   whatever the data (±inf and NaN convert to themselves);
//! - scaling by 2^s is exact in f32, and the conversion is exact for
//!   elements with |x| ≥ 2^(E_i−28), which become normal f16 (the 8 or 11
//!   significant bits of bf16 or f16 fit f16's 11); a smaller one becomes an f16
//!   subnormal, off by at most 2^(−25−s_i) ≤ 2^−39·max_l|A[i,l]|, or 0
//!   where the GPU flushes f16 subnormals, off by less than
//!   2^(E_i−28) ≤ 2^−28·max_l|A[i,l]| (the clamp at 126 only applies to
//!   rows below 2^−112);
//! - products of f16 values are exact in f32 and each is below 2^31, so
//!   the f32 accumulation cannot overflow for any k below 2^97, and
//!   2^-(s_i + t_j) is applied exactly (in two steps when it is outside
//!   f32's normal range).
//!
//! Hence each output differs from the f32 accumulation of the exact
//! operands (what the portable kernel computes, up to summation order) by
//! at most `|ΔC[i,j]| ≤ k · 2^−27 · max_l|A[i,l]| · max_l|B[l,j]|` (the
//! H200), and by at most `k · 2^−38 · …` where f16 subnormals are kept: an
//! eighth (a 2^14th) of `k · 2^−24 · max_l|A[i,l]| · max_l|B[l,j]|`, the
//! scale of that f32 accumulation's own rounding error for such a row and
//! column, and below the rounding of a 16-bit output.
//!
//! A weight is checked at compile time: where one power of two for the
//! whole tensor makes every nonzero element a normal f16 (its finite
//! elements span less than 2^29), that factor is a literal and it has no pre-pass (no
//! conversion error at all); otherwise it is scaled per row or column at
//! run time like any other operand. The pre-pass (one kernel per scaled
//! operand, writing an exponent per row or column) runs only where the
//! alternative does.

use std::fmt::Write;

use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Result, Tensor};

use super::spec::{F16Scaling, Gemm, GemmArgs, FILL};
use super::split::SplitK;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::coopmat::{CoopForm, CoopMat, Role, SUBGROUP};
use crate::preprocess::emit::{entry, grid, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::{Kind, LazyRef};
use crate::preprocess::lowering::Lowering;

/// Bytes after each staged row (the 8 rows a matrix load reads at once
/// start in different banks).
const PAD_BYTES: usize = 16;

/// Multiply-adds (batch·m·n·k) below which a product keeps the portable
/// kernel only: the range pre-pass and its dispatches would cost more
/// than the tensor cores save.
const MIN_WORK: usize = 1 << 18;

/// Invocations of a pre-pass (and conversion pass) workgroup.
const PREPASS: usize = 256;
/// Lines of an [`F16Copy`] are padded to a multiple of this: every tile's
/// sides divide it.
const COPY_LINES: usize = 128;
/// Chunks of 4 lines a pre-pass workgroup takes where lines are not
/// contiguous along k.
const PREPASS_CHUNKS: usize = 8;

impl F16Scaling {
    /// The scaling of operand `x`; `None` for operands that are not f16 or
    /// bf16 (they keep the portable kernel only).
    pub fn of(lw: &Lowering, x: &LazyRef) -> Option<F16Scaling> {
        if !matches!(x.dtype, DType::F16 | DType::BF16) {
            return None;
        }
        let weight = viewed_buffer(x)
            .filter(|&b| lw.buffers.list[b].dtype == x.dtype)
            .and_then(|b| {
                let n = lw.buffers.list[b].numel();
                let bytes = lw.weight_bytes(b)?.get(..2 * n)?;
                Tensor::from_bytes(x.dtype, &[n], bytes).ok()
            });
        Some(
            weight
                .and_then(|w| exact_exponent(&w.to_f32_vec()))
                .map_or(F16Scaling::Lines, F16Scaling::Exact),
        )
    }
}

/// The buffer `x` only reads through layout ops.
fn viewed_buffer(x: &LazyRef) -> Option<BufferIdx> {
    match &x.kind {
        Kind::Load(b) => Some(*b),
        Kind::Permute(x, _)
        | Kind::Expand(x)
        | Kind::Reshape(x)
        | Kind::Slice { x, .. }
        | Kind::Select { x, .. }
        | Kind::Repeat(x) => viewed_buffer(x),
        _ => None,
    }
}

/// The exponent of one factor 2^s that makes every one of `values` (f16
/// or bf16 values) exactly a normal f16 or zero ([`scale_exponent`] of the
/// largest finite |x|), if there is one: scaled, the smallest nonzero |x|
/// must be at least 2^-14 (infinities and NaN aside; the significand of a
/// 16-bit float fits a normal f16's).
fn exact_exponent(values: &[f32]) -> Option<i32> {
    let (mut amax, mut amin) = (0u32, u32::MAX);
    for v in values {
        let bits = v.to_bits() & 0x7fff_ffff;
        if bits != 0 && bits < 0x7f80_0000 {
            amax = amax.max(bits);
            amin = amin.min(bits);
        }
    }
    let s = scale_exponent(amax);
    if amin == u32::MAX {
        return Some(s);
    }
    // ⌊log2 |x|⌋ of the smallest (f32 subnormals: f·2^-149)
    let low = match amin >> 23 {
        0 => (31 - amin.leading_zeros() as i32) - 149,
        field => field as i32 - 127,
    };
    (low + s >= -14).then_some(s)
}

/// The exponent `s` of the factor 2^s for values whose largest finite |x|
/// has f32 bits `amax`: scaled, every one is below 2^15. The pre-pass
/// computes the same in WGSL (`expo` in [`HELPERS`]).
fn scale_exponent(amax: u32) -> i32 {
    let e = (amax >> 23) as i32 - 127;
    (14 - e).clamp(-126, 126)
}

/// WGSL of the scheme: the exponent of the largest |x| with bits `bits`,
/// 2^s for `s` in −126..=127, and `v·2^-(sa + sb)`, exact unless the
/// result itself is beyond f32 (one factor at a time when their product
/// is not a normal f32: both then shrink, or both grow). Flash attention's
/// tensor-core form scales its operands by the same rule.
pub(crate) const HELPERS: &str = "fn expo(bits: u32) -> i32 {
  return clamp(14 - (i32(bits >> 23u) - 127), -126, 126);
}

fn pow2(s: i32) -> f32 {
  return bitcast<f32>(u32(s + 127) << 23u);
}

fn unscale(v: f32, sa: i32, sb: i32) -> f32 {
  let e = -(sa + sb);
  if (e >= -126 && e <= 127) { return v * pow2(e); }
  return (v * pow2(-sa)) * pow2(-sb);
}

fn finite_bits(v: vec4<f32>) -> vec4<u32> {
  let b = bitcast<vec4<u32>>(v) & vec4<u32>(0x7fffffffu);
  return select(vec4<u32>(0u), b, b < vec4<u32>(0x7f800000u));
}

";

/// Tile of the kernel: a workgroup computes `bm × bn`, each of its
/// subgroups `wm × wn` (16×16 accumulators), over `bk`-deep slices of k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CoopTile {
    bm: usize,
    bn: usize,
    wm: usize,
    wn: usize,
    bk: usize,
}

impl CoopTile {
    fn subgroups(&self) -> usize {
        (self.bm / self.wm) * (self.bn / self.wn)
    }

    fn threads(&self) -> usize {
        self.subgroups() * SUBGROUP
    }
}

/// The tile for `gemm` in form `form`: 128×128 where that still gives a
/// large GPU enough workgroups; 32 rows (columns) where m (n) is below 64,
/// so a skinny product keeps no subgroup idle; else 64×64. The 8×8 f32
/// form takes 64×64 over 16-deep slices (its f32 stages double the bytes,
/// and Apple GPUs have 32 KiB of workgroup memory). Only the 128×128 and
/// 64×64 tiles of the 16×16 form have been measured (README, Tensor cores).
fn tile(gemm: &Gemm, form: CoopForm) -> CoopTile {
    let groups = |b: usize| (gemm.m.div_ceil(b) * gemm.n.div_ceil(b)) as u64 * gemm.batch as u64;
    if form == CoopForm::Float8 {
        CoopTile {
            bm: 64,
            bn: 64,
            wm: 32,
            wn: 32,
            bk: 16,
        }
    } else if gemm.m >= 128 && gemm.n >= 128 && groups(128) >= FILL {
        CoopTile {
            bm: 128,
            bn: 128,
            wm: 64,
            wn: 32,
            bk: 32,
        }
    } else {
        let side = |len: usize| if len < 64 { 32 } else { 64 };
        CoopTile {
            bm: side(gemm.m),
            bn: side(gemm.n),
            wm: 32,
            wn: 32,
            bk: 32,
        }
    }
}

/// Whether `gemm` gets the tensor-core alternative: both operands have a
/// [`F16Scaling`], the tiles are not skinny, and there is work enough.
pub(super) fn worth(gemm: &Gemm) -> bool {
    gemm.coop.is_some()
        && gemm.m >= 32
        && gemm.n >= 32
        && gemm.k > 0
        && gemm.batch * gemm.m * gemm.n * gemm.k >= MIN_WORK
}

/// How a kernel of the 16×16 form brings its operands to the tensor
/// cores (module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staging {
    /// Slices read through the chunk readers, scaled and converted as they
    /// are staged in workgroup memory.
    Reader,
    /// Slices of the f16 copies staged in workgroup memory as they are
    /// (8-byte loads; no scaling, conversion or bounds in the loop).
    Copy,
    /// Fragments loaded straight from the f16 copies (the caches in place
    /// of workgroup memory).
    Direct,
}

/// One kernel of the 16×16 form: its staging, and its tile: [`tile`]'s,
/// or where `wide`, 128×128 in 4 subgroups of 64×64 wherever m and n
/// reach 128 (16 products per 8 fragment loads, against 8 per 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Variant {
    staging: Staging,
    wide: bool,
}

/// The 16×16 form's variants, in the payload's order (`benchmarks/
/// variants.py` forces alternatives by index; keep it stable).
const VARIANTS: [Variant; 4] = [
    Variant {
        staging: Staging::Reader,
        wide: false,
    },
    Variant {
        staging: Staging::Copy,
        wide: false,
    },
    Variant {
        staging: Staging::Direct,
        wide: false,
    },
    Variant {
        staging: Staging::Direct,
        wide: true,
    },
];

/// How many variants the 16×16 form has (`PreprocessOptions::emulate_variant`).
pub const VARIANT_COUNT: usize = VARIANTS.len();

/// The tile of variant `v` of the 16×16 form for `gemm`.
fn variant_tile(gemm: &Gemm, v: Variant) -> CoopTile {
    let t = tile(gemm, CoopForm::Half16);
    match v.wide {
        false => t,
        true if gemm.m >= 128 && gemm.n >= 128 => CoopTile {
            bm: 128,
            bn: 128,
            wm: 64,
            wn: 64,
            bk: 32,
        },
        // 2×2 subgroups of the plain tile
        true => CoopTile {
            wm: t.bm / 2,
            wn: t.bn / 2,
            ..t
        },
    }
}

/// One operand's slice of k in workgroup memory, or one batch of its
/// [`F16Copy`]: `len` rows (columns) of the tile by `bk`, laid out
/// k-fastest when the operand is contiguous along k, else `len`-fastest,
/// each row followed by `pad` elements.
#[derive(Clone)]
struct Stage {
    len: usize,
    bk: usize,
    k_fast: bool,
    /// Bytes of an element.
    elem: usize,
    pad: usize,
}

impl Stage {
    fn pitch(&self) -> usize {
        let row = if self.k_fast { self.bk } else { self.len };
        row + self.pad
    }

    /// Elements of one stage.
    fn size(&self) -> usize {
        if self.k_fast {
            self.len * self.pitch()
        } else {
            self.bk * self.pitch()
        }
    }

    /// Offset of element `i` (row of A, column of B) at depth `kk`.
    fn at(&self, i: &str, kk: &str) -> String {
        if self.k_fast {
            format!("({i}) * {}u + {kk}", self.pitch())
        } else {
            format!("({kk}) * {}u + {i}", self.pitch())
        }
    }

    /// Bytes of both stages as WebGPU counts them.
    fn bytes(&self) -> usize {
        (2 * self.size() * self.elem).next_multiple_of(16)
    }
}

/// One operand of the product as the kernels see it.
struct CoopOperand<'a> {
    /// `a` or `b`: names its staging array `t{name}`, registers `p{name}j`.
    name: &'static str,
    /// Its chunk reader (`ca`, `cb`).
    reader: &'static str,
    /// Rows of A or columns of B.
    len: usize,
    k: usize,
    batch: usize,
    /// Elements along k are adjacent (the chunk reader walks k).
    k_fast: bool,
    scaling: F16Scaling,
    /// The pre-pass's exponents (one per `batch × len` line) for
    /// [`F16Scaling::Lines`].
    exps: Option<BufferIdx>,
    stage: &'a Stage,
    /// Its f16 copy, for the variants that read one.
    copy: Option<F16Copy>,
}

impl CoopOperand<'_> {
    /// The WGSL i32 exponent of line `i` (a u32 expression, in range).
    fn exponent(&self, kb: &mut KernelBuilder, i: &str) -> String {
        match (self.scaling, self.exps) {
            (_, Some(exps)) => kb.load(exps, &format!("bt * {}u + {i}", self.len)),
            (F16Scaling::Exact(s), _) => format!("{s}i"),
            // (a pre-pass makes `exps` for every `Lines` operand)
            (F16Scaling::Lines, None) => "0i".into(),
        }
    }

    fn scaled(&self) -> bool {
        self.scaling != F16Scaling::Exact(0)
    }
}

/// Add the pre-pass writing the exponent of each line (row of A, column
/// of B; `batch × len` of them) of operand `o` of `gemm`, read through its
/// chunk reader (of `args`), to `o.exps`.
fn prepass<A: GemmArgs + ?Sized>(
    lw: &mut Lowering,
    o: &CoopOperand,
    gemm: &Gemm,
    args: &A,
) -> Result<()> {
    let (len, k, batch) = (o.len, o.k, o.batch);
    let exps = o
        .exps
        .ok_or_else(|| Error::internal("a range pre-pass with nowhere to write"))?;
    let mut kb = KernelBuilder::new(&lw.buffers);
    let fns = gemm.chunk_reads(&mut kb, args)?;
    // a maximum per invocation: of its chunks (k-fast), or of 4 lines
    let red = if o.k_fast { "u32" } else { "vec4<u32>" };
    let mut s = format!("{fns}{HELPERS}var<workgroup> red: array<{red}, {PREPASS}>;\n\n");
    s.push_str(&entry(PREPASS as u32));
    let groups = if o.k_fast {
        // a workgroup per line, its invocations striding over k in chunks
        let store = kb.store(exps, "g", "expo(red[0])")?;
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let bt = g / {len}u;\n  var mx = vec4<u32>(0u);\n\
             \x20 for (var q = lid * 4u; q < {k}u; q = q + {}u) {{\n\
             \x20   mx = max(mx, finite_bits({}(bt, g % {len}u, q)));\n  }}\n\
             \x20 red[lid] = max(max(mx.x, mx.y), max(mx.z, mx.w));\n  workgroupBarrier();",
            batch * len,
            4 * PREPASS,
            o.reader
        );
        let mut half = PREPASS / 2;
        while half >= 1 {
            let _ = writeln!(
                s,
                "  if (lid < {half}u) {{ red[lid] = max(red[lid], red[lid + {half}u]); }}\n  workgroupBarrier();"
            );
            half /= 2;
        }
        let _ = writeln!(s, "  if (lid == 0u) {{ {store} }}\n}}");
        batch * len
    } else {
        // an invocation per 4 adjacent lines and a 1/PHASES of k, the
        // phases then reduced in workgroup memory
        const CHUNKS: usize = PREPASS_CHUNKS;
        const PHASES: usize = PREPASS / CHUNKS;
        let chunks = len.div_ceil(4);
        let total = batch * chunks;
        let _ = writeln!(
            s,
            "  let c = {FLAT_GROUP} * {CHUNKS}u + lid % {CHUNKS}u;\n  let phase = lid / {CHUNKS}u;\n\
             \x20 let live = c < {total}u;\n  let cc = min(c, {}u);\n\
             \x20 let bt = cc / {chunks}u;\n  let i = (cc % {chunks}u) * 4u;\n  var mx = vec4<u32>(0u);\n\
             \x20 for (var kk = phase; kk < {k}u; kk = kk + {PHASES}u) {{\n\
             \x20   mx = max(mx, finite_bits({}(bt, kk, i)));\n  }}",
            total - 1,
            o.reader
        );
        s.push_str("  red[lid] = mx;\n  workgroupBarrier();\n");
        let mut half = PHASES / 2;
        while half >= 1 {
            let _ = writeln!(
                s,
                "  if (phase < {half}u) {{ red[lid] = max(red[lid], red[lid + {}u]); }}\n  workgroupBarrier();",
                half * CHUNKS
            );
            half /= 2;
        }
        s.push_str("  if (live && phase == 0u) {\n");
        for l in 0..4 {
            let store = kb.store(
                exps,
                &format!("bt * {len}u + i + {l}u"),
                &format!("expo(red[lid][{l}])"),
            )?;
            let _ = writeln!(s, "    if (i + {l}u < {len}u) {{ {store} }}");
        }
        s.push_str("  }\n}\n");
        total.div_ceil(CHUNKS)
    };
    let built = kb.finish(&s).tagged("range");
    let workgroups = grid(groups as u64, lw.options.max_workgroups_per_dim)?;
    // at run time, the workgroups of the valid lines (batch outermost)
    let actual = match &gemm.dynamic {
        Some([b, m, n]) => {
            let line = if o.name == "a" { m } else { n };
            let (lines, per) = match o.k_fast {
                true => ((line.clone(), len), 1),
                false => {
                    let c = |x: usize| SymExpr::Const(x as i64);
                    let quads = SymExpr::floor_div(line.clone() + c(3), c(4))?;
                    ((quads, len.div_ceil(4)), PREPASS_CHUNKS)
                }
            };
            lw.sizes.groups(&[(b.clone(), batch), lines], per)?
        }
        None => None,
    };
    let ops = vec![lw.op_label()];
    lw.add_dispatch_sized(
        built,
        ops,
        [PREPASS as u32, 1, 1],
        workgroups,
        (PREPASS * 16) as u32,
        actual,
    )
}

/// An operand's f16 copy (module comment): scaled as [`Staging::Reader`]
/// scales it, along the operand's contiguous dim as in memory, its lines
/// padded to [`COPY_LINES`] and each split's part of k to `depth` (whole
/// slices), zeros there: the kernels read it with no bounds or clamps.
#[derive(Clone)]
struct F16Copy {
    buf: BufferIdx,
    /// One batch of it (`bk`: all of k, padded; `pad` 0).
    layout: Stage,
    /// Elements of k each split's part takes.
    depth: usize,
}

impl F16Copy {
    fn new(lw: &mut Lowering, o: &CoopOperand, splits: usize, bk: usize) -> Result<F16Copy> {
        let depth = (o.k / splits).next_multiple_of(bk);
        let layout = Stage {
            len: o.len.next_multiple_of(COPY_LINES),
            bk: splits * depth,
            k_fast: o.k_fast,
            elem: 2,
            pad: 0,
        };
        let name = format!("{}.f16_{}", lw.op_label(), o.name);
        let buf = lw.temp16(&name, &[o.batch * layout.size()])?;
        Ok(F16Copy { buf, layout, depth })
    }

    /// Add the pass writing it from operand `o` (after `o`'s pre-pass, whose
    /// exponents it applies) of `gemm` split `splits` ways along k, an
    /// invocation a 4-element chunk of the copy.
    fn convert<A: GemmArgs + ?Sized>(
        &self,
        lw: &mut Lowering,
        o: &CoopOperand,
        gemm: &Gemm,
        args: &A,
        splits: usize,
    ) -> Result<()> {
        let (len, k) = (o.len, o.k / splits);
        let mut kb = KernelBuilder::new(&lw.buffers);
        let fns = gemm.chunk_reads(&mut kb, args)?;
        let out = kb.halves4(self.buf)?;
        let per = self.layout.size() / 4;
        let row = self.layout.pitch() / 4;
        let chunks = o.batch * per;
        // the chunk's line `i` and depth `kq` in the copy, its depth `kk`
        // in the operand (one split's part of k after another)
        let (i, kq, read) = match o.k_fast {
            true => ("r", "q", format!("{}(bt, i, kk)", o.reader)),
            false => ("q", "r", format!("{}(bt, kk, i)", o.reader)),
        };
        let factor = match (o.scaled(), o.k_fast) {
            (false, _) => "1.0".to_string(),
            (true, true) => format!("pow2({})", o.exponent(&mut kb, "i")),
            (true, false) => {
                let line = |l: usize| {
                    let at = format!("min(i + {l}u, {}u)", len - 1);
                    format!("pow2({})", o.exponent(&mut kb, &at))
                };
                format!(
                    "vec4<f32>({})",
                    (0..4).map(line).collect::<Vec<_>>().join(", ")
                )
            }
        };
        let mut s = format!("{fns}{HELPERS}");
        s.push_str(&entry(PREPASS as u32));
        let _ = writeln!(
            s,
            "  let c = {FLAT_GROUP} * {PREPASS}u + lid;
  if (c >= {chunks}u) {{ return; }}
               let bt = c / {per}u;
  let r = (c % {per}u) / {row}u;
  let q = (c % {row}u) * 4u;
               let i = {i};
  let w = {kq} % {depth}u;
               let kk = ({kq} / {depth}u) * {k}u + w;
  var v = vec4<f32>(0.0);
               if (i < {len}u && w < {k}u) {{ v = {read} * {factor}; }}
               {out}[c] = vec4<f16>(v);
}}",
            depth = self.depth,
        );
        let built = kb.finish(&s).tagged("cvt16");
        let workgroups = grid(
            chunks.div_ceil(PREPASS) as u64,
            lw.options.max_workgroups_per_dim,
        )?;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [PREPASS as u32, 1, 1], workgroups, 0)
    }
}

/// What one product's variants share, made by the first that needs it:
/// each operand's exponents and f16 copy.
#[derive(Default)]
struct Shared {
    exps: [Option<BufferIdx>; 2],
    copies: [Option<F16Copy>; 2],
}

/// Add the tensor-core alternatives of dispatch `d`, the portable kernel
/// of `gemm` (with `split` along k): the 16×16 form's [`VARIANTS`] (only
/// the first where not `copies`, or where a split's part of k is not
/// whole chunks of 4), then the 8×8 form. Emulating, the form emulated
/// replaces the dispatch, in the variant the options name.
pub(super) fn alternatives<A: GemmArgs + ?Sized>(
    lw: &mut Lowering,
    d: usize,
    gemm: &Gemm,
    split: &SplitK,
    args: &A,
    copies: bool,
) -> Result<()> {
    // a copy kernel binds the two copies and their exponents in place of
    // the operands' sources: within the budget where the portable kernel
    // leaves two bindings to spare (the sources were at least one each)
    let spare = lw.dispatches[d].buffers.len() + 2 <= lw.options.max_bindings;
    let copies =
        copies && spare && (split.splits == 1 || (gemm.k / split.splits).is_multiple_of(4));
    let mut offered: Vec<Variant> = VARIANTS
        .into_iter()
        .filter(|v| copies || v.staging == Staging::Reader)
        .collect();
    if !lw.variants() {
        let named = VARIANTS.get(lw.options.emulate_variant);
        let v = named.filter(|v| offered.contains(v)).unwrap_or(&offered[0]);
        offered = vec![*v];
    }
    // (a wide variant whose tile is the plain one's adds nothing; they are
    // adjacent)
    offered.dedup_by_key(|v| (variant_tile(gemm, *v), v.staging));
    let mut shared = Shared::default();
    for v in offered {
        let form = CoopForm::Half16;
        lw.alternative(d, form, |lw| {
            lower(lw, gemm, split, args, form, v, &mut shared)
        })?;
    }
    let form = CoopForm::Float8;
    lw.alternative(d, form, |lw| {
        lower(lw, gemm, split, args, form, VARIANTS[0], &mut shared)
    })
}

/// Build the alternative's dispatches for `gemm` (already lowered as the
/// portable dispatch, with `split` along k) in form `form` and variant `v`
/// (the first for [`CoopForm::Float8`]): for [`CoopForm::Half16`] a
/// pre-pass for each operand scaled at run time and the conversion passes
/// the variant reads, then the tensor-core kernel, reading the operands
/// in chunks ([`GemmArgs::chunks`]) or from their copies and storing
/// through `split`.
fn lower<A: GemmArgs + ?Sized>(
    lw: &mut Lowering,
    gemm: &Gemm,
    split: &SplitK,
    args: &A,
    form: CoopForm,
    v: Variant,
    shared: &mut Shared,
) -> Result<()> {
    let Some([mut ra, mut rb]) = gemm.coop else {
        return Ok(());
    };
    let t = match form {
        CoopForm::Half16 => variant_tile(gemm, v),
        CoopForm::Float8 => {
            // f32 holds every f16 and bf16 value as it is
            (ra, rb) = (F16Scaling::Exact(0), F16Scaling::Exact(0));
            tile(gemm, form)
        }
    };
    let (sa, sb) = stages(gemm, &t, form);
    let operand = |name, reader, len, k_fast, scaling, stage| CoopOperand {
        name,
        reader,
        len,
        k: gemm.k,
        batch: gemm.batch,
        k_fast,
        scaling,
        exps: None,
        stage,
        copy: None,
    };
    let mut operands = [
        operand("a", "ca", gemm.m, gemm.a_k_fast, ra, &sa),
        operand("b", "cb", gemm.n, gemm.b_k_fast, rb, &sb),
    ];
    for (x, o) in operands.iter_mut().enumerate() {
        if o.scaling == F16Scaling::Lines {
            if shared.exps[x].is_none() {
                let name = format!("{}.exponents_{}", lw.op_label(), o.name);
                shared.exps[x] = Some(lw.temp(&name, DType::I32, &[o.batch * o.len])?);
            }
            o.exps = shared.exps[x];
            prepass(lw, o, gemm, args)?;
        }
        if v.staging != Staging::Reader {
            if shared.copies[x].is_none() {
                shared.copies[x] = Some(F16Copy::new(lw, o, split.splits, t.bk)?);
            }
            let copy = shared.copies[x].clone();
            if let Some(c) = &copy {
                c.convert(lw, o, gemm, args, split.splits)?;
            }
            o.copy = copy;
        }
    }
    let mut kb = KernelBuilder::new(&lw.buffers);
    let mut cm = lw.coop_mat(form);
    cm.enable(&mut kb);
    // (the operands' readers only where the kernel reads them: a copy's
    // reader binds its sources, which the budget of bindings may not hold)
    let reads = match (form, v.staging) {
        (CoopForm::Half16, Staging::Copy | Staging::Direct) => String::new(),
        _ => gemm.chunk_reads(&mut kb, args)?,
    };
    let fns = reads + &split.store(&mut kb, args)? + HELPERS;
    let main = kernel(
        &mut kb,
        &mut cm,
        gemm,
        &t,
        split.splits,
        &operands,
        v.staging,
    )?;
    let built = kb
        .finish(&format!("{fns}{}{main}", cm.helpers()))
        .tagged(cm.tag());
    let staged = match v.staging {
        Staging::Direct => 0,
        _ => sa.bytes() + sb.bytes(),
    };
    let storage = staged + t.subgroups() * form.size().pow(2) * 4;
    let tiles = (gemm.m.div_ceil(t.bm) * gemm.n.div_ceil(t.bn)) as u64;
    let groups = tiles * (gemm.batch * split.splits) as u64;
    let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
    let actual = gemm.groups(lw, t.bm, t.bn, split.splits)?;
    let ops = vec![lw.op_label()];
    let threads = t.threads() as u32;
    lw.add_dispatch_sized(
        built,
        ops,
        [threads, 1, 1],
        workgroups,
        storage as u32,
        actual,
    )
}

fn stages(gemm: &Gemm, t: &CoopTile, form: CoopForm) -> (Stage, Stage) {
    let elem = form.elem().1;
    let stage = |len, k_fast| Stage {
        len,
        bk: t.bk,
        k_fast,
        elem,
        pad: PAD_BYTES / elem,
    };
    (stage(t.bm, gemm.a_k_fast), stage(t.bn, gemm.b_k_fast))
}

/// The kernel's main (see the module comment), staging as `staging` says
/// (the copies are the operands' own where it reads them).
fn kernel(
    kb: &mut KernelBuilder,
    cm: &mut CoopMat,
    gemm: &Gemm,
    t: &CoopTile,
    splits: usize,
    operands: &[CoopOperand; 2],
    staging: Staging,
) -> Result<String> {
    let CoopTile { bm, bn, wm, wn, bk } = *t;
    let form = cm.form;
    let (size, (elem, bytes)) = (form.size(), form.elem());
    // elements of one matrix (a subgroup's epilogue slot)
    let sq = size * size;
    let (m, n, k) = (gemm.m, gemm.n, gemm.k);
    let threads = t.threads();
    let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
    let tiles = tiles_m * tiles_n;
    let per = tiles * gemm.batch;
    let depth = k / splits;
    let (fm, fnn) = (wm / size, wn / size);
    let [oa, ob] = operands;
    let (sa, sb) = (oa.stage, ob.stage);
    // the copies (and how each is bound: 4 halves an element where staged,
    // halves where the fragments load from it)
    let copies = match (staging, &oa.copy, &ob.copy) {
        (Staging::Reader, _, _) => None,
        (_, Some(ca), Some(cb)) => {
            let bind = |kb: &mut KernelBuilder, c: &F16Copy| match staging {
                Staging::Direct => kb.halves(c.buf),
                _ => kb.halves4(c.buf),
            };
            Some([(ca, bind(kb, ca)?), (cb, bind(kb, cb)?)])
        }
        _ => {
            return Err(Error::internal(
                "a tensor-core GEMM variant without its copies",
            ))
        }
    };
    // each split's part of k as the kernel walks it
    let part = copies.as_ref().map_or(depth, |[(c, _), _]| c.depth);
    let nt = part.div_ceil(bk);
    // Every workgroup array is a whole number of 16 bytes: a
    // cooperative-matrix load needs a 16-byte aligned pointer, and the
    // driver lays the arrays out as it likes (attention_flash.rs).
    let sizes = [
        2 * sa.size() * bytes,
        2 * sb.size() * bytes,
        t.subgroups() * sq * 4,
    ];
    if let Some(bad) = sizes.iter().find(|&&b| b % 16 != 0) {
        return Err(Error::internal(format!(
            "tensor-core GEMM: a workgroup array of {bad} bytes breaks the 16-byte alignment"
        )));
    }
    let mut s = String::new();
    if staging != Staging::Direct {
        let _ = writeln!(s, "var<workgroup> ta: array<{elem}, {}>;", 2 * sa.size());
        let _ = writeln!(s, "var<workgroup> tb: array<{elem}, {}>;", 2 * sb.size());
    }
    let _ = writeln!(s, "var<workgroup> tc: array<f32, {}>;", t.subgroups() * sq);
    let _ = writeln!(
        s,
        "@compute @workgroup_size({threads})\n\
         fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
         @builtin(local_invocation_index) lid: u32{}) {{",
        cm.params()
    );
    s.push_str(&cm.prologue());
    let _ = writeln!(
        s,
        "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
         \x20 let ks = g / {per}u;\n  let sb = g / {tiles}u;\n\
         \x20 let bt = sb % {}u;\n  let tile = g % {tiles}u;\n\
         \x20 let kbase = ks * {part}u;\n{}\
         \x20 let wr = (sg / {}u) * {wm}u;\n  let wc = (sg % {}u) * {wn}u;",
        per * splits,
        gemm.batch,
        gemm.tile_origin(bm, bn),
        bn / wn,
        bn / wn,
    );
    if form == CoopForm::Float8 {
        // Accumulators start as zeros loaded from workgroup memory: naga's
        // MSL for `coop_mat8x8<f32, C>()` is `simdgroup_float8x8 {}`, whose
        // contents Metal leaves undefined (unchecked on Apple hardware).
        let _ = writeln!(
            s,
            "  for (var q = lid; q < {}u; q = q + {threads}u) {{ tc[q] = 0.0; }}\n  workgroupBarrier();",
            t.subgroups() * sq
        );
    }
    for i in 0..fm {
        for j in 0..fnn {
            let init = match form {
                CoopForm::Half16 => cm.zero(),
                CoopForm::Float8 => cm.load(
                    Role::C,
                    "tc",
                    "f32",
                    &format!("sg * {sq}u"),
                    &format!("{size}u"),
                    false,
                ),
            };
            let _ = writeln!(s, "  var c{i}_{j} = {init};");
        }
    }
    let origin = |o: &CoopOperand| if o.name == "a" { "m0" } else { "n0" };
    if let Some([(ca, a16), (cb, b16)]) = &copies {
        if staging == Staging::Direct {
            // no staging: each slice's fragments come from the copies
            let _ = writeln!(
                s,
                "  for (var t = 0u; t < {nt}u; t = t + 1u) {{\n    let k0 = kbase + t * {bk}u;"
            );
            let from = |c: &F16Copy, array: &str, line: &str| Source {
                array: array.to_string(),
                base: format!("bt * {}u", c.layout.size()),
                layout: c.layout.clone(),
                line: line.to_string(),
                k0: "k0 + ".into(),
            };
            let sources = [from(ca, a16, "m0 + wr"), from(cb, b16, "n0 + wc")];
            products(&mut s, cm, &sources, (fm, fnn), bk);
            s.push_str("  }\n");
            return Ok(s + &epilogue(kb, cm, gemm, operands, (fm, fnn)));
        }
    }
    let per_thread = |o: &CoopOperand| o.stage.len * bk / 4 / threads;
    // chunk j of an operand's slice: (index along m/n, depth) of its
    // first element; the chunk runs along k when the operand is k-fast,
    // else along m/n
    let chunk = |o: &CoopOperand, j: usize| -> (String, String) {
        let c = format!("(lid + {}u)", j * threads);
        let len = o.stage.len;
        if o.k_fast {
            (
                format!("{c} / {}u", bk / 4),
                format!("({c} % {}u) * 4u", bk / 4),
            )
        } else {
            (
                format!("({c} % {}u) * 4u", len / 4),
                format!("{c} / {}u", len / 4),
            )
        }
    };
    for o in operands {
        for j in 0..per_thread(o) {
            let _ = writeln!(s, "  var p{}{j}: vec4<{elem}>;", o.name);
            if staging != Staging::Reader || !o.scaled() {
                continue;
            }
            // the factors of the chunk's line(s), the same in every slice
            let (i, _) = chunk(o, j);
            let mut line = |l: usize| {
                let at = format!("min({} + {i} + {l}u, {}u)", origin(o), o.len - 1);
                format!("pow2({})", o.exponent(kb, &at))
            };
            let f = if o.k_fast {
                line(0)
            } else {
                format!(
                    "vec4<f32>({})",
                    (0..4).map(line).collect::<Vec<_>>().join(", ")
                )
            };
            let _ = writeln!(s, "  let f{}{j} = {f};", o.name);
        }
    }
    let read = |s: &mut String, k0: &str| {
        for (x, o) in operands.iter().enumerate() {
            for j in 0..per_thread(o) {
                let (i, kk) = chunk(o, j);
                let gi = format!("{} + {i}", origin(o));
                let gk = format!("{k0} + {kk}");
                if let Some(cs) = &copies {
                    // the copy is whole 4-element chunks, in range
                    let (c, array) = &cs[x];
                    let at = c.layout.at(&gi, &gk);
                    let _ = writeln!(
                        s,
                        "    p{}{j} = {array}[(bt * {}u + {at}) / 4u];",
                        o.name,
                        c.layout.size()
                    );
                    continue;
                }
                let mut conds = vec![];
                if !o.len.is_multiple_of(o.stage.len) {
                    conds.push(format!("{gi} < {}u", o.len));
                }
                if !depth.is_multiple_of(bk) {
                    conds.push(format!("{gk} < kbase + {depth}u"));
                }
                let ci = format!("min({gi}, {}u)", o.len - 1);
                let ck = format!("min({gk}, {}u)", k - 1);
                let call = if o.k_fast {
                    format!("{}(bt, {ci}, {ck})", o.reader)
                } else {
                    format!("{}(bt, {ck}, {ci})", o.reader)
                };
                let mut v = if conds.is_empty() {
                    call
                } else {
                    format!("select(vec4<f32>(0.0), {call}, {})", conds.join(" && "))
                };
                if o.scaled() {
                    v = format!("({v}) * f{}{j}", o.name);
                }
                let _ = writeln!(s, "    p{}{j} = vec4<{elem}>({v});", o.name);
            }
        }
    };
    let write = |s: &mut String, stage: &str| {
        for o in operands {
            for j in 0..per_thread(o) {
                let (i, kk) = chunk(o, j);
                for l in 0..4 {
                    let at = if o.k_fast {
                        o.stage.at(&i, &format!("{kk} + {l}u"))
                    } else {
                        o.stage.at(&format!("{i} + {l}u"), &kk)
                    };
                    let _ = writeln!(
                        s,
                        "    t{0}[{stage} * {1}u + {at}] = p{0}{j}[{l}];",
                        o.name,
                        o.stage.size()
                    );
                }
            }
        }
    };
    if nt > 0 {
        s.push_str("  {\n");
        read(&mut s, "kbase");
        write(&mut s, "0u");
        s.push_str("  }\n  workgroupBarrier();\n");
        let _ = writeln!(
            s,
            "  for (var t = 0u; t < {nt}u; t = t + 1u) {{\n    let cur = t & 1u;\n\
             \x20   let more = t + 1u < {nt}u;\n    if (more) {{"
        );
        read(&mut s, &format!("kbase + (t + 1u) * {bk}u"));
        let _ = writeln!(
            s,
            "    }}\n    let oa = cur * {}u;\n    let ob = cur * {}u;",
            sa.size(),
            sb.size()
        );
        let staged = |array: &str, base: &str, stage: &Stage, line: &str| Source {
            array: array.into(),
            base: base.into(),
            layout: stage.clone(),
            line: line.into(),
            k0: String::new(),
        };
        let sources = [staged("ta", "oa", sa, "wr"), staged("tb", "ob", sb, "wc")];
        products(&mut s, cm, &sources, (fm, fnn), bk);
        s.push_str("    if (more) {\n");
        write(&mut s, "(1u - cur)");
        s.push_str("    }\n    workgroupBarrier();\n  }\n");
    }
    Ok(s + &epilogue(kb, cm, gemm, operands, (fm, fnn)))
}

/// Where a slice's fragments of one operand are read: `array` from
/// element `base`, laid out as `layout`; the subgroup's first line
/// (`line`) and the slice's depth (`k0`, a WGSL prefix) as WGSL.
struct Source {
    array: String,
    base: String,
    layout: Stage,
    line: String,
    k0: String,
}

/// The statements multiplying one `bk`-deep slice into the subgroup's
/// `fm × fn` accumulators `c{i}_{j}`, fragments from `sources` (A, B).
fn products(
    s: &mut String,
    cm: &mut CoopMat,
    sources: &[Source; 2],
    (fm, fnn): (usize, usize),
    bk: usize,
) {
    let size = cm.form.size();
    let elem = cm.form.elem().0;
    let [a, b] = sources;
    for step in 0..bk / size {
        s.push_str("    {\n");
        for (src, role, count, name) in [(a, Role::A, fm, "ma"), (b, Role::B, fnn, "mb")] {
            for i in 0..count {
                let kk = format!("{}{}u", src.k0, size * step);
                let at = src.layout.at(&format!("{} + {}u", src.line, size * i), &kk);
                // A is row-major in memory when k-fast, B when not
                let row_major = src.layout.k_fast == (role == Role::A);
                let ld = cm.load(
                    role,
                    &src.array,
                    elem,
                    &format!("{} + {at}", src.base),
                    &format!("{}u", src.layout.pitch()),
                    row_major,
                );
                let _ = writeln!(s, "      let {name}{i} = {ld};");
            }
        }
        for i in 0..fm {
            for j in 0..fnn {
                let c = format!("c{i}_{j}");
                let _ = writeln!(
                    s,
                    "      {c} = {};",
                    cm.mma(&format!("ma{i}"), &format!("mb{j}"), &c)
                );
            }
        }
        s.push_str("    }\n");
    }
}

/// The statements storing the subgroup's accumulators (one at a time,
/// through its slot of `tc`), unscaled, through `gstore`, and the end of
/// the kernel.
fn epilogue(
    kb: &mut KernelBuilder,
    cm: &mut CoopMat,
    gemm: &Gemm,
    operands: &[CoopOperand; 2],
    (fm, fnn): (usize, usize),
) -> String {
    let [oa, ob] = operands;
    let size = cm.form.size();
    let sq = size * size;
    let (m, n) = (gemm.m, gemm.n);
    let value = if oa.scaled() || ob.scaled() {
        let (ea, eb) = (oa.exponent(kb, "r"), ob.exponent(kb, "c"));
        format!("unscale(tc[e], {ea}, {eb})")
    } else {
        "tc[e]".to_string()
    };
    let mut s = String::new();
    for i in 0..fm {
        for j in 0..fnn {
            let store = cm.store(
                &format!("c{i}_{j}"),
                "tc",
                &format!("sg * {sq}u"),
                &format!("{size}u"),
                true,
            );
            let _ = writeln!(
                s,
                "  {store}\n  workgroupBarrier();\n\
                 \x20 for (var q = sl; q < {sq}u; q = q + {SUBGROUP}u) {{\n\
                 \x20   let e = sg * {sq}u + q;\n\
                 \x20   let r = m0 + wr + {}u + q / {size}u;\n\
                 \x20   let c = n0 + wc + {}u + q % {size}u;\n\
                 \x20   if (r < {m}u && c < {n}u) {{ gstore(sb, r, c, {value}); }}\n  }}\n\
                 \x20 workgroupBarrier();",
                size * i,
                size * j
            );
        }
    }
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::payload::{CoopType, Needs, Payload};
    use crate::preprocess::kernels::testing::{
        alternatives_gated_alike, dynamic_input, input, lower_one, lower_one_with, weight, Operand,
    };
    use crate::preprocess::options::PreprocessOptions;
    use etmetal_core::Op;
    use half::{bf16, f16};

    /// The alternatives of a payload's dispatches: (kernel names, needs).
    fn alternatives(p: &Payload) -> Vec<(Vec<String>, Needs)> {
        p.dispatches
            .iter()
            .flat_map(|d| &d.alternatives)
            .map(|a| {
                let names = a
                    .dispatches
                    .iter()
                    .map(|d| p.kernels[d.kernel].name.clone())
                    .collect();
                (names, a.needs)
            })
            .collect()
    }

    /// Every orientation of the operands, both tiles, split k, batches,
    /// bias, f16 and bf16 of weights and activations: the tensor-core
    /// kernels of both forms validate (naga, with MSL), the 16×16 form's
    /// pre-pass runs for every operand but weights that one factor converts
    /// exactly, and the 8×8 f32 form (Apple) follows it with no pre-pass,
    /// within Apple's 32 KiB of workgroup memory.
    #[test]
    fn coop_alternatives_validate_in_every_form() {
        let (h, b) = (DType::F16, DType::BF16);
        let cases: Vec<(Op, Vec<_>, &[&str])> = vec![
            // activations: A k-fast, B n-fast; both ranges at run time
            (
                Op::MatMul,
                vec![input(b, &[200, 72]), input(b, &[72, 130])],
                &["range", "range", "coop"],
            ),
            // skinny: 32-row, 32-column and 32×32 tiles
            (
                Op::MatMul,
                vec![input(b, &[40, 256]), input(b, &[256, 512])],
                &["range", "range", "coop"],
            ),
            (
                Op::MatMul,
                vec![input(h, &[300, 128]), input(h, &[128, 48])],
                &["range", "range", "coop"],
            ),
            (
                Op::MatMul,
                vec![input(b, &[2, 33, 512]), input(b, &[2, 512, 63])],
                &["range", "range", "coop"],
            ),
            // f16 alike; the 128×128 tile (4096 rows)
            (
                Op::MatMul,
                vec![input(h, &[4096, 40]), input(h, &[40, 1024])],
                &["range", "range", "coop"],
            ),
            // linear: a weight (exact with one factor), B k-fast, bias
            (
                Op::Linear,
                vec![
                    input(b, &[3, 100, 64]),
                    weight(b, &[96, 64]),
                    weight(b, &[96]),
                ],
                &["range", "coop"],
            ),
            // f16 linear without bias: a weight one factor converts exactly
            (
                Op::Linear,
                vec![input(h, &[256, 33]), weight(h, &[48, 33]), None],
                &["range", "coop"],
            ),
            // split k (few tiles, deep k), batched
            (
                Op::MatMul,
                vec![input(h, &[2, 64, 4096]), input(h, &[2, 4096, 64])],
                &["range", "range", "coop"],
            ),
            (
                Op::Addmm {
                    beta: 0.5,
                    alpha: 2.0,
                },
                vec![
                    input(b, &[130]),
                    weight(b, &[70, 90]),
                    weight(b, &[90, 130]),
                ],
                &["coop"],
            ),
        ];
        for (op, operands, kinds) in cases {
            let name = format!("{op:?}");
            // the variants reading f16 copies: each operand's conversion
            // after its pre-pass (in these cases only A's where one is)
            let copying: Vec<&str> = match kinds.len() {
                3 => vec!["range", "cvt16", "range", "cvt16", "coop"],
                2 => vec!["range", "cvt16", "cvt16", "coop"],
                _ => vec!["cvt16", "cvt16", "coop"],
            };
            let emulated = |tags: &[&'static str]| -> Vec<&'static str> {
                let t = tags
                    .iter()
                    .map(|&k| if k == "coop" { "coopemu" } else { k });
                t.collect()
            };
            for v in 0..VARIANT_COUNT {
                let want = if v == 0 { kinds } else { &copying[..] };
                let options = (CoopForm::Half16, v);
                emulated_in_place(op.clone(), operands.clone(), options, &emulated(want));
            }
            let float8 = (CoopForm::Float8, 0);
            emulated_in_place(op.clone(), operands.clone(), float8, &["coop8x8emu"]);
            let p = lower_one(op, operands).unwrap_or_else(|e| panic!("{name}: {e}"));
            let alts = alternatives(&p.payload);

            // the wide variant only where its tile differs (m, n ≥ 128)
            assert!(matches!(alts.len(), 4 | 5), "{name}: {alts:?}");
            let tags = |names: &[String]| -> Vec<String> {
                names
                    .iter()
                    .map(|n| n.rsplit('_').next().unwrap().to_string())
                    .collect()
            };
            for (v, (names, needs)) in alts[..alts.len() - 1].iter().enumerate() {
                let want = if v == 0 { kinds } else { &copying[..] };
                assert_eq!(tags(names), want, "{name} variant {v}");
                assert_eq!((needs.m, needs.ab), (16, CoopType::F16), "{name}");
                // staged: 11 KiB (skinny tiles) to 48; straight from the
                // copies, the epilogue's slots only
                let least = if v < 2 { 8192 } else { 4096 };
                let bytes = needs.workgroup_storage;
                assert!(least <= bytes && bytes <= 49152, "{needs:?}");
                assert_eq!(bytes % 16, 0, "{needs:?}");
            }
            let (names, needs) = &alts[alts.len() - 1];
            assert_eq!(tags(names), ["coop8x8"], "{name}");
            assert_eq!(
                (needs.m, needs.n, needs.k, needs.ab, needs.cr),
                (8, 8, 8, CoopType::F32, CoopType::F32),
                "{name}"
            );
            assert!(
                needs.workgroup_storage > 16384 && needs.workgroup_storage <= 32768,
                "{needs:?}"
            );
            // what the portable kernels need stays within the defaults
            let r = &p.payload.requirements;
            assert!(r.max_compute_workgroup_storage_size <= 16384, "{r:?}");
            assert!(!r.shader_f16);
        }
        // small or skinny products, and f32 ones, have no alternative
        for (op, operands) in [
            (Op::MatMul, vec![input(b, &[40, 40]), input(b, &[40, 40])]),
            (
                Op::MatMul,
                vec![input(h, &[16, 4096]), input(h, &[4096, 512])],
            ),
            (
                Op::MatMul,
                vec![
                    input(DType::F32, &[512, 512]),
                    input(DType::F32, &[512, 512]),
                ],
            ),
        ] {
            let p = lower_one(op, operands).unwrap();
            assert!(alternatives(&p.payload).is_empty());
        }
    }

    /// A bf16 linear over a run-time number of rows: each row bucket's
    /// portable kernel gains both forms, which run in its bucket only,
    /// over the tiles of the actual rows.
    #[test]
    fn dynamic_rows_gain_tensor_core_forms_per_bucket() {
        let p = lower_one(
            Op::Linear,
            vec![
                dynamic_input(DType::BF16, &[512, 256], 0),
                weight(DType::BF16, &[256, 256]),
            ],
        )
        .unwrap()
        .payload;
        assert_eq!(alternatives_gated_alike(&p, &[1, 64, 65, 256, 257, 512]), 3);
        // the top bucket's tensor-core product
        let top = p.dispatches.iter().rfind(|d| !d.alternatives.is_empty());
        let coop = top.unwrap().alternatives[0].dispatches.last().unwrap();
        let at = |n| coop.groups.as_ref().unwrap().eval(&[n]).unwrap();
        assert!(0 < at(300) && at(300) < at(512), "{} {}", at(300), at(512));
        // its pre-pass takes the rows (a workgroup each) of the actual m
        let prepass = &top.unwrap().alternatives[0].dispatches[0];
        assert!(p.kernels[prepass.kernel].name.ends_with("_range"));
        let rows = |n| prepass.groups.as_ref().unwrap().eval(&[n]).unwrap();
        assert_eq!((rows(200), rows(300), rows(512)), (0, 300, 512));
    }

    /// Lowered emulating `form` in GEMM variant `variant` (test mode), `op`
    /// has no alternative: its first dispatches are the form's kernels
    /// tagged `want` (pre-passes, then the product), in place of the
    /// portable kernel, and no kernel it runs uses cooperative matrices or
    /// subgroups (naga validated them without those capabilities); the
    /// 16×16 form asks for shader-f16.
    fn emulated_in_place(
        op: Op,
        operands: Vec<Option<Operand>>,
        (form, variant): (CoopForm, usize),
        want: &[&str],
    ) {
        let options = PreprocessOptions {
            emulate_coop: Some(form),
            emulate_variant: variant,
            ..PreprocessOptions::default()
        };
        let name = format!("{op:?} emulating {form:?} variant {variant}");
        let p = lower_one_with(op, operands, &options)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .payload;
        assert!(alternatives(&p).is_empty(), "{name}");
        let tags: Vec<&str> = p
            .dispatches
            .iter()
            .map(|d| p.kernels[d.kernel].name.rsplit('_').next().unwrap())
            .collect();
        assert!(tags.starts_with(want), "{name}: {tags:?}");
        for d in &p.dispatches {
            let wgsl = &p.kernels[d.kernel].wgsl;
            assert!(
                !wgsl.contains("coop_mat") && !wgsl.contains("subgroup"),
                "{name}"
            );
        }
        assert_eq!(
            p.requirements.shader_f16,
            form == CoopForm::Half16,
            "{name}"
        );
    }

    /// Tiles by shape and form; each invocation stages whole 4-element
    /// chunks of both operands, and subgroups cover the tile.
    #[test]
    fn tiles_by_shape_and_form() {
        let g = |m, n| Gemm {
            batch: 1,
            m,
            n,
            k: 256,
            a_k_fast: true,
            b_k_fast: false,
            coop: None,
            dynamic: None,
        };
        let cases = [
            ((4096, 4096), CoopForm::Half16, (128, 128, 32)),
            ((1024, 1024), CoopForm::Half16, (64, 64, 32)),
            ((40, 4096), CoopForm::Half16, (32, 64, 32)),
            ((4096, 48), CoopForm::Half16, (64, 32, 32)),
            ((40, 48), CoopForm::Half16, (32, 32, 32)),
            ((4096, 4096), CoopForm::Float8, (64, 64, 16)),
            ((40, 48), CoopForm::Float8, (64, 64, 16)),
        ];
        let covers = |t: CoopTile, form: CoopForm| {
            for len in [t.bm, t.bn] {
                assert_eq!(len * t.bk % (4 * t.threads()), 0, "{t:?}");
            }
            assert_eq!(t.bm % t.wm + t.bn % t.wn, 0, "{t:?}");
            let s = form.size();
            assert_eq!((t.wm % s, t.wn % s, t.bk % s), (0, 0, 0), "{t:?}");
            assert_eq!(COPY_LINES % t.bm + COPY_LINES % t.bn, 0, "{t:?}");
        };
        for ((m, n), form, want) in cases {
            let t = tile(&g(m, n), form);
            assert_eq!((t.bm, t.bn, t.bk), want, "{m}x{n} {form:?}");
            covers(t, form);
        }
        // the wide variant: 4 subgroups of 64×64, or of a quarter of the
        // plain tile
        let wide = VARIANTS[3];
        for ((m, n), want) in [
            ((4096, 4096), (128, 128, 64, 64)),
            ((1024, 1024), (128, 128, 64, 64)),
            ((512, 128), (128, 128, 64, 64)),
            ((100, 4096), (64, 64, 32, 32)),
            ((40, 48), (32, 32, 16, 16)),
        ] {
            let t = variant_tile(&g(m, n), wide);
            assert_eq!((t.bm, t.bn, t.wm, t.wn), want, "{m}x{n}");
            assert_eq!(t.subgroups(), 4, "{t:?}");
            covers(t, CoopForm::Half16);
        }
    }

    /// The scheme's arithmetic on the host: `a · b` (`k` long) through
    /// scaled f16 operands and f32 accumulation, as the kernel computes.
    fn product(a: &[f32], b: &[f32]) -> f32 {
        let amax = |x: &[f32]| {
            x.iter()
                .map(|v| v.abs().to_bits())
                .filter(|&b| b < 0x7f80_0000)
                .max()
                .unwrap_or(0)
        };
        let (sa, sb) = (scale_exponent(amax(a)), scale_exponent(amax(b)));
        let f = pow2;
        let mut acc = 0f32;
        for (x, y) in a.iter().zip(b) {
            let x = f16::from_f32(x * f(sa)).to_f32();
            let y = f16::from_f32(y * f(sb)).to_f32();
            assert!(x.is_finite() && y.is_finite(), "overflow");
            acc += x * y;
        }
        (acc * f(-sa)) * f(-sb)
    }

    fn pow2(s: i32) -> f32 {
        f32::from_bits(((s + 127) as u32) << 23)
    }

    fn bf(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    }

    #[test]
    fn scaled_values_stay_below_2_15_and_factors_are_exact() {
        for amax in [
            0.0f32,
            f32::from_bits(1),
            1e-38,
            1e-30,
            6e-8,
            1.0,
            65504.0,
            65520.0,
            1e6,
            3.0e38,
            f32::MAX,
        ] {
            let s = scale_exponent(amax.to_bits());
            let scaled = amax * pow2(s);
            assert!(scaled < 32768.0, "{amax}: 2^{s} gives {scaled}");
            if amax >= 1e-30 {
                assert!(scaled >= 16384.0, "{amax}: 2^{s} wastes range");
            }
            let back = pow2(-s);
            assert_eq!(scaled * back, amax, "{amax}: not exact");
        }
    }

    /// One factor for a whole weight where it converts every element
    /// exactly (infinities aside), none where the elements span too much.
    #[test]
    fn weights_get_one_factor_only_where_it_is_exact() {
        let exact = |v: &[f32]| exact_exponent(&bf(v));
        assert_eq!(exact(&[1.0, -0.75, f32::INFINITY, 0.0]), Some(14));
        assert_eq!(exact(&[1.0, 2f32.powi(-20)]), Some(14));
        // scaled, 2^-14 is f16's smallest normal
        assert_eq!(exact(&[1.0, 2f32.powi(-28)]), Some(14));
        assert_eq!(exact(&[1.0, -(2f32.powi(-29))]), None);
        assert_eq!(exact(&[1e30, 1.0]), None);
        assert_eq!(
            exact(&[1e30, 3e25]),
            Some(scale_exponent(1e30f32.to_bits()))
        );
        // bf16 subnormals: 2^-130 alone, and beside 2^-110
        let (tiny, small) = (f32::from_bits(0x0001_0000), 2f32.powi(-110));
        assert_eq!(exact(&[tiny]), Some(126));
        assert_eq!(exact(&[small, tiny]), Some(scale_exponent(small.to_bits())));
        assert_eq!(exact(&[1e-20, tiny]), None);
        assert_eq!(exact(&[0.0, f32::NAN]), Some(126));
        // f16 weights: a subnormal beside 1.0 becomes normal scaled by 2^14;
        // 1e-4 beside 65504 (scaled by 2^-1) would not
        let h = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| f16::from_f32(x).to_f32()).collect() };
        assert_eq!(exact_exponent(&h(&[1.0, 6e-8])), Some(14));
        assert_eq!(exact_exponent(&h(&[65504.0, 1e-4])), None);
        assert_eq!(exact_exponent(&h(&[65504.0, 1e-3])), Some(-1));
        // what the check admits converts exactly
        for v in [[1.0, 2f32.powi(-20), -3.5], [1e30, 3e25, -7e27]] {
            let s = exact(&v).unwrap();
            for x in bf(&v) {
                let scaled = x * pow2(s);
                assert_eq!(f16::from_f32(scaled).to_f32(), scaled, "{x}");
                assert!(f16::from_f32(scaled).is_normal(), "{x}");
            }
        }
    }

    /// Values near and beyond f16's range, and tiny ones, through the
    /// scheme: within the module comment's bound of the exact product
    /// (where f16 as it is would give inf or 0).
    #[test]
    fn bf16_beyond_f16_range_stays_within_the_bound() {
        let cases: Vec<(Vec<f32>, Vec<f32>)> = vec![
            (vec![70000.0, -1e6, 3.0, 1e-9], vec![2.0, 1e-3, -1e5, 1e9]),
            (
                vec![1e30, 2e30, -1e30, 5.0],
                vec![1e-30, 1e-30, 1e-30, 1e-28],
            ),
            (
                vec![6e-8, 1e-10, -3e-9, 7e-8],
                vec![1e-7, 1e-7, 2e-7, -1e-7],
            ),
            (
                vec![65504.0, 65520.0, 65536.0, -60000.0],
                vec![1.0, 1.0, 1.0, 1.0],
            ),
            (vec![3e38, 1e-38, 1.0, 0.0], vec![1e-38, 3e38, 0.5, 7.0]),
        ];
        for (a, b) in cases {
            let (a, b) = (bf(&a), bf(&b));
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = product(&a, &b) as f64;
            let max = |x: &[f32]| x.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            let k = a.len() as f64;
            // the scheme's bound plus f32 accumulation of k terms
            let bound = k * 2f64.powi(-38) * max(&a) * max(&b)
                + k * f32::EPSILON as f64
                    * a.iter()
                        .zip(&b)
                        .map(|(x, y)| (*x as f64 * *y as f64).abs())
                        .sum::<f64>();
            assert!(
                (got - exact).abs() <= bound,
                "{a:?}·{b:?}: {got} vs {exact} (bound {bound})"
            );
            // converted as they are, these overflow or flush
            let naive: f32 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f16::from_f32(*x).to_f32() * f16::from_f32(*y).to_f32())
                .sum();
            assert!(
                !naive.is_finite() || (naive as f64 - exact).abs() > bound,
                "{a:?}·{b:?}: f16 without scaling would do"
            );
        }
    }
}
