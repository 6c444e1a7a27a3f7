//! How close can the pinned cache's slab policies come to the bytes requested (#16)? Sweeps slab
//! size × slack rule × fit rule over the mixed-size workload (`host::mixed_workload`, seeds 42,
//! 1 and 4), with every block used by a copy on one stream that completes only every 16
//! operations (copies in flight when blocks are freed, as in `tests/all/pinned.rs`), on
//! `SimHost` priced like registration on the H100 host (`docs/pinned.md`: about 0.9 ms per pin
//! plus 60 ps per byte; unpin 0.1 ms plus 20 ps per byte). Prints every configuration's worst
//! peak pinned ÷ peak requested over the seeds, its mean pins and modelled pinning time, then
//! the Pareto front (no other configuration both pins fewer bytes and takes less time).
//!
//! ```text
//! cargo run --release --example pinned_policy_sweep
//! ```

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::Arc;

use cuda_caching_allocator::host::{
    HostOp, PinnedBlock, PinnedCache, PinnedConfig, SimHost, SimHostConfig, mixed_workload,
};
use cuda_caching_allocator::{DeviceAddr, SimDevice, StreamId};

const MIB: usize = 1 << 20;
/// Operations between completions of the copy stream.
const LAG: usize = 16;
const SEEDS: [u64; 3] = [42, 1, 4];

/// One replay: (peak pinned ÷ peak requested, pins, modelled pinning ms).
fn replay(ops: &[HostOp], config: PinnedConfig) -> Result<(f64, u64, f64), Box<dyn Error>> {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let costs = SimHostConfig {
        pin_ns_per_call: 900_000,
        pin_ps_per_byte: 60,
        unpin_ns_per_call: 100_000,
        unpin_ps_per_byte: 20,
        ..SimHostConfig::default()
    };
    let cache = PinnedCache::new(SimHost::new(dev.clone(), costs), config)?;
    let copies = StreamId(9);
    let mut live: BTreeMap<usize, PinnedBlock> = BTreeMap::new();
    let (mut requested, mut peak) = (0usize, 0usize);
    for (i, op) in ops.iter().enumerate() {
        let slot = match *op {
            HostOp::Alloc { slot, .. } | HostOp::Free { slot } => slot,
        };
        if let Some(b) = live.remove(&slot) {
            cache.free(b.ptr)?;
            requested -= b.size;
        }
        if let HostOp::Alloc { size, .. } = *op {
            let b = cache.alloc(size)?;
            dev.use_range(copies, DeviceAddr(b.ptr.addr() as u64), size);
            cache.record_stream(b.ptr, copies)?;
            requested += size;
            peak = peak.max(requested);
            live.insert(slot, b);
        }
        if i % LAG == LAG - 1 {
            dev.complete_work(copies);
        }
    }
    let st = cache.stats();
    Ok((
        st.reserved_bytes.peak as f64 / peak.max(1) as f64,
        st.num_pins,
        st.pin_nanos as f64 / 1e6,
    ))
}

fn main() -> Result<(), Box<dyn Error>> {
    let workloads: Vec<Vec<HostOp>> = SEEDS
        .iter()
        .map(|&s| mixed_workload(s, 4000, 48, 64 * MIB))
        .collect();
    let mut rows: Vec<(String, f64, f64, f64)> = Vec::new();
    for slab in [2usize, 4, 8, 16, 32, 64] {
        for slack in [None, Some(0.02), Some(0.05)] {
            for waste in [None, Some(0.1), Some(0.25), Some(0.5)] {
                let config = PinnedConfig::default()
                    .with_slab_size(slab * MIB)
                    .with_max_slack(slack)
                    .with_max_fit_waste(waste);
                let (mut worst, mut pins, mut ms) = (0f64, 0f64, 0f64);
                for ops in &workloads {
                    let (r, p, t) = replay(ops, config)?;
                    worst = worst.max(r);
                    pins += p as f64 / SEEDS.len() as f64;
                    ms += t / SEEDS.len() as f64;
                }
                let name = format!(
                    "slab {slab} MiB, slack {}, fit waste {}",
                    slack.map_or("off".into(), |s| s.to_string()),
                    waste.map_or("off".into(), |w| w.to_string())
                );
                rows.push((name, worst, pins, ms));
            }
        }
    }
    println!("| configuration | worst × peak requested | mean pins | mean pinning ms (model) |");
    println!("|---|---:|---:|---:|");
    for (name, worst, pins, ms) in &rows {
        println!("| {name} | {worst:.3} | {pins:.0} | {ms:.0} |");
    }
    rows.sort_by(|a, b| a.1.total_cmp(&b.1));
    println!("\nPareto front (worst ratio against pinning time):\n");
    println!("| configuration | worst × peak requested | mean pins | mean pinning ms (model) |");
    println!("|---|---:|---:|---:|");
    let mut best_ms = f64::INFINITY;
    for (name, worst, pins, ms) in &rows {
        if *ms < best_ms {
            best_ms = *ms;
            println!("| {name} | {worst:.3} | {pins:.0} | {ms:.0} |");
        }
    }
    Ok(())
}
