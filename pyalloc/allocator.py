"""The Allocator class: pyalloc's core over a backend that needs no GPU.

``host`` hands out real host memory (tests can write through every block);
``virtual`` hands out addresses only, for replaying traces of any size. The
same C++ policy serves the CUDA path that ``pyalloc.install()`` sets up.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional

from . import _C
from ._config import MAX_SIZE, Size, as_size, conf_string

OutOfMemoryError = _C.OutOfMemoryError
InvalidPointerError = _C.InvalidPointerError
InvariantError = _C.InvariantError

BACKENDS = ("host", "virtual")


def _as_stream(stream: Any) -> int:
    """A stream handle from an int or an object with .cuda_stream (torch streams)."""
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, bool) or not hasattr(handle, "__index__"):
        raise TypeError(f"stream must be an int handle, got {type(stream).__name__}")
    n = operator.index(handle)
    if not 0 <= n <= MAX_SIZE:
        raise ValueError(f"stream handle out of range: {n}")
    return n


def _as_ptr(ptr: Any) -> int:
    if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
        raise TypeError(f"pointer must be an int address, got {type(ptr).__name__}")
    n = operator.index(ptr)
    if not 0 <= n <= MAX_SIZE:
        raise InvalidPointerError(f"{n:#x} is not an address")
    return n


class Allocator:
    """A caching allocator over a host or virtual backend.

    Args:
        backend: ``"host"`` (real host memory) or ``"virtual"`` (addresses only).
        conf: configuration as ``"key:value,..."`` (sizes in bytes or with
            KiB/MiB/GiB), e.g. ``"pool_size:2GiB,max_pool_size:40GiB"``.
        capacity: bytes the simulated device holds (0: unbounded).
        page_size: ``"virtual"`` only: the size of the pages the vmm strategy maps
            (0: CUDA's 2 MiB; a power of two from 4 KiB to 1 GiB), to ask what a
            device with other pages would have done; refused with
            ``strategy:bestfit``, which maps no pages.
        **config: the same keys as keyword arguments; they override ``conf``.

    All sizes are in bytes; streams are integer handles.
    """

    def __init__(
        self,
        backend: str = "host",
        conf: Optional[str] = None,
        *,
        capacity: Size = 0,
        page_size: Size = 0,
        **config: Size,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
        self._core = _C.Allocator(backend, conf_string(conf, config), as_size(capacity, "capacity"),
                                  page_size=as_size(page_size, "page_size"))

    # -- allocation -----------------------------------------------------------------------

    def malloc(self, size: int, stream: Any = 0) -> int:
        """Allocates ``size`` bytes for use on ``stream``; returns the address (0 for 0 bytes).

        Raises OutOfMemoryError (a RuntimeError) when the pool cannot serve it,
        ValueError for negative or impossible sizes.
        """
        return self._core.malloc(as_size(size, "size"), _as_stream(stream))

    def free(self, ptr: int) -> None:
        """Frees an address malloc() returned; InvalidPointerError for anything else."""
        self._core.free(_as_ptr(ptr))

    def record_stream(self, ptr: int, stream: Any) -> None:
        """Marks the allocation as used on ``stream`` too: its memory is not reused until
        the work queued on ``stream`` when it is freed has finished."""
        self._core.record_stream(_as_ptr(ptr), _as_stream(stream))

    # -- pool management ------------------------------------------------------------------

    def empty_cache(self) -> int:
        """Returns cached free memory to the backend, keeping ``pool_size`` reserved;
        the bytes released."""
        return self._core.empty_cache()

    def reserve(self, nbytes: Size) -> int:
        """Grows the pool so that a free range of ``nbytes`` exists; the bytes newly reserved."""
        return self._core.reserve(as_size(nbytes, "nbytes"))

    def set_max_pool_size(self, nbytes: Size) -> None:
        """Caps the pool at ``nbytes`` (0: no cap) for future growth."""
        self._core.set_max_pool_size(as_size(nbytes, "nbytes"))

    # -- introspection --------------------------------------------------------------------

    def stats(self) -> Dict[str, int]:
        """Every key of ``torch.cuda.memory_stats()``, with the same meaning."""
        return dict(self._core.stats())

    def reset_peak_stats(self) -> None:
        self._core.reset_peak_stats()

    def fragmentation(self) -> Dict[str, Any]:
        """Free bytes, largest free block, external fragmentation
        (1 - largest free block / free bytes), free block count and a histogram."""
        return self._core.fragmentation()

    def snapshot(self) -> Dict[str, Any]:
        """The pool in PyTorch's memory-snapshot layout (``torch.cuda.memory._snapshot()``)."""
        return {
            "segments": self._core.snapshot_segments(0),
            "device_traces": [self._core.history()],
            # page_size: the pages the pool mapped (0 under bestfit), a what-if on "virtual".
            "allocator_settings": {"backend": self.backend, **self.config, "page_size": self.page_size},
        }

    def check_invariants(self) -> None:
        """Verifies the whole structure; raises InvariantError if anything is off."""
        self._core.check_invariants()

    def record_history(self, enabled: bool = True, max_entries: int = 100_000) -> None:
        """Keeps the last ``max_entries`` alloc/free/segment events for snapshot()."""
        self._core.record_history(bool(enabled), operator.index(max_entries) if enabled else 0)

    def history(self) -> List[Dict[str, Any]]:
        return self._core.history()

    @property
    def backend(self) -> str:
        return self._core.backend

    @property
    def config(self) -> Dict[str, int]:
        """The effective configuration, in bytes."""
        return self._core.config()

    @property
    def page_size(self) -> int:
        """The size of the pages the vmm strategy maps, in bytes (0: the pool
        uses plain segments, as under ``strategy:bestfit``)."""
        return self._core.page_size

    # -- simulated streams (host and virtual backends) ------------------------------------

    def stream_set_busy(self, stream: Any) -> None:
        """Simulates queued work on ``stream``: events recorded on it stay pending."""
        self._core.stream_set_busy(_as_stream(stream))

    def stream_fail(self, stream: Any) -> None:
        """Simulates the work queued on ``stream`` failing (as a CUDA event whose
        query failed): its events stay pending and waiting for them fails, until
        :meth:`stream_complete`."""
        self._core.stream_fail(_as_stream(stream))

    def stream_complete(self, stream: Any) -> None:
        """Simulates the work queued on ``stream`` finishing."""
        self._core.stream_complete(_as_stream(stream))

    def __repr__(self) -> str:
        s = self._core.stats()
        return (
            f"<pyalloc.Allocator backend={self.backend} "
            f"allocated={s['allocated_bytes.all.current']} reserved={s['reserved_bytes.all.current']}>"
        )
