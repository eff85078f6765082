"""Fragmentation benchmark: replays recorded traces through pyalloc and sets its
peak reserved bytes against the least any allocator must hold (peak live) and
against the allocator that recorded the trace (PyTorch's native one, for GPU
snapshots).

Replays every snapshot in ../shared/traces/ (beside the repository, where CI
keeps the benchmark traces; skipped when absent) and in benchmarks/traces/ (the
bundled ones), prints the table, and writes benchmarks/results/fragmentation.md
and fragmentation.json with the raw numbers, including the C++ replay's
throughput in events per second. Needs no GPU.

    python benchmarks/fragmentation.py [--config CONF] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pyalloc
from pyalloc import _C
from pyalloc.replay import plan_trace, replay
from pyalloc.replay_report import LEGEND, format_table
from pyalloc.snapshot_io import read_trace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
BUNDLED = ROOT / "benchmarks" / "traces"
RESULTS = ROOT / "benchmarks" / "results"

#: Each trace is replayed at least this many times, and for at least MIN_SECONDS.
MIN_REPEATS, MIN_SECONDS = 5, 0.5


def trace_files() -> List[Path]:
    files: List[Path] = []
    for folder in (SHARED, BUNDLED):
        if folder.is_dir():
            files += sorted(p for p in folder.iterdir() if p.name.endswith((".pickle", ".pickle.gz")))
    return files


def throughput(path: Path, conf: str) -> Dict[str, float]:
    """Replay speed of the C++ replayer alone (the trace already resolved), median of repeats."""
    trace = read_trace(path)
    plan = plan_trace(trace)
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    seconds: List[float] = []
    while len(seconds) < MIN_REPEATS or sum(seconds) < MIN_SECONDS:
        run = _C.Replayer(_C.Allocator("virtual", conf, 0), calls)
        run.run()
        seconds.append(run.seconds)
    median = statistics.median(seconds)
    return {
        "replay_seconds": median,
        "events_per_second": len(trace) / median,
        "calls_per_second": len(plan) / median,
        "repeats": len(seconds),
    }


def machine() -> Dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


def markdown(results: List[Dict[str, Any]], meta: Dict[str, Any], table: str) -> str:
    t = meta["throughput"]
    return "\n".join([
        "# Fragmentation benchmark",
        "",
        f"`{meta['command']}` on {meta['date']}, pyalloc {meta['pyalloc']}, "
        f"config `{meta['config'] or 'default'}`, {meta['machine']['cpu']} "
        f"({meta['machine']['cores']} cores), no GPU.",
        "",
        table,
        "",
        LEGEND,
        "",
        f"C++ replay throughput: {t['events_per_second'] / 1e6:.1f} M events/s "
        f"({t['calls_per_second'] / 1e6:.1f} M allocator calls/s) over "
        f"{t['events']} events of {len(results)} traces; the slowest trace ran at "
        f"{t['min_events_per_second'] / 1e6:.1f} M events/s.",
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="pyalloc configuration, 'key:value,...'")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    args = parser.parse_args()

    files = trace_files()
    if not SHARED.is_dir():
        print(f"note: {SHARED} not found; replaying the bundled traces only", file=sys.stderr)
    results, rows = [], []
    for path in files:
        start = time.perf_counter()
        r = replay(path, args.config)
        wall = time.perf_counter() - start
        r.trace = os.path.relpath(path, ROOT.parent if path.is_relative_to(SHARED) else ROOT)
        speed = throughput(path, r.config)
        results.append(r)
        rows.append({**r.to_dict(), "wall_seconds": wall, **speed})

    events = sum(row["events"] for row in rows)
    total_seconds = sum(row["replay_seconds"] for row in rows)
    calls = sum(row["calls_per_second"] * row["replay_seconds"] for row in rows)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/fragmentation.py" + (f" --config '{args.config}'" if args.config else ""),
        "pyalloc": pyalloc.__version__,
        "config": args.config,
        "machine": machine(),
        "throughput": {
            "events": events,
            "events_per_second": events / total_seconds if total_seconds else None,
            "calls_per_second": calls / total_seconds if total_seconds else None,
            "min_events_per_second": min((row["events_per_second"] for row in rows), default=None),
        },
    }
    print(format_table(results))
    t = meta["throughput"]
    if t["events_per_second"] is not None:
        print(f"\nC++ replay: {t['events_per_second'] / 1e6:.1f} M events/s over {events} events")
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fragmentation.md").write_text(markdown(rows, meta, format_table(results, markdown=True)))
        with open(RESULTS / "fragmentation.json", "w") as f:
            json.dump({**meta, "traces": rows}, f, indent=1)
            f.write("\n")
        print(f"wrote {os.path.relpath(RESULTS, Path.cwd())}/fragmentation.{{md,json}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
