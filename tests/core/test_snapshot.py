"""snapshot() in PyTorch's memory-snapshot layout."""
import pyalloc

MiB = 1 << 20
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "frames", "blocks"}
BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}


def test_layout_and_tiling(make):
    a = make(segment_size=32 * MiB)
    live = [a.malloc(n) for n in (100, 3000, 5 * MiB, 7 * MiB)]
    a.free(live[1])
    snap = a.snapshot()
    assert set(snap) >= {"segments", "device_traces"}
    total = 0
    for seg in snap["segments"]:
        assert set(seg) == SEGMENT_KEYS
        addr = seg["address"]
        for b in seg["blocks"]:
            assert set(b) == BLOCK_KEYS
            assert b["address"] == addr
            addr += b["size"]
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
        assert addr == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        total += seg["total_size"]
    assert total == a.stats()["reserved_bytes.all.current"]
    allocated = {b["address"]: b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                 if b["state"] == "active_allocated"}
    assert allocated == {live[0]: 100, live[2]: 5 * MiB, live[3]: 7 * MiB}


def test_history_records_alloc_free_and_segment_events(make):
    a = make(strategy="bestfit", segment_size=2 * MiB)
    a.record_history(True, max_entries=1000)
    p = a.malloc(3 * MiB)
    a.free(p)
    a.empty_cache()
    actions = [e["action"] for e in a.snapshot()["device_traces"][0]]
    assert actions == ["segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]
    e = a.history()[1]
    assert e["addr"] == p and e["size"] == 3 * MiB and e["stream"] == 0 and "time_us" in e


def test_history_is_a_ring_buffer(make):
    a = make()
    a.record_history(True, max_entries=10)
    ptrs = [a.malloc(512 * (i + 1)) for i in range(20)]
    h = a.history()
    assert len(h) == 10
    assert [e["addr"] for e in h] == ptrs[-10:]
    a.record_history(False)
    assert a.history() == []


def test_oom_is_recorded(make):
    a = make(max_pool_size=4 * MiB)
    a.record_history(True)
    try:
        a.malloc(8 * MiB)
    except pyalloc.OutOfMemoryError:
        pass
    assert a.history()[-1]["action"] == "oom"
