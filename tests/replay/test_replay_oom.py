"""Replay of recorded out-of-memory errors (fragmentation or not, who would have
served the request), every device of a snapshot a row, and the peak live of the
snapshots users hand in (Windows, a wrapped ring buffer, several devices),
checked against figures computed here, independently of pyalloc.replay."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pyalloc._C import format_bytes
from pyalloc.replay import NoHistoryError, replay, replay_devices
from pyalloc.replay.allocators import ALLOCATORS, AllocatorRun, run_allocator
from pyalloc.replay.oom import MAX_OOM_REPLAYS
from pyalloc.replay.report import oom_sentence
from pyalloc.replay.snapshot_io import load_snapshot
from shared_dir import SHARED_DIR

ROOT = Path(__file__).resolve().parents[2]
GPU = SHARED_DIR / "traces" / "gpu"
CONSTRUCTOR_SUN = GPU / "constructor-sun-code_location-qwen3emb-gnn-3gpu-expandable-oom.pickle"
WINDOWS = GPU / "zidongliu-decomfl-opt125m-zo-fedlearn-windows.pickle"
WRAPPED = GPU / "wedsonlin-cs336-a2-medium-ctx1024-trainstep-bf16.pickle"
MiB, GiB = 1 << 20, 1 << 30

needs_gpu_traces = pytest.mark.shared


def _model_missing(name):
    from array import array

    from pyalloc import _C

    calls = _C.ReplayTrace(array("B", [1, 2]), array("I", [0, 0]), array("Q", [512, 0]), array("Q", [0, 0]))
    try:
        run_allocator(calls, name)
    except NotImplementedError:
        return True
    return False


NATIVES_MISSING = any(_model_missing(a) for a in ("native", "native_expandable"))
needs_native_models = pytest.mark.skipif(NATIVES_MISSING, reason="no model of PyTorch's allocator in this build")


def ev(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0, "frames": []}


def oom_event(size, device_free, stream=0):
    return {"action": "oom", "size": size, "device_free": device_free, "stream": stream, "time_us": 0,
            "frames": []}


def free(addr, size):
    return [ev("free_requested", addr, size), ev("free_completed", addr, size)]


def cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pyalloc", "replay", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def oom_sentences(stdout):
    """The CLI's sentences on recorded OOMs, each joined again from the lines of at most
    100 columns it is wrapped to (its later lines indented by two)."""
    sentences = []
    for line in stdout.splitlines():
        assert len(line) <= 100, line
        if ", event " in line:
            sentences.append(line)
        elif sentences and line.startswith("  ") and sentences[-1] is not None:
            sentences[-1] += " " + line.strip()
        elif sentences:
            sentences.append(None)
    return [s for s in sentences if s is not None]


# -- figures computed independently of pyalloc.replay --------------------------


def backward_live(snapshot, device):
    """(peak live, live at the start) of one device, walking its trace backwards
    from the live blocks of the final segments, as PyTorch's memory viewer undoes
    history: undoing an alloc takes its bytes away, undoing a free gives them back."""
    live = sum(b.get("requested_size", b["size"])
               for seg in snapshot["segments"] if seg.get("device", 0) == device
               for b in seg["blocks"] if b["state"] in ("active_allocated", "active_pending_free"))
    trace = snapshot["device_traces"][device]
    freed_at = "free_completed" if any(e["action"] == "free_completed" for e in trace) else "free_requested"
    peak = live
    for e in reversed(trace):
        if e["action"] == "alloc":
            live -= e["size"]
        elif e["action"] == freed_at:
            live += e["size"]
        peak = max(peak, live)
    return peak, live


def backward_reserved(snapshot, device, event):
    """The recording allocator's reserved bytes just before trace event `event`:
    the final segments' total, with the segment events from `event` on undone."""
    reserved = sum(seg["total_size"] for seg in snapshot["segments"] if seg.get("device", 0) == device)
    for e in snapshot["device_traces"][device][event:]:
        if e["action"] in ("segment_alloc", "segment_map"):
            reserved -= e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            reserved += e["size"]
    return reserved


# -- snapshots built for the diagnosis ---------------------------------------


BASE = 0x7F0000000000


def fragmented(oom_after_frees=True, request=30 * MiB, device_free=10 * MiB):
    """What the recording (non-expandable) allocator leaves after 50 allocations of
    2 MiB in five 20 MiB segments, every other one freed: 50 MiB live, 50 MiB free
    in 2 MiB holes, none of which holds a 30 MiB request. With 10 MiB free on the
    device it fails, though 50 + 30 MiB fit the 110 MiB the run had."""
    events, segments, seg = [], [], 20 * MiB
    for s in range(5):
        events.append(ev("segment_alloc", BASE + s * seg, seg))
        events += [ev("alloc", BASE + s * seg + b * 2 * MiB, 2 * MiB) for b in range(10)]
    frees = [e for s in range(5) for b in range(0, 10, 2) for e in free(BASE + s * seg + b * 2 * MiB, 2 * MiB)]
    at = oom_event(request, device_free)
    events += frees + [at] if oom_after_frees else [at] + frees
    for s in range(5):
        blocks = [{"address": BASE + s * seg + b * 2 * MiB, "size": 2 * MiB, "requested_size": 2 * MiB,
                   "state": "active_allocated" if b % 2 else "inactive", "frames": []} for b in range(10)]
        segments.append({"device": 0, "address": BASE + s * seg, "total_size": seg, "stream": 0,
                         "segment_type": "large", "blocks": blocks})
    return {"segments": segments, "device_traces": [events]}


def expandable_recorded():
    """Recorded with expandable segments (20 MiB pages for the large pool): six
    30 MiB blocks over nine pages, every other one freed. The free blocks hold
    only three whole pages, which the out-of-memory path unmaps (120 MiB still
    mapped); a 70 MiB request needs four more pages at the tail, with 70 MiB
    free: it fails, though 90 MiB live + 70 MiB fit the 190 MiB the run had."""
    events = [ev("segment_map", BASE + p * 20 * MiB, 20 * MiB) for p in range(9)]
    events += [ev("alloc", BASE + b * 30 * MiB, 30 * MiB) for b in range(6)]
    events += [e for b in (0, 2, 4) for e in free(BASE + b * 30 * MiB, 30 * MiB)]
    events += [ev("segment_unmap", BASE + p * 20 * MiB, 20 * MiB) for p in (0, 3, 6)]
    events.append(oom_event(70 * MiB, 70 * MiB))
    segments = [{"device": 0, "address": BASE + start * MiB, "total_size": 40 * MiB, "stream": 0,
                 "segment_type": "large", "is_expandable": True,
                 "blocks": [{"address": BASE + start * MiB, "size": 10 * MiB, "requested_size": 10 * MiB,
                             "state": "inactive"},
                            {"address": BASE + (start + 10) * MiB, "size": 30 * MiB, "requested_size": 30 * MiB,
                             "state": "active_allocated"}]}
                for start in (20, 80, 140)]
    return {"segments": segments, "device_traces": [events]}


