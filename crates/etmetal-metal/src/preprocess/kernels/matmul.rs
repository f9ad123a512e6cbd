//! Matrix products — `matmul` (1-D operands, batch broadcasting; mm, bmm),
//! `addmm` and `linear` — as one register-tiled GEMM kernel ([`Gemm`]), or,
//! for at most 8 rows per batch against a `k`-contiguous right operand (a
//! decode step's linear layers), a matrix-vector kernel ([`Gemv`]) that
//! reads the weight once in coalesced 4-element chunks.
//!
//! Operands are lazy views, so `weight.T`, permutes and expands are index
//! arithmetic in the tile loads. Each workgroup computes a `bm × bn` tile
//! of one batch's output; `k` is walked in `bk`-deep slices staged in
//! workgroup memory (two stages, the next slice read into registers while
//! the current one is multiplied), and each invocation keeps a `tm × tn`
//! block of accumulators (f32) in registers, reading the staged slices as
//! `vec4`s. The tile is the largest of 128×128, 64×64 and 32×32 that still
//! gives a large GPU enough workgroups, or a 16-wide one for skinny
//! products; when even that leaves too few workgroups and `k` is deep, `k`
//! is split among workgroups and a second kernel adds the partial sums
//! ([`Split`]). The bias and `alpha`/`beta` are applied in the store (the
//! epilogue; 16-bit outputs are rounded there). [`super::conv`] reuses
//! [`Gemm`] for convolution as an implicit GEMM. Products of f16 or bf16
//! operands large enough also get a tensor-core form ([`super::coop`]) as a
//! payload alternative, which the runtime runs where the device offers it.

use std::fmt::Write;

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::coop::{self, Range};
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::emit::{
    entry, expanded_index, grid, linear, unravel, Built, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP,
};
use crate::preprocess::expr::{Kind, Lazy, LazyRef};
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::Lowering;

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let (a, b, bias, alpha, beta) = match &node.op {
        Op::MatMul => (
            lw.input_view(node, 0)?,
            lw.input_view(node, 1)?,
            None,
            1.0,
            0.0,
        ),
        Op::Addmm { beta, alpha } => (
            lw.input_view(node, 1)?,
            lw.input_view(node, 2)?,
            Some(lw.input_view(node, 0)?),
            *alpha,
            *beta,
        ),
        Op::Linear => {
            let w = lw.input_view(node, 1)?;
            if w.shape.len() != 2 {
                return Err(Error::invalid_input(format!(
                    "linear weight {:?} is not [out, in]",
                    w.shape
                )));
            }
            let wt = Lazy::new(
                w.dtype,
                vec![w.shape[1], w.shape[0]],
                Kind::Permute(w, vec![1, 0]),
            );
            (
                lw.input_view(node, 0)?,
                wt,
                lw.optional_input_view(node, 2)?,
                1.0,
                1.0,
            )
        }
        other => {
            return Err(Error::internal(format!(
                "{} is not a matrix product",
                other.name()
            )))
        }
    };
    if a.shape.is_empty() || b.shape.is_empty() {
        return Err(Error::invalid_input(format!(
            "matrix product operands need at least 1 dim, got {:?} and {:?}",
            a.shape, b.shape
        )));
    }
    let (ra, rb) = (a.shape.len(), b.shape.len());
    // a 1-D left operand is a row, a 1-D right operand a column
    let a = if ra == 1 {
        let k = a.shape[0];
        Lazy::new(a.dtype, vec![1, k], Kind::Expand(a))
    } else {
        a
    };
    let b = if rb == 1 {
        let k = b.shape[0];
        reshaped(&b, vec![k, 1])
    } else {
        b
    };
    // a batched left operand times a matrix: the batch is more rows
    let a = if a.shape.len() > 2 && b.shape.len() == 2 {
        let k = a.shape[a.shape.len() - 1];
        reshaped(&a, vec![a.shape.iter().product::<usize>() / k.max(1), k])
    } else {
        a
    };
    let (m, k) = (a.shape[a.shape.len() - 2], a.shape[a.shape.len() - 1]);
    let (k2, n) = (b.shape[b.shape.len() - 2], b.shape[b.shape.len() - 1]);
    if k != k2 {
        return Err(Error::invalid_input(format!(
            "operands {:?} and {:?} cannot be multiplied ({k} != {k2})",
            a.shape, b.shape
        )));
    }
    let batch = broadcast_shapes(&a.shape[..a.shape.len() - 2], &b.shape[..b.shape.len() - 2])?;
    let full = |x: LazyRef, rows: usize, cols: usize| -> LazyRef {
        let shape = [batch.clone(), vec![rows, cols]].concat();
        if x.shape == shape {
            x
        } else {
            Lazy::new(x.dtype, shape, Kind::Expand(x))
        }
    };
    let a = full(a, m, k);
    let b = full(b, k, n);
    // PyTorch ignores the bias (NaN included) when beta is 0
    let bias = match bias {
        Some(x) if beta != 0.0 => Some(full(x, m, n)),
        _ => None,
    };
    let out = lw.output_buffer(node, 0)?;
    let out_dtype = lw.buffers.list[out].dtype;
    let floats = [Some(&a), Some(&b), bias.as_ref()]
        .into_iter()
        .flatten()
        .all(|x| x.dtype.is_float());
    if !floats || !out_dtype.is_float() {
        return Err(Error::unsupported(
            "matrix products of integers on the GPU (float dtypes only)",
        ));
    }
    let numel: usize = batch.iter().product::<usize>() * m * n;
    if lw.buffers.list[out].numel() != numel {
        return Err(Error::internal(format!(
            "output {:?} does not hold the {numel} elements of the product",
            lw.buffers.list[out].shape
        )));
    }

    let batches: usize = batch.iter().product();
    let at = |bt: &str, rest: &[&str]| -> String {
        let mut idx = unravel(bt, &batch);
        idx.extend(rest.iter().map(|s| s.to_string()));
        idx.join(", ")
    };
    // the store: bias, alpha/beta and rounding to the output dtype
    let epilogue = |kb: &mut KernelBuilder| -> Result<String> {
        let mut value = if alpha == 1.0 {
            "v".to_string()
        } else {
            format!("{} * v", float_literal(alpha))
        };
        if let Some(bias) = &bias {
            kb.value_fn(bias, "vbias")?;
            let read = format!("vbias({})", at("bt", &["r", "c"]));
            value = if beta == 1.0 {
                format!("{read} + {value}")
            } else {
                format!("{} * {read} + {value}", float_literal(beta))
            };
        }
        let e = linear(&["bt".into(), "r".into(), "c".into()], &[batches, m, n]);
        let value = cast(&format!("({value})"), DType::F32, out_dtype);
        let store = kb.store(out, "e", &value)?;
        Ok(format!(
            "fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n  let e = {e};\n  {store}\n}}\n\n"
        ))
    };

    if m <= GEMV_ROWS && is_transpose(&b) {
        let gemv = Gemv {
            batch: batches,
            m,
            n,
            k,
        };
        return gemv.lower(
            lw,
            |kb| {
                let fns = chunk_reader(kb, &a, "xa", &batch, false)?;
                Ok(fns + &chunk_reader(kb, &b, "xb", &batch, true)?)
            },
            epilogue,
        );
    }
    let gemm = Gemm {
        batch: batches,
        m,
        n,
        k,
        a_k_fast: !is_transpose(&a),
        b_k_fast: is_transpose(&b),
        coop: Range::of(lw, &a)
            .zip(Range::of(lw, &b))
            .map(|(x, y)| [x, y]),
    };
    let operands = |kb: &mut KernelBuilder, reads: Reads| -> Result<String> {
        if reads == Reads::Chunks {
            let fns = chunk_reader(kb, &a, "ca", &batch, !gemm.a_k_fast)?;
            return Ok(fns + &chunk_reader(kb, &b, "cb", &batch, gemm.b_k_fast)?);
        }
        kb.value_fn(&a, "va")?;
        kb.value_fn(&b, "vb")?;
        let mut fns = String::new();
        let _ = writeln!(
            fns,
            "fn ga(bt: u32, r: u32, k: u32) -> f32 {{ return va({}); }}",
            at("bt", &["r", "k"])
        );
        let _ = writeln!(
            fns,
            "fn gb(bt: u32, k: u32, c: u32) -> f32 {{ return vb({}); }}",
            at("bt", &["k", "c"])
        );
        Ok(fns)
    };
    gemm.lower(lw, operands, epilogue)
}

