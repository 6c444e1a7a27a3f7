//! Two streams: a producer stream and a consumer stream (`fork`), buffers written on one and
//! read on the other, explicit events (`record_event`, `wait`, `join`), and temporaries dropped
//! while the other stream may still use them. cudarc's event tracking orders every cross-stream
//! use; the results must not depend on timing.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

const SRC: &str = r#"
extern "C" __global__ void fill(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v + (float)(i % 16);
}
extern "C" __global__ void slow_add(const float* a, float* acc, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = a[i];
    for (int k = 0; k < 200; k++) v = v * 0.5f + a[i] * 0.5f;
    acc[i] += v;
}
"#;

const N: usize = 1 << 20;

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let ctx = CudaContext::new(0)?;
    let producer = ctx.default_stream();
    let consumer = producer.fork()?;
    let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&producer)?;
    let module = ctx.load_module(compile_ptx(SRC)?)?;
    let fill = module.load_function("fill")?;
    let slow_add = module.load_function("slow_add")?;
    let n = N as u32;
    let cfg = LaunchConfig::for_num_elems(n);

    let mut acc = alloc.alloc_zeros::<f32>(&consumer, N)?;
    for round in 0..8u32 {
        // Written on the producer, read on the consumer, dropped at the end of the round: its
        // memory may be reused only after the consumer's read.
        let mut tmp = alloc.alloc_zeros::<f32>(&producer, N)?;
        let value = round as f32;
        let mut launch = producer.launch_builder(&fill);
        launch.arg(&mut tmp).arg(&value).arg(&n);
        // SAFETY: (float*, float, unsigned) with `n` floats in `tmp`.
        unsafe { launch.launch(cfg) }?;
        let mut launch = consumer.launch_builder(&slow_add);
        launch.arg(&tmp).arg(&mut acc).arg(&n);
        // SAFETY: (const float*, float*, unsigned) with `n` floats in both.
        unsafe { launch.launch(cfg) }?;
    }
    crate::report("accumulated", &producer.clone_dtoh(&acc)?);

    // Explicit events: the consumer waits for the producer's fill before copying.
    let mut staged = alloc.alloc_zeros::<f32>(&producer, N)?;
    let mut launch = producer.launch_builder(&fill);
    launch.arg(&mut staged).arg(&100.0f32).arg(&n);
    // SAFETY: as above.
    unsafe { launch.launch(cfg) }?;
    let filled = producer.record_event(None)?;
    consumer.wait(&filled)?;
    let mut copy = alloc.clone_htod(&consumer, &vec![0.0f32; N])?;
    consumer.memcpy_dtod(&staged, &mut copy)?;
    producer.join(&consumer)?;
    crate::report("event_ordered_copy", &producer.clone_dtoh(&copy)?);
    drop(staged);

    // A buffer of the consumer, freed there, then a new one of the producer written at once.
    let mut last = alloc.alloc_zeros::<f32>(&consumer, N)?;
    let mut launch = consumer.launch_builder(&slow_add);
    launch.arg(&acc).arg(&mut last).arg(&n);
    // SAFETY: (const float*, float*, unsigned) with `n` floats in both.
    unsafe { launch.launch(cfg) }?;
    let result = consumer.clone_dtoh(&last)?;
    drop(last);
    let mut fresh = alloc.alloc_zeros::<f32>(&producer, N)?;
    let mut launch = producer.launch_builder(&fill);
    launch.arg(&mut fresh).arg(&-5.0f32).arg(&n);
    // SAFETY: as above.
    unsafe { launch.launch(cfg) }?;
    crate::report("consumer_result", &result);
    crate::report("fresh", &producer.clone_dtoh(&fresh)?);
    Ok(())
}
