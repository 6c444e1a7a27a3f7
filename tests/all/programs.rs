//! The language of random allocator programs shared by the property tests (`props`,
//! `expandable`, `cross_stream`): the operations, their strategy, how one runs against a model of
//! the live allocations, the checks every program makes after each step, and the final drain
//! that must leave nothing behind. Each test adds its own configurations and checks.
//!
//! Every program also keeps SimDevice's model of queued uses (`SimDevice::use_range`): a
//! `record_stream` comes with a use of the allocation on that stream, the `uses` mix adds uses
//! on the allocation's own stream, uses ordered back into it by an event wait (cudarc's pattern)
//! and synchronizes, and every allocation the cache returns is checked as a hand-out
//! (`SimDevice::check_handout`). The device's violation log must stay empty (`Run::check`).
//! `run_threads` runs several programs at once on one allocator, threads freeing each other's
//! allocations.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::util::MIB;

/// Streams the programs use (allocations on the first three, work on all four).
pub const STREAMS: usize = 4;

/// One step of a program.
#[derive(Clone, Debug)]
pub enum Op {
    Alloc {
        size: usize,
        stream: u64,
    },
    Free {
        pick: usize,
    },
    EmptyCache,
    SetFraction {
        fraction: f64,
    },
    RecordStream {
        pick: usize,
        stream: u64,
    },
    SubmitWork {
        stream: u64,
    },
    CompleteWork {
        stream: u64,
    },
    FailNextCall {
        oom: bool,
    },
    FailEvent {
        call: u8,
    },
    /// The next synchronize (device or stream) fails.
    FailSync,
    /// A unit of work on the allocation's own stream that uses its bytes.
    Use {
        pick: usize,
    },
    /// A use on `stream`, then the allocation's stream waits on an event recorded after it (the
    /// integration orders the use back in, as cudarc does, instead of `record_stream`).
    UseJoined {
        pick: usize,
        stream: u64,
    },
    /// A device-wide synchronize (every use completes).
    Synchronize,
}

/// Which operations a program may contain beyond the common ones.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    /// The smallest request (0 exercises the null allocation).
    pub min_size: usize,
    /// Allocations on all four streams (not only the first three), and queued work on any
    /// stream without a `record_stream`.
    pub all_streams: bool,
    /// Injected failures of event calls and synchronizes.
    pub event_faults: bool,
    /// Uses on the allocation's stream, uses joined back by an event wait, and synchronizes.
    pub uses: bool,
}

fn size_strategy(min_size: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => min_size..=4096,
        3 => 4096usize..=(MIB + 4096),
        2 => MIB..=(12 * MIB),
        1 => (10 * MIB)..=(48 * MIB),
    ]
}

/// Programs of 1–159 steps drawn from `mix`.
pub fn random_program(mix: Mix) -> impl Strategy<Value = Vec<Op>> {
    let alloc_streams = if mix.all_streams { STREAMS as u64 } else { 3 };
    let streams = STREAMS as u64;
    let mut arms: Vec<(u32, BoxedStrategy<Op>)> = vec![
        (
            10,
            (size_strategy(mix.min_size), 0..alloc_streams)
                .prop_map(|(size, stream)| Op::Alloc { size, stream })
                .boxed(),
        ),
        (7, any::<usize>().prop_map(|pick| Op::Free { pick }).boxed()),
        (1, Just(Op::EmptyCache).boxed()),
        (
            1,
            prop_oneof![Just(1.0), 0.05f64..1.0]
                .prop_map(|fraction| Op::SetFraction { fraction })
                .boxed(),
        ),
        (
            2,
            (any::<usize>(), 0..streams)
                .prop_map(|(pick, stream)| Op::RecordStream { pick, stream })
                .boxed(),
        ),
        (
            1,
            (0..streams)
                .prop_map(|stream| Op::CompleteWork { stream })
                .boxed(),
        ),
        (
            1,
            any::<bool>()
                .prop_map(|oom| Op::FailNextCall { oom })
                .boxed(),
        ),
    ];
    if mix.all_streams {
        arms.push((
            2,
            (0..streams)
                .prop_map(|stream| Op::SubmitWork { stream })
                .boxed(),
        ));
    }
    if mix.event_faults {
        arms.push((1, (0u8..3).prop_map(|call| Op::FailEvent { call }).boxed()));
        arms.push((1, Just(Op::FailSync).boxed()));
    }
    if mix.uses {
        arms.push((4, any::<usize>().prop_map(|pick| Op::Use { pick }).boxed()));
        arms.push((
            2,
            (any::<usize>(), 0..streams)
                .prop_map(|(pick, stream)| Op::UseJoined { pick, stream })
                .boxed(),
        ));
        arms.push((1, Just(Op::Synchronize).boxed()));
    }
    proptest::collection::vec(proptest::strategy::Union::new_weighted(arms), 1..160)
}

