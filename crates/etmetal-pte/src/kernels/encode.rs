//! Op → ExecuTorch kernel call: the out-variant ATen kernel of ExecuTorch's
//! portable library for each op, with its schema arguments in order
//! (defaults written out, as EXIR's emitter does), the `out` tensors, then
//! the return again (one `Output`, or an `OutputList` for tuple returns).
//!
//! Ops the portable library has no kernel for (`silu`, `rms_norm`, `sdpa`,
//! general `matmul`, …) are an `Unsupported` error here: the graph pass
//! `etmetal_graph::portable::to_portable` rewrites them first.
//!
//! `outputs` lists every tensor the kernel writes. Where the kernel writes
//! more than the op produces (layer/group/batch norm statistics, max-pool
//! indices) the caller supplies scratch tensors for the extra ones.

use etmetal_core::op_table::{self, Family};
use etmetal_core::{BinaryOp, Error, Op, ReduceOp, Result, Scalar, UnaryOp};

use super::{Call, CallArg, TensorMeta};

pub(super) mod custom;

use CallArg::{Bool, Float, Input, Int, Ints, Null, Output, OutputList};

/// The out-variant kernel call ExecuTorch's portable library runs for `op`.
pub fn encode(op: &Op, inputs: &[Option<TensorMeta>], outputs: &[TensorMeta]) -> Result<Call> {
    encode_op(op, inputs, outputs).map_err(|e| e.context(format!("encoding {}", op.name())))
}

fn call(name: &str, overload: &str, mut args: Vec<CallArg>, n_out: usize) -> Result<Call> {
    args.extend((0..n_out).map(Output));
    if n_out == 1 {
        args.push(Output(0));
    } else {
        args.push(OutputList((0..n_out).collect()));
    }
    Ok(Call {
        name: format!("aten::{name}"),
        overload: overload.into(),
        args,
    })
}

fn unsupported(what: impl std::fmt::Display) -> Error {
    Error::unsupported(format!("no ExecuTorch portable kernel for {what}"))
}

fn ints(v: &[usize]) -> CallArg {
    Ints(v.iter().map(|&d| d as i64).collect())
}

/// An optional tensor slot: the input, or `Null` when absent.
fn opt(inputs: &[Option<TensorMeta>], slot: usize) -> CallArg {
    match inputs.get(slot) {
        Some(Some(_)) => Input(slot),
        _ => CallArg::NoTensor,
    }
}

fn meta(metas: &[Option<TensorMeta>], slot: usize) -> Result<&TensorMeta> {
    metas
        .get(slot)
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::invalid_input(format!("input {slot} is missing")))
}

/// `int[]? dim`: all dims is `None` (an empty list would mean the same to
/// the portable kernels, but EXIR writes what the program said).
fn opt_dims(dims: &[usize]) -> CallArg {
    if dims.is_empty() {
        Null
    } else {
        ints(dims)
    }
}

/// The portable kernel of a unary op without attributes (op table).
fn unary_name(u: &UnaryOp) -> Option<&'static str> {
    op_table::unary_row(*u)?.kernel.map(|k| k.name)
}

/// The portable kernel of a binary op, its overload and the arguments
/// after the two operands: the op table's kernel (with `alpha = 1` where
/// it takes one), or `div.out_mode` with the rounding mode.
fn binary(b: BinaryOp) -> Result<(&'static str, &'static str, Vec<CallArg>)> {
    Ok(match (b, op_table::binary_row(b).kernel) {
        (BinaryOp::FloorDiv, _) => ("div", "out_mode", vec![CallArg::Str("floor".into())]),
        (BinaryOp::TruncDiv, _) => ("div", "out_mode", vec![CallArg::Str("trunc".into())]),
        (_, Some(k)) => {
            let alpha = [CallArg::Scalar(Scalar::Int(1))];
            (
                k.name,
                k.tensor,
                alpha.into_iter().filter(|_| k.alpha).collect(),
            )
        }
        (_, None) => return Err(unsupported(format!("{b:?} (no portable kernel)"))),
    })
}

