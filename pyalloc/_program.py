"""Running a Python program as ``__main__`` in this process, as ``python`` would.

``pyalloc run``, ``pyalloc record`` and ``pyalloc oom`` run the user's program
inside their own process, after pyalloc is installed or the recording armed.
The program must not be able to tell: ``sys.argv`` is the script and its
arguments as typed, ``sys.path[0]`` is the script's folder (symbolic links
resolved) or, for ``-m``, the working folder, in place of the entry the pyalloc
command itself got (its bin folder, or the working folder of ``python -m
pyalloc``), and ``__file__`` is absolute. The commands use this one function,
so they cannot drift apart; ``record`` and
``oom`` also read the command line the same way (``parse_command``, and
``check_command`` before anything is armed: ``python
[flags] script.py args``, ``python -m module args`` or ``script.py args``) and
run it with ``run_program``, which turns the program's end into an exit status.
Python's own options before the script are applied where a running interpreter
can take them (-u, -B, -W, -X dev, -X faulthandler) and refused, with the
command line that applies them, where they act only as Python starts.
``positive`` reads the positive numbers their options take (``--history``...).
"""
from __future__ import annotations

import argparse
import builtins
import contextlib
import faulthandler
import io
import os
import runpy
import sys
import traceback
import types
import warnings
import zipfile
from typing import Callable, Iterator, List, Tuple

#: Python's options that take a value, joined (-Wonce) or the next word (-W once).
_WITH_VALUE = "WX"
#: Options applied to the running interpreter (_applied): -u (stdout and stderr
#: written through, line by line), -B, -W, -X dev (its warnings filter and
#: faulthandler), -X faulthandler; -q does nothing to a script. The others act at
#: Python's start (-O, -E, -s, -S, -I, ...): refused, since taking them and running
#: the program without them would be a silent lie.
_APPLIED = "uBq"
_APPLIED_X = ("dev", "faulthandler")


class CommandError(RuntimeError):
    """The program cannot be run as asked; the message says why."""


def positive(kind: type, what: str) -> Callable[[str], float]:
    """An argparse type: a positive `kind` (int or float), "_" and "," allowed
    between digits; `what` names it in the error ("must be a positive number of
    entries, not 0")."""
    def parse(text: str):
        try:
            value = kind(text.replace("_", "").replace(",", ""))
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive {what}, not {text}")
        return value

    return parse


def parse_command(argv: List[str], tool: str = "pyalloc oom") -> Tuple[str, str, List[str]]:
    """("path" or "module", target, args) from ``python [options] script.py args``,
    ``python -m module args`` or ``script.py args``, a leading ``--`` dropped.
    CommandError for what cannot be run inside this process; ``tool`` (the
    pyalloc command) is named in the advice."""
    kind, target, args, _ = _parse(argv, tool)
    return kind, target, args


def check_command(argv: List[str], tool: str = "pyalloc oom") -> Tuple[str, str, List[str]]:
    """parse_command, and the program there to run: a script, or a folder or zip
    file with ``__main__.py``, as python takes them. For the commands to call
    before they arm or install anything."""
    kind, target, args = parse_command(argv, tool)
    _check_target(kind, target)
    return kind, target, args


def _check_target(kind: str, target: str) -> None:
    if kind != "path":
        return  # a module is found as it is imported, as python -m finds it
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "__main__.py")):
            raise CommandError(f"{target}: a folder with no __main__.py: python cannot run it")
    elif not os.path.isfile(target):
        raise CommandError(f"{target}: no such script")
    elif zipfile.is_zipfile(target):
        with zipfile.ZipFile(target) as z:
            if "__main__.py" not in z.namelist():
                raise CommandError(f"{target}: a zip file with no __main__.py: python cannot run it")


def _parse(argv: List[str], tool: str) -> Tuple[str, str, List[str], List[Tuple[str, str]]]:
    """parse_command's reading, with the Python options to apply: (letter, value)."""
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CommandError("no program given: name it after '--': -- python script.py [args]")
    if os.path.basename(argv[0]) == "torchrun":
        _refuse_launcher(tool)
    if os.path.basename(argv[0]).startswith("python"):
        parsed = _parse_python(argv[1:], tool)
        if parsed[0] == "module" and parsed[1] in _LAUNCHERS:
            _refuse_launcher(tool)
        return parsed
    if argv[0].endswith(".py"):
        return "path", argv[0], argv[1:], []
    raise CommandError(
        f"only Python programs can be run here (they run inside this process), not {argv[0]!r}"
    )


