//! The device-time model on the shipped traces (#11): what each configuration's growth costs in
//! modeled driver time (`ReplayReport::modeled_device_ns`, H100 call costs) and synchronizations,
//! held under committed bounds so that a change that brings the cost back fails; plus the growth
//! knobs that cut the cost (`cca_min_growth_mb`, `cca_handle_per_growth`).

use cuda_caching_allocator::trace::{Trace, TraceOp, TraceSource};
use cuda_caching_allocator::*;

const MIB: usize = 1 << 20;

fn run(trace: &Trace, config: AllocatorConfig) -> ReplayReport {
    let alloc = CachingAllocator::new(SimDevice::default(), config).unwrap();
    replay(&alloc, trace, &ReplayOptions::default()).unwrap()
}

#[cfg(feature = "trace-io")]
fn syncs(r: &ReplayReport) -> u64 {
    r.device_call("synchronize") + r.device_call("stream_synchronize")
}

/// Allocations of `sizes` MiB on stream 0, none freed.
fn growing(sizes: &[usize]) -> Trace {
    let mut t = Trace::new(TraceSource::Synthetic);
    for (i, &mb) in sizes.iter().enumerate() {
        t.push(TraceOp::Alloc {
            id: i as u64,
            size: (mb * MIB) as u64,
            stream: 0,
            addr: None,
        });
    }
    t
}

/// `trace` replayed with every event query answered late `lag` times (a device running behind
/// the host, `SimDevice::set_event_query_lag`).
fn run_lagged(trace: &Trace, config: AllocatorConfig, lag: u32) -> ReplayReport {
    let dev = SimDevice::default();
    dev.set_event_query_lag(lag);
    let alloc = CachingAllocator::new(dev, config).unwrap();
    replay(&alloc, trace, &ReplayOptions::default()).unwrap()
}

/// Lent pages (`cca_page_lending`, Note [Lent pages]): with fences seen late, the default stays
/// at ≤ 1.02 × live on the synthetic stress traces without synchronizing; without lending the
/// memory the pending fences hold back shows (benches/README.md, "Lent pages": 1.12–1.49 on the
/// transformer and many-stream traces).
#[test]
fn lent_pages_keep_the_default_lean_when_fences_complete_late() {
    use cuda_caching_allocator::synth::Workload;
    let no_lending = AllocatorConfig::parse("cca_preset:default,cca_page_lending:False").unwrap();
    for w in [Workload::TransformerVarlen, Workload::ManyStreams] {
        let t = w.trace(1);
        for lag in [1, 4] {
            let r = run_lagged(&t, AllocatorConfig::default(), lag);
            let syncs = r.device_call("synchronize") + r.device_call("stream_synchronize");
            assert!(
                r.reserved_over_live() <= 1.02,
                "{} lag {lag}: {:.4}",
                w.name(),
                r.reserved_over_live()
            );
            assert_eq!(syncs, 0, "{} lag {lag}: {:?}", w.name(), r.device_calls);
            assert!(r.page_loans > 0, "{} lag {lag}: nothing lent", w.name());
            let without = run_lagged(&t, no_lending.clone(), lag);
            assert!(
                without.reserved_over_live() > 1.1,
                "{} lag {lag} without lending: {:.4}",
                w.name(),
                without.reserved_over_live()
            );
            assert_eq!(without.page_loans, 0);
        }
    }
}

/// The sixteen sizes of a transformer step's tensors (`gpu/host_pair.py`'s), in the order the
/// rotating queue allocates them.
pub(crate) const QUEUE_SIZES: [usize; 16] = [
    3072,
    MIB,
    2_359_296,
    4_718_592,
    6_291_456,
    9_437_184,
    512,
    25_165_824,
    12_582_912,
    3072,
    786_432,
    100_663_296,
    2_359_296,
    49_152,
    6_291_456,
    37_748_736,
];

/// A queue of `window` live tensors whose sizes rotate through a transformer step's shapes:
/// each allocation frees the one made `window` allocations before (`gpu/host_pair.py`'s
/// same-thread pattern). `pairs` allocations after `8 × window` of warm-up.
fn rotating_queue(pairs: usize, window: usize) -> Trace {
    let mut t = Trace::new(TraceSource::Synthetic);
    let n = pairs + 8 * window;
    for i in 0..n {
        t.push(TraceOp::Alloc {
            id: i as u64,
            size: QUEUE_SIZES[i % QUEUE_SIZES.len()] as u64,
            stream: 0,
            addr: None,
        });
        if i >= window {
            t.push(TraceOp::Free {
                id: (i - window) as u64,
            });
        }
    }
    for i in n - window..n {
        t.push(TraceOp::Free { id: i as u64 });
    }
    t
}

