"""The C interface between the bridge (csrc/torch_bridge/) and pyalloc._C, on CPU.

The bridge reaches pyalloc's pools only through the table that
``pyalloc_bridge_api_get`` returns (csrc/cuda/bridge_api.h). These tests call
that table through ctypes over fake devices of host memory, as the bridge
calls it over real ones, and check that the C declarations and the ctypes
mirror (tests/bridge_api.py) agree byte for byte.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import subprocess
import threading
import time

import pytest

import pyalloc
from pyalloc import _C

from bridge_api import INVALID, OK, OUT_OF_MEMORY, Api, BlockInfo, BridgeApi, DeviceStats
from bridge_api import FILTER_FN, FREE_MEMORY_FN, VALUE_FN, LiveBlock, OomInfo, SegmentInfo, TraceEntry, checkpoint, restore
from bridge_api import OWNER_NONE, OWNER_OTHER, OWNER_POOLS, VERSION, MemoryUsage

MiB = 1 << 20
CAPACITY = 64 * MiB
HEADER_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")


def test_the_table_is_versioned(api):
    assert api.version == VERSION == 2
    assert api.size == ctypes.sizeof(Api)
    assert api.pyalloc_version.decode() == pyalloc.__version__
    assert not api.get(3), "a version this pyalloc does not offer must give NULL"
    assert not api.get(0)
    # Version 1 is still offered: the members before version 2's.
    v1 = api.get(1).contents
    assert v1.version == 1 and v1.size == Api.record_stream_owned.offset
    assert ctypes.cast(v1.free, ctypes.c_void_p).value == ctypes.cast(api.free, ctypes.c_void_p).value


def test_a_version_1_bridge_gets_version_1s_oom_info(fake):
    # A bridge of version 1 passes room for version 1's pyalloc_oom_info only:
    # nothing may be written past it.
    v1 = BridgeApi(1)
    room = OomInfo.rejected.offset
    buf = (ctypes.c_ubyte * (room + 16))(*([0xEE] * (room + 16)))
    out = ctypes.c_void_p()
    status = v1.table.malloc(0, 10 * CAPACITY, None, 0, ctypes.byref(out),
                             ctypes.cast(buf, ctypes.POINTER(OomInfo)))
    assert status == OUT_OF_MEMORY
    assert int.from_bytes(bytes(buf[:8]), "little") == 10 * CAPACITY  # requested
    assert bytes(buf[room:]) == b"\xee" * 16


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to read the header")
def test_the_header_and_its_ctypes_mirror_agree(tmp_path):
    # A C compiler's sizes and offsets of the header's types, against ctypes'.
    checks = {
        "pyalloc_oom_info": OomInfo, "pyalloc_device_stats": DeviceStats,
        "pyalloc_block_info": BlockInfo, "pyalloc_segment_info": SegmentInfo,
        "pyalloc_trace_entry": TraceEntry, "pyalloc_live_block": LiveBlock,
        "pyalloc_memory_usage": MemoryUsage,
        "pyalloc_bridge_api": Api,
    }
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "cuda/bridge_api.h"',
             "int main(void) {"]
    for c_name in checks:
        lines.append(f'  printf("{c_name} %zu\\n", sizeof({c_name}));')
    for field, _ in Api._fields_:
        lines.append(f'  printf("api.{field} %zu\\n", offsetof(pyalloc_bridge_api, {field}));')
    lines.append("  return 0;\n}")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c99", "-Wall", "-Werror", "-I", HEADER_DIR, str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    seen = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                        text=True).stdout.splitlines())
    for c_name, mirror in checks.items():
        assert int(seen[c_name]) == ctypes.sizeof(mirror), c_name
    for field, _ in Api._fields_:
        assert int(seen[f"api.{field}"]) == getattr(Api, field).offset, field


def torch_counters(device_stats):
    """The device's stats as the bridge's table carries them: torch's keys, not
    pyalloc's own num_driver_calls."""
    return {k: v for k, v in device_stats.items() if k != "num_driver_calls"}


def test_malloc_free_and_stats(api, fake):
    status, p, _ = api.malloc(3 * MiB, device=0, stream=0)
    assert status == OK and p != 0
    stats = api.stats(0)
    assert {**stats, **api.pool_reserved(0)} == torch_counters(_C.cuda_device_stats(0))
    assert stats["allocated_bytes.all.current"] == 3 * MiB
    assert stats["requested_bytes.all.current"] == 3 * MiB
    assert api.free(p, 0) == OK
    assert api.stats(0)["allocated_bytes.all.current"] == 0
    # Size 0 is PyTorch's to ask for: nullptr, as its own allocator answers.
    assert api.malloc(0)[:2] == (OK, 0)
    assert api.free(None, 0) == OK


def test_bad_pointers_are_errors_not_crashes(api, fake):
    status, p, _ = api.malloc(MiB)
    assert status == OK
    assert api.free(p, 0) == OK
    assert api.free(p, 0) == INVALID
    assert "double free" in api.error()
    assert api.free(0xDEAD0000, 0) == INVALID
    assert "not a pointer from pyalloc" in api.error()
    assert api.malloc(MiB, device=-3)[0] == INVALID
    assert "invalid CUDA device index" in api.error()


def test_out_of_memory_says_why_and_keeps_live_blocks(api, fake):
    status, live, _ = api.malloc(8 * MiB)
    assert status == OK
    ctypes.memset(live, 0x5A, 8 * MiB)
    status, p, oom = api.malloc(10 * CAPACITY)
    assert (status, p) == (OUT_OF_MEMORY, 0)
    assert api.error().startswith("CUDA out of memory.")
    assert oom.requested == 10 * CAPACITY
    assert oom.allocated == 8 * MiB
    assert oom.reserved >= 8 * MiB
    assert oom.device_total == CAPACITY
    assert 0 < oom.device_free <= CAPACITY
    assert ctypes.string_at(live, 8 * MiB) == b"\x5a" * (8 * MiB)
    assert api.free(live, 0) == OK


