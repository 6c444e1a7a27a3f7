//! Fuzz target `ops`: arbitrary programs of allocator operations (alloc / free / double free /
//! bogus free / empty_cache / set_fraction / record_stream / flush / stats reads on any stream,
//! with injected device faults) on a small simulated device, under every configuration family,
//! each with and without the fast path (`cca_fast_path:True`).
//!
//! A program runs on one to three worker threads in an order the input scripts: the driver hands
//! each step to the worker the input names and waits for its answer, so one thread runs at a time
//! and every run of an input is the same. Blocks are freed by whichever thread the script picks
//! (cross-thread frees of front-cached blocks), and a step may end a worker (its thread exits
//! with blocks in its front cache) and start a fresh one in its place.
//!
//! After every step the invariant checker runs (the `invariant-checks` feature panics on a
//! violation) and a model of the live allocations must agree with the allocator: no pointer
//! handed out twice, no overlap, every block inside a device segment, stats identities; every
//! free of something that is not a live allocation (pointer 0 aside, a no-op) must fail and
//! change nothing: `u64::MAX` and the addresses near it, interior pointers, freed pointers, and
//! random addresses.
#![no_main]

use std::collections::BTreeMap;
use std::sync::mpsc;

use cuda_caching_allocator::{
    AllocError, Allocation, AllocatorConfig, CachingAllocator, DeviceAddr, FaultKind, SimDevice,
    StatType, StreamId,
};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const MIB: usize = 1 << 20;
const CONFIGS: [&str; 10] = [
    "",
    "max_split_size_mb:20",
    "roundup_power2_divisions:[1:2,4:4,>:8],max_non_split_rounding_mb:24",
    "garbage_collection_threshold:0.5",
    "expandable_segments:True",
    "large_segment_size_mb:12,roundup_power2_divisions:4",
    // The crate's default (AllocatorConfig::default()), and page reuse in multi-page handles.
    "expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device,cca_page_reuse_slack:0.01,cca_precise_cap:True",
    "expandable_segments:True,cca_large_page_size_mb:4,cca_max_handle_size_mb:12,cca_page_reuse:segment",
    // Cross-stream reuse, with fixed segments and with the default.
    "max_split_size_mb:24,cca_cross_stream_reuse:True",
    "cca_preset:default,cca_cross_stream_reuse:True",
];

/// Worker threads at most.
const THREADS: usize = 3;

/// One step, as a worker runs it.
#[derive(Clone, Copy, Debug)]
enum Op {
    Alloc(usize, StreamId),
    Free(DeviceAddr),
    RecordStream(DeviceAddr, StreamId),
    EmptyCache,
    Flush,
    Stats,
    /// The worker's thread ends (its front caches are left for the allocator to take back).
    Exit,
}

/// A worker's answer.
#[derive(Debug)]
enum Done {
    Alloc(std::result::Result<Allocation, AllocError>),
    Unit(std::result::Result<(), AllocError>),
}

fn size(u: &mut Unstructured) -> Result<usize> {
    Ok(match u.int_in_range(0..=9u8)? {
        0 => 0,
        1..=4 => u.int_in_range(1..=65536)?,
        5..=7 => u.int_in_range(65536..=(3 * MIB))?,
        8 => u.int_in_range((3 * MIB)..=(24 * MIB))?,
        _ => u.int_in_range((24 * MIB)..=(80 * MIB))?,
    })
}

/// Any stream: mostly a few (so blocks come back), sometimes anything, sentinels included.
fn stream(u: &mut Unstructured) -> Result<StreamId> {
    Ok(StreamId(match u.int_in_range(0..=15u8)? {
        0..=11 => u.int_in_range(0..=3u64)?,
        12 => u64::MAX,
        13 => u64::MAX - u64::from(u.int_in_range(1..=3u8)?),
        14 => 1 << 63,
        _ => u.arbitrary()?,
    }))
}

/// A pointer that is not a live allocation: sentinels, addresses near the top, interior
/// pointers of live blocks, freed pointers, random ones.
fn bogus(
    u: &mut Unstructured,
    live: &BTreeMap<u64, Allocation>,
    freed: &[DeviceAddr],
) -> Result<u64> {
    let p = match u.int_in_range(0..=7u8)? {
        0 => u64::MAX,
        1 => u64::MAX - u.int_in_range(1..=1u64 << 20)?,
        2 => u.int_in_range(1..=4096u64)?,
        3 if !live.is_empty() => {
            let x = live.values().nth(u.choose_index(live.len())?).map_or(1, |x| {
                x.ptr.0 + u.int_in_range(1..=x.block_size.max(2) as u64 - 1).unwrap_or(1)
            });
            x
        }
        4 if !freed.is_empty() => freed[u.choose_index(freed.len())?].0,
        5 => 1 << 63,
        _ => u.arbitrary()?,
    };
    Ok(p)
}

