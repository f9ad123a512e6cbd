//! The matrix-vector form of a product: for at most [`GEMV_ROWS`] rows
//! per batch against a right operand contiguous along `k` (a decode
//! step's linear layers), read once in coalesced 16-byte chunks.

use std::fmt::Write;

use etmetal_core::Result;

use super::spec::GemvArgs;
use super::split::{split_k, SplitK};
use crate::preprocess::emit::{entry, grid, lane_strided, KernelBuilder, FLAT_GROUP};
use crate::preprocess::lowering::Lowering;

/// Rows (per batch) up to which a product with a `k`-contiguous right
/// operand (a linear layer's weight) is a [`Gemv`].
pub(crate) const GEMV_ROWS: usize = 8;

/// Accumulators of a [`Gemv`] invocation (`rows × columns`), bounded so a
/// 128-invocation workgroup's partial sums fit [`WORKGROUP_BYTES`].
const GEMV_SUMS: usize = 32;

/// Workgroup memory of a matrix-vector kernel (a [`Gemv`], the quantized
/// decode product) at most: wgpu's default limit, which every adapter
/// offers.
pub(crate) const WORKGROUP_BYTES: usize = 16384;

/// Workgroups a [`Gemv`] wants before it gives each fewer columns: about
/// four 128-invocation workgroups on each of an H200's 132 units.
const GEMV_FILL: u64 = 512;

/// Workgroups below which a [`Gemv`] stops adding column groups to a
/// workgroup (about one per unit of a large GPU).
pub(crate) const GROUP_FILL: usize = 128;

/// Invocations of a workgroup at most when it takes several column groups.
pub(crate) const GROUP_THREADS: usize = 256;

/// Column groups of a matrix-vector workgroup: the most (a power of two,
/// `groups · threads ≤ GROUP_THREADS`) that keep [`GROUP_FILL`]
/// workgroups over `blocks` blocks of columns. Each group takes its own
/// columns over all of `k` with `threads` invocations, so a workgroup
/// reads the activations (and computes a prologue) once for all its
/// groups' columns: with a block of a few columns, an int4 weight's
/// bytes are fewer than the activations' each workgroup reads.
pub(crate) fn column_groups(blocks: usize, threads: usize) -> usize {
    let mut g = 1;
    while 2 * g * threads <= GROUP_THREADS && blocks.div_ceil(2 * g) >= GROUP_FILL {
        g *= 2;
    }
    g
}

/// Workgroups a [`Gemv`] whose left operand is computed (staged once a
/// workgroup) keeps while it gives each invocation more chunks of `k`
/// (16, else 8, else 4, in full workgroups of [`GROUP_THREADS`]): more
/// chunks an invocation means more columns a workgroup, over which the
/// evaluation of the left operand is shared, but too few workgroups leave
/// HBM idle. Otherwise, and for a plain left operand, two chunks. On an
/// H100 (2026-12-06, a Llama-1B-shaped bf16 decode step, against two
/// chunks everywhere) this made gate/up 1.54× faster (16 chunks, 256
/// workgroups), the head 1.63× (16), q/k/v 1.39× (4 chunks, 192
/// workgroups, where 8 chunks in half-size workgroups gave 1.30×), and
/// kept down (8192 deep: 128 invocations either way); 8 or 16 chunks for a
/// plain operand (o) were 1.12–1.22× slower.
const GEMV_DEEP_WORKGROUPS: usize = 192;

/// Independent 16-byte loads of the right operand an invocation issues
/// before it uses them (columns × unrolled chunks): enough bytes in flight
/// per unit to cover HBM latency without a deep queue of workgroups.
const GEMV_LOADS: usize = 8;

/// A matrix-vector-like product: `m ≤ 8` rows per batch times a right
/// operand whose columns are contiguous along `k` (`[n, k]` weights). It is
/// memory-bound on the right operand, so each element of it is read once:
/// a workgroup owns `cols` columns and every row, its invocations stride
/// over `k` in chunks of 16 bytes of the right operand (8 elements when
/// 16-bit, else 4; neighbours read neighbouring chunks, so a subgroup's
/// loads are one coalesced run), issuing up to [`GEMV_LOADS`] loads before
/// using them, keep `rows × cols` f32 partial sums, and add them up across
/// the workgroup in workgroup memory ([`reduce_sums`]); too few columns for
/// a large GPU split a deep `k` among workgroups ([`SplitK`]). A workgroup
/// of several column groups reads each chunk of the left operand once a
/// group; where that read is more than a load (an RMSNorm's scaling, a SiLU
/// gate, a permuted view), the workgroup instead evaluates its rows of the
/// left operand once into workgroup memory and the groups read them there
/// ([`Stage`]), in blocks of `k` where they do not fit at once. All of it
/// stays within [`WORKGROUP_BYTES`]. The caller's [`GemvArgs`] read the
/// operands in chunks along `k` and store the results.
pub(crate) struct Gemv {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// How a [`Gemv`]'s workgroups divide the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    /// Invocations of a column group (see [`column_groups`]).
    threads: usize,
    /// Columns a group owns.
    cols: usize,
    /// Column groups of a workgroup.
    groups: usize,
    /// Parts `k` is split into among workgroups.
    splits: usize,
    /// Elements of a chunk (one 16-byte load of the right operand).
    lanes: usize,
    /// Chunks of each column an invocation loads at once.
    unroll: usize,
    /// Columns come in pairs, one of each of two products (see
    /// [`Gemv::lower_pair`]): `cols` is even.
    pairs: bool,
}

