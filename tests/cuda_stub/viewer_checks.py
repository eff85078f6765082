"""A snapshot taken while an allocator trace tracker listens, as PyTorch's memory
viewer reads it, on the stand-in driver (libcuda_stub.c) under strategy vmm.

Run by tests/replay/test_memory_viz.py:  viewer_checks.py PATH/TO/libcuda.so.1 KIND
KIND: plain (the table's snapshot: pyalloc.snapshot's segments) or units
(snapshot_units: what the bridge gives torch.cuda.memory._snapshot once a tracker
listens). Blocks of several pages are allocated, some freed, one mapped past the
holes; the snapshot in PyTorch's format goes through test_memory_viz.check_snapshot
(the viewer's block addresses, its history replay, its timeline, _memory_viz's
renderers). Prints OK, or the viewer's failure.
"""
import ctypes as c
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "replay")]

import pyalloc  # noqa: E402
from bridge_api import OK, SEGMENT_EVENT_FN, BridgeApi  # noqa: E402
from stub import Stub  # noqa: E402
import test_memory_viz as viewer  # noqa: E402

MiB = 1 << 20
stub = Stub.in_dll(c.CDLL(sys.argv[1]), "stub")
stub.vmm = 1
kind = sys.argv[2]
pyalloc._C.cuda_configure("pool_size:0,strategy:vmm")
api = BridgeApi()
pyalloc.record_history(True, max_entries=100_000)
told = {}


def on_event(_user, _device, mapped, addr, size, _pool):
    if mapped:
        told[addr] = size
    else:
        told.pop(addr, None)


watcher = SEGMENT_EVENT_FN(on_event)
assert api.watch_segments(watcher, None) == OK
ptrs = []
for n in (8, 14, 20, 26, 32):
    status, p, _ = api.malloc(n * MiB)
    assert status == OK, api.error()
    ptrs.append(p)
assert api.free(ptrs[1], 0) == OK and api.free(ptrs[3], 0) == OK
status, p, _ = api.malloc(60 * MiB)
assert status == OK, api.error()
assert any(size < 8 * MiB for size in told.values()), "units smaller than the blocks"


def as_torch(segments, trace):
    """The table's segments and history as PyTorch's snapshot (Module.cpp's dicts)."""
    out = []
    for s in segments:
        addr, blocks = s["address"], []
        for b in s["blocks"]:
            state = "active_allocated" if b["allocated"] else "active_pending_free" if b["active"] else "inactive"
            blocks.append({"address": addr, "size": b["size"], "requested_size": b["requested_size"],
                           "state": state, "frames": []})
            addr += b["size"]
        out.append({"device": s["device"], "address": s["address"], "total_size": s["total_size"],
                    "allocated_size": s["allocated_size"], "active_size": s["active_size"],
                    "requested_size": s["requested_size"], "stream": s["stream"],
                    "segment_type": "large" if s["is_large"] else "small", "segment_pool_id": s["pool_id"],
                    "is_expandable": s["is_expandable"], "frames": [], "blocks": blocks})
    return {"segments": out, "device_traces": [[dict(e, frames=[]) for e in trace]]}


snap = as_torch(api.snapshot(0, units=kind == "units"), api.history(0))
try:
    viewer.check_block_addresses(snap)
    viewer.replay_history_backwards(snap)
    total, live = viewer.timeline_final_total(snap), viewer.live_requested(snap)
    assert total == live, f"the timeline ends at {total} bytes, {live} live"
    viewer.render_everything(snap, {"segments": []}, None)
except AssertionError as e:
    print(f"VIEWER: {e}")
    sys.exit(1)
assert api.watch_segments(SEGMENT_EVENT_FN(), None) == OK
assert stub.vmm_refused == 0 and stub.capture_invalidated == 0 and stub.bad_handle == 0
print("OK")
