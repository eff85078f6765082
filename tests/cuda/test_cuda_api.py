"""pyalloc's Python API over the CUDA pools, on CPU.

The pools live on fake devices of host memory (see test_cuda_hooks.py); PyTorch's
side is the allocation hook, driven directly. Buffers from reserve_buffer() are
CPU tensors there, over the fake device's memory.
"""
from __future__ import annotations

import gc
import pickle

import pytest

import pyalloc
from pyalloc import _C

MiB = 1 << 20


def hook_malloc(size: int, device: int = 0, stream: int = 0) -> int:
    return _C._testing_hook_malloc(size, device, stream)


def hook_free(ptr: int, device: int = 0) -> None:
    import ctypes

    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_free(ptr, 0, device, None)


def test_stats_have_torchs_keys_and_count_both_pools(fake):
    host = pyalloc.Allocator("host")
    p = hook_malloc(3 * MiB)
    stats = pyalloc.memory_stats(0)
    assert list(stats) == sorted(host.stats())
    assert pyalloc.memory_allocated(0) == 3 * MiB
    assert pyalloc.memory_reserved("cuda:0") == stats["reserved_bytes.all.current"] > 0
    cap = _C.cuda_buffer(0, MiB, 0)  # the buffer pool counts in the same numbers
    assert pyalloc.memory_allocated(0) == 4 * MiB
    del cap
    hook_free(p)
    assert pyalloc.memory_allocated(0) == 0
    assert pyalloc.max_memory_allocated(0) == 4 * MiB
    pyalloc.reset_peak_memory_stats(0)
    assert pyalloc.max_memory_allocated(0) == 0
    assert pyalloc.max_memory_reserved(0) == pyalloc.memory_reserved(0)


def test_reset_accumulated_memory_stats(fake):
    for _ in range(3):
        hook_free(hook_malloc(3 * MiB))
    stats = pyalloc.memory_stats(0)
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 3
    assert stats["num_device_alloc"] >= 1
    reserved = stats["reserved_bytes.all.current"]
    pyalloc.reset_accumulated_memory_stats(0)
    stats = pyalloc.memory_stats(0)
    assert [k for k, v in stats.items() if v and k.endswith((".allocated", ".freed"))] == []
    assert stats["num_device_alloc"] == 0 and stats["reserved_bytes.all.current"] == reserved
    p = hook_malloc(MiB)  # counting goes on from 0
    assert pyalloc.memory_stats(0)["allocation.all.allocated"] == 1
    hook_free(p)


def test_invariants_hold_after_resetting_accumulated_stats_with_blocks_live(fake):
    # The sums start again from 0 while blocks stay allocated: current may
    # exceed the allocated sum, and that is no inconsistency.
    p = hook_malloc(MiB)
    pyalloc.reset_accumulated_memory_stats(0)
    _C.cuda_check_invariants(0)
    hook_free(p)
    _C.cuda_check_invariants(0)
    assert pyalloc.memory_stats(0)["allocation.all.freed"] == 1


def test_buffers_are_never_labelled_as_a_pytorch_pool(fake):
    # The first torch.cuda.MemPool() is (0, 1), the first graph's pool (1, 0).
    cap = _C.cuda_buffer(0, MiB, 0)
    for pid in ((0, 1), (1, 0)):
        _C._testing_pool_hook("begin_allocate_to_pool", 0, pid, [0x5000])
        p = hook_malloc(MiB, stream=0x5000)
        ids = [s["segment_pool_id"] for s in pyalloc.snapshot()["segments"]]
        assert ids.count(pid) == 1 and ids.count(pyalloc.cuda.BUFFER_POOL_ID) == 1
        _C._testing_pool_hook("end_allocate_to_pool", 0, pid)
        hook_free(p)
        _C._testing_pool_hook("release_pool", 0, pid)
    del cap


def test_device_without_pools_reads_as_zero(fake):
    assert pyalloc.memory_allocated(5) == 0
    assert pyalloc.memory_stats(5)["max_split_size"] == -1
    assert pyalloc.fragmentation(5)["free_bytes"] == 0
    assert pyalloc.empty_cache(5) == 0
    assert _C.cuda_devices() == []  # reading created nothing


@pytest.mark.parametrize("device", [True, -1, "cpu", "cuda:x", 1.5])
def test_bad_devices_are_refused(device):
    with pytest.raises((TypeError, ValueError)):
        pyalloc.memory_allocated(device)