/// Note [Page-move budget]: a steady workload whose live set keeps changing shape below its
/// peak moved pages on most allocations for ever (0.6 unmaps per pair, ~34 µs of modeled device
/// time per pair); with the default's budget the moves stop once the layout has room, so twice
/// the work costs no more device calls, at a memory cost still below PyTorch's.
#[test]
fn a_steady_rotating_queue_stops_moving_pages() {
    let short = rotating_queue(10_000, 8);
    let long = rotating_queue(20_000, 8);
    let calls = |r: &ReplayReport| {
        ["create", "map", "unmap", "release"]
            .iter()
            .map(|c| r.device_call(c))
            .sum::<u64>()
    };
    let (s, l) = (
        run(&short, AllocatorConfig::default()),
        run(&long, AllocatorConfig::default()),
    );
    assert_eq!(
        calls(&s),
        calls(&l),
        "the default kept moving pages: {:?}",
        l.device_calls
    );
    assert!(
        l.modeled_device_ns.unwrap() < 60_000_000,
        "{:?} ns",
        l.modeled_device_ns
    );
    // The credit of one move per 128 core allocations (Note [Page-move budget]) lets the
    // queue buy later, into a tighter layout: 1.2426 × live without it.
    assert!(
        l.reserved_over_live() < 1.2,
        "the queue settled at {:.4} × live",
        l.reserved_over_live()
    );
    let pytorch = run(&long, Preset::Pytorch.config());
    assert!(
        l.reserved_over_live() < pytorch.reserved_over_live(),
        "default {:.4} against pytorch {:.4}",
        l.reserved_over_live(),
        pytorch.reserved_over_live()
    );
    // Without a budget: at the floor, paying page moves all along.
    let unbudgeted = AllocatorConfig::parse("cca_preset:default,cca_page_move_budget:0").unwrap();
    let (s0, l0) = (run(&short, unbudgeted.clone()), run(&long, unbudgeted));
    assert!(
        l0.reserved_over_live() <= 1.05,
        "{:.4}",
        l0.reserved_over_live()
    );
    assert!(
        l0.device_call("unmap") > s0.device_call("unmap") + 5_000,
        "{} then {} unmaps",
        s0.device_call("unmap"),
        l0.device_call("unmap")
    );
}

/// Page reuse's decisions (the slack over the allocated peak, the page-move budget's count) must
/// not follow the peak statistics a program resets (`torch.cuda.reset_peak_memory_stats()` in a
/// training loop that logs each step's peak): the allocator behaves the same with and without
/// the resets. Before the policy kept a peak of its own, every allocation past the reset peak
/// restarted the budget's count and the rotating queue moved pages for ever.
#[test]
fn resetting_the_peak_statistics_changes_no_page_reuse_decision() {
    let calls_of = |events: usize, reset_every: Option<usize>| {
        let queue = rotating_queue(events, 8);
        let alloc =
            CachingAllocator::new(SimDevice::default(), AllocatorConfig::default()).unwrap();
        let r = cuda_caching_allocator::replay::replay_observed(
            &alloc,
            &queue,
            &ReplayOptions::default(),
            None,
            &mut |i, _, a| {
                if reset_every.is_some_and(|k| i % k == 0) {
                    a.reset_peak_stats();
                }
            },
        )
        .unwrap();
        let k = alloc.backend().counters();
        (
            k.create_physical_calls,
            k.map_calls,
            k.unmap_calls,
            r.failed_allocs,
        )
    };
    let plain = calls_of(20_000, None);
    for every in [16, 100, 1_000] {
        assert_eq!(
            calls_of(20_000, Some(every)),
            plain,
            "(creates, maps, unmaps, failures) with the peak reset every {every} events, \
             against none"
        );
    }
    // And the queue still settles with the resets.
    assert_eq!(calls_of(10_000, Some(100)), calls_of(20_000, Some(100)));
}

