"""Bad input gets a clear exception, never a crash; OOM leaves live data intact."""
import ctypes
import re

import pytest

import pyalloc

KiB = 1 << 10
MiB = 1 << 20


def test_double_free(make):
    a = make()
    p = a.malloc(4 * MiB)
    a.free(p)
    with pytest.raises(pyalloc.InvalidPointerError, match="double free"):
        a.free(p)
    a.check_invariants()


def test_double_free_of_a_small_block(make):
    a = make()
    p = a.malloc(100)
    keep = a.malloc(100)
    a.free(p)
    with pytest.raises(pyalloc.InvalidPointerError, match="double free"):
        a.free(p)
    a.free(keep)
    a.check_invariants()


def test_foreign_pointer(make):
    a = make()
    a.malloc(4 * MiB)
    with pytest.raises(pyalloc.InvalidPointerError, match="not a pointer from this allocator"):
        a.free(0x1234000)
    with pytest.raises(pyalloc.InvalidPointerError):
        a.record_stream(0x1234000, 7)
    a.check_invariants()


def test_pointer_into_the_middle_of_an_allocation(make):
    a = make()
    p = a.malloc(4 * MiB)
    with pytest.raises(pyalloc.InvalidPointerError, match="bytes into the allocation"):
        a.free(p + 512)
    a.free(p)


def test_pointer_from_another_allocator(make):
    a, b = make(), make()
    p = b.malloc(1000)
    with pytest.raises(pyalloc.InvalidPointerError):
        a.free(p)
    b.free(p)


def test_invalid_pointer_is_a_value_error(make):
    a = make()
    with pytest.raises(ValueError):
        a.free(12345)
    with pytest.raises(ValueError):
        a.free(-1)
    with pytest.raises(TypeError):
        a.free("0x1000")


@pytest.mark.parametrize("size", [-1, -(1 << 40)])
def test_negative_sizes(make, size):
    with pytest.raises(ValueError, match="negative"):
        make().malloc(size)


@pytest.mark.parametrize("size", [1 << 64, 1 << 100])
def test_sizes_beyond_64_bits(make, size):
    a = make()
    with pytest.raises(ValueError, match="large"):
        a.malloc(size)
    a.check_invariants()


@pytest.mark.parametrize("size", [(1 << 56) + 1, 1 << 57, (1 << 64) - 1])
def test_sizes_no_device_could_hold_are_out_of_memory_at_once(make, size):
    # As PyTorch answers them (torch.cuda.OutOfMemoryError): refused before
    # anything is tried, so counted as a rejection too.
    a = make()
    with pytest.raises(pyalloc.OutOfMemoryError, match="larger than any device could hold"):
        a.malloc(size)
    s = a.stats()
    assert (s["num_ooms"], s["num_oom_rejections"], s["num_alloc_retries"]) == (1, 1, 0)
    a.check_invariants()


def test_non_integer_sizes(make):
    with pytest.raises(TypeError):
        make().malloc(1.5)
    with pytest.raises(TypeError):
        make().malloc(None)


def test_oom_message_says_why_and_stats_count_it(make):
    a = make(max_pool_size=64 * MiB, segment_size=2 * MiB)
    live = [a.malloc(20 * MiB) for _ in range(3)]
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(10 * MiB)
    msg = str(e.value)
    assert msg.startswith("out of memory")
    for part in ("tried to allocate 10.00 MiB", "60.00 MiB allocated", "60.00 MiB reserved",
                 "under its cap of 64.00 MiB (max_pool_size)", "largest free block",
                 "would exceed the pool's cap"):
        assert part in msg, part
    assert isinstance(e.value, RuntimeError)
    s = a.stats()
    assert s["num_ooms"] == 1
    # 60 MiB allocated + 10 MiB > the cap whatever is given back: refused at once.
    assert s["num_alloc_retries"] == 0 and s["num_device_free"] == 0
    assert s["allocation.all.current"] == 3
    a.check_invariants()
    for p in live:
        a.free(p)
    a.malloc(40 * MiB)  # the pool still works after the OOM


def _times(figure, message):
    """How often a figure ("12.00 MiB") is stated, not counting it inside another ("112.00 MiB")."""
    return len(re.findall(r"(?<![\d.])" + re.escape(figure), message))


