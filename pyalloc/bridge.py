"""The bridge: pyalloc behind PyTorch's whole CUDA allocator interface.

``csrc/torch_bridge/bridge.cpp`` is a small C++ subclass of PyTorch's
``CUDAPluggableAllocator`` that answers every method of the interface from
pyalloc's pools, so cuDNN benchmark mode, ``torch.cuda.OutOfMemoryError``,
memory history and snapshots, ``MemPool``, CUDA graphs and the
``torch.cuda.memory_stats`` family work as under PyTorch's own allocator.
It is compiled against the installed torch with ``torch.utils.cpp_extension``
(ninja), the first time ``install()`` needs it or ahead of time with
``pyalloc bridge build``, and cached per torch, CUDA, Python and pyalloc
version and per compiler. It needs a C++ compiler and the CUDA runtime's
headers, from a CUDA toolkit or from the CUDA runtime wheel a CUDA build of
torch depends on. The compiler is the system g++ unless $CXX names another
that links the shared C++ runtime (pyalloc/_toolchain.py: the bridge throws c10
exceptions into torch's frames, which must share torch's C++ runtime); the
library built is read before it is used, and one with a private runtime is
deleted and refused (PYALLOC_ALLOW_PRIVATE_RUNTIME=1 allows both).

A bridge already built (a stamp beside it names the sources it was built from)
is loaded directly, before anything is checked or locked: a runtime image
without a compiler uses the bridge its build image left in the cache, even one
built by a compiler it lacks. A build runs under pyalloc's own lock on the
cache folder (flock: the kernel drops it when its holder dies, however it
dies); a process waiting for it says so, and for how long, every
``WAIT_REPORT_S`` seconds; and ``torch.utils.cpp_extension``'s own lock file,
which a build killed mid-way leaves behind and which made every later build
wait for ever, is removed, since no other build can hold it then.

The command line: ``pyalloc bridge build [--check]`` and ``pyalloc bridge status``.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from . import _C, _toolchain

HERE = os.path.dirname(os.path.abspath(__file__))
#: Where the bridge's sources are: csrc/ beside the package (a source checkout
#: or an editable install), else the copy a wheel carries in the package.
_SOURCE_ROOTS = (os.path.join(os.path.dirname(HERE), "csrc"), os.path.join(HERE, "csrc"))
CACHE_ENV = "PYALLOC_BRIDGE_CACHE"
MODULE_NAME = "pyalloc_bridge"
#: The oldest torch release whose allocator interface the bridge is written for
#: (bridge.cpp refuses to compile against an older one).
OLDEST_TORCH = (2, 9)

#: What PyTorch cannot do through the C hooks of CUDAPluggableAllocator, which
#: the bridge gives back; install() names these when it falls back.
LOST_WITHOUT_BRIDGE = (
    "torch.backends.cudnn.benchmark = True (cuDNN asks the allocator's cacheInfo, which "
    "raises)",
    "torch.cuda.OutOfMemoryError (an out-of-memory error is a RuntimeError instead, and "
    "cuDNN's fallback to algorithms with smaller workspaces does not happen)",
    "torch.cuda.memory._record_memory_history / _snapshot / _dump_snapshot (use "
    "pyalloc.record_history / snapshot / dump_snapshot, without stack traces)",
    "torch.cuda.MemPool and torch.compile(mode='reduce-overhead')",
    "torch.cuda.memory_stats and friends for C++ callers and for code that imported them "
    "before install() (pyalloc patches the Python functions)",
)


class BridgeUnavailable(RuntimeError):
    """The bridge cannot be built or loaded here; the message says why and what to do."""


@dataclass
class CudaHeaders:
    include: str  # holds cuda_runtime_api.h
    library: Optional[str]  # a libcudart shared object to link, if found
    origin: str  # "toolkit" or "wheel"


# -- finding what the build needs ---------------------------------------------------------


def source_dir() -> str:
    """The csrc/ folder holding torch_bridge/bridge.cpp and cuda/bridge_api.h."""
    for root in _SOURCE_ROOTS:
        if os.path.isfile(os.path.join(root, "torch_bridge", "bridge.cpp")):
            return root
    raise BridgeUnavailable(
        "the bridge's sources (csrc/torch_bridge/bridge.cpp) are not installed with this "
        "pyalloc; reinstall it from its source tree (pip install .)"
    )


def _cudart_in(lib_dir: str) -> Optional[str]:
    found = sorted(glob.glob(os.path.join(lib_dir, "libcudart.so*")))
    return found[0] if found else None


def _toolkit_roots() -> List[str]:
    roots: List[str] = [os.environ.get(v, "") for v in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return roots + ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)


def find_cuda_headers(toolkit_roots: Optional[List[str]] = None,
                      search_path: Optional[List[str]] = None) -> Optional[CudaHeaders]:
    """The CUDA runtime's headers: a toolkit (CUDA_HOME, CUDA_PATH, nvcc's, /usr/local/cuda*)
    first, else the CUDA runtime wheel torch depends on (site-packages/nvidia/*/include).
    None if neither. The arguments replace those places (tests)."""
    for root in filter(None, _toolkit_roots() if toolkit_roots is None else toolkit_roots):
        include = os.path.join(root, "include")
        if os.path.isfile(os.path.join(include, "cuda_runtime_api.h")):
            libs = (_cudart_in(os.path.join(root, d)) for d in
                    ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")))
            return CudaHeaders(include, next(filter(None, libs), None), "toolkit")
    for site in sys.path if search_path is None else search_path:
        pattern = os.path.join(site or ".", "nvidia", "*", "include", "cuda_runtime_api.h")
        for header in sorted(glob.glob(pattern)):
            include = os.path.dirname(header)
            return CudaHeaders(include, _cudart_in(os.path.join(os.path.dirname(include), "lib")), "wheel")
    return None


def _import_torch():
    try:
        import torch
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        raise BridgeUnavailable(f"the bridge is built against torch, which cannot be imported: {e}")
    return torch


def compiler_choice() -> "_toolchain.Choice":
    """The compiler the bridge is built with, how it was chosen, and any compiler set
    aside for linking a private C++ runtime (pyalloc/_toolchain.py)."""
    return _toolchain.choose_cxx()


def compiler() -> Tuple[Optional[str], str]:
    """(compiler, why) the bridge is built with: $CXX unless it links a private C++
    runtime, else the system g++, else g++ or c++ on PATH (pyalloc/_toolchain.py)."""
    choice = compiler_choice()
    return choice.cxx, choice.why


def compiler_identity() -> str:
    """The compiler's path and the first line of its --version ('none' without one)."""
    cxx, _ = compiler()
    return _toolchain.identity(cxx) if cxx else "none"


def cache_dir(torch=None) -> str:
    """The build folder for this torch, CUDA, Python, pyalloc and compiler
    (PYALLOC_BRIDGE_CACHE overrides the parent folder, ~/.cache/pyalloc/bridge by
    default). A bridge built by another compiler is never reused: it may carry
    another C++ runtime."""
    torch = torch or _import_torch()
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "pyalloc", "bridge")
    key = (f"torch-{torch.__version__}-cuda-{torch.version.cuda or 'none'}-"
           f"py{sys.version_info[0]}{sys.version_info[1]}-pyalloc-{_C.__version__}-"
           f"cxx-{_toolchain.identity_key(compiler_identity())}")
    return os.path.join(base, re.sub(r"[^A-Za-z0-9._-]", "_", key))


# -- building -----------------------------------------------------------------------------


@dataclass
class BuildResult:
    library: str  # the built shared object
    module: Any  # the loaded module, or None for a check build
    cuda: Optional[CudaHeaders]  # None for a bridge found built, where none need be at hand
    torch_version: str
    message: str


def _built_library(build_dir: str) -> Optional[str]:
    found = glob.glob(os.path.join(build_dir, MODULE_NAME + "*.so"))
    return max(found, key=os.path.getmtime) if found else None


def built_library(torch=None) -> Optional[str]:
    """The bridge built for this torch, CUDA, Python, pyalloc and compiler (in
    cache_dir()), else one finished for them by another compiler (a build image's),
    or None when none is built yet. Builds nothing."""
    torch = torch or _import_torch()
    own = os.path.join(cache_dir(torch), "cuda")
    return _built_library(own) or next(iter(_finished_elsewhere(torch, own)), None)


# -- a finished build: its stamp, the lock around a build --------------------------------

#: Written beside a bridge once its build finished: the fingerprint of the sources.
STAMP = "pyalloc-finished.json"
#: pyalloc's lock on a build folder (flock), holding the builder's pid.
LOCK = "pyalloc-build.lock"
#: torch.utils.cpp_extension's lock file, removed in a `finally` a killed build never runs.
TORCH_LOCK = "lock"
#: How often a process waiting for another's build says it still waits (seconds).
WAIT_REPORT_S = 30.0


def _sources(src: str) -> List[str]:
    """bridge.cpp and every file of csrc/ it includes, directly or not."""
    todo, seen = [os.path.join("torch_bridge", "bridge.cpp")], []
    while todo:
        rel = todo.pop()
        if rel in seen or not os.path.isfile(os.path.join(src, rel)):
            continue
        seen.append(rel)
        with open(os.path.join(src, rel)) as f:
            todo += re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
    return sorted(seen)


def _fingerprint(src: str) -> str:
    """What a finished build must have been built from: the sources' names and bytes.
    torch, CUDA, Python, pyalloc and the compiler are in the folder's name already."""
    digest = hashlib.sha256()
    for rel in _sources(src):
        with open(os.path.join(src, rel), "rb") as f:
            digest.update(rel.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _finished_library(build_dir: str, fingerprint: str) -> Optional[str]:
    """The library in ``build_dir`` whose build finished from these very sources, or None
    (none built, one half built, one from other sources)."""
    try:
        with open(os.path.join(build_dir, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return None
    library = os.path.join(build_dir, str(stamp.get("library", "")))
    if stamp.get("sources") != fingerprint or not os.path.isfile(library):
        return None
    return library


def _write_stamp(build_dir: str, library: str, fingerprint: str) -> None:
    path = os.path.join(build_dir, STAMP)
    with open(path + ".tmp", "w") as f:
        json.dump({"sources": fingerprint, "library": os.path.basename(library)}, f)
    os.replace(path + ".tmp", path)  # never half written


def _remove_stamp(build_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(build_dir, STAMP))


def _finished_elsewhere(torch: Any, own: str) -> List[str]:
    """Finished bridges for this torch, CUDA, Python and pyalloc built by other compilers
    (the cache a build image left to a runtime image without one), newest first."""
    try:
        fingerprint = _fingerprint(source_dir())
    except BridgeUnavailable:
        return []
    prefix = cache_dir(torch).rsplit("-cxx-", 1)[0]
    found = (_finished_library(os.path.join(d, "cuda"), fingerprint)
             for d in glob.glob(glob.escape(prefix) + "-cxx-*"))
    return sorted((lib for lib in found if lib and os.path.dirname(lib) != own),
                  key=os.path.getmtime, reverse=True)


def _finished(torch: Any, build_dir: str, elsewhere: bool) -> Optional[str]:
    """The finished bridge in ``build_dir``, else (``elsewhere``) another compiler's."""
    try:
        library = _finished_library(build_dir, _fingerprint(source_dir()))
    except BridgeUnavailable:
        return None
    if library is None and elsewhere:
        library = next(iter(_finished_elsewhere(torch, build_dir)), None)
    return library


def _import_library(library: str) -> Any:
    """Loads a built bridge as torch.utils.cpp_extension would, without its build lock."""
    name = os.path.basename(library).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _holder(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            pid = f.read().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Holds pyalloc's lock on ``build_dir``, waiting (and saying so) while another
    process builds there. The kernel drops a flock when its holder dies, so a killed
    build never leaves it held; torch's own lock file, which it does leave, is stale
    once this lock is held, as every build in the folder runs under it."""
    path = os.path.join(build_dir, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, said = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if said is None or waited - said >= WAIT_REPORT_S:
                    print(f"pyalloc: waiting for {_holder(path)} to finish building the bridge in "
                          f"{build_dir} (waited {waited:.0f} s)", file=sys.stderr, flush=True)
                    said = waited
                time.sleep(0.2)
        if said is not None:
            print(f"pyalloc: the other build ended after {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _remove_stale_torch_lock(build_dir)
        yield
    finally:
        os.close(fd)  # releases the flock


def _remove_stale_torch_lock(build_dir: str) -> None:
    stale = os.path.join(build_dir, TORCH_LOCK)
    if os.path.exists(stale):
        os.remove(stale)
        print(f"pyalloc: removed {stale}, left by a bridge build that was stopped before it ended",
              file=sys.stderr, flush=True)


def _dynamic_symbols(path: str, undefined: bool) -> List[str]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True, check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and not (undefined and parts[-2] in ("w", "v")):  # weak: optional
            names.append(parts[-1].split("@")[0])
    return names


def _unresolved_outside_cuda(library: str) -> List[str]:
    """Undefined symbols of a check build that nothing loaded in this process (the CPU
    torch, the C and C++ runtimes, Python) defines, besides PyTorch's CUDA libraries and
    the CUDA runtime, which a CPU torch lacks: any such is a real link error. Empty when
    nm is missing (nothing to check with)."""
    if shutil.which("nm") is None:
        return []
    loaded = {sys.executable}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if ".so" in os.path.basename(path) and os.path.isfile(path):
                loaded.add(path)
    defined = set()
    for path in loaded:
        defined.update(_dynamic_symbols(path, undefined=False))
    cuda_only = re.compile(r"cuda|Cuda|CUDA")  # mangled names of c10::cuda, torch::cuda, cudaX
    return [s for s in _dynamic_symbols(library, undefined=True)
            if s not in defined and not cuda_only.search(s)]


def _release(version: str) -> Tuple[int, int]:
    """'2.11.0+cu130' -> (2, 11); (0, 0) when it cannot be read."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def missing_prerequisite(torch: Any = None, check: bool = False) -> Optional[str]:
    """Why the bridge cannot be built against the installed torch here, or None when
    everything the build needs is at hand: torch 2.9 or newer, a CUDA build of it
    (unless check=True: compiled and linked only, which a CPU build allows), the CUDA
    runtime's headers, a C++ compiler, ninja and the bridge's sources. It only looks:
    nothing is compiled. ``torch`` replaces the installed one (tests)."""
    if torch is None:
        try:
            torch = _import_torch()
        except BridgeUnavailable as e:
            return str(e)
    if _release(torch.__version__) < OLDEST_TORCH:
        return (f"torch {torch.__version__} is older than {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}, the "
                "oldest release whose allocator interface the bridge is written for; upgrade torch")
    if not check and torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build: the bridge can be compiled against "
                "it (pyalloc bridge build --check) but not loaded; install a CUDA build of torch")
    if find_cuda_headers() is None:
        return ("the CUDA runtime's headers (cuda_runtime_api.h) were found neither in a CUDA toolkit "
                "(CUDA_HOME, nvcc, /usr/local/cuda) nor in an nvidia CUDA runtime wheel; install "
                "the CUDA toolkit, or the CUDA runtime wheel torch names (pip show torch)")
    choice = compiler_choice()
    cxx, why = choice.cxx, choice.why
    if cxx is None or shutil.which(cxx) is None:
        return "no C++ compiler to build the bridge with: " + (why if cxx is None else f"$CXX={cxx} is not found")
    if choice.refused:
        return choice.refused
    try:
        import ninja  # noqa: F401
    except ImportError:
        if shutil.which("ninja") is None:
            return "ninja is needed to build the bridge: pip install ninja"
    try:
        source_dir()
    except BridgeUnavailable as e:
        return str(e)
    return None


def build(check: bool = False, verbose: bool = False) -> BuildResult:
    """Compiles and links the bridge against the installed torch (cached: a second
    call only loads it) and loads it.

    A bridge whose build finished is loaded as it is, before the prerequisites are
    checked: where it was built for this torch, CUDA, Python and pyalloc by another
    compiler (a build image's) and none can build it here, that one.

    check=True compiles and links without PyTorch's CUDA libraries, for a torch the
    bridge cannot be loaded into here (a CPU build has none): it proves the bridge
    builds against this torch's headers, and that every symbol it needs besides
    PyTorch's CUDA libraries resolves; the message says why it was not loaded.
    Raises BridgeUnavailable saying why it cannot.
    """
    torch = _import_torch()
    build_dir = os.path.join(cache_dir(torch), "check" if check else "cuda")
    if not check:
        found = _load_finished(torch, build_dir)
        if found is not None:
            return found
    why = missing_prerequisite(torch, check=check)
    if why is not None:
        raise BridgeUnavailable(why)
    os.makedirs(build_dir, exist_ok=True)
    with _build_lock(build_dir):
        if not check:  # another process may have built it while this one waited
            found = _load_finished(torch, build_dir, elsewhere=False)
            if found is not None:
                return found
        _remove_stamp(build_dir)
        fingerprint = _fingerprint(source_dir())  # of the sources as the build reads them
        if not check:
            print(f"pyalloc: building the bridge against torch {torch.__version__} (once; cached in "
                  f"{build_dir})", file=sys.stderr, flush=True)
        result = _compile(torch, build_dir, check, verbose)
        _write_stamp(build_dir, result.library, fingerprint)
    return result


def _load_finished(torch: Any, build_dir: str, elsewhere: bool = True) -> Optional[BuildResult]:
    """The bridge in ``build_dir`` whose build finished from the sources at hand, loaded;
    else, where this machine cannot build one (``elsewhere``), a finished one another
    compiler built. None when there is none to load, or it does not load (a build then
    says why)."""
    library = _finished(torch, build_dir, elsewhere and missing_prerequisite(torch) is not None)
    if library is None:
        return None
    _refuse_a_private_runtime(library)
    try:
        module = _import_library(library)
    except ImportError as e:
        if os.path.dirname(library) == build_dir and missing_prerequisite(torch) is None:
            return None  # rebuilt under the lock, which says what is wrong
        raise BridgeUnavailable(f"the bridge built in {library} cannot be loaded: {e}") from e
    return BuildResult(library, module, None, torch.__version__,
                       f"the bridge is built for torch {torch.__version__}: {library}")


def _compile(torch: Any, build_dir: str, check: bool, verbose: bool) -> BuildResult:
    """torch.utils.cpp_extension's build of the bridge in ``build_dir`` (its caller holds
    the folder's lock), then loaded, and audited."""
    from torch.utils import cpp_extension

    cuda = find_cuda_headers()
    assert cuda is not None  # missing_prerequisite() looked
    src = source_dir()
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    ldflags = [f"-L{torch_lib}"]
    if not check:
        ldflags += ["-lc10_cuda", "-ltorch_cuda", f"-Wl,-rpath,{torch_lib}"]
        if cuda.library:
            ldflags += [cuda.library, f"-Wl,-rpath,{os.path.dirname(cuda.library)}"]
    # ninja's own binary may come from the pip wheel, on PATH only through its module.
    env_path = os.environ.get("PATH", "")
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in env_path.split(os.pathsep):
        os.environ["PATH"] = env_path + os.pathsep + scripts
    cflags = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    # CPU builds of torch ship c10/cuda's headers without the file CMake generates
    # for them (it only sets a Windows export flag).
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    if not os.path.isfile(os.path.join(torch_include, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        cflags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    # torch.utils.cpp_extension compiles and links with $CXX.
    choice = compiler_choice()
    cxx = choice.cxx
    if choice.notice and _built_library(build_dir) is None:
        print(choice.notice, file=sys.stderr, flush=True)
    saved_cxx = os.environ.get("CXX")
    os.environ["CXX"] = cxx
    try:
        module = cpp_extension.load(
            name=MODULE_NAME,
            sources=[os.path.join(src, "torch_bridge", "bridge.cpp")],
            extra_include_paths=[src, cuda.include],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=build_dir,
            with_cuda=False,
            verbose=verbose,
        )
    except ImportError as e:
        # A check build links, then cannot load without PyTorch's CUDA libraries.
        library = _built_library(build_dir)
        if not check or library is None:
            raise BridgeUnavailable(f"the bridge was built but cannot be loaded: {e}") from e
        _refuse_a_private_runtime(library)
        missing = _unresolved_outside_cuda(library)
        if missing:
            raise BridgeUnavailable(
                "the bridge links against this torch only with symbols nothing provides: "
                + ", ".join(missing[:8])
            ) from e
        return BuildResult(library, None, cuda, torch.__version__, _check_message(torch, cuda))
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        raise BridgeUnavailable(f"building the bridge failed: {e}") from e
    finally:
        if saved_cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = saved_cxx
    library = _built_library(build_dir) or getattr(module, "__file__", "")
    _refuse_a_private_runtime(library)
    if check:
        return BuildResult(library, module, cuda, torch.__version__,
                           f"the bridge compiles, links and loads against torch {torch.__version__}")
    return BuildResult(library, module, cuda, torch.__version__,
                       f"the bridge is built for torch {torch.__version__} with {_toolchain.identity(cxx)}: "
                       f"{library}")


def _refuse_a_private_runtime(library: str) -> None:
    """Deletes a bridge built with a private C++ runtime (an LDFLAGS or a compiler
    the probe missed) and says why: it must never be used, nor found in the cache."""
    problem = _toolchain.private_runtime_problem(library, "the bridge")
    if problem is None:
        return
    try:
        os.remove(library)
    except OSError:
        pass
    raise BridgeUnavailable(problem)


def _check_message(torch: Any, cuda: CudaHeaders) -> str:
    """What a check build that compiled and linked but was not loaded says: why it was
    not, for the torch at hand (a CPU build; a CUDA build, with or without a device)."""
    built = (f"the bridge compiles and links against torch {torch.__version__} (CUDA headers "
             f"from the {cuda.origin}: {cuda.include})")
    version = torch.version.cuda
    if version is None:
        return f"{built}; this CPU build of torch cannot load it"
    not_loaded = f"{built}; a check build leaves out PyTorch's CUDA libraries, so it could not be loaded"
    if not torch.cuda.is_available():
        return (f"{not_loaded}. This torch is a CUDA {version} build, on a machine with no CUDA device "
                "(torch.cuda.is_available() is False): pyalloc cannot be installed here; on a "
                "machine with a GPU, `pyalloc bridge build` builds and loads the bridge")
    return f"{not_loaded}: `pyalloc bridge build` builds and loads it for this CUDA {version} build of torch"


_loaded: Any = None


def load() -> Any:
    """The bridge module for the installed torch, built first if it is not yet (about a
    minute, once: later processes find it in cache_dir()). BridgeUnavailable says why not."""
    global _loaded
    if _loaded is not None:
        return _loaded
    torch = _import_torch()
    if torch.version.cuda is None:
        raise BridgeUnavailable(f"torch {torch.__version__} is a CPU-only build")
    _loaded = build().module
    return _loaded


def status(torch: Any = None) -> dict:
    """For pyalloc doctor and ``pyalloc bridge status``: whether the bridge could be
    used here, without building it. route: how PyTorch reaches pyalloc in this
    process; torch: its version and CUDA; cuda_headers: where, and from what;
    built, library, cache: whether the bridge is built for this torch and pyalloc,
    the file, the folder; why_not: why it cannot be built or loaded here (None: it
    can). ``torch`` replaces the installed one (tests)."""
    out = {"route": _C.cuda_route(), "torch": None, "cuda_headers": None, "compiler": None,
           "built": False, "library": None, "cache": None, "why_not": None}
    cxx, why = compiler()
    out["compiler"] = f"{_toolchain.identity(cxx)} ({why})" if cxx else why
    cuda = find_cuda_headers()
    if cuda is not None:
        out["cuda_headers"] = f"{cuda.include} ({cuda.origin})"
    try:
        torch = torch or _import_torch()
    except BridgeUnavailable as e:
        out["why_not"] = str(e)
        return out
    version = getattr(torch.version, "cuda", None)
    out["torch"] = f"{torch.__version__}, " + (f"CUDA {version}" if version else "CPU-only")
    out["cache"] = os.path.join(cache_dir(torch), "cuda")
    out["library"] = built_library(torch)
    out["built"] = out["library"] is not None
    out["why_not"] = missing_prerequisite(torch)
    if out["why_not"] is not None and version and _finished_at_hand(torch):
        out["why_not"] = None  # loaded as it is: nothing a build needs is needed
    return out


def _finished_at_hand(torch: Any) -> bool:
    """Whether build() would load a finished bridge rather than build one."""
    return _finished(torch, os.path.join(cache_dir(torch), "cuda"), elsewhere=True) is not None


# -- command line -------------------------------------------------------------------------


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bridge_command", metavar="ACTION")
    b = sub.add_parser("build", help="compile the bridge against the installed torch now",
                       description="Compile (and load) the bridge against the installed torch, "
                                   "so that install() finds it built.")
    b.add_argument("--check", action="store_true",
                   help="compile and link only, without loading: works with a CPU build of torch")
    b.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    sub.add_parser("status", help="say where the bridge would be built and whether it is")


def main(args) -> int:
    if args.bridge_command == "status":
        for key, value in status().items():
            print(f"{key}: {value}")
        return 0
    if args.bridge_command != "build":
        print("usage: pyalloc bridge {build [--check], status}", file=sys.stderr)
        return 2
    try:
        result = build(check=args.check, verbose=args.verbose)
    except BridgeUnavailable as e:
        print(f"pyalloc bridge: {e}", file=sys.stderr)
        return 1
    print(result.message)
    return 0
