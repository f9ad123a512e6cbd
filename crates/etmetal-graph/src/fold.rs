//! Compile-time folding.
//!
//! [`fold_constants`] evaluates, with the CPU kernels, every node that
//! depends on no input (only on weights, literals and other such nodes) and
//! stores its result as a constant, so no backend sees that subgraph:
//! T5's relative-position buckets, masks built from `arange`.
//!
//! [`fold_conv_affine`] folds a per-channel scale and shift into the
//! convolution before them:
//! `conv(x, w, b) * s + t` becomes `conv(x, w·s, b·s + t)` when `w`, `b`,
//! `s` and `t` are constants, as an eval-mode batch norm leaves them after
//! [`crate::decompose`]. One kernel then does the work of three, and
//! reads and writes the activation once. f32 only: in a reduced precision
//! the folded weight would round differently from the two-step result.

use std::collections::{HashMap, HashSet};

use etmetal_core::{BinaryOp, ConvAttrs, DType, Op, Result, Tensor};

use crate::eval::run_node;
use crate::ir::{Graph, InputKind, Node, ValueId};

/// The largest output, in bytes, that [`fold_constants`] stores in place
/// of the node computing it. A folded output is stored in the program and
/// read from memory on every run; up to this size that costs less than a
/// kernel launch. A larger one stays computed: it is most often a large
/// tensor made from almost nothing (an `arange`, `full` or `expand`, or a
/// mask grown from them), cheap to compute and costly to store — what
/// ExecuTorch's `constant_prop_pass` avoids by skipping `full` and torch's
/// constant folding by skipping constructors and view-like expansions.
pub const FOLD_MAX_BYTES: usize = 1 << 20;

/// Replace by constants the outputs of every node whose inputs are all
/// constants and that the CPU kernels evaluate; returns how many nodes were
/// folded. `state` names (by fully qualified name) the buffers that other
/// methods of the program mutate: state too, though this graph only reads
/// them. Not folded: a node that reads a mutated buffer or a fake
/// constant (its value is not known at compile time), a delegate call, a
/// node writing a graph output, a node with an output over
/// [`FOLD_MAX_BYTES`], a node the CPU kernels refuse (left for the backend
/// to report), and a node reading a weight (a parameter, buffer or lifted
/// constant) that an unfolded node or a graph output also reads: folding it
/// would store a copy of that weight beside it. The weights only folded
/// nodes read are left unread, for [`crate::eliminate_dead_code`].
///
/// A node with an output of symbolic size, or with int arguments that
/// depend on a symbol (`Graph::sym`), is not folded either: its value
/// differs from one run to the next.
pub fn fold_constants(graph: &mut Graph, state: &[String]) -> Result<usize> {
    let mut mutated: HashSet<ValueId> = graph
        .buffer_mutations()?
        .into_iter()
        .map(|(b, _)| b)
        .collect();
    mutated.extend(graph.inputs.iter().filter_map(|(v, k)| match k {
        InputKind::Buffer { fqn, .. } if state.contains(fqn) => Some(*v),
        _ => None,
    }));
    let known = |v: &ValueId| {
        graph.constants.contains_key(v) && !graph.fake_constants.contains(v) && !mutated.contains(v)
    };
    let base: HashSet<ValueId> = graph.constants.keys().copied().filter(known).collect();
    let weights: HashSet<ValueId> = (graph.inputs.iter())
        .filter(|(_, k)| *k != InputKind::User)
        .map(|(v, _)| *v)
        .collect();
    let outputs: HashSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (i, n) in graph.nodes.iter().enumerate() {
        for v in n.inputs.iter().flatten() {
            readers.entry(*v).or_default().push(i);
        }
    }
    // computed values survive the rounds: a node is evaluated once
    let mut computed: HashMap<ValueId, Tensor> = HashMap::new();
    let mut blocked: HashSet<usize> = HashSet::new();
    let folded = loop {
        let mut folded: Vec<usize> = vec![];
        let mut constant = base.clone();
        for (i, node) in graph.nodes.iter().enumerate() {
            let candidate = !blocked.contains(&i)
                && !matches!(node.op, Op::Delegate { .. })
                && node.inputs.iter().flatten().all(|v| constant.contains(v))
                && node.outputs.iter().all(|o| {
                    let info = graph.value(*o);
                    !outputs.contains(o)
                        && !graph.is_dynamic(*o)
                        && !graph.sym.args.contains_key(o)
                        && info.dtype.size() * info.shape.iter().product::<usize>()
                            <= FOLD_MAX_BYTES
                });
            if !candidate {
                continue;
            }
            if !node.outputs.iter().all(|o| computed.contains_key(o)) {
                let value = |v: ValueId| computed.get(&v).or_else(|| graph.constants.get(&v));
                let Ok(results) = run_node(graph, node, value) else {
                    blocked.insert(i);
                    continue;
                };
                computed.extend(node.outputs.iter().copied().zip(results));
            }
            constant.extend(node.outputs.iter().copied());
            folded.push(i);
        }
        let here: HashSet<usize> = folded.iter().copied().collect();
        let shares = |i: &usize| {
            graph.nodes[*i].inputs.iter().flatten().any(|v| {
                weights.contains(v)
                    && (outputs.contains(v) || readers[v].iter().any(|r| !here.contains(r)))
            })
        };
        let sharing: Vec<usize> = folded.iter().copied().filter(shares).collect();
        if sharing.is_empty() {
            break here;
        }
        blocked.extend(sharing);
    };
    // the folded values unfolded nodes read become constants; the rest go
    let written: HashSet<ValueId> = (folded.iter())
        .flat_map(|&i| graph.nodes[i].outputs.iter().copied())
        .collect();
    for (i, node) in graph.nodes.iter().enumerate() {
        for v in node.inputs.iter().flatten() {
            if !folded.contains(&i) && written.contains(v) {
                graph.constants.insert(*v, computed[v].clone());
            }
        }
    }
    let mut i = 0;
    graph.nodes.retain(|_| {
        i += 1;
        !folded.contains(&(i - 1))
    });
    Ok(folded.len())
}