def test_fragmentation_empty_cache_and_reserve(fake):
    ptrs = [hook_malloc(2 * MiB) for _ in range(6)]
    for p in ptrs[::2]:
        hook_free(p)
    frag = pyalloc.fragmentation(0)
    assert frag["free_bytes"] >= 6 * MiB and frag["largest_free_block"] < frag["free_bytes"]
    assert 0 < frag["external_fragmentation"] < 1
    for p in ptrs[1::2]:
        hook_free(p)
    assert pyalloc.empty_cache(0) == pyalloc.max_memory_reserved(0)
    assert pyalloc.memory_reserved(0) == 0
    assert pyalloc.reserve(10 * MiB, device=0) == 10 * MiB
    assert pyalloc.reserve("4MiB", device=0) == 0  # a large enough range exists
    assert pyalloc.fragmentation(0)["largest_free_block"] == 10 * MiB
    with pytest.raises(RuntimeError, match="out of memory"):
        pyalloc.reserve(1 << 30, device=0)


def test_memory_summary_of_a_device(fake):
    p = hook_malloc(5 * MiB)
    text = pyalloc.memory_summary(0)
    assert "pyalloc CUDA memory summary, device 0" in text
    assert "Fragmentation of the general pool" in text and "5.0 MiB" in text
    assert len(pyalloc.memory_summary(0, abbreviated=True)) < len(text)
    hook_free(p)


def test_snapshot_and_history_in_torchs_format(fake, tmp_path):
    pyalloc.record_history(True, max_entries=1000)
    p = hook_malloc(MiB)
    q = hook_malloc(4096)
    hook_free(q)
    with pytest.raises(RuntimeError):
        hook_malloc(1 << 30)
    cap = _C.cuda_buffer(0, 2 * MiB, 0)
    snap = pyalloc.snapshot()
    assert {"segments", "device_traces", "allocator_settings"} <= set(snap)
    seg = snap["segments"][0]
    assert {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
            "stream", "segment_type", "segment_pool_id", "is_expandable", "frames",
            "blocks"} <= set(seg)
    assert {"address", "size", "requested_size", "state", "frames"} <= set(seg["blocks"][0])
    assert [s["segment_pool_id"] for s in snap["segments"]] == [(0, 0), pyalloc.cuda.BUFFER_POOL_ID]
    actions = [e["action"] for e in snap["device_traces"][0]]
    # The 4 KiB request borrows a small-pool chunk: the large segment is freed
    # and its pieces (the part below the chunk, the chunk, the part above)
    # allocated, under a segment mapped over the range meanwhile (so that the
    # viewer always has a segment over the live block); the 0-byte segment at
    # its end keeps the viewer's list in address order.
    assert actions[:13] == ["segment_alloc", "alloc",
                            "segment_map", "segment_alloc", "segment_free", "segment_unmap",
                            "segment_alloc", "segment_alloc", "segment_alloc", "segment_unmap",
                            "alloc", "free_requested", "free_completed"]
    assert "oom" in actions and actions[-2:] == ["segment_alloc", "alloc"]
    oom = next(e for e in snap["device_traces"][0] if e["action"] == "oom")
    assert "device_free" in oom and oom["size"] == 1 << 30

    path = tmp_path / "snap.pickle"
    pyalloc.dump_snapshot(str(path))
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == snap["segments"]

    # PyTorch's own readers of the format accept it.
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    assert "total_reserved" in memory_viz.segsum(snap)
    assert "Device 0" in memory_viz.trace(snap)
    assert memory_viz.memory(snap, format_flamegraph=lambda lines: lines)

    pyalloc.record_history(False)
    assert pyalloc.snapshot()["device_traces"][0] == []
    del cap
    hook_free(p)


def test_record_history_applies_to_pools_created_later(fake):
    pyalloc.record_history(max_entries=10)
    hook_free(hook_malloc(4096, device=2))
    traces = pyalloc.snapshot()["device_traces"]
    assert len(traces) == 3 and traces[0] == traces[1] == []
    assert [e["action"] for e in traces[2]][-2:] == ["free_requested", "free_completed"]
    with pytest.raises(ValueError):
        pyalloc.record_history(True, max_entries=0)


def test_graph_memory_api(fake):
    _C.cuda_configure("pool_size:8MiB")
    hook_free(hook_malloc(512))
    _C._testing_set_capture(0x99, 3)
    try:
        p = hook_malloc(MiB, stream=0x99)
        hook_free(p)
    finally:
        _C._testing_set_capture(0x99, 0)
    assert pyalloc.graph_memory(0) == (1, MiB)
    assert "Held for CUDA graphs" in pyalloc.memory_summary(0)
    assert pyalloc.release_graph_memory(0) == MiB
    assert pyalloc.memory_allocated(0) == 0


# -- reserve_buffer ----------------------------------------------------------------------