/// Emit `fn name(bt: u32, j: u32, k: u32) -> vec4<f32>`: elements `k … k+3`
/// (`k` a multiple of 4, zeros past the end) of row `j` of a product's
/// `[batch…, rows, K]` left operand `x`, or of column `j` of its
/// `[batch…, K, cols]` right operand (`column`). A contiguous run of a
/// buffer is read in one vector load, anything else element by element.
fn chunk_reader(
    kb: &mut KernelBuilder,
    x: &LazyRef,
    name: &str,
    batch: &[usize],
    column: bool,
) -> Result<String> {
    let r = x.shape.len();
    let kdim = x.shape[if column { r - 2 } else { r - 1 }];
    let idx = |k: &str| -> Vec<String> {
        let mut idx = unravel("bt", batch);
        if column {
            idx.extend([k.to_string(), "j".to_string()]);
        } else {
            idx.extend(["j".to_string(), k.to_string()]);
        }
        idx
    };
    let body = match k_run(x, &idx("k")) {
        Some((buf, at, shape)) if kdim.is_multiple_of(4) => {
            let c = format!("({}) / 4u", linear(&at, &shape));
            format!("return {};", kb.load4(buf, &c)?)
        }
        _ => {
            let f = format!("v{name}");
            kb.value_fn(x, &f)?;
            let lanes: Vec<String> = (0..4)
                .map(|i| {
                    let ki = format!("min(k + {i}u, {}u)", kdim - 1);
                    let call = format!("{f}({})", idx(&ki).join(", "));
                    if kdim.is_multiple_of(4) || i == 0 {
                        call
                    } else {
                        format!("select(0.0, {call}, k + {i}u < {kdim}u)")
                    }
                })
                .collect();
            format!("return vec4<f32>({});", lanes.join(", "))
        }
    };
    Ok(format!(
        "fn {name}(bt: u32, j: u32, k: u32) -> vec4<f32> {{\n  {body}\n}}\n\n"
    ))
}

/// Where `x` read at `idx` lies in a buffer, when `x` only permutes and
/// broadcasts that buffer and the index named `k` walks its last,
/// contiguous dim: the buffer, the index there and the shape it is read as.
fn k_run(x: &LazyRef, idx: &[String]) -> Option<(BufferIdx, Vec<String>, Vec<usize>)> {
    match &x.kind {
        Kind::Load(buf) => (idx.last().map(String::as_str) == Some("k"))
            .then(|| (*buf, idx.to_vec(), x.shape.clone())),
        Kind::Permute(inner, dims) => {
            let mut at = vec![String::new(); dims.len()];
            for (i, &d) in dims.iter().enumerate() {
                at[d] = idx[i].clone();
            }
            k_run(inner, &at)
        }
        Kind::Expand(inner) => k_run(inner, &expanded_index(idx, &inner.shape)),
        _ => None,
    }
}

