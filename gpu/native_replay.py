#!/usr/bin/env python3
"""Replays an RMM-style CSV trace through PyTorch's own CUDA caching allocator, cold (#11).

The same trace `cca replay --device cuda` replays, through
`c10::cuda::CUDACachingAllocator::raw_alloc_with_stream` / `raw_delete` in a C++ loop (no Python
per event), in a fresh process so that the cache starts empty. Prints one JSON object: wall ns per
operation of the loop, peak reserved and allocated bytes, and the allocator's own device-call
counts. Set PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True) to replay another native
configuration.

    python3 native_replay.py TRACE.csv.gz [--build-dir DIR]

The C++ part is compiled once with the host compiler against the installed torch (no ninja, no
pybind11) and loaded with ctypes after `import torch` has loaded c10_cuda.
"""
import argparse
import ctypes
import gzip
import hashlib
import json
import os
import subprocess
import sys

import torch
import torch.utils.cpp_extension as ext

SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <chrono>
#include <cstdint>
#include <vector>

extern "C" int64_t cca_native_replay(const int64_t* ops, const int64_t* ids, const int64_t* sizes,
                                     int64_t n, int64_t nids, int64_t* live_out) {
  std::vector<void*> ptrs(nids, nullptr);
  cudaStream_t stream = c10::cuda::getDefaultCUDAStream().stream();
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; i++) {
    if (ops[i] == 0) {
      ptrs[ids[i]] = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(sizes[i], stream);
    } else if (ptrs[ids[i]] != nullptr) {
      c10::cuda::CUDACachingAllocator::raw_delete(ptrs[ids[i]]);
      ptrs[ids[i]] = nullptr;
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  int64_t live = 0;
  for (void* p : ptrs) {
    if (p != nullptr) {
      c10::cuda::CUDACachingAllocator::raw_delete(p);
      live++;
    }
  }
  *live_out = live;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
}
"""


def build(build_dir):
    """Compiles SOURCE into a shared library (cached by a hash of the source and torch version)."""
    os.makedirs(build_dir, exist_ok=True)
    key = hashlib.sha256((SOURCE + torch.__version__).encode()).hexdigest()[:12]
    lib = os.path.join(build_dir, f"native_replay_{key}.so")
    if os.path.exists(lib):
        return lib
    src = os.path.join(build_dir, f"native_replay_{key}.cpp")
    with open(src, "w") as f:
        f.write(SOURCE)
    abi = int(torch.compiled_with_cxx11_abi())
    cuda_home = ext.CUDA_HOME or "/usr/local/cuda"
    cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in ext.include_paths()] + [f"-I{cuda_home}/include"]
    cmd += [src, "-o", lib] + [f"-L{p}" for p in ext.library_paths()]
    cmd += ["-lc10", "-lc10_cuda", f"-Wl,-rpath,{ext.library_paths()[0]}"]
    subprocess.run(cmd, check=True)
    return lib


def load_trace(path):
    """(ops, ids, sizes) as lists: op 0 = allocate, 1 = free; ids number the allocations."""
    opener = gzip.open if path.endswith(".gz") else open
    ops, ids, sizes = [], [], []
    live = {}
    nid = 0
    with opener(path, "rt") as f:
        header = f.readline().strip().split(",")
        col = {name: i for i, name in enumerate(header)}
        for line in f:
            parts = line.rstrip("\n").split(",")
            action, ptr = parts[col["Action"]], parts[col["Pointer"]]
            if parts[col["Stream"]] not in ("0", ""):
                sys.exit(f"{path}: stream {parts[col['Stream']]}: this harness replays stream 0 only")
            if action == "allocate":
                live[ptr] = nid
                ops.append(0)
                ids.append(nid)
                sizes.append(int(parts[col["Size"]]))
                nid += 1
            elif action == "free" and ptr in live:
                ops.append(1)
                ids.append(live.pop(ptr))
                sizes.append(0)
    return ops, ids, sizes, nid


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--build-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cca-native-replay"))
    args = ap.parse_args()
    lib = ctypes.CDLL(build(args.build_dir))
    fn = lib.cca_native_replay
    fn.restype = ctypes.c_int64
    ops, ids, sizes, nid = load_trace(args.trace)
    n = len(ops)
    arr = ctypes.c_int64 * n
    a_ops, a_ids, a_sizes = arr(*ops), arr(*ids), arr(*sizes)
    live = ctypes.c_int64(0)
    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats()
    ns = fn(a_ops, a_ids, a_sizes, ctypes.c_int64(n), ctypes.c_int64(nid), ctypes.byref(live))
    stats = torch.cuda.memory_stats()
    out = {
        "trace": os.path.basename(args.trace),
        "allocator": "pytorch-native",
        "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "ops": n,
        "wall_ns_per_op": ns / max(n, 1),
        "peak_reserved_bytes": stats.get("reserved_bytes.all.peak", 0),
        "peak_allocated_bytes": stats.get("allocated_bytes.all.peak", 0),
        "num_device_alloc": stats.get("num_device_alloc", 0),
        "num_device_free": stats.get("num_device_free", 0),
        "num_sync_all_streams": stats.get("num_sync_all_streams", 0),
        "left_live": live.value,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
