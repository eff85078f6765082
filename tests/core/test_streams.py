"""Per-stream reuse made safe by events (simulated streams of the host/virtual backends)."""
import pytest

import pyalloc

MiB = 1 << 20
S, T, U = 11, 22, 33


def test_a_block_freed_on_a_stream_is_reused_by_it_at_once(make):
    a = make()
    a.stream_set_busy(S)  # work still queued on S does not matter to S itself
    p = a.malloc(4 * MiB, S)
    a.free(p)
    assert a.malloc(4 * MiB, S) == p


def test_another_stream_waits_for_the_work_queued_at_the_free(make):
    a = make(segment_size=2 * MiB)
    p = a.malloc(4 * MiB, S)
    a.stream_set_busy(S)
    a.free(p)
    q = a.malloc(4 * MiB, T)
    assert q != p  # S may still be using p
    a.stream_complete(S)
    r = a.malloc(4 * MiB, T)
    assert r == p
    for x in (q, r):
        a.free(x)
    a.check_invariants()


def test_another_stream_reuses_once_the_freeing_stream_is_idle(make):
    a = make()
    p = a.malloc(4 * MiB, S)
    a.free(p)  # S idle: an event recorded on it completes at once
    assert a.malloc(4 * MiB, T) == p
    assert a.stats()["num_device_alloc"] == 1


def test_small_blocks_follow_the_same_rule(make):
    a = make(small_size=MiB, small_chunk_size=2 * MiB)
    p = a.malloc(MiB, S)  # half of a 2 MiB chunk
    a.stream_set_busy(S)
    a.free(p)
    q1 = a.malloc(MiB, T)  # S's chunk is not safe for T yet: T gets a chunk of its own
    q2 = a.malloc(MiB, T)
    assert p not in (q1, q2)
    a.stream_complete(S)
    assert a.malloc(MiB, T) == p  # T's chunk is full; S's is safe now
    a.check_invariants()


def test_record_stream_delays_the_free_until_that_stream_is_done(make):
    a = make()
    p = a.malloc(4 * MiB, S)
    a.record_stream(p, T)
    a.stream_set_busy(T)
    a.free(p)
    s = a.stats()
    assert s["allocated_bytes.all.current"] == 0  # the free was requested
    assert s["active_bytes.all.current"] == 4 * MiB  # but T may still read it
    a.check_invariants()
    q = a.malloc(4 * MiB, S)
    assert q != p  # not even S may reuse it yet
    a.stream_complete(T)
    r = a.malloc(4 * MiB, S)
    assert r == p
    assert a.stats()["active_bytes.all.current"] == 8 * MiB
    a.free(q)
    a.free(r)
    a.check_invariants()


def test_record_stream_on_the_own_stream_changes_nothing(make):
    a = make()
    p = a.malloc(4 * MiB, S)
    a.record_stream(p, S)
    a.stream_set_busy(S)
    a.free(p)
    assert a.stats()["active.all.current"] == 0
    assert a.malloc(4 * MiB, S) == p


def test_snapshot_shows_pending_frees(make):
    a = make()
    p = a.malloc(4 * MiB, S)
    a.record_stream(p, T)
    a.stream_set_busy(T)
    a.free(p)
    states = [b["state"] for seg in a.snapshot()["segments"] for b in seg["blocks"]]
    assert "active_pending_free" in states


def test_empty_cache_waits_for_streams_and_releases_everything(make):
    a = make(segment_size=2 * MiB)
    ptrs = {st: a.malloc(4 * MiB, st) for st in (S, T, U)}
    p = a.malloc(2 * MiB, S)
    a.record_stream(p, U)
    for st in (S, T, U):
        a.stream_set_busy(st)
    for x in list(ptrs.values()) + [p]:
        a.free(x)
    assert a.empty_cache() == a.stats()["reserved_bytes.all.peak"]
    s = a.stats()
    assert s["reserved_bytes.all.current"] == 0
    assert s["active.all.current"] == 0
    assert s["num_sync_all_streams"] == 1
    a.check_invariants()


def test_events_are_recycled(make):
    a = make()
    for i in range(50):
        p = a.malloc(4 * MiB, S)
        a.record_stream(p, T)
        a.free(p)
        q = a.malloc(4 * MiB, T if i % 2 else U)
        a.free(q)
    a.empty_cache()
    assert a._core.live_events() == 0


def test_blocks_of_different_streams_merge_once_safe(make):
    a = make(pool_size=16 * MiB)
    p = a.malloc(4 * MiB, S)
    q = a.malloc(4 * MiB, T)
    r = a.malloc(8 * MiB, S)
    a.stream_set_busy(S)
    a.stream_set_busy(T)
    a.free(p)
    a.free(q)
    a.check_invariants()  # p and q stay apart: neither is safe for the other's stream
    a.stream_complete(S)
    a.stream_complete(T)
    a.free(r)
    a.empty_cache()  # waits for every stream: everything merges into one free block
    assert a.stats()["reserved_bytes.all.current"] == 16 * MiB  # pool_size is kept
    assert a.fragmentation()["largest_free_block"] == 16 * MiB


def test_streams_accept_objects_with_a_cuda_stream_handle(make):
    class FakeStream:
        cuda_stream = 0xABC

    a = make()
    p = a.malloc(1000, FakeStream())
    a.record_stream(p, FakeStream())
    a.free(p)
    with pytest.raises(TypeError):
        a.malloc(10, "stream")


def test_a_block_whose_stream_was_never_waited_on_merges_with_no_other_stream(make):
    # Regression (issue 53, item 4): empty_cache() waits for every stream and
    # then merged each run of free blocks into one, labelled with the first
    # block's stream, though a wait that failed (a failed event; a capture
    # declared meanwhile) leaves its stream's blocks unsafe for any other
    # stream. T's block then reached U through its idle neighbour of S.
    a = make(segment_size=16 * MiB)
    keep = a.malloc(2 * MiB, S)  # the segment stays: only free blocks may merge
    p = a.malloc(4 * MiB, S)
    q = a.malloc(4 * MiB, T)  # beside p, in the same segment
    assert q == p + 4 * MiB
    a.stream_fail(T)  # T's work failed: no event of T's completes, none can be waited for
    a.free(q)
    a.free(p)
    a.empty_cache()
    a.check_invariants()
    r = a.malloc(8 * MiB, U)
    assert not (r < q + 4 * MiB and q < r + 8 * MiB), "U got memory T's failed work may still use"
    a.stream_complete(T)
    for x in (keep, r):
        a.free(x)
    a.check_invariants()