impl Plan {
    /// Invocations of a workgroup.
    fn size(&self) -> usize {
        self.threads * self.groups
    }

    /// Columns of a workgroup.
    fn block(&self) -> usize {
        self.cols * self.groups
    }
}

/// How a [`Gemv`] workgroup stages the left operand's rows in workgroup
/// memory (`xs`, f32; half `h` of chunk `c` of row `r` at `(r · lanes/4 +
/// h) · block + c`, so neighbouring invocations read neighbouring words):
/// a block of `k` at a time, each block filled by all invocations (one
/// evaluation of A an element), then read by every column group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stage {
    /// Chunks of each row a block holds: the whole of a split's `k`, else
    /// a multiple of the unrolled loop's step (`unroll · threads`, fewer
    /// chunks unrolled where not one step fits).
    block: usize,
}

impl Gemv {
    /// The most columns (≤ 4) that keep enough workgroups, `k` split when
    /// there still are too few and each part keeps 32 invocations busy
    /// with two chunks (at most `most` splits); invocations for two chunks
    /// each of a part of `k` (32 to 128), or, where the left operand is
    /// `computed`, for up to 16 (see [`GEMV_DEEP_WORKGROUPS`]); unrolled to
    /// about [`GEMV_LOADS`] loads. `wide`: the right operand is 16-bit
    /// (8-element chunks where `k` allows). `pairs`: columns in pairs
    /// ([`Gemv::lower_pair`]), at least two a column group.
    fn plan(&self, most: usize, wide: bool, computed: bool, pairs: bool) -> Plan {
        let lanes = if wide && self.k.is_multiple_of(8) {
            8
        } else {
            4
        };
        let cols = [4, 2]
            .into_iter()
            .find(|&c| {
                self.m * c <= GEMV_SUMS && (self.n.div_ceil(c) * self.batch) as u64 >= GEMV_FILL
            })
            .unwrap_or(if pairs { 2 } else { 1 });
        let groups = (self.n.div_ceil(cols) * self.batch) as u64;
        let splits = split_k(groups, GEMV_FILL, self.k, lanes * 64, lanes, most);
        let chunks = (self.k / splits).div_ceil(lanes).max(1);
        let blocks = self.n.div_ceil(cols) * self.batch * splits;
        // (invocations of a column group, column groups of a workgroup)
        let layout = |per: usize, least: usize| {
            let threads = chunks.div_ceil(per).next_power_of_two().clamp(least, 128);
            let mut groups = column_groups(blocks, threads);
            // (the partial sums within the workgroup memory: up to 8 rows)
            while groups > 1 && 4 * self.m * cols * threads * groups > WORKGROUP_BYTES {
                groups /= 2;
            }
            (threads, groups)
        };
        let deep = [16, 8, 4]
            .into_iter()
            .map(|per| layout(per, 16))
            .find(|&(t, g)| t * g == GROUP_THREADS && blocks.div_ceil(g) >= GEMV_DEEP_WORKGROUPS);
        let (threads, groups) = match deep {
            Some(deep) if computed => deep,
            _ => layout(2, 32),
        };
        let unroll = (GEMV_LOADS / cols)
            .min(GEMV_LOADS / self.m.max(1))
            .min(chunks / threads)
            .max(1);
        Plan {
            threads,
            cols,
            groups,
            splits,
            lanes,
            unroll,
            pairs,
        }
    }

    /// How a workgroup stages the left operand when `fixed` bytes of
    /// workgroup memory are already taken: the whole of a split's `k` where
    /// it fits, else blocks of as many unrolled steps as fit (fewer chunks
    /// unrolled where not one step does); `None` (the operand read in
    /// place) for one column group, which reads each chunk once anyway, or
    /// where not even one chunk per invocation fits.
    fn stage(&self, plan: &Plan, fixed: usize) -> Option<Stage> {
        if plan.groups == 1 {
            return None;
        }
        let chunks = (self.k / plan.splits).div_ceil(plan.lanes);
        let fit = WORKGROUP_BYTES.saturating_sub(fixed) / (4 * self.m * plan.lanes);
        if chunks <= fit {
            return Some(Stage { block: chunks });
        }
        let unroll = plan.unroll.min(fit / plan.threads);
        let step = unroll * plan.threads;
        (unroll > 0).then(|| Stage {
            block: fit / step * step,
        })
    }

