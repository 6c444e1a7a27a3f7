//! GPU probes of cudarc's stream ordering on cached buffers (issue #10): each hazard is run 20
//! times with a delay kernel that makes a missing wait visible, once on a context that manages
//! stream synchronization (cudarc's default: the cached buffers must be as correct as cudarc's
//! own) and once, as a control, on a context object with event tracking off (cudarc orders
//! nothing there, nor do the cached buffers: the race must show, or the probe proves nothing).
//! `#[ignore]`d like `cuda.rs` (`--ignored` runs them), single-threaded.
#![cfg(feature = "cuda")]

use std::sync::{Arc, OnceLock};

use cuda_caching_allocator::AllocatorConfig;
use cuda_caching_allocator::interop::{CachedSlice, CudaAllocator};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PushKernelArg};

use crate::spin::{N, SPIN, expected, grid, kernels, spin_grid};
use crate::util::{require_gpu, under_sanitizer};

const TRIALS: usize = 20;

/// A context object for the probe: the primary context of device 0 with its own flags
/// (cudarc keeps the stream count and event tracking per `CudaContext` object), and two streams.
fn setup(tracking: bool) -> (Arc<CudaContext>, Arc<CudaStream>, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).unwrap();
    if !tracking {
        // SAFETY: no buffer of this context object exists yet; the probe orders nothing by hand
        // on purpose (that is the control arm).
        unsafe { ctx.disable_event_tracking() };
    }
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    (ctx, s1, s2)
}

/// Hazard (a): a slow kernel writes `x` on s1; a copy on s2 reads `x` at once. Returns the trials
/// whose copy did not see the write.
fn read_after_write(tracking: bool) -> usize {
    let (ctx, s1, s2) = setup(tracking);
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let n = N as u64;
    let mut wrong = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 7;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
        s1.synchronize().unwrap();
        let mut launch = s1.launch_builder(&k.spin_fill);
        launch.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes `N` values of an `N`-value buffer.
        unsafe { launch.launch(spin_grid()) }.unwrap();
        let mut y: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        s2.memcpy_dtod(&x, &mut y).unwrap();
        let got = y.to_vec().unwrap();
        if got != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    alloc.check_invariants().unwrap();
    wrong
}

/// Hazard (b): a slow kernel on s2 reads `x` (allocated on s1); `x` is dropped at once and s1
/// allocates the same size (the same block) and overwrites it. Returns the trials whose read saw
/// the overwrite, and how many trials reused the block.
fn reuse_after_read(tracking: bool) -> (usize, usize) {
    reuse_after_read_on(tracking, false)
}

/// Hazard (b), the new buffer's first use (the overwrite) on s1, or with `third` on a third
/// stream (hazard (d)).
fn reuse_after_read_on(tracking: bool, third: bool) -> (usize, usize) {
    let (ctx, s1, s2) = setup(tracking);
    let over_on = if third {
        ctx.new_stream().unwrap()
    } else {
        Arc::clone(&s1)
    };
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let n = N as u64;
    let (mut wrong, mut reused) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 11;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
        let mut fill = s1.launch_builder(&k.spin_fill);
        let zero = 0i64;
        fill.arg(&mut x).arg(&n).arg(&v).arg(&zero);
        // SAFETY: as above.
        unsafe { fill.launch(grid()) }.unwrap();
        s1.synchronize().unwrap();
        let mut z: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        let mut copy = s2.launch_builder(&k.spin_copy);
        copy.arg(&x).arg(&mut z).arg(&n).arg(&SPIN);
        // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) reads and writes `N` values of
        // two `N`-value buffers.
        unsafe { copy.launch(spin_grid()) }.unwrap();
        let before = x.device_ptr_raw();
        drop(x);
        let mut x2: CachedSlice<u32> = unsafe_uninit(&alloc, &s1);
        if x2.device_ptr_raw() == before {
            reused += 1;
        }
        let junk = 0xDEAD_0000u32;
        let mut over = over_on.launch_builder(&k.spin_fill);
        over.arg(&mut x2).arg(&n).arg(&junk).arg(&zero);
        // SAFETY: as above.
        unsafe { over.launch(grid()) }.unwrap();
        let got = z.to_vec().unwrap();
        if got != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    alloc.check_invariants().unwrap();
    (wrong, reused)
}

