//! Normalisations. Layer, RMS and group norm are row kernels (see
//! [`super::rows`]): one workgroup per normalised group, statistics in f32
//! over two passes (mean, then squared deviations), then one pass writing
//! the normalised, scaled and shifted values. Eval-mode batch norm is a
//! lazy expression (per-channel vectors broadcast over dim 1), fused into
//! whatever reads it.

use etmetal_core::{BinaryOp, DType, Error, Op, Result, Scalar, UnaryOp};
use etmetal_graph::Node;

use super::rows::{
    as_f32, as_rows, col_loop, dispatch_rows_of, row_head, shared, tree_reduce, ROW_WORKGROUP,
};
use crate::preprocess::emit::{entry, KernelBuilder};
use crate::preprocess::expr::{Kind, Lazy, LazyRef};
use crate::preprocess::lowering::Lowering;
use crate::preprocess::pointwise::{cast, float_literal};

/// The statistics a row kernel takes of each group.
#[derive(Clone, Copy, PartialEq)]
enum Stats {
    /// Subtract the mean, divide by the standard deviation.
    MeanVar,
    /// Divide by the root mean square.
    Rms,
}

/// One row kernel's shape: `x` seen as `[rows, cols]`, and the WGSL
/// expression (of `row`, `c`) of the feature index that weight and bias
/// are read at.
struct RowNorm {
    x: LazyRef,
    rows: usize,
    cols: usize,
    feature: String,
    weight: Option<LazyRef>,
    bias: Option<LazyRef>,
    stats: Stats,
    eps: f64,
}

pub(super) fn lower(lw: &mut Lowering, node: &Node) -> Result<()> {
    let x = lw.input_view(node, 0)?;
    let (_, out_dtype, _) = lw.output_info(node, 0)?;
    if !out_dtype.is_float() {
        return Err(Error::unsupported(format!(
            "{} needs a floating-point output dtype, got {out_dtype}",
            node.op.name()
        )));
    }
    let rank = x.shape.len();
    match &node.op {
        Op::LayerNorm {
            normalized_dims,
            eps,
        }
        | Op::RmsNorm {
            normalized_dims,
            eps: Some(eps),
        } => {
            let stats = match node.op {
                Op::LayerNorm { .. } => Stats::MeanVar,
                _ => Stats::Rms,
            };
            trailing(lw, node, &x, *normalized_dims, stats, *eps)
        }
        Op::RmsNorm {
            normalized_dims,
            eps: None,
        } => {
            // PyTorch's default is the epsilon of the compute type, f32
            // for every GPU float dtype (as the CPU kernel)
            let eps = f64::from(f32::EPSILON);
            trailing(lw, node, &x, *normalized_dims, Stats::Rms, eps)
        }
        Op::GroupNorm { groups, eps } => {
            if rank < 2 {
                return Err(Error::invalid_input(format!(
                    "group norm input needs a batch and a channel dim, got shape {:?}",
                    x.shape
                )));
            }
            let c = x.shape[1];
            if *groups == 0 || c % groups != 0 {
                return Err(Error::invalid_input(format!(
                    "{c} channels do not split into {groups} groups"
                )));
            }
            let sp: usize = x.shape[2..].iter().product();
            let cg = c / groups;
            let rows = x.shape[0] * groups;
            let cols = cg * sp;
            let flat = Lazy::new(x.dtype, vec![rows, cols], Kind::Reshape(x.clone()));
            let weight = param(lw, node, 1, c)?;
            let bias = param(lw, node, 2, c)?;
            row_norm(
                lw,
                node,
                RowNorm {
                    x: flat,
                    rows,
                    cols,
                    feature: format!("(row % {groups}u) * {cg}u + c / {}u", sp.max(1)),
                    weight,
                    bias,
                    stats: Stats::MeanVar,
                    eps: *eps,
                },
            )
        }
        Op::BatchNorm { eps } => batch_norm(lw, node, x, *eps),
        other => Err(Error::internal(format!(
            "{} is not a normalisation",
            other.name()
        ))),
    }
}

