//! Expandable segments: PyTorch's `ExpandableSegment` and the block surgery around it
//! (`find_expandable_block`, `map_block`, `try_allocate_expandable_block`, `unmap_block`,
//! `release_blocks`, `release_expandable_segment` of PyTorch 2.11), plus this crate's page reuse.
//!
//! Note [Expandable segments]: one segment per (stream, pool) reserves a large virtual range
//! (`page × ceil(1.125 × device total / page)`) and grows by mapping physical pages, one
//! `create_physical` + `map` per page, 2 MiB pages in the small pool and `large_segment_size`
//! pages in the large pool. The segment is tiled by blocks like any other; the parts without
//! pages are blocks with `mapped == false`, kept in the pool's `unmapped` set. Growth maps pages
//! at the lowest address where free and unmapped blocks together have room (merging the new
//! pages with free neighbours); pages are unmapped only by `release_cached_blocks` (empty_cache
//! and the OOM path), never by an ordinary free. Stats follow PyTorch: `reserved_bytes` counts
//! mapped bytes, `segment` is not touched, `num_device_alloc` / `num_device_free` count map and
//! unmap operations (one per mapped or unmapped range), `inactive_split` skips expandable blocks.
//!
//! Note [Page reuse]: with `page_reuse` on (not PyTorch), a growth first takes pages from
//! `spare_pages`, then unmaps whole free pages of free cached blocks elsewhere (once their
//! queued work is known complete: a completed event fence, Note [Page fences] in `page_fence.rs`,
//! or with `page_reuse_fence` off a stream synchronization) and maps the same physical pages where the growth needs them;
//! only the rest is created new. A growth therefore creates memory only when no free whole page
//! is left, so reserved memory stays within the live bytes plus the partial pages around free
//! blocks. Pages moved between pools move their `reserved_bytes` with them (`StatArray::transfer`).
//!
//! Note [Page-move budget]: moving a page costs an unmap, a map and its access (about 80 µs on
//! an H100, Note [Device-time model]), and a workload whose live set keeps changing shape below
//! its peak (a queue of tensors whose sizes rotate) can make page reuse move pages on almost
//! every allocation for ever: the memory stays at the floor while every pair pays tens of
//! microseconds (25.5 µs per allocate + free through PyTorch on an H200, `gpu/host_pair.py`;
//! native 0.47). Rent or buy: while the allocated bytes stay below their peak, page reuse may
//! move at most `page_move_budget` × the reserved pages (`State::steady_moves` counts them),
//! plus one page for every `ALLOCS_PER_MOVE_CREDIT` (128) allocations of the core since the
//! peak; past that a growth creates what it lacks, the layout settles and the device calls
//! stop. An allocation whose growth raises the peak resets the count when it succeeds (the cold
//! start and a new, larger shape move freely), and near the fraction cap every page is moved as
//! before (memory first). Only what happened counts: a growth's moves once it has its pages, an
//! allocation once it has a block. A failed growth moved nothing and raised no peak, and an
//! allocation of 0 bytes allocates nothing; counted, a program that probes for memory and
//! catches the out-of-memory error restarted the count at each probe (a settled queue made 474
//! unmaps in 20,000 pairs after one such failure instead of 44), transient device errors spent
//! the budget on moves never made, and zero-size allocations earned moves
//! (`tests/all/move_budget.rs`). With
//! the default's 8, every shipped, recorded and synthetic trace of `benches/README.md` replays
//! exactly as without a budget; the rotating queue settles at 1.15 × live after 794 moves
//! instead of moving 0.6 pages per allocation at 1.04 × (1.24 × without the credit). The
//! credit slows the count of a long variable-length training run, which moves a page every
//! 50–100 allocations (`examples/long_varlen.rs`, 1,000–3,000 steps): without it the run
//! bought after about 1,000 steps and settled at 1.16 and 1.25 × live (seeds 1 and 2); with it
//! the run stays at 1.0097–1.0294 × for its first 1,000 steps (six seeds) and settles later, at
//! 1.12 and 1.08 ×, for about a third more page moves in all.
//!
//! Note [Reuse plans count before they collect]: a reuse plan ranks every free mapped block by
//! the pages it would give, and a training step's free blocks can hold thousands of pages. The
//! ranking counts each block's reusable handles without collecting them, and a block's handles
//! are listed only when the plan takes from it, highest first, until the need is met. On the
//! recorded FSDP2 trace (`gpu/traces/fsdp.pickle.gz`, default) this halved the plans' host work
//! (20.4 to 10.0 million instructions for 156 plans) with identical plans.
//!
//! Failure handling: a device error part-way through mapping or unmapping records what did
//! happen (the pages mapped or unmapped so far) in the block structure and puts physical pages
//! that are mapped nowhere into `spare_pages`, so the state stays consistent and nothing leaks.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::growth_fit::{MIN_SAVING, SlackLimit};
use super::{SegmentRec, State};
use crate::allocator::block::{Block, BlockId};
use crate::allocator::device_calls;
use crate::allocator::pool::{FreeKey, Range};
use crate::allocator::segment_events::SegmentAction;
use crate::backend::{BackendError, DeviceAddr, DeviceBackend, PhysicalHandle, StreamId};
use crate::config::{MAX_ALLOCATION_SIZE, PageReuse};
use crate::error::{AllocError, Result};
use crate::size_class::{PoolKind, expandable_page_size};
use crate::trace::TraceOp;

/// Core allocations below the peak that earn the page-move budget one more page move (Note
/// [Page-move budget]).
const ALLOCS_PER_MOVE_CREDIT: u64 = 128;

/// One expandable segment: a reserved address range and the physical handles mapped in it.
#[derive(Clone, Debug)]
pub(crate) struct VmSegment {
    /// Base address of the reservation.
    pub(crate) base: u64,
    /// Bytes reserved (a multiple of `page_size`).
    pub(crate) size: usize,
    /// Bytes per page.
    pub(crate) page_size: usize,
    pub(crate) stream: StreamId,
    pub(crate) pool: PoolKind,
    /// Mapped handles: first page → (handle, pages it spans). One page per handle unless
    /// `expandable_max_handle_size` allows more. Never overlapping.
    pub(crate) handles: BTreeMap<usize, (PhysicalHandle, usize)>,
    /// Pages mapped in all.
    pub(crate) mapped_pages: usize,
}

