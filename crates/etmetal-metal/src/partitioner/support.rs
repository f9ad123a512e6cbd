//! The operator-support check of the Metal backend: which nodes its GPU
//! kernels take. Which op kinds have a GPU form at all is the op table
//! (`crate::op_table`, shared with preprocess); this module adds the
//! conditions on attributes, dtypes and sizes. What is refused stays on
//! the CPU, so every refusal carries a reason for `inspect` and for
//! `--partition whole` errors.
//!
//! The table is what the first GPU kernels implement: pointwise and
//! broadcast ops, reductions, softmax, norms, matmul/linear/addmm,
//! 1-D/2-D convolution and pooling, SDPA, layout ops, embedding and
//! gathers, where, full/arange and casts. Floats are computed in f32, bf16
//! or f16. WGSL has no 64-bit integers, so int64 values are narrowed to
//! i32 where they enter the GPU (inputs checked at each execute, weights
//! and constants at compile: those beyond i32 stay on the CPU); moves,
//! comparisons, min/max, where, casts and indexing are exact on them, and
//! arithmetic (add, sub, mul, neg, abs, division, sum, prod, cumsum) runs
//! in i32 with a check per operation that fails the execute on a result
//! beyond i32 instead of wrapping.

use etmetal_core::op_table::{self, Family};
use etmetal_core::{BinaryOp, DType, Op, ReduceOp, Scalar, UnaryOp};
use etmetal_graph::{Graph, Node, ValueInfo};

/// Device limits a node must fit. The defaults are wgpu's default limits,
/// which every Metal, Vulkan and DX12 adapter meets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest value, in bytes as the delegate holds it
    /// ([`crate::payload::value_gpu_bytes`]; wgpu's
    /// `max_storage_buffer_binding_size`).
    pub max_buffer_bytes: u64,
    /// Largest rank the kernels' shape parameters hold.
    pub max_rank: usize,
    /// Largest `k` of top-k (kept in one workgroup's registers).
    pub max_topk: usize,
    /// Largest head dim of attention (one row of q in workgroup memory).
    pub max_head_dim: usize,
}

impl Default for DeviceLimits {
    fn default() -> Self {
        DeviceLimits {
            max_buffer_bytes: 128 << 20,
            max_rank: 8,
            max_topk: 256,
            max_head_dim: 256,
        }
    }
}

/// Whether the backend takes an op at all, from its kind and attributes
/// alone (no dtypes or shapes). [`supports`] adds the per-node conditions.
pub fn op_supported(op: &Op) -> Result<(), String> {
    let spatial = |n: usize, what: &str| {
        if (1..=2).contains(&n) {
            Ok(())
        } else {
            Err(format!("{n}-D {what} (the GPU kernels do 1-D and 2-D)"))
        }
    };
    match op {
        Op::Convolution(c) if c.transposed => {
            Err("transposed convolution has no GPU kernel yet".into())
        }
        Op::Convolution(c) => spatial(c.spatial_rank(), "convolution"),
        Op::MaxPool(p) if p.with_indices => {
            Err("max pooling with indices has no GPU kernel yet".into())
        }
        Op::MaxPool(p) => spatial(p.spatial_rank(), "pooling"),
        Op::AvgPool(p) => spatial(p.spatial_rank(), "pooling"),
        Op::AdaptiveAvgPool { output_size } => spatial(output_size.len(), "adaptive pooling"),
        _ => Ok(()),
    }?;
    // the attribute conditions above give the better reasons; this is the rest
    if crate::op_table::form(op).is_some() {
        Ok(())
    } else {
        Err(format!("{} has no GPU kernel yet", op.name()))
    }
}

