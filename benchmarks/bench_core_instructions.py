"""Hot-path cost of the allocator core in instructions: callgrind's count per malloc+free pair.

Wall-clock figures (bench_core.py) move with whatever else the machine runs; the
number of instructions a pair executes does not. Each case runs the C++ loop of
bench_core.py (pyalloc._C.bench_pairs over the virtual backend) under
`valgrind --tool=callgrind` twice, for a short and a long loop, in fresh
processes with a fixed hash seed; the difference over the extra pairs is the
cost of one pair, with Python's start-up and the warm-up cancelled out. Each case
runs twice: on the core alone, and through a fake device's pools (the pools of one
CUDA device as PyTorch's hooks reach them: _C.bench_device_pairs over
_C._testing_use_fake_devices), so that the cost of the CUDA layer shows beside the
core's, as a ratio. PyTorch tells pyalloc of its captures there, as the bridge
always does: without that, every allocation asks the driver whether its stream is
capturing, a driver call that a fake device stands in for with a lookup. Prints a
table and writes benchmarks/results/bench_core_instructions.json. Needs valgrind.

    python benchmarks/bench_core_instructions.py [--pairs N] [--out FILE]

Cases (each on the core, then through a device's pools):
  cache hit, 4 KiB     a small-pool block reused every time
  cache hit, 8 MiB     a large-pool block: under vmm the pool maps 20 MiB pages,
                       so each pair splits 8 MiB off a free block and merges it back
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _env import RESULTS, environment  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
CASES = [("cache hit, 4 KiB (small pool)", 4 * KiB), ("cache hit, 8 MiB (large pool)", 8 * MiB)]
SHORT = 10_000  # pairs of the short loop; the long one adds --pairs


PATHS = ("core", "pools")  # the core alone; a fake device's pools


def child(path: str, size: int, pairs: int) -> None:
    """The loop callgrind counts: a warm-up, then `pairs` malloc+free pairs of `size` bytes."""
    import pyalloc
    from pyalloc import _C

    if path == "pools":
        _C._testing_use_fake_devices(64 * MiB)
        _C.cuda_set_told_of_captures(True)
        _C.bench_device_pairs("hooks", size, 1000)
        _C.bench_device_pairs("hooks", size, pairs)
        return
    a = pyalloc.Allocator("virtual")
    _C.bench_pairs(a._core, [size], 1000, 1, 1)
    _C.bench_pairs(a._core, [size], pairs, 1, 1)


def instructions(path: str, size: int, pairs: int) -> int:
    """Instructions callgrind collected over a whole child process of `pairs` pairs."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={os.path.join(tmp, 'cg.out')}",
             sys.executable, os.path.abspath(__file__), "--child", path, str(size), str(pairs)],
            capture_output=True, text=True, env=env, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"callgrind reported no count:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def per_pair(path: str, size: int, pairs: int) -> float:
    return (instructions(path, size, SHORT + pairs) - instructions(path, size, SHORT)) / pairs


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=100_000, help="pairs the long loop adds (default 100000)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_core_instructions.json"))
    ap.add_argument("--child", nargs=3, metavar=("PATH", "SIZE", "PAIRS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("bench_core_instructions: needs valgrind (callgrind) on PATH", file=sys.stderr)
        return 2
    rows: List[Dict] = []
    for name, size in CASES:
        core, pools = (round(per_pair(path, size, args.pairs), 1) for path in PATHS)
        rows.append({"case": name, "size": size, "instructions_per_pair": core,
                     "pools_instructions_per_pair": pools, "pools_ratio": round(pools / core, 3),
                     "pairs": args.pairs})
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'core':>8}  {'device pools':>12}  {'ratio':>5}   (instructions/pair)")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['instructions_per_pair']:>8.1f}  "
              f"{r['pools_instructions_per_pair']:>12.1f}  {r['pools_ratio']:>5.2f}")
    env = environment()
    env["command"] = "python benchmarks/bench_core_instructions.py" + (
        f" --pairs {args.pairs}" if args.pairs != 100_000 else "")
    with open(args.out, "w") as f:
        json.dump({"environment": env, "backend": "virtual",
                   "pools": "device 0's pools on a fake device, through the C hooks, captures told",
                   "method": "callgrind, long loop minus short loop", "results": rows}, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
