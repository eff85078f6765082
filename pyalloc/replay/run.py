"""Replaying recorded allocation traces through pyalloc, with no GPU.

``pyalloc replay FILE...`` (or ``replay()`` from Python) answers "would pyalloc
have held this run, and in how much memory?" for PyTorch memory snapshots:

1. ``snapshot_io`` loads the file safely and reduces it to flat event arrays.
2. ``plan_trace`` resolves addresses into allocations. Addresses are reused,
   so identity follows event order: each alloc opens a new allocation at its
   address, the next free of that address closes it. The history is a ring
   buffer, so blocks live before it began are allocated first: the final
   segments' active blocks whose address no alloc or free of the trace
   mentions, and every free with no alloc before it. Each allocation stays on
   its stream. A block is freed at its ``free_completed`` (when the stream work
   using it was done), or at its ``free_requested`` when the trace has no
   completion for it. Where other calls come between the two (the block was
   used on another stream: ``record_stream``), its ``free_requested`` stays as
   a call of its own ("free requested"): an allocator's out-of-memory path
   waits for the streams and frees such blocks before it gives up (PyTorch's
   release_cached_blocks, pyalloc's release_cached), so under a capacity the
   replays free them there, and their completion then does nothing. A block
   whose free is still pending when the trace ends stays live but for that.
3. The C++ replayer (csrc/replay/replay.h) runs the calls against pyalloc's core on
   the virtual backend, which hands out addresses only: the whole trace in one
   call, without the GIL.
4. The same calls run through the model of PyTorch's caching allocator
   (csrc/replay/torch_model.h), default and with expandable_segments:True
   (``allocators.run_allocator`` names all three).
5. Each allocator, bounded by a capacity and running its own out-of-memory
   path, finds by bisection the smallest budget under which it serves the whole
   trace, to within 0.5%: the three are compared at equal budgets, not by
   their uncapped peaks (PyTorch under a cap frees its cache and retries).
6. Where the snapshot records device calls, the model is checked against them
   (``validate``): matched / recorded calls.
7. Each out-of-memory error the snapshot recorded is replayed as the request it
   was (oom): fragmentation or not, and which allocator would have
   served it.

Each device of a snapshot is its own trace and its own result
(``replay_devices``; ``replay`` takes one). A device with no event (a snapshot
taken with ``include_traces=False``, or its trace emptied) holds no history:
only its final blocks, which say nothing of the run, so it is not replayed
(NoHistoryError where nothing else is, a note beside the devices that are) and
no verdict is given on it. Pinned host memory (``host_segments``,
``host_traces``) is left aside with a note: the replay is of device memory.

Beside these stands the trace's own: the peak of live (requested) bytes, the
least any allocator must hold (counting blocks until their free completes: where
a free waits on another stream, an allocator that runs out of memory frees it
sooner, so a budget may be below it), and, when the snapshot has segments, the
reserved bytes of the allocator that recorded it, followed event by event from
the final segments back.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .. import _C
from .._config import as_size, conf_string, parse_config
from .allocators import (ALLOCATORS, KIND_ALLOC as _KIND_ALLOC, KIND_FREE as _KIND_FREE,
                         KIND_FREE_REQUESTED as _KIND_FREE_REQUESTED, measure_live as _measure_live,
                         min_budget as _min_budget, run_allocator)
from .oom import diagnose_ooms
from .report import (BUDGET_LEGEND, TABLE_LEGEND, format_names, format_ooms, format_recorded, format_table,
                     plot_results, verdicts, wrap)
from .result import ReplayResult
from .settings import TorchSettings
from .validate import validate
from .snapshot_io import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    Trace,
    TraceError,
    check_snapshot,
    device_traces,
    devices_of,
    load_snapshot,
    read_trace,
)

#: How to record what a snapshot without history lacks, as PyTorch's docs say it.
HOW_TO_RECORD = ("To record one, call torch.cuda.memory._record_memory_history(max_entries=100000) "
                 "before the run and torch.cuda.memory._dump_snapshot(path) after it, or run it under "
                 "`pyalloc record -o OUT.pickle -- python script.py`.")


class NoHistoryError(TraceError):
    """The snapshot (or the device asked for) recorded no event: there is nothing to replay."""

_KIND_NONE = 0  # a free_requested whose completion follows at once: no op of its own

#: The stream of the segment pyalloc's history maps over a run while it turns into
#: its pieces or back (csrc/core/allocator.h, kShadowStream).
_COVER_STREAM = (1 << 64) - 1

#: Traces with at least this many events get a progress bar on a terminal.
PROGRESS_MIN_EVENTS = 200_000


# ---------------------------------------------------------------------------
# From events to allocator calls


@dataclass
class ReplayPlan:
    """A trace as allocator calls: op i is ``kinds[i]`` (1 alloc, 2 free, 3 free
    requested: the block waits on other streams until its free, which an
    out-of-memory path may make early) of allocation ``ids[i]``, of ``sizes[i]``
    requested bytes, on ``streams[i]``, standing for trace event ``events[i]``
    (-1: a block live before the trace)."""

    kinds: array
    ids: array
    sizes: array
    streams: array
    events: array
    allocs: int = 0                 # alloc events in the trace
    preexisting_blocks: int = 0     # allocated first, live before the trace
    preexisting_bytes: int = 0
    missed_frees: int = 0           # allocs at an address still live (its free is missing)
    stray_frees: int = 0            # frees of an address already freed
    frees_at_request: int = 0       # freed at free_requested: no completion followed
    pending_at_end: int = 0         # free requested, not completed when the trace ends
    stream_count: int = 0
    peak_live_bytes: int = 0
    peak_live_op: int = -1
    #: The peak with each block freed at its free request: the least an allocator
    #: that waits for the streams when it runs out of memory needs (the budget
    #: search starts from it). peak_live_bytes when no free waits on a stream.
    peak_live_without_pending_bytes: int = 0
    native_start_bytes: Optional[int] = None
    native_peak_reserved_bytes: Optional[int] = None
    native_points: List[Tuple[int, int]] = field(default_factory=list)  # (event, reserved after it)
    native_ooms: int = 0
    #: The addresses of the blocks live before the trace, in op order (they are ops 0, 1, ...).
    preexisting_addrs: array = field(default_factory=lambda: array("Q"))
    #: The recorded settings of PyTorch's allocator, which its models run with (run_allocator).
    torch_settings: TorchSettings = field(default_factory=TorchSettings)

    def __len__(self) -> int:
        return len(self.kinds)


def plan_trace(trace: Trace) -> ReplayPlan:
    """Resolves a trace's addresses into allocations (see the module docstring)."""
    actions, addrs, sizes, streams = trace.actions, trace.addrs, trace.sizes, trace.streams
    uses_completions = FREE_COMPLETED in actions
    plan = ReplayPlan(array("B"), array("I"), array("Q"), array("Q"), array("q"),
                      torch_settings=trace.torch_settings)
    kinds: List[int] = []
    ids: List[int] = []
    events: List[int] = []
    size_of: List[int] = []   # by id: requested bytes
    stream_of: List[int] = []
    # addr -> [id, op of its free_requested or -1], or None once freed
    state: Dict[int, Optional[List[int]]] = {}
    early: List[Tuple[int, int]] = []  # (addr, id) of blocks live before the trace

    def new_id(size: int, stream: int) -> int:
        size_of.append(size)
        stream_of.append(stream)
        return len(size_of) - 1

    def emit(kind: int, id_: int, event: int) -> int:
        kinds.append(kind)
        ids.append(id_)
        events.append(event)
        return len(kinds) - 1

    for i in range(len(actions)):
        code = actions[i]
        if code == ALLOC:
            addr = addrs[i]
            cur = state.get(addr)
            if cur is not None:
                if cur[1] >= 0:  # freed at its request: the completion never came
                    kinds[cur[1]] = _KIND_FREE
                    plan.frees_at_request += 1
                else:
                    emit(_KIND_FREE, cur[0], i)
                    plan.missed_frees += 1
            id_ = new_id(sizes[i], streams[i])
            emit(_KIND_ALLOC, id_, i)
            state[addr] = [id_, -1]
            plan.allocs += 1
        elif code == FREE_REQUESTED or code == FREE_COMPLETED:
            addr = addrs[i]
            if addr in state:
                cur = state[addr]
                if cur is None:
                    plan.stray_frees += 1
                    continue
            else:
                cur = [new_id(sizes[i], streams[i]), -1]
                early.append((addr, cur[0]))
                state[addr] = cur
            if code == FREE_REQUESTED:
                if cur[1] >= 0:
                    plan.stray_frees += 1
                elif uses_completions:
                    cur[1] = emit(_KIND_FREE_REQUESTED, cur[0], i)
                else:
                    emit(_KIND_FREE, cur[0], i)
                    state[addr] = None
            else:
                if 0 <= cur[1] == len(kinds) - 1:
                    kinds[cur[1]] = _KIND_NONE  # completed before any other call: a plain free
                emit(_KIND_FREE, cur[0], i)
                state[addr] = None
        elif code == OOM:
            plan.native_ooms += 1
    plan.pending_at_end = sum(1 for cur in state.values() if cur is not None and cur[1] >= 0)

    # The final segments' live blocks that no event explains were live throughout.
    for addr, requested, stream in trace.live_blocks:
        if addr not in state:
            early.append((addr, new_id(requested, stream)))
    early.sort()
    plan.preexisting_addrs = array("Q", [addr for addr, _ in early])
    plan.preexisting_blocks = len(early)
    plan.preexisting_bytes = sum(size_of[id_] for _, id_ in early)

    # Blocks live before the trace come first, in address order, then the trace's calls.
    for kind, id_, event in [(_KIND_ALLOC, id_, -1) for _, id_ in early] + list(zip(kinds, ids, events)):
        if kind == _KIND_NONE:
            continue
        plan.kinds.append(kind)
        plan.ids.append(id_)
        plan.sizes.append(size_of[id_])
        plan.streams.append(stream_of[id_])
        plan.events.append(event)
    plan.stream_count = len(set(stream_of))
    _measure_live(plan)
    _follow_native(plan, trace)
    return plan


