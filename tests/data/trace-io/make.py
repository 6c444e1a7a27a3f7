"""Regenerates the small hand-made trace files in this directory (python3, no PyTorch needed).

tiny_snapshot_*.pickle: a PyTorch-shaped memory snapshot with two devices (the second empty), a
small and an expandable segment, every trace action, user_metadata, settings and annotations;
written by Python's own pickler in protocols 4 (framed, memoized) and 2. rmm_*.csv: RMM
logging_resource_adaptor logs with clock times across midnight and with integer microseconds.
They are unit-test inputs (tests/all/trace_io.rs) and fuzzing seeds (fuzz/README.md).
"""
import gzip
import pickle

BASE = 0x7F0000000000
MAPPED = 0x7F0004000000


def entry(action, addr, size, stream, time_us, meta=""):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time_us,
            "compile_context": "N/A", "user_metadata": meta}


def block(address, size, requested, state):
    return {"address": address, "size": size, "requested_size": requested, "state": state, "frames": []}


def segment(address, total, allocated, requested, stream, kind, expandable, blocks):
    return {"device": 0, "address": address, "total_size": total, "allocated_size": allocated,
            "active_size": allocated, "requested_size": requested, "stream": stream,
            "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": expandable,
            "frames": [], "blocks": blocks}


MIB2 = 2 << 20
snapshot = {
    "segments": [
        segment(BASE, MIB2, 512, 100, 0, "small", False,
                [block(BASE, 512, 100, "active_allocated"), block(BASE + 512, MIB2 - 512, 0, "inactive")]),
        segment(MAPPED, MIB2, 0, 0, 7, "large", True, [block(MAPPED, MIB2, 0, "inactive")]),
    ],
    "device_traces": [[
        entry("segment_alloc", BASE, MIB2, 0, 1000),
        entry("alloc", BASE, 100, 0, 1001, "fwd"),
        entry("alloc", BASE + 512, 300, 0, 1002),
        entry("free_requested", BASE + 512, 300, 0, 1003),
        entry("free_completed", BASE + 512, 300, 0, 1004),
        entry("segment_map", MAPPED, MIB2, 7, 1005),
        {"action": "oom", "device_free": 1024, "size": 1 << 40, "stream": 0, "time_us": 1006,
         "compile_context": "N/A", "user_metadata": ""},
        entry("snapshot", 0, 100, 0, 1007),
    ], []],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                           "garbage_collection_threshold": 0.0, "expandable_segments": True,
                           "roundup_power2_divisions": {"1": 0, "2": 0}},
    "external_annotations": [{"stage": "START", "name": "step", "device": 0, "time_us": 1000}],
}

p4 = pickle.dumps(snapshot, protocol=4)
open("tiny_snapshot_p4.pickle", "wb").write(p4)
open("tiny_snapshot_p4.pickle.gz", "wb").write(gzip.compress(p4, mtime=0))
open("tiny_snapshot_p2.pickle", "wb").write(pickle.dumps(snapshot, protocol=2))

clock = ("Thread,Time,Action,Pointer,Size,Stream\n"
         "140245,23:59:59.999000,allocate,0x7f3a00000000,4096,0x0\n"
         "140246,23:59:59.999500,allocate failure,(nil),1073741824,0x0\n"
         "140246,00:00:00.000001,allocate,0x7f3a00001000,512,0x5600\n"
         "140245,00:00:00.000002,free,0x7f3a00000000,4096,0x0\n")
open("rmm_clock.csv", "w").write(clock)
open("rmm_clock.csv.gz", "wb").write(gzip.compress(clock.encode(), mtime=0))
open("rmm_us.csv", "w").write("Thread,Time,Action,Pointer,Size,Stream\n"
                              "0,1795313682955251,allocate,0x7fdaf4000000,154389504,0\n"
                              "0,1795313682992463,free,0x7fdaf4000000,154389504,0\n")