/// Fold every `Mul`/`Add` of a per-output-channel (or single) f32 constant
/// that is the only reader of a forward convolution's output with
/// constant weights.
pub fn fold_conv_affine(graph: &mut Graph) -> Result<()> {
    let mut readers: HashMap<ValueId, usize> = HashMap::new();
    for v in graph.nodes.iter().flat_map(|n| n.inputs.iter().flatten()) {
        *readers.entry(*v).or_default() += 1;
    }
    for (v, _) in &graph.outputs {
        *readers.entry(*v).or_default() += 1;
    }
    // the node writing each value, by index
    let mut writer: HashMap<ValueId, usize> = HashMap::new();
    let mut dropped = HashSet::new();
    for i in 0..graph.nodes.len() {
        for o in &graph.nodes[i].outputs {
            writer.insert(*o, i);
        }
        let Some((conv, y, k, add)) = foldable(graph, i, &writer, &readers) else {
            continue;
        };
        let folded = fold(graph, conv, k, add)?;
        let Some((w, b)) = folded else { continue };
        let node = &mut graph.nodes[conv];
        node.inputs.resize(3, None);
        node.inputs[1] = Some(w);
        node.inputs[2] = Some(b);
        // the convolution now writes what the affine op wrote
        node.outputs = vec![y];
        writer.insert(y, conv);
        dropped.insert(i);
    }
    let mut i = 0;
    graph.nodes.retain(|_| {
        i += 1;
        !dropped.contains(&(i - 1))
    });
    Ok(())
}

