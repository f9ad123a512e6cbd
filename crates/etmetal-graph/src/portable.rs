//! Rewrite the ops ExecuTorch's portable kernel library lacks into ones it
//! has, as `to_edge` does (its `functions.yaml`): after this pass every node
//! has a kernel in `etmetal_pte::kernels::encode`.
//!
//! - `MatMul` → `mm` (a 2-D right operand: the left one is flattened) or
//!   `bmm` (batch dims broadcast with `Expand` and flattened), with
//!   `Reshape`s for 1-D operands and the result;
//! - `Silu` → `x * sigmoid(x)`; `Hardsigmoid` → `clamp(x + 3, 0, 6) / 6`;
//!   `Hardswish` → `x * clamp(x + 3, 0, 6) / 6`;
//! - `RmsNorm` → `x * rsqrt(mean(x * x) + eps) * weight`, in f32 for
//!   reduced-precision inputs (as PyTorch does);
//! - `Sdpa` → `softmax(q @ kᵀ * scale + mask) @ v` in f32 for reduced
//!   precision, GQA heads repeated by reshape/expand, the causal mask a
//!   constant (for a dynamic length, made at the bound and sliced to it);
//! - `IndexCopy` → `where(position named, source row gathered, x)`: a
//!   one-hot match of each position of the dim against the index;
//! - `Reduce(All)` → `!any(!x)`; upper `Triangle` → `where(mask, x, 0)`;
//! - 1-D max/avg/adaptive pooling → the 2-D kernels on `[N, C, 1, L]`;
//! - bf16/f16 `Convolution` → the f32 kernel between casts (weights
//!   converted at compile time): the portable kernel accumulates in the
//!   input dtype, which misses PyTorch's bf16 results by more than 1e-2.
//!
//! Each rewrite is checked to infer to the original outputs; new nodes are
//! rewritten again (the `MatMul`s an `Sdpa` produces become `bmm`).

use etmetal_core::shape::gqa_group;
use etmetal_core::{
    AvgPoolAttrs, BinaryOp, DType, Error, MaxPoolAttrs, Op, ReduceOp, Result, Scalar, SymExpr,
    Tensor, UnaryOp,
};

use crate::ir::{Graph, Node, ValueId};
use crate::rewrite::Rewrite;

/// Rewrite `graph` in place to ops with a portable kernel (module docs).
pub fn to_portable(graph: &mut Graph) -> Result<()> {
    let mut pending: Vec<Node> = std::mem::take(&mut graph.nodes);
    pending.reverse(); // a stack: the next node is the last
    let mut done = Vec::with_capacity(pending.len());
    while let Some(node) = pending.pop() {
        match rewrite(graph, &node).map_err(|e| {
            e.context(format!(
                "to_portable: node `{}` ({})",
                node.name, node.target
            ))
        })? {
            Some(nodes) => pending.extend(nodes.into_iter().rev()),
            None => done.push(node),
        }
    }
    graph.nodes = done;
    Ok(())
}

