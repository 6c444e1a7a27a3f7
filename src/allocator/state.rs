//! The allocator's mutable state and PyTorch's algorithm over it: best fit, split, merge, the
//! out-of-memory path, the fraction cap, garbage collection, `record_stream` events.
//!
//! Everything here runs under the allocator's one lock. The steps follow
//! `DeviceCachingAllocator::malloc` / `free` of PyTorch 2.11 and are numbered in
//! `docs/algorithm.md`. Expandable (virtual-memory) segments live in the child module
//! `expandable` (where they grow beyond the page-reuse slack: `growth_fit`); the crate's
//! cross-stream handover (`cca_cross_stream_reuse`) in `handover`.
//! May use: `block`, `pool`, `device_calls`, `size_class`, `stats`, `config`.
#![forbid(unsafe_code)]

mod borrow;
mod checkpoint;
mod expandable;
mod growth_fit;
mod handover;
mod lending;
mod page_fence;
mod private_pool;

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::Allocation;
use super::block::{Arena, Block, BlockId};
use super::device_calls;
use super::history::History;
use super::pool::{BlockPool, FreeKey};
use super::segment_events::{ObserverSlot, SegmentAction, SegmentEvent};
use crate::backend::{BackendError, DeviceAddr, DeviceBackend, EventHandle, StreamId};
use crate::config::{AllocatorConfig, MAX_ALLOCATION_SIZE};
use crate::error::{AllocError, OomReport, OomVerdict, Result};
use crate::size_class::{PoolKind, expandable_page_size, pool_kind, round_size, segment_size};
use crate::stats::{MemoryStats, Stat};

pub(crate) use expandable::{SparePage, VmSegment};
pub(crate) use private_pool::GraphPools;
pub use private_pool::{MemPoolId, PoolFilter, capture_filter};

/// Maps keyed by device address (see `int_hash`).
pub(crate) type AddrMap<V> = crate::int_hash::IntMap<V>;

/// What the cache knows about one device segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentRec {
    /// Bytes: the segment's size, or an expandable segment's whole address range.
    pub(crate) size: usize,
    pub(crate) stream: StreamId,
    pub(crate) pool: PoolKind,
    /// An expandable segment (its pages are in `State::vm_segments`).
    pub(crate) expandable: bool,
    /// The private pool owning it (its slot in `State::graph`), 0 for the default pools.
    pub(crate) owner: u32,
}

/// All mutable state of one allocator.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) config: AllocatorConfig,
    pub(crate) arena: Arena,
    pub(crate) small: BlockPool,
    pub(crate) large: BlockPool,
    /// Allocated blocks by address.
    pub(crate) active: AddrMap<BlockId>,
    /// Device segments and expandable segments' address ranges, by base address.
    pub(crate) segments: BTreeMap<u64, SegmentRec>,
    /// Expandable segments by base address: their page size and mapped pages.
    pub(crate) vm_segments: BTreeMap<u64, VmSegment>,
    /// Physical pages held but mapped nowhere (left by a failed device call); released by
    /// `release_cached_blocks`, reused first when a segment grows.
    pub(crate) spare_pages: Vec<SparePage>,
    /// Whether expandable segments are in use (configured, and the backend has virtual memory
    /// with a granularity that divides both page sizes).
    pub(crate) expandable: bool,
    pub(crate) stats: MemoryStats,
    /// Device memory allocations backing the reserved bytes: one per fixed segment, one per
    /// physical handle of an expandable segment (mapped, lent or spare). Not one of PyTorch's
    /// statistics; `CachingAllocator::memory_handles`.
    pub(crate) handles: Stat,
    /// Bytes reserved from the device (PyTorch's `total_allocated_memory`).
    pub(crate) total_allocated_memory: usize,
    /// The fraction cap in bytes (`None`: no cap).
    pub(crate) allowed_memory_maximum: Option<usize>,
    pub(crate) device_total: usize,
    known_streams: Vec<StreamId>,
    /// Outstanding `record_stream` events, per stream, oldest first.
    pub(crate) pending_events: BTreeMap<StreamId, VecDeque<(EventHandle, BlockId)>>,
    /// Freed blocks whose use by another stream could be neither fenced by an event nor waited
    /// for (event and synchronize calls failed): the streams stay in their `stream_uses` and the
    /// blocks stay out of the cache until a later attempt succeeds (`retry_unsynced`).
    pub(crate) unsynced: Vec<BlockId>,
    event_pool: Vec<EventHandle>,
    /// Set when the last `alloc_block` failed because of the fraction cap.
    cap_rejected: bool,
    /// The device bytes the attempt the cap refused would have taken (meaningful while
    /// `cap_rejected` is set): the out-of-memory verdict names the cap only when the device had
    /// room for them.
    pub(crate) cap_refused_bytes: usize,
    /// Pages page reuse moved since an allocation's growth last raised the peak of allocated
    /// bytes (Note [Page-move budget] in `expandable.rs`).
    pub(crate) steady_moves: u64,
    /// Allocations of the core (`malloc_with`, counted when they succeed with a block) since the
    /// peak of allocated bytes last rose: each earns the page-move budget a fraction of a move
    /// (Note [Page-move budget]).
    pub(crate) allocs_since_peak: u64,
    /// Set by a growth of the allocation under way that raises the allocated peak; the budget's
    /// counts restart when that allocation succeeds (Note [Page-move budget]).
    pub(crate) growth_raises_peak: bool,
    /// The allocated bytes' peak as of the program's last reset of the peak statistics: page
    /// reuse measures its slack and budget against the all-time peak, which a program's
    /// `reset_peak_stats` must not move (Note [The policy's own peak] in `state/growth_fit.rs`).
    pub(crate) allocated_peak_before_reset: usize,
    /// Reserved bytes when the cap was last set, shrinking as segments are released: lowering
    /// the cap below what is reserved is allowed; growing above it is not.
    pub(crate) cap_grace: usize,
    /// The history recorder, when switched on.
    pub(crate) history: Option<History>,
    /// The segment observer, when one is set (`CachingAllocator::set_segment_observer`).
    pub(crate) segment_observer: ObserverSlot,
    /// Awaited frees that completed (address, requested size, stream, owner), to tell the
    /// observer as `FreeCompleted` where a backend is at hand (`tell_completed_frees`).
    completed_frees: Vec<(u64, usize, StreamId, u32)>,
    /// Whether the last `free` left its block waiting for other streams' work (`awaited`).
    pub(crate) last_free_awaited: bool,
    /// Segments handed over from one stream to another (`cca_cross_stream_reuse`) since the
    /// last reset of the accumulated statistics.
    pub(crate) cross_stream_handovers: u64,
    /// The backend answered `Unsupported` to an event call of a handover: do not try again.
    handover_events_unsupported: bool,
    /// Private pools for graph capture, the routings into them and the deferred frees.
    pub(crate) graph: GraphPools,
    /// Page reuse's event fences and free-stamp clock (Note [Page fences]).
    pub(crate) fences: page_fence::PageFences,
    /// Lent blocks whose old mappings are still in place, oldest first (Note [Lent pages]).
    pub(crate) lent: Vec<lending::LentRange>,
    /// Physical handles exported for other processes, with how many live exported allocations
    /// lie on each (`shared_pages.rs`); at 0 the export is let go.
    pub(crate) exported_handles: HashMap<u64, u32>,
    /// Page runs lent (Note [Lent pages]) since the last reset of the accumulated statistics.
    pub(crate) page_loans: u64,
    /// Old mappings of moved pages handed to the backend's helper thread to unmap (Note
    /// [Unmaps off the allocating thread]).
    pub(crate) unmaps_handed_off: u64,
    /// Blocks borrowed across streams (Note [Borrowed blocks]) since the last reset of the
    /// accumulated statistics.
    pub(crate) blocks_borrowed: u64,
    /// Whether the last successful `malloc`'s block is not one the fast path may keep: borrowed
    /// from another stream's segment (Note [Borrowed blocks]) or a private pool's taken on out
    /// of memory (Note [Pools used on out of memory]). Such a block goes back to the core.
    pub(crate) last_foreign_block: bool,
    /// Devices every mapped page of this allocator was granted to
    /// (`CachingAllocator::enable_peer_access`, once all its grants succeeded).
    pub(crate) peers: Vec<usize>,
}

