// The CUDA backend and device over the run-time-loaded driver: see cuda_backend.h.
#include "cuda_backend.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_driver.h"
#include "streams.h"

namespace pyalloc {
namespace {

using namespace drv;

// The handle the driver takes for one of the pools' streams (streams.h).
CUstream as_stream(Stream s) { return reinterpret_cast<CUstream>(streams::handle(s)); }

// The handle an event for the work queued so far on `s` is recorded on.
// Another thread's cudaStreamPerThread cannot be named from this one: the
// legacy default stream stands for it, as an event on that stream completes
// only after the work queued before it on every blocking stream of the
// context, every thread's cudaStreamPerThread included.
CUstream event_stream(Stream s) {
  if (streams::is_per_thread(s) && !streams::is_this_threads(s))
    return reinterpret_cast<CUstream>(streams::kLegacyHandle);
  return as_stream(s);
}

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
  CUresult r = d.StreamGetCaptureInfo != nullptr
                   ? d.StreamGetCaptureInfo(as_stream(s), &status, &id, nullptr, nullptr, nullptr)
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
  // Any other error (a destroyed stream, a context torn down at exit) means
  // not capturing, so the tracker forgets the stream and never asks again.
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
  std::string vmm_why;  // when vmm_page is 0: why
  bool vmm_proven = false;  // the trial mapping was made (not skipped during a capture)
  // The driver calls of the trial mapping (probe_vmm()) that no pool has
  // counted yet: the first pool to collect its uncounted calls takes them.
  std::atomic<int64_t> probe_calls{0};
  CUmemAllocationProp prop{};  // device memory, pinned, on this device
  // Why pages cannot be shared with other processes (vmm_share); empty when
  // they are made with a POSIX file descriptor as their shareable handle.
  std::string share_why;
  // Who may read and write mapped pages: this device first, then each
  // device that can access it as a peer (cuDeviceCanAccessPeer).
  std::vector<CUmemAccessDesc> access;
  std::vector<int> peers;                   // their ordinals
  std::atomic<bool> peers_refused{false};   // the driver refused them: this device alone
  std::string peers_why;

  // The first error that left memory unusable, until an allocation raises it.
  std::mutex error_mu;
  std::string error;
  bool error_told = false;
  std::atomic<bool> has_error{false};  // error is not empty: read without the lock
  // cuCtxSynchronize calls begun in ctx so far, and the number of the latest
  // begun that has returned: an event on a stream that was destroyed is done
  // once one begun after it was found gone has returned.
  std::atomic<uint64_t> ctx_syncs_begun{0};
  std::atomic<uint64_t> ctx_synced{0};

  size_t access_count() const { return peers_refused.load(std::memory_order_acquire) ? 1 : access.size(); }

  // A driver call about the work on a block failed: the block stays out of
  // use (kernels may still be using it). Said once on stderr, and kept for
  // the next allocation on this device to raise (take_error()).
  void report_error(const std::string& what, CUresult r, Stream stream) {
    std::string message = "CUDA error on device " + std::to_string(index) + ": " + what + " failed: " +
                          error_name(r) + ". pyalloc keeps the memory last used on stream " +
                          format_ptr(static_cast<uintptr_t>(stream)) +
                          " out of use, since the device may still be using it; a failed kernel "
                          "(an illegal address, an assert) usually leaves the device unusable "
                          "until the process restarts";
    std::lock_guard<std::mutex> g(error_mu);
    if (error.empty()) error = message;
    has_error.store(true, std::memory_order_release);
    // At exit the driver is torn down before the last frees: nothing to tell then.
    if (error_told || r == CUDA_ERROR_DEINITIALIZED) return;
    error_told = true;
    std::fprintf(stderr, "pyalloc: %s\n", message.c_str());
  }

