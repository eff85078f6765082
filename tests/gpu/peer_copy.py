"""Memory of one GPU read by another: copies both ways, and record_stream with a
stream of the other device. Prints SKIP on a machine with one GPU."""
import torch

import pyalloc

MiB = 1 << 20


def main():
    if torch.cuda.device_count() < 2:
        print("SKIP: one GPU")
        return
    pyalloc.install()
    for n in (1, 3 * MiB + 5, 64 * MiB):
        a = torch.arange(n, dtype=torch.int32, device="cuda:0")
        b = a.to("cuda:1")
        assert torch.equal(b.cpu(), a.cpu()), n
        assert torch.equal(b.to("cuda:0"), a), n
    # A strided copy runs a kernel that reads the other device's memory directly
    # where peer access is on: pages mapped for their owner alone would fault.
    m = torch.arange(1024 * 1024, dtype=torch.float32, device="cuda:0").view(1024, 1024).t()
    assert torch.equal(m.to("cuda:1").cpu(), m.cpu())
    m1 = torch.arange(1024 * 1024, dtype=torch.float32, device="cuda:1").view(1024, 1024).t()
    assert torch.equal(m1.to("cuda:0").cpu(), m1.cpu())
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)

    # record_stream with a stream of device 1 on a block of device 0: the block
    # comes back once that stream's work is done.
    other = torch.cuda.Stream(device=1)
    x = torch.ones(4 * MiB, device="cuda:0")
    try:
        x.record_stream(other)
    except RuntimeError as e:
        print("torch refuses record_stream across devices:", e)
    del x
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    y = torch.ones(MiB, device="cuda:0")  # the pending free completes on the way
    st = pyalloc.memory_stats(0)
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"], st
    del y
    pyalloc._C.cuda_check_invariants(0)
    pyalloc._C.cuda_check_invariants(1)
    print("OK")


if __name__ == "__main__":
    main()