def with_oom(oom, segments=True):
    """A 4 MiB block live in a 20 MiB segment, then `oom` (an event dict), then its free."""
    events = [ev("segment_alloc", BASE, 20 * MiB), ev("alloc", BASE, 4 * MiB), oom] + free(BASE, 4 * MiB)
    segs = [{"device": 0, "address": BASE, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
             "blocks": [{"address": BASE, "size": 20 * MiB, "state": "inactive"}]}] if segments else []
    if not segments:
        events = events[1:]
    return {"segments": segs, "device_traces": [events]}


# -- the verdict ---------------------------------------------------------------


@needs_gpu_traces
def test_constructor_sun_device_1_is_not_fragmentation_and_pyalloc_does_not_serve_it():
    snapshot = load_snapshot(CONSTRUCTOR_SUN)
    trace = snapshot["device_traces"][1]
    [event] = [i for i, e in enumerate(trace) if e["action"] == "oom"]
    r = replay(snapshot, device=1, search=False)
    [oom] = r.recorded_ooms
    live = sum(e["size"] for e in trace[:event] if e["action"] == "alloc") - \
        sum(e["size"] for e in trace[:event] if e["action"] == "free_completed")  # nothing live before
    assert backward_live(snapshot, 1)[1] == 0
    reserved, free = backward_reserved(snapshot, 1, event), trace[event]["device_free"]
    capacity = reserved + free
    assert oom == {"event": event, "size_bytes": trace[event]["size"], "live_bytes": live,
                   "capacity_bytes": capacity, "fragmentation": False, "served_by": oom["served_by"],
                   "memory_fraction": None, "device_total_bytes": None, "device_total_assumed": False,
                   "reserved_bytes": reserved, "device_free_bytes": free, "cap_inferred": False,
                   "cap_below_bytes": None, "cap_recorded_bytes": None, "unused_bytes": reserved - live, "largest_free_block_bytes": None,
                   "min_capacity_bytes": oom["min_capacity_bytes"]}
    # Its blocks were freed after the error (the run went on): the final segments' largest
    # free block is not the one it met.
    assert any(e["action"] == "free_completed" for e in trace[event:])
    # pyalloc needs more than the device had (it did not serve it), at least what was live at once.
    assert capacity < oom["min_capacity_bytes"]["pyalloc"]
    assert oom["min_capacity_bytes"]["pyalloc"] >= live + oom["size_bytes"]
    assert (round(live / GiB, 1), round(capacity / GiB, 1)) == (78.3, 78.5)
    short = live + oom["size_bytes"] - capacity
    assert round(short / GiB, 1) == 4.7
    assert oom["served_by"]["pyalloc"] is False
    sentence = oom_sentence(oom)
    assert sentence.endswith("reduce memory")
    assert f"not fragmentation: {format_bytes(live + oom['size_bytes'])} needed on {format_bytes(capacity)}" in sentence
    assert f"({format_bytes(short)} short)" in sentence
    assert "pyalloc would not" in sentence or "none of pyalloc" in sentence


@needs_gpu_traces
@needs_native_models
def test_constructor_sun_device_1_no_model_of_pytorch_serves_it_either():
    [oom] = replay(CONSTRUCTOR_SUN, device=1, search=False).recorded_ooms
    assert oom["served_by"] == {"pyalloc": False, "native": False, "native_expandable": False}
    short = {a: format_bytes(n - oom["capacity_bytes"]) for a, n in oom["min_capacity_bytes"].items()}
    assert (f"none of pyalloc ({short['pyalloc']} short), PyTorch ({short['native']} short), PyTorch with "
            f"expandable segments ({short['native_expandable']} short) would have served it") in oom_sentence(oom)


def test_fragmentation_that_pyalloc_would_have_served():
    r = replay(fragmented(), search=False)
    assert r.recorded_peak_reserved_bytes == 100 * MiB
    [oom] = r.recorded_ooms
    assert oom["event"] == len(fragmented()["device_traces"][0]) - 1
    assert (oom["size_bytes"], oom["live_bytes"], oom["capacity_bytes"]) == (30 * MiB, 50 * MiB, 110 * MiB)
    assert oom["fragmentation"] is True
    assert oom["served_by"]["pyalloc"] is True
    sentence = oom_sentence(oom)
    assert "fragmentation: 80.00 MiB needed on 110.00 MiB; 100.00 MiB reserved" in sentence
    assert f"; pyalloc ({format_bytes(110 * MiB - oom['min_capacity_bytes']['pyalloc'])} to spare) would have " \
        "served it" in sentence
    assert "not fragmentation" not in sentence and "reduce memory" not in sentence
    # The answer comes from a replay, not from the verdict: pyalloc's bestfit
    # strategy, which cannot remap pages, leaves the same holes and fails.
    [oom] = replay(fragmented(), "strategy:bestfit", search=False).recorded_ooms
    assert (oom["fragmentation"], oom["served_by"]["pyalloc"]) == (True, False)


@needs_native_models
def test_fragmentation_neither_pytorch_would_serve():
    # PyTorch puts the 2 MiB requests ten to a 20 MiB segment (or, expandable, a
    # 20 MiB page) and its out-of-memory path frees only wholly free segments
    # (pages): every one holds live blocks, so the 30 MiB request needs 30 MiB
    # (two pages: 40 MiB) more than the 100 MiB held, on a 110 MiB device.
    [oom] = replay(fragmented(), search=False).recorded_ooms
    assert oom["served_by"] == {"pyalloc": True, "native": False, "native_expandable": False}
    short = {a: format_bytes(oom["min_capacity_bytes"][a] - 110 * MiB) for a in ("native", "native_expandable")}
    assert oom_sentence(oom).endswith(
        f"would have served it, PyTorch ({short['native']} short) and PyTorch with expandable segments "
        f"({short['native_expandable']} short) would not")


def test_fragmentation_under_expandable_segments_that_pyalloc_would_have_served():
    r = replay(expandable_recorded(), search=False)
    assert r.recorded_peak_reserved_bytes == 180 * MiB
    [oom] = r.recorded_ooms
    assert (oom["size_bytes"], oom["live_bytes"], oom["capacity_bytes"]) == (70 * MiB, 90 * MiB, 190 * MiB)
    assert oom["fragmentation"] is True and oom["served_by"]["pyalloc"] is True