#[test]
fn page_move_budget_parses_and_is_off_in_the_pytorch_presets() {
    assert_eq!(AllocatorConfig::default().page_move_budget, 8);
    let c = AllocatorConfig::parse("cca_preset:default,cca_page_move_budget:3").unwrap();
    assert_eq!(c.page_move_budget, 3);
    assert!(
        c.to_settings().contains("cca_page_move_budget:3"),
        "{}",
        c.to_settings()
    );
    for p in [Preset::Pytorch, Preset::PytorchExpandable] {
        assert_eq!(p.config().page_move_budget, 0);
    }
    let e = AllocatorConfig::parse("cca_page_move_budget:-1").unwrap_err();
    assert!(e.to_string().contains("cca_page_move_budget"), "{e}");
}

fn page_reuse_config(extra: &str) -> AllocatorConfig {
    AllocatorConfig::parse(&format!(
        "expandable_segments:True,cca_large_page_size_mb:2,cca_page_reuse:device,\
         cca_page_reuse_slack:0.01,cca_precise_cap:True,cca_max_handle_size_mb:64{extra}"
    ))
    .unwrap()
}

#[test]
fn one_handle_per_growth_halves_the_creates() {
    // Each 7 MiB request grows the segment by 4 pages (8 MiB; the first by 4, later ones by
    // what the free tail lacks).
    let t = growing(&[7, 7, 7]);
    let split = run(&t, page_reuse_config(""));
    let one = run(&t, page_reuse_config(",cca_handle_per_growth:True"));
    assert_eq!(one.peak_reserved_bytes, split.peak_reserved_bytes);
    assert_eq!(one.device_call("create"), one.device_call("map"));
    assert_eq!(one.device_call("create"), 3, "{:?}", one.device_calls);
    assert_eq!(split.device_call("create"), 6, "{:?}", split.device_calls);
    assert!(one.modeled_device_ns < split.modeled_device_ns);
}

#[test]
fn a_minimum_growth_maps_ahead_of_need() {
    // With 20 MiB growths, five 4 MiB requests grow the segment once.
    let t = growing(&[4, 4, 4, 4, 4]);
    let exact = run(&t, page_reuse_config(",cca_handle_per_growth:True"));
    let ahead = run(
        &t,
        page_reuse_config(",cca_handle_per_growth:True,cca_min_growth_mb:20"),
    );
    assert_eq!(exact.device_call("map"), 5, "{:?}", exact.device_calls);
    assert_eq!(ahead.device_call("map"), 1, "{:?}", ahead.device_calls);
    assert_eq!(ahead.peak_reserved_bytes, 20 * MIB as u64);
    // A minimum growth larger than the device falls back to what the request needs.
    let small = CachingAllocator::new(
        SimDevice::with_capacity(64 * MIB),
        page_reuse_config(",cca_min_growth_mb:1024"),
    )
    .unwrap();
    let a = small.allocate(6 * MIB, StreamId(0)).unwrap();
    assert_eq!(small.memory_stats().memory_reserved(), 6 * MIB as i64);
    small.free(a.ptr).unwrap();
}

#[test]
fn growth_knobs_parse_and_stay_off_in_the_pytorch_presets() {
    let c = AllocatorConfig::parse("cca_min_growth_mb:20,cca_handle_per_growth:True").unwrap();
    assert_eq!(c.expandable_min_growth, 20 * MIB);
    assert!(c.expandable_handle_per_growth);
    for p in [Preset::Pytorch, Preset::PytorchExpandable] {
        let c = p.config();
        assert_eq!(c.expandable_min_growth, 0);
        assert!(!c.expandable_handle_per_growth);
    }
    assert!(AllocatorConfig::parse("cca_handle_per_growth:yes").is_err());
}

