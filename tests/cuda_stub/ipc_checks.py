"""CUDA IPC between two processes on the stand-in driver (libcuda_stub.c).

Run by test_ipc.py in a fresh process whose LD_LIBRARY_PATH finds the
stand-in as libcuda.so.1:  ipc_checks.py PATH/TO/libcuda.so.1 send MODE
MODE: "bestfit" (legacy IPC handles of segments), "vmm" (pages as file
descriptors over the sender's socket), "vmm-large-pid" (the same from a
sender whose process id has 7 digits), "vmm-unshareable" (the device refuses
shareable pages: sharing is refused, the pools still work), "vmm-unshareable-
not-permitted" (the same, refused with CUDA_ERROR_NOT_PERMITTED), "slow-sender" (a
sender that never answers stalls no other open or close), "fd-leaks" (no
descriptor is left open when an export or an import fails). The sender calls
the bridge's table as the bridge does for PyTorch's shareIpcHandle, and
starts receivers (this script with "receive"), which open the handle as the
bridge's getIpcDevPtr does, read and write the memory, and answer in JSON.
Prints OK when every check passed.
"""
import collections
import ctypes as c
import json
import os
import subprocess
import sys

from pyalloc import _C
from bridge_api import ERROR, INVALID, OK, BridgeApi
from stub import Stub

MiB = 1 << 20
LIB = sys.argv[1]
driver = c.CDLL(LIB)
stub = Stub.in_dll(driver, "stub")
api = BridgeApi()


def receive(request):
    """In the receiving process: open, read, write back, open again, close."""
    handle = bytes.fromhex(request["handle"])
    fds = open_fds()
    if request.get("open_during_capture"):
        return open_during_capture(handle, request["device"])
    status, base = api.ipc_open(handle, request["device"])
    if status != OK:
        return {"error": api.error(), "mappings": _C.cuda_ipc_counts()["mappings"],
                "imported": stub.imported, "ipc_opened": stub.ipc_opened,
                "fds_left": dict(open_fds() - fds)}
    if request.get("close_during_capture"):
        return close_during_capture(base, request["device"])
    if request.get("wait_fails"):
        return close_when_the_wait_fails(base)
    if request.get("sync_paused"):
        return close_while_the_device_is_waited_for(handle, base, request["device"])
    ptr, size = base + request["offset"], request["size"]
    seen = c.string_at(ptr, size)
    c.memset(ptr + size // 2, request["reply"], size - size // 2)
    again = api.ipc_open(handle, request["device"])
    while_open = dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened,
                      ipc_open=stub.ipc_open)
    # Kernels queued on the memory (`y = model(t); del t`): its last close
    # waits for them before it unmaps, the first has nothing to unmap.
    stub.work_queued = 1
    assert api.ipc_close(base) == OK, api.error()
    syncs = stub.ctx_synchronize
    assert api.ipc_close(again[1]) == OK, api.error()
    return {
        "seen_pattern": seen == bytes([request["pattern"]]) * size,
        "same_mapping": again == (OK, base),
        "while_open": while_open,
        "syncs": [syncs, stub.ctx_synchronize], "unmapped_under_work": stub.unmapped_under_work,
        "after": dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened),
    }


def close_when_the_wait_fails(base):
    """In the receiving process: the device cannot be waited for (a kernel
    failed: the error is sticky). Its kernels may still use the memory, so it
    stays mapped; the close says why."""
    stub.work_queued, stub.sync_error = 1, 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    status = api.ipc_close(base)
    return {"status": status, "error": api.error(), "unmapped_under_work": stub.unmapped_under_work,
            "after": dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened)}


