//! Private pools: CUDA graph captures (`beginAllocateToPool` / `endAllocateToPool` /
//! `releasePool`) and `torch.cuda.MemPool` (`createOrIncrefPool`, `getPoolUseCount`).
//!
//! Two ways to route a capture's allocations: the C++ shim passes PyTorch's own stream filter as
//! a C callback ([`cca_begin_allocate_to_pool_with`]); the pluggable route cannot call PyTorch's
//! `std::function`, so [`cca_begin_allocate_to_pool`] binds the first capture that allocates
//! after it (asking the driver for each allocating stream's capture id), unless the package's
//! wrapper of the PyTorch binding that called it said what the filter is
//! ([`cca_next_routing`]: Note [Routings without a capture on the pluggable route]).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuda_caching_allocator::interop::{AllocatorRegistry, CudaAllocator};
use cuda_caching_allocator::{DeviceBackend, MemPoolId, PoolFilter, StreamId};
use parking_lot::Mutex;

use crate::error::{KIND_OTHER, fail, fail_alloc, guarded};
use crate::hooks::ordinal;

/// PyTorch's `MempoolId_t` (`std::pair<unsigned long long, unsigned long long>`), passed by value.
/// The pair's copy and move constructors are defaulted and its destructor trivial, so the
/// Itanium C++ ABI passes it as this C struct of two 64-bit integers.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MempoolId {
    /// `first`: a graph's own pool counter (`(n, 0)`).
    pub first: u64,
    /// `second`: a user pool counter (`(0, n)`, `graph_pool_handle()`, `MemPool`).
    pub second: u64,
}

impl MempoolId {
    fn id(self) -> MemPoolId {
        MemPoolId(self.first, self.second)
    }
}

/// The cache of `device`, created on first use; `None` (error recorded) when there is none.
fn device_cache(what: &str, device: c_int) -> Option<&'static CudaAllocator> {
    let Some(d) = ordinal(device) else {
        fail(KIND_OTHER, format!("{what}: bad device {device}"));
        return None;
    };
    match AllocatorRegistry::global().get(d) {
        Ok(a) => Some(a),
        Err(e) => {
            fail_alloc(&format!("{what}(device {device})"), &e);
            None
        }
    }
}

/// A C stream filter: `accept(ctx, stream)` decides, `drop(ctx)` runs once when the routing
/// ends and the filter is dropped.
struct CFilter {
    accept: extern "C" fn(*mut c_void, *mut c_void) -> bool,
    drop: Option<extern "C" fn(*mut c_void)>,
    ctx: *mut c_void,
}

// SAFETY: `cca_begin_allocate_to_pool_with`'s caller promises that `accept` may be called with
// `ctx` from any thread and that `drop` may run on any thread.
unsafe impl Send for CFilter {}
// SAFETY: as above: concurrent `accept` calls with the same `ctx` are allowed by the caller.
unsafe impl Sync for CFilter {}

impl CFilter {
    /// Whether the filter admits `stream` (a method, so that closures capture the whole filter).
    fn accepts(&self, stream: StreamId) -> bool {
        (self.accept)(
            self.ctx,
            std::ptr::with_exposed_provenance_mut(stream.0 as usize),
        )
    }
}

impl Drop for CFilter {
    fn drop(&mut self) {
        if let Some(d) = self.drop {
            d(self.ctx);
        }
    }
}

/// Routes `device`'s allocations on the streams `accept` admits into private pool `pool`
/// (making it if new) until [`cca_end_allocate_to_pool`]: PyTorch's `beginAllocateToPool` with
/// its filter as a C callback. 0 on success, -1 on failure, a null `accept` included (the error
/// is recorded; `drop` has then already run).
///
/// # Safety
/// `accept(ctx, stream)` may be called from any thread, concurrently, until `drop(ctx)` runs;
/// it must not call into this library. `drop`, when given, runs exactly once, on any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_begin_allocate_to_pool_with(
    device: c_int,
    pool: MempoolId,
    accept: Option<extern "C" fn(*mut c_void, *mut c_void) -> bool>,
    ctx: *mut c_void,
    drop: Option<extern "C" fn(*mut c_void)>,
) -> c_int {
    let Some(accept) = accept else {
        return guarded("cca_begin_allocate_to_pool_with", -1, || {
            if let Some(d) = drop {
                d(ctx);
            }
            fail(
                KIND_OTHER,
                "cca_begin_allocate_to_pool_with: null accept callback".into(),
            );
            -1
        });
    };
    let cf = CFilter { accept, drop, ctx };
    guarded("cca_begin_allocate_to_pool_with", -1, move || {
        let Some(alloc) = device_cache("beginAllocateToPool", device) else {
            return -1;
        };
        let filter: PoolFilter = Box::new(move |stream: StreamId| cf.accepts(stream));
        match alloc.begin_allocate_to_pool(pool.id(), filter) {
            Ok(()) => 0,
            Err(e) => {
                fail_alloc(
                    &format!(
                        "beginAllocateToPool(device {device}, pool ({}, {}))",
                        pool.first, pool.second
                    ),
                    &e,
                );
                -1
            }
        }
    })
}

