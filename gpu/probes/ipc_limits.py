"""Resource limits of CUDA IPC (torch.multiprocessing) under the package's default configuration.

    python3 gpu/probes/ipc_limits.py failed_share_fds ARM [nolimit]
    python3 gpu/probes/ipc_limits.py native_consumer_va PRODUCER [N]

ARM / PRODUCER: `native` (PyTorch's allocator), `native-expandable` (PyTorch's allocator with
`expandable_segments:True`) or `cca` (the package's shim, crate default configuration).

failed_share_fds: one process. A 1 GiB tensor (512 of the default's 2 MiB pages) is shared
(`_share_cuda_`) under a descriptor limit 64 above what the process has open, so exporting its
pages runs out of descriptors part-way and the share fails. The tensor is then freed. The
descriptors the failed share opened must not outlive it: the check counts /proc/self/fd after the
free, and tries to open a file while the low limit still holds. With `nolimit` (the control: the
trigger removed) the share succeeds, the probe counts the descriptors held while it is shared
(one per page under the default), lets go of the share (its IPC reference counter, then
`torch.cuda.ipc_collect`) and counts again after the free. `native` shares the segment with
cudaIpcGetMemHandle, without descriptors. (`native-expandable` is no control here: its 52 pages of
20 MiB fit under the limit, and PyTorch keeps a page's descriptor until it unmaps the page.)

native_consumer_va: N (default 1500) tensors of 3 MiB, each on pages of its own under the
default, go through a queue in batches of 50 to a spawned consumer on PyTorch's own allocator,
which keeps every one of them. PyTorch 2.11 opens each distinct 'e' handle as an expandable
segment reserving address space for 9/8 of the device's memory (ExpandableSegment::fromShared,
pytorch/pytorch#186213); the x86-64 user address space of 128 TiB then holds about 880 of them on
an H200. The check: the consumer opens all N. `native` (cudaMalloc segments, 'c' handles: a few
hundred segments opened once each) and `native-expandable` (20 MiB pages: five such tensors per
page, one handle each page) are the controls.

Each prints one "PASS ..." or "FAIL ..." line and exits non-zero on FAIL.
"""
import os
import resource
import sys

probe, arm = sys.argv[1], sys.argv[2]
if arm == "native-expandable":  # before torch reads it; a spawned child inherits it
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch as T
import torch.multiprocessing as mp


def enable(who):
    if who == "cca":
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import cuda_caching_allocator.torch as C

        C.enable(config=None, route="shim")  # the crate's default configuration


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def failed_share_fds(nolimit):
    enable(arm)
    t = T.ones(1 << 30, dtype=T.uint8, device="cuda")
    T.cuda.synchronize()
    base = open_fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not nolimit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (base + 64, hard))
    shared, why, held, can_open = None, "", 0, True
    try:
        shared = t.untyped_storage()._share_cuda_()
        held = open_fds() - base
    except RuntimeError as e:
        why = str(e).splitlines()[0][:160]
    if shared is not None:
        # No consumer will take it: let go of the IPC reference the share took, as one would.
        T.UntypedStorage._release_ipc_counter_cuda(shared[4], shared[5])
    del t
    T.cuda.synchronize()
    T.cuda.ipc_collect()
    left = open_fds() - base
    try:
        os.close(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        can_open = False
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    ok = left <= 2 and can_open
    what = ("shared, %d descriptors held while shared" % held) if shared is not None else (
        "share refused (%s)" % why)
    print(("PASS " if ok else "FAIL ") + f"failed_share_fds {arm}{' nolimit' if nolimit else ''}: "
          f"{what}; {left} descriptors still open after the tensor was freed; opening a file "
          f"{'worked' if can_open else 'failed (the process is at its descriptor limit)'}",
          flush=True)
    return ok


def consume(q, back):
    held, opened, err = [], 0, ""
    while True:
        try:
            item = q.get()
        except Exception as e:  # a tensor of the batch could not be opened
            err = str(e).splitlines()[0][:200]
            back.put((opened, err))
            break
        if item is None:
            back.put((opened, err))
            break
        held.extend(item)
        opened += len(item)
        back.put((opened, err))
    T.cuda.synchronize()
    del held


def native_consumer_va(n):
    enable(arm)
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q, back))
    p.start()
    keep, opened, err, sent = [], 0, "", 0
    while sent < n:
        batch = [T.full((3 << 18,), float(sent + i), device="cuda") for i in range(min(50, n - sent))]
        T.cuda.synchronize()
        keep.extend(batch)
        q.put(batch)
        sent += len(batch)
        opened, err = back.get(timeout=120)
        if err:
            break
    if not err:
        q.put(None)
        opened, err = back.get(timeout=120)
    p.join(60)
    ok = opened == n and not err and p.exitcode == 0
    print(("PASS " if ok else "FAIL ") + f"native_consumer_va {arm} -> native: the consumer opened "
          f"{opened} of {n} shared 3 MiB tensors (sent {sent}){'; ' + err if err else ''}; "
          f"consumer exit {p.exitcode}", flush=True)
    return ok


if __name__ == "__main__":
    if probe == "failed_share_fds":
        ok = failed_share_fds(len(sys.argv) > 3 and sys.argv[3] == "nolimit")
    elif probe == "native_consumer_va":
        ok = native_consumer_va(int(sys.argv[3]) if len(sys.argv) > 3 else 1500)
    else:
        sys.exit(f"unknown probe {probe}")
    sys.exit(0 if ok else 1)
