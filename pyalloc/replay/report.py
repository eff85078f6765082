"""Showing replay results: the table (a compact one for a terminal, the full one in
markdown), its legend, the sentences that say where pyalloc wins, ties and loses,
the sentences on recorded out-of-memory errors, and the plots.

The terminal's text fits WIDTH columns. Kept apart from run.py so that the
replay itself never imports matplotlib.
"""
from __future__ import annotations

import os
import shlex
import textwrap
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from .._C import format_bytes
from .result import BUDGET_PRECISION, ReplayResult

__all__ = ["ALLOCATOR_NAMES", "BUDGET_LEGEND", "COLUMNS", "LEGEND", "TABLE_LEGEND", "TIE", "VERDICT_LINES", "WIDTH",
           "comparison_figure", "figure", "format_names", "format_ooms", "format_recorded", "format_table",
           "format_verdict", "oom_sentence", "plot_comparison", "plot_results", "short_names", "shortened_names",
           "verdicts", "wrap"]

#: The full table's columns (the markdown header). The terminal's table is
#: narrower: the three measures (TABLE_LEGEND) under one heading each.
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

LEGEND = (
    "Three allocators replay each trace: pyalloc, PyTorch's caching allocator (native, a model "
    "that makes the recorded device calls of real snapshots) and PyTorch with "
    "expandable_segments:True (expandable). peak live: most requested bytes live at once, the "
    "least any allocator must hold. budget: the smallest device on which the allocator serves "
    "the whole trace, each running its own out-of-memory path (PyTorch frees its cache and "
    f"retries), bisected to {BUDGET_PRECISION:.1%} and served on devices up to 5% larger too (an allocator can "
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

#: The terminal's text (table, legends, sentences) fits this many columns.
WIDTH = 100

#: Trace names at most this long stay whole in the terminal's table; longer ones are
#: shortened to their first words, as few as keep them apart (short_names()).
NAME_WIDTH = 26

#: What the terminal's table shows, in one legend (also `pyalloc replay --help`).
TABLE_LEGEND = (
    "p: pyalloc; n: PyTorch's caching allocator (native; a model that makes the device calls "
    "real snapshots recorded); e: PyTorch with expandable_segments:True. dev: the snapshot's "
    "device. peak live: most requested bytes live at once, the least any allocator must hold. "
    "budget: the smallest device on which the allocator serves the whole trace, running its own "
    f"out-of-memory path (bisected to {BUDGET_PRECISION:.1%}), over peak live. reserved (no cap): peak reserved "
    "bytes on a device of unbounded size, over peak live. driver calls: cudaMalloc, cudaFree, "
    "cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease calls of the uncapped "
    f"replay ('-': not counted). Lower is better in every column; within {BUDGET_PRECISION:.1%} is a tie."
)

#: What the terminal's table on a device of --budget's size shows (`pyalloc replay --budget`).
BUDGET_LEGEND = (
    "On a device of the --budget size: each allocator's peak reserved bytes over peak live, the "
    "allocations it refused (OOMs) and its driver calls."
)

#: Two figures within this fraction of the larger are a tie: the budget search's
#: precision, used for every measure so that one rule holds.
TIE = BUDGET_PRECISION


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


def _stem(trace: str) -> str:
    """A trace's file name without its folder and .pickle / .pickle.gz."""
    name = os.path.basename(trace)
    for ext in (".pickle.gz", ".pickle"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def short_names(traces: Sequence[str], width: int = NAME_WIDTH) -> Dict[str, str]:
    """A name for each trace that fits `width` and no other trace shares: its file
    name without folder and extension where that fits and is unique, else its first
    words (dash-separated; two at least, more until no other trace begins with
    them), and a number after any that would still be alike."""
    stems = {t: _stem(t) for t in dict.fromkeys(traces)}
    names: Dict[str, str] = {}
    for trace, stem in stems.items():
        others = [s for t, s in stems.items() if t != trace]
        if len(stem) <= width and stem not in others:
            names[trace] = stem
            continue
        words = stem.split("-")
        for k in range(min(2, len(words)), len(words) + 1):
            name = "-".join(words[:k])
            if not any(o == name or o.startswith(name + "-") for o in others):
                break
        names[trace] = name[:width]
    alike: Dict[str, List[str]] = {}
    for trace, name in names.items():
        alike.setdefault(name, []).append(trace)
    for name, group in alike.items():
        if len(group) > 1:
            for i, trace in enumerate(group, 1):
                tag = f"#{i}"
                names[trace] = name[: width - len(tag)] + tag
    return names


def _names_of(results: Sequence[Any], width: int = NAME_WIDTH) -> List[str]:
    names = short_names([_get(r, "trace") for r in results], width)
    return [names[_get(r, "trace")] for r in results]


def _labels(results: Sequence[Any]) -> List[str]:
    """How sentences name each result: its short name, and its device where the
    results hold several devices of that trace."""
    traces = [_get(r, "trace") for r in results]
    return [name if traces.count(trace) == 1 else f"{name} dev {_get(r, 'device')}"
            for name, trace, r in zip(_names_of(results), traces, results)]


def _get(r: Union[ReplayResult, Mapping[str, Any]], key: str) -> Any:
    """A figure of a result, or of its dict (a row of --json or fragmentation.json)."""
    return r.get(key) if isinstance(r, Mapping) else getattr(r, key)


def _row(r: ReplayResult, with_budget: bool) -> List[str]:
    """The full table's row (markdown)."""
    live = r.peak_live_bytes
    v = r.validation
    row = [
        os.path.basename(r.trace),
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
    """One row per trace and device, budgets first.

    markdown=True: the full table (COLUMNS; LEGEND explains it), and with a budget
    three more columns, each allocator on a device of that size: its peak reserved
    bytes (to peak live), the allocations it refused and its driver calls.
    Otherwise the terminal's table, within WIDTH columns: the three measures for
    p, n and e (TABLE_LEGEND), trace names shortened where long (format_names()
    lists them), and with a budget a second table of the devices of that size."""
    with_budget = any(r.budget_bytes is not None for r in results)
    if markdown:
        header = list(COLUMNS)
        if with_budget:
            budgets = {r.budget_bytes for r in results if r.budget_bytes is not None}
            at = f"at {format_bytes(budgets.pop())}" if len(budgets) == 1 else "at budget"
            header += [f"reserved {at} (p/n/e)", f"OOMs {at} (p/n/e)", f"driver calls {at} (p/n/e)"]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        lines += ["| " + " | ".join(_row(r, with_budget)) + " |" for r in results]
        return "\n".join(lines)

    def ratios(key: str, r: ReplayResult) -> List[str]:
        return [_to_live(getattr(r, f"{a}_{key}"), r.peak_live_bytes) for a in ALLOCATOR_NAMES]

    def counts(values: Sequence[Optional[int]]) -> List[str]:
        return ["-" if v is None else str(v) for v in values]

    groups = [("budget", [ratios("min_budget_bytes", r) for r in results]),
              ("reserved (no cap)", [ratios("peak_reserved_bytes", r) for r in results]),
              ("driver calls", [counts([getattr(r, f"{a}_driver_calls") for a in ALLOCATOR_NAMES])
                                for r in results])]
    table = _grouped_table(results, groups)
    if not with_budget:
        return table
    runs = [[r.budget_runs.get(a, {}) for a in ALLOCATOR_NAMES] for r in results]
    budgets = {r.budget_bytes for r in results if r.budget_bytes is not None}
    at = format_bytes(budgets.pop()) if len(budgets) == 1 else "each trace's --budget"
    groups = [("reserved", [[_to_live(run.get("peak_reserved_bytes"), r.peak_live_bytes) for run in rs]
                            for r, rs in zip(results, runs)]),
              ("OOMs", [counts([run.get("ooms") for run in rs]) for rs in runs]),
              ("driver calls", [counts([run.get("driver_calls") for run in rs]) for rs in runs])]
    return table + f"\n\nOn a device of {at}:\n" + _grouped_table(results, groups)


def _grouped_table(results: Sequence[ReplayResult], groups: List[Tuple[str, List[List[str]]]]) -> str:
    """trace, dev, peak live, then a heading over p, n and e for each group; the names
    get what WIDTH leaves (NAME_WIDTH at most)."""
    widths = []  # per group: one width for its three columns, and the group's own
    for title, cells in groups:
        w = max([1] + [len(c) for row in cells for c in row])
        widths.append(max(w, -(-(len(title) - 2) // 3)))  # the heading spans 3 w + 2 columns
    fixed = [len("dev"), max([len("peak live")] + [len(_bytes(r.peak_live_bytes)) for r in results])]
    rest = sum(fixed) + 2 * 2 + sum(3 * w + 2 + 2 for w in widths)
    name_width = max(12, min(NAME_WIDTH, WIDTH - rest))
    names = _names_of(results, name_width)
    name_width = max([len("trace")] + [len(n) for n in names])

    def line(first: List[str], per_group: List[List[str]]) -> str:
        cells = [first[0].ljust(name_width), first[1].rjust(fixed[0]), first[2].rjust(fixed[1])]
        for w, triple in zip(widths, per_group):
            cells.append(" ".join(c.rjust(w) for c in triple))
        return "  ".join(cells).rstrip()

    head = " " * (name_width + fixed[0] + fixed[1] + 6)
    head += "  ".join(title.center(3 * w + 2) for (title, _), w in zip(groups, widths))
    lines = [head.rstrip(), line(["trace", "dev", "peak live"], [["p", "n", "e"]] * len(groups)),
             line(["-" * name_width, "-" * fixed[0], "-" * fixed[1]], [["-" * w] * 3 for w in widths])]
    for i, r in enumerate(results):
        lines.append(line([names[i], str(r.device), _bytes(r.peak_live_bytes)], [cells[i] for _, cells in groups]))
    return "\n".join(lines)


def shortened_names(results: Sequence[Any]) -> List[Tuple[str, str]]:
    """(short name, file name without folder and extension) of each trace whose short
    name is not its file's, once each, in order."""
    pairs = [(n, _stem(_get(r, "trace"))) for n, r in zip(_names_of(results), results)]
    return list(dict.fromkeys((n, stem) for n, stem in pairs if n != stem))


def format_names(results: Sequence[Any]) -> str:
    """The trace names the terminal's table shortened, each beside its file's name ("" if none)."""
    shortened = shortened_names(results)
    if not shortened:
        return ""
    pad = max(len(n) for n, _ in shortened)
    lines = ["Names shortened in the table:"]
    for name, stem in shortened:
        lines += textwrap.wrap(f"{name.ljust(pad)}  {stem}", WIDTH, initial_indent="  ",
                               subsequent_indent=" " * (pad + 4), break_on_hyphens=False)
    return "\n".join(lines)


def wrap(text: str) -> str:
    """Text as lines of at most WIDTH columns."""
    return "\n".join(textwrap.wrap(text, WIDTH, break_on_hyphens=False))


def format_recorded(results: Sequence[ReplayResult]) -> str:
    """A line per trace whose snapshot says what its own run reserved or which device
    calls its allocator made: that run's peak reserved over peak live, and how many of
    those calls the model of its allocator makes ("" if none)."""
    lines = []
    for label, r in zip(_labels(results), results):
        parts = []
        if r.recorded_peak_reserved_bytes is not None and r.peak_live_bytes:
            parts.append(f"the recording run reserved {_to_live(r.recorded_peak_reserved_bytes, r.peak_live_bytes)} "
                         "x peak live")
        v = r.validation
        if v is not None:
            parts.append(f"the model of its allocator ({v['allocator']}) makes {v['matched_calls']} of its "
                         f"{v['recorded_calls']} recorded device calls" + _why_calls_differ(v))
        if parts:
            lines.append(textwrap.fill(f"{label}: " + "; ".join(parts) + ".", WIDTH,
                                       subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(lines)


def _why_calls_differ(v: Mapping[str, Any]) -> str:
    """The reason the replay can know why the model missed recorded calls: a recorded
    setting of PyTorch's allocator it does not apply ("" if it missed none, or knows none)."""
    missing = v.get("settings_not_applied") or []
    if v["matched_calls"] == v["recorded_calls"] or not missing:
        return ""
    return f" (with {', '.join(missing)} not applied: the model runs PyTorch's default there)"


# ---------------------------------------------------------------------------
# Where pyalloc wins, ties and loses


class Measure(NamedTuple):
    """One measure the sentences compare and the plot draws as a panel."""
    key: str      # the figure's key suffix (pyalloc_<key>, native_<key>, ...)
    name: str     # its name in the sentences
    axis: str     # the plot's x-axis label
    title: str    # the plot's panel title
    ratio: bool   # a ratio to peak live (else a count on a log axis)


#: The measures, in the sentences' and the plot's order: the one list both read.
MEASURES = (Measure("min_budget_bytes", "budget", "smallest budget without an out-of-memory / peak live",
                    "Equal budgets: the smallest device each completes on", True),
            Measure("peak_reserved_bytes", "uncapped reserved", "peak reserved with no cap / peak live",
                    "With no cap: peak reserved", True),
            Measure("driver_calls", "driver calls", "driver calls, uncapped (log scale)",
                    "Driver calls with no cap", False))

#: The allocators pyalloc is set against, as the sentences name them.
_OTHERS = (("native", "PyTorch's allocator"), ("native_expandable", "expandable segments"))

#: Traces named at most in one list of a sentence; the rest are counted.
_LISTED = 6


def _tally(results: Sequence[Any], labels: List[str], key: str, other: str,
           ratio: bool) -> Dict[str, List[Tuple[str, float, float]]]:
    """pyalloc's figure against `other`'s per result: wins, ties and losses, each
    (label, pyalloc's, other's), the figures ratios to peak live where `ratio`;
    'missing': results where either figure is unknown."""
    out: Dict[str, List[Tuple[str, float, float]]] = {"wins": [], "ties": [], "losses": [], "missing": []}
    for label, r in zip(labels, results):
        mine, theirs, live = _get(r, f"pyalloc_{key}"), _get(r, f"{other}_{key}"), _get(r, "peak_live_bytes")
        if mine is None or theirs is None or (ratio and not live):
            out["missing"].append((label, 0.0, 0.0))
            continue
        if ratio:
            mine, theirs = mine / live, theirs / live
        if abs(mine - theirs) <= TIE * max(mine, theirs):
            out["ties"].append((label, mine, theirs))
        else:
            out["wins" if mine < theirs else "losses"].append((label, mine, theirs))
    return out


def _figure(v: float, ratio: bool) -> str:
    return f"{v:.3f}" if ratio else str(int(v))


def _listed(entries: List[Tuple[str, float, float]], ratio: bool, figures: bool) -> str:
    shown = [f"{label}: {_figure(m, ratio)} against {_figure(t, ratio)}" if figures else label
             for label, m, t in entries[:_LISTED]]
    more = len(entries) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def verdicts(results: Sequence[Union[ReplayResult, Mapping[str, Any]]]) -> List[str]:
    """Sentences, computed from the figures given (ReplayResults, or their dicts as
    --json and fragmentation.json hold them), saying on each measure (budget,
    uncapped reserved, driver calls; lower is better, within TIE a tie) where pyalloc
    wins, ties and loses against PyTorch's allocator and its expandable segments,
    then where it loses, worst first. Each sentence is one string, unwrapped."""
    labels = _labels(results)
    total = len(results)
    sentences = []
    losses: List[str] = []
    for key, measure, _, _, ratio in MEASURES:
        parts = []
        for other, other_name in _OTHERS:
            t = _tally(results, labels, key, other, ratio)
            subject = "pyalloc" if not parts else "it"
            said = _said(t, total, ratio)
            parts.append(f"against {other_name}, {subject} {said}" if said
                         else f"against {other_name}, no figure to compare")
            if t["losses"]:
                worst = max(t["losses"], key=lambda e: e[1] / e[2] if e[2] else float("inf"))
                figures = f"{_figure(worst[1], ratio)} against {_figure(worst[2], ratio)}"
                counted = total - len(t["missing"])
                losses.append(f"{measure} against {other_name} ({figures})" if total == 1 else
                              f"{measure} against {other_name} on {len(t['losses'])} of {counted} "
                              f"(worst: {worst[0]}, {figures})")
        sentences.append(f"{measure[0].upper()}{measure[1:]}: " + "; ".join(parts) + ".")
    if losses:
        sentences.append("Where pyalloc loses: " + "; ".join(losses) + ".")
    elif total == 1:
        sentences.append("pyalloc loses nowhere on this trace.")
    else:
        sentences.append(f"pyalloc loses nowhere on these {total} traces and devices.")
    return sentences


def _said(t: Dict[str, List[Tuple[str, float, float]]], total: int, ratio: bool) -> str:
    """'wins on 19, ties on 5 (a, b, ...), loses on 1 (c: 1.2 against 1.1)'; for a single
    trace 'wins (1.106 against 1.627)'; "" where nothing could be compared."""
    counted = total - len(t["missing"])
    said = []
    for kind, verb in (("wins", "wins"), ("ties", "ties"), ("losses", "loses")):
        entries = t[kind]
        if not entries:
            continue
        if total == 1:
            [(_, mine, theirs)] = entries
            said.append(f"{verb} ({_figure(mine, ratio)} against {_figure(theirs, ratio)})")
        elif len(entries) == counted > 1:
            said.append(f"{verb} on all {counted}")
        elif kind == "wins":
            said.append(f"{verb} on {len(entries)}")
        else:
            said.append(f"{verb} on {len(entries)} ({_listed(entries, ratio, kind == 'losses')})")
    if said and t["missing"]:
        said.append(f"has no figure to compare on {len(t['missing'])}")
    return ", ".join(said)


#: How the sentences name each allocator of allocators.ALLOCATORS.
ALLOCATOR_NAMES = {
    "pyalloc": "pyalloc",
    "native": "PyTorch",
    "native_expandable": "PyTorch with expandable segments",
}


def _and(names: List[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def oom_sentence(oom: Dict[str, Any]) -> str:
    """What a recorded out-of-memory error was, in words a person can act on:
    "a 4.94 GiB allocation with 78.29 GiB live: not fragmentation: 83.20 GiB needed
    on 78.50 GiB (4.70 GiB short); 78.42 GiB reserved, 132.94 MiB of it not live,
    ...; none of pyalloc (4.96 GiB short), ... would have served it; reduce memory",
    or "...: fragmentation: 80.00 MiB needed on 110.00 MiB; ...; pyalloc (9.69 MiB
    to spare) would have served it, PyTorch (20.00 MiB short) would not". The
    allocation's size is the one PyTorch recorded, rounded as it rounds requests.
    Under a recorded memory fraction the capacity says so, and what device memory
    it assumed; under an inferred cap, what betrayed it. Each allocator's figure is
    the capacity left over, or missing, against the smallest on which it serves the
    run up to the error (min_capacity_bytes). Allocators whose answer is unknown
    (None) are left out; figures a dict lacks (an older --json) are not said."""
    size, live, capacity = oom["size_bytes"], oom["live_bytes"], oom["capacity_bytes"]
    needed = live + size
    head = f"a {format_bytes(size)} allocation with {format_bytes(live)} live"
    if capacity is None:
        return (f"{head}: {format_bytes(needed)} needed; the snapshot does not say how much the "
                "device held, so no verdict")
    served = oom["served_by"]
    yes = [_with_margin(a, oom) for a, v in served.items() if v is True]
    no = [_with_margin(a, oom) for a, v in served.items() if v is False]
    on = f"{format_bytes(capacity)}{_fraction_note(oom)}"
    fragmentation = oom["fragmentation"]
    if fragmentation:
        text = f"fragmentation: {format_bytes(needed)} needed on {on}"
    elif fragmentation is False:
        text = (f"not fragmentation: {format_bytes(needed)} needed on {on} "
                f"({format_bytes(needed - capacity)} short)")
    else:
        text = f"fragmentation only if the cap was at least {format_bytes(needed)}, which the snapshot does not tell"
    text += _cap_note(oom) + _reserved_note(oom)
    if yes and no:
        text += f"; {_and(yes)} would have served it, {_and(no)} would not"
    elif yes:
        text += f"; {_and(yes)} would have served it"
    elif len(no) > 1:
        text += f"; none of {', '.join(no)} would have served it"
    elif no:
        text += f"; {_and(no)} would not have served it"
    if fragmentation is False:
        text += "; reduce memory"
    return f"{head}: {text}"


def _with_margin(allocator: str, oom: Dict[str, Any]) -> str:
    """"pyalloc (9.69 MiB to spare)" or "PyTorch (20.00 MiB short)": the capacity
    against the smallest the allocator needs, where that is known and agrees with
    whether it served the error (a replay at the capacity, served_by); the name
    alone otherwise."""
    name = ALLOCATOR_NAMES.get(allocator, allocator)
    need = (oom.get("min_capacity_bytes") or {}).get(allocator)
    served, capacity = oom["served_by"].get(allocator), oom["capacity_bytes"]
    if need is None or served is None or served != (need <= capacity):
        return name
    if served:
        return f"{name} ({format_bytes(capacity - need)} to spare)"
    return f"{name} ({format_bytes(need - capacity)} short)"


def _reserved_note(oom: Dict[str, Any]) -> str:
    """"; 100.00 MiB reserved, 50.00 MiB of it not live, the largest free block of
    its pool and stream 2.00 MiB" where the recording allocator's reserved bytes are
    known; the largest free block "not known" where the snapshot's segments are not
    those of the error."""
    reserved, unused = oom.get("reserved_bytes"), oom.get("unused_bytes")
    if reserved is None or "largest_free_block_bytes" not in oom:
        return ""
    # An inferred cap's note has just named the reserved bytes.
    parts = [] if oom.get("cap_inferred") else [f"{format_bytes(reserved)} reserved"]
    if unused is not None:
        parts.append(f"{format_bytes(unused)} of it not live")
    largest = oom["largest_free_block_bytes"]
    if largest is None:
        parts.append("the largest free block not known (the segments changed after the error)")
    else:
        parts.append(f"the largest free block of its pool and stream {format_bytes(largest)}")
    return "; " + ", ".join(parts)


def _cap_note(oom: Dict[str, Any]) -> str:
    """"; under the per-process cap of ..." where the recorder kept the cap PyTorch's
    observer reported; "; a cap was in force: ..." where one the snapshot does not
    record was inferred (oom._capacity): the evidence, and what the capacity
    was taken as."""
    recorded = oom.get("cap_recorded_bytes")
    if recorded is not None:
        return f"; under the per-process cap of {format_bytes(recorded)} PyTorch reported at the error"
    if not oom.get("cap_inferred"):
        return ""
    reserved, below = oom["reserved_bytes"], oom["cap_below_bytes"]
    return (f"; a cap was in force: {format_bytes(oom['device_free_bytes'])} free on the device, more than the "
            f"{format_bytes(below - reserved)} segment it wanted; taken as the {format_bytes(reserved)} reserved "
            f"(it lay below {format_bytes(below)})")


def _fraction_note(oom: Dict[str, Any]) -> str:
    """" (memory fraction 0.5 of ...)" where a recorded fraction capped the capacity;
    " of the device's 80.00 GiB" where the device's memory is known without one."""
    fraction, total = oom.get("memory_fraction"), oom.get("device_total_bytes")
    if total is None:
        return ""
    if fraction is None:
        return f" of the device's {format_bytes(total)}"
    if oom.get("device_total_assumed"):
        return (f" (memory fraction {fraction:g} of the device, whose memory the snapshot does "
                f"not record: taken as {format_bytes(total)}, reserved plus free at the error)")
    return f" (memory fraction {fraction:g} of {format_bytes(total)})"


def _oom_lines(r: ReplayResult, oom: Dict[str, Any]) -> List[str]:
    """One recorded out-of-memory error's sentence, named by trace and event, as
    lines of at most WIDTH columns, the later ones indented."""
    return textwrap.wrap(f"{_label(r)}, event {oom['event']}: {oom_sentence(oom)}", WIDTH,
                         subsequent_indent="  ", break_on_hyphens=False)


def format_ooms(results: Sequence[ReplayResult]) -> str:
    """A sentence per out-of-memory error the traces recorded, each within WIDTH
    columns, its later lines indented ("" if none)."""
    return "\n".join(line for r in results for oom in r.recorded_ooms for line in _oom_lines(r, oom))


#: At most this many lines in format_verdict().
VERDICT_LINES = 8


def format_verdict(results: Sequence[ReplayResult], path: str) -> List[str]:
    """What a program that just ran out of memory prints on stderr, from the replay
    of the snapshot it left at `path` (replay_devices(path)): for each device, its
    last recorded out-of-memory error (the one the snapshot was taken at), in the
    very sentence ``pyalloc replay PATH`` prints for it (format_ooms()), as many as
    fit VERDICT_LINES, a count of those left out, then the command that replays
    the file again. Lines of at most WIDTH columns (the command's excepted: it
    stays whole, to be copied), VERDICT_LINES at most unless the first sentence
    alone takes more; [] when the results recorded no out-of-memory error."""
    recorded = [(r, r.recorded_ooms[-1]) for r in results if r.recorded_ooms]
    if not recorded:
        return []
    total = sum(len(r.recorded_ooms) for r in results)
    command = "pyalloc replay " + shlex.quote(os.fspath(path))
    lines: List[str] = []
    shown = 0
    for r, oom in recorded:
        sentence = _oom_lines(r, oom)
        # One line for the command, one for a count of those left out.
        if lines and len(lines) + len(sentence) > VERDICT_LINES - 2:
            break
        lines += sentence  # whole, the first one too: a sentence cut short would lose figures
        shown += 1
    if total > shown:
        lines.append(f"  ({total - shown} more out-of-memory error(s) in this file: pyalloc replay lists each)")
    # The command stays whole on its line, to be copied, however long the path.
    said = "to replay it again, with the table and every error:"
    return lines + ([f"{said} {command}"] if len(said) + 1 + len(command) <= WIDTH else [said, "  " + command])


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


#: The allocators of the comparison plot, with their labels and colours.
_ALLOCATOR_STYLE = (("pyalloc", "pyalloc", "tab:blue"), ("native", "PyTorch default", "tab:orange"),
                    ("native_expandable", "PyTorch expandable_segments", "tab:green"))


def plot_comparison(results: Sequence[ReplayResult], path: str) -> None:
    """The three measures of each allocator, per trace, to an image file (comparison_figure())."""
    comparison_figure(results).savefig(path, dpi=110)


def comparison_figure(results: Sequence[ReplayResult]):
    """Three panels side by side, one per measure the sentences compare (verdicts()):
    budget / peak live, uncapped reserved / peak live and driver calls on a log axis;
    one group of bars per trace and device, one bar per allocator, lower better in
    each, so that where pyalloc loses shows as plainly as where it wins (a matplotlib
    Figure with an Agg canvas). 1.0 is peak live, the least any allocator must hold;
    a missing bar is a figure not measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in results if r.peak_live_bytes > 0]
    fig = Figure(figsize=(15, 0.42 * len(rows) + 1.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(MEASURES), sharey=True, squeeze=False)[0]
    height = 0.27
    names = [f"{n} (dev {r.device}, {format_bytes(r.peak_live_bytes)})" for n, r in zip(_names_of(rows), rows)]
    for ax, (key, _, xlabel, title, ratio) in zip(axes, MEASURES):
        for k, (name, label, colour) in enumerate(_ALLOCATOR_STYLE):
            ys, xs = [], []
            for i, r in enumerate(rows):
                value = getattr(r, f"{name}_{key}")
                if value:
                    ys.append(i + (k - 1) * height)
                    xs.append(value / r.peak_live_bytes if ratio else value)
            ax.barh(ys, xs, height=height, label=label, color=colour)
        if ratio:
            ax.axvline(1.0, color="black", linewidth=0.8)
            ax.set_xlim(left=0.95)
        else:
            ax.set_xscale("log")
            ax.set_xlim(left=1)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows)), names, fontsize=8)
    axes[0].set_ylim(len(rows) - 0.5, -0.5)  # the first trace on top, no margin
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(_ALLOCATOR_STYLE), fontsize=9,
               title="lower is better in every panel", title_fontsize=9)
    return fig


def _setup(conf: Optional[str]) -> str:
    """'strategy vmm, config segment_size:64MiB' (the defaults named as such)."""
    from .._config import parse_config

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
