//! The zip container written by `torch.export.save` and the tensors stored in
//! it (FORMATS.md B.2–B.3): entries under one prefix folder, raw storage bytes
//! per tensor described by `*_config.json` payload configs.

use std::collections::BTreeMap;
use std::io::{Cursor, Read};
use std::ops::Range;
use std::sync::Arc;

use etmetal_core::{DType, Error, Result, Tensor};
use rayon::prelude::*;
use serde_json::Value;

use super::json::{field, sym_ints, tensor_meta};

/// Bytes that tensors may borrow (the mapped file, or a decompressed entry).
pub(crate) type Shared = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Every entry of the archive, keyed by its path after the prefix folder:
/// the bytes holding it and where in them. Stored (uncompressed) entries,
/// as torch writes weights, stay in the archive's own bytes, so a
/// contiguous weight becomes a tensor borrowing them (no copy).
pub(crate) struct Archive {
    pub origin: String,
    entries: BTreeMap<String, (Shared, Range<usize>)>,
}

/// Each stored entry's bytes against its CRC, the entries in parallel:
/// the first (in the archive's order) that differs is an error, as zip's
/// reader gives it.
fn check_crcs(data: &[u8], entries: &[(String, Range<usize>, u32)], origin: &str) -> Result<()> {
    let bad = entries
        .par_iter()
        .position_first(|(_, span, crc)| crc32fast::hash(&data[span.clone()]) != *crc);
    match bad {
        None => Ok(()),
        Some(i) => Err(Error::format(format!(
            "{origin}: reading zip entry `{}`: Invalid checksum",
            entries[i].0
        ))),
    }
}

impl Archive {
    pub fn open(bytes: Shared, origin: &str) -> Result<Archive> {
        let data = (*bytes).as_ref();
        // torch writes archives from offset 0; detection is confused by the
        // nested zip of `data/sample_inputs/*.pt` stored inside.
        let config = zip::read::Config {
            archive_offset: zip::read::ArchiveOffset::Known(0),
        };
        let mut zip = zip::ZipArchive::with_config(config, Cursor::new(data))
            .map_err(|e| Error::format(format!("{origin}: not a .pt2 archive (zip): {e}")))?;
        let mut prefix: Option<String> = None;
        let mut entries = BTreeMap::new();
        // stored entries whose CRC is still to check: (name, bytes, CRC)
        let mut unchecked: Vec<(String, Range<usize>, u32)> = vec![];
        for i in 0..zip.len() {
            let entry = Archive::entry(&mut zip, i, &bytes, origin, &mut prefix, &mut unchecked);
            match entry {
                Ok((rel, entry)) => {
                    entries.insert(rel, entry);
                }
                // a bad entry after one with a wrong CRC: the CRC's error,
                // as reading the entries in order gave it
                Err(e) => return Err(check_crcs(data, &unchecked, origin).err().unwrap_or(e)),
            }
        }
        check_crcs(data, &unchecked, origin)?;
        Ok(Archive {
            origin: origin.to_string(),
            entries,
        })
    }

