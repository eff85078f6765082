"""The C++ compiler that builds pyalloc's native code, and the C++ runtime each library uses.

A C++ exception thrown inside pyalloc and unwound through torch's frames (the
bridge's c10::OutOfMemoryError; pybind11's translation of every pyalloc error)
must meet one C++ runtime and one unwinder in the process: those torch and
Python were built against, the system's libstdc++ and libgcc_s. A compiler
installed elsewhere (say /opt/gcc/bin/g++, first on PATH) may bring its own,
linked in statically or found through a RUNPATH; then such an exception runs
torch's personality routine under another unwinder and the process dies inside
``_Unwind_*`` with nothing printed. So pyalloc._C (setup.py) and the bridge
(pyalloc/bridge.py) are built with the system g++ by default; CXX (and CC, for
setup.py) in the environment still win.

``pyalloc doctor`` reads each library with readelf: the compiler named in its
``.comment`` section, its RUNPATH or RPATH, and whether it defines its own copy
of ``__cxa_throw`` or ``_Unwind_RaiseException`` (a private runtime: ``nm -D``
cannot see one that a version script hides, ``readelf -sW`` can).

setup.py loads this file by its path before pyalloc is built: it imports
nothing from pyalloc.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

#: The system compiler: the one the distribution's Python and C++ runtime come with.
SYSTEM_COMPILERS = ("/usr/bin/g++", "/usr/bin/c++")
#: Symbols a private copy of the C++ runtime (__cxa_throw) or of the unwinder defines.
RUNTIME_SYMBOLS = ("__cxa_throw", "_Unwind_RaiseException")
#: Shared objects of a C++ runtime that a RUNPATH could make the loader pick.
RUNTIME_LIBRARIES = ("libstdc++.so*", "libgcc_s.so*")


def _on_path(name: str, path: str) -> Optional[str]:
    for folder in filter(None, path.split(os.pathsep)):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def choose_cxx(env: Optional[Mapping[str, str]] = None,
               system: Sequence[str] = SYSTEM_COMPILERS) -> Tuple[Optional[str], str]:
    """(compiler, why): $CXX when set; else the system g++; else g++ or c++ on PATH.
    (None, why) when there is none. ``env`` and ``system`` replace the environment
    and the system compilers' paths (tests)."""
    env = os.environ if env is None else env
    if env.get("CXX"):
        return env["CXX"], "$CXX"
    for path in system:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, "the system compiler"
    for name in ("g++", "c++"):
        found = _on_path(name, env.get("PATH", ""))
        if found:
            return found, "found on PATH (no system compiler at " + " or ".join(system) + ")"
    return None, "no C++ compiler: neither $CXX, nor " + ", ".join(system) + ", nor g++ or c++ on PATH"


def use_for_setup(env: MutableMapping[str, str], **kwargs) -> Tuple[Optional[str], str]:
    """Makes setuptools compile and link with choose_cxx()'s compiler: sets CXX (C++
    sources and the link, in setuptools 72 and later) and CC (both, before) where
    they are not set. Returns choose_cxx()'s answer."""
    cxx, why = choose_cxx(env, **kwargs)
    if cxx:
        env.setdefault("CXX", cxx)
        env.setdefault("CC", env["CXX"])
    return cxx, why


@functools.lru_cache(maxsize=16)
def _version_line(path: str, mtime: float) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"--version failed: {e}"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if lines else f"--version printed nothing (exit {out.returncode})"


def identity(cxx: str) -> str:
    """'/usr/bin/g++: g++ (Debian 12.2.0-14) 12.2.0': where the compiler is (links
    resolved) and the first line of its --version."""
    path = cxx if os.sep in cxx else shutil.which(cxx) or cxx
    real = os.path.realpath(path)
    try:
        mtime = os.path.getmtime(real)
    except OSError:
        return f"{path}: not found"
    shown = path if real == path else f"{path} -> {real}"
    return f"{shown}: {_version_line(real, mtime)}"


def identity_key(text: str) -> str:
    """A short stable key for a compiler's identity (the bridge's cache folder)."""
    return hashlib.sha1(text.encode()).hexdigest()[:10]


