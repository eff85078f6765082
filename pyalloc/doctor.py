"""``pyalloc doctor``: is this machine ready for pyalloc? Run it first on a new machine.

It reports whether a C++ exception thrown inside pyalloc._C reaches Python (in a
child process: a build whose exceptions crash would crash on every error); for
pyalloc._C, the bridge and torch's libraries, the compiler that built each, any
RUNPATH, and whether one holds a private copy of the C++ runtime (readelf: a mix
is not ready, since exceptions cross from pyalloc into torch's frames), with the
compiler a build would take now and any CC or CXX it sets aside for linking a
private runtime (or PYALLOC_ALLOW_PRIVATE_RUNTIME=1, which keeps them); the
CUDA driver and its version; each device with its memory, virtual memory support
and peers; the installed PyTorch (a CUDA build or not, the hooks its pluggable
allocator offers, whether CUDA is already initialised in this process); the
bridge (pyalloc.bridge): whether this torch can take it, where the CUDA headers
are, whether it is built, which route install() would take and which is in use,
and where it cannot be had, what is lost and how to get it; PyTorch's own
PYTORCH_ALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) and how install() takes each of its
keys; the effective PYALLOC_CONF. Where a GPU and a CUDA build of torch exist, it runs a live check of
a few seconds per device, each in a child process (install pyalloc by the default
route and say which it got, allocate and free on two streams, record_stream, a
tiny CUDA graph, empty_cache). It ends with one line: ready, or not ready and
why. It never raises: whatever fails becomes a line of the report. Exit status 0
when ready, 1 when not.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional

from . import _C, _toolchain

#: torch's pluggable-allocator setters that pyalloc uses when they exist.
GRAPH_POOL_HOOKS = ("set_begin_allocate_to_pool", "set_end_allocate_to_pool", "set_release_pool")

# Seconds a live check may take on top of --timeout when its install() builds the bridge.
BRIDGE_BUILD_SECONDS = 600.0

# A C++ exception thrown inside pyalloc._C, which must reach Python as ValueError.
EXCEPTION_CHECK = r"""
import pyalloc._C as C
try:
    C.cuda_configure("bogus:1")
except ValueError:
    print("EXCEPTIONS OK")
"""

# The live check, run in a child process that sees one device (CUDA_VISIBLE_DEVICES).
# install() takes the default route; the check says which it got.
LIVE_CHECK = r"""
import warnings

import torch
import pyalloc

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pyalloc.install()
for w in caught:
    if "bridge" in str(w.message):  # install()'s warning when it falls back to the C hooks
        print("FALLBACK", str(w.message).splitlines()[0], flush=True)
route = pyalloc.is_installed()
MiB = 1 << 20
side = torch.cuda.Stream()
main = torch.cuda.current_stream()
kept = []
for stream in (main, side):
    with torch.cuda.stream(stream):
        for size in (1, 512, MiB + 1, 20 * MiB + 3, 64 * MiB):
            x = torch.full((size,), 7, dtype=torch.uint8, device="cuda")
            assert int(x[-1]) == 7, size
            kept.append(x)
side.wait_stream(main)
x = kept[3]
with torch.cuda.stream(side):
    x.add_(1)
x.record_stream(side)
del x, kept[:]
torch.cuda.synchronize()
assert torch.cuda.memory_allocated() == 0, torch.cuda.memory_allocated()

static = torch.zeros(1024, device="cuda")
out = static * 2 + 1  # warm-up outside the capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = static * 2 + 1
static.fill_(3)
graph.replay()
torch.cuda.synchronize()
assert float(out[0]) == 7.0, float(out[0])
del graph, out, static
torch.cuda.empty_cache()
print("LIVE OK", route, pyalloc.memory_stats()["reserved_bytes.all.current"])
"""

#: How the report names the routes.
ROUTE_NAMES = {"bridge": "the bridge", "hooks": "the C hooks"}


class Report:
    """Lines of the report, and the reasons it is not ready."""

    def __init__(self, out: Callable[[str], None]):
        self.out = out
        self.problems: List[str] = []

    def line(self, text: str) -> None:
        self.out(text)

    def problem(self, text: str) -> None:
        self.problems.append(text)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _driver_path() -> Optional[str]:
    """The file the CUDA driver was loaded from, as this process maps it."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libcuda.so"):
                    return path
    except OSError:
        pass
    return None


