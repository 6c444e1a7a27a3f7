//! The slab engine of the pinned host cache (`PinnedCache` on `SimHost`) under random programs
//! that mix declared streams, caller fences (complete, pending, failing queries, failing waits),
//! both pending policies, the cap, the slack and fit rules, host and event faults and
//! `empty_cache`; the invariant checker runs after every operation, and every program ends by
//! finishing all work and emptying the cache, which must then hold nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cuda_caching_allocator::host::SimHostFault;
use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::{Flag, FlagFence};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// A stream that never runs work: hand-outs are checked against it.
const NEW_OWNER: StreamId = StreamId(0xfeed);

fn cache_with(config: PinnedConfig) -> (Arc<SimDevice>, PinnedCache<SimHost>) {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(dev.clone(), SimHostConfig::default());
    (dev, PinnedCache::new(host, config).unwrap())
}

/// How a block is freed with a caller's fence.
#[derive(Clone, Copy, Debug)]
enum FenceKind {
    /// Complete at the free.
    Done,
    /// Pending; completes by `Op::Finish` or by a wait.
    Pending,
    /// Pending, and its queries fail until the end of the program.
    FailQuery,
    /// Pending, and a wait for it fails.
    FailWait,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
    FreeAfter(usize, FenceKind),
    Use(usize, u64),
    Complete(u64),
    Finish(usize),
    EmptyCache,
    Fault(u8),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let kind = prop_oneof![
        Just(FenceKind::Done),
        Just(FenceKind::Pending),
        Just(FenceKind::FailQuery),
        Just(FenceKind::FailWait),
    ];
    prop_oneof![
        6 => prop_oneof![1usize..4096, 4096usize..(256 * KIB), (256 * KIB)..(3 * MIB)].prop_map(Op::Alloc),
        3 => any::<usize>().prop_map(Op::Free),
        3 => (any::<usize>(), kind).prop_map(|(i, k)| Op::FreeAfter(i, k)),
        3 => (any::<usize>(), 1u64..4).prop_map(|(i, s)| Op::Use(i, s)),
        2 => (1u64..4).prop_map(Op::Complete),
        2 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::EmptyCache),
        1 => (0u8..6).prop_map(Op::Fault),
    ]
}

