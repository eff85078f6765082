"""pyalloc's own out-of-memory observers (csrc/cuda/oom_observers.h), on fake devices.

An observer attached with pyalloc.cuda.attach_oom_observer hears of each
out-of-memory error of a device's pools once, on every route a request comes by
(the C hooks' logic, the bridge's C table, the buffer pool, a graph pool), with
PyTorch's arguments (device, requested bytes, device total, device free), on the
allocating thread, with the GIL taken for it and no pool lock held: so it can take
a snapshot, or allocate itself, and what it raises never changes the caller's error.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import pyalloc
from pyalloc import _C

from bridge_api import OK, OUT_OF_MEMORY, BridgeApi

MiB = 1 << 20
CAPACITY = 64 * MiB  # the conftest's fake devices
HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
REPO = os.path.join(os.path.dirname(__file__), "..", "..")


class Recorder:
    """An observer that keeps the arguments of each call, and the thread it ran on."""

    def __init__(self, then=None):
        self.calls = []
        self.threads = []
        self.then = then

    def __call__(self, device, requested, device_total, device_free):
        self.calls.append((device, requested, device_total, device_free))
        self.threads.append(threading.get_ident())
        if self.then is not None:
            self.then()


@pytest.fixture
def observe(fake):
    """attach(fn): attaches fn for the test; everything still attached is detached after."""
    attached = []

    def attach(fn):
        pyalloc.cuda.attach_oom_observer(fn)
        attached.append(fn)
        return fn

    yield attach
    for fn in attached:
        try:
            pyalloc.cuda.detach_oom_observer(fn)
        except ValueError:
            pass  # the test detached it itself


def refuse(size=2 * CAPACITY, device=0, stream=0):
    """A request the C hooks' logic refuses: the error PyTorch would get."""
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        _C._testing_hook_malloc(size, device, stream)
    return str(e.value)


def test_an_observer_hears_each_refused_request_once_with_its_figures(observe):
    seen = observe(Recorder())
    refuse(100 * MiB)
    assert seen.calls == [(0, 100 * MiB, CAPACITY, CAPACITY)]  # a fake device says all is free
    refuse(200 * MiB, device=1)
    assert seen.calls[1:] == [(1, 200 * MiB, CAPACITY, CAPACITY)]
    # A request served, even one the retry after giving back the cache served, is no error.
    free_hook(_C._testing_hook_malloc(40 * MiB, 0, 0))
    free_hook(_C._testing_hook_malloc(50 * MiB, 0, 0))  # the 40 MiB cached must go back first
    assert _C.cuda_device_stats(0)["num_alloc_retries"] == 1
    assert len(seen.calls) == 2
    assert _C.cuda_device_stats(0)["num_ooms"] == 1


def free_hook(ptr, device=0):
    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_free(ptr, 0, device, None)


def test_the_c_table_tells_the_observers_the_figures_the_bridge_gets(observe):
    # The bridge passes pyalloc_oom_info on to PyTorch's own observers: pyalloc's
    # hear the same figures, once per error, before malloc returns.
    seen = observe(Recorder())
    api = BridgeApi()
    status, ptr, oom = api.malloc(3 * CAPACITY, device=1, context=5)
    assert (status, ptr) == (OUT_OF_MEMORY, 0)
    assert seen.calls == [(1, oom.requested, oom.device_total, oom.device_free)]
    assert oom.requested == 3 * CAPACITY and oom.device_total == CAPACITY
    assert api.error().startswith("CUDA out of memory.")


def test_the_buffer_pool_and_a_graph_pool_tell_the_observers_too(observe):
    seen = observe(Recorder())
    with pytest.raises(pyalloc.OutOfMemoryError):
        _C.cuda_buffer(0, 2 * CAPACITY, 0)
    assert seen.calls == [(0, 2 * CAPACITY, CAPACITY, CAPACITY)]
    capture = 0x5000
    _C._testing_pool_hook("begin_allocate_to_pool", 0, (0, 9), [capture])
    try:
        # The observer takes a snapshot while the route is open: the graph pools'
        # lock is no longer held when it runs.
        seen.then = pyalloc.snapshot
        refuse(2 * CAPACITY, stream=capture)
    finally:
        _C._testing_pool_hook("end_allocate_to_pool", 0, (0, 9), [])
        _C._testing_pool_hook("release_pool", 0, (0, 9), [])
    assert seen.calls[1:] == [(0, 2 * CAPACITY, CAPACITY, CAPACITY)]


def test_pools_that_cannot_be_made_are_an_error_of_the_request_told_once(observe):
    # pool_size larger than the device: the first request of each route fails to
    # make the device's pools. Their figures are unknown (0), as the bridge's are.
    _C.cuda_configure("pool_size:128MiB")
    seen = observe(Recorder())
    message = refuse(MiB)
    assert message.startswith("CUDA out of memory. pyalloc could not create its pool on device 0")
    with pytest.raises(pyalloc.OutOfMemoryError):
        _C.cuda_buffer(1, 2 * MiB, 0)
    status, _, oom = BridgeApi().malloc(3 * MiB, device=2)
    assert status == OUT_OF_MEMORY and (oom.device_total, oom.device_free) == (0, 0)
    assert seen.calls == [(0, MiB, 0, 0), (1, 2 * MiB, 0, 0), (2, 3 * MiB, 0, 0)]


