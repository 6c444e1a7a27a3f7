"""PyTorch's own caching host allocator on the mixed-size pinned workload of the crate (issue #16).

Runs the workload of `cuda_caching_allocator::host::mixed_workload(42, 4000, 48, 64 MiB)` (the
generator is ported below, step for step: the peak requested it prints must match the Rust
figure, 447.4 MiB) through `torch.empty(n, dtype=torch.uint8, pin_memory=True)`, and reports what
PyTorch pinned: `torch.cuda.host_memory_stats()` where this PyTorch has it (its byte and time
entries, printed as they are), and the same power-of-two count the crate's `PowerOfTwoModel`
makes, for comparison with `examples/pinned_bench.rs` (`bash gpu-bin/run.sh pinned`).

    python3 gpu/pinned_torch.py [--json FILE]
"""

import argparse
import json
import sys
import time

MIB = 1 << 20
MASK = (1 << 64) - 1


def mixed_workload(seed, steps, slots, max_size):
    """The crate's `mixed_workload`: xorshift64* sizes, log-uniform 4 KiB .. max_size."""
    state = seed | 1

    def nxt():
        nonlocal state
        state ^= state >> 12
        state = (state ^ (state << 25)) & MASK
        state ^= state >> 27
        return (state * 0x2545F4914F6CDD1D) & MASK

    slots = max(slots, 1)
    lo = 12
    hi = max(max(max_size, 8192).bit_length() - 1, lo + 1)
    live = [False] * slots
    ops = []
    for _ in range(steps):
        r = nxt()
        slot = r % slots
        if live[slot] and r & (1 << 40):
            ops.append(("free", slot, 0))
            live[slot] = False
            continue
        bits = lo + nxt() % (hi - lo)
        base = 1 << bits
        size = min(base + nxt() % base, max(max_size, 4096))
        ops.append(("alloc", slot, size))
        live[slot] = True
    for slot, held in enumerate(live):
        if held:
            ops.append(("free", slot, 0))
    return ops


def pow2_model(ops):
    """The crate's PowerOfTwoModel: round up to a power of two, reuse exact sizes, never split."""
    free, pinned, pins, held = {}, 0, 0, {}
    for kind, slot, size in ops:
        if slot in held:
            r = held.pop(slot)
            free[r] = free.get(r, 0) + 1
        if kind == "alloc":
            r = 1 << max(size - 1, 0).bit_length()
            if free.get(r, 0) > 0:
                free[r] -= 1
            else:
                pinned += r
                pins += 1
            held[slot] = r
    return pinned, pins


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    import torch

    ops = mixed_workload(42, 4000, 48, 64 * MIB)
    requested = peak = 0
    held = {}  # peak requested, as the Rust harness counts it
    for kind, slot, size in ops:
        if slot in held:
            requested -= held.pop(slot)
        if kind == "alloc":
            held[slot] = size
            requested += size
            peak = max(peak, requested)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    print(f"workload: {len(ops)} ops, peak requested {peak / MIB:.1f} MiB")
    has_stats = hasattr(torch.cuda, "host_memory_stats")
    if not has_stats:
        print("torch.cuda.host_memory_stats is not available in this PyTorch")
    torch.cuda.init()
    if has_stats and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    tensors = {}
    t0 = time.perf_counter()
    for kind, slot, size in ops:
        tensors.pop(slot, None)
        if kind == "alloc":
            tensors[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    wall_ms = (time.perf_counter() - t0) * 1e3
    tensors.clear()
    model_pinned, model_pins = pow2_model(ops)
    out = {
        "torch": torch.__version__,
        "peak_requested": peak,
        "wall_ms": wall_ms,
        "pow2_model_pinned": model_pinned,
        "pow2_model_pins": model_pins,
    }
    print(f"pin_memory() over the workload: {wall_ms:.1f} ms wall")
    print(f"power-of-two model: {model_pinned / MIB:.1f} MiB ({model_pinned / peak:.3f}x), {model_pins} pins")
    if has_stats:
        stats = torch.cuda.host_memory_stats()
        out["host_memory_stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        for k, v in sorted(stats.items()):
            if ("bytes" in k and (k.endswith(".peak") or k.endswith(".current"))) or "time" in k:
                extra = f" = {v / MIB:.1f} MiB ({v / peak:.3f}x peak requested)" if "bytes" in k else ""
                print(f"  {k}: {v}{extra}")
        for k in ("segment.peak", "allocations.peak", "num_host_alloc", "num_host_free"):
            if k in stats:
                print(f"  {k}: {stats[k]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
