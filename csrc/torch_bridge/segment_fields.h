// Members of PyTorch's SegmentInfo that some torch releases have and others
// lack, set where the torch the bridge is built against has them. Without
// torch, so that a test can build it against SegmentInfo's older and newer
// layouts on a machine without a GPU (tests/cuda/test_bridge_api.py).
//
// The bridge builds against torch 2.9 and newer; which release added a
// member is not always known, so its presence is asked of the type itself
// (overload resolution drops the setter whose assignment does not compile)
// rather than of TORCH_VERSION.
#ifndef PYALLOC_TORCH_BRIDGE_SEGMENT_FIELDS_H
#define PYALLOC_TORCH_BRIDGE_SEGMENT_FIELDS_H

#include <cstdint>
#include <limits>

namespace pyalloc_bridge {
namespace detail {

// Chosen when S has registration_counter (the int argument matches exactly).
template <class S>
auto set_registration_counter(S& seg, int64_t counter, int) -> decltype((void)(seg.registration_counter = 0)) {
  using Counter = decltype(seg.registration_counter);
  // PyTorch's is an int32_t that registerMemPool requires to be >= 0.
  int64_t most = static_cast<int64_t>(std::numeric_limits<Counter>::max());
  seg.registration_counter = static_cast<Counter>(counter < most ? counter : most);
}

// Otherwise (int converted to long): the release has no such member.
template <class S>
void set_registration_counter(S&, int64_t, long) {}

}  // namespace detail

/// SegmentInfo::registration_counter (the order in which the memory was
/// obtained, by which ProcessGroupNCCL's registerMemPool sorts a pool's
/// segments), if this torch's SegmentInfo has it; nothing otherwise.
template <class S>
void set_registration_counter(S& seg, int64_t counter) {
  detail::set_registration_counter(seg, counter, 0);
}

}  // namespace pyalloc_bridge

#endif  // PYALLOC_TORCH_BRIDGE_SEGMENT_FIELDS_H