/// Whether the Metal backend takes `node` of `graph` within `limits`;
/// `Err` holds the reason it stays on the CPU.
pub fn supports(graph: &Graph, node: &Node, limits: &DeviceLimits) -> Result<(), String> {
    op_supported(&node.op)?;
    fits_i32(&node.op)?;
    nan_test(graph, node)?;
    super::dynamic::dynamic_supported(graph, node)?;
    let info = |id: etmetal_graph::ValueId| {
        graph
            .values
            .get(id.0)
            .ok_or_else(|| format!("refers to value #{} which is not in the graph", id.0))
    };
    let ins = node
        .inputs
        .iter()
        .map(|slot| slot.map(info).transpose())
        .collect::<Result<Vec<_>, _>>()?;
    let outs = node
        .outputs
        .iter()
        .map(|v| info(*v))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, v) in ins.iter().enumerate() {
        if let Some(v) = v {
            storable(v, limits).map_err(|e| format!("input {i}: {e}"))?;
            let id = node.inputs[i].expect("present slot");
            if let Some(data) = graph.constants.get(&id).filter(|t| t.dtype() == DType::I64) {
                if data.to_i64_vec().iter().any(|&x| i32::try_from(x).is_err()) {
                    return Err(format!(
                        "input {i} `{}` holds int64 values beyond the GPU's 32-bit integers",
                        v.name
                    ));
                }
            }
            if v.dtype == DType::I64 && graph.fake_constants.contains(&id) {
                return Err(format!(
                    "input {i} `{}` is an int64 constant whose values are not known here \
                     (a fake tensor): they may not fit the GPU's 32-bit integers",
                    v.name
                ));
            }
            if v.dtype == DType::I64 && !takes_int64(&node.op) {
                return Err(format!(
                    "input {i} `{}` is int64 (WGSL has no 64-bit integers)",
                    v.name
                ));
            }
        }
    }
    for (i, v) in outs.iter().enumerate() {
        storable(v, limits).map_err(|e| format!("output {i}: {e}"))?;
        if v.shape.contains(&0) {
            return Err(format!("output {i} is empty ({:?})", v.shape));
        }
        if v.dtype == DType::I64 && !takes_int64(&node.op) && !is_index_output(&node.op, i) {
            return Err(format!(
                "output {i} `{}` is int64 (WGSL has no 64-bit integers)",
                v.name
            ));
        }
    }
    dtypes_taken(&node.op, &ins, outs.first().map(|v| v.dtype), limits)
}

/// `x != x` and `x == x` on floats, how `isnan`, `nan_to_num` and `fmax`
/// test for NaN: WGSL lets a shader compiler assume floats are never NaN and
/// fold them to constants, so the test stays on the CPU, where it is exact.
fn nan_test(graph: &Graph, node: &Node) -> Result<(), String> {
    if let (Op::Binary(BinaryOp::Ne | BinaryOp::Eq), [Some(a), Some(b)]) =
        (&node.op, node.inputs.as_slice())
    {
        if a == b && graph.values.get(a.0).is_some_and(|v| v.dtype.is_float()) {
            return Err(
                "a NaN test (x != x): GPU shader compilers may assume floats are never NaN".into(),
            );
        }
    }
    Ok(())
}

/// The storage dtypes of GPU buffers.
const STORED: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

fn storable(v: &ValueInfo, limits: &DeviceLimits) -> Result<(), String> {
    if !STORED.contains(&v.dtype) {
        return Err(format!(
            "`{}` is {} (the GPU takes float32/bfloat16/float16, int64/int32/bool)",
            v.name,
            v.dtype.name()
        ));
    }
    if v.shape.len() > limits.max_rank {
        return Err(format!(
            "`{}` has rank {} (at most {})",
            v.name,
            v.shape.len(),
            limits.max_rank
        ));
    }
    // as the delegate holds it (16-bit float intermediates in f32, int64
    // and bool in 32-bit words), not at its host size
    let bytes = v
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .and_then(|numel| crate::payload::value_gpu_bytes(v.dtype, numel).ok());
    match bytes {
        Some(b) if b <= limits.max_buffer_bytes => Ok(()),
        _ => Err(format!(
            "`{}` of shape {:?} exceeds the {} byte buffer limit",
            v.name, v.shape, limits.max_buffer_bytes
        )),
    }
}

/// Ops that take int64 values narrowed to i32: those that move or make
/// them (the layout family), and the elementwise ops and reductions whose
/// int64 forms the kernels compute exactly or with run-time checks
/// ([`dtypes_taken`] narrows these down). Variance and softmax are float
/// arithmetic with no integer form, as are the layers.
fn takes_int64(op: &Op) -> bool {
    match op_table::family(op) {
        Family::Elementwise | Family::Layout => true,
        Family::Reduction => !matches!(op, Op::Var { .. } | Op::Softmax { .. }),
        Family::Layer | Family::Custom | Family::Delegate => false,
    }
}

