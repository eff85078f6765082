// What the owner of an allocator adds to its out-of-memory path.
//
// The path runs in one place, Allocator::malloc(): a request the pool cannot
// serve makes it give back its own cached memory and try again once; if the
// owner set an OomPolicy and it gives back memory held elsewhere (the other
// pools of a device), once more; then the policy may serve the request from
// memory of its own (a MemPool's cache, PyTorch's use_on_oom); and only then
// is it an out-of-memory error,
// counted (num_ooms, num_oom_rejections), traced (the history's `oom` event)
// and worded there, once. A failure a retry mends is no error at all. The
// policy only adds the memory and the words the allocator cannot know of.
#pragma once

#include <cstddef>
#include <string>

#include "common.h"

namespace pyalloc {

class Allocator;

/// A request the pool could not serve.
struct OomFailure {
  size_t request = 0;  // bytes asked for
  size_t size = 0;     // what the pool needed for it: the request rounded, or a small-pool chunk
  Stream stream = 0;
  std::string why;        // the reason, naming none of the pool's figures
  bool rejected = false;  // refused at once (OutOfMemoryError::rejected())
  // No memory given back anywhere could make room (beyond the device, or a
  // cap): the owner's retry (release_elsewhere) is skipped, its cache kept.
  bool hopeless = false;
};

class OomPolicy {
 public:
  virtual ~OomPolicy() = default;
  /// After the pool's own retry failed, unless the failure is hopeless:
  /// gives back memory held outside the pool that it could then take; the bytes given back, or any nonzero
  /// number when they are not known (0: no more retry).
  /// Called with none of the pool's locks held.
  virtual size_t release_elsewhere(Allocator& pool) = 0;
  /// After every retry failed, the last resort: `failure.request` bytes for
  /// failure.stream from memory held outside the pool (handed out and freed
  /// there, not in the pool); 0 if there is none, and the error follows.
  /// Called with none of the pool's locks held.
  virtual uintptr_t serve_elsewhere(Allocator& pool, const OomFailure& failure, uint64_t context) {
    (void)pool, (void)failure, (void)context;
    return 0;
  }
  /// The message of the error raised for `failure`, once it is final and
  /// counted. Called with none of the pool's locks held: it may read the
  /// pool (stats(), fragmentation(), config()).
  virtual std::string describe(Allocator& pool, const OomFailure& failure) = 0;
};

}  // namespace pyalloc