impl VmSegment {
    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.mapped_pages * self.page_size
    }

    /// Address of page `page`.
    pub(crate) fn page_addr(&self, page: usize) -> u64 {
        self.base + (page * self.page_size) as u64
    }

    /// The page holding `addr` (PyTorch's `segmentLeft`).
    pub(crate) fn page_left(&self, addr: u64) -> usize {
        ((addr - self.base) / self.page_size as u64) as usize
    }

    /// The first page starting at or after `addr` (PyTorch's `segmentRight`).
    pub(crate) fn page_right(&self, addr: u64) -> usize {
        (addr - self.base).div_ceil(self.page_size as u64) as usize
    }

    /// The handle mapped over `page`, as `(first page, pages)`.
    pub(crate) fn covering(&self, page: usize) -> Option<(usize, usize)> {
        self.handles
            .range(..=page)
            .next_back()
            .filter(|(start, (_, n))| page < **start + *n)
            .map(|(start, (_, n))| (*start, *n))
    }

    /// Handles lying wholly inside pages `[first, last)`, as `(first page, pages)`, in order.
    fn handles_within(&self, first: usize, last: usize) -> Vec<(usize, usize)> {
        self.reusable_handles(first, last, self.page_size)
            .map(|(_, start, n)| (start, n))
            .collect()
    }

    /// The handles lying wholly inside pages `[first, last)` whose bytes are whole pages of
    /// `page` bytes (a segment of that page size can map them), in order, as `(pages of `page`
    /// bytes, first page here, pages here)`. Allocates nothing, so a reuse plan can count a free
    /// block's pages without collecting them (Note [Reuse plans count before they collect]).
    fn reusable_handles(
        &self,
        first: usize,
        last: usize,
        page: usize,
    ) -> impl DoubleEndedIterator<Item = (usize, usize, usize)> + '_ {
        let bytes_per = self.page_size;
        self.handles
            .range(first..last.max(first))
            .filter(move |(start, (_, n))| **start + *n <= last)
            .filter(move |(_, (_, n))| page != 0 && (*n * bytes_per) % page == 0)
            .map(move |(start, (_, n))| (*n * bytes_per / page, *start, *n))
    }
}

/// Contiguous runs `(first page, pages)` of the given handles, highest first (so that unmapping
/// one run leaves the runs below it in the block's lower remainder).
fn runs_descending(mut handles: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    handles.sort_unstable();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (start, n) in handles {
        match runs.last_mut() {
            Some(r) if r.0 + r.1 == start => r.1 += n,
            _ => runs.push((start, n)),
        }
    }
    runs.reverse();
    runs
}

/// A physical handle the cache holds but has mapped nowhere. Its bytes count as reserved, in the
/// pool it last served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SparePage {
    pub(crate) handle: PhysicalHandle,
    /// Bytes (a multiple of the granularity; one or more pages).
    pub(crate) size: usize,
    pub(crate) pool: PoolKind,
}

/// Runs of whole handles of one free block to hand to a growing segment, highest first.
#[derive(Clone, Debug)]
pub(super) struct Reclaim {
    pub(super) id: BlockId,
    pub(super) runs: Vec<(usize, usize)>,
}

/// What a growth is for: the address range page reuse must leave alone, the unmapped block being
/// mapped, and the request's size.
#[derive(Clone, Copy, Debug)]
struct Growth {
    keep: (u64, u64),
    to_map: BlockId,
    request: usize,
}

fn backend(operation: &'static str) -> impl FnOnce(BackendError) -> AllocError {
    move |source| AllocError::Backend { operation, source }
}

impl State {
    /// Base address of the expandable segment holding `addr`.
    pub(crate) fn vm_segment_of(&self, addr: u64) -> Option<u64> {
        self.vm_segments
            .range(..=addr)
            .next_back()
            .filter(|(base, s)| addr < **base + s.size as u64)
            .map(|(base, _)| *base)
    }

    /// The physical handles under the live allocation at `ptr`, for sharing it with another
    /// process: `Ok(None)` when it lies in a fixed (`allocate`) segment, else the address of the
    /// first handle, the bytes of each handle and the handles in address order. An importer maps
    /// them side by side, so they must all be of one size; an error says why they cannot be
    /// shared otherwise.
    pub(crate) fn handles_under(
        &self,
        ptr: u64,
    ) -> std::result::Result<Option<(u64, usize, Vec<PhysicalHandle>)>, String> {
        let Some(&id) = self.active.get(&ptr) else {
            return Err(format!(
                "{} is not a live allocation of this allocator",
                DeviceAddr(ptr)
            ));
        };
        self.handles_of(id)
    }

    /// [`handles_under`](Self::handles_under) for block `id`.
    fn handles_of(
        &self,
        id: BlockId,
    ) -> std::result::Result<Option<(u64, usize, Vec<PhysicalHandle>)>, String> {
        let b = self.block(id);
        let ptr = b.ptr;
        if !b.expandable {
            return Ok(None);
        }
        let (end, what) = (b.ptr + b.size as u64, DeviceAddr(ptr));
        let seg = self
            .vm_at(b.ptr)
            .map(|(_, s)| s)
            .ok_or_else(|| format!("{what} lies in no expandable segment of this allocator"))?;
        let (mut page, last) = (seg.page_left(b.ptr), seg.page_right(end));
        let mut handles = Vec::new();
        let (mut start, mut bytes) = (0u64, 0usize);
        while page < last {
            let Some((first, n)) = seg.covering(page) else {
                return Err(format!("page {page} under {what} is not mapped"));
            };
            let Some(&(handle, _)) = seg.handles.get(&first) else {
                return Err(format!("page {page} under {what} is not mapped"));
            };
            let size = n * seg.page_size;
            if handles.is_empty() {
                (start, bytes) = (seg.page_addr(first), size);
            } else if size != bytes {
                return Err(format!(
                    "{what} lies on physical handles of different sizes ({bytes} and {size} bytes), \
                     which another process cannot map side by side; allocations on handles of one \
                     size (cca_max_handle_size_mb unset, as in the default) can be shared"
                ));
            }
            handles.push(handle);
            page = first + n;
        }
        Ok(Some((start, bytes, handles)))
    }

