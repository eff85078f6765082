"""benchmarks/bench_oom_watch.py, what watching for out-of-memory errors costs: it runs
end to end on tiny sizes on CPU (no timing is asserted), the out-of-memory error it
injects into a trace without one is where it says and of the capacity it says, and its
GPU mode refuses cleanly where there is no GPU."""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys

import pytest

import pyalloc
from pyalloc import _C
from pyalloc.replay import plan_trace, replay_devices
from pyalloc.replay.snapshot_io import read_trace, write_snapshot

from benchmarks import bench_oom_watch as bench

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_oom_watch.py")
TRACE = os.path.join(REPO, "benchmarks", "traces", "tiny-gpt-varlen-train.pickle.gz")
MiB = 1 << 20
TINY = ["--repeats", "1", "--pairs", "2000", "--entries", "500", "--passes", "1", "--memory-entries", "3000",
        "--file-entries", "300", "--verdict-repeats", "1"]


def _run(args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))


def _pools_snapshot(path):
    """A snapshot of pyalloc's own pools on a fake device, segments and all: what a run
    under pyalloc with its history recorded leaves (no oom event)."""
    _C._testing_use_fake_devices(1 << 30)
    try:
        pyalloc.record_history(True, 10_000)
        live = [_C._testing_hook_malloc(size * MiB, 0, 0) for size in (3, 30, 5, 12)]
        free = bench.hook_free()
        free(live.pop(1))
        live.append(_C._testing_hook_malloc(40 * MiB, 0, 0))
        for p in live:
            free(p)
        write_snapshot(pyalloc.snapshot(), path)
    finally:
        pyalloc.record_history(False)
        _C._testing_reset()


def test_it_runs_end_to_end_on_tiny_sizes(tmp_path):
    traces = tmp_path / "traces"
    (traces / "sub").mkdir(parents=True)
    shutil.copy(TRACE, traces / "sub")
    _pools_snapshot(str(traces / "pools.pickle"))
    out = tmp_path / "r.json"
    run = _run(TINY + ["--traces", str(traces), "--out", str(out)])
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    env = data["environment"]
    assert env["command"] == " ".join(["python", "benchmarks/bench_oom_watch.py", *TINY, "--traces", str(traces),
                                       "--out", str(out)])
    assert env["torch"] and env["cpu"] and env["git_commit"]
    assert [r["case"].split(",")[0] for r in data["rates"]] == [
        "device pools via C hooks", "device pools via bridge's C table", "tiny-gpt-varlen-train calls",
        "tiny-gpt-varlen-train calls through the C hooks"]
    for row in data["rates"]:
        assert row["ns_off_best"] > 0 and row["ns_on_best"] > 0 and row["repeats"] == 1, row
        allocs_per = 1 if row["per"] == "pair" else data["trace"]["allocs"] / data["trace"]["calls"]
        for side in ("off", "on"):  # ns rounded to 0.1 ns: within a percent
            made = row[f"allocations_per_second_{side}_best"] * row[f"ns_{side}_best"] / 1e9
            assert abs(made - allocs_per) < 0.01 * allocs_per, row
        assert row["case"] in run.stdout
    core, hooks = data["rates"][2:]
    assert core["passes"] == 10 and core["iterations"] == 10 * data["trace"]["calls"]
    assert hooks["passes"] == 1 and hooks["iterations"] == data["trace"]["calls"]
    # A ring of 500 is full before the first pass ends: its events per allocation are not all there.
    assert core["events_per_alloc"] is None
    [memory] = data["history_bytes"]
    assert memory["ring_entries"] == 3000 and memory["resident_growth_bytes"] >= 0
    assert memory["events_per_allocation"] == 3  # alloc, free_requested, free_completed
    assert memory["file_events"] == 300 and memory["file_bytes_per_event"] > 0
    # The trace with the most events is the bundled one, which records no segments; the
    # one with segments is timed beside it, each with an oom event injected.
    verdict = data["verdict"]
    assert verdict["traces_found"] == 2
    first, second = verdict["rows"]
    assert first["trace"] == os.path.join("sub", "tiny-gpt-varlen-train.pickle.gz") and first["events"] == 40716
    assert first["injected_oom"]["capacity_bytes"] is None and second["trace"] == "pools.pickle"
    assert second["injected_oom"]["capacity_bytes"] is not None
    for row in (first, second):
        assert row["child_exit"] == 0 and row["seconds_best"] > 0 and row["lines"], row
        assert row["lines"][0].startswith("with-oom-") and "allocation" in row["lines"][0]
        assert row["lines"][0] in run.stdout
        # The watcher's child says the same lines.
        assert row["watcher_child_exit"] == 0 and row["watcher_child_seconds"] > 0, row
        assert row["watcher_child_output"][0] == "pyalloc oom: " + row["lines"][0], row
    assert "fragmentation" in " ".join(second["lines"])
    assert "no oom event recorded: one injected" in run.stdout


