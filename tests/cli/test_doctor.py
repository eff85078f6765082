"""`pyalloc doctor` on a machine without a GPU: with no driver, with the stand-in
driver (tests/cuda_stub/), with a broken torch and a bad PYALLOC_CONF. It always
ends with its verdict and never shows a traceback."""
from __future__ import annotations

import ctypes
import types
import os
import subprocess
import sys

import pytest


@pytest.fixture
def stub_driver(stub_drivers):
    return stub_drivers["relaxed"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_is_cpu_only() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.version.cuda


def _real_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def doctor(*args, ld_path="", env=None, path=()):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *path]), LD_LIBRARY_PATH=ld_path)
    for name in ("PYALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        full.pop(name, None)
    full.update(env or {})
    out = subprocess.run([sys.executable, "-m", "pyalloc", "doctor", *args], capture_output=True,
                         text=True, env=full, timeout=120, cwd=REPO)
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    return out.returncode, lines


@pytest.mark.skipif(_real_driver_present(), reason="this machine has a CUDA driver")
def test_without_a_driver_it_says_there_is_no_gpu(tmp_path):
    rc, lines = doctor(ld_path=str(tmp_path))
    assert rc == 1
    assert lines[-1].startswith("not ready: no CUDA GPU"), lines
    assert any(line.startswith("driver:   not usable") and "libcuda.so.1" in line for line in lines)
    assert any(line.startswith("PYALLOC_CONF: not set") for line in lines)


def test_with_the_stand_in_driver_it_reports_its_devices(stub_driver):
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent))
    text = "\n".join(lines)
    assert "driver:   CUDA 13.0 (13000), " + str(stub_driver) in text, text
    assert "devices:  2" in text
    for i in (0, 1):
        assert f"cuda:{i}  pyalloc stand-in device: 256.00 MiB total, 256.00 MiB free" in text, text
    assert "virtual memory: no (the device does not support virtual memory management)" in text
    assert "cuda:0 will use strategy bestfit" in text  # the default strategy is vmm
    # The C++ runtime of pyalloc._C, read with readelf: this build uses the shared one.
    assert "runtime:  the C++ runtime of each library (readelf):" in text, text
    at = lines.index("          pyalloc._C: " + lines[lines.index("runtime:  the C++ runtime of each library "
                                                                  "(readelf):") + 1].split(": ", 1)[1])
    assert lines[at + 3] == "            C++ runtime: the shared one", lines[at:at + 4]
    if _torch_is_cpu_only():
        assert rc == 1 and lines[-1] == "not ready: the installed torch is a CPU-only build (pyalloc needs a CUDA build)", lines
    else:
        assert lines[-1] == "ready" or lines[-1].startswith("not ready: "), lines


def test_a_bad_pyalloc_conf_is_named(stub_driver):
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent), env={"PYALLOC_CONF": "pool_size:lots"})
    assert rc == 1
    assert "PYALLOC_CONF is invalid" in lines[-1], lines
    assert lines[-1].startswith("not ready: "), lines


