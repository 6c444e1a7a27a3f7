//! The invariant checker: one named check per invariant of the cache's state.
//!
//! Tests, property tests and fuzzing run it after every operation (the `invariant-checks`
//! feature does so automatically). It walks everything, so it costs O(blocks); production code
//! never calls it. May use: `state`, `block`, `pool`, `stats`.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::block::BlockId;
use super::state::State;
use crate::backend::DeviceAddr;
use crate::size_class::PoolKind;
use crate::stats::{MemoryStats, StatArray, StatType};

/// Which invariant failed, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvariantViolation {
    /// A segment's blocks do not cover it exactly, contiguously, with one stream and pool.
    BlocksDoNotTileSegment {
        /// The segment.
        segment: DeviceAddr,
        /// What was wrong.
        detail: String,
    },
    /// `a.next == b` but `b.prev != a` (or the reverse), or a link points nowhere.
    NeighbourLinksDisagree {
        /// The block whose link is wrong.
        block: DeviceAddr,
    },
    /// Two neighbouring blocks are both free: they should have been merged.
    AdjacentFreeBlocks {
        /// The first block.
        first: DeviceAddr,
        /// The block after it.
        second: DeviceAddr,
    },
    /// The free sets do not hold exactly the free blocks, or hold a stale key.
    FreeSetMismatch {
        /// What was wrong.
        detail: String,
    },
    /// The address map does not hold exactly the allocated blocks.
    ActiveMapMismatch {
        /// What was wrong.
        detail: String,
    },
    /// A statistic differs from a recount of the blocks.
    StatsMismatch {
        /// The `memory_stats()` key.
        key: String,
        /// The value the allocator keeps.
        recorded: i64,
        /// The value a recount gives.
        recount: i64,
    },
    /// An expandable segment's page table disagrees with its blocks: a mapped block over an
    /// unmapped page, a mapped page under an unmapped block, an unmapped block not on page
    /// boundaries, or a segment record that does not match.
    PagesDoNotMatchBlocks {
        /// The segment.
        segment: DeviceAddr,
        /// What was wrong.
        detail: String,
    },
    /// The outstanding stream events disagree with the blocks: an event names a dead,
    /// allocated or unmapped block, or a block's event count differs from the events naming it.
    /// (A block with pending events must stay out of the free sets, best fit and cross-stream
    /// handovers until they complete.)
    PendingEventsMismatch {
        /// The block.
        block: DeviceAddr,
        /// What was wrong.
        detail: String,
    },
    /// The private pools (graph capture) disagree with the blocks: a private block in a default
    /// free set or another pool's, a segment of an unknown pool, an expandable private segment,
    /// a segment count that differs from a recount, a routing to a missing pool, or deferred frees
    /// that do not name exactly the blocks freed with pending stream uses during a capture.
    PrivatePoolMismatch {
        /// What was wrong.
        detail: String,
    },
    /// Reserved bytes grew above the fraction cap.
    ReservedAboveCap {
        /// Bytes reserved.
        reserved: usize,
        /// The cap.
        cap: usize,
    },
}

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BlocksDoNotTileSegment { segment, detail } => {
                write!(f, "blocks do not tile segment {segment}: {detail}")
            }
            Self::NeighbourLinksDisagree { block } => {
                write!(f, "neighbour links disagree at block {block}")
            }
            Self::AdjacentFreeBlocks { first, second } => write!(
                f,
                "adjacent free blocks {first} and {second} were not merged"
            ),
            Self::FreeSetMismatch { detail } => {
                write!(f, "free sets do not match the free blocks: {detail}")
            }
            Self::ActiveMapMismatch { detail } => write!(
                f,
                "address map does not match the allocated blocks: {detail}"
            ),
            Self::StatsMismatch {
                key,
                recorded,
                recount,
            } => write!(f, "stat {key} is {recorded} but a recount gives {recount}"),
            Self::PagesDoNotMatchBlocks { segment, detail } => {
                write!(
                    f,
                    "pages of expandable segment {segment} do not match its blocks: {detail}"
                )
            }
            Self::PendingEventsMismatch { block, detail } => {
                write!(
                    f,
                    "pending stream events disagree at block {block}: {detail}"
                )
            }
            Self::PrivatePoolMismatch { detail } => {
                write!(f, "private pools do not match the blocks: {detail}")
            }
            Self::ReservedAboveCap { reserved, cap } => write!(
                f,
                "reserved {reserved} bytes above the fraction cap of {cap}"
            ),
        }
    }
}

