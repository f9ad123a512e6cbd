//! The matrix-vector form of a product: for at most [`GEMV_ROWS`] rows
//! per batch against a right operand contiguous along `k` (a decode
//! step's linear layers), read once in coalesced 4-element chunks.

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

/// A matrix-vector-like product: `m ≤ 8` rows per batch times a right
/// operand whose columns are contiguous along `k` (`[n, k]` weights). It is
/// memory-bound on the right operand, so each element of it is read once:
/// a workgroup owns `cols` columns and every row, its invocations stride
/// over `k` in 4-element chunks (neighbours read neighbouring chunks: one
/// coalesced vector load each where the operand is a buffer), keep
/// `rows × cols` partial sums, and reduce them across the workgroup in
/// workgroup memory; too few columns for a large GPU split a deep `k`
/// among workgroups ([`SplitK`]). The caller's [`GemvArgs`] read the
/// operands in chunks along `k` and store the results.
pub(crate) struct Gemv {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Gemv {
    /// `(invocations, columns, splits)` of a workgroup: the most columns
    /// (≤ 4) that keep enough workgroups, `k` split when there still are too
    /// few and each part keeps 128 invocations busy, and enough invocations
    /// to cover a part of `k` once (at most 128); at most `most` splits.
    fn shape(&self, most: usize) -> (usize, usize, usize) {
        let cols = [4, 2]
            .into_iter()
            .find(|&c| {
                self.m * c <= GEMV_SUMS && (self.n.div_ceil(c) * self.batch) as u64 >= GEMV_FILL
            })
            .unwrap_or(1);
        let groups = (self.n.div_ceil(cols) * self.batch) as u64;
        let splits = split_k(groups, GEMV_FILL, self.k, 4 * 128, 4, most);
        let chunks = (self.k / splits).div_ceil(4).max(1);
        let threads = chunks.next_power_of_two().clamp(32, 128);
        (threads, cols, splits)
    }

    pub fn lower(&self, lw: &mut Lowering, args: &impl GemvArgs) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            return Ok(());
        }
        let most = SplitK::most(lw, self.batch, self.m, self.n)?;
        let (threads, cols, splits) = self.shape(most);
        let split = SplitK::new(lw, splits, self.batch, self.m, self.n)?;
        let mut kb = KernelBuilder::new(&lw.buffers);
        let (decls, pro) = args.prologue(&mut kb, threads)?;
        let fns = args.k_chunks(&mut kb)? + &split.store(&mut kb, args)?;
        let main = format!(
            "{fns}\n{decls}{}{}  let g = {FLAT_GROUP};\n{}}}\n",
            self.shared(threads, cols),
            entry(threads as u32),
            self.body(threads, cols, splits, "", &pro)
        );
        let built = kb.finish(&main);
        let groups = (self.n.div_ceil(cols) * self.batch * splits) as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let storage = (4 * self.m * cols * threads) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [threads as u32, 1, 1], workgroups, storage)?;
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
        let (threads, cols, _) = whole.shape(1);
        let mut kb = KernelBuilder::new(&lw.buffers);
        let mut fns = String::new();
        let mut pros = vec![];
        for (_, _, args) in members {
            let (decls, pro) = args.prologue(&mut kb, threads)?;
            fns += &decls;
            pros.push(pro);
            fns += &args.k_chunks(&mut kb)?;
            fns += &args.store(&mut kb)?;
        }
        let mut main = format!(
            "{fns}\n{}{}  let g0 = {FLAT_GROUP};\n",
            whole.shared(threads, cols),
            entry(threads as u32)
        );
        let mut start = 0;
        for ((n, tag, _), pro) in members.iter().zip(&pros) {
            let part = Gemv {
                batch: 1,
                m,
                n: *n,
                k,
            };
            let end = start + n.div_ceil(cols);
            let _ = writeln!(
                main,
                "  if (g0 < {end}u) {{\n  let g = g0 - {start}u;\n{}  return;\n  }}",
                part.body(threads, cols, 1, tag, pro)
            );
            start = end;
        }
        main.push_str("}\n");
        let built = kb.finish(&main);
        let workgroups = grid(start as u64, lw.options.max_workgroups_per_dim)?;
        let storage = (4 * m * cols * threads) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [threads as u32, 1, 1], workgroups, storage)
    }

    /// The workgroup memory the partial sums are reduced in.
    fn shared(&self, threads: usize, cols: usize) -> String {
        format!(
            "var<workgroup> red: array<f32, {}>;\n",
            self.m * cols * threads
        )
    }

    /// The statements of a workgroup `g` (a `u32` in scope) computing its
    /// block of columns after the `prologue`, calling the functions tagged
    /// `tag`.
    fn body(
        &self,
        threads: usize,
        cols: usize,
        splits: usize,
        tag: &str,
        prologue: &str,
    ) -> String {
        let (m, n) = (self.m, self.n);
        // k of a split (a multiple of 4 when split)
        let depth = self.k / splits;
        let chunks = depth.div_ceil(4);
        let sums = m * cols;
        let blocks = n.div_ceil(cols);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "  if (g >= {}u) {{ return; }}\n\
             \x20 let kbase = (g / {}u) * {depth}u;\n  let sb = g / {blocks}u;\n\
             \x20 let bt = sb % {}u;\n  let n0 = (g % {blocks}u) * {cols}u;",
            blocks * self.batch * splits,
            blocks * self.batch,
            self.batch
        );
        s.push_str(prologue);
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
            let _ = writeln!(s, "    let b{j} = xb{tag}(bt, c{j}, k);");
        }
        for i in 0..m {
            let _ = writeln!(s, "    let a{i} = xa{tag}(bt, {i}u, k);");
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
             \x20   if (c < {n}u) {{ gstore{tag}(sb, lid / {cols}u, c, red[lid * {threads}u]); }}\n  }}"
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::Gemv;

    #[test]
    fn few_columns_split_deep_k() {
        let gemv = |n, k| {
            Gemv {
                batch: 1,
                m: 1,
                n,
                k,
            }
            .shape(usize::MAX)
        };
        // (invocations, columns, splits)
        assert_eq!(gemv(64, 4096), (128, 1, 8));
        assert_eq!(gemv(1024, 1024), (128, 2, 1));
        assert_eq!(gemv(32000, 1024), (128, 4, 1));
        assert_eq!(gemv(10, 2047), (128, 1, 1));
    }
}