    pub fn lower(&self, lw: &mut Lowering, args: &impl GemvArgs) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let most = SplitK::most(lw, self.batch, self.m, self.n)?;
        self.dispatch(lw, args, most, false)
    }

    fn is_empty(&self) -> bool {
        self.m == 0 || self.n == 0 || self.batch == 0
    }

    /// Two products of one input whose outputs only meet in one pointwise
    /// value (a gated MLP's `act(x·Wg) * (x·Wu)`) as one dispatch storing
    /// that value alone: `self.n` columns of each, interleaved so that a
    /// column group owns column `c` of both (even columns the first
    /// product's, read by `xb`, odd ones the second's, `xb_1`), and the
    /// store, `args`' `gstore(bt, r, c, v, u)`, gets both sums. The next
    /// product then reads a plain vector, with nothing to evaluate or stage.
    /// `k` is not split.
    pub fn lower_pair(&self, lw: &mut Lowering, args: &impl GemvArgs) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let both = Gemv {
            n: 2 * self.n,
            ..*self
        };
        both.dispatch(lw, args, 1, true)
    }

    /// The dispatch of the product (and, split at most `most` ways, the
    /// partial sums' sum).
    fn dispatch(
        &self,
        lw: &mut Lowering,
        args: &impl GemvArgs,
        most: usize,
        pairs: bool,
    ) -> Result<()> {
        let plan = self.plan(most, args.b_dtype().size() == 2, !args.a_is_plain(), pairs);
        let split = SplitK::new(lw, plan.splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let (decls, pro) = args.prologue(&mut kb, plan.size())?;
        let fixed = self.red_bytes(&plan) + args.prologue_bytes();
        let stage = match args.a_is_plain() {
            true => None,
            false => self.stage(&plan, fixed),
        };
        let fns = args.k_chunks(&mut kb, plan.lanes)? + &split.store(&mut kb, args)?;
        let (shared, staged) = self.shared(&plan, stage);
        let main = format!(
            "{fns}\n{}{decls}{shared}{}  let g = {FLAT_GROUP};\n{}}}\n",
            dot_fn(plan.lanes),
            entry(plan.size() as u32),
            self.body(&plan, "", &pro, stage)
        );
        let built = kb.finish(&main);
        let groups = (self.n.div_ceil(plan.block()) * self.batch * plan.splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let storage = (fixed + staged) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [plan.size() as u32, 1, 1], workgroups, storage)?;
        split.sum(lw, args)
    }

    /// Products of one `[m, k]` input by weights of `n_i` columns each (a
    /// layer's q, k and v, or gate and up) in one dispatch: the columns
    /// blocks of all, each workgroup taking a block of one product. Each
    /// member's reads and store are its [`GemvArgs`], whose functions carry
    /// the member's tag (`xa{tag}`, `xb{tag}`, `gstore{tag}`). `k` is not
    /// split: the members' columns together fill the GPU. The staged left
    /// operand's array is one for all members (they share `m` and `k`).
    pub fn lower_group(
        lw: &mut Lowering,
        m: usize,
        k: usize,
        members: &[(usize, String, &dyn GemvArgs)],
    ) -> Result<()> {
        let total: usize = members.iter().map(|(n, _, _)| n).sum();
        let whole = Gemv {
            batch: 1,
            m,
            n: total,
            k,
        };
        let wide = members.iter().all(|(_, _, a)| a.b_dtype().size() == 2);
        let computed = !members.iter().all(|(_, _, a)| a.a_is_plain());
        let plan = whole.plan(1, wide, computed, false);
        let mut kb = KernelBuilder::new(&lw.buffers);
        let mut fns = String::new();
        let mut pros = vec![];
        let mut fixed = whole.red_bytes(&plan);
        for (_, _, args) in members {
            let (decls, pro) = args.prologue(&mut kb, plan.size())?;
            fns += &decls;
            fixed += args.prologue_bytes();
            pros.push(pro);
            fns += &args.k_chunks(&mut kb, plan.lanes)?;
            fns += &args.store(&mut kb)?;
        }
        let stage = match members.iter().all(|(_, _, a)| a.a_is_plain()) {
            true => None,
            false => whole.stage(&plan, fixed),
        };
        let (shared, staged) = whole.shared(&plan, stage);
        let mut main = format!(
            "{fns}\n{}{shared}{}  let g0 = {FLAT_GROUP};\n",
            dot_fn(plan.lanes),
            entry(plan.size() as u32)
        );
        let mut start = 0;
        for ((n, tag, _), pro) in members.iter().zip(&pros) {
            let part = Gemv {
                batch: 1,
                m,
                n: *n,
                k,
            };
            let end = start + n.div_ceil(plan.block());
            let _ = writeln!(
                main,
                "  if (g0 < {end}u) {{\n  let g = g0 - {start}u;\n{}  return;\n  }}",
                part.body(&plan, tag, pro, stage)
            );
            start = end;
        }
        main.push_str("}\n");
        let built = kb.finish(&main);
        let workgroups = grid(start as u64, lw.options.max_workgroups_per_dim)?;
        let storage = (fixed + staged) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [plan.size() as u32, 1, 1], workgroups, storage)
    }

    /// Bytes of the workgroup memory the partial sums are reduced in.
    fn red_bytes(&self, plan: &Plan) -> usize {
        4 * self.m * plan.cols * plan.size()
    }

    /// The workgroup memory the partial sums are reduced in and, where
    /// staged, the left operand's (`xs`, read by `fn xsa(r, c)`: chunk `c`
    /// of row `r` of the block), and the bytes of the latter.
    fn shared(&self, plan: &Plan, stage: Option<Stage>) -> (String, usize) {
        let mut s = format!(
            "var<workgroup> red: array<f32, {}>;\n",
            self.m * plan.cols * plan.size()
        );
        let Some(Stage { block }) = stage else {
            return (s, 0);
        };
        let halves = plan.lanes / 4;
        let _ = writeln!(
            s,
            "var<workgroup> xs: array<vec4<f32>, {}>;",
            self.m * halves * block
        );
        let _ = match halves {
            1 => writeln!(
                s,
                "fn xsa(r: u32, c: u32) -> vec4<f32> {{ return xs[r * {block}u + c]; }}"
            ),
            _ => writeln!(
                s,
                "fn xsa(r: u32, c: u32) -> array<vec4<f32>, 2> {{\n\
                 \x20 let o = r * {}u + c;\n\
                 \x20 return array<vec4<f32>, 2>(xs[o], xs[o + {block}u]);\n}}",
                2 * block
            ),
        };
        (s, 16 * self.m * halves * block)
    }

    /// The statements of a workgroup `g` (a `u32` in scope) computing its
    /// block of columns after the `prologue`, calling the functions tagged
    /// `tag`, the left operand staged as `stage` says (else read in place).
    fn body(&self, plan: &Plan, tag: &str, prologue: &str, stage: Option<Stage>) -> String {
        let (m, n) = (self.m, self.n);
        let Plan {
            threads,
            cols,
            splits,
            lanes,
            ..
        } = *plan;
        // k of a split (a multiple of the chunk when split)
        let depth = self.k / splits;
        let chunks = depth.div_ceil(lanes);
        let blocks = n.div_ceil(plan.block());
        let mut s = String::new();
        let _ = writeln!(
            s,
            "  if (g >= {}u) {{ return; }}\n\
             \x20 let kbase = (g / {}u) * {depth}u;\n  let sb = g / {blocks}u;\n\
             \x20 let bt = sb % {}u;\n  let n0 = (g % {blocks}u) * {}u;\n\
             \x20 let grp = lid / {threads}u;\n  let tl = lid % {threads}u;",
            blocks * self.batch * splits,
            blocks * self.batch,
            self.batch,
            plan.block()
        );
        for j in 0..cols {
            // a last block's missing columns read the last one (not stored)
            let _ = writeln!(
                s,
                "  let c{j} = min(n0 + grp * {cols}u + {j}u, {}u);",
                n - 1
            );
        }
        for i in 0..m {
            for j in 0..cols {
                let _ = writeln!(s, "  var s{i}_{j} = 0.0;");
            }
        }
        let Some(st) = stage else {
            s += &self.chunks(plan, tag, None, chunks, "kbase", prologue);
            return self.reduce(s, plan, tag);
        };
        if chunks <= st.block {
            let pre = prologue.to_string() + &self.fill(plan, tag, st, "kbase", chunks);
            s += &self.chunks(plan, tag, stage, chunks, "kbase", &pre);
            return self.reduce(s, plan, tag);
        }
        // blocks of `k` (a uniform loop: its barriers are the workgroup's),
        // then what is left
        s.push_str(prologue);
        let (whole, rest) = (chunks / st.block, chunks % st.block);
        let span = st.block * lanes;
        let _ = writeln!(
            s,
            "  for (var ko = kbase; ko < kbase + {}u; ko = ko + {span}u) {{",
            whole * span
        );
        let pre = self.fill(plan, tag, st, "ko", st.block);
        s += &self.chunks(plan, tag, stage, st.block, "ko", &pre);
        s.push_str("  workgroupBarrier();\n  }\n");
        if rest > 0 {
            let _ = writeln!(s, "  {{\n  let ko = kbase + {}u;", whole * span);
            let pre = self.fill(plan, tag, st, "ko", rest);
            s += &self.chunks(plan, tag, stage, rest, "ko", &pre);
            s.push_str("  }\n");
        }
        self.reduce(s, plan, tag)
    }

    /// Statements filling the staged left operand with chunks `0 … count`
    /// of the block from `base` (a WGSL `u32`), then a barrier: all of the
    /// workgroup's invocations, each evaluating `xa` for a chunk of a row.
    fn fill(&self, plan: &Plan, tag: &str, stage: Stage, base: &str, count: usize) -> String {
        let (lanes, block) = (plan.lanes, stage.block);
        let mut body = format!(
            "    let r = e / {count}u;\n    let c = e % {count}u;\n\
             \x20   let a = xa{tag}(bt, r, {base} + c * {lanes}u);\n"
        );
        match lanes {
            4 => {
                let _ = writeln!(body, "    xs[r * {block}u + c] = a;");
            }
            _ => {
                let _ = writeln!(
                    body,
                    "    xs[r * {}u + c] = a[0];\n    xs[r * {}u + {block}u + c] = a[1];",
                    2 * block,
                    2 * block
                );
            }
        }
        lane_strided("e", self.m * count, plan.size(), &body) + "  workgroupBarrier();\n"
    }

    /// The loop over chunks `0 … count` of a split's `k`, or of a block of
    /// it, from `base` (a WGSL `u32`): the plan's unrolled chunks of each
    /// column at once (no more than each invocation has) while every
    /// invocation has them, then one at a time, `pre` after the first
    /// pass's loads ([`unrolled_passes`]). The left operand's chunks are
    /// read from the staged block where `stage` is given.
    fn chunks(
        &self,
        plan: &Plan,
        tag: &str,
        stage: Option<Stage>,
        count: usize,
        base: &str,
        pre: &str,
    ) -> String {
        let (m, cols, threads, lanes) = (self.m, plan.cols, plan.threads, plan.lanes);
        let unroll = plan.unroll.min(count / threads).max(1);
        // the right operand's chunks `q + x·threads`, x < u
        let loads = |s: &mut String, u: usize| {
            for x in 0..u {
                let _ = writeln!(
                    s,
                    "    let k{x} = {base} + (q + {}u) * {lanes}u;",
                    x * threads
                );
                for j in 0..cols {
                    let read = match (plan.pairs, j % 2) {
                        (false, _) => format!("xb{tag}(bt, c{j}, k{x})"),
                        (true, 0) => format!("xb{tag}(bt, c{j} >> 1u, k{x})"),
                        (true, _) => format!("xb{tag}_1(bt, c{j} >> 1u, k{x})"),
                    };
                    let _ = writeln!(s, "    let b{x}_{j} = {read};");
                }
            }
        };
        let math = |s: &mut String, u: usize| {
            for x in 0..u {
                for i in 0..m {
                    let a = match stage {
                        Some(_) => format!("xsa({i}u, q + {}u)", x * threads),
                        None => format!("xa{tag}(bt, {i}u, k{x})"),
                    };
                    let _ = writeln!(s, "    let a{x}_{i} = {a};");
                    for j in 0..cols {
                        let _ = writeln!(s, "    s{i}_{j} = s{i}_{j} + dotc(a{x}_{i}, b{x}_{j});");
                    }
                }
            }
        };
        // (`base` is the loads' offset of `k`, not a prefix of `q`)
        unrolled_passes("", count, threads, unroll, pre, loads, math)
    }

    /// `s` with the statements adding up the workgroup's partial sums and
    /// storing them appended.
    fn reduce(&self, mut s: String, plan: &Plan, tag: &str) -> String {
        let (m, n, cols) = (self.m, self.n, plan.cols);
        let sums: Vec<String> = (0..m)
            .flat_map(|i| (0..cols).map(move |j| format!("s{i}_{j}")))
            .collect();
        let per = m * cols;
        let (c, sums_of) = match plan.pairs {
            true => ("c >> 1u", "v, u"),
            false => ("c", "v"),
        };
        let store = format!(
            "let c = n0 + (x / {per}u) * {cols}u + x % {cols}u;\n\
             \x20   if (c < {n}u) {{ gstore{tag}(sb, (x % {per}u) / {cols}u, {c}, {sums_of}); }}"
        );
        s.push_str(&reduce_sums(
            &sums,
            plan.threads,
            plan.groups,
            plan.pairs,
            &store,
        ));
        s
    }
}