fn rewrite(graph: &mut Graph, node: &Node) -> Result<Option<Vec<Node>>> {
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let needs =
        |i: usize| input(i).ok_or_else(|| Error::invalid_input(format!("input {i} is missing")));
    let mut b = Rewrite::new(graph, node);
    let y = match &node.op {
        Op::MatMul => {
            let (x, w) = (needs(0)?, needs(1)?);
            let (sa, sb) = (
                b.graph.value(x).shape.clone(),
                b.graph.value(w).shape.clone(),
            );
            let plain = (sa.len() == 2 && sb.len() == 2)
                || (sa.len() == 3 && sb.len() == 3 && sa[0] == sb[0]);
            if plain {
                return Ok(None);
            }
            matmul(&mut b, x, w)?
        }
        Op::Unary(UnaryOp::Silu) => {
            let x = needs(0)?;
            let s = b.unary(UnaryOp::Sigmoid, x)?;
            b.binary(BinaryOp::Mul, x, s)?
        }
        Op::Unary(u @ (UnaryOp::Hardsigmoid | UnaryOp::Hardswish)) => {
            let x = needs(0)?;
            let dtype = b.graph.value(x).dtype;
            let three = b.scalar(3.0, dtype)?;
            let six = b.scalar(6.0, dtype)?;
            let t = b.binary(BinaryOp::Add, x, three)?;
            let mut t = b.unary(
                UnaryOp::Clamp {
                    min: Some(0.0),
                    max: Some(6.0),
                },
                t,
            )?;
            if *u == UnaryOp::Hardswish {
                t = b.binary(BinaryOp::Mul, x, t)?;
            }
            b.binary(BinaryOp::Div, t, six)?
        }
        Op::RmsNorm {
            normalized_dims,
            eps,
        } => {
            let x = needs(0)?;
            let info = b.graph.value(x).clone();
            let eps = eps.unwrap_or(machine_eps(info.dtype));
            let xf = b.cast(x, compute_dtype(info.dtype))?;
            let sq = b.binary(BinaryOp::Mul, xf, xf)?;
            let rank = info.shape.len();
            let dims = (rank - normalized_dims.min(&rank)..rank).collect();
            let ms = b.node(
                Op::Reduce {
                    op: ReduceOp::Mean,
                    dims,
                    keepdim: true,
                },
                &[Some(sq)],
            )?;
            let e = b.scalar(eps, compute_dtype(info.dtype))?;
            let ms = b.binary(BinaryOp::Add, ms, e)?;
            let r = b.unary(UnaryOp::Rsqrt, ms)?;
            let y = b.binary(BinaryOp::Mul, xf, r)?;
            let y = b.cast(y, info.dtype)?;
            match input(1) {
                Some(w) => b.binary(BinaryOp::Mul, y, w)?,
                None => y,
            }
        }
        Op::Sdpa {
            is_causal,
            scale,
            enable_gqa,
        } => sdpa(
            &mut b,
            [needs(0)?, needs(1)?, needs(2)?],
            input(3),
            *is_causal,
            *scale,
            *enable_gqa,
        )?,
        Op::Reduce {
            op: ReduceOp::All,
            dims,
            keepdim,
        } => {
            let n = b.unary(UnaryOp::LogicalNot, needs(0)?)?;
            let any = Op::Reduce {
                op: ReduceOp::Any,
                dims: dims.clone(),
                keepdim: *keepdim,
            };
            let a = b.node(any, &[Some(n)])?;
            b.unary(UnaryOp::LogicalNot, a)?
        }
        Op::IndexCopy { dim } => index_copy(&mut b, *dim, [needs(0)?, needs(1)?, needs(2)?])?,
        Op::Triangle {
            upper: true,
            diagonal,
        } => {
            let x = needs(0)?;
            let info = b.graph.value(x).clone();
            let [.., rows, cols] = info.shape[..] else {
                return Err(Error::shape(format!("triu of a {:?} tensor", info.shape)));
            };
            let keep: Vec<u8> = (0..rows * cols)
                .map(|i| ((i % cols) as i64 - (i / cols) as i64 >= *diagonal) as u8)
                .collect();
            let name = format!("{}.triu_mask", node.name);
            let mask = b
                .graph
                .add_constant(name, Tensor::from_bytes(DType::Bool, &[rows, cols], &keep)?);
            let zero = b.scalar(0.0, info.dtype)?;
            b.node(Op::Where, &[Some(mask), Some(x), Some(zero)])?
        }
        Op::MaxPool(pool) if pool.spatial_rank() == 1 && !pool.with_indices => {
            let w = pool.window()?;
            let op = Op::MaxPool(MaxPoolAttrs {
                kernel: vec![1, w.kernel[0]],
                stride: vec![1, w.stride[0]],
                padding: vec![0, w.padding[0]],
                dilation: vec![1, w.dilation[0]],
                ceil_mode: w.ceil_mode,
                with_indices: false,
            });
            pool_1d(&mut b, needs(0)?, op)?
        }
        Op::AvgPool(pool) if pool.spatial_rank() == 1 => {
            let w = pool.window()?;
            let op = Op::AvgPool(AvgPoolAttrs {
                kernel: vec![1, w.kernel[0]],
                stride: vec![1, w.stride[0]],
                padding: vec![0, w.padding[0]],
                ..pool.clone()
            });
            pool_1d(&mut b, needs(0)?, op)?
        }
        Op::AdaptiveAvgPool { output_size } if output_size.len() == 1 => {
            let op = Op::AdaptiveAvgPool {
                output_size: vec![1, output_size[0]],
            };
            pool_1d(&mut b, needs(0)?, op)?
        }
        Op::Convolution(_)
            if compute_dtype(b.graph.value(needs(0)?).dtype) != b.graph.value(needs(0)?).dtype =>
        {
            let dtype = b.graph.value(needs(0)?).dtype;
            let slots = node
                .inputs
                .iter()
                .map(|s| s.map(|v| b.as_f32(v)).transpose())
                .collect::<Result<Vec<_>>>()?;
            let y = b.node(node.op.clone(), &slots)?;
            b.cast(y, dtype)?
        }
        _ => return Ok(None),
    };
    b.finish(y).map(Some)
}

