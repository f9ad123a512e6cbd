//! Scaled dot-product attention as fused flash-attention kernels: scores
//! never reach memory, softmax is online (running max and sum per row,
//! f32), the output is normalised once at the end. No subgroup size is
//! assumed: invocations share data through workgroup memory only, and
//! each kernel stays within the default 16 KiB of it.
//!
//! * Prefill (more than [`DECODE_ROWS`] query rows): a workgroup takes one
//!   batch·head and [`BLOCK_ROWS`] query rows and walks the keys in tiles
//!   (see [`Tiling`]). Per tile, q and k rows are staged a [`CHUNK`] of
//!   the head dim at a time as vec4s and each invocation accumulates a
//!   small register block of scores (4 rows × 4 keys, or 2 × 2); the
//!   scaled, masked scores go to workgroup memory, where one invocation a
//!   row updates the row's running max and sum; then each invocation adds
//!   P·V for its block of 4 rows × a few vec4 output columns, held in
//!   registers across the tiles, from the V tile staged in the memory the
//!   q/k chunks used. More than [`SLICE_COLS`] output columns are split
//!   over workgroups (the scores are recomputed per slice).
//! * Decode (at most [`DECODE_ROWS`] query rows): a workgroup takes one
//!   query row; its invocations score one key each (vec4 reads of q from
//!   workgroup memory) per chunk of [`DECODE_CHUNK`] keys, the max is a
//!   tree reduction in workgroup memory (each invocation sums its own
//!   keys' weights, added up once at the end), and the invocations share
//!   the output columns (several invocations a unit for small head dims,
//!   each taking part of the keys, added up at the end), loading the V
//!   rows of [`PV_UNROLL`] keys before they use them (on an H100 this took
//!   a Llama-1B-shaped step's attention from 0.62 to 0.52 ms). Where the
//!   rows of k or v lie whole in one buffer (the KV cache, through GQA's
//!   expand and reshape), they are read 16 bytes a load from the row's
//!   start ([`RowRead`]), else element by element. With a mask, a
//!   workgroup first finds the last key the mask keeps in its range and
//!   ends its keys there: a cache's positions past the current one are
//!   not read. q is staged before that scan, whose end is one atomic max
//!   and one barrier (the tree it replaced took seven); on an H100 this
//!   took a Llama-1B-shaped step's attention from 0.250 to 0.240 ms
//!   (int4) and 0.255 to 0.246 ms (bf16). Each chunk's max is likewise
//!   one atomic max ([`MAX_KEYS`]; 0.242 to 0.238 ms and 0.247 to 0.244
//!   ms, H100).
//! * Either grid, when small, splits the keys over workgroups
//!   (flash-decoding, see [`key_split`]): each split writes its partial
//!   max, sum and unnormalised output, and a combine kernel merges them.
//!
//! As the CPU kernel, a row whose every key is masked gives zeros.

use etmetal_core::shape::{attention_batch, broadcast_shapes, AttentionBatch};
use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::rows::{shared, tree_reduce, ROW_WORKGROUP};
use crate::payload::Size;
use crate::preprocess::buffers::{BufferIdx, Storage};
use crate::preprocess::deferred::Scatter;
use crate::preprocess::emit::{entry, grid, unravel, KernelBuilder, FLAT_GROUP, FLAT_WORKGROUP};
use crate::preprocess::expr::{Kind, Lazy, LazyRef};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::sizes::{bucket, extent, ROW_BUCKETS};

/// The tensor-core forms of the prefill kernel: Apple's 8×8 f32 form,
/// and the dispatch of every form's alternatives.
#[path = "attention_coop.rs"]
mod coop;
/// The 16×16 f16 form (flash attention on NVIDIA's tensor cores).
#[path = "attention_flash.rs"]
mod flash;

/// The largest head dim (of q/k and of v) the kernel takes.
pub(crate) const MAX_HEAD_DIM: usize = 256;
/// Query rows up to which the decode kernel is used.
const DECODE_ROWS: usize = 4;
/// Keys a decode workgroup scores at once (two per invocation).
const DECODE_CHUNK: usize = 2 * ROW_WORKGROUP as usize;
/// Keys whose V rows a decode invocation loads before it uses them.
const PV_UNROLL: usize = 4;
/// Workgroups below which the keys are split (a few per SM of a large GPU).
/// Fewer splits save the combine dispatch but cost more: on an H200 a
/// Llama-1B decode step (32 heads, 513 keys) took 1.524 ms GPU with 256,
/// 1.687 ms with 64 and 1.734 ms with 32 (no split, no combine).
const TARGET_GROUPS: usize = 256;
/// Key splits whose partials a combine invocation loads at once.
const COMBINE_UNROLL: usize = 8;

/// WGSL of two workgroup slots `cmx` and `max_key`/`key_max`: an f32
/// mapped to a u32 key whose unsigned order is the float order (negative
/// floats' bits inverted, positive ones' sign bit set), so a max over the
/// workgroup is one `atomicMax`; key 0, the zero-initialised slot's, is
/// below every float's key (-inf's is 0x007fffff).
const MAX_KEYS: &str = "var<workgroup> cmx: array<atomic<u32>, 2>;\n\
fn max_key(x: f32) -> u32 { let b = bitcast<u32>(x); return select(~b, b | 0x80000000u, (b & 0x80000000u) == 0u); }\n\
fn key_max(k: u32) -> f32 { return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u)); }\n";

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let Op::Sdpa {
        is_causal,
        scale,
        enable_gqa,
    } = node.op
    else {
        return Err(Error::internal(format!(
            "{} is not attention",
            node.op.name()
        )));
    };
    let [q, k, v, mask] = operands(lw, node)?;
    let (q, k, v) = (
        q.ok_or_else(|| Error::invalid_input("input 0 is missing"))?,
        k.ok_or_else(|| Error::invalid_input("input 1 is missing"))?,
        v.ok_or_else(|| Error::invalid_input("input 2 is missing"))?,
    );
    let g = Geometry::new(&q, &k, &v, enable_gqa)?;
    if is_causal && mask.is_some() {
        return Err(Error::invalid_input(
            "an explicit mask cannot be combined with is_causal",
        ));
    }
    if let Some(m) = &mask {
        let full: Vec<usize> = [&g.batch[..], &[g.l, g.s]].concat();
        if broadcast_shapes(&m.shape, &full).ok().as_deref() != Some(&full[..]) {
            return Err(Error::invalid_input(format!(
                "mask of shape {:?} does not broadcast to {full:?}",
                m.shape
            )));
        }
        if m.dtype != DType::Bool && !m.dtype.is_float() {
            return Err(Error::invalid_input(format!(
                "mask dtype {} must be bool or floating point",
                m.dtype
            )));
        }
    }
    let out = lw.output_buffer(node, 0)?;
    let desc = &lw.buffers.list[out];
    let expected: Vec<usize> = [&g.batch[..], &[g.l, g.ev]].concat();
    if desc.shape != expected || !desc.dtype.is_float() {
        return Err(Error::invalid_input(format!(
            "attention output is {} {:?}, expected a float tensor of shape {expected:?}",
            desc.dtype, desc.shape
        )));
    }
    let a = Attn {
        out_dtype: desc.dtype,
        nb: g.batch.iter().product(),
        scale: float_literal(scale.unwrap_or(1.0 / (g.e as f64).sqrt())),
        scale_factor: scale.unwrap_or(1.0 / (g.e as f64).sqrt()),
        g,
        q,
        k,
        v,
        mask,
        is_causal,
        out,
        dynamic: node
            .outputs
            .first()
            .filter(|&&o| lw.graph.is_dynamic(o))
            .map(|&o| {
                let dims = lw.sizes.local(&lw.graph.sym_dims(o));
                let bounds = lw.graph.value(o).shape.iter().copied();
                let dims: Vec<(SymExpr, usize)> = dims.into_iter().zip(bounds).collect();
                let r = dims.len();
                [extent(&dims[..r - 2]), dims[r - 2].0.clone()]
            }),
        keys: match node.inputs.get(1).copied().flatten() {
            Some(k) if lw.graph.is_dynamic(k) => {
                let dims = lw.sizes.local(&lw.graph.sym_dims(k));
                let keys = &dims[dims.len() - 2];
                match keys.as_const() {
                    Some(_) => None,
                    None => Some(lw.sizes.size(keys)?),
                }
            }
            _ => None,
        },
    };
    if a.g.l <= DECODE_ROWS {
        return decode(lw, &a);
    }
    let rows = match &a.dynamic {
        Some([_, rows]) if rows.as_const().is_none() => rows.clone(),
        _ => return prefill(lw, &a, a.g.l),
    };
    // query rows of run-time count: the keys split for each row bucket's
    // largest count, the bucket's kernels gated to it
    let mut lo = 0;
    for hi in ROW_BUCKETS
        .into_iter()
        .filter(|&e| e < a.g.l)
        .chain([a.g.l])
    {
        let top = (hi < a.g.l).then_some(hi);
        lw.gated(bucket(&rows, lo, top)?, |lw| prefill(lw, &a, hi))?;
        lo = hi;
    }
    Ok(())
}

