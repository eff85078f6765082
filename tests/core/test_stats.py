"""stats() mirrors torch.cuda.memory_stats(): same keys, same meanings."""
import itertools

import pyalloc

MiB = 1 << 20

FAMILIES = ["allocation", "segment", "active", "inactive_split", "allocated_bytes",
            "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"]
METRICS = ["current", "peak", "allocated", "freed"]
TORCH_KEYS = (
    {f"{f}.{p}.{m}" for f, p, m in itertools.product(FAMILIES, ["all", "small_pool", "large_pool"], METRICS)}
    | {f"{f}.{m}" for f, m in itertools.product(["oversize_allocations", "oversize_segments"], METRICS)}
    | {"num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
       "num_device_alloc", "num_device_free"}
)


def test_every_torch_key_is_present(make):
    s = make().stats()
    assert TORCH_KEYS <= set(s)
    assert list(s) == sorted(s)  # torch returns them sorted too
    assert all(isinstance(v, int) for v in s.values())


def test_counts_peaks_and_totals(make):
    a = make()
    p = a.malloc(3 * MiB)
    q = a.malloc(5 * MiB)
    a.free(p)
    r = a.malloc(1000)
    s = a.stats()
    assert s["allocation.all.current"] == 2
    assert s["allocation.all.peak"] == 2
    assert s["allocation.all.allocated"] == 3
    assert s["allocation.all.freed"] == 1
    assert s["allocated_bytes.large_pool.peak"] == 8 * MiB
    assert s["allocated_bytes.large_pool.freed"] == 3 * MiB
    assert s["allocated_bytes.small_pool.current"] == 1024
    assert s["requested_bytes.small_pool.current"] == 1000
    a.free(q)
    a.free(r)
    s = a.stats()
    for fam in ("allocation", "allocated_bytes", "active", "active_bytes", "requested_bytes"):
        assert s[f"{fam}.all.current"] == 0, fam


def test_reset_peak_stats(make):
    a = make()
    p = a.malloc(64 * MiB)
    a.free(p)
    a.malloc(MiB * 2)
    assert a.stats()["allocated_bytes.all.peak"] == 64 * MiB
    a.reset_peak_stats()
    s = a.stats()
    assert s["allocated_bytes.all.peak"] == 2 * MiB
    assert s["reserved_bytes.all.peak"] == s["reserved_bytes.all.current"]
    assert s["allocation.all.allocated"] == 2  # totals are not peaks


def test_all_is_the_sum_of_the_pools(make):
    a = make()
    ptrs = [a.malloc(n) for n in (100, 5000, 2 * MiB, 30 * MiB, 700_000)]
    a.free(ptrs[1])
    s = a.stats()
    for fam in FAMILIES:
        assert s[f"{fam}.all.current"] == s[f"{fam}.small_pool.current"] + s[f"{fam}.large_pool.current"], fam


def test_device_calls_are_counted(make):
    a = make(strategy="bestfit", segment_size=2 * MiB)
    ptrs = [a.malloc(2 * MiB) for _ in range(3)]
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    s = a.stats()
    assert s["num_device_alloc"] == 3 and s["num_device_free"] == 3


def test_fragmentation_figures(make):
    a = make(pool_size=64 * MiB, max_pool_size=64 * MiB)
    ptrs = [a.malloc(4 * MiB) for _ in range(16)]
    for p in ptrs[::2]:
        a.free(p)
    f = a.fragmentation()
    assert f["free_bytes"] == 32 * MiB
    assert f["largest_free_block"] == 4 * MiB
    assert f["free_blocks"] == 8
    assert abs(f["external_fragmentation"] - (1 - 4 / 32)) < 1e-12
    assert f["histogram"] == [{"min_size": 4 * MiB, "max_size": 8 * MiB - 1, "count": 8, "bytes": 32 * MiB}]
    assert f["reserved_bytes"] == 64 * MiB and f["allocated_bytes"] == 32 * MiB


def test_fragmentation_of_an_empty_pool(make):
    f = make().fragmentation()
    assert f["free_bytes"] == 0 and f["external_fragmentation"] == 0.0 and f["histogram"] == []
