"""The bridge (csrc/torch_bridge/) built against the installed torch, on CPU.

A CPU build of torch has the headers of PyTorch's CUDA allocator interface but
not its CUDA libraries: the bridge compiles and links against it, and cannot be
loaded. ``pyalloc bridge build --check`` proves the first; on a GPU the bridge
is loaded and exercised by tests/gpu/ (test_gpu.py).
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pyalloc import bridge

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _headers_or_skip():
    cuda = bridge.find_cuda_headers()
    if cuda is None:
        pytest.skip("no CUDA runtime headers here (no CUDA toolkit, no nvidia CUDA runtime wheel)")
    return cuda


def test_check_build_compiles_and_links_against_the_installed_torch(tmp_path, request):
    pytest.importorskip("torch")
    _headers_or_skip()
    env = dict(os.environ, PYALLOC_BRIDGE_CACHE=str(tmp_path))
    env.pop(ALLOW, None)
    try:
        static = request.getfixturevalue("static_runtime_cxx")
    except pytest.skip.Exception:
        static = None
    if static is not None and os.path.exists(SYSTEM_GXX):
        # As on a GPU image whose CXX links the C++ runtime statically: set aside.
        env["CXX"] = static
    else:
        static = None
    out = subprocess.run([sys.executable, "-m", "pyalloc", "bridge", "build", "--check"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compiles and links against torch" in out.stdout
    built = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.endswith(".so")]
    assert built, "no shared object was written"
    if static is not None:
        assert f"pyalloc: $CXX={static} would give pyalloc a private copy of the C++ runtime" in out.stderr, \
            out.stderr
    if shutil.which("readelf") is not None:
        from pyalloc._toolchain import read_runtime

        info = read_runtime(built[0])
        assert not info.is_private and "libstdc++.so.6" in info.needed, info
    if shutil.which("nm") is not None:
        # What only a GPU can show working, seen here in what the bridge links to:
        # it registers itself for the CUDA device type (torch.accelerator's
        # memory calls), recordStream tells storages that own nothing apart, and
        # it reports allocations, frees and out-of-memory errors to PyTorch's
        # profiler (tests/gpu/profiler_memory.py sees them).
        imports = subprocess.run(["nm", "-D", "-C", "--undefined-only", built[0]], capture_output=True,
                                 text=True, check=True).stdout
        assert "c10::SetAllocator(" in imports and "c10::GetAllocator(" in imports
        assert "c10::detail::deleteNothing(" in imports
        assert "c10::memoryProfilingEnabled()" in imports
        assert "c10::reportMemoryUsageToProfiler(" in imports
        assert "c10::reportOutOfMemoryToProfiler(" in imports
        # Out of memory, it runs PyTorch's free-memory callbacks (torch's cuda_ipc_collect).
        assert re.search(r"c10::FreeCudaMemoryCallbacksRegistry(\[abi:cxx11\])?\(\)", imports)


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("nm") is None,
                    reason="needs a C compiler and nm")
def test_the_link_audit_names_a_missing_symbol_but_not_cuda_ones(tmp_path):
    # A library needing a CUDA runtime function (a CPU torch lacks it: fine) and a
    # function nothing provides (a real link error the check must report).
    src = tmp_path / "lib.c"
    src.write_text("int cudaMemcpyAsync(void); int pyalloc_nothing_defines_this(void);\n"
                   "int f(void) { return cudaMemcpyAsync() + pyalloc_nothing_defines_this(); }\n")
    lib = tmp_path / "lib.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    assert bridge._unresolved_outside_cuda(str(lib)) == ["pyalloc_nothing_defines_this"]


def test_cuda_headers_from_a_toolkit_or_the_runtime_wheel(tmp_path):
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "lib64").mkdir()
    (toolkit / "include" / "cuda_runtime_api.h").write_text("")
    (toolkit / "lib64" / "libcudart.so.13").write_text("")
    found = bridge.find_cuda_headers([str(toolkit)], [])
    assert (found.origin, found.include) == ("toolkit", str(toolkit / "include"))
    assert found.library == str(toolkit / "lib64" / "libcudart.so.13")

    site = tmp_path / "site"
    wheel = site / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "cuda_runtime_api.h").write_text("")
    found = bridge.find_cuda_headers([str(tmp_path / "nothing")], [str(site)])
    assert (found.origin, found.include, found.library) == ("wheel", str(wheel / "include"), None)
    assert bridge.find_cuda_headers([], [str(tmp_path / "empty")]) is None


def test_the_build_is_cached_per_torch_and_pyalloc_version(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path))
    path = bridge.cache_dir(torch)
    assert path.startswith(str(tmp_path))
    name = os.path.basename(path)
    assert torch.__version__.replace("+", "_") in name and bridge._C.__version__ in name


def test_without_a_cuda_torch_the_bridge_says_why(monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the bridge can be loaded")
    with pytest.raises(bridge.BridgeUnavailable, match="CPU-only"):
        bridge.load()


def test_bridge_command_line(capsys):
    from pyalloc.__main__ import main

    assert main(["bridge", "status"]) == 0
    out = capsys.readouterr().out
    assert "route: none" in out and "cuda_headers:" in out
    torch = pytest.importorskip("torch")
    assert f"torch: {torch.__version__}, " in out and "built: " in out and "cache: " in out
    if torch.version.cuda is None:
        assert "why_not: torch " in out and "CPU-only" in out
    assert main(["bridge"]) == 2


# -- the compiler: the one whose C++ runtime torch uses ---------------------------------

SYSTEM_GXX = "/usr/bin/g++"
ALLOW = "PYALLOC_ALLOW_PRIVATE_RUNTIME"


def _fake_compiler(folder, name, version):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


def _no_probe(cxx):
    raise AssertionError(f"{cxx} was probed")


def test_the_system_compiler_is_chosen_over_one_first_on_path(tmp_path):
    from pyalloc._toolchain import choose_cxx

    opt = _fake_compiler(tmp_path / "opt" / "gcc" / "bin", "g++", "g++ (GCC) 14.1.0")
    system = _fake_compiler(tmp_path / "usr" / "bin", "g++", "g++ (Ubuntu 13.3.0) 13.3.0")
    path = str(tmp_path / "opt" / "gcc" / "bin")
    # The system compiler is trusted: no probe.
    choice = choose_cxx({"PATH": path}, system=(system,), probe=_no_probe)
    assert (choice.cxx, choice.why, choice.notice, choice.refused) == (system, "the system compiler", None, None)
    # Another on PATH is probed: one that cannot even link is kept, and its build will say why.
    choice = choose_cxx({"PATH": path}, system=(str(tmp_path / "none" / "g++"),))
    assert choice.cxx == opt and choice.why.startswith("found on PATH (no system compiler at "), choice
    assert choice.refused is None
    assert choose_cxx({"PATH": str(tmp_path / "empty")}, system=()).cxx is None


def test_cxx_wins_only_with_the_shared_cxx_runtime(tmp_path):
    # Regression: on a GPU image CXX=/opt/gcc/bin/g++ named a compiler whose link
    # takes libstdc++ statically, and $CXX always won: pyalloc._C and the bridge got
    # a private C++ runtime. $CXX now wins only when its probe shows the shared one.
    from pyalloc._toolchain import Probe, choose_cxx

    system = _fake_compiler(tmp_path / "usr" / "bin", "g++", "g++ 13")
    found = {"/x/clang++": Probe("/x/clang++", "shared", "NEEDED libstdc++.so.6"),
             "/opt/gcc/bin/g++": Probe("/opt/gcc/bin/g++", "private", "__cxa_throw defined in it"),
             "/x/broken": Probe("/x/broken", "unknown", "it failed to link a test library (exit 1)")}
    probe = found.__getitem__
    assert choose_cxx({"CXX": "/x/clang++"}, system=(system,), probe=probe).cxx == "/x/clang++"
    choice = choose_cxx({"CXX": "/opt/gcc/bin/g++"}, system=(system,), probe=probe)
    assert choice.cxx == system and choice.refused is None
    assert choice.why == "the system compiler, not $CXX=/opt/gcc/bin/g++, which links a private C++ runtime"
    assert choice.notice == (f"pyalloc: $CXX=/opt/gcc/bin/g++ would give pyalloc a private copy of the C++ "
                             f"runtime (__cxa_throw defined in it); building with {system} instead ({ALLOW}=1 "
                             "keeps it)")
    choice = choose_cxx({"CXX": "/opt/gcc/bin/g++", ALLOW: "1"}, system=(system,), probe=_no_probe)
    assert (choice.cxx, choice.notice) == ("/opt/gcc/bin/g++", None)
    assert choice.why == f"$CXX; {ALLOW}=1: its C++ runtime is not checked"
    choice = choose_cxx({"CXX": "/x/broken"}, system=(system,), probe=probe)
    assert choice.cxx == "/x/broken" and "could not be probed: it failed to link" in choice.why
    # Nothing to fall back to: refused, with what to do.
    choice = choose_cxx({"CXX": "/opt/gcc/bin/g++", "PATH": ""}, system=(str(tmp_path / "none"),), probe=probe)
    assert choice.cxx == "/opt/gcc/bin/g++" and choice.refused.startswith(
        "$CXX=/opt/gcc/bin/g++ links a private copy of the C++ runtime (__cxa_throw defined in it) and there "
        "is no system compiler"), choice
    assert f"set {ALLOW}=1 to build with it anyway" in choice.refused
    # The only compiler on PATH links a private runtime: refused as well.
    opt = _fake_compiler(tmp_path / "opt" / "bin", "g++", "g++ 14")
    choice = choose_cxx({"PATH": str(tmp_path / "opt" / "bin")}, system=(str(tmp_path / "none"),),
                        probe=lambda cxx: Probe(cxx, "private", "__cxa_throw defined in it"))
    assert choice.cxx == opt and choice.refused and choice.refused.startswith(f"{opt} (found on PATH")


def test_the_probe_tells_a_static_runtime_from_the_shared_one(static_runtime_cxx, tmp_path):
    from pyalloc._toolchain import probe_runtime

    if not os.path.exists(SYSTEM_GXX):
        pytest.skip(f"no {SYSTEM_GXX}")
    shared = probe_runtime(SYSTEM_GXX)
    assert shared.runtime == "shared" and shared.detail.startswith("NEEDED libstdc++.so"), shared
    private = probe_runtime(static_runtime_cxx)
    assert private.runtime == "private", private
    assert private.detail == ("__cxa_throw, _Unwind_RaiseException defined in it, no NEEDED libstdc++.so"), private
    c = probe_runtime(shutil.which("gcc") or "gcc")  # a C driver links no C++ runtime
    assert c.runtime in ("none", "unknown"), c
    broken = probe_runtime(_fake_compiler(tmp_path, "g++", "g++ 1"))
    assert broken.runtime == "unknown" and broken.detail.startswith("it failed to link a test library"), broken


def test_a_static_runtime_compiler_is_set_aside_for_the_system_one(static_runtime_cxx):
    from pyalloc._toolchain import choose_cxx, use_for_setup

    if not os.path.exists(SYSTEM_GXX):
        pytest.skip(f"no {SYSTEM_GXX}")
    choice = choose_cxx({"CXX": static_runtime_cxx})
    assert choice.cxx == SYSTEM_GXX and choice.refused is None, choice
    assert choice.notice.startswith(f"pyalloc: $CXX={static_runtime_cxx} would give pyalloc a private copy of "
                                    "the C++ runtime (__cxa_throw, _Unwind_RaiseException defined in it"), choice
    assert choose_cxx({"CXX": static_runtime_cxx, ALLOW: "1"}).cxx == static_runtime_cxx  # the opt-out keeps it

    # setup.py: CC too, as the GPU image set both.
    env = {"CXX": static_runtime_cxx, "CC": static_runtime_cxx}
    choice = use_for_setup(env)
    assert env == {"CXX": SYSTEM_GXX, "CC": SYSTEM_GXX}
    assert choice.notice.startswith(f"pyalloc: $CXX={static_runtime_cxx} and $CC={static_runtime_cxx} would "
                                    "give pyalloc a private copy"), choice
    assert choice.notice.endswith(f"building with {SYSTEM_GXX} instead ({ALLOW}=1 keeps them)"), choice
    env = {"CXX": static_runtime_cxx, "CC": static_runtime_cxx, ALLOW: "1"}
    use_for_setup(env)
    assert env["CXX"] == env["CC"] == static_runtime_cxx
    env = {"CC": static_runtime_cxx}
    assert use_for_setup(env).notice.startswith(f"pyalloc: $CC={static_runtime_cxx} would give")
    assert env == {"CC": SYSTEM_GXX, "CXX": SYSTEM_GXX}


def test_setup_py_takes_the_system_compiler_and_sets_aside_a_private_runtime(tmp_path, static_runtime_cxx):
    from pyalloc._toolchain import use_for_setup

    system = _fake_compiler(tmp_path / "usr" / "bin", "g++", "g++ 13")
    env = {"PATH": "/opt/gcc/bin"}
    assert use_for_setup(env, system=(system,)).cxx == system
    assert env["CXX"] == system and env["CC"] == system  # setuptools compiles and links with them
    env = {"CC": "/my/gcc"}
    use_for_setup(env, system=(system,))
    assert env == {"CC": "/my/gcc", "CXX": system}
    env = {"CXX": "/my/g++"}
    use_for_setup(env, system=(system,))
    assert env == {"CXX": "/my/g++", "CC": "/my/g++"}

    # setup.py itself says which compiler it builds with, before setuptools runs.
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", ALLOW)}
    if os.path.exists(SYSTEM_GXX):
        out = subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                             env=dict(base, CXX=static_runtime_cxx, CC=static_runtime_cxx), cwd=REPO, timeout=120)
        assert f"pyalloc: $CXX={static_runtime_cxx} and $CC={static_runtime_cxx} would give pyalloc a private " \
               "copy of the C++ runtime" in out.stderr, out.stderr
        assert f"pyalloc: C++ compiler: {SYSTEM_GXX}" in out.stderr, out.stderr
        out = subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                             env=dict(base, CXX=static_runtime_cxx, **{ALLOW: "1"}), cwd=REPO, timeout=120)
        assert f"pyalloc: C++ compiler: {static_runtime_cxx}: " in out.stderr, out.stderr
        assert "would give pyalloc" not in out.stderr
        out = subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                             env=base, cwd=REPO, timeout=120)
        assert "pyalloc: C++ compiler: /usr/bin/g++" in out.stderr and "(the system compiler)" in out.stderr, \
            out.stderr


# A package built the way setup.py builds pyalloc._C: the same compiler choice and
# the same checked build_ext (pyalloc/_toolchain.py), around one throwing C++ file.
TINY_SETUP = """
import importlib.util, os, sys
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

