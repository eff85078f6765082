"""Replaying recorded PyTorch memory snapshots through pyalloc, with no GPU: would
pyalloc have held this run, and in how much memory, beside PyTorch's allocator?

The public entry, all a user imports::

    from pyalloc.replay import replay
    result = replay("snapshot.pickle")        # one device's ReplayResult
    results = replay_devices("snapshot.pickle")  # one per device

and ``pyalloc replay FILE...`` (``add_arguments``/``main``, which pyalloc/__main__.py
registers). Behind it, one concern a module:

- ``snapshot_io``: loads a snapshot safely, reduces each device to flat event arrays,
  and writes snapshots (``pyalloc record``, the OOM watch);
- ``settings``: the recorded settings of PyTorch's allocator the model honours;
- ``run``: plans a trace into allocations and replays it (``replay``, the CLI);
- ``allocators``: the three allocators a trace runs through, and the budget search;
- ``validate``: the model against the device calls a snapshot recorded;
- ``oom``: each recorded out-of-memory error, replayed as the request it was;
- ``result`` and ``report``: what a replay found, and its table, sentences and plots.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> the module that holds it. Loaded on first use: pyalloc's own modules that
# write snapshots (the OOM watch, `pyalloc record`) import snapshot_io alone, and a
# program under pyalloc should not pay for loading the replay on `import pyalloc`.
_PUBLIC = {
    "NoHistoryError": "run", "ReplayPlan": "run", "add_arguments": "run", "main": "run", "plan_trace": "run",
    "replay": "run", "replay_devices": "run", "ReplayResult": "result", "TraceError": "snapshot_io",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_PUBLIC))
