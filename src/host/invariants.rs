//! The pinned cache's invariant checker: one named check per invariant. Tests and property tests
//! run it after every operation (the `invariant-checks` feature runs it inside the cache).
//! May use: `cache`'s state.

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::fmt;

use super::PinnedConfig;
use super::cache::State;

/// A broken invariant: which check, and what it saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinnedInvariantViolation {
    /// The check's name (`slabs_tiled`, `free_merged`, `free_index`, `stats`, `cap`, ...).
    pub check: &'static str,
    /// What was wrong.
    pub detail: String,
}

impl fmt::Display for PinnedInvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.check, self.detail)
    }
}

impl std::error::Error for PinnedInvariantViolation {}

fn fail(check: &'static str, detail: String) -> Result<(), PinnedInvariantViolation> {
    Err(PinnedInvariantViolation { check, detail })
}

pub(super) fn check(st: &State, config: &PinnedConfig) -> Result<(), PinnedInvariantViolation> {
    check_slabs_disjoint(st)?;
    check_slabs_tiled(st, config)?;
    check_free_index(st)?;
    check_used_accounted(st)?;
    check_stats(st)?;
    check_cap(st, config)
}

/// Slabs are non-empty, non-null and do not overlap.
fn check_slabs_disjoint(st: &State) -> Result<(), PinnedInvariantViolation> {
    let mut end = 0usize;
    for (&base, slab) in &st.slabs {
        if base == 0 || slab.size == 0 {
            return fail(
                "slabs_disjoint",
                format!("slab {base:#x} of {} bytes", slab.size),
            );
        }
        if base < end {
            return fail(
                "slabs_disjoint",
                format!("slab {base:#x} starts before {end:#x}"),
            );
        }
        end = base.saturating_add(slab.size);
    }
    Ok(())
}

/// Each slab is tiled exactly by its free and used ranges, aligned, with no two free ranges
/// adjacent (merged).
fn check_slabs_tiled(st: &State, config: &PinnedConfig) -> Result<(), PinnedInvariantViolation> {
    for (&base, slab) in &st.slabs {
        let mut ranges: Vec<(usize, usize, bool)> = slab
            .free
            .iter()
            .map(|(&o, &l)| (o, l, true))
            .chain(slab.used.iter().map(|(&o, &l)| (o, l, false)))
            .collect();
        ranges.sort_unstable();
        let mut at = 0usize;
        let mut prev_free = false;
        for (off, len, free) in ranges {
            if off != at {
                return fail(
                    "slabs_tiled",
                    format!("slab {base:#x}: range at {off:#x}, expected {at:#x}"),
                );
            }
            if len == 0 || off % config.alignment != 0 || (base + off) % config.alignment != 0 {
                return fail(
                    "slabs_tiled",
                    format!("slab {base:#x}: range {off:#x}+{len} empty or misaligned"),
                );
            }
            if free && prev_free {
                return fail(
                    "free_merged",
                    format!("slab {base:#x}: free range at {off:#x} follows another free range"),
                );
            }
            prev_free = free;
            at = off + len;
        }
        if at != slab.size {
            return fail(
                "slabs_tiled",
                format!(
                    "slab {base:#x}: ranges end at {at:#x}, size {:#x}",
                    slab.size
                ),
            );
        }
    }
    Ok(())
}

/// The best-fit index holds exactly the free ranges.
fn check_free_index(st: &State) -> Result<(), PinnedInvariantViolation> {
    let expected: BTreeSet<(usize, usize, usize)> = st
        .slabs
        .iter()
        .flat_map(|(&b, s)| s.free.iter().map(move |(&o, &l)| (l, b, o)))
        .collect();
    if expected != st.free_index {
        return fail(
            "free_index",
            format!(
                "index has {} entries, slabs have {} free ranges",
                st.free_index.len(),
                expected.len()
            ),
        );
    }
    Ok(())
}

/// Every used range is exactly one live block or one waiting block, and the reverse.
fn check_used_accounted(st: &State) -> Result<(), PinnedInvariantViolation> {
    let used: BTreeSet<(usize, usize)> = st
        .slabs
        .iter()
        .flat_map(|(&b, s)| s.used.iter().map(move |(&o, &l)| (b + o, l)))
        .collect();
    let mut owned = BTreeSet::new();
    for (addr, len) in st.owned_ranges() {
        if !owned.insert((addr, len)) {
            return fail("used_accounted", format!("{addr:#x} owned twice"));
        }
    }
    if used != owned {
        return fail(
            "used_accounted",
            format!(
                "{} used ranges in slabs, {} live or waiting blocks",
                used.len(),
                owned.len()
            ),
        );
    }
    Ok(())
}

/// Current statistics match the state.
fn check_stats(st: &State) -> Result<(), PinnedInvariantViolation> {
    let reserved: usize = st.slabs.values().map(|s| s.size).sum();
    let (allocated, requested, pending) = st.byte_totals();
    let s = &st.stats;
    let pairs = [
        ("reserved_bytes", s.reserved_bytes.current, reserved),
        ("slabs", s.slabs.current, st.slabs.len()),
        ("allocated_bytes", s.allocated_bytes.current, allocated),
        ("requested_bytes", s.requested_bytes.current, requested),
        ("pending_bytes", s.pending_bytes.current, pending),
    ];
    for (name, stat, actual) in pairs {
        if usize::try_from(stat).ok() != Some(actual) {
            return fail("stats", format!("{name} is {stat}, state holds {actual}"));
        }
    }
    Ok(())
}

/// Pinned bytes stay within the cap.
fn check_cap(st: &State, config: &PinnedConfig) -> Result<(), PinnedInvariantViolation> {
    let reserved: usize = st.slabs.values().map(|s| s.size).sum();
    match config.max_pinned {
        Some(cap) if reserved > cap => fail("cap", format!("{reserved} bytes pinned, cap {cap}")),
        _ => Ok(()),
    }
}
