//! NumPy `.npy` files (format versions 1–3), little-endian, C order.
//!
//! NumPy has no bfloat16: bf16 tensors are written as float32, and callers
//! convert float32 inputs to bf16 where a program expects bf16.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

const MAGIC: &[u8] = b"\x93NUMPY";

fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 | DType::BF16 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::I16 => "<i2",
        DType::I8 => "|i1",
        DType::U8 => "|u1",
        DType::Bool => "|b1",
    }
}

fn dtype_of_descr(d: &str) -> Option<DType> {
    Some(match d {
        "<f4" | "=f4" => DType::F32,
        "<f8" | "=f8" => DType::F64,
        "<f2" | "=f2" => DType::F16,
        "<i8" | "=i8" => DType::I64,
        "<i4" | "=i4" => DType::I32,
        "<i2" | "=i2" => DType::I16,
        "|i1" | "<i1" => DType::I8,
        "|u1" | "<u1" => DType::U8,
        "|b1" | "<b1" => DType::Bool,
        _ => return None,
    })
}

/// Encode a tensor as `.npy` bytes (bf16 becomes float32).
pub fn encode(tensor: &Tensor) -> Result<Vec<u8>> {
    let t = if tensor.dtype() == DType::BF16 {
        tensor.cast(DType::F32)?
    } else {
        tensor.clone()
    };
    let shape = match t.shape() {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        dims => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        descr(t.dtype())
    );
    // magic + version + u16 len + header + '\n' padded to 64 bytes
    let unpadded = MAGIC.len() + 2 + 2 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + t.nbytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(t.bytes());
    Ok(out)
}

/// Decode `.npy` bytes.
pub fn decode(bytes: &[u8]) -> Result<Tensor> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(Error::format("not a .npy file (missing \\x93NUMPY magic)"));
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(Error::format(".npy header is truncated"));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(Error::unsupported(format!(".npy format version {v}"))),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| Error::format(".npy header runs past the end of the file"))?;
    let header = std::str::from_utf8(&bytes[start..end])
        .map_err(|_| Error::format(".npy header is not text"))?;
    let field = |key: &str| -> Result<&str> {
        let at = header
            .find(&format!("'{key}'"))
            .ok_or_else(|| Error::format(format!(".npy header has no '{key}': {header}")))?;
        let rest = header[at + key.len() + 2..].trim_start();
        rest.strip_prefix(':')
            .map(str::trim_start)
            .ok_or_else(|| Error::format(format!(".npy header is malformed: {header}")))
    };
    let descr_text = field("descr")?;
    let descr = descr_text
        .strip_prefix('\'')
        .and_then(|r| r.split('\'').next())
        .ok_or_else(|| Error::format(format!(".npy descr is malformed: {header}")))?;
    let dtype = dtype_of_descr(descr).ok_or_else(|| {
        Error::unsupported(format!(".npy dtype '{descr}' (big-endian or unsupported)"))
    })?;
    if field("fortran_order")?.starts_with("True") {
        return Err(Error::unsupported(
            ".npy in Fortran order; save with np.ascontiguousarray",
        ));
    }
    let shape_text = field("shape")?;
    let inner = shape_text
        .strip_prefix('(')
        .and_then(|r| r.split(')').next())
        .ok_or_else(|| Error::format(format!(".npy shape is malformed: {header}")))?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| Error::format(format!(".npy shape entry '{s}' is not a size")))
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::from_bytes(dtype, &shape, &bytes[end..]).map_err(|e| e.context(".npy data"))
}

pub fn read(path: &std::path::Path) -> Result<Tensor> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path.display(), e))?;
    decode(&bytes).map_err(|e| e.context(path.display().to_string()))
}

pub fn write(path: &std::path::Path, tensor: &Tensor) -> Result<()> {
    std::fs::write(path, encode(tensor)?).map_err(|e| Error::io(path.display(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_dtype() {
        for dtype in DType::ALL {
            let t = Tensor::from_i64(dtype, &[2, 3], &[0, 1, 0, 1, 1, 0]).unwrap();
            let back = decode(&encode(&t).unwrap()).unwrap();
            let expect = if dtype == DType::BF16 {
                DType::F32
            } else {
                dtype
            };
            assert_eq!(back.dtype(), expect);
            assert_eq!(back.shape(), &[2, 3]);
            assert_eq!(back.to_f64_vec(), t.to_f64_vec());
        }
    }

    #[test]
    fn header_is_64_byte_aligned_and_scalar_shapes_work() {
        let t = Tensor::scalar_f64(DType::F32, 2.5).unwrap();
        let bytes = encode(&t).unwrap();
        assert_eq!((bytes.len() - 4) % 64, 0);
        assert_eq!(decode(&bytes).unwrap().shape(), &[] as &[usize]);
    }

    #[test]
    fn rejects_bad_files() {
        assert!(decode(b"hello").is_err());
        let mut bytes = encode(&Tensor::zeros(DType::F32, &[4]).unwrap()).unwrap();
        bytes.truncate(bytes.len() - 1);
        assert!(decode(&bytes)
            .unwrap_err()
            .to_string()
            .contains("bytes given"));
        let fortran = b"\x93NUMPY\x01\x00\x46\x00{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }      \n";
        assert!(decode(fortran).is_err());
    }
}
