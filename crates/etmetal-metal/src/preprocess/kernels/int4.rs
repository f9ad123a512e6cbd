//! The weight-only quantized linears ([`Op::Int4Linear`],
//! [`Op::Int8Linear`]): `y [M, N] = x [M, K] @ W.T` with `W` in the layout
//! of `etmetal_core::quant`, read as int32 words (8 int4 or 4 int8 codes a
//! word; the passes give the GPU that view, since a uint8 buffer is widened
//! to a word an element). One kernel of each kind serves both code widths
//! ([`Codes`] says what differs).
//!
//! Decode (M <= 8, [`Qmv::lower`]) is bound by the weight bytes, read once: a
//! workgroup owns a few output channels and every activation row; its
//! invocations stride over the packed rows 16 bytes (4 words: 32 int4 or
//! 16 int8 codes) at a time, consecutive invocations on consecutive chunks
//! (coalesced), read a chunk's scale and zero once (every group of 32 or
//! more holds whole chunks) and dequantize in registers without
//! integer-to-float conversions; f32 partial sums meet in workgroup memory
//! (`gemm::reduce_sums`, no subgroup size assumed). Larger M takes the
//! tiled kernel ([`tiled`]) or its tensor-core forms.
//!
//! `metal::gather_qmv` ([`Op::GatherQmv`]) is the same kernel with a block
//! of one row, whose expert index picks the weight (an index out of range
//! is clamped to the last expert; the CPU kernel reports it as an error).
//!
//! [`Op::Int4Linear`]: etmetal_core::Op::Int4Linear
//! [`Op::Int8Linear`]: etmetal_core::Op::Int8Linear
//! [`Op::GatherQmv`]: etmetal_core::Op::GatherQmv

use std::fmt::Write;

