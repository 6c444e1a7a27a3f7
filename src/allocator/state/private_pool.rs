//! Private pools for CUDA-graph capture (`docs/algorithm.md`, steps 28–32): PyTorch's
//! `PrivatePool`, `beginAllocateToPool` / `endAllocateToPool` / `releasePool`,
//! `captures_underway` and `deferred_blocks`. May use: `state`, `block`, `pool`, `backend`.
//!
//! Note [Private pools]: a captured graph replays the addresses it was captured with, so the
//! blocks it allocated must never be handed to anyone else while the graph may be replayed. While
//! a *routing* is active (`begin_allocate_to_pool(id, filter)` until `end_allocate_to_pool(id)`),
//! every allocation whose stream the filter accepts (the newest routing first, as PyTorch scans
//! its list from the back) is served from the private pool `id`: its own small and large free
//! sets, fed by segments allocated for it. A block keeps its pool for life: its free (during the
//! capture or after it) returns it to that pool, and the pool's blocks are served only to
//! allocations routed to it. A pool lives while its use count is above 0 (each routing into it
//! and each `create_pool` adds one, each `release_pool` takes one away); at 0 it is *freeable*,
//! and the next `release_cached_blocks` (empty_cache, or the OOM path outside a capture) returns
//! its wholly free segments to the device, forgetting the pool once it holds none.
//!
//! Private pools always use fixed segments (one `allocate` per segment), also when expandable
//! segments are on: their memory is then never unmapped, moved by page reuse or handed to another
//! stream, which keeps every default-pool mechanism away from them by construction (the default
//! pools' free sets, which those mechanisms walk, never hold a private block).
//!
//! Note [Capture underway]: while any routing is active (PyTorch's `captures_underway` is not
//! empty), queries and synchronizations would invalidate the capture or return garbage, so the
//! cache makes none: `process_events` is skipped, frees of blocks with recorded stream uses are
//! deferred (their events are recorded once no capture is underway), no cached memory is released
//! (garbage collection, `release_available_cached_blocks` and `release_cached_blocks` are skipped
//! on the OOM path, and `empty_cache` is refused), no cross-stream handover and no page reuse run.
//! Device allocations still happen; the backend makes them in relaxed capture mode.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use super::State;
use crate::allocator::block::BlockId;
use crate::allocator::pool::BlockPool;
use crate::backend::{DeviceBackend, StreamId};
use crate::error::{AllocError, Result};
use crate::size_class::PoolKind;

/// A memory pool id: PyTorch's `MempoolId_t`, a pair of numbers. `(0, 0)` is the default pool;
/// pools a graph makes for itself are `(n, 0)` ([`MemPoolId::new_graph`]), pools made by users
/// `(0, n)` ([`MemPoolId::new_user`], PyTorch's `graph_pool_handle()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct MemPoolId(pub u64, pub u64);

static NEXT_GRAPH_POOL: AtomicU64 = AtomicU64::new(1);
static NEXT_USER_POOL: AtomicU64 = AtomicU64::new(1);

impl MemPoolId {
    /// The default pool, `(0, 0)`: never a private pool.
    pub const DEFAULT: MemPoolId = MemPoolId(0, 0);

    /// A fresh id of the form `(n, 0)`, unique in this process (PyTorch's per-graph pools).
    pub fn new_graph() -> Self {
        MemPoolId(NEXT_GRAPH_POOL.fetch_add(1, Ordering::Relaxed), 0)
    }

