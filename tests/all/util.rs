//! Helpers shared by the integration tests.

use cuda_caching_allocator::{
    AllocatorConfig, CachingAllocator, DeviceAddr, SimConfig, SimDevice, StreamId,
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