    /// Entry `i` of `zip` (over `bytes`): its path after the archive
    /// folder (`prefix`, set by the first entry) and where its bytes are. A
    /// stored entry stays in `bytes`, its CRC pushed to `unchecked`; another
    /// is read (decompressed and checked) into bytes of its own.
    fn entry(
        zip: &mut zip::ZipArchive<Cursor<&[u8]>>,
        i: usize,
        bytes: &Shared,
        origin: &str,
        prefix: &mut Option<String>,
        unchecked: &mut Vec<(String, Range<usize>, u32)>,
    ) -> Result<(String, (Shared, Range<usize>))> {
        let data = (**bytes).as_ref();
        let mut file = zip
            .by_index(i)
            .map_err(|e| Error::format(format!("{origin}: zip entry {i}: {e}")))?;
        let name = file
            .name()
            .map_err(|e| Error::format(format!("{origin}: zip entry {i}: {e}")))?
            .into_owned();
        // The prefix is the first entry's folder; all others must share it.
        let p = prefix.get_or_insert_with(|| match name.find('/') {
            Some(slash) => name[..=slash].to_string(),
            None => String::new(),
        });
        let Some(rel) = name.strip_prefix(p.as_str()) else {
            return Err(Error::format(format!(
                "{origin}: zip entry `{name}` is outside the archive folder `{p}`"
            )));
        };
        let rel = rel.to_string();
        let reading =
            |e: std::io::Error| Error::format(format!("{origin}: reading zip entry `{name}`: {e}"));
        let stored = file.compression() == zip::CompressionMethod::Stored && !file.encrypted();
        let span = file.data_start().and_then(|start| {
            let start = usize::try_from(start).ok()?;
            let end = start.checked_add(usize::try_from(file.size()).ok()?)?;
            (end <= data.len()).then_some(start..end)
        });
        let entry = match span.filter(|_| stored) {
            // the zip reader reads `compressed_size` bytes: checked here
            // when that is the entry's size, else read through it
            Some(span) if file.compressed_size() == file.size() => {
                unchecked.push((name.clone(), span.clone(), file.crc32()));
                (bytes.clone(), span)
            }
            Some(span) => {
                std::io::copy(&mut file, &mut std::io::sink()).map_err(reading)?;
                (bytes.clone(), span)
            }
            None => {
                let mut v = Vec::with_capacity(file.size().min(1 << 30) as usize);
                file.read_to_end(&mut v).map_err(reading)?;
                let len = v.len();
                (Arc::new(v) as Shared, 0..len)
            }
        };
        Ok((rel, entry))
    }

    /// The bytes of entry `path`.
    pub fn get(&self, path: &str) -> Option<&[u8]> {
        self.entries
            .get(path)
            .map(|(bytes, span)| &(**bytes).as_ref()[span.clone()])
    }

    pub fn text(&self, path: &str) -> Option<Result<&str>> {
        self.get(path).map(|b| {
            std::str::from_utf8(b)
                .map_err(|_| Error::format(format!("{}: `{path}` is not UTF-8", self.origin)))
        })
    }

    pub fn json(&self, path: &str) -> Option<Result<Value>> {
        self.text(path).map(|t| {
            t.and_then(|t| {
                serde_json::from_str(t).map_err(|e| {
                    Error::format(format!("{}: `{path}`: invalid JSON: {e}", self.origin))
                })
            })
        })
    }

    /// The model program: `models/model.json`, else the only `models/*.json`.
    pub fn model_json(&self) -> Result<(String, Value)> {
        let path = if self.entries.contains_key("models/model.json") {
            "models/model.json".to_string()
        } else {
            let found: Vec<&String> = self
                .entries
                .keys()
                .filter(|k| {
                    k.starts_with("models/") && k.ends_with(".json") && !k[7..].contains('/')
                })
                .collect();
            match found.as_slice() {
                [one] => (*one).clone(),
                [] => {
                    return Err(Error::format(format!(
                        "{}: no `models/*.json` program in the archive",
                        self.origin
                    )))
                }
                many => {
                    return Err(Error::unsupported(format!(
                        "{}: several programs in the archive ({many:?}); only one is supported",
                        self.origin
                    )))
                }
            }
        };
        let json = self
            .json(&path)
            .unwrap_or_else(|| Err(Error::internal("listed entry vanished")))?;
        Ok((path, json))
    }

    /// Check `archive_format` and `archive_version` when they are present.
    pub fn check_version(&self) -> Result<()> {
        if let Some(format) = self.text("archive_format") {
            let format = format?.trim();
            if format != "pt2" {
                return Err(Error::format(format!(
                    "{}: archive_format is `{format}`, expected `pt2`",
                    self.origin
                )));
            }
        }
        if let Some(version) = self.text("archive_version") {
            let version = version?.trim();
            if version != "0" {
                return Err(Error::unsupported(format!(
                    "{}: archive_version is `{version}`, only version 0 is supported",
                    self.origin
                )));
            }
        }
        Ok(())
    }