#[cfg(feature = "trace-io")]
mod shipped {
    use super::*;
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};

    fn load(name: &str) -> Trace {
        let path = format!(
            "{}/examples/traces/{name}.csv.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        read_trace_file(&path, &ImportOptions::strict())
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trace
    }

    /// Per shipped trace: the default's modeled device time (ns) and synchronizations may not
    /// exceed these (the figures of benches/README.md, "Device cost", rounded up). Page reuse
    /// is fenced by events, so the default never synchronizes (it did 47, 7 and 47 times before
    /// `cca_page_reuse_fence`). With the fast path on in the default, gpt2_train's blocks held in
    /// the front cache move 0.7 % more pages (386.2 → 388.9 ms).
    const DEFAULT_BOUNDS: [(&str, u64, u64); 3] = [
        ("gpt2_train", 389_500_000, 0),
        ("resnet50_train", 73_500_000, 0),
        ("bert_varlen", 193_000_000, 0),
    ];

    /// Our recorded HF `generate` client (`gpu/traces/generate.pickle.gz`, 458,914 events; its
    /// peak is reached at event 743, in the first prefill). The default reserves at most 1.02 ×
    /// its peak live bytes (#11, goal 1): 1.0176 ×, 650,117,120 bytes (310 pages of 2 MiB) for
    /// 638,850,184 live; it was 1.0275 × before cached large-pool blocks next to free memory went
    /// back before a miss (Note [Cached blocks next to free memory]) and growths beyond the
    /// page-reuse slack took the run that maps the fewest pages (Note [Fewest-pages growth]).
    /// Without the fast path the default stays under 1.02 too, modeled device time under 21 ms
    /// (21.99 ms before), no synchronization; the `pytorch` preset, PyTorch's own policy, is
    /// untouched (796,917,760 bytes, 1.2474 ×).
    #[test]
    fn the_default_keeps_the_recorded_generate_client_within_two_percent() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/gpu/traces/generate.pickle.gz");
        let t = read_trace_file(path, &ImportOptions::strict())
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trace;
        let r = run(&t, AllocatorConfig::default());
        assert_eq!(r.peak_live_bytes, 638_850_184);
        assert!(
            r.peak_reserved_bytes <= 650_117_120,
            "generate: {} bytes reserved, {:.4} × live",
            r.peak_reserved_bytes,
            r.reserved_over_live()
        );
        assert!(r.reserved_over_live() <= 1.02);
        let ns = r.modeled_device_ns.unwrap();
        assert!(ns <= 21_000_000, "generate: modeled {ns} ns");
        assert_eq!(syncs(&r), 0, "{:?}", r.device_calls);
        let plain = run(
            &t,
            AllocatorConfig {
                fast_path: false,
                ..AllocatorConfig::default()
            },
        );
        assert!(
            plain.reserved_over_live() <= 1.02,
            "generate without the fast path: {:.4}",
            plain.reserved_over_live()
        );
        let pytorch = run(&t, AllocatorConfig::pytorch());
        assert_eq!(pytorch.peak_reserved_bytes, 796_917_760);
    }

    /// Per shipped trace, under the lean-and-fast growth (64 MiB handles, one per growth, 20 MiB
    /// growths): modeled device time over the `pytorch` preset's, and synchronizations.
    const LEAN_FAST_BOUNDS: [(&str, f64, u64); 3] = [
        ("gpt2_train", 3.05, 3),
        ("resnet50_train", 1.20, 0),
        ("bert_varlen", 1.52, 2),
    ];

    /// Our own recorded side-stream client (`gpu/traces/sidestream.pickle.gz`: PyTorch native,
    /// GPT-2 with a prefetch stream and `record_stream`, H200): replayed with late event answers,
    /// the default stays at its floor by lending (the GPU run measured 1.0099 × peak allocated),
    /// and without lending it holds back what the GPU run showed (1.0661 there).
    #[test]
    fn the_recorded_side_stream_client_stays_lean_by_lending() {
        let path = format!(
            "{}/gpu/traces/sidestream.pickle.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        let t = read_trace_file(&path, &ImportOptions::strict())
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trace;
        let with = run_lagged(&t, AllocatorConfig::default(), 4);
        assert!(
            with.reserved_over_live() <= 1.02,
            "{:.4}",
            with.reserved_over_live()
        );
        assert!(with.page_loans > 0);
        assert_eq!(syncs(&with), 0, "{:?}", with.device_calls);
        let no_lending =
            AllocatorConfig::parse("cca_preset:default,cca_page_lending:False").unwrap();
        let without = run_lagged(&t, no_lending, 4);
        assert!(
            without.reserved_over_live() > 1.05,
            "{:.4}",
            without.reserved_over_live()
        );
    }

    /// Our recorded DDP and FSDP2 clients (`gpu/traces/ddp.pickle.gz`, `fsdp.pickle.gz`: rank 0
    /// of two H200s, PyTorch native, GPT-2 8 layers, varlen, 30 steps; FSDP2's all-gather and
    /// reduce-scatter streams beside the compute stream). The default reserves what the GPU runs
    /// measured (1.0098–1.0099 × peak allocated) without a synchronization; PyTorch's policy
    /// reserves 1.3271 × and 1.4220 × peak allocated, as native did on the GPU. With late event
    /// answers too (query lags 1 and 4): before Note [Flush before a new peak], the fast path
    /// left FSDP2 at 1.0284 × there.
    #[test]
    fn the_recorded_ddp_and_fsdp_clients_stay_lean() {
        for (name, pytorch_ratio) in [("ddp", 1.3271), ("fsdp", 1.4220)] {
            let path = format!("{}/gpu/traces/{name}.pickle.gz", env!("CARGO_MANIFEST_DIR"));
            let t = read_trace_file(&path, &ImportOptions::strict())
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .trace;
            for lag in [0, 1, 4] {
                let r = run_lagged(&t, AllocatorConfig::default(), lag);
                assert!(
                    r.reserved_over_live() <= 1.02,
                    "{name}, lag {lag}: {:.4}",
                    r.reserved_over_live()
                );
                assert_eq!(syncs(&r), 0, "{name}, lag {lag}: {:?}", r.device_calls);
            }
            // Over peak allocated, as the GPU runs report it.
            let p = run(&t, AllocatorConfig::pytorch());
            let over_allocated = p.peak_reserved_bytes as f64 / p.peak_allocated_bytes as f64;
            assert!(
                (over_allocated - pytorch_ratio).abs() < 5e-4,
                "{name}: pytorch {over_allocated:.4}"
            );
        }
    }

    #[test]
    fn the_defaults_device_cost_stays_under_its_bound() {
        for (name, max_ns, max_syncs) in DEFAULT_BOUNDS {
            let r = run(&load(name), AllocatorConfig::default());
            let ns = r.modeled_device_ns.unwrap();
            assert!(ns <= max_ns, "{name}: modeled {ns} ns > {max_ns}");
            assert!(syncs(&r) <= max_syncs, "{name}: {:?}", r.device_calls);
            assert!(r.reserved_over_live() <= 1.02, "{name}");
        }
    }

    #[test]
    fn lean_fast_growth_costs_a_few_times_pytorch_and_stays_lean() {
        for (name, max_ratio, max_syncs) in LEAN_FAST_BOUNDS {
            let t = load(name);
            let base = run(&t, AllocatorConfig::pytorch());
            let r = run(
                &t,
                page_reuse_config(",cca_handle_per_growth:True,cca_min_growth_mb:20"),
            );
            let ratio =
                r.modeled_device_ns.unwrap() as f64 / base.modeled_device_ns.unwrap() as f64;
            assert!(ratio <= max_ratio, "{name}: {ratio:.3} x pytorch");
            assert!(syncs(&r) <= max_syncs, "{name}: {:?}", r.device_calls);
            assert!(
                r.reserved_over_live() <= 1.02,
                "{name}: {:.4}",
                r.reserved_over_live()
            );
        }
    }

    /// The `lean-fast` preset on the shipped traces: modeled device time over `pytorch`'s,
    /// synchronizations and reserved over live may not exceed these (the H100 cold replays put
    /// its growth at 0.72–1.05 × PyTorch's wall time; `benches/README.md`). gpt2_train reserves
    /// 1.0194 × live with the fast path as without it (1.0243 before its cached large-pool
    /// blocks next to free memory went back before a miss).
    const LEAN_FAST_PRESET_BOUNDS: [(&str, f64, u64, f64); 3] = [
        ("gpt2_train", 3.05, 0, 1.025),
        ("resnet50_train", 1.25, 0, 1.01),
        ("bert_varlen", 1.55, 0, 1.013),
    ];

    #[test]
    fn the_lean_fast_preset_stays_near_pytorchs_device_cost() {
        for (name, max_ratio, max_syncs, max_memory) in LEAN_FAST_PRESET_BOUNDS {
            let t = load(name);
            let base = run(&t, AllocatorConfig::pytorch());
            let r = run(&t, Preset::LeanFast.config());
            let ratio =
                r.modeled_device_ns.unwrap() as f64 / base.modeled_device_ns.unwrap() as f64;
            assert!(ratio <= max_ratio, "{name}: {ratio:.3} x pytorch");
            assert!(syncs(&r) <= max_syncs, "{name}: {:?}", r.device_calls);
            assert!(
                r.reserved_over_live() <= max_memory,
                "{name}: {:.4}",
                r.reserved_over_live()
            );
        }
    }
}
