//! Shape and dtype inference for every [`Op`]: what a node produces given
//! the dtypes and shapes of its inputs, with PyTorch's rules (type promotion
//! with 0-d operands, matmul broadcasting, convolution arithmetic, …).

//!
//! One module per op family (`op_table::Family`: `elementwise`, `reduce`,
//! `nn`, `layout`, and `quant` for the custom ops), each inferring its own
//! ops; `common` holds what they share.

mod common;
mod elementwise;
mod layout;
mod nn;
mod quant;
mod reduce;

use etmetal_core::op_table::{self, Family};
use etmetal_core::{DType, Error, Op, Result};

use crate::ir::{Graph, Node, ValueInfo};
use common::Out;

pub use common::result_type;

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

fn infer_op(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op_table::family(op) {
        Family::Elementwise => elementwise::infer(op, inputs),
        Family::Reduction => reduce::infer(op, inputs),
        Family::Layer => nn::infer(op, inputs),
        Family::Layout => layout::infer(op, inputs),
        Family::Custom => quant::infer(op, inputs),
        Family::Delegate => Err(Error::internal(match op {
            Op::Delegate { index } => format!(
                "delegate call {index}: its outputs are declared by the backend, not inferred"
            ),
            other => format!("{} is not a delegate call", other.name()),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ValueId;
    use etmetal_core::{BinaryOp, ConvAttrs, MaxPoolAttrs, ReduceOp};

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
