"""``pyalloc oom``: run a program and, if it runs out of GPU memory, keep a snapshot and say why.

    pyalloc oom [-o DIR] [--allocator torch|pyalloc] [--conf SETTINGS] [--frames]
                [--max-snapshots N] [--history N] [--verdict-timeout SECONDS]
                -- python train.py [args]          (or: -- python -m module [args])
    torchrun --nproc-per-node=N -m pyalloc oom -o DIR -- train.py [args]

The program runs in this process as ``__main__`` (pyalloc._program), under
PyTorch's allocator as its own settings make it (``--allocator torch``, the
default) or under pyalloc, installed first as ``pyalloc run`` installs it
(``--allocator pyalloc``, settings from PYALLOC_CONF then ``--conf``). The
watch is ``pyalloc.watch_oom()`` (pyalloc/oom_watch.py): the history from the
first allocation, and at each out-of-memory error a snapshot in DIR (one file a
rank, device and error, ``oom-rank{RANK}-cuda{DEV}-{k}.pickle``) and a verdict
on it from a child process. The exit status is the program's.
"""
from __future__ import annotations

import argparse
import sys
from typing import List

from ._program import CommandError, check_command, positive, run_program
from .oom_watch import ALLOCATORS, DEFAULT_DIR, HISTORY_ENTRIES, MAX_SNAPSHOTS, VERDICT_TIMEOUT, watch_oom


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("pyalloc oom [-o DIR] [--allocator torch|pyalloc] [--conf SETTINGS] [--frames]\n"
                    "                   [--max-snapshots N] [--history N] [--verdict-timeout SECONDS]\n"
                    "                   -- python script.py [args]")
    parser.epilog = (
        "Each snapshot is a plain pickle (pytorch.org/memory_viz reads it); its verdict, printed "
        "on stderr, is also written beside it (FILE.verdict.txt and FILE.verdict.json). "
        "Under torchrun: torchrun --nproc-per-node=N -m pyalloc oom -o DIR -- train.py")
    parser.add_argument("-o", "--output", default=DEFAULT_DIR, metavar="DIR",
                        help=f"the folder for snapshots and verdicts (default: ./{DEFAULT_DIR})")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="torch",
                        help="torch (default): PyTorch's own allocator, as PYTORCH_ALLOC_CONF sets it; "
                             "pyalloc: install pyalloc first, as pyalloc run does")
    parser.add_argument("--conf", default=None, metavar="SETTINGS",
                        help="--allocator pyalloc: pyalloc settings, on top of those in PYALLOC_CONF")
    parser.add_argument("--frames", action="store_true",
                        help="record each allocation's Python stack frames (PyTorch's allocator; "
                             "slower, larger files)")
    parser.add_argument("--max-snapshots", type=positive(int, "number"), default=MAX_SNAPSHOTS,
                        metavar="N", help=f"snapshots kept per process (default {MAX_SNAPSHOTS}): "
                                          "the first out-of-memory error and those after it")
    parser.add_argument("--history", type=positive(int, "number of events"), default=HISTORY_ENTRIES,
                        metavar="N", help=f"events of history kept per device (pyalloc: per pool; "
                                          f"default {HISTORY_ENTRIES:,})")
    parser.add_argument("--verdict-timeout", type=positive(float, "number of seconds"),
                        default=VERDICT_TIMEOUT, metavar="SECONDS",
                        help=f"time each verdict may take (default {VERDICT_TIMEOUT:g}); the snapshot "
                             "stays either way")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- python script.py [args]",
                        help="the program, run inside this process")


def _fail(message: str, status: int = 2) -> int:
    print(f"pyalloc oom: error: {message}", file=sys.stderr)
    return status


def main(args: argparse.Namespace) -> int:
    argv: List[str] = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    try:
        check_command(argv)  # a bad command line, or no program there, fails before anything is armed
    except CommandError as e:
        return _fail(str(e))
    if args.conf is not None and args.allocator != "pyalloc":
        return _fail("--conf sets pyalloc's settings: it goes with --allocator pyalloc")
    try:
        if args.allocator == "pyalloc":
            from .launcher import install_for_program

            install_for_program(args.conf)
        watch = watch_oom(args.output, allocator=args.allocator, frames=args.frames,
                          max_snapshots=args.max_snapshots, history=args.history,
                          verdict_timeout=args.verdict_timeout)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        return _fail("watching PyTorch's allocator needs PyTorch, which is not installed "
                     "(pip install torch; see https://pytorch.org/get-started/)")
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        return _fail(str(e))
    watch.command = argv
    try:
        return run_program(argv)
    except CommandError as e:
        return _fail(str(e))
    finally:
        watch.close()
