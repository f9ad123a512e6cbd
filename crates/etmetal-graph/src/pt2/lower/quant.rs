//! Lowering the int4 and MoE targets of the seed's programs:
//! - `torchao._linear_fp_act_4bit_weight(A, B, group_size, S, Z)`, the
//!   seed's fpa4w linear, with packed weight, scales and zeros as plain
//!   tensors → [`Op::Int4Linear`];
//! - `metal.gather_qmv` → [`Op::GatherQmv`];
//! - `metal.gated_delta_rule`, which writes its `state` argument in place:
//!   [`Op::GatedDeltaRule`] gives the new state, which becomes the value of
//!   what it wrote (a buffer mutation, as for in-place ATen ops);
//! - torchao's weight-only forms (`IntxWeightOnlyConfig` with int4 or
//!   int8 weights, per group or per output channel, as ExecuTorch's LLM
//!   export applies them to linears and embeddings; `Int8WeightOnlyConfig`
//!   per group), which export as `torchao.dequantize_affine(qdata, [1,
//!   group], scale, zero_point, …)` feeding `aten.linear`, `aten.t` →
//!   `aten.mm`, or `aten.embedding`: the dequantize is not lowered; its
//!   constant operands are repacked into the layout of
//!   `etmetal_core::quant` (int4 where the codes span 16 values and the
//!   group is an int4 group, else int8), the linear that reads it becomes
//!   an [`Op::Int4Linear`] or [`Op::Int8Linear`], and the embedding gathers
//!   and dequantizes rows of the packed table (`quantize::gather_rows`), so
//!   the dequantized weight is never materialised;
//! - torchao's `Int8WeightOnlyConfig`, which exports as `mm(x,
//!   _to_copy(t(qdata), float))` followed by a multiplication by the
//!   per-channel scale: the `mm` becomes an [`Op::Int8Linear`] of the codes
//!   (`qdata + 128` with scale 1 and zero -128, exact in every float
//!   dtype), the scale's multiplication stays as exported (the float
//!   weight the `_to_copy` would give is lowered too, and left dead).

use etmetal_core::quant::{as_words, from_signed, pack, QuantFormat};
use etmetal_core::{BinaryOp, DType, Error, Op, Result, Tensor};

use super::{Ctx, Lowerer};
use crate::ir::{Graph, ValueId};
use crate::quantize::{gather_rows, Build, QuantTable};

/// A `dequantize_affine` whose result only a linear (or an embedding) may
/// read, already in the quantized layout; `transposed`: read through
/// `aten.t` (`W.T`, for `aten.mm`).
#[derive(Clone, Copy)]
pub(super) struct Dequant {
    table: QuantTable,
    transposed: bool,
}

/// The importer's emission of one source node as a [`Build`].
struct Emit<'l, 'a, 'c> {
    lw: &'l mut Lowerer<'a>,
    c: &'l Ctx<'c>,
}