fn run_op(a: &CachingAllocator<SimDevice>, op: Op) -> Done {
    match op {
        Op::Alloc(size, s) => Done::Alloc(a.allocate(size, s)),
        Op::Free(p) => Done::Unit(a.free(p)),
        Op::RecordStream(p, s) => Done::Unit(a.record_stream(p, s)),
        Op::EmptyCache => Done::Unit(a.empty_cache()),
        Op::Flush => {
            a.flush_thread_caches();
            Done::Unit(Ok(()))
        }
        Op::Stats => {
            let st = a.memory_stats();
            assert!(st.memory_allocated() <= st.memory_reserved());
            Done::Unit(Ok(()))
        }
        Op::Exit => Done::Unit(Ok(())),
    }
}

fn check(a: &CachingAllocator<SimDevice>, live: &BTreeMap<u64, Allocation>) {
    a.check_invariants().expect("invariants");
    let segments = a.backend().live_segments();
    let mappings = a.backend().live_mappings();
    let mut prev_end = 0;
    for x in live.values() {
        assert!(x.ptr.0 >= prev_end, "overlapping allocations");
        prev_end = x.ptr.0 + x.block_size as u64;
        let inside = |ranges: &[(DeviceAddr, usize)]| {
            ranges.iter().any(|&(b, s)| x.ptr.0 >= b.0 && prev_end <= b.0 + s as u64)
        };
        assert!(inside(&segments) || !mappings.is_empty(), "allocation outside every segment");
    }
    let st = a.memory_stats();
    assert_eq!(st.allocation.get(StatType::All).current as usize, live.len());
    assert_eq!(st.memory_allocated() as usize, live.values().map(|x| x.block_size).sum::<usize>());
    assert!(st.memory_allocated() <= st.memory_reserved());
    assert_eq!(st.memory_reserved() as usize, a.backend().counters().reserved_bytes);
    for arr in [&st.allocation, &st.active, &st.allocated_bytes, &st.active_bytes, &st.requested_bytes] {
        for t in StatType::ALL {
            let s = arr.get(t);
            assert!(s.current >= 0 && s.current <= s.peak, "{s:?}");
            assert_eq!(s.allocated - s.freed, s.current);
        }
    }
}

/// Worker threads, each running the steps it is sent, one at a time.
struct Workers<'scope, 'env> {
    tx: Vec<Option<mpsc::Sender<Op>>>,
    rx: Vec<Option<mpsc::Receiver<Done>>>,
    threads: Vec<Option<std::thread::ScopedJoinHandle<'scope, ()>>>,
    scope: &'scope std::thread::Scope<'scope, 'env>,
    a: &'env CachingAllocator<SimDevice>,
}

impl Drop for Workers<'_, '_> {
    /// Closes every worker's channel and joins its thread, also when a program ends early (its
    /// input ran out): the scope alone waits for the closures, not for the threads' exits, and
    /// LeakSanitizer reads thread-locals not yet dropped as leaks.
    fn drop(&mut self) {
        for t in 0..self.threads.len() {
            self.tx[t] = None;
            self.rx[t] = None;
            if let Some(h) = self.threads[t].take() {
                let _ = h.join();
            }
        }
    }
}

impl<'scope, 'env> Workers<'scope, 'env> {
    fn spawn(&mut self, t: usize) {
        let (op_tx, op_rx) = mpsc::channel::<Op>();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let a = self.a;
        self.threads[t] = Some(self.scope.spawn(move || {
            for op in op_rx {
                let exit = matches!(op, Op::Exit);
                let _ = done_tx.send(run_op(a, op));
                if exit {
                    break;
                }
            }
        }));
        self.tx[t] = Some(op_tx);
        self.rx[t] = Some(done_rx);
    }

    /// Runs `op` on worker `t` and waits for it.
    fn step(&mut self, t: usize, op: Op) -> Done {
        if self.tx[t].is_none() {
            self.spawn(t);
        }
        let sent = self.tx[t].as_ref().is_some_and(|tx| tx.send(op).is_ok());
        assert!(sent, "worker {t} is gone");
        let done = self.rx[t].as_ref().and_then(|rx| rx.recv().ok()).expect("worker answered");
        if matches!(op, Op::Exit) {
            // Wait for the thread to end, its thread-locals dropped: a join waits for the
            // thread itself (its channel closes earlier, before the thread-local destructors
            // run, which left a race that LeakSanitizer reported as a leak).
            self.tx[t] = None;
            self.rx[t] = None;
            if let Some(h) = self.threads[t].take() {
                assert!(h.join().is_ok(), "worker {t} panicked");
            }
        }
        done
    }
}

