// The virtual backend: hands out address ranges and nothing else, so traces
// of any size replay on a laptop. Addresses start high and only move up;
// ranges are never handed out twice, so a stale pointer can never alias a
// new segment. `capacity` plays the device's size (0 = unbounded): it bounds
// segments and mapped virtual-memory pages together.
#include <algorithm>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "core/backend.h"
#include "sim_streams.h"

namespace pyalloc {
namespace {

class VirtualBackend final : public Backend {
 public:
  VirtualBackend(size_t capacity, size_t page) : capacity_(capacity), page_(page) {}

  const char* name() const override { return "virtual"; }

  uintptr_t reserve(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    if (capacity_ != 0 && size > capacity_ - used_) return 0;
    if (size > kLimit - next_) return 0;
    uintptr_t base = next_;
    // A gap after each segment keeps segments from looking contiguous.
    next_ += round_up(size, kSegmentAlign) + kSegmentAlign;
    used_ += size;
    return base;
  }

  void release(uintptr_t, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    used_ -= size;
  }

  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> g(mu_);
    *total_bytes = capacity_;
    *free_bytes = capacity_ == 0 ? 0 : capacity_ - used_;
  }

  EventId record_event(Stream s) override { return streams_.record(s); }
  bool event_done(EventId e) override { return streams_.done(e); }
  bool event_wait(EventId e) override { return streams_.wait(e); }
  void event_free(EventId e) override { streams_.release(e); }
  SimStreams* sim_streams() override { return &streams_; }

  size_t vmm_page_size() override { return page_; }

  uintptr_t vmm_reserve(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    // Page-aligned, like a range cuMemAddressReserve gives.
    size_t align = std::max(page_, kSegmentAlign);
    uintptr_t base = round_up(next_, align);
    if (base > kLimit || size > kLimit - base) return 0;
    next_ = base + round_up(size, align) + align;
    return base;
  }

  bool vmm_map(uintptr_t, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    if (capacity_ != 0 && size > capacity_ - used_) return false;
    used_ += size;
    return true;
  }

  bool vmm_access(uintptr_t, size_t) override { return true; }
  bool vmm_proven() override { return true; }  // addresses only: nothing to refuse

  void vmm_unmap(uintptr_t, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    used_ -= size;
  }

  // A spare keeps its bytes counted against the capacity until dropped.
  bool vmm_moves() override { return true; }
  bool vmm_detach(uintptr_t, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    try {
      spares_.insert(size);
    } catch (const std::bad_alloc&) {
      used_ -= size;  // no room to keep it: released, as backend.h lets a failed detach be
      return false;
    }
    return true;
  }
  bool vmm_attach(uintptr_t, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = spares_.find(size);
    if (it == spares_.end()) return false;
    spares_.erase(it);
    return true;
  }
  void vmm_drop(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = spares_.find(size);
    if (it == spares_.end()) throw std::logic_error("vmm_drop: no spare handle of that size");
    spares_.erase(it);
    used_ -= size;
  }

 private:
  static constexpr uintptr_t kStart = uintptr_t(1) << 44;
  static constexpr uintptr_t kLimit = uintptr_t(1) << 62;
  std::mutex mu_;
  size_t capacity_;
  size_t page_;
  size_t used_ = 0;
  uintptr_t next_ = kStart;
  std::multiset<size_t> spares_;  // detached handles' sizes
  SimStreams streams_;
};

}  // namespace

std::unique_ptr<Backend> make_virtual_backend(size_t capacity, size_t page_size) {
  if (page_size < (size_t(4) << 10) || page_size > (size_t(1) << 30) || (page_size & (page_size - 1)) != 0)
    throw std::invalid_argument("page_size must be a power of two from 4 KiB to 1 GiB, got " +
                                std::to_string(page_size) + " bytes");
  return std::make_unique<VirtualBackend>(capacity, page_size);
}

}  // namespace pyalloc