/// q, k, v and the mask. The decode kernel reads q once a workgroup and
/// k, v and the mask once a key, so for at most [`DECODE_ROWS`] query rows
/// a pointwise operand is computed as it is read (a rotary embedding, the
/// cache with a decode step's new row, a causal mask) instead of written
/// out by a kernel of its own; those with the most buffers are written out
/// while the kernel would bind too many. The prefill kernel reads views.
fn operands(lw: &mut Lowering, node: &Node) -> Result<[Option<LazyRef>; 4]> {
    let rows = lw.input(node, 0)?.shape.iter().rev().nth(1).copied();
    let decode = rows.is_some_and(|l| l <= DECODE_ROWS);
    let mut ops = [None, None, None, None];
    for (slot, op) in ops.iter_mut().enumerate() {
        *op = if decode {
            lw.optional_input(node, slot)?
        } else {
            lw.optional_input_view(node, slot)?
        };
    }
    loop {
        let mut bufs = vec![];
        ops.iter().flatten().for_each(|x| x.buffers(&mut bufs));
        let checks = ops.iter().flatten().any(|x| x.has_checks());
        // the output, key-split partials and a status buffer besides
        if bufs.len() + 2 + usize::from(checks) <= lw.options.max_bindings {
            return Ok(ops);
        }
        let widest = (0..4)
            .filter(|&i| ops[i].as_ref().is_some_and(|x| !x.is_view()))
            .max_by_key(|&i| {
                let mut b = vec![];
                if let Some(x) = &ops[i] {
                    x.buffers(&mut b);
                }
                b.len()
            });
        let Some(slot) = widest else {
            return Ok(ops);
        };
        ops[slot] = lw.optional_input_view(node, slot)?;
    }
}

/// One attention being lowered.
struct Attn {
    g: Geometry,
    q: LazyRef,
    k: LazyRef,
    v: LazyRef,
    mask: Option<LazyRef>,
    is_causal: bool,
    /// The scale, as a WGSL literal.
    scale: String,
    scale_factor: f64,
    out: BufferIdx,
    out_dtype: DType,
    /// Batch·heads.
    nb: usize,
    /// The run-time `(batch·heads, query rows)` where the output is dynamic.
    dynamic: Option<[SymExpr; 2]>,
    /// The run-time key count where it is dynamic (causal attention over
    /// as many keys as queries: the keys past it are masked for every
    /// valid row, and hold whatever the bound layout has there).
    keys: Option<Size>,
}

/// The partial results of a key split: `n` splits of each row, each
/// `[output columns…, max, sum]`.
struct KeySplit {
    part: BufferIdx,
    n: usize,
}

