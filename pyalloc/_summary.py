"""The text of ``memory_summary()``: a table of statistics, then fragmentation.

It takes plain dicts (the ``torch.cuda.memory_stats()`` keys and the
``fragmentation()`` dict), so any pool's numbers can be shown, a host-backend
``Allocator``'s included.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping

WIDTH = 79  # every line, borders included

# (stat family, label, how to show it)
_BYTE_ROWS = (
    ("allocated_bytes", "Allocated memory"),
    ("active_bytes", "Active memory"),
    ("requested_bytes", "Requested memory"),
    ("reserved_bytes", "Reserved memory"),
    ("inactive_split_bytes", "Non-releasable memory"),
)
_COUNT_ROWS = (
    ("allocation", "Allocations"),
    ("active", "Active allocs"),
    ("segment", "Reserved segments"),
    ("inactive_split", "Non-releasable allocs"),
)
_COLUMNS = ("current", "peak", "allocated", "freed")
_HEADINGS = ("Current", "Peak", "Tot alloc", "Tot freed")
_LABEL = 25  # width of the metric column
_CELL = 13  # width of each number column


def size_text(n: int) -> str:
    """'0 B', '512 B', '1.5 KiB', '20.0 MiB': one decimal above a KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _rule(char: str = "-") -> str:
    return "|" + char * (WIDTH - 2) + "|"


def _line(text: str) -> str:
    return "| " + text.ljust(WIDTH - 4)[: WIDTH - 4] + " |"


def _centered(text: str) -> str:
    return "|" + text.center(WIDTH - 2)[: WIDTH - 2] + "|"


def _row(label: str, cells: List[str]) -> str:
    body = f" {label:<{_LABEL - 1}}" + "".join(f"|{c:>{_CELL - 2}} " for c in cells)
    return "|" + body.ljust(WIDTH - 2) + "|"


def _stat_rows(stats: Mapping[str, int], family: str, label: str, fmt, pools: bool) -> List[str]:
    subrows = [("all", label)]
    if pools:
        subrows += [("large_pool", "  from large pool"), ("small_pool", "  from small pool")]
    return [
        _row(name, [fmt(stats[f"{family}.{pool}.{col}"]) for col in _COLUMNS])
        for pool, name in subrows
    ]


def format_summary(
    stats: Mapping[str, int],
    frag: Mapping[str, Any],
    device: int = 0,
    abbreviated: bool = False,
    graph_blocks: int = 0,
    graph_bytes: int = 0,
) -> str:
    """The summary table of one device.

    Args:
        stats: ``torch.cuda.memory_stats()`` keys (e.g. from ``memory_stats()``).
        frag: a ``fragmentation()`` dict.
        device: the device index shown in the title.
        abbreviated: leave out the per-pool rows and the free-block histogram.
        graph_blocks, graph_bytes: memory held for CUDA graphs, shown if any.
    """
    count = lambda n: f"{n:,}"  # noqa: E731
    lines = [
        _rule("="),
        _centered(f"pyalloc CUDA memory summary, device {device}"),
        _rule(),
        _line(
            f"Out-of-memory errors: {stats['num_ooms']:,}    "
            f"retries after emptying the cache: {stats['num_alloc_retries']:,}"
        ),
        _line(
            f"Segments reserved from the device: {stats['num_device_alloc']:,}    "
            f"released: {stats['num_device_free']:,}"
        ),
        _rule("="),
        _row("Metric", list(_HEADINGS)),
    ]
    for family, label in _BYTE_ROWS:
        lines.append(_rule())
        lines += _stat_rows(stats, family, label, size_text, not abbreviated)
    for family, label in _COUNT_ROWS:
        lines.append(_rule())
        lines += _stat_rows(stats, family, label, count, not abbreviated)
    lines.append(_rule())
    for family, label in (("oversize_allocations", "Oversize allocations"),
                          ("oversize_segments", "Oversize segments")):
        lines.append(_row(label, [count(stats[f"{family}.{col}"]) for col in _COLUMNS]))
    lines += _fragmentation_lines(stats, frag, abbreviated, graph_blocks, graph_bytes)
    lines.append(_rule("="))
    return "\n".join(lines) + "\n"


def _fragmentation_lines(
    stats: Mapping[str, int], frag: Mapping[str, Any], abbreviated: bool,
    graph_blocks: int, graph_bytes: int,
) -> List[str]:
    free = frag["free_bytes"]
    largest = frag["largest_free_block"]
    split = stats["max_split_size"]
    lines = [
        _rule("="),
        _centered("Fragmentation of the general pool"),
        _rule(),
        _line(f"Free in reserved memory:  {size_text(free)} in {frag['free_blocks']:,} blocks"),
        _line(
            f"  large / small pool:     {size_text(frag['large_pool_free_bytes'])} / "
            f"{size_text(frag['small_pool_free_bytes'])}"
        ),
        _line(f"Largest free block:       {size_text(largest)}"),
        _line(
            f"  large / small pool:     {size_text(frag['large_pool_largest_free_block'])} / "
            f"{size_text(frag['small_pool_largest_free_block'])}"
        ),
        _line(
            f"External fragmentation:   {100.0 * frag['external_fragmentation']:.1f} %  "
            "(1 - largest free block / free)"
        ),
        _line(
            f"Waiting on other streams: {size_text(frag['pending_free_bytes'])}   "
            f"wholly free small chunks: {frag['free_small_chunks']:,}"
        ),
        _line("Max split size:           " + ("unlimited" if split < 0 else size_text(split))),
    ]
    if graph_blocks:
        lines.append(_line(f"Held for CUDA graphs:      {size_text(graph_bytes)} in {graph_blocks:,} blocks"))
    if not abbreviated and frag["histogram"]:
        lines.append(_rule())
        lines.append(_row("Free blocks by size", ["blocks", "bytes"]))
        for h in frag["histogram"]:
            label = f"{size_text(h['min_size'])} - {size_text(h['max_size'] + 1)}"
            lines.append(_row(label, [f"{h['count']:,}", size_text(h["bytes"])]))
    return lines
