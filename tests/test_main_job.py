"""The README's main job, `python -m benchmarks`, on a machine without a GPU."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_main_job_replays_the_bundled_traces_without_a_gpu():
    # PYTHONPATH: the benchmark runs as a script, which must import this checkout's pyalloc.
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--strategies", "vmm"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU: replaying recorded traces" in out.stdout
    for name in ("tiny-gpt-varlen-train", "convnet-mixedres-train", "encoder-dynbatch-infer"):
        assert name in out.stdout
    assert "peak live" in out.stdout and "min budget" in out.stdout
