"""A GPU window in one command per stage: everything a GPU session runs, in order.

    python -m benchmarks.gpu.session --plan                 # the stages: name, limit (s), what
    python -m benchmarks.gpu.session --stage NAME --out DIR # one stage
    python -m benchmarks.gpu.session --all --out DIR        # every stage, in order

A GPU is lent for about 30 minutes, one command of at most 10 minutes at a time,
and the machine starts bare for every command. So each stage builds what it
needs first (pyalloc._C with all cores, then the bridge where it is used), fits
its own limit (at most 9 minutes, build included; all stages together 25), and
leaves in DIR one log, ``<stage>.log``, and at most a few result files named by
the stage. The log begins with the device, driver, torch, date, commit and
command, takes every output of every step as it comes (a stage stopped at its
limit still leaves it), and ends with what passed, what failed and what did not
run. The runner enforces each stage's limit itself: a step still running at the
limit is killed, and the summary says so.

GPU checks run side by side (pytest-xdist) where they do not need the whole
device, and alone where they do (out-of-memory, budgets, device-wide free
memory: the ``whole_device`` mark in tests/test_gpu.py).

On a machine without the repository's .git, PYALLOC_GIT_COMMIT names the commit.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable

#: One command on the GPU machine runs at most 600 s; a stage keeps a minute in hand.
STAGE_LIMIT_S = 540
#: The whole window: about 30 minutes of device time, less the machine's starts.
TOTAL_LIMIT_S = 1500
#: pytest-xdist workers for the checks that share the device.
SIDE_BY_SIDE = 8
#: Every allocator the benchmarks compare.
ALLOCATORS = "native,pyalloc,pyalloc_hooks,native_expandable"


@dataclass
class Step:
    """One command of a stage. pytest steps have their summary read; a step marked
    ``needed`` stops the stage when it fails (the build)."""

    label: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    pytest: bool = False
    needed: bool = False


@dataclass
class Stage:
    name: str
    limit_s: int
    what: str
    steps: Callable[[str], List[Step]]  # the stage's steps, given its output folder


# -- the stages -------------------------------------------------------------------------


def build_steps(bridge: bool = True) -> List[Step]:
    """pyalloc._C with every core (setup.py compiles in parallel), then the bridge."""
    steps = [Step("build pyalloc._C", [PY, "setup.py", "build_ext", "--inplace"],
                  env={"NPY_NUM_BUILD_JOBS": str(os.cpu_count() or 1)}, needed=True)]
    if bridge:
        steps.append(Step("build the bridge", [PY, "-m", "pyalloc", "bridge", "build"]))
    return steps


def xdist_available() -> bool:
    return importlib.util.find_spec("xdist") is not None


def gpu_test_steps(route: str, conf: str = "") -> List[Step]:
    """tests/test_gpu.py on one route: the checks that share the device side by side
    (one at a time where pytest-xdist is missing), then those that need it whole,
    one at a time."""
    env = {"PYALLOC_BRIDGE": "1" if route == "bridge" else "0"}
    if conf:
        env["PYALLOC_CONF"] = conf
    tag = f"{route}{', ' + conf if conf else ''}"
    common = [PY, "-m", "pytest", "tests/test_gpu.py", "-v", "-rA", "-p", "no:cacheprovider"]
    if xdist_available():
        side = Step(f"GPU tests side by side ({tag})", common + ["-n", str(SIDE_BY_SIDE)], env, pytest=True)
    else:
        side = Step(f"GPU tests that share the device, one at a time: no pytest-xdist ({tag})", common, env,
                    pytest=True)
    side.argv += ["-m", "gpu and not whole_device"]
    return [side, Step(f"GPU tests alone ({tag})", common + ["-m", "gpu and whole_device"], env, pytest=True)]


def _doctor(out: str) -> List[Step]:
    return build_steps() + [
        Step("pyalloc doctor", [PY, "-m", "pyalloc", "doctor"]),
        Step("crash diagnosis", ["bash", "tests/gpu/diagnose_exceptions.sh"], env={"STEP_LIMIT": "60"}),
    ]


def _tests_bridge(out: str) -> List[Step]:
    return build_steps() + gpu_test_steps("bridge")


def _tests_hooks(out: str) -> List[Step]:
    return build_steps(bridge=False) + gpu_test_steps("hooks")


def _tests_bestfit(out: str) -> List[Step]:
    bestfit = "strategy:bestfit"
    return build_steps() + gpu_test_steps("bridge", bestfit) + gpu_test_steps("hooks", bestfit)


def _bench(out: str) -> List[Step]:
    return build_steps() + [Step("quick benchmarks", [
        PY, "-m", "benchmarks.gpu", "--quick", "--allocators", ALLOCATORS,
        "--only", "alloc_speed", "control_transformer", "llm_train",
        "--out-dir", out, "--name", "bench", "--fresh"])]


def _traces(out: str) -> List[Step]:
    # The traces stay outside the output folder, which takes few files: one archive goes back.
    traces = os.path.join(tempfile.gettempdir(), "pyalloc-session-traces")
    return build_steps(bridge=False) + [
        Step("memory histories (native, native_expandable)", [
            PY, "-m", "benchmarks.gpu", "--no-timing", "--traces", "--trace-allocators",
            "native,native_expandable", "--only", "llm_train", "bert_infer", "generate",
            "--trace-dir", traces, "--out-dir", out, "--name", "traces", "--fresh"]),
        Step("replay of the histories", ["bash", "-c",
             f'{shlex.quote(PY)} -m pyalloc replay --no-search --json "$0"/traces-replay.json "$1"/*.pickle',
             out, traces]),
        Step("the replay beside the live runs", [PY, "-m", "benchmarks.gpu.session", "--compare-traces", out]),
        Step("archive of the histories", ["tar", "czf", os.path.join(out, "traces.tar.gz"),
                                          "-C", os.path.dirname(traces), os.path.basename(traces)]),
    ]


def _batch(out: str) -> List[Step]:
    return build_steps() + [Step("largest batch under a budget", [
        PY, "-m", "benchmarks.gpu", "--no-timing", "--budget-search", "--budget", "16GiB",
        "--max-probes", "4", "--search-tolerance", "0.1", "--allocators", ALLOCATORS,
        "--only", "bert_infer", "llm_train_bf16_ckpt", "--out-dir", out, "--name", "batch", "--fresh"])]


STAGES: List[Stage] = [
    Stage("doctor", 240, "build; pyalloc doctor; tests/gpu/diagnose_exceptions.sh (readelf, the throws with "
          "and without torch on both routes and strategies, cuda-gdb, a rebuild with the system g++)", _doctor),
    Stage("tests-bridge", 240, "build; tests/test_gpu.py through the bridge (PYALLOC_BRIDGE=1), default "
          f"strategy: -n {SIDE_BY_SIDE} side by side, then the whole_device checks alone", _tests_bridge),
    Stage("tests-hooks", 180, "build pyalloc._C; tests/test_gpu.py through the C hooks (PYALLOC_BRIDGE=0), "
          "default strategy: side by side, then whole_device alone", _tests_hooks),
    Stage("tests-bestfit", 300, "build; tests/test_gpu.py under PYALLOC_CONF=strategy:bestfit through the bridge, "
          "then through the hooks", _tests_bestfit),
    Stage("bench", 180, f"build; python -m benchmarks.gpu --quick, allocators {ALLOCATORS}: alloc_speed, "
          "control_transformer, llm_train -> bench.json/.md/plots", _bench),
    Stage("traces", 160, "build pyalloc._C; memory histories of llm_train, bert_infer, generate under native "
          "and native_expandable; pyalloc replay --json -> traces.json, traces-replay.json, traces.tar.gz",
          _traces),
    Stage("batch", 200, f"build; largest batch under 16 GiB for bert_infer and llm_train_bf16_ckpt, allocators "
          f"{ALLOCATORS} -> batch.json/.md", _batch),
]


def stage_named(name: str, stages: Sequence[Stage] = STAGES) -> Stage:
    for stage in stages:
        if stage.name == name:
            return stage
    raise KeyError(f"no stage '{name}'; stages: {', '.join(s.name for s in stages)}")


def plan_lines(stages: Sequence[Stage] = STAGES) -> List[str]:
    lines = [f"{s.name:<14} {s.limit_s:>4} s  {s.what}" for s in stages]
    total = sum(s.limit_s for s in stages)
    lines.append(f"{'total':<14} {total:>4} s  (limit per stage {STAGE_LIMIT_S} s, "
                 f"for all {TOTAL_LIMIT_S} s: {'fits' if fits(stages) else 'DOES NOT FIT'})")
    return lines


def fits(stages: Sequence[Stage] = STAGES) -> bool:
    return all(s.limit_s <= STAGE_LIMIT_S for s in stages) and sum(s.limit_s for s in stages) <= TOTAL_LIMIT_S


# -- the replay's prediction beside the live runs ----------------------------------------


def _gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def compare_traces(out: str) -> List[str]:
    """A table of each recorded history: what the live run measured (peak reserved,
    device allocations) beside what the replay of its trace found (the native
    allocator's peak reserved followed through the trace; pyalloc's predicted peak
    reserved and device calls). From out/traces.json and out/traces-replay.json."""
    with open(os.path.join(out, "traces.json")) as f:
        live = json.load(f)
    with open(os.path.join(out, "traces-replay.json")) as f:
        replays = {os.path.basename(r["trace"]): r for r in json.load(f)}
    lines = ["workload             allocator          live: peak reserved GiB, device allocs | replay: "
             "native peak reserved GiB (ratio to live) | pyalloc peak reserved GiB, device allocs+frees"]
    for name, entry in sorted(live.get("workloads", {}).items()):
        for allocator, info in sorted((entry.get("traces") or {}).items()):
            r = replays.get(os.path.basename(info.get("path") or ""))
            seen = info.get("live") or {}
            text = (f"{name:<20} {allocator:<18} {_gib(seen.get('peak_reserved')):>8}, "
                    f"{seen.get('num_device_alloc', '-')}")
            if r is None:
                lines.append(text + " | no replay of this trace")
                continue
            native, peak = r.get("native_peak_reserved_bytes"), seen.get("peak_reserved")
            ratio = f" ({native / peak:.3f})" if native is not None and peak else ""
            lines.append(f"{text} | {_gib(native)}{ratio} | {_gib(r.get('pyalloc_peak_reserved_bytes'))}, "
                         f"{r.get('device_allocs', 0) + r.get('device_frees', 0)}")
    return lines


# -- where it ran -----------------------------------------------------------------------


def _first_line(argv: List[str], timeout: float = 60) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({type(e).__name__})"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines else f"unknown (exit {out.returncode})"


def describe_machine() -> List[str]:
    """Device, driver, torch, date and commit, one line each."""
    sys.path.insert(0, REPO)
    from benchmarks._env import _git_commit

    gpu = _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    torch = _first_line([PY, "-c", "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)"])
    return [f"device: {gpu} (name, driver, memory)", f"torch: {torch}",
            f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"commit: {_git_commit()}", f"python: {sys.version.split()[0]}, {os.cpu_count()} cores"]


# -- running a stage --------------------------------------------------------------------


@dataclass
class StepResult:
    step: Step
    status: str  # "passed", "failed", "killed" (at the stage's limit), "not run"
    rc: Optional[int] = None
    seconds: float = 0.0
    counts: Dict[str, int] = field(default_factory=dict)  # pytest: passed, failed, skipped, ...
    failed_tests: List[str] = field(default_factory=list)
    skipped_tests: List[str] = field(default_factory=list)
    why: str = ""


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def read_pytest(output: str, result: StepResult) -> None:
    """The counts of pytest's last summary line, and the tests -rA names as failed or skipped."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            result.failed_tests.append(line.split(" ", 1)[1])
        elif line.startswith("SKIPPED "):
            result.skipped_tests.append(line.split("] ", 1)[-1])
    summaries = [line for line in output.splitlines() if line.startswith("=") and _COUNT.search(line)]
    if summaries:
        for number, what in _COUNT.findall(summaries[-1]):
            result.counts["errors" if what == "error" else what] = int(number)


