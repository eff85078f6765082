"""Out-of-memory diagnosis: was a recorded OOM fragmentation, and which
allocator would have served the request?

PyTorch records an ``oom`` event when its allocator gives up on a request, with
the size of the block it could not get and the device's free bytes
(``device_free``) at that moment, after its own out-of-memory path has released
what it could. That size is the request rounded up as PyTorch's allocator rounds
it (``params.size()``: a multiple of 512 bytes, or as ``roundup_power2_divisions``
rounds), not the bytes asked for, which the event does not keep; it is what is replayed and
reported here (``size_bytes``), as "a 4.94 GiB allocation". Each such event is
replayed as the allocation it was:

- the capacity then: the recording allocator's reserved bytes at that event
  (followed from the final segments, as for the native figure) plus
  ``device_free``: all the memory the run could have had. Where the snapshot's
  ``allocator_settings`` record a per-process memory fraction
  (``snapshot_io.memory_fraction``), PyTorch could reserve at most that fraction
  of the device's memory, so the capacity is min(reserved + device_free,
  fraction x device memory). A snapshot does not record the device's memory:
  unless the caller gives it, it is taken as reserved + device_free at the event
  (``device_total_assumed``), which leaves out what the CUDA context and other
  processes held, and so errs low; the cap is never taken below the reserved
  bytes, which the recording allocator held under it;
- the bytes live then (requested, not yet freed, blocks live before the trace
  included);
- the verdict: fragmentation when live + the allocation fit that capacity (an
  allocator that wasted less would have served it), otherwise not, short by
  live + allocation - capacity (no allocator could have: the run needs less memory);
- for each allocator of ``replay_allocators.ALLOCATORS``, whether it would have
  served the allocation: the trace's calls up to the event, then the allocation
  (freed right after), replayed from the start on a device of that capacity.
  Served means every allocation up to and including this one was served; an
  allocator that fails earlier would not have reached it. An allocator that this
  build cannot run is reported as None.
"""
from __future__ import annotations

import dataclasses
from array import array
from bisect import bisect_left
from typing import Any, Dict, List, Optional

from . import _C
from .replay_allocators import ALLOCATORS, run_allocator
from .snapshot_io import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Trace, memory_fraction

__all__ = ["MAX_OOM_REPLAYS", "diagnose_ooms", "recorded_reserved_at"]

#: Recorded OOMs per device whose request is replayed through the allocators; the
#: verdict of later ones stands, their served_by is None (each replay runs the
#: trace from the start, so a file of many oom events must not cost that many).
MAX_OOM_REPLAYS = 16

_GROW = (SEGMENT_ALLOC, SEGMENT_MAP)
_SHRINK = (SEGMENT_FREE, SEGMENT_UNMAP)


def recorded_reserved_at(trace: Trace, start: Optional[int], events: List[int]) -> List[Optional[int]]:
    """The recording allocator's reserved bytes just before each of `events`
    (sorted trace indices), from its reserved bytes at the start of the trace
    (``ReplayPlan.native_start_bytes``; None: unknown, and so is every answer)."""
    if start is None:
        return [None] * len(events)
    out: List[Optional[int]] = []
    reserved, i = start, 0
    for event in events:
        while i < event:
            code = trace.actions[i]
            if code in _GROW:
                reserved += trace.sizes[i]
            elif code in _SHRINK:
                reserved -= trace.sizes[i]
            i += 1
        out.append(reserved)
    return out