/// For node `i`, a `Mul` or `Add` of a convolution's output and a
/// constant: (the convolution's index, the node's output, the constant,
/// whether it adds).
fn foldable(
    graph: &Graph,
    i: usize,
    writer: &HashMap<ValueId, usize>,
    readers: &HashMap<ValueId, usize>,
) -> Option<(usize, ValueId, ValueId, bool)> {
    let node = &graph.nodes[i];
    let add = match node.op {
        Op::Binary(BinaryOp::Add) => true,
        Op::Binary(BinaryOp::Mul) => false,
        _ => return None,
    };
    let (&[Some(a), Some(b)], &[y]) = (node.inputs.as_slice(), node.outputs.as_slice()) else {
        return None;
    };
    // the convolution's output on either side, the constant on the other
    let (x, k) = if graph.constants.contains_key(&b) {
        (a, b)
    } else {
        (b, a)
    };
    let conv = *writer.get(&x)?;
    let c = &graph.nodes[conv];
    let Op::Convolution(ConvAttrs {
        transposed: false, ..
    }) = c.op
    else {
        return None;
    };
    let weight_const = |s: Option<&Option<ValueId>>| match s {
        None | Some(None) => true,
        Some(Some(v)) => graph.constants.contains_key(v) && !graph.fake_constants.contains(v),
    };
    let shape = &graph.value(x).shape;
    let fits = readers.get(&x) == Some(&1)
        && c.outputs == [x]
        && graph.value(x).dtype == DType::F32
        && graph.value(y).dtype == DType::F32
        && graph.value(y).shape == *shape
        && graph.constants.contains_key(&k)
        && !graph.fake_constants.contains(&k)
        && per_channel(&graph.value(k).shape, shape)
        && c.inputs.get(1).is_some_and(|w| w.is_some())
        && weight_const(c.inputs.get(1))
        && weight_const(c.inputs.get(2));
    fits.then_some((conv, y, k, add))
}

/// Whether a constant of shape `k` broadcast against a convolution output
/// of shape `out` (`[N, C, …]`) takes one value per channel: a single
/// value, or `C` along the channel dim and 1 elsewhere.
fn per_channel(k: &[usize], out: &[usize]) -> bool {
    let n: usize = k.iter().product();
    if n == 1 {
        return k.len() <= out.len();
    }
    // aligned to the right, the channel dim is out.len() - 2 from the end
    let Some(lead) = out.len().checked_sub(k.len()) else {
        return false;
    };
    k.iter()
        .enumerate()
        .all(|(d, &s)| s == if lead + d == 1 { out[1] } else { 1 })
        && lead <= 1
}