class Tee:
    """Every line to the log file (flushed at once) and to this process's stdout."""

    def __init__(self, path: str, echo: bool = True):
        self.file = open(path, "w", buffering=1)  # one log per run of a stage
        self.echo = echo

    def write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()
        if self.echo:
            sys.stdout.write(text)
            sys.stdout.flush()

    def line(self, text: str = "") -> None:
        self.write(text + "\n")

    def close(self) -> None:
        self.file.close()


def _kill(proc: subprocess.Popen) -> None:
    """The step and every process it started (its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, tee: Tee, deadline: float, env: Dict[str, str]) -> StepResult:
    tee.line("$ " + " ".join([f"{k}={v}" for k, v in step.env.items()] + [shlex.join(step.argv)]))
    start = time.monotonic()
    try:
        proc = subprocess.Popen(step.argv, cwd=REPO, env=dict(env, **step.env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        tee.line(f"-- could not start: {e}")
        return StepResult(step, "failed", why=f"could not start: {e}")
    lines: List[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            tee.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        killed = True
        _kill(proc)
    reader.join(timeout=10)
    if not reader.is_alive():
        proc.stdout.close()  # type: ignore[union-attr]
    result = StepResult(step, "passed", rc=proc.returncode, seconds=time.monotonic() - start)
    if step.pytest:
        read_pytest("".join(lines), result)
    if killed:
        result.status, result.why = "killed", "killed at the stage's limit"
        tee.line(f"-- killed after {result.seconds:.0f} s: the stage's limit was reached")
    elif proc.returncode != 0:
        result.status = "failed"
        result.why = (f"died of signal {-proc.returncode}" if proc.returncode < 0
                      else f"exit {proc.returncode}")
        last = [line.strip() for line in lines if line.strip()][-1:]
        if last and not step.pytest:  # a pytest step's summary names its failures
            result.why += f", its last line: {last[0][:300]}"
    tee.line(f"-- {result.status}: {step.label} ({result.why or 'exit 0'}, {result.seconds:.0f} s)")
    return result


def _counts(r: StepResult) -> str:
    return ", ".join(f"{n} {what}" for what, n in r.counts.items())


def summary_lines(stage: Stage, results: List[StepResult], seconds: float) -> List[str]:
    """What passed, what failed, what did not run (steps, then the tests pytest named);
    the last line: the stage's verdict."""
    passed = [r.step.label + (f" ({_counts(r)})" if r.counts else "") for r in results if r.status == "passed"]
    failed = [r for r in results if r.status in ("failed", "killed")]
    not_run = [f"{r.step.label} ({r.why})" for r in results if r.status == "not run"]
    failed_tests = [t for r in results for t in r.failed_tests]
    skipped_tests = [t for r in results for t in r.skipped_tests]
    killed = any(r.status == "killed" for r in results)
    verdict = "KILLED at its limit" if killed else "FAILED" if failed or failed_tests else "PASSED"
    lines = [f"== summary of stage {stage.name} ({seconds:.0f} s of its {stage.limit_s} s)",
             "passed: " + ("; ".join(passed) or "nothing"),
             "failed: " + ("; ".join(r.step.label for r in failed) or "nothing")]
    lines += [f"  {r.step.label}: {r.why}" + (f" ({_counts(r)})" if r.counts else "") for r in failed]
    lines += [f"  failed test: {t}" for t in failed_tests]
    lines.append("did not run: " + ("; ".join(not_run) or "nothing"))
    lines += [f"  skipped test: {t}" for t in skipped_tests]
    lines.append(f"stage {stage.name}: {verdict}")
    return lines