use etmetal_core::quant::QuantFormat;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::epilogue::rounded;
use super::epilogue::Tail;
use super::gemm::{column_groups, reduce_sums, unrolled_passes, WORKGROUP_BYTES};
use super::glu::{Gated, GatedStore};
use super::matmul::row_stat_prologue;
use super::rows::as_rows;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::deferred::RowStat;
use crate::preprocess::emit::{entry, grid, lane_strided, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::{Kind, LazyRef};
use crate::preprocess::lowering::Lowering;

/// Activation rows a workgroup takes (decode batches up to 8 read the
/// weight once).
const ROWS: usize = 8;

/// What the kernels' code differs in between code widths.
#[derive(Clone, Copy, Debug)]
struct Codes(QuantFormat);

impl Codes {
    /// Codes in an int32 word.
    fn per_word(self) -> usize {
        self.0.per_word()
    }

    /// WGSL of `fn dec(w: u32) -> array<vec4<f32>, P>` (`P` = codes a
    /// word / 4): the codes of word `w`, four a vector in order, each
    /// times a power of two that [`Codes::scale`] undoes. A code masked in
    /// place into the mantissa of 1.0 is `1 + q·2^(s-23)` exactly (`s` its
    /// bit offset in its half word: a code's bits must lie in 0..23), so
    /// one AND/OR and a subtraction give `q·2^(s-23)` with no
    /// integer-to-float conversion (I2F runs at an eighth of the FMA rate
    /// on NVIDIA GPUs, too slow for 8.6 G codes per ms). int4: codes 0..3
    /// of each half word at bits 0, 4, 8, 12; int8: codes 0, 1 of each
    /// half at bits 0, 8.
    fn decode_fn(self) -> String {
        let one = "vec4<u32>(0x3f800000u)";
        match self.0.bits {
            4 => format!(
                "fn nib(w: u32) -> vec4<f32> {{\n\
                 \x20 let v = (vec4<u32>(w) & vec4<u32>(0xfu, 0xf0u, 0xf00u, 0xf000u)) | {one};\n\
                 \x20 return bitcast<vec4<f32>>(v) - vec4<f32>(1.0);\n}}\n\
                 fn dec(w: u32) -> array<vec4<f32>, 2> {{ return array<vec4<f32>, 2>(nib(w), nib(w >> 16u)); }}"
            ),
            _ => format!(
                "fn dec(w: u32) -> array<vec4<f32>, 1> {{\n\
                 \x20 let v = (vec4<u32>(w, w, w >> 16u, w >> 16u) & vec4<u32>(0xffu, 0xff00u, 0xffu, 0xff00u)) | {one};\n\
                 \x20 return array<vec4<f32>, 1>(bitcast<vec4<f32>>(v) - vec4<f32>(1.0));\n}}"
            ),
        }
    }

    /// The powers of two that turn [`Codes::decode_fn`]'s lanes back into
    /// codes, `2^(23-s)` per lane.
    fn scale(self) -> &'static str {
        match self.0.bits {
            4 => "vec4<f32>(8388608.0, 524288.0, 32768.0, 2048.0)",
            _ => "vec4<f32>(8388608.0, 32768.0, 8388608.0, 32768.0)",
        }
    }
}

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let (format, experts) = match (&node.op, QuantFormat::of_linear(&node.op)) {
        (_, Some(format)) => (format, false),
        (Op::GatherQmv { group_size }, _) => (QuantFormat::int4(*group_size), true),
        _ => {
            return Err(Error::internal(format!(
                "{} is not a quantized op",
                node.op.name()
            )))
        }
    };
    let group_size = format.group_size;
    let packed = lw.input_view(node, 1)?;
    let scales = lw.input_view(node, 2)?;
    let zeros = lw.input_view(node, 3)?;
    let lead = usize::from(experts);
    let per_word = format.per_word();
    if packed.dtype != DType::I32 || packed.shape.len() != 2 + lead {
        return Err(Error::unsupported(format!(
            "{} packed weight {} {:?}: the GPU kernel reads int32 words [.., N, K/{per_word}]",
            format.name(),
            packed.dtype,
            packed.shape
        )));
    }
    let x = qmv_operand(lw, node, experts)?;
    let rank = x.shape.len();
    let (xr, m, k) = as_rows(&x, &[rank.saturating_sub(1)]);
    let (n, words) = (packed.shape[lead], packed.shape[lead + 1]);
    // every group is a multiple of 32 (`quant::check_group`): the tiled
    // kernel's K step of 32 lies in one group
    if words * per_word != k || group_size % 32 != 0 || k % group_size != 0 {
        return Err(Error::invalid_input(format!(
            "{} weight of {n}x{words} words, group {group_size}, for K = {k}",
            format.name()
        )));
    }
    let idx = if experts {
        Some(lw.input_view(node, 4)?)
    } else {
        None
    };
    if !experts && m > ROWS {
        let out = lw.output_buffer(node, 0)?;
        let dims = Gemm { m, n, k, format };
        let d = lw.dispatches.len();
        tiled(lw, &xr, &packed, &scales, &zeros, out, dims)?;
        // the tensor-core forms, dequantizing as they stage (gemm/dequant.rs)
        let operands = super::gemm::QuantOperands {
            x: &xr,
            packed: &packed,
            scales: &scales,
            zeros: &zeros,
            format,
            m,
            n,
            k,
            out,
        };
        return operands.alternatives(lw, d);
    }
    // a decode product's store computes its pointwise tail (a skip
    // connection's add), or the gated value of its halves (a merged gate
    // and up); gather_qmv's stores none
    let gated = match experts {
        true => None,
        false => Gated::of_halves(lw, node),
    };
    let store = match (experts, gated) {
        (true, _) => Store::Tail(Tail::none(lw, node)?),
        (false, Some(gated)) => {
            let (store, halves) = gated.lower_halves(lw, node)?;
            let (_, dtype, _) = lw.output_info(node, 0)?;
            Store::Gated {
                store,
                halves,
                dtype,
            }
        }
        (false, None) => {
            let mut bound = vec![];
            for v in [&xr, &packed, &scales, &zeros] {
                v.buffers(&mut bound);
            }
            let checks = [&xr, &scales, &zeros].iter().any(|v| v.has_checks());
            Store::Tail(Tail::plan(lw, node, &bound, usize::from(checks), &[])?)
        }
    };
    let q = Qmv {
        x: &xr,
        packed: &packed,
        scales: &scales,
        zeros: &zeros,
        experts: idx.as_ref(),
        store,
        stats: if experts { vec![] } else { row_stats(lw, &xr) },
        m,
        n,
        words,
        codes: Codes(format),
    };
    q.lower(lw)
}

/// The operands of a decode-sized quantized product (see [`Qmv::lower`]).
struct Qmv<'a> {
    /// `[m, k]`.
    x: &'a LazyRef,
    /// `[(experts,) n, words]` int32 words.
    packed: &'a LazyRef,
    /// `[(experts,) n, k / group_size]` each.
    scales: &'a LazyRef,
    zeros: &'a LazyRef,
    /// gather_qmv: each row's expert `[m]`.
    experts: Option<&'a LazyRef>,
    /// How the `[m, n]` sums are stored.
    store: Store,
    /// The row means `x` reads (an RMSNorm's), which the kernel computes.
    stats: Vec<(RowStat, DType)>,
    m: usize,
    n: usize,
    words: usize,
    codes: Codes,
}