def close_while_the_device_is_waited_for(handle, base, device):
    """In the receiving process: the last close of the memory waits for the device
    (cuCtxSynchronize, held here), on one thread; another closes on another. Regression:
    the wait ran under the receivers' lock, so every other open and close of the
    process (tensors' deleters, any thread) waited behind a whole device's work.
    An open of the same handle meanwhile waits for the unmap, then maps it afresh."""
    import threading
    import time

    stub.work_queued, stub.pause_ctx_synchronize = 1, 1
    closed = {}
    closer = threading.Thread(target=lambda: closed.setdefault("status", api.ipc_close(base)))
    closer.start()
    deadline = time.monotonic() + 20
    while not stub.paused and time.monotonic() < deadline:
        time.sleep(0.001)
    held = bool(stub.paused)
    other = {}
    another = threading.Thread(target=lambda: other.setdefault("status", api.ipc_close(0x1000)))
    another.start()
    another.join(timeout=10)
    stalled = another.is_alive()
    reopened = {}
    reopener = threading.Thread(target=lambda: reopened.setdefault("got", api.ipc_open(handle, device)))
    reopener.start()
    reopener.join(timeout=1)
    reopen_waited = reopener.is_alive()
    stub.paused = 0  # the device's work is done
    closer.join()
    another.join()
    reopener.join()
    status, again = reopened["got"]
    if status == OK:
        assert api.ipc_close(again) == OK, api.error()
    return {"held": held, "stalled": stalled, "closed": closed["status"], "other": other["status"],
            "reopen_waited": reopen_waited, "reopened": status,
            "unmapped_under_work": stub.unmapped_under_work,
            "after": dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened)}


def check_a_close_waiting_for_the_device_stalls_no_other(p, size):
    handle, offset = share(p)
    got = ask(handle, offset, size, sync_paused=True)
    assert got["held"], got
    assert not got["stalled"], "a close waited for another thread's close to synchronize the device"
    assert got["closed"] == OK and got["other"] == INVALID, got
    assert got["reopen_waited"] and got["reopened"] == OK, got
    assert got["unmapped_under_work"] == 0, "it still waits for the device before it unmaps"
    assert got["after"]["mappings"] == 0 and got["after"]["imported"] + got["after"]["ipc_opened"] == 0, got


def begin_capture(device):
    """torch 2.13's markCaptureBegin, and a stream capturing."""
    assert api.mark_capture(device, 1) == OK, api.error()
    stub.capture_id, stub.capturing_stream = 93, 0x5300
    stub.forbidden_during_capture = stub.relaxed_during_capture = 0


def open_during_capture(handle, device):
    """In the receiving process: the memory opened while another thread
    captures a CUDA graph, as a consumer thread receives tensors then. Importing,
    reserving and mapping are legal then in relaxed mode only; closing waits for
    the capture's end."""
    begin_capture(device)
    status, base = api.ipc_open(handle, device)
    during = dict(_C.cuda_ipc_counts(), status=status, error=api.error() if status != OK else "",
                  forbidden=stub.forbidden_during_capture, relaxed=stub.relaxed_during_capture,
                  invalidated=stub.capture_invalidated, mode=driver.stub_thread_mode())
    if status == OK:
        assert api.ipc_close(base) == OK, api.error()
    during["deferred_after_close"] = _C.cuda_ipc_counts()["deferred_unmaps"]
    stub.capturing_stream = 0  # cudaStreamEndCapture
    assert api.mark_capture(device, 0) == OK, api.error()
    return {"during": during, "after": dict(_C.cuda_ipc_counts(), imported=stub.imported,
                                            ipc_opened=stub.ipc_opened)}


def close_during_capture(base, device):
    """In the receiving process: the memory closed while a CUDA graph is captured
    (torch 2.13's markCaptureBegin, a stream capturing), as a tensor received
    may be freed then on any thread. Unmapping it then would break the capture
    (CUDA's default global mode): it waits for the capture's end."""
    begin_capture(device)
    closed = api.ipc_close(base)
    during = dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened,
                  forbidden=stub.forbidden_during_capture)
    reopened = api.ipc_close(base)  # closed already: no use left to drop
    stub.capturing_stream = 0  # cudaStreamEndCapture
    assert api.mark_capture(device, 0) == OK, api.error()
    return {"closed": closed, "during": during, "closed_twice": reopened,
            "after": dict(_C.cuda_ipc_counts(), imported=stub.imported, ipc_opened=stub.ipc_opened,
                          forbidden=stub.forbidden_during_capture)}


def check_a_close_during_a_capture_waits_for_its_end(p, size):
    handle, offset = share(p)
    got = ask(handle, offset, size, close_during_capture=True)
    assert got["closed"] == OK and got["closed_twice"] == INVALID, got
    during, after = got["during"], got["after"]
    assert during["forbidden"] == 0, got
    assert during["mappings"] == 1 and during["deferred_unmaps"] == 1, got
    assert during["imported"] + during["ipc_opened"] >= 1, got
    assert after["mappings"] == 0 and after["deferred_unmaps"] == 0, got
    assert after["imported"] == 0 and after["ipc_opened"] == 0 and after["forbidden"] == 0, got


