"""Issue 19's targets for the vmm strategy, on the recorded traces
(benchmarks/traces, and ../shared/traces with its gpu/ where present), every
device of each, and on the random workloads of benchmarks/random_workloads.py.

Against the model of PyTorch's allocator with expandable_segments:True that
the replay runs beside pyalloc (pyalloc/replay_allocators.py), on every trace
and device: pyalloc's smallest budget no larger (both bisected to the same
precision; where pyalloc's bisection lands above, pyalloc must still complete
the trace on expandable segments' budget), its device calls in the trace's
second half no more, and its driver calls over the whole replay no more.
Absolute targets: peak reserved with no cap within 5% of peak live on traces
of 1 GiB or more and within 15% on smaller ones and on random workloads; the
smallest budget within 1% of peak live on traces of 1 GiB or more.

Where a target is missed today the case is an xfail with the measured figures
(strict: it fails once the target is met, so that the mark goes);
benchmarks/results/fragmentation.md says why.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import pyalloc
import pyalloc.replay
from pyalloc import _C
from pyalloc.replay import plan_trace, replay_devices
from pyalloc.replay_allocators import run_allocator
from pyalloc.snapshot_io import devices_of, load_snapshot, read_trace

from benchmarks.random_workloads import WORKLOADS, random_ops, random_snapshot
from benchmarks.random_workloads import name as workload_name
from shared_dir import SHARED_DIR

GiB = 1 << 30
CONF = "strategy:vmm"
ROOT = Path(__file__).resolve().parents[2]
SHARED = SHARED_DIR / "traces"
TRACES = sorted((ROOT / "benchmarks" / "traces").glob("*.pickle.gz"))
for folder in (SHARED, SHARED / "gpu"):
    if folder.is_dir():
        TRACES += sorted(folder.glob("*.pickle"))
IN_SHARED = {path.name for path in TRACES if SHARED in path.parents}
# By name: the recorded traces, then benchmarks/random_workloads.py's.
SNAPSHOTS = {path.name: load_snapshot(path) for path in TRACES}
SNAPSHOTS.update({workload_name(streams, seed): random_snapshot(seed, streams) for streams, seed in WORKLOADS})
CASES = [(name, device) for name in SNAPSHOTS for device in devices_of(SNAPSHOTS[name])]
RANDOM = {workload_name(streams, seed) for streams, seed in WORKLOADS}

# Missed today, keyed "trace:device", with the figures measured (pyalloc
# against expandable segments where the target is theirs); see fragmentation.md.
RESERVED_MISSED = {
    "bert-dynbatch-infer.pickle:0": "1.30: 13.4 MiB blocks split the hole its 53.6 MiB requests need",
    "encoder-dynbatch-infer.pickle.gz:0": "1.24: a 7.8 MiB hole at its peak, and a 12 MiB grain mapped for 6 MiB",
    "maphsge4-select_n-llama7b-offload-infer-10streams.pickle:0": "1.055: holes of ten streams stay mapped",
    "mercuryb1-sqattn-qwen2.5-7b-layerwise-quant-calib.pickle:0": "1.095: two 512 KiB blocks bound the hole a 1036 MiB request needs",
    # Random workloads: 15% whatever their size; nothing repeats, holes stay mapped.
    "random-1-stream-seed1:0": "1.224", "random-1-stream-seed2:0": "1.252", "random-1-stream-seed3:0": "1.151",
    "random-3-streams-seed0:0": "1.181", "random-3-streams-seed1:0": "1.284", "random-3-streams-seed2:0": "1.300",
    "random-3-streams-seed3:0": "1.218",
}
BUDGET_MISSED = {
    "gpt2-varlen-train.pickle:0": "1.011",
    # Free bytes in pages beside live blocks of random sizes (expandable segments: 1.13 to 1.24).
    "random-1-stream-seed3:0": "1.0341", "random-3-streams-seed0:0": "1.0432",
    "random-3-streams-seed1:0": "1.0433", "random-3-streams-seed3:0": "1.0434",
}
EXPANDABLE_BUDGET_MISSED = {
    "zidongliu-decomfl-opt125m-zo-fedlearn-windows.pickle:0": "1.0030 against 1.0018: a late 147 MiB request is 2 MiB short, the free bytes in pages under live blocks",
}
EXPANDABLE_CALLS_MISSED = {"random-1-stream-seed0:0": "2 against 1: two 32 MiB growths where expandable segments map once"}
# Whole replay, pyalloc against expandable segments (cuMemSetAccess once per
# mapped range for both, as PyTorch's mapAndSetAccess calls it): none missed
# since small pools grow in 12 MiB steps (8 MiB steps made 49 against 44 on
# convnet-mixedres, 42 against 36 on bert-dynbatch, 40 against 29 on
# jaspersolt-cnn).
EXPANDABLE_DRIVER_CALLS_MISSED: dict = {}

# On an 80 GiB device (pyalloc sizes its handles by the room left, expandable
# segments map 20 MiB pages on any device): benchmarks/results/fragmentation.md,
# "On a device of a size", has these and the snug device's figures.
DEVICE_80_DRIVER_CALLS_MISSED = {
    "constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle:1":
        "10010 against 9119: 78 GiB of peak live fills the device, and handles shrink to one page",
}


def replay_calls(name, device):
    plan = plan_trace(read_trace(SNAPSHOTS[name], device))
    return _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)


def cases(missed):
    params = []
    for name, device in CASES:
        key = f"{name}:{device}"
        marks = ([pytest.mark.xfail(reason=missed[key], raises=AssertionError, strict=True)]
                 if key in missed else [])
        if name in IN_SHARED:
            marks.append(pytest.mark.shared)
        params.append(pytest.param(name, device, id=key, marks=marks))
    return params


@pytest.fixture(scope="module")
def results():
    """The replay of a trace's device (three allocators, budgets bisected to
    0.1%), computed once for every test of the module."""
    cache = {}

    def get(name, device):
        if name not in cache:
            precision = pyalloc.replay.BUDGET_PRECISION
            pyalloc.replay.BUDGET_PRECISION = 0.001
            try:
                cache[name] = {r.device: r for r in replay_devices(SNAPSHOTS[name], CONF, name=name,
                                                                   progress=False)}
            finally:
                pyalloc.replay.BUDGET_PRECISION = precision
        return cache[name][device]
    return get


@pytest.mark.parametrize("name,device", cases(RESERVED_MISSED))
def test_reserved_with_no_cap_is_near_peak_live(results, name, device):
    r = results(name, device)
    target = 1.05 if r.peak_live_bytes >= GiB and name not in RANDOM else 1.15
    assert r.pyalloc_ratio <= target, r.pyalloc_ratio


@pytest.mark.parametrize("name,device", cases(BUDGET_MISSED))
def test_smallest_budget_of_a_large_trace_is_within_1_percent(results, name, device):
    r = results(name, device)
    if r.peak_live_bytes < GiB:
        pytest.skip("under 1 GiB of peak live: no absolute budget target")
    assert r.pyalloc_min_budget_bytes <= 1.01 * r.peak_live_bytes, r.pyalloc_min_budget_bytes / r.peak_live_bytes


@pytest.mark.parametrize("name,device", cases(EXPANDABLE_BUDGET_MISSED))
def test_smallest_budget_no_larger_than_expandable_segments(results, name, device):
    r = results(name, device)
    ours, theirs = r.pyalloc_min_budget_bytes, r.native_expandable_min_budget_bytes
    assert ours and theirs
    if ours <= theirs:
        return
    # Two bisections of the same precision from different upper ends can land
    # either way of a tie: the question is whether pyalloc serves the whole
    # trace on a device of expandable segments' budget.
    fits = run_allocator(replay_calls(name, device), "pyalloc", capacity=theirs, stop_on_oom=True,
                         conf=CONF).completed
    assert fits, (f"pyalloc {ours / r.peak_live_bytes:.4f} x peak live, "
                  f"expandable segments {theirs / r.peak_live_bytes:.4f}")


@pytest.mark.parametrize("name,device", cases(EXPANDABLE_CALLS_MISSED))
def test_second_half_calls_no_more_than_expandable_segments(results, name, device):
    r = results(name, device)
    assert r.pyalloc_second_half_device_calls <= r.native_expandable_second_half_device_calls, (
        r.pyalloc_second_half_device_calls, r.native_expandable_second_half_device_calls)


@pytest.mark.parametrize("name,device", cases(EXPANDABLE_DRIVER_CALLS_MISSED))
def test_driver_calls_no_more_than_expandable_segments(results, name, device):
    r = results(name, device)
    assert r.pyalloc_driver_calls <= r.native_expandable_driver_calls, (
        r.pyalloc_driver_calls, r.native_expandable_driver_calls)


@pytest.mark.parametrize("name,device", cases(DEVICE_80_DRIVER_CALLS_MISSED))
def test_driver_calls_on_an_80_gib_device_no_more_than_expandable_segments(name, device):
    calls = replay_calls(name, device)
    ours = run_allocator(calls, "pyalloc", capacity=80 * GiB, conf=CONF)
    theirs = run_allocator(calls, "native_expandable", capacity=80 * GiB)
    assert ours.completed and theirs.completed
    assert ours.driver_calls <= theirs.driver_calls, (ours.driver_calls, theirs.driver_calls)


@pytest.mark.parametrize("streams,seed", WORKLOADS)
def test_random_workloads_leave_the_allocator_consistent(streams, seed):
    # The target cases replay them; this drives an allocator call by call and checks its
    # blocks, pages and counters after each workload.
    a = pyalloc.Allocator("virtual", strategy="vmm")
    ptrs = {}
    for kind, id_, size, stream in random_ops(seed, streams):
        if kind == "alloc":
            ptrs[id_] = a.malloc(size, stream)
        else:
            a.free(ptrs.pop(id_))
    a.check_invariants()
    for ptr in ptrs.values():
        a.free(ptr)
    a.check_invariants()
    assert a.stats()["allocated_bytes.all.current"] == 0