/// Note [Routings without a capture on the pluggable route]: PyTorch routes allocations into a
/// private pool without any capture too. `torch.cuda.use_mem_pool` and CUDA graph trees' warm-up
/// (`torch._C._cuda_beginAllocateCurrentThreadToPool`) route the calling thread's allocations,
/// whatever their stream; `torch._C._cuda_beginAllocateToPool` routes every allocation of the
/// device. Each binding hands PyTorch's allocator a `std::function` filter saying so, which the
/// pluggable hook receives but cannot call; the capture binding below then routed nothing (no
/// stream is captured), and the allocations went to the default pool. The package wraps these
/// bindings on the pluggable route: each wrapper says here, just before it calls PyTorch, which
/// filter PyTorch is about to pass, and [`cca_begin_allocate_to_pool`], called by PyTorch in the
/// same thread, takes it.
#[derive(Clone, Copy, Debug)]
enum NextRouting {
    /// The calling thread's allocations (`_cuda_beginAllocateCurrentThreadToPool`).
    Thread,
    /// Every allocation of the device (`_cuda_beginAllocateToPool`).
    All,
    /// Allocations on one stream (`_cuda_beginAllocateCurrentStreamToPool`).
    Stream(StreamId),
}

thread_local! {
    /// What the next [`cca_begin_allocate_to_pool`] of this thread routes (see the note).
    static NEXT_ROUTING: Cell<Option<NextRouting>> = const { Cell::new(None) };
    /// This thread's number (never reused, unlike a thread id after the thread ended).
    static THREAD_NO: u64 = NEXT_THREAD_NO.fetch_add(1, Ordering::Relaxed);
}

/// The next thread number; 0 is no thread's.
static NEXT_THREAD_NO: AtomicU64 = AtomicU64::new(1);

/// The calling thread's number, 0 while the thread's locals are being destroyed.
fn thread_no() -> u64 {
    THREAD_NO.try_with(|n| *n).unwrap_or(0)
}

/// Says what the next [`cca_begin_allocate_to_pool`] of the calling thread routes, for the
/// package's wrappers of PyTorch's routing bindings on the pluggable route (Note [Routings
/// without a capture on the pluggable route]): `kind` 1, the calling thread's allocations; 2,
/// every allocation of the device; 3, allocations on `stream`; 0 forgets what was said (the
/// wrapper calls it after PyTorch returns, also when PyTorch raised before calling the hook).
/// 0 on success, -1 for another `kind` (nothing changes; the error is recorded).
#[unsafe(no_mangle)]
pub extern "C" fn cca_next_routing(kind: c_int, stream: *mut c_void) -> c_int {
    guarded("cca_next_routing", -1, || {
        let next = match kind {
            0 => None,
            1 => Some(NextRouting::Thread),
            2 => Some(NextRouting::All),
            3 => Some(NextRouting::Stream(StreamId(stream.addr() as u64))),
            _ => {
                fail(KIND_OTHER, format!("cca_next_routing: unknown kind {kind}"));
                return -1;
            }
        };
        match NEXT_ROUTING.try_with(|c| c.set(next)) {
            Ok(()) => 0,
            Err(_) => -1,
        }
    })
}

/// The filter of a routing a wrapper announced, made in the thread that begins it.
fn announced_filter(next: NextRouting) -> PoolFilter {
    match next {
        NextRouting::Thread => {
            let mine = thread_no();
            Box::new(move |_| mine != 0 && thread_no() == mine)
        }
        NextRouting::All => Box::new(|_| true),
        NextRouting::Stream(s) => Box::new(move |stream| stream == s),
    }
}

/// Capture ids already bound to a pool by an active pluggable routing, per device: a routing
/// whose filter meets the stream of another pool's capture must not claim it.
static BOUND_CAPTURES: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());

/// An active pluggable routing: device, pool id, and the capture id bound to it (0 until bound).
type Route = (usize, u64, u64, Arc<AtomicU64>);

