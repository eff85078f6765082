// The CUDA backend and device over the run-time-loaded driver: see cuda_backend.h.
#include "cuda_backend.h"

#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"

namespace pyalloc {
namespace {

using namespace drv;

CUstream as_stream(Stream s) { return reinterpret_cast<CUstream>(static_cast<uintptr_t>(s)); }

/// Makes ctx current for the scope; restores another context the thread had.
class ContextGuard {
 public:
  ContextGuard(const Driver& d, CUcontext ctx) : d_(d) {
    if (d_.CtxGetCurrent(&prev_) != CUDA_SUCCESS) prev_ = nullptr;
    if (prev_ != ctx) {
      check(d_.CtxSetCurrent(ctx), "cuCtxSetCurrent");
      restore_ = prev_ != nullptr;
    }
  }
  ~ContextGuard() {
    if (restore_) d_.CtxSetCurrent(prev_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  const Driver& d_;
  CUcontext prev_ = nullptr;
  bool restore_ = false;
};

void device_mem_info(const Driver& d, CUcontext ctx, size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
  try {
    ContextGuard g(d, ctx);
    if (d.MemGetInfo(free_bytes, total_bytes) != CUDA_SUCCESS) *free_bytes = *total_bytes = 0;
  } catch (const DriverError&) {
  }
}

CaptureState probe_stream(const Driver& d, Stream s) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  CUresult r = d.StreamGetCaptureInfo != nullptr ? d.StreamGetCaptureInfo(as_stream(s), &status, &id)
                                                 : d.StreamIsCapturing(as_stream(s), &status);
  CaptureState st;
  if (r == CUDA_SUCCESS) {
    // An invalidated capture is still a capture until it is ended.
    st.capturing = status != CU_STREAM_CAPTURE_STATUS_NONE;
    st.id = st.capturing ? id : 0;
  } else if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
    // The legacy stream while a blocking stream captures: it may not be used.
    st.capturing = true;
  }
  return st;
}

// One for the process: CUDA's global capture mode forbids the calls it
// guards from any thread, whatever the device.
CaptureTracker& process_captures() {
  static CaptureTracker* tracker =
      new CaptureTracker([](Stream s) { return probe_stream(driver(), s); });
  return *tracker;
}

// What the pools of one device share. Never destroyed while a backend lives.
struct CudaShared {
  CudaShared(int index, CUdevice dev, CUcontext ctx)
      : index(index), dev(dev), ctx(ctx), captures(process_captures()) {}
  int index;
  CUdevice dev;
  CUcontext ctx;
  CaptureTracker& captures;
  size_t vmm_page = 0;  // the device's mapping granularity; 0: no virtual memory
  CUmemAllocationProp prop{};  // device memory, pinned, on this device
};

// Whether the device and driver do virtual memory management, and its page.
size_t probe_vmm(const Driver& d, CudaShared& sh) {
  if (!d.has_vmm()) return 0;
  int supported = 0;
  if (d.DeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, sh.dev) !=
          CUDA_SUCCESS ||
      supported == 0)
    return 0;
  sh.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  sh.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  sh.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  sh.prop.location.id = sh.dev;
  size_t page = 0;
  ContextGuard g(d, sh.ctx);
  if (d.MemGetAllocationGranularity(&page, &sh.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
    return 0;
  // The core sizes pages in units of its 512 B granularity.
  return page != 0 && page % kGranularity == 0 ? page : 0;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::shared_ptr<CudaShared> shared) : d_(driver()), sh_(std::move(shared)) {}

  const char* name() const override { return "cuda"; }

  uintptr_t reserve(size_t size) override {
    if (sh_->captures.underway() && !grows_while_capturing()) return 0;
    RelaxedCaptureMode relaxed(d_);  // legal whatever capture is underway
    ContextGuard g(d_, sh_->ctx);
    CUdeviceptr p = 0;
    CUresult r = d_.MemAlloc(&p, size);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
    check(r, "cuMemAlloc");
    return static_cast<uintptr_t>(p);
  }

  void release(uintptr_t base, size_t size) override {
    // The core has already forgotten this segment; an error here can only be reported.
    try {
      ContextGuard g(d_, sh_->ctx);
      CUresult r = d_.MemFree(static_cast<CUdeviceptr>(base));
      if (r != CUDA_SUCCESS)
        std::fprintf(stderr, "pyalloc: cuMemFree of %zu bytes at 0x%llx failed: %s\n", size,
                     static_cast<unsigned long long>(base), error_name(r).c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: releasing a segment failed: %s\n", e.what());
    }
  }

  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    // Out-of-memory messages during a capture go without the device's numbers.
    if (sh_->captures.underway()) *free_bytes = *total_bytes = 0;
    else device_mem_info(d_, sh_->ctx, free_bytes, total_bytes);
  }

  EventId record_event(Stream s) override {
    EventId id;
    if (!spare_.empty()) {
      id = spare_.back();
      spare_.pop_back();
    } else {
      id = slots_.size();
      slots_.emplace_back();
    }
    Slot& slot = slots_[id];
    slot.stream = s;
    slot.done = false;
    slot.unrecorded = true;
    try_record(slot);
    return id;
  }

  bool event_done(EventId id) override {
    Slot& slot = slots_[id];
    if (slot.done) return true;
    // No queries while a capture is on: they may break it (global mode).
    if (sh_->captures.underway()) return false;
    if (slot.unrecorded && !try_record(slot)) return false;
    CUresult r;
    try {
      ContextGuard g(d_, sh_->ctx);
      r = d_.EventQuery(slot.event);
    } catch (const DriverError& e) {
      std::fprintf(stderr, "pyalloc: %s\n", e.what());
      return false;
    }
    if (r == CUDA_ERROR_NOT_READY) return false;
    // Any other answer ends the wait: a failed context never completes events.
    slot.done = true;
    return true;
  }

  bool event_wait(EventId id) override {
    Slot& slot = slots_[id];
    if (slot.done) return true;
    // An event that cannot be recorded yet (its stream is capturing) cannot
    // be waited for: the core keeps treating it as not done.
    if (sh_->captures.underway()) return false;
    if (slot.unrecorded && !try_record(slot)) return false;
    try {
      ContextGuard g(d_, sh_->ctx);
      CUresult r = d_.EventSynchronize(slot.event);
      if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "pyalloc: cuEventSynchronize failed: %s\n", error_name(r).c_str());
        return false;
      }
    } catch (const DriverError& e) {
      std::fprintf(stderr, "pyalloc: %s\n", e.what());
      return false;
    }
    slot.done = true;
    return true;
  }

