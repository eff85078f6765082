// The backend every pool of a device allocates through (PoolBackend), and
// the one budget all of them draw on (DeviceBudget).
//
// A PoolBackend wraps the device's CUDA backend (cuda_backend.h), or for a
// torch.cuda.MemPool with an allocator of its own, that allocator's
// reserve and release (SegmentSource). It charges every reservation and
// mapping to the device's budget, so that the memory fraction
// (set_memory_fraction) caps what all the pools of the device reserve
// together, graph pools and the buffer pool included, as PyTorch's cap
// covers its private pools. It tells the segment watchers (segment_watch.h)
// of each unit it maps and unmaps. And while a graph pool has a use (`held`)
// it tells the core a capture is underway, so that the core releases
// nothing of it: a graph captured into the pool may be replayed at any time.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "core/backend.h"
#include "segment_watch.h"

namespace pyalloc {

/// PyTorch's MempoolId_t: {CaptureId_t, CaptureId_t}; {0, 0} is the general pool.
using PoolId = std::pair<uint64_t, uint64_t>;

/// The bytes all the pools of a device hold from the driver, against the
/// memory fraction's cap, and the lowest and highest address any of them
/// ever got (may_hold()). One per device.
struct DeviceBudget {
  std::atomic<size_t> reserved{0};
  std::atomic<size_t> cap{0};  // 0: no cap
  std::atomic<uintptr_t> lo{UINTPTR_MAX};
  std::atomic<uintptr_t> hi{0};

  /// Charges `bytes`; false, with nothing charged, if the cap cannot hold them.
  bool take(size_t bytes);
  void give(size_t bytes) { reserved.fetch_sub(bytes, std::memory_order_acq_rel); }
  /// A pool got [base, base + bytes) from the driver.
  void saw(uintptr_t base, size_t bytes);
  /// False if no pool of the device ever held ptr (true is only a maybe).
  bool may_hold(uintptr_t ptr) const {
    return ptr >= lo.load(std::memory_order_acquire) && ptr < hi.load(std::memory_order_acquire);
  }
};

/// Where a pool's segments come from when not from the driver: a
/// torch.cuda.MemPool's own allocator (NCCL's ncclMemAlloc, say). reserve
/// returns 0 when out of memory and throws for other errors; release takes
/// back what reserve gave. Called with the pool's lock held.
struct SegmentSource {
  std::function<uintptr_t(size_t)> reserve;
  std::function<void(uintptr_t, size_t)> release;
};

class PoolBackend final : public Backend {
 public:
  PoolBackend(std::unique_ptr<Backend> inner, DeviceBudget& budget, bool held, int device, PoolId id,
              SegmentSource source = {});

  /// The units mapped and told to the segment watchers, by address.
  const MappedUnits& units() const { return units_; }
  /// A graph pool: whether it has a use (then capture_underway() is true).
  void set_held(bool held) { held_.store(held, std::memory_order_release); }

  const char* name() const override { return inner_->name(); }
  uintptr_t reserve(size_t size) override;
  void release(uintptr_t base, size_t size) override;
  void mem_info(size_t* free_bytes, size_t* total_bytes) override;
  size_t shared_cap() override { return budget_.cap.load(std::memory_order_acquire); }
  size_t vmm_page_size() override { return inner_->vmm_page_size(); }
  bool vmm_proven() override { return inner_->vmm_proven(); }
  uintptr_t vmm_reserve(size_t size) override;
  void vmm_release(uintptr_t base, size_t size) override;
  bool vmm_map(uintptr_t addr, size_t size) override;
  bool vmm_access(uintptr_t addr, size_t size) override;
  int64_t take_uncounted_calls() override;
  void vmm_unmap(uintptr_t addr, size_t size) override;
  // A spare stays on the budget until dropped.
  bool vmm_moves() override { return inner_->vmm_moves(); }
  bool vmm_detach(uintptr_t addr, size_t size) override;
  bool vmm_attach(uintptr_t addr, size_t size) override;
  bool share_segment(uintptr_t base, size_t size, SharedMemory* out, std::string* why) override;
  bool vmm_share(uintptr_t addr, size_t size, SharedMemory* out, std::string* why) override {
    return inner_->vmm_share(addr, size, out, why);
  }
  void vmm_drop(size_t size) override;
  EventId record_event(Stream s) override { return inner_->record_event(s); }
  bool event_done(EventId e) override { return inner_->event_done(e); }
  bool event_wait(EventId e) override { return inner_->event_wait(e); }
  void event_free(EventId e) override { inner_->event_free(e); }
  bool is_capturing(Stream s) override { return inner_->is_capturing(s); }
  bool capture_underway() override {
    return held_.load(std::memory_order_acquire) || inner_->capture_underway();
  }
  bool grows_while_capturing() override { return inner_->grows_while_capturing(); }
  SimStreams* sim_streams() override { return inner_->sim_streams(); }

 private:
  std::unique_ptr<Backend> inner_;
  DeviceBudget& budget_;
  SegmentSource source_;
  MappedUnits units_;
  int64_t uncounted_ = 0;  // take_uncounted_calls(); under the core's lock, as every call
  std::atomic<bool> held_;
};

}  // namespace pyalloc
