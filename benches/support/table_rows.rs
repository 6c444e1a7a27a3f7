//! Simulated rows of two tables in `benches/README.md` (fragmentation, cross-stream reuse),
//! shared by the examples that print them (`examples/fragmentation_table.rs`,
//! `examples/cross_stream_table.rs`) and the tests that hold the README's rows to what the code
//! does today (`tests/all/fragmentation.rs`).
#![allow(dead_code)]

use cuda_caching_allocator::trace::Trace;
use cuda_caching_allocator::{
    CachingAllocator, Preset, ReplayOptions, ReplayReport, SimDevice, replay,
};

/// Gigabytes (10^9 bytes) with three decimals, as the table writes them.
pub(crate) fn gb(bytes: u64) -> String {
    format!("{:.3}", bytes as f64 / 1e9)
}

/// Replays `trace` under `preset` on a fresh `SimDevice`; returns the report and the trace's
/// row of the table (named `name`): peak live and reserved bytes, their ratio, PyTorch's device
/// calls, the simulated driver's calls one by one, synchronizations and OOMs.
///
/// # Panics
/// When the preset's allocator cannot be made or the replay fails (a bad trace).
pub(crate) fn row(name: &str, trace: &Trace, preset: Preset) -> (ReplayReport, String) {
    let alloc = CachingAllocator::new(SimDevice::default(), preset.config())
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let report =
        replay(&alloc, trace, &ReplayOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let s = alloc.backend().counters();
    let line = format!(
        "| {} | {} | `{}` | {} | {:.3} | {} + {} | {}, {}, {}, {}, {} | {} | {} |",
        name,
        gb(report.peak_live_bytes),
        preset.name(),
        gb(report.peak_reserved_bytes),
        report.reserved_over_live(),
        report.num_device_alloc,
        report.num_device_free,
        s.allocate_calls,
        s.create_physical_calls,
        s.map_calls,
        s.unmap_calls,
        s.release_physical_calls + s.free_calls,
        s.synchronize_calls,
        report.num_ooms,
    );
    (report, line)
}

/// Replays `trace` under `preset`, with cross-stream reuse on or off, on a fresh `SimDevice`;
/// returns its row of the cross-stream table: peak reserved bytes, their ratio to peak live,
/// handovers, PyTorch's device calls, synchronizations, address ranges reserved and OOMs.
///
/// # Panics
/// When the preset's allocator cannot be made or the replay fails (a bad trace).
pub(crate) fn cross_stream_row(name: &str, trace: &Trace, preset: Preset, on: bool) -> String {
    let mut config = preset.config();
    config.cross_stream_reuse = on;
    let alloc = CachingAllocator::new(SimDevice::default(), config)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let r =
        replay(&alloc, trace, &ReplayOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let sim = alloc.backend().counters();
    format!(
        "| {name} | `{}`{} | {:.3} | {:.3} | {} | {} + {} | {} | {} | {} |",
        preset.name(),
        if on { " + cross-stream" } else { "" },
        r.peak_reserved_bytes as f64 / 1e9,
        r.reserved_over_live(),
        r.cross_stream_handovers,
        r.num_device_alloc,
        r.num_device_free,
        sim.synchronize_calls,
        sim.reserve_calls,
        r.num_ooms,
    )
}
