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
  fraction x device memory). A snapshot does not record the device's memory;
  pyalloc's out-of-memory recorder writes it beside the snapshot (its
  ``pyalloc_oom`` key). Unless the caller or that record gives it, it is taken as
  reserved + device_free at the event (``device_total_assumed``), which leaves
  out what the CUDA context and other processes held, and so errs low; the cap
  is never taken below the reserved bytes, which the recording allocator held
  under it. A cap set with ``torch.cuda.set_per_process_memory_fraction`` is
  recorded nowhere, but an event with more free device memory than the block
  could need (``device_need``: its segment, or its expandable pages) betrays one:
  PyTorch's device call could not have failed, its cap check did (alloc_block
  refuses when reserved + the segment passes the cap). The cap then lay between
  the reserved bytes and the reserved bytes + that segment (``cap_below_bytes``);
  the capacity is taken as the reserved bytes (``cap_inferred``);
- the bytes live then (requested, not yet freed, blocks live before the trace
  included);
- the verdict: fragmentation when live + the allocation fit that capacity (an
  allocator that wasted less would have served it), otherwise not, short by
  live + allocation - capacity (no allocator could have: the run needs less memory).
  Under an inferred cap, None (withheld) where they fit below cap_below_bytes but
  not the reserved bytes: it depends on where the cap lay, which nothing tells;
- for each allocator of ``allocators.ALLOCATORS``, whether it would have
  served the allocation: the trace's calls up to the event, then the allocation
  (freed right after), replayed from the start on a device of that capacity.
  Served means every allocation up to and including this one was served; an
  allocator that fails earlier would not have reached it. An allocator that this
  build cannot run is reported as None;
- how much each had to spare or lacked: the smallest device on which it serves
  those calls (``min_capacity_bytes``), found by the budget search of the whole
  trace (``allocators.min_budget``) run on them, for the first MAX_OOM_SEARCHES
  events of a device and its last;
