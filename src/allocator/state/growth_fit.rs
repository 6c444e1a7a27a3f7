//! Where an expandable segment grows once its growth raises reserved memory past the page-reuse
//! slack (part of page reuse, `cca_page_reuse`; `docs/algorithm.md`, step 23c). May use:
//! `state`, `block`, `config`.
//!
//! Note [Fewest-pages growth]: PyTorch's `find_expandable_block` grows at the lowest address
//! where a free block and the unmapped blocks after it have room. Each unmapped stretch inside
//! a segment (a hole, which page reuse leaves where it took pages) is edged by free bytes in
//! pages that live blocks share: those bytes can be reserved again only by a growth that maps
//! the hole and runs across them. When the growth must create memory beyond the slack
//! (`reserved + request > (1 + cca_page_reuse_slack) × max(peak allocated, allocated +
//! request)`, the bound under which page reuse prefers new pages), every page it maps at a
//! place with fewer free bytes around costs memory for as long as the blocks around stay. So
//! there, among the runs with room, the growth takes the one that maps the fewest pages, the
//! lowest address among equals; below the slack it keeps PyTorch's rule (where the memory is
//! new anyway, and the lowest address keeps later blocks where PyTorch would put them).
//!
//! With a minimum growth (`cca_min_growth_mb`, as in the `lean-fast` preset) the rule stays
//! off: such a growth maps ahead of need at the segment's end on purpose, which is the opposite
//! aim (measured, the rule raised `lean-fast`'s bert_varlen from 1.0124 to 1.0132 × live).
//!
//! A run is taken over the lowest one only when it maps at least [`MIN_SAVING`] fewer pages: a
//! single page is within what the rounding of a run's last page gives or takes, not worth
//! leaving PyTorch's placement for (taken too, one-page savings raised the recorded `generate`
//! client from 1.0275 to 1.0340 × live without the fast path's Note [Cached blocks next to free
//! memory], and cost 0.5% more modeled device time on synth_capped_training with it). Measured
//! on `SimDevice` (`benches/README.md`, "Memory on SimDevice"): with that note, the rule brings
//! `generate` from 1.0209 to 1.0176 × live (the default without the fast path from 1.0209 to
//! 1.0078) and leaves every other trace of the device-cost table (seeds 1 and 2 of the
//! synthetic ones) and `ckpt` at or below its old peak (synth_many_streams, seed 2: 1.0102 →
//! 1.0095); on further seeds of the synthetic traces it moves peaks by about ±0.1% of live
//! either way, as any change of placement does.
#![forbid(unsafe_code)]

use super::State;
use crate::allocator::block::BlockId;
use crate::config::PageReuse;

/// Pages a run must save over the lowest run to be taken instead (Note [Fewest-pages growth]).
pub(super) const MIN_SAVING: usize = 2;

/// What [`State::slack_limit`] measures.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlackLimit {
    /// Allocated bytes after the request.
    pub(super) after: usize,
    /// Peak allocated bytes so far.
    pub(super) peak: usize,
    /// Reserved bytes the page-reuse slack allows.
    pub(super) limit: usize,
}

impl State {
    /// Whether a growth for `size` bytes takes the fewest-pages run (Note [Fewest-pages growth]):
    /// page reuse is on, no minimum growth is set, and creating the request's bytes would take
    /// reserved memory past the slack.
    pub(super) fn fewest_pages_growth(&self, size: usize) -> bool {
        if self.config.page_reuse == PageReuse::Off || self.config.expandable_min_growth > 0 {
            return false;
        }
        self.total_allocated_memory.saturating_add(size) > self.slack_limit(size).limit
    }

    /// The allocated bytes after a request of `size` bytes, their peak so far, and the reserved
    /// bytes the page-reuse slack allows: `(1 + cca_page_reuse_slack) × max(after, peak)`. The
    /// one measure behind the slack's rules (`acquire_pages`, Note [Fewest-pages growth], Note
    /// [Flush before a new peak]).
    ///
    /// Note [The policy's own peak]: the peak here is the all-time one. The statistics' peak
    /// is the program's to reset (`torch.cuda.reset_peak_memory_stats()`, which training loops
    /// call every step to log each step's peak), and PyTorch's allocator decides nothing by it.
    /// Read from the statistics alone, a reset made every allocation past it a new peak: the
    /// page-move budget's count restarted at each, so a rotating queue moved pages for ever
    /// (12,534 unmaps in 20,000 pairs with a reset every 16 events, against 837), the slack
    /// shrank to the current step's bytes, and growths flushed every front cache as if they
    /// set a new peak. `State::reset_peak_stats`, the one way to reset them, keeps the peak it
    /// clears in `allocated_peak_before_reset`.
    pub(super) fn slack_limit(&self, size: usize) -> SlackLimit {
        let after = (self.stats.memory_allocated().max(0) as usize).saturating_add(size);
        let peak = (self.stats.max_memory_allocated().max(0) as usize)
            .max(self.allocated_peak_before_reset);
        let limit = (after.max(peak) as f64 * (1.0 + self.config.page_reuse_slack)) as usize;
        SlackLimit { after, peak, limit }
    }

    /// The pages of `page` bytes a growth of `size` bytes starting at free-or-unmapped block
    /// `start` would map, walking the free and unmapped blocks after it; `None` when the run is
    /// shorter than `size`. (Unmapped blocks start on a page boundary.)
    pub(super) fn run_pages(&self, start: BlockId, size: usize, page: usize) -> Option<usize> {
        let mut bytes = 0usize;
        let mut pages = 0usize;
        let mut cur = Some(start);
        while let Some(id) = cur {
            if bytes >= size || !self.allocatable(id) {
                break;
            }
            let b = self.block(id);
            if !b.mapped {
                pages += b.size.min(size - bytes).div_ceil(page);
            }
            bytes += b.size;
            cur = b.next;
        }
        (bytes >= size).then_some(pages)
    }
}