def test_the_injected_oom_comes_after_the_peak_and_does_not_fit_what_was_free(tmp_path):
    source = str(tmp_path / "pools.pickle")
    _pools_snapshot(source)
    copy = str(tmp_path / "with-oom.pickle")
    path, device, injected = bench.with_oom(source, copy)
    assert path == copy and device == 0
    trace = read_trace(source)
    plan = plan_trace(trace)
    assert injected["event"] == plan.events[plan.peak_live_op] + 1
    assert injected["size_bytes"] == 80 * MiB  # twice the largest allocation (40 MiB), in 2 MiB steps
    assert injected["device_free_bytes"] < injected["size_bytes"]  # the driver could not have served it
    assert injected["capacity_bytes"] == injected["recorded_reserved_bytes"] + injected["device_free_bytes"]
    [oom] = replay_devices(copy, device=0, search=False, progress=False)[0].recorded_ooms
    assert oom["event"] == injected["event"] and oom["size_bytes"] == injected["size_bytes"]
    assert oom["live_bytes"] == plan.peak_live_bytes and oom["capacity_bytes"] == injected["capacity_bytes"]
    # A trace that recorded an oom event is timed as it is.
    assert bench.with_oom(copy, str(tmp_path / "again.pickle")) == (copy, 0, None)
    assert not os.path.exists(tmp_path / "again.pickle")


