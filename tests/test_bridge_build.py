"""The bridge (csrc/torch_bridge/) built against the installed torch, on CPU.

A CPU build of torch has the headers of PyTorch's CUDA allocator interface but
not its CUDA libraries: the bridge compiles and links against it, and cannot be
loaded. ``pyalloc bridge build --check`` proves the first; on a GPU the bridge
is loaded and exercised by tests/gpu/ (test_gpu.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pyalloc import bridge

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _headers_or_skip():
    cuda = bridge.find_cuda_headers()
    if cuda is None:
        pytest.skip("no CUDA runtime headers here (no CUDA toolkit, no nvidia CUDA runtime wheel)")
    return cuda


def test_check_build_compiles_and_links_against_the_installed_torch(tmp_path):
    pytest.importorskip("torch")
    _headers_or_skip()
    env = dict(os.environ, PYALLOC_BRIDGE_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pyalloc", "bridge", "build", "--check"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "compiles and links against torch" in out.stdout
    built = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.endswith(".so")]
    assert built, "no shared object was written"
    if shutil.which("nm") is not None:
        # What only a GPU can show working, seen here in what the bridge links to:
        # it registers itself for the CUDA device type (torch.accelerator's
        # memory calls), and recordStream tells storages that own nothing apart.
        imports = subprocess.run(["nm", "-D", "-C", "--undefined-only", built[0]], capture_output=True,
                                 text=True, check=True).stdout
        assert "c10::SetAllocator(" in imports and "c10::GetAllocator(" in imports
        assert "c10::detail::deleteNothing(" in imports


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


def _fake_compiler(folder, name, version):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


def test_the_system_compiler_is_chosen_over_one_first_on_path(tmp_path):
    from pyalloc._toolchain import choose_cxx

    opt = _fake_compiler(tmp_path / "opt" / "gcc" / "bin", "g++", "g++ (GCC) 14.1.0")
    system = _fake_compiler(tmp_path / "usr" / "bin", "g++", "g++ (Ubuntu 13.3.0) 13.3.0")
    path = str(tmp_path / "opt" / "gcc" / "bin")
    assert choose_cxx({"PATH": path}, system=(system,)) == (system, "the system compiler")
    assert choose_cxx({"PATH": path, "CXX": "/x/clang++"}, system=(system,)) == ("/x/clang++", "$CXX")
    cxx, why = choose_cxx({"PATH": path}, system=(str(tmp_path / "none" / "g++"),))
    assert cxx == opt and why.startswith("found on PATH (no system compiler at "), why
    assert choose_cxx({"PATH": str(tmp_path / "empty")}, system=())[0] is None


def test_setup_py_takes_the_system_compiler_and_leaves_cc_and_cxx_to_the_user(tmp_path):
    from pyalloc._toolchain import use_for_setup

    system = _fake_compiler(tmp_path / "usr" / "bin", "g++", "g++ 13")
    env = {"PATH": "/opt/gcc/bin"}
    assert use_for_setup(env, system=(system,)) == (system, "the system compiler")
    assert env["CXX"] == system and env["CC"] == system  # setuptools compiles and links with them
    env = {"CC": "/my/gcc"}
    use_for_setup(env, system=(system,))
    assert env == {"CC": "/my/gcc", "CXX": system}
    env = {"CXX": "/my/g++"}
    use_for_setup(env, system=(system,))
    assert env == {"CXX": "/my/g++", "CC": "/my/g++"}

    # setup.py itself says which compiler it builds with, before setuptools runs.
    opt = tmp_path / "opt" / "gcc" / "bin"
    _fake_compiler(opt, "g++", "g++ (GCC) 14.1.0")
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    base["PATH"] = os.pathsep.join([str(opt), base.get("PATH", "")])
    out = subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                         env=dict(base, CXX=str(opt / "g++")), cwd=REPO, timeout=120)
    assert f"pyalloc: C++ compiler: {opt / 'g++'}: g++ (GCC) 14.1.0 ($CXX)" in out.stderr, out.stderr
    if os.path.exists("/usr/bin/g++"):
        out = subprocess.run([sys.executable, "setup.py", "--name"], capture_output=True, text=True,
                             env=base, cwd=REPO, timeout=120)
        assert "pyalloc: C++ compiler: /usr/bin/g++" in out.stderr and "(the system compiler)" in out.stderr, \
            out.stderr


def test_the_bridge_is_built_with_the_chosen_compiler_and_cached_per_compiler(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("PYALLOC_BRIDGE_CACHE", str(tmp_path / "cache"))
    one = _fake_compiler(tmp_path / "a", "g++", "g++ (GCC) 13.3.0")
    two = _fake_compiler(tmp_path / "b", "g++", "g++ (GCC) 14.1.0")
    monkeypatch.setenv("CXX", one)
    assert bridge.compiler() == (one, "$CXX")
    assert bridge.compiler_identity() == f"{one}: g++ (GCC) 13.3.0"
    first = bridge.cache_dir(torch)
    assert bridge.cache_dir(torch) == first
    monkeypatch.setenv("CXX", two)
    assert bridge.cache_dir(torch) != first  # another compiler: another build
    assert bridge.status(torch)["compiler"] == f"{two}: g++ (GCC) 14.1.0 ($CXX)"
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