/// `x` with row `index[m]` of dim `dim` replaced by row `m` of `rows`: a
/// one-hot match of each position against the index, the matching row
/// gathered, `where` the position was named.
fn index_copy(b: &mut Rewrite, dim: usize, [x, index, rows]: [ValueId; 3]) -> Result<ValueId> {
    let shape = b.graph.value(x).shape.clone();
    let n = shape[dim];
    if b.graph.sym_dims(x)[dim].as_const().is_none() {
        return Err(Error::unsupported(format!(
            "index_copy into dim {dim} of dynamic size"
        )));
    }
    let k = b.graph.value(index).shape.first().copied().unwrap_or(1);
    let rows_k = b
        .graph
        .sym_dims(index)
        .first()
        .cloned()
        .unwrap_or(SymExpr::Const(1));
    let index = b.cast(index, DType::I64)?;
    let index = b.reshape(index, vec![k, 1])?;
    let positions = Tensor::from_i64(DType::I64, &[1, n], &(0..n as i64).collect::<Vec<_>>())?;
    let positions = b.constant("positions", positions);
    let hits = b.binary(BinaryOp::Eq, index, positions)?;
    let any = Op::Reduce {
        op: ReduceOp::Any,
        dims: vec![0],
        keepdim: false,
    };
    let named = b.node(any, &[Some(hits)])?;
    // the source row of each position: sum over m of m * [index[m] == j]
    let arange = Op::Arange {
        start: Scalar::Int(0),
        end: Scalar::Int(k as i64),
        step: Scalar::Int(1),
        dtype: DType::I64,
    };
    let ms = b.sized(arange, &[], vec![rows_k])?;
    let ms = b.reshape(ms, vec![k, 1])?;
    let hits = b.cast(hits, DType::I64)?;
    let weighted = b.binary(BinaryOp::Mul, hits, ms)?;
    let sum = Op::Reduce {
        op: ReduceOp::Sum,
        dims: vec![0],
        keepdim: false,
    };
    let source_row = b.node(sum, &[Some(weighted)])?;
    let gathered = b.node(Op::IndexSelect { dim }, &[Some(rows), Some(source_row)])?;
    let mut mask_shape = vec![1; shape.len()];
    mask_shape[dim] = n;
    let mask = b.reshape(named, mask_shape)?;
    b.node(Op::Where, &[Some(mask), Some(gathered), Some(x)])
}

/// f32 for the reduced-precision floats (PyTorch's opmath type), else the dtype.
fn compute_dtype(d: DType) -> DType {
    if matches!(d, DType::BF16 | DType::F16) {
        DType::F32
    } else {
        d
    }
}

/// `torch.finfo(dtype).eps`, the default `rms_norm` epsilon.
fn machine_eps(d: DType) -> f64 {
    match d {
        DType::BF16 => 0.0078125,
        DType::F16 => 0.0009765625,
        DType::F64 => f64::EPSILON,
        _ => f32::EPSILON as f64,
    }
}

