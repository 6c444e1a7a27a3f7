//! "Views" of big physical handles, modelled (#11, goal 3: cold start). Not built in the
//! allocator: this example prices the idea from the device calls the crate's default makes.
//!
//! The default maps expandable segments as 2 MiB handles, one `create` + `map` (+ access) per
//! page, and page reuse moves free pages (unmap, map elsewhere). The idea: each growth creates
//! ONE handle for all the pages it creates (a *group*), and page reuse moves a page of a partly
//! used group by mapping the whole handle again (a *view*) at `va - offset of the page in its
//! group`, where only the pages the view owns are usable (the others are *ghosts*: address space
//! taken, unusable). Memory is then exactly the default's; only the device calls change.
//!
//! Every trace is replayed through `CachingAllocator::new(Recorder(SimDevice), default)` (what
//! `cca replay TRACE` does), the recorder noting each virtual-memory call and the trace event
//! that made it. From that log, under the default's exact placement:
//!
//! * a *group* is a run of consecutive `create_physical` calls of one event: one create, and one
//!   release once its last page is released;
//! * a `map` puts the page into the live view of its group at base `va - offset` (free: the
//!   whole handle is mapped there already), or makes that view (one map + one access); an
//!   `unmap` takes the page out of its view, and the view goes (one unmap) once it owns no page;
//! * a new view is *infeasible* where its window `[base, base + group bytes)` leaves the
//!   reservation holding the page, or overlaps another page's mapping when it is made or later in
//!   the same event; *overlapping* where it overlaps another live view's window (ghosts
//!   included); *hit* where a later event maps a page into its ghosts (the default's later layout
//!   puts a page where the view's ghosts lie).
//!
//! Modelled device time, with the costs of `SimCosts::default()` (Note [Device-time model]):
//! *default* (the replay's own), *views* (every view as made), *views, infeasible per page*
//! (an infeasible view priced as the default prices its pages: a map + access per page it takes
//! in, an unmap per page it gives up), *views, pessimistic* (the same for every infeasible,
//! overlapping or hit view, and a group whose first view is one of those created and released
//! page by page), beside the `pytorch` preset's replay.
//!
//! ```text
//! cargo run --release --example views_model --features trace-io
//! ```
//!
//! An optional argument, a configuration string (`"cca_preset:default,cca_min_growth_mb:20"`),
//! replays that configuration instead of the default, views modelled on its own placement.
//! Without `trace-io` only the synthetic traces are replayed.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use cuda_caching_allocator::synth::Workload;
use cuda_caching_allocator::trace::Trace;
use cuda_caching_allocator::{
    AllocatorConfig, BackendError, CachingAllocator, DeviceAddr, DeviceBackend, EventHandle,
    MemInfo, PhysicalHandle, Preset, ReplayOptions, SimCosts, SimDevice, StreamId, replay,
    replay_observed,
};

/// The synthetic traces' seed.
const SEED: u64 = 1;

/// One virtual-memory call that succeeded.
#[derive(Clone, Copy, Debug)]
enum Call {
    Reserve { base: u64, size: u64 },
    ReleaseRange { base: u64 },
    Create { handle: u64, size: u64 },
    Release { handle: u64 },
    Map { va: u64, size: u64, handle: u64 },
    Unmap { va: u64 },
}

/// A `SimDevice` that logs its successful virtual-memory calls with the event that made them.
#[derive(Debug)]
struct Recorder {
    dev: SimDevice,
    /// Index of the trace event being replayed (set by the replay's observer).
    event: AtomicUsize,
    calls: Mutex<Vec<(usize, Call)>>,
}

impl Recorder {
    fn new() -> Self {
        Recorder {
            dev: SimDevice::default(),
            event: AtomicUsize::new(0),
            calls: Mutex::new(Vec::new()),
        }
    }

    fn note<T>(
        &self,
        r: Result<T, BackendError>,
        call: impl FnOnce(&T) -> Call,
    ) -> Result<T, BackendError> {
        if let Ok(v) = &r {
            let e = self.event.load(Ordering::Relaxed);
            self.calls.lock().unwrap().push((e, call(v)));
        }
        r
    }
}

