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
    assert "segment_bytes" not in meta  # pyalloc's observer gets the caller's bytes
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
    # PyTorch's observer gets the segment it tried to reserve, not the caller's bytes.
    assert meta["segment_bytes"] == 20 * MiB and meta["requested_bytes"] is None
    assert meta["device_free_bytes"] == 2 * MiB
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
    [line, closing] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("pyalloc oom:")]
    assert "could not keep" in line and "snapshot refused" in line
    assert "1 out-of-memory error could not be kept (cuda:1 x1)" in closing
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


def test_a_second_call_returns_the_armed_handle_and_says_once_which_settings_stay(torch_cuda, tmp_path,
                                                                                  capsys):
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")  # as pyalloc oom -o DIR arms it
    assert pyalloc.watch_oom(tmp_path, allocator="torch") is watch
    assert capsys.readouterr().err == ""
    # The program's own call, with other settings: it goes on, under the first watch.
    assert pyalloc.watch_oom(tmp_path / "other", allocator="torch", max_snapshots=5) is watch
    assert pyalloc.watch_oom(tmp_path / "third", allocator="torch") is watch
    [line] = capsys.readouterr().err.splitlines()
    assert "already watching" in line and f"snapshots to {tmp_path}" in line
    assert "at most 3 snapshots" in line and "these settings are not applied" in line
    assert not (tmp_path / "other").exists()
    watch.close()
    assert pyalloc.watch_oom(tmp_path / "other", allocator="torch") is not watch


def test_a_program_that_arms_its_own_watch_runs_under_the_command(torch_cuda, tmp_path, capsys):
    program = tmp_path / "train.py"
    program.write_text(textwrap.dedent(f"""
        import pyalloc, torch
        watch = pyalloc.watch_oom({str(tmp_path / "mine")!r}, max_snapshots=1)
        try:
            torch.cuda.caching_allocator_alloc(64 << 20, 1)
        except torch.cuda.OutOfMemoryError:
            raise SystemExit(5)
    """))
    out = tmp_path / "runs"
    assert cli_main(["oom", "-o", str(out), "--", "python", str(program)]) == 5
    assert "oom-rank0-cuda1-1.pickle" in os.listdir(out)
    assert "already watching" in capsys.readouterr().err


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
    assert meta["command"] == ["python", str(program)] and meta["segment_bytes"] == 64 * MiB
    err = capsys.readouterr().err
    assert "1 later out-of-memory error was not kept (cuda:1 x1)" in err


def test_the_command_refuses_a_program_it_cannot_run(capsys, tmp_path):
    assert cli_main(["oom", "-o", str(tmp_path), "--", "bash", "x.sh"]) == 2
    assert "only Python programs" in capsys.readouterr().err
    (tmp_path / "x.py").write_text("")
    assert cli_main(["oom", "--conf", "pool_size:1GiB", "--", "python", str(tmp_path / "x.py")]) == 2
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


# ---------------------------------------------------------------------------
# An unusable folder, a snapshot that cannot be written


def test_an_unusable_folder_is_refused_when_the_watch_is_armed(torch_cuda, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match="cannot write snapshots"):
        pyalloc.watch_oom(blocker / "oom", allocator="torch")
    assert torch_cuda.queued == [] and oom_watch._current is None  # nothing armed
    made = tmp_path / "new" / "deeper"
    pyalloc.watch_oom(made, allocator="torch").close()
    assert made.is_dir() and os.listdir(made) == []  # the test file is gone