    /// Where the tensor `fqn` of a payload config lies in its storage (`None`
    /// when the config does not list it). `torch.export.save` writes one
    /// file per storage, so two names of one eager tensor (a lifted
    /// constant that is also a registered buffer) have equal [`Storage`]s.
    pub fn payload_storage(&self, dir: &str, config: &Value, fqn: &str) -> Result<Option<Storage>> {
        let Some(entry) = config.get("config").and_then(|c| c.get(fqn)) else {
            return Ok(None);
        };
        let what = format!("{}: tensor `{fqn}`", self.origin);
        let path_name = field(entry, "path_name")
            .and_then(|v| {
                v.as_str()
                    .ok_or_else(|| Error::format("`path_name` is not a string"))
            })
            .map_err(|e| e.context(&what))?;
        let meta = field(entry, "tensor_meta").map_err(|e| e.context(&what))?;
        let (dtype, sizes) = tensor_meta(meta).map_err(|e| e.context(&what))?;
        let strides = sym_ints(field(meta, "strides").map_err(|e| e.context(&what))?)
            .map_err(|e| e.context(&what))?;
        let offset = match meta.get("storage_offset") {
            Some(v) if !v.is_null() => super::json::sym_int(v).map_err(|e| e.context(&what))?,
            _ => 0,
        };
        Ok(Some(Storage {
            file: format!("{dir}/{path_name}"),
            dtype,
            sizes,
            strides,
            offset,
        }))
    }

    /// The tensor `fqn` of a payload config, and whether it is fake (no
    /// storage bytes for a non-empty tensor: zeros).
    pub fn payload_tensor(
        &self,
        dir: &str,
        config: &Value,
        fqn: &str,
    ) -> Result<Option<(Tensor, bool)>> {
        let Some(entry) = config.get("config").and_then(|c| c.get(fqn)) else {
            return Ok(None);
        };
        let what = format!("{}: tensor `{fqn}`", self.origin);
        if entry.get("use_pickle").and_then(Value::as_bool) == Some(true) {
            return Err(Error::unsupported(format!(
                "{what} is pickled (tensor subclass), which is not supported"
            )));
        }
        let Some(Storage {
            file,
            dtype,
            sizes,
            strides,
            offset,
        }) = self.payload_storage(dir, config, fqn)?
        else {
            return Ok(None);
        };
        let Some((bytes, span)) = self.entries.get(&file) else {
            return Err(Error::format(format!(
                "{what}: payload `{file}` is missing from the archive"
            )));
        };
        let fake = span.is_empty() && sizes.iter().product::<usize>() > 0;
        strided_tensor(dtype, &sizes, &strides, offset, bytes, span.clone())
            .map(|t| Some((t, fake)))
            .map_err(|e| e.context(format!("{what} (`{file}`)")))
    }
}

/// A tensor's place in an archive: its storage file and the view of it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Storage {
    pub file: String,
    pub dtype: DType,
    pub sizes: Vec<usize>,
    pub strides: Vec<i64>,
    pub offset: i64,
}

impl Storage {
    /// The elements `[first, last]` of the storage the view can touch
    /// (`None` for an empty tensor).
    fn extent(&self) -> Option<(i64, i64)> {
        if self.sizes.contains(&0) {
            return None;
        }
        let reach: i64 = self
            .sizes
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n as i64 - 1) * s.abs())
            .sum();
        Some((self.offset, self.offset + reach))
    }

    /// Whether the two views may share an element of one storage without
    /// being the same view.
    pub fn overlaps(&self, other: &Storage) -> bool {
        if self.file != other.file || self == other {
            return false;
        }
        let bytes = |s: &Storage| {
            s.extent().map(|(a, b)| {
                let e = s.dtype.size() as i64;
                (a * e, (b + 1) * e)
            })
        };
        match (bytes(self), bytes(other)) {
            (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
            _ => false,
        }
    }
}

