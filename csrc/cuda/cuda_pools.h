// pyalloc's pools on CUDA devices, as PyTorch's hooks (torch_hooks.cpp) and
// the Python API (py_cuda.cpp) reach them.
//
// Each device has two pools, created together on first use:
// - the general pool, which serves PyTorch's allocations;
// - the buffer pool, which serves pyalloc.reserve_buffer(): long-lived
//   buffers (KV caches, workspaces) that would otherwise split the general
//   pool's free ranges. Its memory never mixes with the general pool's.
//
// Graph pools (PyTorch's private pools, MempoolId_t). PyTorch says when a
// CUDA graph capture (or a torch.cuda.MemPool context) begins and ends, and
// when a graph or MemPool is gone: begin_allocate_to_pool(id, filter) routes
// every allocation on a stream the filter accepts to the pool `id` until
// end_allocate_to_pool(id). Each pool is a core Allocator of its own over the
// device, with plain segments (no page remapping) and a backend that tells
// the core a capture is underway for as long as the pool has a use: so
// nothing of it is released or reused by the general pool while a graph
// captured into it may still be replayed. Graphs given the same pool id
// share it, and a block freed into it serves later allocations routed to
// it, as in PyTorch's allocator. Each begin_allocate_to_pool() and
// create_or_incref_pool() is a use, each release_pool() drops one; once no
// use is left and nothing in the pool is live, its segments go back to the
// driver, where the general pool finds them. When the last use goes
// (release_pool, end_allocate_to_pool) with nothing live, at once. When the
// last live block goes, at the next empty_cache() or out-of-memory retry:
// a free runs inside a tensor's deleter, where waiting for the device
// (cuEventSynchronize) and cuMemFree have no place (PyTorch's CUDA-graph
// trees release a pool on every warm-up iteration). And while a capture is
// underway, never: at the first empty_cache() or out-of-memory retry after it.
//
// The capture window: PyTorch routes a graph's pool before it begins the
// capture, and ends the route after the capture ends. Each open route counts
// as a capture underway (capture.h), on every device: from the route's
// opening on, no pool queries events, releases or unmaps memory, or
// reclaims graph pools. torch 2.13 also marks the capture itself
// (mark_capture(), through the bridge), which counts the same way. Each pool
// decides under its own lock whether it may touch the device, so the route's
// opening (and a mark's) returns only once every pool of every device has
// finished the operation it was in (quiesce()): another thread's release or
// event query begun before the declaration cannot run into the capture. The
// same wait covers the calls made outside the pools' locks (cuMemGetInfo for
// an out-of-memory message or the cache info: CaptureTracker::
// unless_underway) and a device's pools being made (their trial mapping).
//
// A route that never ends: torch 2.x's CUDAGraph::capture_end checks
// cudaStreamEndCapture's result before it calls end_allocate_to_pool, so a
// capture that fails (an invalidated capture) leaves its route open, and
// with it a capture counted as underway on every device for the rest of the
// process. Such a route heals: the streams it served while they were
// capturing are remembered (with the capture's id), and once every one of
// them has been found done (cuStreamGetCaptureInfo, legal during any
// capture) for kRouteHealGrace while the route is still open, it stops
// counting as a capture underway and pyalloc says so on stderr (once a
// device); the grace leaves a capture that has just ended the moment
// PyTorch needs to end its route. A route that served no capturing stream
// cannot be seen to end: it goes when the pool's last use is released
// (release_pool()), which ends every route still open to it. Limit: a route seen only on a stream forked
// from the capture and joined back before the capture ends may heal while
// the capture goes on, after the grace.
//
// Without those calls (a torch whose pluggable allocator lacks the setters),
// every allocation asks the device whether its stream is capturing, and a
// block allocated during a capture is held: when PyTorch frees it, it stays
// allocated in the general pool, to be reused only by a later allocation of
// the same rounded size in the same capture sequence (which the graph
// orders after the earlier use), until release_graph_memory() says the
// graphs are gone. Blocks named in record_stream() are never reused that
// way. The first begin_allocate_to_pool() or create_or_incref_pool() on a
// device stops those queries for good.
//
// Growing during a capture: a backend that can (the CUDA backend puts the
// calling thread in relaxed capture mode around cuMemAlloc and the page
// mapping calls, as PyTorch's allocator does) serves a capture with fresh
// memory; nothing is ever released or unmapped during a capture.
//
// Statistics: the pools of a device count together, as PyTorch's one
// DeviceStats per device counts its private pools with the rest: each pool
// pushes its changes to the device's StatsSink at the end of every
// operation, so torch.cuda.memory_stats() reads one set of counts whose
// peaks are the device's own. Each graph pool's reserved bytes are also
// reported apart (PyTorch's reserved_bytes_by_private_pools).
//
// The memory fraction (set_memory_fraction) caps what all the pools of a
// device reserve together, graph pools and the buffer pool included, as
// PyTorch's cap covers its private pools: every pool's backend draws on one
// budget per device, and a pool refused by it first has the other pools'
// cached memory given back, as on the out-of-memory path.
//
// Frees: a free of a general-pool block takes that pool's lock alone; one of
// a graph-pool block takes the graph pools' registry lock shared, and its
// pool's own locks, so it waits for no allocation or free elsewhere, only
// while a graph pool is added, released, restored or reclaimed. A free that
// names no device asks only the devices whose address range holds the
// pointer (read without a lock).
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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"
#include "cuda_backend.h"
#include "pool_backend.h"