def test_the_command_refuses_an_unusable_folder_before_the_program_runs(torch_cuda, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    program = tmp_path / "train.py"
    program.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    assert cli_main(["oom", "-o", str(blocker / "oom"), "--", "python", str(program)]) == 2
    assert not (tmp_path / "ran").exists()
    assert "pyalloc oom: error: cannot write snapshots" in capsys.readouterr().err


def test_a_snapshot_that_cannot_be_written_gives_its_slot_back(torch_cuda, tmp_path, capsys, monkeypatch):
    real = oom_watch.write_snapshot
    failures = iter([OSError(28, "No space left on device")])

    def write(snapshot, path):
        for e in failures:
            raise e
        real(snapshot, path)

    monkeypatch.setattr(oom_watch, "write_snapshot", write)
    with pyalloc.watch_oom(tmp_path, allocator="torch", max_snapshots=1, verdict_timeout=60) as watch:
        for _ in range(3):
            with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
                torch_cuda.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    assert [os.path.basename(p) for p in watch.snapshots] == ["oom-rank0-cuda1-1.pickle"]
    assert sorted(os.listdir(tmp_path))[0] == "oom-rank0-cuda1-1.pickle"
    err = capsys.readouterr().err.splitlines()
    assert len([x for x in err if "could not keep" in x]) == 1
    [failed] = [x for x in err if "could not be kept" in x]
    assert "1 out-of-memory error could not be kept (cuda:1 x1)" in failed
    [skipped] = [x for x in err if "not kept" in x]
    assert "1 later out-of-memory error was not kept (cuda:1 x1)" in skipped


DIES_WHILE_WRITING = """
    import builtins, os, signal, sys
    import pyalloc
    from pyalloc import _C

    _C._testing_use_fake_devices(64 << 20)
    watch = pyalloc.watch_oom(sys.argv[1], allocator="pyalloc")
    real_open = builtins.open

    class Killed:  # torchrun's SIGTERM to the other ranks, half-way through the write
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def open_(name, mode="r", *args, **kwargs):
        f = real_open(name, mode, *args, **kwargs)
        return Killed(f) if "w" in mode and str(name).startswith(sys.argv[1]) else f

    builtins.open = open_
    while True:
        _C._testing_hook_malloc(24 << 20, 0, 0)
"""


def test_a_process_killed_while_writing_leaves_no_partial_snapshot(tmp_path):
    import signal
    import subprocess

    program = tmp_path / "dies.py"
    program.write_text(textwrap.dedent(DIES_WHILE_WRITING))
    out = tmp_path / "oom"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pyalloc.__file__)))
    proc = subprocess.run([sys.executable, str(program), str(out)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [p for p in os.listdir(out) if p.endswith(".pickle")] == []  # no truncated snapshot
    assert [p for p in os.listdir(out) if p.endswith(".tmp")]  # it died writing


def test_a_snapshot_is_written_whole_under_its_name(torch_cuda, tmp_path, monkeypatch):
    seen = []
    real = oom_watch.write_snapshot

    def write(snapshot, path):
        seen.append(path)
        assert not (tmp_path / "oom-rank0-cuda1-1.pickle").exists()  # no name until written whole
        real(snapshot, path)

    monkeypatch.setattr(oom_watch, "write_snapshot", write)
    with pyalloc.watch_oom(tmp_path, allocator="torch", verdict_timeout=60) as watch:
        with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
            torch_cuda.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    [path] = watch.snapshots
    assert seen and os.path.dirname(seen[0]) == str(tmp_path) and seen[0] != path
    with open(path, "rb") as f:
        assert pickle.load(f)["pyalloc_oom"]["device"] == 1
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ---------------------------------------------------------------------------
# Each snapshot's verdict process stays beside it


class Running:
    """A verdict process still running at the end."""

    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None


def still_running(capsys):
    return sorted(x for x in capsys.readouterr().err.splitlines() if "still running" in x)


def test_a_verdict_that_could_not_start_shifts_no_other(torch_cuda, tmp_path, monkeypatch, capsys):
    started = iter([OSError("fork failed"), Running(4242)])

    def start(path, device, timeout, cwd):
        got = next(started)
        if isinstance(got, OSError):
            raise got
        return got

    monkeypatch.setattr(oom_watch, "start_verdict", start)
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    for _ in range(2):
        with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
            torch_cuda.malloc(20 * MiB, device=1)
    watch.close()
    assert [os.path.basename(p) for p in watch.snapshots] == ["oom-rank0-cuda1-1.pickle",
                                                              "oom-rank0-cuda1-2.pickle"]
    assert [p.pid for p in watch.verdicts] == [4242]
    [line] = still_running(capsys)
    assert "oom-rank0-cuda1-2.pickle is still running (process 4242)" in line


def test_two_devices_at_once_keep_their_own_verdicts(torch_cuda, tmp_path, monkeypatch, capsys):
    import threading

    second_done = threading.Event()

    def start(path, device, timeout, cwd):
        if device == 0:  # the first error's verdict starts after the second's
            assert second_done.wait(timeout=30)
        return Running(1000 + device)

    monkeypatch.setattr(oom_watch, "start_verdict", start)
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch_cuda.init()
    [observer] = torch_cuda.observers
    first = threading.Thread(target=observer, args=(0, 20 * MiB, 80 * GiB, 2 * MiB))
    first.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "oom-rank0-cuda0-1.pickle").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    observer(1, 20 * MiB, 80 * GiB, 2 * MiB)
    second_done.set()
    first.join(timeout=30)
    watch.close()
    assert sorted(p.pid for p in watch.verdicts) == [1000, 1001]
    lines = still_running(capsys)
    assert len(lines) == 2
    assert "oom-rank0-cuda0-1.pickle is still running (process 1000)" in lines[0]
    assert "oom-rank0-cuda1-1.pickle is still running (process 1001)" in lines[1]


# ---------------------------------------------------------------------------
# The program's own history recording


def test_history_the_program_records_itself_is_left_on_at_close(torch_cuda, tmp_path, capsys):
    torch = torch_cuda.torch
    fake_record = torch.cuda.memory._record_memory_history
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch_cuda.init()
    # The program's own call, after the watch's: it replaces the watch's settings (recordHistory).
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=7)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch_cuda.malloc(20 * MiB, device=1)
    watch.close()
    assert torch_cuda.history[-1] == {"enabled": "all", "max_entries": 7}  # not turned off
    assert torch.cuda.memory._record_memory_history is fake_record  # torch's own again
    with open(watch.snapshots[0], "rb") as f:
        assert pickle.load(f)["pyalloc_oom"]["history_set_by_program"] is True
    assert "the program records the allocator's history itself" in capsys.readouterr().err


