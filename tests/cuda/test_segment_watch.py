"""What PyTorch's allocator trace trackers hear through the bridge's C table
(csrc/cuda/segment_watch.h): each unit of memory the driver maps, once usable,
and again before it goes; snapshot_units' segments are those units; and a
MemPool's own allocator (NCCL's ncclMemAlloc, for ProcessGroupNCCL) gives a
pool its segments. On fake devices here; pages of strategy vmm, moved and
unmapped, on the stand-in driver (tests/cuda_stub/watch_checks.py).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from bridge_api import (FILTER_FN, OK, OUT_OF_MEMORY, SEGMENT_EVENT_FN, SOURCE_ALLOC_FN, SOURCE_FREE_FN)

MiB = 1 << 20
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
STUB_DIR = os.path.join(TESTS, "cuda_stub")


class Registrar:
    """Plays ProcessGroupNCCL's hooks: registers each unit told mapped, and
    deregisters it, by its address, when told it goes; anything else is an
    error, as NCCLComm::registerSegment / deregisterSegment make it."""

    def __init__(self):
        self.registered = {}
        self.errors = []
        self.events = []

    def __call__(self, _user, device, mapped, addr, size, pool):
        self.events.append((bool(mapped), device, addr, size, (pool[0], pool[1])))
        if mapped:
            if addr in self.registered:
                self.errors.append(f"{addr:#x} registered twice")
            self.registered[addr] = size
        elif self.registered.pop(addr, None) != size:
            self.errors.append(f"{addr:#x} ({size} bytes) deregistered but not registered so")


@pytest.fixture
def registrar(api):
    r = Registrar()
    fn = SEGMENT_EVENT_FN(r)
    assert api.watch_segments(fn, None) == OK
    yield r
    assert api.watch_segments(SEGMENT_EVENT_FN(), None) == OK
    assert not r.errors, r.errors


def units(api, **kw):
    return {(s["address"], s["total_size"]) for s in api.snapshot(0, units=True, **kw)}


def test_a_segment_is_told_once_usable_and_before_it_goes(api, fake, registrar):
    status, p, _ = api.malloc(3 * MiB)
    assert status == OK
    [(mapped, device, addr, size, pool)] = registrar.events
    assert mapped and device == 0 and pool == (0, 0)
    assert addr <= p < addr + size
    # The segments a communicator registers when it is made: the same units.
    assert units(api) == {(addr, size)} == set(registrar.registered.items())
    [seg] = api.snapshot(0, units=True)
    assert sum(b["size"] for b in seg["blocks"]) == size
    assert seg["allocated_size"] == 3 * MiB
    assert api.free(p, 0) == OK and api.empty_cache(-1) == OK
    assert registrar.events[-1] == (False, 0, addr, size, (0, 0))
    assert registrar.registered == {} and units(api) == set()


def test_small_chunks_stay_inside_the_unit_they_were_cut_from(api, fake, registrar):
    # The small pool lends chunks of a segment: a snapshot lists them apart,
    # the units do not (NCCL registered the segment whole).
    status, big, _ = api.malloc(5 * MiB)
    status, small, _ = api.malloc(4096)
    plain = api.snapshot(0)
    told = set(registrar.registered.items())
    assert units(api) == told
    assert len(plain) >= len(told)
    for seg in api.snapshot(0, units=True):
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    allocated = sum(s["allocated_size"] for s in api.snapshot(0, units=True))
    assert allocated == sum(s["allocated_size"] for s in plain)
    api.free(big, 0)
    api.free(small, 0)


def test_a_mempool_with_its_own_allocator_gets_its_segments_from_it(api, fake, registrar):
    calls = []
    maps = {}

    def alloc(_user, device, size, out):
        m = mmap.mmap(-1, size)  # host memory, as the fake device's own
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        maps[ptr] = m
        calls.append(("alloc", device, size))
        out[0] = ptr
        return OK

    def free(_user, device, ptr, size):
        calls.append(("free", device, size, registrar.registered.get(ptr)))
        maps.pop(ptr)  # released by the collector later: its buffer is exported

    alloc_fn, free_fn = SOURCE_ALLOC_FN(alloc), SOURCE_FREE_FN(free)
    assert api.create_or_incref_pool_with(0, 0, 9, alloc_fn, free_fn, None) == OK
    stream = 7
    filt = FILTER_FN(lambda _u, s: int((s or 0) == stream))
    assert api.begin_allocate_to_pool(0, 0, 9, filt, None) == OK
    status, p, _ = api.malloc(3 * MiB, stream=stream)
    assert status == OK, api.error()
    assert api.end_allocate_to_pool(0, 0, 9) == OK
    assert api.release_pool(0, 0, 9) == OK  # as torch.cuda.use_mem_pool ends
    [(_, device, size)] = calls
    [(base, seg)] = registrar.registered.items()
    assert device == 0 and base in maps and base <= p < base + seg and size == seg
    assert registrar.events[-1][4] == (0, 9)
    assert units(api, pool_id=(0, 9)) == {(base, seg)}
    ctypes.memset(p, 1, 3 * MiB)  # its memory
    # The MemPool gone and its pool empty: its segment goes back to its
    # allocator, deregistered first.
    assert api.release_pool(0, 0, 9) == OK
    assert api.free(p, 0) == OK and api.empty_cache(-1) == OK
    assert calls[-1] == ("free", 0, seg, None), calls
    assert registrar.registered == {}


def test_a_mempool_allocator_out_of_memory_is_an_oom(api, fake):
    alloc_fn = SOURCE_ALLOC_FN(lambda _u, device, size, out: OK)  # *out stays NULL: none left
    free_fn = SOURCE_FREE_FN(lambda *a: None)
    assert api.create_or_incref_pool_with(0, 0, 11, alloc_fn, free_fn, None) == OK
    filt = FILTER_FN(lambda _u, s: 1)
    assert api.begin_allocate_to_pool(0, 0, 11, filt, None) == OK
    status, p, _ = api.malloc(3 * MiB)
    said = api.error()
    assert api.end_allocate_to_pool(0, 0, 11) == OK
    assert api.release_pool(0, 0, 11) == OK
    assert status == OUT_OF_MEMORY and p == 0
    assert "CUDA out of memory" in said, said
    assert api.release_pool(0, 0, 11) == OK


@pytest.mark.parametrize("mode", ["vmm", "bestfit"])
def test_units_are_told_as_the_stand_in_driver_maps_moves_and_unmaps_them(stub_drivers, mode):
    library = stub_drivers["relaxed"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS]), LD_LIBRARY_PATH=str(library.parent))
    env.pop("PYALLOC_CONF", None)
    out = subprocess.run([sys.executable, os.path.join(STUB_DIR, "watch_checks.py"), str(library), mode],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


# -- trackers are called with no pool lock held ----------------------------------------------

TRACKER_THAT_ALLOCATES = r"""
import sys
from pyalloc import _C
from bridge_api import OK, SEGMENT_EVENT_FN, BridgeApi

