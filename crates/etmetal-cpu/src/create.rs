//! Tensors made from attributes alone: `full` and `arange`.

use etmetal_core::{DType, Error, Result, Scalar, Tensor};

pub fn full(shape: &[usize], value: Scalar, dtype: DType) -> Result<Tensor> {
    let n = etmetal_core::shape::numel(shape)?;
    match value {
        Scalar::Float(v) => Tensor::from_f64(dtype, shape, &vec![v; n]),
        Scalar::Int(_) | Scalar::Bool(_) => {
            Tensor::from_i64(dtype, shape, &vec![value.to_i64(); n])
        }
    }
}

/// `arange(start, end, step)`: `ceil((end - start) / step)` values
/// `start + i * step`, exact in i64 when every bound is an integer.
pub fn arange(start: Scalar, end: Scalar, step: Scalar, dtype: DType) -> Result<Tensor> {
    let bad =
        |why: &str| Error::invalid_input(format!("arange({start:?}, {end:?}, {step:?}): {why}"));
    let ints = [start, end, step]
        .iter()
        .all(|s| !matches!(s, Scalar::Float(_)));
    if ints && !dtype.is_float() {
        let (a, b, s) = (start.to_i64(), end.to_i64(), step.to_i64());
        if s == 0 {
            return Err(bad("step must be non-zero"));
        }
        let span = (b as i128) - (a as i128);
        if span != 0 && (span > 0) != (s > 0) {
            return Err(bad("the bounds are inconsistent with the sign of the step"));
        }
        let (span, s128) = (span.abs(), (s as i128).abs());
        let len =
            usize::try_from((span + s128 - 1) / s128).map_err(|_| bad("too many elements"))?;
        etmetal_core::shape::numel(&[len, dtype.size()])?;
        let vals: Vec<i64> = (0..len as i64)
            .map(|i| a.wrapping_add(i.wrapping_mul(s)))
            .collect();
        return Tensor::from_i64(dtype, &[len], &vals);
    }
    let (a, b, s) = (start.to_f64(), end.to_f64(), step.to_f64());
    if s == 0.0 || !s.is_finite() || !a.is_finite() || !b.is_finite() {
        return Err(bad("bounds and step must be finite and the step non-zero"));
    }
    let len = ((b - a) / s).ceil();
    if len < 0.0 {
        return Err(bad("the bounds are inconsistent with the sign of the step"));
    }
    if len > (isize::MAX as f64) / 8.0 {
        return Err(bad("too many elements"));
    }
    let len = len as usize;
    let vals: Vec<f64> = (0..len).map(|i| a + i as f64 * s).collect();
    Tensor::from_f64(dtype, &[len], &vals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arange_lengths_follow_pytorch() {
        // torch.arange(0, 1, 0.3) -> [0.0, 0.3, 0.6, 0.9] (PyTorch 2.15)
        let t = arange(
            Scalar::Int(0),
            Scalar::Int(1),
            Scalar::Float(0.3),
            DType::F32,
        )
        .unwrap();
        assert_eq!(t.to_f32_vec(), vec![0.0, 0.3, 0.6, 0.9]);
        // torch.arange(-1., 1., 0.1): 20 values ending 0.7, 0.8, 0.9
        let t = arange(
            Scalar::Float(-1.0),
            Scalar::Float(1.0),
            Scalar::Float(0.1),
            DType::F32,
        )
        .unwrap();
        assert_eq!(&t.to_f32_vec()[17..], &[0.7, 0.8, 0.9]);
        // torch.arange(5, -3, -3) -> [5, 2, -1]
        let t = arange(Scalar::Int(5), Scalar::Int(-3), Scalar::Int(-3), DType::I64).unwrap();
        assert_eq!(t.to_i64_vec(), vec![5, 2, -1]);
        let big = i64::MAX - 2;
        let t = arange(
            Scalar::Int(big),
            Scalar::Int(i64::MAX),
            Scalar::Int(1),
            DType::I64,
        )
        .unwrap();
        assert_eq!(t.to_i64_vec(), vec![big, big + 1]);
        assert_eq!(
            arange(Scalar::Int(3), Scalar::Int(3), Scalar::Int(1), DType::I32)
                .unwrap()
                .shape(),
            &[0]
        );
        assert!(arange(Scalar::Int(0), Scalar::Int(5), Scalar::Int(-1), DType::I64).is_err());
        assert!(arange(Scalar::Int(0), Scalar::Int(5), Scalar::Int(0), DType::I64).is_err());
    }

    #[test]
    fn full_is_exact_for_ints() {
        let t = full(&[2, 1], Scalar::Int(i64::MIN), DType::I64).unwrap();
        assert_eq!(t.to_i64_vec(), vec![i64::MIN; 2]);
        let t = full(&[3], Scalar::Float(1.0 / 3.0), DType::BF16).unwrap();
        assert_eq!(t.to_f32_vec(), vec![171.0 / 512.0; 3]);
        assert_eq!(
            full(&[], Scalar::Bool(true), DType::Bool)
                .unwrap()
                .to_i64_vec(),
            vec![1]
        );
    }
}