/// The active pluggable routings.
static ROUTES: Mutex<Vec<Route>> = Mutex::new(Vec::new());

/// `void begin_allocate_to_pool(int device, MempoolId_t pool, std::function<bool(cudaStream_t)>)`,
/// PyTorch's pluggable `set_begin_allocate_to_pool` hook, called by `CUDAGraph::capture_begin`
/// just before `cudaStreamBeginCapture`, and by PyTorch's routing bindings. PyTorch's filter is a
/// C++ `std::function`, passed by invisible reference: `filter` is its address, which a C ABI
/// cannot call and which is not used. When the package's wrapper of the binding that called this
/// said what the filter is ([`cca_next_routing`]), that routing is made; otherwise the routing
/// binds the first capture, not bound by another routing of the device, that allocates after
/// this call: the capture PyTorch is about to begin.
///
/// # Safety
/// Called by PyTorch with a device ordinal and a pool id; `filter` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_begin_allocate_to_pool(
    device: c_int,
    pool: MempoolId,
    filter: *const c_void,
) {
    let _ = filter;
    guarded("cca_begin_allocate_to_pool", (), || {
        let Some(alloc) = device_cache("begin_allocate_to_pool", device) else {
            return;
        };
        let Some(ordinal) = ordinal(device) else {
            return;
        };
        if let Some(next) = NEXT_ROUTING.try_with(Cell::take).ok().flatten() {
            // Not in ROUTES: no capture is bound to it (its end finds nothing there to drop).
            if let Err(e) = alloc.begin_allocate_to_pool(pool.id(), announced_filter(next)) {
                fail_alloc(
                    &format!(
                        "begin_allocate_to_pool(device {device}, pool ({}, {}))",
                        pool.first, pool.second
                    ),
                    &e,
                );
            }
            return;
        }
        let bound = Arc::new(AtomicU64::new(0));
        let mine = Arc::clone(&bound);
        let filter: PoolFilter = Box::new(move |stream| {
            let id = match alloc.device().stream_capture_id(stream) {
                Ok(Some(id)) => id,
                Ok(None) => return false,
                // A failed query of a routing already bound to its capture counts as that
                // capture (the crate's `capture_filter` rule): a captured allocation must not
                // take a block eager work could get back while the graph still uses it.
                Err(_) => return mine.load(Ordering::Acquire) != 0,
            };
            let have = mine.load(Ordering::Acquire);
            if have != 0 {
                return have == id;
            }
            let mut taken = BOUND_CAPTURES.lock();
            if taken.iter().any(|&(d, c)| d == ordinal && c == id) {
                return false;
            }
            taken.push((ordinal, id));
            mine.store(id, Ordering::Release);
            true
        });
        let entry = Arc::clone(&bound);
        ROUTES
            .lock()
            .push((ordinal, pool.first, pool.second, bound));
        if let Err(e) = alloc.begin_allocate_to_pool(pool.id(), filter) {
            // Only this call's entry: a routing of the same pool already under way (the core
            // refuses a second one) keeps its own, which its end will look for.
            ROUTES.lock().retain(|r| !Arc::ptr_eq(&r.3, &entry));
            fail_alloc(
                &format!(
                    "begin_allocate_to_pool(device {device}, pool ({}, {}))",
                    pool.first, pool.second
                ),
                &e,
            );
        }
    })
}

/// `void end_allocate_to_pool(int device, MempoolId_t pool)`, PyTorch's `endAllocateToPool`
/// (`CUDAGraph::capture_end`, the end of `use_mem_pool`): stops routing allocations into `pool`.
/// Errors are recorded.
#[unsafe(no_mangle)]
pub extern "C" fn cca_end_allocate_to_pool(device: c_int, pool: MempoolId) {
    guarded("cca_end_allocate_to_pool", (), || {
        let Some(ordinal) = ordinal(device) else {
            fail(
                KIND_OTHER,
                format!("end_allocate_to_pool: bad device {device}"),
            );
            return;
        };
        let mut routes = ROUTES.lock();
        if let Some(i) = routes
            .iter()
            .position(|r| r.0 == ordinal && r.1 == pool.first && r.2 == pool.second)
        {
            let (_, _, _, bound) = routes.remove(i);
            let id = bound.load(Ordering::Acquire);
            BOUND_CAPTURES
                .lock()
                .retain(|&(d, c)| !(d == ordinal && c == id));
        }
        drop(routes);
        if let Some(alloc) = AllocatorRegistry::global().get_if_created(ordinal)
            && let Err(e) = alloc.end_allocate_to_pool(pool.id())
        {
            fail_alloc(
                &format!(
                    "end_allocate_to_pool(device {device}, pool ({}, {}))",
                    pool.first, pool.second
                ),
                &e,
            );
        }
    })
}

