//! Symbolic sizes of a node's outputs from its inputs' (bounded dynamic
//! shapes, see [`SymShapes`](crate::ir::SymShapes)): the companion of
//! [`infer`](crate::infer::infer), which gives the upper bounds.
//!
//! The rules follow the ops' size arithmetic (broadcasting, matmul,
//! convolution, concatenation, padding, reshapes). An op whose sizes come
//! from attributes rather than inputs (`Full`, `Arange`) keeps what the
//! importer read from the file; a node with a dynamic input and no rule is
//! an error naming it.

use etmetal_core::shape::sym_conv_output_size;
use etmetal_core::{Error, Op, Result, SymExpr};
use std::ops::{Add, Mul};

use crate::infer::infer;
use crate::ir::{Graph, Node};

type Dims = Vec<SymExpr>;

fn c(n: usize) -> SymExpr {
    SymExpr::Const(n as i64)
}

fn product(dims: &[SymExpr]) -> SymExpr {
    dims.iter().cloned().fold(SymExpr::Const(1), SymExpr::mul)
}

/// Broadcasting of symbolic sizes: a size 1 takes the other; of a constant
/// and a symbol, the constant (the program was exported with them equal).
fn broadcast(a: &[SymExpr], b: &[SymExpr]) -> Dims {
    let rank = a.len().max(b.len());
    let at = |s: &[SymExpr], i: usize| {
        (i + s.len())
            .checked_sub(rank)
            .map_or(SymExpr::Const(1), |j| s[j].clone())
    };
    (0..rank)
        .map(|i| {
            let (x, y) = (at(a, i), at(b, i));
            match (x.as_const(), y.as_const()) {
                (Some(1), _) => y,
                (_, Some(1)) | (Some(_), None) => x,
                (None, Some(_)) => y,
                _ => x,
            }
        })
        .collect()
}

fn matmul(a: &[SymExpr], b: &[SymExpr]) -> Dims {
    let a_batch = &a[..a.len().saturating_sub(2)];
    let b_batch = &b[..b.len().saturating_sub(2)];
    let mut out = broadcast(a_batch, b_batch);
    if a.len() >= 2 {
        out.push(a[a.len() - 2].clone());
    }
    if b.len() >= 2 {
        out.push(b[b.len() - 1].clone());
    }
    out
}

/// `e / k` when every term of `e` is a multiple of `k` (`4*s / 4` is `s`).
fn exact_div(e: &SymExpr, k: i64) -> Option<SymExpr> {
    if k == 1 {
        return Some(e.clone());
    }
    let term = |t: &SymExpr| match t {
        SymExpr::Const(v) => (v % k == 0).then(|| SymExpr::Const(v / k)),
        SymExpr::Mul(fs) => match fs[0] {
            SymExpr::Const(v) if v % k == 0 => {
                let rest = fs[1..]
                    .iter()
                    .cloned()
                    .fold(SymExpr::Const(1), SymExpr::mul);
                Some(SymExpr::mul(SymExpr::Const(v / k), rest))
            }
            _ => None,
        },
        _ => None,
    };
    match e {
        SymExpr::Add(ts) => ts
            .iter()
            .map(term)
            .try_fold(SymExpr::Const(0), |acc, t| Some(SymExpr::add(acc, t?))),
        e => term(e),
    }
}

