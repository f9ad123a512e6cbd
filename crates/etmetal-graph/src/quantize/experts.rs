//! Routed experts under `--quantize int4`: the stacked expert weights of a
//! mixture-of-experts layer, as the grouped matmul reads them once the
//! importer has lowered it (`pt2::lower::composite`, `grouped_mm`), become
//! int4, and the product [`Op::GatherQmv`] (`metal::gather_qmv`), which
//! multiplies each row by its own expert's weights.
//!
//! Timed on an H100 (`benchmarks/binaries.py`, 2026-12-07, a Qwen3-MoE-shaped
//! model, 6 layers, 8 experts routed top-2, the linears in int4 either
//! way): against experts kept in bf16, a 512-token prefill took 25.4 ms of
//! GPU time against 33.3, in 1000 MiB against 1300; a decode step 1.69 ms
//! against 1.62 (the bf16 experts' routed product reads them in place,
//! `grouped_mm_sparse`: `gather_qmv` is the slower kernel there, for all
//! its quarter of the bytes). So `--quantize int4` takes the experts too;
//! `--quantize-skip experts` keeps them in float.
//!
//! The two forms the importer writes, `B [E, K, N]` the stacked weights as
//! the product reads them:
//! - fewer rows than experts (a decode step): `x [S, 1, K] @
//!   index_select(B, 0, expert)` becomes `gather_qmv(x [S, K], W, expert)`
//!   reshaped to `[S, 1, N]`;
//! - as many rows or more (a prefill): `Σ_e (expand(x) @ B)[e] ⊙ (expert
//!   == e)`, every expert's product of every row of which each row keeps
//!   its own, becomes `gather_qmv(x, W, clamp(expert, 0, E-1)) ⊙ (expert
//!   == clamp(expert, 0, E-1))`: each row times its own expert only (E
//!   times fewer products), and a row past every group (`expert = E`)
//!   still zero.
//!
//! `B` is a constant `[E, K, N]` (gpt-oss stores `gate_up_proj` so), or
//! the transpose of its last two dims of a constant `[E, N, K]`
//! (transformers' `gate_up_proj` and `down_proj` of Qwen3-MoE, Mixtral,
//! Qwen3-Next: `_grouped_mm(x, w.transpose(-2, -1), offs)`). Its `W [E, N,
//! K]` is quantized as `E·N` rows of K, each expert's rows as a linear's
//! ([`super::fit`]: the same groups, fitting and rounding), in the layout
//! of [`etmetal_core::quant`] with the expert dim in front, zeros added
//! (MLX's biases, which `gather_qmv` reads) as the linears' are.
//!
//! A stacked weight is quantized only where every reader of it is such a
//! product: one read in any other way would keep its float copy in the
//! file beside the int4 one ([`float_readers`]).

use std::collections::{HashMap, HashSet};

use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Result, Scalar, Tensor, UnaryOp};
use rayon::prelude::*;

use super::QuantTable;
use crate::ir::{Graph, Node, ValueId};
use crate::rewrite::Rewrite;

/// Stacked expert weights: the constant `value`, `[E, N, K]` (each
/// expert's `W` as a linear's), or `[E, K, N]` where `transposed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stacked {
    pub value: ValueId,
    pub transposed: bool,
    pub e: usize,
    pub n: usize,
    pub k: usize,
}

/// How a routed product picks each row's expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// `x [S, 1, K] @ index_select(B, 0, expert [S])`.
    Sparse { x: ValueId, expert: ValueId },
    /// `Σ_e (expand(x [1, S, K]) @ B)[e] ⊙ (expert [S, 1] == e)`.
    Dense { x: ValueId, expert: ValueId },
}

/// A product of routed rows by stacked expert weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutedProduct {
    /// The node writing the product (the matmul of the sparse form, the
    /// sum over the experts of the dense one), which the rewrite replaces.
    pub anchor: usize,
    pub weight: Stacked,
    pub routing: Routing,
    /// The node reading `B` (the gather, or the dense form's matmul).
    pub reader: usize,
    /// The transpose making `B` of a stored `[E, N, K]`, if any.
    pub transpose: Option<usize>,
}

