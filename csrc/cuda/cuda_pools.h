// The pools of one CUDA device (DevicePools), as PyTorch's hooks and the
// Python API (py_cuda.cpp) reach them:
// - the general pool, which serves PyTorch's allocations;
// - the buffer pool, which serves pyalloc.reserve_buffer(): long-lived
//   buffers (KV caches, workspaces) that would otherwise split the general
//   pool's free ranges. Its memory never mixes with the general pool's;
// - the graph pools (graph_pools.h): PyTorch's private pools, which CUDA
//   graph captures and torch.cuda.MemPool allocate from.
// They are made together, on the device's first use, and draw on one budget
// (pool_backend.h), count as one device (stats()), and share one
// out-of-memory path (core/oom.h): a pool that runs out has the others'
// cached memory given back before its error is raised, and the general pool
// then takes a free block of a MemPool made with use_on_oom=True.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "cuda_backend.h"
#include "graph_pools.h"
#include "oom_observers.h"
#include "pool_backend.h"

namespace pyalloc {

class DevicePools;

/// Frees memory held outside pyalloc's pools whose frees come back into them:
/// PyTorch's free-memory callbacks (FreeCudaMemoryCallbacksRegistry; torch's
/// "cuda_ipc_collect" frees the blocks sent to other processes that every
/// receiver has let go), which the bridge sets. Nonzero when it freed some.
using FreeMemoryHook = int (*)(void* user);

/// Sets the process's one hook (nullptr: none). A call under way on another
/// thread may still finish after it returns.
void set_free_memory_hook(FreeMemoryHook fn, void* user);

/// Runs the hook, if one is set, with no pools lock held: true when it
/// freed memory. Not again on a thread already inside it (its frees never
/// allocate, but a hook that did could run out of memory in turn).
bool run_free_memory_hook();

/// What the pools of one device ask of the process's other devices. The
/// registry, which owns every device's pools (registry.h), answers: the
/// pools never reach up to it.
class ProcessPools {
 public:
  /// PyTorch announces every capture of the process (the bridge, or hooks
  /// where torch has the setters): allocations need not ask the driver
  /// whether their stream is capturing.
  virtual bool told_of_captures() const = 0;
  /// PyTorch marks each capture (torch 2.13's markCaptureBegin/End, through
  /// the bridge): a pool route counts as a capture only until its capture's
  /// mark or an allocation on a stream not capturing (GraphPools::begin_route).
  virtual bool captures_marked() const = 0;
  /// Every device's pools made so far.
  virtual std::vector<DevicePools*> all() const = 0;

 protected:
  ~ProcessPools() = default;
};

class DevicePools {
 public:
  using PoolId = pyalloc::PoolId;
  using SegmentSource = pyalloc::SegmentSource;
  using StreamFilter = GraphPools::StreamFilter;

  /// `process` must outlive the pools.
  DevicePools(std::unique_ptr<Device> device, const Config& config, ProcessPools& process);

  int index() const { return index_; }
  Device& device() { return *device_; }
  Allocator& general() { return *general_; }
  Allocator& buffers() { return *buffers_; }
  /// The device's graph pools, for their checkpoints and what they hold.
  GraphPools& graphs() { return graphs_; }

  /// The pool id the buffer pool reports in snapshots (PyTorch's default
  /// pool is {0, 0}; its private pools count up from {1, 0} and {0, 1}).
  static constexpr PoolId kBufferPoolId{1, 1};

  /// A block for PyTorch: from the graph pool the stream is routed to, else
  /// from the general pool. Throws OutOfMemoryError whose message begins
  /// "CUDA out of memory." and gives the numbers; a failure the retry after
  /// giving back other pools' memory mends is no OOM, and the one raised is
  /// counted and traced once. `context`: the history's tag for it (Allocator::malloc).
  uintptr_t malloc(size_t size, Stream stream, uint64_t context = 0);
  /// False if ptr is no live allocation of this device's general pool or
  /// graph pools; *why then says what it is.
  bool free(uintptr_t ptr, std::string* why, uint64_t context = 0);
  /// False if ptr is no live allocation of any pool of this device.
  /// `device`: the stream's (streams.h), when it may be another than this
  /// one (-1: this one): a default stream's handle names each device's own.
  bool record_stream(uintptr_t ptr, Stream stream, int device = -1);
  /// The segment of any pool of this device holding ptr.
  bool segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// Allocator::base_allocation() of the pool of this device holding ptr.
  bool base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// Allocator::share() of the pool whose live allocation is at ptr: false,
  /// with *why, if none has one there (out stays empty) or its backend
  /// refuses (CUDA IPC, ipc.h).
  bool share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why);
  /// False if no pool of this device has ever held memory at ptr: read
  /// without a lock, to find a pointer's device (true is only a maybe).
  bool may_hold(uintptr_t ptr) const { return budget_.may_hold(ptr); }

