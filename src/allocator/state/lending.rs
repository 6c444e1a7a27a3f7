//! Lent pages (crate key `cca_page_lending`, on in the crate's default, off in the PyTorch
//! presets): how a growing expandable segment takes free pages whose page fence is still
//! pending, without waiting for them and without creating new memory (`docs/algorithm.md`,
//! step 23b). May use: `state`, `block`, `expandable`'s page records, `page_fence`, `backend`.
//!
//! Note [Lent pages]: page reuse (Note [Page reuse]) unmaps a free page before mapping its
//! physical memory where a growth needs it, and `cuMemUnmap` is not stream-ordered, so the page
//! must be idle first (Note [Page fences]); a page whose fence is pending used to stay where it
//! was while the growth created new memory. But *mapping* is not the problem: a physical handle
//! may be mapped at two address ranges at once (the driver allows it; `gpu/probes/
//! vmm_alias_host.cu` measured it on the H100), both views addressing the same bytes. So a
//! growth may *lend* such a page:
//!
//! 1. An event covering the page's free stamp is found among its stream's pending fences, or
//!    recorded now (it completes once everything queued on that stream before it, including
//!    every use of the page, is done).
//! 2. If the growth is for another stream, that stream waits on the event (`stream_wait_event`:
//!    stream-ordered, the host never blocks). The new owner's work, queued later on the growing
//!    stream, therefore runs after the page's last use. On the page's own stream, stream order
//!    gives the same.
//! 3. The handle leaves the old segment's page table and is mapped again where the growth needs
//!    it (`map_block`, as for any reused page). The old range becomes a *lent* block: unmapped
//!    in the cache's books, still mapped on the device, neither free nor in the `unmapped` set,
//!    never merged with its neighbours, so no growth maps over it and no allocation lands in
//!    it. Its `LentRange` remembers the old mappings, the stream and the stamp.
//! 4. Once a fence on that stream covering the stamp is seen complete (polled at each growth,
//!    never waited for), the old mappings are unmapped and the block becomes an ordinary
//!    unmapped block, merged with its unmapped neighbours. `empty_cache` and the out-of-memory
//!    path, which may synchronize, synchronize the stream and unmap what is still lent before
//!    they release anything (a handle may not be released while mapped).
//!
//! Two more rules keep the lent bytes' old uses ordered before every later owner:
//!
//! * The block the lent pages are mapped into gets a fresh free stamp (not 0, as fresh memory
//!   does): moving those pages on again needs a fence on the growing stream recorded after the
//!   event wait of step 2, which completes only after the old uses too.
//! * A lent handle that ends up spare (the growth failed after lending) is not taken from the
//!   spare pages while its old mapping is in place.
//!
//! Nothing is lent while a graph capture is underway (page reuse is off then), and nothing is
//! lent when no event can be recorded: the growth creates new memory instead, as before.
//!
//! Note [Unmaps off the allocating thread] (crate key `cca_unmap_helper`, on in the default): a
//! page move costs an unmap at the old address, a map and an access setting at the new one, all
//! on the thread that allocates, whose host time is the step's in a host-bound program (FSDP2's
//! growth steps). The unmap need not be there: since a handle may be mapped at two addresses,
//! the move can map first and unmap later, and a thread making VMM calls does not hold up
//! another thread's launches (`gpu/probes/vmm_threads.cu`). So, when the backend has a helper
//! thread ([`DeviceBackend::unmaps_off_thread`]: a CUDA device):
//!
//! 1. A growth that reuses an *idle* page (its fence complete, Note [Page fences]) lends it as
//!    above, marked `idle`: no event wait, and the new block keeps the stamp of fresh memory.
//!    The move counts as a device free (`num_device_free`) then, as the unmap would without the
//!    helper, not when the helper's job comes back.
//! 2. Once the growth has mapped its pages, every lent block whose uses are complete (idle
//!    ones, and loans whose fence has since completed) is handed to the helper
//!    ([`DeviceBackend::unmap_later`]): its old mappings are queued there, and the block stays
//!    lent (out of every set, never merged or mapped over, its handles neither spare-reused nor
//!    released) while the job runs. Handing off after the growth, not during it, matters: the
//!    driver serializes VMM calls across threads, so unmaps beside the growth's own maps would
//!    only slow those down (`gpu/probes/vmm_deferred_unmap.cu`).
//! 3. The next growth first waits for the helper's jobs ([`DeviceBackend::wait_unmaps`]) and
//!    takes them back ([`DeviceBackend::finished_unmaps`]): a block with no old mapping left
//!    becomes an ordinary unmapped block; one whose job stopped at an error stays lent and is
//!    tried again. Waiting keeps the growth's layout what it would have been had this thread
//!    unmapped the pages itself: a first version that let old ranges stay lent until the
//!    helper happened to finish moved a fifth to two thirds more pages on `SimDevice` (the
//!    FSDP2 and checkpointed recordings, its jobs run three polls late) and doubled FSDP2's device time per
//!    step on two H200s. Loans that became idle meanwhile are unmapped by the growing thread
//!    then, as without the helper; only what is idle once the growth has mapped goes to it.
//!    Until its job comes back, an idle move's old range counts as the unmapped block it would
//!    be without the helper wherever the cache decides something between growths (best fit's
//!    room to grow, a cross-stream handover, `forget_stream`: `State::unmapped_or_moving`).
//! 4. `empty_cache`, the out-of-memory path and `enable_peer_access` wait for the helper first
//!    ([`DeviceBackend::wait_unmaps`]), so nothing they release or grant is being unmapped.
//!
//! The memory is the same (the old mapping holds no bytes of its own); an old address range
//! comes back to use a little later. A backend without a helper (the simulated device unless
//! `SimDevice::set_unmap_helper` gives it one) takes the growing thread's unmaps as before.
#![forbid(unsafe_code)]