/// Integer constants the kernels bake in must fit the GPU's 32-bit integers.
fn fits_i32(op: &Op) -> Result<(), String> {
    let scalars = match op {
        Op::Full { value, .. } => vec![*value],
        Op::Arange {
            start, end, step, ..
        } => vec![*start, *end, *step],
        _ => vec![],
    };
    for s in scalars {
        if let Scalar::Int(v) = s {
            if i32::try_from(v).is_err() {
                return Err(format!(
                    "integer constant {v} does not fit the GPU's 32-bit integers"
                ));
            }
        }
    }
    Ok(())
}

/// Outputs that hold int64 indices written by a float kernel.
fn is_index_output(op: &Op, slot: usize) -> bool {
    match op {
        Op::ArgReduce { .. } => slot == 0,
        Op::ReduceWithIndices { .. } | Op::TopK { .. } => slot == 1,
        _ => false,
    }
}

fn is_gpu_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

fn float(v: &ValueInfo, slot: usize) -> Result<(), String> {
    if is_gpu_float(v.dtype) {
        Ok(())
    } else {
        Err(format!(
            "input {slot} is {} (this op runs on float32/bfloat16/float16)",
            v.dtype.name()
        ))
    }
}

fn integer_index(v: &ValueInfo, slot: usize) -> Result<(), String> {
    match v.dtype {
        DType::I64 | DType::I32 => Ok(()),
        DType::Bool => Err(format!(
            "input {slot} is a bool mask index (its result shape depends on the data)"
        )),
        d => Err(format!(
            "input {slot} is a {} index (int64/int32 expected)",
            d.name()
        )),
    }
}

/// Input `slot`, which the op requires.
fn required<'a>(ins: &[Option<&'a ValueInfo>], slot: usize) -> Result<&'a ValueInfo, String> {
    ins.get(slot)
        .copied()
        .flatten()
        .ok_or_else(|| format!("required input {slot} is missing"))
}

/// Every present input of `slots` is float, all of one dtype.
fn same_float(ins: &[Option<&ValueInfo>], slots: std::ops::Range<usize>) -> Result<(), String> {
    let mut first: Option<DType> = None;
    for slot in slots {
        let Some(v) = ins.get(slot).copied().flatten() else {
            continue;
        };
        float(v, slot)?;
        match first {
            Some(d) if d != v.dtype => {
                return Err(format!(
                    "mixed dtypes {} and {} (the kernels take one float dtype)",
                    d.name(),
                    v.dtype.name()
                ))
            }
            _ => first = Some(v.dtype),
        }
    }
    Ok(())
}

/// int32, and int64 computed as i32.
fn is_int_lane(d: DType) -> bool {
    matches!(d, DType::I32 | DType::I64)
}

