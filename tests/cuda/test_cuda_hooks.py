"""PyTorch's hooks and the per-device pools behind them, on CPU.

The functions PyTorch calls are called here through ctypes, exactly as PyTorch
calls them, over fake devices whose pools are host memory and whose stream
captures the tests set (``_C._testing_*``). What needs a real GPU is in
tests/gpu/, run by test_gpu.py.
"""
from __future__ import annotations

import ctypes
import gc
import threading

import pytest

import pyalloc
from pyalloc import _C

MiB = 1 << 20
CAPACITY = 64 * MiB

HOOKS = (
    "pyalloc_malloc",
    "pyalloc_free",
    "pyalloc_init",
    "pyalloc_empty_cache",
    "pyalloc_set_memory_fraction",
    "pyalloc_base_alloc",
    "pyalloc_record_stream",
)


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def lib():
    """The hooks with PyTorch's signatures (torch/csrc/cuda/CUDAPluggableAllocator.h)."""
    lib = ctypes.CDLL(_C.library_path())
    c = ctypes
    lib.pyalloc_malloc.restype = c.c_void_p
    lib.pyalloc_malloc.argtypes = [c.c_size_t, c.c_int, c.c_void_p]
    lib.pyalloc_free.restype = None
    lib.pyalloc_free.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
    lib.pyalloc_init.restype = None
    lib.pyalloc_init.argtypes = [c.c_int]
    lib.pyalloc_empty_cache.restype = None
    lib.pyalloc_empty_cache.argtypes = []
    lib.pyalloc_set_memory_fraction.restype = None
    lib.pyalloc_set_memory_fraction.argtypes = [c.c_double, c.c_int]
    lib.pyalloc_base_alloc.restype = c.c_void_p
    lib.pyalloc_base_alloc.argtypes = [c.c_void_p, c.POINTER(c.c_size_t)]
    lib.pyalloc_record_stream.restype = None
    lib.pyalloc_record_stream.argtypes = [c.c_void_p, c.c_void_p]
    return lib


def allocated(device: int = 0) -> int:
    return _C.cuda_stats(device)["allocated_bytes.all.current"]


def reserved(device: int = 0) -> int:
    return _C.cuda_stats(device)["reserved_bytes.all.current"]


def check(device: int = 0) -> None:
    _C.cuda_check_invariants(device)


# -- the library as PyTorch sees it ------------------------------------------------------


def test_hooks_are_exported_from_the_module_library():
    lib = ctypes.CDLL(pyalloc._C.__file__)
    for name in HOOKS:
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert _C.library_path().endswith(pyalloc._C.__file__.rsplit("/", 1)[-1])


def test_size_zero_null_and_foreign_pointers_need_no_device(lib):
    # PyTorch asks for 0 bytes at times: nullptr, as from its own allocator.
    assert lib.pyalloc_malloc(0, 0, None) is None
    lib.pyalloc_free(None, 0, 0, None)
    lib.pyalloc_record_stream(1234 * 4096, 7)  # not ours: ignored
    size = ctypes.c_size_t(99)
    assert lib.pyalloc_base_alloc(4096 * 77, ctypes.byref(size)) == 4096 * 77
    assert size.value == 99  # untouched, as PyTorch's default
    lib.pyalloc_empty_cache()
    assert _C.cuda_devices() == []


def test_init_hook_records_the_device_count(fake, lib):
    lib.pyalloc_init(3)
    assert _C.cuda_hook_device_count() == 3
    assert _C.cuda_devices() == []  # pools come with each device's first allocation


@pytest.mark.skipif(_driver_present(), reason="a CUDA driver is installed here")
def test_missing_driver_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1.*NVIDIA") as e:
        _C.cuda_check_driver()
    assert isinstance(e.value, _C.CudaDriverError)
    # The same reason reaches PyTorch from the allocation hook, and nothing is left behind.
    with pytest.raises(RuntimeError, match=r"cannot load the CUDA driver library libcuda\.so\.1"):
        _C._testing_hook_malloc(4096, 0, 0)
    with pytest.raises(RuntimeError, match="libcuda"):
        _C.cuda_reserve(0, MiB)
    assert _C.cuda_devices() == []


# -- malloc and free ---------------------------------------------------------------------


def test_malloc_free_through_the_hooks(fake, lib):
    ptrs = [lib.pyalloc_malloc(n, 0, None) for n in (1, 512, 1000, 3 * MiB, 100_000)]
    assert all(ptrs) and len(set(ptrs)) == len(ptrs)
    for p, n in zip(ptrs, (1, 512, 1000, 3 * MiB, 100_000)):
        ctypes.memset(p, 0xAB, n)  # fake device memory is real: every byte is usable
    assert allocated() == 512 + 512 + 1024 + 3 * MiB + 100_352
    for p in ptrs:
        lib.pyalloc_free(p, 0, 0, None)  # the size PyTorch passes is not trusted
    assert allocated() == 0
    check()


def test_free_goes_to_the_device_that_owns_the_pointer(fake, lib):
    p = lib.pyalloc_malloc(4096, 1, None)
    assert allocated(1) == 4096
    lib.pyalloc_free(p, 4096, 0, None)  # a wrong device index from the caller
    assert allocated(1) == 0
    assert _C.cuda_devices() == [1]  # device 0 got no pool from the bad hint
    check(1)


