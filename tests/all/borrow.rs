//! Borrowed blocks (`cca_borrow_blocks:True`, opt-in; Note [Borrowed blocks] in
//! `src/allocator/state/borrow.rs`): an allocation that finds no free block of its own stream
//! uses another stream's idle free large-pool block where it lies. What is borrowed (only idle
//! blocks, best fit, never the small pool, never without the key), that nothing moves or waits,
//! that the block goes back to its stream only after the borrower's work on it, the fast path,
//! and the FSDP2 recording's page moves.

use cuda_caching_allocator::*;

use crate::util::{MIB, segment_stream, with_config};

const T: StreamId = StreamId(1);
const S: StreamId = StreamId(2);

/// The crate's default with borrowing on.
fn borrowing() -> AllocatorConfig {
    AllocatorConfig::parse("cca_preset:default,cca_borrow_blocks:True").unwrap()
}

#[test]
fn an_idle_block_of_another_stream_is_borrowed_where_it_lies() {
    let a = with_config(1 << 30, borrowing());
    let dev = a.backend();
    let x = a.allocate(32 * MIB, T).unwrap();
    dev.use_range(T, x.ptr, 32 * MIB);
    dev.complete_work(T);
    a.free(x.ptr).unwrap();
    let before = dev.counters();
    let reserved = a.memory_stats().memory_reserved();
    let y = a.allocate(20 * MIB, S).unwrap();
    let after = dev.counters();
    // Where it lies: the same address, T's segment, reported on S; nothing mapped, created,
    // unmapped, synchronized or waited for (T's work was done: one fence recorded and seen).
    assert_eq!((y.ptr, y.stream, y.block_size), (x.ptr, S, 20 * MIB));
    assert_eq!(segment_stream(&a, y.ptr), T);
    assert_eq!(a.blocks_borrowed(), 1);
    assert_eq!(a.memory_stats().memory_reserved(), reserved);
    assert_eq!(
        (
            after.create_physical_calls - before.create_physical_calls,
            after.map_calls - before.map_calls,
            after.unmap_calls - before.unmap_calls,
            after.stream_waits - before.stream_waits,
            after.stream_synchronize_calls + after.synchronize_calls,
        ),
        (0, 0, 0, 0, 0),
        "{after:?}"
    );
    assert!(dev.check_handout(S, y.ptr, 20 * MIB));
    a.check_invariants().unwrap();

    // The borrower's work is still queued when it frees the block: T does not get the block
    // back until an event shows that work done.
    dev.use_range(S, y.ptr, 20 * MIB);
    a.free(y.ptr).unwrap();
    let st = a.memory_stats();
    assert_eq!(st.active_bytes.get(StatType::All).current, 20 * MIB as i64);
    assert_eq!(st.allocated_bytes.get(StatType::All).current, 0);
    let z = a.allocate(32 * MIB, T).unwrap();
    assert!(
        z.ptr.0 >= y.ptr.0 + 20 * MIB as u64 || z.ptr.0 + 32 * MIB as u64 <= y.ptr.0,
        "T got the borrowed bytes while S's work was queued"
    );
    assert!(dev.check_handout(T, z.ptr, 32 * MIB));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.free(z.ptr).unwrap();
    // Once S's work is done, the next allocation's event poll gives the block back to T.
    dev.complete_work(S);
    let w = a.allocate(20 * MIB, T).unwrap();
    assert_eq!((w.ptr, a.blocks_borrowed()), (y.ptr, 1));
    assert!(dev.check_handout(T, w.ptr, 20 * MIB));
    a.free(w.ptr).unwrap();
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.memory_stats().memory_reserved(), 0);
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
}