# -- reading a library's C++ runtime ------------------------------------------------------


@dataclass
class RuntimeInfo:
    """What readelf says of one shared library."""

    path: str
    compilers: List[str] = field(default_factory=list)  # the .comment strings
    runpath: List[str] = field(default_factory=list)  # RUNPATH and RPATH entries
    private: List[str] = field(default_factory=list)  # RUNTIME_SYMBOLS it defines itself
    runtime_in_runpath: List[str] = field(default_factory=list)  # C++ runtimes a RUNPATH holds
    error: Optional[str] = None  # why it could not be read


def _readelf(readelf: str, args: List[str], path: str) -> str:
    out = subprocess.run([readelf, *args, path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise OSError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return out.stdout


def _is_system_dir(folder: str) -> bool:
    real = os.path.realpath(folder)
    return any(real == d or real.startswith(d + "/") for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"))


def read_runtime(path: str, readelf: str = "readelf") -> RuntimeInfo:
    """readelf's view of ``path``: compilers, RUNPATH/RPATH, a private C++ runtime."""
    info = RuntimeInfo(path)
    try:
        comment = _readelf(readelf, ["-p", ".comment"], path)
        dynamic = _readelf(readelf, ["-d"], path)
        symbols = _readelf(readelf, ["-sW"], path)
    except (OSError, subprocess.SubprocessError) as e:
        info.error = str(e)
        return info
    for line in comment.splitlines():
        if line.strip().startswith("[") and "]" in line:
            text = line.split("]", 1)[1].strip()
            if text and text not in info.compilers:
                info.compilers.append(text)
    origin = os.path.dirname(os.path.abspath(path))
    for line in dynamic.splitlines():
        if "(RUNPATH)" in line or "(RPATH)" in line:
            value = line.split("[", 1)[-1].rstrip().rstrip("]")
            for entry in filter(None, value.split(":")):
                info.runpath.append(entry)
                folder = entry.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
                if _is_system_dir(folder):
                    continue  # the system's own runtime, the one torch uses
                for pattern in RUNTIME_LIBRARIES:
                    info.runtime_in_runpath += sorted(glob.glob(os.path.join(folder, pattern)))
    for line in symbols.splitlines():
        if "__cxa_throw" not in line and "_Unwind_RaiseException" not in line:
            continue  # torch's libraries list hundreds of thousands of symbols
        # Num: Value Size Type Bind Vis Ndx Name; a defined symbol has a section index, not UND.
        parts = line.split()
        if len(parts) >= 8 and parts[0].endswith(":") and parts[6] != "UND":
            name = parts[7].split("@")[0]
            if name in RUNTIME_SYMBOLS and name not in info.private:
                info.private.append(name)
    info.private.sort(key=RUNTIME_SYMBOLS.index)
    return info


def torch_libraries(torch_dir: Optional[str]) -> List[Tuple[str, str]]:
    """(label, path) of torch's libraries an exception from pyalloc unwinds through."""
    if not torch_dir:
        return []
    names = ("libtorch_python.so", "libc10.so", "libc10_cuda.so", "libtorch_cuda.so")
    lib = os.path.join(torch_dir, "lib")
    return [(f"torch {name}", os.path.join(lib, name)) for name in names
            if os.path.isfile(os.path.join(lib, name))]


def runtime_problems(ours: Dict[str, RuntimeInfo], theirs: Dict[str, RuntimeInfo]) -> List[str]:
    """Why pyalloc's libraries and torch's would not share one C++ runtime: a private
    copy, or a C++ runtime found through a RUNPATH, in one of ours but not in torch's."""
    torch_private = any(i.private for i in theirs.values())
    problems = []
    for label, info in ours.items():
        if info.private and not torch_private:
            problems.append(f"{label} holds a private copy of the C++ runtime ({', '.join(info.private)}) "
                            "that torch's libraries do not")
        if info.runtime_in_runpath:
            problems.append(f"{label} finds a C++ runtime through its RUNPATH ({info.runtime_in_runpath[0]})")
    return problems