/// `torch.matmul` with `mm`/`bmm` (module docs).
fn matmul(b: &mut Rewrite, x: ValueId, w: ValueId) -> Result<ValueId> {
    let (mut sa, mut sb) = (
        b.graph.value(x).shape.clone(),
        b.graph.value(w).shape.clone(),
    );
    if sa.is_empty() || sb.is_empty() {
        return Err(Error::shape(format!("matmul of {sa:?} and {sb:?}")));
    }
    if sa.len() == 1 {
        sa.insert(0, 1);
    }
    if sb.len() == 1 {
        sb.push(1);
    }
    let (x, w) = (b.reshape(x, sa.clone())?, b.reshape(w, sb.clone())?);
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let y = if sb.len() == 2 {
        let rows: usize = sa[..sa.len() - 1].iter().product();
        let x2 = b.reshape(x, vec![rows, k])?;
        b.node(Op::MatMul, &[Some(x2), Some(w)])?
    } else {
        let batch =
            etmetal_core::shape::broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2])?;
        let count: usize = batch.iter().product();
        let xe = b.expand(x, [batch.as_slice(), &[m, k]].concat())?;
        let we = b.expand(w, [batch.as_slice(), &[k, n]].concat())?;
        let x3 = b.reshape(xe, vec![count, m, k])?;
        let w3 = b.reshape(we, vec![count, k, n])?;
        b.node(Op::MatMul, &[Some(x3), Some(w3)])?
    };
    let out = b
        .base
        .outputs
        .first()
        .map(|v| b.graph.value(*v).shape.clone());
    let out = out.ok_or_else(|| Error::internal("matmul without an output"))?;
    b.reshape(y, out)
}

/// Attention by its definition (module docs).
fn sdpa(
    b: &mut Rewrite,
    [q, k, v]: [ValueId; 3],
    mask: Option<ValueId>,
    is_causal: bool,
    scale: Option<f64>,
    enable_gqa: bool,
) -> Result<ValueId> {
    let dtype = b.graph.value(q).dtype;
    let work = compute_dtype(dtype);
    let (q, mut k, mut v) = (b.cast(q, work)?, b.cast(k, work)?, b.cast(v, work)?);
    let sq = b.graph.value(q).shape.clone();
    let r = sq.len();
    if enable_gqa && r >= 3 {
        k = repeat_heads(b, k, sq[r - 3])?;
        v = repeat_heads(b, v, sq[r - 3])?;
    }
    let sk = b.graph.value(k).shape.clone();
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    let kt = b.node(Op::Permute { dims: perm }, &[Some(k)])?;
    let scores = b.node(Op::MatMul, &[Some(q), Some(kt)])?;
    let scale = scale.unwrap_or(1.0 / (sq[r - 1] as f64).sqrt());
    let s = b.scalar(scale, work)?;
    let mut scores = b.binary(BinaryOp::Mul, scores, s)?;
    let neg_inf = b.scalar(f64::NEG_INFINITY, work)?;
    if is_causal {
        let (l, s_len) = (sq[r - 2], sk[r - 2]);
        let keep: Vec<u8> = (0..l * s_len)
            .map(|i| (i % s_len <= i / s_len) as u8)
            .collect();
        let mut m = b.constant(
            "causal_mask",
            Tensor::from_bytes(DType::Bool, &[l, s_len], &keep)?,
        );
        let (ld, sd) = (
            b.graph.sym_dims(q)[r - 2].clone(),
            b.graph.sym_dims(k)[r - 2].clone(),
        );
        if ld.as_const().is_none() || sd.as_const().is_none() {
            // a dynamic length: the mask at the bound, cut to the actual
            // sizes (an entry depends on its position only)
            let cut = |dim, end| Op::Slice {
                dim,
                start: 0,
                end,
                step: 1,
            };
            let rows = vec![ld.clone(), SymExpr::Const(s_len as i64)];
            m = b.sized(cut(0, l), &[Some(m)], rows)?;
            m = b.sized(cut(1, s_len), &[Some(m)], vec![ld, sd])?;
        }
        scores = b.node(Op::Where, &[Some(m), Some(scores), Some(neg_inf)])?;
    }
    if let Some(m) = mask {
        scores = if b.graph.value(m).dtype == DType::Bool {
            b.node(Op::Where, &[Some(m), Some(scores), Some(neg_inf)])?
        } else {
            let m = b.cast(m, work)?;
            b.binary(BinaryOp::Add, scores, m)?
        };
    }
    let p = b.node(
        Op::Softmax {
            dim: r - 1,
            log: false,
        },
        &[Some(scores)],
    )?;
    let y = b.node(Op::MatMul, &[Some(p), Some(v)])?;
    b.cast(y, dtype)
}

