#!/usr/bin/env python3
"""PyTorch as a real client of cuda-caching-allocator.

Trains a small GPT-2 (transformers, random weights, fixed seeds, bf16 autocast) for a few steps,
with PyTorch's native caching allocator (default and expandable_segments:True) and, each in a
separate process, with this crate's allocator loaded through
torch.cuda.memory.CUDAPluggableAllocator (its `pytorch` preset and its default configuration);
then compares the losses (bf16 tolerance), the peak reserved memory and the step time.

  python3 torch_client.py --so path/to/libcca_torch.so [--json out.json]   # both, compared
  python3 torch_client.py --mode native|cca --so ...                           # one run
  CCA_CLIENT_PACKAGE=1 python3 torch_client.py --so ...   # cca runs through the installed package

Needs torch and transformers; no network (the model is built from a config).
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time


def run_one(args):
    import torch

    lib = None
    if args.mode == "cca" and os.environ.get("CCA_CLIENT_PACKAGE"):
        # Through the installed package (the C++ shim route unless no compiler is present); the
        # configuration comes from CUDA_CACHING_ALLOCATOR_CONF as set by compare().
        import cuda_caching_allocator.torch as cca
        cca.enable(library=args.so)
        lib = cca.library()
        print(f"package route: {cca.route()}")
    elif args.mode == "cca":
        # Must happen before the first CUDA allocation of the process.
        alloc = torch.cuda.memory.CUDAPluggableAllocator(args.so, "cca_alloc", "cca_free")
        torch.cuda.memory.change_current_allocator(alloc)
        lib = ctypes.CDLL(args.so)  # the same loaded library: same registry, same statistics
        lib.cca_memory_stat.restype = ctypes.c_int64
        lib.cca_memory_stat.argtypes = [ctypes.c_int, ctypes.c_char_p]

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)

    config = GPT2Config(
        n_layer=args.layers, n_embd=args.embd, n_head=args.heads, n_positions=args.seq,
        vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    # Learnable synthetic data: a few fixed batches over a small slice of the vocabulary, cycled,
    # so the loss falls clearly within a few steps (uniform random tokens would not be learnable).
    gen = torch.Generator().manual_seed(args.seed + 1)
    distinct = [torch.randint(0, 512, (args.batch, args.seq), generator=gen) for _ in range(4)]
    batches = [distinct[i % len(distinct)] for i in range(args.steps)]

    losses, times = [], []
    for step, tokens in enumerate(batches):
        tokens = tokens.cuda(non_blocking=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()  # synchronizes
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        del out, tokens

    result = {
        "mode": args.mode,
        "losses": losses,
        "step_ms_median": 1000 * statistics.median(times[args.warmup:]),
        "step_ms_all": [1000 * t for t in times],
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if args.mode == "native":
        s = torch.cuda.memory_stats()
        stat = lambda key: s.get(key)
    else:
        stat = lambda key: lib.cca_memory_stat(0, key.encode())
    result["peak_reserved_bytes"] = stat("reserved_bytes.all.peak")
    result["peak_allocated_bytes"] = stat("allocated_bytes.all.peak")
    result["num_device_alloc"] = stat("num_device_alloc")
    result["num_alloc_retries"] = stat("num_alloc_retries")
    result["allocs_per_step"] = stat("allocation.all.allocated") / args.steps
    if args.mode == "cca":
        # Host cost of our allocate + free (cache hits), from native code, on torch's stream.
        lib.cca_bench_alloc_free.restype = ctypes.c_double
        lib.cca_bench_alloc_free.argtypes = [ctypes.c_int, ctypes.c_ssize_t, ctypes.c_void_p,
                                             ctypes.c_int, ctypes.c_int]
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for size in (4096, 1 << 20, 64 << 20):
            for path, name in ((0, "raw"), (1, "core")):
                result[f"alloc_free_ns_{name}_{size}"] = lib.cca_bench_alloc_free(0, size, stream, 200000, path)
        lib.cca_print_summary(0)
    print("RESULT " + json.dumps(result))


RUNS = [
    # (label, --mode, environment changes)
    ("native", "native", {}),
    ("native-expandable", "native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("cca-pytorch", "cca", {"CUDA_CACHING_ALLOCATOR_CONF": "cca_preset:pytorch"}),
    ("cca-default", "cca", {}),
]


def compare(args):
    results = {}
    for label, mode, env_changes in RUNS:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode] + [
            f"--{k}={v}" for k, v in (("so", args.so), ("layers", args.layers), ("embd", args.embd),
                                      ("heads", args.heads), ("batch", args.batch), ("seq", args.seq),
                                      ("steps", args.steps), ("warmup", args.warmup), ("seed", args.seed))]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_CACHING_ALLOCATOR_CONF")}
        env.update(env_changes)
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr[-6000:])
        if proc.returncode != 0:
            print(f"{label} run failed with {proc.returncode}")
            return 1
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
        results[label] = json.loads(line[len("RESULT "):])
        results[label]["process_s"] = time.time() - t0

    n = results["native"]
    gib = 1 << 30
    lines = [
        f"GPT-2 {args.layers} layers, n_embd {args.embd}, {n['params_m']:.1f}M params, batch {args.batch} x seq {args.seq}, "
        f"{args.steps} AdamW steps, bf16 autocast, seed {args.seed}",
        f"{'run':<18} {'first loss':>10} {'last loss':>10} {'max rel diff':>12} {'peak reserved':>14} "
        f"{'peak alloc':>11} {'dev allocs':>10} {'step ms':>8}",
    ]
    ok = True
    for label, _, _ in RUNS:
        c = results[label]
        rel = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(n["losses"], c["losses"]))
        good = rel <= args.rtol and c["losses"][-1] < 0.8 * c["losses"][0]
        ok = ok and good
        c["max_rel_loss_diff"] = rel
        lines.append(
            f"{label:<18} {c['losses'][0]:>10.4f} {c['losses'][-1]:>10.4f} {rel:>12.3g} "
            f"{c['peak_reserved_bytes'] / gib:>10.3f} GiB {c['peak_allocated_bytes'] / gib:>7.3f} GiB "
            f"{c['num_device_alloc']:>10} {c['step_ms_median']:>8.2f}" + ("" if good else "  MISMATCH"))
    lines.append(f"losses {'MATCH' if ok else 'MISMATCH'} (relative tolerance {args.rtol}); "
                 f"allocations per step {n['allocs_per_step']:.0f}")
    c = results["cca-default"]
    lines.append("our alloc+free host cost (ns, cache hit, default config; raw API / core only): " + ", ".join(
        f"{size >> 10} KiB {c[f'alloc_free_ns_raw_{size}']:.0f}/{c[f'alloc_free_ns_core_{size}']:.0f}"
        for size in (4096, 1 << 20, 64 << 20)))
    print("\n".join(["== PyTorch comparison =="] + lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": lines, "match": ok, "runs": results}, f, indent=1)
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["native", "cca"], help="one run; without it, both and compare")
    p.add_argument("--so", required=True, help="path to libcca_torch.so (the package's native library, staged by gpu/build.sh)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rtol", type=float, default=2e-2, help="relative loss tolerance (bf16)")
    p.add_argument("--json", help="write the comparison here")
    args = p.parse_args()
    args.so = os.path.abspath(args.so)
    if args.mode:
        run_one(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
