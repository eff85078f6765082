"""Running a Python program as ``__main__`` in this process, as ``python`` would.

``pyalloc run``, ``pyalloc record`` and ``pyalloc oom`` run the user's program
inside their own process, after pyalloc is installed or the recording armed.
The program must not be able to tell: ``sys.argv`` is the script and its
arguments as typed, ``sys.path[0]`` is the script's folder (symbolic links
resolved) or, for ``-m``, the working folder, in place of the entry the pyalloc
command itself got (its bin folder, or the working folder of ``python -m
pyalloc``), and ``__file__`` is absolute. The commands use this one function,
so they cannot drift apart; ``record`` and
``oom`` also read the command line the same way (``parse_command``: ``python
[flags] script.py args``, ``python -m module args`` or ``script.py args``) and
run it with ``run_program``, which turns the program's end into an exit status.
"""
from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import traceback
import types
from typing import List, Tuple

_PYTHON_FLAGS_WITH_VALUE = ("-X", "-W")
_PYTHON_FLAGS = ("-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-I", "-q")


class CommandError(RuntimeError):
    """The program cannot be run as asked; the message says why."""


def parse_command(argv: List[str]) -> Tuple[str, str, List[str]]:
    """("path" or "module", target, args) from ``python [flags] script.py args``,
    ``python -m module args`` or ``script.py args``, a leading ``--`` dropped."""
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CommandError("no program given: name it after '--': -- python script.py [args]")
    if os.path.basename(argv[0]).startswith("python"):
        rest = argv[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            flag = rest.pop(0)
            if flag in _PYTHON_FLAGS_WITH_VALUE and rest:
                rest.pop(0)
            elif flag not in _PYTHON_FLAGS and not flag.startswith(_PYTHON_FLAGS_WITH_VALUE):
                raise CommandError(f"unsupported Python option {flag!r}: "
                                   "the program runs inside this process")
        if rest[:1] == ["-m"] and len(rest) >= 2:
            return "module", rest[1], rest[2:]
        if rest and not rest[0].startswith("-"):
            return "path", rest[0], rest[1:]
        raise CommandError("expected 'python script.py [args]' or 'python -m module [args]'")
    if argv[0].endswith(".py"):
        return "path", argv[0], argv[1:]
    raise CommandError(
        f"only Python programs can be run here (they run inside this process), not {argv[0]!r}"
    )


def run_program(argv: List[str]) -> int:
    """Runs ``python script.py args`` (or ``-m module``) as ``__main__`` in this
    process; its exit status. An exception in the program is printed, status 1."""
    kind, target, args = parse_command(argv)
    if kind == "path" and not os.path.isfile(target):
        raise CommandError(f"{target}: no such script")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        run_as_main(kind, target, args)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


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