/// The per-op dtype and size conditions.
fn dtypes_taken(
    op: &Op,
    ins: &[Option<&ValueInfo>],
    out_dtype: Option<DType>,
    limits: &DeviceLimits,
) -> Result<(), String> {
    let all = 0..ins.len();
    match op {
        Op::Unary(u) => {
            let x = required(ins, 0)?;
            match u {
                // `logical_not` takes any dtype
                u if u.is_predicate() => Ok(()),
                // exact on int64 narrowed to i32: sign extension commutes
                u if u.is_bitwise() => match x.dtype {
                    DType::I32 | DType::I64 | DType::Bool => Ok(()),
                    d => Err(format!("{} of {}", u.name(), d.name())),
                },
                UnaryOp::Relu
                | UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Sign
                | UnaryOp::Clamp { .. }
                    if is_int_lane(x.dtype) || x.dtype == DType::Bool =>
                {
                    Ok(())
                }
                _ => float(x, 0),
            }
        }
        Op::Binary(b) if b.is_bitwise() => {
            for slot in 0..2 {
                let v = required(ins, slot)?;
                if !matches!(v.dtype, DType::I32 | DType::I64 | DType::Bool) {
                    return Err(format!("bitwise op on {} input {slot}", v.dtype.name()));
                }
            }
            Ok(())
        }
        // int64 powers would wrap in i32 unchecked
        Op::Binary(BinaryOp::Pow) if out_dtype == Some(DType::I64) => {
            Err("int64 pow (no overflow-checked GPU kernel)".into())
        }
        Op::Where => match required(ins, 0)?.dtype {
            DType::Bool => Ok(()),
            d => Err(format!(
                "where with a {} condition (bool expected)",
                d.name()
            )),
        },
        Op::Reduce {
            op: ReduceOp::Mean, ..
        } => float(required(ins, 0)?, 0),
        // integer sums and products accumulate in i32 (int64 ones checked);
        // a float summed into integers has no kernel
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Prod,
            ..
        }
        | Op::CumSum { .. } => {
            let x = required(ins, 0)?;
            match out_dtype {
                Some(d) if x.dtype.is_float() && !d.is_float() => {
                    Err(format!("a {} sum of {} input", d.name(), x.dtype.name()))
                }
                _ if is_int_lane(x.dtype) || x.dtype == DType::Bool => Ok(()),
                _ => float(x, 0),
            }
        }
        Op::Reduce {
            op: ReduceOp::Max | ReduceOp::Min,
            ..
        }
        | Op::ArgReduce { .. }
        | Op::ReduceWithIndices { .. } => {
            let x = required(ins, 0)?;
            if is_int_lane(x.dtype) {
                Ok(())
            } else {
                float(x, 0)
            }
        }
        Op::TopK { k, .. } => {
            if *k > limits.max_topk {
                return Err(format!("top-k with k = {k} (at most {})", limits.max_topk));
            }
            // (an MoE router's sort of int64 expert ids: exact in i32)
            let x = required(ins, 0)?;
            if is_int_lane(x.dtype) {
                Ok(())
            } else {
                float(x, 0)
            }
        }
        Op::Var { .. }
        | Op::Softmax { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::BatchNorm { .. }
        | Op::GroupNorm { .. }
        | Op::MaxPool(_)
        | Op::AvgPool(_)
        | Op::AdaptiveAvgPool { .. } => {
            required(ins, 0)?;
            same_float(ins, all)
        }
        Op::MatMul | Op::Addmm { .. } | Op::Linear | Op::Convolution(_) => {
            required(ins, 0)?;
            required(ins, 1)?;
            same_float(ins, all)
        }
        Op::Sdpa { .. } => {
            required(ins, 1)?;
            same_float(ins, 0..3)?;
            for slot in [0, 2] {
                let head = required(ins, slot)?.shape.last().copied().unwrap_or(1);
                if head > limits.max_head_dim {
                    return Err(format!(
                        "attention head dim {head} (at most {})",
                        limits.max_head_dim
                    ));
                }
            }
            match ins.get(3).copied().flatten() {
                Some(m) if m.dtype != DType::Bool => float(m, 3),
                _ => Ok(()),
            }
        }
        Op::Embedding => integer_index(required(ins, 1)?, 1),
        Op::IndexSelect { .. } | Op::Gather { .. } => integer_index(required(ins, 1)?, 1),
        Op::IndexCopy { .. } => {
            required(ins, 0)?;
            required(ins, 2)?;
            integer_index(required(ins, 1)?, 1)
        }
        Op::Index => {
            for (slot, v) in ins.iter().enumerate().skip(1) {
                if let Some(v) = v {
                    integer_index(v, slot)?;
                }
            }
            Ok(())
        }
        Op::Arange {
            start, end, dtype, ..
        } if *dtype == DType::I64 => {
            // computed in 32-bit lanes and sign-extended
            let fits = |s: &Scalar| i32::try_from(s.to_i64()).is_ok();
            if fits(start) && fits(end) {
                Ok(())
            } else {
                Err("int64 arange beyond the int32 range".into())
            }
        }
        // the GPU reads packed weights as int32 words (the passes' form)
        Op::Int4Linear { .. } | Op::Int8Linear { .. } | Op::GatherQmv { .. } => {
            match required(ins, 1)?.dtype {
                DType::I32 => required(ins, 0).map(|_| ()),
                d => Err(format!(
                    "packed weight of {} (the GPU reads int32 words)",
                    d.name()
                )),
            }
        }
        _ => Ok(()),
    }
}