impl State {
    pub(crate) fn new(
        config: AllocatorConfig,
        device_total: usize,
        vm_granularity: Option<usize>,
    ) -> Self {
        let expandable = config.expandable_segments
            && vm_granularity.is_some_and(|g| {
                g > 0
                    && [PoolKind::Small, PoolKind::Large]
                        .iter()
                        .all(|&k| expandable_page_size(k, &config) % g == 0)
            });
        if config.graph_capture_record_stream_reuse {
            tracing::warn!(target: "cuda_caching_allocator", "graph_capture_record_stream_reuse:True is not implemented: blocks freed during a graph capture with recorded stream uses are reused only after the capture ends (PyTorch's behaviour with the key False)");
        }
        if config.expandable_segments && !expandable {
            tracing::warn!(target: "cuda_caching_allocator", granularity = ?vm_granularity, "expandable segments need virtual memory with a granularity dividing the page sizes; using fixed segments");
        }
        let stats = MemoryStats {
            max_split_size: if config.max_split_size == usize::MAX {
                -1
            } else {
                config.max_split_size as i64
            },
            ..MemoryStats::default()
        };
        let mut s = State {
            config,
            arena: Arena::default(),
            small: BlockPool::default(),
            large: BlockPool::default(),
            active: AddrMap::default(),
            segments: BTreeMap::new(),
            vm_segments: BTreeMap::new(),
            spare_pages: Vec::new(),
            expandable,
            stats,
            handles: Stat::default(),
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            device_total,
            known_streams: Vec::new(),
            pending_events: BTreeMap::new(),
            unsynced: Vec::new(),
            event_pool: Vec::new(),
            cap_rejected: false,
            cap_refused_bytes: 0,
            steady_moves: 0,
            allocs_since_peak: 0,
            growth_raises_peak: false,
            allocated_peak_before_reset: 0,
            cap_grace: 0,
            history: None,
            segment_observer: ObserverSlot::default(),
            completed_frees: Vec::new(),
            last_free_awaited: false,
            cross_stream_handovers: 0,
            handover_events_unsupported: false,
            graph: GraphPools::default(),
            fences: page_fence::PageFences::default(),
            lent: Vec::new(),
            exported_handles: HashMap::new(),
            page_loans: 0,
            unmaps_handed_off: 0,
            blocks_borrowed: 0,
            last_foreign_block: false,
            peers: Vec::new(),
        };
        s.apply_fraction(s.config.per_process_memory_fraction);
        s
    }

    pub(crate) fn apply_fraction(&mut self, fraction: f64) {
        self.config.per_process_memory_fraction = fraction;
        self.cap_grace = self.total_allocated_memory;
        self.allowed_memory_maximum = if fraction < 1.0 {
            Some((fraction * self.device_total as f64) as usize)
        } else {
            None
        };
    }

    fn pool(&mut self, kind: PoolKind) -> &mut BlockPool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    pub(crate) fn pool_ref(&self, kind: PoolKind) -> &BlockPool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    fn block(&self, id: BlockId) -> &Block {
        match self.arena.get(id) {
            Some(b) => b,
            None => unreachable_block(id),
        }
    }

    fn block_mut(&mut self, id: BlockId) -> &mut Block {
        match self.arena.get_mut(id) {
            Some(b) => b,
            None => unreachable_block(id),
        }
    }

    /// The free set of `id`'s pool (a private pool's for a private block), and the block.
    fn free_set_of(&mut self, id: BlockId) -> Option<(&mut BlockPool, &mut Block)> {
        let b = self.arena.get_mut(id)?;
        let set = match (b.owner, b.pool) {
            (0, PoolKind::Small) => &mut self.small,
            (0, PoolKind::Large) => &mut self.large,
            (owner, kind) => self.graph.pools.get_mut(&owner)?.set(kind),
        };
        Some((set, b))
    }

    /// Inserts a free block into its pool's free set (a private pool's for a private block).
    fn cache_block(&mut self, id: BlockId) {
        if let Some((set, b)) = self.free_set_of(id) {
            set.insert(id, b);
        }
    }

    /// Removes a free block from its pool's free set (a private pool's for a private block).
    fn uncache_free_block(&mut self, id: BlockId) {
        if let Some((set, b)) = self.free_set_of(id) {
            set.remove(id, b);
        }
    }

    // ---- malloc ----------------------------------------------------------------------------

