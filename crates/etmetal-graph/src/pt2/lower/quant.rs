//! Lowering the int4 and MoE targets of the seed's programs:
//! - `torchao._linear_fp_act_4bit_weight(A, B, group_size, S, Z)`, the
//!   seed's fpa4w linear, with packed weight, scales and zeros as plain
//!   tensors → [`Op::Int4Linear`];
//! - `metal.gather_qmv` → [`Op::GatherQmv`];
//! - `metal.gated_delta_rule`, which writes its `state` argument in place:
//!   [`Op::GatedDeltaRule`] gives the new state, which becomes the value of
//!   what it wrote (a buffer mutation, as for in-place ATen ops);
//! - torchao's weight-only forms (`IntxWeightOnlyConfig` and friends),
//!   which export as `torchao.dequantize_affine(qdata, [1, group], scale,
//!   zero_point, …)` feeding `aten.linear`: the dequantize is not lowered;
//!   its constant operands are repacked into the int4 layout and the linear
//!   that reads it becomes an [`Op::Int4Linear`], so the dequantized weight
//!   is never materialised.

use etmetal_core::int4::{as_words, pack};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

/// A `dequantize_affine` whose result only a linear may read, already in
/// the int4 layout.
pub(super) struct Dequant {
    packed: ValueId,
    scales: ValueId,
    zeros: ValueId,
    group_size: usize,
}

/// The value name of the first present tensor argument among `names`
/// (schemas name the same operand differently: `A` / `activations`).
fn tensor_arg<'a>(c: &Ctx<'a>, names: &[&str]) -> Result<&'a str> {
    for n in names {
        if let Some(v) = c.args.tensor_name(n)? {
            return Ok(v);
        }
    }
    Err(Error::format(format!(
        "missing tensor argument `{}`",
        names[0]
    )))
}

fn group_arg(c: &Ctx, name: &str) -> Result<usize> {
    let g = c
        .args
        .opt_int(name)?
        .ok_or_else(|| Error::format(format!("missing int argument `{name}`")))?;
    usize::try_from(g).map_err(|_| Error::shape(format!("negative group size {g}")))
}

