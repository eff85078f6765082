"""Structured mutation of snapshots through the reader and the replay: what a file
downloaded from an issue may hold. Valid snapshots (generated, and the start of a
bundled trace) are mutated a fixed number of times from a fixed seed: entries of the
wrong type, negative and huge sizes and addresses, frees of nothing, allocations
over live blocks, segments and blocks that make no sense, traces cut anywhere, and
pickled files cut or altered byte by byte. Each case must end in a replay or in one
of the documented errors (TraceError, ValueError with a sentence): never another
exception, a crash or a hang. The cases run in a child process under a timeout, so
that a crash or a hang fails the test, naming the case it was in.
"""
from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "benchmarks" / "traces" / "tiny-gpt-varlen-train.pickle.gz"
SEED = 52
#: Cases of each kind: dicts given to replay(), and files given to replay() by path.
DICT_CASES = 3000
FILE_CASES = 1500
#: The child's limit: far above what the cases take (about 10 s on one core).
TIMEOUT_S = 240
#: Events of the bundled trace kept as a base (its start: allocations, frees, segments).
BUNDLED_EVENTS = 400
MiB = 1 << 20
ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot", "user_defined"]
# Values of the wrong type, or out of range, for any field.
ODD_VALUES: List[Any] = [None, "", "0x1000", 1.5, float("nan"), float("inf"), True, [], {}, (1,), b"\x00",
                         -1, -(1 << 63), 1 << 63, (1 << 64) - 1, 1 << 64, 1 << 200, 0]
HUGE_SIZES = [(1 << 62), (1 << 63) - 1, (1 << 48), (1 << 40) + 1, 0, 1, 511, 513]


def generated(rng: random.Random) -> Dict[str, Any]:
    """A well-formed snapshot: allocations and frees on two streams, segments for them."""
    events: List[Dict[str, Any]] = []
    live: Dict[int, int] = {}
    base = 0x7F0000000000
    for _ in range(rng.randrange(5, 60)):
        if live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            size = live.pop(addr)
            events.append({"action": "free_requested", "addr": addr, "size": size, "stream": 0})
            events.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0})
        else:
            size = rng.choice([512, 4096, MiB, 3 * MiB + 7, 20 * MiB])
            addr = base
            base += (size + 0xFFFFF) & ~0xFFFFF
            live[addr] = size
            events.append({"action": "alloc", "addr": addr, "size": size, "stream": rng.choice([0, 7])})
    blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated"}
              for a, s in sorted(live.items())]
    segments = [{"device": 0, "address": b["address"], "total_size": b["size"], "stream": 0,
                 "segment_type": "large", "blocks": [b]} for b in blocks]
    return {"segments": segments, "device_traces": [events]}


def bundled() -> Dict[str, Any]:
    with gzip.open(BUNDLED, "rb") as f:
        snapshot = pickle.load(f)
    traces = snapshot["device_traces"]
    device = max(range(len(traces)), key=lambda d: len(traces[d]))
    return {"segments": [], "device_traces": [traces[device][:BUNDLED_EVENTS]]}


# -- mutations of a snapshot dict (each changes it in place) --------------------


def _events(s: Dict[str, Any]) -> List[Any]:
    traces = s.get("device_traces")
    if type(traces) is list and traces and type(traces[0]) is list:
        return traces[0]
    return []


def _an_event(rng: random.Random, s: Dict[str, Any]):
    events = [e for e in _events(s) if type(e) is dict]
    return rng.choice(events) if events else None


def wrong_field(rng, s):
    e = _an_event(rng, s)
    if e is not None:
        e[rng.choice(["action", "addr", "size", "stream", "device_free"])] = rng.choice(ODD_VALUES)


def drop_field(rng, s):
    e = _an_event(rng, s)
    if e is not None:
        e.pop(rng.choice(["action", "addr", "size", "stream"]), None)


def huge_or_negative_size(rng, s):
    e = _an_event(rng, s)
    if e is not None:
        e["size"] = rng.choice(HUGE_SIZES + [-1, -512, 1 << 63, 1 << 64])


def free_of_nothing(rng, s):
    events = _events(s)
    at = rng.randrange(len(events) + 1)
    addr = rng.choice([0, 1, 0x7F0000000000 + rng.randrange(1 << 30), (1 << 64) - 1])
    for action in rng.sample(["free_requested", "free_completed"], rng.randrange(1, 3)):
        events.insert(at, {"action": action, "addr": addr, "size": rng.choice(HUGE_SIZES), "stream": 0})


def overlapping_alloc(rng, s):
    events = _events(s)
    allocs = [e for e in events if type(e) is dict and e.get("action") == "alloc" and type(e.get("addr")) is int]
    at = rng.randrange(len(events) + 1)
    if allocs:
        e = rng.choice(allocs)
        addr = e["addr"] + rng.choice([0, 1, 256, 4096])
        events.insert(at, {"action": "alloc", "addr": addr % (1 << 64), "size": rng.choice(HUGE_SIZES), "stream": 0})


