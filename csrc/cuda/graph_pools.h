// The graph pools of one device: PyTorch's private pools (MempoolId_t), which
// CUDA graphs and torch.cuda.MemPool allocate from, with the routes that send
// allocations to them and the capture window those routes declare.
//
// PyTorch says when a CUDA graph capture (or a MemPool context) begins and
// ends, and when a graph or MemPool is gone: begin_route(id, filter) sends
// every allocation on a stream the filter accepts to pool `id` until
// end_route(id). As in PyTorch's allocator, a pool has one route at a time
// (a second begin is refused), and where several routes accept a stream the
// newest wins: use_mem_pool(P) inside torch.cuda.graph(g) sends the
// capture's allocations to P. Each pool is a core Allocator of its own over
// the device, with plain segments (no page remapping) and a backend that
// tells the core a capture is underway for as long as the pool has a use
// (PoolBackend's `held`): nothing of it is released or reused elsewhere
// while a graph captured into it may still be replayed. Graphs given the same pool id
// share it, and a block freed into it serves later allocations routed to it,
// as in PyTorch's allocator. Each begin_route() and create_or_incref() is a
// use, each release() drops one. Once no use is left and nothing in the pool
// is live, its segments go back to the driver (reclaim_locked()), where the
// device's other pools find them: at once when the last use goes with
// nothing live; when the last live block goes, at the next reclaim() (the
// device's empty_cache() or out-of-memory path), since a free runs inside a
// tensor's deleter, where waiting for the device and cuMemFree have no place
// (PyTorch's CUDA-graph trees release a pool on every warm-up iteration);
// and never while a capture is underway.
//
// The capture window: PyTorch routes a graph's pool before it begins the
// capture, and ends the route after the capture ends. Each open route counts
// as a capture underway (capture.h) on every device, from its opening on: no
// pool queries events, releases or unmaps memory, or reclaims graph pools.
// Before torch 2.13 it counts until it ends. torch 2.13 also marks the
// capture itself (mark_capture(): capture_begin routes, calls
// cudaStreamBeginCapture, then marks), which counts the same way; where
// PyTorch marks its captures (begin_route()'s `marked`), a route counts only
// until its capture's mark takes over (a mark begun on the thread that
// opened it), or until it serves an allocation on a stream found not
// capturing (use_mem_pool, NCCL registration and CUDA-graph trees' warm-up
// route with no capture: PyTorch's allocator then defers its event processing
// for the marks alone), or until it ends; so the moment between the route and
// the mark, when the capture begins, is covered. A mark PyTorch never ends
// ends when its route's capturing streams have been seen done for
// kRouteHealGrace (cudaStreamEndCapture failed, the graph kept:
// heal_routes()), or once no route is left open on the device (a capture
// abandoned before capture_end, whose reset() ends the route only): PyTorch
// ends a capture's mark before its route, so no capture is marked without a
// route open. The caller waits, once a route or mark is
// open, for every pool of every device to finish the operation it was in
// (quiesce()).
//
// torch.cuda.MemPool's options, as PyTorch's allocator keeps them per pool:
// no_split (set_no_split()) makes the pool's allocator never split a block
// (Config::no_split); use_on_oom (set_use_on_oom()) lets the pool's free
// blocks serve, as a last resort, allocations of the device routed to no
// pool that would otherwise run out of memory (malloc_on_oom(), on the
// general pool's out-of-memory path): such a block is handed out from the
// pool and its free returns it there.
//
// Locks: mu_ is taken shared to allocate from, free into or read the pools,
// and exclusively to add, release, reclaim or restore one; then a pool's own
// locks. So a free of a graph-pool block waits for no allocation or free
// elsewhere, only while a pool is added, released, restored or reclaimed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/allocator.h"
#include "cuda_backend.h"
#include "pool_backend.h"

namespace pyalloc {

class GraphPools {
 public:
  /// True: this stream's allocations go to the pool.
  using StreamFilter = std::function<bool(Stream)>;
  struct LiveBlock {
    uintptr_t ptr;
    size_t size;  // as requested
    Stream stream;
  };
  struct Info {
    PoolId id;
    int uses;
    int64_t allocated_bytes;
    int64_t reserved_bytes;
  };
  /// How long a route's capture must have been seen over before it heals
  /// (heal_routes()).
  static constexpr double kRouteHealGrace = 0.5;  // seconds

