// Stream values for the CUDA pools where a driver handle alone names no one
// stream, and what the driver is given for them.
//
// The core takes a stream as an opaque number and tells two streams apart by
// it. A CUDA handle is such a number, except:
// - the default streams' handles (0, cudaStreamLegacy 0x1,
//   cudaStreamPerThread 0x2) name the default stream of whichever device's
//   context they are used in: PyTorch's record_stream with another device's
//   default stream (c10::Stream carries its device) is no stream of the
//   block's own device;
// - cudaStreamPerThread names the calling host thread's own default stream:
//   two threads passing 0x2 use two streams, which do not order each other.
// Such a stream is given a tagged value (bit 63 set, which no user-space
// handle has): the device it belongs to when it is another than the pool's,
// and for cudaStreamPerThread a number of the host thread's own. The backends
// take the tags off before any driver call (handle(), device_of()).
#pragma once

#include <cstdint>

#include "core/common.h"

namespace pyalloc {
namespace streams {

/// cudaStreamLegacy and cudaStreamPerThread, as the runtime defines them.
constexpr uintptr_t kLegacyHandle = 0x1;
constexpr uintptr_t kPerThreadHandle = 0x2;

/// The calling thread's cudaStreamPerThread, as the pools know it.
Stream per_thread();
/// A stream handle PyTorch passes (hooks, bridge) as the pools know it:
/// cudaStreamPerThread becomes the calling thread's own.
Stream from_handle(uintptr_t handle);
/// `s`, a stream of device `device`, as a pool of device `own` knows it:
/// tagged with the device when that is another (device < 0: the pool's own).
/// Left as it is if it cannot be tagged (a handle above 2^48, a device
/// beyond 126): an explicit stream's handle is unique in the process anyway.
Stream on_device(Stream s, int device, int own);

/// The device `s` was tagged with (on_device()); -1: the pool's own.
int device_of(Stream s);
/// `s` as the pools of its own device know it: without on_device()'s tag.
Stream without_device(Stream s);
/// Whether `s` is a thread's cudaStreamPerThread (per_thread()).
bool is_per_thread(Stream s);
/// Whether `s` is the calling thread's cudaStreamPerThread.
bool is_this_threads(Stream s);
/// The handle PyTorch passed for `s` (cudaStreamPerThread for every thread's
/// own): what its graph filters and the snapshots are given.
uintptr_t handle(Stream s);

}  // namespace streams
}  // namespace pyalloc
