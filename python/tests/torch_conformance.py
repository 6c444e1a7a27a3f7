"""PyTorch conformance of cuda-caching-allocator installed through the package (GPU machine).

Installs the allocator with ``cuda_caching_allocator.torch.enable()`` (the C++ shim route unless
``--route pluggable``), then checks PyTorch's own APIs against values it can predict: one line
``PASS name: detail`` or ``FAIL name: detail`` per API, a closing ``N passed, N failed`` line, and
a non-zero exit status on any failure.

    python3 torch_conformance.py [--config STR] [--route shim|pluggable] [--out DIR]

Sizes used for exact checks are multiples of 2 MiB or small powers of two, which every rounding
setting of the allocator leaves as they are (1000 bytes rounds to 1024, the 512-byte granule).
"""

import argparse
import os
import pickle
import sys
import tempfile
import traceback

RESULTS = []
MiB = 1 << 20


def check(name):
    def deco(fn):
        def run(*a, **kw):
            try:
                ok, detail = fn(*a, **kw)
            except Exception as e:  # an API that raises fails, with its message
                ok, detail = False, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=4)!r}"
            RESULTS.append((name, ok))
            print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
            return ok

        run.__name__ = fn.__name__
        return run

    return deco


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--route", default="shim", choices=["shim", "pluggable", "auto"])
    ap.add_argument("--out", default=None, help="folder for the snapshot file (default: a temp dir)")
    args = ap.parse_args()

    import cuda_caching_allocator.torch as cca

    cca.enable(config=args.config, route=args.route)
    import torch

    print(f"torch {torch.__version__}, route {cca.route()}, device "
          f"{torch.cuda.get_device_name(0)}, config {args.config!r}", flush=True)
    dev = torch.device("cuda", 0)
    out_dir = args.out or tempfile.mkdtemp(prefix="cca-conformance-")
    os.makedirs(out_dir, exist_ok=True)

    @check("route")
    def t_route():
        return cca.route() == "shim", f"route={cca.route()} name={torch.cuda.get_allocator_backend()}"

    @check("memory_allocated")
    def t_allocated():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        sizes = [2 * MiB, 4 * MiB, 6 * MiB, 1000, 4096]
        rounded = [2 * MiB, 4 * MiB, 6 * MiB, 1024, 4096]
        ts = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
        got = torch.cuda.memory_allocated() - base
        ours = cca.stat("allocated_bytes.all.current")
        want = sum(rounded)
        ok = got == want and ours == torch.cuda.memory_allocated()
        del ts
        after = torch.cuda.memory_allocated()
        ok = ok and after == base
        return ok, f"delta {got} want {want}; ours {ours} vs torch {base + got}; after free {after} (base {base})"

    @check("memory_stats")
    def t_stats():
        x = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
        s = torch.cuda.memory_stats()
        keys = ["allocated_bytes.all.current", "reserved_bytes.all.current", "allocation.all.current",
                "segment.all.current", "active_bytes.all.peak", "num_device_alloc", "num_ooms"]
        bad = [k for k in keys if s.get(k) != cca.stat(k)]
        ok = not bad and s["allocation.all.current"] >= 1 and s["reserved_bytes.all.current"] >= 8 * MiB
        del x
        return ok, f"{len(s)} keys; mismatches {bad}; reserved {s['reserved_bytes.all.current']}"

    @check("memory_reserved/max_memory_reserved/reset_peak_memory_stats")
    def t_peaks():
        x = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
        peak_alloc = torch.cuda.max_memory_allocated()
        del x
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        r, mr = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
        a, ma = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        ok = peak_alloc >= 64 * MiB and mr == r and ma == a
        return ok, f"peak before {peak_alloc}; after reset reserved {r} max {mr}, allocated {a} max {ma}"

    @check("empty_cache")
    def t_empty():
        torch.cuda.empty_cache()
        r0 = torch.cuda.memory_reserved()
        x = torch.empty(128 * MiB, dtype=torch.uint8, device=dev)
        r1 = torch.cuda.memory_reserved()
        del x
        r2 = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        r3 = torch.cuda.memory_reserved()
        ok = r1 >= r0 + 128 * MiB and r2 == r1 and r3 <= r0
        return ok, f"reserved {r0} -> alloc {r1} -> free {r2} -> empty_cache {r3}"

    @check("memory_summary")
    def t_summary():
        x = torch.empty(10 * MiB, dtype=torch.uint8, device=dev)
        s = torch.cuda.memory_summary()
        cur = cca.stat("allocated_bytes.all.current")
        # PyTorch's summary formats "Cur Usage" in the unit that fits the row's peak.
        peak = cca.stat("allocated_bytes.all.peak")
        sz, p, unit = cur, peak, "B  "
        for nxt in ("KiB", "MiB", "GiB", "TiB", "PiB"):
            if p < 768 * 1024:
                break
            unit, sz, p = nxt, sz // 1024, p / 1024
        want = f"{sz:6d} {unit}"
        # Rows read "| Allocated memory      |  10240 KiB | ...": the label is the first column.
        row = next((ln for ln in s.splitlines()
                    if ln.strip().lstrip("|").strip().startswith("Allocated memory")), "")
        cols = [c.strip() for c in row.strip().strip("|").split("|")]
        ok = "PyTorch CUDA memory summary" in s and len(cols) > 1 and cols[1] == want.strip()
        del x
        return ok, f"row {row.strip()!r}: Cur Usage should be {want.strip()!r} (ours: {cur} bytes)"

    @check("set_per_process_memory_fraction + OOM observer + OutOfMemoryError")
    def t_fraction_oom():
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.empty_cache()
        ooms0 = torch.cuda.memory_stats()["num_ooms"]
        torch.cuda.set_per_process_memory_fraction(0.05)
        frac = getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 0.05)()
        raised = ""
        try:
            torch.empty(int(total * 0.2), dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as e:
            raised = str(e)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        ooms1 = torch.cuda.memory_stats()["num_ooms"]
        ok_small = torch.empty(4 * MiB, dtype=torch.uint8, device=dev) is not None
        ok = (abs(frac - 0.05) < 1e-9 and "cuda_caching_allocator" in raised and len(seen) == 1
              and ooms1 == ooms0 + 1 and ok_small)
        return ok, f"fraction {frac}; raised {raised[:120]!r}; observer calls {seen}; num_ooms {ooms0}->{ooms1}"

    @check("record_stream")
    def t_record_stream():
        side = torch.cuda.Stream()
        # Load the kernels first: with CUDA's lazy module loading, the first launch of a kernel
        # may wait for the device, and the side stream would be idle before the test begins.
        warm = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        with torch.cuda.stream(side):
            torch.cuda._sleep(1)
            warm.add_(1)
        side.synchronize()
        del warm
        x = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # keeps the side stream busy
            x.add_(1)
        x.record_stream(side)
        ptr = x.data_ptr()
        del x
        y = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        busy = not side.query()  # the side stream still runs: reuse now would be a race
        reused = y.data_ptr() == ptr
        side.synchronize()
        return busy and not reused, (f"freed block {'REUSED' if reused else 'not reused'} while the "
                                     f"side stream {'runs' if busy else 'was already idle (no test)'}")

    @check("_record_memory_history/_snapshot/_dump_snapshot + _memory_viz")
    def t_snapshot():
        from torch.cuda import _memory_viz

        torch.cuda.memory._record_memory_history(max_entries=10000)
        x = torch.empty(6 * MiB, dtype=torch.uint8, device=dev)
        y = torch.empty(2 * MiB, dtype=torch.uint8, device=dev)
        del y
        snap = torch.cuda.memory._snapshot()
        path = os.path.join(out_dir, "cca_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        blocks = [b for s in snap["segments"] for b in s["blocks"]]
        mine = [b for b in blocks if b.get("address") == x.data_ptr()]
        traces = snap["device_traces"][0] if snap["device_traces"] else []
        allocs = [t for t in traces if t["action"] == "alloc" and t["addr"] == x.data_ptr()]
        frames = allocs[0].get("frames", []) if allocs else []
        with open(path, "rb") as f:
            data = pickle.load(f)
        html = _memory_viz.trace_plot(data)
        seg_html = _memory_viz.segment_plot(data)
        text = _memory_viz.segsum(data)
        ok = (bool(mine) and mine[0]["state"] == "active_allocated" and mine[0]["size"] == 6 * MiB
              and bool(allocs) and bool(frames) and any(t["action"] == "free_completed" for t in traces)
              and len(html) > 1000 and len(seg_html) > 1000 and "Summary of segments" in text)
        del x
        return ok, (f"{len(snap['segments'])} segments, block {mine[:1]}, {len(traces)} trace entries, "
                    f"{len(frames)} frames on the alloc, file {path} reopened: trace_plot "
                    f"{len(html)} chars, segment_plot {len(seg_html)}, segsum {len(text)}")

    @check("cudnn.benchmark (cacheInfo)")
    def t_cudnn():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(16, 32, 3, padding=1).to(dev)
        inp = torch.randn(8, 16, 64, 64, device=dev)
        torch.backends.cudnn.benchmark = False
        ref = conv(inp)
        torch.backends.cudnn.benchmark = True
        try:
            got = conv(inp)
            got.sum().backward()
        finally:
            torch.backends.cudnn.benchmark = False
        err = (got - ref).abs().max().item()
        return err < 1e-3, f"max abs diff benchmark vs not {err:.2e}"

    @check("torch.cuda.graph private pool + checkPoolLiveAllocations")
    def t_graph():
        static_in = torch.ones(1 << 20, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                (static_in * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tmp = static_in * 2
            static_out = tmp + 1
            del tmp
        static_in.fill_(3.0)
        g.replay()
        torch.cuda.synchronize()
        val_ok = bool((static_out == 7.0).all())
        pool = g.pool()
        live_ok = torch._C._cuda_checkPoolLiveAllocations(0, pool, {static_out.untyped_storage().data_ptr()})
        wrong_ok = not torch._C._cuda_checkPoolLiveAllocations(0, pool, set())
        # A second graph sharing the pool.
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=pool):
            out2 = static_out * 10
        g2.replay()
        torch.cuda.synchronize()
        share_ok = bool((out2 == 70.0).all())
        del g, g2, static_out, out2
        return val_ok and live_ok and wrong_ok and share_ok, (
            f"values {val_ok}, live check {live_ok}, mismatch detected {wrong_ok}, shared pool {share_ok}")

    @check("make_graphed_callables")
    def t_graphed():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(dev)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(dev)
        ref.load_state_dict(model.state_dict())
        x = torch.randn(32, 64, device=dev, requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (x,))
        xs = [torch.randn(32, 64, device=dev) for _ in range(3)]
        diffs, gd = [], 0.0
        for xb in xs:
            # Gradients compared step by step, zeroed before each backward: accumulated across
            # graphed calls they differ from eager's under PyTorch's own allocator too (checked on
            # an H100: grad diff 32.0 native and ours alike).
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            a, b = graphed(xb), ref(xb)
            a.sum().backward()
            b.sum().backward()
            diffs.append((a - b).abs().max().item())
            gd = max([gd] + [(p.grad - q.grad).abs().max().item()
                             for p, q in zip(model.parameters(), ref.parameters())])
        return max(diffs) < 1e-5 and gd < 1e-4, f"max out diff {max(diffs):.2e}, grad diff {gd:.2e}"

    @check("torch.cuda.MemPool / use_mem_pool")
    def t_mempool():
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        y = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        uses = pool.use_count()
        segs = pool.snapshot()
        in_pool = any(b.get("address") == x.data_ptr() for s in segs for b in s["blocks"])
        y_in_pool = any(b.get("address") == y.data_ptr() for s in segs for b in s["blocks"])
        # use_on_oom is accepted (it used to be refused); what it does is probed in
        # gpu/probes/torch_review.py use_on_oom.
        oom_pool = torch.cuda.MemPool(use_on_oom=True)
        del x, y, pool, oom_pool
        torch.cuda.empty_cache()
        ok = uses >= 1 and in_pool and not y_in_pool
        return ok, f"use_count {uses}, x in pool snapshot {in_pool}, y (outside) in it {y_in_pool}, MemPool(use_on_oom=True) accepted"

    @check("torch.compile(mode='reduce-overhead') transformer, losses equal to eager")
    def t_compile():
        def make():
            torch.manual_seed(0)
            layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(64, 16)).to(dev)

        def train(model, step_fn, steps=6):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator(device="cpu").manual_seed(1)
            losses = []
            for _ in range(steps):
                xb = torch.randn(8, 12, 64, generator=g).to(dev)
                yb = torch.randint(0, 16, (8, 12), generator=g).to(dev)
                torch.compiler.cudagraph_mark_step_begin()
                loss = step_fn(model, xb, yb)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.item()))
            return losses

        def step(model, xb, yb):
            return torch.nn.functional.cross_entropy(model(xb).reshape(-1, 16), yb.reshape(-1))

        eager = train(make(), step)
        compiled_model = make()
        compiled = torch.compile(compiled_model, mode="reduce-overhead")
        comp = train(compiled_model, lambda m, xb, yb: step(compiled, xb, yb))
        diff = max(abs(a - b) for a, b in zip(eager, comp))
        return diff < 2e-3, f"eager {['%.4f' % v for v in eager]} compiled {['%.4f' % v for v in comp]} max diff {diff:.2e}"

    @check("CUDA IPC handle in PyTorch's format")
    def t_ipc():
        import struct

        x = torch.empty(3 * MiB + 4096, dtype=torch.uint8, device=dev)
        shared = x.untyped_storage()._share_cuda_()
        handle, size, offset = shared[1], shared[2], shared[3]
        if len(handle) < 2 or handle[0] != 2:
            return False, f"version {handle[:1]!r}, {len(handle)} bytes"
        if chr(handle[1]) == "e":
            # Pages (the default): PyTorch's ShareHeader (pid, 4 bytes of zero padding, bytes per
            # handle, handle count), then one POSIX descriptor per handle, open in this process.
            pid, pad, per, n = struct.unpack_from("<iIQQ", handle, 2)
            fds = struct.unpack_from(f"<{n}i", handle, 26) if len(handle) == 26 + 4 * n else ()
            ok = (pid == os.getpid() and pad == 0 and per > 0 and len(fds) == n
                  and offset < per and offset + size <= per * n
                  and all(os.path.exists(f"/proc/self/fd/{fd}") for fd in fds))
            return ok, f"'e': pid {pid}, {n} handles of {per} bytes, offset {offset}, fds {fds}"
        ok = chr(handle[1]) == "c" and len(handle) == 66
        return ok, f"'c': {len(handle)} bytes, offset {offset}"

    @check("per-device APIs refuse a device that does not exist")
    def t_bad_device():
        # As PyTorch's assertValidDevice ("Invalid device argument N: did you call init?"); the
        # library reads a device whose cache was never made as empty, so without the shim's
        # check torch.cuda.memory_allocated(N) answered 0 for a device the machine lacks.
        # Control: the same calls on device 0 answer.
        n = torch.cuda.device_count()
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        control = torch.cuda.memory_stats(0)["num_ooms"] >= 0 and (
            get_fraction is None or 0.0 < get_fraction(0) <= 1.0)
        calls = [("memory_stats", lambda: torch.cuda.memory_stats(n)),
                 ("reset_peak_memory_stats", lambda: torch.cuda.reset_peak_memory_stats(n))]
        if get_fraction is not None:
            calls.append(("get_per_process_memory_fraction", lambda: get_fraction(n)))
        refused = []
        for name, call in calls:
            try:
                call()
            except RuntimeError as e:
                if "Invalid device argument" in str(e):
                    refused.append(name)
        return control and len(refused) == len(calls), f"device {n} of {n}: refused {refused}"

    only = [n for n in os.environ.get("CCA_CONFORMANCE_ONLY", "").split(",") if n]
    for t in (t_route, t_allocated, t_stats, t_peaks, t_empty, t_summary, t_fraction_oom,
              t_record_stream, t_snapshot, t_cudnn, t_graph, t_graphed, t_mempool, t_compile, t_ipc,
              t_bad_device):
        if not only or t.__name__ in only:
            t()
    print(torch.cuda.memory_summary(abbreviated=True))
    failed = sum(1 for _, ok in RESULTS if not ok)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