spec = importlib.util.spec_from_file_location("_toolchain", {toolchain!r})
toolchain = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = toolchain
spec.loader.exec_module(toolchain)
choice = toolchain.use_for_setup(os.environ)
if choice.notice:
    print(choice.notice, file=sys.stderr)
setup(name="tiny", ext_modules=[Extension("tiny", ["tiny.cpp"], language="c++")],
      cmdclass={{"build_ext": toolchain.checked_build_ext(build_ext, choice.refused)}})
"""
TINY_SOURCE = 'extern "C" int tiny_throws(int x) { if (x) throw x; return x; }\n'


def _build_tiny(folder, **env):
    folder.mkdir()
    (folder / "setup.py").write_text(TINY_SETUP.format(
        toolchain=os.path.join(REPO, "pyalloc", "_toolchain.py")))
    (folder / "tiny.cpp").write_text(TINY_SOURCE)
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "LDFLAGS", "LDSHARED", ALLOW)}
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], capture_output=True,
                         text=True, cwd=folder, env=dict(base, **env), timeout=300)
    built = [str(p) for p in folder.rglob("tiny*.so")]
    return out, built


@pytest.mark.slow
def test_a_build_with_a_private_runtime_falls_back_or_is_refused(tmp_path, static_runtime_cxx):
    from pyalloc._toolchain import read_runtime

    if not os.path.exists(SYSTEM_GXX):
        pytest.skip(f"no {SYSTEM_GXX}")
    # CC and CXX name the static-runtime compiler: built with the system one instead.
    out, built = _build_tiny(tmp_path / "fallback", CC=static_runtime_cxx, CXX=static_runtime_cxx)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "would give pyalloc a private copy of the C++ runtime" in out.stderr
    assert built and all(not read_runtime(p).is_private for p in built), [read_runtime(p) for p in built]
    # A private runtime from elsewhere (LDFLAGS): the library is read, deleted, and the build fails.
    static = "-static-libstdc++ -static-libgcc"
    out, built = _build_tiny(tmp_path / "ldflags", LDFLAGS=static)
    assert out.returncode != 0 and built == [], out.stdout + out.stderr
    assert "pyalloc: tiny" in out.stderr and "was linked with a private copy of the C++ runtime (__cxa_throw" \
        in out.stderr, out.stderr
    # The opt-out keeps both the compiler and what it builds.
    out, built = _build_tiny(tmp_path / "allowed", CC=static_runtime_cxx, CXX=static_runtime_cxx, **{ALLOW: "1"})
    assert out.returncode == 0 and "would give" not in out.stderr, out.stdout + out.stderr
    assert built and all(read_runtime(p).is_private for p in built)


def test_the_bridge_sets_aside_a_private_runtime_and_refuses_one_it_built(monkeypatch, tmp_path,
                                                                          static_runtime_cxx):
    torch = pytest.importorskip("torch")
    if not os.path.exists(SYSTEM_GXX):
        pytest.skip(f"no {SYSTEM_GXX}")
    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ALLOW, raising=False)
    monkeypatch.delenv("CXX", raising=False)
    plain = bridge.cache_dir(torch)
    monkeypatch.setenv("CXX", static_runtime_cxx)
    cxx, why = bridge.compiler()
    assert cxx == SYSTEM_GXX and why.endswith(f"not $CXX={static_runtime_cxx}, which links a private C++ runtime")
    assert bridge.cache_dir(torch) == plain  # the same compiler, the same build
    assert "not $CXX=" in bridge.status(torch)["compiler"]
    monkeypatch.setenv(ALLOW, "1")
    assert bridge.compiler()[0] == static_runtime_cxx

    # What the build checks after linking: a private runtime is deleted and refused.
    lib = tmp_path / "bridge.so"
    (tmp_path / "b.cpp").write_text(TINY_SOURCE)
    subprocess.run([static_runtime_cxx, "-shared", "-fPIC", str(tmp_path / "b.cpp"), "-o", str(lib)], check=True)
    bridge._refuse_a_private_runtime(str(lib))  # allowed
    assert lib.exists()
    monkeypatch.delenv(ALLOW)
    with pytest.raises(bridge.BridgeUnavailable, match=r"the bridge was linked with a private copy of the C\+\+ "
                                                        r"runtime \(__cxa_throw"):
        bridge._refuse_a_private_runtime(str(lib))
    assert not lib.exists()


def test_the_bridge_is_built_with_the_chosen_compiler_and_cached_per_compiler(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ALLOW, raising=False)
    one = _fake_compiler(tmp_path / "a", "g++", "g++ (GCC) 13.3.0")
    two = _fake_compiler(tmp_path / "b", "g++", "g++ (GCC) 14.1.0")
    monkeypatch.setenv("CXX", one)
    assert bridge.compiler()[0] == one  # it cannot link: kept, and its build will say why
    assert bridge.compiler_identity() == f"{one}: g++ (GCC) 13.3.0"
    first = bridge.cache_dir(torch)
    assert bridge.cache_dir(torch) == first
    monkeypatch.setenv("CXX", two)
    assert bridge.cache_dir(torch) != first  # another compiler: another build
    assert bridge.status(torch)["compiler"].startswith(f"{two}: g++ (GCC) 14.1.0 ($CXX; ")
    monkeypatch.setenv("CXX", str(tmp_path / "nothing" / "g++"))
    why = bridge.missing_prerequisite(torch, check=True)
    if bridge.find_cuda_headers() is not None and why is not None and "older than" not in why:
        assert why == f"no C++ compiler to build the bridge with: $CXX={tmp_path / 'nothing' / 'g++'} is not found"


def test_a_check_build_under_a_cuda_torch_without_a_gpu_says_so(monkeypatch, tmp_path):
    """Regression: `pyalloc bridge build --check` under a CUDA build of torch on a
    machine without a GPU said "this CPU build of torch cannot load it". The build's
    steps are stood in for (compiling takes minutes); what it says is build()'s own."""
    torch = pytest.importorskip("torch")
    from torch.utils import cpp_extension

    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path))
    monkeypatch.setattr(bridge, "missing_prerequisite", lambda torch, check=False: None)
    monkeypatch.setattr(bridge, "find_cuda_headers", lambda: bridge.CudaHeaders("/cuda/include", None, "toolkit"))

    def load(**kwargs):
        raise ImportError("libc10_cuda.so: cannot open shared object file")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(bridge, "_built_library", lambda build_dir: str(tmp_path / "pyalloc_bridge.so"))
    monkeypatch.setattr(bridge, "_unresolved_outside_cuda", lambda library: [])
    monkeypatch.setattr(torch.version, "cuda", None)
    assert bridge.build(check=True).message.endswith("; this CPU build of torch cannot load it")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = bridge.build(check=True).message
    assert "CPU build" not in message, message
    assert message.startswith(f"the bridge compiles and links against torch {torch.__version__} "), message
    assert "a CUDA 13.0 build, on a machine with no CUDA device" in message, message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = bridge.build(check=True).message
    assert "CPU build" not in message and "no CUDA device" not in message, message
    assert message.endswith("`pyalloc bridge build` builds and loads it for this CUDA 13.0 build of torch")