/// How a [`Qmv`] stores its sums.
enum Store {
    /// As its output `[m, n]`, and its pointwise tail.
    Tail(Tail),
    /// As the gated value `[m, n/2]` of its two halves (a merged gate and
    /// up, `glu.rs`): columns are interleaved, even ones channels of the
    /// first half, odd ones the second's, so a workgroup holds both sums of
    /// an output; `halves` are the buffers the store substitutes for them,
    /// and `dtype` the product's.
    Gated {
        store: GatedStore,
        halves: [BufferIdx; 2],
        dtype: DType,
    },
}

/// Independent 16-byte weight loads an invocation issues before using
/// them (channels × unrolled chunks; as the matrix-vector GEMM's).
const QMV_LOADS: usize = 8;

/// Workgroups wanted before a workgroup takes fewer channels (four of 128
/// invocations on each of an H200's 132 units).
const QMV_FILL: usize = 512;

impl Qmv<'_> {
    /// WGSL of `fn wc((e,) c, q)`: the `cw` words of chunk `q` of channel
    /// `c` (of expert `e`), one 16-byte load where `cw` is 4.
    fn words_fn(&self, kb: &mut KernelBuilder, cw: usize) -> Result<String> {
        let (n, words) = (self.n, self.words);
        let at_e = if self.experts.is_some() { "e, " } else { "" };
        let mut fns = String::new();
        // the words of chunk `q` of channel `c` (of expert `e`)
        let lead = if self.experts.is_some() {
            "e: u32, "
        } else {
            ""
        };
        match (&self.packed.kind, cw) {
            (Kind::Load(buf), 4) => {
                let at = match self.experts {
                    Some(_) => format!("(e * {n}u + c) * {}u + q", words / 4),
                    None => format!("c * {}u + q", words / 4),
                };
                let load = kb.load_words4(*buf, &at)?;
                let _ = writeln!(
                    fns,
                    "fn wc({lead}c: u32, q: u32) -> vec4<u32> {{ return {load}; }}"
                );
            }
            (_, 1) => {
                kb.value_fn(self.packed, "wq")?;
                let _ = writeln!(
                    fns,
                    "fn wc({lead}c: u32, q: u32) -> u32 {{ return bitcast<u32>(wq({at_e}c, q)); }}"
                );
            }
            _ => {
                kb.value_fn(self.packed, "wq")?;
                let parts: Vec<String> = (0..cw)
                    .map(|w| format!("bitcast<u32>(wq({at_e}c, q * {cw}u + {w}u))"))
                    .collect();
                let _ = writeln!(
                    fns,
                    "fn wc({lead}c: u32, q: u32) -> vec{cw}<u32> {{ return vec{cw}<u32>({}); }}",
                    parts.join(", ")
                );
            }
        }
        Ok(fns)
    }

    /// Append the kernel. A workgroup takes `cols` channels (4, 2 or 1:
    /// the most that keep [`QMV_FILL`] workgroups) for a block of rows
    /// (every row; one for gather_qmv, whose rows pick their own expert).
    /// Its invocations stride over the packed rows in chunks of `cw` words
    /// (4, one `vec4<u32>` load, where the words, the groups and the
    /// buffer allow, else the words of 8 codes), unrolled so about
    /// [`QMV_LOADS`] loads are in flight. Codes become floats without
    /// conversions ([`Codes::decode_fn`]); the products with x gather per
    /// lane in a vector scaled back once per chunk. `w = q·scale + zero` is
    /// applied per chunk as `scale·Σxq + zero·Σx`.
    ///
    /// An `x` that is computed (an RMSNorm's scaling, a SiLU gate, a
    /// permuted view) is first evaluated once per workgroup into workgroup
    /// memory ([`Stage`]), a block of `k` at a time, rather than by every
    /// invocation that reads it: on an H100 this made a Llama-1B-shaped
    /// int4 decode step 1.9× faster (5.12 → 2.70 ms GPU). Each block's
    /// first words, scales and zeros are loaded before the prologue and
    /// the staging, whose barriers would otherwise hold them back (on an
    /// H100: down 1.07× faster, the head 1.08×, gate/up and q/k/v
    /// 0.96–0.97×; the step within 1%).
    fn lower(&self, lw: &mut Lowering) -> Result<()> {
        let (m, n, words) = (self.m, self.n, self.words);
        let gs = self.codes.0.group_size;
        if m == 0 || n == 0 {
            // nothing to write
            return Ok(());
        }
        let per_word = self.codes.per_word();
        let k = words * per_word;
        let mut kb = KernelBuilder::new(&lw.buffers);
        kb.value_fn(self.scales, "sc")?;
        kb.value_fn(self.zeros, "ze")?;
        let (mb, at_e) = match self.experts {
            Some(idx) => {
                kb.value_fn(idx, "ex")?;
                (1, "e, ")
            }
            None => (m.clamp(1, ROWS), ""),
        };
        let mblocks = m.div_ceil(mb);
        let whole = matches!(self.packed.kind, Kind::Load(_));
        // words of a chunk: 16 bytes, or 8 codes (what `xw` loads)
        let cw = if whole && words.is_multiple_of(4) && gs.is_multiple_of(4 * per_word) {
            4
        } else {
            8 / per_word
        };
        // activation loads of 8 a chunk, and vec4 pieces of codes a word
        let (loads, pieces) = (cw * per_word / 8, per_word / 4);
        let mut fns = self.words_fn(&mut kb, cw)?;
        let chunks = words / cw;
        let pairs = matches!(self.store, Store::Gated { .. });
        let cols = [4, 2]
            .into_iter()
            .find(|&c| mb * c <= 32 && n.div_ceil(c) * mblocks >= QMV_FILL)
            .unwrap_or(if pairs { 2 } else { 1 });
        // staged: one chunk of a block per invocation (measured faster
        // than two, and than the bf16 products' deep layout of four chunks
        // in full workgroups: on an H100, int4 gate/up 0.474 -> 0.506 ms,
        // a Llama-1B step 1.525 -> 1.599 ms end to end); else two chunks
        // of all of k
        let layout = |stage: Option<Stage>| {
            let span = stage.map_or(chunks.div_ceil(2), |st| st.chunks);
            let threads = span.next_power_of_two().clamp(32, 128);
            let unroll = (QMV_LOADS / cols).min(span / threads).max(1);
            (
                threads,
                unroll,
                column_groups(n.div_ceil(cols) * mblocks, threads),
            )
        };
        let mut stage = match self.experts.is_none() && x_run(self.x).is_none() {
            true => Stage::plan(mb, chunks, cw * per_word),
            false => None,
        };
        let (mut threads, mut unroll, mut groups) = layout(stage);
        if let Some(st) = stage {
            // the partial sums and the block within what every adapter
            // offers: fewer column groups a workgroup, else no staging
            let means: usize = self.stats.iter().map(|(st, _)| 4 * st.rows).sum();
            let fits = |groups: usize| {
                4 * mb * cols * threads * groups + st.bytes(mb) + means <= WORKGROUP_BYTES
            };
            while !fits(groups) && groups > 1 {
                groups /= 2;
            }
            if !fits(groups) {
                stage = None;
                (threads, unroll, groups) = layout(None);
            }
        }
        let size = threads * groups;
        let blocks = n.div_ceil(cols * groups);
        let sums = mb * cols;

        // an RMSNorm's mean that x reads: each workgroup computes it first
        let (decls, prologue) = row_stat_prologue(&mut kb, &self.stats, "", size)?;
        // eight activations from `k` (a multiple of 8) of row `r`
        let xw = match x_run(self.x) {
            // the block staged from `kb` (`k` is relative to it)
            _ if stage.is_some() => {
                kb.value_fn(self.x, "x")?;
                let depth = stage.map_or(0, |st| st.depth());
                format!("array<vec4<f32>, 2>(xs[(r * {depth}u + k) / 4u], xs[(r * {depth}u + k) / 4u + 1u])")
            }
            Some(buf) => kb.load8(buf, &format!("(r * {k}u + k) / 8u"))?,
            None => {
                kb.value_fn(self.x, "x")?;
                let quad = |h: usize| {
                    let l: Vec<String> = (4 * h..4 * h + 4)
                        .map(|i| format!("x(r, k + {i}u)"))
                        .collect();
                    format!("vec4<f32>({})", l.join(", "))
                };
                format!("array<vec4<f32>, 2>({}, {})", quad(0), quad(1))
            }
        };
        let _ = writeln!(
            fns,
            "fn xw(r: u32, k: u32) -> array<vec4<f32>, 2> {{ return {xw}; }}\n{}",
            self.codes.decode_fn()
        );

        // the store of output (r, c), its f32 sum `v` (and the second
        // half's `u`)
        let (tail_decls, write) = match &self.store {
            Store::Tail(tail) => tail.store(&mut kb, &format!("(r * {n}u + c)"), "v", "")?,
            Store::Gated {
                store,
                halves: [first, second],
                dtype,
            } => store.store(
                &mut kb,
                &format!("(r * {}u + (c >> 1u))", n / 2),
                [
                    (*first, rounded("v", *dtype)),
                    (*second, rounded("u", *dtype)),
                ],
            )?,
        };
        let staged = match stage {
            Some(st) => format!(
                "var<workgroup> xs: array<vec4<f32>, {}>;\n",
                mb * st.depth() / 4
            ),
            None => String::new(),
        };
        let mut s = format!(
            "{fns}\n{decls}{tail_decls}{staged}var<workgroup> red: array<f32, {}>;\n{}",
            sums * size,
            entry(size as u32)
        );
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let n0 = (g % {blocks}u) * {}u;\n  let m0 = (g / {blocks}u) * {mb}u;\n\
             \x20 let grp = lid / {threads}u;\n  let tl = lid % {threads}u;",
            blocks * mblocks,
            cols * groups
        );
        if self.experts.is_some() {
            let count = self.packed.shape[0];
            let _ = writeln!(s, "  let e = u32(clamp(i32(ex(m0)), 0i, {}i));", count - 1);
        }
        for j in 0..cols {
            // a last block's missing channels read the last one (not stored)
            let c = match pairs {
                true => format!("((n0 + grp * {cols}u + {j}u) >> 1u) + {}u", j % 2 * n / 2),
                false => format!("n0 + grp * {cols}u + {j}u"),
            };
            let _ = writeln!(s, "  let c{j} = min({c}, {}u);", n - 1);
        }
        for i in 0..mb {
            let _ = writeln!(s, "  let r{i} = min(m0 + {i}u, {}u);", m - 1);
            for j in 0..cols {
                let _ = writeln!(s, "  var s{i}_{j} = 0.0;");
            }
        }
        let scale = self.codes.scale();
        // the chunks of a pass: all of k, or a staged block's from `qb`
        let (span, base, local) = match stage {
            Some(st) => (st.chunks, "qb + ", " - kb"),
            None => (chunks, "", ""),
        };
        // the words of `u` chunks `q + x·threads` of each channel, and
        // their scales and zeros
        let loads_of = |s: &mut String, u: usize| {
            for x in 0..u {
                let _ = writeln!(s, "    let q{x} = q + {}u;", x * threads);
                for j in 0..cols {
                    let _ = writeln!(s, "    let w{x}_{j} = wc({at_e}c{j}, q{x});");
                }
                let _ = writeln!(
                    s,
                    "    let k{x} = q{x} * {}u;\n    let g{x} = k{x} / {gs}u;",
                    cw * per_word
                );
                for j in 0..cols {
                    let _ = writeln!(
                        s,
                        "    let sc{x}_{j} = sc({at_e}c{j}, g{x});\n    let ze{x}_{j} = ze({at_e}c{j}, g{x});"
                    );
                }
            }
        };
        // their products with the activations
        let math_of = |s: &mut String, u: usize| {
            for x in 0..u {
                for i in 0..mb {
                    let mut total = vec![];
                    for l in 0..loads {
                        let _ = writeln!(
                            s,
                            "    let x{x}_{i}_{l} = xw(r{i}, k{x}{local} + {}u);",
                            8 * l
                        );
                        total.push(format!("x{x}_{i}_{l}[0] + x{x}_{i}_{l}[1]"));
                    }
                    let _ = writeln!(
                        s,
                        "    let sx{x}_{i} = dot({}, vec4<f32>(1.0));",
                        total.join(" + ")
                    );
                }
                for j in 0..cols {
                    for w in 0..cw {
                        let word = match cw {
                            1 => format!("w{x}_{j}"),
                            _ => format!("w{x}_{j}[{w}]"),
                        };
                        let _ = writeln!(s, "    let d{x}_{j}_{w} = dec({word});");
                    }
                    for i in 0..mb {
                        // vec4 piece p of the chunk's activations meets
                        // piece p of its codes
                        let terms: Vec<String> = (0..cw * pieces)
                            .map(|p| {
                                let (w, e) = (p / pieces, p % pieces);
                                format!("x{x}_{i}_{}[{}] * d{x}_{j}_{w}[{e}]", p / 2, p % 2)
                            })
                            .collect();
                        let _ = writeln!(
                            s,
                            "    s{i}_{j} = s{i}_{j} + sc{x}_{j} * dot({}, {scale}) + ze{x}_{j} * sx{x}_{i};",
                            terms.join(" + ")
                        );
                    }
                }
            }
        };
        let passes =
            |pre: &str| unrolled_passes(base, span, threads, unroll, pre, loads_of, math_of);
        match stage {
            Some(st) if st.depth() == k => {
                let pre = prologue.clone() + &st.fill(mb, size);
                let _ = write!(
                    s,
                    "  {{\n  let kb = 0u;\n  let qb = 0u;\n{}  }}\n",
                    passes(&pre)
                );
            }
            Some(st) => {
                s.push_str(&prologue);
                s.push_str(&st.blocks(k, &passes(&st.fill(mb, size))));
            }
            None => s.push_str(&passes(&prologue)),
        }
        let names: Vec<String> = (0..mb)
            .flat_map(|i| (0..cols).map(move |j| format!("s{i}_{j}")))
            .collect();
        let store = format!(
            "let c = n0 + (x / {sums}u) * {cols}u + x % {cols}u;\n    let r = m0 + (x % {sums}u) / {cols}u;\n\
             \x20   if (c < {n}u && r < {m}u) {{ {write} }}"
        );
        s.push_str(&reduce_sums(&names, threads, groups, pairs, &store));
        s.push_str("}\n");
        let built = kb.finish(&s);
        let workgroups = grid((blocks * mblocks) as u64, lw.options.max_workgroups_per_dim)?;
        let ops = vec![lw.op_label()];
        let staged = stage.map_or(0, |st| st.bytes(mb));
        let storage = (4 * sums * size + staged) as u32;
        lw.add_dispatch(built, ops, [size as u32, 1, 1], workgroups, storage)
    }
}

