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
"""
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


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
    for _ in range(3):
        churn()
    torch.cuda.synchronize()

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
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
