#!/usr/bin/env python3
"""Checks of gpu/clients.py's bookkeeping that need no GPU and no torch (run by
python/tests/ci.sh): the A/B schedule, the pairing of its step times, the summary table and the
thread labels of --record-threads. The measurements themselves run on the GPU machine."""
import contextlib
import io
import os
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clients  # noqa: E402

COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams")


class FakeAb:
    """Statistics of the two sides as the A/B extension returns them."""

    def __init__(self):
        self.calls = {0: 0, 1: 0}
        self.mode_set = []

        # Timed allocations, as `host_alloc` returns them: (on, native ns, native calls, crate
        # ns, crate calls).
        self.timed = [False, 0, 0, 0, 0]

    def set_mode(self, mode):
        self.mode_set.append(mode)

    def host_alloc(self):
        return tuple(self.timed)

    def stats(self, side, device=0):
        return {"reserved_bytes.all.peak": 110 if side else 150,
                "allocated_bytes.all.peak": 100,
                "num_device_alloc": self.calls[side], "num_device_free": 0,
                "num_sync_all_streams": 0}


def test_schedule():
    modes = [clients.ab_mode(i) for i in range(4 * clients.AB_RUNS)]
    # Input j: a priming run (native for even j, the crate for odd j), then ABBA.
    assert modes == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0], modes
    for j in range(50):
        measured = {clients.ab_mode(clients.AB_RUNS * j + k) for k in (1, 2)}
        assert measured == {0, 1}, (j, measured)


def test_pairing():
    ab = FakeAb()
    clients.AB = ab
    clients.HOST_TIME = lambda: None
    args = types.SimpleNamespace(warmup=2, steps=6)
    at, counters = clients.ab_probe(args)
    times = []
    for i in range(clients.AB_RUNS * args.steps):
        at(i)
        if i == clients.AB_RUNS * args.warmup:
            ab.calls[1] = 0  # read at warm-up: calls before it do not count
        j, pos = divmod(i, clients.AB_RUNS)
        mode = clients.ab_mode(i)
        # Priming runs are slow; the crate takes 10 % longer than native on input j's repeats.
        times.append(1.0 if pos == 0 else (0.1 + j) * (1.1 if mode else 1.0))
    ab.calls[1] = 3
    assert ab.mode_set == [clients.ab_mode(i) for i in range(len(times))]
    r = clients.ab_result(args, times, counters)
    assert len(r["native_ms"]) == args.steps - args.warmup
    for n, c in zip(r["native_ms"], r["crate_ms"]):
        assert abs(c / n - 1.1) < 1e-9, (n, c)
    assert r["crate_first"] == [False, True, False, True]
    assert r["native_prime_ms"] == [1000.0, 1000.0] and r["crate_prime_ms"] == [1000.0, 1000.0]
    assert r["crate_steady_device_calls"] == 3 and r["native_steady_device_calls"] == 0


def test_alloc_time():
    """Each execution's timed allocations go to its allocator; only the two repeats of each
    input after warm-up count, paired by input."""
    ab = FakeAb()
    ab.timed[0] = True
    clients.AB = ab
    # The crate's shim timing: 500 µs of frees in each execution under the crate.
    shim = {"alloc_ns": 0, "alloc_calls": 0, "free_ns": 0, "free_calls": 0}
    clients.HOST_TIME = lambda: dict(shim)
    # The crate's device calls: 2 unmaps in each execution under the crate.
    calls = {"unmap": 0, "map": 0}
    clients.DEVICE_COUNTS = lambda device=0: dict(calls)
    args = types.SimpleNamespace(warmup=1, steps=4)
    at, counters = clients.ab_probe(args)
    times = []
    for i in range(clients.AB_RUNS * args.steps):
        at(i)
        j = i // clients.AB_RUNS
        # Execution i allocates 10 times: native 2 µs each, the crate 3 µs plus 1 per input.
        if clients.ab_mode(i) == 0:
            ab.timed[1] += 10 * 2000
            ab.timed[2] += 10
        else:
            ab.timed[3] += 10 * (3000 + 1000 * j)
            ab.timed[4] += 10
            shim["free_ns"] += 500_000
            calls["unmap"] += 2
        times.append(1.0)
    r = clients.ab_result(args, times, counters)
    assert r["native_alloc_us"] == [20.0, 20.0, 20.0], r
    assert r["crate_alloc_us"] == [40.0, 50.0, 60.0], r
    assert r["native_allocs"] == [10, 10, 10] and r["crate_allocs"] == [10, 10, 10], r
    assert r["crate_calls_own"] == {"unmap": [2, 2, 2], "map": [0, 0, 0]}, r
    assert r["crate_free_us_own"] == [500.0] * 3 and r["crate_free_us_in_native"] == [0.0] * 3, r
    assert clients.alloc_cell([r]) == "20 / 50 (10); +30; crate frees 500", clients.alloc_cell([r])
    # Timing off: no figures, an empty cell.
    ab2 = FakeAb()
    clients.AB = ab2
    clients.HOST_TIME = lambda: None
    clients.DEVICE_COUNTS = lambda device=0: None
    at, counters = clients.ab_probe(args)
    for i in range(clients.AB_RUNS * args.steps):
        at(i)
    r2 = clients.ab_result(args, times, counters)
    assert "native_alloc_us" not in r2 and clients.alloc_cell([r2]) == ""


