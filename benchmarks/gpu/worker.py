"""One workload under one allocator, in a process of its own.

    python -m benchmarks.gpu.worker --workload NAME --allocator native|pyalloc|pyalloc_hooks|native_expandable|native_async
        --device cuda|cpu --result OUT.json [--size N] [--steps N] [--warmup N] [--seed N]
        [--budget BYTES] [--probe --probe-steps N] [--trace FILE] [--smoke] [--quick]
    python -m benchmarks.gpu.worker --info  --device cuda --result OUT.json
    python -m benchmarks.gpu.worker --check --allocator A --device cuda --result OUT.json

The allocator is chosen first, before anything touches the GPU, because torch
lets a process swap its CUDA allocator only before the first allocation:
``pyalloc`` via ``pyalloc.install()``, by its default route (the bridge where it
builds, else the C hooks), ``pyalloc_hooks`` via ``install(bridge=False)``
(CUDAPluggableAllocator's C hooks); the result records the route really used
(``pyalloc_route``). ``native_expandable`` is the native allocator with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` and ``native_async`` PyTorch's
``backend:cudaMallocAsync``, each set by the parent in this process's environment. A budget caps the native allocator with
``torch.cuda.set_per_process_memory_fraction(budget / total)`` and pyalloc with
``install(max_pool_size=budget)``.

The worker always writes OUT.json, with "status": "ok", "oom" (out of memory,
with the step it happened at), or "error" (with the traceback). It exits 0 for
ok and oom, 1 for error. Its progress goes to stdout.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import platform
import random
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy
import torch

from .._env import cpu_model

ALLOCATORS = ("native", "pyalloc", "pyalloc_hooks", "native_expandable", "native_async")
#: pyalloc by its default route, and pyalloc through the C hooks.
PYALLOC_ALLOCATORS = ("pyalloc", "pyalloc_hooks")
#: PyTorch's own allocator under another setting: the PYTORCH_CUDA_ALLOC_CONF each needs.
NATIVE_CONF = {"native_expandable": "expandable_segments:True", "native_async": "backend:cudaMallocAsync"}

# memory_stats() keys worth keeping beside the peaks (same keys under both allocators).
STAT_KEYS = (
    "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
    "segment.all.peak", "active_bytes.all.peak", "requested_bytes.all.peak",
    "inactive_split_bytes.all.peak", "allocation.all.allocated",
)

OOM_MARKERS = ("out of memory", "alloc_failed")


def is_oom(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and for errors that say memory ran out.

    pyalloc's out-of-memory error reaches Python through torch's pluggable
    allocator as a RuntimeError saying "CUDA out of memory."; cuBLAS and cuDNN
    say CUBLAS_STATUS_ALLOC_FAILED / CUDNN_STATUS_ALLOC_FAILED when their
    workspace cannot be had.
    """
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and any(m in text for m in OOM_MARKERS)


def pyalloc_route() -> Optional[str]:
    """How PyTorch reaches pyalloc in this process ("bridge" or "hooks"), None if it does not."""
    try:
        import pyalloc

        return pyalloc.is_installed()
    except Exception:  # noqa: BLE001 - a label must not fail the run
        return None


def pyalloc_settings() -> Optional[Dict[str, Any]]:
    """pyalloc's settings as its pools use them (strategy bestfit where vmm could not
    work), or None where it was not installed."""
    try:
        import pyalloc

        return dict(pyalloc._C.cuda_config()) if pyalloc.is_installed() else None
    except Exception:  # noqa: BLE001 - a label must not fail the run
        return None


def install_allocator(allocator: str, budget: int, conf: Dict[str, str]) -> None:
    """Makes `allocator` torch's CUDA allocator for this process; call before any CUDA work."""
    if allocator in PYALLOC_ALLOCATORS:
        import pyalloc

        if not hasattr(pyalloc, "install"):
            raise RuntimeError("this pyalloc build has no install(): the PyTorch integration is missing")
        config: Dict[str, Any] = dict(conf)
        if budget:
            config["max_pool_size"] = budget
        if allocator == "pyalloc_hooks":
            config["bridge"] = False
        pyalloc.install(**config)
    elif allocator in NATIVE_CONF:
        if NATIVE_CONF[allocator] not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError(f"{allocator} needs PYTORCH_CUDA_ALLOC_CONF={NATIVE_CONF[allocator]}")


