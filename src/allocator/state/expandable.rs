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
//! `spare_pages`, then unmaps whole free pages of free cached blocks elsewhere (after
//! synchronizing their stream) and maps the same physical pages where the growth needs them;
//! only the rest is created new. A growth therefore creates memory only when no free whole page
//! is left, so reserved memory stays within the live bytes plus the partial pages around free
//! blocks. Pages moved between pools move their `reserved_bytes` with them (`StatArray::transfer`).
//!
//! Failure handling: a device error part-way through mapping or unmapping records what did
//! happen (the pages mapped or unmapped so far) in the block structure and puts physical pages
//! that are mapped nowhere into `spare_pages`, so the state stays consistent and nothing leaks.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::{SegmentRec, State};
use crate::allocator::block::{Block, BlockId};
use crate::allocator::device_calls;
use crate::allocator::pool::FreeKey;
use crate::backend::{BackendError, DeviceBackend, DevicePtr, PhysicalHandle, StreamId};
use crate::config::PageReuse;
use crate::error::{AllocError, Result};
use crate::size_class::{PoolKind, expandable_page_size};

/// One expandable segment: a reserved address range and its mapped pages.
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
    /// Mapped pages: page index → physical handle.
    pub(crate) pages: BTreeMap<usize, PhysicalHandle>,
}

impl VmSegment {
    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.pages.len() * self.page_size
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
}

/// A physical page the cache holds but has mapped nowhere. Its bytes count as reserved, in the
/// pool it last served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SparePage {
    pub(crate) handle: PhysicalHandle,
    pub(crate) size: usize,
    pub(crate) pool: PoolKind,
}

/// Whole pages `[first, first + count)` of a free block to hand to a growing segment.
#[derive(Clone, Copy, Debug)]
struct Reclaim {
    id: BlockId,
    first: usize,
    count: usize,
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