    /// A fresh id of the form `(0, n)`, unique in this process (PyTorch's
    /// `torch.cuda.graph_pool_handle()`), for pools shared by several captures.
    pub fn new_user() -> Self {
        MemPoolId(0, NEXT_USER_POOL.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether this is the default pool `(0, 0)`.
    pub fn is_default(self) -> bool {
        self == MemPoolId::DEFAULT
    }
}

impl fmt::Display for MemPoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// Decides which streams' allocations a routing sends to its private pool. It runs under the
/// allocator's lock, for every allocation while any routing is active: keep it cheap and never
/// call back into the allocator.
pub type PoolFilter = Box<dyn Fn(StreamId) -> bool + Send + Sync>;

/// A [`PoolFilter`] accepting the streams `backend` reports as capturing into `capture_id`
/// ([`DeviceBackend::stream_capture_id`]; a failed query counts as capturing, so that a
/// captured allocation never takes a block eager work could get back while the graph still
/// uses it: at worst an eager one lands in the pool). Pass a
/// cheap handle (`Arc<CudaDevice>`, `&'static SimDevice`). `begin_allocate_to_capture` does the
/// same without needing a handle of its own.
pub fn capture_filter<D: DeviceBackend + 'static>(backend: D, capture_id: u64) -> PoolFilter {
    Box::new(move |stream| {
        backend
            .stream_capture_id(stream)
            .map_or(true, |c| c == Some(capture_id))
    })
}

/// How a routing picks its streams.
enum RouteFilter {
    /// A caller's filter.
    Streams(PoolFilter),
    /// The streams the backend reports as capturing into this capture id (the capture's origin
    /// stream and every stream joined into it).
    Capture(u64),
}

/// One active routing (an entry of PyTorch's `captures_underway`).
struct Route {
    id: MemPoolId,
    slot: u32,
    filter: RouteFilter,
}

/// One private pool: its free sets and how many segments it holds.
#[derive(Debug, Default)]
pub(crate) struct PrivatePool {
    pub(crate) id: MemPoolId,
    /// Routings into it plus `create_pool` calls, minus `release_pool` calls.
    pub(crate) use_count: u32,
    /// Segments allocated for it and not yet released (PyTorch's `cudaMalloc_count`).
    pub(crate) segments: usize,
    pub(crate) small: BlockPool,
    pub(crate) large: BlockPool,
    /// PyTorch's `use_on_oom`: an allocation of the default pools about to fail with out of
    /// memory may take a free block of this pool (Note [Pools used on out of memory]).
    pub(crate) use_on_oom: bool,
    /// PyTorch's `no_split_pools`: a block of this pool is never split (Note [No-split pools]).
    pub(crate) no_split: bool,
}

impl PrivatePool {
    pub(crate) fn set(&mut self, kind: PoolKind) -> &mut BlockPool {
        match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    pub(crate) fn set_ref(&self, kind: PoolKind) -> &BlockPool {
        match kind {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }
}

/// The private pools of one allocator and the routings into them.
#[derive(Default)]
pub(crate) struct GraphPools {
    /// Pools by slot (the `owner` their blocks carry; slot 0 is the default pools).
    pub(crate) pools: BTreeMap<u32, PrivatePool>,
    ids: BTreeMap<MemPoolId, u32>,
    last_slot: u32,
    /// Active routings, oldest first.
    routes: Vec<Route>,
    /// Blocks freed during a capture with recorded stream uses: their events are recorded once
    /// no capture is underway (PyTorch's `needs_events_deferred_until_no_capture`).
    pub(crate) deferred: Vec<BlockId>,
}

impl fmt::Debug for GraphPools {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPools")
            .field("pools", &self.pools)
            .field(
                "routes",
                &self.routes.iter().map(|r| r.id).collect::<Vec<_>>(),
            )
            .field("deferred", &self.deferred)
            .finish()
    }
}

impl GraphPools {
    /// Whether any routing is active (PyTorch: `!captures_underway.empty()`).
    pub(crate) fn routing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// The slot of pool `id`.
    pub(crate) fn slot_of(&self, id: MemPoolId) -> Option<u32> {
        self.ids.get(&id).copied()
    }

    /// The slots the active routings route to, oldest first.
    pub(crate) fn routed_slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.routes.iter().map(|r| r.slot)
    }

    /// Whether `id` is the pool of slot `slot` in the id index.
    pub(crate) fn indexed(&self, id: MemPoolId, slot: u32) -> bool {
        self.ids.get(&id) == Some(&slot) && self.ids.len() == self.pools.len()
    }

    /// The pool id of slot `slot` (the default pool for 0).
    pub(crate) fn id_of(&self, slot: u32) -> MemPoolId {
        self.pools.get(&slot).map_or(MemPoolId::DEFAULT, |p| p.id)
    }

