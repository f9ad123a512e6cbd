//! The matrix-vector form of a product: for at most [`GEMV_ROWS`] rows
//! per batch against a right operand contiguous along `k` (a decode
//! step's linear layers), read once in coalesced 16-byte chunks.

use std::fmt::Write;

use etmetal_core::Result;

use super::spec::GemvArgs;
use super::split::{split_k, SplitK};
use crate::preprocess::emit::{entry, grid, KernelBuilder, FLAT_GROUP};
use crate::preprocess::Lowering;

/// Rows (per batch) up to which a product with a `k`-contiguous right
/// operand (a linear layer's weight) is a [`Gemv`].
pub(crate) const GEMV_ROWS: usize = 8;

/// Accumulators of a [`Gemv`] invocation (`rows × columns`), bounded so the
/// workgroup's partial sums fit 16 KiB.
const GEMV_SUMS: usize = 32;

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
/// a large GPU split a deep `k` among workgroups ([`SplitK`]). The caller's
/// [`GemvArgs`] read the operands in chunks along `k` and store the
/// results.
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

impl Gemv {
    /// The most columns (≤ 4) that keep enough workgroups, `k` split when
    /// there still are too few and each part keeps 32 invocations busy
    /// with two chunks,
    /// enough invocations for two chunks each of a part of `k` (32 to
    /// 128), unrolled to about [`GEMV_LOADS`] loads; at most `most` splits.
    /// `wide`: the right operand is 16-bit (8-element chunks where `k`
    /// allows).
    fn plan(&self, most: usize, wide: bool) -> Plan {
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
            .unwrap_or(1);
        let groups = (self.n.div_ceil(cols) * self.batch) as u64;
        let splits = split_k(groups, GEMV_FILL, self.k, lanes * 64, lanes, most);
        let chunks = (self.k / splits).div_ceil(lanes).max(1);
        let threads = chunks.div_ceil(2).next_power_of_two().clamp(32, 128);
        let unroll = (GEMV_LOADS / cols)
            .min(GEMV_LOADS / self.m.max(1))
            .min(chunks / threads)
            .max(1);
        let groups = column_groups(self.n.div_ceil(cols) * self.batch * splits, threads);
        Plan {
            threads,
            cols,
            groups,
            splits,
            lanes,
            unroll,
        }
    }