def run_stage(stage: Stage, out: str, command: str = "", echo: bool = True,
              describe: Optional[Callable[[], List[str]]] = None, env: Optional[Dict[str, str]] = None) -> bool:
    """Runs one stage into out/<stage>.log; True when every step passed. ``describe``
    and ``env`` replace the real ones (tests)."""
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    deadline = start + stage.limit_s
    tee = Tee(os.path.join(out, f"{stage.name}.log"), echo)
    results: List[StepResult] = []
    try:
        tee.line(f"== stage {stage.name}: {stage.what}")
        tee.line(f"limit: {stage.limit_s} s")
        tee.line(f"command: {command or shlex.join([PY, '-m', 'benchmarks.gpu.session'] + sys.argv[1:])}")
        try:
            for line in (describe or describe_machine)():
                tee.line(line)
        except Exception as e:  # the stage runs whatever the description says
            tee.line(f"environment: cannot be described ({type(e).__name__}: {e})")
        steps = stage.steps(os.path.abspath(out))
        stop = ""
        base_env = dict(os.environ if env is None else env)
        base_env["PYTHONUNBUFFERED"] = "1"
        for step in steps:
            if not stop and time.monotonic() >= deadline:
                stop = "the stage's limit was reached"
            if stop:
                results.append(StepResult(step, "not run", why=stop))
                continue
            tee.line()
            r = run_step(step, tee, deadline, base_env)
            results.append(r)
            if r.status == "killed":
                stop = "the stage's limit was reached"
            elif r.status == "failed" and step.needed:
                stop = f"'{step.label}' failed"
    finally:
        tee.line()
        for line in summary_lines(stage, results, time.monotonic() - start):
            tee.line(line)
        tee.close()
    return all(r.status == "passed" for r in results)


