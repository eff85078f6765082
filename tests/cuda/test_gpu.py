"""pyalloc as PyTorch's CUDA allocator on a real GPU.

PyTorch's allocator can be swapped only once per process, so each check is a
script in tests/gpu/ run in a fresh process. All are marked ``gpu`` and skipped
(conftest.py) where torch sees no CUDA GPU.

Routes. Each script inherits this process's environment, so every check runs on
the route PYALLOC_BRIDGE selects: ``1`` the bridge (csrc/torch_bridge/, built
against the installed torch), ``0`` the C hooks of CUDAPluggableAllocator,
unset the bridge where it builds. The checks of what only the bridge gives
(cuDNN benchmark mode, torch.cuda.OutOfMemoryError and its observers, memory
history with Python frames, MemPool, torch.compile's CUDA-graph trees) skip
under PYALLOC_BRIDGE=0, saying so; every other check runs on both routes. A
GPU session builds the bridge once, then runs this file four times, both routes
under the default strategy and under bestfit (PYALLOC_CONF applies to every
check):

    python3 -m pyalloc bridge build
    PYALLOC_BRIDGE=1 python3 -m pytest tests/cuda/test_gpu.py
    PYALLOC_BRIDGE=0 python3 -m pytest tests/cuda/test_gpu.py
    PYALLOC_BRIDGE=1 PYALLOC_CONF=strategy:bestfit python3 -m pytest tests/cuda/test_gpu.py
    PYALLOC_BRIDGE=0 PYALLOC_CONF=strategy:bestfit python3 -m pytest tests/cuda/test_gpu.py

``python -m benchmarks.gpu.session`` runs these as stages of a GPU window, the
checks marked ``whole_device`` alone and the others side by side (pytest -n).
A check that dies by a signal runs once more under cuda-gdb (crash_rerun.py).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from crash_rerun import run_check

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(REPO, "tests", "gpu")


# PYALLOC_CONF in the environment of pytest (say strategy:bestfit) applies to every
# check; a check that sets its own adds its keys to it.
BASE_CONF = os.environ.get("PYALLOC_CONF", "")
# The route every check's install() takes (PYALLOC_BRIDGE passes through to them).
HOOKS_ROUTE = os.environ.get("PYALLOC_BRIDGE", "").strip() == "0"

# Checks that need the device to themselves: they run out of its memory on purpose, or
# read its free memory (torch.cuda.mem_get_info), which checks beside them would move.
# A GPU session runs them alone, the others side by side (benchmarks/gpu/session.py).
whole_device = pytest.mark.whole_device

bridge_only = pytest.mark.skipif(
    HOOKS_ROUTE, reason="needs the bridge: PYALLOC_BRIDGE=0 selects the C hooks route, where "
                        "PyTorch answers this with 'not supported'")


# Each check's own limit, well under the 360 s of the GPU session's tests stage
# (benchmarks/gpu/session.py), which stops every check with it: a check that hangs is
# killed with its children at its own limit (crash_rerun.run_check), and says so, while
# the stage goes on. A configuration's checks took about 2 minutes all together on an
# H200; torch.compile's and CUDA graph trees' checks compile first.
CHECK_TIMEOUT_S = 150
LONG_CHECK_TIMEOUT_S = 240


def run(args, env=None, timeout=CHECK_TIMEOUT_S) -> str:
    return run_process(args, env, timeout).stdout


def run_process(args, env=None, timeout=CHECK_TIMEOUT_S):
    """Runs a check (env added to this process's, PYALLOC_CONF to BASE_CONF), asserts it
    exited with 0 and returns its result: stdout and stderr."""
    full_env = dict(os.environ, PYTHONPATH=REPO, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    full_env.pop("PYALLOC_CONF", None)
    full_env.update(env or {})
    conf = ",".join(c for c in (BASE_CONF, full_env.get("PYALLOC_CONF", "")) if c)
    if conf:
        full_env["PYALLOC_CONF"] = conf
    # A check killed by a signal runs once more under cuda-gdb: its native backtrace
    # goes into the message (crash_rerun.py).
    out, native = run_check(args, full_env, REPO, timeout)
    ended = f"ran past its {timeout} s and was killed" if out.timed_out else f"exited with {out.returncode}"
    assert out.returncode == 0, (
        f"{' '.join(args)} {ended} (log: {out.log}.out/.err)\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
        + (f"\n--- {native}" if native else "")
    )
    return out


def script_process(name: str, *args: str, **kwargs):
    # faulthandler: a check that crashes in native code still says where in Python.
    return run_process([sys.executable, "-X", "faulthandler", os.path.join(GPU_DIR, name), *args], **kwargs)


def script(name: str, *args: str, **kwargs) -> str:
    return script_process(name, *args, **kwargs).stdout


def check(name: str, *args: str, **kwargs) -> str:
    """Runs a check script: skipped where it prints a SKIP line, else it must print OK."""
    return verdict(name, script(name, *args, **kwargs))


def verdict(name: str, out: str) -> str:
    """A check's stdout: the test skipped where it has a SKIP line, else it must have OK."""
    skipped = [line for line in out.splitlines() if line.startswith("SKIP")]
    if skipped:
        pytest.skip(f"{name}: {skipped[0]}")
    assert "OK" in out, out
    return out


# -- the bridge and the route ------------------------------------------------------------


@pytest.mark.skipif(HOOKS_ROUTE, reason="PYALLOC_BRIDGE=0: the bridge is not used")
def test_the_bridge_builds_against_the_installed_torch():
    out = run([sys.executable, "-m", "pyalloc", "bridge", "build"], timeout=LONG_CHECK_TIMEOUT_S)
    assert "the bridge is built for torch" in out, out
    status = run([sys.executable, "-m", "pyalloc", "bridge", "status"])
    assert "built: True" in status, status


def test_install_takes_the_route_pyalloc_bridge_selects():
    out = check("route.py")
    expected = "hooks" if HOOKS_ROUTE else "bridge"
    assert f"ROUTE {expected}" in out, out  # unset: the bridge, which builds on a GPU machine
    if expected == "bridge":
        assert "WARNING" not in out, out


def test_training_matches_the_native_allocator_bitwise():
    native = json.loads(script("train.py", "--allocator", "native").splitlines()[-1])
    ours = json.loads(script("train.py", "--allocator", "pyalloc").splitlines()[-1])
    assert len(ours) == 8
    assert ours == native


def test_memory_allocated_is_the_live_tensors():
    assert "OK" in script("accounting.py")


@whole_device
def test_torch_empty_cache_lowers_reserved_memory():
    assert "OK" in script("empty_cache.py")


def test_record_stream_keeps_a_block_from_reuse():
    assert "OK" in script("record_stream.py")


def test_allocation_from_several_threads():
    assert "OK" in script("threads.py")


@whole_device
def test_oom_is_caught_and_recovered_from():
    assert "OK" in script("oom.py")


def test_cuda_graph_capture_and_replay():
    assert "OK" in script("cuda_graph.py")


def test_copies_between_devices():
    check("peer_copy.py")  # skipped with one GPU


def test_doctor_says_ready_and_names_the_route():
    out = run([sys.executable, "-m", "pyalloc", "doctor"])  # exit status 0: ready
    lines = out.strip().splitlines()
    assert lines[-1] == "ready", out
    route = "the C hooks" if HOOKS_ROUTE else "the bridge"
    live = [line for line in lines if line.startswith("live:     cuda:")]
    assert live and all(" ok " in line and f"through {route}" in line for line in live), out
    assert any(line.startswith("exceptions:") and "reaches Python" in line for line in lines), out


@pytest.mark.parametrize("strategy", ["vmm", "bestfit"])
def test_fixed_shape_training_calls_the_driver_never_once_warm(strategy):
    out = script("steady_state.py", env={"PYALLOC_CONF": f"strategy:{strategy}"})
    assert "OK" in out


@whole_device
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


def test_launcher_reaches_spawn_and_forkserver_children():
    out = run([sys.executable, "-m", "pyalloc", "run", "--conf", "pool_size:48MiB",
               os.path.join(GPU_DIR, "spawned.py"), str(48 << 20)])
    assert "OK" in out, out  # a child without pyalloc fails its assert, and says why on stderr


@pytest.mark.skipif(shutil.which("pyalloc") is None, reason="the pyalloc console script is not on PATH")
def test_console_script():
    out = run(["pyalloc", "run", os.path.join(GPU_DIR, "launched.py"), "0"])
    assert "OK" in out


def test_install_reads_pyalloc_conf():
    assert "OK" in script("env_install.py", env={"PYALLOC_CONF": "pool_size:48MiB,segment_size:4MiB"})


def torchrun(*args: str, env=None) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", *args], env=env, timeout=LONG_CHECK_TIMEOUT_S)


def test_ddp_under_torchrun_with_the_launcher():
    out = torchrun("-m", "pyalloc", "run", os.path.join(GPU_DIR, "ddp.py"))
    assert "rank 0 OK" in out and "rank 1 OK" in out


def test_ddp_under_torchrun_with_pyalloc_conf():
    out = torchrun(os.path.join(GPU_DIR, "ddp.py"), "--install", env={"PYALLOC_CONF": "pool_size:32MiB"})
    assert "rank 0 OK" in out and "rank 1 OK" in out


# -- what the bridge gives (tests/gpu/gpu_common.py: bridge_only) ---------------------------


def test_torch_memory_stats_are_pyallocs_and_raw_allocations_work():
    check("torch_stats.py")  # both routes: torch's own functions through the bridge


@bridge_only
def test_cudnn_benchmark_mode_trains_a_convnet():
    check("cudnn_benchmark.py")


@bridge_only
@whole_device
def test_out_of_memory_is_torchs_error_with_observers_called_first():
    check("oom_observer.py")


@whole_device
@pytest.mark.parametrize("allocator", ["torch", "pyalloc"])
def test_pyalloc_oom_keeps_the_snapshot_and_verdict_of_a_caught_oom(tmp_path, allocator):
    check("oom_watch.py", allocator, str(tmp_path))


@bridge_only
def test_memory_history_names_python_frames_and_every_reader_takes_it(tmp_path):
    check("memory_history.py", str(tmp_path / "history.pickle"))


@bridge_only
@whole_device
def test_mempool_keeps_its_allocations_and_returns_its_memory():
    check("mempool.py")


@bridge_only
@whole_device
def test_mempool_no_split_and_use_on_oom():
    check("mempool_options.py")


@bridge_only
def test_torch_compile_reduce_overhead_matches_eager():
    check("compile_reduce_overhead.py", timeout=LONG_CHECK_TIMEOUT_S)


@bridge_only
def test_graph_trees_keep_outputs_across_restores_and_take_record_stream():
    check("graph_trees_restore.py", timeout=LONG_CHECK_TIMEOUT_S)


@bridge_only
def test_torch_accelerator_memory_functions_reach_pyalloc():
    check("accelerator.py")


@bridge_only
def test_requests_no_device_holds_and_oom_rejections_are_torchs_oom():
    check("oom_rejection.py", timeout=LONG_CHECK_TIMEOUT_S)


@bridge_only
def test_allocation_traceback_names_the_allocating_function():
    check("allocation_traceback.py")


@bridge_only
def test_the_profiler_sees_pyallocs_allocations_frees_and_ooms():
    check("profiler_memory.py")


# -- processes, NCCL and torch 2.14's figures (bridge only) ---------------------------------


@bridge_only
def test_cuda_tensors_cross_processes_and_stay_allocated_while_received():
    check("ipc.py")  # two processes on one GPU, under the session's strategy


@bridge_only
def test_nccl_registers_what_pyalloc_maps_and_a_mempool_over_ncclmemalloc_works():
    out = script_process("nccl_register.py", env={"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"})
    # A registration NCCL refused (a range registered twice, or deregistered
    # unregistered) is said by pyalloc on stderr: the tracker threw.
    assert "an allocator trace tracker failed" not in out.stderr, out.stderr
    verdict("nccl_register.py", out.stdout)


@bridge_only
def test_memory_reserved_counts_cuda_graph_pools():
    check("graph_reserved.py")