/// A block freed after a caller's fence, with the fence's flag.
struct Fenced {
    block: PinnedBlock,
    flag: Arc<Flag>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn fenced_programs_never_hand_out_pending_memory_and_lose_nothing(
        ops in proptest::collection::vec(op_strategy(), 1..150),
        cap in prop_oneof![Just(None), Just(Some(6 * MIB))],
        slack in prop_oneof![Just(None), Just(Some(0.05))],
        waste in prop_oneof![Just(None), Just(Some(0.25))],
        pending in prop_oneof![Just(PendingPolicy::Wait), Just(PendingPolicy::Grow)],
        lag in 0u32..3,
    ) {
        let (dev, c) = cache_with(
            PinnedConfig::default()
                .with_slab_size(MIB)
                .with_max_pinned(cap)
                .with_max_slack(slack)
                .with_max_fit_waste(waste)
                .with_pending(pending),
        );
        dev.set_event_query_lag(lag);
        let mut live: Vec<PinnedBlock> = Vec::new();
        let mut fenced: Vec<Fenced> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(size) => match c.alloc(size) {
                    Ok(b) => {
                        let (lo, hi) = (b.ptr.addr(), b.ptr.addr() + b.size);
                        for o in &live {
                            prop_assert!(hi <= o.ptr.addr() || o.ptr.addr() + o.size <= lo,
                                "{b:?} overlaps live {o:?}");
                        }
                        for f in &fenced {
                            let o = f.block;
                            let overlaps = !(hi <= o.ptr.addr() || o.ptr.addr() + o.size <= lo);
                            prop_assert!(!overlaps || f.flag.done.load(Ordering::SeqCst),
                                "{b:?} overlaps {o:?}, whose fence is pending");
                        }
                        prop_assert!(dev.check_handout(NEW_OWNER, DeviceAddr(lo as u64), b.size),
                            "{b:?} handed out while in flight: {:?}", dev.violations());
                        live.push(b);
                    }
                    Err(PinnedError::CapExceeded { .. } | PinnedError::Backend(_)) => {}
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                Op::Free(i) if !live.is_empty() => {
                    let b = live.swap_remove(i % live.len());
                    match c.free(b.ptr) {
                        Ok(()) | Err(PinnedError::Fence { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                    // A second free of the same pointer is refused and changes nothing.
                    let before = c.stats();
                    let again = c.free(b.ptr);
                    prop_assert!(
                        matches!(again, Err(PinnedError::UnknownBlock { .. })),
                        "double free: {again:?}"
                    );
                    prop_assert_eq!(before, c.stats());
                }
                Op::FreeAfter(i, kind) if !live.is_empty() => {
                    let b = live.swap_remove(i % live.len());
                    let flag = Arc::new(Flag::default());
                    match kind {
                        FenceKind::Done => flag.done.store(true, Ordering::SeqCst),
                        FenceKind::Pending => {}
                        FenceKind::FailQuery => flag.fail_query.store(true, Ordering::SeqCst),
                        FenceKind::FailWait => flag.fail_wait.store(true, Ordering::SeqCst),
                    }
                    match c.free_after(b.ptr, Box::new(FlagFence(flag.clone()))) {
                        Ok(()) | Err(PinnedError::Fence { .. }) => {}
                        Err(e) => prop_assert!(false, "unexpected {e}"),
                    }
                    fenced.push(Fenced { block: b, flag });
                }
                Op::Use(i, s) if !live.is_empty() => {
                    let b = live[i % live.len()];
                    dev.use_range(StreamId(s), DeviceAddr(b.ptr.addr() as u64), b.size);
                    c.record_stream(b.ptr, StreamId(s)).unwrap();
                }
                Op::Complete(s) => dev.complete_work(StreamId(s)),
                Op::Finish(i) if !fenced.is_empty() => {
                    let f = &fenced[i % fenced.len()];
                    f.flag.done.store(true, Ordering::SeqCst);
                }
                Op::EmptyCache => {
                    let _ = c.empty_cache();
                }
                Op::Fault(k) => match k {
                    0 => c.host().fail_next(SimHostFault::PinOutOfMemory),
                    1 => c.host().fail_next(SimHostFault::PinError),
                    2 => c.host().fail_next(SimHostFault::UnpinError),
                    3 => dev.fail_next_event_call(SimEventCall::Record),
                    4 => dev.fail_next_synchronize(),
                    _ => {
                        dev.fail_next_event_call(SimEventCall::Create);
                        dev.fail_next_synchronize();
                    }
                },
                _ => {}
            }
            c.check_invariants().map_err(|v| TestCaseError::fail(v.to_string()))?;
            prop_assert!(dev.violations().is_empty(), "{:?}", dev.violations());
            let s = c.stats();
            let live_bytes: usize = live.iter().map(|b| b.size).sum();
            prop_assert_eq!(s.requested_bytes.current as usize, live_bytes);
            prop_assert!(s.reserved_bytes.current >= s.allocated_bytes.current + s.pending_bytes.current);
            prop_assert!(s.reserved_bytes.peak >= s.reserved_bytes.current);
            prop_assert!(s.allocated_bytes.peak >= s.allocated_bytes.current);
        }
        // Everything finishes: nothing may stay pinned.
        c.host().clear_faults();
        dev.clear_faults();
        for f in &fenced {
            f.flag.fail_query.store(false, Ordering::SeqCst);
            f.flag.done.store(true, Ordering::SeqCst);
        }
        for s in 1..4 {
            dev.complete_work(StreamId(s));
        }
        for b in live.drain(..) {
            c.free(b.ptr).unwrap();
        }
        // Events recorded under a query lag answer "pending" to their first queries.
        for _ in 0..=lag {
            c.empty_cache().unwrap();
        }
        c.check_invariants().map_err(|v| TestCaseError::fail(v.to_string()))?;
        let s = c.stats();
        prop_assert_eq!(c.waiting_blocks(), 0);
        prop_assert_eq!(s.reserved_bytes.current, 0, "{}", c.summary());
        prop_assert_eq!(s.slabs.current, 0);
        prop_assert_eq!(s.pending_bytes.current, 0);
        prop_assert_eq!(c.host().counters().pinned_bytes, 0);
        prop_assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    }
}

/// Each request below `i64::MAX` bytes passes the statistics' check, but two of them pinned
/// together do not fit in the `i64` byte statistics: the reserved bytes saturated, and unpinning
/// both then drove them below zero (a `debug_assert` panic inside the library; wrong figures in
/// release builds).
#[test]
fn pinned_bytes_beyond_what_the_statistics_count_are_refused() {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = SimHost::new(
        dev,
        SimHostConfig {
            capacity: usize::MAX,
            ..SimHostConfig::default()
        },
    );
    let c = PinnedCache::new(host, PinnedConfig::default()).unwrap();
    let big = 1usize << 62;
    let a = c.alloc(big).unwrap();
    let r = c.alloc(big);
    assert!(
        matches!(&r, Err(PinnedError::InvalidRequest(m)) if m.contains("statistics")),
        "{:?}",
        r.map(|b| b.ptr)
    );
    assert_eq!(c.host().counters().pins, 1, "the second slab is not pinned");
    c.check_invariants().unwrap();
    c.free(a.ptr).unwrap();
    assert_eq!(c.empty_cache().unwrap(), big);
    let s = c.stats();
    assert_eq!((s.reserved_bytes.current, s.slabs.current), (0, 0));
    c.check_invariants().unwrap();
    // A slab size past `i64::MAX` would count as negative bytes from the first pin.
    let host = SimHost::new(
        Arc::new(SimDevice::with_capacity(1 << 30)),
        SimHostConfig {
            capacity: usize::MAX,
            ..SimHostConfig::default()
        },
    );
    let err = PinnedCache::new(host, PinnedConfig::default().with_slab_size(1 << 63)).unwrap_err();
    assert!(
        matches!(&err, PinnedError::InvalidConfig(m) if m.contains("slab_size") && m.contains("statistics")),
        "{err}"
    );
    // `i64::MAX` itself is countable, but the slab size in force is rounded up to the
    // alignment: 2^63, which is not.
    let host = SimHost::new(
        Arc::new(SimDevice::with_capacity(1 << 30)),
        SimHostConfig {
            capacity: usize::MAX,
            ..SimHostConfig::default()
        },
    );
    let err = PinnedCache::new(
        host,
        PinnedConfig::default().with_slab_size(i64::MAX as usize),
    )
    .unwrap_err();
    assert!(
        matches!(&err, PinnedError::InvalidConfig(m) if m.contains("slab_size") && m.contains("statistics")),
        "{err}"
    );
}

/// A caller's fence whose work never completes (queries say "not yet") and whose `wait` panics.
#[derive(Debug)]
struct PanickingWait;

impl host::HostFence for PanickingWait {
    fn query(&mut self) -> Result<bool, BackendError> {
        Ok(false)
    }
    fn wait(&mut self) -> Result<(), BackendError> {
        panic!("the fence's wait panicked");
    }
}

/// A `SimHost` the test still reaches after the cache that owns it is dropped.
#[derive(Debug)]
struct SharedHost(Arc<SimHost>);

// SAFETY: every call is forwarded to the shared `SimHost`, which keeps both promises.
unsafe impl host::HostBackend for SharedHost {
    type Device = Arc<SimDevice>;
    fn device(&self) -> &Arc<SimDevice> {
        self.0.device()
    }
    fn alignment(&self) -> usize {
        self.0.alignment()
    }
    fn pin(&self, size: usize) -> Result<host::Pinned, BackendError> {
        self.0.pin(size)
    }
    unsafe fn unpin(&self, ptr: HostPtr, size: usize) -> Result<u64, BackendError> {
        // SAFETY: the caller's obligations, forwarded unchanged.
        unsafe { self.0.unpin(ptr, size) }
    }
}

/// An allocation that waits for a freed block ([`PendingPolicy::Wait`]) takes the block's fences
/// out of the cache and marks the block claimed. When the fence's `wait` panicked, the block
/// stayed claimed with no fence left; the cache's drop then found nothing to wait for, gave the
/// block back to its slab and unpinned the slab, though the fence had never said the work using
/// the block was done (with `CudaHost`, a copy still queued on the memory would run on unpinned,
/// unmapped host memory). A block whose claim was never settled now keeps its slab pinned.
#[test]
fn a_panicking_fence_wait_keeps_the_blocks_slab_pinned_at_the_drop() {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let host = Arc::new(SimHost::new(dev, SimHostConfig::default()));
    let config = PinnedConfig::default()
        .with_slab_size(MIB)
        .with_pending(PendingPolicy::Wait);
    let c = PinnedCache::new(SharedHost(host.clone()), config).unwrap();
    let a = c.alloc(4 * KIB).unwrap();
    c.free_after(a.ptr, Box::new(PanickingWait)).unwrap();
    assert_eq!(c.waiting_blocks(), 1);
    // Only the waiting block (merged with the rest of its slab) can serve a whole slab: the
    // allocation claims it and waits for its fence, which panics.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.alloc(MIB)));
    assert!(r.is_err(), "the fence's panic reaches the caller");
    drop(c);
    assert_eq!(
        host.counters().unpins,
        0,
        "the slab of a block whose fence never completed was unpinned"
    );
    assert_eq!(host.live_ranges().len(), 1);
}