/// `ScalarType? dtype`: given only where the output dtype differs from the
/// input's (sum of ints, cumsum with dtype=), as the program would say it.
fn dtype_arg(inputs: &[Option<TensorMeta>], outputs: &[TensorMeta]) -> Result<CallArg> {
    let input = meta(inputs, 0)?.0;
    let out = outputs
        .first()
        .ok_or_else(|| Error::invalid_input("no output"))?
        .0;
    Ok(if input == out {
        Null
    } else {
        CallArg::ScalarType(out)
    })
}

fn encode_op(op: &Op, inputs: &[Option<TensorMeta>], outputs: &[TensorMeta]) -> Result<Call> {
    let n_out = kernel_outputs(op);
    if outputs.len() != n_out {
        return Err(Error::invalid_input(format!(
            "the kernel writes {n_out} tensor(s), {} given",
            outputs.len()
        )));
    }
    match op_table::family(op) {
        Family::Elementwise => elementwise(op),
        Family::Reduction => reduction(op, inputs, outputs),
        Family::Layer => layer(op, inputs),
        Family::Layout => layout(op, inputs),
        Family::Custom => custom::encode(op).unwrap_or_else(|| Err(unsupported(op.name()))),
        Family::Delegate => Err(needs_rewrite(op)),
    }
}

/// An op the portable library has no kernel for: `to_portable` rewrites it
/// first.
fn needs_rewrite(op: &Op) -> Error {
    unsupported(format!("{} (rewrite it with to_portable)", op.name()))
}

/// Unary and binary functions, `where`, casts and copies.
fn elementwise(op: &Op) -> Result<Call> {
    let x = Input(0);
    match op {
        Op::Unary(u) => {
            if let Some(name) = unary_name(u) {
                return call(name, "out", vec![x], 1);
            }
            match *u {
                UnaryOp::Gelu { tanh } => {
                    let approximate = if tanh { "tanh" } else { "none" };
                    call("gelu", "out", vec![x, CallArg::Str(approximate.into())], 1)
                }
                UnaryOp::LeakyRelu { slope } => call(
                    "leaky_relu",
                    "out",
                    vec![x, CallArg::Scalar(Scalar::Float(slope))],
                    1,
                ),
                UnaryOp::Clamp { min, max } => {
                    let bound =
                        |b: Option<f64>| b.map_or(Null, |v| CallArg::Scalar(Scalar::Float(v)));
                    call("clamp", "out", vec![x, bound(min), bound(max)], 1)
                }
                UnaryOp::PowScalar { exponent } => call(
                    "pow",
                    "Tensor_Scalar_out",
                    vec![x, CallArg::Scalar(Scalar::Float(exponent))],
                    1,
                ),
                other => Err(unsupported(format!(
                    "{other:?} (rewrite it with to_portable)"
                ))),
            }
        }
        Op::Binary(b) => {
            let (name, overload, extra) = binary(*b)?;
            let mut args = vec![Input(0), Input(1)];
            args.extend(extra);
            call(name, overload, args, 1)
        }
        Op::Where => call("where", "self_out", vec![Input(0), Input(1), Input(2)], 1),
        // dtype comes from the out tensor; non_blocking=False, memory_format=None
        Op::Cast { .. } => call("_to_copy", "out", vec![x, Bool(false), Null], 1),
        Op::Identity => call("clone", "out", vec![x, Null], 1),
        other => Err(needs_rewrite(other)),
    }
}