/// Bitwise ops take integer lanes only.
#[cfg(test)]
mod tests {
    use super::*;
    use etmetal_core::ConvAttrs;
    use etmetal_graph::ValueId;

    /// A graph with one node of `op` over inputs of the given dtypes and
    /// shapes, giving one output of `out`.
    fn one_node(op: Op, ins: &[(DType, &[usize])], out: (DType, &[usize])) -> (Graph, Node) {
        let mut graph = Graph::default();
        let inputs = ins
            .iter()
            .enumerate()
            .map(|(i, (d, s))| Some(graph.add_value(format!("in{i}"), *d, s.to_vec())))
            .collect();
        let y = graph.add_value("y", out.0, out.1.to_vec());
        let node = Node {
            name: "n".into(),
            target: "test".into(),
            op,
            inputs,
            outputs: vec![y],
        };
        (graph, node)
    }

    fn verdict(op: Op, ins: &[(DType, &[usize])], out: (DType, &[usize])) -> Result<(), String> {
        let (graph, node) = one_node(op, ins, out);
        supports(&graph, &node, &DeviceLimits::default())
    }

    const F32: DType = DType::F32;

    #[test]
    fn float_compute_is_taken_in_every_gpu_float() {
        for d in [DType::F32, DType::BF16, DType::F16] {
            let mm = verdict(Op::MatMul, &[(d, &[2, 3]), (d, &[3, 4])], (d, &[2, 4]));
            assert_eq!(mm, Ok(()), "{d:?}");
            let ex = verdict(Op::Unary(UnaryOp::Exp), &[(d, &[5])], (d, &[5]));
            assert_eq!(ex, Ok(()), "{d:?}");
        }
    }

    #[test]
    fn a_dynamic_mean_stays_on_the_cpu_naming_op_and_dim() {
        let sum = Op::Reduce {
            op: ReduceOp::Mean,
            dims: vec![0],
            keepdim: true,
        };
        let (mut graph, node) = one_node(sum, &[(F32, &[8])], (F32, &[1]));
        assert_eq!(supports(&graph, &node, &DeviceLimits::default()), Ok(()));
        graph
            .sym
            .ranges
            .insert("s".into(), etmetal_core::SymRange { min: 1, max: 8 });
        let x = node.inputs[0].unwrap();
        graph
            .set_sym_dims(x, vec![etmetal_core::SymExpr::sym("s")])
            .unwrap();
        let err = supports(&graph, &node, &DeviceLimits::default()).unwrap_err();
        assert_eq!(
            err,
            "dynamic shape: reduce_mean reduces over dynamic dim `s`"
        );
        // elementwise at any size: the GPU takes it
        let (mut graph, node) = one_node(Op::Unary(UnaryOp::Exp), &[(F32, &[8])], (F32, &[8]));
        graph
            .sym
            .ranges
            .insert("s".into(), etmetal_core::SymRange { min: 1, max: 8 });
        for v in [node.inputs[0].unwrap(), node.outputs[0]] {
            graph
                .set_sym_dims(v, vec![etmetal_core::SymExpr::sym("s")])
                .unwrap();
        }
        assert_eq!(supports(&graph, &node, &DeviceLimits::default()), Ok(()));
    }

    #[test]
    fn float64_is_refused_with_its_name() {
        let err = verdict(
            Op::Binary(BinaryOp::Add),
            &[(DType::F64, &[2]), (DType::F64, &[2])],
            (DType::F64, &[2]),
        )
        .unwrap_err();
        assert!(err.contains("float64") && err.contains("in0"), "{err}");
    }