  /// A block of the buffer pool (same errors as malloc).
  uintptr_t malloc_buffer(size_t size, Stream stream);
  void free_buffer(uintptr_t ptr);

  /// PyTorch's graph-pool calls (GraphPools): from now on, allocations on
  /// streams the filter accepts come from pool `id`, until the route ends.
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  /// Ends a route to pool `id` (GraphPools::end_route). Once no capture is
  /// underway, the pages parked during it go back, on every device.
  void end_allocate_to_pool(PoolId id);
  /// torch 2.13's markCaptureBegin (begin) / markCaptureEnd (GraphPools::mark_capture).
  void mark_capture(bool begin);
  /// A graph or MemPool using pool `id` is gone: one use less (GraphPools::release).
  void release_pool(PoolId id);
  /// A MemPool: creates pool `id` with one use (its segments from `source`,
  /// if given), or adds a use.
  void create_or_incref_pool(PoolId id, SegmentSource source = {});
  /// GraphPools::heal_routes().
  void heal_routes() { graphs_.heal_routes(); }

  /// Allocator::check_invariants() of every pool of the device, the graph
  /// pools' lists of their blocks included; InvariantError if anything is off.
  void check_invariants() const;

  /// Every pool of the device together (general, buffers, graph pools), as
  /// torch.cuda.memory_stats() counts a device: each peak the peak of the
  /// sum, never a sum of peaks.
  Stats stats() const;
  /// Each graph pool's reserved bytes (GraphPools::reserved()).
  std::vector<std::pair<PoolId, StatArray>> pool_reserved() const { return graphs_.reserved(); }
  /// Every peak of every pool of the device, and of the device, to its
  /// current value; forgets the graph pools already released.
  void reset_peak_stats();
  /// Keeps the last max_entries events of each pool of the device, graph
  /// pools created later included (0: stop and forget).
  void record_history(bool enabled, size_t max_entries);

  /// Returns the cached segments of the general and buffer pools, and every
  /// graph pool that has no use left, to the driver, keeping pool_size
  /// reserved; the bytes released, net. Does nothing while a capture is
  /// underway (releasing memory then would break it).
  size_t empty_cache();
  /// Returns once no operation of any pool of the device and no device
  /// query outside the pools' locks (CaptureTracker::drain) is under way.
  void quiesce() const;
  /// Caps what all the pools of the device reserve together at fraction *
  /// the device's total memory (the general pool also at max_pool_size if
  /// that is lower). Releases nothing: a pool already past the cap only
  /// stops growing.
  void set_memory_fraction(double fraction);
  /// The fraction last set (1 before any).
  double memory_fraction() const { return fraction_.load(std::memory_order_relaxed); }
  /// Bytes all the pools of the device hold from the driver (reserved
  /// segments and mapped pages), and the cap on them (0: none).
  size_t device_reserved() const { return budget_.reserved.load(std::memory_order_acquire); }
  size_t device_cap() const { return budget_.cap.load(std::memory_order_acquire); }

  /// Calls fn(id, pool) for the general pool ({0, 0}), the buffer pool
  /// (kBufferPoolId) and every graph pool (its id), graph pools' lock held:
  /// fn may use the pool but must not call back into DevicePools.
  void for_each_pool(const std::function<void(PoolId, Allocator&)>& fn);
  /// for_each_pool(), with the units each pool's backend has mapped
  /// (segment_watch.h).
  void for_each_pool_units(const std::function<void(PoolId, Allocator&, const MappedUnits&)>& fn);
  /// A CUDA graph capture is underway, as far as the device knows: a route
  /// or mark PyTorch declared, or a stream seen capturing (capture.h). CUDA
  /// devices share the process's tracker: then anywhere in the process.
  bool capture_underway() const { return graphs_.capture_declared() || device_->captures().underway(); }
  /// Calls `call` (driver calls CUDA's default capture mode forbids, made
  /// with no pools lock held) unless a capture is underway; false if it did
  /// not. A capture declared later waits for it (CaptureTracker::unless_underway).
  bool unless_capture_underway(const std::function<void()>& call) const {
    return !graphs_.capture_declared() && device_->captures().unless_underway(call);
  }
  /// Unless a capture is underway, every pool of the device gives back the
  /// pages it parked during one (Allocator::release_parked).
  void release_parked();
  /// Every allocated / freed sum and counter of the device's pools to 0.
  void reset_accumulated_stats();
  /// The figures of an out-of-memory error of `request` bytes, read now:
  /// what its observers and PyTorch's hear (oom_observers.h).
  OomReport oom_report(size_t request, bool rejected) const;
  /// The largest free block of any pool of the device (bytes).
  size_t largest_free_block();
  /// The largest request the device could serve without releasing anything:
  /// its largest free block, or the device's free memory within the general
  /// pool's cap if that is larger (PyTorch's cacheInfo, used by cuDNN).
  size_t cache_info();

