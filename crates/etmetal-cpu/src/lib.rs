//! CPU kernels for every [`Op`], with PyTorch semantics.
//!
//! [`execute`] is the reference entry point: it checks the input slots, runs
//! the op's kernel and checks the computed output shapes and dtypes against
//! what the graph expects. Kernels are grouped by family, one module each;
//! they share the dtype domains of [`buf`] and the strided walk of
//! [`strided`].
//!
//! [`execute_into`] runs the ops its [`fast`] paths take on borrowed memory
//! (a runtime's planned arenas), reading the inputs and writing the outputs
//! in place; the caller runs the others with [`execute`].

mod attention;
mod buf;
mod conv;
mod create;
mod ctx;
mod elementwise;
mod fast;
mod index;
mod int4;
mod layout;
mod matmul;
mod norm;
mod pool;
mod reduce;
mod simd;
mod strided;
mod view;

use ctx::Ctx;
use etmetal_core::{DType, Error, Op, Result, Tensor};
pub use view::{View, ViewMut};

/// Run one op. `inputs` are the op's input slots (None = absent optional),
/// `outputs` the dtype and shape the graph expects for each output.
///
/// The kernel computes each output's shape itself; a disagreement with
/// `outputs` is an `Error::shape` naming the op, the expected and the computed
/// shape. Where PyTorch promotes (sums of ints, `sqrt` of ints, comparisons)
/// the output dtype is taken from `outputs`.
pub fn execute(
    op: &Op,
    inputs: &[Option<&Tensor>],
    outputs: &[(DType, Vec<usize>)],
) -> Result<Vec<Tensor>> {
    execute_bounded(op, inputs, outputs, &[])
}

/// [`execute`] where `bounded[i]` marks output `i`'s expected shape as an
/// upper bound (a dynamic tensor planned at its largest): its computed
/// shape must have the same rank and no dim above the bound. Outputs
/// beyond `bounded` are exact.
pub fn execute_bounded(
    op: &Op,
    inputs: &[Option<&Tensor>],
    outputs: &[(DType, Vec<usize>)],
    bounded: &[bool],
) -> Result<Vec<Tensor>> {
    let ctx = Ctx {
        op,
        inputs,
        outputs,
    };
    let results = dispatch(&ctx)?;
    if results.len() != outputs.len() {
        return Err(Error::shape(format!(
            "{}: the graph expects {} outputs but the op produces {}",
            op.name(),
            outputs.len(),
            results.len()
        )));
    }
    for (i, (t, (dtype, shape))) in results.iter().zip(outputs).enumerate() {
        let got = t.shape();
        if bounded.get(i).copied().unwrap_or(false) {
            if got.len() != shape.len() || got.iter().zip(shape).any(|(g, b)| g > b) {
                return Err(Error::shape(format!(
                    "{}: output {i} computed shape {got:?}, outside its upper bound {shape:?}",
                    op.name()
                )));
            }
        } else if got != shape.as_slice() {
            return Err(Error::shape(format!(
                "{}: output {i} expected shape {shape:?}, computed {got:?}",
                op.name()
            )));
        }
        if t.dtype() != *dtype {
            return Err(Error::shape(format!(
                "{}: output {i} expected dtype {dtype}, computed {}",
                op.name(),
                t.dtype()
            )));
        }
    }
    Ok(results)
}

/// Run one op on borrowed memory if a fast path takes it: `inputs` are the
/// op's input slots, each output view has the dtype and shape the graph
/// expects, and outputs must not overlap inputs or each other. `Ok(false)`
/// when no fast path takes the op, with nothing written: run [`execute`].
pub fn execute_into(op: &Op, inputs: &[Option<View>], outputs: &mut [ViewMut]) -> Result<bool> {
    let ins = inputs
        .iter()
        .flatten()
        .map(|x| (x.dtype, x.shape, x.bytes.len()));
    let outs = outputs.iter().map(|y| (y.dtype, y.shape, y.bytes.len()));
    for (i, (dtype, shape, len)) in ins.chain(outs).enumerate() {
        view::check_len(dtype, shape, len, &format!("{} operand {i}", op.name()))?;
    }
    Ok(fast::run(op, inputs, outputs))
}

