// Which streams of a device are being captured into CUDA graphs, as far as
// pyalloc has seen.
//
// PyTorch tells a pluggable allocator nothing when a capture begins or ends,
// so the device is asked: every stream pyalloc allocates on is probed, and a
// stream found capturing is remembered until a later probe finds it done.
// While any remembered capture is underway the backends treat every stream
// as capturing: no memory is reserved or released and no event is queried,
// recorded on a capturing stream, or waited on. That is stricter than
// CUDA's thread-local capture mode needs and exactly what its default
// (global) mode demands, where such a call from any thread breaks the capture.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
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

  /// True while any remembered stream is still capturing; forgets the ones
  /// that are done. Costs nothing while no capture has been seen.
  bool underway();

  /// What a backend answers for is_capturing(s): s is capturing, or some
  /// capture is underway, so the device must not be touched.
  bool blocks(Stream s) { return probe(s).capturing || underway(); }

 private:
  Probe probe_;
  std::mutex mu_;
  std::vector<Stream> capturing_;
  std::atomic<size_t> count_{0};
};

/// Puts the calling thread in relaxed capture mode for its scope and then
/// restores the mode it had, as PyTorch's allocator does around cudaMalloc:
/// in relaxed mode, allocating and mapping memory is legal while any stream
/// of the process is being captured (in the default global mode, such a call
/// from any thread invalidates the capture). Does nothing where the driver
/// lacks cuThreadExchangeStreamCaptureMode.
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