/// `x` with the same elements in row-major order under `shape` (a load of
/// a contiguous buffer stays a plain load).
pub(super) fn reshaped(x: &LazyRef, shape: Vec<usize>) -> LazyRef {
    if x.shape == shape {
        return x.clone();
    }
    match x.kind {
        Kind::Load(buf) => Lazy::new(x.dtype, shape, Kind::Load(buf)),
        _ => Lazy::new(x.dtype, shape, Kind::Reshape(x.clone())),
    }
}

/// Whether `x` reads its last two dims swapped (a transposed matrix), so a
/// tile is best loaded along its second-last dim.
fn is_transpose(x: &LazyRef) -> bool {
    match &x.kind {
        Kind::Permute(_, dims) => {
            let r = dims.len();
            r >= 2 && dims[r - 2] == r - 1 && dims[r - 1] == r - 2
        }
        Kind::Expand(inner) => is_transpose(inner),
        _ => false,
    }
}

/// One batched product `C[bt, r, c] = Σ_k A[bt, r, k] · B[bt, k, c]` as a
/// kernel. The caller's WGSL reads the operands as [`Reads`] asks and, in
/// the store's WGSL, defines `gstore(bt, r, c, v)`. When its tiles are too
/// few for a large GPU and `k` is deep, `k` is split among workgroups
/// ([`split_k`]).
pub(super) struct Gemm {
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
    /// ([`coop`]); `None`: the portable kernel only.
    pub coop: Option<[Range; 2]>,
}

/// What the operand functions a GEMM kernel calls are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reads {
    /// `ga(bt, r, k) -> f32` and `gb(bt, k, c) -> f32`, called with
    /// in-range indices only.
    Elements,
    /// `ca(bt, j, q) -> vec4<f32>` and `cb(bt, j, q)`: the four elements
    /// from `q` (a multiple of 4) along the operand's contiguous dim (k
    /// where `a_k_fast`/`b_k_fast`, else A's rows or B's columns), `j`
    /// the other index; zeros past the end of that dim.
    Chunks,
}

/// Tile sizes: a workgroup computes `bm × bn` outputs, `(bm/tm)·(bn/tn)`
/// invocations each `tm × tn`, over `bk`-deep slices of k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tile {
    bm: usize,
    bn: usize,
    bk: usize,
    tm: usize,
    tn: usize,
}

impl Tile {
    fn threads(&self) -> usize {
        (self.bm / self.tm) * (self.bn / self.tn)
    }

    /// Vector width of an invocation's rows (columns): its `tm` rows are
    /// `tm / wm` runs of `wm` adjacent rows, read from workgroup memory as
    /// one `vec4` (or scalar) each.
    fn widths(&self) -> (usize, usize) {
        let w = |t: usize| if t.is_multiple_of(4) { 4 } else { 1 };
        (w(self.tm), w(self.tn))
    }

    /// Words of one stage of the staged A and B slices.
    fn stage_words(&self) -> (usize, usize) {
        (self.bk * self.bm, self.bk * self.bn)
    }
}

/// Workgroups below which a tile is too big to fill a large GPU (an H200
/// runs two 256-invocation 128×128 workgroups on each of its 132 units).
/// Measured there in one run: 4096³ is fastest on 128×128 tiles (24.0 ms;
/// 128×64: 29.1, 64×64: 35.1), 1024³ on 64×64 (0.113 ms; 128×128: 0.166),
/// 512³ on 32×32 (0.034 ms; 64×64: 0.040).
pub(super) const FILL: u64 = 256;

impl Gemm {
    fn tile(&self) -> Tile {
        let (m, n) = (self.m, self.n);
        let groups =
            |bm: usize, bn: usize| (m.div_ceil(bm) * n.div_ceil(bn)) as u64 * self.batch as u64;
        let t = |bm, bn, bk, tm, tn| Tile { bm, bn, bk, tm, tn };
        if m <= 16 && n > m {
            // matrix-vector-like: few rows, many columns per workgroup
            t(16, 64, 16, 1, 4)
        } else if n <= 16 && m > n {
            t(64, 16, 16, 4, 1)
        } else if m >= 128 && n >= 128 && groups(128, 128) >= FILL {
            t(128, 128, 8, 8, 8)
        } else if groups(64, 64) >= FILL {
            t(64, 64, 16, 8, 4)
        } else {
            t(32, 32, 16, 4, 4)
        }
    }