  void event_free(EventId id) override { spare_.push_back(id); }

  bool is_capturing(Stream s) override { return sh_->captures.blocks(s); }
  bool capture_underway() override { return sh_->captures.underway(); }
  bool grows_while_capturing() override { return d_.ThreadExchangeStreamCaptureMode != nullptr; }

  // Virtual memory: one physical allocation (cuMemCreate handle) per page,
  // so that any page can be unmapped and returned on its own.
  size_t vmm_page_size() override { return sh_->vmm_page; }

  uintptr_t vmm_reserve(size_t size) override {
    ContextGuard g(d_, sh_->ctx);
    CUdeviceptr p = 0;
    if (d_.MemAddressReserve(&p, size, sh_->vmm_page, 0, 0) != CUDA_SUCCESS) return 0;
    return static_cast<uintptr_t>(p);
  }

  void vmm_release(uintptr_t base, size_t size) override {
    try {
      ContextGuard g(d_, sh_->ctx);
      for (auto it = handles_.begin(); it != handles_.end();) {
        if (it->first >= base && it->first < base + size) {
          d_.MemUnmap(static_cast<CUdeviceptr>(it->first), sh_->vmm_page);
          d_.MemRelease(it->second);
          it = handles_.erase(it);
        } else {
          ++it;
        }
      }
      d_.MemAddressFree(static_cast<CUdeviceptr>(base), size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: releasing a virtual range failed: %s\n", e.what());
    }
  }

  bool vmm_map(uintptr_t addr, size_t size) override {
    if (sh_->captures.underway() && !grows_while_capturing()) return false;
    RelaxedCaptureMode relaxed(d_);
    ContextGuard g(d_, sh_->ctx);
    size_t page = sh_->vmm_page;
    for (size_t off = 0; off < size; off += page) {
      CUmemGenericAllocationHandle h = 0;
      CUresult r = d_.MemCreate(&h, page, &sh_->prop, 0);
      if (r == CUDA_SUCCESS) {
        r = d_.MemMap(static_cast<CUdeviceptr>(addr + off), page, 0, h, 0);
        if (r != CUDA_SUCCESS) d_.MemRelease(h);
      }
      if (r != CUDA_SUCCESS) {
        unmap_pages(addr, off);  // nothing stays mapped from this call
        if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
        check(r, "cuMemCreate/cuMemMap");
      }
      handles_[addr + off] = h;
    }
    CUmemAccessDesc access{};
    access.location = sh_->prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult r = d_.MemSetAccess(static_cast<CUdeviceptr>(addr), size, &access, 1);
    if (r != CUDA_SUCCESS) {
      unmap_pages(addr, size);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      check(r, "cuMemSetAccess");
    }
    return true;
  }

  void vmm_unmap(uintptr_t addr, size_t size) override {
    // The core unmaps only pages every stream is done with (backend.h).
    try {
      ContextGuard g(d_, sh_->ctx);
      unmap_pages(addr, size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: unmapping pages failed: %s\n", e.what());
    }
  }

 private:
  void unmap_pages(uintptr_t addr, size_t size) {
    for (size_t off = 0; off < size; off += sh_->vmm_page) {
      auto it = handles_.find(addr + off);
      if (it == handles_.end()) continue;
      d_.MemUnmap(static_cast<CUdeviceptr>(it->first), sh_->vmm_page);
      d_.MemRelease(it->second);  // the memory goes back to the device
      handles_.erase(it);
    }
  }

  struct Slot {
    CUevent event = nullptr;
    Stream stream = 0;
    bool unrecorded = false;  // recording waits for the stream's capture to end
    bool done = false;
  };

  // Records the slot's event on its stream, unless a capture is underway:
  // like PyTorch's own allocator, no event is recorded during any capture.
  bool try_record(Slot& slot) {
    if (sh_->captures.blocks(slot.stream)) return false;
    try {
      ContextGuard g(d_, sh_->ctx);
      if (slot.event == nullptr)
        check(d_.EventCreate(&slot.event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      check(d_.EventRecord(slot.event, as_stream(slot.stream)), "cuEventRecord");
    } catch (const DriverError& e) {
      std::fprintf(stderr, "pyalloc: %s\n", e.what());
      return false;
    }
    slot.unrecorded = false;
    return true;
  }

  const Driver& d_;
  std::shared_ptr<CudaShared> sh_;
  // Used only under the owning core's lock (backend.h), so no lock here.
  std::vector<Slot> slots_;
  std::vector<EventId> spare_;
  std::unordered_map<uintptr_t, CUmemGenericAllocationHandle> handles_;  // mapped page -> handle
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(std::shared_ptr<CudaShared> shared) : sh_(std::move(shared)) {}

  int index() const override { return sh_->index; }
  std::unique_ptr<Backend> make_backend() override { return std::make_unique<CudaBackend>(sh_); }
  CaptureTracker& captures() override { return sh_->captures; }
  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    if (sh_->captures.underway()) *free_bytes = *total_bytes = 0;
    else device_mem_info(driver(), sh_->ctx, free_bytes, total_bytes);
  }
  int dlpack_device_type() const override { return 2; }  // kDLCUDA

 private:
  std::shared_ptr<CudaShared> sh_;
};

}  // namespace

int cuda_device_count() {
  const Driver& d = driver();
  int n = 0;
  check(d.DeviceGetCount(&n), "cuDeviceGetCount");
  return n;
}

std::unique_ptr<Device> open_cuda_device(int index) {
  const Driver& d = driver();
  int count = cuda_device_count();
  if (index < 0 || index >= count)
    throw DriverError("invalid CUDA device index " + std::to_string(index) + ": the driver sees " +
                      std::to_string(count) + " device(s)");
  CUdevice dev = 0;
  check(d.DeviceGet(&dev, index), "cuDeviceGet");
  // The primary context is the one the CUDA runtime, and so PyTorch, uses.
  // It is retained for the life of the process, like the pools on it.
  CUcontext ctx = nullptr;
  check(d.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  auto shared = std::make_shared<CudaShared>(index, dev, ctx);
  shared->vmm_page = probe_vmm(d, *shared);
  return std::make_unique<CudaDevice>(std::move(shared));
}

}  // namespace pyalloc
