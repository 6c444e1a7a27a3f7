#!/usr/bin/env python3
"""The real-client suite of #11: PyTorch workloads run, each allocator in its own process, side by
side in one call — PyTorch native, native with expandable segments, and this crate's allocator
(installed by `cuda_caching_allocator.torch.enable`) under its `pytorch` preset and its default.

Workloads (random-weight GPT-2 models from transformers configs; no network):
  sidestream  training whose next batch is copied on a side stream and handed over with
              `record_stream`, variable sequence length
  generate    `generate()` with varying batch size and prompt length (greedy)
  ckpt        activation-checkpointed training with a sequence length drawn anew each step
  ddp         DistributedDataParallel over NCCL on every visible GPU (2 or more), varlen
  fsdp        FSDP2 (`fully_shard`) over NCCL on every visible GPU, varlen

Per run: median step time after warm-up, peak reserved and allocated bytes, device allocations,
device calls after warm-up (allocations, frees and all-stream synchronizations the steady state
made), losses (checked against native's within bf16 tolerance). With `--reps N` every allocator
runs N times, interleaved in rotated order, and the ratio to native is taken within each repeat
and reported as the median with its range. Prints one table per workload and writes every run as
JSON.

    python3 clients.py --python-dir gpu-bin/python --library gpu-bin/libcca_torch.so \
        --workloads sidestream generate ckpt [--reps 3] [--json out.json]

With `--ab`, each workload instead runs in one process holding two allocators, PyTorch's native
one and the crate's (one configuration, `--allocators`, default cca-default), behind
`gpu/ab_shim.cpp`: every step's input runs three times in a row, a priming run (the first run
of a new shape costs 4–6 × a repeat: kernel selection, heuristics) and then once under each
allocator, in ABBA order; the table gives the crate's time over native's for the same input a
step apart (median and quartiles over the steps after warm-up, pooled over `--reps` processes),
and the priming runs' medians by allocator (unpaired). Drift of the host between processes,
which moved separate-process ratios by ±20 %, cancels; memory figures still come from the
separate-process runs (each allocator here keeps its own cache in the same device).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALLOCATORS = [
    # (label, environment, cca config or None for native)
    ("native", {}, None),
    ("cca-default", {}, "cca_preset:default"),
    ("native-expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    ("cca-pytorch", {}, "cca_preset:pytorch"),
]
# Run only when named with --allocators: the default with PyTorch's expandable page size for the
# large pool (20 MiB pages instead of 2 MiB), and the lean-fast preset (2 MiB pages in 64 MiB
# handles), to tell the page and handle size's part in step time.
EXTRA_ALLOCATORS = [
    ("cca-default-20m", {}, "cca_preset:default,cca_large_page_size_mb:20"),
    ("cca-lean-fast", {}, "cca_preset:lean-fast"),
    ("cca-no-lending", {}, "cca_preset:default,cca_page_lending:False"),
    ("cca-no-fast", {}, "cca_preset:default,cca_fast_path:False"),
    ("cca-borrow", {}, "cca_preset:default,cca_borrow_blocks:True"),
    # The default with the page-move budget at its smallest (1 × the reserved pages instead of
    # 8 ×): how a long run looks once the budget is spent and the layout settles.
    ("cca-budget1", {}, "cca_preset:default,cca_page_move_budget:1"),
    # The default with 1.5 % page-reuse slack instead of 1 %: growths create pages instead of
    # moving them while reserved bytes stay within 1.015 x the peak (FSDP2's growth steps).
    ("cca-slack15", {}, "cca_preset:default,cca_page_reuse_slack:0.015"),
    # The default with every unmap of a moved page on the allocating thread, as before the
    # unmap helper (cca_unmap_helper): what taking them off that thread saves a growth step.
    ("cca-no-helper", {}, "cca_preset:default,cca_unmap_helper:False"),
]


# The allocator's own host time (cuda_caching_allocator.torch.host_time, on with --host-timing
# for the crate's runs), or None.
HOST_TIME = lambda: None  # noqa: E731

# Device-call kinds whose host time the crate reports (the `device_ns.KIND` keys of
# cuda_caching_allocator.torch.stat); the tables name the largest three.
CALL_KINDS = ("map", "set_access", "unmap", "create", "event_query", "event_record",
              "stream_wait_event", "stream_synchronize", "synchronize", "release")

# The crate's device calls so far, by kind (a dict), or None on runs without the crate.
DEVICE_COUNTS = lambda device=0: None  # noqa: E731

# The crate's host nanoseconds inside device calls so far, by kind (a dict, "all" included), or
# None on runs without the crate.
DEVICE_NS = lambda: None  # noqa: E731


# The A/B extension (gpu/ab_shim.cpp) in --ab runs, or None.
AB = None
HERE = os.path.dirname(os.path.abspath(__file__))


def setup_ab(args):
    """Installs the A/B allocator: PyTorch's native allocator and the crate's shim object under
    `args.ab_config`, switched by `AB.set_mode` (0 native, 1 the crate)."""
    import torch
    from torch.utils import cpp_extension

    sys.path.insert(0, args.python_dir)
    from cuda_caching_allocator import torch as cca

    path = cca._find_library(args.library)
    cfg = cca._apply_config(args.ab_config)
    lib = cca._load_library(path)
    cca._check_config(lib)
    shim = cca.build_shim()
    build = os.path.join(os.environ.get("CCA_SHIM_BUILD_DIR", "/tmp/cca-shim-build"), "ab")
    os.makedirs(build, exist_ok=True)
    mod = cpp_extension.load(name="ab_shim", sources=[os.path.join(HERE, "ab_shim.cpp")],
                             build_directory=build, with_cuda=True, extra_cflags=["-O2"])
    mod.install(shim.create(path, cfg))
    global AB, HOST_TIME
    AB = mod

    def host_time():
        on, alloc_ns, alloc_calls, free_ns, free_calls = shim.host_time()
        return ({"alloc_ns": alloc_ns, "alloc_calls": alloc_calls, "free_ns": free_ns,
                 "free_calls": free_calls} if on else None)

    HOST_TIME = host_time

    def device_ns():
        return {k: lib.cca_memory_stat(0, f"device_ns.{k}".encode()) for k in CALL_KINDS + ("all",)}

    def device_counts(device=0):
        return {k: lib.cca_memory_stat(device, f"device_calls.{k}".encode()) for k in CALL_KINDS}

    global DEVICE_NS, DEVICE_COUNTS
    DEVICE_NS = device_ns
    DEVICE_COUNTS = device_counts

    def stat(key, device=0):
        return mod.stats(1, device).get(key, 0)

    torch.backends.cuda.matmul.allow_tf32 = False
    return torch, stat, "ab"


def setup(args):
    """Installs the allocator (cca runs) before CUDA is touched; returns a stat reader."""
    import torch

    if args.ab_config is not None:
        return setup_ab(args)
    if args.cca_config is not None:
        sys.path.insert(0, args.python_dir)
        from cuda_caching_allocator import torch as cca

        cca.enable(config=args.cca_config, library=args.library)

        def stat(key, device=0):
            return cca.stat(key, device)

        route = cca.route()
        global HOST_TIME, DEVICE_NS
        HOST_TIME = cca.host_time

        def device_ns():
            return {k: cca.stat(f"device_ns.{k}") for k in CALL_KINDS + ("all",)}

        DEVICE_NS = device_ns
    else:

        def stat(key, device=0):
            return torch.cuda.memory_stats(device).get(key, 0)

        route = "native"
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch, stat, route


def gpt2(torch, layers, embd, heads, seq, seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, n_positions=seq, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def upload(torch, res, model):
    """`model.cuda()`, its wall time in `res["upload_ms"]` (the weights' first device memory: part
    of a cold start)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = model.cuda()
    torch.cuda.synchronize()
    res["upload_ms"] = 1000 * (time.perf_counter() - t0)
    return model