  /// Pools of `device`, drawing on its `budget`, pushing their counts to
  /// `sink` (the device's), with `general`'s settings where a graph pool
  /// keeps any, and `oom` on their out-of-memory path. All must outlive it.
  GraphPools(Device& device, DeviceBudget& budget, StatsSink& sink, const Config& general, OomPolicy& oom);
  /// Closes the captures its open routes and marks declared (tests drop fake devices).
  ~GraphPools();
  GraphPools(const GraphPools&) = delete;
  GraphPools& operator=(const GraphPools&) = delete;

  // -- Routes and the capture window ------------------------------------------

  /// From now on, allocations on streams the filter accepts come from pool
  /// `id` (created if new); a use of the pool. The route counts as a capture
  /// underway until it ends; with `marked` (PyTorch marks its captures), only
  /// until a mark begins on this thread or it serves a stream not capturing.
  /// Throws std::invalid_argument if the pool is being recorded to already
  /// (a route to it still open, not healed), as PyTorch's allocator refuses
  /// it; a healed route to it goes. The filter is called with no lock of
  /// PyTorch's held, and must not allocate.
  void begin_route(PoolId id, StreamFilter filter, bool marked = false);
  /// Stops the route to pool `id`, if any; the pool and its blocks stay.
  void end_route(PoolId id);
  /// A MemPool: creates pool `id` with one use (its segments from `source`,
  /// if given), or adds a use.
  void create_or_incref(PoolId id, SegmentSource source = {});
  /// A graph or MemPool using pool `id` is gone: one use less. Once no use
  /// is left, routes still open to it end (their graph is gone), and once
  /// nothing in it is live either, its memory returns to the device. True
  /// if that was the last use (a capture it declared may have ended).
  bool release(PoolId id);
  /// MemPool(no_split=True), PyTorch's setNoSplit: from now on pool `id`
  /// never splits a block. Throws no_such_pool() if there is none.
  void set_no_split(PoolId id);
  /// MemPool(use_on_oom=True), PyTorch's setUseOnOOM: whether the free blocks
  /// of pool `id` serve malloc_on_oom(). Throws no_such_pool() if there is
  /// none, unless turning it off (MemPool's destructor).
  void set_use_on_oom(PoolId id, bool use_on_oom);
  /// torch 2.13's markCaptureBegin (begin) / markCaptureEnd, on the thread
  /// that captures: a capture on the device counts as underway in between,
  /// or until the mark's route heals, or no route is left open on the
  /// device. An end without a begin (or whose mark healed) is ignored. True
  /// if a mark ended.
  bool mark_capture(bool begin);
  /// Ends counting as a capture underway each route (and the mark it holds)
  /// whose capturing streams have all been done for kRouteHealGrace (see
  /// graph_pools.cpp, "A route that never ends"). One atomic load while no
  /// open route has served a capture.
  void heal_routes();
  /// Some route is open (one atomic load).
  bool routing() const { return routing_.load(std::memory_order_acquire); }
  /// Some route still counts as a capture underway.
  bool capture_declared() const { return declared_routes_.load(std::memory_order_acquire) > 0; }
  /// PyTorch's pool calls are in use on this device (a route or a MemPool
  /// was ever made): it announces its captures.
  bool told_of_captures() const { return told_of_captures_.load(std::memory_order_acquire); }
  /// Returns once no pool is being added, released, restored or reclaimed.
  void quiesce() const;

  // -- Memory -----------------------------------------------------------------

  /// A block of the pool the stream is routed to; *routed false, and 0, if
  /// none is. Throws OutOfMemoryError (the pool gives nothing back to make
  /// room: its route counts as a capture underway).
  uintptr_t malloc(size_t size, Stream stream, uint64_t context, bool* routed);
  /// A block for an allocation routed to no pool that would otherwise run
  /// out of memory: from the free blocks of the first use_on_oom pool (by
  /// id) that has one that fits, which never grows for it; 0 if none has.
  uintptr_t malloc_on_oom(size_t size, Stream stream, uint64_t context);
  /// False if ptr is no live allocation of a graph pool.
  bool free(uintptr_t ptr, uint64_t context);
  bool record_stream(uintptr_t ptr, Stream stream);
  bool segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// Allocator::base_allocation() of the graph pool holding ptr.
  bool base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// Allocator::share() of the graph pool holding a live allocation at ptr:
  /// false with *out empty if none does.
  bool share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why);
  /// Gives back every pool with no use left and nothing live (unless a
  /// capture is underway); the bytes.
  size_t reclaim();

  // -- Checkpoints (PyTorch's CUDA-graph trees) -------------------------------

