// Remembering capturing streams until the device says they are done: see capture.h.
#include "capture.h"

#include <algorithm>

namespace pyalloc {

CaptureState CaptureTracker::probe(Stream s) {
  CaptureState st = probe_(s);
  if (st.capturing) {
    std::lock_guard<std::mutex> g(mu_);
    if (std::find(capturing_.begin(), capturing_.end(), s) == capturing_.end()) {
      capturing_.push_back(s);
      count_.store(capturing_.size(), std::memory_order_release);
    }
  }
  return st;
}

bool CaptureTracker::underway() {
  if (declared_.load(std::memory_order_acquire) > 0) return true;
  if (count_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> g(mu_);
  capturing_.erase(std::remove_if(capturing_.begin(), capturing_.end(),
                                  [&](Stream s) { return !probe_(s).capturing; }),
                   capturing_.end());
  count_.store(capturing_.size(), std::memory_order_release);
  return !capturing_.empty();
}

RelaxedCaptureMode::RelaxedCaptureMode(const drv::Driver& d) : d_(d) {
  if (d_.ThreadExchangeStreamCaptureMode == nullptr) return;
  prev_ = drv::CU_STREAM_CAPTURE_MODE_RELAXED;
  swapped_ = d_.ThreadExchangeStreamCaptureMode(&prev_) == drv::CUDA_SUCCESS;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (swapped_) d_.ThreadExchangeStreamCaptureMode(&prev_);
}

}  // namespace pyalloc
