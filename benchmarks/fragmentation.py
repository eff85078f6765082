"""Fragmentation benchmark: replays recorded traces through three allocators,
pyalloc, PyTorch's caching allocator and PyTorch with expandable segments (a
model that makes the device calls real snapshots recorded), and compares them
at equal budgets: the smallest device each completes the trace on, running its
own out-of-memory path, over peak live (the least any allocator must hold).

Replays every device of every snapshot in benchmarks/traces/ (the bundled ones),
../shared/traces/, ../shared/traces/gpu/ and ../shared/traces/h200/ (beside the
repository, where CI keeps the benchmark traces; skipped when absent), and the
random workloads of benchmarks/random_workloads.py (work no allocator was tuned
on), with a progress bar on a terminal. It prints, within 100 columns, a compact
table (budget, uncapped reserved and driver calls of each allocator), its legend
and sentences computed from those figures saying where pyalloc wins, ties and
loses, and writes to benchmarks/out/ (ignored by git; --results DIR elsewhere,
--update-results the committed benchmarks/results/): fragmentation.md (the full
table, the model's validation against each snapshot's own device calls, a
paragraph per trace), fragmentation.json (the raw numbers, with the replays'
throughput) and fragmentation.png (the three measures side by side, per trace;
with matplotlib, else the markdown links no plot). Needs no GPU.

    python benchmarks/fragmentation.py [--config CONF] [--strategies bestfit,vmm] [--no-write]
                                       [--results DIR | --update-results] [--previous OLD.json]
                                       [--traces NAME,...] [--[no-]progress]
                                       [--sweep SEEDS] [--sweep-streams N,...]

The results markdown sets pyalloc against its targets, each against PyTorch
with expandable_segments:True on the same trace: the smallest budget no larger
(and within 1% of peak live on traces recorded on a GPU with 1 GiB of peak live
or more), reserved with no cap at most theirs + 0.02 x peak live, no more device
calls in the second half, driver calls within 1.25 x theirs on the traces
recorded on a GPU; says where a target is missed and why; sets the same uncapped
targets on a sweep of random workloads no table shows (--sweep, seeds 100-129
on one to four streams by default); and says per trace and strategy what
changed since an earlier run (--previous: its fragmentation.json; by default
the committed benchmarks/results/fragmentation.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pyalloc
from pyalloc import _C

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import _git_commit, cpu_model  # noqa: E402
import random_workloads  # noqa: E402
from pyalloc.replay import plan_trace, replay  # noqa: E402
from pyalloc.replay.allocators import ALLOCATORS, min_budget, run_allocator
from pyalloc.replay.report import (LEGEND, TABLE_LEGEND, TIE, WIDTH, format_names, format_table,
                                   plot_comparison, shortened_names, verdicts, wrap)
from pyalloc.replay.result import BUDGET_PRECISION, ReplayResult
from pyalloc.replay.snapshot_io import load_snapshot, read_trace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
BUNDLED = ROOT / "benchmarks" / "traces"
#: The committed results, rewritten only with --update-results.
RESULTS = ROOT / "benchmarks" / "results"
#: Where a run writes by default: ignored by git, so a run leaves the checkout as it was.
OUT = ROOT / "benchmarks" / "out"

#: Each trace is replayed at least this many times, and for at least MIN_SECONDS.
MIN_REPEATS, MIN_SECONDS = 5, 0.5


@dataclass
class Source:
    """A trace to replay: its name in results (`short` in the strategy tables) and
    how to get its snapshot (loaded anew each time: the large ones are not kept)."""
    name: str
    short: str
    load: Callable[[], Dict[str, Any]]


def trace_files() -> List[Path]:
    files: List[Path] = []
    for folder in (BUNDLED, SHARED, SHARED / "gpu", SHARED / "h200"):
        if folder.is_dir():
            files += sorted(p for p in folder.iterdir() if p.name.endswith((".pickle", ".pickle.gz")))
    return files


def label(path: Path) -> str:
    """The trace's name in results: relative to the repository, or to its parent for ../shared."""
    return os.path.relpath(path, ROOT.parent if path.is_relative_to(SHARED) else ROOT)


def sources() -> List[Source]:
    """The recorded traces, then the random workloads."""
    found = [Source(label(p), p.name, lambda p=p: load_snapshot(p)) for p in trace_files()]
    for streams, seed in random_workloads.WORKLOADS:
        name = random_workloads.name(streams, seed)
        found.append(Source(name, name, lambda st=streams, sd=seed: random_workloads.random_snapshot(sd, st)))
    return found


def replay_devices(source: Source, conf: str) -> List[ReplayResult]:
    """One replay per device of the snapshot that has events (every device a row)."""
    snapshot = source.load()
    devices = [d for d, t in enumerate(snapshot["device_traces"]) if t] or [0]
    return [replay(snapshot, conf, device=d, name=source.name) for d in devices]


def throughput(source: Source, conf: str, device: int) -> Dict[str, float]:
    """Replay speed of the C++ replayers alone (the trace already resolved), median of
    repeats: pyalloc's core, and the model of PyTorch's allocator."""
    trace = read_trace(source.load(), device)
    plan = plan_trace(trace)
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    seconds: List[float] = []
    while len(seconds) < MIN_REPEATS or sum(seconds) < MIN_SECONDS:
        run = _C.Replayer(_C.Allocator("virtual", conf, 0), calls)
        run.run()
        seconds.append(run.seconds)
    model: List[float] = []
    while len(model) < MIN_REPEATS:
        model.append(_C.run_torch_model(calls)["seconds"])
    median = statistics.median(seconds)
    return {
        "replay_seconds": median,
        "events_per_second": len(trace) / median,
        "calls_per_second": len(plan) / median,
        "model_seconds": statistics.median(model),
        "repeats": len(seconds),
    }


def machine() -> Dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


