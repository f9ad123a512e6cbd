//! Host tensors to and from their GPU form ([`GpuRepr`]), converted in
//! one pass, in parallel, straight between the tensor's own memory and a
//! mapped staging buffer: no intermediate copy on either side.

use etmetal_core::{Error, Result, View, ViewMut};
use etmetal_metal::payload::{gpu_bytes, gpu_words, host_from_gpu, int64_does_not_fit, GpuRepr};
use rayon::prelude::*;
use wgpu::WriteOnly;

/// Conversion units ([`GpuRepr::unit`]) per parallel task:
/// 256 KiB and more of copying keeps rayon's per-task cost under 1%, and
/// still gives every core of a 16-core host work from 4 MiB up.
const CHUNK: usize = 1 << 18;

/// A piece of a mapped buffer that one task writes.
struct Part<'a>(WriteOnly<'a, [u8]>);

// SAFETY: a `WriteOnly` is an exclusive reference, as `&mut [u8]` is, and
// the parts are disjoint. (wgpu makes `WriteOnly<T>` Send for `T: Send`
// with an implied `Sized`, which leaves out slices.)
unsafe impl Send for Part<'_> {}

/// Write `src` in its GPU form into `dst` (at least [`gpu_bytes`] long;
/// bytes past the tensor, the padding of an odd-length 16-bit tensor, are
/// zeroed). `what` names the tensor in the error raised when an int64
/// value does not fit the GPU's 32-bit integers.
pub(crate) fn upload(src: &View, dst: WriteOnly<'_, [u8]>, what: &str) -> Result<()> {
    let repr = GpuRepr::of(src.dtype)?;
    let need = gpu_bytes(src.dtype, src.numel())? as usize;
    let (host, gpu) = repr.unit(src.dtype);
    let n = src.bytes.len() / host;
    if dst.len() < need || src.bytes.len() != n * host {
        return Err(Error::internal(format!(
            "{what}: {} host bytes do not go into a GPU region of {} bytes ({need} needed)",
            src.bytes.len(),
            dst.len()
        )));
    }
    let (body, mut tail) = dst.split_at(n * gpu);
    let mut tasks = Vec::with_capacity(n.div_ceil(CHUNK).max(1));
    let mut rest = body;
    for (c, s) in src.bytes.chunks(CHUNK * host).enumerate() {
        let (d, r) = rest.split_at(s.len() / host * gpu);
        tasks.push((c * CHUNK, s, Part(d)));
        rest = r;
    }
    // the first element that does not fit, in element order
    let bad = tasks
        .into_par_iter()
        .map(|(first, s, Part(mut d))| {
            if repr.same_layout() {
                d.copy_from_slice(s);
                return None;
            }
            let (words, _) = d.into_chunks::<4>();
            let mut bad = None;
            words.write_iter(gpu_words(src.dtype, s).map(|w| {
                w.unwrap_or_else(|(i, v)| {
                    bad.get_or_insert((first + i, v));
                    [0; 4]
                })
            }));
            bad
        })
        .collect::<Vec<_>>()
        .into_iter()
        .flatten()
        .next();
    if let Some((i, v)) = bad {
        return Err(int64_does_not_fit(what, i, v));
    }
    tail.fill(0);
    Ok(())
}

/// Convert GPU bytes `src` (at least [`gpu_bytes`] long) into `out`, in
/// place: the one read of a delegate output, into the method's memory.
pub(crate) fn download(src: &[u8], out: &mut ViewMut) -> Result<()> {
    let (dtype, numel) = (out.dtype, out.numel());
    let need = gpu_bytes(dtype, numel)? as usize;
    if src.len() < need {
        return Err(Error::internal(format!(
            "GPU buffer of {} bytes holds less than a {} tensor of shape {:?} ({need} bytes)",
            src.len(),
            dtype.name(),
            out.shape
        )));
    }
    let repr = GpuRepr::of(dtype)?;
    let (host, gpu) = repr.unit(dtype);
    out.bytes
        .par_chunks_mut(CHUNK * host)
        .zip(src.par_chunks(CHUNK * gpu))
        .for_each(|(d, s)| host_from_gpu(dtype, s, d));
    Ok(())
}

