// The CUDA backend: pools of device memory over the driver API, which is
// loaded at run time (cuda_driver.h), so that the same library imports on a
// machine without a GPU.
//
// A Device is one GPU as the PyTorch hooks see it: it makes a Backend for
// each pool on that GPU (the general pool and the buffer pool), and holds
// what the pools share: the primary context, and the capture tracker, which
// is the same for every device of the process (CUDA's global capture mode
// forbids the calls it guards from any thread, on any device).
//
// The CUDA Backend, beyond backend.h's contract:
// - Every driver call runs with the device's primary context current; the
//   calling thread gets back what it had current: another context, or none.
// - reserve() is cuMemAlloc; it returns 0 for CUDA_ERROR_OUT_OF_MEMORY and
//   throws DriverError for any other failure (a broken context is not an
//   out-of-memory). release() is cuMemFree, which waits for the device's
//   work on that memory to finish.
// - Events are created once (CU_EVENT_DISABLE_TIMING) and recycled: a freed
//   EventId's CUevent serves the next record_event(). An event recorded on a
//   stream of another device (record_stream) is made in that stream's
//   context: the primary context of the device a stream is tagged with
//   (streams.h). Another thread's cudaStreamPerThread, which no handle names
//   from this thread, is stood for by the legacy default stream. Only CUDA_SUCCESS from cuEventQuery means done; NOT_READY and
//   the capture errors mean not yet; any other answer fails the event for
//   good (its block is never reused, as the device may still use it), is
//   said once on stderr, and is raised by the device's next allocation
//   (Device::take_error()).
// - Pages (virtual memory) are mapped for the device and every device that
//   can access it as a peer (cuDeviceCanAccessPeer); if the driver refuses
//   the peers, for the device alone, said once on stderr.
// - Virtual memory is offered (vmm_page_size() != 0) only when the driver
//   has the entry points, the device supports it and a trial mapping of one
//   page at open succeeded; otherwise Device::vmm_unavailable() says why.
// - Captures (capture.h): while a capture is underway in the process,
//   is_capturing() is true for every stream, reserve() and vmm_map() run
//   in relaxed capture mode (capture.h; they return 0/false where the driver
//   has no such mode), mem_info() answers 0 (unknown) and event_done() false without asking
//   the driver, and an event
//   asked for is not recorded (it would land in the graph if its stream
//   were capturing): it is recorded on its stream once the capture is over,
//   which completes no earlier than the work it stands for.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "capture.h"

namespace pyalloc {

class Device {
 public:
  virtual ~Device() = default;

  /// PyTorch's device index (the CUDA ordinal under CUDA_VISIBLE_DEVICES).
  virtual int index() const = 0;
  /// A fresh backend for one pool on this device.
  virtual std::unique_ptr<Backend> make_backend() = 0;
  virtual CaptureTracker& captures() = 0;
  /// Free and total bytes of the device (both 0 if unknown).
  virtual void mem_info(size_t* free_bytes, size_t* total_bytes) = 0;
  /// The device's memory in bytes (0 if unknown); unlike mem_info(), known
  /// during a capture too.
  virtual size_t total_bytes() = 0;
  /// The DLPack device type of its memory (kDLCUDA = 2; kDLCPU = 1 for the fake).
  virtual int dlpack_device_type() const = 0;
  /// Why its backends offer no virtual memory; empty when they do.
  virtual std::string vmm_unavailable() const { return ""; }
  /// The error that has left memory of this device unusable since the last
  /// call, as a message for the user; empty if none. Cleared by the call.
  virtual std::string take_error() { return ""; }
  /// Whether take_error() may have one: asked by every allocation, so
  /// without building a string.
  virtual bool has_error() const { return false; }
};

/// What `pyalloc doctor` shows of a CUDA device.
struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  size_t total_bytes = 0;
  size_t free_bytes = 0;
  size_t vmm_page = 0;      // mapping granularity; 0: no virtual memory
  std::string vmm_why;      // when vmm_page is 0: why
  std::vector<int> peers;   // devices that can access its memory
  std::string peers_why;    // non-empty: the driver refused mapping for them
};

/// Opens device `index` as open_cuda_device() does (retaining its primary
/// context, a trial mapping) and describes it. Throws drv::DriverError.
CudaDeviceInfo describe_cuda_device(int index);

/// Opens CUDA device `index`: loads the driver and retains the device's
/// primary context. Throws drv::DriverError saying what is missing.
std::unique_ptr<Device> open_cuda_device(int index);

/// The number of CUDA devices the driver sees; throws drv::DriverError.
int cuda_device_count();

/// For tests without a GPU: a device whose pools are host memory
/// (host_backend) of `capacity` bytes each, whose captures are set by
/// set_fake_capture(). Its memory is real, so tests can write through it.
std::unique_ptr<Device> open_fake_device(int index, size_t capacity);

/// Makes a fake device stream capturing with capture id `id`, or not
/// capturing when id == 0. Stream handles are unique in the process.
void set_fake_capture(Stream stream, uint64_t id);

}  // namespace pyalloc
