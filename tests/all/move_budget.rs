//! The page-move budget counts only what happened (Note [Page-move budget] in
//! `src/allocator/state/expandable.rs`): a failed allocation raises no peak and moves no page, and
//! an allocation of nothing earns no credit. Each test drives the default's rotating queue (the
//! sixteen sizes of `device_cost::QUEUE_SIZES`, eight live) or a small layout through the API on
//! `SimDevice`, and fails on the code before the fix (found by an adversarial review).

use std::collections::VecDeque;

use cuda_caching_allocator::*;

use super::device_cost::QUEUE_SIZES;

const MIB: usize = 1 << 20;

/// The default over a simulated device of `capacity` bytes, driven as a rotating queue.
struct Queue {
    a: CachingAllocator<SimDevice>,
    live: VecDeque<DeviceAddr>,
    i: usize,
}

impl Queue {
    fn new(capacity: usize) -> Self {
        let dev = SimDevice::new(SimConfig {
            capacity,
            ..SimConfig::default()
        });
        Queue {
            a: CachingAllocator::new(dev, AllocatorConfig::default()).unwrap(),
            live: VecDeque::new(),
            i: 0,
        }
    }

    /// `pairs` allocations, each freeing the one made eight before.
    fn run(&mut self, pairs: usize) {
        for _ in 0..pairs {
            let size = QUEUE_SIZES[self.i % QUEUE_SIZES.len()];
            let p = self.a.allocate(size, StreamId::DEFAULT).unwrap().ptr;
            self.i += 1;
            self.live.push_back(p);
            if self.live.len() > 8 {
                self.a.free(self.live.pop_front().unwrap()).unwrap();
            }
        }
    }

    fn unmaps(&self) -> u64 {
        self.a.backend().counters().unmap_calls
    }

    /// The queue settled (20,000 pairs), then `what`, then the unmaps of 20,000 more pairs.
    fn moves_after(what: &dyn Fn(&CachingAllocator<SimDevice>)) -> u64 {
        let mut q = Queue::new(2 << 30);
        q.run(20_000);
        let peak = q.a.memory_stats().max_memory_allocated();
        what(&q.a);
        assert_eq!(q.a.memory_stats().max_memory_allocated(), peak);
        let before = q.unmaps();
        q.run(20_000);
        q.a.check_invariants().unwrap();
        q.unmaps() - before
    }
}

/// An allocation that fails for lack of memory after its growth began (the device runs out)
/// raises no peak, so it must not restart the budget's count: the queue makes as few moves
/// after it as after an `empty_cache` (which the failure's release chain also does). Before
/// the fix the count restarted when the growth was planned: 474 unmaps instead of 44.
#[test]
fn a_failed_allocation_does_not_restart_the_page_move_budget() {
    let emptied = Queue::moves_after(&|a| a.empty_cache().unwrap());
    // Refused by the fraction cap before any growth: the same.
    let refused = Queue::moves_after(&|a| {
        a.set_memory_fraction(0.5).unwrap();
        assert!(a.allocate(1900 * MIB, StreamId::DEFAULT).is_err());
        a.set_memory_fraction(1.0).unwrap();
    });
    assert_eq!(
        refused, emptied,
        "out of memory at the cap against empty_cache"
    );
    let failed = Queue::moves_after(&|a| {
        let e = a.allocate(1900 * MIB, StreamId::DEFAULT).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
    });
    assert_eq!(
        failed, emptied,
        "unmaps after a failed 1.9 GB allocation ({failed}) against after empty_cache \
         ({emptied}); the peak did not move"
    );
}

/// A growth that fails on a device error moves no page (the plan is not carried out), so it
/// must not spend the budget: after 27 such failures the same allocation still moves its six
/// free pages instead of creating new memory. Before the fix each failure spent the six planned
/// moves (27 × 6 > the budget of 8 × 20 pages), and the allocation created 12 MiB.
#[test]
fn a_failed_growth_does_not_spend_the_page_move_budget() {
    let after_failures = |faults: usize| {
        let dev = SimDevice::new(SimConfig {
            capacity: 1 << 30,
            ..SimConfig::default()
        });
        let a = CachingAllocator::new(dev, AllocatorConfig::default()).unwrap();
        let s = StreamId::DEFAULT;
        // Five 8 MiB blocks (the peak, 40 MiB), the second and fourth freed: 8 free pages.
        let p: Vec<_> = (0..5)
            .map(|_| a.allocate(8 * MIB, s).unwrap().ptr)
            .collect();
        a.free(p[1]).unwrap();
        a.free(p[3]).unwrap();
        a.flush_thread_caches();
        let reserved = a.memory_reserved();
        for _ in 0..faults {
            // The growth for 12 MiB plans to move 6 pages; its first device call fails.
            a.backend().fail_next_call(FaultKind::Error);
            let e = a.allocate(12 * MIB, s).unwrap_err();
            assert!(e.to_string().contains("injected fault"), "{e}");
            a.backend().clear_faults();
            assert_eq!(a.memory_reserved(), reserved);
        }
        let before = a.backend().counters();
        let _kept = a.allocate(12 * MIB, s).unwrap();
        let after = a.backend().counters();
        a.check_invariants().unwrap();
        (
            a.memory_reserved(),
            after.create_physical_calls - before.create_physical_calls,
            after.unmap_calls - before.unmap_calls,
        )
    };
    let clean = after_failures(0);
    assert_eq!(clean, (40 * MIB as i64, 0, 6));
    assert_eq!(
        after_failures(27),
        clean,
        "(reserved, creates, unmaps) of the same allocation after 27 failed attempts"
    );
}

/// `allocate(0)` returns the null pointer and allocates nothing, so it earns the budget no
/// credit: 32,000 of them change no later decision. Before the fix each counted as an
/// allocation (one move per 128): 288 unmaps instead of 44.
#[test]
fn allocations_of_nothing_earn_no_page_moves() {
    let plain = Queue::moves_after(&|a| a.empty_cache().unwrap());
    let with_zeros = Queue::moves_after(&|a| {
        a.empty_cache().unwrap();
        for _ in 0..32_000 {
            assert!(a.allocate(0, StreamId::DEFAULT).unwrap().ptr.is_null());
        }
    });
    assert_eq!(
        with_zeros, plain,
        "unmaps with 32,000 zero-size allocations ({with_zeros}) against without ({plain})"
    );
}
