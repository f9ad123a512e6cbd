//! What a program's inputs must look like, and the one check of given
//! inputs against it (shared by the `.pt2` and `.pte` paths).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::numel;
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// An all-ones tensor of this spec (`etmetal run` without `--inputs`).
    pub fn ones(&self) -> Result<Tensor> {
        Tensor::from_f64(self.dtype, &self.shape, &vec![1.0; numel(&self.shape)?])
    }
}

/// Check `inputs` against `specs`: count, dtype and shape, naming the input
/// index, expected and got. A float32 tensor given for a bf16 or f16 input
/// is rounded to it (NumPy has no bfloat16).
pub fn check_inputs(specs: &[TensorSpec], inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
    if inputs.len() != specs.len() {
        return Err(Error::invalid_input(format!(
            "the program takes {} input(s), {} given",
            specs.len(),
            inputs.len()
        )));
    }
    inputs
        .into_iter()
        .zip(specs)
        .enumerate()
        .map(|(i, (t, spec))| {
            let rounds = t.dtype() == DType::F32 && matches!(spec.dtype, DType::BF16 | DType::F16);
            let t = if rounds { t.cast(spec.dtype)? } else { t };
            if t.dtype() != spec.dtype || t.shape() != spec.shape.as_slice() {
                return Err(Error::invalid_input(format!(
                    "input {i}: expected {} {:?}, got {} {:?}",
                    spec.dtype,
                    spec.shape,
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(t)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_count_dtype_and_shape() {
        let specs = [TensorSpec {
            dtype: DType::BF16,
            shape: vec![2],
        }];
        let err = check_inputs(&specs, vec![]).unwrap_err().to_string();
        assert!(err.contains("takes 1 input(s), 0 given"), "{err}");
        let f64s = Tensor::zeros(DType::F64, &[2]).unwrap();
        let err = check_inputs(&specs, vec![f64s]).unwrap_err().to_string();
        assert!(
            err.contains("input 0: expected bfloat16 [2], got float64 [2]"),
            "{err}"
        );
        let wide = Tensor::zeros(DType::F32, &[3]).unwrap();
        assert!(check_inputs(&specs, vec![wide]).is_err());
        let ok = check_inputs(
            &specs,
            vec![Tensor::from_f32(DType::F32, &[2], &[1.0, 2.5]).unwrap()],
        )
        .unwrap();
        assert_eq!(ok[0].dtype(), DType::BF16);
        assert_eq!(specs[0].ones().unwrap().to_f32_vec(), vec![1.0, 1.0]);
    }
}