#[cfg(test)]
mod tests {
    use etmetal_core::{DType, Tensor};

    use super::*;

    /// `t` uploaded into a buffer filled with 0xAA, and that buffer.
    fn uploaded(t: &Tensor) -> Result<Vec<u8>> {
        let mut gpu = vec![0xAA; gpu_bytes(t.dtype(), t.numel())? as usize];
        upload(&View::of(t), WriteOnly::from_mut(gpu.as_mut_slice()), "x")?;
        Ok(gpu)
    }

    fn round_trip(t: &Tensor) -> Tensor {
        let gpu = uploaded(t).unwrap();
        let mut back = Tensor::zeros(t.dtype(), t.shape()).unwrap();
        download(&gpu, &mut ViewMut::of(&mut back)).unwrap();
        back
    }

    // one element, and past one parallel chunk with an odd tail
    const SIZES: [usize; 2] = [1, CHUNK + 3];

    #[test]
    fn every_gpu_form_round_trips_exactly() {
        for n in SIZES {
            let ints: Vec<i64> = (0..n as i64).map(|i| (i % 300) - 150).collect();
            let floats: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
            let tensors = [
                Tensor::from_f32(DType::F32, &[n], &floats),
                Tensor::from_f32(DType::BF16, &[n], &floats),
                Tensor::from_f32(DType::F16, &[n], &floats),
                Tensor::from_i64(DType::I64, &[n], &ints),
                Tensor::from_i64(DType::I32, &[n], &ints),
                Tensor::from_i64(
                    DType::I8,
                    &[n],
                    &ints.iter().map(|v| v % 100).collect::<Vec<_>>(),
                ),
                Tensor::from_i64(
                    DType::U8,
                    &[n],
                    &ints.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                ),
                Tensor::from_i64(
                    DType::Bool,
                    &[n],
                    &ints.iter().map(|v| v & 1).collect::<Vec<_>>(),
                ),
            ];
            for t in tensors {
                let t = t.unwrap();
                assert!(round_trip(&t).bytes() == t.bytes(), "{} n={n}", t.dtype());
            }
        }
    }

    #[test]
    fn gpu_words_are_what_kernels_read() {
        let t = Tensor::from_i64(DType::I8, &[2], &[-3, 5]).unwrap();
        assert_eq!(uploaded(&t).unwrap(), [253, 255, 255, 255, 5, 0, 0, 0]);
        let t = Tensor::from_i64(DType::I64, &[2], &[-2, 1 << 20]).unwrap();
        assert_eq!(uploaded(&t).unwrap(), [254, 255, 255, 255, 0, 0, 16, 0]);
        // an odd 16-bit tensor: the last word's upper half is zeroed
        let t = Tensor::from_f32(DType::BF16, &[3], &[1.0, 2.0, 3.0]).unwrap();
        let gpu = uploaded(&t).unwrap();
        assert_eq!(&gpu[..6], t.bytes());
        assert_eq!(&gpu[6..], [0, 0]);
    }

    #[test]
    fn int64_past_i32_names_its_first_element() {
        let n = 3 * CHUNK;
        let mut v = vec![0i64; n];
        v[CHUNK + 1] = i64::from(i32::MAX) + 1;
        v[2 * CHUNK] = i64::from(i32::MIN) - 1;
        let t = Tensor::from_i64(DType::I64, &[n], &v).unwrap();
        let e = uploaded(&t).unwrap_err().to_string();
        let first = format!("x: int64 element {} = 2147483648 does not fit", CHUNK + 1);
        assert!(e.contains(&first), "{e}");
    }

    #[test]
    fn a_short_gpu_region_is_an_error() {
        let t = Tensor::from_f32(DType::F32, &[4], &[1.0; 4]).unwrap();
        let mut small = vec![0u8; 8];
        let e = upload(
            &View::of(&t),
            WriteOnly::from_mut(small.as_mut_slice()),
            "x",
        );
        assert!(e.is_err());
        let mut out = Tensor::zeros(DType::F32, &[4]).unwrap();
        assert!(download(&small, &mut ViewMut::of(&mut out)).is_err());
    }
}