/// Workgroup memory for the staged activations of a [`Qmv`], leaving
/// the partial sums and the row means room within [`WORKGROUP_BYTES`].
const STAGE_BYTES: usize = 8192;

/// How a [`Qmv`] stages a computed `x`: blocks of `chunks` chunks of `k`
/// (each `codes` deep), every row of the block evaluated once into the
/// workgroup array `xs` before the invocations read it.
#[derive(Clone, Copy)]
struct Stage {
    chunks: usize,
    codes: usize,
}

impl Stage {
    /// The fewest equal blocks of whole chunks that fit [`STAGE_BYTES`]
    /// for `mb` rows; none where a block would hold fewer chunks than a
    /// 32-wide column group has invocations (too short a `k` to gain).
    fn plan(mb: usize, chunks: usize, codes: usize) -> Option<Stage> {
        let fit = STAGE_BYTES / (4 * mb * codes);
        let blocks = (chunks.div_ceil(fit.max(1))..=chunks).find(|&b| chunks.is_multiple_of(b))?;
        let chunks = chunks / blocks;
        (chunks >= 32).then_some(Stage { chunks, codes })
    }

    /// Codes of `k` a block holds.
    fn depth(&self) -> usize {
        self.chunks * self.codes
    }

    fn bytes(&self, mb: usize) -> usize {
        4 * mb * self.depth()
    }

