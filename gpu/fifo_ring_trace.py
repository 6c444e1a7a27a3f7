#!/usr/bin/env python3
"""Writes gpu/host_pair.py's same-thread pattern as an RMM CSV trace for `cca replay` /
`cca compare` on the simulated device: the sixteen sizes of a transformer step's tensors
(host_pair.py's SIZES) in turn, one stream, each allocation followed by the free of the tensor
made eight allocations before (a FIFO ring of eight live tensors, as a layer's activations).

    python3 gpu/fifo_ring_trace.py OUT.csv [--pairs N]     # N: pairs after the warm-up (20000)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_pair import SIZES  # noqa: E402  (the same list the GPU measurement uses)

WINDOW = 8


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--pairs", type=int, default=20_000)
    a = p.parse_args()
    t, nxt, ring = 1000, 0x100_0000_0000, [None] * WINDOW
    with open(a.out, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        for i in range(8 * WINDOW + a.pairs):  # host_pair.py warms up with 8 rounds of the ring
            size = SIZES[i % len(SIZES)]
            ptr, nxt = nxt, nxt + ((size + 0xFFFFF) >> 20 << 20) + (1 << 20)
            f.write(f"0,{t},allocate,{ptr:#x},{size},0\n")
            t += 1
            old = ring[i % WINDOW]
            if old:
                f.write(f"0,{t},free,{old[0]:#x},{old[1]},0\n")
                t += 1
            ring[i % WINDOW] = (ptr, size)
        for ptr, size in ring:
            f.write(f"0,{t},free,{ptr:#x},{size},0\n")
            t += 1


if __name__ == "__main__":
    main()
