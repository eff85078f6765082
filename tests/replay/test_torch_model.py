"""The model of PyTorch's caching allocator (csrc/replay/torch_model.h): its policy
on small hand-made traces, the seam that runs the three allocators of a replay
(pyalloc/replay/allocators.py), and the model against the device calls real
snapshots recorded (pyalloc/replay/validate.py)."""
from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from pyalloc import _C
from pyalloc.replay import plan_trace, replay
from pyalloc.replay.allocators import ALLOCATORS, AllocatorRun, run_allocator
from pyalloc.replay.validate import validate
from pyalloc.replay.snapshot_io import read_trace
from shared_dir import SHARED_DIR

KiB, MiB = 1 << 10, 1 << 20
SEG_ALLOC, SEG_FREE, SEG_MAP, SEG_UNMAP = 3, 4, 5, 6

ROOT = Path(__file__).resolve().parents[2]
SHARED = SHARED_DIR / "traces"
BUNDLED = ROOT / "benchmarks" / "traces"
needs_shared = pytest.mark.shared


def calls_of(ops):
    """A ReplayTrace from [("a", id, size, stream=0) | ("f", id)]."""
    kinds, ids, sizes, streams = array("B"), array("I"), array("Q"), array("Q")
    for op in ops:
        kinds.append(1 if op[0] == "a" else 2)
        ids.append(op[1])
        sizes.append(op[2] if op[0] == "a" else 0)
        streams.append(op[3] if op[0] == "a" and len(op) > 3 else 0)
    return _C.ReplayTrace(kinds, ids, sizes, streams)


def model(ops, **kw):
    return _C.run_torch_model(calls_of(ops), record_calls=True, **kw)


def made(r, kind=None):
    """(action, op, bytes) of the model's calls."""
    return [(k, op, size) for k, op, _, size in r["calls"] if kind is None or k == kind]


# -- the default policy --------------------------------------------------------


def test_rounding_and_segment_sizes():
    r = model([("a", 0, 1), ("a", 1, MiB + 1), ("a", 2, 10 * MiB - 1), ("a", 3, 10 * MiB + 1)])
    # <= 1 MiB: a 2 MiB small-pool segment; under 10 MiB: 20 MiB (the second request fits in
    # what the first left of it); larger: rounded up to 2 MiB.
    assert made(r) == [(SEG_ALLOC, 0, 2 * MiB), (SEG_ALLOC, 1, 20 * MiB), (SEG_ALLOC, 3, 12 * MiB)]
    assert r["peak_reserved_bytes"] == 34 * MiB and r["driver_calls"] == 3 and r["completed"]


def test_small_requests_share_a_segment_by_512_byte_blocks():
    # 1000 B rounds to 1024 B: 2048 of them fill one 2 MiB segment, the next needs another.
    ops = [("a", i, 1000) for i in range(2049)]
    r = model(ops)
    assert made(r) == [(SEG_ALLOC, 0, 2 * MiB), (SEG_ALLOC, 2048, 2 * MiB)]


