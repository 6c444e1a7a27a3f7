//! Restoring a private pool to a checkpoint (`CachingAllocator::pool_checkpoint` /
//! `restore_pool`, PyTorch's `getCheckpointState` / `setCheckpointPoolState`) on the simulated
//! device: after the pool's books changed (tensors died, a new recording allocated), restoring
//! gives back exactly the checkpoint's layout — every segment's blocks at the same addresses and
//! sizes, allocated where they were — reports what it freed and allocated, keeps the statistics
//! and invariants, and refuses what it cannot restore without changing anything.

use cuda_caching_allocator::*;

use crate::util::{MIB, four_configs, with_config};

type Layout = Vec<Vec<(u64, usize, BlockState)>>;

/// A pool's segments as (address, size, state) per block.
fn layout(cp: &PoolCheckpoint) -> Layout {
    cp.segments
        .iter()
        .map(|s| {
            s.blocks
                .iter()
                .map(|b| {
                    // Freed blocks may still wait on events (pending) or not: both are free.
                    let state = match b.state {
                        BlockState::ActivePendingFree => BlockState::Inactive,
                        s => s,
                    };
                    (b.address.0, b.size, state)
                })
                .collect()
        })
        .collect()
}

/// `now`'s layout of the segments `cp` holds (segments made since are left out).
fn layout_of_checkpointed(now: &PoolCheckpoint, cp: &PoolCheckpoint) -> Layout {
    layout(now)
        .into_iter()
        .filter(|seg| cp.segments.iter().any(|s| s.address.0 == seg[0].0))
        .collect()
}

/// The recorded history pairs every free with one live allocation and leaves none live (the
/// restore's frees and allocations are in it).
fn history_is_consistent(a: &CachingAllocator<SimDevice>, name: &str) {
    let (trace, dropped) = a.history();
    assert_eq!(dropped, 0);
    let mut live = std::collections::HashSet::new();
    for e in &trace.events {
        match e.op {
            trace::TraceOp::Alloc { id, .. } => {
                assert!(live.insert(id), "{name}: alloc {id} twice")
            }
            trace::TraceOp::Free { id } => {
                assert!(live.remove(&id), "{name}: free of {id} not live")
            }
            _ => {}
        }
    }
    assert!(
        live.is_empty(),
        "{name}: {} allocations never freed",
        live.len()
    );
}

fn route(a: &CachingAllocator<SimDevice>, pool: MemPoolId) {
    a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
}

#[test]
fn a_restored_pool_has_the_checkpoints_layout_again() {
    for (name, config) in four_configs() {
        let a = with_config(8 << 30, config);
        a.record_history(1 << 16);
        let s = StreamId::DEFAULT;
        let pool = MemPoolId::new_graph();
        // Recording 1: three outputs stay, one temporary dies.
        route(&a, pool);
        let x1 = a.allocate(3 * MIB, s).unwrap().ptr;
        let x2 = a.allocate(1000, s).unwrap().ptr;
        let tmp = a.allocate(5 * MIB, s).unwrap().ptr;
        let x3 = a.allocate(25 * MIB, s).unwrap().ptr;
        a.free(tmp).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        let cp = a.pool_checkpoint(pool).unwrap();
        let allocated_then = a.memory_stats().allocated_bytes.get(StatType::All).current;
        // Replays change nothing here; then x1 and x3 die and a second recording allocates.
        a.free(x1).unwrap();
        a.free(x3).unwrap();
        route(&a, pool);
        let y = a.allocate(4 * MIB, s).unwrap().ptr;
        let z = a.allocate(2 * MIB + 512, s).unwrap().ptr;
        let w = a.allocate(40 * MIB, s).unwrap().ptr; // a segment the checkpoint does not know
        a.end_allocate_to_pool(pool).unwrap();
        let r = a.restore_pool(&cp).unwrap();
        let mut freed = vec![x2, y, z, w];
        freed.sort();
        let mut back = vec![x1, x2, x3];
        back.sort();
        assert_eq!(r.freed, freed, "{name}");
        assert_eq!(r.allocated, back, "{name}");
        let now = a.pool_checkpoint(pool).unwrap();
        let known = layout_of_checkpointed(&now, &cp);
        assert_eq!(known, layout(&cp), "{name}: the checkpoint's layout again");
        let extra: Vec<_> = now
            .segments
            .iter()
            .filter(|s| !cp.segments.iter().any(|c| c.address == s.address))
            .collect();
        assert!(
            extra.len() == 1
                && extra[0]
                    .blocks
                    .iter()
                    .all(|b| b.state != BlockState::ActiveAllocated),
            "{name}: the new segment stays, free: {extra:?}"
        );
        assert_eq!(
            a.memory_stats().allocated_bytes.get(StatType::All).current,
            allocated_then,
            "{name}"
        );
        a.check_invariants().unwrap();
        for p in back {
            a.free(p).unwrap();
        }
        history_is_consistent(&a, name);
        // One use per recording (per graph), as PyTorch counts them.
        a.release_pool(pool).unwrap();
        a.release_pool(pool).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            a.pool_use_count(pool),
            None,
            "{name}: the pool empties and goes"
        );
        assert_eq!(
            a.memory_stats().allocated_bytes.get(StatType::All).current,
            0,
            "{name}"
        );
        a.check_invariants().unwrap();
    }
}

