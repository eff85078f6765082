// The bridge's allocation step, without torch: pyalloc's malloc through the C
// table, and on failure the error as it stands right after it.
//
// Why a step of its own: an out-of-memory error runs PyTorch's observers
// before the bridge throws, and they call into pyalloc on this thread (the
// OOM dump of torch.cuda.memory._record_memory_history takes a snapshot). A
// call that succeeds clears the thread's last error (bridge_api.h), so the
// message must be read before they run, or the caller gets an empty
// torch.cuda.OutOfMemoryError. Kept free of torch so that a test can build it
// against pyalloc._C on a machine without a GPU (tests/cuda/test_bridge_api.py).
#ifndef PYALLOC_TORCH_BRIDGE_ALLOCATE_H
#define PYALLOC_TORCH_BRIDGE_ALLOCATE_H

#include <cstdint>
#include <string>

#include "cuda/bridge_api.h"

namespace pyalloc_bridge {

/// A failed malloc: its status, pyalloc's message and (out of memory) figures.
struct AllocFailure {
  int status = PYALLOC_OK;
  std::string message;
  pyalloc_oom_info oom{};
};

/// api->malloc of `size` bytes. PYALLOC_OK: *out is the memory (nullptr for
/// size 0). Otherwise *failure holds the status, the message and the figures,
/// all read before on_oom(*failure) runs, which it does for an out-of-memory
/// error only. Returns the status.
template <class OnOutOfMemory>
int allocate(const pyalloc_bridge_api* api, int device, uint64_t size, void* stream, uint64_t tag,
             void** out, AllocFailure* failure, OnOutOfMemory&& on_oom) {
  pyalloc_oom_info oom{};
  int status = api->malloc(device, size, stream, tag, out, &oom);
  if (status == PYALLOC_OK) return status;
  failure->status = status;
  failure->message = api->last_error();  // before on_oom: its calls into pyalloc clear it
  failure->oom = oom;
  if (status == PYALLOC_OUT_OF_MEMORY) on_oom(static_cast<const AllocFailure&>(*failure));
  return status;
}

}  // namespace pyalloc_bridge

#endif  // PYALLOC_TORCH_BRIDGE_ALLOCATE_H
