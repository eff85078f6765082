"""Recording: running a program in-process, the CPU profiler's memory events as
a snapshot, the GPU path's wiring, and the command line."""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyalloc
from pyalloc import record
from pyalloc.record import RecordError, parse_command, record_program, run_program
from pyalloc.replay import replay
from pyalloc.replay.snapshot_io import load_snapshot, write_snapshot

ROOT = Path(__file__).resolve().parents[2]


def script(tmp_path, body, name="prog.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--", "python", "a.py", "x"], ("path", "a.py", ["x"])),
        (["python3.11", "-u", "-X", "dev", "a.py"], ("path", "a.py", [])),
        (["/usr/bin/python", "-m", "pkg.mod", "-v"], ("module", "pkg.mod", ["-v"])),
        (["a.py", "--flag"], ("path", "a.py", ["--flag"])),
    ],
)
def test_parse_command(argv, want):
    assert parse_command(argv) == want


@pytest.mark.parametrize(
    "argv, match",
    [([], "no program"), (["--"], "no program"), (["bash", "x.sh"], "only Python programs"),
     (["python", "-c", "print(1)"], "python -c runs code"), (["python"], "expected")],
)
def test_parse_command_refuses(argv, match):
    with pytest.raises(RecordError, match=match):
        parse_command(argv)


def test_run_program_runs_as_main_with_its_argv(tmp_path):
    out = tmp_path / "out.txt"
    path = script(tmp_path, f"""
        import sys
        if __name__ == "__main__":
            with open({str(out)!r}, "w") as f:
                f.write(" ".join(sys.argv[1:]))
            sys.exit(3)
    """)
    argv_before = sys.argv[:]
    assert run_program(["python", path, "a", "b"]) == 3
    assert out.read_text() == "a b"
    assert sys.argv == argv_before


def test_run_program_reports_an_exception_as_status_1(tmp_path, capsys):
    path = script(tmp_path, "raise KeyError('boom')\n")
    assert run_program([path]) == 1
    assert "KeyError" in capsys.readouterr().err


def test_cpu_recording_sees_each_request_with_its_size(tmp_path):
    torch = pytest.importorskip("torch")

    def work():
        keep = torch.empty(1000, dtype=torch.float32)   # 4000 bytes, live at the end
        tmp = torch.empty(3000, dtype=torch.uint8)      # 3000 bytes, freed
        del tmp
        return keep

    keep, snapshot = record.record_cpu(work)
    events = snapshot["device_traces"][0]
    sizes = [(e["action"], e["size"]) for e in events]
    assert ("alloc", 4000) in sizes and ("alloc", 3000) in sizes
    assert ("free_requested", 3000) in sizes and ("free_completed", 3000) in sizes
    assert all(e["stream"] == 0 and e["frames"] == [] for e in events)
    assert [e["time_us"] for e in events] == sorted(e["time_us"] for e in events)
    assert snapshot["segments"] == [] and snapshot["pyalloc_source"]["torch"] == str(torch.__version__)
    path = tmp_path / "t.pickle"
    write_snapshot(snapshot, path)  # only plain data: the safe loader takes it back
    r = replay(load_snapshot(path))
    assert r.peak_live_bytes >= 7000 and r.missed_frees == 0
    del keep


def test_gpu_recording_uses_pyalloc_history(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pyalloc, "install", lambda: calls.append("install"), raising=False)
    monkeypatch.setattr(pyalloc, "record_history", lambda on, n: calls.append(("history", on, n)), raising=False)

    def dump(path):
        calls.append("dump")
        write_snapshot({"segments": [], "device_traces": [[]]}, path)

    monkeypatch.setattr(pyalloc, "dump_snapshot", dump, raising=False)
    prog = script(tmp_path, "import sys; sys.exit(0)\n")
    for name in ("g.pickle", "g.pickle.gz"):
        out = str(tmp_path / name)
        assert record_program(["python", prog], out, device="cuda") == 0
        assert load_snapshot(out) == {"segments": [], "device_traces": [[]]}
    assert calls[:3] == ["install", ("history", True, 100_000), "dump"]


def test_gpu_recording_without_the_hooks_says_so(tmp_path, monkeypatch):
    for name in ("install", "record_history", "dump_snapshot"):
        monkeypatch.delattr(pyalloc, name, raising=False)
    prog = script(tmp_path, "pass\n")
    with pytest.raises(RecordError, match="--device cpu"):
        record_program(["python", prog], str(tmp_path / "x.pickle"), device="cuda")


def cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pyalloc", "record", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_cli_records_a_script_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    prog = script(tmp_path, """
        import sys
        import torch
        xs = [torch.zeros(int(n)) for n in sys.argv[1:]]
        del xs
        sys.exit(5)
    """)
    out = tmp_path / "t.pickle.gz"
    p = cli("-o", out, "--device", "cpu", "--", "python", prog, "1024", "4096")
    assert p.returncode == 5, p.stderr
    assert f"wrote {out}" in p.stderr
    snapshot = load_snapshot(out)
    assert snapshot["pyalloc_source"]["command"] == ["python", prog, "1024", "4096"]
    sizes = [e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert 4096 in sizes and 16384 in sizes
    r = replay(out)
    assert r.peak_live_bytes >= 4096 + 16384


def test_cli_refuses_a_program_it_cannot_run(tmp_path):
    p = cli("-o", tmp_path / "x.pickle", "--", "bash", "-c", "true")
    assert p.returncode == 2
    assert p.stderr.strip().startswith("pyalloc record: error: only Python programs")
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "x.pickle").exists()


def test_regression_record_on_cuda_where_install_refuses_is_an_error_line(tmp_path, monkeypatch, capsys):
    # Regression: install()'s RuntimeError (no GPU, a CPU-only torch) ended in a traceback.
    from pyalloc.__main__ import main

    def refuse():
        raise RuntimeError("pyalloc.install() found no usable CUDA GPU")

    monkeypatch.setattr(pyalloc, "install", refuse)
    prog = script(tmp_path, "raise AssertionError('must not run')\n")
    assert main(["record", "-o", str(tmp_path / "x.pickle"), "--device", "cuda", "--", "python", prog]) == 2
    assert capsys.readouterr().err == ("pyalloc record: error: pyalloc.install() found no usable CUDA GPU; "
                                       "record on the CPU with --device cpu\n")


HOOK_WORK = """
import ctypes, sys
from pyalloc import _C
lib = ctypes.CDLL(_C.library_path())
lib.pyalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
for _ in range(int(sys.argv[1])):
    lib.pyalloc_free(_C._testing_hook_malloc(4096, 0, 0), 0, 0, None)
"""


@pytest.mark.parametrize("history, wrapped", [(8, True), (1000, False)])
def test_record_keeps_as_many_history_entries_as_asked_and_says_when_it_wrapped(
        fake, tmp_path, monkeypatch, capsys, history, wrapped):
    # Regression: at most 100,000 entries, no option to keep more, and a longer program
    # lost its first events without a word. The pools are fake devices here; install()
    # is stood in for (it needs a GPU), the history and the snapshot are pyalloc's own.
    from pyalloc.__main__ import main

    monkeypatch.setattr(pyalloc, "install", lambda: None)
    prog = script(tmp_path, HOOK_WORK)
    out = tmp_path / "h.pickle"
    assert main(["record", "-o", str(out), "--device", "cuda", "--history", str(history),
                 "--", "python", prog, "20"]) == 0
    err = capsys.readouterr().err
    events = load_snapshot(out)["device_traces"][0]
    assert (len(events) == history) if wrapped else (40 < len(events) < history), (len(events), err)
    said = (f"pyalloc record: the history of cuda:0's general pool reached its limit of {history} "
            "entries: any older events were dropped (a larger --history keeps more)")
    assert (said in err) == wrapped, err
    pyalloc.record_history(False)


def test_record_history_must_be_positive(capsys):
    from pyalloc.__main__ import main

    with pytest.raises(SystemExit):
        main(["record", "-o", "x.pickle", "--history", "0", "--", "python", "x.py"])
    assert "argument --history: must be a positive number of entries, not 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Python's own options before the script: applied, or refused before anything runs

FLAGS_SEEN = """
    import faulthandler, json, sys, warnings
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn("a resource", ResourceWarning)  # ignored unless dev mode's filters
    seen = {"faulthandler": faulthandler.is_enabled(), "write_through": sys.stdout.write_through,
            "line_buffering": sys.stdout.line_buffering, "dont_write_bytecode": sys.dont_write_bytecode,
            "resource_warning_shown": len(shown) == 1, "warnoptions": sys.warnoptions}
    print(json.dumps(seen))
    warnings.warn("made an error by -W error::UserWarning")
    print("not reached")
"""


def run_in_a_fresh_python(argv, tmp_path):
    code = "import sys; from pyalloc._program import run_program; sys.exit(run_program(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pyalloc.__file__)))
    for name in ("PYTHONDEVMODE", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED", "PYTHONWARNINGS",
                 "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code] + argv, capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_python_options_before_the_script_are_applied(tmp_path):
    prog = script(tmp_path, FLAGS_SEEN)
    p = run_in_a_fresh_python(["python", "-u", "-B", "-X", "dev", "-W", "error::UserWarning", prog], tmp_path)
    assert p.returncode == 1, p.stderr  # the warning, made an error, ends the program
    seen = json.loads(p.stdout.splitlines()[0])
    assert seen == {"faulthandler": True, "write_through": True, "line_buffering": True,
                    "dont_write_bytecode": True, "resource_warning_shown": True,
                    "warnoptions": ["error::UserWarning"]}
    assert "UserWarning: made an error" in p.stderr and "not reached" not in p.stdout
    p = run_in_a_fresh_python(["python", "-Xfaulthandler", "-Werror::UserWarning", prog], tmp_path)
    seen = json.loads(p.stdout.splitlines()[0])
    assert seen["faulthandler"] and not seen["resource_warning_shown"] and p.returncode == 1


@pytest.mark.parametrize("flag", ["-O", "-OO", "-E", "-s", "-S", "-I", "-b", "-X importtime", "-Xutf8"])
def test_python_options_that_a_running_python_cannot_take_are_refused(flag):
    with pytest.raises(RecordError, match=r"cannot be applied .*python " + re.escape(flag.split()[0])):
        parse_command(["python"] + flag.split() + ["a.py"])
