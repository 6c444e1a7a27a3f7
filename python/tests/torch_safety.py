#!/usr/bin/env python3
"""GPU probes of the PyTorch integration's stream and graph safety (issue #10), each run once with
PyTorch's native allocator and once with cuda-caching-allocator installed by
``cuda_caching_allocator.torch.enable()``, in separate processes (PyTorch cannot swap allocators
once one is in use):

1. record_stream: a tensor made on a side stream is read on the main stream after a delay
   (``x.record_stream(main)``), then freed; the side stream at once allocates the same size and
   overwrites it. The main stream's read must see the original values (20 trials).
2. graph: ``torch.cuda.graph`` capture of work that allocates and frees inside the capture,
   replayed 100 times while eager work allocates, fills and frees tensors of the same sizes
   between replays; every replay's output is checked.
3. graphed: ``torch.cuda.make_graphed_callables`` on a small MLP, trained for a few steps; the
   losses must equal an eager twin's.

    python3 torch_safety.py --library path/to/libcca_torch.so [--config STR] [--json OUT]
    python3 torch_safety.py --mode native|cca ...     # one process

Exit status 0 when every probe of the cca run passes and native passes too.
"""

import argparse
import json
import os
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/ (the cuda_caching_allocator package)

TRIALS = 20
N = 1 << 22  # 16 MiB of float32
SLEEP = 50_000_000  # torch.cuda._sleep cycles: ~25 ms


def probe_record_stream(torch):
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    wrong = reused = 0
    for trial in range(TRIALS):
        with torch.cuda.stream(side):
            x = torch.full((N,), float(trial + 1), device="cuda")
        main.wait_stream(side)
        torch.cuda._sleep(SLEEP)  # the main stream is busy for a while ...
        y = x * 1.0  # ... then reads x
        x.record_stream(main)
        ptr = x.data_ptr()
        del x
        with torch.cuda.stream(side):
            z = torch.empty((N,), device="cuda")
            reused += int(z.data_ptr() == ptr)
            z.fill_(-7.0)  # must not overwrite x before the main stream has read it
        torch.cuda.synchronize()
        if not bool((y == float(trial + 1)).all()):
            wrong += 1
        del y, z
    return {"trials": TRIALS, "wrong": wrong, "reused_block": reused}


def probe_graph(torch):
    s = torch.cuda.Stream()
    static_in = torch.zeros(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    # Warm up on the side stream, as PyTorch's docs ask.
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            tmp = static_in * 2.0 + 1.0
            out = tmp.sum() + static_in[:16].sum()
            del tmp
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        tmp = static_in * 2.0 + 1.0  # allocated inside the capture
        tmp2 = tmp * 3.0
        del tmp  # freed inside the capture
        static_out = tmp2.sum() + static_in[:16].sum()
        del tmp2
    wrong = 0
    for i in range(100):
        static_in.fill_(float(i % 7))
        g.replay()
        # Eager work between replays allocates, fills and frees tensors of the captured sizes:
        # it must never receive the graph's memory.
        junk = [torch.full((N,), 1e6, device="cuda") for _ in range(3)]
        junk2 = junk[0] * junk[1]
        want = (float(i % 7) * 2.0 + 1.0) * 3.0 * N + 16 * float(i % 7)
        got = float(static_out.item())
        if abs(got - want) > 1e-3 * abs(want) + 1e-3:
            wrong += 1
        del junk, junk2
    del g
    return {"replays": 100, "wrong": wrong}


def probe_graphed(torch):
    torch.manual_seed(0)
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        ).cuda()
    eager, graphed = make(), make()
    sample = torch.randn(32, 64, device="cuda")
    graphed = torch.cuda.make_graphed_callables(graphed, (sample,))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses_e, losses_g = [], []
    for _ in range(10):
        xb = torch.randn(32, 64, device="cuda", generator=gen)
        yb = torch.randint(0, 10, (32,), device="cuda", generator=gen)
        for model, opt, losses in ((eager, opt_e, losses_e), (graphed, opt_g, losses_g)):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(float(loss.item()))
    diff = max(abs(a - b) for a, b in zip(losses_e, losses_g))
    return {"steps": 10, "max_abs_loss_diff": diff, "ok": diff < 1e-4, "losses": losses_g}


def run_one(args):
    if args.mode == "cca":
        import cuda_caching_allocator.torch as cca
        cca.enable(config=args.config, library=args.library)
    import torch
    probes = (("record_stream", probe_record_stream), ("graph", probe_graph),
              ("graphed", probe_graphed))
    if args.mode == "bare":
        if args.config:
            os.environ["CUDA_CACHING_ALLOCATOR_CONF"] = args.config
        bare = torch.cuda.memory.CUDAPluggableAllocator(args.library, "cca_alloc", "cca_free")
        torch.cuda.memory.change_current_allocator(bare)
        probes = probes[:1]
    result = {"mode": args.mode, "config": args.config, "torch": torch.__version__}
    for name, fn in probes:
        try:
            result[name] = fn(torch)
        except Exception as e:  # a probe that raises is reported, not hidden
            result[name] = {"error": f"{type(e).__name__}: {e}",
                            "trace": traceback.format_exc(limit=3)}
    if args.mode == "cca":
        import cuda_caching_allocator.torch as cca
        result["graph_hooks"] = cca.graph_hooks()
        result["peak_reserved"] = cca.stat("reserved_bytes.all.peak")
    print(json.dumps(result))


def passed(r):
    rs, g, gd = r.get("record_stream", {}), r.get("graph", {}), r.get("graphed", {})
    return (rs.get("wrong") == 0 and g.get("wrong") == 0 and gd.get("ok") is True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["native", "cca", "bare"],
                    help="bare: the library installed without any hook, as before issue #10 "
                         "(the control arm: the record_stream race must show)")
    ap.add_argument("--library")
    ap.add_argument("--config", action="append",
                    help="cca configuration string (repeat for several runs); default: the "
                         "crate's default and cca_preset:pytorch")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.mode:
        args.config = (args.config or [None])[0]
        run_one(args)
        return 0
    runs = ([("native", None), ("bare", None)]
            + [("cca", c) for c in (args.config or [None, "cca_preset:pytorch"])])
    results = []
    for mode, config in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode]
        if args.library:
            cmd += ["--library", args.library]
        if config:
            cmd += ["--config", config]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        line = (p.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = {"mode": mode, "config": config, "error": (p.stderr or p.stdout)[-2000:]}
        r["rc"] = p.returncode
        results.append(r)
        print(f"== {mode} {config or '(default)'}: rc={p.returncode} pass={passed(r)}")
        for k in ("record_stream", "graph", "graphed"):
            print(f"   {k}: {json.dumps(r.get(k))[:400]}")
        if p.returncode != 0:
            print(p.stderr[-1500:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    # The control arm must show the race, or the probe proves nothing.
    control = [r for r in results if r.get("mode") == "bare"]
    sensitive = all(r.get("record_stream", {}).get("wrong", 0) > 0 for r in control)
    print(f"control arm (no hooks) shows the record_stream race: {sensitive}")
    ok = all(passed(r) for r in results if r.get("mode") != "bare") and sensitive
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