class Memory:
    """The allocator's own figures: torch.cuda's for the native allocator, pyalloc's under pyalloc.

    Every figure is None on a CPU, where neither allocator is in play.
    """

    def __init__(self, allocator: str, device):
        if device.type != "cuda":
            self.api = None
        elif allocator in PYALLOC_ALLOCATORS:
            import pyalloc

            self.api = pyalloc
        else:
            self.api = torch.cuda

    def _call(self, name: str):
        return None if self.api is None else getattr(self.api, name)()

    def allocated(self) -> Optional[int]:
        return self._call("memory_allocated")

    def reserved(self) -> Optional[int]:
        return self._call("memory_reserved")

    def peaks(self) -> Dict[str, Any]:
        """Peak allocated and reserved, their ratio, and a few memory_stats() counters."""
        if self.api is None:
            return {"peak_allocated": None, "peak_reserved": None, "reserved_over_allocated": None, "stats": {}}
        peak_a, peak_r = self.api.max_memory_allocated(), self.api.max_memory_reserved()
        stats = self.api.memory_stats()
        out = {
            "peak_allocated": peak_a,
            "peak_reserved": peak_r,
            "reserved_over_allocated": peak_r / peak_a if peak_a else None,
            "stats": {k: stats[k] for k in STAT_KEYS if k in stats},
        }
        if self.api.__name__ == "pyalloc" and hasattr(self.api, "fragmentation"):
            out["fragmentation"] = self.api.fragmentation()
        return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well


def device_info(device) -> Dict[str, Any]:
    """What the results must say about the machine: device, torch, CUDA, libraries."""
    info: Dict[str, Any] = {
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
    }
    for module in ("transformers", "torchvision", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name, total_memory=props.total_memory, capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
            device_count=torch.cuda.device_count(),
        )
    else:
        info.update(name=cpu_model(), total_memory=None)
    return info




def check(allocator: str, device) -> Dict[str, Any]:
    """A quick look that the allocator is in place and its figures answer (--device-check)."""
    mem = Memory(allocator, device)
    x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    y = torch.randn(1024, 1024, device=device)
    (y @ y).sum().item()
    out: Dict[str, Any] = {"allocated_with_64MiB_live": mem.allocated(), "reserved": mem.reserved()}
    if device.type == "cuda":
        # Under pyalloc torch.cuda's functions answer from pyalloc (torch's own through the
        # bridge, pyalloc's in their place through the C hooks): they must agree.
        out["torch_cuda_memory_allocated"] = torch.cuda.memory_allocated(device)
        out["figures_agree"] = out["torch_cuda_memory_allocated"] == out["allocated_with_64MiB_live"]
        out["allocator_backend"] = torch.cuda.get_allocator_backend()
        if allocator in PYALLOC_ALLOCATORS:
            out["pyalloc_route"] = pyalloc_route()
        else:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=1000)
            torch.empty(1 << 20, device=device)  # one alloc and one free for the history
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            out["history_entries"] = sum(len(t) for t in snapshot["device_traces"])
    del x, y
    out.update(mem.peaks())
    return out


