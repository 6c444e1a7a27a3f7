//! A block pool: the free blocks of one size class, ordered by `(stream, size, address)` as
//! PyTorch's `BlockComparatorSize` orders them, so best fit is one ordered-set lookup.
//!
//! Note [Small free sets]: the free sets are small in practice (on the recorded `generate`
//! client 8–17 blocks on average and at most 21 at a best-fit search; 46 on average and 155 at
//! most for gpt2_train under `pytorch`), and a `BTreeSet` spends about 250 instructions on an
//! insert, a removal or a lower-bound search even in a single node (its node handling, and the
//! four-field comparisons of a linear search). A [`FreeSet`] keeps its keys in a sorted vector
//! while it holds at most [`FreeSet::VEC_MAX`] of them: a binary search finds a bound, and an
//! insertion or removal moves at most that many 32-byte keys. A larger set moves into a
//! `BTreeSet` (logarithmic whatever the size) and back into a vector once it falls to
//! [`FreeSet::VEC_MIN`] (the gap keeps a set that hovers around one size from moving to and fro).
//! Both hold the same keys in the same order, so every query answers as the `BTreeSet` alone did
//! (the property test `free_set_is_an_ordered_set` checks it against one).
//!
//! May use: `block`.
#![forbid(unsafe_code)]

use std::collections::{BTreeSet, btree_set};
use std::ops::{Bound, RangeBounds};

use super::block::{Block, BlockId};
use crate::backend::StreamId;

/// Ordering key of a free block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct FreeKey {
    pub(crate) stream: StreamId,
    pub(crate) size: usize,
    pub(crate) ptr: u64,
    pub(crate) id: BlockId,
}

impl FreeKey {
    pub(crate) fn of(id: BlockId, b: &Block) -> Self {
        FreeKey {
            stream: b.stream,
            size: b.size,
            ptr: b.ptr,
            id,
        }
    }

    /// The smallest key for `stream` with at least `size` bytes.
    pub(crate) fn search(stream: StreamId, size: usize) -> Self {
        FreeKey {
            stream,
            size,
            ptr: 0,
            id: BlockId(0),
        }
    }
}

/// An ordered set of free-block keys (Note [Small free sets]): a sorted vector while small, a
/// `BTreeSet` while large; the same answers either way.
#[derive(Debug, Default)]
pub(crate) struct FreeSet {
    /// The keys in order, while the set is small (`tree` is then empty).
    sorted: Vec<FreeKey>,
    /// The keys, while the set is large (`sorted` is then empty).
    tree: BTreeSet<FreeKey>,
    /// Which of the two holds the keys.
    large: bool,
}

impl FreeSet {
    /// Most keys kept in the sorted vector: one more moves the set into the tree.
    pub(crate) const VEC_MAX: usize = 256;
    /// A set in the tree moves back into a vector when it falls to this many keys.
    pub(crate) const VEC_MIN: usize = 128;

    /// Inserts `key`; false if it was there already.
    #[inline]
    pub(crate) fn insert(&mut self, key: FreeKey) -> bool {
        if self.large {
            return self.tree.insert(key);
        }
        let i = self.sorted.partition_point(|k| *k < key);
        if self.sorted.get(i) == Some(&key) {
            return false;
        }
        self.sorted.insert(i, key);
        if self.sorted.len() > Self::VEC_MAX {
            self.tree = std::mem::take(&mut self.sorted).into_iter().collect();
            self.large = true;
        }
        true
    }

    /// Removes `key`; false if it was not there.
    #[inline]
    pub(crate) fn remove(&mut self, key: &FreeKey) -> bool {
        if self.large {
            let removed = self.tree.remove(key);
            if self.tree.len() <= Self::VEC_MIN {
                self.sorted = std::mem::take(&mut self.tree).into_iter().collect();
                self.large = false;
            }
            return removed;
        }
        let i = self.sorted.partition_point(|k| k < key);
        if self.sorted.get(i) != Some(key) {
            return false;
        }
        self.sorted.remove(i);
        true
    }