impl Attn {
    /// A kernel builder with `q`, `k`, `v` (and `mask`) value functions.
    fn builder<'b>(&self, lw: &'b Lowering) -> Result<KernelBuilder<'b>> {
        self.builder_reading(lw, RowRead::Scalar, RowRead::Scalar)
    }

    /// [`Self::builder`] where k and v are read as `k` and `v` say: a
    /// wide one gets its row function (`k_row`, `v_row`) instead.
    fn builder_reading<'b>(
        &self,
        lw: &'b Lowering,
        k: RowRead,
        v: RowRead,
    ) -> Result<KernelBuilder<'b>> {
        let mut kb = KernelBuilder::new(&lw.buffers);
        kb.value_fn(&self.q, "q")?;
        for (x, name, read) in [(&self.k, "k", k), (&self.v, "v", v)] {
            match read {
                RowRead::Wide { .. } => kb.row_fn(x, &format!("{name}_row"))?,
                RowRead::Scalar => kb.value_fn(x, name)?,
            }
        }
        if let Some(m) = &self.mask {
            kb.value_fn(m, "mask")?;
        }
        Ok(kb)
    }

    /// `bi0, bi1, …`: the batch index of the flat batch·head `b`.
    fn batch_lets(&self) -> String {
        unravel("b", &self.g.batch)
            .iter()
            .enumerate()
            .map(|(d, name)| format!("  let bi{d} = {name};\n"))
            .collect()
    }

    /// The batch arguments of an operand of `shape` (broadcast dims read
    /// 0; with GQA, `rep` query heads share a head).
    fn batch_args(&self, shape: &[usize], rep: usize) -> Vec<String> {
        let nbat = self.g.batch.len();
        let lead = nbat - (shape.len() - 2);
        (0..shape.len() - 2)
            .map(|d| {
                let full = lead + d;
                if shape[d] == 1 {
                    "0u".to_string()
                } else if rep > 1 && full + 1 == nbat {
                    format!("bi{full} / {rep}u")
                } else {
                    format!("bi{full}")
                }
            })
            .collect()
    }

    fn read(&self, name: &str, x: &LazyRef, rep: usize, row: &str, col: &str) -> String {
        self.call(name, x, rep, &[row, col])
    }

    /// `name(batch args…, rest…)` for operand `x` (see [`Self::batch_args`]).
    fn call(&self, name: &str, x: &LazyRef, rep: usize, rest: &[&str]) -> String {
        let mut args = self.batch_args(&x.shape, rep);
        args.extend(rest.iter().map(|a| a.to_string()));
        format!("{name}({})", args.join(", "))
    }

    fn q_at(&self, row: &str, col: &str) -> String {
        self.read("q", &self.q, 1, row, col)
    }

    fn k_at(&self, row: &str, col: &str) -> String {
        self.read("k", &self.k, self.g.k_group, row, col)
    }

    fn v_at(&self, row: &str, col: &str) -> String {
        self.read("v", &self.v, self.g.v_group, row, col)
    }

    /// Statements turning the dot product in var `x` of query row `i`
    /// (< L) and key `j` into its score: scaled, masked (−∞ where
    /// dropped), `valid` saying the key is in range.
    fn score(&self, x: &str, i: &str, j: &str, valid: &str) -> String {
        format!("{x} = {x} * {};\n", self.scale) + &self.mask(x, i, j, valid, None)
    }

    /// Statements masking the scaled score in var `x` (see
    /// [`Self::score`]); an additive mask's term is multiplied by `factor`
    /// where one is given (a kernel working in log2 units).
    fn mask(&self, x: &str, i: &str, j: &str, valid: &str, factor: Option<&str>) -> String {
        let mut s = String::new();
        let mut keep = valid.to_string();
        if self.is_causal {
            keep = format!("{keep} && {j} <= {i}");
        }
        if let Some(m) = &self.mask {
            let full: Vec<String> = (0..self.g.batch.len())
                .map(|d| format!("bi{d}"))
                .chain([i.to_string(), j.to_string()])
                .collect();
            let lead = full.len() - m.shape.len();
            let args: Vec<String> = m
                .shape
                .iter()
                .enumerate()
                .map(|(d, &n)| {
                    if n == 1 {
                        "0u".into()
                    } else {
                        full[lead + d].clone()
                    }
                })
                .collect();
            let at = format!("mask({})", args.join(", "));
            if m.dtype == DType::Bool {
                keep = format!("{keep} && {at}");
            } else {
                let term = match factor {
                    Some(f) => format!("{at} * {f}"),
                    None => at,
                };
                s.push_str(&format!("{x} = {x} + {term};\n"));
            }
        }
        s.push_str(&format!(
            "{x} = select({}, {x}, {keep});\n",
            float_literal(f64::NEG_INFINITY)
        ));
        s
    }

    /// A statement writing the unnormalised output `acc` of row `row`,
    /// column `col`: normalised by `inv` into the output, or as a partial
    /// of split `sp`.
    fn store_col(
        &self,
        kb: &mut KernelBuilder,
        split: &Option<KeySplit>,
        row: &str,
        col: &str,
        acc: &str,
    ) -> Result<String> {
        let (l, ev) = (self.g.l, self.g.ev);
        match split {
            None => kb.store(
                self.out,
                &format!("(b * {l}u + {row}) * {ev}u + {col}"),
                &cast(&format!("({acc} * inv)"), DType::F32, self.out_dtype),
            ),
            Some(sp) => kb.store(
                sp.part,
                &format!(
                    "((b * {l}u + {row}) * {}u + sp) * {}u + {col}",
                    sp.n,
                    ev + 2
                ),
                acc,
            ),
        }
    }

    /// Statements writing a split's max `m` and sum `l` of row `row`
    /// (none when the keys are not split).
    fn store_stats(
        &self,
        kb: &mut KernelBuilder,
        split: &Option<KeySplit>,
        row: &str,
    ) -> Result<String> {
        let ev = self.g.ev;
        Ok(match split {
            None => String::new(),
            Some(_) => format!(
                "{} {}",
                self.store_col(kb, split, row, &format!("{ev}u"), "m")?,
                self.store_col(kb, split, row, &format!("{}u", ev + 1), "l")?
            ),
        })
    }

    /// The most key splits whose partials fit the buffer limit.
    /// The WGSL of a prefill workgroup's end of keys: its split's (from
    /// `kbeg`, `span` keys), for causal attention not past its last row
    /// (`i0 + br`), and not past the run-time key count.
    fn kend(&self, kb: &mut KernelBuilder, span: usize, br: usize) -> String {
        let s = match &self.keys {
            Some(keys) => kb.size(keys),
            None => format!("{}u", self.g.s),
        };
        let mut kend = format!("min({s}, kbeg + {span}u)");
        if self.is_causal {
            kend = format!("min({kend}, i0 + {br}u)");
        }
        kend
    }

    /// The WGSL placing prefill workgroup `g` (over batch·heads and row
    /// blocks of `br` rows, `blocks` of them) at row `i0` of batch·head
    /// `b`. A run-time row count walks the row blocks outermost, so that
    /// the valid ones come first whatever the batch·heads.
    fn block_lets(&self, g: &str, br: usize, blocks: usize) -> String {
        let nb = self.nb;
        if self.dynamic_rows() {
            format!("  let i0 = ({g} / {nb}u) * {br}u;\n  let b = {g} % {nb}u;\n")
        } else {
            format!("  let i0 = ({g} % {blocks}u) * {br}u;\n  let b = {g} / {blocks}u;\n")
        }
    }

    fn dynamic_rows(&self) -> bool {
        self.dynamic
            .as_ref()
            .is_some_and(|[_, r]| r.as_const().is_none())
    }

    /// The workgroups of a prefill grid ([`Self::block_lets`] over `br`-row
    /// blocks, `blocks` of them, then `inner`, fastest last) at run time:
    /// the row blocks of the valid query rows.
    fn prefill_groups(
        &self,
        lw: &Lowering,
        br: usize,
        blocks: usize,
        inner: &[(SymExpr, usize)],
    ) -> Result<Option<Size>> {
        let Some([nb, rows]) = &self.dynamic else {
            return Ok(None);
        };
        let c = |n: usize| SymExpr::Const(n as i64);
        let row_blocks = SymExpr::floor_div(rows.clone() + c(br - 1), c(br))?;
        let (batch, rows) = ((nb.clone(), self.nb), (row_blocks, blocks));
        let (outer, next) = match self.dynamic_rows() {
            true => (rows, batch),
            false => (batch, rows),
        };
        let dims: Vec<(SymExpr, usize)> = [outer, next].into_iter().chain(inner.to_vec()).collect();
        lw.sizes.groups(&dims, 1)
    }

    fn most_splits(&self, lw: &Lowering) -> Result<usize> {
        lw.scratch_parts(self.nb * self.g.l * (self.g.ev + 2))
    }

    /// The partials buffer of `n` key splits (none for one split).
    fn split(&self, lw: &mut Lowering, n: usize) -> Result<Option<KeySplit>> {
        if n <= 1 {
            return Ok(None);
        }
        let name = format!("{}.splits", lw.buffers.list[self.out].name);
        let shape = [self.nb * self.g.l * n * (self.g.ev + 2)];
        Ok(Some(KeySplit {
            part: lw.temp(&name, DType::F32, &shape)?,
            n,
        }))
    }
}

/// How to split `tiles` tiles of `tile` keys over workgroups when only
/// `groups` workgroups would run: `(splits, keys per split)`, enough
/// splits for about [`TARGET_GROUPS`] workgroups, each whole tiles, and
/// at most `most` (the partials that fit the buffer limit).
fn key_split(groups: usize, tiles: usize, tile: usize, most: usize) -> (usize, usize) {
    let tiles = tiles.max(1);
    let want = TARGET_GROUPS
        .div_ceil(groups.max(1))
        .min(most)
        .clamp(1, tiles);
    let per = tiles.div_ceil(want);
    (tiles.div_ceil(per), per * tile)
}

/// Query rows of a prefill workgroup.
const BLOCK_ROWS: usize = 32;
/// Head-dim columns of q and k staged at once (4 vec4s a row).
const CHUNK: usize = 16;
/// vec4s a staged q/k row takes (one of padding: no bank conflicts).
const CHUNK_STRIDE: usize = CHUNK / 4 + 1;
/// Output columns a prefill workgroup takes at most.
const SLICE_COLS: usize = 128;

/// How a prefill workgroup's invocations share the work: scores as a
/// grid of `rt` × `kt` invocations (each `BLOCK_ROWS / rt` rows × `bc /
/// kt` keys), the output as `rp` × `cp` (each 4 rows × some vec4s).
struct Tiling {
    wg: usize,
    bc: usize,
    rt: usize,
    kt: usize,
    rp: usize,
    cp: usize,
}

impl Tiling {
    /// 64 invocations, 32-key tiles, 4×4 scores each for at most 64
    /// output columns; 128 invocations, 16-key tiles, 2×2 scores for 128.
    fn for_columns(cols: usize) -> Tiling {
        let (wg, bc, rt, kt) = if cols <= 64 {
            (64, 32, 8, 8)
        } else {
            (128, 16, 16, 8)
        };
        let rp = BLOCK_ROWS / 4;
        Tiling {
            wg,
            bc,
            rt,
            kt,
            rp,
            cp: wg / rp,
        }
    }
}

