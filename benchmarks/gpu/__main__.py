"""Benchmarks pyalloc against PyTorch's native CUDA allocator on a GPU.

    python -m benchmarks.gpu [--only NAME ...] [--quick] [--budget-search] [--traces] [--no-timing]
                             [--out-dir DIR] [--name STEM] [--extend FILE] [--fresh]
    python -m benchmarks.gpu --device-check
    python -m benchmarks.gpu --device cpu --smoke          # the whole pipeline, tiny models, no GPU
    python -m benchmarks.gpu --render FILE.json [--update-readme]
    python -m benchmarks.gpu --list

Every (workload, allocator) pair runs in a fresh process (benchmarks.gpu.worker):
torch can swap its CUDA allocator only before the first allocation, and a
fresh process gives both allocators the same start. The allocators of one
workload run back to back, with the same seeds.

Results accumulate in one file per GPU and date, <out-dir>/gpu-<date>-<gpu>.json,
which is rewritten, with its markdown and plots, after every run: a command
killed by a time limit keeps what it measured, and several commands (one per
group of workloads) fill one file.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from . import report
from .search import largest_passing
from .worker import ALLOCATORS, NATIVE_CONF, PYALLOC_ALLOCATORS
from .workloads import GROUPS, SPECS, SPEED_ROUNDS, Spec, select, speed_mode

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
TRACES_DIR = os.path.join(REPO, "benchmarks", "traces")
README = os.path.join(HERE, "README.md")
#: Every workload runs under these unless --allocators says otherwise; a workload may add
#: its own (alloc_speed adds pyalloc_hooks: pyalloc through the C hooks beside the bridge).
DEFAULT_ALLOCATORS = ("native", "pyalloc")
# Settings the harness owns: inherited values would change what "native" means, or which
# route "pyalloc" takes (its default one; "pyalloc_hooks" asks for the C hooks itself).
#: --trace-allocators: the native allocator records a memory history under these settings
#: (cudaMallocAsync keeps none); under pyalloc the same run is made live only.
TRACE_ALLOCATORS = ("native", "native_expandable") + PYALLOC_ALLOCATORS
#: What a process holds on the device beside what its allocator counts (the CUDA context,
#: the libraries' handles): a few hundred MiB; a GiB is kept for each.
CONTEXT_BYTES = 1 << 30
#: --parallel auto fills this share of the device with budgets, the rest left to the driver.
AUTO_SHARE = 0.95
OWNED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYALLOC_CONF", "PYALLOC_BRIDGE")

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_budget(text: str, total: Optional[int]) -> Optional[int]:
    """'0.5' (a fraction of the device's memory) or '40GiB' (bytes) -> bytes; None without a total."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"bad budget '{text}': give a fraction of the GPU's memory (0.5) or a size (40GiB)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and number <= 1.0:
        if number <= 0:
            raise ValueError("the budget must be positive")
        return int(number * total) if total else None
    return int(number * UNITS[unit])


# ---------------------------------------------------------------------------
# Running workers
# ---------------------------------------------------------------------------


def child_env(allocator: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OWNED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    if allocator in NATIVE_CONF:
        env["PYTORCH_CUDA_ALLOC_CONF"] = NATIVE_CONF[allocator]
    return env


def spawn(worker_args: List[str], allocator: str, timeout: float, tag: str = "") -> Dict[str, Any]:
    """Runs one worker and returns its JSON result (or what went wrong). With ``tag``
    (workers running side by side) each line the worker prints comes after ``[tag] ``."""
    with tempfile.TemporaryDirectory(prefix="pyalloc-gpu-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu.worker", "--allocator", allocator, *worker_args,
               "--result", out]
        start = time.perf_counter()
        pipe = subprocess.PIPE if tag else None
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(allocator), stdout=pipe,
                                stderr=subprocess.STDOUT if tag else None, text=True, errors="replace")
        reader = None
        if tag:
            def pump() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:  # one write a line: the lanes' lines never mix
                    sys.stdout.write(f"[{tag}] {line}" if line.endswith("\n") else f"[{tag}] {line}\n")
                    sys.stdout.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"status": "timeout", "error": f"no result within {timeout:.0f} s", "wall_s": timeout}
        except BaseException:  # interrupted: the worker must not live on, holding the device
            proc.kill()
            proc.wait()
            raise
        finally:
            if reader is not None:
                reader.join(timeout=5)
            if proc.stdout is not None and (reader is None or not reader.is_alive()):
                proc.stdout.close()
        if not os.path.exists(out):
            return {"status": "crashed", "error": f"worker exited with {proc.returncode} and no result",
                    "wall_s": time.perf_counter() - start}
        with open(out) as f:
            return json.load(f)