def test_a_snapshot_taken_in_the_observer_holds_the_oom_event(observe):
    pyalloc.record_history(True, 1000)
    try:
        snapshots = []
        observe(lambda *args: snapshots.append(pyalloc.snapshot()))
        live = _C._testing_hook_malloc(8 * MiB, 0, 0)
        refuse(100 * MiB)
        [snap] = snapshots
        [oom] = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
        assert oom["size"] == 100 * MiB
        assert sum(s["allocated_size"] for s in snap["segments"]) == 8 * MiB  # the pools as they were
        free_hook(live)
    finally:
        pyalloc.record_history(False)


def test_an_observer_that_raises_changes_nothing_the_caller_gets(observe, monkeypatch):
    expected = refuse(100 * MiB)  # the error with no observer
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def broken(*args):
        raise KeyError("observer bug")

    observe(broken)
    after = observe(Recorder())  # observers attached later are still told
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        _C._testing_hook_malloc(100 * MiB, 0, 0)
    assert str(e.value) == expected
    assert len(after.calls) == 1
    [report] = unraisable
    assert isinstance(report.exc_value, KeyError) and report.object is broken
    # The C table's caller too: its status and message.
    api = BridgeApi()
    status, _, _ = api.malloc(100 * MiB)
    assert status == OUT_OF_MEMORY and api.error() == expected
    assert len(unraisable) == 2


def test_an_observer_that_allocates_runs_once_and_its_own_oom_is_its_own(observe):
    # Inside the observer, a request that fits is served (no lock of the failed
    # request is held) and one that does not is refused with no observer told:
    # no recursion, no deadlock.
    inner = []

    def allocating(device, requested, total, free):
        p = _C._testing_hook_malloc(MiB, device, 0)
        free_hook(p, device)
        try:
            _C._testing_hook_malloc(requested, device, 0)
        except pyalloc.OutOfMemoryError as e:
            inner.append(str(e))

    observe(allocating)
    seen = observe(Recorder())
    refuse(100 * MiB)
    assert len(inner) == 1 and inner[0].startswith("CUDA out of memory.")
    assert seen.calls == [(0, 100 * MiB, CAPACITY, CAPACITY)]  # once: not for the observer's own error
    assert _C.cuda_device_stats(0)["num_ooms"] == 2  # both errors were errors


def test_detach_stops_the_calls_and_checks_its_argument(observe):
    seen = observe(Recorder())
    twice = Recorder()
    pyalloc.cuda.attach_oom_observer(twice)
    pyalloc.cuda.attach_oom_observer(twice)  # attached twice: told twice
    refuse()
    assert (len(seen.calls), len(twice.calls)) == (1, 2)
    pyalloc.cuda.detach_oom_observer(seen)
    pyalloc.cuda.detach_oom_observer(twice)  # one of its two
    refuse()
    assert (len(seen.calls), len(twice.calls)) == (1, 3)
    pyalloc.cuda.detach_oom_observer(twice)
    refuse()
    assert (len(seen.calls), len(twice.calls)) == (1, 3)
    with pytest.raises(ValueError, match="not attached"):
        pyalloc.cuda.detach_oom_observer(twice)
    with pytest.raises(TypeError, match="callable"):
        pyalloc.cuda.attach_oom_observer(42)
    with pytest.raises(TypeError, match="callable"):
        pyalloc.cuda.detach_oom_observer("not a function")
    assert pyalloc.attach_oom_observer is pyalloc.cuda.attach_oom_observer


def test_a_bound_method_detaches_by_equality(observe):
    # obj.method is a new object at each access: detach finds an equal one, as list.remove does.
    seen = Recorder()
    box = type("Box", (), {"note": lambda self, *args: seen(*args)})()
    pyalloc.cuda.attach_oom_observer(box.note)
    refuse()
    pyalloc.cuda.detach_oom_observer(box.note)
    refuse()
    assert len(seen.calls) == 1


def test_testing_reset_drops_the_observers(fake):
    seen = Recorder()
    pyalloc.cuda.attach_oom_observer(seen)
    _C._testing_reset()
    _C._testing_use_fake_devices(CAPACITY)
    refuse()
    assert seen.calls == []
    with pytest.raises(ValueError):
        pyalloc.cuda.detach_oom_observer(seen)


def test_an_observer_runs_on_the_allocating_thread_which_let_go_of_the_gil(observe):
    # _testing_hook_malloc releases the GIL, as PyTorch's allocation path may
    # run without it: the observer's wrapper takes it back on that thread.
    seen = observe(Recorder())
    errors = []

    def worker():
        try:
            _C._testing_hook_malloc(2 * CAPACITY, 0, 0)
        except pyalloc.OutOfMemoryError as e:
            errors.append(str(e))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and seen.threads == [t.ident]


