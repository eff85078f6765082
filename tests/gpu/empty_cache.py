"""torch.cuda.empty_cache() gives pyalloc's cached segments back to the driver."""
import torch

import pyalloc

MiB = 1 << 20


def main():
    pyalloc.install()
    keep = torch.ones(MiB, device="cuda")
    garbage = [torch.empty(40 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del garbage
    reserved = torch.cuda.memory_reserved()
    free_before, _ = torch.cuda.mem_get_info()
    assert reserved >= 160 * MiB
    torch.cuda.empty_cache()
    assert pyalloc.empty_cache() == 0  # nothing left to release
    assert torch.cuda.memory_reserved() < reserved - 150 * MiB, torch.cuda.memory_reserved()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after > free_before + 150 * MiB  # the driver has the memory back
    # keep.sum() allocates its result: that may take a fresh page, so it comes last.
    assert torch.cuda.memory_allocated() >= 4 * MiB and float(keep.sum()) == MiB
    print("OK")


if __name__ == "__main__":
    main()
