// Flattening the stats into PyTorch's memory_stats() keys.
#include "stats.h"

#include <algorithm>
#include <array>
#include <mutex>

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
  num_device_alloc = num_device_free = num_oom_rejections = 0;
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
  out.emplace_back("num_oom_rejections", num_oom_rejections);
  out.emplace_back("max_split_size", max_split_size);
  std::sort(out.begin(), out.end());
  return out;
}

void StatsSink::push(const Stats& now, Stats* last) {
  auto add = [](Stat& total, const Stat& n, const Stat& l) {
    total.current += n.current - l.current;
    total.allocated += n.allocated - l.allocated;
    total.freed += n.freed - l.freed;
  };
  constexpr StatArray Stats::*kArrays[] = {
      &Stats::allocation,      &Stats::segment,        &Stats::active,
      &Stats::inactive_split,  &Stats::allocated_bytes, &Stats::reserved_bytes,
      &Stats::active_bytes,    &Stats::inactive_split_bytes, &Stats::requested_bytes,
  };
  constexpr int64_t Stats::*kCounters[] = {
      &Stats::num_alloc_retries, &Stats::num_ooms,        &Stats::num_sync_all_streams,
      &Stats::num_device_alloc,  &Stats::num_device_free, &Stats::num_oom_rejections,
  };
  std::lock_guard<Lock> guard(mu_);
  for (StatArray Stats::*a : kArrays) {
    add((total_.*a).all, (now.*a).all, (last->*a).all);
    add((total_.*a).small, (now.*a).small, (last->*a).small);
    add((total_.*a).large, (now.*a).large, (last->*a).large);
  }
  add(total_.oversize_allocations, now.oversize_allocations, last->oversize_allocations);
  add(total_.oversize_segments, now.oversize_segments, last->oversize_segments);
  for (int64_t Stats::*c : kCounters) total_.*c += now.*c - last->*c;
  total_.settle();
  *last = now;
}

Stats StatsSink::read() const {
  std::lock_guard<Lock> guard(mu_);
  return total_;
}

void StatsSink::reset_peak() {
  std::lock_guard<Lock> guard(mu_);
  total_.reset_peak();
}

void StatsSink::reset_accumulated() {
  std::lock_guard<Lock> guard(mu_);
  total_.reset_accumulated();
}

}  // namespace pyalloc