fn run(data: &[u8]) -> Result<()> {
    let mut u = Unstructured::new(data);
    let mut text = CONFIGS[u.int_in_range(0..=CONFIGS.len() - 1)?].to_string();
    if u.arbitrary()? {
        if !text.is_empty() {
            text.push(',');
        }
        text.push_str("cca_fast_path:True");
    }
    let config = AllocatorConfig::parse(&text).expect("config");
    let capacity = u.int_in_range(32..=256usize)? * MIB;
    let threads = u.int_in_range(1..=THREADS)?;
    let a = CachingAllocator::new(SimDevice::with_capacity(capacity), config).expect("allocator");
    let mut live: BTreeMap<u64, Allocation> = BTreeMap::new();
    let mut freed: Vec<DeviceAddr> = Vec::new();
    let steps = u.int_in_range(1..=200u32)?;
    std::thread::scope(|scope| -> Result<()> {
        let mut w = Workers {
            tx: vec![None, None, None],
            rx: vec![None, None, None],
            threads: vec![None, None, None],
            scope,
            a: &a,
        };
        for _ in 0..steps {
            let t = u.int_in_range(0..=threads - 1)?;
            match u.int_in_range(0..=14u8)? {
                0..=4 => {
                    let s = size(&mut u)?;
                    let st = stream(&mut u)?;
                    match w.step(t, Op::Alloc(s, st)) {
                        Done::Alloc(Ok(x)) if x.ptr.is_null() => assert_eq!(s, 0),
                        Done::Alloc(Ok(x)) => {
                            assert!(live.insert(x.ptr.0, x).is_none(), "pointer handed out twice");
                            freed.retain(|p| *p != x.ptr);
                        }
                        Done::Alloc(Err(e)) => {
                            assert!(e.is_out_of_memory() || e.to_string().contains("device call"), "{e}")
                        }
                        other => panic!("{other:?}"),
                    }
                }
                5..=7 if !live.is_empty() => {
                    let k = *live.keys().nth(u.choose_index(live.len())?).expect("key");
                    let x = live.remove(&k).expect("live");
                    match w.step(t, Op::Free(x.ptr)) {
                        Done::Unit(Ok(())) => {}
                        other => panic!("free of a live allocation: {other:?}"),
                    }
                    freed.push(x.ptr);
                }
                8 => {
                    let p = bogus(&mut u, &live, &freed)?;
                    if !live.contains_key(&p) {
                        match w.step(t, Op::Free(DeviceAddr(p))) {
                            Done::Unit(Err(_)) => {}
                            // The null pointer is a no-op, as in PyTorch.
                            Done::Unit(Ok(())) if p == 0 => {}
                            other => panic!("free({p:#x}) of no live allocation: {other:?}"),
                        }
                    }
                }
                9 => {
                    let _ = w.step(t, if u.arbitrary()? { Op::EmptyCache } else { Op::Flush });
                }
                10 => {
                    let f = if u.arbitrary()? { 1.0 } else { f64::from(u.int_in_range(5..=100u8)?) / 100.0 };
                    a.set_memory_fraction(f).expect("fraction");
                }
                11 => {
                    let _ = w.step(t, if u.arbitrary()? { Op::Stats } else { Op::Exit });
                }
                _ => match u.int_in_range(0..=3u8)? {
                    0 => a.backend().fail_next_call(if u.arbitrary()? { FaultKind::OutOfMemory } else { FaultKind::Error }),
                    1 if !live.is_empty() => {
                        let x = *live.values().nth(u.choose_index(live.len())?).expect("live");
                        let s = stream(&mut u)?;
                        a.backend().submit_work(s);
                        match w.step(t, Op::RecordStream(x.ptr, s)) {
                            Done::Unit(Ok(())) => {}
                            other => panic!("record_stream: {other:?}"),
                        }
                    }
                    _ => a.backend().complete_work(stream(&mut u)?),
                },
            }
            check(&a, &live);
        }
        a.backend().clear_faults();
        // Every worker frees a share of what is left, then exits.
        let keys: Vec<u64> = live.keys().copied().collect();
        for (n, k) in keys.into_iter().enumerate() {
            let x = live.remove(&k).expect("live");
            match w.step(n % threads, Op::Free(x.ptr)) {
                Done::Unit(Ok(())) => {}
                other => panic!("final free: {other:?}"),
            }
        }
        for t in 0..threads {
            if w.tx[t].is_some() {
                let _ = w.step(t, Op::Exit);
            }
        }
        Ok(())
    })?;
    a.empty_cache().expect("final empty_cache");
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    check(&a, &live);
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
