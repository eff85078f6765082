"""The settings a user already has for PyTorch's allocator, taken over by pyalloc.

People who swap allocators arrive with ``PYTORCH_ALLOC_CONF`` (or the older
``PYTORCH_CUDA_ALLOC_CONF``, read only where the new one is unset, as PyTorch's
c10/core/AllocatorConfig.h says of its device-generic keys) set. Where both are
set and differ, the older one is named as not read: PyTorch itself then reads
its CUDA keys (backend, per_process_memory_fraction...) from the older one
(c10/cuda/CUDAAllocatorConfig.h) and the rest from the newer, a split that one
string for pyalloc cannot follow. Each of its keys is taken one of three
ways, and none is dropped in silence:

- ``applied``: it becomes a pyalloc setting with the same meaning
  (``expandable_segments`` -> ``strategy``, ``max_split_size_mb`` ->
  ``max_split_size``, ``large_segment_size_mb`` -> ``segment_size``), or it
  asks for what pyalloc does anyway;
- ``applied by PyTorch``: the pinned host-memory keys, which PyTorch's own
  host allocator still reads (pyalloc allocates device memory only);
- ``not applied``: pyalloc has no such mechanism; install() names each such
  key once on stderr, with why, and ``pyalloc doctor`` lists every key.

The key names and value forms follow PyTorch's parsers
(c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.cpp).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, TextIO, Tuple

#: PyTorch's variables, in the order it reads them.
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

APPLIED = "applied"
BY_TORCH = "applied by PyTorch"
NOT_APPLIED = "not applied"

_MIB = 1 << 20
#: PyTorch's kLargeBuffer: max_split_size_mb below it is an error there.
_MIN_SPLIT_MB = 20


@dataclass(frozen=True)
class Taken:
    """How one key of PyTorch's settings was taken."""

    key: str
    value: str
    how: str  # APPLIED, BY_TORCH or NOT_APPLIED
    setting: str  # the pyalloc "key:value" it became ("" where none)
    why: str

    def describe(self) -> str:
        into = f" -> {self.setting}" if self.setting else ""
        return f"{self.key}:{self.value}{into} ({self.how}: {self.why})"


def torch_conf(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, str]]:
    """(variable, text) of the PyTorch settings in force, or None where neither is set."""
    env = os.environ if environ is None else environ
    for name in ENV_NAMES:
        text = env.get(name)
        if text is not None:
            return (name, text) if text.strip() else None
    return None