    /// Validate and append the kernel(s): `operands` (asked for
    /// [`Reads::Elements`], and [`Reads::Chunks`] for the tensor-core
    /// alternative) and `store` emit the operand and store functions
    /// (returning their WGSL), then the tiled main follows.
    pub fn lower(
        &self,
        lw: &mut Lowering,
        operands: impl Fn(&mut KernelBuilder, Reads) -> Result<String>,
        store: impl Fn(&mut KernelBuilder) -> Result<String>,
    ) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            // nothing to write
            return Ok(());
        }
        let t = self.tile();
        let tiles = self.m.div_ceil(t.bm) as u64 * self.n.div_ceil(t.bn) as u64;
        let splits = split_k(tiles * self.batch as u64, FILL, self.k, t.bk * 8, t.bk);
        let split = Split::new(lw, splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let fns = operands(&mut kb, Reads::Elements)? + &split.store(&mut kb, &store)?;
        let main = format!("{fns}\n{}", self.main(&t, splits));
        let built: Built = kb.finish(&main);
        let groups = tiles * (self.batch * splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let (sa, sb) = t.stage_words();
        // two stages: the next slice is written while this one is read
        let storage = (2 * 4 * (sa + sb)) as u32;
        let ops = vec![lw.op_label()];
        let d = lw.dispatches.len();
        lw.add_dispatch(built, ops, [t.threads() as u32, 1, 1], workgroups, storage)?;
        if coop::worth(self) {
            // the same partial sums or outputs, from the same split of k
            lw.alternative(d, coop::NEEDS, |lw| {
                coop::lower(lw, self, splits, &|kb| operands(kb, Reads::Chunks), &|kb| {
                    split.store(kb, &store)
                })
            })?;
        }
        split.sum(lw, &store)
    }

    /// `ca`/`cb` ([`Reads::Chunks`]) as four calls of `ga`/`gb`, for
    /// operands with no faster chunk reader.
    pub fn element_chunks(&self) -> String {
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

    /// The kernel's main. Invocation `(ty, tx)` owns rows
    /// `g·(bm·wm/tm) + ty·wm + i` and columns `h·(bn·wn/tn) + tx·wn + j`, so
    /// its reads of a staged k-row are `tm/wm + tn/wn` vector loads shared
    /// by neighbours (broadcasts, no bank conflicts). Slices of k are staged
    /// in two alternating halves of workgroup memory (A transposed: k-major)
    /// and the next slice's global reads are issued into registers before
    /// the current one is multiplied, so one barrier per slice suffices and
    /// memory latency hides behind the FMAs.
    fn main(&self, t: &Tile, splits: usize) -> String {
        let Tile { bm, bn, bk, tm, tn } = *t;
        let threads = t.threads();
        let (wm, wn) = t.widths();
        let (m, n, k) = (self.m, self.n, self.k);
        let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
        let tiles = tiles_m * tiles_n;
        let per = tiles * self.batch;
        let (gm, gn) = (tm / wm, tn / wn);
        // rows (columns) between an invocation's runs, and vectors per k-row
        let (rg, cg) = (bm / gm, bn / gn);
        let (va, vb) = (bm / wm, bn / wn);
        let (sa, sb) = t.stage_words();
        let vty = |w: usize| if w == 4 { "vec4<f32>" } else { "f32" };
        let lane = |x: &str, w: usize, i: usize| {
            if w == 4 {
                format!("{x}[{i}]")
            } else {
                x.to_string()
            }
        };
        // k per split (a multiple of bk when split)
        let nt = (k / splits).div_ceil(bk);
        let mut s = String::new();
        let _ = writeln!(s, "var<workgroup> ta: array<{}, {}>;", vty(wm), 2 * sa / wm);
        let _ = writeln!(s, "var<workgroup> tb: array<{}, {}>;", vty(wn), 2 * sb / wn);
        let _ = writeln!(
            s,
            "@compute @workgroup_size({threads})\n\
             fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
             @builtin(local_invocation_index) lid: u32) {{"
        );
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let ks = g / {per}u;\n  let sb = g / {tiles}u;\n\
             \x20 let bt = sb % {}u;\n  let tile = g % {tiles}u;\n\
             \x20 let kbase = ks * {}u;\n\
             \x20 let m0 = (tile / {tiles_n}u) * {bm}u;\n  let n0 = (tile % {tiles_n}u) * {bn}u;\n\
             \x20 let tx = lid % {}u;\n  let ty = lid / {}u;",
            per * splits,
            self.batch,
            k / splits,
            bn / tn,
            bn / tn,
        );
        for i in 0..tm {
            for h in 0..gn {
                let _ = writeln!(s, "  var c{i}_{h} = {}(0.0);", vty(wn));
            }
        }
        // the elements of a slice each invocation reads: element
        // e = lid + j·threads of the tile, walked k-fastest when the operand
        // is adjacent along k (coalesced reads)
        let per_a = bm * bk / threads;
        let per_b = bn * bk / threads;
        let coords = |e: &str, k_fast: bool, len: usize| -> (String, String) {
            if k_fast {
                (format!("({e}) / {bk}u"), format!("({e}) % {bk}u"))
            } else {
                (format!("({e}) % {len}u"), format!("({e}) / {len}u"))
            }
        };
        // bounds checks only where the tile can overhang
        let check = |idx: &str, len: usize, tile: usize| -> Option<(String, String)> {
            (!len.is_multiple_of(tile)).then(|| {
                (
                    format!("{idx} < {len}u"),
                    format!("min({idx}, {}u)", len - 1),
                )
            })
        };
        let read = |s: &mut String, k0: &str| {
            for j in 0..per_a {
                let (r, kk) = coords(&format!("lid + {}u", j * threads), self.a_k_fast, bm);
                let gr = format!("(m0 + {r})");
                let gk = format!("({k0} + {kk})");
                let _ = writeln!(
                    s,
                    "    {}",
                    guarded(
                        &format!("pa{j}"),
                        "ga",
                        &[
                            ("bt".into(), None),
                            (gr.clone(), check(&gr, m, bm)),
                            (gk.clone(), check(&gk, k, bk))
                        ]
                    )
                );
            }
            for j in 0..per_b {
                let (c, kk) = coords(&format!("lid + {}u", j * threads), self.b_k_fast, bn);
                let gc = format!("(n0 + {c})");
                let gk = format!("({k0} + {kk})");
                let _ = writeln!(
                    s,
                    "    {}",
                    guarded(
                        &format!("pb{j}"),
                        "gb",
                        &[
                            ("bt".into(), None),
                            (gk.clone(), check(&gk, k, bk)),
                            (gc.clone(), check(&gc, n, bn))
                        ]
                    )
                );
            }
        };
        let write = |s: &mut String, stage: &str| {
            for (name, per, k_fast, len, w, v, arr) in [
                ("pa", per_a, self.a_k_fast, bm, wm, va, "ta"),
                ("pb", per_b, self.b_k_fast, bn, wn, vb, "tb"),
            ] {
                for j in 0..per {
                    let (r, kk) = coords(&format!("lid + {}u", j * threads), k_fast, len);
                    let at = format!("{stage} * {}u + ({kk}) * {v}u + ({r}) / {w}u", v * bk);
                    let dst = if w == 4 {
                        format!("{arr}[{at}][({r}) % 4u]")
                    } else {
                        format!("{arr}[{at}]")
                    };
                    let _ = writeln!(s, "    {dst} = {name}{j};");
                }
            }
        };
        if nt > 0 {
            for j in 0..per_a {
                let _ = writeln!(s, "  var pa{j} = 0.0;");
            }
            for j in 0..per_b {
                let _ = writeln!(s, "  var pb{j} = 0.0;");
            }
            s.push_str("  {\n");
            read(&mut s, "kbase");
            write(&mut s, "0u");
            s.push_str("  }\n  workgroupBarrier();\n");
            let _ = writeln!(s, "  for (var t = 0u; t < {nt}u; t = t + 1u) {{");
            s.push_str("    let cur = t & 1u;\n    let more = t + 1u < ");
            let _ = writeln!(s, "{nt}u;\n    if (more) {{");
            read(&mut s, &format!("kbase + (t + 1u) * {bk}u"));
            s.push_str("    }\n");
            let _ = writeln!(
                s,
                "    let oa = cur * {}u + ty;\n    let ob = cur * {}u + tx;",
                va * bk,
                vb * bk
            );
            for kk in 0..bk {
                s.push_str("    {\n");
                for g in 0..gm {
                    let _ = writeln!(s, "    let a{g} = ta[oa + {}u];", kk * va + g * rg / wm);
                }
                for h in 0..gn {
                    let _ = writeln!(s, "    let b{h} = tb[ob + {}u];", kk * vb + h * cg / wn);
                }
                for i in 0..tm {
                    let a = lane(&format!("a{}", i / wm), wm, i % wm);
                    let a = if wn == 4 {
                        format!("vec4<f32>({a})")
                    } else {
                        a
                    };
                    for h in 0..gn {
                        let _ = writeln!(s, "    c{i}_{h} = fma({a}, b{h}, c{i}_{h});");
                    }
                }
                s.push_str("    }\n");
            }
            s.push_str("    if (more) {\n");
            write(&mut s, "(1u - cur)");
            s.push_str("    }\n    workgroupBarrier();\n  }\n");
        }
        for i in 0..tm {
            let _ = writeln!(
                s,
                "  let r{i} = m0 + ty * {wm}u + {}u;",
                (i / wm) * rg + i % wm
            );
        }
        for j in 0..tn {
            let _ = writeln!(
                s,
                "  let q{j} = n0 + tx * {wn}u + {}u;",
                (j / wn) * cg + j % wn
            );
        }
        for i in 0..tm {
            for j in 0..tn {
                let v = lane(&format!("c{i}_{}", j / wn), wn, j % wn);
                let _ = writeln!(
                    s,
                    "  if (r{i} < {m}u && q{j} < {n}u) {{ gstore(sb, r{i}, q{j}, {v}); }}"
                );
            }
        }
        s.push_str("}\n");
        s
    }
}

/// Ways to split `k` among workgroups when `groups` fall short of `fill`:
/// the fewest of 2, 4, 8 that fill the GPU (else the most) whose parts are
/// whole multiples of `align` and at least `min_depth` deep; 1 when none.
fn split_k(groups: u64, fill: u64, k: usize, min_depth: usize, align: usize) -> usize {
    let mut best = 1;
    if groups >= fill {
        return best;
    }
    for s in [2, 4, 8] {
        if k.is_multiple_of(s * align) && k / s >= min_depth {
            best = s;
            if groups * s as u64 >= fill {
                break;
            }
        }
    }
    best
}

/// The store side of a product split `splits` ways along `k`: each
/// workgroup writes its partial sums to `[splits·batch, m, n]` (split-major)
/// and a second kernel adds them up and applies the caller's store.
struct Split {
    parts: Option<BufferIdx>,
    splits: usize,
    batch: usize,
    m: usize,
    n: usize,
}

impl Split {
    fn new(lw: &mut Lowering, splits: usize, batch: usize, m: usize, n: usize) -> Result<Split> {
        let parts = (splits > 1)
            .then(|| {
                let name = format!("{}.split_k", lw.op_label());
                lw.temp(&name, DType::F32, &[splits * batch, m, n])
            })
            .transpose()?;
        Ok(Split {
            parts,
            splits,
            batch,
            m,
            n,
        })
    }

    /// The product kernel's `gstore(sb, r, c, v)` (`sb`: split · batch +
    /// batch index): the caller's when not split, else a partial store.
    fn store(
        &self,
        kb: &mut KernelBuilder,
        store: &impl Fn(&mut KernelBuilder) -> Result<String>,
    ) -> Result<String> {
        let Some(parts) = self.parts else {
            return store(kb);
        };
        let e = linear(
            &["bt".into(), "r".into(), "c".into()],
            &[self.splits * self.batch, self.m, self.n],
        );
        let write = kb.store(parts, "e", "v")?;
        Ok(format!(
            "fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n  let e = {e};\n  {write}\n}}\n\n"
        ))
    }

    /// The kernel adding the partial sums up (nothing when not split).
    fn sum(
        &self,
        lw: &mut Lowering,
        store: &impl Fn(&mut KernelBuilder) -> Result<String>,
    ) -> Result<()> {
        let Some(parts) = self.parts else {
            return Ok(());
        };
        let (m, n) = (self.m, self.n);
        let total = self.batch * m * n;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let mut s = store(&mut kb)?;
        s.push_str(&entry(FLAT_WORKGROUP));
        let part = kb.load(parts, &format!("e + p * {total}u"));
        let _ = writeln!(
            s,
            "  let e = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (e >= {total}u) {{ return; }}\n\
             \x20 var v = 0.0;\n\
             \x20 for (var p = 0u; p < {}u; p = p + 1u) {{ v = v + {part}; }}\n\
             \x20 gstore(e / {}u, (e / {n}u) % {m}u, e % {n}u, v);\n}}",
            self.splits,
            m * n
        );
        let built = kb.finish(&s);
        let groups = (total as u64).div_ceil(u64::from(FLAT_WORKGROUP));
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [FLAT_WORKGROUP, 1, 1], workgroups, 0)
    }
}