impl std::error::Error for InvariantViolation {}

/// Runs every check in order; returns the first violation.
pub(crate) fn check(st: &State) -> Result<(), InvariantViolation> {
    check_segments_tiled(st)?;
    check_no_adjacent_free(st)?;
    check_free_sets(st)?;
    check_unmapped_sets(st)?;
    check_lent(st)?;
    check_pages(st)?;
    check_active_map(st)?;
    check_pending_events(st)?;
    check_private_pools(st)?;
    check_stats(st)?;
    check_cap(st)
}

fn is_free(st: &State, id: BlockId) -> bool {
    st.arena
        .get(id)
        .is_some_and(|b| !b.allocated && !b.lent && b.event_count == 0 && b.stream_uses.is_empty())
}

fn check_segments_tiled(st: &State) -> Result<(), InvariantViolation> {
    let mut reached = 0usize;
    let mut heads = 0usize;
    for (head, hb) in st.arena.iter().filter(|(_, b)| b.prev.is_none()) {
        heads += 1;
        let seg = DeviceAddr(hb.ptr);
        let tile = |detail: String| InvariantViolation::BlocksDoNotTileSegment {
            segment: seg,
            detail,
        };
        let Some(rec) = st.segments.get(&hb.ptr) else {
            return Err(tile("no segment record for this head block".into()));
        };
        let mut cur = head;
        let mut end = hb.ptr;
        loop {
            let Some(b) = st.arena.get(cur) else {
                return Err(InvariantViolation::NeighbourLinksDisagree {
                    block: DeviceAddr(end),
                });
            };
            reached += 1;
            if b.ptr != end {
                return Err(tile(format!("gap or overlap at {}", DeviceAddr(b.ptr))));
            }
            if b.stream != rec.stream || b.pool != rec.pool || b.owner != rec.owner {
                return Err(tile(format!(
                    "block {} has another stream, pool or private pool",
                    DeviceAddr(b.ptr)
                )));
            }
            end = b.end();
            match b.next {
                None => break,
                Some(n) => {
                    if st.arena.get(n).is_none_or(|nb| nb.prev != Some(cur)) {
                        return Err(InvariantViolation::NeighbourLinksDisagree {
                            block: DeviceAddr(b.ptr),
                        });
                    }
                    cur = n;
                }
            }
            if reached > st.arena.len() {
                return Err(tile("cycle in block links".into()));
            }
        }
        if end != hb.ptr + rec.size as u64 {
            return Err(tile(format!(
                "blocks end at {} but the segment has {} bytes",
                DeviceAddr(end),
                rec.size
            )));
        }
    }
    if heads != st.segments.len() {
        return Err(InvariantViolation::BlocksDoNotTileSegment {
            segment: DeviceAddr::NULL,
            detail: format!(
                "{} segment records but {heads} head blocks",
                st.segments.len()
            ),
        });
    }
    if reached != st.arena.len() {
        return Err(InvariantViolation::BlocksDoNotTileSegment {
            segment: DeviceAddr::NULL,
            detail: format!(
                "{} blocks live but {reached} reachable from segment heads",
                st.arena.len()
            ),
        });
    }
    Ok(())
}

fn check_no_adjacent_free(st: &State) -> Result<(), InvariantViolation> {
    for (id, b) in st.arena.iter() {
        if let Some(n) = b.next {
            let same_mapping = st.arena.get(n).is_some_and(|nb| nb.mapped == b.mapped);
            if same_mapping && is_free(st, id) && is_free(st, n) {
                let second = st
                    .arena
                    .get(n)
                    .map_or(DeviceAddr::NULL, |nb| DeviceAddr(nb.ptr));
                return Err(InvariantViolation::AdjacentFreeBlocks {
                    first: DeviceAddr(b.ptr),
                    second,
                });
            }
        }
    }
    Ok(())
}

