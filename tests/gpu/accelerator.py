"""torch.accelerator's memory functions reach pyalloc through the bridge.

torch.accelerator.memory_stats(), memory_allocated(), memory_reserved(),
reset_peak_memory_stats() and empty_cache() look the allocator up by device type
(c10::GetAllocator(kCUDA)), not through the pointer changeCurrentAllocator swaps:
the bridge registers itself there too (c10::SetAllocator). Without that they
read PyTorch's native allocator, which never served a byte: zeros, and an
empty_cache() that gives nothing back. Only the bridge does this (the C hooks
route cannot register anything).
"""
import torch

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def main():
    bridge_only("torch.accelerator's memory functions")
    if not hasattr(torch, "accelerator") or not hasattr(torch.accelerator, "memory_stats"):
        print(f"SKIP: torch {torch.__version__} has no torch.accelerator.memory_stats")
        return
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    ours = pyalloc.memory_stats(0)
    assert ours["allocated_bytes.all.current"] >= 64 * MiB, ours["allocated_bytes.all.current"]

    # The same figures as torch.cuda's (which the bridge answers) and pyalloc's own.
    assert torch._C._accelerator_isAllocatorInitialized(), "torch.accelerator sees no initialised allocator"
    theirs = torch.accelerator.memory_stats(0)
    assert "allocated_bytes.all.current" in theirs and "reserved_bytes.all.current" in theirs, list(theirs)
    unequal = {k: (v, ours[k]) for k, v in theirs.items() if k in ours and v != ours[k]}
    assert not unequal, f"torch.accelerator / pyalloc differ: {unequal}"
    assert torch.accelerator.memory_allocated(0) == torch.cuda.memory_allocated(0) == \
        ours["allocated_bytes.all.current"]
    assert torch.accelerator.memory_reserved(0) == torch.cuda.memory_reserved(0)

    # Peaks and the cache, driven through torch.accelerator, change pyalloc's.
    del x
    torch.cuda.synchronize()
    assert torch.accelerator.max_memory_allocated(0) >= 64 * MiB
    torch.accelerator.reset_peak_memory_stats(0)
    assert pyalloc.memory_stats(0)["allocated_bytes.all.peak"] < 64 * MiB
    reserved = pyalloc.memory_stats(0)["reserved_bytes.all.current"]
    torch.accelerator.empty_cache()
    after = pyalloc.memory_stats(0)["reserved_bytes.all.current"]
    assert after < reserved, (reserved, after)
    assert torch.accelerator.memory_reserved(0) == after
    print("OK")


if __name__ == "__main__":
    main()