/// The passes of `threads` invocations over chunks `0 … count` (WGSL `q`,
/// from `base`: empty or a prefix such as `"qb + "`): `unroll` chunks an
/// invocation at once while every invocation has them, then one at a time.
/// The first step issues its loads before `pre` (a prologue, a staging),
/// whose barriers would otherwise hold the loads back. `loads` and `math`
/// append the statements of `u` chunks `q + x·threads`, `x < u`.
pub(crate) fn unrolled_passes(
    base: &str,
    count: usize,
    threads: usize,
    unroll: usize,
    pre: &str,
    loads: impl Fn(&mut String, usize),
    math: impl Fn(&mut String, usize),
) -> String {
    let step = unroll * threads;
    let full = count / step * step;
    let mut s = String::new();
    let mut from = 0;
    if full > 0 {
        let _ = writeln!(s, "  {{\n    let q = {base}tl;");
        loads(&mut s, unroll);
        s.push_str(pre);
        math(&mut s, unroll);
        s.push_str("  }\n");
        from = step;
    } else {
        s.push_str(pre);
    }
    for (u, to, by) in [(unroll, full, step), (1, count, threads)] {
        if from < to {
            let _ = writeln!(
                s,
                "  for (var q = {base}{from}u + tl; q < {base}{to}u; q = q + {by}u) {{"
            );
            loads(&mut s, u);
            math(&mut s, u);
            s.push_str("  }\n");
        }
        from = from.max(to);
    }
    s
}

