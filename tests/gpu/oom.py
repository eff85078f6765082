"""An OOM is a RuntimeError batch-size finders recognise, and the process goes on.

The sizes come from plan(total) and problems() says what they must satisfy;
tests/cuda/test_gpu_checks_on_cpu.py checks both for 80 GB and 141 GB devices, and
this script checks them again for its own device before it starts.

set_per_process_memory_fraction caps growth only, as PyTorch's does: a request
the pools can serve from memory they already hold succeeds whatever the cap, and
setting a fraction releases nothing. So the fraction check first frees what the
batch loop left (the model and its gradients: a live gradient kept a cached
segment reserved after empty_cache() under strategy bestfit, and the 0.4 x
device request was served from it) and asserts that what stays reserved is under
the cap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

import pyalloc

MiB = 1 << 20
GiB = 1 << 30
#: The memory fraction the cap checks set.
FRACTION = 0.25
#: `keep`: a tensor that lives through the whole check (1 Mi floats).
KEEP_BYTES = 4 * MiB
#: Room for what the pools hold beside the planned tensors: the segment `keep` lives
#: in (bestfit grows by 20 MiB at least), the small pool's chunks, page rounding.
SLACK = 256 * MiB
#: The batch loop's first try; halved after each out-of-memory error.
FIRST_BATCH = 1 << 24
FEATURES = 4096


@dataclass(frozen=True)
class Plan:
    """Sizes in bytes for a device of `total` bytes."""

    total: int
    cap: int  # FRACTION of the device: what all pyalloc's pools may reserve together
    refused: int  # one request above the cap: refused
    granted: int  # one request under the cap with `keep` beside it: served
    chunk: int  # the vmm part: `chunks` tensors of `chunk` bytes, every other one freed
    chunks: int
    want: int  # then one tensor larger than any hole, which only moved pages can hold

    @property
    def kept(self) -> int:
        """Chunks still live when `want` is asked for (the odd ones)."""
        return self.chunks // 2

    @property
    def freed(self) -> int:
        return self.chunks - self.kept

    @property
    def first_batch_bytes(self) -> int:
        return FIRST_BATCH * FEATURES * 4


def plan(total: int) -> Plan:
    chunk = 64 * MiB
    chunks = int(0.2 * total) // chunk
    return Plan(total=total, cap=int(FRACTION * total), refused=int(0.4 * total), granted=int(0.1 * total),
                chunk=chunk, chunks=chunks, want=4 * chunk * (chunks // 8))


def problems(p: Plan) -> List[str]:
    """What keeps the plan from checking what it means to; empty when it is sound."""
    out = []
    if p.first_batch_bytes <= p.total:
        out.append("the batch loop's first try fits the device: no out-of-memory error to recover from")
    if p.refused <= p.cap:
        out.append("the request meant to be refused is under the cap")
    if KEEP_BYTES + p.granted + SLACK > p.cap:
        out.append("the request meant to be served does not fit under the cap beside `keep`")
    if p.chunks * p.chunk + KEEP_BYTES + SLACK > p.cap:
        out.append("the chunks do not fit under the cap")
    if p.kept * p.chunk + p.want + KEEP_BYTES + SLACK > p.cap:
        out.append("the chunks kept and `want` do not fit under the cap together")
    if p.chunks * p.chunk + p.want <= p.cap:
        out.append("`want` fits beside every chunk: the cap does not force pages to move")
    if p.want < 2 * p.chunk:
        out.append("`want` fits one hole: no pages need to move")
    room = p.freed * p.chunk + (p.cap - p.chunks * p.chunk - KEEP_BYTES - SLACK)
    if p.want > room:
        out.append("the holes and the room under the cap hold less than `want`")
    return out


def is_oom(e):
    # What accelerate's find_executable_batch_size and Lightning's scaler test. The
    # bridge's torch.cuda.OutOfMemoryError is a RuntimeError and must pass it too.
    return isinstance(e, RuntimeError) and len(e.args) == 1 and "CUDA out of memory." in e.args[0]


def holds(t: torch.Tensor, value: int) -> bool:
    """Whether every element of `t` equals `value`, checked without a temporary of
    t's size: t.eq(value) would allocate one as large as `t` (13.75 GiB above the
    cap on an H200, which ended the first run of this check)."""
    return int(t.min()) == value == int(t.max())


def main():
    pyalloc.install()
    total = torch.cuda.get_device_properties(0).total_memory
    p = plan(total)
    assert not problems(p), (problems(p), p)
    keep = torch.ones(KEEP_BYTES // 4, device="cuda")
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
    model = torch.nn.Linear(FEATURES, FEATURES).cuda()
    batch = FIRST_BATCH
    while True:
        try:
            x = torch.randn(batch, FEATURES, device="cuda")
            model(x).sum().backward()
            break
        except RuntimeError as e:
            if not is_oom(e):
                raise
            batch //= 2
    assert batch >= 1024, batch
    assert torch.cuda.memory_stats()["num_ooms"] >= 2
    assert float(keep.sum()) == KEEP_BYTES // 4

    # set_per_process_memory_fraction caps the pools' growth. Precondition: what they
    # hold is under the cap, so a request above the cap cannot come from their cache.
    del x, model  # the weights and their gradients: live blocks pin their segments
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    assert reserved + p.granted <= p.cap, (
        f"precondition: {reserved / GiB:.2f} GiB stays reserved after empty_cache(), too much for the "
        f"{p.cap / GiB:.2f} GiB cap to be checked (the fraction caps growth only)")
    torch.cuda.set_per_process_memory_fraction(FRACTION)
    try:
        torch.empty(p.refused, dtype=torch.uint8, device="cuda")
        raise AssertionError("the memory fraction did not cap the pool")
    except RuntimeError as e:
        # The message names the cap that refused it (tests/cuda/test_cuda_hooks.py pins the wording).
        assert is_oom(e) and f"memory fraction {FRACTION:g} caps all of pyalloc's pools" in str(e), e
    small = torch.empty(p.granted, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() <= p.cap
    del small

    # Under the cap, a request that fits no hole takes the holes' pages (strategy
    # vmm): their handles move (cuMemUnmap, cuMemMap at the new address,
    # cuMemSetAccess), and the live tensors between the holes keep their values.
    torch.cuda.empty_cache()
    blocks = [torch.full((p.chunk,), i % 251, dtype=torch.uint8, device="cuda") for i in range(p.chunks)]
    for i in range(0, p.chunks, 2):
        blocks[i] = None
    reserved = torch.cuda.memory_reserved()
    moves = pyalloc._C.cuda_config()["strategy"] == "vmm"
    if moves:
        assert reserved + p.want > p.cap, (reserved, p)  # so only moved pages can hold it
        big = torch.full((p.want,), 7, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() <= p.cap
        assert holds(big, 7)
        del big
    for i in range(1, p.chunks, 2):
        assert holds(blocks[i], i % 251), i
    del blocks
    torch.cuda.set_per_process_memory_fraction(1.0)
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
