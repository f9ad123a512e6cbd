//! Host tensors: contiguous, row-major, with owned or shared bytes.
//!
//! Every etmetal tensor on the host is contiguous; strided sources (a `.pt2`
//! storage viewed with strides, a permuted view) are materialised when they
//! are read. Shared bytes let constants borrow a memory-mapped file.

use std::borrow::Cow;
use std::sync::Arc;

use bytemuck::Pod;
use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::numel;

/// The bytes behind a tensor.
#[derive(Clone)]
enum Bytes {
    /// Owned, 8-byte aligned so every dtype can be viewed in place.
    Owned { words: Vec<u64>, len: usize },
    /// A window into shared memory (a mapped file, a loaded archive).
    Shared {
        data: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
        len: usize,
    },
}

/// `data` as 8-byte words (the tail zero-padded), copied straight in: no
/// zeroing pass first, which would double the work for large tensors.
fn words_of(data: &[u8]) -> Vec<u64> {
    let n = data.len().div_ceil(8);
    let mut words: Vec<u64> = Vec::with_capacity(n);
    // SAFETY: the capacity holds n * 8 >= data.len() bytes; the first
    // data.len() are copied from `data` and the rest zeroed, so all n words
    // are initialised before the length is set.
    unsafe {
        let dst = words.as_mut_ptr().cast::<u8>();
        std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
        std::ptr::write_bytes(dst.add(data.len()), 0, n * 8 - data.len());
        words.set_len(n);
    }
    words
}

/// Owned words behind a shared handle ([`Tensor::into_shared`]): 8-byte
/// aligned, as owned bytes are.
struct Words {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Words {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// One element of `dtype` (its little-endian bytes `c`) as f64.
fn element_f64(dtype: DType, c: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(c.try_into().unwrap()) as f64,
        DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
        DType::F16 => f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
        DType::BF16 => bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
        DType::Bool | DType::U8 => c[0] as f64,
        DType::I8 => c[0] as i8 as f64,
        DType::I16 => i16::from_le_bytes(c.try_into().unwrap()) as f64,
        DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f64,
        DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
    }
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
            Bytes::Shared { data, offset, len } => &(**data).as_ref()[*offset..*offset + *len],
        }
    }
}

/// A contiguous tensor in borrowed memory (a planned arena, a mapped file,
/// a [`Tensor`]'s storage), seen as a dtype and a shape.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// A contiguous tensor in borrowed memory that a kernel or delegate writes
/// (where a result goes, so that it is not copied there afterwards).
pub struct ViewMut<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a mut [u8],
}

// (dtype and shape only: the bytes of a large tensor are no message)
impl std::fmt::Debug for View<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "View({}, {:?})", self.dtype, self.shape)
    }
}

impl std::fmt::Debug for ViewMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ViewMut({}, {:?})", self.dtype, self.shape)
    }
}

impl<'a> View<'a> {
    pub fn of(t: &'a Tensor) -> View<'a> {
        View {
            dtype: t.dtype,
            shape: &t.shape,
            bytes: t.bytes(),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as f32, when the dtype is f32 and the bytes are aligned.
    pub fn f32s(&self) -> Option<&'a [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }
}

impl<'a> ViewMut<'a> {
    /// A view of `t`'s own storage (made owned first if it was shared).
    pub fn of(t: &'a mut Tensor) -> ViewMut<'a> {
        t.make_owned();
        let Tensor {
            dtype,
            shape,
            bytes,
        } = t;
        let Bytes::Owned { words, len } = bytes else {
            unreachable!("made owned above")
        };
        ViewMut {
            dtype: *dtype,
            shape,
            bytes: &mut bytemuck::cast_slice_mut(words)[..*len],
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as f32, when the dtype is f32 and the bytes are aligned.
    pub fn f32s(&mut self) -> Option<&mut [f32]> {
        if self.dtype != DType::F32 {
            return None;
        }
        bytemuck::try_cast_slice_mut(self.bytes).ok()
    }
}

#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Bytes,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?})", self.dtype, self.shape)
    }
}

fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize> {
    numel(shape)?
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::limit(format!("a {dtype} tensor of shape {shape:?} is too large")))
}

impl Tensor {
    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let len = byte_len(dtype, shape)?;
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            bytes: Bytes::Owned {
                words: vec![0; len.div_ceil(8)],
                len,
            },
        })
    }

