// The end of the allocator's out-of-memory path (oom.h): a refusal, and the
// error raised once no retry is left, counted, traced and worded here. The
// retries are in malloc() (allocator.cpp). Also malloc_cached(), what another
// pool's out-of-memory path may ask of this one (its OomPolicy's last resort).
#include <algorithm>
#include <sstream>
#include <utility>

#include "allocator.h"

namespace pyalloc {

uintptr_t Allocator::malloc_cached(size_t size, Stream s, uint64_t context) {
  if (size == 0 || size > kMaxRequest) return 0;
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  prepare(s);
  size_t rounded = round_up(size, kGranularity);
  if (!pending_.empty() && !backend_->is_capturing(s)) process_pending(false);
  Block* b;
  if (rounded <= cfg_.small_size) {
    b = find_free(kSmallPool, rounded, s);
  } else {
    if (bool small = rounded <= kSmallArea; small != small_area_) set_area(small);
    Block* frontier = nullptr;
    b = find_large(rounded, s, &frontier);
    if (b == nullptr) b = frontier;
  }
  if (b == nullptr) return 0;
  ContextScope scope(&trace_context_, context);
  return hand_out(take(b, rounded, s), size, s, context);
}

void Allocator::refuse(size_t request, size_t size, Stream s, std::string why, bool rejected, bool hopeless) {
  throw Refused{OomFailure{request, size, s, std::move(why), rejected, hopeless}};
}

void Allocator::throw_oom(const OomFailure& f, uint64_t context) {
  std::string message;
  {
    std::lock_guard<Lock> guard(mu_);
    // The driver is asked for the history's entry and for the core's own
    // words; a policy's words ask it what they need.
    size_t dev_free = 0, dev_total = 0;
    if (history_on_ || oom_policy_ == nullptr) backend_->mem_info(&dev_free, &dev_total);
    stats_.num_ooms++;
    // Refused before trying, as PyTorch's throw_on_cudamalloc_oom refuses what
    // its memory fraction cannot hold: PyTorch counts these apart.
    if (f.rejected) stats_.num_oom_rejections++;
    if (history_on_) {
      ContextScope scope(&trace_context_, context);
      trace(TraceEntry::kOom, dev_free, f.request, f.stream);
    }
    if (oom_policy_ == nullptr) message = describe_oom_locked(f, dev_free, dev_total);
  }
  if (oom_policy_ != nullptr) message = oom_policy_->describe(*this, f);
  throw OutOfMemoryError(message, f.rejected);
}

std::string Allocator::describe_oom_locked(const OomFailure& f, size_t dev_free, size_t dev_total) const {
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t allocated = static_cast<size_t>(stats_.allocated_bytes.all.current);
  size_t active = static_cast<size_t>(stats_.active_bytes.all.current);
  size_t free_bytes = reserved - active;
  size_t largest = std::max(largest_free_locked(kLargePool), largest_free_locked(kSmallPool));
  std::ostringstream m;
  m << "out of memory: tried to allocate " << format_bytes(f.request);
  if (f.request <= kMaxRequest && f.size != round_up(f.request, kGranularity))
    m << " (as a " << format_bytes(f.size) << " small-pool chunk)";
  // Each figure once: `why` names none that follows.
  m << " on stream " << f.stream << ": " << f.why << ". The pool has " << format_bytes(allocated)
    << " allocated and " << format_bytes(reserved) << " reserved";
  if (cfg_.max_pool_size != 0)
    m << ", under its cap of " << format_bytes(cfg_.max_pool_size) << " (max_pool_size)";
  m << "; " << format_bytes(free_bytes) << " of the reserved memory is free, the largest free block is "
    << format_bytes(largest) << ".";
  if (free_bytes >= f.size && largest < f.size)
    m << " The free memory is fragmented: no free block is large enough.";
  if (dev_total != 0)
    m << " The device has " << format_bytes(dev_free) << " free of " << format_bytes(dev_total) << ".";
  return m.str();
}

}  // namespace pyalloc