pub use fast::output_shape;

fn dispatch(ctx: &Ctx) -> Result<Vec<Tensor>> {
    let one = |t: Tensor| Ok(vec![t]);
    match ctx.op {
        Op::Unary(u) => {
            ctx.arity(1, 1)?;
            one(elementwise::unary(ctx, *u)?)
        }
        Op::Binary(b) => {
            ctx.arity(2, 2)?;
            one(elementwise::binary(ctx, *b)?)
        }
        Op::Where => {
            ctx.arity(3, 3)?;
            one(elementwise::where_(ctx)?)
        }
        Op::Cast { dtype } => {
            ctx.arity(1, 1)?;
            one(ctx.input(0)?.cast(*dtype)?)
        }
        Op::Identity => {
            ctx.arity(1, 1)?;
            one(ctx.input(0)?.clone())
        }
        Op::Reduce { op, dims, keepdim } => {
            ctx.arity(1, 1)?;
            one(reduce::reduce(ctx, *op, dims, *keepdim)?)
        }
        Op::Var {
            dims,
            correction,
            keepdim,
        } => {
            ctx.arity(1, 1)?;
            one(reduce::var(ctx, dims, *correction, *keepdim)?)
        }
        Op::ArgReduce { max, dim, keepdim } => {
            ctx.arity(1, 1)?;
            one(reduce::arg_reduce(ctx, *max, *dim, *keepdim)?)
        }
        Op::ReduceWithIndices { max, dim, keepdim } => {
            ctx.arity(1, 1)?;
            reduce::reduce_with_indices(ctx, *max, *dim, *keepdim)
        }
        Op::CumSum { dim } => {
            ctx.arity(1, 1)?;
            one(reduce::cumsum(ctx, *dim)?)
        }
        Op::Softmax { dim, log } => {
            ctx.arity(1, 1)?;
            one(reduce::softmax(ctx, *dim, *log)?)
        }
        Op::Int4Linear { .. } | Op::Int8Linear { .. } => {
            ctx.arity(4, 4)?;
            let format = etmetal_core::quant::QuantFormat::of_linear(ctx.op)
                .ok_or_else(|| Error::internal("not a quantized linear"))?;
            one(int4::quant_linear(ctx, format)?)
        }
        Op::GatherQmv { group_size } => {
            ctx.arity(5, 5)?;
            one(int4::gather_qmv(ctx, *group_size)?)
        }
        Op::GatedDeltaRule => {
            ctx.arity(6, 6)?;
            int4::gated_delta_rule(ctx)
        }
        Op::TopK {
            k,
            dim,
            largest,
            sorted: _,
        } => {
            // Unsorted top-k order is unspecified in PyTorch; sorted is a valid answer.
            ctx.arity(1, 1)?;
            reduce::topk(ctx, *k, *dim, *largest)
        }
        Op::LayerNorm {
            normalized_dims,
            eps,
        } => {
            ctx.arity(1, 3)?;
            one(norm::layer_norm(ctx, *normalized_dims, *eps)?)
        }
        Op::RmsNorm {
            normalized_dims,
            eps,
        } => {
            ctx.arity(1, 2)?;
            one(norm::rms_norm(ctx, *normalized_dims, *eps)?)
        }
        Op::BatchNorm { eps } => {
            ctx.arity(5, 5)?;
            one(norm::batch_norm(ctx, *eps)?)
        }
        Op::GroupNorm { groups, eps } => {
            ctx.arity(1, 3)?;
            one(norm::group_norm(ctx, *groups, *eps)?)
        }
        Op::MatMul => {
            ctx.arity(2, 2)?;
            one(matmul::matmul(ctx)?)
        }
        Op::Addmm { beta, alpha } => {
            ctx.arity(3, 3)?;
            one(matmul::addmm(ctx, *beta, *alpha)?)
        }
        Op::Linear => {
            ctx.arity(2, 3)?;
            one(matmul::linear(ctx)?)
        }
        Op::Convolution(p) => {
            ctx.arity(2, 3)?;
            one(conv::convolution(ctx, p)?)
        }
        Op::MaxPool(p) => {
            ctx.arity(1, 1)?;
            pool::max_pool(ctx, p)
        }
        Op::AvgPool(p) => {
            ctx.arity(1, 1)?;
            one(pool::avg_pool(ctx, p)?)
        }
        Op::AdaptiveAvgPool { output_size } => {
            ctx.arity(1, 1)?;
            one(pool::adaptive_avg_pool(ctx, output_size)?)
        }
        Op::Sdpa {
            is_causal,
            scale,
            enable_gqa,
        } => {
            ctx.arity(3, 4)?;
            one(attention::sdpa(ctx, *is_causal, *scale, *enable_gqa)?)
        }
        Op::Embedding => {
            ctx.arity(2, 2)?;
            one(index::embedding(ctx)?)
        }
        Op::Reshape { shape } => {
            ctx.arity(1, 1)?;
            one(layout::reshape(ctx, shape)?)
        }
        Op::Permute { .. } | Op::Expand { .. } | Op::Slice { .. } | Op::Select { .. } => {
            ctx.arity(1, 1)?;
            one(layout::view(ctx)?)
        }
        Op::Cat { dim } => {
            ctx.arity(1, usize::MAX)?;
            one(layout::cat(ctx, *dim)?)
        }
        Op::ConstantPad { pad, value } => {
            ctx.arity(1, 1)?;
            one(layout::constant_pad(ctx, pad, *value)?)
        }
        Op::IndexSelect { dim } => {
            ctx.arity(2, 2)?;
            one(index::index_select(ctx, *dim)?)
        }
        Op::Gather { dim } => {
            ctx.arity(2, 2)?;
            one(index::gather(ctx, *dim)?)
        }
        Op::IndexCopy { dim } => {
            ctx.arity(3, 3)?;
            one(index::index_copy(ctx, *dim)?)
        }
        Op::Index => {
            ctx.arity(1, usize::MAX)?;
            one(index::index(ctx)?)
        }
        Op::Triangle { upper, diagonal } => {
            ctx.arity(1, 1)?;
            one(layout::triangle(ctx, *upper, *diagonal)?)
        }
        Op::Repeat { repeats } => {
            ctx.arity(1, 1)?;
            one(layout::repeat(ctx, repeats)?)
        }
        Op::Full {
            shape,
            value,
            dtype,
        } => {
            ctx.arity(0, 0)?;
            one(create::full(shape, *value, *dtype)?)
        }
        Op::Arange {
            start,
            end,
            step,
            dtype,
        } => {
            ctx.arity(0, 0)?;
            one(create::arange(*start, *end, *step, *dtype)?)
        }
        Op::Delegate { index } => Err(Error::unsupported(format!(
            "delegate call {index} is run by its backend, not by a CPU kernel"
        ))),
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    pub fn f32t(shape: &[usize], v: &[f32]) -> Tensor {
        Tensor::from_f32(DType::F32, shape, v).unwrap()
    }
    pub fn i64t(shape: &[usize], v: &[i64]) -> Tensor {
        Tensor::from_i64(DType::I64, shape, v).unwrap()
    }
    /// Run `op` on present inputs, expecting one output of `dtype`/`shape`.
    pub fn run1(op: Op, inputs: &[&Tensor], dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let slots: Vec<Option<&Tensor>> = inputs.iter().map(|t| Some(*t)).collect();
        Ok(execute(&op, &slots, &[(dtype, shape.to_vec())])?.remove(0))
    }
    /// The test inputs the PyTorch references were computed on:
    /// `((i * mul) % m) / 4 - 1` (exact in every float type).
    pub fn ramp(n: usize, m: usize, mul: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * mul) % m) as f32 / 4.0 - 1.0).collect()
    }
    /// Reference `a[m×k] @ b[k×n]` (row-major) in f64.
    pub fn naive_mm(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        (0..m * n)
            .map(|ij| {
                (0..k)
                    .map(|p| a[ij / n * k + p] as f64 * b[p * n + ij % n] as f64)
                    .sum::<f64>() as f32
            })
            .collect()
    }
    pub fn close(got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "length: got {got:?}, want {want:?}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let ok = (g - w).abs() <= tol * (1.0 + w.abs()) || (g.is_nan() && w.is_nan());
            assert!(
                ok,
                "element {i}: got {g}, want {w} (got {got:?}, want {want:?})"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::*;
    use super::*;
    use etmetal_core::ErrorKind;

    #[test]
    fn output_shape_and_dtype_are_checked() {
        let x = f32t(&[2], &[1.0, 2.0]);
        let e = run1(Op::Identity, &[&x], DType::F32, &[3]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shape);
        assert!(
            e.to_string().contains("[3]") && e.to_string().contains("[2]"),
            "{e}"
        );
        let e = run1(Op::Identity, &[&x], DType::I64, &[2]).unwrap_err();
        assert!(e.to_string().contains("int64"), "{e}");
    }

    #[test]
    fn bounded_outputs_take_any_shape_within_the_bound() {
        let x = f32t(&[2, 3], &[1.0; 6]);
        let bound = [(DType::F32, vec![4, 3])];
        let out = execute_bounded(&Op::Identity, &[Some(&x)], &bound, &[true]).unwrap();
        assert_eq!(out[0].shape(), &[2, 3]);
        let e = execute_bounded(
            &Op::Identity,
            &[Some(&x)],
            &[(DType::F32, vec![4, 2])],
            &[true],
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Shape);
        assert!(
            e.to_string()
                .contains("output 0 computed shape [2, 3], outside its upper bound [4, 2]"),
            "{e}"
        );
        // not bounded: exact
        assert!(execute_bounded(&Op::Identity, &[Some(&x)], &bound, &[false]).is_err());
        // the shapes the fast paths are sized with
        let add = Op::Binary(etmetal_core::BinaryOp::Add);
        assert_eq!(
            output_shape(&add, &[Some(&[2, 3]), Some(&[2, 1])]),
            Some(vec![2, 3])
        );
        assert_eq!(output_shape(&add, &[Some(&[2, 3]), Some(&[3, 1])]), None);
        assert_eq!(
            output_shape(&Op::MatMul, &[Some(&[5, 3]), Some(&[3, 7])]),
            Some(vec![5, 7])
        );
    }

    #[test]
    fn missing_and_extra_slots_are_errors() {
        let x = f32t(&[2], &[1.0, 2.0]);
        let e = execute(&Op::MatMul, &[Some(&x), None], &[(DType::F32, vec![])]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert!(e.to_string().contains("slot 1"), "{e}");
        let e = execute(
            &Op::Identity,
            &[Some(&x), Some(&x)],
            &[(DType::F32, vec![2])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("expected 1 input"), "{e}");
    }

    #[test]
    fn cast_truncates_and_tests_nonzero() {
        let x = f32t(&[4], &[-1.7, 2.9, 0.0, 0.25]);
        let i = run1(Op::Cast { dtype: DType::I32 }, &[&x], DType::I32, &[4]).unwrap();
        assert_eq!(i.to_i64_vec(), vec![-1, 2, 0, 0]);
        let b = run1(Op::Cast { dtype: DType::Bool }, &[&x], DType::Bool, &[4]).unwrap();
        assert_eq!(b.to_i64_vec(), vec![1, 1, 0, 1]);
        let f = execute(
            &Op::Full {
                shape: vec![2],
                value: etmetal_core::Scalar::Float(2.5),
                dtype: DType::F16,
            },
            &[],
            &[(DType::F16, vec![2])],
        )
        .unwrap();
        assert_eq!(f[0].to_f32_vec(), vec![2.5, 2.5]);
    }
}
