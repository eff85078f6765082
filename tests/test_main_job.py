"""The README's main job, `python -m benchmarks`, on a machine without a GPU."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_main_job_replays_the_bundled_traces_without_a_gpu(tmp_path):
    # PYTHONPATH: the benchmark runs as a script, which must import this checkout's pyalloc.
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--strategies", "vmm", "--results", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU: replaying recorded traces" in out.stdout
    for name in ("tiny-gpt-varlen-train", "convnet-mixedres-train", "encoder-dynbatch-infer",
                 "random-1-stream-seed0", "random-3-streams-seed3"):
        assert name in out.stdout
    # The three allocators at equal budgets lead the table; the prose is in the markdown only.
    assert "budget / peak live" in out.stdout and "expand." in out.stdout
    assert "the smallest device the trace completes on" not in out.stdout
    md = (tmp_path / "fragmentation.md").read_text()
    assert "the smallest device the trace completes on" in md
    assert (tmp_path / "fragmentation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "fragmentation.json").read_text())["traces"]
    for key in ("peak_live_bytes", "recorded_peak_reserved_bytes", "native_expandable_min_budget_bytes",
                "pyalloc_driver_calls", "native_second_half_device_calls"):
        assert all(key in row for row in rows)
    # Each trace again on devices of a size: 80 GiB, snug, 1.05 x peak live and expandable
    # segments' smallest, where all three allocators run (equal budgets).
    devices = json.loads((tmp_path / "fragmentation.json").read_text())["devices"]
    for row in rows:
        mine = [d for d in devices if (d["trace"], d["device"]) == (row["trace"], row["device"])]
        assert [d["device_kind"] for d in mine] == ["fixed", "snug", "budget", "expandable's smallest"], row["trace"]
        assert mine[3]["device_bytes"] == row["native_expandable_min_budget_bytes"]
        assert mine[3]["native_expandable"]["ooms"] == 0  # its smallest device: it completes there
    assert "(e's smallest)" in md
    assert len(out.stdout.splitlines()) < 50  # one screen
