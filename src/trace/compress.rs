//! Gzip detection (by magic bytes), decompression and compression, and whole-file reads and
//! writes with the file name in the error.
#![forbid(unsafe_code)]

use std::borrow::Cow;
use std::io::{Read, Write};
use std::path::Path;

use flate2::Compression;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;

use super::io_error::TraceIoError;

/// The two bytes every gzip member starts with.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Whether `bytes` start with the gzip magic bytes (`1f 8b`).
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&GZIP_MAGIC)
}

/// Returns `bytes` decompressed when they start with the gzip magic bytes (all concatenated
/// members), else `bytes` unchanged. Decompression streams and stops one byte past `limit`: at
/// most `limit + 1` bytes are ever held, however far the data would expand.
///
/// # Errors
/// [`TraceIoError::TooLarge`] when the input, plain or decompressed, is longer than `limit`;
/// [`TraceIoError::Gzip`] for corrupt data.
pub(crate) fn decompress_if_gzip(bytes: &[u8], limit: u64) -> Result<Cow<'_, [u8]>, TraceIoError> {
    if !is_gzip(bytes) {
        if bytes.len() as u64 > limit {
            return Err(TraceIoError::TooLarge {
                what: "the input's bytes",
                limit,
            });
        }
        return Ok(Cow::Borrowed(bytes));
    }
    let guess = bytes.len().saturating_mul(4);
    let mut out = Vec::with_capacity(usize::try_from(limit).map_or(guess, |l| guess.min(l)));
    let mut decoder = MultiGzDecoder::new(bytes).take(limit.saturating_add(1));
    match decoder.read_to_end(&mut out) {
        Ok(_) if out.len() as u64 > limit => Err(TraceIoError::TooLarge {
            what: "the decompressed input's bytes",
            limit,
        }),
        Ok(_) => Ok(Cow::Owned(out)),
        Err(source) => Err(TraceIoError::Gzip {
            decompressed: out.len() as u64,
            source,
        }),
    }
}

/// Gzip-compresses `bytes` (default level, no file name, modification time 0: deterministic).
pub(crate) fn gzip(bytes: &[u8]) -> Result<Vec<u8>, TraceIoError> {
    let mut encoder = GzEncoder::new(Vec::with_capacity(bytes.len() / 4), Compression::default());
    encoder.write_all(bytes).map_err(TraceIoError::Write)?;
    encoder.finish().map_err(TraceIoError::Write)
}

/// Reads a whole file.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, TraceIoError> {
    std::fs::read(path).map_err(|source| TraceIoError::File {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a whole file of at most `limit` bytes (checked before reading).
///
/// # Errors
/// [`TraceIoError::File`] when it cannot be read, [`TraceIoError::TooLarge`] when longer.
pub(crate) fn read_file_limited(path: &Path, limit: u64) -> Result<Vec<u8>, TraceIoError> {
    let file_error = |source| TraceIoError::File {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(file_error)?.len();
    if len > limit {
        return Err(TraceIoError::TooLarge {
            what: "the file's bytes",
            limit,
        });
    }
    read_file(path)
}

/// Creates (or truncates) a file and writes `bytes` to it.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TraceIoError> {
    std::fs::write(path, bytes).map_err(|source| TraceIoError::File {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes_pass_through() {
        let data = b"Thread,Time\n";
        assert!(matches!(
            decompress_if_gzip(data, u64::MAX).unwrap(),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn gzip_round_trip_and_concatenated_members() {
        let mut two = gzip(b"hello ").unwrap();
        assert!(is_gzip(&two));
        two.extend(gzip(b"world").unwrap());
        assert_eq!(
            &*decompress_if_gzip(&two, u64::MAX).unwrap(),
            b"hello world"
        );
    }

    /// Regression (#14): decompression had no limit (a 2 MB `.gz` grew to 4 GB before the
    /// format was even detected). It stops one byte past the limit now.
    #[test]
    fn decompression_stops_at_the_limit() {
        let packed = gzip(&vec![0u8; 1 << 20]).unwrap();
        assert!(decompress_if_gzip(&packed, 1 << 20).is_ok());
        let err = decompress_if_gzip(&packed, (1 << 20) - 1).unwrap_err();
        assert!(
            matches!(err, TraceIoError::TooLarge { limit, .. } if limit == (1 << 20) - 1),
            "{err}"
        );
        assert!(err.to_string().contains("--max-import-bytes"), "{err}");
        assert!(matches!(
            decompress_if_gzip(b"plain text", 4),
            Err(TraceIoError::TooLarge { limit: 4, .. })
        ));
    }

    #[test]
    fn truncated_gzip_is_an_error() {
        let packed = gzip(&[7u8; 10_000]).unwrap();
        for cut in [2, 10, packed.len() / 2, packed.len() - 1] {
            let err = decompress_if_gzip(&packed[..cut], u64::MAX).unwrap_err();
            assert!(matches!(err, TraceIoError::Gzip { .. }), "cut {cut}: {err}");
        }
    }
}