def test_out_of_memory_runs_pytorchs_free_memory_callbacks_first(api, fake):
    # PyTorch's allocator runs the FreeCudaMemoryCallbacksRegistry callbacks (torch's
    # cuda_ipc_collect: blocks sent to other processes that every receiver let go) when
    # no cached block fits. Through the bridge they never ran, so a process that sent
    # tensors ran out of memory where PyTorch's allocator frees them and goes on.
    assert api.size >= Api.set_free_memory_hook.offset + ctypes.sizeof(ctypes.c_void_p)
    _, held, _ = api.malloc(40 * MiB)  # a block sent away and let go: only the callback frees it
    calls = []

    def collect(_user):
        # The first time, an allocation inside it that fails (counted) does not run it again.
        calls.append(api.malloc(10 * CAPACITY)[0] if not calls else "again")
        nonlocal held
        if not held:
            return 0
        assert api.free(held, 0) == OK  # its frees come back into pyalloc: no pools lock is held
        held = 0
        return 1

    hook = FREE_MEMORY_FN(collect)
    assert api.table.set_free_memory_hook(hook, None) == OK
    try:
        _, small, _ = api.malloc(8 * MiB)
        assert calls == []  # only a request the pools cannot serve runs it
        result = []
        worker = threading.Thread(target=lambda: result.append(api.malloc(40 * MiB)), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "the free-memory hook deadlocked"
        status, p, _ = result[0]
        assert status == OK and p != 0 and calls == [OUT_OF_MEMORY]
        assert api.stats(0)["num_ooms"] == 1  # the callback's own; a failure a retry mends is no error
        # Nothing left to free: the error, counted once, after the callback ran.
        status, q, _ = api.malloc(40 * MiB)
        assert (status, q) == (OUT_OF_MEMORY, 0) and calls == [OUT_OF_MEMORY, "again"]
        assert api.error().startswith("CUDA out of memory.") and api.stats(0)["num_ooms"] == 2
        assert api.free(p, 0) == OK and api.free(small, 0) == OK
    finally:
        assert api.table.set_free_memory_hook(FREE_MEMORY_FN(), None) == OK
    status, q, _ = api.malloc(10 * CAPACITY)
    assert status == OUT_OF_MEMORY and len(calls) == 2  # no hook: nothing runs
    assert not BridgeApi(1).table.set_free_memory_hook  # not in version 1's table


def test_errors_are_per_call(api, fake):
    api.free(0xDEAD0000, 0)
    assert api.error() != ""
    status, p, _ = api.malloc(MiB)
    assert status == OK and api.error() == ""
    api.free(p, 0)


def test_context_tags_follow_pytorch_history_rules(api, fake):
    assert api.record_history(1, 1000, 0) == OK
    try:
        status, p, _ = api.malloc(5 * MiB, context=7)
        assert status == OK
        live = [b for s in api.snapshot(0) for b in s["blocks"] if b["allocated"]]
        assert [b["context"] for b in live] == [7]
        assert 7 in api.values("contexts_in_use")
        assert api.free(p, 9) == OK
        events = api.history(0)
        by_action = {}
        for e in events:
            by_action.setdefault(e["action"], []).append(e["context"])
        assert by_action["alloc"] == [7]
        assert set(by_action["segment_alloc"]) == {7}  # caused by the tagged malloc
        assert by_action["free_requested"] == [9]  # the free's own context
        assert by_action["free_completed"] == [7]  # the allocation's
        now = time.time() * 1e6
        assert all(abs(e["time_us"] - now) < 60e6 for e in events), "time_us is Unix time"
        assert all(e["pool_id"] == (0, 0) for e in events)
        # Cleared history, nothing live: no tag is held any more.
        assert api.record_history(1, 1000, 1) == OK
        assert api.history(0) == []
        assert api.values("contexts_in_use") == []
    finally:
        api.record_history(0, 0, 1)


def test_untagged_free_keeps_the_allocation_context(api, fake):
    api.record_history(1, 100, 1)
    try:
        _, p, _ = api.malloc(MiB, context=11)
        api.free(p, 0)
        tags = {e["action"]: e["context"] for e in api.history(0)}
        assert tags["free_requested"] == 11 and tags["free_completed"] == 11
    finally:
        api.record_history(0, 0, 1)


def test_graph_pools_route_by_the_filter(api, fake):
    accepted = {5}
    seen = []

    def accepts(_user, stream):
        seen.append(stream or 0)
        return int((stream or 0) in accepted)

    filt = FILTER_FN(accepts)  # kept alive until end_allocate_to_pool
    assert api.begin_allocate_to_pool(0, 1, 0, filt, None) == OK
    _, in_pool, _ = api.malloc(3 * MiB, stream=5)
    _, general, _ = api.malloc(3 * MiB, stream=6)
    assert api.end_allocate_to_pool(0, 1, 0) == OK
    assert 5 in seen and 6 in seen
    assert api.values("pool_live_blocks", 0, 1, 0) == [in_pool]
    pools = {s["pool_id"] for s in api.snapshot(0) if s["blocks"]}
    assert (1, 0) in pools and (0, 0) in pools
    assert {s["pool_id"] for s in api.snapshot(0, pool_id=(1, 0))} == {(1, 0)}
    count = ctypes.c_int()
    assert api.pool_use_count(0, 1, 0, ctypes.byref(count)) == OK and count.value == 1
    # The device's stats count the graph pool too, as PyTorch's do, and
    # each private pool's reserved bytes apart.
    assert api.stats(0)["allocated_bytes.all.current"] == 6 * MiB
    assert api.pool_reserved(0)["reserved_bytes_by_private_pools.1_0.all.current"] >= 3 * MiB
    assert {**api.stats(0), **api.pool_reserved(0)} == torch_counters(_C.cuda_device_stats(0))
    assert api.release_pool(0, 1, 0) == OK
    assert api.pool_use_count(0, 1, 0, ctypes.byref(count)) == OK and count.value == 0
    api.free(in_pool, 0)
    api.free(general, 0)
    assert api.values("pool_live_blocks", 0, 1, 0) == []
    # A MemPool's pool: created with one use, one more, then dropped.
    assert api.create_or_incref_pool(0, 0, 3) == OK
    assert api.create_or_incref_pool(0, 0, 3) == OK
    assert api.pool_use_count(0, 0, 3, ctypes.byref(count)) == OK and count.value == 2


def test_the_newest_route_wins(api, fake):
    """Regression (issue 53, item 1): PyTorch's allocator searches the routes being
    recorded newest first, so torch.cuda.use_mem_pool(P) opened inside
    torch.cuda.graph(g) sends the capture's allocations to P. pyalloc took the
    oldest route: the capture's pool got them and P stayed empty."""
    on_7 = FILTER_FN(lambda _u, s: int((s or 0) == 7))  # the capture: its stream only
    every = FILTER_FN(lambda _u, s: 1)  # use_mem_pool: every stream
    assert api.begin_allocate_to_pool(0, 1, 0, on_7, None) == OK
    assert api.begin_allocate_to_pool(0, 0, 5, every, None) == OK
    _, inner, _ = api.malloc(MiB, stream=7)
    assert api.values("pool_live_blocks", 0, 0, 5) == [inner]
    assert api.values("pool_live_blocks", 0, 1, 0) == []
    assert api.end_allocate_to_pool(0, 0, 5) == OK  # use_mem_pool exits: the capture's route again
    _, outer, _ = api.malloc(MiB, stream=7)
    _, general, _ = api.malloc(MiB, stream=8)
    assert api.values("pool_live_blocks", 0, 1, 0) == [outer]
    assert api.end_allocate_to_pool(0, 1, 0) == OK
    for p in (inner, outer, general):
        api.free(p, 0)
    assert api.release_pool(0, 1, 0) == OK and api.release_pool(0, 0, 5) == OK
    assert api.empty_cache(0) == OK
    assert _C.cuda_graph_pools(0) == []


def test_a_second_route_into_a_pool_being_recorded_to_is_refused(api, fake):
    """Regression (issue 53, item 2): PyTorch's beginAllocateToPool refuses a pool
    already being recorded to ("already recording to mempool_id"). pyalloc took a
    second route (torch.cuda.graph(g, pool=P.id) on one thread, use_mem_pool(P) on
    another) and the first end stopped the oldest: the capture's own route."""
    capture = FILTER_FN(lambda _u, s: int((s or 0) == 1))
    other = FILTER_FN(lambda _u, s: int((s or 0) == 2))
    count = ctypes.c_int()
    assert api.begin_allocate_to_pool(0, 2, 0, capture, None) == OK
    assert api.begin_allocate_to_pool(0, 2, 0, other, None) == INVALID
    assert "already recording to mempool_id" in api.error() and "(2, 0)" in api.error()
    assert api.pool_use_count(0, 2, 0, ctypes.byref(count)) == OK and count.value == 1  # no use taken
    _, a, _ = api.malloc(MiB, stream=1)
    _, general, _ = api.malloc(MiB, stream=2)  # the refused route sends nothing to the pool
    assert api.values("pool_live_blocks", 0, 2, 0) == [a]
    assert api.end_allocate_to_pool(0, 2, 0) == OK  # the one route there is ends
    _, b, _ = api.malloc(MiB, stream=1)
    assert api.values("pool_live_blocks", 0, 2, 0) == [a]
    # Once it has ended, the pool may be recorded to again.
    assert api.begin_allocate_to_pool(0, 2, 0, other, None) == OK
    _, c, _ = api.malloc(MiB, stream=2)
    assert sorted(api.values("pool_live_blocks", 0, 2, 0)) == sorted([a, c])
    assert api.end_allocate_to_pool(0, 2, 0) == OK
    for p in (a, b, c, general):
        api.free(p, 0)
    assert api.release_pool(0, 2, 0) == OK and api.release_pool(0, 2, 0) == OK
    assert api.empty_cache(0) == OK
    assert _C.cuda_graph_pools(0) == []


def test_an_end_never_leaves_a_route_whose_filter_the_bridge_dropped(api, fake):
    """Regression: the bridge drops the filters of a pool's earlier routes when a
    route into it begins or ends. A capture that failed (its route never ended)
    left a route that, once healed, stayed routed while a retried capture into the
    same pool went on, and pyalloc went on calling its filter: after the bridge
    had freed it. A retry while the failed route still counts as a capture is
    refused, as PyTorch refuses a second route into a pool being recorded to."""
    stream = 0x77
    capture_id = [0]

    def capture(cid):
        capture_id[0] = cid
        _C._testing_set_capture(stream, cid)

    calls = []

    def accepts_capture(cid):
        def accepts(_user, s):  # as PyTorch's filters: this capture's stream only
            calls.append(cid)
            return int((s or 0) == stream and capture_id[0] == cid)
        return FILTER_FN(accepts)

    failed, retried = accepts_capture(45), accepts_capture(46)
    assert api.begin_allocate_to_pool(0, 9, 0, failed, None) == OK
    capture(45)
    _, g, _ = api.malloc(MiB, stream=stream)  # the failed capture's stream is seen
    capture(0)  # cudaStreamEndCapture fails: this route's end never comes
    assert api.begin_allocate_to_pool(0, 9, 0, retried, None) == INVALID  # retried at once
    assert "already recording" in api.error()
    api.free(api.malloc(512, stream=1)[1], 0)  # the failed capture's stream is seen done
    time.sleep(_C.cuda_route_heal_grace() + 0.1)
    api.free(api.malloc(512, stream=1)[1], 0)  # the failed capture's route heals
    assert api.begin_allocate_to_pool(0, 9, 0, retried, None) == OK  # the bridge drops `failed`
    capture(46)
    _, h, _ = api.malloc(MiB, stream=stream)
    capture(0)
    assert api.end_allocate_to_pool(0, 9, 0) == OK
    calls.clear()
    _, k, _ = api.malloc(MiB, stream=stream)
    assert 45 not in calls and 46 not in calls  # no route left calls a dropped filter
    assert api.values("pool_live_blocks", 0, 9, 0) == sorted([g, h])
    for p in (g, h, k):
        api.free(p, 0)
    assert api.release_pool(0, 9, 0) == OK
    assert api.release_pool(0, 9, 0) == OK
    assert api.empty_cache(0) == OK
    assert _C.cuda_graph_pools(0) == []


def cached_on_device_1(api) -> None:
    """8 MiB cached on device 1: empty_cache releases it unless a capture is underway."""
    _, p, _ = api.malloc(8 * MiB, device=1)
    assert api.free(p, 0) == OK
    assert api.stats(1)["reserved_bytes.all.current"] >= 8 * MiB


def released_on_device_1(api) -> bool:
    assert api.empty_cache(-1) == OK
    return api.stats(1)["reserved_bytes.all.current"] == 0


@pytest.mark.parametrize("marked", [0, 1], ids=["routes_count", "captures_marked"])
def test_a_capture_abandoned_after_its_mark_counts_no_longer(api, fake, marked):
    """Regression (issue 53, item 11): torch 2.13 marks a capture after
    cudaStreamBeginCapture and unmarks it in capture_end, before it ends the
    route. A capture abandoned in between (CUDAGraph::reset() ends its route and
    releases its pool, with no markCaptureEnd) left the mark open: a capture
    underway for good, nothing released on any device again."""
    filt = FILTER_FN(lambda _u, s: int((s or 0) == 0x70))
    if marked:
        assert api.set_captures_marked(1) == OK
    cached_on_device_1(api)
    assert api.begin_allocate_to_pool(0, 0, 70, filt, None) == OK
    assert api.mark_capture(0, 1) == OK  # markCaptureBegin: the capture has begun
    assert not released_on_device_1(api)
    # reset() of the abandoned graph: its route ends, its pool goes; no mark's end.
    assert api.end_allocate_to_pool(0, 0, 70) == OK
    assert api.release_pool(0, 0, 70) == OK
    assert released_on_device_1(api)
    assert api.mark_capture(0, 0) == OK  # a late end finds no mark: ignored
    # A capture that ends as torch 2.13 ends it still counts until its mark ends,
    # and another capture's mark is not taken for it.
    cached_on_device_1(api)
    assert api.begin_allocate_to_pool(0, 0, 71, filt, None) == OK
    assert api.mark_capture(0, 1) == OK
    assert api.mark_capture(0, 0) == OK
    assert api.end_allocate_to_pool(0, 0, 71) == OK
    assert released_on_device_1(api)
    cached_on_device_1(api)
    assert api.begin_allocate_to_pool(0, 0, 72, filt, None) == OK
    assert api.mark_capture(0, 1) == OK
    assert api.release_pool(0, 0, 71) == OK  # the first graph goes: not this capture
    assert not released_on_device_1(api)
    assert api.mark_capture(0, 0) == OK
    assert api.end_allocate_to_pool(0, 0, 72) == OK
    assert released_on_device_1(api)
    assert api.release_pool(0, 0, 72) == OK


def test_on_torch_2_13_a_route_alone_is_no_capture(api, fake):
    """Regression (issue 53, item 11): from torch 2.13 PyTorch marks each capture
    (markCaptureBegin/End) apart from routing a pool, which use_mem_pool, NCCL
    registration and CUDA-graph trees' warm-up do with no capture; its allocator
    defers event processing for the marks alone. pyalloc counted every open route
    as a capture on every device: inside use_mem_pool nothing was released and no
    event asked about, and each free waited."""
    every = FILTER_FN(lambda _u, s: 1)
    assert api.set_captures_marked(1) == OK  # the bridge, built against torch 2.13+
    try:
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 73, every, None) == OK  # use_mem_pool(P)
        _, p, _ = api.malloc(MiB, stream=3)
        assert api.values("pool_live_blocks", 0, 0, 73) == [p]
        assert released_on_device_1(api)  # no capture is underway
        cached_on_device_1(api)
        assert api.mark_capture(0, 1) == OK  # a capture begins inside it: that counts
        assert not released_on_device_1(api)
        assert api.mark_capture(0, 0) == OK
        assert released_on_device_1(api)
        assert api.end_allocate_to_pool(0, 0, 73) == OK
        api.free(p, 0)
        assert api.release_pool(0, 0, 73) == OK
    finally:
        assert api.set_captures_marked(0) == OK


