"""The C++ compiler that builds pyalloc's native code, and the C++ runtime each library uses.

A C++ exception thrown inside pyalloc and unwound through torch's frames (the
bridge's c10::OutOfMemoryError; pybind11's translation of every pyalloc error)
must meet one C++ runtime and one unwinder in the process: those torch and
Python were built against, the system's libstdc++ and libgcc_s. A compiler
installed elsewhere (say /opt/gcc/bin/g++, named by CXX or first on PATH) may
bring its own, linked in statically or found through a RUNPATH; then such an
exception runs torch's personality routine under another unwinder and the
process dies inside ``_Unwind_*`` with nothing printed.

So pyalloc._C (setup.py) and the bridge (pyalloc/bridge.py) are built with the
system g++ by default. A compiler that CXX (or CC, for setup.py) or PATH names
instead is probed first: it compiles and links a tiny shared library that
throws, which readelf then reads (probe_runtime()). One that links a private
copy of the runtime is set aside for the system compiler, with a one-line
notice; where there is no system compiler to take, the build refuses to
start. Each library built is read again afterwards, and a private runtime
found there (LDFLAGS, LDSHARED) fails the build (private_runtime_problem()).
PYALLOC_ALLOW_PRIVATE_RUNTIME=1 turns both checks off, for those who know the
process will meet no other C++ runtime.

``pyalloc doctor`` reads each library with readelf: the compiler named in its
``.comment`` section, its RUNPATH or RPATH, and whether it defines its own copy
of ``__cxa_throw`` or ``_Unwind_RaiseException`` (a private runtime: ``nm -D``
cannot see one that a version script hides, ``readelf -sW`` can).

setup.py loads this file by its path before pyalloc is built: it imports
nothing from pyalloc.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

#: The system compiler: the one the distribution's Python and C++ runtime come with.
SYSTEM_COMPILERS = ("/usr/bin/g++", "/usr/bin/c++")
#: Symbols a private copy of the C++ runtime (__cxa_throw) or of the unwinder defines.
RUNTIME_SYMBOLS = ("__cxa_throw", "_Unwind_RaiseException")
#: Shared objects of a C++ runtime that a RUNPATH could make the loader pick.
RUNTIME_LIBRARIES = ("libstdc++.so*", "libgcc_s.so*")
#: Another C++ runtime altogether (clang's libc++), which torch's libraries never use.
FOREIGN_RUNTIMES = ("libc++.so", "libc++abi.so")
#: Set to 1, builds go ahead with a compiler that links a private C++ runtime.
ALLOW_PRIVATE_ENV = "PYALLOC_ALLOW_PRIVATE_RUNTIME"


def _on_path(name: str, path: str) -> Optional[str]:
    for folder in filter(None, path.split(os.pathsep)):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def allow_private(env: Optional[Mapping[str, str]] = None) -> bool:
    """PYALLOC_ALLOW_PRIVATE_RUNTIME=1: build with the compiler named, whatever C++
    runtime it links, and do not check the libraries built."""
    env = os.environ if env is None else env
    return env.get(ALLOW_PRIVATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Choice:
    """The compiler that builds pyalloc's native code, and how it was chosen."""

    cxx: Optional[str]  # None: there is none
    why: str  # how it was chosen, or why there is none
    #: Why cxx cannot be used: it links a private C++ runtime and nothing replaces it.
    refused: Optional[str] = None
    #: ("CXX" or "CC", the compiler it named, what the probe found) for each one set aside.
    set_aside: Tuple[Tuple[str, str, str], ...] = ()

    @property
    def notice(self) -> Optional[str]:
        """One line when compilers the environment named were set aside, else None."""
        if not self.set_aside:
            return None
        names = " and ".join(f"${name}={value}" for name, value, _ in self.set_aside)
        return (f"pyalloc: {names} would give pyalloc a private copy of the C++ runtime "
                f"({self.set_aside[0][2]}); building with {self.cxx} instead "
                f"({ALLOW_PRIVATE_ENV}=1 keeps {'it' if len(self.set_aside) == 1 else 'them'})")