/// Rows (per batch) up to which a product with a `k`-contiguous right
/// operand (a linear layer's weight) is a [`Gemv`].
const GEMV_ROWS: usize = 8;

/// Accumulators of a [`Gemv`] invocation (`rows × columns`), bounded so the
/// workgroup's partial sums fit 16 KiB.
const GEMV_SUMS: usize = 32;

/// Workgroups a [`Gemv`] wants before it gives each fewer columns: about
/// four 128-invocation workgroups on each of an H200's 132 units.
const GEMV_FILL: u64 = 512;

/// A matrix-vector-like product: `m ≤ 8` rows per batch times a right
/// operand whose columns are contiguous along `k` (`[n, k]` weights). It is
/// memory-bound on the right operand, so each element of it is read once:
/// a workgroup owns `cols` columns and every row, its invocations stride
/// over `k` in 4-element chunks (neighbours read neighbouring chunks: one
/// coalesced vector load each where the operand is a buffer), keep
/// `rows × cols` partial sums, and reduce them across the workgroup in
/// workgroup memory; too few columns for a large GPU split a deep `k`
/// among workgroups ([`Split`]). The caller's WGSL defines `xa(bt, r, k)`
/// and `xb(bt, c, k)` (chunks, see [`chunk_reader`]) and `gstore`.
struct Gemv {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
}