def test_the_watchs_own_history_is_turned_off_at_close(torch_cuda, tmp_path):
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch_cuda.init()
    watch.close()
    assert torch_cuda.history[-1] == {"enabled": None}


def test_a_history_emptied_by_the_program_is_named_in_the_verdict(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    snap = torch_snapshot()
    snap["device_traces"][1] = []  # _record_memory_history(enabled=None) clears the buffer
    fake = FakeTorchCuda(monkeypatch, snap)
    with pyalloc.watch_oom(tmp_path, allocator="torch", verdict_timeout=60) as watch:
        with pytest.raises(fake.torch.cuda.OutOfMemoryError):
            fake.malloc(20 * MiB, device=1)
        wait_verdicts(watch)
    [path] = watch.snapshots
    txt, js = verdict_files(path)
    [line] = Path(txt).read_text().splitlines()
    assert "holds no history of cuda:1" in line and "turned off or emptied by the program" in line
    assert json.loads(Path(js).read_text())["status"] == "failed"


def test_a_program_whose_own_recording_starts_cuda_is_still_watched(torch_cuda, tmp_path, monkeypatch):
    torch = torch_cuda.torch
    real = torch.cuda.memory._record_memory_history

    def starts_cuda(enabled="all", **kwargs):  # torch's own call initialises CUDA first
        torch_cuda.init()
        real(enabled, **kwargs)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", starts_cuda)
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=9)
    assert torch_cuda.history == [{"enabled": "all", "max_entries": 9}] and len(torch_cuda.observers) == 1
    watch.close()
    assert torch_cuda.history[-1] == {"enabled": "all", "max_entries": 9}


# ---------------------------------------------------------------------------
# What the watch cannot see: torchrun's workers, processes the program spawns


@pytest.mark.parametrize("command", [["torchrun", "--nproc-per-node=2", "train.py"],
                                     ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "--help"],
                                     ["python3", "-m", "torch.distributed.launch", "--help"]])
def test_torchrun_under_the_command_is_refused_with_the_command_that_works(command, tmp_path, capsys):
    assert cli_main(["oom", "-o", str(tmp_path), "--"] + command) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node=N -m pyalloc oom -o DIR -- train.py" in err
    assert os.listdir(tmp_path) == []


def test_a_watch_that_never_saw_cuda_says_so_and_names_spawned_processes(torch_cuda, tmp_path, capsys):
    pyalloc.watch_oom(tmp_path, allocator="torch").close()  # the program's GPU work was all in children
    [line] = [x for x in capsys.readouterr().err.splitlines() if "pyalloc oom:" in x]
    assert "never initialised CUDA" in line and "nothing was watched" in line
    assert "started with multiprocessing's spawn or forkserver" in line and "watch themselves" in line
    assert "subprocesses, torchrun's workers) are not watched" in line
    watch = pyalloc.watch_oom(tmp_path, allocator="torch")
    torch_cuda.init()
    watch.close()
    oom_watch._at_exit()
    assert "nothing was watched" not in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Programs python runs: a folder or zip file with __main__.py; a bad one refused before arming


def test_a_folder_or_zip_program_runs_as_python_runs_it(torch_cuda, tmp_path):
    import zipfile

    pkg = tmp_path / "pkgdir"
    pkg.mkdir()
    (pkg / "__main__.py").write_text("import sys\nsys.exit(4 if sys.argv[1:] == ['x'] else 9)\n")
    assert cli_main(["oom", "-o", str(tmp_path / "out"), "--", "python", str(pkg), "x"]) == 4
    app = tmp_path / "app.pyz"
    with zipfile.ZipFile(app, "w") as z:
        z.write(pkg / "__main__.py", "__main__.py")
    assert cli_main(["oom", "-o", str(tmp_path / "out"), "--", "python", str(app), "x"]) == 4


