"""NCCL buffer registration under pyalloc, through the bridge: a one-rank NCCL
process group (one GPU is enough) with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1,
and a torch.cuda.MemPool over the process group's own allocator (ncclMemAlloc).

ProcessGroupNCCL registers the segments of a snapshot when its communicator is
made, then each SEGMENT_ALLOC its trackers hear of, and deregisters each by
address at its SEGMENT_FREE; NCCLComm refuses a range registered twice or
deregistered unregistered. pyalloc tells the trackers of each unit it maps
(segments, vmm's handles) and unmaps, moves included, and from the first
tracker on its snapshots list those units. A tracker that failed is said on
stderr ("an allocator trace tracker failed"), which test_gpu.py reads.

What is checked here, from outside NCCL: that the segments a snapshot lists
(what ProcessGroupNCCL registers when a communicator is made, and what
register_mem_pool registers) are each one mapping of the driver, starting at
the segment's address (asked of the driver itself, cuPointerGetAttribute:
NCCL registers by address, and a range must lie in one allocation), none
overlapping another, and that they cover every block pyalloc's own segment
list holds (its pools' bookkeeping, not the units); that every tensor used in
a collective lies in those ranges; and that a MemPool's tensor lies in one of
them. The pool is freed while it is registered and while the process group
lives: with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 NCCL's hook
deregisters every segment freed (ProcessGroupNCCL.cpp,
cacheAllocatorDeregisterHook) and NCCLComm::deregisterSegment refuses one not
registered, so deregister_mem_pool then freeing the pool would fail under
PyTorch's own allocator too. What is not checked, because only NCCL's
internals know it: that NCCL holds these registrations (ProcessGroupNCCL
keeps them in NCCLComm, not visible from Python), and whether NCCL treats a
buffer that spans several registered ranges (vmm pages of one tensor) as
registered; the check prints how many such buffers it saw.
"""
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist

import pyalloc
from gpu_common import bridge_only

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for bridge_api

MiB = 1 << 20
spanning = []  # buffers of collectives that lie in more than one registered range


def ranges(segments):
    """The (address, size) of each segment of a snapshot: what ProcessGroupNCCL
    registers for each (NCCLComm::registerSegment, keyed by address)."""
    return {(s["address"], s["total_size"]) for s in segments}


def holders(registered, lo, hi):
    """The registered ranges that [lo, hi) overlaps, by address, if together
    they cover it without a gap; None if some byte of it is in none."""
    held, at = [], lo
    for addr, size in sorted(registered):
        if addr + size <= at or addr >= hi:
            continue
        if addr > at:
            return None
        held.append((addr, size))
        at = addr + size
        if at >= hi:
            return held
    return None if at < hi else held


def block_ranges(pool_id=None):
    """The (address, size) of every allocated block in pyalloc's own segment list (its
    pools' bookkeeping, listed without the units: the C table's snapshot, whose
    blocks tile each segment in order)."""
    from bridge_api import BridgeApi

    out = set()
    for seg in BridgeApi().snapshot(0, pool_id=pool_id):
        at = seg["address"]
        for b in seg["blocks"]:
            if b["allocated"] and b["size"] > 0:
                out.add((at, b["size"]))
            at += b["size"]
    return out


# CUpointer_attribute (cuda.h): the range of a cuMemAlloc allocation, and the mapping
# (cuMemMap) a pointer lies in.
RANGE_START_ADDR, RANGE_SIZE, MAPPING_SIZE, MAPPING_BASE_ADDR = 11, 12, 18, 19


def driver_attribute(driver, attribute, ptr):
    """cuPointerGetAttribute's 64-bit answer, or None where the driver has none for ptr."""
    import ctypes

    value = ctypes.c_uint64(0)
    status = driver.cuPointerGetAttribute(ctypes.byref(value), ctypes.c_int(attribute), ctypes.c_uint64(ptr))
    return value.value if status == 0 else None


def driver_extents(driver, ptr):
    """The driver's own (start, size) of what ptr lies in, as it answers them: its
    allocation (cuMemAlloc: cudaMalloc'd segments) and its mapping (cuMemMap: vmm's
    handles, ncclMemAlloc). (None, None) for an answer it does not give."""
    return [(driver_attribute(driver, RANGE_START_ADDR, ptr), driver_attribute(driver, RANGE_SIZE, ptr)),
            (driver_attribute(driver, MAPPING_BASE_ADDR, ptr), driver_attribute(driver, MAPPING_SIZE, ptr))]


