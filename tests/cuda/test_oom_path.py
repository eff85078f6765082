"""One out-of-memory path (csrc/core/oom.h), on fake devices of host memory.

Whichever pool of a device runs out (general, buffers, a graph pool, the general
pool during a capture PyTorch did not announce), the error is raised once, where
the retries end: counted once (num_ooms, num_oom_rejections), traced once (the
history's ``oom`` event, tagged with the request's context, as PyTorch's is) and
worded once, in PyTorch's words, naming the pool.
"""
from __future__ import annotations

import ctypes

import pytest

import pyalloc
from pyalloc import _C

from bridge_api import OK, OUT_OF_MEMORY, BridgeApi

MiB = 1 << 20
CAPTURE_STREAM = 0x5000


@pytest.fixture
def lib():
    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_malloc.restype = ctypes.c_void_p
    lib.pyalloc_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_free.restype = None
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_set_memory_fraction.restype = None
    lib.pyalloc_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
    return lib


@pytest.fixture
def history():
    _C.cuda_record_history(True, 1000)
    try:
        yield
    finally:
        _C.cuda_record_history(False, 0)


def ooms(pool="general"):
    return [e for e in _C.cuda_history(0, pool) if e["action"] == "oom"]


def counts():
    s = _C.cuda_device_stats(0)
    return s["num_ooms"], s["num_oom_rejections"], s["num_alloc_retries"]


def hook(name, pool_id, streams=()):
    _C._testing_pool_hook(name, 0, pool_id, list(streams))


def test_the_oom_event_carries_the_requests_context(fake):
    """Regression: an out-of-memory error the device's other pools could not
    mend was traced with no context (counted apart from the request), so
    PyTorch's memory viewer showed the `oom` event without the stack of the
    allocation that failed; one the retry after giving them back did not mend
    carried it."""
    api = BridgeApi()
    assert api.record_history(1, 1000, 1) == OK
    try:
        status, _, _ = api.malloc(128 * MiB, context=23)  # twice the fake device
        assert status == OUT_OF_MEMORY
        [oom] = [e for e in api.history(0) if e["action"] == "oom"]
        assert oom["context"] == 23 and oom["size"] == 128 * MiB
        assert 23 in api.values("contexts_in_use")  # its stack is kept for the viewer
    finally:
        api.record_history(0, 0, 1)


NO_RETRY = ("no retry was tried: no cached memory given back, by this pool or any other, "
            "could make room for it")


def test_a_buffer_oom_beyond_the_memory_fraction_keeps_the_general_cache(fake, lib, history):
    """Regression: a request larger than the memory fraction lets all of the
    device's pools hold made the general pool give back its cache for a retry
    that could not help. PyTorch's alloc_block calls release_cached_blocks
    there too; pyalloc refuses at once and keeps the cache."""
    p = lib.pyalloc_malloc(40 * MiB, 0, None)
    lib.pyalloc_free(p, 0, 0, None)  # cached in the general pool
    lib.pyalloc_set_memory_fraction(0.5, 0)  # 32 MiB for all of device 0's pools
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        _C.cuda_buffer(0, 40 * MiB, 0)
    message = str(e.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 40.00 MiB on device 0 "
                              "(pyalloc buffer pool).")
    assert message.count("CUDA out of memory") == 1
    assert "larger than the memory fraction lets all of the device's pools reserve (32.00 MiB)" in message
    assert NO_RETRY in message
    assert _C.cuda_stats(0, "general")["reserved_bytes.all.current"] == 40 * MiB
    assert counts() == (1, 1, 0)
    assert len(ooms("buffers")) == 1 and ooms("general") == []
    _C.cuda_check_invariants(0)


def test_a_request_beyond_the_device_keeps_every_pools_cache(fake, lib, history):
    """Regression: a request larger than the device itself made the device's
    other pools give back their cache before the error."""
    buf = _C.cuda_buffer(0, 8 * MiB, 0)
    del buf  # cached in the buffer pool
    lib.pyalloc_free(lib.pyalloc_malloc(4 * MiB, 0, None), 0, 0, None)  # and in the general pool
    general = _C.cuda_stats(0, "general")["reserved_bytes.all.current"]
    buffers = _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"]
    assert general > 0 and buffers > 0
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        _C._testing_hook_malloc(65 * MiB, 0, 0)  # the fake device holds 64 MiB
    message = str(e.value)
    assert "larger than the device's total memory (64.00 MiB)" in message and NO_RETRY in message
    assert _C.cuda_stats(0, "general")["reserved_bytes.all.current"] == general
    assert _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"] == buffers
    assert counts() == (1, 1, 0)
    _C.cuda_check_invariants(0)


def test_a_request_beyond_the_pools_cap_keeps_the_other_pools_cache(fake, lib, history):
    """Regression: a request the general pool's own cap (max_pool_size) could
    never hold made the buffer pool give back its cache first."""
    _C.cuda_configure("max_pool_size:16MiB")
    buf = _C.cuda_buffer(0, 8 * MiB, 0)
    del buf
    buffers = _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"]
    assert buffers > 0
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        _C._testing_hook_malloc(20 * MiB, 0, 0)
    message = str(e.value)
    assert "would exceed the pool's cap" in message and NO_RETRY in message
    assert _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"] == buffers
    assert counts() == (1, 1, 0)
    _C.cuda_check_invariants(0)


