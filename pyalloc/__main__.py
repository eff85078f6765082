"""The pyalloc command line: ``pyalloc <command> ...`` or ``python -m pyalloc <command> ...``.

Each command lives in its own module, which provides ``add_arguments(parser)``
and ``main(args) -> int``; this file only dispatches.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# (command, module, one-line help)
COMMANDS = [
    ("run", "pyalloc.launcher", "run a Python script with pyalloc installed as torch's CUDA allocator"),
    ("replay", "pyalloc.replay", "replay recorded allocation traces through pyalloc (no GPU needed)"),
    ("record", "pyalloc.record", "record a program's allocation trace as a memory snapshot"),
    ("oom", "pyalloc.oom",
     "run a program and, if it runs out of GPU memory, keep a snapshot and say why"),
    ("doctor", "pyalloc.doctor", "check that this machine is ready for pyalloc: driver, devices, torch, live test"),
    ("bridge", "pyalloc.bridge", "build the bridge to PyTorch's allocator interface, or say where it is"),
]


DESCRIPTION = "pyalloc, a CUDA caching allocator for PyTorch: run, replay, record or watch for OOMs."


def _version() -> str:
    try:
        from . import __version__
    except ImportError:  # the compiled module is missing: say so, but still answer
        return "pyalloc (not built)"
    return f"pyalloc {__version__}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyalloc", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in COMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        parser.error(f"the '{args.command}' command is not available in this build")
    return importlib.import_module(args._module).main(args)


if __name__ == "__main__":
    sys.exit(main())
