//! Unit tests of the simulated device.

use super::*;

const MIB: usize = 1 << 20;

#[test]
fn ranges_are_disjoint_and_capacity_is_enforced() {
    let sim = SimDevice::with_capacity(10 * MIB);
    let a = sim.allocate(4 * MIB, StreamId(1)).unwrap();
    let b = sim.allocate(4 * MIB, StreamId(1)).unwrap();
    assert!(a.0 + (4 * MIB) as u64 <= b.0 || b.0 + (4 * MIB) as u64 <= a.0);
    assert!(matches!(
        sim.allocate(4 * MIB, StreamId(1)),
        Err(BackendError::OutOfMemory)
    ));
    assert_eq!(sim.counters().failed_allocate_calls, 1);
    assert_eq!(
        sim.mem_info().unwrap(),
        MemInfo {
            free: 2 * MIB,
            total: 10 * MIB
        }
    );
    // SAFETY: from allocate above, unused.
    unsafe { sim.free(a, 4 * MIB, StreamId(1)).unwrap() };
    assert_eq!(sim.counters().reserved_bytes, 4 * MIB);
    assert_eq!(sim.counters().peak_reserved_bytes, 8 * MIB);
}

#[test]
fn hint_places_segment_and_is_ignored_when_taken() {
    let sim = SimDevice::default();
    sim.place_next_at(0x1000_0000);
    let a = sim.allocate(2 * MIB, StreamId(0)).unwrap();
    assert_eq!(a.0, 0x1000_0000);
    sim.place_next_at(0x1000_0000 + MIB as u64);
    let b = sim.allocate(2 * MIB, StreamId(0)).unwrap();
    assert_ne!(
        b.0,
        0x1000_0000 + MIB as u64,
        "overlapping hint must be ignored"
    );
}

#[test]
fn faults_fire_once_at_the_named_call() {
    let sim = SimDevice::default();
    sim.fail_call(2, FaultKind::Error);
    let a = sim.allocate(MIB, StreamId(0)).unwrap();
    // SAFETY: from allocate above.
    let err = unsafe { sim.free(a, MIB, StreamId(0)) }.unwrap_err();
    assert!(
        matches!(err, BackendError::Injected { call: 2, .. }),
        "{err}"
    );
    // SAFETY: still live: the failed free did not free it.
    unsafe { sim.free(a, MIB, StreamId(0)).unwrap() };
    sim.fail_allocations_above(Some(MIB));
    assert!(
        sim.allocate(2 * MIB, StreamId(0))
            .unwrap_err()
            .is_out_of_memory()
    );
    sim.report_free(Some(7));
    assert_eq!(sim.mem_info().unwrap().free, 7);
}

#[test]
fn events_follow_simulated_work() {
    let sim = SimDevice::default();
    let s = StreamId(7);
    let e = sim.create_event().unwrap();
    sim.submit_work(s);
    sim.record_event(e, s).unwrap();
    assert!(!sim.query_event(e).unwrap());
    sim.complete_work(s);
    assert!(sim.query_event(e).unwrap());
    sim.submit_work(s);
    sim.record_event(e, s).unwrap();
    sim.synchronize().unwrap();
    assert!(sim.query_event(e).unwrap());
}

#[test]
fn stream_waits_order_work_across_streams() {
    let sim = SimDevice::default();
    let (t, s) = (StreamId(1), StreamId(2));
    let e = sim.create_event().unwrap();
    sim.submit_work(t);
    sim.record_event(e, t).unwrap();
    sim.stream_wait_event(s, e).unwrap();
    sim.submit_work(s);
    let after = sim.create_event().unwrap();
    sim.record_event(after, s).unwrap();
    assert_eq!(
        sim.stream_waits(),
        vec![SimStreamWait {
            stream: s,
            event: e,
            recorded: Some((t, 1)),
            position: 0,
        }]
    );
    assert_eq!(sim.counters().stream_waits, 1);
    // The waiting stream's later work cannot have completed before T's.
    assert!(!sim.query_event(after).unwrap());
    sim.complete_work(s);
    assert!(
        !sim.has_pending_work(t),
        "completing S completed what S waited for"
    );
    assert!(sim.query_event(e).unwrap() && sim.query_event(after).unwrap());
    assert_eq!(sim.counters().synchronize_calls, 0);

    // An event recorded on an idle stream after a wait is pending until the wait is met.
    let e2 = sim.create_event().unwrap();
    sim.submit_work(t);
    sim.record_event(e2, t).unwrap();
    sim.stream_wait_event(s, e2).unwrap();
    let e3 = sim.create_event().unwrap();
    sim.record_event(e3, s).unwrap();
    assert!(!sim.query_event(e3).unwrap());
    sim.complete_work(t);
    assert!(sim.query_event(e3).unwrap());
    // A wait on a point already complete waits for nothing.
    sim.stream_wait_event(s, e2).unwrap();
    assert_eq!(sim.stream_waits().len(), 3);
}