    pub(crate) fn malloc<B: DeviceBackend>(
        &mut self,
        dev: &B,
        orig_size: usize,
        stream: StreamId,
    ) -> Result<Allocation> {
        self.malloc_with(dev, orig_size, stream, &mut |_, _| false)
    }

    /// `reset_peak_memory_stats` of the core: every statistic's and the handle count's peak
    /// becomes its current value. Page reuse keeps the allocated bytes' all-time peak
    /// (Note [The policy's own peak] in `state/growth_fit.rs`).
    pub(crate) fn reset_peak_stats(&mut self) {
        self.allocated_peak_before_reset = self
            .allocated_peak_before_reset
            .max(self.stats.max_memory_allocated().max(0) as usize);
        self.stats.reset_peak();
        self.handles.reset_peak();
    }

    /// `malloc` with a hook for the fast path: when no cached block fits, `before_growth(Some(
    /// stream))` runs before anything else (a cross-stream handover, garbage collection, device
    /// allocation, the release-and-retry chain), and `before_growth(None)` once more before the
    /// release-and-retry chain; when it returns true (it gave blocks back), the best-fit search
    /// runs again. `Some(stream)` lets the hook give back only what that stream could use.
    pub(crate) fn malloc_with<B: DeviceBackend>(
        &mut self,
        dev: &B,
        orig_size: usize,
        stream: StreamId,
        before_growth: &mut dyn FnMut(&mut State, Option<StreamId>) -> bool,
    ) -> Result<Allocation> {
        self.last_foreign_block = false;
        self.growth_raises_peak = false;
        if orig_size == 0 {
            return Ok(Allocation {
                ptr: DeviceAddr::NULL,
                size: 0,
                block_size: 0,
                stream,
            });
        }
        if orig_size as u64 >= MAX_ALLOCATION_SIZE {
            return Err(AllocError::TooLarge {
                requested: orig_size as u64,
            });
        }
        self.admit_stream(dev, stream)?;
        // Note [Capture underway] (private_pool.rs): no event queries, synchronizations or
        // releases while a routing is active; the allocation may go to a private pool.
        let capture = self.capture_underway();
        let owner = if capture {
            self.route(dev, stream)?
        } else {
            if !self.graph.deferred.is_empty() {
                self.insert_deferred_events(dev)?;
            }
            if !self.pending_events.is_empty() || !self.unsynced.is_empty() {
                self.process_events(dev)?;
            }
            0
        };
        let size = round_size(orig_size, &self.config);
        let kind = pool_kind(size);
        let alloc_size = segment_size(size, &self.config);

        let mut found = self.get_free_block(stream, size, kind, owner);
        if found.is_none() {
            // Note [Flush before a new peak] (front/mod.rs): other streams' cached blocks are
            // spared, except before a large-pool growth that would raise the reserved peak.
            let only = if kind == PoolKind::Large && self.growth_sets_reserved_peak(size) {
                None
            } else {
                Some(stream)
            };
            if before_growth(self, only) {
                found = self.get_free_block(stream, size, kind, owner);
            }
        }
        if found.is_none() && !capture && self.config.cross_stream_reuse {
            found = self.cross_stream_handover(dev, stream, size, kind);
        }
        // Note [Borrowed blocks] (borrow.rs).
        let mut borrowed = false;
        let mut from_oom_pool = false;
        if found.is_none() && !capture && owner == 0 {
            found = self.borrow_block(dev, stream, size, kind);
            borrowed = found.is_some();
        }
        if found.is_none() {
            if !capture
                && self.allowed_memory_maximum.is_some()
                && self.config.garbage_collection_threshold > 0.0
            {
                self.garbage_collect_cached_blocks(dev)?;
            }
            found = self.alloc_block(dev, stream, kind, alloc_size, size, false, owner)?;
            let give_up = capture || (self.cap_rejected && self.config.throw_on_cudamalloc_oom);
            // Note [Pools used on out of memory]: PyTorch's `try_mempool_fallback` comes right
            // after the first device allocation fails, before anything is released.
            if found.is_none() && owner == 0 {
                found = self.free_block_of_oom_pools(stream, size, kind);
                from_oom_pool = found.is_some();
            }
            // Before the release chain, every cached block of every stream goes back (the
            // growth above may have spared other streams' front caches).
            if found.is_none() && !give_up && before_growth(self, None) {
                found = self.get_free_block(stream, size, kind, owner);
            }
            if found.is_none()
                && !give_up
                && self.release_available_cached_blocks(dev, stream, size, kind)?
            {
                found = self.alloc_block(dev, stream, kind, alloc_size, size, false, owner)?;
            }
            if found.is_none() && !give_up {
                self.release_cached_blocks(dev)?;
                found = self.alloc_block(dev, stream, kind, alloc_size, size, true, owner)?;
            }
        }
        let Some(id) = found else {
            let oom = self.out_of_memory(dev, orig_size, size, alloc_size, stream, kind, owner);
            return Err(match oom {
                AllocError::OutOfMemory(report) if capture => AllocError::CaptureOutOfMemory {
                    pool: self.graph.id_of(owner),
                    report,
                },
                e => e,
            });
        };
        let split = self.should_split(id, size);
        let mut a = self.alloc_found_block(id, size, orig_size, split);
        self.last_foreign_block = borrowed || from_oom_pool;
        if borrowed {
            // Note [Borrowed blocks], step 2: the block's stream stays its segment's; the
            // borrower is a recorded use, so the block returns after an event on it.
            if let Some(&id) = self.active.get(&a.ptr.0) {
                self.add_stream_use(id, stream);
            }
            a.stream = stream;
        }
        // Note [Page-move budget]: only an allocation that got a block counts, and only one
        // whose growth raised the peak restarts the count.
        self.allocs_since_peak = self.allocs_since_peak.wrapping_add(1);
        if std::mem::take(&mut self.growth_raises_peak) {
            self.steady_moves = 0;
            self.allocs_since_peak = 0;
        }
        Ok(a)
    }

