"""Making torch.cuda's memory statistics answer from pyalloc.

Under any pluggable allocator, ``torch.cuda.memory_stats()`` and the functions
built on it raise "CUDAPluggableAllocator does not yet support ...", which breaks
training loops and libraries that log memory. ``apply()`` replaces them, in both
``torch.cuda`` and ``torch.cuda.memory`` (torch's own helpers look them up
there), with functions of the same signatures that read pyalloc's pools.
``remove()`` puts torch's back.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from . import cuda as _api


def memory_stats(device: Any = None) -> Dict[str, Any]:
    return _api.memory_stats(device)


def memory_allocated(device: Any = None) -> int:
    return _api.memory_allocated(device)


def max_memory_allocated(device: Any = None) -> int:
    return _api.max_memory_allocated(device)


def memory_reserved(device: Any = None) -> int:
    return _api.memory_reserved(device)


def max_memory_reserved(device: Any = None) -> int:
    return _api.max_memory_reserved(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    _api.reset_peak_memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    return _api.memory_summary(device, abbreviated)


REPLACEMENTS: Tuple[Callable[..., Any], ...] = (
    memory_stats,
    memory_allocated,
    max_memory_allocated,
    memory_reserved,
    max_memory_reserved,
    reset_peak_memory_stats,
    memory_summary,
)

for _fn in REPLACEMENTS:
    _fn.__doc__ = (
        f"pyalloc's torch.cuda.{_fn.__name__}: the same arguments and result, from "
        f"pyalloc's pools (see pyalloc.{_fn.__name__})."
    )

# (module, name) -> torch's function, while patched
_originals: Dict[Tuple[Any, str], Any] = {}


def apply() -> None:
    """Installs the replacements (idempotent)."""
    import torch.cuda
    import torch.cuda.memory

    for module in (torch.cuda, torch.cuda.memory):
        for fn in REPLACEMENTS:
            name = fn.__name__
            current = getattr(module, name, None)
            if current is None or current is fn:
                continue
            _originals[(module, name)] = current
            setattr(module, name, fn)


def remove() -> None:
    """Puts torch's functions back."""
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


def is_applied() -> bool:
    import torch.cuda

    return torch.cuda.memory_stats is memory_stats
