"""The allocators a replay sets side by side, behind one call.

``run_allocator(calls, name, capacity=...)`` replays a trace's allocator calls
(a ``_C.ReplayTrace``) through one of:

- ``pyalloc``: pyalloc's core on the virtual backend (addresses only);
- ``native``: the model of PyTorch's caching allocator (csrc/replay/torch_model.h),
  with the settings the snapshot recorded (``settings.TorchSettings``;
  PyTorch's defaults where none);
- ``native_expandable``: the same model with ``expandable_segments:True``.

Each runs its own out-of-memory path under a capacity: pyalloc its own,
PyTorch's models release every cached segment (or whole page) of every pool and
stream and try once more. Before either gives up, the blocks whose free waits on
other streams (a "free requested" call, kind 3: ``record_stream``) are freed, as
both allocators do once they have waited for those streams. The figures come
back in one record, so that the replay compares the three at equal budgets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .. import _C
from .._config import as_size
from .result import BUDGET_PRECISION
from .settings import TorchSettings

__all__ = ["ALLOCATORS", "AllocatorRun", "BUDGET_CHECKS_ABOVE", "fits", "measure_live", "min_budget", "run_allocator"]

ALLOCATORS = ("pyalloc", "native", "native_expandable")

#: A ReplayTrace's op kinds (csrc/replay/replay.h): an alloc, a free, and a free
#: requested whose block waits on other streams until its free op (or until an
#: out-of-memory path frees it early).
KIND_ALLOC, KIND_FREE, KIND_FREE_REQUESTED = 1, 2, 3

#: An allocator can complete a trace on a device and fail on a slightly larger
#: one (its choices depend on the room it has: pyalloc's handle sizes, PyTorch's
#: out-of-memory retries). The smallest budget is checked on devices this much
#: larger too, and searched again above any of them that fails: the budget
#: reported is one from which every device checked completes.
BUDGET_CHECKS_ABOVE = (0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05)


@dataclass
class AllocatorRun:
    completed: bool                 # every allocation of the trace was served
    ooms: int                       # allocations refused (0 when completed)
    first_oom_op: int               # index into the ReplayTrace's ops of the first refusal, -1 if none
    peak_reserved_bytes: int
    device_calls: int               # segment/page-range reservations + releases (num_device_alloc + num_device_free)
    second_half_device_calls: Optional[int]  # the same, from op len/2 on
    # Every cudaMalloc / cudaFree / cuMemAddressReserve / cuMemCreate / cuMemMap /
    # cuMemSetAccess / cuMemUnmap / cuMemRelease the allocator's CUDA path makes, as it
    # makes them: cuMemCreate, cuMemMap, cuMemUnmap and cuMemRelease per page (pyalloc:
    # per handle), cuMemSetAccess once per range mapped (PyTorch's mapAndSetAccess;
    # pyalloc: per range of handles mapped at once), cuMemAddressReserve once per
    # virtual range (PyTorch: per (stream, pool) expandable segment; pyalloc: per
    # pool). None if unknown.
    driver_calls: Optional[int]
    retries: int                    # out-of-memory retries (release cached memory and try again) taken


def run_allocator(calls: Any, allocator: str, *, capacity: Optional[int] = None,
                  stop_on_oom: bool = False, conf: str = "", plan: Any = None,
                  page_size: Optional[int] = None, settings: Optional[TorchSettings] = None) -> AllocatorRun:
    """Replays `calls` (a _C.ReplayTrace) through `allocator` on a device of
    `capacity` bytes (None: unbounded). `conf` is pyalloc's configuration (pyalloc only).
    `plan` is the ReplayPlan the calls came from (the PyTorch models may use its
    pre-trace blocks / segments). `page_size` (pyalloc only; None or 0: CUDA's 2 MiB)
    replays on a device whose virtual-memory pages have that size, a what-if: the pages
    the vmm strategy maps. `settings`: PyTorch's allocator settings for its models, as
    the snapshot recorded them (None: the plan's ``torch_settings``, or PyTorch's
    defaults without a plan).
    Raises ValueError for an unknown allocator name, or a page_size for another allocator
    or under strategy:bestfit (which maps no pages)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; valid allocators: {', '.join(ALLOCATORS)}")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be at least 1 byte, got {capacity}")
    if page_size is not None:
        page_size = as_size(page_size, "page_size")
    if allocator == "pyalloc":
        return _run_pyalloc(calls, capacity, stop_on_oom, conf, page_size or 0)
    if page_size:
        raise ValueError(f"page_size applies to pyalloc only, not to {allocator!r} (a model of PyTorch's "
                         "allocator, whose pages are CUDA's)")
    # Every allocator starts from an empty device, the blocks live before the
    # trace allocated first: the same start for all three. (Validation against a
    # snapshot's own calls starts the model from the recorded segments instead:
    # validate.py.)
    settings = settings or getattr(plan, "torch_settings", None) or TorchSettings()
    r = _C.run_torch_model(calls, expandable=allocator == "native_expandable",
                           capacity=capacity or 0, stop_on_oom=stop_on_oom, **settings.model_options())
    return AllocatorRun(
        completed=r["completed"],
        ooms=r["ooms"],
        first_oom_op=r["first_oom_op"],
        peak_reserved_bytes=r["peak_reserved_bytes"],
        device_calls=r["device_calls"],
        second_half_device_calls=r["second_half_device_calls"],
        driver_calls=r["driver_calls"],
        retries=r["retries"],
    )


