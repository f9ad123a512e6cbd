//! Reading the custom quantized and MoE calls back (the encoder's
//! `encode/custom.rs` says what they are).

use etmetal_core::quant::QuantFormat;
use etmetal_core::{Error, Op, Result};

use super::super::encode::custom::{INT4_LINEAR, INT8_LINEAR};

use super::{one, Args, DecodedCall};

/// The op of a custom call, `None` when `name.overload` is not one of ours.
pub(super) fn decode(a: &Args, name: &str, overload: &str) -> Option<Result<DecodedCall>> {
    if overload != "out" {
        return None;
    }
    let group = |pos: usize| -> Result<usize> {
        usize::try_from(a.int(pos)?).map_err(|_| Error::format("a negative group size"))
    };
    Some(match name {
        INT4_LINEAR | INT8_LINEAR => (|| {
            let inputs = [0, 1, 3, 4].map(|p| a.tensor(p).map(Some));
            let format = match name {
                INT4_LINEAR => QuantFormat::int4(group(2)?),
                _ => QuantFormat::int8(group(2)?),
            };
            one(
                format.linear_op(),
                inputs.into_iter().collect::<Result<_>>()?,
                vec![a.tensor(5)?],
            )
        })(),
        "metal::gather_qmv" => (|| {
            let inputs = (0..5).map(|p| a.tensor(p).map(Some));
            one(
                Op::GatherQmv {
                    group_size: group(5)?,
                },
                inputs.collect::<Result<_>>()?,
                vec![a.tensor(6)?],
            )
        })(),
        "metal::gated_delta_rule" => (|| {
            let inputs = (0..6).map(|p| a.tensor(p).map(Some));
            one(
                Op::GatedDeltaRule,
                inputs.collect::<Result<_>>()?,
                vec![a.tensor(6)?, a.tensor(7)?],
            )
        })(),
        _ => return None,
    })
}
