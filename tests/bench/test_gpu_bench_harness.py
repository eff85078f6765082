"""The GPU benchmark harness (benchmarks/gpu), tested without a GPU.

The writers (JSON, markdown, plots, README section) and the batch search run on
made-up results; the whole pipeline (parent, worker processes, results file)
runs in its CPU smoke mode, native allocator only, on tiny models. Workloads
that need transformers are smoke-tested only where it is installed. The tests
marked gpu run the real thing with both allocators and skip without CUDA.
"""
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")  # the harness and its workloads are torch programs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.gpu import report, worker, workloads  # noqa: E402
from benchmarks.gpu.__main__ import README, _parser, main, parse_budget  # noqa: E402
from benchmarks.gpu.search import largest_passing  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def harness(*args, timeout=600):
    """Runs `python -m benchmarks.gpu ARGS` from the repository root."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------
# The batch search, with a fake probe
# ---------------------------------------------------------------------------


def threshold_probe(limit, calls=None):
    def probe(size):
        if calls is not None:
            calls.append(size)
        return "ok" if size <= limit else "oom"

    return probe


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 4, 5, 7, 8, 13, 31, 63, 64, 100])
def test_search_finds_the_threshold(limit):
    calls = []
    found = largest_passing(threshold_probe(limit, calls), start=4, hi=64, max_probes=20)
    assert found["largest"] == min(limit, 64)
    assert found["smallest_failing"] == (limit + 1 if limit < 64 else None)
    assert found["exact"] and found["stopped"] == "found"
    assert len(calls) == len(set(calls)), "no size is probed twice"
    assert len(calls) <= 12  # gallop (at most log2(64) + 1) then bisect (at most log2(64))
    assert [p["size"] for p in found["probes"]] == calls


def test_search_gallops_from_the_start_then_bisects():
    calls = []
    largest_passing(threshold_probe(21, calls), start=4, hi=1000, max_probes=20)
    assert calls[:4] == [4, 8, 16, 32]  # doubling until the first failure
    assert calls[4:] == [24, 20, 22, 21]  # then bisecting (16, 32)


def test_search_halves_when_the_start_fails():
    calls = []
    found = largest_passing(threshold_probe(3, calls), start=16, hi=64, max_probes=20)
    assert calls[:3] == [16, 8, 4] and found["largest"] == 3


def test_search_stops_at_max_probes_with_a_bracket():
    found = largest_passing(threshold_probe(37), start=4, hi=1024, max_probes=5)
    assert len(found["probes"]) == 5 and found["stopped"] == "max_probes" and not found["exact"]
    assert found["largest"] <= 37 < found["smallest_failing"]


def test_search_stops_within_the_tolerance():
    calls = []
    found = largest_passing(threshold_probe(300, calls), start=100, hi=10_000, max_probes=20, rel_tol=0.05)
    assert found["stopped"] == "tolerance" and not found["exact"]
    assert found["largest"] <= 300 < found["smallest_failing"] <= found["largest"] * 1.05 + 1
    assert len(calls) <= 8
    exact = largest_passing(threshold_probe(300), start=100, hi=10_000, max_probes=20)
    assert exact["largest"] == 300 and len(exact["probes"]) > len(calls)


def test_search_stops_on_an_error_and_keeps_details():
    def probe(size):
        if size >= 8:
            return "error", {"error": "boom"}
        return "ok", {"peak_reserved": size * 10}

    found = largest_passing(probe, start=2, hi=64)
    assert found["stopped"] == "error" and found["largest"] == 4
    assert found["probes"][0] == {"size": 2, "status": "ok", "peak_reserved": 20}
    assert found["probes"][-1] == {"size": 8, "status": "error", "error": "boom"}


def test_search_when_nothing_fits_and_bad_arguments():
    found = largest_passing(threshold_probe(0), start=8, hi=64)
    assert found["largest"] == 0 and found["smallest_failing"] == 1 and found["exact"]
    with pytest.raises(ValueError):
        largest_passing(threshold_probe(3), start=1, hi=0)
    with pytest.raises(ValueError):
        largest_passing(threshold_probe(3), start=1, hi=8, max_probes=0)


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(0, 300), start=st.integers(-5, 400), hi=st.integers(1, 300))
def test_search_property(limit, start, hi):
    found = largest_passing(threshold_probe(limit), start=start, hi=hi, max_probes=64)
    assert found["largest"] == min(limit, hi) and found["exact"]
    assert all(1 <= p["size"] <= hi for p in found["probes"])


# ---------------------------------------------------------------------------
# Small parsers
# ---------------------------------------------------------------------------


def test_parse_budget():
    assert parse_budget("0.5", 80 * GiB) == 40 * GiB
    assert parse_budget("1", 80 * GiB) == 80 * GiB
    assert parse_budget("40GiB", 80 * GiB) == 40 * GiB
    assert parse_budget("40 GB", None) == 40 * GiB  # GB means GiB, as in PyTorch
    assert parse_budget("512MiB", None) == 512 << 20
    assert parse_budget("0.5", None) is None  # a fraction of nothing: no cap (CPU)
    for bad in ("abc", "-1", "0", "10parsecs", ""):
        with pytest.raises(ValueError):
            parse_budget(bad, 80 * GiB)


def test_the_native_cap_names_the_device_by_index_as_torch_requires(monkeypatch):
    """The first batch search on an H200 lost every native probe: the worker passed
    torch.device("cuda"), which torch's own device check refuses. The fake below runs that
    check (pure Python, the same on a CPU build) and records what it was given."""
    from torch.cuda._utils import _get_device_index

    calls = []
    props = type("Props", (), {"total_memory": 64 * GiB})()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: (_get_device_index(d), props)[1])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d=None: calls.append((f, _get_device_index(d))))
    assert worker.cap_native(torch.device("cuda"), 16 * GiB) == 0.25
    assert worker.cap_native(torch.device("cuda", 0), 128 * GiB) == 1.0  # never above the device
    assert calls == [(0.25, 0), (1.0, 0)]


def test_select_names_and_groups():
    assert workloads.select(None) == list(workloads.SPECS)
    assert workloads.select(["control_transformer", "alloc_speed"]) == ["alloc_speed", "control_transformer"]
    assert workloads.select(["llm", "generate"]) == ["llm_train", "llm_train_bf16_ckpt", "generate"]
    with pytest.raises(ValueError, match="unknown workload 'nope'.*alloc_speed.*groups.*fragmenting"):
        workloads.select(["nope"])
    for names in workloads.GROUPS.values():
        assert set(names) <= set(workloads.SPECS)


def test_specs_are_consistent():
    for spec in workloads.SPECS.values():
        if spec.kind == "steps":
            assert spec.build and spec.steps >= 30 and 0 < spec.quick_steps <= spec.steps
            assert 1 <= spec.size <= spec.search_hi and 1 <= spec.search_start <= spec.search_hi
            assert spec.size_name
        else:
            assert spec.kind == "micro" and not spec.trace
    assert {s.name for s in workloads.SPECS.values() if s.trace} == set(workloads.GROUPS["fragmenting"])


def test_readme_numbers_match_the_code():
    with open(README) as f:
        text = " ".join(f.read().split())
    steps = {s.name: s.trace_steps for s in workloads.SPECS.values() if s.trace}
    assert steps == {"llm_train": 6, "llm_train_bf16_ckpt": 6, "bert_infer": 40, "generate": 2, "vision_train": 10}
    assert "6 steps of each training, 40 BERT requests, 10 ViT steps and 2 generate() calls" in text
    assert f"max_entries={_parser().get_default('trace_max_entries')})" in text
    probes = {s.name: s.probe_steps for s in workloads.SPECS.values() if s.kind == "steps"}
    assert set(probes.values()) == {6, 3} and probes["generate"] == 3
    assert "runs 6 drawn shapes (3 generate() calls; `--probe-steps`)" in text
    assert f"known to {_parser().get_default('search_tolerance'):.0%}" in text


def test_oom_is_recognised():
    assert worker.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert worker.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB (pyalloc)"))
    assert worker.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not worker.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not worker.is_oom(ValueError("out of memory is not a value"))


def test_parse_conf():
    assert worker.parse_conf("") == {}
    assert worker.parse_conf("pool_size:2GiB, segment_size:64MiB") == {"pool_size": "2GiB",
                                                                       "segment_size": "64MiB"}
    with pytest.raises(ValueError, match="key:value"):
        worker.parse_conf("pool_size")


def test_mixed_sizes_span_the_range():
    sizes = workloads.mixed_sizes(4096, 512, 256 << 20, seed=0)
    assert sizes == workloads.mixed_sizes(4096, 512, 256 << 20, seed=0)
    assert min(sizes) >= 512 and max(sizes) <= 256 << 20
    assert min(sizes) < 4096 and max(sizes) > 64 << 20  # both ends are exercised


# ---------------------------------------------------------------------------
# The results file: JSON, markdown, plots, README
# ---------------------------------------------------------------------------


def fake_run(median, peak_a, peak_r, steps=6, **extra):
    return dict(status="ok", size=4, median_ms=median, mean_ms=median, step_ms=[median * (1 + i % 2 / 10)
                for i in range(steps)], allocated_after=[peak_a // 2] * steps,
                reserved_after=[peak_r * (i + 1) // steps for i in range(steps)], peak_allocated=peak_a,
                peak_reserved=peak_r, reserved_over_allocated=peak_r / peak_a, **extra)


def fake_search(largest, hi=64, budget=40 * GiB):
    return dict(largest=largest, smallest_failing=largest + 1, exact=True, stopped="found", range=[1, hi],
                budget=budget, probes=[{"size": largest, "status": "ok"}, {"size": largest + 1, "status": "oom"}])


def fake_speed_run(nets, baseline=500.0, core=None, route=None):
    """One allocator's alloc_speed run from made-up processes: {case: [ns beyond
    torch.empty(0), one per process]}."""
    count = len(next(iter(nets.values())))
    processes = []
    for i in range(count):
        cases = []
        for name, values in nets.items():
            case = {"name": name, "ns_per_pair": values[i] + baseline, "baseline_ns": baseline, "net_ns": values[i]}
            if core is not None:
                case["core_ns"] = core
            cases.append(case)
        processes.append({"status": "ok", "cases": cases, "wall_s": 4.0,
                          **({"pyalloc_route": route} if route else {})})
    return report.combine_speed(processes)


def fake_results():
    device = dict(device_type="cuda", name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, torch="2.11.0",
                  cuda="13.0", capability="9.0", python="3.11.7", transformers="4.57.0")
    results = report.new_results(device, {"pyalloc": "0.1.0", "git_commit": "abc1234"})
    results["invocations"] = [{"command": "python -m benchmarks.gpu --only micro llm",
                               "started": "2026-11-22T10:00:00"}]
    speed = report.workload_entry(results, "alloc_speed", "torch.empty pairs", "micro", "")
    speed["runs"] = {
        "native": fake_speed_run({"one size (4 KiB)": [950.0, 1000.0, 1050.0], "mixed": [1900.0, 2000.0, 2100.0]}),
        "pyalloc": fake_speed_run({"one size (4 KiB)": [1250.0, 1300.0, 1350.0], "mixed": [1400.0, 1500.0, 1600.0]},
                                  core=60.0),
    }
    speed["rounds"] = {"planned": 3, "done": 3, "orders": [["native", "pyalloc"], ["pyalloc", "native"],
                                                          ["native", "pyalloc"]]}
    llm = report.workload_entry(results, "llm_train", "GPT-2 training", "steps", "batch")
    llm["runs"] = {"native": fake_run(200.0, 30 * GiB, 45 * GiB), "pyalloc": fake_run(199.0, 30 * GiB, 33 * GiB)}
    llm["search"] = {"budget": 40 * GiB, "native": fake_search(6), "pyalloc": fake_search(8)}
    llm["trace"] = {"path": "benchmarks/traces/llm_train-nvidia-h100.pickle", "steps": 6, "entries": 54321,
                    "bytes": 3 << 20, "status": "ok"}
    control = report.workload_entry(results, "control_transformer", "fixed", "steps", "batch")
    control["runs"] = {"native": fake_run(100.0, 10 * GiB, 11 * GiB), "pyalloc": fake_run(105.0, 10 * GiB, 12 * GiB)}
    control["search"] = {"budget": 40 * GiB, "native": fake_search(40), "pyalloc": fake_search(39)}
    gen = report.workload_entry(results, "generate", "generate()", "steps", "max batch")
    gen["runs"] = {"native": fake_run(50.0, 5 * GiB, 9 * GiB),
                   "pyalloc": {"status": "error", "error": "RuntimeError: boom", "phase": "steps", "at_step": 3}}
    return results


def test_markdown_tables_and_ratios():
    text = report.markdown(fake_results(), images=["x-speed.png"])
    assert "# pyalloc vs PyTorch's native allocator: NVIDIA H100 80GB HBM3" in text
    assert "torch 2.11.0, CUDA 13.0" in text and "80.0 GiB" in text
    assert "python -m benchmarks.gpu --only micro llm" in text
    assert "| case | torch.empty(0) | native | pyalloc | pyalloc's core (C++) | pyalloc / native |" in text
    assert "| one size (4 KiB) | 500 | 1000 [950, 1050] | 1300 [1250, 1350] | 60 | 1.30 slower |" in text
    assert "| mixed | 500 | 2000 [1900, 2100] | 1500 [1400, 1600] | 60 | 0.75 faster |" in text
    assert "(3 each, alternated in 3 rounds)" in text
    assert "| llm_train | batch 4 | 6 | 200.0 | 199.0 | 0.995 [0.995, 0.995] tie |" in text
    assert "| control_transformer | batch 4 | 6 | 100.0 | 105.0 | 1.050 [1.050, 1.050] slower |" in text
    assert "| generate | max batch 4 | 6 | 50.0 | error |  |" in text
    assert "| llm_train | 30.00 | 30.00 | 45.00 | 33.00 | 1.500 | 1.100 |" in text
    assert "under a 40.0 GiB budget" in text and "| llm_train | batch | 6 | 8 | 1.33 | 4 |" in text
    assert "| llm_train | `llm_train-nvidia-h100.pickle` | 6 | 54321 | 3.0 | ok |" in text
    assert "![speed](x-speed.png)" in text


def test_losses_name_every_figure_where_pyalloc_is_worse_and_only_those():
    lost = report.losses(fake_results())
    text = "\n".join(lost)
    assert ("allocation speed, one size (4 KiB): 1.30x native's time per pair beyond torch.empty(0) "
            "(1300 vs 1000 ns; [1250, 1350] ns and [950, 1050] ns over 3 processes and 3 processes)") in text
    assert "control_transformer: median step 1.050x" in text
    assert "control_transformer: peak reserved 12.00 GiB vs native's 11.00 GiB" in text
    assert "control_transformer: the largest batch that runs under the budget is 39, native's 40" in text
    assert "generate: the run ended with 'error' where native's finished (RuntimeError: boom)" in text
    assert "llm_train" not in text and "mixed" not in text  # where pyalloc wins, nothing is said
    md = report.markdown(fake_results())
    assert "# Where pyalloc loses to native" in md and "Runs that did not finish" in md
    assert "generate / pyalloc: error during steps at step 3: RuntimeError: boom" in md


def test_markdown_says_when_pyalloc_loses_nowhere():
    results = fake_results()
    del results["workloads"]["control_transformer"], results["workloads"]["generate"]
    # Slower by 10% at the median, but within the spread over the processes: a tie.
    results["workloads"]["alloc_speed"]["runs"]["pyalloc"] = fake_speed_run(
        {"one size (4 KiB)": [1040.0, 1100.0, 1200.0], "mixed": [1400.0, 1500.0, 1600.0]})
    assert report.losses(results) == []
    assert "- nowhere in these runs" in report.markdown(results)


def test_save_load_render(tmp_path):
    results = fake_results()
    path = str(tmp_path / "gpu-2026-11-22-nvidia-h100-80gb-hbm3.json")
    report.save(results, path)
    assert report.load(path) == json.loads(json.dumps(results))
    written = report.render(report.load(path), path)
    names = sorted(os.path.basename(p) for p in written)
    stem = "gpu-2026-11-22-nvidia-h100-80gb-hbm3"
    assert names == sorted([f"{stem}.md"] + [f"{stem}-{k}.png" for k in report.PLOTS])
    for p in written[1:]:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
    md = (tmp_path / f"{stem}.md").read_text()
    assert f"![batch]({stem}-batch.png)" in md and f"`{stem}.json`" in md

    # A plot whose data is gone is removed, not left stale.
    for entry in results["workloads"].values():
        entry.pop("search", None)
    written = report.render(results, path)
    assert not (tmp_path / f"{stem}-batch.png").exists()
    assert "batch.png" not in (tmp_path / f"{stem}.md").read_text()


def test_load_rejects_another_schema(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": 0, "workloads": {}}))
    with pytest.raises(ValueError, match="schema"):
        report.load(str(path))


def test_stem_and_slug():
    assert report.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.results_stem({"device_type": "cuda", "name": "NVIDIA H200"}, "2026-11-22") == \
        "gpu-2026-11-22-nvidia-h200"
    assert report.results_stem({"device_type": "cpu", "name": "Xeon (R)"}, "2026-11-22") == "cpu-2026-11-22-xeon-r"


def test_update_readme_replaces_only_its_section(tmp_path):
    results = fake_results()
    out = tmp_path / "results"
    out.mkdir()
    path = str(out / "gpu-x.json")
    report.save(results, path)
    report.render(results, path)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.README_BEGIN}\nold table\n{report.README_END}\noutro\n")
    report.update_readme(str(readme), results, path)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert "### pyalloc vs PyTorch's native allocator" in text
    assert "![memory](results/gpu-x-memory.png)" in text and "`results/gpu-x.json`" in text
    report.update_readme(str(readme), results, path)  # idempotent
    assert readme.read_text() == text
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="gpu-results:begin"):
        report.update_readme(str(readme), results, path)


def test_the_benchmark_readme_has_a_results_section():
    with open(README) as f:
        text = f.read()
    assert report.README_BEGIN in text and report.README_END in text
    for name in workloads.SPECS:
        assert f"`{name}`" in text, f"README does not describe {name}"


def test_the_readme_commands_are_valid():
    with open(README) as f:
        commands = re.findall(r"^python -m benchmarks\.gpu(?!\.)(.*)$", f.read(), re.M)  # not .session
    assert len(commands) >= 12
    for line in commands:
        args = _parser().parse_args(shlex.split(line.replace("<date>-<gpu>", "x")))
        workloads.select(args.only)
        parse_budget(args.budget, 80 * GiB)


# ---------------------------------------------------------------------------
# pyalloc's two routes: "pyalloc" (its default, the bridge) and "pyalloc_hooks"
# ---------------------------------------------------------------------------


def test_each_pyalloc_allocator_installs_its_route(monkeypatch):
    import types

    calls = []
    fake = types.SimpleNamespace(install=lambda **kwargs: calls.append(kwargs))
    monkeypatch.setitem(sys.modules, "pyalloc", fake)
    worker.install_allocator("pyalloc", 0, {"strategy": "bestfit"})
    worker.install_allocator("pyalloc_hooks", 40 * GiB, {})
    assert calls == [{"strategy": "bestfit"}, {"max_pool_size": 40 * GiB, "bridge": False}]
    assert set(worker.PYALLOC_ALLOCATORS) == {"pyalloc", "pyalloc_hooks"} <= set(worker.ALLOCATORS)


def test_the_route_of_pyalloc_is_the_harness_choice_not_the_shell(monkeypatch):
    from benchmarks.gpu.__main__ import child_env

    monkeypatch.setenv("PYALLOC_BRIDGE", "0")  # would turn "pyalloc" into the hooks route
    assert "PYALLOC_BRIDGE" not in child_env("pyalloc")
    assert "PYALLOC_BRIDGE" not in child_env("pyalloc_hooks")


def _harness(tmp_path, *argv, device_type="cuda"):
    from benchmarks.gpu.__main__ import Harness

    args = _parser().parse_args(["--out-dir", str(tmp_path), *argv])
    args.argv = list(argv)
    return Harness(args, {"device_type": device_type, "name": "NVIDIA H100", "total_memory": 80 * GiB})


def test_alloc_speed_compares_native_the_bridge_and_the_hooks(tmp_path):
    h = _harness(tmp_path)
    assert h.allocators_for(workloads.SPECS["alloc_speed"]) == ["native", "pyalloc", "pyalloc_hooks"]
    assert h.allocators_for(workloads.SPECS["llm_train"]) == ["native", "pyalloc"]
    chosen = _harness(tmp_path, "--allocators", "native,pyalloc")
    assert chosen.allocators_for(workloads.SPECS["alloc_speed"]) == ["native", "pyalloc"]
    cpu = _harness(tmp_path, "--device", "cpu", device_type="cpu")
    assert cpu.allocators_for(workloads.SPECS["alloc_speed"]) == ["native"]
    assert _parser().parse_args(["--allocators", "pyalloc_hooks"]).allocators == "pyalloc_hooks"


def test_results_say_which_route_each_pyalloc_run_took():
    results = fake_results()
    speed = results["workloads"]["alloc_speed"]["runs"]
    speed["pyalloc"]["pyalloc_route"] = "bridge"
    speed["pyalloc_hooks"] = fake_speed_run({"one size (4 KiB)": [2500.0, 2600.0, 2700.0],
                                             "mixed": [1400.0, 1500.0, 1600.0]}, route="hooks")
    assert report.pyalloc_routes(results) == {"pyalloc": ["bridge"], "pyalloc_hooks": ["hooks"]}
    assert report.allocators(results) == ["native", "pyalloc", "pyalloc_hooks"]
    text = report.markdown(results)
    assert "| pyalloc route in use | pyalloc: bridge; pyalloc_hooks: hooks |" in text
    assert "| case | torch.empty(0) | native | pyalloc | pyalloc_hooks | pyalloc's core (C++) | pyalloc / native " \
           "| pyalloc_hooks / native | pyalloc / pyalloc_hooks |" in text
    assert ("| one size (4 KiB) | 500 | 1000 [950, 1050] | 1300 [1250, 1350] | 2600 [2500, 2700] | 60 "
            "| 1.30 slower | 2.60 slower | 0.50 faster |") in text
    assert "pyalloc_hooks, allocation speed, one size (4 KiB): 2.60x" in "\n".join(report.losses(results))
    # A "pyalloc" run that fell back to the hooks says so.
    speed["pyalloc"]["pyalloc_route"] = "hooks"
    assert "| pyalloc route in use | pyalloc: hooks; pyalloc_hooks: hooks |" in report.markdown(results)


# ---------------------------------------------------------------------------
# Speed figures over processes; step times within their spread
# ---------------------------------------------------------------------------


def test_speed_processes_combine_into_a_median_and_its_range():
    def process(net, base, core=None, status="ok"):
        case = {"name": "one size (4 KiB)", "ns_per_pair": net + base, "baseline_ns": base, "net_ns": net}
        if core is not None:
            case["core_ns"] = core
        return {"status": status, "cases": [case], "wall_s": 5.0, "pyalloc_route": "bridge"}

    run = report.combine_speed([process(2400.0, 1500.0, 55.0), process(900.0, 1400.0, 60.0),
                                process(1000.0, 1600.0, 70.0)])
    assert run["status"] == "ok" and run["pyalloc_route"] == "bridge" and len(run["processes"]) == 3
    assert run["cases"] == [{"name": "one size (4 KiB)", "processes": 3, "net_ns": 1000.0,
                             "net_processes": [2400.0, 900.0, 1000.0], "net_min": 900.0, "net_max": 2400.0,
                             "ns_per_pair": 2600.0, "baseline_ns": 1500.0, "core_ns": 60.0}]
    failed = report.combine_speed([process(900.0, 1400.0), {"status": "crashed", "error": "worker exited with -9"}])
    assert failed["status"] == "crashed" and failed["error"] == "1 of 2 processes: worker exited with -9"
    assert failed["cases"][0]["processes"] == 1  # kept, but an unfinished run shows in no table


def test_allocation_speed_within_the_spread_over_processes_is_a_tie():
    """Regression: two alloc_speed runs a minute apart on one H200 (4ec56a2) said
    pyalloc 0.83x, then 1.66x native per 4 KiB pair; one process per allocator could
    not tell noise from a difference, and the report called each a win or a loss."""
    results = fake_results()
    results["workloads"] = {"alloc_speed": results["workloads"]["alloc_speed"]}
    case = "one size (4 KiB)"
    results["workloads"]["alloc_speed"]["runs"] = {
        "native": fake_speed_run({case: [2297.0, 2299.0, 4529.0]}, baseline=0.0),
        "pyalloc": fake_speed_run({case: [1898.0, 3807.0, 2424.0]}, baseline=0.0),
    }
    assert report.losses(results) == []
    assert "| one size (4 KiB) | 0 | 2299 [2297, 4529] | 2424 [1898, 3807] | 1.05 tie |" in report.markdown(results)
    # Ranges apart: slower, and said so; faster is no loss.
    slow = {"ns": 1300.0, "lo": 1250.0, "hi": 1350.0, "processes": 3}
    fast = {"ns": 900.0, "lo": 850.0, "hi": 990.0, "processes": 3}
    base = {"ns": 1000.0, "lo": 995.0, "hi": 1010.0, "processes": 3}
    assert [report.speed_verdict(f, base) for f in (slow, fast, base)] == ["slower", "faster", "tie"]
    # One process a side (older results): no spread, so only the old 2% rule can say.
    one = {"ns": 1010.0, "lo": 1010.0, "hi": 1010.0, "processes": 1}
    assert report.speed_verdict(one, dict(base, processes=1)) == "tie"
    assert report.speed_verdict(dict(one, ns=1100.0), dict(base, processes=1)) == "slower"


# llm_train, 20 quick steps, native and pyalloc (bridge), H200, 2026-11-28 at 1ceb995 (same shapes).
H200_NATIVE_MS = [141.4, 155.0, 216.0, 61.7, 63.7, 99.7, 61.0, 200.3, 183.1, 66.1, 221.4, 249.4, 61.4, 81.4, 173.9,
                  76.4, 95.7, 237.5, 69.2, 211.5]
H200_PYALLOC_MS = [141.3, 154.6, 216.1, 73.0, 74.6, 102.8, 76.2, 200.2, 184.0, 70.9, 222.1, 249.5, 51.1, 83.0,
                   173.8, 80.9, 96.8, 238.1, 73.3, 211.7]


def _steps(ms, shapes=None):
    import statistics

    return {"status": "ok", "step_ms": ms, "median_ms": statistics.median(ms),
            "shapes": shapes or [{"length": i} for i in range(len(ms))]}


def test_step_times_within_their_spread_are_ties():
    # The H200's llm_train: the short steps were slower under pyalloc (the per-step
    # ratios' quartiles are 1.000 and 1.059), the median step 1.2%: a tie by the 2% rule.
    h200 = report.step_comparison(_steps(H200_NATIVE_MS), _steps(H200_PYALLOC_MS))
    assert h200["paired"] and h200["verdict"] == "tie" and round(h200["ratio"], 3) == 1.012
    assert (round(h200["lo"], 3), round(h200["hi"], 3)) == (1.000, 1.059)
    # 3% slower at the median, but steps either side of native's: a tie (the old rule, a
    # ratio above 1.02, called it a loss).
    base = [100.0 + i for i in range(8)]
    mixed = [b * r for b, r in zip(base, [0.95, 1.10, 0.97, 1.08, 1.03, 1.04, 0.99, 1.06])]
    c = report.step_comparison(_steps(base), _steps(mixed))
    assert c["verdict"] == "tie" and c["ratio"] > 1.02 and c["lo"] < 1 < c["hi"]
    results = fake_results()
    results["workloads"]["control_transformer"]["runs"] = {"native": _steps(base), "pyalloc": _steps(mixed)}
    assert not any("control_transformer: median step" in item for item in report.losses(results))
    # Every step 5% slower: a loss. 1% slower every step: still a tie (within 2%).
    assert report.step_comparison(_steps(base), _steps([b * 1.05 for b in base]))["verdict"] == "slower"
    assert report.step_comparison(_steps(base), _steps([b * 0.95 for b in base]))["verdict"] == "faster"
    assert report.step_comparison(_steps(base), _steps([b * 1.01 for b in base]))["verdict"] == "tie"
    # Runs that do not pair (other shapes) compare their step times' quartiles.
    other = report.step_comparison(_steps(base), _steps([b * 1.03 for b in base], shapes=[{"length": 0}] * 8))
    assert not other["paired"] and other["verdict"] == "tie"  # the quartiles overlap


def test_each_round_puts_every_allocator_in_another_place():
    from benchmarks.gpu.__main__ import round_order

    five = ["native", "pyalloc", "pyalloc_hooks", "native_expandable", "native_async"]
    for allocators, rounds in ((five, 5), (five[:3], 3), (five[:2], 2), (five[:4], 4)):
        orders = [round_order(allocators, r) for r in range(rounds)]
        assert all(sorted(o) == sorted(allocators) for o in orders)
        for a in allocators:
            assert len({o.index(a) for o in orders}) == rounds, (allocators, orders)
    assert round_order(five, 0) == five


def test_speed_rounds_alternate_and_none_starts_past_its_time(tmp_path, monkeypatch):
    import benchmarks.gpu.__main__ as harness_main

    clock = [0.0]
    spawned = []

    def fake_spawn(worker_args, allocator, timeout):
        spawned.append(allocator)
        clock[0] += 10.0  # each process takes 10 s
        return {"status": "ok", "wall_s": 10.0, "cases": [
            {"name": "one size (4 KiB)", "ns_per_pair": 2000.0 + len(spawned), "baseline_ns": 1000.0,
             "net_ns": 1000.0 + len(spawned)}]}

    monkeypatch.setattr(harness_main, "spawn", fake_spawn)
    monkeypatch.setattr(harness_main.time, "perf_counter", lambda: clock[0])
    h = _harness(tmp_path, "--only", "alloc_speed", "--rounds", "4", "--rounds-within", "75")
    h.speed_rounds(workloads.SPECS["alloc_speed"])
    # Rounds of 30 s: the third would end at 90 s, past 75.
    assert spawned == ["native", "pyalloc", "pyalloc_hooks", "pyalloc_hooks", "native", "pyalloc"]
    entry = h.results["workloads"]["alloc_speed"]
    assert entry["rounds"]["done"] == 2 and entry["rounds"]["planned"] == 4
    assert entry["runs"]["native"]["cases"][0]["net_processes"] == [1001.0, 1005.0]
    assert report.load(h.json_path)["workloads"]["alloc_speed"]["rounds"]["done"] == 2
    # Without a time the rounds planned all run; --quick plans 3.
    spawned.clear()
    _harness(tmp_path, "--quick", "--allocators", "native,pyalloc").speed_rounds(workloads.SPECS["alloc_speed"])
    assert spawned == ["native", "pyalloc", "pyalloc", "native", "native", "pyalloc"]


def test_side_by_side_lanes_are_what_the_device_holds_at_the_budget():
    from benchmarks.gpu.__main__ import lanes_for

    h200 = 150_109_880_320  # what torch reported for the H200 of 2026-11-28
    # Seven 16 GiB budgets, each with a GiB for its process's CUDA context, in 95% of an H200.
    assert lanes_for("auto", 16 * GiB, h200) == 7
    assert lanes_for("auto", 8 * GiB, 80 * GiB) == 8
    assert lanes_for("auto", 100 * GiB, 80 * GiB) == 1  # never fewer than one
    assert lanes_for("auto", None, h200) == 1 and lanes_for("auto", 16 * GiB, None) == 1
    assert lanes_for("3", None, None) == 3
    assert _parser().parse_args(["--parallel", "auto"]).parallel == "auto"
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--parallel", bad])


def _fake_probes(monkeypatch, fits, seconds, together=1):
    """spawn() replaced by probes that take `seconds[workload]`, run out of memory above
    `fits[workload]`, and note how many ran at once, and which; the first `together`
    probes wait for each other (they must be running at the same time)."""
    import benchmarks.gpu.__main__ as harness_main

    lock = threading.Lock()
    running, seen = [], {"most": 0, "mixed": False, "tags": set(), "calls": 0}
    meet = threading.Barrier(together, timeout=60)

    def fake_spawn(worker_args, allocator, timeout, tag=""):
        workload = worker_args[worker_args.index("--workload") + 1]
        size = int(worker_args[worker_args.index("--size") + 1])
        with lock:
            running.append(workload)
            seen["most"] = max(seen["most"], len(running))
            seen["tags"].add(tag)
            first = seen["calls"] < together
            seen["calls"] += 1
        if first:
            meet.wait()  # a lane short of `together` breaks it: BrokenBarrierError
            with lock:
                seen["mixed"] |= len(set(running)) > 1
        time.sleep(seconds[workload])
        with lock:
            running.remove(workload)
        ok = size <= fits[workload]
        return {"status": "ok" if ok else "oom", "wall_s": seconds[workload], "peak_reserved": size * MiB}

    monkeypatch.setattr(harness_main, "spawn", fake_spawn)
    return seen


def test_batch_searches_of_every_workload_share_the_lanes(tmp_path, monkeypatch):
    # The first H200 window searched one workload at a time, its five allocators side by
    # side: a lane whose search ended waited for the slowest. The searches of the next
    # workloads now take a lane as soon as one is free, and each is saved as it ends.
    seen = _fake_probes(monkeypatch, {"bert_infer": 1500, "generate": 300}, {"bert_infer": 0.01, "generate": 0.05},
                        together=4)
    h = _harness(tmp_path, "--budget-search", "--budget", "16GiB", "--parallel", "4", "--max-probes", "4",
                 "--allocators", "native,pyalloc,native_expandable")
    saves = []
    monkeypatch.setattr(h, "save", lambda: saves.append(sum(
        len([k for k in w.get("search", {}) if k != "budget"]) for w in h.results["workloads"].values())))
    h.search_all([workloads.SPECS["generate"], workloads.SPECS["bert_infer"]])
    # Four lanes: generate's three searches and bert_infer's first, at once.
    assert seen["most"] == 4 and seen["mixed"]
    assert seen["tags"] == {f"{w} {a}" for w in ("generate", "bert_infer")
                            for a in ("native", "pyalloc", "native_expandable")}
    assert saves == [1, 2, 3, 4, 5, 6]
    for name, fit in (("bert_infer", 1500), ("generate", 300)):
        search = h.results["workloads"][name]["search"]
        assert search["budget"] == 16 * GiB
        for allocator in ("native", "pyalloc", "native_expandable"):
            found = search[allocator]
            assert found["largest"] <= fit < (found["smallest_failing"] or 10 ** 9) and len(found["probes"]) <= 4
    # One lane: the searches one after the other, untagged.
    seen = _fake_probes(monkeypatch, {"bert_infer": 1500}, {"bert_infer": 0.0})
    _harness(tmp_path, "--budget-search", "--allocators", "native,pyalloc").search_all([workloads.SPECS["bert_infer"]])
    assert seen["most"] == 1 and seen["tags"] == {""}


def test_a_traced_run_beside_others_that_had_to_retry_is_made_again_alone(tmp_path, monkeypatch):
    import benchmarks.gpu.__main__ as harness_main

    calls = []

    def fake_spawn(worker_args, allocator, timeout, tag=""):
        calls.append((allocator, tag))
        path = worker_args[worker_args.index("--trace") + 1] if "--trace" in worker_args else None
        if path and not tag:
            assert not os.path.exists(path), "the crowded run's history was left to be replayed"
        if path:
            open(path, "w").close()
        if allocator == "native_expandable":  # an error no company causes: not made again
            return {"status": "error", "error": "ValueError: a bad shape"}
        crowded = tag and allocator == "native"  # beside the others, native ran short and retried
        return {"status": "ok", "peak_allocated": 10, "peak_reserved": 20 if crowded else 15,
                "stats": {"num_alloc_retries": 2 if crowded else 0, "num_device_alloc": 3},
                "trace": {"path": path, "entries": 5, "bytes": 100} if path else None}

    monkeypatch.setattr(harness_main, "spawn", fake_spawn)
    h = _harness(tmp_path, "--traces", "--no-timing", "--trace-allocators", "native,native_expandable,pyalloc",
                 "--parallel", "auto", "--trace-dir", str(tmp_path / "traces"))
    h.trace(workloads.SPECS["bert_infer"])
    assert sorted(calls[:3]) == [("native", "bert_infer native"), ("native_expandable", "bert_infer native_expandable"),
                                 ("pyalloc", "bert_infer pyalloc")]
    assert calls[3:] == [("native", "")]  # made again, alone
    traces = h.results["workloads"]["bert_infer"]["traces"]
    assert traces["native"]["live"]["peak_reserved"] == 15 and traces["native"]["live"]["num_alloc_retries"] == 0
    assert traces["native"]["made_alone_after"] == "freed its cache and retried 2 times"
    assert not traces["native"]["side_by_side"]
    assert traces["native_expandable"]["side_by_side"] and traces["pyalloc"]["side_by_side"]
    assert traces["native_expandable"]["error"] == "ValueError: a bad shape" and h.failures == 1
    # One at a time without --parallel.
    calls.clear()
    _harness(tmp_path, "--traces", "--no-timing", "--trace-allocators", "native,pyalloc",
             "--trace-dir", str(tmp_path / "one-at-a-time")).trace(workloads.SPECS["bert_infer"])
    assert calls == [("native", ""), ("pyalloc", "")]


def test_searches_start_in_the_order_only_names_the_workloads():
    from benchmarks.gpu.__main__ import search_order
    from benchmarks.gpu.session import BATCH_WORKLOADS

    specs = [workloads.SPECS[n] for n in workloads.select(list(BATCH_WORKLOADS))]  # the registry's order
    assert [s.name for s in specs] != list(BATCH_WORKLOADS)
    assert [s.name for s in search_order(specs, list(BATCH_WORKLOADS))] == list(BATCH_WORKLOADS)
    assert [s.name for s in search_order(specs, ["generate,serve"])] == ["generate", "llm_train_bf16_ckpt",
                                                                         "bert_infer"]
    assert search_order(specs, None) == specs


def test_a_failed_or_crowded_run_says_why():
    from benchmarks.gpu.__main__ import crowded

    assert crowded({"status": "ok", "stats": {"num_alloc_retries": 0}}) == ""
    assert crowded({"status": "ok"}) == ""
    assert crowded({"status": "oom", "error": "CUDA out of memory"}) == "ended oom (CUDA out of memory)"
    assert crowded({"status": "ok", "stats": {"num_alloc_retries": 1}}) == "freed its cache and retried 1 times"
    assert crowded({"status": "error", "error": "CUDA error: out of memory"}).startswith("ended error")
    assert crowded({"status": "crashed", "error": "worker exited with -9 and no result"}).startswith("ended crashed")
    assert crowded({"status": "error", "error": "ValueError: a bad shape"}) == ""  # comes again alone


def test_a_worker_beside_others_has_each_line_it_prints_tagged(capfd):
    from benchmarks.gpu.__main__ import spawn

    r = spawn(["--workload", "control_transformer", "--device", "cpu", "--smoke", "--size", "2", "--steps", "2"],
              "native", 120, tag="control native")
    assert r["status"] == "ok", r
    out = capfd.readouterr().out.splitlines()
    steps = [line for line in out if "step 2/2" in line]
    assert steps and all(line.startswith("[control native]     step") for line in steps), out


def test_the_cpp_pair_cost_is_measured_beside_torchs():
    case = workloads.alloc_speed_cases(smoke=True, quick=False, seed=0)[1]  # mixed sizes, 64 live
    assert 0 < workloads.core_pair_ns(case, repeats=1) < 100_000


# ---------------------------------------------------------------------------
# The whole pipeline on a CPU
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smoke_pipeline_on_cpu(tmp_path):
    out = str(tmp_path)
    run = harness("--device", "cpu", "--smoke", "--only", "alloc_speed", "control_transformer", "--budget-search",
                  "--out-dir", out, "--name", "smoke")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "on a CPU only the native allocator runs" in run.stdout
    results = report.load(os.path.join(out, "smoke.json"))
    assert results["device"]["device_type"] == "cpu" and results["device"]["torch"] == torch.__version__
    speed = results["workloads"]["alloc_speed"]["runs"]
    assert list(speed) == ["native"] and speed["native"]["status"] == "ok"
    assert len(speed["native"]["cases"]) == 4 and all(c["ns_per_pair"] > 0 for c in speed["native"]["cases"])
    # Two processes (two rounds, the smoke default), each with a torch.empty(0) baseline.
    assert len(speed["native"]["processes"]) == 2 and results["workloads"]["alloc_speed"]["rounds"]["done"] == 2
    for p in speed["native"]["processes"]:
        assert all(c["baseline_ns"] > 0 and c["net_ns"] == c["ns_per_pair"] - c["baseline_ns"] for c in p["cases"])
    assert all(c["processes"] == 2 and c["net_min"] <= c["net_ns"] <= c["net_max"]
               for c in speed["native"]["cases"])
    control = results["workloads"]["control_transformer"]
    run_ = control["runs"]["native"]
    assert run_["status"] == "ok" and len(run_["step_ms"]) == 2 and run_["median_ms"] > 0
    assert run_["shapes"] == [{"batch": 2, "length": 8}] * 2 and run_["peak_reserved"] is None
    found = control["search"]["native"]
    assert found["largest"] == 4 and found["stopped"] == "found"  # nothing runs out of memory on a CPU
    assert [p["status"] for p in found["probes"]] == ["ok", "ok"]
    with open(os.path.join(out, "smoke.md")) as f:
        md = f.read()
    assert "| control_transformer | batch 2 | 2 |" in md and "| control_transformer | batch | ≥ 4 (cap) |" in md
    with open(os.path.join(out, "smoke-timeline.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC

    # A second command extends the same file.
    again = harness("--device", "cpu", "--smoke", "--only", "alloc_speed", "--out-dir", out, "--name", "smoke")
    assert again.returncode == 0, again.stdout + again.stderr
    results = report.load(os.path.join(out, "smoke.json"))
    assert len(results["invocations"]) == 2 and "control_transformer" in results["workloads"]
    assert results["invocations"][1]["command"].endswith("--only alloc_speed --out-dir " + out + " --name smoke")


HF_WORKLOADS = ["llm_train", "llm_train_bf16_ckpt", "bert_infer", "generate", "vision_train", "control_resnet50"]


@pytest.mark.slow
def test_smoke_transformers_workloads_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    run = harness("--device", "cpu", "--smoke", "--only", *HF_WORKLOADS, "--out-dir", str(tmp_path), "--name", "hf")
    assert run.returncode == 0, run.stdout + run.stderr
    results = report.load(str(tmp_path / "hf.json"))
    for name in HF_WORKLOADS:
        r = results["workloads"][name]["runs"]["native"]
        assert r["status"] == "ok" and len(r["step_ms"]) == 2 and r["params"] > 0, (name, r.get("traceback"))


def test_without_a_gpu_the_harness_says_how_to_test_it(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    run = harness("--only", "control_transformer", "--out-dir", str(tmp_path))
    assert run.returncode == 2
    assert "no CUDA device" in run.stderr and "--device cpu --smoke" in run.stderr
    assert os.listdir(tmp_path) == []


def test_list_and_render(tmp_path, capsys):
    assert main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in workloads.SPECS) and "fragmenting" in listing
    path = str(tmp_path / "gpu-x.json")
    report.save(fake_results(), path)
    assert main(["--render", path]) == 0
    assert (tmp_path / "gpu-x.md").exists() and (tmp_path / "gpu-x-timeline.png").exists()


def test_device_check_on_cpu(capsys):
    assert main(["--device-check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "== native: ok" in out and '"device_type": "cpu"' in out


@pytest.mark.parametrize("args, message", [
    (["--only", "llm_trian"], "unknown workload 'llm_trian'"),
    (["--allocators", "native,pyaloc"], "unknown allocator 'pyaloc'"),
    (["--budget", "lots"], "bad budget 'lots'"),
    (["--no-timing"], "--no-timing leaves nothing to run"),
])
def test_bad_arguments_are_refused(args, message):
    run = harness(*args)
    assert run.returncode == 2 and message in run.stderr


def test_worker_reports_errors_as_json(tmp_path):
    out = str(tmp_path / "r.json")
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu.worker", "--workload", "control_transformer",
                          "--device", "cpu", "--smoke", "--size", "-1", "--steps", "1", "--result", out],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    with open(out) as f:
        result = json.load(f)
    assert run.returncode == 1 and result["status"] == "error" and result["phase"] == "steps"
    assert "Traceback" in result["traceback"]


# ---------------------------------------------------------------------------
# On a GPU: both allocators for real
# ---------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_device_check_on_gpu():
    run = harness("--device-check")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.gpu
@needs_gpu
def test_trace_on_gpu(tmp_path):
    pytest.importorskip("transformers")
    run = harness("--smoke", "--no-timing", "--traces", "--only", "bert_infer", "--out-dir", str(tmp_path),
                  "--name", "gpu", "--trace-dir", str(tmp_path / "traces"))
    assert run.returncode == 0, run.stdout + run.stderr
    with open(tmp_path / "traces" / "index.json") as f:
        (info,) = json.load(f).values()
    assert info["status"] == "ok" and info["entries"] > 0 and not info["wrapped"]
    with open(info["path"], "rb") as f:  # a memory snapshot, as torch's own tools read it
        snapshot = pickle.load(f)
    assert {"segments", "device_traces"} <= set(snapshot)


@pytest.mark.gpu
@needs_gpu
def test_both_allocators_on_gpu(tmp_path):
    run = harness("--smoke", "--only", "alloc_speed", "control_transformer", "--budget-search", "--budget", "0.5",
                  "--out-dir", str(tmp_path), "--name", "gpu")
    assert run.returncode == 0, run.stdout + run.stderr
    results = report.load(str(tmp_path / "gpu.json"))
    runs = results["workloads"]["control_transformer"]["runs"]
    for allocator in ("native", "pyalloc"):
        assert runs[allocator]["status"] == "ok"
        assert 0 < runs[allocator]["peak_allocated"] <= runs[allocator]["peak_reserved"]
    speed = results["workloads"]["alloc_speed"]["runs"]
    assert sorted(speed) == ["native", "pyalloc", "pyalloc_hooks"]
    assert speed["pyalloc"]["pyalloc_route"] == "bridge" and speed["pyalloc_hooks"]["pyalloc_route"] == "hooks"
    assert all(c["core_ns"] > 0 and c["processes"] == 2 for c in speed["pyalloc"]["cases"])
    assert not any("core_ns" in c for c in speed["native"]["cases"])
    assert results["workloads"]["control_transformer"]["search"]["budget"] > 0


def test_report_names_the_strategy_pyalloc_really_used():
    from benchmarks.gpu import report as gpu_report

    results = {"workloads": {
        "a": {"runs": {"native": {"status": "ok"}, "pyalloc": {"pyalloc_settings": {"strategy": "bestfit"}}}},
        "b": {"runs": {"pyalloc": {"status": "error"}}},
    }}
    assert gpu_report.pyalloc_strategies(results) == ["bestfit"]
    assert gpu_report.pyalloc_strategies({"workloads": {}}) == []


def test_traces_are_recorded_only_under_native_allocators_and_pyalloc_runs_live(capsys):
    from benchmarks.gpu.__main__ import TRACE_ALLOCATORS, _parser, main

    assert _parser().get_default("trace_allocators") == "native"
    # cudaMallocAsync keeps no memory history: nothing to replay.
    assert main(["--device", "cpu", "--smoke", "--no-timing", "--traces", "--trace-allocators",
                 "native,native_async"]) == 2
    assert "--trace-allocators: 'native_async' records no memory history" in capsys.readouterr().err
    # pyalloc's run of the same workload is made live only, for the replay's prediction.
    assert {"pyalloc", "pyalloc_hooks"} <= set(TRACE_ALLOCATORS)