  /// Blocks and bytes held for CUDA graphs in the general pool (without
  /// PyTorch's pool calls), freed by PyTorch or not.
  std::pair<size_t, size_t> graph_memory() const;
  /// Frees every held graph block that PyTorch has freed, and stops holding
  /// the rest; the bytes returned to the pool. The caller must know that no
  /// graph captured so far will be replayed again, and that none is running.
  size_t release_graph_memory();

 private:
  // The out-of-memory path's device part for one kind of pool (core/oom.h):
  // the other pools' memory given back (general and buffer pools), and the
  // message, in PyTorch's words, with the device's figures.
  class PoolOom final : public OomPolicy {
   public:
    PoolOom(DevicePools& pools, const char* which, bool relieved)
        : pools_(pools), which_(which), relieved_(relieved) {}
    size_t release_elsewhere(Allocator& pool) override;
    uintptr_t serve_elsewhere(Allocator& pool, const OomFailure& failure, uint64_t context) override;
    std::string describe(Allocator& pool, const OomFailure& failure) override;

   private:
    DevicePools& pools_;
    const char* which_;
    bool relieved_;
  };

  struct GraphBlock {
    uint64_t capture;  // 0: not to be reused
    Stream stream;     // reuse stays on the stream, which the graph orders
    size_t size;       // the rounded request
  };
  using GraphKey = std::tuple<uint64_t, Stream, size_t>;  // (capture, stream, size)

  std::unique_ptr<Backend> make_backend(PoolId id);
  // malloc() and free() beyond their common case, out of line so that it
  // stays short: a route or a capture to look at; a block of no general pool.
  [[gnu::noinline]] uintptr_t malloc_routed(size_t size, Stream stream, uint64_t context);
  [[gnu::noinline]] bool free_other(uintptr_t ptr, std::string* why, uint64_t context);
  /// On the out-of-memory path of `pool`: gives back the cached memory of
  /// the device's other pools and its graph pools without a use; the bytes.
  size_t release_others(const Allocator& pool);
  // After a capture ends (a route's end or release, a mark's end), with no
  // pools lock held: every pool of every device gives back the pages it
  // parked during it, once none is underway (Allocator::release_parked).
  void release_parked_everywhere();
  uintptr_t capture_malloc(size_t size, Stream stream, uint64_t capture, uint64_t context);
  // Inline: every free asks, and none has been held but during a capture
  // without PyTorch's pool calls.
  bool capture_free(uintptr_t ptr) { return graph_any_.load(std::memory_order_acquire) && capture_free_held(ptr); }
  bool capture_free_held(uintptr_t ptr);
  void capture_record_stream(uintptr_t ptr);

  std::unique_ptr<Device> device_;
  int index_;  // device_->index(), which every free passes on
  Config config_;
  ProcessPools& process_;
  DeviceBudget budget_;     // before the pools that draw on it
  StatsSink device_stats_;  // before the pools that push to it
  PoolOom general_oom_{*this, "general", true};  // before the pools that use them
  PoolOom buffer_oom_{*this, "buffer", true};
  PoolOom graph_oom_{*this, "graph", false};
  int64_t max_split_size_ = 0;
  std::unique_ptr<Allocator> general_;
  std::unique_ptr<Allocator> buffers_;
  GraphPools graphs_;
  std::atomic<double> fraction_{1.0};

  // Blocks held for CUDA graphs without PyTorch's pool calls (capture_malloc()).
  mutable std::mutex graph_mu_;
  std::atomic<bool> graph_any_{false};
  std::unordered_map<uintptr_t, GraphBlock> graph_live_;
  std::multimap<GraphKey, uintptr_t> graph_idle_;  // freed by PyTorch, still held
  size_t graph_bytes_ = 0;
};

}  // namespace pyalloc
