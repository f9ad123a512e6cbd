//! Matrix products — `matmul` (1-D operands, batch broadcasting; mm, bmm),
//! `addmm` and `linear` — on the GEMM family ([`super::gemm`]): a
//! register-tiled [`Gemm`] (with a tensor-core alternative for 16-bit
//! operands), or, for at most 8 rows per batch against a `k`-contiguous
//! right operand (a decode step's linear layers), a [`Gemv`] that reads
//! the weight once in coalesced 16-byte chunks.
//!
//! Operands are lazy views, so `weight.T`, permutes and expands are index
//! arithmetic in the kernels' reads ([`MatmulArgs`]); a contiguous run of
//! a buffer along `k` is read as vectors. The bias and `alpha`/`beta` are
//! applied in the store (the epilogue; 16-bit outputs are rounded there).

use std::fmt::Write;

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::sym::SymExpr;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use super::epilogue::{self, Tail};
use super::gemm::{Epilogue, F16Scaling, Gemm, GemmArgs, Gemv, GemvArgs, GEMV_ROWS};
use super::glu::Gated;
use crate::preprocess::buffers::BufferIdx;
use crate::preprocess::deferred::RowStat;
use crate::preprocess::emit::{expanded_index, lane_strided, linear, unravel, KernelBuilder};
use crate::preprocess::expr::{reshaped, GatherAt, Kind, Lazy, LazyRef, Pos};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::sizes::extent;

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    if let Some(gated) = Gated::of_siblings(lw, node) {
        return gated.lower_siblings(lw, node);
    }
    let (args, k) = product(lw, node, String::new(), &[], true)?;
    let (m, n) = (args.m, args.n);
    let batches: usize = args.batch.iter().product();
    if m <= GEMV_ROWS && is_transpose(&args.b) {
        let siblings = siblings(lw, node, &args, k);
        if !siblings.is_empty() {
            return lower_siblings(lw, args, k, &siblings);
        }
        return Gemv {
            batch: batches,
            m,
            n,
            k,
        }
        .lower(lw, &args);
    }
    let gemm = Gemm {
        batch: batches,
        m,
        n,
        k,
        a_k_fast: !is_transpose(&args.a),
        b_k_fast: is_transpose(&args.b),
        coop: F16Scaling::of(lw, &args.a)
            .zip(F16Scaling::of(lw, &args.b))
            .map(|(x, y)| [x, y]),
        dynamic: dynamic_extent(lw, node, args.batch.len()),
    };
    gemm.lower(lw, &args)
}

/// The run-time `(batch, m, n)` extents of a product whose output is
/// dynamic: its dims split as `[batch…, m…, n]` (a linear's leading dims
/// flattened into m).
fn dynamic_extent(lw: &Lowering, node: &Node, batch_dims: usize) -> Option<[SymExpr; 3]> {
    let out = node.outputs[0];
    if !lw.graph.is_dynamic(out) {
        return None;
    }
    let dims: Vec<(SymExpr, usize)> = lw
        .sizes
        .local(&lw.graph.sym_dims(out))
        .into_iter()
        .zip(lw.graph.value(out).shape.iter().copied())
        .collect();
    let r = dims.len();
    if r < batch_dims + 2 {
        return None;
    }
    // (the rows of the bound layout up to the last valid one: `[2, s]`
    // rows of a linear are `S + s`, not `2s`)
    Some([
        extent(&dims[..batch_dims]),
        extent(&dims[batch_dims..r - 1]),
        dims[r - 1].0.clone(),
    ])
}