def test_a_broken_torch_is_a_line_not_a_traceback(stub_driver, tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('libtorch_cuda.so: cannot open shared object file')\n")
    rc, lines = doctor(ld_path=str(stub_driver.parent), path=[str(tmp_path)])
    assert rc == 1
    assert any("torch:    cannot be imported (OSError: libtorch_cuda.so" in line for line in lines), lines
    assert "bridge:   cannot be used: torch cannot be imported (OSError: libtorch_cuda.so: cannot open " \
           "shared object file)" in lines, lines
    assert lines[-1].startswith("not ready: torch cannot be imported (OSError: libtorch_cuda.so"), lines
    assert not any(line.startswith("internal error") for line in lines), lines


def test_doctor_is_a_command():
    out = subprocess.run([sys.executable, "-m", "pyalloc", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert "doctor" in out.stdout


# -- the bridge ---------------------------------------------------------------------------


def test_a_cpu_torch_cannot_take_the_bridge_and_the_report_says_what_is_lost(stub_driver):
    if not _torch_is_cpu_only():
        pytest.skip("a CUDA build of torch")
    from pyalloc.bridge import LOST_WITHOUT_BRIDGE

    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent))
    text = "\n".join(lines)
    assert any(line.startswith("bridge:   torch ") and "CPU-only: cannot take it" in line for line in lines), text
    assert "          CUDA headers: " in text and "          built: no" in text
    assert "install() would take: the C hooks, with a warning" in text
    assert "in use in this process: none" in text
    assert "why not the bridge: torch " in text and "install a CUDA build of torch" in text
    for item in LOST_WITHOUT_BRIDGE:
        assert f"            - {item}" in text
    assert "to get it: " in text and "pyalloc bridge build" in text
    assert lines[-1].startswith("not ready: ") and "bridge" not in lines[-1], lines[-1]
    # The C++ exception check ran in a child process, and found them reaching Python.
    assert "exceptions: a C++ exception thrown in pyalloc._C reaches Python (ValueError)" in lines, lines


def test_pyalloc_bridge_1_without_a_bridge_is_not_ready(stub_driver):
    if not _torch_is_cpu_only():
        pytest.skip("a CUDA build of torch")
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent), env={"PYALLOC_BRIDGE": "1"})
    assert "          install() would fail: PYALLOC_BRIDGE=1 asks for the bridge, which cannot be had here" \
        in lines, lines
    assert rc == 1 and "PYALLOC_BRIDGE=1 asks for the bridge" in lines[-1], lines[-1]


def _fake_torch(version="2.11.0+cu130", cuda="13.0"):
    return types.SimpleNamespace(__version__=version, version=types.SimpleNamespace(cuda=cuda))


def _report():
    from pyalloc.doctor import Report

    lines = []
    return Report(lines.append), lines


@pytest.fixture
def buildable(monkeypatch, tmp_path):
    """Everything the bridge's build needs, found; an empty build cache."""
    from pyalloc import bridge

    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path))
    monkeypatch.delenv("PYALLOC_BRIDGE", raising=False)
    monkeypatch.setattr(bridge, "find_cuda_headers",
                        lambda *a: bridge.CudaHeaders("/opt/cuda/include", None, "toolkit"))
    monkeypatch.setattr(bridge.shutil, "which", lambda name: f"/usr/bin/{name}")
    return tmp_path


def test_a_cuda_torch_takes_the_bridge_built_on_first_install(buildable):
    from pyalloc import bridge
    from pyalloc.doctor import check_bridge

    r, lines = _report()
    assert check_bridge(r, _fake_torch()) == "bridge"
    text = "\n".join(lines)
    assert lines[0] == "bridge:   torch 2.11.0+cu130, CUDA 13.0: can take it", text
    assert "CUDA headers: /opt/cuda/include (toolkit)" in text
    assert f"built: no (it would be built in {bridge.cache_dir(_fake_torch())}" in text
    assert "install() would take: the bridge, built by the first install()" in text
    assert "why not" not in text and "do not work" not in text and not r.problems

    # Once built, the report names the file.
    folder = os.path.join(bridge.cache_dir(_fake_torch()), "cuda")
    os.makedirs(folder)
    library = os.path.join(folder, "pyalloc_bridge.so")
    open(library, "w").close()
    r, lines = _report()
    assert check_bridge(r, _fake_torch()) == "bridge"
    assert f"          built: yes, {library}" in lines and "          install() would take: the bridge" in lines


@pytest.mark.parametrize("value, route, words", [
    ("0", "hooks", "install() would take: the C hooks (PYALLOC_BRIDGE=0)"),
    ("auto", "bridge", "install() would take: the bridge, built by the first install()"),
    ("sometimes", None, "install() would fail: PYALLOC_BRIDGE='sometimes'"),
])
def test_pyalloc_bridge_decides_the_route(buildable, monkeypatch, value, route, words):
    from pyalloc.doctor import check_bridge

    monkeypatch.setenv("PYALLOC_BRIDGE", value)
    r, lines = _report()
    assert check_bridge(r, _fake_torch()) == route
    assert any(words in line for line in lines), lines
    assert bool(r.problems) == (route is None)


