"""``pyalloc run``: argument handling, errors, and running the program as __main__."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from pyalloc import __main__ as cli
from pyalloc import cuda as api

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT = (
    "import json, sys\n"
    "print(json.dumps({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0]}))\n"
)


def pyalloc_cli(*args, env_conf=None, cwd=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("PYALLOC_CONF", None)
    if env_conf is not None:
        env["PYALLOC_CONF"] = env_conf
    return subprocess.run([sys.executable, "-m", "pyalloc", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def _cpu_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is None


def test_help():
    out = pyalloc_cli("run", "--help")
    assert out.returncode == 0
    for words in ("script.py", "-m module", "--conf", "PYALLOC_CONF", "--no-patch-torch"):
        assert words in out.stdout


@pytest.mark.skipif(not _cpu_torch(), reason="needs the CPU build of torch")
def test_without_a_gpu_the_program_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    out = pyalloc_cli("run", str(script), "--epochs", "1")
    assert out.returncode == 1
    assert out.stderr.startswith("pyalloc run: error: ")
    assert "CPU-only" in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "args, words",
    [
        ((), "name a script"),
        (("no_such_script.py",), "no such file"),
        (("--conf", "bogus:1", "x.py"), "unknown config key 'bogus'"),
    ],
)
def test_usage_errors(args, words, tmp_path):
    (tmp_path / "x.py").write_text("")
    out = pyalloc_cli("run", *args, cwd=tmp_path)
    assert out.returncode == 1
    assert words in out.stderr


def test_bad_pyalloc_conf_is_named(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("")
    out = pyalloc_cli("run", str(script), env_conf="pool_size:huge")
    assert out.returncode == 1
    assert "PYALLOC_CONF='pool_size:huge'" in out.stderr


# -- running the program (install() replaced: it needs a GPU) -----------------------------


@pytest.fixture
def launched(monkeypatch):
    """Records install() calls instead of swapping torch's allocator."""
    class Calls(list):
        bridge: list  # what each call asked of the bridge

    calls = Calls()
    calls.bridge = []

    def install(conf=None, bridge=None, patch_torch=True):
        calls.append((conf, patch_torch))
        calls.bridge.append(bridge)

    monkeypatch.setattr(api, "install", install)
    # The launcher makes this process's spawn children install pyalloc: undone after.
    import multiprocessing.spawn

    monkeypatch.setattr(multiprocessing.spawn, "get_preparation_data",
                        multiprocessing.spawn.get_preparation_data)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYALLOC_CONF", raising=False)
    return calls