/// Who makes and who reads each value of a graph.
struct Uses<'g> {
    graph: &'g Graph,
    producer: HashMap<ValueId, usize>,
    readers: HashMap<ValueId, Vec<usize>>,
    outputs: HashSet<ValueId>,
}

impl<'g> Uses<'g> {
    fn new(graph: &'g Graph) -> Uses<'g> {
        let mut producer = HashMap::new();
        let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for (i, node) in graph.nodes.iter().enumerate() {
            for &v in &node.outputs {
                producer.insert(v, i);
            }
            for &v in node.inputs.iter().flatten() {
                let r = readers.entry(v).or_default();
                if r.last() != Some(&i) {
                    r.push(i);
                }
            }
        }
        let outputs = graph.outputs.iter().map(|(v, _)| *v).collect();
        Uses {
            graph,
            producer,
            readers,
            outputs,
        }
    }

    /// The node making `v`, with its index.
    fn made_by(&self, v: ValueId) -> Option<(usize, &'g Node)> {
        let &i = self.producer.get(&v)?;
        Some((i, &self.graph.nodes[i]))
    }

    /// The inputs of the node making `v` when `op` says it is the one.
    fn inputs_of(&self, v: ValueId, op: impl Fn(&Op) -> bool) -> Option<Vec<ValueId>> {
        let (_, node) = self.made_by(v)?;
        if !op(&node.op) {
            return None;
        }
        node.inputs.iter().copied().collect()
    }

    fn readers(&self, v: ValueId) -> &[usize] {
        self.readers.get(&v).map_or(&[], Vec::as_slice)
    }

    /// Whether one node reads `v` and it is no output of the graph.
    fn read_once(&self, v: ValueId) -> bool {
        self.readers(v).len() == 1 && !self.outputs.contains(&v)
    }

    fn shape(&self, v: ValueId) -> &'g [usize] {
        &self.graph.value(v).shape
    }

    /// `v` as stacked expert weights `B [E, K, N]`: a float constant with
    /// data, or the transpose of the last two dims of one (and that node).
    fn stacked(&self, v: ValueId) -> Option<(Stacked, Option<usize>)> {
        let constant = |c: ValueId| {
            let t = self.graph.constants.get(&c)?;
            let fit =
                t.dtype().is_float() && t.rank() == 3 && !self.graph.fake_constants.contains(&c);
            fit.then(|| [t.shape()[0], t.shape()[1], t.shape()[2]])
        };
        if let Some([e, k, n]) = constant(v) {
            let w = Stacked {
                value: v,
                transposed: true,
                e,
                n,
                k,
            };
            return Some((w, None));
        }
        let (i, node) = self.made_by(v)?;
        let (Op::Permute { dims }, [Some(c)]) = (&node.op, node.inputs.as_slice()) else {
            return None;
        };
        let [e, n, k] = constant(*c).filter(|_| dims[..] == [0, 2, 1])?;
        let w = Stacked {
            value: *c,
            transposed: false,
            e,
            n,
            k,
        };
        Some((w, Some(i)))
    }

    /// Node `i` as the sparse form's product.
    fn sparse(&self, i: usize, node: &Node) -> Option<RoutedProduct> {
        let (Op::MatMul, [Some(x), Some(b)]) = (&node.op, node.inputs.as_slice()) else {
            return None;
        };
        let (reader, gather) = self.made_by(*b)?;
        let (Op::IndexSelect { dim: 0 }, [Some(bv), Some(expert)]) =
            (&gather.op, gather.inputs.as_slice())
        else {
            return None;
        };
        let (weight, transpose) = self.stacked(*bv)?;
        let routed = matches!(self.graph.value(*expert).dtype, DType::I32 | DType::I64)
            && self.shape(*x) == [self.shape(*expert)[0], 1, weight.k]
            && self.read_once(*b);
        routed.then_some(RoutedProduct {
            anchor: i,
            weight,
            routing: Routing::Sparse {
                x: *x,
                expert: *expert,
            },
            reader,
            transpose,
        })
    }