def check_a_close_that_cannot_wait_leaves_the_memory_mapped(p, size):
    handle, offset = share(p)
    got = ask(handle, offset, size, wait_fails=True)
    assert got["status"] == ERROR and "cuCtxSynchronize" in got["error"], got
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in got["error"] and "stays mapped" in got["error"], got
    assert got["unmapped_under_work"] == 0 and got["after"]["mappings"] == 0, got
    assert got["after"]["imported"] + got["after"]["ipc_opened"] >= 1, got


def check_an_open_during_a_capture_breaks_nothing(p, size):
    """Regression: a receiver's open imported, reserved and mapped (or opened a
    legacy handle) in CUDA's global capture mode, which invalidates another
    thread's capture; they run in relaxed mode now."""
    handle, offset = share(p)
    got = ask(handle, offset, size, open_during_capture=True)
    during, after = got["during"], got["after"]
    assert during["status"] == OK and during["mappings"] == 1, got
    assert during["forbidden"] == 0 and during["invalidated"] == 0 and during["relaxed"] > 0, got
    assert during["mode"] == 0, "the thread's capture mode is restored"
    assert during["deferred_after_close"] == 1, got  # its close waited for the capture's end
    assert after["mappings"] == 0 and after["imported"] == 0 and after["ipc_opened"] == 0, got


RECEIVER_PREFIX = []  # "unshare -n": receivers in a network namespace of their own


