//! Fold a per-channel scale and shift into the convolution before them:
//! `conv(x, w, b) * s + t` becomes `conv(x, w·s, b·s + t)` when `w`, `b`,
//! `s` and `t` are constants, as an eval-mode batch norm leaves them after
//! [`crate::decompose`]. One kernel then does the work of three, and
//! reads and writes the activation once. f32 only: in a reduced precision
//! the folded weight would round differently from the two-step result.

use std::collections::{HashMap, HashSet};

use etmetal_core::{BinaryOp, ConvAttrs, DType, Op, Result, Tensor};

use crate::ir::{Graph, Node, ValueId};

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
    use crate::ir::{InputKind, OutputKind};
    use crate::test_util::{ops, push, reinfers};

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
