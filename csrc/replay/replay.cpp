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
  std::vector<uint8_t> requested(slots_, 0);  // by id: its free was requested
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
        requested[op.id] = 0;
        break;
      case ReplayOp::kFreeRequested:
        if (slot == kFree) bad("requests the free of an id that is not live");
        if (requested[op.id]) bad("requests the free of an id already pending");
        op.size = slot;
        requested[op.id] = 1;
        break;
      default:
        bad("unknown op kind " + std::to_string(int(op.kind)) + " (1: alloc, 2: free, 3: free requested)");
    }
  }
}

Replayer::Replayer(Allocator& allocator, const ReplayTrace& trace, bool stop_on_oom,
                   size_t timeline_points)
    : alloc_(allocator),
      trace_(trace),
      stop_on_oom_(stop_on_oom),
      ptr_(trace.slots(), 0),
      size_(trace.slots(), 0),
      held_(trace.slots(), kNotHeld),
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
    } else if (op.kind == ReplayOp::kFreeRequested) {
      // Nothing happens to the allocator until the free, or an allocation that fails.
      if (held_[op.id] == kHeld) {
        held_[op.id] = kFreeWaits;
        requested_.push_back(op.id);
        waiting_++;
      }
    } else if (held_[op.id] == kFreedEarly) {
      held_[op.id] = kNotHeld;  // an out-of-memory path freed it already
    } else if (held_[op.id] == kNotHeld) {
      skipped_frees_++;
    } else {
      free_one(op.id);
    }
    if (bucket_ != 0 && ((pos_ + 1) % bucket_ == 0 || pos_ + 1 == ops.size())) sample(pos_);
  }
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return !stopped_;
}

bool Replayer::alloc_one(const ReplayOp& op) {
  // The allocator's own out-of-memory path has run; the blocks whose free was
  // requested are those it would have waited for, had the replay called
  // record_stream: freed now, one more try.
  if (!try_alloc(op) && !(free_requested_now() && try_alloc(op))) return false;
  held_[op.id] = kHeld;
  size_[op.id] = op.size;
  mallocs_++;
  live_ += static_cast<int64_t>(op.size);
  peak_live_ = std::max(peak_live_, live_);
  bucket_live_max_ = std::max(bucket_live_max_, live_);
  return true;
}

bool Replayer::try_alloc(const ReplayOp& op) {
  try {
    ptr_[op.id] = alloc_.malloc(op.size, op.stream);
  } catch (const OutOfMemoryError&) {
    return false;
  } catch (const std::invalid_argument&) {
    return false;  // a size no device could hold: out of memory on any budget
  }
  return true;
}

void Replayer::free_one(uint32_t id) {
  if (held_[id] == kFreeWaits) waiting_--;
  alloc_.free(ptr_[id]);
  held_[id] = kNotHeld;
  ptr_[id] = 0;
  frees_++;
  live_ -= static_cast<int64_t>(size_[id]);
  // Ids freed by their free op stay in requested_: dropped once they outnumber the rest.
  if (requested_.size() > 2 * waiting_ + 64)
    requested_.erase(std::remove_if(requested_.begin(), requested_.end(),
                                    [&](uint32_t i) { return held_[i] != kFreeWaits; }),
                     requested_.end());
}

bool Replayer::free_requested_now() {
  if (waiting_ == 0) return false;
  // In the order they were requested, as the allocator would find their events done.
  std::vector<uint32_t> ids;
  ids.swap(requested_);
  for (uint32_t id : ids) {
    if (held_[id] != kFreeWaits) continue;  // freed by its free op since (or its id reused)
    free_one(id);
    held_[id] = kFreedEarly;
    early_frees_++;
  }
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
