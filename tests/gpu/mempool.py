"""torch.cuda.MemPool with torch.cuda.use_mem_pool through the bridge (only there: the
C hooks route has no createOrIncrefPool).

Allocations made inside the context come from the pool's own memory and keep it
after the context; torch sees the pool in MemPool.snapshot() and memory_stats();
when the pool and its tensors are gone (in either order) its memory goes back to
the device.
"""
import gc

import torch
from torch.torch_version import TorchVersion

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def pools():
    return {tuple(p["id"]): p for p in pyalloc._C.cuda_graph_pools(0)}


def private_reserved(pid):
    """torch's reserved_bytes_by_private_pools for the pool (torch 2.13 and later), else None."""
    key = f"reserved_bytes_by_private_pools.{pid[0]}_{pid[1]}.all.current"
    return torch.cuda.memory_stats().get(key)


def step(text):
    print(text, flush=True)  # says where a crash happened


def main():
    bridge_only("torch.cuda.MemPool")
    x = torch.ones(MiB, device="cuda")  # the general pool exists
    torch.cuda.synchronize()

    pool = torch.cuda.MemPool()
    pid = tuple(pool.id)
    assert pid in pools() and pools()[pid]["use_count"] == pool.use_count() == 1, (pid, pools())
    with torch.cuda.use_mem_pool(pool):
        a = torch.full((64 * MiB // 4,), 3.0, device="cuda")
        b = torch.full((1000,), 5.0, device="cuda")
        assert pool.use_count() == 2  # the context is a use, as in PyTorch's allocator
    outside = torch.full((MiB,), 7.0, device="cuda")
    assert pool.use_count() == 1

    # The pool holds what was allocated in the context, and nothing else.
    p = pools()[pid]
    assert p["allocated_bytes"] >= 64 * MiB + 4000 and p["reserved_bytes"] >= p["allocated_bytes"], p
    live = set(pyalloc._C.cuda_pool_live_blocks(0, pid))
    assert {a.data_ptr(), b.data_ptr()} <= live and outside.data_ptr() not in live, live
    # torch's view of it: MemPool.snapshot() has the pool's segments only.
    segments = pool.snapshot()
    assert segments and all(tuple(s["segment_pool_id"]) == pid for s in segments), segments
    blocks = {blk["address"] for s in segments for blk in s["blocks"] if blk["state"] == "active_allocated"}
    assert blocks == live, (blocks, live)
    assert sum(s["total_size"] for s in segments) == p["reserved_bytes"]
    if TorchVersion(torch.__version__) >= "2.13":
        assert private_reserved(pid) == p["reserved_bytes"], (private_reserved(pid), p)
    # The allocations keep their memory after the context; empty_cache leaves it alone.
    torch.cuda.empty_cache()
    assert pools()[pid]["reserved_bytes"] == p["reserved_bytes"]
    assert float(a[0]) == float(a[-1]) == 3.0 and float(b.sum()) == 5000.0 and float(outside[0]) == 7.0

    # The pool goes first, its tensors later: its memory stays until they are gone.
    torch.cuda.synchronize()
    pool_bytes = p["reserved_bytes"]
    reserved = torch.cuda.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    step("deleting a MemPool whose tensors are alive")
    del pool
    gc.collect()
    assert pools()[pid]["use_count"] == 0 and pools()[pid]["allocated_bytes"] > 0, pools()
    step("deleting its tensors")
    del a, b
    gc.collect()
    # The last free only leaves the pool marked (no device sync inside a
    # deleter): empty_cache gives it back.
    assert pools()[pid]["allocated_bytes"] == 0, pools()
    torch.cuda.empty_cache()
    assert pid not in pools(), pools()
    assert torch.cuda.memory_reserved() <= reserved - pool_bytes, (torch.cuda.memory_reserved(), reserved)
    assert torch.cuda.mem_get_info()[0] >= free_before + pool_bytes - 2 * MiB
    if TorchVersion(torch.__version__) >= "2.13":
        assert private_reserved(pid) in (None, 0), private_reserved(pid)

    # The tensors go first, the pool later: the pool keeps its memory while it exists.
    pool = torch.cuda.MemPool()
    pid = tuple(pool.id)
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
        c.fill_(1)
    torch.cuda.synchronize()
    del c
    gc.collect()
    p = pools()[pid]
    assert p["allocated_bytes"] == 0 and p["reserved_bytes"] >= 32 * MiB, p
    with torch.cuda.use_mem_pool(pool):  # used again: served from what it kept
        d = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    assert pools()[pid]["reserved_bytes"] == p["reserved_bytes"], (pools()[pid], p)
    del d
    gc.collect()
    reserved = torch.cuda.memory_reserved()
    step("deleting a MemPool with nothing alive")
    del pool
    gc.collect()
    assert pid not in pools(), pools()
    assert torch.cuda.memory_reserved() <= reserved - p["reserved_bytes"]

    # The general pool serves as before.
    y = torch.full((16 * MiB,), 2.0, device="cuda")
    assert float(y[-1]) == 2.0 and float(x.sum()) == MiB
    del y
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