    /// The use count of pool `id`, when it exists.
    pub(crate) fn use_count(&self, id: MemPoolId) -> Option<u32> {
        self.pools.get(&self.slot_of(id)?).map(|p| p.use_count)
    }

    fn next_slot(&mut self) -> Option<u32> {
        let slot = self.last_slot.checked_add(1)?;
        self.last_slot = slot;
        Some(slot)
    }
}

fn invalid(pool: MemPoolId, reason: &'static str) -> AllocError {
    AllocError::InvalidPool { pool, reason }
}

impl State {
    /// Whether a capture is underway: any routing to a private pool is active.
    pub(crate) fn capture_underway(&self) -> bool {
        self.graph.routing()
    }

    /// The private pool an allocation on `stream` goes to now (`route`), or `None` for the
    /// default pools.
    pub(crate) fn routed_pool<B: DeviceBackend>(
        &self,
        dev: &B,
        stream: StreamId,
    ) -> Option<MemPoolId> {
        if !self.capture_underway() {
            return None;
        }
        // A failed capture query: no pool to name (an allocation would fail).
        let slot = self.route(dev, stream).unwrap_or(0);
        (slot != 0).then(|| self.graph.id_of(slot))
    }

    /// The private pool whose memory the live allocation at `ptr` is (`None`: the default pools,
    /// or no live allocation starts there).
    pub(crate) fn pool_of_allocation(&self, ptr: u64) -> Option<MemPoolId> {
        let &id = self.active.get(&ptr)?;
        let owner = self.arena.get(id)?.owner;
        (owner != 0).then(|| self.graph.id_of(owner))
    }

    /// The free set that block owner `owner` (0: the default pools) keeps for `kind`.
    pub(super) fn free_set(&mut self, owner: u32, kind: PoolKind) -> Option<&mut BlockPool> {
        if owner == 0 {
            Some(self.pool(kind))
        } else {
            self.graph.pools.get_mut(&owner).map(|p| p.set(kind))
        }
    }

    /// The pool an allocation on `stream` goes to: the slot of the newest routing whose filter
    /// accepts the stream, or 0 (the default pools).
    ///
    /// # Errors
    /// A failed capture query of a capture routing: the allocation fails (PyTorch's filter
    /// checks `cudaStreamGetCaptureInfo` the same way). Counted as "not capturing", a captured
    /// allocation took a block of the default pools, which eager work got back after the
    /// capture while every replay of the graph still wrote it.
    pub(super) fn route<B: DeviceBackend>(&self, dev: &B, stream: StreamId) -> Result<u32> {
        for r in self.graph.routes.iter().rev() {
            let hit = match &r.filter {
                RouteFilter::Streams(f) => f(stream),
                RouteFilter::Capture(id) => {
                    dev.stream_capture_id(stream)
                        .map_err(|source| AllocError::Backend {
                            operation: "stream_capture_id",
                            source,
                        })?
                        == Some(*id)
                }
            };
            if hit {
                return Ok(r.slot);
            }
        }
        Ok(0)
    }

    /// PyTorch's `createOrIncrefPool`: makes pool `id` with a use count of 1, or adds one use.
    pub(crate) fn create_or_incref_pool(&mut self, id: MemPoolId) -> Result<u32> {
        if id.is_default() {
            return Err(invalid(
                id,
                "(0, 0) is the default pool and cannot be used as a private pool; use MemPoolId::new_graph() or MemPoolId::new_user()",
            ));
        }
        if let Some(slot) = self.graph.slot_of(id) {
            let Some(p) = self.graph.pools.get_mut(&slot) else {
                return Err(invalid(id, "the pool's record is missing"));
            };
            if p.use_count == 0 {
                return Err(invalid(
                    id,
                    "the pool was released and still holds memory; call empty_cache before using its id again",
                ));
            }
            p.use_count = p.use_count.saturating_add(1);
            return Ok(slot);
        }
        let Some(slot) = self.graph.next_slot() else {
            return Err(invalid(id, "too many private pools were made"));
        };
        self.graph.pools.insert(
            slot,
            PrivatePool {
                id,
                use_count: 1,
                ..PrivatePool::default()
            },
        );
        self.graph.ids.insert(id, slot);
        Ok(slot)
    }

