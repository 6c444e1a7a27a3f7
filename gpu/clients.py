#!/usr/bin/env python3
"""The real-client suite of #11: PyTorch workloads run, each allocator in its own process, side by
side in one call — PyTorch native, native with expandable segments, and this crate's allocator
(installed by `cuda_caching_allocator.torch.enable`) under its `pytorch` preset and its default.

Workloads (random-weight GPT-2 models from transformers configs; no network):
  sidestream  training whose next batch is copied on a side stream and handed over with
              `record_stream`, variable sequence length
  generate    `generate()` with varying batch size and prompt length (greedy)
  ckpt        activation-checkpointed training with a sequence length drawn anew each step
  ddp         DistributedDataParallel over NCCL on every visible GPU (2 or more), varlen
  fsdp        FSDP2 (`fully_shard`) over NCCL on every visible GPU, varlen

Per run: median step time after warm-up, peak reserved and allocated bytes, device allocations,
losses (checked against native's within bf16 tolerance). Prints one table per workload and writes
every run as JSON.

    python3 clients.py --python-dir gpu-bin/python --library gpu-bin/libcca_torch.so \
        --workloads sidestream generate ckpt [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALLOCATORS = [
    # (label, environment, cca config or None for native)
    ("native", {}, None),
    ("cca-default", {}, "cca_preset:default"),
    ("native-expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    ("cca-pytorch", {}, "cca_preset:pytorch"),
]


def setup(args):
    """Installs the allocator (cca runs) before CUDA is touched; returns a stat reader."""
    import torch

    if args.cca_config is not None:
        sys.path.insert(0, args.python_dir)
        from cuda_caching_allocator import torch as cca

        cca.enable(config=args.cca_config, library=args.library)

        def stat(key, device=0):
            return cca.stat(key, device)

        route = cca.route()
    else:

        def stat(key, device=0):
            return torch.cuda.memory_stats(device).get(key, 0)

        route = "native"
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch, stat, route


def gpt2(torch, layers, embd, heads, seq, seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, n_positions=seq, vocab_size=50257,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def lengths(seed, n, lo, hi):
    import random

    r = random.Random(seed)
    return [r.randrange(lo, hi + 1, 8) for _ in range(n)]


def train_loop(torch, model, opt, steps, batch, seqs, side_stream, rank=0):
    """Training steps with bf16 autocast; the next batch optionally prefetched on a side stream."""
    gen = torch.Generator().manual_seed(7 + rank)
    host = [torch.randint(0, 512, (batch, s), generator=gen).pin_memory() for s in seqs[:steps]]
    side = torch.cuda.Stream() if side_stream else None
    main = torch.cuda.current_stream()
    losses, times = [], []

    def fetch(i):
        if side is None:
            return host[i].cuda(non_blocking=True)
        with torch.cuda.stream(side):
            x = host[i].cuda(non_blocking=True)
        return x

    nxt = fetch(0)
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if side is not None:
            main.wait_stream(side)
            nxt.record_stream(main)
        tokens = nxt
        if i + 1 < steps:
            nxt = fetch(i + 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out, tokens
    return losses, times


def run_one(args):
    torch, stat, route = setup(args)
    if args.record:
        # PyTorch's own history of every allocation and free (no stack context: the replay needs
        # sizes, streams and order only), dumped as a snapshot pickle at the end.
        torch.cuda.memory._record_memory_history(context=None, max_entries=20_000_000)
    res = {"workload": args.workload, "route": route}
    w = args.workload
    if w in ("sidestream", "ckpt"):
        model = gpt2(torch, args.layers, 768, 12, 1024, args.seed).cuda().train()
        if w == "ckpt":
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        seqs = lengths(args.seed, args.steps, 128, 1024)
        losses, times = train_loop(torch, model, opt, args.steps, args.batch, seqs, w == "sidestream")
    elif w == "generate":
        model = gpt2(torch, args.layers, 768, 12, 1024, args.seed).cuda().eval().to(torch.bfloat16)
        r = lengths(args.seed, args.steps, 16, 512)
        bs = [1 + (x // 8) % 16 for x in lengths(args.seed + 1, args.steps, 8, 1024)]
        gen = torch.Generator().manual_seed(3)
        losses, times = [], []
        with torch.no_grad():
            for i in range(args.steps):
                prompt = torch.randint(0, 512, (bs[i], r[i]), generator=gen).cuda()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                     attention_mask=torch.ones_like(prompt))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(out[:, -32:].float().sum().item()))
                del out, prompt
        res["total_s"] = sum(times)
    else:
        raise SystemExit(f"unknown workload {w}")
    res.update(losses=losses, step_ms_median=1000 * statistics.median(times[args.warmup:]),
               step_ms=[1000 * t for t in times],
               peak_reserved_bytes=stat("reserved_bytes.all.peak"),
               peak_allocated_bytes=stat("allocated_bytes.all.peak"),
               num_device_alloc=stat("num_device_alloc"),
               num_device_free=stat("num_device_free"),
               num_sync_all_streams=stat("num_sync_all_streams"))
    if args.record:
        path = os.path.join(args.record, f"{args.workload}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        res["recorded"] = path
    print("RESULT " + json.dumps(res), flush=True)


def dist_worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # The allocator first: torch.cuda.set_device initializes PyTorch's allocator, after which
    # it can no longer be swapped.
    torch, stat, route = setup(args)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    model = gpt2(torch, args.layers, 768, 12, 1024, args.seed).cuda().train()
    if args.workload == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    seqs = lengths(args.seed + rank, args.steps, 128, 1024)
    losses, times = train_loop(torch, model, opt, args.steps, args.batch, seqs, False, rank)
    res = {"workload": args.workload, "route": route, "rank": rank, "losses": losses,
           "step_ms_median": 1000 * statistics.median(times[args.warmup:]),
           "step_ms": [1000 * t for t in times],
           "peak_reserved_bytes": stat("reserved_bytes.all.peak", rank),
           "peak_allocated_bytes": stat("allocated_bytes.all.peak", rank),
           "num_device_alloc": stat("num_device_alloc", rank),
           "num_device_free": stat("num_device_free", rank),
           "num_sync_all_streams": stat("num_sync_all_streams", rank)}
    if rank == 0:
        print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def run_dist(args):
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    if world < 2:
        print("RESULT " + json.dumps({"skipped": f"{args.workload} needs 2 GPUs, {world} visible"}))
        return
    mp.spawn(dist_worker, args=(world, args), nprocs=world, join=True)


def compare(args):
    all_results = {}
    ok = True
    for w in args.workloads:
        rows = {}
        allocators = ALLOCATORS[:1] if args.record else ALLOCATORS
        for label, env_changes, cfg in allocators:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", w,
                   "--python-dir", args.python_dir,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
                   "--batch", str(args.batch), "--seed", str(args.seed), "--port", str(args.port)]
            if cfg is not None:
                cmd += ["--cca-config", cfg]
            if args.record:
                os.makedirs(args.record, exist_ok=True)
                cmd += ["--record", os.path.abspath(args.record)]
            if args.library:
                cmd += ["--library", args.library]
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_CACHING_ALLOCATOR_CONF")}
            env.update(env_changes)
            t0 = time.time()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                print(f"{w} {label}: FAILED rc={p.returncode}\n{p.stderr[-3000:]}", flush=True)
                ok = False
                continue
            rows[label] = json.loads(lines[-1][len("RESULT "):])
            rows[label]["process_s"] = time.time() - t0
            print(f"{w} {label}: {rows[label].get('step_ms_median', rows[label].get('skipped'))}",
                  file=sys.stderr, flush=True)
        all_results[w] = rows
        n = rows.get("native")
        if n is None or "skipped" in n:
            print(f"\n== {w}: {n.get('skipped') if n else 'native failed'}")
            continue
        gib = 1 << 30
        print(f"\n== {w} ({args.steps} steps, median after {args.warmup})")
        print("| allocator | route | median step ms | × native | peak reserved GiB | reserved / peak allocated | device allocs | max rel loss diff |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for label, _, _ in allocators:
            c = rows.get(label)
            if c is None:
                print(f"| {label} | failed | | | | | | |")
                continue
            rel = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(n["losses"], c["losses"]))
            good = rel <= args.rtol
            ok = ok and good
            c["max_rel_loss_diff"] = rel
            print(f"| {label} | {c['route']} | {c['step_ms_median']:.2f} | {c['step_ms_median'] / n['step_ms_median']:.3f} | "
                  f"{c['peak_reserved_bytes'] / gib:.3f} | {c['peak_reserved_bytes'] / max(c['peak_allocated_bytes'], 1):.4f} | "
                  f"{c['num_device_alloc']} | {rel:.2g}{'' if good else ' MISMATCH'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f)
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="*", default=["sidestream", "generate", "ckpt"])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--cca-config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--python-dir", required=True, help="folder holding the cuda_caching_allocator package")
    p.add_argument("--library", default=None, help="the native library (default: the package's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--rtol", type=float, default=3e-2)
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--json")
    p.add_argument("--record", metavar="DIR",
                   help="run only PyTorch native, recording each workload's allocation history as "
                        "DIR/<workload>.pickle (a snapshot cca replays)")
    args = p.parse_args()
    args.python_dir = os.path.abspath(args.python_dir)
    if args.library:
        args.library = os.path.abspath(args.library)
    if args.one:
        args.workload = args.one
        if args.one in ("ddp", "fsdp"):
            run_dist(args)
        else:
            run_one(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
