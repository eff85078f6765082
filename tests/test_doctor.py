"""`pyalloc doctor` on a machine without a GPU: with no driver, with the stand-in
driver (tests/cuda_stub/), with a broken torch and a bad PYALLOC_CONF. It always
ends with its verdict and never shows a traceback."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from test_cuda_backend_stub import stub_driver as stub_drivers  # noqa: F401  (the fixture)


@pytest.fixture
def stub_driver(stub_drivers):  # noqa: F811
    return stub_drivers["relaxed"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    full.pop("PYALLOC_CONF", None)
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


def test_with_the_stand_in_driver_it_reports_its_devices(stub_driver):  # noqa: F811
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent))
    text = "\n".join(lines)
    assert "driver:   CUDA 13.0 (13000), " + str(stub_driver) in text, text
    assert "devices:  2" in text
    for i in (0, 1):
        assert f"cuda:{i}  pyalloc stand-in device: 256.00 MiB total, 256.00 MiB free" in text, text
    assert "virtual memory: no (the device does not support virtual memory management)" in text
    assert "cuda:0 will use strategy bestfit" in text  # the default strategy is vmm
    if _torch_is_cpu_only():
        assert rc == 1 and lines[-1] == "not ready: the installed torch is a CPU-only build (pyalloc needs a CUDA build)", lines
    else:
        assert lines[-1] == "ready" or lines[-1].startswith("not ready: "), lines


def test_a_bad_pyalloc_conf_is_named(stub_driver):  # noqa: F811
    rc, lines = doctor("--no-live", ld_path=str(stub_driver.parent), env={"PYALLOC_CONF": "pool_size:lots"})
    assert rc == 1
    assert "PYALLOC_CONF is invalid" in lines[-1], lines
    assert lines[-1].startswith("not ready: "), lines


def test_a_broken_torch_is_a_line_not_a_traceback(stub_driver, tmp_path):  # noqa: F811
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('libtorch_cuda.so: cannot open shared object file')\n")
    rc, lines = doctor(ld_path=str(stub_driver.parent), path=[str(tmp_path)])
    assert rc == 1
    assert any("torch:    cannot be imported (OSError: libtorch_cuda.so" in line for line in lines), lines
    assert lines[-1].startswith("not ready: torch cannot be imported (OSError: libtorch_cuda.so"), lines


def test_doctor_is_a_command():
    out = subprocess.run([sys.executable, "-m", "pyalloc", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert "doctor" in out.stdout
