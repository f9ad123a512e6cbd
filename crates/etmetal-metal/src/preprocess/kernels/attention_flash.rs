//! Flash attention on tensor cores in the 16×16 f16 form (NVIDIA GPUs
//! through Vulkan): payload alternatives of the prefill kernel of
//! `attention.rs` for f16 and bf16 attention over head dims 64 and 128
//! (q, k and v alike), one for each variant ([`variants`]) that fits
//! [`MAX_STORAGE`]; the runtime measures them against the portable kernel
//! and keeps the fastest. Where the portable kernel splits the keys over
//! workgroups, these take the same splits and write the same partials,
//! which the combine kernel merges; over a run-time length they take the
//! same row buckets, grid order and end of keys.
//!
//! **16-bit copies.** Pre-passes write q, k and v as f16 (two a word, rows
//! padded to whole [`CHUNK_ROWS`] and zero there), each scaled by a power
//! of two into f16's range: q and k by one factor per head (the largest
//! finite |x| of the head below 2^15), v by one per head and column. Two
//! kernels a copy, both spread over (head, chunk of rows): the first
//! writes each chunk's column maxima, the second reduces them, converts
//! its chunk and (chunk 0) writes the exponents. A per-head factor loses
//! only elements more than 2^28 below the head's largest, whose
//! contributions to a score are that far below the head's largest
//! product: the score's absolute error stays below `d · 2^-27 · max|q| ·
//! max|k|` (the GEMM's bound, `gemm/coop.rs`); per column of v likewise.
//! All variants of one attention share the copies.
//!
//! **Kernel.** A workgroup takes `rows · subgroups` query rows of one
//! batch·head (`rows` 16 or 32: one or two matrices high); each subgroup
//! keeps its rows of q as cooperative matrices (staged once, a matrix a
//! subgroup at a time) and its rows × dv output as f32 accumulators, and
//! the keys go by in tiles of `bc`:
//! 1. the workgroup stages the key and value tiles in workgroup memory
//!    (8 bytes a load; zeros past the end of keys); a prefetching variant
//!    stores them from registers, and loads the next tiles into those
//!    registers as soon as the stores are past the barrier, so their
//!    latency is spent on steps 2–4 rather than before them;
//! 2. each subgroup computes `S = Q·Kᵀ` (rows × bc; each key fragment
//!    loaded once for its matrices) and stores it;
//! 3. the lanes of a row (two at 16 rows, paired by subgroup and lane,
//!    which Vulkan does not tie to the local index; one at 32) turn their
//!    share of the row into scores, held in registers, in log2 units
//!    (`S · scale · log2 e · 2^-(sq + sk)`, masked as the portable kernel
//!    masks), reduce the row's max, and write `P = 2^(x − m)` as f16
//!    scaled by 2^[`P_EXP`], summing it in f32. The reference `m` moves
//!    only when a row's max passes it by more than [`TAU`] (so P stays
//!    below 2^TAU, and f16 holds it); only then are the accumulators
//!    rescaled, through workgroup memory, by every subgroup at once
//!    (rare after the first tiles);
//! 4. each subgroup adds `P·V` into its accumulators (each value fragment
//!    loaded once for its matrices).
//!
//! On an H100 (2026-12-07, BENCHMARKS.md) the 32-row variants were the
//! fastest on both timed rows (their fragments feed twice the products,
//! and no lane waits on another for a row's max); double-buffered tiles,
//! which spared a tile its own two barriers, gained nothing and are not
//! offered.
//!
//! At the end the accumulators go through workgroup memory to the output,
//! divided by the row sums and unscaled per column.

use std::fmt::Write;

use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Result};

use super::{Attn, KeySplit};
use crate::payload::Size;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::coopmat::{CoopForm, CoopMat, Role, SUBGROUP};
use crate::preprocess::emit::{entry, grid, unravel, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::LazyRef;
use crate::preprocess::kernels::gemm::F16_SCALING_WGSL;
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::float_literal;

/// Rows (and columns, and depth) of one cooperative matrix.
const MAT: usize = 16;
/// Rows of a pre-pass workgroup's chunk; the copies' rows are padded to it.
const CHUNK_ROWS: usize = 64;
/// Invocations of a pre-pass workgroup.
const PREPASS: usize = 256;
/// How far (log2 units) a row's max may pass its reference before the
/// accumulators are rescaled: P is below 2^TAU.
const TAU: f64 = 8.0;
/// P is stored as f16 times 2^P_EXP: below 2^(TAU + P_EXP) = 2^15, and
/// kept to 2^-(14 + P_EXP) of its reference where f16 subnormals flush.
const P_EXP: i32 = 7;
/// Workgroup memory a variant may use (what NVIDIA's Vulkan drivers offer).
const MAX_STORAGE: usize = 48 << 10;

/// One shape of the kernel: subgroups a workgroup, keys a tile, query
/// rows a subgroup (one or two matrices high), and whether each invocation
/// loads its share of the next key and value tiles into registers while
/// the current ones are multiplied ([`Variant::prefetches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Variant {
    subgroups: usize,
    bc: usize,
    rows: usize,
    prefetch: bool,
}

/// The tile shapes (subgroups, keys a tile) of the 16-row variants, and of
/// the 32-row ones: each staged key and value fragment then feeds two
/// products, each lane holds a whole row of scores (no exchange between
/// lanes for its max and sum), and a workgroup's tiles serve twice the
/// rows.
const SHAPES: [(usize, usize); 4] = [(4, 64), (4, 32), (2, 64), (2, 32)];
const TALL_SHAPES: [(usize, usize); 3] = [(4, 32), (2, 64), (2, 32)];

