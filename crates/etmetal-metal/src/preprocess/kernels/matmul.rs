//! Matrix products — `matmul` (1-D operands, batch broadcasting; mm, bmm),
//! `addmm` and `linear` — as one register-tiled GEMM kernel ([`Gemm`]).
//!
//! Operands are lazy views, so `weight.T`, permutes and expands are index
//! arithmetic in the tile loads. Each workgroup computes a `bm × bn` tile
//! of one batch's output; `k` is walked in `bk`-deep slices staged in
//! workgroup memory, and each invocation keeps a `tm × tn` block of
//! accumulators (f32) in registers. The bias and `alpha`/`beta` are applied
//! in the store (the epilogue). [`super::conv`] reuses [`Gemm`] for
//! convolution as an implicit GEMM.

use std::fmt::Write;

use etmetal_core::shape::broadcast_shapes;
use etmetal_core::{DType, Error, Op, Result};
use etmetal_graph::Node;

use crate::preprocess::emit::{grid, linear, unravel, Built, KernelBuilder, FLAT_GROUP};
use crate::preprocess::expr::{Kind, Lazy, LazyRef};
use crate::preprocess::pointwise::{cast, float_literal};
use crate::preprocess::Lowering;

pub(super) fn takes(op: &Op) -> bool {
    matches!(op, Op::MatMul | Op::Addmm { .. } | Op::Linear)
}

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

    let gemm = Gemm {
        batch: batch.iter().product(),
        m,
        n,
        k,
        a_k_fast: !is_transpose(&a),
        b_k_fast: is_transpose(&b),
    };
    gemm.lower(lw, |kb| {
        kb.value_fn(&a, "va")?;
        kb.value_fn(&b, "vb")?;
        let at = |bt: &str, rest: &[&str]| -> String {
            let mut idx = unravel(bt, &batch);
            idx.extend(rest.iter().map(|s| s.to_string()));
            idx.join(", ")
        };
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
        let e = linear(&["bt".into(), "r".into(), "c".into()], &[gemm.batch, m, n]);
        let value = cast(&format!("({value})"), DType::F32, out_dtype);
        let store = kb.store(out, "e", &value)?;
        let _ = writeln!(
            fns,
            "fn gstore(bt: u32, r: u32, c: u32, v: f32) {{\n  let e = {e};\n  {store}\n}}\n"
        );
        Ok(fns)
    })
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
/// kernel. The caller's WGSL defines `ga(bt, r, k) -> f32`,
/// `gb(bt, k, c) -> f32` (called with in-range indices only) and
/// `gstore(bt, r, c, v)`.
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
}

impl Gemm {
    fn tile(&self) -> Tile {
        let (m, n) = (self.m, self.n);
        if m >= 512 && n >= 512 {
            Tile {
                bm: 128,
                bn: 128,
                bk: 8,
                tm: 8,
                tn: 8,
            }
        } else if m <= 16 && n > m {
            // matrix-vector-like: few rows, many columns per workgroup
            Tile {
                bm: 16,
                bn: 64,
                bk: 32,
                tm: 1,
                tn: 4,
            }
        } else if n <= 16 && m > n {
            Tile {
                bm: 64,
                bn: 16,
                bk: 32,
                tm: 4,
                tn: 1,
            }
        } else {
            Tile {
                bm: 64,
                bn: 64,
                bk: 16,
                tm: 4,
                tn: 4,
            }
        }
    }

    /// Shared-array row lengths: one word of padding where the tile is
    /// written with k fastest, so those stores spread over the banks.
    fn strides(&self, t: &Tile) -> (usize, usize) {
        (
            t.bm + usize::from(self.a_k_fast),
            t.bn + usize::from(self.b_k_fast),
        )
    }