@pytest.mark.skipif(bench.gpu_available()[0], reason="a CUDA GPU is here")
def test_the_gpu_mode_refuses_cleanly_without_a_gpu(tmp_path):
    out = tmp_path / "r.json"
    run = _run(["--device", "cuda", "--out", str(out)], timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("--device cuda needs a CUDA GPU: "), run.stderr
    assert "Traceback" not in run.stderr and not out.exists()


@pytest.mark.parametrize("args, said", [
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--memory-entries", "-1"], "--memory-entries must be at least 1"),
    (["--trace", "no-such.pickle"], "--trace no-such.pickle: no such file"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_are_refused_by_name(args, said, tmp_path):
    run = _run(args + ["--out", str(tmp_path / "r.json")], timeout=120)
    assert run.returncode == 2 and said in run.stderr, run.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_gpu_recordings_are_ones_torch_takes():
    torch = pytest.importorskip("torch")
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"context", "stacks", "max_entries"} <= set(params)
    # context None records no stack frames, "alloc" each allocation's Python frames (no
    # C++ unwinding): as the watcher arms it, without and with --frames.
    assert [kw for _, kw in bench.TORCH_RECORDINGS] == [{"context": None, "stacks": "python"},
                                                        {"context": "alloc", "stacks": "python"}]
    for _, kw in bench.TORCH_RECORDINGS:
        inspect.signature(torch.cuda.memory._record_memory_history).bind(enabled="all", max_entries=10, **kw)
    assert [name for name, _ in bench.GPU_ALLOCATORS] == ["native", "native_expandable", "pyalloc"]
    assert dict(bench.GPU_ALLOCATORS)["native_expandable"] == "expandable_segments:True"


def test_the_gpu_session_has_a_stage_that_runs_it():
    from benchmarks.gpu import session

    stage = session.stage_named("oom_watch")
    assert not stage.in_window and stage.limit_s + session.BUILD_LIMIT_S <= session.COMMAND_LIMIT_S
    [step] = stage.steps("/out")
    assert step.argv[1:5] == ["-m", "benchmarks.bench_oom_watch", "--device", "cuda"]
    assert step.argv[step.argv.index("--out") + 1] == "/out/oom_watch.json"


class _FakeTorch:
    """The torch entry points the GPU mode's worker uses, without a GPU: torch.empty's
    tensors are recorded as PyTorch's history records them (alloc, then free_requested
    and free_completed when dropped, in a ring of max_entries) while
    _record_memory_history, whose arguments are checked against the real one's
    signature, has it on; under pyalloc they are served by its pools on a fake device
    through the C hooks, which pyalloc.record_history records."""

    uint8 = "uint8"
    __version__ = "0.0-fake"

    def __init__(self, real):
        from collections import deque
        from types import SimpleNamespace

        self.real, self.pools, self.ring = real, False, None
        self._deque = deque
        memory = SimpleNamespace(_record_memory_history=self._record, _snapshot=self._snapshot)
        self.cuda = SimpleNamespace(get_device_name=lambda i: "fake GPU", synchronize=lambda: None, memory=memory)
        self.version = SimpleNamespace(cuda="12.0")
        self.free = bench.hook_free()

    def device(self, kind, index):
        return (kind, index)

    def _record(self, *args, **kwargs):
        bound = inspect.signature(self.real.cuda.memory._record_memory_history).bind(*args, **kwargs)
        bound.apply_defaults()
        enabled, max_entries = bound.arguments["enabled"], bound.arguments["max_entries"]
        self.ring = None if enabled is None else self._deque(maxlen=max_entries)

    def _snapshot(self):
        return {"segments": [], "device_traces": [list(self.ring or [])]}

    def _event(self, action, size):
        if self.ring is not None:
            self.ring.append({"action": action, "addr": 0, "size": size, "stream": 0, "time_us": 0, "frames": []})

    def empty(self, size, dtype=None, device=None):
        fake = self

        class Tensor:
            def __init__(self):
                self.ptr = _C._testing_hook_malloc(size, 0, 0) if fake.pools else 0
                fake._event("alloc", size)

            def __del__(self):
                if self.ptr:
                    fake.free(self.ptr)
                fake._event("free_requested", size)
                fake._event("free_completed", size)

        return Tensor()


@pytest.mark.parametrize("allocator", ["native", "pyalloc"])
def test_the_gpu_workers_logic_against_a_fake_torch(allocator, monkeypatch):
    real = pytest.importorskip("torch")
    fake = _FakeTorch(real)
    monkeypatch.setitem(sys.modules, "torch", fake)
    if allocator == "pyalloc":
        def install():
            _C._testing_use_fake_devices(1 << 40)
            fake.pools = True
        monkeypatch.setattr(pyalloc, "install", install)
        monkeypatch.setattr(pyalloc, "is_installed", lambda: "hooks")
    try:
        base = {"allocator": allocator, "trace": TRACE}
        speed = bench.worker(dict(base, what="speed", repeats=2, pairs=200, entries=400))
        assert fake.ring is None  # every recording turned off after its turn
        memory = bench.worker(dict(base, what="memory", recording=bench.gpu_recordings(allocator)[-1][0],
                                   entries=300))
    finally:
        if fake.pools:
            pyalloc.record_history(False)
            _C._testing_reset()
    recordings = [name for name, _ in bench.gpu_recordings(allocator)]
    assert [r["case"] for r in speed["rows"]] == [
        f"{allocator}, {what}, {name}" for name in recordings
        for what in ("4 KiB torch.empty/del pairs", "tiny-gpt-varlen-train calls as torch.empty/del")]
    for row in speed["rows"]:
        assert row["repeats"] == 2 and row["ns_off_best"] > 0 and row["ns_on_best"] > 0, row
    assert speed["pyalloc_route"] == ("hooks" if allocator == "pyalloc" else None)
    assert speed["device"] == "fake GPU"
    # 300 pairs, three events each, into a ring of 300: full, as pickled.
    mem = memory["memory"]
    assert mem["ring_entries"] == 300 and mem["file_events"] == 300 and mem["file_bytes_per_event"] > 0
    assert mem["case"] == f"{allocator}, {recordings[-1]}"


def test_a_ring_that_holds_a_pass_counts_its_events_per_allocation():
    row = bench.trace_in_core(bench.Calls(TRACE), repeats=1, entries=1_000_000, passes=2)
    # alloc, free_requested and free_completed for each, and the segments' events.
    assert 2.9 < row["events_per_alloc"] < 3.5, row
    assert row["iterations"] == 2 * len(bench.Calls(TRACE))
