// pyalloc's pools on CUDA devices, as PyTorch's hooks (torch_hooks.cpp) and
// the Python API (py_cuda.cpp) reach them.
//
// Each device has two pools, created together on first use:
// - the general pool, which serves PyTorch's allocations;
// - the buffer pool, which serves pyalloc.reserve_buffer(): long-lived
//   buffers (KV caches, workspaces) that would otherwise split the general
//   pool's free ranges. Its memory never mixes with the general pool's.
//
// CUDA graphs. A block allocated while its stream is being captured may be
// used by every replay of the graph, and PyTorch tells a pluggable
// allocator neither when a capture ends nor when its graph dies. So such a
// block is held: when PyTorch frees it, it stays allocated in the general
// pool, to be reused only by a later allocation of the same rounded size in
// the same capture sequence (which the graph orders after the earlier use),
// until release_graph_memory() says the graphs are gone. Blocks named in
// record_stream() are never reused that way.
//
// Registry: the pools of a device are created lazily under a mutex and
// never destroyed (PyTorch frees tensors until the very end of the process);
// lookups take no lock. The configuration is fixed at the first creation:
// what configure() set, else PYALLOC_CONF, else the defaults.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"
#include "cuda_backend.h"

namespace pyalloc {

class DevicePools {
 public:
  DevicePools(std::unique_ptr<Device> device, const Config& config);

  int index() const { return device_->index(); }
  Device& device() { return *device_; }
  Allocator& general() { return *general_; }
  Allocator& buffers() { return *buffers_; }

  /// A general-pool block for PyTorch. Throws OutOfMemoryError whose
  /// message begins "CUDA out of memory." and gives the numbers.
  uintptr_t malloc(size_t size, Stream stream);
  /// False if ptr is no live allocation of this device's general pool;
  /// *why then says what it is.
  bool free(uintptr_t ptr, std::string* why);
  /// False if ptr is no live allocation of either pool of this device.
  bool record_stream(uintptr_t ptr, Stream stream);
  /// The segment of either pool holding ptr.
  bool segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const;

  /// A buffer-pool block (same errors as malloc).
  uintptr_t malloc_buffer(size_t size, Stream stream);
  void free_buffer(uintptr_t ptr);

  /// Returns the cached segments of both pools to the driver, keeping
  /// pool_size reserved; the bytes released, net. Does nothing while a
  /// capture is underway (releasing memory then would break it).
  size_t empty_cache();
  /// Caps the general pool at fraction * the device's total memory (and at
  /// max_pool_size if that is lower).
  void set_memory_fraction(double fraction);

  /// Blocks and bytes held for CUDA graphs, freed by PyTorch or not.
  std::pair<size_t, size_t> graph_memory() const;
  /// Frees every held graph block that PyTorch has freed, and stops holding
  /// the rest; the bytes returned to the pool. The caller must know that no
  /// graph captured so far will be replayed again, and that none is running.
  size_t release_graph_memory();

 private:
  struct GraphBlock {
    uint64_t capture;  // 0: not to be reused
    Stream stream;     // reuse stays on the stream, which the graph orders
    size_t size;       // the rounded request
  };
  using GraphKey = std::tuple<uint64_t, Stream, size_t>;  // (capture, stream, size)

  uintptr_t capture_malloc(size_t size, Stream stream, uint64_t capture);
  bool capture_free(uintptr_t ptr);
  void capture_record_stream(uintptr_t ptr);
  [[noreturn]] void throw_oom(Allocator& pool, const char* which, size_t size,
                              const std::string& why, bool capturing);

  std::unique_ptr<Device> device_;
  Config config_;
  std::unique_ptr<Allocator> general_;
  std::unique_ptr<Allocator> buffers_;

  mutable std::mutex graph_mu_;
  std::atomic<bool> graph_any_{false};
  std::unordered_map<uintptr_t, GraphBlock> graph_live_;
  std::multimap<GraphKey, uintptr_t> graph_idle_;  // freed by PyTorch, still held
  size_t graph_bytes_ = 0;
};

class PoolRegistry {
 public:
  static constexpr int kMaxDevices = 64;

  /// The process's one registry (never destroyed).
  static PoolRegistry& instance();

  /// Sets the configuration ("key:value,..."). Throws std::invalid_argument
  /// for a bad one, std::runtime_error if pools already use a different one.
  void configure(const std::string& text);
  Config config();

  /// The device's pools, created on first use; throws for a bad index or a
  /// missing driver (drv::DriverError), or OutOfMemoryError for pool_size.
  DevicePools& get(int device);
  /// The device's pools if they exist (no lock).
  DevicePools* find(int device) const;
  std::vector<DevicePools*> all() const;

  /// Remembered for pools created later, applied to both pools of each device.
  void record_history(bool enabled, size_t max_entries);

  /// The device count PyTorch's init hook passed (-1 before it ran).
  void set_device_count(int n) { device_count_ = n; }
  int device_count() const { return device_count_; }

  void set_installed(bool installed) { installed_ = installed; }
  bool installed() const { return installed_; }

  /// Tests: later pools live on fake devices of `capacity` bytes each
  /// (cuda_backend.h). Refused once a CUDA pool exists.
  void use_fake_devices(size_t capacity);
  /// Tests: drops every fake pool and returns to the unconfigured state.
  void reset_fake();
  bool fake() const { return fake_; }

 private:
  PoolRegistry();
  Config config_locked();

  mutable std::mutex mu_;
  std::array<std::atomic<DevicePools*>, kMaxDevices> pools_{};
  bool configured_ = false;
  Config config_;
  bool history_ = false;
  size_t history_max_ = 0;
  std::atomic<bool> installed_{false};
  std::atomic<int> device_count_{-1};
  bool fake_ = false;
  size_t fake_capacity_ = 0;
};

/// The hooks' logic, which torch_hooks.cpp exports with C linkage.
namespace hooks {
uintptr_t malloc(size_t size, int device, Stream stream);
void free(uintptr_t ptr, int device) noexcept;
void record_stream(uintptr_t ptr, Stream stream);
uintptr_t base_alloc(uintptr_t ptr, size_t* size) noexcept;
void empty_cache();
void set_memory_fraction(double fraction, int device);
void init(int device_count) noexcept;
}  // namespace hooks

/// The file of the library holding the hooks (torch_hooks.cpp): what
/// torch.cuda.memory.CUDAPluggableAllocator is given to load.
std::string library_path();

}  // namespace pyalloc