  void refuse_peers(CUresult r) {
    if (peers_refused.exchange(true)) return;
    peers_why = "cuMemSetAccess for peer devices failed: " + error_name(r);
    std::fprintf(stderr,
                 "pyalloc: device %d: %s; its pages are mapped for device %d alone, and peer "
                 "devices reading them directly will fault\n",
                 index, peers_why.c_str(), index);
  }
};

// Sets the access of a mapped range: this device and its peers, or this
// device alone once the driver has refused the peers.
CUresult set_access(const Driver& d, CudaShared& sh, uintptr_t addr, size_t size, int64_t* calls = nullptr) {
  size_t n = sh.access_count();
  CUresult r = d.MemSetAccess(static_cast<CUdeviceptr>(addr), size, sh.access.data(), n);
  if (r != CUDA_SUCCESS && n > 1 && r != CUDA_ERROR_OUT_OF_MEMORY) {
    if (calls != nullptr) ++*calls;
    CUresult alone = d.MemSetAccess(static_cast<CUdeviceptr>(addr), size, sh.access.data(), 1);
    if (alone == CUDA_SUCCESS) sh.refuse_peers(r);
    r = alone;
  }
  return r;
}

// The devices that can access `sh`'s memory as peers, as access descriptors.
void find_peers(const Driver& d, CudaShared& sh) {
  CUmemAccessDesc own{};
  own.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  own.location.id = sh.dev;
  own.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  sh.access.assign(1, own);
  int count = 0;
  if (d.DeviceCanAccessPeer == nullptr || d.DeviceGetCount(&count) != CUDA_SUCCESS) return;
  for (int i = 0; i < count; ++i) {
    CUdevice other = 0;
    int can = 0;
    if (i == sh.index || d.DeviceGet(&other, i) != CUDA_SUCCESS || other == sh.dev) continue;
    if (d.DeviceCanAccessPeer(&can, other, sh.dev) != CUDA_SUCCESS || can == 0) continue;
    CUmemAccessDesc peer = own;
    peer.location.id = other;
    sh.access.push_back(peer);
    sh.peers.push_back(i);
  }
}

// Whether the device and driver do virtual memory management, and its page;
// on 0, sh.vmm_why says why. Maps one page once: a driver that lists the
// entry points but refuses the calls (a sandbox, a vGPU) is found here.
size_t probe_vmm(const Driver& d, CudaShared& sh) {
  if (!d.has_vmm()) {
    sh.vmm_why = "the CUDA driver lacks its virtual memory entry points (" + d.vmm_missing + ")";
    return 0;
  }
  int supported = 0;
  CUresult r = d.DeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, sh.dev);
  if (r != CUDA_SUCCESS || supported == 0) {
    sh.vmm_why = r != CUDA_SUCCESS ? "asking whether the device supports virtual memory failed: " + error_name(r)
                                   : "the device does not support virtual memory management";
    return 0;
  }
  sh.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  // Shareable as POSIX file descriptors (CUDA IPC of pages, csrc/cuda/ipc.h),
  // passed over a Unix socket: no pidfd_getfd, which containers refuse.
  sh.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (!d.has_shareable_handles()) {
    sh.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    sh.share_why = "the CUDA driver lacks cuMemExportToShareableHandle";
  }
  sh.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  sh.prop.location.id = sh.dev;
  size_t page = 0;
  ContextGuard g(d, sh.ctx);
  r = d.MemGetAllocationGranularity(&page, &sh.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) {
    sh.vmm_why = "cuMemGetAllocationGranularity failed: " + error_name(r);
    return 0;
  }
  // The core sizes pages in units of its 512 B granularity.
  if (page == 0 || page % kGranularity != 0) {
    sh.vmm_why = "the device's mapping granularity (" + std::to_string(page) + " bytes) is unusable";
    return 0;
  }
  // No trial during a capture: it would break it. The pools find out later.
  if (sh.captures.underway()) return page;
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  const char* step = "cuMemAddressReserve";
  // Counted as the pools count theirs (stats.h): cuMemAddressFree is not.
  int64_t calls = 1;
  r = d.MemAddressReserve(&va, page, page, 0, 0);
  if (r == CUDA_SUCCESS) {
    step = "cuMemCreate";
    calls++;
    r = d.MemCreate(&h, page, &sh.prop, 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY &&
        sh.prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
      // Pages the device cannot share still serve this process. Drivers
      // refuse the handle type with NOT_SUPPORTED, INVALID_VALUE or
      // NOT_PERMITTED: as PyTorch's expandable segments do, any answer but
      // out of memory means "not this handle type". A device that refuses
      // pages of any kind refuses the plain ones too, and says so.
      sh.share_why = "the device refused pages with a POSIX file descriptor handle: cuMemCreate failed: " +
                     error_name(r);
      sh.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
      calls++;
      r = d.MemCreate(&h, page, &sh.prop, 0);
    }
    if (r == CUDA_SUCCESS) {
      step = "cuMemMap";
      calls += 2;  // and cuMemRelease
      r = d.MemMap(va, page, 0, h, 0);
      if (r == CUDA_SUCCESS) {
        step = "cuMemSetAccess";
        calls += 2;  // and cuMemUnmap
        r = set_access(d, sh, static_cast<uintptr_t>(va), page, &calls);
        d.MemUnmap(va, page);
      }
      d.MemRelease(h);
    }
    d.MemAddressFree(va, page);
  }
  sh.probe_calls.fetch_add(calls, std::memory_order_relaxed);
  if (r != CUDA_SUCCESS) {
    sh.vmm_why = std::string("the driver refused a trial mapping: ") + step + " failed: " + error_name(r);
    return 0;
  }
  sh.vmm_proven = true;
  return page;
}