DEVICE_COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams")


def warmup_probe(args, stat, device=0):
    """Returns (callback, counters): the callback copies the device counters into `counters`
    before step `args.warmup`, so that the steady state's device calls are the difference."""
    counters = {}

    def at(i):
        if i == args.warmup:
            counters.update({k: stat(k, device) for k in DEVICE_COUNTERS})
            counters["_host"] = HOST_TIME()
            counters["_device"] = DEVICE_NS()

    return at, counters


def steady_calls(stat, counters, device=0):
    """Device allocations + frees + all-stream synchronizations after warm-up."""
    if not counters:
        return None
    return sum(stat(k, device) - counters[k] for k in DEVICE_COUNTERS)


def steady_host(counters, steps):
    """The allocator's host time per step after warm-up (µs, allocate + free, every thread of
    this process) and its allocations per step, when host timing is on; else {}."""
    before, after = counters.get("_host"), HOST_TIME()
    if not before or not after or steps <= 0:
        return {}
    ns = (after["alloc_ns"] + after["free_ns"]) - (before["alloc_ns"] + before["free_ns"])
    res = {"host_us_per_step": ns / 1000 / steps,
           "allocs_per_step": (after["alloc_calls"] - before["alloc_calls"]) / steps}
    res.update(steady_device(counters.get("_device"), DEVICE_NS(), steps))
    return res


def steady_device(before, after, steps):
    """The part of the allocator's host time per step spent inside device calls (µs; the crate's
    `device_ns.KIND` figures), in all and by kind, between two readings of DEVICE_NS; {} when
    either reading is missing or a figure is unknown (a library without them)."""
    if not before or not after or steps <= 0:
        return {}
    if any(v is None or v < 0 for v in list(before.values()) + list(after.values())):
        return {}
    per = {k: (after[k] - before[k]) / 1000 / steps for k in after if k in before}
    return {"device_us_per_step": per.pop("all", 0.0), "device_us_by_kind": per}