    #[test]
    fn int64_is_computed_on_where_exact_or_checked() {
        let i64s: &[(DType, &[usize])] = &[(DType::I64, &[3]), (DType::I64, &[3])];
        for b in [
            BinaryOp::Add,
            BinaryOp::Mul,
            BinaryOp::FloorDiv,
            BinaryOp::Remainder,
            BinaryOp::Maximum,
            BinaryOp::BitwiseAnd,
        ] {
            let v = verdict(Op::Binary(b), i64s, (DType::I64, &[3]));
            assert_eq!(v, Ok(()), "{b:?}");
        }
        assert_eq!(
            verdict(Op::Binary(BinaryOp::Le), i64s, (DType::Bool, &[3])),
            Ok(())
        );
        let pow = verdict(Op::Binary(BinaryOp::Pow), i64s, (DType::I64, &[3]));
        assert!(pow.unwrap_err().contains("pow"));
        let exp = verdict(Op::Unary(UnaryOp::Exp), &[(DType::I64, &[3])], (F32, &[3]));
        assert!(exp.unwrap_err().contains("int64"));
        for u in [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Sign] {
            let v = verdict(Op::Unary(u), &[(DType::I64, &[3])], (DType::I64, &[3]));
            assert_eq!(v, Ok(()), "{u:?}");
        }
        let emb = verdict(
            Op::Embedding,
            &[(F32, &[10, 4]), (DType::I64, &[3])],
            (F32, &[3, 4]),
        );
        assert_eq!(emb, Ok(()));
        let perm = verdict(
            Op::Permute { dims: vec![1, 0] },
            &[(DType::I64, &[2, 3])],
            (DType::I64, &[3, 2]),
        );
        assert_eq!(perm, Ok(()));
        let argmax = verdict(
            Op::ArgReduce {
                max: true,
                dim: Some(0),
                keepdim: false,
            },
            &[(F32, &[4])],
            (DType::I64, &[]),
        );
        assert_eq!(argmax, Ok(()));
        let sum = |x: DType, out: DType| {
            verdict(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    dims: vec![],
                    keepdim: false,
                },
                &[(x, &[4])],
                (out, &[]),
            )
        };
        assert_eq!(sum(DType::I32, DType::I64), Ok(()));
        assert_eq!(sum(DType::Bool, DType::I64), Ok(()));
        assert!(sum(F32, DType::I64).unwrap_err().contains("int64 sum"));
        let cumsum = verdict(
            Op::CumSum { dim: 0 },
            &[(DType::I64, &[4])],
            (DType::I64, &[4]),
        );
        assert_eq!(cumsum, Ok(()));
    }

    #[test]
    fn integer_constants_must_fit_32_bits() {
        let full = |v: i64| Op::Full {
            shape: vec![2],
            value: Scalar::Int(v),
            dtype: DType::I64,
        };
        assert_eq!(fits_i32(&full(-5)), Ok(()));
        assert!(fits_i32(&full(i64::MIN)).unwrap_err().contains("32-bit"));
        let mut g = Graph::default();
        let w = g.add_constant(
            "w",
            etmetal_core::Tensor::from_i64(DType::I64, &[2], &[1, 1 << 40]).unwrap(),
        );
        let y = g.add_value("y", DType::I64, vec![2]);
        let node = Node {
            name: "copy".into(),
            target: "t".into(),
            op: Op::Identity,
            inputs: vec![Some(w)],
            outputs: vec![y],
        };
        let err = supports(&g, &node, &DeviceLimits::default()).unwrap_err();
        assert!(err.contains("beyond the GPU's 32-bit"), "{err}");
        // values a fake tensor stands for are unknown: they may not fit
        g.constants
            .insert(w, etmetal_core::Tensor::zeros(DType::I64, &[2]).unwrap());
        assert_eq!(supports(&g, &node, &DeviceLimits::default()), Ok(()));
        g.fake_constants.insert(w);
        let err = supports(&g, &node, &DeviceLimits::default()).unwrap_err();
        assert!(err.contains("fake tensor"), "{err}");
    }

    #[test]
    fn attribute_conditions() {
        let conv = |transposed: bool, spatial: usize| {
            Op::Convolution(ConvAttrs {
                stride: vec![1; spatial],
                padding: vec![0; spatial],
                dilation: vec![1; spatial],
                transposed,
                output_padding: vec![0; spatial],
                groups: 1,
            })
        };
        assert_eq!(op_supported(&conv(false, 1)), Ok(()));
        assert_eq!(op_supported(&conv(false, 2)), Ok(()));
        assert!(op_supported(&conv(false, 3)).unwrap_err().contains("3-D"));
        assert!(op_supported(&conv(true, 2))
            .unwrap_err()
            .contains("transposed"));
        assert_eq!(op_supported(&Op::CumSum { dim: 0 }), Ok(()));
        let topk = |k| Op::TopK {
            k,
            dim: 0,
            largest: true,
            sorted: true,
        };
        let k = 300;
        let (graph, mut node) = one_node(topk(k), &[(F32, &[1000])], (F32, &[k]));
        let idx = ValueId(graph.values.len());
        let mut graph = graph;
        graph.add_value("idx", DType::I64, vec![k]);
        node.outputs.push(idx);
        let err = supports(&graph, &node, &DeviceLimits::default()).unwrap_err();
        assert!(err.contains("k = 300"), "{err}");
        let wide = DeviceLimits {
            max_topk: 512,
            ..DeviceLimits::default()
        };
        assert_eq!(supports(&graph, &node, &wide), Ok(()));
        // an MoE router's sort of int64 expert ids stays on the GPU
        let (graph, mut node) = one_node(topk(4), &[(DType::I64, &[4])], (DType::I64, &[4]));
        let idx = ValueId(graph.values.len());
        let mut graph = graph;
        graph.add_value("idx", DType::I64, vec![4]);
        node.outputs.push(idx);
        assert_eq!(supports(&graph, &node, &DeviceLimits::default()), Ok(()));
    }

    #[test]
    fn sizes_and_dtypes_within_limits() {
        let limits = DeviceLimits {
            max_buffer_bytes: 1024,
            max_rank: 3,
            ..DeviceLimits::default()
        };
        let (graph, node) = one_node(Op::Identity, &[(F32, &[257])], (F32, &[257]));
        let err = supports(&graph, &node, &limits).unwrap_err();
        assert!(err.contains("1024 byte"), "{err}");
        let (graph, node) = one_node(Op::Identity, &[(F32, &[1, 1, 1, 1])], (F32, &[1, 1, 1, 1]));
        let err = supports(&graph, &node, &limits).unwrap_err();
        assert!(err.contains("rank 4"), "{err}");
        let mixed = verdict(
            Op::MatMul,
            &[(F32, &[2, 2]), (DType::BF16, &[2, 2])],
            (F32, &[2, 2]),
        );
        assert!(mixed.unwrap_err().contains("mixed dtypes"));
        let mask = verdict(Op::Index, &[(F32, &[4]), (DType::Bool, &[4])], (F32, &[2]));
        assert!(mask.unwrap_err().contains("bool mask"));
        let empty = verdict(Op::Identity, &[(F32, &[0])], (F32, &[0]));
        assert!(empty.unwrap_err().contains("empty"));
        let u8s = verdict(Op::Identity, &[(DType::U8, &[4])], (DType::U8, &[4]));
        assert!(u8s.unwrap_err().contains("uint8"));
    }

    #[test]
    fn attention_head_dim_and_mask() {
        let sdpa = Op::Sdpa {
            is_causal: false,
            scale: None,
            enable_gqa: false,
        };
        let q: &[usize] = &[1, 2, 8, 64];
        let ok = verdict(
            sdpa.clone(),
            &[(F32, q), (F32, q), (F32, q), (DType::Bool, &[8, 8])],
            (F32, q),
        );
        assert_eq!(ok, Ok(()));
        let big: &[usize] = &[1, 2, 8, 512];
        let err = verdict(
            sdpa.clone(),
            &[(F32, big), (F32, big), (F32, big)],
            (F32, big),
        );
        assert!(err.unwrap_err().contains("head dim 512"));
        let int_mask = verdict(
            sdpa,
            &[(F32, q), (F32, q), (F32, q), (DType::I32, &[8, 8])],
            (F32, q),
        );
        assert!(int_mask.unwrap_err().contains("input 3"));
    }

    #[test]
    fn missing_values_are_reasons_not_panics() {
        let (graph, mut node) = one_node(Op::Identity, &[(F32, &[2])], (F32, &[2]));
        node.inputs[0] = Some(ValueId(42));
        let err = supports(&graph, &node, &DeviceLimits::default()).unwrap_err();
        assert!(err.contains("#42"), "{err}");
        node.inputs[0] = None;
        node.op = Op::Unary(UnaryOp::Exp);
        assert!(supports(&graph, &node, &DeviceLimits::default())
            .unwrap_err()
            .contains("required input 0"));
    }
}