std::shared_ptr<CudaShared> open_shared(const Driver& d, int index) {
  // A device's pools may first open while another thread captures: retaining
  // its context, asking its granularity and reserving the trial range are
  // legal then only in relaxed mode (in global mode each invalidates the
  // capture), as NCCL makes every cuMem* call.
  RelaxedCaptureMode relaxed(d);
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
  find_peers(d, *shared);
  shared->vmm_page = probe_vmm(d, *shared);
  return shared;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::shared_ptr<CudaShared> shared) : d_(driver()), sh_(std::move(shared)) {}

  const char* name() const override { return "cuda"; }

  uintptr_t reserve(size_t size) override {
    if (sh_->captures.underway() && !grows_while_capturing()) {
      uncounted_--;  // refused with no driver call
      return 0;
    }
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
    if (!sh_->captures.unless_underway([&] { device_mem_info(d_, sh_->ctx, free_bytes, total_bytes); }))
      *free_bytes = *total_bytes = 0;
  }

  // Events. Only CUDA_SUCCESS means the work is done. CUDA_ERROR_NOT_READY
  // and the capture errors mean not yet. A stream that no longer exists
  // (CUDA_ERROR_INVALID_HANDLE from cuEventRecord) is no failure: its last
  // work may still run, so its event is done once the context has been
  // synchronized (event_wait(), on the out-of-memory path and empty_cache;
  // a poll never blocks). Any other answer fails the event: it never
  // completes, so its block is never reused, and the error is reported
  // (CudaShared::report_error).
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
    slot.failed = false;
    slot.gone = false;
    slot.unrecorded = true;
    try_record(slot);
    return id;
  }

  bool event_done(EventId id) override {
    Slot& slot = slots_[id];
    if (slot.done) return true;
    if (slot.failed) return false;
    if (slot.gone) return slot.done = synced_since_gone(slot);
    // No queries while a capture is on: they may break it (global mode).
    if (sh_->captures.underway()) return false;
    if (slot.unrecorded && !try_record(slot)) return false;
    CUresult r;
    try {
      ContextGuard g(d_, slot.ctx);
      r = d_.EventQuery(slot.event);
    } catch (const DriverError& e) {
      return fail(slot, e.what());
    }
    if (r == CUDA_SUCCESS) return slot.done = true;
    if (r == CUDA_ERROR_NOT_READY || is_capture_error(r)) return false;
    return fail(slot, "cuEventQuery", r);
  }

  bool event_wait(EventId id) override {
    Slot& slot = slots_[id];
    if (slot.done) return true;
    if (slot.failed) return false;
    // An event that cannot be recorded yet (its stream is capturing) cannot
    // be waited for: the core keeps treating it as not done.
    if (sh_->captures.underway()) return false;
    if (slot.unrecorded && !try_record(slot) && !slot.gone) return false;
    if (slot.gone) return synchronize_for(slot);
    CUresult r;
    try {
      ContextGuard g(d_, slot.ctx);
      r = d_.EventSynchronize(slot.event);
    } catch (const DriverError& e) {
      return fail(slot, e.what());
    }
    if (r == CUDA_SUCCESS) return slot.done = true;
    if (is_capture_error(r)) return false;
    return fail(slot, "cuEventSynchronize", r);
  }

  void event_free(EventId id) override { spare_.push_back(id); }

  bool is_capturing(Stream s) override { return sh_->captures.blocks(s); }
  bool capture_underway() override { return sh_->captures.underway(); }
  bool grows_while_capturing() override { return d_.ThreadExchangeStreamCaptureMode != nullptr; }

  // Virtual memory: each vmm_map() is one physical allocation (cuMemCreate
  // handle) of its size, mapped (cuMemMap); vmm_access() gives access to a
  // run of them in one cuMemSetAccess; each vmm_unmap() unmaps and releases
  // one such handle whole. The core decides
  // the handles (and counts these calls: num_driver_calls).
  size_t vmm_page_size() override { return sh_->vmm_page; }
  bool vmm_proven() override { return sh_->vmm_proven; }

  uintptr_t vmm_reserve(size_t size) override {
    RelaxedCaptureMode relaxed(d_);  // a pool may open during a capture
    ContextGuard g(d_, sh_->ctx);
    CUdeviceptr p = 0;
    if (d_.MemAddressReserve(&p, size, sh_->vmm_page, 0, 0) != CUDA_SUCCESS) return 0;
    return static_cast<uintptr_t>(p);
  }

  void vmm_release(uintptr_t base, size_t size) override {
    // Also when a pool opened during a capture gives its range back, nothing
    // mapped (vmm.cpp): cuMemAddressFree is legal then in relaxed mode only.
    RelaxedCaptureMode relaxed(d_);
    try {
      ContextGuard g(d_, sh_->ctx);
      for (auto it = handles_.begin(); it != handles_.end();) {
        if (it->first >= base && it->first < base + size) {
          d_.MemUnmap(static_cast<CUdeviceptr>(it->first), it->second.size);
          d_.MemRelease(it->second.handle);
          it = handles_.erase(it);
        } else {
          ++it;
        }
      }
      // None outside a move or an out-of-memory retry: the core drops them.
      for (auto& [sz, h] : spares_) d_.MemRelease(h);
      spares_.clear();
      d_.MemAddressFree(static_cast<CUdeviceptr>(base), size);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: releasing a virtual range failed: %s\n", e.what());
    }
  }

  bool vmm_map(uintptr_t addr, size_t size) override {
    if (sh_->captures.underway() && !grows_while_capturing()) {
      uncounted_--;  // refused with no driver call
      return false;
    }
    RelaxedCaptureMode relaxed(d_);
    ContextGuard g(d_, sh_->ctx);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d_.MemCreate(&h, size, &sh_->prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    if (r != CUDA_SUCCESS) uncounted_++;
    check(r, "cuMemCreate");
    r = d_.MemMap(static_cast<CUdeviceptr>(addr), size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      d_.MemRelease(h);
      // cuMemCreate, cuMemMap and cuMemRelease: one counted if refused.
      uncounted_ += r == CUDA_ERROR_OUT_OF_MEMORY ? 2 : 3;
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      check(r, "cuMemMap");
    }
    handles_[addr] = Mapped{h, size};
    return true;
  }

  bool vmm_access(uintptr_t addr, size_t size) override {
    // One call for every handle mapped in [addr, addr+size), peers too: their
    // kernels and cudaMemcpyAsync read these pages directly. On failure the
    // core unmaps those handles (during a capture it parks them: vmm.cpp).
    RelaxedCaptureMode relaxed(d_);
    ContextGuard g(d_, sh_->ctx);
    CUresult r = set_access(d_, *sh_, addr, size, &uncounted_);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check(r, "cuMemSetAccess");
    return true;
  }

  int64_t take_uncounted_calls() override {
    return std::exchange(uncounted_, 0) + sh_->probe_calls.exchange(0, std::memory_order_relaxed);
  }

  // A handle moved out of a hole: cuMemUnmap now, cuMemMap at its new
  // address (or cuMemRelease if it finds none), never a cuMemRelease and a
  // cuMemCreate for memory the process keeps.
  bool vmm_moves() override { return true; }

  bool vmm_detach(uintptr_t addr, size_t size) override {
    // As vmm_unmap: errors are reported, never thrown into the core mid-move.
    try {
      ContextGuard g(d_, sh_->ctx);
      auto it = handles_.find(addr);
      if (it == handles_.end() || it->second.size != size) {
        std::fprintf(stderr, "pyalloc: no handle of %zu bytes is mapped at 0x%llx\n", size,
                     static_cast<unsigned long long>(addr));
        return false;
      }
      CUmemGenericAllocationHandle h = it->second.handle;
      handles_.erase(it);
      CUresult r = d_.MemUnmap(static_cast<CUdeviceptr>(addr), size);
      if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "pyalloc: cuMemUnmap failed: %s\n", error_name(r).c_str());
        d_.MemRelease(h);
        return false;
      }
      spares_.emplace(size, h);
      return true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: unmapping pages failed: %s\n", e.what());
      return false;
    }
  }

  bool vmm_attach(uintptr_t addr, size_t size) override {
    if (sh_->captures.underway() && !grows_while_capturing()) return false;
    RelaxedCaptureMode relaxed(d_);
    ContextGuard g(d_, sh_->ctx);
    auto it = spares_.find(size);
    if (it == spares_.end()) return false;
    // The handle's memory is held already: any failure is an error (thrown;
    // the handle stays a spare, which the core drops).
    CUresult r = d_.MemMap(static_cast<CUdeviceptr>(addr), size, 0, it->second, 0);
    if (r != CUDA_SUCCESS) uncounted_++;
    check(r, "cuMemMap");
    handles_[addr] = Mapped{it->second, size};
    spares_.erase(it);
    return true;
  }

  void vmm_drop(size_t size) override {
    try {
      ContextGuard g(d_, sh_->ctx);
      auto it = spares_.find(size);
      if (it == spares_.end()) {
        std::fprintf(stderr, "pyalloc: no spare handle of %zu bytes to release\n", size);
        return;
      }
      d_.MemRelease(it->second);
      spares_.erase(it);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: releasing a spare handle failed: %s\n", e.what());
    }
  }

  // Sharing with another process (csrc/cuda/ipc.h). A segment: its legacy
  // IPC handle, which names the whole cuMemAlloc allocation. A page handle:
  // a POSIX file descriptor, if the device's pages are made shareable.
  bool share_segment(uintptr_t base, size_t size, SharedMemory* out, std::string* why) override {
    if (!d_.has_legacy_ipc()) {
      *why = "the CUDA driver lacks the legacy IPC entry points (cuIpcGetMemHandle)";
      return false;
    }
    ContextGuard g(d_, sh_->ctx);
    CUipcMemHandle h{};
    CUresult r = d_.IpcGetMemHandle(&h, static_cast<CUdeviceptr>(base));
    if (r != CUDA_SUCCESS) {
      *why = "cuIpcGetMemHandle failed: " + error_name(r);
      return false;
    }
    *out = SharedMemory{base, size, std::string(h.reserved, sizeof(h.reserved)), -1};
    return true;
  }

  bool vmm_share(uintptr_t addr, size_t size, SharedMemory* out, std::string* why) override {
    if (sh_->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
      *why = "device " + std::to_string(sh_->index) + "'s pages cannot be shared: " + sh_->share_why;
      return false;
    }
    auto it = handles_.find(addr);
    if (it == handles_.end() || it->second.size != size) {
      *why = "no handle of " + std::to_string(size) + " bytes is mapped at " + format_ptr(addr);
      return false;
    }
    ContextGuard g(d_, sh_->ctx);
    int fd = -1;
    CUresult r =
        d_.MemExportToShareableHandle(&fd, it->second.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      *why = "cuMemExportToShareableHandle failed: " + error_name(r);
      return false;
    }
    *out = SharedMemory{addr, size, std::string(), fd};
    return true;
  }

  void vmm_unmap(uintptr_t addr, size_t size) override {
    // The core unmaps only pages every stream is done with (backend.h).
    try {
      ContextGuard g(d_, sh_->ctx);
      if (!unmap_handle(addr))
        std::fprintf(stderr, "pyalloc: no handle of %zu bytes is mapped at 0x%llx\n", size,
                     static_cast<unsigned long long>(addr));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: unmapping pages failed: %s\n", e.what());
    }
  }

 private:
  bool unmap_handle(uintptr_t addr) {
    auto it = handles_.find(addr);
    if (it == handles_.end()) return false;
    d_.MemUnmap(static_cast<CUdeviceptr>(addr), it->second.size);
    d_.MemRelease(it->second.handle);  // the memory goes back to the device
    handles_.erase(it);
    return true;
  }

  struct Slot {
    CUevent event = nullptr;
    CUcontext ctx = nullptr;  // the event's context: its stream's
    Stream stream = 0;
    bool unrecorded = false;  // recording waits for the stream's capture to end
    bool done = false;
    bool failed = false;      // never done: its block stays out of use
    bool gone = false;        // its stream was destroyed: done after a cuCtxSynchronize
    uint64_t gone_at = 0;     // ctx_syncs_begun when it was found gone
    Stream ctx_for = 0;       // the stream ctx was chosen for
  };

  // Chooses the context the slot's event is made in for its stream: the
  // primary context of the device the stream is tagged with (streams.h),
  // else the one the driver named for that same stream before (try_record's
  // cuStreamGetCtx), else this device's. A recycled slot's event made in
  // another context is destroyed: a default stream's handle recorded there
  // would name that context's default stream. False if the slot failed.
  bool choose_context(Slot& slot) {
    int device = streams::device_of(slot.stream);
    CUcontext want = sh_->ctx;
    try {
      if (device >= 0) want = primary_context(d_, device);
      else if (slot.ctx != nullptr && slot.ctx_for == slot.stream) want = slot.ctx;
      if (slot.ctx != want && slot.event != nullptr) {
        ContextGuard g(d_, slot.ctx);
        d_.EventDestroy(slot.event);
        slot.event = nullptr;
      }
    } catch (const DriverError& e) {
      return fail(slot, e.what());
    }
    slot.ctx = want;
    slot.ctx_for = slot.stream;
    return true;
  }

  // A gone stream's event: done if its context (the device's own) was
  // synchronized since.
  bool synced_since_gone(const Slot& slot) const {
    return slot.ctx == sh_->ctx && sh_->ctx_synced.load(std::memory_order_acquire) > slot.gone_at;
  }

  // Waits for every stream of the gone stream's context, so its last work too.
  bool synchronize_for(Slot& slot) {
    if (synced_since_gone(slot)) return slot.done = true;
    uint64_t number = sh_->ctx_syncs_begun.fetch_add(1, std::memory_order_acq_rel) + 1;
    CUresult r;
    try {
      ContextGuard g(d_, slot.ctx);
      r = d_.CtxSynchronize();
    } catch (const DriverError& e) {
      return fail(slot, e.what());
    }
    if (r == CUDA_SUCCESS) {
      if (slot.ctx == sh_->ctx) {
        uint64_t seen = sh_->ctx_synced.load(std::memory_order_acquire);
        while (seen < number && !sh_->ctx_synced.compare_exchange_weak(seen, number, std::memory_order_acq_rel)) {
        }
      }
      return slot.done = true;
    }
    if (is_capture_error(r)) return false;
    return fail(slot, "cuCtxSynchronize", r);
  }

  bool fail(Slot& slot, const std::string& what, CUresult r = CUDA_SUCCESS) {
    slot.failed = true;
    if (r == CUDA_SUCCESS) {  // the context could not be made current
      std::lock_guard<std::mutex> g(sh_->error_mu);
      std::string message = "CUDA error on device " + std::to_string(sh_->index) + ": " + what;
      if (sh_->error.empty()) sh_->error = message;
      sh_->has_error.store(true, std::memory_order_release);
      if (!sh_->error_told) std::fprintf(stderr, "pyalloc: %s\n", message.c_str());
      sh_->error_told = true;
    } else {
      sh_->report_error(what, r, slot.stream);
    }
    return false;
  }

  // Records the slot's event on its stream, unless a capture is underway:
  // like PyTorch's own allocator, no event is recorded during any capture.
  // A stream of another device (record_stream) has another context, where
  // the event is made: an event and its stream must share a context. That
  // device is known when the stream is tagged with it (streams.h), as
  // PyTorch's insert_events records under a guard for the stream's device;
  // otherwise the driver says (cuStreamGetCtx) once the record in this
  // device's context fails.
  bool try_record(Slot& slot) {
    if (sh_->captures.blocks(slot.stream)) return false;
    if (!choose_context(slot)) return false;
    const char* what = "cuEventRecord";
    CUresult r;
    try {
      r = record_in(slot, slot.ctx, &what);
      CUcontext owner = nullptr;
      if (r == CUDA_ERROR_INVALID_HANDLE && d_.StreamGetCtx != nullptr &&
          d_.StreamGetCtx(as_stream(slot.stream), &owner) == CUDA_SUCCESS && owner != nullptr &&
          owner != slot.ctx) {
        {
          ContextGuard g(d_, slot.ctx);
          d_.EventDestroy(slot.event);
        }
        slot.event = nullptr;
        slot.ctx = owner;
        what = "cuEventRecord";
        r = record_in(slot, owner, &what);
      }
    } catch (const DriverError& e) {
      return fail(slot, e.what());
    }
    if (r == CUDA_SUCCESS) {
      slot.unrecorded = false;
      return true;
    }
    if (r == CUDA_ERROR_INVALID_HANDLE && std::strcmp(what, "cuEventRecord") == 0) {
      // The stream is gone (destroyed by its library): no error of the device's.
      slot.unrecorded = false;
      slot.gone = true;
      slot.gone_at = sh_->ctx_syncs_begun.load(std::memory_order_acquire);
      return false;
    }
    if (!is_capture_error(r)) fail(slot, what, r);
    return false;
  }

  CUresult record_in(Slot& slot, CUcontext ctx, const char** what) {
    ContextGuard g(d_, ctx);
    if (slot.event == nullptr) {
      CUresult r = d_.EventCreate(&slot.event, CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {
        slot.event = nullptr;
        *what = "cuEventCreate";
        return r;
      }
    }
    return d_.EventRecord(slot.event, event_stream(slot.stream));
  }

  const Driver& d_;
  std::shared_ptr<CudaShared> sh_;
  // Used only under the owning core's lock (backend.h), so no lock here.
  std::vector<Slot> slots_;
  std::vector<EventId> spare_;
  struct Mapped {
    CUmemGenericAllocationHandle handle;
    size_t size;
  };
  std::unordered_map<uintptr_t, Mapped> handles_;  // mapped address -> its handle
  std::multimap<size_t, CUmemGenericAllocationHandle> spares_;  // detached, kept: size -> handle
  int64_t uncounted_ = 0;  // take_uncounted_calls(); under the core's lock, as every call
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(std::shared_ptr<CudaShared> shared) : sh_(std::move(shared)) {}

  int index() const override { return sh_->index; }
  std::unique_ptr<Backend> make_backend() override { return std::make_unique<CudaBackend>(sh_); }
  CaptureTracker& captures() override { return sh_->captures; }
  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    // Also called outside every pool's lock (out-of-memory messages, cache
    // info): the tracker's drain() waits for it.
    if (!sh_->captures.unless_underway([&] { device_mem_info(driver(), sh_->ctx, free_bytes, total_bytes); }))
      *free_bytes = *total_bytes = 0;
  }
  size_t total_bytes() override {
    // cuDeviceTotalMem touches no stream or memory: legal during a capture.
    const Driver& d = driver();
    size_t total = 0;
    if (d.DeviceTotalMem != nullptr && d.DeviceTotalMem(&total, sh_->dev) == CUDA_SUCCESS) return total;
    size_t free_bytes = 0;
    mem_info(&free_bytes, &total);
    return total;
  }
  int dlpack_device_type() const override { return 2; }  // kDLCUDA
  std::string vmm_unavailable() const override { return sh_->vmm_page != 0 ? "" : sh_->vmm_why; }
  bool has_error() const override { return sh_->has_error.load(std::memory_order_acquire); }
  std::string take_error() override {
    if (!sh_->has_error.load(std::memory_order_acquire)) return {};  // every allocation asks
    std::lock_guard<std::mutex> g(sh_->error_mu);
    std::string e;
    e.swap(sh_->error);
    sh_->has_error.store(false, std::memory_order_release);
    return e;
  }

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
  return std::make_unique<CudaDevice>(open_shared(driver(), index));
}

CudaDeviceInfo describe_cuda_device(int index) {
  const Driver& d = driver();
  CudaDeviceInfo info;
  info.index = index;
  std::shared_ptr<CudaShared> sh = open_shared(d, index);
  char name[256] = {0};
  if (d.DeviceGetName != nullptr && d.DeviceGetName(name, sizeof(name) - 1, sh->dev) == CUDA_SUCCESS)
    info.name = name;
  sh->captures.unless_underway([&] { device_mem_info(d, sh->ctx, &info.free_bytes, &info.total_bytes); });
  if (info.total_bytes == 0 && d.DeviceTotalMem != nullptr) d.DeviceTotalMem(&info.total_bytes, sh->dev);
  info.vmm_page = sh->vmm_page;
  info.vmm_why = sh->vmm_why;
  info.peers = sh->peers;
  info.peers_why = sh->peers_refused.load() ? sh->peers_why : "";
  return info;
}

}  // namespace pyalloc