    /// `beginAllocateToPool`: one more use of pool `id` (made if new), and a routing of the
    /// streams `filter` accepts into it. With `capture`, the filter is the backend's capture id.
    pub(crate) fn begin_allocate_to_pool(
        &mut self,
        id: MemPoolId,
        filter: Option<PoolFilter>,
        capture: Option<u64>,
    ) -> Result<()> {
        if self.graph.routes.iter().any(|r| r.id == id) {
            return Err(invalid(
                id,
                "allocations are already being routed to this pool; end that routing first",
            ));
        }
        let filter = match (filter, capture) {
            (Some(f), _) => RouteFilter::Streams(f),
            (None, Some(c)) => RouteFilter::Capture(c),
            (None, None) => return Err(invalid(id, "a routing needs a filter or a capture id")),
        };
        let slot = self.create_or_incref_pool(id)?;
        self.graph.routes.push(Route { id, slot, filter });
        Ok(())
    }

    /// `endAllocateToPool`: stops routing into pool `id`. When no routing is left, the frees
    /// deferred during the capture record their stream events.
    pub(crate) fn end_allocate_to_pool<B: DeviceBackend>(
        &mut self,
        dev: &B,
        id: MemPoolId,
    ) -> Result<()> {
        let Some(i) = self.graph.routes.iter().position(|r| r.id == id) else {
            return Err(invalid(
                id,
                "allocations are not being routed to this pool (end_allocate_to_pool without begin_allocate_to_pool)",
            ));
        };
        self.graph.routes.remove(i);
        if !self.capture_underway() {
            self.insert_deferred_events(dev)?;
        }
        Ok(())
    }

    /// PyTorch's `setUseOnOOM`: whether allocations of the default pools about to fail with out
    /// of memory may take free blocks of pool `id`.
    pub(crate) fn set_use_on_oom(&mut self, id: MemPoolId, on: bool) -> Result<()> {
        self.pool_mut(id)?.use_on_oom = on;
        Ok(())
    }

    /// The record of private pool `id`.
    fn pool_mut(&mut self, id: MemPoolId) -> Result<&mut PrivatePool> {
        let slot = self
            .graph
            .slot_of(id)
            .ok_or_else(|| invalid(id, "no such private pool"))?;
        self.graph
            .pools
            .get_mut(&slot)
            .ok_or_else(|| invalid(id, "the pool's record is missing"))
    }

    /// Note [Pools used on out of memory]: PyTorch's `try_mempool_fallback`. An allocation of
    /// the default pools (not routed to a private pool) whose first device allocation failed
    /// takes the best-fitting free block of its stream from the pools marked `use_on_oom` (in
    /// the order they were made, among those still in use), before any cached memory is
    /// released: PyTorch tries these pools "before expensive memory freeing operations", ahead
    /// of `release_available_cached_blocks` and `release_cached_blocks`. The block stays its
    /// pool's and goes back to it when freed. No new memory is made for it.
    pub(super) fn free_block_of_oom_pools(
        &mut self,
        stream: StreamId,
        size: usize,
        kind: PoolKind,
    ) -> Option<BlockId> {
        let slots: Vec<u32> = self
            .graph
            .pools
            .iter()
            .filter(|(_, p)| p.use_on_oom && p.use_count > 0)
            .map(|(&s, _)| s)
            .collect();
        slots
            .into_iter()
            .find_map(|slot| self.get_free_block(stream, size, kind, slot))
    }