def test_growth_cell():
    """Pairs whose crate execution made a page call on any rank are split from the others; a
    run without per-execution calls gives no cell."""
    r = {"native_ms": [100.0] * 4, "crate_ms": [101.0, 99.0, 130.0, 120.0],
         "crate_first": [False, True, False, True],
         "crate_calls_own": {"map": [0, 0, 5, 0], "unmap": [0, 0, 0, 0], "create": [0, 0, 1, 0],
                             "event_query": [3, 3, 3, 3]},
         "other_ranks": [{"crate_calls_own": {"map": [0, 0, 0, 7], "unmap": [0, 0, 0, 2],
                                              "create": [0, 0, 0, 0]}}]}
    # Quiet: pairs 0 (1.01, second) and 1 (0.99, first): order-free sqrt(0.99 * 1.01).
    q = (0.99 * 1.01) ** 0.5
    g = (1.2 * 1.3) ** 0.5
    assert clients.growth_cell([r]) == f"{q:.3f} (2) / {g:.3f} (2)", clients.growth_cell([r])
    assert clients.growth_cell([dict(r, other_ranks=[{}])]) == ""
    assert clients.growth_cell([{k: v for k, v in r.items() if k != "crate_calls_own"}]) == ""


def test_table():
    ab = FakeAb()
    clients.AB = ab
    # The crate 2 % slower when second (order effect), 2 % faster when first: order-free 1.000.
    n = [100.0] * 8
    first = [k % 2 == 1 for k in range(8)]
    c = [98.0 if f else 102.0 for f in first]
    run = {"native_ms": n, "crate_ms": c, "crate_first": first, "native_prime_ms": [500.0],
           "crate_prime_ms": [510.0], "losses": [1.0, 0.9],
           "native_peak_reserved_bytes": 150, "native_peak_allocated_bytes": 100,
           "crate_peak_reserved_bytes": 101, "crate_peak_allocated_bytes": 100,
           "native_steady_device_calls": 0, "crate_steady_device_calls": 0}
    clients.run_child = lambda *a: dict(run)
    args = types.SimpleNamespace(allocators=None, workloads=["ckpt"], reps=2, steps=10, warmup=2,
                                 json=None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = clients.compare_ab(args)
    assert rc == 0
    row = [l for l in out.getvalue().splitlines() if l.startswith("| ckpt |")]
    assert len(row) == 1, out.getvalue()
    cells = [x.strip() for x in row[0].split("|")]
    assert cells[3] == "16", cells              # pairs pooled over 2 processes
    assert cells[4] == "**1.000**", cells        # order-free
    assert cells[5] == "0.980 / 1.020", cells    # crate first / second
    assert cells[12] == "500.0 / 510.0", cells   # priming runs


def test_thread_labels():
    frames_loop = [{"name": "forward", "filename": "m.py"}, {"name": "train_loop"}]
    snap = {"device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1,
         "frames": frames_loop},
        {"action": "alloc", "addr": 8192, "size": 256, "stream": 7, "time_us": 2,
         "frames": [{"name": "_pre_backward_hook"}]},
        {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "time_us": 3,
         "frames": []},
        {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "time_us": 4},
        {"action": "segment_map", "addr": 0, "size": 2 << 20, "stream": 0, "time_us": 0},
    ]]}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.csv")
        clients.threaded_csv(snap, 0, path)
        with open(path) as f:
            lines = f.read().splitlines()
    assert lines == ["Thread,Time,Action,Pointer,Size,Stream",
                     "main,1,allocate,0x1000,512,0",
                     "other,2,allocate,0x2000,256,7",
                     "other,3,free,0x1000,512,0"], lines


def test_device_time_cell():
    """The host-time cell adds the time inside device calls and names the largest kinds; a
    library without the figures (-1 or None) leaves them out."""
    before = {k: 0 for k in clients.CALL_KINDS + ("all",)}
    after = dict(before, map=2_000_000, unmap=6_000_000, set_access=4_000_000, all=12_500_000)
    dev = clients.steady_device(before, after, 2)
    assert dev["device_us_per_step"] == 6250.0, dev
    assert dev["device_us_by_kind"]["unmap"] == 3000.0, dev
    row = {"host_us_per_step": 9000.0, "allocs_per_step": 100.0, **dev}
    assert clients.host_cell([row]) == (
        "9000 (100); device calls 6250, unmap 3000, set_access 2000, map 1000"), clients.host_cell([row])
    assert clients.steady_device(before, dict(after, map=-1), 2) == {}
    assert clients.steady_device(None, after, 2) == {}
    assert clients.host_cell([{"host_us_per_step": 10.0, "allocs_per_step": 2.0}]) == "10 (2)"
    assert clients.host_cell([{}]) == ""


def test_cold_cell():
    """The cold cell: upload + first step (median ms), its ratio to native within each repeat,
    and the ratio of the warm-up steps' totals; runs without the figures are left out."""
    native = {"upload_ms": 10.0, "step_ms": [90.0, 50.0, 50.0, 40.0]}
    slow = {"upload_ms": 20.0, "step_ms": [130.0, 55.0, 45.0, 40.0]}
    fast = {"upload_ms": 10.0, "step_ms": [90.0, 50.0, 50.0, 40.0]}
    cell = clients.cold_cell([(slow, native), (fast, native), ({"step_ms": [1.0]}, native)], 3)
    # upload + first step: 150 and 100 (median 125); ratios 1.5 and 1.0; warm-up totals
    # (20 + 230) / 200 = 1.25 and 1.0.
    assert cell == "125.0, 1.250 (1.000–1.500) (1.125)", cell
    assert clients.cold_cell([], 3) == ""


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
            print(f"ok {name}")
