"""From an out-of-memory error to a snapshot and a verdict: ``pyalloc oom`` and
``pyalloc.watch_oom()`` (pyalloc/oom_watch.py, pyalloc/_oom_verdict.py).

pyalloc's own pools run on fake devices of host memory. PyTorch's allocator is
not there without a GPU, so its entry points (history recording, the OOM
observer, the snapshot, CUDA's lazy initialisation) are replaced by fakes that
behave as torch/cuda/memory.py and c10/cuda/CUDACachingAllocator.cpp say they
do; only the real driver is left for the GPU.
"""
from __future__ import annotations

import copy
import ctypes
import json
import os
import pickle
import re
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pyalloc
from pyalloc import _C, oom_watch
from pyalloc.__main__ import main as cli_main

MiB = 1 << 20
GiB = 1 << 30
SEG0, SEG1 = 0x7F0000000000, 0x7F1000000000
FIGURE = re.compile(r"\d+\.\d+ [KMGT]?i?B")


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    oom_watch._reset_for_tests()


def wait_for(path, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path


def wait_verdicts(watch, seconds=120.0):
    for proc in watch.verdicts:
        assert proc.wait(timeout=seconds) is not None


def verdict_files(snapshot):
    stem = str(snapshot)[: -len(".pickle")]
    return stem + ".verdict.txt", stem + ".verdict.json"


def replay_cli(path, capsys, tmp_path):
    """What `pyalloc replay FILE` prints for the file, and its --json rows."""
    capsys.readouterr()
    out = tmp_path / "replay.json"
    assert cli_main(["replay", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    return printed, json.loads(out.read_text())


# ---------------------------------------------------------------------------
# pyalloc's pools, on fake devices


@pytest.fixture
def lib():
    lib = ctypes.CDLL(_C.library_path())
    lib.pyalloc_free.restype = None
    lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def test_a_pyalloc_oom_leaves_a_snapshot_and_the_verdict_replay_gives(fake, lib, tmp_path, capfd):
    with pyalloc.watch_oom(tmp_path) as watch:  # fake devices: pyalloc's recorder
        assert watch.allocator == "pyalloc"
        held = [_C._testing_hook_malloc(10 * MiB, 0, 0) for _ in range(4)]
        for hole in (held.pop(2), held.pop(0)):  # a hole in each of two segments: fragmentation
            lib.pyalloc_free(hole, 0, 0, None)
        with pytest.raises(pyalloc.OutOfMemoryError):
            while True:
                held.append(_C._testing_hook_malloc(18 * MiB, 0, 0))
        assert watch.snapshots == [str(tmp_path / "oom-rank0-cuda0-1.pickle")]
        wait_verdicts(watch)
    [snapshot] = watch.snapshots
    with open(snapshot, "rb") as f:  # a plain pickle, as pytorch.org/memory_viz reads
        snap = pickle.load(f)
    meta = snap["pyalloc_oom"]
    assert meta["allocator"] == "pyalloc" and meta["device"] == 0 and meta["rank"] is None
    assert meta["device_total_bytes"] == 64 * MiB and meta["requested_bytes"] == 18 * MiB
    assert meta["pyalloc"] == pyalloc.__version__
    txt, js = verdict_files(snapshot)
    verdict = json.loads(Path(js).read_text())
    lines = Path(txt).read_text().splitlines()
    assert verdict["status"] == "done" and verdict["device"] == 0 and verdict["file"] == snapshot
    assert verdict["ooms"] and lines and lines[-1].endswith(f"pyalloc replay {snapshot}")
    assert verdict["ooms"][-1]["fragmentation"] is True and "fragmentation" in lines[0]
    err = capfd.readouterr().err
    assert f"pyalloc oom: out of memory on cuda:0: snapshot {snapshot};" in err
    for line in lines:
        assert f"pyalloc oom: {line}" in err  # the same lines, on stderr
    printed, rows = replay_cli(snapshot, capfd, tmp_path)
    assert verdict["ooms"] == rows[0]["recorded_ooms"]
    figures = FIGURE.findall("\n".join(lines))
    assert figures and all(f in printed for f in figures), (figures, printed)


def test_pyalloc_recording_stops_and_the_observer_goes_on_close(fake, tmp_path):
    watch = pyalloc.watch_oom(tmp_path, allocator="pyalloc")
    watch.close()
    with pytest.raises(pyalloc.OutOfMemoryError):
        _C._testing_hook_malloc(65 * MiB, 0, 0)
    assert watch.snapshots == [] and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# PyTorch's allocator, through fakes of its entry points


def event(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}


def segment(device, address, blocks):
    return {
        "device": device, "address": address, "total_size": sum(s for s, _ in blocks),
        "allocated_size": sum(s for s, st in blocks if st == "active_allocated"),
        "active_size": sum(s for s, st in blocks if st == "active_allocated"),
        "requested_size": sum(s for s, st in blocks if st == "active_allocated"),
        "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
        "frames": [],
        "blocks": [{"address": address + sum(b for b, _ in blocks[:i]), "size": s, "requested_size": s,
                    "state": st, "frames": []} for i, (s, st) in enumerate(blocks)],
    }


def torch_snapshot(pairs=0):
    """What torch.cuda.memory._snapshot() returns on two devices, device 1 having
    run out of memory: a 20 MiB segment, two 8 MiB blocks, the first freed, then a
    16 MiB request with 2 MiB free on the device; `pairs` more alloc/free pairs first."""
    t = iter(range(1, 10**9))
    dev1 = [event("segment_alloc", SEG1, 20 * MiB, next(t))]
    for _ in range(pairs):
        dev1 += [event("alloc", SEG1, 4 * MiB, next(t)), event("free_requested", SEG1, 4 * MiB, next(t)),
                 event("free_completed", SEG1, 4 * MiB, next(t))]
    dev1 += [event("alloc", SEG1, 8 * MiB, next(t)), event("alloc", SEG1 + 8 * MiB, 8 * MiB, next(t)),
             event("free_requested", SEG1, 8 * MiB, next(t)), event("free_completed", SEG1, 8 * MiB, next(t)),
             {"action": "oom", "device_free": 2 * MiB, "size": 16 * MiB, "stream": 0, "time_us": next(t),
              "frames": []}]
    dev0 = [event("segment_alloc", SEG0, 2 * MiB, 1), event("alloc", SEG0, 512, 2)]
    return {
        "segments": [segment(0, SEG0, [(512, "active_allocated"), (2 * MiB - 512, "inactive")]),
                     segment(1, SEG1, [(8 * MiB, "inactive"), (8 * MiB, "active_allocated"),
                                       (4 * MiB, "inactive")])],
        "device_traces": [dev0, dev1],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
    }


class FakeTorchCuda:
    """PyTorch's CUDA allocator entry points, as they behave on a GPU: calls made
    through torch.cuda._lazy_call wait for CUDA's initialisation (init()); the OOM
    observers get (device, bytes it tried to reserve, device total or the fraction's
    cap, device free) before OutOfMemoryError is raised."""

    def __init__(self, monkeypatch, snapshot, total=80 * GiB, free=2 * MiB):
        import torch

        self.torch, self.snapshot, self.total, self.free = torch, snapshot, total, free
        self.queued, self.history, self.observers = [], [], []
        self.initialized = False
        cuda = torch.cuda
        self.asked = 0  # devices asked for: the driver started
        monkeypatch.setattr(cuda, "is_available", self.is_available)
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(cuda, "_is_compiled", lambda: True)
        monkeypatch.setattr(cuda, "_lazy_call", self.lazy_call)
        monkeypatch.setattr(cuda.memory, "_record_memory_history", self.record_history)
        monkeypatch.setattr(cuda.memory, "_snapshot", self.take_snapshot)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "caching_allocator_alloc", self.malloc)
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self.observers.append,
                            raising=False)
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)

    def is_available(self):
        self.asked += 1
        return True

    def lazy_call(self, fn, **kwargs):
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def init(self):
        if not self.initialized:
            self.initialized = True
            for fn in self.queued:
                fn()

    def record_history(self, enabled="all", *args, **kwargs):
        assert not args, "positional arguments past enabled depend on the torch release"
        self.history.append(dict(kwargs, enabled=enabled))

    def take_snapshot(self, device=None, augment_with_fx_traces=False):
        return copy.deepcopy(self.snapshot)

    def malloc(self, size, device=None, stream=None):
        self.init()
        for observer in self.observers:
            observer(device, size, self.total, self.free)
        raise self.torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")