def test_bad_frees_are_reported_not_raised(fake, lib, capfd):
    p = lib.pyalloc_malloc(4096, 0, None)
    lib.pyalloc_free(p, 4096, 0, None)
    lib.pyalloc_free(p, 4096, 0, None)
    lib.pyalloc_free(p + 512, 4096, 0, None)
    lib.pyalloc_free(0x1000, 16, 0, None)
    err = capfd.readouterr().err
    assert "double free" in err
    assert "not a pointer from pyalloc" in err
    check()


def test_base_alloc_gives_the_segment(fake, lib):
    p = lib.pyalloc_malloc(MiB, 0, None)
    q = lib.pyalloc_malloc(MiB, 0, None)
    size = ctypes.c_size_t(0)
    base = lib.pyalloc_base_alloc(q + 100, ctypes.byref(size))
    assert base <= p < base + size.value and base <= q < base + size.value
    assert (base, size.value) == tuple(_C.cuda_snapshot_segments(0)[0][k] for k in ("address", "total_size"))
    lib.pyalloc_free(p, 0, 0, None)
    lib.pyalloc_free(q, 0, 0, None)


# -- out of memory -----------------------------------------------------------------------


def test_oom_message_is_what_batch_size_finders_look_for(fake):
    keep = _C._testing_hook_malloc(8 * MiB, 0, 0)
    with pytest.raises(RuntimeError) as e:
        _C._testing_hook_malloc(512 * MiB, 0, 0)
    message = str(e.value)
    # accelerate's find_executable_batch_size and Lightning's scaler test this text.
    assert message.startswith("CUDA out of memory. Tried to allocate 512.00 MiB on device 0")
    for words in ("8.00 MiB allocated", "reserved", "of which", "is free",
                  "the largest free block is"):
        assert words in message
    assert isinstance(e.value, pyalloc.OutOfMemoryError)
    # The process goes on: a smaller request succeeds.
    p = _C._testing_hook_malloc(8 * MiB, 0, 0)
    stats = _C.cuda_stats(0)
    assert stats["num_ooms"] == 1 and stats["allocated_bytes.all.current"] == 16 * MiB
    for q in (p, keep):
        ctypes.CDLL(_C.library_path()).pyalloc_free(ctypes.c_void_p(q), 0, 0, None)
    check()


def test_oom_message_names_each_figure_once_for_what_it_is(fake, lib):
    """Regression: under a memory fraction the message called the room left under the
    cap "the device has 14.98 MiB free" beside "104.20 GiB is free" (the GPU's free
    memory), and after "Details:" stated the pool's figures a second time. Requested,
    allocated, reserved, free, largest free block, the device's free memory and the
    room under the cap are each stated once, each named."""
    import re

    lib.pyalloc_set_memory_fraction(0.75, 0)  # 48 MiB of the 64 MiB fake device
    live = [lib.pyalloc_malloc(size, 0, None) for size in (6 * MiB, 4 * MiB, 6 * MiB)]
    lib.pyalloc_free(live[1], 0, 0, None)  # 12 MiB allocated, a 4 MiB hole
    reserved = _C.cuda_stats(0)["reserved_bytes.all.current"]
    assert reserved == 20 * MiB
    with pytest.raises(RuntimeError) as e:
        _C._testing_hook_malloc(40 * MiB, 0, 0)
    message = str(e.value)
    for said in ("Tried to allocate 40.00 MiB", "GPU 0 has a total capacity of 64.00 MiB of which",
                 "12.00 MiB allocated", "20.00 MiB reserved in this pool",
                 "8.00 MiB of the reserved memory is free", "the largest free block is 4.00 MiB",
                 "The memory fraction 0.75 caps all of pyalloc's pools on device 0 at 48.00 MiB: "
                 "28.00 MiB more can be reserved under the cap",
                 "Why: the allocated memory and this request would exceed the pool's cap; no retry "
                 "was tried: no cached memory given back, by this pool or any other, could make "
                 "room for it."):
        assert message.count(said) == 1, (said, message)
    for figure in ("40.00 MiB", "12.00 MiB", "20.00 MiB", "8.00 MiB", "4.00 MiB", "48.00 MiB", "28.00 MiB"):
        assert len(re.findall(r"(?<![\d.])" + re.escape(figure), message)) == 1, (figure, message)
    assert "device has" not in message and "Details" not in message
    for p in (live[0], live[2]):
        lib.pyalloc_free(p, 0, 0, None)
    check()


def test_batch_size_finder_loop_recovers(fake):
    batch = 384
    while True:
        try:
            ptr = _C._testing_hook_malloc(batch * MiB, 0, 0)
            break
        except RuntimeError as e:
            assert "CUDA out of memory." in str(e)
            batch //= 2
    assert batch == 48  # 64 MiB device: the first size that fits
    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_free(ctypes.c_void_p(ptr), 0, 0, None)
    assert allocated() == 0
    check()


# -- streams -----------------------------------------------------------------------------


