//! The spinning kernels of the GPU stream-order probes (`cuda_streams.rs`, `interop_review2.rs`,
//! `interop_review3.rs`): a kernel that waits about 20 ms before it touches memory makes a
//! missing wait visible. Buffers of `N` values; `expected(v)` is what `spin_fill` writes.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};

/// Values per buffer: 4 MiB of `u32`.
pub const N: usize = 1 << 20;
/// About 20 ms of spinning at 2 GHz: long enough for the host to queue the conflicting work.
pub const SPIN: i64 = 40_000_000;
/// No spinning: the kernel runs at once.
pub const NO_SPIN: i64 = 0;
/// A value no probe writes otherwise.
pub const JUNK: u32 = 0xDEAD_0000;

const KERNELS: &str = r#"
extern "C" __global__ void spin_fill(unsigned int* p, unsigned long long n, unsigned int v,
                                     long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = v + (unsigned int)i;
}
extern "C" __global__ void spin_copy(const unsigned int* src, unsigned int* dst,
                                     unsigned long long n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"#;

/// The three kernels, loaded in one context.
pub struct Kernels {
    /// `spin_fill(unsigned* p, u64 n, u32 v, i64 cycles)`: `p[i] = v + i` after spinning.
    pub spin_fill: CudaFunction,
    /// `spin_copy(const unsigned* src, unsigned* dst, u64 n, i64 cycles)`.
    pub spin_copy: CudaFunction,
    /// `spin(i64 cycles)`: touches no memory.
    pub spin: CudaFunction,
}

/// Loads the kernels in `ctx`.
pub fn kernels(ctx: &Arc<CudaContext>) -> Kernels {
    let module = crate::util::load_module(ctx, KERNELS);
    Kernels {
        spin_fill: module.load_function("spin_fill").unwrap(),
        spin_copy: module.load_function("spin_copy").unwrap(),
        spin: module.load_function("spin").unwrap(),
    }
}

/// A full grid for the kernels that do not spin.
pub fn grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1024, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Two blocks for the spinning kernels: they must leave the GPU's other multiprocessors free,
/// or a device-to-device copy (itself a kernel) cannot start before they end and the race
/// cannot show (seen on an H100 with a full grid: the control arm of hazard (a) stayed correct).
pub fn spin_grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (2, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What `spin_fill(.., v, ..)` writes into `N` values.
pub fn expected(v: u32) -> Vec<u32> {
    (0..N as u32).map(|i| v.wrapping_add(i)).collect()
}

/// `spin_fill(dst, N, v, cycles)` on `s` (`dst`: any kernel argument of `N` or more `u32`); the
/// launch's result.
macro_rules! fill {
    ($s:expr, $k:expr, $dst:expr, $v:expr, $cycles:expr, $cfg:expr) => {{
        let n = $crate::spin::N as u64;
        let v: u32 = $v;
        let cycles: i64 = $cycles;
        let mut l = $s.launch_builder(&$k.spin_fill);
        l.arg($dst).arg(&n).arg(&v).arg(&cycles);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes `N` values of a buffer of `N` or more.
        unsafe { l.launch($cfg) }
    }};
}
pub(crate) use fill;

/// `spin_copy(src, dst, N, SPIN)` on `s`: reads `src` after about 20 ms.
macro_rules! slow_copy {
    ($s:expr, $k:expr, $src:expr, $dst:expr) => {{
        let n = $crate::spin::N as u64;
        let mut l = $s.launch_builder(&$k.spin_copy);
        l.arg($src).arg($dst).arg(&n).arg(&$crate::spin::SPIN);
        // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) on two `N`-value buffers.
        unsafe { l.launch($crate::spin::spin_grid()) }.unwrap();
    }};
}
pub(crate) use slow_copy;
