"""The main job: ``python -m benchmarks``.

On a machine with a CUDA GPU, compares pyalloc with PyTorch's native allocator
live (``python -m benchmarks.gpu --quick``: every workload under both
allocators, each in its own process). Without one, replays the recorded traces
(the bundled ones, and ``../shared/traces`` and ``../shared/traces/gpu`` when
present) through pyalloc, PyTorch's caching allocator and PyTorch with
expandable segments, prints the three at equal budgets, and writes the results
with a plot and a paragraph per trace to benchmarks/results/
(``benchmarks/fragmentation.py``; ``--no-write`` or ``--results DIR`` to keep
them elsewhere). Extra arguments go to whichever runs.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None and torch.cuda.is_available()


def main(argv: list) -> int:
    if has_gpu():
        print("CUDA GPU found: pyalloc against the native allocator, live (python -m benchmarks.gpu --quick)",
              flush=True)
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--quick"] + argv
    else:
        print("no CUDA GPU: replaying recorded traces through pyalloc and models of PyTorch's allocator "
              "(benchmarks/fragmentation.py)", flush=True)
        cmd = [sys.executable, os.path.join(HERE, "fragmentation.py")] + argv
    return subprocess.call(cmd, cwd=ROOT, env=child_env())


def child_env() -> dict:
    """The environment of the job: where this checkout's pyalloc is built in place, its
    children import that one, not another checkout's that an editable install names."""
    env = dict(os.environ)
    if glob.glob(os.path.join(ROOT, "pyalloc", "_C*.so")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
