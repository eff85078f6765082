"""Shared pytest setup: one generic suite runs over every backend and strategy that
needs no GPU; tests marked ``gpu`` run only where PyTorch sees a CUDA GPU, and
those marked ``shared`` only where ../shared is (shared_dir.py)."""
from __future__ import annotations

import functools
import gc
import os
import shutil
import subprocess

import pytest

import pyalloc
from shared_dir import SHARED_DIR

CPU_BACKENDS = ("host", "virtual")
STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_stub")


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=["bestfit", "vmm"])
def strategy(request):
    return request.param


@pytest.fixture
def make(backend, strategy):
    """make(**config) -> Allocator on the parametrized backend and strategy."""

    def factory(conf=None, **kwargs):
        kwargs.setdefault("strategy", strategy)
        return pyalloc.Allocator(backend, conf, **kwargs)

    return factory


@pytest.fixture
def host():
    """make(**config) -> Allocator on real host memory."""

    def factory(conf=None, **kwargs):
        return pyalloc.Allocator("host", conf, **kwargs)

    return factory



@pytest.fixture
def fake():
    """pyalloc's CUDA pools on fake devices of 64 MiB of host memory each (no GPU),
    dropped after the test."""
    from pyalloc import _C

    _C._testing_use_fake_devices(64 << 20)
    try:
        yield
    finally:
        gc.collect()  # tensors over fake memory must die before it is unmapped
        _C._testing_reset()


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA GPU (asked once, and only if needed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    if not SHARED_DIR.is_dir():
        skip_shared = pytest.mark.skip(reason=f"reads {SHARED_DIR}, which this machine does not have")
        for item in items:
            if "shared" in item.keywords:
                item.add_marker(skip_shared, append=False)  # before "got empty parameter set"
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


#: A compiler like one that brings its own C++ runtime (/opt/gcc/bin/g++ on some GPU
#: images): the system g++, linking libstdc++ and libgcc statically into what it links.
STATIC_RUNTIME_CXX = """#!/bin/sh
case " $* " in
  *" -c "*) exec {cxx} "$@" ;;
esac
exec {cxx} -static-libstdc++ -static-libgcc "$@"
"""


@pytest.fixture(scope="session")
def static_runtime_cxx(tmp_path_factory):
    """The path of a compiler wrapper whose link takes the C++ runtime statically."""
    cxx = "/usr/bin/g++" if os.path.exists("/usr/bin/g++") else shutil.which("g++")
    if cxx is None or shutil.which("readelf") is None:
        pytest.skip("needs g++ and readelf")
    folder = tmp_path_factory.mktemp("static-runtime") / "bin"
    folder.mkdir()
    path = folder / "g++"
    path.write_text(STATIC_RUNTIME_CXX.format(cxx=cxx))
    path.chmod(0o755)
    from pyalloc._toolchain import probe_runtime

    if probe_runtime(str(path)).runtime == "unknown":
        pytest.skip(f"g++ cannot link the C++ runtime statically here: {probe_runtime(str(path)).detail}")
    return str(path)


@pytest.fixture(scope="session")
def stub_drivers(tmp_path_factory):
    """The stand-in libcuda.so.1 of tests/cuda_stub/, built twice: {"relaxed", "norelax"} -> its path."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    drivers = {}
    # The second lacks cuThreadExchangeStreamCaptureMode, like drivers before CUDA 10.1.
    for name, flags in (("relaxed", []), ("norelax", ["-DSTUB_NO_RELAXED"])):
        out_dir = tmp_path_factory.mktemp(f"stub_driver_{name}")
        library = out_dir / "libcuda.so.1"
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O1", "-pthread", "-Wl,-soname,libcuda.so.1", *flags,
             os.path.join(STUB_DIR, "libcuda_stub.c"), "-o", str(library)],
            check=True, capture_output=True, text=True,
        )
        drivers[name] = library
    return drivers
