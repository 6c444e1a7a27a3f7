"""NCCL user-buffer registration through the allocator's trace entries (two GPUs).

    python3 gpu/probes/nccl_register.py native|native-expandable|cca [CONFIG] [flip]

With TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, ProcessGroupNCCL registers every segment
of the allocator's snapshot with each new communicator, then registers a segment on every
SEGMENT_ALLOC trace entry and deregisters it on every SEGMENT_FREE (ProcessGroupNCCL.cpp,
cacheAllocatorRegisterHook / cacheAllocatorDeregisterHook); under expandable segments it leaves
the hook off (shouldAllCommunicatorsRegisterAllTensors). Before the package sent segment entries,
its snapshot's segments were registered and never deregistered, and no later segment was
registered.

Each rank records PyTorch's memory history, allocates before the communicator exists (so the
snapshot registration sees it), all-reduces, then frees everything, empties the cache and
all-reduces fresh tensors of other sizes, twelve rounds, checking every result. NCCL writes its
REG log to a file per rank (NCCL_DEBUG_FILE). The check, per rank:

* every all-reduce result is right;
* the history's segment entries are consistent: each segment_free names a segment allocated
  earlier (or in the snapshot before the communicator), each segment_alloc is freed later or
  still in the final snapshot;
* every buffer NCCL registered is a segment of the snapshot taken at the communicator's
  creation or of a segment_alloc entry (so each will see its segment_free);
* with expandable segments (native-expandable, the package's default) NCCL registered nothing,
  as PyTorch turns the hook off there; otherwise it registered the segments made later too.

With `flip` (the package only), each rank first asks PyTorch for the opposite of what the
allocator does (`torch.cuda.memory._set_allocator_settings('expandable_segments:False')` under
the default): the package must warn that it did not apply it and keep PyTorch's setting at what
it does, so that registration still follows the allocator's real segments.

Prints one line per rank, "PASS ..." or "FAIL ...", and exits 0 only if both ranks pass.
"""
import glob
import os
import re
import sys
import tempfile

import torch as T
import torch.distributed as dist
import torch.multiprocessing as mp

args = [a for a in sys.argv[1:] if a != "flip"]
flip = "flip" in sys.argv[1:]
who = args[0]
cfg = args[1] if len(args) > 1 else None