namespace pyalloc {

class DevicePools {
 public:
  using PoolId = pyalloc::PoolId;
  using SegmentSource = pyalloc::SegmentSource;
  /// True: this stream's allocations go to the pool.
  using StreamFilter = std::function<bool(Stream)>;

  DevicePools(std::unique_ptr<Device> device, const Config& config);
  ~DevicePools();

  int index() const { return device_->index(); }
  Device& device() { return *device_; }
  Allocator& general() { return *general_; }
  Allocator& buffers() { return *buffers_; }

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
  bool record_stream(uintptr_t ptr, Stream stream);
  /// The segment of any pool of this device holding ptr.
  bool segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// Allocator::share() of the pool whose live allocation is at ptr: false,
  /// with *why, if none has one there (out stays empty) or its backend
  /// refuses (CUDA IPC, ipc.h).
  bool share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why);
  /// False if no pool of this device has ever held memory at ptr: read
  /// without a lock, to find a pointer's device (true is only a maybe).
  bool may_hold(uintptr_t ptr) const { return budget_.may_hold(ptr); }

  /// From now on, allocations on streams the filter accepts come from pool
  /// `id` (created if new); a use of the pool. A pool may have several
  /// routes at once. The filter is called with no lock of PyTorch's held, and
  /// must not allocate.
  void begin_allocate_to_pool(PoolId id, StreamFilter filter);
  /// Stops the first route to pool `id` still counting as a capture (as
  /// PyTorch's allocator stops the first), and with it the healed routes to
  /// the pool begun before it (never one whose filter the bridge has dropped,
  /// bridge_api.h); the pool and its blocks stay. Once no capture is underway,
  /// pages parked during it go back, on every device (release_parked()).
  void end_allocate_to_pool(PoolId id);
  /// torch 2.13's markCaptureBegin (begin) / markCaptureEnd: a capture on
  /// this device counts as underway in between (capture.h). An end without
  /// a begin is ignored.
  void mark_capture(bool begin);
  /// A graph or MemPool using pool `id` is gone: one use less. Once no use
  /// is left, routes still open to it end (their graph is gone), and once
  /// nothing in it is live either, its memory returns to the device.
  void release_pool(PoolId id);
  /// Ends counting as a capture underway each route whose capturing streams
  /// have all been done for kRouteHealGrace (see "A route that never ends").
  /// Cheap (one atomic load) while no open route has served a capture.
  void heal_routes();
  /// How long a route's capture must have been seen over before it heals.
  static constexpr double kRouteHealGrace = 0.5;  // seconds
  /// A MemPool: creates pool `id` with one use (its segments from `source`,
  /// if given), or adds a use.
  void create_or_incref_pool(PoolId id, SegmentSource source = {});
  /// for_each_pool(), with the units each pool's backend has mapped and told
  /// the segment watchers of (segment_watch.h), by address.
  void for_each_pool_units(
      const std::function<void(PoolId, Allocator&, const std::vector<std::pair<uintptr_t, size_t>>&)>& fn);
  /// The uses of pool `id` (0 if there is no such pool).
  int pool_use_count(PoolId id) const;
  /// The live allocations of pool `id` (PyTorch's checkPoolLiveAllocations).
  std::vector<uintptr_t> pool_live_blocks(PoolId id) const;
  struct LiveBlock {
    uintptr_t ptr;
    size_t size;  // as requested
    Stream stream;
  };
  /// The live allocations of pool `id` with their sizes and streams: a
  /// checkpoint of it (PyTorch's getCheckpointState, for CUDA-graph trees).
  std::vector<LiveBlock> pool_checkpoint(PoolId id) const;
  /// Makes exactly `blocks` the live allocations of pool `id`: frees the
  /// others and allocates the missing ones at their addresses (PyTorch's
  /// setCheckpointPoolState). As PyTorch's allocator reports it, *freed lists
  /// every block live before and *allocated every block of `blocks`: one live
  /// both before and after is in both. Throws std::invalid_argument if the
  /// pool is gone, a block's memory is no longer free, or it lies in a block
  /// the checkpoint drops that a stream named by record_stream may still use
  /// (its free would wait on that stream); every live block is then as it
  /// was (bytes, request, stream, tag, recorded streams), though free memory
  /// may lie in other pieces.
  void restore_pool(PoolId id, const std::vector<LiveBlock>& blocks,
                    std::vector<uintptr_t>* freed, std::vector<uintptr_t>* allocated);
  struct GraphPoolInfo {
    PoolId id;
    int uses;
    int64_t allocated_bytes;
    int64_t reserved_bytes;
  };
  /// The graph pools that exist, read under their lock (a pool may be
  /// released by another thread at any time).
  std::vector<GraphPoolInfo> graph_pools() const;
  /// Allocator::check_invariants() of every pool of the device, and each
  /// graph pool's list of its blocks against its allocator's live ones (read
  /// with no graph-pool operation midway); InvariantError if anything is off.
  void check_invariants() const;

