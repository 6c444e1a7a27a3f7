//! Helpers shared by the integration tests.

use cuda_caching_allocator::{AllocatorConfig, CachingAllocator, SimConfig, SimDevice};

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

/// Whether the opt-in GPU tests run (`CCA_TEST_CUDA=1`); otherwise prints that `test` was skipped.
/// With the variable set, a machine where no CUDA device works fails the test.
#[cfg(feature = "cuda")]
pub fn gpu_tests_enabled(test: &str) -> bool {
    if std::env::var("CCA_TEST_CUDA").as_deref() != Ok("1") {
        println!("skipped {test}: set CCA_TEST_CUDA=1 to run the GPU tests");
        return false;
    }
    assert!(
        cuda_caching_allocator::backend::cuda::cuda_available(),
        "CCA_TEST_CUDA=1 but no CUDA device works"
    );
    true
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