    /// Statements staging `mb` rows of the block from code `kb` into `xs`
    /// (all `size` invocations), then a barrier.
    fn fill(&self, mb: usize, size: usize) -> String {
        let quads = self.depth() / 4;
        let body = format!(
            "    let r = i / {quads}u;\n    let c = kb + (i % {quads}u) * 4u;\n\
             \x20   xs[i] = vec4<f32>(x(r, c), x(r, c + 1u), x(r, c + 2u), x(r, c + 3u));\n"
        );
        lane_strided("i", mb * quads, size, &body) + "  workgroupBarrier();\n"
    }

    /// The loop over the blocks of `k` (`kb` the first code, `qb` the
    /// first chunk of a block) running `passes` (which stage the block).
    fn blocks(&self, k: usize, passes: &str) -> String {
        let depth = self.depth();
        format!(
            "  for (var kb = 0u; kb < {k}u; kb = kb + {depth}u) {{\n\
             \x20 let qb = kb / {codes}u;\n{passes}  workgroupBarrier();\n  }}\n",
            codes = self.codes,
        )
    }
}

/// The pending row means ([`RowStat`]) `x` reads.
fn row_stats(lw: &Lowering, x: &LazyRef) -> Vec<(RowStat, DType)> {
    let mut read = vec![];
    x.buffers(&mut read);
    lw.pending
        .iter()
        .filter(|st| read.contains(&st.buf))
        .map(|st| (st.clone(), lw.buffers.list[st.buf].dtype))
        .collect()
}

