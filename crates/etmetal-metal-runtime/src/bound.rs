//! A dynamic delegate input or output (payload 1.3) lives on the GPU in
//! the layout of its upper bound: row-major strides of the bound shape.
//! The host tensor is contiguous at its actual shape, so crossing moves it
//! in runs: the elements that are adjacent in both layouts.

use etmetal_core::{DType, Result};
use etmetal_metal::payload::GpuRepr;

/// `(start in the actual layout, start in the bound layout, length)` of
/// each run, in elements, in order; one run at 0 when the actual tensor
/// is the start of the bound layout.
pub(crate) fn runs(actual: &[usize], bound: &[usize]) -> Vec<(usize, usize, usize)> {
    let numel: usize = actual.iter().product();
    // the last dim that differs: everything after it is whole
    let Some(d) = (0..actual.len()).rev().find(|&d| actual[d] != bound[d]) else {
        return vec![(0, 0, numel)];
    };
    let inner: usize = bound[d + 1..].iter().product();
    let len = actual[d] * inner;
    if numel == 0 {
        return vec![];
    }
    if actual[..d].iter().zip(&bound[..d]).all(|(_, &b)| b == 1) {
        return vec![(0, 0, len)];
    }
    let outer = &actual[..d];
    let count: usize = outer.iter().product();
    (0..count)
        .map(|i| {
            // the bound-layout offset of outer multi-index i (row-major)
            let (mut rest, mut at, mut stride) = (i, 0, bound[d] * inner);
            for k in (0..d).rev() {
                at += (rest % outer[k]) * stride;
                rest /= outer[k];
                stride *= bound[k];
            }
            (i * len, at, len)
        })
        .collect()
}

/// The bytes of a region (`size` at the bound) that hold a tensor of
/// `actual` shape laid out as `bound`: up to its last valid element, in
/// whole words (what an execute copies across, not the whole bound).
pub(crate) fn valid_bytes(
    dtype: DType,
    actual: &[usize],
    bound: &[usize],
    size: u64,
) -> Result<u64> {
    let end = runs(actual, bound)
        .last()
        .map_or(0, |&(_, to, len)| to + len);
    let bytes = (end * element_bytes(dtype)?) as u64;
    Ok(bytes.next_multiple_of(4).clamp(4, size.max(4)).min(size))
}

/// GPU bytes of one element of `dtype` ([`GpuRepr`]).
pub(crate) fn element_bytes(dtype: DType) -> Result<usize> {
    let repr = GpuRepr::of(dtype)?;
    Ok(if repr.same_layout() { dtype.size() } else { 4 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_place_each_row_at_its_bound_offset() {
        // [2, s=2, 3] in [2, 4, 3]: rows of 6 at 0 and 12
        assert_eq!(runs(&[2, 2, 3], &[2, 4, 3]), [(0, 0, 6), (6, 12, 6)]);
        // a leading dynamic dim: one run
        assert_eq!(runs(&[3, 5], &[8, 5]), [(0, 0, 15)]);
        assert_eq!(runs(&[1, 3, 5], &[1, 8, 5]), [(0, 0, 15)]);
        assert_eq!(runs(&[4, 5], &[4, 5]), [(0, 0, 20)]);
        // two dynamic dims: [b=2, s=1, 2] in [3, 2, 2]
        assert_eq!(runs(&[2, 1, 2], &[3, 2, 2]), [(0, 0, 2), (2, 4, 2)]);
    }

    #[test]
    fn an_execute_copies_up_to_the_last_valid_element() {
        // [2, s=2, 3] f32 in [2, 4, 3] (96 bytes): up to element 18
        assert_eq!(
            valid_bytes(DType::F32, &[2, 2, 3], &[2, 4, 3], 96).unwrap(),
            72
        );
        // three bf16 of eight: 6 bytes, a whole word more
        assert_eq!(valid_bytes(DType::BF16, &[3], &[8], 16).unwrap(), 8);
        assert_eq!(valid_bytes(DType::F32, &[8], &[8], 32).unwrap(), 32);
    }
}