/// Every variant, in the order of the payload's alternatives (those that
/// [`fits`] are offered): each 16-row shape, then each prefetching, then
/// the 32-row shapes likewise, so an alternative's index names the same
/// kernel as before the later kinds came.
fn variants() -> impl Iterator<Item = Variant> {
    let kind = |shapes: &'static [(usize, usize)], rows: usize| {
        [false, true].into_iter().flat_map(move |prefetch| {
            shapes.iter().map(move |&(subgroups, bc)| Variant {
                subgroups,
                bc,
                rows,
                prefetch,
            })
        })
    };
    kind(&SHAPES, MAT).chain(kind(&TALL_SHAPES, 2 * MAT))
}

/// 8-byte loads of the next key tile (and of the value tile) an invocation
/// of a prefetching variant holds at most: 16 registers each.
const PREFETCH_LOADS: usize = 8;

impl Variant {
    /// The 8-byte loads of a `cols`-wide tile each invocation makes: the
    /// tile's chunks spread evenly over the workgroup.
    fn loads(self, cols: usize) -> Option<usize> {
        let (chunks, threads) = (self.bc * cols / 4, self.subgroups * SUBGROUP);
        chunks.is_multiple_of(threads).then_some(chunks / threads)
    }

    /// Whether a prefetching variant's registers hold the next tiles of
    /// head dims `dh` and `dv`.
    fn prefetches(self, dh: usize, dv: usize) -> bool {
        [dh, dv]
            .iter()
            .all(|&c| self.loads(c).is_some_and(|n| n <= PREFETCH_LOADS))
    }

    /// Query rows of a workgroup.
    fn block(self) -> usize {
        self.subgroups * self.rows
    }

    /// Lanes sharing a row of scores (1 or 2): a subgroup's lanes over its
    /// rows.
    fn lanes_per_row(self) -> usize {
        SUBGROUP / self.rows
    }
}

/// The most query rows a workgroup of any variant takes (the q copy's
/// padding, so every variant's last block reads inside it).
fn max_rows() -> usize {
    variants().map(Variant::block).max().unwrap_or(MAT)
}

/// Whether attention `a` gets these forms: 16-bit operands of one dtype,
/// head dims 64 or 128.
pub(super) fn applies(a: &Attn) -> bool {
    let d = [a.q.dtype, a.k.dtype, a.v.dtype];
    matches!(d[0], DType::F16 | DType::BF16)
        && d.iter().all(|&t| t == d[0])
        && a.g.e == a.g.ev
        && matches!(a.g.e, 64 | 128)
}

/// Add the variants of prefill dispatch `d` (see the module comment).
pub(super) fn alternatives(
    lw: &mut Lowering,
    a: &Attn,
    d: usize,
    split: &Option<KeySplit>,
    span: usize,
) -> Result<()> {
    let mut copies: Option<[Copy16; 3]> = None;
    let mut variants: Vec<Variant> = variants().filter(|&v| fits(a, v)).collect();
    if !lw.variants() {
        // emulated, one replaces the portable dispatch (software adapters
        // offer 32 KiB of workgroup memory): variant `emulate_variant` of
        // the smallest of each kind, 16-row before 32-row, plain before
        // prefetching (0: 16 rows, loading each tile when it is used; 1:
        // its prefetching twin; 2 and 3: the same with 32 rows)
        variants.sort_by_key(|&v| (v.rows, v.prefetch, storage(a, v)));
        variants.dedup_by_key(|v| (v.rows, v.prefetch));
        if !variants.is_empty() {
            let pick = lw.options.emulate_variant.min(variants.len() - 1);
            variants = vec![variants[pick]];
        }
    }
    for v in variants {
        lw.alternative(d, CoopForm::Half16, |lw| {
            let made = match &copies {
                Some(c) => c.clone(),
                None => {
                    let label = lw.op_label();
                    // the three copies' exponents share a buffer (one binding)
                    let heads =
                        |x: &LazyRef| -> usize { x.shape[..x.shape.len() - 2].iter().product() };
                    let (nq, nk, nv) = (heads(&a.q), heads(&a.k), heads(&a.v) * a.g.ev);
                    let exps =
                        lw.temp(&format!("{label}.exponents16"), DType::I32, &[nq + nk + nv])?;
                    let c = [
                        Copy16::new(
                            lw,
                            &a.q,
                            &format!("{label}.q16"),
                            max_rows(),
                            (exps, 0),
                            false,
                        )?,
                        Copy16::new(
                            lw,
                            &a.k,
                            &format!("{label}.k16"),
                            CHUNK_ROWS,
                            (exps, nq),
                            false,
                        )?,
                        Copy16::new(
                            lw,
                            &a.v,
                            &format!("{label}.v16"),
                            CHUNK_ROWS,
                            (exps, nq + nk),
                            true,
                        )?,
                    ];
                    copies = Some(c.clone());
                    c
                }
            };
            let rows = valid_rows(lw, a)?;
            made[0].convert(lw, &a.q, rows)?;
            made[1].convert(lw, &a.k, a.keys.clone())?;
            made[2].convert(lw, &a.v, a.keys.clone())?;
            kernel(lw, a, v, &made, split, span)
        })?;
    }
    Ok(())
}

/// The pitches (in elements) of a variant's workgroup arrays: the key
/// and value tiles' rows (halves, 16 bytes of padding: the rows a matrix
/// load reads start in different banks), the scores' (f32) and P's.
struct Pitches {
    k: usize,
    v: usize,
    s: usize,
    p: usize,
}

fn pitches(a: &Attn, v: Variant) -> Pitches {
    Pitches {
        k: a.g.e + 8,
        v: a.g.ev + 8,
        s: v.bc + 4,
        p: v.bc + 8,
    }
}

/// Workgroup memory of variant `v` for `a`, in bytes.
fn storage(a: &Attn, v: Variant) -> usize {
    let p = pitches(a, v);
    let rows = v.block();
    let bytes =
        2 * v.bc * (p.k + p.v) + 4 * rows * p.s + 2 * rows * p.p + 4 * (rows + 2 * exchange(v) + 4);
    bytes.next_multiple_of(16)
}

