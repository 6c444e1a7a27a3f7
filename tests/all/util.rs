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
