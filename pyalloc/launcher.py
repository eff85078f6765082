"""``pyalloc run``: run a Python program with pyalloc installed as torch's CUDA allocator.

    pyalloc run [--conf SETTINGS] [--no-patch-torch] script.py [args ...]
    pyalloc run [--conf SETTINGS] [--no-patch-torch] -m module [args ...]
    torchrun --nproc-per-node=N -m pyalloc run train.py [args ...]

pyalloc is installed (settings from PYALLOC_CONF, then --conf) before the
program's first line runs; the program then runs as ``__main__`` with its own
``sys.argv``, as under ``python script.py`` or ``python -m module``. The
effective settings are exported in PYALLOC_CONF for the processes it starts;
those multiprocessing starts with spawn or forkserver install pyalloc before
they run anything of the program, and forked ones inherit it (_children.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import _children
from ._program import run_as_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "pyalloc run [--conf SETTINGS] [--no-bridge] [--no-patch-torch] (script.py | -m module) [args ...]"
    )
    parser.epilog = (
        "Settings are 'key:value,...' (e.g. pool_size:40GiB,max_pool_size:70GiB); "
        "--conf overrides PYALLOC_CONF key by key."
    )
    parser.add_argument("--conf", metavar="SETTINGS", default=None,
                        help="pyalloc settings, on top of those in PYALLOC_CONF")
    parser.add_argument("--no-bridge", action="store_true",
                        help="use CUDAPluggableAllocator's C hooks rather than the bridge")
    parser.add_argument("--no-patch-torch", action="store_true",
                        help="hooks route: leave torch.cuda.memory_stats() and friends untouched")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="module ...",
                        help="run a library module as a script, like python -m")
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="script.py ...",
                        help="the program and its arguments")


def _fail(message: str) -> int:
    print(f"pyalloc run: error: {message}", file=sys.stderr)
    return 1


def main(args: argparse.Namespace) -> int:
    command: List[str] = args.module if args.module is not None else args.script
    if not command:
        return _fail("name a script (pyalloc run script.py ...) or a module (pyalloc run -m module ...)")
    target, argv = command[0], command[1:]
    is_module = args.module is not None
    if not is_module and not os.path.exists(target):
        return _fail(f"cannot open {target!r}: no such file")

    try:
        install_for_program(args.conf, no_bridge=args.no_bridge, patch_torch=not args.no_patch_torch)
    except (RuntimeError, ValueError, TypeError) as e:
        return _fail(str(e))
    run_as_main("module" if is_module else "path", target, argv)
    return 0


def install_for_program(conf: Optional[str], no_bridge: bool = False, patch_torch: bool = True) -> None:
    """Installs pyalloc (PYALLOC_CONF, then ``conf``) for a program this process is
    about to run, and for the processes it will start; RuntimeError, ValueError or
    TypeError say why it cannot be. ``pyalloc oom --allocator pyalloc`` installs so too."""
    from . import cuda

    text = cuda.settings_text(conf)
    cuda.install(conf, bridge=False if no_bridge else None, patch_torch=patch_torch)
    # Processes the program starts use the same settings: forked ones inherit pyalloc,
    # spawn and forkserver ones install it on arrival, on the route this one took.
    os.environ[cuda.CONF_ENV] = text
    taken = {"bridge": True, "hooks": False}.get(cuda._state.route or "")
    _children.reach_children(text, False if no_bridge else taken, patch_torch)