/// `as_strided(sizes, strides, offset)` over the raw storage `span` of
/// `bytes` as a contiguous tensor: a contiguous view borrows the bytes, any
/// other is materialised; an empty storage means a fake tensor (zeros).
pub(crate) fn strided_tensor(
    dtype: DType,
    sizes: &[usize],
    strides: &[i64],
    offset: i64,
    bytes: &Shared,
    span: Range<usize>,
) -> Result<Tensor> {
    let storage = (**bytes)
        .as_ref()
        .get(span.clone())
        .ok_or_else(|| Error::internal(format!("storage {span:?} outside its bytes")))?;
    if storage.is_empty() {
        return Tensor::zeros(dtype, sizes);
    }
    if strides.len() != sizes.len() {
        return Err(Error::format(format!(
            "{} strides given for {} dims",
            strides.len(),
            sizes.len()
        )));
    }
    if strides.iter().any(|&s| s < 0) || offset < 0 {
        return Err(Error::format(format!(
            "negative strides {strides:?} or storage offset {offset}"
        )));
    }
    let esize = dtype.size();
    if !storage.len().is_multiple_of(esize) {
        return Err(Error::format(format!(
            "storage of {} bytes is not a whole number of {dtype} elements",
            storage.len()
        )));
    }
    let elems = storage.len() / esize;
    if sizes.contains(&0) {
        return Tensor::zeros(dtype, sizes);
    }
    // The farthest element the view touches must lie inside the storage.
    let last = sizes
        .iter()
        .zip(strides)
        .try_fold(offset as u128, |acc, (&n, &s)| {
            Some(acc + (n as u128 - 1) * s as u128)
        });
    if last.is_none_or(|l| l >= elems as u128) {
        return Err(Error::format(format!(
            "sizes {sizes:?}, strides {strides:?}, offset {offset} reach outside the storage of {elems} {dtype} elements ({} bytes)",
            storage.len()
        )));
    }
    let strides: Vec<usize> = strides.iter().map(|&s| s as usize).collect();
    let offset = offset as usize;
    if etmetal_core::shape::is_contiguous(sizes, &strides) {
        return Tensor::from_shared(dtype, sizes, bytes.clone(), span.start + offset * esize);
    }
    let mut out = Tensor::zeros(dtype, sizes)?;
    let mut index = vec![0usize; sizes.len()];
    for chunk in out.bytes_mut().chunks_exact_mut(esize) {
        let src: usize = offset
            + index
                .iter()
                .zip(&strides)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        chunk.copy_from_slice(&storage[src * esize..(src + 1) * esize]);
        for d in (0..sizes.len()).rev() {
            index[d] += 1;
            if index[d] < sizes[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `storage` as the middle of larger bytes, as an archive entry is.
    fn entry(storage: &[u8]) -> (Shared, Range<usize>) {
        let mut bytes = vec![0xAB; 4];
        bytes.extend_from_slice(storage);
        bytes.extend_from_slice(&[0xCD; 4]);
        (Arc::new(bytes), 4..4 + storage.len())
    }

    fn view(sizes: &[usize], strides: &[i64], offset: i64, storage: &[u8]) -> Result<Tensor> {
        let (bytes, span) = entry(storage);
        strided_tensor(DType::F32, sizes, strides, offset, &bytes, span)
    }

    #[test]
    fn strided_views_are_materialised_and_contiguous_ones_borrowed() {
        let storage: Vec<u8> = (0..6f32 as i32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        // storage [0 1 2 3 4 5] viewed as a [3,2] transpose of a [2,3] matrix
        let t = view(&[3, 2], &[1, 3], 0, &storage).unwrap();
        assert_eq!(t.to_f32_vec(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let t = view(&[2], &[2], 1, &storage).unwrap();
        assert_eq!(t.to_f32_vec(), vec![1.0, 3.0]);
        // rows 1..3 of a [3, 2] matrix: contiguous, read from the entry's bytes
        let t = view(&[2, 2], &[2, 1], 2, &storage).unwrap();
        assert_eq!(t.to_f32_vec(), vec![2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn out_of_storage_strides_are_rejected() {
        let storage = vec![0u8; 24];
        let e = view(&[3, 2], &[1, 4], 0, &storage).unwrap_err();
        assert!(e.to_string().contains("outside the storage"), "{e}");
        let e = view(&[2], &[1], 5, &storage).unwrap_err();
        assert!(e.to_string().contains("outside the storage"), "{e}");
        let e = view(&[2, 2], &[2, 1], 3, &storage).unwrap_err();
        assert!(e.to_string().contains("outside the storage"), "{e}");
    }

    #[test]
    fn empty_storage_gives_zeros() {
        let t = view(&[2, 2], &[2, 1], 0, &[]).unwrap();
        assert_eq!(t.to_f32_vec(), vec![0.0; 4]);
    }
}
