"""What watching for out-of-memory errors costs: allocations per second with the
allocator's history recorded against not, the bytes of history kept per
allocation, and the wall time of a verdict on the largest recorded trace.

    python benchmarks/bench_oom_watch.py [--repeats R] [--pairs N] [--entries N]
                                         [--trace FILE] [--traces DIR]
    python benchmarks/bench_oom_watch.py --device cuda [...]     # on a GPU

Writes benchmarks/results/bench_oom_watch.json (``--device cuda``:
bench_oom_watch-cuda.json) with the environment record, and prints a table.

On CPU (the default), pyalloc's CUDA pools over a fake device (host memory, no
GPU), with ``pyalloc.record_history(True, N)`` against off:
  1. allocations per second, best and median of the repeats, off and on in turn:
     - device pools, C++ loop: 4 KiB malloc+free pairs through the C hooks and
       through the bridge's C table (``_C.bench_device_pairs``: no Python in the loop);
     - trace calls, C++ loop: the calls of a recorded trace (``--trace``, a
       realistic mix of sizes and lifetimes) replayed through the core allocator
       (``_C.Replayer``, the virtual backend: the same history code), 10 x
       ``--passes`` times over, so that the ring fills and turns;
     - trace calls through the C hooks: the same calls ``--passes`` times over,
       each a call from Python into the hooks (``_C._testing_hook_malloc``,
       ``pyalloc_free``), on stream 0; Python's cost per call is in both columns,
       so the difference is the history's;
  2. bytes of history, in a fresh process: its resident memory growth, and
     malloc's (glibc's mallinfo2), while a ring of ``--memory-entries`` events
     fills (with more events than that: it ends full), divided by the events
     kept; and the bytes per event of the snapshot file
     ``pyalloc.dump_snapshot`` writes (a plain pickle, no stack frames) of a
     ring of ``--file-entries``;
  3. the verdict: what the out-of-memory watcher's child process runs,
     ``pyalloc.replay.replay_devices(path, device=D, search=False)`` and the
     verdict's lines, on the trace of ``--traces`` (default ../shared/traces,
     recursively) with the most events, and on the one with the most events of
     those that record their segments (only there is the recording allocator's
     capacity known, so only there are the allocators replayed to the error). A
     trace with no oom event gets one injected after its peak of live bytes: a
     request of twice its largest allocation with half of that free on the
     device (capacity = recorded reserved + free); the output says so. Timed in
     this process, as a child process (interpreter start included), and as the
     watcher's own child command, ``python -m pyalloc._oom_verdict FILE --device D
     --timeout T``.

With ``--device cuda`` (needs a CUDA GPU), each allocator in a fresh process of
its own (PyTorch reads its allocator setting once): PyTorch's default, with
``expandable_segments:True``, and pyalloc (``pyalloc.install()``). In each,
``torch.empty`` / ``del`` loops (4 KiB pairs, and the trace's calls) with the
history off and on in turn: for PyTorch ``torch.cuda.memory._record_memory_history(
max_entries=N)`` as the watcher arms it, without stack frames (``context=None``)
and with Python frames (``context="alloc"``: ``pyalloc oom --frames``), for
pyalloc ``pyalloc.record_history(True, N)``. Then, each recording in a fresh
process, the memory growth while its ring (``--memory-entries``) fills, per
event, and the snapshot file's bytes per event (the snapshot pickled, as
``_dump_snapshot`` / ``pyalloc.dump_snapshot`` write it). The verdict is timed as
on CPU.
Performance is never asserted: tests/bench/test_bench_oom_watch.py runs this on
tiny sizes.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import RESULTS, environment  # noqa: E402

import pyalloc  # noqa: E402
from pyalloc import _C  # noqa: E402
from pyalloc.oom_watch import HISTORY_ENTRIES, VERDICT_TIMEOUT  # noqa: E402
from pyalloc.replay import plan_trace, replay_devices  # noqa: E402
from pyalloc.replay.oom import recorded_reserved_at  # noqa: E402
from pyalloc.replay.report import format_verdict  # noqa: E402
from pyalloc.replay.snapshot_io import device_traces, load_snapshot, read_trace, write_snapshot  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KiB, MiB = 1 << 10, 1 << 20
#: The trace whose calls make the realistic mix (it ships with the repository).
DEFAULT_TRACE = os.path.join(HERE, "traces", "tiny-gpt-varlen-train.pickle.gz")
SHARED_TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
#: Where the verdict's trace is looked for: ../shared/traces beside the checkout, else
#: the traces that ship with it (a GPU machine's copy of the tree has only those).
DEFAULT_TRACES = SHARED_TRACES if os.path.isdir(SHARED_TRACES) else os.path.join(HERE, "traces")
#: A fake device large enough for any shared trace's peak (its memory is never touched).
FAKE_DEVICE_BYTES = 1 << 40
#: The ring the watcher records (pyalloc oom --history's default).
DEFAULT_ENTRIES = HISTORY_ENTRIES
#: PyTorch's recordings timed on a GPU, (label, _record_memory_history keywords): the two
#: the watcher arms (pyalloc/oom_watch.py), without frames and with --frames.
TORCH_RECORDINGS = (("no frames", {"context": None, "stacks": "python"}),
                    ("python frames", {"context": "alloc", "stacks": "python"}))
#: The allocators of the GPU mode: (name, the PYTORCH_CUDA_ALLOC_CONF of its process).
GPU_ALLOCATORS = (("native", ""), ("native_expandable", "expandable_segments:True"), ("pyalloc", ""))
#: What the GPU mode's workers must not inherit: each sets its own allocator.
OWNED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYALLOC_CONF")


# -- figures ------------------------------------------------------------------------------


def best_median(values: List[float]) -> Tuple[float, float]:
    return min(values), statistics.median(values)


def rate_row(case: str, ns_off: List[float], ns_on: List[float], per: str, allocs_per: float = 1.0,
             **extra: Any) -> Dict[str, Any]:
    """One case's figures: ns per `per` (a pair or a call, of which `allocs_per` are
    allocations) and allocations per second, best and median of the repeats, off and
    on; the added cost from the best of each."""
    off_best, off_med = best_median(ns_off)
    on_best, on_med = best_median(ns_on)
    return {"case": case, "per": per, "repeats": len(ns_off),
            "ns_off_best": round(off_best, 1), "ns_off_median": round(off_med, 1),
            "ns_on_best": round(on_best, 1), "ns_on_median": round(on_med, 1),
            "allocations_per_second_off_best": round(allocs_per * 1e9 / off_best),
            "allocations_per_second_on_best": round(allocs_per * 1e9 / on_best),
            "added_ns_best": round(on_best - off_best, 1), "slowdown_best": round(on_best / off_best, 3),
            "slowdown_median": round(on_med / off_med, 3), **extra}


def resident_bytes() -> int:
    """The process's resident memory (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> Optional[int]:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: in use in its
    arenas plus its mmapped chunks), whether or not the pages are resident; None
    without glibc 2.33+. Resident memory misses a ring that reuses memory freed
    before it; this does not."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