use super::State;
use super::expandable::{Reclaim, SparePage};
use crate::allocator::block::BlockId;
use crate::allocator::device_calls;
use crate::allocator::segment_events::SegmentAction;
use crate::backend::{DeviceAddr, DeviceBackend, EventHandle, PhysicalHandle, StreamId};
use crate::error::{AllocError, Result};
use crate::trace::TraceOp;

/// A lent block: its old mappings, still in place, and what must complete before they go.
#[derive(Clone, Debug)]
pub(crate) struct LentRange {
    /// The lent block (unmapped in the cache's books, `Block::lent`).
    pub(crate) block: BlockId,
    /// The old mappings not yet unmapped: (address, bytes, handle), in address order.
    pub(crate) maps: Vec<(u64, usize, PhysicalHandle)>,
    /// The stream whose queued work may still use the old mappings.
    pub(crate) stream: StreamId,
    /// The block's free stamp when it was lent: a fence on `stream` at or after it ends the
    /// old uses.
    pub(crate) stamp: u64,
    /// Whether the old uses were complete when the pages moved (an idle page moved with its
    /// unmap left to the helper, Note [Unmaps off the allocating thread]): the new owner waited
    /// for nothing, so its block keeps the stamp of fresh memory.
    pub(crate) idle: bool,
    /// The helper's job unmapping the old mappings, while it runs.
    pub(crate) ticket: Option<u64>,
}

impl State {
    /// Whether a growth may lend pages whose fence is pending (configured, fences in use, and
    /// no capture underway).
    pub(super) fn lending_on(&self) -> bool {
        self.config.page_lending && self.fenced_reuse() && !self.capture_underway()
    }

    /// Whether `handle` is still mapped at a lent block's old address.
    pub(super) fn handle_lent(&self, handle: PhysicalHandle) -> bool {
        self.lent
            .iter()
            .any(|r| r.maps.iter().any(|&(_, _, h)| h == handle))
    }

    /// Whether `handle` is still mapped at the old address of a block lent while its uses were
    /// pending (not an idle move whose unmap went to the helper).
    pub(super) fn handle_lent_pending(&self, handle: PhysicalHandle) -> bool {
        self.lent
            .iter()
            .any(|r| !r.idle && r.maps.iter().any(|&(_, _, h)| h == handle))
    }

    /// Whether block `id` is unmapped, or lent by an idle move whose unmap is left to the helper
    /// (Note [Unmaps off the allocating thread]): such a block becomes an ordinary unmapped block
    /// once the helper's job comes back, and without the helper it would be one already. What
    /// the cache decides between growths (best fit's growable room, a segment handed to another
    /// stream, a stream forgotten) counts it as unmapped, so the helper changes no layout.
    pub(super) fn unmapped_or_moving(&self, id: BlockId) -> bool {
        let b = self.block(id);
        !b.mapped && (!b.lent || self.lent.iter().any(|r| r.block == id && r.idle))
    }

    /// Whether moved pages' old mappings are left to the backend's helper thread (Note [Unmaps
    /// off the allocating thread]): configured, the backend has a helper, no capture underway.
    pub(super) fn unmaps_offloaded<B: DeviceBackend>(&self, dev: &B) -> bool {
        self.config.unmap_helper && dev.unmaps_off_thread() && !self.capture_underway()
    }