def _follow_native(plan: ReplayPlan, trace: Trace) -> None:
    """The recording allocator's reserved bytes, from the final segments back to the
    start of the trace, then forward event by event."""
    grow, shrink = (SEGMENT_ALLOC, SEGMENT_MAP), (SEGMENT_FREE, SEGMENT_UNMAP)
    changes = [
        (i, size if code in grow else -size)
        for i, (code, size) in enumerate(zip(trace.actions, trace.sizes))
        if code in grow or code in shrink
    ]
    if trace.segments == 0 and not changes:
        return  # nothing says what the recording allocator held
    start = trace.segments_bytes - sum(delta for _, delta in changes)
    if start < 0:
        return  # segments and events disagree: no trustworthy figure
    # A segment split as its pieces allocated, then the whole freed (how
    # pyalloc's own snapshots tell it, so that PyTorch's viewer can undo it)
    # is one change: the pieces alone are no peak.
    pieces = set()
    for i, code in enumerate(trace.actions):
        if code != SEGMENT_FREE:
            continue
        lo, hi = trace.addrs[i], trace.addrs[i] + trace.sizes[i]
        k = i - 1
        while (k >= 0 and trace.actions[k] == SEGMENT_ALLOC and lo <= trace.addrs[k]
               and trace.addrs[k] + trace.sizes[k] <= hi):
            pieces.add(k)
            k -= 1
    # A segment turned into its pieces, or they back into it, under a segment
    # mapped over them for that moment and unmapped at the end, the events
    # between all segment events (how pyalloc's own snapshots tell it, so that
    # trace_plot -s pairs every segment_free with its segment_alloc and the
    # viewer has a segment over every live block meanwhile) is one change too.
    # Only pyalloc's cover segments, on their own stream (2**64 - 1), bracket so:
    # PyTorch's expandable segments may map a range and unmap the same one on an
    # out-of-memory retry, and that map is a real high point.
    segment_codes = grow + shrink
    i, n = 0, len(trace.actions)
    while i < n:
        if trace.actions[i] == SEGMENT_MAP and trace.streams[i] == _COVER_STREAM:
            j = i + 1
            while j < n and trace.actions[j] in segment_codes and not (
                    trace.actions[j] == SEGMENT_UNMAP and trace.addrs[j] == trace.addrs[i]
                    and trace.sizes[j] == trace.sizes[i] and trace.streams[j] == _COVER_STREAM):
                j += 1
            if j < n and trace.actions[j] == SEGMENT_UNMAP:
                pieces.update(range(i, j))
                i = j
        i += 1
    reserved = peak = start
    for i, delta in changes:
        reserved += delta
        if i in pieces:
            continue
        peak = max(peak, reserved)
        plan.native_points.append((i, reserved))
    plan.native_start_bytes = start
    plan.native_peak_reserved_bytes = peak


