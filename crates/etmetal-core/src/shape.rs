//! Shapes, strides, dim order and broadcasting. Shapes are `[usize]`, strides
//! are in elements (as PyTorch's) and may be zero for expanded dims.

use crate::error::{Error, Result};

/// Number of elements, or an error when the product overflows.
pub fn numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d).ok_or_else(|| {
            Error::limit(format!(
                "shape {shape:?} has more elements than fit in memory"
            ))
        })
    })
}

/// Row-major strides of a contiguous tensor.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// Whether `strides` describe a row-major contiguous layout of `shape`
/// (dims of size 1 may have any stride, as in PyTorch).
pub fn is_contiguous(shape: &[usize], strides: &[usize]) -> bool {
    let mut expected = 1usize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

/// Dim order (ExecuTorch's `dim_order`): dims sorted from the outermost
/// (largest stride) to the innermost. Contiguous tensors give `0..rank`.
pub fn dim_order(shape: &[usize], strides: &[usize]) -> Vec<u8> {
    let mut order: Vec<usize> = (0..shape.len()).collect();
    // stable sort keeps the natural order between equal strides
    order.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    order.into_iter().map(|d| d as u8).collect()
}

/// NumPy/PyTorch broadcasting of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(format!(
                    "shapes {a:?} and {b:?} do not broadcast"
                )))
            }
        };
    }
    Ok(out)
}

/// Strides (in elements) that read a contiguous tensor of shape `from` as if
/// it had the broadcast shape `to` (zero stride on broadcast dims).
pub fn broadcast_strides(from: &[usize], to: &[usize]) -> Vec<usize> {
    let src = contiguous_strides(from);
    let offset = to.len() - from.len();
    (0..to.len())
        .map(|i| {
            if i < offset || from[i - offset] == 1 {
                0
            } else {
                src[i - offset]
            }
        })
        .collect()
}

/// Normalise a possibly negative dim index against `rank`.
pub fn normalize_dim(dim: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r.max(1) {
        return Err(Error::shape(format!(
            "dim {dim} is out of range for a tensor of rank {rank}"
        )));
    }
    Ok(d as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_contiguity() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert!(is_contiguous(&[2, 3, 4], &[12, 4, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert!(is_contiguous(&[1, 3], &[99, 1]));
        assert_eq!(dim_order(&[2, 3], &[1, 2]), vec![1, 0]);
        assert_eq!(dim_order(&[2, 3, 4], &[12, 4, 1]), vec![0, 1, 2]);
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            broadcast_shapes(&[2, 1, 4], &[3, 1]).unwrap(),
            vec![2, 3, 4]
        );
        assert!(broadcast_shapes(&[2, 3], &[4]).is_err());
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
    }

    #[test]
    fn dims_and_overflow() {
        assert_eq!(normalize_dim(-1, 3).unwrap(), 2);
        assert!(normalize_dim(3, 3).is_err());
        assert!(numel(&[usize::MAX, 2]).is_err());
        assert_eq!(numel(&[]).unwrap(), 1);
    }
}
