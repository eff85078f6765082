"""Out-of-memory errors of the right type, and OOM rejections, through the bridge.

- A request no device could hold (above 2^56 bytes) is torch.cuda.OutOfMemoryError,
  as with PyTorch's allocator, not a RuntimeError of another kind.
- A request refused at once from figures already known (here the memory
  fraction's cap) is what PyTorch's throw_on_cudamalloc_oom refuses: counted in
  num_oom_rejections, reported (torch 2.12 on) to the observers attached with
  attachOomRejectionObserver, then to the out-of-memory observers. A request that
  was tried and failed is no rejection.
torch has no Python call to attach a rejection observer: a small extension built
with torch.utils.cpp_extension.load_inline does it (torch 2.12 or newer).
"""
import torch

import pyalloc
from gpu_common import bridge_only

MiB = 1 << 20
GiB = 1 << 30

OBSERVER_SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/extension.h>
#include <mutex>
#include <vector>

static std::mutex mu;
static std::vector<std::vector<int64_t>> seen;

void attach() {
  c10::cuda::CUDACachingAllocator::attachOomRejectionObserver(
      [](int64_t device, size_t size, size_t allocated, size_t total) {
        std::lock_guard<std::mutex> g(mu);
        seen.push_back({device, (int64_t)size, (int64_t)allocated, (int64_t)total});
      });
}

std::vector<std::vector<int64_t>> calls() {
  std::lock_guard<std::mutex> g(mu);
  return seen;
}
"""


def rejection_observer():
    """The extension's (attach, calls), or None on a torch without rejection observers."""
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < "2.12":
        return None
    import os

    from torch.utils.cpp_extension import load_inline

    from pyalloc import bridge

    # As the bridge is built: the CUDA runtime's headers, and libc10_cuda (the allocator's home).
    cuda = bridge.find_cuda_headers()
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return load_inline("pyalloc_rejection_observer", cpp_sources=OBSERVER_SOURCE,
                       functions=["attach", "calls"], with_cuda=False, verbose=False,
                       extra_include_paths=[cuda.include] if cuda is not None else [],
                       extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", f"-Wl,-rpath,{torch_lib}"])


def rejections() -> int:
    return pyalloc.memory_stats(0)["num_oom_rejections"]


def main():
    bridge_only("torch.cuda.OutOfMemoryError and OOM rejections")
    torch.ones(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    ooms = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: ooms.append(args))
    ext = rejection_observer()
    if ext is not None:
        ext.attach()

    # Something held from the driver beyond what tensors use (a freed block stays
    # cached), so that reserved and allocated differ: a rejection observer's third
    # argument is PyTorch's total_allocated_memory, the bytes held from the
    # driver (reserved), not the bytes allocated to tensors.
    held = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    cached = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del cached
    reserved_at_rejection = []

    # 1. Above 2^56 bytes: out of memory, refused at once.
    before = rejections()
    reserved_at_rejection.append(pyalloc.memory_stats(0)["reserved_bytes.all.current"])
    try:
        torch.empty((1 << 56) + 1, dtype=torch.uint8, device="cuda")
        raise AssertionError("allocating 2^56 + 1 bytes succeeded")
    except torch.cuda.OutOfMemoryError as e:
        assert str(e).startswith("CUDA out of memory.") and "larger than any device" in str(e), str(e)
    assert rejections() == before + 1
    assert len(ooms) == 1 and ooms[-1][1] == (1 << 56) + 1, ooms

    # 2. Beyond the memory fraction's cap: refused at once, observers told.
    torch.cuda.set_per_process_memory_fraction(0.25)
    request = total // 2
    reserved_at_rejection.append(pyalloc.memory_stats(0)["reserved_bytes.all.current"])
    try:
        torch.empty(request, dtype=torch.uint8, device="cuda")
        raise AssertionError("a request above the memory fraction succeeded")
    except torch.cuda.OutOfMemoryError:
        pass
    assert rejections() == before + 2
    assert len(ooms) == 2 and ooms[-1][0] == 0 and ooms[-1][1] == request, ooms
    if "num_oom_rejections" in torch.cuda.memory_stats(0):  # torch 2.12 on
        assert torch.cuda.memory_stats(0)["num_oom_rejections"] == rejections()
    if ext is not None:
        calls = ext.calls()
        assert [c[:2] for c in calls] == [[0, (1 << 56) + 1], [0, request]], calls
        assert all(c[3] == total for c in calls), (calls, total)
        assert [c[2] for c in calls] == reserved_at_rejection, (calls, reserved_at_rejection)
        assert all(c[2] > pyalloc.memory_stats(0)["allocated_bytes.all.current"] for c in calls), calls
    torch.cuda.set_per_process_memory_fraction(1.0)

    # 3. What fits is served, and counts nothing.
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    assert rejections() == before + 2
    del x, held
    where = "observers checked" if ext is not None else f"no rejection observers in torch {torch.__version__}"
    print(f"OK ({where})")


if __name__ == "__main__":
    main()