#[test]
fn event_faults_fire_once() {
    let sim = SimDevice::default();
    sim.fail_next_event_call(SimEventCall::Create);
    assert!(matches!(
        sim.create_event(),
        Err(BackendError::Injected {
            operation: "create_event",
            call: 1
        })
    ));
    let e = sim.create_event().unwrap();
    sim.fail_next_event_call(SimEventCall::Record);
    assert!(sim.record_event(e, StreamId(1)).is_err());
    sim.record_event(e, StreamId(1)).unwrap();
    sim.fail_next_event_call(SimEventCall::StreamWait);
    assert!(sim.stream_wait_event(StreamId(2), e).is_err());
    assert!(sim.stream_waits().is_empty());
    sim.stream_wait_event(StreamId(2), e).unwrap();
    sim.fail_next_event_call(SimEventCall::StreamWait);
    sim.clear_faults();
    sim.stream_wait_event(StreamId(2), e).unwrap();
    assert_eq!(sim.counters().stream_waits, 2);
}

#[test]
fn virtual_memory_maps_inside_reservations() {
    let sim = SimDevice::with_capacity(8 * MIB);
    let va = sim.reserve_address_range(16 * MIB).unwrap();
    let h = sim.create_physical(2 * MIB).unwrap();
    // SAFETY: va is a fresh reservation, h a fresh 2 MiB handle.
    unsafe { sim.map(va, 2 * MIB, h).unwrap() };
    // SAFETY: same range mapped twice must be refused, not UB, on the simulator.
    assert!(unsafe { sim.map(va, 2 * MIB, h) }.is_err());
    assert_eq!(sim.counters().reserved_bytes, 2 * MIB);
    // SAFETY: exactly the mapping made above.
    unsafe { sim.unmap(va, 2 * MIB).unwrap() };
    // SAFETY: unmapped now.
    unsafe { sim.release_physical(h, 2 * MIB).unwrap() };
    // SAFETY: nothing mapped.
    unsafe { sim.release_address_range(va, 16 * MIB).unwrap() };
    assert_eq!(sim.counters().reserved_bytes, 0);
}

#[test]
fn incomplete_uses_make_frees_and_unmaps_violations() {
    let sim = SimDevice::with_capacity(64 * MIB);
    let s = StreamId(3);
    let a = sim.allocate(2 * MIB, s).unwrap();
    let b = sim.allocate(2 * MIB, s).unwrap();
    let u = sim.use_range(s, a.offset(4096), 512);
    assert_eq!(u.unit, 1);
    assert_eq!(sim.pending_uses(), vec![u]);
    // SAFETY: simulated memory; the point is the breach being logged.
    unsafe { sim.free(b, 2 * MIB, s).unwrap() };
    assert!(sim.violations().is_empty(), "b was not used");
    // SAFETY: as above.
    unsafe { sim.free(a, 2 * MIB, s).unwrap() };
    let v = sim.violations();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].kind, SimViolationKind::Free);
    assert_eq!(v[0].pending, u);
    assert!(v[0].to_string().contains("freed"), "{}", v[0]);

    // Completed uses constrain nothing; a pending one blocks an unmap.
    let va = sim.reserve_address_range(4 * MIB).unwrap();
    let h = sim.create_physical(2 * MIB).unwrap();
    // SAFETY: fresh reservation and handle.
    unsafe { sim.map(va, 2 * MIB, h).unwrap() };
    sim.use_range(s, va, MIB);
    sim.complete_work(s);
    assert!(sim.pending_uses().is_empty());
    let pending = sim.use_range(StreamId(4), va.offset(MIB), 4096);
    // SAFETY: exactly the mapping above.
    unsafe { sim.unmap(va, 2 * MIB).unwrap() };
    let v = sim.violations();
    assert_eq!(v.len(), 2);
    assert_eq!(v[1].kind, SimViolationKind::Unmap);
    assert_eq!(v[1].pending, pending);
    // A synchronize completes everything.
    sim.use_range(s, va, 8);
    sim.synchronize().unwrap();
    assert!(sim.pending_uses().is_empty());
}