def test_a_graph_pool_oom_counts_once_and_gives_nothing_back(fake, lib, history):
    """A graph pool's route counts as a capture underway: nothing is released to
    make room for it, not even the other pools' caches."""
    buf = _C.cuda_buffer(0, 8 * MiB, 0)
    del buf  # cached in the buffer pool
    lib.pyalloc_set_memory_fraction(0.5, 0)
    hook("begin_allocate_to_pool", (0, 9), [CAPTURE_STREAM])
    try:
        with pytest.raises(pyalloc.OutOfMemoryError) as e:
            _C._testing_hook_malloc(30 * MiB, 0, CAPTURE_STREAM)
        graph_ooms = ooms("graph")  # read while the pool exists
    finally:
        hook("end_allocate_to_pool", (0, 9))
        hook("release_pool", (0, 9))
    message = str(e.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 30.00 MiB on device 0 "
                              "(pyalloc graph pool).")
    assert "A CUDA graph capture is underway" in message
    assert _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"] >= 8 * MiB
    num_ooms, rejections, _ = counts()
    assert (num_ooms, rejections) == (1, 1)
    assert len(graph_ooms) == 1 and ooms("general") == ooms("buffers") == []
    _C.cuda_check_invariants(0)


def test_an_oom_during_an_unannounced_capture_counts_once(fake, lib, history):
    """Without PyTorch's pool calls, a capturing stream's blocks are held in the
    general pool; its out-of-memory error says the capture is why nothing was given
    back."""
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, None), 0, 0, None)
    _C._testing_set_capture(CAPTURE_STREAM, 3)
    try:
        with pytest.raises(pyalloc.OutOfMemoryError) as e:
            _C._testing_hook_malloc(128 * MiB, 0, CAPTURE_STREAM)
    finally:
        _C._testing_set_capture(CAPTURE_STREAM, 0)
    message = str(e.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 128.00 MiB on device 0 "
                              "(pyalloc general pool).")
    assert "A CUDA graph capture is underway" in message
    assert counts() == (1, 1, 0)
    [oom] = ooms()
    assert oom["size"] == 128 * MiB and oom["stream"] == CAPTURE_STREAM
    _C.cuda_check_invariants(0)


def test_the_core_alone_words_and_counts_its_own_errors(make):
    """An allocator with no device around it (the replay, pyalloc.Allocator) says
    its own figures; one error, one count, one event."""
    a = make(max_pool_size=4 * MiB)
    a.record_history(True)
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(8 * MiB)
    assert str(e.value).startswith("out of memory: tried to allocate 8.00 MiB on stream 0: ")
    s = a.stats()
    assert (s["num_ooms"], s["num_oom_rejections"]) == (1, 1)
    assert [h["action"] for h in a.history()].count("oom") == 1


def test_a_malloc_that_retried_twice_counts_one_retry(fake, lib, history):
    """Regression: num_alloc_retries counted each attempt that reached the pool's
    release-and-retry: a malloc whose first attempt retried in vain, then had the
    device's other pools give back their cache (the device's part of the retry)
    and tried again, in vain too, counted 2. PyTorch counts each malloc that
    retried once."""
    _C.cuda_configure("pool_size:0,strategy:bestfit")
    a = lib.pyalloc_malloc(6 * MiB, 0, None)
    b = lib.pyalloc_malloc(6 * MiB, 0, None)  # the same segment: it stays, holding free memory
    lib.pyalloc_free(a, 0, 0, None)
    live = _C.cuda_buffer(0, 4 * MiB, 0)  # the buffer pool keeps this,
    cached = _C.cuda_buffer(0, 8 * MiB, 0)
    del cached  # and gives this back, which is not enough
    lib.pyalloc_set_memory_fraction(0.75, 0)  # 48 MiB for all of device 0's pools
    general = _C.cuda_stats(0, "general")
    buffers = _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"]
    device_free = 48 * MiB - general["reserved_bytes.all.current"] - buffers
    unallocated = general["reserved_bytes.all.current"] - general["allocated_bytes.all.current"]
    # More than the device has free even after the buffer pool's release, within
    # what the general pool's unallocated memory seems to make up: it retries.
    request = device_free + 8 * MiB + 4 * MiB
    assert request - device_free <= unallocated
    ooms_before, _, retries_before = counts()
    with pytest.raises(pyalloc.OutOfMemoryError):
        _C._testing_hook_malloc(request, 0, 0)
    num_ooms, _, retries = counts()
    assert _C.cuda_stats(0, "buffers")["reserved_bytes.all.current"] < buffers  # it did give back
    assert (num_ooms - ooms_before, retries - retries_before) == (1, 1)
    del live
    lib.pyalloc_free(b, 0, 0, None)
    _C.cuda_check_invariants(0)
