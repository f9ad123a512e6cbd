//! The quantized and MoE ops, which ExecuTorch's portable library has no
//! kernel for, written as calls of the custom operators the seed's programs
//! name (`torchao::_linear_fp_act_4bit_weight`, `metal::gather_qmv`,
//! `metal::gated_delta_rule`) with ExecuTorch's out-variant convention:
//! schema arguments, the `out` tensors, then the return again. The int8
//! linear, which no library names, is etmetal's own
//! `etmetal::_linear_fp_act_8bit_weight`, with the int4 op's arguments.
//! etmetal's runtime runs them on its CPU kernels; ExecuTorch's stock
//! runtime has no kernel registered under these names (the seed runs them
//! inside its AOTI delegate), so it refuses such a program at load.

use etmetal_core::{Op, Result};

use super::super::{Call, CallArg};
use CallArg::{Input, Int, Output, OutputList};

/// The int4 linear's operator (torchao's).
pub(in crate::kernels) const INT4_LINEAR: &str = "torchao::_linear_fp_act_4bit_weight";
/// The int8 linear's operator (etmetal's own; same arguments).
pub(in crate::kernels) const INT8_LINEAR: &str = "etmetal::_linear_fp_act_8bit_weight";

/// The call for one of the custom ops, `None` for any other op.
pub(in crate::kernels) fn encode(op: &Op) -> Option<Result<Call>> {
    let call = |name: &str, mut args: Vec<CallArg>, n_out: usize| {
        args.extend((0..n_out).map(Output));
        args.push(match n_out {
            1 => Output(0),
            _ => OutputList((0..n_out).collect()),
        });
        Ok(Call {
            name: name.into(),
            overload: "out".into(),
            args,
        })
    };
    Some(match op {
        // (A, B, group_size, S, Z, out)
        Op::Int4Linear { group_size } | Op::Int8Linear { group_size } => call(
            match op {
                Op::Int4Linear { .. } => INT4_LINEAR,
                _ => INT8_LINEAR,
            },
            vec![
                Input(0),
                Input(1),
                Int(*group_size as i64),
                Input(2),
                Input(3),
            ],
            1,
        ),
        // (x, w, scales, biases, expert_indices, group_size, out)
        Op::GatherQmv { group_size } => call(
            "metal::gather_qmv",
            vec![
                Input(0),
                Input(1),
                Input(2),
                Input(3),
                Input(4),
                Int(*group_size as i64),
            ],
            1,
        ),
        // (q, k, v, g, beta, state, out, state_out): the state the
        // functional form returns is the second out tensor.
        Op::GatedDeltaRule => call("metal::gated_delta_rule", (0..6).map(Input).collect(), 2),
        _ => return None,
    })
}
