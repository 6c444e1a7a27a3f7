//! A framework-shaped program (as candle's CUDA backend is built): a storage enum over several
//! element types, an accessor that hands out `&CudaSlice<T>`, and a custom op written against
//! cudarc's concrete type. It is moved onto the cache by changing the allocation layer only —
//! the `Buffer<T>` alias and the three functions of `mod alloc_layer`; the storage accessors, the
//! op and the rest keep their code, because `CachedSlice::as_cuda_slice` hands out the same
//! `&CudaSlice<T>` (with the buffer's own stream-ordering events).
//!
//! The plain-cudarc version of the layer is in the comments of `mod alloc_layer`: the diff is
//! those 4 lines (`docs/migrating-from-cudarc.md`, "Frameworks").
//!
//! Run: `cargo run --release --example framework_storage --features cuda`. Without a GPU it says
//! so and exits successfully.

use std::sync::Arc;

use cuda_caching_allocator::backend::cuda::cuda_available;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};

/// The allocation layer: the only code that changes in the port.
mod alloc_layer {
    use std::sync::Arc;

    use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
    use cudarc::driver::{
        CudaSlice, CudaStream, DeviceRepr, DriverError, HostSlice, ValidAsZeroBits,
    };

    /// The framework's owned buffer. Plain cudarc: `pub type Buffer<T> = CudaSlice<T>;`
    pub(crate) type Buffer<T> = CachedSlice<T>;

    fn cache(stream: &Arc<CudaStream>) -> Result<&'static CudaAllocator, DriverError> {
        Ok(CudaAllocator::for_stream(stream)?)
    }

    /// Plain cudarc: `stream.alloc_zeros(len)`.
    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Buffer<T>, DriverError> {
        Ok(cache(stream)?.alloc_zeros(stream, len)?)
    }

    /// Plain cudarc: `stream.clone_htod(src)`.
    pub(crate) fn upload<T: DeviceRepr, S: HostSlice<T> + ?Sized>(
        stream: &Arc<CudaStream>,
        src: &S,
    ) -> Result<Buffer<T>, DriverError> {
        Ok(cache(stream)?.clone_htod(stream, src)?)
    }

    /// Plain cudarc: `buf` itself (`&CudaSlice<T>`).
    pub(crate) fn as_cuda<T>(buf: &Buffer<T>) -> &CudaSlice<T> {
        buf.as_cuda_slice()
    }
}

use alloc_layer::{Buffer, as_cuda};

/// The framework's storage: one variant per element type, as in candle's `CudaStorageSlice`.
enum Storage {
    F32(Buffer<f32>),
    U32(Buffer<u32>),
    I64(Buffer<i64>),
}

impl Storage {
    fn zeros(stream: &Arc<CudaStream>, dtype: &str, len: usize) -> Result<Self, DriverError> {
        Ok(match dtype {
            "u32" => Storage::U32(alloc_layer::zeros(stream, len)?),
            "i64" => Storage::I64(alloc_layer::zeros(stream, len)?),
            _ => Storage::F32(alloc_layer::zeros(stream, len)?),
        })
    }

    /// The accessor that kernels and custom ops use (candle's `as_cuda_slice::<T>()`): unchanged
    /// by the port.
    fn as_cuda_slice<T: StorageType>(&self) -> Option<&CudaSlice<T>> {
        T::pick(self)
    }
}

trait StorageType: DeviceRepr + ValidAsZeroBits + Sized {
    fn pick(s: &Storage) -> Option<&CudaSlice<Self>>;
}

impl StorageType for f32 {
    fn pick(s: &Storage) -> Option<&CudaSlice<f32>> {
        match s {
            Storage::F32(b) => Some(as_cuda(b)),
            _ => None,
        }
    }
}

impl StorageType for u32 {
    fn pick(s: &Storage) -> Option<&CudaSlice<u32>> {
        match s {
            Storage::U32(b) => Some(as_cuda(b)),
            _ => None,
        }
    }
}

impl StorageType for i64 {
    fn pick(s: &Storage) -> Option<&CudaSlice<i64>> {
        match s {
            Storage::I64(b) => Some(as_cuda(b)),
            _ => None,
        }
    }
}

const KERNEL: &str = r#"
extern "C" __global__ void scale_add(const float* x, float a, float b, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"#;

/// A custom op written against cudarc's concrete type: `y = a * x + b`, on `stream`.
fn custom_op(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    x: &CudaSlice<f32>,
    a: f32,
    b: f32,
) -> Result<Storage, DriverError> {
    let n = x.len();
    let mut y = alloc_layer::zeros::<f32>(stream, n)?;
    let n32 = n as u32;
    let mut launch = stream.launch_builder(f);
    launch.arg(x).arg(&a).arg(&b).arg(&mut y).arg(&n32);
    // SAFETY: `scale_add` takes (const float*, float, float, float*, unsigned int); both buffers
    // hold `n` floats and the kernel checks bounds.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n32)) }?;
    Ok(Storage::F32(y))
}

fn main() -> Result<(), DriverError> {
    if !cuda_available() {
        println!("no CUDA device: nothing to run");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    // Two streams, so cudarc orders them and the cached buffers carry events.
    let stream = ctx.default_stream();
    let other = ctx.new_stream()?;
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL).map_err(|e| {
        eprintln!("NVRTC: {e}");
        DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_SOURCE)
    })?;
    let f = ctx.load_module(ptx)?.load_function("scale_add")?;

    let host: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    let x = Storage::F32(alloc_layer::upload(&stream, &host)?);
    let counts = Storage::zeros(&stream, "u32", 16)?;
    let offsets = Storage::zeros(&stream, "i64", 16)?;
    for step in 0..3 {
        let Some(xs) = x.as_cuda_slice::<f32>() else {
            unreachable!("x is f32")
        };
        // The op runs on the other stream; cudarc's events order it after the upload.
        let y = custom_op(&other, &f, xs, 2.0, step as f32)?;
        let Some(ys) = y.as_cuda_slice::<f32>() else {
            unreachable!("custom_op returns f32")
        };
        let out = other.clone_dtoh(ys)?;
        assert_eq!(out.len(), host.len());
        assert!(
            out.iter()
                .enumerate()
                .all(|(i, &v)| v == 2.0 * i as f32 + step as f32)
        );
    }
    assert!(counts.as_cuda_slice::<u32>().is_some() && offsets.as_cuda_slice::<i64>().is_some());
    let cache = cuda_caching_allocator::interop::CudaAllocator::shared(0)?;
    println!(
        "ok: 3 steps of the custom op; device allocations: {}",
        cache.memory_stats().num_device_alloc
    );
    Ok(())
}
