// Telling watchers of the units pyalloc's pools map: see segment_watch.h.
#include "segment_watch.h"

#include <atomic>
#include <shared_mutex>

namespace pyalloc {
namespace {

// Read on every map and unmap; changed rarely (the bridge attaching a tracker).
std::shared_mutex watcher_mu;
SegmentWatcher watcher = nullptr;
void* watcher_user = nullptr;

// The next unit's number: one count for every pool of every device.
std::atomic<int64_t> next_counter{0};
int64_t new_counter() { return next_counter.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

void watch_segments(SegmentWatcher fn, void* user) {
  std::unique_lock<std::shared_mutex> g(watcher_mu);
  watcher = fn;
  watcher_user = user;
}

void MappedUnits::tell(uintptr_t addr, size_t size, bool mapped) const {
  std::shared_lock<std::shared_mutex> g(watcher_mu);
  if (watcher != nullptr) watcher(watcher_user, SegmentEvent{device_, addr, size, pool_, mapped});
}

void MappedUnits::segment_mapped(uintptr_t addr, size_t size) {
  {
    std::lock_guard<std::mutex> g(mu_);
    told_[addr] = Unit{size, new_counter()};
  }
  tell(addr, size, true);
}

void MappedUnits::handle_mapped(uintptr_t addr, size_t size) {
  std::lock_guard<std::mutex> g(mu_);
  waiting_[addr] = Unit{size, new_counter()};
}

void MappedUnits::access(uintptr_t addr, size_t size) {
  std::vector<std::pair<uintptr_t, size_t>> now;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = waiting_.lower_bound(addr); it != waiting_.end() && it->first < addr + size;) {
      now.emplace_back(it->first, it->second.size);
      told_.insert(*it);
      it = waiting_.erase(it);
    }
  }
  for (const auto& [a, s] : now) tell(a, s, true);
}

void MappedUnits::unmapping(uintptr_t addr) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    waiting_.erase(addr);
    auto it = told_.find(addr);
    if (it == told_.end()) return;
    size = it->second.size;
    told_.erase(it);
  }
  tell(addr, size, false);
}

void MappedUnits::unmapping_range(uintptr_t base, size_t size) {
  std::vector<std::pair<uintptr_t, size_t>> gone;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = waiting_.lower_bound(base); it != waiting_.end() && it->first < base + size;)
      it = waiting_.erase(it);
    for (auto it = told_.lower_bound(base); it != told_.end() && it->first < base + size;) {
      gone.emplace_back(it->first, it->second.size);
      it = told_.erase(it);
    }
  }
  for (const auto& [a, s] : gone) tell(a, s, false);
}

std::vector<MappedUnit> MappedUnits::list() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<MappedUnit> out;
  out.reserve(told_.size());
  for (const auto& [addr, u] : told_) out.push_back(MappedUnit{addr, u.size, u.counter});
  return out;
}

int64_t MappedUnits::counter_at(uintptr_t addr) const {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto* units : {&told_, &waiting_}) {
    auto it = units->upper_bound(addr);
    if (it == units->begin()) continue;
    --it;
    if (addr < it->first + it->second.size) return it->second.counter;
  }
  return -1;
}

}  // namespace pyalloc