def duplicate_or_swap(rng, s):
    events = _events(s)
    if len(events) >= 2:
        i, j = rng.randrange(len(events)), rng.randrange(len(events))
        if rng.random() < 0.5:
            events[i], events[j] = events[j], events[i]
        else:
            events.insert(j, dict(events[i]) if type(events[i]) is dict else events[i])


def odd_event(rng, s):
    events = _events(s)
    events.insert(rng.randrange(len(events) + 1), rng.choice(
        ODD_VALUES + [{"action": rng.choice(ACTIONS)},
                      {"action": rng.choice(ACTIONS), "addr": rng.choice(ODD_VALUES),
                       "size": rng.choice(ODD_VALUES), "stream": rng.choice(ODD_VALUES),
                       "device_free": rng.choice(ODD_VALUES)}]))


def segment_events(rng, s):
    events = _events(s)
    for _ in range(rng.randrange(1, 4)):
        events.insert(rng.randrange(len(events) + 1), {
            "action": rng.choice(ACTIONS[3:7]), "addr": rng.choice([0x7F0000000000, 0, (1 << 64) - 1]),
            "size": rng.choice(HUGE_SIZES + [-1]), "stream": rng.choice([0, (1 << 64) - 1, -1])})


def oom_event(rng, s):
    """An out-of-memory the device recorded, readable or not: its replay at the
    capacity the event implies, under the memory fraction the settings record."""
    events = _events(s)
    sizes = HUGE_SIZES + [2 * MiB, 20 * MiB]
    e = {"action": "oom", "size": rng.choice(sizes), "device_free": rng.choice(sizes), "stream": rng.choice([0, 7, -1])}
    if rng.random() < 0.2:
        e[rng.choice(sorted(e))] = rng.choice(ODD_VALUES)
    events.insert(rng.randrange(len(events) + 1), e)
    if rng.random() < 0.5:
        s["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:" + rng.choice(
            ["0.5", "1e-30", "0.999999", "5e-324", "0.1"])}


def cut_trace(rng, s):
    events = _events(s)
    del events[rng.randrange(len(events) + 1):]


def odd_segments(rng, s):
    choice = rng.randrange(6)
    if choice == 0:
        s["segments"] = rng.choice(ODD_VALUES)
    elif choice == 1 and type(s.get("segments", [])) is list:
        s.setdefault("segments", []).append(rng.choice(ODD_VALUES))
    else:
        segments = s.get("segments")
        if type(segments) is not list:
            return
        seg = {"device": rng.choice([0, 0, 1, -1, "0", None]), "address": rng.choice([0x7F0000000000] + ODD_VALUES),
               "total_size": rng.choice(HUGE_SIZES + ODD_VALUES), "stream": rng.choice([0] + ODD_VALUES),
               "segment_type": rng.choice(["large", "small", None]), "is_expandable": rng.choice([True, False, 1]),
               "blocks": rng.choice([[], None, "x", [
                   {"address": rng.choice([0x7F0000000000] + ODD_VALUES), "size": rng.choice(HUGE_SIZES + ODD_VALUES),
                    "requested_size": rng.choice(HUGE_SIZES + ODD_VALUES),
                    "state": rng.choice(["active_allocated", "active_pending_free", "inactive", None])},
                   rng.choice(ODD_VALUES)]])}
        for key in rng.sample(sorted(seg), rng.randrange(3)):
            del seg[key]
        segments.append(seg)


def odd_top_level(rng, s):
    choice = rng.randrange(6)
    if choice == 0:
        s.pop("device_traces", None)
    elif choice == 1:
        s["device_traces"] = rng.choice(ODD_VALUES + [[None], [[], 3], [{}]])
    elif choice == 2 and type(s.get("device_traces")) is list:
        s["device_traces"] = [[]] * rng.randrange(0, 4) + s["device_traces"]  # more devices
    elif choice == 3:
        s["allocator_settings"] = rng.choice(ODD_VALUES + [
            {"PYTORCH_CUDA_ALLOC_CONF": rng.choice(["per_process_memory_fraction:0.5", "per_process_memory_fraction:x",
                                                    "per_process_memory_fraction:1e999", ",,:", 7])},
            {"per_process_memory_fraction": rng.choice(ODD_VALUES + ["0.25", 0.25])}])
    else:
        s[rng.choice(["segments", "device_traces", "extra"])] = rng.choice(ODD_VALUES)


MUTATIONS: List[Callable[[random.Random, Dict[str, Any]], None]] = [
    wrong_field, drop_field, huge_or_negative_size, free_of_nothing, overlapping_alloc, duplicate_or_swap,
    odd_event, segment_events, oom_event, cut_trace, odd_segments, odd_top_level]


def mutated(rng: random.Random, bases: List[Dict[str, Any]]) -> Tuple[Dict[str, Any], List[str]]:
    s = pickle.loads(pickle.dumps(rng.choice(bases)))  # a deep copy
    done = []
    for _ in range(rng.randrange(1, 4)):
        m = rng.choice(MUTATIONS)
        m(rng, s)
        done.append(m.__name__)
    return s, done