/// The elements of the arrays through which two lanes sharing a row trade
/// their halves' max and sum (none where a lane holds a whole row).
fn exchange(v: Variant) -> usize {
    if v.lanes_per_row() > 1 {
        v.subgroups * SUBGROUP
    } else {
        0
    }
}

/// Whether variant `v` applies to `a`: a round of the block's q rows (one
/// matrix high a subgroup) fits where the key and value tiles go, its
/// workgroup memory fits, and a prefetching variant's registers hold the
/// next tiles.
fn fits(a: &Attn, v: Variant) -> bool {
    let p = pitches(a, v);
    v.subgroups * MAT * p.k <= v.bc * (p.k + p.v)
        && storage(a, v) <= MAX_STORAGE
        && (!v.prefetch || v.prefetches(a.g.e, a.g.ev))
}

/// The run-time query rows, where they are a run-time size.
fn valid_rows(lw: &mut Lowering, a: &Attn) -> Result<Option<Size>> {
    match &a.dynamic {
        Some([_, rows]) if rows.as_const().is_none() => Ok(Some(lw.sizes.size(rows)?)),
        _ => Ok(None),
    }
}

/// A 16-bit copy of an operand `[heads…, rows, cols]` (module comment).
#[derive(Clone)]
struct Copy16 {
    /// `heads × prows × cols` f16, two a word.
    data: BufferIdx,
    /// The exponent of each head (or each head's columns), from element
    /// `exps.1` of buffer `exps.0`.
    exps: (BufferIdx, usize),
    /// Each chunk's column maxima (f32 bits).
    partial: BufferIdx,
    heads: usize,
    rows: usize,
    prows: usize,
    cols: usize,
    per_column: bool,
}

impl Copy16 {
    fn new(
        lw: &mut Lowering,
        x: &LazyRef,
        name: &str,
        pad: usize,
        exps: (BufferIdx, usize),
        per_column: bool,
    ) -> Result<Copy16> {
        let r = x.shape.len();
        let heads: usize = x.shape[..r - 2].iter().product();
        let (rows, cols) = (x.shape[r - 2], x.shape[r - 1]);
        let prows = rows.next_multiple_of(pad).next_multiple_of(CHUNK_ROWS);
        let chunks = prows / CHUNK_ROWS;
        Ok(Copy16 {
            data: lw.temp16(name, &[heads, prows, cols])?,
            exps,
            partial: lw.temp(
                &format!("{name}.maxima"),
                DType::I32,
                &[heads * chunks * cols],
            )?,
            heads,
            rows,
            prows,
            cols,
            per_column,
        })
    }

    fn chunks(&self) -> usize {
        self.prows / CHUNK_ROWS
    }

    /// WGSL lets naming operand `x`'s head `h` (`hi0, hi1, …`) and the
    /// call reading its element `(row, col)`.
    fn reader(x: &LazyRef) -> (String, impl Fn(&str, &str) -> String) {
        let r = x.shape.len();
        let idx = unravel("h", &x.shape[..r - 2]);
        let lets: String = idx
            .iter()
            .enumerate()
            .map(|(d, e)| format!("  let hi{d} = {e};\n"))
            .collect();
        let n = r - 2;
        (lets, move |row: &str, col: &str| {
            let args: Vec<String> = (0..n)
                .map(|d| format!("hi{d}"))
                .chain([row.to_string(), col.to_string()])
                .collect();
            format!("x({})", args.join(", "))
        })
    }

