"""CUDA tensors sent to another process through torch.multiprocessing (spawn),
with pyalloc in both, through the bridge (the C hooks route has no IPC).

Under the session's strategy (PYALLOC_CONF: vmm by default, bestfit): the
receiver sees the sender's values and the sender sees the receiver's writes;
the sender's block stays allocated while the receiver holds it (PyTorch's
reference count of shared blocks) and is freed by torch.cuda.ipc_collect()
once the receiver let go, or by an allocation that runs out of memory (PyTorch's
free-memory callbacks); the receiver unmaps what it opened. Under vmm the
receiver maps only the pages under the tensor. Under bestfit, a receiver with
PyTorch's own allocator opens the same handle (PyTorch's layout).
"""
import sys

import torch
import torch.multiprocessing as mp

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20


def receiver(inbox, outbox, with_pyalloc):
    if with_pyalloc:
        pyalloc.install(bridge=True)
    big, small, view = inbox.get()
    report = {
        "big": float(big[0]) == float(big[-1]) == 7.0,
        "small": float(small.sum()) == 4.0 * small.numel(),
        "view": view.data_ptr() == big.data_ptr() + 1000 * 4 and float(view[0]) == 7.0,
    }
    if with_pyalloc:
        counts = pyalloc._C.cuda_ipc_counts()
        report["mappings"] = counts["mappings"]
        report["mapped_bytes"] = counts["mapped_bytes"]
    big[:MiB].fill_(9.0)  # the sender sees it
    torch.cuda.synchronize()
    outbox.put(report)
    assert inbox.get() == "drop"
    del big, small, view
    torch.cuda.synchronize()
    if with_pyalloc:
        import gc

        gc.collect()
        outbox.put(pyalloc._C.cuda_ipc_counts())
    else:
        outbox.put({})
    assert inbox.get() == "exit"


def send(ctx, with_pyalloc):
    strategy = pyalloc._C.cuda_config()["strategy"]
    big = torch.full((64 * MiB // 4,), 7.0, device="cuda")
    small = torch.full((1000,), 4.0, device="cuda")
    view = big[1000:2000]
    torch.cuda.synchronize()
    allocated = pyalloc.memory_allocated()
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(inbox, outbox, with_pyalloc))
    proc.start()
    inbox.put((big, small, view))
    report = outbox.get(timeout=300)
    assert report["big"] and report["small"] and report["view"], report
    if with_pyalloc:
        assert report["mappings"] >= 1, report
        if strategy == "vmm":
            # The handles under the two storages: never more than the sender has
            # mapped at all (PyTorch's expandable segments reserve 9/8 of the
            # device per handle in the receiver, pytorch 186213).
            assert 64 * MiB <= report["mapped_bytes"] <= pyalloc.memory_reserved(), report
    torch.cuda.synchronize()
    assert float(big[0]) == 9.0 and float(big[MiB]) == 7.0, "the receiver's writes reach the sender"

    # The sender lets go first: its blocks stay allocated while the receiver holds them.
    ptr = big.data_ptr()
    del big, small, view
    torch.cuda.ipc_collect()
    assert pyalloc.memory_allocated() >= allocated, (pyalloc.memory_allocated(), allocated)
    inbox.put("drop")
    after = outbox.get(timeout=300)
    if with_pyalloc:
        assert after["mappings"] == 0 and after["mapped_bytes"] == 0, after
    # The receiver has released them, and nobody called ipc_collect(): a request the
    # memory fraction leaves no room for runs PyTorch's free-memory callbacks (torch's
    # cuda_ipc_collect frees the released block), as PyTorch's allocator does, and the
    # freed block serves it. Before, pyalloc raised out of memory here.
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    held = pyalloc.memory_allocated()
    torch.cuda.set_per_process_memory_fraction((held + 32 * MiB) / total)
    try:
        again = torch.empty(64 * MiB // 4, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert pyalloc.memory_allocated() < held + MiB, (pyalloc.memory_allocated(), held)  # the block went first
    del again
    torch.cuda.ipc_collect()  # what is left of them (the small one) goes
    assert pyalloc.memory_allocated() < allocated - 64 * MiB + MiB, (pyalloc.memory_allocated(), allocated)
    inbox.put("exit")
    proc.join(timeout=120)
    assert proc.exitcode == 0, proc.exitcode
    if strategy == "vmm" and with_pyalloc:
        assert pyalloc._C.cuda_ipc_counts()["exports"] == 0
    print(f"sent {ptr:#x} under {strategy} to a receiver {'with' if with_pyalloc else 'without'} pyalloc")


def main():
    bridge_only("CUDA IPC (torch.multiprocessing of CUDA tensors)")
    ctx = mp.get_context("spawn")
    send(ctx, with_pyalloc=True)
    if pyalloc._C.cuda_config()["strategy"] == "bestfit":
        send(ctx, with_pyalloc=False)  # PyTorch's own allocator opens pyalloc's segment handles
    pyalloc._C.cuda_check_invariants(0)
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