    pub fn lower(&self, lw: &mut Lowering, args: &impl GemvArgs) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            return Ok(());
        }
        let most = SplitK::most(lw, self.batch, self.m, self.n)?;
        let plan = self.plan(most, args.b_dtype().size() == 2);
        let split = SplitK::new(lw, plan.splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let (decls, pro) = args.prologue(&mut kb, plan.size())?;
        let fns = args.k_chunks(&mut kb, plan.lanes)? + &split.store(&mut kb, args)?;
        let main = format!(
            "{fns}\n{}{decls}{}{}  let g = {FLAT_GROUP};\n{}}}\n",
            dot_fn(plan.lanes),
            self.shared(&plan),
            entry(plan.size() as u32),
            self.body(&plan, "", &pro)
        );
        let built = kb.finish(&main);
        let groups = (self.n.div_ceil(plan.block()) * self.batch * plan.splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let storage = (4 * self.m * plan.cols * plan.size()) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [plan.size() as u32, 1, 1], workgroups, storage)?;
        split.sum(lw, args)
    }

    /// Products of one `[m, k]` input by weights of `n_i` columns each (a
    /// layer's q, k and v, or gate and up) in one dispatch: the columns
    /// blocks of all, each workgroup taking a block of one product. Each
    /// member's reads and store are its [`GemvArgs`], whose functions carry
    /// the member's tag (`xa{tag}`, `xb{tag}`, `gstore{tag}`). `k` is not
    /// split: the members' columns together fill the GPU.
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
        let plan = whole.plan(1, wide);
        let mut kb = KernelBuilder::new(&lw.buffers);
        let mut fns = String::new();
        let mut pros = vec![];
        for (_, _, args) in members {
            let (decls, pro) = args.prologue(&mut kb, plan.size())?;
            fns += &decls;
            pros.push(pro);
            fns += &args.k_chunks(&mut kb, plan.lanes)?;
            fns += &args.store(&mut kb)?;
        }
        let mut main = format!(
            "{fns}\n{}{}{}  let g0 = {FLAT_GROUP};\n",
            dot_fn(plan.lanes),
            whole.shared(&plan),
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
                part.body(&plan, tag, pro)
            );
            start = end;
        }
        main.push_str("}\n");
        let built = kb.finish(&main);
        let workgroups = grid(start as u64, lw.options.max_workgroups_per_dim)?;
        let storage = (4 * m * plan.cols * plan.size()) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [plan.size() as u32, 1, 1], workgroups, storage)
    }

    /// The workgroup memory the partial sums are reduced in.
    fn shared(&self, plan: &Plan) -> String {
        format!(
            "var<workgroup> red: array<f32, {}>;\n",
            self.m * plan.cols * plan.size()
        )
    }

    /// The statements of a workgroup `g` (a `u32` in scope) computing its
    /// block of columns after the `prologue`, calling the functions tagged
    /// `tag`.
    fn body(&self, plan: &Plan, tag: &str, prologue: &str) -> String {
        let (m, n) = (self.m, self.n);
        let Plan {
            threads,
            cols,
            groups,
            splits,
            lanes,
            unroll,
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
        // `unroll` chunks of each column at once while every invocation has
        // them, then one at a time
        let step = unroll * threads;
        let full = chunks / step * step;
        // the right operand's chunks `q + x·threads`, x < u
        let loads = |s: &mut String, u: usize| {
            for x in 0..u {
                let _ = writeln!(
                    s,
                    "    let k{x} = kbase + (q + {}u) * {lanes}u;",
                    x * threads
                );
                for j in 0..cols {
                    let _ = writeln!(s, "    let b{x}_{j} = xb{tag}(bt, c{j}, k{x});");
                }
            }
        };
        let math = |s: &mut String, u: usize| {
            for x in 0..u {
                for i in 0..m {
                    let _ = writeln!(s, "    let a{x}_{i} = xa{tag}(bt, {i}u, k{x});");
                    for j in 0..cols {
                        let _ = writeln!(s, "    s{i}_{j} = s{i}_{j} + dotc(a{x}_{i}, b{x}_{j});");
                    }
                }
            }
        };
        let mut from = 0;
        if full > 0 {
            // the first pass's loads go out before the prologue, whose
            // barriers would otherwise hold them back
            s.push_str("  {\n    let q = tl;\n");
            loads(&mut s, unroll);
            s.push_str(prologue);
            math(&mut s, unroll);
            s.push_str("  }\n");
            from = step;
        } else {
            s.push_str(prologue);
        }
        for (u, to, by) in [(unroll, full, step), (1, chunks, threads)] {
            if from < to {
                let _ = writeln!(
                    s,
                    "  for (var q = {from}u + tl; q < {to}u; q = q + {by}u) {{"
                );
                loads(&mut s, u);
                math(&mut s, u);
                s.push_str("  }\n");
            }
            from = from.max(to);
        }
        let sums: Vec<String> = (0..m)
            .flat_map(|i| (0..cols).map(move |j| format!("s{i}_{j}")))
            .collect();
        let per = self.m * cols;
        let store = format!(
            "let c = n0 + (lid / {per}u) * {cols}u + lid % {cols}u;\n\
             \x20   if (c < {n}u) {{ gstore{tag}(sb, (lid % {per}u) / {cols}u, c, v); }}"
        );
        s.push_str(&reduce_sums(&sums, threads, groups, &store));
        s
    }
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
/// `store` in invocation `lid < groups · sums.len()` with `v` the total of
/// sum `lid % sums.len()` of group `lid / sums.len()`. Two barriers
/// whatever the workgroup size: every invocation adds up a strip of
/// `threads / STRIPS` partials of one sum, and the storing invocation adds
/// up the strips; no subgroup size is assumed (lavapipe has 8, NVIDIA 32).
/// Call it in uniform control flow.
pub(crate) fn reduce_sums(sums: &[String], threads: usize, groups: usize, store: &str) -> String {
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
    let _ = writeln!(
        s,
        "  workgroupBarrier();\n\
         \x20 for (var e = lid; e < {strips}u; e = e + {size}u) {{\n\
         \x20   let o = (e / {STRIPS}u) * {threads}u + (e % {STRIPS}u) * {width}u;\n\
         \x20   var t = red[o];\n\
         \x20   for (var i = 1u; i < {width}u; i = i + 1u) {{ t = t + red[o + i]; }}\n\
         \x20   red[o] = t;\n  }}\n  workgroupBarrier();\n\
         \x20 if (lid < {total}u) {{\n\
         \x20   var v = 0.0;\n\
         \x20   for (var p = 0u; p < {STRIPS}u; p = p + 1u) {{ v = v + red[lid * {threads}u + p * {width}u]; }}\n\
         \x20   {store}\n  }}",
        strips = count * groups * STRIPS,
        total = count * groups,
    );
    s
}

#[cfg(test)]
mod tests {
    use super::{Gemv, Plan};

    #[test]
    fn few_columns_split_deep_k() {
        let gemv = |n, k, wide| {
            let p: Plan = Gemv {
                batch: 1,
                m: 1,
                n,
                k,
            }
            .plan(usize::MAX, wide);
            (p.threads, p.cols, p.splits, p.lanes, p.unroll, p.groups)
        };
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
}