/// Every free set (the default pools' and each private pool's) holds exactly the free mapped
/// blocks of its owner.
fn check_free_sets(st: &State) -> Result<(), InvariantViolation> {
    let bad = |detail: String| InvariantViolation::FreeSetMismatch { detail };
    let mut in_sets = BTreeSet::new();
    let sets = [PoolKind::Small, PoolKind::Large]
        .into_iter()
        .map(|kind| (0u32, kind, st.pool_ref(kind)))
        .chain(st.graph.pools.iter().flat_map(|(&slot, p)| {
            [PoolKind::Small, PoolKind::Large]
                .into_iter()
                .map(move |kind| (slot, kind, p.set_ref(kind)))
        }));
    for (owner, kind, set) in sets {
        if let Err(detail) = set.blocks.check() {
            return Err(bad(format!(
                "{kind:?} free set of pool slot {owner}: {detail}"
            )));
        }
        for k in &set.blocks {
            let Some(b) = st.arena.get(k.id) else {
                return Err(bad(format!(
                    "key for a dead block at {}",
                    DeviceAddr(k.ptr)
                )));
            };
            if b.owner != owner {
                return Err(InvariantViolation::PrivatePoolMismatch {
                    detail: format!(
                        "block {} of pool slot {} sits in the free set of pool slot {owner} (0: default)",
                        DeviceAddr(b.ptr),
                        b.owner
                    ),
                });
            }
            if (b.stream, b.size, b.ptr, b.pool) != (k.stream, k.size, k.ptr, kind) {
                return Err(bad(format!("stale key for block {}", DeviceAddr(b.ptr))));
            }
            if !is_free(st, k.id) || !b.mapped {
                return Err(bad(format!(
                    "block {} is in a free set but not free",
                    DeviceAddr(b.ptr)
                )));
            }
            in_sets.insert(k.id);
        }
    }
    for (id, b) in st.arena.iter() {
        if is_free(st, id) && b.mapped && !in_sets.contains(&id) {
            return Err(bad(format!(
                "free block {} is missing from its free set",
                DeviceAddr(b.ptr)
            )));
        }
    }
    Ok(())
}

/// Unmapped blocks are exactly the entries of the pools' `unmapped` sets, and are free parts of
/// expandable segments.
fn check_unmapped_sets(st: &State) -> Result<(), InvariantViolation> {
    let bad = |detail: String| InvariantViolation::FreeSetMismatch { detail };
    let mut entries = 0usize;
    for kind in [PoolKind::Small, PoolKind::Large] {
        for &(stream, ptr, id) in &st.pool_ref(kind).unmapped {
            entries += 1;
            let Some(b) = st.arena.get(id) else {
                return Err(bad(format!(
                    "unmapped-set entry for a dead block at {}",
                    DeviceAddr(ptr)
                )));
            };
            if (b.stream, b.ptr, b.pool) != (stream, ptr, kind) || b.mapped {
                return Err(bad(format!(
                    "stale unmapped-set entry for block {}",
                    DeviceAddr(b.ptr)
                )));
            }
            if b.allocated || b.event_count > 0 || !b.expandable {
                return Err(bad(format!(
                    "unmapped block {} is allocated, pending or not expandable",
                    DeviceAddr(b.ptr)
                )));
            }
        }
    }
    let unmapped = st
        .arena
        .iter()
        .filter(|(_, b)| !b.mapped && !b.lent)
        .count();
    if unmapped != entries {
        return Err(bad(format!(
            "{unmapped} unmapped blocks but {entries} unmapped-set entries"
        )));
    }
    Ok(())
}