    /// Note [No-split pools]: PyTorch's `setNoSplit` (`torch.cuda.MemPool(no_split=True)`, made
    /// for symmetric memory, where each allocation must own its segment: one signal pad per
    /// device allocation). A block of such a pool is handed out whole, never split: PyTorch's
    /// `should_split` answers false before its usual rules for a block whose pool is in
    /// `no_split_pools`, and that is its only effect. Rounding, segment sizes (a 4 MiB request
    /// still gets a 20 MiB segment, a 512-byte one a 2 MiB block), best fit, merging and release
    /// are unchanged, so a freed block serves a later smaller allocation of the pool whole, and
    /// the statistics count the whole block as allocated. A block of the pool taken on out of
    /// memory (Note [Pools used on out of memory]) is not split either, as in PyTorch, whose
    /// check follows the block's pool. A checkpoint restore cuts blocks as the checkpoint says
    /// (PyTorch's `setSegmentStateToCheckpoint` passes its own split flag too). The flag lives
    /// as long as the pool's record: PyTorch keeps the id in its set until the pool's last use
    /// is released; here the pool and its flag are forgotten together.
    pub(crate) fn set_no_split(&mut self, id: MemPoolId, on: bool) -> Result<()> {
        self.pool_mut(id)?.no_split = on;
        Ok(())
    }

    /// Whether blocks of private pool slot `owner` are never split (Note [No-split pools]).
    #[inline]
    pub(super) fn no_split(&self, owner: u32) -> bool {
        owner != 0 && self.graph.pools.get(&owner).is_some_and(|p| p.no_split)
    }

    /// `releasePool`: one use less. At 0 the pool is freeable: forgotten at once when it holds no
    /// segment, else its memory goes back at the next `release_cached_blocks`.
    pub(crate) fn release_pool(&mut self, id: MemPoolId) -> Result<()> {
        let Some(slot) = self.graph.slot_of(id) else {
            return Err(invalid(id, "no such private pool"));
        };
        // Each routing holds a use of its own (`create_or_incref_pool`): another use (a graph
        // reset while a second capture routes into the shared pool) may go, but not the
        // routings' own. Refusing every release while routed leaked that graph's use for good
        // (the interop's `GraphPool` gives its use back once, on drop).
        let routed = self.graph.routes.iter().filter(|r| r.id == id).count();
        let Some(p) = self.graph.pools.get_mut(&slot) else {
            return Err(invalid(id, "the pool's record is missing"));
        };
        if p.use_count == 0 {
            return Err(invalid(id, "the pool was released already"));
        }
        if (p.use_count as usize) <= routed {
            return Err(invalid(
                id,
                "allocations are still being routed to this pool; call end_allocate_to_pool first",
            ));
        }
        p.use_count -= 1;
        if p.use_count == 0 && p.segments == 0 {
            self.graph.pools.remove(&slot);
            self.graph.ids.remove(&id);
        }
        Ok(())
    }

    /// Records the stream events of the frees deferred during a capture.
    pub(super) fn insert_deferred_events<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let deferred = std::mem::take(&mut self.graph.deferred);
        let mut first_err = None;
        for id in deferred {
            if let Err(e) = self.insert_events(dev, id) {
                first_err.get_or_insert(e);
            }
        }
        // Blocks whose streams were waited for on the spot are back already.
        self.tell_completed_frees(dev);
        first_err.map_or(Ok(()), Err)
    }

    /// `release_cached_blocks` for the freeable private pools: their wholly free segments go back
    /// to the device; a pool left without segments is forgotten.
    pub(super) fn release_freeable_pools<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let freeable: Vec<u32> = self
            .graph
            .pools
            .iter()
            .filter(|(_, p)| p.use_count == 0)
            .map(|(&s, _)| s)
            .collect();
        for slot in freeable {
            let mut ids = Vec::new();
            if let Some(p) = self.graph.pools.get(&slot) {
                for kind in [PoolKind::Large, PoolKind::Small] {
                    for k in &p.set_ref(kind).blocks {
                        if self.arena.get(k.id).is_some_and(|b| !b.is_split()) {
                            ids.push(k.id);
                        }
                    }
                }
            }
            self.release_all(dev, &ids)?;
            if let Some(p) = self.graph.pools.get(&slot) {
                if p.segments == 0 {
                    let id = p.id;
                    self.graph.pools.remove(&slot);
                    self.graph.ids.remove(&id);
                }
            }
        }
        Ok(())
    }
}