- what the recording allocator held then: its reserved bytes, those of them not
  live (``unused_bytes``: cached free blocks and rounding), and the largest free
  block that could have held the allocation (of its pool and stream), read from
  the final segments where they are the ones the event met (no event but oom
  events and the snapshot's own came after it), else None.

None of it depends on the budget search of the whole trace (``replay``'s
``search``): a verdict is the same whether or not that ran.
"""
from __future__ import annotations

import dataclasses
from array import array
from bisect import bisect_left
from typing import Any, Dict, List, Optional, Tuple

from .. import _C
from .allocators import ALLOCATORS, measure_live, min_budget, run_allocator
from .snapshot_io import (OOM, OTHER, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, Trace,
                          memory_fraction, recorded_device_total)

__all__ = ["MAX_OOM_REPLAYS", "MAX_OOM_SEARCHES", "device_need", "diagnose_ooms", "recorded_reserved_at",
           "segment_size"]

#: Recorded OOMs per device whose request is replayed through the allocators, and
#: the last one (the error a snapshot dumped at an out-of-memory error was taken
#: at); the verdict of the others stands, their served_by is None (each replay runs
#: the trace from the start, so a file of many oom events must not cost that many).
MAX_OOM_REPLAYS = 16

#: Recorded OOMs per device for which each allocator's smallest capacity is searched
#: (min_capacity_bytes, a bisection of some twenty replays each), and the last one;
#: None for the others.
MAX_OOM_SEARCHES = 4

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
    memory_fraction, device_total_bytes, device_total_assumed, reserved_bytes,
    device_free_bytes, cap_inferred, cap_below_bytes, unused_bytes,
    largest_free_block_bytes, min_capacity_bytes}``, ``size_bytes``
    being the size PyTorch recorded (rounded, not requested) and ``served_by`` by
    allocator name, as ``min_capacity_bytes`` is. Where the recording
    allocator's reserved bytes are unknown (no segments), capacity, verdict,
    served_by, reserved_bytes, unused_bytes and the largest free block are
    None. ``memory_fraction`` is the recorded per-process memory fraction (None:
    none recorded);
    ``device_total_bytes`` the device's memory: `device_total` where given, else
    what pyalloc's out-of-memory recorder wrote beside the snapshot
    (``snapshot_io.recorded_device_total``), else, where a fraction needs it,
    reserved + device_free (``device_total_assumed``); None where none of these."""
    ooms = sorted(trace.ooms)
    if not ooms:
        return []
    fraction = memory_fraction(trace.metadata)
    known = device_total or recorded_device_total(trace.metadata, trace.device)
    # The cap PyTorch's observer reported at the error, under a memory fraction: no
    # need to infer one.
    limit = recorded_device_total(trace.metadata, trace.device, "device_limit_bytes")
    events = [event for event, _, _, _ in ooms]
    reserved = recorded_reserved_at(trace, plan.native_start_bytes, events)
    # The failed allocation goes in before the first call of a later event.
    points = [bisect_left(plan.events, event) for event in events]
    lives = _live_before(plan, points)
    settled = _last_change(trace) + 1  # from this event on, the final segments are those the events met
    out = []
    for n, ((event, size, free, stream), held, k, live) in enumerate(zip(ooms, reserved, points, lives)):
        capacity, cap_below, total = None, None, known
        if held is not None:
            if fraction is not None:
                total = known or held + free
            if limit is not None:
                # It held `held` under the cap: the capacity is at least that.
                capacity, cap_below = min(held + free, max(limit, held)), None
            else:
                capacity, cap_below = _capacity(held, free, size, fraction, total,
                                                plan.torch_settings.large_segment_size or _LARGE_BUFFER)
        served_by: Dict[str, Optional[bool]] = {a: None for a in ALLOCATORS}
        needs: Dict[str, Optional[int]] = {a: None for a in ALLOCATORS}
        # The last one too: the error a snapshot taken at an out-of-memory error was taken at.
        last = n == len(ooms) - 1
        replayed = capacity is not None and (n < MAX_OOM_REPLAYS or last)
        if replayed or n < MAX_OOM_SEARCHES or last:
            sub, calls = _request_calls(plan, k, event, size, stream)
            if replayed:
                served_by = _served_by(sub, calls, capacity, conf)
            if n < MAX_OOM_SEARCHES or last:
                needs = _min_capacities(sub, calls, conf)
        out.append({
            "event": event,
            "size_bytes": size,
            "live_bytes": live,
            "capacity_bytes": capacity,
            "fragmentation": _fragmentation(live + size, capacity, cap_below),
            "served_by": served_by,
            "memory_fraction": fraction,
            "device_total_bytes": total,
            "device_total_assumed": total is not None and not known,
            "reserved_bytes": held,
            "device_free_bytes": free,
            "cap_inferred": cap_below is not None,
            "cap_recorded_bytes": limit if held is not None else None,
            "cap_below_bytes": cap_below,
            "unused_bytes": None if held is None or held < live else held - live,
            "largest_free_block_bytes": (_largest_free(trace, size, stream)
                                         if held is not None and event >= settled else None),
            "min_capacity_bytes": needs,
        })
    return out


# PyTorch's sizes (c10/cuda/CUDACachingAllocator.cpp): kSmallSize, the largest
# small-pool block; kSmallBuffer, a small segment (and a small page of an
# expandable segment); kMinLargeAlloc, below which a large block gets a
# kLargeBuffer segment (and the large pool's expandable page); kRoundLarge, the
# rounding of larger segments.
_SMALL_SIZE, _SMALL_BUFFER, _MIN_LARGE_ALLOC = 1 << 20, 2 << 20, 10 << 20
_LARGE_BUFFER, _ROUND_LARGE = 20 << 20, 2 << 20


def segment_size(size: int, large: int = _LARGE_BUFFER) -> int:
    """The segment PyTorch's allocator asks the device for to hold a block of
    `size` bytes (its get_allocation_size: alloc_block's p.alloc_size), the size
    its per-process memory fraction is checked against. `large`: its large
    segment (large_segment_size_mb, 20 MiB unless the snapshot records another)."""
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return large
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


def device_need(size: int, large: int = _LARGE_BUFFER) -> int:
    """The most device memory PyTorch's allocator can need to take a block of
    `size` bytes, with expandable segments or without: its segment, or the pages
    of an expandable segment that cover the block (2 MiB in the small pool, the
    large segment, `large`, in the large one)."""
    page = _SMALL_BUFFER if size <= _SMALL_SIZE else large
    return max(segment_size(size, large), -(-size // page) * page)


def _capacity(held: int, free: int, size: int, fraction: Optional[float],
              total: Optional[int], large: int = _LARGE_BUFFER) -> Tuple[int, Optional[int]]:
    """(the capacity, the bound a cap was inferred below, or None).

    All the run could have had is what it held and what the device had free;
    under a recorded fraction, no more than that fraction of the device (and no
    less than it held under it). A device with more free memory than the block
    could need (device_need) did not refuse it: a cap did, one the snapshot does
    not record (set_per_process_memory_fraction). alloc_block refuses when
    reserved + segment > the cap, and every earlier segment passed, so the cap
    lay in [held, held + segment): the capacity is taken as held, its lower bound."""
    capacity = held + free
    if fraction is not None and total is not None:
        capacity = min(capacity, max(int(fraction * total), held))
    if free >= device_need(size, large):
        below = held + segment_size(size, large)
        if capacity >= below:
            return held, below
    return capacity, None


def _fragmentation(need: int, capacity: Optional[int], cap_below: Optional[int]) -> Optional[bool]:
    """Whether `need` bytes (live + the block) fit the capacity; under an inferred
    cap, which lay in [capacity, cap_below), None where the answer depends on
    where in it: at least capacity fits any such cap, at least cap_below none."""
    if capacity is None:
        return None
    if need <= capacity:
        return True
    if cap_below is None or need >= cap_below:
        return False
    return None


def _last_change(trace: Trace) -> int:
    """The last event that can change the segments or their blocks (-1: none): after
    it, the final segments are the state every later event met."""
    for i in range(len(trace.actions) - 1, -1, -1):
        if trace.actions[i] not in (OOM, OTHER):
            return i
    return -1


def _largest_free(trace: Trace, size: int, stream: int) -> int:
    """The largest free block of the final segments that could have held a block of
    `size` bytes on `stream`: one of its pool (small up to 1 MiB, as PyTorch's
    get_pool picks) and of its stream (PyTorch reuses a block on its own stream
    only); 0 where there is none."""
    small = size <= _SMALL_SIZE
    return max((b for b, s, sm in trace.free_blocks if s == stream and sm == small), default=0)


def _request_calls(plan: Any, k: int, event: int, size: int, stream: int) -> Tuple[Any, Any]:
    """(the plan of the trace's calls up to the event and then the allocation
    (_with_request), with its live figures; its _C.ReplayTrace)."""
    sub = _with_request(plan, k, event, size, stream)
    measure_live(sub)
    return sub, _C.ReplayTrace(sub.kinds, sub.ids, sub.sizes, sub.streams)


def _min_capacities(sub: Any, calls: Any, conf: str) -> Dict[str, Optional[int]]:
    """For each allocator, the smallest device on which it serves `calls` (the
    trace's calls up to the event and then the allocation, _request_calls; the
    budget search of the whole trace, allocators.min_budget, on those calls);
    None where it serves them on no device (or this build cannot run it)."""
    needs: Dict[str, Optional[int]] = {a: None for a in ALLOCATORS}
    for name in ALLOCATORS:
        own = conf if name == "pyalloc" else ""  # pyalloc's configuration is pyalloc's alone
        try:
            uncapped = run_allocator(calls, name, conf=own, plan=sub)
        except NotImplementedError:
            continue
        if uncapped.completed:
            needs[name] = min_budget(calls, own, sub.peak_live_without_pending_bytes, uncapped.peak_reserved_bytes,
                                     None, name, settings=sub.torch_settings)[0]
    return needs


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


def _served_by(sub: Any, calls: Any, capacity: int, conf: str) -> Dict[str, Optional[bool]]:
    """For each allocator, whether it serves `calls` (_request_calls) on a device of
    `capacity` bytes; None where this build cannot run it."""
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