/// `void release_pool(int device, MempoolId_t pool)`, PyTorch's `releasePool` (`CUDAGraph::reset`,
/// a graph's or `MemPool`'s destruction): gives back one use of `pool`; its memory returns to the
/// device at the next `empty_cache` once unused. Errors are recorded.
///
/// # Safety
/// No graph captured into `pool` is launched after its last use is given back: its memory goes
/// to other allocations and, at the next `empty_cache`, back to the driver.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_release_pool(device: c_int, pool: MempoolId) {
    guarded("cca_release_pool", (), || {
        let Some(alloc) =
            ordinal(device).and_then(|d| AllocatorRegistry::global().get_if_created(d))
        else {
            return;
        };
        // SAFETY: the caller's promise above, `release_pool`'s obligation (PyTorch gives a
        // pool's use back when the graph or `MemPool` holding it is reset or destroyed:
        // `CUDAGraph::reset`, `~MemPool`; no graph replays it afterwards).
        if let Err(e) = unsafe { alloc.release_pool(pool.id()) } {
            fail_alloc(
                &format!(
                    "release_pool(device {device}, pool ({}, {}))",
                    pool.first, pool.second
                ),
                &e,
            );
        }
    })
}

/// PyTorch's `createOrIncrefPool` (`torch.cuda.MemPool()`): makes private pool `pool` on
/// `device` with one use, or adds a use. 0 on success, -1 on failure (error recorded).
#[unsafe(no_mangle)]
pub extern "C" fn cca_create_pool(device: c_int, pool: MempoolId) -> c_int {
    guarded("cca_create_pool", -1, || {
        let Some(alloc) = device_cache("createOrIncrefPool", device) else {
            return -1;
        };
        // SAFETY: `create_pool` frees nothing, which is `core`'s only obligation.
        match unsafe { alloc.core() }.create_pool(pool.id()) {
            Ok(()) => 0,
            Err(e) => {
                fail_alloc(
                    &format!(
                        "createOrIncrefPool(device {device}, pool ({}, {}))",
                        pool.first, pool.second
                    ),
                    &e,
                );
                -1
            }
        }
    })
}

/// PyTorch's `getPoolUseCount` (`MemPool.use_count()`): the uses of `pool` on `device`, 0 when
/// there is no such pool.
#[unsafe(no_mangle)]
pub extern "C" fn cca_pool_use_count(device: c_int, pool: MempoolId) -> c_int {
    guarded("cca_pool_use_count", 0, || {
        ordinal(device)
            .and_then(|d| AllocatorRegistry::global().get_if_created(d))
            .and_then(|a| a.pool_use_count(pool.id()))
            .and_then(|n| c_int::try_from(n).ok())
            .unwrap_or(0)
    })
}

/// One block of a checkpointed segment, for [`cca_restore_pool`]: its address and size, whether
/// it was allocated (1) or free (0) at the checkpoint, and whether it is the first block of its
/// segment (1).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CcaCheckpointBlock {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// 1 when the block was allocated at the checkpoint.
    pub allocated: u32,
    /// 1 when the block starts a segment.
    pub segment_start: u32,
}

const _: () = assert!(std::mem::size_of::<CcaCheckpointBlock>() == 24);