/// Input 0. For at most [`ROWS`] rows (a [`Qmv`]) a pointwise input is
/// read as it is, its math repeated by each workgroup (an RMSNorm's
/// scaling, a SiLU gate: cheaper than a dispatch writing it out), where
/// the kernel's bindings hold its buffers; else a view.
fn qmv_operand(lw: &mut Lowering, node: &Node, experts: bool) -> Result<LazyRef> {
    let x = lw.input(node, 0)?;
    let k = x.shape.last().copied().unwrap_or(1).max(1);
    let rows = x.shape.iter().product::<usize>() / k;
    if rows > ROWS {
        return lw.input_view(node, 0);
    }
    // packed words, scales, zeros, the output (and the experts)
    let fixed = 4 + usize::from(experts);
    let fits = |v: &[&LazyRef]| {
        let mut bufs = vec![];
        v.iter().for_each(|x| x.buffers(&mut bufs));
        let checks = v.iter().any(|x| x.has_checks());
        fixed + bufs.len() + usize::from(checks) <= lw.options.max_bindings
    };
    match x.is_view() || fits(&[&x]) {
        true => Ok(x),
        false => lw.input_view(node, 0),
    }
}

/// The buffer `x` (`[m, k]` rows) reads row-major and whole, so eight
/// elements from a multiple of 8 are one chunk of it: a load, or a
/// reshape of one. Not one through permutes of size-1 dims, which the
/// float products read in place ([`Lazy::contiguous_source`]): a
/// Llama-1B-shaped int4 step's o product (k 2048) took 0.226 ms read in
/// place against 0.162 ms staged (H100, `binaries_glu_h100.json`).
///
/// [`Lazy::contiguous_source`]: crate::preprocess::expr::Lazy::contiguous_source
fn x_run(x: &LazyRef) -> Option<BufferIdx> {
    match &x.kind {
        Kind::Load(buf) => Some(*buf),
        Kind::Reshape(inner) => match inner.kind {
            Kind::Load(buf) => Some(buf),
            _ => None,
        },
        _ => None,
    }
}