/// Layer or RMS norm over the trailing `nd` dims.
fn trailing(
    lw: &mut Lowering,
    node: &Node,
    x: &LazyRef,
    nd: usize,
    stats: Stats,
    eps: f64,
) -> Result<()> {
    let rank = x.shape.len();
    if nd > rank {
        return Err(Error::invalid_input(format!(
            "normalises {nd} dims of a rank-{rank} input {:?}",
            x.shape
        )));
    }
    let (rows_x, rows, cols) = as_rows(x, &(rank - nd..rank).collect::<Vec<_>>());
    let weight = param(lw, node, 1, cols)?;
    let bias = match stats {
        Stats::MeanVar => param(lw, node, 2, cols)?,
        Stats::Rms => None,
    };
    row_norm(
        lw,
        node,
        RowNorm {
            x: rows_x,
            rows,
            cols,
            feature: "c".into(),
            weight,
            bias,
            stats,
            eps,
        },
    )
}

/// Optional per-feature input `slot`, flattened to `[n]` and checked.
fn param(lw: &mut Lowering, node: &Node, slot: usize, n: usize) -> Result<Option<LazyRef>> {
    let Some(p) = lw.optional_input_view(node, slot)? else {
        return Ok(None);
    };
    let numel: usize = p.shape.iter().product();
    if numel != n {
        return Err(Error::invalid_input(format!(
            "input {slot} has shape {:?}, expected {n} elements",
            p.shape
        )));
    }
    Ok(Some(as_f32(Lazy::new(p.dtype, vec![n], Kind::Reshape(p)))))
}

fn row_norm(lw: &mut Lowering, node: &Node, n: RowNorm) -> Result<()> {
    let out = lw.output_buffer(node, 0)?;
    let out_dtype = lw.buffers.list[out].dtype;
    let cols = n.cols;
    let mut kb = KernelBuilder::new(&lw.buffers);
    kb.value_fn(&as_f32(n.x), "x")?;
    let mut y = "(x(row, c) - mean) * rstd".to_string();
    if let Some(w) = &n.weight {
        kb.value_fn(w, "w")?;
        y = format!("({y}) * w(f)");
    }
    if let Some(b) = &n.bias {
        kb.value_fn(b, "b")?;
        y = format!("({y}) + b(f)");
    }
    let sum = |a: &str, b: &str| format!("({a} + {b})");
    let mut main = shared("red", "f32");
    main.push_str(&entry(ROW_WORKGROUP));
    main.push_str(&row_head(n.rows));
    let n_cols = float_literal(cols.max(1) as f64);
    match n.stats {
        Stats::MeanVar => {
            main.push_str("  var acc = 0.0;\n");
            main.push_str(&col_loop(cols, "    acc = acc + x(row, c);\n"));
            main.push_str(&tree_reduce("red", "acc", "total", &sum));
            main.push_str(&format!(
                "  let mean = total / {n_cols};\n  var sq = 0.0;\n"
            ));
            main.push_str(&col_loop(
                cols,
                "    let d = x(row, c) - mean;\n    sq = sq + d * d;\n",
            ));
        }
        Stats::Rms => {
            main.push_str("  let mean = 0.0;\n  var sq = 0.0;\n");
            main.push_str(&col_loop(
                cols,
                "    let d = x(row, c);\n    sq = sq + d * d;\n",
            ));
        }
    }
    main.push_str(&tree_reduce("red", "sq", "sqs", &sum));
    main.push_str(&format!(
        "  let rstd = 1.0 / sqrt(sqs / {n_cols} + {});\n",
        float_literal(n.eps)
    ));
    let at = format!("row * {cols}u + c");
    let y = cast(&y, DType::F32, out_dtype);
    let store = kb.store(out, &at, &y)?;
    main.push_str(&col_loop(
        cols,
        &format!("    let f = {};\n    {store}\n", n.feature),
    ));
    main.push_str("}\n");
    dispatch_rows_of(lw, kb.finish(&main), n.rows, ROW_WORKGROUP * 4, Some(out))
}

