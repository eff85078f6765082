"""The README's main job, `python -m benchmarks`, on a machine without a GPU, run as a
new user runs it: in a clone of its own (here a copy of the checkout's tracked files,
with the pyalloc._C built here), where it must leave `git status` clean, print within
100 columns and say, from the figures it measured, where pyalloc loses."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Two of the traces, so that a run takes seconds: a bundled one and a random workload.
TRACES = "encoder-dynbatch-infer,random-1-stream-seed0"
OUT_LINE = "wrote benchmarks/out/fragmentation.{md,json,png} (untracked; --update-results: benchmarks/results/)"

needs_git = pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                               reason="needs git and a git checkout")


def git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture
def clone(tmp_path):
    """The checkout's tracked files as they are now, and its built pyalloc._C, committed
    in a repository of their own (no ../shared beside it: the bundled traces only)."""
    repo = tmp_path / "repo"
    for name in git(ROOT, "ls-files", "-z").split("\0"):
        if name and os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(repo / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), repo / name)
    for built in glob.glob(os.path.join(ROOT, "pyalloc", "_C*.so")):
        shutil.copy2(built, repo / "pyalloc")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "clone")
    assert git(repo, "status", "--porcelain") == ""
    return repo


def main_job(repo, *args, path=None):
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=repo, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    return out


def where_pyalloc_loses(rows):
    """{(measure, allocator): traces where pyalloc's figure is above the other's by more
    than 0.5%}, from the JSON's rows."""
    keys = {"budget": "min_budget_bytes", "uncapped reserved": "peak_reserved_bytes",
            "driver calls": "driver_calls"}
    others = {"PyTorch's allocator": "native", "expandable segments": "native_expandable"}
    lost = {}
    for measure, key in keys.items():
        for name, other in others.items():
            pairs = [(row[f"pyalloc_{key}"], row[f"{other}_{key}"]) for row in rows]
            lost[measure, name] = sum(1 for p, o in pairs if None not in (p, o) and p - o > 0.005 * max(p, o))
    return lost


@needs_git
@pytest.mark.slow
def test_the_main_job_leaves_the_checkout_clean_fits_100_columns_and_says_where_pyalloc_loses(clone):
    out = main_job(clone, "--traces", TRACES, "--strategies", "vmm", "--progress")
    assert git(clone, "status", "--porcelain") == ""
    lines = out.stdout.splitlines()
    assert lines[0].startswith("no CUDA GPU: replaying recorded traces")
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert lines[-1] == OUT_LINE
    git(clone, "check-ignore", "-q", "benchmarks/out/fragmentation.md")  # fails unless ignored
    # The progress bar, on stderr, fits too.
    bar = [seg for seg in re.split(r"[\r\n]", out.stderr) if seg.strip()]
    assert any(seg.startswith("replaying") for seg in bar) and max(len(seg) for seg in bar) <= 100

    # The compact table: short names, the three measures; its legend; no prose per trace.
    assert [line.split()[0] for line in lines[4:6]] == ["encoder-dynbatch-infer", "random-1-stream-seed0"]
    text = " ".join(out.stdout.split())
    assert "p: pyalloc; n: PyTorch's caching allocator" in text
    assert "the smallest device the trace completes on" not in text

    # The closing sentences say what the JSON's figures say, losses included.
    results = clone / "benchmarks" / "out"
    data = json.loads((results / "fragmentation.json").read_text())
    rows = data["traces"]
    lost = where_pyalloc_loses(rows)
    assert any(lost.values())  # these two traces have losses to tell (random-1-stream-seed0's reserved)
    said = text[text.index("Where pyalloc loses: "):]
    for (measure, other), count in lost.items():
        if count:
            assert f"{measure} against {other} on {count} of {len(rows)}" in said
        else:
            assert f"{measure} against {other} on" not in said

    # The files: the markdown links the plot written beside it, and has what the terminal left out.
    md = (results / "fragmentation.md").read_text()
    assert "](fragmentation.png)" in md
    assert (results / "fragmentation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for section in ("## Where pyalloc wins, ties and loses", "## Per trace", "## Since the previous results"):
        assert section in md
    assert "the smallest device the trace completes on" in md and "(e's smallest)" in md
    for key in ("peak_live_bytes", "recorded_peak_reserved_bytes", "native_expandable_min_budget_bytes",
                "pyalloc_driver_calls", "native_second_half_device_calls"):
        assert all(key in row for row in rows)
    # Each trace again on devices of a size: 80 GiB, snug, 1.05 x peak live and expandable
    # segments' smallest, where all three allocators run (equal budgets).
    for row in rows:
        mine = [d for d in data["devices"] if (d["trace"], d["device"]) == (row["trace"], row["device"])]
        assert [d["device_kind"] for d in mine] == ["fixed", "snug", "budget", "expandable's smallest"], row["trace"]
        assert mine[3]["device_bytes"] == row["native_expandable_min_budget_bytes"]
        assert mine[3]["native_expandable"]["ooms"] == 0  # its smallest device: it completes there


@needs_git
@pytest.mark.slow
def test_without_matplotlib_it_says_how_to_plot_and_links_no_plot(clone, tmp_path):
    hidden = tmp_path / "no-matplotlib"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    out = main_job(clone, "--traces", "encoder-dynbatch-infer", "--strategies", "vmm", path=hidden)
    assert 'pip install ".[plot]"' in out.stdout
    assert out.stdout.splitlines()[-1] == OUT_LINE.replace("{md,json,png}", "{md,json}")
    results = clone / "benchmarks" / "out"
    assert not (results / "fragmentation.png").exists()
    assert "fragmentation.png" not in (results / "fragmentation.md").read_text()
    assert git(clone, "status", "--porcelain") == ""


@needs_git
@pytest.mark.slow
def test_update_results_rewrites_the_committed_results_and_sets_them_against_the_old(clone):
    out = main_job(clone, "--traces", "encoder-dynbatch-infer", "--strategies", "vmm", "--update-results")
    assert out.stdout.splitlines()[-1] == ("wrote benchmarks/results/fragmentation.{md,json,png}: "
                                           "the committed results, updated")
    changed = sorted(line.split()[-1] for line in git(clone, "status", "--porcelain").splitlines())
    assert changed == [f"benchmarks/results/fragmentation.{ext}" for ext in ("json", "md", "png")]
    md = (clone / "benchmarks" / "results" / "fragmentation.md").read_text()
    assert "## Since the previous results" in md and "Against `benchmarks/results/fragmentation.json`" in md


def test_on_a_gpu_the_live_benchmark_writes_to_the_untracked_folder_too():
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.__main__ import OUT, command
    finally:
        sys.path.remove(ROOT)
    assert command([], gpu=True)[-3:] == ["--quick", "--out-dir", OUT]
    assert command(["--only", "llm"], gpu=True)[-4:] == ["--out-dir", OUT, "--only", "llm"]
    assert command(["--update-results"], gpu=True)[-1] == "--quick"  # its default: benchmarks/results
    assert command(["--out-dir", "mine"], gpu=True)[-3:] == ["--quick", "--out-dir", "mine"]
    assert command(["--update-results"], gpu=False)[-1] == "--update-results"  # fragmentation.py's flag
    if shutil.which("git") and os.path.exists(os.path.join(ROOT, ".git")):
        assert subprocess.run(["git", "check-ignore", "-q", os.path.join(OUT, "x.json")], cwd=ROOT).returncode == 0
