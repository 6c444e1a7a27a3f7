//! One pinned slab: its range and the free ranges inside it, merged with their neighbours.
//! May use: nothing. Offsets are relative to the slab's base.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// A pinned slab tiled by free ranges and used ranges (live or waiting for events).
#[derive(Debug)]
pub(super) struct Slab {
    /// Bytes pinned.
    pub(super) size: usize,
    /// Free ranges, offset → length; never adjacent (merged on insert), never empty.
    pub(super) free: BTreeMap<usize, usize>,
    /// Used ranges (allocated, or freed and waiting for events), offset → length.
    pub(super) used: BTreeMap<usize, usize>,
}

impl Slab {
    /// A wholly free slab of `size` bytes.
    pub(super) fn new(size: usize) -> Self {
        let mut free = BTreeMap::new();
        free.insert(0, size);
        Slab {
            size,
            free,
            used: BTreeMap::new(),
        }
    }

    /// Whether nothing in the slab is used.
    pub(super) fn is_idle(&self) -> bool {
        self.used.is_empty()
    }

    /// Takes `len` bytes from the front of the free range at `offset` (which must hold at least
    /// `len`); returns the remainder that stays free (offset, length), if any.
    pub(super) fn take(&mut self, offset: usize, len: usize) -> Option<(usize, usize)> {
        let have = self.free.remove(&offset)?;
        self.used.insert(offset, len);
        let rest = have.checked_sub(len)?;
        if rest > 0 {
            self.free.insert(offset + len, rest);
            Some((offset + len, rest))
        } else {
            None
        }
    }

    /// The free ranges touching the used range `offset..offset + len`: the one ending at
    /// `offset` and the one starting at its end, as (offset, length).
    fn free_neighbours(&self, offset: usize, len: usize) -> [Option<(usize, usize)>; 2] {
        let end = offset.saturating_add(len);
        let before = self
            .free
            .range(..offset)
            .next_back()
            .filter(|&(&o, &l)| o.saturating_add(l) == offset)
            .map(|(&o, &l)| (o, l));
        let after = self.free.get(&end).map(|&l| (end, l));
        [before, after]
    }

    /// The length of the free range the used range at `offset` would become if given back now
    /// (itself plus its free neighbours); `None` if no used range starts there.
    pub(super) fn merged_len(&self, offset: usize) -> Option<usize> {
        let len = *self.used.get(&offset)?;
        Some(
            self.free_neighbours(offset, len)
                .iter()
                .flatten()
                .fold(len, |acc, &(_, l)| acc.saturating_add(l)),
        )
    }

    /// Returns the used range at `offset` to the free ranges, merged with free neighbours.
    /// Returns the ranges that left the free set (merged neighbours) and the merged range.
    pub(super) fn give_back(&mut self, offset: usize) -> Option<Merge> {
        let len = self.used.remove(&offset)?;
        let absorbed = self.free_neighbours(offset, len);
        let (mut start, mut end) = (offset, offset + len);
        if let Some((p_off, _)) = absorbed[0] {
            self.free.remove(&p_off);
            start = p_off;
        }
        if let Some((n_off, n_len)) = absorbed[1] {
            self.free.remove(&n_off);
            end += n_len;
        }
        self.free.insert(start, end - start);
        Some(Merge {
            absorbed,
            merged: (start, end - start),
        })
    }
}

/// The effect of [`Slab::give_back`] on the free set.
#[derive(Debug)]
pub(super) struct Merge {
    /// Free neighbours that were merged away.
    pub(super) absorbed: [Option<(usize, usize)>; 2],
    /// The resulting free range (offset, length).
    pub(super) merged: (usize, usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_len_is_what_give_back_makes() {
        let mut s = Slab::new(100);
        assert_eq!(s.take(0, 10), Some((10, 90)));
        assert_eq!(s.take(10, 20), Some((30, 70)));
        assert_eq!(s.take(30, 30), Some((60, 40)));
        // 0..10 free, 10..30 used, 30..60 used, 60..100 free.
        assert!(s.give_back(0).is_some());
        assert_eq!(s.merged_len(10), Some(30));
        assert_eq!(s.merged_len(30), Some(70));
        assert_eq!(s.merged_len(5), None);
        let m = s.give_back(10).map(|m| m.merged);
        assert_eq!(m, Some((0, 30)));
        assert_eq!(s.merged_len(30), Some(100));
        assert_eq!(s.give_back(30).map(|m| m.merged), Some((0, 100)));
        assert!(s.is_idle());
    }
}