/// A program's run: the allocator, the model of its live allocations, and the work submitted
/// per stream so far.
pub struct Run {
    pub a: CachingAllocator<SimDevice>,
    pub live: BTreeMap<u64, Allocation>,
    pub submitted: [u64; STREAMS],
}

impl Run {
    pub fn new(capacity_mib: usize, config: AllocatorConfig) -> Self {
        Run {
            a: CachingAllocator::new(SimDevice::with_capacity(capacity_mib * MIB), config).unwrap(),
            live: BTreeMap::new(),
            submitted: [0; STREAMS],
        }
    }

    /// Runs `op`: allocations join the model (out of memory and injected backend errors are the
    /// only errors allowed), frees leave it and a second free of the same pointer is refused.
    pub fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let (a, live) = (&self.a, &mut self.live);
        let sim = a.backend();
        match *op {
            Op::Alloc { size, stream } => match a.allocate(size, StreamId(stream)) {
                Ok(x) if x.ptr.is_null() => prop_assert_eq!(size, 0),
                Ok(x) => {
                    sim.check_handout(x.stream, x.ptr, x.block_size);
                    prop_assert!(
                        live.insert(x.ptr.0, x).is_none(),
                        "pointer handed out twice"
                    );
                }
                Err(e) => prop_assert!(
                    e.is_out_of_memory() || matches!(e, AllocError::Backend { .. }),
                    "unexpected error {}",
                    e
                ),
            },
            Op::Free { pick } => {
                if !live.is_empty() {
                    let key = *live.keys().nth(pick % live.len()).unwrap();
                    let x = live.remove(&key).unwrap();
                    // A free fails only when neither an event nor a synchronize could fence a
                    // recorded stream (injected faults); the allocation is gone all the same.
                    if let Err(e) = a.free(x.ptr) {
                        prop_assert!(
                            matches!(e, AllocError::Backend { .. }),
                            "unexpected error {}",
                            e
                        );
                    }
                    prop_assert!(a.free(x.ptr).is_err(), "double free accepted");
                }
            }
            Op::EmptyCache => {
                let _ = a.empty_cache();
            }
            Op::SetFraction { fraction } => a.set_memory_fraction(fraction).unwrap(),
            Op::RecordStream { pick, stream } => {
                if !live.is_empty() {
                    let x = *live.values().nth(pick % live.len()).unwrap();
                    sim.use_range(StreamId(stream), x.ptr, x.size);
                    self.submitted[stream as usize] += 1;
                    a.record_stream(x.ptr, StreamId(stream)).unwrap();
                }
            }
            Op::SubmitWork { stream } => {
                sim.submit_work(StreamId(stream));
                self.submitted[stream as usize] += 1;
            }
            Op::CompleteWork { stream } => sim.complete_work(StreamId(stream)),
            Op::FailNextCall { oom } => sim.fail_next_call(if oom {
                FaultKind::OutOfMemory
            } else {
                FaultKind::Error
            }),
            Op::FailEvent { call } => sim.fail_next_event_call(
                [
                    SimEventCall::Create,
                    SimEventCall::Record,
                    SimEventCall::StreamWait,
                ][call as usize],
            ),
            Op::Use { pick } => {
                if !live.is_empty() {
                    let x = *live.values().nth(pick % live.len()).unwrap();
                    sim.use_range(x.stream, x.ptr, x.size);
                    self.submitted[x.stream.0 as usize] += 1;
                }
            }
            Op::UseJoined { pick, stream } => {
                if !live.is_empty() {
                    let x = *live.values().nth(pick % live.len()).unwrap();
                    use_joined(sim, &x, StreamId(stream));
                    self.submitted[stream as usize] += 1;
                }
            }
            Op::Synchronize => {
                // May fail (an injected fault): then nothing completes.
                let _ = sim.synchronize();
            }
            Op::FailSync => sim.fail_next_synchronize(),
        }
        Ok(())
    }

    /// What holds after every step: the invariants; live allocations do not overlap and lie in
    /// device memory (fixed segments or mapped pages); the allocation count, allocated and
    /// reserved bytes agree with the model and the device.
    pub fn check(&self) -> Result<(), TestCaseError> {
        let (a, live) = (&self.a, &self.live);
        if let Err(v) = a.check_invariants() {
            return Err(TestCaseError::fail(format!("invariant: {v}")));
        }
        let sim = a.backend();
        let violations = sim.violations();
        prop_assert!(
            violations.is_empty(),
            "memory that queued work still used was given away: {}",
            violations[0]
        );
        let mut ranges: Vec<(u64, u64)> = sim
            .live_segments()
            .into_iter()
            .chain(sim.live_mappings())
            .map(|(p, s)| (p.0, p.0 + s as u64))
            .collect();
        ranges.sort_unstable();
        let mut prev_end = 0u64;
        for x in live.values() {
            prop_assert!(x.ptr.0 >= prev_end, "live allocations overlap at {}", x.ptr);
            prev_end = x.ptr.0 + x.block_size as u64;
            prop_assert!(
                covered(&ranges, x.ptr.0, prev_end),
                "{} lies outside device memory",
                x.ptr
            );
            prop_assert!(x.block_size >= x.size);
        }
        let st = a.memory_stats();
        prop_assert_eq!(
            st.allocation.get(StatType::All).current as usize,
            live.len()
        );
        prop_assert_eq!(
            st.memory_allocated() as usize,
            live.values().map(|x| x.block_size).sum::<usize>()
        );
        prop_assert!(st.memory_allocated() <= st.memory_reserved());
        prop_assert_eq!(st.memory_reserved() as usize, sim.counters().reserved_bytes);
        Ok(())
    }

    /// Runs `ops`, checking after every step ([`check`](Self::check)), then
    /// [`drain`](Self::drain)s.
    pub fn run_checked(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for op in ops {
            self.step(op)?;
            self.check()?;
        }
        self.drain()
    }

    /// Frees what is live and empties the cache: nothing may stay reserved, allocated or mapped.
    pub fn drain(&mut self) -> Result<(), TestCaseError> {
        let sim = self.a.backend();
        sim.clear_faults();
        for x in std::mem::take(&mut self.live).into_values() {
            self.a.free(x.ptr).unwrap();
        }
        self.a.empty_cache().unwrap();
        prop_assert_eq!(self.a.memory_stats().memory_reserved(), 0);
        let c = sim.counters();
        prop_assert_eq!(c.live_segments, 0);
        prop_assert_eq!(c.reserved_bytes, 0);
        prop_assert!(sim.live_mappings().is_empty());
        self.check()
    }
}