#: Issue 42's targets, each against PyTorch with expandable_segments:True on the same trace:
#: the smallest budget at most theirs + BUDGET_TIE (or pyalloc completes on theirs), and at
#: most GPU_BUDGET x peak live on traces recorded on a GPU with LARGE bytes of peak live or
#: more; uncapped reserved at most theirs + RESERVED_SLACK x peak live; second-half device
#: calls no more than theirs; uncapped driver calls at most DRIVER_CALLS x theirs on traces
#: recorded on a GPU. BUDGET_DEVICE: the device (x peak live) whose driver calls are shown.
BUDGET_TIE = 0.002
GPU_BUDGET, LARGE = 1.01, 1 << 30
RESERVED_SLACK = 0.02
DRIVER_CALLS = 1.25
BUDGET_DEVICE = 1.05


def recorded_on_gpu(r: ReplayResult) -> bool:
    """The snapshot holds the recording allocator's segments: recorded on a GPU (profiler
    traces and the random workloads have none)."""
    return r.recorded_peak_reserved_bytes is not None


def driver_calls(source: Source, conf: str) -> Dict[str, int]:
    """num_driver_calls of the replay with no cap: all of it, and its second half
    (from the same op on as the replay's second_half_device_calls)."""
    plan = plan_trace(read_trace(source.load()))
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    allocator = _C.Allocator("virtual", conf, 0)
    run = _C.Replayer(allocator, calls)
    run.run(len(plan) // 2)
    half = allocator.stats()["num_driver_calls"]
    run.run()
    total = allocator.stats()["num_driver_calls"]
    return {"driver_calls": total, "second_half_driver_calls": total - half}


def _quiet(name: str) -> None:
    """A progress callback that shows nothing."""


def strategy_rows(found: List[Source], strategies: List[str], base: str,
                  tick: Callable[[str], None] = _quiet) -> List[Dict[str, Any]]:
    rows = []
    for source in found:
        row: Dict[str, Any] = {"trace": source.short}  # the device with most events
        for strategy in strategies:
            tick(f"{strategy} {source.short}")
            conf = ",".join(c for c in (base, f"strategy:{strategy}") if c)
            r = replay(source.load(), conf, name=source.name)
            live = r.peak_live_bytes
            row["peak_live_bytes"] = live
            row[strategy] = {
                "at_peak_live": r.fragmentation_at_peak,
                "peak_reserved_bytes": r.pyalloc_peak_reserved_bytes,
                "device_calls": r.device_allocs + r.device_frees,
                "second_half_device_calls": r.pyalloc_second_half_device_calls,
                "min_budget_bytes": r.pyalloc_min_budget_bytes,
                "reserved_ratio": r.pyalloc_peak_reserved_bytes / live if live else None,
                "budget_ratio": r.pyalloc_min_budget_bytes / live if live and r.pyalloc_min_budget_bytes else None,
                "budget_missed": budget_missed(r.pyalloc_min_budget_bytes, r.native_expandable_min_budget_bytes,
                                               lambda: _completes_on(r, r.native_expandable_min_budget_bytes,
                                                                     conf, [source])),
                **driver_calls(source, conf),
            }
            row["native_ratio"] = (r.recorded_peak_reserved_bytes / live
                                   if live and r.recorded_peak_reserved_bytes else None)
            # Expandable segments' figures on the same device, and whether it was recorded on a GPU.
            row["native_expandable"] = {
                "reserved_ratio": r.native_expandable_peak_reserved_bytes / live if live else None,
                "budget_ratio": (r.native_expandable_min_budget_bytes / live
                                 if live and r.native_expandable_min_budget_bytes else None),
                "second_half_device_calls": r.native_expandable_second_half_device_calls,
                "driver_calls": r.native_expandable_driver_calls,
            }
            row["recorded_on_gpu"] = recorded_on_gpu(r)
        rows.append(row)
    return rows


PAGE = 2 << 20  # the virtual-memory page (CUDA's granularity, and the simulated backends')


def budget_missed(ours: Optional[int], theirs: Optional[int], completes_on_theirs: Callable[[], bool]) -> bool:
    """The budget target, the one rule the misses and the strategies' marks apply: missed
    where pyalloc's smallest budget is above expandable segments' by more than BUDGET_TIE
    (two bisections of the same precision from different upper ends land either way of a
    tie) and pyalloc does not complete the trace on theirs (asked only then: a replay)."""
    return (ours is not None and theirs is not None and ours > theirs * (1 + BUDGET_TIE)
            and not completes_on_theirs())


def reserved_missed(ours: int, theirs: int, live: int) -> bool:
    """The uncapped reserved target: at most expandable segments' + RESERVED_SLACK x peak live."""
    return ours > theirs + RESERVED_SLACK * live


def calls_missed(ours: Optional[int], theirs: Optional[int]) -> bool:
    """The second-half device calls target: no more than expandable segments' ('-' counts as 0)."""
    return (ours or 0) > (theirs or 0)


def strategy_marks(row: Dict[str, Any], strategy: str) -> Dict[str, bool]:
    """Which of issue 42's targets the strategy meets on the row's trace, against expandable
    segments' figures (the budget by budget_missed(), settled in strategy_rows())."""
    r, e = row[strategy], row["native_expandable"]

    def at_most(ours: Any, theirs: Any, slack: float = 0.0) -> bool:
        return ours is not None and theirs is not None and ours <= theirs + slack
    gpu_large = row["recorded_on_gpu"] and row["peak_live_bytes"] >= LARGE
    return {
        "budget": (r["budget_ratio"] is not None and e["budget_ratio"] is not None and not r["budget_missed"]
                   and (not gpu_large or r["budget_ratio"] <= GPU_BUDGET)),
        "reserved": (r["reserved_ratio"] is not None and e["reserved_ratio"] is not None
                     and not reserved_missed(r["reserved_ratio"], e["reserved_ratio"], 1)),
        "calls": not calls_missed(r["second_half_device_calls"], e["second_half_device_calls"]),
        "driver_calls": (not row["recorded_on_gpu"]
                         or at_most(r.get("driver_calls"), DRIVER_CALLS * (e["driver_calls"] or 0))),
    }


def why(row: Dict[str, Any], strategy: str) -> str:
    """Where the bytes over peak live sit, at the moment of peak live."""
    r = row[strategy]
    if all(strategy_marks(row, strategy).values()):
        return "targets met"
    at = r["at_peak_live"]
    mib = 1 << 20
    large, small = at.get("large_pool_free_bytes", 0), at.get("small_pool_free_bytes", 0)
    text = (f"at peak live, {(large + small) / mib:.1f} MiB reserved is free: {large / mib:.1f} MiB in the "
            f"large pool, {small / mib:.1f} MiB in small-pool chunks")
    if strategy == "vmm":
        text += (f"; with no cap, pages stay mapped in free holes and the pool grows instead (moving "
                 f"them would map and unmap again on every pass of a workload that repeats); they move "
                 f"only at max_pool_size or on a full device, which the budget measures; growth maps "
                 f"ahead to expandable segments' 20 MiB page boundaries; one 2 MiB page is "
                 f"{PAGE / row['peak_live_bytes']:.1%} of peak live")
    else:
        text += ("; segments are never merged or split across, so free space in one cannot serve a "
                 "request that another needs")
    return text


def strategy_table(rows: List[Dict[str, Any]], strategies: List[str]) -> str:
    def cell(v: Any, met: bool, fmt: str = ".3f") -> str:
        if v is None:
            return "-"
        return format(v, fmt) + (" ✓" if met else "")

    def plain(v: Any, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    head = ["trace"]
    for st in strategies:
        head += [f"{st} budget", f"{st} reserved", f"{st} calls", f"{st} driver calls"]
    head += ["expandable budget", "expandable reserved", "expandable calls", "native reserved"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["trace"]]
        for st in strategies:
            met = strategy_marks(row, st)
            cells += [cell(row[st]["budget_ratio"], met["budget"]), cell(row[st]["reserved_ratio"], met["reserved"]),
                      cell(row[st]["second_half_device_calls"], met["calls"], "d"),
                      plain(row[st].get("second_half_driver_calls"), "d")]
        e = row["native_expandable"]
        cells += [plain(e["budget_ratio"]), plain(e["reserved_ratio"]), plain(e["second_half_device_calls"], "d"),
                  plain(row["native_ratio"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Where each strategy lands and why (the default strategy first):", ""]
    for st in sorted(strategies, key=lambda x: x != "vmm"):
        for row in rows:
            lines.append(f"- {st}, {row['trace']}: {why(row, st)}.")
    return "\n".join(lines)


def changes_table(rows: List[Dict[str, Any]], strategies: List[str], previous: Dict[str, Any]) -> str:
    """Per trace and strategy: the ratios, the second half's device and driver calls and the whole
    replay's driver calls, before -> now; expandable segments' figures beside them."""
    before = {row["trace"]: row for row in previous.get("strategies", [])}

    def pair(old: Any, new: Any, fmt: str) -> str:
        a, b = ("-" if v is None else format(v, fmt) for v in (old, new))
        mark = "" if old is None or new is None or a == b else (" (+)" if new > old else " (-)")
        return f"{a} -> {b}{mark}"

    def theirs(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| trace | strategy | budget | reserved | 2nd-half device calls | 2nd-half driver calls | "
             "driver calls | expandable: budget / reserved / 2nd-half device calls / driver calls |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        old_row = before.get(row["trace"], {})
        e = row["native_expandable"]
        for st in strategies:
            old, new = old_row.get(st, {}), row[st]
            lines.append(f"| {row['trace']} | {st} | {pair(old.get('budget_ratio'), new['budget_ratio'], '.3f')} | "
                         f"{pair(old.get('reserved_ratio'), new['reserved_ratio'], '.3f')} | "
                         f"{pair(old.get('second_half_device_calls'), new['second_half_device_calls'], 'd')} | "
                         f"{pair(old.get('second_half_driver_calls'), new.get('second_half_driver_calls'), 'd')} | "
                         f"{pair(old.get('driver_calls'), new.get('driver_calls'), 'd')} | "
                         f"{theirs(e['budget_ratio'], '.3f')} / {theirs(e['reserved_ratio'], '.3f')} / "
                         f"{theirs(e['second_half_device_calls'], 'd')} / {theirs(e['driver_calls'], 'd')} |")
    return "\n".join(lines)


NAMES = {"pyalloc": "pyalloc", "native": "PyTorch", "native_expandable": "PyTorch with expandable segments"}


def _x(n: Any, live: int) -> str:
    return "-" if n is None or not live else f"{n / live:.3f} x"


def prose(r: ReplayResult) -> str:
    """What the replay found on one trace, in a paragraph: who completes on what budget,
    at what price, and where pyalloc does no better."""
    live = r.peak_live_bytes
    name = f"{r.trace} (device {r.device}, peak live {_C.format_bytes(live)})"
    budgets = {a: getattr(r, f"{a}_min_budget_bytes") for a in NAMES}
    if not live or any(v is None for v in budgets.values()):
        return f"- {name}: no budget search (an empty trace, or an allocator that cannot serve it uncapped)."
    parts = []
    for a in NAMES:
        retries = getattr(r, f"{a}_budget_retries")
        extra = f" ({retries} out-of-memory retr{'y' if retries == 1 else 'ies'} there)" if retries else ""
        parts.append(f"{_x(budgets[a], live)} peak live for {NAMES[a]}{extra}")
    text = f"- {name}: the smallest device the trace completes on is " + "; ".join(parts) + ". "
    text += (f"Uncapped, pyalloc reserves {_x(r.pyalloc_peak_reserved_bytes, live)}, PyTorch "
             f"{_x(r.native_peak_reserved_bytes, live)}, with expandable segments "
             f"{_x(r.native_expandable_peak_reserved_bytes, live)}")
    if r.recorded_peak_reserved_bytes is not None:
        text += f"; the recording run held {_x(r.recorded_peak_reserved_bytes, live)}"
    text += ". "
    best_torch = min(budgets["native"], budgets["native_expandable"])
    if budgets["pyalloc"] > best_torch:
        text += (f"pyalloc does no better here: it needs {(budgets['pyalloc'] - best_torch) / live:.1%} of peak "
                 "live more than PyTorch's best. ")
    elif budgets["pyalloc"] >= best_torch - TIE * best_torch:
        text += f"pyalloc does no better here: within the search's {TIE:.1%} of PyTorch's best. "
    else:
        text += f"pyalloc saves {(best_torch - budgets['pyalloc']) / live:.1%} of peak live over PyTorch's best. "
    calls = [getattr(r, f"{a}_second_half_device_calls") for a in NAMES]
    text += "Device calls in the second half: " + ", ".join(
        f"{NAMES[a]} {'-' if c is None else c}" for a, c in zip(NAMES, calls)) + "."
    v = r.validation
    if v is not None:
        text += (f" The model of the recording allocator ({v['allocator']}) makes {v['matched_calls']} of its "
                 f"{v['recorded_calls']} recorded device calls, in order.")
    return text


# Why each kind of miss happens, and what was measured trying to remove it.
MISS_REASONS = {
    "sweep_reserved": (
        "Reserved on the sweep's workloads of several streams: pyalloc's large area is one range for "
        "every stream, where expandable segments keep one per stream, so a random workload's blocks of "
        "two streams lie side by side and a hole one stream's frees leave is bounded by the other's live "
        "blocks. On average that holds less (two streams: the sweep table), on these workloads more: on "
        "random-2-streams-seed127, at its peak, a 56.6 MiB request finds 315.6 MiB free in 43 holes of "
        "the large area, the largest 45.6 MiB, and the area grows from 1218 to 1298 MiB; "
        "random-2-streams-seed155 (seeds 130 to 159) holds 1.370 x peak live against 1.300, its 63.9 MiB "
        "request at its peak finding 398.8 MiB free in 33 holes, the largest 56.8 MiB. Growth of one "
        "20 MiB page whatever the streams left them at 1.301 and 1.370 x."),
    "sweep_second_half_calls": (
        "Second-half device calls on the sweep's workloads of several streams: expandable segments keep a "
        "range per stream, each grown early to its own stream's high-water mark; they hold more (the sweep "
        "table) and seldom grow late. pyalloc's one range, holding less, grows where the streams' combined "
        "high-water mark rises late in the trace: random-3-streams-seed103's large area grows twice in its "
        "second half (1.293 x peak live) where expandable segments, at 1.492 x, never do. Growth of a "
        "20 MiB page per stream the pool serves (csrc/core/vmm.cpp) took such misses from 12 to 5 of 180 "
        "unseen workloads of two to four streams (seeds 100 to 159); of one page whatever the streams, "
        "pyalloc made 2120 second-half device calls on them against expandable segments' 3252, now 1623."),
}


#: Devices a trace is replayed on beside the unbounded one: an 80 GiB GPU, a
#: snug one (peak live + 10%, rounded up to a GiB), the size a user picks a batch
#: to fill, one of BUDGET_DEVICE x peak live, and the smallest device expandable
#: segments complete on (equal budgets: the device where a user of expandable
#: segments is out of room). pyalloc
#: sizes its handles and maps ahead by the room the device has left
#: (csrc/core/vmm.cpp), and moves pages out of holes where it has none, so its
#: driver calls depend on the device.
DEVICE_80 = 80 << 30


def snug_device(peak_live: int) -> int:
    return -(-peak_live * 11 // 10 // (1 << 30)) * (1 << 30)


def _calls_of(r: ReplayResult, found: List[Source]) -> Any:
    [source] = [s for s in found if s.name == r.trace]
    plan = plan_trace(read_trace(source.load(), r.device))
    return _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)


def device_rows(results: List[ReplayResult], conf: str, found: List[Source],
                tick: Callable[[str], None] = _quiet) -> List[Dict[str, Any]]:
    """The three allocators on an 80 GiB device, a snug one, one of BUDGET_DEVICE x peak live and
    expandable segments' smallest, per trace."""
    rows = []
    for r in results:
        tick(f"devices {os.path.basename(r.trace)}")
        if not r.peak_live_bytes:
            continue
        calls = _calls_of(r, found)
        sizes = [(DEVICE_80, "fixed"), (snug_device(r.peak_live_bytes), "snug"),
                 (int(r.peak_live_bytes * BUDGET_DEVICE), "budget")]
        if r.native_expandable_min_budget_bytes is not None:
            sizes.append((r.native_expandable_min_budget_bytes, "expandable's smallest"))
        for device, kind in sizes:
            row: Dict[str, Any] = {"trace": r.trace, "device": r.device, "device_bytes": device,
                                   "device_kind": kind, "peak_live_bytes": r.peak_live_bytes}
            for name in ALLOCATORS:
                row[name] = asdict(run_allocator(calls, name, capacity=device,
                                                 conf=conf if name == "pyalloc" else ""))
            rows.append(row)
    return rows


def device_label(row: Dict[str, Any]) -> str:
    """A device of the table: whole GiB, or expandable segments' smallest as a ratio to peak live."""
    if row.get("device_kind") == "expandable's smallest":
        return f"{row['device_bytes'] / row['peak_live_bytes']:.3f} x peak live (e's smallest)"
    if row.get("device_kind") == "budget":
        return f"{BUDGET_DEVICE:.2f} x peak live"
    return f"{row['device_bytes'] >> 30} GiB"


def device_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| trace | device | device size | reserved / peak live (p/n/e) | OOMs (p/n/e) "
             "| driver calls (p/n/e) | 2nd-half device calls (p/n/e) |", "|" + " --- |" * 7]
    for row in rows:
        runs, live = [row[name] for name in ALLOCATORS], row["peak_live_bytes"]

        def cell(key: str, fmt: str = "d") -> str:
            values = [run[key] for run in runs]
            worse = None not in values[::2] and values[0] > values[2]  # pyalloc above expandable segments
            return "/".join("-" if v is None else format(v, fmt) for v in values) + (" ✗" if worse else "")
        reserved = "/".join(f"{run['peak_reserved_bytes'] / live:.3f}" for run in runs)
        lines.append(f"| {row['trace']} | {row['device']} | {device_label(row)} | {reserved} | "
                     f"{cell('ooms')} | {cell('driver_calls')} | {cell('second_half_device_calls')} |")
    return "\n".join(lines)


def _completes_on(r: ReplayResult, budget: int, conf: str, found: List[Source]) -> bool:
    """Whether pyalloc serves the trace's whole device on `budget` bytes (a bisection's tie settled)."""
    return run_allocator(_calls_of(r, found), "pyalloc", capacity=budget, stop_on_oom=True, conf=conf).completed


#: The page size of the what-if replay beside each smallest budget missed: how much of
#: the miss is CUDA's 2 MiB page (free bytes in pages partly under live blocks).
WHAT_IF_PAGE = 64 << 10


def budget_with_pages(r: ReplayResult, conf: str, found: List[Source], page_size: int) -> int:
    """pyalloc's smallest budget for r's trace on a device whose pages are `page_size`
    bytes (a what-if: CUDA maps 2 MiB), bisected as the table's budgets are."""
    calls = _calls_of(r, found)
    unbounded = run_allocator(calls, "pyalloc", conf=conf, page_size=page_size)
    budget, _ = min_budget(calls, conf, r.peak_live_bytes, unbounded.peak_reserved_bytes, page_size=page_size)
    return budget


def target_misses(results: List[ReplayResult], conf: str, traces: List[Source],
                  swept: List[Dict[str, Any]] = (), tick: Callable[[str], None] = _quiet) -> str:
    """pyalloc's misses of its targets, against expandable segments: the figures trace by
    trace (and on the sweep's workloads), then why, kind by kind."""
    found: Dict[str, List[str]] = {}
    for r in results:
        tick(f"targets {os.path.basename(r.trace)}")
        live = r.peak_live_bytes
        if not live:
            continue
        name = f"{r.trace} (device {r.device})"
        ours_b, theirs_b = r.pyalloc_min_budget_bytes, r.native_expandable_min_budget_bytes
        if budget_missed(ours_b, theirs_b, lambda: _completes_on(r, theirs_b, conf, traces)):
            small_pages = budget_with_pages(r, conf, traces, WHAT_IF_PAGE)
            found.setdefault("budget", []).append(
                f"{name}: {ours_b / live:.4f} x peak live against {theirs_b / live:.4f}; pyalloc with "
                f"{WHAT_IF_PAGE >> 10} KiB pages {small_pages / live:.4f}")
        if recorded_on_gpu(r) and live >= LARGE and ours_b is not None and ours_b > GPU_BUDGET * live:
            found.setdefault("budget_gpu", []).append(f"{name}: {ours_b / live:.4f} x peak live")
        theirs_r = r.native_expandable_peak_reserved_bytes
        if theirs_r is not None and reserved_missed(r.pyalloc_peak_reserved_bytes, theirs_r, live):
            found.setdefault("reserved", []).append(
                f"{name}: {r.pyalloc_peak_reserved_bytes / live:.3f} x peak live against {theirs_r / live:.3f}")
        if calls_missed(r.pyalloc_second_half_device_calls, r.native_expandable_second_half_device_calls):
            found.setdefault("second_half_calls", []).append(
                f"{name}: {r.pyalloc_second_half_device_calls} against "
                f"{r.native_expandable_second_half_device_calls}")
        if (recorded_on_gpu(r) and r.pyalloc_driver_calls is not None and r.native_expandable_driver_calls
                and r.pyalloc_driver_calls > DRIVER_CALLS * r.native_expandable_driver_calls):
            found.setdefault("driver_calls", []).append(
                f"{name}: {r.pyalloc_driver_calls} against {r.native_expandable_driver_calls}")
    for w in swept:
        if w["reserved_missed"]:
            found.setdefault("sweep_reserved", []).append(
                f"{w['name']}: {w['pyalloc_reserved_ratio']:.3f} x peak live against "
                f"{w['expandable_reserved_ratio']:.3f}")
        if w["calls_missed"]:
            found.setdefault("sweep_second_half_calls", []).append(
                f"{w['name']}: {w['pyalloc_second_half_device_calls']} against "
                f"{w['expandable_second_half_device_calls']} (reserved {w['pyalloc_reserved_ratio']:.3f} x "
                f"peak live against {w['expandable_reserved_ratio']:.3f})")
    if not found:
        return "Every target is met on every trace and device, and on every workload of the sweep."
    lines = []
    order = ["budget", "budget_gpu", "reserved", "second_half_calls", "driver_calls", "sweep_reserved",
             "sweep_second_half_calls"]
    for kind, misses in sorted(found.items(), key=lambda kv: order.index(kv[0])):
        reason = MISS_REASONS.get(kind, f"{kind}: missed here, not explained yet.")
        lines += [reason, ""] + [f"- {m}" for m in misses] + [""]
    return "\n".join(lines).rstrip()


def sweep(seeds: List[int], stream_counts: List[int], conf: str,
          tick: Callable[[str], None] = _quiet) -> List[Dict[str, Any]]:
    """The uncapped targets (reserved, second-half device calls) on random workloads no table
    shows: pyalloc and expandable segments, no budget search."""
    out = []
    for streams in stream_counts:
        for seed in seeds:
            tick(f"sweep {random_workloads.name(streams, seed)}")
            plan = plan_trace(read_trace(random_workloads.random_snapshot(seed, streams), 0))
            calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
            ours = run_allocator(calls, "pyalloc", conf=conf)
            theirs = run_allocator(calls, "native_expandable")
            live = plan.peak_live_bytes
            out.append({
                "name": random_workloads.name(streams, seed), "streams": streams, "seed": seed,
                "peak_live_bytes": live,
                "pyalloc_reserved_ratio": ours.peak_reserved_bytes / live,
                "expandable_reserved_ratio": theirs.peak_reserved_bytes / live,
                "pyalloc_second_half_device_calls": ours.second_half_device_calls,
                "expandable_second_half_device_calls": theirs.second_half_device_calls,
                "reserved_missed": reserved_missed(ours.peak_reserved_bytes, theirs.peak_reserved_bytes, live),
                "calls_missed": calls_missed(ours.second_half_device_calls, theirs.second_half_device_calls),
            })
    return out


def sweep_table(swept: List[Dict[str, Any]]) -> str:
    """Per stream count: workloads, mean reserved, and the misses of each uncapped target."""
    lines = ["| streams | workloads | mean reserved / peak live (p/e) | reserved missed | "
             "2nd-half device calls missed | 2nd-half device calls, all (p/e) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for streams in sorted({w["streams"] for w in swept}):
        ws = [w for w in swept if w["streams"] == streams]
        mean = [statistics.mean(w[k] for w in ws) for k in ("pyalloc_reserved_ratio", "expandable_reserved_ratio")]
        calls = [sum(w[k] or 0 for w in ws) for k in ("pyalloc_second_half_device_calls",
                                                      "expandable_second_half_device_calls")]
        lines.append(f"| {streams} | {len(ws)} | {mean[0]:.3f}/{mean[1]:.3f} | "
                     f"{sum(w['reserved_missed'] for w in ws)} | {sum(w['calls_missed'] for w in ws)} | "
                     f"{calls[0]}/{calls[1]} |")
    return "\n".join(lines)


def validation_table(results: List[ReplayResult]) -> str:
    lines = ["| trace | device | model | matched / recorded | by action | seeded segments | recording's releases |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        v = r.validation
        if v is None:
            continue
        actions = ", ".join(f"{a} {m}/{n}" for a, (m, n) in v["by_action"].items())
        lines.append(f"| {r.trace} | {r.device} | {v['allocator']} | {v['matched_calls']}/{v['recorded_calls']} | "
                     f"{actions} | {v['seeded_segments']} | {v['releases']} |")
    return "\n".join(lines)


def markdown(results: List[ReplayResult], meta: Dict[str, Any], found: List[Source], strategies: str = "",
             changes: str = "", devices: List[Dict[str, Any]] = (), swept: List[Dict[str, Any]] = (),
             plot: Optional[str] = None, misses: Optional[str] = None) -> str:
    """The results markdown. plot: the file name of the plot written beside it (None: no
    plot, and no link to one); misses: target_misses(), computed here when not given."""
    t = meta["throughput"]
    if misses is None:
        misses = target_misses(results, meta["config"], found, swept)
    return "\n".join([
        "# Fragmentation benchmark",
        "",
        f"`{meta['command']}` on {meta['date']}, pyalloc {meta['pyalloc']}, "
        f"config `{meta['config'] or 'default'}`, {meta['machine']['cpu']} "
        f"({meta['machine']['cores']} cores), no GPU.",
        "",
    ] + ([f"![budget, uncapped reserved and driver calls per trace, three allocators]({plot})", ""] if plot
         else []) + [
        format_table(results, markdown=True),
        "",
        LEGEND,
        "",
        "## Where pyalloc wins, ties and loses",
        "",
        f"Computed from the table above: lower is better on every measure, and figures within {TIE:.1%} of "
        "each other are a tie. Traces go by their file names without extension"
        + (", long ones by their first words:" if shortened_names(results) else "."),
        "",
    ] + [f"- `{short}`: {stem}" for short, stem in shortened_names(results)] + (
        [""] if shortened_names(results) else []) + [f"- {sentence}" for sentence in verdicts(results)] + [
        "",
        "The random-* rows are the random workloads of benchmarks/random_workloads.py, traces no "
        "allocator was tuned on: 20000 calls, log-uniform sizes from 512 B to 64 MiB, frees at random, up "
        "to 2 GiB live, on one to four streams; nothing repeats. The h200/ traces were recorded by this "
        "project on an NVIDIA H200 (141 GB), each workload under PyTorch's default allocator and under "
        "expandable segments (the -native_expandable- file): the same requests, so the same rows but for "
        "the recorded column. On that GPU the replay of pyalloc as it was at commit 4ec56a2 predicted "
        "its live peak reserved on bert_infer to the byte (benchmarks/results/gpu-2026-11-28-h200-4ec56a2): "
        "the replay takes the decisions the CUDA backend takes; the policy replayed here has not run there.",
        "",
        f"C++ replay throughput: pyalloc {t['events_per_second'] / 1e6:.1f} M events/s "
        f"({t['calls_per_second'] / 1e6:.1f} M allocator calls/s) over {t['events']} events of "
        f"{len(results)} traces and devices; the slowest ran at {t['min_events_per_second'] / 1e6:.1f} M events/s. "
        f"The model of PyTorch's allocator replays them all in {t['model_seconds'] * 1e3:.1f} ms; the whole "
        f"benchmark's replays, budget searches and validation took {t['wall_seconds']:.1f} s.",
        "",
        "## The model against the snapshots' own device calls",
        "",
        "Where a snapshot records PyTorch's device calls, the model of the allocator that recorded it, started "
        "from the segments present before the trace (the blocks then live at their addresses) and given the "
        "recording run's own releases (each recorded segment_free / segment_unmap is one: the model, uncapped, "
        "never releases on its own), placing every cudaMalloc itself, makes these of the recorded calls, "
        "in order, with the same sizes, for the same allocations (pyalloc/replay/validate.py).",
        "",
        validation_table(results),
        "",
        "## On a device of a size",
        "",
        "The tables above replay with no cap on a device of unbounded size. pyalloc sizes its handles "
        "and maps ahead by the room its device has left, so here pyalloc and PyTorch's expandable "
        "segments replay each trace on an 80 GiB device, on a snug one (peak live + 10%, rounded up "
        f"to a GiB: the device a user fills by choosing the batch), on one of {BUDGET_DEVICE} x peak live "
        "and on the smallest device expandable "
        "segments complete on (e's smallest: equal budgets where a user of expandable segments runs out "
        "of room), with PyTorch's default allocator, each running its own out-of-memory path. These are "
        "shown, not targets. p/n/e as in the first table; ✗ marks a figure of pyalloc's "
        "above expandable segments' (PyTorch's default makes one cudaMalloc per segment: on the 80 GiB "
        "and snug devices of every recorded trace it makes fewer driver calls than either and reserves "
        "more than pyalloc; on constructor-sun's device 1 it refuses an allocation on 80 GiB where "
        "the other two complete, and on expandable segments' smallest device it refuses allocations on "
        "most: its OOMs column).",
        "",
        device_table(list(devices)) if devices else "(not run)",
        "",
        "## Per trace",
        "",
    ] + [prose(r) for r in results] + [
        "",
        "## Where pyalloc misses its targets, and why",
        "",
        "Targets (issue 42), each against PyTorch with expandable_segments:True on the same trace: the "
        f"smallest budget no larger (bisected to {BUDGET_PRECISION:.1%} here; above theirs "
        f"by more than {BUDGET_TIE:.1%}, pyalloc must complete the trace on theirs), and within "
        f"{GPU_BUDGET - 1:.0%} of peak live on the traces recorded on a GPU (the recorded column) with "
        f"{LARGE >> 30} GiB of peak live or more; uncapped reserved at most theirs + {RESERVED_SLACK} x peak "
        "live; no more device calls in the second half; uncapped driver calls at most "
        f"{DRIVER_CALLS} x theirs on the traces recorded on a GPU. A loop that repeats exactly makes no "
        "device call after its first pass (tests/core/test_steady_state.py). The uncapped targets are also "
        "set on the sweep below.",
        "",
        misses,
        "",
    ] + ([] if not swept else [
        "## Random workloads no table shows",
        "",
        f"The uncapped targets on {len(swept)} more random workloads (seeds "
        f"{min(w['seed'] for w in swept)} to {max(w['seed'] for w in swept)}, on "
        f"{', '.join(str(n) for n in sorted({w['streams'] for w in swept}))} streams), "
        "pyalloc (p) against expandable segments (e): the reserved target missed where pyalloc holds more "
        f"than theirs + {RESERVED_SLACK} x peak live, the calls target where it makes more device calls in "
        "the second half.",
        "",
        sweep_table(list(swept)),
        "",
    ]) + [
        "## pyalloc's strategies against the targets",
        "",
        f"Ratios to peak live: the smallest budget without an OOM (searched to "
        f"{BUDGET_PRECISION:.1%} of it) and the peak reserved bytes with no cap, each beside "
        "expandable segments' on the trace's device with most events; ✓ marks a target of the section above "
        "met, by the rules stated there. "
        f"calls: the device calls of the replay with no cap in the second half of the trace "
        f"(num_device_alloc + num_device_free: segments reserved and released, page ranges mapped and "
        f"unmapped). driver calls: num_driver_calls over the same half, the CUDA driver calls behind them "
        f"(cuMemAlloc or cuMemFree per segment; cuMemCreate and cuMemMap per handle mapped, one cuMemSetAccess "
        f"per range mapped at once, "
        f"cuMemUnmap and cuMemRelease per handle unmapped).",
        "",
        strategies,
        "",
    ] + ([] if not changes else [
        "## Since the previous results",
        "",
        f"Against `{meta['previous']['file']}` (`{meta['previous']['command']}` on {meta['previous']['date']}, "
        f"git {meta['previous'].get('git_commit') or 'unknown'}): budget and reserved as ratios to peak live, "
        "calls as above (the strategies' own replays, no cap); (+) marks a figure that rose, (-) one that fell.",
        "",
        changes,
        "",
    ]))


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the current folder where under it."""
    path = path.resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def select(found: List[Source], names: Optional[str]) -> List[Source]:
    """The sources `--traces` names (file names without .pickle / .pickle.gz, or random
    workload names), in their order; all of them for None. An unknown name is an error."""
    if names is None:
        return found
    wanted = [n for n in names.split(",") if n]
    stems = [s.short.removesuffix(".gz").removesuffix(".pickle") for s in found]
    unknown = [n for n in wanted if n not in stems]
    if unknown:
        raise SystemExit(f"fragmentation.py: error: --traces: no trace named {', '.join(unknown)} "
                         f"(known: {', '.join(stems)})")
    return [s for s, stem in zip(found, stems) if stem in wanted]


class Progress:
    """One tqdm bar on stderr over every step of the run, each step named as it
    starts; within WIDTH columns; by default only on a terminal."""

    def __init__(self, total: int, enabled: Optional[bool]) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="replaying", unit="step", file=sys.stderr, leave=False,
                         disable=None if enabled is None else not enabled,
                         ncols=min(WIDTH, shutil.get_terminal_size().columns))
        self._started = False

    def __call__(self, name: str) -> None:
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(name[:30])

    def add(self, steps: int) -> None:
        self._bar.total += steps
        self._bar.refresh()

    def close(self) -> None:
        if self._started:
            self._bar.update(1)
        self._bar.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="pyalloc configuration, 'key:value,...'")
    parser.add_argument("--no-write", action="store_true", help="print only; write no results")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--results", default=None, metavar="DIR",
                       help=f"where to write fragmentation.{{md,json,png}} (default: {_shown(OUT)}, which git "
                            "ignores)")
    where.add_argument("--update-results", action="store_true",
                       help=f"write the committed results, {_shown(RESULTS)}, instead")
    parser.add_argument("--strategies", default="bestfit,vmm", help="strategies to set against the targets")
    parser.add_argument("--previous", default=None, metavar="OLD.json",
                        help="the fragmentation.json of an earlier run, to say what changed since (default: "
                             f"the committed {_shown(RESULTS / 'fragmentation.json')})")
    parser.add_argument("--traces", default=None, metavar="NAME,...",
                        help="replay only these traces: file names without .pickle / .pickle.gz, or random "
                             "workload names")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar on stderr (default: when it is a terminal)")
    parser.add_argument("--sweep", default="100-129", metavar="SEEDS",
                        help="seeds (FIRST-LAST) of the random workloads the uncapped targets are also set on "
                             "(default 100-129; '' for none)")
    parser.add_argument("--sweep-streams", default="1,2,3,4", metavar="N,...",
                        help="stream counts of the sweep's workloads (default 1,2,3,4)")
    args = parser.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    results_dir = RESULTS if args.update_results else Path(args.results) if args.results else OUT
    previous_file = args.previous
    if previous_file is None and (RESULTS / "fragmentation.json").is_file():
        previous_file = str(RESULTS / "fragmentation.json")

    found = select(sources(), args.traces)
    if not SHARED.is_dir() and args.traces is None:
        print(f"note: {_shown(SHARED)} not found; replaying the bundled traces only", file=sys.stderr)
    bar = Progress(len(found) * (1 + len(strategies)), args.progress)
    start = time.perf_counter()
    results: List[ReplayResult] = []
    rows = []
    for source in found:
        bar(f"replay {source.short}")
        for r in replay_devices(source, args.config):
            results.append(r)
            rows.append({**r.to_dict(), **throughput(source, r.config, r.device)})
    wall = time.perf_counter() - start
    bar.add(len(results) * (1 if args.no_write else 2))  # the devices of a size, then the targets

    events = sum(row["events"] for row in rows)
    total_seconds = sum(row["replay_seconds"] for row in rows)
    calls = sum(row["calls_per_second"] * row["replay_seconds"] for row in rows)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/fragmentation.py" + (f" --config '{args.config}'" if args.config else "")
                   + (f" --traces {args.traces}" if args.traces else "")
                   + (f" --previous {args.previous}" if args.previous else "")
                   + (f" --sweep '{args.sweep}'" if args.sweep != "100-129" else "")
                   + (f" --sweep-streams {args.sweep_streams}" if args.sweep_streams != "1,2,3,4" else ""),
        "pyalloc": pyalloc.__version__,
        "git_commit": _git_commit(),
        "config": args.config,
        "machine": machine(),
        "throughput": {
            "events": events,
            "events_per_second": events / total_seconds if total_seconds else None,
            "calls_per_second": calls / total_seconds if total_seconds else None,
            "min_events_per_second": min((row["events_per_second"] for row in rows), default=None),
            "model_seconds": sum(row["model_seconds"] for row in rows),
            "wall_seconds": wall,
        },
    }
    by_strategy = strategy_rows(found, strategies, args.config, bar)
    devices = device_rows(results, args.config, found, bar)
    swept: List[Dict[str, Any]] = []
    if args.sweep:
        first, _, last = args.sweep.partition("-")
        seeds = list(range(int(first), int(last or first) + 1))
        stream_counts = [int(n) for n in args.sweep_streams.split(",") if n]
        bar.add(len(seeds) * len(stream_counts))
        swept = sweep(seeds, stream_counts, args.config, bar)
    changes = ""
    if previous_file is not None:
        with open(previous_file) as f:
            previous = json.load(f)
        meta["previous"] = {k: previous.get(k) for k in ("date", "command", "git_commit")}
        meta["previous"]["file"] = os.path.relpath(os.path.abspath(previous_file), ROOT)
        changes = changes_table(by_strategy, strategies, previous)
    misses = None if args.no_write else target_misses(results, args.config, found, swept, bar)
    bar.close()

    # The terminal gets the compact table, its legend and the verdicts; the markdown has the rest.
    print(format_table(results))
    names = format_names(results)
    if names:
        print("\n" + names)
    print("\n" + wrap(TABLE_LEGEND))
    t = meta["throughput"]
    if t["events_per_second"] is not None:
        print("\n" + wrap(f"{len(results)} traces and devices, {events} events: pyalloc's replay "
                          f"{t['events_per_second'] / 1e6:.1f} M events/s, PyTorch's model "
                          f"{t['model_seconds'] * 1e3:.1f} ms for all; {wall:.1f} s with the budget searches "
                          "and validation."))
    print()
    for sentence in verdicts(results):
        print(wrap(sentence))
    print()
    if args.no_write:
        print("wrote nothing (--no-write)")
        return 0
    results_dir.mkdir(parents=True, exist_ok=True)
    try:
        plot_comparison(results, str(results_dir / "fragmentation.png"))
        plot, written = "fragmentation.png", "{md,json,png}"
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        plot, written = None, "{md,json}"
        print(wrap('no plot: matplotlib is not installed (pip install ".[plot]", as the README\'s command for '
                   "the main job does)"))
    (results_dir / "fragmentation.md").write_text(
        markdown(results, meta, found, strategy_table(by_strategy, strategies), changes, devices, swept,
                 plot, misses))
    with open(results_dir / "fragmentation.json", "w") as f:
        json.dump({**meta, "traces": rows, "strategies": by_strategy, "devices": devices, "sweep": swept,
                   "targets": {"against": "native_expandable", "budget_tie": BUDGET_TIE,
                               "gpu_budget_ratio": GPU_BUDGET, "large_bytes": LARGE,
                               "reserved_slack_of_peak_live": RESERVED_SLACK,
                               "driver_calls_ratio": DRIVER_CALLS, "budget_device_ratio": BUDGET_DEVICE}},
                  f, indent=1)
        f.write("\n")
    files = f"{_shown(results_dir)}/fragmentation.{written}"
    if args.update_results:
        print(f"wrote {files}: the committed results, updated")
    elif args.results is None:
        print(f"wrote {files} (untracked; --update-results: {_shown(RESULTS)}/)")
    else:
        print(f"wrote {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