def test_on_torch_2_13_a_capture_counts_from_its_route_to_its_mark(api, fake):
    """Regression: torch 2.13's capture_begin routes the pool, then calls
    cudaStreamBeginCapture, then marks the capture. Where PyTorch marks its
    captures a route counted as no capture at all, so between the route and the
    mark another thread's release or event query ran into the capture as it
    began. A route now counts from its begin until its capture's mark, or until
    it serves a stream found not capturing (use_mem_pool), or its end."""
    stream = 0x79
    capture = FILTER_FN(lambda _u, s: int((s or 0) == stream))
    every = FILTER_FN(lambda _u, s: 1)
    assert api.set_captures_marked(1) == OK
    try:
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 74, capture, None) == OK
        assert not released_on_device_1(api)  # cudaStreamBeginCapture comes next
        _C._testing_set_capture(stream, 47)
        assert api.mark_capture(0, 1) == OK  # the mark takes over
        assert not released_on_device_1(api)
        _C._testing_set_capture(stream, 0)
        assert api.mark_capture(0, 0) == OK
        assert released_on_device_1(api)  # the route alone counts no longer
        assert api.end_allocate_to_pool(0, 0, 74) == OK
        # use_mem_pool(P): a capture until its first allocation shows a stream
        # that is not capturing; an allocation on a capturing stream does not.
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 75, every, None) == OK
        assert not released_on_device_1(api)
        _C._testing_set_capture(stream, 48)
        _, a, _ = api.malloc(MiB, stream=stream)
        _C._testing_set_capture(stream, 0)
        assert not released_on_device_1(api)
        _, b, _ = api.malloc(MiB, stream=3)
        assert released_on_device_1(api)
        assert api.values("pool_live_blocks", 0, 0, 75) == sorted([a, b])
        assert api.end_allocate_to_pool(0, 0, 75) == OK
        # One that never allocates counts until its end.
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 76, every, None) == OK
        assert not released_on_device_1(api)
        assert api.end_allocate_to_pool(0, 0, 76) == OK
        assert released_on_device_1(api)
        for p in (a, b):
            api.free(p, 0)
        for pool in (74, 75, 76):
            assert api.release_pool(0, 0, pool) == OK
    finally:
        _C._testing_set_capture(stream, 0)
        assert api.set_captures_marked(0) == OK

def test_on_torch_2_13_a_mark_takes_over_only_its_own_threads_route(api, fake):
    """capture_begin routes, begins the capture and marks it on one thread: a
    mark takes over the count from its own thread's route only. Another
    thread's route, whose capture is about to begin, counts on."""
    capture = FILTER_FN(lambda _u, s: int((s or 0) == 0x7B))
    other = FILTER_FN(lambda _u, s: int((s or 0) == 0x7C))
    assert api.set_captures_marked(1) == OK
    try:
        cached_on_device_1(api)
        begun = []
        t = threading.Thread(target=lambda: begun.append(api.begin_allocate_to_pool(0, 0, 80, other, None)))
        t.start()
        t.join()
        assert begun == [OK]
        assert api.begin_allocate_to_pool(0, 0, 81, capture, None) == OK
        assert api.mark_capture(0, 1) == OK
        assert api.mark_capture(0, 0) == OK
        assert api.end_allocate_to_pool(0, 0, 81) == OK
        assert not released_on_device_1(api)  # the other thread's capture has not begun yet
        assert api.end_allocate_to_pool(0, 0, 80) == OK
        assert released_on_device_1(api)
        assert api.release_pool(0, 0, 80) == OK and api.release_pool(0, 0, 81) == OK
    finally:
        assert api.set_captures_marked(0) == OK


def test_on_torch_2_13_a_marked_capture_that_failed_heals(api, fake):
    """Regression: when cudaStreamEndCapture fails, torch 2.13's capture_end
    neither unmarks the capture nor ends its route; a graph kept (no reset())
    left the mark open for good: nothing released, no event processed on any
    device. Its capturing streams are now remembered, and once found done for
    the grace period the mark ends and the route counts no longer, as a route
    left open does before torch 2.13."""
    stream = 0x7A
    capture_id = [0]
    capture = FILTER_FN(lambda _u, s: int((s or 0) == stream and capture_id[0] == 49))
    assert api.set_captures_marked(1) == OK
    try:
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 77, capture, None) == OK
        capture_id[0] = 49
        _C._testing_set_capture(stream, 49)
        assert api.mark_capture(0, 1) == OK
        _, g, _ = api.malloc(MiB, stream=stream)
        assert api.values("pool_live_blocks", 0, 0, 77) == [g]
        _C._testing_set_capture(stream, 0)  # cudaStreamEndCapture fails: no mark end, no route end
        capture_id[0] = 0
        assert not released_on_device_1(api)  # its stream is seen done
        time.sleep(_C.cuda_route_heal_grace() + 0.1)
        assert released_on_device_1(api)  # healed
        assert api.mark_capture(0, 0) == OK  # a late end finds no mark: ignored
        # The next capture counts from its route to its mark's end.
        cached_on_device_1(api)
        assert api.begin_allocate_to_pool(0, 0, 78, capture, None) == OK
        assert not released_on_device_1(api)
        assert api.mark_capture(0, 1) == OK
        assert not released_on_device_1(api)
        assert api.mark_capture(0, 0) == OK
        assert released_on_device_1(api)
        assert api.end_allocate_to_pool(0, 0, 78) == OK
        # The healed route gives way to a new one into its pool.
        assert api.begin_allocate_to_pool(0, 0, 77, capture, None) == OK
        assert api.end_allocate_to_pool(0, 0, 77) == OK
        api.free(g, 0)
        assert api.release_pool(0, 0, 77) == OK and api.release_pool(0, 0, 77) == OK
        assert api.release_pool(0, 0, 78) == OK
        assert api.empty_cache(0) == OK
        assert _C.cuda_graph_pools(0) == []
    finally:
        _C._testing_set_capture(stream, 0)
        assert api.set_captures_marked(0) == OK


def test_pool_calls_on_a_pool_that_does_not_exist_raise(api, fake):
    """Regression (issue 53, item 11): PyTorch's checkPoolLiveAllocations raises
    "Could not find pool of id" and getPoolUseCount asserts for a pool that does
    not exist; pyalloc answered an empty pool (CUDA-graph trees' check passed) and 0."""
    count = ctypes.c_int()
    for device in (0, 1):  # device 1 has no pools at all yet
        assert api.pool_use_count(device, 0, 99, ctypes.byref(count)) == INVALID
        assert "Could not find pool of id" in api.error() and "(0, 99)" in api.error()
        status = api.pool_live_blocks(device, 0, 99, VALUE_FN(lambda _u, v: None), None)
        assert status == INVALID and "Could not find pool of id" in api.error()
    assert api.create_or_incref_pool(0, 0, 99) == OK
    assert api.pool_use_count(0, 0, 99, ctypes.byref(count)) == OK and count.value == 1
    assert api.values("pool_live_blocks", 0, 0, 99) == []
    assert api.release_pool(0, 0, 99) == OK
    assert api.empty_cache(0) == OK  # the pool is gone
    assert api.pool_use_count(0, 0, 99, ctypes.byref(count)) == INVALID