def test_reserve_buffer_is_a_tensor_apart_from_the_general_pool(fake):
    torch = pytest.importorskip("torch")
    general_before = _C.cuda_stats(0, "general")["reserved_bytes.all.current"]
    t = pyalloc.reserve_buffer(6 * MiB, device=0)
    assert t.dtype == torch.uint8 and t.shape == (6 * MiB,)
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 6 * MiB
    assert _C.cuda_stats(0, "general")["reserved_bytes.all.current"] == general_before
    # It is real memory of the device, usable under any view.
    f = t.view(torch.float32)
    f.fill_(1.5)
    assert float(f.sum()) == 1.5 * f.numel()
    seg = _C.cuda_snapshot_segments(0, "buffers")[0]
    assert seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]
    # The region returns when the last tensor using it dies.
    del t
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 6 * MiB  # f lives
    del f
    gc.collect()
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 0
    _C.cuda_check_invariants(0)


def test_reserve_buffer_errors(fake):
    pytest.importorskip("torch")
    with pytest.raises(ValueError):
        pyalloc.reserve_buffer(0, device=0)
    with pytest.raises(ValueError):
        pyalloc.reserve_buffer(-1, device=0)
    with pytest.raises(RuntimeError, match=r"^CUDA out of memory\..*buffer pool"):
        pyalloc.reserve_buffer("1GiB", device=0)


def test_many_buffers_pack_their_segments(fake):
    pytest.importorskip("torch")
    bufs = [pyalloc.reserve_buffer(3 * MiB, device=0) for _ in range(4)]
    stats = _C.cuda_stats(0, "buffers")
    assert stats["allocated_bytes.all.current"] == 12 * MiB
    assert stats["reserved_bytes.all.current"] <= 16 * MiB
    for i, b in enumerate(bufs):
        b.fill_(i)
    assert [int(b[123]) for b in bufs] == [0, 1, 2, 3]
    del bufs, b
    gc.collect()
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 0


# -- torch's functions answering from pyalloc --------------------------------------------


def test_patched_torch_functions_answer_from_pyalloc(fake):
    torch = pytest.importorskip("torch")
    from pyalloc import _torch_patch
    from pyalloc.cuda import TORCH_REPLACEMENTS

    original = torch.cuda.memory_allocated
    _torch_patch.apply(TORCH_REPLACEMENTS)
    try:
        assert _torch_patch.is_applied()
        p = hook_malloc(2 * MiB)
        assert torch.cuda.memory_allocated(0) == 2 * MiB
        assert torch.cuda.memory.memory_allocated(device=0) == 2 * MiB
        assert torch.cuda.memory_stats(0)["allocated_bytes.all.current"] == 2 * MiB
        assert torch.cuda.memory_reserved(torch.device("cuda", 0)) >= 2 * MiB
        hook_free(p)
        assert torch.cuda.max_memory_allocated("cuda:0") == 2 * MiB
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == 0
        assert torch.cuda.max_memory_reserved(0) == torch.cuda.memory_reserved(0)
        assert "pyalloc" in torch.cuda.memory_summary(0, abbreviated=True)
        # torch's own helpers built on memory_stats follow too.
        with pytest.warns(FutureWarning):
            assert torch.cuda.memory_cached(0) == torch.cuda.memory_reserved(0)
        # With no device given, the current device (0 before CUDA is initialized).
        assert torch.cuda.memory_allocated() == 0
    finally:
        _torch_patch.remove()
    assert torch.cuda.memory_allocated is original
    assert not _torch_patch.is_applied()


def test_frees_wait_for_no_graph_pool_operation(fake):
    """Regression: once graph pools existed every free took the device's graph-pool
    lock, and a free naming no device probed every device under its locks: one
    thread inside a pool's stream filter (or any pool call) stalled every
    deleter of the process."""
    import threading

    from bridge_api import FILTER_FN, OK, BridgeApi

    api = BridgeApi()
    entered, go_on = threading.Event(), threading.Event()

    def accepts(_user, stream):
        if (stream or 0) == 0x71:  # the stalled allocation
            entered.set()
            go_on.wait(20)
        return int((stream or 0) in (0x70, 0x71))

    filt = FILTER_FN(accepts)
    plain = [api.malloc(MiB, device=d, stream=0x10)[1] for d in (0, 1, 1)]
    assert api.begin_allocate_to_pool(0, 0, 81, filt, None) == OK
    in_pool = api.malloc(MiB, stream=0x70)[1]
    stalled = threading.Thread(target=api.malloc, args=(MiB, 0, 0x71))
    stalled.start()
    try:
        assert entered.wait(20)
        done = threading.Event()

        def frees():
            for p in plain + [in_pool]:
                assert api.free(p, 0) == OK, api.error()
            done.set()

        freer = threading.Thread(target=frees)
        freer.start()
        freed_meanwhile = done.wait(5)
    finally:
        go_on.set()
        stalled.join()
    freer.join()
    assert freed_meanwhile, "a free waited for another thread's graph-pool allocation"
    assert api.end_allocate_to_pool(0, 0, 81) == OK
    for p in api.values("pool_live_blocks", 0, 0, 81):
        assert api.free(p, 0) == OK
    assert api.release_pool(0, 0, 81) == OK


