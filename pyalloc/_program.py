"""Running a Python program as ``__main__`` in this process, as ``python`` would.

``pyalloc run`` and ``pyalloc record`` both run the user's program inside their
own process, after pyalloc is installed. The program must not be able to tell:
``sys.argv`` is the script and its arguments as typed, ``sys.path[0]`` is the
script's folder (symbolic links resolved) or, for ``-m``, the working folder,
in place of the entry the pyalloc command itself got (its bin folder, or the
working folder of ``python -m pyalloc``), and ``__file__`` is absolute. Both
commands use this one function, so they cannot drift apart.
"""
from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types
from typing import List


def run_as_main(kind: str, target: str, args: List[str]) -> None:
    """Runs ``target`` (kind "path": a script file; "module": a module name, as
    ``python -m``) as ``__main__`` with ``args``. Exceptions, SystemExit included,
    propagate; sys.argv, sys.path and sys.modules['__main__'] are left as the
    program left them, except the ``__main__`` entry of a script file, restored."""
    sys.argv = [target] + list(args)
    if kind == "module":
        sys.path[:1] = [os.getcwd()]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif os.path.isfile(target) and target.endswith(".py"):
        sys.path[:1] = [os.path.dirname(os.path.realpath(target))]
        _run_file(os.path.abspath(target))
    else:  # a folder or zip file with __main__.py: runpy puts it first on sys.path itself
        sys.path[:1] = []
        runpy.run_path(target, run_name="__main__")


def _run_file(path: str) -> None:
    """Runs a source file as the module ``__main__`` with ``__file__`` = ``path``.
    runpy.run_path would also set sys.argv[0] to ``path``, which python leaves as typed."""
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main  # multiprocessing's spawn finds the script through it
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
