"""reserve_buffer(): CUDA tensors from a region kept apart from the general pool."""
import gc

import torch

import pyalloc
from pyalloc import _C

MiB = 1 << 20


def main():
    pyalloc.install()
    x = torch.ones(MiB, device="cuda")  # the general pool exists
    general = _C.cuda_stats(0, "general")["reserved_bytes.all.current"]

    kv = pyalloc.reserve_buffer(64 * MiB)
    assert kv.is_cuda and kv.device == torch.device("cuda", 0) and kv.dtype == torch.uint8
    assert kv.numel() == 64 * MiB
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 64 * MiB
    assert _C.cuda_stats(0, "general")["reserved_bytes.all.current"] == general
    assert pyalloc.memory_allocated() >= 68 * MiB  # both pools count
    cache = kv.view(torch.float16).view(2, 8, 1024, 2048)  # a KV-cache layout
    cache.normal_()
    assert bool(torch.isfinite(cache.float()).all())

    # Usable from other streams like any tensor.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        total = cache.float().sum()
    cache.record_stream(side)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(total))

    del kv, cache
    gc.collect()
    torch.cuda.synchronize()
    assert _C.cuda_stats(0, "buffers")["allocated_bytes.all.current"] == 0

    # Tensor.record_stream reaches the buffer pool too: a buffer freed while another
    # stream still reads it waits for that stream.
    buf = pyalloc.reserve_buffer(64 * MiB)
    buf.fill_(7)
    out = torch.empty_like(buf)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # a few hundred ms
        out.copy_(buf)
    buf.record_stream(side)
    del buf
    gc.collect()
    if not side.query():  # still reading: the free must wait for it
        st = _C.cuda_stats(0, "buffers")
        assert st["active_bytes.all.current"] == 64 * MiB > st["allocated_bytes.all.current"] == 0, (
            "record_stream on a buffer was ignored", st)
    else:
        print("(the side stream finished early; the pending free was not exercised)")
    torch.cuda.synchronize()
    assert bool((out == 7).all())
    del out
    pyalloc.reserve_buffer(MiB)  # a buffer-pool call: the pending free completes on the way
    assert _C.cuda_stats(0, "buffers")["active_bytes.all.current"] == 0
    on_device = pyalloc.reserve_buffer(MiB, device=torch.device("cuda", 0))
    assert on_device.device.index == 0
    del on_device, x
    _C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
