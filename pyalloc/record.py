"""Recording a program's allocation requests as a memory snapshot.

``pyalloc record -o OUT.pickle[.gz] -- python script.py [args]`` runs the
script in this process, as ``__main__``, and writes what it asked the
allocator for in PyTorch's memory-snapshot format, which ``pyalloc replay``
(and pytorch.org/memory_viz) read:

- On a GPU, pyalloc is installed as torch's CUDA allocator and its own history
  is recorded and dumped (``pyalloc.install``, ``record_history``,
  ``dump_snapshot``): the snapshot then has pyalloc's segments too.
- On a CPU, the script runs under ``torch.profiler.profile(profile_memory=True)``
  and the profiler's allocation events (address, bytes, time) become ``alloc``,
  ``free_requested`` and ``free_completed`` events on stream 0, with no
  segments: every request the CPU run made, with its exact size, in order.
  A CPU run makes somewhat different temporaries than a CUDA run of the same
  model; the pattern of sizes, order and lifetimes is the program's own.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._program import CommandError, check_command, parse_command, positive, run_program
from .replay.snapshot_io import write_snapshot

__all__ = ["RecordError", "add_arguments", "main", "profiler_snapshot", "record_program", "run_program"]

#: The program cannot be recorded as asked; the message says why. The one error of
#: every command that runs a program in its own process (pyalloc._program).
RecordError = CommandError


# ---------------------------------------------------------------------------
# CPU: the profiler's memory events


def profiler_snapshot(prof: Any, source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A memory snapshot from a finished ``torch.profiler.profile(profile_memory=True)``:
    its CPU allocation events as alloc / free_requested / free_completed on stream 0."""
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
    except (AttributeError, ImportError) as e:
        raise RecordError(f"this torch's profiler does not expose its allocation events ({e})") from None
    found: List[Tuple[int, int, int, int]] = []  # (time ns, order, ptr, signed bytes)
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu" and f.alloc_size != 0:
                found.append((node.start_time_ns, len(found), f.ptr, f.alloc_size))
        stack.extend(reversed(node.children))
    found.sort()  # by time; events of the same nanosecond keep their tree order
    t0 = found[0][0] if found else 0
    events: List[Dict[str, Any]] = []
    for t, _, ptr, nbytes in found:
        us = (t - t0) // 1000
        if nbytes > 0:
            events.append(_event("alloc", ptr, nbytes, us))
        else:
            # A CPU free is done when it returns: requested and completed at once.
            events.append(_event("free_requested", ptr, -nbytes, us))
            events.append(_event("free_completed", ptr, -nbytes, us))
    return {
        "segments": [],
        "device_traces": [events],
        "allocator_settings": {},
        "pyalloc_source": dict(source or {}),
    }


def _event(action: str, addr: int, size: int, time_us: int) -> Dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": []}


def record_cpu(run: Callable[[], Any], source: Optional[Dict[str, Any]] = None) -> Tuple[Any, Dict[str, Any]]:
    """Runs ``run()`` under the profiler; (its return value, the snapshot)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        value = run()
    meta = {"recorded_on": "cpu, torch.profiler profile_memory", "torch": str(torch.__version__)}
    meta.update(source or {})
    return value, profiler_snapshot(prof, meta)


# ---------------------------------------------------------------------------
# GPU: pyalloc's own history


#: How many alloc / free / segment events each pool keeps by default (``--history``).
HISTORY_ENTRIES = 100_000


def record_cuda(run: Callable[[], Any], output: str, max_entries: int = HISTORY_ENTRIES) -> Any:
    """Runs ``run()`` with pyalloc as torch's CUDA allocator, recording the last
    ``max_entries`` events of each pool, and dumps the snapshot to ``output``;
    run()'s return value. A pool whose history filled up is named on stderr."""
    import pyalloc

    hooks = [getattr(pyalloc, n, None) for n in ("install", "record_history", "dump_snapshot")]
    if any(h is None for h in hooks):
        raise RecordError(
            "recording on a GPU needs pyalloc.install, pyalloc.record_history and "
            "pyalloc.dump_snapshot, which this build lacks; record on the CPU with --device cpu"
        )
    install, record_history, dump_snapshot = hooks
    try:
        install()
    except (RuntimeError, ValueError) as e:  # no GPU, a CPU-only torch, bad PYALLOC_CONF
        raise RecordError(f"{e}; record on the CPU with --device cpu") from None
    record_history(True, max_entries)
    value = run()
    dump_snapshot(output)  # a plain pickle, gzip-compressed only for a .gz name
    for device, pool in full_histories(max_entries):
        print(f"pyalloc record: the history of cuda:{device}'s {pool} pool reached its limit of "
              f"{max_entries} entries: any older events were dropped (a larger --history keeps more)",
              file=sys.stderr)
    return value


def full_histories(max_entries: int) -> List[Tuple[int, str]]:
    """(device, pool) of each pool whose history holds ``max_entries`` events: it kept
    the newest and dropped any older ones (each pool's history is a ring of that size)."""
    from . import _C

    return [(d, pool) for d in _C.cuda_devices() for pool in ("general", "buffers", "graph")
            if len(_C.cuda_history(d, pool)) >= max_entries]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def record_program(argv: List[str], output: str, device: str = "auto",
                   history: int = HISTORY_ENTRIES) -> int:
    """Records ``python script.py args`` into ``output``; the program's exit status.

    device: "cuda" (pyalloc's history, the last ``history`` events of each pool),
    "cpu" (the profiler, every event), or "auto" (cuda when torch sees a GPU).
    """
    argv = list(argv[1:] if argv[:1] == ["--"] else argv)
    check_command(argv, "pyalloc record")  # a bad command line fails before anything runs
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    if device == "cuda":
        return record_cuda(lambda: run_program(argv, "pyalloc record"), output, history)
    status, snapshot = record_cpu(lambda: run_program(argv, "pyalloc record"), {"command": list(argv)})
    write_snapshot(snapshot, output)
    return status


# ---------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="OUT.pickle",
                        help="where to write the snapshot (.pickle, or .pickle.gz compressed)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: pyalloc's own history on the GPU; cpu: torch.profiler's memory "
                             "events; auto (default): cuda when torch sees a GPU")
    parser.add_argument("--history", type=positive(int, "number of entries"), default=HISTORY_ENTRIES, metavar="N",
                        help=f"cuda: keep the last N events of each pool (default {HISTORY_ENTRIES:,}); "
                             "a pool that reached N is named, its older events dropped")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- python script.py [args]",
                        help="the program to record, run inside this process")


def main(args: argparse.Namespace) -> int:
    try:
        status = record_program(args.command, args.output, args.device, args.history)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        print("pyalloc record: error: recording needs PyTorch, which is not installed "
              "(pip install torch; see https://pytorch.org/get-started/)", file=sys.stderr)
        return 2
    except RecordError as e:
        print(f"pyalloc record: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"pyalloc record: error: {e}", file=sys.stderr)
        return 1
    events = _count_events(args.output)
    print(f"pyalloc record: wrote {args.output} ({events} events)", file=sys.stderr)
    return status


def _count_events(path: str) -> str:
    from .replay.snapshot_io import TraceError, device_traces, load_snapshot

    try:
        return str(sum(len(t) for t in device_traces(load_snapshot(path))))
    except TraceError:
        return "?"