impl Lowerer<'_> {
    /// Lower `c` if it is one of the int4/MoE targets (or a linear reading a
    /// fused `dequantize_affine`); `None` otherwise.
    pub(super) fn lower_quant(&mut self, c: &Ctx) -> Option<Result<()>> {
        let target = c.target.as_str();
        Some(match target {
            "torch.ops.torchao._linear_fp_act_4bit_weight.default" => self.linear_4bit(c),
            "torch.ops.metal.gather_qmv.default" => self.gather_qmv(c),
            "torch.ops.metal.gated_delta_rule.default" => self.gated_delta_rule(c),
            "torch.ops.torchao.dequantize_affine.default" => self.dequantize_affine(c),
            "torch.ops.aten.linear.default" => {
                let w = match c.args.tensor_name("weight") {
                    Ok(Some(w)) if self.dequant.contains_key(w) => w.to_string(),
                    _ => return None,
                };
                self.fused_linear(c, &w)
            }
            _ => return None,
        })
    }

    fn linear_4bit(&mut self, c: &Ctx) -> Result<()> {
        let mut t = |names: &[&str]| -> Result<ValueId> {
            let n = tensor_arg(c, names)?;
            self.lookup(n)
        };
        let mut inputs = vec![
            Some(t(&["A", "activations"])?),
            Some(t(&["B", "packed_weights"])?),
            Some(t(&["S", "scales"])?),
            Some(t(&["Z", "zeros"])?),
        ];
        inputs[1] = Some(self.words(c, inputs[1])?);
        let group_size = group_arg(c, "group_size")?;
        self.finish(c, Op::Int4Linear { group_size }, inputs)
    }

    fn gather_qmv(&mut self, c: &Ctx) -> Result<()> {
        let mut inputs: Vec<Option<ValueId>> = ["x", "w", "scales", "biases", "expert_indices"]
            .iter()
            .map(|n| self.t(c, n).map(Some))
            .collect::<Result<_>>()?;
        inputs[1] = Some(self.words(c, inputs[1])?);
        let group_size = group_arg(c, "group_size")?;
        self.finish(c, Op::GatherQmv { group_size }, inputs)
    }

    /// A constant uint8 packed weight as its int32 words (the GPU stores
    /// int32 verbatim); any other value as it is.
    fn words(&mut self, c: &Ctx, packed: Option<ValueId>) -> Result<ValueId> {
        let v = packed.ok_or_else(|| Error::internal("no packed weight"))?;
        match self.graph.constants.get(&v) {
            Some(t) if t.dtype() == DType::U8 && !self.graph.fake_constants.contains(&v) => {
                let words = as_words(t)?;
                Ok(self.graph.add_constant(format!("{}.words", c.name), words))
            }
            _ => Ok(v),
        }
    }

    fn gated_delta_rule(&mut self, c: &Ctx) -> Result<()> {
        let inputs = ["q", "k", "v", "g", "beta", "state"]
            .iter()
            .map(|n| self.t(c, n).map(Some))
            .collect::<Result<_>>()?;
        let state = tensor_arg(c, &["state"])?.to_string();
        let outs = self.emit(c, Op::GatedDeltaRule, inputs)?;
        self.bind(c, 0, outs[0])?;
        self.write(c, &state, outs[1])
    }

    /// A constant operand of `dequantize_affine`, as f32 or i64 values.
    fn constant_of(&mut self, c: &Ctx, arg: &str) -> Result<(ValueId, Tensor)> {
        let name = tensor_arg(c, &[arg])?;
        let v = self.lookup(name)?;
        let t = self.graph.constants.get(&v).cloned().ok_or_else(|| {
            Error::unsupported(format!(
                "dequantize_affine `{arg}` is computed, not a constant: etmetal fuses only \
                 constant int4 weights into the linear that reads them"
            ))
        })?;
        Ok((v, t))
    }

    fn dequantize_affine(&mut self, c: &Ctx) -> Result<()> {
        let (_, q) = self.constant_of(c, "input")?;
        let (_, scale) = self.constant_of(c, "scale")?;
        let zero = match c.args.tensor_name("zero_point")? {
            Some(_) => Some(self.constant_of(c, "zero_point")?.1),
            None => None,
        };
        let block = c.args.ints("block_size")?.unwrap_or_default();
        let (qmin, qmax) = (c.args.int("quant_min", -8)?, c.args.int("quant_max", 7)?);
        let [n, k] = q.shape()[..] else {
            return Err(Error::unsupported(format!(
                "dequantize_affine of a {:?} tensor: a 2-D weight is needed",
                q.shape()
            )));
        };
        let group_size = match block[..] {
            [1, g] if g > 0 => g as usize,
            _ => {
                return Err(Error::unsupported(format!(
                    "dequantize_affine block size {block:?}: [1, group] is needed"
                )))
            }
        };
        if qmax - qmin > 15 || k % group_size != 0 {
            return Err(Error::unsupported(format!(
                "dequantize_affine with range {qmin}..={qmax} and group {group_size} of \
                 K = {k}: a 4-bit range and a group dividing K are needed"
            )));
        }
        let groups = k / group_size;
        if scale.numel() != n * groups || zero.as_ref().is_some_and(|z| z.numel() != n * groups) {
            return Err(Error::shape(format!(
                "dequantize_affine scale {:?} for {n}x{k} in groups of {group_size}",
                scale.shape()
            )));
        }
        // w = (q - zp) * s = (q - qmin) * s + (qmin - zp) * s
        let codes: Vec<u8> = q.to_i64_vec().iter().map(|&v| (v - qmin) as u8).collect();
        let s = scale.to_f32_vec();
        let zp = zero.map_or_else(|| vec![0.0; n * groups], |z| z.to_f32_vec());
        let zeros: Vec<f32> = s
            .iter()
            .zip(&zp)
            .map(|(s, z)| (qmin as f32 - z) * s)
            .collect();
        let out = c.args.scalar_type("output_dtype")?.unwrap_or(DType::F32);
        let at = |what: &str| format!("{}.{what}", c.name);
        let packed = self.graph.add_constant(
            at("int4"),
            as_words(&Tensor::from_slice(DType::U8, &[n, k / 2], &pack(&codes))?)?,
        );
        let scales = self
            .graph
            .add_constant(at("int4_scales"), Tensor::from_f32(out, &[n, groups], &s)?);
        let zeros = self.graph.add_constant(
            at("int4_zeros"),
            Tensor::from_f32(out, &[n, groups], &zeros)?,
        );
        let Some(Some(name)) = c.outputs.first() else {
            return Ok(());
        };
        self.dequant.insert(
            name.clone(),
            Dequant {
                packed,
                scales,
                zeros,
                group_size,
            },
        );
        Ok(())
    }

    fn fused_linear(&mut self, c: &Ctx, weight: &str) -> Result<()> {
        let d = &self.dequant[weight];
        let (p, s, z, group_size) = (d.packed, d.scales, d.zeros, d.group_size);
        let x = self.t(c, "input")?;
        let inputs = vec![Some(x), Some(p), Some(s), Some(z)];
        match self.opt_t(c, "bias")? {
            None => self.finish(c, Op::Int4Linear { group_size }, inputs),
            Some(b) => {
                let y = self.emit1(c, Op::Int4Linear { group_size }, inputs)?;
                self.finish(c, Op::Binary(BinaryOp::Add), vec![Some(y), Some(b)])
            }
        }
    }
}