/// Reductions, arg and indexed reductions, scans, softmax and top-k.
fn reduction(op: &Op, inputs: &[Option<TensorMeta>], outputs: &[TensorMeta]) -> Result<Call> {
    let x = Input(0);
    match op {
        Op::Reduce {
            op: r,
            dims,
            keepdim,
        } => {
            let keep = Bool(*keepdim);
            match r {
                ReduceOp::Sum | ReduceOp::Mean => {
                    let name = if *r == ReduceOp::Sum { "sum" } else { "mean" };
                    let overload = if *r == ReduceOp::Sum {
                        "IntList_out"
                    } else {
                        "out"
                    };
                    let dtype = dtype_arg(inputs, outputs)?;
                    call(name, overload, vec![x, opt_dims(dims), keep, dtype], 1)
                }
                ReduceOp::Max | ReduceOp::Min => {
                    let name = if *r == ReduceOp::Max { "amax" } else { "amin" };
                    call(name, "out", vec![x, ints(dims), keep], 1)
                }
                ReduceOp::Prod => match dims.as_slice() {
                    [d] => {
                        let dtype = dtype_arg(inputs, outputs)?;
                        call("prod", "int_out", vec![x, Int(*d as i64), keep, dtype], 1)
                    }
                    [] if !keepdim => call("prod", "out", vec![x, dtype_arg(inputs, outputs)?], 1),
                    _ => Err(unsupported(format!(
                        "prod over dims {dims:?} keepdim={keepdim}"
                    ))),
                },
                ReduceOp::Any => call("any", "dims_out", vec![x, opt_dims(dims), keep], 1),
                ReduceOp::All => Err(unsupported("all (rewrite it with to_portable)")),
            }
        }
        Op::Var {
            dims,
            correction,
            keepdim,
        } => call(
            "var",
            "correction_out",
            vec![
                x,
                opt_dims(dims),
                CallArg::Scalar(Scalar::Float(*correction)),
                Bool(*keepdim),
            ],
            1,
        ),
        Op::ArgReduce { max, dim, keepdim } => {
            let name = if *max { "argmax" } else { "argmin" };
            let dim = dim.map_or(Null, |d| Int(d as i64));
            call(name, "out", vec![x, dim, Bool(*keepdim)], 1)
        }
        Op::ReduceWithIndices { max, dim, keepdim } => {
            let (name, overload) = if *max {
                ("max", "dim_max")
            } else {
                ("min", "dim_min")
            };
            call(name, overload, vec![x, Int(*dim as i64), Bool(*keepdim)], 2)
        }
        Op::CumSum { dim } => {
            let dtype = dtype_arg(inputs, outputs)?;
            call("cumsum", "out", vec![x, Int(*dim as i64), dtype], 1)
        }
        Op::Softmax { dim, log } => {
            let name = if *log { "_log_softmax" } else { "_softmax" };
            call(name, "out", vec![x, Int(*dim as i64), Bool(false)], 1)
        }
        Op::TopK {
            k,
            dim,
            largest,
            sorted,
        } => call(
            "topk",
            "values",
            vec![
                x,
                Int(*k as i64),
                Int(*dim as i64),
                Bool(*largest),
                Bool(*sorted),
            ],
            2,
        ),
        other => Err(needs_rewrite(other)),
    }
}

