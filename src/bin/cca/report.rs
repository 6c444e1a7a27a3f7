//! `cca replay` and `cca compare`: text tables and JSON.

use cuda_caching_allocator::{ReplayReport, memory_summary};
use serde_json::{Map, Value, json};

use crate::load::{self, CliResult, Labelled, Run};
use crate::reference::{self, Reference};
use crate::{CompareArgs, ReplayArgs, TraceArgs};

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// The JSON object for one run (the keys `--json` promises, and more).
fn run_json(label: &Labelled, run: &Run, trace_args: &TraceArgs) -> Value {
    let r = &run.report;
    let lat = r.latency.unwrap_or_default();
    let stats: Map<String, Value> = r
        .stats_at_peak
        .to_map()
        .into_iter()
        .map(|(k, v)| (k, json!(v)))
        .collect();
    json!({
        "trace": trace_args.trace.display().to_string(),
        "configuration": label.label,
        "settings": label.config.settings,
        "device": trace_args.device.to_string(),
        "device_description": run.device,
        "device_memory": run.device_memory,
        "events": r.events,
        "allocs": r.allocs,
        "frees": r.frees,
        "peak_live_bytes": r.peak_live_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "reserved_over_live": r.reserved_over_live(),
        "fragmentation_at_peak": r.fragmentation_at_peak(),
        "segment_count_peak": r.segment_count_peak,
        "num_device_alloc": r.num_device_alloc,
        "num_device_free": r.num_device_free,
        "num_ooms": r.num_ooms,
        "num_alloc_retries": r.num_alloc_retries,
        "cross_stream_handovers": r.cross_stream_handovers,
        "device_calls": device_calls_json(r),
        "modeled_device_ns": r.modeled_device_ns,
        "ns_per_op": lat.mean_ns,
        "ns_per_op_p50": lat.p50_ns,
        "ns_per_op_p99": lat.p99_ns,
        "ns_per_op_max": lat.max_ns,
        "wall_s": run.wall.as_secs_f64(),
        "wall_ns_per_op": run.wall_ns_per_op(),
        "stats_at_peak": stats,
    })
}

/// The device calls of a simulated run by kind (`null` on a real device).
fn device_calls_json(r: &ReplayReport) -> Value {
    if r.modeled_device_ns.is_none() {
        return Value::Null;
    }
    Value::Object(
        r.device_calls
            .iter()
            .map(|&(k, v)| (k.to_string(), json!(v)))
            .collect(),
    )
}

fn reference_json(reference: &Reference) -> Value {
    json!({
        "torch": reference.torch,
        "pytorch_default_peak_reserved_bytes": reference.default_reserved,
        "pytorch_default_peak_allocated_bytes": reference.default_allocated,
        "pytorch_default_segment_count_peak": reference.default_segments,
        "pytorch_default_num_device_alloc": reference.default_device_allocs,
        "pytorch_expandable_peak_reserved_bytes": reference.expandable_reserved,
        "cudaMallocAsync_peak_reserved_bytes": reference.async_reserved,
        "pytorch_replay_ns_per_op": reference.torch_ns_per_op,
        "cudaMallocAsync_replay_ns_per_op": reference.async_ns_per_op,
    })
}