def test_what_keeps_the_bridge_away_is_named(buildable, monkeypatch):
    from pyalloc import bridge
    from pyalloc.doctor import check_bridge

    r, lines = _report()
    assert check_bridge(r, _fake_torch(version="2.8.0+cu128")) == "hooks"
    assert "why not the bridge: torch 2.8.0+cu128 is older than 2.9" in "\n".join(lines)
    monkeypatch.setattr(bridge, "find_cuda_headers", lambda *a: None)
    r, lines = _report()
    assert check_bridge(r, _fake_torch()) == "hooks"
    text = "\n".join(lines)
    assert "CUDA headers: not found" in text and "why not the bridge: the CUDA runtime's headers" in text
    assert "install the CUDA toolkit" in text and not r.problems
    monkeypatch.setenv("PYALLOC_BRIDGE", "1")
    r, lines = _report()
    assert check_bridge(r, _fake_torch()) is None
    assert r.problems and "PYALLOC_BRIDGE=1 asks for the bridge" in r.problems[0]


def test_a_crash_where_pyalloc_throws_is_named():
    from pyalloc.doctor import check_exceptions

    r, lines = _report()
    check_exceptions(r, code="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    text = ("C++ exceptions crash in this build of pyalloc (signal 11): rebuild it with the "
            "system C++ compiler")
    assert lines == [f"exceptions: {text}"] and r.problems == [text]
    r, lines = _report()
    check_exceptions(r, code="raise SystemExit('the import failed')")
    assert lines == ["exceptions: the check failed: the child exited with 1: the import failed"], lines
    assert r.problems == ["the C++ exception check failed (the import failed)"]