@pytest.fixture
def torch_cuda(monkeypatch):
    pytest.importorskip("torch")
    return FakeTorchCuda(monkeypatch, torch_snapshot())


def test_torch_history_waits_for_cuda_and_keeps_no_frames(torch_cuda, tmp_path):
    watch = pyalloc.watch_oom(tmp_path, allocator="torch", history=5000)
    # No CUDA of its own: the program may still set CUDA_VISIBLE_DEVICES, or fork.
    assert torch_cuda.history == [] and torch_cuda.observers == [] and torch_cuda.asked == 0
    torch_cuda.init()
    assert torch_cuda.history == [{"enabled": "all", "context": None, "stacks": "python",
                                   "max_entries": 5000}]
    assert len(torch_cuda.observers) == 1
    watch.close()
    assert torch_cuda.history[-1] == {"enabled": None}


def test_torch_frames_on_request(torch_cuda, tmp_path):
    torch_cuda.init()  # CUDA already in use: recording starts at once
    pyalloc.watch_oom(tmp_path, allocator="torch", frames=True).close()
    assert torch_cuda.history[0] == {"enabled": "all", "context": "alloc", "stacks": "python",
                                     "max_entries": 100_000}


def test_torch_oom_writes_the_devices_snapshot_named_by_rank(torch_cuda, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    (tmp_path / "oom-rank3-cuda1-1.pickle").write_bytes(b"an earlier run's")
    torch_cuda.total, torch_cuda.free = 80 * GiB, 2 * MiB
    monkeypatch.setattr(torch_cuda.torch.cuda, "mem_get_info", lambda device=None: (2 * MiB, 81 * GiB))
    with pyalloc.watch_oom(tmp_path, allocator="torch", verdict_timeout=60) as watch:
        with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
            torch_cuda.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    path = str(tmp_path / "oom-rank3-cuda1-2.pickle")  # the earlier file is kept
    assert watch.snapshots == [path]
    assert (tmp_path / "oom-rank3-cuda1-1.pickle").read_bytes() == b"an earlier run's"
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert [s["device"] for s in snap["segments"]] == [1]
    assert snap["device_traces"][0] == [] and snap["device_traces"][1] == torch_snapshot()["device_traces"][1]
    meta = snap["pyalloc_oom"]
    assert meta["device"] == 1 and meta["rank"] == 3 and meta["world_size"] == 8
    assert meta["allocator"] == "pytorch"
    assert meta["device_total_bytes"] == 81 * GiB  # the device's memory, from mem_get_info
    assert meta["device_limit_bytes"] == 80 * GiB  # the observer's: a memory fraction's cap
    assert meta["requested_bytes"] == 20 * MiB and meta["device_free_bytes"] == 2 * MiB
    assert meta["torch"] == str(torch_cuda.torch.__version__) and meta["time"]
    verdict = json.loads(Path(verdict_files(path)[1]).read_text())
    assert verdict["status"] == "done" and verdict["ooms"][0]["size_bytes"] == 16 * MiB


@pytest.mark.parametrize("variable, recorded, label", [
    ("expandable_segments:True", None, "pytorch expandable_segments"),  # a snapshot without the key
    ("", True, "pytorch expandable_segments"),  # turned on by the program itself
    ("expandable_segments:True", False, "pytorch"),  # what the allocator ran wins
])
def test_expandable_segments_name_the_allocator(torch_cuda, tmp_path, monkeypatch, variable, recorded, label):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", variable)
    settings = torch_cuda.snapshot["allocator_settings"]
    if recorded is None:
        del settings["expandable_segments"]
    else:
        settings["expandable_segments"] = recorded
    with pyalloc.watch_oom(tmp_path, allocator="torch", verdict_timeout=60) as watch:
        with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
            torch_cuda.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    with open(watch.snapshots[0], "rb") as f:
        assert pickle.load(f)["pyalloc_oom"]["allocator"] == label


def test_at_most_max_snapshots_and_the_rest_counted_in_one_line(torch_cuda, tmp_path, capsys):
    with pyalloc.watch_oom(tmp_path, allocator="torch", max_snapshots=2, verdict_timeout=60) as watch:
        for device in (1, 1, 0, 1, 1):
            with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
                torch_cuda.malloc(20 * MiB, device=device)
        wait_verdicts(watch)
    assert [os.path.basename(p) for p in watch.snapshots] == ["oom-rank0-cuda1-1.pickle",
                                                              "oom-rank0-cuda1-2.pickle"]
    assert len(watch.verdicts) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if "not kept" in x]
    assert "3 later out-of-memory errors were not kept (cuda:0 x1, cuda:1 x2)" in line
    assert "at most 2 snapshots" in line