/// `fn dotc(a, b) -> f32` for chunks of `lanes` elements: WGSL's `dot` for
/// a `vec4<f32>`, a helper summing both halves of an 8-element chunk.
fn dot_fn(lanes: usize) -> String {
    match lanes {
        4 => "fn dotc(a: vec4<f32>, b: vec4<f32>) -> f32 { return dot(a, b); }\n".into(),
        _ => "fn dotc(a: array<vec4<f32>, 2>, b: array<vec4<f32>, 2>) -> f32 {\n\
              \x20 return dot(a[0], b[0]) + dot(a[1], b[1]);\n}\n"
            .into(),
    }
}

/// Partial sums of a strip of the reduction (see [`reduce_sums`]).
const STRIPS: usize = 8;

/// Statements adding up, over each of `groups` groups of `threads`
/// invocations (`threads` a power of two, at least [`STRIPS`]; group `lid
/// / threads`), each invocation's f32 partial sums named `sums` (in `red`,
/// a workgroup array of `sums.len() × threads × groups` f32), then running
/// `store` with `v` the total of sum `x % sums.len()` of group `x /
/// sums.len()`, for each `x < groups · sums.len()`; with `pairs` (an even
/// count of sums), `x` even only, and `u` the total of sum `x + 1`. Two
/// barriers whatever the workgroup size: every invocation adds up a strip
/// of `threads / STRIPS` partials of one sum, and the storing invocation
/// adds up the strips; no subgroup size is assumed (lavapipe has 8, NVIDIA
/// 32). Call it in uniform control flow.
pub(crate) fn reduce_sums(
    sums: &[String],
    threads: usize,
    groups: usize,
    pairs: bool,
    store: &str,
) -> String {
    let count = sums.len();
    let width = threads / STRIPS;
    let size = threads * groups;
    let mut s = String::new();
    for (i, name) in sums.iter().enumerate() {
        let _ = writeln!(
            s,
            "  red[((lid / {threads}u) * {count}u + {i}u) * {threads}u + lid % {threads}u] = {name};"
        );
    }
    // `var name`: the total of sum `at`'s strips
    let total = |name: &str, at: &str| {
        format!(
            "var {name} = 0.0;\n    for (var p = 0u; p < {STRIPS}u; p = p + 1u) {{ {name} = {name} + red[{at} * {threads}u + p * {width}u]; }}"
        )
    };
    let (storing, x, second) = match pairs {
        true => (
            count * groups / 2,
            "2u * lid",
            format!("\n    {}", total("u", "(x + 1u)")),
        ),
        false => (count * groups, "lid", String::new()),
    };
    let _ = writeln!(
        s,
        "  workgroupBarrier();\n\
         \x20 for (var e = lid; e < {strips}u; e = e + {size}u) {{\n\
         \x20   let o = (e / {STRIPS}u) * {threads}u + (e % {STRIPS}u) * {width}u;\n\
         \x20   var t = red[o];\n\
         \x20   for (var i = 1u; i < {width}u; i = i + 1u) {{ t = t + red[o + i]; }}\n\
         \x20   red[o] = t;\n  }}\n  workgroupBarrier();\n\
         \x20 if (lid < {storing}u) {{\n\
         \x20   let x = {x};\n\
         \x20   {}{second}\n\
         \x20   {store}\n  }}",
        total("v", "x"),
        strips = count * groups * STRIPS,
    );
    s
}

