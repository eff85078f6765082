// Stream values beyond a driver handle: see streams.h.
#include "streams.h"

#include <atomic>

namespace pyalloc {
namespace streams {
namespace {

// Bit 63: a tagged value. Bits 56-62: the device + 1 (0: the pool's own).
// Bit 55: a thread's cudaStreamPerThread, the thread's number in bits 0-47;
// otherwise bits 0-47 hold the handle.
constexpr Stream kTagged = Stream{1} << 63;
constexpr int kDeviceShift = 56;
constexpr Stream kDeviceMask = Stream{0x7f} << kDeviceShift;
constexpr Stream kPerThread = Stream{1} << 55;
constexpr Stream kLow = (Stream{1} << 48) - 1;
constexpr int kMaxTaggedDevice = 0x7f - 1;

bool tagged(Stream s) { return (s & kTagged) != 0; }

}  // namespace

Stream per_thread() {
  // Numbers are never reused, so a thread that ended leaves no stream that
  // a new thread could be taken for.
  static std::atomic<Stream> next{1};
  thread_local const Stream mine = kTagged | kPerThread | (next.fetch_add(1, std::memory_order_relaxed) & kLow);
  return mine;
}

Stream from_handle(uintptr_t h) { return h == kPerThreadHandle ? per_thread() : static_cast<Stream>(h); }

Stream on_device(Stream s, int device, int own) {
  if (device < 0 || device == own || device > kMaxTaggedDevice || device_of(s) >= 0) return s;
  if (!tagged(s) && s > kLow) return s;
  return s | kTagged | (static_cast<Stream>(device + 1) << kDeviceShift);
}

int device_of(Stream s) {
  if (!tagged(s)) return -1;
  return static_cast<int>((s & kDeviceMask) >> kDeviceShift) - 1;
}

Stream without_device(Stream s) {
  if (device_of(s) < 0) return s;
  Stream rest = s & ~kDeviceMask;
  return (rest & kPerThread) != 0 ? rest : rest & kLow;  // a handle needs no tag of its own
}

bool is_per_thread(Stream s) { return tagged(s) && (s & kPerThread) != 0; }

bool is_this_threads(Stream s) { return is_per_thread(s) && (s & ~kDeviceMask) == per_thread(); }

uintptr_t handle(Stream s) {
  if (!tagged(s)) return static_cast<uintptr_t>(s);
  return is_per_thread(s) ? kPerThreadHandle : static_cast<uintptr_t>(s & kLow);
}

}  // namespace streams
}  // namespace pyalloc