def rank_main(rank, init_file, results):
    if who == "cca":
        import cuda_caching_allocator.torch as C

        C.enable(config=cfg, route="shim")
    T.cuda.set_device(rank)
    dev = T.device("cuda", rank)
    warned = None
    if flip:
        import warnings

        opposite = "expandable_segments:True" if cfg and "cca_preset:pytorch" in cfg else "expandable_segments:False"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            T.cuda.memory._set_allocator_settings(opposite)
        warned = any("cuda_caching_allocator" in str(m.message) and "expandable_segments"
                     in str(m.message) for m in w)
    shim = C._state["shim"] if who == "cca" else None
    T.cuda.memory._record_memory_history(max_entries=200000)
    first = T.full((16 << 20,), float(rank + 1), device=dev)
    at_init = [(s["address"], s["total_size"]) for s in T.cuda.memory._snapshot()["segments"]]
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=2, device_id=dev
    )
    bad = []
    dist.all_reduce(first)
    T.cuda.synchronize()
    if not bool((first == 3).all().item()):
        bad.append("first")
    del first
    sizes = [(3 << 20) + 17, 12 << 20, 40 << 20, (5 << 20) + 3, 64 << 20, 1 << 20]
    for r in range(12):
        T.cuda.synchronize()
        T.cuda.empty_cache()
        n = sizes[r % len(sizes)]
        pad = T.empty(sizes[(r + 2) % len(sizes)] // 2, device=dev)  # shifts later addresses
        xs = [T.full((n,), float((rank + 1) * (i + 1)), device=dev) for i in range(3)]
        for x in xs:
            dist.all_reduce(x)
        T.cuda.synchronize()
        for i, x in enumerate(xs):
            want = 3.0 * (i + 1)
            if not bool((x == want).all().item()):
                bad.append(f"round {r} tensor {i}: {x.min().item()}..{x.max().item()} != {want}")
        del xs, pad
    snap = T.cuda.memory._snapshot()
    entries = [e for tr in snap["device_traces"] for e in tr if e["action"].startswith("segment")]
    final = [(s["address"], s["total_size"]) for s in snap["segments"]]
    try:
        from torch.cuda import _memory_viz

        _memory_viz.trace_plot(snap)
        viz = "drawn"
    except Exception as e:  # noqa: BLE001
        viz = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    results[rank] = {
        "bad": bad,
        "at_init": at_init,
        "final": final,
        "entries": [(e["action"], e["addr"], e["size"]) for e in entries],
        "viz": viz,
        "warned": warned,
        # PyTorch's own expandable_segments, which ProcessGroupNCCL read (the shim reads it).
        "settings": shim.pytorch_expandable() if shim else "?",
    }


def check(rank, res, registered, expandable):
    problems = list(res["bad"])
    # The history was on before the first allocation: every segment shows in the entries.
    live = {}
    known = set(res["at_init"])
    counts = {}
    for action, addr, size in res["entries"]:
        counts[action] = counts.get(action, 0) + 1
        if action == "segment_alloc":
            if addr in live:
                problems.append(f"segment_alloc of {addr:#x}, already live")
            live[addr] = size
            known.add((addr, size))
        elif action == "segment_free":
            if live.pop(addr, None) != size:
                problems.append(f"segment_free of {addr:#x} + {size}, not a live segment")
    for addr, size in live.items():
        if (addr, size) not in res["final"]:
            problems.append(f"segment {addr:#x} + {size} allocated, never freed, not in the snapshot")
    for addr, size in registered:
        if (addr, size) not in known:
            problems.append(f"NCCL registered {addr:#x} + {size}: no segment of the allocator's")
    if expandable and registered:
        problems.append(f"{len(registered)} registrations under expandable segments (hook not off)")
    if not expandable and len(registered) <= 1:
        problems.append(f"only {len(registered)} registrations: later segments were not registered")
    if flip and not res["warned"]:
        problems.append("no warning that expandable_segments was not applied")
    if res["settings"] != "?" and res["settings"] != expandable:
        problems.append(f"PyTorch's expandable_segments {res['settings']}, the allocator's {expandable}")
    if res["viz"] != "drawn":
        problems.append(f"_memory_viz.trace_plot: {res['viz']}")
    what = (
        f"{len(registered)} registered, entries {counts}, PyTorch's expandable_segments "
        f"{res['settings']}"
    )
    return problems, what


if __name__ == "__main__":
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    if who == "native-expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "REG"
    with tempfile.TemporaryDirectory() as d:
        os.environ["NCCL_DEBUG_FILE"] = os.path.join(d, "nccl.%p")
        mgr = mp.Manager()
        results = mgr.dict()
        mp.spawn(rank_main, args=(os.path.join(d, "init"), results), nprocs=2, join=True)
        regs = {0: [], 1: []}
        pat = re.compile(r"\[(\d)\] NCCL INFO register comm \S+ buffer (0x[0-9a-f]+) size (\d+)")
        for path in glob.glob(os.path.join(d, "nccl.*")):
            with open(path) as f:
                for line in f:
                    m = pat.search(line)
                    if m:
                        regs[int(m.group(1))].append((int(m.group(2), 16), int(m.group(3))))
        expandable = who == "native-expandable" or (
            who == "cca" and (cfg is None or "cca_preset:pytorch" not in cfg)
        )
        ok = True
        for rank in range(2):
            res = results.get(rank)
            if res is None:
                problems, what = ["no result"], ""
            else:
                problems, what = check(rank, res, regs[rank], expandable)
            ok = ok and not problems
            print(
                ("PASS " if not problems else "FAIL ")
                + f"nccl_register {who} {cfg or ''}{' flip' if flip else ''} rank {rank}: {what}"
                + (f"; {problems[:4]}" if problems else ""),
                flush=True,
            )
    sys.exit(0 if ok else 1)