def test_large_blocks_split_only_when_more_than_1_mib_is_left():
    # 19 MiB of a 20 MiB segment leaves 1 MiB: not split, so 1.5 MiB needs a new segment.
    r = model([("a", 0, 19 * MiB), ("a", 1, 3 * MiB // 2)])
    assert len(made(r, SEG_ALLOC)) == 2
    # 18.5 MiB leaves 1.5 MiB: split off, and 1.5 MiB fits there.
    r = model([("a", 0, 37 * MiB // 2), ("a", 1, 3 * MiB // 2)])
    assert len(made(r, SEG_ALLOC)) == 1


def test_freed_blocks_merge_and_are_reused():
    r = model([("a", 0, 4 * MiB), ("a", 1, 4 * MiB), ("f", 0), ("f", 1), ("a", 2, 12 * MiB)])
    assert made(r) == [(SEG_ALLOC, 0, 20 * MiB)]


def test_streams_do_not_share_cached_blocks():
    r = model([("a", 0, 12 * MiB, 1), ("f", 0), ("a", 1, 12 * MiB, 2), ("f", 1), ("a", 2, 12 * MiB, 1)])
    assert made(r) == [(SEG_ALLOC, 0, 12 * MiB), (SEG_ALLOC, 2, 12 * MiB)]


def test_best_fit_breaks_ties_by_the_lowest_address():
    # Two free 12 MiB segments; the driver placed the second lower. The request takes
    # that one, so a release then frees the first.
    r = model([("a", 0, 12 * MiB), ("a", 1, 12 * MiB), ("f", 0), ("f", 1), ("a", 2, 12 * MiB)],
              releases=array("Q", [5]))
    first, second = r["calls"][0][2], r["calls"][1][2]
    assert second < first
    assert [(k, addr) for k, _, addr, _ in r["calls"][2:]] == [(SEG_FREE, first)]


def test_release_frees_only_wholly_free_segments_of_every_stream():
    ops = [("a", 0, 12 * MiB, 1), ("a", 1, 12 * MiB, 2), ("a", 2, 4 * MiB, 2), ("a", 3, 14 * MiB, 2),
           ("f", 0), ("f", 1), ("f", 2)]
    r = model(ops, releases=array("Q", [7]))
    # Stream 1's segment and stream 2's 12 MiB one go; the 20 MiB one holds a live 14 MiB block.
    assert sorted(size for _, _, size in made(r, SEG_FREE)) == [12 * MiB, 12 * MiB]


def test_out_of_memory_releases_the_cache_and_retries():
    ops = [("a", 0, 12 * MiB), ("f", 0), ("a", 1, 14 * MiB)]
    r = model(ops, capacity=20 * MiB)
    assert r["completed"] and r["retries"] == 1
    assert made(r) == [(SEG_ALLOC, 0, 12 * MiB), (SEG_FREE, 2, 12 * MiB), (SEG_ALLOC, 2, 14 * MiB)]
    # cudaMalloc, the one refused, cudaFree, cudaMalloc.
    assert r["driver_calls"] == 4 and r["peak_reserved_bytes"] == 14 * MiB
    # Unbounded, the cache is kept and the device grows instead.
    assert model(ops)["peak_reserved_bytes"] == 26 * MiB


def test_out_of_memory_after_the_retry_refuses_the_allocation():
    ops = [("a", 0, 12 * MiB), ("a", 1, 14 * MiB), ("f", 1), ("a", 2, 512), ("f", 0)]
    r = model(ops, capacity=20 * MiB)
    assert not r["completed"] and r["ooms"] == 1 and r["first_oom_op"] == 1 and r["retries"] == 1
    assert r["second_half_device_calls"] is not None  # the replay went on past the refusal
    r = model(ops, capacity=20 * MiB, stop_on_oom=True)
    assert r["ooms"] == 1 and r["second_half_device_calls"] is None


def test_seeded_segments_and_blocks_placed_at_their_addresses():
    base = 0x7F0000000000
    ops = [("a", 0, 4 * MiB), ("a", 1, 12 * MiB)]
    place = array("Q", [base + 8 * MiB, 0])
    r = model(ops, seed=[(base, 20 * MiB, 0, False)], place_at=place)
    # The placed block leaves 8 MiB free on either side: 12 MiB needs a segment of its own.
    assert made(r) == [(SEG_ALLOC, 1, 12 * MiB)] and r["misplaced"] == 0
    assert r["peak_reserved_bytes"] == 32 * MiB
    # Not placed, the 4 MiB block would take the front, and 12 MiB would fit behind it.
    assert made(model(ops, seed=[(base, 20 * MiB, 0, False)])) == []


def test_driver_addresses_are_used_when_the_sizes_agree():
    r = model([("a", 0, 12 * MiB), ("a", 1, 14 * MiB)],
              malloc_hints=[(12 * MiB, 0x7F0000000000), (16 * MiB, 0x7E0000000000)])
    assert r["calls"][0][2] == 0x7F0000000000
    assert r["calls"][1][2] != 0x7E0000000000  # 14 MiB, not 16: the model's own address


# -- expandable segments -------------------------------------------------------


def test_expandable_maps_pages_on_demand():
    ops = [("a", 0, MiB + 1), ("a", 1, 5 * MiB), ("a", 2, 30 * MiB), ("a", 3, 512)]
    r = model(ops, expandable=True)
    # 20 MiB pages for the large pool, mapped only for what the free tail lacks; 2 MiB for the small.
    assert made(r) == [(SEG_MAP, 0, 20 * MiB), (SEG_MAP, 2, 20 * MiB), (SEG_MAP, 3, 2 * MiB)]
    # A range reserved per pool (cuMemAddressReserve); for each one-page map
    # cuMemCreate, cuMemMap and cuMemSetAccess.
    assert r["driver_calls"] == 2 + 3 * 3 and r["device_calls"] == 3


def test_expandable_request_larger_than_a_range_is_no_crash():
    """Unbounded, each expandable range was 1 TiB: a larger request mapped the
    whole range and went on mapping past its end (a null block): a segfault.
    The range now holds the request; one no address space holds is refused."""
    r = model([("a", 0, 2 << 40), ("f", 0)], expandable=True)
    assert r["completed"] and r["peak_reserved_bytes"] >= 2 << 40
    r = model([("a", 0, 1 << 56)], expandable=True)
    assert not r["completed"] and r["ooms"] == 1


def test_expandable_driver_calls_per_mapping():
    """As PyTorch's ExpandableSegment makes them: one cuMemAddressReserve per
    (stream, pool) range; mapping k pages is k cuMemCreate, k cuMemMap and one
    cuMemSetAccess over the k pages (regression: counted 3 per page)."""
    ops = [("a", 0, 50 * MiB), ("a", 1, 70 * MiB), ("a", 2, MiB + 1, 1)]
    r = model(ops, expandable=True)
    assert made(r) == [(SEG_MAP, 0, 60 * MiB), (SEG_MAP, 1, 60 * MiB), (SEG_MAP, 2, 20 * MiB)]
    # Stream 0's range and 3 pages, 3 more pages; stream 1's range and one page.
    assert r["driver_calls"] == (1 + 7) + 7 + (1 + 3)


def test_expandable_reuses_holes_before_growing():
    ops = [("a", 0, 8 * MiB), ("a", 1, 8 * MiB), ("f", 0), ("a", 2, 6 * MiB)]
    r = model(ops, expandable=True)
    assert made(r, SEG_MAP) == [(SEG_MAP, 0, 20 * MiB)]


def test_expandable_unmaps_whole_pages_of_free_blocks_only():
    ops = [("a", 0, MiB + 1), ("a", 1, 25 * MiB), ("f", 1)]
    r = model(ops, expandable=True, releases=array("Q", [3]))
    # The live block pins the first page; the second is unmapped (cuMemUnmap, cuMemRelease).
    assert made(r) == [(SEG_MAP, 0, 20 * MiB), (SEG_MAP, 1, 20 * MiB), (SEG_UNMAP, 3, 20 * MiB)]
    assert r["driver_calls"] == 1 + 3 * 2 + 2  # the range, two one-page maps, one unmap
    # Everything freed, then released: both pages go, and the range with them.
    r = model(ops + [("f", 0)], expandable=True, releases=array("Q", [4]))
    assert made(r)[-1] == (SEG_UNMAP, 4, 40 * MiB)
    assert r["driver_calls"] == 1 + 3 * 2 + 2 * 2 + 1  # ... two pages unmapped, cuMemAddressFree


def test_expandable_out_of_memory_unmaps_and_retries():
    # Stream 1 caches a 20 MiB page; stream 2 needs it: only the retry's unmap makes room.
    ops = [("a", 0, 12 * MiB, 1), ("f", 0), ("a", 1, 12 * MiB, 2)]
    r = model(ops, expandable=True, capacity=30 * MiB)
    assert r["completed"] and r["retries"] == 1
    assert made(r) == [(SEG_MAP, 0, 20 * MiB), (SEG_UNMAP, 2, 20 * MiB), (SEG_MAP, 2, 20 * MiB)]


# -- bad input -----------------------------------------------------------------


def test_bad_options_are_value_errors():
    calls = calls_of([("a", 0, 1)])
    with pytest.raises(ValueError, match="place_at"):
        _C.run_torch_model(calls, place_at=array("Q", [0, 0]))
    with pytest.raises(ValueError, match="ascending"):
        _C.run_torch_model(calls, releases=array("Q", [1, 0]))
    with pytest.raises(ValueError, match="expandable"):
        _C.run_torch_model(calls, expandable=True, seed=[(0x7F0000000000, 2 * MiB, 0, True)])
    with pytest.raises(ValueError, match="overlap"):
        _C.run_torch_model(calls, seed=[(0x7F0000000000, 20 * MiB, 0, False), (0x7F0000200000, 2 * MiB, 0, True)])


# -- the seam ------------------------------------------------------------------


def test_run_allocator_runs_each_allocator_and_refuses_unknown_names():
    calls = calls_of([("a", 0, 12 * MiB), ("f", 0), ("a", 1, 24 * MiB), ("a", 2, 100)])
    for name in ALLOCATORS:
        run = run_allocator(calls, name)
        assert isinstance(run, AllocatorRun) and run.completed and run.ooms == 0 and run.first_oom_op == -1
        assert run.peak_reserved_bytes >= 24 * MiB + 100 and run.device_calls >= 2
        tight = run_allocator(calls, name, capacity=21 * MiB)
        assert not tight.completed and tight.ooms >= 1 and tight.first_oom_op == 2
        assert tight.retries >= (name != "pyalloc")  # PyTorch's path always retries once
        assert run_allocator(calls, name, capacity=21 * MiB, stop_on_oom=True).ooms == 1
    assert run_allocator(calls, "native").driver_calls == 3
    with pytest.raises(ValueError, match="valid allocators: pyalloc, native, native_expandable"):
        run_allocator(calls, "jemalloc")
    with pytest.raises(ValueError, match="capacity"):
        run_allocator(calls, "native", capacity=0)


# -- validation against recorded snapshots ---------------------------------------


def snapshot(events, segments=(), expandable=False):
    entries = [{"action": a, "addr": addr, "size": size, "stream": 0} for a, addr, size in events]
    return {"segments": list(segments), "device_traces": [entries],
            "allocator_settings": {"expandable_segments": expandable}}


def check(snap, device=None):
    trace = read_trace(snap, device)
    plan = plan_trace(trace)
    return validate(trace, plan, _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams))


def test_validation_replays_the_recordings_own_empty_cache():
    a, b = 0x7F0000000000, 0x7E0000000000
    events = [("segment_alloc", a, 20 * MiB), ("alloc", a, 4 * MiB), ("free_requested", a, 4 * MiB),
              ("free_completed", a, 4 * MiB),
              ("segment_free", a, 20 * MiB),  # empty_cache(): the model would keep it
              ("segment_alloc", b, 20 * MiB), ("alloc", b, 4 * MiB)]
    v = check(snapshot(events))
    assert (v.allocator, v.matched_calls, v.recorded_calls, v.first_mismatch) == ("native", 3, 3, None)
    assert v.releases == 1 and v.by_action == {"segment_alloc": [2, 2], "segment_free": [1, 1]}
    # A recording whose allocator made a call the model would not: counted as a mismatch.
    wrong = events[:5] + [("segment_alloc", b, 40 * MiB), ("alloc", b, 4 * MiB)]
    v = check(snapshot(wrong))
    assert (v.matched_calls, v.recorded_calls, v.first_mismatch) == (2, 3, 2)


def test_a_snapshot_pyalloc_recorded_is_not_checked_against_a_model_of_pytorch():
    """Regression: pyalloc's own bestfit snapshots hold segment_map events (chunks
    lent between pools), and were checked against the model of expandable
    segments, as if PyTorch had recorded them ('2/76 matched')."""
    import random

    import pyalloc

    a = pyalloc.Allocator("virtual", "strategy:bestfit")
    a.record_history(True)
    rng, live = random.Random(3), []
    for _ in range(300):
        if rng.random() < 0.6 or not live:
            live.append(a.malloc(rng.choice([rng.randint(1, 200_000), rng.randint(MiB, 6 * MiB)]), rng.choice([0, 7])))
        else:
            a.free(live.pop(rng.randrange(len(live))))
    snap = a.snapshot()
    assert any(e["action"] in ("segment_alloc", "segment_map") for e in snap["device_traces"][0])
    assert replay(snap, search=False).validation is None


def test_validation_starts_from_the_segments_before_the_trace():
    a, b = 0x7F0000000000, 0x7E0000000000

    def live(addr, size):
        return {"address": addr, "size": size, "requested_size": size, "state": "active_allocated"}

    segments = [{"device": 0, "address": a, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": [live(a, 6 * MiB), live(a + 6 * MiB, 10 * MiB)]},
                {"device": 0, "address": b, "total_size": 12 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": [live(b, 12 * MiB)]}]
    # Segment a was there before the trace, with a block live in it: 10 MiB fits
    # behind that block, and only the 12 MiB request needs a cudaMalloc.
    events = [("alloc", a + 6 * MiB, 10 * MiB), ("segment_alloc", b, 12 * MiB), ("alloc", b, 12 * MiB)]
    v = check(snapshot(events, segments))
    assert v.seeded_segments == 1 and (v.matched_calls, v.recorded_calls, v.model_calls) == (1, 1, 1)
    assert v.peak_reserved_bytes == 32 * MiB
    # Nothing recorded to compare with: no verdict.
    assert check(snapshot(events[:1], segments[:1])) is None


def traced(name, device=None):
    trace = read_trace(SHARED / name, device)
    plan = plan_trace(trace)
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    return trace, plan, calls


# (file, device, model, recorded calls): every call matches, in order.
RECORDED = [
    ("cs336-2.7b-ctx128-fullstep.pickle", None, "native", 783),
    ("tinyllama-lora-8bit-step.pickle", None, "native", 152),
    ("gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle", 0, "native_expandable", 175),
    ("gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle", 1, "native_expandable", 46),
    ("gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle", 2, "native_expandable", 78),
    ("gpu/maphsge4-select_n-llama7b-offload-infer-10streams.pickle", None, "native", 1163),
    ("gpu/mercuryb1-sqattn-qwen2.5-7b-layerwise-quant-calib.pickle", None, "native", 840),
    ("gpu/zidongliu-decomfl-opt125m-zo-fedlearn-windows.pickle", None, "native", 61),
    ("gpu/jaspersolt-eor_nn-cnn-counterfactuals.pickle", None, "native", 7),
]


@needs_shared
@pytest.mark.parametrize("name,device,allocator,count", RECORDED)
def test_the_model_makes_every_recorded_device_call(name, device, allocator, count):
    trace, plan, calls = traced(name, device)
    v = validate(trace, plan, calls)
    assert v.allocator == allocator
    assert (v.matched_calls, v.recorded_calls, v.model_calls, v.first_mismatch) == (count, count, count, None)
    # From the same start, the model's peak reserved is the recording's.
    assert v.peak_reserved_bytes == plan.native_peak_reserved_bytes


@needs_shared
def test_cs336_cudamallocs_and_peak():
    trace, plan, calls = traced("cs336-2.7b-ctx128-fullstep.pickle")
    v = validate(trace, plan, calls)
    assert v.by_action == {"segment_alloc": [783, 783]}
    assert v.peak_reserved_bytes == 58280 * MiB
    # Given the recording driver's addresses instead of its own, the same.
    assert validate(trace, plan, calls, driver_addresses=True).matched_calls == 783


@needs_shared
def test_constructor_sun_device_1_out_of_memory_retry_is_replayed():
    trace, plan, calls = traced("gpu/constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle", 1)
    v = validate(trace, plan, calls)
    # The six unmaps of the recording's retry before its 5 GB request, then the map.
    assert v.releases == 1 and v.by_action == {"segment_map": [40, 40], "segment_unmap": [6, 6]}


@needs_shared
def test_tinyllama_needs_the_blocks_live_before_the_trace_in_place():
    trace, plan, calls = traced("tinyllama-lora-8bit-step.pickle")
    v = validate(trace, plan, calls)
    assert v.matched_calls == 152
    # Without the recorded addresses of its blocks, the seeded segments fill differently.
    plan.preexisting_addrs = array("Q", [0] * len(plan.preexisting_addrs))
    assert validate(trace, plan, calls).matched_calls < 152


@needs_shared
def test_cs336_at_equal_budgets():
    r = replay(SHARED / "cs336-2.7b-ctx128-fullstep.pickle")
    live = r.peak_live_bytes
    # PyTorch under a cap frees its cache and retries: far below its uncapped 1.115 x.
    assert r.native_peak_reserved_bytes / live == pytest.approx(1.115, abs=0.002)
    assert r.native_min_budget_bytes / live == pytest.approx(1.011, abs=0.003)
    assert r.native_expandable_min_budget_bytes / live == pytest.approx(1.013, abs=0.003)
    assert r.native_budget_retries >= 1
    assert r.validation["matched_calls"] == r.validation["recorded_calls"] == 783


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_each_allocators_budget_is_the_smallest_it_completes_on(allocator):
    from pyalloc.replay.allocators import fits
    from pyalloc.replay.result import BUDGET_PRECISION

    r = replay(BUNDLED / "encoder-dynbatch-infer.pickle.gz")
    budget = getattr(r, f"{allocator}_min_budget_bytes")
    assert r.peak_live_bytes <= budget <= getattr(r, f"{allocator}_peak_reserved_bytes")
    trace = read_trace(BUNDLED / "encoder-dynbatch-infer.pickle.gz")
    plan = plan_trace(trace)
    calls = _C.ReplayTrace(plan.kinds, plan.ids, plan.sizes, plan.streams)
    assert fits(calls, "", budget, allocator)
    assert not fits(calls, "", int(budget * (1 - 2 * BUDGET_PRECISION)), allocator)
    # Retries at that budget: PyTorch frees its cache at least once to fit it.
    if allocator != "pyalloc":
        assert getattr(r, f"{allocator}_budget_retries") >= 1