/// Lent blocks (Note [Lent pages]) are exactly the blocks of the lent list, each once: unmapped,
/// expandable, not allocated, with no pending event, and their old mappings lie inside them in
/// address order.
fn check_lent(st: &State) -> Result<(), InvariantViolation> {
    let bad = |detail: String| InvariantViolation::FreeSetMismatch { detail };
    let flagged = st.arena.iter().filter(|(_, b)| b.lent).count();
    if flagged != st.lent.len() {
        return Err(bad(format!(
            "{flagged} lent blocks but {} lent-list entries",
            st.lent.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for r in &st.lent {
        let Some(b) = st.arena.get(r.block) else {
            return Err(bad("lent-list entry for a dead block".into()));
        };
        if !seen.insert(r.block)
            || !b.lent
            || b.mapped
            || !b.expandable
            || b.allocated
            || b.event_count > 0
            || r.stream != b.stream
        {
            return Err(bad(format!(
                "lent block {} is listed twice, mapped, allocated, pending or on another stream",
                DeviceAddr(b.ptr)
            )));
        }
        let mut at = b.ptr;
        for &(va, bytes, _) in &r.maps {
            if va < at || va + bytes as u64 > b.end() || bytes == 0 {
                return Err(bad(format!(
                    "lent block {}: old mapping {} + {bytes} out of order or outside it",
                    DeviceAddr(b.ptr),
                    DeviceAddr(va)
                )));
            }
            at = va + bytes as u64;
        }
    }
    Ok(())
}

/// Each expandable segment: its record matches, its unmapped blocks start and end on page
/// boundaries with no page mapped under them, and every page under a mapped block is mapped (so
/// the mapped pages tile exactly the mapped blocks).
fn check_pages(st: &State) -> Result<(), InvariantViolation> {
    for (&base, seg) in &st.vm_segments {
        let rec_ok = st.segments.get(&base).is_some_and(|r| {
            r.expandable && r.size == seg.size && r.stream == seg.stream && r.pool == seg.pool
        });
        let pages = seg.size.checked_div(seg.page_size).unwrap_or(0);
        if !rec_ok || seg.base != base || pages == 0 || seg.size % seg.page_size != 0 {
            return Err(InvariantViolation::PagesDoNotMatchBlocks {
                segment: DeviceAddr(base),
                detail: "segment record does not match".into(),
            });
        }
        let mut end = 0usize;
        let mut counted = 0usize;
        for (&start, &(_, n)) in &seg.handles {
            if n == 0 || start < end || start + n > pages {
                return Err(InvariantViolation::PagesDoNotMatchBlocks {
                    segment: DeviceAddr(base),
                    detail: format!("handle at page {start} overlaps another or the end"),
                });
            }
            end = start + n;
            counted += n;
        }
        if counted != seg.mapped_pages {
            return Err(InvariantViolation::PagesDoNotMatchBlocks {
                segment: DeviceAddr(base),
                detail: format!(
                    "{counted} pages under handles but {} counted",
                    seg.mapped_pages
                ),
            });
        }
    }
    for (_, b) in st.arena.iter() {
        let Some(base) = st.vm_segment_of(b.ptr) else {
            if !b.mapped || b.expandable {
                return Err(InvariantViolation::PagesDoNotMatchBlocks {
                    segment: DeviceAddr::NULL,
                    detail: format!(
                        "block {} is expandable or unmapped outside expandable segments",
                        DeviceAddr(b.ptr)
                    ),
                });
            }
            continue;
        };
        let Some(seg) = st.vm_segments.get(&base) else {
            continue;
        };
        let bad = |detail: String| InvariantViolation::PagesDoNotMatchBlocks {
            segment: DeviceAddr(base),
            detail,
        };
        if !b.expandable {
            return Err(bad(format!(
                "block {} is not marked expandable",
                DeviceAddr(b.ptr)
            )));
        }
        let (first, last) = (seg.page_left(b.ptr), seg.page_right(b.end()));
        if b.mapped {
            let mut p = first;
            while p < last {
                let Some((start, n)) = seg.covering(p) else {
                    return Err(bad(format!(
                        "mapped block {} lies over unmapped page {p}",
                        DeviceAddr(b.ptr)
                    )));
                };
                p = start + n;
            }
        } else {
            let ps = seg.page_size as u64;
            if (b.ptr - base) % ps != 0 || b.size as u64 % ps != 0 {
                return Err(bad(format!(
                    "unmapped block {} is not page aligned",
                    DeviceAddr(b.ptr)
                )));
            }
            let overlap = seg
                .covering(first)
                .map(|(start, _)| start)
                .or_else(|| seg.handles.range(first..last).next().map(|(p, _)| *p));
            if let Some(p) = overlap {
                return Err(bad(format!(
                    "page {p} is mapped under unmapped block {}",
                    DeviceAddr(b.ptr)
                )));
            }
        }
    }
    let expandable_recs = st.segments.values().filter(|r| r.expandable).count();
    if expandable_recs != st.vm_segments.len() {
        return Err(InvariantViolation::PagesDoNotMatchBlocks {
            segment: DeviceAddr::NULL,
            detail: format!(
                "{expandable_recs} expandable segment records but {} page tables",
                st.vm_segments.len()
            ),
        });
    }
    Ok(())
}

fn check_active_map(st: &State) -> Result<(), InvariantViolation> {
    let bad = |detail: String| InvariantViolation::ActiveMapMismatch { detail };
    for (&ptr, &id) in &st.active {
        match st.arena.get(id) {
            Some(b) if b.allocated && b.ptr == ptr => {}
            _ => {
                return Err(bad(format!(
                    "entry {} does not name an allocated block there",
                    DeviceAddr(ptr)
                )));
            }
        }
    }
    let allocated = st.arena.iter().filter(|(_, b)| b.allocated).count();
    if allocated != st.active.len() {
        return Err(bad(format!(
            "{allocated} allocated blocks but {} map entries",
            st.active.len()
        )));
    }
    Ok(())
}

/// Every outstanding event names a live block that is freed but pending (not allocated, mapped),
/// and each block's `event_count` equals the number of events naming it; the `unsynced` list
/// holds exactly the freed blocks that still have stream uses; exactly the freed blocks still
/// waiting for streams are marked `awaited`.
fn check_pending_events(st: &State) -> Result<(), InvariantViolation> {
    let mut named: BTreeMap<BlockId, u32> = BTreeMap::new();
    for queue in st.pending_events.values() {
        for &(_, id) in queue {
            let Some(b) = st.arena.get(id) else {
                return Err(InvariantViolation::PendingEventsMismatch {
                    block: DeviceAddr::NULL,
                    detail: "an event names a dead block".into(),
                });
            };
            if b.allocated || !b.mapped {
                return Err(InvariantViolation::PendingEventsMismatch {
                    block: DeviceAddr(b.ptr),
                    detail: "an event names an allocated or unmapped block".into(),
                });
            }
            *named.entry(id).or_default() += 1;
        }
    }
    for (id, b) in st.arena.iter() {
        // A freed block keeps stream uses only while it waits: listed in `unsynced`, for a
        // stream it could neither fence nor wait for, or deferred until a capture ends (checked
        // with the private pools).
        let unsynced =
            !b.allocated && !b.stream_uses.is_empty() && !st.graph.deferred.contains(&id);
        if unsynced != st.unsynced.contains(&id) {
            return Err(InvariantViolation::PendingEventsMismatch {
                block: DeviceAddr(b.ptr),
                detail: format!(
                    "freed with stream uses: {unsynced}, listed as unsynced: {}",
                    !unsynced
                ),
            });
        }
        // Waiting after its free returned is what `awaited` records (its completion is told).
        let waiting = !b.allocated && (b.event_count > 0 || !b.stream_uses.is_empty());
        if b.awaited != waiting {
            return Err(InvariantViolation::PendingEventsMismatch {
                block: DeviceAddr(b.ptr),
                detail: format!(
                    "waiting for streams: {waiting}, marked awaited: {}",
                    b.awaited
                ),
            });
        }
        let n = named.get(&id).copied().unwrap_or(0);
        if b.event_count != n {
            return Err(InvariantViolation::PendingEventsMismatch {
                block: DeviceAddr(b.ptr),
                detail: format!("event count {} but {n} events name it", b.event_count),
            });
        }
    }
    Ok(())
}

/// The private pools: each block's owner names a live pool; private segments are fixed
/// segments and each pool's segment count equals a recount; every routing names a live pool
/// with a use; deferred frees exist only during a capture and name exactly the blocks freed with
/// pending stream uses (not allocated, no events recorded yet).
fn check_private_pools(st: &State) -> Result<(), InvariantViolation> {
    let bad = |detail: String| InvariantViolation::PrivatePoolMismatch { detail };
    let mut segments: BTreeMap<u32, usize> = BTreeMap::new();
    for (&base, rec) in &st.segments {
        if rec.owner == 0 {
            continue;
        }
        if !st.graph.pools.contains_key(&rec.owner) {
            return Err(bad(format!(
                "segment {} belongs to unknown pool slot {}",
                DeviceAddr(base),
                rec.owner
            )));
        }
        if rec.expandable {
            return Err(bad(format!(
                "private segment {} is expandable",
                DeviceAddr(base)
            )));
        }
        *segments.entry(rec.owner).or_default() += 1;
    }
    for (&slot, p) in &st.graph.pools {
        let n = segments.get(&slot).copied().unwrap_or(0);
        if p.segments != n {
            return Err(bad(format!(
                "pool {} counts {} segments but holds {n}",
                p.id, p.segments
            )));
        }
        if p.id.is_default() || !st.graph.indexed(p.id, slot) {
            return Err(bad(format!("pool {} is missing from the id index", p.id)));
        }
        if p.use_count == 0 && p.segments == 0 {
            return Err(bad(format!("released empty pool {} was kept", p.id)));
        }
    }
    for slot in st.graph.routed_slots() {
        if st.graph.pools.get(&slot).is_none_or(|p| p.use_count == 0) {
            return Err(bad(format!(
                "a routing names pool slot {slot}, which is missing or released"
            )));
        }
    }
    if !st.capture_underway() && !st.graph.deferred.is_empty() {
        return Err(bad(format!(
            "{} deferred frees but no capture is underway",
            st.graph.deferred.len()
        )));
    }
    let deferred: BTreeSet<BlockId> = st.graph.deferred.iter().copied().collect();
    if deferred.len() != st.graph.deferred.len() {
        return Err(bad("a block is deferred twice".into()));
    }
    for (id, b) in st.arena.iter() {
        // Freed with stream uses and not waiting for a failed synchronize (`unsynced`, checked
        // with the pending events): deferred until the capture ends.
        let waiting = !b.allocated && !b.stream_uses.is_empty() && !st.unsynced.contains(&id);
        if waiting != deferred.contains(&id) || (waiting && b.event_count > 0) {
            return Err(bad(format!(
                "block {} is {}deferred but {}",
                DeviceAddr(b.ptr),
                if deferred.contains(&id) { "" } else { "not " },
                if waiting {
                    "freed with pending stream uses"
                } else {
                    "allocated or without stream uses"
                }
            )));
        }
    }
    for id in &deferred {
        if st.arena.get(*id).is_none() {
            return Err(bad("a deferred free names a dead block".into()));
        }
    }
    Ok(())
}

fn check_stats(st: &State) -> Result<(), InvariantViolation> {
    let mut want = MemoryStats::default();
    let max_split = st.config.max_split_size;
    let mut oversize_allocs = 0i64;
    for (_, b) in st.arena.iter() {
        let k = b.pool;
        let n = b.size as i64;
        if b.allocated {
            want.allocation.increase(k, 1);
            want.allocated_bytes.increase(k, n);
            if b.size >= max_split {
                oversize_allocs += 1;
            }
        }
        // Active: allocated, waiting for its stream events, or holding stream uses (a free
        // deferred during a capture, or one whose event and synchronizes failed).
        if b.allocated || b.event_count > 0 || !b.stream_uses.is_empty() {
            want.active.increase(k, 1);
            want.active_bytes.increase(k, n);
            want.requested_bytes.increase(k, b.requested_size as i64);
        } else if b.is_split() && !b.expandable && b.mapped {
            want.inactive_split.increase(k, 1);
            want.inactive_split_bytes.increase(k, n);
        }
    }
    let mut oversize_segs = 0i64;
    for rec in st.segments.values().filter(|r| !r.expandable) {
        want.segment.increase(rec.pool, 1);
        want.reserved_bytes.increase(rec.pool, rec.size as i64);
        if rec.size >= max_split {
            oversize_segs += 1;
        }
    }
    // Expandable segments reserve their mapped pages; spare pages stay reserved too.
    for seg in st.vm_segments.values() {
        want.reserved_bytes
            .increase(seg.pool, seg.mapped_bytes() as i64);
    }
    for sp in &st.spare_pages {
        want.reserved_bytes.increase(sp.pool, sp.size as i64);
    }
    let arrays: [(&str, &StatArray, &StatArray); 9] = [
        ("allocation", &st.stats.allocation, &want.allocation),
        (
            "allocated_bytes",
            &st.stats.allocated_bytes,
            &want.allocated_bytes,
        ),
        ("active", &st.stats.active, &want.active),
        ("active_bytes", &st.stats.active_bytes, &want.active_bytes),
        (
            "requested_bytes",
            &st.stats.requested_bytes,
            &want.requested_bytes,
        ),
        (
            "inactive_split",
            &st.stats.inactive_split,
            &want.inactive_split,
        ),
        (
            "inactive_split_bytes",
            &st.stats.inactive_split_bytes,
            &want.inactive_split_bytes,
        ),
        ("segment", &st.stats.segment, &want.segment),
        (
            "reserved_bytes",
            &st.stats.reserved_bytes,
            &want.reserved_bytes,
        ),
    ];
    for (name, have, recount) in arrays {
        for t in StatType::ALL {
            let (h, r) = (have.get(t).current, recount.get(t).current);
            if h != r {
                return Err(InvariantViolation::StatsMismatch {
                    key: format!("{name}.{}.current", t.name()),
                    recorded: h,
                    recount: r,
                });
            }
        }
    }
    let reserved = st.stats.reserved_bytes.get(StatType::All).current;
    if reserved != st.total_allocated_memory as i64
        || reserved != want.reserved_bytes.get(StatType::All).current
    {
        return Err(InvariantViolation::StatsMismatch {
            key: "reserved_bytes.all.current".into(),
            recorded: reserved,
            recount: want.reserved_bytes.get(StatType::All).current,
        });
    }
    // One handle per fixed segment and per physical handle mapped in an expandable segment or
    // spare (a lent handle's old mappings are the same handle, counted where it is mapped now).
    let handles = st.segments.values().filter(|r| !r.expandable).count()
        + st.vm_segments
            .values()
            .map(|seg| seg.handles.len())
            .sum::<usize>()
        + st.spare_pages.len();
    if st.handles.current != handles as i64 {
        return Err(InvariantViolation::StatsMismatch {
            key: "memory_handles.current".into(),
            recorded: st.handles.current,
            recount: handles as i64,
        });
    }
    for (key, have, recount) in [
        (
            "oversize_allocations.current",
            st.stats.oversize_allocations.current,
            oversize_allocs,
        ),
        (
            "oversize_segments.current",
            st.stats.oversize_segments.current,
            oversize_segs,
        ),
    ] {
        if have != recount {
            return Err(InvariantViolation::StatsMismatch {
                key: key.into(),
                recorded: have,
                recount,
            });
        }
    }
    for (name, have) in [
        ("allocated_bytes", &st.stats.allocated_bytes),
        ("reserved_bytes", &st.stats.reserved_bytes),
    ] {
        for t in StatType::ALL {
            let s = have.get(t);
            if s.peak < s.current || s.current < 0 {
                return Err(InvariantViolation::StatsMismatch {
                    key: format!("{name}.{}.peak", t.name()),
                    recorded: s.peak,
                    recount: s.current,
                });
            }
        }
    }
    Ok(())
}

fn check_cap(st: &State) -> Result<(), InvariantViolation> {
    if let Some(cap) = st.allowed_memory_maximum {
        // PyTorch checks an expandable growth against `get_allocation_size` and then maps whole
        // pages, so its reserved bytes may pass the cap by less than one page (a 10 MiB request
        // passes a check with 10 MiB of room and maps a 20 MiB page). The precise cap does not.
        let overshoot = if st.expandable && !st.config.precise_fraction_cap {
            [PoolKind::Small, PoolKind::Large]
                .into_iter()
                .map(|k| crate::size_class::expandable_page_size(k, &st.config))
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        if st.total_allocated_memory > cap.max(st.cap_grace).saturating_add(overshoot) {
            return Err(InvariantViolation::ReservedAboveCap {
                reserved: st.total_allocated_memory,
                cap,
            });
        }
    }
    Ok(())
}