def _run_pyalloc(calls: Any, capacity: Optional[int], stop_on_oom: bool, conf: str,
                 page_size: int = 0) -> AllocatorRun:
    try:
        allocator = _C.Allocator("virtual", conf, capacity or 0, page_size=page_size)
    except _C.OutOfMemoryError:  # pool_size alone does not fit: every request fails
        # A valid trace opens with an alloc (a free needs a live allocation), so op 0 is the first refused.
        refused = min(calls.allocs, 1) if stop_on_oom else calls.allocs
        return AllocatorRun(completed=calls.allocs == 0, ooms=refused, first_oom_op=0 if refused else -1,
                            peak_reserved_bytes=0, device_calls=0, second_half_device_calls=None,
                            driver_calls=None, retries=0)
    run = _C.Replayer(allocator, calls, stop_on_oom, 0)
    run.run()
    stats = allocator.stats()
    half_allocs, half_frees = run.device_calls_at_half
    device_calls = stats["num_device_alloc"] + stats["num_device_free"]
    second_half = None if half_allocs < 0 else device_calls - half_allocs - half_frees
    return AllocatorRun(
        completed=run.ooms == 0,
        ooms=run.ooms,
        first_oom_op=run.first_oom_op,
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        device_calls=device_calls,
        second_half_device_calls=second_half,
        # Counted by pyalloc's CUDA backend where it models its driver calls; unknown otherwise.
        driver_calls=stats.get("num_driver_calls"),
        retries=stats["num_alloc_retries"],
    )


def measure_live(plan: Any) -> None:
    """Sets a ReplayPlan's peak of requested bytes live (and the op it is reached
    at), and that peak with the blocks whose free waits on other streams counted
    as freed at their request (peak_live_without_pending_bytes: the least a budget
    search starts from, as out-of-memory paths free those blocks early)."""
    live = peak = 0
    peak_op = -1
    waiting = least = 0  # bytes whose free was requested, not yet made; the peak without them
    requested = set()
    for op, (kind, id_, size) in enumerate(zip(plan.kinds, plan.ids, plan.sizes)):
        if kind == KIND_ALLOC:
            live += size
            if live > peak:
                peak, peak_op = live, op
            least = max(least, live - waiting)
        elif kind == KIND_FREE_REQUESTED:
            waiting += size
            requested.add(id_)
        else:
            live -= size
            if id_ in requested:
                requested.discard(id_)
                waiting -= size
    plan.peak_live_bytes, plan.peak_live_op = peak, peak_op
    plan.peak_live_without_pending_bytes = least


def fits(calls: Any, conf: str, capacity: int, allocator: str = "pyalloc",
         page_size: Optional[int] = None, settings: Optional[TorchSettings] = None) -> bool:
    """Whether the whole trace replays within `capacity` bytes without an OOM
    (`settings`: PyTorch's, for its models)."""
    return run_allocator(calls, allocator, capacity=capacity, stop_on_oom=True, conf=conf,
                         page_size=page_size, settings=settings).completed


def min_budget(calls: Any, conf: str, peak_live: int, peak_reserved: int,
               bars: Any = None, allocator: str = "pyalloc", page_size: Optional[int] = None,
               settings: Optional[TorchSettings] = None) -> Tuple[int, int]:
    """Bisection on the device's capacity, between peak live (too little: the
    live bytes alone need that much; ReplayPlan.peak_live_without_pending_bytes,
    as frees waiting on streams are made by the out-of-memory path) and the
    unbounded replay's peak reserved
    (enough: the same replay never reserved more), to BUDGET_PRECISION.
    `bars`: the replay's progress bars (their search() bar counts the replays), or None.
    `page_size`: pyalloc's what-if page size, `settings` PyTorch's for its models
    (run_allocator()). Returns (budget, replays)."""
    if peak_live == 0:
        return 0, 0
    lo, hi = peak_live - 1, peak_reserved
    replays = 0
    bar = None if bars is None else bars.search()
    while True:
        while hi - lo > hi * BUDGET_PRECISION:
            mid = max((lo + hi) // 2, 1)  # a device holds at least a byte
            replays += 1
            if fits(calls, conf, mid, allocator, page_size, settings):
                hi = mid
            else:
                lo = mid
            if bar is not None:
                bar.update(1)
        # Larger devices must complete too (BUDGET_CHECKS_ABOVE): else the
        # search goes on above the largest that failed, below the next that
        # completes (or the unbounded replay's peak reserved).
        checked = [int(hi * (1 + above)) for above in BUDGET_CHECKS_ABOVE]
        done = {size: fits(calls, conf, size, allocator, page_size, settings)
                for size in checked if size < peak_reserved}
        replays += len(done)
        failed = [size for size, ok in done.items() if not ok]
        if not failed:
            return hi, replays
        lo = max(failed)
        hi = min([size for size, ok in done.items() if ok and size > lo], default=peak_reserved)