def test_record_stream_holds_a_block_until_the_other_stream_is_done(fake, lib):
    s1, s2 = 0x1100, 0x2200
    p = lib.pyalloc_malloc(MiB, 0, s1)
    _C._testing_hook_malloc(512, 0, s2)  # s2 has a pool state of its own now
    _C._testing_stream(0, s2, True)  # work queued on s2, reading p
    lib.pyalloc_record_stream(p, s2)
    lib.pyalloc_free(p, MiB, 0, s1)
    stats = _C.cuda_stats(0)
    assert stats["allocated_bytes.all.current"] == 512
    assert stats["active_bytes.all.current"] == 512 + MiB  # pending: s2 may still read it
    q = lib.pyalloc_malloc(MiB, 0, s1)
    assert q != p  # not reused while s2 is busy
    _C._testing_stream(0, s2, False)
    lib.pyalloc_free(q, MiB, 0, s1)
    r = lib.pyalloc_malloc(MiB, 0, s1)  # the pending free completes on the way
    assert _C.cuda_stats(0)["active_bytes.all.current"] == 512 + MiB
    lib.pyalloc_free(r, MiB, 0, s1)
    check()


PER_THREAD = 0x2  # cudaStreamPerThread


def test_each_thread_has_its_own_per_thread_default_stream(fake, lib):
    """Regression (issue 53, item 4): cudaStreamPerThread (0x2) names the
    calling thread's own default stream, and two threads' do not order each
    other. The hooks took 0x2 for one stream: a block a thread freed with work
    still queued on its stream went at once to another thread."""
    seen = {}

    def worker():
        p = lib.pyalloc_malloc(MiB, 0, PER_THREAD)
        _C._testing_stream(0, _C._testing_per_thread_stream(), True)  # this thread's work still reads p
        lib.pyalloc_free(p, MiB, 0, PER_THREAD)
        again = lib.pyalloc_malloc(MiB, 0, PER_THREAD)  # its own stream reuses it at once
        lib.pyalloc_free(again, MiB, 0, PER_THREAD)
        seen.update(p=p, again=again, stream=_C._testing_per_thread_stream())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["again"] == seen["p"]
    q = lib.pyalloc_malloc(MiB, 0, PER_THREAD)
    assert q != seen["p"], "a thread got a block another thread's queued work may still use"
    assert seen["stream"] != _C._testing_per_thread_stream()
    # Snapshots give the handle PyTorch passed, as its own allocator's do.
    assert {seg["stream"] for seg in _C.cuda_snapshot_segments(0)} == {PER_THREAD}
    _C._testing_stream(0, seen["stream"], False)
    lib.pyalloc_free(q, MiB, 0, PER_THREAD)
    check()


# -- cache, fraction, configuration ------------------------------------------------------


def test_empty_cache_hook_releases_every_device(fake, lib):
    for d in (0, 1):
        lib.pyalloc_free(lib.pyalloc_malloc(5 * MiB, d, None), 0, d, None)
        assert reserved(d) > 0
    lib.pyalloc_empty_cache()
    assert reserved(0) == reserved(1) == 0


def test_empty_cache_keeps_pool_size(fake, lib):
    _C.cuda_configure("pool_size:8MiB")
    p = lib.pyalloc_malloc(20 * MiB, 0, None)
    lib.pyalloc_free(p, 0, 0, None)
    assert reserved() >= 28 * MiB
    assert _C.cuda_empty_cache(0) >= 20 * MiB
    assert reserved() == 8 * MiB
    check()


def test_memory_fraction_caps_the_pool(fake, lib):
    lib.pyalloc_set_memory_fraction(0.25, 0)  # 16 MiB of the 64 MiB fake device
    with pytest.raises(RuntimeError, match="CUDA out of memory.*memory fraction 0.25 caps all of "
                                           "pyalloc's pools on device 0 at 16.00 MiB"):
        _C._testing_hook_malloc(20 * MiB, 0, 0)
    p = lib.pyalloc_malloc(12 * MiB, 0, None)
    assert p and reserved() <= 16 * MiB
    lib.pyalloc_free(p, 0, 0, None)


def test_memory_fraction_caps_every_pool_of_the_device(fake, lib):
    """Regression: the fraction capped the general pool alone, so buffers and
    graph pools could take the whole device past it (PyTorch's cap covers its
    private pools too)."""
    lib.pyalloc_set_memory_fraction(0.25, 0)  # 16 MiB for all of device 0's pools
    with pytest.raises(RuntimeError, match="CUDA out of memory.*memory fraction 0.25"):
        _C.cuda_buffer(0, 20 * MiB, 0)
    hook("begin_allocate_to_pool", (0, 61), [CAPTURE_STREAM])
    try:
        with pytest.raises(RuntimeError, match="CUDA out of memory.*graph pool"):
            _C._testing_hook_malloc(20 * MiB, 0, CAPTURE_STREAM)
        g = lib.pyalloc_malloc(6 * MiB, 0, CAPTURE_STREAM)
    finally:
        hook("end_allocate_to_pool", (0, 61))
    buf = _C.cuda_buffer(0, 6 * MiB, 0)
    # 12 MiB held by the graph pool and the buffer pool: the general pool gets the rest.
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        _C._testing_hook_malloc(6 * MiB, 0, 0)
    p = lib.pyalloc_malloc(2 * MiB, 0, None)
    assert _C.cuda_stats(0)["reserved_bytes.all.current"] <= 16 * MiB
    lib.pyalloc_free(p, 0, 0, None)
    del buf  # cached in the buffer pool: given back when the general pool needs it
    lib.pyalloc_free(g, 0, 0, None)
    hook("release_pool", (0, 61))
    q = lib.pyalloc_malloc(14 * MiB, 0, None)
    assert _C.cuda_stats(0)["reserved_bytes.all.current"] <= 16 * MiB
    lib.pyalloc_free(q, 0, 0, None)
    # Back to the whole device: the other pools grow again.
    lib.pyalloc_set_memory_fraction(1.0, 0)
    buf = _C.cuda_buffer(0, 20 * MiB, 0)
    del buf
    check()


