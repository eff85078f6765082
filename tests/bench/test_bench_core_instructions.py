"""benchmarks/bench_core_instructions.py: callgrind's instructions per malloc+free pair."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_core_instructions.py")


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (callgrind)")
def test_it_prints_a_table_and_writes_each_cases_count_per_pair(tmp_path):
    out = tmp_path / "ir.json"
    run = subprocess.run([sys.executable, SCRIPT, "--pairs", "3000", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO))
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert data["environment"]["command"] == "python benchmarks/bench_core_instructions.py --pairs 3000"
    rows = {r["case"]: r for r in data["results"]}
    assert set(rows) == {"cache hit, 4 KiB (small pool)", "cache hit, 8 MiB (large pool)"}
    for name, row in rows.items():
        # A pair is hundreds of instructions; Python's start-up (tens of millions) cancelled out.
        assert 100 < row["instructions_per_pair"] < 20000, row
        assert row["instructions_per_pair"] < row["pools_instructions_per_pair"] < 20000, row
        assert row["pools_ratio"] == round(row["pools_instructions_per_pair"] / row["instructions_per_pair"], 3)
        # Issue 52: a device's pools add at most a quarter to the core's cost
        # (1.8x before the device's stats stopped taking every pair's counts).
        assert row["pools_ratio"] <= 1.25, row
        assert name in run.stdout
    assert "device pools" in run.stdout


def test_the_committed_results_show_the_pools_within_a_quarter_of_the_core():
    with open(os.path.join(REPO, "benchmarks", "results", "bench_core_instructions.json")) as f:
        data = json.load(f)
    assert data["environment"]["command"] == "python benchmarks/bench_core_instructions.py"
    assert len(data["results"]) == 2
    for row in data["results"]:
        assert row["pairs"] == 100_000
        assert row["pools_ratio"] == round(row["pools_instructions_per_pair"] / row["instructions_per_pair"], 3)
        assert row["pools_ratio"] <= 1.25, row


def test_without_valgrind_it_says_so(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, PATH=str(tmp_path))
    run = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "x.json")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 2 and "needs valgrind" in run.stderr
    assert not (tmp_path / "x.json").exists()
