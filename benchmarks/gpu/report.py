"""The results file of the GPU benchmark: JSON, a markdown table and PNG plots.

One JSON file holds everything measured on one GPU on one date, and grows with
each command that runs more workloads (a GPU command is limited in time, so the
whole benchmark takes several). Its layout:

    {"schema": 1, "device": {...}, "environment": {...}, "invocations": [{command, started, ...}],
     "workloads": {name: {"title", "kind", "size_name",
                          "runs":   {allocator: worker result},
                          "search": {"budget": bytes, allocator: search result},
                          "trace":  {...}}}}

``alloc_speed``'s runs are several processes per allocator, alternated in rounds:
its ``runs[allocator]`` is combine_speed() of them (each case's median over the
processes and their min-max, the processes themselves under "processes").

The markdown and the plots are always rendered from the JSON, so they can be
rebuilt at any time (``python -m benchmarks.gpu --render FILE.json``). Ratios
are another allocator's figure over the native allocator's. A time is a tie
when the spread measured around it overlaps native's (speed_verdict,
step_comparison): differences within the noise are not reported as wins or losses.
"""
from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

SCHEMA = 1
BASELINE = "native"
ALLOCATOR_ORDER = ("native", "pyalloc", "pyalloc_hooks", "native_expandable", "native_async")
#: The allocators that are pyalloc: by its default route (the bridge where it builds),
#: and through CUDAPluggableAllocator's C hooks.
PYALLOC_ALLOCATORS = ("pyalloc", "pyalloc_hooks")
#: Step times within this fraction of native count as a tie whatever their spread: one
#: run per allocator cannot see the noise between processes (llm_train's median step on
#: an H200: 1.013 x native at 1ceb995, 1.000 x at 4ec56a2 that day, the allocator's code
#: unchanged between them), which was about this large.
#: alloc_speed, measured over several processes, uses their spread alone.
TIME_TOLERANCE = 0.02
#: Memory figures within this fraction of native count as a tie.
MEMORY_TOLERANCE = 0.01
GiB = 1 << 30
README_BEGIN = "<!-- gpu-results:begin -->"
README_END = "<!-- gpu-results:end -->"
PLOTS = ("speed", "memory", "timeline", "batch")


# ---------------------------------------------------------------------------
# The JSON file
# ---------------------------------------------------------------------------


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def results_stem(device: Dict[str, Any], date: str) -> str:
    """gpu-<date>-<device> (or cpu-... for smoke runs on a CPU)."""
    kind = "gpu" if device.get("device_type") == "cuda" else "cpu"
    return f"{kind}-{date}-{slug(device.get('name') or 'unknown')}"


def new_results(device: Dict[str, Any], environment: Dict[str, Any]) -> Dict[str, Any]:
    return {"schema": SCHEMA, "device": device, "environment": environment, "invocations": [], "workloads": {}}


def load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        results = json.load(f)
    if results.get("schema") != SCHEMA:
        raise ValueError(f"{path}: results schema {results.get('schema')!r}, expected {SCHEMA}")
    return results