/// PyTorch's `setCheckpointPoolState`: restores private pool `pool` of `device` to the
/// checkpoint `blocks[..n]` (each segment's blocks in address order, segments one after another),
/// as [`CudaAllocator::restore_pool`] does. `changed(ctx, ptr, 0)` is called for each allocation
/// freed, then `changed(ctx, ptr, 1)` for each allocated again, in address order. 0 on success,
/// -1 on failure, a null `changed` or a null `blocks` with `n > 0` included (nothing changed; the
/// error is recorded).
///
/// # Safety
/// `blocks` is null or readable for `n` blocks; `changed` does not call into this library; every
/// allocation of `pool` live now came from [`cca_alloc`](crate::cca_alloc) and nothing uses or
/// frees it afterwards (the restore frees it: PyTorch's graph trees restore a pool only once the
/// tensors on those allocations are dead, and never free the pointers reported as freed).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cca_restore_pool(
    device: c_int,
    pool: MempoolId,
    blocks: *const CcaCheckpointBlock,
    n: usize,
    changed: Option<extern "C" fn(*mut c_void, u64, c_int)>,
    ctx: *mut c_void,
) -> c_int {
    use cuda_caching_allocator::{
        BlockSnapshot, BlockState, DeviceAddr, PoolCheckpoint, SegmentSnapshot,
    };
    guarded("cca_restore_pool", -1, || {
        let Some(changed) = changed else {
            fail(KIND_OTHER, "cca_restore_pool: null callback".into());
            return -1;
        };
        if blocks.is_null() && n > 0 {
            fail(
                KIND_OTHER,
                format!("cca_restore_pool: null blocks (n = {n})"),
            );
            return -1;
        }
        let Some(alloc) = device_cache("setCheckpointPoolState", device) else {
            return -1;
        };
        let blocks: &[CcaCheckpointBlock] = if n == 0 {
            &[]
        } else {
            // SAFETY: readable for `n` blocks by the caller's promise.
            unsafe { std::slice::from_raw_parts(blocks, n) }
        };
        let mut segments: Vec<SegmentSnapshot> = Vec::new();
        for b in blocks {
            let block = BlockSnapshot {
                address: DeviceAddr(b.address),
                size: b.size as usize,
                requested_size: if b.allocated != 0 { b.size as usize } else { 0 },
                state: if b.allocated != 0 {
                    BlockState::ActiveAllocated
                } else {
                    BlockState::Inactive
                },
            };
            match segments.last_mut() {
                Some(s) if b.segment_start == 0 => {
                    s.total_size += block.size;
                    s.blocks.push(block);
                }
                _ => segments.push(SegmentSnapshot {
                    address: block.address,
                    total_size: block.size,
                    stream: StreamId::DEFAULT,
                    pool: cuda_caching_allocator::PoolKind::Large,
                    is_expandable: false,
                    private_pool: pool.id(),
                    blocks: vec![block],
                }),
            }
        }
        let checkpoint = PoolCheckpoint {
            pool: pool.id(),
            segments,
        };
        // SAFETY: the pool's live allocations are the caller's from `cca_alloc`, unused and not
        // freed again afterwards (the caller's promise above), which is `restore_pool`'s
        // obligation; their streams were declared through `cca_record_stream`.
        match unsafe { alloc.restore_pool(&checkpoint) } {
            Ok(r) => {
                for p in r.freed {
                    changed(ctx, p.addr(), 0);
                }
                for p in r.allocated {
                    changed(ctx, p.addr(), 1);
                }
                0
            }
            Err(e) => {
                fail_alloc(
                    &format!(
                        "setCheckpointPoolState(device {device}, pool ({}, {}))",
                        pool.first, pool.second
                    ),
                    &e,
                );
                -1
            }
        }
    })
}

/// Sets one flag of `device`'s private pool `pool` through `set` (PyTorch's `what`): 0 on success,
/// -1 on failure (the error is recorded).
fn set_pool_flag(
    what: &str,
    device: c_int,
    pool: MempoolId,
    on: c_int,
    set: fn(&CudaAllocator, MemPoolId, bool) -> cuda_caching_allocator::Result<()>,
) -> c_int {
    let Some(alloc) = device_cache(what, device) else {
        return -1;
    };
    match set(alloc, pool.id(), on != 0) {
        Ok(()) => 0,
        Err(e) => {
            fail_alloc(
                &format!(
                    "{what}(device {device}, pool ({}, {}))",
                    pool.first, pool.second
                ),
                &e,
            );
            -1
        }
    }
}

/// PyTorch's `setUseOnOOM` (`torch.cuda.MemPool(use_on_oom=True)`): whether allocations of
/// `device`'s default pools about to fail with out of memory may take free blocks of private
/// pool `pool`. 0 on success, -1 on failure (the error is recorded).
#[unsafe(no_mangle)]
pub extern "C" fn cca_set_use_on_oom(device: c_int, pool: MempoolId, on: c_int) -> c_int {
    guarded("cca_set_use_on_oom", -1, || {
        set_pool_flag(
            "setUseOnOOM",
            device,
            pool,
            on,
            CudaAllocator::set_use_on_oom,
        )
    })
}

/// PyTorch's `setNoSplit` (`torch.cuda.MemPool(no_split=True)`): whether blocks of `device`'s
/// private pool `pool` are handed out whole, never split. 0 on success, -1 on failure (the error
/// is recorded).
#[unsafe(no_mangle)]
pub extern "C" fn cca_set_no_split(device: c_int, pool: MempoolId, on: c_int) -> c_int {
    guarded("cca_set_no_split", -1, || {
        set_pool_flag("setNoSplit", device, pool, on, CudaAllocator::set_no_split)
    })
}