// SAFETY: every call is forwarded to the inner `SimDevice` with its arguments unchanged (the log
// only reads them), so the recorder keeps all three promises the `SimDevice` keeps.
unsafe impl DeviceBackend for Recorder {
    fn device_index(&self) -> usize {
        self.dev.device_index()
    }
    fn alignment(&self) -> usize {
        self.dev.alignment()
    }
    fn mem_info(&self) -> Result<MemInfo, BackendError> {
        self.dev.mem_info()
    }
    fn allocate(&self, size: usize, stream: StreamId) -> Result<DeviceAddr, BackendError> {
        self.dev.allocate(size, stream)
    }
    unsafe fn free(
        &self,
        ptr: DeviceAddr,
        size: usize,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        // SAFETY: the caller's obligations 1-2 are forwarded unchanged.
        unsafe { self.dev.free(ptr, size, stream) }
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        self.dev.synchronize()
    }
    fn validate_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.dev.validate_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.dev.synchronize_stream(stream)
    }
    fn stream_capture_id(&self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        self.dev.stream_capture_id(stream)
    }
    fn create_event(&self) -> Result<EventHandle, BackendError> {
        self.dev.create_event()
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> Result<(), BackendError> {
        self.dev.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> Result<bool, BackendError> {
        self.dev.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> Result<(), BackendError> {
        self.dev.synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> Result<(), BackendError> {
        self.dev.stream_wait_event(stream, event)
    }
    unsafe fn destroy_event(&self, event: EventHandle) -> Result<(), BackendError> {
        // SAFETY: obligation 1 is forwarded unchanged.
        unsafe { self.dev.destroy_event(event) }
    }
    fn vm_granularity(&self) -> Option<usize> {
        self.dev.vm_granularity()
    }
    fn reserve_address_range(&self, size: usize) -> Result<DeviceAddr, BackendError> {
        let r = self.dev.reserve_address_range(size);
        self.note(r, |base| Call::Reserve {
            base: base.0,
            size: size as u64,
        })
    }
    unsafe fn release_address_range(
        &self,
        base: DeviceAddr,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        let r = unsafe { self.dev.release_address_range(base, size) };
        self.note(r, |_| Call::ReleaseRange { base: base.0 })
    }
    fn create_physical(&self, size: usize) -> Result<PhysicalHandle, BackendError> {
        let r = self.dev.create_physical(size);
        self.note(r, |h| Call::Create {
            handle: h.0,
            size: size as u64,
        })
    }
    unsafe fn release_physical(
        &self,
        handle: PhysicalHandle,
        size: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        let r = unsafe { self.dev.release_physical(handle, size) };
        self.note(r, |_| Call::Release { handle: handle.0 })
    }
    unsafe fn map(
        &self,
        va: DeviceAddr,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        let r = unsafe { self.dev.map(va, size, handle) };
        self.note(r, |_| Call::Map {
            va: va.0,
            size: size as u64,
            handle: handle.0,
        })
    }
    unsafe fn unmap(&self, va: DeviceAddr, size: usize) -> Result<(), BackendError> {
        // SAFETY: obligations 1-2 are forwarded unchanged.
        let r = unsafe { self.dev.unmap(va, size) };
        self.note(r, |_| Call::Unmap { va: va.0 })
    }
}

/// A physical page of the default (one handle) and where it sits in its group.
#[derive(Clone, Copy, Debug)]
struct Page {
    group: usize,
    offset: u64,
}

/// The pages one growth created: one big handle in the views world.
#[derive(Debug, Default)]
struct Group {
    bytes: u64,
    pages: u64,
    live_pages: u64,
    /// The first view made of the group (its mapping at creation).
    first_view: Option<usize>,
}

/// One mapping of a whole group's handle.
#[derive(Debug)]
struct View {
    group: usize,
    base: u64,
    event: usize,
    /// Pages owned now.
    members: u64,
    /// Maps of pages into it, and unmaps of pages out of it (the default's calls).
    joins: u64,
    leaves: u64,
    dropped: bool,
    /// The first view of its group (the mapping of the growth that created it).
    first: bool,
    /// Its window leaves the reservation that holds the page.
    outside: bool,
    /// Its window overlaps another page's mapping when it is made.
    occupied: bool,
    /// A later map of the same event falls into its window.
    crowded: bool,
    /// Its window overlaps another live view's window when it is made.
    overlapping: bool,
    /// A map of a later event falls into its window (ghosts).
    hit: bool,
}

impl View {
    /// Cannot be placed where the default's layout needs it, its ghosts aside.
    fn infeasible(&self) -> bool {
        self.outside || self.occupied || self.crowded
    }

    /// Infeasible, or in conflict with another view's or a later mapping's address space.
    fn bad(&self) -> bool {
        self.infeasible() || self.overlapping || self.hit
    }
}

/// What the model found on one trace.
#[derive(Debug, Default)]
struct Model {
    creates: u64,
    maps: u64,
    unmaps: u64,
    releases: u64,
    groups: u64,
    group_releases: u64,
    views: Vec<View>,
    groups_v: Vec<Group>,
    /// Later maps into a live view's ghosts.
    ghost_maps: u64,
}

fn model(calls: &[(usize, Call)]) -> Model {
    let mut m = Model::default();
    let mut pages: HashMap<u64, Page> = HashMap::new();
    let mut reservations: BTreeMap<u64, u64> = BTreeMap::new();
    // The default's mappings: va → (end, handle, view).
    let mut mappings: BTreeMap<u64, (u64, u64, usize)> = BTreeMap::new();
    // Live views by (base, id) → end, and by (group, base) → id.
    let mut live: BTreeMap<(u64, usize), u64> = BTreeMap::new();
    let mut live_of: HashMap<(usize, u64), usize> = HashMap::new();
    let mut widest = 0u64;
    let mut open: Option<(usize, usize)> = None; // (event, group) of a run of creates
    for &(event, call) in calls {
        if !matches!(call, Call::Create { .. }) {
            open = None;
        }
        match call {
            Call::Reserve { base, size } => {
                reservations.insert(base, size);
            }
            Call::ReleaseRange { base } => {
                reservations.remove(&base);
            }
            Call::Create { handle, size } => {
                m.creates += 1;
                let g = match open {
                    Some((e, g)) if e == event => g,
                    _ => {
                        m.groups += 1;
                        m.groups_v.push(Group::default());
                        m.groups_v.len() - 1
                    }
                };
                open = Some((event, g));
                let grp = &mut m.groups_v[g];
                pages.insert(
                    handle,
                    Page {
                        group: g,
                        offset: grp.bytes,
                    },
                );
                grp.bytes += size;
                grp.pages += 1;
                grp.live_pages += 1;
                widest = widest.max(grp.bytes);
            }
            Call::Release { handle } => {
                m.releases += 1;
                let p = pages.remove(&handle).unwrap();
                let grp = &mut m.groups_v[p.group];
                grp.live_pages -= 1;
                if grp.live_pages == 0 {
                    m.group_releases += 1;
                }
            }
            Call::Map { va, size, handle } => {
                m.maps += 1;
                let p = pages[&handle];
                let base = va - p.offset;
                let vid = if let Some(&v) = live_of.get(&(p.group, base)) {
                    v
                } else {
                    let end = base + m.groups_v[p.group].bytes;
                    let inside = reservations
                        .range(..=va)
                        .next_back()
                        .is_some_and(|(&r, &len)| r <= base && end <= r + len);
                    let occupied = mappings
                        .range(..end)
                        .next_back()
                        .is_some_and(|(_, &(e, _, _))| e > base)
                        || mappings.range(base..end).next().is_some();
                    let overlapping = live
                        .range((base.saturating_sub(widest), 0)..(end, 0))
                        .any(|(_, &e)| e > base);
                    let id = m.views.len();
                    m.views.push(View {
                        group: p.group,
                        base,
                        event,
                        members: 0,
                        joins: 0,
                        leaves: 0,
                        dropped: false,
                        first: m.groups_v[p.group].first_view.is_none(),
                        outside: !inside,
                        occupied,
                        crowded: false,
                        overlapping,
                        hit: false,
                    });
                    live.insert((base, id), end);
                    live_of.insert((p.group, base), id);
                    m.groups_v[p.group].first_view.get_or_insert(id);
                    id
                };
                // Other live views whose window this mapping falls into.
                let end = va + size;
                let others: Vec<usize> = live
                    .range((va.saturating_sub(widest), 0)..(end, 0))
                    .filter(|&(&(_, id), &e)| e > va && id != vid)
                    .map(|(&(_, id), _)| id)
                    .collect();
                if !others.is_empty() {
                    let mut later = false;
                    for id in others {
                        let v = &mut m.views[id];
                        if v.event == event {
                            v.crowded = true;
                        } else {
                            v.hit = true;
                            later = true;
                        }
                    }
                    m.ghost_maps += u64::from(later);
                }
                let v = &mut m.views[vid];
                v.members += 1;
                v.joins += 1;
                mappings.insert(va, (end, handle, vid));
            }
            Call::Unmap { va } => {
                m.unmaps += 1;
                let (_, _, vid) = mappings.remove(&va).unwrap();
                let v = &mut m.views[vid];
                v.members -= 1;
                v.leaves += 1;
                if v.members == 0 {
                    v.dropped = true;
                    live.remove(&(v.base, vid));
                    live_of.remove(&(v.group, v.base));
                }
            }
        }
    }
    m
}

/// Modelled device nanoseconds of the virtual-memory calls.
#[derive(Debug)]
struct Priced {
    default: u64,
    views: u64,
    infeasible_per_page: u64,
    pessimistic: u64,
}

fn price(m: &Model, c: &SimCosts) -> Priced {
    let map = c.map_ns + c.set_access_ns;
    let default =
        m.creates * c.create_ns + m.maps * map + m.unmaps * c.unmap_ns + m.releases * c.release_ns;
    let per_view = |v: &View, per_page: bool| {
        if per_page {
            v.joins * map + v.leaves * c.unmap_ns
        } else {
            map + u64::from(v.dropped) * c.unmap_ns
        }
    };
    let groups = m.groups * c.create_ns + m.group_releases * c.release_ns;
    let views: u64 = m.views.iter().map(|v| per_view(v, false)).sum();
    let infeasible_per_page: u64 = m.views.iter().map(|v| per_view(v, v.infeasible())).sum();
    let mut pessimistic: u64 = m.views.iter().map(|v| per_view(v, v.bad())).sum();
    for g in &m.groups_v {
        let released = u64::from(g.live_pages == 0);
        pessimistic += if g.first_view.is_some_and(|id| m.views[id].bad()) {
            g.pages * c.create_ns + (g.pages - g.live_pages) * c.release_ns
        } else {
            c.create_ns + released * c.release_ns
        };
    }
    Priced {
        default,
        views: groups + views,
        infeasible_per_page: groups + infeasible_per_page,
        pessimistic,
    }
}

#[cfg(feature = "trace-io")]
fn real_traces() -> Vec<(String, Trace)> {
    use cuda_caching_allocator::trace::{ImportOptions, read_trace_file};
    let root = env!("CARGO_MANIFEST_DIR");
    let shipped = ["gpt2_train", "resnet50_train", "bert_varlen"]
        .map(|n| (n.to_string(), format!("{root}/examples/traces/{n}.csv.gz")));
    let ours = ["generate", "ckpt", "sidestream", "ddp", "fsdp"]
        .map(|n| (n.to_string(), format!("{root}/gpu/traces/{n}.pickle.gz")));
    shipped
        .into_iter()
        .chain(ours)
        .map(|(name, path)| {
            let trace = read_trace_file(&path, &ImportOptions::strict())
                .unwrap_or_else(|e| panic!("{path}: {e}"))
                .trace;
            (name, trace)
        })
        .collect()
}

#[cfg(not(feature = "trace-io"))]
fn real_traces() -> Vec<(String, Trace)> {
    eprintln!("(built without `trace-io`: the real traces are left out)");
    Vec::new()
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// One trace's figures.
struct Row {
    name: String,
    reserved_over_live: f64,
    pytorch_ns: u64,
    default_ns: u64,
    /// Everything the default paid outside create, map, unmap and release.
    rest_ns: u64,
    priced: Priced,
    model: Model,
}

/// Replays `trace` under `config` through the recorder and models its views.
fn measure(name: &str, trace: &Trace, config: &AllocatorConfig, costs: &SimCosts) -> Row {
    let pt = {
        let alloc = CachingAllocator::new(SimDevice::default(), Preset::Pytorch.config()).unwrap();
        replay(&alloc, trace, &ReplayOptions::default()).unwrap()
    };
    let alloc = CachingAllocator::new(Recorder::new(), config.clone()).unwrap();
    let rec = alloc.backend();
    let hint = |a: Option<u64>| match a {
        Some(addr) => rec.dev.place_next_at(addr),
        None => rec.dev.clear_placement_hint(),
    };
    let before = rec.dev.counters();
    let mut report = replay_observed(
        &alloc,
        trace,
        &ReplayOptions::default(),
        Some(&hint),
        &mut |i, _, _| rec.event.store(i + 1, Ordering::Relaxed),
    )
    .unwrap();
    report.add_device_cost(&before, &rec.dev.counters());
    let calls = std::mem::take(&mut *rec.calls.lock().unwrap());
    let model = model(&calls);
    let priced = price(&model, costs);
    let default_ns = report.modeled_device_ns.unwrap_or(0);
    // The log holds every virtual-memory call the device counted.
    let counted = report.device_call("create") * costs.create_ns
        + report.device_call("map") * (costs.map_ns + costs.set_access_ns)
        + report.device_call("unmap") * costs.unmap_ns
        + report.device_call("release") * costs.release_ns;
    assert_eq!(counted, priced.default, "{name}: the log misses calls");
    eprintln!(
        "{name}: {} events, peak reserved {} B, modeled device {} ns (default), {} ns (pytorch), {} page loans",
        report.events,
        report.peak_reserved_bytes,
        default_ns,
        pt.modeled_device_ns.unwrap_or(0),
        report.page_loans,
    );
    Row {
        name: name.to_string(),
        reserved_over_live: report.reserved_over_live(),
        pytorch_ns: pt.modeled_device_ns.unwrap_or(1).max(1),
        default_ns,
        rest_ns: default_ns - priced.default,
        priced,
        model,
    }
}

fn main() {
    // An optional configuration string replaces the default (e.g.
    // "cca_preset:default,cca_min_growth_mb:20").
    let config = match std::env::args().nth(1) {
        Some(s) => AllocatorConfig::parse(&s).unwrap(),
        None => AllocatorConfig::default(),
    };
    let mut traces = real_traces();
    for w in Workload::ALL {
        traces.push((format!("{} (seed {SEED})", w.name()), w.trace(SEED)));
    }
    let costs = SimCosts::default();
    let rows: Vec<Row> = traces
        .iter()
        .map(|(name, trace)| measure(name, trace, &config, &costs))
        .collect();
    println!(
        "| trace | reserved / live | `pytorch` ms | default ms | views ms | views, infeasible per page | views, pessimistic | × `pytorch`: default, views, infeasible per page, pessimistic |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let x = |ns: u64| ns as f64 / r.pytorch_ns as f64;
        let (v, i, p) = (
            r.rest_ns + r.priced.views,
            r.rest_ns + r.priced.infeasible_per_page,
            r.rest_ns + r.priced.pessimistic,
        );
        println!(
            "| {} | {:.4} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}, {:.2}, {:.2}, {:.2} |",
            r.name,
            r.reserved_over_live,
            ms(r.pytorch_ns),
            ms(r.default_ns),
            ms(v),
            ms(i),
            ms(p),
            x(r.default_ns),
            x(v),
            x(i),
            x(p),
        );
    }
    println!(
        "\n| trace | default: creates, maps, unmaps, releases | groups (pages each, mean) | views: first, further | dropped | further views: infeasible (outside, occupied, crowded) | overlapping | hit later | first views: infeasible, overlapping, hit later | later maps into ghosts |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let m = &r.model;
        let count = |first: bool, f: fn(&View) -> bool| {
            m.views.iter().filter(|v| v.first == first && f(v)).count()
        };
        let first = count(true, |_| true);
        let further = count(false, |_| true);
        println!(
            "| {} | {}, {}, {}, {} | {} ({:.1}) | {first}, {further} | {} | {} ({}, {}, {}) | {} | {} | {}, {}, {} | {} |",
            r.name,
            m.creates,
            m.maps,
            m.unmaps,
            m.releases,
            m.groups,
            m.creates as f64 / m.groups.max(1) as f64,
            m.views.iter().filter(|v| v.dropped).count(),
            count(false, View::infeasible),
            count(false, |v| v.outside),
            count(false, |v| v.occupied),
            count(false, |v| v.crowded),
            count(false, |v| v.overlapping),
            count(false, |v| v.hit),
            count(true, View::infeasible),
            count(true, |v| v.overlapping),
            count(true, |v| v.hit),
            m.ghost_maps,
        );
    }
}