/// `(x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]` as a lazy
/// expression over channel dim 1, computed in f32 and rounded once.
fn batch_norm(lw: &mut Lowering, node: &Node, x: LazyRef, eps: f64) -> Result<()> {
    let (_, out_dtype, shape) = lw.output_info(node, 0)?;
    if shape.len() < 2 {
        return Err(Error::invalid_input(format!(
            "batch norm input needs a batch and a channel dim, got shape {shape:?}"
        )));
    }
    let c = shape[1];
    // [C] → [C, 1, …] → the output's shape
    let channel = |lw: &mut Lowering, slot: usize| -> Result<Option<LazyRef>> {
        let Some(p) = param(lw, node, slot, c)? else {
            return Ok(None);
        };
        let mut col = vec![c];
        col.resize(shape.len() - 1, 1);
        let col = Lazy::new(DType::F32, col, Kind::Reshape(p));
        Ok(Some(Lazy::new(
            DType::F32,
            shape.clone(),
            Kind::Expand(col),
        )))
    };
    let required = |p: Option<LazyRef>, what: &str| {
        p.ok_or_else(|| Error::invalid_input(format!("batch norm needs its {what}")))
    };
    let mean = required(channel(lw, 3)?, "running_mean (input 3)")?;
    let var = required(channel(lw, 4)?, "running_var (input 4)")?;
    let weight = channel(lw, 1)?;
    let bias = channel(lw, 2)?;
    let bin = |op: BinaryOp, a: LazyRef, b: LazyRef| {
        Lazy::new(
            DType::F32,
            shape.clone(),
            Kind::Binary {
                op,
                compute: DType::F32,
                a,
                b,
            },
        )
    };
    let eps = Lazy::new(DType::F32, shape.clone(), Kind::Literal(Scalar::Float(eps)));
    let rstd = Lazy::new(
        DType::F32,
        shape.clone(),
        Kind::Unary(UnaryOp::Rsqrt, bin(BinaryOp::Add, var, eps)),
    );
    let mut y = bin(BinaryOp::Mul, bin(BinaryOp::Sub, as_f32(x), mean), rstd);
    if let Some(w) = weight {
        y = bin(BinaryOp::Mul, y, w);
    }
    if let Some(b) = bias {
        y = bin(BinaryOp::Add, y, b);
    }
    let y = Lazy::new(out_dtype, shape, Kind::Cast(y));
    lw.define(node.outputs[0], y);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::kernels::testing::lower_inputs;

    #[test]
    fn norm_kernels_validate() {
        let f = DType::F32;
        let p = lower_inputs(
            Op::LayerNorm {
                normalized_dims: 2,
                eps: 1e-5,
            },
            &[
                Some((DType::BF16, &[3, 5, 7])),
                Some((DType::BF16, &[5, 7])),
                Some((DType::BF16, &[5, 7])),
            ],
        )
        .unwrap();
        assert_eq!(p.payload.dispatches.len(), 2, "norm + bf16 output write");
        lower_inputs(
            Op::RmsNorm {
                normalized_dims: 1,
                eps: None,
            },
            &[Some((f, &[4, 9])), Some((f, &[9]))],
        )
        .unwrap();
        lower_inputs(
            Op::GroupNorm {
                groups: 2,
                eps: 1e-5,
            },
            &[Some((f, &[2, 4, 3, 3])), None, Some((f, &[4]))],
        )
        .unwrap();
        let e = lower_inputs(
            Op::GroupNorm {
                groups: 3,
                eps: 1e-5,
            },
            &[Some((f, &[2, 4, 3]))],
        );
        assert!(e.is_err());
        // batch norm is an expression: only the output write is a kernel
        let p = lower_inputs(
            Op::BatchNorm { eps: 1e-5 },
            &[
                Some((f, &[2, 3, 4])),
                Some((f, &[3])),
                None,
                Some((f, &[3])),
                Some((f, &[3])),
            ],
        )
        .unwrap();
        assert_eq!(p.payload.dispatches.len(), 1);
    }
}