def test_cache_info_fraction_and_resets(api, fake):
    _, p, _ = api.malloc(4 * MiB)
    api.free(p, 0)
    largest = ctypes.c_uint64()
    assert api.cache_info(0, ctypes.byref(largest)) == OK
    assert largest.value >= 4 * MiB
    assert largest.value >= _C.cuda_fragmentation(0)["largest_free_block"]
    # The memory fraction caps the pool: cacheInfo offers what is cached, and
    # of the device's free memory no more than the cap allows.
    assert api.set_memory_fraction(0, 0.25) == OK
    frac = ctypes.c_double()
    assert api.memory_fraction(0, ctypes.byref(frac)) == OK and frac.value == 0.25
    assert api.cache_info(0, ctypes.byref(largest)) == OK
    cached = _C.cuda_fragmentation(0)["largest_free_block"]
    reserved = api.stats(0)["reserved_bytes.all.current"]
    assert largest.value == max(cached, max(CAPACITY // 4 - reserved, 0))
    assert api.set_memory_fraction(0, 1.5) == INVALID
    before = api.stats(0)
    assert before["allocation.all.allocated"] == 1
    assert api.reset_accumulated_stats(0) == OK
    after = api.stats(0)
    assert after["allocation.all.allocated"] == 0 and after["allocation.all.freed"] == 0
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert api.reset_peak_stats(0) == OK
    assert api.empty_cache(-1) == OK
    assert api.stats(0)["reserved_bytes.all.current"] == 0


def test_base_alloc_and_record_stream(api, fake):
    _, p, _ = api.malloc(3 * MiB)
    size = ctypes.c_uint64()
    base = api.base_alloc(p + 4096, ctypes.byref(size))
    assert base <= p and base + size.value >= p + 3 * MiB
    assert api.base_alloc(0x1000, ctypes.byref(size)) == 0x1000 and size.value == 0
    assert api.record_stream(p, 3) == OK
    assert api.free(p, 0) == OK


def test_route_settings_and_init(api, fake):
    assert api.set_route(2) == OK
    assert _C.cuda_route() == "bridge" and pyalloc.is_installed()
    assert api.set_route(7) == INVALID
    assert api.init(3) == OK and _C.cuda_hook_device_count() == 3
    buf = ctypes.create_string_buffer(512)
    assert api.settings(buf, 512) == OK
    assert "strategy:" in buf.value.decode()
    assert api.settings(buf, 4) == INVALID


def test_a_pool_checkpoint_is_restored_at_the_same_addresses(api, fake):
    # What torch.compile's CUDA-graph trees do between recordings.
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 4, 0, filt, None) == OK
    ptrs = [api.malloc(size, stream=0)[1] for size in (3 * MiB, 700 * 1024, 5 * MiB, 4096)]
    api.free(ptrs[1], 0)
    saved = checkpoint(api, 0, (4, 0))
    assert sorted(p for p, _, _ in saved) == sorted([ptrs[0], ptrs[2], ptrs[3]])
    assert {p: s for p, s, _ in saved}[ptrs[2]] == 5 * MiB
    # The pool moves on: a checkpointed block is freed, a new one appears.
    api.free(ptrs[2], 0)
    _, extra, _ = api.malloc(2 * MiB)
    assert api.end_allocate_to_pool(0, 4, 0) == OK

    status, freed, allocated = restore(api, 0, (4, 0), saved)
    assert status == OK, api.error()
    # As PyTorch's allocator reports it: every block live before is freed,
    # every checkpointed one allocated (ptrs[0] and ptrs[3] are in both).
    assert sorted(freed) == sorted([extra, ptrs[0], ptrs[3]])
    assert sorted(allocated) == sorted([ptrs[2], ptrs[0], ptrs[3]])
    assert sorted(api.values("pool_live_blocks", 0, 4, 0)) == sorted(p for p, _, _ in saved)
    _C.cuda_check_invariants(0)
    # Restoring blocks whose memory is taken is an error, not a corruption.
    status, _, _ = restore(api, 0, (9, 9), saved)
    assert status == INVALID and "no longer exists" in api.error()
    for p, _, _ in saved:
        assert api.free(p, 0) == OK


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_library_exports_only_its_entry_points():
    # PyTorch and the bridge look up pyalloc_* by name; nothing else of ours
    # (no C++ template instantiation) may be bound to from another library.
    out = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True,
                         text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "PyInit__C" in names and "pyalloc_bridge_api_get" in names and "pyalloc_malloc" in names
    assert [n for n in names if n != "PyInit__C" and not n.startswith("pyalloc_")] == []


def test_a_failed_restore_changes_nothing(api, fake):
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 6, 0, filt, None) == OK
    _, a, _ = api.malloc(2 * MiB)
    _, b, _ = api.malloc(3 * MiB)
    assert api.end_allocate_to_pool(0, 6, 0) == OK
    before = sorted(checkpoint(api, 0, (6, 0)))
    # A checkpoint that keeps a, drops b, and wants a block inside a's range:
    # impossible, so the pool must be left exactly as it was (b still live).
    bad = [(a, 2 * MiB, 0), (a + MiB, 4096, 0)]
    status, freed, allocated = restore(api, 0, (6, 0), bad)
    assert status == INVALID and "not free" in api.error()
    assert (freed, allocated) == ([], [])
    assert sorted(checkpoint(api, 0, (6, 0))) == before
    _C.cuda_check_invariants(0)
    api.free(a, 0)
    api.free(b, 0)


@pytest.mark.parametrize("bad_block", [
    lambda base: (base + 512, 1 << 63, 0),          # no device holds it
    lambda base: (0xDEAD0000, 4096, 0),             # no memory of the pool
    lambda base: (base + 1024, 512, 7),             # overlaps the block restored before it
], ids=["huge", "foreign", "overlapping"])
def test_a_restore_refused_after_a_block_on_another_stream_keeps_the_live_block(api, fake, bad_block):
    """A restore that dropped a live block, made a block inside its memory on
    another stream, then met a block it could not make, freed the new block
    and could not make the dropped one again (its memory was now split by
    stream): the pool lost a block PyTorch still held, and freeing it was
    refused. Blocks that cannot be made are now refused before any change."""
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 9, 0, filt, None) == OK
    _, live, _ = api.malloc(3 * MiB)
    assert api.end_allocate_to_pool(0, 9, 0) == OK
    before = checkpoint(api, 0, (9, 0))
    status, freed, allocated = restore(api, 0, (9, 0), [(live + 512, 1024, 7), bad_block(live)])
    assert status == INVALID and api.error()
    assert (freed, allocated) == ([], [])
    assert checkpoint(api, 0, (9, 0)) == before
    _C.cuda_check_invariants(0)
    assert api.free(live, 0) == OK, api.error()
    assert api.release_pool(0, 9, 0) == OK


def recorded_block_in_a_pool(api, pool, size, stream):
    """A live block of graph pool `pool` on device 0, also used on `stream` (record_stream)."""
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, *pool, filt, None) == OK
    status, ptr, _ = api.malloc(size)
    assert status == OK, api.error()
    assert api.end_allocate_to_pool(0, *pool) == OK
    assert api.record_stream(ptr, stream) == OK, api.error()
    return ptr


def pool_state(api, pool):
    """What a restore that fails must leave as it was: the pool's allocated
    blocks as its allocator holds them (address, bytes, request, tag) and the
    device's current counts."""
    blocks = []
    for seg in api.snapshot(0, pool):
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["allocated"]:
                blocks.append((addr, b["size"], b["requested_size"], b["context"]))
            addr += b["size"]
    stats = api.stats()
    return sorted(blocks), {k: v for k, v in stats.items() if k.endswith(".current")}


def refused_leaving_all_as_it_was(api, pool, blocks, error=""):
    """Restores graph pool `pool` of device 0 to `blocks`, which must be
    refused (with `error` in the reason) with every live block as it was."""
    before, state = checkpoint(api, 0, pool), pool_state(api, pool)
    status, freed, allocated = restore(api, 0, pool, blocks)
    assert status == INVALID and error in api.error(), api.error()
    assert (freed, allocated) == ([], [])
    assert checkpoint(api, 0, pool) == before
    assert pool_state(api, pool) == state
    _C.cuda_check_invariants(0)


@contextlib.contextmanager
def a_block_and_a_free_waiting_on_stream_5(api, size, waiting_size, record_block=False):
    """Graph pool (9, 0) of device 0 with a live block of `size` bytes (also
    used on stream 5 if record_block) and the memory of a freed block of
    `waiting_size` bytes whose free waits on stream 5, busy meanwhile:
    (block, freed block)."""
    x = recorded_block_in_a_pool(api, (9, 0), size, 5) if record_block else None
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 9, 0, filt, None) == OK
    if x is None:
        _, x, _ = api.malloc(size)
    _, z, _ = api.malloc(waiting_size)
    assert api.end_allocate_to_pool(0, 9, 0) == OK
    assert api.record_stream(z, 5) == OK
    _C._testing_stream(0, 5, True)
    try:
        assert api.free(z, 0) == OK
        yield x, z
    finally:
        _C._testing_stream(0, 5, False)


def test_a_restore_into_a_block_recorded_on_a_finished_stream(api, fake):
    """A restore freed a block PyTorch had used on another stream
    (record_stream), which left it a pending free until the next malloc, and
    then failed to make a checkpointed block inside its memory; the undo could
    not make the dropped block again either: the restore failed and the pool
    lost a block PyTorch still held. The stream's work is done, so the restore
    goes through."""
    x = recorded_block_in_a_pool(api, (9, 0), 20 * MiB, 5)
    status, freed, allocated = restore(api, 0, (9, 0), [(x + 2 * MiB, 1, 1)])
    assert status == OK, api.error()
    assert (freed, allocated) == ([x], [x + 2 * MiB])
    assert checkpoint(api, 0, (9, 0)) == [(x + 2 * MiB, 1, 1)]
    _C.cuda_check_invariants(0)
    assert api.free(x + 2 * MiB, 0) == OK, api.error()
    assert api.release_pool(0, 9, 0) == OK


