#!/usr/bin/env python3
"""Cold replays side by side (#11): each shipped trace through PyTorch's own allocator (native and
native expandable, `native_replay.py`) and through `cca replay --device cuda` under several
configurations, each run in a fresh process, repeated and interleaved so that drift hits every
configuration alike. Prints a table of median wall ns per operation of the replay loop (min–max over the repeats; cca's
loop also does the replay's bookkeeping: statistics after every event, fragmentation at each new
peak), the median of the allocator calls alone (cca: time inside allocate/free; native: its loop,
which does nothing else),
peak reserved bytes over peak live, and device calls; writes every run as JSON lines.

    python3 cold_replay.py --cca gpu-bin/cca --traces gpu-bin/traces --reps 3 --jsonl OUT.jsonl
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# (label, how): "native" rows carry PYTORCH_CUDA_ALLOC_CONF, "cca" rows a preset or a config.
CONFIGS = [
    ("native", ("native", "")),
    ("native expandable", ("native", "expandable_segments:True")),
    ("cca pytorch", ("cca", ["--preset", "pytorch"])),
    ("cca default", ("cca", ["--preset", "default"])),
    ("cca 64 MiB handles, 20 MiB growth", ("cca", ["--config",
        "cca_preset:default,cca_max_handle_size_mb:64,cca_handle_per_growth:True,cca_min_growth_mb:20"])),
    ("cca 256 MiB handles, 64 MiB growth", ("cca", ["--config",
        "cca_preset:default,cca_max_handle_size_mb:256,cca_handle_per_growth:True,cca_min_growth_mb:64"])),
]


def run_one(kind, how, trace, cca):
    if kind == "native":
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if how:
            env["PYTORCH_CUDA_ALLOC_CONF"] = how
        p = subprocess.run([sys.executable, os.path.join(HERE, "native_replay.py"), trace],
                           capture_output=True, text=True, env=env, timeout=300)
        if p.returncode != 0:
            return {"error": p.stderr[-500:]}
        d = json.loads(p.stdout.strip().splitlines()[-1])
        return {"ns": d["wall_ns_per_op"], "call_ns": d["wall_ns_per_op"],
                "reserved": d["peak_reserved_bytes"],
                "allocated": d["peak_allocated_bytes"],
                "calls": f"cudaMalloc {d['num_device_alloc']}, free {d['num_device_free']}"}
    p = subprocess.run([cca, "replay", trace, "--device", "cuda", "--json", *how],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"error": p.stderr[-500:]}
    d = json.loads(p.stdout)
    # A real device counts no calls by kind; the allocator's own counters stand in.
    calls = {k: v for k, v in (d.get("device_calls") or {}).items() if v}
    text = ", ".join(f"{k} {v}" for k, v in calls.items()) or (
        f"device allocs/maps {d.get('num_device_alloc')}, frees/unmaps {d.get('num_device_free')}")
    return {"ns": d["wall_ns_per_op"], "call_ns": d.get("ns_per_op"),
            "reserved": d["peak_reserved_bytes"],
            "allocated": d["peak_allocated_bytes"], "live": d.get("peak_live_bytes"),
            "calls": text}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cca", required=True)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jsonl", default=None)
    args = ap.parse_args()
    traces = sorted(glob.glob(os.path.join(args.traces, "*.csv.gz")))
    results = {}
    log = open(args.jsonl, "w") if args.jsonl else None
    for rep in range(args.reps):
        for trace in traces:
            name = os.path.basename(trace).replace(".csv.gz", "")
            for label, (kind, how) in CONFIGS:
                r = run_one(kind, how, trace, args.cca)
                r.update(trace=name, config=label, rep=rep)
                results.setdefault((name, label), []).append(r)
                if log:
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                print(f"rep {rep} {name} {label}: {r.get('ns', r.get('error'))}", file=sys.stderr)
    print("| trace | allocator | wall ns/op, median (min–max) | × native | allocator calls only, ns/op median | × native | peak reserved GB | reserved / peak allocated | device calls (last run) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for trace in traces:
        name = os.path.basename(trace).replace(".csv.gz", "")
        base = None
        base_calls = None
        for label, _ in CONFIGS:
            rs = [r for r in results.get((name, label), []) if "ns" in r]
            if not rs:
                errs = [r.get("error", "") for r in results.get((name, label), [])]
                print(f"| {name} | {label} | failed: {errs[:1]} | | | | | | |")
                continue
            ns = [r["ns"] for r in rs]
            med = statistics.median(ns)
            calls_ns = statistics.median(r["call_ns"] for r in rs)
            if label == "native":
                base = med
                base_calls = calls_ns
            last = rs[-1]
            ratio = f"{med / base:.2f}" if base else ""
            cratio = f"{calls_ns / base_calls:.2f}" if base_calls else ""
            print(f"| {name} | {label} | {med:,.0f} ({min(ns):,.0f}–{max(ns):,.0f}) | {ratio} | "
                  f"{calls_ns:,.0f} | {cratio} | "
                  f"{last['reserved'] / 1e9:.3f} | {last['reserved'] / max(last['allocated'], 1):.4f} | {last['calls']} |")


if __name__ == "__main__":
    main()
