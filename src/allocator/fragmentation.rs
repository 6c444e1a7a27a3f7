//! The fragmentation report: where the reserved bytes are at one moment, the free-block size
//! histogram, and the fragmentation metrics of `reference/other-allocators.md` §5.2, each named.
//! May use: `state`, `block`, `format`.
#![forbid(unsafe_code)]

use std::fmt;

use super::state::State;
use crate::format::format_size;

/// Free cached blocks whose size lies in `[min_size, 2 × min_size)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeBucket {
    /// The bucket's lower bound, a power of two.
    pub min_size: usize,
    /// Free blocks in the bucket.
    pub count: usize,
    /// Their bytes.
    pub bytes: usize,
}

/// Where an allocator's reserved bytes are, and how fragmented its free memory is, at one
/// moment ([`CachingAllocator::fragmentation`](crate::CachingAllocator::fragmentation)).
///
/// `reserved_bytes = allocated_bytes + pending_free_bytes + free_bytes + spare_bytes`: device
/// segments and mapped pages hold allocated blocks, blocks waiting for stream events and free
/// cached blocks; spare pages are physical pages mapped nowhere.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FragmentationReport {
    /// Bytes reserved from the device (segments, mapped pages and spare pages).
    pub reserved_bytes: usize,
    /// Bytes of allocated blocks (rounded sizes).
    pub allocated_bytes: usize,
    /// Bytes the users asked for, of the allocated blocks.
    pub requested_bytes: usize,
    /// Bytes of freed blocks still waiting for stream events.
    pub pending_free_bytes: usize,
    /// Bytes of free cached blocks (mapped).
    pub free_bytes: usize,
    /// Number of free cached blocks.
    pub free_blocks: usize,
    /// The largest free cached block.
    pub largest_free_block: usize,
    /// Bytes of physical pages held but mapped nowhere.
    pub spare_bytes: usize,
    /// Free cached blocks by power-of-two size bucket, smallest first; empty buckets left out.
    pub histogram: Vec<FreeBucket>,
    /// Sawicki's `1 − sqrt(Σ fᵢ²) / Σ fᵢ` over the free blocks (0: at most one free block).
    pub sawicki_fragmentation: f64,
}

impl FragmentationReport {
    /// `1 − allocated / reserved`: the share of reserved memory not handed out (GMLake's and
    /// STWeaver's "fragmentation ratio" when taken at the peak). 0 when nothing is reserved.
    pub fn fragmentation(&self) -> f64 {
        if self.reserved_bytes == 0 {
            0.0
        } else {
            1.0 - self.allocated_bytes as f64 / self.reserved_bytes as f64
        }
    }

    /// `1 − largest free block / total free`: how scattered the free memory is (TF BFC's
    /// `GetFragmentation`). 0 when nothing is free.
    pub fn external_fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / self.free_bytes as f64
        }
    }

    /// Rounding waste: allocated minus requested bytes.
    pub fn internal_waste(&self) -> usize {
        self.allocated_bytes.saturating_sub(self.requested_bytes)
    }

    /// Reserved ÷ requested bytes (1.0 is the floor; 0 when nothing is requested).
    pub fn reserved_over_requested(&self) -> f64 {
        if self.requested_bytes == 0 {
            0.0
        } else {
            self.reserved_bytes as f64 / self.requested_bytes as f64
        }
    }
}

fn sawicki_of(free: &[usize]) -> f64 {
    let total: f64 = free.iter().map(|&f| f as f64).sum();
    if total == 0.0 {
        return 0.0;
    }
    let squares: f64 = free.iter().map(|&f| (f as f64) * (f as f64)).sum();
    1.0 - squares.sqrt() / total
}

impl fmt::Display for FragmentationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |part: usize| {
            if self.reserved_bytes == 0 {
                0.0
            } else {
                100.0 * part as f64 / self.reserved_bytes as f64
            }
        };
        writeln!(f, "Fragmentation report")?;
        writeln!(
            f,
            "  reserved {}: allocated {} ({:.2}%), pending free {} ({:.2}%), free cached {} ({:.2}%), spare pages {} ({:.2}%)",
            format_size(self.reserved_bytes as u64),
            format_size(self.allocated_bytes as u64),
            pct(self.allocated_bytes),
            format_size(self.pending_free_bytes as u64),
            pct(self.pending_free_bytes),
            format_size(self.free_bytes as u64),
            pct(self.free_bytes),
            format_size(self.spare_bytes as u64),
            pct(self.spare_bytes),
        )?;
        writeln!(
            f,
            "  requested {} (rounding waste {}); reserved / requested {:.4}",
            format_size(self.requested_bytes as u64),
            format_size(self.internal_waste() as u64),
            self.reserved_over_requested(),
        )?;
        writeln!(
            f,
            "  free cached blocks {}, largest {}",
            self.free_blocks,
            format_size(self.largest_free_block as u64),
        )?;
        writeln!(
            f,
            "  fragmentation 1 - allocated/reserved: {:.2}%",
            100.0 * self.fragmentation()
        )?;
        writeln!(
            f,
            "  external fragmentation 1 - largest free/total free: {:.2}%",
            100.0 * self.external_fragmentation()
        )?;
        writeln!(
            f,
            "  Sawicki fragmentation 1 - sqrt(sum f^2)/sum f: {:.2}%",
            100.0 * self.sawicki_fragmentation
        )?;
        if !self.histogram.is_empty() {
            writeln!(f, "  free blocks by size:")?;
            for b in &self.histogram {
                writeln!(
                    f,
                    "    [{:>12}, {:>12})  {:>6} blocks  {:>12}",
                    format_size(b.min_size as u64),
                    format_size((b.min_size as u64).saturating_mul(2)),
                    b.count,
                    format_size(b.bytes as u64),
                )?;
            }
        }
        Ok(())
    }
}

/// Walks the blocks once.
pub(crate) fn take(st: &State) -> FragmentationReport {
    let mut r = FragmentationReport {
        reserved_bytes: st.total_allocated_memory,
        ..FragmentationReport::default()
    };
    let mut buckets = [FreeBucket::default(); usize::BITS as usize];
    let mut free_sizes = Vec::new();
    for (_, b) in st.arena.iter() {
        if !b.mapped {
            continue;
        }
        if b.allocated {
            r.allocated_bytes += b.size;
            r.requested_bytes += b.requested_size;
        } else if b.event_count > 0 || !b.stream_uses.is_empty() {
            r.pending_free_bytes += b.size;
        } else {
            r.free_bytes += b.size;
            r.free_blocks += 1;
            r.largest_free_block = r.largest_free_block.max(b.size);
            let k = (usize::BITS - 1 - b.size.max(1).leading_zeros()) as usize;
            buckets[k].min_size = 1 << k;
            buckets[k].count += 1;
            buckets[k].bytes += b.size;
            free_sizes.push(b.size);
        }
    }
    r.spare_bytes = st.spare_pages.iter().map(|p| p.size).sum();
    r.histogram = buckets.into_iter().filter(|b| b.count > 0).collect();
    r.sawicki_fragmentation = sawicki_of(&free_sizes);
    r
}