def check_driver(r: Report) -> List[Dict[str, Any]]:
    """The driver and each device; the devices' descriptions."""
    try:
        version = _C.cuda_check_driver()
    except Exception as e:  # pyalloc's CudaDriverError says why and what to do
        r.line(f"driver:   not usable: {e}")
        r.problem("no CUDA GPU: the CUDA driver cannot be used (see 'driver' above)")
        return []
    where = _driver_path()
    r.line(f"driver:   CUDA {version // 1000}.{version % 1000 // 10} ({version})"
           + (f", {where}" if where else ""))
    try:
        count = _C.cuda_device_count()
    except Exception as e:
        r.line(f"devices:  cannot be counted: {e}")
        r.problem("no CUDA GPU: the driver cannot count its devices")
        return []
    r.line(f"devices:  {count}")
    if count == 0:
        r.problem("no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES?)")
    devices = []
    for i in range(count):
        try:
            d = _C.cuda_describe_device(i)
        except Exception as e:
            r.line(f"  cuda:{i}  cannot be opened: {e}")
            r.problem(f"device {i} cannot be opened")
            continue
        devices.append(d)
        vmm = (f"yes, granularity {_size(d['vmm_granularity'])}" if d["vmm"]
               else f"no ({d['vmm_why']})")
        r.line(f"  cuda:{i}  {d['name'] or '(unnamed)'}: {_size(d['total_bytes'])} total, "
               f"{_size(d['free_bytes'])} free")
        r.line(f"          virtual memory: {vmm}")
        peers = ", ".join(f"cuda:{p}" for p in d["peers"]) or "none"
        r.line(f"          peers that can access its memory: {peers}"
               + (f" (refused: {d['peers_why']})" if d["peers_why"] else ""))
    return devices


def check_torch(r: Report) -> Any:
    """The installed torch, or None if it cannot run pyalloc."""
    try:
        import torch
    except Exception as e:
        r.line(f"torch:    cannot be imported ({_one_line(e)})")
        r.problem("PyTorch is not installed (pip install torch)" if isinstance(e, ModuleNotFoundError)
                  else f"torch cannot be imported ({_one_line(e)})")
        return None
    cuda = getattr(torch.version, "cuda", None)
    r.line(f"torch:    {torch.__version__}, " + (f"a CUDA {cuda} build" if cuda else "a CPU-only build"))
    if not cuda:
        r.problem("the installed torch is a CPU-only build (pyalloc needs a CUDA build)")
        return None
    try:
        initialised = torch.cuda.is_initialized()
    except Exception as e:
        initialised = None
        r.line(f"          CUDA initialised in this process: unknown ({_one_line(e)})")
    if initialised is not None:
        r.line(f"          CUDA initialised in this process: {'yes' if initialised else 'no'}"
               + (" (install() must come before CUDA work)" if initialised else ""))
    allocator_type = getattr(torch._C, "_cuda_CUDAAllocator", None)
    if allocator_type is None:
        r.line("          pluggable allocator: missing (torch._C._cuda_CUDAAllocator)")
        r.problem("this torch has no pluggable CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator)")
        return None
    from .cuda import _HOOKS

    offered = [name for name, _ in _HOOKS if hasattr(allocator_type, name)]
    missing = [name for name, _ in _HOOKS if not hasattr(allocator_type, name)]
    r.line(f"          allocator hooks: {', '.join(offered) or 'none'}"
           + (f"; missing: {', '.join(missing)}" if missing else ""))
    graph = [name for name in GRAPH_POOL_HOOKS if hasattr(allocator_type, name)]
    r.line(f"          graph-pool hooks: {', '.join(graph) if graph else 'none (CUDA graphs use pool_size)'}")
    return torch