  /// Every pool of the device together (general, buffers, graph pools), as
  /// torch.cuda.memory_stats() counts a device: each peak the peak of the
  /// sum, never a sum of peaks.
  Stats stats() const;
  /// Each graph pool's reserved bytes (PyTorch's reserved_bytes_by_private_pools):
  /// the pools that exist, and those released since the last
  /// reset_peak_stats(), whose current is 0.
  std::vector<std::pair<PoolId, StatArray>> pool_reserved() const;
  /// Every peak of every pool of the device, and of the device, to its
  /// current value; forgets the graph pools already released.
  void reset_peak_stats();
  /// Keeps the last max_entries events of each pool of the device, graph
  /// pools created later included (0: stop and forget).
  void record_history(bool enabled, size_t max_entries);

  /// A buffer-pool block (same errors as malloc).
  uintptr_t malloc_buffer(size_t size, Stream stream);
  void free_buffer(uintptr_t ptr);

  /// Returns the cached segments of the general and buffer pools, and every
  /// graph pool that has no use left, to the driver, keeping pool_size
  /// reserved; the bytes released, net. Does nothing while a capture is
  /// underway (releasing memory then would break it).
  size_t empty_cache();
  /// Returns once no operation of the general or the buffer pool, no
  /// reclaim of a graph pool and no device query outside the pools' locks
  /// (CaptureTracker::drain) is under way: see "The capture window" above.
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
  /// Unless a capture is underway, every pool of the device gives back the
  /// pages it parked during one (Allocator::release_parked).
  void release_parked();
  /// Every allocated / freed sum and counter of the device's pools to 0.
  void reset_accumulated_stats();
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
  struct GraphBlock {
    uint64_t capture;  // 0: not to be reused
    Stream stream;     // reuse stays on the stream, which the graph orders
    size_t size;       // the rounded request
  };
  using GraphKey = std::tuple<uint64_t, Stream, size_t>;  // (capture, stream, size)

  struct GraphPool;

  // A route of begin_allocate_to_pool(). While `declared`, it counts as a
  // capture underway (capture.h): until end_allocate_to_pool(), its pool's
  // last release_pool(), or heal_routes(). Changed under pools_mu_ held
  // exclusively, except `seen` and `ended`, guarded by seen_mu_.
  struct PoolRoute {
    PoolId id;
    StreamFilter filter;
    bool declared = true;
    std::vector<std::pair<Stream, uint64_t>> seen;  // (stream, capture id) it served capturing
    double ended = 0;  // when all of `seen` were first found done (steady seconds), 0: not yet
  };

  std::unique_ptr<Backend> make_backend(bool held, PoolId id);
  uintptr_t routed_malloc(size_t size, Stream stream, uint64_t context, bool* routed);
  bool pool_free(uintptr_t ptr, uint64_t context);
  GraphPool& pool_incref_locked(PoolId id, SegmentSource source = {});
  bool reclaim_locked(GraphPool& pool);
  // After a capture ends (a route's end or release, a mark's end), with no
  // pools lock held: every pool of every device gives back the pages it
  // parked during it, once none is underway (Allocator::release_parked).
  void release_parked_everywhere();
  /// pools_mu_ held (either way): the route's capture has been over for the grace.
  bool route_abandoned_locked(PoolRoute& route);
  /// pools_mu_ held exclusively: the route no longer counts as a capture underway.
  void undeclare_locked(PoolRoute& route, const char* why);
  size_t reclaim_pools();
  /// On the out-of-memory path of `pool`: gives back the cached memory of
  /// the device's other pools and its graph pools without a use; the bytes.
  size_t release_others(const Allocator& pool);
  uintptr_t capture_malloc(size_t size, Stream stream, uint64_t capture, uint64_t context);
  bool capture_free(uintptr_t ptr);
  void capture_record_stream(uintptr_t ptr);