    /// The keys from the first not less than `key` on, in order, and that first key's position
    /// in the sorted vector: a hint for [`remove_hinted`](Self::remove_hinted) (meaningless,
    /// and harmless, while the set is large).
    #[inline]
    pub(crate) fn lower_bound(&self, key: &FreeKey) -> (usize, Range<'_>) {
        if self.large {
            return (0, Range::Tree(self.tree.range(key..)));
        }
        let s = &self.sorted;
        let start = s.partition_point(|k| k < key);
        (start, Range::Vec(s.get(start..).unwrap_or_default().iter()))
    }

    /// Removes `key`, looking first at position `hint` of the sorted vector (where
    /// [`lower_bound`](Self::lower_bound) and the keys after it put it); false if it was not
    /// there. The same as [`remove`](Self::remove), one search shorter when the hint is right.
    #[inline]
    pub(crate) fn remove_hinted(&mut self, key: &FreeKey, hint: usize) -> bool {
        if !self.large && self.sorted.get(hint) == Some(key) {
            self.sorted.remove(hint);
            return true;
        }
        self.remove(key)
    }

    /// The keys within `range`, in order (from either end). An empty or inverted range yields
    /// nothing.
    #[inline]
    pub(crate) fn range<R: RangeBounds<FreeKey>>(&self, range: R) -> Range<'_> {
        if self.large {
            let inverted = match (range.start_bound(), range.end_bound()) {
                (Bound::Included(a), Bound::Included(b)) => a > b,
                (Bound::Included(a) | Bound::Excluded(a), Bound::Excluded(b))
                | (Bound::Excluded(a), Bound::Included(b)) => a >= b,
                _ => false,
            };
            if inverted {
                // `BTreeSet::range` would panic.
                return Range::Vec([].iter());
            }
            return Range::Tree(self.tree.range(range));
        }
        let s = &self.sorted;
        let start = match range.start_bound() {
            Bound::Included(a) => s.partition_point(|k| k < a),
            Bound::Excluded(a) => s.partition_point(|k| k <= a),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(b) => s.partition_point(|k| k <= b),
            Bound::Excluded(b) => s.partition_point(|k| k < b),
            Bound::Unbounded => s.len(),
        };
        Range::Vec(s.get(start..end).unwrap_or_default().iter())
    }

    /// Every key, in order.
    #[inline]
    pub(crate) fn iter(&self) -> Range<'_> {
        self.range(..)
    }

    /// The smallest key.
    pub(crate) fn first(&self) -> Option<&FreeKey> {
        self.iter().next()
    }

    /// The streams that have keys here, in order: one ordered look-up per stream.
    pub(crate) fn streams(&self) -> impl Iterator<Item = StreamId> + '_ {
        let mut next = self.first().map(|k| k.stream);
        std::iter::from_fn(move || {
            let t = next?;
            next =
                t.0.checked_add(1)
                    .and_then(|n| self.range(FreeKey::search(StreamId(n), 0)..).next())
                    .map(|k| k.stream);
            Some(t)
        })
    }

    /// `stream`'s keys of at least `size` bytes, smallest first (best fit's order).
    pub(crate) fn fits(&self, stream: StreamId, size: usize) -> impl Iterator<Item = &FreeKey> {
        self.range(FreeKey::search(stream, size)..)
            .take_while(move |k| k.stream == stream)
    }

    /// The representation's own invariant (Note [Small free sets]): the keys in strictly
    /// increasing order, in exactly one of the two forms, the vector no longer than `VEC_MAX`
    /// and the tree longer than `VEC_MIN`.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.large {
            if !self.sorted.is_empty() || self.tree.len() <= Self::VEC_MIN {
                return Err(format!(
                    "a tree of {} keys beside a vector of {}",
                    self.tree.len(),
                    self.sorted.len()
                ));
            }
        } else {
            if !self.tree.is_empty() || self.sorted.len() > Self::VEC_MAX {
                return Err(format!(
                    "a vector of {} keys beside a tree of {}",
                    self.sorted.len(),
                    self.tree.len()
                ));
            }
            if self.sorted.windows(2).any(|w| w[0] >= w[1]) {
                return Err("the vector is not in strictly increasing order".into());
            }
        }
        Ok(())
    }

    /// How many keys the set holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        if self.large {
            self.tree.len()
        } else {
            self.sorted.len()
        }
    }
}

