"""Snapshots as current PyTorch writes them: with no history (taken with
``include_traces=False``, so no ``device_traces``; or with an empty trace), with
pinned host memory (``host_segments`` and ``host_traces``), and with a compile
context on each entry. A snapshot without history holds only its final blocks: a
replay of those says nothing about the run, so it says that, and how to record a
history, instead of a verdict."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

import pyalloc
import pyalloc.replay as rp
from pyalloc.replay import snapshot_io

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERDICT_WORDS = ("wins", "loses", "ties", "Budget:", "Uncapped reserved:", "Driver calls:")


def recorded_snapshot() -> dict:
    """A snapshot in PyTorch's layout with a history, and live blocks in its final segments."""
    a = pyalloc.Allocator("virtual", strategy="bestfit")
    a.record_history(True)
    ptrs = [a.malloc(size << 20) for size in (3, 5, 7, 1, 9, 2)]
    a.free(ptrs[1])
    a.free(ptrs[3])
    snapshot = a.snapshot()
    assert snapshot["device_traces"][0] and any(
        b["state"] == "active_allocated" for s in snapshot["segments"] for b in s["blocks"])
    return snapshot


def without_history(keep_key: bool) -> dict:
    snapshot = recorded_snapshot()
    if keep_key:
        snapshot["device_traces"] = [[]]  # a real snapshot with its trace emptied
    else:
        del snapshot["device_traces"]  # torch.cuda.memory._snapshot(include_traces=False)
    return snapshot


def replay_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "pyalloc", "replay", "--no-search", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)


@pytest.mark.parametrize("keep_key", [True, False], ids=["emptied-trace", "include_traces-False"])
def test_a_snapshot_without_history_says_so_and_gives_no_verdict(tmp_path, keep_key):
    path = tmp_path / "final-blocks-only.pickle"
    snapshot_io.write_snapshot(without_history(keep_key), path)
    out = replay_cli(path)
    text = " ".join((out.stdout + out.stderr).split())
    assert "holds no history" in text, text
    assert "torch.cuda.memory._record_memory_history(max_entries=" in text, text
    for word in VERDICT_WORDS:
        assert word not in out.stdout, (word, out.stdout)
    assert out.returncode == 1, "nothing was replayed"


def test_replay_refuses_a_snapshot_without_history():
    with pytest.raises(rp.NoHistoryError, match="holds no history") as e:
        rp.replay(without_history(keep_key=False), name="final-blocks-only")
    assert isinstance(e.value, snapshot_io.TraceError)
    with pytest.raises(rp.NoHistoryError, match="final-blocks-only: device 0 holds no history"):
        rp.replay_devices(without_history(keep_key=True), name="final-blocks-only")


def test_check_snapshot_takes_a_snapshot_without_traces_and_refuses_what_is_none():
    snapshot_io.check_snapshot(without_history(keep_key=False), "s")
    with pytest.raises(snapshot_io.TraceError, match="not a memory snapshot"):
        snapshot_io.check_snapshot({"allocator_settings": {}}, "s")
    with pytest.raises(snapshot_io.TraceError, match="'host_traces' must be a list"):
        snapshot_io.check_snapshot({**recorded_snapshot(), "host_traces": 5}, "s")


def test_a_device_without_history_beside_one_with_is_left_out_with_a_note():
    snapshot = recorded_snapshot()
    other = copy.deepcopy(snapshot["segments"])
    for segment in other:
        segment["device"] = 1
    snapshot["segments"] += other
    snapshot["device_traces"].append([])
    results = rp.replay_devices(snapshot, name="two", search=False)
    assert [r.device for r in results] == [0]
    assert any("device 1 holds no history" in note for note in results[0].notes), results[0].notes


def host_data(snapshot: dict) -> dict:
    """The pinned host memory of _record_memory_history(record_pinned_host_memory=True)."""
    snapshot["host_segments"] = [{"address": 1 << 40, "total_size": 2 << 20, "blocks": []}]
    snapshot["host_traces"] = [{"action": "alloc", "addr": 1 << 40, "size": 4096, "stream": 0},
                               {"action": "free_completed", "addr": 1 << 40, "size": 4096, "stream": 0}]
    return snapshot


def test_host_data_is_left_aside_with_a_note(tmp_path):
    plain = rp.replay(recorded_snapshot(), name="t", search=False)
    with_host = rp.replay(host_data(recorded_snapshot()), name="t", search=False)
    assert with_host.pyalloc_peak_reserved_bytes == plain.pyalloc_peak_reserved_bytes
    assert with_host.events == plain.events
    assert "host_segments" not in with_host.to_dict().get("metadata", {})
    assert any("1 host segment" in n and "2 host events" in n and "left aside" in n for n in with_host.notes), \
        with_host.notes
    path = tmp_path / "host.pickle"
    snapshot_io.write_snapshot(host_data(recorded_snapshot()), path)
    out = replay_cli(path)
    assert out.returncode == 0, out.stderr
    assert "pyalloc replay: note: " in out.stderr and "left aside" in out.stderr, out.stderr


def test_entries_with_a_compile_context_replay_as_without():
    snapshot = recorded_snapshot()
    for entry in snapshot["device_traces"][0]:
        entry["compile_context"] = "[0/0] torch/_dynamo frame 3"
        entry["user_metadata"] = "step 7"
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            block["compile_context"] = "[0/1]"
    plain = rp.replay(recorded_snapshot(), name="t", search=False)
    compiled = rp.replay(snapshot, name="t", search=False)
    assert compiled.events == plain.events > 0
    assert compiled.pyalloc_peak_reserved_bytes == plain.pyalloc_peak_reserved_bytes
    assert compiled.peak_live_bytes == plain.peak_live_bytes
