//! Per-thread statistics of the fast path, summed with the core's on read.
//!
//! The core counts a block it handed to the fast path as allocated until the block comes back
//! (its view). The user's view differs only for blocks the fast path holds: a block freed into a
//! front cache is no longer allocated for the user, and a cache hit allocates it again with a new
//! requested size. Each thread cache keeps that difference as a [`Delta`]; `memory_stats()` is
//! `core + Σ deltas`, exactly, for `current`, `allocated` and `freed`.
//!
//! Peaks cannot be summed. Each thread cache keeps a base (the user-view values when it last
//! synchronised under the core lock, less its own delta) and the largest delta values reached
//! since; their sum is a peak candidate, folded into the user-view peaks at the next
//! synchronisation (see `local::Local`).
//! With one thread using the allocator this is exact (nothing else moves the core in between);
//! see Note [Peaks with several threads] in `front/mod.rs`.
//!
//! May use: `stats`, `size_class`.
#![forbid(unsafe_code)]

use crate::size_class::PoolKind;
use crate::stats::{MemoryStats, StatArray, StatType};

/// Index of a pool in the three-slot arrays (`all` is 0).
#[inline]
fn pool_index(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

/// `current`, `allocated` and `freed` of one counter (the peak is kept apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Acc {
    pub(crate) current: i64,
    pub(crate) allocated: i64,
    pub(crate) freed: i64,
}

/// One quantity (a count, bytes, or requested bytes) for `all`, `small_pool`, `large_pool`.
pub(crate) type Triple = [Acc; 3];

/// What the user's view adds to the core's, for the blocks one thread cache manages.
///
/// `count` applies to `allocation` and `active`, `bytes` to `allocated_bytes` and
/// `active_bytes`, `req` to `requested_bytes` (the fast path never holds event-pending blocks, so
/// the allocated and active views move together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Delta {
    pub(crate) count: Triple,
    pub(crate) bytes: Triple,
    pub(crate) req: Triple,
}

/// The five user-view statistics the fast path changes, `current` only, flat: statistic `s`
/// (`allocation`, `active`, `allocated_bytes`, `active_bytes`, `requested_bytes`) and pool `p`
/// (`all`, small, large) at `3 * s + p`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Five(pub(crate) [i64; 15]);

impl Delta {
    /// Moves a block's contribution `c = [count, bytes, requested]` out of `current` into
    /// `freed` (`sign = 1`), or back (`sign = -1`).
    pub(crate) fn retire(&mut self, kind: PoolKind, c: [i64; 3], sign: i64) {
        for p in [0, pool_index(kind)] {
            for (t, &v) in [&mut self.count, &mut self.bytes, &mut self.req]
                .into_iter()
                .zip(c.iter())
            {
                t[p].current -= sign * v;
                t[p].freed += sign * v;
            }
        }
    }

    /// `self - other`, counter by counter.
    pub(crate) fn minus(&self, other: &Delta) -> Delta {
        let mut d = *self;
        for (dst, src) in [
            (&mut d.count, &other.count),
            (&mut d.bytes, &other.bytes),
            (&mut d.req, &other.req),
        ] {
            for (a, b) in dst.iter_mut().zip(src) {
                a.current -= b.current;
                a.allocated -= b.allocated;
                a.freed -= b.freed;
            }
        }
        d
    }

    /// `self += other`, counter by counter.
    pub(crate) fn add(&mut self, other: &Delta) {
        for (dst, src) in [
            (&mut self.count, &other.count),
            (&mut self.bytes, &other.bytes),
            (&mut self.req, &other.req),
        ] {
            for (a, b) in dst.iter_mut().zip(src) {
                a.current += b.current;
                a.allocated += b.allocated;
                a.freed += b.freed;
            }
        }
    }

    /// Zeroes `allocated` and `freed` (`reset_accumulated_memory_stats`).
    pub(crate) fn reset_accumulated(&mut self) {
        for t in [&mut self.count, &mut self.bytes, &mut self.req] {
            for a in t.iter_mut() {
                a.allocated = 0;
                a.freed = 0;
            }
        }
    }

    /// The `current` values by quantity and pool (`3 * quantity + pool`).
    pub(crate) fn currents(&self) -> [i64; 9] {
        let mut c = [0; 9];
        for (q, t) in [&self.count, &self.bytes, &self.req]
            .into_iter()
            .enumerate()
        {
            for p in 0..3 {
                c[3 * q + p] = t[p].current;
            }
        }
        c
    }

    /// The five statistics' `current` values of this delta.
    pub(crate) fn five(&self) -> Five {
        Five::of_quantities(&self.currents())
    }
}

impl Five {
    /// Expands per-quantity values (`3 * quantity + pool`: count, bytes, requested) to the five
    /// statistics (a count applies to `allocation` and `active`, bytes to `allocated_bytes` and
    /// `active_bytes`).
    #[inline]
    pub(crate) fn of_quantities(q: &[i64; 9]) -> Five {
        let mut f = [0; 15];
        f[0..3].copy_from_slice(&q[0..3]);
        f[3..6].copy_from_slice(&q[0..3]);
        f[6..9].copy_from_slice(&q[3..6]);
        f[9..12].copy_from_slice(&q[3..6]);
        f[12..15].copy_from_slice(&q[6..9]);
        Five(f)
    }

    /// The core's `current` values of the five statistics.
    #[inline]
    pub(crate) fn of_core(stats: &MemoryStats) -> Five {
        let g = |a: &StatArray| {
            [
                a.get(StatType::All).current,
                a.get(StatType::SmallPool).current,
                a.get(StatType::LargePool).current,
            ]
        };
        let (a, b, c, d, e) = (
            g(&stats.allocation),
            g(&stats.active),
            g(&stats.allocated_bytes),
            g(&stats.active_bytes),
            g(&stats.requested_bytes),
        );
        Five([
            a[0], a[1], a[2], b[0], b[1], b[2], c[0], c[1], c[2], d[0], d[1], d[2], e[0], e[1],
            e[2],
        ])
    }

    /// `self += other`.
    #[inline]
    pub(crate) fn add(&mut self, other: &Five) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    /// `self -= other`.
    #[inline]
    pub(crate) fn sub(&mut self, other: &Five) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a -= b;
        }
    }

    /// Element-wise maximum into `self`.
    #[inline]
    pub(crate) fn raise_to(&mut self, other: &Five) {
        // A store only where a value passes its peak (most do not).
        for (a, b) in self.0.iter_mut().zip(other.0) {
            if b > *a {
                *a = b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retire_and_back_balance() {
        let mut d = Delta::default();
        d.retire(PoolKind::Small, [-1, -1024, -1000], 1);
        assert_eq!((d.count[0].current, d.count[0].freed), (1, -1));
        assert_eq!((d.bytes[1].current, d.bytes[2].current), (1024, 0));
        d.retire(PoolKind::Small, [-1, -1024, -1000], -1);
        assert_eq!(d, Delta::default());
        let mut e = Delta::default();
        e.retire(PoolKind::Large, [0, 0, 300], 1);
        let mut sum = d;
        sum.add(&e);
        assert_eq!(sum.minus(&e), d);
        assert_eq!(sum.five().0[12..15], [-300, 0, -300]);
    }
}