def test_the_observer_never_raises_into_the_allocator(torch_cuda, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("snapshot refused")

    monkeypatch.setattr(torch_cuda.torch.cuda.memory, "_snapshot", broken)
    with pyalloc.watch_oom(tmp_path, allocator="torch") as watch:
        torch_cuda.init()
        [observer] = torch_cuda.observers
        assert observer(1, 20 * MiB, 80 * GiB, 2 * MiB) is None
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pyalloc oom:")]
    assert "could not keep" in line and "snapshot refused" in line
    assert watch.snapshots == [] and os.listdir(tmp_path) == []


def test_a_verdict_that_cannot_finish_says_so_and_keeps_the_snapshot(monkeypatch, tmp_path, capfd):
    pytest.importorskip("torch")
    fake = FakeTorchCuda(monkeypatch, torch_snapshot(pairs=30_000))
    with pyalloc.watch_oom(tmp_path, allocator="torch", verdict_timeout=0.001) as watch:
        with pytest.raises(fake.torch.cuda.OutOfMemoryError):
            fake.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    [path] = watch.snapshots
    assert os.path.getsize(path) > 0
    txt, js = verdict_files(path)
    verdict = json.loads(Path(js).read_text())
    assert verdict["status"] == "timeout" and verdict["ooms"] == []
    [line] = Path(txt).read_text().splitlines()
    assert "could not finish within 0.001 s" in line and f"pyalloc replay {path}" in line
    assert f"pyalloc oom: {line}" in capfd.readouterr().err


def test_the_verdict_child_gives_up_on_a_file_that_never_comes(tmp_path, capsys):
    """A watchdog, not the replay, ends the child: here the file is a pipe nobody writes."""
    import subprocess

    fifo = tmp_path / "oom-rank0-cuda0-1.pickle"
    os.mkfifo(fifo)
    proc = oom_watch.start_verdict(str(fifo), 0, 0.5)
    assert proc.wait(timeout=60) != 0
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    txt, js = verdict_files(fifo)
    assert json.loads(Path(js).read_text())["status"] == "timeout"
    assert "could not finish within 0.5 s" in Path(txt).read_text()
    assert isinstance(proc, subprocess.Popen)


def test_the_verdict_child_sees_no_gpu_and_runs_in_a_session_of_its_own(monkeypatch, tmp_path):
    import subprocess

    seen = {}

    def popen(argv, **kwargs):
        seen.update(kwargs, argv=argv)
        return "started"

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert oom_watch.start_verdict("/x/oom-rank0-cuda2-1.pickle", 2, 300.0) == "started"
    assert seen["argv"][1:] == ["-m", "pyalloc._oom_verdict", "/x/oom-rank0-cuda2-1.pickle",
                                "--device", "2", "--timeout", "300.0"]
    assert seen["start_new_session"] is True and seen["stdin"] == subprocess.DEVNULL
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "" and "stderr" not in seen


def test_cuda_malloc_async_runs_the_program_unwatched(torch_cuda, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch_cuda.init()
    assert watch.allocator is None and torch_cuda.history == [] and torch_cuda.observers == []
    assert "cudaMallocAsync" in capsys.readouterr().err


def test_without_a_gpu_there_is_nothing_to_watch(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)  # as a CPU build of torch
    with pytest.warns(UserWarning, match="nothing to watch"):
        watch = pyalloc.watch_oom(tmp_path)
    assert watch.allocator is None and not watch.armed
    watch.close()


def test_a_second_call_returns_the_armed_handle_or_refuses_other_settings(torch_cuda, tmp_path):
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    assert pyalloc.watch_oom(tmp_path, allocator="torch") is watch
    with pytest.raises(RuntimeError, match="already watching"):
        pyalloc.watch_oom(tmp_path / "other", allocator="torch")
    watch.close()
    assert pyalloc.watch_oom(tmp_path / "other", allocator="torch") is not watch


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="allocator"):
        pyalloc.watch_oom(tmp_path, allocator="jemalloc")
    with pytest.raises(ValueError, match="max_snapshots"):
        pyalloc.watch_oom(tmp_path, max_snapshots=0)
    with pytest.raises(ValueError, match="verdict_timeout"):
        pyalloc.watch_oom(tmp_path, verdict_timeout=0)


def test_import_pyalloc_stays_torch_free():
    import subprocess

    code = "import sys, pyalloc; pyalloc.watch_oom; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(pyalloc.__file__)))
    assert out.stdout.strip() == "False"


PROGRAM = """
    import sys
    import torch
    batch = 64
    while True:
        try:
            torch.cuda.caching_allocator_alloc(batch * 1024 * 1024, 1)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 16:
                sys.exit(7)
            batch //= 2
"""


def test_the_command_runs_a_program_that_catches_its_oom(torch_cuda, tmp_path, capsys):
    program = tmp_path / "train.py"
    program.write_text(textwrap.dedent(PROGRAM))
    out = tmp_path / "out"
    status = cli_main(["oom", "-o", str(out), "--max-snapshots", "2", "--", "python", str(program)])
    assert status == 7  # the program's own exit status
    assert sorted(os.listdir(out))[:2] == ["oom-rank0-cuda1-1.pickle", "oom-rank0-cuda1-2.pickle"]
    for name in ("oom-rank0-cuda1-1", "oom-rank0-cuda1-2"):
        verdict = json.loads(Path(wait_for(out / f"{name}.verdict.json")).read_text())
        assert verdict["status"] == "done" and verdict["ooms"][0]["size_bytes"] == 16 * MiB
    with open(out / "oom-rank0-cuda1-1.pickle", "rb") as f:
        meta = pickle.load(f)["pyalloc_oom"]
    assert meta["command"] == ["python", str(program)] and meta["requested_bytes"] == 64 * MiB
    err = capsys.readouterr().err
    assert "1 later out-of-memory error was not kept (cuda:1 x1)" in err


def test_the_command_refuses_a_program_it_cannot_run(capsys, tmp_path):
    assert cli_main(["oom", "-o", str(tmp_path), "--", "bash", "x.sh"]) == 2
    assert "only Python programs" in capsys.readouterr().err
    assert cli_main(["oom", "--conf", "pool_size:1GiB", "--", "python", "x.py"]) == 2
    assert "--conf" in capsys.readouterr().err


def test_a_verdict_still_running_at_the_end_is_named_once(torch_cuda, tmp_path, monkeypatch, capsys):
    class Running:
        pid = 4242

        def poll(self):
            return None

    monkeypatch.setattr(oom_watch, "start_verdict", lambda path, device, timeout, cwd: Running())
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
        torch_cuda.malloc(20 * MiB, device=1)
    watch.close()
    watch.close()
    oom_watch._at_exit()
    lines = [x for x in capsys.readouterr().err.splitlines() if "still running" in x]
    txt = verdict_files(tmp_path / "oom-rank0-cuda1-1.pickle")[0]
    assert lines == [f"pyalloc oom: the verdict on {tmp_path}/oom-rank0-cuda1-1.pickle is still running "
                     f"(process 4242); it will be written to {txt}"]


def test_the_command_installs_pyalloc_first_and_watches_its_pools(fake, monkeypatch, tmp_path, capfd):
    from pyalloc import launcher

    installed = []
    monkeypatch.setattr(launcher, "install_for_program", installed.append)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trainer.py").write_text(textwrap.dedent("""
        import sys
        import pyalloc
        from pyalloc import _C
        held = []
        try:
            while True:
                held.append(_C._testing_hook_malloc(24 << 20, 0, 0))
        except pyalloc.OutOfMemoryError:
            import os
            os.chdir(os.path.dirname(os.getcwd()))  # the folder given stays the one started in
            try:
                _C._testing_hook_malloc(64 << 20, 0, 0)
            except pyalloc.OutOfMemoryError:
                sys.exit(len(held))
    """))
    status = cli_main(["oom", "--allocator", "pyalloc", "--conf", "segment_size:4MiB", "--",
                       "python", "-m", "trainer"])
    assert installed == ["segment_size:4MiB"]
    assert status == 2  # the program's: two 24 MiB blocks on a 64 MiB device
    assert sorted(p for p in os.listdir(tmp_path / "pyalloc-oom") if p.endswith(".pickle")) == [
        "oom-rank0-cuda0-1.pickle", "oom-rank0-cuda0-2.pickle"]
    snapshot = tmp_path / "pyalloc-oom" / "oom-rank0-cuda0-1.pickle"
    verdict = json.loads(Path(wait_for(verdict_files(snapshot)[1])).read_text())
    assert verdict["status"] == "done" and verdict["ooms"][-1]["size_bytes"] == 24 * MiB
    assert verdict["file"] == "pyalloc-oom/oom-rank0-cuda0-1.pickle"  # as the user's shell finds it
    wait_for(verdict_files(tmp_path / "pyalloc-oom" / "oom-rank0-cuda0-2.pickle")[1])
    with open(snapshot, "rb") as f:
        assert pickle.load(f)["pyalloc_oom"]["command"] == ["python", "-m", "trainer"]
