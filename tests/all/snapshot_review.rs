//! Snapshots on programs an adversarial review of IPC and snapshots wrote, each failing on the
//! code before its fix: the fast path's cached blocks shown as the core shows them after a free
//! (merged with their free neighbours), and an exported snapshot keeping a private pool's id
//! (`segment_pool_id`).

use cuda_caching_allocator::*;

#[cfg(feature = "trace-io")]
use crate::util::MIB;
use crate::util::with_config;

fn cfg(fast_path: bool) -> AllocatorConfig {
    AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .fast_path(fast_path)
        .build()
        .unwrap()
}

/// Per segment: its address and its blocks as (address, size, state).
type Layout = Vec<(u64, Vec<(u64, usize, &'static str)>)>;

fn layout(a: &CachingAllocator<SimDevice>) -> Layout {
    a.snapshot()
        .iter()
        .map(|s| {
            (
                s.address.0,
                s.blocks
                    .iter()
                    .map(|b| (b.address.0, b.size, b.state.name()))
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn fast_path_snapshot_matches_plain_core() {
    let run = |fast: bool| {
        let a = with_config(1 << 30, cfg(fast));
        let x = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
        let y = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
        let z = a.allocate(4096, StreamId::DEFAULT).unwrap().ptr;
        a.free(y).unwrap();
        a.free(z).unwrap();
        let l = layout(&a);
        let _ = x;
        l
    };
    assert_eq!(
        run(true),
        run(false),
        "snapshot with the fast path vs without"
    );
}

#[cfg(feature = "trace-io")]
#[test]
fn exported_snapshot_keeps_private_pool_id() {
    for config in [AllocatorConfig::pytorch(), cfg(false)] {
        let a = with_config(1 << 30, config);
        let pool = MemPoolId::new_graph();
        a.begin_allocate_to_pool(pool, Box::new(|_| true)).unwrap();
        let x = a.allocate(5 * MIB, StreamId::DEFAULT).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        let snap = a.snapshot();
        let seg = snap
            .iter()
            .find(|s| s.blocks.iter().any(|b| b.address == x.ptr))
            .unwrap();
        assert_eq!(seg.private_pool, pool);
        use cuda_caching_allocator::trace::ToSnapshotSegments;
        let exported = snap.to_snapshot_segments(0);
        let eseg = exported
            .iter()
            .find(|s| s.blocks.iter().any(|b| b.address == x.ptr.0))
            .unwrap();
        assert_eq!(
            eseg.pool_id,
            (pool.0, pool.1),
            "segment_pool_id of a private pool's segment"
        );
    }
}