def test_script_runs_as_main_with_its_own_arguments(launched, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYALLOC_CONF", "segment_size:4MiB")
    script = tmp_path / "train.py"
    script.write_text(REPORT)
    # Options after the script belong to the script, pyalloc's own included.
    rc = cli.main(["run", "--conf", "pool_size:1GiB", str(script), "--lr", "0.1", "--conf", "-m", "x"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "name": "__main__",
        "argv": [str(script), "--lr", "0.1", "--conf", "-m", "x"],
        "path0": str(tmp_path),
    }
    assert launched == [("pool_size:1GiB", True)]
    # The program and the processes it starts see the effective settings.
    assert os.environ["PYALLOC_CONF"] == "segment_size:4MiB,pool_size:1GiB"


def test_module_runs_as_main(launched, tmp_path, capsys, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(REPORT)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["run", "--no-patch-torch", "-m", "mypkg.train", "a", "--b", "-m", "c"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["name"] == "__main__"
    assert report["argv"][0].endswith(os.path.join("mypkg", "train.py"))
    assert report["argv"][1:] == ["a", "--b", "-m", "c"]
    assert report["path0"] == str(tmp_path)
    assert launched == [(None, False)]


def test_the_programs_exit_status_is_the_processes(launched, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(script)])
    assert e.value.code == 3


def test_install_errors_stop_the_launch(monkeypatch, tmp_path, capsys):
    def refuse(conf=None, bridge=None, patch_torch=True):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(api, "install", refuse)
    script = tmp_path / "x.py"
    script.write_text("raise AssertionError('must not run')\n")
    assert cli.main(["run", str(script)]) == 1
    assert capsys.readouterr().err == "pyalloc run: error: no GPU here\n"


def test_no_bridge_asks_for_the_hooks_route(launched, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert cli.main(["run", str(script)]) == 0
    assert cli.main(["run", "--no-bridge", str(script)]) == 0
    assert launched.bridge == [None, False]


# -- the program sees what `python script.py` gives it -----------------------------------

SEES = (
    "import json, os, sys\n"
    "print(json.dumps({'file': __file__, 'argv0': sys.argv[0], 'path0': sys.path[0],\n"
    "                  'listdir': sorted(os.listdir(os.path.dirname(__file__)))}))\n"
)


def what_python_gives(script, cwd):
    """What `python script.py` shows the script (a child, run in ``cwd``)."""
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=cwd,
                         check=True, timeout=60)
    return json.loads(out.stdout)


def _linked_script(tmp_path):
    """A relative path through a symbolic link, to a script in another folder."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "sees.py").write_text(SEES)
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "sees.py")
    return "link.py"


def test_regression_the_script_sees_what_python_gives_it(launched, tmp_path, capsys, monkeypatch):
    # Regression: __file__ was the path as typed (relative: os.listdir(os.path.dirname(__file__))
    # failed), where python makes it absolute.
    script = _linked_script(tmp_path)
    want = what_python_gives(script, tmp_path)
    monkeypatch.chdir(tmp_path)
    path_length = len(sys.path)
    assert cli.main(["run", script]) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert want["file"] == str(tmp_path / "link.py") and want["argv0"] == "link.py"
    assert want["path0"] == str(tmp_path / "real")
    assert len(sys.path) == path_length  # replaced the command's own first entry, as python has none


def test_record_and_run_give_the_program_the_same_view(launched, tmp_path, capsys, monkeypatch):
    # Regression: record inserted the script's folder before the command's own first
    # entry (pyalloc's bin folder, or the working folder of python -m pyalloc), run replaced it.
    from pyalloc.record import run_program

    script = _linked_script(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    sys.path[0] = "/the/pyalloc/commands/own/entry"
    assert run_program(["python", script]) == 0
    recorded = capsys.readouterr().out
    assert sys.path[0] == "/the/pyalloc/commands/own/entry"  # record gives the process back as it was
    probe = ("import json, sys\nprint(json.dumps(sys.path))\n")
    (tmp_path / "real" / "probe.py").write_text(probe)
    assert run_program(["python", "real/probe.py"]) == 0
    seen_by_record = json.loads(capsys.readouterr().out)
    assert cli.main(["run", "real/probe.py"]) == 0
    seen_by_run = json.loads(capsys.readouterr().out)
    assert seen_by_record == seen_by_run == [str(tmp_path / "real")] + before[1:]
    assert json.loads(recorded) == what_python_gives(script, tmp_path)


# -- the processes the program starts ------------------------------------------------------
# install() needs a GPU: every interpreter of these runs stands it in, from a
# sitecustomize on PYTHONPATH that only the test adds, logging which process called it.

STUB_INSTALL = """
import json, os
try:
    from pyalloc import cuda
except ImportError:
    cuda = None
if cuda is not None:
    def install(conf=None, *, bridge=None, patch_torch=True, **config):
        if os.environ.get("REFUSE_IN_CHILDREN") and os.path.exists(os.environ["INSTALL_LOG"]):
            raise RuntimeError("no GPU in this child")  # the launcher, first, logged its call
        with open(os.environ["INSTALL_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "conf": conf, "bridge": bridge,
                                "patch_torch": patch_torch}) + "\\n")
        cuda._state.route = "hooks"
    cuda.install = install
"""

CHILDREN = """
import json, multiprocessing as mp, os, sys
from pyalloc import cuda

AT_IMPORT = cuda._state.route  # a spawn child imports this file again: installed by then?

def report(q):
    q.put({"pid": os.getpid(), "at_import": AT_IMPORT, "route": cuda._state.route,
           "conf": os.environ.get("PYALLOC_CONF")})

def torch_worker(rank, q):
    report(q)

def grandchild(q):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=report, args=(q,))
    p.start()
    p.join()

if __name__ == "__main__":
    out = {"parent": os.getpid()}
    for method in ("spawn", "forkserver", "fork"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=report, args=(q,))
        p.start()
        out[method] = q.get(timeout=120)
        p.join()
    if "torch" in sys.argv:
        import torch.multiprocessing
        q = mp.get_context("spawn").SimpleQueue()
        torch.multiprocessing.spawn(torch_worker, args=(q,), nprocs=1)
        out["torch.multiprocessing.spawn"] = q.get()
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=grandchild, args=(q,))
    p.start()
    out["spawn's spawn"] = q.get(timeout=120)
    p.join()
    print(json.dumps(out))