    /// A tensor from raw little-endian bytes; the length must match.
    pub fn from_bytes(dtype: DType, shape: &[usize], data: &[u8]) -> Result<Tensor> {
        let len = byte_len(dtype, shape)?;
        if data.len() != len {
            return Err(Error::format(format!(
                "{} bytes given for a {dtype} tensor of shape {shape:?}, which needs {len}",
                data.len(),
            )));
        }
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            bytes: Bytes::Owned {
                words: words_of(data),
                len,
            },
        })
    }

    /// A tensor that borrows `len` bytes at `offset` of shared memory.
    pub fn from_shared(
        dtype: DType,
        shape: &[usize],
        data: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
    ) -> Result<Tensor> {
        let len = byte_len(dtype, shape)?;
        let available = (*data).as_ref().len();
        if offset.checked_add(len).is_none_or(|end| end > available) {
            return Err(Error::format(format!(
                "a {dtype} tensor of shape {shape:?} needs bytes {offset}..{} but only {available} exist",
                offset.saturating_add(len)
            )));
        }
        Ok(Tensor {
            dtype,
            shape: shape.to_vec(),
            bytes: Bytes::Shared { data, offset, len },
        })
    }

    /// A tensor from typed values; `T` must be the storage type of `dtype`
    /// (`f32` for F32, `u16` bits or `bf16` for BF16, `u8` for Bool, …).
    pub fn from_slice<T: Pod>(dtype: DType, shape: &[usize], values: &[T]) -> Result<Tensor> {
        if std::mem::size_of::<T>() != dtype.size() {
            return Err(Error::internal(format!(
                "element of {} bytes given for {dtype}",
                std::mem::size_of::<T>()
            )));
        }
        Tensor::from_bytes(dtype, shape, bytemuck::cast_slice(values))
    }

    /// A tensor from f32 values, converted (rounded to nearest even for
    /// bf16/f16, `!= 0` for bool, to integers as PyTorch on x86 does:
    /// NaN and values out of range give the minimum of int64 or int32).
    pub fn from_f32(dtype: DType, shape: &[usize], values: &[f32]) -> Result<Tensor> {
        let f64s: Vec<f64> = values.iter().map(|&v| v as f64).collect();
        Tensor::from_f64(dtype, shape, &f64s)
    }

    /// A tensor from f64 values, converted as in [`Tensor::from_f32`].
    pub fn from_f64(dtype: DType, shape: &[usize], values: &[f64]) -> Result<Tensor> {
        let mut t = Tensor::zeros(dtype, shape)?;
        if values.len() != t.numel() {
            return Err(Error::internal(format!(
                "{} values given for shape {shape:?}",
                values.len()
            )));
        }
        let out = t.bytes_mut();
        let w = dtype.size();
        for (i, &v) in values.iter().enumerate() {
            let dst = &mut out[i * w..(i + 1) * w];
            match dtype {
                DType::F32 => dst.copy_from_slice(&(v as f32).to_le_bytes()),
                DType::F64 => dst.copy_from_slice(&v.to_le_bytes()),
                DType::F16 => dst.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
                DType::BF16 => dst.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
                DType::Bool => dst[0] = (v != 0.0) as u8,
                DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64 => {
                    dst.copy_from_slice(&float_to_int(v, dtype).to_le_bytes()[..w])
                }
            }
        }
        Ok(t)
    }

    /// A tensor from i64 values (exact for integer dtypes).
    pub fn from_i64(dtype: DType, shape: &[usize], values: &[i64]) -> Result<Tensor> {
        if dtype.is_float() {
            let f: Vec<f64> = values.iter().map(|&v| v as f64).collect();
            return Tensor::from_f64(dtype, shape, &f);
        }
        let mut t = Tensor::zeros(dtype, shape)?;
        if values.len() != t.numel() {
            return Err(Error::internal(format!(
                "{} values given for shape {shape:?}",
                values.len()
            )));
        }
        let w = dtype.size();
        let out = t.bytes_mut();
        for (i, &v) in values.iter().enumerate() {
            let dst = &mut out[i * w..(i + 1) * w];
            match dtype {
                DType::Bool => dst[0] = (v != 0) as u8,
                _ => dst.copy_from_slice(&v.to_le_bytes()[..w]),
            }
        }
        Ok(t)
    }

    pub fn scalar_f64(dtype: DType, value: f64) -> Result<Tensor> {
        Tensor::from_f64(dtype, &[], &[value])
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        self.nbytes() / self.dtype.size()
    }
    pub fn nbytes(&self) -> usize {
        match &self.bytes {
            Bytes::Owned { len, .. } | Bytes::Shared { len, .. } => *len,
        }
    }
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// Copy shared bytes into an owned buffer (no-op when owned).
    fn make_owned(&mut self) {
        if let Bytes::Shared { len, .. } = self.bytes {
            let words = words_of(self.bytes.as_slice());
            self.bytes = Bytes::Owned { words, len };
        }
    }

    /// Mutable bytes; shared bytes are copied into an owned buffer first.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.make_owned();
        match &mut self.bytes {
            Bytes::Owned { words, len } => &mut bytemuck::cast_slice_mut(words)[..*len],
            Bytes::Shared { .. } => unreachable!("converted to owned above"),
        }
    }

    /// The elements as `T` (which must be the storage type of the dtype);
    /// borrowed when aligned, copied otherwise.
    pub fn values<T: Pod>(&self) -> Result<Cow<'_, [T]>> {
        if std::mem::size_of::<T>() != self.dtype.size() {
            return Err(Error::internal(format!(
                "cannot view {} as elements of {} bytes",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        let bytes = self.bytes();
        Ok(match bytemuck::try_cast_slice(bytes) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
        })
    }

    /// Mutable typed view of an owned tensor.
    pub fn values_mut<T: Pod>(&mut self) -> Result<&mut [T]> {
        if std::mem::size_of::<T>() != self.dtype.size() {
            return Err(Error::internal(format!(
                "cannot view {} as elements of {} bytes",
                self.dtype,
                std::mem::size_of::<T>()
            )));
        }
        Ok(bytemuck::cast_slice_mut(self.bytes_mut()))
    }

    /// Every element converted to f64 (exact for all dtypes but i64 beyond 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let b = self.bytes();
        let w = self.dtype.size();
        b.chunks_exact(w)
            .map(|c| element_f64(self.dtype, c))
            .collect()
    }

    /// Every element converted to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self
                .values::<f32>()
                .map(|v| v.into_owned())
                .unwrap_or_default(),
            _ => {
                let mut out = vec![0.0; self.numel()];
                self.read_f32(0, &mut out);
                out
            }
        }
    }

    /// Elements `start..start + out.len()` converted to f32 into `out`, as
    /// [`Tensor::to_f32_vec`] converts them: a part of a large tensor
    /// without converting all of it (bf16 and f16 straight to f32, which
    /// is exact; the other dtypes through f64). Panics past the end.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        let w = self.dtype.size();
        let bytes = &self.bytes()[start * w..(start + out.len()) * w];
        let chunks = bytes.chunks_exact(w);
        match self.dtype {
            DType::F32 => {
                for (o, c) in out.iter_mut().zip(chunks) {
                    *o = f32::from_le_bytes(c.try_into().unwrap());
                }
            }
            DType::BF16 => {
                for (o, c) in out.iter_mut().zip(chunks) {
                    *o = bf16::from_le_bytes(c.try_into().unwrap()).to_f32();
                }
            }
            DType::F16 => {
                for (o, c) in out.iter_mut().zip(chunks) {
                    *o = f16::from_le_bytes(c.try_into().unwrap()).to_f32();
                }
            }
            dtype => {
                for (o, c) in out.iter_mut().zip(chunks) {
                    *o = element_f64(dtype, c) as f32;
                }
            }
        }
    }

    /// The same tensor with its bytes behind a shared handle: a clone
    /// shares them instead of copying (an owned tensor's bytes are moved,
    /// not copied; mutable access copies them out again).
    pub fn into_shared(self) -> Tensor {
        match self.bytes {
            Bytes::Owned { words, len } => Tensor {
                bytes: Bytes::Shared {
                    data: Arc::new(Words { words, len }),
                    offset: 0,
                    len,
                },
                ..self
            },
            Bytes::Shared { .. } => self,
        }
    }

    /// Every element converted to i64 (floats truncated towards zero).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        let b = self.bytes();
        let w = self.dtype.size();
        match self.dtype {
            DType::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            DType::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
                .collect(),
            DType::I16 => b
                .chunks_exact(2)
                .map(|c| i16::from_le_bytes(c.try_into().unwrap()) as i64)
                .collect(),
            DType::I8 => b.iter().map(|&v| v as i8 as i64).collect(),
            DType::U8 | DType::Bool => b.iter().map(|&v| v as i64).collect(),
            _ => {
                let _ = w;
                self.to_f64_vec().into_iter().map(|v| v as i64).collect()
            }
        }
    }

    /// The same bytes under another shape with the same element count.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape)? != self.numel() {
            return Err(Error::shape(format!(
                "cannot view a tensor of shape {:?} as {shape:?}",
                self.shape
            )));
        }
        Ok(Tensor {
            dtype: self.dtype,
            shape: shape.to_vec(),
            bytes: self.bytes.clone(),
        })
    }

    /// Converted to another dtype (same conversions as [`Tensor::from_f64`];
    /// integer-to-integer conversions are exact).
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype {
            return Ok(self.clone());
        }
        if !self.dtype.is_float() && !dtype.is_float() {
            return Tensor::from_i64(dtype, &self.shape, &self.to_i64_vec());
        }
        Tensor::from_f64(dtype, &self.shape, &self.to_f64_vec())
    }
}