/// Norms, matrix products, convolution and pooling.
fn layer(op: &Op, inputs: &[Option<TensorMeta>]) -> Result<Call> {
    let x = Input(0);
    match op {
        Op::LayerNorm {
            normalized_dims,
            eps,
        } => {
            let shape = &meta(inputs, 0)?.1;
            let lead = shape.len().checked_sub(*normalized_dims).ok_or_else(|| {
                Error::shape(format!(
                    "{normalized_dims} normalized dims of a {shape:?} input"
                ))
            })?;
            let args = vec![
                x,
                ints(&shape[lead..]),
                opt(inputs, 1),
                opt(inputs, 2),
                Float(*eps),
            ];
            call("native_layer_norm", "out", args, 3)
        }
        Op::GroupNorm { groups, eps } => {
            let shape = &meta(inputs, 0)?.1;
            let (&n, &c) = match shape.as_slice() {
                [n, c, ..] => (n, c),
                _ => return Err(Error::shape(format!("group norm of a {shape:?} input"))),
            };
            let hxw: usize = shape[2..].iter().product();
            let args = vec![
                x,
                opt(inputs, 1),
                opt(inputs, 2),
                Int(n as i64),
                Int(c as i64),
                Int(hxw as i64),
                Int(*groups as i64),
                Float(*eps),
            ];
            call("native_group_norm", "out", args, 3)
        }
        Op::BatchNorm { eps } => {
            // momentum is unused in inference; EXIR writes the module's 0.1
            let args = vec![
                x,
                opt(inputs, 1),
                opt(inputs, 2),
                Input(3),
                Input(4),
                Float(0.1),
                Float(*eps),
            ];
            call("_native_batch_norm_legit_no_training", "out", args, 3)
        }
        Op::MatMul => {
            let (a, b) = (meta(inputs, 0)?, meta(inputs, 1)?);
            match (a.1.len(), b.1.len()) {
                (2, 2) => call("mm", "out", vec![Input(0), Input(1)], 1),
                (3, 3) if a.1[0] == b.1[0] => call("bmm", "out", vec![Input(0), Input(1)], 1),
                _ => Err(unsupported(format!(
                    "matmul of {:?} and {:?} (rewrite it with to_portable)",
                    a.1, b.1
                ))),
            }
        }
        Op::Addmm { beta, alpha } => {
            let s = |v: f64| CallArg::Scalar(Scalar::Float(v));
            call(
                "addmm",
                "out",
                vec![Input(0), Input(1), Input(2), s(*beta), s(*alpha)],
                1,
            )
        }
        Op::Convolution(c) => {
            let args = vec![
                x,
                Input(1),
                opt(inputs, 2),
                ints(&c.stride),
                ints(&c.padding),
                ints(&c.dilation),
                Bool(c.transposed),
                ints(&c.output_padding),
                Int(c.groups as i64),
            ];
            call("convolution", "out", args, 1)
        }
        Op::MaxPool(p) => {
            if p.spatial_rank() != 2 {
                return Err(unsupported(format!("{}-D max pooling", p.spatial_rank())));
            }
            let args = vec![
                x,
                ints(&p.kernel),
                ints(&p.stride),
                ints(&p.padding),
                ints(&p.dilation),
                Bool(p.ceil_mode),
            ];
            call("max_pool2d_with_indices", "out", args, 2)
        }
        Op::AvgPool(p) => {
            if p.spatial_rank() != 2 {
                return Err(unsupported(format!(
                    "{}-D average pooling",
                    p.spatial_rank()
                )));
            }
            let args = vec![
                x,
                ints(&p.kernel),
                ints(&p.stride),
                ints(&p.padding),
                Bool(p.ceil_mode),
                Bool(p.count_include_pad),
                p.divisor_override.map_or(Null, Int),
            ];
            call("avg_pool2d", "out", args, 1)
        }
        Op::AdaptiveAvgPool { output_size } => {
            if output_size.len() != 2 {
                return Err(unsupported(format!(
                    "{}-D adaptive pooling",
                    output_size.len()
                )));
            }
            call("_adaptive_avg_pool2d", "out", vec![x, ints(output_size)], 1)
        }
        other => Err(needs_rewrite(other)),
    }
}