def check_bridge(r: Report, torch: Any = None) -> Optional[str]:
    """The bridge: whether this torch can take it, the CUDA headers, whether it is
    built, the route install() would take and the one in use; where it cannot be
    had, what is lost and how to get it. Returns the route install() would take
    ("bridge", "hooks"), or None where it would fail. ``torch`` replaces the
    installed one (tests)."""
    from . import bridge
    from .cuda import BRIDGE_ENV, _bridge_from_env

    try:
        st = bridge.status(torch)
    except Exception as e:  # a torch that fails to import with something else than ImportError
        r.line(f"bridge:   cannot be used: torch cannot be imported ({_one_line(e)})")
        return None
    why = st["why_not"]
    if st["torch"] is None:
        r.line(f"bridge:   cannot be used: {why}")
    else:
        r.line(f"bridge:   torch {st['torch']}: " + ("can take it" if why is None else "cannot take it"))
    r.line(f"          CUDA headers: {st['cuda_headers'] or 'not found'}")
    if st["built"]:
        r.line(f"          built: yes, {st['library']}")
    else:
        r.line("          built: no" + (f" (it would be built in {st['cache']})" if st["cache"] else ""))

    try:
        wanted = _bridge_from_env()
    except ValueError as e:
        r.line(f"          install() would fail: {e}")
        r.problem(str(e))
        return None
    if wanted is False:
        route: Optional[str] = "hooks"
        r.line(f"          install() would take: the C hooks ({BRIDGE_ENV}=0)")
    elif why is None:
        route = "bridge"
        r.line("          install() would take: the bridge" + (
            "" if st["built"] else ", built by the first install() (a minute, once; or now: "
                                   "pyalloc bridge build)"))
    elif wanted:
        route = None
        r.line(f"          install() would fail: {BRIDGE_ENV}=1 asks for the bridge, which cannot be "
               "had here")
        r.problem(f"{BRIDGE_ENV}=1 asks for the bridge, which cannot be had here ({why})")
    else:
        route = "hooks"
        r.line("          install() would take: the C hooks, with a warning")
    in_use = st["route"]
    r.line("          in use in this process: " + (ROUTE_NAMES.get(in_use, in_use) if in_use != "none"
                                                   else "none (pyalloc is not installed here)"))
    if why is not None:
        r.line(f"          why not the bridge: {why}")
        r.line("          without it, through the C hooks, these do not work:")
        for item in bridge.LOST_WITHOUT_BRIDGE:
            r.line(f"            - {item}")
        r.line("          to get it: remedy the above, then run `pyalloc bridge build` (or let "
               "install() build it)")
    return route


def _child_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a child that imports this pyalloc."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    return env


def check_exceptions(r: Report, code: str = EXCEPTION_CHECK, timeout: float = 60.0) -> None:
    """In a child process, a C++ exception thrown inside pyalloc._C must reach Python:
    pyalloc raises one on every error (a bad setting, an out-of-memory), and a build
    whose exceptions crash the process (a compiler or C++ runtime that does not
    match) turns every error into a crash."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=_child_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        r.line(f"exceptions: the check did not finish in {timeout:.0f} s")
        r.problem("the C++ exception check hung")
        return
    except OSError as e:
        r.line(f"exceptions: the check could not start: {e}")
        r.problem("the C++ exception check could not start")
        return
    if out.returncode < 0:
        text = (f"C++ exceptions crash in this build of pyalloc (signal {-out.returncode}): "
                "rebuild it with the system C++ compiler")
        r.line(f"exceptions: {text}")
        r.problem(text)
    elif out.returncode == 0 and "EXCEPTIONS OK" in out.stdout:
        r.line("exceptions: a C++ exception thrown in pyalloc._C reaches Python (ValueError)")
    else:
        last = [line for line in out.stderr.strip().splitlines() if line.strip()][-1:] or ["no message"]
        r.line(f"exceptions: the check failed: the child exited with {out.returncode}: {last[0]}")
        r.problem(f"the C++ exception check failed ({last[0]})")


def _runtime_libraries() -> List[Any]:
    """(label, path) of pyalloc._C, the bridge where it is built, and torch's libraries."""
    libraries = [("pyalloc._C", _C.__file__)]
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    torch_dir = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    if torch_dir:
        try:
            from . import bridge

            built = bridge.built_library()
            if built:
                libraries.append(("the bridge", built))
        except Exception:  # torch that cannot be imported: check_torch says so
            pass
    return libraries + _toolchain.torch_libraries(torch_dir)