/// `v` converted to integer `dtype` (its two's-complement bits in the low
/// bytes) as PyTorch's casts do on x86, whose truncating conversion
/// (`cvttsd2si`) gives the type's minimum for NaN, ±inf and values out of
/// range: int64 and int32 convert directly; the narrower types through
/// int32, keeping its low bits (`-3.7` → uint8 253, `inf` → int8 0).
/// Rust's `as` would saturate instead (`-inf` → `i64::MIN` but `inf` →
/// `i64::MAX`, NaN → 0). `log(0)` cast to int64 (T5's position buckets)
/// depends on this.
fn float_to_int(v: f64, dtype: DType) -> i64 {
    let trunc = |bits: u32| {
        let limit = 2f64.powi(bits as i32 - 1);
        if v.is_nan() || v < -limit || v >= limit {
            i64::MIN >> (64 - bits)
        } else {
            v as i64
        }
    };
    match dtype {
        DType::I64 => trunc(64),
        _ => trunc(32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_and_shared_views_agree() {
        let t = Tensor::from_f32(DType::F32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(t.values::<f32>().unwrap().as_ref(), &[1.0, 2.0, 3.0, 4.0]);
        let mut raw = vec![0u8; 3];
        raw.extend_from_slice(t.bytes());
        let shared: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(raw);
        let s = Tensor::from_shared(DType::F32, &[4], shared.clone(), 3).unwrap();
        assert_eq!(s.to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0]);
        assert!(Tensor::from_shared(DType::F32, &[5], shared, 3).is_err());
    }

    #[test]
    fn half_floats_widen_to_f32_as_through_f64() {
        // every bit pattern, NaNs included: the direct widening to f32
        // gives the bits the f64 route gave
        for dtype in [DType::BF16, DType::F16] {
            let bits: Vec<u16> = (0..=u16::MAX).collect();
            let t = Tensor::from_slice(dtype, &[bits.len()], &bits).unwrap();
            let direct: Vec<u32> = t.to_f32_vec().iter().map(|v| v.to_bits()).collect();
            let through: Vec<u32> = t
                .to_f64_vec()
                .iter()
                .map(|&v| (v as f32).to_bits())
                .collect();
            assert_eq!(direct, through, "{dtype}");
            let mut part = vec![0.0f32; 5];
            t.read_f32(0x3f80, &mut part);
            let part: Vec<u32> = part.iter().map(|v| v.to_bits()).collect();
            assert_eq!(part, direct[0x3f80..0x3f85], "{dtype}");
        }
    }

    #[test]
    fn a_shared_tensor_keeps_its_bytes_and_copies_on_write() {
        let t = Tensor::from_f32(DType::F32, &[3], &[1.0, 2.0, 3.0]).unwrap();
        let shared = t.clone().into_shared();
        assert_eq!(shared.bytes(), t.bytes());
        // a clone shares the bytes; writing copies them
        let mut other = shared.clone();
        assert_eq!(other.bytes().as_ptr(), shared.bytes().as_ptr());
        other.values_mut::<f32>().unwrap()[0] = 9.0;
        assert_eq!(shared.to_f32_vec(), [1.0, 2.0, 3.0]);
        assert_eq!(other.to_f32_vec(), [9.0, 2.0, 3.0]);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 lies exactly between two bf16 values; even mantissa wins.
        let t = Tensor::from_f32(DType::BF16, &[1], &[1.0 + 1.0 / 256.0]).unwrap();
        assert_eq!(t.to_f32_vec(), vec![1.0]);
        let t = Tensor::from_f32(DType::BF16, &[1], &[1.0 + 3.0 / 256.0]).unwrap();
        assert_eq!(t.to_f32_vec(), vec![1.0 + 4.0 / 256.0]);
    }

    #[test]
    fn float_to_int_casts_as_pytorch_on_x86() {
        let v = [
            f64::NEG_INFINITY,
            f64::INFINITY,
            f64::NAN,
            1e30,
            3e9,
            3.7,
            -3.7,
        ];
        let cast = |dtype| Tensor::from_f64(dtype, &[7], &v).unwrap().to_i64_vec();
        // torch.tensor(v).to(dtype) on x86-64, torch 2.15
        let min = i64::MIN;
        assert_eq!(cast(DType::I64), [min, min, min, min, 3_000_000_000, 3, -3]);
        let min = i32::MIN as i64;
        assert_eq!(cast(DType::I32), [min, min, min, min, min, 3, -3]);
        assert_eq!(cast(DType::I16), [0, 0, 0, 0, 0, 3, -3]);
        assert_eq!(cast(DType::I8), [0, 0, 0, 0, 0, 3, -3]);
        assert_eq!(cast(DType::U8), [0, 0, 0, 0, 0, 3, 253]);
    }

    #[test]
    fn casts_and_sizes() {
        let t = Tensor::from_i64(DType::I64, &[3], &[i64::MAX, -1, 0]).unwrap();
        assert_eq!(
            t.cast(DType::I64).unwrap().to_i64_vec(),
            vec![i64::MAX, -1, 0]
        );
        assert_eq!(t.cast(DType::Bool).unwrap().to_i64_vec(), vec![1, 1, 0]);
        assert!(Tensor::from_bytes(DType::F32, &[2], &[0; 7]).is_err());
        assert!(Tensor::zeros(DType::F64, &[usize::MAX / 4, 4]).is_err());
        assert!(t.reshape(&[2]).is_err());
    }
}
