//! What a program's inputs must look like, and the one check of given
//! inputs against it (shared by the `.pt2` and `.pte` paths).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::numel;
use crate::tensor::Tensor;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub dtype: DType,
    /// Each dim's size; for a dynamic dim, its upper bound.
    pub shape: Vec<usize>,
    /// Which dims are dynamic (any size up to `shape[d]`); empty when every
    /// dim is static. An ExecuTorch `DYNAMIC_BOUND` tensor has every dim
    /// dynamic: the format bounds the tensor, not each dim.
    pub dynamic: Vec<bool>,
}

impl TensorSpec {
    /// A static spec.
    pub fn new(dtype: DType, shape: Vec<usize>) -> TensorSpec {
        TensorSpec {
            dtype,
            shape,
            dynamic: vec![],
        }
    }

    pub fn is_dynamic(&self) -> bool {
        self.dynamic.iter().any(|&d| d)
    }

    /// Whether dim `d` is dynamic (any size up to `shape[d]`).
    pub fn dim_is_dynamic(&self, d: usize) -> bool {
        self.dynamic.get(d).copied().unwrap_or(false)
    }

    /// The shape as a user reads it: `[<=8, 4]` marks dim 0 dynamic up to 8.
    pub fn shape_text(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .enumerate()
            .map(|(d, s)| {
                if self.dim_is_dynamic(d) {
                    format!("<={s}")
                } else {
                    s.to_string()
                }
            })
            .collect();
        format!("[{}]", dims.join(", "))
    }

    /// An all-ones tensor of this spec at its largest shape (`etmetal run`
    /// without `--inputs`).
    pub fn ones(&self) -> Result<Tensor> {
        Tensor::from_f64(self.dtype, &self.shape, &vec![1.0; numel(&self.shape)?])
    }

    /// Why `shape` does not fit this spec, if it does not: same rank,
    /// static dims equal, dynamic dims at most their bound.
    pub fn mismatch(&self, shape: &[usize]) -> Option<String> {
        if shape.len() != self.shape.len() {
            return Some(format!(
                "rank {} (shape {shape:?}), expected rank {} ({})",
                shape.len(),
                self.shape.len(),
                self.shape_text()
            ));
        }
        shape
            .iter()
            .zip(&self.shape)
            .enumerate()
            .find_map(|(d, (&got, &bound))| {
                if self.dim_is_dynamic(d) {
                    (got > bound).then(|| {
                        format!("dim {d} is {got}, above its upper bound {bound} (shape {shape:?}, spec {})", self.shape_text())
                    })
                } else {
                    (got != bound).then(|| {
                        format!("dim {d} is {got}, expected {bound} (shape {shape:?}, spec {})", self.shape_text())
                    })
                }
            })
    }
}

/// Check `inputs` against `specs`: count, dtype and shape (dynamic dims up
/// to their bound), naming the input index, expected and got. A float32
/// tensor given for a bf16 or f16 input is rounded to it (NumPy has no
/// bfloat16).
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
            let why = spec.mismatch(t.shape());
            if t.dtype() != spec.dtype || (why.is_some() && !spec.is_dynamic()) {
                return Err(Error::invalid_input(format!(
                    "input {i}: expected {} {}, got {} {:?}",
                    spec.dtype,
                    spec.shape_text(),
                    t.dtype(),
                    t.shape()
                )));
            }
            // a dynamic input: which dim is off, and its bound
            if let Some(why) = why {
                return Err(Error::invalid_input(format!("input {i}: {why}")));
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
        let specs = [TensorSpec::new(DType::BF16, vec![2])];
        let err = check_inputs(&specs, vec![]).unwrap_err().to_string();
        assert!(err.contains("takes 1 input(s), 0 given"), "{err}");
        let f64s = Tensor::zeros(DType::F64, &[2]).unwrap();
        let err = check_inputs(&specs, vec![f64s]).unwrap_err().to_string();
        assert!(
            err.contains("input 0: expected bfloat16 [2], got float64 [2]"),
            "{err}"
        );
        let wide = Tensor::zeros(DType::F32, &[3]).unwrap();
        let err = check_inputs(&specs, vec![wide]).unwrap_err().to_string();
        assert!(
            err.contains("input 0: expected bfloat16 [2], got bfloat16 [3]"),
            "{err}"
        );
        let ok = check_inputs(
            &specs,
            vec![Tensor::from_f32(DType::F32, &[2], &[1.0, 2.5]).unwrap()],
        )
        .unwrap();
        assert_eq!(ok[0].dtype(), DType::BF16);
        assert_eq!(specs[0].ones().unwrap().to_f32_vec(), vec![1.0, 1.0]);
    }

    #[test]
    fn dynamic_dims_take_any_size_up_to_their_bound() {
        let spec = TensorSpec {
            dtype: DType::F32,
            shape: vec![8, 4],
            dynamic: vec![true, false],
        };
        assert_eq!(spec.shape_text(), "[<=8, 4]");
        for rows in [0, 1, 5, 8] {
            let t = Tensor::zeros(DType::F32, &[rows, 4]).unwrap();
            assert!(check_inputs(std::slice::from_ref(&spec), vec![t]).is_ok());
        }
        let check = |shape: &[usize]| {
            let t = Tensor::zeros(DType::F32, shape).unwrap();
            check_inputs(std::slice::from_ref(&spec), vec![t])
                .unwrap_err()
                .to_string()
        };
        let err = check(&[9, 4]);
        assert!(
            err.contains("input 0: dim 0 is 9, above its upper bound 8"),
            "{err}"
        );
        assert!(check(&[2, 3]).contains("dim 1 is 3, expected 4"));
        assert!(check(&[2]).contains("rank 1 (shape [2]), expected rank 2 ([<=8, 4])"));
        assert_eq!(spec.ones().unwrap().shape(), &[8, 4]);
    }
}
