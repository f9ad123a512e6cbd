//! Shape and dtype inference for every [`Op`]: what a node produces given
//! the dtypes and shapes of its inputs, with PyTorch's rules (type promotion
//! with 0-d operands, matmul broadcasting, convolution arithmetic, …).

use etmetal_core::dtype::{self, Operand};
use etmetal_core::shape::{attention_batch, broadcast_shapes, numel};
use etmetal_core::{BinaryOp, DType, Error, Op, ReduceOp, Result, UnaryOp};

use crate::ir::{Graph, Node, ValueInfo};

/// `(dtype, shape)` of each output of `node`, in order.
pub fn infer(graph: &Graph, node: &Node) -> Result<Vec<(DType, Vec<usize>)>> {
    let inputs: Vec<Option<&ValueInfo>> =
        node.inputs
            .iter()
            .map(|slot| {
                slot.map(|v| {
                    graph.values.get(v.0).ok_or_else(|| {
                        Error::internal(format!("value id {} is not in the graph", v.0))
                    })
                })
                .transpose()
            })
            .collect::<Result<_>>()?;
    infer_op(&node.op, &inputs)
        .map_err(|e| e.context(format!("node `{}` ({})", node.name, node.op.name())))
}

pub(crate) type Out = Vec<(DType, Vec<usize>)>;

pub(crate) fn req<'a>(
    inputs: &[Option<&'a ValueInfo>],
    slot: usize,
    what: &str,
) -> Result<&'a ValueInfo> {
    inputs
        .get(slot)
        .copied()
        .flatten()
        .ok_or_else(|| Error::shape(format!("input {slot} ({what}) is missing")))
}

/// PyTorch's `result_type` for two tensors ([`dtype::result_type`]).
pub fn result_type(a: &ValueInfo, b: &ValueInfo) -> DType {
    let operand = |v: &ValueInfo| {
        if v.shape.is_empty() {
            Operand::ZeroDim(v.dtype)
        } else {
            Operand::Tensor(v.dtype)
        }
    };
    dtype::result_type(operand(a), operand(b))
}

/// Integer and bool inputs of float functions give float32.
fn float_of(d: DType) -> DType {
    if d.is_float() {
        d
    } else {
        DType::F32
    }
}