@needs_native_models
def test_fragmentation_under_expandable_segments_pytorch_by_default_would_have_served():
    # Without expandable segments each 30 MiB block is a segment of its own: the
    # out-of-memory path frees the three free ones (90 MiB held) and 70 MiB more
    # fit 190. With them, the recording allocator's own failure is reproduced.
    [oom] = replay(expandable_recorded(), search=False).recorded_ooms
    assert oom["served_by"] == {"pyalloc": True, "native": True, "native_expandable": False}
    need = oom["min_capacity_bytes"]
    spare = {a: format_bytes(190 * MiB - need[a]) for a in ("pyalloc", "native")}
    short = format_bytes(need["native_expandable"] - 190 * MiB)
    assert oom_sentence(oom).endswith(
        f"pyalloc ({spare['pyalloc']} to spare) and PyTorch ({spare['native']} to spare) would have served it, "
        f"PyTorch with expandable segments ({short} short) would not")
    # Two more 20 MiB pages than the 190 MiB: 200 MiB.
    assert within_precision(oom["min_capacity_bytes"]["native_expandable"], 200 * MiB)


def test_the_request_is_replayed_where_it_failed():
    # The same request before the frees: 100 MiB live, 130 MiB needed on 110.
    [oom] = replay(fragmented(oom_after_frees=False), search=False).recorded_ooms
    assert (oom["live_bytes"], oom["capacity_bytes"], oom["fragmentation"]) == (100 * MiB, 110 * MiB, False)
    assert oom["served_by"]["pyalloc"] is False
    assert "(20.00 MiB short)" in oom_sentence(oom)


def test_a_request_that_fits_only_without_the_cap_is_not_served():
    # 4 MiB live, a 17 MiB request, 1 MiB free beside the 20 MiB segment: it fits
    # 21 MiB; a 18 MiB one does not.
    [fits] = replay(with_oom(oom_event(17 * MiB, MiB)), search=False).recorded_ooms
    [short] = replay(with_oom(oom_event(18 * MiB, MiB)), search=False).recorded_ooms
    assert (fits["capacity_bytes"], fits["fragmentation"]) == (21 * MiB, True)
    assert (short["capacity_bytes"], short["fragmentation"]) == (21 * MiB, False)
    assert short["served_by"]["pyalloc"] is False


def test_the_sentence_does_not_call_the_recorded_size_the_request():
    """PyTorch's oom event records params.size(), the request rounded up to its
    block size, not the bytes requested: the sentence must not say "request"."""
    [oom] = replay(fragmented(), search=False).recorded_ooms
    sentence = oom_sentence(oom)
    assert sentence.startswith("a 30.00 MiB allocation with 50.00 MiB live: ")
    assert "request" not in sentence


def with_fraction(snapshot, settings):
    snapshot["allocator_settings"] = settings
    return snapshot


def test_a_recorded_memory_fraction_caps_the_capacity():
    """100 MiB reserved and 10 MiB free: 110 MiB without a cap. Under
    per_process_memory_fraction:0.95 in the recorded PYTORCH_CUDA_ALLOC_CONF, the
    device's memory unknown and taken as those 110 MiB, the cap is 104.5 MiB:
    80 MiB needed still fit, 30 MiB more reserved would not (so it is still
    fragmentation, on less memory)."""
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,per_process_memory_fraction:0.95",
                "expandable_segments": False}
    [oom] = replay(with_fraction(fragmented(), settings), search=False).recorded_ooms
    assert oom["memory_fraction"] == 0.95
    assert (oom["device_total_bytes"], oom["device_total_assumed"]) == (110 * MiB, True)
    assert oom["capacity_bytes"] == int(0.95 * 110 * MiB)
    assert oom["fragmentation"] is True
    sentence = oom_sentence(oom)
    assert (f"needed on {format_bytes(int(0.95 * 110 * MiB))} (memory fraction 0.95 of the device, whose "
            "memory the snapshot does not record: taken as 110.00 MiB, reserved plus free at the error)") \
        in sentence


def test_a_memory_fraction_below_what_was_live_makes_it_no_fragmentation():
    # 0.5 of an assumed 110 MiB is less than the 100 MiB the recording allocator
    # held under the cap: the cap is at least that. 80 MiB needed fit 100 MiB.
    [held] = replay(with_fraction(fragmented(), {"per_process_memory_fraction": 0.5}),
                    search=False).recorded_ooms
    assert (held["memory_fraction"], held["capacity_bytes"]) == (0.5, 100 * MiB)
    # Before the frees: 100 MiB live + 30 MiB, on a cap of 100 MiB: 30 MiB short.
    [short] = replay(with_fraction(fragmented(oom_after_frees=False), {"per_process_memory_fraction": 0.5}),
                     search=False).recorded_ooms
    assert (short["capacity_bytes"], short["fragmentation"]) == (100 * MiB, False)
    assert "(30.00 MiB short)" in oom_sentence(short)


def test_a_known_device_total_is_used_and_said():
    from pyalloc.replay import plan_trace
    from pyalloc.replay.oom import diagnose_ooms
    from pyalloc.replay.snapshot_io import read_trace

    trace = read_trace(with_fraction(fragmented(), {"per_process_memory_fraction": 0.52}))
    [oom] = diagnose_ooms(trace, plan_trace(trace), "", device_total=200 * MiB)
    assert (oom["device_total_bytes"], oom["device_total_assumed"]) == (200 * MiB, False)
    assert oom["capacity_bytes"] == int(0.52 * 200 * MiB)  # 104 MiB, below 110 reserved + free
    assert f"needed on 104.00 MiB (memory fraction 0.52 of 200.00 MiB)" in oom_sentence(oom)


