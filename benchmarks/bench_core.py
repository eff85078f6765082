"""Hot-path cost of the allocator core: nanoseconds per malloc+free pair.

Runs C++ timing loops (pyalloc._C.bench_pairs) over the virtual backend, so
neither Python nor memory traffic is in the loop, and prints a table and
writes benchmarks/results/bench_core.json.

    python benchmarks/bench_core.py [--iterations N] [--repeats R]

Cases:
  cache hit         one size, malloc then free: the block is reused every time
  mixed sizes       log-uniform 512 B .. 64 MiB with 64 allocations kept live
  2 threads         the cache-hit loop from two threads at once (one pool)
  device pools      the cache-hit loop through a CUDA device's pools as PyTorch
                    reaches them (the C hooks, or the bridge's C table), over a
                    fake device: the CUDA layer's cost without a GPU
Target: a cache-hit pair under 100 ns, judged on the best of the repeats (on
a shared machine other tenants only add time; medians are reported too).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import RESULTS, environment  # noqa: E402

import pyalloc  # noqa: E402
from pyalloc import _C  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TARGET_NS = 100.0


def mixed_sizes(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    lo, hi = math.log2(512), math.log2(64 * MiB)
    return [int(2 ** rng.uniform(lo, hi)) for _ in range(n)]


def measure(sizes, iterations, threads=1, window=1, repeats=5):
    """Median ns per pair (per thread) over fresh allocators, after one warm-up run."""
    results = []
    for _ in range(repeats):
        a = pyalloc.Allocator("virtual")
        _C.bench_pairs(a._core, sizes, max(1000, iterations // 10), threads, window)  # warm
        seconds = _C.bench_pairs(a._core, sizes, iterations, threads, window)
        results.append(seconds * 1e9 / iterations)
    return statistics.median(results), min(results)


def device_pair_ns(via: str, size: int, iterations: int, repeats: int):
    """(median, best) ns per pair through device 0's pools on a fake device."""
    results = []
    for _ in range(repeats):
        _C._testing_use_fake_devices(256 * MiB)
        # As installed: PyTorch announces captures (the bridge; hooks where torch has them).
        _C.cuda_set_told_of_captures(True)
        try:
            _C.bench_device_pairs(via, size, max(1000, iterations // 10))  # warm
            results.append(_C.bench_device_pairs(via, size, iterations) * 1e9 / iterations)
        finally:
            _C._testing_reset()
    return statistics.median(results), min(results)


def python_pair_ns(iterations: int) -> float:
    a = pyalloc.Allocator("virtual")
    malloc, free = a.malloc, a.free
    start = time.perf_counter()
    for _ in range(iterations):
        free(malloc(4096))
    return (time.perf_counter() - start) * 1e9 / iterations


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_core.json"))
    args = ap.parse_args()
    n, r = args.iterations, args.repeats

    cases = [
        ("cache hit, 4 KiB (small pool)", dict(sizes=[4 * KiB])),
        ("cache hit, 8 MiB (large pool)", dict(sizes=[8 * MiB])),
        ("mixed sizes 512 B - 64 MiB, 64 live", dict(sizes=mixed_sizes(4096), window=64, iterations=n // 4)),
        ("cache hit, 4 KiB, 2 threads", dict(sizes=[4 * KiB], threads=2)),
        ("mixed sizes, 2 threads, 64 live each", dict(sizes=mixed_sizes(4096), threads=2, window=64, iterations=n // 4)),
    ]
    rows = []
    for name, kw in cases:
        iters = kw.pop("iterations", n)
        median, best = measure(iterations=iters, repeats=r, **kw)
        rows.append({"case": name, "ns_per_pair_median": round(median, 2), "ns_per_pair_best": round(best, 2),
                     "iterations": iters, "threads": kw.get("threads", 1), "live_window": kw.get("window", 1)})
    for via, label in (("hooks", "C hooks"), ("bridge_api", "bridge's C table")):
        for size, size_name in ((4 * KiB, "4 KiB"), (8 * MiB, "8 MiB")):
            median, best = device_pair_ns(via, size, n // 2, r)
            rows.append({"case": f"device pools via {label}, {size_name}", "ns_per_pair_median": round(median, 2),
                         "ns_per_pair_best": round(best, 2), "iterations": n // 2, "threads": 1,
                         "live_window": 1})
    py_ns = python_pair_ns(200_000)

    width = max(len(row["case"]) for row in rows)
    print(f"{'case':<{width}}  {'ns/pair (median)':>16}  {'best':>8}  threads")
    for row in rows:
        print(f"{row['case']:<{width}}  {row['ns_per_pair_median']:>16.1f}  {row['ns_per_pair_best']:>8.1f}  {row['threads']}")
    print(f"{'(through Python: Allocator.malloc+free, 4 KiB)':<{width}}  {py_ns:>16.1f}")
    # The target is judged on the best repeat: the loop's own cost, which
    # other tenants of a shared machine can only add to (the median is shown
    # beside it and kept in the JSON).
    hit = rows[0]["ns_per_pair_best"]
    verdict = "met" if hit < TARGET_NS else "NOT met"
    print(f"target: cache-hit pair under {TARGET_NS:.0f} ns in the C++ loop: {verdict} "
          f"(best of {r} repeats {hit:.1f} ns, median {rows[0]['ns_per_pair_median']:.1f} ns)")
    print("(with 2 threads, ns/pair is the wall time of each thread's loop per pair: both share one lock)")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "backend": "virtual", "results": rows,
                   "python_pair_ns": round(py_ns, 1), "target_cache_hit_ns": TARGET_NS,
                   "target_judged_on": "ns_per_pair_best", "target_met": hit < TARGET_NS}, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
