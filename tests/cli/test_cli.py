"""The command line as a new user meets it: version, help, missing extras, plots."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pyalloc

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "benchmarks" / "traces"
MiB = 1 << 20


def cli(*args, extra_path=None, cwd=None):
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path[::-1]))
    return subprocess.run([sys.executable, "-m", "pyalloc", *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def hide(tmp_path, module):
    """A directory that, first on the path, makes `import module` fail as if absent."""
    d = tmp_path / f"no-{module}"
    (d / module).mkdir(parents=True)
    (d / module / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n")
    return d


def test_version():
    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"pyalloc {pyalloc.__version__}"


@pytest.mark.parametrize("command", [[], ["run"], ["replay"], ["record"], ["oom"]])
def test_help_has_no_rest_markup(command):
    p = cli(*command, "--help")
    assert p.returncode == 0
    for markup in ("``", ":func:", ":class:", ":meth:", "::\n"):
        assert markup not in p.stdout, (command, markup)
    assert not any(line.lstrip().startswith(".. ") for line in p.stdout.splitlines())


def test_record_without_torch_says_what_to_install(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("pass\n")
    p = cli("record", "-o", tmp_path / "o.pickle", "--", "python", prog,
            extra_path=hide(tmp_path, "torch"))
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "pip install torch" in p.stderr


def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    p = cli("replay", BUNDLED / "encoder-dynbatch-infer.pickle.gz", "--no-search",
            "--plot", tmp_path / "p.png", extra_path=hide(tmp_path, "matplotlib"))
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert 'pip install "pyalloc[plot]"' in p.stderr
    assert "encoder-dynbatch-infer" in p.stdout  # the table still comes out


def test_plot_title_legend_budget_and_native():
    pytest.importorskip("matplotlib")
    from pyalloc.replay import replay
    from pyalloc.replay.report import figure

    # A GPU-like snapshot: segments and segment events, so the native line is known.
    events, addr = [], 1 << 32
    events.append({"action": "segment_alloc", "addr": addr, "size": 64 * MiB, "stream": 0})
    for i in range(40):
        a = addr + (i % 8) * 4 * MiB
        events.append({"action": "alloc", "addr": a, "size": 3 * MiB, "stream": 0})
        if i % 3:
            events.append({"action": "free_requested", "addr": a, "size": 3 * MiB, "stream": 0})
            events.append({"action": "free_completed", "addr": a, "size": 3 * MiB, "stream": 0})
    # Free what is still live, so the final segments have no live blocks.
    live = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    for a, e in live.items():
        events.append({"action": "free_requested", "addr": a, "size": e["size"], "stream": 0})
        events.append({"action": "free_completed", "addr": a, "size": e["size"], "stream": 0})
    snap = {"segments": [{"device": 0, "address": addr, "total_size": 64 * MiB, "stream": 0,
                          "blocks": [{"address": addr, "size": 64 * MiB, "state": "inactive"}]}],
            "device_traces": [events]}
    r = replay(snap, "strategy:vmm,segment_size:8MiB", budget="40MiB", name="gpu.pickle", search=False)
    assert r.native_timeline
    fig = figure([r])
    ax = fig.axes[0]
    title = ax.get_title()
    assert "gpu.pickle" in title and "strategy vmm" in title and "segment_size:8MiB" in title
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "recorded reserved" in labels and any(lbl.startswith("budget 40.00 MiB") for lbl in labels)
    budget = [ln for ln in ax.get_lines() if ln.get_label().startswith("budget")][0]
    assert budget.get_ydata()[0] == pytest.approx(40)  # in MiB, the axis' unit
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend_box = ax.get_legend().get_window_extent(renderer)
    plot_box = ax.get_window_extent(renderer)
    assert legend_box.x0 >= plot_box.x1  # beside the data, never over it


def test_default_config_is_named_in_the_title():
    pytest.importorskip("matplotlib")
    from pyalloc.replay import replay
    from pyalloc.replay.report import figure

    r = replay(BUNDLED / "encoder-dynbatch-infer.pickle.gz", search=False)
    title = figure([r]).axes[0].get_title()
    assert f"strategy {pyalloc.parse_config('')['strategy']}" in title and "(defaults)" in title


def test_replay_help_explains_each_column():
    p = cli("replay", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    for column in ("p: pyalloc;", "n: PyTorch's caching allocator", "e: PyTorch with expandable_segments:True",
                   "dev: the snapshot's device", "peak live: most requested bytes", "budget: the smallest device",
                   "reserved (no cap): peak reserved bytes", "driver calls: cudaMalloc",
                   "allocations it refused (OOMs)", "within 0.5% is a tie"):
        assert column in text, column