impl Gemv {
    /// `(invocations, columns, splits)` of a workgroup: the most columns
    /// (≤ 4) that keep enough workgroups, `k` split when there still are too
    /// few and each part keeps 128 invocations busy, and enough invocations
    /// to cover a part of `k` once (at most 128).
    fn shape(&self) -> (usize, usize, usize) {
        let cols = [4, 2]
            .into_iter()
            .find(|&c| {
                self.m * c <= GEMV_SUMS && (self.n.div_ceil(c) * self.batch) as u64 >= GEMV_FILL
            })
            .unwrap_or(1);
        let groups = (self.n.div_ceil(cols) * self.batch) as u64;
        let splits = split_k(groups, GEMV_FILL, self.k, 4 * 128, 4);
        let chunks = (self.k / splits).div_ceil(4).max(1);
        let threads = chunks.next_power_of_two().clamp(32, 128);
        (threads, cols, splits)
    }

    fn lower(
        &self,
        lw: &mut Lowering,
        operands: impl FnOnce(&mut KernelBuilder) -> Result<String>,
        store: impl Fn(&mut KernelBuilder) -> Result<String>,
    ) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            return Ok(());
        }
        let (threads, cols, splits) = self.shape();
        let split = Split::new(lw, splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let fns = operands(&mut kb)? + &split.store(&mut kb, &store)?;
        let main = format!("{fns}\n{}", self.main(threads, cols, splits));
        let built = kb.finish(&main);
        let groups = (self.n.div_ceil(cols) * self.batch * splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let storage = (4 * self.m * cols * threads) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [threads as u32, 1, 1], workgroups, storage)?;
        split.sum(lw, &store)
    }

    fn main(&self, threads: usize, cols: usize, splits: usize) -> String {
        let (m, n) = (self.m, self.n);
        // k of a split (a multiple of 4 when split)
        let depth = self.k / splits;
        let chunks = depth.div_ceil(4);
        let sums = m * cols;
        let blocks = n.div_ceil(cols);
        let mut s = String::new();
        let _ = writeln!(s, "var<workgroup> red: array<f32, {}>;", sums * threads);
        s.push_str(&entry(threads as u32));
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let kbase = (g / {}u) * {depth}u;\n  let sb = g / {blocks}u;\n\
             \x20 let bt = sb % {}u;\n  let n0 = (g % {blocks}u) * {cols}u;",
            blocks * self.batch * splits,
            blocks * self.batch,
            self.batch
        );
        for j in 0..cols {
            // a last block's missing columns read the last one (not stored)
            let _ = writeln!(s, "  let c{j} = min(n0 + {j}u, {}u);", n - 1);
        }
        for i in 0..m {
            for j in 0..cols {
                let _ = writeln!(s, "  var s{i}_{j} = 0.0;");
            }
        }
        let _ = writeln!(
            s,
            "  for (var q = lid; q < {chunks}u; q = q + {threads}u) {{\n    let k = kbase + q * 4u;"
        );
        for j in 0..cols {
            let _ = writeln!(s, "    let b{j} = xb(bt, c{j}, k);");
        }
        for i in 0..m {
            let _ = writeln!(s, "    let a{i} = xa(bt, {i}u, k);");
            for j in 0..cols {
                let _ = writeln!(s, "    s{i}_{j} = s{i}_{j} + dot(a{i}, b{j});");
            }
        }
        s.push_str("  }\n");
        for i in 0..m {
            for j in 0..cols {
                let _ = writeln!(s, "  red[{}u + lid] = s{i}_{j};", (i * cols + j) * threads);
            }
        }
        s.push_str("  workgroupBarrier();\n");
        // halve the partial sums of every output at once
        let mut half = threads / 2;
        while half >= 1 {
            let _ = writeln!(
                s,
                "  for (var e = lid; e < {}u; e = e + {threads}u) {{\n\
                 \x20   let o = (e / {half}u) * {threads}u + e % {half}u;\n\
                 \x20   red[o] = red[o] + red[o + {half}u];\n  }}\n  workgroupBarrier();",
                sums * half
            );
            half /= 2;
        }
        let _ = writeln!(
            s,
            "  if (lid < {sums}u) {{\n    let c = n0 + lid % {cols}u;\n\
             \x20   if (c < {n}u) {{ gstore(sb, lid / {cols}u, c, red[lid * {threads}u]); }}\n  }}\n}}"
        );
        s
    }
}