/// The symbolic target of a reshape of `x` (sizes at their bounds in
/// `x_ub`) to the bounds `out`: dims are grouped where the products of the
/// bounds meet; a group keeps its constant sizes and gives its one
/// non-constant size the product of the input group divided by them.
fn reshape(x: &[SymExpr], x_ub: &[usize], out: &[usize]) -> Result<Dims> {
    let fail = || {
        Error::unsupported(format!(
            "reshape of a dynamic shape [{}] to {out:?}: no symbolic size fits",
            x.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    };
    let mut dims = Vec::with_capacity(out.len());
    let (mut i, mut j) = (0, 0);
    while i < x.len() || j < out.len() {
        let (gi, gj) = (i, j);
        let (mut pi, mut pj) = (1usize, 1usize);
        // one group: extend the side with the smaller product until they meet
        loop {
            if i < x.len() && (pi < pj || pi == pj && i == gi) {
                pi *= x_ub[i];
                i += 1;
            } else if j < out.len() && (pj < pi || j == gj) {
                pj *= out[j];
                j += 1;
            } else {
                break;
            }
            if pi == pj && i > gi && j > gj {
                // trailing 1s of the output join this group
                while j < out.len() && out[j] == 1 && (i == x.len() || x_ub[i] != 1) {
                    j += 1;
                }
                break;
            }
        }
        if pi != pj {
            return Err(fail());
        }
        let group = &x[gi..i];
        let total = product(group);
        if total.as_const().is_some() {
            dims.extend(out[gj..j].iter().map(|&n| c(n)));
            continue;
        }
        // the one output dim of the group whose size is not a constant
        let found = (gj..j).find_map(|k| {
            let others: usize = (gj..j).filter(|&m| m != k).map(|m| out[m]).product();
            exact_div(&total, others as i64).map(|e| (k, e))
        });
        let (k, e) = found.ok_or_else(fail)?;
        dims.extend((gj..j).map(|m| if m == k { e.clone() } else { c(out[m]) }));
    }
    Ok(dims)
}

/// The symbolic sizes of `node`'s outputs, or `None` when none of its
/// inputs is dynamic (its outputs are static, or keep what they have).
pub fn infer_sym(graph: &Graph, node: &Node) -> Result<Option<Vec<Dims>>> {
    if !node.inputs.iter().flatten().any(|&v| graph.is_dynamic(v)) {
        return Ok(None);
    }
    let dims = |slot: usize| -> Result<Dims> {
        node.inputs
            .get(slot)
            .copied()
            .flatten()
            .map(|v| graph.sym_dims(v))
            .ok_or_else(|| Error::shape(format!("input {slot} is missing")))
    };
    let at = |e: Error| e.context(format!("node `{}` ({})", node.name, node.op.name()));
    // the bounds, from the static inference
    let ub: Vec<Vec<usize>> = infer(graph, node)?.into_iter().map(|(_, s)| s).collect();
    let x = || dims(0);
    let one = |d: Dims| Ok(vec![d]);
    let out = match &node.op {
        Op::Unary(_)
        | Op::Cast { .. }
        | Op::Identity
        | Op::CumSum { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::BatchNorm { .. }
        | Op::GroupNorm { .. }
        | Op::Triangle { .. } => one(x()?),
        Op::Binary(_) => one(broadcast(&x()?, &dims(1)?)),
        Op::Where => one(broadcast(&broadcast(&x()?, &dims(1)?), &dims(2)?)),
        Op::Reduce {
            dims: rd, keepdim, ..
        }
        | Op::Var {
            dims: rd, keepdim, ..
        } => one(reduced(&x()?, rd, *keepdim)),
        Op::ArgReduce { dim, keepdim, .. } => one(match dim {
            Some(d) => reduced(&x()?, &[*d], *keepdim),
            None => ub[0].iter().map(|&n| c(n)).collect(),
        }),
        Op::ReduceWithIndices { dim, keepdim, .. } => {
            let d = reduced(&x()?, &[*dim], *keepdim);
            Ok(vec![d.clone(), d])
        }
        Op::TopK { k, dim, .. } => {
            let mut d = x()?;
            if let Some(s) = d.get_mut(*dim) {
                *s = c(*k);
            }
            Ok(vec![d.clone(), d])
        }
        Op::MatMul => one(matmul(&x()?, &dims(1)?)),
        Op::Addmm { .. } => one(matmul(&dims(1)?, &dims(2)?)),
        // (`[P, K]` rows, each times its expert's `[N, K]`: `[P, N]`)
        Op::Linear | Op::Int4Linear { .. } | Op::Int8Linear { .. } | Op::GatherQmv { .. } => {
            let mut d = x()?;
            if let (Some(last), Some(&n)) = (d.last_mut(), ub[0].last()) {
                *last = c(n);
            }
            one(d)
        }
        Op::Convolution(conv) if !conv.transposed => {
            let (x, w) = (x()?, dims(1)?);
            let sr = conv.spatial_rank();
            let lead = x.len() - sr;
            let mut d: Dims = x[..lead - 1].to_vec();
            d.push(w[0].clone());
            for s in 0..sr {
                let k = ub_of(graph, node, 1)[2 + s];
                let (st, p, dil) = (conv.stride[s], conv.padding[s], conv.dilation[s]);
                d.push(sym_conv_output_size(x[lead + s].clone(), k, st, p, dil)?);
            }
            one(d)
        }
        Op::MaxPool(_) | Op::AvgPool(_) => {
            let x = x()?;
            let window = match &node.op {
                Op::MaxPool(p) => p.window()?,
                Op::AvgPool(p) => p.window()?,
                _ => return Err(Error::internal("not a pool")),
            };
            let lead = x.len() - window.spatial_rank();
            let mut d: Dims = x[..lead].to_vec();
            for (s, size) in x[lead..].iter().enumerate() {
                d.push(match size.as_const() {
                    Some(_) => c(ub[0][lead + s]),
                    // ceil mode drops a last window in the padding: not a sum
                    None if window.ceil_mode => {
                        return Err(at(Error::unsupported(
                            "pooling in ceil mode over a dynamic spatial size",
                        )))
                    }
                    None => sym_conv_output_size(
                        size.clone(),
                        window.kernel[s],
                        window.stride[s],
                        window.padding[s],
                        window.dilation[s],
                    )?,
                });
            }
            Ok(ub.iter().map(|_| d.clone()).collect())
        }
        // the output size whatever the input's
        Op::AdaptiveAvgPool { output_size } => {
            let x = x()?;
            let mut d: Dims = x[..x.len() - output_size.len()].to_vec();
            d.extend(output_size.iter().map(|&n| c(n)));
            one(d)
        }
        // transposed: a dynamic batch only
        Op::Convolution(conv) => {
            let x = x()?;
            let lead = x.len() - conv.spatial_rank();
            if x[lead..].iter().any(|d| d.as_const().is_none()) {
                return Err(at(Error::unsupported(
                    "a transposed convolution over a dynamic spatial size",
                )));
            }
            let mut d: Dims = x[..lead - 1].to_vec();
            d.extend(ub[0][lead - 1..].iter().map(|&n| c(n)));
            one(d)
        }
        Op::Sdpa { .. } => {
            let (q, v) = (x()?, dims(2)?);
            let r = q.len();
            let mut d = q[..r - 1].to_vec();
            d.push(v[r - 1].clone());
            one(d)
        }
        Op::Embedding => {
            let mut d = dims(1)?;
            d.push(dims(0)?[1].clone());
            one(d)
        }
        Op::Reshape { shape } => one(reshape(&x()?, &ub_of(graph, node, 0), shape).map_err(at)?),
        Op::Permute { dims: p } => {
            let x = x()?;
            one(p.iter().map(|&d| x[d].clone()).collect())
        }
        Op::Expand { shape } => {
            let x = x()?;
            let lead = shape.len() - x.len();
            one(shape
                .iter()
                .enumerate()
                .map(|(i, &n)| match i.checked_sub(lead).map(|j| &x[j]) {
                    Some(e) if e.as_const() != Some(1) => e.clone(),
                    _ => c(n),
                })
                .collect())
        }
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => {
            let mut d = x()?;
            let in_ub = ub_of(graph, node, 0)[*dim];
            let size = d[*dim].clone();
            if size.as_const().is_some() {
                d[*dim] = c((end - start).div_ceil(*step));
            } else if *start == 0 && *end == in_ub && *step == 1 {
                // the whole dim
            } else {
                return Err(at(Error::unsupported(format!(
                    "a slice {start}..{end} of dynamic size `{size}`: its symbolic size is \
                     unknown (only the file's slices carry one)"
                ))));
            }
            one(d)
        }
        Op::Select { dim, .. } => {
            let mut d = x()?;
            d.remove(*dim);
            one(d)
        }
        Op::Cat { dim } => {
            let parts: Vec<Dims> = node
                .inputs
                .iter()
                .flatten()
                .filter(|&&v| graph.value(v).shape != [0])
                .map(|&v| graph.sym_dims(v))
                .collect();
            let mut d = parts[0].clone();
            d[*dim] = parts
                .iter()
                .map(|p| p[*dim].clone())
                .fold(SymExpr::Const(0), SymExpr::add);
            one(d)
        }
        Op::ConstantPad { pad, .. } => {
            let mut d = x()?;
            let rank = d.len();
            for (i, pair) in pad.chunks(2).enumerate() {
                let k = rank - 1 - i;
                d[k] = SymExpr::add(d[k].clone(), SymExpr::Const(pair.iter().sum()));
            }
            one(d)
        }
        Op::IndexSelect { dim } => {
            let mut d = x()?;
            if !d.is_empty() {
                d[*dim] = product(&dims(1)?);
            }
            one(d)
        }
        Op::Gather { .. } => one(dims(1)?),
        Op::IndexCopy { .. } => one(x()?),
        Op::Repeat { repeats } => {
            let x = x()?;
            let lead = repeats.len() - x.len();
            one(repeats
                .iter()
                .enumerate()
                .map(|(i, &r)| match i.checked_sub(lead) {
                    Some(j) => SymExpr::mul(c(r), x[j].clone()),
                    None => c(r),
                })
                .collect())
        }
        other => Err(at(Error::unsupported(format!(
            "{} with a dynamic-shape input",
            other.name()
        )))),
    }?;
    Ok(Some(out))
}

fn ub_of(graph: &Graph, node: &Node, slot: usize) -> Vec<usize> {
    node.inputs
        .get(slot)
        .copied()
        .flatten()
        .map_or_else(Vec::new, |v| graph.value(v).shape.clone())
}

fn reduced(x: &[SymExpr], dims: &[usize], keepdim: bool) -> Dims {
    let all = dims.is_empty();
    x.iter()
        .enumerate()
        .filter_map(|(i, n)| match (all || dims.contains(&i), keepdim) {
            (false, _) => Some(n.clone()),
            (true, true) => Some(SymExpr::Const(1)),
            (true, false) => None,
        })
        .collect()
}

/// Give the outputs of `node` (already in `graph`) their symbolic sizes.
pub fn assign_sym(graph: &mut Graph, node: &Node) -> Result<()> {
    if let Some(outs) = infer_sym(graph, node)? {
        for (&v, d) in node.outputs.iter().zip(outs) {
            graph
                .set_sym_dims(v, d)
                .map_err(|e| e.context(format!("node `{}` ({})", node.name, node.op.name())))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::{BinaryOp, DType, SymRange};

    fn s() -> SymExpr {
        SymExpr::sym("s")
    }

    fn dynamic_graph() -> (Graph, crate::ValueId) {
        let mut g = Graph::default();
        g.sym
            .ranges
            .insert("s".into(), SymRange { min: 1, max: 16 });
        let x = g.add_value("x", DType::F32, vec![16, 4]);
        g.set_sym_dims(x, vec![s(), SymExpr::Const(4)]).unwrap();
        (g, x)
    }

    fn add_node(g: &mut Graph, op: Op, inputs: &[crate::ValueId]) -> Result<crate::ValueId> {
        let mut node = Node {
            name: format!("n{}", g.nodes.len()),
            target: String::new(),
            op,
            inputs: inputs.iter().map(|&v| Some(v)).collect(),
            outputs: vec![],
        };
        let (dtype, shape) = infer(g, &node)?.remove(0);
        node.outputs.push(g.add_value("y", dtype, shape));
        assign_sym(g, &node)?;
        let y = node.outputs[0];
        g.nodes.push(node);
        Ok(y)
    }

    #[test]
    fn sizes_follow_the_ops() {
        let (mut g, x) = dynamic_graph();
        let w = g.add_value("w", DType::F32, vec![4, 3]);
        let y = add_node(&mut g, Op::MatMul, &[x, w]).unwrap();
        assert_eq!(g.sym_dims(y), [s(), SymExpr::Const(3)]);
        let cat = add_node(&mut g, Op::Cat { dim: 0 }, &[x, x]).unwrap();
        assert_eq!(g.sym_dims(cat)[0], SymExpr::mul(SymExpr::Const(2), s()));
        assert_eq!(g.value(cat).shape, [32, 4]);
        let flat = add_node(&mut g, Op::Reshape { shape: vec![64] }, &[x]).unwrap();
        assert_eq!(g.sym_dims(flat), [SymExpr::mul(SymExpr::Const(4), s())]);
        let back = add_node(
            &mut g,
            Op::Reshape {
                shape: vec![2, 16, 2],
            },
            &[flat],
        )
        .unwrap();
        assert_eq!(
            g.sym_dims(back),
            [
                SymExpr::Const(2),
                SymExpr::mul(SymExpr::Const(1), s()),
                SymExpr::Const(2)
            ]
        );
        let b = g.add_value("b", DType::F32, vec![1, 4]);
        let sum = add_node(&mut g, Op::Binary(BinaryOp::Add), &[b, x]).unwrap();
        assert_eq!(g.sym_dims(sum), [s(), SymExpr::Const(4)]);
        // a static node stays static
        let ww = add_node(&mut g, Op::Binary(BinaryOp::Add), &[w, w]).unwrap();
        assert!(!g.is_dynamic(ww));
    }

    #[test]
    fn pools_of_a_dynamic_image_size() {
        let mut g = Graph::default();
        g.sym
            .ranges
            .insert("h".into(), SymRange { min: 4, max: 16 });
        let x = g.add_value("x", DType::F32, vec![1, 2, 16, 16]);
        let h = SymExpr::sym("h");
        let c = SymExpr::Const;
        g.set_sym_dims(x, vec![c(1), c(2), h.clone(), h.clone()])
            .unwrap();
        let pool = |ceil_mode| {
            Op::MaxPool(etmetal_core::MaxPoolAttrs {
                kernel: vec![2, 2],
                stride: vec![2, 2],
                padding: vec![0, 0],
                dilation: vec![1, 1],
                ceil_mode,
                with_indices: false,
            })
        };
        let y = add_node(&mut g, pool(false), &[x]).unwrap();
        let half = SymExpr::floor_div(h.clone(), c(2)).unwrap();
        assert_eq!(g.sym_dims(y), [c(1), c(2), half.clone(), half]);
        let e = add_node(&mut g, pool(true), &[x]).unwrap_err().to_string();
        assert!(e.contains("ceil mode over a dynamic spatial size"), "{e}");
        let a = add_node(
            &mut g,
            Op::AdaptiveAvgPool {
                output_size: vec![1, 1],
            },
            &[x],
        )
        .unwrap();
        assert!(!g.is_dynamic(a));
    }

    #[test]
    fn a_node_without_a_rule_is_an_error_naming_it() {
        let (mut g, x) = dynamic_graph();
        let e = add_node(
            &mut g,
            Op::Slice {
                dim: 0,
                start: 1,
                end: 16,
                step: 1,
            },
            &[x],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("node `n0` (slice)") && e.contains("dynamic size `s`"),
            "{e}"
        );
        let e = add_node(&mut g, Op::Reshape { shape: vec![8, 8] }, &[x])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no symbolic size fits"), "{e}");
    }
}