def run_steps(args, spec, device, result: Dict[str, Any]) -> None:
    """Builds the workload, warms up, then times each step; or runs a batch-search probe.

    Fills `result` as it goes, so a run that fails keeps the steps it made.
    """
    mem = Memory(args.allocator, device)
    result["size"] = args.size
    result["phase"] = "build"
    t0 = time.perf_counter()
    # Built on the device itself: GPT-2 medium's random initialisation took 15-19 s of a
    # 20 s run on the CPU (H200, 2026-11-28), and each batch-search probe pays it again.
    with device:
        runner = spec.build(device, args.size, args.smoke)
    _sync(device)
    result.update(build_s=time.perf_counter() - t0, params=runner.params, config=runner.config)
    rng = random.Random(f"{args.seed}:{spec.name}")
    if args.probe:
        # Fragment the cache with drawn shapes, then demand the largest shape twice.
        shapes = [runner.draw(rng) for _ in range(args.probe_steps)] + [runner.worst()] * 2
        warmup: List[Dict[str, int]] = []
    else:
        warmup = [runner.draw(rng) for _ in range(args.warmup)]
        shapes = [runner.draw(rng) for _ in range(args.steps)]
    result["shapes"] = shapes
    step_ms: List[float] = []
    allocated: List[Optional[int]] = []
    reserved: List[Optional[int]] = []
    result.update(step_ms=step_ms, allocated_after=allocated, reserved_after=reserved)
    result["phase"] = "warm-up"
    for shape in warmup:
        runner.step(shape)
    _sync(device)
    result["phase"] = "steps"
    report_every = max(1, len(shapes) // 5)
    for i, shape in enumerate(shapes):
        result["at_step"] = i
        _sync(device)
        start = time.perf_counter()
        runner.step(shape)
        _sync(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        allocated.append(mem.allocated())
        reserved.append(mem.reserved())
        if (i + 1) % report_every == 0 or i + 1 == len(shapes):
            print(f"    step {i + 1}/{len(shapes)} {shape}: {step_ms[-1]:.1f} ms", flush=True)
    del result["at_step"], result["phase"]
    result.update(
        median_ms=statistics.median(step_ms), mean_ms=statistics.fmean(step_ms), total_s=sum(step_ms) / 1e3,
    )


def cap_native(device: torch.device, budget: int) -> float:
    """Caps PyTorch's own allocator (native, expandable segments, cudaMallocAsync) at
    `budget` bytes of `device`; returns the fraction set. torch wants the device's index:
    a bare torch.device("cuda") is refused ("Expected a torch.device with a specified
    index"), which ended every native probe of the first batch search on an H200."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def run(args, result: Dict[str, Any]) -> None:
    """Everything after the allocator is in place; fills `result`."""
    from .workloads import SPECS, alloc_speed

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to torch")
    if args.info:
        result.update(device_info(device))
        return
    if device.type == "cuda" and args.budget and args.allocator not in PYALLOC_ALLOCATORS:
        cap_native(device, args.budget)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls, as most GPU training runs
    if device.type == "cpu" and args.smoke:
        torch.set_num_threads(1)  # tiny models gain nothing from threads and lose a lot on a busy machine
    seed_everything(args.seed)
    if args.check:
        result.update(check(args.allocator, device))
        return
    spec = SPECS[args.workload]
    if args.trace:
        if device.type != "cuda" or args.allocator in PYALLOC_ALLOCATORS:
            raise RuntimeError("memory history is recorded only on CUDA with a native allocator")
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=args.trace_max_entries)
    if spec.kind == "micro":
        # Under pyalloc, what the same pairs cost its core in C++, measured in this process.
        result["cases"] = alloc_speed(device, args.smoke, args.quick, args.seed,
                                      core=args.allocator in PYALLOC_ALLOCATORS)
    else:
        run_steps(args, spec, device, result)
    if args.trace:
        result["trace"] = dump_trace(args.trace)
    result.update(Memory(args.allocator, device).peaks())


def dump_trace(path: str) -> Dict[str, Any]:
    """Writes the recorded history as a memory snapshot and stops recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    return {
        "path": path, "bytes": os.path.getsize(path),
        "entries": sum(len(t) for t in snapshot.get("device_traces", [])),
        "segments_at_end": len(snapshot.get("segments", [])),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.worker", description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True, help="where to write the JSON result")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--allocator", default="native", choices=ALLOCATORS)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload")
    what.add_argument("--info", action="store_true", help="describe the device and libraries")
    what.add_argument("--check", action="store_true", help="check that the allocator is in place")
    p.add_argument("--size", type=int, default=0, help="the workload's size knob (batch)")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=0, help="memory cap in bytes (0: none)")
    p.add_argument("--pyalloc-conf", default="", help="extra pyalloc config, 'key:value,...'")
    p.add_argument("--probe", action="store_true", help="batch-search probe: drawn shapes, then the worst twice")
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--trace", default="", help="record the native memory history into this snapshot file")
    p.add_argument("--trace-max-entries", type=int, default=200_000)
    p.add_argument("--smoke", action="store_true", help="tiny models, for testing the harness")
    p.add_argument("--quick", action="store_true", help="fewer iterations (alloc_speed)")
    return p


def parse_conf(text: str) -> Dict[str, str]:
    """'key:value,key:value' -> {key: value}; sizes stay strings for pyalloc to parse."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition(":")
        if not sep or not key or not value:
            raise ValueError(f"bad pyalloc config item '{item}': expected key:value")
        conf[key.strip()] = value.strip()
    return conf


def die_with_parent() -> None:
    """Ends this process when the harness dies (killed at a time limit), instead of holding the GPU."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    die_with_parent()
    result: Dict[str, Any] = {
        "workload": args.workload, "allocator": args.allocator, "device": args.device, "seed": args.seed,
        "budget": args.budget or None, "probe": args.probe, "smoke": args.smoke, "quick": args.quick,
    }
    started = time.perf_counter()
    try:
        if args.device == "cuda":
            install_allocator(args.allocator, args.budget, parse_conf(args.pyalloc_conf))
        run(args, result)
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure must reach the parent as JSON
        result["status"] = "oom" if is_oom(exc) else "error"
        result["error"] = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc()[-4000:]
        result.update(_after_failure(args))
        print(f"    {result['status']}: {result['error']}", flush=True)
    if args.device == "cuda" and args.allocator in PYALLOC_ALLOCATORS:
        result["pyalloc_settings"] = pyalloc_settings()
        result["pyalloc_route"] = pyalloc_route()
    result["wall_s"] = time.perf_counter() - started
    _write_json(args.result, result)
    return 0 if result["status"] in ("ok", "oom") else 1


def _after_failure(args) -> Dict[str, Any]:
    """What memory looked like when the run failed: the peaks, if the allocator still answers."""
    if args.device != "cuda" or not torch.cuda.is_available():
        return {}
    try:
        return Memory(args.allocator, torch.device(args.device)).peaks()
    except Exception as exc:  # noqa: BLE001
        return {"peaks_error": str(exc)[:200]}


def _write_json(path: str, data: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
