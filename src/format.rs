//! Human-readable sizes, formatted exactly as PyTorch's allocator formats them in messages.
#![forbid(unsafe_code)]

/// Formats a byte count as PyTorch's `format_size` does: `N bytes` up to 1 KiB, then
/// `x.xx KiB` / `x.xx MiB` / `x.xx GiB` (each unit up to and including its own size).
///
/// ```
/// use cuda_caching_allocator::format_size;
/// assert_eq!(format_size(1024), "1024 bytes");
/// assert_eq!(format_size(2 << 20), "2.00 MiB");
/// assert_eq!(format_size(1 << 40), "1024.00 GiB");
/// ```
pub fn format_size(size: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if size <= KIB {
        format!("{size} bytes")
    } else if size <= MIB {
        format!("{:.2} KiB", size as f64 / KIB as f64)
    } else if size <= GIB {
        format!("{:.2} MiB", size as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", size as f64 / GIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::format_size;

    #[test]
    fn unit_edges_match_pytorch() {
        assert_eq!(format_size(0), "0 bytes");
        assert_eq!(format_size(1025), "1.00 KiB");
        assert_eq!(format_size(1 << 20), "1024.00 KiB");
        assert_eq!(format_size((1 << 20) + 1), "1.00 MiB");
        assert_eq!(format_size(1 << 30), "1024.00 MiB");
        assert_eq!(format_size(8_502_000_000), "7.92 GiB");
    }
}
