"""Trace replay: address resolution, the state before the trace, streams, the
native figure, the C++ replayer, the budget search, the bundled traces' known
totals and the command line."""
import json
import os
import re
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from pyalloc import _C
from pyalloc.replay import plan_trace, replay
from pyalloc.replay.allocators import fits, run_allocator
from pyalloc.replay.snapshot_io import read_trace, write_snapshot
from shared_dir import SHARED_DIR

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "benchmarks" / "traces"
SHARED = SHARED_DIR / "traces"
MiB = 1 << 20


def ev(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0, "frames": []}


def life(addr, size, stream=0):
    """An alloc whose free is requested and completed right away."""
    return [ev("alloc", addr, size, stream), ev("free_requested", addr, size, stream),
            ev("free_completed", addr, size, stream)]


def snap(events, segments=()):
    return {"segments": list(segments), "device_traces": [list(events)]}


def segment(address, total, blocks, stream=0):
    return {"device": 0, "address": address, "total_size": total, "stream": stream,
            "segment_type": "large", "blocks": blocks}


def block(address, size, requested, state="active_allocated"):
    return {"address": address, "size": size, "requested_size": requested, "state": state, "frames": []}


def plan_of(snapshot):
    return plan_trace(read_trace(snapshot))


def ops(plan):
    """[(kind, id, size, stream, event)] with kinds as 'alloc' / 'free' / 'pending' (a free
    requested while another stream still uses the block)."""
    names = {1: "alloc", 2: "free", 3: "pending"}
    return [(names[k], i, s, st, e) for k, i, s, st, e in
            zip(plan.kinds, plan.ids, plan.sizes, plan.streams, plan.events)]


