"""pyalloc: a CUDA caching allocator for PyTorch that fights fragmentation.

The policy is C++ (``pyalloc._C``); this package wraps it. ``install()`` makes it
PyTorch's CUDA allocator (see ``pyalloc.cuda``); ``Allocator`` runs it over host
or virtual memory, with no GPU needed. ``watch_oom()`` keeps a snapshot, and
a verdict, of each out-of-memory error. Importing pyalloc never imports torch.
"""
from ._C import __version__
from ._config import CONFIG_KEYS, parse_config
from .allocator import Allocator, InvalidPointerError, InvariantError, OutOfMemoryError
from .cuda import (
    NotOnCudaError,
    attach_oom_observer,
    detach_oom_observer,
    dump_snapshot,
    empty_cache,
    fragmentation,
    graph_memory,
    install,
    is_installed,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    record_history,
    release_graph_memory,
    reserve,
    reserve_buffer,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    snapshot,
)
from .oom_watch import watch_oom

__all__ = [
    "Allocator",
    "CONFIG_KEYS",
    "InvalidPointerError",
    "InvariantError",
    "NotOnCudaError",
    "OutOfMemoryError",
    "__version__",
    "attach_oom_observer",
    "detach_oom_observer",
    "dump_snapshot",
    "empty_cache",
    "fragmentation",
    "graph_memory",
    "install",
    "is_installed",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "parse_config",
    "record_history",
    "release_graph_memory",
    "reserve",
    "reserve_buffer",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "snapshot",
    "watch_oom",
]
