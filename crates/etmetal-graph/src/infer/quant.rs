//! Shape and dtype inference of the quantized and MoE ops
//! ([`Op::Int4Linear`], [`Op::Int8Linear`], [`Op::GatherQmv`],
//! [`Op::GatedDeltaRule`]); the weight layout rules are
//! [`etmetal_core::quant`]'s.

use etmetal_core::quant::{check_activation, check_weight, QuantFormat};
use etmetal_core::{DType, Error, Op, Result};

use super::common::{req, Out};
use crate::ir::ValueInfo;

fn spec(v: &ValueInfo) -> (DType, &[usize]) {
    (v.dtype, v.shape.as_slice())
}

pub(super) fn infer(op: &Op, inputs: &[Option<&ValueInfo>]) -> Result<Out> {
    match op {
        Op::Int4Linear { .. } | Op::Int8Linear { .. } => {
            let format = QuantFormat::of_linear(op)
                .ok_or_else(|| Error::internal("not a quantized linear"))?;
            let what = format!("{} linear", format.name());
            let x = req(inputs, 0, "activations")?;
            check_activation(&format!("{what} activations"), x.dtype)?;
            let Some(&k) = x.shape.last() else {
                return Err(Error::shape(format!("{what} of a 0-d input")));
            };
            let w = check_weight(
                format,
                k,
                spec(req(inputs, 1, "packed weight")?),
                spec(req(inputs, 2, "scales")?),
                spec(req(inputs, 3, "zeros")?),
                false,
            )?;
            let mut shape = x.shape.clone();
            *shape.last_mut().unwrap_or(&mut 0) = w.n;
            Ok(vec![(x.dtype, shape)])
        }
        Op::GatherQmv { group_size } => {
            let x = req(inputs, 0, "activations")?;
            check_activation("gather_qmv activations", x.dtype)?;
            let [p, k] = x.shape[..] else {
                return Err(Error::shape(format!(
                    "gather_qmv activations {:?}: [P, K] expected",
                    x.shape
                )));
            };
            let w = check_weight(
                QuantFormat::int4(*group_size),
                k,
                spec(req(inputs, 1, "packed expert weights")?),
                spec(req(inputs, 2, "scales")?),
                spec(req(inputs, 3, "biases")?),
                true,
            )?;
            let idx = req(inputs, 4, "expert indices")?;
            if !matches!(idx.dtype, DType::I32 | DType::I64) || idx.shape != [p] {
                return Err(Error::shape(format!(
                    "gather_qmv expert indices {} {:?}: int32 or int64 [{p}] expected",
                    idx.dtype, idx.shape
                )));
            }
            Ok(vec![(x.dtype, vec![p, w.n])])
        }
        Op::GatedDeltaRule => {
            let names = ["q", "k", "v", "g", "beta", "state"];
            let v: Vec<&ValueInfo> = (0..6)
                .map(|i| req(inputs, i, names[i]))
                .collect::<Result<_>>()?;
            for (i, t) in v.iter().enumerate() {
                check_activation(&format!("gated_delta_rule {}", names[i]), t.dtype)?;
            }
            let bad = || {
                Error::shape(format!(
                    "gated_delta_rule shapes q {:?} k {:?} v {:?} g {:?} beta {:?} state {:?}: \
                     q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], \
                     state [B, Hv, Dv, Dk] with Hk dividing Hv expected",
                    v[0].shape, v[1].shape, v[2].shape, v[3].shape, v[4].shape, v[5].shape
                ))
            };
            let [b, t, hk, dk] = v[0].shape[..] else {
                return Err(bad());
            };
            let [_, _, hv, dv] = v[2].shape[..] else {
                return Err(bad());
            };
            let ok = v[1].shape == v[0].shape
                && v[2].shape[..2] == [b, t]
                && v[3].shape == [b, t, hv]
                && v[4].shape == [b, t, hv]
                && v[5].shape == [b, hv, dv, dk]
                && hk > 0
                && hv.is_multiple_of(hk);
            if !ok {
                return Err(bad());
            }
            Ok(vec![
                (v[0].dtype, vec![b, t, hv, dv]),
                (v[5].dtype, v[5].shape.clone()),
            ])
        }
        other => Err(Error::internal(format!(
            "{} is not an int4 or MoE op",
            other.name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::infer::infer;
    use crate::ir::{Graph, Node};
    use DType::*;

    fn run(op: Op, inputs: &[(DType, &[usize])]) -> Result<Out> {
        let mut g = Graph::default();
        let ids = inputs
            .iter()
            .map(|(d, s)| Some(g.add_value("in", *d, s.to_vec())))
            .collect();
        let n = Node {
            name: "lin_q".into(),
            target: "t".into(),
            op,
            inputs: ids,
            outputs: vec![],
        };
        infer(&g, &n)
    }

    #[test]
    fn int4_linear_shapes_and_errors_name_the_node() {
        let lin = Op::Int4Linear { group_size: 32 };
        let out = run(
            lin.clone(),
            &[
                (BF16, &[2, 3, 64]),
                (U8, &[10, 32]),
                (BF16, &[10, 2]),
                (BF16, &[10, 2]),
            ],
        )
        .unwrap();
        assert_eq!(out, vec![(BF16, vec![2, 3, 10])]);
        let e = run(
            Op::Int4Linear { group_size: 64 },
            &[
                (F32, &[1, 96]),
                (U8, &[10, 48]),
                (F32, &[10, 1]),
                (F32, &[10, 1]),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("node `lin_q`"), "{e}");
        assert!(e.to_string().contains("does not divide K = 96"), "{e}");
        let e = run(
            lin.clone(),
            &[
                (F32, &[1, 64]),
                (U8, &[10, 64]),
                (F32, &[10, 2]),
                (F32, &[10, 2]),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("holds 128 values a row"), "{e}");
        let e = run(
            lin,
            &[
                (I32, &[1, 64]),
                (U8, &[10, 32]),
                (F32, &[10, 2]),
                (F32, &[10, 2]),
            ],
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("int4 linear activations must be float"),
            "{e}"
        );
    }

    #[test]
    fn int8_linear_shapes() {
        // per output channel (one group of K), on int32 words
        let out = run(
            Op::Int8Linear { group_size: 96 },
            &[
                (F32, &[3, 96]),
                (I32, &[10, 24]),
                (F32, &[10, 1]),
                (F32, &[10, 1]),
            ],
        )
        .unwrap();
        assert_eq!(out, vec![(F32, vec![3, 10])]);
        let e = run(
            Op::Int8Linear { group_size: 32 },
            &[
                (F32, &[3, 96]),
                (U8, &[10, 48]),
                (F32, &[10, 3]),
                (F32, &[10, 3]),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("int8 packed weight"), "{e}");
    }

    #[test]
    fn gather_qmv_and_gated_delta_rule_shapes() {
        let out = run(
            Op::GatherQmv { group_size: 32 },
            &[
                (F32, &[4, 128]),
                (U8, &[4, 64, 64]),
                (F32, &[4, 64, 4]),
                (F32, &[4, 64, 4]),
                (I32, &[4]),
            ],
        )
        .unwrap();
        assert_eq!(out, vec![(F32, vec![4, 64])]);
        let gdr = [
            (BF16, &[1, 2, 2, 8][..]),
            (BF16, &[1, 2, 2, 8]),
            (BF16, &[1, 2, 4, 16]),
            (BF16, &[1, 2, 4]),
            (BF16, &[1, 2, 4]),
            (F32, &[1, 4, 16, 8]),
        ];
        let out = run(Op::GatedDeltaRule, &gdr).unwrap();
        assert_eq!(
            out,
            vec![(BF16, vec![1, 2, 4, 16]), (F32, vec![1, 4, 16, 8])]
        );
        let mut bad = gdr;
        bad[5] = (F32, &[1, 4, 8, 16]);
        assert!(run(Op::GatedDeltaRule, &bad).is_err());
    }
}
