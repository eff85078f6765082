"""The settings of PyTorch's allocator a snapshot records (``allocator_settings``), as
the model of that allocator (csrc/replay/torch_model.h) honours them: read once from
the snapshot (``pyalloc.replay.settings.torch_settings``), passed to every run of the model (the
uncapped figures, the budget search, the OOM verdict, the validation against the
recorded device calls), and named in a note where the model does not apply one.

The snapshots are built by hand in PyTorch's format, with ``allocator_settings`` as
torch 2.13's ``torch.cuda.memory._snapshot()`` writes them (torch/csrc/cuda/Module.cpp):
``max_split_size`` in bytes (-1 unset), ``roundup_power2_divisions`` as a dict from
each interval's lower end in MiB ("1" ... "32768") to its divisions, and the
configuration string under ``PYTORCH_CUDA_ALLOC_CONF``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyalloc import _C
from pyalloc.replay import replay
from pyalloc.replay.report import format_recorded
from pyalloc.replay.settings import TorchSettings, torch_settings
from test_torch_model import calls_of

MiB, GiB = 1 << 20, 1 << 30
SEG_ALLOC, SEG_FREE = 3, 4
BASE = 0x7F0000000000
ROOT = Path(__file__).resolve().parents[2]
INTERVALS = [str(1 << i) for i in range(16)]  # the dict's keys: 1 MiB ... 32 GiB


def recorded_settings(conf="", max_split_size=-1, divisions=0, gc=0.0, expandable=False):
    """allocator_settings as torch 2.13 records them; `divisions` one int for every
    interval or a list of 16."""
    per_interval = divisions if isinstance(divisions, list) else [divisions] * 16
    return {"PYTORCH_CUDA_ALLOC_CONF": conf, "max_split_size": max_split_size,
            "garbage_collection_threshold": gc, "expandable_segments": expandable,
            "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
            "roundup_power2_divisions": dict(zip(INTERVALS, per_interval))}


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": []}


def oom_event(size, device_free):
    return {"action": "oom", "size": size, "device_free": device_free, "stream": 0, "time_us": 0,
            "frames": []}


def segment(addr, total, blocks):
    """A large-pool segment; blocks: [(address, size, requested, state)]."""
    return {"device": 0, "address": addr, "total_size": total, "stream": 0, "segment_type": "large",
            "blocks": [{"address": a, "size": s, "requested_size": r, "state": st, "frames": []}
                       for a, s, r, st in blocks]}


def model(ops, settings: TorchSettings, **kw):
    return _C.run_torch_model(calls_of(ops), record_calls=True, **settings.model_options(), **kw)


def made(r):
    return [(k, op, size) for k, op, _, size in r["calls"]]


def settings_of(conf="", **kw):
    return torch_settings({"allocator_settings": recorded_settings(conf, **kw)})


# -- roundup_power2_divisions -------------------------------------------------


def two_1200_mib_requests():
    """Recorded under roundup_power2_divisions:4: a 1200 MiB allocation rounded to a
    1280 MiB block (its own cudaMalloc), then a second 1200 MiB request, rounded to
    1280 MiB too, refused with 1250 MiB free: the device held 2530 MiB."""
    events = [ev("segment_alloc", BASE, 1280 * MiB), ev("alloc", BASE, 1200 * MiB),
              oom_event(1280 * MiB, 1250 * MiB)]
    segments = [segment(BASE, 1280 * MiB, [(BASE, 1280 * MiB, 1200 * MiB, "active_allocated")])]
    return {"segments": segments, "device_traces": [events],
            "allocator_settings": recorded_settings("roundup_power2_divisions:4", divisions=4)}


def test_roundup_power2_divisions_4_is_honoured_by_the_oom_verdict():
    r = replay(two_1200_mib_requests(), search=False)
    [oom] = r.recorded_ooms
    assert oom["capacity_bytes"] == 2530 * MiB
    # PyTorch rounds both to 1280 MiB: 2560 MiB do not fit 2530, with or without
    # expandable segments (whose 20 MiB pages hold 1280 MiB exactly).
    assert oom["served_by"]["native"] is False
    assert oom["served_by"]["native_expandable"] is False
    # How much each would have needed is searched under the same settings: at least
    # the two rounded blocks, not the 2400 MiB PyTorch's default rounding would need.
    assert oom["min_capacity_bytes"]["native"] >= 2560 * MiB
    assert oom["min_capacity_bytes"]["native_expandable"] >= 2560 * MiB


def test_roundup_power2_divisions_4_makes_the_recorded_cudamalloc():
    r = replay(two_1200_mib_requests(), search=False)
    v = r.validation
    assert (v["matched_calls"], v["recorded_calls"]) == (1, 1)
    assert "makes 1 of its 1 recorded device calls." in " ".join(format_recorded([r]).split())
    # Uncapped, the model reserves what PyTorch did: the 1280 MiB segment.
    assert r.native_peak_reserved_bytes == 1280 * MiB


def test_roundup_power2_divisions_per_interval():
    """The list form, "[256:1,512:2,1024:4,2048:1]": below 512 MiB one division
    (512-byte rounding), 512 MiB - 1 GiB two, 1 - 2 GiB four, 2 - 4 GiB one, above
    none. Each request makes its own cudaMalloc of the size PyTorch rounds it to."""
    divisions = [1] * 9 + [2, 4, 1] + [0] * 4
    sizes = [(300 * MiB, 300 * MiB), (600 * MiB, 768 * MiB), (1200 * MiB, 1280 * MiB),
             (2500 * MiB, 2500 * MiB), (5000 * MiB, 5000 * MiB)]
    events, segments, addr = [], [], BASE
    for requested, rounded in sizes:
        events += [ev("segment_alloc", addr, rounded), ev("alloc", addr, requested)]
        segments.append(segment(addr, rounded, [(addr, rounded, requested, "active_allocated")]))
        addr += 8 * GiB
    snapshot = {"segments": segments, "device_traces": [events], "allocator_settings": recorded_settings(
        "roundup_power2_divisions:[256:1,512:2,1024:4,2048:1]", divisions=divisions)}
    r = replay(snapshot, search=False)
    assert (r.validation["matched_calls"], r.validation["recorded_calls"]) == (5, 5)
    assert r.native_peak_reserved_bytes == sum(rounded for _, rounded in sizes)


def test_roundup_power2_next_division_as_pytorch_rounds():
    """c10's round_size with roundup_power2_next_division: up to the next of
    `divisions` equal steps between the powers of two around the size, only for sizes
    above 512 B x divisions; sizes under 1 MiB take the first interval's divisions;
    powers of two stay."""
    s = settings_of(divisions=8)
    # 1100 B is not above 4096 B: 512-byte rounding, 1536 B (not 1152 B): 1366 of them
    # need a second 2 MiB segment.
    r = model([("a", i, 1100) for i in range(1366)], s)
    assert [size for _, _, size in made(r)] == [2 * MiB, 2 * MiB]
    # 650 KiB: 8 steps of 64 KiB above 512 KiB, 704 KiB: three need two small segments.
    r = model([("a", i, 650 * 1024) for i in range(3)], s)
    assert [size for _, _, size in made(r)] == [2 * MiB, 2 * MiB]
    assert len(made(model([("a", i, 650 * 1024) for i in range(3)], TorchSettings()))) == 1
    # 64 MiB stays; 65 MiB rounds to 72 MiB (8 steps of 8 MiB).
    r = model([("a", 0, 64 * MiB), ("a", 1, 65 * MiB)], s)
    assert made(r) == [(SEG_ALLOC, 0, 64 * MiB), (SEG_ALLOC, 1, 72 * MiB)]


# -- max_split_size_mb (and max_non_split_rounding_mb) ------------------------


def oversize_then_small():
    """Recorded under max_split_size_mb:100: a 200 MiB block freed, then a 50 MiB
    request, which PyTorch does not cut from the oversize block: a cudaMalloc of its own."""
    events = [ev("segment_alloc", BASE, 200 * MiB), ev("alloc", BASE, 200 * MiB),
              ev("free_requested", BASE, 200 * MiB), ev("free_completed", BASE, 200 * MiB),
              ev("segment_alloc", BASE + GiB, 50 * MiB), ev("alloc", BASE + GiB, 50 * MiB)]
    segments = [segment(BASE, 200 * MiB, [(BASE, 200 * MiB, 200 * MiB, "inactive")]),
                segment(BASE + GiB, 50 * MiB, [(BASE + GiB, 50 * MiB, 50 * MiB, "active_allocated")])]
    return {"segments": segments, "device_traces": [events],
            "allocator_settings": recorded_settings("max_split_size_mb:100", max_split_size=100 * MiB)}


def test_max_split_size_blocks_are_not_split_for_smaller_requests():
    r = replay(oversize_then_small(), search=False)
    assert (r.validation["matched_calls"], r.validation["recorded_calls"]) == (2, 2)
    assert r.native_peak_reserved_bytes == 250 * MiB


def test_large_requests_reuse_oversize_blocks_only_within_max_non_split_rounding():
    ops = [("a", 0, 200 * MiB), ("f", 0), ("a", 1, 150 * MiB), ("f", 1), ("a", 2, 185 * MiB)]
    # Default rounding (20 MiB): 200 >= 150 + 20, a new segment; 200 < 185 + 20, reused whole.
    r = model(ops, settings_of("max_split_size_mb:100", max_split_size=100 * MiB))
    assert made(r) == [(SEG_ALLOC, 0, 200 * MiB), (SEG_ALLOC, 2, 150 * MiB)]
    # max_non_split_rounding_mb:60, which the snapshot keeps only in the string: reused at once.
    s = settings_of("max_split_size_mb:100,max_non_split_rounding_mb:60", max_split_size=100 * MiB)
    assert s.max_non_split_rounding == 60 * MiB
    assert made(model(ops, s)) == [(SEG_ALLOC, 0, 200 * MiB)]


def test_oom_releases_oversize_blocks_first():
    """release_available_cached_blocks: a failed cudaMalloc frees the smallest oversize
    block that covers the request (at least max_split_size), or the largest ones until
    they do, and tries again, before release_cached_blocks would free every cached
    segment: the small pool's free segment stays."""
    s = settings_of("max_split_size_mb:100", max_split_size=100 * MiB)
    ops = [("a", 0, 120 * MiB), ("a", 1, 110 * MiB), ("a", 2, 1024), ("f", 0), ("f", 1), ("f", 2),
           ("a", 3, 200 * MiB)]
    r = model(ops, s, capacity=400 * MiB)
    assert r["completed"] and r["retries"] == 0
    assert made(r) == [(SEG_ALLOC, 0, 120 * MiB), (SEG_ALLOC, 1, 110 * MiB), (SEG_ALLOC, 2, 2 * MiB),
                       (SEG_FREE, 6, 120 * MiB), (SEG_FREE, 6, 110 * MiB), (SEG_ALLOC, 6, 200 * MiB)]
    # One oversize block that covers it: only that one goes.
    ops = [("a", 0, 200 * MiB), ("a", 1, 30 * MiB), ("f", 0), ("f", 1), ("a", 2, 60 * MiB)]
    r = model(ops, s, capacity=250 * MiB)
    assert made(r) == [(SEG_ALLOC, 0, 200 * MiB), (SEG_ALLOC, 1, 30 * MiB), (SEG_FREE, 4, 200 * MiB),
                       (SEG_ALLOC, 4, 60 * MiB)]
    # Without the setting nothing is oversize: the 60 MiB are cut from the 200 MiB block.
    assert made(model(ops, TorchSettings(), capacity=250 * MiB)) == made(r)[:2]
    # Only the request's stream's blocks: the oversize block of stream 1 stays, and the
    # out-of-memory path goes on to release_cached_blocks, which frees every free segment.
    ops = [("a", 0, 200 * MiB, 1), ("a", 1, 30 * MiB), ("f", 0), ("f", 1), ("a", 2, 60 * MiB)]
    r = model(ops, s, capacity=250 * MiB)
    assert r["retries"] == 1
    # (in the free set's order: by stream, then size)
    assert made(r)[2:] == [(SEG_FREE, 4, 30 * MiB), (SEG_FREE, 4, 200 * MiB), (SEG_ALLOC, 4, 60 * MiB)]