  /// The uses of pool `id`. Throws no_such_pool() if there is none.
  int use_count(PoolId id) const;
  /// The live allocations of pool `id` (PyTorch's checkPoolLiveAllocations).
  /// Throws no_such_pool() if there is none.
  std::vector<uintptr_t> live_blocks(PoolId id) const;
  /// The error PyTorch's allocator raises for a pool that does not exist
  /// ("Could not find pool of id").
  static std::invalid_argument no_such_pool(PoolId id);
  /// The live allocations of pool `id` with their sizes and streams
  /// (PyTorch's getCheckpointState).
  std::vector<LiveBlock> checkpoint(PoolId id) const;
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
  void restore(PoolId id, const std::vector<LiveBlock>& blocks, std::vector<uintptr_t>* freed,
               std::vector<uintptr_t>* allocated);

  // -- Reading ------------------------------------------------------------------

  /// The pools that exist, read under the lock (another thread may release
  /// one at any time).
  std::vector<Info> info() const;
  /// fn(id, pool) for every graph pool, the lock held shared: fn may use the
  /// pool but must not call back into GraphPools.
  void for_each(const std::function<void(PoolId, Allocator&)>& fn);
  /// The device's stats (StatsSink::read) over `others`' and every graph
  /// pool's, read while no pool can be retired (its sums would count twice).
  Stats device_stats(std::vector<Stats> others) const;
  /// Each pool's reserved bytes (PyTorch's reserved_bytes_by_private_pools):
  /// the pools that exist, and those reclaimed since the last
  /// reset_peak_stats(), whose current is 0.
  std::vector<std::pair<PoolId, StatArray>> reserved() const;
  /// Every pool's peaks to their current values; forgets the pools reclaimed.
  void reset_peak_stats();
  /// Keeps the last max_entries events of each pool, those made later too.
  void record_history(bool enabled, size_t max_entries);
  /// Allocator::check_invariants() of every pool, and each pool's list of its
  /// blocks against its allocator's live ones; InvariantError if anything is off.
  void check_invariants() const;

 private:
  struct Pool;
  // A route of begin_route(). While `declared`, it counts as a capture
  // underway (capture.h); while `marked`, its capture's mark does (never
  // both): until end_route(), its pool's last release(), or heal_routes()
  // (then `healed`: its capture was seen over, and PyTorch never ended the
  // route); one `until_marked` is declared only until a mark of its thread
  // takes over (mark_capture()) or it serves a stream not capturing.
  // `declared`, `marked`, `seen` and `ended` are guarded by seen_mu_
  // (`marked` changed under mu_ held exclusively too, with marks_), the rest
  // changed under mu_ held exclusively.
  struct Route {
    PoolId id;
    StreamFilter filter;
    bool until_marked = false;  // PyTorch marks its captures (torch 2.13+)
    std::thread::id thread;     // the thread that began it: its capture's
    bool declared = true;
    bool marked = false;
    bool healed = false;
    std::vector<std::pair<Stream, uint64_t>> seen;  // (stream, capture id) it served capturing
    double ended = 0;  // when all of `seen` were first found done (steady seconds), 0: not yet
  };

  Pool& incref_locked(PoolId id, SegmentSource source = {});
  bool reclaim_locked(Pool& pool);
  bool route_abandoned_locked(Route& route);
  /// Ends the route's count, seen_mu_ held: its declaration, or its hold on
  /// a mark, which ends too with `end_mark` (mu_ held exclusively); `why`:
  /// said on stderr (once a device), as a capture never ended.
  void uncount_held(Route& route, bool end_mark, const char* why);
  void retire_locked(Route& route, const char* why, bool end_mark = false);
  bool end_abandoned_marks_locked();

  Device& device_;
  DeviceBudget& budget_;
  StatsSink& sink_;
  const Config config_;  // every graph pool's
  OomPolicy& oom_;

  mutable std::shared_mutex mu_;
  std::map<PoolId, std::unique_ptr<Pool>> pools_;
  std::vector<Route> routes_;             // in begin order
  std::mutex seen_mu_;                    // guards each route's count (Route)
  std::atomic<int> watched_{0};           // declared or marked routes whose `seen` is not empty
  std::atomic<int> declared_routes_{0};   // routes that still count as a capture underway
  std::atomic<bool> told_unended_{false};  // a route left open was said on stderr
  int marks_ = 0;                         // mark_capture() begins not yet ended (routes' `marked` included)
  std::atomic<bool> routing_{false};      // routes_ is not empty
  std::atomic<bool> exist_{false};        // pools_ is not empty
  std::atomic<bool> told_of_captures_{false};
  std::atomic<int> use_on_oom_{0};        // pools whose use_on_oom is set
  std::map<PoolId, StatArray> released_reserved_;  // pools reclaimed since the last reset
  bool history_ = false;                           // what record_history() set
  size_t history_max_ = 0;
};

}  // namespace pyalloc
