"""The settings of PyTorch's caching allocator a snapshot records, as the replay's
model of that allocator (csrc/replay/torch_model.h) takes them.

torch's ``memory._snapshot()`` (torch/csrc/cuda/Module.cpp) writes the allocator's
configuration at top level as ``allocator_settings``: the configuration string it
was given (``PYTORCH_CUDA_ALLOC_CONF``, whichever variable set it), and the values
in force: ``max_split_size`` in bytes (-1 where unset), ``garbage_collection_threshold``,
``expandable_segments``, ``roundup_power2_divisions`` as a dict from each
power-of-two interval's lower end in MiB ("1" ... "32768", the last open-ended) to its
divisions, and settings of pinned host memory and locking. ``torch_settings`` reads
them once into a ``TorchSettings``, whose ``model_options()`` are the keywords of
``_C.run_torch_model``; every run of the model (its uncapped figures, its budget
search, the OOM verdict, the validation against the recorded device calls) gets them.

Honoured, as c10/cuda/CUDACachingAllocator.cpp uses them: ``max_split_size_mb``
(with ``max_non_split_rounding_mb``, which the snapshot keeps only in the string),
``roundup_power2_divisions`` (the values recorded per interval, so both the single
number and the list form), ``large_segment_size_mb`` (in the string only). The
memory fraction is the OOM verdict's (``snapshot_io.memory_fraction``) and
``expandable_segments`` picks the model. Settings of pinned host memory, of the
lock around cudaMalloc and of graph captures decide nothing the replay models.
Anything else set, and ``garbage_collection_threshold`` (PyTorch collects only
under a memory fraction, by the age of blocks in calls to the allocator, which the
model does not follow), is not applied: each gets a note saying the figures are
for PyTorch's default there (``TorchSettings.notes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["TorchSettings", "torch_settings"]

MiB = 1 << 20
#: roundup_power2_divisions' intervals: [1, 2) MiB ... [32, inf) GiB.
INTERVALS = 16
_UNSET = 1 << 63  # max_split_size at or past this (SIZE_MAX as int64 is -1) is unset
_MAX_DIVISIONS = 1 << 31  # PyTorch reads divisions with stoi

#: Keys of PYTORCH_CUDA_ALLOC_CONF that decide nothing about the device memory the
#: model replays, or that the replay takes elsewhere.
_NO_BEARING = {
    "expandable_segments", "per_process_memory_fraction",
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "graph_capture_record_stream_reuse",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
    "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "pinned_reserve_segment_size_mb",
}
#: Keys this module reads.
_READ = {"max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
         "roundup_power2_divisions", "garbage_collection_threshold", "backend"}


@dataclass
class TorchSettings:
    """PyTorch's allocator settings as the model applies them; None (or no
    divisions) for PyTorch's default. ``not_applied`` names the recorded settings
    the model does not apply, ``notes`` says so for each."""

    max_split_size: Optional[int] = None
    max_non_split_rounding: Optional[int] = None
    large_segment_size: Optional[int] = None
    roundup_power2_divisions: Tuple[int, ...] = ()
    not_applied: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def model_options(self) -> Dict[str, Any]:
        """The keywords of ``_C.run_torch_model`` that carry these settings."""
        return {"max_split_size": self.max_split_size or 0,
                "max_non_split_rounding": self.max_non_split_rounding or 0,
                "large_segment_size": self.large_segment_size or 0,
                "roundup_power2_divisions": list(self.roundup_power2_divisions) or None}

    def _skip(self, key: str, value: Any, default: str) -> None:
        self.not_applied.append(key)
        self.notes.append(f"the snapshot records {key}:{value}, which the model of PyTorch's allocator "
                          f"does not apply: its figures and OOM verdicts are for PyTorch's default there "
                          f"({default})")


def torch_settings(snapshot: Mapping[str, Any]) -> TorchSettings:
    """The settings of PyTorch's allocator that `snapshot` (a snapshot dict, or a
    Trace's ``metadata``) records; PyTorch's defaults where it records none, or was
    recorded by pyalloc (whose ``allocator_settings`` are its own)."""
    s = TorchSettings()
    recorded = snapshot.get("allocator_settings")
    if type(recorded) is not dict or "strategy" in recorded or recorded.get("backend") == "pyalloc":
        return s
    conf = _conf_items(recorded.get("PYTORCH_CUDA_ALLOC_CONF"))
    _max_split(s, recorded, conf)
    _divisions(s, recorded, conf)
    s.max_non_split_rounding = _mib(s, conf, "max_non_split_rounding_mb")
    s.large_segment_size = _mib(s, conf, "large_segment_size_mb")
    gc = recorded.get("garbage_collection_threshold", conf.get("garbage_collection_threshold", 0))
    if gc not in (0, 0.0, "0"):
        s._skip("garbage_collection_threshold", gc, "no garbage collection")
    if conf.get("backend", "native") != "native":
        s._skip("backend", conf["backend"], "the native caching allocator, which is what is modelled")
    for key in conf.keys() - _READ - _NO_BEARING:
        s._skip(key, conf[key], "as if it were not set")
    return s


def _conf_items(text: Any) -> Dict[str, str]:
    """key -> value text of a configuration string "k:v,k2:[a:1,b:2]" (later keys win)."""
    if type(text) is not str:
        return {}
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            items.append(text[start:i])
            start = i + 1
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        if key.strip():
            out[key.strip()] = value.strip()
    return out


def _max_split(s: TorchSettings, recorded: Dict[str, Any], conf: Dict[str, str]) -> None:
    value = recorded.get("max_split_size")
    if value is None:  # not recorded as a value: as the string sets it
        s.max_split_size = _mib(s, conf, "max_split_size_mb")
    elif type(value) is int:
        s.max_split_size = value if 0 < value < _UNSET else None
    else:
        s._skip("max_split_size", value, "unset: every block may be split")


def _divisions(s: TorchSettings, recorded: Dict[str, Any], conf: Dict[str, str]) -> None:
    """roundup_power2_divisions per interval: the recorded values, else the single
    number of the string (its list form is read only as PyTorch recorded it)."""
    value = recorded.get("roundup_power2_divisions")
    per_interval: Optional[List[int]] = None
    if isinstance(value, dict):
        per_interval = _by_interval(value)
    elif value is None and "roundup_power2_divisions" in conf:
        text = conf["roundup_power2_divisions"]
        per_interval = [int(text)] * INTERVALS if text.isdigit() and int(text) < _MAX_DIVISIONS else None
        value = text
    else:
        per_interval = [0] * INTERVALS
    if per_interval is None or any(d & (d - 1) for d in per_interval):
        s._skip("roundup_power2_divisions", value, "sizes rounded up to 512 bytes")
    elif any(d > 1 for d in per_interval):
        s.roundup_power2_divisions = tuple(per_interval)


def _by_interval(recorded: Dict[Any, Any]) -> Optional[List[int]]:
    """The dict Module.cpp writes ("1", "2", ... "32768" MiB -> divisions) as a list
    by interval; None where it is not that."""
    out = [0] * INTERVALS
    for key, divisions in recorded.items():
        lower = int(key) if type(key) is str and key.isdigit() else 0
        index = lower.bit_length() - 1
        if lower != 1 << max(index, 0) or not 0 <= index < INTERVALS or type(divisions) is not int \
                or not 0 <= divisions < _MAX_DIVISIONS:
            return None
        out[index] = divisions
    return out


def _mib(s: TorchSettings, conf: Dict[str, str], key: str) -> Optional[int]:
    """A whole number of MiB of the string, in bytes; None where it sets none (or an
    unreadable one, which gets a note)."""
    text = conf.get(key)
    if text is None:
        return None
    if text.isdigit() and 0 < int(text) * MiB < _UNSET:
        return int(text) * MiB
    s._skip(key, text, "unset")
    return None