/// Hazard (c), a borrowed block (Note [Borrowed blocks]): s1 leaves an idle free block; s2,
/// which has no free block of its own, borrows it, fills it, and a slow kernel on s2 copies it
/// out; the block is dropped at once and s1 allocates the same size and overwrites what it gets.
/// Event tracking is off, so only the allocator orders anything. In the `control` arm the block
/// is allocated on s1 itself (no borrowing, the use on s2 undeclared): the overwrite must show
/// there, or the probe proves nothing. Returns the trials whose copy saw the overwrite, the
/// trials that borrowed, and the trials whose overwrite landed on the block just used.
fn borrowed_reuse(control: bool) -> (usize, usize, usize) {
    let (ctx, s1, s2) = setup(false);
    let k = kernels(&ctx);
    let config = AllocatorConfig::parse("cca_preset:default,cca_borrow_blocks:True").unwrap();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), config).unwrap();
    let n = N as u64;
    let zero = 0i64;
    let (mut wrong, mut borrowed, mut same) = (0, 0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 13;
        // s2's output first: s2 then holds no free block of this size.
        let mut z: CachedSlice<u32> = unsafe_uninit(&alloc, &s2);
        let x = unsafe_uninit(&alloc, &s1);
        s1.synchronize().unwrap();
        drop(x);
        // In the core, not in this thread's front cache, so that the next miss can see it.
        alloc.flush_thread_caches();
        let before = alloc.blocks_borrowed();
        let mut y = unsafe_uninit(&alloc, if control { &s1 } else { &s2 });
        if alloc.blocks_borrowed() > before {
            borrowed += 1;
        }
        let mut fill = s2.launch_builder(&k.spin_fill);
        fill.arg(&mut y).arg(&n).arg(&v).arg(&zero);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes `N` values of an `N`-value buffer.
        unsafe { fill.launch(grid()) }.unwrap();
        let mut copy = s2.launch_builder(&k.spin_copy);
        copy.arg(&y).arg(&mut z).arg(&n).arg(&SPIN);
        // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) reads and writes `N` values of
        // two `N`-value buffers.
        unsafe { copy.launch(spin_grid()) }.unwrap();
        let used = y.device_ptr_raw();
        drop(y);
        let mut x2 = unsafe_uninit(&alloc, &s1);
        if x2.device_ptr_raw() == used {
            same += 1;
        }
        let junk = 0xDEAD_0000u32;
        let mut over = s1.launch_builder(&k.spin_fill);
        over.arg(&mut x2).arg(&n).arg(&junk).arg(&zero);
        // SAFETY: as above.
        unsafe { over.launch(grid()) }.unwrap();
        s2.synchronize().unwrap();
        let got = z.to_vec().unwrap();
        if got != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    alloc.check_invariants().unwrap();
    (wrong, borrowed, same)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_borrowed_block_returns_only_after_the_borrowers_work() {
    require_gpu("a_borrowed_block_returns_only_after_the_borrowers_work");
    let probe = borrowed_reuse(false);
    let control = borrowed_reuse(true);
    println!(
        "borrowed-block probe, {TRIALS} trials: borrowed {}, overwrite seen {}, s1 got the used block at once {}; control (own stream, undeclared use): overwrite seen {}, same block {}",
        probe.1, probe.0, probe.2, control.0, control.2
    );
    assert_eq!(
        probe.1, TRIALS,
        "every trial must borrow, or the probe tests nothing"
    );
    assert_eq!(
        probe.0, 0,
        "reuse of a borrowed block before the borrower's work ended"
    );
    if !under_sanitizer() {
        assert!(control.2 > 0, "control arm never reused the block");
        assert!(control.0 > 0, "control arm: the reuse race did not show");
    }
}

/// Hazard (d), the kept events of a cache hit (Note [Event shells and captures]): as hazard (b),
/// but the new buffer's *first* use, the overwrite, is on a third stream. Only the block's kept
/// events, which the new buffer takes at that first use, order the write after the read
/// (cudarc's own `alloc` gives new events, which order nothing there).
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn a_cache_hits_first_use_on_a_third_stream_waits_for_the_blocks_last_reads() {
    require_gpu("a_cache_hits_first_use_on_a_third_stream_waits_for_the_blocks_last_reads");
    let managed = reuse_after_read_on(true, true);
    let control = reuse_after_read_on(false, true);
    println!(
        "kept-events probe, {TRIALS} trials: managed wrong {}/{TRIALS} (block reused {}); control (tracking off) wrong {}/{TRIALS} (block reused {})",
        managed.0, managed.1, control.0, control.1
    );
    assert_eq!(managed.1, TRIALS, "every trial must reuse the block");
    assert_eq!(
        managed.0, 0,
        "a first use on a third stream overtook the block's last read"
    );
    if !under_sanitizer() {
        assert!(control.1 > 0, "control arm never reused the block");
        assert!(control.0 > 0, "control arm: the race did not show");
    }
}

fn unsafe_uninit(alloc: &CudaAllocator, s: &Arc<CudaStream>) -> CachedSlice<u32> {
    // SAFETY: `u32` is valid for every bit pattern; the probe overwrites it before reading.
    unsafe { alloc.alloc::<u32>(s, N) }.unwrap()
}

/// Results of the probes, computed once and printed for the GPU log.
fn results() -> &'static [(usize, (usize, usize)); 2] {
    static R: OnceLock<[(usize, (usize, usize)); 2]> = OnceLock::new();
    R.get_or_init(|| {
        let managed = (read_after_write(true), reuse_after_read(true));
        let control = (read_after_write(false), reuse_after_read(false));
        println!(
            "cudarc stream probes, {TRIALS} trials each: managed (event tracking on): read-after-write wrong {}/{TRIALS}, reuse-after-read wrong {}/{TRIALS} (block reused {}); control (tracking off): read-after-write wrong {}/{TRIALS}, reuse-after-read wrong {}/{TRIALS} (block reused {})",
            managed.0, managed.1.0, managed.1.1, control.0, control.1.0, control.1.1
        );
        [managed, control]
    })
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cached_buffers_keep_cudarc_stream_order() {
    require_gpu("cached_buffers_keep_cudarc_stream_order");
    let [managed, control] = *results();
    assert_eq!(managed.0, 0, "read after a write on another stream");
    assert_eq!(managed.1.0, 0, "reuse after a read on another stream");
    if !under_sanitizer() {
        // The probe must be able to fail: without ordering, the race shows.
        assert!(
            control.0 > 0,
            "control arm: the read-after-write race did not show"
        );
        assert!(
            control.1.0 > 0,
            "control arm: the reuse-after-read race did not show"
        );
        // The hazard (b) arm only means something if the block was reused.
        assert!(control.1.1 > 0, "control arm never reused the block");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cudarc_own_buffers_agree() {
    // The reference: the same hazard (a) with cudarc's own `CudaSlice` is ordered by cudarc.
    require_gpu("cudarc_own_buffers_agree");
    let (ctx, s1, s2) = setup(true);
    let k = kernels(&ctx);
    let n = N as u64;
    for trial in 0..TRIALS {
        let v = 77 + trial as u32;
        let mut x: CudaSlice<u32> = s1.alloc_zeros(N).unwrap();
        let mut launch = s1.launch_builder(&k.spin_fill);
        launch.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: as above.
        unsafe { launch.launch(spin_grid()) }.unwrap();
        let mut y: CudaSlice<u32> = s2.alloc_zeros(N).unwrap();
        s2.memcpy_dtod(&x, &mut y).unwrap();
        assert_eq!(s2.clone_dtoh(&y).unwrap(), expected(v));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn event_pairs_follow_tracking_and_hits_reuse_them() {
    require_gpu("event_pairs_follow_tracking_and_hits_reuse_them");
    // A fresh context object with no second stream: cudarc manages nothing, but its buffers have
    // their events (tracking is on), and so do ours (Note [Events whenever tracking is on]);
    // they stay with the block's address, and a hit takes them back without making any.
    let ctx = CudaContext::new(0).unwrap();
    let s = ctx.default_stream();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let a: CachedSlice<u32> = alloc.alloc_zeros(&s, 1000).unwrap();
    assert!(
        a.has_events(),
        "one stream, tracking on: events, as cudarc's"
    );
    let p0 = a.device_ptr_raw();
    drop(a);
    assert_eq!(alloc.kept_event_pairs(), 1);
    let a: CachedSlice<u32> = alloc.alloc_zeros(&s, 1000).unwrap();
    assert_eq!(a.device_ptr_raw(), p0, "cache hit");
    assert!(a.has_events());
    assert_eq!(alloc.kept_event_pairs(), 0, "the hit took the kept pair");
    drop(a);
    // Tracking off: no events (cudarc's buffers have none either); the kept pair stays kept.
    // SAFETY: nothing is in flight on this context object's buffers that needs ordering.
    unsafe { ctx.disable_event_tracking() };
    let z: CachedSlice<u32> = alloc.alloc_zeros(&s, 1000).unwrap();
    assert!(!z.has_events(), "tracking off: no events");
    drop(z);
    assert_eq!(alloc.kept_event_pairs(), 1);
    // SAFETY: as above.
    unsafe { ctx.enable_event_tracking() };
    // A second stream switches the context to multi-stream mode, where the events order uses.
    let s2 = ctx.new_stream().unwrap();
    let b: CachedSlice<u32> = alloc.alloc_zeros(&s2, 1000).unwrap();
    assert!(b.has_events());
    let p = b.device_ptr_raw();
    drop(b);
    assert_eq!(alloc.kept_event_pairs(), 2);
    let c: CachedSlice<u32> = alloc.alloc_zeros(&s2, 1000).unwrap();
    assert_eq!(c.device_ptr_raw(), p, "cache hit");
    assert!(c.has_events());
    assert_eq!(
        alloc.kept_event_pairs(),
        1,
        "the hit took the kept events back"
    );
    // Views carry the events: a write through a view on s1 orders a read on s2.
    let s1 = ctx.new_stream().unwrap();
    let k = kernels(&ctx);
    let mut d: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
    let n = (N / 2) as u64;
    let v = 5u32;
    {
        let mut tail = d.get_mut(N / 2..).unwrap();
        let mut launch = s1.launch_builder(&k.spin_fill);
        launch.arg(&mut tail).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: spin_fill writes `N / 2` values of an `N / 2`-value view.
        unsafe { launch.launch(spin_grid()) }.unwrap();
    }
    let mut e: CachedSlice<u32> = alloc.alloc_zeros(&s2, N / 2).unwrap();
    s2.memcpy_dtod(&d.get(N / 2..).unwrap(), &mut e).unwrap();
    let want: Vec<u32> = (0..N as u32 / 2).map(|i| v.wrapping_add(i)).collect();
    assert_eq!(
        e.to_vec().unwrap(),
        want,
        "view write on s1, view read on s2"
    );
    drop((c, d, e));
    alloc.empty_cache().unwrap();
    assert_eq!(
        alloc.kept_event_pairs(),
        0,
        "empty_cache destroys kept events"
    );
}

/// A program that forks a stream per task does not accumulate streams: the allocator keeps an
/// admitted stream only while something uses it. Tasks whose stream holds no cached block are
/// released as admissions grow (at 64 admitted, then at twice what stays); tasks that allocated
/// on their stream keep it while its cached blocks do, and `empty_cache` releases those.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn forked_streams_are_released_once_unused() {
    require_gpu("forked_streams_are_released_once_unused");
    let ctx = CudaContext::new(0).unwrap();
    let main = ctx.default_stream();
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let shared: CachedSlice<u32> = alloc.htod(&main, &[7u32; 1024]).unwrap();
    let mut most = 0;
    for _ in 0..500 {
        let task = main.fork().unwrap();
        alloc.admit(&task).unwrap();
        let copy = task.clone_dtoh(&shared).unwrap();
        assert_eq!(copy, [7u32; 1024]);
        most = most.max(alloc.device().admitted_stream_count());
    }
    assert!(most <= 64, "500 tasks kept up to {most} streams admitted");
    // Tasks that allocate on their own stream: a stream stays admitted while cached blocks of
    // its own are mapped (the default's page reuse may move a dead stream's free pages to a live
    // one first, which releases it earlier); `empty_cache` releases the rest.
    for _ in 0..100 {
        let task = main.fork().unwrap();
        let mut mine: CachedSlice<u32> = alloc.alloc_zeros(&task, 4096).unwrap();
        task.memcpy_dtod(&shared, &mut mine).unwrap();
        assert_eq!(mine.to_vec().unwrap()[..1024], [7u32; 1024]);
    }
    drop(shared);
    main.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.device().admitted_stream_count(), 0);
    alloc.check_invariants().unwrap();
}

// ---- suspected hazards of an interop review (twenty-second session) --------------------------
//
// Found by reading, with no GPU left to run them: each probe returns how many of `TRIALS`
// results were wrong in the probe arm and in a control arm that differs only in the suspected
// trigger, and each asserts what cudarc's own buffers do. R7-1 (a kept event shell taken by a
// buffer of another `CudaContext` object) is fixed by Note [Shells of one context object], R7-2
// (a view made while one stream existed stayed event-less) by Note [Events whenever tracking is on],
// R7-3 (`as_cuda_slice` while event tracking is off) by Note [Typed buffers made while tracking
// is off].

/// R7-1: a kept event shell made under context object A, taken by a buffer of context object B
/// (same device, same cache, both on the legacy default stream, so the same block). cudarc's
/// `DevicePtr` impls gate their waits on the *shell's* context (A), which no longer manages
/// synchronization once A's streams are gone. Read-after-write: a slow kernel on B's stream
/// writes `x`, `x.to_vec()` on the default stream reads it.
fn shell_of_another_context_object(trigger: bool) -> (usize, usize) {
    let ctx_b = CudaContext::new(0).unwrap();
    let s2 = ctx_b.new_stream().unwrap();
    let _s3 = ctx_b.new_stream().unwrap();
    let db = ctx_b.default_stream();
    let spin_fill = kernels(&ctx_b).spin_fill;
    let alloc = CudaAllocator::new(Arc::clone(&ctx_b), AllocatorConfig::default()).unwrap();
    let mut first = None;
    if trigger {
        let ctx_a = CudaContext::new(0).unwrap();
        let a1 = ctx_a.new_stream().unwrap();
        let a2 = ctx_a.new_stream().unwrap();
        let da = ctx_a.default_stream();
        let w: CachedSlice<u32> = alloc.alloc_zeros(&da, N).unwrap(); // byte shell made under A
        first = Some(w.device_ptr_raw());
        da.synchronize().unwrap();
        drop(w); // shell kept at its address
        drop((a1, a2)); // A manages nothing any more (its object lives on in the shell)
    }
    let n = N as u64;
    let (mut wrong, mut same) = (0, 0);
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 7;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&db, N).unwrap();
        if Some(x.device_ptr_raw()) == first {
            same += 1;
        }
        db.synchronize().unwrap();
        let mut l = s2.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes N values of an N-value buffer.
        unsafe { l.launch(spin_grid()) }.unwrap();
        if x.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx_b.synchronize().unwrap();
    }
    (wrong, same)
}

/// R7-2: a view made while the context had one stream carries no events; after `new_stream`
/// and a use that makes the buffer's shell, a kernel reads through the old view on s2 (marked
/// only), and a later write through the buffer (shell exists: no settle) does not wait for it.
fn stale_view(trigger: bool) -> usize {
    let mut wrong = 0;
    let n = N as u64;
    let zero = 0i64;
    for trial in 0..TRIALS {
        let ctx = CudaContext::new(0).unwrap(); // fresh object: one stream
        let d = ctx.default_stream();
        let k = kernels(&ctx);
        let (spin_fill, spin_copy) = (k.spin_fill, k.spin_copy);
        let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
        let v = 1000 * trial as u32 + 11;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&d, N).unwrap();
        let mut l = d.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&zero);
        // SAFETY: as above.
        unsafe { l.launch(spin_grid()) }.unwrap();
        d.synchronize().unwrap();
        let mut z: CachedSlice<u32>;
        {
            let early = trigger.then(|| x.as_view()); // no events: one stream
            let s2 = ctx.new_stream().unwrap(); // cudarc now manages synchronization
            let _ = x.to_vec().unwrap(); // makes the byte shell (nothing marked yet)
            let late = x.as_view(); // control: a view with events
            let view = early.as_ref().unwrap_or(&late);
            z = alloc.alloc_zeros(&s2, N).unwrap();
            let mut c = s2.launch_builder(&spin_copy);
            c.arg(view).arg(&mut z).arg(&n).arg(&SPIN);
            // SAFETY: spin_copy(const unsigned*, unsigned*, u64, i64) on two N-value buffers.
            unsafe { c.launch(spin_grid()) }.unwrap();
        }
        d.memset_zeros(&mut x).unwrap(); // must wait for the copy's read (cudarc: read event)
        if z.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    wrong
}