# ---------------------------------------------------------------------------
# Running the plan


def replay(
    source: Union[str, "os.PathLike[str]", Dict[str, Any], Trace],
    config: Optional[str] = None,
    budget: Union[int, str, None] = None,
    *,
    device: Optional[int] = None,
    search: bool = True,
    timeline_points: int = 2000,
    name: Optional[str] = None,
    progress: Optional[bool] = None,
) -> ReplayResult:
    """Replays a memory snapshot through pyalloc on the virtual backend.

    Args:
        source: a snapshot file (``.pickle`` / ``.pickle.gz``), a loaded snapshot
            dict, or a ``snapshot_io.Trace``.
        config: pyalloc configuration, ``"key:value,..."``.
        budget: bytes (or ``"80GiB"``) the simulated device holds for an extra
            replay that counts the allocations refused under it.
        device: which of the snapshot's devices (default: the one with most events).
        search: find the smallest budget that replays without an OOM.
        timeline_points: samples of live and reserved bytes to keep for plots.
        name: what to call the trace in results (default: the file name).
        progress: show progress bars (default: on a terminal, for long traces).

    Raises TraceError for a malformed trace, ValueError for a bad config or budget.
    """
    return _replay_source(source, config, budget, [device], search, timeline_points, name, progress)[0]