MiB = 1 << 20
_C._testing_use_fake_devices(64 << 20)
api = BridgeApi()
events, inner, errors = [], [], []

def tracker(_user, device, mapped, addr, size, pool):
    events.append((bool(mapped), addr, size))
    try:
        if len(inner) < 3:  # allocates, frees and empties the cache from inside its call
            status, p, _ = api.malloc(9 * MiB)
            assert status == OK, api.error()
            inner.append(p)
            assert api.free(p, 0) == OK, api.error()
            assert api.empty_cache(-1) == OK, api.error()
    except BaseException as e:  # ctypes swallows a callback's exception: keep it
        errors.append(repr(e))

fn = SEGMENT_EVENT_FN(tracker)
assert api.watch_segments(fn, None) == OK
status, p, _ = api.malloc(3 * MiB)
assert status == OK, api.error()
assert api.free(p, 0) == OK and api.empty_cache(-1) == OK
assert api.watch_segments(SEGMENT_EVENT_FN(), None) == OK
assert not errors, errors
assert len(inner) == 3, inner
# One order: every unit told mapped, then unmapping, never twice either way.
live = {}
for mapped, addr, size in events:
    assert (addr in live) != mapped, (mapped, hex(addr), events)
    if mapped:
        live[addr] = size
    else:
        assert live.pop(addr) == size
assert live == {}, live
assert _C._testing_queued_segment_events() == 0
print("OK", len(events))
"""


def run_or_fail_on_deadlock(script, what):
    """Runs script in a child process, so that a deadlock fails the test in a
    minute instead of hanging the suite."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS]))
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} deadlocked")
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr


def test_a_tracker_that_allocates_and_frees_from_its_call_does_not_deadlock():
    # Regression: trackers were called under the pool's lock, so a tracker
    # that allocated or freed through pyalloc from its call waited for the lock
    # its own thread held.
    run_or_fail_on_deadlock(TRACKER_THAT_ALLOCATES, "a tracker that allocates from its call")


TRACKER_THAT_TAKES_A_LOCK = r"""
import threading
from pyalloc import _C
from bridge_api import OK, SEGMENT_EVENT_FN, BridgeApi

MiB = 1 << 20
_C._testing_use_fake_devices(64 << 20)
api = BridgeApi()
lock, in_tracker, errors, events, got = threading.Lock(), threading.Event(), [], [], {}

def tracker(_user, device, mapped, addr, size, pool):
    events.append((bool(mapped), addr))
    if len(events) == 1:
        in_tracker.set()
        if not lock.acquire(timeout=20):  # held by a thread that allocates meanwhile
            errors.append("the tracker waited for a lock its holder could not release")
            return
        lock.release()

def other():
    with lock:  # as a caller holding its own lock while it allocates
        in_tracker.wait()
        got["status"], got["ptr"], _ = api.malloc(30 * MiB)  # a segment of its own

fn = SEGMENT_EVENT_FN(tracker)
assert api.watch_segments(fn, None) == OK
t = threading.Thread(target=other)
t.start()
status, p, _ = api.malloc(3 * MiB)
t.join()
assert status == OK and got["status"] == OK, (status, got)
assert not errors, errors
assert [m for m, _ in events] == [True, True], events  # both told, in order
assert api.free(p, 0) == OK and api.free(got["ptr"], 0) == OK
assert api.watch_segments(SEGMENT_EVENT_FN(), None) == OK
print("OK")
"""


def test_a_tracker_that_takes_a_lock_an_allocating_thread_holds_does_not_deadlock():
    # A tracker that waits for a lock which another thread holds while it
    # allocates: that thread must not wait for the tracker in turn (for the
    # pool's lock, as it did, or for the telling of its own events).
    run_or_fail_on_deadlock(TRACKER_THAT_TAKES_A_LOCK, "a tracker that takes a lock an allocating thread holds")
