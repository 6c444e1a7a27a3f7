//! Random programs mixing graph captures with the default configuration's extras (expandable
//! segments, page reuse and lending, the fast path, cross-stream reuse, borrowing) on a small
//! device, with *replays*: every live graph may be launched again at any time, writing each
//! address its capture allocated on that allocation's stream. `SimDevice` checks every hand-out
//! against the queued uses (replays, and eager uses declared with each allocation and
//! `record_stream`), every unmap and free of used memory, and that no illegal call happens during
//! a global-mode capture; the test checks that an allocation outside a graph's pool never
//! overlaps memory a live graph replays.

use cuda_caching_allocator::*;
use proptest::prelude::*;

use crate::graph_capture::{capture, end, sim_alloc};
use crate::util::MIB;

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: usize,
        stream: u64,
        used: bool,
    },
    Free {
        pick: usize,
    },
    Begin {
        stream: u64,
        share: bool,
    },
    End,
    Release {
        pick: usize,
    },
    EmptyCache,
    RecordStream {
        pick: usize,
        stream: u64,
    },
    Replay {
        pick: usize,
    },
    Complete {
        stream: u64,
    },
    Restore {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        3 => 1usize..=4096,
        3 => 4096usize..=(MIB + 4096),
        3 => MIB..=(12 * MIB),
        1 => (10 * MIB)..=(30 * MIB),
    ];
    prop_oneof![
        10 => (size, 0..3u64, any::<bool>())
            .prop_map(|(size, stream, used)| Op::Alloc { size, stream, used }),
        8 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (0..3u64, any::<bool>()).prop_map(|(stream, share)| Op::Begin { stream, share }),
        2 => Just(Op::End),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => Just(Op::EmptyCache),
        2 => (any::<usize>(), 0..3u64).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        3 => any::<usize>().prop_map(|pick| Op::Replay { pick }),
        2 => (0..3u64).prop_map(|stream| Op::Complete { stream }),
        1 => any::<usize>().prop_map(|pick| Op::Restore { pick }),
    ]
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

/// A captured graph: its pool and every (address, length, stream) its capture allocated.
struct Graph {
    pool: MemPoolId,
    ranges: Vec<(u64, usize, StreamId)>,
}

