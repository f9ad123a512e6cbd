//! The layout of weight-only quantized weights, which every quantized op
//! shares: int4 (the seed's fpa4w layout: torchao's
//! `_linear_fp_act_4bit_weight`, MLX's affine format, and
//! `metal::gather_qmv` per expert) and int8, the same layout with 8-bit
//! codes.
//!
//! A weight `W [N, K]` with `b`-bit codes ([`QuantFormat::bits`], 4 or 8)
//! is stored as
//! - `packed [N, K·b/8]` uint8, `8/b` codes a byte, element `j` of a byte
//!   in its bits `b·j … b·j + b - 1` (int4: element `2j` in the low
//!   nibble, `2j + 1` in the high nibble; int8: a code a byte); or the
//!   same bytes viewed as `[N, K·b/32]` int32 words (little-endian, element
//!   `w·32/b + i` in bits `b·i …` of word `w`), the form etmetal's passes
//!   give the GPU, which stores int32 verbatim but widens each uint8 to a
//!   word ([`as_words`]);
//! - `scales [N, K/group]` and `zeros [N, K/group]`, float, one per group of
//!   `group` consecutive elements of a row,
//!
//! and `W[n, k] = q[n, k] * scales[n, k / group] + zeros[n, k / group]`,
//! `q` in `0..2^b`. Expert-indexed weights put an expert dim in front of
//! all three. torchao's signed codes with a zero point,
//! `w = (c - zp)·s` for `c` in `qmin..=qmax`, are this layout with
//! `q = c - qmin` and `zero = (qmin - zp)·s` ([`from_signed`]).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::op::Op;
use crate::tensor::Tensor;

/// The group sizes of int4 weights (the seed's kernels take these).
pub const GROUP_SIZES: [usize; 4] = [32, 64, 128, 256];

/// int8 groups are multiples of this (a GPU kernel's K step of 32 lies in
/// one group); a group of all of K is one scale and zero per output
/// channel.
pub const GROUP_QUANTUM: usize = 32;

/// A code width and a group size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantFormat {
    /// 4 or 8.
    pub bits: u32,
    pub group_size: usize,
}

impl QuantFormat {
    pub fn int4(group_size: usize) -> QuantFormat {
        QuantFormat {
            bits: 4,
            group_size,
        }
    }

    pub fn int8(group_size: usize) -> QuantFormat {
        QuantFormat {
            bits: 8,
            group_size,
        }
    }

    /// `int4` or `int8`, for messages.
    pub fn name(self) -> &'static str {
        match self.bits {
            4 => "int4",
            _ => "int8",
        }
    }

    /// Codes in a byte (2 or 1).
    pub fn per_byte(self) -> usize {
        8 / self.bits as usize
    }

    /// Codes in an int32 word (8 or 4).
    pub fn per_word(self) -> usize {
        32 / self.bits as usize
    }

    /// The largest code (15 or 255).
    pub fn max_code(self) -> u32 {
        (1 << self.bits) - 1
    }

    /// The weight-only linear op reading weights of this format.
    pub fn linear_op(self) -> Op {
        match self.bits {
            4 => Op::Int4Linear {
                group_size: self.group_size,
            },
            _ => Op::Int8Linear {
                group_size: self.group_size,
            },
        }
    }

    /// The format of a weight-only linear op, `None` for any other op.
    pub fn of_linear(op: &Op) -> Option<QuantFormat> {
        match *op {
            Op::Int4Linear { group_size } => Some(QuantFormat::int4(group_size)),
            Op::Int8Linear { group_size } => Some(QuantFormat::int8(group_size)),
            _ => None,
        }
    }

    /// Error unless the group size suits this code width and divides `k`:
    /// int4 groups are one of [`GROUP_SIZES`], int8 groups a multiple of
    /// [`GROUP_QUANTUM`] (all of K: per output channel).
    pub fn check_group(self, k: usize) -> Result<()> {
        let g = self.group_size;
        match self.bits {
            4 if !GROUP_SIZES.contains(&g) => {
                return Err(Error::unsupported(format!(
                    "int4 group size {g}: one of {GROUP_SIZES:?} is needed"
                )))
            }
            8 if g == 0 || !g.is_multiple_of(GROUP_QUANTUM) => {
                return Err(Error::unsupported(format!(
                    "int8 group size {g}: a multiple of {GROUP_QUANTUM} is needed"
                )))
            }
            4 | 8 => {}
            b => return Err(Error::unsupported(format!("{b}-bit weights: 4 or 8 bits"))),
        }
        if !k.is_multiple_of(g) {
            return Err(Error::shape(format!(
                "{} group size {g} does not divide K = {k}",
                self.name()
            )));
        }
        Ok(())
    }
}

/// The dims a quantized weight describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantDims {
    /// Leading (expert) count: 1 for a plain weight.
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    pub format: QuantFormat,
}

