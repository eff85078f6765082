"""Checks the model of PyTorch's allocator against the device calls a snapshot recorded.

A snapshot recorded under PyTorch's native allocator holds its device calls:
``segment_alloc`` / ``segment_free`` (cudaMalloc / cudaFree) or, with
``expandable_segments:True``, ``segment_map`` / ``segment_unmap``. The model
(csrc/replay/torch_model.h) replays the same trace and is asked to make the
same calls, in the same order, of the same sizes, while serving the same
allocations. What it is given, and why each is the recording's and not the
allocator's own decision:

- The segments present before the trace: the final segments, with the trace's
  segment_alloc undone and its segment_free redone, walking back; the blocks
  live before the trace sit at their recorded addresses in them.
- The recording run's own releases. PyTorch gives memory back only in
  release_cached_blocks (``empty_cache()`` or an out-of-memory retry), and the
  model runs uncapped, so it never releases on its own: every recorded
  segment_free / segment_unmap is such a release, and the model calls
  release_cached_blocks before the allocator call that followed it.

Where the driver puts a segment is the driver's choice, and best fit breaks ties
between equal free blocks by address, so it decides which block is reused. The
model places each cudaMalloc itself, in the highest free range (the Linux driver
hands out successive addresses mostly downwards); with ``driver_addresses=True``
it takes the recorded address of each cudaMalloc instead (when the sizes agree).
On the GPU snapshots of ../shared both give every call.

A call matches when its action, size and the allocator call that made it
(its op in the ReplayTrace) agree; ``matched_calls`` counts the longest run of
matching calls in order (difflib's matching blocks).
"""
from __future__ import annotations

import bisect
import difflib
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import _C
from .snapshot_io import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Trace

__all__ = ["Validation", "validate"]

_NAMES = {SEGMENT_ALLOC: "segment_alloc", SEGMENT_FREE: "segment_free",
          SEGMENT_MAP: "segment_map", SEGMENT_UNMAP: "segment_unmap"}
_SMALL_SEGMENT = 2 << 20  # the small pool's segment: no large-pool segment is this small


@dataclass
class Validation:
    """How closely the model made the recorded device calls."""

    allocator: str                  # the model checked: "native" or "native_expandable"
    recorded_calls: int
    matched_calls: int
    model_calls: int
    first_mismatch: Optional[int]   # index of the first recorded call the model did not make in place; None if all
    by_action: Dict[str, List[int]] = field(default_factory=dict)  # action -> [matched, recorded]
    seeded_segments: int = 0        # segments present before the trace, given to the model
    releases: int = 0               # the recording's release_cached_blocks calls, given to the model
    peak_reserved_bytes: int = 0    # the model's, from the seeded start
    driver_addresses: bool = False  # the recorded cudaMalloc addresses were given to the model
    #: Recorded settings of PyTorch's allocator the model does not apply (settings):
    #: where the calls differ, a reason the replay can know.
    settings_not_applied: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def validate(trace: Trace, plan: Any, calls: Any, *, driver_addresses: bool = False) -> Optional[Validation]:
    """Replays the model of the allocator that recorded `trace` (its
    allocator_settings, or segment_map events, say which) and compares its device
    calls with the recorded ones. None when the trace records no device calls,
    or was recorded by pyalloc (its ``allocator_settings`` name a strategy).
    `plan` and `calls` are the trace's ReplayPlan and ReplayTrace."""
    settings = trace.metadata.get("allocator_settings")
    if isinstance(settings, dict) and "strategy" in settings:
        return None  # recorded by pyalloc (its settings name a strategy): no model of PyTorch's to check
    recorded = [(trace.actions[i], i, trace.addrs[i], trace.sizes[i], trace.streams[i])
                for i in range(len(trace)) if trace.actions[i] in _NAMES]
    if not recorded:
        return None
    expandable = (settings.get("expandable_segments") is True if isinstance(settings, dict) else False) or any(
        code in (SEGMENT_MAP, SEGMENT_UNMAP) for code, *_ in recorded) or any(s[4] for s in trace.segment_list)

    # The op each recorded call belongs to: the allocator call that followed it.
    events = list(plan.events)
    def op_of(event: int) -> int:
        return bisect.bisect_right(events, event)

    want = [(code, op_of(e), size) for code, e, _, size, _ in recorded]
    releases = array("Q", sorted({op for code, op, _ in want if code in (SEGMENT_FREE, SEGMENT_UNMAP)}))
    hints = [(size, addr) for code, _, addr, size, _ in recorded if code == SEGMENT_ALLOC] if driver_addresses else None

    seed: Optional[List[Tuple[int, int, int, bool]]] = None
    place_at = None
    if not expandable:
        seed = _segments_before(trace, recorded)
        if seed:
            n = len(plan.preexisting_addrs)
            place_at = array("Q", plan.preexisting_addrs)
            place_at.extend([0] * (len(plan) - n))
    # The model runs with the settings the recording allocator had (max_split_size_mb...).
    options = trace.torch_settings.model_options()
    try:
        r = _C.run_torch_model(calls, expandable=expandable, record_calls=True, seed=seed,
                               place_at=place_at, releases=releases, malloc_hints=hints, **options)
    except ValueError:  # segments that overlap: a snapshot at odds with itself; start empty
        seed, place_at = None, None
        r = _C.run_torch_model(calls, expandable=expandable, record_calls=True, releases=releases,
                               malloc_hints=hints, **options)
    made = [(code, op, size) for code, op, _, size in r["calls"]]

    by_action: Dict[str, List[int]] = {}
    for code, _, _ in want:
        by_action.setdefault(_NAMES[code], [0, 0])[1] += 1
    matched = 0
    # The common case, every call in place, without difflib's quadratic worst case.
    blocks = ([difflib.Match(0, 0, len(want))] if made == want else
              difflib.SequenceMatcher(None, made, want, autojunk=False).get_matching_blocks())
    for block in blocks:
        matched += block.size
        for code, _, _ in want[block.b:block.b + block.size]:
            by_action[_NAMES[code]][0] += 1
    first = next((i for i, (a, b) in enumerate(zip(made, want)) if a != b), None)
    if first is None and len(made) != len(want):
        first = min(len(made), len(want))
    return Validation(
        allocator="native_expandable" if expandable else "native",
        recorded_calls=len(want),
        matched_calls=matched,
        model_calls=len(made),
        first_mismatch=first,
        by_action=by_action,
        seeded_segments=len(seed or []),
        releases=len(releases),
        peak_reserved_bytes=r["peak_reserved_bytes"],
        driver_addresses=driver_addresses,
        settings_not_applied=list(trace.torch_settings.not_applied),
    )


def _segments_before(trace: Trace, recorded: List[Tuple[int, int, int, int, int]]) -> List[Tuple[int, int, int, bool]]:
    """The segments present when the trace began: the final ones, walking the
    trace's segment_alloc / segment_free back."""
    segments: Dict[int, Tuple[int, int, bool]] = {
        addr: (size, stream, small) for addr, size, stream, small, _ in trace.segment_list}
    for code, _, addr, size, stream in reversed(recorded):
        if code == SEGMENT_ALLOC:
            segments.pop(addr, None)
        elif code == SEGMENT_FREE:
            segments[addr] = (size, stream, size == _SMALL_SEGMENT)
    return [(addr, size, stream, small) for addr, (size, stream, small) in sorted(segments.items())]