def test_built_library_is_the_newest_bridge_in_this_torchs_cache_folder(tmp_path, monkeypatch):
    """doctor asks for the built bridge through built_library(): none before a build,
    the newest of this torch's, Python's and compiler's cache folder after."""
    pytest.importorskip("torch")
    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path))
    assert bridge.built_library() is None
    folder = os.path.join(bridge.cache_dir(), "cuda")
    os.makedirs(folder)
    old, new = (os.path.join(folder, f"{bridge.MODULE_NAME}{tag}.so") for tag in ("_v1", "_v2"))
    for i, path in enumerate((old, new)):
        open(path, "w").close()
        os.utime(path, (1000 + i, 1000 + i))
    assert bridge.built_library() == new
    open(os.path.join(str(tmp_path), f"{bridge.MODULE_NAME}.so"), "w").close()  # another torch's folder
    assert bridge.built_library() == new


# -- a killed build, a build in progress, a bridge already built --------------------------
# The bridge's steps around torch.utils.cpp_extension run for real, on a stand-in for
# bridge.cpp (a plain Python module: compiling the real one takes minutes here); each
# child process has a timeout, so that a build waiting for ever fails the test.

TINY_BRIDGE = r"""
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "pyalloc_bridge", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_pyalloc_bridge(void) { return PyModule_Create(&module); }
"""