def readme_table(path):
    """The rows of the first markdown table in a README, as dicts by header."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


# -- address resolution ------------------------------------------------------


def test_addresses_are_reused_in_event_order():
    p = plan_of(snap(life(0x1000, 100) + life(0x1000, 300) + [ev("alloc", 0x1000, 50)]))
    allocs = [o for o in ops(p) if o[0] == "alloc"]
    assert [o[2] for o in allocs] == [100, 300, 50]
    assert len({o[1] for o in allocs}) == 3  # three allocations, not one
    assert (p.allocs, p.peak_live_bytes) == (3, 300)


def test_frees_happen_at_free_completed():
    events = [ev("alloc", 1, 100), ev("alloc", 2, 200), ev("free_requested", 1, 100),
              ev("alloc", 3, 50), ev("free_completed", 1, 100)]
    p = plan_of(snap(events))
    assert p.peak_live_bytes == 350  # block 1 is still in use by its stream when 3 arrives
    free = [o for o in ops(p) if o[0] == "free"]
    assert [o[4] for o in free] == [4]


def test_a_trace_without_completions_frees_at_request():
    events = [ev("alloc", 1, 100), ev("alloc", 2, 200), ev("free_requested", 1, 100), ev("alloc", 3, 50)]
    p = plan_of(snap(events))
    assert p.peak_live_bytes == 300
    assert p.frees_at_request == 0


def test_a_missing_completion_falls_back_to_the_request():
    events = life(9, 10) + [ev("alloc", 1, 100), ev("free_requested", 1, 100),
                            ev("alloc", 2, 500), ev("alloc", 1, 70)]
    p = plan_of(snap(events))
    assert p.frees_at_request == 1
    frees = [o for o in ops(p) if o[0] == "free"]
    assert [o[4] for o in frees] == [2, 4]  # the block at 1 is freed at its free_requested
    assert p.peak_live_bytes == 570


def test_a_free_still_pending_at_the_end_stays_live():
    events = life(9, 10) + [ev("alloc", 1, 100), ev("free_requested", 1, 100)]
    p = plan_of(snap(events))
    assert p.pending_at_end == 1
    assert sum(1 for o in ops(p) if o[0] == "free") == 1


def test_an_alloc_at_a_live_address_is_counted_and_frees_the_old_block():
    p = plan_of(snap([ev("alloc", 1, 100), ev("alloc", 1, 200), ev("free_completed", 1, 200)]))
    assert p.missed_frees == 1
    assert p.peak_live_bytes == 200
    result = replay(snap([ev("alloc", 1, 100), ev("alloc", 1, 200)]))
    assert result.missed_frees == 1 and result.allocs == 2


def test_a_second_free_is_counted_as_stray():
    p = plan_of(snap(life(1, 100) + [ev("free_completed", 1, 100), ev("free_requested", 1, 100)]))
    assert p.stray_frees == 2
    assert p.peak_live_bytes == 100


# -- the state before the trace ----------------------------------------------


def test_blocks_live_before_the_trace_are_allocated_first():
    segments = [
        segment(0x10000, 2 * MiB, [
            block(0x10000, 1024, 1000),                          # live throughout
            block(0x10400, 512, 7, "active_pending_free"),       # live throughout
            block(0x10600, 512, 0, "inactive"),                  # free: not live
            block(0x10800, 1024, 900),                           # allocated in the trace
            block(0x10c00, 2 * MiB - 0xc00, 0, "inactive"),
        ], stream=5),
    ]
    events = [
        ev("free_requested", 0x90000, 3000, stream=6),  # a free with no alloc: live before
        ev("free_completed", 0x90000, 3000, stream=6),
        ev("alloc", 0x10800, 900, stream=5),
        *life(0x20000, 700),
    ]
    p = plan_of(snap(events, segments))
    assert (p.preexisting_blocks, p.preexisting_bytes) == (3, 1000 + 7 + 3000)
    first = ops(p)[:3]
    # In address order, by requested size, on their own streams, before any event.
    assert [(o[0], o[2], o[3], o[4]) for o in first] == [
        ("alloc", 1000, 5, -1), ("alloc", 7, 5, -1), ("alloc", 3000, 6, -1)]
    assert p.peak_live_bytes == 1000 + 7 + 3000
    # After the free of the early block: 1007 + 900 + 700 at most.
    r = replay(snap(events, segments))
    assert r.peak_live_bytes == 4007 and r.preexisting_blocks == 3


def test_a_trace_of_only_frees_starts_from_those_blocks():
    p = plan_of(snap([ev("free_completed", 1, 100), ev("free_completed", 2, 50)]))
    assert (p.preexisting_blocks, p.peak_live_bytes, p.peak_live_op) == (2, 150, 1)


# -- streams -----------------------------------------------------------------


def test_each_allocation_stays_on_its_stream():
    segments = [segment(0x50000, 2 * MiB, [block(0x50000, 2 * MiB, 2 * MiB)], stream=3)]
    events = [ev("free_completed", 0x70000, 4 * MiB, stream=4)]
    for i in range(30):
        s = 1 + i % 2
        events += [ev("alloc", 0x1000 * i, (i + 1) * 100_000, stream=s)]
        if i % 3 == 0:
            events += [ev("free_requested", 0x1000 * i, (i + 1) * 100_000, stream=s),
                       ev("free_completed", 0x1000 * i, (i + 1) * 100_000, stream=s)]
    p = plan_of(snap(events, segments))
    assert p.stream_count == 4
    calls = _C.ReplayTrace(p.kinds, p.ids, p.sizes, p.streams)
    a = _C.Allocator("virtual", "", 0)
    a.record_history(True, 10_000)
    r = _C.Replayer(a, calls)
    for stop in range(1, len(p) + 1):
        r.run(stop)
        a.check_invariants()
    got = [(e["size"], e["stream"]) for e in a.history() if e["action"] == "alloc"]
    want = [(o[2], o[3]) for o in ops(p) if o[0] == "alloc"]
    assert got == want
    assert replay(snap(events, segments)).streams == 4


# -- the native allocator's reserved bytes -----------------------------------


def test_native_reserved_is_followed_back_from_the_final_segments():
    segments = [segment(0x100000, 60 * MiB, [block(0x100000, 10 * MiB, 10 * MiB)]),
                segment(0x9000000, 40 * MiB, [])]
    events = [
        ev("segment_alloc", 0x9000000, 20 * MiB),
        ev("alloc", 0x9000000, 5 * MiB),
        ev("segment_free", 0x7000000, 10 * MiB),
        ev("segment_map", 0xa000000, 4 * MiB),
        ev("segment_unmap", 0xa000000, 2 * MiB),
        {"action": "oom", "device_free": 0, "size": 1, "stream": 0},
    ]
    p = plan_of(snap(events, segments))
    # 100 MiB at the end, less what the trace reserved, plus what it gave back.
    assert p.native_start_bytes == (100 - 20 - 4 + 10 + 2) * MiB
    assert p.native_peak_reserved_bytes == 108 * MiB
    assert [r for _, r in p.native_points] == [108 * MiB, 98 * MiB, 102 * MiB, 100 * MiB]
    assert p.native_ooms == 1
    r = replay(snap(events, segments))
    assert r.recorded_peak_reserved_bytes == 108 * MiB
    assert r.recorded_ratio == pytest.approx(108 / 15)
    assert r.native_timeline["reserved_bytes"][0] == 88 * MiB
    assert r.native_timeline["reserved_bytes"][-1] == 100 * MiB


def test_an_expandable_map_unmapped_by_an_oom_retry_is_a_high_point():
    """PyTorch's expandable segments may map a range, fail the next mapping and
    unmap the same range in the retry: the map is a real high point. Only pyalloc's
    own cover segments (stream 2**64 - 1) bracket a change that is no peak."""
    segments = [segment(0x100000, 20 * MiB, [block(0x100000, 20 * MiB, 20 * MiB)])]
    events = [
        ev("segment_map", 0x2000000, 40 * MiB),
        ev("segment_map", 0x4800000, 20 * MiB),
        ev("segment_unmap", 0x2000000, 40 * MiB),
    ]
    assert plan_of(snap(events, segments)).native_peak_reserved_bytes == 60 * MiB
    cover = [dict(e, stream=(1 << 64) - 1) if e["addr"] == 0x2000000 else e for e in events]
    assert plan_of(snap(cover, segments)).native_peak_reserved_bytes == 20 * MiB


def test_native_is_unknown_without_segments():
    r = replay(snap(life(1, 100)))
    assert r.recorded_peak_reserved_bytes is None and r.recorded_ratio is None
    assert r.native_timeline == {}


def test_native_is_unknown_when_segments_and_events_disagree():
    p = plan_of(snap([ev("segment_alloc", 1, 40 * MiB)], [segment(1, 20 * MiB, [])]))
    assert p.native_peak_reserved_bytes is None


def test_segments_without_segment_events_mean_constant_reserved():
    p = plan_of(snap(life(1, 100), [segment(1, 20 * MiB, [])]))
    assert p.native_peak_reserved_bytes == 20 * MiB


# -- the C++ replayer --------------------------------------------------------


def trace_of(*ops_):
    kinds, ids, sizes, streams = zip(*ops_)
    return _C.ReplayTrace(array("B", kinds), array("I", ids), array("Q", sizes), array("Q", streams))


@pytest.mark.parametrize(
    "bad, match",
    [
        ([(2, 0, 0, 0)], "frees an id that is not live"),
        ([(1, 0, 8, 0), (1, 0, 8, 0)], "allocates an id that is still live"),
        ([(4, 0, 8, 0)], "valid kinds"),
        ([(3, 0, 8, 0)], "requests the free of an id that is not live"),
        ([(1, 0, 8, 0), (3, 0, 0, 0), (3, 0, 0, 0)], "requests the free of an id already pending"),
        ([(1, 0, 8, 0), (2, 0, 0, 0), (3, 0, 0, 0)], "requests the free of an id that is not live"),
        ([(1, 0, 8, 0), (3, 0, 0, 0), (1, 0, 8, 0)], "allocates an id that is still live"),
        ([(1, 0, 8, 0), (3, 7, 0, 0)], "below the number of ops"),
    ],
)
def test_replay_trace_rejects_inconsistent_calls(bad, match):
    with pytest.raises(ValueError, match=match):
        trace_of(*bad)


def test_replay_trace_checks_its_buffers():
    with pytest.raises(ValueError, match="same length"):
        _C.ReplayTrace(b"\x01", array("I", [0, 1]), array("Q", [1]), array("Q", [0]))
    with pytest.raises(ValueError, match="expected integers"):
        _C.ReplayTrace(b"\x01", array("I", [0]), array("d", [1.0]), array("Q", [0]))
    with pytest.raises(ValueError, match="negative"):
        _C.ReplayTrace(b"\x01", array("i", [-1]), array("Q", [1]), array("Q", [0]))
    with pytest.raises(ValueError, match="below the number of ops"):
        _C.ReplayTrace(b"\x01", array("I", [2**32 - 1]), array("Q", [1]), array("Q", [0]))


def test_ids_are_slots_and_free_sizes_come_from_the_alloc():
    t = trace_of((1, 0, 1000, 0), (2, 0, 0, 0), (1, 0, 3000, 0), (2, 0, 0, 0))
    assert (len(t), t.allocs, t.slots) == (4, 2, 1)
    r = _C.Replayer(_C.Allocator("virtual", "", 0), t)
    assert r.run(3)
    assert (r.live_bytes, r.peak_live_bytes, r.position) == (3000, 3000, 3)
    assert r.run() and r.live_bytes == 0 and (r.mallocs, r.frees) == (2, 2)


def test_an_allocation_that_does_not_fit_is_skipped_with_its_free():
    t = trace_of((1, 0, 30 * MiB, 0), (1, 1, 30 * MiB, 0), (2, 1, 0, 0), (2, 0, 0, 0))
    r = _C.Replayer(_C.Allocator("virtual", "", 40 * MiB), t)
    assert r.run()
    assert (r.ooms, r.first_oom_op, r.skipped_frees, r.frees) == (1, 1, 1, 1)
    stop = _C.Replayer(_C.Allocator("virtual", "", 40 * MiB), t, stop_on_oom=True)
    assert not stop.run()
    assert stop.position == 1 and not stop.run()


def test_the_timeline_samples_the_whole_trace():
    t = trace_of(*[(1, i, MiB, 0) for i in range(100)], *[(2, i, 0, 0) for i in range(100)])
    r = _C.Replayer(_C.Allocator("virtual", "", 0), t, timeline_points=20)
    r.run()
    points = r.timeline()
    assert len(points) == 20 and points[-1][0] == 199
    assert max(p[1] for p in points) == 100 * MiB == r.peak_live_bytes
    assert points[-1][3] == 0  # nothing allocated at the end; reserved stays cached
    assert points[-1][2] >= 100 * MiB


def test_invariants_hold_after_every_op_of_a_bundled_trace():
    p = plan_trace(read_trace(BUNDLED / "encoder-dynbatch-infer.pickle.gz"))
    calls = _C.ReplayTrace(p.kinds, p.ids, p.sizes, p.streams)
    a = _C.Allocator("virtual", "", 0)
    r = _C.Replayer(a, calls)
    for stop in range(1, min(len(p), 1500) + 1):
        r.run(stop)
        a.check_invariants()


# -- replay() and the budget -------------------------------------------------


def test_min_budget_fits_and_a_budget_below_peak_live_does_not():
    path = BUNDLED / "encoder-dynbatch-infer.pickle.gz"
    r = replay(path)
    assert r.peak_live_bytes < r.pyalloc_min_budget_bytes <= r.pyalloc_peak_reserved_bytes
    assert r.search_replays > 0
    p = plan_trace(read_trace(path))
    assert fits(_C.ReplayTrace(p.kinds, p.ids, p.sizes, p.streams), "", r.pyalloc_min_budget_bytes)
    assert replay(path, budget=r.pyalloc_min_budget_bytes, search=False).budget_ooms == 0
    tight = replay(path, budget=r.peak_live_bytes // 2, search=False)
    assert tight.budget_ooms > 0
    assert tight.budget_peak_reserved_bytes <= r.peak_live_bytes // 2


def test_a_budget_below_pool_size_refuses_everything():
    r = replay(snap(life(1, 100) + life(2, 100)), config="pool_size:64MiB", budget="32MiB")
    assert r.budget_ooms == 2


def test_config_changes_the_replay_and_bad_config_is_a_value_error():
    path = BUNDLED / "tiny-gpt-varlen-train.pickle.gz"
    bestfit = replay(path, config="strategy:bestfit,segment_size:64MiB", search=False)
    vmm = replay(path, config="strategy:vmm", search=False)
    assert vmm.pyalloc_peak_reserved_bytes < bestfit.pyalloc_peak_reserved_bytes
    assert bestfit.config == "strategy:bestfit,segment_size:64MiB"
    with pytest.raises(ValueError, match="bogus"):
        replay(path, config="bogus:1")
    with pytest.raises(ValueError, match="budget"):
        replay(path, budget="lots")
    with pytest.raises(ValueError, match="at least 1 byte"):
        replay(path, budget=0)


def test_fragmentation_is_taken_at_peak_live():
    r = replay(BUNDLED / "convnet-mixedres-train.pickle.gz", search=False)
    f = r.fragmentation_at_peak
    assert f["live_bytes"] == r.peak_live_bytes
    assert f["allocated_bytes"] >= f["live_bytes"]
    assert f["reserved_bytes"] == f["allocated_bytes"] + f["free_bytes"]
    assert 0 <= f["external_fragmentation"] <= 1
    assert 0 < f["event"] < r.events


def test_result_dict_has_the_documented_keys():
    d = replay(snap(life(1, 100))).to_dict()
    for key in ("trace", "events", "allocs", "peak_live_bytes", "recorded_peak_reserved_bytes"):
        assert key in d
    # The figures of each allocator, at equal budgets and uncapped.
    for allocator in ("pyalloc", "native", "native_expandable"):
        for figure in ("peak_reserved_bytes", "min_budget_bytes", "second_half_device_calls", "driver_calls"):
            assert f"{allocator}_{figure}" in d
        assert d[f"{allocator}_min_budget_bytes"] >= d["peak_live_bytes"] == 100
    assert "timeline" not in d
    json.dumps(d)


def repeating(passes, sizes=(2 * MiB, 3 * MiB, 7 * MiB // 2)):
    """The loop of tests/core/test_steady_state.py, `passes` times, as a trace."""
    p, q, s = sizes
    events = []
    for _ in range(passes):
        events += [ev("alloc", 0x1000, p), ev("alloc", 0x2000, q), ev("free_requested", 0x1000, p),
                   ev("free_completed", 0x1000, p), ev("alloc", 0x3000, s),
                   ev("free_requested", 0x2000, q), ev("free_completed", 0x2000, q),
                   ev("free_requested", 0x3000, s), ev("free_completed", 0x3000, s)]
    return snap(events)


@pytest.mark.parametrize("strategy", ["bestfit", "vmm"])
def test_device_calls_of_the_second_half_are_counted(strategy):
    r = replay(repeating(10), f"strategy:{strategy}", search=False)
    assert r.device_allocs >= 1 and r.pyalloc_second_half_device_calls == 0
    # A trace whose second half grows the pool: its calls are counted there.
    growing = snap(life(0x1000, MiB) + life(0x1000, MiB) + [ev("alloc", 0x2000, 64 * MiB)]
                   + life(0x3000, 128 * MiB))
    r = replay(growing, f"strategy:{strategy}", search=False)
    assert r.pyalloc_second_half_device_calls >= 1
    assert r.device_allocs + r.device_frees >= r.pyalloc_second_half_device_calls
    assert r.to_dict()["pyalloc_second_half_device_calls"] == r.pyalloc_second_half_device_calls


def test_empty_trace():
    # No event: no history to replay, and no verdict (tests/replay/test_snapshot_history.py).
    from pyalloc.replay import NoHistoryError

    with pytest.raises(NoHistoryError, match="holds no history"):
        replay(snap([]))


# -- frees waiting on record_stream -----------------------------------------


def record_stream_run(passes=3, size=39 * MiB):
    """A 1 MiB block live throughout (a 2 MiB small-pool segment), then `passes` buffers
    of `size` bytes, each used on a second stream (record_stream) and freed while that
    stream still uses it: its free completes only after the next buffer is allocated."""
    events = [ev("alloc", 0x100, MiB)]
    for i in range(passes):
        addr = 0x10000000 * (i + 1)
        events += [ev("alloc", addr, size), ev("free_requested", addr, size)]
        if i:
            events.append(ev("free_completed", addr - 0x10000000, size))
    events.append(ev("free_completed", 0x10000000 * passes, size))
    return snap(events)


def test_a_free_waiting_on_another_stream_is_a_pending_op_then_its_completion():
    p = plan_of(snap([ev("alloc", 1, 100), ev("free_requested", 1, 100), ev("alloc", 2, 50),
                      ev("free_completed", 1, 100), ev("free_requested", 2, 50),
                      ev("free_completed", 2, 50)]))
    # Block 1 is freed at its completion; its request is kept as a pending op (an
    # out-of-memory path may free it early). Block 2's completion follows its request
    # at once: a plain free, no pending op.
    assert [(o[0], o[4]) for o in ops(p)] == [("alloc", 0), ("pending", 1), ("alloc", 2), ("free", 3),
                                            ("free", 5)]
    assert p.peak_live_bytes == 150
    assert p.peak_live_without_pending_bytes == 100


def test_pytorch_waits_for_record_stream_frees_on_its_out_of_memory_path():
    # PyTorch under a cap: the next buffer's cudaMalloc fails, release_cached_blocks
    # first waits for the streams (synchronize_and_free_events), which frees the
    # buffer still in use on the other stream, then releases its segment: one buffer's
    # 40 MiB segment plus the 2 MiB small segment (42 MiB) serve the run. Freeing
    # only at the recorded completions would need two buffers at once (82 MiB).
    r = replay(record_stream_run())
    assert r.peak_live_bytes == 79 * MiB  # live until the completions, as recorded
    assert r.native_peak_reserved_bytes == 82 * MiB  # uncapped: nothing waits early
    assert r.native_min_budget_bytes <= 42 * MiB * 1.005
    assert r.native_expandable_min_budget_bytes <= 42 * MiB * 1.005
    # pyalloc's own out-of-memory path waits for its pending frees too.
    assert 40 * MiB <= r.pyalloc_min_budget_bytes <= 44 * MiB
    assert r.native_min_budget_bytes >= 40 * MiB and r.native_expandable_min_budget_bytes >= 40 * MiB


def test_record_stream_frees_made_early_are_not_made_again():
    p = plan_of(record_stream_run())
    calls = _C.ReplayTrace(p.kinds, p.ids, p.sizes, p.streams)
    for expandable in (False, True):
        run = _C.run_torch_model(calls, expandable=expandable, capacity=42 * MiB)
        assert (run["completed"], run["retries"], run["early_frees"]) == (True, 2, 2), expandable
        assert _C.run_torch_model(calls, expandable=expandable)["early_frees"] == 0
    a = _C.Allocator("virtual", "", 42 * MiB)
    r = _C.Replayer(a, calls)
    assert r.run()
    # Each buffer freed once (two of them early, by the out-of-memory path), the small
    # block never: nothing skipped, nothing live but the small block at the end.
    assert (r.ooms, r.frees, r.early_frees, r.skipped_frees, r.live_bytes) == (0, 3, 2, 0, MiB)
    assert a.stats()["allocated_bytes.all.current"] <= 2 * MiB
    a.check_invariants()
    # Unbounded, the pending ops do nothing: the frees come at the completions.
    wide = _C.Replayer(_C.Allocator("virtual", "", 0), calls)
    wide.run()
    assert (wide.frees, wide.peak_live_bytes) == (3, 79 * MiB)


def test_an_id_freed_and_allocated_again_is_not_freed_early():
    # Id 0's free was requested, then made; the id is allocated again and never
    # requested: the failing allocation of id 1 may not take it.
    t = trace_of((1, 0, 30 * MiB, 0), (3, 0, 0, 0), (2, 0, 0, 0), (1, 0, 30 * MiB, 0),
                 (1, 1, 30 * MiB, 0), (2, 1, 0, 0), (3, 0, 0, 0), (1, 2, 30 * MiB, 0))
    r = _C.Replayer(_C.Allocator("virtual", "", 40 * MiB), t)
    assert r.run()
    # Id 1 is refused; id 2 gets the room of id 0, whose free was requested again.
    assert (r.ooms, r.first_oom_op, r.early_frees, r.skipped_frees) == (1, 4, 1, 1)
    for expandable in (False, True):
        run = _C.run_torch_model(t, expandable=expandable, capacity=40 * MiB)
        assert (run["ooms"], run["first_oom_op"], run["early_frees"]) == (1, 4, 1), expandable


def random_calls(seed, steps=3000, request_every=3):
    """A random trace over reused ids on three streams; every `request_every`-th free
    is requested first, its free coming a few calls later (or never)."""
    import random

    rng = random.Random(seed)
    ops_, live, requested, free_ids, next_id = [], [], [], [], 0
    for _ in range(steps):
        r = rng.random()
        if requested and r < 0.15:
            ops_.append((2, requested.pop(rng.randrange(len(requested))), 0, 0))
            free_ids.append(ops_[-1][1])
        elif live and r < 0.5:
            id_ = live.pop(rng.randrange(len(live)))
            if rng.randrange(request_every) == 0:
                ops_.append((3, id_, 0, 0))
                requested.append(id_)
            else:
                ops_.append((2, id_, 0, 0))
                free_ids.append(id_)
        else:
            id_ = free_ids.pop() if free_ids and rng.random() < 0.5 else next_id
            next_id += id_ == next_id
            size = rng.randrange(48 * MiB) if rng.random() < 0.25 else rng.randrange(2 * MiB)
            ops_.append((1, id_, size, rng.randrange(3)))
            live.append(id_)
    return ops_


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traces_with_requested_frees(seed):
    calls = random_calls(seed)
    with_requests = trace_of(*calls)
    without = trace_of(*[c for c in calls if c[0] != 3])
    for expandable in (False, True):
        # Unbounded, a free request does nothing: the same run as without it (but for
        # where the second half starts, which the extra calls move).
        a, b = (_C.run_torch_model(t, expandable=expandable) for t in (with_requests, without))
        assert a["early_frees"] == 0
        moved = ("seconds", "second_half_device_calls")
        assert {k: v for k, v in a.items() if k not in moved} == {k: v for k, v in b.items() if k not in moved}
        for capacity in (64 * MiB, 160 * MiB):
            r = _C.run_torch_model(with_requests, expandable=expandable, capacity=capacity)
            assert r["peak_reserved_bytes"] <= capacity
            assert r["early_frees"] <= sum(1 for c in calls if c[0] == 3)
    wide = [_C.Replayer(_C.Allocator("virtual", "", 0), t) for t in (with_requests, without)]
    for r in wide:
        r.run()
    assert [(r.frees, r.peak_live_bytes, r.early_frees) for r in wide] == [
        (wide[1].frees, wide[1].peak_live_bytes, 0)] * 2
    a = _C.Allocator("virtual", "", 96 * MiB)
    r = _C.Replayer(a, with_requests)
    for stop in range(0, len(calls) + 1, 50):
        r.run(stop)
        a.check_invariants()
    r.run()
    a.check_invariants()
    assert r.early_frees > 0 and r.ooms > 0  # the capacity is tight enough to need both
    held = a.stats()["allocated_bytes.all.current"]
    assert r.live_bytes >= 0 and (r.live_bytes == 0) == (held == 0)


def test_a_free_pending_at_the_end_is_freed_by_the_out_of_memory_path():
    # The trace ends before the last buffer's free completes: it stays live unbounded,
    # and an allocation that needs its room gets it once the stream is waited for.
    events = [ev("alloc", 1, 30 * MiB), ev("free_requested", 1, 30 * MiB), ev("alloc", 2, 30 * MiB),
              ev("free_requested", 2, 30 * MiB), ev("free_completed", 2, 30 * MiB)]
    p = plan_of(snap(events))
    assert p.pending_at_end == 1
    calls = _C.ReplayTrace(p.kinds, p.ids, p.sizes, p.streams)
    assert run_allocator(calls, "native", capacity=40 * MiB).completed
    assert run_allocator(calls, "native").peak_reserved_bytes == 60 * MiB


# -- known totals ------------------------------------------------------------


BUNDLED_ROWS = readme_table(BUNDLED / "README.md")


def test_every_bundled_trace_is_in_the_table():
    assert sorted(r["file"] for r in BUNDLED_ROWS) == sorted(p.name for p in BUNDLED.glob("*.pickle.gz"))


@pytest.mark.parametrize("row", BUNDLED_ROWS, ids=lambda r: r["file"])
def test_bundled_trace_known_totals(row):
    path = BUNDLED / row["file"]
    assert path.stat().st_size < 1 << 20
    r = replay(path)
    assert (r.events, r.allocs, r.frees) == (int(row["events"]), int(row["allocs"]), int(row["frees"]))
    assert r.peak_live_bytes == int(row["peak live bytes"])
    assert (r.missed_frees, r.stray_frees, r.frees_at_request) == (0, 0, 0)
    assert r.recorded_peak_reserved_bytes is None
    assert r.peak_live_bytes <= r.pyalloc_min_budget_bytes <= r.pyalloc_peak_reserved_bytes


@pytest.mark.shared
@pytest.mark.parametrize("row", readme_table(SHARED / "README.md") if (SHARED / "README.md").exists() else [],
                         ids=lambda r: r["file"])
def test_shared_trace_totals(row):
    r = replay(SHARED / row["file"], search=False)
    assert (r.events, r.allocs) == (int(row["events"]), int(row["allocs"]))
    assert round(r.peak_live_bytes / MiB) == int(row["peak live MiB"])
    native = row["native peak reserved MiB"]
    if native == "-":
        assert r.recorded_peak_reserved_bytes is None
    else:
        assert round(r.recorded_peak_reserved_bytes / MiB) == int(native.split()[0])


# -- the command line --------------------------------------------------------


def cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pyalloc", "replay", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_cli_prints_a_table_and_writes_json_and_a_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    files = sorted(BUNDLED.glob("*.pickle.gz"))
    p = cli(*files, "--json", out, "--plot", png)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert lines[0].split() == ["budget", "reserved", "(no", "cap)", "driver", "calls"]
    assert lines[1].split() == ["trace", "dev", "peak", "live"] + ["p", "n", "e"] * 3
    rows = lines[3:3 + len(files)]
    assert [row.split()[0] for row in rows] == [f.name.removesuffix(".pickle.gz") for f in files]
    assert lines[3 + len(files)] == ""
    text = " ".join(p.stdout.split())
    # One legend explains the columns, then sentences say where pyalloc wins, ties and loses.
    assert "p: pyalloc; n: PyTorch's caching allocator" in text and "Lower is better in every column" in text
    assert "Budget: against PyTorch's allocator, pyalloc" in text
    assert "Where pyalloc loses: " in text or "pyalloc loses nowhere" in text
    data = json.loads(out.read_text())
    assert [Path(d["trace"]).name for d in data] == [f.name for f in files]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_budget_adds_the_three_allocators_on_that_device(tmp_path):
    p = cli(BUNDLED / "encoder-dynbatch-infer.pickle.gz", "--budget", "16MiB", "--no-search")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines)
    at = lines.index("On a device of 16.00 MiB:")
    top, header, _, row = lines[at + 1:at + 5]
    assert top.split() == ["reserved", "OOMs", "driver", "calls"]
    assert header.split() == ["trace", "dev", "peak", "live"] + ["p", "n", "e"] * 3
    cells = row.split()[-9:]
    reserved, ooms, driver_calls = cells[:3], cells[3:6], cells[6:]
    assert "On a device of the --budget size" in " ".join(p.stdout.split())  # the legend says so
    assert all(int(n) > 0 for n in ooms)  # 58 MiB of peak live on 16 MiB: every allocator refuses some
    # Each bounded run's peak reserved stays within the budget (ratios to the 57.94 MiB of peak live).
    assert all(float(x) * 57.94 <= 16.01 for x in reserved)
    assert all(int(n) > 0 for n in driver_calls)


def test_cli_bad_files_give_one_line_each_and_fail(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pickle"
    # GLOBAL os.system, then REDUCE with one argument: would run the command.
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    garbage = tmp_path / "g.pickle.gz"
    garbage.write_bytes(b"\x1f\x8bnot really gzip")
    good = BUNDLED / "encoder-dynbatch-infer.pickle.gz"
    p = cli(evil, garbage, good, tmp_path / "missing.pickle", "--no-search")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    errors = p.stderr.strip().splitlines()
    assert len(errors) == 3
    for line, path in zip(errors, [evil, garbage, tmp_path / "missing.pickle"]):
        assert line.startswith(f"pyalloc replay: error: {path}: ")
    assert not marker.exists()
    assert "encoder-dynbatch-infer" in p.stdout  # the good file is still reported


def test_cli_bad_options_exit_2():
    good = BUNDLED / "encoder-dynbatch-infer.pickle.gz"
    p = cli(good, "--config", "nonsense:1")
    assert p.returncode == 2 and "nonsense" in p.stderr and "Traceback" not in p.stderr
    p = cli(good, "--budget", "a lot")
    assert p.returncode == 2 and "--budget" in p.stderr


def test_cli_needs_a_file():
    p = cli()
    assert p.returncode == 2 and "FILE" in p.stderr


def test_plot_draws_native_where_known(tmp_path):
    pytest.importorskip("matplotlib")
    from pyalloc.replay.report import plot_results

    segments = [segment(1, 40 * MiB, [])]
    events = [ev("segment_alloc", 1, 20 * MiB)] + life(1, 5 * MiB) + life(2, 3 * MiB)
    results = [replay(snap(events, segments), name="gpu"), replay(snap(life(1, 100)), name="cpu")]
    png = tmp_path / "p.png"
    plot_results(results, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_progress_bars_can_be_forced_on(capsys):
    r = replay(BUNDLED / "encoder-dynbatch-infer.pickle.gz", progress=True)
    assert r.search_replays > 0
    assert "budget search" in capsys.readouterr().err


def test_table_formats(tmp_path):
    from pyalloc.replay.report import COLUMNS, format_table

    results = [replay(snap(life(1, 100)), name="a/b.pickle", budget="1GiB", search=False)]
    text = format_table(results).splitlines()
    assert text[0].lstrip().startswith("budget")  # the allocators' headings lead
    assert text[1].split()[:4] == ["trace", "dev", "peak", "live"]
    assert text[3].startswith("b ")  # the file name, without folder or extension
    runs = results[0].budget_runs
    assert text[text.index("On a device of 1.00 GiB:") + 4].split()[-6:] == (
        ["0", "0", "0"] + [str(runs[a]["driver_calls"]) for a in ("pyalloc", "native", "native_expandable")])
    md = format_table(results, markdown=True).splitlines()
    assert md[0] == "| " + " | ".join(COLUMNS + [f"{c} at 1.00 GiB (p/n/e)" for c in ("reserved", "OOMs", "driver calls")]) + " |"
    assert md[2].endswith(f"| {runs['pyalloc']['driver_calls']}/{runs['native']['driver_calls']}/"
                          f"{runs['native_expandable']['driver_calls']} |")
    assert md[2].split(" | ")[-2] == "0/0/0"  # the OOMs at 1 GiB: nobody refuses 100 B
    assert md[2].startswith("| b.pickle | 0 | 100 B |")


def test_the_smallest_budget_is_one_every_larger_device_checked_completes_from(monkeypatch):
    """An allocator that completes on a device and fails on one slightly larger:
    the budget reported is above the failures, and every device checked above
    it completes."""
    import pyalloc.replay.allocators as allocators_mod

    def fits(calls, conf, capacity, allocator="pyalloc", page_size=None, settings=None):
        return capacity >= 100_000 and not 100_150 <= capacity <= 100_400

    monkeypatch.setattr(allocators_mod, "fits", fits)
    budget, replays = allocators_mod.min_budget(None, "", 90_000, 200_000)
    assert budget > 100_400 and replays > 0
    assert budget <= 100_400 * (1 + allocators_mod.BUDGET_CHECKS_ABOVE[0]) + 200_000 * allocators_mod.BUDGET_PRECISION
    for above in allocators_mod.BUDGET_CHECKS_ABOVE:
        assert fits(None, "", int(budget * (1 + above)))
    # A monotonic allocator: the bisection's answer, within its precision.
    monkeypatch.setattr(allocators_mod, "fits",
                        lambda calls, conf, capacity, allocator="pyalloc", page_size=None, settings=None:
                        capacity >= 100_000)
    budget, _ = allocators_mod.min_budget(None, "", 90_000, 200_000)
    assert 100_000 <= budget <= 100_000 * (1 + allocators_mod.BUDGET_PRECISION)


def test_the_replay_page_shows_replay_from_python_and_its_example_runs(monkeypatch, capsys):
    """The replay's page (docs/replay.md) shows the Python entry (pyalloc.replay.replay),
    not only the command line and the internal run_allocator, and its example runs as
    written from the repository's root."""
    text = (ROOT / "docs" / "replay.md").read_text()
    section = text.split("## Would pyalloc have saved my run?")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and "from pyalloc.replay import replay" in blocks[0], "no Python example of replay()"
    monkeypatch.chdir(ROOT)
    exec(compile(blocks[0], "docs/replay.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("peak live 137 MiB; peak reserved: pyalloc "), out
    for name in ("pyalloc", "native", "native_expandable"):
        assert f"on 160 MiB, {name} refused " in out, out


def test_a_snapshot_pyalloc_recorded_replays_pyalloc_with_the_policy_it_ran():
    """A snapshot of pyalloc's pools (pyalloc.snapshot(): allocator_settings name the
    backend and its settings) is replayed through the pyalloc that ran: its verdict
    on an out-of-memory error speaks of that policy, not of the default one. A
    configuration given wins; the pool's size and cap are the replay device's."""
    MiB = 1 << 20
    events = [{"action": "alloc", "addr": 0x10000000 + i * 4 * MiB, "size": 3 * MiB, "stream": 0,
               "time_us": i, "frames": []} for i in range(4)]
    settings = {"backend": "pyalloc", "strategy": "bestfit", "pool_size": 0, "max_pool_size": 64 * MiB,
                "segment_size": 20 * MiB, "small_size": 256 << 10, "small_chunk_size": 512 << 10,
                "max_split_size": 0}
    snapshot = {"segments": [], "device_traces": [events], "allocator_settings": settings}
    assert replay(snapshot, search=False).config == "strategy:bestfit"
    assert replay(snapshot, "strategy:vmm", search=False).config == "strategy:vmm"
    settings["segment_size"] = 64 * MiB
    assert replay(snapshot, search=False).config == f"strategy:bestfit,segment_size:{64 * MiB}"
    settings["strategy"] = "no-such-strategy"  # another pyalloc's: the default policy
    assert replay(snapshot, search=False).config == ""
    snapshot["allocator_settings"] = {"expandable_segments": False}  # PyTorch's
    assert replay(snapshot, search=False).config == ""