/// `[.., Hk, S, E]` → `[.., H, S, E]`, each head repeated `H / Hk` times
/// in place (`repeat_interleave` on the head dim).
fn repeat_heads(b: &mut Rewrite, x: ValueId, heads: usize) -> Result<ValueId> {
    let s = b.graph.value(x).shape.clone();
    let r = s.len();
    let hk = s[r - 3];
    if hk == heads {
        return Ok(x);
    }
    let group = gqa_group(heads, hk)?;
    let mut split = s.clone();
    split.insert(r - 2, 1);
    let x = b.reshape(x, split.clone())?;
    split[r - 2] = group;
    let x = b.expand(x, split)?;
    let mut out = s;
    out[r - 3] = heads;
    b.reshape(x, out)
}

/// A 1-D pooling `op2d` (already widened to 2-D attributes) on `[N, C, 1, L]`.
fn pool_1d(b: &mut Rewrite, x: ValueId, op2d: Op) -> Result<ValueId> {
    let mut s = b.graph.value(x).shape.clone();
    let at = s.len().saturating_sub(1);
    s.insert(at, 1);
    let x4 = b.reshape(x, s)?;
    let y4 = b.node(op2d, &[Some(x4)])?;
    let mut out = b.graph.value(y4).shape.clone();
    out.remove(at);
    b.reshape(y4, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{InputKind, OutputKind};
    use crate::test_util::{ops, push, reinfers};
    use etmetal_core::ConvAttrs;

    /// One node `op` over fresh user inputs of the given shapes (f32 unless
    /// `dtypes` says), its output a graph output.
    fn single(op: Op, inputs: &[(DType, &[usize])]) -> Graph {
        let mut g = Graph::default();
        let ins: Vec<_> = inputs
            .iter()
            .enumerate()
            .map(|(i, (d, s))| {
                let v = g.add_value(format!("in{i}"), *d, s.to_vec());
                g.inputs.push((v, InputKind::User));
                Some(v)
            })
            .collect();
        let y = push(&mut g, "n", op, ins);
        g.outputs.push((y, OutputKind::User));
        g
    }

    /// Every node re-infers to its values, and only encodable shapes remain.
    fn check(g: &Graph) {
        reinfers(g);
        for n in &g.nodes {
            if n.op == Op::MatMul {
                let (a, b) = (
                    &g.value(n.inputs[0].unwrap()).shape,
                    &g.value(n.inputs[1].unwrap()).shape,
                );
                assert!(
                    (a.len(), b.len()) == (2, 2) || (a.len(), b.len()) == (3, 3) && a[0] == b[0],
                    "{a:?} {b:?}"
                );
            }
            assert!(!matches!(
                n.op,
                Op::Sdpa { .. } | Op::RmsNorm { .. } | Op::Unary(UnaryOp::Silu)
            ));
        }
    }

    const F: DType = DType::F32;

    #[test]
    fn matmul_shapes() {
        for (a, b, want) in [
            (
                &[2, 5, 8][..],
                &[8, 4][..],
                vec!["reshape", "mat_mul", "reshape"],
            ),
            (&[2, 3, 4], &[2, 4, 5], vec!["mat_mul"]),
            (
                &[2, 1, 3, 4],
                &[5, 4, 6],
                vec![
                    "expand", "expand", "reshape", "reshape", "mat_mul", "reshape",
                ],
            ),
            (&[4], &[4, 6], vec!["reshape", "mat_mul", "reshape"]),
            (
                &[2, 3, 4],
                &[4],
                vec!["reshape", "reshape", "mat_mul", "reshape"],
            ),
        ] {
            let mut g = single(Op::MatMul, &[(F, a), (F, b)]);
            to_portable(&mut g).unwrap();
            check(&g);
            assert_eq!(ops(&g), want, "{a:?} @ {b:?}");
        }
    }

    #[test]
    fn activations_and_norms() {
        let mut g = single(Op::Unary(UnaryOp::Silu), &[(F, &[2, 3])]);
        to_portable(&mut g).unwrap();
        check(&g);
        assert_eq!(ops(&g), ["sigmoid", "mul"]);
        let mut g = single(Op::Unary(UnaryOp::Hardswish), &[(F, &[2, 3])]);
        to_portable(&mut g).unwrap();
        assert_eq!(ops(&g), ["add", "clamp", "mul", "div"]);
        let rms = Op::RmsNorm {
            normalized_dims: 1,
            eps: None,
        };
        let mut g = single(rms, &[(DType::BF16, &[2, 3, 8]), (DType::BF16, &[8])]);
        to_portable(&mut g).unwrap();
        check(&g);
        assert_eq!(
            ops(&g),
            [
                "cast",
                "mul",
                "reduce_mean",
                "add",
                "rsqrt",
                "mul",
                "cast",
                "mul"
            ]
        );
        let all = Op::Reduce {
            op: ReduceOp::All,
            dims: vec![1],
            keepdim: false,
        };
        let mut g = single(all, &[(DType::Bool, &[2, 3])]);
        to_portable(&mut g).unwrap();
        check(&g);
        assert_eq!(ops(&g), ["logical_not", "reduce_any", "logical_not"]);
    }

    #[test]
    fn attention_becomes_bmm_and_softmax() {
        let sdpa = Op::Sdpa {
            is_causal: true,
            scale: None,
            enable_gqa: true,
        };
        let mut g = single(
            sdpa,
            &[(F, &[2, 4, 5, 8]), (F, &[2, 2, 5, 8]), (F, &[2, 2, 5, 8])],
        );
        to_portable(&mut g).unwrap();
        check(&g);
        let names = ops(&g);
        assert_eq!(
            names.iter().filter(|n| **n == "mat_mul").count(),
            2,
            "{names:?}"
        );
        assert!(names.contains(&"softmax") && names.contains(&"where"));
        // the causal mask is a lower-triangular constant
        let mask = g
            .values
            .iter()
            .position(|v| v.name.contains(".causal_mask"))
            .unwrap();
        let m = g.constants[&ValueId(mask)].bytes().to_vec();
        assert_eq!(&m[..6], &[1, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn pools_and_triu() {
        let pool = Op::MaxPool(MaxPoolAttrs {
            kernel: vec![3],
            stride: vec![2],
            padding: vec![1],
            dilation: vec![1],
            ceil_mode: false,
            with_indices: false,
        });
        let mut g = single(pool, &[(F, &[2, 4, 11])]);
        to_portable(&mut g).unwrap();
        check(&g);
        assert_eq!(ops(&g), ["reshape", "max_pool", "reshape"]);
        let conv = Op::Convolution(ConvAttrs {
            stride: vec![1],
            padding: vec![0],
            dilation: vec![1],
            transposed: false,
            output_padding: vec![0],
            groups: 1,
        });
        let mut g = Graph::default();
        let x = g.add_value("x", DType::BF16, vec![1, 2, 5]);
        g.inputs.push((x, InputKind::User));
        let w = g.add_constant(
            "w",
            Tensor::from_f32(DType::BF16, &[3, 2, 2], &[0.5; 12]).unwrap(),
        );
        let y = g.add_value("y", DType::BF16, vec![1, 3, 4]);
        let inputs = vec![Some(x), Some(w), None];
        g.nodes.push(Node {
            name: "c".into(),
            target: "t".into(),
            op: conv,
            inputs,
            outputs: vec![y],
        });
        g.outputs.push((y, OutputKind::User));
        to_portable(&mut g).unwrap();
        check(&g);
        assert_eq!(ops(&g), ["cast", "convolution", "cast"]);
        let wf = g.nodes[1].inputs[1].unwrap();
        assert_eq!(g.constants[&wf].dtype(), DType::F32);
        let mut g = single(
            Op::Triangle {
                upper: true,
                diagonal: 1,
            },
            &[(F, &[3, 3])],
        );
        to_portable(&mut g).unwrap();
        check(&g);
        let mask = g.nodes[0].inputs[0].unwrap();
        assert_eq!(g.constants[&mask].bytes(), &[0, 1, 1, 0, 0, 1, 0, 0, 0]);
    }
}