def _system_compiler(env: Mapping[str, str], system: Sequence[str]) -> Tuple[Optional[str], str]:
    for path in system:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path, "the system compiler"
    for name in ("g++", "c++"):
        found = _on_path(name, env.get("PATH", ""))
        if found:
            return found, "found on PATH (no system compiler at " + " or ".join(system) + ")"
    return None, "no C++ compiler: neither $CXX, nor " + ", ".join(system) + ", nor g++ or c++ on PATH"


def choose_cxx(env: Optional[Mapping[str, str]] = None, system: Sequence[str] = SYSTEM_COMPILERS,
               probe=None) -> Choice:
    """The compiler to build with: $CXX when set and it links the shared C++ runtime
    (or PYALLOC_ALLOW_PRIVATE_RUNTIME=1); else the system g++; else g++ or c++ on PATH.
    Every compiler but the system's is probed (probe_runtime()). ``env``, ``system``
    and ``probe`` (a function of the compiler returning a Probe) replace the
    environment, the system compilers' paths and the probe (tests)."""
    env = os.environ if env is None else env
    probe = probe or probe_runtime
    fallback, fallback_why = _system_compiler(env, system)
    named = env.get("CXX")
    if named:
        if allow_private(env):
            return Choice(named, f"$CXX; {ALLOW_PRIVATE_ENV}=1: its C++ runtime is not checked")
        found = probe(named)
        if found.runtime == "unknown":
            return Choice(named, f"$CXX; its C++ runtime could not be probed: {found.detail}")
        if found.runtime != "private":
            return Choice(named, "$CXX")
        if fallback is None or fallback in (named, shutil.which(named)) or (
                fallback not in system and probe(fallback).runtime == "private"):
            why = f"$CXX, which links a private copy of the C++ runtime ({found.detail})"
            return Choice(named, why, refused=f"$CXX={named} links a private copy of the C++ runtime "
                          f"({found.detail}) and there is no system compiler ({', '.join(system)}) to "
                          f"build with instead; install g++, or set {ALLOW_PRIVATE_ENV}=1 to build "
                          "with it anyway")
        return Choice(fallback, f"{fallback_why}, not $CXX={named}, which links a private C++ runtime",
                      set_aside=(("CXX", named, found.detail),))
    if fallback is None or fallback in system:
        return Choice(fallback, fallback_why)
    found = probe(fallback)  # first on PATH: perhaps a compiler with its own runtime
    if found.runtime == "private" and not allow_private(env):
        return Choice(fallback, fallback_why, refused=f"{fallback} ({fallback_why}) links a private copy "
                      f"of the C++ runtime ({found.detail}); install the system g++, or set "
                      f"{ALLOW_PRIVATE_ENV}=1 to build with it anyway")
    return Choice(fallback, fallback_why)