"""


def _run_children(tmp_path, *args, refuse_in_children=False):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(STUB_INSTALL)
    (tmp_path / "children.py").write_text(CHILDREN)
    log = tmp_path / "install.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), REPO]), INSTALL_LOG=str(log),
               PYALLOC_CONF="pool_size:1GiB")
    if refuse_in_children:
        env["REFUSE_IN_CHILDREN"] = "1"
    launcher = subprocess.Popen([sys.executable, "-m", "pyalloc", "run", "--conf", "segment_size:4MiB",
                                 "children.py", *args], cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return json.loads(out.splitlines()[-1]), calls, err


@pytest.mark.slow
def test_regression_spawn_and_forkserver_children_install_pyalloc_and_fork_children_inherit_it(tmp_path):
    # Regression: only PYALLOC_CONF reached a spawn child, which ran PyTorch's own allocator.
    torch_args = ("torch",) if importlib.util.find_spec("torch") else ()
    out, calls, err = _run_children(tmp_path, *torch_args)
    settings = "pool_size:1GiB,segment_size:4MiB"
    by_pid = {c["pid"]: c for c in calls}
    assert by_pid[out["parent"]] == {"pid": out["parent"], "conf": "segment_size:4MiB", "bridge": None,
                                     "patch_torch": True}
    started = ["spawn", "forkserver", "spawn's spawn"] + ["torch.multiprocessing.spawn"] * bool(torch_args)
    for method in started:
        child = out[method]
        # Installed with the parent's settings and route, before the program's main file was imported again.
        assert by_pid.get(child["pid"]) == {"pid": child["pid"], "conf": settings, "bridge": False,
                                            "patch_torch": True}, (method, calls)
        assert child["at_import"] == child["route"] == "hooks", (method, child)
    fork = out["fork"]
    assert fork["pid"] not in by_pid and fork["route"] == "hooks", "a fork child inherits, and installs nothing"
    assert len(calls) == 1 + len(started) + 1  # the grandchild's parent, a spawn child too
    assert all(out[m]["conf"] == settings for m in started + ["fork"])


@pytest.mark.slow
def test_a_child_where_install_fails_says_so(tmp_path):
    out, calls, err = _run_children(tmp_path, refuse_in_children=True)
    for method in ("spawn", "forkserver"):
        pid = out[method]["pid"]
        assert (f"pyalloc: WARNING: process {pid}, started by multiprocessing, runs PyTorch's own CUDA "
                "allocator, not pyalloc: no GPU in this child") in err, err
        assert out[method]["route"] is None


# install() runs for real in every interpreter of this one, with only what needs a GPU
# stood in: a CUDA build of torch, a GPU that torch sees, the swap of torch's allocator
# (a CPU torch has none), and the driver checks, which log the process that asked.
STUB_GPU = """
import json, os
try:
    import torch
    from pyalloc import _C, cuda
except ImportError:
    cuda = None
if cuda is not None:
    def logged(what, result):
        def call(*args, **kwargs):
            with open(os.environ["DRIVER_LOG"], "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "what": what}) + "\\n")
            return result
        return call
    torch.version.cuda = "13.0"
    torch.cuda.is_available = logged("torch.cuda.is_available", True)
    torch.cuda.device_count = logged("torch.cuda.device_count", 1)
    torch.cuda.init = logged("torch.cuda.init", None)
    _C.cuda_check_driver = logged("cuInit (_C.cuda_check_driver)", 13000)
    _C.cuda_device_count = logged("cuInit (_C.cuda_device_count)", 1)
    cuda._install_hooks = lambda torch: None
"""

RANKS = """
import json, multiprocessing as mp, os

def driver_calls():
    with open(os.environ["DRIVER_LOG"]) as f:
        return [c["what"] for c in map(json.loads, f) if c["pid"] == os.getpid()]

def worker(rank, q):
    # What a per-rank program does first: choose its GPU, before any CUDA work.
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    from pyalloc import cuda
    q.put({"pid": os.getpid(), "driver_before_target": driver_calls(), "route": cuda._state.route})

if __name__ == "__main__":
    import torch.multiprocessing
    out = {"parent": driver_calls()}
    for method in ("spawn", "forkserver"):
        q = mp.get_context(method).SimpleQueue()
        torch.multiprocessing.start_processes(worker, args=(q,), nprocs=2, start_method=method)
        out[method] = [q.get(), q.get()]
    print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_regression_children_leave_the_driver_to_their_target_and_say_the_notes_once(tmp_path):
    # Regression: a spawn or forkserver child's install ran torch.cuda.is_available() and cuInit
    # before its target, so CUDA_VISIBLE_DEVICES set there was never read; and each child named
    # the PYTORCH_ALLOC_CONF keys not applied again.
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(STUB_GPU)
    (tmp_path / "ranks.py").write_text(RANKS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), REPO]),
               DRIVER_LOG=str(tmp_path / "driver.log"), PYTORCH_ALLOC_CONF="garbage_collection_threshold:0.6")
    for name in ("PYALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYALLOC_BRIDGE"):
        env.pop(name, None)
    (tmp_path / "driver.log").write_text("")
    out = subprocess.run([sys.executable, "-m", "pyalloc", "run", "--no-bridge", "ranks.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert "cuInit (_C.cuda_check_driver)" in seen["parent"]  # the program's own process checks up front
    for method in ("spawn", "forkserver"):
        for child in seen[method]:
            assert child["route"] == "hooks", (method, child, out.stderr)
            assert child["driver_before_target"] == [], (method, child)
    assert out.stderr.count("garbage_collection_threshold:0.6 is not applied") == 1, out.stderr
