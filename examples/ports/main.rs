//! The port pairs: cudarc-style programs, each in two versions that differ only where buffers
//! are created — `NAME/plain.rs` uses cudarc 0.19's own allocation, `NAME/cached.rs` the same
//! program moved onto `cuda_caching_allocator::interop` by following
//! `docs/migrating-from-cudarc.md`. Every program prints its results as checksums, so that the
//! two versions can be compared line by line on a GPU (`gpu/run.sh ports`), and
//! `tests/all/ports.rs` counts the changed lines of every pair for the guide's table.
//!
//! Run: `cargo run --release --example ports --features cublas -- [plain|cached] [NAME...]`
//! (`list` prints the names). Without a GPU it says so and exits successfully.

use std::error::Error;
use std::process::ExitCode;

/// One program: its name and its two versions.
struct Pair {
    name: &'static str,
    plain: fn() -> Result<(), Box<dyn Error>>,
    cached: fn() -> Result<(), Box<dyn Error>>,
}

// The pairs' modules, `NAME/plain.rs` and `NAME/cached.rs` (declared one by one, not by a
// macro, so that rustfmt formats them).
mod nvrtc_kernel {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod cublas_gemm {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod cublaslt_matmul {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod curand_fill {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod nccl_allreduce {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod graph_replay {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod graph_alloc {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod views {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod pinned_copies {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod two_streams {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod clones {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod memset_zeros {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod buffer_fn {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod driver_error {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod as_cuda_slice {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod loop_temporaries {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}
mod host_roundtrip {
    #[path = "cached.rs"]
    pub(crate) mod cached;
    #[path = "plain.rs"]
    pub(crate) mod plain;
}

/// The table of the pairs.
macro_rules! pairs {
    ($($name:ident),* $(,)?) => {
        const PAIRS: &[Pair] = &[
            $(Pair {
                name: stringify!($name),
                plain: || $name::plain::main().map_err(Into::into),
                cached: || $name::cached::main().map_err(Into::into),
            },)*
        ];
    };
}

pairs!(
    nvrtc_kernel,
    cublas_gemm,
    cublaslt_matmul,
    curand_fill,
    nccl_allreduce,
    graph_replay,
    graph_alloc,
    views,
    pinned_copies,
    two_streams,
    clones,
    memset_zeros,
    buffer_fn,
    driver_error,
    as_cuda_slice,
    loop_temporaries,
    host_roundtrip,
);

/// An FNV-1a hash of the values' little-endian bytes: equal results print equal checksums.
pub(crate) trait Checksum: Copy + std::fmt::Debug {
    /// The value's bytes, little-endian.
    fn bytes(self) -> Vec<u8>;
}

macro_rules! checksum_le {
    ($($t:ty),*) => {
        $(impl Checksum for $t {
            fn bytes(self) -> Vec<u8> {
                self.to_le_bytes().to_vec()
            }
        })*
    };
}
checksum_le!(f32, f64, u8, u32, i32, u64);

/// Prints `label`, the length, the checksum and the first four values of `values`.
pub(crate) fn report<T: Checksum>(label: &str, values: &[T]) {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.bytes() {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let head: Vec<T> = values.iter().take(4).copied().collect();
    println!(
        "{label}: len {} checksum {hash:016x} head {head:?}",
        values.len()
    );
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let version = args.next().unwrap_or_else(|| "list".to_string());
    if version == "list" {
        for p in PAIRS {
            println!("{}", p.name);
        }
        return ExitCode::SUCCESS;
    }
    if version != "plain" && version != "cached" {
        eprintln!("usage: ports [list | plain NAME... | cached NAME...] (no NAME: all)");
        return ExitCode::from(2);
    }
    let names: Vec<String> = args.collect();
    if let Some(unknown) = names.iter().find(|n| !PAIRS.iter().any(|p| p.name == *n)) {
        eprintln!("no program named {unknown} (`ports list` names them)");
        return ExitCode::from(2);
    }
    if !cuda_caching_allocator::backend::cuda::cuda_available() {
        println!("no CUDA device: nothing to run");
        return ExitCode::SUCCESS;
    }
    let mut failed = false;
    for p in PAIRS {
        if !names.is_empty() && !names.iter().any(|n| n == p.name) {
            continue;
        }
        println!("== {}", p.name);
        let run = if version == "plain" {
            p.plain
        } else {
            p.cached
        };
        if let Err(e) = run() {
            println!("{} failed: {e}", p.name);
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
