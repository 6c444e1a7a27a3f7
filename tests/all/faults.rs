//! Fault injection at every device call of a fixed program: each failing call leaves the allocator
//! consistent (invariants hold), loses no live allocation, and the program can go on.

use cuda_caching_allocator::*;

use crate::util::MIB;

#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc(usize, u64),
    Free(usize),
    Record(usize, u64),
    Empty,
}

fn program() -> Vec<Step> {
    use Step::*;
    vec![
        Alloc(300, 0),
        Alloc(3 * MIB, 0),
        Alloc(12 * MIB, 1),
        Record(1, 5),
        Alloc(600 * 1024, 1),
        Free(0),
        Free(1),
        Alloc(25 * MIB, 0),
        Empty,
        Alloc(2 * MIB, 1),
        Free(2),
        Alloc(40 * MIB, 0),
        Free(3),
        Alloc(5000, 0),
        Empty,
        Alloc(30 * MIB, 1),
    ]
}

/// Runs the program; returns how many device calls it made.
fn run(sim_capacity: usize, fail: Option<(u64, FaultKind)>) -> u64 {
    let sim = SimDevice::with_capacity(sim_capacity);
    if let Some((n, k)) = fail {
        sim.fail_call(n, k);
    }
    let a = CachingAllocator::new(sim, AllocatorConfig::pytorch()).unwrap();
    let mut slots: Vec<Option<Allocation>> = Vec::new();
    for step in program() {
        match step {
            Step::Alloc(size, s) => match a.allocate(size, StreamId(s)) {
                Ok(x) => slots.push(Some(x)),
                Err(e) => {
                    assert!(
                        e.is_out_of_memory() || matches!(e, AllocError::Backend { .. }),
                        "{e}"
                    );
                    slots.push(None);
                }
            },
            Step::Free(i) => {
                if let Some(x) = slots.get_mut(i).and_then(Option::take) {
                    a.free(x.ptr).unwrap();
                }
            }
            Step::Record(i, s) => {
                if let Some(Some(x)) = slots.get(i) {
                    a.backend().submit_work(StreamId(s));
                    a.record_stream(x.ptr, StreamId(s)).unwrap();
                }
            }
            Step::Empty => {
                let _ = a.empty_cache();
            }
        }
        a.check_invariants()
            .unwrap_or_else(|v| panic!("after {step:?} with fault {fail:?}: {v}"));
        // No live allocation lost: the allocator still counts every one we hold.
        let live: Vec<&Allocation> = slots.iter().flatten().collect();
        let st = a.memory_stats();
        assert_eq!(
            st.allocation.get(StatType::All).current as usize,
            live.len()
        );
        assert_eq!(
            st.memory_allocated() as usize,
            live.iter().map(|x| x.block_size).sum::<usize>()
        );
        assert!(st.memory_allocated() <= st.memory_reserved());
        assert_eq!(
            st.memory_reserved() as usize,
            a.backend().counters().reserved_bytes
        );
    }
    for x in slots.into_iter().flatten() {
        a.free(x.ptr).unwrap();
    }
    a.backend().clear_faults();
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    a.check_invariants().unwrap();
    a.backend().counters().device_calls
}

#[test]
fn every_device_call_can_fail() {
    let calls = run(1 << 30, None);
    assert!(calls >= 8, "the program makes {calls} device calls");
    for n in 1..=calls {
        for kind in [FaultKind::OutOfMemory, FaultKind::Error] {
            run(1 << 30, Some((n, kind)));
        }
    }
}

#[test]
fn a_tight_device_runs_the_oom_path_consistently() {
    for cap in [40 * MIB, 48 * MIB, 64 * MIB, 80 * MIB] {
        run(cap, None);
    }
}

/// Lent pages (Note [Lent pages]) under a failing device call: pages of a block still used on
/// stream 1 are lent to stream 2's growths, then the use completes and the old mappings go. Any
/// one device call of the program may fail (map of a lent page, unmap of an old mapping, create,
/// release): the allocator stays consistent, the device sees no breach of the stream rule, and
/// `empty_cache` gives back everything.
fn lending_run(fail: Option<(u64, FaultKind)>) -> u64 {
    let sim = SimDevice::with_capacity(1 << 30);
    if let Some((n, k)) = fail {
        sim.fail_call(n, k);
    }
    let a = CachingAllocator::new(sim, AllocatorConfig::default()).unwrap();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let ok = |r: std::result::Result<Allocation, AllocError>| match r {
        Ok(x) => Some(x),
        Err(e) => {
            assert!(
                e.is_out_of_memory() || matches!(e, AllocError::Backend { .. }),
                "{e}"
            );
            None
        }
    };
    let mut live = Vec::new();
    if let Some(x) = ok(a.allocate(32 * MIB, s1)) {
        a.backend().use_range(s1, x.ptr, x.block_size);
        a.free(x.ptr).unwrap();
    }
    for size in [16 * MIB, 6 * MIB] {
        if let Some(y) = ok(a.allocate(size, s2)) {
            assert!(a.backend().check_handout(s2, y.ptr, y.block_size));
            live.push(y);
        }
        a.check_invariants().unwrap();
    }
    if fail.is_none() {
        assert!(a.page_loans() >= 1, "the program lends");
    }
    a.backend().complete_work(s1);
    if let Some(y) = ok(a.allocate(12 * MIB, s2)) {
        assert!(a.backend().check_handout(s2, y.ptr, y.block_size));
        live.push(y);
    }
    a.check_invariants().unwrap();
    for y in live {
        a.free(y.ptr).unwrap();
    }
    a.backend().clear_faults();
    let _ = a.empty_cache();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert_eq!(a.backend().counters().reserved_bytes, 0);
    assert!(
        a.backend().violations().is_empty(),
        "{fail:?}: {:?}",
        a.backend().violations()
    );
    a.backend().counters().device_calls
}

#[test]
fn every_device_call_of_a_lending_program_can_fail() {
    let calls = lending_run(None);
    assert!(calls >= 20, "the program makes {calls} device calls");
    for n in 1..=calls {
        for kind in [FaultKind::OutOfMemory, FaultKind::Error] {
            lending_run(Some((n, kind)));
        }
    }
}
