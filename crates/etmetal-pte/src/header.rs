//! The `eh00` extended header ExecuTorch inserts after the first 8 bytes of
//! the program flatbuffer (FORMATS.md A.2), and the shared alignment rule.

use etmetal_core::{Error, Result};

pub const FILE_IDENTIFIER: &[u8; 4] = b"ET12";
pub const HEADER_MAGIC: &[u8; 4] = b"eh00";
/// Magic, length and three u64 fields; what ExecuTorch 1.x writes.
pub const HEADER_LENGTH: u32 = 32;
/// Older files end the header after `segment_base_offset`.
const MIN_HEADER_LENGTH: u32 = 24;
/// Where the header starts: after the root offset and the file identifier.
pub const HEADER_OFFSET: usize = 8;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtendedHeader {
    /// Bytes of the flatbuffer from offset 0, this header included.
    pub program_size: u64,
    /// Absolute file offset that `DataSegment.offset` is relative to (0: no segments).
    pub segment_base_offset: u64,
    /// Total bytes of segment data (0 in files before v1.0).
    pub segment_data_size: u64,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

impl ExtendedHeader {
    /// Read the header of `file` if it has one, checking it against the file length.
    pub fn parse(file: &[u8]) -> Result<Option<ExtendedHeader>> {
        if file.get(HEADER_OFFSET..HEADER_OFFSET + 4) != Some(HEADER_MAGIC) {
            return Ok(None);
        }
        let truncated = || {
            Error::format(format!(
                "extended header: file of {} bytes ends inside the header",
                file.len()
            ))
        };
        let length = u32_at(file, 12).ok_or_else(truncated)?;
        if length < MIN_HEADER_LENGTH {
            return Err(Error::format(format!(
                "extended header: length {length} is below the minimum {MIN_HEADER_LENGTH}"
            )));
        }
        let program_size = u64_at(file, 16).ok_or_else(truncated)?;
        let segment_base_offset = u64_at(file, 24).ok_or_else(truncated)?;
        let segment_data_size = if length >= HEADER_LENGTH {
            u64_at(file, 32).ok_or_else(truncated)?
        } else {
            0
        };
        let header = ExtendedHeader {
            program_size,
            segment_base_offset,
            segment_data_size,
        };
        header.check(file.len() as u64, HEADER_OFFSET as u64 + u64::from(length))?;
        Ok(Some(header))
    }

    fn check(&self, file_len: u64, header_end: u64) -> Result<()> {
        let bad = |msg: String| Err(Error::format(format!("extended header: {msg}")));
        if self.program_size < header_end || self.program_size > file_len {
            return bad(format!(
                "program_size {} is outside {header_end}..={file_len} (header end..file size)",
                self.program_size
            ));
        }
        if self.segment_base_offset != 0 && self.segment_base_offset < self.program_size {
            return bad(format!(
                "segment_base_offset {} lies inside the program (program_size {})",
                self.segment_base_offset, self.program_size
            ));
        }
        // Like the runtime, skip the end check for pre-v1.0 files (size 0, base set).
        if self.segment_data_size != 0 || self.segment_base_offset == 0 {
            let end = self.segment_base_offset.checked_add(self.segment_data_size);
            if end.is_none_or(|end| end > file_len) {
                return bad(format!(
                    "segments end at {} + {} but the file has {file_len} bytes",
                    self.segment_base_offset, self.segment_data_size
                ));
            }
        }
        Ok(())
    }

    /// The 32 header bytes as written at offset 8.
    pub fn to_bytes(&self) -> [u8; HEADER_LENGTH as usize] {
        let mut out = [0u8; HEADER_LENGTH as usize];
        out[0..4].copy_from_slice(HEADER_MAGIC);
        out[4..8].copy_from_slice(&HEADER_LENGTH.to_le_bytes());
        out[8..16].copy_from_slice(&self.program_size.to_le_bytes());
        out[16..24].copy_from_slice(&self.segment_base_offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.segment_data_size.to_le_bytes());
        out
    }
}

/// `value` rounded up to a multiple of `alignment` (> 0), or None on overflow.
pub fn aligned_size(value: u64, alignment: u64) -> Option<u64> {
    value.checked_next_multiple_of(alignment)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(length: u32, program_size: u64, base: u64, data: u64, file_len: usize) -> Vec<u8> {
        let mut f = vec![0u8; file_len];
        f[4..8].copy_from_slice(FILE_IDENTIFIER);
        f[8..12].copy_from_slice(HEADER_MAGIC);
        f[12..16].copy_from_slice(&length.to_le_bytes());
        f[16..24].copy_from_slice(&program_size.to_le_bytes());
        f[24..32].copy_from_slice(&base.to_le_bytes());
        f[32..40].copy_from_slice(&data.to_le_bytes());
        f
    }

    #[test]
    fn reads_the_verified_linear_header() {
        // FORMATS.md A.2: program_size 1864, base 1920, data 52.
        let f = file_with(32, 1864, 1920, 52, 1972);
        let h = ExtendedHeader::parse(&f).unwrap().unwrap();
        assert_eq!(
            h,
            ExtendedHeader {
                program_size: 1864,
                segment_base_offset: 1920,
                segment_data_size: 52
            }
        );
        assert_eq!(&h.to_bytes()[..], &f[8..40]);
    }

    #[test]
    fn rejects_bad_headers() {
        let msg = |f: Vec<u8>| ExtendedHeader::parse(&f).unwrap_err().to_string();
        assert!(msg(file_with(20, 64, 128, 0, 128)).contains("length 20 is below the minimum 24"));
        assert!(msg(file_with(32, 4096, 0, 0, 128)).contains("program_size 4096"));
        assert!(msg(file_with(32, 64, 128, 16, 140)).contains("segments end at 128 + 16"));
        assert!(msg(file_with(32, 64, 32, 0, 128)).contains("lies inside the program"));
        // Pre-v1.0 header (length 24): data size reads as 0 and the end check is skipped.
        let old = ExtendedHeader::parse(&file_with(24, 64, 128, 999, 128))
            .unwrap()
            .unwrap();
        assert_eq!(old.segment_data_size, 0);
        assert!(ExtendedHeader::parse(&[0u8; 8]).unwrap().is_none());
    }
}