# -- large_segment_size_mb ----------------------------------------------------


def test_large_segment_size_sets_the_segment_of_mid_sized_requests_and_expandable_pages():
    s = settings_of("large_segment_size_mb:40")
    assert s.large_segment_size == 40 * MiB
    assert made(model([("a", 0, 5 * MiB)], s)) == [(SEG_ALLOC, 0, 40 * MiB)]
    r = model([("a", 0, 30 * MiB)], s, expandable=True)
    assert [size for _, _, size in made(r)] == [40 * MiB]


# -- what is not applied is said ------------------------------------------------


def test_defaults_need_no_note():
    s = settings_of()
    assert s == TorchSettings() and s.notes == []
    assert torch_settings({}) == TorchSettings()
    # pyalloc's own snapshots record its settings, not PyTorch's.
    assert torch_settings({"allocator_settings": {"backend": "pyalloc", "strategy": "vmm"}}) == TorchSettings()


def test_garbage_collection_threshold_is_named_as_not_applied():
    snapshot = oversize_then_small()
    snapshot["allocator_settings"] = recorded_settings(
        "max_split_size_mb:100,garbage_collection_threshold:0.6", max_split_size=100 * MiB, gc=0.6)
    s = torch_settings(snapshot)
    assert s.not_applied == ["garbage_collection_threshold"]
    r = replay(snapshot, search=False)
    [note] = [n for n in r.notes if "garbage_collection_threshold" in n]
    assert "0.6" in note and "PyTorch's default" in note
    assert r.validation["settings_not_applied"] == ["garbage_collection_threshold"]