def host_cell(rows):
    """The table cell of the allocator's host time: µs per step (allocations per step), and,
    when measured, the µs per step inside device calls with the three largest kinds."""
    rows = [r for r in rows if "host_us_per_step" in r]
    if not rows:
        return ""
    cell = (f"{statistics.median(r['host_us_per_step'] for r in rows):.0f} "
            f"({statistics.median(r['allocs_per_step'] for r in rows):.0f})")
    dev = [r for r in rows if "device_us_per_step" in r]
    if dev:
        kinds = {k: statistics.median(r["device_us_by_kind"].get(k, 0.0) for r in dev)
                 for k in CALL_KINDS}
        top = sorted(((v, k) for k, v in kinds.items() if v >= 1), reverse=True)[:3]
        cell += (f"; device calls {statistics.median(r['device_us_per_step'] for r in dev):.0f}"
                 + "".join(f", {k} {v:.0f}" for v, k in top))
    return cell


def order_free(ratios, first):
    """The order-free ratio of paired times: the geometric mean of the median with the crate
    first and the median with the crate second (the overall median stands in for an empty
    side)."""
    med = statistics.median(ratios)
    a = statistics.median([r for r, f in zip(ratios, first) if f] or [med])
    b = statistics.median([r for r, f in zip(ratios, first) if not f] or [med])
    return (a * b) ** 0.5


def growth_cell(rows):
    """--ab: the table cell splitting the pairs by whether the crate's execution made a page
    call (map, unmap or create) on any rank: order-free ratio (pairs) of the pairs without, then
    of those with; "" when the runs carry no per-execution device calls."""
    quiet, grown = ([], []), ([], [])
    for r in rows:
        ranks = [r.get("crate_calls_own")] + [o.get("crate_calls_own") for o in r.get("other_ranks", [])]
        if not all(ranks):
            return ""
        for i, (c, n, f) in enumerate(zip(r["crate_ms"], r["native_ms"], r["crate_first"])):
            calls = sum(k.get(kind, [0] * (i + 1))[i] for k in ranks
                        for kind in ("map", "unmap", "create"))
            side = grown if calls else quiet
            side[0].append(c / n)
            side[1].append(f)
    cells = [f"{order_free(*side):.3f} ({len(side[0])})" if side[0] else "– (0)"
             for side in (quiet, grown)]
    return " / ".join(cells)


def alloc_cell(rows):
    """--ab: the table cell of the allocation time per execution, native / crate, medians over
    the inputs after warm-up (the allocations per execution), the median of the per-input
    difference (crate minus native) and, when timed, the crate's free time per execution of its
    own; "" when the A/B shim did not time."""
    rows = [r for r in rows if r.get("native_alloc_us") and r.get("crate_alloc_us")]
    if not rows:
        return ""
    nat = [x for r in rows for x in r["native_alloc_us"]]
    mine = [x for r in rows for x in r["crate_alloc_us"]]
    calls = [x for r in rows for x in r["native_allocs"] + r["crate_allocs"]]
    diff = statistics.median(c - n for c, n in zip(mine, nat))
    cell = (f"{statistics.median(nat):.0f} / {statistics.median(mine):.0f} "
            f"({statistics.median(calls):.0f}); {diff:+.0f}")
    frees = [x for r in rows for x in r.get("crate_free_us_own", [])]
    if frees:
        cell += f"; crate frees {statistics.median(frees):.0f}"
    return cell


# --ab: executions per input: a priming run, then one under each allocator.
AB_RUNS = 3


def ab_mode(i):
    """--ab: the allocator of execution `i` (0 native, 1 the crate). Input j runs as executions
    3j, 3j + 1 and 3j + 2: first a priming run (native for even j, the crate for odd j), which
    pays what a process pays once per new shape (measured on an H200: 150–250 ms against
    25–55 ms for a repeat of a ckpt or side-stream step), then a repeat under each allocator,
    native first for even j and the crate first for odd j (ABBA), so that a drift of the host
    within an input falls on each allocator alike."""
    j, pos = divmod(i, AB_RUNS)
    return j % 2 if pos == 0 else (j + pos - 1) % 2


def ab_probe(args, device=0):
    """--ab: (callback, counters); the callback sets the allocator of each execution and reads
    both sides' device counters at the end of warm-up (input `warmup`'s priming run)."""
    counters = {"_alloc_reads": []}

    def at(i):
        # Both sides' timed allocations so far (CCA_HOST_TIMING): one reading between every two
        # executions, so each execution's allocation time is known by its allocator.
        counters["_alloc_reads"].append(AB.host_alloc())
        counters.setdefault("_crate_reads", []).append(HOST_TIME())
        counters.setdefault("_call_reads", []).append(DEVICE_COUNTS(device))
        AB.set_mode(ab_mode(i))
        if i == AB_RUNS * args.warmup:
            for side in (0, 1):
                st = AB.stats(side, device)
                counters[side] = {k: st[k] for k in DEVICE_COUNTERS}
            counters["_host"] = HOST_TIME()
            counters["_device"] = DEVICE_NS()

    return at, counters