    /// Node `i` as the dense form's sum over the experts.
    fn dense(&self, i: usize, node: &Node) -> Option<RoutedProduct> {
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![0],
            keepdim: false,
        };
        let [Some(kept)] = node.inputs.as_slice() else {
            return None;
        };
        if node.op != sum || !self.read_once(*kept) {
            return None;
        }
        let [a, b] = self.inputs_of(*kept, |op| *op == Op::Binary(BinaryOp::Mul))?[..] else {
            return None;
        };
        // (the product of every expert, then the mask of each row's own)
        let ((reader, product), mask) = match self.made_by(a) {
            Some((r, p)) if p.op == Op::MatMul => ((r, p), b),
            _ => (self.made_by(b).filter(|(_, p)| p.op == Op::MatMul)?, a),
        };
        let [Some(xe), Some(bv)] = product.inputs.as_slice() else {
            return None;
        };
        let (weight, transpose) = self.stacked(*bv)?;
        let (e, k) = (weight.e, weight.k);
        let [x] = self.inputs_of(*xe, |op| matches!(op, Op::Expand { .. }))?[..] else {
            return None;
        };
        let [one, s, kx] = self.shape(x)[..] else {
            return None;
        };
        if [one, kx] != [1, k]
            || self.shape(*xe) != [e, s, k]
            || !self.read_once(product.outputs[0])
        {
            return None;
        }
        let expert = self.one_hot(mask, e, s)?;
        Some(RoutedProduct {
            anchor: i,
            weight,
            routing: Routing::Dense { x, expert },
            reader,
            transpose,
        })
    }

    /// `mask [E, S, 1]` as the importer makes it, `reshape(permute(cast(expert
    /// [S, 1] == arange(E) [1, E]), [1, 0]), [E, S, 1])`: `expert`.
    fn one_hot(&self, mask: ValueId, e: usize, s: usize) -> Option<ValueId> {
        let reshape = |to: Vec<usize>| move |op: &Op| *op == Op::Reshape { shape: to.clone() };
        if self.shape(mask) != [e, s, 1] {
            return None;
        }
        let [m] = self.inputs_of(mask, reshape(vec![e, s, 1]))?[..] else {
            return None;
        };
        let [m] = self.inputs_of(m, |op| *op == Op::Permute { dims: vec![1, 0] })?[..] else {
            return None;
        };
        let [m] = self.inputs_of(m, |op| matches!(op, Op::Cast { .. }))?[..] else {
            return None;
        };
        let [expert, ids] = self.inputs_of(m, |op| *op == Op::Binary(BinaryOp::Eq))?[..] else {
            return None;
        };
        let [ids] = self.inputs_of(ids, reshape(vec![1, e]))?[..] else {
            return None;
        };
        let iota = |op: &Op| {
            matches!(op, Op::Arange { start, end, step, .. }
                if [*start, *end, *step] == [Scalar::Int(0), Scalar::Int(e as i64), Scalar::Int(1)])
        };
        self.inputs_of(ids, iota)?;
        let int = matches!(self.graph.value(expert).dtype, DType::I32 | DType::I64);
        (int && self.shape(expert) == [s, 1]).then_some(expert)
    }
}

/// The products of routed rows by stacked expert weights in `graph`, in
/// order.
pub fn routed_products(graph: &Graph) -> Vec<RoutedProduct> {
    let uses = Uses::new(graph);
    (graph.nodes.iter().enumerate())
        .filter_map(|(i, node)| uses.sparse(i, node).or_else(|| uses.dense(i, node)))
        .collect()
}

/// Per weight of `weights`, the first node of `graph` that reads it (or a
/// transpose of it that `products` read) other than `products`, which
/// would keep it in float: a stacked weight is quantized only where there
/// is none.
pub fn float_readers(
    graph: &Graph,
    products: &[RoutedProduct],
    weights: impl IntoIterator<Item = ValueId>,
) -> HashMap<ValueId, String> {
    let uses = Uses::new(graph);
    let covered: HashSet<usize> = products.iter().map(|p| p.reader).collect();
    let transposes: HashSet<usize> = products.iter().filter_map(|p| p.transpose).collect();
    let mut out = HashMap::new();
    for w in weights {
        if out.contains_key(&w) {
            continue;
        }
        let mut found = None;
        if uses.outputs.contains(&w) {
            found = Some("an output of the graph".to_string());
        }
        for &r in uses.readers(w) {
            let node = &graph.nodes[r];
            let outside = if transposes.contains(&r) {
                let t = node.outputs[0];
                (uses.outputs.contains(&t))
                    .then_some(r)
                    .or_else(|| (uses.readers(t).iter().copied()).find(|u| !covered.contains(u)))
            } else {
                (!covered.contains(&r)).then_some(r)
            };
            if let (None, Some(o)) = (&found, outside) {
                let o = &graph.nodes[o];
                found = Some(format!("also read by `{}` ({})", o.name, o.op.name()));
            }
        }
        if let Some(why) = found {
            out.insert(w, why);
        }
    }
    out
}