BUILD_CHILD = r"""
import json, os, sys, time
import torch
from torch.utils import cpp_extension
from pyalloc import bridge

mode, src = sys.argv[1], os.environ["TINY_SRC"]
bridge.source_dir = lambda: src
bridge.find_cuda_headers = lambda: bridge.CudaHeaders(src, None, "toolkit")
bridge.WAIT_REPORT_S = 1.0
torch.version.cuda = "13.0"  # a CUDA build of torch (whose CUDA libraries the stand-in needs not)
if mode == "hang":  # a build that never ends, killed by the test
    def hang(**kwargs):
        open(os.environ["BUILD_STARTED"], "w").close()
        time.sleep(600)
    cpp_extension._write_ninja_file_and_build_library = hang
if mode == "load":  # a machine that cannot build: no compiler (say), and a CUDA torch
    bridge.missing_prerequisite = lambda torch, check=False: "no C++ compiler here"
    module = bridge.load()
else:
    bridge.missing_prerequisite = lambda torch, check=False: None
    module = bridge.build(check=True).module
print(json.dumps({"answer": module.answer(), "file": module.__file__}))
"""


@pytest.fixture
def tiny_build(tmp_path):
    """Runs BUILD_CHILD: (mode, Popen keywords) -> Popen; and the check folder's path."""
    pytest.importorskip("torch")
    if shutil.which("g++") is None:
        pytest.skip("needs a C++ compiler")
    src = tmp_path / "csrc"
    (src / "torch_bridge").mkdir(parents=True)
    (src / "torch_bridge" / "bridge.cpp").write_text(TINY_BRIDGE)
    child = tmp_path / "child.py"
    child.write_text(BUILD_CHILD)
    env = dict(os.environ, PYTHONPATH=REPO, TINY_SRC=str(src), PYALLOC_BRIDGE_CACHE=str(tmp_path / "cache"),
               BUILD_STARTED=str(tmp_path / "started"))

    def start(mode, **kwargs):
        return subprocess.Popen([sys.executable, str(child), mode], env=env, text=True, **kwargs)

    start.started = tmp_path / "started"
    return start