/// The prefill kernel (see the module docs).
/// The prefill kernel, its keys split for `rows` query rows (the rows
/// of a bucket of a run-time length; else all of them).
fn prefill(lw: &mut Lowering, a: &Attn, rows: usize) -> Result<()> {
    let Geometry { l, s, e, ev, .. } = a.g;
    let ninf = float_literal(f64::NEG_INFINITY);
    let br = BLOCK_ROWS;
    let blocks = l.div_ceil(br);
    // output vec4s of a workgroup, and the slices covering every column
    let c4 = ev.min(SLICE_COLS).div_ceil(4);
    let slices = ev.div_ceil(4 * c4);
    let Tiling {
        wg,
        bc,
        rt,
        kt,
        rp,
        cp,
    } = Tiling::for_columns(4 * c4);
    let (rtt, ktt, cpt) = (br / rt, bc / kt, c4.div_ceil(cp));
    // P is [key][row], rows padded so the score stores do not conflict
    let pstride = br + rt;
    let most = a.most_splits(lw)?;
    let busy = a.nb * rows.div_ceil(br) * slices;
    let (nsplit, span) = key_split(busy, s.div_ceil(bc), bc, most);
    let total = a.nb * blocks * slices * nsplit;
    let split = a.split(lw, nsplit)?;
    let mut kb = a.builder(lw)?;
    let region = ((br + bc) * CHUNK_STRIDE).max(bc * c4);

    let mut main = format!(
        "var<workgroup> sa: array<vec4<f32>, {region}>;\n\
         var<workgroup> pt: array<f32, {}>;\nvar<workgroup> alpha: array<f32, {br}>;\n",
        bc * pstride
    );
    main.push_str(&entry(wg as u32));
    let kend = a.kend(&mut kb, span, br);
    let block_of = a.block_lets("g2", br, blocks);
    main.push_str(&format!(
        "  let g0 = {FLAT_GROUP};\n  if (g0 >= {total}u) {{ return; }}\n\
         \x20 let sl = g0 % {slices}u;\n  let g1 = g0 / {slices}u;\n\
         \x20 let sp = g1 % {nsplit}u;\n  let g2 = g1 / {nsplit}u;\n{block_of}{}\
         \x20 let c0 = sl * {}u;\n  let kbeg = sp * {span}u;\n  let kend = {kend};\n\
         \x20 let tr = lid % {rt}u;\n  let tk = lid / {rt}u;\n\
         \x20 let pr = lid % {rp}u;\n  let pc = lid / {rp}u;\n\
         \x20 var m = {ninf};\n  var l = 0.0;\n",
        a.batch_lets(),
        4 * c4
    ));
    let o = |r: usize, c: usize| format!("o{r}_{c}");
    for r in 0..4 {
        main.extend((0..cpt).map(|c| format!("  var {} = vec4<f32>();\n", o(r, c))));
    }
    let exact_e = e % CHUNK == 0;
    let qv = vec4_at(
        &|col| a.q_at(&format!("min(i0 + r, {}u)", l - 1), col),
        e,
        exact_e,
    );
    let kv = vec4_at(&|col| a.k_at("kr", col), e, exact_e);
    let vv = vec4_at(&|col| a.v_at("kr", col), ev, 4 * c4 * slices == ev);
    let smax = s.max(1) - 1;
    // scores of the tile: q and k staged a chunk of the head dim at a time
    main.push_str(&format!(
        "  for (var t0 = kbeg; t0 < kend; t0 = t0 + {bc}u) {{\n"
    ));
    for r in 0..rtt {
        main.extend((0..ktt).map(|k| format!("    var s{r}_{k} = 0.0;\n")));
    }
    main.push_str(&format!(
        "    for (var d0 = 0u; d0 < {e}u; d0 = d0 + {CHUNK}u) {{\n\
         \x20     for (var t = lid; t < {}u; t = t + {wg}u) {{\n\
         \x20       let r = t / 4u;\n        let d = d0 + (t % 4u) * 4u;\n\
         \x20       let at = r * {CHUNK_STRIDE}u + t % 4u;\n\
         \x20       if (r < {br}u) {{\n          sa[at] = {qv};\n        }} else {{\n\
         \x20         let key = t0 + r - {br}u;\n          let kr = min(key, {smax}u);\n\
         \x20         sa[at] = select(vec4<f32>(), {kv}, key < kend);\n        }}\n      }}\n\
         \x20     workgroupBarrier();\n\
         \x20     for (var d4 = 0u; d4 < 4u; d4 = d4 + 1u) {{\n",
        (br + bc) * 4
    ));
    for r in 0..rtt {
        main.push_str(&format!(
            "        let q{r} = sa[(tr + {}u) * {CHUNK_STRIDE}u + d4];\n",
            r * rt
        ));
    }
    for k in 0..ktt {
        main.push_str(&format!(
            "        let k{k} = sa[(tk + {}u) * {CHUNK_STRIDE}u + d4];\n",
            br + k * kt
        ));
    }
    for r in 0..rtt {
        for k in 0..ktt {
            main.push_str(&format!("        s{r}_{k} = s{r}_{k} + dot(q{r}, k{k});\n"));
        }
    }
    main.push_str("      }\n      workgroupBarrier();\n    }\n");
    // scaled and masked scores into P; the V tile into the staging memory
    for r in 0..rtt {
        for k in 0..ktt {
            let key = format!("(t0 + tk + {}u)", k * kt);
            let row = format!("min(i0 + tr + {}u, {}u)", r * rt, l - 1);
            let x = format!("s{r}_{k}");
            let fix = a.score(&x, &row, &key, &format!("{key} < kend"));
            main.extend(fix.lines().map(|line| format!("    {line}\n")));
            main.push_str(&format!(
                "    pt[(tk + {}u) * {pstride}u + tr + {}u] = {x};\n",
                k * kt,
                r * rt
            ));
        }
    }
    main.push_str(&format!(
        "    for (var t = lid; t < {}u; t = t + {wg}u) {{\n\
         \x20     let key = t0 + t / {c4}u;\n      let kr = min(key, {smax}u);\n\
         \x20     let d = c0 + (t % {c4}u) * 4u;\n\
         \x20     sa[t] = select(vec4<f32>(), {vv}, key < kend);\n    }}\n\
         \x20   workgroupBarrier();\n",
        bc * c4
    ));
    // online softmax: invocation r keeps row r's running max and sum
    main.push_str(&format!(
        "    if (lid < {br}u) {{\n\
         \x20     var mx = m;\n\
         \x20     for (var j = 0u; j < {bc}u; j = j + 1u) {{ mx = max(mx, pt[j * {pstride}u + lid]); }}\n\
         \x20     let ms = select(mx, 0.0, mx == {ninf});\n\
         \x20     var sum = 0.0;\n\
         \x20     for (var j = 0u; j < {bc}u; j = j + 1u) {{\n\
         \x20       let p = exp(pt[j * {pstride}u + lid] - ms);\n\
         \x20       pt[j * {pstride}u + lid] = p;\n        sum = sum + p;\n      }}\n\
         \x20     let a = exp(m - ms);\n      l = l * a + sum;\n      m = mx;\n      alpha[lid] = a;\n\
         \x20   }}\n    workgroupBarrier();\n"
    ));
    // the output block: rescaled, plus P·V
    for r in 0..4 {
        main.push_str(&format!("    let a{r} = alpha[pr + {}u];\n", r * rp));
        main.extend((0..cpt).map(|c| format!("    {0} = {0} * a{r};\n", o(r, c))));
    }
    let vcol = |c: usize| {
        if c4 % cp == 0 {
            format!("pc + {}u", c * cp)
        } else {
            format!("min(pc + {}u, {}u)", c * cp, c4 - 1)
        }
    };
    main.push_str(&format!(
        "    let nj = min({bc}u, kend - t0);\n    for (var j = 0u; j < nj; j = j + 1u) {{\n"
    ));
    for r in 0..4 {
        main.push_str(&format!(
            "      let p{r} = pt[j * {pstride}u + pr + {}u];\n",
            r * rp
        ));
    }
    for c in 0..cpt {
        main.push_str(&format!("      let v{c} = sa[j * {c4}u + {}];\n", vcol(c)));
    }
    for r in 0..4 {
        for c in 0..cpt {
            main.push_str(&format!("      {0} = {0} + p{r} * v{c};\n", o(r, c)));
        }
    }
    main.push_str("    }\n    workgroupBarrier();\n  }\n");
    // 1 / sum per row, then every invocation writes its block
    let stats = a.store_stats(&mut kb, &split, "i0 + lid")?;
    main.push_str(&format!(
        "  if (lid < {br}u) {{\n    alpha[lid] = select(0.0, 1.0 / l, l > 0.0);\n"
    ));
    if !stats.is_empty() {
        main.push_str(&format!(
            "    if (sl == 0u && i0 + lid < {l}u) {{ {stats} }}\n"
        ));
    }
    main.push_str("  }\n  workgroupBarrier();\n");
    for r in 0..4 {
        main.push_str(&format!(
            "  {{\n    let row = pr + {}u;\n    let inv = alpha[row];\n    if (i0 + row < {l}u) {{\n",
            r * rp
        ));
        for c in 0..cpt {
            for (k, comp) in ["x", "y", "z", "w"].iter().enumerate() {
                let col = format!("c0 + (pc + {}u) * 4u + {k}u", c * cp);
                let store = a.store_col(
                    &mut kb,
                    &split,
                    "i0 + row",
                    &col,
                    &format!("{}.{comp}", o(r, c)),
                )?;
                main.push_str(&if c4 % cp == 0 && 4 * c4 * slices == ev {
                    format!("      {store}\n")
                } else {
                    format!(
                        "      if (pc + {}u < {c4}u && {col} < {ev}u) {{ {store} }}\n",
                        c * cp
                    )
                });
            }
        }
        main.push_str("    }\n  }\n");
    }
    main.push_str("}\n");
    let workgroups = grid(total as u64, lw.options.max_workgroups_per_dim)?;
    let storage = (16 * region + 4 * (bc * pstride + br)) as u32;
    let c = |n: usize| SymExpr::Const(n as i64);
    let inner = [(c(nsplit), nsplit), (c(slices), slices)];
    let actual = a.prefill_groups(lw, br, blocks, &inner)?;
    lw.add_dispatch_sized(
        kb.finish(&main),
        vec![lw.op_label()],
        [wg as u32, 1, 1],
        workgroups,
        storage,
        actual,
    )?;
    coop::alternatives(lw, a, lw.dispatches.len() - 1, &split, span)?;
    match split {
        Some(sp) => combine(lw, a, &sp),
        None => Ok(()),
    }
}