def check_runtime(r: Report, libraries: Optional[List[Any]] = None, readelf: str = "readelf") -> None:
    """Which compiler built each library, its RUNPATH, and whether it holds a private
    C++ runtime: pyalloc's exceptions unwind through torch's frames, so pyalloc's
    libraries must use the C++ runtime torch uses. ``libraries`` ((label, path)
    pairs) and ``readelf`` replace the real ones (tests)."""
    choice = _toolchain.choose_cxx()
    r.line("compiler: " + (f"{_toolchain.identity(choice.cxx)} ({choice.why})" if choice.cxx else choice.why)
           + " builds pyalloc._C and the bridge")
    if choice.notice:
        r.line(f"          {choice.notice[len('pyalloc: '):]}")
    if choice.refused:
        r.line(f"          refused: {choice.refused}")
    allowed = _toolchain.allow_private()
    if allowed:
        r.line(f"          {_toolchain.ALLOW_PRIVATE_ENV}=1: compilers and the libraries they build are "
               "not checked for a private C++ runtime")
    found = shutil.which(readelf)
    if found is None:
        r.line(f"runtime:  {readelf} is not found (binutils): which C++ runtime each library uses "
               "cannot be told")
        return
    libraries = _runtime_libraries() if libraries is None else libraries
    r.line("runtime:  the C++ runtime of each library (readelf):")
    ours, theirs = {}, {}
    for label, path in libraries:
        info = _toolchain.read_runtime(path, found)
        if info.error is not None:
            r.line(f"          {label}: cannot be read ({info.error})")
            continue
        (theirs if label.startswith("torch") else ours)[label] = info
        r.line(f"          {label}: {'; '.join(info.compilers) or 'no .comment'}")
        r.line(f"            {path}")
        r.line("            RUNPATH/RPATH: " + (":".join(info.runpath) or "none")
               + (f" (holds {', '.join(info.runtime_in_runpath)})" if info.runtime_in_runpath else ""))
        r.line("            C++ runtime: " + (f"a private copy ({', '.join(info.private)} defined here)"
                                               if info.private else f"another one ({info.foreign[0]})"
                                               if info.foreign else "the shared one"))
    problems = _toolchain.runtime_problems(ours, theirs)
    for text in problems:
        r.problem(f"{text}: rebuild with the system g++ (python setup.py build_ext --inplace --force; "
                  "pyalloc bridge build: both set aside a CC or CXX that links a private C++ runtime"
                  + (f", once {_toolchain.ALLOW_PRIVATE_ENV} is unset)" if allowed else ")"))
    if problems:
        r.line("          a mix: an exception from pyalloc would unwind through torch's frames under "
               "another runtime and crash")


def check_torch_conf(r: Report) -> bool:
    """PyTorch's own allocator settings, and how install() takes each key; False
    where they are invalid."""
    from . import _torch_conf
    from .cuda import torch_settings

    try:
        name, taken = torch_settings()
    except ValueError as e:
        r.line(f"PYTORCH_ALLOC_CONF: invalid: {e}")
        r.problem(f"PyTorch's allocator settings are invalid: {e}")
        return False
    if name is None:
        r.line("PYTORCH_ALLOC_CONF: not set (nor PYTORCH_CUDA_ALLOC_CONF)")
        return True
    r.line(f"{name}: {os.environ[name]!r}")
    for t in taken:
        r.line(f"          {t.describe()}")
    unread = _torch_conf.shadowed()
    if unread:
        r.line(f"          {unread} is set too and not read: {name} wins")
    return True


