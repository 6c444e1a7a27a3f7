//! `--device cuda[:N]`: replays on a real GPU through `CachingAllocator<CudaDevice>`, so device
//! calls are real `cuMemAlloc` / `cuMemFree` (or page maps with expandable segments) and host time
//! per operation includes them.
//!
//! The recorded stream handles mean nothing in this process, so each distinct non-zero stream of
//! the trace becomes a new stream of the device (stream 0 stays the legacy default stream). The
//! driver places segments, so `--placement` does not apply. Allocations the trace leaves live are
//! freed and the cache emptied after the replay, so `compare` starts each configuration on an
//! empty device. Built without the `cuda` feature, the flag is a clear error.

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::trace::Trace;

use crate::load::{CliResult, Run};

/// Replays `trace` under `config` on CUDA device `ordinal`.
#[cfg(feature = "cuda-unpinned")]
pub(crate) fn run(
    trace: &Trace,
    config: &AllocatorConfig,
    ordinal: usize,
    label: &str,
    points: usize,
    time_every: u32,
) -> CliResult<Run> {
    // cudarc panics where the driver library lacks a function its bindings name (a driver older
    // than the bindings' CUDA version); turn that into an error instead of a crash.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cuda::run(trace, config, ordinal, label, points, time_every)
    }));
    std::panic::set_hook(previous);
    match outcome {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(format!(
                "--device cuda:{ordinal}: the CUDA driver library could not be used ({what}); \
                 is the driver older than the CUDA version this cca was built for?"
            )
            .into())
        }
    }
}

/// Without the CUDA backend: the error that says so.
#[cfg(not(feature = "cuda-unpinned"))]
pub(crate) fn run(
    _trace: &Trace,
    _config: &AllocatorConfig,
    ordinal: usize,
    _label: &str,
    _points: usize,
    _time_every: u32,
) -> CliResult<Run> {
    Err(format!(
        "--device cuda:{ordinal}: this cca was built without CUDA support; install one with \
         `cargo install --locked --path . --features cli,cuda` (or run target/release/cca after \
         `cargo build --release --features cli,cuda`), or use --device sim"
    )
    .into())
}

#[cfg(feature = "cuda-unpinned")]
mod cuda {
    use std::collections::HashMap;

    use cuda_caching_allocator::backend::cuda::{CudaDevice, device_count};
    use cuda_caching_allocator::trace::{Trace, TraceOp};
    use cuda_caching_allocator::{
        AllocError, AllocatorConfig, BackendError, BlockState, CachingAllocator, DeviceBackend,
        Placement, format_size,
    };

    use crate::load::{CliResult, Run, replay_timed};

    /// Opens device `ordinal`, or says in words why it cannot be used.
    fn open(ordinal: usize) -> CliResult<CudaDevice> {
        let count = match device_count() {
            Ok(n) => n,
            Err(BackendError::NoDriver) => {
                return Err(format!(
                    "--device cuda:{ordinal}: no CUDA driver was found on this machine \
                     (libcuda.so.1 could not be loaded); run on a machine with an NVIDIA driver, \
                     or use --device sim"
                )
                .into());
            }
            Err(e) => {
                return Err(
                    format!("--device cuda:{ordinal}: CUDA cannot be used here: {e}").into(),
                );
            }
        };
        if ordinal >= count {
            return Err(format!(
                "--device cuda:{ordinal}: no such device ({count} CUDA device{} visible)",
                if count == 1 { "" } else { "s" }
            )
            .into());
        }
        CudaDevice::open(ordinal)
            .map_err(|e| format!("--device cuda:{ordinal}: opening the device failed: {e}").into())
    }

    /// The trace with each distinct non-zero stream replaced by a new, admitted stream of
    /// `device` (the device keeps the streams alive); stream 0 stays the legacy default stream.
    fn map_streams(trace: &Trace, device: &CudaDevice) -> CliResult<(Trace, usize)> {
        let mut ids: HashMap<u64, u64> = HashMap::new();
        ids.insert(0, 0);
        let mut out = trace.clone();
        for ev in &mut out.events {
            if let TraceOp::Alloc { stream, .. } = &mut ev.op {
                let id = match ids.get(stream) {
                    Some(id) => *id,
                    None => {
                        let s = device.context().new_stream()?;
                        let id = device.admit_stream(&s)?.0;
                        ids.insert(*stream, id);
                        id
                    }
                };
                *stream = id;
            }
        }
        Ok((out, ids.len()))
    }

    /// Frees what the trace left allocated and empties the cache; returns how many allocations
    /// were still live.
    fn release(alloc: &CachingAllocator<&CudaDevice>) -> Result<usize, AllocError> {
        let mut live = 0;
        for segment in alloc.snapshot() {
            for block in segment.blocks {
                if block.state == BlockState::ActiveAllocated {
                    alloc.free(block.address)?;
                    live += 1;
                }
            }
        }
        alloc.empty_cache()?;
        Ok(live)
    }

    pub(super) fn run(
        trace: &Trace,
        config: &AllocatorConfig,
        ordinal: usize,
        label: &str,
        points: usize,
        time_every: u32,
    ) -> CliResult<Run> {
        let device = open(ordinal)?;
        let name = device
            .context()
            .name()
            .unwrap_or_else(|_| "unknown GPU".into());
        let total = device.mem_info()?.total;
        let (trace, streams) = map_streams(trace, &device)?;
        let alloc = CachingAllocator::new(&device, config.clone())?;
        let (report, timeline, wall) = replay_timed(
            &alloc,
            &trace,
            Placement::Fresh,
            None,
            label,
            points,
            time_every,
        )?;
        match release(&alloc) {
            Ok(0) => {}
            Ok(live) => say!(
                "cca: {label}: freed the {live} allocations the trace left live and emptied the cache"
            ),
            Err(e) => say!("cca: warning: {label}: cleaning up after the replay failed: {e}"),
        }
        Ok(Run {
            report,
            timeline,
            wall,
            device: format!(
                "CUDA device {ordinal} ({name}, {}), {streams} stream{}, segments placed by the driver",
                format_size(total as u64),
                if streams == 1 { "" } else { "s" }
            ),
            device_memory: total as u64,
        })
    }
}
