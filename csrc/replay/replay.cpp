// The trace replayer: see replay.h.
#include "replay.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace pyalloc {

ReplayTrace::ReplayTrace(std::vector<ReplayOp> ops) : ops_(std::move(ops)) {
  for (size_t i = 0; i < ops_.size(); ++i) {
    // No trace needs more slots than it has ops; a larger id is a caller's bug.
    if (ops_[i].id >= ops_.size())
      throw std::invalid_argument("replay op " + std::to_string(i) + ": id " +
                                  std::to_string(ops_[i].id) + " is not below the number of ops");
    slots_ = std::max(slots_, size_t(ops_[i].id) + 1);
  }
  // size_of[id]: the live allocation's size, or kFree when the slot is free.
  constexpr size_t kFree = ~size_t(0);
  std::vector<size_t> size_of(slots_, kFree);
  for (size_t i = 0; i < ops_.size(); ++i) {
    ReplayOp& op = ops_[i];
    size_t& slot = size_of[op.id];
    auto bad = [&](const std::string& why) {
      throw std::invalid_argument("replay op " + std::to_string(i) + " (id " +
                                  std::to_string(op.id) + "): " + why);
    };
    switch (op.kind) {
      case ReplayOp::kAlloc:
        if (slot != kFree) bad("allocates an id that is still live");
        if (op.size == kFree) bad("impossible size");
        slot = op.size;
        allocs_++;
        break;
      case ReplayOp::kFree:
        if (slot == kFree) bad("frees an id that is not live");
        op.size = slot;
        slot = kFree;
        break;
      default:
        bad("unknown op kind " + std::to_string(int(op.kind)) + " (1: alloc, 2: free)");
    }
  }
}

Replayer::Replayer(Allocator& allocator, const ReplayTrace& trace, bool stop_on_oom,
                   size_t timeline_points)
    : alloc_(allocator),
      trace_(trace),
      stop_on_oom_(stop_on_oom),
      ptr_(trace.slots(), 0),
      held_(trace.slots(), 0),
      half_(trace.size() / 2) {
  if (timeline_points > 0 && trace.size() > 0) {
    bucket_ = (trace.size() + timeline_points - 1) / timeline_points;
    timeline_.reserve(trace.size() / bucket_ + 1);
  }
}

bool Replayer::run(size_t stop) {
  std::lock_guard<std::mutex> guard(mu_);
  if (stopped_) return false;
  const std::vector<ReplayOp>& ops = trace_.ops();
  stop = std::min(stop, ops.size());
  auto start = std::chrono::steady_clock::now();
  for (; pos_ < stop; ++pos_) {
    if (pos_ == half_) {
      Stats s = alloc_.stats();
      calls_at_half_ = {s.num_device_alloc, s.num_device_free};
    }
    const ReplayOp& op = ops[pos_];
    if (op.kind == ReplayOp::kAlloc) {
      if (!alloc_one(op)) {
        ooms_++;
        if (first_oom_op_ < 0) first_oom_op_ = static_cast<int64_t>(pos_);
        if (stop_on_oom_) {
          stopped_ = true;
          break;
        }
      }
    } else if (!held_[op.id]) {
      skipped_frees_++;
    } else {
      alloc_.free(ptr_[op.id]);
      held_[op.id] = 0;
      ptr_[op.id] = 0;
      frees_++;
      live_ -= static_cast<int64_t>(op.size);
    }
    if (bucket_ != 0 && ((pos_ + 1) % bucket_ == 0 || pos_ + 1 == ops.size())) sample(pos_);
  }
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return !stopped_;
}

bool Replayer::alloc_one(const ReplayOp& op) {
  try {
    ptr_[op.id] = alloc_.malloc(op.size, op.stream);
  } catch (const OutOfMemoryError&) {
    return false;
  } catch (const std::invalid_argument&) {
    return false;  // a size no device could hold: out of memory on any budget
  }
  held_[op.id] = 1;
  mallocs_++;
  live_ += static_cast<int64_t>(op.size);
  peak_live_ = std::max(peak_live_, live_);
  bucket_live_max_ = std::max(bucket_live_max_, live_);
  return true;
}

void Replayer::sample(size_t op) {
  Stats s = alloc_.stats();
  timeline_.push_back(TimelinePoint{op, bucket_live_max_, s.reserved_bytes.all.current,
                                    s.allocated_bytes.all.current});
  bucket_live_max_ = live_;
}

std::vector<TimelinePoint> Replayer::timeline() const {
  std::lock_guard<std::mutex> guard(mu_);
  return timeline_;
}

}  // namespace pyalloc
