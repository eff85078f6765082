"""CUDA IPC through the bridge's C table (csrc/cuda/ipc.h), on CPU.

Fake devices: a shared block is opened by a simulated receiver in the same
process (the handle names this process and the address), which checks the
handle's layout, the receiver's counting of one mapping per handle and the
refusals. The stand-in driver (tests/cuda_stub/) runs the real thing between
two processes: legacy IPC handles of bestfit's segments, and vmm's pages
passed as file descriptors over a Unix socket (tests/cuda_stub/ipc_checks.py).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from pyalloc import _C

from bridge_api import INVALID, OK

MiB = 1 << 20
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
STUB_DIR = os.path.join(TESTS, "cuda_stub")


def counts():
    return _C.cuda_ipc_counts()


def test_a_shared_segment_gives_pytorchs_layout_and_its_offset(api, fake):
    status, p, _ = api.malloc(MiB)
    assert status == OK
    status, q, _ = api.malloc(MiB)  # the same segment, further on
    assert status == OK
    status, handle, offset = api.ipc_share(q)
    assert status == OK, api.error()
    # PyTorch's SHAREABLE_HANDLE_VERSION 2, SHAREABLE_CUDA_MALLOC, 64 bytes of
    # the driver's handle: what PyTorch's own allocator writes and reads.
    assert handle[:2] == b"\x02c" and len(handle) == 66
    base = api.base_alloc(q, None)
    assert offset == q - base
    # The same allocation shared again: the same handle (a receiver's cache
    # then finds its mapping).
    assert api.ipc_share(q)[1:] == (handle, offset)
    # Another block of the same segment names the same memory, elsewhere in it.
    status, other, other_offset = api.ipc_share(p)
    assert other == handle and other_offset == p - base
    assert api.free(p, 0) == OK and api.free(q, 0) == OK


def test_a_simulated_receiver_sees_the_values_and_counts_its_uses(api, fake):
    status, p, _ = api.malloc(MiB)
    ctypes.memset(p, 0x5A, MiB)
    status, handle, offset = api.ipc_share(p)
    assert status == OK
    status, base = api.ipc_open(handle)
    assert status == OK, api.error()
    assert ctypes.string_at(base + offset, MiB) == b"\x5a" * MiB
    assert counts()["mappings"] == 1
    # Opened again (another storage of the same segment): one mapping, two uses.
    assert api.ipc_open(handle) == (OK, base)
    assert counts()["mappings"] == 1
    assert api.ipc_close(base) == OK
    assert counts()["mappings"] == 1, "a use is left: the mapping stays"
    assert api.ipc_close(base) == OK
    assert counts()["mappings"] == 0
    assert api.ipc_close(base) == INVALID
    assert "no CUDA memory opened from another process" in api.error()
    assert api.free(p, 0) == OK


def test_sharing_what_is_not_a_live_allocation_is_refused(api, fake):
    status, p, _ = api.malloc(MiB)
    assert api.free(p, 0) == OK
    status, handle, _ = api.ipc_share(p)
    assert status == INVALID and handle == b""
    assert "cannot share" in api.error()
    status, _, _ = api.ipc_share(0x1234)
    assert status == INVALID and "no pool of pyalloc's holds it" in api.error()


@pytest.mark.parametrize("handle, says", [
    (b"", "truncated"),
    (b"\x02", "truncated"),
    (b"\x02c" + b"\0" * 10, "must hold 64 bytes"),
    (b"\x09c" + b"\0" * 64, "newer layout: version 9 of kind 'c', where pyalloc reads versions up to 2"),
    (b"\x03e" + b"\0" * 80, "version 3 of kind 'e'"),
    (b"\x02e" + b"\0" * 80, "expandable segments"),
    (b"\x02z" + b"\0" * 64, "unknown kind"),
    (b"\x02P\x01" + b"\0" * 8, "cut short"),
    (b"\x02c" + b"\0" * 64, "handles of fake devices"),
])
def test_a_handle_pyalloc_cannot_open_is_a_clear_error(api, fake, handle, says):
    status, ptr = api.ipc_open(handle)
    assert status == INVALID and ptr == 0
    assert says in api.error()
    assert counts()["mappings"] == 0


def test_a_handle_too_long_for_the_buffer_says_its_length(api, fake):
    status, p, _ = api.malloc(MiB)
    length, offset = ctypes.c_uint64(), ctypes.c_uint64()
    buf = ctypes.create_string_buffer(8)
    assert api.table.ipc_share(p, buf, 8, ctypes.byref(length), ctypes.byref(offset)) == INVALID
    assert length.value == 66 and "does not fit" in api.error()
    assert api.free(p, 0) == OK


# ---------------------------------------------------------------------------
# Two processes on the stand-in driver


def network_namespaces_can_be_made():
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


NETNS = pytest.mark.skipif(not network_namespaces_can_be_made(),
                           reason="`unshare -n` is not permitted here (needs root or user namespaces)")


@pytest.mark.parametrize("mode", ["bestfit", "vmm", "vmm-large-pid", "vmm-unshareable",
                                  "vmm-unshareable-not-permitted", "slow-sender", "fd-leaks", "vmm-ipc-dir",
                                  pytest.param("netns-abstract", marks=NETNS),
                                  pytest.param("netns-ipc-dir", marks=NETNS)])
def test_ipc_between_two_processes_on_the_stand_in_driver(stub_drivers, mode):
    stub_driver = stub_drivers["relaxed"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS]), LD_LIBRARY_PATH=str(stub_driver.parent))
    env.pop("PYALLOC_CONF", None)
    env.pop("PYALLOC_IPC_DIR", None)
    out = subprocess.run(
        [sys.executable, os.path.join(STUB_DIR, "ipc_checks.py"), str(stub_driver), "send", mode],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
    assert "pyalloc:" not in out.stderr, out.stderr
