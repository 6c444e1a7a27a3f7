//! The synchronisation primitives of the front caches' shared half (`shared.rs`), named in one
//! place so that the model checker (`tests/front_model.rs`) can compile that file against
//! `shuttle`'s instrumented versions instead. May use: `std`, `parking_lot`.
#![forbid(unsafe_code)]

pub(crate) use parking_lot::Mutex;
pub(crate) use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
};

/// A reader waiting for the owner to finish an update (`Counters::snapshot`): spin a little,
/// then let the owner run.
#[inline]
pub(crate) fn wait(spins: u32) {
    if spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}