def test_unreadable_memory_fractions_are_ignored():
    for settings in ({"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:lots"},
                     {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:1.0"},
                     {"per_process_memory_fraction": float("nan")}, {"per_process_memory_fraction": True},
                     {"per_process_memory_fraction": -0.5}, "not a dict", {"PYTORCH_CUDA_ALLOC_CONF": 7}):
        [oom] = replay(with_fraction(fragmented(), settings), search=False).recorded_ooms
        assert (oom["memory_fraction"], oom["capacity_bytes"]) == (None, 110 * MiB), settings


def test_unknown_models_are_none_and_left_out_of_the_sentence():
    oom = {"event": 3, "size_bytes": 30 * MiB, "live_bytes": 50 * MiB, "capacity_bytes": 110 * MiB,
           "fragmentation": True, "served_by": {"pyalloc": True, "native": None, "native_expandable": False}}
    assert oom_sentence(oom).endswith(
        "fragmentation: 80.00 MiB needed on 110.00 MiB; pyalloc would have served it, "
        "PyTorch with expandable segments would not")
    if NATIVES_MISSING:
        [oom] = replay(fragmented(), search=False).recorded_ooms
        assert oom["served_by"]["native"] is None and oom["served_by"]["native_expandable"] is None
        assert "PyTorch" not in oom_sentence(oom)


def test_a_block_waiting_on_another_stream_is_freed_before_the_request_fails():
    """A 30 MiB block freed while a second stream still used it (record_stream), a
    10 MiB one live, and a 20 MiB request on a 40 MiB device: the out-of-memory
    path waits for the stream and frees the first block, so every allocator serves
    the request (the prefix replayed keeps the pending free), and the block does not
    count as live."""
    first, second = BASE, BASE + 0x10000000
    events = [ev("segment_alloc", first, 30 * MiB), ev("alloc", first, 30 * MiB),
              ev("free_requested", first, 30 * MiB), ev("segment_alloc", second, 10 * MiB),
              ev("alloc", second, 10 * MiB), oom_event(20 * MiB, 0), ev("free_completed", first, 30 * MiB)]
    segments = [{"device": 0, "address": addr, "total_size": size, "stream": 0, "segment_type": "large",
                 "blocks": [{"address": addr, "size": size, "requested_size": size, "state": state,
                             "frames": []}]}
                for addr, size, state in ((first, 30 * MiB, "inactive"), (second, 10 * MiB, "active_allocated"))]
    [oom] = replay({"segments": segments, "device_traces": [events]}, search=False).recorded_ooms
    assert (oom["capacity_bytes"], oom["live_bytes"], oom["fragmentation"]) == (40 * MiB, 10 * MiB, True)
    assert oom["served_by"] == {name: True for name in ALLOCATORS}


def test_each_allocator_is_asked_through_run_allocator(monkeypatch):
    """How the diagnosis uses the seam: every allocator of ALLOCATORS, on the
    capacity, stopping at the first refusal, with the plan its calls came from:
    the trace's calls up to the event, then the request and its free; then each
    uncapped, where the search for the smallest capacity it needs starts."""
    import pyalloc.replay.oom as replay_oom

    asked = []

    def fake(calls, allocator, *, capacity=None, stop_on_oom=False, conf="", plan=None):
        asked.append((allocator, capacity, stop_on_oom, len(calls), len(plan), list(plan.sizes[-2:]),
                      list(plan.events[-2:]), plan.kinds[-2:].tolist()))
        if allocator == "pyalloc":
            return run_allocator(calls, allocator, capacity=capacity, stop_on_oom=stop_on_oom, conf=conf,
                                 plan=plan)
        return AllocatorRun(allocator == "native", 0, -1, 0, 0, None, None, 0)

    monkeypatch.setattr(replay_oom, "run_allocator", fake)
    [oom] = replay(fragmented(), search=False).recorded_ooms
    assert oom["served_by"] == {"pyalloc": True, "native": True, "native_expandable": False}
    calls = 50 + 25 + 2  # 50 allocs, 25 frees, the request and its free
    assert asked == [(a, capacity, capacity is not None, calls, calls, [30 * MiB] * 2, [oom["event"]] * 2, [1, 2])
                     for capacity in (110 * MiB, None) for a in ALLOCATORS]
    # One that serves nothing on a device of any size needs no capacity at all.
    assert oom["min_capacity_bytes"]["native_expandable"] is None


def test_run_allocator_pyalloc_and_unknown_names():
    from array import array

    from pyalloc import _C

    calls = _C.ReplayTrace(array("B", [1, 1, 2, 2]), array("I", [0, 1, 0, 1]),
                           array("Q", [4 * MiB, 4 * MiB, 0, 0]), array("Q", [0, 0, 0, 0]))
    run = run_allocator(calls, "pyalloc")
    assert isinstance(run, AllocatorRun)
    assert (run.completed, run.ooms, run.first_oom_op) == (True, 0, -1)
    assert run.peak_reserved_bytes >= 8 * MiB and run.device_calls >= 1
    cramped = run_allocator(calls, "pyalloc", capacity=6 * MiB, stop_on_oom=True)
    assert (cramped.completed, cramped.first_oom_op) == (False, 1)
    assert run_allocator(calls, "pyalloc", capacity=1, stop_on_oom=True).completed is False
    with pytest.raises(ValueError, match="native_expandable"):
        run_allocator(calls, "jemalloc")
    assert ALLOCATORS == ("pyalloc", "native", "native_expandable")


# -- the JSON row and the command line ---------------------------------------


def test_json_rows_carry_recorded_ooms_with_the_documented_keys(tmp_path):
    from pyalloc.replay.snapshot_io import write_snapshot

    path, out = tmp_path / "frag.pickle", tmp_path / "r.json"
    write_snapshot(fragmented(), path)
    p = cli(path, "--no-search", "--json", out)
    assert p.returncode == 0, p.stderr
    [row] = json.loads(out.read_text())
    [oom] = row["recorded_ooms"]
    assert set(oom) == {"event", "size_bytes", "live_bytes", "capacity_bytes", "fragmentation", "served_by",
                        "memory_fraction", "device_total_bytes", "device_total_assumed", "reserved_bytes",
                        "device_free_bytes", "cap_inferred", "cap_below_bytes", "cap_recorded_bytes", "unused_bytes",
                        "largest_free_block_bytes", "min_capacity_bytes"}
    assert set(oom["min_capacity_bytes"]) == set(ALLOCATORS)
    assert (oom["memory_fraction"], oom["device_total_bytes"], oom["device_total_assumed"]) == (None, None, False)
    assert set(oom["served_by"]) == set(ALLOCATORS)
    assert all(v is None or isinstance(v, bool) for v in oom["served_by"].values())
    assert isinstance(oom["fragmentation"], bool)
    assert all(isinstance(oom[k], int) for k in ("event", "size_bytes", "live_bytes", "capacity_bytes"))
    assert row["skipped_ooms"] == 0 and row["devices"] == 1
    # The table, then one sentence per recorded OOM.
    [sentence] = oom_sentences(p.stdout)
    assert sentence.startswith("frag.pickle, event 105: a 30.00 MiB allocation with 50.00 MiB live: fragmentation: "
                               "80.00 MiB needed on 110.00 MiB; 100.00 MiB reserved")
    assert sentence.endswith(oom_sentence(oom))  # the JSON's figures are the ones printed
    # A trace without OOMs has an empty list, and prints no sentence.
    clean = tmp_path / "clean.pickle"
    write_snapshot({"segments": [], "device_traces": [[ev("alloc", 1, 10)] + free(1, 10)]}, clean)
    p = cli(clean, "--no-search", "--json", out)
    assert json.loads(out.read_text())[0]["recorded_ooms"] == [] and ", event " not in p.stdout


@needs_gpu_traces
def test_cli_says_what_constructor_sun_device_1_needed():
    p = cli(CONSTRUCTOR_SUN, "--no-search", "--device", "1")
    assert p.returncode == 0, p.stderr
    [line] = [ln for ln in oom_sentences(p.stdout) if ", event 421: " in ln]
    assert "not fragmentation: 83.23 GiB needed on 78.51 GiB (4.73 GiB short)" in line
    assert line.endswith("; reduce memory")


# -- hostile and malformed oom events ----------------------------------------


def oom_with(**fields):
    e = {"action": "oom", "size": 8 * MiB, "device_free": MiB, "stream": 0, "time_us": 0, "frames": []}
    e.update(fields)
    return {k: v for k, v in e.items() if v is not DROP}


DROP = object()

MALFORMED = {
    "no size": oom_with(size=DROP),
    "negative size": oom_with(size=-1),
    "size past 2**63": oom_with(size=1 << 64),
    "size a string": oom_with(size="8 MiB"),
    "size a float": oom_with(size=8.0 * MiB),
    "size a bool": oom_with(size=True),
    "size None": oom_with(size=None),
    "no device_free": oom_with(device_free=DROP),
    "negative device_free": oom_with(device_free=-MiB),
    "device_free a list": oom_with(device_free=[1]),
    "stream a string": oom_with(stream="s"),
}


@pytest.mark.parametrize("oom", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_oom_event_is_skipped_and_counted(oom):
    r = replay(with_oom(oom), search=False)
    assert r.recorded_ooms == []
    assert r.skipped_ooms == 1 and len(r.skipped_oom_problems) == 1
    assert r.skipped_oom_problems[0].startswith("<snapshot>: device_traces[0][2] (oom): ")
    assert r.native_ooms == 1 and r.allocs == 1 and r.peak_live_bytes == 4 * MiB  # the rest is replayed


def test_cli_warns_of_skipped_oom_events_and_still_reports(tmp_path):
    from pyalloc.replay.snapshot_io import write_snapshot

    snapshot = with_oom(oom_with(device_free=DROP))
    snapshot["device_traces"][0] += [oom_with(size=-5), oom_event(MiB, MiB)]
    path = tmp_path / "bad-oom.pickle"
    write_snapshot(snapshot, path)
    p = cli(path, "--no-search")
    assert p.returncode == 0 and "Traceback" not in p.stderr
    [warning] = p.stderr.strip().splitlines()
    assert warning.startswith("pyalloc replay: warning: 2 oom event(s) could not be read")
    assert "[2] (oom): no 'device_free'" in warning and "[5] (oom): 'size' must be a byte count, got -5" in warning
    assert [s.split(": ")[0] for s in oom_sentences(p.stdout)] == ["bad-oom.pickle, event 6"]


def test_huge_but_readable_sizes_get_a_verdict_not_a_crash():
    [oom] = replay(with_oom(oom_event((1 << 63) - 1, MiB)), search=False).recorded_ooms
    assert oom["fragmentation"] is False and oom["served_by"]["pyalloc"] is False
    # A device said to have 2**62 bytes free: only a cap refuses there, below the 20 MiB
    # held + the 8 MiB segment; 4 + 8 MiB fit the 20 held, and pyalloc serves them.
    [oom] = replay(with_oom(oom_event(8 * MiB, 1 << 62)), search=False).recorded_ooms
    assert (oom["capacity_bytes"], oom["cap_below_bytes"]) == (20 * MiB, 40 * MiB)
    assert oom["fragmentation"] is True and oom["served_by"]["pyalloc"] is True
    # Both at once: capacity near 2**63, request near 2**63.
    # It fits that capacity, but is past the largest request pyalloc takes.
    [oom] = replay(with_oom(oom_event((1 << 63) - 1, (1 << 63) - 1)), search=False).recorded_ooms
    assert oom["capacity_bytes"] == 20 * MiB + (1 << 63) - 1
    assert oom["fragmentation"] is True and oom["served_by"]["pyalloc"] is False
    # No allocator serves a request near 2**63 bytes, and the sentence says so of pyalloc.
    assert not any(oom["served_by"].values())
    assert "none of pyalloc" in oom_sentence(oom)


def test_no_device_free_at_all_and_nothing_reserved():
    # 0 free and 0 reserved: a device of no bytes serves nothing, even 1 byte.
    snapshot = {"segments": [], "device_traces": [[ev("segment_alloc", BASE, 0), oom_event(1, 0)]]}
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["capacity_bytes"], oom["live_bytes"], oom["fragmentation"]) == (0, 0, False)
    assert oom["served_by"]["pyalloc"] is False


def test_an_oom_without_segments_has_no_capacity_and_no_verdict():
    [oom] = replay(with_oom(oom_event(8 * MiB, MiB), segments=False), search=False).recorded_ooms
    assert (oom["live_bytes"], oom["capacity_bytes"], oom["fragmentation"]) == (4 * MiB, None, None)
    assert set(oom["served_by"].values()) == {None}
    assert (oom["reserved_bytes"], oom["unused_bytes"], oom["largest_free_block_bytes"]) == (None, None, None)
    # The error the last event: the final segments are its, but there are none to read.
    [oom] = replay({"segments": [], "device_traces": [[ev("alloc", BASE, 4 * MiB), oom_event(8 * MiB, MiB)]]},
                   search=False).recorded_ooms
    assert (oom["reserved_bytes"], oom["largest_free_block_bytes"]) == (None, None)
    assert "no verdict" in oom_sentence(oom)


def test_an_oom_first_and_many_ooms():
    # As the first event: nothing live, the request replayed on its own.
    snapshot = with_oom(oom_event(8 * MiB, MiB))
    events = snapshot["device_traces"][0]
    events.insert(0, oom_event(64 * MiB, 0))
    [first, second] = replay(snapshot, search=False).recorded_ooms
    assert (first["event"], first["live_bytes"], first["capacity_bytes"]) == (0, 0, 0)
    assert (second["event"], second["live_bytes"], second["fragmentation"]) == (3, 4 * MiB, True)
    # Many: each gets a verdict, the first MAX_OOM_REPLAYS a replay, and the last (the
    # error a snapshot taken at an out-of-memory error was taken at).
    events[3:3] = [oom_event(8 * MiB, MiB) for _ in range(MAX_OOM_REPLAYS + 4)]
    ooms = replay(snapshot, search=False).recorded_ooms
    assert len(ooms) == MAX_OOM_REPLAYS + 6
    assert all(o["fragmentation"] is not None for o in ooms)
    assert [o["served_by"]["pyalloc"] is None for o in ooms] == [False] * MAX_OOM_REPLAYS + [True] * 5 + [False]


# -- every device a row --------------------------------------------------------


def two_devices():
    """Device 0 and device 2 recorded events; device 1 nothing; device 3 only a segment."""
    seg3 = {"device": 3, "address": BASE, "total_size": 2 * MiB, "stream": 0, "segment_type": "large",
            "blocks": [{"address": BASE, "size": 2 * MiB, "requested_size": 1000, "state": "active_allocated"}]}
    d0 = [ev("alloc", 1, 100), ev("alloc", 2, 200)] + free(1, 100) + free(2, 200)
    d2 = [ev("alloc", 1, 5000)] + free(1, 5000) + [ev("alloc", 1, 7000)] + free(1, 7000)
    return {"segments": [seg3], "device_traces": [d0, [], d2, []]}


def test_every_device_that_recorded_anything_is_a_row():
    # Device 3, with a segment and no event, holds no history: named, not a row.
    rows = replay_devices(two_devices(), search=False)
    assert [(r.device, r.peak_live_bytes, r.devices) for r in rows] == [(0, 300, 2), (2, 7000, 2)]
    assert [n.split(": ", 1)[1][:26] for n in rows[0].notes] == ["device 3 holds no history "]
    [one] = replay_devices(two_devices(), device=2, search=False)
    assert (one.device, one.peak_live_bytes, one.devices) == (2, 7000, 1)
    # replay() still answers for one device: the one with most events.
    assert replay(two_devices(), search=False).device == 0
    # An empty snapshot holds no history: nothing to replay (test_snapshot_history.py).
    with pytest.raises(NoHistoryError, match="device 0 holds no history"):
        replay_devices({"segments": [], "device_traces": []}, search=False)


def test_a_device_with_segments_and_no_trace_list_is_named():
    """Regression: device 3's segment was not looked at when device_traces had
    fewer lists than that (it ended at device 2), and it was lost in silence. It
    holds no history (segments, no event), so it is not a row: a note names it."""
    snapshot = two_devices()
    snapshot["device_traces"] = snapshot["device_traces"][:3]
    rows = replay_devices(snapshot, search=False)
    assert [(r.device, r.peak_live_bytes) for r in rows] == [(0, 300), (2, 7000)]
    assert any("device 3 holds no history" in note for note in rows[0].notes), rows[0].notes
    with pytest.raises(NoHistoryError, match="device 3 holds no history"):
        replay_devices(snapshot, device=3, search=False)


@needs_gpu_traces
def test_cli_rows_for_every_device(tmp_path):
    out = tmp_path / "r.json"
    p = cli(CONSTRUCTOR_SUN, "--no-search", "--json", out)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())
    assert [r["device"] for r in rows] == [0, 1, 2]  # device 3 recorded nothing
    table = p.stdout.splitlines()
    # The table names each device in its own column, one row each.
    devs = [ln.split()[1] for ln in table if ln.startswith("constructor-sun ") and ln.split()[1].isdigit()]
    assert devs == ["0", "1", "2"]
    assert [len(r["recorded_ooms"]) for r in rows] == [0, 1, 0]
    p = cli(CONSTRUCTOR_SUN, "--no-search", "--device", "2", "--json", out)
    assert [r["device"] for r in json.loads(out.read_text())] == [2]
    assert [ln.split()[1] for ln in p.stdout.splitlines()
            if ln.startswith("constructor-sun ") and ln.split()[1].isdigit()] == ["2"]
    p = cli(CONSTRUCTOR_SUN, "--no-search", "--device", "7")
    assert p.returncode == 1 and "no device 7" in p.stderr and "Traceback" not in p.stderr