def shadowed(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The older variable where both are set, differently: pyalloc does not read it."""
    env = os.environ if environ is None else environ
    new, old = (env.get(n, "").strip() for n in ENV_NAMES)
    return ENV_NAMES[1] if new and old and new != old else None


def _items(name: str, text: str) -> List[Tuple[str, str]]:
    """Splits 'key:value,key:[a:b,c:d],...' into (key, value) pairs; spaces are
    ignored, as PyTorch's tokenizer ignores them."""
    text = text.replace(" ", "")
    items, i = [], 0
    while i < len(text):
        colon = text.find(":", i)
        comma = text.find(",", i)
        if colon < 0 or (0 <= comma < colon):
            end = comma if comma >= 0 else len(text)
            raise ValueError(f"{name}={text!r}: item '{text[i:end]}' is not of the form key:value")
        key = text[i:colon]
        j = colon + 1
        if text.startswith("[", j):
            close = text.find("]", j)
            if close < 0:
                raise ValueError(f"{name}={text!r}: '[' after '{key}:' is never closed")
            end = close + 1
        else:
            end = comma if comma >= 0 else len(text)
        items.append((key, text[j:end]))
        if end < len(text) and text[end] != ",":
            raise ValueError(f"{name}={text!r}: expected ',' after '{key}:{text[j:end]}'")
        i = end + 1
    return [(k, v) for k, v in items if k]


def _bool(name: str, key: str, value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise ValueError(f"{name}: {key} expects True or False, got {value!r}")


def _megabytes(name: str, key: str, value: str, least: int = 1) -> int:
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{name}: {key} expects a whole number of MiB of at least {least}, got {value!r}")
    return int(value)


# -- one function a key: (how, pyalloc setting, why) -------------------------------------


def _expandable_segments(name: str, key: str, value: str) -> Tuple[str, str, str]:
    if _bool(name, key, value):
        return (APPLIED, "strategy:vmm", "one virtual range with pages mapped on demand, as "
                "expandable segments (bestfit where the device has no virtual memory management)")
    return (APPLIED, "strategy:bestfit", "separate segments, as PyTorch's allocator without expandable segments")


def _max_split_size(name: str, key: str, value: str) -> Tuple[str, str, str]:
    mb = _megabytes(name, key, value, least=_MIN_SPLIT_MB)
    return (APPLIED, f"max_split_size:{mb * _MIB}", "blocks this large or larger are never split")


def _large_segment_size(name: str, key: str, value: str) -> Tuple[str, str, str]:
    mb = _megabytes(name, key, value)
    return (APPLIED, f"segment_size:{mb * _MIB}",
            "the pool grows by segments of at least this size (strategy bestfit; vmm maps pages)")


def _throw_on_oom(name: str, key: str, value: str) -> Tuple[str, str, str]:
    if _bool(name, key, value):
        return (APPLIED, "", "pyalloc always does so: a request past the memory fraction is refused "
                "with an out-of-memory error before any driver call")
    return (NOT_APPLIED, "", "pyalloc always refuses a request past the memory fraction before any "
            "driver call; it cannot be turned off")


def _fraction(name: str, key: str, value: str) -> Tuple[str, str, str]:
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"{name}: {key} expects a fraction in [0, 1], got {value!r}")
    return (NOT_APPLIED, "", "pyalloc cannot set it before a device is in use; call "
            f"torch.cuda.set_per_process_memory_fraction({value}) after install(), which pyalloc honours")


def _backend(name: str, key: str, value: str) -> Tuple[str, str, str]:
    if value not in ("native", "cudaMallocAsync"):
        raise ValueError(f"{name}: backend expects native or cudaMallocAsync, got {value!r}")
    return (NOT_APPLIED, "", f"it chooses between PyTorch's own allocators, and pyalloc replaces "
            f"them; to use {value}, do not install pyalloc")


def _not_applied(why: str) -> Callable[[str, str, str], Tuple[str, str, str]]:
    return lambda name, key, value: (NOT_APPLIED, "", why)


def _by_torch(name: str, key: str, value: str) -> Tuple[str, str, str]:
    return (BY_TORCH, "", "pinned host memory stays PyTorch's; pyalloc allocates device memory only")


_KEYS: Dict[str, Callable[[str, str, str], Tuple[str, str, str]]] = {
    "expandable_segments": _expandable_segments,
    "max_split_size_mb": _max_split_size,
    "large_segment_size_mb": _large_segment_size,
    "throw_on_cudamalloc_oom": _throw_on_oom,
    "per_process_memory_fraction": _fraction,
    "backend": _backend,
    "garbage_collection_threshold": _not_applied(
        "pyalloc has no threshold collector: it gives cached memory back on empty_cache() and "
        "when a request would otherwise not fit"),
    "roundup_power2_divisions": _not_applied(
        "pyalloc rounds requests to 512 B only; its placement, not rounding, keeps blocks reusable"),
    "max_non_split_rounding_mb": _not_applied("pyalloc hands out unsplit blocks only when they fit exactly"),
    "expandable_segments_reserve": _not_applied(
        "pyalloc's vmm strategy reserves one virtual range per device, sized by itself"),
    "expandable_segments_reserve_by_class": _not_applied(
        "pyalloc's vmm strategy reserves one virtual range per device, sized by itself"),
    "release_lock_on_cudamalloc": _not_applied("pyalloc's pools keep their own locking"),
    "graph_capture_record_stream_reuse": _not_applied(
        "pyalloc reuses a block freed during a capture as it does outside one, after the streams' events"),
    "pinned_use_cuda_host_register": _by_torch,
    "pinned_num_register_threads": _by_torch,
    "pinned_use_background_threads": _by_torch,
    "pinned_reserve_segment_size_mb": _by_torch,
    "pinned_free_catch_all": _by_torch,
}


def translate(name: str, text: str) -> List[Taken]:
    """How each key of PyTorch's settings ``text`` (from variable ``name``) is taken.

    ValueError names the variable and the bad item or value, as PyTorch
    itself refuses such a string.
    """
    taken = []
    for key, value in _items(name, text):
        handler = _KEYS.get(key)
        if handler is None:
            taken.append(Taken(key, value, NOT_APPLIED, "", "not a key PyTorch's allocator knows"))
            continue
        how, setting, why = handler(name, key, value)
        taken.append(Taken(key, value, how, setting, why))
    return taken


def settings(taken: List[Taken]) -> str:
    """The pyalloc settings string the applied keys make (later keys win)."""
    return ",".join(t.setting for t in taken if t.setting)


_announced = False


def announce(name: str, taken: List[Taken], out: Optional[TextIO] = None) -> None:
    """Names each key that is not applied, on stderr, once per process."""
    global _announced
    if _announced:
        return
    _announced = True
    out = sys.stderr if out is None else out
    unread = shadowed()
    if unread:
        print(f"pyalloc: {unread} is not read: {name} is set too, and pyalloc reads that one alone",
              file=out)
    for t in taken:
        if t.how == NOT_APPLIED:
            print(f"pyalloc: {name}: {t.key}:{t.value} is not applied: {t.why}", file=out)
