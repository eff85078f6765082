"""pyalloc oom on a real GPU: a program that catches its out-of-memory error, run
under ``pyalloc oom --allocator ALLOCATOR``, leaves a snapshot of the device that
holds the history from its first allocation and the error, and a verdict from
the child process whose figures are those ``pyalloc replay`` gives the file.

    oom_watch.py torch|pyalloc DIR

What the tests without a GPU leave to this check (tests/cli/test_oom_watch.py
fakes torch's entry points): that torch's history and observer, queued with
torch.cuda._lazy_call, are in place when the program initialises CUDA; what the
observers really pass; that torch's or pyalloc's real snapshot replays.
"""
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time

import torch

MiB = 1 << 20

PROGRAM = """
    import torch
    keep = torch.ones(MiB, device="cuda")  # the first allocation: 4 MiB
    free, total = torch.cuda.mem_get_info()
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or a RuntimeError on the C hooks
        assert "out of memory" in str(e), e
        print("CAUGHT", total, flush=True)
    assert float(keep.sum()) == MiB
"""


def wait_for(path, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
    return path


def main():
    allocator, folder = sys.argv[1], sys.argv[2]
    program = os.path.join(folder, "program.py")
    with open(program, "w") as f:
        f.write(textwrap.dedent(PROGRAM).replace("MiB", str(MiB)))
    out = os.path.join(folder, "oom")
    run = subprocess.run([sys.executable, "-m", "pyalloc", "oom", "-o", out, "--allocator", allocator,
                          "--", "python", program], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    [caught] = [line for line in run.stdout.splitlines() if line.startswith("CAUGHT")]
    total = int(caught.split()[1])

    path = os.path.join(out, "oom-rank0-cuda0-1.pickle")
    with open(path, "rb") as f:
        snap = pickle.load(f)
    meta = snap["pyalloc_oom"]
    assert meta["device"] == 0 and meta["device_total_bytes"] == total, (meta, total)
    assert meta["allocator"] == ("pyalloc" if allocator == "pyalloc" else "pytorch"), meta
    events = snap["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    assert allocs and allocs[0]["size"] == 4 * MiB, allocs[:3]  # from the first allocation
    assert any(e["action"] == "oom" for e in events), [e["action"] for e in events]
    assert all(not e.get("frames") for e in events), "frames recorded without --frames"

    verdict = json.loads(open(wait_for(os.path.join(out, "oom-rank0-cuda0-1.verdict.json"))).read())
    assert verdict["status"] == "done", verdict
    replayed = os.path.join(folder, "replay.json")
    subprocess.run([sys.executable, "-m", "pyalloc", "replay", path, "--json", replayed],
                   check=True, capture_output=True, timeout=120)
    rows = json.loads(open(replayed).read())
    assert verdict["ooms"] == rows[0]["recorded_ooms"], (verdict["ooms"], rows[0]["recorded_ooms"])
    assert f"pyalloc oom: out of memory on cuda:0: snapshot {path};" in run.stderr, run.stderr
    for line in verdict["verdict"]:  # the child shares the program's stderr
        assert f"pyalloc oom: {line}" in run.stderr, (line, run.stderr)
    print("OK")


if __name__ == "__main__":
    main()
