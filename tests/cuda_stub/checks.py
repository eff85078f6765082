"""pyalloc's CUDA backend against the stand-in driver (libcuda_stub.c).

Run by test_cuda_backend_stub.py, one check a process (a device's pools are
made once per process, and a failed check would leave the next its state),
with LD_LIBRARY_PATH finding the stand-in as libcuda.so.1:

    checks.py PATH/TO/libcuda.so.1 [MODE...] CHECK...

runs each CHECK (a function below) in turn after the mode's set-up, and prints
OK when every one passed. MODE: none for the segment checks (check_*, and
relaxed_check_* or norelax_check_*); "vmm" (the stand-in reports virtual
memory management: pools map pages) for vmm_check_*; "fallback" (vmm asked
for where it cannot work) for fallback_check_*; "areas" (vmm, on the stand-in
without the relaxed capture mode) for areas_check_*; "capture" (vmm, with a
device's pools made during a capture; "big": a pool_size it cannot map then;
"error": a driver error mapping it; "access": the device refuses access to
its pages then) for capture_check_*. "norelax": the stand-in was built
without cuThreadExchangeStreamCaptureMode, so captures cannot grow the pool.
"""
import ctypes
import os
import sys

from pyalloc import _C
from stub import Stub

MiB = 1 << 20
c = ctypes


driver = c.CDLL(sys.argv[1])
stub = Stub.in_dll(driver, "stub")
driver.stub_context.restype = c.c_void_p
driver.stub_context.argtypes = [c.c_int]
driver.stub_current.restype = c.c_void_p
driver.cuCtxSetCurrent.argtypes = [c.c_void_p]
driver.stub_event_records_on.restype = c.c_int64
driver.stub_event_records_on.argtypes = [c.c_int]
RELAXED = "norelax" not in sys.argv[2:]

hooks = c.CDLL(_C.library_path())
hooks.pyalloc_free.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
hooks.pyalloc_record_stream.argtypes = [c.c_void_p, c.c_void_p]
hooks.pyalloc_empty_cache.restype = None
hooks.pyalloc_base_alloc.restype = c.c_void_p
hooks.pyalloc_base_alloc.argtypes = [c.c_void_p, c.POINTER(c.c_size_t)]
hooks.pyalloc_set_memory_fraction.argtypes = [c.c_double, c.c_int]


def malloc(size, device=0, stream=0):
    return _C._testing_hook_malloc(size, device, stream)


def free(ptr, device=0):
    hooks.pyalloc_free(ptr, 0, device, None)


def stats(device=0):
    return _C.cuda_stats(device)


def check_driver_loads():
    assert _C.cuda_check_driver() == 13000
    assert _C.cuda_device_count() == 2


def check_contexts():
    # No context on this thread: one is made current for the call, and none after.
    assert driver.stub_current() is None
    p = malloc(MiB, device=1)
    assert driver.stub_current() is None
    assert stub.used[1] >= 32 * MiB and stub.wrong_context == 0
    c.memset(p, 1, MiB)  # the stand-in's memory is host memory
    # Another device's context current: used for the call, then restored.
    driver.cuCtxSetCurrent(driver.stub_context(0))
    q = malloc(40 * MiB, device=1)  # grows device 1's pool: a cuMemAlloc
    assert driver.stub_current() == driver.stub_context(0)
    assert stub.used[1] >= 72 * MiB and stub.used[0] == 0
    free(p, device=1)
    free(q, device=0)  # a wrong device hint: the pointer's owner decides
    assert stats(1)["allocated_bytes.all.current"] == 0
    hooks.pyalloc_empty_cache()
    assert driver.stub_current() == driver.stub_context(0)
    assert stub.wrong_context == 0
    # Back to none: every entry point leaves the thread without a context.
    driver.cuCtxSetCurrent(None)
    p = malloc(MiB, 0, 0x1000)
    hooks.pyalloc_record_stream(p, 0x2000)
    free(p)
    free(malloc(MiB, 1, (1 << 32) | 0x1000))  # a stream of device 1
    hooks.pyalloc_empty_cache()
    stats(0), _C.cuda_config()
    assert driver.stub_current() is None
    # The steady state sets no context where the thread has the device's current.
    driver.cuCtxSetCurrent(driver.stub_context(0))
    free(malloc(MiB, 0, 0x1000))
    sets = stub.ctx_set
    for _ in range(20):
        free(malloc(MiB, 0, 0x1000))
    assert stub.ctx_set == sets, stub.ctx_set - sets
    driver.cuCtxSetCurrent(None)