def test_fake_device_without_virtual_memory_says_nothing_of_vmm():
    """bench_core's fake device offers no virtual memory: pools asked for vmm run
    bestfit there without telling stderr that a trial mapping failed (a device
    that offers it and refuses it still says so: test_cuda_backend_stub.py)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    prog = ("from benchmarks.bench_core import device_pair_ns\n"
            "from pyalloc import _C\n"
            "assert _C.cuda_config()['strategy'] == 'vmm'\n"
            "device_pair_ns('hooks', 4096, 2000, 1)\n")
    out = subprocess.run([sys.executable, "-c", prog], cwd=root, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert "cannot use strategy vmm" not in out.stderr, out.stderr


# -- without pools: no device, or pyalloc not installed ---------------------------------

READERS = ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
           "max_memory_reserved", "fragmentation", "memory_summary", "graph_memory")


@pytest.fixture
def no_pools():
    """pyalloc as a process without a GPU has it: not installed, no pools, no fake devices."""
    if _C.cuda_devices() or _C.cuda_is_installed() or _C._testing_fake_devices():
        pytest.skip("this process has pyalloc's CUDA pools")


def test_without_a_cuda_device_the_stats_say_so_rather_than_read_zero(no_pools, monkeypatch, tmp_path):
    """Regression: without a GPU, fragmentation(), memory_stats(), memory_reserved()
    and memory_summary() returned zeros and an empty table. Every function that reads
    the pools' figures raises NotOnCudaError (a RuntimeError) saying why there are
    none and where to get figures without a GPU; those that act do nothing."""
    def no_driver():
        raise RuntimeError("pyalloc's CUDA backend cannot load the CUDA driver library libcuda.so.1")

    monkeypatch.setattr(_C, "cuda_device_count", no_driver)
    calls = [(name, lambda f=getattr(pyalloc, name): f(0)) for name in READERS]
    calls += [("snapshot", pyalloc.snapshot),
              ("dump_snapshot", lambda: pyalloc.dump_snapshot(str(tmp_path / "s.pickle")))]
    for name, call in calls:
        with pytest.raises(pyalloc.NotOnCudaError) as e:
            call()
        message = str(e.value)
        assert message.startswith(f"pyalloc.{name}(): there is no CUDA device in this process"), message
        assert "cannot load the CUDA driver library" in message
        assert "pyalloc.Allocator" in message and "pyalloc.replay.replay" in message
        assert isinstance(e.value, RuntimeError)
    assert not (tmp_path / "s.pickle").exists()
    # What acts on the pools has nothing to act on.
    assert pyalloc.empty_cache(0) == 0 and pyalloc.release_graph_memory(0) == 0
    pyalloc.reset_peak_memory_stats(0)
    pyalloc.reset_accumulated_memory_stats(0)
    pyalloc.record_history(True)
    pyalloc.record_history(False)
    assert _C.cuda_devices() == []
    # The figures without a GPU, from an Allocator.
    a = pyalloc.Allocator("virtual")
    a.free(a.malloc(MiB))
    assert a.stats()["reserved_bytes.all.current"] > 0


def test_with_a_device_but_not_installed_the_stats_say_to_install(no_pools, monkeypatch):
    monkeypatch.setattr(_C, "cuda_device_count", lambda: 2)
    with pytest.raises(pyalloc.NotOnCudaError, match=r"pyalloc.memory_reserved\(\): pyalloc is not PyTorch's "
                                                     r"CUDA allocator.*cuda:1.*pyalloc.install\(\)"):
        pyalloc.memory_reserved(1)
    with pytest.raises(pyalloc.NotOnCudaError, match=r"there is no cuda:2 \(the CUDA driver sees 2 device"):
        pyalloc.fragmentation("cuda:2")


def test_without_a_gpu_the_stats_raise_here_too(no_pools):
    """Unpatched, on whatever this machine has: never zeros."""
    with pytest.raises(pyalloc.NotOnCudaError):
        pyalloc.memory_stats(0)
