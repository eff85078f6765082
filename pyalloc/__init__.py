"""pyalloc: a CUDA caching allocator for PyTorch that fights fragmentation.

The policy is C++ (``pyalloc._C``); this package wraps it. ``Allocator`` runs
it over host or virtual memory, with no GPU needed.
"""
from ._C import __version__
from ._config import CONFIG_KEYS, parse_config
from .allocator import Allocator, InvalidPointerError, InvariantError, OutOfMemoryError

__all__ = [
    "Allocator",
    "CONFIG_KEYS",
    "InvalidPointerError",
    "InvariantError",
    "OutOfMemoryError",
    "__version__",
    "parse_config",
]