def search_order(specs: List[Spec], only: Optional[List[str]]) -> List[Spec]:
    """The workloads whose searches run, in the order --only names them (a group's in
    the registry's order, after those named): the first start first."""
    words = [w for word in only or [] for w in word.split(",") if w]
    rank = {name: i for i, name in reversed(list(enumerate(words)))}
    return sorted(specs, key=lambda spec: rank.get(spec.name, len(words)))


def crowded(r: Dict[str, Any]) -> str:
    """Why a run made beside others may not be the run it makes alone ("" when it is):
    it ran out of memory, failed for want of it (a CUDA context, a library's workspace)
    or without a result, or its allocator had to free its cache and retry. Another error
    would come again alone."""
    status, error = r.get("status"), str(r.get("error") or "")
    if status in ("oom", "crashed") or (status != "ok" and "memory" in error.lower()):
        return f"ended {status} ({error[:120]})"
    retries = (r.get("stats") or {}).get("num_alloc_retries")
    return f"freed its cache and retried {retries} times" if retries else ""


def lanes_for(parallel: str, budget: Optional[int], total: Optional[int]) -> int:
    """How many workers may run side by side: --parallel N, or with "auto" as many as
    the device holds at the budget each (and a CUDA context beside each, which no cap
    counts), from 95% of its memory; one without a budget or a device size."""
    if parallel != "auto":
        return max(1, int(parallel))
    if not budget or not total:
        return 1
    return max(1, int(total * AUTO_SHARE) // (budget + CONTEXT_BYTES))


def round_order(allocators: List[str], r: int) -> List[str]:
    """The allocators in round r: moved on by a step coprime with their number, so that
    each takes another place in each round (five allocators: step 2; three, or more,
    rounds put none in the same place twice)."""
    n = len(allocators)
    step = 2 if n % 2 and n > 2 else 1
    return [allocators[(i + step * r) % n] for i in range(n)] if n else []


def _show(path: str, start: str = REPO) -> str:
    """A path relative to the repository when it lies inside it."""
    rel = os.path.relpath(os.path.abspath(path), start)
    return path if rel.startswith("..") else rel


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment() -> Dict[str, Any]:
    """Where the harness ran; pyalloc's version and the commit when they can be had."""
    from benchmarks._env import environment as env

    try:
        return env()
    except ImportError as exc:  # pyalloc not built: native runs still work
        return {"pyalloc": f"not importable ({exc})"}


class Harness:
    """One invocation: which workloads, which allocators, where the results go."""

    def __init__(self, args: argparse.Namespace, device: Dict[str, Any]):
        self.args = args
        self.device = device
        self.failures = 0
        self.allocators = self._allocators(args.allocators or ",".join(DEFAULT_ALLOCATORS))
        self.budget = parse_budget(args.budget, device.get("total_memory"))
        date = args.date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        stem = args.name or report.results_stem(device, date)
        self.json_path = os.path.join(args.out_dir, stem + ".json")
        env = environment()
        self.results = self._start_results(env)
        self.command = "python -m benchmarks.gpu " + shlex.join(args.argv)
        # Commands of one results file may run from different commits: each says its own.
        self.invocation = {"command": self.command, "started": _utc_now(), "finished": None,
                           "workloads": [], "allocators": self.allocators, "quick": args.quick,
                           "smoke": args.smoke, "seed": args.seed, "git_commit": env.get("git_commit"),
                           "pyalloc": env.get("pyalloc")}
        self.results["invocations"].append(self.invocation)
        self.trace_dir = args.trace_dir

    def _allocators(self, text: str) -> List[str]:
        allocators = [a.strip() for a in text.split(",") if a.strip()]
        if self.args.device == "cpu":
            dropped = [a for a in allocators if a != "native"]
            if dropped:
                print(f"on a CPU only the native allocator runs; not running {', '.join(dropped)}")
            allocators = ["native"]
        return allocators

    def allocators_for(self, spec: Spec) -> List[str]:
        """The allocators a workload runs under: --allocators, else the defaults and the
        workload's own additions."""
        if self.args.allocators or self.args.device == "cpu":
            return self.allocators
        return self.allocators + [a for a in spec.extra_allocators if a not in self.allocators]

    def _start_results(self, env: Dict[str, Any]) -> Dict[str, Any]:
        base = self.args.extend or self.json_path
        if os.path.exists(base) and not self.args.fresh:
            results = report.load(base)
            print(f"extending {_show(base)}")
        else:
            results = report.new_results(self.device, env)
        results["device"] = self.device
        return results

    def save(self) -> None:
        report.save(self.results, self.json_path)
        report.render(self.results, self.json_path)

    # -- the three kinds of run ------------------------------------------------

    def _common(self, spec: Spec) -> List[str]:
        a = self.args
        out = ["--workload", spec.name, "--device", a.device, "--seed", str(a.seed)]
        if a.smoke:
            out.append("--smoke")
        if a.quick:
            out.append("--quick")
        if a.pyalloc_conf:
            out += ["--pyalloc-conf", a.pyalloc_conf]
        return out

    def size(self, spec: Spec) -> int:
        return spec.smoke_size if self.args.smoke else spec.size

    def timing(self, spec: Spec) -> None:
        a = self.args
        if spec.kind == "micro":
            self.speed_rounds(spec)
            return
        if spec.kind == "steps":
            steps = a.steps or (2 if a.smoke else spec.quick_steps if a.quick else spec.steps)
            warmup = 1 if a.smoke else spec.warmup
            extra = ["--size", str(self.size(spec)), "--steps", str(steps), "--warmup", str(warmup)]
        else:
            extra = []
        entry = report.workload_entry(self.results, spec.name, spec.title, spec.kind, spec.size_name)
        for allocator in self.allocators_for(spec):
            print(f"== {spec.name} / {allocator}", flush=True)
            result = spawn(self._common(spec) + extra, allocator, a.worker_timeout)
            result["invocation"] = self.command
            entry["runs"][allocator] = result
            self._report(spec, allocator, result)
            self.save()

    def speed_rounds(self, spec: Spec) -> None:
        """alloc_speed: one process per allocator in each round, the rounds in different
        orders (round_order), so that what drifts over a minute (clocks, other tenants,
        where a process lands) touches every allocator alike. With --rounds-within S no
        round starts that the longest one so far says would end past S seconds."""
        a = self.args
        allocators = self.allocators_for(spec)
        planned = a.rounds or SPEED_ROUNDS[speed_mode(a.smoke, a.quick)]
        entry = report.workload_entry(self.results, spec.name, spec.title, spec.kind, spec.size_name)
        entry["runs"] = {}
        rounds = entry["rounds"] = {"planned": planned, "done": 0, "orders": [], "within_s": a.rounds_within or None}
        processes: Dict[str, List[Dict[str, Any]]] = {alloc: [] for alloc in allocators}
        started, longest = time.perf_counter(), 0.0
        for r in range(planned):
            elapsed = time.perf_counter() - started
            if r and a.rounds_within and elapsed + longest > a.rounds_within:
                print(f"   {r} of {planned} rounds: another would end past {a.rounds_within:.0f} s "
                      f"(--rounds-within; {elapsed:.0f} s so far, the longest round {longest:.0f} s)", flush=True)
                break
            order = round_order(allocators, r)
            rounds["orders"].append(order)
            for allocator in order:
                print(f"== {spec.name} / {allocator} (round {r + 1} of {planned})", flush=True)
                result = spawn(self._common(spec), allocator, a.worker_timeout)
                result["invocation"] = self.command
                processes[allocator].append(result)
                entry["runs"][allocator] = report.combine_speed(processes[allocator])
                self._report(spec, allocator, result)
                report.save(self.results, self.json_path)  # the figures; the tables and plots at the end
            rounds["done"] = r + 1
            longest = max(longest, time.perf_counter() - started - elapsed)
        self.save()

    def search_all(self, specs: List[Spec]) -> None:
        """The largest size of each workload that runs under the budget, for each allocator.

        Each (workload, allocator) search is a run of probes, each probe a process of its
        own capped at the budget. --parallel N (or auto: as many as the device holds at
        the budget each, lanes_for) runs N searches at the same time, the workloads'
        in order, a lane taking the next search as soon as its own ends: on a device
        with room for N budgets (and N CUDA contexts) the answers are those of searches
        one after the other; only the probes' wall time grows. The results are saved as
        each search ends."""
        a = self.args
        lanes = lanes_for(a.parallel, self.budget, self.device.get("total_memory"))
        cap = f"a {self.budget / 2**30:.1f} GiB budget" if self.budget else "no memory cap"
        jobs = [(spec, allocator) for spec in specs for allocator in self.allocators_for(spec)]
        if lanes > 1:
            print(f"searching {len(jobs)} (workload, allocator) pairs, {lanes} at a time under {cap}", flush=True)
        lock = threading.Lock()

        def one(job) -> None:
            spec, allocator = job
            found = self._search_one(spec, allocator, cap, tag=f"{spec.name} {allocator}" if lanes > 1 else "")
            with lock:
                entry = report.workload_entry(self.results, spec.name, spec.title, spec.kind, spec.size_name)
                searches = entry.setdefault("search", {})
                searches["budget"] = self.budget
                searches[allocator] = found
                if found["stopped"] == "error":
                    self.failures += 1
                self.save()  # a command that ends first keeps every search done

        with ThreadPoolExecutor(max_workers=lanes) as pool:
            list(pool.map(one, jobs))

    def _search_one(self, spec: Spec, allocator: str, cap: str, tag: str = "") -> Dict[str, Any]:
        a = self.args
        hi = min(spec.search_hi, 4) if a.smoke else spec.search_hi
        max_probes = 3 if a.smoke else a.max_probes
        probe_steps = 1 if a.smoke else a.probe_steps or spec.probe_steps
        print(f"== {spec.name} / {allocator}: searching the {spec.size_name} under {cap}", flush=True)

        def probe(size: int):
            worker_args = self._common(spec) + ["--probe", "--size", str(size), "--probe-steps",
                                                str(probe_steps), "--budget", str(self.budget or 0)]
            r = spawn(worker_args, allocator, a.worker_timeout, tag=tag)
            print(f"   {spec.name} / {allocator}: probe {size}: {r['status']} in {r.get('wall_s', 0):.0f} s"
                  + (f" (peak reserved {r['peak_reserved'] / 2**30:.2f} GiB)" if r.get("peak_reserved") else ""),
                  flush=True)
            keep = {k: r.get(k) for k in ("peak_allocated", "peak_reserved", "error", "wall_s", "at_step")
                    if r.get(k) is not None}
            return r["status"], keep

        start = spec.smoke_size if a.smoke else spec.search_start
        found = largest_passing(probe, start=start, hi=hi, max_probes=max_probes, rel_tol=a.search_tolerance)
        found.update(budget=self.budget, probe_steps=probe_steps, invocation=self.command)
        print(f"   {spec.name} / {allocator}: largest that runs: {found['largest']} ({found['stopped']})", flush=True)
        return found

    def trace(self, spec: Spec) -> None:
        """The workload's memory history under each native trace allocator, and pyalloc's
        live run of the same steps. With --parallel (auto: all of them) the runs go side
        by side, each a process of its own: none measures time, and each allocator sees
        the device only through its own process. A run that ran out of memory, had to
        free its cache and retry, or failed beside the others is made again alone: its
        history would not be the one it makes alone."""
        a = self.args
        if a.device != "cuda":
            print(f"== {spec.name}: memory history needs CUDA; no trace on a CPU")
            return
        allocators = [x.strip() for x in a.trace_allocators.split(",") if x.strip()]
        lanes = len(allocators) if a.parallel == "auto" else min(int(a.parallel), len(allocators))
        if lanes <= 1:
            for allocator in allocators:
                self._record_trace(spec, allocator, self._trace_run(spec, allocator), beside=False)
            return
        with ThreadPoolExecutor(max_workers=lanes) as pool:
            runs = list(pool.map(lambda x: self._trace_run(spec, x, tag=f"{spec.name} {x}"), allocators))
        again = []
        for allocator, r in zip(allocators, runs):
            why = crowded(r)
            if why:
                again.append((allocator, why))
            else:
                self._record_trace(spec, allocator, r, beside=True)
        for allocator, why in again:
            print(f"== {spec.name} / {allocator}: beside the others it {why}; again, alone", flush=True)
            if allocator not in PYALLOC_ALLOCATORS and os.path.exists(self._trace_path(spec, allocator)):
                os.remove(self._trace_path(spec, allocator))  # a crowded history must not be replayed
            r = dict(self._trace_run(spec, allocator), made_alone_after=why)
            self._record_trace(spec, allocator, r, beside=False)

    def _trace_path(self, spec: Spec, allocator: str) -> str:
        # The native allocator's traces keep their names; another's names it.
        tag = "" if allocator == "native" else f"-{allocator}"
        return os.path.join(self.trace_dir, f"{spec.name}{tag}-{report.slug(self.device.get('name', 'gpu'))}.pickle")

    def _trace_run(self, spec: Spec, allocator: str, tag: str = "") -> Dict[str, Any]:
        a = self.args
        os.makedirs(self.trace_dir, exist_ok=True)
        worker_args = self._common(spec) + ["--size", str(self.size(spec)), "--steps", str(self._trace_steps(spec)),
                                            "--warmup", "0"]
        if allocator in PYALLOC_ALLOCATORS:
            # pyalloc records no history of its own here: the same run (steps, seed, size),
            # live only, is what the replay's prediction for pyalloc is judged against.
            print(f"== {spec.name} / {allocator}: the traced run, live, for the replay's prediction", flush=True)
        else:
            path = self._trace_path(spec, allocator)
            print(f"== {spec.name} / {allocator}: recording the memory history into {_show(path)}", flush=True)
            worker_args += ["--trace", path, "--trace-max-entries", str(a.trace_max_entries)]
        return spawn(worker_args, allocator, a.worker_timeout, tag=tag)

    def _trace_steps(self, spec: Spec) -> int:
        return 2 if self.args.smoke else self.args.trace_steps or spec.trace_steps

    def _record_trace(self, spec: Spec, allocator: str, r: Dict[str, Any], beside: bool) -> None:
        a = self.args
        entry = report.workload_entry(self.results, spec.name, spec.title, spec.kind, spec.size_name)
        steps = self._trace_steps(spec)
        info = dict(r.get("trace") or {}, status=r["status"], steps=steps, seed=a.seed, size=self.size(spec),
                    max_entries=a.trace_max_entries, device=self.device.get("name"),
                    torch=self.device.get("torch"), invocation=self.command, allocator=allocator,
                    side_by_side=beside)
        if r.get("made_alone_after"):
            info["made_alone_after"] = r["made_alone_after"]
        # What the live run measured, beside which a replay of its trace is judged.
        stats = r.get("stats") or {}
        info["live"] = {"peak_allocated": r.get("peak_allocated"), "peak_reserved": r.get("peak_reserved"),
                        "num_device_alloc": stats.get("num_device_alloc"),
                        "num_device_free": stats.get("num_device_free"),
                        "num_alloc_retries": stats.get("num_alloc_retries")}
        # A full ring buffer has dropped its oldest events: a replay must start from the blocks then live.
        info["wrapped"] = info.get("entries", 0) >= a.trace_max_entries
        if "path" in info:
            info["path"] = _show(info["path"])
        if r["status"] != "ok":
            info["error"] = r.get("error")
            self.failures += 1
        if allocator == "native":
            entry["trace"] = info
        entry.setdefault("traces", {})[allocator] = info
        if allocator not in PYALLOC_ALLOCATORS:
            self._write_trace_index(spec.name, info)
        print(f"   {spec.name} / {allocator}: {info['status']}: {info.get('entries', '?')} entries, "
              f"{(info.get('bytes') or 0) / 2**20:.1f} MiB", flush=True)
        self.save()

    def _write_trace_index(self, name: str, info: Dict[str, Any]) -> None:
        path = os.path.join(self.trace_dir, "index.json")
        index = {}
        if os.path.exists(path):
            with open(path) as f:
                index = json.load(f)
        index[os.path.basename(info.get("path") or f"{name}.pickle")] = dict(info, workload=name)
        with open(path, "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
            f.write("\n")

    def _report(self, spec: Spec, allocator: str, r: Dict[str, Any]) -> None:
        status = r.get("status")
        if status not in ("ok", "oom"):
            self.failures += 1
        text = f"   {status} in {r.get('wall_s', 0):.0f} s"
        if status == "ok" and spec.kind == "steps":
            text += f": median {r['median_ms']:.1f} ms"
        if r.get("peak_reserved") is not None:
            text += (f", peak allocated {r['peak_allocated'] / 2**30:.2f} GiB,"
                     f" reserved {r['peak_reserved'] / 2**30:.2f} GiB")
        if r.get("error"):
            text += f": {r['error']}"
        print(text, flush=True)


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"workloads: {', '.join(SPECS)}\ngroups: {', '.join(GROUPS)}")
    p.add_argument("--only", nargs="+", metavar="NAME", help="workloads or groups to run (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer steps, to fit a 10-minute command")
    p.add_argument("--steps", type=int, default=0, help="timed steps per run (default: the workload's)")
    p.add_argument("--rounds", type=int, default=0,
                   help="alloc_speed: processes per allocator, one per round, the allocators in another order "
                        "each round (default: %s)" % ", ".join(f"{n} {m}" for m, n in SPEED_ROUNDS.items()))
    p.add_argument("--rounds-within", type=float, default=0, metavar="S",
                   help="alloc_speed: start no round that the longest so far says would end past S seconds "
                        "(0: every round runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allocators", default=None,
                   help="comma-separated: native, pyalloc (its default route: the bridge where it builds), "
                        "pyalloc_hooks (through the C hooks), native_expandable, native_async "
                        "(backend:cudaMallocAsync) (default: native,pyalloc, "
                        "and pyalloc_hooks too for alloc_speed)")
    p.add_argument("--pyalloc-conf", default="", help="extra pyalloc.install() config, 'key:value,...'")
    p.add_argument("--no-timing", action="store_true", help="skip the timed runs (with --budget-search/--traces)")
    p.add_argument("--budget-search", action="store_true", help="find the largest batch under --budget")
    p.add_argument("--budget", default="0.5", help="fraction of GPU memory (0.5) or a size (40GiB)")
    p.add_argument("--max-probes", type=int, default=8, help="probes per allocator in the batch search")
    p.add_argument("--search-tolerance", type=float, default=0.03,
                   help="stop the search when the answer is known to this fraction (default 0.03)")
    p.add_argument("--parallel", type=_lanes, default="1", metavar="N|auto",
                   help="runs made side by side where no time is measured: (workload, allocator) searches "
                        "of --budget-search, in the order --only names the workloads (each probe still a "
                        "process of its own, capped at the budget; the device needs room for this many "
                        "budgets; auto: as many as it has) and the "
                        "runs of one workload under --trace-allocators (auto: all of them)")
    p.add_argument("--probe-steps", type=int, default=0,
                   help="drawn steps before the worst shape in a probe (default: the workload's)")
    p.add_argument("--traces", action="store_true", help="record native memory histories (workloads 2-5)")
    p.add_argument("--trace-dir", default=TRACES_DIR)
    p.add_argument("--trace-allocators", default="native",
                   help="comma-separated allocators to record under (default native; "
                        "native_expandable: with expandable_segments:True; pyalloc, pyalloc_hooks: "
                        "the same run without a history, its live figures only)")
    p.add_argument("--trace-steps", type=int, default=0, help="steps per trace (default: the workload's)")
    p.add_argument("--trace-max-entries", type=int, default=200_000,
                   help="events kept per trace; past this the oldest are dropped (about 50 bytes each)")
    p.add_argument("--out-dir", default=None, help=f"default {_show(RESULTS_DIR)} "
                   "(a temporary directory with --smoke)")
    p.add_argument("--name", default=None, help="results file stem (default gpu-<date>-<gpu>)")
    p.add_argument("--date", default=None, help=argparse.SUPPRESS)
    p.add_argument("--extend", default=None, metavar="FILE",
                   help="start from this results JSON (default: the same-named file in --out-dir)")
    p.add_argument("--fresh", action="store_true", help="do not extend an existing results file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true", help="tiny models and 2 steps: tests the harness")
    p.add_argument("--device-check", action="store_true", help="check the GPU and each allocator, then stop")
    p.add_argument("--worker-timeout", type=float, default=540, help="seconds before a worker is killed")
    p.add_argument("--render", metavar="FILE", help="only rebuild the markdown and plots of a results JSON")
    p.add_argument("--update-readme", action="store_true",
                   help="put the results into benchmarks/gpu/README.md's results section")
    p.add_argument("--list", action="store_true", help="list the workloads and groups")
    return p


def _lanes(text: str) -> str:
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"'{text}': give a number of at least 1, or auto")


