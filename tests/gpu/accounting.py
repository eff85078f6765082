"""memory_allocated() is the bytes of the live tensors; the stats follow torch's meanings."""
import torch

import pyalloc

KiB, MiB = 1 << 10, 1 << 20


def main():
    pyalloc.install()
    torch.cuda.init()
    base = pyalloc.memory_allocated()
    base_requested = pyalloc.memory_stats()["requested_bytes.all.current"]

    # Sizes whose blocks are exact: multiples of 512 B, each leaving its
    # segment or small chunk a remainder worth splitting off.
    sizes = [512, 4 * KiB, 64 * KiB, MiB, 2 * MiB, 4 * MiB, 6 * MiB, 30 * MiB]
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    live = sum(t.numel() * t.element_size() for t in tensors)
    assert pyalloc.memory_allocated() - base == live, (pyalloc.memory_allocated() - base, live)
    assert torch.cuda.memory_allocated() == pyalloc.memory_allocated()
    assert torch.cuda.memory_allocated(0) == torch.cuda.memory_allocated(torch.device("cuda:0"))

    # An odd size takes a 512 B-rounded block; requested_bytes keeps the exact size.
    odd = torch.empty(1000, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] - base == live + 1024
    assert stats["requested_bytes.all.current"] - base_requested == live + 1000
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()

    peak = torch.cuda.max_memory_allocated()
    del tensors, odd
    assert pyalloc.memory_allocated() == base
    assert torch.cuda.max_memory_allocated() == peak
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base
    assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()

    # A tensor's memory is on the device PyTorch asked for; frees find their pool.
    if torch.cuda.device_count() > 1:
        t1 = torch.ones(MiB, device="cuda:1")
        assert pyalloc.memory_allocated(1) == 4 * MiB
        with torch.cuda.device(0):
            del t1  # freed while device 0 is current
        assert pyalloc.memory_allocated(1) == 0
        pyalloc._C.cuda_check_invariants(1)
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