/// `cca replay`.
pub(crate) fn replay(a: &ReplayArgs) -> CliResult<()> {
    let label = load::resolve(a.preset.as_deref(), a.config.as_deref())?;
    let trace = load::load_trace(&a.trace.trace, a.trace.lenient, a.trace.max_import_bytes)?;
    let run = load::run(&trace, &label.config, &a.trace, &label.label, 0)?;
    let r = &run.report;
    let reference = reference::find(&a.trace.trace, a.trace.reference.as_deref())?;
    if a.json {
        let mut v = run_json(&label, &run, &a.trace);
        if let (Some(obj), Some(rf)) = (v.as_object_mut(), &reference) {
            obj.insert("pytorch_reference".into(), reference_json(rf));
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let (ref_res, ref_alloc, ref_name) = match &reference {
        Some(rf) => rf.for_preset(label.preset),
        None => (None, None, "PyTorch"),
    };
    let mark = |ours: u64, theirs: Option<u64>| match theirs {
        Some(t) if t == ours => format!("{:>18}  exact", thousands(t)),
        Some(t) => format!(
            "{:>18}  {:+.3}%",
            thousands(t),
            (ours as f64 / t as f64 - 1.0) * 100.0
        ),
        None => String::new(),
    };
    let lat = r.latency.unwrap_or_default();
    println!("trace          {}", a.trace.trace.display());
    println!("configuration  {}", label.label);
    println!("device         {}", run.device);
    println!();
    let header = match &reference {
        Some(rf) => format!("{ref_name} {} (reference.json)", rf.torch),
        None => String::new(),
    };
    println!("{:<26}{:>18}  {header}", "", "this run");
    println!("{:<26}{:>18}", "events", thousands(r.events as u64));
    println!("{:<26}{:>18}", "allocations", thousands(r.allocs as u64));
    println!(
        "{:<26}{:>18}  {}",
        "peak live (requested)",
        thousands(r.peak_live_bytes),
        mark(
            r.peak_live_bytes,
            reference.as_ref().and_then(|x| x.peak_live_bytes)
        )
    );
    println!(
        "{:<26}{:>18}  {}",
        "peak allocated bytes",
        thousands(r.peak_allocated_bytes),
        mark(r.peak_allocated_bytes, ref_alloc)
    );
    println!(
        "{:<26}{:>18}  {}",
        "peak reserved bytes",
        thousands(r.peak_reserved_bytes),
        mark(r.peak_reserved_bytes, ref_res)
    );
    let ref_ratio = match (ref_res, reference.as_ref().and_then(|x| x.peak_live_bytes)) {
        (Some(res), Some(live)) => format!("{:>18.4}", ratio(res, live)),
        _ => String::new(),
    };
    println!(
        "{:<26}{:>18.4}  {ref_ratio}",
        "reserved / live",
        r.reserved_over_live()
    );
    let default_only = |v: Option<u64>| {
        if label.preset == Some(cuda_caching_allocator::Preset::Pytorch) {
            mark(r.segment_count_peak, v)
        } else {
            String::new()
        }
    };
    println!(
        "{:<26}{:>18}  {}",
        "segments at peak",
        thousands(r.segment_count_peak),
        default_only(reference.as_ref().and_then(|x| x.default_segments))
    );
    println!(
        "{:<26}{:>18}",
        "device allocs",
        thousands(r.num_device_alloc)
    );
    println!("{:<26}{:>18}", "device frees", thousands(r.num_device_free));
    if let Some(ns) = r.modeled_device_ns {
        println!(
            "{:<26}{:>18}",
            "modeled device time",
            format!("{:.3} ms", ns as f64 / 1e6)
        );
        let calls: Vec<String> = r
            .device_calls
            .iter()
            .filter(|(_, c)| *c > 0)
            .map(|(k, c)| format!("{k} {}", thousands(*c)))
            .collect();
        println!("{:<26}{:>18}  {}", "device calls", "", calls.join(", "));
    }
    println!(
        "{:<26}{:>18}",
        "OOMs / retries",
        format!("{} / {}", r.num_ooms, r.num_alloc_retries)
    );
    println!(
        "{:<26}{:>18}  {}",
        "host ns per op (mean)",
        format!("{:.0}", lat.mean_ns),
        reference
            .as_ref()
            .and_then(|x| {
                x.torch_ns_per_op.map(|t| {
                    let asyncmax = x
                        .async_ns_per_op
                        .map_or(String::new(), |a| format!("; cudaMallocAsync {a}"));
                    format!(
                        "{t:>18}  (PyTorch native{asyncmax}; replayed on the {} host)",
                        x.device
                    )
                })
            })
            .unwrap_or_default()
    );
    println!(
        "{:<26}{:>18}",
        "host ns p50 / p99",
        format!("{} / {}", lat.p50_ns, lat.p99_ns)
    );
    println!("{:<26}{:>18}", "host ns max", thousands(lat.max_ns));
    println!(
        "{:<26}{:>18}",
        "wall time",
        format!("{:.3} s", run.wall.as_secs_f64())
    );
    println!(
        "{:<26}{:>18}",
        "wall ns per op",
        format!("{:.0}", run.wall_ns_per_op())
    );
    if let Some(rf) = &reference {
        if let (Some(e), Some(live)) = (rf.expandable_reserved, rf.peak_live_bytes) {
            println!(
                "{:<26}{:>18}  PyTorch expandable_segments: {} ({:.4}x live)",
                "",
                "",
                thousands(e),
                ratio(e, live)
            );
        }
        if let (Some(e), Some(live)) = (rf.async_reserved, rf.peak_live_bytes) {
            println!(
                "{:<26}{:>18}  cudaMallocAsync:             {} ({:.4}x live)",
                "",
                "",
                thousands(e),
                ratio(e, live)
            );
        }
    }
    if a.summary {
        println!(
            "\nAt peak reserved:\n{}",
            memory_summary(&r.stats_at_peak, 0, false)
        );
    }
    Ok(())
}

/// `cca compare`.
pub(crate) fn compare(a: &CompareArgs) -> CliResult<()> {
    let cols = load::columns(
        &a.presets,
        &a.configs,
        &["pytorch", "pytorch-expandable", "default"],
    )?;
    let trace = load::load_trace(&a.trace.trace, a.trace.lenient, a.trace.max_import_bytes)?;
    let mut runs = Vec::new();
    for c in &cols {
        runs.push(load::run(&trace, &c.config, &a.trace, &c.label, 0)?);
    }
    if a.json {
        let arr: Vec<Value> = cols
            .iter()
            .zip(&runs)
            .map(|(c, r)| run_json(c, r, &a.trace))
            .collect();
        println!("{}", serde_json::to_string_pretty(&arr)?);
        return Ok(());
    }
    let w = cols
        .iter()
        .map(|c| c.label.len())
        .max()
        .unwrap_or(0)
        .max(16)
        + 2;
    if let Some(run) = runs.first() {
        println!("device: {}\n", run.device);
    }
    print!(
        "{:<24}",
        a.trace
            .trace
            .file_name()
            .map(|f| f.to_string_lossy().to_string())
            .unwrap_or_default()
    );
    for c in &cols {
        print!("{:>w$}", c.label);
    }
    println!();
    type Row = (&'static str, fn(&ReplayReport) -> String);
    let rows: [Row; 13] = [
        ("peak live bytes", |r| thousands(r.peak_live_bytes)),
        ("peak allocated bytes", |r| {
            thousands(r.peak_allocated_bytes)
        }),
        ("peak reserved bytes", |r| thousands(r.peak_reserved_bytes)),
        ("reserved / live", |r| {
            format!("{:.4}", r.reserved_over_live())
        }),
        ("fragmentation at peak", |r| {
            format!("{:.2}%", r.fragmentation_at_peak() * 100.0)
        }),
        ("segments at peak", |r| thousands(r.segment_count_peak)),
        ("device allocs", |r| thousands(r.num_device_alloc)),
        ("device frees", |r| thousands(r.num_device_free)),
        ("modeled device ms", |r| {
            r.modeled_device_ns
                .map_or("-".to_string(), |ns| format!("{:.3}", ns as f64 / 1e6))
        }),
        ("synchronizations", |r| {
            thousands(r.device_call("synchronize") + r.device_call("stream_synchronize"))
        }),
        ("OOMs / retries", |r| {
            format!("{} / {}", r.num_ooms, r.num_alloc_retries)
        }),
        ("host ns per op (mean)", |r| {
            format!("{:.0}", r.latency.unwrap_or_default().mean_ns)
        }),
        ("host ns p99", |r| {
            thousands(r.latency.unwrap_or_default().p99_ns)
        }),
    ];
    for (name, f) in rows {
        print!("{name:<24}");
        for r in &runs {
            print!("{:>w$}", f(&r.report));
        }
        println!();
    }
    print!("{:<24}", "wall ns per op");
    for r in &runs {
        print!("{:>w$}", format!("{:.0}", r.wall_ns_per_op()));
    }
    println!();
    if let Some(rf) = reference::find(&a.trace.trace, a.trace.reference.as_deref())? {
        println!();
        let live = rf.peak_live_bytes.unwrap_or(0);
        for (name, v) in [
            ("PyTorch default", rf.default_reserved),
            ("PyTorch expandable", rf.expandable_reserved),
            ("cudaMallocAsync", rf.async_reserved),
        ] {
            if let Some(v) = v {
                println!(
                    "{:<24}{:>18} reserved ({:.4}x live)   [reference.json, torch {}]",
                    name,
                    thousands(v),
                    ratio(v, live),
                    rf.torch
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::thousands;

    #[test]
    fn groups_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(15286140928), "15,286,140,928");
    }
}
