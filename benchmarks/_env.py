"""What every benchmark result records about where and how it was measured."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Any, Dict

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    # A copy of the tree without its .git (a GPU machine) is told the commit by its caller.
    if os.environ.get("PYALLOC_GIT_COMMIT"):
        return os.environ["PYALLOC_GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _script(path: str) -> str:
    """The script as run from the checkout's root where it lies in it (an absolute path
    names a folder only the machine that ran it has)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = os.path.abspath(path)
    return os.path.relpath(full, root) if full.startswith(root + os.sep) else path


def environment() -> Dict[str, Any]:
    import pyalloc

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), _script(sys.argv[0])] + sys.argv[1:]),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "pyalloc": pyalloc.__version__,
        "git_commit": _git_commit(),
    }