#[test]
fn handouts_must_be_ordered_after_every_pending_use() {
    let sim = SimDevice::default();
    let (s, t, x) = (StreamId(1), StreamId(2), StreamId(3));
    let p = DeviceAddr(0x1000_0000);
    let used = sim.use_range(t, p, 4096);
    // Same stream: ordered by the stream itself. Disjoint range: unconstrained.
    assert!(sim.check_handout(t, p, 4096));
    assert!(sim.check_handout(s, p.offset(4096), 4096));
    assert!(sim.violations().is_empty());
    // Another stream that waited on nothing.
    assert!(!sim.check_handout(s, p.offset(512), 512));
    let v = sim.violations();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].kind, SimViolationKind::Handout { stream: s });
    assert_eq!(v[0].pending, used);
    // An event recorded on T before the use orders nothing.
    let early = sim.create_event().unwrap();
    let e = sim.create_event().unwrap();
    sim.use_range(t, p.offset(8192), 8);
    sim.record_event(e, t).unwrap();
    sim.stream_wait_event(x, e).unwrap();
    // X waited on a point after `used`: ordered. S waits on X's point after that wait:
    // ordered transitively.
    assert!(sim.check_handout(x, p, 4096));
    sim.submit_work(x);
    sim.record_event(early, x).unwrap();
    sim.stream_wait_event(s, early).unwrap();
    assert!(sim.check_handout(s, p, 4096));
    // A wait on a point of T before the use does not order it.
    let y = StreamId(9);
    let before = sim.create_event().unwrap();
    let z = StreamId(10);
    sim.record_event(before, z).unwrap();
    let late = sim.use_range(z, p, 64);
    sim.stream_wait_event(y, before).unwrap();
    assert!(!sim.check_handout(y, p, 64));
    let v = sim.violations();
    assert_eq!(v.last().map(|v| v.pending), Some(late));
    // An event recorded after a wait (with no new work between) carries the wait: a stream
    // waiting on it is ordered after what the first wait covered.
    let (u, w) = (StreamId(11), StreamId(12));
    let q = DeviceAddr(0x2000_0000);
    let far = sim.use_range(StreamId(13), q, 64);
    let e1 = sim.create_event().unwrap();
    sim.record_event(e1, StreamId(13)).unwrap();
    sim.stream_wait_event(u, e1).unwrap();
    let e2 = sim.create_event().unwrap();
    sim.record_event(e2, u).unwrap();
    sim.stream_wait_event(w, e2).unwrap();
    assert!(sim.check_handout(w, q, 64), "{far:?} is ordered before W");
    // Once the uses complete, any stream may have the range.
    sim.complete_work(t);
    sim.complete_work(z);
    assert!(sim.check_handout(y, p, 4096));
}

#[test]
fn the_device_time_model_charges_each_call_kind() {
    let costs = SimCosts::default();
    let sim = SimDevice::default();
    let s = StreamId(3);
    let va = sim.reserve_address_range(8 * MIB).unwrap();
    let h = sim.create_physical(4 * MIB).unwrap();
    // SAFETY: `h` is a live 4 MiB handle and the range lies in the reservation, unmapped.
    unsafe { sim.map(va, 4 * MIB, h).unwrap() };
    // SAFETY: the mapping made above; no work uses it.
    unsafe { sim.unmap(va, 4 * MIB).unwrap() };
    // SAFETY: mapped nowhere now.
    unsafe { sim.release_physical(h, 4 * MIB).unwrap() };
    // SAFETY: nothing is mapped in it.
    unsafe { sim.release_address_range(va, 8 * MIB).unwrap() };
    let p = sim.allocate(MIB, s).unwrap();
    // SAFETY: from allocate above, unused.
    unsafe { sim.free(p, MIB, s).unwrap() };
    let e = sim.create_event().unwrap();
    sim.record_event(e, s).unwrap();
    sim.query_event(e).unwrap();
    sim.stream_wait_event(StreamId(4), e).unwrap();
    sim.synchronize_stream(s).unwrap();
    sim.synchronize().unwrap();
    sim.fail_next_synchronize();
    assert!(sim.synchronize().is_err(), "a failed call is not charged");
    let c = sim.counters();
    let counts: Vec<(&str, u64)> = c.call_counts().to_vec();
    assert_eq!(
        counts,
        vec![
            ("allocate", 1),
            ("free", 1),
            ("reserve", 1),
            ("release_range", 1),
            ("create", 1),
            ("map", 1),
            ("set_access", 1),
            ("unmap", 1),
            ("release", 1),
            ("synchronize", 2),
            ("stream_synchronize", 1),
            ("event_create", 1),
            ("event_record", 1),
            ("event_query", 1),
            ("stream_wait_event", 1),
        ]
    );
    let expected = costs.allocate_ns
        + costs.free_ns
        + costs.reserve_ns
        + costs.release_range_ns
        + costs.create_ns
        + costs.map_ns
        + costs.set_access_ns
        + costs.unmap_ns
        + costs.release_ns
        + costs.synchronize_ns
        + costs.stream_synchronize_ns
        + costs.event_create_ns
        + costs.event_record_ns
        + costs.event_query_ns
        + costs.stream_wait_event_ns;
    assert_eq!(c.modeled_device_ns, expected);
    assert_eq!(
        expected,
        34_000 + 29_000 + 28_000 * 2 + 14_000 + 33_000 + 21_000 + 15_000 + 100_000 + 7_000
    );

    // Costs are configurable; the zero model counts without charging.
    let free = SimDevice::new(SimConfig {
        costs: SimCosts::zero(),
        ..SimConfig::default()
    });
    free.synchronize().unwrap();
    assert_eq!(free.counters().modeled_device_ns, 0);
    assert_eq!(free.counters().synchronize_calls, 1);
}
