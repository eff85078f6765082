"""Showing replay results: the table (plain text or markdown), the sentences on
recorded out-of-memory errors, and the plot.

Kept apart from replay.py so that the replay itself never imports matplotlib.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from ._C import format_bytes
from .replay_result import ReplayResult

__all__ = ["ALLOCATOR_NAMES", "COLUMNS", "LEGEND", "budget_figure", "figure", "format_ooms", "format_table",
           "oom_sentence", "plot_budgets", "plot_results"]

#: The table's columns (the markdown header). The plain-text table groups the
#: allocators' columns under one heading each and names the allocators shortly.
COLUMNS = [
    "trace",
    "device",
    "peak live",
    "budget pyalloc",
    "budget native",
    "budget expandable",
    "reserved pyalloc",
    "reserved native",
    "reserved expandable",
    "reserved recorded",
    "2nd-half device calls (p/n/e)",
    "driver calls (p/n/e)",
    "retries at budget (p/n/e)",
    "matched calls",
]

_GROUPS = [("", 3), ("budget / peak live", 3), ("uncapped reserved / peak live", 4),
           ("2nd-half calls", 1), ("driver calls", 1), ("retries", 1), ("model vs", 1)]
_SHORT = ["trace", "dev", "peak live", "pyalloc", "native", "expand.", "pyalloc", "native", "expand.",
          "recorded", "p/n/e", "p/n/e", "p/n/e", "recorded"]

LEGEND = (
    "Three allocators replay each trace: pyalloc, PyTorch's caching allocator (native, a model "
    "that makes the recorded device calls of real snapshots) and PyTorch with "
    "expandable_segments:True (expandable). peak live: most requested bytes live at once, the "
    "least any allocator must hold. budget: the smallest device on which the allocator serves "
    "the whole trace, each running its own out-of-memory path (PyTorch frees its cache and "
    "retries), bisected to 0.5% and served on devices up to 5% larger too (an allocator can "
    "complete on one device and fail on a slightly larger one), as a ratio to peak live: the "
    "comparison at equal budgets. "
    "reserved: peak reserved bytes with no cap, to peak live; recorded: the allocator that "
    "recorded the snapshot, from its segments ('-' where it has none). 2nd-half calls: device "
    "calls (segments or page ranges reserved and released) over the second half of the trace, "
    "uncapped; a workload that repeats makes none once warm. driver calls: every cudaMalloc, "
    "cudaFree, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease of the "
    "uncapped replay, page by page ('-' where pyalloc's stats do not count them). retries: "
    "out-of-memory retries replaying at the allocator's own budget. matched calls: the "
    "recorded segment_alloc / segment_free / segment_map / segment_unmap calls the model of "
    "the recording allocator makes, in order, of the recorded ones."
)

#: Trace names longer than this are cut in the plain-text table.
NAME_WIDTH = 32


def _bytes(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.3f}"


def _label(r: ReplayResult) -> str:
    """The trace's file name, and its device where the snapshot had several."""
    name = os.path.basename(r.trace)
    return f"{name} [device {r.device}]" if r.devices > 1 else name


def _to_live(n: Optional[int], live: int) -> str:
    return "-" if n is None or live == 0 else f"{n / live:.3f}"


def _triple(*values: Optional[int]) -> str:
    return "/".join("-" if v is None else str(v) for v in values)


