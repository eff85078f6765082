"""Allocator.allocate_at: the blocks of a checkpoint given back at their addresses.

PyTorch's CUDA-graph trees (torch.compile(mode="reduce-overhead")) restore a
private pool to a checkpoint: the blocks live then are allocated again where
they were. These tests check that the core can, on every backend and strategy,
and that it refuses clearly when the range is not free.
"""
from __future__ import annotations

import random

import pytest

from pyalloc import _C

KiB, MiB = 1 << 10, 1 << 20


def core(backend, strategy, **conf):
    text = ",".join([f"strategy:{strategy}"] + [f"{k}:{v}" for k, v in conf.items()])
    return _C.Allocator(backend, text, 1 << 30)


def test_a_freed_block_comes_back_at_its_address(backend, strategy):
    a = core(backend, strategy)
    p = a.malloc(3 * MiB)
    q = a.malloc(5 * MiB)
    small = a.malloc(4 * KiB)
    a.free(p)
    a.free(small)
    assert a.allocate_at(p, 3 * MiB) == p
    assert a.allocate_at(small, 4 * KiB) == small
    a.check_invariants()
    stats = a.stats()
    assert stats["allocation.all.current"] == 3
    assert stats["requested_bytes.all.current"] == 8 * MiB + 4 * KiB
    for ptr in (p, q, small):
        a.free(ptr)
    a.check_invariants()
    assert a.stats()["allocated_bytes.all.current"] == 0


def test_a_range_inside_a_larger_free_block_is_carved_out(backend, strategy):
    a = core(backend, strategy)
    p = a.malloc(8 * MiB)
    a.free(p)
    # The middle of what was one block: free pieces stay on both sides.
    mid = a.allocate_at(p + 2 * MiB, MiB)
    assert mid == p + 2 * MiB
    a.check_invariants()
    before = a.malloc(2 * MiB)
    assert before == p, "the piece in front stays free and usable"
    a.free(before)
    a.free(mid)
    a.check_invariants()


def test_a_free_that_waited_on_a_finished_stream_leaves_its_range_free(backend, strategy):
    """A block used on another stream (record_stream) is freed once that
    stream's queued work is done; allocate_at took the range as in use until
    the next malloc completed the free, so a restore of a checkpoint into it
    failed. While the stream is busy the range is in use indeed."""
    a = core(backend, strategy)
    p = a.malloc(4 * MiB)
    a.record_stream(p, 5)
    a.stream_set_busy(5)
    a.free(p)
    with pytest.raises(ValueError, match="not free"):
        a.allocate_at(p, 4 * MiB)
    a.stream_complete(5)
    assert a.allocate_at(p + MiB, MiB) == p + MiB
    a.check_invariants()
    a.free(p + MiB)
    a.check_invariants()
    assert a.stats()["allocated_bytes.all.current"] == 0


def test_a_range_free_in_blocks_of_several_streams_is_made_one_block(backend, strategy):
    """Neighbouring free blocks of streams still at work stay apart (neither is
    safe for the other); a checkpoint's block across them was refused as "not
    free in one block", and so was the undo of a failed restore that had made
    a block inside a dropped one on another stream (the pool then lost the
    dropped block). The caller orders the work on the range it restores."""
    a = core(backend, strategy)
    # Above 1 MiB: under vmm smaller requests take pages of another area.
    first = a.malloc(3 * MiB, 1)
    second = a.malloc(3 * MiB, 2)
    assert second == first + 3 * MiB, "the test needs neighbours"
    after = a.malloc(2 * MiB, 1)  # something live beyond them
    a.stream_set_busy(1)
    a.stream_set_busy(2)
    a.free(first)
    a.free(second)
    assert a.allocate_at(first + 3 * MiB // 2, 3 * MiB, 3) == first + 3 * MiB // 2
    a.check_invariants()
    a.stream_complete(1)
    a.stream_complete(2)
    # The pieces around it kept their streams and stay usable.
    assert a.malloc(3 * MiB // 2, 1) == first
    assert a.malloc(3 * MiB // 2, 2) == first + 9 * MiB // 2
    a.check_invariants()


def test_a_range_in_use_or_outside_the_pool_is_refused(backend, strategy):
    a = core(backend, strategy)
    p = a.malloc(2 * MiB)
    with pytest.raises(ValueError, match="not free"):
        a.allocate_at(p, 1 * MiB)
    with pytest.raises(ValueError, match="no memory of this pool"):
        a.allocate_at(0x1000, 1 * MiB)
    a.free(p)
    with pytest.raises(ValueError, match="block boundary"):
        a.allocate_at(p + 100, 1 * MiB)
    a.check_invariants()


def test_restoring_a_checkpoint_after_random_traffic(backend):
    # bestfit: the graph pools that checkpoints are taken of use plain segments.
    rng = random.Random(7)
    a = core(backend, "bestfit")
    live = {}
    for _ in range(300):
        if live and rng.random() < 0.45:
            ptr = rng.choice(list(live))
            a.free(ptr)
            del live[ptr]
        else:
            size = rng.choice([rng.randint(1, 64 * KiB), rng.randint(1, 8 * MiB)])
            live[a.malloc(size)] = size
    checkpoint = dict(live)
    for _ in range(300):
        if live and rng.random() < 0.5:
            ptr = rng.choice(list(live))
            a.free(ptr)
            del live[ptr]
        else:
            size = rng.randint(1, 4 * MiB)
            live[a.malloc(size)] = size
    # Restore: free what the checkpoint did not hold, allocate what it held.
    for ptr in [p for p in live if p not in checkpoint or live[p] != checkpoint[p]]:
        a.free(ptr)
        del live[ptr]
    for ptr, size in checkpoint.items():
        if ptr not in live:
            assert a.allocate_at(ptr, size) == ptr
            live[ptr] = size
        a.check_invariants()
    assert a.stats()["requested_bytes.all.current"] == sum(checkpoint.values())


def test_without_a_small_pool_small_blocks_come_back_too(backend, strategy):
    # small_size:0 (graph pools): every request from the large pool, so a range
    # freed by a large block and reused by small ones can be restored.
    a = core(backend, strategy, small_size=0)
    big = a.malloc(MiB)
    a.free(big)
    smalls = [a.malloc(4 * KiB) for _ in range(4)]
    assert a.stats()["allocation.small_pool.current"] == 0
    for p in smalls:
        a.free(p)
    assert a.allocate_at(big, MiB) == big
    a.check_invariants()
    a.free(big)
