//! NCCL in one process over every GPU present (a group of one on a single GPU): all-reduce,
//! broadcast and all-gather through `Comm`, then a grouped all-reduce through `Group`, whose
//! collectives take cudarc's `CudaView` / `CudaViewMut` by value.
//!
//! A port pair: `plain.rs` allocates with cudarc, `cached.rs` with the caching allocator.

use std::error::Error;

use cudarc::driver::CudaContext;
use cudarc::nccl::{Comm, ReduceOp, group_end, group_start};

const N: usize = 4096;

fn nccl<T>(r: Result<T, cudarc::nccl::result::NcclError>) -> Result<T, Box<dyn Error>> {
    r.map_err(|e| format!("NCCL: {:?}", e.0).into())
}

pub(crate) fn main() -> Result<(), Box<dyn Error>> {
    let devices = CudaContext::device_count()? as usize;
    let mut streams = Vec::new();
    for ordinal in 0..devices {
        streams.push(CudaContext::new(ordinal)?.default_stream());
    }
    let comms = nccl(Comm::from_devices(streams))?;
    println!("ranks: {}", comms.len());

    let (mut sends, mut recvs, mut gathered, mut maxes) = (vec![], vec![], vec![], vec![]);
    for comm in &comms {
        let stream = comm.stream();
        let rank = comm.rank();
        let alloc = cuda_caching_allocator::interop::CudaAllocator::for_stream(&stream)?;
        let host: Vec<f32> = (0..N).map(|i| ((i + rank) % 17) as f32).collect();
        sends.push(alloc.clone_htod(&stream, &host)?);
        recvs.push(alloc.alloc_zeros::<f32>(&stream, N)?);
        gathered.push(alloc.alloc_zeros::<f32>(&stream, N * comms.len())?);
        maxes.push(alloc.alloc_zeros::<f32>(&stream, N / 2)?);
    }

    nccl(group_start())?;
    for ((comm, send), recv) in comms.iter().zip(&sends).zip(&mut recvs) {
        nccl(comm.all_reduce(send, recv, &ReduceOp::Sum))?;
    }
    nccl(group_end())?;
    crate::report("all_reduce", &comms[0].stream().clone_dtoh(&recvs[0])?);

    nccl(group_start())?;
    for (comm, recv) in comms.iter().zip(&mut recvs) {
        nccl(comm.broadcast_in_place(recv, 0))?;
    }
    nccl(group_end())?;
    let last = &recvs[recvs.len() - 1];
    crate::report("broadcast", &last.stream().clone_dtoh(last)?);

    nccl(group_start())?;
    for ((comm, send), out) in comms.iter().zip(&sends).zip(&mut gathered) {
        nccl(comm.all_gather(send, out))?;
    }
    nccl(group_end())?;
    crate::report("all_gather", &comms[0].stream().clone_dtoh(&gathered[0])?);

    nccl(group_start())?;
    for ((comm, send), out) in comms.iter().zip(&sends).zip(&mut maxes) {
        let (part, whole) = (send.as_cuda_view().slice(..N / 2), out.as_cuda_view_mut());
        let mut group = comm.group();
        nccl(group.all_reduce(part, whole, &ReduceOp::Max))?;
    }
    nccl(group_end())?;
    crate::report(
        "group_all_reduce_max",
        &comms[0].stream().clone_dtoh(&maxes[0])?,
    );
    Ok(())
}