def replay_devices(
    source: Union[str, "os.PathLike[str]", Dict[str, Any], Trace],
    config: Optional[str] = None,
    budget: Union[int, str, None] = None,
    *,
    device: Optional[int] = None,
    search: bool = True,
    timeline_points: int = 2000,
    name: Optional[str] = None,
    progress: Optional[bool] = None,
) -> List[ReplayResult]:
    """Replays every device of a snapshot that recorded anything (events or
    segments), a result each in device order; ``device`` picks one. The other
    arguments, and the errors, are those of ``replay``."""
    return _replay_source(source, config, budget, None if device is None else [device], search,
                          timeline_points, name, progress)


def _replay_source(source: Any, config: Optional[str], budget: Union[int, str, None],
                   devices: Optional[List[Optional[int]]], search: bool, timeline_points: int,
                   name: Optional[str], progress: Optional[bool]) -> List[ReplayResult]:
    """`devices`: those to replay (None in it: the one with most events); None: every one."""
    conf = conf_string(config)
    budget_bytes = None if budget is None else as_size(budget, "budget")
    if budget_bytes == 0:
        raise ValueError("budget must be at least 1 byte (a device of 0 bytes holds nothing)")
    bars = _Bars(progress, name or (os.fspath(source) if isinstance(source, (str, os.PathLike)) else "trace"))
    try:
        if isinstance(source, Trace):
            bars.close()
            if not source.has_history:
                raise NoHistoryError(_no_history(source))
            return [_replay_trace(source, _conf_for(source, config, conf), budget_bytes, search,
                                  timeline_points, bars)]
        if isinstance(source, dict):
            snapshot, label = source, name
            check_snapshot(snapshot, name or "<snapshot>")
        else:
            label = os.fspath(source)
            snapshot = load_snapshot(label, progress=bars.bytes(_file_size(label)))
            label = name or label
        results, notes = [], []
        for device in devices_of(snapshot) if devices is None else devices:
            events = bars.events(_event_count(snapshot, device))
            trace = read_trace(snapshot, device, name=label, progress=events)
            bars.close()
            if not trace.has_history:
                notes.append(_no_history(trace))
                continue
            results.append(_replay_trace(trace, _conf_for(trace, config, conf), budget_bytes, search,
                                         timeline_points, bars))
        if not results:
            raise NoHistoryError(" ".join(notes))
        for r in results:
            r.devices = len(results)
            r.notes = notes + r.notes
        return results
    finally:
        bars.close()