def file_bytes(rng: random.Random, s: Any) -> Tuple[bytes, str]:
    """The snapshot pickled (perhaps gzip'd), then cut or altered: what a broken
    download or a hostile file looks like."""
    data = pickle.dumps(s, protocol=rng.choice([0, 2, 4, 5]))
    how = rng.choice(["whole", "cut", "flip", "cut", "flip", "gzip-cut", "gzip-flip"])
    if how.startswith("gzip"):
        data = gzip.compress(data, mtime=0)
    if how.endswith("cut"):
        data = data[:rng.randrange(len(data) + 1)]
    elif how.endswith("flip"):
        blob = bytearray(data)
        for _ in range(rng.randrange(1, 6)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        data = bytes(blob)
    return data, how


# -- the child: runs the cases, a line each --------------------------------------


def documented(e: BaseException) -> bool:
    """TraceError, or ValueError with a one-line sentence."""
    from pyalloc.replay.snapshot_io import TraceError

    text = str(e)
    sentence = bool(text.strip()) and "\n" not in text and " " in text.strip()
    return isinstance(e, (TraceError, ValueError)) and sentence


def run_case(replay, source, search: bool) -> str:
    try:
        r = replay(source, search=search, progress=False, timeline_points=50)
    except Exception as e:  # every other kind is what the test finds
        return "error" if documented(e) else "BAD " + "".join(traceback.format_exception(type(e), e, e.__traceback__))
    # A replay that ends reports what the allocator held: never less than was live at once
    # (one that refused requests counted only those it served, and read as a win).
    if r.pyalloc_peak_reserved_bytes < r.peak_live_bytes:
        return (f"BAD a replay reported {r.pyalloc_peak_reserved_bytes} bytes reserved at most, "
                f"under the {r.peak_live_bytes} bytes live at once")
    return "ok"


def child(out: Path) -> None:
    from pyalloc.replay import replay

    rng = random.Random(SEED)
    bases = [bundled()] + [generated(rng) for _ in range(4)]
    with open(out, "w", buffering=1) as log, tempfile.TemporaryDirectory() as tmp:
        for i in range(DICT_CASES + FILE_CASES):
            s, what = mutated(rng, bases)
            source: Any = s
            if i >= DICT_CASES:
                data, how = file_bytes(rng, s)
                what.append(how)
                source = os.path.join(tmp, f"case{i}.pickle")
                with open(source, "wb") as f:
                    f.write(data)
            log.write(json.dumps({"case": i, "what": what, "start": True}) + "\n")
            outcome = run_case(replay, source, search=i % 10 == 0)
            log.write(json.dumps({"case": i, "what": what, "outcome": outcome}) + "\n")


def test_mutated_snapshots_replay_or_raise_a_documented_error(tmp_path):
    out = tmp_path / "cases.jsonl"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {Path(__file__).stem} as m; " \
           f"m.child(__import__('pathlib').Path({str(out)!r}))"
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                              cwd=str(ROOT), timeout=TIMEOUT_S)
        ended = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        proc, ended = None, f"a hang: still running after {TIMEOUT_S} s"
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    done = [r for r in lines if "outcome" in r]
    bad = [r for r in done if r["outcome"].startswith("BAD")]
    assert not bad, f"{len(bad)} cases raised an undocumented error; the first: {bad[0]['what']}\n{bad[0]['outcome']}"
    if proc is None or proc.returncode != 0 or len(done) != DICT_CASES + FILE_CASES:
        last = lines[-1] if lines else None
        raise AssertionError(f"the cases did not all end ({len(done)} did); the last begun: {last}; {ended}")
    outcomes = {o: sum(1 for r in done if r["outcome"] == o) for o in ("ok", "error")}
    # The mutations reach both ends: some cases still replay, some are refused.
    assert outcomes["ok"] >= 50 and outcomes["error"] >= 50, outcomes


def test_a_request_pyalloc_cannot_serve_uncapped_is_refused_not_reported_as_a_win():
    """Found by the mutations above: a 16 TiB request, past the virtual range a pool
    maps, was refused by the uncapped replay, which then reported 0 bytes reserved and
    pyalloc 'winning' against PyTorch's allocator."""
    import pytest

    from pyalloc.replay import replay
    from pyalloc.replay.snapshot_io import TraceError

    events = [{"action": "alloc", "addr": 1 << 40, "size": 1 << 20, "stream": 0},
              {"action": "alloc", "addr": 1 << 41, "size": 1 << 44, "stream": 0}]
    with pytest.raises(TraceError, match=r"<snapshot>: device 0: pyalloc refused 1 allocation\(s\) even on a device "
                                         r"of unbounded size, the first event 1 of 17592186044416 bytes"):
        replay({"segments": [], "device_traces": [events]}, search=False)
    # What it can serve still replays.
    r = replay({"segments": [], "device_traces": [events[:1]]}, search=False)
    assert r.pyalloc_peak_reserved_bytes >= r.peak_live_bytes == 1 << 20