#[cfg(test)]
mod tests {
    use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Tensor, UnaryOp};
    use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};

    use super::{Gemv, Plan, WORKGROUP_BYTES};
    use crate::preprocess::kernels::testing::lower_graph;

    /// Append `op` over `inputs` to `g`: its output.
    fn node(g: &mut Graph, op: Op, inputs: &[ValueId]) -> ValueId {
        let mut node = Node {
            name: format!("n{}", g.nodes.len()),
            target: "test".into(),
            op,
            inputs: inputs.iter().map(|&v| Some(v)).collect(),
            outputs: vec![],
        };
        let (dtype, shape) = etmetal_graph::infer::infer(g, &node).unwrap().remove(0);
        let v = g.add_value(node.name.clone(), dtype, shape);
        node.outputs.push(v);
        g.nodes.push(node);
        v
    }

    fn input(g: &mut Graph, dtype: DType, shape: &[usize]) -> ValueId {
        let v = g.add_value(format!("x{}", g.inputs.len()), dtype, shape.to_vec());
        g.inputs.push((v, InputKind::User));
        v
    }

    fn constant(g: &mut Graph, t: Tensor) -> ValueId {
        let name = format!("w{}", g.constants.len());
        let v = g.add_constant(name.clone(), t);
        g.inputs.push((v, InputKind::Parameter { fqn: name }));
        v
    }

    /// `linear(a(x), w)` for `w` of `[n, k]`: the product's kernel and its
    /// dispatch's workgroup memory (the payload's requirement).
    fn product(
        dtype: DType,
        (m, n, k): (usize, usize, usize),
        a: impl Fn(&mut Graph, ValueId) -> ValueId,
    ) -> (String, u32) {
        let mut g = Graph::default();
        let x = input(&mut g, dtype, &[1, m, k]);
        let h = a(&mut g, x);
        let w = constant(&mut g, Tensor::zeros(dtype, &[n, k]).unwrap());
        let y = node(&mut g, Op::Linear, &[h, w]);
        g.outputs.push((y, OutputKind::User));
        let p = lower_graph(&g).unwrap().payload;
        let kernel = p
            .kernels
            .iter()
            .find(|k| k.wgsl.contains("gstore"))
            .expect("a product kernel");
        (
            kernel.wgsl.clone(),
            p.requirements.max_compute_workgroup_storage_size,
        )
    }

    /// `rms_norm(x) · g` written out as a decoder does.
    fn rms_norm(g: &mut Graph, x: ValueId) -> ValueId {
        let (dtype, k) = (g.value(x).dtype, *g.value(x).shape.last().unwrap());
        let sq = node(g, Op::Binary(BinaryOp::Mul), &[x, x]);
        let mean = Op::Reduce {
            op: ReduceOp::Mean,
            dims: vec![2],
            keepdim: true,
        };
        let ms = node(g, mean, &[sq]);
        let eps = constant(g, Tensor::scalar_f64(dtype, 1e-6).unwrap());
        let ms = node(g, Op::Binary(BinaryOp::Add), &[ms, eps]);
        let r = node(g, Op::Unary(UnaryOp::Rsqrt), &[ms]);
        let h = node(g, Op::Binary(BinaryOp::Mul), &[x, r]);
        let w = constant(g, Tensor::zeros(dtype, &[k]).unwrap());
        node(g, Op::Binary(BinaryOp::Mul), &[h, w])
    }

    /// `silu(x) · x`: a SiLU gate (of itself).
    fn silu_gate(g: &mut Graph, x: ValueId) -> ValueId {
        let s = node(g, Op::Unary(UnaryOp::Silu), &[x]);
        node(g, Op::Binary(BinaryOp::Mul), &[s, x])
    }

    /// A left operand that is more than a load (an RMSNorm computed in the
    /// prologue, a SiLU gate) is evaluated once a workgroup of several
    /// column groups into workgroup memory, in blocks of `k` where it does
    /// not fit at once (a Llama-3.2-1B down product's 8192), within 16 KiB;
    /// a plain load, or one column group's operand, is read in place.
    #[test]
    fn a_computed_left_operand_is_staged() {
        let staged = "var<workgroup> xs";
        let (wgsl, _) = product(DType::BF16, (1, 2048, 2048), |_, x| x);
        assert!(!wgsl.contains(staged), "a plain load staged");
        // (64 columns: one group a workgroup)
        let (wgsl, _) = product(DType::F32, (3, 64, 1000), rms_norm);
        assert!(!wgsl.contains(staged), "one column group staged");
        for (dtype, (m, n, k)) in [
            (DType::BF16, (1, 2048, 2048)),
            (DType::F32, (2, 2048, 1000)),
            (DType::F16, (8, 1024, 128)),
        ] {
            let (wgsl, bytes) = product(dtype, (m, n, k), rms_norm);
            assert!(wgsl.contains(staged), "{dtype:?} {m}x{n}x{k}: not staged");
            assert!(!wgsl.contains("for (var ko"), "{k} in blocks");
            assert!(bytes as usize <= WORKGROUP_BYTES, "{bytes} bytes");
        }
        for (m, n) in [(1, 2048), (1, 512), (4, 64)] {
            let (wgsl, bytes) = product(DType::BF16, (m, n, 8192), silu_gate);
            assert!(wgsl.contains(staged), "{m}x{n}: not staged");
            assert!(wgsl.contains("for (var ko"), "{m}x{n}: not in blocks");
            assert!(bytes as usize <= WORKGROUP_BYTES, "{m}x{n}: {bytes} bytes");
        }
    }

    /// Up to 8 rows and 4 columns keep the partial sums within 16 KiB.
    #[test]
    fn partial_sums_fit_the_workgroup_memory() {
        for (m, n, k) in [(8, 4096, 4096), (5, 2048, 256), (8, 128256, 2048)] {
            let p: Plan = Gemv { batch: 1, m, n, k }.plan(usize::MAX, true, false, false);
            assert!(4 * m * p.cols * p.size() <= WORKGROUP_BYTES, "{p:?}");
        }
    }

    /// The plan of a one-row product (`n` outputs over `k`) as
    /// (invocations a group, columns, splits, lanes, unroll, groups).
    fn layout(
        n: usize,
        k: usize,
        most: usize,
        wide: bool,
        computed: bool,
    ) -> (usize, usize, usize, usize, usize, usize) {
        let p: Plan = Gemv {
            batch: 1,
            m: 1,
            n,
            k,
        }
        .plan(most, wide, computed, false);
        (p.threads, p.cols, p.splits, p.lanes, p.unroll, p.groups)
    }

    #[test]
    fn few_columns_split_deep_k() {
        let gemv = |n, k, wide| layout(n, k, usize::MAX, wide, false);
        // (invocations a group, columns, splits, lanes, unroll, groups)
        assert_eq!(gemv(64, 4096, false), (64, 1, 8, 4, 2, 4));
        assert_eq!(gemv(64, 4096, true), (32, 1, 8, 8, 2, 4));
        assert_eq!(gemv(1024, 1024, false), (128, 2, 1, 4, 2, 2));
        assert_eq!(gemv(32000, 1024, false), (128, 4, 1, 4, 2, 2));
        // k not a multiple of 8: 4-element chunks
        assert_eq!(gemv(10, 2047, true), (128, 1, 1, 4, 4, 1));
        // a Llama-3.2-1B decode step: q (2048 → 2048), down (8192 → 2048)
        // and the head (2048 → 128256), bf16
        assert_eq!(gemv(2048, 2048, true), (128, 4, 1, 8, 2, 2));
        assert_eq!(gemv(2048, 8192, true), (128, 4, 1, 8, 2, 2));
        assert_eq!(gemv(128256, 2048, true), (128, 4, 1, 8, 2, 2));
    }

    /// A staged (computed) left operand gives each invocation up to 16
    /// chunks while full workgroups stay at least 192 (the H100-timed
    /// layouts of a Llama-3.2-1B bf16 decode step); a plain one keeps two.
    #[test]
    fn a_computed_left_operand_deepens_invocations() {
        let gemv = |n, k, computed| layout(n, k, 1, true, computed);
        // (invocations a group, columns, splits, lanes, unroll, groups)
        // gate/up (merged) and the head: 16 chunks, 256 workgroups and more
        assert_eq!(gemv(16384, 2048, true), (16, 4, 1, 8, 2, 16));
        assert_eq!(gemv(128256, 2048, true), (16, 4, 1, 8, 2, 16));
        // q/k/v (merged): 8 or 16 chunks leave fewer than 192 full
        // workgroups, 4 chunks keep 192
        assert_eq!(gemv(3072, 2048, true), (64, 4, 1, 8, 2, 4));
        // down (8192 deep): 8 chunks, 128 invocations
        assert_eq!(gemv(2048, 8192, true), (128, 4, 1, 8, 2, 2));
        // a plain operand (o): two chunks
        assert_eq!(gemv(2048, 2048, false), (128, 4, 1, 8, 2, 2));
        // too small for any deep layout: two chunks
        assert_eq!(gemv(256, 512, true), gemv(256, 512, false));
    }
}