# -- peak live of the snapshots users hand in --------------------------------


@needs_gpu_traces
@pytest.mark.parametrize("path", [WINDOWS, WRAPPED, CONSTRUCTOR_SUN], ids=["windows", "wrapped", "3-devices"])
def test_peak_live_per_device_matches_a_backward_walk(path):
    snapshot = load_snapshot(path)
    rows = replay_devices(snapshot, search=False)
    expected = [(d, backward_live(snapshot, d)[0]) for d in range(len(snapshot["device_traces"]))
                if snapshot["device_traces"][d]]
    assert [(r.device, r.peak_live_bytes) for r in rows] == expected
    if path == WRAPPED:  # the ring buffer wrapped: blocks were live before its first event
        assert backward_live(snapshot, 0)[1] > 0 and rows[0].preexisting_blocks > 0
    if path == WINDOWS:
        assert min(e["addr"] for e in snapshot["device_traces"][0] if "addr" in e) < 1 << 36


def random_history(seed, events=3000):
    """A workload on a few reused addresses, with its frees requested then completed
    (sometimes later), and the final segments' live blocks."""
    rng = random.Random(seed)
    live, pending, out = {}, [], []
    for _ in range(events):
        r = rng.random()
        if r < 0.45 or not live:
            addr = rng.choice([a for a in range(1, 64) if a * 4096 not in live and a * 4096 not in pending] or [0])
            if addr == 0:
                continue
            size = rng.choice([512, 4096, 1 << 20, 3 << 20, 25 << 20]) + rng.randrange(512)
            live[addr * 4096] = size
            out.append(ev("alloc", addr * 4096, size))
        elif r < 0.8 and set(live) - set(pending):
            addr = rng.choice(sorted(set(live) - set(pending)))
            out.append(ev("free_requested", addr, live[addr]))
            pending.append(addr)
            if rng.random() < 0.7:
                out += [ev("free_completed", addr, live.pop(addr))]
                pending.remove(addr)
        elif pending:
            addr = pending.pop(0)
            out.append(ev("free_completed", addr, live.pop(addr)))
    blocks = [{"address": a, "size": s + 511 & ~511, "requested_size": s,
               "state": "active_pending_free" if a in pending else "active_allocated"} for a, s in live.items()]
    segments = [{"device": 0, "address": 0, "total_size": 1 << 40, "stream": 0, "blocks": blocks}]
    return out, segments