/// Whether `[start, end)` lies inside the union of the sorted `ranges`.
fn covered(ranges: &[(u64, u64)], start: u64, end: u64) -> bool {
    let mut at = start;
    for &(s, e) in ranges {
        if s <= at && at < e {
            at = e;
        }
        if at >= end {
            return true;
        }
    }
    at >= end
}

/// A use of `x` on `stream`, ordered back into `x`'s stream: an event recorded on `stream` after
/// the use, which `x.stream` waits on (cudarc's pattern). If an event call fails (injected), the
/// integration falls back to waiting for `stream` on the host.
pub fn use_joined(sim: &SimDevice, x: &Allocation, stream: StreamId) {
    sim.use_range(stream, x.ptr, x.size);
    let joined = sim.create_event().ok().is_some_and(|e| {
        let ok = sim
            .record_event(e, stream)
            .and_then(|()| sim.stream_wait_event(x.stream, e))
            .is_ok();
        // SAFETY: `e` was created above and not destroyed; the wait captured its record.
        let _ = unsafe { sim.destroy_event(e) };
        ok
    });
    if !joined {
        sim.complete_work(stream);
    }
}

/// Runs `op` on a thread sharing `live` with others (each op under the model's lock while it
/// touches a live allocation, so no other thread frees it meanwhile; a free leaves the model
/// before it reaches the allocator, an allocation joins it after). Checks each hand-out against
/// the live allocations and the device's model of queued uses. Device faults are not injected
/// here.
pub fn thread_step(
    a: &CachingAllocator<SimDevice>,
    live: &Mutex<BTreeMap<u64, Allocation>>,
    op: &Op,
) -> Result<(), String> {
    let sim = a.backend();
    match *op {
        Op::Alloc { size, stream } => match a.allocate(size, StreamId(stream)) {
            Ok(x) if x.ptr.is_null() => {}
            Ok(x) => {
                if !sim.check_handout(x.stream, x.ptr, x.block_size) {
                    return Err(format!("{} handed out over queued work", x.ptr));
                }
                let mut g = live.lock().unwrap();
                let end = x.ptr.0 + x.block_size as u64;
                if let Some((_, y)) = g.range(..end).next_back() {
                    if y.ptr.0 + y.block_size as u64 > x.ptr.0 {
                        return Err(format!("{} overlaps live {}", x.ptr, y.ptr));
                    }
                }
                g.insert(x.ptr.0, x);
            }
            Err(e) if e.is_out_of_memory() => {}
            Err(e) => return Err(format!("unexpected error {e}")),
        },
        Op::Free { pick } => {
            let taken = {
                let mut g = live.lock().unwrap();
                let key = (!g.is_empty()).then(|| *g.keys().nth(pick % g.len()).unwrap());
                key.and_then(|k| g.remove(&k))
            };
            if let Some(x) = taken {
                a.free(x.ptr).map_err(|e| format!("free {}: {e}", x.ptr))?;
            }
        }
        Op::EmptyCache => a.empty_cache().map_err(|e| e.to_string())?,
        Op::SetFraction { fraction } => a.set_memory_fraction(fraction).unwrap(),
        Op::RecordStream { pick, stream } => {
            let g = live.lock().unwrap();
            if !g.is_empty() {
                let x = *g.values().nth(pick % g.len()).unwrap();
                sim.use_range(StreamId(stream), x.ptr, x.size);
                a.record_stream(x.ptr, StreamId(stream))
                    .map_err(|e| format!("record_stream {}: {e}", x.ptr))?;
            }
        }
        Op::Use { pick } => {
            let g = live.lock().unwrap();
            if !g.is_empty() {
                let x = *g.values().nth(pick % g.len()).unwrap();
                sim.use_range(x.stream, x.ptr, x.size);
            }
        }
        Op::UseJoined { pick, stream } => {
            let g = live.lock().unwrap();
            if !g.is_empty() {
                let x = *g.values().nth(pick % g.len()).unwrap();
                use_joined(sim, &x, StreamId(stream));
            }
        }
        Op::SubmitWork { stream } => sim.submit_work(StreamId(stream)),
        Op::CompleteWork { stream } => sim.complete_work(StreamId(stream)),
        Op::Synchronize => sim.synchronize().unwrap(),
        Op::FailNextCall { .. } | Op::FailEvent { .. } | Op::FailSync => {}
    }
    Ok(())
}

/// Runs `programs` on as many threads at once over `a`, then frees what is left and empties the
/// cache; returns the first failure. The device's violation log must stay empty.
pub fn run_threads(a: &CachingAllocator<SimDevice>, programs: &[Vec<Op>]) -> Result<(), String> {
    let live = Mutex::new(BTreeMap::new());
    std::thread::scope(|sc| {
        let handles: Vec<_> = programs
            .iter()
            .map(|ops| {
                let live = &live;
                sc.spawn(move || {
                    for op in ops {
                        thread_step(a, live, op)?;
                    }
                    Ok::<(), String>(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a thread panicked".to_string())?)
    })?;
    for x in std::mem::take(&mut *live.lock().unwrap()).into_values() {
        a.free(x.ptr).map_err(|e| e.to_string())?;
    }
    a.empty_cache().map_err(|e| e.to_string())?;
    if let Err(v) = a.check_invariants() {
        return Err(format!("invariant: {v}"));
    }
    if a.memory_stats().memory_reserved() != 0 {
        return Err("reserved bytes left after the drain".into());
    }
    match a.backend().violations().first() {
        Some(v) => Err(format!(
            "memory that queued work still used was given away: {v}"
        )),
        None => Ok(()),
    }
}
