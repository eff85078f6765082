"""The core's pool policy: rounding, pools, best fit, split, coalesce, growth, release."""
import pytest

import pyalloc

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def current(a, key):
    return a.stats()[key + ".current"]


def test_size_zero_returns_null_and_free_null_is_a_noop(make):
    a = make()
    assert a.malloc(0) == 0
    a.free(0)
    assert current(a, "allocation.all") == 0
    a.check_invariants()


def test_sizes_round_to_512_and_split_by_pool(make):
    a = make()
    small = a.config["small_size"]
    p = a.malloc(1)
    q = a.malloc(small)  # still small: <= small_size
    r = a.malloc(small + 1)  # large
    s = a.stats()
    assert s["allocated_bytes.small_pool.current"] == 512 + small
    assert s["allocated_bytes.large_pool.current"] >= small + 512
    assert s["requested_bytes.all.current"] == 1 + small + small + 1
    assert s["allocation.small_pool.current"] == 2
    assert s["allocation.large_pool.current"] == 1
    for ptr in (p, q, r):
        assert ptr % 512 == 0
    a.check_invariants()


def test_small_blocks_live_in_chunks_borrowed_from_the_large_pool(make):
    a = make(pool_size=64 * MiB)
    chunk = a.config["small_chunk_size"]
    ptrs = [a.malloc(4 * KiB) for _ in range(10)]
    s = a.stats()
    assert s["segment.small_pool.current"] == 1
    assert s["reserved_bytes.small_pool.current"] == chunk
    assert s["reserved_bytes.large_pool.current"] == 64 * MiB - chunk
    assert s["reserved_bytes.all.current"] == 64 * MiB
    assert s["num_device_alloc"] == 1  # the chunk came from the pool, not the backend
    # The ten small blocks are packed in the one chunk.
    assert max(ptrs) - min(ptrs) < chunk
    for p in ptrs:
        a.free(p)
    a.check_invariants()


def test_same_size_is_reused_at_the_same_address(make):
    a = make()
    p = a.malloc(3 * MiB)
    a.free(p)
    assert a.malloc(3 * MiB) == p
    assert a.stats()["num_device_alloc"] == 1


def test_best_fit_takes_the_smallest_block_that_fits(make):
    a = make(pool_size=256 * MiB)
    # Carve holes of 40, 10 and 20 MiB separated by live blocks.
    sizes = [40, 4, 10, 4, 20, 4]
    ptrs = [a.malloc(n * MiB) for n in sizes]
    for i in (0, 2, 4):
        a.free(ptrs[i])
    a.check_invariants()
    assert a.malloc(9 * MiB) == ptrs[2]
    assert a.malloc(15 * MiB) == ptrs[4]
    assert a.malloc(30 * MiB) == ptrs[0]
    a.check_invariants()


def test_split_remainder_is_reused_and_coalesces_back(make):
    a = make(strategy="bestfit", pool_size=64 * MiB)
    p = a.malloc(8 * MiB)
    q = a.malloc(8 * MiB)
    assert q == p + 8 * MiB  # carved from the front of the remainder
    s = a.stats()
    assert s["inactive_split.large_pool.current"] == 1
    assert s["inactive_split_bytes.large_pool.current"] == 48 * MiB
    a.free(p)
    a.free(q)
    a.check_invariants()
    f = a.fragmentation()
    assert f["free_blocks"] == 1 and f["largest_free_block"] == 64 * MiB
    assert a.stats()["inactive_split.all.current"] == 0


def test_small_remainders_of_large_blocks_are_not_split(make):
    a = make(strategy="bestfit", pool_size=4 * MiB, max_pool_size=4 * MiB, small_size=MiB, small_chunk_size=2 * MiB)
    p = a.malloc(3 * MiB + 512 * KiB)  # remainder 512 KiB < small_size: kept whole
    assert a.stats()["allocated_bytes.large_pool.current"] == 4 * MiB
    a.free(p)
    a.check_invariants()


def test_pool_size_is_reserved_up_front(make):
    a = make(pool_size=100 * MiB)
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 100 * MiB
    assert s["segment.large_pool.current"] == 1
    ptrs = [a.malloc(10 * MiB) for _ in range(10)]
    assert a.stats()["num_device_alloc"] == 1
    for p in ptrs:
        a.free(p)


def test_growth_is_by_at_least_segment_size(make):
    a = make(strategy="bestfit", segment_size=64 * MiB)
    a.malloc(2 * MiB)
    assert current(a, "reserved_bytes.all") == 64 * MiB
    a.malloc(100 * MiB)  # bigger than a segment: exactly what it needs, rounded to 2 MiB
    assert current(a, "reserved_bytes.all") == 64 * MiB + 100 * MiB


