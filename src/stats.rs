//! Statistics with `torch.cuda.memory_stats()` semantics and exactly its 122 key names.
//!
//! A [`Stat`] holds `current / peak / allocated / freed`; `increase` and `decrease` are its only
//! mutators. Each pool-aware statistic is a [`StatArray`] of three: `all`, `small_pool`,
//! `large_pool`. [`MemoryStats`] is a plain copy of all of them, with typed access and the flat
//! key → value map ([`MemoryStats::to_map`]). May use: `size_class` (for [`PoolKind`]).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use crate::size_class::PoolKind;

/// One counter: PyTorch's `Stat { current, peak, allocated, freed }`.
///
/// The cumulative `allocated` and `freed` **saturate** at `i64::MAX` (2^63 - 1, 8 EiB of bytes)
/// instead of overflowing, where PyTorch's `int64_t` would wrap; `current` and `peak` never
/// exceed what is live, so they stay far below it. Reset the accumulated values
/// ([`Stat::reset_accumulated`]) to count again after saturation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Largest `current` since the last peak reset.
    pub peak: i64,
    /// Sum of all increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of all decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Adds `n`.
    #[inline]
    pub fn increase(&mut self, n: i64) {
        self.current = self.current.saturating_add(n);
        self.peak = self.peak.max(self.current);
        self.allocated = self.allocated.saturating_add(n);
    }

    /// Subtracts `n`.
    #[inline]
    pub fn decrease(&mut self, n: i64) {
        self.current = self.current.saturating_sub(n);
        debug_assert!(self.current >= 0, "stat went negative: {self:?}");
        self.freed = self.freed.saturating_add(n);
    }

    /// `peak = current`.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// `allocated = freed = 0`.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// Which slice of a [`StatArray`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatType {
    /// Both pools (`all`).
    All,
    /// The small pool (`small_pool`).
    SmallPool,
    /// The large pool (`large_pool`).
    LargePool,
}

impl StatType {
    /// The three, in PyTorch's order.
    pub const ALL: [StatType; 3] = [StatType::All, StatType::SmallPool, StatType::LargePool];

    /// The key segment (`all`, `small_pool`, `large_pool`).
    pub fn name(self) -> &'static str {
        match self {
            StatType::All => "all",
            StatType::SmallPool => "small_pool",
            StatType::LargePool => "large_pool",
        }
    }

    fn index(self) -> usize {
        match self {
            StatType::All => 0,
            StatType::SmallPool => 1,
            StatType::LargePool => 2,
        }
    }
}

impl From<PoolKind> for StatType {
    fn from(p: PoolKind) -> Self {
        match p {
            PoolKind::Small => StatType::SmallPool,
            PoolKind::Large => StatType::LargePool,
        }
    }
}

/// A statistic kept for `all`, `small_pool` and `large_pool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray([Stat; 3]);

impl StatArray {
    /// The slice for `t`.
    pub fn get(&self, t: StatType) -> &Stat {
        &self.0[t.index()]
    }

    /// The slice for `t`, mutable (the fast path writes its user view through it).
    pub(crate) fn get_mut(&mut self, t: StatType) -> &mut Stat {
        &mut self.0[t.index()]
    }

    /// Adds `n` to `all` and to `pool`.
    #[inline]
    pub fn increase(&mut self, pool: PoolKind, n: i64) {
        self.0[0].increase(n);
        self.0[StatType::from(pool).index()].increase(n);
    }

    /// Subtracts `n` from `all` and from `pool`.
    #[inline]
    pub fn decrease(&mut self, pool: PoolKind, n: i64) {
        self.0[0].decrease(n);
        self.0[StatType::from(pool).index()].decrease(n);
    }

    /// Moves `n` from `from`'s slice to `to`'s, leaving `all` alone (physical pages handed from
    /// one pool to the other).
    #[inline]
    pub fn transfer(&mut self, from: PoolKind, to: PoolKind, n: i64) {
        if from != to {
            self.0[StatType::from(from).index()].decrease(n);
            self.0[StatType::from(to).index()].increase(n);
        }
    }

    fn for_each(&mut self, f: impl Fn(&mut Stat)) {
        self.0.iter_mut().for_each(f);
    }
}

/// The nine pool-aware statistics, in PyTorch's key names.
pub const ARRAY_STAT_NAMES: [&str; 9] = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
];

/// Every statistic of one allocator (PyTorch's `DeviceStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Live allocations (count).
    pub allocation: StatArray,
    /// Device segments (count; not changed by expandable map/unmap).
    pub segment: StatArray,
    /// Active blocks: allocated, or freed but waiting on stream events (count).
    pub active: StatArray,
    /// Free blocks inside split segments, which cannot be released (count).
    pub inactive_split: StatArray,
    /// Bytes of live allocations (rounded block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes reserved from the device.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks inside split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes the users asked for (unrounded), of active blocks.
    pub requested_bytes: StatArray,
    /// Allocations of blocks of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Allocations that succeeded only after releasing all cached segments.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors returned.
    pub num_ooms: i64,
    /// Device-wide synchronizations to drain pending events.
    pub num_sync_all_streams: i64,
    /// Device allocations (segment allocations, or page maps with expandable segments).
    pub num_device_alloc: i64,
    /// Device frees (segment frees, or page unmaps; a page move whose unmap is left to the
    /// unmap helper counts when the pages move).
    pub num_device_free: i64,
    /// The configured `max_split_size` in bytes; -1 when unlimited (as PyTorch reports it).
    pub max_split_size: i64,
}