@pytest.mark.parametrize("seed", range(4))
def test_peak_live_after_the_ring_buffer_wrapped(seed):
    """The history cut at any point (what a wrapped ring buffer keeps) gives the
    most bytes live from that point on in the whole history, walked forwards."""
    events, segments = random_history(seed)
    live_after = []  # live bytes after each event of the whole history
    live, sizes = 0, {}
    for e in events:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        live_after.append(live)
    for cut in (1, len(events) // 3, len(events) // 2, len(events) - 10):
        kept = {"segments": segments, "device_traces": [events[cut:]]}
        [r] = replay_devices(kept, search=False)
        assert r.peak_live_bytes == max(live_after[cut - 1:]), cut


# -- what the recorder writes beside the snapshot (pyalloc_oom) ---------------


def with_recorder_metadata(snapshot, **fields):
    """The snapshot as pyalloc's out-of-memory recorder writes it: a top-level
    "pyalloc_oom" dict (any field may be missing)."""
    snapshot["pyalloc_oom"] = {"device": 0, "allocator": "pytorch", "pyalloc": "0", **fields}
    return snapshot


def test_the_recorders_device_total_reaches_the_trace_and_caps_the_fraction():
    from pyalloc.replay.snapshot_io import read_trace

    snapshot = with_recorder_metadata(with_fraction(fragmented(), {"per_process_memory_fraction": 0.52}),
                                      device_total_bytes=200 * MiB)
    assert read_trace(snapshot).metadata["pyalloc_oom"]["device_total_bytes"] == 200 * MiB
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["device_total_bytes"], oom["device_total_assumed"]) == (200 * MiB, False)
    assert oom["capacity_bytes"] == int(0.52 * 200 * MiB)
    assert "needed on 104.00 MiB (memory fraction 0.52 of 200.00 MiB)" in oom_sentence(oom)