    /// The two dispatches converting `x` (rows from `valid` on read as
    /// zeros: a run-time size's garbage never sets a factor).
    fn convert(&self, lw: &mut Lowering, x: &LazyRef, valid: Option<Size>) -> Result<()> {
        let (rows, cols, chunks) = (self.rows, self.cols, self.chunks());
        let groups = (self.heads * chunks) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        // pass 1: each chunk's column maxima
        let mut kb = KernelBuilder::new(&lw.buffers);
        kb.value_fn(x, "x")?;
        let end = match &valid {
            Some(s) => kb.size(s),
            None => format!("{rows}u"),
        };
        let (lets, at) = Self::reader(x);
        let lanes = PREPASS / cols;
        // (a fixed trip count, rows past the end read clamped and left
        // out, so the compiler can issue the loads together)
        let clamped = format!("min(r, {}u)", rows - 1);
        let mut s = format!("{F16_SCALING_WGSL}var<workgroup> red: array<u32, {PREPASS}>;\n\n");
        s.push_str(&entry(PREPASS as u32));
        let store = kb.store(
            self.partial,
            &format!("g * {cols}u + lid"),
            "bitcast<i32>(m)",
        )?;
        let _ = write!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {groups}u) {{ return; }}\n\
             \x20 let h = g / {chunks}u;\n  let r0 = (g % {chunks}u) * {CHUNK_ROWS}u;\n{lets}\
             \x20 let c = lid % {cols}u;\n  var mx = 0u;\n\
             \x20 for (var i = 0u; i < {}u; i = i + 1u) {{\n\
             \x20   let r = r0 + lid / {cols}u + i * {lanes}u;\n\
             \x20   let bits = finite_bits(vec4<f32>({})).x;\n\
             \x20   mx = max(mx, select(0u, bits, r < {end}));\n  }}\n\
             \x20 red[lid] = mx;\n  workgroupBarrier();\n\
             \x20 if (lid < {cols}u) {{\n    var m = 0u;\n\
             \x20   for (var k = 0u; k < {lanes}u; k = k + 1u) {{ m = max(m, red[k * {cols}u + lid]); }}\n\
             \x20   {store}\n  }}\n}}\n",
            CHUNK_ROWS / lanes,
            at(&clamped, "c")
        );
        let ops = vec![lw.op_label()];
        lw.add_dispatch(
            kb.finish(&s).tagged("amax"),
            ops,
            [PREPASS as u32, 1, 1],
            workgroups,
            (4 * PREPASS) as u32,
        )?;
        // pass 2: the factors, then the chunk converted
        let mut kb = KernelBuilder::new(&lw.buffers);
        kb.value_fn(x, "x")?;
        kb.enable("f16");
        let end = match &valid {
            Some(s) => kb.size(s),
            None => format!("{rows}u"),
        };
        let (lets, at) = Self::reader(x);
        let partial = kb.load(
            self.partial,
            &format!("(h * {chunks}u + k) * {cols}u + lid"),
        );
        let ne = if self.per_column { cols } else { 1 };
        let (exps, first) = self.exps;
        let store_exp = kb.store(exps, &format!("{first}u + h * {ne}u + lid"), "ex[lid]")?;
        let data = kb.halves(self.data)?;
        let at_data = format!("(h * {}u + r) * {cols}u + c", self.prows);
        let store =
            format!("{data}[{at_data}] = f16(v.x);\n    {data}[{at_data} + 1u] = f16(v.y);");
        let half = cols / 2;
        let clamped = format!("min(r, {}u)", rows - 1);
        let (lo, hi) = (at(&clamped, "c"), at(&clamped, "c + 1u"));
        let (flo, fhi) = match self.per_column {
            true => ("ex[c]", "ex[c + 1u]"),
            false => ("ex[0]", "ex[0]"),
        };
        let mut s = format!(
            "{F16_SCALING_WGSL}var<workgroup> colm: array<u32, {cols}>;\nvar<workgroup> ex: array<i32, {cols}>;\n\n"
        );
        s.push_str(&entry(PREPASS as u32));
        let _ = write!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {groups}u) {{ return; }}\n\
             \x20 let h = g / {chunks}u;\n  let chunk = g % {chunks}u;\n  let r0 = chunk * {CHUNK_ROWS}u;\n{lets}\
             \x20 if (lid < {cols}u) {{\n    var m = 0u;\n\
             \x20   for (var k = 0u; k < {chunks}u; k = k + 1u) {{ m = max(m, bitcast<u32>({partial})); }}\n\
             \x20   colm[lid] = m;\n  }}\n  workgroupBarrier();\n"
        );
        if !self.per_column {
            let _ = write!(
                s,
                "  if (lid == 0u) {{\n    var m = 0u;\n\
                 \x20   for (var k = 0u; k < {cols}u; k = k + 1u) {{ m = max(m, colm[k]); }}\n\
                 \x20   colm[0] = m;\n  }}\n  workgroupBarrier();\n"
            );
        }
        let _ = write!(
            s,
            "  if (lid < {ne}u) {{\n    ex[lid] = expo(colm[lid]);\n\
             \x20   if (chunk == 0u) {{ {store_exp} }}\n  }}\n  workgroupBarrier();\n\
             \x20 for (var w = lid; w < {}u; w = w + {PREPASS}u) {{\n\
             \x20   let r = r0 + w / {half}u;\n    let c = 2u * (w % {half}u);\n\
             \x20   let ok = r < {end};\n\
             \x20   let v = select(vec2<f32>(0.0), vec2<f32>({lo} * pow2({flo}), {hi} * pow2({fhi})), ok);\n\
             \x20   {store}\n  }}\n}}\n",
            CHUNK_ROWS * half,
        );
        let ops = vec![lw.op_label()];
        lw.add_dispatch(
            kb.finish(&s).tagged("cvt16"),
            ops,
            [PREPASS as u32, 1, 1],
            workgroups,
            (8 * cols) as u32,
        )
    }
}

/// The linear head of operand `x` (of `shape`, `rep` query heads a head)
/// that batch·head `b` reads, as WGSL over the kernel's `bi` lets.
fn head_of(a: &Attn, shape: &[usize], rep: usize) -> String {
    let args = a.batch_args(shape, rep);
    let dims = &shape[..shape.len() - 2];
    let mut stride = 1;
    let mut terms = vec![];
    for (d, arg) in args.iter().enumerate().rev() {
        if dims[d] > 1 {
            terms.push(format!("({arg}) * {stride}u"));
        }
        stride *= dims[d];
    }
    if terms.is_empty() {
        "0u".into()
    } else {
        terms.join(" + ")
    }
}