  // The out-of-memory path's device part for one kind of pool (core/oom.h):
  // the other pools' memory given back (general and buffer pools), and the
  // message, in PyTorch's words, with the device's figures.
  class PoolOom final : public OomPolicy {
   public:
    PoolOom(DevicePools& pools, const char* which, bool relieved)
        : pools_(pools), which_(which), relieved_(relieved) {}
    size_t release_elsewhere(Allocator& pool) override;
    std::string describe(Allocator& pool, const OomFailure& failure) override;

   private:
    DevicePools& pools_;
    const char* which_;
    bool relieved_;
  };

  std::unique_ptr<Device> device_;
  Config config_;
  DeviceBudget budget_;     // before the pools that draw on it
  StatsSink device_stats_;  // before the pools that push to it
  PoolOom general_oom_{*this, "general", true};  // before the pools that use them
  PoolOom buffer_oom_{*this, "buffer", true};
  PoolOom graph_oom_{*this, "graph", false};
  int64_t max_split_size_ = 0;
  std::unique_ptr<Allocator> general_;
  std::unique_ptr<Allocator> buffers_;

  mutable std::mutex graph_mu_;
  std::atomic<bool> graph_any_{false};
  std::unordered_map<uintptr_t, GraphBlock> graph_live_;
  std::multimap<GraphKey, uintptr_t> graph_idle_;  // freed by PyTorch, still held
  size_t graph_bytes_ = 0;

  // Graph pools. Lock order: pools_mu_, then a pool's own locks. pools_mu_
  // is taken shared to allocate from, free into or read the pools, and
  // exclusively to add, release, reclaim or restore one.
  mutable std::shared_mutex pools_mu_;
  std::map<PoolId, std::unique_ptr<GraphPool>> pools_;
  std::vector<PoolRoute> routes_;         // in begin order
  std::mutex seen_mu_;                    // guards each route's seen and ended
  std::atomic<int> watched_{0};           // declared routes whose `seen` is not empty
  std::atomic<int> declared_routes_{0};   // routes that still count as a capture underway
  std::atomic<bool> told_unended_{false};  // a route left open was said on stderr
  int marks_ = 0;                         // mark_capture() begins not yet ended
  std::atomic<bool> routing_{false};      // routes_ is not empty
  std::atomic<bool> pools_exist_{false};  // pools_ is not empty
  std::atomic<bool> told_of_captures_{false};  // PyTorch's pool calls are in use
  std::atomic<double> fraction_{1.0};
  std::map<PoolId, StatArray> released_reserved_;  // graph pools gone since the last reset
  bool history_ = false;                           // what record_history() set
  size_t history_max_ = 0;
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
  }
  /// PyTorch will call begin/end_allocate_to_pool around every capture (the
  /// bridge, or hooks where torch has the setters): allocations need not ask
  /// the driver whether their stream is capturing.
  void set_told_of_captures(bool told) { told_of_captures_.store(told, std::memory_order_release); }
  bool told_of_captures() const { return told_of_captures_.load(std::memory_order_acquire); }
  Route route() const { return static_cast<Route>(route_.load()); }
  bool installed() const { return route_.load() != kNotInstalled; }

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
  static constexpr uintptr_t kSeveral = 1;
  std::atomic<DevicePools*> only_{nullptr};  // kSeveral once a second device has pools
  std::atomic<int> route_{kNotInstalled};
  std::atomic<bool> told_of_captures_{false};
  std::atomic<int> device_count_{-1};
  bool fake_ = false;
  size_t fake_capacity_ = 0;
};

/// The hooks' logic, which torch_hooks.cpp exports with C linkage.
namespace hooks {
uintptr_t malloc(size_t size, int device, Stream stream, uint64_t context = 0);
/// Frees ptr in whichever device's pools hold it (device is a hint; -1 for
/// none); false, with *why, if none does.
bool free_checked(uintptr_t ptr, int device, uint64_t context, std::string* why);
/// free_checked, with any error said on stderr (PyTorch's deleters must not throw).
void free(uintptr_t ptr, int device) noexcept;
void record_stream(uintptr_t ptr, Stream stream);
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
