"""torch.cuda.MemPool(no_split=True) and MemPool(use_on_oom=True) through the bridge
(only there: the C hooks route has no createOrIncrefPool).

no_split: every allocation of the pool holds a block of its own, and a cached block
larger than a request serves it whole (PyTorch's should_split over no_split_pools).
use_on_oom: an allocation routed to no pool that would otherwise run out of memory
takes a free block of the pool, which its free gives back to the pool (PyTorch's
malloc over use_on_oom_pools); a pool without the option serves no one else.
The device is capped with the memory fraction, which caps every pool of it together.
"""
import gc

import torch

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def live(pid):
    return set(pyalloc._C.cuda_pool_live_blocks(0, pid))


def blocks_per_segment(pool):
    return [[(b["size"], b["state"]) for b in s["blocks"]] for s in pool.snapshot()]


def check_no_split():
    pool = torch.cuda.MemPool(no_split=True)
    with torch.cuda.use_mem_pool(pool):
        a = torch.empty(1000, dtype=torch.uint8, device="cuda")
        b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    segments = blocks_per_segment(pool)
    assert len(segments) == 2 and all(len(s) == 1 and s[0][1] == "active_allocated" for s in segments), segments
    b_ptr = b.data_ptr()
    del b
    gc.collect()
    with torch.cuda.use_mem_pool(pool):
        c = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    assert c.data_ptr() == b_ptr  # the cached block, taken whole
    segments = blocks_per_segment(pool)
    assert all(len(s) == 1 for s in segments), segments
    c.fill_(1)
    a.fill_(2)
    torch.cuda.synchronize()
    del a, c, pool
    gc.collect()


def fill_and_cap(pool, nbytes):
    """The pool caches `nbytes`; the device is capped 64 MiB above what is reserved."""
    with torch.cuda.use_mem_pool(pool):
        big = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    big.fill_(0)
    torch.cuda.synchronize()
    del big
    gc.collect()
    torch.cuda.empty_cache()  # the pool has a use: its cache stays
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * MiB) / total)


def check_use_on_oom():
    pool = torch.cuda.MemPool(use_on_oom=True)
    pid = tuple(pool.id)
    fill_and_cap(pool, 1024 * MiB)
    try:
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")  # routed to no pool
        assert x.data_ptr() in live(pid), "the use_on_oom pool's cache did not serve it"
        x.fill_(7)
        assert int(x[-1]) == 7
        del x
        gc.collect()
        assert live(pid) == set()  # its free went back to the pool
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del pool
    gc.collect()
    torch.cuda.empty_cache()

    plain = torch.cuda.MemPool()
    fill_and_cap(plain, 1024 * MiB)
    try:
        try:
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
            raise AssertionError("a pool without use_on_oom served another allocation")
        except torch.cuda.OutOfMemoryError:
            pass
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del plain
    gc.collect()


def main():
    bridge_only("torch.cuda.MemPool(no_split=True, use_on_oom=True)")
    check_no_split()
    check_use_on_oom()
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
