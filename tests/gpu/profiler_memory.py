"""PyTorch's profiler sees pyalloc's allocations, as it sees its own allocator's.

torch.profiler.profile(profile_memory=True) and its memory timeline hear of
memory from the allocator (c10::reportMemoryUsageToProfiler): PyTorch's
reports each malloc (ptr, the block's bytes, the device's allocated and
reserved bytes after it, the device), each free (the same, bytes negative)
and each out-of-memory error (c10::reportOutOfMemoryToProfiler). The bridge
reports the same from pyalloc's figures; through the C hooks PyTorch reports
nothing, so the check needs the bridge.
"""
import torch
from torch._C._profiler import _EventType
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def allocations(prof):
    """[(ptr, bytes, total_allocated, total_reserved)] of the CUDA allocation events, in order."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    found = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cuda":
            f = e.extra_fields
            found.append((e.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, f.total_reserved))
    return [x[1:] for x in sorted(found)]


def main():
    bridge_only("PyTorch's profiler's memory events")
    torch.empty(1, device="cuda")  # CUDA and its context, outside the profile
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        a = torch.empty(3 * MiB + 1, dtype=torch.uint8, device="cuda")
        after_a = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        b = torch.empty(1000, dtype=torch.uint8, device="cuda")
        after_b = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        pa, pb = a.data_ptr(), b.data_ptr()
        del a
        after_free = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        try:  # refused at once: more than the device holds
            torch.empty(4 * total, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        else:
            raise AssertionError("allocating four times the device's memory succeeded")
        torch.cuda.synchronize()

    events = allocations(prof)
    assert len(events) == 3, events  # a, b, the free of a (b is still live)
    (p1, n1, alloc1, res1), (p2, n2, alloc2, res2), (p3, n3, alloc3, res3) = events
    assert p1 == pa and 3 * MiB + 1 <= n1 < 4 * MiB, events
    assert (alloc1, res1) == after_a, (events, after_a)
    assert p2 == pb and 1000 <= n2 < MiB and (alloc2, res2) == after_b, (events, after_b)
    assert (p3, n3) == (pa, -n1) and (alloc3, res3) == after_free, (events, after_free)

    # The same events as the profiler's tables read them.
    kineto = prof.profiler.kineto_results.events()
    memory = [e.nbytes() for e in kineto if e.name() == "[memory]" and e.device_type() == DeviceType.CUDA]
    assert memory == [n1, n2, -n1], memory
    ooms = [e for e in kineto if e.name() == "[OutOfMemory]"]
    assert len(ooms) == 1 and ooms[0].nbytes() == 4 * total, [(e.nbytes(), e.device_type()) for e in ooms]
    empties = [row for row in prof.key_averages() if row.key == "aten::empty"]
    assert empties and sum(row.device_memory_usage for row in empties) == n1 + n2, \
        [(row.key, row.device_memory_usage) for row in empties]

    del b
    c = torch.empty(2 * MiB, device="cuda")
    del c
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