def test_configuration_is_fixed_once_pools_exist(fake, lib):
    _C.cuda_configure("segment_size:4MiB")
    _C.cuda_configure("segment_size:8MiB")  # nothing allocated yet: still free to change
    lib.pyalloc_free(lib.pyalloc_malloc(4096, 0, None), 0, 0, None)
    _C.cuda_configure("segment_size:8MiB")  # the same settings: fine
    with pytest.raises(RuntimeError, match="cannot change"):
        _C.cuda_configure("segment_size:2MiB")
    with pytest.raises(ValueError, match="unknown config key 'bogus'"):
        _C.cuda_configure("bogus:1")
    assert _C.cuda_config()["segment_size"] == 8 * MiB


def test_pools_read_pyalloc_conf_when_not_configured(fake, lib, monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "pool_size:6MiB")
    lib.pyalloc_free(lib.pyalloc_malloc(4096, 0, None), 0, 0, None)
    assert reserved() == 6 * MiB


def test_bad_pyalloc_conf_is_named(fake, monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "pool_size:lots")
    with pytest.raises(ValueError, match="PYALLOC_CONF: bad value for config key 'pool_size'"):
        _C._testing_hook_malloc(4096, 0, 0)


def test_pool_size_the_device_cannot_hold_is_an_oom(fake):
    _C.cuda_configure("pool_size:1GiB")
    with pytest.raises(RuntimeError, match=r"^CUDA out of memory\. pyalloc could not create its pool"):
        _C._testing_hook_malloc(4096, 0, 0)
    assert _C.cuda_devices() == []


# -- CUDA graph capture ------------------------------------------------------------------

CAPTURE_STREAM = 0x5000


@pytest.fixture
def graph_pool(fake, lib):
    """A device with 16 MiB reserved, as pool_size gives, and no capture yet."""
    _C.cuda_configure("pool_size:16MiB")
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, None), 0, 0, None)
    yield lib
    _C._testing_set_capture(CAPTURE_STREAM, 0)


def capture(capture_id: int) -> None:
    _C._testing_set_capture(CAPTURE_STREAM, capture_id)


def test_capture_grows_the_pool_but_releases_nothing(graph_pool):
    # torch.cuda.graph() empties the cache before capturing: a capture must grow.
    lib = graph_pool
    segments = _C.cuda_stats(0)["num_device_alloc"]
    capture(1)
    p = lib.pyalloc_malloc(4 * MiB, 0, CAPTURE_STREAM)
    q = lib.pyalloc_malloc(32 * MiB, 0, CAPTURE_STREAM)  # beyond pool_size
    assert p and q and _C.cuda_stats(0)["num_device_alloc"] == segments + 1
    r = lib.pyalloc_malloc(8 * MiB, 0, None)  # eager work on another stream
    lib.pyalloc_free(r, 0, 0, None)
    before = reserved()
    # Nothing cached is released while the capture runs: not by empty_cache,
    # nor to make room for a request the device cannot hold.
    assert lib.pyalloc_empty_cache() is None and reserved() == before
    with pytest.raises(RuntimeError, match="capture is underway") as e:
        _C._testing_hook_malloc(48 * MiB, 0, 0)
    assert str(e.value).startswith("CUDA out of memory.") and "pool_size" not in str(e.value)
    assert reserved() == before
    capture(0)
    lib.pyalloc_free(p, 0, 0, None)
    lib.pyalloc_free(q, 0, 0, None)
    assert _C.cuda_release_graph_memory(0) == 36 * MiB
    lib.pyalloc_empty_cache()
    assert reserved() == 16 * MiB
    check()


def test_capture_on_one_device_blocks_releases_on_every_device(graph_pool):
    # Regression: captures were tracked per device, so empty_cache() released
    # device 1's memory while device 0 captured, which global capture mode forbids.
    lib = graph_pool
    lib.pyalloc_free(lib.pyalloc_malloc(30 * MiB, 1, None), 0, 1, None)
    before = reserved(1)
    capture(4)
    lib.pyalloc_malloc(512, 0, CAPTURE_STREAM)  # the capture is seen
    lib.pyalloc_empty_cache()
    assert reserved(1) == before
    with pytest.raises(RuntimeError, match="capture is underway"):
        _C._testing_hook_malloc(40 * MiB, 1, 0)
    capture(0)
    lib.pyalloc_empty_cache()
    assert reserved(1) == 16 * MiB