/// The folded weight and bias constants, `None` when the constants'
/// values do not fit (read as f64, stored as the weight's dtype).
fn fold(
    graph: &mut Graph,
    conv: usize,
    k: ValueId,
    add: bool,
) -> Result<Option<(ValueId, ValueId)>> {
    let node: &Node = &graph.nodes[conv];
    let (Some(Some(w)), b) = (node.inputs.get(1), node.inputs.get(2).copied().flatten()) else {
        return Ok(None);
    };
    let wt = &graph.constants[w];
    let cout = wt.shape().first().copied().unwrap_or(0);
    let per = graph.constants[&k].to_f64_vec();
    let at = |c: usize| per[if per.len() == 1 { 0 } else { c }];
    let mut bias = match b {
        Some(b) => graph.constants[&b].to_f64_vec(),
        None => vec![0.0; cout],
    };
    if bias.len() != cout || (per.len() != 1 && per.len() != cout) || cout == 0 {
        return Ok(None);
    }
    let mut weight = wt.to_f64_vec();
    let per_out = weight.len() / cout;
    for (c, b) in bias.iter_mut().enumerate() {
        if add {
            *b += at(c);
        } else {
            *b *= at(c);
            weight[c * per_out..(c + 1) * per_out]
                .iter_mut()
                .for_each(|v| *v *= at(c));
        }
    }
    let (dtype, wshape) = (wt.dtype(), wt.shape().to_vec());
    let name = node.name.clone();
    let w = if add {
        *w
    } else {
        let t = Tensor::from_f64(dtype, &wshape, &weight)?;
        graph.add_constant(format!("{name}.weight_folded"), t)
    };
    let b = graph.add_constant(
        format!("{name}.bias_folded"),
        Tensor::from_f64(dtype, &[cout], &bias)?,
    );
    Ok(Some((w, b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::OutputKind;
    use crate::test_util::{ops, push, reinfers};
    use etmetal_core::{Scalar, SymExpr, SymRange, UnaryOp};

    fn arange(g: &mut Graph, name: &str, n: i64) -> ValueId {
        let op = Op::Arange {
            start: Scalar::Int(0),
            end: Scalar::Int(n),
            step: Scalar::Int(1),
            dtype: DType::I64,
        };
        push(g, name, op, vec![])
    }

    fn reshape(g: &mut Graph, x: ValueId, shape: &[usize]) -> ValueId {
        let op = Op::Reshape {
            shape: shape.to_vec(),
        };
        push(g, "view", op, vec![Some(x)])
    }

    fn bin(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        push(g, op.name(), Op::Binary(op), vec![Some(a), Some(b)])
    }

    fn un(g: &mut Graph, op: Op, x: ValueId) -> ValueId {
        push(g, op.name(), op, vec![Some(x)])
    }

    fn scalar(g: &mut Graph, dtype: DType, v: f64) -> ValueId {
        g.add_constant("_scalar", Tensor::scalar_f64(dtype, v).unwrap())
    }

    fn user(g: &mut Graph, dtype: DType, shape: &[usize]) -> ValueId {
        let x = g.add_value("x", dtype, shape.to_vec());
        g.inputs.push((x, InputKind::User));
        x
    }

    fn param(g: &mut Graph, fqn: &str, t: Tensor) -> ValueId {
        let w = g.add_constant(fqn, t);
        g.inputs.push((w, InputKind::Parameter { fqn: fqn.into() }));
        w
    }

    /// HF T5's `_relative_position_bucket(memory - context, bidirectional=True,
    /// num_buckets=8, max_distance=20)` for 6 queries and 10 keys, op by op
    /// as torch.export records it: `log(0)` is `-inf`, cast to int64, then
    /// masked out by the `where`.
    fn t5_buckets(g: &mut Graph) -> ValueId {
        let (i64_, f32_) = (DType::I64, DType::F32);
        let (q, k) = (arange(g, "q", 6), arange(g, "k", 10));
        let (q, k) = (reshape(g, q, &[6, 1]), reshape(g, k, &[1, 10]));
        let rel = bin(g, BinaryOp::Sub, k, q);
        let zero = scalar(g, i64_, 0.0);
        let after = bin(g, BinaryOp::Gt, rel, zero);
        let after = un(g, Op::Cast { dtype: i64_ }, after);
        let half = scalar(g, i64_, 4.0);
        let buckets = bin(g, BinaryOp::Mul, after, half);
        let rel = un(g, Op::Unary(UnaryOp::Abs), rel);
        let max_exact = scalar(g, i64_, 2.0);
        let small = bin(g, BinaryOp::Lt, rel, max_exact);
        let f = un(g, Op::Cast { dtype: f32_ }, rel);
        let two = scalar(g, f32_, 2.0);
        let f = bin(g, BinaryOp::Div, f, two);
        let f = un(g, Op::Unary(UnaryOp::Log), f);
        let log_ratio = scalar(g, f32_, (20.0f64 / 2.0).ln());
        let f = bin(g, BinaryOp::Div, f, log_ratio);
        let f = bin(g, BinaryOp::Mul, f, two);
        let large = un(g, Op::Cast { dtype: i64_ }, f);
        let large = bin(g, BinaryOp::Add, large, max_exact);
        let last = scalar(g, i64_, 3.0);
        let large = bin(g, BinaryOp::Minimum, large, last);
        let args = vec![Some(small), Some(rel), Some(large)];
        let picked = push(g, "where", Op::Where, args);
        bin(g, BinaryOp::Add, buckets, picked)
    }

    /// T5's buckets as eager PyTorch computes them (transformers'
    /// `T5Attention._relative_position_bucket`, same arguments).
    const T5_BUCKETS: [[i64; 10]; 6] = [
        [0, 5, 6, 6, 6, 6, 6, 7, 7, 7],
        [1, 0, 5, 6, 6, 6, 6, 6, 7, 7],
        [2, 1, 0, 5, 6, 6, 6, 6, 6, 7],
        [2, 2, 1, 0, 5, 6, 6, 6, 6, 6],
        [2, 2, 2, 1, 0, 5, 6, 6, 6, 6],
        [2, 2, 2, 2, 1, 0, 5, 6, 6, 6],
    ];

    #[test]
    fn t5_position_bias_folds_to_pytorchs_values() {
        let mut g = Graph::default();
        let x = user(&mut g, DType::F32, &[1, 2, 6, 10]);
        let buckets = t5_buckets(&mut g);
        // relative_attention_bias: bucket b, head h holds 10 b + h
        let table: Vec<f32> = (0..16).map(|i| (i / 2 * 10 + i % 2) as f32).collect();
        let w = param(
            &mut g,
            "rel_bias.weight",
            Tensor::from_f32(DType::F32, &[8, 2], &table).unwrap(),
        );
        let bias = push(
            &mut g,
            "embedding",
            Op::Embedding,
            vec![Some(w), Some(buckets)],
        );
        let bias = un(
            &mut g,
            Op::Permute {
                dims: vec![2, 0, 1],
            },
            bias,
        );
        let bias = reshape(&mut g, bias, &[1, 2, 6, 10]);
        let y = bin(&mut g, BinaryOp::Add, x, bias);
        g.outputs.push((y, OutputKind::User));
        let nodes = g.nodes.len();
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), nodes - 1);
        crate::eliminate_dead_code(&mut g);
        assert_eq!(ops(&g), ["add"]);
        reinfers(&g);
        // the folded bias replaced the table, which nothing reads now
        assert!(!g.constants.contains_key(&w));
        assert_eq!(g.inputs.len(), 1);
        let got = g.constants[&bias].to_f32_vec();
        for h in 0..2 {
            for (i, row) in T5_BUCKETS.iter().enumerate() {
                for (j, b) in row.iter().enumerate() {
                    assert_eq!(got[(h * 6 + i) * 10 + j], (b * 10 + h as i64) as f32);
                }
            }
        }
    }

    /// A user input `x` [4, 4] and a causal mask built from `arange`s
    /// (`where(i >= j, 0, -inf)`): six nodes that depend on no input.
    fn causal_mask(g: &mut Graph) -> (ValueId, ValueId) {
        let x = user(g, DType::F32, &[4, 4]);
        let (i, j) = (arange(g, "i", 4), arange(g, "j", 4));
        let (i, j) = (reshape(g, i, &[4, 1]), reshape(g, j, &[1, 4]));
        let keep = bin(g, BinaryOp::Ge, i, j);
        let (zero, ninf) = (
            scalar(g, DType::F32, 0.0),
            scalar(g, DType::F32, f64::NEG_INFINITY),
        );
        let mask = push(
            g,
            "where",
            Op::Where,
            vec![Some(keep), Some(zero), Some(ninf)],
        );
        (x, mask)
    }

    #[test]
    fn causal_mask_from_arange_folds() {
        let mut g = Graph::default();
        let (x, mask) = causal_mask(&mut g);
        let y = bin(&mut g, BinaryOp::Add, x, mask);
        g.outputs.push((y, OutputKind::User));
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 6);
        assert_eq!(ops(&g), ["add"]);
        // torch.zeros(4, 4).masked_fill(~torch.ones(4, 4).tril().bool(), -inf)
        let got = g.constants[&mask].to_f32_vec();
        for (k, v) in got.iter().enumerate() {
            let want = if k % 4 <= k / 4 {
                0.0
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(*v, want, "element {k}");
        }
    }

    #[test]
    fn a_value_of_symbolic_size_is_not_folded() {
        // the causal mask of `causal_mask_from_arange_folds`, its rows sliced
        // to a dynamic length: computed at every run, not stored at the bound
        let mut g = Graph::default();
        let (x, mask) = causal_mask(&mut g);
        let rows = SymExpr::sym("s0");
        g.sym
            .ranges
            .insert("s0".into(), SymRange { min: 1, max: 4 });
        g.sym
            .dims
            .insert(mask, vec![rows.clone(), SymExpr::Const(4)]);
        g.sym.dims.insert(x, vec![rows, SymExpr::Const(4)]);
        let y = bin(&mut g, BinaryOp::Add, x, mask);
        g.outputs.push((y, OutputKind::User));
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 5);
        assert_eq!(ops(&g), ["where", "add"]);
        assert!(!g.constants.contains_key(&mask));
    }

    #[test]
    fn a_large_arange_stays_computed() {
        let mut g = Graph::default();
        let n = FOLD_MAX_BYTES / 8;
        let x = user(&mut g, DType::I64, &[n + 1]);
        let (small, large) = (
            arange(&mut g, "small", n as i64),
            arange(&mut g, "large", n as i64 + 1),
        );
        let small = reshape(&mut g, small, &[n, 1]);
        let sum = bin(&mut g, BinaryOp::Add, x, large);
        g.outputs.push((small, OutputKind::User));
        g.outputs.push((sum, OutputKind::User));
        // a graph output stays computed too: only the arange under it folds
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 1);
        assert_eq!(ops(&g), ["arange", "reshape", "add"]);
        assert_eq!(g.nodes[0].outputs, [large]);
        assert_eq!(g.constants[&g.nodes[1].inputs[0].unwrap()].numel(), n);
    }

    #[test]
    fn mutated_buffers_and_fake_constants_are_not_folded() {
        let mut g = Graph::default();
        let x = user(&mut g, DType::F32, &[2]);
        let b = g.add_constant(
            "b_cache",
            Tensor::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap(),
        );
        let buffer = InputKind::Buffer {
            fqn: "cache".into(),
            persistent: true,
        };
        g.inputs.push((b, buffer));
        let w = param(&mut g, "w", Tensor::zeros(DType::F32, &[2]).unwrap());
        g.fake_constants.insert(w);
        let two = scalar(&mut g, DType::F32, 2.0);
        let (read, fake) = (
            bin(&mut g, BinaryOp::Mul, b, two),
            bin(&mut g, BinaryOp::Mul, w, two),
        );
        let new = bin(&mut g, BinaryOp::Add, b, two);
        let y = bin(&mut g, BinaryOp::Add, x, read);
        let y = bin(&mut g, BinaryOp::Add, y, fake);
        g.outputs.push((
            new,
            OutputKind::BufferMutation {
                fqn: "cache".into(),
            },
        ));
        g.outputs.push((y, OutputKind::User));
        let before = g.nodes.clone();
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 0);
        assert_eq!(g.nodes, before);
        // a method that only reads the buffer another method writes
        g.outputs.remove(0);
        crate::eliminate_dead_code(&mut g);
        let before = g.nodes.clone();
        assert_eq!(fold_constants(&mut g, &["cache".into()]).unwrap(), 0);
        assert_eq!(g.nodes, before);
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 1, "read-only here");
    }

    #[test]
    fn a_weight_another_node_reads_is_not_copied() {
        let mut g = Graph::default();
        let ids = user(&mut g, DType::I64, &[3]);
        let w = param(
            &mut g,
            "tok.weight",
            Tensor::from_f32(DType::F32, &[4, 2], &[1.0; 8]).unwrap(),
        );
        let e = push(&mut g, "embedding", Op::Embedding, vec![Some(w), Some(ids)]);
        // tied output projection: the transposed table
        let wt = un(&mut g, Op::Permute { dims: vec![1, 0] }, w);
        let y = push(&mut g, "mm", Op::MatMul, vec![Some(e), Some(wt)]);
        g.outputs.push((y, OutputKind::User));
        assert_eq!(fold_constants(&mut g, &[]).unwrap(), 0);
        assert_eq!(ops(&g), ["embedding", "permute", "mat_mul"]);
    }

    /// `bn(conv(x, w))` with 2 output channels; `also_read` makes the
    /// convolution's output a graph output too.
    fn conv_bn(dtype: DType, also_read: bool) -> Graph {
        let mut g = Graph::default();
        let x = g.add_value("x", dtype, vec![1, 1, 3, 3]);
        g.inputs.push((x, InputKind::User));
        let c = |g: &mut Graph, shape: &[usize], v: &[f32]| {
            g.add_constant("p", Tensor::from_f32(dtype, shape, v).unwrap())
        };
        let w = c(&mut g, &[2, 1, 1, 1], &[3.0, -2.0]);
        let conv = Op::Convolution(ConvAttrs {
            stride: vec![1, 1],
            padding: vec![0, 0],
            dilation: vec![1, 1],
            transposed: false,
            output_padding: vec![0, 0],
            groups: 1,
        });
        let y = push(&mut g, "conv", conv, vec![Some(x), Some(w), None]);
        let (gamma, beta) = (c(&mut g, &[2], &[2.0, 1.0]), c(&mut g, &[2], &[0.5, 0.0]));
        let (mean, var) = (c(&mut g, &[2], &[1.0, -1.0]), c(&mut g, &[2], &[4.0, 1.0]));
        let bn = Op::BatchNorm { eps: 0.0 };
        let args = vec![Some(y), Some(gamma), Some(beta), Some(mean), Some(var)];
        let z = push(&mut g, "bn", bn, args);
        g.outputs.push((z, OutputKind::User));
        if also_read {
            g.outputs.push((y, OutputKind::User));
        }
        crate::decompose(&mut g, &|_| false);
        g
    }

    #[test]
    fn batch_norm_folds_into_the_convolution() {
        let mut g = conv_bn(DType::F32, false);
        fold_conv_affine(&mut g).unwrap();
        assert_eq!(ops(&g), ["convolution"]);
        let n = &g.nodes[0];
        assert_eq!(n.outputs, [g.outputs[0].0]);
        let value = |i: usize| g.constants[&n.inputs[i].unwrap()].to_f32_vec();
        // scale = gamma / sqrt(var) = [1, 1]; shift = beta - mean * scale
        assert_eq!(value(1), [3.0, -2.0]);
        assert_eq!(value(2), [-0.5, 1.0]);
        reinfers(&g);
    }

    #[test]
    fn shared_outputs_and_reduced_precision_stay_apart() {
        for (dtype, also_read) in [(DType::F32, true), (DType::BF16, false)] {
            let mut g = conv_bn(dtype, also_read);
            fold_conv_affine(&mut g).unwrap();
            assert_eq!(
                ops(&g),
                ["convolution", "mul", "add"],
                "{dtype} {also_read}"
            );
        }
    }

    #[test]
    fn channel_constants_only() {
        assert!(per_channel(&[4, 1, 1], &[1, 4, 5, 5]));
        assert!(per_channel(&[1, 4, 1, 1], &[1, 4, 5, 5]));
        assert!(per_channel(&[], &[1, 4, 5, 5]));
        assert!(per_channel(&[4, 1], &[1, 4, 7]));
        assert!(!per_channel(&[4], &[1, 4, 7]));
        assert!(!per_channel(&[1, 1, 5], &[1, 4, 5, 5]));
        assert!(!per_channel(&[2, 4, 1, 1], &[1, 4, 5, 5]));
    }
}
