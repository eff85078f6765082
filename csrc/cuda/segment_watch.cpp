// Telling watchers of the units pyalloc's pools map: see segment_watch.h.
#include "segment_watch.h"

#include <atomic>
#include <cstdio>
#include <deque>
#include <exception>
#include <shared_mutex>

namespace pyalloc {
namespace segment_watch_detail {
std::atomic<uint64_t> queued_so_far{0};  // last_queued, read without the lock
std::atomic<uint64_t> told{0};
}  // namespace segment_watch_detail
using segment_watch_detail::queued_so_far;
using segment_watch_detail::told;

namespace {

// Read on every map and unmap; changed rarely (the bridge attaching a tracker).
std::shared_mutex watcher_mu;
SegmentWatcher watcher = nullptr;
void* watcher_user = nullptr;

std::atomic<bool> watching{false};  // a watcher is set: events are queued

// The next unit's number: one count for every pool of every device.
std::atomic<int64_t> next_counter{0};
int64_t new_counter() { return next_counter.fetch_add(1, std::memory_order_relaxed); }

// ---------------------------------------------------------------------------
// The queue of events not yet told: filled under the pools' locks, emptied
// with none held (segment_watch.h). Numbered in order; `told` is the number
// of the last one told, so a thread knows whether its own are.

struct Queued {
  uint64_t seq;
  SegmentEvent event;
  std::function<void()> then;  // run once the event is told (a MemPool allocator's free)
};
std::mutex queue_mu;
std::deque<Queued> queue;  // under queue_mu
uint64_t last_queued = 0;  // under queue_mu
std::mutex telling_mu;  // one thread tells at a time: one order
thread_local uint64_t my_last_queued = 0;
thread_local bool telling_here = false;  // inside a watcher's call on this thread

void enqueue(const SegmentEvent& e, std::function<void()> then = {}) {
  std::lock_guard<std::mutex> g(queue_mu);
  queue.push_back(Queued{++last_queued, e, std::move(then)});
  my_last_queued = last_queued;
  queued_so_far.store(last_queued, std::memory_order_seq_cst);
}

bool pop(Queued* out) {
  std::lock_guard<std::mutex> g(queue_mu);
  if (queue.empty()) return false;
  *out = queue.front();
  queue.pop_front();
  return true;
}

void tell_one(const SegmentEvent& e) {
  std::shared_lock<std::shared_mutex> g(watcher_mu);
  if (watcher != nullptr) watcher(watcher_user, e);
}

// Tells the queue, if no other thread is telling it; false if one is.
bool tell_queue() noexcept {
  std::unique_lock<std::mutex> g(telling_mu, std::try_to_lock);
  if (!g.owns_lock()) return false;
  telling_here = true;
  Queued q;
  while (pop(&q)) {
    try {
      tell_one(q.event);
    } catch (...) {
      // A watcher is a C function (the bridge's): nothing to unwind into here.
    }
    try {
      if (q.then) q.then();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: giving a segment back to its MemPool's allocator failed: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "pyalloc: giving a segment back to its MemPool's allocator failed\n");
    }
    told.store(q.seq, std::memory_order_release);
  }
  telling_here = false;
  return true;
}

}  // namespace

void tell_queued_segments() noexcept {
  if (told.load(std::memory_order_acquire) >= my_last_queued) return;
  if (telling_here) return;  // the loop this thread is in tells them after the watcher returns
  // Never waits for another thread telling: its watcher may wait for a lock
  // this thread holds. That thread tells these too: one queued before its
  // last look (after it lets go of telling_mu) is seen there.
  while (tell_queue()) {
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the look after the unlock, not before
    if (told.load(std::memory_order_seq_cst) >= queued_so_far.load(std::memory_order_seq_cst)) return;
  }
}

size_t queued_segment_events() {
  std::lock_guard<std::mutex> g(queue_mu);
  return queue.size();
}

void watch_segments(SegmentWatcher fn, void* user) {
  std::unique_lock<std::shared_mutex> g(watcher_mu);
  watcher = fn;
  watcher_user = user;
  watching.store(fn != nullptr, std::memory_order_release);
}

void MappedUnits::tell(uintptr_t addr, size_t size, bool mapped) const {
  if (watching.load(std::memory_order_acquire)) enqueue(SegmentEvent{device_, addr, size, pool_, mapped});
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

void MappedUnits::unmapping(uintptr_t addr, std::function<void()> then) {
  size_t size = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    waiting_.erase(addr);
    auto it = told_.find(addr);
    if (it != told_.end()) {
      size = it->second.size;
      told_.erase(it);
    }
  }
  if (size != 0 && watching.load(std::memory_order_acquire)) {
    enqueue(SegmentEvent{device_, addr, size, pool_, false}, std::move(then));
    return;
  }
  if (then) then();
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
