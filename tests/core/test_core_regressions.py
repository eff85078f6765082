"""Regression tests for bugs found in the allocator core, named after the bug."""
import pytest

import pyalloc


def test_free_merges_with_its_own_stream_beyond_an_absorbed_neighbour():
    a = pyalloc.Allocator("virtual")
    # Four adjacent 512 B blocks of one small-pool chunk: x, y (stream 2), z, guard.
    x = a.malloc(512, 1)
    y = a.malloc(512, 2)
    z = a.malloc(512, 1)
    guard = a.malloc(512, 1)
    assert [p - x for p in (y, z, guard)] == [512, 1024, 1536]
    a.free(x)  # free on stream 1
    a.free(y)  # free on stream 2; not merged with x: neither is safe for the other's stream yet
    a.malloc(1024, 3)  # stream 3 looks at stream 2's free blocks: y becomes safe everywhere
    a.check_invariants()
    a.free(z)  # z absorbs y (safe), and now lies next to x, a free block of its own stream
    a.check_invariants()


def test_a_huge_cap_neither_overflows_the_bins_nor_the_range():
    """Bins covered sizes below 2^57 only, and a vmm range of four times a huge
    max_pool_size merged into free blocks past that: writes past the bin table.
    Bins now cover every size, and the range is bounded."""
    a = pyalloc.Allocator("virtual", strategy="vmm", max_pool_size=(1 << 59) + (1 << 58))
    ptrs = [a.malloc(1 << 42) for _ in range(8)]
    for p in ptrs:
        a.free(p)
    a.check_invariants()
    assert a.fragmentation()["largest_free_block"] >= 8 << 42
    a.empty_cache()
    a.check_invariants()


def test_vmm_takes_a_mapped_block_that_max_split_size_would_keep_whole():
    """Under vmm a mapped free block larger than max_split_size was skipped by
    best fit and by the mapping path alike, so a 1 MiB request dropped the whole
    cache through the out-of-memory retry (2 MiB here: requests of up to 1 MiB
    take pages of the small area)."""
    a = pyalloc.Allocator("virtual", strategy="vmm", max_split_size=64 << 20, capacity=1 << 30)
    a.free(a.malloc(100 << 20))
    a.malloc(2 << 20)
    s = a.stats()
    assert s["num_alloc_retries"] == 0
    assert s["reserved_bytes.all.current"] == 100 << 20


def test_fresh_pages_merge_with_every_usable_neighbour():
    """Mapped pages merged once per side; absorbing a ready block of another
    stream could leave them next to a free block of their own stream."""
    for seed in (13, 21, 34):
        from test_stream_safety import run

        run(seed, "virtual", "vmm", "max_pool_size:48MiB", steps=400)


def test_a_max_pool_size_off_the_block_granularity_makes_no_odd_sized_segment():
    """Under bestfit, pool_size's segment was cut to max_pool_size as it stood:
    a cap of 1001 bytes (at construction) or 1 byte (set_max_pool_size, then
    empty_cache() restoring pool_size) made a segment of 1001 or 1 bytes, a
    block no 512-byte granule tiles (on host memory, a crash at the next free
    of the cache). The pool now stays within the cap in whole granules."""
    for backend in ("host", "virtual"):
        with pytest.raises(pyalloc.OutOfMemoryError, match="max_pool_size"):
            pyalloc.Allocator(backend, "pool_size:1000,max_pool_size:1001", strategy="bestfit")
        a = pyalloc.Allocator(backend, "pool_size:1000,max_pool_size:3000", strategy="bestfit")
        assert a.stats()["reserved_bytes.all.current"] == 2560
        a.check_invariants()
        a = pyalloc.Allocator(backend, "pool_size:3", strategy="bestfit")
        a.set_max_pool_size(1)
        a.empty_cache()
        a.check_invariants()
        assert a.stats()["reserved_bytes.all.current"] == 0
        a.set_max_pool_size(5000)
        a.empty_cache()
        a.check_invariants()
        assert a.stats()["reserved_bytes.all.current"] == 4608