@pytest.mark.parametrize("target, says", [("missing.py", "no such script"),
                                          ("emptydir", "no __main__.py")])
def test_a_program_that_cannot_run_is_refused_before_anything_is_armed(torch_cuda, tmp_path, capsys,
                                                                     target, says):
    (tmp_path / "emptydir").mkdir()
    out = tmp_path / "out"
    assert cli_main(["oom", "-o", str(out), "--", "python", str(tmp_path / target)]) == 2
    assert says in capsys.readouterr().err
    assert torch_cuda.queued == [] and not out.exists()  # nothing armed, no folder made


# ---------------------------------------------------------------------------
# The verdict child imports the pyalloc this process runs, without shadowing the standard library


def child_env(monkeypatch, site_dirs, pythonpath):
    import site
    import subprocess

    seen = {}
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(site, "getsitepackages", lambda: list(site_dirs))
    monkeypatch.setattr(site, "getusersitepackages", lambda: "/nowhere/user-site")
    if pythonpath is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", pythonpath)
    oom_watch.start_verdict("/x/oom-rank0-cuda0-1.pickle", 0, 300.0)
    return seen["env"]


def test_an_installed_pyalloc_adds_nothing_to_the_childs_path(monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(pyalloc.__file__)))  # as if site-packages
    assert "PYTHONPATH" not in child_env(monkeypatch, [root], None)
    assert child_env(monkeypatch, ["/usr/lib/site-packages", root], "/mine")["PYTHONPATH"] == "/mine"


def test_a_source_checkout_goes_after_the_childs_path(monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(pyalloc.__file__)))
    env = child_env(monkeypatch, ["/usr/lib/site-packages"], "/mine")
    assert env["PYTHONPATH"] == f"/mine{os.pathsep}{root}"
    assert child_env(monkeypatch, ["/usr/lib/site-packages"], None)["PYTHONPATH"] == root


def test_a_rename_that_fails_leaves_neither_file(torch_cuda, tmp_path, monkeypatch, capsys):
    def refuse(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(oom_watch.os, "replace", refuse)
    with pyalloc.watch_oom(tmp_path, allocator="torch") as watch:
        with pytest.raises(torch_cuda.torch.cuda.OutOfMemoryError):
            torch_cuda.malloc(20 * MiB, device=1)
    assert watch.snapshots == [] and os.listdir(tmp_path) == []
    assert "could not keep" in capsys.readouterr().err


def test_nothing_to_watch_makes_no_folder(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    with pytest.warns(UserWarning, match="nothing to watch"):
        pyalloc.watch_oom(tmp_path / "oom").close()
    assert not (tmp_path / "oom").exists()


SPAWNS = """
    import multiprocessing as mp, os, sys
    import pyalloc
    from pyalloc import _C

    def worker(out):  # its GPU work only here, as under torch.multiprocessing.spawn
        _C._testing_use_fake_devices(64 << 20)
        held = []
        try:
            while True:
                held.append(_C._testing_hook_malloc(24 << 20, 0, 0))
        except pyalloc.OutOfMemoryError:
            pass
        with open(os.path.join(out, "worker-pid"), "w") as f:
            f.write(str(os.getpid()))

    def idle(out):  # a worker that does no CUDA work: says nothing
        pass

    if __name__ == "__main__":
        _C._testing_use_fake_devices(64 << 20)
        watch = pyalloc.watch_oom(sys.argv[1], allocator="pyalloc")
        for target in (worker, idle):
            p = mp.get_context("spawn").Process(target=target, args=(sys.argv[1],))
            p.start()
            p.join()
        watch.close()
        p = mp.get_context("spawn").Process(target=worker, args=(sys.argv[2],))  # after close: unwatched
        p.start()
        p.join()
"""


def test_processes_the_program_spawns_watch_themselves(tmp_path):
    import subprocess

    program = tmp_path / "spawns.py"
    program.write_text(textwrap.dedent(SPAWNS))
    out, later = tmp_path / "oom", tmp_path / "later"
    later.mkdir()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pyalloc.__file__)))
    proc = subprocess.run([sys.executable, str(program), str(out), str(later)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    pid = (out / "worker-pid").read_text()
    with open(out / "oom-rank0-cuda0-1.pickle", "rb") as f:
        meta = pickle.load(f)["pyalloc_oom"]
    assert meta["allocator"] == "pyalloc" and meta["requested_bytes"] == 24 * MiB
    assert f"pyalloc oom: out of memory on cuda:0: snapshot {out}/oom-rank0-cuda0-1.pickle" in proc.stderr
    assert pid and "nothing was watched" not in proc.stderr
    assert os.listdir(later) == ["worker-pid"]  # the watch closed: its children no longer arm one