def test_a_restore_into_a_block_recorded_on_a_busy_stream_changes_nothing(api, fake):
    """While stream 5 may still use the dropped block, its memory cannot be
    given to a checkpointed block: the restore is refused before it changes
    anything, and goes through once the stream's work is done."""
    x = recorded_block_in_a_pool(api, (9, 0), 20 * MiB, 5)
    _C._testing_stream(0, 5, True)
    try:
        refused_leaving_all_as_it_was(api, (9, 0), [(x + 2 * MiB, 1, 1)], "record_stream")
    finally:
        _C._testing_stream(0, 5, False)
    status, freed, allocated = restore(api, 0, (9, 0), [(x + 2 * MiB, 1, 1)])
    assert status == OK, api.error()
    assert api.free(x + 2 * MiB, 0) == OK, api.error()
    assert api.release_pool(0, 9, 0) == OK


def test_a_failed_restore_keeps_a_dropped_block_whose_free_would_wait(api, fake):
    """A restore freed every dropped block first: one recorded on a busy stream
    became a pending free, which the undo of a later failure could not make
    again. Such blocks are freed only once every checkpointed block is made."""
    with a_block_and_a_free_waiting_on_stream_5(api, 4 * MiB, 4 * MiB, record_block=True) as (x, z):
        assert checkpoint(api, 0, (9, 0)) == [(x, 4 * MiB, 0)]
        # z's memory is not free yet: the block cannot be made, and x, which the
        # checkpoint drops, must still be live afterwards.
        refused_leaving_all_as_it_was(api, (9, 0), [(z, 4 * MiB, 0)], "not free")
    assert api.free(x, 0) == OK, api.error()
    assert api.release_pool(0, 9, 0) == OK


def test_a_failed_restore_makes_a_dropped_block_again_whatever_streams_were_made_inside_it(api, fake):
    """The undo of a failed restore frees the blocks it made and makes the
    dropped ones again: a block made inside a dropped one on another stream
    left the freed memory in pieces of two streams, which did not merge while
    neither was safe for the other, so the dropped block could not be made
    again and the pool lost it."""
    with a_block_and_a_free_waiting_on_stream_5(api, 20 * MiB, 4 * MiB) as (x, z):
        refused_leaving_all_as_it_was(api, (9, 0), [(x + 2 * MiB, MiB, 1), (z, 4 * MiB, 0)], "not free")
    assert api.free(x, 0) == OK, api.error()
    assert api.release_pool(0, 9, 0) == OK


def test_a_failed_restore_gives_a_dropped_block_back_its_tag_and_its_recorded_streams(api, fake):
    """The undo made a dropped block again from its address, request and
    stream alone: its tag was lost, and so were the streams record_stream had
    named, so that its next free no longer waited for them and its memory went
    to the next allocation while stream 5 could still be using it."""
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 9, 0, filt, None) == OK
    _, d, _ = api.malloc(4 * MiB, 0, 0, 1234)
    _, z, _ = api.malloc(4 * MiB)
    assert api.end_allocate_to_pool(0, 9, 0) == OK
    assert api.record_stream(d, 5) == OK  # stream 5 is idle: d can be freed at once
    assert api.record_stream(z, 6) == OK
    _C._testing_stream(0, 6, True)
    try:
        assert api.free(z, 0) == OK  # waits on stream 6
        refused_leaving_all_as_it_was(api, (9, 0), [(d + MiB, MiB, 0), (z, 4 * MiB, 0)], "not free")
        assert api.block_context(d) == 1234
        # d is still recorded on stream 5: its free waits while stream 5 works.
        _C._testing_stream(0, 5, True)
        assert api.free(d, 0) == OK
        assert api.begin_allocate_to_pool(0, 9, 0, filt, None) == OK
        _, e, _ = api.malloc(4 * MiB)
        assert api.end_allocate_to_pool(0, 9, 0) == OK
        assert e != d, "d's memory went to another block while stream 5 may still use it"
        assert api.free(e, 0) == OK
    finally:
        _C._testing_stream(0, 5, False)
        _C._testing_stream(0, 6, False)
    assert api.release_pool(0, 9, 0) == OK


@pytest.fixture
def oversize(fake):
    """Fake devices whose pools never split blocks of 4 MiB or more, so that a
    block can hold far more than its request (the fake fixture's reset drops
    the setting)."""
    _C.cuda_configure("max_split_size:4194304")


def test_a_restore_into_the_tail_of_an_oversize_block(api, oversize):
    """A dropped block's memory reaches past its request when the pool kept
    it whole: a checkpointed block in that tail was taken for memory of no
    dropped block, which was then freed only after the checkpointed block
    was refused."""
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 9, 0, filt, None) == OK
    _, d, _ = api.malloc(6 * MiB)  # never split: it holds its whole 20 MiB segment
    assert api.end_allocate_to_pool(0, 9, 0) == OK
    assert pool_state(api, (9, 0))[0][0][1] > 8 * MiB, "the test needs a block past its request"
    status, freed, allocated = restore(api, 0, (9, 0), [(d + 8 * MiB, MiB, 0)])
    assert status == OK, api.error()
    assert (freed, allocated) == ([d], [d + 8 * MiB])
    _C.cuda_check_invariants(0)
    assert api.free(d + 8 * MiB, 0) == OK
    assert api.release_pool(0, 9, 0) == OK


def test_a_failed_restore_gives_an_oversize_block_back_whole(api, oversize):
    """The undo made a dropped block again at its request's size: an oversize
    block came back 14 MiB short, a free block in its place, and the pool's
    counts changed."""
    with a_block_and_a_free_waiting_on_stream_5(api, 6 * MiB, 2 * MiB) as (d, z):
        refused_leaving_all_as_it_was(api, (9, 0), [(d + 2 * MiB, MiB, 0), (z, 2 * MiB, 0)], "not free")
    assert api.free(d, 0) == OK
    assert api.release_pool(0, 9, 0) == OK


def test_restore_after_small_blocks_took_a_freed_range(api, fake):
    # A freed 1 MiB block's range is reused by small allocations; the
    # checkpoint still gets the 1 MiB block back at its address.
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 7, 0, filt, None) == OK
    _, big, _ = api.malloc(MiB)
    _, keep, _ = api.malloc(4096)
    saved = checkpoint(api, 0, (7, 0))
    api.free(big, 0)
    smalls = [api.malloc(4096)[1] for _ in range(8)]
    assert any(big <= p < big + MiB for p in smalls), "the small blocks were meant to reuse the range"
    assert api.end_allocate_to_pool(0, 7, 0) == OK
    status, freed, allocated = restore(api, 0, (7, 0), saved)
    assert status == OK, api.error()
    assert sorted(freed) == sorted(smalls + [keep]) and sorted(allocated) == sorted([big, keep])
    assert sorted(api.values("pool_live_blocks", 0, 7, 0)) == sorted([big, keep])
    _C.cuda_check_invariants(0)
    api.free(big, 0)
    api.free(keep, 0)


def test_restore_lists_a_block_live_before_and_after_in_both_lists(api, fake):
    # torch.compile's CUDA-graph trees (addStorageDeleterFns) give a live
    # storage its deleter back only if its pointer is among those allocated,
    # and count as definitely freed only pointers not allocated again: a block
    # live across a restore must be in both lists, as PyTorch's allocator puts it.
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 8, 0, filt, None) == OK
    _, out, _ = api.malloc(2 * MiB)
    _, tmp, _ = api.malloc(MiB)
    assert api.end_allocate_to_pool(0, 8, 0) == OK
    saved = checkpoint(api, 0, (8, 0))
    status, freed, allocated = restore(api, 0, (8, 0), saved)
    assert status == OK, api.error()
    assert sorted(freed) == sorted([out, tmp]) and sorted(allocated) == sorted([out, tmp])
    # Live once, still: one free each.
    assert sorted(api.values("pool_live_blocks", 0, 8, 0)) == sorted([out, tmp])
    assert api.stats(0)["allocation.all.current"] == 2
    # A checkpoint that keeps one and drops the other.
    status, freed, allocated = restore(api, 0, (8, 0), [b for b in saved if b[0] == out])
    assert status == OK, api.error()
    assert sorted(freed) == sorted([out, tmp]) and allocated == [out]
    assert api.values("pool_live_blocks", 0, 8, 0) == [out]
    _C.cuda_check_invariants(0)
    assert api.free(out, 0) == OK
    assert api.free(tmp, 0) == INVALID  # freed by the restore


def test_a_block_on_another_stream_is_made_again_on_the_checkpoints_stream(api, fake):
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 10, 0, filt, None) == OK
    _, p, _ = api.malloc(MiB, stream=0)
    assert api.end_allocate_to_pool(0, 10, 0) == OK
    status, freed, allocated = restore(api, 0, (10, 0), [(p, MiB, 5)])
    assert status == OK, api.error()
    assert (freed, allocated) == ([p], [p])
    assert checkpoint(api, 0, (10, 0)) == [(p, MiB, 5)]
    api.free(p, 0)


def graph_output(api, pool):
    """A block of a private pool, as CUDA-graph trees keep their outputs, and
    an empty checkpoint of the pool from before it."""
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, *pool, filt, None) == OK
    empty = checkpoint(api, 0, pool)
    _, p, _ = api.malloc(2 * MiB, stream=0)
    assert api.end_allocate_to_pool(0, *pool) == OK
    return p, empty, checkpoint(api, 0, pool)


