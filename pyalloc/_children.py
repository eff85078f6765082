"""pyalloc, and its out-of-memory watch, in the processes that a program run by
``pyalloc run`` or ``pyalloc oom`` (or armed with ``pyalloc.watch_oom()``) starts.

A process forked from the program inherits pyalloc as its allocator with the
rest of its memory. A process started by multiprocessing's ``spawn`` or
``forkserver`` methods (``torch.multiprocessing.spawn``, DDP without torchrun,
spawn-context DataLoader workers and pools) is a new interpreter, which would
run PyTorch's own allocator: under ``strategy:vmm`` it could not even open the
CUDA tensors its parent sends it.

Such a child reads, before anything else, the "preparation data" its parent
pickles for it (``multiprocessing.spawn.get_preparation_data``: sys.path, the
main module to import, ...); ``spawn.prepare()`` uses the keys it knows and
ignores the others. ``reach_children()`` adds one key whose unpickling installs
pyalloc in the child, with the parent's settings and route, before the child
imports the program's main module or runs its target, so before its first CUDA
work; the child in turn reaches its own children. That install leaves the CUDA
driver alone (no torch.cuda.is_available(), no cuInit), since the driver reads
CUDA_VISIBLE_DEVICES once, when it starts, and a target commonly sets it first
(``os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)``); a child without a GPU or
driver hears so at its first CUDA use. The parent already named the
PYTORCH_ALLOC_CONF keys not applied: a child does not repeat them. Where the install fails in a
child, it says so on stderr, naming the process, and the child runs on
PyTorch's allocator. This needs no file on sys.path (no sitecustomize, no
``.pth``) and does not touch interpreters that are not multiprocessing children:
a Python program started with ``subprocess`` gets ``PYALLOC_CONF`` only, and
must call ``pyalloc.install()`` or be started with ``pyalloc run`` itself.

A watch (oom_watch, through ``carry``) travels the same way: a spawn or forkserver child
arms ``watch_oom()`` with its parent's settings (the folder made absolute), after
pyalloc's install where that travels too, and keeps its own snapshots, at most
``max_snapshots`` of them; a child that never uses CUDA (a DataLoader worker) says
nothing of it. Children started after the watch closes arm none.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

#: The preparation-data keys; multiprocessing's prepare() leaves unknown keys alone.
KEY = "pyalloc_install"


class _InstallOnArrival:
    """Pickled into a child's preparation data; unpickling it installs pyalloc there."""

    def __init__(self, conf: str, bridge: Optional[bool], patch_torch: bool) -> None:
        self.args = (conf, bridge, patch_torch)

    def __reduce__(self):
        return install_in_child, self.args


def install_in_child(conf: str, bridge: Optional[bool], patch_torch: bool) -> str:
    """Installs pyalloc in a multiprocessing child as its parent has it (what the
    child's preparation data holds under KEY: the route it took, or why not)."""
    from . import cuda

    cuda._state.child = True  # no driver start before the target runs; the parent said the notes
    try:
        cuda.install(conf, bridge=bridge, patch_torch=patch_torch)
    except Exception as e:  # the child still runs: say loudly on what
        print(f"pyalloc: WARNING: process {os.getpid()}, started by multiprocessing, runs PyTorch's own "
              f"CUDA allocator, not pyalloc: {e}", file=sys.stderr, flush=True)
        return f"not installed: {e}"
    reach_children(conf, bridge, patch_torch)
    return "installed"


def reach_children(conf: str, bridge: Optional[bool], patch_torch: bool) -> bool:
    """Makes every spawn and forkserver child this process starts install pyalloc
    with these arguments. False, after a warning, where this Python's multiprocessing
    has no preparation data to carry it."""
    return _carry(KEY, _InstallOnArrival(conf, bridge, patch_torch))


def carry(key: str, value: Any) -> bool:
    """Puts ``value`` in the preparation data of every spawn and forkserver child
    this process starts, under ``key``: unpickled there before the child imports the
    program's main module (how oom_watch arms its watch in children). False, after a
    warning, where this Python's multiprocessing has no preparation data."""
    return _carry(key, value)


def forget(key: str) -> None:
    """Children started from now on get nothing under ``key``."""
    _ARRIVALS.pop(key, None)


#: What each child gets in its preparation data, by key, in the order carried.
_ARRIVALS: Dict[str, Any] = {}


def _carry(key: str, value: Any) -> bool:
    try:
        from multiprocessing import spawn
        original = spawn.get_preparation_data
    except (ImportError, AttributeError):
        print("pyalloc: WARNING: this Python's multiprocessing has no spawn.get_preparation_data: "
              "processes the program starts with spawn or forkserver get neither pyalloc's install "
              "nor its out-of-memory watch (fork children inherit both)", file=sys.stderr, flush=True)
        return False
    _ARRIVALS[key] = value
    original = getattr(original, "__wrapped__", original)  # once, however often asked

    def get_preparation_data(name):
        data = original(name)
        data.update(_ARRIVALS)
        return data

    get_preparation_data.__wrapped__ = original
    spawn.get_preparation_data = get_preparation_data
    return True