def diagnose_ooms(trace: Trace, plan: Any, conf: str,
                  device_total: Optional[int] = None) -> List[Dict[str, Any]]:
    """One dict per readable oom event of `trace` (see the module docstring):
    ``{event, size_bytes, live_bytes, capacity_bytes, fragmentation, served_by,
    memory_fraction, device_total_bytes, device_total_assumed}``, ``size_bytes``
    being the size PyTorch recorded (rounded, not requested) and ``served_by`` by
    allocator name. Where the recording allocator's reserved bytes are unknown
    (no segments), capacity, verdict and served_by are None. ``memory_fraction``
    is the recorded per-process memory fraction (None: none recorded);
    ``device_total_bytes`` the device memory its cap was taken of (`device_total`
    where given, else reserved + device_free: ``device_total_assumed``), None
    where no fraction applies."""
    ooms = sorted(trace.ooms)
    if not ooms:
        return []
    fraction = memory_fraction(trace.metadata)
    events = [event for event, _, _, _ in ooms]
    reserved = recorded_reserved_at(trace, plan.native_start_bytes, events)
    # The failed allocation goes in before the first call of a later event.
    points = [bisect_left(plan.events, event) for event in events]
    lives = _live_before(plan, points)
    out = []
    for n, ((event, size, free, stream), held, k, live) in enumerate(zip(ooms, reserved, points, lives)):
        capacity = None if held is None else held + free
        total = None
        if capacity is not None and fraction is not None:
            total = device_total if device_total else capacity
            # The recording allocator held `held` under the cap: it is at least that.
            capacity = min(capacity, max(int(fraction * total), held))
        served_by: Dict[str, Optional[bool]] = {a: None for a in ALLOCATORS}
        if capacity is not None and n < MAX_OOM_REPLAYS:
            served_by = _served_by(plan, k, event, size, stream, capacity, conf)
        out.append({
            "event": event,
            "size_bytes": size,
            "live_bytes": live,
            "capacity_bytes": capacity,
            "fragmentation": None if capacity is None else live + size <= capacity,
            "served_by": served_by,
            "memory_fraction": fraction,
            "device_total_bytes": total,
            "device_total_assumed": total is not None and not device_total,
        })
    return out


def _live_before(plan: Any, points: List[int]) -> List[int]:
    """Requested bytes live before op k, for each k of `points` (ascending). A block
    whose free was requested (kind 3: it waits on other streams) counts as freed
    there: PyTorch's out-of-memory path frees it before the error."""
    out = []
    live = op = 0
    requested = set()
    for k in points:
        while op < k:
            kind, id_ = plan.kinds[op], plan.ids[op]
            if kind == 1:
                live += plan.sizes[op]
            elif kind == 3:
                live -= plan.sizes[op]
                requested.add(id_)
            elif id_ in requested:
                requested.discard(id_)
            else:
                live -= plan.sizes[op]
            op += 1
        out.append(live)
    return out


def _served_by(plan: Any, k: int, event: int, size: int, stream: int, capacity: int,
               conf: str) -> Dict[str, Optional[bool]]:
    sub = _with_request(plan, k, event, size, stream)
    calls = _C.ReplayTrace(sub.kinds, sub.ids, sub.sizes, sub.streams)
    served: Dict[str, Optional[bool]] = {}
    for name in ALLOCATORS:
        try:
            run = run_allocator(calls, name, capacity=max(capacity, 1), stop_on_oom=True,
                                conf=conf, plan=sub)
        except NotImplementedError:
            served[name] = None
            continue
        served[name] = run.completed
    return served


def _with_request(plan: Any, k: int, event: int, size: int, stream: int) -> Any:
    """The plan's first k calls, then an alloc of `size` bytes (the recorded,
    rounded size) on `stream` standing for trace event `event` and its free. Ids are renumbered densely (a
    ReplayTrace wants them below its number of calls). The prefix keeps its free requests (kind 3) whose
    free comes after the event: the allocators free those blocks on their out-of-memory path, as
    PyTorch did before it gave up."""
    slot: Dict[int, int] = {}
    ids = array("I", (slot.setdefault(i, len(slot)) for i in plan.ids[:k]))
    request = len(slot)
    ids.extend((request, request))
    kinds = plan.kinds[:k]
    kinds.extend((1, 2))
    sizes = plan.sizes[:k]
    sizes.extend((size, size))
    streams = plan.streams[:k]
    streams.extend((stream, stream))
    events = plan.events[:k]
    events.extend((event, event))
    return dataclasses.replace(plan, kinds=kinds, ids=ids, sizes=sizes, streams=streams, events=events)