# -- command line -----------------------------------------------------------------------


def main(argv: Optional[List[str]] = None, stages: Sequence[Stage] = STAGES) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.session", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", action="store_true", help="print the stages: name, limit in seconds, what")
    which.add_argument("--stage", metavar="NAME", help="run one stage")
    which.add_argument("--all", action="store_true", help="run every stage, in order")
    which.add_argument("--compare-traces", metavar="DIR", help="the replay of the traces stage's histories "
                       "beside the live runs (DIR/traces.json, DIR/traces-replay.json)")
    p.add_argument("--out", metavar="DIR", help="where each stage writes its log and results")
    args = p.parse_args(argv)
    if args.compare_traces:
        for line in compare_traces(args.compare_traces):
            print(line)
        return 0
    if args.plan:
        for line in plan_lines(stages):
            print(line)
        return 0 if fits(stages) else 1
    if not args.out:
        p.error("--stage and --all need --out DIR")
    command = shlex.join([PY, "-m", "benchmarks.gpu.session"] + (sys.argv[1:] if argv is None else argv))
    try:
        chosen = [stage_named(args.stage, stages)] if args.stage else list(stages)
    except KeyError as e:
        p.error(str(e.args[0]))
    ok = True
    for stage in chosen:
        ok &= run_stage(stage, args.out, command)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