impl QuantDims {
    pub fn groups(&self) -> usize {
        self.k / self.format.group_size
    }

    pub fn group_size(&self) -> usize {
        self.format.group_size
    }
}

/// Check a quantized weight of `format` for activations with `k`
/// features: the packed tensor, scales and zeros as `(dtype, shape)`,
/// `experts` whether a leading expert dim is expected. Errors say which
/// tensor disagrees and how.
pub fn check_weight(
    format: QuantFormat,
    k: usize,
    packed: (DType, &[usize]),
    scales: (DType, &[usize]),
    zeros: (DType, &[usize]),
    experts: bool,
) -> Result<QuantDims> {
    format.check_group(k)?;
    let name = format.name();
    let group_size = format.group_size;
    let rank = if experts { 3 } else { 2 };
    let per = match packed.0 {
        DType::U8 => format.per_byte(),
        DType::I32 => format.per_word(),
        other => {
            return Err(Error::unsupported(format!(
                "{name} packed weight must be uint8 (or its int32 words), got {other}"
            )))
        }
    };
    if packed.1.len() != rank {
        return Err(Error::shape(format!(
            "{name} packed weight {:?}: rank {rank} expected",
            packed.1
        )));
    }
    let experts_n = if experts { packed.1[0] } else { 1 };
    let n = packed.1[rank - 2];
    if packed.1[rank - 1] * per != k {
        return Err(Error::shape(format!(
            "{name} packed weight {} {:?} holds {} values a row, but K = {k}",
            packed.0,
            packed.1,
            packed.1[rank - 1] * per
        )));
    }
    let mut want = packed.1.to_vec();
    want[rank - 1] = k / group_size;
    for (what, (dtype, shape)) in [("scales", scales), ("zeros", zeros)] {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::unsupported(format!(
                "{name} {what} must be float32, float16 or bfloat16, got {dtype}"
            )));
        }
        if shape != want.as_slice() {
            return Err(Error::shape(format!(
                "{name} {what} {shape:?} disagree with packed weight {:?} and group size \
                 {group_size}: {want:?} expected",
                packed.1
            )));
        }
    }
    Ok(QuantDims {
        experts: experts_n,
        n,
        k,
        format,
    })
}

/// Error unless `dtype` is an activation dtype the quantized kernels take.
pub fn check_activation(what: &str, dtype: DType) -> Result<()> {
    if matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        Ok(())
    } else {
        Err(Error::unsupported(format!(
            "{what} must be float32, float16 or bfloat16, got {dtype}"
        )))
    }
}

/// The int32-word view of a uint8 packed weight (the same bytes); other
/// tensors are returned as they are.
pub fn as_words(packed: &Tensor) -> Result<Tensor> {
    let shape = packed.shape();
    match (packed.dtype(), shape.last()) {
        (DType::U8, Some(&last)) if last % 4 == 0 => {
            let mut words = shape.to_vec();
            *words.last_mut().unwrap_or(&mut 0) = last / 4;
            Tensor::from_bytes(DType::I32, &words, packed.bytes())
        }
        (DType::U8, _) => Err(Error::shape(format!(
            "packed weight {shape:?}: its rows are not whole 32-bit words"
        ))),
        _ => Ok(packed.clone()),
    }
}

/// Pack codes of `bits` bits (4 or 8), `8/bits` a byte (the first in the
/// low bits). `q.len()` must be a multiple of `8/bits`; higher bits of
/// each code are dropped.
pub fn pack(bits: u32, q: &[u8]) -> Vec<u8> {
    match bits {
        4 => {
            let mut out = vec![0; q.len() / 2];
            pack_into(bits, q, &mut out);
            out
        }
        _ => q.to_vec(),
    }
}

/// [`pack`] into `out`, which holds `q.len() * bits / 8` bytes.
pub fn pack_into(bits: u32, q: &[u8], out: &mut [u8]) {
    match bits {
        4 => {
            for (o, p) in out.iter_mut().zip(q.chunks_exact(2)) {
                *o = (p[0] & 15) | ((p[1] & 15) << 4);
            }
        }
        _ => out.copy_from_slice(q),
    }
}

/// The code at element `i` of a packed row or tensor.
#[inline]
pub fn code(bits: u32, packed: &[u8], i: usize) -> u8 {
    match bits {
        4 => (packed[i / 2] >> ((i & 1) * 4)) & 15,
        _ => packed[i],
    }
}

/// Unpack every code (the inverse of [`pack`]).
pub fn unpack(bits: u32, packed: &[u8]) -> Vec<u8> {
    match bits {
        4 => packed.iter().flat_map(|b| [b & 15, b >> 4]).collect(),
        _ => packed.to_vec(),
    }
}

