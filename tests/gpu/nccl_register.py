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
register_mem_pool registers) are exactly the units the bridge tells its
trackers (pyalloc's C table, snapshot_units), so that every range registered
is later deregistered by its address; that every tensor used in a collective
lies in those ranges; and that a MemPool's tensor lies in one of them. What is
not checked, because only NCCL's internals know it: that NCCL holds these
registrations (ProcessGroupNCCL keeps them in NCCLComm, not visible from
Python), and whether NCCL treats a buffer that spans several registered
ranges (vmm pages of one tensor) as registered; the check prints how many
such buffers it saw.
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


def told_units(pool_id=None):
    """The units the bridge has told its trackers (pyalloc's side of the story)."""
    from bridge_api import BridgeApi

    return ranges(BridgeApi().snapshot(0, pool_id=pool_id, units=True))


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
    """A snapshot now lists exactly the units told: what a communicator made now
    registers is what later SEGMENT_FREEs deregister."""
    torch.cuda.synchronize()
    listed, told = ranges(torch.cuda.memory_snapshot()), told_units()
    assert listed == told, (
        f"snapshot lists {sorted(listed - told)[:4]} not told, units told {sorted(told - listed)[:4]} not listed")
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
        assert pool_ranges == told_units(tuple(pool.id)), (pool_ranges, told_units(tuple(pool.id)))
        held = check_registered(t, pool_ranges, "a MemPool's tensor")
        assert len(held) == 1, f"a MemPool tensor spans {len(held)} registered ranges"
    dist.all_reduce(t)
    torch.cuda.synchronize()
    assert float(t[0]) == float(t[-1]) == 1.0
    live = set(pyalloc._C.cuda_pool_live_blocks(0, tuple(pool.id)))
    assert t.data_ptr() in live, live
    if registers:
        backend.deregister_mem_pool(pool)
    del t
    gc.collect()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    pyalloc._C.cuda_check_invariants(0)
    # Not a failure: whether NCCL uses such buffers as registered is NCCL's.
    print(f"buffers in more than one registered range: {spanning}")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