C_THREADS = r'''
#include <pthread.h>
#include "cuda/bridge_api.h"

struct job { const pyalloc_bridge_api* api; uint64_t size; int status; };

static void* run(void* arg) {
  struct job* j = (struct job*)arg;
  void* out = 0;
  j->status = j->api->malloc(0, j->size, 0, 0, &out, 0);
  return 0;
}

/* api->malloc on a thread of its own, which Python has never seen. */
int malloc_on_a_new_thread(const pyalloc_bridge_api* api, uint64_t size) {
  pthread_t t;
  struct job j = {api, size, -1};
  if (pthread_create(&t, 0, run, &j) != 0) return -1;
  pthread_join(t, 0);
  return j.status;
}

static void* run_forever(void* arg) {
  for (;;) run(arg);
  return 0;
}

/* A thread Python never saw, which asks for `size` bytes again and again until the process ends. */
int start_failing_thread(const pyalloc_bridge_api* api, uint64_t size) {
  static struct job j;
  pthread_t t;
  j.api = api;
  j.size = size;
  if (pthread_create(&t, 0, run_forever, &j) != 0) return -1;
  return pthread_detach(t);
}
'''


@pytest.fixture(scope="module")
def c_threads(tmp_path_factory):
    """The path of a library of C threads that call the C table (C_THREADS)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the thread harness")
    d = tmp_path_factory.mktemp("threads")
    (d / "threads.c").write_text(C_THREADS)
    lib = d / "threads.so"
    subprocess.run(["cc", "-std=c99", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror", "-I", HEADER_DIR,
                    str(d / "threads.c"), "-o", str(lib)], check=True, capture_output=True, text=True)
    return str(lib)


def test_an_observer_runs_on_a_thread_python_never_saw(observe, c_threads):
    run = ctypes.CDLL(c_threads).malloc_on_a_new_thread
    run.restype = ctypes.c_int
    run.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    names = []
    seen = observe(Recorder(then=lambda: names.append(threading.current_thread().name)))
    assert run(BridgeApi().pointer, 2 * CAPACITY) == OUT_OF_MEMORY  # ctypes lets go of the GIL
    assert seen.calls == [(0, 2 * CAPACITY, CAPACITY, CAPACITY)]
    assert seen.threads[0] != threading.get_ident() and names[0].startswith("Dummy")
    assert run(BridgeApi().pointer, MiB) == OK  # served: nobody told
    assert len(seen.calls) == 1


def test_observers_attached_and_detached_while_another_thread_runs_out(observe):
    # The list is copied under its lock and called outside it: an observer
    # detached mid-call finishes that call, then is dropped (with the GIL).
    stop = threading.Event()
    errors = []

    def worker():
        while not stop.is_set():
            try:
                _C._testing_hook_malloc(2 * CAPACITY, 0, 0)
            except pyalloc.OutOfMemoryError:
                errors.append(1)

    t = threading.Thread(target=worker)
    t.start()
    try:
        told = []
        for i in range(300):
            fn = (lambda k: lambda *args: told.append(k))(i)
            pyalloc.cuda.attach_oom_observer(fn)
            pyalloc.cuda.detach_oom_observer(fn)
    finally:
        stop.set()
        t.join()
    assert errors and len(set(told)) <= 300
    seen = observe(Recorder())
    refuse()
    assert len(seen.calls) == 1  # none of the 300 left behind


SHUTDOWN = textwrap.dedent(r'''
    import ctypes, sys, pyalloc
    from pyalloc import _C
    sys.path.insert(0, "tests")
    from bridge_api import BridgeApi

    _C._testing_use_fake_devices(64 << 20)

    def broken(*args):
        raise RuntimeError("observer bug")

    pyalloc.cuda.attach_oom_observer(broken)
    try:
        _C._testing_hook_malloc(128 << 20, 0, 0)
    except pyalloc.OutOfMemoryError as e:
        print("caller got:", str(e).split(".")[0])
    pyalloc.cuda.detach_oom_observer(broken)
    counted = []
    pyalloc.cuda.attach_oom_observer(lambda *args: counted.append(1))
    start = ctypes.CDLL(sys.argv[1]).start_failing_thread
    start.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    assert start(BridgeApi().pointer, 128 << 20) == 0
    while len(counted) < 50:
        pass
    print("exiting")
''')


def test_the_interpreter_exits_while_a_thread_runs_out_with_observers_attached(c_threads):
    # A raising observer is printed on stderr and swallowed. At exit, with a
    # thread still failing requests, no observer calls into the interpreter
    # being finalized (on Python 3.11 a thread taking the GIL then is ended
    # where it stands, through the C table's catch-all): the process ends normally.
    for _ in range(3):  # the thread is somewhere else at each exit
        out = subprocess.run([sys.executable, "-c", SHUTDOWN, c_threads], capture_output=True, text=True,
                             timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=os.path.abspath(REPO)))
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["caller got: CUDA out of memory", "exiting"]
        assert "RuntimeError: observer bug" in out.stderr and "Traceback" in out.stderr