def test_capture_blocks_are_held_and_reused_only_within_their_capture(graph_pool):
    lib = graph_pool
    capture(7)
    a = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    lib.pyalloc_free(a, MiB, 0, CAPTURE_STREAM)
    assert allocated() == MiB  # held: the graph's replays still use it
    b = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    assert b == a  # same capture, same stream, same size: the graph orders the reuse
    c = lib.pyalloc_malloc(2 * MiB, 0, CAPTURE_STREAM)
    assert c not in (a, b)
    lib.pyalloc_free(b, 0, 0, None)
    capture(0)
    lib.pyalloc_free(c, 0, 0, None)
    assert allocated() == 3 * MiB
    assert _C.cuda_graph_memory(0) == (2, 3 * MiB)
    capture(8)  # a new graph never gets the old one's memory
    d = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    assert d not in (a, c)
    capture(0)
    e = lib.pyalloc_malloc(MiB, 0, None)  # nor does eager work
    assert e not in (a, c)
    lib.pyalloc_free(e, 0, 0, None)
    assert _C.cuda_release_graph_memory(0) == 3 * MiB
    assert allocated() == MiB  # d is still live; freed now it goes straight back
    lib.pyalloc_free(d, 0, 0, None)
    assert allocated() == 0 and _C.cuda_graph_memory(0) == (0, 0)
    check()


def test_capture_block_used_by_another_stream_is_not_reused(graph_pool):
    lib = graph_pool
    capture(9)
    a = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    lib.pyalloc_record_stream(a, 0x7777)
    lib.pyalloc_free(a, 0, 0, None)
    b = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    assert b != a
    lib.pyalloc_free(b, 0, 0, None)
    capture(0)
    _C.cuda_release_graph_memory(0)
    assert allocated() == 0
    check()


# -- graph pools (PyTorch's begin/end_allocate_to_pool and release_pool) -----------------


def hook(name, pool, streams=(), device=0):
    """A graph-pool hook, called as PyTorch calls it (exact C++ signature)."""
    _C._testing_pool_hook(name, device, pool, list(streams))


def pools(device=0):
    return {p["id"]: p for p in _C.cuda_graph_pools(device)}


def test_graph_pool_hooks_are_exported_with_cpp_signatures():
    lib = ctypes.CDLL(pyalloc._C.__file__)
    for name in ("pyalloc_begin_allocate_to_pool", "pyalloc_end_allocate_to_pool", "pyalloc_release_pool"):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def test_graph_pool_serves_the_streams_its_filter_accepts(fake, lib):
    hook("begin_allocate_to_pool", (0, 1), [CAPTURE_STREAM])
    assert _C._testing_pool("use_count", 0, (0, 1)) == 1
    a = lib.pyalloc_malloc(3 * MiB, 0, CAPTURE_STREAM)
    b = lib.pyalloc_malloc(MiB, 0, 0x77)  # another stream: the general pool
    assert allocated() == MiB and pools()[(0, 1)]["allocated_bytes"] == 3 * MiB
    assert _C.cuda_pool_live_blocks(0, (0, 1)) == [a]
    size = ctypes.c_size_t(0)
    base = lib.pyalloc_base_alloc(a + 100, ctypes.byref(size))
    assert base <= a < base + size.value
    lib.pyalloc_record_stream(a, 0x78)  # honoured in the pool
    lib.pyalloc_free(a, 0, 0, None)
    assert pools()[(0, 1)]["allocated_bytes"] == 0 and allocated() == MiB
    # While a route is open a capture counts as underway: no event is asked
    # about, so `a` waits for 0x78 and the pool grows instead.
    e = lib.pyalloc_malloc(3 * MiB, 0, CAPTURE_STREAM)
    assert e != a
    lib.pyalloc_free(e, 0, 0, None)
    c = lib.pyalloc_malloc(3 * MiB, 0, CAPTURE_STREAM)
    assert c == e  # freed into the pool, reused by the pool's next allocation
    hook("end_allocate_to_pool", (0, 1))
    d = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)  # no longer routed
    assert allocated() == 2 * MiB and _C.cuda_pool_live_blocks(0, (0, 1)) == [c]
    # The pool keeps its memory while it has a use, whatever empty_cache says.
    lib.pyalloc_free(c, 0, 0, None)
    lib.pyalloc_empty_cache()
    assert pools()[(0, 1)]["reserved_bytes"] >= 3 * MiB
    assert _C.cuda_graph_memory(0) == (0, 0)  # nothing held in the general pool
    for p in (b, d):
        lib.pyalloc_free(p, 0, 0, None)
    hook("release_pool", (0, 1))
    assert pools() == {} and _C._testing_pool("use_count", 0, (0, 1)) == 0
    check()


def test_graphs_sharing_a_pool_share_its_memory_until_both_are_released(fake, lib):
    capture(21)
    hook("begin_allocate_to_pool", (0, 2), [CAPTURE_STREAM])
    x = lib.pyalloc_malloc(8 * MiB, 0, CAPTURE_STREAM)
    out1 = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)  # the first graph's output, kept
    lib.pyalloc_free(x, 0, 0, None)  # freed during the capture: the graph orders reuse
    hook("end_allocate_to_pool", (0, 2))
    capture(22)
    hook("begin_allocate_to_pool", (0, 2), [CAPTURE_STREAM])  # torch.cuda.graph(pool=...)
    assert _C._testing_pool("use_count", 0, (0, 2)) == 2
    y = lib.pyalloc_malloc(8 * MiB, 0, CAPTURE_STREAM)
    assert y == x and y != out1
    hook("end_allocate_to_pool", (0, 2))
    capture(0)
    lib.pyalloc_free(y, 0, 0, None)
    reserved_by_pool = pools()[(0, 2)]["reserved_bytes"]
    hook("release_pool", (0, 2))  # one graph gone, the other may still replay
    assert pools()[(0, 2)]["reserved_bytes"] == reserved_by_pool
    z = lib.pyalloc_malloc(8 * MiB, 0, CAPTURE_STREAM)  # eager: never the pool's memory
    assert z not in (x, out1)
    hook("release_pool", (0, 2))
    assert (0, 2) in pools()  # out1 is still live
    assert _C.cuda_pool_live_blocks(0, (0, 2)) == [out1]
    # The last live block: the pool is marked, and its memory goes back at the
    # next empty_cache (or out-of-memory retry), not inside the deleter.
    lib.pyalloc_free(out1, 0, 0, None)
    assert pools()[(0, 2)]["use_count"] == 0 and pools()[(0, 2)]["reserved_bytes"] > 0
    lib.pyalloc_empty_cache()
    assert pools() == {}
    lib.pyalloc_free(z, 0, 0, None)
    check()


