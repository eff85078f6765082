// Shared vocabulary of the allocator core: sizes, streams, the error types the
// Python layer turns into exceptions, and byte formatting for messages.
//
// Nothing here knows about CUDA. A stream is an opaque 64-bit handle (a
// cudaStream_t on the CUDA backend, any integer on the simulated ones).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace pyalloc {

using Stream = uint64_t;

/// Every block size is a multiple of this (PyTorch rounds to the same unit).
constexpr size_t kGranularity = 512;
/// Backend segments are sized in multiples of this.
constexpr size_t kSegmentAlign = size_t(2) << 20;
/// Requests above this cannot be represented after rounding on any device.
constexpr size_t kMaxRequest = size_t(1) << 56;

inline size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

/// The pool could not serve a request. Live allocations are untouched.
/// rejected(): refused at once, from figures already known (the cap, the
/// device's free memory, a size no device holds), before anything was tried:
/// what PyTorch calls an OOM rejection (num_oom_rejections, its rejection
/// observers).
class OutOfMemoryError : public std::runtime_error {
 public:
  explicit OutOfMemoryError(const std::string& what, bool rejected = false)
      : std::runtime_error(what), rejected_(rejected) {}
  bool rejected() const { return rejected_; }

 private:
  bool rejected_;
};

/// free() / record_stream() got a pointer that is not a live allocation.
class InvalidPointerError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// check_invariants() found the structure inconsistent (a bug in the core).
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// "1.50 GiB", "512 B": for messages meant for people.
std::string format_bytes(uint64_t n);

/// "0x7f00deadbe00"
std::string format_ptr(uintptr_t p);

}  // namespace pyalloc
