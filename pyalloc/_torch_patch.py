"""Making torch.cuda's memory statistics answer from pyalloc.

Under any pluggable allocator, ``torch.cuda.memory_stats()`` and the functions
built on it raise "CUDAPluggableAllocator does not yet support ...", which breaks
training loops and libraries that log memory. ``apply(replacements)`` puts the
given functions (pyalloc.cuda's, which take the same arguments and give the same
results) in place of torch's of the same names, in both ``torch.cuda`` and
``torch.cuda.memory`` (torch's own helpers look them up there). ``remove()``
puts torch's back. This module knows nothing of pyalloc's pools, so it imports
none of pyalloc.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Tuple

# (module, name) -> torch's function, while patched
_originals: Dict[Tuple[Any, str], Any] = {}
# name -> the function put in torch's place
_applied: Dict[str, Callable[..., Any]] = {}


def apply(replacements: Iterable[Callable[..., Any]]) -> None:
    """Installs the replacements, each under its own __name__ (idempotent)."""
    import torch.cuda
    import torch.cuda.memory

    for fn in replacements:
        name = fn.__name__
        for module in (torch.cuda, torch.cuda.memory):
            current = getattr(module, name, None)
            if current is None or current is fn:
                continue
            _originals.setdefault((module, name), current)
            setattr(module, name, fn)
        _applied[name] = fn


def remove() -> None:
    """Puts torch's functions back."""
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()
    _applied.clear()


def is_applied() -> bool:
    import torch.cuda

    fn = _applied.get("memory_stats")
    return fn is not None and torch.cuda.memory_stats is fn