def check_units_against_driver(units, blocks, driver=None):
    """Each unit is what the driver has mapped from its address on (so NCCL can
    register it, and deregister it by that address), to its last byte; no two overlap; and every block pyalloc holds lies in them. ``driver``:
    libcuda (a stand-in on CPU)."""
    import ctypes

    driver = driver or ctypes.CDLL("libcuda.so.1")
    end = 0
    for addr, size in sorted(units):
        assert addr >= end, f"units overlap at {addr:#x} (the one before ends at {end:#x})"
        end = addr + size
        extents = driver_extents(driver, addr)
        # One allocation or mapping of the driver's starts at the unit and holds all of it.
        assert any(start == addr and size <= (length or 0) for start, length in extents), (
            f"unit {addr:#x}+{size:#x}: the driver's allocation and mapping there are "
            + ", ".join(f"{start or 0:#x}+{length or 0:#x}" for start, length in extents))
    missing = [(a, s) for a, s in sorted(blocks) if holders(units, a, a + s) is None]
    assert not missing, f"blocks outside every unit listed: {[(hex(a), s) for a, s in missing[:4]]}"


def pool_snapshot(pool_id):
    """The segments of one MemPool, as register_mem_pool asks for them."""
    try:
        return torch.cuda.memory_snapshot(mempool_id=pool_id)
    except TypeError:  # a torch whose memory_snapshot takes no pool
        return [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id)]


def check_registered(tensor, registered, what):
    """tensor's bytes lie in registered ranges; noted when in more than one."""
    lo = tensor.data_ptr()
    held = holders(registered, lo, lo + tensor.untyped_storage().nbytes())
    assert held, f"{what} at {lo:#x} lies outside every registered range"
    if len(held) > 1:
        spanning.append((what, len(held)))
    return held


def check_snapshot_is_units():
    """A snapshot now lists what the driver has mapped, one mapping a segment, and
    every block pyalloc holds lies in them: what a communicator made now registers
    is what later SEGMENT_FREEs deregister, by the same addresses."""
    torch.cuda.synchronize()
    listed = ranges(torch.cuda.memory_snapshot())
    check_units_against_driver(listed, block_ranges())
    return listed


def churn():
    """Allocations that map, unmap and (vmm) move pages: each told to NCCL."""
    keep = []
    for i in range(6):
        keep.append(torch.empty((8 + 6 * i) * MiB, dtype=torch.uint8, device="cuda"))
    for t in keep[::2]:
        t.fill_(1)
    del keep[::2]
    big = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")  # past the freed holes
    x = torch.ones(4 * MiB, device="cuda")
    dist.all_reduce(x)  # on registered memory
    assert float(x[0]) == 1.0
    registered = check_snapshot_is_units()
    check_registered(x, registered, "an all_reduce's 16 MiB")
    check_registered(big, registered, "a 96 MiB buffer")
    del keep, big, x
    torch.cuda.empty_cache()  # units unmapped: deregistered first


def main():
    assert os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK") == "1"
    bridge_only("NCCL registration through allocator trace trackers")
    if not dist.is_nccl_available():
        print("SKIP: this torch has no NCCL")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free one: checks run side by side
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.cuda.set_device(0)
    before = torch.ones(16 * MiB, device="cuda")  # segments the communicator registers when made
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dist.all_reduce(before)  # makes the communicator
    torch.cuda.synchronize()
    segments = torch.cuda.memory_snapshot()
    assert segments and all(s["total_size"] > 0 for s in segments), segments
    # The hook's tracker is attached: snapshots list the units told to it.
    registered = check_snapshot_is_units()
    check_registered(before, registered, "the tensor of the first all_reduce")
    for _ in range(3):
        churn()
    torch.cuda.synchronize()
    check_snapshot_is_units()  # after unmaps and moves too

    # A MemPool over NCCL's own allocator: its segments come from ncclMemAlloc.
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda", 0))
    allocator = getattr(backend, "mem_allocator", None)
    if allocator is None:
        print("SKIP: this ProcessGroupNCCL has no mem_allocator (NCCL too old)")
        dist.destroy_process_group()
        return 0
    pool = torch.cuda.MemPool(allocator)
    with torch.cuda.use_mem_pool(pool):
        t = torch.ones(32 * MiB // 4, device="cuda")
    registers = hasattr(backend, "register_mem_pool")  # torch 2.7 and later
    if registers:
        backend.register_mem_pool(pool)
        # What register_mem_pool registered: the pool's segments, each one
        # ncclMemAlloc segment and so one unit, told as such.
        pool_ranges = ranges(pool_snapshot(tuple(pool.id)))
        check_units_against_driver(pool_ranges, block_ranges(tuple(pool.id)))
        held = check_registered(t, pool_ranges, "a MemPool's tensor")
        assert len(held) == 1, f"a MemPool tensor spans {len(held)} registered ranges"
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert float(t[0]) == float(t[-1]) == 1.0
    live = set(pyalloc._C.cuda_pool_live_blocks(0, tuple(pool.id)))
    assert t.data_ptr() in live, live
    # Freed while registered and while the process group lives: the hook deregisters
    # each segment as it goes (deregistering the pool first would leave it to deregister
    # what is no longer registered, which NCCLComm refuses), as a tensor's memory
    # goes in a training run.
    del t
    gc.collect()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    del backend, allocator
    dist.destroy_process_group()
    pyalloc._C.cuda_check_invariants(0)
    # Not a failure: whether NCCL uses such buffers as registered is NCCL's.
    print(f"buffers in more than one registered range: {spanning}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