/// Views and layout, gathers by index, `tril`, `full` and `arange`.
fn layout(op: &Op, inputs: &[Option<TensorMeta>]) -> Result<Call> {
    let x = Input(0);
    match op {
        Op::Embedding => {
            // padding_idx only matters for gradients
            call(
                "embedding",
                "out",
                vec![x, Input(1), Int(-1), Bool(false), Bool(false)],
                1,
            )
        }
        Op::Reshape { shape } => call("view_copy", "out", vec![x, ints(shape)], 1),
        Op::Permute { dims } => call("permute_copy", "out", vec![x, ints(dims)], 1),
        Op::Expand { shape } => call("expand_copy", "out", vec![x, ints(shape), Bool(false)], 1),
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => {
            let i = |v: usize| Int(v as i64);
            call(
                "slice_copy",
                "Tensor_out",
                vec![x, i(*dim), i(*start), i(*end), i(*step)],
                1,
            )
        }
        Op::Select { dim, index } => call(
            "select_copy",
            "int_out",
            vec![x, Int(*dim as i64), Int(*index as i64)],
            1,
        ),
        Op::Cat { dim } => {
            let all = (0..inputs.len()).collect();
            call(
                "cat",
                "out",
                vec![CallArg::InputList(all), Int(*dim as i64)],
                1,
            )
        }
        Op::ConstantPad { pad, value } => {
            let args = vec![x, Ints(pad.clone()), CallArg::Scalar(Scalar::Float(*value))];
            call("constant_pad_nd", "out", args, 1)
        }
        Op::IndexSelect { dim } => call(
            "index_select",
            "out",
            vec![x, Int(*dim as i64), Input(1)],
            1,
        ),
        Op::Gather { dim } => call(
            "gather",
            "out",
            vec![x, Int(*dim as i64), Input(1), Bool(false)],
            1,
        ),
        Op::Index => {
            let slots = (1..inputs.len())
                .map(|i| inputs[i].as_ref().map(|_| i))
                .collect();
            call(
                "index",
                "Tensor_out",
                vec![x, CallArg::OptionalInputList(slots)],
                1,
            )
        }
        Op::Triangle {
            upper: false,
            diagonal,
        } => call("tril", "out", vec![x, Int(*diagonal)], 1),
        Op::Repeat { repeats } => call("repeat", "out", vec![x, ints(repeats)], 1),
        // the dtype is the out tensor's
        Op::Full { shape, value, .. } => {
            call("full", "out", vec![ints(shape), CallArg::Scalar(*value)], 1)
        }
        Op::Arange {
            start, end, step, ..
        } => {
            let s = |v: &Scalar| CallArg::Scalar(*v);
            call("arange", "start_out", vec![s(start), s(end), s(step)], 1)
        }
        other => Err(needs_rewrite(other)),
    }
}