    /// Counts the allocation at `ptr` as exported: each handle under it stays exported until the
    /// last such allocation on it is freed ([`unexport`](Self::unexport)).
    pub(crate) fn mark_exported(&mut self, ptr: u64, handles: &[PhysicalHandle]) {
        let Some(&id) = self.active.get(&ptr) else {
            return;
        };
        if std::mem::replace(&mut self.block_mut(id).exported, true) {
            return;
        }
        for h in handles {
            *self.exported_handles.entry(h.0).or_insert(0) += 1;
        }
    }

    /// The exported allocation `id` is being freed: lets go of the exports of its handles that
    /// no other live exported allocation lies on.
    pub(crate) fn unexport<B: DeviceBackend>(&mut self, dev: &B, id: BlockId) {
        self.block_mut(id).exported = false;
        let Ok(Some((_, _, handles))) = self.handles_of(id) else {
            return;
        };
        for h in handles {
            if let Some(n) = self.exported_handles.get_mut(&h.0) {
                *n -= 1;
                if *n == 0 {
                    self.exported_handles.remove(&h.0);
                    dev.release_export(h);
                }
            }
        }
    }

    /// The expandable segment holding `addr`, with its base address.
    fn vm_at(&self, addr: u64) -> Option<(u64, &VmSegment)> {
        let base = self.vm_segment_of(addr)?;
        Some((base, self.vm_segments.get(&base)?))
    }

    /// Free for reuse: not allocated and no pending stream use (mapped or not).
    pub(super) fn allocatable(&self, id: BlockId) -> bool {
        let b = self.block(id);
        !b.allocated && !b.lent && b.event_count == 0 && b.stream_uses.is_empty()
    }

    /// Removes a free mapped block from its pool's free set.
    fn uncache_block(&mut self, id: BlockId) {
        let kind = self.block(id).pool;
        let pool = match kind {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        };
        if let Some(b) = self.arena.get(id) {
            pool.remove(id, b);
        }
    }

    /// `get_free_block`'s expandable walk: from the first fitting key, move on while the next
    /// candidate of the stream has a smaller *expandable size* (its size plus an unmapped block
    /// right after it), so that best fit counts growable room. `rest` is the free set's keys
    /// after `key`, in order; returns the key chosen and how many keys after `key` it is.
    pub(super) fn expandable_best_fit(&self, key: FreeKey, rest: Range<'_>) -> (FreeKey, usize) {
        let expandable_size = |id: BlockId| {
            let b = self.block(id);
            // The unmapped block after it; with idle moves whose unmaps the helper has not
            // given back, the run of them and unmapped blocks that will merge into one.
            let mut tail = 0;
            let mut cur = b.next;
            while let Some(n) = cur.filter(|&n| self.unmapped_or_moving(n)) {
                let n = self.block(n);
                tail += n.size;
                cur = n.next;
            }
            b.size + tail
        };
        let mut it = key;
        let mut steps = 0;
        for next in rest {
            if !self.block(it.id).expandable
                || next.stream != key.stream
                || expandable_size(next.id) >= expandable_size(it.id)
            {
                break;
            }
            it = *next;
            steps += 1;
        }
        (it, steps)
    }