/// Output tile edge of the tiled kernel, and its K step (one step lies in
/// one group: every group size is a multiple of 32).
const TILE: usize = 32;

struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    format: QuantFormat,
}

/// Prefill (M > 8): a workgroup of 256 computes a 32x32 tile of `y`, each
/// invocation 2x2. Per K step of 32 it stages the activation tile and the
/// weight tile, dequantizing the weight while staging (4 int4 or 8 int8
/// words a row, one scale and zero: the step lies in one group), so each
/// packed word is read once per tile row of M.
fn tiled(
    lw: &mut Lowering,
    x: &LazyRef,
    packed: &LazyRef,
    scales: &LazyRef,
    zeros: &LazyRef,
    out: BufferIdx,
    d: Gemm,
) -> Result<()> {
    let Gemm { m, n, k, format } = d;
    let group_size = format.group_size;
    // codes a word, the words of a 32-wide row, a code's bits
    let (per, row_words, bits) = (format.per_word(), TILE / format.per_word(), format.bits);
    let wg = 256u32;
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(x, "x")?;
    kb.value_fn(packed, "wq")?;
    kb.value_fn(scales, "sc")?;
    kb.value_fn(zeros, "ze")?;
    let tiles_n = n.div_ceil(TILE);
    let tiles = m.div_ceil(TILE) * tiles_n;
    let store = kb.store(out, &format!("mm * {n}u + nn"), "acc[a * 2u + b]")?;
    let mut main = format!(
        "var<workgroup> xs: array<f32, {sz}>;\nvar<workgroup> ws: array<f32, {sz}>;\n",
        sz = TILE * (TILE + 1)
    );
    main.push_str(&entry(wg));
    main.push_str(&format!(
        "  let tile = {FLAT_GROUP};\n  if (tile >= {tiles}u) {{ return; }}\n\
         \x20 let n0 = (tile % {tiles_n}u) * {TILE}u;\n  let m0 = (tile / {tiles_n}u) * {TILE}u;\n\
         \x20 let ty = lid / 16u;\n  let tx = lid % 16u;\n\
         \x20 var acc: array<f32, 4>;\n\
         \x20 for (var i = 0u; i < 4u; i = i + 1u) {{ acc[i] = 0.0; }}\n\
         \x20 for (var k0 = 0u; k0 < {k}u; k0 = k0 + {TILE}u) {{\n\
         \x20   for (var i = 0u; i < 4u; i = i + 1u) {{\n\
         \x20     let e = lid + i * {wg}u;\n      let r = e / {TILE}u;\n      let c = e % {TILE}u;\n\
         \x20     xs[r * {TP}u + c] = x(min(m0 + r, {ml}u), k0 + c);\n\
         \x20   }}\n\
         \x20   if (lid < {words}u) {{\n\
         \x20     let r = lid / {row_words}u;\n      let wi = lid % {row_words}u;\n      let nr = min(n0 + r, {nl}u);\n\
         \x20     let q = bitcast<u32>(wq(nr, k0 / {per}u + wi));\n\
         \x20     let g = k0 / {group_size}u;\n      let s = sc(nr, g);\n      let z = ze(nr, g);\n\
         \x20     for (var i = 0u; i < {per}u; i = i + 1u) {{\n\
         \x20       ws[r * {TP}u + wi * {per}u + i] = f32((q >> ({bits}u * i)) & {mask}u) * s + z;\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20   for (var kk = 0u; kk < {TILE}u; kk = kk + 1u) {{\n\
         \x20     for (var a = 0u; a < 2u; a = a + 1u) {{\n\
         \x20       let xv = xs[(ty * 2u + a) * {TP}u + kk];\n\
         \x20       for (var b = 0u; b < 2u; b = b + 1u) {{\n\
         \x20         acc[a * 2u + b] = acc[a * 2u + b] + xv * ws[(tx * 2u + b) * {TP}u + kk];\n\
         \x20       }}\n\
         \x20     }}\n\
         \x20   }}\n\
         \x20   workgroupBarrier();\n\
         \x20 }}\n\
         \x20 for (var a = 0u; a < 2u; a = a + 1u) {{\n\
         \x20   for (var b = 0u; b < 2u; b = b + 1u) {{\n\
         \x20     let mm = m0 + ty * 2u + a;\n      let nn = n0 + tx * 2u + b;\n\
         \x20     if (mm < {m}u && nn < {n}u) {{ {store} }}\n\
         \x20   }}\n\
         \x20 }}\n}}\n",
        TP = TILE + 1,
        ml = m - 1,
        nl = n - 1,
        words = TILE * row_words,
        mask = format.max_code(),
    ));
    let workgroups = grid(tiles as u64, lw.options.max_workgroups_per_dim)?;
    let ops = vec![lw.op_label()];
    let storage = (2 * TILE * (TILE + 1) * 4) as u32;
    lw.add_dispatch(kb.finish(&main), ops, [wg, 1, 1], workgroups, storage)
}

