// Flattening the stats into PyTorch's memory_stats() keys.
#include "stats.h"

#include <algorithm>
#include <array>
#include <mutex>

#include "allocator.h"

namespace pyalloc {

namespace {

// Every StatArray of a Stats, in one list, for the operations on all of them.
template <class S>
auto arrays_of(S& s) {
  return std::array<decltype(&s.allocation), 9>{
      &s.allocation,     &s.segment,      &s.active,
      &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
      &s.active_bytes,   &s.inactive_split_bytes, &s.requested_bytes};
}

}  // namespace

void Stats::reset_peak() {
  for (StatArray* a : arrays_of(*this)) a->reset_peak();
  oversize_allocations.reset_peak();
  oversize_segments.reset_peak();
}

void Stats::reset_accumulated() {
  for (StatArray* a : arrays_of(*this)) a->reset_accumulated();
  oversize_allocations.reset_accumulated();
  oversize_segments.reset_accumulated();
  num_alloc_retries = num_ooms = num_sync_all_streams = 0;
  num_device_alloc = num_device_free = num_oom_rejections = num_driver_calls = 0;
}

namespace {

void put(std::vector<std::pair<std::string, int64_t>>& out, const std::string& prefix,
         const Stat& s) {
  out.emplace_back(prefix + ".current", s.current);
  out.emplace_back(prefix + ".peak", s.peak);
  out.emplace_back(prefix + ".allocated", s.allocated);
  out.emplace_back(prefix + ".freed", s.freed);
}

}  // namespace

std::vector<std::pair<std::string, int64_t>> Stats::flatten() const {
  std::vector<std::pair<std::string, int64_t>> out;
  const std::pair<const char*, const StatArray*> arrays[] = {
      {"allocation", &allocation},
      {"segment", &segment},
      {"active", &active},
      {"inactive_split", &inactive_split},
      {"allocated_bytes", &allocated_bytes},
      {"reserved_bytes", &reserved_bytes},
      {"active_bytes", &active_bytes},
      {"inactive_split_bytes", &inactive_split_bytes},
      {"requested_bytes", &requested_bytes},
  };
  for (const auto& [name, a] : arrays) {
    std::string n(name);
    put(out, n + ".all", a->all);
    put(out, n + ".small_pool", a->small);
    put(out, n + ".large_pool", a->large);
  }
  put(out, "oversize_allocations", oversize_allocations);
  put(out, "oversize_segments", oversize_segments);
  out.emplace_back("num_alloc_retries", num_alloc_retries);
  out.emplace_back("num_ooms", num_ooms);
  out.emplace_back("num_sync_all_streams", num_sync_all_streams);
  out.emplace_back("num_device_alloc", num_device_alloc);
  out.emplace_back("num_device_free", num_device_free);
  out.emplace_back("num_driver_calls", num_driver_calls);
  out.emplace_back("num_oom_rejections", num_oom_rejections);
  out.emplace_back("max_split_size", max_split_size);
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// f(to's Stat, from's Stat) for every count of the two: each array's three
// pools, then the oversize counts.
template <typename F>
void each_stat(Stats& to, const Stats& from, F f) {
  auto to_arrays = arrays_of(to);
  auto from_arrays = arrays_of(from);
  for (size_t i = 0; i < to_arrays.size(); ++i) {
    f(to_arrays[i]->all, from_arrays[i]->all);
    f(to_arrays[i]->small, from_arrays[i]->small);
    f(to_arrays[i]->large, from_arrays[i]->large);
  }
  f(to.oversize_allocations, from.oversize_allocations);
  f(to.oversize_segments, from.oversize_segments);
}

// Adds the sums that only grow (allocated, freed, the counters) of `from` to `to`.
void add_sums(Stats& to, const Stats& from) {
  each_stat(to, from, [](Stat& t, const Stat& f) {
    t.allocated += f.allocated;
    t.freed += f.freed;
  });
  to.num_alloc_retries += from.num_alloc_retries;
  to.num_ooms += from.num_ooms;
  to.num_sync_all_streams += from.num_sync_all_streams;
  to.num_device_alloc += from.num_device_alloc;
  to.num_device_free += from.num_device_free;
  to.num_driver_calls += from.num_driver_calls;
  to.num_oom_rejections += from.num_oom_rejections;
}

}  // namespace

namespace {

inline void carry(Stat& total, const Stat& now, Stat& last) {
  int64_t delta = now.current - last.current;
  if (delta == 0) return;
  last.current = now.current;
  total.current += delta;
  if (total.current > total.peak) total.peak = total.current;
}

inline void carry(StatArray& total, const StatArray& now, StatArray& last) {
  carry(total.all, now.all, last.all);
  carry(total.small, now.small, last.small);
  carry(total.large, now.large, last.large);
}

// Whether any current count of `s` is nonzero.
bool has_counts(const Stats& s) {
  for (const StatArray* a : arrays_of(s))
    if (a->all.current != 0 || a->small.current != 0 || a->large.current != 0) return true;
  return s.oversize_allocations.current != 0 || s.oversize_segments.current != 0;
}

// The current counts and peaks of `from` in `to`, its sums left as they are.
void copy_counts(Stats& to, const Stats& from) {
  each_stat(to, from, [](Stat& t, const Stat& f) {
    t.current = f.current;
    t.peak = f.peak;
  });
}

}  // namespace

void StatsSink::push(const Allocator* pusher, const Stats& now, Stats* last) {
  if (Allocator* solo = solo_.load(std::memory_order_acquire); solo != nullptr) {
    if (solo == pusher) return;
    // Another allocator with no count leaves the sum the solo one's (its
    // *last has no count either: it has never carried any).
    if (!has_counts(now)) return;
    solo->join_sink();  // its lock, then ours: solo ends before we carry
  }
  // Only current counts, and only those that changed: this runs at the end of
  // every allocation and free of every pool of the device once solo has
  // ended, so it is spelled out for the compiler rather than looped over
  // member tables.
  std::lock_guard<Lock> guard(mu_);
  carry(total_.allocation, now.allocation, last->allocation);
  carry(total_.segment, now.segment, last->segment);
  carry(total_.active, now.active, last->active);
  carry(total_.inactive_split, now.inactive_split, last->inactive_split);
  carry(total_.allocated_bytes, now.allocated_bytes, last->allocated_bytes);
  carry(total_.reserved_bytes, now.reserved_bytes, last->reserved_bytes);
  carry(total_.active_bytes, now.active_bytes, last->active_bytes);
  carry(total_.inactive_split_bytes, now.inactive_split_bytes, last->inactive_split_bytes);
  carry(total_.requested_bytes, now.requested_bytes, last->requested_bytes);
  carry(total_.oversize_allocations, now.oversize_allocations, last->oversize_allocations);
  carry(total_.oversize_segments, now.oversize_segments, last->oversize_segments);
}

void StatsSink::join(const Allocator* solo, const Stats& now, Stats* last) {
  std::lock_guard<Lock> guard(mu_);
  if (solo_.load(std::memory_order_relaxed) != solo) return;
  copy_counts(total_, now);
  *last = now;  // only its current counts are ever read
  solo_.store(nullptr, std::memory_order_release);
}

Stats StatsSink::read(const std::vector<Stats>& pools) const {
  std::lock_guard<Lock> guard(mu_);
  Stats out = total_;
  if (solo_.load(std::memory_order_relaxed) != nullptr && !pools.empty()) copy_counts(out, pools.front());
  add_sums(out, retired_);
  for (const Stats& p : pools) add_sums(out, p);
  return out;
}

void StatsSink::retire(const Stats& final) {
  std::lock_guard<Lock> guard(mu_);
  add_sums(retired_, final);
}

void StatsSink::reset_peak() {
  std::lock_guard<Lock> guard(mu_);
  total_.reset_peak();
}

void StatsSink::reset_accumulated() {
  std::lock_guard<Lock> guard(mu_);
  retired_ = Stats();
}

}  // namespace pyalloc