#: The settings of pyalloc's policy a snapshot pyalloc recorded carries
#: (allocator_settings, pyalloc.snapshot()): not its pool's size or cap, which the
#: replay's device stands for.
_POLICY_KEYS = ("strategy", "segment_size", "small_size", "small_chunk_size", "max_split_size")


def _conf_for(trace: Trace, config: Optional[str], conf: str) -> str:
    """pyalloc's configuration for `trace`: the one given; else, where pyalloc
    recorded the trace, the policy it ran with where that is not its default (so
    that "pyalloc would have served it" speaks of the pyalloc that ran); else the
    default."""
    if config is not None:
        return conf
    settings = trace.metadata.get("allocator_settings")
    if not isinstance(settings, dict) or settings.get("backend") != "pyalloc":
        return conf
    default = parse_config("")
    recorded = {k: settings[k] for k in _POLICY_KEYS if k in settings and settings[k] != default[k]}
    try:
        return conf_string(None, recorded)
    except (TypeError, ValueError):  # a snapshot from another pyalloc: its default policy
        return conf


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # load_snapshot says what is wrong with it


def _no_history(trace: Trace) -> str:
    """The sentence for a device with no event, and how to record one."""
    why = ("its snapshot was taken with include_traces=False" if not trace.traces_recorded
           else "its trace is empty")
    return (f"{trace.name}: device {trace.device} holds no history ({why}): only the "
            f"{len(trace.live_blocks)} blocks live in its final segments, which say nothing of how "
            f"the run got there, so there is nothing to replay and no verdict to give. {HOW_TO_RECORD}")


def _host_note(trace: Trace) -> List[str]:
    if not (trace.host_segments or trace.host_events):
        return []
    return [f"{trace.name}: its pinned host memory ({trace.host_segments} host segment(s), "
            f"{trace.host_events} host events) is left aside: the replay is of device memory."]


def _event_count(snapshot: Dict[str, Any], device: Optional[int]) -> int:
    traces = device_traces(snapshot)
    if device is None:
        return max((len(t) for t in traces), default=0)
    return len(traces[device]) if 0 <= device < len(traces) else 0


