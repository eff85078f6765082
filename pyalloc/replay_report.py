"""Showing replay results: the table (plain text or markdown), the sentences on
recorded out-of-memory errors, and the plot.

Kept apart from replay.py so that the replay itself never imports matplotlib.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

from ._C import format_bytes
from .replay_result import ReplayResult

__all__ = ["ALLOCATOR_NAMES", "COLUMNS", "LEGEND", "figure", "format_ooms", "format_table", "oom_sentence",
           "plot_results"]

COLUMNS = [
    "trace",
    "events",
    "allocs",
    "peak live",
    "pyalloc reserved",
    "ratio",
    "2nd-half device calls",
    "min budget",
    "native reserved",
    "native ratio",
    "frag at peak",
]

LEGEND = (
    "peak live: most requested bytes live at once, the least any allocator must hold. "
    "pyalloc reserved: pyalloc's peak reserved bytes replaying the trace (ratio: to peak live). "
    "2nd-half device calls: num_device_alloc + num_device_free over the second half of the trace "
    "(segments reserved and released, page ranges mapped and unmapped: each is a call to the "
    "driver, or a few); a workload that repeats makes none once warm. "
    "min budget: the smallest device size under which pyalloc replays the trace without an OOM "
    "(bisection, within 1%). native reserved: peak reserved bytes of the allocator that recorded "
    "the trace, from its segments ('-' where the trace has none). frag at peak: at peak live, "
    "1 - largest free block / free bytes in pyalloc's pool."
)


def _bytes(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.3f}"


def _label(r: ReplayResult) -> str:
    """The trace's file name, and its device where the snapshot had several."""
    name = os.path.basename(r.trace)
    return f"{name} [device {r.device}]" if r.devices > 1 else name


def _row(r: ReplayResult, with_budget: bool) -> List[str]:
    frag = r.fragmentation_at_peak.get("external_fragmentation")
    row = [
        _label(r),
        str(r.events),
        str(r.allocs),
        _bytes(r.peak_live_bytes),
        _bytes(r.pyalloc_peak_reserved_bytes),
        _ratio(r.pyalloc_ratio),
        "-" if r.second_half_device_calls is None else str(r.second_half_device_calls),
        _bytes(r.pyalloc_min_budget_bytes),
        _bytes(r.native_peak_reserved_bytes),
        _ratio(r.native_ratio),
        "-" if frag is None else f"{frag:.1%}",
    ]
    if with_budget:
        row.append(_bytes(r.budget_peak_reserved_bytes))
        row.append("-" if r.budget_ooms is None else str(r.budget_ooms))
    return row


def format_table(results: Sequence[ReplayResult], markdown: bool = False) -> str:
    """One row per trace. With a budget, two more columns: the bounded replay's peak
    reserved bytes and the allocations it refused."""
    with_budget = any(r.budget_bytes is not None for r in results)
    header = list(COLUMNS)
    if with_budget:
        budgets = {r.budget_bytes for r in results if r.budget_bytes is not None}
        at = f"at {format_bytes(budgets.pop())}" if len(budgets) == 1 else "at budget"
        header += [f"reserved {at}", f"OOMs {at}"]
    rows = [_row(r, with_budget) for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    # Names on the left, numbers on the right.
    def fmt(row: List[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule] + [fmt(row) for row in rows])


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
    "not fragmentation: 83.20 GiB needed on 78.50 GiB (4.70 GiB short); reduce memory",
    or "fragmentation: 80.00 MiB needed on 110.00 MiB; pyalloc would have served it,
    PyTorch would not". Allocators whose answer is unknown (None) are left out."""
    size, live, capacity = oom["size_bytes"], oom["live_bytes"], oom["capacity_bytes"]
    needed = live + size
    head = f"a {format_bytes(size)} request with {format_bytes(live)} live"
    if capacity is None:
        return (f"{head}: {format_bytes(needed)} needed; the snapshot does not say how much the "
                "device held, so no verdict")
    served = oom["served_by"]
    yes = [a for a, v in served.items() if v is True]
    no = [a for a, v in served.items() if v is False]
    if oom["fragmentation"]:
        text = f"fragmentation: {format_bytes(needed)} needed on {format_bytes(capacity)}"
    else:
        text = (f"not fragmentation: {format_bytes(needed)} needed on {format_bytes(capacity)} "
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
        top = max(r.pyalloc_peak_reserved_bytes, r.native_peak_reserved_bytes or 0, r.budget_bytes or 0)
        scale, unit = _unit(top)
        t = r.timeline
        if t:
            ax.plot(t["event"], [v / scale for v in t["reserved_bytes"]], label="pyalloc reserved",
                    color="tab:blue", drawstyle="steps-post")
            ax.plot(t["event"], [v / scale for v in t["live_bytes"]], label="live (requested)",
                    color="tab:gray", linewidth=0.8)
        n = r.native_timeline
        if n:
            ax.plot(n["event"], [v / scale for v in n["reserved_bytes"]], label="native reserved",
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


def _setup(conf: Optional[str]) -> str:
    """'strategy vmm, config segment_size:64MiB' (the defaults named as such)."""
    from ._config import parse_config

    strategy = parse_config(conf or "")["strategy"]
    return f"strategy {strategy}, config {conf if conf else '(defaults)'}"


def _verdict(r: ReplayResult) -> str:
    text = f"pyalloc reserved {_ratio(r.pyalloc_ratio)}x peak live"
    if r.native_ratio is not None:
        text += f", native {_ratio(r.native_ratio)}x"
    if r.budget_bytes is not None:
        text += f"; at the budget: {r.budget_ooms} OOMs"
    return text


def _unit(n: int):
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= 4 * scale:
            return scale, unit
    return 1, "bytes"