def test_record_stream_of_a_storage_that_owns_nothing_leaves_graph_pools_alone(api, fake):
    # A CUDA-graph tree's output is a storage with c10::detail::deleteNothing
    # over a live block of the tree's pool. record_stream on it must not pin
    # the block: the next restore frees it and a later one allocates it again.
    p, empty, full = graph_output(api, (11, 0))
    _C._testing_stream(0, 3, True)  # work queued on stream 3 that has not run
    try:
        assert api.record_stream_owned(p, 3, OWNER_NONE) == OK
        assert restore(api, 0, (11, 0), empty)[0] == OK
        status, _, allocated = restore(api, 0, (11, 0), full)
        assert status == OK, api.error()
        assert allocated == [p]
    finally:
        _C._testing_stream(0, 3, False)
    api.free(p, 0)


def test_record_stream_of_a_block_pyalloc_handed_out_pins_it(api, fake):
    # The same block, its storage with the bridge's deleter: the event keeps
    # it from being taken while stream 3's work is queued (and so the
    # restore that wants it back fails cleanly, as with PyTorch's allocator).
    p, empty, full = graph_output(api, (12, 0))
    _C._testing_stream(0, 3, True)
    try:
        assert api.record_stream_owned(p, 3, OWNER_POOLS) == OK
        assert restore(api, 0, (12, 0), empty)[0] == OK
        status, freed, allocated = restore(api, 0, (12, 0), full)
        assert status == INVALID and "not free" in api.error()
        assert (freed, allocated) == ([], [])
    finally:
        _C._testing_stream(0, 3, False)
    _C.cuda_check_invariants(0)


def test_record_stream_with_another_deleter_acts_only_on_buffers(api, fake):
    # Another deleter: DLPack, which reserve_buffer()'s tensors have, or
    # another library's memory. A graph-pool block is not pinned by it.
    p, empty, full = graph_output(api, (13, 0))
    _C._testing_stream(0, 3, True)
    try:
        assert api.record_stream_owned(p, 3, OWNER_OTHER) == OK
        assert restore(api, 0, (13, 0), empty)[0] == OK
        assert restore(api, 0, (13, 0), full)[0] == OK, api.error()
        assert api.record_stream_owned(0xDEAD0000, 3, OWNER_OTHER) == OK  # not pyalloc's: ignored
        # A reserve_buffer() block is pyalloc's: pinned, so once its tensor
        # dies it waits for stream 3 before it is free.
        cap = _C.cuda_buffer(0, MiB, 0)
        buf = _C.cuda_snapshot_segments(0, "buffers")[0]["blocks"][0]["address"]
        assert api.record_stream_owned(buf + 4096, 3, OWNER_OTHER) == OK  # inside it: not a block
        assert api.record_stream_owned(buf, 3, OWNER_OTHER) == OK
        del cap
        gc.collect()
        states = [b["state"] for b in _C.cuda_snapshot_segments(0, "buffers")[0]["blocks"]]
        assert states[0] == "active_pending_free", states
    finally:
        _C._testing_stream(0, 3, False)
    api.free(p, 0)
    assert api.record_stream_owned(None, 3, OWNER_POOLS) == OK
    assert api.record_stream_owned(0xDEAD0000, 3, OWNER_POOLS) == INVALID
    assert "pyalloc's deleter" in api.error()
    assert api.record_stream_owned(p, 3, 9) == INVALID


@pytest.mark.parametrize("size", [(1 << 56) + 1, 1 << 60, (1 << 64) - 1])
def test_a_request_no_device_could_hold_is_out_of_memory(api, fake, size):
    # PyTorch's allocator answers it with torch.cuda.OutOfMemoryError (its
    # cudaMalloc fails); the bridge raises that for PYALLOC_OUT_OF_MEMORY.
    before = api.stats(0)
    status, p, oom = api.malloc(size)
    assert (status, p) == (OUT_OF_MEMORY, 0)
    assert api.error().startswith("CUDA out of memory.") and "larger than any device" in api.error()
    assert oom.requested == size and oom.rejected == 1
    after = api.stats(0)
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["num_oom_rejections"] == before["num_oom_rejections"] + 1
    _C.cuda_check_invariants(0)


def test_requests_refused_at_once_are_oom_rejections(api, fake):
    # Refused from figures already known, before anything is released or
    # reserved: by the memory fraction's cap, as PyTorch's
    # throw_on_cudamalloc_oom refuses, and by the device's free memory.
    _, live, _ = api.malloc(8 * MiB)
    assert api.set_memory_fraction(0, 0.5) == OK
    status, _, oom = api.malloc(30 * MiB)
    assert status == OUT_OF_MEMORY and oom.rejected == 1
    assert api.stats(0)["num_oom_rejections"] == 1
    assert api.set_memory_fraction(0, 1.0) == OK
    status, _, oom = api.malloc(2 * CAPACITY)
    assert status == OUT_OF_MEMORY and oom.rejected == 1
    s = api.stats(0)
    assert (s["num_oom_rejections"], s["num_ooms"], s["num_alloc_retries"]) == (2, 2, 0)
    api.free(live, 0)


def test_an_oom_after_trying_is_no_rejection(api, fake):
    # Fragmented: the device and the cache together have room, but no block
    # is large enough and the segments holding live blocks cannot go back.
    ps = [api.malloc(6 * MiB)[1] for _ in range(8)]
    for p in ps[::2]:
        assert api.free(p, 0) == OK
    status, _, oom = api.malloc(20 * MiB)
    assert status == OUT_OF_MEMORY and oom.rejected == 0
    s = api.stats(0)
    assert (s["num_ooms"], s["num_oom_rejections"]) == (1, 0)
    for p in ps[1::2]:
        api.free(p, 0)


def test_block_context_is_the_tag_malloc_was_given(api, fake):
    # PyTorch's getContextForPointer (torch.cuda.memory._allocation_traceback):
    # the bridge maps the tag to the recorded stack trace.
    _, p, _ = api.malloc(3 * MiB, context=42)
    _, q, _ = api.malloc(4096)
    assert api.block_context(p) == 42
    assert api.block_context(q) == 0  # allocated without a context
    assert api.block_context(p + 4096) == 0  # not an allocation's start
    assert api.block_context(0xDEAD0000) == 0 and api.block_context(0) == 0
    filt = FILTER_FN(lambda _u, _s: 1)
    assert api.begin_allocate_to_pool(0, 14, 0, filt, None) == OK
    _, g, _ = api.malloc(MiB, context=43)
    assert api.end_allocate_to_pool(0, 14, 0) == OK
    assert api.block_context(g) == 43  # a private pool's block
    for ptr in (p, q, g):
        assert api.free(ptr, 0) == OK
    assert api.block_context(p) == 0  # freed


# -- the bridge's allocation step (csrc/torch_bridge/allocate.h), built without torch --------

ALLOCATE_HARNESS = r'''
#include <cstdio>
#include "torch_bridge/allocate.h"

// The bridge's alloc() with the OOM observers replaced by `observer`.
extern "C" int harness_alloc(const pyalloc_bridge_api* api, uint64_t size, void (*observer)(void),
                             char* message, size_t len, uint64_t* requested) {
  void* out = nullptr;
  pyalloc_bridge::AllocFailure failure;
  int status = pyalloc_bridge::allocate(api, 0, size, nullptr, 0, &out, &failure,
                                        [&](const pyalloc_bridge::AllocFailure&) { observer(); });
  std::snprintf(message, len, "%s", failure.message.c_str());
  *requested = failure.oom.requested;
  if (status == PYALLOC_OK && out != nullptr) api->free(out, 0);
  return status;
}
'''


@pytest.fixture(scope="module")
def allocate_step(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the bridge's allocation step")
    d = tmp_path_factory.mktemp("allocate")
    (d / "harness.cpp").write_text(ALLOCATE_HARNESS)
    lib = d / "harness.so"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror", "-I", HEADER_DIR,
                    str(d / "harness.cpp"), "-o", str(lib)], check=True, capture_output=True, text=True)
    harness = ctypes.CDLL(str(lib)).harness_alloc
    harness.restype = ctypes.c_int
    harness.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                        ctypes.POINTER(ctypes.c_uint64)]
    return harness


def test_bridge_oom_message_survives_an_observer_that_calls_pyalloc(api, fake, allocate_step):
    # Regression: through the bridge, torch.cuda.OutOfMemoryError('') on the
    # GPU. PyTorch's OOM observer (the dump of _record_memory_history) takes a
    # snapshot, the next call into pyalloc on the thread; it succeeds and so
    # clears the thread's last error before the bridge read it.
    _, live, _ = api.malloc(8 * MiB)
    seen = []

    def observer():
        seen.append(len(api.snapshot(0)))
        seen.append(api.error())  # what the thread's last error is now

    callback = ctypes.CFUNCTYPE(None)(observer)
    message = ctypes.create_string_buffer(4096)
    requested = ctypes.c_uint64()
    status = allocate_step(ctypes.cast(api.pointer, ctypes.c_void_p), 10 * CAPACITY,
                           ctypes.cast(callback, ctypes.c_void_p), message, len(message), ctypes.byref(requested))
    assert status == OUT_OF_MEMORY
    assert seen and seen[0] >= 1 and seen[1] == "", seen  # the observer ran, and cleared the error
    assert message.value.decode().startswith("CUDA out of memory. Tried to allocate "), message.value
    assert requested.value == 10 * CAPACITY
    # Only an out-of-memory error runs the observers; another error keeps its message too.
    seen.clear()
    status = allocate_step(ctypes.cast(api.pointer, ctypes.c_void_p), MiB,
                           ctypes.cast(callback, ctypes.c_void_p), message, len(message), ctypes.byref(requested))
    assert (status, seen, message.value) == (OK, [], b"")
    assert api.free(live, 0) == OK


# -- what the bridge tells PyTorch's profiler ---------------------------------------------