def growth(before: Tuple[int, Optional[int]], events: int) -> Dict[str, Any]:
    """What the process gained since `before` (resident_bytes(), heap_bytes()), in all
    and per event kept."""
    resident, heap = resident_bytes() - before[0], None if before[1] is None else heap_bytes() - before[1]
    return {"resident_growth_bytes": resident, "resident_bytes_per_event": round(resident / events, 1),
            "heap_growth_bytes": heap, "heap_bytes_per_event": None if heap is None else round(heap / events, 1)}


# -- the calls of a trace -----------------------------------------------------------------


class Calls:
    """A trace's allocator calls: kinds (1 alloc, 2 free), ids, sizes, streams."""

    def __init__(self, path: str) -> None:
        trace = read_trace(path)
        plan = plan_trace(trace)
        base = os.path.basename(path)
        self.name, self.events = base[:base.index(".pickle")] if ".pickle" in base else base, len(trace)
        self.kinds, self.ids, self.sizes, self.streams = plan.kinds, plan.ids, plan.sizes, plan.streams
        self.allocs, self.peak_live_bytes = plan.allocs, plan.peak_live_bytes

    def __len__(self) -> int:
        return len(self.kinds)

    def replay(self, malloc: Callable[[int], Any], free: Callable[[Any], None]) -> float:
        """Runs every call through malloc(size) / free(handle), then frees what is left;
        the seconds the calls took."""
        live: Dict[int, Any] = {}
        start = time.perf_counter()
        for kind, id_, size in zip(self.kinds, self.ids, self.sizes):
            if kind == 1:
                live[id_] = malloc(size)
            else:
                free(live.pop(id_))
        seconds = time.perf_counter() - start
        for handle in live.values():
            free(handle)
        return seconds


