"""What one trace's replay found: the record pyalloc.replay returns and the
report (report.py) formats. Its own module so that neither imports the other."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

#: The smallest budgets are bisected to within this fraction; two figures closer than
#: that are a tie (report.TIE).
BUDGET_PRECISION = 0.005


@dataclass
class ReplayResult:
    """What one trace's replay found. Byte counts are bytes; ratios are to peak live."""

    trace: str
    device: int
    events: int
    allocs: int
    frees: int
    streams: int
    peak_live_bytes: int
    pyalloc_peak_reserved_bytes: int
    pyalloc_ratio: Optional[float]
    pyalloc_min_budget_bytes: Optional[int]
    #: The recording allocator's peak reserved bytes, from the snapshot's segments
    #: (None where it has none), and its ratio to peak live.
    recorded_peak_reserved_bytes: Optional[int]
    recorded_ratio: Optional[float]
    fragmentation_at_peak: Dict[str, Any]
    preexisting_blocks: int
    preexisting_bytes: int
    missed_frees: int
    stray_frees: int
    frees_at_request: int
    native_ooms: int
    config: str
    #: The replay's device calls, as the stats count them: segments reserved plus page ranges
    #: mapped (num_device_alloc), segments released plus page ranges unmapped (num_device_free);
    #: over the whole trace, and (allocs + frees) over its second half, from the middle
    #: allocator call on, where a workload that repeats should make none.
    device_allocs: int = 0
    device_frees: int = 0
    pyalloc_second_half_device_calls: Optional[int] = None
    #: pyalloc's driver calls as its stats count them (num_driver_calls); None where they do not.
    pyalloc_driver_calls: Optional[int] = None
    #: Out-of-memory retries taken replaying at the allocator's smallest budget.
    pyalloc_budget_retries: Optional[int] = None
    #: The model of PyTorch's allocator (allocators.py), default and with
    #: expandable_segments:True: the same figures. driver_calls: every cudaMalloc,
    #: cudaFree, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease
    #: of the uncapped replay, page by page.
    native_peak_reserved_bytes: Optional[int] = None
    native_min_budget_bytes: Optional[int] = None
    native_second_half_device_calls: Optional[int] = None
    native_driver_calls: Optional[int] = None
    native_budget_retries: Optional[int] = None
    native_expandable_peak_reserved_bytes: Optional[int] = None
    native_expandable_min_budget_bytes: Optional[int] = None
    native_expandable_second_half_device_calls: Optional[int] = None
    native_expandable_driver_calls: Optional[int] = None
    native_expandable_budget_retries: Optional[int] = None
    #: The model against the snapshot's own device calls (validate.py);
    #: None where the snapshot records none.
    validation: Optional[Dict[str, Any]] = None
    budget_bytes: Optional[int] = None
    budget_ooms: Optional[int] = None
    budget_peak_reserved_bytes: Optional[int] = None
    #: Each allocator on a device of budget_bytes: {allocator: its allocators.AllocatorRun
    #: as a dict}; budget_ooms and budget_peak_reserved_bytes are pyalloc's.
    budget_runs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    replay_seconds: float = 0.0
    events_per_second: Optional[float] = None
    calls_per_second: Optional[float] = None
    search_replays: int = 0
    ignored_actions: Dict[str, int] = field(default_factory=dict)
    #: How many devices of its snapshot were replayed, a result each (this one is `device`).
    devices: int = 1
    #: The out-of-memory errors the snapshot recorded on this device, each replayed as the
    #: allocation it was, of the rounded size PyTorch recorded (pyalloc.replay.oom): {event,
    #: size_bytes, live_bytes, capacity_bytes, fragmentation, served_by: {allocator: bool, or
    #: None where unknown}, memory_fraction, device_total_bytes, device_total_assumed,
    #: reserved_bytes, device_free_bytes, cap_inferred, cap_below_bytes, unused_bytes,
    #: largest_free_block_bytes, min_capacity_bytes: {allocator: bytes, or None}}
    #: (oom.diagnose_ooms says what each is). Independent of the budget search.
    recorded_ooms: List[Dict[str, Any]] = field(default_factory=list)
    #: oom events that could not be read (no size, no device_free...), left out of
    #: recorded_ooms; what was wrong with the first few.
    skipped_ooms: int = 0
    skipped_oom_problems: List[str] = field(default_factory=list)
    #: What the replay left aside, a sentence each (host memory, devices without history).
    notes: List[str] = field(default_factory=list)
    timeline: Dict[str, List[int]] = field(default_factory=dict, repr=False)
    native_timeline: Dict[str, List[int]] = field(default_factory=dict, repr=False)

    def to_dict(self, timelines: bool = False) -> Dict[str, Any]:
        """A JSON-ready dict; the timelines only if asked for."""
        d = asdict(self)
        if not timelines:
            d.pop("timeline")
            d.pop("native_timeline")
        return d