    /// `find_expandable_block`: the lowest-addressed run of free and unmapped blocks of `stream`
    /// with room for `size` bytes (starting at the free block before an unmapped one when there
    /// is one); else a new segment with one unmapped block spanning its whole range.
    fn find_expandable_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        kind: PoolKind,
        size: usize,
    ) -> Result<Option<BlockId>> {
        let unmapped: Vec<BlockId> = self
            .pool_ref(kind)
            .unmapped
            .range((stream, 0, BlockId(0))..)
            .take_while(|(s, _, _)| *s == stream)
            .map(|&(_, _, id)| id)
            .collect();
        let page = expandable_page_size(kind, &self.config);
        // Note [Fewest-pages growth] (growth_fit.rs): the lowest run with room, or beyond the
        // page-reuse slack the one that maps the fewest pages.
        let fewest = self.fewest_pages_growth(size);
        // (start of the run, pages it maps)
        let mut lowest: Option<(BlockId, usize)> = None;
        let mut best: Option<(BlockId, usize)> = None;
        for id in unmapped {
            let mut c = id;
            if let Some(p) = self.block(c).prev {
                if self.allocatable(p) {
                    c = p;
                }
            }
            let Some(pages) = self.run_pages(c, size, page) else {
                continue;
            };
            if !fewest {
                return Ok(Some(c));
            }
            lowest.get_or_insert((c, pages));
            if best.is_none_or(|(_, p)| pages < p) {
                best = Some((c, pages));
            }
        }
        if let (Some((low, low_pages)), Some((c, pages))) = (lowest, best) {
            return Ok(Some(if pages + MIN_SAVING <= low_pages {
                c
            } else {
                low
            }));
        }
        // PyTorch's address range: the device's memory and an eighth more, so that one segment
        // can grow over all of it. It stops at the largest request the cache serves
        // (`MAX_ALLOCATION_SIZE`): a simulated device of `usize::MAX` bytes overflowed the sum,
        // and ranges that large left room in the address space for one or two segments.
        let total = self.device_total;
        let handles = total
            .saturating_add(total / 8)
            .min(usize::try_from(MAX_ALLOCATION_SIZE).unwrap_or(usize::MAX))
            .div_ceil(page)
            .max(size.div_ceil(page))
            .max(1);
        let Some(va_size) = page.checked_mul(handles) else {
            return Ok(None);
        };
        let base = match dev.reserve_address_range(va_size) {
            Ok(p) => p.0,
            Err(BackendError::OutOfMemory) => return Ok(None),
            Err(source) => return Err(backend("reserve_address_range")(source)),
        };
        let mut b = Block::new(base, va_size, stream, kind);
        b.mapped = false;
        b.expandable = true;
        let id = self.arena.insert(b);
        self.pool(kind).unmapped.insert((stream, base, id));
        self.segments.insert(
            base,
            SegmentRec {
                size: va_size,
                stream,
                pool: kind,
                expandable: true,
                owner: 0,
            },
        );
        self.vm_segments.insert(
            base,
            VmSegment {
                base,
                size: va_size,
                page_size: page,
                stream,
                pool: kind,
                handles: BTreeMap::new(),
                mapped_pages: 0,
            },
        );
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), base = %DeviceAddr(base), va_size, page, %stream, pool = kind.segment_type(), "expandable segment reserved");
        Ok(Some(id))
    }

    /// `try_allocate_expandable_block`: finds room, maps the pages it lacks, and returns one free
    /// block (removed from the free set) of at least `size` bytes. `Ok(None)`: out of memory.
    pub(super) fn try_allocate_expandable_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        stream: StreamId,
        kind: PoolKind,
        size: usize,
    ) -> Result<Option<BlockId>> {
        if self.cannot_fit(dev, size) {
            return Ok(None);
        }
        if !self.lent.is_empty() && !self.capture_underway() {
            // Note [Unmaps off the allocating thread], step 3: what the helper unmapped comes
            // back first (waited for), so the growth plans over the layout it would have had if
            // this thread had unmapped the pages itself; then Note [Lent pages], step 4, before
            // the growth picks its blocks (ending a loan merges unmapped blocks). Fences are
            // polled only if loans are left, as without the helper: a loan of pending pages
            // (not an idle move, which only the helper makes) counts even when the helper has
            // just unmapped it, since without the helper it would still be lent here.
            let loans = self.lent.iter().any(|r| !r.idle);
            self.collect_unmaps(dev);
            if loans {
                self.poll_fences(dev);
            }
            if !self.lent.is_empty() {
                self.settle_lent(dev, false)?;
            }
        }
        let Some(mut cand) = self.find_expandable_block(dev, stream, kind, size)? else {
            return Ok(None);
        };
        // Page reuse must not take pages from the run being assembled.
        let lo = self.block(cand).ptr;
        let mut growth = Growth {
            keep: (lo, lo.saturating_add(size as u64)),
            to_map: cand,
            request: size,
        };
        if !self.block(cand).mapped {
            let n = self.block(cand).size.min(size);
            if !self.map_growth(dev, n, growth)? {
                return Ok(None);
            }
        }
        while self.block(cand).size < size {
            let remaining = size - self.block(cand).size;
            let Some(next) = self
                .block(cand)
                .next
                .filter(|&n| !self.block(n).mapped && !self.block(n).lent)
            else {
                // find_expandable_block promised free -> unmapped -> ...; nothing else to do.
                return Ok(None);
            };
            let n = remaining.min(self.block(next).size);
            growth.to_map = next;
            if !self.map_growth(dev, n, growth)? {
                return Ok(None);
            }
            cand = next;
        }
        self.uncache_block(cand);
        self.offload_settled(dev);
        Ok(Some(cand))
    }

    /// Whether `size` bytes can certainly not be had, checked before anything is reserved,
    /// created or mapped (so a request far beyond the device fails in a few calls instead of
    /// creating pages until memory runs out), in the order the OOM report names the cause:
    /// larger than the device, than the fraction cap, or than free device memory plus every
    /// byte this allocator holds (all of which could at best be reused).
    fn cannot_fit<B: DeviceBackend>(&self, dev: &B, size: usize) -> bool {
        if size > self.device_total || self.allowed_memory_maximum.is_some_and(|max| size > max) {
            return true;
        }
        let fresh = size.saturating_sub(self.total_allocated_memory);
        fresh > 0 && dev.mem_info().is_ok_and(|info| fresh > info.free)
    }

    /// `map_block` of `needed` bytes, or of `cca_min_growth_mb` when that is more (and the
    /// unmapped block has room): growing ahead of need lets the next small growths find room
    /// mapped already. When the larger growth does not fit (out of memory, or over the fraction
    /// cap), maps just what is needed.
    fn map_growth<B: DeviceBackend>(
        &mut self,
        dev: &B,
        needed: usize,
        growth: Growth,
    ) -> Result<bool> {
        let room = self.block(growth.to_map).size;
        let ahead = needed.max(self.config.expandable_min_growth).min(room);
        if ahead > needed {
            if self.map_block(dev, ahead, growth)? {
                return Ok(true);
            }
            self.cap_rejected = false;
        }
        self.map_block(dev, needed, growth)
    }

    /// `map_block`: maps the pages covering the first `size` bytes of unmapped block
    /// `growth.to_map`, which then becomes (part of) a free mapped block. `Ok(false)`: out of
    /// memory (nothing changed).
    fn map_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        size: usize,
        growth: Growth,
    ) -> Result<bool> {
        let to_map = growth.to_map;
        let ptr = self.block(to_map).ptr;
        let Some((base, seg)) = self.vm_at(ptr) else {
            return Ok(false);
        };
        let (first, last, page, kind, stream) = (
            seg.page_left(ptr),
            seg.page_right(ptr + size as u64),
            seg.page_size,
            seg.pool,
            seg.stream,
        );
        if last <= first {
            return Ok(false);
        }
        let Some(handles) = self.acquire_pages(dev, base, last - first, growth)? else {
            return Ok(false);
        };
        let mut at = first;
        let mut mapped = 0usize;
        let mut err = None;
        for sp in &handles {
            let n = sp.size / page;
            let va = DeviceAddr(base + (at * page) as u64);
            match device_calls::map_page(dev, va, sp.size, sp.handle) {
                Ok(()) => {
                    if let Some(seg) = self.vm_segments.get_mut(&base) {
                        seg.handles.insert(at, (sp.handle, n));
                        seg.mapped_pages += n;
                    }
                    self.stats
                        .reserved_bytes
                        .transfer(sp.pool, kind, sp.size as i64);
                    at += n;
                    mapped += 1;
                }
                Err(source) => {
                    err = Some(backend("map")(source));
                    break;
                }
            }
        }
        self.spare_pages.extend_from_slice(&handles[mapped..]);
        if at > first {
            let bytes = (at - first) * page;
            let lent = handles[..mapped]
                .iter()
                .any(|sp| self.handle_lent_pending(sp.handle));
            self.mark_mapped(to_map, bytes);
            if lent {
                // Note [Lent pages]: the pages' old uses are ordered before this stream's work
                // only from the event wait on; moving them on needs a fence recorded after it.
                let t = self.fences.tick();
                let b = self.block_mut(to_map);
                b.free_stamp = b.free_stamp.max(t);
            }
            if let Some(h) = &mut self.history {
                h.op(TraceOp::SegmentMap {
                    addr: base + (first * page) as u64,
                    size: bytes as u64,
                    stream: stream.0,
                });
            }
            let owner = self.block(to_map).owner;
            self.segment_event(
                dev,
                SegmentAction::Map,
                base + (first * page) as u64,
                bytes,
                stream,
                owner,
            );
        }
        match err {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }

    /// The block surgery of `map_block` once `bytes` at the start of `to_map` are mapped.
    fn mark_mapped(&mut self, to_map: BlockId, bytes: usize) {
        let (ptr, size, stream, kind, next) = {
            let b = self.block(to_map);
            (b.ptr, b.size, b.stream, b.pool, b.next)
        };
        self.pool(kind).unmapped.remove(&(stream, ptr, to_map));
        {
            // Freshly mapped: no work has used these bytes at this address.
            let b = self.block_mut(to_map);
            b.mapped = true;
            b.free_stamp = 0;
        }
        if bytes < size {
            let mut rest = Block::new(ptr + bytes as u64, size - bytes, stream, kind);
            rest.mapped = false;
            rest.expandable = true;
            rest.prev = Some(to_map);
            rest.next = next;
            let rid = self.arena.insert(rest);
            if let Some(n) = next {
                self.block_mut(n).prev = Some(rid);
            }
            let b = self.block_mut(to_map);
            b.next = Some(rid);
            b.size = bytes;
            self.pool(kind)
                .unmapped
                .insert((stream, ptr + bytes as u64, rid));
        }
        let prev = self.block(to_map).prev;
        self.try_merge_blocks(to_map, prev);
        let next = self.block(to_map).next;
        self.try_merge_blocks(to_map, next);
        self.cache_block(to_map);
        self.stats.num_device_alloc += 1;
    }

    /// Whether a growth by `size` bytes would raise the allocated bytes past their peak and the
    /// reserved bytes past the page-reuse slack over them (`(1 + cca_page_reuse_slack) ×
    /// (allocated + size)`, the allowance of `acquire_pages`), with page reuse on: a growth that
    /// sets the reserved peak (Note [Flush before a new peak] in `front/mod.rs`).
    pub(crate) fn growth_sets_reserved_peak(&self, size: usize) -> bool {
        if self.config.page_reuse == PageReuse::Off || !self.config.expandable_segments {
            return false;
        }
        let s = self.slack_limit(size);
        s.after > s.peak && self.total_allocated_memory.saturating_add(size) > s.limit
    }

    /// Physical handles covering `n` pages of segment `base`, already counted as reserved (each
    /// in the pool its `SparePage` names): spare handles first, then (with page reuse) handles
    /// unmapped from free blocks, then new ones. `Ok(None)`: out of memory or over the cap,
    /// nothing changed except that reused handles may have moved to `spare_pages`.
    fn acquire_pages<B: DeviceBackend>(
        &mut self,
        dev: &B,
        base: u64,
        n: usize,
        growth: Growth,
    ) -> Result<Option<Vec<SparePage>>> {
        let Some((page, kind)) = self.vm_segments.get(&base).map(|s| (s.page_size, s.pool)) else {
            return Ok(None);
        };
        let mut got: Vec<SparePage> = Vec::new();
        let mut have = 0usize;
        self.spare_pages.sort_by_key(|p| std::cmp::Reverse(p.size));
        let mut i = 0;
        while i < self.spare_pages.len() && have < n {
            let sp = self.spare_pages[i];
            // A handle still mapped where it was lent from may still be in use there.
            if sp.size % page == 0 && sp.size / page <= n - have && !self.handle_lent(sp.handle) {
                have += sp.size / page;
                got.push(self.spare_pages.remove(i));
            } else {
                i += 1;
            }
        }
        let need = n - have;
        // Allocated bytes after the request, and their peak so far.
        let SlackLimit { after, peak, limit } = self.slack_limit(growth.request);
        // Within the slack, new pages are cheaper than moving pages around.
        let allowance = if self.config.page_reuse_slack > 0.0 {
            limit.saturating_sub(self.total_allocated_memory) / page
        } else {
            0
        };
        // No unmapping (nor the stream synchronization before it) while a capture is underway.
        let reuse = self.config.page_reuse != PageReuse::Off && !self.capture_underway();
        let mut to_reclaim = need.saturating_sub(allowance);
        // Note [Page-move budget]: below the peak, moves come from a budget.
        let budget = self.config.page_move_budget;
        let budgeted = budget > 0 && after <= peak;
        if budgeted {
            let allowed = budget
                .saturating_mul((self.total_allocated_memory / page) as u64)
                .saturating_add(self.allocs_since_peak / ALLOCS_PER_MOVE_CREDIT);
            to_reclaim = to_reclaim.min(allowed.saturating_sub(self.steady_moves) as usize);
        }
        let (mut plan, mut reclaimed) = if to_reclaim > 0 && reuse {
            self.plan_reuse(dev, base, to_reclaim, growth)
        } else {
            (Vec::new(), 0)
        };
        let over_cap = |st: &Self, fresh: usize| {
            st.config.precise_fraction_cap
                && st
                    .allowed_memory_maximum
                    .is_some_and(|max| st.total_allocated_memory.saturating_add(fresh * page) > max)
        };
        let mut under_cap = false;
        if reuse && to_reclaim < need && over_cap(self, need - reclaimed) {
            // No slack under the cap: reuse all that can be reused.
            (plan, reclaimed) = self.plan_reuse(dev, base, need, growth);
            under_cap = true;
        }
        // Note [Lent pages]: pages whose fence is pending, instead of new memory.
        let want = if under_cap { need } else { to_reclaim }.saturating_sub(reclaimed);
        if want > 0 && reuse && self.lending_on() {
            let (lend, _, _) = self.reclaim_plan(base, want, growth, true);
            if !lend.is_empty() {
                let stream = self
                    .vm_segments
                    .get(&base)
                    .map_or(StreamId::DEFAULT, |s| s.stream);
                let (pages, bytes) = self.lend_pages(dev, lend, stream);
                reclaimed += bytes / page;
                got.extend(pages);
            }
        }
        // The moves count once the growth has its pages (below), not when planned.
        let counted_moves = if budgeted && !under_cap { reclaimed } else { 0 };
        let fresh = need - reclaimed;
        if fresh > 0 && over_cap(self, fresh) {
            self.cap_rejected = true;
            self.cap_refused_bytes = fresh * page;
            self.spare_pages.extend(got);
            return Ok(None);
        }
        let per_handle = self
            .config
            .expandable_max_handle_size
            .map_or(1, |m| (m / page).max(1));
        let mut created: Vec<SparePage> = Vec::new();
        let mut left = fresh;
        while left > 0 {
            // The last page usually holds the end of the request and the start of whatever
            // comes next: a handle of its own there keeps the big handles reusable.
            let pages = if self.config.expandable_handle_per_growth {
                left.min(per_handle)
            } else if left > 1 && left <= per_handle {
                left - 1
            } else {
                left.min(per_handle)
            };
            match dev.create_physical(pages * page) {
                Ok(handle) => {
                    self.handles.increase(1);
                    created.push(SparePage {
                        handle,
                        size: pages * page,
                        pool: kind,
                    });
                }
                Err(e) => {
                    // A graph capture forbids releasing memory (cuMemRelease is not
                    // stream-ordered): the handles this growth made stay spare until
                    // `empty_cache` after the capture.
                    let keep = self.capture_underway();
                    for sp in created {
                        let released = !keep
                            && device_calls::release_unmapped_page(dev, sp.handle, sp.size).is_ok();
                        if released {
                            self.handles.decrease(1);
                        } else {
                            // Keep what cannot be released: it is real memory.
                            self.total_allocated_memory += sp.size;
                            self.stats.reserved_bytes.increase(kind, sp.size as i64);
                            self.spare_pages.push(sp);
                        }
                    }
                    self.spare_pages.extend(got);
                    return if e.is_out_of_memory() {
                        Ok(None)
                    } else {
                        Err(backend("create_physical")(e))
                    };
                }
            }
            left -= pages;
        }
        if fresh > 0 {
            self.total_allocated_memory += fresh * page;
            self.stats
                .reserved_bytes
                .increase(kind, (fresh * page) as i64);
            got.extend(created);
        }
        let mut synced: Vec<StreamId> = Vec::new();
        let offload = self.unmaps_offloaded(dev);
        for r in plan {
            let (stream, stamp) = {
                let b = self.block(r.id);
                (b.stream, b.free_stamp)
            };
            // Note [Page fences]: a block a completed fence covers is idle; anything else waits
            // for its stream (the PyTorch-like setting, or a backend without events).
            let idle = self.fenced_reuse() && self.known_idle(r.id);
            if !idle && !synced.contains(&stream) {
                if let Err(source) = dev.synchronize_stream(stream) {
                    self.spare_pages.extend(got);
                    return Err(backend("synchronize_stream")(source));
                }
                synced.push(stream);
            }
            let mut cur = Some(r.id);
            for (first, count) in r.runs {
                let Some(id) = cur else { break };
                if offload && idle {
                    // Note [Unmaps off the allocating thread]: the old mapping stays until the
                    // helper unmaps it, after this growth.
                    let (pages, below) = self.lend_run(id, first, count, stream, stamp, true);
                    got.extend(pages);
                    cur = below;
                    continue;
                }
                let (pages, below, res) = self.unmap_run(dev, id, first, count);
                got.extend(pages);
                if let Err(e) = res {
                    self.spare_pages.extend(got);
                    return Err(e);
                }
                cur = below;
            }
        }
        // Note [Page-move budget]: a growth that fails moves nothing and raises no peak.
        self.steady_moves = self.steady_moves.saturating_add(counted_moves as u64);
        if after > peak {
            self.growth_raises_peak = true;
        }
        // Big handles first, the smallest (usually one page) last, where the range ends.
        got.sort_by_key(|p| std::cmp::Reverse(p.size));
        Ok(Some(got))
    }

    /// `reclaim_plan`, fenced (Note [Page fences]): polls the fences first; when the plan
    /// comes up short because some free pages' fences have not completed, records fences on
    /// those streams, polls once more and plans again.
    fn plan_reuse<B: DeviceBackend>(
        &mut self,
        dev: &B,
        base: u64,
        need: usize,
        growth: Growth,
    ) -> (Vec<Reclaim>, usize) {
        if !self.fenced_reuse() {
            let (plan, got, _) = self.reclaim_plan(base, need, growth, false);
            return (plan, got);
        }
        self.poll_fences(dev);
        let (plan, got, unfenced) = self.reclaim_plan(base, need, growth, false);
        if got < need && !unfenced.is_empty() && self.record_fences(dev, &unfenced) {
            self.poll_fences(dev);
            let (plan, got, _) = self.reclaim_plan(base, need, growth, false);
            return (plan, got);
        }
        (plan, got)
    }

    /// Which mapped handles to reuse for `need` pages of segment `base`, and how many pages they
    /// give: handles lying wholly inside free blocks the policy allows (same segment, or any
    /// segment whose handles are whole multiples of this page size), largest first, never more
    /// than needed; never from blocks in `growth.keep` in `base` (the run being assembled), nor
    /// the pages of `growth.to_map`'s neighbours that touch it (unmapped, they would merge with
    /// it).
    ///
    /// With fenced reuse, only blocks a completed fence covers are taken; the third value names
    /// the streams of the others that hold reusable pages, each with its blocks' highest free
    /// stamp (where a fence would help). With `pending`, the opposite: only the blocks whose
    /// fence has not completed (pages to lend, Note [Lent pages]).
    fn reclaim_plan(
        &self,
        base: u64,
        need: usize,
        growth: Growth,
        pending: bool,
    ) -> (Vec<Reclaim>, usize, Vec<(StreamId, u64)>) {
        let mut unfenced: Vec<(StreamId, u64)> = Vec::new();
        let Some((page, kind)) = self.vm_segments.get(&base).map(|s| (s.page_size, s.pool)) else {
            return (Vec::new(), 0, unfenced);
        };
        let same_segment_only = self.config.page_reuse == PageReuse::Segment;
        let (lo, hi) = growth.keep;
        // Per block: (pages here in all, address, block, its segment, its first reusable page,
        // the page past its last): its handles are listed only if the plan takes from it.
        type Cand = (usize, u64, BlockId, u64, usize, usize);
        let mut cands: Vec<Cand> = Vec::new();
        for pk in [PoolKind::Small, PoolKind::Large] {
            if same_segment_only && pk != kind {
                continue;
            }
            for k in &self.pool_ref(pk).blocks {
                let b = self.block(k.id);
                if !b.expandable {
                    continue;
                }
                let Some((sb, seg)) = self.vm_at(b.ptr) else {
                    continue;
                };
                if same_segment_only && sb != base {
                    continue;
                }
                if sb == base && b.ptr < hi && b.end() > lo {
                    continue;
                }
                // A neighbour of the block being mapped keeps its page next to it: unmapped
                // there, it would merge into that block.
                let skip_low = usize::from(b.prev == Some(growth.to_map));
                let skip_high = usize::from(b.next == Some(growth.to_map));
                let first = seg.page_right(b.ptr) + skip_low;
                let last = seg.page_left(b.end()).saturating_sub(skip_high);
                let total: usize = seg.reusable_handles(first, last, page).map(|h| h.0).sum();
                if total == 0 {
                    continue;
                }
                if pending {
                    if !self.fenced_reuse() || self.known_idle(k.id) {
                        continue;
                    }
                } else if !self.fence_allows(k.id) {
                    match unfenced.iter_mut().find(|(s, _)| *s == b.stream) {
                        Some(u) => u.1 = u.1.max(b.free_stamp),
                        None => unfenced.push((b.stream, b.free_stamp)),
                    }
                    continue;
                }
                cands.push((total, b.ptr, k.id, sb, first, last));
            }
        }
        // Fewest blocks touched: the blocks with most reusable pages first; within a block its
        // highest handles first (the low part stays mapped next to what precedes it).
        cands.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut left = need;
        let mut taken: Vec<(BlockId, usize, usize)> = Vec::new();
        for (_, _, id, sb, first, last) in cands {
            let Some(seg) = self.vm_segments.get(&sb) else {
                continue;
            };
            // Every handle gives at least one page: none fits once nothing is left.
            for (pages, start, count) in seg.reusable_handles(first, last, page).rev() {
                if left == 0 {
                    break;
                }
                if pages <= left {
                    left -= pages;
                    taken.push((id, start, count));
                }
            }
            if left == 0 {
                break;
            }
        }
        taken.sort_unstable();
        let mut plan: Vec<Reclaim> = Vec::new();
        let mut i = 0;
        while i < taken.len() {
            let id = taken[i].0;
            let mut handles = Vec::new();
            while i < taken.len() && taken[i].0 == id {
                handles.push((taken[i].1, taken[i].2));
                i += 1;
            }
            plan.push(Reclaim {
                id,
                runs: runs_descending(handles),
            });
        }
        // Deterministic order: by block address.
        plan.sort_unstable_by_key(|r| self.block(r.id).ptr);
        (plan, need - left, unfenced)
    }

    /// Unmaps the handles tiling pages `[first, first + count)` of free mapped block `id` (the
    /// caller made sure its queued work is complete: a fence or a synchronize) and does `unmap_block`'s surgery for what was unmapped.
    /// Returns the handles (still counted as reserved in the block's pool), the free block left
    /// below the run (if any), and the first error.
    fn unmap_run<B: DeviceBackend>(
        &mut self,
        dev: &B,
        id: BlockId,
        first: usize,
        count: usize,
    ) -> (Vec<SparePage>, Option<BlockId>, Result<()>) {
        let ptr = self.block(id).ptr;
        let Some((base, seg)) = self.vm_at(ptr) else {
            return (Vec::new(), Some(id), Ok(()));
        };
        let (page, kind, stream) = (seg.page_size, seg.pool, seg.stream);
        let mut out = Vec::new();
        let mut res = Ok(());
        let mut at = first;
        while at < first + count {
            let Some(seg) = self.vm_segments.get_mut(&base) else {
                break;
            };
            let Some(&(handle, n)) = seg.handles.get(&at) else {
                break;
            };
            match device_calls::unmap_page(dev, DeviceAddr(seg.page_addr(at)), n * page) {
                Ok(()) => {
                    seg.handles.remove(&at);
                    seg.mapped_pages -= n;
                    out.push(SparePage {
                        handle,
                        size: n * page,
                        pool: kind,
                    });
                    at += n;
                }
                Err(source) => {
                    res = Err(backend("unmap")(source));
                    break;
                }
            }
        }
        let below = if at > first {
            let start = base + (first * page) as u64;
            let bytes = (at - first) * page;
            if let Some(h) = &mut self.history {
                h.op(TraceOp::SegmentUnmap {
                    addr: start,
                    size: bytes as u64,
                    stream: stream.0,
                });
            }
            let owner = self.block(id).owner;
            let below = self.mark_unmapped(id, start, bytes);
            // After the books agree with the device (a panicking observer is caught, but the
            // bookkeeping is done first all the same).
            self.segment_event(dev, SegmentAction::Unmap, start, bytes, stream, owner);
            below
        } else {
            Some(id)
        };
        (out, below, res)
    }

    /// `unmap_block`'s surgery: `[start, start + bytes)` of free block `id` lost its pages; the
    /// mapped parts before and after become free blocks of their own. Returns the part before.
    fn mark_unmapped(&mut self, id: BlockId, start: u64, bytes: usize) -> Option<BlockId> {
        let below = self.split_out(id, start, bytes);
        self.file_unmapped(id);
        self.stats.num_device_free += 1;
        below
    }

    /// Files unmapped block `id` (not lent): merged with its unmapped neighbours, put in its
    /// pool's `unmapped` set. The caller counts the device free (one unmapped range).
    pub(super) fn file_unmapped(&mut self, id: BlockId) {
        let prev = self.block(id).prev;
        self.try_merge_blocks(id, prev);
        let next = self.block(id).next;
        self.try_merge_blocks(id, next);
        let (stream, kind, ptr) = {
            let b = self.block(id);
            (b.stream, b.pool, b.ptr)
        };
        self.pool(kind).unmapped.insert((stream, ptr, id));
    }

    /// Cuts free mapped block `id` down to `[start, start + bytes)`, marked unmapped and out of
    /// the free set; the mapped parts before and after become free blocks of their own (keeping
    /// the free stamp). Returns the part before. The caller files the block (`mark_unmapped`,
    /// or `lend_run` for a lent block).
    pub(super) fn split_out(&mut self, id: BlockId, start: u64, bytes: usize) -> Option<BlockId> {
        self.uncache_block(id);
        let (ptr, size, stream, kind, prev, next, stamp) = {
            let b = self.block(id);
            (
                b.ptr,
                b.size,
                b.stream,
                b.pool,
                b.prev,
                b.next,
                b.free_stamp,
            )
        };
        let before = (start - ptr) as usize;
        let mut below = None;
        if before > 0 {
            let mut bf = Block::new(ptr, before, stream, kind);
            bf.expandable = true;
            bf.free_stamp = stamp;
            bf.prev = prev;
            bf.next = Some(id);
            let bid = self.arena.insert(bf);
            if let Some(p) = prev {
                self.block_mut(p).next = Some(bid);
            }
            self.block_mut(id).prev = Some(bid);
            self.cache_block(bid);
            below = Some(bid);
        }
        let after = size - before - bytes;
        if after > 0 {
            let mut af = Block::new(start + bytes as u64, after, stream, kind);
            af.expandable = true;
            af.free_stamp = stamp;
            af.prev = Some(id);
            af.next = next;
            let aid = self.arena.insert(af);
            if let Some(n) = next {
                self.block_mut(n).prev = Some(aid);
            }
            self.block_mut(id).next = Some(aid);
            self.cache_block(aid);
        }
        {
            let b = self.block_mut(id);
            b.ptr = start;
            b.size = bytes;
            b.mapped = false;
        }
        below
    }

    /// Gives physical handles back to the device; those that cannot be released stay spare.
    fn release_pages<B: DeviceBackend>(&mut self, dev: &B, pages: Vec<SparePage>) -> Result<()> {
        let mut first_err = None;
        for sp in pages {
            match device_calls::release_unmapped_page(dev, sp.handle, sp.size) {
                Ok(()) => {
                    self.handles.decrease(1);
                    self.total_allocated_memory -= sp.size;
                    self.cap_grace = self.cap_grace.min(self.total_allocated_memory);
                    self.stats.reserved_bytes.decrease(sp.pool, sp.size as i64);
                }
                Err(source) => {
                    first_err.get_or_insert(backend("release_physical")(source));
                    self.spare_pages.push(sp);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Releases every spare handle.
    pub(super) fn release_spare_pages<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let pages = std::mem::take(&mut self.spare_pages);
        self.release_pages(dev, pages)
    }

    /// `release_blocks` for expandable segments of one pool: unmaps the handles lying wholly
    /// inside every free block and releases them, dropping segments left wholly unmapped.
    pub(super) fn release_expandable_blocks<B: DeviceBackend>(
        &mut self,
        dev: &B,
        kind: PoolKind,
    ) -> Result<()> {
        let to_unmap: Vec<BlockId> = self
            .pool_ref(kind)
            .blocks
            .iter()
            .filter(|k| self.block(k.id).expandable)
            .map(|k| k.id)
            .collect();
        for id in to_unmap {
            let Some(b) = self.arena.get(id) else {
                continue;
            };
            if !b.expandable || !b.mapped || b.allocated || b.event_count > 0 {
                continue;
            }
            let Some((_, seg)) = self.vm_at(b.ptr) else {
                continue;
            };
            let (runs, stream) = {
                let inside = seg.handles_within(seg.page_right(b.ptr), seg.page_left(b.end()));
                (runs_descending(inside), seg.stream)
            };
            let mut last = id;
            if !runs.is_empty() {
                // "MemUnmap and MemRelease do not appear to synchronize": wait for the stream.
                dev.synchronize_stream(stream)
                    .map_err(backend("synchronize_stream"))?;
            }
            let mut cur = Some(id);
            for (first, count) in runs {
                let Some(c) = cur else { break };
                let (pages, below, res) = self.unmap_run(dev, c, first, count);
                last = c;
                let rel = self.release_pages(dev, pages);
                res?;
                rel?;
                cur = below;
            }
            let b = self.block(last);
            if !b.mapped && !b.is_split() {
                self.release_expandable_segment(dev, last)?;
            }
        }
        // Ranges left wholly unmapped by an earlier failed release.
        let empty: Vec<BlockId> = self
            .pool_ref(kind)
            .unmapped
            .iter()
            .map(|&(_, _, id)| id)
            .filter(|&id| !self.block(id).is_split())
            .collect();
        for id in empty {
            self.release_expandable_segment(dev, id)?;
        }
        Ok(())
    }

    /// `release_expandable_segment`: frees the address range of a wholly unmapped segment.
    fn release_expandable_segment<B: DeviceBackend>(&mut self, dev: &B, id: BlockId) -> Result<()> {
        let (base, size, stream, kind) = {
            let b = self.block(id);
            (b.ptr, b.size, b.stream, b.pool)
        };
        device_calls::release_range(dev, DeviceAddr(base), size)
            .map_err(backend("release_address_range"))?;
        self.pool(kind).unmapped.remove(&(stream, base, id));
        self.arena.remove(id);
        self.segments.remove(&base);
        self.vm_segments.remove(&base);
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), base = %DeviceAddr(base), "expandable segment released");
        Ok(())
    }
}
