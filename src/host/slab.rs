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

    /// Returns the used range at `offset` to the free ranges, merged with free neighbours.
    /// Returns the ranges that left the free set (merged neighbours) and the merged range.
    pub(super) fn give_back(&mut self, offset: usize) -> Option<Merge> {
        let len = self.used.remove(&offset)?;
        let mut start = offset;
        let mut end = offset + len;
        let mut absorbed = [None, None];
        if let Some((&p_off, &p_len)) = self.free.range(..offset).next_back() {
            if p_off + p_len == offset {
                self.free.remove(&p_off);
                absorbed[0] = Some((p_off, p_len));
                start = p_off;
            }
        }
        if let Some(&n_len) = self.free.get(&end) {
            self.free.remove(&end);
            absorbed[1] = Some((end, n_len));
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