def test_pool_released_during_a_capture_is_reclaimed_after_it(fake, lib):
    hook("begin_allocate_to_pool", (0, 3), [CAPTURE_STREAM])
    lib.pyalloc_free(lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM), 0, 0, None)
    hook("end_allocate_to_pool", (0, 3))
    capture(31)
    lib.pyalloc_malloc(512, 0, CAPTURE_STREAM)  # another graph captures: it is seen
    hook("release_pool", (0, 3))
    assert (0, 3) in pools()  # nothing may be released during a capture
    lib.pyalloc_empty_cache()
    assert (0, 3) in pools()
    capture(0)
    lib.pyalloc_empty_cache()
    assert pools() == {}


def pending(device: int = 0) -> int:
    st = _C.cuda_stats(device)
    return st["active_bytes.all.current"] - st["allocated_bytes.all.current"]


def test_an_open_route_is_a_capture_underway(fake, lib):
    """Regression: PyTorch routes a graph's pool before cudaStreamBeginCapture; in
    between, pyalloc still asked about events and released other devices' caches,
    which invalidates a capture in CUDA's default (global) mode."""
    lib.pyalloc_free(lib.pyalloc_malloc(8 * MiB, 1, None), 0, 1, None)  # cached on device 1
    p = lib.pyalloc_malloc(MiB, 0, 0x10)
    lib.pyalloc_record_stream(p, 0x11)
    hook("begin_allocate_to_pool", (0, 63), [CAPTURE_STREAM])  # no stream captures yet
    lib.pyalloc_free(p, 0, 0, None)  # must wait for 0x11: its event is not asked about
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)
    assert pending(0) == MiB
    lib.pyalloc_empty_cache()
    assert reserved(1) >= 8 * MiB  # nothing released, on any device
    hook("end_allocate_to_pool", (0, 63))
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)
    assert pending(0) == 0
    lib.pyalloc_empty_cache()
    assert reserved(1) == 0
    hook("release_pool", (0, 63))
    check()


def said(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("pyalloc:")]


def test_a_route_left_open_by_a_failed_capture_heals(fake, lib, capfd):
    """Regression: torch 2.x's CUDAGraph::capture_end checks cudaStreamEndCapture
    before it ends the route, so a failed capture left its route open and a capture
    counted as underway on every device for good: no event asked about again, no
    cache released. Once the route's capturing stream has been done for the grace,
    the route heals (said once)."""
    import time

    lib.pyalloc_free(lib.pyalloc_malloc(8 * MiB, 1, None), 0, 1, None)  # cached on device 1
    p = lib.pyalloc_malloc(MiB, 0, 0x10)
    lib.pyalloc_record_stream(p, 0x11)
    hook("begin_allocate_to_pool", (0, 66), [CAPTURE_STREAM])
    capture(41)
    g = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)  # served while capturing: the route is watched
    lib.pyalloc_free(p, 0, 0, None)
    capture(0)  # cudaStreamEndCapture fails; end_allocate_to_pool never comes
    # Within the grace, PyTorch may still be about to end the route: still a capture.
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)
    assert pending(0) == MiB
    lib.pyalloc_empty_cache()
    assert reserved(1) >= 8 * MiB
    time.sleep(_C.cuda_route_heal_grace() + 0.1)
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)
    assert pending(0) == 0  # the deferred free completes
    lib.pyalloc_empty_cache()
    assert reserved(1) == 0  # and every device's cache is released again
    lines = said(capfd)
    assert len(lines) == 1 and "(0, 66) on device 0 was never ended" in lines[0], lines
    # The graph's reset releases the pool: the route goes, the pool with it.
    lib.pyalloc_free(g, 0, 0, None)
    hook("release_pool", (0, 66))
    lib.pyalloc_empty_cache()
    assert pools() == {}
    check()


