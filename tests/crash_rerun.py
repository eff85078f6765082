"""A GPU check that dies by a signal runs once more under a debugger (tests/cuda/test_gpu.py).

A crash in native code (a SIGSEGV inside the unwinder, say) prints nothing of
its own, and a GPU is lent rarely and for minutes: the check is run again at once
under cuda-gdb (the GPU machine's debugger; gdb where there is no cuda-gdb),
and the native backtrace of the thread that crashed, with the shared libraries
the process had loaded, goes into the failure's message, so one run finds
where it crashed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
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


def run_check(args: List[str], env: Dict[str, str], cwd: str,
              timeout: float) -> Tuple[subprocess.CompletedProcess, Optional[str]]:
    """Runs a check; (its result, the debugger's report when it died by a signal, else None)."""
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if out.returncode >= 0:
        return out, None
    return out, rerun_under_debugger(args, env, cwd, timeout)