def test_oom_message_states_each_figure_once(make):
    """Regression: the message said the allocated bytes twice ("0 B of the pool is
    allocated. The pool has 0 B allocated and 0 B reserved"): the reason, then the
    pool's figures. Requested, allocated, reserved, free, largest free block, the
    cap and the device's free memory are each stated once."""
    a = make(max_pool_size=64 * MiB, capacity=256 * MiB, segment_size=2 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(100 * MiB)
    msg = str(e.value)
    assert "of the pool is allocated" not in msg
    assert msg.count("0 B allocated") == msg.count("0 B reserved") == 1, msg
    live = [a.malloc(12 * MiB) for _ in range(5)]
    a.free(live[0])
    a.free(live[2])  # 36 MiB allocated, 60 MiB reserved, two free 12 MiB holes
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(30 * MiB)
    msg = str(e.value)
    for figure, said in (("30.00 MiB", "tried to allocate 30.00 MiB"), ("36.00 MiB", "36.00 MiB allocated"),
                         ("60.00 MiB", "60.00 MiB reserved"), ("64.00 MiB", "under its cap of 64.00 MiB"),
                         ("24.00 MiB", "24.00 MiB of the reserved memory is free"),
                         ("12.00 MiB", "the largest free block is 12.00 MiB"),
                         ("196.00 MiB", "The device has 196.00 MiB free of 256.00 MiB")):
        assert said in msg and _times(figure, msg) == 1, (figure, msg)


def test_oom_when_the_device_is_full(make):
    a = make(capacity=32 * MiB)
    a.malloc(30 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError, match="(could not|cannot) (provide|map)"):
        a.malloc(4 * MiB)
    a.check_invariants()


def test_oom_message_reports_fragmentation(make):
    a = make(strategy="bestfit", pool_size=64 * MiB, max_pool_size=64 * MiB)
    ptrs = [a.malloc(4 * MiB) for _ in range(16)]
    for p in ptrs[::2]:
        a.free(p)
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(8 * MiB)
    assert "32.00 MiB of the reserved memory is free" in str(e.value)
    assert "the largest free block is 4.00 MiB" in str(e.value)
    assert "fragmented" in str(e.value)


def test_oom_releases_cached_segments_and_retries(make):
    a = make(strategy="bestfit", capacity=64 * MiB, segment_size=2 * MiB)
    ptrs = [a.malloc(8 * MiB) for _ in range(8)]
    for p in ptrs:
        a.free(p)  # 64 MiB cached in eight 8 MiB segments
    p = a.malloc(40 * MiB)  # only fits once the cache is given back
    s = a.stats()
    assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert s["num_device_free"] == 8
    a.free(p)
    a.check_invariants()


def cached_pool(make, **kw):
    a = make(capacity=64 * MiB, segment_size=2 * MiB, **kw)
    keep = a.malloc(8 * MiB)
    a.free(a.malloc(24 * MiB))  # cached: 32 MiB reserved, 24 MiB of it free
    return a, keep


def test_impossible_requests_fail_at_once_and_keep_the_cache(make):
    """Beyond the cap, or beyond the device's free memory plus everything the
    pool could give back, a request fails before anything is mapped, reserved
    or released: the cached memory stays for the requests that fit."""
    capped, _ = cached_pool(make, max_pool_size=48 * MiB)
    uncapped, _ = cached_pool(make)
    before = [p.stats() for p in (capped, uncapped)]
    with pytest.raises(pyalloc.OutOfMemoryError, match="would exceed the pool's cap.*cap of 48.00 MiB"):
        capped.malloc(49 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError, match="would exceed the pool's cap.* 8.00 MiB allocated"):
        capped.malloc(41 * MiB)  # 8 MiB stays allocated whatever is given back
    with pytest.raises(pyalloc.OutOfMemoryError,
                       match="cannot provide it, even with all of the pool's unallocated memory given back.*"
                             "24.00 MiB of the reserved memory is free.*The device has 32.00 MiB free"):
        uncapped.malloc(57 * MiB)
    for pool, was in zip((capped, uncapped), before):
        s = pool.stats()
        for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "reserved_bytes.all.current"):
            assert s[key] == was[key], key
        pool.check_invariants()
    # Each was refused before anything was tried: what PyTorch counts as a rejection.
    assert capped.stats()["num_oom_rejections"] == 2 and uncapped.stats()["num_oom_rejections"] == 1
    # What fits once the cache is given back is served, with at most one retry.
    p = uncapped.malloc(56 * MiB)
    assert uncapped.stats()["num_alloc_retries"] <= 1
    uncapped.free(p)
    uncapped.check_invariants()


def test_oom_leaves_live_allocations_intact(host):
    a = host(capacity=64 * MiB, segment_size=2 * MiB)
    live = {}
    for i in range(12):
        p = a.malloc(5 * MiB if i % 2 else 3000)
        size = 5 * MiB if i % 2 else 3000
        ctypes.memset(p, i + 1, size)
        live[p] = (i + 1, size)
    for _ in range(3):
        with pytest.raises(pyalloc.OutOfMemoryError):
            a.malloc(40 * MiB)
    a.check_invariants()
    for p, (byte, size) in live.items():
        assert ctypes.string_at(p, size) == bytes([byte]) * size
        a.free(p)