def use_for_setup(env: MutableMapping[str, str], **kwargs) -> Choice:
    """Makes setuptools compile and link with choose_cxx()'s compiler: sets CXX (C++
    sources and the link, in setuptools 72 and later) and CC (both, before). A CC
    the environment sets is kept unless it links a private C++ runtime. Returns
    choose_cxx()'s answer, with CC in its set_aside where CC was set aside."""
    choice = choose_cxx(env, **kwargs)
    if choice.cxx is None or choice.refused:
        return choice
    env["CXX"] = choice.cxx
    cc = env.get("CC")
    if not cc:
        env["CC"] = choice.cxx
        return choice
    if cc == choice.cxx or allow_private(env):
        return choice
    found = (kwargs.get("probe") or probe_runtime)(cc)
    if found.runtime != "private":
        return choice
    env["CC"] = choice.cxx
    return dataclasses.replace(choice, set_aside=choice.set_aside + (("CC", cc, found.detail),))


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
    needed: List[str] = field(default_factory=list)  # its NEEDED shared libraries
    error: Optional[str] = None  # why it could not be read

    @property
    def foreign(self) -> List[str]:
        """The NEEDED libraries of another C++ runtime (libc++): never the one torch uses."""
        return [n for n in self.needed if n.startswith(FOREIGN_RUNTIMES)]

    @property
    def is_private(self) -> bool:
        """It holds its own C++ runtime or unwinder, or needs another one (libc++). A
        runtime in its RUNPATH is not counted here: the loader takes a libstdc++.so.6
        already loaded (by torch) for it, so the RUNPATH matters only when pyalloc loads
        first, and the interpreter's own lib folder (conda's) holds torch's runtime anyway."""
        return bool(self.private or self.foreign)

    def describe(self) -> str:
        """What readelf shows of its C++ runtime, in a few words."""
        shared = [n for n in self.needed if n.startswith("libstdc++.so")]
        parts = [f"{', '.join(self.private)} defined in it" if self.private else "",
                 f"NEEDED {self.foreign[0]}, another C++ runtime" if self.foreign else "",
                 f"a C++ runtime in its RUNPATH: {self.runtime_in_runpath[0]}" if self.runtime_in_runpath else "",
                 f"NEEDED {shared[0]}" if shared else "no NEEDED libstdc++.so"]
        return ", ".join(p for p in parts if p)