def ab_result(args, times, counters, device=0):
    """--ab: per input after warm-up, native's and the crate's time for the same input (the two
    repeats after its priming run), their order, the priming runs' times by allocator, and each
    side's peaks and device calls after warm-up."""
    native, crate, crate_first, prime = [], [], [], {0: [], 1: []}
    for j in range(args.warmup, len(times) // AB_RUNS):
        p, a, b = (times[AB_RUNS * j + k] for k in range(3))
        prime[ab_mode(AB_RUNS * j)].append(1000 * p)
        n, c = (a, b) if ab_mode(AB_RUNS * j + 1) == 0 else (b, a)
        native.append(1000 * n)
        crate.append(1000 * c)
        crate_first.append(ab_mode(AB_RUNS * j + 1) == 1)
    res = {"native_ms": native, "crate_ms": crate, "crate_first": crate_first,
           "native_prime_ms": prime[0], "crate_prime_ms": prime[1]}
    for side, name in ((0, "native"), (1, "crate")):
        st = AB.stats(side, device)
        res[f"{name}_peak_reserved_bytes"] = st["reserved_bytes.all.peak"]
        res[f"{name}_peak_allocated_bytes"] = st["allocated_bytes.all.peak"]
        res[f"{name}_steady_device_calls"] = (
            sum(st[k] - counters[side][k] for k in DEVICE_COUNTERS) if side in counters else None)
    # The crate's host time covers its priming runs too: about 1.5 of its executions per input.
    res.update(steady_host(counters, 1.5 * (args.steps - args.warmup)))
    res.update(ab_alloc_time(args, counters.get("_alloc_reads", [])))
    res.update(ab_crate_free_time(args, counters.get("_crate_reads", [])))
    res.update(ab_crate_calls(args, counters.get("_call_reads", []), device))
    return res


def ab_crate_calls(args, reads, device=0):
    """--ab: per input after warm-up, the crate's device calls by kind (`device_calls.KIND` of
    `device`) made during the execution under the crate ({kind: [count per input]}); {} without
    the figures."""
    reads = reads + [DEVICE_COUNTS(device)]
    if not reads or any(r is None for r in reads):
        return {}
    out = {}
    for side, a, b in measured_executions(args, reads):
        if side == 1:
            for kind in a:
                out.setdefault(kind, []).append(b[kind] - a[kind])
    return {"crate_calls_own": out}


def ab_crate_free_time(args, reads):
    """--ab with host timing: per input after warm-up, the crate's free time (µs; its shim's
    own timing, `host_time`) during the execution under the crate and during the one under
    native (frees of the crate's blocks made before, e.g. by its priming run); {} when timing
    is off. Native's frees go to its own deleter and are not timed."""
    reads = reads + [HOST_TIME()]
    if not reads or any(r is None for r in reads):
        return {}
    out = {"crate_free_us_own": [], "crate_free_us_in_native": []}
    for side, a, b in measured_executions(args, reads):
        us = (b["free_ns"] - a["free_ns"]) / 1000
        out["crate_free_us_own" if side == 1 else "crate_free_us_in_native"].append(us)
    return out


def ab_alloc_time(args, reads):
    """--ab with host timing: per input after warm-up, the allocation time (µs) and allocation
    count of the execution under native and of the one under the crate, timed alike by the A/B
    shim around each side's `allocate` (`ab_shim.cpp`); {} when timing is off."""
    reads = reads + [AB.host_alloc()]
    if not reads or not reads[0][0]:
        return {}
    out = {"native_alloc_us": [], "crate_alloc_us": [], "native_allocs": [], "crate_allocs": []}
    for side, a, b in measured_executions(args, reads):
        ns, calls = (b[1] - a[1], b[2] - a[2]) if side == 0 else (b[3] - a[3], b[4] - a[4])
        name = "native" if side == 0 else "crate"
        out[f"{name}_alloc_us"].append(ns / 1000)
        out[f"{name}_allocs"].append(calls)
    return out


def measured_executions(args, reads):
    """--ab: for each input after warm-up, its two measured executions (the repeats after its
    priming run), in order, as (allocator, reading before, reading after); `reads` holds one
    reading taken before each execution and a final one."""
    for j in range(args.warmup, (len(reads) - 1) // AB_RUNS):
        for k in (AB_RUNS * j + 1, AB_RUNS * j + 2):
            yield ab_mode(k), reads[k], reads[k + 1]


def lengths(seed, n, lo, hi):
    import random

    r = random.Random(seed)
    return [r.randrange(lo, hi + 1, 8) for _ in range(n)]


def train_loop(torch, model, opt, steps, batch, seqs, side_stream, rank=0, at_warmup=None):
    """Training steps with bf16 autocast; the next batch optionally prefetched on a side stream.
    `at_warmup(i)` is called before each step (it reads the device counters at the end of
    warm-up)."""
    gen = torch.Generator().manual_seed(7 + rank)
    host = [torch.randint(0, 512, (batch, s), generator=gen).pin_memory() for s in seqs[:steps]]
    side = torch.cuda.Stream() if side_stream else None
    main = torch.cuda.current_stream()
    losses, times = [], []

    def fetch(i):
        if side is None:
            return host[i].cuda(non_blocking=True)
        with torch.cuda.stream(side):
            x = host[i].cuda(non_blocking=True)
        return x

    nxt = fetch(0)
    for i in range(steps):
        torch.cuda.synchronize()
        if at_warmup is not None:
            at_warmup(i)
        t0 = time.perf_counter()
        if side is not None:
            main.wait_stream(side)
            nxt.record_stream(main)
        tokens = nxt
        if i + 1 < steps:
            nxt = fetch(i + 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out, tokens
    return losses, times


def run_one(args):
    torch, stat, route = setup(args)
    if args.record:
        # PyTorch's own history of every allocation and free (no stack context: the replay needs
        # sizes, streams and order only), dumped as a snapshot pickle at the end.
        torch.cuda.memory._record_memory_history(context=None, max_entries=20_000_000)
    res = {"workload": args.workload, "route": route}
    w = args.workload
    # --ab: every input three times, a priming run and once under each allocator (ab_mode).
    execs = AB_RUNS * args.steps if AB else args.steps
    runs_of = (lambda xs: [x for x in xs for _ in range(AB_RUNS)]) if AB else (lambda xs: xs)
    if w in ("sidestream", "ckpt"):
        model = upload(torch, res, gpt2(torch, args.layers, 768, 12, 1024, args.seed)).train()
        if w == "ckpt":
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        seqs = runs_of(lengths(args.seed, args.steps, 128, 1024))
        at, counters = ab_probe(args) if AB else warmup_probe(args, stat)
        losses, times = train_loop(torch, model, opt, execs, args.batch, seqs, w == "sidestream",
                                   at_warmup=at)
    elif w == "generate":
        model = upload(torch, res, gpt2(torch, args.layers, 768, 12, 1024, args.seed)).eval()
        model = model.to(torch.bfloat16)
        r = runs_of(lengths(args.seed, args.steps, 16, 512))
        bs = runs_of([1 + (x // 8) % 16 for x in lengths(args.seed + 1, args.steps, 8, 1024)])
        gen = torch.Generator().manual_seed(3)
        losses, times = [], []
        at, counters = ab_probe(args) if AB else warmup_probe(args, stat)
        with torch.no_grad():
            for i in range(execs):
                at(i)
                prompt = torch.randint(0, 512, (bs[i], r[i]), generator=gen).cuda()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                     attention_mask=torch.ones_like(prompt))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(out[:, -32:].float().sum().item()))
                del out, prompt
        res["total_s"] = sum(times)
    else:
        raise SystemExit(f"unknown workload {w}")
    if AB:
        res.update(losses=losses, **ab_result(args, times, counters))
        print("RESULT " + json.dumps(res), flush=True)
        return
    res.update(losses=losses, step_ms_median=1000 * statistics.median(times[args.warmup:]),
               step_ms=[1000 * t for t in times],
               peak_reserved_bytes=stat("reserved_bytes.all.peak"),
               peak_allocated_bytes=stat("allocated_bytes.all.peak"),
               num_device_alloc=stat("num_device_alloc"),
               num_device_free=stat("num_device_free"),
               num_sync_all_streams=stat("num_sync_all_streams"),
               steady_device_calls=steady_calls(stat, counters),
               **steady_host(counters, args.steps - args.warmup))
    if args.record:
        path = os.path.join(args.record, f"{args.workload}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["recorded"] = path
    print("RESULT " + json.dumps(res), flush=True)


def dist_worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # The allocator first: torch.cuda.set_device initializes PyTorch's allocator, after which
    # it can no longer be swapped.
    torch, stat, route = setup(args)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    if args.record and rank == 0:
        # Rank 0's history only (the ranks' patterns are alike), as run_one records; with
        # --record-threads, Python stacks too, to tell the threads apart (threaded_csv).
        if args.record_threads:
            torch.cuda.memory._record_memory_history(context="all", stacks="python",
                                                     max_entries=20_000_000)
        else:
            torch.cuda.memory._record_memory_history(context=None, max_entries=20_000_000)
    cold = {}
    model = upload(torch, cold, gpt2(torch, args.layers, 768, 12, 1024, args.seed)).train()
    if args.workload == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    seqs = lengths(args.seed + rank, args.steps, 128, 1024)
    if AB:
        # Every rank runs the same schedule: a step's collectives pair executions of one mode.
        at, counters = ab_probe(args, rank)
        losses, times = train_loop(torch, model, opt, AB_RUNS * args.steps, args.batch,
                                   [x for x in seqs for _ in range(AB_RUNS)], False, rank, at)
        res = {"workload": args.workload, "route": route, "rank": rank, "losses": losses,
               **ab_result(args, times, counters, rank)}
        # Every rank waits for the others at each collective: the other ranks' own figures
        # (their inputs differ) go beside rank 0's, as `other_ranks` of its result.
        print(("RESULT " if rank == 0 else "RANK ") + json.dumps(res), flush=True)
        dist.destroy_process_group()
        return
    at, counters = warmup_probe(args, stat, rank)
    losses, times = train_loop(torch, model, opt, args.steps, args.batch, seqs, False, rank, at)
    res = {"workload": args.workload, "route": route, "rank": rank, "losses": losses, **cold,
           "step_ms_median": 1000 * statistics.median(times[args.warmup:]),
           "step_ms": [1000 * t for t in times],
           "peak_reserved_bytes": stat("reserved_bytes.all.peak", rank),
           "peak_allocated_bytes": stat("allocated_bytes.all.peak", rank),
           "num_device_alloc": stat("num_device_alloc", rank),
           "num_device_free": stat("num_device_free", rank),
           "num_sync_all_streams": stat("num_sync_all_streams", rank),
           "steady_device_calls": steady_calls(stat, counters, rank),
           **steady_host(counters, args.steps - args.warmup)}
    if args.record and rank == 0 and args.record_threads:
        path = os.path.join(args.record, f"{args.workload}-threads.csv")
        threaded_csv(torch.cuda.memory._snapshot(), rank, path)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["recorded"] = path
    elif args.record and rank == 0:
        path = os.path.join(args.record, f"{args.workload}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["recorded"] = path
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def threaded_csv(snap, device, path):
    """Writes PyTorch's allocation history of `device` as an RMM-style CSV log whose Thread
    column tells the training loop's thread (`main`: an event whose Python stack passes through
    `train_loop`) from the others (`other`: autograd's device thread, which runs the backward
    pass and its hooks, and any C++ thread; their Python stacks never reach the loop). PyTorch
    records no thread ids; `examples/threaded_replay.rs` replays the log with one replay thread
    per label."""
    rows = ["Thread,Time,Action,Pointer,Size,Stream"]
    for e in snap["device_traces"][device]:
        action = {"alloc": "allocate", "free_requested": "free"}.get(e["action"])
        if action is None:
            continue
        frames = e.get("frames") or []
        thread = "main" if any(f.get("name") == "train_loop" for f in frames) else "other"
        rows.append(f"{thread},{e['time_us']},{action},{e['addr']:#x},{e['size']},{e['stream']}")
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def run_dist(args):
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    # CCA_DIST_ONE_RANK=1 runs DDP and FSDP2 on one GPU as a single rank (a proxy where no
    # two-GPU machine is at hand: the same model, hooks and per-layer all-gathered parameters,
    # with collectives over one rank; its figures are labelled "one rank", not the two-GPU ones).
    least = 1 if os.environ.get("CCA_DIST_ONE_RANK") == "1" else 2
    if world < least:
        print("RESULT " + json.dumps({"skipped": f"{args.workload} needs 2 GPUs, {world} visible"}))
        return
    mp.spawn(dist_worker, args=(world, args), nprocs=world, join=True)


def run_child(args, w, label, env_changes, cfg):
    """One workload under one allocator in a fresh process; its RESULT dict, or None."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", w,
           "--python-dir", args.python_dir,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
           "--batch", str(args.batch), "--seed", str(args.seed), "--port", str(args.port)]
    if cfg is not None:
        cmd += ["--ab-config" if args.ab else "--cca-config", cfg]
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        cmd += ["--record", os.path.abspath(args.record)]
        if args.record_threads:
            cmd += ["--record-threads"]
    if args.library:
        cmd += ["--library", args.library]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_CACHING_ALLOCATOR_CONF")}
    env.update(env_changes)
    if cfg is not None and args.host_timing:
        env["CCA_HOST_TIMING"] = "1"
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{w} {label}: FAILED (timeout {args.timeout} s)", flush=True)
        return None
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        print(f"{w} {label}: FAILED rc={p.returncode}\n{p.stderr[-3000:]}", flush=True)
        return None
    r = json.loads(lines[-1][len("RESULT "):])
    others = [json.loads(l[len("RANK "):]) for l in p.stdout.splitlines() if l.startswith("RANK ")]
    if others:
        r["other_ranks"] = others
    r["process_s"] = time.time() - t0
    shown = r.get("step_ms_median", r.get("skipped"))
    if "crate_ms" in r:
        shown = f"native {statistics.median(r['native_ms']):.2f} / crate {statistics.median(r['crate_ms']):.2f}"
    print(f"{w} {label}: {shown} ms ({r['process_s']:.0f} s)", file=sys.stderr, flush=True)
    return r


def quartiles(xs):
    """(q1, median, q3) of `xs`."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def compare_ab(args):
    """--ab: each workload `args.reps` times, each run one process holding native and one crate
    configuration; prints the crate's time over native's for the same input, pooled over the
    repeats, and each repeat's median beside it."""
    known = {a[0]: a for a in ALLOCATORS + EXTRA_ALLOCATORS if a[2] is not None}
    labels = [a for a in (args.allocators or ["cca-default"]) if a != "native"]
    unknown = [a for a in labels if a not in known]
    if unknown:
        raise SystemExit(f"unknown allocators {unknown}; known: {sorted(known)}")
    all_results, ok = {}, True
    print(f"\n== A/B in one process ({args.steps} steps after {args.warmup} of warm-up, every input "
          f"under both allocators, ABBA; {args.reps} processes each)")
    print("| workload | allocator | pairs | crate ÷ native, same input: order-free | "
          "crate first / second | median (q1–q3) | per process | ratio of means | "
          "crate slower in | native ms | crate ms | "
          "priming runs ms, native / crate | "
          "device calls after warm-up, native / crate | crate host µs / step (allocs / step; in device calls) | "
          "allocation µs / execution, native / crate (allocs) | "
          "order-free: pairs without / with page calls in the crate's execution (pairs) | "
          "reserved / peak allocated, native / crate |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in args.workloads:
        for label in labels:
            _, env_changes, cfg = known[label]
            runs = [run_child(args, w, label, env_changes, cfg) for _ in range(args.reps)]
            all_results.setdefault(w, {})[label] = runs
            good = [r for r in runs if r is not None and "crate_ms" in r]
            if len(good) < len(runs):
                ok = False
            if not good:
                skipped = next((r["skipped"] for r in runs if r and "skipped" in r), "failed")
                print(f"| {w} | {label} | {skipped} | | | | | | | | | | | | | | |")
                continue
            nat = [x for r in good for x in r["native_ms"]]
            mine = [x for r in good for x in r["crate_ms"]]
            first = [x for r in good for x in r["crate_first"]]
            ratios = [c / n for c, n in zip(mine, nat)]
            q1, med, q3 = quartiles(ratios)
            # The second run of an input may gain from the first (caches, clocks): the median
            # with the crate first and with the crate second, and their geometric mean, in
            # which that order effect cancels.
            r_first = statistics.median([r for r, f in zip(ratios, first) if f] or [med])
            r_second = statistics.median([r for r, f in zip(ratios, first) if not f] or [med])
            both = order_free(ratios, first)
            per = "/".join(f"{statistics.median(c / n for c, n in zip(r['crate_ms'], r['native_ms'])):.3f}"
                           for r in good)
            finite = all(l == l and abs(l) != float("inf") for r in good for l in r["losses"])
            ok = ok and finite
            host = host_cell(good) if all("host_us_per_step" in r for r in good) else ""
            alloc = alloc_cell(good)
            split = growth_cell(good)
            calls = ", ".join(f"{r['native_steady_device_calls']}/{r['crate_steady_device_calls']}"
                              for r in good)
            pn = [x for r in good for x in r["native_prime_ms"]]
            pc = [x for r in good for x in r["crate_prime_ms"]]
            primes = (f"{statistics.median(pn):.1f} / {statistics.median(pc):.1f}"
                      if pn and pc else "")
            r0 = good[-1]
            mem = (f"{r0['native_peak_reserved_bytes'] / max(r0['native_peak_allocated_bytes'], 1):.4f} / "
                   f"{r0['crate_peak_reserved_bytes'] / max(r0['crate_peak_allocated_bytes'], 1):.4f}")
            print(f"| {w} | {label} | {len(ratios)} | **{both:.3f}** | "
                  f"{r_first:.3f} / {r_second:.3f} | {med:.3f} ({q1:.3f}–{q3:.3f}) | {per} | "
                  f"{sum(mine) / sum(nat):.3f} | {sum(r > 1 for r in ratios)}/{len(ratios)} | "
                  f"{statistics.median(nat):.2f} | {statistics.median(mine):.2f} | {primes} | "
                  f"{calls} | {host} | {alloc} | {split} | "
                  f"{mem}{'' if finite else ' NON-FINITE LOSS'} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f)
    return 0 if ok else 1


def cold_cell(pairs, warmup):
    """The cold start of (crate run, native run) pairs of one repeat each: the model's upload plus
    the first step, in ms (median over the repeats), and its ratio to native's within each repeat
    (median, range); then the ratio of the first `warmup` steps' total (median)."""
    firsts, ratios, warm = [], [], []
    for c, n in pairs:
        if not (c.get("step_ms") and n.get("step_ms") and "upload_ms" in c and "upload_ms" in n):
            continue
        a = c["upload_ms"] + c["step_ms"][0]
        b = n["upload_ms"] + n["step_ms"][0]
        firsts.append(a)
        ratios.append(a / b)
        warm.append((c["upload_ms"] + sum(c["step_ms"][:warmup]))
                    / (n["upload_ms"] + sum(n["step_ms"][:warmup])))
    if not firsts:
        return ""
    return (f"{statistics.median(firsts):.1f}, {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}–{max(ratios):.3f}) ({statistics.median(warm):.3f})")


def compare(args):
    """Runs every workload under every allocator `args.reps` times, interleaved: repeat k runs
    the allocators in the order rotated by k, so that drift of the machine (clocks, other
    tenants) falls on each allocator alike. The ratio to native is taken within each repeat
    (runs minutes apart) and reported as the median with its range over the repeats."""
    all_results = {}
    ok = True
    if args.record:
        allocators = ALLOCATORS[:1]
    elif args.allocators:
        known = {a[0]: a for a in ALLOCATORS + EXTRA_ALLOCATORS}
        unknown = [a for a in args.allocators if a not in known]
        if unknown:
            raise SystemExit(f"unknown allocators {unknown}; known: {sorted(known)}")
        # native always runs: every ratio is taken against it.
        allocators = [ALLOCATORS[0]] + [known[a] for a in args.allocators if a != "native"]
    else:
        allocators = ALLOCATORS
    reps = 1 if args.record else args.reps
    for w in args.workloads:
        runs = {label: [] for label, _, _ in allocators}
        for k in range(reps):
            order = allocators[k % len(allocators):] + allocators[:k % len(allocators)]
            for label, env_changes, cfg in order:
                r = run_child(args, w, label, env_changes, cfg)
                if r is None:
                    ok = False
                runs[label].append(r)
        all_results[w] = runs
        first = next((r for r in runs["native"] if r is not None), None)
        if first is None or "skipped" in first:
            print(f"\n== {w}: {first.get('skipped') if first else 'native failed'}")
            continue
        gib = 1 << 30
        print(f"\n== {w} ({args.steps} steps, median after {args.warmup}; {reps} interleaved repeats)")
        print("| allocator | route | median step ms (min–max over repeats) | × native, median (min–max) | "
              "× native, step by step | cold: upload + first step ms, × native (first `warmup` steps × native) | peak reserved GiB | reserved / peak allocated | num_device_alloc (segments; mapped ranges when expandable) | "
              "device calls after warm-up | allocator host µs / step (allocs / step; in device calls) | max rel loss diff |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for label, _, _ in allocators:
            mine = runs[label]
            pairs = [(c, n) for c, n in zip(mine, runs["native"]) if c is not None and n is not None]
            good_runs = [c for c in mine if c is not None]
            if not good_runs:
                print(f"| {label} | failed | | | | | | | | | | |")
                continue
            steps = [c["step_ms_median"] for c in good_runs]
            ratios = [c["step_ms_median"] / n["step_ms_median"] for c, n in pairs]
            rel = max(abs(a - b) / max(abs(a), 1e-6)
                      for c, n in pairs for a, b in zip(n["losses"], c["losses"]))
            # Greedy `generate` flips near-tied tokens run to run under native itself (two
            # native processes, 16 inputs: 0.021 apart; docs/gpu-results.md, twenty-third
            # session, call 3), so its token sums get twice the tolerance.
            good = rel <= args.rtol * (2 if w == "generate" else 1)
            ok = ok and good
            c = good_runs[-1]
            steady = [x.get("steady_device_calls") for x in good_runs]
            ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
                     if ratios else "")
            # Step by step: step i has the same inputs (sequence length, batch) under every
            # allocator, so the ratio of the same step cancels the spread between steps; the
            # median over the steps after warm-up of each repeat, then over the repeats.
            per_rep = [statistics.median(a / b for a, b in zip(c["step_ms"][args.warmup:],
                                                                n["step_ms"][args.warmup:]))
                       for c, n in pairs if c.get("step_ms") and n.get("step_ms")]
            stepwise = (f"{statistics.median(per_rep):.3f} ({min(per_rep):.3f}–{max(per_rep):.3f})"
                        if per_rep else "")
            host = host_cell(good_runs)
            cold = cold_cell(pairs, args.warmup)
            print(f"| {label} | {c['route']} | {statistics.median(steps):.2f} ({min(steps):.2f}–{max(steps):.2f}) | "
                  f"{ratio} | {stepwise} | {cold} | {c['peak_reserved_bytes'] / gib:.3f} | "
                  f"{c['peak_reserved_bytes'] / max(c['peak_allocated_bytes'], 1):.4f} | "
                  f"{c['num_device_alloc']} | {'/'.join(str(x) for x in steady)} | {host} | "
                  f"{rel:.2g}{'' if good else ' MISMATCH'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f)
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="*", default=["sidestream", "generate", "ckpt"])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--cca-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--python-dir", required=True, help="folder holding the cuda_caching_allocator package")
    p.add_argument("--library", default=None, help="the native library (default: the package's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--rtol", type=float, default=3e-2)
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--allocators", nargs="*", default=None,
                   help="labels to run beside native (default: the four of ALLOCATORS; also "
                        "cca-default-20m, cca-lean-fast, cca-no-lending, cca-no-fast, cca-borrow, "
                        "cca-budget1, cca-slack15, cca-no-helper)")
    p.add_argument("--reps", type=int, default=int(os.environ.get("CCA_CLIENT_REPS", "1")),
                   help="interleaved repeats of every allocator (default 1, or $CCA_CLIENT_REPS)")
    p.add_argument("--host-timing", action="store_true",
                   help="time the allocator's host path in the crate's runs (CCA_HOST_TIMING=1) "
                        "and report its µs per step")
    p.add_argument("--record-threads", action="store_true",
                   help="with --record, the two-GPU workloads write DIR/<workload>-threads.csv, "
                        "an RMM-style log whose Thread column tells the training loop's thread "
                        "from autograd's (from Python stacks)")
    p.add_argument("--ab", action="store_true",
                   help="one process per run holding native and one crate configuration "
                        "(--allocators, default cca-default), every input under both (see above)")
    p.add_argument("--ab-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json")
    p.add_argument("--record", metavar="DIR",
                   help="run only PyTorch native, recording each workload's allocation history as "
                        "DIR/<workload>.pickle (a snapshot cca replays)")
    args = p.parse_args()
    args.python_dir = os.path.abspath(args.python_dir)
    if args.library:
        args.library = os.path.abspath(args.library)
    if args.one:
        args.workload = args.one
        if args.one in ("ddp", "fsdp"):
            run_dist(args)
        else:
            run_one(args)
        return 0
    return compare_ab(args) if args.ab else compare(args)


if __name__ == "__main__":
    sys.exit(main())