/// The values of stacked weights `B [E, K, N]` as `W [E, N, K]`, f32.
pub(super) fn stacked_values(t: &Tensor, [e, k, n]: [usize; 3]) -> Vec<f32> {
    let v = t.to_f32_vec();
    let mut w = vec![0.0f32; e * n * k];
    // a row of one expert's W a task
    w.par_chunks_mut(k.max(1)).enumerate().for_each(|(r, row)| {
        let (x, j) = (r / n.max(1), r % n.max(1));
        for (i, o) in row.iter_mut().enumerate() {
            *o = v[(x * k + i) * n + j];
        }
    });
    w
}

/// `node`, the anchor of `p`, rewritten to `gather_qmv` of the quantized
/// `table` (`W [E, N, K]` in int4 of `group_size`).
pub(super) fn rewrite(
    graph: &mut Graph,
    node: &Node,
    p: &RoutedProduct,
    table: QuantTable,
) -> Result<Vec<Node>> {
    let (e, k) = (p.weight.e, p.weight.k);
    let gather = Op::GatherQmv {
        group_size: table.format.group_size,
    };
    let weights = [Some(table.packed), Some(table.scales), Some(table.zeros)];
    let out = graph.value(node.outputs[0]).clone();
    let mut rw = Rewrite::new(graph, node);
    let y = match p.routing {
        Routing::Sparse { x, expert } => {
            let s = rw.graph.value(expert).shape[0];
            let x = rw.reshape(x, vec![s, k])?;
            // (int32 indices: the GPU's kernel takes no int64)
            let idx = rw.cast(expert, DType::I32)?;
            let y = rw.node(gather, &[&[Some(x)], &weights[..], &[Some(idx)]].concat())?;
            rw.reshape(y, out.shape)?
        }
        Routing::Dense { x, expert } => {
            let s = rw.graph.value(expert).shape[0];
            let x = rw.reshape(x, vec![s, k])?;
            let clamp = UnaryOp::Clamp {
                min: Some(0.0),
                max: Some((e - 1) as f64),
            };
            let own = rw.unary(clamp, expert)?;
            let idx = rw.reshape(own, vec![s])?;
            let idx = rw.cast(idx, DType::I32)?;
            let y = rw.node(gather, &[&[Some(x)], &weights[..], &[Some(idx)]].concat())?;
            // a row past every group (expert E) names no expert: zero
            let keep = rw.binary(BinaryOp::Eq, expert, own)?;
            let keep = rw.cast(keep, out.dtype)?;
            rw.binary(BinaryOp::Mul, y, keep)?
        }
    };
    rw.finish(y)
}

#[cfg(test)]
mod tests {
    use etmetal_core::quant::QuantFormat;

    use super::*;
    use crate::eval::run_graph;
    use crate::ir::{InputKind, OutputKind};
    use crate::quantize::fit::tests::gaussian;
    use crate::quantize::fit::{dequantize_weight, quantize_tensors, Fit, QuantWeight, Values};
    use crate::quantize::{QuantizeOptions, Quantizer, Scheme};
    use crate::test_util::{ops, push, reinfers};

    const E: usize = 5;
    const N: usize = 12;
    const K: usize = 64;

    /// `W [E, N, K]`, each expert's rows of another scale.
    fn experts_w() -> Vec<f32> {
        let mut w = gaussian(3, E * N * K);
        for (i, v) in w.iter_mut().enumerate() {
            *v *= 1.0 + (i / (N * K)) as f32;
        }
        w
    }

