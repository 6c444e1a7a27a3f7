"""CUDA tensors shared between processes through torch.multiprocessing (CUDA IPC).

    python3 gpu/probes/cuda_ipc.py PRODUCER CONSUMER [CONFIG]

PRODUCER and CONSUMER are `native` (PyTorch's allocator), `native-expandable` (PyTorch's
allocator with `expandable_segments:True`: its 'e' handles carry POSIX descriptors of the pages)
or `cca` (the package's shim, with CONFIG; default `cca_preset:pytorch`, whose 'c' handles name a
cudaMalloc segment; `default` for the crate's default configuration, whose 'e' handles carry the
descriptors of its 2 MiB pages). Fourteen tensors of different sizes (several from one segment
or page) go, one at a time, through a queue to a spawned consumer, which checks each holds
0..n-1 and doubles it in place; the producer then checks it sees the doubling, frees the tensor
and fills new allocations with a sentinel, and the consumer, still holding the tensor, checks it
was not overwritten (the producer's cache must not hand a shared block out while another process
holds it: PyTorch keeps the block allocated, CudaIPCSentData).

Then the blocks the producer freed while the consumer held them (PyTorch's CudaIPCSentDataLimbo)
must go back once the consumer has let go: PyTorch's allocator runs the free-memory callbacks
(cuda_ipc_collect) on a cache miss, so after the consumer exits one allocation that needs new
memory leaves the producer with only its live tensors allocated.

Prints "PASS ..." or "FAIL ...".
"""
import os
import sys

if sys.argv[1] == "native-expandable":  # before torch reads it; the spawned consumer inherits it
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch as T
import torch.multiprocessing as mp

producer, consumer = sys.argv[1], sys.argv[2]
cfg = sys.argv[3] if len(sys.argv) > 3 else "cca_preset:pytorch"
cfg = None if cfg == "default" else cfg  # the crate's default configuration


def enable(who):
    if who == "cca":
        # The package would read PyTorch's variable when given no configuration of its own.
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import cuda_caching_allocator.torch as C

        C.enable(config=cfg, route="shim")


def consume(q, back, who):
    enable(who)
    bad = 0
    held = None  # the previous tensor, kept while the producer frees its own and allocates more
    while True:
        item = q.get()
        if held is not None:
            # The producer has freed its reference and filled new allocations with a sentinel:
            # its cache must not have handed this still-shared block out again.
            if not T.equal(held, 2 * T.arange(held.numel(), device=held.device, dtype=held.dtype)):
                bad += 1
            held = None
        if item is None:
            break
        i, t = item
        want = T.arange(t.numel(), device=t.device, dtype=t.dtype)
        if not T.equal(t, want):
            bad += 1
        t.mul_(2)
        T.cuda.synchronize()
        held = t
        del t, want, item
        back.put((i, bad))
    back.put(("done", bad))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    enable(producer)
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q, back, consumer))
    p.start()
    bad = 0
    churn = []
    sizes = [1000, 1 << 20, 3 << 20, 777, 5 << 18, 1 << 22, 13 << 20] * 2
    for i, n in enumerate(sizes):
        t = T.arange(n, device="cuda", dtype=T.float32)
        q.put((i, t))
        j, _ = back.get(timeout=120)
        T.cuda.synchronize()
        if j != i or not T.equal(t, 2 * T.arange(n, device="cuda", dtype=T.float32)):
            bad += 1
        del t
        # Reuse pressure: blocks the cache hands out now are overwritten with a sentinel.
        churn = [T.full(((i + 1) << 18,), -7.0, device="cuda") for _ in range(3)]
        T.cuda.synchronize()
    q.put(None)  # the consumer re-checks the last tensor it holds, then stops
    _, consumer_bad = back.get(timeout=120)
    p.join(60)
    T.cuda.synchronize()
    live = sum((c.untyped_storage().nbytes() + 511) // 512 * 512 for c in churn)
    held = T.cuda.memory_allocated() - live  # blocks kept for the consumer, now gone
    big = T.empty(1 << 29, dtype=T.uint8, device="cuda")  # more than the cache has: a miss
    left = T.cuda.memory_allocated() - live - big.numel()
    del churn, big
    ok = bad == 0 and consumer_bad == 0 and p.exitcode == 0 and held > 0 and left == 0
    print(("PASS " if ok else "FAIL ") + f"cuda_ipc {producer} -> {consumer} {cfg}: "
          f"{bad} of {len(sizes)} doublings not seen by the producer, {consumer_bad} tensors wrong in the "
          f"consumer, consumer exit {p.exitcode}; shared blocks still allocated after the "
          f"consumer exited {held} bytes, after a miss {left}", flush=True)
    sys.exit(0 if ok else 1)