def test_a_capture_retried_into_the_pool_of_a_healed_route_ends(fake, lib, capfd):
    """Regression: a healed route stayed in the list ahead of the retried capture's
    route into the same pool: its filter matched first, so the new route never saw
    its stream capture and could not heal, and the new capture's end closed the
    healed route instead, leaving a capture underway for good."""
    import time

    hook("begin_allocate_to_pool", (0, 68), [CAPTURE_STREAM])
    capture(43)
    g = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    capture(0)  # the capture fails: its route is never ended
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)  # seen done
    time.sleep(_C.cuda_route_heal_grace() + 0.1)
    lib.pyalloc_free(lib.pyalloc_malloc(512, 0, 0x10), 0, 0, None)  # and healed
    # The same graph captures again into the same pool, and this time ends.
    hook("begin_allocate_to_pool", (0, 68), [CAPTURE_STREAM])
    capture(44)
    h = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    capture(0)
    hook("end_allocate_to_pool", (0, 68))
    lib.pyalloc_free(lib.pyalloc_malloc(8 * MiB, 1, None), 0, 1, None)  # cached on device 1
    lib.pyalloc_empty_cache()
    assert reserved(1) == 0  # no capture counts as underway any more
    lines = said(capfd)
    assert len(lines) == 1 and "(0, 68) on device 0 was never ended" in lines[0], lines
    for p in (g, h):
        lib.pyalloc_free(p, 0, 0, None)
    hook("release_pool", (0, 68))
    hook("release_pool", (0, 68))
    lib.pyalloc_empty_cache()
    assert pools() == {}
    check()


def test_release_pool_ends_a_route_left_open(fake, lib, capfd):
    """A capture that failed before serving any allocation leaves a route no probe
    can see end; the pool's last release_pool ends it."""
    lib.pyalloc_free(lib.pyalloc_malloc(8 * MiB, 1, None), 0, 1, None)
    hook("begin_allocate_to_pool", (0, 67), [CAPTURE_STREAM])
    hook("end_allocate_to_pool", (0, 67))  # a graph captured into the pool
    hook("begin_allocate_to_pool", (0, 67), [CAPTURE_STREAM + 1])  # a second graph, same pool: fails
    hook("release_pool", (0, 67))  # one graph gone: the other's route may be a live capture
    lib.pyalloc_empty_cache()
    assert reserved(1) >= 8 * MiB
    hook("release_pool", (0, 67))  # the last use: no graph is left to end its route
    lib.pyalloc_empty_cache()
    assert reserved(1) == 0 and pools() == {}
    lines = said(capfd)
    assert len(lines) == 1 and "(0, 67) on device 0 was never ended" in lines[0], lines
    check()


def test_capture_marks_of_torch_2_13_count_as_a_capture(fake, lib):
    from bridge_api import OK, Api, BridgeApi

    api = BridgeApi()
    assert api.size >= ctypes.sizeof(Api), "the table has no mark_capture"
    lib.pyalloc_free(lib.pyalloc_malloc(8 * MiB, 1, None), 0, 1, None)  # cached on device 1
    assert api.mark_capture(0, 1) == OK  # markCaptureBegin(0)
    lib.pyalloc_empty_cache()
    assert reserved(1) >= 8 * MiB
    assert api.mark_capture(0, 0) == OK  # markCaptureEnd(0)
    assert api.mark_capture(0, 0) == OK  # an end without a begin is ignored
    lib.pyalloc_empty_cache()
    assert reserved(1) == 0