/// The keys of a [`FreeSet`] within a range, in order.
#[derive(Debug, Clone)]
pub(crate) enum Range<'a> {
    /// Of a small set.
    Vec(std::slice::Iter<'a, FreeKey>),
    /// Of a large set.
    Tree(btree_set::Range<'a, FreeKey>),
}

impl<'a> Iterator for Range<'a> {
    type Item = &'a FreeKey;

    #[inline]
    fn next(&mut self) -> Option<&'a FreeKey> {
        match self {
            Range::Vec(it) => it.next(),
            Range::Tree(it) => it.next(),
        }
    }
}

impl DoubleEndedIterator for Range<'_> {
    #[inline]
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            Range::Vec(it) => it.next_back(),
            Range::Tree(it) => it.next_back(),
        }
    }
}

impl<'a> IntoIterator for &'a FreeSet {
    type Item = &'a FreeKey;
    type IntoIter = Range<'a>;

    fn into_iter(self) -> Range<'a> {
        self.iter()
    }
}

/// The free blocks of one pool (small or large).
#[derive(Debug, Default)]
pub(crate) struct BlockPool {
    /// Free, mapped, event-free blocks.
    pub(crate) blocks: FreeSet,
    /// Unmapped tails of expandable segments, by `(stream, address)`.
    pub(crate) unmapped: BTreeSet<(StreamId, u64, BlockId)>,
    /// Number of best-fit searches so far (ages for garbage collection).
    pub(crate) get_free_blocks_call_count: u64,
}

impl BlockPool {
    /// Inserts a free block, stamping its GC age base.
    pub(crate) fn insert(&mut self, id: BlockId, b: &mut Block) -> bool {
        b.gc_count_base = self.get_free_blocks_call_count;
        self.blocks.insert(FreeKey::of(id, b))
    }