/// `dst = f(args)` with each checked argument clamped into range for the
/// call and the value 0 where any is out of range.
fn guarded(dst: &str, f: &str, args: &[(String, Option<(String, String)>)]) -> String {
    let conds: Vec<&str> = args
        .iter()
        .filter_map(|(_, c)| c.as_ref().map(|c| c.0.as_str()))
        .collect();
    let call = format!(
        "{f}({})",
        args.iter()
            .map(|(a, c)| c.as_ref().map_or(a.as_str(), |c| c.1.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if conds.is_empty() {
        format!("{dst} = {call};")
    } else {
        format!("{dst} = select(0.0, {call}, {});", conds.join(" && "))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use etmetal_core::{DType, Op, Result, Tensor};
    use etmetal_graph::{Graph, InputKind, Node, OutputKind};

    use crate::partitioner::Partition;
    use crate::preprocess::{preprocess, PreprocessOptions, Preprocessed};

    /// An operand of a one-node graph: a user input, or a weight (zeros).
    pub struct Operand {
        pub dtype: DType,
        pub shape: Vec<usize>,
        pub weight: bool,
    }

    pub fn input(dtype: DType, shape: &[usize]) -> Option<Operand> {
        Some(Operand {
            dtype,
            shape: shape.to_vec(),
            weight: false,
        })
    }

    pub fn weight(dtype: DType, shape: &[usize]) -> Option<Operand> {
        Some(Operand {
            dtype,
            shape: shape.to_vec(),
            weight: true,
        })
    }

    /// Preprocess the graph of one `op` node over `operands` (`None`: an
    /// absent optional input) as one partition.
    pub fn lower_one(op: Op, operands: Vec<Option<Operand>>) -> Result<Preprocessed> {
        let mut graph = Graph::default();
        let mut part = Partition {
            id: 0,
            nodes: vec![0],
            inputs: vec![],
            outputs: vec![],
            constants: vec![],
            mutated_buffers: vec![],
        };
        let mut inputs = vec![];
        for (i, o) in operands.into_iter().enumerate() {
            let Some(o) = o else {
                inputs.push(None);
                continue;
            };
            let v = graph.add_value(format!("in{i}"), o.dtype, o.shape.clone());
            if o.weight {
                graph.constants.insert(v, Tensor::zeros(o.dtype, &o.shape)?);
                part.constants.push(v);
            } else {
                graph.inputs.push((v, InputKind::User));
                part.inputs.push(v);
            }
            inputs.push(Some(v));
        }
        let mut node = Node {
            name: "n0".into(),
            target: "test".into(),
            op,
            inputs,
            outputs: vec![],
        };
        for (k, (dtype, shape)) in etmetal_graph::infer::infer(&graph, &node)?
            .into_iter()
            .enumerate()
        {
            let v = graph.add_value(format!("out{k}"), dtype, shape);
            node.outputs.push(v);
            graph.outputs.push((v, OutputKind::User));
            part.outputs.push(v);
        }
        graph.nodes.push(node);
        preprocess(&graph, &part, &PreprocessOptions::default())
    }

    #[test]
    fn products_of_every_form_validate() {
        let f = DType::F32;
        let cases: Vec<(Op, Vec<Option<Operand>>)> = vec![
            (Op::MatMul, vec![input(f, &[5, 7]), input(f, &[7, 3])]),
            (Op::MatMul, vec![input(f, &[7]), input(f, &[7])]),
            (Op::MatMul, vec![input(f, &[7]), input(f, &[2, 7, 3])]),
            (
                Op::MatMul,
                vec![input(f, &[2, 1, 5, 7]), input(f, &[3, 7, 4])],
            ),
            (
                Op::MatMul,
                vec![input(f, &[2, 600, 9]), input(f, &[9, 520])],
            ),
            (
                Op::Addmm {
                    beta: 0.5,
                    alpha: 2.0,
                },
                vec![input(f, &[3]), input(f, &[4, 5]), input(f, &[5, 3])],
            ),
            (
                Op::Linear,
                vec![
                    input(DType::BF16, &[2, 3, 8]),
                    weight(DType::BF16, &[40, 8]),
                    weight(DType::BF16, &[40]),
                ],
            ),
            (
                Op::Linear,
                vec![input(f, &[1, 64]), weight(f, &[300, 64]), None],
            ),
        ];
        for (op, operands) in cases {
            let name = format!("{op:?}");
            let p = lower_one(op, operands).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(
                p.payload.kernels.iter().any(|k| k.wgsl.contains("gstore")),
                "{name}: no GEMM kernel"
            );
        }
    }

    #[test]
    fn tiles_follow_the_shape() {
        let tile = |batch, m, n| {
            let g = super::Gemm {
                batch,
                m,
                n,
                k: 64,
                a_k_fast: true,
                b_k_fast: false,
                coop: None,
            };
            let t = g.tile();
            // every invocation stages whole elements of both slices
            assert_eq!((t.bm * t.bk) % t.threads(), 0);
            assert_eq!((t.bn * t.bk) % t.threads(), 0);
            assert!(2 * 4 * (t.bm + t.bn) * t.bk <= 16384, "{t:?}");
            (t.bm, t.bn)
        };
        assert_eq!(tile(1, 4096, 4096), (128, 128));
        assert_eq!(tile(64, 129, 129), (128, 128));
        assert_eq!(tile(1, 1024, 1024), (64, 64));
        assert_eq!(tile(1, 512, 512), (32, 32));
        assert_eq!(tile(1, 1, 4096), (16, 64));
        assert_eq!(tile(1, 4096, 3), (64, 16));
    }

    /// Decode-step linears (one row) are matrix-vector kernels reading the
    /// weight in 4-element chunks, with enough workgroups for a large GPU.
    #[test]
    fn decode_linears_read_weight_chunks() {
        for (dtype, k, n, chunk) in [
            (DType::F32, 1024, 1024, Some("array<vec4<f32>>")),
            (DType::BF16, 1024, 32000, Some("array<vec2<u32>>")),
            (DType::F32, 1022, 2048, None),
        ] {
            let p = lower_one(
                Op::Linear,
                vec![input(dtype, &[1, k]), weight(dtype, &[n, k]), None],
            )
            .unwrap();
            let (d, kernel) = p
                .payload
                .dispatches
                .iter()
                .map(|d| (d, &p.payload.kernels[d.kernel]))
                .find(|(_, k)| k.wgsl.contains("gstore"))
                .expect("a product kernel");
            assert!(kernel.wgsl.contains("var<workgroup> red"), "not a GEMV");
            if let Some(chunk) = chunk {
                assert!(kernel.wgsl.contains(chunk), "{dtype:?} {k}: no {chunk}");
            } else {
                assert!(!kernel.wgsl.contains("vec4<f32>>;"), "k % 4 != 0 chunked");
            }
            let groups: u32 = d.workgroups.iter().product();
            assert!(groups >= 512, "{n} columns in {groups} workgroups");
        }
    }

    #[test]
    fn deep_k_is_split_when_tiles_are_few() {
        use super::{split_k, Gemv};
        // BERT-base linears at 128 tokens on 32×32 tiles
        assert_eq!(split_k(96, 256, 768, 128, 16), 4);
        assert_eq!(split_k(96, 256, 3072, 128, 16), 4);
        assert_eq!(split_k(384, 256, 768, 128, 16), 1);
        // parts must stay deep and whole slices
        assert_eq!(split_k(1, 256, 256, 128, 16), 2);
        assert_eq!(split_k(1, 256, 1000, 128, 16), 1);
        let gemv = |n, k| {
            Gemv {
                batch: 1,
                m: 1,
                n,
                k,
            }
            .shape()
        };
        // (invocations, columns, splits)
        assert_eq!(gemv(64, 4096), (128, 1, 8));
        assert_eq!(gemv(1024, 1024), (128, 2, 1));
        assert_eq!(gemv(32000, 1024), (128, 4, 1));
        assert_eq!(gemv(10, 2047), (128, 1, 1));
        // the split cases of the GPU tests (gpu_matmul.rs) do split
        let f = DType::F32;
        let cases: Vec<(Op, Vec<Option<Operand>>)> = vec![
            (
                Op::Linear,
                vec![input(f, &[40, 512]), weight(f, &[40, 512]), None],
            ),
            (
                Op::MatMul,
                vec![input(f, &[4, 1, 1024]), input(f, &[4, 1024, 30])],
            ),
            (
                Op::MatMul,
                vec![input(f, &[100, 1024]), input(f, &[1024, 3])],
            ),
            (
                Op::Linear,
                vec![input(f, &[2, 2048]), weight(f, &[10, 2048]), None],
            ),
            (
                Op::Linear,
                vec![
                    input(DType::BF16, &[1, 1024]),
                    weight(DType::BF16, &[7, 1024]),
                    None,
                ],
            ),
        ];
        for (op, operands) in cases {
            let p = lower_one(op, operands).unwrap();
            assert!(
                p.payload
                    .buffers
                    .iter()
                    .any(|b| b.name.ends_with(".split_k")),
                "not split"
            );
        }
    }

    #[test]
    fn mismatched_operands_are_errors() {
        let f = DType::F32;
        let bad = lower_one(
            Op::Linear,
            vec![input(f, &[2, 3]), weight(f, &[4, 3, 1]), None],
        );
        assert!(bad.is_err());
    }
}
