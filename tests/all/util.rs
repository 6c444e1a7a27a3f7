//! Helpers shared by the integration tests.

use cuda_caching_allocator::{
    AllocatorConfig, AllocatorConfigBuilder, CachingAllocator, DeviceAddr, SimConfig, SimDevice,
    StreamId,
};

pub const MIB: usize = 1 << 20;

/// An allocator with PyTorch's configuration over a simulated device of `capacity` bytes.
pub fn pytorch_on(capacity: usize) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(
        SimDevice::with_capacity(capacity),
        AllocatorConfig::pytorch(),
    )
    .unwrap()
}

/// An allocator with `config` over a simulated device of `capacity` bytes.
pub fn with_config(capacity: usize, config: AllocatorConfig) -> CachingAllocator<SimDevice> {
    CachingAllocator::new(
        SimDevice::new(SimConfig {
            capacity,
            ..SimConfig::default()
        }),
        config,
    )
    .unwrap()
}

/// PyTorch's configuration, the crate default (expandable segments with page reuse), and both
/// with the fast path and cross-stream reuse on: the configurations a property of the cache's
/// bookkeeping must hold under.
pub fn four_configs() -> Vec<(&'static str, AllocatorConfig)> {
    let extra = |c: AllocatorConfig| {
        AllocatorConfigBuilder::from_config(c)
            .fast_path(true)
            .cross_stream_reuse(true)
            .build()
            .unwrap()
    };
    vec![
        ("pytorch", AllocatorConfig::pytorch()),
        ("default", AllocatorConfig::default()),
        ("pytorch+fast+xstream", extra(AllocatorConfig::pytorch())),
        ("default+fast+xstream", extra(AllocatorConfig::default())),
    ]
}

/// The stream of the segment holding `ptr` (from the snapshot).
pub fn segment_stream(a: &CachingAllocator<SimDevice>, ptr: DeviceAddr) -> StreamId {
    a.snapshot()
        .iter()
        .find(|s| ptr.0 >= s.address.0 && ptr.0 < s.address.0 + s.total_size as u64)
        .unwrap()
        .stream
}

/// Fails `test` unless a CUDA device works. The GPU tests are `#[ignore]`d (with the reason), so
/// `cargo test` lists them as ignored; `cargo test ... -- --ignored` runs them, and on a machine
/// without a working device each fails here rather than passing untested.
#[cfg(feature = "cuda")]
pub fn require_gpu(test: &str) {
    assert!(
        cuda_caching_allocator::backend::cuda::cuda_available(),
        "{test} needs a CUDA GPU and no CUDA device works on this machine"
    );
}

/// Whether `gpu/run.sh` runs this under compute-sanitizer, which serializes kernel launches (so
/// "still running" checks cannot hold there).
#[cfg(feature = "cuda")]
pub fn under_sanitizer() -> bool {
    std::env::var_os("CCA_UNDER_SANITIZER").is_some()
}

/// CUDA C `source` compiled with NVRTC and loaded into `ctx`.
#[cfg(feature = "cuda")]
pub fn load_module(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    source: &str,
) -> std::sync::Arc<cudarc::driver::CudaModule> {
    let ptx = cudarc::nvrtc::compile_ptx(source).unwrap();
    ctx.load_module(ptx).unwrap()
}

/// A caller's fence (`HostFence`) over a flag, counting queries and waits; `wait` sets the flag
/// (the work it stands for is then done) unless `fail_wait` is set.
#[derive(Debug, Default)]
pub struct Flag {
    pub done: std::sync::atomic::AtomicBool,
    pub queries: std::sync::atomic::AtomicUsize,
    pub waits: std::sync::atomic::AtomicUsize,
    /// `wait` fails (and leaves the flag as it is).
    pub fail_wait: std::sync::atomic::AtomicBool,
    /// `query` fails (as for an event recorded inside a graph capture).
    pub fail_query: std::sync::atomic::AtomicBool,
}

/// The fence a pinned cache holds for a [`Flag`].
#[derive(Debug)]
pub struct FlagFence(pub std::sync::Arc<Flag>);

impl cuda_caching_allocator::host::HostFence for FlagFence {
    fn query(&mut self) -> Result<bool, cuda_caching_allocator::BackendError> {
        use std::sync::atomic::Ordering;
        self.0.queries.fetch_add(1, Ordering::SeqCst);
        if self.0.fail_query.load(Ordering::SeqCst) {
            return Err(cuda_caching_allocator::BackendError::Injected {
                operation: "fence query",
                call: 0,
            });
        }
        Ok(self.0.done.load(Ordering::SeqCst))
    }

    fn wait(&mut self) -> Result<(), cuda_caching_allocator::BackendError> {
        use std::sync::atomic::Ordering;
        self.0.waits.fetch_add(1, Ordering::SeqCst);
        if self.0.fail_wait.load(Ordering::SeqCst) {
            return Err(cuda_caching_allocator::BackendError::Injected {
                operation: "fence wait",
                call: 0,
            });
        }
        self.0.done.store(true, Ordering::SeqCst);
        Ok(())
    }
}
