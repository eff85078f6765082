"""The results file of the GPU benchmark: JSON, a markdown table and PNG plots.

One JSON file holds everything measured on one GPU on one date, and grows with
each command that runs more workloads (a GPU command is limited in time, so the
whole benchmark takes several). Its layout:

    {"schema": 1, "device": {...}, "environment": {...}, "invocations": [{command, started, ...}],
     "workloads": {name: {"title", "kind", "size_name",
                          "runs":   {allocator: worker result},
                          "search": {"budget": bytes, allocator: search result},
                          "trace":  {...}}}}

The markdown and the plots are always rendered from the JSON, so they can be
rebuilt at any time (``python -m benchmarks.gpu --render FILE.json``). Ratios
are another allocator's figure over the native allocator's.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

SCHEMA = 1
BASELINE = "native"
ALLOCATOR_ORDER = ("native", "pyalloc", "pyalloc_hooks", "native_expandable", "native_async")
#: The allocators that are pyalloc: by its default route (the bridge where it builds),
#: and through CUDAPluggableAllocator's C hooks.
PYALLOC_ALLOCATORS = ("pyalloc", "pyalloc_hooks")
#: Step times within this fraction of native count as a tie (run-to-run noise on a GPU).
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


def _run_ratio(runs: Dict[str, Any], other: str, key: str) -> Optional[float]:
    """runs[other][key] / runs[native][key] when both runs finished."""
    if not (_ok(runs.get(other)) and _ok(runs.get(BASELINE))):
        return None
    return _ratio(runs[other].get(key), runs[BASELINE].get(key))


def speed_cases(results: Dict[str, Any]) -> List[Tuple[str, Dict[str, Optional[float]]]]:
    """[(case name, {allocator: ns per pair})] for the allocation-speed workload."""
    runs = results["workloads"].get("alloc_speed", {}).get("runs", {})
    cases: Dict[str, Dict[str, Optional[float]]] = {}
    for alloc, run in runs.items():
        for case in (run.get("cases") or []) if _ok(run) else []:
            cases.setdefault(case["name"], {})[alloc] = case["ns_per_pair"]
    return list(cases.items())


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
        for case, ns in speed_cases(results):
            r = _ratio(ns.get(other), ns.get(BASELINE))
            if r is not None and r > 1 + TIME_TOLERANCE:
                out.append(f"{other}, allocation speed, {case}: {r:.2f}x native's time per pair "
                           f"({ns[other]:.0f} vs {ns[BASELINE]:.0f} ns)")
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
    r = _ratio(mine.get("median_ms"), base.get("median_ms"))
    if r is not None and r > 1 + TIME_TOLERANCE:
        out.append(f"{other}, {name}: median step {r:.3f}x native's "
                   f"({mine['median_ms']:.1f} vs {base['median_ms']:.1f} ms)")
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
        "Each workload ran once per allocator, each in its own process, with the same seeds, back to back. "
        "Ratios are the other allocator's figure over native's: below 1 it is faster (time) or smaller "
        "(memory); for the largest batch, above 1 it fits more.", "",
    ]

    cases = speed_cases(results)
    if cases:
        lines += [f"{h}# Allocation speed: torch.empty + release, ns per pair (per thread)", ""]
        # pyalloc by its default route (the bridge) against pyalloc through the C hooks.
        routes = [("pyalloc", "pyalloc_hooks")] if {"pyalloc", "pyalloc_hooks"} <= set(allocs) else []
        rows = [[case] + [_num(ns.get(a), ".0f") for a in allocs]
                + [_num(_ratio(ns.get(o), ns.get(BASELINE)), ".2f") for o in others]
                + [_num(_ratio(ns.get(a), ns.get(b)), ".2f") for a, b in routes] for case, ns in cases]
        lines += _table(["case"] + allocs + [f"{o} / native" for o in others]
                        + [f"{a} / {b}" for a, b in routes], rows) + [""]

    steps = step_workloads(results)
    if steps:
        lines += [f"{h}# Step time: median ms per step", ""]
        rows = []
        for name, entry in steps:
            runs = entry["runs"]
            base = runs.get(BASELINE) or next(iter(runs.values()), {})
            rows.append([name, f"{entry.get('size_name', '')} {base.get('size', '')}", len(base.get("step_ms") or [])]
                        + [_cell(runs.get(a), "median_ms", lambda v: f"{v:.1f}") for a in allocs]
                        + [_num(_run_ratio(runs, o, "median_ms"), ".3f") for o in others])
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
                  f"Slower by more than {TIME_TOLERANCE:.0%}, more memory by more than {MEMORY_TOLERANCE:.0%}, "
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
    for case, ns in speed_cases(results):
        labels.append(f"torch.empty: {case}")
        for o in others:
            values[o].append(_ratio(ns.get(o), ns.get(BASELINE)))
    for name, entry in step_workloads(results):
        labels.append(f"step: {name}")
        for o in others:
            values[o].append(_run_ratio(entry["runs"], o, "median_ms"))
    if not others or not any(v is not None for vs in values.values() for v in vs):
        return None
    series = {f"{o} / native": values[o] for o in others}
    texts = {f"{o} / native": [f"{v:.2f}" if v is not None else "" for v in values[o]] for o in others}
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