def test_the_recorders_device_total_is_said_without_a_fraction_too():
    # 100 MiB reserved + 10 MiB free of a 128 MiB device: the other 18 MiB the run
    # could not use (the CUDA context, other processes).
    [oom] = replay(with_recorder_metadata(fragmented(), device_total_bytes=128 * MiB),
                   search=False).recorded_ooms
    assert (oom["capacity_bytes"], oom["device_total_bytes"], oom["device_total_assumed"]) == \
        (110 * MiB, 128 * MiB, False)
    assert "needed on 110.00 MiB of the device's 128.00 MiB" in oom_sentence(oom)


@pytest.mark.parametrize("fields", [
    {"device_total_bytes": 200 * MiB, "device": 1},  # another device's total
    {"device_total_bytes": -5}, {"device_total_bytes": True}, {"device_total_bytes": "200MiB"},
    {"device_total_bytes": 0}, {"device_total_bytes": None}, {}], ids=str)
def test_a_device_total_that_is_not_this_devices_or_not_a_size_is_ignored(fields):
    snapshot = with_recorder_metadata(with_fraction(fragmented(), {"per_process_memory_fraction": 0.52}), **fields)
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["device_total_bytes"], oom["device_total_assumed"]) == (110 * MiB, True)
    snapshot["pyalloc_oom"] = "not a dict"
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["device_total_bytes"], oom["device_total_assumed"]) == (110 * MiB, True)


# -- a cap the snapshot does not record ----------------------------------------


def full_segments(request=16 * MiB, device_free=40 * GiB, segments=5, live_per_segment=10):
    """`segments` segments of 20 MiB, each holding `live_per_segment` live 2 MiB
    blocks (the rest of it free), then an oom event of `request` bytes with
    `device_free` bytes free on the device."""
    events, segs, seg = [], [], 20 * MiB
    for s in range(segments):
        events.append(ev("segment_alloc", BASE + s * seg, seg))
        events += [ev("alloc", BASE + s * seg + b * 2 * MiB, 2 * MiB) for b in range(live_per_segment)]
        blocks = [{"address": BASE + s * seg + b * 2 * MiB, "size": 2 * MiB, "requested_size": 2 * MiB,
                   "state": "active_allocated", "frames": []} for b in range(live_per_segment)]
        if live_per_segment < 10:
            blocks.append({"address": BASE + s * seg + live_per_segment * 2 * MiB,
                           "size": (10 - live_per_segment) * 2 * MiB, "state": "inactive", "frames": []})
        segs.append({"device": 0, "address": BASE + s * seg, "total_size": seg, "stream": 0,
                     "segment_type": "large", "blocks": blocks})
    events.append(oom_event(request, device_free))
    return {"segments": segs, "device_traces": [events]}


def test_more_free_on_the_device_than_the_segment_it_wanted_means_a_cap():
    """100 MiB live in five full 20 MiB segments, a 16 MiB block refused with 40 GiB
    free: PyTorch's cudaMalloc of a 16 MiB segment cannot fail with 40 GiB free, so
    a cap refused it (set_per_process_memory_fraction, which the snapshot does not
    record), below 100 + 16 MiB: no allocator had room, it is not fragmentation."""
    [oom] = replay(full_segments(), search=False).recorded_ooms
    assert oom["cap_inferred"] is True
    assert (oom["reserved_bytes"], oom["capacity_bytes"], oom["cap_below_bytes"]) == \
        (100 * MiB, 100 * MiB, 116 * MiB)
    assert oom["fragmentation"] is False
    assert not any(oom["served_by"].values())
    sentence = oom_sentence(oom)
    assert "not fragmentation: 116.00 MiB needed on 100.00 MiB" in sentence
    assert ("a cap was in force: 40.00 GiB free on the device, more than the 16.00 MiB segment it "
            "wanted; taken as the 100.00 MiB reserved (it lay below 116.00 MiB)") in sentence


def test_an_inferred_cap_with_room_in_the_reserved_bytes_is_fragmentation():
    # 50 MiB live in 100 MiB reserved, 6 MiB each segment's free tail: a 16 MiB block
    # fits the 100 MiB reserved whatever the cap was, 66 MiB needed.
    [oom] = replay(full_segments(live_per_segment=5), search=False).recorded_ooms
    assert (oom["cap_inferred"], oom["capacity_bytes"], oom["fragmentation"]) == (True, 100 * MiB, True)
    assert oom["served_by"]["pyalloc"] is True


def test_an_inferred_cap_that_may_or_may_not_have_held_the_need_withholds_the_verdict():
    # 90 MiB live in 100 MiB reserved, 16 MiB more: 106 MiB needed, the cap somewhere
    # in [100, 116) MiB: fragmentation only if it was at least 106. Not said either way.
    snapshot = full_segments()
    events = snapshot["device_traces"][0]
    events[-1:-1] = [e for b in range(5) for e in free(BASE + b * 20 * MiB, 2 * MiB)]
    for s in range(5):
        snapshot["segments"][s]["blocks"][0]["state"] = "inactive"
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["live_bytes"], oom["capacity_bytes"], oom["cap_below_bytes"]) == (90 * MiB, 100 * MiB, 116 * MiB)
    assert oom["cap_inferred"] is True and oom["fragmentation"] is None
    sentence = oom_sentence(oom)
    assert "not fragmentation" not in sentence and "reduce memory" not in sentence
    assert ("fragmentation only if the cap was at least 106.00 MiB, which the snapshot does not tell"
            in sentence)