def _replay_trace(trace: Trace, conf: str, budget: Optional[int], search: bool,
                  timeline_points: int, bars: "_Bars") -> ReplayResult:
    plan = plan_trace(trace)
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)

    # The main replay, unbounded, paused at peak live to look at the pool.
    allocator = _C.Allocator("virtual", conf, 0)
    main = _C.Replayer(allocator, calls, False, timeline_points)
    frag: Dict[str, Any] = {}
    if plan.peak_live_op >= 0:
        main.run(plan.peak_live_op + 1)
        frag = _fragmentation(allocator, plan, main)
    main.run()
    if main.ooms:
        raise TraceError(_refused_uncapped(trace, plan, main, conf))
    stats = allocator.stats()
    peak_reserved = stats["reserved_bytes.all.peak"]
    half_allocs, half_frees = main.device_calls_at_half
    second_half_calls = (None if half_allocs < 0 else
                         stats["num_device_alloc"] - half_allocs + stats["num_device_free"] - half_frees)

    min_budget, replays = None, 0
    if search and main.ooms == 0:
        min_budget, replays = _min_budget(calls, conf, plan.peak_live_without_pending_bytes, peak_reserved, bars)
    pyalloc_retries = None
    if min_budget:
        pyalloc_retries = run_allocator(calls, "pyalloc", capacity=min_budget, conf=conf).retries

    result = ReplayResult(
        trace=trace.name,
        device=trace.device,
        events=len(trace),
        allocs=plan.allocs,
        frees=main.frees + main.skipped_frees,
        streams=plan.stream_count,
        peak_live_bytes=plan.peak_live_bytes,
        pyalloc_peak_reserved_bytes=peak_reserved,
        pyalloc_ratio=_ratio(peak_reserved, plan.peak_live_bytes),
        pyalloc_min_budget_bytes=min_budget,
        recorded_peak_reserved_bytes=plan.native_peak_reserved_bytes,
        recorded_ratio=_ratio(plan.native_peak_reserved_bytes, plan.peak_live_bytes),
        fragmentation_at_peak=frag,
        preexisting_blocks=plan.preexisting_blocks,
        preexisting_bytes=plan.preexisting_bytes,
        missed_frees=plan.missed_frees,
        stray_frees=plan.stray_frees,
        frees_at_request=plan.frees_at_request,
        native_ooms=plan.native_ooms,
        config=conf,
        device_allocs=stats["num_device_alloc"],
        device_frees=stats["num_device_free"],
        pyalloc_second_half_device_calls=second_half_calls,
        pyalloc_driver_calls=stats.get("num_driver_calls"),
        pyalloc_budget_retries=pyalloc_retries,
        replay_seconds=main.seconds,
        events_per_second=len(trace) / main.seconds if main.seconds > 0 else None,
        calls_per_second=len(plan) / main.seconds if main.seconds > 0 else None,
        search_replays=replays,
        ignored_actions=dict(trace.ignored_actions),
        recorded_ooms=diagnose_ooms(trace, plan, conf),
        skipped_ooms=trace.skipped_ooms,
        skipped_oom_problems=list(trace.oom_problems),
        timeline=_timeline(main, plan),
        native_timeline=_native_timeline(plan, len(trace)),
        notes=_host_note(trace) + trace.torch_settings.notes,
    )
    result.search_replays += _replay_models(result, calls, plan, search, bars)
    checked = validate(trace, plan, calls)
    result.validation = None if checked is None else checked.to_dict()
    if budget is not None:
        # The three allocators on a device of `budget` bytes: what each reserves, refuses,
        # and calls the driver for there (pyalloc sizes its handles by the room left).
        result.budget_bytes = budget
        for name in ALLOCATORS:
            result.budget_runs[name] = asdict(
                run_allocator(calls, name, capacity=budget, conf=conf if name == "pyalloc" else "", plan=plan))
        result.budget_ooms = result.budget_runs["pyalloc"]["ooms"]
        result.budget_peak_reserved_bytes = result.budget_runs["pyalloc"]["peak_reserved_bytes"]
    return result


