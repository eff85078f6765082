"""What the segment watcher hears on the stand-in driver (libcuda_stub.c).

Run by test_segment_watch.py:  watch_checks.py PATH/TO/libcuda.so.1 MODE
(MODE: vmm or bestfit). The watcher plays ProcessGroupNCCL's hooks and checks,
at each event, with the stand-in itself, that a unit told mapped is mapped
and accessible there; that a unit is told going before anything mapped
later at its address is told mapped (it is told once the pool's lock is
released, so after the driver has it back: segment_watch.h); that every event
is told before the call that caused it returns; and that the units told are
always snapshot_units' segments. Prints OK when all held.
"""
import ctypes as c
import sys

from pyalloc import _C
from bridge_api import OK, SEGMENT_EVENT_FN, BridgeApi
from stub import Stub

MiB = 1 << 20
driver = c.CDLL(sys.argv[1])
driver.stub_usable.argtypes = [c.c_uint64, c.c_size_t]
stub = Stub.in_dll(driver, "stub")
api = BridgeApi()
registered, problems, told = {}, [], {"mapped": 0, "going": 0}


def on_event(_user, device, mapped, addr, size, _pool):
    usable = driver.stub_usable(addr, size)
    if mapped:
        told["mapped"] += 1
        if not usable:
            problems.append(f"{addr:#x} told mapped before it is usable")
        if addr in registered:
            problems.append(f"{addr:#x} registered twice")
        registered[addr] = size
    else:
        told["going"] += 1
        if registered.pop(addr, None) != size:
            problems.append(f"{addr:#x} deregistered but not registered with {size} bytes")


def check_units():
    assert _C._testing_queued_segment_events() == 0, "told before the call returned"
    units = {(s["address"], s["total_size"]) for s in api.snapshot(0, units=True)}
    assert units == set(registered.items()), (units, registered)
    assert not problems, problems


def malloc(size):
    status, p, _ = api.malloc(size)
    assert status == OK, api.error()
    return p


watcher = SEGMENT_EVENT_FN(on_event)
mode = sys.argv[2]
stub.vmm = 1 if mode == "vmm" else 0
_C.cuda_configure(f"pool_size:0,strategy:{mode}")
assert api.watch_segments(watcher, None) == OK
a, b, c_ = malloc(20 * MiB), malloc(20 * MiB), malloc(20 * MiB)
check_units()
# A cap that the next request passes unless the pages of b's hole move to it.
assert api.set_memory_fraction(0, (72 * MiB) / stub.capacity) == OK
assert api.free(b, 0) == OK
maps, creates = stub.mem_map, stub.mem_create
d = malloc(30 * MiB)
check_units()
if mode == "vmm":
    assert stub.mem_map > maps and told["going"] > 0, "the hole's pages moved (unmapped, mapped again)"
small = [malloc(100_000) for _ in range(8)]
check_units()
for p in [a, c_, d] + small:
    assert api.free(p, 0) == OK
assert api.empty_cache(-1) == OK
check_units()
assert registered == {} and told["mapped"] == told["going"] > 0, told
assert api.watch_segments(SEGMENT_EVENT_FN(), None) == OK
_C.cuda_check_invariants(0)
assert stub.vmm_refused == 0 and stub.capture_invalidated == 0 and stub.bad_handle == 0
print("OK")
