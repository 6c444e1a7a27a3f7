"""A free that switches devices must not make a context on a GPU the process never used.

    python3 gpu/probes/device_guard.py PRODUCER CONSUMER [CONFIG]

Needs two GPUs. PRODUCER and CONSUMER are as in cuda_ipc.py (`native`, `native-expandable`,
`cca`; CONFIG for `cca`, default the crate's default configuration). The producer shares a tensor
of GPU 1 through torch.multiprocessing; the consumer works on GPU 1 only (torch.cuda.set_device),
checks the tensor, and lets go of it in a fresh Python thread that never chose a device, so
that the release of the opened handle (cudaIpcCloseMemHandle, or the unmapping of imported
pages) switches to GPU 1 and back. In that thread the runtime's current device reads 0: putting
it back with cudaSetDevice(0) makes a primary context on GPU 0, some 500 MB of a GPU the process
never used, which PyTorch's CUDAGuard avoids (c10::cuda::MaybeSetDevice switches back only to a
device whose context exists). The consumer reads GPU 0's primary-context state from the driver
(cuDevicePrimaryCtxGetState) before it receives the tensor, after, and after the release.

Prints "PASS ..." or "FAIL ..." ("INCONCLUSIVE ..." when GPU 0's context existed before the
release, so that the release cannot be judged).
"""
import ctypes
import gc
import os
import sys
import threading

if "native-expandable" in sys.argv[1:3]:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch as T
import torch.multiprocessing as mp

producer, consumer = sys.argv[1], sys.argv[2]
cfg = sys.argv[3] if len(sys.argv) > 3 else None


def enable(who):
    if who == "cca":
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import cuda_caching_allocator.torch as C

        C.enable(config=cfg, route="shim")
    elif who == "native":
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def gpu0_context_active():
    """Whether this process holds an active primary context on GPU 0 (the driver's answer)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    flags, active = ctypes.c_uint(), ctypes.c_int()
    rc = cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
    assert rc == 0, f"cuDevicePrimaryCtxGetState: {rc}"
    return bool(active.value)


def consume(q, back, who):
    enable(who)
    T.cuda.set_device(1)
    before = gpu0_context_active()
    held = [q.get()]
    values_ok = T.equal(held[0], T.arange(held[0].numel(), device="cuda:1", dtype=T.float32))
    T.cuda.synchronize(1)
    received = gpu0_context_active()
    # The last reference goes in a thread that never chose a device.
    t = threading.Thread(target=held.clear)
    t.start()
    t.join()
    gc.collect()
    released = gpu0_context_active()
    back.put((values_ok, before, received, released))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    enable(producer)
    T.cuda.set_device(1)
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consume, args=(q, back, consumer))
    p.start()
    x = T.arange(3 << 20, device="cuda:1", dtype=T.float32)
    T.cuda.synchronize(1)
    q.put(x)
    values_ok, before, received, released = back.get(timeout=120)
    p.join(60)
    what = (f"device_guard {producer} -> {consumer} {cfg or ''}: values "
            f"{'equal' if values_ok else 'WRONG'}; the consumer's GPU 0 context active before "
            f"receiving {before}, after {received}, after the release in a fresh thread "
            f"{released}; consumer exit {p.exitcode}")
    if before or received:
        print("INCONCLUSIVE " + what, flush=True)
        sys.exit(1)
    ok = values_ok and not released and p.exitcode == 0
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    sys.exit(0 if ok else 1)