/// `vec4<f32>(at(d), at(d + 1u), …)`: columns `d`… (a u32 named `d` in
/// the WGSL) of a row of `n`, zeros past the end unless `exact` (every
/// vec4 read is whole).
fn vec4_at(at: &dyn Fn(&str) -> String, n: usize, exact: bool) -> String {
    let comps: Vec<String> = (0..4)
        .map(|c| {
            if exact {
                at(&format!("d + {c}u"))
            } else {
                let col = format!("min(d + {c}u, {}u)", n - 1);
                format!("select(0.0, {}, d + {c}u < {n}u)", at(&col))
            }
        })
        .collect();
    format!("vec4<f32>({})", comps.join(", "))
}

/// How the decode kernel reads the rows of k or v.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RowRead {
    /// `width` elements a load of buffer `buf` (8: 16 bytes of a 16-bit
    /// buffer; 4: 16 bytes of an f32 one, 8 of a 16-bit one whose rows
    /// are no multiple of 8), from the row start its `_row` function gives.
    Wide { buf: BufferIdx, width: usize },
    /// Element by element through the operand's value function.
    Scalar,
}

impl RowRead {
    /// How rows of `n` elements of `x` are read: wide where they lie whole
    /// in one buffer ([`crate::preprocess::expr::Lazy::row_source`]), so
    /// that every row starts at a multiple of `n`, a multiple of the width.
    fn of(lw: &Lowering, x: &LazyRef, n: usize) -> RowRead {
        let Some(buf) = x.row_source() else {
            return RowRead::Scalar;
        };
        let width = match lw.buffers.list[buf].storage {
            Storage::Packed16 if n.is_multiple_of(8) => 8,
            Storage::I32 => return RowRead::Scalar,
            _ if n.is_multiple_of(4) => 4,
            _ => return RowRead::Scalar,
        };
        RowRead::Wide { buf, width }
    }

    /// Columns one unit of a row holds: a load, or a vec4 of element reads.
    fn width(self) -> usize {
        match self {
            RowRead::Wide { width, .. } => width,
            RowRead::Scalar => 4,
        }
    }

    fn buf(self) -> Option<BufferIdx> {
        match self {
            RowRead::Wide { buf, .. } => Some(buf),
            RowRead::Scalar => None,
        }
    }

    /// A statement binding `var` to unit `unit` (a u32 expression in
    /// units of the width from the buffer's start), and its vec4s.
    fn load(self, kb: &mut KernelBuilder, var: &str, unit: &str) -> Result<(String, Vec<String>)> {
        let RowRead::Wide { buf, width } = self else {
            return Err(Error::internal("element reads load no units"));
        };
        Ok(if width == 8 {
            let at = kb.load8(buf, unit)?;
            (
                format!("let {var} = {at};"),
                vec![format!("{var}[0]"), format!("{var}[1]")],
            )
        } else {
            (
                format!("let {var} = {};", kb.load4(buf, unit)?),
                vec![var.to_string()],
            )
        })
    }
}

/// k's and v's [`RowRead`]s for the decode kernel: wide where the buffer
/// is bound only so (a buffer bound both in units and element by element,
/// or in units of two widths, would take two of the kernel's bindings).
fn row_reads(lw: &Lowering, a: &Attn) -> [RowRead; 2] {
    let mut reads = [RowRead::of(lw, &a.k, a.g.e), RowRead::of(lw, &a.v, a.g.ev)];
    let [k, v] = reads;
    if k.buf().is_some() && k.buf() == v.buf() && k != v {
        let width = k.width().min(v.width());
        reads = reads.map(|r| match r {
            RowRead::Wide { buf, .. } => RowRead::Wide { buf, width },
            r => r,
        });
    }
    // element reads may turn more reads into element reads: twice settles
    for _ in 0..2 {
        let mut plain = vec![];
        a.q.buffers(&mut plain);
        if let Some(m) = &a.mask {
            m.buffers(&mut plain);
        }
        for (x, r) in [&a.k, &a.v].into_iter().zip(reads) {
            if r == RowRead::Scalar {
                x.buffers(&mut plain);
            }
        }
        for r in &mut reads {
            if r.buf().is_some_and(|b| plain.contains(&b)) {
                *r = RowRead::Scalar;
            }
        }
    }
    reads
}

