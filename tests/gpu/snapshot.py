"""dump_snapshot() writes PyTorch's memory-snapshot format with the recorded history.

    snapshot.py OUT.pickle
"""
import pickle
import sys

import torch
from torch.cuda import _memory_viz

import pyalloc


def main(path):
    pyalloc.install()
    pyalloc.record_history(max_entries=10_000)
    xs = [torch.randn(n, device="cuda") for n in (10, 1000, 300_000, 5_000_000)]
    del xs[1]
    buf = pyalloc.reserve_buffer(1 << 20)
    pyalloc.dump_snapshot(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert {"alloc", "free_requested", "free_completed"} <= actions, actions
    # A segment appears as PyTorch reports it: cudaMalloc'd (bestfit) or mapped into a
    # virtual range, as its expandable segments are (vmm).
    strategy = pyalloc._C.cuda_config()["strategy"]
    assert ("segment_map" if strategy == "vmm" else "segment_alloc") in actions, (strategy, actions)
    assert any(s["segment_pool_id"] == pyalloc.cuda.BUFFER_POOL_ID for s in snap["segments"])
    assert "total_reserved" in _memory_viz.segsum(snap)
    assert "Device 0" in _memory_viz.trace(snap)
    assert "<html>" in _memory_viz.trace_plot(snap)
    del buf
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
