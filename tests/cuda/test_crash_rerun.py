"""The GPU checks' harness (crash_rerun.py, used by test_gpu.py) on CPU: a check that
dies by a signal runs once more under the debugger, whose backtrace goes into the
message; a check that fails otherwise does not."""
from __future__ import annotations

import os
import sys

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