def ask(handle, offset, size, pattern=0, reply=0, device=0, env=None, **more):
    """Starts a receiving process for the handle; its answer."""
    request = {"handle": handle.hex(), "offset": offset, "size": size, "pattern": pattern,
               "reply": reply, "device": device, **more}
    out = subprocess.run(RECEIVER_PREFIX + [sys.executable, __file__, LIB, "receive"], input=json.dumps(request),
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def malloc(size):
    status, p, _ = api.malloc(size)
    assert status == OK, api.error()
    return p


def share(p):
    status, handle, offset = api.ipc_share(p)
    assert status == OK, api.error()
    return handle, offset


def check_a_received_block_is_the_senders_memory(size=3 * MiB):
    """Values cross both ways; two opens make one mapping; the close unmaps it."""
    p = malloc(size)
    c.memset(p, 0x11, size)
    handle, offset = share(p)
    got = ask(handle, offset, size, pattern=0x11, reply=0x22)
    assert got["seen_pattern"], got
    assert got["same_mapping"], got
    assert got["while_open"]["mappings"] == 1, got
    assert got["after"]["mappings"] == 0 and got["after"]["imported"] == 0, got
    assert got["after"]["ipc_opened"] == 0, got
    # PyTorch synchronizes the device before it unmaps imported pages: the
    # driver's unmap does not wait for kernels still using them.
    assert got["syncs"][1] == got["syncs"][0] + 1 and got["unmapped_under_work"] == 0, got
    assert c.string_at(p + size // 2, size - size // 2) == b"\x22" * (size - size // 2)
    assert c.string_at(p, size // 2) == b"\x11" * (size // 2)
    assert share(p) == (handle, offset), "the same allocation gives the same handle"
    check_a_close_during_a_capture_waits_for_its_end(p, size)
    check_an_open_during_a_capture_breaks_nothing(p, size)
    check_a_close_that_cannot_wait_leaves_the_memory_mapped(p, size)
    check_a_close_waiting_for_the_device_stalls_no_other(p, size)
    return p, handle, offset, got


def bestfit():
    _C.cuda_configure("pool_size:0,strategy:bestfit")
    p, handle, offset, got = check_a_received_block_is_the_senders_memory()
    assert handle[:2] == b"\x02c" and len(handle) == 66
    assert got["while_open"]["ipc_open"] == 1, "opened twice, one cuIpcOpenMemHandle"
    assert stub.ipc_get >= 1
    # A block elsewhere in the same segment: the receiver maps the segment again.
    q = malloc(MiB)
    c.memset(q, 0x33, MiB)
    handle_q, offset_q = share(q)
    assert handle_q == handle and offset_q != offset
    assert ask(handle_q, offset_q, MiB, pattern=0x33, reply=0x44)["seen_pattern"]
    # A segment of another allocator (PyTorch's own): its handle as PyTorch
    # before 2.2 sent it, the driver's 64 bytes alone, and as it sends it now.
    driver.cuCtxSetCurrent.argtypes = [c.c_void_p]
    driver.stub_context.restype = c.c_void_p
    driver.stub_context.argtypes = [c.c_int]
    driver.cuCtxSetCurrent(driver.stub_context(0))
    other = c.c_uint64()
    assert driver.cuMemAlloc_v2(c.byref(other), c.c_size_t(2 * MiB)) == 0
    raw = (c.c_char * 64)()
    assert driver.cuIpcGetMemHandle(raw, other) == 0
    driver.cuCtxSetCurrent(None)
    c.memset(other.value, 0x55, 2 * MiB)
    for foreign, reply in ((bytes(raw), 0x55), (b"\x02c" + bytes(raw), 0x66)):
        got = ask(foreign, 0, 2 * MiB, pattern=0x55, reply=reply)
        assert got["seen_pattern"] and got["after"]["ipc_opened"] == 0, got
    assert c.string_at(other.value + MiB, MiB) == b"\x66" * MiB
    # Its segment back to the driver: the old handle names nothing any more.
    assert api.free(p, 0) == OK and api.free(q, 0) == OK
    assert api.empty_cache(-1) == OK
    got = ask(handle, offset, MiB)
    assert "opening a CUDA IPC handle failed" in got.get("error", ""), got
    assert got["mappings"] == 0 and got["ipc_opened"] == 0, got


def open_fds():
    """This process's descriptors by kind, counted; the memfds of pages beyond the
    stand-in's own (one per live handle) as "exported pages"."""
    kinds = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # listdir's own
            continue
        kinds["exported pages" if name.startswith("/memfd:stub-pages") else name.split(":")[0]] += 1
    kinds["exported pages"] -= stub.fd_handles
    return kinds


def handle_bytes(handle):
    """The bytes of the handles a 'P' handle names (ipc.cpp's PagesHandle)."""
    return int.from_bytes(handle[2 + 1 + 4 + 8:2 + 1 + 4 + 8 + 8], "little")


def handle_count(handle):
    """The number of handles a 'P' handle names (ipc.cpp's PagesHandle)."""
    return int.from_bytes(handle[2 + 1 + 4 + 8 + 8:2 + 1 + 4 + 8 + 8 + 4], "little")


def vmm():
    stub.vmm = 1
    _C.cuda_configure("pool_size:0,strategy:vmm")
    fds = open_fds()
    big = malloc(40 * MiB)  # pages the receiver has no business mapping
    c.memset(big, 0x77, 40 * MiB)
    exports = stub.exports
    p, handle, offset, got = check_a_received_block_is_the_senders_memory()
    assert _C.cuda_config()["strategy"] == "vmm"
    assert handle[:2] == b"\x02P" and handle[2] == 1, "an abstract socket unless PYALLOC_IPC_DIR is set"
    # Regression: each share exported the handles (only to count them), and
    # each receiver's request exported them again. Once, at the first share:
    # the export keeps their descriptors and sends each receiver copies.
    assert stub.exports - exports == handle_count(handle) == _C.cuda_ipc_counts()["handles_exported"], (
        stub.exports - exports, handle_count(handle))
    assert _C.cuda_ipc_counts()["exports"] == 1
    # The receiver mapped the handles under the block, no more.
    mapped = got["while_open"]["mapped_bytes"]
    reserved = api.stats(0)["reserved_bytes.all.current"]
    assert 3 * MiB <= mapped == handle_bytes(handle) < reserved, (mapped, reserved)
    assert got["while_open"]["imported"] >= 1 and got["after"]["imported"] == 0, got
    # Pages around it go back to the driver; the shared ones stay where they are.
    # Regression: once anything was exported, every free took the exports'
    # lock of the whole process; now only the free of an exported allocation.
    locked = _C.cuda_ipc_counts()["frees_locked"]
    others = [malloc(MiB) for _ in range(16)]
    for q in others + [big]:
        assert api.free(q, 0) == OK
    assert _C.cuda_ipc_counts()["frees_locked"] == locked, "frees of unexported blocks took the lock"
    assert api.empty_cache(-1) == OK
    assert api.stats(0)["reserved_bytes.all.current"] < reserved
    again = ask(handle, offset, 3 * MiB, pattern=0x22, reply=0x22)
    assert c.string_at(p, MiB) == b"\x11" * MiB
    assert not again["seen_pattern"] and "error" not in again  # first half 0x11, second 0x22
    # Freed by its owner: the export ends, and a late receiver is refused.
    served = _C.cuda_ipc_counts()["served"]
    # One request per receiving process (its second open is cached), and one more from the
    # receiver that opens the handle again once its mapping was unmapped.
    assert served == 7, served
    assert api.free(p, 0) == OK
    assert _C.cuda_ipc_counts()["exports"] == 0
    assert _C.cuda_ipc_counts()["frees_locked"] == locked + 1
    got = ask(handle, offset, 3 * MiB)
    assert "is no longer shared: its allocation was freed" in got.get("error", ""), got
    assert got["mappings"] == 0 and got["imported"] == 0, got
    assert _C.cuda_ipc_counts()["refused"] == 1 and _C.cuda_ipc_counts()["served"] == served
    # Every descriptor exported for a receiver was closed: the server's socket is left.
    assert open_fds() - fds == collections.Counter(socket=1), (open_fds(), fds)
    _C.cuda_check_invariants(0)


def vmm_large_pid():
    """Regression: the server's name held the process's id as written, so a sender
    whose id has 7 digits (pid_max reaches 4194304) made 'P' handles of 64 bytes,
    which receivers read as the driver's legacy handle sent alone (as PyTorch does
    a handle of that length) and failed to open."""
    stub.vmm = 1
    _C._testing_ipc_process_id(1234567)
    _C.cuda_configure("pool_size:0,strategy:vmm")
    p, handle, _, _ = check_a_received_block_is_the_senders_memory()
    assert handle[:2] == b"\x02P" and len(handle) != 64, len(handle)
    assert int.from_bytes(handle[3:7], "little") == 1234567
    assert b"1234567" in handle
    # Every 'P' handle has one length, whatever the id: the shortest the same.
    assert len(handle) == 2 + 1 + 4 + 8 + 8 + 4 + 1 + len("pyalloc-ipc.0001234567.") + 16
    assert api.free(p, 0) == OK


def pages_handle(socket_name, pid=4242, export=77, size=2 * MiB, handles=1):
    """A 'P' handle (ipc.cpp's PagesHandle) naming a server at `socket_name`."""
    name = socket_name.encode()
    return (b"\x02P\x01" + pid.to_bytes(4, "little") + export.to_bytes(8, "little") +
            size.to_bytes(8, "little") + handles.to_bytes(4, "little") + bytes([len(name)]) + name)


def slow_sender():
    """Regression: open() held the receivers' lock while it asked the sender for
    its pages, each step waiting up to 30 s: a stopped or slow sender stalled
    every other open and close of the process (tensors' deleters, any thread)."""
    import socket
    import threading

    stub.vmm = 1
    name = f"pyalloc-test-silent.{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(1)
    opened = {}

    def open_it():
        opened["status"] = api.ipc_open(pages_handle(name))[0]
        opened["error"] = api.error()

    waiting = threading.Thread(target=open_it)
    waiting.start()
    conn, _ = server.accept()  # the receiver now waits for an answer that does not come
    assert conn.recv(8) == (77).to_bytes(8, "little")
    other = {}
    closer = threading.Thread(target=lambda: other.setdefault("status", api.ipc_close(0x1000)))
    closer.start()
    closer.join(timeout=20)
    stalled = closer.is_alive()
    conn.close()  # the sender gives up: the waiting open fails
    waiting.join()
    closer.join()
    assert not stalled, "a close waited for another thread's open to hear from its sender"
    assert other["status"] == INVALID
    assert opened["status"] == ERROR and "failed: no answer" in opened["error"], opened
    assert _C.cuda_ipc_counts()["mappings"] == 0
    server.close()


def fd_leaks():
    """Regression: descriptors were left open on error paths. The sender's, when
    exporting the handles under a block failed after the first (a driver error
    thrown by the context switch), and the receiver's, when mapping the pages it
    was sent failed (here on a device it does not have)."""
    stub.vmm = 1
    _C.cuda_configure("pool_size:0,strategy:vmm")
    p = malloc(40 * MiB)  # over several handles
    fds = open_fds()
    # The first handle's export switches context twice (in and back); the third switch fails.
    stub.fail_ctx_set_in = 3
    status, handle, _ = api.ipc_share(p)
    assert status == ERROR and handle == b"" and "cuCtxSetCurrent" in api.error(), api.error()
    assert stub.fail_ctx_set_in == 0 and stub.exports >= 1
    assert open_fds() == fds, (open_fds(), fds)
    # Shared, then opened on device 7: the receiver had the descriptors when it failed.
    handle, offset = share(p)
    got = ask(handle, offset, MiB, device=7)
    assert "cuDeviceGet" in got.get("error", ""), got
    assert got["fds_left"] == {} and got["mappings"] == 0 and got["imported"] == 0, got
    assert _C.cuda_ipc_counts()["served"] == 1
    assert api.free(p, 0) == OK
    assert open_fds() - fds == collections.Counter(socket=1), (open_fds(), fds)


def vmm_unshareable(refusal=0):
    """The device refuses pages with a POSIX file descriptor handle: with
    CUDA_ERROR_NOT_SUPPORTED (the stand-in's default), or as real drivers also
    answer, CUDA_ERROR_NOT_PERMITTED (regression: only NOT_SUPPORTED and
    INVALID_VALUE fell back to unshareable pages; any other refusal left the
    device without vmm). PyTorch's expandable segments take any error but out
    of memory as "this handle type is not supported" and fall back."""
    stub.vmm = 1
    stub.refuse_fd_handles = 1
    stub.refuse_fd_handles_with = refusal
    _C.cuda_configure("pool_size:0,strategy:vmm")
    p = malloc(3 * MiB)
    assert _C.cuda_config()["strategy"] == "vmm", "pages that cannot be shared still serve the process"
    status, handle, _ = api.ipc_share(p)
    assert status == ERROR and handle == b""
    assert "the device refused pages with a POSIX file descriptor handle" in api.error(), api.error()
    assert ("CUDA_ERROR_NOT_PERMITTED" if refusal == 800 else "CUDA_ERROR_NOT_SUPPORTED") in api.error()
    assert _C.cuda_ipc_counts()["exports"] == 0
    assert api.free(p, 0) == OK


def vmm_ipc_dir():
    """PYALLOC_IPC_DIR: the sender serves its pages from a socket file there,
    of its owner alone, which a receiver reaches through the same directory
    (in another network namespace too: the mode "netns-ipc-dir"); a receiver
    without it is told what to set."""
    import stat
    import tempfile

    stub.vmm = 1
    with tempfile.TemporaryDirectory() as shared:
        os.environ["PYALLOC_IPC_DIR"] = shared
        _C.cuda_configure("pool_size:0,strategy:vmm")
        p, handle, offset, got = check_a_received_block_is_the_senders_memory()
        assert handle[:2] == b"\x02P" and handle[2] == 2, handle
        [name] = os.listdir(shared)
        assert name.encode() in handle
        mode = os.stat(os.path.join(shared, name)).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)
        alone = dict(os.environ)
        del alone["PYALLOC_IPC_DIR"]
        refused = ask(handle, offset, MiB, env=alone)
        assert "set PYALLOC_IPC_DIR in this process too" in refused.get("error", ""), refused
        assert refused["mappings"] == 0 and refused["imported"] == 0, refused
        assert api.free(p, 0) == OK


def netns_abstract():
    """A receiver in another network namespace cannot reach the sender's
    abstract socket: the error says what to change."""
    stub.vmm = 1
    RECEIVER_PREFIX[:] = ["unshare", "-n"]
    _C.cuda_configure("pool_size:0,strategy:vmm")
    p = malloc(3 * MiB)
    handle, offset = share(p)
    got = ask(handle, offset, MiB)
    assert "another network namespace" in got.get("error", ""), got
    assert "set PYALLOC_IPC_DIR, in both processes" in got["error"], got
    assert got["mappings"] == 0 and got["imported"] == 0, got
    assert api.free(p, 0) == OK


def netns_ipc_dir():
    """Receivers in a network namespace of their own (as in another container)
    open the pages through the socket file in PYALLOC_IPC_DIR."""
    RECEIVER_PREFIX[:] = ["unshare", "-n"]
    vmm_ipc_dir()


if sys.argv[2] == "receive":
    print(json.dumps(receive(json.loads(sys.stdin.read()))))
else:
    {"bestfit": bestfit, "vmm": vmm, "vmm-large-pid": vmm_large_pid, "vmm-unshareable": vmm_unshareable,
     "vmm-unshareable-not-permitted": lambda: vmm_unshareable(800),
     "slow-sender": slow_sender, "fd-leaks": fd_leaks, "vmm-ipc-dir": vmm_ipc_dir,
     "netns-abstract": netns_abstract, "netns-ipc-dir": netns_ipc_dir}[sys.argv[3]]()
    assert stub.bad_handle == 0 and stub.vmm_refused == 0 and stub.capture_invalidated == 0
    print("OK")