def _name(trace: str, short: bool) -> str:
    name = os.path.basename(trace)
    if not short:
        return name
    for ext in (".pickle.gz", ".pickle"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "~"


def _row(r: ReplayResult, with_budget: bool, short: bool) -> List[str]:
    live = r.peak_live_bytes
    v = r.validation
    row = [
        _name(r.trace, short),
        str(r.device),
        _bytes(live),
        _to_live(r.pyalloc_min_budget_bytes, live),
        _to_live(r.native_min_budget_bytes, live),
        _to_live(r.native_expandable_min_budget_bytes, live),
        _to_live(r.pyalloc_peak_reserved_bytes, live),
        _to_live(r.native_peak_reserved_bytes, live),
        _to_live(r.native_expandable_peak_reserved_bytes, live),
        _to_live(r.recorded_peak_reserved_bytes, live),
        _triple(r.pyalloc_second_half_device_calls, r.native_second_half_device_calls,
                r.native_expandable_second_half_device_calls),
        _triple(r.pyalloc_driver_calls, r.native_driver_calls, r.native_expandable_driver_calls),
        _triple(r.pyalloc_budget_retries, r.native_budget_retries, r.native_expandable_budget_retries),
        "-" if v is None else f"{v['matched_calls']}/{v['recorded_calls']}",
    ]
    if with_budget:
        runs = [r.budget_runs.get(name, {}) for name in ALLOCATOR_NAMES]
        row.append("/".join(_to_live(run.get("peak_reserved_bytes"), live) for run in runs))
        row.append(_triple(*(run.get("ooms") for run in runs)))
        row.append(_triple(*(run.get("driver_calls") for run in runs)))
    return row


def format_table(results: Sequence[ReplayResult], markdown: bool = False) -> str:
    """One row per trace and device, budgets first. With a budget, three more
    columns, each allocator on a device of that size: its peak reserved bytes (to
    peak live), the allocations it refused and its driver calls."""
    with_budget = any(r.budget_bytes is not None for r in results)
    header = list(COLUMNS) if markdown else list(_SHORT)
    extra: List[str] = []
    if with_budget:
        budgets = {r.budget_bytes for r in results if r.budget_bytes is not None}
        at = f"at {format_bytes(budgets.pop())}" if len(budgets) == 1 else "at budget"
        extra = [f"reserved {at} (p/n/e)", f"OOMs {at} (p/n/e)", f"driver calls {at} (p/n/e)"]
        header += extra if markdown else ["p/n/e"] * 3
    rows = [_row(r, with_budget, not markdown) for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    groups = (_GROUPS + [(f"reserved {at}", 1), (f"OOMs {at}", 1), (f"driver calls {at}", 1)]
              if extra else _GROUPS)
    # Each group's heading spans its columns; a column widens if its heading needs it.
    col = 0
    for title, span in groups:
        inner = sum(widths[col:col + span]) + 2 * (span - 1)
        if len(title) > inner:
            widths[col + span - 1] += len(title) - inner
        col += span

    def fmt(row: List[str]) -> str:  # names on the left, numbers on the right
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    heads, col = [], 0
    for title, span in groups:
        inner = sum(widths[col:col + span]) + 2 * (span - 1)
        heads.append(title.center(inner) if title else " " * inner)
        col += span
    top = "  ".join(heads).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([top, fmt(header), rule] + [fmt(row) for row in rows])


#: How the sentences name each allocator of replay_allocators.ALLOCATORS.
ALLOCATOR_NAMES = {
    "pyalloc": "pyalloc",
    "native": "PyTorch",
    "native_expandable": "PyTorch with expandable segments",
}


def _names(keys: List[str]) -> str:
    names = [ALLOCATOR_NAMES.get(k, k) for k in keys]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def oom_sentence(oom: Dict[str, Any]) -> str:
    """What a recorded out-of-memory error was, in words a person can act on:
    "a 4.94 GiB allocation with 78.29 GiB live: not fragmentation: 83.20 GiB needed
    on 78.50 GiB (4.70 GiB short); reduce memory", or "...: fragmentation: 80.00 MiB
    needed on 110.00 MiB; pyalloc would have served it, PyTorch would not". The
    allocation's size is the one PyTorch recorded, rounded as it rounds requests.
    Under a recorded memory fraction the capacity says so, and what device memory
    it assumed. Allocators whose answer is unknown (None) are left out."""
    size, live, capacity = oom["size_bytes"], oom["live_bytes"], oom["capacity_bytes"]
    needed = live + size
    head = f"a {format_bytes(size)} allocation with {format_bytes(live)} live"
    if capacity is None:
        return (f"{head}: {format_bytes(needed)} needed; the snapshot does not say how much the "
                "device held, so no verdict")
    served = oom["served_by"]
    yes = [a for a, v in served.items() if v is True]
    no = [a for a, v in served.items() if v is False]
    on = f"{format_bytes(capacity)}{_fraction_note(oom)}"
    if oom["fragmentation"]:
        text = f"fragmentation: {format_bytes(needed)} needed on {on}"
    else:
        text = (f"not fragmentation: {format_bytes(needed)} needed on {on} "
                f"({format_bytes(needed - capacity)} short)")
    if yes and no:
        text += f"; {_names(yes)} would have served it, {_names(no)} would not"
    elif yes:
        text += f"; {_names(yes)} would have served it"
    elif len(no) > 1:
        text += f"; none of {', '.join(ALLOCATOR_NAMES.get(a, a) for a in no)} would have served it"
    elif no:
        text += f"; {_names(no)} would not have served it"
    if not oom["fragmentation"]:
        text += "; reduce memory"
    return f"{head}: {text}"


def _fraction_note(oom: Dict[str, Any]) -> str:
    """" (memory fraction 0.5 of ...)" where a recorded fraction capped the capacity."""
    fraction, total = oom.get("memory_fraction"), oom.get("device_total_bytes")
    if fraction is None or total is None:
        return ""
    if oom.get("device_total_assumed"):
        return (f" (memory fraction {fraction:g} of the device, whose memory the snapshot does "
                f"not record: taken as {format_bytes(total)}, reserved plus free at the error)")
    return f" (memory fraction {fraction:g} of {format_bytes(total)})"


def format_ooms(results: Sequence[ReplayResult]) -> str:
    """One line per out-of-memory error the traces recorded ("" if none)."""
    lines = []
    for r in results:
        for oom in r.recorded_ooms:
            lines.append(f"{_label(r)}, event {oom['event']}: {oom_sentence(oom)}")
    return "\n".join(lines)


def plot_results(results: Sequence[ReplayResult], path: str) -> None:
    """Reserved and live bytes over each trace, one panel per trace, to an image file."""
    figure(results).savefig(path, dpi=110)


def figure(results: Sequence[ReplayResult]):
    """The plot of plot_results() as a matplotlib Figure (with an Agg canvas).

    Each panel's title names the trace, the strategy and the configuration; the
    legend sits beside the panel, over no data. A replay with a budget draws
    the budget as a dashed line; the native allocator's reserved bytes are
    drawn where the trace has them (GPU snapshots with segments).
    """
    # The object API with the Agg canvas: no pyplot, so no display and no global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.2 * len(results)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    for ax, r in zip(axes, results):
        top = max(r.pyalloc_peak_reserved_bytes, r.recorded_peak_reserved_bytes or 0, r.budget_bytes or 0)
        scale, unit = _unit(top)
        t = r.timeline
        if t:
            ax.plot(t["event"], [v / scale for v in t["reserved_bytes"]], label="pyalloc reserved",
                    color="tab:blue", drawstyle="steps-post")
            ax.plot(t["event"], [v / scale for v in t["live_bytes"]], label="live (requested)",
                    color="tab:gray", linewidth=0.8)
        n = r.native_timeline
        if n:
            ax.plot(n["event"], [v / scale for v in n["reserved_bytes"]], label="recorded reserved",
                    color="tab:orange", drawstyle="steps-post")
        if r.budget_bytes is not None:
            ax.axhline(r.budget_bytes / scale, color="tab:red", linestyle="--", linewidth=1,
                       label=f"budget {format_bytes(r.budget_bytes)}")
        ax.set_title(f"{_label(r)}: {_setup(r.config)}\n{_verdict(r)}", fontsize=10)
        ax.set_xlabel("trace event")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0, top=top / scale * 1.05 if top else None)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    return fig


#: The allocators of the budget plot, with their labels and colours.
_ALLOCATOR_STYLE = (("pyalloc", "pyalloc", "tab:blue"), ("native", "PyTorch default", "tab:orange"),
                    ("native_expandable", "PyTorch expandable_segments", "tab:green"))


def plot_budgets(results: Sequence[ReplayResult], path: str) -> None:
    """The smallest budget of each allocator, over peak live, per trace, to an image file."""
    budget_figure(results).savefig(path, dpi=110)


def budget_figure(results: Sequence[ReplayResult]):
    """Bars of budget / peak live, one group per trace and device, one bar per
    allocator (a matplotlib Figure with an Agg canvas). 1.0 is peak live, the
    least any allocator must hold; a missing bar is a budget not searched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in results if r.peak_live_bytes > 0]
    fig = Figure(figsize=(10, 0.45 * len(rows) + 1.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    height = 0.27
    names = [f"{_name(r.trace, True)} (dev {r.device}, {format_bytes(r.peak_live_bytes)})" for r in rows]
    for k, (key, label, colour) in enumerate(_ALLOCATOR_STYLE):
        ys, xs = [], []
        for i, r in enumerate(rows):
            budget = getattr(r, f"{key}_min_budget_bytes")
            if budget:
                ys.append(i + (k - 1) * height)
                xs.append(budget / r.peak_live_bytes)
        ax.barh(ys, xs, height=height, label=label, color=colour)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first trace on top, no margin
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlim(left=0.95)
    ax.set_xlabel("smallest budget without an out-of-memory / peak live (lower is better)")
    ax.set_title("Equal budgets: the smallest device each allocator completes the trace on", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _setup(conf: Optional[str]) -> str:
    """'strategy vmm, config segment_size:64MiB' (the defaults named as such)."""
    from ._config import parse_config

    strategy = parse_config(conf or "")["strategy"]
    return f"strategy {strategy}, config {conf if conf else '(defaults)'}"


def _verdict(r: ReplayResult) -> str:
    text = f"pyalloc reserved {_ratio(r.pyalloc_ratio)}x peak live"
    if r.recorded_ratio is not None:
        text += f", recorded {_ratio(r.recorded_ratio)}x"
    if r.budget_bytes is not None:
        text += f"; at the budget: {r.budget_ooms} OOMs"
    return text


def _unit(n: int):
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= 4 * scale:
            return scale, unit
    return 1, "bytes"