def test_the_live_check_says_which_route_it_got():
    from pyalloc.doctor import live_check

    r, lines = _report()
    code = ("print('FALLBACK pyalloc: the bridge to PyTorch is not available (no compiler)')\n"
            "print('LIVE OK hooks 0')")
    live_check(r, [{"index": 0}], timeout=60, code=code)
    assert lines[0].startswith("live:     cuda:0 ok through the C hooks (install, "), lines
    assert lines[1] == "          pyalloc: the bridge to PyTorch is not available (no compiler)"
    assert not r.problems
    r, lines = _report()
    live_check(r, [{"index": 0}, {"index": 1}], timeout=60, builds_bridge=True, code="print('LIVE OK bridge 0')")
    assert lines[0].startswith("live:     the bridge is not built yet")
    assert [line[:37] for line in lines[1:]] == ["live:     cuda:0 ok through the bridg",
                                                 "live:     cuda:1 ok through the bridg"]
    r, lines = _report()
    live_check(r, [{"index": 0}], timeout=60, code="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert lines[0].startswith("live:     cuda:0 failed: the child died of signal 11"), lines
    assert r.problems and "device 0" in r.problems[0]


# -- one C++ runtime ----------------------------------------------------------------------


THROWS = ('#include <stdexcept>\n'
          'extern "C" int pyalloc_test_throws(int x) {\n'
          '  try { if (x) throw std::runtime_error("x"); } catch (const std::exception&) { return 1; }\n'
          '  return 0;\n'
          '}\n')


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    """Two tiny C++ libraries that throw: one with the shared C++ runtime, one with a
    private copy linked in (-static-libstdc++ -static-libgcc, as a compiler with its
    own runtime would build pyalloc), and one whose RUNPATH holds a C++ runtime."""
    import shutil

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or shutil.which("readelf") is None:
        pytest.skip("needs a C++ compiler and readelf")
    d = tmp_path_factory.mktemp("runtimes")
    (d / "throws.cpp").write_text(THROWS)
    (d / "own").mkdir()
    (d / "own" / "libstdc++.so.6").write_text("")  # what a RUNPATH would make the loader pick
    built = {}
    for name, flags in (("shared", []), ("private", ["-static-libstdc++", "-static-libgcc"]),
                        ("runpath", [f"-Wl,-rpath,{d / 'own'}", "-Wl,--enable-new-dtags"])):
        built[name] = str(d / f"lib{name}.so")
        subprocess.run([cxx, "-shared", "-fPIC", *flags, str(d / "throws.cpp"), "-o", built[name]], check=True)
    return built


def test_a_library_with_a_private_cxx_runtime_is_told_apart(runtimes):
    from pyalloc._toolchain import read_runtime

    private, shared = read_runtime(runtimes["private"]), read_runtime(runtimes["shared"])
    assert private.private == ["__cxa_throw", "_Unwind_RaiseException"], private
    assert shared.private == [] and shared.error is None
    assert shared.compilers and shared.compilers[0].startswith("GCC: ")
    runpath = read_runtime(runtimes["runpath"])
    assert runpath.runpath and runpath.runtime_in_runpath[0].endswith("own/libstdc++.so.6"), runpath
    # A RUNPATH copy is taken only where pyalloc loads before torch: doctor names it, no
    # build refuses it (conda's Python puts its own lib/, torch's runtime, in every RUNPATH).
    assert not runpath.is_private


def test_the_interpreters_own_lib_folder_in_a_runpath_is_no_problem(tmp_path, monkeypatch):
    """conda's Python links every extension with -Wl,-rpath,$PREFIX/lib, where the
    libstdc++.so.6 that Python and torch load lies: a build there must go ahead."""
    import shutil
    import sys

    from pyalloc import _toolchain

    cxx = shutil.which("g++")
    if cxx is None or shutil.which("readelf") is None:
        pytest.skip("needs g++ and readelf")
    prefix = tmp_path / "env"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libstdc++.so.6").write_text("")
    (tmp_path / "throws.cpp").write_text(THROWS)
    lib = str(tmp_path / "libconda.so")
    subprocess.run([cxx, "-shared", "-fPIC", f"-Wl,-rpath,{prefix / 'lib'}", str(tmp_path / "throws.cpp"),
                    "-o", lib], check=True)
    assert read_runtime_of(lib).runtime_in_runpath  # elsewhere it would be named
    monkeypatch.setattr(sys, "prefix", str(prefix))
    info = read_runtime_of(lib)
    assert info.runtime_in_runpath == [] and not info.is_private, info
    assert _toolchain.private_runtime_problem(lib, "pyalloc._C", env={}) is None
    assert _toolchain.runtime_problems({"pyalloc._C": info}, {}) == []


def read_runtime_of(path):
    from pyalloc._toolchain import read_runtime

    return read_runtime(path)


def test_a_library_on_libcxx_needs_another_runtime(tmp_path):
    """clang++ -stdlib=libc++ links no libstdc++ and defines no __cxa_throw: it needs
    libc++, a runtime torch never loads. A stand-in libc++.so.1 shows it."""
    import shutil

    from pyalloc import _toolchain

    cxx = shutil.which("g++")
    if cxx is None or shutil.which("readelf") is None:
        pytest.skip("needs g++ and readelf")
    (tmp_path / "empty.c").write_text("int pyalloc_libcxx_stand_in;\n")
    subprocess.run([cxx, "-shared", "-fPIC", "-Wl,-soname,libc++.so.1", "-x", "c", str(tmp_path / "empty.c"),
                    "-o", str(tmp_path / "libc++.so.1")], check=True)
    (tmp_path / "throws.cpp").write_text(THROWS)
    lib = str(tmp_path / "libcxx.so")
    # --no-as-needed: the stand-in defines nothing the library uses, and a linker that drops
    # unused libraries by default would leave it out of DT_NEEDED.
    subprocess.run([cxx, "-shared", "-fPIC", str(tmp_path / "throws.cpp"), "-Wl,--no-as-needed",
                    str(tmp_path / "libc++.so.1"), "-o", lib], check=True)
    info = read_runtime_of(lib)
    assert info.foreign == ["libc++.so.1"] and info.is_private, info
    problem = _toolchain.private_runtime_problem(lib, "pyalloc._C", env={})
    assert problem is not None and "libc++.so.1" in problem, problem
    assert _toolchain.runtime_problems({"pyalloc._C": info}, {})[0].startswith(
        "pyalloc._C needs another C++ runtime (libc++.so.1)")


def test_doctor_calls_a_mix_of_cxx_runtimes_not_ready(runtimes):
    from pyalloc.doctor import check_runtime

    r, lines = _report()
    check_runtime(r, [("pyalloc._C", runtimes["private"]), ("torch libc10.so", runtimes["shared"])])
    text = "\n".join(lines)
    assert "pyalloc._C: GCC: " in text and "RUNPATH/RPATH: none" in text, text
    assert "C++ runtime: a private copy (__cxa_throw, _Unwind_RaiseException defined here)" in text, text
    assert "C++ runtime: the shared one" in text, text
    assert len(r.problems) == 1, r.problems
    assert r.problems[0].startswith("pyalloc._C holds a private copy of the C++ runtime (__cxa_throw, "
                                    "_Unwind_RaiseException) that torch's libraries do not: rebuild with "
                                    "the system g++"), r.problems
    assert "python setup.py build_ext --inplace --force" in r.problems[0]

    r, lines = _report()
    check_runtime(r, [("the bridge", runtimes["runpath"]), ("torch libc10.so", runtimes["shared"])])
    assert len(r.problems) == 1 and r.problems[0].startswith(
        "the bridge finds a C++ runtime through its RUNPATH ("), r.problems

    r, lines = _report()
    check_runtime(r, [("pyalloc._C", runtimes["shared"]), ("torch libc10.so", runtimes["shared"]),
                      ("torch libmissing.so", os.path.join(os.path.dirname(runtimes["shared"]), "nothing.so"))])
    assert not r.problems, r.problems
    assert any(line.startswith("          torch libmissing.so: cannot be read (") for line in lines), lines
    assert lines[0].startswith("compiler: ") and lines[0].endswith("builds pyalloc._C and the bridge"), lines


def test_doctor_names_a_compiler_set_aside_for_its_private_runtime(monkeypatch, runtimes, static_runtime_cxx):
    from pyalloc.doctor import check_runtime

    if not os.path.exists("/usr/bin/g++"):
        pytest.skip("no /usr/bin/g++")
    monkeypatch.delenv("PYALLOC_ALLOW_PRIVATE_RUNTIME", raising=False)
    monkeypatch.setenv("CXX", static_runtime_cxx)
    r, lines = _report()
    check_runtime(r, [("pyalloc._C", runtimes["shared"])])
    assert lines[0].startswith("compiler: /usr/bin/g++") and f"not $CXX={static_runtime_cxx}" in lines[0], lines
    assert lines[1].startswith(f"          $CXX={static_runtime_cxx} would give pyalloc a private copy of the "
                               "C++ runtime (__cxa_throw, _Unwind_RaiseException defined in it"), lines
    assert not r.problems

    # The opt-out: the compiler is kept and said to be unchecked; a private runtime is still reported.
    monkeypatch.setenv("PYALLOC_ALLOW_PRIVATE_RUNTIME", "1")
    r, lines = _report()
    check_runtime(r, [("pyalloc._C", runtimes["private"]), ("torch libc10.so", runtimes["shared"])])
    assert lines[0].startswith(f"compiler: {static_runtime_cxx}: "), lines
    assert lines[1] == ("          PYALLOC_ALLOW_PRIVATE_RUNTIME=1: compilers and the libraries they build are "
                        "not checked for a private C++ runtime"), lines
    assert len(r.problems) == 1 and r.problems[0].endswith("once PYALLOC_ALLOW_PRIVATE_RUNTIME is unset)"), \
        r.problems


def test_doctor_without_readelf_says_so(runtimes):
    from pyalloc.doctor import check_runtime

    r, lines = _report()
    check_runtime(r, [("pyalloc._C", runtimes["private"])], readelf="pyalloc-no-such-readelf")
    assert lines[1] == ("runtime:  pyalloc-no-such-readelf is not found (binutils): which C++ runtime "
                        "each library uses cannot be told"), lines
    assert not r.problems


def test_pytorch_alloc_conf_keys_are_shown_with_how_each_is_taken(stub_driver):
    conf = "expandable_segments:True,max_split_size_mb:64,garbage_collection_threshold:0.6"
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent), env={"PYTORCH_CUDA_ALLOC_CONF": conf})
    at = lines.index(f"PYTORCH_CUDA_ALLOC_CONF: {conf!r}")
    shown = lines[at + 1:at + 4]
    assert shown[0].startswith("          expandable_segments:True -> strategy:vmm (applied: "), shown
    assert shown[1].startswith("          max_split_size_mb:64 -> max_split_size:67108864 (applied: "), shown
    assert shown[2].startswith("          garbage_collection_threshold:0.6 (not applied: "), shown
    assert any(line.startswith("          effective: ") and "max_split_size=67108864" in line for line in lines)

    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent), env={"PYTORCH_ALLOC_CONF": "backend:turbo"})
    assert rc == 1 and "PyTorch's allocator settings are invalid" in lines[-1], lines