def test_free_memory_below_the_segment_it_wanted_infers_no_cap():
    # A 1.5 MiB block comes from a 20 MiB segment: 10 MiB free is more than the block
    # but less than the segment, and cudaMalloc fails for want of memory.
    [oom] = replay(full_segments(request=3 * MiB // 2, device_free=10 * MiB), search=False).recorded_ooms
    assert oom["cap_inferred"] is False and oom["cap_below_bytes"] is None
    assert oom["capacity_bytes"] == 110 * MiB
    # A 22 MiB block under expandable segments maps two 20 MiB pages: 30 MiB free may not do.
    [oom] = replay(full_segments(request=22 * MiB, device_free=30 * MiB), search=False).recorded_ooms
    assert oom["cap_inferred"] is False and oom["capacity_bytes"] == 130 * MiB
    [oom] = replay(full_segments(request=22 * MiB, device_free=40 * MiB), search=False).recorded_ooms
    assert (oom["cap_inferred"], oom["cap_below_bytes"]) == (True, 122 * MiB)


# -- the verdict's figures: what was reserved, and how much each allocator needed ----


def within_precision(found, exact):
    """A budget bisected to BUDGET_PRECISION: at least the exact figure, at most that much above."""
    from pyalloc.replay.result import BUDGET_PRECISION

    return exact <= found <= exact * (1 + BUDGET_PRECISION) + 1


def test_what_was_reserved_unused_and_the_largest_free_block_at_the_failure():
    # 100 MiB reserved in five 20 MiB segments, 50 MiB live: 50 MiB unused, in 2 MiB holes.
    [oom] = replay(fragmented(), search=False).recorded_ooms
    assert (oom["reserved_bytes"], oom["unused_bytes"], oom["largest_free_block_bytes"]) == \
        (100 * MiB, 50 * MiB, 2 * MiB)
    assert ("100.00 MiB reserved, 50.00 MiB of it not live, the largest free block of its pool and stream "
            "2.00 MiB") in oom_sentence(oom)


def test_the_largest_free_block_is_not_known_where_the_segments_changed_after_the_error():
    # The frees came after the oom event: the final segments are not those it met.
    [oom] = replay(fragmented(oom_after_frees=False), search=False).recorded_ooms
    assert (oom["reserved_bytes"], oom["unused_bytes"], oom["largest_free_block_bytes"]) == (100 * MiB, 0, None)
    assert ("the largest free block not known (the segments changed after the error)"
            in oom_sentence(oom))


def test_only_free_blocks_of_the_requests_pool_and_stream_count():
    snapshot = fragmented()
    # A large free block on another stream, and a small-pool segment: neither serves it.
    snapshot["segments"] += [
        {"device": 0, "address": BASE + 200 * MiB, "total_size": 40 * MiB, "stream": 7, "segment_type": "large",
         "blocks": [{"address": BASE + 200 * MiB, "size": 40 * MiB, "state": "inactive"}]},
        {"device": 0, "address": BASE + 300 * MiB, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "blocks": [{"address": BASE + 300 * MiB, "size": 2 * MiB, "state": "inactive"},
                    {"address": BASE + 300 * MiB, "size": "junk", "state": "inactive"}]}]
    snapshot["device_traces"][0][0:0] = [ev("segment_alloc", BASE + 200 * MiB, 40 * MiB, 7),
                                         ev("segment_alloc", BASE + 300 * MiB, 2 * MiB)]
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["reserved_bytes"], oom["largest_free_block_bytes"]) == (142 * MiB, 2 * MiB)


def test_how_much_each_allocator_needed_and_had_to_spare():
    """fragmented(): pyalloc needs about the 80 MiB live + requested; PyTorch, which
    frees no segment (each holds live blocks), 100 MiB + a 30 MiB segment; with
    expandable segments 100 MiB + two 20 MiB pages. On the 110 MiB the run had."""
    [oom] = replay(fragmented(), search=False).recorded_ooms
    need = oom["min_capacity_bytes"]
    assert set(need) == set(ALLOCATORS)
    assert 80 * MiB <= need["pyalloc"] <= 110 * MiB
    sentence = oom_sentence(oom)
    spare = format_bytes(110 * MiB - need["pyalloc"])
    assert f"pyalloc ({spare} to spare) would have served it" in sentence
    if not NATIVES_MISSING:
        assert within_precision(need["native"], 130 * MiB), need
        assert within_precision(need["native_expandable"], 140 * MiB), need
        assert (f"PyTorch ({format_bytes(need['native'] - 110 * MiB)} short) and PyTorch with expandable "
                f"segments ({format_bytes(need['native_expandable'] - 110 * MiB)} short) would not") in sentence


def test_recorded_ooms_do_not_depend_on_the_budget_search():
    assert replay(fragmented(), search=True).recorded_ooms == replay(fragmented(), search=False).recorded_ooms


def test_only_the_first_few_ooms_and_the_last_are_searched():
    from pyalloc.replay.oom import MAX_OOM_SEARCHES

    snapshot = with_oom(oom_event(8 * MiB, MiB))
    snapshot["device_traces"][0][3:3] = [oom_event(8 * MiB, MiB) for _ in range(MAX_OOM_SEARCHES + 2)]
    ooms = replay(snapshot, search=False).recorded_ooms
    assert [o["min_capacity_bytes"]["pyalloc"] is None for o in ooms] == \
        [False] * MAX_OOM_SEARCHES + [True] * 2 + [False]
    # 4 MiB live + 8 MiB on a 21 MiB device: pyalloc needs 12 MiB or a little more.
    assert 12 * MiB <= ooms[0]["min_capacity_bytes"]["pyalloc"] <= 21 * MiB



def test_a_recorded_large_segment_size_is_the_segment_a_cap_is_inferred_from():
    """With large_segment_size_mb:64 PyTorch asks for a 64 MiB segment to hold a 4 MiB
    block: 40 MiB free on the device is then a true shortage, not a cap."""
    snapshot = full_segments(request=4 * MiB, device_free=40 * MiB)
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert oom["cap_inferred"] is True  # under the default 20 MiB segment, 40 MiB free means a cap
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "large_segment_size_mb:64"}
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert oom["cap_inferred"] is False and oom["capacity_bytes"] == 140 * MiB


def test_the_cap_pytorchs_observer_reported_is_the_capacity():
    """Under a memory fraction PyTorch's observer reports the cap, which pyalloc oom
    keeps beside the snapshot (device_limit_bytes): the capacity is that cap, not
    one inferred between the reserved bytes and reserved + the segment. Four full
    segments (80 MiB live) and 20 MiB free in them under a 110 MiB cap: a 16 MiB
    block fits no hole, but 96 MiB of live bytes fit 110 MiB: fragmentation."""
    snapshot = full_segments(segments=5, live_per_segment=8)
    snapshot["pyalloc_oom"] = {"device": 0, "device_total_bytes": 80 * GiB, "device_limit_bytes": 110 * MiB}
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert (oom["cap_inferred"], oom["cap_recorded_bytes"], oom["capacity_bytes"]) == (False, 110 * MiB, 110 * MiB)
    assert oom["fragmentation"] is True
    assert "under the per-process cap of 110.00 MiB PyTorch reported" in oom_sentence(oom)
    # Another device's record says nothing of this one.
    snapshot["pyalloc_oom"]["device"] = 1
    [oom] = replay(snapshot, search=False).recorded_ooms
    assert oom["cap_recorded_bytes"] is None and oom["cap_inferred"] is True