    /// Best fit: the smallest free block of `stream` in the pool with at least `size` bytes,
    /// lowest address first among equals; never an oversize block for a normal request, nor one
    /// more than `max_non_split_rounding` larger for an oversize request.
    /// `owner` picks the free sets: 0 the default pools, else a private pool's (whose blocks are
    /// never expandable).
    pub(super) fn get_free_block(
        &mut self,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
        owner: u32,
    ) -> Option<BlockId> {
        let gc_on =
            self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0;
        let walk = self.expandable && owner == 0;
        let pool = self.free_set(owner, kind)?;
        if gc_on {
            pool.get_free_blocks_call_count += 1;
        }
        // One search: the expandable walk goes on from the first fitting key, and the removal
        // below looks first where the two found the key.
        let search = FreeKey::search(stream, size);
        let (key, at) = if walk {
            let (start, mut keys) = self.pool_ref(kind).blocks.lower_bound(&search);
            let first = *keys.next()?;
            if first.stream != stream {
                return None;
            }
            let (key, steps) = self.expandable_best_fit(first, keys);
            (key, start + steps)
        } else {
            let (start, mut keys) = pool.blocks.lower_bound(&search);
            let key = *keys.next()?;
            if key.stream != stream {
                return None;
            }
            (key, start)
        };
        if !self.best_fit_accepts(size, key.size) {
            return None;
        }
        self.free_set(owner, kind)?.blocks.remove_hinted(&key, at);
        Some(key.id)
    }

    /// Whether best fit takes a free block of `block_size` bytes for a request of `size`: never
    /// an oversize block for a normal request, nor one more than `max_non_split_rounding` larger
    /// for an oversize request. The refusals grow with the block size, so along one stream's
    /// fits (smallest first) the first refusal ends the walk.
    #[inline]
    pub(super) fn best_fit_accepts(&self, size: usize, block_size: usize) -> bool {
        let max_split = self.config.max_split_size;
        if size < max_split {
            block_size < max_split
        } else {
            block_size < size.saturating_add(self.config.max_non_split_rounding)
        }
    }

    fn should_split(&self, id: BlockId, size: usize) -> bool {
        let b = self.block(id);
        if self.no_split(b.owner) {
            // Note [No-split pools].
            return false;
        }
        let remaining = b.size - size;
        // PyTorch tests the configuration flag, not the block.
        if b.pool == PoolKind::Small || self.expandable {
            remaining >= crate::config::MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > crate::config::SMALL_SIZE
        }
    }