/// The decode kernel (see the module docs).
fn decode(lw: &mut Lowering, a: &Attn) -> Result<()> {
    let Geometry { l, s, e, ev, .. } = a.g;
    let ninf = float_literal(f64::NEG_INFINITY);
    let wg = ROW_WORKGROUP as usize;
    let most = a.most_splits(lw)?;
    let (nsplit, span) = key_split(a.nb * l, s.div_ceil(DECODE_CHUNK), DECODE_CHUNK, most);
    let total = a.nb * l * nsplit;
    let split = a.split(lw, nsplit)?;
    let [kr, vr] = row_reads(lw, a);
    let writes = row_writes(lw, a);
    let mut kb = a.builder_reading(lw, kr, vr)?;
    let e4 = e.div_ceil(4);
    // invocations share the output: units of `vw` columns (one V load or
    // vec4), `cw` units a column group, `parts` groups each taking every
    // `parts`-th key
    let vw = vr.width();
    let (nh, units) = (vw / 4, ev.div_ceil(vw));
    let cw = units.next_power_of_two().min(wg);
    let parts = wg / cw;
    let ncols = units.div_ceil(cw);

    let mut main = format!(
        "var<workgroup> qs: array<vec4<f32>, {e4}>;\nvar<workgroup> ps: array<f32, {DECODE_CHUNK}>;\n"
    );
    main.push_str(&shared("red", "f32"));
    main.push_str(MAX_KEYS);
    if parts > 1 {
        main.push_str(&format!(
            "var<workgroup> red4: array<vec4<f32>, {}>;\n",
            wg * nh
        ));
    }
    if a.mask.is_some() {
        main.push_str("var<workgroup> tend: atomic<u32>;\n");
    }
    main.push_str(&entry(ROW_WORKGROUP));
    let mut kend = format!("min({s}u, kbeg + {span}u)");
    if a.is_causal {
        kend = format!("min({kend}, i + 1u)");
    }
    main.push_str(&format!(
        "  let g0 = {FLAT_GROUP};\n  if (g0 >= {total}u) {{ return; }}\n\
         \x20 let sp = g0 % {nsplit}u;\n  let g1 = g0 / {nsplit}u;\n\
         \x20 let i = g1 % {l}u;\n  let b = g1 / {l}u;\n{}\
         \x20 let kbeg = sp * {span}u;\n",
        a.batch_lets(),
    ));
    // the cache rows this step writes whose positions are in the
    // workgroup's keys, written before they are read (every workgroup of
    // those keys writes all their heads' rows: the same bytes, a few KiB),
    // after q's loads and the mask's scan have issued theirs (the position
    // they read first is then at hand)
    let mut rows = String::new();
    for (t, w) in writes.iter().enumerate() {
        let keep = format!("j >= i32(kbeg) && j < i32(min({s}u, kbeg + {span}u))");
        // (in chunks through the binding the rows are read by)
        let chunk = [kr, vr]
            .into_iter()
            .find(|r| r.buf() == Some(w.target))
            .map_or(0, RowRead::width);
        if let Some(w) = super::scatter::element_write(&mut kb, lw, w, t, Some(&keep), chunk)? {
            rows.push_str(&format!(
                "  for (var t = lid; t < {}u; t = t + {wg}u) {{\n{}  }}\n",
                w.items, w.body
            ));
        }
    }
    // (visible to every invocation of the workgroup with the barrier that
    // ends the mask's scan)
    if !writes.is_empty() {
        rows.push_str("  storageBarrier();\n");
    }
    // q is staged first, so that its loads and the mask's are in flight
    // together, and the barrier ending the mask's scan covers both
    main.push_str(&format!(
        "  for (var t = lid; t < {e4}u; t = t + {wg}u) {{ let d = 4u * t; qs[t] = {}; }}\n",
        vec4_at(&|col| a.q_at("i", col), e, e % 4 == 0)
    ));
    if a.mask.is_some() {
        // the keys end after the last one the mask keeps: a KV cache's
        // positions past the current one are neither read nor scored, and a
        // split wholly past it writes an empty partial (the latest end is
        // one atomic max in workgroup memory, which WGSL zero-initialises:
        // one barrier where a tree took one a halving)
        let keep = a.mask("x", "i", "j", "true", None);
        main.push_str(&format!(
            "  let kall = {kend};\n  var last = 0u;\n\
             \x20 for (var j = kbeg + lid; j < kall; j = j + {wg}u) {{\n    var x = 0.0;\n"
        ));
        main.extend(keep.lines().map(|line| format!("    {line}\n")));
        main.push_str(&format!(
            "    if (x != {ninf}) {{ last = j + 1u; }}\n  }}\n\
             {rows}\x20 atomicMax(&tend, last);\n  workgroupBarrier();\n\
             \x20 let kend = min(kall, atomicLoad(&tend));\n"
        ));
    } else {
        main.push_str(&format!(
            "  let kend = {kend};\n{rows}  workgroupBarrier();\n"
        ));
    }
    main.push_str(&format!(
        "  let cc = lid % {cw}u;\n  let part = lid / {cw}u;\n\
         \x20 var m = {ninf};\n  var lp = 0.0;\n"
    ));
    for c in 0..ncols {
        main.extend((0..nh).map(|h| format!("  var o{c}_{h} = vec4<f32>();\n")));
    }
    main.push_str(&format!(
        "  for (var c0 = kbeg; c0 < kend; c0 = c0 + {DECODE_CHUNK}u) {{\n    var cmax = {ninf};\n"
    ));
    // scores of the invocation's keys, all their K loads issued first (no
    // K row read past the end: its keys read the last row again)
    let keys = DECODE_CHUNK / wg;
    for kk in 0..keys {
        main.push_str(&format!(
            "    let j{kk} = c0 + lid + {}u;\n    let kr{kk} = min(j{kk}, kend - 1u);\n    var x{kk} = 0.0;\n",
            kk * wg
        ));
        if let RowRead::Wide { width, .. } = kr {
            main.push_str(&format!(
                "    let ko{kk} = {} / {width}u;\n",
                a.call("k_row", &a.k, a.g.k_group, &[&format!("kr{kk}")])
            ));
        }
    }
    match kr {
        RowRead::Wide { width, .. } => {
            let mut dots = String::new();
            for kk in 0..keys {
                for t in 0..e / width {
                    let (stmt, vecs) =
                        kr.load(&mut kb, &format!("k{kk}_{t}"), &format!("ko{kk} + {t}u"))?;
                    main.push_str(&format!("    {stmt}\n"));
                    for (h, v) in vecs.iter().enumerate() {
                        dots.push_str(&format!(
                            "    x{kk} = x{kk} + dot(qs[{}u], {v});\n",
                            t * width / 4 + h
                        ));
                    }
                }
            }
            main.push_str(&dots);
        }
        RowRead::Scalar => {
            for kk in 0..keys {
                let row = format!("kr{kk}");
                let kv = vec4_at(&|col| a.k_at(&row, col), e, e % 4 == 0);
                main.push_str(&format!(
                    "    for (var t = 0u; t < {e4}u; t = t + 1u) {{ let d = 4u * t; x{kk} = x{kk} + dot(qs[t], {kv}); }}\n"
                ));
            }
        }
    }
    for kk in 0..keys {
        let (x, j) = (format!("x{kk}"), format!("j{kk}"));
        let fix = a.score(&x, "i", &j, &format!("{j} < kend"));
        main.extend(fix.lines().map(|line| format!("    {line}\n")));
        main.push_str(&format!(
            "    ps[lid + {}u] = {x};\n    cmax = max(cmax, {x});\n",
            kk * wg
        ));
    }
    // the chunk's max: one atomic max of order-preserving keys and one
    // barrier (a tree takes eight), in one of two slots by the chunk's
    // parity; the other slot, read before the last chunk's later barriers,
    // is cleared for the next chunk
    main.push_str(&format!(
        "    let slot = ((c0 - kbeg) / {DECODE_CHUNK}u) % 2u;\n\
         \x20   atomicMax(&cmx[slot], max_key(cmax));\n    workgroupBarrier();\n\
         \x20   let tmax = key_max(atomicLoad(&cmx[slot]));\n\
         \x20   if (lid == 0u) {{ atomicStore(&cmx[1u - slot], 0u); }}\n"
    ));
    main.push_str(&format!(
        "    let mx = max(m, tmax);\n    let ms = select(mx, 0.0, mx == {ninf});\n\
         \x20   let a = exp(m - ms);\n    var psum = 0.0;\n"
    ));
    for kk in 0..keys {
        main.push_str(&format!(
            "    {{ let p = exp(ps[lid + {o}u] - ms); ps[lid + {o}u] = p; psum = psum + p; }}\n",
            o = kk * wg
        ));
    }
    // each invocation sums its own keys' weights (the rescale `a` is the
    // workgroup's): one sum at the end instead of one a chunk
    main.push_str("    lp = lp * a + psum;\n    m = mx;\n    workgroupBarrier();\n");
    for c in 0..ncols {
        main.extend((0..nh).map(|h| format!("    o{c}_{h} = o{c}_{h} * a;\n")));
    }
    main.push_str(&format!(
        "    let nk = min({DECODE_CHUNK}u, kend - c0);\n    var j = part;\n"
    ));
    // the keys' V rows `PV_UNROLL` at a time, their loads issued before
    // the products use them, then one at a time
    let mut accumulate = |main: &mut String, u: usize| -> Result<()> {
        // terms[c][h]: the products adding to `o{c}_{h}`
        let mut terms = vec![vec![vec![]; nh]; ncols];
        for x in 0..u {
            main.push_str(&format!(
                "      let p{x} = ps[j + {o}u];\n      let kr{x} = c0 + j + {o}u;\n",
                o = x * parts
            ));
            let row = format!("kr{x}");
            if let RowRead::Wide { width, .. } = vr {
                main.push_str(&format!(
                    "      let vo{x} = {} / {width}u;\n",
                    a.call("v_row", &a.v, a.g.v_group, &[&row])
                ));
            }
            for (c, tc) in terms.iter_mut().enumerate() {
                let unit = format!("min(cc + {}u, {}u)", c * cw, units - 1);
                let vecs = match vr {
                    RowRead::Wide { .. } => {
                        let (stmt, v) =
                            vr.load(&mut kb, &format!("v{x}_{c}"), &format!("vo{x} + {unit}"))?;
                        main.push_str(&format!("      {stmt}\n"));
                        v
                    }
                    RowRead::Scalar => {
                        let vv = vec4_at(&|col| a.v_at(&row, col), ev, ev % 4 == 0);
                        main.push_str(&format!(
                            "      var v{x}_{c}: vec4<f32>;\n      {{ let d = 4u * {unit}; v{x}_{c} = {vv}; }}\n"
                        ));
                        vec![format!("v{x}_{c}")]
                    }
                };
                for (t, v) in tc.iter_mut().zip(vecs) {
                    t.push(format!("p{x} * {v}"));
                }
            }
        }
        for (c, tc) in terms.iter().enumerate() {
            for (h, t) in tc.iter().enumerate() {
                main.push_str(&format!("      o{c}_{h} = o{c}_{h} + {};\n", t.join(" + ")));
            }
        }
        Ok(())
    };
    main.push_str(&format!(
        "    for (; j + {}u < nk; j = j + {}u) {{\n",
        (PV_UNROLL - 1) * parts,
        PV_UNROLL * parts
    ));
    accumulate(&mut main, PV_UNROLL)?;
    main.push_str(&format!(
        "    }}\n    for (; j < nk; j = j + {parts}u) {{\n"
    ));
    accumulate(&mut main, 1)?;
    main.push_str("    }\n    workgroupBarrier();\n  }\n");
    if parts > 1 {
        // one unit each (cw ≥ units): add the parts' sums
        main.extend((0..nh).map(|h| format!("  red4[lid * {nh}u + {h}u] = o0_{h};\n")));
        main.push_str("  workgroupBarrier();\n");
        for h in 0..nh {
            let terms: Vec<String> = (0..parts)
                .map(|p| format!("red4[(cc + {}u) * {nh}u + {h}u]", p * cw))
                .collect();
            main.push_str(&format!("  o0_{h} = {};\n", terms.join(" + ")));
        }
    }
    main.push_str(&tree_reduce("red", "lp", "l", &|x, y| {
        format!("({x} + {y})")
    }));
    main.push_str("  let inv = select(0.0, 1.0 / l, l > 0.0);\n  if (part == 0u) {\n");
    for c in 0..ncols {
        for h in 0..nh {
            for (k, comp) in ["x", "y", "z", "w"].iter().enumerate() {
                let col = format!("(cc + {}u) * {vw}u + {}u", c * cw, 4 * h + k);
                let store = a.store_col(&mut kb, &split, "i", &col, &format!("o{c}_{h}.{comp}"))?;
                main.push_str(&format!(
                    "    if (cc + {}u < {units}u && {col} < {ev}u) {{ {store} }}\n",
                    c * cw
                ));
            }
        }
    }
    let stats = a.store_stats(&mut kb, &split, "i")?;
    if !stats.is_empty() {
        main.push_str(&format!("    if (lid == 0u) {{ {stats} }}\n"));
    }
    main.push_str("  }\n}\n");
    let workgroups = grid(total as u64, lw.options.max_workgroups_per_dim)?;
    let red4 = if parts > 1 { 16 * wg * nh } else { 0 };
    let ends = if a.mask.is_some() { 4 * wg } else { 0 };
    let storage = (16 * e4 + 4 * (DECODE_CHUNK + wg) + red4 + ends) as u32;
    lw.add_dispatch(
        kb.finish(&main),
        vec![lw.op_label()],
        [ROW_WORKGROUP, 1, 1],
        workgroups,
        storage,
    )?;
    match split {
        Some(sp) => combine(lw, a, &sp),
        None => Ok(()),
    }
}