_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")


def _refuse_launcher(tool: str) -> None:
    """torchrun starts its workers as processes of its own, which a watch or a
    recording in this process would never see: the tool goes inside it instead."""
    output = "-o DIR" if tool.endswith("oom") else "-o OUT.pickle"
    raise CommandError(f"torchrun starts its workers as processes of their own, which {tool} would "
                       f"not see from here: run {tool} inside it instead: "
                       f"torchrun --nproc-per-node=N -m {tool} {output} -- train.py [args]")


def _parse_python(rest: List[str], tool: str) -> Tuple[str, str, List[str], List[Tuple[str, str]]]:
    """Reads ``[options] (script | -m module) args`` as Python does (letters may be
    grouped: -uB; a value joined or the next word: -Werror, -W error)."""
    options: List[Tuple[str, str]] = []
    while rest and rest[0].startswith("-") and rest[0] != "-":
        word = rest.pop(0)
        if word.startswith("--"):
            _refuse(word, tool)
        letters = word[1:]
        for i, letter in enumerate(letters):
            if letter == "m":
                module = letters[i + 1:] or (rest.pop(0) if rest else "")
                if not module:
                    break
                return "module", module, rest, options
            if letter in _WITH_VALUE:
                value = letters[i + 1:] or (rest.pop(0) if rest else "")
                if not value:
                    raise CommandError(f"Python option -{letter} needs a value")
                if letter == "X" and value.split("=")[0] not in _APPLIED_X:
                    _refuse(f"-X {value}" if not letters[i + 1:] else f"-X{value}", tool)
                options.append((letter, value))
                break
            if letter not in _APPLIED:
                _refuse(f"-{letters}" if len(letters) <= 2 and letters == letter * len(letters)
                        else f"-{letter}", tool)
            options.append((letter, ""))
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:], options
    raise CommandError("expected 'python script.py [args]' or 'python -m module [args]'")


def _refuse(option: str, tool: str) -> None:
    if option == "-c":
        raise CommandError("python -c runs code, not a program file: write it to a script, "
                           "and give its path")
    raise CommandError(
        f"Python option {option} cannot be applied to a program that runs inside this process "
        f"(it acts as Python starts): give it to the Python that runs pyalloc instead: "
        f"python {option} -m {tool} ... -- script.py [args]")


@contextlib.contextmanager
def _applied(options: List[Tuple[str, str]]) -> Iterator[None]:
    """The Python options that can act on a running interpreter, in force while the
    program runs, then undone (``pyalloc record`` goes on after it)."""
    saved_bytecode, saved_warnoptions = sys.dont_write_bytecode, sys.warnoptions[:]
    saved_faulthandler = faulthandler.is_enabled()
    saved_streams = [(s, s.line_buffering, s.write_through) for s in (sys.stdout, sys.stderr)
                     if isinstance(s, io.TextIOWrapper)]
    warns = [value for letter, value in options if letter == "W"]
    xs = [value.split("=")[0] for letter, value in options if letter == "X"]
    with warnings.catch_warnings():
        if "dev" in xs:
            warnings.simplefilter("default")  # dev mode's filter, below the -W options
        if warns:
            sys.warnoptions.extend(warns)  # multiprocessing passes them on to its children
            warnings._processoptions(warns)  # type: ignore[attr-defined]  # as Python's start does
        if "dev" in xs or "faulthandler" in xs:
            faulthandler.enable()
        if any(letter == "B" for letter, _ in options):
            sys.dont_write_bytecode = True
        if any(letter == "u" for letter, _ in options):
            for stream, _, _ in saved_streams:
                stream.reconfigure(line_buffering=True, write_through=True)
        try:
            yield
        finally:
            sys.dont_write_bytecode = saved_bytecode
            sys.warnoptions[:] = saved_warnoptions
            if not saved_faulthandler and faulthandler.is_enabled():
                faulthandler.disable()
            for stream, line_buffering, write_through in saved_streams:
                if not stream.closed:
                    stream.reconfigure(line_buffering=line_buffering, write_through=write_through)


def run_program(argv: List[str], tool: str = "pyalloc oom") -> int:
    """Runs ``python [options] script.py args`` (or ``-m module``) as ``__main__`` in
    this process, with the Python options that a running interpreter can take; its
    exit status. An exception in the program is printed, status 1."""
    kind, target, args, options = _parse(argv, tool)
    _check_target(kind, target)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with _applied(options):
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