impl MemoryStats {
    fn arrays(&self) -> [&StatArray; 9] {
        [
            &self.allocation,
            &self.segment,
            &self.active,
            &self.inactive_split,
            &self.allocated_bytes,
            &self.reserved_bytes,
            &self.active_bytes,
            &self.inactive_split_bytes,
            &self.requested_bytes,
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The flat `torch.cuda.memory_stats()` map: 122 keys, sorted as PyTorch sorts them.
    ///
    /// ```
    /// use cuda_caching_allocator::MemoryStats;
    /// let m = MemoryStats::default().to_map();
    /// assert_eq!(m.len(), 122);
    /// assert!(m.contains_key("allocated_bytes.all.peak"));
    /// ```
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        let metric = |s: &Stat| {
            [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ]
        };
        for (name, arr) in ARRAY_STAT_NAMES.iter().zip(self.arrays()) {
            for t in StatType::ALL {
                for (k, v) in metric(arr.get(t)) {
                    m.insert(format!("{name}.{}.{k}", t.name()), v);
                }
            }
        }
        for (name, s) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            for (k, v) in metric(s) {
                m.insert(format!("{name}.{k}"), v);
            }
        }
        m.insert("num_alloc_retries".into(), self.num_alloc_retries);
        m.insert("num_ooms".into(), self.num_ooms);
        m.insert("num_sync_all_streams".into(), self.num_sync_all_streams);
        m.insert("num_device_alloc".into(), self.num_device_alloc);
        m.insert("num_device_free".into(), self.num_device_free);
        m.insert("max_split_size".into(), self.max_split_size);
        m
    }

    /// One value by its `memory_stats()` key, or `None` for an unknown key.
    pub fn get(&self, key: &str) -> Option<i64> {
        let parts: Vec<&str> = key.split('.').collect();
        let pick = |s: &Stat, m: &str| match m {
            "current" => Some(s.current),
            "peak" => Some(s.peak),
            "allocated" => Some(s.allocated),
            "freed" => Some(s.freed),
            _ => None,
        };
        match parts.as_slice() {
            [name, pool, m] => {
                let i = ARRAY_STAT_NAMES.iter().position(|n| n == name)?;
                let t = StatType::ALL.into_iter().find(|t| t.name() == *pool)?;
                pick(self.arrays()[i].get(t), m)
            }
            ["oversize_allocations", m] => pick(&self.oversize_allocations, m),
            ["oversize_segments", m] => pick(&self.oversize_segments, m),
            ["num_alloc_retries"] => Some(self.num_alloc_retries),
            ["num_ooms"] => Some(self.num_ooms),
            ["num_sync_all_streams"] => Some(self.num_sync_all_streams),
            ["num_device_alloc"] => Some(self.num_device_alloc),
            ["num_device_free"] => Some(self.num_device_free),
            ["max_split_size"] => Some(self.max_split_size),
            _ => None,
        }
    }

    /// `reset_peak_memory_stats`: every `peak` becomes `current`.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// `reset_accumulated_memory_stats`: every `allocated` / `freed` and the five `num_*`
    /// counters become 0.
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// `memory_allocated()`: `allocated_bytes.all.current`.
    pub fn memory_allocated(&self) -> i64 {
        self.allocated_bytes.get(StatType::All).current
    }

    /// `memory_reserved()`: `reserved_bytes.all.current`.
    pub fn memory_reserved(&self) -> i64 {
        self.reserved_bytes.get(StatType::All).current
    }

    /// `max_memory_allocated()`.
    pub fn max_memory_allocated(&self) -> i64 {
        self.allocated_bytes.get(StatType::All).peak
    }

    /// `max_memory_reserved()`.
    pub fn max_memory_reserved(&self) -> i64 {
        self.reserved_bytes.get(StatType::All).peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#14): after 2^63 cumulative bytes the accumulators overflowed (a panic in
    /// debug builds, negative totals in release); they saturate now.
    #[test]
    fn accumulated_values_saturate() {
        let mut s = Stat::default();
        let chunk = 1i64 << 62;
        for _ in 0..4 {
            s.increase(chunk);
            s.decrease(chunk);
        }
        assert_eq!((s.current, s.peak), (0, chunk));
        assert_eq!((s.allocated, s.freed), (i64::MAX, i64::MAX));
        s.reset_accumulated();
        s.increase(5);
        assert_eq!((s.allocated, s.freed), (5, 0));
    }

    #[test]
    fn stat_semantics() {
        let mut s = Stat::default();
        s.increase(5);
        s.decrease(3);
        s.increase(1);
        assert_eq!(
            s,
            Stat {
                current: 3,
                peak: 5,
                allocated: 6,
                freed: 3
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 3);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed), (0, 0));
    }

    #[test]
    fn map_has_pytorchs_122_keys_and_get_agrees() {
        let mut st = MemoryStats::default();
        st.allocated_bytes.increase(PoolKind::Small, 512);
        st.max_split_size = -1;
        let m = st.to_map();
        assert_eq!(m.len(), 122);
        for (k, v) in &m {
            assert_eq!(st.get(k), Some(*v), "{k}");
        }
        assert_eq!(m["allocated_bytes.small_pool.current"], 512);
        assert_eq!(m["allocated_bytes.large_pool.current"], 0);
        assert_eq!(st.get("nope"), None);
    }
}
