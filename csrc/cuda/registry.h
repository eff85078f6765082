// The process's pools (PoolRegistry: one DevicePools per device, made on
// first use, never destroyed, since PyTorch frees tensors until the very end
// of the process) and the logic behind PyTorch's hooks, which
// torch_hooks.cpp exports with C linkage and the bridge reaches through
// bridge_api.cpp. Lookups take no lock. The configuration is fixed at the
// first device's pools: what configure() set, else PYALLOC_CONF, else the
// defaults.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_pools.h"

namespace pyalloc {

class PoolRegistry final : public ProcessPools {
 public:
  static constexpr int kMaxDevices = 64;

  /// The process's one registry (never destroyed: PyTorch frees tensors
  /// during interpreter shutdown). Inline, as find() and get()'s common
  /// case: every allocation and free of PyTorch's asks it.
  static PoolRegistry& instance() {
    static PoolRegistry* r = new PoolRegistry();
    return *r;
  }

  /// Sets the configuration ("key:value,..."). Throws std::invalid_argument
  /// for a bad one, std::runtime_error if pools already use a different one.
  void configure(const std::string& text);
  Config config();

  /// The device's pools, created on first use; throws for a bad index or a
  /// missing driver (drv::DriverError), or OutOfMemoryError for pool_size.
  DevicePools& get(int device) {
    DevicePools* p = find(device);
    return p != nullptr ? *p : make(device);
  }
  /// The device's pools if they exist (no lock).
  DevicePools* find(int device) const {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return pools_[device].load(std::memory_order_acquire);
  }
  std::vector<DevicePools*> all() const override;
  /// Returns once no device's pools are being made (get()): a device's
  /// first pools try a mapping, and all() lists them only once made.
  void wait_for_pools_being_made();
  /// The pools of the one device that has them, or null if none or several do.
  DevicePools* only() const {
    DevicePools* p = only_.load(std::memory_order_acquire);
    return p == reinterpret_cast<DevicePools*>(kSeveral) ? nullptr : p;
  }

  /// Remembered for pools created later, applied to both pools of each device.
  void record_history(bool enabled, size_t max_entries);

  /// The device count PyTorch's init hook passed (-1 before it ran).
  void set_device_count(int n) { device_count_ = n; }
  int device_count() const { return device_count_; }

  /// How PyTorch reaches the pools: not at all, through the C hooks of its
  /// CUDAPluggableAllocator, or through the bridge (csrc/torch_bridge/).
  enum Route : int { kNotInstalled = 0, kHooks = 1, kBridge = 2 };
  void set_route(Route route) {
    route_ = route;
    if (route == kBridge) set_told_of_captures(true);  // the bridge always passes them on
    else set_captures_marked(false);                   // only the bridge passes marks on
  }
  /// PyTorch will call begin/end_allocate_to_pool around every capture (the
  /// bridge, or hooks where torch has the setters): allocations need not ask
  /// the driver whether their stream is capturing.
  void set_told_of_captures(bool told) { told_of_captures_.store(told, std::memory_order_release); }
  bool told_of_captures() const override { return told_of_captures_.load(std::memory_order_acquire); }
  /// The bridge, built against torch 2.13 or later, passes on PyTorch's
  /// markCaptureBegin/End: from then on a pool route alone is no capture.
  void set_captures_marked(bool marked) { captures_marked_.store(marked, std::memory_order_release); }
  bool captures_marked() const override { return captures_marked_.load(std::memory_order_acquire); }
  Route route() const { return static_cast<Route>(route_.load()); }
  bool installed() const { return route_.load() != kNotInstalled; }

  /// Tests: later pools live on fake devices of `capacity` bytes each
  /// (cuda_backend.h). Refused once a CUDA pool exists.
  void use_fake_devices(size_t capacity);
  /// Tests: drops every fake pool and every out-of-memory observer, and
  /// returns to the unconfigured state.
  void reset_fake();
  bool fake() const { return fake_; }

 private:
  PoolRegistry();
  Config config_locked();
  void drop_fake_pools();
  /// get() of a device without pools yet: makes them, under mu_.
  DevicePools& make(int device);

  mutable std::mutex mu_;
  std::array<std::atomic<DevicePools*>, kMaxDevices> pools_{};
  bool configured_ = false;
  Config config_;
  bool history_ = false;
  size_t history_max_ = 0;
  static constexpr uintptr_t kSeveral = 1;
  std::atomic<DevicePools*> only_{nullptr};  // kSeveral once a second device has pools
  std::atomic<int> route_{kNotInstalled};
  std::atomic<bool> told_of_captures_{false};
  std::atomic<bool> captures_marked_{false};
  std::atomic<int> device_count_{-1};
  bool fake_ = false;
  size_t fake_capacity_ = 0;
};

/// The hooks' logic, which torch_hooks.cpp exports with C linkage.
namespace hooks {
/// A block for PyTorch (DevicePools::malloc of the device, its pools made on
/// first use); an out-of-memory error is told to the observers
/// (oom_observers.h) once no lock of the pools is held, and thrown as a
/// DeviceOutOfMemoryError carrying what they were told.
uintptr_t malloc(size_t size, int device, Stream stream, uint64_t context = 0);
/// The same for a block of the device's buffer pool (pyalloc.reserve_buffer).
uintptr_t malloc_buffer(size_t size, int device, Stream stream);
/// Frees ptr in whichever device's pools hold it (device is a hint; -1 for
/// none); false, with *why, if none does.
bool free_checked(uintptr_t ptr, int device, uint64_t context, std::string* why);
/// free_checked, with any error said on stderr (PyTorch's deleters must not throw).
void free(uintptr_t ptr, int device) noexcept;
void record_stream(uintptr_t ptr, Stream stream);
/// PyTorch's getBaseAllocation: Allocator::base_allocation() of the pool
/// holding ptr; else ptr, *size untouched (PyTorch's answer with no hook set).
uintptr_t base_alloc(uintptr_t ptr, size_t* size) noexcept;
void empty_cache();
void set_memory_fraction(double fraction, int device);
void init(int device_count) noexcept;
/// PyTorch's graph-pool calls (CUDAGraph::capture_begin / capture_end /
/// reset, torch.cuda.MemPool); end and release run in destructors and
/// report errors on stderr instead of throwing.
void begin_allocate_to_pool(int device, DevicePools::PoolId id, DevicePools::StreamFilter filter);
void end_allocate_to_pool(int device, DevicePools::PoolId id) noexcept;
void release_pool(int device, DevicePools::PoolId id) noexcept;
/// torch 2.13's markCaptureBegin / markCaptureEnd (DevicePools::mark_capture).
void mark_capture(int device, bool begin);
}  // namespace hooks

/// The file of the library holding the hooks (torch_hooks.cpp): what
/// torch.cuda.memory.CUDAPluggableAllocator is given to load.
std::string library_path();

}  // namespace pyalloc