/// The later linear layers of one row block that read `node`'s input and
/// can be computed now (their weights and biases are constants, their
/// residuals computed), as many as one kernel binds with `node`'s: a
/// layer's q, k and v, or gate and up, are one dispatch.
fn siblings<'g>(
    lw: &Lowering<'g>,
    node: &Node,
    args: &MatmulArgs,
    k: usize,
) -> Vec<(usize, &'g Node)> {
    if node.op != Op::Linear || !args.batch.is_empty() {
        return vec![];
    }
    let mut bufs = vec![];
    for x in [Some(&args.a), Some(&args.b), args.bias.as_ref()]
        .into_iter()
        .flatten()
    {
        add_reads(lw, x, &mut bufs);
    }
    args.tail.buffers(&mut bufs);
    let checks = args.a.has_checks();
    let mut outputs = 1;
    let dtype = lw.graph.value(node.outputs[0]).dtype;
    let mut found = vec![];
    for (n, other) in lw.nodes_after(node) {
        let same = other.op == Op::Linear
            && other.inputs.first() == node.inputs.first()
            && other.outputs.len() == 1
            && lw.graph.value(other.outputs[0]).dtype == dtype;
        if !same {
            continue;
        }
        let ready = |slot: usize| match other.inputs.get(slot).copied().flatten() {
            Some(v) => lw.value(v).ok().filter(|x| x.is_view()),
            None => None,
        };
        let Some(w) = ready(1) else { continue };
        if w.shape.len() != 2 || w.shape[1] != k {
            continue;
        }
        let bias = match other.inputs.get(2).copied().flatten() {
            Some(_) => match ready(2) {
                Some(b) => Some(b),
                None => continue,
            },
            None => None,
        };
        let mut more = bufs.clone();
        w.buffers(&mut more);
        if let Some(b) = &bias {
            b.buffers(&mut more);
        }
        for b in epilogue::reads(lw, other) {
            if !more.contains(&b) {
                more.push(b);
            }
        }
        if more.len() + outputs + 1 + usize::from(checks) > lw.options.max_bindings {
            continue;
        }
        bufs = more;
        outputs += 1;
        found.push((n, other));
    }
    found
}

/// `args` and its `siblings` as one matrix-vector dispatch.
fn lower_siblings(
    lw: &mut Lowering,
    args: MatmulArgs,
    k: usize,
    siblings: &[(usize, &Node)],
) -> Result<()> {
    let m = args.m;
    let mut all = vec![args];
    for (i, &(n, node)) in siblings.iter().enumerate() {
        lw.absorb(n, &[]);
        // (a tail reading another product of the kernel would read it unwritten)
        let written: Vec<BufferIdx> = all.iter().map(|p| p.tail.out).collect();
        let (p, _) = product(lw, node, format!("_{}", i + 1), &written, true)?;
        all.push(p);
    }
    let members: Vec<(usize, String, &dyn GemvArgs)> = all
        .iter()
        .map(|p| (p.n, p.tag.clone(), p as &dyn GemvArgs))
        .collect();
    Gemv::lower_group(lw, m, k, &members)
}

