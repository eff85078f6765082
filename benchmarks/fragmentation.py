"""Fragmentation benchmark: replays recorded traces through pyalloc and sets its
peak reserved bytes against the least any allocator must hold (peak live) and
against the allocator that recorded the trace (PyTorch's native one, for GPU
snapshots).

Replays every snapshot in ../shared/traces/ and its gpu/ (beside the repository,
where CI keeps the benchmark traces; skipped when absent) and in benchmarks/traces/ (the
bundled ones), prints the table, and writes benchmarks/results/fragmentation.md
and fragmentation.json with the raw numbers, including the C++ replay's
throughput in events per second. Needs no GPU.

    python benchmarks/fragmentation.py [--config CONF] [--strategies bestfit,vmm] [--no-write]
                                       [--previous OLD.json]

Besides the main table (the default configuration, or --config), every trace
is replayed once per strategy, and a second table sets each strategy against
the targets (traces of 1 GiB of peak live or more: smallest budget within 1%,
peak reserved within 5%; smaller ones: 2% and 15%), beside the device calls and
the driver calls (num_driver_calls) of the second half of each trace. With --previous (the
fragmentation.json of an earlier run), a third table says per trace and
strategy what changed since: which trace pays, and how much.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import _git_commit, cpu_model  # noqa: E402
import pyalloc.replay  # noqa: E402
from pyalloc.replay import plan_trace, replay

#: The budget target is 1% of peak live: the search for the smallest budget
#: goes to 0.1% (the replay's default, 1%, can report 1.013 for 1.006).
pyalloc.replay.BUDGET_PRECISION = 0.001
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
    for folder in (SHARED, SHARED / "gpu", BUNDLED):
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
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


#: The targets the strategies are measured against (ratios to peak live): traces
#: of LARGE bytes of peak live or more, and smaller ones.
LARGE = 1 << 30
TARGET_BUDGET, TARGET_RESERVED = 1.01, 1.05
TARGET_BUDGET_SMALL, TARGET_RESERVED_SMALL = 1.02, 1.15


def targets(peak_live: int) -> "tuple[float, float]":
    """(budget, reserved) targets for a trace of this peak live."""
    if peak_live >= LARGE:
        return TARGET_BUDGET, TARGET_RESERVED
    return TARGET_BUDGET_SMALL, TARGET_RESERVED_SMALL


def driver_calls(path: Path, conf: str) -> Dict[str, int]:
    """num_driver_calls of the replay with no cap: all of it, and its second half
    (from the same op on as the replay's second_half_device_calls)."""
    plan = plan_trace(read_trace(path))
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    allocator = _C.Allocator("virtual", conf, 0)
    run = _C.Replayer(allocator, calls)
    run.run(len(plan) // 2)
    half = allocator.stats()["num_driver_calls"]
    run.run()
    total = allocator.stats()["num_driver_calls"]
    return {"driver_calls": total, "second_half_driver_calls": total - half}


def strategy_rows(files: List[Path], strategies: List[str], base: str) -> List[Dict[str, Any]]:
    rows = []
    for path in files:
        row: Dict[str, Any] = {"trace": path.name}
        for strategy in strategies:
            conf = ",".join(c for c in (base, f"strategy:{strategy}") if c)
            r = replay(path, conf)
            live = r.peak_live_bytes
            row["peak_live_bytes"] = live
            row[strategy] = {
                "at_peak_live": r.fragmentation_at_peak,
                "peak_reserved_bytes": r.pyalloc_peak_reserved_bytes,
                "device_calls": r.device_allocs + r.device_frees,
                "second_half_device_calls": r.second_half_device_calls,
                "min_budget_bytes": r.pyalloc_min_budget_bytes,
                "reserved_ratio": r.pyalloc_peak_reserved_bytes / live if live else None,
                "budget_ratio": r.pyalloc_min_budget_bytes / live if live and r.pyalloc_min_budget_bytes else None,
                **driver_calls(path, conf),
            }
            row["native_ratio"] = (r.native_peak_reserved_bytes / live
                                   if live and r.native_peak_reserved_bytes else None)
        rows.append(row)
    return rows


PAGE = 2 << 20  # the virtual-memory page (CUDA's granularity, and the simulated backends')


def why(row: Dict[str, Any], strategy: str) -> str:
    """Where the bytes over peak live sit, at the moment of peak live."""
    r = row[strategy]
    budget_target, reserved_target = targets(row["peak_live_bytes"])
    if r["budget_ratio"] is not None and r["budget_ratio"] <= budget_target and r["reserved_ratio"] <= reserved_target:
        return "targets met"
    at = r["at_peak_live"]
    mib = 1 << 20
    large, small = at.get("large_pool_free_bytes", 0), at.get("small_pool_free_bytes", 0)
    text = (f"at peak live, {(large + small) / mib:.1f} MiB reserved is free: {large / mib:.1f} MiB in the "
            f"large pool, {small / mib:.1f} MiB in small-pool chunks")
    if strategy == "vmm":
        text += (f"; with no cap, pages stay mapped in free holes and the pool grows instead (moving "
                 f"them would map and unmap again on every pass of a workload that repeats); they move "
                 f"only at max_pool_size or on a full device, which the budget measures; pages are "
                 f"mapped whole, so free bytes in pages partly under live blocks stay reserved; one 2 MiB "
                 f"page is {PAGE / row['peak_live_bytes']:.1%} of peak live; handles of up to 32 MiB "
                 f"(with no cap) are unmapped only whole")
    else:
        text += ("; segments are never merged or split across, so free space in one cannot serve a "
                 "request that another needs")
    return text


def strategy_table(rows: List[Dict[str, Any]], strategies: List[str]) -> str:
    def cell(v: Any, target: float) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" + (" ✓" if v <= target else "")

    def calls(v: Any) -> str:
        return "-" if v is None else str(v)

    head = ["trace"]
    for st in strategies:
        head += [f"{st} budget", f"{st} reserved", f"{st} calls", f"{st} driver calls"]
    head.append("native reserved")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["trace"]]
        budget_target, reserved_target = targets(row["peak_live_bytes"])
        for st in strategies:
            cells += [cell(row[st]["budget_ratio"], budget_target), cell(row[st]["reserved_ratio"], reserved_target),
                      calls(row[st]["second_half_device_calls"]), calls(row[st].get("second_half_driver_calls"))]
        cells.append("-" if row["native_ratio"] is None else f"{row['native_ratio']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Where each strategy lands and why (the default strategy first):", ""]
    for st in sorted(strategies, key=lambda x: x != "vmm"):
        for row in rows:
            lines.append(f"- {st}, {row['trace']}: {why(row, st)}.")
    return "\n".join(lines)


def changes_table(rows: List[Dict[str, Any]], strategies: List[str], previous: Dict[str, Any]) -> str:
    """Per trace and strategy: the ratios and the second half's device calls, before -> now."""
    before = {row["trace"]: row for row in previous.get("strategies", [])}

    def pair(old: Any, new: Any, fmt: str) -> str:
        a, b = ("-" if v is None else format(v, fmt) for v in (old, new))
        mark = "" if old is None or new is None or a == b else (" (+)" if new > old else " (-)")
        return f"{a} -> {b}{mark}"

    lines = ["| trace | strategy | budget | reserved | calls | driver calls |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        old_row = before.get(row["trace"], {})
        for st in strategies:
            old, new = old_row.get(st, {}), row[st]
            lines.append(f"| {row['trace']} | {st} | {pair(old.get('budget_ratio'), new['budget_ratio'], '.3f')} | "
                         f"{pair(old.get('reserved_ratio'), new['reserved_ratio'], '.3f')} | "
                         f"{pair(old.get('second_half_device_calls'), new['second_half_device_calls'], 'd')} | "
                         f"{pair(old.get('second_half_driver_calls'), new.get('second_half_driver_calls'), 'd')} |")
    return "\n".join(lines)


def markdown(results: List[Dict[str, Any]], meta: Dict[str, Any], table: str, strategies: str = "",
             changes: str = "") -> str:
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
        "## Strategies against the targets",
        "",
        f"Ratios to peak live: the smallest budget without an OOM (searched to "
        f"{pyalloc.replay.BUDGET_PRECISION:.1%} of it; earlier results to 1%) (target <= {TARGET_BUDGET} on traces of "
        f"1 GiB of peak live or more, {TARGET_BUDGET_SMALL} on smaller ones) and the peak reserved bytes with "
        f"no cap (target <= {TARGET_RESERVED}, {TARGET_RESERVED_SMALL} on smaller ones); ✓ marks a target met. "
        f"calls: the device calls of the replay with no cap in the second half of the trace "
        f"(num_device_alloc + num_device_free: segments reserved and released, page ranges mapped and "
        f"unmapped). driver calls: num_driver_calls over the same half, the CUDA driver calls behind them "
        f"(cuMemAlloc or cuMemFree per segment; cuMemCreate, cuMemMap and cuMemSetAccess per handle mapped, "
        f"cuMemUnmap and cuMemRelease per handle unmapped).",
        "",
        strategies,
        "",
    ] + ([] if not changes else [
        "## Since the previous results",
        "",
        f"Against `{meta['previous']['file']}` (`{meta['previous']['command']}` on {meta['previous']['date']}, "
        f"git {meta['previous'].get('git_commit') or 'unknown'}): budget and reserved as ratios to peak live, "
        "calls as above; (+) marks a figure that rose, (-) one that fell.",
        "",
        changes,
        "",
    ]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="pyalloc configuration, 'key:value,...'")
    parser.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/results alone")
    parser.add_argument("--strategies", default="bestfit,vmm", help="strategies to set against the targets")
    parser.add_argument("--previous", default=None, metavar="OLD.json",
                        help="the fragmentation.json of an earlier run, to say what changed since")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]

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
        "command": "python benchmarks/fragmentation.py" + (f" --config '{args.config}'" if args.config else "")
                   + (f" --previous {args.previous}" if args.previous else ""),
        "pyalloc": pyalloc.__version__,
        "git_commit": _git_commit(),
        "config": args.config,
        "machine": machine(),
        "throughput": {
            "events": events,
            "events_per_second": events / total_seconds if total_seconds else None,
            "calls_per_second": calls / total_seconds if total_seconds else None,
            "min_events_per_second": min((row["events_per_second"] for row in rows), default=None),
        },
    }
    by_strategy = strategy_rows(files, strategies, args.config)
    changes = ""
    if args.previous is not None:
        with open(args.previous) as f:
            previous = json.load(f)
        meta["previous"] = {k: previous.get(k) for k in ("date", "command", "git_commit")}
        meta["previous"]["file"] = os.path.relpath(os.path.abspath(args.previous), ROOT)
        changes = changes_table(by_strategy, strategies, previous)
    print(format_table(results))
    print()
    print(strategy_table(by_strategy, strategies))
    if changes:
        print()
        print(changes)
    t = meta["throughput"]
    if t["events_per_second"] is not None:
        print(f"\nC++ replay: {t['events_per_second'] / 1e6:.1f} M events/s over {events} events")
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fragmentation.md").write_text(
            markdown(rows, meta, format_table(results, markdown=True), strategy_table(by_strategy, strategies),
                     changes))
        with open(RESULTS / "fragmentation.json", "w") as f:
            json.dump({**meta, "traces": rows, "strategies": by_strategy,
                       "targets": {"budget_ratio": TARGET_BUDGET, "reserved_ratio": TARGET_RESERVED,
                                   "budget_ratio_small": TARGET_BUDGET_SMALL,
                                   "reserved_ratio_small": TARGET_RESERVED_SMALL, "large_bytes": LARGE}},
                      f, indent=1)
            f.write("\n")
        print(f"wrote {os.path.relpath(RESULTS, Path.cwd())}/fragmentation.{{md,json}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
