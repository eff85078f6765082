"""The CUDA backend on CPU, against a stand-in libcuda.so.1 (tests/cuda_stub/).

The stand-in counts the driver calls pyalloc makes, so this checks what no fake
backend can: primary contexts made current and restored, events created once
and recycled, out-of-memory told apart from other driver errors, and no call
that CUDA's global capture mode forbids while a capture is underway.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STUB_DIR = os.path.join(HERE, "cuda_stub")


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory):
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


# What each mode must say on stderr, exactly once (and nothing else from pyalloc).
STDERR = {
    "segments": ["cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)",
                 "a CUDA graph capture into pool (0, 15) on device 0 was never ended"],
    "vmm": ["device 1: cuMemSetAccess for peer devices failed: CUDA_ERROR_NOT_SUPPORTED (801)",
            "device 0: cuMemSetAccess for peer devices failed: CUDA_ERROR_NOT_SUPPORTED (801)",
            # vmm_check_parked_pages_go_back_when_the_capture_ends: a route its pool's release ends
            "a CUDA graph capture into pool (0, 31) on device 0 was never ended"],
    "fallback": ["device 0 cannot use strategy vmm (the driver refused a trial mapping: "
                 "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED (800)); its pools use strategy bestfit"],
    "capture": [], "capture-big": [], "capture-error": [], "capture-access": [], "areas-norelax": [],
}
STDERR["segments-norelax"] = STDERR["segments"][:1]  # no capture grows a graph pool there


@pytest.mark.parametrize("mode", ["segments", "vmm", "fallback", "capture", "capture-big", "capture-error",
                                  "capture-access", "segments-norelax", "areas-norelax"])
def test_cuda_backend_against_the_stand_in_driver(stub_driver, mode):
    library = stub_driver["norelax" if mode.endswith("norelax") else "relaxed"]
    env = dict(os.environ, PYTHONPATH=REPO, LD_LIBRARY_PATH=str(library.parent))
    env.pop("PYALLOC_CONF", None)
    out = subprocess.run(
        [sys.executable, os.path.join(STUB_DIR, "checks.py"), str(library)]
        + [m for m in mode.split("-") if m != "segments"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("pyalloc:")]
    assert len(said) == len(STDERR[mode]), out.stderr
    for words in STDERR[mode]:
        assert sum(words in line for line in said) == 1, (words, out.stderr)
