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

Neither side waits for ever: the receiver is a daemon process whose every wait
on its queue has a timeout, the sender's waits stop at once when the receiver
has died, and a sender that fails (the very out-of-memory this checks for)
kills the receiver on its way out, so that the check fails in seconds, not at
its harness's timeout.
"""
import contextlib
import queue
import sys
import time

import torch
import torch.multiprocessing as mp

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20
#: The longest either side waits for the other (seconds): far more than a step takes
#: (the receiver's start, torch's import and CUDA's included), and well within the
#: check's own limit (tests/cuda/test_gpu.py, CHECK_TIMEOUT_S).
WAIT_S = 60


def answer(outbox, proc, timeout=WAIT_S):
    """The receiver's next message: an AssertionError at once if the receiver has
    exited, or after ``timeout`` seconds without a word."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return outbox.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if not proc.is_alive():
                raise AssertionError(f"the receiver exited with {proc.exitcode} without answering") from None
            if time.monotonic() >= deadline:
                raise AssertionError(f"the receiver did not answer in {timeout} s") from None


@contextlib.contextmanager
def receiving(ctx, target, args):
    """The receiver, started as a daemon process (Python's exit does not wait on it),
    and killed on the way out if it is still there: after a failure in the sender it
    would otherwise wait on its queue."""
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)


def receiver(inbox, outbox, with_pyalloc):
    if with_pyalloc:
        pyalloc.install(bridge=True)
    big, small, view = inbox.get(timeout=WAIT_S)
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
    assert inbox.get(timeout=WAIT_S) == "drop"
    del big, small, view
    torch.cuda.synchronize()
    if with_pyalloc:
        import gc

        gc.collect()
        outbox.put(pyalloc._C.cuda_ipc_counts())
    else:
        outbox.put({})
    assert inbox.get(timeout=WAIT_S) == "exit"


def send(ctx, with_pyalloc):
    strategy = pyalloc._C.cuda_config()["strategy"]
    big = torch.full((64 * MiB // 4,), 7.0, device="cuda")
    small = torch.full((1000,), 4.0, device="cuda")
    view = big[1000:2000]
    torch.cuda.synchronize()
    allocated = pyalloc.memory_allocated()
    inbox, outbox = ctx.Queue(), ctx.Queue()
    with receiving(ctx, receiver, (inbox, outbox, with_pyalloc)) as proc:
        inbox.put((big, small, view))
        report = answer(outbox, proc)
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
        after = answer(outbox, proc)
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
        proc.join(timeout=WAIT_S)
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
