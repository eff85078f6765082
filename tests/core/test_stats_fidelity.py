"""Statistics, segments and messages as PyTorch's give them."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyalloc

KiB, MiB = 1 << 10, 1 << 20
FAMILIES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
            "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
# torch 2.13's memory_stats() beyond the families above.
TORCH_COUNTERS = {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                  "num_device_free", "num_oom_rejections", "max_split_size"}


def torch_keys():
    keys = {f"{fam}.{pool}.{field}" for fam in FAMILIES
            for pool in ("all", "small_pool", "large_pool")
            for field in ("current", "peak", "allocated", "freed")}
    keys |= {f"{name}.{field}" for name in ("oversize_allocations", "oversize_segments")
             for field in ("current", "peak", "allocated", "freed")}
    return keys | TORCH_COUNTERS


def check_identities(s):
    for fam in FAMILIES:
        for field in ("current", "allocated", "freed"):
            assert s[f"{fam}.all.{field}"] == s[f"{fam}.small_pool.{field}"] + s[f"{fam}.large_pool.{field}"], (fam, field)
        for pool in ("all", "small_pool", "large_pool"):
            k = f"{fam}.{pool}"
            assert s[k + ".current"] == s[k + ".allocated"] - s[k + ".freed"], k
            assert s[k + ".current"] <= s[k + ".peak"] <= s[k + ".allocated"], k
        # The combined peak is the peak of the combined count: no more than
        # the pools' peaks together, no less than either.
        assert max(s[f"{fam}.small_pool.peak"], s[f"{fam}.large_pool.peak"]) <= s[f"{fam}.all.peak"]
        assert s[f"{fam}.all.peak"] <= s[f"{fam}.small_pool.peak"] + s[f"{fam}.large_pool.peak"]


def segment_totals(snapshot):
    out = {}
    for pool in ("small", "large"):
        segs = [s for s in snapshot["segments"] if s["segment_type"] == pool]
        out[pool] = (len(segs), sum(s["total_size"] for s in segs))
    return out


OPS = st.lists(
    st.tuples(st.sampled_from(["malloc", "free", "empty", "record", "complete", "reset"]),
              st.integers(1, 12 * MiB), st.sampled_from([0, 5]), st.integers(0, 1 << 30)),
    max_size=120)


def currents(s):
    return {k[:-len(".current")]: v for k, v in s.items() if k.endswith(".current")}


@pytest.mark.parametrize("conf", ["strategy:bestfit,segment_size:4MiB", "strategy:vmm",
                                  "strategy:bestfit,max_pool_size:48MiB",
                                  "strategy:vmm,max_pool_size:48MiB,pool_size:8MiB",
                                  "strategy:bestfit,segment_size:2MiB,max_split_size:4MiB"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_stats_identities_and_snapshot_totals_after_random_work(conf, ops):
    a = pyalloc.Allocator("virtual", conf)
    live = []
    # Every peak is the highest value its count was seen at between operations
    # (since the last reset), as torch.cuda.max_memory_* reads: never a
    # moment inside one malloc (a segment grown, then partly lent to the small
    # pool; pages mapped, then split).
    highest = currents(a.stats())
    for op, size, stream, pick in ops:
        if op == "malloc" or not live:
            # Mostly small requests: they borrow and return small-pool chunks.
            n = size if pick % 3 == 0 else size % (64 * KiB) + 1
            try:
                live.append(a.malloc(n, stream))
            except pyalloc.OutOfMemoryError:
                pass
        elif op == "free":
            a.free(live.pop(pick % len(live)))
        elif op == "empty":
            a.empty_cache()
        elif op == "record":
            a.record_stream(live[pick % len(live)], 9)
        elif op == "reset":
            a.reset_peak_stats()
            highest = currents(a.stats())
        else:
            a.stream_complete(9)
        s = a.stats()
        check_identities(s)
        for k, v in currents(s).items():
            highest[k] = max(highest[k], v)
            assert s[k + ".peak"] == highest[k], k
        snap = segment_totals(a.snapshot())
        for pool in ("small", "large"):
            assert snap[pool] == (s[f"segment.{pool}_pool.current"], s[f"reserved_bytes.{pool}_pool.current"])
    a.check_invariants()


def test_every_key_of_torchs_memory_stats(make):
    a = make()
    # Beyond torch's keys: num_driver_calls, the driver calls behind the device calls.
    assert set(a.stats()) == torch_keys() | {"num_driver_calls"}
    assert list(a.stats()) == sorted(a.stats())


def test_lending_small_chunks_keeps_all_the_sum_of_the_pools(make):
    a = make(segment_size=8 * MiB)
    seen = []
    ps = []
    for _ in range(3):
        ps.append(a.malloc(1000))
        seen.append(a.stats()["reserved_bytes.all.current"])
    for p in ps:
        a.free(p)
    a.empty_cache()  # the chunk goes back to the large pool
    s = a.stats()
    check_identities(s)
    assert s["reserved_bytes.small_pool.allocated"] > 0 and s["reserved_bytes.small_pool.freed"] > 0
    # Moving memory between the pools never raises the combined peak.
    assert s["reserved_bytes.all.peak"] == max(seen)


def test_segments_are_typed_and_carry_their_stream():
    a = pyalloc.Allocator("virtual", strategy="bestfit", segment_size=4 * MiB)
    big = a.malloc(3 * MiB, stream=7)   # a segment made for stream 7
    small = a.malloc(100, stream=0)     # a small-pool chunk for stream 0
    snap = a.snapshot()
    by_type = {}
    for s in snap["segments"]:
        by_type.setdefault(s["segment_type"], []).append(s)
    assert [s["stream"] for s in by_type["small"]] == [0]
    assert by_type["small"][0]["blocks"][0]["address"] == small
    assert any(s["stream"] == 7 and s["blocks"][0]["address"] == big for s in by_type["large"])
    s = a.stats()
    assert s["segment.small_pool.current"] == 1
    assert len(by_type["large"]) == s["segment.large_pool.current"]


def test_empty_cache_keeps_pool_size(make):
    a = make(pool_size=16 * MiB, segment_size=4 * MiB)
    ps = [a.malloc(6 * MiB) for _ in range(5)]
    for p in ps:
        a.free(p)
    released = a.empty_cache()
    s = a.stats()
    assert released > 0
    assert s["reserved_bytes.all.current"] == 16 * MiB
    p = a.malloc(15 * MiB)  # served from what was kept
    assert a.stats()["num_device_alloc"] == s["num_device_alloc"]
    a.free(p)


def test_oom_message_gives_the_size_asked_for(make):
    a = make(max_pool_size=4 * MiB, segment_size=2 * MiB)
    a.malloc(4 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(1000)
    assert "tried to allocate 1000 B" in str(e.value)
    assert a.stats()["num_oom_rejections"] == 1  # refused by the cap before trying
    with pytest.raises(pyalloc.OutOfMemoryError) as e:
        a.malloc(5 * MiB + 1)
    assert f"tried to allocate {pyalloc._C.format_bytes(5 * MiB + 1)}" in str(e.value)


def test_oom_refused_at_once_by_the_device_is_a_rejection():
    # The device's known free memory cannot hold it: refused before trying.
    a = pyalloc.Allocator("virtual", capacity=8 * MiB, strategy="bestfit", segment_size=2 * MiB)
    with pytest.raises(pyalloc.OutOfMemoryError):
        a.malloc(16 * MiB)
    s = a.stats()
    assert s["num_ooms"] == 1 and s["num_oom_rejections"] == 1


def test_oom_after_trying_is_no_rejection():
    # Room in the device and the cache together, but fragmented: found only
    # by trying (a retry after giving the cache back), so no rejection.
    a = pyalloc.Allocator("virtual", capacity=64 * MiB, strategy="bestfit", segment_size=20 * MiB)
    ps = [a.malloc(6 * MiB) for _ in range(8)]
    for p in ps[::2]:
        a.free(p)
    with pytest.raises(pyalloc.OutOfMemoryError, match="fragmented"):
        a.malloc(20 * MiB)
    s = a.stats()
    assert (s["num_ooms"], s["num_oom_rejections"], s["num_alloc_retries"]) == (1, 0, 1)


# -- a CUDA device: every pool counted together, as PyTorch counts a device ---------------


@pytest.fixture
def fake():
    import gc

    pyalloc._C._testing_use_fake_devices(64 * MiB)
    try:
        yield
    finally:
        gc.collect()
        pyalloc._C._testing_reset()


def hook_free(ptr):
    import ctypes

    lib = ctypes.CDLL(pyalloc._C.library_path())
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.pyalloc_free(ptr, 0, 0, None)


def test_device_peaks_are_the_devices_own_not_a_sum_of_its_pools(fake):
    _C = pyalloc._C
    p = _C._testing_hook_malloc(8 * MiB, 0, 0)
    hook_free(p)                          # the general pool peaked at 8 MiB
    buf = _C.cuda_buffer(0, 6 * MiB, 0)   # the buffer pool at 6 MiB, later
    s = pyalloc.memory_stats(0)
    check_identities(s)
    assert s["allocated_bytes.all.current"] == 6 * MiB
    # Never 14 MiB at once: torch.cuda.max_memory_allocated() is the device's peak.
    assert s["allocated_bytes.all.peak"] == pyalloc.max_memory_allocated(0) == 8 * MiB
    assert s["allocation.all.peak"] == 1 and s["active_bytes.all.peak"] == 8 * MiB
    del buf
    pyalloc.reset_peak_memory_stats(0)
    s = pyalloc.memory_stats(0)
    assert s["allocated_bytes.all.peak"] == 0
    assert s["reserved_bytes.all.peak"] == s["reserved_bytes.all.current"] > 0


def test_graph_pools_count_in_the_device_and_by_pool_id(fake):
    _C = pyalloc._C
    stream, pid = 0x5000, (0, 7)
    pyalloc.record_history(True)
    _C._testing_pool_hook("begin_allocate_to_pool", 0, pid, [stream])
    g = _C._testing_hook_malloc(3 * MiB, 0, stream)  # into the graph pool
    p = _C._testing_hook_malloc(MiB, 0, 0)           # into the general pool
    s = pyalloc.memory_stats(0)
    check_identities(s)
    assert s["allocated_bytes.all.current"] == pyalloc.memory_allocated(0) == 4 * MiB
    private = {k for k in s if k.startswith("reserved_bytes_by_private_pools.")}
    assert private == {f"reserved_bytes_by_private_pools.0_7.{pool}.{field}"
                       for pool in ("all", "small_pool", "large_pool")
                       for field in ("current", "peak", "allocated", "freed")}
    held = s["reserved_bytes_by_private_pools.0_7.all.current"]
    assert held >= 3 * MiB and held == s["reserved_bytes_by_private_pools.0_7.large_pool.current"]
    # The snapshot lists the graph pool's segments under its id, and adds up to the stats.
    snap = pyalloc.snapshot()
    assert sum(seg["total_size"] for seg in snap["segments"] if seg["segment_pool_id"] == pid) == held
    for pool in ("small", "large"):
        segs = [seg for seg in snap["segments"] if seg["segment_type"] == pool]
        assert len(segs) == s[f"segment.{pool}_pool.current"]
        assert sum(seg["total_size"] for seg in segs) == s[f"reserved_bytes.{pool}_pool.current"]
    assert any(e["action"] == "alloc" and e["addr"] == g for e in snap["device_traces"][0])
    # The graph is gone: the pool's memory goes back, its record stays until a reset.
    _C._testing_pool_hook("end_allocate_to_pool", 0, pid)
    hook_free(g)
    _C._testing_pool_hook("release_pool", 0, pid)
    s = pyalloc.memory_stats(0)
    check_identities(s)
    assert s["allocated_bytes.all.current"] == MiB and s["allocated_bytes.all.peak"] == 4 * MiB
    assert s["reserved_bytes_by_private_pools.0_7.all.current"] == 0
    assert s["reserved_bytes_by_private_pools.0_7.all.peak"] == held
    assert s["reserved_bytes_by_private_pools.0_7.all.freed"] == held
    pyalloc.reset_peak_memory_stats(0)
    assert not any(k.startswith("reserved_bytes_by_private_pools.") for k in pyalloc.memory_stats(0))
    hook_free(p)
    pyalloc.record_history(False)


# -- each figure's meaning, by value (PyTorch's c10/cuda/CUDACachingAllocator.cpp) -------


def test_requested_bytes_drop_when_the_free_completes_as_active_does(make):
    # PyTorch's free() lowers allocation and allocated_bytes; its free_block(), once
    # the streams record_stream() named are done, lowers active, active_bytes and
    # requested_bytes together. A snapshot's segment counts the requests of its
    # active blocks, pending frees included.
    a = make()
    p = a.malloc(1000, stream=11)
    a.record_stream(p, 22)
    a.stream_set_busy(22)
    a.free(p)
    s = a.stats()
    assert (s["allocation.all.current"], s["allocated_bytes.all.current"]) == (0, 0)
    assert (s["active.all.current"], s["active_bytes.all.current"]) == (1, 1024)
    assert (s["requested_bytes.all.current"], s["requested_bytes.all.freed"]) == (1000, 0)
    segs = [seg for seg in a.snapshot()["segments"]
            if any(b["state"] == "active_pending_free" for b in seg["blocks"])]
    assert [seg["requested_size"] for seg in segs] == [1000]
    a.check_invariants()
    a.stream_complete(22)
    a.empty_cache()  # waits for every stream: the free completes
    s = a.stats()
    assert (s["active.all.current"], s["active_bytes.all.current"]) == (0, 0)
    assert (s["requested_bytes.all.current"], s["requested_bytes.all.freed"]) == (0, 1000)
    a.check_invariants()


def test_vmm_counts_nothing_as_inactive_split_as_pytorch_leaves_out_expandable_segments():
    # inactive_split is memory empty_cache cannot give back. PyTorch leaves its
    # expandable segments out of it (their free pages always go back), and so does
    # vmm: a cached run beside unmapped pages is released whole by empty_cache.
    def inactive(a):
        s = a.stats()
        return s["inactive_split.all.current"], s["inactive_split_bytes.all.current"]

    vmm = pyalloc.Allocator("virtual", strategy="vmm", capacity=1 << 30)
    vmm.free(vmm.malloc(40 * MiB))
    assert vmm.stats()["reserved_bytes.all.current"] >= 40 * MiB
    assert inactive(vmm) == (0, 0)
    keep = vmm.malloc(4 * MiB)
    small = [vmm.malloc(1000) for _ in range(2)]
    vmm.free(small[0])  # a free block in a split small-pool chunk
    assert inactive(vmm) == (0, 0)
    vmm.check_invariants()
    vmm.free(keep)
    vmm.free(small[1])
    vmm.empty_cache()
    assert vmm.stats()["reserved_bytes.all.current"] == 0
    # bestfit as PyTorch without expandable segments: a whole free segment is
    # releasable, a free part of a split one is not.
    best = pyalloc.Allocator("virtual", strategy="bestfit", segment_size=20 * MiB)
    best.free(best.malloc(40 * MiB))
    assert inactive(best) == (0, 0)
    p, q = best.malloc(4 * MiB), best.malloc(4 * MiB)
    best.free(p)
    assert inactive(best) == (2, 36 * MiB)  # p's 4 MiB and the 32 MiB after q
    best.check_invariants()


def test_reset_accumulated_memory_stats_zeroes_every_counter(fake):
    # Every counter made nonzero first, through the device's route: an
    # out-of-memory error found only by retrying, an empty_cache (a sync of all
    # streams), and the driver calls behind them.
    _C = pyalloc._C
    ps = [_C._testing_hook_malloc(6 * MiB, 0, 0) for _ in range(8)]
    for p in ps[::2]:
        hook_free(p)
    with pytest.raises(pyalloc.OutOfMemoryError):
        _C._testing_hook_malloc(30 * MiB, 0, 0)
    for p in ps[1:-1:2]:
        hook_free(p)
    pyalloc.empty_cache(0)  # gives back the segments now wholly free
    counters = ("num_ooms", "num_alloc_retries", "num_sync_all_streams", "num_driver_calls",
                "num_device_alloc", "num_device_free")
    s = pyalloc.memory_stats(0)
    assert all(s[k] > 0 for k in counters), {k: s[k] for k in counters}
    live = s["allocated_bytes.all.current"]
    pyalloc.reset_accumulated_memory_stats(0)
    s = pyalloc.memory_stats(0)
    assert {k: s[k] for k in counters} == dict.fromkeys(counters, 0)
    assert s["num_oom_rejections"] == 0
    assert s["allocated_bytes.all.current"] == live == 6 * MiB  # counts stay; sums and counters restart
    hook_free(ps[-1])
