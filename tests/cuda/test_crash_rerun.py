"""The GPU checks' harness (crash_rerun.py, used by test_gpu.py) on CPU: a check that
dies by a signal runs once more under the debugger, whose backtrace goes into the
message; a check that fails otherwise does not."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from crash_rerun import run_check

CRASH = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
FAKE_GDB = """#!/bin/sh
# Stands in for cuda-gdb: says how it was called, and a backtrace.
echo "$@" >> "$(dirname "$0")/calls"
echo "Thread 1 received signal SIGSEGV, Segmentation fault."
echo "#0  0x00007f0000001234 in _Unwind_RaiseException () from /opt/gcc/lib64/libgcc_s.so.1"
echo "From                To                  Syms Read   Shared Object Library"
"""


def _path_with_fake_debugger(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "cuda-gdb"
    fake.write_text(FAKE_GDB)
    fake.chmod(0o755)
    return bin_dir, dict(os.environ, PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))


def test_a_check_killed_by_a_signal_is_rerun_once_under_cuda_gdb(tmp_path):
    bin_dir, env = _path_with_fake_debugger(tmp_path)
    out, native = run_check(CRASH, env, str(tmp_path), timeout=60)
    assert out.returncode == -11
    assert native is not None and native.startswith(f"rerun under {bin_dir / 'cuda-gdb'} -q -batch "), native
    assert "#0  0x00007f0000001234 in _Unwind_RaiseException () from /opt/gcc/lib64/libgcc_s.so.1" in native
    assert "(exit 0)" in native.splitlines()[0]
    calls = (bin_dir / "calls").read_text().splitlines()
    assert len(calls) == 1, calls
    assert "-ex run -ex bt " in calls[0] and "-ex info sharedlibrary --args " + " ".join(CRASH) in calls[0]


def test_a_check_that_fails_without_a_signal_is_not_rerun(tmp_path):
    bin_dir, env = _path_with_fake_debugger(tmp_path)
    out, native = run_check([sys.executable, "-c", "raise SystemExit(3)"], env, str(tmp_path), timeout=60)
    assert out.returncode == 3 and native is None
    assert not (bin_dir / "calls").exists()


def test_without_a_debugger_the_message_says_so(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # neither cuda-gdb nor gdb here
    out, native = run_check(CRASH, env, str(tmp_path), timeout=60)
    assert out.returncode == -11
    assert native == "no native backtrace: neither cuda-gdb nor gdb is on PATH"


def test_test_gpu_puts_the_native_backtrace_into_the_failure(tmp_path, monkeypatch):
    import pytest

    import test_gpu

    bin_dir, env = _path_with_fake_debugger(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    with pytest.raises(AssertionError) as failed:
        test_gpu.run(CRASH, timeout=60)
    message = str(failed.value)
    assert "exited with -11" in message and "--- rerun under " in message, message
    assert "in _Unwind_RaiseException () from /opt/gcc/lib64/libgcc_s.so.1" in message, message


# A check that hangs, having started a grandchild that hangs too (as tests/gpu/ipc.py's
# receiver did), after printing a line to each stream.
HANG = [sys.executable, "-c", (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print('GRANDCHILD', child.pid, flush=True)\n"
    "print('sender: waiting on the receiver', file=sys.stderr, flush=True)\n"
    "time.sleep(600)\n")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has gone
    except FileNotFoundError:
        return False


def test_a_hung_check_is_killed_with_its_children_and_its_output_kept(tmp_path):
    import time

    env = dict(os.environ, PYALLOC_CHECK_LOGS=str(tmp_path / "logs"))
    start = time.monotonic()
    out, native = run_check(HANG, env, str(tmp_path), timeout=3)
    assert time.monotonic() - start < 30, "run_check waited on what the check left running"
    assert out.timed_out and out.returncode is None and native is None  # no debugger rerun for a hang
    grandchild = int(out.stdout.split()[1])
    assert out.stdout.startswith("GRANDCHILD "), out.stdout
    assert "sender: waiting on the receiver" in out.stderr
    assert "ran past its 3 s: its process group was killed" in out.stderr
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the check's grandchild outlived it"
    # Both streams are on disk, as printed, for a stage killed before pytest reports.
    assert Path(out.log + ".out").read_text() == out.stdout
    assert "sender: waiting on the receiver" in Path(out.log + ".err").read_text()


def test_a_failing_check_keeps_its_output_in_its_log_file(tmp_path):
    env = dict(os.environ, PYALLOC_CHECK_LOGS=str(tmp_path / "logs"))
    fail = [sys.executable, "-c", "import sys; print('step 1 ok'); sys.exit('step 2: out of memory')"]
    out, native = run_check(fail, env, str(tmp_path), timeout=60)
    assert out.returncode == 1 and not out.timed_out and native is None
    assert out.stdout == "step 1 ok\n" and "step 2: out of memory" in out.stderr
    assert os.path.dirname(out.log) == str(tmp_path / "logs")
    assert Path(out.log + ".out").read_text() == "step 1 ok\n"
    assert "step 2: out of memory" in Path(out.log + ".err").read_text()


def test_test_gpu_says_a_check_timed_out_and_shows_its_partial_output(tmp_path, monkeypatch):
    import pytest

    import test_gpu

    monkeypatch.setenv("PYALLOC_CHECK_LOGS", str(tmp_path / "logs"))
    with pytest.raises(AssertionError) as failed:
        test_gpu.run(HANG, timeout=3)
    message = str(failed.value)
    assert "ran past its 3 s and was killed" in message and "GRANDCHILD " in message, message
    assert "sender: waiting on the receiver" in message and "(log: " in message, message


def test_a_gpu_check_failure_prints_when_it_fails_not_at_the_end(tmp_path):
    import subprocess

    (tmp_path / "conftest.py").write_text("from crash_rerun import pytest_runtest_logreport, pytest_sessionstart\n")
    (tmp_path / "test_gpu.py").write_text(
        "def test_fails():\n    assert False, 'the receiver never answered'\n\n"
        "def test_after():\n    print('LATER CHECK')\n")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(tmp_path)], capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    text = out.stdout
    assert out.returncode == 1, text
    at_once = text.index("=== FAILED test_gpu.py::test_fails (call), at once:")
    assert "the receiver never answered" in text[at_once:text.index("test_gpu.py::test_after")], text
    assert at_once < text.index("test_gpu.py::test_after") < text.index("= FAILURES =")


def test_every_gpu_check_stops_well_within_the_gpu_sessions_tests_stage():
    import re

    import test_gpu
    from benchmarks.gpu.session import STAGES

    stage = next(s for s in STAGES if s.name == "tests")
    # A check that hangs is killed at its own limit, and the stage goes on to the others.
    assert test_gpu.CHECK_TIMEOUT_S <= test_gpu.LONG_CHECK_TIMEOUT_S <= stage.limit_s * 2 // 3
    with open(test_gpu.__file__) as f:
        source = f.read()
    assert re.findall(r"timeout=\d|REPO, \d", source) == [], "every limit is one of the two constants"
