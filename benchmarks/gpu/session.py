"""A GPU window: everything a GPU session runs, in stages, in as few commands as fit.

    python -m benchmarks.gpu.session --plan                        # the stages, and how a window fits them
    python -m benchmarks.gpu.session --stages doctor,tests,speed --out DIR --limit 560
    python -m benchmarks.gpu.session --stage NAME --out DIR        # one stage
    python -m benchmarks.gpu.session --all --out DIR               # every stage, in order

A GPU task has 15 minutes of device time in all: the machine's start (a minute
or two), each command (at most 10 minutes) and every idle wait count. A machine
goes back 30 s after a command ends, and the next one starts bare. So one
command builds once (pyalloc._C with all cores, then the bridge where a stage
uses it) and runs several stages in order, each within its own limit; a stage
that no longer fits the command's limit does not start, and the log says so.
A second command on the warm machine finds the build done and takes the next
stages. ``--plan`` prints how a window splits the stages into commands.

Each stage leaves in DIR one log, ``<stage>.log``, and its results; the build
leaves ``build.log``. A log begins with the device, driver, torch, date, commit
and command, takes every output of every step as it comes (a stage stopped at
its limit still leaves it), and ends with what passed, what failed and what did
not run. The runner enforces the limits itself: a step still running at its
stage's limit is killed, with the processes it started; when a step ends, what
it left running is killed too. At most 8 files come back from a GPU machine:
past 8, the results (not the logs) go into one archive, and the logs into
another if that is not enough.

GPU checks run side by side (pytest-xdist) where they do not need the whole
device, the four configurations (two routes, two strategies) at once, and alone
where they do (out-of-memory, budgets, device-wide free memory: the
``whole_device`` mark in tests/cuda/test_gpu.py).

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
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable

#: One command on the GPU machine runs at most 600 s; the runner keeps 40 s in hand.
COMMAND_LIMIT_S = 560
#: A GPU task's device time: 15 minutes, the machine's start and idle waits included.
DEVICE_TIME_S = 900
#: A bare machine's start, counted in the device time. The guide allows a minute or two;
#: the H200 of 2026-11-28 took 35 s (held 570 s for a command of 535 s). The plan takes two
#: minutes, and shows the window with the start measured too.
START_S = 120
MEASURED_START_S = 35
#: Between two commands the machine idles (and counts) while the next is sent; it goes
#: back after 30 s. The second command is sent as soon as the first returns: 20 s is
#: what the plan allows for that, not a measurement.
TURNAROUND_S = 20
#: Kept in hand at the end: a step killed at its limit takes a few seconds more to go,
#: and the machine counts until it is given back (give_back, at once after the last command).
END_MARGIN_S = 20
#: Building pyalloc._C with every core, then the bridge, on a bare machine: 39 s on an
#: H200's 16 cores with /usr/bin/g++ (11 s and 25 s; 58 s with the image's CXX the day
#: before); the C++ runtime's probe adds a tiny library or two. BUILD_S is what a plan
#: expects, BUILD_LIMIT_S where the build is stopped. On a warm machine the build
#: outputs are still there: the stage took 9-11 s (its two steps 5-6 s).
BUILD_S = 45
BUILD_LIMIT_S = 75
WARM_BUILD_S = 11
#: What comes back from a GPU machine's output folder: 8 files, each of at most 16 MiB.
MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
#: A result larger than this stays a file of its own when the others are packed.
PACK_UP_TO = 4 << 20
#: pytest-xdist workers for the checks that share the device, per configuration (four run at once).
SIDE_BY_SIDE = 3
#: The configurations of tests/cuda/test_gpu.py: route (PYALLOC_BRIDGE) and PYALLOC_CONF.
CONFIGURATIONS = [("bridge", ""), ("hooks", ""), ("bridge", "strategy:bestfit"), ("hooks", "strategy:bestfit")]
#: Every allocator the benchmarks compare.
ALLOCATORS = "native,pyalloc,pyalloc_hooks,native_expandable,native_async"


@dataclass
class Step:
    """One command of a stage. pytest steps have their summary read; a step marked
    ``needed`` stops the stage when it fails (the build). Consecutive steps marked
    ``together`` run at the same time, each line of their output tagged with ``tag``."""

    label: str
    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    pytest: bool = False
    needed: bool = False
    together: bool = False
    tag: str = ""
    #: The stage's last seconds, kept for the steps after this one: killed at its own
    #: deadline, the step lets them run (a replay and an archive of what it recorded).
    reserve_s: int = 0


@dataclass
class Stage:
    name: str
    limit_s: int  # where its steps are stopped, the build excluded (a command builds once)
    what: str
    steps: Callable[[str], List[Step]]  # the stage's steps, given its output folder
    bridge: bool = True  # needs the bridge built
    in_window: bool = True  # planned in every window; else run by name when needed
    #: What the stage is expected to take, from the measured runs (default: its limit). A
    #: plan fits stages by it, and a command starts a stage while it fits what is left.
    cost_s: Optional[int] = None
    #: A stage that takes what is left of its command, up to its limit, and keeps what
    #: it finished when the command ends: its cost is the least worth starting it for.
    fills: bool = False

    @property
    def expected_s(self) -> int:
        return self.limit_s if self.cost_s is None else self.cost_s


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


def config_tag(route: str, conf: str = "") -> str:
    return f"{route}{', ' + conf if conf else ''}"


def _test_env(route: str, conf: str) -> Dict[str, str]:
    env = {"PYALLOC_BRIDGE": "1" if route == "bridge" else "0"}
    if conf:
        env["PYALLOC_CONF"] = conf
    return env


# pytest-benchmark (on the GPU machine's image) warns that xdist disables it, and the
# project's filterwarnings = error makes that an internal error: no check would run.
# --durations: the stage is the window's longest, and its plan needs to know which checks take its time.
_PYTEST = [PY, "-m", "pytest", "tests/cuda/test_gpu.py", "-v", "-rA", "--durations", "12", "-p", "no:cacheprovider",
           "-p", "no:benchmark"]


def gpu_test_steps(configurations=CONFIGURATIONS) -> List[Step]:
    """tests/cuda/test_gpu.py under each configuration: first the checks that share the device,
    every configuration at once (each with pytest-xdist workers, or one check at a time
    where it is missing), then those that need the device whole, alone, one
    configuration after the other."""
    side, alone = [], []
    for route, conf in configurations:
        tag, env = config_tag(route, conf), _test_env(route, conf)
        argv = list(_PYTEST)
        if xdist_available():
            label = f"GPU tests side by side ({tag})"
            argv += ["-n", str(SIDE_BY_SIDE)]
        else:
            label = f"GPU tests that share the device, one worker: no pytest-xdist ({tag})"
        side.append(Step(label, argv + ["-m", "gpu and not whole_device"], env, pytest=True,
                         together=len(configurations) > 1, tag=tag))
        alone.append(Step(f"GPU tests alone ({tag})", _PYTEST + ["-m", "gpu and whole_device"], env,
                          pytest=True, tag=tag))
    return side + alone


def _doctor(out: str) -> List[Step]:
    return [Step("pyalloc doctor", [PY, "-m", "pyalloc", "doctor"])]


def _tests(out: str) -> List[Step]:
    return gpu_test_steps()


def _diagnose(out: str) -> List[Step]:
    return [Step("crash diagnosis", ["bash", "tests/gpu/diagnose_exceptions.sh"], env={"STEP_LIMIT": "60"})]


def _bench(what: str, only: Sequence[str], extra: Sequence[str] = ()) -> Callable[[str], List[Step]]:
    def steps(out: str) -> List[Step]:
        return [Step(f"quick benchmarks: {', '.join(only)}", [
            PY, "-m", "benchmarks.gpu", "--quick", "--allocators", ALLOCATORS, "--only", *only, *extra,
            "--out-dir", out, "--name", what, "--fresh"])]
    return steps


#: The speed stage runs the rounds --quick plans (SPEED_ROUNDS in workloads.py, which this
#: torch-free module does not import): one process per allocator each. A process cost
#: about 9 s at 4ec56a2 on the H200 (4-5 s measuring, the rest python, torch and the CUDA
#: context, and the tables and plots redrawn after it); it now should measure for about a
#: second (an estimate, not yet run on a GPU) and draws once at the end. No round starts that would end past SPEED_WITHIN_S.
SPEED_WITHIN_S = 70


def _traces(out: str) -> List[Step]:
    # The traces stay outside the output folder, which takes few files: one archive goes back.
    traces = os.path.join(tempfile.gettempdir(), "pyalloc-session-traces")
    return [
        Step("memory histories (native, native_expandable), and pyalloc's live run of each", [
            PY, "-m", "benchmarks.gpu", "--no-timing", "--traces", "--trace-allocators",
            "native,native_expandable,pyalloc", "--parallel", "auto", "--only", "bert_infer", "llm_train",
            "generate", "--trace-dir", traces, "--out-dir", out, "--name", "traces", "--fresh"], reserve_s=20),
        Step("replay of the histories", ["bash", "-c",
             f'{shlex.quote(PY)} -m pyalloc replay --no-search --json "$0"/traces-replay.json "$1"/*.pickle',
             out, traces]),
        Step("the replay beside the live runs", [PY, "-m", "benchmarks.gpu.session", "--compare-traces", out]),
        Step("archive of the histories", ["tar", "czf", os.path.join(out, "traces.tar.gz"),
                                          "-C", os.path.dirname(traces), os.path.basename(traces)]),
    ]


#: The batch stage's workloads, each searched under every allocator, in the order the
#: harness starts the searches (--only's): bert_infer first, whose answer checks the
#: replay's claim live; generate next, whose searches take longest and so run beside the
#: others; llm_train_bf16_ckpt last. Seven lanes end bert_infer's five searches first and
#: all fifteen about 30 s sooner than the workloads in the registry's order (batch_searches).
BATCH_WORKLOADS = ("bert_infer", "generate", "llm_train_bf16_ckpt")
BATCH_BUDGET_GIB = 16
BATCH_PROBES = 4
#: Drawn shapes before the worst one twice, in each probe (the workloads' own default: 6).
BATCH_PROBE_STEPS = 2
#: A probe's seconds, an estimate. On the H200 at 4ec56a2 only pyalloc's probes ran (PyTorch's
#: allocators' failed at once), two at a time: bert_infer 10-12 s and llm_train_bf16_ckpt 8-13 s
#: with 6 drawn shapes, generate 55 s with 3 drawn calls of up to 256 new tokens (drawn calls
#: 44-56 ms a token, the first of the largest shape 66-72 ms, its repeat 21 ms). With 2 drawn
#: shapes, and generate's calls of at most 128 new tokens since, expected as below; seven at
#: a time share the GPU and may take longer: not measured.
PROBE_S = {"bert_infer": 9, "llm_train_bf16_ckpt": 8, "generate": 27}
#: The harness's own start and tables around the searches.
BATCH_AROUND_S = 10
#: What the H200 holds side by side at the budget: lanes_for(auto) on the 150,109,880,320
#: bytes torch reports for it.
H200_LANES = 7


def lane_ends(durations: Sequence[float], lanes: int) -> List[float]:
    """When each job ends, the jobs taken in order by ``lanes`` lanes, each lane taking
    the next as soon as its own ends (as the harness's search_all does)."""
    free = [0.0] * max(1, lanes)
    ends = []
    for d in durations:
        i = min(range(len(free)), key=free.__getitem__)
        free[i] += d
        ends.append(free[i])
    return ends


def batch_searches(lanes: int = H200_LANES, allocators: int = len(ALLOCATORS.split(","))) -> List[float]:
    """When each (workload, allocator) search of the batch stage is expected to end, in
    the harness's order: every allocator's search of one workload, then the next's
    (BATCH_WORKLOADS)."""
    return lane_ends([BATCH_PROBES * PROBE_S[w] for w in BATCH_WORKLOADS for _ in range(allocators)], lanes)


def batch_seconds(lanes: int = H200_LANES, allocators: int = len(ALLOCATORS.split(","))) -> int:
    """What the batch stage is expected to take for every search: each at most
    BATCH_PROBES probes, ``lanes`` at a time, and the harness's start and tables."""
    return int(-(-max(batch_searches(lanes, allocators)) // 1)) + BATCH_AROUND_S


def _batch(out: str) -> List[Step]:
    return [Step("largest batch under a budget", [
        PY, "-m", "benchmarks.gpu", "--no-timing", "--budget-search", "--budget", f"{BATCH_BUDGET_GIB}GiB",
        "--max-probes", str(BATCH_PROBES), "--search-tolerance", "0.1", "--probe-steps", str(BATCH_PROBE_STEPS),
        "--allocators", ALLOCATORS, "--parallel", "auto",
        "--only", *BATCH_WORKLOADS, "--out-dir", out, "--name", "batch", "--fresh"])]


def _oom_watch(out: str) -> List[Step]:
    return [Step("the cost of watching for out-of-memory errors", [
        PY, "-m", "benchmarks.bench_oom_watch", "--device", "cuda", "--repeats", str(OOM_WATCH_REPEATS),
        "--out", os.path.join(out, "oom_watch.json")])]


#: The oom_watch stage's repeats: each allocator's process times every recording that many
#: times in turn (100000 torch.empty pairs and the bundled trace's 27144 calls each).
OOM_WATCH_REPEATS = 3


# What each stage is expected to take (cost) and where it is stopped (limit), from what the
# H200 took on 2026-11-28 (benchmarks/results/gpu-2026-11-28-h200-4ec56a2, and -1ceb995 for
# the tests; "estimated" where no log shows the figure):
# - doctor 8-10 s.
# - tests 241 s at 1ceb995 (the four configurations side by side 82-125 s, then each one's
#   whole_device checks alone 22-38 s); four checks were added since, all side by side.
# - speed 53-60 s for one process per allocator, now the rounds of --quick
#   within 70 s, the session's start and the tables around them 12-19 s.
# - steps: llm_train 88 s for its five runs (12-14 s each in the worker, the rest the
#   process's start), control_transformer 6 s a run in the worker (about 11 s with the
#   start: estimated from llm_train's).
# - traces: one after the other, llm_train's three runs took 40 s, bert_infer's 41 s and
#   generate's two recordings about 70 s (estimated: the stage was killed during pyalloc's
#   run after them); a workload's three runs now go side by side
#   (about the longest one, 15-25 s each: an estimate), generate's calls are half as long,
#   and the replay of six histories takes seconds.
# - batch: see PROBE_S (estimated) and batch_searches(); it takes what is left of its
#   command (fills), and is worth starting for bert_infer's five searches, which start
#   first and take about BATCH_PROBES of its probes.
# - oom_watch: not yet run on a GPU; estimated: eight processes (a speed run and one a
#   recording's memory, for three allocators), each with its CUDA context (5-10 s), the speed
#   runs 3 repeats of 1-3 recordings over 100000 pairs and 27144 calls (20-40 s each), and
#   the memory runs a ring of 100000 filled and pickled (5-15 s each, frames the most).
STAGES: List[Stage] = [
    Stage("doctor", 30, "pyalloc doctor: ready, the route, the device's virtual memory", _doctor, cost_s=10),
    Stage("tests", 360, "tests/cuda/test_gpu.py on both routes (PYALLOC_BRIDGE=1, 0) under the default strategy "
          f"and strategy:bestfit: the four side by side at once (-n {SIDE_BY_SIDE} each), then each one's "
          "whole_device checks alone", _tests, cost_s=280),
    Stage("speed", 95, f"python -m benchmarks.gpu --quick, allocators {ALLOCATORS}: alloc_speed (torch.empty "
          f"pairs), the --quick rounds of one process each, none started that would end past "
          f"{SPEED_WITHIN_S} s -> speed.json/.md/plot",
          _bench("speed", ["alloc_speed"],
                 ["--rounds-within", str(SPEED_WITHIN_S)]), cost_s=85),
    Stage("steps", 170, f"python -m benchmarks.gpu --quick, allocators {ALLOCATORS}: control_transformer, "
          "llm_train (step times, peak allocated and reserved) -> steps.json/.md/plots",
          _bench("steps", ["control_transformer", "llm_train"]), cost_s=150),
    Stage("traces", 150, "memory histories of llm_train, bert_infer, generate under native and "
          "native_expandable, and pyalloc's live run of each, a workload's three side by side; "
          "pyalloc replay --json -> traces.json, traces-replay.json, traces.tar.gz",
          _traces, bridge=False, cost_s=80),
    Stage("batch", 330, f"largest batch under {BATCH_BUDGET_GIB} GiB for {', '.join(BATCH_WORKLOADS)}, "
          f"allocators {ALLOCATORS}, as many searches side by side as the device holds at the budget, "
          f"{BATCH_PROBES} probes each ({BATCH_PROBE_STEPS} drawn shapes, then the worst twice); takes what "
          "is left of its command -> batch.json/.md",
          _batch, cost_s=BATCH_PROBES * PROBE_S["bert_infer"] + 10, fills=True),
    Stage("oom_watch", 240, "run by name: benchmarks/bench_oom_watch.py --device cuda, torch.empty/del with the "
          "history recorded against not under native, native_expandable (_record_memory_history without and "
          "with Python frames) and pyalloc (record_history), an allocator a process; the history's bytes an event "
          "and a snapshot file's; a verdict's wall time -> oom_watch.json", _oom_watch, in_window=False,
          cost_s=150),
    Stage("diagnose", 240, "only when a GPU check died by a signal: tests/gpu/diagnose_exceptions.sh (the C++ "
          "runtime of each library, throws with and without torch on both routes and strategies, cuda-gdb, a "
          "rebuild with the system g++)", _diagnose, in_window=False),
]


def stage_named(name: str, stages: Sequence[Stage] = STAGES) -> Stage:
    for stage in stages:
        if stage.name == name:
            return stage
    raise KeyError(f"no stage '{name}'; stages: {', '.join(s.name for s in stages)}")


def command_cost(stages: Sequence[Stage], warm: bool = False) -> int:
    """Seconds one command of these stages is expected to take: the build, then each
    stage's expected time (what a filling stage needs at least)."""
    return (WARM_BUILD_S if warm else BUILD_S) + sum(s.expected_s for s in stages)


def window_plan(stages: Sequence[Stage], start_s: int = START_S) -> List[List[Stage]]:
    """The stages as a GPU window runs them: a first command on a bare machine takes
    them in order while they fit its limit; a second one on the warm machine takes the
    next while they fit what is left of the device time. What is left over is the
    last list: for the next window. A stage too long for any command is left over."""
    todo = list(stages)
    first: List[Stage] = []
    while todo and fits([todo[0]]) and command_cost(first + todo[:1]) <= COMMAND_LIMIT_S:
        first.append(todo.pop(0))
    second: List[Stage] = []
    while first and todo and fits([todo[0]]) and \
            command_cost(second + todo[:1], warm=True) <= second_limit(first, start_s):
        second.append(todo.pop(0))
    return [first, second, todo]


def second_limit(first: Sequence[Stage], start_s: int = START_S) -> int:
    """The --limit of a window's second command, after a first of these stages: the
    device time left, less the margin kept at the end. On the GPU, take it from the
    device's budget_left_s less END_MARGIN_S instead: it counts what really happened."""
    left = DEVICE_TIME_S - start_s - command_cost(first) - TURNAROUND_S - END_MARGIN_S
    return max(0, min(left, COMMAND_LIMIT_S))


def _names(stages: Sequence[Stage]) -> str:
    return ",".join(s.name for s in stages)


def _filled(command: Sequence[Stage], limit: int, warm: bool) -> str:
    """What a filling stage at the end of a command gets (the command's limit less the
    rest of it, at most its own limit) against what all its work is expected to take."""
    last = command[-1] if command else None
    if last is None or not last.fills:
        return ""
    gets = min(limit - command_cost(command[:-1], warm=warm), last.limit_s)
    need = min(batch_seconds() if last.name == "batch" else last.limit_s, last.limit_s)
    text = f"; {last.name} has {gets} s for the {need} s all its work is expected to take"
    if gets >= need:
        return text
    if last.name == "batch":
        ends = batch_searches()
        done = sum(1 for end in ends if end + BATCH_AROUND_S <= gets)
        text += f" ({done} of its {len(ends)} searches)"
    return text + ": it stops where its time ends, keeping what it finished"


def plan_lines(stages: Sequence[Stage] = STAGES, planned: Optional[Sequence[Stage]] = None) -> List[str]:
    """Each stage (name, expected time, limit, what), then how a window runs ``planned``
    (by default every stage planned in every window, in order): with a start of START_S
    and, where it differs, with the start measured."""
    lines = [f"{s.name:<10} {s.expected_s:>4} s{'+' if s.fills else ' '} {s.limit_s:>4} s  {s.what}"
             for s in stages]
    lines.append("(expected seconds, + where a stage takes what is left of its command; the limit; what it runs)")
    if planned is None:
        planned = [s for s in stages if s.in_window]
    for start in (START_S, MEASURED_START_S):
        first, second, later = window_plan(planned, start)
        limit = second_limit(first, start)
        lines.append(f"a window with a start of {start} s: {DEVICE_TIME_S} s of device time, a build of {BUILD_S} s "
                     f"({WARM_BUILD_S} s on a warm machine), at most {COMMAND_LIMIT_S} s a command, "
                     f"{END_MARGIN_S} s kept in hand")
        lines.append(f"command 1: --stages {_names(first)} --limit {COMMAND_LIMIT_S} "
                     f"({command_cost(first)} s expected{_filled(first, COMMAND_LIMIT_S, False)})"
                     if first else "command 1: nothing fits")
        if second:
            lines.append(f"command 2, on the warm machine within {TURNAROUND_S} s: --stages {_names(second)} "
                         f"--limit {limit} ({command_cost(second, warm=True)} s expected; the limit: "
                         f"budget_left_s less {END_MARGIN_S}{_filled(second, limit, True)}), then give the machine back")
        lines.append(f"next window: {_names(later) or 'nothing'}")
    return lines


def fits(stages: Sequence[Stage] = STAGES) -> bool:
    """Every stage fits one command, its build included."""
    return all(BUILD_LIMIT_S + s.expected_s <= COMMAND_LIMIT_S for s in stages)


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
    status: str  # "passed", "failed", "killed" (at a limit), "stopped" (a filling stage at the command's end), "not run"
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


def machine_paths(out: str) -> List[tuple]:
    """(path, placeholder) for the folders of this machine a log would name but no
    other machine has: the checkout, the virtualenv, the output folder, the temporary
    folder and the home folder. System paths (compilers, CUDA, headers) stay: they say
    what the image holds."""
    pairs = [(REPO, "<checkout>"), (os.path.abspath(out), "$OUT"), (tempfile.gettempdir(), "<tmp>"),
             (os.path.expanduser("~"), "~")]
    if sys.prefix != sys.base_prefix:  # a virtualenv: the system's prefix (/usr) names system paths
        pairs.append((sys.prefix, "<venv>"))
    # The longest first, so that a folder inside another takes its own name.
    return sorted(((os.path.realpath(p), name) for p, name in pairs if p not in ("", "/")),
                  key=lambda pair: -len(pair[0]))


def portable(text: str, paths: Sequence[tuple]) -> str:
    """text with each machine path (machine_paths()) as its placeholder, where it is a
    whole path or begins one."""
    for path, name in paths:
        text = re.sub(re.escape(path) + r"(?=[/\s'\":,)\]]|$)", lambda _: name, text, flags=re.M)
    return text


class Tee:
    """Every line to the log file (flushed at once) and to this process's stdout; whole
    lines, from several threads at once. With ``paths`` (machine_paths()) the log names
    this machine's own folders by placeholders, so that it reads the same anywhere."""

    def __init__(self, path: str, echo: bool = True, paths: Sequence[tuple] = ()):
        self.file = open(path, "w", buffering=1)  # one log per run of a stage
        self.echo = echo
        self.paths = list(paths)
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            if self.file.closed:  # a straggling reader after the stage ended
                return
            self.file.write(portable(text, self.paths))
            self.file.flush()
            if self.echo:
                sys.stdout.write(text)
                sys.stdout.flush()

    def line(self, text: str = "") -> None:
        self.write(text + "\n")

    def close(self) -> None:
        with self.lock:
            self.file.close()


def _signal_group(proc: subprocess.Popen, sig: int, wait_s: float) -> bool:
    """Sends sig to the step's process group (the step and all it started) and waits up
    to wait_s for the step itself to end; False if the group was gone already."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    return True


def _kill(proc: subprocess.Popen) -> None:
    """The step and every process it started: SIGTERM, a few seconds for the step to
    go, then SIGKILL to whatever is left of the group, which also takes a child that
    ignores SIGTERM or outlives its parent."""
    if _signal_group(proc, signal.SIGTERM, 3):
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the step's process group: nothing it started outlives it (on the GPU
    machine a process in a session of its own runs on after the command)."""
    _signal_group(proc, signal.SIGKILL, 5)


def run_step(step: Step, tee: Tee, deadline: float, env: Dict[str, str],
             limit: str = "the stage's limit") -> StepResult:
    """Runs one step until it ends or the deadline (``limit`` names it); each line it
    prints goes to the log as it comes, after ``[tag] `` when the step runs beside others."""
    prefix = f"[{step.tag}] " if step.together and step.tag else ""
    tee.line(prefix + "$ " + " ".join([f"{k}={v}" for k, v in step.env.items()] + [shlex.join(step.argv)]))
    start = time.monotonic()
    try:
        proc = subprocess.Popen(step.argv, cwd=REPO, env=dict(env, **step.env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        tee.line(f"{prefix}-- could not start: {e}")
        return StepResult(step, "failed", why=f"could not start: {e}")
    lines: List[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            tee.write(prefix + line if line.endswith("\n") else prefix + line + "\n")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        killed = True
        _kill(proc)
    else:
        _kill_group(proc)  # a child left behind would hold the device, and the output pipe
    reader.join(timeout=5)
    if not reader.is_alive():
        proc.stdout.close()  # type: ignore[union-attr]
    result = StepResult(step, "passed", rc=proc.returncode, seconds=time.monotonic() - start)
    if step.pytest:
        read_pytest("".join(lines), result)
    if killed:
        result.status, result.why = "killed", f"killed at {limit}"
        tee.line(f"{prefix}-- killed after {result.seconds:.0f} s: {limit} was reached")
    elif proc.returncode != 0:
        result.status = "failed"
        result.why = (f"died of signal {-proc.returncode}" if proc.returncode < 0
                      else f"exit {proc.returncode}")
        last = [line.strip() for line in lines if line.strip()][-1:]
        if last and not step.pytest:  # a pytest step's summary names its failures
            result.why += f", its last line: {last[0][:300]}"
    tee.line(f"{prefix}-- {result.status}: {step.label} ({result.why or 'exit 0'}, {result.seconds:.0f} s)")
    return result


def run_together(steps: List[Step], tee: Tee, deadline: float, env: Dict[str, str]) -> List[StepResult]:
    """Runs the steps at the same time; their results in their order."""
    results: List[Optional[StepResult]] = [None] * len(steps)

    def one(i: int) -> None:
        try:
            results[i] = run_step(steps[i], tee, deadline, env)
        except Exception as e:  # the other steps' results still count
            results[i] = StepResult(steps[i], "failed", why=f"the runner failed: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def _counts(r: StepResult) -> str:
    return ", ".join(f"{n} {what}" for what, n in r.counts.items())


def summary_lines(stage: Stage, results: List[StepResult], seconds: float, limit_s: Optional[float] = None) -> List[str]:
    """What passed, what failed, what did not run (steps, then the tests pytest named);
    the last line: the stage's verdict."""
    passed = [r.step.label + (f" ({_counts(r)})" if r.counts else "") for r in results if r.status == "passed"]
    passed += [f"{r.step.label} ({r.why})" for r in results if r.status == "stopped"]
    failed = [r for r in results if r.status in ("failed", "killed")]
    skipped = [r for r in results if r.status == "not run"]
    not_run = [f"{r.step.label} ({r.why})" for r in skipped]
    if len(skipped) > 1 and len(skipped) == len(results) and len({r.why for r in skipped}) == 1:
        not_run = [f"all {len(skipped)} steps ({skipped[0].why})"]
    failed_tests = [t for r in results for t in r.failed_tests]
    skipped_tests = [t for r in results for t in r.skipped_tests]
    killed = any(r.status == "killed" for r in results)
    stopped = any(r.status == "stopped" for r in results)
    verdict = ("KILLED at its limit" if killed else "FAILED" if failed or failed_tests
               else "NOT RUN" if results and len(skipped) == len(results)
               else "INCOMPLETE" if skipped and not stopped or not results
               else "STOPPED at the command's end, as planned" if stopped else "PASSED")
    limit = stage.limit_s if limit_s is None else limit_s
    lines = [f"== summary of stage {stage.name} ({seconds:.0f} s of its {limit:.0f} s)",
             "passed: " + ("; ".join(passed) or "nothing"),
             "failed: " + ("; ".join(r.step.label for r in failed) or "nothing")]
    lines += [f"  {r.step.label}: {r.why}" + (f" ({_counts(r)})" if r.counts else "") for r in failed]
    lines += [f"  failed test: {t}" for t in failed_tests]
    lines.append("did not run: " + ("; ".join(not_run) or "nothing"))
    lines += [f"  skipped test: {t}" for t in skipped_tests]
    lines.append(f"stage {stage.name}: {verdict}")
    return lines


def run_stage(stage: Stage, out: str, command: str = "", echo: bool = True,
              describe: Optional[Callable[[], List[str]]] = None, env: Optional[Dict[str, str]] = None,
              **how) -> bool:
    """Runs one stage into out/<stage>.log; True when every step passed (see stage_results)."""
    results = stage_results(stage, out, command, echo, describe, env, **how)
    return bool(results) and all(r.status in ("passed", "stopped") for r in results)


def end_of(cut: bool) -> str:
    """What stops a stage: the command's end when it comes before the stage's limit."""
    return "the command's end" if cut else "the stage's limit"


def stage_results(stage: Stage, out: str, command: str = "", echo: bool = True,
                  describe: Optional[Callable[[], List[str]]] = None, env: Optional[Dict[str, str]] = None,
                  steps: Optional[List[Step]] = None, until: Optional[float] = None,
                  not_run: str = "") -> List[StepResult]:
    """Runs one stage into out/<stage>.log; what each step did. ``steps`` replaces the
    stage's own (the build), ``until`` (time.monotonic()) ends it before its limit (the
    command's), ``not_run`` says why none of its steps runs. ``describe`` and ``env``
    replace the real ones (tests)."""
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    deadline = start + stage.limit_s if until is None else min(start + stage.limit_s, until)
    cut = deadline < start + stage.limit_s  # the command ends before the stage's limit
    tee = Tee(os.path.join(out, f"{stage.name}.log"), echo, machine_paths(out))
    results: List[StepResult] = []
    try:
        tee.line(f"== stage {stage.name}: {stage.what}")
        tee.line(f"limit: {deadline - start:.0f} s" + (
            f" (what is left of the command; the stage's own: {stage.limit_s} s)" if cut else ""))
        tee.line(f"command: {command or shlex.join([PY, '-m', 'benchmarks.gpu.session'] + sys.argv[1:])}")
        try:
            for line in (describe or describe_machine)():
                tee.line(line)
        except Exception as e:  # the stage runs whatever the description says
            tee.line(f"environment: cannot be described ({type(e).__name__}: {e})")
        todo = stage.steps(os.path.abspath(out)) if steps is None else steps
        stop = not_run
        base_env = dict(os.environ if env is None else env)
        base_env["PYTHONUNBUFFERED"] = "1"
        i = 0
        while i < len(todo):
            group = [todo[i]]
            while todo[i].together and i + len(group) < len(todo) and todo[i + len(group)].together:
                group.append(todo[i + len(group)])
            i += len(group)
            if not stop and time.monotonic() >= deadline:
                stop = f"{end_of(cut)} was reached"
            if stop:
                results += [StepResult(s, "not run", why=stop) for s in group]
                continue
            tee.line()
            reserve = group[0].reserve_s if len(group) == 1 else 0
            end = end_of(cut)
            done = run_together(group, tee, deadline, base_env) if len(group) > 1 else \
                [run_step(group[0], tee, deadline - reserve, base_env,
                          f"its limit ({reserve} s of the stage's kept for the steps after it)" if reserve
                          else end)]
            if stage.fills and cut:  # as planned: what it finished is kept
                for r in done:
                    if r.status == "killed":
                        r.status, r.why = "stopped", "stopped at the command's end, as planned: what it finished is kept"
            results += done
            if any(r.status in ("killed", "stopped") for r in done):
                if not (reserve and time.monotonic() < deadline):
                    stop = f"{end} was reached"
            else:
                failed = [r.step.label for r in done if r.status == "failed" and r.step.needed]
                if failed:
                    stop = f"'{failed[0]}' failed"
    finally:
        tee.line()
        for line in summary_lines(stage, results, time.monotonic() - start, deadline - start):
            tee.line(line)
        tee.close()
    return results


def _pack(out: str, names: List[str], archive: str) -> None:
    with tarfile.open(os.path.join(out, archive), "w:gz") as tar:
        for n in names:
            tar.add(os.path.join(out, n), arcname=n)
    for n in names:
        os.remove(os.path.join(out, n))


def pack_results(out: str, max_files: int = MAX_FILES) -> List[str]:
    """Past ``max_files`` files in ``out``: the results (not the logs, not archives, none
    over PACK_UP_TO bytes) go into one results.tar.gz; if that is not enough, the logs
    into logs.tar.gz too. What it did, and any file too large to come back, as lines."""
    def files() -> List[str]:
        return sorted(n for n in os.listdir(out) if os.path.isfile(os.path.join(out, n)))

    said: List[str] = []
    if len(files()) > max_files:
        small = [n for n in files() if not n.endswith((".log", ".tar.gz"))
                 and os.path.getsize(os.path.join(out, n)) <= PACK_UP_TO]
        if len(small) > 1:
            _pack(out, small, "results.tar.gz")
            said.append(f"more than {max_files} files: {len(small)} results went into results.tar.gz")
    if len(files()) > max_files:
        logs = [n for n in files() if n.endswith(".log")]
        if len(logs) > 1:
            _pack(out, logs, "logs.tar.gz")
            said.append(f"still more than {max_files} files: the {len(logs)} logs went into logs.tar.gz")
    if len(files()) > max_files:
        said.append(f"{len(files())} files: only {max_files} come back from a GPU machine")
    for n in files():
        if os.path.getsize(os.path.join(out, n)) > MAX_FILE_BYTES:
            said.append(f"{n} is over {MAX_FILE_BYTES >> 20} MiB: it will not come back from a GPU machine")
    return said


def run_command(stages: Sequence[Stage], out: str, limit_s: float, command: str = "", echo: bool = True,
                describe: Optional[Callable[[], List[str]]] = None, env: Optional[Dict[str, str]] = None,
                build: Optional[List[Step]] = None) -> bool:
    """One command of a window: the build once (build.log), then each stage in order, each
    started only while what it is expected to take fits what is left of ``limit_s``, and
    stopped at its limit or the command's end, whichever comes first; a stage that does
    not fit, or follows a failed build, leaves a log that says so. True when all passed.
    ``build`` replaces the real build steps (tests)."""
    start = time.monotonic()
    until = start + limit_s
    lines: Optional[List[str]] = None

    def described() -> List[str]:  # once for the command: the commit and device do not change
        nonlocal lines
        if lines is None:
            lines = (describe or describe_machine)()
        return [("date: " + _now()) if line.startswith("date: ") else line for line in lines]

    needs_bridge = any(s.bridge for s in stages)
    build_stage = Stage("build", BUILD_LIMIT_S, "build pyalloc._C" + (" and the bridge" if needs_bridge else ""),
                        lambda o: [])
    done = stage_results(build_stage, out, command, echo, described, env,
                         steps=build if build is not None else build_steps(needs_bridge), until=until)
    # The stages run when pyalloc._C was built; a bridge that failed fails the checks that need it.
    built = bool(done) and all(r.status == "passed" for r in done if r.step.needed)
    ok = built and all(r.status == "passed" for r in done)
    try:
        for stage in stages:
            left = until - time.monotonic()
            why = ("building pyalloc._C failed or ran out of time" if not built else
                   f"{left:.0f} s of the command were left, and the stage is expected to take {stage.expected_s} s"
                   if left < stage.expected_s else "")
            ok &= run_stage(stage, out, command, echo, described, env, until=until, not_run=why)
    finally:
        for line in pack_results(out):
            print(line, flush=True)
    return ok


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- command line -----------------------------------------------------------------------


def main(argv: Optional[List[str]] = None, stages: Sequence[Stage] = STAGES) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.session", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    p.add_argument("--plan", action="store_true", help="print the stages and how a window runs them (those "
                   "of --stages: what is left for this window)")
    which.add_argument("--stages", metavar="A,B,...", help="run these stages in one command, in this order")
    which.add_argument("--stage", metavar="NAME", help="run one stage")
    which.add_argument("--all", action="store_true", help="run every stage, in order")
    which.add_argument("--compare-traces", metavar="DIR", help="the replay of the traces stage's histories "
                       "beside the live runs (DIR/traces.json, DIR/traces-replay.json)")
    p.add_argument("--out", metavar="DIR", help="where the command writes its logs and results")
    p.add_argument("--limit", type=float, metavar="S", help="seconds for the whole command, build included "
                   f"(default: {COMMAND_LIMIT_S} for --stages, the stages' own limits for --stage and --all)")
    args = p.parse_args(argv)
    if args.compare_traces:
        for line in compare_traces(args.compare_traces):
            print(line)
        return 0
    if args.plan:
        if args.stage or args.all:
            p.error("--plan takes --stages, not --stage or --all")
        try:
            chosen = [stage_named(n.strip(), stages) for n in (args.stages or "").split(",") if n.strip()]
        except KeyError as e:
            p.error(str(e.args[0]))
        for line in plan_lines(stages, chosen or None):
            print(line)
        return 0 if fits(chosen or stages) else 1
    if not (args.stages or args.stage or args.all):
        p.error("one of --plan, --stages, --stage, --all or --compare-traces is needed")
    if not args.out:
        p.error("--stages, --stage and --all need --out DIR")
    command = shlex.join([PY, "-m", "benchmarks.gpu.session"] + (sys.argv[1:] if argv is None else argv))
    try:
        if args.stages:
            chosen = [stage_named(name.strip(), stages) for name in args.stages.split(",") if name.strip()]
        elif args.stage:
            chosen = [stage_named(args.stage, stages)]
        else:
            chosen = list(stages)
    except KeyError as e:
        p.error(str(e.args[0]))
    if not chosen:
        p.error("--stages names no stage")
    limit = args.limit if args.limit is not None else (
        COMMAND_LIMIT_S if args.stages else command_cost(chosen))
    return 0 if run_command(chosen, args.out, limit, command) else 1


if __name__ == "__main__":
    sys.exit(main())