def check_conf(r: Report, devices: List[Dict[str, Any]]) -> None:
    from .cuda import CONF_ENV, settings_text

    if not check_torch_conf(r):
        return
    raw = os.environ.get(CONF_ENV)
    r.line(f"{CONF_ENV}: " + (repr(raw) if raw is not None else "not set"))
    try:
        config = _C.parse_config(settings_text())
    except Exception as e:
        r.line(f"          invalid: {e}")
        r.problem(f"{CONF_ENV} is invalid: {e}")
        return
    r.line("          effective: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    if config.get("strategy") == "vmm":
        for d in devices:
            if not d["vmm"]:
                r.line(f"          cuda:{d['index']} will use strategy bestfit: {d['vmm_why']}")


def live_check(r: Report, devices: List[Dict[str, Any]], timeout: float, builds_bridge: bool = False,
               code: str = LIVE_CHECK) -> None:
    """Runs the live check on each device; builds_bridge: the first install() builds the
    bridge, which takes longer."""
    if builds_bridge:
        r.line("live:     the bridge is not built yet: the first device's install() builds it (a minute, once)")
    for d in devices:
        i = d["index"]
        limit = timeout + (BRIDGE_BUILD_SECONDS if builds_bridge else 0.0)
        builds_bridge = False
        try:
            out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code],
                                 capture_output=True, text=True, env=_child_env(CUDA_VISIBLE_DEVICES=str(i)),
                                 timeout=limit)
        except subprocess.TimeoutExpired:
            r.line(f"live:     cuda:{i} did not finish in {limit:.0f} s")
            r.problem(f"the live check on device {i} hung")
            continue
        except OSError as e:
            r.line(f"live:     cuda:{i} could not start: {e}")
            r.problem(f"the live check on device {i} could not start")
            continue
        done = [line.split() for line in out.stdout.splitlines() if line.startswith("LIVE OK")]
        if out.returncode == 0 and done:
            route = done[0][2] if len(done[0]) > 2 else "unknown"
            r.line(f"live:     cuda:{i} ok through {ROUTE_NAMES.get(route, route)} "
                   "(install, two streams, record_stream, a CUDA graph, empty_cache)")
            for line in out.stdout.splitlines():
                if line.startswith("FALLBACK "):
                    r.line(f"          {line[len('FALLBACK '):]}")
            continue
        how = (f"died of signal {-out.returncode}" if out.returncode < 0 else f"exited with {out.returncode}")
        last = [line for line in out.stderr.strip().splitlines() if line.strip()][-1:] or ["no message"]
        r.line(f"live:     cuda:{i} failed: the child {how}: {last[0]}")
        for line in out.stderr.strip().splitlines()[-12:]:
            r.line(f"          | {line}")
        r.problem(f"the live check on device {i} failed ({last[0]})")


def diagnose(out: Callable[[str], None] = print, live: bool = True, timeout: float = 120.0) -> bool:
    """Writes the report through ``out``; True when the machine is ready."""
    r = Report(out)
    try:
        r.line(f"pyalloc:  {_C.__version__}, {_C.library_path()}")
        check_exceptions(r)
        devices = check_driver(r)
        torch = check_torch(r)
        route = check_bridge(r)
        check_runtime(r)
        check_conf(r, devices)
        if not live:
            r.line("live:     skipped (--no-live)")
        elif devices and torch is not None and not r.problems:
            from . import bridge

            live_check(r, devices, timeout, builds_bridge=route == "bridge" and not bridge.status()["built"])
        else:
            r.line("live:     skipped (nothing to run it on)")
    except BaseException as e:  # the report must end with its verdict, whatever happened
        if isinstance(e, KeyboardInterrupt):
            r.problem("interrupted")
        else:
            r.line(f"internal error: {_one_line(e)}")
            r.problem(f"pyalloc doctor itself failed ({_one_line(e)})")
    if r.problems:
        r.line("not ready: " + "; ".join(dict.fromkeys(r.problems)))
        return False
    r.line("ready")
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-live", action="store_true",
                        help="skip the live check (which runs a child process per device)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the live check of one device may take (default 120)")


def main(args: argparse.Namespace) -> int:
    ready = diagnose(lambda text: print(text, flush=True), live=not args.no_live, timeout=args.timeout)
    return 0 if ready else 1
