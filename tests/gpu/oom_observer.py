"""Out of memory through the bridge: torch.cuda.OutOfMemoryError, observers first.

The bridge throws c10::OutOfMemoryError, which Python sees as
torch.cuda.OutOfMemoryError (still a RuntimeError saying "CUDA out of memory.",
what batch-size finders test), after calling the observers attached with
torch._C._cuda_attach_out_of_memory_observer, as PyTorch's allocator does: the
OOM dumps of _record_memory_history take their snapshot there. The process
recovers: a batch-size search that catches only OutOfMemoryError finds a batch
that runs. Only the bridge can do this (through the C hooks an OOM is a plain
RuntimeError and no observer is called).
"""
import pickle

import torch

import pyalloc
from gpu_common import bridge_only
from oom import is_oom

MiB = 1 << 20

observed = []


def observer(device, alloc, device_total, device_free):
    # What an OOM dump does (torch.cuda.memory docs): a snapshot, while the error is on its way.
    snapshot = torch.cuda.memory._snapshot()
    observed.append(dict(device=device, alloc=alloc, total=device_total, free=device_free,
                         snapshot=pickle.loads(pickle.dumps(snapshot))))


def main():
    bridge_only("torch.cuda.OutOfMemoryError and out-of-memory observers")
    keep = torch.ones(MiB, device="cuda")
    torch._C._cuda_attach_out_of_memory_observer(observer)
    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    free, total = torch.cuda.mem_get_info()

    request = 2 * total
    caught = None
    try:
        torch.empty(request, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        caught = e
    assert caught is not None, "allocating twice the device's memory succeeded"
    assert isinstance(caught, RuntimeError) and is_oom(caught), repr(caught)
    message = str(caught)
    assert message.startswith("CUDA out of memory."), message
    assert "Tried to allocate" in message and "largest free block" in message, message

    # The observer ran once, before the error reached Python, with PyTorch's figures.
    assert len(observed) == 1, [{k: v for k, v in o.items() if k != "snapshot"} for o in observed]
    seen = observed[0]
    assert seen["device"] == 0, seen["device"]
    assert request <= seen["alloc"] < request + 2 * MiB, (seen["alloc"], request)
    assert seen["total"] == total, (seen["total"], total)
    assert 0 < seen["free"] <= total, seen["free"]
    # Its snapshot has the failed request in the history, and the live tensor.
    events = seen["snapshot"]["device_traces"][0]
    ooms = [e for e in events if e["action"] == "oom"]
    assert ooms and ooms[-1]["size"] == request and 0 < ooms[-1]["device_free"] <= total, ooms
    live = [b for s in seen["snapshot"]["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(b["address"] == keep.data_ptr() for b in live), "the live tensor is missing from the snapshot"
    torch.cuda.memory._record_memory_history(enabled=None)

    stats = torch.cuda.memory_stats()
    assert stats["num_ooms"] == 1, stats["num_ooms"]
    assert float(keep.sum()) == MiB  # live data untouched

    # Recovering: a batch-size search that catches only OutOfMemoryError (any other
    # error ends the test) finds a batch that trains. It starts at 1 TiB of input.
    model = torch.nn.Linear(4096, 4096).cuda()
    batch, failures = 1 << 26, 0
    while True:
        try:
            x = torch.randn(batch, 4096, device="cuda")
            model(x).sum().backward()
            break
        except torch.cuda.OutOfMemoryError:
            x = None  # a batch that fitted but whose output did not: free it before the next
            failures += 1
            batch //= 2
    assert failures >= 2 and batch >= 1024, (failures, batch)
    # Every out-of-memory error pyalloc counted was observed once.
    assert len(observed) == torch.cuda.memory_stats()["num_ooms"] >= 1 + failures, (
        len(observed), torch.cuda.memory_stats()["num_ooms"], failures)
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.empty(free // 2, dtype=torch.uint8, device="cuda")  # the memory is usable again
    big.fill_(1)
    assert int(big[-1]) == 1
    del big
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    main()