def test_graph_pool_and_general_frees_from_many_threads(fake, lib):
    # Frees find their pool under a shared lock and per-pool block sets.
    import random
    import threading

    hook("begin_allocate_to_pool", (0, 64), [CAPTURE_STREAM])
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            live = []
            for _ in range(400):
                if live and rng.random() < 0.5:
                    lib.pyalloc_free(live.pop(rng.randrange(len(live))), 0, 0, None)
                else:
                    stream = CAPTURE_STREAM if rng.random() < 0.5 else 0x10 + seed
                    live.append(lib.pyalloc_malloc(rng.choice([512, 4096, 65536]), 0, stream))
            for p in live:
                lib.pyalloc_free(p, 0, 0, None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hook("end_allocate_to_pool", (0, 64))
    assert not errors, errors
    assert allocated() == 0 and _C.cuda_pool_live_blocks(0, (0, 64)) == []
    check()
    hook("release_pool", (0, 64))
    assert pools() == {}


def test_pool_calls_errors(fake, lib):
    hook("begin_allocate_to_pool", (0, 4), [CAPTURE_STREAM])
    # A second route into a pool being recorded to (use_mem_pool on another
    # thread) is refused, as PyTorch's beginAllocateToPool refuses it.
    with pytest.raises(ValueError, match="already recording to mempool_id"):
        hook("begin_allocate_to_pool", (0, 4), [CAPTURE_STREAM + 1])
    assert _C._testing_pool("use_count", 0, (0, 4)) == 1
    p = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
    assert _C.cuda_pool_live_blocks(0, (0, 4)) == [p]
    hook("end_allocate_to_pool", (0, 4))
    hook("end_allocate_to_pool", (0, 4))  # once more: nothing more to do
    hook("end_allocate_to_pool", (9, 9))  # unknown pools are ignored by end and release
    hook("release_pool", (9, 9))
    lib.pyalloc_free(p, 0, 0, None)
    hook("release_pool", (0, 4))
    hook("release_pool", (0, 4))
    assert pools() == {}
    # As PyTorch's checkPoolLiveAllocations: a pool that does not exist is an error.
    with pytest.raises(ValueError, match="Could not find pool of id"):
        _C.cuda_pool_live_blocks(0, (0, 4))


def test_mempool_uses(fake, lib):
    # torch.cuda.MemPool: created with a use; use_mem_pool adds one per context.
    assert _C._testing_pool("create_or_incref", 0, (5, 0)) == 1
    hook("begin_allocate_to_pool", (5, 0), [0x99])
    p = lib.pyalloc_malloc(MiB, 0, 0x99)
    hook("end_allocate_to_pool", (5, 0))
    assert _C._testing_pool("release", 0, (5, 0)) == 1  # the context's use
    assert _C.cuda_pool_live_blocks(0, (5, 0)) == [p]
    lib.pyalloc_free(p, 0, 0, None)
    assert (5, 0) in pools()  # the MemPool itself still holds it
    assert _C._testing_pool("release", 0, (5, 0)) == 0
    assert pools() == {}


# -- buffers -----------------------------------------------------------------------------


def test_buffer_capsule_not_consumed_frees_its_buffer(fake):
    cap = _C.cuda_buffer(0, 3 * MiB, 0)
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 3 * MiB
    assert _C.cuda_stats(0, "general")["reserved_bytes.all.current"] == 0
    del cap
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 0


def test_buffer_pointers_are_known_to_the_hooks(fake, lib):
    torch = pytest.importorskip("torch")
    t = pyalloc.reserve_buffer(2 * MiB, device=0)
    size = ctypes.c_size_t(0)
    base = lib.pyalloc_base_alloc(t.data_ptr(), ctypes.byref(size))
    assert base <= t.data_ptr() < base + size.value
    lib.pyalloc_record_stream(t.data_ptr(), 0x42)  # honoured, not an error
    assert t.dtype == torch.uint8
    del t
    gc.collect()
    assert _C.cuda_stats(0, "buffers")["active_bytes.all.current"] in (0, 2 * MiB)


def test_once_pytorch_announces_captures_allocations_stop_asking(graph_pool):
    # With the graph-pool hooks registered (or the bridge), a capture always
    # begins with begin_allocate_to_pool: no allocation asks the driver about
    # its stream, so a capture pyalloc was not told of is not seen either.
    lib = graph_pool
    _C.cuda_set_told_of_captures(True)
    try:
        capture(9)
        a = lib.pyalloc_malloc(MiB, 0, CAPTURE_STREAM)
        lib.pyalloc_free(a, MiB, 0, CAPTURE_STREAM)
        assert _C.cuda_graph_memory(0) == (0, 0), "the stream was probed after all"
        assert allocated() == 0
    finally:
        capture(0)
        _C.cuda_set_told_of_captures(False)
    check()


# -- one out-of-memory error, counted once ------------------------------------------------


def hold_40_mib_elsewhere(lib, where):
    """40 MiB held by another pool of device 0 with no use left, which the
    general pool's out-of-memory retry gives back: the buffer pool's cache, or a
    released graph pool whose last block died (reclaimed later, never in the
    deleter). Each fake pool has the whole fake device to itself: the memory
    fraction, which caps all of a device's pools together, makes them compete."""
    if where == "buffers":
        buf = _C.cuda_buffer(0, 40 * MiB, 0)
        del buf  # cached in the buffer pool
    else:
        hook("begin_allocate_to_pool", (0, 7), [CAPTURE_STREAM])
        out = lib.pyalloc_malloc(40 * MiB, 0, CAPTURE_STREAM)
        hook("end_allocate_to_pool", (0, 7))
        hook("release_pool", (0, 7))
        lib.pyalloc_free(out, 0, 0, None)  # the last block: marked, its memory still held
        assert pools()[(0, 7)]["reserved_bytes"] >= 40 * MiB
    assert _C.cuda_device_stats(0)["reserved_bytes.all.current"] >= 40 * MiB


def oom_events(device=0):
    return [e for e in _C.cuda_history(device, "general") if e["action"] == "oom"]


@pytest.mark.parametrize("where", ["buffers", "graph_pool"])
def test_a_request_served_by_the_pools_retry_is_no_oom(fake, lib, where):
    """Regression: the general pool's first failure counted an OOM (and a
    rejection) and traced an `oom` event, though the retry after giving back the
    other pools' memory served the request: the caller saw no error."""
    _C.cuda_record_history(True, 1000)
    try:
        hold_40_mib_elsewhere(lib, where)
        lib.pyalloc_set_memory_fraction(0.75, 0)  # 48 MiB for all of device 0's pools
        p = lib.pyalloc_malloc(40 * MiB, 0, None)  # fits only once the others give back
        assert p
        s = _C.cuda_device_stats(0)
        assert (s["num_ooms"], s["num_oom_rejections"]) == (0, 0)
        assert oom_events() == []
        lib.pyalloc_free(p, 0, 0, None)
        check()
    finally:
        _C.cuda_record_history(False, 0)


@pytest.mark.parametrize("where", ["buffers", "graph_pool"])
def test_an_oom_after_the_pools_retry_counts_once(fake, lib, where):
    """Regression: refused, the other pools' memory given back, refused again:
    one error for the caller, counted (and traced) twice."""
    _C.cuda_record_history(True, 1000)
    try:
        hold_40_mib_elsewhere(lib, where)
        lib.pyalloc_set_memory_fraction(0.5, 0)  # 32 MiB for all of device 0's pools
        with pytest.raises(pyalloc.OutOfMemoryError, match="CUDA out of memory"):
            _C._testing_hook_malloc(40 * MiB, 0, 0)
        s = _C.cuda_device_stats(0)
        assert (s["num_ooms"], s["num_oom_rejections"]) == (1, 1)
        events = oom_events()
        assert len(events) == 1 and events[0]["size"] == 40 * MiB, events
        check()
    finally:
        _C.cuda_record_history(False, 0)