# -- CPU: pyalloc's pools over a fake device ------------------------------------------------


@contextlib.contextmanager
def fake_device(history: int = 0):
    """Device 0's pools on a fake device, as installed (captures announced as the bridge
    does), recording `history` events (0: off)."""
    _C._testing_use_fake_devices(FAKE_DEVICE_BYTES)
    _C.cuda_set_told_of_captures(True)
    try:
        if history:
            pyalloc.record_history(True, history)
        yield
    finally:
        pyalloc.record_history(False)
        _C._testing_reset()


def hook_free() -> Callable[[int], None]:
    """pyalloc_free, the C hook PyTorch's pluggable allocator calls, as tests/cuda does."""
    lib = ctypes.CDLL(_C.library_path())
    fn = lib.pyalloc_free
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    fn.restype = None
    return lambda ptr: fn(ptr, 0, 0, None)


def device_pairs(via: str, pairs: int, repeats: int, entries: int) -> Dict[str, Any]:
    ns: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(repeats):
        for on in (False, True):  # in turn, so that the machine's moods fall on both
            with fake_device(entries if on else 0):
                _C.bench_device_pairs(via, 4 * KiB, max(100, pairs // 10))  # warm; fills the ring
                ns[on].append(_C.bench_device_pairs(via, 4 * KiB, pairs) * 1e9 / pairs)
    label = "C hooks" if via == "hooks" else "bridge's C table"
    return rate_row(f"device pools via {label}, 4 KiB pairs, C++ loop", ns[False], ns[True], "pair",
                    iterations=pairs)


def trace_in_core(calls: Calls, repeats: int, entries: int, passes: int) -> Dict[str, Any]:
    """The trace's calls `passes` times over in a row (the ring fills and turns, as in a
    long run) through one core allocator a repeat, each pass a Replayer of its own."""
    replay = _C.ReplayTrace(calls.kinds, calls.ids, calls.sizes, calls.streams)
    ns: Dict[bool, List[float]] = {False: [], True: []}
    per_alloc = None
    for _ in range(repeats):
        for on in (False, True):
            allocator = _C.Allocator("virtual", "", 0)
            if on:
                allocator.record_history(True, entries)
            seconds = 0.0
            for n in range(passes):
                run = _C.Replayer(allocator, replay, False, 0)
                run.run()
                seconds += run.seconds
                if on and n == 0 and per_alloc is None:
                    kept = len(allocator.history())
                    per_alloc = round(kept / calls.allocs, 2) if kept < entries else None
            ns[on].append(seconds * 1e9 / (passes * len(calls)))
    return rate_row(f"{calls.name} calls, core allocator, C++ loop", ns[False], ns[True], "call",
                    calls.allocs / len(calls), iterations=passes * len(calls), passes=passes,
                    events_per_alloc=per_alloc)


def trace_through_hooks(calls: Calls, repeats: int, entries: int, passes: int) -> Dict[str, Any]:
    """The trace's calls `passes` times over through the C hooks, after one pass untimed
    (the pools' cache as the trace leaves it)."""
    free = hook_free()
    hook_malloc = _C._testing_hook_malloc
    malloc = lambda size: hook_malloc(size, 0, 0)  # noqa: E731
    ns: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(repeats):
        for on in (False, True):
            with fake_device(entries if on else 0):
                calls.replay(malloc, free)
                seconds = sum(calls.replay(malloc, free) for _ in range(passes))
                ns[on].append(seconds * 1e9 / (passes * len(calls)))
    return rate_row(f"{calls.name} calls through the C hooks, from Python", ns[False], ns[True], "call",
                    calls.allocs / len(calls), iterations=passes * len(calls), passes=passes)


def history_bytes(entries: int, file_entries: int, trace: str) -> Dict[str, Any]:
    """Resident memory per event while a ring of `entries` fills; a snapshot file's bytes
    per event for a ring of `file_entries` holding the trace's calls. Run in a fresh
    process (what earlier rings freed would be reused here, and no growth seen)."""
    with fake_device():
        _C.bench_device_pairs("hooks", 4 * KiB, 1000)  # the segment and the pools made first
        pyalloc.record_history(True, 30)
        _C.bench_device_pairs("hooks", 4 * KiB, 10)
        per_pair = len(_C.cuda_history(0, "general")) / 10
        pyalloc.record_history(False)
        before = resident_bytes(), heap_bytes()
        pyalloc.record_history(True, entries)
        # Three events a pair (alloc, free_requested, free_completed): `entries` pairs
        # leave the ring full, every one of its entries kept.
        _C.bench_device_pairs("hooks", 4 * KiB, entries)
        grown = growth(before, entries)
    free, calls = hook_free(), Calls(trace)
    with fake_device(file_entries), tempfile.TemporaryDirectory(prefix="bench-oom-watch-") as tmp:
        passes = 0
        while passes == 0 or len(_C.cuda_history(0, "general")) < file_entries and passes < 1000:
            calls.replay(lambda size: _C._testing_hook_malloc(size, 0, 0), free)
            passes += 1
        events = len(_C.cuda_history(0, "general"))
        path = os.path.join(tmp, "snapshot.pickle")
        pyalloc.dump_snapshot(path)
        plain = os.path.getsize(path)
        pyalloc.dump_snapshot(path + ".gz")
        packed = os.path.getsize(path + ".gz")
    per_event = grown["heap_bytes_per_event"] or grown["resident_bytes_per_event"]
    return {"case": "pyalloc.record_history", "ring_entries": entries, **grown, "events_per_allocation": per_pair,
            "bytes_per_allocation": round(per_event * per_pair, 1),
            "file_events": events, "file_of": f"{calls.name} calls, {passes} pass(es)", "file_bytes": plain,
            "file_bytes_per_event": round(plain / max(events, 1), 1),
            "gzip_file_bytes": packed, "gzip_file_bytes_per_event": round(packed / max(events, 1), 1)}


# -- the verdict ----------------------------------------------------------------------------


def find_traces(folder: str) -> List[Tuple[str, int, bool]]:
    """(path, events of its busiest device, whether it records segments) of every
    .pickle / .pickle.gz under folder, most events first."""
    found = []
    for base, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith((".pickle", ".pickle.gz")):
                path = os.path.join(base, name)
                snapshot = load_snapshot(path)
                events = max((len(t) for t in device_traces(snapshot)), default=0)
                found.append((path, events, bool(snapshot.get("segments"))))
    return sorted(found, key=lambda f: (-f[1], f[0]))


def with_oom(path: str, out: str) -> Tuple[str, int, Optional[Dict[str, int]]]:
    """The trace itself where it records an oom event; else a copy written to `out` with
    one injected after its peak of live bytes (see the module docstring). (path to time,
    the device, what was injected or None)."""
    trace = read_trace(path)
    if trace.ooms:
        return path, trace.device, None
    plan = plan_trace(trace)
    at = plan.events[plan.peak_live_op] + 1 if plan.peak_live_op >= 0 else 0
    largest = max(plan.sizes, default=MiB)
    size = -(-2 * largest // (2 * MiB)) * (2 * MiB)
    free = size // 2  # less than the request: the driver could not have served it, no cap in force
    reserved = recorded_reserved_at(trace, plan.native_start_bytes, [at])[0]
    snapshot = load_snapshot(path)
    entries = device_traces(snapshot)[trace.device]
    time_us = entries[at - 1].get("time_us", 0) if at > 0 else 0
    entries.insert(at, {"action": "oom", "addr": free, "size": size, "stream": 0, "time_us": time_us,
                        "device_free": free, "frames": []})
    write_snapshot(snapshot, out)
    injected = {"event": at, "size_bytes": size, "device_free_bytes": free,
                "recorded_reserved_bytes": reserved,
                "capacity_bytes": None if reserved is None else reserved + free}
    return out, trace.device, injected


def verdict_lines(path: str, device: int) -> List[str]:
    """What the watcher's child prints: the replay, then the out-of-memory lines."""
    return format_verdict(replay_devices(path, device=device, search=False, progress=False), path)


def timed_child(argv: List[str], timeout: float) -> Tuple[float, int, str]:
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env())
    return time.perf_counter() - start, run.returncode, (run.stdout + run.stderr).strip()


def child_env(conf: Optional[str] = None) -> Dict[str, str]:
    """This checkout's pyalloc for a child; `conf`: its PYTORCH_CUDA_ALLOC_CONF, the
    environment's allocator settings dropped (GPU mode; None: the environment as it is)."""
    env = {k: v for k, v in os.environ.items() if conf is None or k not in OWNED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return env


def verdict_timing(path: str, name: str, events: int, repeats: int, tmp: str) -> Dict[str, Any]:
    base = os.path.basename(path)
    copy = os.path.join(tmp, "with-oom-" + (base[:-3] if base.endswith(".gz") else base))  # a plain pickle
    timed, device, injected = with_oom(path, copy)
    seconds, lines = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        lines = verdict_lines(timed, device)
        seconds.append(time.perf_counter() - start)
    child, rc, said = timed_child([sys.executable, os.path.abspath(__file__), "--verdict-of", timed,
                                   "--trace-device", str(device)], VERDICT_TIMEOUT)
    row = {"trace": name, "events": events, "device": device, "injected_oom": injected,
           "seconds_best": round(min(seconds), 3), "seconds_median": round(statistics.median(seconds), 3),
           "repeats": repeats, "child_seconds": round(child, 3), "child_exit": rc, "lines": lines}
    if rc != 0:
        row["child_output"] = said[-2000:]
    # The watcher's own child, as pyalloc oom and watch_oom() start it (it writes the verdict
    # beside the copy, in the temporary folder).
    took, rc, said = timed_child([sys.executable, "-m", "pyalloc._oom_verdict", timed, "--device", str(device),
                                  "--timeout", str(VERDICT_TIMEOUT)], VERDICT_TIMEOUT + 60)
    row.update(watcher_child_seconds=round(took, 3), watcher_child_exit=rc,
               watcher_child_output=said.splitlines()[-12:])
    return row


def verdicts(folder: str, repeats: int) -> Dict[str, Any]:
    traces = find_traces(folder) if os.path.isdir(folder) else []
    if not traces:
        return {"traces": folder, "rows": [], "note": f"no trace under {folder}"}
    chosen = [traces[0]]
    with_segments = [t for t in traces if t[2]]
    if with_segments and with_segments[0] is not traces[0]:
        chosen.append(with_segments[0])
    with tempfile.TemporaryDirectory(prefix="bench-oom-watch-") as tmp:
        rows = [verdict_timing(path, os.path.relpath(path, folder), events, repeats, tmp) for path, events, _ in chosen]
    rows[0]["why"] = "the most events"
    if len(rows) > 1:
        rows[1]["why"] = "the most events of the traces that record their segments"
    return {"traces": _shown(folder), "traces_found": len(traces), "rows": rows}


def _shown(folder: str) -> str:
    """The folder as the checkout sees it: ../shared/traces, benchmarks/traces, or as given."""
    full = os.path.abspath(folder)
    if full == SHARED_TRACES:
        return os.path.join("..", "shared", "traces")
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else folder


# -- GPU: torch.empty / del under each allocator, each in its own process -------------------


def torch_version() -> Optional[str]:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def gpu_available() -> Tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if torch.version.cuda is None:
        return False, f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False: no CUDA GPU here"
    return True, torch.cuda.get_device_name(0)


def gpu_recordings(allocator: str) -> List[Tuple[str, Dict[str, Any]]]:
    """The recordings timed under `allocator`: PyTorch's two, or pyalloc's one."""
    return [("pyalloc.record_history", {})] if allocator == "pyalloc" else list(TORCH_RECORDINGS)


def gpu_record(allocator: str, label: str, entries: int) -> None:
    """Turns the recording `label` on (entries > 0) or off, for the allocator in use."""
    import torch

    if allocator == "pyalloc":
        pyalloc.record_history(entries > 0, entries or DEFAULT_ENTRIES)
    elif entries:
        torch.cuda.memory._record_memory_history(enabled="all", max_entries=entries, **dict(TORCH_RECORDINGS)[label])
    else:
        torch.cuda.memory._record_memory_history(None)


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """What a fresh process of this script measures: on CPU, pyalloc's history's bytes
    (spec["what"] == "cpu memory"); on a GPU, under spec["allocator"], the speed of every
    recording ("speed") or the memory of one ("memory", spec["recording"])."""
    if spec["what"] == "cpu memory":
        return history_bytes(spec["entries"], spec["file_entries"], spec["trace"])
    import torch

    allocator = spec["allocator"]
    if allocator == "pyalloc":
        pyalloc.install()
    dev = torch.device("cuda", 0)
    torch.empty(1, device=dev)  # the context and the allocator made
    calls = Calls(spec["trace"])

    def empty(size: int):
        return torch.empty(size, dtype=torch.uint8, device=dev)

    def pairs(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            t = torch.empty(4096, dtype=torch.uint8, device=dev)
            del t
        return time.perf_counter() - start

    out: Dict[str, Any] = {"allocator": allocator, "device": torch.cuda.get_device_name(0),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                           "pyalloc_route": pyalloc.is_installed() if allocator == "pyalloc" else None}
    if spec["what"] == "speed":
        recordings = [("off", None)] + gpu_recordings(allocator)
        ns: Dict[str, Dict[str, List[float]]] = {label: {"pairs": [], "trace": []} for label, _ in recordings}
        calls.replay(empty, lambda t: None)  # warm: the cache as the trace leaves it
        for _ in range(spec["repeats"]):
            for label, _ in recordings:  # in turn, so that the machine's moods fall on each
                gpu_record(allocator, label, 0 if label == "off" else spec["entries"])
                torch.cuda.synchronize()
                ns[label]["pairs"].append(pairs(spec["pairs"]) * 1e9 / spec["pairs"])
                ns[label]["trace"].append(calls.replay(empty, lambda t: None) * 1e9 / len(calls))
                gpu_record(allocator, label, 0)
        rows = []
        for label, _ in recordings[1:]:
            rows.append(rate_row(f"{allocator}, 4 KiB torch.empty/del pairs, {label}", ns["off"]["pairs"],
                                 ns[label]["pairs"], "pair", iterations=spec["pairs"]))
            rows.append(rate_row(f"{allocator}, {calls.name} calls as torch.empty/del, {label}",
                                 ns["off"]["trace"], ns[label]["trace"], "call", calls.allocs / len(calls),
                                 iterations=len(calls)))
        out["rows"] = rows
        return out
    label, entries = spec["recording"], spec["entries"]
    pairs(1000)
    before = resident_bytes(), heap_bytes()
    gpu_record(allocator, label, entries)
    pairs(entries)  # at least one event a pair: the ring ends full
    grown = growth(before, entries)
    # What _dump_snapshot and pyalloc.dump_snapshot write: the snapshot, pickled.
    snapshot = pyalloc.snapshot() if allocator == "pyalloc" else torch.cuda.memory._snapshot()
    events = sum(len(t) for t in snapshot["device_traces"])
    with tempfile.TemporaryDirectory(prefix="bench-oom-watch-") as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        write_snapshot(snapshot, path)
        size = os.path.getsize(path)
    out["memory"] = {"case": f"{allocator}, {label}", "ring_entries": entries, **grown, "file_events": events,
                     "file_bytes": size, "file_bytes_per_event": round(size / max(events, 1), 1)}
    return out


def run_worker(spec: Dict[str, Any], conf: Optional[str], timeout: float) -> Dict[str, Any]:
    """Runs worker(spec) in a fresh process of this script; its result, or {"error": ...}.
    `conf`: the PYTORCH_CUDA_ALLOC_CONF it gets (None: the environment's)."""
    with tempfile.TemporaryDirectory(prefix="bench-oom-watch-") as tmp:
        result = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), "--result", result]
        try:
            run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                 env=child_env(conf))
        except subprocess.TimeoutExpired:
            return dict(spec, error=f"no result within {timeout:.0f} s")
        if run.returncode != 0 or not os.path.exists(result):
            return dict(spec, error=f"exit {run.returncode}: {run.stderr.strip()[-1500:]}")
        with open(result) as f:
            return json.load(f)


def gpu_figures(args: argparse.Namespace) -> Dict[str, Any]:
    speed, memory, failures, about = [], [], [], {}
    for allocator, conf in GPU_ALLOCATORS:
        base = {"allocator": allocator, "trace": args.trace}
        done = run_worker(dict(base, what="speed", repeats=args.repeats, pairs=args.pairs, entries=args.entries),
                          conf, args.worker_timeout)
        if "error" in done:
            failures.append(done)
        else:
            speed += done["rows"]
            about = {k: done[k] for k in ("device", "torch", "torch_cuda")}
            if allocator == "pyalloc":
                about["pyalloc_route"] = done["pyalloc_route"]
        for label, _ in gpu_recordings(allocator):
            done = run_worker(dict(base, what="memory", recording=label, entries=args.memory_entries), conf,
                              args.worker_timeout)
            if "error" in done:
                failures.append(done)
            else:
                memory.append(done["memory"])
    return {"gpu": about, "rates": speed, "history_bytes": memory, "failures": failures}


# -- command line ---------------------------------------------------------------------------


def print_table(data: Dict[str, Any]) -> None:
    rows = data["rates"]
    if rows:
        width = max(len(r["case"]) for r in rows)
        print(f"{'allocations, history off against on':<{width}}  {'ns off':>8}  {'ns on':>8}  "
              f"{'added':>7}  {'x best':>6}  {'x med':>6}  per   {'M allocs/s off':>14}  {'on':>6}")
        for r in rows:
            print(f"{r['case']:<{width}}  {r['ns_off_best']:>8.1f}  {r['ns_on_best']:>8.1f}  "
                  f"{r['added_ns_best']:>7.1f}  {r['slowdown_best']:>6.3f}  {r['slowdown_median']:>6.3f}  "
                  f"{r['per']:<4}  {r['allocations_per_second_off_best'] / 1e6:>14.2f}  "
                  f"{r['allocations_per_second_on_best'] / 1e6:>6.2f}")
        print(f"(ns per pair or call and allocations per second, best of {rows[0]['repeats']} repeats; x: on / off, "
              f"of the best and of the medians; ring of {data['entries']} entries)")
    mem = data["history_bytes"]
    for m in mem:
        line = f"history kept, {m['case']}, a ring of {m['ring_entries']}: "
        if m["heap_bytes_per_event"] is not None:
            line += f"{m['heap_bytes_per_event']:.1f} heap bytes an event ({m['heap_growth_bytes'] / MiB:.1f} MiB), "
        line += f"{m['resident_bytes_per_event']:.1f} resident ({m['resident_growth_bytes'] / MiB:.1f} MiB)"
        if "events_per_allocation" in m:
            line += f"; {m['bytes_per_allocation']:.0f} an allocation ({m['events_per_allocation']:g} events)"
        print(line)
        line = (f"  snapshot file: {m['file_bytes_per_event']:.1f} bytes an event ({m['file_events']} events"
                + (f" of {m['file_of']}" if "file_of" in m else ""))
        if "gzip_file_bytes_per_event" in m:
            line += f"; gzip {m['gzip_file_bytes_per_event']:.1f}"
        print(line + ")")
    for row in data["verdict"].get("rows", []):
        injected = row["injected_oom"]
        print(f"verdict on {row['trace']} ({row['events']} events, device {row['device']}; {row['why']}): "
              f"{row['seconds_best']:.2f} s in process (median {row['seconds_median']:.2f}), "
              f"{row['child_seconds']:.2f} s as a child process, {row['watcher_child_seconds']:.2f} s as "
              "python -m pyalloc._oom_verdict")
        if injected:
            capacity = injected["capacity_bytes"]
            print(f"  no oom event recorded: one injected at event {injected['event']} (after the peak of live "
                  f"bytes), {injected['size_bytes'] / MiB:.0f} MiB asked with "
                  f"{injected['device_free_bytes'] / MiB:.0f} MiB free, capacity "
                  + ("unknown (no segments recorded)" if capacity is None else f"{capacity / MiB:.0f} MiB"))
        for line in row["lines"]:
            print("  | " + line)
    if data["verdict"].get("note"):
        print("verdict: " + data["verdict"]["note"])
    for f in data.get("failures", []):
        print(f"FAILED: {f.get('allocator', '')} {f.get('recording', f['what'])}: {f['error']}")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: pyalloc's pools over a fake device; cuda: torch on the GPU, each allocator in a process")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=None, help="malloc+free pairs a repeat of the pair loops "
                    "(default 1000000; GPU: torch.empty/del pairs, 100000)")
    ap.add_argument("--entries", type=int, default=DEFAULT_ENTRIES, help="the history's ring while timing")
    ap.add_argument("--passes", type=int, default=4, help="passes over the trace's calls a repeat from Python "
                    "(ten times as many in C++)")
    ap.add_argument("--memory-entries", type=int, default=None, help="the ring whose memory is measured "
                    "(default 1000000; GPU: 100000, each written as a snapshot file too)")
    ap.add_argument("--file-entries", type=int, default=DEFAULT_ENTRIES, help="the ring written as a snapshot file")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="the trace whose calls are the mix of sizes")
    ap.add_argument("--traces", default=DEFAULT_TRACES, help="where the verdict's trace is looked for")
    ap.add_argument("--verdict-repeats", type=int, default=3)
    ap.add_argument("--worker-timeout", type=float, default=240.0, help="GPU mode: seconds a worker process gets")
    ap.add_argument("--out", help="the JSON written (default: benchmarks/results/bench_oom_watch[-cuda].json)")
    ap.add_argument("--verdict-of", help=argparse.SUPPRESS)
    ap.add_argument("--trace-device", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pairs is None:  # torch.empty costs microseconds: a tenth keeps a GPU repeat near a second
        args.pairs = 100_000 if args.device == "cuda" else 1_000_000
    if args.memory_entries is None:  # on a GPU the ring is also written: a file of frames for each event
        args.memory_entries = 100_000 if args.device == "cuda" else 1_000_000
    for name in ("repeats", "pairs", "entries", "passes", "memory_entries", "file_entries", "verdict_repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.verdict_of or args.worker) and not os.path.isfile(args.trace):
        ap.error(f"--trace {args.trace}: no such file")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.verdict_of:  # the child whose wall time is a verdict's
        for line in verdict_lines(args.verdict_of, args.trace_device):
            print(line)
        return 0
    if args.worker:
        with open(args.result, "w") as f:
            json.dump(worker(json.loads(args.worker)), f)
        return 0
    data: Dict[str, Any] = {"environment": dict(environment(), torch=torch_version()), "device": args.device,
                            "entries": args.entries}
    if args.device == "cuda":
        ok, why = gpu_available()
        if not ok:
            print(f"--device cuda needs a CUDA GPU: {why}", file=sys.stderr)
            return 2
        data.update(gpu_figures(args))
    else:
        calls = Calls(args.trace)
        data["trace"] = {"name": calls.name, "events": calls.events, "calls": len(calls), "allocs": calls.allocs,
                         "peak_live_bytes": calls.peak_live_bytes}
        data["rates"] = [device_pairs("hooks", args.pairs, args.repeats, args.entries),
                         device_pairs("bridge_api", args.pairs, args.repeats, args.entries),
                         trace_in_core(calls, args.repeats, args.entries, args.passes * 10),
                         trace_through_hooks(calls, args.repeats, args.entries, args.passes)]
        memory = run_worker({"what": "cpu memory", "entries": args.memory_entries, "file_entries": args.file_entries,
                             "trace": args.trace}, None, args.worker_timeout)
        data["history_bytes"] = [] if "error" in memory else [memory]
        data["failures"] = [memory] if "error" in memory else []
    data["verdict"] = verdicts(args.traces, args.verdict_repeats)
    print_table(data)
    out = args.out or os.path.join(RESULTS, "bench_oom_watch" + ("-cuda" if args.device == "cuda" else "") + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(out)}")
    return 1 if data.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