def test_unknown_and_unreadable_settings_are_named():
    s = torch_settings({"allocator_settings": dict(
        recorded_settings("backend:cudaMallocAsync,some_new_knob:3"), max_split_size="big")})
    assert s.max_split_size is None
    assert sorted(s.not_applied) == ["backend", "max_split_size", "some_new_knob"]


def test_values_no_pytorch_would_record_are_named_not_passed_on():
    huge = recorded_settings("large_segment_size_mb:99999999999999999999")
    huge["roundup_power2_divisions"]["1024"] = 1 << 70
    s = torch_settings({"allocator_settings": huge})
    assert sorted(s.not_applied) == ["large_segment_size_mb", "roundup_power2_divisions"]
    assert s.model_options() == TorchSettings().model_options()
    # Divisions that are not powers of two are refused where they would reach the model.
    with pytest.raises(ValueError, match="powers of two"):
        _C.run_torch_model(calls_of([("a", 0, 1)]), roundup_power2_divisions=[3] * 16)


def test_a_mismatch_says_which_setting_was_not_applied():
    """A recording whose device calls the model cannot make (a 30 MiB cudaMalloc where
    the model reuses the free 200 MiB block), under a setting it does not apply: the
    validation line gives that as the reason it may know."""
    snapshot = oversize_then_small()
    snapshot["device_traces"][0][4]["size"] = 30 * MiB  # keep the file consistent
    snapshot["segments"][1]["total_size"] = 30 * MiB
    snapshot["segments"][1]["blocks"][0].update(size=30 * MiB, requested_size=30 * MiB)
    snapshot["device_traces"][0][5]["size"] = 30 * MiB
    snapshot["allocator_settings"] = recorded_settings("garbage_collection_threshold:0.6", gc=0.6)
    r = replay(snapshot, search=False)
    assert r.validation["matched_calls"] < r.validation["recorded_calls"]
    line = " ".join(format_recorded([r]).split())
    assert "garbage_collection_threshold" in line and "not applied" in line


def test_the_cli_prints_the_note(tmp_path):
    import pickle

    snapshot = oversize_then_small()
    snapshot["allocator_settings"]["garbage_collection_threshold"] = 0.6
    path = tmp_path / "gc.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "pyalloc", "replay", "--no-search", str(path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pyalloc replay: note:" in out.stderr and "garbage_collection_threshold" in out.stderr