def _start_a_build_that_hangs(tiny_build):
    hung = tiny_build("hang", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not tiny_build.started.exists():
        assert hung.poll() is None and time.monotonic() < deadline, "the hanging build did not start"
        time.sleep(0.1)
    return hung


def _cache_folder(tmp_path, kind):
    (folder,) = glob.glob(os.path.join(str(tmp_path / "cache"), "*", kind))
    return folder


def _finish(process, timeout):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"still waiting after {timeout} s; it said: {err}")
    assert process.returncode == 0, err
    return json.loads(out.splitlines()[-1]), err


def test_regression_a_build_killed_midway_does_not_hang_the_next_one(tiny_build, tmp_path):
    # Regression: cpp_extension's lock file, removed in a `finally` SIGKILL never runs,
    # made every later build wait on it for ever, silently.
    hung = _start_a_build_that_hangs(tiny_build)
    folder = _cache_folder(tmp_path, "check")
    assert os.path.exists(os.path.join(folder, "lock"))
    hung.send_signal(signal.SIGKILL)
    hung.wait(timeout=30)
    assert os.path.exists(os.path.join(folder, "lock")), "the killed build left torch's lock behind"
    report, err = _finish(tiny_build("build", stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=120)
    assert report["answer"] == 42
    assert f"pyalloc: removed {os.path.join(folder, 'lock')}, left by a bridge build that was stopped" in err, err
    assert "waiting" not in err, err


def test_a_process_waiting_for_a_live_build_says_so_and_for_how_long(tiny_build, tmp_path):
    hung = _start_a_build_that_hangs(tiny_build)
    waiting = tiny_build("build", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        said = ""
        deadline = time.monotonic() + 90
        while "(waited 1 s)" not in said and "(waited 2 s)" not in said:
            assert waiting.poll() is None and time.monotonic() < deadline, said
            said += os.read(waiting.stderr.fileno(), 4096).decode()
        folder = _cache_folder(tmp_path, "check")
        assert f"pyalloc: waiting for process {hung.pid} to finish building the bridge in {folder} (waited 0 s)" \
            in said, said
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait(timeout=30)
    report, err = _finish(waiting, timeout=120)
    assert report["answer"] == 42
    assert "pyalloc: the other build ended after " in said + err


def _hold_the_build_lock(folder):
    """The lock held, as by a build in progress, and torch's lock file there too."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, "lock"), "w").close()
    fd = os.open(os.path.join(folder, bridge.LOCK), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_regression_a_built_bridge_loads_without_the_build_lock_or_a_compiler(tiny_build, tmp_path):
    # Regression: loading went through the build's lock (and waited while it was held),
    # and the prerequisite check (a compiler, ninja, CUDA headers) refused a bridge built already.
    _finish(tiny_build("build", stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=300)
    check = _cache_folder(tmp_path, "check")
    cuda = os.path.join(os.path.dirname(check), "cuda")
    shutil.copytree(check, cuda)  # a finished build, with its stamp, where load() looks
    fd = _hold_the_build_lock(cuda)
    try:
        report, err = _finish(tiny_build("load", stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=60)
    finally:
        os.close(fd)
    assert report == {"answer": 42, "file": os.path.join(cuda, "pyalloc_bridge.so")}
    assert "waiting" not in err and "building" not in err, err


def test_regression_a_bridge_a_build_image_left_loads_where_no_compiler_is(tiny_build, tmp_path):
    # A runtime image without a compiler finds the bridge the build image's compiler built
    # (its own cache folder, named after no compiler, is empty).
    _finish(tiny_build("build", stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=300)
    check = _cache_folder(tmp_path, "check")
    prefix = os.path.dirname(check).rsplit("-cxx-", 1)[0]
    image = os.path.join(prefix + "-cxx-_opt_build-image_g__", "cuda")
    shutil.copytree(check, image)
    report, err = _finish(tiny_build("load", stdout=subprocess.PIPE, stderr=subprocess.PIPE), timeout=60)
    assert report == {"answer": 42, "file": os.path.join(image, "pyalloc_bridge.so")}
    # Sources that changed since: that build is not the bridge at hand, and is not loaded.
    with open(tmp_path / "csrc" / "torch_bridge" / "bridge.cpp", "a") as f:
        f.write("// changed\n")
    out = tiny_build("load", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = out.communicate(timeout=60)
    assert out.returncode != 0 and "no C++ compiler here" in err, err


def test_regression_status_counts_a_finished_bridge_from_another_compiler_as_usable(tmp_path, monkeypatch):
    # Regression: pyalloc doctor and `bridge status` said a runtime image without a compiler
    # could not take the bridge its build image had built, and install() fell back to the hooks.
    import types

    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path))
    torch = types.SimpleNamespace(__version__="2.11.0+cu130", version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setattr(bridge, "missing_prerequisite", lambda torch, check=False: "no C++ compiler here")
    prefix = bridge.cache_dir(torch).rsplit("-cxx-", 1)[0]
    image = os.path.join(prefix + "-cxx-_opt_build-image_g__", "cuda")
    os.makedirs(image)
    library = os.path.join(image, "pyalloc_bridge.so")
    open(library, "w").close()
    assert bridge.status(torch)["why_not"] == "no C++ compiler here"  # not finished: no stamp
    bridge._write_stamp(image, library, bridge._fingerprint(bridge.source_dir()))
    st = bridge.status(torch)
    assert (st["why_not"], st["built"], st["library"]) == (None, True, library)
    torch.version.cuda = None  # a CPU build of torch cannot load it, finished or not
    assert bridge.status(torch)["why_not"] == "no C++ compiler here"