def test_memory_usage_gives_the_profiler_what_pytorchs_allocator_reports(api, fake):
    # PyTorch's allocator reports (ptr, block bytes, allocated, reserved, device)
    # at each malloc and (ptr, -block bytes, ...) at each free: the bridge asks
    # memory_usage for those figures.
    assert api.size >= Api.memory_usage.offset + ctypes.sizeof(ctypes.c_void_p)
    _, p, _ = api.malloc(3 * MiB + 1)
    _, q, _ = api.malloc(1000)
    stats = api.stats(0)
    u = api.memory_usage(p, device=0)
    assert u.device == 0 and u.size >= 3 * MiB + 1
    assert (u.allocated, u.reserved) == (stats["allocated_bytes.all.current"], stats["reserved_bytes.all.current"])
    small = api.memory_usage(q)  # device -1: the allocation's device
    assert small.device == 0 and 1000 <= small.size < MiB
    assert u.size + small.size == stats["allocated_bytes.all.current"]  # the bytes allocated_bytes counts
    assert api.free(p, 0) == OK
    after = api.memory_usage(device=0)  # the free's report: the device's figures after it
    assert (after.size, after.allocated) == (0, stats["allocated_bytes.all.current"] - u.size)
    assert after.reserved == api.stats(0)["reserved_bytes.all.current"]
    gone = api.memory_usage(p)  # freed: no allocation, no device to ask about
    assert (gone.device, gone.size, gone.allocated, gone.reserved) == (-1, 0, 0, 0)
    assert api.memory_usage(0xDEAD0000).size == 0
    assert api.memory_usage(device=5).allocated == 0  # a device without pools
    assert api.table.memory_usage(-7, None, ctypes.byref(MemoryUsage())) == INVALID
    assert api.free(q, 0) == OK
    assert not BridgeApi(1).table.memory_usage  # not in version 1's table


def test_reserved_bytes_count_graph_pools_as_pytorch_and_torch_2_14_define_them(api, fake):
    # torch.cuda.memory_reserved() is reserved_bytes.all.current: PyTorch's
    # allocator counts its private pools in it, and torch 2.14's cudaMallocAsync
    # backend now counts its graph memory too. So does the bridge's table.
    status, p, _ = api.malloc(3 * MiB)
    before = api.stats(0)["reserved_bytes.all.current"]
    filt = FILTER_FN(lambda _u, s: int((s or 0) == 5))
    assert api.begin_allocate_to_pool(0, 0, 21, filt, None) == OK
    status, q, _ = api.malloc(5 * MiB, stream=5)
    assert api.end_allocate_to_pool(0, 0, 21) == OK
    pool = api.pool_reserved(0)["reserved_bytes_by_private_pools.0_21.all.current"]
    assert pool >= 5 * MiB
    assert api.stats(0)["reserved_bytes.all.current"] == before + pool
    assert api.release_pool(0, 0, 21) == OK
    assert api.free(q, 0) == OK and api.empty_cache(-1) == OK
    assert api.stats(0)["reserved_bytes.all.current"] <= before
    assert api.pool_reserved(0)["reserved_bytes_by_private_pools.0_21.all.current"] == 0
    assert api.free(p, 0) == OK


def test_record_stream_with_another_devices_default_stream_waits_for_that_device(api, fake):
    """Regression (issue 53, item 7): record_stream with device 1's default
    stream on a block of device 0. Both default streams have the handle 0; the
    device was dropped on the way, and the event went to device 0's default
    stream: the block was reused while device 1 could still read it, and
    waited on device 0's work instead. As PyTorch's insert_events, the event
    now goes to the stream's own device."""
    assert api.malloc(MiB, device=1)[0] == OK  # device 1's pools, and streams, exist
    _, p, _ = api.malloc(3 * MiB, device=0)
    _C._testing_stream(1, 0, True)  # device 1's default stream has work queued
    try:
        assert api.record_stream_on(p, None, 1, OWNER_POOLS) == OK, api.error()
        assert api.free(p, 0) == OK
        _, q, _ = api.malloc(3 * MiB, device=0)
        assert q != p, "device 0 reused a block device 1's queued work may still read"
        assert api.stats(0)["active_bytes.all.current"] == 6 * MiB
    finally:
        _C._testing_stream(1, 0, False)
    _, r, _ = api.malloc(3 * MiB, device=0)
    assert r == p  # device 1 is done with it
    # Device 0's own default stream is no part of it.
    _C._testing_stream(0, 0, True)
    try:
        assert api.record_stream_on(r, None, 1, OWNER_POOLS) == OK, api.error()
        assert api.free(r, 0) == OK
        api.free(api.malloc(512, device=0, stream=0x1000)[1], 0)  # pending frees are looked at
        assert api.stats(0)["active_bytes.all.current"] == 3 * MiB
    finally:
        _C._testing_stream(0, 0, False)
    assert api.free(q, 0) == OK
    _C.cuda_check_invariants(0)


def test_cuda_stream_per_thread_is_each_threads_own_through_the_table(api, fake):
    """Regression (issue 53, item 4): as through the hooks, cudaStreamPerThread
    (0x2) is the calling thread's own stream; a block freed with work queued on
    one thread's goes to no other thread's until that work is done."""
    seen = {}

    def worker():
        _, p, _ = api.malloc(MiB, device=0, stream=0x2)
        seen.update(p=p, stream=_C._testing_per_thread_stream())
        _C._testing_stream(0, seen["stream"], True)
        assert api.free(p, 0) == OK

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    try:
        _, q, _ = api.malloc(MiB, device=0, stream=0x2)
        assert q != seen["p"], "a thread got a block another thread's queued work may still use"
        assert {seg["stream"] for seg in api.snapshot(0)} == {0x2}
    finally:
        _C._testing_stream(0, seen["stream"], False)
    assert api.free(q, 0) == OK
    _C.cuda_check_invariants(0)


# -- registration_counter, by which ProcessGroupNCCL.register_mem_pool orders segments ----


def containing(segments, ptr):
    seg, = [s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"]]
    return seg


def test_snapshot_segments_carry_the_order_their_memory_was_made_in(api, fake):
    # torch 2.13's SegmentInfo has registration_counter; registerMemPool (2.14.1)
    # sorts a pool's segments by it and refuses one below 0, which the bridge
    # left at -1. PyTorch numbers memory as it obtains it (cudaMalloc, a new
    # expandable segment); pyalloc numbers each unit as it maps it, process-wide.
    assert api.fills("registration_counter")
    _, a, _ = api.malloc(3 * MiB)
    _, b, _ = api.malloc(40 * MiB)  # a segment of its own, made after a's
    for units in (False, True):
        segs = api.snapshot(0, units=units)
        assert all(s["registration_counter"] >= 0 for s in segs), segs
        assert containing(segs, a)["registration_counter"] < containing(segs, b)["registration_counter"]
    units = api.snapshot(0, units=True)
    assert len({s["registration_counter"] for s in units}) == len(units)  # one number a unit
    made = max(s["registration_counter"] for s in units)
    # A MemPool's segments, as register_mem_pool reads them (snapshot of its id):
    # numbered after everything before them, whatever their addresses.
    filt = FILTER_FN(lambda _u, s: int((s or 0) == 5))
    assert api.begin_allocate_to_pool(0, 0, 23, filt, None) == OK
    _, q, _ = api.malloc(5 * MiB, stream=5)
    assert api.end_allocate_to_pool(0, 0, 23) == OK
    for units in (False, True):
        pool_segs = api.snapshot(0, pool_id=(0, 23), units=units)
        assert pool_segs and all(s["registration_counter"] > made for s in pool_segs), pool_segs
    assert api.free(q, 0) == OK and api.release_pool(0, 0, 23) == OK
    # Memory given back and mapped again is new memory: a new number.
    assert api.free(b, 0) == OK and api.empty_cache(-1) == OK
    _, c, _ = api.malloc(40 * MiB)
    assert containing(api.snapshot(0), c)["registration_counter"] > made
    assert api.free(a, 0) == OK and api.free(c, 0) == OK


def test_a_version_1_bridge_is_told_no_segment_info_member_is_appended():
    assert BridgeApi(1).table.size <= Api.segment_info_size.offset


SEGMENT_FIELDS_HARNESS = r'''
#include <cstdint>
#include "torch_bridge/segment_fields.h"

// SegmentInfo's layouts: before registration_counter (torch 2.9) and with it (2.13).
struct Before { int device = 0; std::size_t address = 0; };
struct With { int device = 0; int32_t registration_counter = -1; std::size_t address = 0; };

extern "C" int harness_before(int64_t counter) {
  Before seg;
  pyalloc_bridge::set_registration_counter(seg, counter);
  return seg.device;
}
extern "C" int32_t harness_with(int64_t counter) {
  With seg;
  pyalloc_bridge::set_registration_counter(seg, counter);
  return seg.registration_counter;
}
'''


def test_the_bridge_sets_registration_counter_where_segment_info_has_it(tmp_path):
    # The bridge compiles against torch 2.9 and newer: the member is set where the
    # torch it is built against has it, and its absence is no compile error.
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "harness.cpp").write_text(SEGMENT_FIELDS_HARNESS)
    lib = tmp_path / "harness.so"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror", "-I", HEADER_DIR,
                    str(tmp_path / "harness.cpp"), "-o", str(lib)], check=True, capture_output=True, text=True)
    harness = ctypes.CDLL(str(lib))
    harness.harness_before.argtypes = harness.harness_with.argtypes = [ctypes.c_int64]
    harness.harness_with.restype = ctypes.c_int32
    assert harness.harness_before(12) == 0
    assert harness.harness_with(12) == 12
    assert harness.harness_with(1 << 40) == (1 << 31) - 1  # never negative, which registerMemPool refuses


# ---------------------------------------------------------------------------
# torch.cuda.MemPool's options (issue 47, item 1): PyTorch's setUseOnOOM and
# setNoSplit, which the bridge refused as unsupported.

