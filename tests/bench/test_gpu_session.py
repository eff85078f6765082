"""The GPU window's runner (benchmarks/gpu/session.py) on CPU: its plan fits the
window, a stage writes its log with the environment first and the summary last,
and a stage that runs past its limit is stopped and says so."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.gpu import session
from benchmarks.gpu.session import Stage, Step, run_stage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORDER = ["doctor", "tests", "speed", "steps", "traces", "batch", "oom_watch", "diagnose"]


def _py(code):
    return [sys.executable, "-c", code]


def _log(out, name):
    return (out / f"{name}.log").read_text().splitlines()


def test_the_plan_lists_every_stage_and_splits_a_window_into_commands_that_fit(capsys):
    assert session.main(["--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:len(ORDER)]] == ORDER
    for line, stage in zip(lines, session.STAGES):
        assert line.split()[1:5] == [str(stage.expected_s), "s+" if stage.fills else "s", str(stage.limit_s), "s"]
        assert stage.what in line and stage.expected_s <= stage.limit_s
        assert session.BUILD_LIMIT_S + stage.limit_s <= session.COMMAND_LIMIT_S, stage.name
    # Issue 40: 15 minutes of device time with a start of two minutes hold doctor, tests and
    # speed in a first command on the bare machine, steps, traces and batch in a second on
    # the warm one, by what each was measured to take.
    window = [s for s in session.STAGES if s.in_window]
    first, second, later = session.window_plan(window)
    assert session.START_S == 120
    assert [s.name for s in first] == ["doctor", "tests", "speed"] and later == []
    assert [s.name for s in second] == ["steps", "traces", "batch"]
    assert session.command_cost(first) <= session.COMMAND_LIMIT_S
    limit = session.second_limit(first)
    assert (session.START_S + session.command_cost(first) + session.TURNAROUND_S + limit
            + session.END_MARGIN_S) == session.DEVICE_TIME_S
    assert session.command_cost(second, warm=True) <= limit
    # The batch search takes what is left: with a start of two minutes not all it could
    # do, with the 35 s measured all of it.
    batch_gets = limit - session.command_cost(second[:-1], warm=True)
    assert session.stage_named("batch").expected_s <= batch_gets < session.batch_seconds()
    assert session.second_limit(first, session.MEASURED_START_S) - session.command_cost(second[:-1], warm=True) \
        >= session.batch_seconds()
    assert lines[len(ORDER) + 2].startswith("command 1: --stages doctor,tests,speed --limit 560 (420 s expected)")
    assert lines[len(ORDER) + 3].startswith(
        f"command 2, on the warm machine within 20 s: --stages steps,traces,batch --limit {limit} ")
    assert f"batch has {batch_gets} s for the {session.batch_seconds()} s" in lines[len(ORDER) + 3]
    assert "it stops where its time ends, keeping what it finished" in lines[len(ORDER) + 3]
    assert lines[len(ORDER) + 4] == "next window: nothing" and lines[-1] == "next window: nothing"
    assert "with a start of 35 s" in lines[len(ORDER) + 5] and "stops where" not in lines[-2]

    # A part of the stages, for what is left of a window: --plan --stages.
    assert session.main(["--plan", "--stages", "traces,batch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[len(ORDER) + 2].startswith("command 1: --stages traces,batch ")

    # No first command: no warm machine for a second, though the stage would fit one.
    first, second, later = session.window_plan([Stage("a", 500, "x", lambda out: [])])
    assert first == [] and second == [] and [s.name for s in later] == ["a"]
    too_long = [Stage("a", 540, "x", lambda out: []), Stage("b", 30, "x", lambda out: [])]
    assert session.main(["--plan"], stages=too_long) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "next window: a,b", out  # nothing runs past a stage no command can hold
    # A stage is planned by what it is expected to take, not its limit.
    cheap = [Stage("a", 400, "x", lambda out: [], cost_s=300), Stage("b", 400, "x", lambda out: [], cost_s=200)]
    first, second, later = session.window_plan(cheap)
    assert [s.name for s in first] == ["a", "b"] and later == []


def test_the_batch_stage_is_planned_as_its_lanes_take_the_searches():
    # In order, each lane taking the next job as soon as its own ends (the harness's search_all).
    assert session.lane_ends([3, 1, 1, 1], 2) == [3, 1, 2, 3]
    assert session.lane_ends([5, 5], 0) == [5, 10]
    ends = session.batch_searches()
    probes = session.BATCH_PROBES
    assert len(ends) == 15 and ends[:5] == [probes * session.PROBE_S["bert_infer"]] * 5
    assert session.batch_seconds() == max(ends) + session.BATCH_AROUND_S
    # Seven 16 GiB lanes on the H200: generate's long searches started second run beside the
    # others; in the registry's order they would start last and end later.
    registry = [probes * session.PROBE_S[w] for w in ("llm_train_bf16_ckpt", "bert_infer", "generate")
                for _ in range(5)]
    assert max(ends) < max(session.lane_ends(registry, session.H200_LANES))
    assert session.batch_seconds(lanes=100) == probes * session.PROBE_S["generate"] + session.BATCH_AROUND_S
    from benchmarks.gpu.__main__ import lanes_for

    assert lanes_for("auto", session.BATCH_BUDGET_GIB << 30, 150_109_880_320) == session.H200_LANES
    argv = session.stage_named("batch").steps("/out")[0].argv
    assert argv[argv.index("--parallel") + 1] == "auto"
    assert argv[argv.index("--only") + 1:argv.index("--only") + 4] == list(session.BATCH_WORKLOADS)
    assert argv[argv.index("--probe-steps") + 1] == str(session.BATCH_PROBE_STEPS)
    assert set(session.PROBE_S) == set(session.BATCH_WORKLOADS)


def test_a_command_starts_a_stage_that_is_expected_to_fit_and_stops_it_at_the_commands_end(tmp_path):
    sleepy = Stage("fill", 60, "takes what is left", lambda out: [Step("sleep", _py("import time; time.sleep(30)"))],
                   cost_s=1, fills=True)
    start = time.monotonic()
    ok = session.run_command([sleepy], str(tmp_path), limit_s=3, command="c", echo=False,
                             describe=lambda: ["device: none"], build=[Step("build", _py("pass"), needed=True)])
    assert time.monotonic() - start < 20
    log = _log(tmp_path, "fill")
    assert log[1].startswith("limit: 3 s (what is left of the command; the stage's own: 60 s)"), log[1]
    # A stage that takes what is left, stopped at the command's end, did what was planned:
    # not a failure, which would hide real ones.
    assert ok and log[-1] == "stage fill: STOPPED at the command's end, as planned", log
    assert "passed: sleep (stopped at the command's end, as planned: what it finished is kept)" in log
    # Another stage stopped there, or a filling one at its own limit, was killed.
    plain = Stage("plain", 60, "x", lambda out: [Step("sleep", _py("import time; time.sleep(30)"))], cost_s=1)
    assert not session.run_command([plain], str(tmp_path), limit_s=3, command="c", echo=False,
                                   describe=lambda: ["device: none"], build=[Step("build", _py("pass"), needed=True)])
    assert _log(tmp_path, "plain")[-1] == "stage plain: KILLED at its limit"
    short = Stage("short", 2, "x", lambda out: [Step("sleep", _py("import time; time.sleep(30)"))], fills=True)
    assert not session.run_stage(short, str(tmp_path), "c", echo=False, describe=lambda: ["device: none"])
    assert _log(tmp_path, "short")[-1] == "stage short: KILLED at its limit"
    # A stage expected to take more than is left does not start.
    late = Stage("late", 60, "x", lambda out: [Step("never", _py("pass"))], cost_s=10)
    assert not session.run_command([late], str(tmp_path), limit_s=3, command="c", echo=False,
                                   describe=lambda: ["device: none"], build=[Step("build", _py("pass"), needed=True)])
    assert "3 s of the command were left, and the stage is expected to take 10 s" in " ".join(_log(tmp_path, "late"))


def test_the_gpu_tests_take_each_route_and_strategy_side_by_side_then_alone(monkeypatch):
    monkeypatch.setattr(session, "xdist_available", lambda: True)  # as on the GPU machine
    steps = session.stage_named("tests").steps("unused")
    side, alone = steps[:4], steps[4:]
    envs = [{"PYALLOC_BRIDGE": "1"}, {"PYALLOC_BRIDGE": "0"},
            {"PYALLOC_BRIDGE": "1", "PYALLOC_CONF": "strategy:bestfit"},
            {"PYALLOC_BRIDGE": "0", "PYALLOC_CONF": "strategy:bestfit"}]
    assert [s.env for s in side] == envs and [s.env for s in alone] == envs
    assert all(s.pytest for s in steps)

    def marks(argv):  # pytest's -m, after python's own -m pytest
        return argv[len(argv) - argv[::-1].index("-m")]

    for s in side:
        assert s.together and "-n" in s.argv and marks(s.argv) == "gpu and not whole_device"
        # pytest-benchmark's warning under xdist is an error here (filterwarnings = error):
        # with the plugin loaded, pytest -n stopped before running a check (seen on CPU).
        assert s.argv[s.argv.index("no:benchmark") - 1] == "-p"
    for s in alone:
        assert not s.together and "-n" not in s.argv and marks(s.argv) == "gpu and whole_device"
    assert len({s.tag for s in side}) == 4
    # Each says which of its checks took the time: the tests are the window's longest stage.
    assert all(s.argv[s.argv.index("--durations") + 1] == "12" for s in steps)

    monkeypatch.setattr(session, "xdist_available", lambda: False)
    side = session.gpu_test_steps()[0]
    assert "-n" not in side.argv and marks(side.argv) == "gpu and not whole_device"
    assert side.label == "GPU tests that share the device, one worker: no pytest-xdist (bridge)"


def test_the_build_comes_first_with_every_core_and_the_bridge_only_where_a_stage_needs_it():
    steps = session.build_steps()
    assert steps[0].argv[1:] == ["setup.py", "build_ext", "--inplace"] and steps[0].needed
    assert int(steps[0].env["NPY_NUM_BUILD_JOBS"]) == (os.cpu_count() or 1)
    assert steps[1].argv[1:] == ["-m", "pyalloc", "bridge", "build"] and not steps[1].needed
    assert len(session.build_steps(bridge=False)) == 1
    assert not session.stage_named("traces").bridge and session.stage_named("tests").bridge


def test_the_checks_run_alone_are_those_that_need_the_whole_device():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu and whole_device", "tests/cuda/test_gpu.py"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    chosen = {line.split("::")[1] for line in out.stdout.splitlines() if "::" in line}
    assert {"test_oom_is_caught_and_recovered_from", "test_out_of_memory_is_torchs_error_with_observers_called_first",
            "test_torch_empty_cache_lowers_reserved_memory"} <= chosen, out.stdout + out.stderr
    assert "test_training_matches_the_native_allocator_bitwise" not in chosen


PYTEST_LIKE = r'''
print("tests/cuda/test_gpu.py::test_a PASSED")
print("=========================== short test summary info ============================")
print("SKIPPED [1] tests/cuda/test_gpu.py:140: skipped with one GPU")
print("FAILED tests/cuda/test_gpu.py::test_oom_is_caught_and_recovered_from - AssertionError: exited with -11")
print("============== 1 failed, 20 passed, 1 skipped in 42.00s ==============")
raise SystemExit(1)
'''


def test_a_stage_logs_its_environment_every_output_and_a_summary(tmp_path):
    stage = Stage("fake", 60, "three fake steps", lambda out: [
        Step("build", _py("print('compiled', flush=True)"), needed=True),
        Step("gpu tests", _py(PYTEST_LIKE), pytest=True),
        Step("benchmark", _py(f"open({str(tmp_path / 'out' / 'fake-result.json')!r}, 'w').write('{{}}')")),
    ])
    ok = run_stage(stage, str(tmp_path / "out"), command="python -m benchmarks.gpu.session --stage fake",
                   echo=False, describe=lambda: ["device: a fake GPU, 555.55, 81559 MiB", "commit: abc1234"])
    assert not ok
    lines = _log(tmp_path / "out", "fake")
    assert lines[:5] == ["== stage fake: three fake steps", "limit: 60 s",
                         "command: python -m benchmarks.gpu.session --stage fake",
                         "device: a fake GPU, 555.55, 81559 MiB", "commit: abc1234"], lines
    assert "compiled" in lines and "tests/cuda/test_gpu.py::test_a PASSED" in lines
    # The interpreter as the log names it: by a placeholder where it lies in a virtualenv.
    python = session.portable(sys.executable, session.machine_paths(str(tmp_path / "out")))
    assert any(line.startswith(f"$ {python} -c ") and "compiled" in line for line in lines), lines
    assert (tmp_path / "out" / "fake-result.json").exists()
    summary = lines[lines.index(next(x for x in lines if x.startswith("== summary of stage fake"))):]
    assert summary[1:] == [
        "passed: build; benchmark",
        "failed: gpu tests",
        "  gpu tests: exit 1 (1 failed, 20 passed, 1 skipped)",
        "  failed test: tests/cuda/test_gpu.py::test_oom_is_caught_and_recovered_from - AssertionError: exited with -11",
        "did not run: nothing",
        "  skipped test: tests/cuda/test_gpu.py:140: skipped with one GPU",
        "stage fake: FAILED",
    ], summary


def _stamp(path, name):
    """A step that appends its name to a file: the order the steps ran in."""
    return Step(name, _py(f"open({str(path)!r}, 'a').write({name!r} + '\\n'); print({name!r})"))


def test_one_command_builds_once_then_runs_each_stage_that_fits_in_order(tmp_path):
    ran = tmp_path / "ran"
    stages = [Stage("a", 30, "first", lambda out: [_stamp(ran, "a")]),
              Stage("huge", 500, "does not fit", lambda out: [_stamp(ran, "huge")]),
              Stage("b", 30, "fits after it", lambda out: [_stamp(ran, "b")], bridge=False)]
    out = tmp_path / "out"
    ok = session.run_command(stages, str(out), 100, echo=False, describe=lambda: ["commit: abc1234"],
                             build=[_stamp(ran, "build")])
    assert not ok  # a stage did not run
    assert ran.read_text().split() == ["build", "a", "b"]
    assert sorted(os.listdir(out)) == ["a.log", "b.log", "build.log", "huge.log"]
    for name in ("build", "a", "huge", "b"):
        assert _log(out, name)[3] == "commit: abc1234", name  # every log says where it ran
    huge = _log(out, "huge")
    assert huge[-4:-2] == ["passed: nothing", "failed: nothing"] and huge[-1] == "stage huge: NOT RUN", huge
    assert huge[-2].startswith("did not run: huge (") and huge[-2].endswith(
        " s of the command were left, and the stage is expected to take 500 s)"), huge
    assert _log(out, "b")[-1] == "stage b: PASSED"


def test_a_failed_build_of_pyalloc_stops_every_stage_and_a_failed_bridge_stops_none(tmp_path):
    ran = tmp_path / "ran"
    stages = [Stage("a", 30, "x", lambda out: [_stamp(ran, "a")])]
    broken = [Step("build pyalloc._C", _py("print('error: no compiler'); raise SystemExit(2)"), needed=True),
              _stamp(ran, "bridge")]
    assert not session.run_command(stages, str(tmp_path / "c"), 100, echo=False, describe=lambda: [],
                                   build=broken)
    assert not ran.exists()
    build = _log(tmp_path / "c", "build")
    assert build[-5:] == ["passed: nothing", "failed: build pyalloc._C",
                          "  build pyalloc._C: exit 2, its last line: error: no compiler",
                          "did not run: bridge ('build pyalloc._C' failed)", "stage build: FAILED"], build
    assert _log(tmp_path / "c", "a")[-2:] == ["did not run: a (building pyalloc._C failed or ran out of time)", "stage a: NOT RUN"]

    no_bridge = [_stamp(ran, "pyalloc"), Step("build the bridge", _py("raise SystemExit(1)"))]
    assert not session.run_command(stages, str(tmp_path / "b"), 100, echo=False, describe=lambda: [],
                                   build=no_bridge)
    assert ran.read_text().split() == ["pyalloc", "a"]
    assert _log(tmp_path / "b", "a")[-1] == "stage a: PASSED"


def test_steps_together_run_at_once_and_each_line_names_its_step(tmp_path):
    # Each waits until the other has started: run one after the other, both would time out.
    def waits_for(me, other):
        return (f"import os, time; open({str(tmp_path / me)!r}, 'w').close(); t = time.time()\n"
                f"while not os.path.exists({str(tmp_path / other)!r}):\n"
                f"    assert time.time() - t < 20, 'alone'; time.sleep(0.05)\n"
                f"print('saw {other}')")
    stage = Stage("pair", 60, "x", lambda out: [
        Step("left", _py(waits_for("l", "r")), together=True, tag="L"),
        Step("right", _py(waits_for("r", "l")), together=True, tag="R"),
        Step("after", _py("print('after both')")),
    ])
    assert run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    lines = _log(tmp_path, "pair")
    assert "[L] saw r" in lines and "[R] saw l" in lines and "after both" in lines
    assert lines.index("after both") > max(lines.index("[L] saw r"), lines.index("[R] saw l"))
    assert any(line.startswith("[L] -- passed: left") for line in lines)


def test_past_eight_files_the_results_go_into_one_archive_and_the_logs_stay(tmp_path):
    import tarfile

    for name in ["build.log", "bench.log", "bench.json", "bench.md"] + [f"p{i}.png" for i in range(4)]:
        (tmp_path / name).write_text(name)
    assert session.pack_results(str(tmp_path)) == []  # eight come back as they are
    (tmp_path / "tests.log").write_text("x")
    (tmp_path / "traces.tar.gz").write_bytes(b"already an archive")
    (tmp_path / "big.json").write_bytes(b"x" * (session.PACK_UP_TO + 1))  # stays a file of its own
    said = session.pack_results(str(tmp_path))
    assert said == ["more than 8 files: 6 results went into results.tar.gz"]
    assert sorted(os.listdir(tmp_path)) == ["bench.log", "big.json", "build.log", "results.tar.gz", "tests.log",
                                            "traces.tar.gz"]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["bench.json", "bench.md"] + [f"p{i}.png" for i in range(4)]
        assert tar.extractfile("bench.md").read() == b"bench.md"


def test_past_eight_files_of_logs_the_logs_are_packed_too_and_a_file_too_big_is_named(tmp_path, monkeypatch):
    import tarfile

    for name in [f"stage{i}.log" for i in range(9)] + ["r.json"]:
        (tmp_path / name).write_text(name)
    monkeypatch.setattr(session, "MAX_FILE_BYTES", 4)
    said = session.pack_results(str(tmp_path))
    assert said[0] == "still more than 8 files: the 9 logs went into logs.tar.gz"
    assert sorted(os.listdir(tmp_path)) == ["logs.tar.gz", "r.json"]
    assert said[1:] == ["logs.tar.gz is over 0 MiB: it will not come back from a GPU machine",
                        "r.json is over 0 MiB: it will not come back from a GPU machine"]
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert len(tar.getnames()) == 9


def test_a_stage_past_its_limit_is_killed_with_its_children_and_says_so(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The step starts a grandchild, as pytest -n or a benchmark worker would: both must die.
    hang = _starts_a_stubborn_child(pid_file, "started") + "; time.sleep(120)"
    stage = Stage("slow", 3, "hangs", lambda out: [Step("hangs", _py(hang)), Step("after", _py("print('x')"))])
    assert not run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    lines = _log(tmp_path, "slow")
    assert "started" in lines
    assert any(line.startswith("-- killed after ") and "the stage's limit was reached" in line for line in lines)
    assert lines[-5:] == ["passed: nothing", "failed: hangs", "  hangs: killed at the stage's limit",
                          "did not run: after (the stage's limit was reached)", "stage slow: KILLED at its limit"]
    _assert_gone(int(pid_file.read_text()))


def test_a_step_with_time_kept_for_the_next_is_killed_early_and_the_next_still_run(tmp_path):
    # The first H200 window lost every memory history it recorded: the recording ran to the
    # stage's limit and the archive step after it never ran.
    stage = Stage("kept", 4, "records, then archives", lambda out: [
        Step("records", _py("import time; time.sleep(120)"), reserve_s=2),
        Step("archives", _py("print('archived')"))])
    assert not run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    lines = _log(tmp_path, "kept")
    assert "archived" in lines
    assert any(line.startswith("-- killed after ") and "its limit (2 s of the stage's kept" in line for line in lines)
    assert "  records: killed at its limit (2 s of the stage's kept for the steps after it)" in lines
    assert "passed: archives" in lines


def test_the_traces_stage_keeps_time_for_its_replay_and_archive():
    steps = session.stage_named("traces").steps("/tmp/out")
    assert steps[0].reserve_s > 0 and [s.reserve_s for s in steps[1:]] == [0] * (len(steps) - 1)
    assert any("tar" in s.argv for s in steps[1:])


CHILD_SLEEP_S = 600  # how long a stubborn child would live if nothing killed it


def _starts_a_stubborn_child(pid_file, says):
    """Code that starts a child ignoring SIGTERM (as a wedged CUDA process may: SIGKILL
    must follow), writes its pid to pid_file and prints `says`."""
    return (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            f"signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep({CHILD_SLEEP_S})']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print({says!r}, flush=True)")


def _assert_gone(pid):
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # dead, not yet reaped (a container's first process may never reap it)
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    pytest.fail(f"the step's child {pid} outlived its step")


def test_a_child_a_step_leaves_behind_is_killed_when_the_step_ends(tmp_path):
    pid_file = tmp_path / "child.pid"
    leaves = _starts_a_stubborn_child(pid_file, "left it")
    stage = Stage("leaves", 60, "x", lambda out: [Step("leaves", _py(leaves)), Step("next", _py("print('next')"))])
    assert run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    lines = _log(tmp_path, "leaves")
    assert "next" in lines and lines[-1] == "stage leaves: PASSED"
    # The child held the output pipe and sleeps on: the step ended with its own process, not
    # when the child would have (its time, as the stage logged it, is well short of the sleep).
    took = [line for line in lines if line.startswith("-- passed: leaves (exit 0, ")]
    assert len(took) == 1 and int(took[0].rsplit(", ", 1)[1].split()[0]) < CHILD_SLEEP_S // 2, lines
    _assert_gone(int(pid_file.read_text()))


def test_a_stage_some_of_whose_steps_did_not_run_is_not_passed():
    stage = Stage("s", 10, "x", lambda out: [])
    ran = session.StepResult(Step("first", []), "passed")
    skipped = session.StepResult(Step("second", []), "not run", why="the stage's limit was reached")
    assert session.summary_lines(stage, [ran, skipped], 10)[-1] == "stage s: INCOMPLETE"
    assert session.summary_lines(stage, [skipped], 10)[-1] == "stage s: NOT RUN"
    assert session.summary_lines(stage, [ran], 10)[-1] == "stage s: PASSED"


def test_the_command_line_runs_named_stages_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session, "describe_machine", lambda: ["device: none"])
    monkeypatch.setattr(session, "build_steps", lambda bridge=True: [Step("build", _py("print('built')"))])
    stages = [Stage("one", 30, "x", lambda out: [Step("hello", _py("print('hello')"))]),
              Stage("two", 30, "y", lambda out: [Step("bye", _py("print('bye')"))])]
    assert session.main(["--stage", "one", "--out", str(tmp_path / "1")], stages=stages) == 0
    lines = _log(tmp_path / "1", "one")
    assert lines[3] == "device: none" and lines[-1] == "stage one: PASSED", lines
    assert sorted(os.listdir(tmp_path / "1")) == ["build.log", "one.log"]
    assert session.main(["--stages", "two,one", "--out", str(tmp_path / "2")], stages=stages) == 0
    assert "bye" in _log(tmp_path / "2", "two") and "hello" in _log(tmp_path / "2", "one")
    for bad in (["--stage", "three", "--out", str(tmp_path)], ["--stages", "one,three", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit):
            session.main(bad, stages=stages)
        assert "no stage 'three'; stages: one, two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session.main(["--all"], stages=stages)  # no --out


def test_the_log_names_device_driver_torch_date_and_commit(monkeypatch):
    monkeypatch.setenv("PYALLOC_GIT_COMMIT", "abc1234")  # a GPU machine's copy has no .git
    lines = session.describe_machine()
    assert [line.split(":")[0] for line in lines] == ["device", "torch", "date", "commit", "python"], lines
    assert lines[0].endswith("(name, driver, memory)") and lines[3] == "commit: abc1234"
    torch = pytest.importorskip("torch")
    assert lines[1].startswith(f"torch: {torch.__version__} CUDA "), lines


def test_the_replay_is_put_beside_the_live_runs(tmp_path, capsys):
    import json

    GiB = 1 << 30
    # Recorded in one folder, replayed from another: matched by file name.
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    live = {"workloads": {"llm_train": {"traces": {
        "native": {"path": str(recorded / "llm_train-nvidia-h100.pickle"),
                   "live": {"peak_reserved": 20 * GiB, "num_device_alloc": 31}},
        "native_expandable": {"path": str(recorded / "llm_train-native_expandable-nvidia-h100.pickle"),
                              "live": {"peak_reserved": 16 * GiB, "num_device_alloc": 90}}}}}}
    replay = [{"trace": str(replayed / "llm_train-nvidia-h100.pickle"),
               "native_peak_reserved_bytes": 19 * GiB, "pyalloc_peak_reserved_bytes": 15 * GiB,
               "device_allocs": 12, "device_frees": 3}]
    (tmp_path / "traces.json").write_text(json.dumps(live))
    (tmp_path / "traces-replay.json").write_text(json.dumps(replay))
    assert session.main(["--compare-traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["llm_train", "native", "20.00,", "31", "|", "19.00", "(0.950)", "|", "15.00,", "15"]
    assert lines[2].split()[:5] == ["llm_train", "native_expandable", "16.00,", "90", "|"]
    assert lines[2].endswith("| no replay of this trace")


def test_the_readme_shows_the_plan_as_it_is():
    with open(os.path.join(REPO, "benchmarks", "gpu", "README.md")) as f:
        rows = [line.split("|") for line in f if line.startswith("| `")]
    table = {cells[1].strip().strip("`"): (cells[2].strip(), cells[3].strip()) for cells in rows if len(cells) > 4}
    assert [(s.name, table.get(s.name)) for s in session.STAGES] == \
        [(s.name, (f"{s.expected_s}{'+' if s.fills else ''}", str(s.limit_s))) for s in session.STAGES]
    # The prose's figures are the plan's.
    with open(os.path.join(REPO, "benchmarks", "gpu", "README.md")) as f:
        text = " ".join(f.read().split())
    first, second, _ = session.window_plan([s for s in session.STAGES if s.in_window])
    limit = session.second_limit(first)
    assert f'--stages steps,traces,batch --out "$OUT" --limit {limit} ' in text
    assert f"({session.command_cost(first)} s expected) and command 2 `steps`, `traces` and `batch` ({limit} s " in text
    assert f"all are expected to take {session.batch_seconds()} s" in text
    gets = limit - session.command_cost(second[:-1], warm=True)
    done = sum(1 for end in session.batch_searches() if end + session.BATCH_AROUND_S <= gets)
    assert f"start the stage has {gets} s, enough for {done} of the 15 searches" in text
    measured = session.second_limit(first, session.MEASURED_START_S) - session.command_cost(second[:-1], warm=True)
    assert f"with a {session.MEASURED_START_S} s start {measured} s, enough for all" in text
    assert f"and {session.WARM_BUILD_S} s on a warm one" in text
    assert f"a start of {session.START_S} s" in text and f"started in {session.MEASURED_START_S} s" in text


def test_the_speed_stage_starts_no_round_too_late_for_its_limit():
    """alloc_speed runs one process per allocator in each round; the stage must end
    within its limit however long a process takes, so the harness starts no round
    that would end past --rounds-within."""
    stage = session.stage_named("speed")
    argv = stage.steps("/out")[0].argv
    within = float(argv[argv.index("--rounds-within") + 1])
    # Around the rounds: the session's start, the device-information worker and the
    # tables at the end, 15-16 s on the H200 at 4ec56a2; 25 s kept for them.
    assert within + 25 <= stage.limit_s


def test_the_speed_stage_runs_the_rounds_the_harness_plans_for_quick():
    """The number of alloc_speed rounds is the harness's (workloads.SPEED_ROUNDS, by
    mode): the stage runs --quick and names no count of its own that could drift."""
    from benchmarks.gpu.workloads import SPEED_ROUNDS

    argv = session.stage_named("speed").steps("/out")[0].argv
    assert "--quick" in argv and "--rounds" not in argv
    assert not hasattr(session, "SPEED_ROUNDS")
    assert SPEED_ROUNDS["quick"] >= 1

def test_a_log_names_this_machines_folders_by_placeholders(tmp_path, monkeypatch):
    """The logs are committed: the checkout, the output folder, the virtualenv and the
    home folder of the machine that ran them are named by placeholders, system paths
    (a compiler) as they are."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    said = [os.path.join(REPO, "pyalloc", "_C.so"), str(out / "speed.json"), os.path.join(sys.prefix, "bin", "python3"),
            str(tmp_path / "home" / ".cache" / "pyalloc"), "/usr/bin/g++", REPO + "-other/x"]
    stage = Stage("paths", 60, "prints paths", lambda o: [Step("prints", _py(f"print({' '.join(said)!r})"))])
    assert run_stage(stage, str(out), echo=False, describe=lambda: [])
    line = next(line for line in _log(out, "paths") if line.startswith("<checkout>"))
    venv = "<venv>" if sys.prefix != sys.base_prefix else sys.prefix
    words = line.split()
    assert words[:5] == ["<checkout>/pyalloc/_C.so", "$OUT/speed.json", f"{venv}/bin/python3",
                         "~/.cache/pyalloc", "/usr/bin/g++"], line
    # A folder beside the checkout whose name begins with the checkout's is not the checkout
    # (in a checkout under the temporary folder it is named as lying there).
    assert not words[5].startswith("<checkout>") and words[5].endswith(os.path.basename(REPO) + "-other/x"), line


def test_a_results_command_names_the_script_from_the_checkout(monkeypatch):
    from benchmarks import _env

    monkeypatch.setattr(sys, "argv", [os.path.join(REPO, "benchmarks", "gpu", "__main__.py"), "--quick"])
    assert _env.environment()["command"] == f"{os.path.basename(sys.executable)} benchmarks/gpu/__main__.py --quick"
    monkeypatch.setattr(sys, "argv", ["-c", "--quick"])
    assert _env.environment()["command"].endswith(" -c --quick")
