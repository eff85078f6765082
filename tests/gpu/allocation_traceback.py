"""torch.cuda.memory._allocation_traceback through the bridge (getContextForPointer).

With memory history on, the traceback of a live allocation names the Python
function that made it, as with PyTorch's allocator; a pointer inside it, a freed
one and one with history off answer None.
"""
import torch

import pyalloc  # noqa: F401
from gpu_common import bridge_only

MiB = 1 << 20


def make_the_weight():
    return torch.randn(512, 512, device="cuda")


def main():
    bridge_only("torch.cuda.memory._allocation_traceback")
    if not hasattr(torch.cuda.memory, "_allocation_traceback"):
        print(f"SKIP: torch {torch.__version__} has no torch.cuda.memory._allocation_traceback")
        return
    traceback = torch.cuda.memory._allocation_traceback
    before = torch.ones(MiB, device="cuda")  # made with history off
    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    try:
        w = make_the_weight()
        ptr = w.untyped_storage().data_ptr()
        frames = traceback(ptr)
        assert frames, f"no traceback for a live allocation: {frames!r}"
        names = [f["name"] for f in frames]
        assert "make_the_weight" in names, names
        assert traceback(ptr + 512) is None  # not an allocation's start
        assert traceback(before.untyped_storage().data_ptr()) is None  # no context recorded
        del w
        torch.cuda.synchronize()
        assert traceback(ptr) is None  # freed
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    print("OK")


if __name__ == "__main__":
    main()