/// How many tensors the kernel for `op` writes: the op's outputs plus the
/// statistics and indices ExecuTorch's kernels always produce.
pub fn kernel_outputs(op: &Op) -> usize {
    match op {
        Op::LayerNorm { .. } | Op::GroupNorm { .. } | Op::BatchNorm { .. } => 3,
        Op::ReduceWithIndices { .. } | Op::TopK { .. } | Op::MaxPool(_) => 2,
        Op::GatedDeltaRule => 2,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::{ConvAttrs, DType};
    use CallArg::{InputList, NoTensor, OptionalInputList, ScalarType, Str};

    fn t(shape: &[usize]) -> Option<TensorMeta> {
        Some((DType::F32, shape.to_vec()))
    }

    fn enc(op: Op, inputs: &[Option<TensorMeta>], n_out: usize) -> Call {
        let outs = vec![(DType::F32, vec![2, 3]); n_out];
        encode(&op, inputs, &outs).unwrap()
    }

    fn check(c: &Call, name: &str, overload: &str, args: Vec<CallArg>) {
        assert_eq!((c.name.as_str(), c.overload.as_str()), (name, overload));
        assert_eq!(c.args, args, "{name}.{overload}");
    }

    #[test]
    fn elementwise() {
        let two = [t(&[2, 3]), t(&[])];
        let c = enc(Op::Binary(BinaryOp::Add), &two, 1);
        check(
            &c,
            "aten::add",
            "out",
            vec![
                Input(0),
                Input(1),
                CallArg::Scalar(Scalar::Int(1)),
                Output(0),
                Output(0),
            ],
        );
        let c = enc(Op::Binary(BinaryOp::Lt), &two, 1);
        check(
            &c,
            "aten::lt",
            "Tensor_out",
            vec![Input(0), Input(1), Output(0), Output(0)],
        );
        let c = enc(Op::Binary(BinaryOp::FloorDiv), &two, 1);
        check(
            &c,
            "aten::div",
            "out_mode",
            vec![
                Input(0),
                Input(1),
                Str("floor".into()),
                Output(0),
                Output(0),
            ],
        );
        let c = enc(Op::Unary(UnaryOp::Gelu { tanh: true }), &two[..1], 1);
        check(
            &c,
            "aten::gelu",
            "out",
            vec![Input(0), Str("tanh".into()), Output(0), Output(0)],
        );
        let c = enc(
            Op::Unary(UnaryOp::Clamp {
                min: None,
                max: Some(6.0),
            }),
            &two[..1],
            1,
        );
        check(
            &c,
            "aten::clamp",
            "out",
            vec![
                Input(0),
                Null,
                CallArg::Scalar(Scalar::Float(6.0)),
                Output(0),
                Output(0),
            ],
        );
        let c = enc(Op::Where, &[t(&[2, 3]), t(&[2, 3]), t(&[])], 1);
        check(
            &c,
            "aten::where",
            "self_out",
            vec![Input(0), Input(1), Input(2), Output(0), Output(0)],
        );
        let c = enc(Op::Cast { dtype: DType::I64 }, &two[..1], 1);
        check(
            &c,
            "aten::_to_copy",
            "out",
            vec![Input(0), Bool(false), Null, Output(0), Output(0)],
        );
        assert!(encode(
            &Op::Unary(UnaryOp::Silu),
            &two[..1],
            &[(DType::F32, vec![2, 3])]
        )
        .is_err());
    }

    #[test]
    fn reductions_and_multi_output() {
        let x = [t(&[2, 3])];
        let c = enc(
            Op::Reduce {
                op: ReduceOp::Sum,
                dims: vec![1],
                keepdim: true,
            },
            &x,
            1,
        );
        check(
            &c,
            "aten::sum",
            "IntList_out",
            vec![
                Input(0),
                Ints(vec![1]),
                Bool(true),
                Null,
                Output(0),
                Output(0),
            ],
        );
        // int64 sum of a bool tensor names its dtype
        let b = [Some((DType::Bool, vec![2, 3]))];
        let sum = Op::Reduce {
            op: ReduceOp::Sum,
            dims: vec![],
            keepdim: false,
        };
        let c = encode(&sum, &b, &[(DType::I64, vec![])]).unwrap();
        assert_eq!(c.args[3], ScalarType(DType::I64));
        assert_eq!(c.args[1], Null);
        let c = enc(
            Op::ReduceWithIndices {
                max: true,
                dim: 1,
                keepdim: false,
            },
            &x,
            2,
        );
        check(
            &c,
            "aten::max",
            "dim_max",
            vec![
                Input(0),
                Int(1),
                Bool(false),
                Output(0),
                Output(1),
                OutputList(vec![0, 1]),
            ],
        );
        let c = enc(
            Op::LayerNorm {
                normalized_dims: 1,
                eps: 1e-5,
            },
            &[t(&[2, 3]), t(&[3]), None],
            3,
        );
        check(
            &c,
            "aten::native_layer_norm",
            "out",
            vec![
                Input(0),
                Ints(vec![3]),
                Input(1),
                NoTensor,
                Float(1e-5),
                Output(0),
                Output(1),
                Output(2),
                OutputList(vec![0, 1, 2]),
            ],
        );
        // as EXIR 1.5.1 emits it: momentum 0.1, three outs, then the tuple
        let bn = Op::BatchNorm { eps: 1e-5 };
        let c = enc(bn, &[t(&[2, 3, 4]), t(&[3]), t(&[3]), t(&[3]), t(&[3])], 3);
        check(
            &c,
            "aten::_native_batch_norm_legit_no_training",
            "out",
            vec![
                Input(0),
                Input(1),
                Input(2),
                Input(3),
                Input(4),
                Float(0.1),
                Float(1e-5),
                Output(0),
                Output(1),
                Output(2),
                OutputList(vec![0, 1, 2]),
            ],
        );
        // the statistics outputs must be supplied
        let ln = Op::LayerNorm {
            normalized_dims: 1,
            eps: 1e-5,
        };
        assert!(encode(&ln, &x, &[(DType::F32, vec![2, 3])]).is_err());
        let c = enc(
            Op::TopK {
                k: 2,
                dim: 1,
                largest: true,
                sorted: true,
            },
            &x,
            2,
        );
        check(
            &c,
            "aten::topk",
            "values",
            vec![
                Input(0),
                Int(2),
                Int(1),
                Bool(true),
                Bool(true),
                Output(0),
                Output(1),
                OutputList(vec![0, 1]),
            ],
        );
    }

    #[test]
    fn linear_algebra_and_layout() {
        let c = enc(Op::MatMul, &[t(&[2, 4]), t(&[4, 3])], 1);
        check(
            &c,
            "aten::mm",
            "out",
            vec![Input(0), Input(1), Output(0), Output(0)],
        );
        let c = enc(Op::MatMul, &[t(&[5, 2, 4]), t(&[5, 4, 3])], 1);
        assert_eq!((c.name.as_str(), c.overload.as_str()), ("aten::bmm", "out"));
        assert!(encode(
            &Op::MatMul,
            &[t(&[5, 2, 4]), t(&[4, 3])],
            &[(DType::F32, vec![5, 2, 3])]
        )
        .is_err());
        let c = enc(Op::Reshape { shape: vec![3, 2] }, &[t(&[2, 3])], 1);
        check(
            &c,
            "aten::view_copy",
            "out",
            vec![Input(0), Ints(vec![3, 2]), Output(0), Output(0)],
        );
        let c = enc(
            Op::Slice {
                dim: 1,
                start: 0,
                end: 2,
                step: 1,
            },
            &[t(&[2, 3])],
            1,
        );
        check(
            &c,
            "aten::slice_copy",
            "Tensor_out",
            vec![
                Input(0),
                Int(1),
                Int(0),
                Int(2),
                Int(1),
                Output(0),
                Output(0),
            ],
        );
        let c = enc(Op::Select { dim: 0, index: 1 }, &[t(&[2, 3])], 1);
        check(
            &c,
            "aten::select_copy",
            "int_out",
            vec![Input(0), Int(0), Int(1), Output(0), Output(0)],
        );
        let c = enc(Op::Cat { dim: 1 }, &[t(&[2, 1]), t(&[2, 2])], 1);
        check(
            &c,
            "aten::cat",
            "out",
            vec![InputList(vec![0, 1]), Int(1), Output(0), Output(0)],
        );
        let c = enc(
            Op::Index,
            &[t(&[2, 3]), None, Some((DType::I64, vec![2]))],
            1,
        );
        check(
            &c,
            "aten::index",
            "Tensor_out",
            vec![
                Input(0),
                OptionalInputList(vec![None, Some(2)]),
                Output(0),
                Output(0),
            ],
        );
        let conv = Op::Convolution(ConvAttrs {
            stride: vec![1, 1],
            padding: vec![0, 0],
            dilation: vec![1, 1],
            transposed: false,
            output_padding: vec![0, 0],
            groups: 1,
        });
        let c = enc(conv, &[t(&[1, 2, 4, 4]), t(&[3, 2, 3, 3]), None], 1);
        check(
            &c,
            "aten::convolution",
            "out",
            vec![
                Input(0),
                Input(1),
                NoTensor,
                Ints(vec![1, 1]),
                Ints(vec![0, 0]),
                Ints(vec![1, 1]),
                Bool(false),
                Ints(vec![0, 0]),
                Int(1),
                Output(0),
                Output(0),
            ],
        );
        let full = Op::Full {
            shape: vec![2, 3],
            value: Scalar::Float(1.5),
            dtype: DType::F32,
        };
        check(
            &enc(full, &[], 1),
            "aten::full",
            "out",
            vec![
                Ints(vec![2, 3]),
                CallArg::Scalar(Scalar::Float(1.5)),
                Output(0),
                Output(0),
            ],
        );
        assert!(encode(
            &Op::Linear,
            &[t(&[2, 3]), t(&[4, 3])],
            &[(DType::F32, vec![2, 4])]
        )
        .is_err());
    }
}
