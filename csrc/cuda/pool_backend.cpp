// The device's budget and the backend each of its pools draws on it through:
// see pool_backend.h.
#include "pool_backend.h"

#include <algorithm>
#include <utility>

namespace pyalloc {

// ---------------------------------------------------------------------------
// DeviceBudget

bool DeviceBudget::take(size_t bytes) {
  size_t now = reserved.load(std::memory_order_acquire);
  do {
    size_t limit = cap.load(std::memory_order_acquire);
    if (limit != 0 && (bytes > limit || now > limit - bytes)) return false;
  } while (!reserved.compare_exchange_weak(now, now + bytes, std::memory_order_acq_rel));
  return true;
}

void DeviceBudget::saw(uintptr_t base, size_t bytes) {
  uintptr_t now = lo.load(std::memory_order_acquire);
  while (base < now && !lo.compare_exchange_weak(now, base, std::memory_order_acq_rel)) {
  }
  uintptr_t end = base + bytes;
  now = hi.load(std::memory_order_acquire);
  while (end > now && !hi.compare_exchange_weak(now, end, std::memory_order_acq_rel)) {
  }
}

// ---------------------------------------------------------------------------
// PoolBackend

PoolBackend::PoolBackend(std::unique_ptr<Backend> inner, DeviceBudget& budget, bool held, int device,
                         PoolId id, SegmentSource source)
    : inner_(std::move(inner)),
      budget_(budget),
      source_(std::move(source)),
      units_(device, id),
      held_(held) {}

uintptr_t PoolBackend::reserve(size_t size) {
  if (!budget_.take(size)) {
    uncounted_--;  // refused with no driver call
    return 0;
  }
  uintptr_t base = 0;
  try {
    // The CUDA backend throws on errors other than OOM; so does a source.
    base = source_.reserve ? source_.reserve(size) : inner_->reserve(size);
  } catch (...) {
    budget_.give(size);
    throw;
  }
  if (base == 0) {
    budget_.give(size);
  } else {
    budget_.saw(base, size);
    units_.segment_mapped(base, size);
  }
  return base;
}

void PoolBackend::release(uintptr_t base, size_t size) {
  if (source_.release) {
    // Its allocator's free (ncclMemFree) after the watcher's deregistration,
    // which runs with no pool lock held (segment_watch.h).
    units_.unmapping(base, [release = source_.release, base, size] { release(base, size); });
  } else {
    units_.unmapping(base);
    inner_->release(base, size);
  }
  budget_.give(size);
}

void PoolBackend::mem_info(size_t* free_bytes, size_t* total_bytes) {
  inner_->mem_info(free_bytes, total_bytes);
  // Within the cap: a request the budget cannot hold fails before any release.
  size_t cap = budget_.cap.load(std::memory_order_acquire);
  if (cap != 0 && *total_bytes != 0) {
    size_t used = budget_.reserved.load(std::memory_order_acquire);
    *free_bytes = std::min(*free_bytes, cap > used ? cap - used : 0);
  }
}

uintptr_t PoolBackend::vmm_reserve(size_t size) {
  uintptr_t base = inner_->vmm_reserve(size);
  if (base != 0) budget_.saw(base, size);
  return base;
}

void PoolBackend::vmm_release(uintptr_t base, size_t size) {
  units_.unmapping_range(base, size);
  inner_->vmm_release(base, size);
}

bool PoolBackend::vmm_map(uintptr_t addr, size_t size) {
  if (!budget_.take(size)) {
    uncounted_--;  // refused with no driver call
    return false;
  }
  bool mapped = false;
  try {
    mapped = inner_->vmm_map(addr, size);
  } catch (...) {
    budget_.give(size);
    throw;
  }
  if (!mapped) budget_.give(size);
  else units_.handle_mapped(addr, size);
  return mapped;
}

bool PoolBackend::vmm_access(uintptr_t addr, size_t size) {
  bool ok = inner_->vmm_access(addr, size);
  if (ok) units_.access(addr, size);
  return ok;
}

int64_t PoolBackend::take_uncounted_calls() {
  return std::exchange(uncounted_, 0) + inner_->take_uncounted_calls();
}

void PoolBackend::vmm_unmap(uintptr_t addr, size_t size) {
  units_.unmapping(addr);
  inner_->vmm_unmap(addr, size);
  budget_.give(size);
}

bool PoolBackend::vmm_detach(uintptr_t addr, size_t size) {
  units_.unmapping(addr);
  bool kept = inner_->vmm_detach(addr, size);
  if (!kept) budget_.give(size);
  return kept;
}

bool PoolBackend::vmm_attach(uintptr_t addr, size_t size) {
  bool attached = inner_->vmm_attach(addr, size);
  if (attached) units_.handle_mapped(addr, size);
  return attached;
}

bool PoolBackend::share_segment(uintptr_t base, size_t size, SharedMemory* out, std::string* why) {
  if (source_.reserve) {
    *why = "the memory of a MemPool's own allocator cannot be shared by pyalloc";
    return false;
  }
  return inner_->share_segment(base, size, out, why);
}

void PoolBackend::vmm_drop(size_t size) {
  inner_->vmm_drop(size);
  budget_.give(size);
}

}  // namespace pyalloc