#[test]
fn restoring_after_random_recordings_gives_the_layout_back() {
    let a = with_config(16 << 30, AllocatorConfig::default());
    let s = StreamId::DEFAULT;
    let pool = MemPoolId::new_graph();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let size = |r: u64| match r % 4 {
        0 => 512 + (r >> 8) as usize % 8192,
        1 => MIB + (r >> 8) as usize % (3 * MIB),
        2 => 6 * MIB + (r >> 8) as usize % (20 * MIB),
        _ => 2 * MIB,
    };
    let mut live: Vec<DeviceAddr> = Vec::new();
    for round in 0..60 {
        route(&a, pool);
        for _ in 0..(rand() % 6 + 1) {
            live.push(a.allocate(size(rand()), s).unwrap().ptr);
        }
        for _ in 0..(rand() % 3) {
            if !live.is_empty() {
                let i = rand() as usize % live.len();
                a.free(live.swap_remove(i)).unwrap();
            }
        }
        a.end_allocate_to_pool(pool).unwrap();
        let cp = a.pool_checkpoint(pool).unwrap();
        let mut then: Vec<DeviceAddr> = live.clone();
        then.sort();
        // Tensors die and another recording allocates, then the checkpoint is restored.
        for _ in 0..(rand() % 4) {
            if !live.is_empty() {
                let i = rand() as usize % live.len();
                a.free(live.swap_remove(i)).unwrap();
            }
        }
        route(&a, pool);
        for _ in 0..(rand() % 4) {
            live.push(a.allocate(size(rand()), s).unwrap().ptr);
        }
        a.end_allocate_to_pool(pool).unwrap();
        let r = a.restore_pool(&cp).unwrap();
        live.sort();
        assert_eq!(
            r.freed, live,
            "round {round}: every live allocation of the pool is freed"
        );
        assert_eq!(
            r.allocated, then,
            "round {round}: the checkpoint's allocations are back"
        );
        let now = a.pool_checkpoint(pool).unwrap();
        let known = layout_of_checkpointed(&now, &cp);
        assert_eq!(known, layout(&cp), "round {round}");
        a.check_invariants().unwrap();
        live = then;
    }
}

#[test]
fn what_cannot_be_restored_is_refused_and_nothing_changes() {
    let a = with_config(4 << 30, AllocatorConfig::pytorch());
    let (s, other) = (StreamId::DEFAULT, StreamId(9));
    let pool = MemPoolId::new_graph();
    route(&a, pool);
    let x = a.allocate(3 * MIB, s).unwrap().ptr;
    let _y = a.allocate(MIB, s).unwrap().ptr;
    a.end_allocate_to_pool(pool).unwrap();
    let cp = a.pool_checkpoint(pool).unwrap();
    let expect = |cp: &PoolCheckpoint, words: &str| {
        let before = a.snapshot();
        let err = a.restore_pool(cp).unwrap_err();
        assert!(
            matches!(err, AllocError::InvalidPool { .. }) && err.to_string().contains(words),
            "{err}"
        );
        assert_eq!(a.snapshot(), before, "{err}: nothing changed");
        a.check_invariants().unwrap();
    };
    // A segment the pool does not hold; blocks that do not cover their segment.
    let mut moved = cp.clone();
    for b in &mut moved.segments[0].blocks {
        b.address = DeviceAddr(b.address.0 + (1 << 40));
    }
    moved.segments[0].address = moved.segments[0].blocks[0].address;
    expect(&moved, "not a segment of the pool");
    let mut short = cp.clone();
    short.segments[0].blocks.pop();
    expect(&short, "do not cover");
    let mut unknown = cp.clone();
    unknown.pool = MemPoolId::new_graph();
    expect(&unknown, "no such private pool");
    // Recorded stream uses: the block's work may still run.
    a.record_stream(x, other).unwrap();
    expect(&cp, "stream uses");
    assert!(matches!(
        a.pool_checkpoint(MemPoolId::new_user()),
        Err(AllocError::InvalidPool { .. })
    ));
}