/// R7-3: `as_cuda_slice` first called while event tracking is off makes a typed shell without
/// events, which then takes precedence for every use, also after tracking is back on. cudarc's
/// buffer allocated while tracking was on keeps its events.
fn typed_shell_without_events(trigger: bool) -> usize {
    let ctx = CudaContext::new(0).unwrap();
    let s1 = ctx.new_stream().unwrap();
    let s2 = ctx.new_stream().unwrap();
    let spin_fill = kernels(&ctx).spin_fill;
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let n = N as u64;
    let mut wrong = 0;
    for trial in 0..TRIALS {
        let v = 1000 * trial as u32 + 13;
        let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap(); // tracking on
        s1.synchronize().unwrap();
        if trigger {
            // SAFETY: nothing is in flight; tracking comes back on below.
            unsafe { ctx.disable_event_tracking() };
        }
        let _ = x.as_cuda_slice();
        // SAFETY: as above.
        unsafe { ctx.enable_event_tracking() };
        let mut l = s1.launch_builder(&spin_fill);
        l.arg(&mut x).arg(&n).arg(&v).arg(&SPIN);
        // SAFETY: as above.
        unsafe { l.launch(spin_grid()) }.unwrap();
        let mut y: CachedSlice<u32> = alloc.alloc_zeros(&s2, N).unwrap();
        s2.memcpy_dtod(&x, &mut y).unwrap();
        if y.to_vec().unwrap() != expected(v) {
            wrong += 1;
        }
        ctx.synchronize().unwrap();
    }
    wrong
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_kept_shell_serves_only_its_own_context_object() {
    require_gpu("cuda_a_kept_shell_serves_only_its_own_context_object");
    let (probe, control) = (
        shell_of_another_context_object(true),
        shell_of_another_context_object(false),
    );
    println!("other-context shell: probe (wrong, same block) {probe:?}, control {control:?}");
    assert!(
        probe.1 > 0,
        "the probe never got the first object's block: {probe:?}"
    );
    assert_eq!(
        (probe.0, control.0),
        (0, 0),
        "cudarc would order every read"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_view_made_before_a_second_stream_orders_later_writes() {
    require_gpu("cuda_a_view_made_before_a_second_stream_orders_later_writes");
    let (probe, control) = (stale_view(true), stale_view(false));
    assert_eq!(
        (probe, control),
        (0, 0),
        "wrong results: probe {probe}, control {control}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_typed_shell_made_while_tracking_was_off_keeps_ordering() {
    require_gpu("cuda_a_typed_shell_made_while_tracking_was_off_keeps_ordering");
    let (probe, control) = (
        typed_shell_without_events(true),
        typed_shell_without_events(false),
    );
    assert_eq!(
        (probe, control),
        (0, 0),
        "wrong results: probe {probe}, control {control}"
    );
}

/// Note [Leaked buffers end their events as dropped ones], a kernel's use without events (the
/// events forced to fail, Note [Uses without events]): a slow kernel writes the buffer on s2,
/// then (probe) the buffer is leaked and its allocation stream s1 memsets the memory through the
/// driver. `leak` promises the drop's waits, so the memset must come after the kernel's write.
/// The control arm memsets at the same point without the leak: the kernel must overwrite it,
/// or the kernel was too short to tell. Returns whether the memset's zeros are what is left.
fn leak_after_an_unordered_kernel(probe: bool) -> bool {
    let (ctx, s1, s2) = setup(true);
    let k = kernels(&ctx);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    // Not `alloc_zeros`: its memset is the buffer's first use and would take the events (Note
    // [Events whenever tracking is on]) before the hook below can make them fail.
    // SAFETY: `u32` is valid for every bit pattern; the kernel writes every value before a read.
    let mut x: CachedSlice<u32> = unsafe { alloc.alloc::<u32>(&s1, N) }.unwrap();
    ctx.synchronize().unwrap();
    let (n, v, cycles) = (N as u64, 7u32, 1_000_000_000i64);
    cuda_caching_allocator::interop::fail_next_event_shells(1);
    let mut launch = s2.launch_builder(&k.spin_fill);
    launch.arg(&mut x).arg(&n).arg(&v).arg(&cycles);
    cuda_caching_allocator::interop::fail_next_event_shells(0);
    // SAFETY: spin_fill(unsigned*, u64, u32, i64) writes `N` values of an `N`-value buffer.
    unsafe { launch.launch(spin_grid()) }.unwrap();
    assert!(!x.has_events(), "the hook made the events fail");
    let p = x.device_ptr_raw().0;
    let leaked = if probe { Some(x.leak()) } else { None };
    // SAFETY: `p` holds `N` u32 of the (leaked or live) buffer; s1 is its allocation stream.
    unsafe { cudarc::driver::result::memset_d8_async(p, 0, N * 4, s1.cu_stream()) }.unwrap();
    ctx.synchronize().unwrap();
    let mut back = vec![1u32; N];
    // SAFETY: as above; every stream is synchronized.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut back, p) }.unwrap();
    if let Some(ptr) = leaked {
        assert_eq!(ptr, p);
        // SAFETY: the leaked block of this allocator; nothing uses it any more.
        unsafe { alloc.free(cuda_caching_allocator::DeviceAddr(ptr)) }.unwrap();
    }
    assert_eq!(ctx.check_err(), Ok(()));
    back.iter().all(|&b| b == 0)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_leak_waits_for_a_kernel_use_without_events() {
    require_gpu("cuda_a_leak_waits_for_a_kernel_use_without_events");
    let (probe, control) = (
        leak_after_an_unordered_kernel(true),
        leak_after_an_unordered_kernel(false),
    );
    println!("the memset after the kernel is what is left: probe {probe}, control {control}");
    assert!(
        !control,
        "the control's memset was not overwritten: the kernel was too short to tell"
    );
    assert!(
        probe,
        "the leak did not wait for the kernel's use without events"
    );
}

/// The calling thread's current context (null when none).
fn current_ctx() -> cudarc::driver::sys::CUcontext {
    cudarc::driver::result::ctx::get_current()
        .unwrap()
        .unwrap_or(std::ptr::null_mut())
}

/// Makes `ctx` current on the calling thread (null: none).
fn set_current(ctx: cudarc::driver::sys::CUcontext) {
    // SAFETY: null or the primary context of a live `CudaContext` of this test.
    unsafe { cudarc::driver::result::ctx::set_current(ctx) }.unwrap();
}

/// Note [Leaked buffers end their events as dropped ones]: a leak lets cudarc bind the buffer's
/// context (its waits and event destructions) and, like the drop and every other call of the
/// cache, puts the caller's current context back (none, here); and the buffer's event pair stays
/// with the block, so the block's next buffer makes no new events. The control arm is a cudarc
/// call of the same context (a stream synchronization), which leaves it current: the probe can
/// tell.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_a_leak_keeps_the_callers_context_and_the_blocks_events() {
    require_gpu("cuda_a_leak_keeps_the_callers_context_and_the_blocks_events");
    let (ctx, s1, s2) = setup(true);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let mut x: CachedSlice<u32> = alloc.alloc_zeros(&s1, N).unwrap();
    s2.memset_zeros(&mut x).unwrap();
    assert!(x.has_events(), "the uses took the buffer's events");
    assert_eq!(alloc.kept_event_pairs(), 0);

    set_current(std::ptr::null_mut());
    s1.synchronize().unwrap();
    let control = current_ctx();
    set_current(std::ptr::null_mut());
    let p = x.leak();
    let probe = current_ctx();
    set_current(ctx.cu_ctx());
    println!("current context after: a cudarc call {control:?}, the leak {probe:?}");
    assert!(!control.is_null(), "the control left no context current");
    assert!(
        probe.is_null(),
        "the leak left a context current: {probe:?}"
    );
    assert_eq!(
        alloc.kept_event_pairs(),
        1,
        "the leaked buffer's events stay with its block"
    );
    ctx.synchronize().unwrap();
    // SAFETY: the leaked block of this allocator; its uses are synchronized.
    unsafe { alloc.free(cuda_caching_allocator::DeviceAddr(p)) }.unwrap();
    assert_eq!(ctx.check_err(), Ok(()));
    alloc.empty_cache().unwrap();
}

/// A buffer's first view, `try_as_cuda_slice` and `try_as_cuda_view_mut` make its events, and
/// cudarc binds the buffer's context to make them; cudarc's own `slice`, `as_view_mut` and a
/// `&CudaSlice` bind nothing, so each of the three puts the caller's current context back (none,
/// here), as the drop, `leak` and every call of the cache do. The control arm is a cudarc call
/// of the same context, which leaves it current: the probe can tell.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_first_views_and_typed_shells_keep_the_callers_context() {
    require_gpu("cuda_first_views_and_typed_shells_keep_the_callers_context");
    let (ctx, s1, _s2) = setup(true);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    // SAFETY: the buffers are never read; only their events are made.
    let (x, y, mut z) = unsafe {
        (
            alloc.alloc::<u32>(&s1, N).unwrap(),
            alloc.alloc::<u32>(&s1, N).unwrap(),
            alloc.alloc::<u32>(&s1, N).unwrap(),
        )
    };
    assert!(!x.has_events() && !y.has_events() && !z.has_events());

    set_current(std::ptr::null_mut());
    s1.synchronize().unwrap();
    let control = current_ctx();
    set_current(std::ptr::null_mut());
    let after_view = {
        let _view = x.as_view();
        current_ctx()
    };
    set_current(std::ptr::null_mut());
    y.try_as_cuda_slice().unwrap();
    let after_typed = current_ctx();
    set_current(std::ptr::null_mut());
    z.try_as_cuda_view_mut().unwrap();
    let after_view_mut = current_ctx();
    set_current(ctx.cu_ctx());
    println!(
        "current context after: a cudarc call {control:?}, a first view {after_view:?}, \
         try_as_cuda_slice {after_typed:?}, try_as_cuda_view_mut {after_view_mut:?}"
    );
    assert!(!control.is_null(), "the control left no context current");
    assert!(x.has_events() && y.has_events() && z.has_events());
    assert!(after_view.is_null(), "a first view left a context current");
    assert!(
        after_typed.is_null(),
        "try_as_cuda_slice left a context current"
    );
    assert!(
        after_view_mut.is_null(),
        "try_as_cuda_view_mut left a context current"
    );
    drop((x, y, z));
    ctx.synchronize().unwrap();
    assert_eq!(ctx.check_err(), Ok(()));
}

/// `CachedView::chunks_exact` panics on a chunk size of 0 as cudarc's `CudaView::chunks_exact`
/// does (cudarc divides the length by it, so an empty view panics too; the first version
/// returned no chunks for an empty view). Each arm runs on an empty and a non-empty view; the
/// control arm is cudarc's own view of its own buffer.
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda,cublas --test all -- --ignored (gpu/run.sh runs it)"]
fn cuda_chunks_exact_of_zero_panics_as_cudarcs() {
    require_gpu("cuda_chunks_exact_of_zero_panics_as_cudarcs");
    let (ctx, s1, _s2) = setup(true);
    let alloc = CudaAllocator::new(Arc::clone(&ctx), AllocatorConfig::default()).unwrap();
    let ours: CachedSlice<u32> = alloc.alloc_zeros(&s1, 8).unwrap();
    let theirs: CudaSlice<u32> = s1.alloc_zeros(8).unwrap();
    let panics =
        |f: &dyn Fn() -> usize| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    for len in [0usize, 8] {
        let control = panics(&|| theirs.slice(..len).chunks_exact(0).count());
        let probe = panics(&|| ours.slice(..len).chunks_exact(0).count());
        println!("chunks_exact(0) of {len} values panics: cudarc {control}, ours {probe}");
        assert!(control, "cudarc's chunks_exact(0) of {len} values returned");
        assert_eq!(
            probe, control,
            "chunks_exact(0) of {len} values, as cudarc's"
        );
    }
    drop(theirs);
    drop(ours);
    s1.synchronize().unwrap();
    assert_eq!(ctx.check_err(), Ok(()));
}
