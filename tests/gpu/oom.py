"""An OOM is a RuntimeError batch-size finders recognise, and the process goes on."""
import torch

import pyalloc

MiB = 1 << 20


def is_oom(e):
    # What accelerate's find_executable_batch_size and Lightning's scaler test. The
    # bridge's torch.cuda.OutOfMemoryError is a RuntimeError and must pass it too.
    return isinstance(e, RuntimeError) and len(e.args) == 1 and "CUDA out of memory." in e.args[0]


def main():
    pyalloc.install()
    total = torch.cuda.get_device_properties(0).total_memory
    keep = torch.ones(MiB, device="cuda")
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        raise AssertionError("allocating twice the device's memory succeeded")
    except RuntimeError as e:
        assert is_oom(e), e
        # The bridge throws c10::OutOfMemoryError, which Python sees as
        # torch.cuda.OutOfMemoryError; through the C hooks it is a plain RuntimeError.
        bridge = pyalloc.is_installed() == "bridge"
        assert isinstance(e, torch.cuda.OutOfMemoryError) == bridge, (type(e), pyalloc.is_installed())
        message = str(e)
        assert message.startswith("CUDA out of memory. Tried to allocate"), message
        for words in ("allocated", "reserved", "is free", "largest free block"):
            assert words in message, (words, message)

    # Retrying with smaller batches works, as a batch-size finder does.
    model = torch.nn.Linear(4096, 4096).cuda()
    batch = 1 << 24
    while True:
        try:
            x = torch.randn(batch, 4096, device="cuda")
            model(x).sum().backward()
            break
        except RuntimeError as e:
            if not is_oom(e):
                raise
            batch //= 2
    assert batch >= 1024, batch
    del x
    assert torch.cuda.memory_stats()["num_ooms"] >= 2
    assert float(keep.sum()) == MiB

    # set_per_process_memory_fraction caps the pool.
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(0.25)
    try:
        torch.empty(int(0.4 * total), dtype=torch.uint8, device="cuda")
        raise AssertionError("the memory fraction did not cap the pool")
    except RuntimeError as e:
        assert is_oom(e) and "max_pool_size" in str(e), e
    small = torch.empty(int(0.1 * total), dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() <= 0.25 * total
    del small

    # Under the cap, a request that fits no hole takes the holes' pages (strategy
    # vmm): their handles move (cuMemUnmap, cuMemMap at the new address,
    # cuMemSetAccess), and the live tensors between the holes keep their values.
    torch.cuda.empty_cache()
    chunk = 64 * MiB
    n = int(0.2 * total) // chunk
    blocks = [torch.full((chunk,), i % 251, dtype=torch.uint8, device="cuda") for i in range(n)]
    for i in range(0, n, 2):
        blocks[i] = None
    want = 4 * chunk * (n // 8)
    reserved = torch.cuda.memory_reserved()
    moves = pyalloc._C.cuda_config()["strategy"] == "vmm"
    if moves:
        assert reserved + want > 0.25 * total, (reserved, want)  # so only moved pages can hold it
        big = torch.full((want,), 7, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() <= 0.25 * total
        assert bool(big.eq(7).all())
        del big
    for i in range(1, n, 2):
        assert bool(blocks[i].eq(i % 251).all()), i
    del blocks
    torch.cuda.set_per_process_memory_fraction(1.0)
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