def _refused_uncapped(trace: Trace, plan: ReplayPlan, run: Any, conf: str) -> str:
    """Why a trace has no figures: pyalloc refused requests on a device of unbounded
    size (a request past the virtual range a pool can map, or a cap the
    configuration sets). Its peak reserved would count only what it served, and
    read as a win."""
    op = run.first_oom_op
    event = plan.events[op]
    where = "a block live before the trace" if event < 0 else f"event {event}"
    return (f"{trace.name}: device {trace.device}: pyalloc refused {run.ooms} allocation(s) even on a "
            f"device of unbounded size, the first {where} of {plan.sizes[op]} bytes "
            f"(configuration '{conf or 'default'}': a request past the virtual range a pool can map, "
            "or a cap such as max_pool_size), so the replay has no true figure to report")


def _fragmentation(allocator: Any, plan: ReplayPlan, run: Any) -> Dict[str, Any]:
    f = allocator.fragmentation()
    reserved = f["reserved_bytes"]
    return {
        "event": max(plan.events[plan.peak_live_op], 0),
        "live_bytes": run.live_bytes,
        "reserved_bytes": reserved,
        "allocated_bytes": f["allocated_bytes"],
        "free_bytes": f["free_bytes"],
        "largest_free_block": f["largest_free_block"],
        "free_blocks": f["free_blocks"],
        "large_pool_free_bytes": f["large_pool_free_bytes"],
        "small_pool_free_bytes": f["small_pool_free_bytes"],
        "external_fragmentation": f["external_fragmentation"],
        "unused_fraction": 1.0 - run.live_bytes / reserved if reserved else 0.0,
    }


def _replay_models(result: ReplayResult, calls: Any, plan: ReplayPlan, search: bool, bars: "_Bars") -> int:
    """The models of PyTorch's allocator on the same calls: uncapped, then at the
    smallest budget each completes on. Fills their fields; returns the replays run."""
    replays = 0
    for name in ALLOCATORS[1:]:
        run = run_allocator(calls, name, plan=plan)
        setattr(result, f"{name}_peak_reserved_bytes", run.peak_reserved_bytes)
        setattr(result, f"{name}_second_half_device_calls", run.second_half_device_calls)
        setattr(result, f"{name}_driver_calls", run.driver_calls)
        if not search or not run.completed:
            continue
        budget, n = _min_budget(calls, "", plan.peak_live_without_pending_bytes, run.peak_reserved_bytes,
                                bars, name, settings=plan.torch_settings)
        replays += n
        setattr(result, f"{name}_min_budget_bytes", budget)
        if budget:
            setattr(result, f"{name}_budget_retries",
                    run_allocator(calls, name, capacity=budget, plan=plan).retries)
    return replays


def _ratio(num: Optional[int], den: int) -> Optional[float]:
    return None if num is None or den == 0 else num / den


def _timeline(run: Any, plan: ReplayPlan) -> Dict[str, List[int]]:
    points = run.timeline()
    return {
        "event": [max(plan.events[op], 0) for op, _, _, _ in points],
        "live_bytes": [live for _, live, _, _ in points],
        "reserved_bytes": [reserved for _, _, reserved, _ in points],
    }


def _native_timeline(plan: ReplayPlan, events: int) -> Dict[str, List[int]]:
    if plan.native_start_bytes is None:
        return {}
    points = [(0, plan.native_start_bytes)] + plan.native_points
    points.append((max(events - 1, 0), points[-1][1]))
    return {"event": [e for e, _ in points], "reserved_bytes": [r for _, r in points]}


