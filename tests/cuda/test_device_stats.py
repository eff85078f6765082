"""A device's stats as the sum of its pools, while the general pool is the only one with
counts (it then pushes nothing to the device's sink: csrc/core/stats.h) and after another
pool's first count: currents the sum of the pools', each peak the peak of the sum (never
the sum of the peaks), and reads from another thread that never see half an operation.
"""
from __future__ import annotations

import threading

import pyalloc
from pyalloc import _C

from test_cuda_api import hook_free, hook_malloc

MiB = 1 << 20


def currents_are_the_pools_sum(device: int = 0) -> None:
    total = pyalloc.memory_stats(device)
    general, buffers = _C.cuda_stats(device, "general"), _C.cuda_stats(device, "buffers")
    for key, value in total.items():
        if key.endswith(".current"):
            assert value == general[key] + buffers[key], key


def test_peaks_are_of_the_sum_before_and_after_another_pool_counts(fake):
    a = hook_malloc(8 * MiB)
    hook_free(a)
    currents_are_the_pools_sum()
    assert pyalloc.max_memory_allocated(0) == 8 * MiB  # the general pool alone so far
    cap = _C.cuda_buffer(0, 2 * MiB, 0)  # the buffer pool's first count
    currents_are_the_pools_sum()
    assert pyalloc.memory_allocated(0) == 2 * MiB
    assert pyalloc.max_memory_allocated(0) == 8 * MiB  # neither 10 (sum of peaks) nor 2
    b = hook_malloc(7 * MiB)
    currents_are_the_pools_sum()
    assert pyalloc.max_memory_allocated(0) == 9 * MiB  # the sum's own peak
    stats = pyalloc.memory_stats(0)
    assert stats["allocation.all.peak"] == 2 and stats["active.all.peak"] == 2
    hook_free(b)
    del cap
    stats = pyalloc.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == 0 and stats["allocated_bytes.all.peak"] == 9 * MiB
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 3
    currents_are_the_pools_sum()
    pyalloc.reset_peak_memory_stats(0)
    assert pyalloc.max_memory_allocated(0) == 0
    c = hook_malloc(MiB)
    assert pyalloc.max_memory_allocated(0) == MiB
    hook_free(c)


def test_a_reset_peak_holds_while_the_general_pool_is_alone(fake):
    hook_free(hook_malloc(6 * MiB))
    pyalloc.reset_peak_memory_stats(0)
    p = hook_malloc(MiB)
    assert pyalloc.max_memory_allocated(0) == MiB
    cap = _C.cuda_buffer(0, MiB, 0)  # the device's peaks taken over from the general pool's
    assert pyalloc.max_memory_allocated(0) == 2 * MiB
    del cap
    hook_free(p)
    assert pyalloc.max_memory_allocated(0) == 2 * MiB and pyalloc.memory_allocated(0) == 0


def test_a_reader_on_another_thread_sees_whole_operations(fake):
    size = 3 * MiB  # a multiple of every rounding: bytes = blocks * size
    stop = threading.Event()
    seen = []

    def read():
        while not stop.is_set():
            s = pyalloc.memory_stats(0)
            seen.append((s["allocation.all.current"], s["allocated_bytes.all.current"],
                         s["allocated_bytes.all.peak"], s["active_bytes.all.current"]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            ptrs = [hook_malloc(size) for _ in range(2)]
            if i == 150:
                cap = _C.cuda_buffer(0, size, 0)  # the switch, under the reader's eyes
            for p in ptrs:
                hook_free(p)
    finally:
        stop.set()
        reader.join()
    del cap
    assert seen
    for blocks, allocated, peak, active in seen:
        assert allocated == blocks * size == active, (blocks, allocated, active)
        assert allocated <= peak <= 3 * size
    assert pyalloc.max_memory_allocated(0) == 3 * size
    currents_are_the_pools_sum()
