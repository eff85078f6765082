"""pyalloc as PyTorch's CUDA allocator on a real GPU.

PyTorch's allocator can be swapped only once per process, so each check is a
script in tests/gpu/ run in a fresh process. All are marked ``gpu`` and skipped
(conftest.py) where torch sees no CUDA GPU.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_DIR = os.path.join(REPO, "tests", "gpu")


# PYALLOC_CONF in the environment of pytest (say strategy:bestfit) applies to every
# check; a check that sets its own adds its keys to it.
BASE_CONF = os.environ.get("PYALLOC_CONF", "")


def run(args, env=None, timeout=600) -> str:
    full_env = dict(os.environ, PYTHONPATH=REPO, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    full_env.pop("PYALLOC_CONF", None)
    full_env.update(env or {})
    conf = ",".join(c for c in (BASE_CONF, full_env.get("PYALLOC_CONF", "")) if c)
    if conf:
        full_env["PYALLOC_CONF"] = conf
    out = subprocess.run(args, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout)
    assert out.returncode == 0, (
        f"{' '.join(args)} exited with {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    )
    return out.stdout


def script(name: str, *args: str, **kwargs) -> str:
    # faulthandler: a check that crashes in native code still says where in Python.
    return run([sys.executable, "-X", "faulthandler", os.path.join(GPU_DIR, name), *args], **kwargs)


def test_training_matches_the_native_allocator_bitwise():
    native = json.loads(script("train.py", "--allocator", "native").splitlines()[-1])
    ours = json.loads(script("train.py", "--allocator", "pyalloc").splitlines()[-1])
    assert len(ours) == 8
    assert ours == native


def test_memory_allocated_is_the_live_tensors():
    assert "OK" in script("accounting.py")


def test_torch_empty_cache_lowers_reserved_memory():
    assert "OK" in script("empty_cache.py")


def test_record_stream_keeps_a_block_from_reuse():
    assert "OK" in script("record_stream.py")


def test_allocation_from_several_threads():
    assert "OK" in script("threads.py")


def test_oom_is_caught_and_recovered_from():
    assert "OK" in script("oom.py")


def test_cuda_graph_capture_and_replay():
    assert "OK" in script("cuda_graph.py")


def test_copies_between_devices():
    out = script("peer_copy.py")
    if "SKIP" in out:
        pytest.skip("needs two GPUs")
    assert "OK" in out


def test_doctor_says_ready():
    out = run([sys.executable, "-m", "pyalloc", "doctor"])  # exit status 0: ready
    lines = out.strip().splitlines()
    assert lines[-1] == "ready", out
    assert any(line.startswith("live:") and " ok " in line for line in lines), out


@pytest.mark.parametrize("strategy", ["vmm", "bestfit"])
def test_fixed_shape_training_calls_the_driver_never_once_warm(strategy):
    out = script("steady_state.py", env={"PYALLOC_CONF": f"strategy:{strategy}"})
    assert "OK" in out


def test_cuda_graph_pools_shared_and_released():
    assert "OK" in script("cuda_graph_pools.py")


def test_reserve_buffer():
    assert "OK" in script("buffers.py")


def test_snapshot_opens_in_torchs_memory_viz(tmp_path):
    assert "OK" in script("snapshot.py", str(tmp_path / "snap.pickle"))


@pytest.mark.parametrize("mode", ["after-cuda", "twice"])
def test_install_refusals(mode):
    assert "OK" in script("install_errors.py", mode)


def test_launcher_installs_before_the_script():
    out = run([sys.executable, "-m", "pyalloc", "run", "--conf", "pool_size:64MiB",
               os.path.join(GPU_DIR, "launched.py"), str(64 << 20), "a", "--b"])
    assert "ARGV ['a', '--b']" in out and "OK" in out


def test_launcher_takes_pyalloc_conf():
    out = run([sys.executable, "-m", "pyalloc", "run", os.path.join(GPU_DIR, "launched.py"),
               str(32 << 20)], env={"PYALLOC_CONF": "pool_size:32MiB"})
    assert "OK" in out


@pytest.mark.skipif(shutil.which("pyalloc") is None, reason="the pyalloc console script is not on PATH")
def test_console_script():
    out = run(["pyalloc", "run", os.path.join(GPU_DIR, "launched.py"), "0"])
    assert "OK" in out


def test_install_reads_pyalloc_conf():
    assert "OK" in script("env_install.py", env={"PYALLOC_CONF": "pool_size:48MiB,segment_size:4MiB"})


def torchrun(*args: str, env=None) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", *args], env=env, timeout=600)


def test_ddp_under_torchrun_with_the_launcher():
    out = torchrun("-m", "pyalloc", "run", os.path.join(GPU_DIR, "ddp.py"))
    assert "rank 0 OK" in out and "rank 1 OK" in out


def test_ddp_under_torchrun_with_pyalloc_conf():
    out = torchrun(os.path.join(GPU_DIR, "ddp.py"), "--install", env={"PYALLOC_CONF": "pool_size:32MiB"})
    assert "rank 0 OK" in out and "rank 1 OK" in out