/// The in-place row writes waiting ([`Lowering::scatters_waiting`]: a
/// decode step's KV cache rows) that the decode kernel writes itself
/// instead of a dispatch before it: every waiting write into a buffer the
/// attention reads, where each is into the buffer of k or v whose keys are
/// its rows (key `j` is position `j` along the written dim: [`keys_are_rows`]),
/// the kernel runs at every size and binds them all within the limit (it
/// writes a buffer through the binding it reads it by: [`RowRead`]'s
/// chunks, else words). Else none, and they are dispatched before the
/// kernel as usual.
fn row_writes(lw: &mut Lowering, a: &Attn) -> Vec<Scatter> {
    let mut bound = vec![];
    for x in [&a.q, &a.k, &a.v].into_iter().chain(&a.mask) {
        x.buffers(&mut bound);
    }
    let ours: Vec<usize> = (lw.scatters_waiting().iter().enumerate())
        .filter(|(_, w)| bound.contains(&w.target))
        .map(|(i, _)| i)
        .collect();
    if ours.is_empty() || lw.is_gated() {
        return vec![];
    }
    let waiting = lw.scatters_waiting();
    let mut checks = [&a.q, &a.k, &a.v]
        .into_iter()
        .chain(&a.mask)
        .any(|x| x.has_checks());
    for &i in &ours {
        let w = &waiting[i];
        let (_, _, inner) = w.geometry();
        let aligned = [&a.k, &a.v].into_iter().any(|x| {
            let r = x.shape.len();
            keys_are_rows(x, w.target)
                && w.shape[w.dim] == x.shape[r - 2]
                && inner == x.shape[r - 1]
        });
        if !aligned {
            return vec![];
        }
        w.index.buffers(&mut bound);
        w.src.buffers(&mut bound);
        checks |= w.index.has_checks() || w.src.has_checks();
    }
    // (and the output or the key splits' partials)
    if bound.len() + 1 + usize::from(checks) > lw.options.max_bindings {
        return vec![];
    }
    lw.take_scatters(&ours)
}

/// Whether key `j` of `x` (an attention's k or v, `[…, keys, d]`) is row
/// `j` of buffer `buf` seen as `[…, keys, d]`: `x` reads `buf` through
/// reshapes and expands that keep its last two dims as they are.
fn keys_are_rows(x: &Lazy, buf: BufferIdx) -> bool {
    let r = x.shape.len();
    let same = |y: &Lazy| y.shape.len() >= 2 && y.shape[y.shape.len() - 2..] == x.shape[r - 2..];
    match &x.kind {
        Kind::Load(b) => *b == buf,
        Kind::Reshape(y) | Kind::Expand(y) if same(y) => keys_are_rows(y, buf),
        _ => false,
    }
}

/// Merge the key splits' partials into the output: weights
/// `exp(m_split − max)`, normalised by the weighted sums.
fn combine(lw: &mut Lowering, a: &Attn, sp: &KeySplit) -> Result<()> {
    let (ev, n) = (a.g.ev, sp.n);
    let width = ev + 2;
    let items = a.nb * a.g.l * ev;
    let ninf = float_literal(f64::NEG_INFINITY);
    let mut kb = KernelBuilder::new(&lw.buffers);
    // the splits `unroll` at a time, their loads issued together (one
    // at a time, each pass waited out n loads in turn); past the last
    // split, `t` reads the last again and its weight is 0
    let unroll = n.min(COMBINE_UNROLL);
    let t = |u: usize| match n % unroll {
        0 => format!("t0 + {u}u"),
        _ => format!("min(t0 + {u}u, {}u)", n - 1),
    };
    let mut at =
        |u: usize, col: &str| kb.load(sp.part, &format!("base + ({}) * {width}u + {col}", t(u)));
    let mut maxes = String::new();
    let mut sums = String::new();
    for u in 0..unroll {
        let (m, l, o) = (
            at(u, &format!("{ev}u")),
            at(u, &format!("{}u", ev + 1)),
            at(u, "c"),
        );
        maxes.push_str(&format!("    mx = max(mx, {m});\n"));
        let w = match n % unroll {
            0 => format!("exp({m} - ms)"),
            _ => format!("select(0.0, exp({m} - ms), t0 + {u}u < {n}u)"),
        };
        sums.push_str(&format!(
            "    let w{u} = {w};\n    acc = acc + w{u} * {o};\n    l = l + w{u} * {l};\n"
        ));
    }
    let y = cast("(acc * inv)", DType::F32, a.out_dtype);
    let store = kb.store(a.out, "g", &y)?;
    let mut main = entry(FLAT_WORKGROUP);
    main.push_str(&format!(
        "  let g = {FLAT_GROUP} * {FLAT_WORKGROUP}u + lid;\n  if (g >= {items}u) {{ return; }}\n\
         \x20 let c = g % {ev}u;\n  let base = (g / {ev}u) * {}u;\n\
         \x20 var mx = {ninf};\n\
         \x20 for (var t0 = 0u; t0 < {n}u; t0 = t0 + {unroll}u) {{\n{maxes}  }}\n\
         \x20 let ms = select(mx, 0.0, mx == {ninf});\n  var acc = 0.0;\n  var l = 0.0;\n\
         \x20 for (var t0 = 0u; t0 < {n}u; t0 = t0 + {unroll}u) {{\n{sums}  }}\n\
         \x20 let inv = select(0.0, 1.0 / l, l > 0.0);\n  {store}\n}}\n",
        n * width
    ));
    let groups = (items as u64).div_ceil(u64::from(FLAT_WORKGROUP));
    let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
    // (one invocation an output element, in order)
    let actual = lw
        .sizes
        .groups(&lw.grid_dims(a.out), FLAT_WORKGROUP as usize)?;
    lw.add_dispatch_sized(
        kb.finish(&main),
        vec![lw.op_label()],
        [FLAT_WORKGROUP, 1, 1],
        workgroups,
        0,
        actual,
    )
}