def check_the_stand_in_refuses_what_the_driver_refuses():
    """The stand-in itself, called directly: what the driver refuses, it refuses
    (and counts), so that a core that breaks a rule fails here rather than on a
    GPU. Virtual memory: mapping over a live mapping, at an offset or an
    unaligned address, unmapping or freeing part of what was mapped or
    reserved; a handle released while mapped keeps its memory until unmapped.
    Captures: a forbidden call in global mode fails and invalidates the capture."""
    u64, size_t = c.c_uint64, c.c_size_t
    driver.cuMemAddressReserve.argtypes = [c.POINTER(u64), size_t, size_t, u64, u64]
    driver.cuMemAddressFree.argtypes = [u64, size_t]
    driver.cuMemCreate.argtypes = [c.POINTER(u64), size_t, c.c_void_p, u64]
    driver.cuMemRelease.argtypes = [u64]
    driver.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
    driver.cuMemUnmap.argtypes = [u64, size_t]
    driver.cuMemGetInfo_v2.argtypes = [c.POINTER(size_t), c.POINTER(size_t)]
    page, prop = 2 * MiB, (c.c_int * 2)(1, 0)
    driver.cuCtxSetCurrent(driver.stub_context(0))
    va, h, g = u64(), u64(), u64()
    assert driver.cuMemAddressReserve(c.byref(va), 4 * page, page, 0, 0) == 0
    assert va.value % page == 0, "reserved ranges are aligned to the page"
    assert driver.cuMemCreate(c.byref(h), page, prop, 0) == 0
    assert driver.cuMemCreate(c.byref(g), page, prop, 0) == 0
    assert driver.cuMemMap(va.value, page, 0, h.value, 0) == 0
    refused = [driver.cuMemMap(va.value, page, 0, g.value, 0),  # over a live mapping
               driver.cuMemMap(va.value + page, page, page, g.value, 0),  # at an offset
               driver.cuMemMap(va.value + page + 4096, page, 0, g.value, 0),  # unaligned
               driver.cuMemMap(va.value + 4 * page, page, 0, g.value, 0),  # outside the range
               driver.cuMemUnmap(va.value, page // 2),  # part of a mapping
               driver.cuMemUnmap(va.value, 2 * page),  # more than was mapped
               driver.cuMemAddressFree(va.value, 2 * page),  # part of the reservation
               driver.cuMemAddressFree(va.value, 4 * page)]  # a page still mapped there
    assert all(r != 0 for r in refused) and stub.vmm_refused == len(refused), (refused, stub.vmm_refused)
    used = stub.used[0]
    assert driver.cuMemRelease(h.value) == 0 and stub.used[0] == used, "freed while mapped"
    assert driver.cuMemUnmap(va.value, page) == 0 and stub.used[0] == used - page, "freed once unmapped"
    assert driver.cuMemRelease(g.value) == 0 and stub.used[0] == used - 2 * page
    assert driver.cuMemAddressFree(va.value, 4 * page) == 0
    stub.vmm_refused = 0
    # A call forbidden during a capture, in global mode: refused, the capture invalidated.
    free_bytes, total = size_t(), size_t()
    stub.capture_id, stub.capturing_stream = 61, 0x6100
    status = c.c_int()
    assert driver.cuStreamIsCapturing(c.c_void_p(0x6100), c.byref(status)) == 0 and status.value == 1
    assert driver.cuMemGetInfo_v2(c.byref(free_bytes), c.byref(total)) == 900  # STREAM_CAPTURE_UNSUPPORTED
    assert driver.cuStreamIsCapturing(c.c_void_p(0x6100), c.byref(status)) == 0 and status.value == 2
    assert stub.capture_invalidated == 1 and stub.forbidden_during_capture == 1
    stub.capturing_stream = 0
    driver.cuCtxSetCurrent(None)
    stub.capture_invalidated = stub.forbidden_during_capture = 0


def check_capture_info_uses_the_versioned_entry_point():
    # CUDA 13's headers map cuStreamGetCaptureInfo to a seven-argument _v3;
    # the plain symbol is another ABI. pyalloc asks for cuStreamGetCaptureInfo_v2.
    queries = stub.capture_queries
    free(malloc(MiB, 0, 0x1000))
    assert stub.capture_queries > queries
    assert stub.capture_info_v1 == 0


def check_events_are_recycled():
    s1, s2 = 0x1000, 0x2000
    created = stub.event_create
    recorded = stub.event_record
    for _ in range(50):
        # Each stream takes memory the other freed: an event each time.
        free(malloc(4 * MiB, 0, s1))
        free(malloc(4 * MiB, 0, s2))
    assert stub.event_record - recorded >= 50, stub.event_record - recorded
    assert stub.event_create - created <= 2, stub.event_create - created
    assert stub.event_destroy == 0
    _C.cuda_check_invariants(0)


def check_record_stream_waits_for_the_event():
    s1, s2 = 0x1000, 0x2000
    p = malloc(MiB, 0, s1)
    hooks.pyalloc_record_stream(p, s2)
    stub.events_pending = 1
    free(p)
    st = stats()
    assert st["active_bytes.all.current"] - st["allocated_bytes.all.current"] == MiB
    q = malloc(MiB, 0, s1)
    assert q != p
    stub.events_pending = 0
    free(q)
    free(malloc(512, 0, s1))  # the pending free completes on the way
    st = stats()
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"] == 0
    _C.cuda_check_invariants(0)


def pending(device=0):
    st = stats(device)
    return st["active_bytes.all.current"] - st["allocated_bytes.all.current"]


def check_capture_errors_mean_not_yet():
    # cuEventQuery refused because of some capture: not done, no error.
    p = malloc(MiB, 0, 0x1000)
    hooks.pyalloc_record_stream(p, 0x2000)
    stub.event_error = 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    free(p)
    free(malloc(512, 0, 0x1000))
    assert pending() == MiB
    free(malloc(512, 0, 0x1000))  # still no error to raise
    stub.event_error = 0
    free(malloc(512, 0, 0x1000))
    assert pending() == 0
    _C.cuda_check_invariants(0)


def check_record_stream_on_another_device():
    # A stream of device 1 used a block of device 0: its event is made in
    # device 1's context (an event and its stream share one), and completes.
    other = (1 << 32) | 0x2000
    for _ in range(3):
        p = malloc(MiB, 0, 0x1000)
        hooks.pyalloc_record_stream(p, other)
        free(p)
        free(malloc(512, 0, 0x1000))
        assert pending() == 0
    assert stub.stream_get_ctx >= 1
    assert stub.event_record_errors <= 1, stub.event_record_errors  # then the event stays there
    _C.cuda_check_invariants(0)


def check_record_stream_with_the_streams_device_records_there_at_once():
    # With the stream's device (the bridge's record_stream_on), the event is
    # made in that device's context at once, another device's default stream
    # (handle 0) included: no record in the block's own context first.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bridge_api import OWNER_POOLS, BridgeApi

    api = BridgeApi()
    on_device_0 = driver.stub_event_records_on(0)
    for stream in ((1 << 32) | 0x2000, 0):
        p = malloc(MiB, 0, 0x1000)
        assert api.record_stream_on(p, stream, 1, OWNER_POOLS) == 0, api.error()
        free(p)
        free(malloc(512, 0, 0x1000))
        assert pending() == 0
    assert stub.event_record_errors == 0 and stub.wrong_context == 0
    assert driver.stub_event_records_on(1) == 2 and driver.stub_event_records_on(0) == on_device_0
    # Its event recycled for device 0's own default stream goes to device 0:
    # the default stream's handle in device 1's context would be device 1's.
    p = malloc(MiB, 0, 0x1000)
    hooks.pyalloc_record_stream(p, None)
    free(p)
    assert driver.stub_event_records_on(1) == 2 and driver.stub_event_records_on(0) == on_device_0 + 1
    free(malloc(512, 0, 0x1000))
    assert pending() == 0
    _C.cuda_check_invariants(0)


def check_out_of_memory():
    try:
        malloc(1 << 30)
        raise AssertionError("1 GiB from a 256 MiB device")
    except RuntimeError as e:
        message = str(e)
    assert message.startswith("CUDA out of memory. Tried to allocate 1.00 GiB on device 0"), message
    assert "GPU 0 has a total capacity of 256.00 MiB" in message, message
    free(malloc(8 * MiB))  # the process goes on


MEMORY_CALLS = ("mem_alloc", "mem_alloc_refused", "mem_free", "mem_create", "mem_create_refused",
                "mem_release", "mem_map", "mem_map_refused", "mem_unmap", "mem_get_info")


def memory_calls():
    return {k: getattr(stub, k) for k in MEMORY_CALLS}


def calls_since(before):
    """The driver calls about memory made since `before`, by name (refusals apart)."""
    now = memory_calls()
    return {k: now[k] - before[k] for k in MEMORY_CALLS if now[k] != before[k]}


def fails_at_once(size):
    """A request pyalloc can tell is impossible: refused with no memory taken or given back."""
    reserved = stats()["reserved_bytes.all.current"]
    before = memory_calls()
    try:
        malloc(size)
        raise AssertionError(f"{size} bytes were allocated")
    except RuntimeError as e:
        assert str(e).startswith("CUDA out of memory."), str(e)
    made = calls_since(before)
    # Questions about free memory (one to decide, two for the message): nothing
    # allocated, mapped, freed or unmapped.
    assert set(made) <= {"mem_get_info"} and made.get("mem_get_info", 0) <= 3, made
    assert stats()["reserved_bytes.all.current"] == reserved


OTHER_PROCESS = 64 * MiB


def impossible_and_possible_requests(cached):
    """With `cached` bytes of free memory in the pool and another process holding
    OTHER_PROCESS bytes of the device: requests no release could serve fail at
    once; one that needs the cache given back is served with one retry."""
    stub.used[0] += OTHER_PROCESS
    try:
        st = stats()
        room = stub.capacity - stub.used[0]
        give_back = st["reserved_bytes.all.current"] - st["allocated_bytes.all.current"]
        fails_at_once(stub.capacity + MiB)  # more than the device holds
        fails_at_once(room + give_back + 2 * MiB)  # more than free + everything cached
        before = memory_calls()
        retries = st["num_alloc_retries"]
        size = room + cached - 4 * MiB
        p = malloc(size)
        made = calls_since(before)
        assert stats()["num_alloc_retries"] == retries + 1
        assert made.get("mem_get_info", 0) <= 2, made
        assert made.get("mem_alloc_refused", 0) + made.get("mem_create_refused", 0) == 0, made
        free(p)
        return made, size
    finally:
        stub.used[0] -= OTHER_PROCESS


def check_impossible_requests_fail_at_once():
    keep = malloc(8 * MiB)  # in the pool_size segment
    free(malloc(120 * MiB))  # a cached segment of its own
    made, _ = impossible_and_possible_requests(120 * MiB)
    # The cached segment freed, the request's segment allocated: nothing more.
    assert made.get("mem_free") == 1 and made.get("mem_alloc") == 1, made
    free(keep)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


# Every driver call about memory the stand-in counts, as the core's num_driver_calls counts them.
DRIVER_CALLS = ("mem_alloc", "mem_alloc_refused", "mem_free", "mem_create", "mem_create_refused",
                "mem_release", "mem_map", "mem_map_refused", "mem_unmap", "mem_set_access",
                "mem_address_reserve", "mem_failed")


def driver_calls():
    return sum(getattr(stub, k) for k in DRIVER_CALLS)


def refused(size, stream=0, device=0, says="CUDA out of memory.", **knobs):
    """malloc(size) with the stand-in's `knobs` set for the call, which must fail
    saying `says`; the message."""
    for name, value in knobs.items():
        setattr(stub, name, value)
    try:
        malloc(size, device, stream)
    except RuntimeError as e:
        message = str(e)
    else:
        raise AssertionError(f"{size} bytes allocated with {knobs}")
    finally:
        for name in knobs:
            setattr(stub, name, 0)
    assert says in message, message
    return message


def counted_as_made(work, device=0, some=True):
    """Runs work(): the core's num_driver_calls (every pool of the device) rose by
    the calls the stand-in saw (some, unless told otherwise)."""
    before, counted = driver_calls(), _C.cuda_device_stats(device)["num_driver_calls"]
    work()
    made, told = driver_calls() - before, _C.cuda_device_stats(device)["num_driver_calls"] - counted
    assert made == told and (made > 0 or not some), (made, told)


def check_the_core_counts_the_driver_calls_it_makes():
    def work():
        hooks.pyalloc_empty_cache()
        ptrs = [malloc(size) for size in (3 * MiB, 40 * MiB, 5 * MiB, 64 * MiB + 512, 7 * MiB)]
        for p in ptrs[::2]:
            free(p)
        hooks.pyalloc_empty_cache()
        for p in ptrs[1::2]:
            free(p)
        free(malloc(120 * MiB))  # cached
        stub.used[0] += OTHER_PROCESS
        try:
            retries = stats()["num_alloc_retries"]
            free(malloc(150 * MiB))  # only with the cache given back
            assert stats()["num_alloc_retries"] == retries + 1
        finally:
            stub.used[0] -= OTHER_PROCESS
        hooks.pyalloc_empty_cache()
    counted_as_made(work)


def check_a_repeating_loop_allocates_nothing_after_its_first_pass():
    hooks.pyalloc_empty_cache()
    for i in range(6):
        p = malloc(20 * MiB)
        q = malloc(30 * MiB)
        free(p)
        s = malloc(35 * MiB)
        free(q)
        free(s)
        if i == 0:
            first = memory_calls()
    assert calls_since(first) == {}, calls_since(first)
    _C.cuda_check_invariants(0)


def check_other_driver_errors_are_not_oom():
    message = ""

    def failing():  # the failed cuMemAlloc counted too
        nonlocal message
        message = refused(46 * MiB, says="cuMemAlloc", fail_alloc_size=46 * MiB)
    counted_as_made(failing)
    assert "cuMemAlloc failed: CUDA_ERROR_STUB_FAILURE (999)" in message, message
    assert "out of memory" not in message
    _C.cuda_check_invariants(0)
    # The failed reservation gave its bytes back to the device's budget: under a
    # cap with room for 46 MiB and a little more, 46 MiB can still be had.
    hooks.pyalloc_empty_cache()
    reserved = stats()["reserved_bytes.all.current"]
    hooks.pyalloc_set_memory_fraction((reserved + 54 * MiB) / stub.capacity, 0)
    try:
        free(malloc(46 * MiB))
    finally:
        hooks.pyalloc_set_memory_fraction(1.0, 0)
    _C.cuda_check_invariants(0)


def check_empty_cache_frees_segments():
    free(malloc(100 * MiB))
    before = stub.mem_free
    hooks.pyalloc_empty_cache()
    assert stub.mem_free > before
    assert stub.used[0] == 32 * MiB  # pool_size stays reserved
    assert stats()["reserved_bytes.all.current"] == 32 * MiB


def check_capture():
    capture_stream, other = 0x5000, 0x6000
    eager = malloc(MiB, 0, other)
    hooks.pyalloc_record_stream(eager, capture_stream)
    allocs = stub.mem_alloc
    stub.capture_id, stub.capturing_stream = 77, capture_stream
    stub.forbidden_during_capture = stub.relaxed_during_capture = 0
    a = malloc(2 * MiB, 0, capture_stream)  # served from pool_size
    free(a)
    assert malloc(2 * MiB, 0, capture_stream) == a  # reused within the capture
    b = malloc(4096, 0, 0)  # eager work during the capture, from reserved memory
    if RELAXED:
        # torch.cuda.graph() empties the cache before capturing: captures must grow.
        exchanges = stub.mode_exchanges
        g = malloc(64 * MiB, 0, capture_stream)
        assert stub.mem_alloc == allocs + 1 and stub.relaxed_during_capture == 1
        # Relaxed for the call only: the thread's mode is back to global.
        assert stub.mode_exchanges == exchanges + 2 and driver.stub_thread_mode() == 0
    else:
        try:
            malloc(64 * MiB, 0, capture_stream)
            raise AssertionError("the pool grew during a capture")
        except RuntimeError as e:
            assert "CUDA graph capture is underway" in str(e) and "pool_size" in str(e), str(e)
        assert stub.mem_alloc == allocs
    free(eager)  # used by the capturing stream: its event must wait for the capture
    hooks.pyalloc_empty_cache()  # nothing may be released during the capture
    free(b)
    assert stub.forbidden_during_capture == 0, stub.forbidden_during_capture
    recorded = stub.event_record
    stub.capturing_stream = 0
    free(malloc(512, 0, other))  # after the capture the deferred event is recorded
    free(malloc(512, 0, other))
    assert stub.event_record > recorded
    held = (2, 66 * MiB) if RELAXED else (1, 2 * MiB)
    assert _C.cuda_graph_memory(0) == held
    assert _C.cuda_release_graph_memory(0) == 0  # `a` is still live
    free(a)
    if RELAXED:
        free(g)
    _C.cuda_check_invariants(0)


def pool_hook(name, pool, streams=()):
    _C._testing_pool_hook(name, 0, pool, list(streams))


def relaxed_check_graph_pool_grows_and_returns_its_memory():
    cap, other = 0x5100, 0x6100
    hooks.pyalloc_empty_cache()
    free(malloc(MiB, 0, other))  # cached on `other`
    pool_hook("begin_allocate_to_pool", (0, 7), [cap])
    # PyTorch now says when captures begin: plain allocations ask the driver nothing
    # (after one, which may still look at streams an earlier capture left remembered).
    free(malloc(MiB, 0, other))
    queries = stub.capture_queries
    for _ in range(10):
        free(malloc(MiB, 0, other))
    assert stub.capture_queries == queries
    stub.capture_id, stub.capturing_stream = 90, cap
    stub.forbidden_during_capture = stub.relaxed_during_capture = 0
    big = (stub.capacity - stub.used[0]) // MiB * MiB - 8 * MiB
    p = malloc(big, 0, cap)  # the graph pool grows during the capture
    assert stub.relaxed_during_capture == 1 and driver.stub_thread_mode() == 0
    pool_hook("end_allocate_to_pool", (0, 7))
    free(p)  # back to the graph pool: the graph still uses it
    pool_hook("release_pool", (0, 7))  # the graph dies while another capture runs
    hooks.pyalloc_empty_cache()
    assert stub.forbidden_during_capture == 0
    assert [x["id"] for x in _C.cuda_graph_pools(0)] == [(0, 7)]
    stub.capturing_stream = 0
    # Eager work needing the pool's memory gets it: the released pool is reclaimed.
    freed = stub.mem_free
    q = malloc(big, 0, other)
    assert stub.mem_free > freed and _C.cuda_graph_pools(0) == []
    free(q)
    assert stub.wrong_context == 0
    _C.cuda_check_invariants(0)


WINDOW_CALLS = ("event_query", "event_sync", "event_record", "mem_free", "mem_unmap", "mem_release",
                "mem_get_info")


def window_calls():
    return {k: getattr(stub, k) for k in WINDOW_CALLS}


def window_calls_since(before):
    now = window_calls()
    return {k: now[k] - before[k] for k in WINDOW_CALLS if now[k] != before[k]}


def check_an_open_route_is_a_capture_underway():
    """Regression: PyTorch routes a graph's pool (begin_allocate_to_pool) before
    cudaStreamBeginCapture, and ends the route after the capture ends. Anywhere in
    between, another thread's event query, cuMemFree or unmap invalidates the
    capture in the default (global) mode; pyalloc made them until a stream was
    seen capturing."""
    import threading

    cap, s1, s2 = 0x5200, 0x1000, 0x2000
    hooks.pyalloc_empty_cache()
    free(malloc(40 * MiB, device=1))  # cached on device 1
    p = malloc(MiB, 0, s1)
    hooks.pyalloc_record_stream(p, s2)

    def eager_work(first):
        if first:
            free(p)  # waits for s2: an event to record and ask about
        free(malloc(512, 0, s1))
        hooks.pyalloc_empty_cache()
        hooks.pyalloc_set_memory_fraction(1.0, 0)

    def on_another_thread(first=False):
        t = threading.Thread(target=eager_work, args=(first,))
        t.start()
        t.join()

    pool_hook("begin_allocate_to_pool", (0, 12), [cap])
    before = window_calls()
    on_another_thread(first=True)  # routed, not yet capturing
    stub.capture_id, stub.capturing_stream = 91, cap
    stub.forbidden_during_capture = 0
    if RELAXED:
        g = malloc(2 * MiB, 0, cap)  # into the graph pool
    on_another_thread()
    stub.capturing_stream = 0  # cudaStreamEndCapture; the route ends just after
    on_another_thread()
    assert window_calls_since(before) == {}, window_calls_since(before)
    assert stub.forbidden_during_capture == 0
    assert pending() == MiB
    pool_hook("end_allocate_to_pool", (0, 12))
    free(malloc(512, 0, s1))  # the deferred event is recorded and found done
    assert pending() == 0
    freed = stub.mem_free
    hooks.pyalloc_empty_cache()
    assert stub.mem_free > freed  # device 1's cache
    if RELAXED:
        free(g)
    pool_hook("release_pool", (0, 12))
    hooks.pyalloc_empty_cache()
    assert _C.cuda_graph_pools(0) == []
    _C.cuda_check_invariants(0)


def declaring_a_capture_waits_for_calls_under_way(declare, end, pause="pause_mem_free", work=None):
    """A pool decides under its own lock whether it may release memory, and
    PyTorch begins the capture as soon as the declaration (`declare`: a graph
    pool's route, or torch 2.13's capture mark) returns. Another thread's
    `work` that had decided to make a call CUDA's global capture mode forbids
    (from any thread, while any stream is capturing) before the declaration
    must not go on making it into the capture: the declaration waits for it.
    The stand-in pauses inside the call named by `pause`. By default the work
    is an empty_cache() freeing two cached segments (cuMemFree)."""
    import threading
    import time

    cap = 0x5400
    hooks.pyalloc_empty_cache()
    ptrs = [malloc(40 * MiB), malloc(50 * MiB)]
    for p in ptrs:
        free(p)  # two segments cached
    freed = stub.mem_free
    stub.forbidden_during_capture = 0
    setattr(stub, pause, 1)
    working = threading.Thread(target=work or hooks.pyalloc_empty_cache, daemon=True)
    working.start()
    deadline = time.monotonic() + 30
    while not stub.paused:  # inside the call
        assert time.monotonic() < deadline, f"the work never reached the call ({pause})"
        time.sleep(0.001)
    began = threading.Event()

    def capture_begins():
        declare(cap)
        stub.capture_id, stub.capturing_stream = 92, cap  # cudaStreamBeginCapture
        began.set()

    capturing = threading.Thread(target=capture_begins, daemon=True)
    capturing.start()
    time.sleep(0.2)
    declared_early = began.is_set()
    stub.paused = 0
    working.join(30)
    capturing.join(30)
    assert not working.is_alive() and not capturing.is_alive(), "a thread is stuck"
    stub.capturing_stream = 0  # cudaStreamEndCapture
    end()
    assert stub.forbidden_during_capture == 0, stub.forbidden_during_capture
    assert not declared_early, "the capture was declared while a call was under way"
    if work is None:
        assert stub.mem_free == freed + 2  # both segments, before the capture began
    hooks.pyalloc_empty_cache()
    assert _C.cuda_graph_pools(0) == []
    _C.cuda_check_invariants(0)


def end_route():
    pool_hook("end_allocate_to_pool", (0, 16))
    pool_hook("release_pool", (0, 16))


def open_route(cap):
    pool_hook("begin_allocate_to_pool", (0, 16), [cap])


def bridge_api():
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bridge_api import OK, BridgeApi  # tests/bridge_api.py

    return OK, BridgeApi()


def check_opening_a_route_waits_for_releases_under_way():
    declaring_a_capture_waits_for_calls_under_way(open_route, end_route)


def check_marking_a_capture_waits_for_releases_under_way():
    OK, api = bridge_api()

    def mark(begin):
        assert api.mark_capture(0, begin) == OK  # torch 2.13's markCaptureBegin / End

    declaring_a_capture_waits_for_calls_under_way(lambda cap: mark(1), lambda: mark(0))


def check_opening_a_route_waits_for_a_device_query_under_way():
    """cacheInfo (cuDNN's benchmark asks it) reads the device's free memory
    outside every pool's lock."""
    OK, api = bridge_api()
    largest = c.c_uint64(0)

    def cache_info():
        assert api.cache_info(0, c.byref(largest)) == OK

    declaring_a_capture_waits_for_calls_under_way(open_route, end_route, "pause_mem_get_info", cache_info)
    assert largest.value > 0


def captures_beside_busy_threads(seconds=1.5):
    """Stress: three threads allocate, free, share blocks between streams and
    empty the cache while a fourth captures graph after graph. Nothing CUDA's
    global mode forbids may reach the driver between a capture's declaration
    and its end, whatever the interleaving."""
    import random
    import threading
    import time

    hooks.pyalloc_empty_cache()
    stub.forbidden_during_capture = 0
    stop = threading.Event()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        streams = (0x1000, 0x2000)
        live = []
        try:
            # The stand-in never reuses a handle's id (65535 at most): a bound.
            while not stop.is_set() and stub.mem_create < 40000:
                op = rng.random()
                if (op < 0.5 or not live) and len(live) < 6:
                    try:
                        live.append(malloc(int(2 ** rng.uniform(9, 25)), 0, rng.choice(streams)))
                    except RuntimeError as e:
                        assert "out of memory" in str(e).lower(), str(e)
                elif op < 0.85 or len(live) >= 6:
                    free(live.pop(rng.randrange(len(live))))
                elif op < 0.95:
                    hooks.pyalloc_record_stream(rng.choice(live), rng.choice(streams))
                else:
                    hooks.pyalloc_empty_cache()
            for p in live:
                free(p)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def capturer():
        cap = 0x5700
        n = 0
        try:
            while not stop.is_set():
                n += 1
                pool = (0, 100 + n)
                pool_hook("begin_allocate_to_pool", pool, [cap])
                stub.capture_id, stub.capturing_stream = 200 + n, cap
                for _ in range(4):
                    try:  # the workers may hold the device: nothing is released to make room
                        free(malloc(int(2 ** random.uniform(9, 23)), 0, cap))
                    except RuntimeError as e:
                        assert "out of memory" in str(e).lower(), str(e)
                time.sleep(0.003)
                stub.capturing_stream = 0
                pool_hook("end_allocate_to_pool", pool)
                pool_hook("release_pool", pool)
                time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001
            stub.capturing_stream = 0
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
    threads.append(threading.Thread(target=capturer, daemon=True))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    assert stub.forbidden_during_capture == 0, stub.forbidden_during_capture
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def relaxed_check_a_device_opened_during_a_capture_gives_its_range_back():
    """Regression: a device's pools first opened while another thread captures
    retained its context, asked its granularity and reserved its virtual range
    in CUDA's global capture mode, and where no page could be mapped then, gave
    the range back (cuMemAddressFree) in it too: each call invalidates the
    capture (the stand-in refuses them, as the driver does). They run in
    relaxed mode now, as NCCL makes its cuMem* calls; the pool serves the
    request from a plain segment."""
    stub.vmm = 1
    _C.cuda_configure("strategy:vmm,pool_size:0")
    cap, s1 = 0x5a00, (1 << 32) | 0x1000
    free(malloc(MiB))  # device 0's pools, before the capture
    pool_hook("begin_allocate_to_pool", (0, 19), [cap])
    stub.capture_id, stub.capturing_stream = 95, cap
    stub.forbidden_during_capture = stub.relaxed_during_capture = 0
    reserves, frees, allocs = stub.mem_address_reserve, stub.mem_address_free, stub.mem_alloc
    stub.fail_create_size = 2 * MiB  # device 1 makes no page during the capture
    try:
        p = malloc(3 * MiB, 1, s1)  # device 1's pools open now
    finally:
        stub.fail_create_size = 0
    c.memset(p, 7, 3 * MiB)
    assert stub.mem_address_reserve > reserves and stub.mem_address_free > frees, (
        stub.mem_address_reserve - reserves, stub.mem_address_free - frees)
    assert stub.mem_alloc == allocs + 1, "a plain segment serves it"
    assert stub.forbidden_during_capture == 0 and stub.capture_invalidated == 0, stub.forbidden_during_capture
    assert stub.relaxed_during_capture > 0 and driver.stub_thread_mode() == 0
    stub.capturing_stream = 0
    pool_hook("end_allocate_to_pool", (0, 19))
    pool_hook("release_pool", (0, 19))
    free(p, device=1)
    _C.cuda_check_invariants(1)


def relaxed_check_a_budget_refusal_is_counted_as_no_call():
    """A graph pool refused by the device's budget (the memory fraction) during
    a capture, when the device's free memory is not asked: no cuMemAlloc is
    made, and none is counted (two were)."""
    hooks.pyalloc_empty_cache()
    hooks.pyalloc_set_memory_fraction(32 / 256, 0)  # 32 MiB for every pool of device 0
    held = malloc(24 * MiB)
    cap = 0x5800
    pool_hook("begin_allocate_to_pool", (0, 21), [cap])
    stub.capture_id, stub.capturing_stream = 81, cap
    stub.forbidden_during_capture = 0

    try:
        counted_as_made(lambda: refused(16 * MiB, cap), some=False)
        assert stub.forbidden_during_capture == 0
    finally:
        stub.capturing_stream = 0
        pool_hook("end_allocate_to_pool", (0, 21))
        pool_hook("release_pool", (0, 21))
        free(held)
        hooks.pyalloc_set_memory_fraction(1.0, 0)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def relaxed_check_captures_beside_busy_threads():
    captures_beside_busy_threads()


def relaxed_check_a_route_left_open_heals_by_probing_its_stream():
    """Regression: torch 2.x ends no route when cudaStreamEndCapture fails; the
    route's capture stream, asked with cuStreamGetCaptureInfo, is found done, and
    after the grace nothing counts as a capture underway any more."""
    import time

    cap, s1, s2 = 0x5400, 0x1000, 0x2000
    hooks.pyalloc_empty_cache()
    p = malloc(MiB, 0, s1)
    hooks.pyalloc_record_stream(p, s2)
    pool_hook("begin_allocate_to_pool", (0, 15), [cap])
    stub.capture_id, stub.capturing_stream = 92, cap
    g = malloc(2 * MiB, 0, cap)  # into the graph pool, its stream seen capturing
    free(p)
    stub.capturing_stream = 0  # the capture is over; end_allocate_to_pool never comes
    free(malloc(512, 0, s1))
    assert pending() == MiB
    time.sleep(_C.cuda_route_heal_grace() + 0.1)
    free(malloc(512, 0, s1))  # the route heals; the deferred event is asked about
    assert pending() == 0
    free(g)
    pool_hook("release_pool", (0, 15))  # the graph's reset: the route and the pool go
    hooks.pyalloc_empty_cache()
    assert _C.cuda_graph_pools(0) == []
    _C.cuda_check_invariants(0)


def relaxed_check_last_free_of_a_released_graph_pool_does_not_sync():
    """Regression: the last free of a released graph pool waited for its events
    (cuEventSynchronize) and cuMemFree'd its segments inside the tensor's
    deleter; it is given back at empty_cache or on the out-of-memory path."""
    pool_hook("begin_allocate_to_pool", (0, 13), [0x5300])
    p = malloc(4 * MiB, 0, 0x5300)
    q = malloc(MiB, 0, 0x5300)
    hooks.pyalloc_record_stream(p, 0x5301)  # its free needs an event
    pool_hook("end_allocate_to_pool", (0, 13))
    pool_hook("release_pool", (0, 13))  # the graph is gone, its outputs live on
    free(q)
    before = window_calls()
    free(p)  # the pool's last live block, in a deleter
    made = window_calls_since(before)
    assert not {"event_sync", "event_query", "mem_free"} & set(made), made
    assert [x["id"] for x in _C.cuda_graph_pools(0)] == [(0, 13)]
    hooks.pyalloc_empty_cache()
    assert stub.mem_free > before["mem_free"] and _C.cuda_graph_pools(0) == []
    # And on the out-of-memory path: eager work needing the pool's memory gets it.
    pool_hook("begin_allocate_to_pool", (0, 14), [0x5300])
    hooks.pyalloc_empty_cache()
    p = malloc(100 * MiB, 0, 0x5300)
    pool_hook("end_allocate_to_pool", (0, 14))
    pool_hook("release_pool", (0, 14))
    free(p)
    assert [x["id"] for x in _C.cuda_graph_pools(0)] == [(0, 14)]
    room = stub.capacity - stub.used[0]
    q = malloc(room + 64 * MiB, 0, 0x1000)
    assert _C.cuda_graph_pools(0) == []
    free(q)
    _C.cuda_check_invariants(0)


def check_failed_event_keeps_the_block_and_raises_once():
    p = malloc(MiB, 0, 0x1000)
    hooks.pyalloc_record_stream(p, 0x2000)
    stub.event_error = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: a kernel failed
    free(p)
    free(malloc(512, 0, 0x1000))  # the query fails here
    assert pending() == MiB
    queries = stub.event_query
    try:
        malloc(512, 0, 0x1000)
        raise AssertionError("the failed event was not raised")
    except RuntimeError as e:
        message = str(e)
    assert "cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)" in message, message
    assert "device 0" in message, message
    stub.event_error = 0  # even if the device recovers, the block stays out of use
    for _ in range(5):
        free(malloc(512, 0, 0x1000))  # raised once; not asked again
    assert pending() == MiB
    assert stub.event_query == queries
    assert malloc(MiB, 0, 0x1000) != p
    _C.cuda_check_invariants(0)


def check_gone_streams_are_not_probed_again():
    # A block waiting for its event: each allocation asks whether a capture is underway.
    waiting = pending()
    p = malloc(MiB, 0, 0x1000)
    hooks.pyalloc_record_stream(p, 0x2000)
    stub.events_pending = 1
    free(p)
    gone = 0x7000
    stub.capture_id, stub.capturing_stream = 79, gone
    a = malloc(MiB, 0, gone)  # seen capturing: remembered
    stub.capturing_stream = 0
    stub.destroyed_stream = gone  # destroyed without the capture ending
    free(malloc(512, 0, 0x1000))
    assert stub.destroyed_queries == 1
    for _ in range(10):
        free(malloc(512, 0, 0x1000))
    assert stub.destroyed_queries == 1
    stub.destroyed_stream = 0
    stub.events_pending = 0
    free(a)
    free(malloc(512, 0, 0x1000))
    assert pending() == waiting
    _C.cuda_release_graph_memory(0)


def check_a_destroyed_streams_blocks_come_back_after_a_sync_and_raise_nothing():
    # Regression (issue 53, item 4): a stream its library destroyed
    # (torch.cuda.ExternalStream) makes cuEventRecord fail. That failed the
    # event as a failed kernel would: the next allocation raised, blaming
    # one, and the blocks freed on the stream were never reused. Its last
    # work may still run: the blocks wait for the context's synchronization
    # (empty_cache, the out-of-memory path), then serve any stream.
    gone = 0x7100
    keep = malloc(2 * MiB, 0, gone)  # its segment stays
    p = malloc(4 * MiB, 0, gone)
    free(p)  # work queued on `gone` may still use p
    stub.destroyed_stream = gone
    try:
        q = malloc(4 * MiB, 0, 0x1000)  # the event on `gone` cannot be recorded
        assert q != p  # nothing proves yet that `gone`'s last work is over
        free(malloc(512, 0, 0x1000))  # nothing to raise
        free(q)
        hooks.pyalloc_empty_cache()  # waits for the device's work, `gone`'s with it
        r = malloc(4 * MiB, 0, 0x1000)
        assert r == p
        free(r)
        free(keep)
    finally:
        stub.destroyed_stream = 0
    _C.cuda_check_invariants(0)


def check_base_alloc():
    p = malloc(3 * MiB)
    size = c.c_size_t(0)
    base = hooks.pyalloc_base_alloc(p + 10, c.byref(size))
    assert base <= p < base + size.value and size.value >= 3 * MiB
    free(p)


def vmm_check_pages_are_mapped_on_demand():
    assert _C.cuda_check_driver() == 13000
    p = malloc(5 * MiB)
    q = malloc(5 * MiB)
    assert stub.mem_alloc == 0  # no cuMemAlloc: pages are mapped
    # On to the next boundary of expandable segments' 20 MiB pages.
    assert stub.mem_map >= 5 and stub.mapped[0] == stats()["reserved_bytes.all.current"] == 20 * MiB
    c.memset(p, 7, 5 * MiB)
    c.memset(q, 8, 5 * MiB)
    assert c.string_at(p, 5 * MiB) == b"\x07" * (5 * MiB)
    free(p)
    free(q)
    hooks.pyalloc_empty_cache()
    assert stub.mapped[0] == 0 and stub.mem_release == stub.mem_create
    assert stats()["reserved_bytes.all.current"] == 0
    assert stub.wrong_context == 0
    _C.cuda_check_invariants(0)


def vmm_check_a_destroyed_streams_pages_are_unmapped_after_a_sync():
    # Regression (issue 53, item 4): under vmm, the pages of blocks freed on
    # a stream its library destroyed were never unmapped (their event failed).
    gone = 0x7100
    p = malloc(5 * MiB, 0, gone)
    free(p)
    stub.destroyed_stream = gone
    try:
        free(malloc(5 * MiB, 0, 0x1000))  # the event on `gone` cannot be recorded
        hooks.pyalloc_empty_cache()  # waits for the device's work, `gone`'s with it
        assert stub.mapped[0] == 0 and stats()["reserved_bytes.all.current"] == 0
        free(malloc(512, 0, 0x1000))  # nothing to raise
    finally:
        stub.destroyed_stream = 0
    _C.cuda_check_invariants(0)


def vmm_check_base_alloc_names_the_handles_under_the_block():
    """Regression: getBaseAllocation (set_base_alloc_fn) answered the whole virtual
    range under vmm, four times the device and mostly unmapped. Now the handles
    under the block holding the pointer: mapped, and as long as the block lives."""
    p = malloc(5 * MiB)
    q = malloc(30 * MiB)
    size = c.c_size_t(0)
    for ptr, n in ((p, 5 * MiB), (q, 30 * MiB)):
        base = hooks.pyalloc_base_alloc(ptr + 100, c.byref(size))
        assert base <= ptr and ptr + n <= base + size.value, (hex(ptr), hex(base), size.value)
        assert size.value <= stub.mapped[0] == stats()["reserved_bytes.all.current"]
        c.memset(base, 3, size.value)  # the stand-in's mapped pages: every byte usable
    far = q + stub.capacity + 64 * MiB  # inside the reserved range, never mapped
    size.value = 7
    assert hooks.pyalloc_base_alloc(far, c.byref(size)) == far and size.value == 7
    free(p)
    free(q)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_peers_may_access_the_pages():
    p = malloc(6 * MiB)  # device 0's pages: device 1 may access them too
    assert stub.access_count == 2 and stub.access_mask == 0b11, (stub.access_count, stub.access_mask)
    free(p)
    assert _C.cuda_config()["strategy"] == "vmm"
    # A driver that refuses peer mappings: the device alone, said on stderr
    # once. Device 1 opens now: its trial mapping's calls are counted too.
    stub.refuse_peers = 1
    q = None

    def opening():
        nonlocal q
        q = malloc(6 * MiB, device=1)
    counted_as_made(opening, device=1)
    assert stub.access_count == 1 and stub.access_mask == 0b10
    c.memset(q, 3, 6 * MiB)
    free(q)
    stub.refuse_peers = 0
    r = malloc(40 * MiB, device=1)
    assert stub.access_count == 1  # not asked again
    free(r)
    info = _C.cuda_describe_device(0)
    assert info["peers"] == [1] and info["vmm"] and info["vmm_granularity"] == 2 * MiB, info
    _C.cuda_check_invariants(1)


def vmm_check_holes_back_a_large_allocation():
    hooks.pyalloc_set_memory_fraction(64 / 256, 0)  # cap the pool at 64 MiB
    ptrs = [malloc(4 * MiB) for _ in range(16)]
    for p in ptrs[::2]:
        free(p)
    before, retries = memory_calls(), stats()["num_alloc_retries"]
    big = malloc(24 * MiB)  # only by moving pages out of the 4 MiB holes
    assert stats()["num_alloc_retries"] == retries  # no out-of-memory retry needed for it
    assert stub.mapped[0] <= 64 * MiB
    # The handles move: unmapped from the holes and mapped again under the
    # request, with no memory given back to the device and taken again.
    made = calls_since(before)
    assert made.get("mem_create", 0) == 0 and made["mem_map"] > 0, made
    assert made["mem_map"] + made.get("mem_release", 0) == made["mem_unmap"], made
    assert stub.bad_handle == 0
    free(big)
    for p in ptrs[1::2]:
        free(p)
    hooks.pyalloc_set_memory_fraction(1.0, 0)
    _C.cuda_check_invariants(0)


def vmm_check_a_failed_move_keeps_no_handle():
    """cuMemMap failing for a handle moving out of a hole: the request fails with
    the driver's error, every handle moved is released once (none kept, none
    twice), and the pool serves the request once the driver maps again."""
    hooks.pyalloc_empty_cache()
    hooks.pyalloc_set_memory_fraction(64 / 256, 0)
    ptrs = [malloc(4 * MiB) for _ in range(16)]
    for p in ptrs[::2]:
        free(p)
    held = stub.used[0] - stub.mapped[0]  # memory of handles mapped nowhere

    # The failed cuMemMap is counted too.
    counted_as_made(lambda: refused(24 * MiB, says="cuMemMap", fail_remap=1))
    assert stub.used[0] - stub.mapped[0] == held and stub.bad_handle == 0
    assert stats()["reserved_bytes.all.current"] <= 64 * MiB
    _C.cuda_check_invariants(0)
    big = malloc(24 * MiB)
    c.memset(big, 3, 24 * MiB)
    free(big)
    for p in ptrs[1::2]:
        free(p)
    hooks.pyalloc_set_memory_fraction(1.0, 0)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_an_out_of_memory_retry_maps_again_the_handles_it_unmaps():
    """The retry gives back everything cached, as PyTorch's does; the handles it
    unmaps are mapped again for the request, not released and created anew, and
    the ones it has no use for are released."""
    hooks.pyalloc_empty_cache()
    hooks.pyalloc_set_memory_fraction(16 / 256, 0)  # a 16 MiB pool
    p1 = malloc(6 * MiB)
    p2 = malloc(6 * MiB)
    hooks.pyalloc_record_stream(p1, 0x2000)
    stub.events_pending = 1
    free(p1)  # pending: only the retry waits for its stream
    before, retries = memory_calls(), stats()["num_alloc_retries"]

    def work():
        free(malloc(8 * MiB))
    try:
        counted_as_made(work)
    finally:
        stub.events_pending = 0
    made = calls_since(before)
    assert stats()["num_alloc_retries"] == retries + 1
    # p1's three pages unmapped and mapped again; one page made for the rest.
    assert {k: n for k, n in made.items() if k != "mem_get_info"} == {"mem_unmap": 3, "mem_map": 4, "mem_create": 1}, made
    free(p2)
    hooks.pyalloc_set_memory_fraction(1.0, 0)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_a_repeating_loop_maps_nothing_after_its_first_pass():
    """Each pass of this loop mapped one page and unmapped another, forever."""
    hooks.pyalloc_empty_cache()
    for i in range(6):
        p = malloc(2 * MiB)
        q = malloc(3 * MiB)
        free(p)
        s = malloc(7 * MiB // 2)
        free(q)
        free(s)
        if i == 0:
            first = memory_calls()
            assert stub.mem_map > 0
    assert calls_since(first) == {}, calls_since(first)
    _C.cuda_check_invariants(0)


def vmm_check_the_core_counts_the_driver_calls_it_makes():
    def work():
        hooks.pyalloc_empty_cache()
        vmm_check_holes_back_a_large_allocation()  # pages move out of holes under a cap
        keep = malloc(8 * MiB)
        hole = malloc(96 * MiB)
        keep2 = malloc(2 * MiB)
        free(hole)
        stub.used[0] += OTHER_PROCESS
        try:
            room = stub.capacity - stub.used[0]
            free(malloc(room + 64 * MiB))  # only with the hole's pages given back
        finally:
            stub.used[0] -= OTHER_PROCESS
        free(keep)
        free(keep2)
        hooks.pyalloc_empty_cache()
    counted_as_made(work)


def vmm_check_large_handles_where_the_device_has_room():
    """With room to spare on the device, a mapping is made of handles of up to
    32 MiB, not one per 2 MiB page: a tenth of the driver calls."""
    hooks.pyalloc_empty_cache()
    stub.capacity = 64 << 30  # the stand-in's pages are host memory, committed only when written
    hooks.pyalloc_set_memory_fraction(1.0, 0)
    try:
        def work():
            before = memory_calls()
            p = malloc(512 * MiB)
            made = calls_since(before)
            assert made.get("mem_create") == made.get("mem_map") <= 512 // 32 + 8, made
            c.memset(p + 300 * MiB, 5, MiB)  # mapped, across handles
            free(p)
            hooks.pyalloc_empty_cache()
            assert stub.mapped[0] == 0 and stats()["reserved_bytes.all.current"] == 0
        counted_as_made(work)
    finally:
        stub.capacity = 256 << 20
        hooks.pyalloc_set_memory_fraction(1.0, 0)
    _C.cuda_check_invariants(0)


def vmm_check_impossible_requests_fail_at_once():
    hooks.pyalloc_empty_cache()
    keep = malloc(8 * MiB)
    hole = malloc(96 * MiB)
    keep2 = malloc(16 * MiB)  # to the 20 MiB boundary growth maps on to: nothing else cached
    free(hole)  # 48 pages mapped and cached, between live blocks
    made, size = impossible_and_possible_requests(96 * MiB)
    # The cached pages unmapped, each mapped again for the request or released;
    # the rest of the request's pages made; no page asked of a full device.
    pages, new_pages = 96 * MiB // (2 * MiB), -(-size // (2 * MiB))
    moved = made.get("mem_map", 0) - made.get("mem_create", 0)
    assert made.get("mem_unmap") == pages and made.get("mem_map") == new_pages, made
    assert moved > 0 and moved + made.get("mem_release", 0) == pages, made
    free(keep)
    free(keep2)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_a_refused_set_access_gives_the_pages_back():
    """cuMemSetAccess refused (out of memory): the handles mapped for the range are
    unmapped and released, nothing is reserved, the error is an out-of-memory one,
    and every call made is counted."""
    hooks.pyalloc_empty_cache()
    reserved, mapped, used = stats()["reserved_bytes.all.current"], stub.mapped[0], stub.used[0]

    counted_as_made(lambda: refused(40 * MiB, set_access_oom=1))
    assert (stub.mapped[0], stub.used[0]) == (mapped, used)
    assert stats()["reserved_bytes.all.current"] == reserved
    p = malloc(40 * MiB)  # served once access is granted again
    c.memset(p, 5, 40 * MiB)
    free(p)
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_a_refused_mapping_is_counted_as_made():
    """cuMemMap refused (out of memory) after its cuMemCreate: the handle is
    released, and the three calls are counted (the core counted one)."""
    hooks.pyalloc_empty_cache()
    creates = stub.mem_create

    counted_as_made(lambda: refused(40 * MiB, map_oom=1))
    assert stub.mem_create > creates and stub.mem_release == stub.mem_create
    free(malloc(40 * MiB))  # mapped once the device can
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_pages_are_mapped_during_capture_and_none_unmapped():
    capture_stream = 0x5000
    free(malloc(8 * MiB, 0, capture_stream))  # 8 MiB mapped and cached
    maps, unmaps = stub.mem_map, stub.mem_unmap
    stub.capture_id, stub.capturing_stream = 78, capture_stream
    stub.forbidden_during_capture = stub.relaxed_during_capture = 0
    a = malloc(6 * MiB, 0, capture_stream)  # from mapped pages
    assert stub.mem_map == maps
    b = malloc(64 * MiB, 0, capture_stream)  # fresh pages, mapped in relaxed mode
    assert stub.mem_map > maps and stub.relaxed_during_capture > 0
    assert driver.stub_thread_mode() == 0
    hooks.pyalloc_empty_cache()
    assert stub.forbidden_during_capture == 0 and stub.mem_unmap == unmaps
    stub.capturing_stream = 0
    free(a)
    free(b)
    _C.cuda_release_graph_memory(0)
    _C.cuda_check_invariants(0)


def vmm_check_a_mapping_refused_during_capture_unmaps_nothing():
    """Regression: during a capture (the device's free memory unknown then) a
    growth was mapped in several handles, and when the device refused a later
    one the earlier ones were unmapped and released again: cuMemUnmap and
    cuMemRelease into the capture. A growth during a capture is one handle."""
    capture_stream = 0x5600
    hooks.pyalloc_empty_cache()
    capacity = stub.capacity
    stub.capacity = stub.used[0] + 40 * MiB  # 40 MiB left on device 0
    stub.capture_id, stub.capturing_stream = 79, capture_stream
    stub.forbidden_during_capture = 0
    maps, refused = stub.mem_map, stub.mem_create_refused
    try:
        malloc(60 * MiB, 0, capture_stream)
        raise AssertionError("60 MiB mapped on a device with 40 MiB free")
    except RuntimeError as e:
        assert "out of memory" in str(e).lower(), str(e)
    assert stub.mem_create_refused > refused and stub.mem_map == maps
    p = malloc(30 * MiB, 0, capture_stream)  # what fits is still mapped, in one handle
    assert stub.mem_map == maps + 1
    assert stub.forbidden_during_capture == 0, stub.forbidden_during_capture
    stub.capturing_stream = 0
    stub.capacity = capacity
    free(p)
    _C.cuda_release_graph_memory(0)  # the graph is done with it
    hooks.pyalloc_empty_cache()
    q = malloc(60 * MiB)  # the range is mapped again where the refusal left it
    c.memset(q, 9, 60 * MiB)
    free(q)
    hooks.pyalloc_empty_cache()
    assert stub.mapped[0] == 0 and stub.mem_release == stub.mem_create
    _C.cuda_check_invariants(0)


def vmm_check_a_refused_set_access_during_capture_unmaps_nothing():
    """Regression: cuMemSetAccess refused (out of memory) or failing (another
    error) during a capture unmapped and released the handle it was for: two
    calls into the capture. The pages stay mapped, parked: reserved, never
    handed out, and unmapped once the capture is over."""
    capture_stream = 0x5700
    hooks.pyalloc_empty_cache()
    before = stats()
    stub.capture_id, stub.capturing_stream = 80, capture_stream
    stub.forbidden_during_capture = 0
    unmaps = stub.mem_unmap

    counted_as_made(lambda: refused(40 * MiB, capture_stream, says="refused access",
                                    set_access_oom=1))
    assert stub.forbidden_during_capture == 0 and stub.mem_unmap == unmaps
    st = stats()
    parked = st["reserved_bytes.all.current"] - before["reserved_bytes.all.current"]
    assert parked >= 40 * MiB, parked  # held, and said so

    def failing():
        message = refused(10 * MiB, capture_stream, says="cuMemSetAccess", set_access_fail=1)
        assert "out of memory" not in message.lower(), message
    counted_as_made(failing)
    assert stub.forbidden_during_capture == 0 and stub.mem_unmap == unmaps
    st = stats()
    parked = st["reserved_bytes.all.current"] - before["reserved_bytes.all.current"]
    assert parked >= 50 * MiB, parked
    assert st["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    blocks = [b for seg in _C.cuda_snapshot_segments(0) for b in seg["blocks"]]
    assert sum(b["size"] for b in blocks if b["state"] == "inactive") >= parked, blocks
    assert not [b for b in blocks if b["state"] != "inactive"], blocks  # no one holds them
    _C.cuda_check_invariants(0)
    hooks.pyalloc_empty_cache()  # nothing goes back during the capture
    p = malloc(30 * MiB, 0, capture_stream)  # access granted again: other pages
    c.memset(p, 3, 30 * MiB)
    assert stub.forbidden_during_capture == 0 and stub.mem_unmap == unmaps
    assert stats()["reserved_bytes.all.current"] >= before["reserved_bytes.all.current"] + parked
    stub.capturing_stream = 0
    free(p)
    _C.cuda_release_graph_memory(0)

    def grow():  # past what is cached, with no cap: only the parked pages are unmapped
        q = malloc(64 * MiB)
        c.memset(q, 1, 64 * MiB)
        free(q)
    counted_as_made(grow)
    assert stub.mem_unmap > unmaps and stub.forbidden_during_capture == 0
    reserved = stats()["reserved_bytes.all.current"]
    assert reserved < 64 * MiB + parked, reserved
    _C.cuda_check_invariants(0)
    counted_as_made(hooks.pyalloc_empty_cache)
    assert stub.mapped[0] == 0 and stub.mem_release == stub.mem_create
    assert stats()["reserved_bytes.all.current"] == 0
    _C.cuda_check_invariants(0)


def vmm_check_parked_pages_go_back_when_the_capture_ends():
    """Pages parked during a capture (the device refused access to them) went back
    only at the next growth, reserve() or empty_cache(): a process doing none of
    these after the capture kept them, counted as reserved. The capture's end
    gives them back now, on every device: the end of its pool's route (PyTorch
    calls it after cudaStreamEndCapture), torch 2.13's markCaptureEnd, or the
    release of a pool whose route never ended. Not while another capture is
    still underway."""
    OK, api = bridge_api()
    cap, other = 0x5800, 0x5900
    reserved = lambda device: _C.cuda_device_stats(device)["reserved_bytes.all.current"]  # noqa: E731
    pool, marked_pool = (0, 31), (0, 32)

    def marked(begin):
        """A capture as torch 2.13 makes it: its route, then its mark; the mark's
        end (markCaptureEnd), then the route's end and the graph's reset."""
        if begin:
            pool_hook("begin_allocate_to_pool", marked_pool, [cap + 1])
            assert api.mark_capture(0, 1) == OK  # markCaptureBegin
        else:
            assert api.mark_capture(0, 0) == OK
            pool_hook("end_allocate_to_pool", marked_pool)
            pool_hook("release_pool", marked_pool)

    opens = {"route": lambda: pool_hook("begin_allocate_to_pool", pool, [cap]),
             "mark": lambda: marked(True)}
    ends = {"route": lambda: pool_hook("end_allocate_to_pool", pool),
            "mark": lambda: marked(False),
            "release": lambda: pool_hook("release_pool", pool)}  # a route never ended
    stub.forbidden_during_capture = 0
    # (the first capture, the second, how the second ends, the device whose pages park)
    for first, second, last, device in [("mark", "route", "route", 0), ("route", "mark", "mark", 0),
                                        ("mark", "route", "release", 0), ("mark", "route", "route", 1),
                                        ("route", "mark", "mark", 1)]:
        hooks.pyalloc_empty_cache()
        before, unmaps = reserved(device), stub.mem_unmap
        opens[first]()
        stub.capture_id, stub.capturing_stream = 82, cap
        # Parked by the general pool (graph pools take no pages), growing on a stream
        # the route does not take while a capture is underway.
        counted_as_made(lambda: refused(40 * MiB, other, device, says="refused access", set_access_oom=1),
                        device=device)
        assert reserved(device) >= before + 40 * MiB and stub.mem_unmap == unmaps
        opens[second]()  # another capture, still underway when the first ends
        stub.capturing_stream = 0  # cudaStreamEndCapture of the first
        ends[first]()
        assert stub.mem_unmap == unmaps and reserved(device) >= before + 40 * MiB
        counted_as_made(ends[last], device=device)  # the last capture ends: they go back
        assert stub.mem_unmap > unmaps and reserved(device) == before, (first, last, device)
        assert stub.forbidden_during_capture == 0
        _C.cuda_check_invariants(device)
        if "route" in (first, second) and last != "release":
            pool_hook("release_pool", pool)
    free(malloc(MiB, 0, other))  # the pools work on
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def vmm_check_captures_beside_busy_threads():
    captures_beside_busy_threads()


def vmm_check_peers_refused_by_a_pool_are_counted_as_made():
    """Peers refused at a pool's mapping, not at the device's trial (device 0
    was opened with them): cuMemSetAccess is asked twice, and counted twice
    (the core counted once)."""
    hooks.pyalloc_empty_cache()
    free(malloc(MiB))
    assert stub.access_count == 2
    stub.refuse_peers = 1
    try:
        counted_as_made(lambda: free(malloc(24 * MiB)))
    finally:
        stub.refuse_peers = 0
    assert stub.access_count == 1 and stub.access_mask == 0b01
    hooks.pyalloc_empty_cache()
    _C.cuda_check_invariants(0)


def fallback_check_vmm_refused_by_a_sandbox():
    stub.vmm = 1
    stub.vmm_refuse = 1  # cuMemCreate: CUDA_ERROR_NOT_PERMITTED
    p = None

    def opening():  # the refused trial mapping's calls counted too
        nonlocal p
        p = malloc(5 * MiB)
    counted_as_made(opening)
    assert stub.mem_alloc > 0 and stub.mem_map == 0  # plain segments
    free(p)
    # Every report names the strategy in use (stderr said why, once).
    assert _C.cuda_config()["strategy"] == "bestfit"
    from pyalloc import cuda
    assert cuda.snapshot()["allocator_settings"]["strategy"] == "bestfit"
    why = _C.cuda_describe_device(0)["vmm_why"]
    assert "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED (800)" in why, why


def fallback_check_no_vmm_support():
    stub.vmm = 0
    stub.vmm_refuse = 0
    free(malloc(5 * MiB, device=1))
    info = _C.cuda_describe_device(1)
    assert not info["vmm"] and "does not support virtual memory" in info["vmm_why"], info
    assert _C.cuda_config()["strategy"] == "bestfit"


def capture_check_a_device_opened_during_a_capture_breaks_nothing():
    """Regression: a device's pools made while a stream of another device
    captures (CUDA's global mode forbids unmapping from any thread) made their
    trial mapping and unmapped it again: a cuMemUnmap and a cuMemRelease into
    the capture for each pool. The trial page now stays mapped, as the pool's
    first, until the capture is over: it counts toward a pool_size up to a
    page ("capture"); a pool_size the device cannot give during the capture
    ("capture big": 64 MiB, of 32; "capture error": a driver error mapping it)
    is mapped once the capture is over (it threw, leaking the page, the range
    and the pool's share of the device). "capture access": the device refuses
    access to the page; it stays mapped, parked, and the request fails."""
    pool_size = 64 * MiB if {"big", "error"} & set(sys.argv[2:]) else 2 * MiB
    _C.cuda_configure(f"strategy:vmm,pool_size:{pool_size}")
    cap, s1 = 0x5500, (1 << 32) | 0x1000
    free(malloc(MiB))  # device 0's pools
    pool_hook("begin_allocate_to_pool", (0, 17), [cap])
    stub.capture_id, stub.capturing_stream = 93, cap
    stub.forbidden_during_capture = 0
    allocs = stub.mem_alloc
    capacity = stub.capacity
    access = "access" in sys.argv[2:]
    if "error" in sys.argv[2:]:
        stub.fail_create_size = pool_size - 2 * MiB  # a driver error, not out of memory
    elif pool_size > 2 * MiB:
        stub.capacity = 32 * MiB
    stub.set_access_oom = int(access)
    try:
        p = malloc(3 * MiB, 1, s1)  # device 1's pools are made now
        assert not access, "allocated pages no device may access"
        c.memset(p, 4, 3 * MiB)
        free(p, device=1)
    except RuntimeError as e:
        assert access and "refused access" in str(e), str(e)
    finally:
        stub.set_access_oom = 0
    hooks.pyalloc_empty_cache()  # nothing is given back during the capture
    assert stub.forbidden_during_capture == 0, stub.forbidden_during_capture
    assert stub.mem_alloc == allocs and stub.mapped[1] > 0  # device 1 maps pages
    stub.capturing_stream = 0
    stub.capacity = capacity
    stub.fail_create_size = 0
    pool_hook("end_allocate_to_pool", (0, 17))
    pool_hook("release_pool", (0, 17))
    if access:  # the parked pages are unmapped first, and not counted as reserved by it
        got = _C.cuda_reserve(1, 8 * MiB)
        assert got == 8 * MiB, got
    q = malloc(5 * MiB, 1, s1)
    c.memset(q, 6, 5 * MiB)
    free(q, device=1)
    hooks.pyalloc_empty_cache()  # the trial page goes back with the rest, but pool_size
    assert stub.mapped[1] == pool_size == stats(1)["reserved_bytes.all.current"], stub.mapped[1]
    assert _C.cuda_config()["strategy"] == "vmm"
    _C.cuda_check_invariants(1)


def areas_check_a_capture_that_cannot_grow_serves_small_requests_from_pool_size():
    """Requests of up to 1 MiB take pages of the range's small area; where a
    capture may map none (this driver cannot relax the capture mode), they take
    free pages of the large area, pool_size's, rather than fail."""
    assert _C.cuda_check_driver() == 13000
    _C.cuda_configure("strategy:vmm,pool_size:32MiB")
    capture_stream = 0x5000
    keep = malloc(4 * MiB)  # the device's pools open, pool_size mapped; the rest never used
    created = stub.mem_create
    stub.capture_id, stub.capturing_stream = 77, capture_stream
    try:
        ptrs = [malloc(4096, 0, capture_stream), malloc(MiB, 0, capture_stream)]
    finally:
        stub.capturing_stream = 0
    assert stub.mem_create == created and stats()["reserved_bytes.all.current"] == 32 * MiB, (
        stub.mem_create - created, stats()["reserved_bytes.all.current"])
    for ptr in ptrs + [keep]:
        free(ptr)
    _C.cuda_check_invariants(0)



def set_up(mode):
    """What every check of `mode` takes for granted."""
    stub.vmm = 1 if mode in ("vmm", "capture", "areas") else 0
    if mode == "":
        _C.cuda_configure("pool_size:32MiB,strategy:bestfit")
    elif mode == "vmm":
        _C.cuda_configure("strategy:vmm")
        stub.peer_access = 1  # the devices find their peers when they open
        # Device 0 open, as a program's first allocation leaves it: its trial mapping
        # made (and counted in its first pool) before any check sets the stand-in's knobs.
        free(malloc(MiB))
        hooks.pyalloc_empty_cache()
    elif mode == "fallback":
        _C.cuda_configure("strategy:vmm")


words = sys.argv[2:]
checks = [w for w in words if "check_" in w]
unknown = [name for name in checks if not callable(globals().get(name))]
assert checks and not unknown, f"name the checks to run (unknown: {unknown})"
set_up(next((w for w in words if w in ("vmm", "fallback", "capture", "areas")), ""))
for name in checks:
    globals()[name]()
    assert stub.bad_handle == 0, f"{name}: a released handle was mapped or released again"
    # As the driver would: a range mapped over, unmapped or freed in part.
    assert stub.vmm_refused == 0, f"{name}: the driver refused {stub.vmm_refused} virtual memory calls"
    assert stub.capture_invalidated == 0, f"{name}: a driver call invalidated a capture"
print("OK")