    /// Free for reuse: not allocated and no pending stream use (mapped or not).
    fn allocatable(&self, id: BlockId) -> bool {
        let b = self.block(id);
        !b.allocated && b.event_count == 0 && b.stream_uses.is_empty()
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
    /// right after it), so that best fit counts growable room.
    pub(super) fn expandable_best_fit(&self, key: FreeKey, kind: PoolKind) -> FreeKey {
        let expandable_size = |id: BlockId| {
            let b = self.block(id);
            let tail = b
                .next
                .map(|n| self.block(n))
                .filter(|n| !n.mapped)
                .map_or(0, |n| n.size);
            b.size + tail
        };
        let mut it = key;
        for next in self.pool_ref(kind).blocks.range(key..).skip(1) {
            if !self.block(it.id).expandable
                || next.stream != key.stream
                || expandable_size(next.id) >= expandable_size(it.id)
            {
                break;
            }
            it = *next;
        }
        it
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
        for id in unmapped {
            let mut c = id;
            if let Some(p) = self.block(c).prev {
                if self.allocatable(p) {
                    c = p;
                }
            }
            let mut bytes = 0usize;
            let mut cur = Some(c);
            while let Some(b) = cur {
                if bytes >= size || !self.allocatable(b) {
                    break;
                }
                bytes += self.block(b).size;
                cur = self.block(b).next;
            }
            if bytes >= size {
                return Ok(Some(c));
            }
        }
        let page = expandable_page_size(kind, &self.config);
        let total = self.device_total;
        let handles = (total + total / 8)
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
                pages: BTreeMap::new(),
            },
        );
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), base = %DevicePtr(base), va_size, page, %stream, pool = kind.segment_type(), "expandable segment reserved");
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
        let Some(mut cand) = self.find_expandable_block(dev, stream, kind, size)? else {
            return Ok(None);
        };
        // Page reuse must not take pages from the run being assembled.
        let lo = self.block(cand).ptr;
        let keep = (lo, lo.saturating_add(size as u64), size);
        if !self.block(cand).mapped {
            let n = self.block(cand).size.min(size);
            if !self.map_block(dev, cand, n, keep)? {
                return Ok(None);
            }
        }
        while self.block(cand).size < size {
            let remaining = size - self.block(cand).size;
            let Some(next) = self.block(cand).next.filter(|&n| !self.block(n).mapped) else {
                // find_expandable_block promised free -> unmapped -> ...; nothing else to do.
                return Ok(None);
            };
            let n = remaining.min(self.block(next).size);
            if !self.map_block(dev, next, n, keep)? {
                return Ok(None);
            }
            cand = next;
        }
        self.uncache_block(cand);
        Ok(Some(cand))
    }

    /// `map_block`: maps the pages covering the first `size` bytes of unmapped block `to_map`,
    /// which then becomes (part of) a free mapped block. `Ok(false)`: out of memory (nothing
    /// changed). `keep` is the address range page reuse must leave alone and the request size.
    fn map_block<B: DeviceBackend>(
        &mut self,
        dev: &B,
        to_map: BlockId,
        size: usize,
        keep: (u64, u64, usize),
    ) -> Result<bool> {
        let ptr = self.block(to_map).ptr;
        let Some(base) = self.vm_segment_of(ptr) else {
            return Ok(false);
        };
        let (first, last, page, kind) = {
            let seg = &self.vm_segments[&base];
            (
                seg.page_left(ptr),
                seg.page_right(ptr + size as u64),
                seg.page_size,
                seg.pool,
            )
        };
        if last <= first {
            return Ok(false);
        }
        let Some(handles) = self.acquire_pages(dev, base, last - first, keep, to_map)? else {
            return Ok(false);
        };
        let mut mapped = 0usize;
        let mut err = None;
        for (i, sp) in handles.iter().enumerate() {
            let va = DevicePtr(base + ((first + i) * page) as u64);
            match device_calls::map_page(dev, va, page, sp.handle) {
                Ok(()) => {
                    if let Some(seg) = self.vm_segments.get_mut(&base) {
                        seg.pages.insert(first + i, sp.handle);
                    }
                    self.stats
                        .reserved_bytes
                        .transfer(sp.pool, kind, page as i64);
                    mapped += 1;
                }
                Err(source) => {
                    err = Some(backend("map")(source));
                    break;
                }
            }
        }
        self.spare_pages.extend_from_slice(&handles[mapped..]);
        if mapped > 0 {
            self.mark_mapped(to_map, mapped * page);
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
        self.block_mut(to_map).mapped = true;
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

    /// `n` physical pages for segment `base`, already counted as reserved (each in the pool its
    /// `SparePage` names): spare pages first, then (with page reuse) pages unmapped from free
    /// blocks, then new ones. `Ok(None)`: out of memory or over the cap, nothing changed except
    /// that reused pages may have moved to `spare_pages`.
    fn acquire_pages<B: DeviceBackend>(
        &mut self,
        dev: &B,
        base: u64,
        n: usize,
        keep: (u64, u64, usize),
        to_map: BlockId,
    ) -> Result<Option<Vec<SparePage>>> {
        let (page, kind) = {
            let seg = &self.vm_segments[&base];
            (seg.page_size, seg.pool)
        };
        let mut got: Vec<SparePage> = Vec::with_capacity(n);
        let mut i = 0;
        while i < self.spare_pages.len() && got.len() < n {
            if self.spare_pages[i].size == page {
                got.push(self.spare_pages.swap_remove(i));
            } else {
                i += 1;
            }
        }
        let need = n - got.len();
        // Within the slack, new pages are cheaper than moving pages around.
        let allowance = if self.config.page_reuse_slack > 0.0 {
            let allocated = self.stats.memory_allocated().max(0) as usize;
            let peak = self.stats.max_memory_allocated().max(0) as usize;
            let budget = (allocated.saturating_add(keep.2).max(peak) as f64
                * (1.0 + self.config.page_reuse_slack)) as usize;
            budget.saturating_sub(self.total_allocated_memory) / page
        } else {
            0
        };
        let to_reclaim = need.saturating_sub(allowance);
        let plan = if to_reclaim > 0 && self.config.page_reuse != PageReuse::Off {
            self.reclaim_plan(base, to_reclaim, (keep.0, keep.1), to_map)
        } else {
            Vec::new()
        };
        let fresh = need - plan.iter().map(|r| r.count).sum::<usize>();
        if fresh > 0 && self.config.precise_fraction_cap {
            if let Some(max) = self.allowed_memory_maximum {
                if self.total_allocated_memory.saturating_add(fresh * page) > max {
                    self.cap_rejected = true;
                    self.spare_pages.extend(got);
                    return Ok(None);
                }
            }
        }
        let mut created = Vec::with_capacity(fresh);
        for _ in 0..fresh {
            match dev.create_physical(page) {
                Ok(h) => created.push(h),
                Err(e) => {
                    for h in created {
                        if device_calls::release_unmapped_page(dev, h, page).is_err() {
                            // Keep what cannot be released: it is real memory.
                            self.total_allocated_memory += page;
                            self.stats.reserved_bytes.increase(kind, page as i64);
                            self.spare_pages.push(SparePage {
                                handle: h,
                                size: page,
                                pool: kind,
                            });
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
        }
        if fresh > 0 {
            self.total_allocated_memory += fresh * page;
            self.stats
                .reserved_bytes
                .increase(kind, (fresh * page) as i64);
            got.extend(created.into_iter().map(|handle| SparePage {
                handle,
                size: page,
                pool: kind,
            }));
        }
        let mut synced: Vec<StreamId> = Vec::new();
        for r in plan {
            let stream = self.block(r.id).stream;
            if !synced.contains(&stream) {
                if let Err(source) = dev.synchronize_stream(stream) {
                    self.spare_pages.extend(got);
                    return Err(backend("synchronize_stream")(source));
                }
                synced.push(stream);
            }
            let (pages, res) = self.unmap_pages(dev, r.id, r.first, r.count);
            got.extend(pages);
            if let Err(e) = res {
                self.spare_pages.extend(got);
                return Err(e);
            }
        }
        Ok(Some(got))
    }

    /// Which whole free pages to reuse for `need` pages of segment `base`: from the free blocks
    /// the policy allows (same segment, or any segment with the same page size), largest first,
    /// each giving its highest pages; never from blocks near `keep` in `base`, nor from the
    /// neighbours of `to_map` (whose unmapped remains would merge with it).
    fn reclaim_plan(
        &self,
        base: u64,
        need: usize,
        keep: (u64, u64),
        to_map: BlockId,
    ) -> Vec<Reclaim> {
        let (page, kind) = {
            let seg = &self.vm_segments[&base];
            (seg.page_size, seg.pool)
        };
        let same_segment_only = self.config.page_reuse == PageReuse::Segment;
        let (lo, hi) = (
            keep.0.saturating_sub(page as u64),
            keep.1.saturating_add(page as u64),
        );
        let mut cands: Vec<(usize, u64, Reclaim)> = Vec::new();
        for pk in [PoolKind::Small, PoolKind::Large] {
            if same_segment_only && pk != kind {
                continue;
            }
            for k in &self.pool_ref(pk).blocks {
                let b = self.block(k.id);
                if !b.expandable {
                    continue;
                }
                let Some(sb) = self.vm_segment_of(b.ptr) else {
                    continue;
                };
                if same_segment_only && sb != base {
                    continue;
                }
                let seg = &self.vm_segments[&sb];
                if seg.page_size != page {
                    continue;
                }
                if sb == base
                    && ((b.ptr < hi && b.end() > lo)
                        || b.prev == Some(to_map)
                        || b.next == Some(to_map))
                {
                    continue;
                }
                let first = seg.page_right(b.ptr);
                let last = seg.page_left(b.end());
                if last > first {
                    cands.push((
                        last - first,
                        b.ptr,
                        Reclaim {
                            id: k.id,
                            first,
                            count: last - first,
                        },
                    ));
                }
            }
        }
        cands.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut left = need;
        let mut plan = Vec::new();
        for (_, _, mut r) in cands {
            if left == 0 {
                break;
            }
            let take = r.count.min(left);
            r.first += r.count - take;
            r.count = take;
            left -= take;
            plan.push(r);
        }
        plan
    }

    /// Unmaps pages `[first, first + count)` of free mapped block `id` (the caller synchronized
    /// its stream) and does `unmap_block`'s surgery for the pages actually unmapped. Returns
    /// their physical pages (still counted as reserved in the block's pool) and the first error.
    fn unmap_pages<B: DeviceBackend>(
        &mut self,
        dev: &B,
        id: BlockId,
        first: usize,
        count: usize,
    ) -> (Vec<SparePage>, Result<()>) {
        let ptr = self.block(id).ptr;
        let Some(base) = self.vm_segment_of(ptr) else {
            return (Vec::new(), Ok(()));
        };
        let mut out = Vec::with_capacity(count);
        let mut res = Ok(());
        let (page, kind) = {
            let seg = &self.vm_segments[&base];
            (seg.page_size, seg.pool)
        };
        for p in first..first + count {
            let Some(seg) = self.vm_segments.get_mut(&base) else {
                break;
            };
            let Some(&handle) = seg.pages.get(&p) else {
                break;
            };
            match device_calls::unmap_page(dev, DevicePtr(seg.page_addr(p)), page) {
                Ok(()) => {
                    seg.pages.remove(&p);
                    out.push(SparePage {
                        handle,
                        size: page,
                        pool: kind,
                    });
                }
                Err(source) => {
                    res = Err(backend("unmap")(source));
                    break;
                }
            }
        }
        if !out.is_empty() {
            let start = base + (first * page) as u64;
            self.mark_unmapped(id, start, out.len() * page);
        }
        (out, res)
    }

    /// `unmap_block`'s surgery: `[start, start + bytes)` of free block `id` lost its pages; the
    /// mapped parts before and after become free blocks of their own.
    fn mark_unmapped(&mut self, id: BlockId, start: u64, bytes: usize) {
        self.uncache_block(id);
        let (ptr, size, stream, kind, prev, next) = {
            let b = self.block(id);
            (b.ptr, b.size, b.stream, b.pool, b.prev, b.next)
        };
        let before = (start - ptr) as usize;
        if before > 0 {
            let mut bf = Block::new(ptr, before, stream, kind);
            bf.expandable = true;
            bf.prev = prev;
            bf.next = Some(id);
            let bid = self.arena.insert(bf);
            if let Some(p) = prev {
                self.block_mut(p).next = Some(bid);
            }
            self.block_mut(id).prev = Some(bid);
            self.cache_block(bid);
        }
        let after = size - before - bytes;
        if after > 0 {
            let mut af = Block::new(start + bytes as u64, after, stream, kind);
            af.expandable = true;
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
        let prev = self.block(id).prev;
        self.try_merge_blocks(id, prev);
        let next = self.block(id).next;
        self.try_merge_blocks(id, next);
        let ptr = self.block(id).ptr;
        self.pool(kind).unmapped.insert((stream, ptr, id));
        self.stats.num_device_free += 1;
    }

    /// Gives physical pages back to the device; pages that cannot be released stay spare.
    fn release_pages<B: DeviceBackend>(&mut self, dev: &B, pages: Vec<SparePage>) -> Result<()> {
        let mut first_err = None;
        for sp in pages {
            match device_calls::release_unmapped_page(dev, sp.handle, sp.size) {
                Ok(()) => {
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

    /// Releases every spare page.
    pub(super) fn release_spare_pages<B: DeviceBackend>(&mut self, dev: &B) -> Result<()> {
        let pages = std::mem::take(&mut self.spare_pages);
        self.release_pages(dev, pages)
    }

    /// `release_blocks` for expandable segments of one pool: unmaps the whole pages inside every
    /// free block and releases them, dropping segments left wholly unmapped.
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
            let Some(base) = self.vm_segment_of(b.ptr) else {
                continue;
            };
            let (first, last, stream) = {
                let seg = &self.vm_segments[&base];
                (seg.page_right(b.ptr), seg.page_left(b.end()), seg.stream)
            };
            if last > first {
                // "MemUnmap and MemRelease do not appear to synchronize": wait for the stream.
                dev.synchronize_stream(stream)
                    .map_err(backend("synchronize_stream"))?;
                let (pages, res) = self.unmap_pages(dev, id, first, last - first);
                let rel = self.release_pages(dev, pages);
                res?;
                rel?;
            }
            let b = self.block(id);
            if !b.mapped && !b.is_split() {
                self.release_expandable_segment(dev, id)?;
            }
        }
        Ok(())
    }

    /// `release_expandable_segment`: frees the address range of a wholly unmapped segment.
    fn release_expandable_segment<B: DeviceBackend>(&mut self, dev: &B, id: BlockId) -> Result<()> {
        let (base, size, stream, kind) = {
            let b = self.block(id);
            (b.ptr, b.size, b.stream, b.pool)
        };
        device_calls::release_range(dev, DevicePtr(base), size)
            .map_err(backend("release_address_range"))?;
        self.pool(kind).unmapped.remove(&(stream, base, id));
        self.arena.remove(id);
        self.segments.remove(&base);
        self.vm_segments.remove(&base);
        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), base = %DevicePtr(base), "expandable segment released");
        Ok(())
    }
}