/// A matrix product's operands, output and store ([`MatmulArgs`], its
/// functions named with `tag`) and `k`; its kernel also writes `unwritten`.
/// The store computes the pointwise nodes after it ([`Tail::plan`]) where
/// `epilogue`, else stores the product alone.
pub(super) fn product(
    lw: &mut Lowering,
    node: &Node,
    tag: String,
    unwritten: &[BufferIdx],
    epilogue: bool,
) -> Result<(MatmulArgs, usize)> {
    let (a, b, bias, alpha, beta) = match &node.op {
        Op::MatMul => (
            lw.input_view(node, 0)?,
            right_operand(lw, node, 1)?,
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
                gemv_operand(lw, node, wt.shape[1])?,
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
    let mut a = a;
    let reads: usize = [Some(&a), Some(&b), bias.as_ref()]
        .into_iter()
        .flatten()
        .map(|x| {
            let mut bufs = vec![];
            add_reads(lw, x, &mut bufs);
            bufs.len() + usize::from(x.has_checks())
        })
        .sum::<usize>()
        + epilogue::reads(lw, node).len();
    // the output and the operands' buffers (each counted per operand: an
    // upper bound) within a kernel's bindings, else A is written out first
    if !a.is_view() && reads + 1 > lw.options.max_bindings {
        // (only a linear's input is read as it is: same elements)
        a = reshaped(&lw.input_view(node, 0)?, a.shape.clone());
    }
    let gemv = m <= GEMV_ROWS && is_transpose(&b);
    let operands = [Some(&a), Some(&b), bias.as_ref()];
    let mut bound = vec![];
    for x in operands.into_iter().flatten() {
        add_reads(lw, x, &mut bound);
    }
    let checks = operands.into_iter().flatten().any(|x| x.has_checks());
    // the tensor-core kernel binds the exponents of operands scaled at run time
    let lines = match gemv {
        true => 0,
        false => [&a, &b]
            .into_iter()
            .filter(|x| F16Scaling::of(lw, x) == Some(F16Scaling::Lines))
            .count(),
    };
    let tail = match epilogue {
        true => Tail::plan(lw, node, &bound, usize::from(checks) + lines, unwritten)?,
        false => Tail::none(lw, node)?,
    };
    let (out, out_dtype) = (tail.out, lw.buffers.list[tail.out].dtype);
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

    // the row means A reads (an RMSNorm's), computed by the kernel itself
    let mut read = vec![];
    a.buffers(&mut read);
    let stats = match gemv {
        true => lw
            .pending
            .iter()
            .filter(|st| read.contains(&st.buf))
            .map(|st| (st.clone(), lw.buffers.list[st.buf].dtype))
            .collect(),
        false => vec![],
    };
    let args = MatmulArgs {
        a,
        b,
        bias,
        tail,
        stats,
        alpha,
        beta,
        batch,
        m,
        n,
        tag,
    };
    Ok((args, k))
}

/// Input `slot` of a product, its right operand: a gather of a view at
/// indices that are a view (a MoE decode step's routed experts' weights,
/// `index_select(w, 0, expert)`) is read in place by the product's kernel,
/// which then reads only the routed experts' weights and no copy of them
/// is written and read again; anything else as [`Lowering::input_view`].
/// Every reader of the kernels takes it: the element reads (`ga`/`gb`,
/// emitted through the gather) and the chunk readers, which fall back to
/// them where it is no plain run of a buffer ([`k_run`]).
fn right_operand(lw: &mut Lowering, node: &Node, slot: usize) -> Result<LazyRef> {
    let b = lw.input(node, slot)?;
    if matches!(&b.kind, Kind::Gather { src, index, .. } if src.is_view() && index.is_view()) {
        return Ok(b);
    }
    lw.input_view(node, slot)
}

/// Input 0 of a linear layer with `n` outputs: for at most [`GEMV_ROWS`]
/// rows (a [`Gemv`]) a pointwise value is read as it is, its math
/// repeated by each workgroup (an RMSNorm's scaling, a SiLU gate: cheaper
/// than a dispatch writing it out and reading it back); else a view.
fn gemv_operand(lw: &mut Lowering, node: &Node, n: usize) -> Result<LazyRef> {
    let x = lw.input(node, 0)?;
    let k = x.shape.last().copied().unwrap_or(1);
    let rows = x.shape.iter().product::<usize>() / k.max(1);
    if x.is_view() || rows > GEMV_ROWS || n == 0 || x.shape.len() < 2 {
        return lw.input_view(node, 0);
    }
    Ok(x)
}

/// Workgroup arrays (`decls`) and the statements filling them (`s`, run by
/// all `threads` invocations, a power of two, with `red` workgroup memory of
/// at least `threads` floats): the row means `stats` of a matrix-vector
/// kernel's operand, computed by each workgroup instead of a row kernel of
/// their own, which the kernel's reads of their buffers then read.
pub(super) fn row_stat_prologue(
    kb: &mut KernelBuilder,
    stats: &[(RowStat, DType)],
    tag: &str,
    threads: usize,
) -> Result<(String, String)> {
    let (mut decls, mut s) = (String::new(), String::new());
    for (j, (st, dtype)) in stats.iter().enumerate() {
        let (name, f) = (format!("st{tag}_{j}"), format!("sx{tag}_{j}"));
        kb.value_fn(&st.x, &f)?;
        kb.substitute(st.buf, &name);
        let _ = writeln!(decls, "var<workgroup> {name}: array<f32, {}>;", st.rows);
        let mean = cast(
            &format!("(red[0] / {})", float_literal(st.cols as f64)),
            DType::F32,
            *dtype,
        );
        // each row: strided sums, halved in workgroup memory
        for r in 0..st.rows {
            let sum = lane_strided(
                "c",
                st.cols,
                threads,
                &format!("    acc = acc + {f}({r}u, c);\n"),
            );
            let _ = writeln!(
                s,
                "  {{\n    var acc = 0.0;\n{sum}\
                 \x20   red[lid] = acc;\n    workgroupBarrier();\n\
                 \x20   for (var h = {half}u; h > 0u; h = h >> 1u) {{\n\
                 \x20     if (lid < h) {{ red[lid] = red[lid] + red[lid + h]; }}\n      workgroupBarrier();\n    }}\n\
                 \x20   if (lid == 0u) {{ {name}[{r}u] = {mean}; }}\n    workgroupBarrier();\n  }}",
                half = threads / 2
            );
        }
    }
    Ok((decls, s))
}

/// How a matrix product's kernels read its operands (lazy views of
/// `[batch…, m, k]` and `[batch…, k, n]`) and store its output (`alpha`,
/// the bias times `beta`, rounding to the output dtype, then its pointwise
/// tail: a skip connection's add, an activation).
pub(super) struct MatmulArgs {
    a: LazyRef,
    pub b: LazyRef,
    /// `[batch…, m, n]`; absent (also when `beta` is 0).
    bias: Option<LazyRef>,
    /// The store, and the pointwise chain after it ([`Tail`]).
    tail: Tail,
    alpha: f64,
    beta: f64,
    /// The broadcast batch dims.
    pub batch: Vec<usize>,
    pub m: usize,
    pub n: usize,
    /// Appended to the names of its matrix-vector functions (`xa`, `xb`,
    /// `gstore`, …), so products of one kernel have their own.
    tag: String,
    /// Row means A reads that the matrix-vector kernel computes first
    /// (with the dtype they are stored in).
    stats: Vec<(RowStat, DType)>,
}

/// Add the buffers a kernel binds to read `x` to `bufs`: a pending row
/// mean's are those of what it averages (a matrix-vector kernel computes
/// it; elsewhere it is dispatched first and read: one buffer less).
pub(super) fn add_reads(lw: &Lowering, x: &LazyRef, bufs: &mut Vec<BufferIdx>) {
    let mut read = vec![];
    x.buffers(&mut read);
    for b in read {
        match lw.pending.iter().find(|st| st.buf == b) {
            Some(st) => st.x.buffers(bufs),
            None if !bufs.contains(&b) => bufs.push(b),
            None => {}
        }
    }
}

impl MatmulArgs {
    /// The index of an operand at batch `bt` (a flat index) and `rest`.
    fn at(&self, bt: &str, rest: &[&str]) -> String {
        let mut idx = unravel(bt, &self.batch);
        idx.extend(rest.iter().map(|s| s.to_string()));
        idx.join(", ")
    }
}

impl MatmulArgs {
    /// The f32 value of output `(bt, r, c)` from its sum `v`: `alpha`, and
    /// the bias times `beta`.
    fn scaled(&self, kb: &mut KernelBuilder, v: &str) -> Result<String> {
        let mut value = if self.alpha == 1.0 {
            v.to_string()
        } else {
            format!("{} * {v}", float_literal(self.alpha))
        };
        if let Some(bias) = &self.bias {
            let f = format!("vbias{}", self.tag);
            kb.value_fn(bias, &f)?;
            let read = format!("{f}({})", self.at("bt", &["r", "c"]));
            value = if self.beta == 1.0 {
                format!("{read} + {value}")
            } else {
                format!("{} * {read} + {value}", float_literal(self.beta))
            };
        }
        Ok(value)
    }

    /// The buffer a product stored without an epilogue would write, and its
    /// value from the sum `v`, rounded to the output dtype (a store that
    /// substitutes it, `glu.rs`).
    pub(super) fn stored_value(
        &self,
        kb: &mut KernelBuilder,
        v: &str,
    ) -> Result<(BufferIdx, String)> {
        let value = self.scaled(kb, v)?;
        self.tail.substituted(&value)
    }
}

impl Epilogue for MatmulArgs {
    fn store(&self, kb: &mut KernelBuilder) -> Result<String> {
        let value = self.scaled(kb, "v")?;
        let batches: usize = self.batch.iter().product();
        let e = linear(
            &["bt".into(), "r".into(), "c".into()],
            &[batches, self.m, self.n],
        );
        // (a tail's add rounds twice, as PyTorch stores the product first)
        let (decls, store) = self.tail.store(kb, "e", &value, &self.tag)?;
        Ok(format!(
            "{decls}fn gstore{}(bt: u32, r: u32, c: u32, v: f32) {{\n  let e = {e};\n  {store}\n}}\n\n",
            self.tag
        ))
    }
}

impl GemmArgs for MatmulArgs {
    fn elements(&self, kb: &mut KernelBuilder) -> Result<String> {
        kb.value_fn(&self.a, "va")?;
        kb.value_fn(&self.b, "vb")?;
        let mut fns = String::new();
        let _ = writeln!(
            fns,
            "fn ga(bt: u32, r: u32, k: u32) -> f32 {{ return va({}); }}",
            self.at("bt", &["r", "k"])
        );
        let _ = writeln!(
            fns,
            "fn gb(bt: u32, k: u32, c: u32) -> f32 {{ return vb({}); }}",
            self.at("bt", &["k", "c"])
        );
        Ok(fns)
    }

    fn chunks(&self, kb: &mut KernelBuilder) -> Result<Option<String>> {
        let fns = chunk_reader(kb, &self.a, "ca", &self.batch, is_transpose(&self.a), 4)?;
        let fns = fns + &chunk_reader(kb, &self.b, "cb", &self.batch, is_transpose(&self.b), 4)?;
        Ok(Some(fns))
    }
}

impl GemvArgs for MatmulArgs {
    fn prologue(&self, kb: &mut KernelBuilder, threads: usize) -> Result<(String, String)> {
        row_stat_prologue(kb, &self.stats, &self.tag, threads)
    }

    fn k_chunks(&self, kb: &mut KernelBuilder, lanes: usize) -> Result<String> {
        let (xa, xb) = (format!("xa{}", self.tag), format!("xb{}", self.tag));
        let fns = chunk_reader(kb, &self.a, &xa, &self.batch, false, lanes)?;
        Ok(fns + &chunk_reader(kb, &self.b, &xb, &self.batch, true, lanes)?)
    }

    fn b_dtype(&self) -> DType {
        self.b.dtype
    }

    fn a_is_plain(&self) -> bool {
        let mut idx = unravel("bt", &self.batch);
        idx.extend(["j".to_string(), "k".to_string()]);
        let mut gathers = vec![];
        k_run(&self.a, &idx, &mut gathers).is_some() && gathers.is_empty()
    }

    fn prologue_bytes(&self) -> usize {
        self.stats.iter().map(|(st, _)| 4 * st.rows).sum()
    }
}

/// Emit `fn name(bt: u32, j: u32, k: u32)`: elements `k … k+lanes-1`
/// (`k` a multiple of `lanes`, 4 or 8; zeros past the end) of row `j` of a
/// product's `[batch…, rows, K]` left operand `x`, or of column `j` of its
/// `[batch…, K, cols]` right operand (`column`), as a `vec4<f32>` (4) or an
/// `array<vec4<f32>, 2>` (8). A contiguous run of a buffer is read in
/// vector loads (through gathers along other dims, each index read once
/// for the chunk: a MoE decode step's routed experts' weights), anything
/// else element by element.
pub(super) fn chunk_reader(
    kb: &mut KernelBuilder,
    x: &LazyRef,
    name: &str,
    batch: &[usize],
    column: bool,
    lanes: usize,
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
    let ty = match lanes {
        4 => "vec4<f32>",
        _ => "array<vec4<f32>, 2>",
    };
    let at = idx("k");
    let mut gathers = vec![];
    let body = match k_run(x, &at, &mut gathers) {
        Some((buf, at, shape)) if kdim.is_multiple_of(lanes) => {
            let mut lets = String::new();
            for (i, g) in gathers.iter().enumerate() {
                let f = format!("v{name}_g{i}");
                kb.value_fn(g.index, &f)?;
                let pos = kb.gather_index(&format!("ri{i}"), g.index.dtype, g.n, g.len)?;
                let _ = write!(lets, "let ri{i} = {f}({});\n  let gi{i} = {pos};\n  ", g.at);
            }
            let c = format!("({}) / {lanes}u", linear(&at, &shape));
            let load = match lanes {
                4 => kb.load4(buf, &c)?,
                _ => kb.load8(buf, &c)?,
            };
            format!("{lets}return {load};")
        }
        _ => {
            let f = format!("v{name}");
            kb.value_fn(x, &f)?;
            let lane = |i: usize| {
                let ki = format!("min(k + {i}u, {}u)", kdim - 1);
                let call = format!("{f}({})", idx(&ki).join(", "));
                if kdim.is_multiple_of(lanes) || i == 0 {
                    call
                } else {
                    format!("select(0.0, {call}, k + {i}u < {kdim}u)")
                }
            };
            let quad = |q: usize| {
                let l: Vec<String> = (4 * q..4 * q + 4).map(lane).collect();
                format!("vec4<f32>({})", l.join(", "))
            };
            let quads: Vec<String> = (0..lanes / 4).map(quad).collect();
            match lanes {
                4 => format!("return {};", quads[0]),
                _ => format!("return {ty}({});", quads.join(", ")),
            }
        }
    };
    Ok(format!(
        "fn {name}(bt: u32, j: u32, k: u32) -> {ty} {{\n  {body}\n}}\n\n"
    ))
}

/// A gather (`index_select`) that [`k_run`] sees through: the index it
/// reads, once for a whole chunk, as `gi{n}` (its place in the list).
struct Gathered<'a> {
    index: &'a LazyRef,
    /// Where `index` is read (the gathered dim's index, never `k`).
    at: String,
    /// The gathered dim's size, which the index is clamped into.
    n: usize,
    len: &'a Pos,
}

/// Where `x` read at `idx` lies in a buffer, when `x` only permutes and
/// broadcasts that buffer (or reads it in order through reshapes,
/// [`Lazy::contiguous_source`]) and the index named `k` walks its last,
/// contiguous dim: the buffer, the index there and the shape it is read as.
/// A gather along a dim that `k` does not walk (the batch dim of routed
/// experts' weights) is seen through: its index is pushed on `gathers`
/// and read by name (`gi{n}`), one read for all of a chunk's elements.
fn k_run<'a>(
    x: &'a LazyRef,
    idx: &[String],
    gathers: &mut Vec<Gathered<'a>>,
) -> Option<(BufferIdx, Vec<String>, Vec<usize>)> {
    match &x.kind {
        Kind::Load(buf) => (idx.last().map(String::as_str) == Some("k"))
            .then(|| (*buf, idx.to_vec(), x.shape.clone())),
        // (a buffer read in order through reshapes: x's index is the buffer's)
        Kind::Reshape(_) => (idx.last().map(String::as_str) == Some("k"))
            .then(|| x.contiguous_source())?
            .map(|buf| (buf, idx.to_vec(), x.shape.clone())),
        Kind::Permute(inner, dims) => {
            let mut at = vec![String::new(); dims.len()];
            for (i, &d) in dims.iter().enumerate() {
                at[d] = idx[i].clone();
            }
            k_run(inner, &at, gathers)
        }
        Kind::Expand(inner) => k_run(inner, &expanded_index(idx, &inner.shape), gathers),
        Kind::Gather {
            src,
            dim,
            index,
            at: GatherAt::Dim,
            len,
        } if idx[*dim] != "k" => {
            let mut inner = idx.to_vec();
            inner[*dim] = format!("gi{}", gathers.len());
            gathers.push(Gathered {
                index,
                at: idx[*dim].clone(),
                n: src.shape[*dim],
                len,
            });
            k_run(src, &inner, gathers)
        }
        _ => None,
    }
}

