"""The main job: ``python -m benchmarks``.

On a machine with a CUDA GPU, compares pyalloc with PyTorch's native allocator
live (``python -m benchmarks.gpu --quick``: every workload under both
allocators, each in its own process). Without one, replays the recorded traces
(the bundled ones, and ``../shared/traces`` and ``../shared/traces/gpu`` when
present) through pyalloc, PyTorch's caching allocator and PyTorch with
expandable segments, prints the three at equal budgets within 100 columns, and
says where pyalloc wins, ties and loses (``benchmarks/fragmentation.py``).

Either way the results go to benchmarks/out/, which git ignores, so that a run
leaves the checkout as it was; ``--update-results`` writes the committed ones
in benchmarks/results/ instead. Other arguments go to whichever runs.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: Where a run writes (git ignores it); fragmentation.py's OUT.
OUT = os.path.join(HERE, "out")


def has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None and torch.cuda.is_available()


def command(argv: List[str], gpu: bool) -> List[str]:
    """The job's command line. The GPU benchmark writes to benchmarks/results/ unless
    told otherwise, so it is told OUT, unless the user named a folder or asked for
    the committed results (--update-results, fragmentation.py's own flag)."""
    if not gpu:
        return [sys.executable, os.path.join(HERE, "fragmentation.py")] + argv
    args = [a for a in argv if a != "--update-results"]
    if "--update-results" not in argv and not any(a == "--out-dir" or a.startswith("--out-dir=") for a in argv):
        args = ["--out-dir", OUT] + args
    return [sys.executable, "-m", "benchmarks.gpu", "--quick"] + args


def main(argv: List[str]) -> int:
    gpu = has_gpu()
    if gpu:
        print("CUDA GPU found: pyalloc against the native allocator, live (python -m benchmarks.gpu --quick)",
              flush=True)
    else:
        print("no CUDA GPU: replaying recorded traces through pyalloc and models of PyTorch's allocator",
              flush=True)
    cmd = command(argv, gpu)
    code = subprocess.call(cmd, cwd=ROOT, env=child_env())
    if gpu and OUT in cmd:  # fragmentation.py says where it wrote; the GPU benchmark is told here
        print(f"results in {_shown(OUT)}/ (untracked; --update-results: {_shown(os.path.join(HERE, 'results'))}/)")
    return code


def _shown(path: str) -> str:
    """A path relative to the current folder where under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def child_env() -> dict:
    """The environment of the job: where this checkout's pyalloc is built in place, its
    children import that one, not another checkout's that an editable install names."""
    env = dict(os.environ)
    if glob.glob(os.path.join(ROOT, "pyalloc", "_C*.so")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return env


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