def save(results: Dict[str, Any], path: str) -> None:
    """Writes the JSON atomically, so a run killed mid-write leaves the previous file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def workload_entry(results: Dict[str, Any], name: str, title: str, kind: str, size_name: str) -> Dict[str, Any]:
    entry = results["workloads"].setdefault(name, {"runs": {}})
    entry.update(title=title, kind=kind, size_name=size_name)
    return entry


# ---------------------------------------------------------------------------
# Figures derived from the runs
# ---------------------------------------------------------------------------


def pyalloc_strategies(results: Dict[str, Any]) -> List[str]:
    """The strategies pyalloc's pools really used in the runs (worker's pyalloc_settings)."""
    seen = set()
    for entry in results.get("workloads", {}).values():
        for name in PYALLOC_ALLOCATORS:
            run = entry.get("runs", {}).get(name) or {}
            settings = run.get("pyalloc_settings") or {}
            if settings.get("strategy"):
                seen.add(settings["strategy"])
    return sorted(seen)


def pyalloc_routes(results: Dict[str, Any]) -> Dict[str, List[str]]:
    """{allocator: the routes its runs really took ("bridge", "hooks")} for pyalloc's
    allocators (worker's pyalloc_route): "pyalloc" takes the bridge only where it builds."""
    seen: Dict[str, set] = {}
    for entry in results.get("workloads", {}).values():
        for name in PYALLOC_ALLOCATORS:
            route = (entry.get("runs", {}).get(name) or {}).get("pyalloc_route")
            if route:
                seen.setdefault(name, set()).add(route)
    return {name: sorted(seen[name]) for name in PYALLOC_ALLOCATORS if name in seen}


def allocators(results: Dict[str, Any]) -> List[str]:
    """Every allocator that has a run or a search, native first."""
    seen = set()
    for entry in results["workloads"].values():
        seen.update(entry.get("runs", {}))
        seen.update(k for k in entry.get("search", {}) if k != "budget")
    known = [a for a in ALLOCATOR_ORDER if a in seen]
    return known + sorted(seen - set(known))


def _ok(run: Optional[Dict[str, Any]]) -> bool:
    return bool(run) and run.get("status") == "ok"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def combine_speed(processes: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One allocator's alloc_speed processes (worker results) as one run: each case's
    median over the processes of what a pair costs beyond torch.empty(0) ("net_ns"),
    with its min and max, the raw and baseline medians, and pyalloc's core in C++
    where measured. "ok" when every process finished; else the first failure's status."""
    good = [p for p in processes if p.get("status") == "ok"]
    bad = [p for p in processes if p.get("status") != "ok"]
    run: Dict[str, Any] = {"status": "ok" if processes and not bad else (bad[0].get("status") if bad else "no run"),
                           "processes": processes, "wall_s": sum(p.get("wall_s") or 0 for p in processes)}
    if bad:
        run["error"] = f"{len(bad)} of {len(processes)} processes: " + str(bad[0].get("error"))
    for key in ("pyalloc_route", "pyalloc_settings"):
        if any(p.get(key) for p in good):
            run[key] = next(p[key] for p in good if p.get(key))
    names: List[str] = []
    for p in good:
        names += [c["name"] for c in p.get("cases") or [] if c["name"] not in names]
    cases = []
    for name in names:
        rows = [c for p in good for c in p.get("cases") or [] if c["name"] == name]
        net = [c.get("net_ns", c["ns_per_pair"]) for c in rows]
        case = {"name": name, "processes": len(rows), "net_ns": statistics.median(net), "net_processes": net,
                "net_min": min(net), "net_max": max(net),
                "ns_per_pair": statistics.median(c["ns_per_pair"] for c in rows)}
        base = [c["baseline_ns"] for c in rows if c.get("baseline_ns") is not None]
        if base:
            case["baseline_ns"] = statistics.median(base)
        core = [c["core_ns"] for c in rows if c.get("core_ns") is not None]
        if core:
            case["core_ns"] = statistics.median(core)
        cases.append(case)
    run["cases"] = cases
    return run


def _speed_figures(case: Dict[str, Any]) -> Dict[str, Any]:
    """A case's figures; a result of one process (older files: "ns_per_pair" alone, no
    baseline) counts as one process whose spread is unknown."""
    net = case.get("net_ns", case["ns_per_pair"])
    return {"ns": net, "lo": case.get("net_min", net), "hi": case.get("net_max", net),
            "processes": case.get("processes", 1), "baseline": case.get("baseline_ns"),
            "raw": case["ns_per_pair"], "core": case.get("core_ns")}


def speed_cases(results: Dict[str, Any]) -> List[Tuple[str, Dict[str, Dict[str, Any]]]]:
    """[(case name, {allocator: figures})] for the allocation-speed workload; figures:
    ns (median per pair beyond torch.empty(0) over the processes), lo and hi (their min
    and max), processes, baseline, raw (median without subtraction), core (pyalloc's
    core in C++, where measured)."""
    runs = results["workloads"].get("alloc_speed", {}).get("runs", {})
    cases: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for alloc, run in runs.items():
        for case in (run.get("cases") or []) if _ok(run) else []:
            cases.setdefault(case["name"], {})[alloc] = _speed_figures(case)
    return list(cases.items())


def speed_verdict(mine: Dict[str, Any], base: Dict[str, Any]) -> str:
    """'tie', 'faster' or 'slower' (mine against base): a tie when the ranges over the
    processes overlap. With one process on either side (no spread measured) a tie is
    a ratio within TIME_TOLERANCE."""
    if min(mine["processes"], base["processes"]) < 2:
        if abs(mine["ns"] - base["ns"]) <= TIME_TOLERANCE * abs(base["ns"]):
            return "tie"
        return "slower" if mine["ns"] > base["ns"] else "faster"
    if mine["lo"] > base["hi"]:
        return "slower"
    if mine["hi"] < base["lo"]:
        return "faster"
    return "tie"


def _quartiles(values: Sequence[float]) -> Tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def step_comparison(base: Dict[str, Any], mine: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Median step of `mine` over `base`'s, its spread and the verdict.

    Both runs draw the same shapes with the same seed, so they pair step by step: the
    spread is the interquartile range of the per-step ratios. Runs that do not pair
    (other shapes) compare the interquartile ranges of their step times. A tie when
    the spread holds 1 (the ranges overlap), or the ratio is within TIME_TOLERANCE.
    """
    a, b = mine.get("step_ms") or [], base.get("step_ms") or []
    ratio = _ratio(mine.get("median_ms"), base.get("median_ms"))
    if ratio is None or not a or not b:
        return None
    paired = len(a) == len(b) and mine.get("shapes") == base.get("shapes")
    if paired:
        lo, hi = _quartiles([x / y for x, y in zip(a, b)])
        overlap = lo <= 1 <= hi
    else:
        (alo, ahi), (blo, bhi) = _quartiles(a), _quartiles(b)
        lo, hi = alo / bhi, ahi / blo
        overlap = alo <= bhi and blo <= ahi
    verdict = "tie" if overlap or abs(ratio - 1) <= TIME_TOLERANCE else "slower" if ratio > 1 else "faster"
    return {"ratio": ratio, "lo": lo, "hi": hi, "paired": paired, "verdict": verdict}


def step_workloads(results: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    return [(n, e) for n, e in results["workloads"].items() if e.get("kind") == "steps"]


def search_value(search: Optional[Dict[str, Any]]) -> Optional[int]:
    """The largest passing size of a finished search, None if it could not say."""
    if not search or search.get("stopped") == "error" or "largest" not in search:
        return None
    return search["largest"]


def _fmt_search(search: Optional[Dict[str, Any]]) -> str:
    if not search:
        return ""
    if search.get("stopped") == "error":
        last = (search.get("probes") or [{}])[-1]
        return f"error at {last.get('size', '?')}"
    largest, failing = search["largest"], search.get("smallest_failing")
    lo, hi = search.get("range", [1, None])
    if largest < lo:
        return f"none (< {lo})"
    if failing is None:
        return f"≥ {largest}" + (" (cap)" if largest == hi else "")
    if failing == largest + 1:
        return str(largest)
    return f"{largest}-{failing - 1}"


def losses(results: Dict[str, Any]) -> List[str]:
    """Every figure where an allocator other than native does worse than native, in words."""
    out: List[str] = []
    for other in [a for a in allocators(results) if a != BASELINE]:
        for case, figures in speed_cases(results):
            mine, base = figures.get(other), figures.get(BASELINE)
            if mine and base and speed_verdict(mine, base) == "slower":
                r = _net_ratio(mine, base)
                out.append(f"{other}, allocation speed, {case}: {_num(r, '.2f') or 'more than'}x native's time per "
                           f"pair beyond "
                           f"torch.empty(0) ({mine['ns']:.0f} vs {base['ns']:.0f} ns; {_span(mine)} and "
                           f"{_span(base)} over {_procs(mine)} and {_procs(base)})")
        for name, entry in results["workloads"].items():
            runs = entry.get("runs", {})
            mine, base = runs.get(other), runs.get(BASELINE)
            if base and mine and _ok(base) and not _ok(mine):
                out.append(f"{other}, {name}: the run ended with '{mine.get('status')}' where native's finished"
                           + (f" ({mine.get('error')})" if mine.get("error") else ""))
            if entry.get("kind") == "steps" and _ok(base) and _ok(mine):
                out.extend(_step_losses(other, name, base, mine))
            search = entry.get("search", {})
            theirs, ours = search_value(search.get(BASELINE)), search_value(search.get(other))
            if theirs is not None and ours is not None and ours < theirs:
                out.append(f"{other}, {name}: the largest {entry.get('size_name', 'size')} that runs under "
                           f"the budget is {ours}, native's {theirs}")
    return out


def _step_losses(other: str, name: str, base: Dict[str, Any], mine: Dict[str, Any]) -> List[str]:
    out = []
    c = step_comparison(base, mine)
    if c is not None and c["verdict"] == "slower":
        out.append(f"{other}, {name}: median step {c['ratio']:.3f}x native's "
                   f"({mine['median_ms']:.1f} vs {base['median_ms']:.1f} ms; {_spread_words(c)})")
    for key, what in (("peak_reserved", "peak reserved"), ("peak_allocated", "peak allocated")):
        r = _ratio(mine.get(key), base.get(key))
        if r is not None and r > 1 + MEMORY_TOLERANCE:
            out.append(f"{other}, {name}: {what} {mine[key] / GiB:.2f} GiB vs native's {base[key] / GiB:.2f} GiB "
                       f"({r:.3f}x)")
    mine_ra, base_ra = mine.get("reserved_over_allocated"), base.get("reserved_over_allocated")
    if mine_ra is not None and base_ra is not None and mine_ra > base_ra * (1 + MEMORY_TOLERANCE):
        out.append(f"{other}, {name}: reserved / allocated at peak {mine_ra:.3f} vs native's {base_ra:.3f}")
    return out


def unfinished(results: Dict[str, Any]) -> List[str]:
    out = []
    for name, entry in results["workloads"].items():
        for alloc, run in entry.get("runs", {}).items():
            if not _ok(run):
                where = f" at step {run['at_step']}" if "at_step" in run else ""
                phase = f" during {run['phase']}" if "phase" in run else ""
                out.append(f"{name} / {alloc}: {run.get('status')}{phase}{where}"
                           + (f": {run.get('error')}" if run.get("error") else ""))
        for alloc, search in entry.get("search", {}).items():
            if alloc != "budget" and search.get("stopped") == "error":
                last = search["probes"][-1]
                out.append(f"{name} / {alloc} batch search: probe at {last['size']} ended with "
                           f"'{last['status']}'" + (f": {last.get('error')}" if last.get("error") else ""))
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------


def _span(f: Dict[str, Any]) -> str:
    return f"[{f['lo']:.0f}, {f['hi']:.0f}] ns"


def _procs(f: Dict[str, Any]) -> str:
    return f"{f['processes']} process" + ("es" if f["processes"] != 1 else "")


def _spread_words(c: Dict[str, Any]) -> str:
    if c["paired"]:
        return f"per-step ratios [{c['lo']:.3f}, {c['hi']:.3f}], interquartile"
    return f"step-time quartiles [{c['lo']:.3f}, {c['hi']:.3f}] x native's"


def _speed_cell(f: Optional[Dict[str, Any]]) -> str:
    if not f:
        return ""
    return f"{f['ns']:.0f}" + (f" [{f['lo']:.0f}, {f['hi']:.0f}]" if f["processes"] > 1 else "")


def _step_cell(runs: Dict[str, Any], other: str) -> str:
    if not (_ok(runs.get(other)) and _ok(runs.get(BASELINE))):
        return ""
    c = step_comparison(runs[BASELINE], runs[other])
    return "" if c is None else f"{c['ratio']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}] {c['verdict']}"


def _net_ratio(mine: Dict[str, Any], base: Dict[str, Any]) -> Optional[float]:
    """mine / base per pair beyond torch.empty(0); None where either is not above 0 (with
    4 threads contention can leave nothing beyond the baseline to divide)."""
    return mine["ns"] / base["ns"] if mine["ns"] > 0 and base["ns"] > 0 else None


def _verdict_cell(mine: Optional[Dict[str, Any]], base: Optional[Dict[str, Any]]) -> str:
    if not mine or not base:
        return ""
    r = _net_ratio(mine, base)
    return (f"{r:.2f} " if r is not None else "") + speed_verdict(mine, base)


def _gib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / GiB:.2f}"


def _num(x: Optional[float], fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _cell(run: Optional[Dict[str, Any]], key: str, fmt) -> str:
    """A run's figure, or its status when it did not finish, or nothing when it did not run."""
    if not run:
        return ""
    if not _ok(run):
        return str(run.get("status"))
    value = run.get(key)
    return "" if value is None else fmt(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> List[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _device_line(device: Dict[str, Any]) -> str:
    parts = [device.get("name") or "unknown device"]
    if device.get("total_memory"):
        parts.append(f"{device['total_memory'] / GiB:.1f} GiB")
    if device.get("capability"):
        parts.append(f"compute capability {device['capability']}")
    return ", ".join(parts)


def markdown(results: Dict[str, Any], images: Sequence[str] = (), level: int = 1,
             source: Optional[str] = None) -> str:
    """The tables, the losses, the unfinished runs and the plots, as markdown.

    `images` are paths of the plots relative to where the markdown will live;
    `level` is the heading level of the title; `source` names the JSON file.
    """
    h = "#" * level
    device, env = results.get("device", {}), results.get("environment", {})
    allocs = allocators(results)
    others = [a for a in allocs if a != BASELINE]
    lines = [f"{h} pyalloc vs PyTorch's native allocator: {device.get('name', 'unknown device')}", ""]
    lib = [f"torch {device.get('torch')}", f"CUDA {device.get('cuda')}"]
    if device.get("cudnn"):
        lib.append(f"cuDNN {device['cudnn']}")
    if device.get("transformers"):
        lib.append(f"transformers {device['transformers']}")
    invocations = results.get("invocations", [])
    dates = sorted({inv.get("started", "")[:10] for inv in invocations if inv.get("started")})
    lines += _table(["", ""], [
        ["device", _device_line(device)],
        ["software", ", ".join(lib) + f", Python {device.get('python')}"],
        ["pyalloc", f"{env.get('pyalloc', '?')} (commit "
                    + ", ".join(sorted({inv.get("git_commit") or env.get("git_commit") or "?"
                                        for inv in invocations} or {env.get("git_commit") or "?"})) + ")"],
        ["date", ", ".join(dates) or "?"],
        ["allocators", ", ".join(allocs)],
    ] + ([["pyalloc strategy in use", ", ".join(pyalloc_strategies(results))]]
         if pyalloc_strategies(results) else [])
      + ([["pyalloc route in use", "; ".join(f"{a}: {', '.join(r)}" for a, r in pyalloc_routes(results).items())]]
         if pyalloc_routes(results) else [])
      + ([["results", f"`{source}`"]] if source else []), right_from=2)
    lines += ["", "Commands:", ""] + [f"    {inv['command']}" for inv in invocations] + [""]
    lines += [
        "Each workload ran once per allocator (alloc_speed: several times, in alternating rounds), each run "
        "in its own process, with the same seeds. Ratios are the other allocator's figure over native's: "
        "below 1 it is faster (time) or smaller (memory); for the largest batch, above 1 it fits more. "
        "A time is a tie when the spread measured around it overlaps native's.", "",
    ]

    cases = speed_cases(results)
    if cases:
        speed = results["workloads"]["alloc_speed"]
        rounds = speed.get("rounds") or {}
        counts = sorted({f["processes"] for _, figures in cases for f in figures.values()})
        done = (f"alternated in {rounds['done']} rounds" if rounds.get("done") == rounds.get("planned")
                else f"alternated in {rounds.get('done')} of {rounds.get('planned')} planned rounds") if rounds else ""
        has_base = any(f.get("baseline") is not None for _, figures in cases for f in figures.values())
        if has_base:
            lines += [f"{h}# Allocation speed: torch.empty + release, ns per pair beyond torch.empty(0) "
                      "(per thread)", "",
                      f"Each figure: the median over an allocator's processes ({' or '.join(map(str, counts))} "
                      "each" + (f", {done}" if done else "") + ") of a pair's time less a torch.empty(0) pair's, "
                      "timed in the same process; [min, max] over the processes. A ratio is a tie when the two "
                      "ranges overlap. torch.empty(0): the median of every process's baseline. pyalloc's core: "
                      "the same pairs in pyalloc's C++ core alone (virtual backend: no torch, no device).", ""]
        else:  # results from before the baseline and the rounds
            lines += [f"{h}# Allocation speed: torch.empty + release, ns per pair (per thread)", "",
                      "One process per allocator and no torch.empty(0) baseline: no spread was measured, and a "
                      f"ratio within {TIME_TOLERANCE:.0%} is called a tie.", ""]
        # pyalloc by its default route (the bridge) against pyalloc through the C hooks.
        routes = [("pyalloc", "pyalloc_hooks")] if {"pyalloc", "pyalloc_hooks"} <= set(allocs) else []
        has_core = any(f.get("core") is not None for _, figures in cases for f in figures.values())
        rows = []
        for case, figures in cases:
            base = [f["baseline"] for f in figures.values() if f.get("baseline") is not None]
            core = [f["core"] for f in figures.values() if f.get("core") is not None]
            rows.append([case] + ([_num(statistics.median(base), ".0f") if base else ""] if has_base else [])
                        + [_speed_cell(figures.get(a)) for a in allocs]
                        + ([_num(statistics.median(core), ".0f") if core else ""] if has_core else [])
                        + [_verdict_cell(figures.get(o), figures.get(BASELINE)) for o in others]
                        + [_verdict_cell(figures.get(a), figures.get(b)) for a, b in routes])
        lines += _table(["case"] + (["torch.empty(0)"] if has_base else []) + allocs
                        + (["pyalloc's core (C++)"] if has_core else [])
                        + [f"{o} / native" for o in others] + [f"{a} / {b}" for a, b in routes], rows) + [""]

    steps = step_workloads(results)
    if steps:
        lines += [f"{h}# Step time: median ms per step", "",
                  "Ratio: the other allocator's median step over native's, the interquartile range of its "
                  "per-step ratios (both runs draw the same shapes) and the verdict: a tie when that range holds 1 "
                  f"or the ratio is within {TIME_TOLERANCE:.0%} (the noise between processes, which one run each "
                  "cannot measure).", ""]
        rows = []
        for name, entry in steps:
            runs = entry["runs"]
            base = runs.get(BASELINE) or next(iter(runs.values()), {})
            rows.append([name, f"{entry.get('size_name', '')} {base.get('size', '')}", len(base.get("step_ms") or [])]
                        + [_cell(runs.get(a), "median_ms", lambda v: f"{v:.1f}") for a in allocs]
                        + [_step_cell(runs, o) for o in others])
        lines += _table(["workload", "knob", "steps"] + allocs + [f"{o} / native" for o in others], rows,
                        right_from=2) + [""]

        lines += [f"{h}# Memory at peak (GiB; reserved / allocated is the ratio of the two peaks)", ""]
        header = ["workload"] + [f"allocated, {a}" for a in allocs] + [f"reserved, {a}" for a in allocs] \
            + [f"reserved / allocated, {a}" for a in allocs]
        rows = []
        for name, entry in steps:
            runs = entry["runs"]
            rows.append([name] + [_cell(runs.get(a), "peak_allocated", _gib) for a in allocs]
                        + [_cell(runs.get(a), "peak_reserved", _gib) for a in allocs]
                        + [_cell(runs.get(a), "reserved_over_allocated", lambda v: f"{v:.3f}") for a in allocs])
        lines += _table(header, rows) + [""]

    searched = [(n, e) for n, e in steps if e.get("search")]
    if searched:
        budgets = sorted({e["search"].get("budget") for _, e in searched if e["search"].get("budget")})
        budget_text = " / ".join(f"{b / GiB:.1f} GiB" for b in budgets)
        title = f"under a {budget_text} budget" if budget_text else "(no memory cap)"
        lines += [f"{h}# Largest batch that runs {title}", "",
                  "Native capped with set_per_process_memory_fraction(budget / total), pyalloc with "
                  "max_pool_size = budget. Each probe is a fresh process that runs drawn shapes, then the "
                  "largest shape twice. 'a-b': the search stopped with the answer between a and b.", ""]
        rows = []
        for name, entry in searched:
            s = entry["search"]
            rows.append([name, entry.get("size_name", "")] + [_fmt_search(s.get(a)) for a in allocs]
                        + [_num(_ratio(search_value(s.get(o)), search_value(s.get(BASELINE))), ".2f")
                           for o in others]
                        + [sum(len(s.get(a, {}).get("probes", [])) for a in allocs)])
        lines += _table(["workload", "knob"] + allocs + [f"{o} / native" for o in others] + ["probes"], rows,
                        right_from=2) + [""]

    traces = [(n, e["trace"]) for n, e in results["workloads"].items() if e.get("trace")]
    if traces:
        lines += [f"{h}# Memory-history traces of the native runs", ""]
        rows = [[n, f"`{os.path.basename(t.get('path', ''))}`", t.get("steps", ""), t.get("entries", ""),
                 f"{(t.get('bytes') or 0) / 2**20:.1f}", t.get("status", "")] for n, t in traces]
        lines += _table(["workload", "file", "steps", "entries", "MiB", "status"], rows, right_from=2) + [""]

    if others:
        lost = losses(results)
        lines += [f"{h}# Where {' and '.join(others)} lose{'s' if len(others) == 1 else ''} to native", "",
                  "Slower beyond the measured spread (step times: and by more than "
                  f"{TIME_TOLERANCE:.0%}), more memory by more than {MEMORY_TOLERANCE:.0%}, "
                  "a smaller largest batch, or a run that did not finish:", ""]
        lines += [f"- {item}" for item in lost] or ["- nowhere in these runs"]
        lines.append("")
    failed = unfinished(results)
    if failed:
        lines += [f"{h}# Runs that did not finish", ""] + [f"- {item}" for item in failed] + [""]
    if images:
        lines += [f"{h}# Plots", ""] + [f"![{_plot_title(p)}]({p})" for p in images] + [""]
    return "\n".join(lines)


def _plot_title(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0].rsplit("-", 1)[-1]


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------

COLORS = {"native": "#4c72b0", "pyalloc": "#dd8452", "pyalloc_hooks": "#c44e52", "native_expandable": "#55a868", "native_async": "#8172b3"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: Dict[str, Any], out_dir: str, stem: str) -> List[str]:
    """Writes the plots that have data; returns their paths."""
    plt = _pyplot()
    written = []
    for kind, draw in (("speed", _plot_speed), ("memory", _plot_memory), ("timeline", _plot_timeline),
                       ("batch", _plot_batch)):
        fig = draw(plt, results)
        if fig is None:
            continue
        path = os.path.join(out_dir, f"{stem}-{kind}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _grouped_bars(plt, labels: List[str], series: Dict[str, List[Optional[float]]],
                  texts: Dict[str, List[str]], horizontal: bool):
    """Bars per label and series, each with its text; a missing value is drawn as 'n/a'."""
    n = len(series)
    extent = 0.45 * len(labels) * max(1, n) / 2 + 1.4
    fig, ax = plt.subplots(figsize=(8, extent) if horizontal else (max(6, extent * 1.6), 4.5))
    width = 0.8 / n
    for k, (name, values) in enumerate(series.items()):
        pos = [i + (k - (n - 1) / 2) * width for i in range(len(labels))]
        draw = ax.barh if horizontal else ax.bar
        bars = draw(pos, [v or 0 for v in values], width, color=COLORS.get(name.split(" ")[0]), label=name)
        ax.bar_label(bars, [t if v is not None else "n/a" for t, v in zip(texts[name], values)],
                     padding=2, fontsize=8)
    if horizontal:
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=1)
        ax.margins(x=0.15)
    else:
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.axhline(1.0, color="black", linewidth=1)
        ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="best")
    return fig, ax


def _plot_speed(plt, results):
    """Time ratios to native: allocation-speed cases and median step times."""
    others = [a for a in allocators(results) if a != BASELINE]
    labels, values = [], {o: [] for o in others}
    verdicts: Dict[str, List[str]] = {o: [] for o in others}
    for case, figures in speed_cases(results):
        labels.append(f"torch.empty: {case}")
        for o in others:
            mine, base = figures.get(o), figures.get(BASELINE)
            values[o].append(_net_ratio(mine, base) if mine and base else None)
            verdicts[o].append(speed_verdict(mine, base) if mine and base else "")
    for name, entry in step_workloads(results):
        labels.append(f"step: {name}")
        for o in others:
            runs = entry["runs"]
            c = step_comparison(runs[BASELINE], runs[o]) if _ok(runs.get(o)) and _ok(runs.get(BASELINE)) else None
            values[o].append(c["ratio"] if c else None)
            verdicts[o].append(c["verdict"] if c else "")
    if not others or not any(v is not None for vs in values.values() for v in vs):
        return None
    series = {f"{o} / native": values[o] for o in others}
    texts = {f"{o} / native": [f"{v:.2f} {w}" if v is not None else "" for v, w in zip(values[o], verdicts[o])]
             for o in others}
    fig, ax = _grouped_bars(plt, labels, series, texts, horizontal=True)
    ax.set_xlabel("time relative to native (below 1: faster)")
    ax.set_title("Time per torch.empty pair and per step, relative to PyTorch's native allocator")
    return fig


def _plot_memory(plt, results):
    """Reserved / allocated at peak per workload and allocator, with the peak reserved written on each bar."""
    allocs = allocators(results)
    rows = [(n, e["runs"]) for n, e in step_workloads(results)
            if any(_ok(r) and r.get("reserved_over_allocated") is not None for r in e["runs"].values())]
    if not rows:
        return None
    series, texts = {}, {}
    for a in allocs:
        good = [runs.get(a) if _ok(runs.get(a)) else None for _, runs in rows]
        series[a] = [r.get("reserved_over_allocated") if r else None for r in good]
        texts[a] = [f"{r['peak_reserved'] / GiB:.1f} GiB" if r and r.get("peak_reserved") else "" for r in good]
    fig, ax = _grouped_bars(plt, [n for n, _ in rows], series, texts, horizontal=False)
    ax.set_ylabel("peak reserved / peak allocated")
    ax.set_title("Memory held beyond what tensors used at peak (labels: peak reserved)")
    return fig


def _plot_timeline(plt, results):
    """Per workload: memory after each step (left) and each step's time (right)."""
    rows = [(n, e["runs"]) for n, e in step_workloads(results) if any(_ok(r) for r in e["runs"].values())]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 2.6 * len(rows)), squeeze=False)
    for (name, runs), (left, right) in zip(rows, axes):
        has_memory = False
        for a in allocators(results):
            run = runs.get(a)
            if not _ok(run):
                continue
            reserved = [v for v in run.get("reserved_after") or [] if v is not None]
            allocated = [v for v in run.get("allocated_after") or [] if v is not None]
            if reserved:
                has_memory = True
                left.plot([v / GiB for v in reserved], color=COLORS.get(a), label=f"{a} reserved")
                left.plot([v / GiB for v in allocated], color=COLORS.get(a), linestyle=":",
                          label=f"{a} allocated")
            right.plot(run.get("step_ms") or [], color=COLORS.get(a), label=a, marker=".", linewidth=0.8)
        if not has_memory:
            left.text(0.5, 0.5, "no allocator figures (CPU run)", ha="center", va="center",
                      transform=left.transAxes)
        left.set_title(f"{name}: memory after each step (GiB)", fontsize=9)
        right.set_title(f"{name}: step time (ms)", fontsize=9)
        for ax in (left, right):
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_batch(plt, results):
    """Largest batch under the budget relative to native's, with the batch written on each bar."""
    allocs = allocators(results)
    rows = [(n, e["search"]) for n, e in step_workloads(results) if e.get("search")]
    if not rows:
        return None
    series, texts = {}, {}
    for a in allocs:
        series[a] = [_ratio(search_value(s.get(a)), search_value(s.get(BASELINE))) for _, s in rows]
        texts[a] = [_fmt_search(s.get(a)) for _, s in rows]
    fig, ax = _grouped_bars(plt, [n for n, _ in rows], series, texts, horizontal=False)
    ax.set_ylabel("largest batch relative to native's (above 1: more fits)")
    ax.set_title("Largest batch under the same memory budget (labels: the batch)")
    return fig


# ---------------------------------------------------------------------------
# Rendering everything, and the README section
# ---------------------------------------------------------------------------


def render(results: Dict[str, Any], json_path: str) -> List[str]:
    """Writes <stem>.md and the plots beside the JSON file; returns the paths written."""
    out_dir = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    for kind in PLOTS:  # a plot that has lost its data must not linger
        stale = os.path.join(out_dir, f"{stem}-{kind}.png")
        if os.path.exists(stale):
            os.remove(stale)
    plots = write_plots(results, out_dir, stem)
    md_path = os.path.join(out_dir, f"{stem}.md")
    text = markdown(results, [os.path.basename(p) for p in plots], source=os.path.basename(json_path))
    with open(md_path, "w") as f:
        f.write(text)
    return [md_path] + plots


def update_readme(readme: str, results: Dict[str, Any], json_path: str) -> None:
    """Replaces the README's results section (between the markers) with these results."""
    with open(readme) as f:
        text = f.read()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{readme} has no '{README_BEGIN}' ... '{README_END}' section")
    here = os.path.dirname(os.path.abspath(readme))
    out_dir = os.path.dirname(os.path.abspath(json_path))
    stem = os.path.splitext(os.path.basename(json_path))[0]
    images = [os.path.relpath(os.path.join(out_dir, f"{stem}-{k}.png"), here) for k in PLOTS
              if os.path.exists(os.path.join(out_dir, f"{stem}-{k}.png"))]
    body = markdown(results, images, level=3, source=os.path.relpath(os.path.abspath(json_path), here))
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    with open(readme, "w") as f:
        f.write(f"{head}{README_BEGIN}\n{body}\n{README_END}{tail}")