    /// A decode step's routed product of `s` rows as the importer writes
    /// it: `x [S, 1, K] @ index_select(B, 0, expert)` (inputs `x [S, K]`
    /// and `expert [S]`), `B` the transpose of parameter `experts.w [E, N,
    /// K]`, or where `stored_kn` the parameter `[E, K, N]` itself; `w` is
    /// `W [E, N, K]`.
    fn sparse(s: usize, w: &[f32], stored_kn: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![s, K]);
        let expert = g.add_value("expert", DType::I64, vec![s]);
        g.inputs.push((x, InputKind::User));
        g.inputs.push((expert, InputKind::User));
        let stored = match stored_kn {
            false => Tensor::from_f32(DType::F32, &[E, N, K], w).unwrap(),
            true => {
                let kn: Vec<f32> = (0..E * K * N)
                    .map(|i| {
                        let (e, kk, n) = (i / (K * N), i / N % K, i % N);
                        w[(e * N + n) * K + kk]
                    })
                    .collect();
                Tensor::from_f32(DType::F32, &[E, K, N], &kn).unwrap()
            }
        };
        let p = g.add_value("p_experts_w", DType::F32, stored.shape().to_vec());
        g.inputs.push((
            p,
            InputKind::Parameter {
                fqn: "experts.w".into(),
            },
        ));
        g.constants.insert(p, stored);
        let b = match stored_kn {
            true => p,
            false => {
                let dims = vec![0, 2, 1];
                push(&mut g, "transpose", Op::Permute { dims }, vec![Some(p)])
            }
        };
        let mine = push(
            &mut g,
            "mine",
            Op::IndexSelect { dim: 0 },
            vec![Some(b), Some(expert)],
        );
        let shape = vec![s, 1, K];
        let x3 = push(&mut g, "x3", Op::Reshape { shape }, vec![Some(x)]);
        let y = push(&mut g, "product", Op::MatMul, vec![Some(x3), Some(mine)]);
        g.outputs.push((y, OutputKind::User));
        g
    }

    fn inputs(s: usize) -> Vec<Tensor> {
        let x = Tensor::from_f32(DType::F32, &[s, K], &gaussian(7, s * K)).unwrap();
        let idx: Vec<i64> = (0..s as i64).map(|i| (3 * i + 1) % E as i64).collect();
        vec![x, Tensor::from_i64(DType::I64, &[s], &idx).unwrap()]
    }

    fn quantize(g: &mut Graph, options: QuantizeOptions) -> crate::quantize::QuantizeReport {
        let mut q = Quantizer::new(options, None);
        q.plan(&[g], None).unwrap();
        q.quantize(g).unwrap()
    }

    /// The sparse form of either stored layout becomes `gather_qmv` of the
    /// int4 `W [E, N, K]`: the float weights gone, each expert's codes,
    /// scales and zeros those of a linear of its `W` (the same fitting),
    /// and the product the float one of the dequantized weights.
    #[test]
    fn routed_products_become_gather_qmv() {
        let w = experts_w();
        let format = QuantFormat::int4(32);
        let per_expert: Vec<[Tensor; 3]> = (0..E)
            .map(|e| {
                let we = Values::F32(&w[e * N * K..(e + 1) * N * K]);
                quantize_tensors(we, N, K, format, Fit::Refine, DType::F32).unwrap()
            })
            .collect();
        let deq: Vec<f32> = per_expert
            .iter()
            .flat_map(|[p, s, z]| {
                let q = QuantWeight {
                    format,
                    packed: p.bytes().to_vec(),
                    scales: s.to_f32_vec(),
                    zeros: z.to_f32_vec(),
                };
                dequantize_weight(&q, K)
            })
            .collect();
        for stored_kn in [false, true] {
            let mut g = sparse(3, &w, stored_kn);
            let r = quantize(&mut g, QuantizeOptions::int4(32, &[]));
            assert_eq!(r.experts, [("product".into(), "experts.w".into())]);
            assert_eq!(r.expert_weights(), (1, 0));
            assert!(r.quantized.is_empty() && r.experts_skipped.is_empty());
            assert_eq!(
                ops(&g),
                ["reshape", "reshape", "cast", "gather_qmv", "reshape"]
            );
            reinfers(&g);
            assert!(g.inputs.iter().all(|(_, k)| *k == InputKind::User));
            let gather = g
                .nodes
                .iter()
                .find(|n| n.op.name() == "gather_qmv")
                .unwrap();
            let table = |slot: usize| &g.constants[&gather.inputs[slot].unwrap()];
            assert_eq!(table(1).shape(), [E, N, K / 8]);
            assert_eq!(table(2).shape(), [E, N, K / 32]);
            for (slot, part) in (1..4).zip(0..3) {
                let whole: Vec<u8> = per_expert
                    .iter()
                    .flat_map(|t| t[part].bytes().to_vec())
                    .collect();
                assert_eq!(
                    table(slot).bytes(),
                    whole,
                    "stored [E, K, N] {stored_kn}: slot {slot}"
                );
            }
            // against the float product of the dequantized weights
            let expected = run_graph(&sparse(3, &deq, false), inputs(3)).unwrap();
            let got = run_graph(&g, inputs(3)).unwrap();
            assert_eq!(got[0].shape(), [3, 1, N]);
            for (a, b) in got[0].to_f32_vec().iter().zip(expected[0].to_f32_vec()) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    /// Stacked weights stay in float, the reason reported, where another
    /// node reads them too (in this method or another), under int8 (the
    /// kernel takes int4 only), or where a skip pattern names them.
    #[test]
    fn experts_stay_in_float_where_int4_cannot_take_them_all() {
        let w = experts_w();
        let read_too = |g: &mut Graph| {
            let p = g.inputs[2].0;
            let sum = Op::Reduce {
                op: ReduceOp::Sum,
                dims: vec![],
                keepdim: false,
            };
            let t = push(g, "total", sum, vec![Some(p)]);
            g.outputs.push((t, OutputKind::User));
        };
        let mut g = sparse(2, &w, false);
        read_too(&mut g);
        let r = quantize(&mut g, QuantizeOptions::int4(32, &[]));
        assert!(r.experts.is_empty());
        let (node, weight, why) = &r.experts_skipped[0];
        assert_eq!((node.as_str(), weight.as_str()), ("product", "experts.w"));
        assert_eq!(why, "also read by `total` (reduce_sum)");
        assert!(ops(&g).contains(&"index_select"));
        // another method reading them keeps them in float in this one too
        let (mut a, mut b) = (sparse(2, &w, false), sparse(2, &w, false));
        read_too(&mut b);
        let mut q = Quantizer::new(QuantizeOptions::int4(32, &[]), None);
        q.plan(&[&a, &b], None).unwrap();
        let r = q.quantize(&mut a).unwrap();
        assert_eq!(r.experts_skipped[0].2, "also read by `total` (reduce_sum)");
        assert!(ops(&a).contains(&"index_select"));
        // a skip naming one product's node keeps the weights of both in float
        let mut g = sparse(2, &w, false);
        let (b, idx, x3) = (g.nodes[0].outputs[0], g.inputs[1].0, g.nodes[2].outputs[0]);
        let mine = push(
            &mut g,
            "mine2",
            Op::IndexSelect { dim: 0 },
            vec![Some(b), Some(idx)],
        );
        let y = push(&mut g, "other", Op::MatMul, vec![Some(x3), Some(mine)]);
        g.outputs.push((y, OutputKind::User));
        assert_eq!(routed_products(&g).len(), 2);
        let r = quantize(&mut g, QuantizeOptions::int4(32, &["other".into()]));
        assert_eq!(r.experts_skipped.len(), 2, "{:?}", r.experts_skipped);
        assert_eq!(r.expert_weights(), (0, 1));
        for (options, why) in [
            (
                QuantizeOptions {
                    scheme: Scheme::Int8,
                    group_size: None,
                    skip: vec![],
                },
                "takes int4 codes only",
            ),
            (
                QuantizeOptions::int4(32, &["experts".into()]),
                "matches --quantize-skip experts",
            ),
            (QuantizeOptions::int4(128, &[]), "does not divide K = 64"),
        ] {
            let mut g = sparse(2, &w, true);
            let r = quantize(&mut g, options);
            assert!(
                r.experts_skipped[0].2.contains(why),
                "{:?}",
                r.experts_skipped
            );
            assert_eq!(r.expert_weights(), (0, 1));
            assert!(ops(&g).contains(&"mat_mul"));
        }
    }
}