/// torchao's signed codes `c` in `qmin..=qmax` with scale `s` and zero
/// point `zp` (`w = (c - zp)·s`) as this layout's codes `c - qmin` and
/// zero `(qmin - zp)·s`: the codes, and each group's zero.
pub fn from_signed(
    codes: &[i64],
    qmin: i64,
    scales: &[f32],
    zero_points: &[f32],
) -> (Vec<u8>, Vec<f32>) {
    let q = codes.iter().map(|&c| (c - qmin) as u8).collect();
    let zeros = scales
        .iter()
        .zip(zero_points)
        .map(|(s, z)| (qmin as f32 - z) * s)
        .collect();
    (q, zeros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_puts_the_even_element_in_the_low_nibble() {
        let q = [1u8, 2, 15, 0, 7, 9];
        let p = pack(4, &q);
        assert_eq!(p, [0x21, 0x0f, 0x97]);
        assert_eq!(unpack(4, &p), q);
        assert_eq!((0..6).map(|i| code(4, &p, i)).collect::<Vec<_>>(), q);
        // int8: a code a byte
        let q8 = [200u8, 3, 255, 0];
        assert_eq!(pack(8, &q8), q8);
        assert_eq!(unpack(8, &q8), q8);
        assert_eq!(code(8, &q8, 2), 255);
    }

    #[test]
    fn int8_groups_are_multiples_of_32_up_to_a_whole_row() {
        use DType::*;
        // per output channel: one group of all of K
        let ok = check_weight(
            QuantFormat::int8(96),
            96,
            (I32, &[5, 24]),
            (BF16, &[5, 1]),
            (BF16, &[5, 1]),
            false,
        )
        .unwrap();
        assert_eq!((ok.n, ok.groups(), ok.format.per_word()), (5, 1, 4));
        let e = check_weight(
            QuantFormat::int8(48),
            96,
            (U8, &[5, 96]),
            (F32, &[5, 2]),
            (F32, &[5, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("int8 group size 48"), "{e}");
        let e = check_weight(
            QuantFormat::int8(64),
            96,
            (U8, &[5, 96]),
            (F32, &[5, 1]),
            (F32, &[5, 1]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not divide K = 96"), "{e}");
        let e = check_weight(
            QuantFormat::int8(32),
            64,
            (U8, &[5, 32]),
            (F32, &[5, 2]),
            (F32, &[5, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("holds 32 values a row"), "{e}");
        // torchao's signed codes: w = (c - zp)·s = (c + 128)·s + (-128 - zp)·s
        let (q, z) = from_signed(&[-128, 0, 127], -128, &[0.5], &[2.0]);
        assert_eq!((q, z), (vec![0, 128, 255], vec![-65.0]));
    }

    #[test]
    fn weight_checks_name_the_disagreement() {
        use DType::*;
        let ok = check_weight(
            QuantFormat::int4(32),
            64,
            (U8, &[8, 32]),
            (F32, &[8, 2]),
            (BF16, &[8, 2]),
            false,
        )
        .unwrap();
        assert_eq!((ok.n, ok.k, ok.groups(), ok.experts), (8, 64, 2, 1));
        let e = check_weight(
            QuantFormat::int4(64),
            96,
            (U8, &[8, 48]),
            (F32, &[8, 1]),
            (F32, &[8, 1]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not divide K = 96"), "{e}");
        let e = check_weight(
            QuantFormat::int4(32),
            64,
            (U8, &[8, 16]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("holds 32 values a row"), "{e}");
        let words = check_weight(
            QuantFormat::int4(32),
            64,
            (I32, &[8, 8]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        );
        assert_eq!(words.unwrap().k, 64);
        let e = check_weight(
            QuantFormat::int4(32),
            64,
            (U8, &[8, 32]),
            (F32, &[8, 4]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("scales [8, 4]"), "{e}");
        let e = check_weight(
            QuantFormat::int4(48),
            64,
            (U8, &[8, 32]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("group size 48"), "{e}");
        let e = check_weight(
            QuantFormat::int4(32),
            64,
            (I8, &[8, 32]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("uint8"), "{e}");
        let p = Tensor::from_slice(U8, &[1, 4], &[0x21u8, 0x43, 0x65, 0x87]).unwrap();
        let w = as_words(&p).unwrap();
        assert_eq!((w.dtype(), w.shape()), (I32, &[1usize, 1][..]));
        assert_eq!(w.values::<i32>().unwrap()[0] as u32, 0x8765_4321);
        let e = check_weight(
            QuantFormat::int4(32),
            64,
            (U8, &[8, 32]),
            (I32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("scales must be float"), "{e}");
        let ex = check_weight(
            QuantFormat::int4(32),
            64,
            (U8, &[4, 8, 32]),
            (F16, &[4, 8, 2]),
            (F16, &[4, 8, 2]),
            true,
        )
        .unwrap();
        assert_eq!(ex.experts, 4);
        assert!(check_activation("x", I64).is_err());
    }
}