def test_segments_are_never_merged(make):
    a = make(strategy="bestfit", segment_size=2 * MiB)
    p = a.malloc(2 * MiB)
    q = a.malloc(2 * MiB)
    a.free(p)
    a.free(q)
    a.check_invariants()
    assert a.fragmentation()["largest_free_block"] == 2 * MiB
    assert current(a, "segment.large_pool") == 2


def test_empty_cache_releases_wholly_free_segments_only(make):
    a = make(strategy="bestfit", segment_size=2 * MiB)
    keep = a.malloc(2 * MiB)
    drop = [a.malloc(2 * MiB) for _ in range(3)]
    small = a.malloc(100)
    for p in drop:
        a.free(p)
    a.free(small)
    released = a.empty_cache()
    assert released == 3 * 2 * MiB + 2 * MiB  # three segments, and the chunk's segment
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 2 * MiB
    assert s["num_device_free"] == 4
    a.free(keep)
    assert a.empty_cache() == 2 * MiB
    assert current(a, "reserved_bytes.all") == 0
    a.check_invariants()


def test_reserve_grows_so_later_allocations_need_no_backend_call(make):
    a = make()
    assert a.reserve(300 * MiB) == 300 * MiB
    before = a.stats()["num_device_alloc"]
    ptrs = [a.malloc(50 * MiB) for _ in range(6)]
    assert a.stats()["num_device_alloc"] == before
    for p in ptrs:
        a.free(p)
    assert a.reserve(100 * MiB) == 0  # a free range that large exists already
    a.check_invariants()


def test_large_requests_take_back_wholly_free_chunks_before_growing(make):
    a = make(pool_size=4 * MiB, max_pool_size=4 * MiB)
    small = [a.malloc(64 * KiB) for _ in range(8)]
    for p in small:
        a.free(p)
    assert current(a, "segment.small_pool") == 1
    p = a.malloc(4 * MiB)  # needs the chunk's memory back
    assert current(a, "segment.small_pool") == 0
    assert a.stats()["num_device_alloc"] == 1
    a.free(p)
    a.check_invariants()


def test_max_split_size_keeps_oversize_blocks_whole(make):
    a = make(strategy="bestfit", max_split_size=64 * MiB, segment_size=2 * MiB)
    big = a.malloc(128 * MiB)
    s = a.stats()
    assert s["max_split_size"] == 64 * MiB
    assert s["oversize_allocations.current"] == 1
    assert s["oversize_segments.current"] == 1
    a.free(big)
    p = a.malloc(8 * MiB)  # must not cut the oversize block
    assert not (big <= p < big + 128 * MiB)
    a.check_invariants()


def test_max_split_size_boundaries_as_pytorch_draws_them():
    # PyTorch's get_free_block(): a request below max_split_size takes no block of
    # max_split_size or more; a request of max_split_size or more takes one smaller
    # than itself plus 20 MiB. Its should_split(): only a request below
    # max_split_size splits (large pool). Each boundary exactly, both sides.
    def pool():
        a = pyalloc.Allocator("virtual", strategy="bestfit", max_split_size=4 * MiB,
                              segment_size=2 * MiB, capacity=1 << 30)
        return a

    def cached(a, size):
        p = a.malloc(size)
        a.free(p)
        return p

    a = pool()  # a request of exactly max_split_size takes a cached 10 MiB block whole
    big = cached(a, 10 * MiB)
    assert a.malloc(4 * MiB) == big
    assert a.stats()["allocated_bytes.all.current"] == 10 * MiB
    a.check_invariants()

    a = pool()  # ... and one 20 MiB larger than itself is refused; one smaller, taken whole
    far = cached(a, 24 * MiB)
    assert a.malloc(4 * MiB) != far
    a = pool()
    near = cached(a, 22 * MiB)
    assert a.malloc(4 * MiB) == near
    assert a.stats()["allocated_bytes.all.current"] == 22 * MiB

    a = pool()  # a request just below max_split_size takes no block of exactly max_split_size
    edge = cached(a, 4 * MiB)
    assert a.malloc(4 * MiB - 512) != edge
    assert a.stats()["segment.all.current"] == 2  # a segment of its own
    a.check_invariants()


def test_max_split_size_defaults_to_unlimited_like_torch(make):
    assert make().stats()["max_split_size"] == -1