def _readelf(readelf: str, args: List[str], path: str) -> str:
    out = subprocess.run([readelf, *args, path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise OSError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return out.stdout


def _is_system_dir(folder: str) -> bool:
    """The system's library folders, or the interpreter's own (a conda environment's
    lib/, which Python's LDSHARED puts in every extension's RUNPATH: the runtime there is
    the one Python and torch load)."""
    real = os.path.realpath(folder)
    ours = {os.path.realpath(os.path.join(p, "lib")) for p in (sys.prefix, sys.base_prefix)}
    return real in ours or any(real == d or real.startswith(d + "/")
                               for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"))


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
        if "(NEEDED)" in line:
            info.needed.append(line.split("[", 1)[-1].rstrip().rstrip("]"))
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


# -- what a compiler links ----------------------------------------------------------------

#: A shared library that throws: linked by a compiler, it needs the C++ runtime's
#: __cxa_throw, from libstdc++.so (the shared runtime) or from a copy linked in.
PROBE_SOURCE = ('extern "C" int pyalloc_runtime_probe(int x) {\n'
                '  if (x) throw x;\n'
                '  return x;\n'
                '}\n')


@dataclass(frozen=True)
class Probe:
    """What a compiler's link gives a C++ shared library."""

    compiler: str
    #: "shared": NEEDED libstdc++.so, the runtime torch uses; "private": a copy of the
    #: runtime or unwinder inside, or another runtime (libc++) needed; "none": no C++
    #: runtime at all (a C compiler's link); "unknown": the probe could not be built or read.
    runtime: str
    detail: str  # what readelf showed, or why the probe failed


def probe_runtime(cxx: str, readelf: str = "readelf") -> Probe:
    """Compiles and links PROBE_SOURCE into a shared library with ``cxx`` as setuptools
    and torch.utils.cpp_extension link pyalloc's (``-shared -fPIC``) and reads it.
    ``cxx`` may carry words before or after the program, as CXX may ("ccache g++").
    Remembered per compiler file and its modification time, within the process."""
    words = shlex.split(cxx) or [cxx]
    path = words[0] if os.sep in words[0] else shutil.which(words[0]) or words[0]
    try:
        stat = os.stat(path)
    except OSError as e:
        return Probe(cxx, "unknown", f"{words[0]}: {e.strerror}")
    return _probe(cxx, readelf, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _probe(cxx: str, readelf: str, mtime_ns: int, size: int) -> Probe:
    found = shutil.which(readelf)
    if found is None:
        return Probe(cxx, "unknown", f"{readelf} is not found (binutils)")
    with tempfile.TemporaryDirectory(prefix="pyalloc-probe-") as work:
        source, library = os.path.join(work, "probe.cpp"), os.path.join(work, "libprobe.so")
        with open(source, "w") as f:
            f.write(PROBE_SOURCE)
        try:
            out = subprocess.run([*(shlex.split(cxx) or [cxx]), "-shared", "-fPIC", source, "-o", library],
                                 capture_output=True, text=True, timeout=120, cwd=work)
        except (OSError, subprocess.SubprocessError) as e:
            return Probe(cxx, "unknown", f"it could not be run: {e}")
        if out.returncode != 0 or not os.path.isfile(library):
            last = [line for line in (out.stderr + out.stdout).splitlines() if line.strip()][-1:]
            return Probe(cxx, "unknown", f"it failed to link a test library (exit {out.returncode}"
                         + (f": {last[0].strip()}" if last else "") + ")")
        info = read_runtime(library, found)
    if info.error is not None:
        return Probe(cxx, "unknown", f"its test library cannot be read: {info.error}")
    if info.is_private:
        runtime = "private"
    elif any(n.startswith("libstdc++.so") for n in info.needed):
        runtime = "shared"
    else:
        runtime = "none"
    return Probe(cxx, runtime, info.describe())


def private_runtime_problem(path: str, label: str, env: Optional[Mapping[str, str]] = None,
                            readelf: str = "readelf") -> Optional[str]:
    """Why the library just built at ``path`` must not be used: it holds a private C++
    runtime. None when it does not, when PYALLOC_ALLOW_PRIVATE_RUNTIME=1, or when
    readelf cannot tell (pyalloc doctor says so)."""
    if allow_private(env):
        return None
    found = shutil.which(readelf)
    if found is None:
        return None
    info = read_runtime(path, found)
    if info.error is not None or not info.is_private:
        return None
    return (f"{label} was linked with a private copy of the C++ runtime ({info.describe()}): an "
            "exception from it would unwind through torch's frames under another runtime and crash. "
            "Unset LDFLAGS, LDSHARED, CC and CXX that bring one (or name /usr/bin/g++), or set "
            f"{ALLOW_PRIVATE_ENV}=1 to keep it")


def checked_build_ext(base, refused: Optional[str] = None):
    """setuptools' build_ext ``base``, which refuses to start when ``refused`` says why
    (Choice.refused), and reads each library it built: where one holds a private C++
    runtime, it deletes them and fails (private_runtime_problem())."""

    class CheckedBuildExt(base):
        def run(self):
            if refused:
                raise SystemExit(f"pyalloc: {refused}")
            super().run()
            built = []
            # setuptools builds in build_lib and, with --inplace, copies beside the sources.
            for inplace in dict.fromkeys((self.inplace, False)):
                saved, self.inplace = self.inplace, inplace
                try:
                    built += [self.get_ext_fullpath(ext.name) for ext in self.extensions]
                finally:
                    self.inplace = saved
            for path in dict.fromkeys(p for p in built if os.path.isfile(p)):
                problem = private_runtime_problem(path, os.path.basename(path))
                if problem:
                    for other in built:
                        if os.path.isfile(other):
                            os.remove(other)
                    raise SystemExit(f"pyalloc: {problem}")

    return CheckedBuildExt


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
    copy, another runtime (libc++), or a C++ runtime found through a RUNPATH outside the
    system's and the interpreter's lib folders, in one of ours but not in torch's. Builds
    refuse only the first two (private_runtime_problem()): a RUNPATH copy is used only
    when pyalloc is loaded before torch, and doctor names it."""
    torch_private = any(i.private for i in theirs.values())
    problems = []
    for label, info in ours.items():
        if info.private and not torch_private:
            problems.append(f"{label} holds a private copy of the C++ runtime ({', '.join(info.private)}) "
                            "that torch's libraries do not")
        if info.foreign:
            problems.append(f"{label} needs another C++ runtime ({info.foreign[0]}) than torch's libstdc++")
        if info.runtime_in_runpath:
            problems.append(f"{label} finds a C++ runtime through its RUNPATH ({info.runtime_in_runpath[0]})")
    return problems
