"""The allocators a replay can run a trace through, behind one call.

``run_allocator(calls, name, capacity=...)`` replays a ``_C.ReplayTrace`` through
one of ``ALLOCATORS`` on a device of ``capacity`` bytes and says what it did.
Only pyalloc itself is available here; the models of PyTorch's caching
allocator ("native", "native_expandable") raise NotImplementedError, and
callers that loop over ``ALLOCATORS`` report them as unknown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import _C

__all__ = ["ALLOCATORS", "AllocatorRun", "run_allocator"]

ALLOCATORS = ("pyalloc", "native", "native_expandable")


@dataclass
class AllocatorRun:
    completed: bool                 # every allocation of the trace was served
    ooms: int                       # allocations refused (0 when completed)
    first_oom_op: int               # index into the ReplayTrace's ops of the first refusal, -1 if none
    peak_reserved_bytes: int
    device_calls: int               # segment/page-range reservations + releases (num_device_alloc + num_device_free)
    second_half_device_calls: Optional[int]  # the same, from op len/2 on
    driver_calls: Optional[int]     # every cudaMalloc/cudaFree/cuMemCreate/cuMemMap/cuMemSetAccess/cuMemUnmap/cuMemRelease, page by page; None if unknown
    retries: int                    # out-of-memory retries (release cached memory and try again) taken


def run_allocator(calls, allocator: str, *, capacity: Optional[int] = None,
                  stop_on_oom: bool = False, conf: str = "", plan=None) -> AllocatorRun:
    """Replays `calls` (a _C.ReplayTrace) through `allocator` on a device of
    `capacity` bytes (None: unbounded). `conf` is pyalloc's configuration (pyalloc only).
    `plan` is the ReplayPlan the calls came from (the PyTorch models may use its
    pre-trace blocks / segments). Raises ValueError for an unknown allocator name."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; valid: {', '.join(ALLOCATORS)}")
    if allocator != "pyalloc":
        raise NotImplementedError(f"no model of the {allocator!r} allocator in this build")
    try:
        alloc = _C.Allocator("virtual", conf, capacity or 0)
    except _C.OutOfMemoryError:
        # pool_size alone does not fit: every request fails, from op 0 on (a
        # ReplayTrace's first op is an alloc, since every free names a live one).
        refused = calls.allocs if not stop_on_oom else min(calls.allocs, 1)
        return AllocatorRun(calls.allocs == 0, refused, 0 if calls.allocs else -1,
                            0, 0, None, None, 0)
    run = _C.Replayer(alloc, calls, stop_on_oom, 0)
    run.run()
    stats = alloc.stats()
    calls_made = stats["num_device_alloc"] + stats["num_device_free"]
    half_allocs, half_frees = run.device_calls_at_half
    second_half = None if half_allocs < 0 else calls_made - half_allocs - half_frees
    return AllocatorRun(
        completed=run.first_oom_op < 0,
        ooms=run.ooms,
        first_oom_op=run.first_oom_op,
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        device_calls=calls_made,
        second_half_device_calls=second_half,
        driver_calls=None,
        retries=stats["num_alloc_retries"],
    )
