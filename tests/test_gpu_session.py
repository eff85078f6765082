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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["doctor", "tests-bridge", "tests-hooks", "tests-bestfit", "bench", "traces", "batch"]


def _py(code):
    return [sys.executable, "-c", code]


def _log(out, name):
    return (out / f"{name}.log").read_text().splitlines()


def test_the_plan_lists_every_stage_in_order_and_fits_the_window(capsys):
    assert session.main(["--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ORDER
    for line, stage in zip(lines, session.STAGES):
        assert line.split()[1:3] == [str(stage.limit_s), "s"] and stage.what in line
        assert stage.limit_s <= 540
    assert sum(s.limit_s for s in session.STAGES) <= 1500
    assert lines[-1].split()[:3] == ["total", str(sum(s.limit_s for s in session.STAGES)), "s"]
    assert lines[-1].endswith("fits)")

    too_long = [Stage("a", 540, "x", lambda out: []), Stage("b", 540, "x", lambda out: []),
                Stage("c", 540, "x", lambda out: [])]
    assert session.main(["--plan"], stages=too_long) == 1
    assert capsys.readouterr().out.splitlines()[-1].endswith("DOES NOT FIT)")


def test_every_stage_builds_first_and_the_gpu_tests_take_their_route_and_strategy(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "xdist_available", lambda: True)  # as on the GPU machine
    for stage in session.STAGES:
        steps = stage.steps(str(tmp_path))
        assert steps[0].argv[1:] == ["setup.py", "build_ext", "--inplace"] and steps[0].needed, stage.name
        assert int(steps[0].env["NPY_NUM_BUILD_JOBS"]) == (os.cpu_count() or 1)
    tests = {name: [s for s in session.stage_named(name).steps(str(tmp_path)) if s.pytest]
             for name in ("tests-bridge", "tests-hooks", "tests-bestfit")}
    assert [s.env for s in tests["tests-bridge"]] == [{"PYALLOC_BRIDGE": "1"}] * 2
    assert [s.env for s in tests["tests-hooks"]] == [{"PYALLOC_BRIDGE": "0"}] * 2
    assert [s.env["PYALLOC_BRIDGE"] for s in tests["tests-bestfit"]] == ["1", "1", "0", "0"]
    assert {s.env["PYALLOC_CONF"] for s in tests["tests-bestfit"]} == {"strategy:bestfit"}
    def marks(argv):  # pytest's -m, after python's own -m pytest
        return argv[len(argv) - argv[::-1].index("-m")]

    for steps in tests.values():
        side, alone = steps[0].argv, steps[1].argv
        assert "-n" in side and marks(side) == "gpu and not whole_device"
        assert "-n" not in alone and marks(alone) == "gpu and whole_device"

    monkeypatch.setattr(session, "xdist_available", lambda: False)
    side = session.gpu_test_steps("bridge")[0]
    assert "-n" not in side.argv and marks(side.argv) == "gpu and not whole_device"
    assert side.label == "GPU tests that share the device, one at a time: no pytest-xdist (bridge)"


def test_the_checks_run_alone_are_those_that_need_the_whole_device():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "gpu and whole_device", "tests/test_gpu.py"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    chosen = {line.split("::")[1] for line in out.stdout.splitlines() if "::" in line}
    assert {"test_oom_is_caught_and_recovered_from", "test_out_of_memory_is_torchs_error_with_observers_called_first",
            "test_torch_empty_cache_lowers_reserved_memory"} <= chosen, out.stdout + out.stderr
    assert "test_training_matches_the_native_allocator_bitwise" not in chosen


PYTEST_LIKE = r'''
print("tests/test_gpu.py::test_a PASSED")
print("=========================== short test summary info ============================")
print("SKIPPED [1] tests/test_gpu.py:140: skipped with one GPU")
print("FAILED tests/test_gpu.py::test_oom_is_caught_and_recovered_from - AssertionError: exited with -11")
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
    assert "compiled" in lines and "tests/test_gpu.py::test_a PASSED" in lines
    assert any(line.startswith(f"$ {sys.executable} -c ") and "compiled" in line for line in lines), lines
    assert (tmp_path / "out" / "fake-result.json").exists()
    summary = lines[lines.index(next(x for x in lines if x.startswith("== summary of stage fake"))):]
    assert summary[1:] == [
        "passed: build; benchmark",
        "failed: gpu tests",
        "  gpu tests: exit 1 (1 failed, 20 passed, 1 skipped)",
        "  failed test: tests/test_gpu.py::test_oom_is_caught_and_recovered_from - AssertionError: exited with -11",
        "did not run: nothing",
        "  skipped test: tests/test_gpu.py:140: skipped with one GPU",
        "stage fake: FAILED",
    ], summary


def test_a_failed_build_stops_the_stage_and_the_rest_did_not_run(tmp_path):
    stage = Stage("broken", 60, "x", lambda out: [
        Step("build pyalloc._C", _py("print('error: no compiler'); raise SystemExit(2)"), needed=True),
        Step("tests", _py("print('never')")),
    ])
    assert not run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    lines = _log(tmp_path, "broken")
    assert "never" not in lines
    assert lines[-5:] == ["passed: nothing", "failed: build pyalloc._C",
                          "  build pyalloc._C: exit 2, its last line: error: no compiler",
                          "did not run: tests ('build pyalloc._C' failed)", "stage broken: FAILED"], lines


def test_a_stage_past_its_limit_is_killed_with_its_children_and_says_so(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The step starts a grandchild, as pytest -n or a benchmark worker would: both must die.
    hang = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(120)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); "
            "time.sleep(120)")
    stage = Stage("slow", 3, "hangs", lambda out: [Step("hangs", _py(hang)), Step("after", _py("print('x')"))])
    start = time.monotonic()
    assert not run_stage(stage, str(tmp_path), echo=False, describe=lambda: [])
    assert time.monotonic() - start < 30
    lines = _log(tmp_path, "slow")
    assert "started" in lines
    assert any(line.startswith("-- killed after ") and "the stage's limit was reached" in line for line in lines)
    assert lines[-5:] == ["passed: nothing", "failed: hangs", "  hangs: killed at the stage's limit",
                          "did not run: after (the stage's limit was reached)", "stage slow: KILLED at its limit"]
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {grandchild} outlived the stage")


def test_the_command_line_runs_a_named_stage_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session, "describe_machine", lambda: ["device: none"])
    stages = [Stage("one", 30, "x", lambda out: [Step("hello", _py("print('hello')"))])]
    monkeypatch.setattr(session, "STAGES", stages)
    assert session.main(["--stage", "one", "--out", str(tmp_path)], stages=stages) == 0
    lines = _log(tmp_path, "one")
    assert lines[3] == "device: none" and lines[-1] == "stage one: PASSED", lines
    with pytest.raises(SystemExit):
        session.main(["--stage", "two", "--out", str(tmp_path)], stages=stages)
    assert "no stage 'two'; stages: one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        session.main(["--all"], stages=stages)


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
    table = {cells[1].strip().strip("`"): cells[2].strip() for cells in rows if len(cells) > 3}
    assert [(s.name, table.get(s.name)) for s in session.STAGES] == \
        [(s.name, str(s.limit_s)) for s in session.STAGES]
