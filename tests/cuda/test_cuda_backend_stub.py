"""The CUDA backend on CPU, against a stand-in libcuda.so.1 (tests/cuda_stub/).

The stand-in counts the driver calls pyalloc makes, so this checks what no fake
backend can: primary contexts made current and restored, events created once
and recycled, out-of-memory told apart from other driver errors, and no call
that CUDA's global capture mode forbids while a capture is underway.

Each check of cuda_stub/checks.py is a test of its own, in a process of its
own (a device's pools are made once per process): a failure names its check,
and `-k NAME` runs one.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
STUB_DIR = os.path.join(TESTS, "cuda_stub")

# Each mode: the stand-in it runs on, the words checks.py takes, and the prefixes of its checks.
MODES = {
    "segments": ("relaxed", [], ("check_", "relaxed_check_")),
    "segments-norelax": ("norelax", ["norelax"], ("check_", "norelax_check_")),
    "vmm": ("relaxed", ["vmm"], ("vmm_check_",)),
    "fallback": ("relaxed", ["fallback"], ("fallback_check_",)),
    "capture": ("relaxed", ["capture"], ("capture_check_",)),
    "capture-big": ("relaxed", ["capture", "big"], ("capture_check_",)),
    "capture-error": ("relaxed", ["capture", "error"], ("capture_check_",)),
    "capture-access": ("relaxed", ["capture", "access"], ("capture_check_",)),
    "areas-norelax": ("norelax", ["areas", "norelax"], ("areas_check_",)),
}

# What a check must say on stderr, each exactly once; pyalloc says nothing else.
STDERR = {
    "check_failed_event_keeps_the_block_and_raises_once": [
        "cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"],
    "relaxed_check_a_route_left_open_heals_by_probing_its_stream": [
        "a CUDA graph capture into pool (0, 15) on device 0 was never ended"],
    "vmm_check_peers_may_access_the_pages": [
        "device 1: cuMemSetAccess for peer devices failed: CUDA_ERROR_NOT_SUPPORTED (801)"],
    "vmm_check_peers_refused_by_a_pool_are_counted_as_made": [
        "device 0: cuMemSetAccess for peer devices failed: CUDA_ERROR_NOT_SUPPORTED (801)"],
    # a route its pool's release ends
    "vmm_check_parked_pages_go_back_when_the_capture_ends": [
        "a CUDA graph capture into pool (0, 31) on device 0 was never ended"],
    "fallback_check_vmm_refused_by_a_sandbox": [
        "device 0 cannot use strategy vmm (the driver refused a trial mapping: "
        "cuMemCreate failed: CUDA_ERROR_NOT_PERMITTED (800)); its pools use strategy bestfit"],
    "relaxed_check_a_device_opened_during_a_capture_gives_its_range_back": [
        "device 1 cannot use strategy vmm (the trial mapping failed); its pools use strategy bestfit"],
    "fallback_check_no_vmm_support": [
        "device 1 cannot use strategy vmm (the device does not support virtual memory management); "
        "its pools use strategy bestfit"],
}


def _checks(prefixes):
    """The functions of checks.py whose names start with one of `prefixes`, in the file's order."""
    with open(os.path.join(STUB_DIR, "checks.py")) as f:
        tree = ast.parse(f.read())
    return [node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith(prefixes)]


CHECKS = [(mode, name) for mode, (_, _, prefixes) in MODES.items() for name in _checks(prefixes)]


@pytest.mark.parametrize("mode, check", CHECKS, ids=[f"{mode}-{name}" for mode, name in CHECKS])
def test_cuda_backend_against_the_stand_in_driver(stub_drivers, mode, check):
    """One check of checks.py in a process of its own (a device's pools are made
    once per process, and a failed check leaves the next nothing to stumble on)."""
    driver, words, _ = MODES[mode]
    library = stub_drivers[driver]
    env = dict(os.environ, PYTHONPATH=REPO, LD_LIBRARY_PATH=str(library.parent))
    env.pop("PYALLOC_CONF", None)
    out = subprocess.run(
        [sys.executable, os.path.join(STUB_DIR, "checks.py"), str(library), *words, check],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("pyalloc:")]
    expected = STDERR.get(check, [])
    assert len(said) == len(expected), out.stderr
    for words in expected:
        assert sum(words in line for line in said) == 1, (words, out.stderr)


def test_every_check_of_checks_py_runs_in_some_mode():
    named = {name for name in _checks(("",)) if "check_" in name}
    assert named == {name for _, name in CHECKS}, named - {name for _, name in CHECKS}