#[test]
fn a_block_whose_work_is_pending_is_not_borrowed() {
    let a = with_config(1 << 30, borrowing());
    let dev = a.backend();
    let x = a.allocate(32 * MIB, T).unwrap();
    dev.use_range(T, x.ptr, 32 * MIB);
    a.free(x.ptr).unwrap();
    let y = a.allocate(20 * MIB, S).unwrap();
    assert_eq!(a.blocks_borrowed(), 0, "T's work on it is still queued");
    assert!(dev.check_handout(S, y.ptr, 20 * MIB));
    // Once T's work is done, the rest of the block can be borrowed.
    dev.complete_work(T);
    let z = a.allocate(8 * MIB, S).unwrap();
    assert!(dev.check_handout(S, z.ptr, 8 * MIB));
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    for p in [y, z] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_over_the_other_streams_and_never_the_small_pool() {
    let a = with_config(1 << 30, borrowing());
    let u = StreamId(3);
    // Two idle free blocks on two streams, 40 and 24 MiB; a 4 KiB small-pool block on T.
    let big = a.allocate(40 * MIB, T).unwrap();
    let mid = a.allocate(24 * MIB, u).unwrap();
    let small = a.allocate(4096, T).unwrap();
    for p in [big, mid, small] {
        a.free(p.ptr).unwrap();
    }
    let y = a.allocate(20 * MIB, S).unwrap();
    assert_eq!(y.ptr, mid.ptr, "the smallest block that fits");
    let s = a.allocate(4096, S).unwrap();
    assert_ne!(s.ptr, small.ptr, "the small pool is not borrowed from");
    assert_eq!(segment_stream(&a, s.ptr), S);
    assert_eq!(a.blocks_borrowed(), 1);
    for p in [y, s] {
        a.free(p.ptr).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn off_in_every_preset_and_on_by_key() {
    for config in Preset::ALL.iter().map(|p| p.config()) {
        assert!(!config.borrow_blocks);
        let a = with_config(1 << 30, config);
        let x = a.allocate(32 * MIB, T).unwrap();
        a.free(x.ptr).unwrap();
        let y = a.allocate(20 * MIB, S).unwrap();
        assert_eq!(a.blocks_borrowed(), 0);
        assert_eq!(segment_stream(&a, y.ptr), S);
        a.free(y.ptr).unwrap();
    }
    // The settings string names the key where it differs from PyTorch's (off), and parses back.
    let on = borrowing().to_settings();
    assert!(on.contains("cca_borrow_blocks:True"), "{on}");
    assert!(AllocatorConfig::parse(&on).unwrap().borrow_blocks);
    assert!(
        !AllocatorConfig::default()
            .to_settings()
            .contains("cca_borrow_blocks")
    );
    assert!(AllocatorConfig::parse("cca_borrow_blocks:maybe").is_err());
    let built = AllocatorConfigBuilder::from_config(AllocatorConfig::default())
        .borrow_blocks(true)
        .build()
        .unwrap();
    assert!(built.borrow_blocks);
}

#[test]
fn a_borrowed_block_stays_out_of_the_fast_path() {
    // The default has the fast path on: a borrowed block is the core's, so its free records the
    // borrower's event (and a hit on S never serves it without one).
    let a = with_config(1 << 30, borrowing());
    let dev = a.backend();
    let x = a.allocate(32 * MIB, T).unwrap();
    a.free(x.ptr).unwrap();
    for _ in 0..8 {
        let y = a.allocate(32 * MIB, S).unwrap();
        assert_eq!(y.ptr, x.ptr);
        dev.use_range(S, y.ptr, 32 * MIB);
        let records = dev.counters().event_records;
        a.free(y.ptr).unwrap();
        assert_eq!(dev.counters().event_records, records + 1, "an event on S");
        dev.complete_work(S);
    }
    assert!(dev.violations().is_empty(), "{:?}", dev.violations());
    a.check_invariants().unwrap();
}

/// Our FSDP2 recording (two streams for the all-gathers and reduce-scatters beside the compute
/// stream): borrowing takes the idle buffers where they lie instead of moving their pages, at
/// the same peak (`benches/README.md`, "Borrowed blocks").
#[cfg(feature = "trace-io")]
#[test]
fn fsdp_moves_fewer_pages_at_the_same_peak() {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/gpu/traces/fsdp.pickle.gz");
    let trace = read_trace_file(path, &ImportOptions::default())
        .unwrap()
        .trace;
    let run = |config: AllocatorConfig| {
        let a = with_config(80 << 30, config);
        replay(&a, &trace, &ReplayOptions::default()).unwrap()
    };
    let with = run(borrowing());
    let without = run(AllocatorConfig::default());
    assert!(with.blocks_borrowed > 0);
    assert_eq!(without.blocks_borrowed, 0);
    assert_eq!(with.peak_reserved_bytes, without.peak_reserved_bytes);
    assert!(
        with.device_call("unmap") * 2 < without.device_call("unmap"),
        "unmaps {} with against {} without",
        with.device_call("unmap"),
        without.device_call("unmap")
    );
    assert_eq!(
        with.device_call("synchronize") + with.device_call("stream_synchronize"),
        0
    );
}