/// Sizes of one attention: batch dims (broadcast, k/v heads repeated to
/// q's), query and key lengths, head dims, and the GQA head groups.
struct Geometry {
    batch: Vec<usize>,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    /// Query heads per key and per value head.
    k_group: usize,
    v_group: usize,
}

impl Geometry {
    fn new(q: &LazyRef, k: &LazyRef, v: &LazyRef, enable_gqa: bool) -> Result<Geometry> {
        let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
        let r = qs.len();
        if r < 2 || ks.len() != r || vs.len() != r {
            return Err(Error::invalid_input(format!(
                "q {qs:?}, k {ks:?}, v {vs:?} need one rank of at least 2"
            )));
        }
        let (l, e, s, ev) = (qs[r - 2], qs[r - 1], ks[r - 2], vs[r - 1]);
        if ks[r - 1] != e || vs[r - 2] != s {
            return Err(Error::invalid_input(format!(
                "q {qs:?}, k {ks:?}, v {vs:?} disagree on the embedding or sequence size"
            )));
        }
        if e > MAX_HEAD_DIM || ev > MAX_HEAD_DIM {
            return Err(Error::unsupported(format!(
                "attention head dims {e} and {ev} (the GPU kernel takes at most {MAX_HEAD_DIM})"
            )));
        }
        if l == 0 || e == 0 || ev == 0 {
            return Err(Error::unsupported(format!(
                "empty attention (q {qs:?}, v {vs:?})"
            )));
        }
        let AttentionBatch {
            batch,
            k_group,
            v_group,
        } = attention_batch(&qs[..r - 2], &ks[..r - 2], &vs[..r - 2], enable_gqa).map_err(
            |err| Error::invalid_input(format!("attention batch dims: {}", err.message())),
        )?;
        Ok(Geometry {
            batch,
            l,
            s,
            e,
            ev,
            k_group,
            v_group,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{input, lower_inputs as lower_one, lower_one_with};
    use crate::preprocess::options::PreprocessOptions;
    use etmetal_core::{DType, Op};

    /// 40 query rows over 4096 keys split the keys 128 ways: 204 800
    /// bytes of partials (40 rows × 128 splits × (8 + 2) f32), more than
    /// the largest value (k and v, 131 072). Within a 140 000 byte buffer
    /// limit the keys split 64 ways; every buffer fits.
    #[test]
    fn key_split_partials_fit_the_buffer_limit() {
        let f = DType::F32;
        let op = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: false,
        };
        for (limit, splits, largest) in [
            (PreprocessOptions::default().max_buffer_bytes, 128, 204_800),
            (140_000, 64, 131_072),
        ] {
            let options = PreprocessOptions {
                max_buffer_bytes: limit,
                ..PreprocessOptions::default()
            };
            let operands = vec![
                input(f, &[1, 40, 8]),
                input(f, &[1, 4096, 8]),
                input(f, &[1, 4096, 8]),
            ];
            let p = lower_one_with(op.clone(), operands, &options).unwrap();
            let parts = p
                .payload
                .buffers
                .iter()
                .find(|b| b.name.ends_with(".splits"));
            assert_eq!(
                parts.map(|b| b.shape[0]),
                Some(40 * splits * 10),
                "limit {limit}"
            );
            let binding = p.payload.requirements.max_storage_buffer_binding_size;
            assert_eq!(binding, largest, "limit {limit}");
            assert!(binding <= limit);
        }
    }

    /// The decode kernel reads k and v rows 16 bytes a load (`vec4<u32>`
    /// of a 16-bit buffer, `vec4<f32>` of an f32 one), 8 bytes where a
    /// 16-bit row is no multiple of 8, element by element where a row is
    /// no multiple of 4; with a mask, its keys end at the last one kept.
    #[test]
    fn decode_reads_whole_rows_in_wide_loads() {
        let op = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: true,
        };
        for (dtype, d, binding) in [
            (DType::BF16, 64, Some("array<vec4<u32>>")),
            (DType::F16, 128, Some("array<vec4<u32>>")),
            (DType::F32, 64, Some("array<vec4<f32>>")),
            (DType::BF16, 12, Some("array<vec2<u32>>")),
            (DType::BF16, 6, None),
        ] {
            let p = lower_one(
                op.clone(),
                &[
                    Some((dtype, &[1, 4, 1, d])),
                    Some((dtype, &[1, 2, 40, d])),
                    Some((dtype, &[1, 2, 40, d])),
                    Some((DType::Bool, &[1, 1, 1, 40])),
                ],
            )
            .unwrap();
            let wgsl = &p.payload.kernels[p.payload.dispatches[0].kernel].wgsl;
            for f in ["fn k_row(", "fn v_row("] {
                assert_eq!(wgsl.contains(f), binding.is_some(), "{dtype} {d}: {f}");
            }
            if let Some(b) = binding {
                assert!(wgsl.contains(b), "{dtype} {d}: no {b}");
            }
            assert!(wgsl.contains("min(kall, atomicLoad(&tend))"), "{dtype} {d}");
        }
    }

    #[test]
    fn attention_kernels_validate() {
        let f = DType::F32;
        let op = |is_causal, enable_gqa| Op::Sdpa {
            is_causal,
            scale: None,
            enable_gqa,
        };
        // decode with GQA and a bool mask
        lower_one(
            op(false, true),
            &[
                Some((f, &[1, 4, 1, 8])),
                Some((f, &[1, 2, 19, 8])),
                Some((f, &[1, 2, 19, 6])),
                Some((DType::Bool, &[1, 19])),
            ],
        )
        .unwrap();
        // causal prefill in bf16, head dim 256
        lower_one(
            op(true, false),
            &[
                Some((DType::BF16, &[2, 13, 256])),
                Some((DType::BF16, &[2, 13, 256])),
                Some((DType::BF16, &[2, 13, 256])),
            ],
        )
        .unwrap();
        // long decode: the keys split over workgroups, then combined
        let p = lower_one(
            op(false, false),
            &[
                Some((f, &[2, 3, 1, 20])),
                Some((f, &[2, 3, 700, 20])),
                Some((f, &[2, 3, 700, 20])),
                Some((f, &[2, 1, 1, 700])),
            ],
        )
        .unwrap();
        assert_eq!(p.payload.dispatches.len(), 2);
        // prefill with q re-read per tile (head dim 80), split keys
        let p = lower_one(
            op(true, false),
            &[
                Some((f, &[1, 40, 80])),
                Some((f, &[1, 300, 80])),
                Some((f, &[1, 300, 80])),
            ],
        )
        .unwrap();
        assert_eq!(p.payload.dispatches.len(), 2);
        let e = lower_one(
            op(false, false),
            &[
                Some((f, &[1, 2, 3, 4])),
                Some((f, &[1, 2, 5, 4])),
                Some((f, &[1, 2, 5, 4])),
                Some((f, &[3, 3, 5])),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("broadcast"), "{e}");
        let e = lower_one(
            op(false, false),
            &[
                Some((f, &[2, 3, 300])),
                Some((f, &[2, 5, 300])),
                Some((f, &[2, 5, 4])),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("at most 256"), "{e}");
    }
}
