"""What sharing one CUDA tensor between processes costs (torch.multiprocessing, CUDA IPC).

    python3 gpu/probes/ipc_cost.py ALLOCATOR [MIB]

ALLOCATOR is `native`, `native-expandable` or `cca` (default configuration) / `cca-preset`
(`cca_preset:pytorch`). A tensor of MIB MiB (default 1024) is shared twice: the wall time of
`Storage._share_cuda_()` in the producer, first and second time (a page's descriptor is exported
once), and of the consumer's `queue.get()` (opening the handle: for expandable pages, taking each
page's descriptor and mapping it), first tensor and a second tensor on the same memory. Prints one
line `ipc_cost ALLOCATOR MIB: share first / again ms, open first / again ms`.
"""
import os
import sys
import time

who = sys.argv[1]
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
if who == "native-expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch as T
import torch.multiprocessing as mp


def enable(who):
    if who.startswith("cca"):
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import cuda_caching_allocator.torch as C

        C.enable(config="cca_preset:pytorch" if who == "cca-preset" else None, route="shim")


def consume(q, back, who):
    enable(who)
    T.zeros(1, device="cuda")
    got = []
    for _ in range(2):
        t0 = time.perf_counter()
        t = q.get()
        got.append(t)
        back.put(time.perf_counter() - t0)
    T.cuda.synchronize()
    ok = all(float(t[-1]) == 7.0 for t in got)
    back.put(ok)
    del got, t
    q.get()


if __name__ == "__main__":
    enable(who)
    ctx = mp.get_context("spawn")
    x = T.full((mib << 18,), 7.0, device="cuda")
    y = x[1:]  # a second tensor on the same storage
    st = x.untyped_storage()
    t0 = time.perf_counter()
    st._share_cuda_()
    share1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    st._share_cuda_()
    share2 = time.perf_counter() - t0
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q, back, who))
    p.start()
    q.put(x)
    open1 = back.get(timeout=300)
    q.put(y)
    open2 = back.get(timeout=300)
    ok = back.get(timeout=300)
    q.put(None)
    p.join(120)
    print(f"{'PASS' if ok else 'FAIL'} ipc_cost {who} {mib} MiB: share {share1 * 1e3:.1f} / again "
          f"{share2 * 1e3:.1f} ms, open {open1 * 1e3:.1f} / again {open2 * 1e3:.1f} ms", flush=True)
