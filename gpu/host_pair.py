#!/usr/bin/env python3
"""Host cost of an allocation and its free through PyTorch's own entry point
(`c10::cuda::CUDACachingAllocator::get()->allocate(n)`, the call every CUDA tensor makes, and the
`DataPtr`'s deleter), under PyTorch's native allocator and under this crate's (installed by
`cuda_caching_allocator.torch.enable`, shim route), each configuration in a fresh process,
interleaved over repeats (#11: what the allocator costs a PyTorch step on the host).

Patterns, ns per allocate + free pair:
  same      one thread; sizes cycle over a fixed list; each new allocation frees the one made
            `window` allocations before (a FIFO of live tensors, as a layer's activations)
  cross     one thread allocates a batch, a second thread frees it (as autograd's thread frees
            what the forward pass allocated), in turn
  clock     the cost of one `steady_clock::now()` on this host (what CCA_HOST_TIMING pays per
            read), for reading gpu/clients.py's host times

    python3 host_pair.py --python-dir DIR [--library LIB] [--reps 3] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [
    ("native", None),
    ("cca-default", "cca_preset:default"),
    ("cca-no-fast", "cca_preset:default,cca_fast_path:False"),
    ("cca-pytorch", "cca_preset:pytorch"),
]

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

using clk = std::chrono::steady_clock;

static double ns_since(clk::time_point t0) {
  return std::chrono::duration<double, std::nano>(clk::now() - t0).count();
}

double clock_ns(int64_t n) {
  auto t0 = clk::now();
  int64_t sink = 0;
  for (int64_t i = 0; i < n; ++i) sink += clk::now().time_since_epoch().count() & 1;
  double ns = ns_since(t0);
  return ns / n + (sink == -1 ? 1 : 0);
}

double same_thread(int64_t n, std::vector<int64_t> sizes, int64_t window) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  std::vector<c10::DataPtr> ring(window);
  size_t k = sizes.size();
  for (int64_t i = 0; i < 8 * window; ++i) ring[i % window] = a->allocate(sizes[i % k]);
  auto t0 = clk::now();
  for (int64_t i = 0; i < n; ++i) ring[i % window] = a->allocate(sizes[i % k]);
  double ns = ns_since(t0);
  ring.clear();
  return ns / n;
}

double cross_thread(int64_t rounds, std::vector<int64_t> sizes, int64_t batch) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  std::vector<c10::DataPtr> v(batch);
  std::atomic<int> turn{0};  // 0: the allocating thread's, 1: the freeing thread's, 2: stop
  std::thread freer([&] {
    for (;;) {
      int t;
      while ((t = turn.load(std::memory_order_acquire)) == 0) {}
      if (t == 2) return;
      for (auto& p : v) p.clear();
      turn.store(0, std::memory_order_release);
    }
  });
  size_t k = sizes.size();
  double ns = 0;
  for (int64_t r = -4; r < rounds; ++r) {  // 4 rounds of warm-up
    auto t0 = clk::now();
    for (int64_t i = 0; i < batch; ++i) v[i] = a->allocate(sizes[(r * batch + i + 64) % k]);
    turn.store(1, std::memory_order_release);
    while (turn.load(std::memory_order_acquire) != 0) {}
    if (r >= 0) ns += ns_since(t0);
  }
  turn.store(2, std::memory_order_release);
  freer.join();
  return ns / (rounds * batch);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("clock_ns", &clock_ns);
  m.def("same_thread", &same_thread);
  m.def("cross_thread", &cross_thread);
}
"""

# Sizes of a transformer step's tensors (bytes): biases and norms, activations, weights, logits.
SIZES = [3072, 1 << 20, 2359296, 4718592, 6291456, 9437184, 512, 25165824, 12582912, 3072,
         786432, 100663296, 2359296, 49152, 6291456, 37748736]


def one(args):
    import torch
    from torch.utils import cpp_extension

    if args.cca_config is not None:
        sys.path.insert(0, args.python_dir)
        from cuda_caching_allocator import torch as cca

        cca.enable(config=args.cca_config, library=args.library, route="shim")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ext = cpp_extension.load_inline(name="cca_host_pair", cpp_sources=[SOURCE], with_cuda=True,
                                    build_directory=args.build_dir, extra_cflags=["-O2"])
    res = {"clock_ns": ext.clock_ns(1_000_000)}
    res["same_ns"] = statistics.median(ext.same_thread(200_000, SIZES, 8) for _ in range(5))
    res["cross_ns"] = statistics.median(ext.cross_thread(2_000, SIZES, 64) for _ in range(5))
    print("RESULT " + json.dumps(res), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python-dir", required=True)
    p.add_argument("--library", default=None)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--cca-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build-dir", default="/tmp/cca-host-pair-build")
    args = p.parse_args()
    args.python_dir = os.path.abspath(args.python_dir)
    os.makedirs(args.build_dir, exist_ok=True)
    if args.one:
        one(args)
        return 0
    runs = {label: [] for label, _ in CONFIGS}
    ok = True
    for k in range(args.reps):
        order = CONFIGS[k % len(CONFIGS):] + CONFIGS[:k % len(CONFIGS)]
        for label, cfg in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", "--python-dir",
                   args.python_dir, "--build-dir", args.build_dir]
            if cfg is not None:
                cmd += ["--cca-config", cfg]
            if args.library:
                cmd += ["--library", os.path.abspath(args.library)]
            env = {k2: v for k2, v in os.environ.items() if k2 != "CCA_HOST_TIMING"}
            p2 = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            lines = [l for l in p2.stdout.splitlines() if l.startswith("RESULT ")]
            if p2.returncode != 0 or not lines:
                print(f"{label}: FAILED rc={p2.returncode}\n{p2.stderr[-2000:]}", flush=True)
                ok = False
                continue
            r = json.loads(lines[-1][len("RESULT "):])
            print(f"{label} rep {k}: {r}", file=sys.stderr, flush=True)
            runs[label].append(r)
    print("| configuration | same thread, ns per pair | cross thread, ns per pair | "
          "steady_clock::now, ns |")
    print("|---|---:|---:|---:|")
    for label, _ in CONFIGS:
        rs = runs[label]
        if not rs:
            print(f"| {label} | failed | | |")
            continue

        def fmt(key):
            xs = [r[key] for r in rs]
            return f"{statistics.median(xs):.0f} ({min(xs):.0f}–{max(xs):.0f})"

        print(f"| {label} | {fmt('same_ns')} | {fmt('cross_ns')} | {fmt('clock_ns')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
