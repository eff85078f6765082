"""torch.cuda.memory._record_memory_history(stacks="python") and _dump_snapshot through
the bridge (only there: the C hooks route answers both with "not supported").

    memory_history.py OUT.pickle

The file PyTorch writes must hold alloc events whose Python frames name this
script's own function, read back as PyTorch's web viewer reads it (the checks
of tests/replay/test_memory_viz.py), replay with `python -m pyalloc replay`, and render
with every Python function of torch.cuda._memory_viz that takes a snapshot
(flamegraph.pl, which those of them that draw flame graphs would download, is
replaced by a function that returns its input lines).
"""
import os
import pickle
import subprocess
import sys

import torch
from torch.cuda import _memory_viz

import pyalloc
from gpu_common import bridge_only

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "replay"))
import test_memory_viz as viewer  # noqa: E402  (tests/replay/: what the web viewer does)

HERE = os.path.abspath(__file__)
FUNCTION = "allocate_for_the_history_check"
SIZES = (10, 1000, 300_000, 5_000_000)  # floats: small-pool and large-pool blocks


def allocate_for_the_history_check():
    xs = [torch.empty(n, device="cuda") for n in SIZES]
    ys = [x.fill_(1.0) * 2 for x in xs]  # kernels, and more allocations
    del xs[1]
    return xs, ys


def frames_name_this_function(frames):
    return any(f["name"] == FUNCTION and os.path.abspath(f["filename"]) == HERE for f in frames)


def main(path):
    bridge_only("torch.cuda.memory._record_memory_history and _dump_snapshot")
    early = torch.ones(1000, device="cuda")  # live before the history starts
    before = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=100_000)
    assert torch._C._cuda_isHistoryEnabled()
    kept = allocate_for_the_history_check()
    del early  # a free of a block allocated before the history started
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    assert not torch._C._cuda_isHistoryEnabled()
    check_file(path, before, [t.data_ptr() for t in kept[0] + kept[1]])
    del kept
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


def check_file(path, before, live_pointers):
    """What the dumped file must be, as each reader sees it."""
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snap), list(snap)
    events = snap["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    mine = [e for e in allocs if frames_name_this_function(e["frames"])]
    sizes = {e["size"] for e in mine}
    assert {4 * n for n in SIZES} <= sizes, (sorted(sizes), [e["frames"] for e in allocs[:3]])
    assert all({"filename", "line", "name"} <= set(f) for e in mine for f in e["frames"])
    frees = [e for e in events if e["action"] == "free_requested"]
    assert any(frames_name_this_function(e["frames"]) for e in frees), "context='all': frees carry frames"
    # The blocks still live carry the frames of their allocation.
    live = {b["address"]: b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
    for ptr in live_pointers:
        assert ptr in live, f"live tensor {ptr:#x} is not an allocated block"
        assert frames_name_this_function(live[ptr]["frames"]), live[ptr]["frames"]
    assert snap["segments"] and all(s["device"] == 0 for s in snap["segments"])

    # As the web viewer reads it (tests/replay/test_memory_viz.py does what MemoryViz.js does).
    viewer.check_block_addresses(snap)
    viewer.replay_history_backwards(snap)
    assert viewer.timeline_final_total(snap) == viewer.live_requested(snap)

    # Every Python function of torch.cuda._memory_viz that takes a snapshot.
    lines = lambda text: text  # noqa: E731  (instead of flamegraph.pl, which is downloaded)
    assert f"{os.path.basename(HERE)}:" in _memory_viz.segments(snap, format_flamegraph=lines)
    assert FUNCTION in _memory_viz.memory(snap, format_flamegraph=lines)
    assert isinstance(_memory_viz.compare(before["segments"], snap["segments"], format_flamegraph=lines), str)
    summary = _memory_viz.segsum(snap)  # checks its own totals
    assert f"segments: {len(snap['segments'])}" in summary, summary
    text = _memory_viz.trace(snap)
    assert "Device 0" in text and "TOTAL MEM" in text, text[-500:]
    for html in (_memory_viz.trace_plot(snap), _memory_viz.trace_plot(snap, plot_segments=True),
                 _memory_viz.trace_plot(pickle.loads(pickle.dumps(snap)), filter_freed=True),
                 _memory_viz.segment_plot(snap)):
        assert "<!DOCTYPE html>" in html
    # ... and its command line, which reads the file itself.
    for action in ("stats", "trace"):
        out = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", action, path],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (action, out.stdout[-2000:], out.stderr[-2000:])

    # pyalloc's replay reads PyTorch's file.
    out = subprocess.run([sys.executable, "-m", "pyalloc", "replay", path], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])


if __name__ == "__main__":
    main(sys.argv[1])