/// Whether `x` reads its last two dims swapped (a transposed matrix), so a
/// tile is best loaded along its second-last dim. A gather of whole
/// matrices (`index_select` along a batch dim: routed experts' `[n, k]`
/// weights) keeps its source's layout within each.
fn is_transpose(x: &LazyRef) -> bool {
    match &x.kind {
        Kind::Permute(_, dims) => {
            let r = dims.len();
            r >= 2 && dims[r - 2] == r - 1 && dims[r - 1] == r - 2
        }
        Kind::Expand(inner) => is_transpose(inner),
        Kind::Gather {
            src,
            dim,
            at: GatherAt::Dim,
            ..
        } if *dim + 2 < x.shape.len() => is_transpose(src),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use etmetal_core::{DType, Op};

    use crate::preprocess::kernels::testing::{input, lower_one, lower_one_with, weight, Operand};
    use crate::preprocess::options::PreprocessOptions;

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

    /// Decode-step linears (one row) are matrix-vector kernels reading the
    /// weight in 16-byte chunks, with enough workgroups for a large GPU.
    #[test]
    fn decode_linears_read_weight_chunks() {
        for (dtype, k, n, chunk) in [
            (DType::F32, 1024, 1024, Some("array<vec4<f32>>")),
            (DType::BF16, 1024, 32000, Some("array<vec4<u32>>")),
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
            // (enough workgroups for a large GPU: column groups stop there)
            let groups: u32 = d.workgroups.iter().product();
            let fill = crate::preprocess::kernels::gemm::GROUP_FILL as u32;
            assert!(groups >= fill, "{n} columns in {groups} workgroups");
        }
    }

    /// The split cases of the GPU tests (gpu_matmul.rs) do split.
    #[test]
    fn deep_k_is_split_when_tiles_are_few() {
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

    /// `[160, 1024] @ [1024, 160]` splits `k` 8 ways: 819 200 bytes of
    /// partial sums, more than its largest value (655 360). Within a
    /// 700 000 byte buffer limit it splits 4 ways; every buffer fits.
    #[test]
    fn split_k_partials_fit_the_buffer_limit() {
        let f = DType::F32;
        let lower = |max_buffer_bytes| {
            let options = PreprocessOptions {
                max_buffer_bytes,
                ..PreprocessOptions::default()
            };
            let operands = vec![input(f, &[160, 1024]), input(f, &[1024, 160])];
            lower_one_with(Op::MatMul, operands, &options)
        };
        for (limit, splits, largest) in [
            (PreprocessOptions::default().max_buffer_bytes, 8, 819_200),
            (700_000, 4, 655_360),
            (655_360, 4, 655_360),
        ] {
            let p = lower(limit).unwrap();
            let parts = p
                .payload
                .buffers
                .iter()
                .find(|b| b.name.ends_with(".split_k"));
            assert_eq!(parts.map(|b| b.shape[0]), Some(splits), "limit {limit}");
            let binding = p.payload.requirements.max_storage_buffer_binding_size;
            assert_eq!(binding, largest, "limit {limit}");
            assert!(binding <= limit);
        }
        // a value over the limit (the partitioner keeps it on the CPU) is
        // a typed error naming it, never a payload that cannot load
        let e = lower(600_000).unwrap_err();
        assert_eq!(e.kind(), etmetal_core::ErrorKind::Limit, "{e}");
        assert!(e.to_string().contains("`in0`"), "{e}");
        assert!(e.to_string().contains("600000 byte buffer limit"), "{e}");
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