def _list() -> int:
    for spec in SPECS.values():
        needs = f" (needs {', '.join(spec.requires)})" if spec.requires else ""
        print(f"{spec.name:<22} {spec.title}{needs}")
    print()
    for group, names in GROUPS.items():
        print(f"{group:<22} {' '.join(names)}")
    return 0


def _render(args) -> int:
    results = report.load(args.render)
    for path in report.render(results, args.render):
        print(f"wrote {_show(path)}")
    if args.update_readme:
        report.update_readme(README, results, args.render)
        print(f"updated {_show(README)}")
    return 0


def _device_check(args, device: Dict[str, Any], allocators: List[str]) -> int:
    print(json.dumps(device, indent=1))
    bad = 0
    for allocator in allocators:
        r = spawn(["--check", "--device", args.device], allocator, args.worker_timeout)
        print(f"== {allocator}: {r.get('status')}")
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}, indent=1, default=str))
        if r.get("traceback"):
            print(r["traceback"])
        bad += r.get("status") != "ok" or r.get("figures_agree") is False
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.list:
        return _list()
    if args.render:
        return _render(args)
    try:
        names = select([w for word in args.only or [] for w in word.split(",") if w])
        parse_budget(args.budget, 1)
        unknown = [a for a in (args.allocators or "").split(",") if a.strip() and a.strip() not in ALLOCATORS]
        if unknown:
            raise ValueError(f"unknown allocator '{unknown[0]}'; allocators: {', '.join(ALLOCATORS)}")
        bad = [a for a in args.trace_allocators.split(",") if a.strip() not in TRACE_ALLOCATORS]
        if bad:
            raise ValueError(f"--trace-allocators: '{bad[0]}' records no memory history; give "
                             f"{', '.join(TRACE_ALLOCATORS)} (pyalloc's: the same run, live only)")
        if args.rounds < 0 or args.rounds_within < 0:
            raise ValueError("--rounds and --rounds-within take a number of at least 0")
        if args.no_timing and not (args.budget_search or args.traces):
            raise ValueError("--no-timing leaves nothing to run: add --budget-search or --traces")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    info = spawn(["--info", "--device", args.device], "native", args.worker_timeout)
    if info.get("status") != "ok":
        print(f"error: cannot use device '{args.device}': {info.get('error')}", file=sys.stderr)
        if args.device == "cuda":
            print("(to test the harness without a GPU: --device cpu --smoke)", file=sys.stderr)
        return 2
    device = {k: v for k, v in info.items() if k not in ("status", "wall_s", "workload", "allocator", "seed",
                                                        "budget", "probe", "smoke", "quick", "device")}
    if args.device_check:
        harness_allocators = ["native"] if args.device == "cpu" else \
            (args.allocators or ",".join(DEFAULT_ALLOCATORS + ("pyalloc_hooks",))).split(",")
        return _device_check(args, device, harness_allocators)
    if args.out_dir is None:
        args.out_dir = tempfile.mkdtemp(prefix="pyalloc-gpu-smoke-") if args.smoke else RESULTS_DIR
    harness = Harness(args, device)
    print(f"device: {device.get('name')}; torch {device.get('torch')}, CUDA {device.get('cuda')}; "
          f"allocators: {', '.join(harness.allocators)}; results: {_show(harness.json_path)}", flush=True)
    started = time.perf_counter()
    searched: List[Spec] = []
    for i, name in enumerate(names, 1):
        spec = SPECS[name]
        missing = [m for m in spec.requires if importlib.util.find_spec(m) is None]
        if missing:
            print(f"[{i}/{len(names)}] {name}: skipped, needs {', '.join(missing)}", flush=True)
            continue
        print(f"[{i}/{len(names)}] {name}: {spec.title} ({time.perf_counter() - started:.0f} s so far)", flush=True)
        harness.invocation["workloads"].append(name)
        if not args.no_timing:
            harness.timing(spec)
        if args.budget_search and spec.kind == "steps":
            searched.append(spec)
        if args.traces and spec.trace:
            harness.trace(spec)
    if searched:  # after the timed runs, which need the device alone; the searches may share it
        harness.search_all(search_order(searched, args.only))
    harness.invocation["finished"] = _utc_now()
    harness.save()
    if args.update_readme:
        report.update_readme(README, harness.results, harness.json_path)
    print()
    print(report.markdown(harness.results))
    print(f"results: {_show(harness.json_path)} (+ .md, plots) after {time.perf_counter() - started:.0f} s")
    return 1 if harness.failures else 0


if __name__ == "__main__":
    sys.exit(main())
