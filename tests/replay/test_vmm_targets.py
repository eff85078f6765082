"""Issue 42's targets for the vmm strategy: never behind PyTorch's own
allocator with expandable_segments:True, the model the replay runs beside
pyalloc (pyalloc/replay/allocators.py), on the same trace. On the recorded
traces (benchmarks/traces, and ../shared/traces with its gpu/ and h200/ where
present: skipped when absent), every device of each, and on the random
workloads of benchmarks/random_workloads.py:

- budget: pyalloc's smallest device no larger than expandable segments' (both
  bisected to 0.1%; where pyalloc's bisection lands above theirs by more than
  0.2%, pyalloc must still complete the trace on theirs), and within 1% of peak
  live on the traces recorded on a GPU (their snapshots hold the recording
  allocator's segments) with 1 GiB of peak live or more;
- reserved with no cap: no more than expandable segments' + 0.02 x peak live;
- device calls in the trace's second half, no cap: no more than theirs;
- driver calls over the whole replay, no cap: at most 1.25 x theirs on the
  traces recorded on a GPU.

(A loop that repeats exactly making no device call after its first pass:
tests/test_steady_state.py.) Where a target is missed the case is an xfail with
the measured figures (strict: it fails once the target is met, so that the mark
goes); benchmarks/results/fragmentation.md says why.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import pyalloc
import pyalloc.replay.allocators
from pyalloc import _C
from pyalloc.replay import plan_trace, replay_devices
from pyalloc.replay.allocators import run_allocator
from pyalloc.replay.snapshot_io import devices_of, load_snapshot, read_trace

from benchmarks.random_workloads import WORKLOADS, random_ops, random_snapshot
from benchmarks.random_workloads import name as workload_name
from shared_dir import SHARED_DIR

GiB = 1 << 30
CONF = "strategy:vmm"
ROOT = Path(__file__).resolve().parents[2]
SHARED = SHARED_DIR / "traces"
TRACES = sorted((ROOT / "benchmarks" / "traces").glob("*.pickle.gz"))
for folder, pattern in ((SHARED, "*.pickle"), (SHARED / "gpu", "*.pickle"), (SHARED / "h200", "*.pickle.gz")):
    if folder.is_dir():
        TRACES += sorted(folder.glob(pattern))
IN_SHARED = {path.name for path in TRACES if SHARED in path.parents}
# By name: the recorded traces, then benchmarks/random_workloads.py's.
SNAPSHOTS = {path.name: load_snapshot(path) for path in TRACES}
SNAPSHOTS.update({workload_name(streams, seed): random_snapshot(seed, streams) for streams, seed in WORKLOADS})
CASES = [(name, device) for name in SNAPSHOTS for device in devices_of(SNAPSHOTS[name])]

# Missed today, keyed "trace:device", with the figures measured (pyalloc
# against expandable segments); see fragmentation.md. None on these traces.
BUDGET_MISSED: dict = {}
BUDGET_GPU_MISSED: dict = {}
RESERVED_MISSED: dict = {}
CALLS_MISSED: dict = {}
DRIVER_CALLS_MISSED: dict = {}


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
    if not SHARED.is_dir():
        params.append(pytest.param(None, None, id="shared-traces",
                                   marks=pytest.mark.skip(reason=f"{SHARED} not found: bundled traces only")))
    return params


@pytest.fixture(scope="module")
def results():
    """The replay of a trace's device (three allocators, budgets bisected to
    0.1%), computed once for every test of the module."""
    cache = {}

    def get(name, device):
        if name not in cache:
            precision = pyalloc.replay.allocators.BUDGET_PRECISION
            pyalloc.replay.allocators.BUDGET_PRECISION = 0.001
            try:
                cache[name] = {r.device: r for r in replay_devices(SNAPSHOTS[name], CONF, name=name,
                                                                   progress=False)}
            finally:
                pyalloc.replay.allocators.BUDGET_PRECISION = precision
        return cache[name][device]
    return get


def recorded_on_a_gpu(r):
    """The snapshot holds the recording allocator's segments (CPU profiler traces and
    the random workloads have none)."""
    return r.recorded_peak_reserved_bytes is not None


@pytest.mark.parametrize("name,device", cases(BUDGET_MISSED))
def test_smallest_budget_no_larger_than_expandable_segments(results, name, device):
    r = results(name, device)
    ours, theirs = r.pyalloc_min_budget_bytes, r.native_expandable_min_budget_bytes
    assert ours and theirs
    if ours <= theirs * 1.002:
        return
    # Two bisections of the same precision from different upper ends can land
    # either way of a tie: the question is whether pyalloc serves the whole
    # trace on a device of expandable segments' budget.
    fits = run_allocator(replay_calls(name, device), "pyalloc", capacity=theirs, stop_on_oom=True,
                         conf=CONF).completed
    assert fits, (f"pyalloc {ours / r.peak_live_bytes:.4f} x peak live, "
                  f"expandable segments {theirs / r.peak_live_bytes:.4f}")


@pytest.mark.parametrize("name,device", cases(BUDGET_GPU_MISSED))
def test_smallest_budget_of_a_large_gpu_trace_is_within_1_percent(results, name, device):
    r = results(name, device)
    if not recorded_on_a_gpu(r) or r.peak_live_bytes < GiB:
        pytest.skip("not recorded on a GPU with 1 GiB of peak live or more")
    assert r.pyalloc_min_budget_bytes <= 1.01 * r.peak_live_bytes, r.pyalloc_min_budget_bytes / r.peak_live_bytes


@pytest.mark.parametrize("name,device", cases(RESERVED_MISSED))
def test_reserved_with_no_cap_no_more_than_expandable_segments(results, name, device):
    r = results(name, device)
    slack = 0.02 * r.peak_live_bytes
    assert r.pyalloc_peak_reserved_bytes <= r.native_expandable_peak_reserved_bytes + slack, (
        f"{r.pyalloc_ratio:.3f} x peak live against "
        f"{r.native_expandable_peak_reserved_bytes / r.peak_live_bytes:.3f}")


@pytest.mark.parametrize("name,device", cases(CALLS_MISSED))
def test_second_half_calls_no_more_than_expandable_segments(results, name, device):
    r = results(name, device)
    assert r.pyalloc_second_half_device_calls <= r.native_expandable_second_half_device_calls, (
        r.pyalloc_second_half_device_calls, r.native_expandable_second_half_device_calls)


@pytest.mark.parametrize("name,device", cases(DRIVER_CALLS_MISSED))
def test_driver_calls_of_a_gpu_trace_within_a_quarter_of_expandable_segments(results, name, device):
    r = results(name, device)
    if not recorded_on_a_gpu(r):
        pytest.skip("not recorded on a GPU")
    assert r.pyalloc_driver_calls <= 1.25 * r.native_expandable_driver_calls, (
        r.pyalloc_driver_calls, r.native_expandable_driver_calls)


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