#[cfg(test)]
mod tests {
    use crate::preprocess::kernels::testing::lower_int4_linear;
    use etmetal_core::DType;

    fn decode(dtype: DType, m: usize, n: usize, k: usize, g: usize) -> String {
        let p = lower_int4_linear(dtype, m, n, k, g)
            .unwrap_or_else(|e| panic!("{dtype:?} {m}x{n}x{k} g{g}: {e}"));
        let kernel = &p.payload.kernels[p.payload.dispatches[0].kernel];
        kernel.wgsl.clone()
    }

    /// The decode kernel reads the packed weight and 16-bit activations in
    /// 16-byte loads for every group size of 32 or more (validated by naga,
    /// with MSL).
    #[test]
    fn decode_reads_16_byte_chunks() {
        for g in [32, 64, 128, 256] {
            for (dtype, m) in [(DType::BF16, 1), (DType::F16, 3), (DType::F32, 8)] {
                let wgsl = decode(dtype, m, 72, 512, g);
                assert!(wgsl.contains("array<vec4<i32>>"), "g{g}: words one by one");
                let x = match dtype {
                    DType::F32 => "array<vec4<f32>>",
                    _ => "array<vec4<u32>>",
                };
                assert!(wgsl.contains(x), "{dtype:?}: activations not in chunks");
                assert!(!wgsl.contains("f32(q"), "a code converted from an integer");
            }
        }
    }
}

#[cfg(test)]
mod int8_tests {
    use crate::preprocess::kernels::testing::lower_quant_linear;
    use etmetal_core::quant::QuantFormat;
    use etmetal_core::DType;

    /// The int8 decode kernel is the int4 one with 4 codes a word: 16-byte
    /// weight loads (an int8 row is a multiple of 32 codes, 8 words, so
    /// whole chunks), per group and per output channel (a group of all of
    /// K), one `dec` a word, no integer-to-float conversion. Prefill takes
    /// the tiled kernel. All validated by naga, with MSL.
    #[test]
    fn int8_decode_reads_16_byte_chunks() {
        let wgsl = |g, m, n, k| {
            let p = lower_quant_linear(QuantFormat::int8(g), DType::BF16, m, n, k)
                .unwrap_or_else(|e| panic!("int8 {m}x{n}x{k} g{g}: {e}"));
            let kernel = &p.payload.kernels[p.payload.dispatches[0].kernel];
            (kernel.name.clone(), kernel.wgsl.clone())
        };
        for (g, m, k) in [
            (32, 1, 512),
            (128, 3, 256),
            (640, 8, 640),
            (2048, 1, 2048),
            (32, 2, 160),
        ] {
            let (name, w) = wgsl(g, m, 72, k);
            assert!(name.ends_with("int8_linear"), "{name}");
            assert!(w.contains("array<vec4<i32>>"), "g{g}: words one by one");
            assert!(w.contains("0xff00u"), "g{g}: not the 8-bit decode");
            assert!(!w.contains("f32(q"), "a code converted from an integer");
        }
        let (name, w) = wgsl(32, 40, 72, 256);
        assert!(name.ends_with("int8_linear"), "{name}");
        assert!(w.contains("255u"), "the tiled kernel masks 8-bit codes");
    }
}