fn run(config: AllocatorConfig, ops: &[Op]) -> Result<(), TestCaseError> {
    let a = sim_alloc(96 * MIB, config);
    let sim = a.backend();
    let mut live: Vec<(Allocation, MemPoolId)> = Vec::new();
    let mut graphs: Vec<Graph> = Vec::new();
    let mut open: Option<(StreamId, Graph)> = None;
    for op in ops {
        match *op {
            Op::Alloc { size, stream, used } => {
                let stream = StreamId(stream);
                let pool = match &open {
                    Some((s, g)) if *s == stream => g.pool,
                    _ => MemPoolId::DEFAULT,
                };
                match a.allocate(size, stream) {
                    Ok(x) => {
                        let r = (x.ptr.0, x.size);
                        prop_assert!(
                            sim.check_handout(stream, x.ptr, x.size),
                            "{op:?}: {:?}",
                            sim.violations()
                        );
                        prop_assert_eq!(a.pool_of(x.ptr).unwrap_or_default(), pool, "{:?}", op);
                        for g in graphs.iter().chain(open.as_ref().map(|(_, g)| g)) {
                            if g.pool != pool {
                                for &(p, n, _) in &g.ranges {
                                    prop_assert!(
                                        !overlaps(r, (p, n)),
                                        "{x:?} (pool {pool}) overlaps a graph of pool {}",
                                        g.pool
                                    );
                                }
                            }
                        }
                        for (y, _) in &live {
                            prop_assert!(!overlaps(r, (y.ptr.0, y.size)), "{x:?} overlaps {y:?}");
                        }
                        if let Some((s, g)) = &mut open {
                            if *s == stream {
                                g.ranges.push((x.ptr.0, x.size, stream));
                            }
                        }
                        if used {
                            sim.use_range(stream, x.ptr, x.size);
                        }
                        live.push((x, pool));
                    }
                    Err(e) => prop_assert!(e.is_out_of_memory(), "{e}"),
                }
            }
            Op::Free { pick } => {
                if !live.is_empty() {
                    let (x, _) = live.swap_remove(pick % live.len());
                    a.free(x.ptr).unwrap();
                }
            }
            Op::Begin { stream, share } => {
                if open.is_none() {
                    let pool = match graphs.last() {
                        Some(g) if share => g.pool,
                        _ => MemPoolId::new_graph(),
                    };
                    capture(&a, StreamId(stream), pool);
                    open = Some((
                        StreamId(stream),
                        Graph {
                            pool,
                            ranges: Vec::new(),
                        },
                    ));
                }
            }
            Op::End => {
                if let Some((s, g)) = open.take() {
                    end(&a, s, g.pool);
                    graphs.push(g);
                }
            }
            Op::Release { pick } => {
                if !graphs.is_empty() {
                    let g = graphs.remove(pick % graphs.len());
                    // A routing holds a use of its own: the graph's may always go.
                    a.release_pool(g.pool).unwrap();
                }
            }
            Op::EmptyCache => {
                let r = a.empty_cache();
                prop_assert_eq!(r.is_err(), open.is_some(), "{:?}", r);
            }
            Op::RecordStream { pick, stream } => {
                if !live.is_empty() {
                    let (x, _) = live[pick % live.len()];
                    a.record_stream(x.ptr, StreamId(stream)).unwrap();
                    sim.use_range(StreamId(stream), x.ptr, x.size);
                }
            }
            Op::Replay { pick } => {
                if !graphs.is_empty() {
                    let g = &graphs[pick % graphs.len()];
                    for &(p, n, s) in &g.ranges {
                        sim.use_range(s, DeviceAddr(p), n);
                    }
                }
            }
            Op::Complete { stream } => sim.complete_work(StreamId(stream)),
            Op::Restore { pick } => {
                // A checkpoint restored at once: the pool's live allocations come back at the
                // same addresses (as block-sized allocations), or nothing changes.
                if !graphs.is_empty() {
                    let pool = graphs[pick % graphs.len()].pool;
                    let cp = a.pool_checkpoint(pool).unwrap();
                    let before = a.memory_stats();
                    match a.restore_pool(&cp) {
                        Ok(r) => {
                            let mut was: Vec<u64> = live
                                .iter()
                                .filter(|(_, p)| *p == pool)
                                .map(|(x, _)| x.ptr.0)
                                .collect();
                            was.sort_unstable();
                            let freed: Vec<u64> = r.freed.iter().map(|p| p.0).collect();
                            let made: Vec<u64> = r.allocated.iter().map(|p| p.0).collect();
                            prop_assert_eq!(&freed, &was);
                            prop_assert_eq!(&made, &was);
                            let after = a.memory_stats();
                            prop_assert_eq!(after.memory_reserved(), before.memory_reserved());
                            prop_assert_eq!(after.memory_allocated(), before.memory_allocated());
                        }
                        Err(e) => prop_assert!(matches!(e, AllocError::InvalidPool { .. }), "{e}"),
                    }
                }
            }
        }
        if let Err(v) = a.check_invariants() {
            return Err(TestCaseError::fail(format!("after {op:?}: {v}")));
        }
        let v = sim.violations();
        prop_assert!(v.is_empty(), "after {op:?}: {v:?}");
        let c = sim.capture_violations();
        prop_assert!(c.is_empty(), "after {op:?}: {c:?}");
    }
    if let Some((s, g)) = open.take() {
        end(&a, s, g.pool);
        graphs.push(g);
    }
    for (x, _) in live.drain(..) {
        a.free(x.ptr).unwrap();
    }
    for g in graphs {
        a.release_pool(g.pool).unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    prop_assert!(sim.violations().is_empty());
    prop_assert_eq!(a.memory_stats().memory_reserved(), 0);
    Ok(())
}

fn configs() -> Vec<(&'static str, AllocatorConfig)> {
    let mut v = crate::util::four_configs();
    let everything = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .fast_path(true)
        .cross_stream_reuse(true)
        .borrow_blocks(true)
        .page_lending(true)
        .build()
        .unwrap();
    v.push(("default+everything", everything));
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn replayed_graphs_keep_their_memory_under_every_policy(
        which in 0..5usize,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let (_, config) = configs().swap_remove(which);
        run(config, &ops)?;
    }
}