EVERY_STREAM = FILTER_FN(lambda _u, _s: 1)  # use_mem_pool's route: the thread's every stream


def has_pool_options(api):
    return api.size >= Api.set_pool_no_split.offset + ctypes.sizeof(ctypes.c_void_p)


def fill_pool(api, pool_id, sizes):
    """Allocations routed to the pool (use_mem_pool), as PyTorch routes them."""
    assert api.begin_allocate_to_pool(0, *pool_id, EVERY_STREAM, None) == OK
    try:
        return [api.malloc(size)[1] for size in sizes]
    finally:
        assert api.end_allocate_to_pool(0, *pool_id) == OK


def pool_blocks(api, pool_id):
    """[(segment bytes, [(block bytes, allocated)])] of the pool, smallest first."""
    segments = sorted(api.snapshot(0, pool_id=pool_id), key=lambda s: (s["total_size"], s["address"]))
    return [(s["total_size"], [(b["size"], b["allocated"]) for b in s["blocks"]]) for s in segments]


def test_a_no_split_pool_never_splits_a_block(api, fake):
    """MemPool(no_split=True): PyTorch's should_split answers false for every
    block of the pool (CUDACachingAllocator.cpp, should_split over
    no_split_pools), so each allocation holds a block of its own and a cached
    block larger than a request serves it whole. pyalloc refused the option."""
    assert has_pool_options(api), "the table has no set_pool_no_split"
    assert api.create_or_incref_pool(0, 0, 9) == OK
    assert api.set_pool_no_split(0, 0, 9) == OK
    a, b = fill_pool(api, (0, 9), [MiB, 3 * MiB])
    # Each allocation a segment of its own, of exactly what it needs (2 MiB
    # units), held whole: no free remainder is left to serve anyone else.
    assert pool_blocks(api, (0, 9)) == [(2 * MiB, [(2 * MiB, True)]), (4 * MiB, [(4 * MiB, True)])]
    assert api.free(b, 0) == OK
    c, = fill_pool(api, (0, 9), [MiB])
    assert c == b  # the cached 4 MiB block, best fit, taken whole
    assert pool_blocks(api, (0, 9)) == [(2 * MiB, [(2 * MiB, True)]), (4 * MiB, [(4 * MiB, True)])]
    assert api.stats(0)["allocated_bytes.all.current"] == 6 * MiB  # PyTorch counts the whole blocks too
    _C.cuda_check_invariants(0)
    # The same requests in an ordinary pool split the cached block.
    assert api.create_or_incref_pool(0, 0, 10) == OK
    d, = fill_pool(api, (0, 10), [3 * MiB])
    assert api.free(d, 0) == OK
    e, = fill_pool(api, (0, 10), [MiB])
    assert [blocks for _, blocks in pool_blocks(api, (0, 10))] == [[(MiB, True), (19 * MiB, False)]]
    for p in (a, c, e):
        assert api.free(p, 0) == OK
    for pool in ((0, 9), (0, 10)):
        assert api.release_pool(0, *pool) == OK
    # A pool that does not exist, as PyTorch's pool calls raise.
    assert api.set_pool_no_split(0, 0, 77) == INVALID
    assert "Could not find pool of id (0, 77)" in api.error()


def use_on_oom_setup(api):
    """A MemPool (0, 7) whose cache holds a free 40 MiB block, and a general
    pool holding 18 MiB of a 20 MiB segment, on a device capped at 60 MiB
    (the memory fraction caps every pool of the device together, as
    PyTorch's does): all of it reserved."""
    assert has_pool_options(api), "the table has no set_pool_use_on_oom"
    assert api.create_or_incref_pool(0, 0, 7) == OK
    cached, = fill_pool(api, (0, 7), [40 * MiB])
    assert api.free(cached, 0) == OK
    general = [api.malloc(16 * MiB)[1], api.malloc(2 * MiB)[1]]
    assert all(general) and api.values("pool_live_blocks", 0, 0, 7) == []
    assert api.set_memory_fraction(0, 60 / 64) == OK
    assert api.stats(0)["reserved_bytes.all.current"] == 60 * MiB
    return cached, general


def test_a_use_on_oom_pool_serves_the_device_when_it_would_run_out(api, fake):
    """MemPool(use_on_oom=True): once an allocation routed to no pool would
    run out of memory, PyTorch's malloc takes a free block of the pools in
    use_on_oom_pools (get_free_block on the pool, same rules) and hands it
    out from that pool, where its free returns it (CUDACachingAllocator.cpp,
    DeviceCachingAllocator::malloc). pyalloc refused the option."""
    cached, general = use_on_oom_setup(api)
    assert api.set_pool_use_on_oom(0, 0, 7, 1) == OK
    # Not before: what the general pool can serve itself stays out of the pool.
    small = api.malloc(2 * MiB)[1]
    assert small and api.values("pool_live_blocks", 0, 0, 7) == []
    before = api.stats(0)
    status, p, _ = api.malloc(30 * MiB)
    assert status == OK, api.error()
    assert cached <= p < cached + 40 * MiB  # in the MemPool's cached block
    assert api.values("pool_live_blocks", 0, 0, 7) == [p]
    after = api.stats(0)
    assert after["num_ooms"] == before["num_ooms"]  # no error, none counted
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    ctypes.memset(p, 0x33, 30 * MiB)
    _C.cuda_check_invariants(0)
    # Its free gives the block back to the MemPool's cache, not to the general pool.
    assert api.free(p, 0) == OK
    assert api.values("pool_live_blocks", 0, 0, 7) == []
    assert [blocks for _, blocks in pool_blocks(api, (0, 7))] == [[(40 * MiB, False)]]
    # An allocation routed to another pool is no fallback's: it runs out.
    assert api.create_or_incref_pool(0, 0, 8) == OK
    assert api.begin_allocate_to_pool(0, 0, 8, EVERY_STREAM, None) == OK
    status, q, _ = api.malloc(30 * MiB)
    assert api.end_allocate_to_pool(0, 0, 8) == OK
    assert (status, q) == (OUT_OF_MEMORY, 0)
    # MemPool's destructor turns the option off, then releases the pool.
    assert api.set_pool_use_on_oom(0, 0, 7, 0) == OK
    status, q, _ = api.malloc(30 * MiB)
    assert (status, q) == (OUT_OF_MEMORY, 0)
    for x in general + [small]:
        assert api.free(x, 0) == OK
    for pool in ((0, 7), (0, 8)):
        assert api.release_pool(0, *pool) == OK
    assert api.set_pool_use_on_oom(0, 0, 7, 0) == OK  # gone: nothing to turn off
    assert api.set_pool_use_on_oom(0, 0, 77, 1) == INVALID
    assert "Could not find pool of id (0, 77)" in api.error()


def test_without_use_on_oom_a_pools_cache_serves_no_one_else(api, fake):
    cached, general = use_on_oom_setup(api)
    status, p, _ = api.malloc(30 * MiB)
    assert (status, p) == (OUT_OF_MEMORY, 0)
    assert api.error().startswith("CUDA out of memory.")
    assert [blocks for _, blocks in pool_blocks(api, (0, 7))] == [[(40 * MiB, False)]]
    for x in general:
        assert api.free(x, 0) == OK
    assert api.release_pool(0, 0, 7) == OK


def test_a_use_on_oom_pool_is_the_last_resort(api, fake):
    """Only what nothing else can serve: a request the general pool serves once it
    has given back its own cache stays out of the MemPool, as in PyTorch's malloc
    when use_on_oom came (pytorch 151487: "try to use existing mempools as a last
    resort"). PyTorch's current source tries the MemPools before it frees its
    cache (try_mempool_fallback); pyalloc keeps them for last (docs/pytorch.md)."""
    _C.cuda_configure("segment_size:2MiB")  # segments of exactly what a request needs
    assert has_pool_options(api), "the table has no set_pool_use_on_oom"
    assert api.create_or_incref_pool(0, 0, 7) == OK
    cached, = fill_pool(api, (0, 7), [10 * MiB])
    assert api.free(cached, 0) == OK
    assert api.set_pool_use_on_oom(0, 0, 7, 1) == OK
    held = api.malloc(10 * MiB)[1]
    spare = api.malloc(8 * MiB)[1]
    assert api.free(spare, 0) == OK  # the general pool caches 8 MiB
    assert api.set_memory_fraction(0, 0.5) == OK  # 32 MiB for the device, 28 reserved
    retries = api.stats(0)["num_alloc_retries"]
    status, p, _ = api.malloc(9 * MiB)  # fits once the general pool's 8 MiB went back
    assert status == OK, api.error()
    assert api.values("pool_live_blocks", 0, 0, 7) == [] and api.stats(0)["num_alloc_retries"] == retries + 1
    status, q, _ = api.malloc(9 * MiB)  # nothing left to give back: the MemPool's block
    assert status == OK, api.error()
    assert api.values("pool_live_blocks", 0, 0, 7) == [q] and cached <= q < cached + 10 * MiB
    _C.cuda_check_invariants(0)
    for x in (held, p, q):
        assert api.free(x, 0) == OK
    assert api.release_pool(0, 0, 7) == OK


def test_memory_usage_of_one_device_looks_at_that_device_alone(api, fake):
    # Regression: asked about device 0, memory_usage searched every device for
    # ptr, and answered with another device's allocation (and its device).
    status, p, _ = api.malloc(2 * MiB, device=1)
    assert status == OK, api.error()
    u = api.memory_usage(p, device=0)
    assert (u.device, u.size) == (0, 0)
    assert u.allocated == api.stats(0)["allocated_bytes.all.current"]
    mine = api.memory_usage(p, device=1)
    assert mine.device == 1 and mine.size >= 2 * MiB
    assert api.memory_usage(p).device == 1  # -1: the allocation's device, found on any
    assert api.free(p, 1) == OK
