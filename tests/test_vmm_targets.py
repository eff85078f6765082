"""Issue 19's absolute targets for the vmm strategy, on the recorded traces
(benchmarks/traces, and ../shared/traces with its gpu/ where present) and on
random workloads: peak reserved with no cap within 5% of peak live on traces
of 1 GiB or more and within 15% on smaller ones and on random workloads; the
smallest budget within 1% of peak live on traces of 1 GiB or more; the
second half's device calls no more than PyTorch's expandable segments make
(figures of the issue). Where a target is missed today the case is an xfail
(strict: it fails once the target is met, so that the mark goes);
benchmarks/results/fragmentation.md says why.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

import pyalloc
import pyalloc.replay
from pyalloc.replay import replay

MiB, GiB = 1 << 20, 1 << 30
ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
TRACES = sorted((ROOT / "benchmarks" / "traces").glob("*.pickle.gz"))
for folder in (SHARED, SHARED / "gpu"):
    if folder.is_dir():
        TRACES += sorted(folder.glob("*.pickle"))

# Missed today (ratio with no cap, to peak live), see fragmentation.md.
RESERVED_MISSED = {
    "bert-dynbatch-infer.pickle": "1.30: free bytes in pages partly under live blocks",
    "encoder-dynbatch-infer.pickle.gz": "1.24: free bytes in pages partly under live blocks",
    "maphsge4-select_n-llama7b-offload-infer-10streams.pickle": "1.055: holes of ten streams stay mapped",
    "mercuryb1-sqattn-qwen2.5-7b-layerwise-quant-calib.pickle": "1.095: holes of work that does not repeat stay mapped",
}
BUDGET_MISSED = {"gpt2-varlen-train.pickle": "1.011"}
# PyTorch's expandable segments, second half's device calls (issue 19's model).
EXPANDABLE_CALLS = {"gpt2-varlen-train.pickle": 18, "vit-mixedres-train.pickle": 5}


def mark(path, missed):
    if path.name in missed:
        return pytest.param(path, id=path.name, marks=pytest.mark.xfail(reason=missed[path.name], strict=True))
    return pytest.param(path, id=path.name)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(path):
        if path not in cache:
            precision = pyalloc.replay.BUDGET_PRECISION
            pyalloc.replay.BUDGET_PRECISION = 0.001
            try:
                cache[path] = replay(path, "strategy:vmm", progress=False)
            finally:
                pyalloc.replay.BUDGET_PRECISION = precision
        return cache[path]
    return get


@pytest.mark.parametrize("path", [mark(p, RESERVED_MISSED) for p in TRACES])
def test_reserved_with_no_cap_is_near_peak_live(results, path):
    r = results(path)
    target = 1.05 if r.peak_live_bytes >= GiB else 1.15
    assert r.pyalloc_ratio <= target, r.pyalloc_ratio


@pytest.mark.parametrize("path", [mark(p, BUDGET_MISSED) for p in TRACES])
def test_smallest_budget_of_a_large_trace_is_within_1_percent(results, path):
    r = results(path)
    if r.peak_live_bytes < GiB:
        pytest.skip("under 1 GiB of peak live: no absolute budget target")
    assert r.pyalloc_min_budget_bytes <= 1.01 * r.peak_live_bytes, r.pyalloc_min_budget_bytes / r.peak_live_bytes


@pytest.mark.parametrize("name", sorted(EXPANDABLE_CALLS))
def test_second_half_calls_no_more_than_expandable_segments(results, name):
    path = next((p for p in TRACES if p.name == name), None)
    if path is None:
        pytest.skip(f"{name} is in ../shared/traces, absent here")
    assert results(path).pyalloc_second_half_device_calls <= EXPANDABLE_CALLS[name]


def random_workload(seed, streams):
    """Log-uniform sizes from 512 B to 64 MiB, frees at random, up to 2 GiB live."""
    rng = random.Random(seed)
    a = pyalloc.Allocator("virtual", strategy="vmm")
    live, cur, peak = [], 0, 0
    for _ in range(20000):
        if live and (rng.random() < 0.5 or cur > 2 * GiB):
            p, size = live.pop(rng.randrange(len(live)))
            a.free(p)
            cur -= size
        else:
            size = -(-int(math.exp(rng.uniform(math.log(512), math.log(64 * MiB)))) // 512) * 512
            live.append((a.malloc(size, rng.randrange(streams)), size))
            cur += size
            peak = max(peak, cur)
    a.check_invariants()
    return a.stats()["reserved_bytes.all.peak"] / peak


@pytest.mark.xfail(reason="1.18 (one stream) and 1.25 (three) on average: holes stay mapped", strict=True)
@pytest.mark.parametrize("streams", [1, 3])
def test_random_workloads_reserve_within_15_percent(streams):
    ratios = [random_workload(seed, streams) for seed in range(4)]
    assert max(ratios) <= 1.15, ratios