    /// Lends the pages `plan` names (blocks whose fence is pending) to a growth of `stream`'s
    /// segment (steps 1–3 of Note [Lent pages]). Returns the handles (counted as reserved in
    /// their old pool, unmapped nowhere) and how many bytes they hold. A block whose event
    /// cannot be had or waited on is skipped (nothing changes for it).
    pub(super) fn lend_pages<B: DeviceBackend>(
        &mut self,
        dev: &B,
        plan: Vec<Reclaim>,
        stream: StreamId,
    ) -> (Vec<SparePage>, usize) {
        let mut got = Vec::new();
        let mut bytes = 0usize;
        let mut waited: Vec<EventHandle> = Vec::new();
        for r in plan {
            let (old_stream, stamp) = {
                let b = self.block(r.id);
                (b.stream, b.free_stamp)
            };
            let Some(ev) = self.covering_fence(dev, old_stream, stamp) else {
                continue;
            };
            if old_stream != stream && !waited.contains(&ev) {
                if let Err(e) = dev.stream_wait_event(stream, ev) {
                    tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, %stream, "page lending: event wait failed");
                    continue;
                }
                waited.push(ev);
            }
            let mut cur = Some(r.id);
            for (first, count) in r.runs {
                let Some(id) = cur else { break };
                let (pages, below) = self.lend_run(id, first, count, old_stream, stamp, false);
                bytes += pages.iter().map(|p| p.size).sum::<usize>();
                got.extend(pages);
                cur = below;
            }
        }
        (got, bytes)
    }

    /// Takes the handles tiling pages `[first, first + count)` of free mapped block `id` out of
    /// its segment's page table, leaving them mapped on the device, and makes that range a lent
    /// block (`idle`: its uses are complete, the unmap is only left for later). Returns the
    /// handles and the free block left below the range (if any).
    pub(super) fn lend_run(
        &mut self,
        id: BlockId,
        first: usize,
        count: usize,
        stream: StreamId,
        stamp: u64,
        idle: bool,
    ) -> (Vec<SparePage>, Option<BlockId>) {
        let ptr = self.block(id).ptr;
        let Some(base) = self.vm_segment_of(ptr) else {
            return (Vec::new(), Some(id));
        };
        let Some(seg) = self.vm_segments.get_mut(&base) else {
            return (Vec::new(), Some(id));
        };
        let (page, kind) = (seg.page_size, seg.pool);
        let mut out = Vec::new();
        let mut maps = Vec::new();
        let mut at = first;
        while at < first + count {
            let Some((handle, n)) = seg.handles.remove(&at) else {
                break;
            };
            seg.mapped_pages -= n;
            maps.push((seg.page_addr(at), n * page, handle));
            out.push(SparePage {
                handle,
                size: n * page,
                pool: kind,
            });
            at += n;
        }
        if at == first {
            return (out, Some(id));
        }
        let start = base + (first * page) as u64;
        let below = self.split_out(id, start, (at - first) * page);
        self.block_mut(id).lent = true;
        if idle {
            // The device free of the unmap this thread would have made here (Note [Unmaps off
            // the allocating thread]): counted now, as without the helper, not when the
            // helper's job comes back.
            self.stats.num_device_free += 1;
        } else {
            self.page_loans += 1;
        }
        self.lent.push(LentRange {
            block: id,
            maps,
            stream,
            stamp,
            idle,
            ticket: None,
        });
        (out, below)
    }

    /// Step 4 of Note [Lent pages]: takes back the blocks whose unmaps the helper finished
    /// (waiting for it: Note [Unmaps off the allocating thread]), then unmaps the old mappings
    /// of every lent block whose fence has completed (polled by the caller) and returns those
    /// blocks to the unmapped set. With `synchronize` (only `empty_cache` and the out-of-memory
    /// path), waits for the streams of the others first, so that nothing stays lent.
    ///
    /// # Errors
    ///
    /// With `synchronize`, the first failed synchronization or unmap (what was unmapped so far
    /// stays unmapped, the rest stays lent). Without it, failures leave the block lent for a
    /// later try and are not errors.
    pub(super) fn settle_lent<B: DeviceBackend>(
        &mut self,
        dev: &B,
        synchronize: bool,
    ) -> Result<()> {
        if self.lent.is_empty() || self.capture_underway() {
            return Ok(());
        }
        // Note [Unmaps off the allocating thread], step 3: the helper's jobs first, waited for,
        // so the growth plans over the same layout as if this thread had unmapped them.
        self.collect_unmaps(dev);
        if synchronize && self.lent.iter().any(|r| r.ticket.is_some()) {
            // A job the helper never reported: its ranges may still be mapped, so nothing may
            // be released.
            return Err(AllocError::Backend {
                operation: "unmap",
                source: crate::backend::BackendError::Unsupported(
                    "the unmap helper did not report a queued job",
                ),
            });
        }
        let mut synced: Vec<StreamId> = Vec::new();
        let mut i = 0;
        while i < self.lent.len() {
            let (stream, stamp) = (self.lent[i].stream, self.lent[i].stamp);
            if self.lent[i].ticket.is_some() {
                // Left by a helper that stopped: tried again once it reports the job.
                i += 1;
                continue;
            }
            if !self.fences.idle(stream, stamp) {
                if !synchronize {
                    i += 1;
                    continue;
                }
                if !synced.contains(&stream) {
                    dev.synchronize_stream(stream)
                        .map_err(|source| AllocError::Backend {
                            operation: "synchronize_stream",
                            source,
                        })?;
                    synced.push(stream);
                }
            }
            while let Some(&(va, bytes, _)) = self.lent[i].maps.last() {
                match device_calls::unmap_page(dev, DeviceAddr(va), bytes) {
                    Ok(()) => {
                        self.lent[i].maps.pop();
                    }
                    Err(source) if synchronize => {
                        return Err(AllocError::Backend {
                            operation: "unmap",
                            source,
                        });
                    }
                    Err(e) => {
                        tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, "lent page: unmap failed, left lent for now");
                        break;
                    }
                }
            }
            if self.lent[i].maps.is_empty() {
                let r = self.lent.remove(i);
                self.end_lending(dev, &r);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Hands the old mappings of every lent block whose uses are complete to the helper (Note
    /// [Unmaps off the allocating thread]): called once a growth has mapped its pages, so the
    /// helper's unmaps run while the program goes on, not beside the growth's own calls.
    pub(super) fn offload_settled<B: DeviceBackend>(&mut self, dev: &B) {
        if !self.unmaps_offloaded(dev) {
            return;
        }
        for i in 0..self.lent.len() {
            let r = &self.lent[i];
            if r.ticket.is_none() && self.fences.idle(r.stream, r.stamp) {
                self.hand_to_helper(dev, i);
            }
        }
    }

    /// Queues the old mappings of lent block `i` (its uses complete) on the helper; if it
    /// refuses, the block stays for the growing thread to unmap.
    fn hand_to_helper<B: DeviceBackend>(&mut self, dev: &B, i: usize) {
        let ranges: Vec<(DeviceAddr, usize)> = self.lent[i]
            .maps
            .iter()
            .rev()
            .map(|&(va, bytes, _)| (DeviceAddr(va), bytes))
            .collect();
        if ranges.is_empty() {
            return;
        }
        let pages = ranges.len() as u64;
        match device_calls::unmap_pages_later(dev, ranges) {
            Ok(ticket) => {
                self.lent[i].ticket = Some(ticket);
                self.unmaps_handed_off += pages;
            }
            Err(e) => {
                tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, "lent page: the helper refused the unmaps; unmapping here");
            }
        }
    }

    /// Waits for the helper's jobs and takes back their lent blocks: what a job unmapped leaves
    /// the block's list of old mappings; a block with none left becomes an ordinary unmapped
    /// block, one whose job stopped at an error stays lent for a later try.
    pub(crate) fn collect_unmaps<B: DeviceBackend>(&mut self, dev: &B) {
        let tickets: Vec<u64> = self.lent.iter().filter_map(|r| r.ticket).collect();
        if tickets.is_empty() {
            return;
        }
        dev.wait_unmaps();
        for f in dev.finished_unmaps(&tickets) {
            let Some(i) = self.lent.iter().position(|r| r.ticket == Some(f.ticket)) else {
                continue;
            };
            let r = &mut self.lent[i];
            r.ticket = None;
            // The job unmapped the list from its end (`hand_to_helper`).
            let left = r.maps.len().saturating_sub(f.unmapped);
            r.maps.truncate(left);
            if let Some(e) = f.error {
                tracing::debug!(target: "cuda_caching_allocator", device = dev.device_index(), error = %e, "lent page: the helper's unmap failed, left lent for now");
            }
            if self.lent[i].maps.is_empty() {
                let r = self.lent.remove(i);
                self.end_lending(dev, &r);
            }
        }
    }

    /// A lent block whose old mappings are gone becomes an ordinary unmapped block, counted as a
    /// device free unless it was an idle move (counted when it was lent).
    fn end_lending<B: DeviceBackend>(&mut self, dev: &B, r: &LentRange) {
        let id = r.block;
        let (ptr, size, stream, owner) = {
            let b = self.block_mut(id);
            b.lent = false;
            (b.ptr, b.size, b.stream, b.owner)
        };
        if let Some(h) = &mut self.history {
            h.op(TraceOp::SegmentUnmap {
                addr: ptr,
                size: size as u64,
                stream: stream.0,
            });
        }
        self.file_unmapped(id);
        if !r.idle {
            self.stats.num_device_free += 1;
        }
        self.segment_event(dev, SegmentAction::Unmap, ptr, size, stream, owner);
    }
}
