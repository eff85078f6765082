// Which streams of a device are being captured into CUDA graphs, as far as
// pyalloc has seen or been told.
//
// Told: PyTorch routes a graph's pool (begin_allocate_to_pool) before it
// calls cudaStreamBeginCapture, and ends the route after the capture ends;
// torch 2.13 also marks the capture itself (markCaptureBegin/End), after
// cudaStreamBeginCapture. Each open route and each mark counts as a capture
// underway (open() / close()), so the window between the route's opening and
// the capture's start is covered too: another thread's event query or free
// there would invalidate the capture as it begins. PyTorch's own allocator
// likewise defers its event processing while any pool route is open. Where
// PyTorch marks its captures (the bridge on torch 2.13 and later), a route
// counts only until its capture's mark takes over, or until it serves a
// stream found not capturing (use_mem_pool: no capture, as PyTorch's
// allocator then counts the marks alone), or until it ends (graph_pools.h).
//
// Seen: without those calls, every stream pyalloc allocates on is probed, and a
// stream found capturing is remembered until a later probe finds it done.
// While any capture is underway the backends treat every stream
// as capturing: no memory is reserved or released and no event is queried,
// recorded on a capturing stream, or waited on. That is stricter than
// CUDA's thread-local capture mode needs and exactly what its default
// (global) mode demands, where such a call from any thread breaks the capture.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "core/common.h"
#include "cuda_driver.h"

namespace pyalloc {

struct CaptureState {
  bool capturing = false;
  /// The capture sequence's id, unique in the process; 0 when unknown.
  uint64_t id = 0;
};

class CaptureTracker {
 public:
  /// Asks the device about one stream; must be legal during any capture.
  using Probe = std::function<CaptureState(Stream)>;

  explicit CaptureTracker(Probe probe) : probe_(std::move(probe)) {}

  /// The stream's state, from the device; a capturing stream is remembered.
  CaptureState probe(Stream s);

  /// True while a capture is declared open, or any remembered stream is
  /// still capturing (forgetting the ones that are done). Costs one atomic
  /// load while no capture has been seen or declared.
  bool underway();

  /// Calls `call` (a driver call CUDA's global capture mode forbids, made
  /// outside every pool's lock) unless a capture is underway; false if it
  /// did not. drain() returns once no call begun this way is still running:
  /// with the pools' locks (DevicePools::quiesce), what a declaration waits
  /// for before PyTorch begins the capture.
  template <class F>
  bool unless_underway(F&& call) {
    std::shared_lock<std::shared_mutex> g(calls_mu_);
    if (underway()) return false;
    call();
    return true;
  }
  void drain() { std::unique_lock<std::shared_mutex> g(calls_mu_); }

  /// PyTorch says a capture may be underway from now on (a pool route, or
  /// torch 2.13's markCaptureBegin), until the matching close().
  void open() { declared_.fetch_add(1, std::memory_order_acq_rel); }
  void close() { declared_.fetch_sub(1, std::memory_order_acq_rel); }
  /// How many are declared open now.
  int declared() const { return declared_.load(std::memory_order_acquire); }

  /// What a backend answers for is_capturing(s): s is capturing, or some
  /// capture is underway, so the device must not be touched. While one is
  /// declared, the stream is not even asked about (PyTorch declares every
  /// capture once it declares any: each has a route).
  bool blocks(Stream s) { return declared() > 0 || probe(s).capturing || underway(); }

 private:
  Probe probe_;
  std::mutex mu_;
  std::vector<Stream> capturing_;
  std::atomic<size_t> count_{0};
  std::atomic<int> declared_{0};
  std::shared_mutex calls_mu_;
};

/// Puts the calling thread in relaxed capture mode for its scope and then
/// restores the mode it had, as PyTorch's allocator does around cudaMalloc:
/// in relaxed mode, allocating and mapping memory is legal while any stream
/// of the process is being captured (in the default global mode, such a call
/// from any thread invalidates the capture). pyalloc wraps every driver call
/// that may meet another thread's capture so, as NCCL wraps its cuMem* calls:
/// growing a pool, a device's first opening (its context, granularity and
/// virtual range), giving a range back, and opening another process's
/// memory. Does nothing where the driver lacks
/// cuThreadExchangeStreamCaptureMode.
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(const drv::Driver& d);
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  const drv::Driver& d_;
  drv::CUstreamCaptureMode prev_ = drv::CU_STREAM_CAPTURE_MODE_GLOBAL;
  bool swapped_ = false;
};

}  // namespace pyalloc
