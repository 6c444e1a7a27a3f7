//! Graph capture and private pools on programs an adversarial review wrote, each failing on the
//! code before its fix: a doctored checkpoint refused before anything changes (a segment listed
//! twice, a block size past the address space), and a failed capture query failing the
//! allocation instead of serving captured work from the default pools. (The review's third
//! finding, a graph's use given back while another capture routes into the shared pool, is
//! tested in
//! `graph_capture::a_graphs_use_goes_while_another_capture_routes_into_the_pool`.)

use cuda_caching_allocator::*;

use crate::graph_capture::sim_alloc;
use crate::util::MIB;

const S0: StreamId = StreamId(0);

// ---- 2. restore_pool changes the pool, then fails ---------------------------------------------

/// `restore_pool` documents "with nothing changed" for every `InvalidPool` error, and Note [Pool
/// checkpoints] says "Everything is checked before anything changes". A checkpoint listing one
/// segment twice passes the checks, then step 1 frees every live allocation of the pool and step
/// 2 fails on the second copy: the caller gets an error (so it keeps using its tensors), but
/// their blocks were freed behind its back and the next routed allocation gets the same bytes.
#[test]
fn a_failed_restore_has_freed_live_allocations() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let pool = MemPoolId::new_graph();
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let _x = a.allocate(MIB, S0).unwrap(); // a 2 MiB small segment: x, then 1 MiB free
    a.end_allocate_to_pool(pool).unwrap();
    let cp = a.pool_checkpoint(pool).unwrap();
    // Later work of the pool: y is live in the same segment.
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let y = a.allocate(512 << 10, S0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();

    let mut doubled = cp.clone();
    doubled.segments.push(cp.segments[0].clone());
    let before = a.snapshot();
    let err = a.restore_pool(&doubled).unwrap_err();
    assert!(matches!(err, AllocError::InvalidPool { .. }), "{err}");
    let after = a.snapshot();
    // y is still live for its owner, who got an error: it must still be allocated.
    let z = {
        a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
        let z = a.allocate(512 << 10, S0).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        z
    };
    assert!(
        after == before && z.ptr != y.ptr,
        "restore_pool failed with `{err}` but changed the pool: y at {} was freed and is now \
         handed out again as z at {}",
        y.ptr,
        z.ptr
    );
}

// ---- 3. restore_pool panics on a checkpoint block size that overflows --------------------------

/// A checkpoint is a plain public struct (the refusal test builds doctored ones); a block size
/// near `usize::MAX` makes the validation's `at += size as u64` overflow: a panic in library
/// code (debug builds) instead of `InvalidPool`.
#[test]
fn a_huge_checkpoint_block_size_is_refused_not_a_panic() {
    let a = sim_alloc(1 << 30, AllocatorConfig::pytorch());
    let pool = MemPoolId::new_graph();
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
    let x = a.allocate(MIB, S0).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    let mut cp = a.pool_checkpoint(pool).unwrap();
    cp.segments[0].blocks.truncate(1);
    cp.segments[0].blocks[0].size = usize::MAX;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.restore_pool(&cp)));
    match r {
        Ok(Err(AllocError::InvalidPool { .. })) => {}
        Ok(other) => panic!("unexpected: {other:?}"),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("restore_pool panicked on a doctored checkpoint: {msg}");
        }
    }
    a.free(x.ptr).unwrap();
}

// ---- 4. a failed capture-status query serves a captured allocation from the default pool -----

/// A SimDevice whose `stream_capture_id` can be made to fail (a driver error).
struct FlakyCaptureQuery {
    sim: SimDevice,
    fail: std::sync::atomic::AtomicBool,
}

