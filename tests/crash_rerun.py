"""A GPU check that dies by a signal runs once more under a debugger (tests/cuda/test_gpu.py).

A crash in native code (a SIGSEGV inside the unwinder, say) prints nothing of
its own, and a GPU is lent rarely and for minutes: the check is run again at once
under cuda-gdb (the GPU machine's debugger; gdb where there is no cuda-gdb),
and the native backtrace of the thread that crashed, with the shared libraries
the process had loaded, goes into the failure's message, so one run finds
where it crashed.

Every check runs in a process group of its own, its stdout and stderr written to log files
as they come (build/gpu-checks/, or PYALLOC_CHECK_LOGS): a check that hangs is
killed with everything it started, and what it printed is kept.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Optional, Tuple

DEBUGGERS = ("cuda-gdb", "gdb")
#: What the debugger does: run to the crash, then the backtraces and the libraries loaded.
DEBUGGER_COMMANDS = ("set pagination off", "run", "bt", "thread apply all bt 12", "info sharedlibrary")
#: The debugger's output kept in the message (its last lines: the crash, then the libraries).
KEEP_LINES = 250


def debugger_command(debugger: str, args: List[str]) -> List[str]:
    out = [debugger, "-q", "-batch"]
    for command in DEBUGGER_COMMANDS:
        out += ["-ex", command]
    return out + ["--args", *args]


def rerun_under_debugger(args: List[str], env: Dict[str, str], cwd: str, timeout: float) -> str:
    """Runs ``args`` once under cuda-gdb (or gdb) and returns what it printed: the
    backtrace where it stopped and the libraries loaded. Never raises."""
    path = env.get("PATH", os.environ.get("PATH"))
    debugger = next((found for found in (shutil.which(d, path=path) for d in DEBUGGERS) if found), None)
    if debugger is None:
        return f"no native backtrace: neither {' nor '.join(DEBUGGERS)} is on PATH"
    command = debugger_command(debugger, args)
    try:
        out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, cwd=cwd, timeout=timeout)
        text, status = out.stdout, f"exit {out.returncode}"
    except subprocess.TimeoutExpired as e:
        text = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        status = f"stopped after {timeout:.0f} s"
    except OSError as e:
        return f"no native backtrace: {debugger} could not start ({e})"
    lines = text.splitlines()
    dropped = len(lines) - KEEP_LINES
    kept = (["[... {} earlier lines]".format(dropped)] if dropped > 0 else []) + lines[-KEEP_LINES:]
    return f"rerun under {' '.join(command)} ({status}):\n" + "\n".join(kept)


#: Where each check's output goes as it runs (one file per check), unless
#: PYALLOC_CHECK_LOGS names another folder: a stage killed at its limit, or pytest -n
#: holding every failure's text to its end, still leaves what each check printed.
LOG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu-checks")
#: The longest the rerun under the debugger may take: the check's stage goes on after it.
RERUN_TIMEOUT_S = 120
#: Seconds a killed check's process group gets to go before its output is read.
KILL_WAIT_S = 10


def log_path(args: List[str], env: Dict[str, str]) -> str:
    """The stem of a check's two log files (STEM.out, STEM.err): named by its script (or
    first argument), the configuration it runs under, and this process, so that checks
    side by side never share one."""
    folder = env.get("PYALLOC_CHECK_LOGS") or os.environ.get("PYALLOC_CHECK_LOGS") or LOG_DIR
    os.makedirs(folder, exist_ok=True)
    script = next((a for a in args[1:] if a.endswith((".py", ".sh"))), args[0])
    tag = "".join(c if c.isalnum() else "-" for c in env.get("PYALLOC_CONF", "") + env.get("PYALLOC_BRIDGE", ""))
    return os.path.join(folder, f"{os.path.basename(script)}-{tag or 'default'}-{os.getpid()}-{time.monotonic_ns()}")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills the check and everything it started (its own process group): a child
    process left waiting would otherwise hold the check's exit, or the GPU, past it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


def run_check(args: List[str], env: Dict[str, str], cwd: str,
              timeout: float) -> Tuple[subprocess.CompletedProcess, Optional[str]]:
    """Runs a check in a process group of its own; (its result, the debugger's report
    when it died by a signal, else None). Its stdout and stderr go to two log files as it
    prints them (log_path(); the result's ``log`` is their stem). Past ``timeout`` seconds
    the whole group is killed, and the result keeps what the check had printed:
    returncode None, ``timed_out`` True, a line saying so at the end of its stderr. When
    the check ends, whatever it left running in its group is killed too."""
    stem = log_path(args, env)
    with open(stem + ".out", "w") as out_log, open(stem + ".err", "w") as err_log:
        err_log.write(f"$ {' '.join(args)}\n")
        err_log.flush()
        proc = subprocess.Popen(args, stdout=out_log, stderr=err_log, env=env, cwd=cwd,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)
        if timed_out:
            err_log.write(f"\n[the check ran past its {timeout:.0f} s: its process group was killed]\n")
    with open(stem + ".out", errors="replace") as f:
        stdout = f.read()
    with open(stem + ".err", errors="replace") as f:
        stderr = f.read().split("\n", 1)[1]  # less the command line
    out = subprocess.CompletedProcess(args, None if timed_out else proc.returncode, stdout, stderr)
    out.timed_out, out.log = timed_out, stem  # type: ignore[attr-defined]
    if timed_out or out.returncode >= 0:
        return out, None
    return out, rerun_under_debugger(args, env, cwd, min(timeout, RERUN_TIMEOUT_S))


# pytest hooks, imported by tests/cuda/conftest.py: a GPU check's failure is printed as
# soon as it is known, not only in pytest's summary at the end. Under pytest -n that
# summary is all a session's log would show, and a stage killed at its limit never
# reaches it. They act in the process that reports: the controller under pytest -n (its
# workers send it their reports), else pytest itself.
_reporter = None


def pytest_sessionstart(session) -> None:
    global _reporter
    if not hasattr(session.config, "workerinput"):  # not a pytest-xdist worker
        _reporter = session.config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logreport(report) -> None:
    if _reporter is None or not report.failed or "test_gpu.py" not in report.nodeid:
        return
    _reporter.write_line(f"\n=== FAILED {report.nodeid} ({report.when}), at once:")
    _reporter.write_line(report.longreprtext)