/// The kernel of variant `v` over the copies `[q, k, v]`.
fn kernel(
    lw: &mut Lowering,
    a: &Attn,
    v: Variant,
    copies: &[Copy16; 3],
    split: &Option<KeySplit>,
    span: usize,
) -> Result<()> {
    let (l, dh, dv) = (a.g.l, a.g.e, a.g.ev);
    let Variant {
        subgroups,
        bc,
        rows: rs,
        ..
    } = v;
    let (br, lpr) = (v.block(), v.lanes_per_row());
    // matrices a subgroup's rows span
    let mr = rs / MAT;
    let threads = subgroups * SUBGROUP;
    let Pitches {
        k: kp,
        v: vp,
        s: sw,
        p: pw,
    } = pitches(a, v);
    let blocks = l.div_ceil(br);
    let nsplit = split.as_ref().map_or(1, |sp| sp.n);
    let total = a.nb * blocks * nsplit;
    let [cq, ck, cv] = copies;
    let ninf = float_literal(f64::NEG_INFINITY);
    let log2e = float_literal(std::f64::consts::LOG2_E);
    let mut cm = lw.coop_mat(CoopForm::Half16);
    // (q, k and v are read from the copies: only the mask is bound as it is)
    let mut kb = KernelBuilder::new(&lw.buffers);
    if let Some(mask) = &a.mask {
        kb.value_fn(mask, "mask")?;
    }
    cm.enable(&mut kb);
    let (bq, bk, bv) = (
        kb.halves4(cq.data)?,
        kb.halves4(ck.data)?,
        kb.halves4(cv.data)?,
    );
    let (qh, kh, vh) = (
        head_of(a, &a.q.shape, 1),
        head_of(a, &a.k.shape, a.g.k_group),
        head_of(a, &a.v.shape, a.g.v_group),
    );
    let exp_at = |c: &Copy16, i: &str| format!("{}u + {i}", c.exps.1);
    let (eq, ek) = (
        kb.load(cq.exps.0, &exp_at(cq, "qh")),
        kb.load(ck.exps.0, &exp_at(ck, "kh")),
    );
    let ev = kb.load(cv.exps.0, &exp_at(cv, &format!("vh * {dv}u + col")));

    // Every workgroup array is a whole number of 16 bytes (the flag too):
    // a cooperative-matrix load or store needs a 16-byte aligned pointer,
    // and the driver lays the arrays out as it likes. (On an H100 a lone
    // `u32` flag set every array 4 bytes off, and each load read its
    // matrix 2 halves early.)
    let sizes = [
        2 * bc * (kp + vp),
        4 * br * sw,
        2 * br * pw,
        4 * br,
        4 * exchange(v),
    ];
    if let Some(bad) = sizes.iter().find(|&&b| b % 16 != 0) {
        return Err(Error::internal(format!(
            "flash attention: a workgroup array of {bad} bytes breaks the 16-byte alignment"
        )));
    }
    let mut m = String::new();
    let _ = writeln!(
        m,
        "var<workgroup> kv: array<f16, {}>;\nvar<workgroup> sc: array<f32, {}>;\n\
         var<workgroup> pt: array<f16, {}>;\nvar<workgroup> rowa: array<f32, {br}>;\n\
         var<workgroup> resc: array<u32, 4>;",
        bc * (kp + vp),
        br * sw,
        br * pw
    );
    if exchange(v) > 0 {
        let _ = writeln!(
            m,
            "var<workgroup> rm: array<f32, {0}>;\nvar<workgroup> rs: array<f32, {0}>;",
            exchange(v)
        );
    }
    let _ = writeln!(
        m,
        "@compute @workgroup_size({threads})\n\
         fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
         @builtin(local_invocation_index) lid: u32{}) {{",
        cm.params()
    );
    m.push_str(&cm.prologue());
    let kend = a.kend(&mut kb, span, br);
    let _ = write!(
        m,
        "  let g0 = {FLAT_GROUP};\n  if (g0 >= {total}u) {{ return; }}\n\
         \x20 let sp = g0 % {nsplit}u;\n  let g1 = g0 / {nsplit}u;\n  let kbeg = sp * {span}u;\n\
         {}{}\
         \x20 let kend = {kend};\n\
         \x20 let qh = {qh};\n  let kh = {kh};\n  let vh = {vh};\n\
         \x20 let f = unscale({}, {eq}, {ek});\n\
         \x20 let r = sl / {lpr}u;\n  let hf = sl % {lpr}u;\n  let row = sg * {rs}u + r;\n\
         \x20 let lane = sg * {SUBGROUP}u + sl;\n\
         \x20 let gi = i0 + row;\n  let qi = min(gi, {}u);\n",
        a.block_lets("g1", br, blocks),
        a.batch_lets(),
        float_literal(a.scale_factor * std::f64::consts::LOG2_E),
        l - 1
    );
    // q, once: the block's rows staged where the key and value tiles go,
    // one matrix of each subgroup's rows a round (staged row `j` is row
    // `(j / 16) · rs + round · 16 + j % 16` of the block), kept as
    // matrices `qa{round}_{d}`
    for i in 0..mr {
        let at = format!("(j / {MAT}u) * {rs}u + {}u + j % {MAT}u", i * MAT);
        m.push_str(&stage(
            "kv",
            "0u",
            kp,
            subgroups * MAT,
            dh,
            &format!("{bq}[(qh * {}u + i0 + {at}) * {}u + c]", cq.prows, dh / 4),
            "true",
            threads,
        ));
        m.push_str("  workgroupBarrier();\n");
        for d in 0..dh / 16 {
            let ld = cm.load(
                Role::A,
                "kv",
                "f16",
                &format!("sg * {}u + {}u", MAT * kp, d * 16),
                &format!("{kp}u"),
                true,
            );
            let _ = writeln!(m, "  let qa{i}_{d} = {ld};");
        }
        if i + 1 < mr {
            m.push_str("  workgroupBarrier();\n");
        }
    }
    for i in 0..mr {
        for j in 0..dv / 16 {
            let _ = writeln!(m, "  var o{i}_{j} = {};", cm.zero());
        }
    }
    // 1. the key and value tiles (zeros past the end of keys): staged
    // from the copies, or from registers loaded one tile ahead (`loads` a
    // tile an invocation; none where the variant does not prefetch)
    let loads = |cols: usize| -> Result<usize> {
        if !v.prefetch {
            return Ok(0);
        }
        v.loads(cols).ok_or_else(|| {
            Error::internal(format!(
                "flash attention: {v:?} cannot prefetch {cols} columns"
            ))
        })
    };
    let tiles = [
        (&bk, "kh", ck, dh, kp, "0u".to_string(), "nk", loads(dh)?),
        (
            &bv,
            "vh",
            cv,
            dv,
            vp,
            format!("{}u", bc * kp),
            "nv",
            loads(dv)?,
        ),
    ];
    let read = |src: &str, head: &str, copy: &Copy16, cols: usize, t: &str| {
        format!(
            "{src}[({head} * {}u + min({t} + j, {}u)) * {}u + c]",
            copy.prows,
            copy.prows - 1,
            cols / 4
        )
    };
    // (the loads of the tile from key `t` into registers `nk0…`, `nv0…`)
    let fetch = |t: &str| -> String {
        let mut f = String::new();
        for (src, head, copy, cols, _, _, regs, n) in &tiles {
            let per = cols / 4;
            for i in 0..*n {
                let _ = writeln!(
                    f,
                    "  {{\n    let w = lid + {}u;\n    let j = w / {per}u;\n    let c = w % {per}u;\n\
                     \x20   {regs}{i} = select(vec4<f16>(), {}, {t} + j < kend);\n  }}",
                    i * threads,
                    read(src, head, copy, *cols, t)
                );
            }
        }
        f
    };
    if v.prefetch {
        for (_, _, _, _, _, _, regs, n) in &tiles {
            for i in 0..*n {
                let _ = writeln!(m, "  var {regs}{i}: vec4<f16>;");
            }
        }
        m.push_str(&fetch("kbeg"));
    }
    let _ = writeln!(
        m,
        "  var mref = {ninf};\n  var l = 0.0;\n\
         \x20 for (var t0 = kbeg; t0 < kend; t0 = t0 + {bc}u) {{\n\
         \x20   workgroupBarrier();\n    if (lid == 0u) {{ resc[0] = 0u; }}"
    );
    for (src, head, copy, cols, pitch, at, regs, n) in &tiles {
        let (cols, pitch) = (*cols, *pitch);
        if !v.prefetch {
            let read = read(src, head, copy, cols, "t0");
            m.push_str(&indent(
                &stage("kv", at, pitch, bc, cols, &read, "t0 + j < kend", threads),
                2,
            ));
            continue;
        }
        let per = cols / 4;
        for i in 0..*n {
            let _ = writeln!(
                m,
                "    {{\n      let w = lid + {}u;\n      let e = {at} + (w / {per}u) * {pitch}u + 4u * (w % {per}u);\n      {}\n    }}",
                i * threads,
                store4("kv", &format!("{regs}{i}"))
            );
        }
    }
    m.push_str("    workgroupBarrier();\n");
    if v.prefetch {
        // (issued now, they land while the tiles are multiplied)
        m.push_str(&indent(&fetch(&format!("(t0 + {bc}u)")), 2));
    }
    // 2. S = Q·Kᵀ
    // (each key fragment loaded once for the subgroup's `mr` matrices)
    m.push_str("    {\n");
    for i in 0..mr {
        for j in 0..bc / 16 {
            let _ = writeln!(m, "      var s{i}_{j} = {};", cm.zero());
        }
    }
    for d in 0..dh / 16 {
        for j in 0..bc / 16 {
            let ld = cm.load(
                Role::B,
                "kv",
                "f16",
                &format!("{}u", j * 16 * kp + d * 16),
                &format!("{kp}u"),
                false,
            );
            m.push_str(&fragment_products(
                &mut cm,
                (&format!("kb{d}_{j}"), &ld),
                mr,
                |i| (format!("qa{i}_{d}"), format!("s{i}_{j}")),
                6,
            ));
        }
    }
    for i in 0..mr {
        for j in 0..bc / 16 {
            let st = cm.store(
                &format!("s{i}_{j}"),
                "sc",
                &format!("sg * {}u + {}u", rs * sw, i * MAT * sw + j * 16),
                &format!("{sw}u"),
                true,
            );
            let _ = writeln!(m, "      {st}");
        }
    }
    m.push_str("    }\n    workgroupBarrier();\n");
    // 3. scores, the row's max (over the `lpr` lanes of a row), P: each
    // lane's share of its row of scores held in registers (`x0…`) from the scaling to the
    // exponentials, unrolled, rather than written back to the score
    // memory and read again (H100, 2026-12-07: the flash kernel 1.19–1.50×
    // faster in every variant, BENCHMARKS.md)
    let half = bc / lpr;
    let masked = indent(&a.mask("x", "qi", "key", "key < kend", Some(&log2e)), 6);
    let _ = writeln!(m, "    var mx = {ninf};");
    for c in 0..half {
        let _ = writeln!(
            m,
            "    var x{c}: f32;\n    {{\n      let key = t0 + hf * {half}u + {c}u;\n\
             \x20     var x = sc[row * {sw}u + hf * {half}u + {c}u] * f;\n{masked}\
             \x20     x{c} = x;\n      mx = max(mx, x);\n    }}"
        );
    }
    if lpr > 1 {
        m.push_str(
            "    rm[lane] = mx;\n    workgroupBarrier();\n    mx = max(mx, rm[lane ^ 1u]);\n",
        );
    }
    let _ = write!(
        m,
        "    var al = 1.0;\n\
         \x20   if (mx > mref + {}) {{\n\
         \x20     al = exp2(mref - mx);\n      if (mref != {ninf}) {{ resc[0] = 1u; }}\n\
         \x20     l = l * al;\n      mref = mx;\n    }}\n\
         \x20   if (hf == 0u) {{ rowa[row] = al; }}\n\
         \x20   let ms = select(mref, 0.0, mref == {ninf});\n    var sum = 0.0;\n",
        float_literal(TAU)
    );
    for c in (0..half).step_by(2) {
        let _ = writeln!(
            m,
            "    {{\n      let p = exp2(vec2<f32>(x{c}, x{}) - ms);\n      sum = sum + p.x + p.y;\n\
             \x20     let h = vec2<f16>(p * {});\n      let at = row * {pw}u + hf * {half}u + {c}u;\n\
             \x20     pt[at] = h.x;\n      pt[at + 1u] = h.y;\n    }}",
            c + 1,
            float_literal(2f64.powi(P_EXP))
        );
    }
    // (the barrier inside the uniform load also orders rs, pt and rowa)
    let pair_sum = if lpr > 1 {
        m.push_str("    rs[lane] = sum;\n");
        " + rs[lane ^ 1u]"
    } else {
        ""
    };
    let _ = writeln!(
        m,
        "    let rescale = workgroupUniformLoad(&resc[0]);\n    l = l + sum{pair_sum};\n    if (rescale != 0u) {{"
    );
    // (rare) the accumulators rescaled by their rows' factors
    m.push_str(&indent(
        &through_memory(
            &mut cm,
            v,
            dv,
            sw,
            |cols| {
                format!(
                "let a = rowa[row];\nfor (var c = 0u; c < {0}u; c = c + 1u) {{ sc[row * {sw}u + hf * {0}u + c] = sc[row * {sw}u + hf * {0}u + c] * a; }}\n",
                cols / lpr
            )
            },
            true,
        ),
        6,
    ));
    m.push_str("    }\n");
    // 4. O += P·V (each value fragment loaded once for the `mr` matrices)
    for kk in 0..bc / 16 {
        for i in 0..mr {
            let pa = cm.load(
                Role::A,
                "pt",
                "f16",
                &format!("sg * {}u + {}u", rs * pw, i * MAT * pw + kk * 16),
                &format!("{pw}u"),
                true,
            );
            let _ = writeln!(m, "    let pa{i}_{kk} = {pa};");
        }
        for j in 0..dv / 16 {
            let vb = cm.load(
                Role::B,
                "kv",
                "f16",
                &format!("{}u", bc * kp + kk * 16 * vp + j * 16),
                &format!("{vp}u"),
                true,
            );
            m.push_str(&fragment_products(
                &mut cm,
                (&format!("vb{kk}_{j}"), &vb),
                mr,
                |i| (format!("pa{i}_{kk}"), format!("o{i}_{j}")),
                4,
            ));
        }
    }
    m.push_str("  }\n  workgroupBarrier();\n");
    // the output: normalised (or a split's partials), unscaled per column
    let stats = a.store_stats(&mut kb, split, "gi")?;
    let value = format!("unscale(sc[row * {sw}u + hf * HALF + c], {P_EXP}, {ev})");
    let store = a.store_col(&mut kb, split, "gi", "col", "acc")?;
    let _ = writeln!(
        m,
        "  let inv = select(0.0, 1.0 / l, l > 0.0);\n  let m = mref * {};\n\
         \x20 if (hf == 0u && gi < {l}u) {{ {stats} }}",
        float_literal(std::f64::consts::LN_2)
    );
    m.push_str(&through_memory(
        &mut cm,
        v,
        dv,
        sw,
        |cols| {
            let value = value.replace("HALF", &format!("{}u", cols / lpr));
            format!(
            "for (var c = 0u; c < {0}u; c = c + 1u) {{\n  let col = c0 + hf * {0}u + c;\n  let acc = {value};\n  if (gi < {l}u) {{ {store} }}\n}}\n",
            cols / lpr
        )
        },
        false,
    ));
    m.push_str("}\n");
    let built = kb
        .finish(&format!("{F16_SCALING_WGSL}{}{m}", cm.helpers()))
        .tagged(cm.tag());
    let workgroups = grid(total as u64, lw.options.max_workgroups_per_dim)?;
    let splits = (SymExpr::Const(nsplit as i64), nsplit);
    let actual = a.prefill_groups(lw, br, blocks, &[splits])?;
    let ops = vec![lw.op_label()];
    lw.add_dispatch_sized(
        built,
        ops,
        [threads as u32, 1, 1],
        workgroups,
        storage(a, v) as u32,
        actual,
    )
}

/// Statements (indented `by`) loading B matrix `b` (`(name, load)`) once
/// and adding its product with each of a subgroup's `mr` A matrices into
/// an accumulator (`ac(i)`: the A matrix and the accumulator of matrix
/// row `i`).
fn fragment_products(
    cm: &mut CoopMat,
    (b, load): (&str, &str),
    mr: usize,
    ac: impl Fn(usize) -> (String, String),
    by: usize,
) -> String {
    let mut s = format!("let {b} = {load};\n");
    for i in 0..mr {
        let (a, c) = ac(i);
        let product = cm.mma(&a, b, &c);
        let _ = writeln!(s, "{c} = {product};");
    }
    indent(&s, by)
}

/// Statements staging `rows` rows of `cols` halves (row `j`, 4-half chunk
/// `c` read by `read`, zeros where `valid` fails) into workgroup array
/// `dst` from element `at`, rows `pitch` apart, by `threads` invocations.
#[allow(clippy::too_many_arguments)]
fn stage(
    dst: &str,
    at: &str,
    pitch: usize,
    rows: usize,
    cols: usize,
    read: &str,
    valid: &str,
    threads: usize,
) -> String {
    let per = cols / 4;
    format!(
        "  for (var w = lid; w < {}u; w = w + {threads}u) {{\n\
         \x20   let j = w / {per}u;\n    let c = w % {per}u;\n\
         \x20   let x = select(vec4<f16>(), {read}, {valid});\n\
         \x20   let e = {at} + j * {pitch}u + 4u * c;\n    {}\n  }}\n",
        rows * per,
        store4(dst, "x")
    )
}

/// The statement storing the four halves of `x` (a `vec4<f16>`) at
/// elements `e …` of workgroup array `dst`.
fn store4(dst: &str, x: &str) -> String {
    format!(
        "{dst}[e] = {x}.x; {dst}[e + 1u] = {x}.y; {dst}[e + 2u] = {x}.z; {dst}[e + 3u] = {x}.w;"
    )
}

/// Statements moving variant `v`'s output accumulators `o{i}_{j}`
/// through the score memory `v.bc` columns at a time: each round stores
/// them, runs `lanes` (WGSL for the lanes of row `row`, lane `hf` of them,
/// over `cols` columns from column `c0`) and, when `back`, loads them
/// again.
fn through_memory(
    cm: &mut CoopMat,
    v: Variant,
    dv: usize,
    sw: usize,
    lanes: impl Fn(usize) -> String,
    back: bool,
) -> String {
    let mut s = String::new();
    let bc = v.bc;
    let per = bc / 16;
    // each stored matrix `o{i}_{j}`, at column `x` of the round's
    let at = |i: usize, x: usize| format!("sg * {}u + {}u", v.rows * sw, i * MAT * sw + x * 16);
    for round in 0..dv.div_ceil(bc) {
        let cols = bc.min(dv - round * bc);
        let mats: Vec<(usize, usize, usize)> = (0..v.rows / MAT)
            .flat_map(|i| {
                (round * per..round * per + cols / 16)
                    .enumerate()
                    .map(move |(x, j)| (i, x, j))
            })
            .collect();
        let _ = writeln!(s, "{{\n  let c0 = {}u;", round * bc);
        for &(i, x, j) in &mats {
            let st = cm.store(
                &format!("o{i}_{j}"),
                "sc",
                &at(i, x),
                &format!("{sw}u"),
                true,
            );
            let _ = writeln!(s, "  {st}");
        }
        s.push_str("  workgroupBarrier();\n");
        s.push_str(&indent(&lanes(cols), 2));
        s.push_str("  workgroupBarrier();\n");
        if back {
            for &(i, x, j) in &mats {
                let ld = cm.load(Role::C, "sc", "f32", &at(i, x), &format!("{sw}u"), true);
                let _ = writeln!(s, "  o{i}_{j} = {ld};");
            }
            s.push_str("  workgroupBarrier();\n");
        }
        s.push_str("}\n");
    }
    s
}

fn indent(s: &str, by: usize) -> String {
    let pad = " ".repeat(by);
    s.lines().map(|line| format!("{pad}{line}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::super::super::testing::{input, lower_one_with};
    use crate::preprocess::coopmat::CoopForm;
    use crate::preprocess::options::PreprocessOptions;
    use etmetal_core::{DType, Op};

    /// The WGSL of each flash kernel of a bf16 prefill of head dim `d`
    /// (`emulate`: the emulated forms, variant `variant`), in the order of
    /// the prefill dispatch's alternatives.
    fn flash_kernels(d: usize, emulate: Option<usize>) -> Vec<String> {
        let options = PreprocessOptions {
            emulate_coop: emulate.map(|_| CoopForm::Half16),
            emulate_variant: emulate.unwrap_or(0),
            ..PreprocessOptions::default()
        };
        let op = Op::Sdpa {
            is_causal: true,
            scale: None,
            enable_gqa: true,
        };
        let b = DType::BF16;
        let operands = vec![
            input(b, &[1, 8, 256, d]),
            input(b, &[1, 2, 256, d]),
            input(b, &[1, 2, 256, d]),
        ];
        let p = lower_one_with(op, operands, &options).unwrap().payload;
        let alts = p.dispatches.iter().flat_map(|d| &d.alternatives);
        p.dispatches
            .iter()
            .chain(alts.flat_map(|a| &a.dispatches))
            .map(|d| &p.kernels[d.kernel])
            .filter(|k| k.name.ends_with("sdpa_coop") || k.name.ends_with("sdpa_coopemu"))
            .map(|k| k.wgsl.clone())
            .collect()
    }

    /// Head dim 64 offers the four 16-row tile shapes and three
    /// prefetching twins (the fourth, 2 subgroups over 64 keys, would hold
    /// 16 loads a tile), then the three 32-row shapes and two twins; 128
    /// the shapes within the workgroup memory likewise. A prefetching
    /// kernel loads the next tiles into registers after the barrier that
    /// follows their stores, and only it does; a 32-row kernel keeps two
    /// matrices of q a subgroup, and only it does.
    #[test]
    fn variants_in_the_order_of_the_alternatives() {
        let (f, t) = (false, true);
        for (d, kinds) in [
            (
                64,
                vec![(f, f), (f, f), (f, f), (f, f), (t, f), (t, f), (t, f)],
            ),
            (128, vec![(f, f), (f, f), (f, f), (t, f)]),
        ] {
            let tall = match d {
                64 => vec![(f, t), (f, t), (f, t), (t, t), (t, t)],
                _ => vec![(f, t), (f, t), (t, t)],
            };
            let want: Vec<(bool, bool)> = kinds.into_iter().chain(tall).collect();
            let wgsl = flash_kernels(d, None);
            let got: Vec<(bool, bool)> = wgsl
                .iter()
                .map(|w| (w.contains("var nk0"), w.contains("qa1_0")))
                .collect();
            assert_eq!(got, want, "head dim {d}: (prefetching, 32 rows)");
            for w in wgsl.iter().filter(|w| w.contains("var nk0")) {
                let stores = w.find("kv[e] = nk0.x").expect("stores from registers");
                let next = w.find("(t0 + ").expect("the next tile's loads");
                assert!(
                    stores < next,
                    "head dim {d}: next tile loaded after the stores"
                );
            }
            // two lanes share a row's scores only in the 16-row kernels
            for (w, (_, tall)) in wgsl.iter().zip(&got) {
                assert_eq!(w.contains("rm[lane ^ 1u]"), !tall, "head dim {d}");
            }
        }
        // emulated: the smallest of each kind, 16-row before 32-row,
        // plain before prefetching
        for (variant, want) in [(0, (f, f)), (1, (t, f)), (2, (f, t)), (3, (t, t))] {
            let [w] = &flash_kernels(64, Some(variant))[..] else {
                panic!("one emulated kernel")
            };
            let got = (w.contains("var nk0"), w.contains("qa1_0"));
            assert_eq!(got, want, "emulated variant {variant}");
        }
    }
}
