//! The int4 weight layout every int4 op shares: the seed's fpa4w layout
//! (torchao's `_linear_fp_act_4bit_weight`, MLX's affine format, and
//! `metal::gather_qmv` per expert).
//!
//! A weight `W [N, K]` is stored as
//! - `packed [N, K/2]` uint8, two 4-bit values a byte: element `2j` in the
//!   low nibble, `2j + 1` in the high nibble; or the same bytes viewed as
//!   `[N, K/8]` int32 words (little-endian, element `8w + i` in bits
//!   `4i..4i+4` of word `w`), the form etmetal's passes give the GPU, which
//!   stores int32 verbatim but widens each uint8 to a word ([`as_words`]);
//! - `scales [N, K/group]` and `zeros [N, K/group]`, float, one per group of
//!   `group` consecutive elements of a row,
//!
//! and `W[n, k] = q[n, k] * scales[n, k / group] + zeros[n, k / group]`,
//! `q` in `0..=15`. Expert-indexed weights put an expert dim in front of
//! all three.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The group sizes the kernels (ours and the seed's) take.
pub const GROUP_SIZES: [usize; 4] = [32, 64, 128, 256];

/// The dims an int4 weight describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int4Dims {
    /// Leading (expert) count: 1 for a plain weight.
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    pub group_size: usize,
}

impl Int4Dims {
    pub fn groups(&self) -> usize {
        self.k / self.group_size
    }
}

/// Check an int4 weight for activations with `k` features: the packed
/// tensor, scales and zeros as `(dtype, shape)`, `experts` whether a leading
/// expert dim is expected. Errors say which tensor disagrees and how.
pub fn check_weight(
    k: usize,
    group_size: usize,
    packed: (DType, &[usize]),
    scales: (DType, &[usize]),
    zeros: (DType, &[usize]),
    experts: bool,
) -> Result<Int4Dims> {
    if !GROUP_SIZES.contains(&group_size) {
        return Err(Error::unsupported(format!(
            "int4 group size {group_size}: one of {GROUP_SIZES:?} is needed"
        )));
    }
    if !k.is_multiple_of(group_size) {
        return Err(Error::shape(format!(
            "int4 group size {group_size} does not divide K = {k}"
        )));
    }
    let rank = if experts { 3 } else { 2 };
    let per = match packed.0 {
        DType::U8 => 2,
        DType::I32 => 8,
        other => {
            return Err(Error::unsupported(format!(
                "int4 packed weight must be uint8 (or its int32 words), got {other}"
            )))
        }
    };
    if packed.1.len() != rank {
        return Err(Error::shape(format!(
            "int4 packed weight {:?}: rank {rank} expected",
            packed.1
        )));
    }
    let experts_n = if experts { packed.1[0] } else { 1 };
    let n = packed.1[rank - 2];
    if packed.1[rank - 1] * per != k {
        return Err(Error::shape(format!(
            "int4 packed weight {} {:?} holds {} values a row, but K = {k}",
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
                "int4 {what} must be float32, float16 or bfloat16, got {dtype}"
            )));
        }
        if shape != want.as_slice() {
            return Err(Error::shape(format!(
                "int4 {what} {shape:?} disagree with packed weight {:?} and group size \
                 {group_size}: {want:?} expected",
                packed.1
            )));
        }
    }
    Ok(Int4Dims {
        experts: experts_n,
        n,
        k,
        group_size,
    })
}

/// Error unless `dtype` is an activation dtype the int4 kernels take.
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
            "int4 packed weight {shape:?}: its rows are not whole 32-bit words"
        ))),
        _ => Ok(packed.clone()),
    }
}

/// Pack values in `0..=15` two a byte (even index in the low nibble).
/// `q.len()` must be even; higher bits of each value are dropped.
pub fn pack(q: &[u8]) -> Vec<u8> {
    q.chunks_exact(2)
        .map(|p| (p[0] & 15) | ((p[1] & 15) << 4))
        .collect()
}

/// The 4-bit value at element `i` of a packed row or tensor.
#[inline]
pub fn nibble(packed: &[u8], i: usize) -> u8 {
    (packed[i / 2] >> ((i & 1) * 4)) & 15
}

/// Unpack every value (the inverse of [`pack`]).
pub fn unpack(packed: &[u8]) -> Vec<u8> {
    packed.iter().flat_map(|b| [b & 15, b >> 4]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_puts_the_even_element_in_the_low_nibble() {
        let q = [1u8, 2, 15, 0, 7, 9];
        let p = pack(&q);
        assert_eq!(p, [0x21, 0x0f, 0x97]);
        assert_eq!(unpack(&p), q);
        assert_eq!((0..6).map(|i| nibble(&p, i)).collect::<Vec<_>>(), q);
    }

    #[test]
    fn weight_checks_name_the_disagreement() {
        use DType::*;
        let ok = check_weight(
            64,
            32,
            (U8, &[8, 32]),
            (F32, &[8, 2]),
            (BF16, &[8, 2]),
            false,
        )
        .unwrap();
        assert_eq!((ok.n, ok.k, ok.groups(), ok.experts), (8, 64, 2, 1));
        let e = check_weight(
            96,
            64,
            (U8, &[8, 48]),
            (F32, &[8, 1]),
            (F32, &[8, 1]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not divide K = 96"), "{e}");
        let e = check_weight(
            64,
            32,
            (U8, &[8, 16]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("holds 32 values a row"), "{e}");
        let words = check_weight(
            64,
            32,
            (I32, &[8, 8]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        );
        assert_eq!(words.unwrap().k, 64);
        let e = check_weight(
            64,
            32,
            (U8, &[8, 32]),
            (F32, &[8, 4]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("scales [8, 4]"), "{e}");
        let e = check_weight(
            64,
            48,
            (U8, &[8, 32]),
            (F32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("group size 48"), "{e}");
        let e = check_weight(
            64,
            32,
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
            64,
            32,
            (U8, &[8, 32]),
            (I32, &[8, 2]),
            (F32, &[8, 2]),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("scales must be float"), "{e}");
        let ex = check_weight(
            64,
            32,
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