fn reduced(shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Vec<usize>> {
    for &d in dims {
        if d >= shape.len().max(1) {
            return Err(Error::shape(format!(
                "reduce dim {d} is out of range for shape {shape:?}"
            )));
        }
    }
    let all = dims.is_empty();
    Ok(shape
        .iter()
        .enumerate()
        .filter_map(|(i, &n)| match (all || dims.contains(&i), keepdim) {
            (false, _) => Some(n),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect())
}

fn check_dim(shape: &[usize], dim: usize, what: &str) -> Result<()> {
    if dim >= shape.len() {
        return Err(Error::shape(format!(
            "{what} dim {dim} is out of range for shape {shape:?}"
        )));
    }
    Ok(())
}

fn check_index_dtype(v: &ValueInfo, what: &str) -> Result<()> {
    if !matches!(v.dtype, DType::I64 | DType::I32) {
        return Err(Error::shape(format!(
            "{what} must be int64 or int32, got {}",
            v.dtype
        )));
    }
    Ok(())
}

fn matmul_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let mismatch = || {
        Error::shape(format!(
            "matmul of shapes {a:?} and {b:?}: inner dims differ"
        ))
    };
    if a.is_empty() || b.is_empty() {
        return Err(Error::shape(format!(
            "matmul needs tensors of rank >= 1, got {a:?} and {b:?}"
        )));
    }
    let (ak, bk) = (
        a[a.len() - 1],
        if b.len() == 1 { b[0] } else { b[b.len() - 2] },
    );
    if ak != bk {
        return Err(mismatch());
    }
    let a_batch = &a[..a.len().saturating_sub(2)];
    let b_batch = &b[..b.len().saturating_sub(2)];
    let mut out = broadcast_shapes(a_batch, b_batch)?;
    if a.len() >= 2 {
        out.push(a[a.len() - 2]);
    }
    if b.len() >= 2 {
        out.push(b[b.len() - 1]);
    }
    Ok(out)
}

fn spatial_split<'a>(
    x: &'a ValueInfo,
    spatial: usize,
    what: &str,
) -> Result<(&'a [usize], &'a [usize])> {
    if x.shape.len() != spatial + 1 && x.shape.len() != spatial + 2 {
        return Err(Error::shape(format!(
            "{what} with {spatial} spatial dims needs input of rank {} or {}, got {:?}",
            spatial + 1,
            spatial + 2,
            x.shape
        )));
    }
    Ok(x.shape.split_at(x.shape.len() - spatial))
}

fn infer_op(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    let x = || req(inputs, 0, "input");
    let same = |v: &ValueInfo| Ok(vec![(v.dtype, v.shape.clone())]);
    match op {
        Op::Unary(u) => {
            let x = x()?;
            let dtype = match u {
                UnaryOp::Relu
                | UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Sign
                | UnaryOp::Clamp { .. } => x.dtype,
                UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::BitwiseNot => x.dtype,
                UnaryOp::LogicalNot => DType::Bool,
                UnaryOp::PowScalar { exponent }
                    if !x.dtype.is_float() && exponent.fract() == 0.0 =>
                {
                    x.dtype
                }
                _ => float_of(x.dtype),
            };
            Ok(vec![(dtype, x.shape.clone())])
        }
        Op::Binary(b) => {
            let (l, r) = (req(inputs, 0, "lhs")?, req(inputs, 1, "rhs")?);
            let shape = broadcast_shapes(&l.shape, &r.shape)?;
            let common = result_type(l, r);
            let dtype = match b {
                b if b.is_predicate() => DType::Bool,
                BinaryOp::Div => float_of(common),
                b if b.is_bitwise() && common.is_float() => {
                    return Err(Error::shape(format!("bitwise op on {common} tensors")));
                }
                _ => common,
            };
            Ok(vec![(dtype, shape)])
        }
        Op::Where => {
            let (c, a, b) = (
                req(inputs, 0, "condition")?,
                req(inputs, 1, "self")?,
                req(inputs, 2, "other")?,
            );
            if c.dtype != DType::Bool {
                return Err(Error::shape(format!(
                    "where condition must be bool, got {}",
                    c.dtype
                )));
            }
            let shape = broadcast_shapes(&broadcast_shapes(&c.shape, &a.shape)?, &b.shape)?;
            Ok(vec![(result_type(a, b), shape)])
        }
        Op::Cast { dtype } => Ok(vec![(*dtype, x()?.shape.clone())]),
        Op::Identity => same(x()?),
        Op::Reduce { op, dims, keepdim } => {
            let x = x()?;
            let dtype = match op {
                ReduceOp::Sum | ReduceOp::Prod if !x.dtype.is_float() => DType::I64,
                ReduceOp::Mean if !x.dtype.is_float() => {
                    return Err(Error::shape(format!(
                        "mean of a {} tensor (needs a float dtype)",
                        x.dtype
                    )))
                }
                ReduceOp::Any | ReduceOp::All => DType::Bool,
                _ => x.dtype,
            };
            Ok(vec![(dtype, reduced(&x.shape, dims, *keepdim)?)])
        }
        Op::Var { dims, keepdim, .. } => {
            let x = x()?;
            Ok(vec![(
                float_of(x.dtype),
                reduced(&x.shape, dims, *keepdim)?,
            )])
        }
        Op::ArgReduce { dim, keepdim, .. } => {
            let x = x()?;
            let shape = match dim {
                Some(d) => reduced(&x.shape, &[*d], *keepdim)?,
                None if *keepdim => vec![1; x.shape.len()],
                None => vec![],
            };
            Ok(vec![(DType::I64, shape)])
        }
        Op::ReduceWithIndices { dim, keepdim, .. } => {
            let x = x()?;
            let shape = reduced(&x.shape, &[*dim], *keepdim)?;
            Ok(vec![(x.dtype, shape.clone()), (DType::I64, shape)])
        }
        Op::CumSum { dim } => {
            let x = x()?;
            check_dim(&x.shape, *dim, "cumsum").or_else(|e| {
                if x.shape.is_empty() {
                    Ok(())
                } else {
                    Err(e)
                }
            })?;
            Ok(vec![(
                if x.dtype.is_float() {
                    x.dtype
                } else {
                    DType::I64
                },
                x.shape.clone(),
            )])
        }
        Op::Softmax { dim, .. } => {
            let x = x()?;
            if !x.shape.is_empty() {
                check_dim(&x.shape, *dim, "softmax")?;
            }
            Ok(vec![(float_of(x.dtype), x.shape.clone())])
        }
        Op::TopK { k, dim, .. } => {
            let x = x()?;
            let mut shape = x.shape.clone();
            if !shape.is_empty() {
                check_dim(&shape, *dim, "topk")?;
                if *k > shape[*dim] {
                    return Err(Error::shape(format!(
                        "topk k={k} exceeds size {} of dim {dim}",
                        shape[*dim]
                    )));
                }
                shape[*dim] = *k;
            }
            Ok(vec![(x.dtype, shape.clone()), (DType::I64, shape)])
        }
        Op::LayerNorm {
            normalized_dims, ..
        }
        | Op::RmsNorm {
            normalized_dims, ..
        } => {
            let x = x()?;
            if *normalized_dims > x.shape.len() {
                return Err(Error::shape(format!(
                    "normalising {normalized_dims} dims of shape {:?}",
                    x.shape
                )));
            }
            let norm = &x.shape[x.shape.len() - normalized_dims..];
            for (slot, what) in [(1, "weight"), (2, "bias")] {
                if let Some(p) = inputs.get(slot).copied().flatten() {
                    if p.shape != norm {
                        return Err(Error::shape(format!(
                            "{what} shape {:?} != normalized shape {norm:?}",
                            p.shape
                        )));
                    }
                }
            }
            same(x)
        }
        Op::BatchNorm { .. } | Op::GroupNorm { .. } => {
            let x = x()?;
            if x.shape.len() < 2 {
                return Err(Error::shape(format!(
                    "normalisation over channels needs rank >= 2, got {:?}",
                    x.shape
                )));
            }
            let c = x.shape[1];
            if let Op::GroupNorm { groups, .. } = op {
                if *groups == 0 || c % groups != 0 {
                    return Err(Error::shape(format!(
                        "{c} channels do not split into {groups} groups"
                    )));
                }
            }
            for (slot, p) in inputs.iter().enumerate().skip(1) {
                if let Some(p) = p {
                    if p.shape != [c] {
                        return Err(Error::shape(format!(
                            "parameter {slot} has shape {:?}, expected [{c}]",
                            p.shape
                        )));
                    }
                }
            }
            if matches!(op, Op::BatchNorm { .. }) {
                req(inputs, 3, "running_mean")?;
                req(inputs, 4, "running_var")?;
            }
            same(x)
        }
        Op::MatMul => {
            let (a, b) = (req(inputs, 0, "a")?, req(inputs, 1, "b")?);
            Ok(vec![(
                DType::promote(a.dtype, b.dtype),
                matmul_shape(&a.shape, &b.shape)?,
            )])
        }
        Op::Addmm { .. } => {
            let (bias, a, b) = (
                req(inputs, 0, "bias")?,
                req(inputs, 1, "mat1")?,
                req(inputs, 2, "mat2")?,
            );
            if a.shape.len() != 2 || b.shape.len() != 2 {
                return Err(Error::shape(format!(
                    "addmm needs 2-D matrices, got {:?} and {:?}",
                    a.shape, b.shape
                )));
            }
            let out = matmul_shape(&a.shape, &b.shape)?;
            if broadcast_shapes(&bias.shape, &out)? != out {
                return Err(Error::shape(format!(
                    "addmm bias {:?} does not broadcast to {out:?}",
                    bias.shape
                )));
            }
            Ok(vec![(DType::promote(a.dtype, b.dtype), out)])
        }
        Op::Linear => {
            let (x, w) = (x()?, req(inputs, 1, "weight")?);
            let (Some(&inner), [out_f, in_f]) = (x.shape.last(), w.shape.as_slice()) else {
                return Err(Error::shape(format!(
                    "linear of {:?} with weight {:?}",
                    x.shape, w.shape
                )));
            };
            if inner != *in_f {
                return Err(Error::shape(format!(
                    "linear input {:?} does not match weight {:?}",
                    x.shape, w.shape
                )));
            }
            if let Some(b) = inputs.get(2).copied().flatten() {
                if b.shape != [*out_f] {
                    return Err(Error::shape(format!(
                        "linear bias {:?}, expected [{out_f}]",
                        b.shape
                    )));
                }
            }
            let mut shape = x.shape.clone();
            *shape.last_mut().unwrap_or(&mut 0) = *out_f;
            Ok(vec![(x.dtype, shape)])
        }
        Op::Convolution(conv) => {
            let (x, w) = (x()?, req(inputs, 1, "weight")?);
            let spatial = w.shape.len().saturating_sub(2);
            if spatial == 0 {
                return Err(Error::shape(format!(
                    "convolution weight {:?} has no spatial dims",
                    w.shape
                )));
            }
            let (lead, dims) = spatial_split(x, spatial, "convolution")?;
            let cin = *lead.last().unwrap_or(&0);
            let groups = conv.groups;
            let (expect_cin, cout) = conv.channels(&w.shape);
            if cin != expect_cin || cout % groups.max(1) != 0 {
                return Err(Error::shape(format!(
                    "convolution input {:?} with weight {:?} and groups {groups}: channels do not match",
                    x.shape, w.shape
                )));
            }
            if let Some(b) = inputs.get(2).copied().flatten() {
                if b.shape != [cout] {
                    return Err(Error::shape(format!(
                        "convolution bias {:?}, expected [{cout}]",
                        b.shape
                    )));
                }
            }
            let mut shape: Vec<usize> = lead[..lead.len() - 1].to_vec();
            shape.push(cout);
            shape.extend(conv.output_spatial(dims, &w.shape[2..])?);
            Ok(vec![(x.dtype, shape)])
        }
        Op::MaxPool(pool) => {
            let x = x()?;
            let (lead, dims) = spatial_split(x, pool.spatial_rank(), "max pool")?;
            let shape = [lead, &pool.window()?.output_spatial(dims)?].concat();
            let mut out = vec![(x.dtype, shape.clone())];
            if pool.with_indices {
                out.push((DType::I64, shape));
            }
            Ok(out)
        }
        Op::AvgPool(pool) => {
            let x = x()?;
            let (lead, dims) = spatial_split(x, pool.spatial_rank(), "avg pool")?;
            let shape = [lead, &pool.window()?.output_spatial(dims)?].concat();
            Ok(vec![(x.dtype, shape)])
        }
        Op::AdaptiveAvgPool { output_size } => {
            let x = x()?;
            let (lead, _) = spatial_split(x, output_size.len(), "adaptive avg pool")?;
            let mut shape = lead.to_vec();
            shape.extend_from_slice(output_size);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Sdpa { enable_gqa, .. } => {
            let (q, k, v) = (
                req(inputs, 0, "query")?,
                req(inputs, 1, "key")?,
                req(inputs, 2, "value")?,
            );
            let r = q.shape.len();
            if r < 2 || k.shape.len() != r || v.shape.len() != r {
                return Err(Error::shape(format!(
                    "attention q {:?}, k {:?}, v {:?}: ranks differ or < 2",
                    q.shape, k.shape, v.shape
                )));
            }
            let (l, e, s, ev) = (
                q.shape[r - 2],
                q.shape[r - 1],
                k.shape[r - 2],
                v.shape[r - 1],
            );
            if k.shape[r - 1] != e || v.shape[r - 2] != s {
                return Err(Error::shape(format!(
                    "attention q {:?}, k {:?}, v {:?}: sizes differ",
                    q.shape, k.shape, v.shape
                )));
            }
            let mut batch = attention_batch(
                &q.shape[..r - 2],
                &k.shape[..r - 2],
                &v.shape[..r - 2],
                *enable_gqa,
            )
            .map_err(|e| {
                Error::shape(format!(
                    "attention batch dims of q {:?}, k {:?} and v {:?}: {}",
                    q.shape,
                    k.shape,
                    v.shape,
                    e.message()
                ))
            })?
            .batch;
            if let Some(m) = inputs.get(3).copied().flatten() {
                let mut scores = batch.clone();
                scores.extend([l, s]);
                if broadcast_shapes(&m.shape, &scores)? != scores {
                    return Err(Error::shape(format!(
                        "attention mask {:?} does not broadcast to {scores:?}",
                        m.shape
                    )));
                }
            }
            batch.extend([l, ev]);
            Ok(vec![(q.dtype, batch)])
        }
        Op::Embedding => {
            let (w, idx) = (req(inputs, 0, "weight")?, req(inputs, 1, "indices")?);
            check_index_dtype(idx, "embedding indices")?;
            if w.shape.len() != 2 {
                return Err(Error::shape(format!(
                    "embedding weight must be 2-D, got {:?}",
                    w.shape
                )));
            }
            let mut shape = idx.shape.clone();
            shape.push(w.shape[1]);
            Ok(vec![(w.dtype, shape)])
        }
        Op::Reshape { shape } => {
            let x = x()?;
            if numel(&x.shape)? != numel(shape)? {
                return Err(Error::shape(format!(
                    "cannot reshape {:?} to {shape:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, shape.clone())])
        }
        Op::Permute { dims } => {
            let x = x()?;
            let mut seen = vec![false; x.shape.len()];
            if dims.len() != x.shape.len()
                || dims
                    .iter()
                    .any(|&d| d >= seen.len() || std::mem::replace(&mut seen[d], true))
            {
                return Err(Error::shape(format!(
                    "{dims:?} is not a permutation of the dims of {:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, dims.iter().map(|&d| x.shape[d]).collect())])
        }
        Op::Expand { shape } => {
            let x = x()?;
            let ok = shape.len() >= x.shape.len()
                && x.shape
                    .iter()
                    .rev()
                    .zip(shape.iter().rev())
                    .all(|(&a, &b)| a == b || a == 1);
            if !ok {
                return Err(Error::shape(format!(
                    "cannot expand {:?} to {shape:?}",
                    x.shape
                )));
            }
            Ok(vec![(x.dtype, shape.clone())])
        }
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => {
            let x = x()?;
            check_dim(&x.shape, *dim, "slice")?;
            if *step == 0 || start > end || *end > x.shape[*dim] {
                return Err(Error::shape(format!(
                    "slice {start}..{end} step {step} of dim {dim} of {:?}",
                    x.shape
                )));
            }
            let mut shape = x.shape.clone();
            shape[*dim] = (end - start).div_ceil(*step);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Select { dim, index } => {
            let x = x()?;
            check_dim(&x.shape, *dim, "select")?;
            if *index >= x.shape[*dim] {
                return Err(Error::shape(format!(
                    "select index {index} out of range for dim {dim} of {:?}",
                    x.shape
                )));
            }
            let mut shape = x.shape.clone();
            shape.remove(*dim);
            Ok(vec![(x.dtype, shape)])
        }
        Op::Cat { dim } => {
            let parts: Vec<&ValueInfo> = inputs.iter().copied().flatten().collect();
            let Some(first) = parts.iter().find(|p| p.shape != [0]) else {
                return Err(Error::shape("cat of no non-empty tensors"));
            };
            check_dim(&first.shape, *dim, "cat")?;
            let mut shape = first.shape.clone();
            shape[*dim] = 0;
            let mut dtype = parts[0].dtype;
            for p in &parts {
                dtype = DType::promote(dtype, p.dtype);
                if p.shape == [0] {
                    continue; // legacy empty tensors are skipped by torch.cat
                }
                let fits = p.shape.len() == shape.len()
                    && p.shape
                        .iter()
                        .zip(&first.shape)
                        .enumerate()
                        .all(|(i, (a, b))| i == *dim || a == b);
                if !fits {
                    return Err(Error::shape(format!(
                        "cat along dim {dim} of {:?} and {:?}",
                        first.shape, p.shape
                    )));
                }
                shape[*dim] += p.shape[*dim];
            }
            Ok(vec![(dtype, shape)])
        }
        Op::ConstantPad { pad, .. } => {
            let x = x()?;
            if pad.len() % 2 != 0 || pad.len() / 2 > x.shape.len() {
                return Err(Error::shape(format!("pad {pad:?} for shape {:?}", x.shape)));
            }
            let mut shape = x.shape.clone();
            for (i, pair) in pad.chunks(2).enumerate() {
                let d = shape.len() - 1 - i;
                let n = shape[d] as i64 + pair[0] + pair[1];
                if n < 0 {
                    return Err(Error::shape(format!(
                        "pad {pad:?} makes dim {d} of {:?} negative",
                        x.shape
                    )));
                }
                shape[d] = n as usize;
            }
            Ok(vec![(x.dtype, shape)])
        }
        Op::IndexSelect { dim } => {
            let (x, idx) = (x()?, req(inputs, 1, "index")?);
            check_index_dtype(idx, "index_select index")?;
            if idx.shape.len() > 1 {
                return Err(Error::shape(format!(
                    "index_select index must be 1-D, got {:?}",
                    idx.shape
                )));
            }
            let mut shape = x.shape.clone();
            if !shape.is_empty() {
                check_dim(&shape, *dim, "index_select")?;
                shape[*dim] = numel(&idx.shape)?;
            }
            Ok(vec![(x.dtype, shape)])
        }
        Op::Gather { dim } => {
            let (x, idx) = (x()?, req(inputs, 1, "index")?);
            check_index_dtype(idx, "gather index")?;
            if idx.shape.len() != x.shape.len() {
                return Err(Error::shape(format!(
                    "gather index {:?} must have the rank of {:?}",
                    idx.shape, x.shape
                )));
            }
            if !x.shape.is_empty() {
                check_dim(&x.shape, *dim, "gather")?;
            }
            Ok(vec![(x.dtype, idx.shape.clone())])
        }
        Op::IndexCopy { dim } => {
            let (x, idx, src) = (x()?, req(inputs, 1, "index")?, req(inputs, 2, "source")?);
            check_index_dtype(idx, "index_copy index")?;
            check_dim(&x.shape, *dim, "index_copy")?;
            let mut rows = x.shape.clone();
            rows[*dim] = numel(&idx.shape)?;
            if idx.shape.len() > 1 || src.shape != rows || src.dtype != x.dtype {
                return Err(Error::shape(format!(
                    "index_copy of a {} source {:?} at an index {:?} into dim {dim} of {} {:?} \
                     (the source needs {rows:?})",
                    src.dtype, src.shape, idx.shape, x.dtype, x.shape
                )));
            }
            Ok(vec![(x.dtype, x.shape.clone())])
        }
        Op::Index => {
            let x = x()?;
            let slots = &inputs[1..];
            if slots.len() > x.shape.len() {
                return Err(Error::shape(format!(
                    "{} indices for a tensor of shape {:?}",
                    slots.len(),
                    x.shape
                )));
            }
            let mut bshape: Vec<usize> = vec![];
            let mut positions = vec![];
            for (d, s) in slots.iter().enumerate() {
                if let Some(i) = s {
                    if i.dtype == DType::Bool || i.dtype == DType::U8 {
                        return Err(Error::unsupported(
                            "boolean mask indexing (its shape depends on the data)",
                        ));
                    }
                    check_index_dtype(i, "index")?;
                    bshape = broadcast_shapes(&bshape, &i.shape)?;
                    positions.push(d);
                }
            }
            if positions.is_empty() {
                return same(x);
            }
            let adjacent = positions.windows(2).all(|w| w[1] == w[0] + 1);
            let rest = |range: std::ops::Range<usize>| {
                range.filter(|d| !positions.contains(d)).map(|d| x.shape[d])
            };
            let shape: Vec<usize> = if adjacent {
                rest(0..positions[0])
                    .chain(bshape)
                    .chain(rest(positions[0]..x.shape.len()))
                    .collect()
            } else {
                bshape.into_iter().chain(rest(0..x.shape.len())).collect()
            };
            Ok(vec![(x.dtype, shape)])
        }
        Op::Triangle { .. } => {
            let x = x()?;
            if x.shape.len() < 2 {
                return Err(Error::shape(format!(
                    "triu/tril needs rank >= 2, got {:?}",
                    x.shape
                )));
            }
            same(x)
        }
        Op::Repeat { repeats } => {
            let x = x()?;
            if repeats.len() < x.shape.len() {
                return Err(Error::shape(format!(
                    "repeat {repeats:?} has fewer dims than {:?}",
                    x.shape
                )));
            }
            let pad = repeats.len() - x.shape.len();
            let shape = repeats
                .iter()
                .enumerate()
                .map(|(i, &r)| r * if i < pad { 1 } else { x.shape[i - pad] })
                .collect();
            Ok(vec![(x.dtype, shape)])
        }
        Op::Full { shape, dtype, .. } => Ok(vec![(*dtype, shape.clone())]),
        Op::Delegate { index } => Err(Error::internal(format!(
            "delegate call {index}: its outputs are declared by the backend, not inferred"
        ))),
        Op::Arange {
            start,
            end,
            step,
            dtype,
        } => {
            let (s, e, st) = (start.to_f64(), end.to_f64(), step.to_f64());
            if st == 0.0 || !((e - s) / st).is_finite() {
                return Err(Error::shape(format!("arange({s}, {e}, {st})")));
            }
            Ok(vec![(
                *dtype,
                vec![((e - s) / st).ceil().max(0.0) as usize],
            )])
        }
        Op::Int4Linear { .. }
        | Op::Int8Linear { .. }
        | Op::GatherQmv { .. }
        | Op::GatedDeltaRule => crate::infer_quant::infer_quant(op, inputs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ValueId;
    use etmetal_core::{ConvAttrs, MaxPoolAttrs};

    fn node(graph: &mut Graph, op: Op, inputs: &[(DType, &[usize])]) -> Result<Out> {
        let ids = inputs
            .iter()
            .map(|(d, s)| Some(graph.add_value("in", *d, s.to_vec())))
            .collect();
        let n = Node {
            name: "n".into(),
            target: "t".into(),
            op,
            inputs: ids,
            outputs: vec![ValueId(0)],
        };
        infer(graph, &n)
    }

    fn one(op: Op, inputs: &[(DType, &[usize])]) -> Result<(DType, Vec<usize>)> {
        node(&mut Graph::default(), op, inputs).map(|mut v| v.remove(0))
    }

    #[test]
    fn promotion_with_zero_dim_operands() {
        use DType::*;
        let add = Op::Binary(BinaryOp::Add);
        assert_eq!(
            one(add.clone(), &[(F32, &[2, 3]), (F64, &[])]).unwrap(),
            (F32, vec![2, 3])
        );
        assert_eq!(
            one(add.clone(), &[(I64, &[3]), (F32, &[])]).unwrap(),
            (F32, vec![3])
        );
        assert_eq!(
            one(add.clone(), &[(BF16, &[3]), (F32, &[3])]).unwrap(),
            (F32, vec![3])
        );
        assert_eq!(
            one(Op::Binary(BinaryOp::Div), &[(I64, &[3]), (I64, &[])])
                .unwrap()
                .0,
            F32
        );
        assert_eq!(
            one(Op::Binary(BinaryOp::Lt), &[(F32, &[2, 1]), (F32, &[4])]).unwrap(),
            (Bool, vec![2, 4])
        );
        assert!(one(add, &[(F32, &[2]), (F32, &[3])]).is_err());
    }

    #[test]
    fn matmul_and_linear() {
        use DType::F32;
        assert_eq!(
            one(Op::MatMul, &[(F32, &[2, 1, 3, 4]), (F32, &[5, 4, 6])])
                .unwrap()
                .1,
            vec![2, 5, 3, 6]
        );
        assert_eq!(
            one(Op::MatMul, &[(F32, &[4]), (F32, &[4, 6])]).unwrap().1,
            vec![6]
        );
        assert!(one(Op::MatMul, &[(F32, &[3, 4]), (F32, &[5, 6])]).is_err());
        assert_eq!(
            one(
                Op::Linear,
                &[(F32, &[2, 5, 8]), (F32, &[4, 8]), (F32, &[4])]
            )
            .unwrap()
            .1,
            vec![2, 5, 4]
        );
        assert!(one(Op::Linear, &[(F32, &[2, 8]), (F32, &[4, 8]), (F32, &[3])]).is_err());
    }

    #[test]
    fn convolution_and_pooling() {
        use DType::F32;
        let conv = Op::Convolution(ConvAttrs {
            stride: vec![2, 2],
            padding: vec![1, 1],
            dilation: vec![1, 1],
            transposed: false,
            output_padding: vec![0, 0],
            groups: 1,
        });
        assert_eq!(
            one(conv, &[(F32, &[1, 3, 16, 16]), (F32, &[8, 3, 3, 3])])
                .unwrap()
                .1,
            vec![1, 8, 8, 8]
        );
        let pool = |ceil| {
            Op::MaxPool(MaxPoolAttrs {
                kernel: vec![3],
                stride: vec![2],
                padding: vec![0],
                dilation: vec![1],
                ceil_mode: ceil,
                with_indices: true,
            })
        };
        let out = node(&mut Graph::default(), pool(false), &[(F32, &[1, 2, 6])]).unwrap();
        assert_eq!(out, vec![(F32, vec![1, 2, 2]), (DType::I64, vec![1, 2, 2])]);
        assert_eq!(
            one(pool(true), &[(F32, &[1, 2, 6])]).unwrap().1,
            vec![1, 2, 3]
        );
    }

    #[test]
    fn views_and_indexing() {
        use DType::*;
        assert_eq!(
            one(
                Op::Slice {
                    dim: 1,
                    start: 1,
                    end: 5,
                    step: 2
                },
                &[(F32, &[2, 6])]
            )
            .unwrap()
            .1,
            vec![2, 2]
        );
        assert!(one(Op::Reshape { shape: vec![5] }, &[(F32, &[2, 3])]).is_err());
        assert!(one(Op::Permute { dims: vec![0, 0] }, &[(F32, &[2, 2])]).is_err());
        let idx = one(Op::Index, &[(F32, &[4, 5, 6]), (I64, &[3]), (I64, &[3])]).unwrap();
        assert_eq!(idx.1, vec![3, 6]);
        let mut g = Graph::default();
        let x = g.add_value("x", F32, vec![4, 5, 6]);
        let i = g.add_value("i", I64, vec![2, 3]);
        let n = Node {
            name: "n".into(),
            target: "t".into(),
            op: Op::Index,
            inputs: vec![Some(x), None, Some(i)],
            outputs: vec![],
        };
        assert_eq!(infer(&g, &n).unwrap()[0].1, vec![4, 2, 3, 6]);
        let e = one(Op::Embedding, &[(F32, &[10, 4]), (F32, &[3])]).unwrap_err();
        assert!(e.to_string().contains("int64"), "{e}");
        assert_eq!(
            one(
                Op::ConstantPad {
                    pad: vec![1, 1, 0, -1],
                    value: 0.0
                },
                &[(F32, &[3, 4])]
            )
            .unwrap()
            .1,
            vec![2, 6]
        );
    }

    #[test]
    fn attention_and_reductions() {
        use DType::*;
        let sdpa = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: false,
        };
        let out = one(
            sdpa,
            &[
                (F32, &[1, 2, 5, 8]),
                (F32, &[1, 2, 7, 8]),
                (F32, &[1, 2, 7, 4]),
                (Bool, &[5, 7]),
            ],
        );
        assert_eq!(out.unwrap().1, vec![1, 2, 5, 4]);
        // PyTorch 2.15: 8 query heads over 2 key and 4 value heads give
        // [2, 8, 5, 4] (k/v batch 1 broadcast); 3 over 2 do not divide
        let gqa = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: true,
        };
        let q = (F32, &[2, 8, 5, 8][..]);
        let (k, v) = ((F32, &[1, 2, 7, 8][..]), (F32, &[1, 4, 7, 4][..]));
        assert_eq!(one(gqa.clone(), &[q, k, v]).unwrap().1, vec![2, 8, 5, 4]);
        assert!(one(gqa, &[(F32, &[1, 3, 5, 8]), k, (F32, &[1, 2, 7, 4])]).is_err());
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![1],
            keepdim: true,
        };
        assert_eq!(one(sum, &[(Bool, &[2, 3])]).unwrap(), (I64, vec![2, 1]));
        let topk = Op::TopK {
            k: 2,
            dim: 1,
            largest: true,
            sorted: true,
        };
        assert_eq!(
            node(&mut Graph::default(), topk, &[(F32, &[3, 4])]).unwrap()[1],
            (I64, vec![3, 2])
        );
        let ar = Op::Arange {
            start: etmetal_core::Scalar::Int(0),
            end: etmetal_core::Scalar::Int(5),
            step: etmetal_core::Scalar::Int(2),
            dtype: I64,
        };
        assert_eq!(one(ar, &[]).unwrap(), (I64, vec![3]));
    }
}