    /// Validate and append the kernel: `fns` emits the operand and store
    /// functions (returning their WGSL), then the tiled main follows.
    pub fn lower(
        &self,
        lw: &mut Lowering,
        fns: impl FnOnce(&mut KernelBuilder) -> Result<String>,
    ) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.batch == 0 {
            // nothing to write
            return Ok(());
        }
        let t = self.tile();
        let mut kb = KernelBuilder::new(&lw.buffers);
        let main = format!("{}\n{}", fns(&mut kb)?, self.main(&t));
        let built: Built = kb.finish(&main);
        let tiles = self.m.div_ceil(t.bm) as u64 * self.n.div_ceil(t.bn) as u64;
        let groups = tiles * self.batch as u64;
        let workgroups = grid(groups, lw.options.max_workgroups_per_dim)?;
        let (sa, sb) = self.strides(&t);
        let storage = (4 * t.bk * (sa + sb)) as u32;
        let ops = vec![lw.op_label()];
        lw.add_dispatch(built, ops, [t.threads() as u32, 1, 1], workgroups, storage)
    }

    fn main(&self, t: &Tile) -> String {
        let Tile { bm, bn, bk, tm, tn } = *t;
        let threads = t.threads();
        let (sa, sb) = self.strides(t);
        let (m, n, k) = (self.m, self.n, self.k);
        let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
        let (rs, cs) = (bm / tm, bn / tn);
        let mut s = String::new();
        let _ = writeln!(s, "var<workgroup> ta: array<f32, {}>;", bk * sa);
        let _ = writeln!(s, "var<workgroup> tb: array<f32, {}>;", bk * sb);
        let _ = writeln!(
            s,
            "@compute @workgroup_size({threads})\n\
             fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, \
             @builtin(local_invocation_index) lid: u32) {{"
        );
        let _ = writeln!(
            s,
            "  let g = {FLAT_GROUP};\n  if (g >= {}u) {{ return; }}\n\
             \x20 let bt = g / {}u;\n  let tile = g % {}u;\n\
             \x20 let m0 = (tile / {tiles_n}u) * {bm}u;\n  let n0 = (tile % {tiles_n}u) * {bn}u;\n\
             \x20 let tx = lid % {cs}u;\n  let ty = lid / {cs}u;",
            tiles_m * tiles_n * self.batch,
            tiles_m * tiles_n,
            tiles_m * tiles_n,
        );
        for i in 0..tm {
            for j in 0..tn {
                let _ = writeln!(s, "  var c{i}_{j} = 0.0;");
            }
        }
        let _ = writeln!(s, "  for (var k0 = 0u; k0 < {k}u; k0 = k0 + {bk}u) {{");
        // stage A[m0.., k0..] as ta[kk * sa + r] and B[k0.., n0..] as tb[kk * sb + c]
        let fill =
            |s: &mut String, total: usize, r: String, kk: String, read: String, dst: String| {
                let _ = writeln!(
                    s,
                    "    for (var e = lid; e < {total}u; e = e + {threads}u) {{\n\
                 \x20     let r = {r};\n      let kk = {kk};\n{read}\n      {dst}\n    }}"
                );
            };
        let (ar, ak) = if self.a_k_fast {
            (format!("e / {bk}u"), format!("e % {bk}u"))
        } else {
            (format!("e % {bm}u"), format!("e / {bm}u"))
        };
        fill(
            &mut s,
            bm * bk,
            ar,
            ak,
            format!(
                "      let gr = m0 + r;\n      let gk = k0 + kk;\n\
                 \x20     let v = select(0.0, ga(bt, min(gr, {}u), min(gk, {}u)), gr < {m}u && gk < {k}u);",
                m - 1,
                k.max(1) - 1
            ),
            format!("ta[kk * {sa}u + r] = v;"),
        );
        let (bc, bkk) = if self.b_k_fast {
            (format!("e / {bk}u"), format!("e % {bk}u"))
        } else {
            (format!("e % {bn}u"), format!("e / {bn}u"))
        };
        fill(
            &mut s,
            bn * bk,
            bc,
            bkk,
            format!(
                "      let gc = n0 + r;\n      let gk = k0 + kk;\n\
                 \x20     let v = select(0.0, gb(bt, min(gk, {}u), min(gc, {}u)), gc < {n}u && gk < {k}u);",
                k.max(1) - 1,
                n - 1
            ),
            format!("tb[kk * {sb}u + r] = v;"),
        );
        let _ = writeln!(s, "    workgroupBarrier();");
        let _ = writeln!(s, "    for (var kk = 0u; kk < {bk}u; kk = kk + 1u) {{");
        for i in 0..tm {
            let _ = writeln!(s, "      let a{i} = ta[kk * {sa}u + ty + {}u];", rs * i);
        }
        for j in 0..tn {
            let _ = writeln!(s, "      let b{j} = tb[kk * {sb}u + tx + {}u];", cs * j);
        }
        for i in 0..tm {
            for j in 0..tn {
                let _ = writeln!(s, "      c{i}_{j} = fma(a{i}, b{j}, c{i}_{j});");
            }
        }
        let _ = writeln!(s, "    }}\n    workgroupBarrier();\n  }}");
        for i in 0..tm {
            let _ = writeln!(s, "  let r{i} = m0 + ty + {}u;", rs * i);
        }
        for j in 0..tn {
            let _ = writeln!(s, "  let q{j} = n0 + tx + {}u;", cs * j);
        }
        for i in 0..tm {
            for j in 0..tn {
                let _ = writeln!(
                    s,
                    "  if (r{i} < {m}u && q{j} < {n}u) {{ gstore(bt, r{i}, q{j}, c{i}_{j}); }}"
                );
            }
        }
        s.push_str("}\n");
        s
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
    fn mismatched_operands_are_errors() {
        let f = DType::F32;
        let bad = lower_one(
            Op::Linear,
            vec![input(f, &[2, 3]), weight(f, &[4, 3, 1]), None],
        );
        assert!(bad.is_err());
    }
}
