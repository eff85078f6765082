"""Tensor.record_stream keeps a block from reuse while a side stream still reads it."""
import torch

import pyalloc

N = 16 << 20  # floats: 64 MiB
SLEEP_CYCLES = 500_000_000  # a few hundred ms on the side stream


def side_read(x, out, side):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        out.copy_(x)


def main():
    pyalloc.install()
    side = torch.cuda.Stream()

    # Control: without record_stream the freed block is reused at once on the
    # default stream, so the check below is meaningful.
    x = torch.full((N,), 7.0, device="cuda")
    out = torch.empty_like(x)
    side_read(x, out, side)
    address = x.data_ptr()
    del x
    y = torch.empty(N, device="cuda")
    assert y.data_ptr() == address, "expected immediate reuse without record_stream"
    torch.cuda.synchronize()
    del y

    # With record_stream the block waits for the side stream.
    x = torch.full((N,), 7.0, device="cuda")
    out = torch.empty_like(x)
    side_read(x, out, side)
    x.record_stream(side)
    address = x.data_ptr()
    del x
    busy = not side.query()
    if busy:
        stats = pyalloc.memory_stats()
        assert stats["active_bytes.all.current"] > stats["allocated_bytes.all.current"]
    y = torch.full((N,), -1.0, device="cuda")  # overwrites whatever block it gets
    if busy:
        assert y.data_ptr() != address, "a block still read by the side stream was reused"
    torch.cuda.synchronize()
    assert bool((out == 7.0).all()), "the side stream read overwritten memory"
    assert bool((y == -1.0).all())
    pyalloc._C.cuda_check_invariants(0)
    print("OK" if busy else "OK (side stream finished early; reuse not exercised)")


if __name__ == "__main__":
    main()