    pub(crate) fn remove(&mut self, id: BlockId, b: &Block) -> bool {
        self.blocks.remove(&FreeKey::of(id, b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(stream: u64, size: usize, ptr: u64) -> FreeKey {
        FreeKey {
            stream: StreamId(stream),
            size: size * 512,
            ptr: ptr * 512,
            // One id per address, as in a pool (a free block's address is unique).
            id: BlockId(ptr as u32),
        }
    }

    fn key_strategy() -> impl Strategy<Value = FreeKey> {
        (0u64..3, 0usize..8, 0u64..64).prop_map(|(s, z, p)| key(s, z, p))
    }

    fn bound(kind: u8, k: FreeKey) -> Bound<FreeKey> {
        match kind % 3 {
            0 => Bound::Included(k),
            1 => Bound::Excluded(k),
            _ => Bound::Unbounded,
        }
    }

    /// The whole set, both ways, and a few queries, against the reference.
    fn same(set: &FreeSet, model: &BTreeSet<FreeKey>) -> Result<(), TestCaseError> {
        prop_assert_eq!(set.check(), Ok(()));
        prop_assert_eq!(set.len(), model.len());
        prop_assert_eq!(
            set.large,
            set.len() > FreeSet::VEC_MIN && !set.tree.is_empty()
        );
        prop_assert!(set.iter().eq(model.iter()));
        prop_assert!(set.iter().rev().eq(model.iter().rev()));
        prop_assert!(set.into_iter().eq(model));
        prop_assert_eq!(set.first(), model.first());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Note [Small free sets]: a `FreeSet` answers every query as a `BTreeSet` of the same
        /// keys does, while it grows past `VEC_MAX` into its tree and shrinks back below
        /// `VEC_MIN` into its vector.
        #[test]
        fn free_set_is_an_ordered_set(
            ops in prop::collection::vec((0u8..10, key_strategy(), key_strategy(), 0u8..9), 1..1600),
        ) {
            let mut set = FreeSet::default();
            let mut model = BTreeSet::new();
            let (mut grew, half) = (false, ops.len() / 2);
            for (n, &(what, a, b, kinds)) in ops.iter().enumerate() {
                // Inserts dominate the first half and removals the second, so long programs
                // cross both thresholds.
                let insert = if n < half { what < 7 } else { what < 3 };
                if insert {
                    prop_assert_eq!(set.insert(a), model.insert(a));
                } else if what % 2 == 0 {
                    prop_assert_eq!(set.remove(&a), model.remove(&a));
                } else {
                    // A hint that is right, one off, or past the end: the same answer.
                    let hint = (set.lower_bound(&a).0 + usize::from(kinds % 3)).saturating_sub(1);
                    prop_assert_eq!(set.remove_hinted(&a, hint), model.remove(&a));
                }
                grew |= set.large;
                let (lo, hi) = (bound(kinds, a), bound(kinds / 3, b));
                let expected: Vec<&FreeKey> =
                    model.iter().filter(|k| (lo, hi).contains(*k)).collect();
                let got: Vec<&FreeKey> = set.range((lo, hi)).collect();
                prop_assert_eq!(&got, &expected);
                let back: Vec<&FreeKey> = set.range((lo, hi)).rev().collect();
                prop_assert!(back.iter().eq(expected.iter().rev()));
                // Best fit's query: the smallest key of a stream with at least a size.
                let search = FreeKey::search(a.stream, a.size);
                prop_assert_eq!(set.range(search..).next(), model.range(search..).next());
                let (start, keys) = set.lower_bound(&search);
                prop_assert!(keys.eq(model.range(search..)));
                if !set.large {
                    prop_assert_eq!(start, model.range(..search).count());
                }
                if n % 64 == 0 {
                    same(&set, &model)?;
                }
            }
            same(&set, &model)?;
            if ops.len() > 1200 {
                // Long programs are meant to reach the tree (a check of the test itself).
                prop_assert!(grew || model.len() <= FreeSet::VEC_MAX);
            }
        }
    }

    #[test]
    fn a_set_moves_into_its_tree_and_back() {
        let mut set = FreeSet::default();
        let keys: Vec<FreeKey> = (0..400).map(|i| key(i % 2, (i % 7) as usize, i)).collect();
        for &k in &keys {
            assert!(set.insert(k));
        }
        assert!(set.large && set.sorted.is_empty());
        assert_eq!(set.check(), Ok(()));
        assert!(!set.insert(keys[5]));
        for k in &keys[..300] {
            assert!(set.remove(k));
        }
        assert!(!set.large && set.tree.is_empty());
        assert_eq!(set.check(), Ok(()));
        assert_eq!(set.len(), 100);
        set.sorted.swap(0, 1);
        assert!(set.check().is_err());
        set.sorted.swap(0, 1);
        assert!(!set.remove(&keys[0]));
        let mut model: Vec<FreeKey> = keys[300..].to_vec();
        model.sort();
        assert!(set.iter().eq(model.iter()));
        // An inverted range is empty in either form.
        let (hi, lo) = (model[50], model[10]);
        assert_eq!(set.range(hi..lo).count(), 0);
        for &k in &keys[..300] {
            set.insert(k);
        }
        assert!(set.large);
        assert_eq!(set.range(hi..lo).count(), 0);
        assert_eq!(
            set.range((Bound::Excluded(lo), Bound::Excluded(lo)))
                .count(),
            0
        );
    }
}