impl Build for Emit<'_, '_, '_> {
    fn graph(&self) -> &Graph {
        &self.lw.graph
    }
    fn node(&mut self, op: Op, inputs: &[Option<ValueId>]) -> Result<ValueId> {
        self.lw.emit1(self.c, op, inputs.to_vec())
    }
    fn constant(&mut self, what: &str, t: Tensor) -> ValueId {
        self.lw.add_table(self.c, what, t)
    }
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
                let d = self.dequant_arg(c, "weight", false)?;
                self.fused_linear(c, d, "input")
            }
            "torch.ops.aten.t.default" => {
                let Some(d) = self.dequant_arg(c, "self", false) else {
                    self.note_int8_transpose(c);
                    return None;
                };
                let Some(Some(name)) = c.outputs.first() else {
                    return Some(Ok(()));
                };
                let t = Dequant {
                    transposed: true,
                    ..d
                };
                self.dequant.insert(name.clone(), t);
                Ok(())
            }
            "torch.ops.aten.mm.default" => {
                let d = self.dequant_arg(c, "mat2", true)?;
                self.fused_linear(c, d, "self")
            }
            "torch.ops.aten.embedding.default" => {
                let d = self.dequant_arg(c, "weight", false)?;
                self.quantized_embedding(c, d)
            }
            "torch.ops.aten._to_copy.default" => {
                // lowered as usual too: only an `mm` reads the codes
                if let Err(e) = self.int8_to_float(c) {
                    return Some(Err(e));
                }
                return None;
            }
            _ => return None,
        })
    }

    /// Remember `c` (an `aten.t`) where it transposes a constant int8
    /// matrix.
    fn note_int8_transpose(&mut self, c: &Ctx) {
        let (Ok(Some(src)), Some(Some(out))) = (c.args.tensor_name("self"), c.outputs.first())
        else {
            return;
        };
        let Ok(v) = self.lookup(src) else { return };
        let int8 = self.graph.constants.get(&v).is_some_and(|t| {
            t.dtype() == DType::I8 && t.rank() == 2 && !self.graph.fake_constants.contains(&v)
        });
        if int8 {
            self.int8_t.insert(out.clone(), v);
        }
    }

    /// `_to_copy(t(Q), float)` of a constant int8 `Q [N, K]`: the codes as
    /// a per-channel int8 table (scale 1, zero -128) that an `mm` fuses.
    /// Nothing where `c` is any other copy, or K is no multiple of 32.
    fn int8_to_float(&mut self, c: &Ctx) -> Result<()> {
        let (Ok(Some(src)), Some(Some(out))) = (c.args.tensor_name("self"), c.outputs.first())
        else {
            return Ok(());
        };
        let Some(&q) = self.int8_t.get(src) else {
            return Ok(());
        };
        let dtype = match c.args.scalar_type("dtype")? {
            Some(d @ (DType::F32 | DType::BF16 | DType::F16)) => d,
            _ => return Ok(()),
        };
        let t = self.graph.constants[&q].clone();
        let (n, k) = (t.shape()[0], t.shape()[1]);
        let format = QuantFormat::int8(k);
        if format.check_group(k).is_err() {
            return Ok(());
        }
        let codes: Vec<u8> = t.to_i64_vec().iter().map(|&v| (v + 128) as u8).collect();
        let at = |what: &str| format!("{}.int8{what}", c.name);
        let packed = self.graph.add_constant(
            at(""),
            as_words(&Tensor::from_slice(DType::U8, &[n, k], &codes)?)?,
        );
        let scales = self.graph.add_constant(
            at("_scales"),
            Tensor::from_f32(dtype, &[n, 1], &vec![1.0; n])?,
        );
        let zeros = self.graph.add_constant(
            at("_zeros"),
            Tensor::from_f32(dtype, &[n, 1], &vec![-128.0; n])?,
        );
        let table = QuantTable {
            packed,
            scales,
            zeros,
            format,
        };
        self.dequant.insert(
            out.clone(),
            Dequant {
                table,
                transposed: true,
            },
        );
        Ok(())
    }

    /// The dequantized weight that argument `arg` of `c` reads, in the
    /// layout `transposed` asks for; `None` where it reads something else.
    fn dequant_arg(&self, c: &Ctx, arg: &str, transposed: bool) -> Option<Dequant> {
        match c.args.tensor_name(arg) {
            Ok(Some(w)) => self
                .dequant
                .get(w)
                .copied()
                .filter(|d| d.transposed == transposed),
            _ => None,
        }
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
                 constant quantized weights into the linear that reads them"
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
        // torchao takes the range of `input_dtype` where none is given
        let (lo, hi) = match c.args.scalar_type("input_dtype")? {
            Some(DType::I8) => (-128, 127),
            Some(DType::U8) => (0, 255),
            _ => (-8, 7),
        };
        let (qmin, qmax) = (c.args.int("quant_min", lo)?, c.args.int("quant_max", hi)?);
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
        // the narrowest layout that holds the range and takes the group
        let formats = [QuantFormat::int4(group_size), QuantFormat::int8(group_size)];
        let format = formats
            .into_iter()
            .filter(|f| qmax - qmin <= f.max_code() as i64)
            .find(|f| f.check_group(k).is_ok())
            .ok_or_else(|| {
                Error::unsupported(format!(
                    "dequantize_affine with range {qmin}..={qmax} and group {group_size} of \
                     K = {k}: an 8-bit range and a group of int4's {:?} or a multiple of 32 \
                     dividing K are needed",
                    etmetal_core::quant::GROUP_SIZES
                ))
            })?;
        let groups = k / group_size;
        if scale.numel() != n * groups || zero.as_ref().is_some_and(|z| z.numel() != n * groups) {
            return Err(Error::shape(format!(
                "dequantize_affine scale {:?} for {n}x{k} in groups of {group_size}",
                scale.shape()
            )));
        }
        // w = (q - zp) * s = (q - qmin) * s + (qmin - zp) * s
        let s = scale.to_f32_vec();
        let zp = zero.map_or_else(|| vec![0.0; n * groups], |z| z.to_f32_vec());
        let (codes, zeros) = from_signed(&q.to_i64_vec(), qmin, &s, &zp);
        let out = c.args.scalar_type("output_dtype")?.unwrap_or(DType::F32);
        let tag = format.name();
        let at = |what: &str| format!("{}.{tag}{what}", c.name);
        let bytes = pack(format.bits, &codes);
        let packed = self.graph.add_constant(
            at(""),
            as_words(&Tensor::from_slice(
                DType::U8,
                &[n, k / format.per_byte()],
                &bytes,
            )?)?,
        );
        let scales = self
            .graph
            .add_constant(at("_scales"), Tensor::from_f32(out, &[n, groups], &s)?);
        let zeros = self
            .graph
            .add_constant(at("_zeros"), Tensor::from_f32(out, &[n, groups], &zeros)?);
        let Some(Some(name)) = c.outputs.first() else {
            return Ok(());
        };
        let table = QuantTable {
            packed,
            scales,
            zeros,
            format,
        };
        self.dequant.insert(
            name.clone(),
            Dequant {
                table,
                transposed: false,
            },
        );
        Ok(())
    }

    /// `linear(x, W)` or `mm(x, W.T)` of a dequantized `W`; `x` is argument
    /// `input`.
    fn fused_linear(&mut self, c: &Ctx, d: Dequant, input: &str) -> Result<()> {
        let QuantTable {
            packed,
            scales,
            zeros,
            format,
        } = d.table;
        let x = self.t(c, input)?;
        let inputs = vec![Some(x), Some(packed), Some(scales), Some(zeros)];
        let bias = match d.transposed {
            true => None,
            false => self.opt_t(c, "bias")?,
        };
        match bias {
            Some(b) => {
                let y = self.emit1(c, format.linear_op(), inputs)?;
                self.finish(c, Op::Binary(BinaryOp::Add), vec![Some(y), Some(b)])
            }
            None => self.finish(c, format.linear_op(), inputs),
        }
    }

    /// `embedding(W, indices)` of a dequantized `W`: rows of the packed
    /// table, dequantized.
    fn quantized_embedding(&mut self, c: &Ctx, d: Dequant) -> Result<()> {
        let idx = self.t(c, "indices")?;
        let dtype = self.graph.value(d.table.scales).dtype;
        let mut b = Emit { lw: self, c };
        let y = gather_rows(&mut b, d.table, idx, dtype)?;
        self.bind(c, 0, y)
    }
}