    /// Asks the device for a new segment (after the fraction-cap check). `Ok(None)` means "no
    /// room" (cap or device out of memory); other device errors are returned. A private pool
    /// (`owner` > 0) always gets a fixed segment of its own.
    #[allow(clippy::too_many_arguments)]
    fn alloc_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        kind: PoolKind,
        size: usize,
        rounded: usize,
        is_retry: bool,
        owner: u32,
    ) -> Result<Option<BlockId>> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        self.cap_rejected = false;
        let expandable = self.expandable && owner == 0;
        let precise_cap = expandable && self.config.precise_fraction_cap;
        if let Some(max) = self.allowed_memory_maximum {
            if !precise_cap && self.total_allocated_memory.saturating_add(size) > max {
                self.cap_rejected = true;
                self.cap_refused_bytes = size;
                return Ok(None);
            }
        }
        if expandable {
            return self.try_allocate_expandable_block(dev, stream, kind, rounded);
        }
        if owner != 0 && !self.graph.pools.contains_key(&owner) {
            return Ok(None);
        }
        let ptr = match dev.allocate(size, stream) {
            Ok(p) => p,
            Err(BackendError::OutOfMemory) => return Ok(None),
            Err(source) => {
                return Err(AllocError::Backend {
                    operation: "allocate",
                    source,
                });
            }
        };
        self.total_allocated_memory += size;
        let mut block = Block::new(ptr.0, size, stream, kind);
        block.owner = owner;
        let id = self.arena.insert(block);
        if let Some(p) = self.graph.pools.get_mut(&owner) {
            p.segments += 1;
        }
        self.stats.segment.increase(kind, 1);
        self.handles.increase(1);
        self.stats.reserved_bytes.increase(kind, size as i64);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.segments.insert(
            ptr.0,
            SegmentRec {
                size,
                stream,
                pool: kind,
                expandable: false,
                owner,
            },
        );
        if let Some(h) = &mut self.history {
            h.segment_alloc(ptr, size, stream);
        }
        self.segment_event(dev, SegmentAction::Alloc, ptr.0, size, stream, owner);
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), %ptr, size, %stream, pool = kind.segment_type(), "segment allocated");
        Ok(Some(id))
    }

    fn alloc_found_block(
        &mut self,
        id: BlockId,
        size: usize,
        orig_size: usize,
        split: bool,
    ) -> Allocation {
        let kind = self.block(id).pool;
        let already_split = self.block(id).is_split();
        let expandable = self.block(id).expandable;
        let mut id = id;
        if split {
            // The front keeps the request; the old block becomes the remainder.
            let rem = id;
            let (ptr, stream, prev, owner) = {
                let r = self.block(rem);
                (r.ptr, r.stream, r.prev, r.owner)
            };
            let mut front = Block::new(ptr, size, stream, kind);
            front.expandable = expandable;
            front.owner = owner;
            front.prev = prev;
            front.next = Some(rem);
            let fid = self.arena.insert(front);
            if let Some(p) = prev {
                self.block_mut(p).next = Some(fid);
            }
            {
                let r = self.block_mut(rem);
                r.prev = Some(fid);
                r.ptr += size as u64;
                r.size -= size;
            }
            self.cache_block(rem);
            if !expandable {
                if already_split {
                    self.stats.inactive_split_bytes.decrease(kind, size as i64);
                } else {
                    let rs = self.block(rem).size as i64;
                    self.stats.inactive_split_bytes.increase(kind, rs);
                    self.stats.inactive_split.increase(kind, 1);
                }
            }
            id = fid;
        } else if already_split && !expandable {
            let bs = self.block(id).size as i64;
            self.stats.inactive_split_bytes.decrease(kind, bs);
            self.stats.inactive_split.decrease(kind, 1);
        }
        let b = self.block_mut(id);
        b.allocated = true;
        b.requested_size = orig_size;
        let (ptr, bsize, stream) = (b.ptr, b.size, b.stream);
        self.active.insert(ptr, id);
        let st = &mut self.stats;
        st.allocation.increase(kind, 1);
        st.allocated_bytes.increase(kind, bsize as i64);
        st.active.increase(kind, 1);
        st.active_bytes.increase(kind, bsize as i64);
        st.requested_bytes.increase(kind, orig_size as i64);
        if bsize >= self.config.max_split_size {
            st.oversize_allocations.increase(1);
        }
        Allocation {
            ptr: DeviceAddr(ptr),
            size: orig_size,
            block_size: bsize,
            stream,
        }
    }

    // ---- free ------------------------------------------------------------------------------

    pub(crate) fn free<B: DeviceBackend>(&mut self, dev: &B, ptr: DeviceAddr) -> Result<()> {
        if ptr.is_null() {
            return Ok(());
        }
        let Some(id) = self.active.remove(&ptr.0) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        if self.block(id).exported {
            self.unexport(dev, id);
        }
        let max_split = self.config.max_split_size;
        let b = self.block_mut(id);
        b.allocated = false;
        let (kind, size) = (b.pool, b.size);
        let has_uses = !b.stream_uses.is_empty();
        self.stats.allocation.decrease(kind, 1);
        self.stats.allocated_bytes.decrease(kind, size as i64);
        if size >= max_split {
            self.stats.oversize_allocations.decrease(1);
        }
        if has_uses && self.capture_underway() {
            // Events recorded now could not be queried until the capture ends: wait for that
            // (PyTorch's deferred blocks). The block stays active until then.
            self.graph.deferred.push(id);
            self.await_block(id);
            Ok(())
        } else if has_uses {
            let r = self.insert_events(dev, id);
            // Still waiting, unless every stream was waited for on the spot.
            let b = self.block(id);
            if !b.allocated && (b.event_count > 0 || !b.stream_uses.is_empty()) {
                self.await_block(id);
            }
            r
        } else {
            self.free_block(id);
            Ok(())
        }
    }

    /// Marks freed block `id` as waiting for other streams' work after its free returned.
    fn await_block(&mut self, id: BlockId) {
        self.block_mut(id).awaited = true;
        self.last_free_awaited = true;
    }

    /// Tells the segment observer of the awaited frees that completed since the last call.
    pub(crate) fn tell_completed_frees<B: DeviceBackend>(&mut self, dev: &B) {
        for (ptr, size, stream, owner) in std::mem::take(&mut self.completed_frees) {
            self.segment_event(dev, SegmentAction::FreeCompleted, ptr, size, stream, owner);
        }
    }

    /// Whether the allocated block at `ptr` touches a free cached block and would, freed and
    /// merged with its free neighbours, make a free block of at least `need` bytes (the fast
    /// path's Note [Cached blocks next to free memory]).
    pub(crate) fn touches_free_block(&self, ptr: u64, need: usize) -> bool {
        let Some(b) = self.active.get(&ptr).and_then(|&id| self.arena.get(id)) else {
            return false;
        };
        let mut merged = b.size;
        let mut touches = false;
        for n in [b.prev, b.next].into_iter().flatten() {
            if let Some(free) = self.arena.get(n).filter(|f| f.mapped) {
                if self.allocatable(n) {
                    touches = true;
                    merged = merged.saturating_add(free.size);
                }
            }
        }
        touches && merged >= need
    }

    fn classify_bad_pointer(&self, ptr: DeviceAddr) -> AllocError {
        let seg = self
            .segments
            .range(..=ptr.0)
            .next_back()
            .filter(|(base, s)| ptr.0 < **base + s.size as u64);
        let Some((&base, _)) = seg else {
            return AllocError::UnknownPointer { ptr };
        };
        let is_block_start = self
            .arena
            .iter()
            .any(|(_, b)| b.ptr == ptr.0 && !b.allocated);
        if is_block_start {
            AllocError::DoubleFree { ptr }
        } else {
            AllocError::InteriorPointer {
                ptr,
                segment: DeviceAddr(base),
            }
        }
    }

    /// Returns a no-longer-used block to its pool, merging with free neighbours.
    fn free_block(&mut self, id: BlockId) {
        let (orig_size, requested, kind, prev, next) = {
            let b = self.block_mut(id);
            let awaited = std::mem::take(&mut b.awaited);
            let told = (b.ptr, b.requested_size, b.stream, b.owner);
            let sizes = (b.size, b.requested_size, b.pool, b.prev, b.next);
            if awaited && self.segment_observer.0.is_some() {
                self.completed_frees.push(told);
            }
            sizes
        };
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        for cand in [prev, next] {
            let subsumed = self.try_merge_blocks(id, cand);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.stamp_free(id);
        self.cache_block(id);
        let b = self.block(id);
        let (split, expandable, size) = (b.is_split(), b.expandable, b.size);
        if split {
            net_blocks += 1;
            net_bytes += size as i64;
        }
        let st = &mut self.stats;
        if !expandable {
            if net_blocks > 0 {
                st.inactive_split.increase(kind, net_blocks);
            } else if net_blocks < 0 {
                st.inactive_split.decrease(kind, -net_blocks);
            }
            if net_bytes > 0 {
                st.inactive_split_bytes.increase(kind, net_bytes);
            } else if net_bytes < 0 {
                st.inactive_split_bytes.decrease(kind, -net_bytes);
            }
        }
        st.active.decrease(kind, 1);
        st.active_bytes.decrease(kind, orig_size as i64);
        st.requested_bytes.decrease(kind, requested as i64);
    }

    /// Merges free neighbour `src` into `dst`; returns the bytes absorbed (0 if no merge).
    fn try_merge_blocks(&mut self, dst: BlockId, src: Option<BlockId>) -> usize {
        let Some(src) = src else { return 0 };
        // Read what the merge needs without cloning the block (its `stream_uses` is a Vec).
        let (dst_mapped, dst_lent) = {
            let d = self.block(dst);
            (d.mapped, d.lent)
        };
        let s = self.block(src);
        if s.allocated
            || s.event_count > 0
            || !s.stream_uses.is_empty()
            || s.mapped != dst_mapped
            || s.lent
            || dst_lent
        {
            return 0;
        }
        let (s_ptr, s_size, s_prev, s_next, s_stream, s_pool, s_mapped, s_stamp) = (
            s.ptr,
            s.size,
            s.prev,
            s.next,
            s.stream,
            s.pool,
            s.mapped,
            s.free_stamp,
        );
        if s_mapped {
            self.uncache_free_block(src);
        } else {
            self.pool(s_pool).unmapped.remove(&(s_stream, s_ptr, src));
        }
        let d = self.block_mut(dst);
        if d.prev == Some(src) {
            d.ptr = s_ptr;
            d.prev = s_prev;
            if let Some(p) = s_prev {
                self.block_mut(p).next = Some(dst);
            }
        } else {
            d.next = s_next;
            if let Some(n) = s_next {
                self.block_mut(n).prev = Some(dst);
            }
        }
        let d = self.block_mut(dst);
        d.size += s_size;
        d.free_stamp = d.free_stamp.max(s_stamp);
        self.arena.remove(src);
        s_size
    }

    // ---- streams and events ----------------------------------------------------------------

    /// Checks `stream` with the device the first time the cache meets it, and remembers it.
    ///
    /// # Errors
    /// [`AllocError::InvalidStream`] when the device rejects it (nothing changes).
    pub(crate) fn admit_stream<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
    ) -> Result<()> {
        if !self.known_streams.contains(&stream) {
            dev.validate_stream(stream)
                .map_err(|source| AllocError::InvalidStream { stream, source })?;
            self.known_streams.push(stream);
        }
        Ok(())
    }

    pub(crate) fn record_stream(&mut self, ptr: DeviceAddr, stream: StreamId) -> Result<()> {
        let Some(&id) = self.active.get(&ptr.0) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        self.add_stream_use(id, stream);
        Ok(())
    }

    /// Lists `stream` among allocated block `id`'s uses (unless it is the block's own stream):
    /// its free then records an event there and the block waits for it.
    fn add_stream_use(&mut self, id: BlockId, stream: StreamId) {
        let b = self.block_mut(id);
        if stream != b.stream && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
    }

    fn get_event<B: DeviceBackend>(
        &mut self,
        dev: &B,
    ) -> std::result::Result<EventHandle, BackendError> {
        match self.event_pool.pop() {
            Some(e) => Ok(e),
            None => dev.create_event(),
        }
    }

    /// Records an event on every stream that used the block; the block becomes free when all
    /// have completed. Where an event cannot be recorded, waits for that stream instead (then
    /// for the whole device); where that fails too, the stream stays in the block's
    /// `stream_uses` and the block in `unsynced`, out of the cache, until a later attempt
    /// succeeds (never back in the pool while that stream may still use it).
    fn insert_events<B: DeviceBackend>(&mut self, dev: &B, id: BlockId) -> Result<()> {
        let uses = std::mem::take(&mut self.block_mut(id).stream_uses);
        let mut first_err = None;
        let mut unsynced = Vec::new();
        for s in uses {
            let recorded = match self.get_event(dev) {
                Ok(ev) => match dev.record_event(ev, s) {
                    Ok(()) => {
                        self.pending_events
                            .entry(s)
                            .or_default()
                            .push_back((ev, id));
                        self.block_mut(id).event_count += 1;
                        true
                    }
                    Err(_) => {
                        self.event_pool.push(ev);
                        false
                    }
                },
                Err(_) => false,
            };
            if recorded {
                continue;
            }
            // A context synchronize covers every stream when the stream's own wait fails.
            if let Err(source) = dev.synchronize_stream(s).or_else(|_| dev.synchronize()) {
                first_err.get_or_insert(AllocError::Backend {
                    operation: "synchronize",
                    source,
                });
                unsynced.push(s);
            }
        }
        let b = self.block_mut(id);
        b.stream_uses = unsynced;
        if !b.stream_uses.is_empty() {
            if !self.unsynced.contains(&id) {
                self.unsynced.push(id);
            }
        } else if b.event_count == 0 {
            self.free_block(id);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Tries again to fence or wait for the streams of the `unsynced` blocks.
    fn retry_unsynced<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let mut first_err = None;
        for id in std::mem::take(&mut self.unsynced) {
            // A block that fails again puts itself back.
            if let Err(e) = self.insert_events(dev, id) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn complete_event(&mut self, ev: EventHandle, id: BlockId) {
        self.event_pool.push(ev);
        let b = self.block_mut(id);
        b.event_count -= 1;
        if b.event_count == 0 && b.stream_uses.is_empty() {
            self.free_block(id);
        }
    }

    /// Whether any mapped block belongs to `stream`, any lent block does whose old uses were
    /// pending when it was lent (not an idle move whose unmap is left to the helper: Note [Unmaps
    /// off the allocating thread]), any block lists it in its `stream_uses`, or an event recorded
    /// on it is outstanding (see `CachingAllocator::forget_stream`).
    pub(crate) fn stream_referenced(&self, stream: StreamId) -> bool {
        self.pending_events.contains_key(&stream)
            || self.arena.iter().any(|(id, b)| {
                // An idle move's old range is as good as unmapped (Note [Unmaps off the
                // allocating thread]): its uses are complete, only the helper's unmap is left.
                ((b.mapped || (b.lent && !self.unmapped_or_moving(id))) && b.stream == stream)
                    || b.stream_uses.contains(&stream)
            })
    }

    /// Drops `stream` from the validated streams (the next allocation on it validates it again).
    pub(crate) fn forget_known_stream(&mut self, stream: StreamId) {
        self.known_streams.retain(|&s| s != stream);
    }

    /// Frees blocks whose events completed; per stream, stops at the first pending event.
    pub(crate) fn process_events<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let r = self.complete_events(dev);
        self.tell_completed_frees(dev);
        r
    }

    fn complete_events<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        // A block whose stream could be neither fenced nor waited for stays parked (out of the
        // cache) when the retry fails again; the allocation that retried goes on, since its
        // request has nothing to do with that stream (`empty_cache` and the out-of-memory
        // release still report the failure).
        if !self.unsynced.is_empty() {
            if let Err(e) = self.retry_unsynced(dev) {
                tracing::warn!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, parked = self.unsynced.len(), "a freed block's stream could still not be fenced or synchronized; the block stays out of the cache");
            }
        }
        let streams: Vec<StreamId> = self.pending_events.keys().copied().collect();
        for s in streams {
            while let Some(&(ev, id)) = self.pending_events.get(&s).and_then(|q| q.front()) {
                match dev.query_event(ev) {
                    Ok(true) => {
                        if let Some(q) = self.pending_events.get_mut(&s) {
                            q.pop_front();
                        }
                        self.complete_event(ev, id);
                    }
                    Ok(false) => break,
                    Err(source) => {
                        return Err(AllocError::Backend {
                            operation: "query_event",
                            source,
                        });
                    }
                }
            }
            if self.pending_events.get(&s).is_some_and(VecDeque::is_empty) {
                self.pending_events.remove(&s);
            }
        }
        Ok(())
    }

    fn synchronize_and_free_events<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let r = self.wait_for_all_events(dev);
        self.tell_completed_frees(dev);
        r
    }

    fn wait_for_all_events<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        self.stats.num_sync_all_streams += 1;
        if !self.unsynced.is_empty() {
            self.retry_unsynced(dev)?;
        }
        while let Some((&s, _)) = self.pending_events.first_key_value() {
            while let Some(&(ev, id)) = self.pending_events.get(&s).and_then(|q| q.front()) {
                dev.synchronize_event(ev)
                    .map_err(|source| AllocError::Backend {
                        operation: "synchronize_event",
                        source,
                    })?;
                if let Some(q) = self.pending_events.get_mut(&s) {
                    q.pop_front();
                }
                self.complete_event(ev, id);
            }
            self.pending_events.remove(&s);
        }
        Ok(())
    }

    /// Tells the segment observer, if one is set, that `action` happened to `[addr, addr +
    /// size)` of a segment of `stream` owned by private-pool slot `owner` (0: the default pools).
    pub(crate) fn segment_event<B: DeviceBackend>(
        &mut self,
        dev: &B,
        action: SegmentAction,
        addr: u64,
        size: usize,
        stream: StreamId,
        owner: u32,
    ) {
        let Some(observer) = &self.segment_observer.0 else {
            return;
        };
        // While the thread unwinds (an allocator dropped during a panic), a second panic in the
        // observer would abort: nothing is told then.
        if std::thread::panicking() {
            return;
        }
        let event = SegmentEvent {
            action,
            device: dev.device_index(),
            addr: DeviceAddr(addr),
            size,
            stream,
            pool: self.graph.id_of(owner),
        };
        // An observer that panics must not unwind through the cache's bookkeeping: it is dropped
        // (no more events) and the cache goes on.
        let told = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| observer(&event)));
        if told.is_err() {
            tracing::error!(target: "cuda_caching_allocator", device = event.device, action = ?event.action, "the segment observer panicked; it is removed");
            self.segment_observer = ObserverSlot(None);
        }
    }

    // ---- releasing cache -------------------------------------------------------------------

    /// Returns one whole free segment to the device. On a device error the block stays cached.
    fn release_block<B: DeviceBackend>(&mut self, dev: &B, id: BlockId) -> Result<()> {
        let b = self.block(id).clone();
        debug_assert!(!b.is_split() && !b.allocated && !b.expandable);
        // Before the free, as PyTorch records SEGMENT_FREE: an observer that registered the
        // segment elsewhere (NCCL) deregisters it while the memory is still there.
        self.segment_event(dev, SegmentAction::Free, b.ptr, b.size, b.stream, b.owner);
        if let Err(source) = device_calls::free_segment(dev, DeviceAddr(b.ptr), b.size, b.stream) {
            // The segment stays cached: an observer told of its free hears of it again.
            self.segment_event(dev, SegmentAction::Alloc, b.ptr, b.size, b.stream, b.owner);
            return Err(AllocError::Backend {
                operation: "free",
                source,
            });
        }
        self.stats.num_device_free += 1;
        self.total_allocated_memory -= b.size;
        self.cap_grace = self.cap_grace.min(self.total_allocated_memory);
        self.stats.segment.decrease(b.pool, 1);
        self.handles.decrease(1);
        self.stats.reserved_bytes.decrease(b.pool, b.size as i64);
        if b.size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.uncache_free_block(id);
        if let Some(p) = self.graph.pools.get_mut(&b.owner) {
            p.segments -= 1;
        }
        self.arena.remove(id);
        self.segments.remove(&b.ptr);
        if let Some(h) = &mut self.history {
            h.segment_free(DeviceAddr(b.ptr), b.size, b.stream);
        }
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), ptr = %DeviceAddr(b.ptr), size = b.size, "segment released");
        Ok(())
    }

    fn release_all<B: DeviceBackend>(&mut self, dev: &B, ids: &[BlockId]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        // Obligation 2 of `free`: no queued work may still use a released segment.
        dev.synchronize().map_err(|source| AllocError::Backend {
            operation: "synchronize",
            source,
        })?;
        for &id in ids {
            self.release_block(dev, id)?;
        }
        Ok(())
    }

    /// Whole free (unsplit, non-expandable) blocks of a pool, in free-set order.
    fn releasable(&self, kind: PoolKind) -> Vec<BlockId> {
        self.pool_ref(kind)
            .blocks
            .iter()
            .filter(|k| {
                let b = self.block(k.id);
                !b.is_split() && !b.expandable
            })
            .map(|k| k.id)
            .collect()
    }

    /// `release_cached_blocks`: drain events, then, per pool (large first), free every whole
    /// free segment and unmap the free pages of expandable segments (dropping those left wholly
    /// unmapped); finally release spare physical pages.
    pub(crate) fn release_cached_blocks<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        if self.capture_underway() {
            return Err(AllocError::CaptureUnderway {
                operation: "releasing cached memory (empty_cache)",
            });
        }
        self.insert_deferred_events(dev)?;
        self.synchronize_and_free_events(dev)?;
        // Nothing may be released while mapped where it was lent from (Note [Lent pages]).
        self.settle_lent(dev, true)?;
        let mut released = 0usize;
        for kind in [PoolKind::Large, PoolKind::Small] {
            let ids = self.releasable(kind);
            released += ids.len();
            self.release_all(dev, &ids)?;
            self.release_expandable_blocks(dev, kind)?;
        }
        self.release_spare_pages(dev)?;
        self.release_freeable_pools(dev)?;
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), segments = released, "cache flushed");
        Ok(())
    }

    /// With `max_split_size` set: free one cached oversize block that fits, else oversize blocks
    /// from the largest down until enough bytes were released.
    fn release_available_cached_blocks<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
    ) -> Result<bool> {
        let max_split = self.config.max_split_size;
        if max_split == usize::MAX {
            return Ok(false);
        }
        let key_size = size.max(max_split);
        let search = FreeKey::search(stream, key_size);
        let pool = self.pool_ref(kind);
        if let Some(k) = pool.blocks.range(search..).next() {
            let b = self.block(k.id);
            if k.stream == stream && !b.expandable && !b.is_split() {
                let id = k.id;
                self.release_all(dev, &[id])?;
                return Ok(true);
            }
        }
        let mut released = 0usize;
        let mut ids = Vec::new();
        for k in pool.blocks.range(..search).rev() {
            if released >= key_size || k.size < max_split || k.stream != stream {
                break;
            }
            let b = self.block(k.id);
            if !b.expandable && !b.is_split() {
                ids.push(k.id);
                released += k.size;
            }
        }
        self.release_all(dev, &ids)?;
        Ok(released >= key_size)
    }

    /// Age-based GC of whole cached large blocks once reserved memory passes
    /// `garbage_collection_threshold × cap`.
    fn garbage_collect_cached_blocks<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let Some(allowed) = self.allowed_memory_maximum else {
            return Ok(());
        };
        let threshold = (self.config.garbage_collection_threshold * allowed as f64) as usize;
        if self.total_allocated_memory <= threshold {
            return Ok(());
        }
        let target = self.total_allocated_memory - threshold;
        let now = self.large.get_free_blocks_call_count;
        let age = |b: &Block| now - b.gc_count_base;
        let mut total_age: u64 = 0;
        let mut count: u64 = 0;
        for k in &self.large.blocks {
            let b = self.block(k.id);
            if !b.is_split() {
                total_age += age(b);
                count += 1;
            }
        }
        if count == 0 {
            return Ok(());
        }
        let mut reclaimed = 0usize;
        let mut freed_any = true;
        while reclaimed < target && freed_any && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed_any = false;
            let mut ids = Vec::new();
            for k in &self.large.blocks {
                let b = self.block(k.id);
                if !b.is_split() && !b.expandable && age(b) as f64 >= threshold_age {
                    ids.push(k.id);
                    freed_any = true;
                    reclaimed += b.size;
                    total_age -= age(b);
                    count -= 1;
                }
            }
            self.release_all(dev, &ids)?;
        }
        Ok(())
    }

    // ---- out of memory ---------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn out_of_memory<B: DeviceBackend>(
        &mut self,
        dev: &B,
        orig_size: usize,
        size: usize,
        alloc_size: usize,
        stream: StreamId,
        kind: PoolKind,
        owner: u32,
    ) -> AllocError {
        self.stats.num_ooms += 1;
        let info = dev.mem_info().unwrap_or_default();
        // The pools the request was served from (a private pool's, when it was routed to one):
        // their free bytes, the largest free block, and of those bytes the ones the request
        // could use (its stream's, in its size class) with their largest block.
        let sets = match owner {
            0 => Some((&self.small, &self.large)),
            _ => self.graph.pools.get(&owner).map(|p| (&p.small, &p.large)),
        };
        let (mut pool_free, mut largest, mut usable, mut largest_on_stream) = (0, 0, 0, 0);
        if let Some((small, large)) = sets {
            for (set, k) in [(PoolKind::Small, small), (PoolKind::Large, large)]
                .into_iter()
                .flat_map(|(set, p)| p.blocks.iter().map(move |k| (set, k)))
            {
                pool_free += k.size;
                largest = largest.max(k.size);
                if set == kind && k.stream == stream {
                    usable += k.size;
                    largest_on_stream = largest_on_stream.max(k.size);
                }
            }
        }
        // The least the device must hold for the request: its segment, or for a growth of an
        // expandable segment the whole pages the block covers (not the segment size).
        let least = if owner == 0 && self.expandable {
            size.next_multiple_of(crate::size_class::expandable_page_size(kind, &self.config))
        } else {
            alloc_size
        };
        // With `throw_on_cudamalloc_oom` a request the cap refused fails without the release
        // chain: the free cached bytes were not released, so they are no cause of their own.
        let chain_skipped =
            self.cap_rejected && self.config.throw_on_cudamalloc_oom && !self.capture_underway();
        let cap_stopped = self.cap_stopped(owner, size, least, info.free);
        let verdict = if info.total > 0 && least > info.total {
            OomVerdict::LargerThanDevice
        } else if chain_skipped && cap_stopped {
            OomVerdict::FractionCapReached
        } else if pool_free >= size {
            if usable >= size {
                OomVerdict::Fragmented
            } else {
                OomVerdict::CachedForOtherStreams
            }
        } else if cap_stopped {
            OomVerdict::FractionCapReached
        } else {
            OomVerdict::DeviceFull
        };
        let report = OomReport {
            device: dev.device_index(),
            requested_bytes: orig_size,
            rounded_bytes: size,
            segment_bytes: alloc_size,
            stream,
            device_total: info.total,
            device_free: info.free,
            limit_bytes: self.allowed_memory_maximum,
            allocated_bytes: self.stats.memory_allocated() as usize,
            reserved_bytes: self.total_allocated_memory,
            private_pool_free_bytes: self
                .graph
                .pools
                .values()
                .flat_map(|p| p.small.blocks.iter().chain(p.large.blocks.iter()))
                .map(|k| k.size)
                .sum(),
            largest_free_block: largest,
            largest_free_block_on_stream: largest_on_stream,
            external_fragmentation: if pool_free == 0 {
                0.0
            } else {
                1.0 - largest as f64 / pool_free as f64
            },
            expandable_segments: self.expandable,
            verdict,
        };
        tracing::warn!(target: "cuda_caching_allocator", device = report.device, requested = orig_size, segment = alloc_size, verdict = ?verdict, "out of memory");
        AllocError::OutOfMemory(Box::new(report))
    }

    /// Whether the fraction cap, and not the device, stopped the last attempt: the cap refused
    /// it (or, for an expandable request, the request alone exceeds the cap) while the device
    /// had room for what the attempt needed (`least`: what the device must hold for the
    /// request, as the report computes it). Where both stop it, raising the fraction cannot
    /// help, so the device is the verdict.
    fn cap_stopped(&self, owner: u32, size: usize, least: usize, device_free: usize) -> bool {
        let Some(max) = self.allowed_memory_maximum else {
            return false;
        };
        let refused = if self.cap_rejected {
            Some(self.cap_refused_bytes)
        } else if owner == 0 && self.expandable && size > max {
            // `cannot_fit` refuses such a request before any growth is tried.
            Some(least)
        } else {
            None
        };
        refused.is_some_and(|need| device_free >= need)
    }

    // ---- teardown --------------------------------------------------------------------------

    /// Destroys pooled events (allocator drop).
    pub(crate) fn destroy_events<B: DeviceBackend>(&mut self, dev: &B) {
        self.destroy_fence_events(dev);
        for ev in self.event_pool.drain(..) {
            let _ = device_calls::destroy_event(dev, ev);
        }
    }
}

#[cold]
fn unreachable_block(id: BlockId) -> ! {
    // A dangling BlockId is a bug in this module; the invariant checker reports it in tests.
    unreachable!("dangling block id {id:?}")
}