// SAFETY: every memory call is forwarded unchanged to the SimDevice, which keeps the promises.
unsafe impl DeviceBackend for FlakyCaptureQuery {
    fn device_index(&self) -> usize {
        self.sim.device_index()
    }
    fn alignment(&self) -> usize {
        self.sim.alignment()
    }
    fn mem_info(&self) -> std::result::Result<MemInfo, BackendError> {
        self.sim.mem_info()
    }
    fn allocate(
        &self,
        size: usize,
        stream: StreamId,
    ) -> std::result::Result<DeviceAddr, BackendError> {
        self.sim.allocate(size, stream)
    }
    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: StreamId,
    ) -> std::result::Result<(), BackendError> {
        // SAFETY: forwarded unchanged.
        unsafe { self.sim.free(ptr, size, stream) }
    }
    fn synchronize(&self) -> std::result::Result<(), BackendError> {
        self.sim.synchronize()
    }
    fn validate_stream(&self, stream: StreamId) -> std::result::Result<(), BackendError> {
        self.sim.validate_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamId) -> std::result::Result<(), BackendError> {
        self.sim.synchronize_stream(stream)
    }
    fn stream_capture_id(
        &self,
        stream: StreamId,
    ) -> std::result::Result<Option<u64>, BackendError> {
        if self.fail.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(BackendError::InvalidArgument {
                operation: "stream_capture_id",
                reason: "driver error (injected)".into(),
            });
        }
        self.sim.stream_capture_id(stream)
    }
    fn create_event(&self) -> std::result::Result<EventHandle, BackendError> {
        self.sim.create_event()
    }
    fn record_event(
        &self,
        event: EventHandle,
        stream: StreamId,
    ) -> std::result::Result<(), BackendError> {
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> std::result::Result<bool, BackendError> {
        self.sim.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> std::result::Result<(), BackendError> {
        self.sim.synchronize_event(event)
    }
    fn stream_wait_event(
        &self,
        stream: StreamId,
        event: EventHandle,
    ) -> std::result::Result<(), BackendError> {
        self.sim.stream_wait_event(stream, event)
    }
    unsafe fn destroy_event(&self, event: EventHandle) -> std::result::Result<(), BackendError> {
        // SAFETY: forwarded unchanged.
        unsafe { self.sim.destroy_event(event) }
    }
}

/// PyTorch's capture filter checks `cudaStreamGetCaptureInfo` with `AT_CUDA_CHECK`: a failed
/// query fails the allocation. Here `route` treats the capturing stream as "not capturing", so
/// the captured kernel gets a default-pool block; freed inside the capture it goes straight back
/// to the default pool and the next eager allocation on the stream gets the bytes every replay of
/// the graph writes.
#[test]
fn a_failed_capture_query_hands_captured_work_a_default_pool_block() {
    let dev = FlakyCaptureQuery {
        sim: SimDevice::with_capacity(1 << 30),
        fail: std::sync::atomic::AtomicBool::new(false),
    };
    let a = CachingAllocator::new(dev, AllocatorConfig::pytorch()).unwrap();
    let pool = MemPoolId::new_graph();
    let id = a
        .backend()
        .sim
        .begin_capture(S0, SimCaptureMode::Global)
        .unwrap();
    a.begin_allocate_to_capture(pool, id).unwrap();
    a.backend()
        .fail
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let r = a.allocate(MIB, S0); // S0 is capturing into `pool`
    a.backend()
        .fail
        .store(false, std::sync::atomic::Ordering::Relaxed);
    match &r {
        Err(AllocError::Backend { operation, .. }) => {
            assert_eq!(*operation, "stream_capture_id");
            a.backend().sim.end_capture(S0).unwrap();
            a.end_allocate_to_pool(pool).unwrap();
            return;
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => {}
    }
    let leaked = match &r {
        Ok(x) => {
            let in_pool = a.pool_of(x.ptr);
            a.free(x.ptr).unwrap(); // a temporary of the captured graph
            a.backend().sim.end_capture(S0).unwrap();
            a.end_allocate_to_pool(pool).unwrap();
            let eager = a.allocate(MIB, S0).unwrap();
            Some((x.ptr, in_pool, eager.ptr))
        }
        Err(_) => None,
    };
    if let Some((graph_ptr, in_pool, eager_ptr)) = leaked {
        panic!(
            "the allocation of a capturing stream whose capture query failed was served from \
             {in_pool:?} (None = the default pool) at {graph_ptr}; after the capture an eager \
             allocation got {eager_ptr}{}",
            if graph_ptr == eager_ptr {
                " — the very bytes the graph replays"
            } else {
                ""
            }
        );
    }
}
