//! `memory_summary()`: PyTorch's 75-column statistics table, reproduced line for line.
//! May use: `stats`.
#![forbid(unsafe_code)]

use crate::stats::{MemoryStats, StatType};

fn format_size(mut sz: i64, pref: i64) -> String {
    let prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut prefix = prefixes[0];
    let mut pref = pref as f64;
    for p in &prefixes[1..] {
        if pref < 768.0 * 1024.0 {
            break;
        }
        prefix = p;
        sz = sz.div_euclid(1024);
        pref /= 1024.0;
    }
    format!("{sz:6} {prefix}")
}

fn format_count(mut cnt: i64, pref: i64) -> String {
    let prefixes = [" ", "K", "M"];
    let mut prefix = prefixes[0];
    let mut pref = pref as f64;
    for p in &prefixes[1..] {
        if pref < 750.0 * 1000.0 {
            break;
        }
        prefix = p;
        cnt = cnt.div_euclid(1000);
        pref /= 1000.0;
    }
    format!("{cnt:7} {prefix} ")
}

type Formatter = fn(i64, i64) -> String;

/// PyTorch's `memory_summary()` table for `stats` of device `device` (`abbreviated` leaves out
/// the per-pool rows), e.g. for the statistics a replay recorded at its peak.
pub fn memory_summary(stats: &MemoryStats, device: usize, abbreviated: bool) -> String {
    let rule = |c: char| c.to_string().repeat(75);
    let mut lines = vec![
        rule('='),
        format!(
            " {:16} PyTorch CUDA memory summary, device ID {:<17} ",
            "", device
        ),
        rule('-'),
        format!(
            "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
            "", stats.num_ooms, "", stats.num_alloc_retries
        ),
        rule('='),
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    ];
    let metrics: [(&str, &str, Formatter); 9] = [
        ("allocated_bytes", "Allocated memory", format_size),
        ("active_bytes", "Active memory", format_size),
        ("requested_bytes", "Requested memory", format_size),
        ("reserved_bytes", "GPU reserved memory", format_size),
        ("inactive_split_bytes", "Non-releasable memory", format_size),
        ("allocation", "Allocations", format_count),
        ("active", "Active allocs", format_count),
        ("segment", "GPU reserved segments", format_count),
        ("inactive_split", "Non-releasable allocs", format_count),
    ];
    let get = |key: String| stats.get(&key).unwrap_or(0);
    for (key, name, fmt) in metrics {
        lines.push(rule('-'));
        let mut subs = vec![(StatType::All, name)];
        if !abbreviated {
            subs.push((StatType::LargePool, "      from large pool"));
            subs.push((StatType::SmallPool, "      from small pool"));
        }
        let mut pref: Option<[i64; 4]> = None;
        for (t, label) in subs {
            let prefix = format!("{key}.{}.", t.name());
            let vals =
                ["current", "peak", "allocated", "freed"].map(|m| get(format!("{prefix}{m}")));
            let p = *pref.get_or_insert(vals);
            lines.push(format!(
                " {:<21} | {} | {} | {} | {} ",
                label,
                fmt(vals[0], p[0]),
                fmt(vals[1], p[1]),
                fmt(vals[2], p[2]),
                fmt(vals[3], p[3])
            ));
        }
    }
    for (key, name) in [
        ("oversize_allocations", "Oversize allocations"),
        ("oversize_segments", "Oversize GPU segments"),
    ] {
        lines.push(rule('-'));
        let v = ["current", "peak", "allocated", "freed"].map(|m| get(format!("{key}.{m}")));
        lines.push(format!(
            " {:<21} | {} | {} | {} | {} ",
            name,
            format_count(v[0], v[0]),
            format_count(v[1], v[1]),
            format_count(v[2], v[2]),
            format_count(v[3], v[3])
        ));
    }
    lines.push(rule('='));
    format!("|{}|\n", lines.join("|\n|"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::size_class::PoolKind;

    #[test]
    fn layout_matches_pytorch() {
        let mut s = MemoryStats::default();
        s.allocated_bytes.increase(PoolKind::Large, 3 << 30);
        s.allocation.increase(PoolKind::Small, 800_000);
        let out = memory_summary(&s, 0, false);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], format!("|{}|", "=".repeat(75)));
        assert_eq!(
            lines[1],
            "|                  PyTorch CUDA memory summary, device ID 0                 |"
        );
        assert_eq!(
            lines[3],
            "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |"
        );
        assert_eq!(
            lines[5],
            "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
        );
        assert_eq!(
            lines[7],
            "| Allocated memory      |   3072 MiB |   3072 MiB |   3072 MiB |      0 B   |"
        );
        assert_eq!(
            lines[8],
            "|       from large pool |   3072 MiB |   3072 MiB |   3072 MiB |      0 B   |"
        );
        assert!(out.contains(
            "| Allocations           |     800 K  |     800 K  |     800 K  |       0    |"
        ));
        assert!(out.ends_with(&format!("|{}|\n", "=".repeat(75))));
        assert_eq!(lines.len(), 6 + 9 * 4 + 2 * 2 + 1);
        let short = memory_summary(&s, 1, true);
        assert_eq!(short.lines().count(), 6 + 9 * 2 + 2 * 2 + 1);
    }
}