class _Bars:
    """tqdm progress bars on stderr: by default only on a terminal and only for
    long traces (short ones replay faster than a bar can draw)."""

    def __init__(self, enabled: Optional[bool], label: str) -> None:
        self._enabled = enabled
        self._label = os.path.basename(label)
        self._long = False
        self._bar: Any = None

    def _want(self, long: bool) -> bool:
        if self._enabled is not None:
            return self._enabled
        return long and sys.stderr.isatty()

    def _open(self, **kwargs: Any) -> Any:
        self.close()
        from tqdm import tqdm

        self._bar = tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)
        return self._bar

    def bytes(self, total: int) -> Optional[Callable[[int], Any]]:
        # A snapshot with stack frames takes a few hundred bytes per event.
        if not self._want(total >= PROGRESS_MIN_EVENTS * 100):
            return None
        return self._open(total=total, unit="B", unit_scale=True, desc=f"load {self._label}").update

    def events(self, count: int) -> Optional[Callable[[int], Any]]:
        self._long = count >= PROGRESS_MIN_EVENTS
        if not self._want(self._long):
            return None
        return self._open(total=count, unit="ev", unit_scale=True, desc=f"read {self._label}").update

    def search(self) -> Any:
        if not self._want(self._long):
            return None
        return self._open(desc=f"budget search {self._label}", unit="replay")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "It prints a table of the three allocators (within 100 columns; the full figures: --json), "
        "then a line per snapshot that recorded its own run's segments or device calls, a sentence "
        "per out-of-memory error the snapshot recorded, and sentences saying where pyalloc wins, "
        f"ties and loses. The table's columns: {TABLE_LEGEND} {BUDGET_LEGEND}")
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="memory snapshots (.pickle or .pickle.gz) as torch.cuda.memory._dump_snapshot "
                             "or pyalloc record writes them")
    parser.add_argument("--config", default=None, metavar="CONF",
                        help="pyalloc configuration, 'key:value,...' (e.g. 'segment_size:64MiB')")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="also replay the three allocators on a device of SIZE (e.g. 80GiB): reserved, OOMs, driver calls")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="plot reserved and live bytes over each trace (matplotlib)")
    parser.add_argument("--device", type=int, default=None,
                        help="replay only this device's trace (default: every device that recorded "
                             "anything, a row each)")
    parser.add_argument("--no-search", action="store_true",
                        help="skip the search for the smallest budget")


def main(args: argparse.Namespace) -> int:

    try:
        conf_string(args.config)
        budget = None if args.budget is None else as_size(args.budget, "--budget")
        if budget == 0:
            raise ValueError("--budget must be at least 1 byte")
    except (TypeError, ValueError) as e:
        print(f"pyalloc replay: error: {e}", file=sys.stderr)
        return 2
    results: List[ReplayResult] = []
    failed = 0
    for path in args.files:
        try:
            rows = replay_devices(path, args.config, budget, device=args.device, search=not args.no_search)
        except NoHistoryError as e:
            print(f"pyalloc replay: {e}", file=sys.stderr)
            failed += 1
            continue
        except TraceError as e:
            print(f"pyalloc replay: error: {e}", file=sys.stderr)
            failed += 1
            continue
        results.extend(rows)
        for note in rows[0].notes if rows else ():
            print(f"pyalloc replay: note: {note}", file=sys.stderr)
        for r in rows:
            if r.skipped_ooms:
                # Each problem names the file, the device and the event.
                print(f"pyalloc replay: warning: {r.skipped_ooms} oom event(s) could not be read "
                      "and are not diagnosed: " + "; ".join(r.skipped_oom_problems), file=sys.stderr)
    if results:
        # Within 100 columns, as the main job: the table, its names and legend, then sentences.
        print(format_table(results))
        names = format_names(results)
        if names:
            print("\n" + names)
        print("\n" + wrap(TABLE_LEGEND + (" " + BUDGET_LEGEND if budget is not None else "")))
        for text in (format_recorded(results), format_ooms(results)):
            if text:
                print("\n" + text)
        print()
        for sentence in verdicts(results):
            print(wrap(sentence))
    try:
        if args.json is not None:
            with open(args.json, "w") as f:
                json.dump([r.to_dict() for r in results], f, indent=1)
                f.write("\n")
        if args.plot is not None and results:
            plot_results(results, args.plot)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        print('pyalloc replay: error: --plot needs matplotlib: pip install "pyalloc[plot]"',
              file=sys.stderr)
        return 1
    except OSError as e:
        print(f"pyalloc replay: error: {e}", file=sys.stderr)
        return 1
    return 1 if failed else 0
