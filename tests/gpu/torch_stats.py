"""torch.cuda's memory statistics and raw allocations under pyalloc, on either route.

Through the bridge torch's own functions answer from pyalloc (nothing in torch is
replaced): torch.cuda.memory_stats() equals pyalloc.memory_stats() for every key
pyalloc reports, after resets too, torch.cuda.memory_summary() is torch's table,
torch.cuda.memory_snapshot() adds up to the stats. Through the C hooks torch's
own functions raise "not supported", so install() puts pyalloc's in their place.
torch.cuda.caching_allocator_alloc / caching_allocator_delete work on both.
"""
import torch

# torch's functions, taken before pyalloc could replace any.
ORIGINAL = {name: getattr(torch.cuda, name) for name in (
    "memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "memory_summary")}

import pyalloc  # noqa: E402

MiB = 1 << 20

# pyalloc's own keys, which no torch reports: the driver calls behind the device calls.
PYALLOC_KEYS = ("num_driver_calls",)
# pyalloc's keys that older torch releases do not report.
NEWER_KEYS = (("2.12", lambda k: k == "num_oom_rejections"),
              ("2.13", lambda k: k.startswith("reserved_bytes_by_private_pools.")))


def differences(ours, theirs):
    from torch.torch_version import TorchVersion

    version = TorchVersion(torch.__version__)
    missing = [k for k in ours if k not in theirs and k not in PYALLOC_KEYS
               and not any(version < since and newer(k) for since, newer in NEWER_KEYS)]
    unequal = {k: (ours[k], theirs[k]) for k in ours if k in theirs and ours[k] != theirs[k]}
    return missing, unequal


def compare(what):
    ours, theirs = pyalloc.memory_stats(), torch.cuda.memory_stats()
    missing, unequal = differences(ours, theirs)
    assert not missing, f"{what}: keys torch does not report: {missing}"
    assert not unequal, f"{what}: pyalloc / torch differ: {unequal}"
    return theirs


def main():
    pyalloc.install()
    route = pyalloc.is_installed()
    if route == "bridge":
        for name, fn in ORIGINAL.items():
            assert getattr(torch.cuda, name) is fn and getattr(torch.cuda.memory, name) is fn, name
            assert fn.__module__ == "torch.cuda.memory", (name, fn.__module__)
        assert torch.cuda.get_allocator_backend() == "pyalloc", torch.cuda.get_allocator_backend()
    else:
        assert route == "hooks", route
        assert torch.cuda.memory_stats is pyalloc.memory_stats  # put in torch's place
        torch.cuda.init()
        try:
            ORIGINAL["memory_stats"]()
            raise AssertionError("torch's memory_stats answered through the C hooks")
        except RuntimeError as e:
            assert "not" in str(e) and "support" in str(e), e

    # Allocations of both pools, on two streams, some freed.
    side = torch.cuda.Stream()
    xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (512, 1000, 70_000, 3 * MiB, 40 * MiB)]
    with torch.cuda.stream(side):
        ys = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (4096, 5 * MiB)]
    torch.cuda.synchronize()
    del xs[1], ys[0]
    stats = compare("after allocations")
    assert stats["allocation.all.current"] >= 5 and stats["requested_bytes.all.current"] >= 48 * MiB, stats
    assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
    assert stats["reserved_bytes.all.peak"] == torch.cuda.max_memory_reserved()

    # Raw allocations through torch's caching-allocator API, on the current stream and another.
    before = torch.cuda.memory_allocated()
    ptr = torch.cuda.caching_allocator_alloc(3 * MiB)
    ptr2 = torch.cuda.caching_allocator_alloc(1000, stream=side)
    assert ptr and ptr2 and ptr != ptr2
    assert torch.cuda.memory_allocated() == before + 3 * MiB + 1024, (torch.cuda.memory_allocated(), before)
    compare("with raw allocations")
    torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.caching_allocator_delete(ptr2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before

    # Resets, through torch.
    torch.cuda.reset_peak_memory_stats()
    stats = compare("after reset_peak_memory_stats")
    assert stats["allocated_bytes.all.peak"] == stats["allocated_bytes.all.current"]
    if route == "bridge":
        torch.cuda.reset_accumulated_memory_stats()
        stats = compare("after reset_accumulated_memory_stats")
        assert stats["allocation.all.allocated"] == 0 and stats["num_ooms"] == 0, stats

        # torch's own summary, and a snapshot that adds up to the stats.
        summary = torch.cuda.memory_summary()
        assert "PyTorch CUDA memory summary" in summary and "Allocated memory" in summary, summary
        segments = torch.cuda.memory_snapshot()
        assert len(segments) == stats["segment.all.current"], (len(segments), stats["segment.all.current"])
        assert sum(s["total_size"] for s in segments) == stats["reserved_bytes.all.current"]
        allocated = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
        assert allocated == stats["allocated_bytes.all.current"], (allocated, stats["allocated_bytes.all.current"])
    else:
        assert "pyalloc CUDA memory summary" in torch.cuda.memory_summary()

    del xs, ys
    torch.cuda.synchronize()
    compare("after frees")
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
