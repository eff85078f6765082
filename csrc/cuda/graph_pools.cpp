// The graph pools of one device, their routes and checkpoints: see graph_pools.h.
#include "graph_pools.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace pyalloc {

namespace {

// A graph pool's segments, as PyTorch's allocator gives its private pools:
// plain segments, whose memory no page remapping can move away from under a
// graph.
Config graph_pool_config(const Config& general) {
  Config g = general;
  g.strategy = Strategy::kBestFit;
  g.pool_size = 0;
  // One size pool: memory never moves between the small and large pools, so
  // a block freed in a graph pool can always be given back at its address
  // (restore(), for torch.compile's CUDA-graph trees).
  g.small_size = 0;
  return g;
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string pool_name(PoolId id) {
  return "graph pool (" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

}  // namespace

struct GraphPools::Pool {
  PoolId id;
  std::unique_ptr<Allocator> alloc;
  PoolBackend* backend = nullptr;  // owned by alloc
  int uses = 0;                    // changed under mu_ held exclusively
  bool use_on_oom = false;         // changed under mu_ held exclusively
  std::mutex mu;                   // guards blocks
  std::unordered_set<uintptr_t> blocks;  // its live allocations
};

GraphPools::GraphPools(Device& device, DeviceBudget& budget, StatsSink& sink, const Config& general,
                       OomPolicy& oom)
    : device_(device), budget_(budget), sink_(sink), config_(graph_pool_config(general)), oom_(oom) {}

GraphPools::~GraphPools() {
  for (const Route& route : routes_)
    if (route.declared) device_.captures().close();
  for (int i = 0; i < marks_; ++i) device_.captures().close();
}

std::invalid_argument GraphPools::no_such_pool(PoolId id) {
  // PyTorch's checkPoolLiveAllocations says "Could not find pool of id" (its
  // getPoolUseCount asserts the same).
  return std::invalid_argument("Could not find pool of id (" + std::to_string(id.first) + ", " +
                               std::to_string(id.second) +
                               "): no graph pool or MemPool of the device has it");
}

// ---------------------------------------------------------------------------
// Pools: made on a first use, given back once unused and empty

GraphPools::Pool& GraphPools::incref_locked(PoolId id, SegmentSource source) {
  auto it = pools_.find(id);
  if (it != pools_.end()) {
    Pool& pool = *it->second;
    if (pool.uses++ == 0) pool.backend->set_held(true);  // released, not yet reclaimed
    return pool;
  }
  auto pool = std::make_unique<Pool>();
  pool->id = id;
  auto backend = std::make_unique<PoolBackend>(device_.make_backend(), budget_, true, device_.index(), id,
                                               std::move(source));
  pool->backend = backend.get();
  pool->alloc = std::make_unique<Allocator>(std::move(backend), config_);
  pool->alloc->set_oom_policy(&oom_);
  pool->alloc->set_stats_sink(&sink_);
  pool->alloc->share_history();
  if (history_) pool->alloc->record_history(true, history_max_);
  released_reserved_.erase(id);  // reported live again
  pool->uses = 1;
  Pool& ref = *pool;
  pools_.emplace(id, std::move(pool));
  exist_.store(true, std::memory_order_release);
  return ref;
}

bool GraphPools::reclaim_locked(Pool& pool) {
  if (pool.uses != 0 || !pool.blocks.empty()) return false;
  for (const Route& route : routes_)
    if (route.id == pool.id) return false;
  // Nothing may be released while any capture is underway: later, then.
  if (device_.captures().underway()) return false;
  pool.backend->set_held(false);
  pool.alloc->empty_cache();  // waits for the streams that used its blocks
  if (pool.alloc->stats().reserved_bytes.all.current != 0) return false;
  if (pool.use_on_oom) use_on_oom_.fetch_sub(1, std::memory_order_acq_rel);
  pool.alloc->set_stats_sink(nullptr);  // all it added is given back by now
  Stats final = pool.alloc->stats();
  sink_.retire(final);  // its sums stay the device's
  released_reserved_[pool.id] = final.reserved_bytes;
  pools_.erase(pool.id);
  exist_.store(!pools_.empty(), std::memory_order_release);
  return true;
}

size_t GraphPools::reclaim() {
  if (!exist_.load(std::memory_order_acquire)) return 0;
  std::unique_lock<std::shared_mutex> g(mu_);
  size_t released = 0;
  std::vector<Pool*> idle;
  for (const auto& [id, pool] : pools_)
    if (pool->uses == 0 && pool->blocks.empty()) idle.push_back(pool.get());
  for (Pool* pool : idle) {
    auto reserved = static_cast<size_t>(pool->alloc->stats().reserved_bytes.all.current);
    if (reclaim_locked(*pool)) released += reserved;
  }
  return released;
}

void GraphPools::create_or_incref(PoolId id, SegmentSource source) {
  std::unique_lock<std::shared_mutex> g(mu_);
  told_of_captures_.store(true, std::memory_order_release);
  incref_locked(id, std::move(source));
}

bool GraphPools::release(PoolId id) {
  std::unique_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second->uses == 0) return false;  // nothing left to release
  Pool& pool = *it->second;
  if (--pool.uses != 0) return false;
  // Every use is gone, the graphs that routed to the pool included: a route
  // still open to it was never ended (its capture failed, capture.h).
  for (auto r = routes_.begin(); r != routes_.end();) {
    if (r->id != id) {
      ++r;
      continue;
    }
    retire_locked(*r, "its pool was released while it was open");
    r = routes_.erase(r);
  }
  end_abandoned_marks_locked();
  routing_.store(!routes_.empty(), std::memory_order_release);
  reclaim_locked(pool);
  return true;
}

void GraphPools::set_no_split(PoolId id) {
  std::unique_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) throw no_such_pool(id);
  it->second->alloc->set_no_split();
}

void GraphPools::set_use_on_oom(PoolId id, bool use_on_oom) {
  std::unique_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    if (use_on_oom) throw no_such_pool(id);
    return;  // reclaimed already: nothing left to serve from
  }
  Pool& pool = *it->second;
  if (pool.use_on_oom != use_on_oom) use_on_oom_.fetch_add(use_on_oom ? 1 : -1, std::memory_order_acq_rel);
  pool.use_on_oom = use_on_oom;
}

void GraphPools::quiesce() const {
  // Pools are added, released, restored and reclaimed only with mu_ held exclusively.
  std::unique_lock<std::shared_mutex> g(mu_);
}

// ---------------------------------------------------------------------------
// Routes and the capture window

void GraphPools::begin_route(PoolId id, StreamFilter filter, bool marked) {
  std::unique_lock<std::shared_mutex> g(mu_);
  // One route to a pool at a time, as PyTorch's beginAllocateToPool checks
  // ("already recording to mempool_id"): then each end ends the route it
  // belongs to. Refused before any use is taken, so the pool stays as it was.
  for (const Route& r : routes_) {
    if (r.id == id && !r.healed)
      throw std::invalid_argument(pool_name(id) +
                                  " is already being recorded to (beginAllocateToPool: already recording to "
                                  "mempool_id): a CUDA graph capture or use_mem_pool into it has not ended");
  }
  told_of_captures_.store(true, std::memory_order_release);
  // A healed route to the pool (its capture seen over, never ended) gives way
  // to the new one; the bridge drops its filter when this returns.
  routes_.erase(std::remove_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.id == id; }),
                routes_.end());
  incref_locked(id);
  Route route;
  route.id = id;
  route.filter = std::move(filter);
  route.until_marked = marked;
  route.thread = std::this_thread::get_id();
  routes_.push_back(std::move(route));
  routing_.store(true, std::memory_order_release);
  // PyTorch begins the capture only after this returns, and marks it (torch
  // 2.13) only once it has begun: from now on, a capture counts as underway,
  // for every thread (capture.h).
  device_.captures().open();
  declared_routes_.fetch_add(1, std::memory_order_acq_rel);
}

void GraphPools::end_route(PoolId id) {
  std::unique_lock<std::shared_mutex> g(mu_);
  // A pool has one route at a time (begin_route()): the one to `id` ends.
  auto ending = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.id == id; });
  if (ending != routes_.end()) {
    retire_locked(*ending, nullptr);  // the capture, if any, ended before this call
    routes_.erase(ending);
  }
  end_abandoned_marks_locked();
  routing_.store(!routes_.empty(), std::memory_order_release);
  auto it = pools_.find(id);
  if (it != pools_.end()) reclaim_locked(*it->second);  // released while routed
}

// A mark and its route: torch 2.13's CUDAGraph::capture_begin routes the
// pool, begins the capture and marks it, all on the calling thread, so a
// mark's begin takes over the count from the routes of its thread still
// waiting for a mark (until_marked, declared); the newest is its capture's
// route, which then holds the mark (`marked`): the route's capturing streams
// heal the mark if PyTorch never ends it (heal_routes()). A mark's end ends
// its thread's marked route's mark (capture_end ends the mark on the thread
// that began it); one of a thread with none ends a mark held by no route, if
// any is left: an end whose mark healed first is ignored. Limit: a mark
// healed between cudaStreamEndCapture's success and markCaptureEnd (the
// grace makes it unlikely) takes with its late end a mark of the same thread
// begun since, or one held by no route.
bool GraphPools::mark_capture(bool begin) {
  std::unique_lock<std::shared_mutex> g(mu_);
  std::lock_guard<std::mutex> s(seen_mu_);
  const std::thread::id me = std::this_thread::get_id();
  if (begin) {
    marks_++;
    device_.captures().open();  // before the routes it takes over close: never a moment uncounted
    bool held = false;
    for (auto r = routes_.rbegin(); r != routes_.rend(); ++r) {
      if (r->thread != me || !r->until_marked || !r->declared) continue;
      if (held) {
        uncount_held(*r, false, nullptr);
        continue;
      }
      held = true;
      r->marked = true;  // its `seen` now heals the mark
      r->declared = false;
      declared_routes_.fetch_sub(1, std::memory_order_acq_rel);
      device_.captures().close();
    }
    return false;
  }
  int held = 0;
  Route* owner = nullptr;
  for (Route& r : routes_) {
    if (!r.marked) continue;
    held++;
    if (r.thread == me) owner = &r;  // the newest
  }
  if (owner != nullptr) {
    uncount_held(*owner, true, nullptr);
    return true;
  }
  if (marks_ == held) return false;  // no mark left that no route holds: it healed
  marks_--;
  device_.captures().close();
  return true;
}

void GraphPools::retire_locked(Route& route, const char* why, bool end_mark) {
  {
    std::lock_guard<std::mutex> s(seen_mu_);
    uncount_held(route, end_mark, why);
  }
  route.healed = true;  // ended: no capture of it may be counted again
}

// A mark whose end never comes: torch 2.13's CUDAGraph::capture_end ends the
// mark before it ends the route, but a capture abandoned before capture_end
// (an exception in the captured code, the graph destroyed) gets from reset()
// an end of its route and a release of its pool only, and its mark would
// count as a capture underway for the rest of the process. A route's end
// leaves the mark it holds held by none. Every capture PyTorch marks has its
// route open until after its mark ends, so once no route is left open on the
// device (healed ones aside), every mark left is such a one, and ends.
// A mark that outlives its route while another route of the device stays
// open ends only then: a capture still marked cannot be told apart from it.
// Limit: a conditional node's capture (begin_capture_to_if_node) ends its
// route and begins another meanwhile; with no other route open on the
// device, its mark ends there, and the capture counts again only from the new
// route's begin (declared, waiting for a mark that never comes) on.
bool GraphPools::end_abandoned_marks_locked() {
  if (marks_ == 0) return false;
  for (const Route& r : routes_)
    if (!r.healed) return false;
  for (; marks_ > 0; --marks_) device_.captures().close();
  return true;
}

// A route that never ends: torch 2.x's CUDAGraph::capture_end checks
// cudaStreamEndCapture's result before it calls end_allocate_to_pool, so a
// capture that fails (an invalidated capture) leaves its route open, and with
// it a capture counted as underway on every device for the rest of the
// process. Such a route heals: the streams it served while they were
// capturing are remembered (with the capture's id), and once every one of
// them has been found done (cuStreamGetCaptureInfo, legal during any capture)
// for kRouteHealGrace while the route is still open, it stops counting as a
// capture underway and pyalloc says so on stderr (once a device); the grace
// leaves a capture that has just ended the moment PyTorch needs to end its
// route. On torch 2.13 the same failure leaves the capture's mark open too
// (where capture_end ends it only after cudaStreamEndCapture succeeds): the
// route holding the mark remembers its capturing streams the same way, and
// the mark ends when the route heals. A route that served no capturing stream
// cannot be seen to end: it goes when the pool's last use is released
// (release()), which ends every route still open to it. Limit: a route seen
// only on a stream forked from the capture and joined back before the
// capture ends may heal while the capture goes on, after the grace.

bool GraphPools::route_abandoned_locked(Route& route) {
  std::lock_guard<std::mutex> s(seen_mu_);
  if (!route.declared && !route.marked) return false;
  if (route.seen.empty()) return false;
  for (const auto& [stream, capture] : route.seen) {
    CaptureState st = device_.captures().probe(stream);
    // Still capturing, in that capture (or one whose id is unknown): not over.
    if (st.capturing && (st.id == capture || st.id == 0 || capture == 0)) {
      route.ended = 0;
      return false;
    }
  }
  double now = steady_seconds();
  if (route.ended == 0) route.ended = now;
  return now - route.ended >= kRouteHealGrace;
}

void GraphPools::uncount_held(Route& route, bool end_mark, const char* why) {
  if (!route.declared && !route.marked) return;
  if (!route.seen.empty()) watched_.fetch_sub(1, std::memory_order_acq_rel);
  route.seen.clear();
  route.ended = 0;
  if (route.declared) {
    route.declared = false;
    declared_routes_.fetch_sub(1, std::memory_order_acq_rel);
    device_.captures().close();
  }
  if (route.marked) {
    route.marked = false;  // else its mark stays, held by no route
    if (end_mark) {        // mu_ is held exclusively
      marks_--;
      device_.captures().close();
    }
  }
  if (why != nullptr && !told_unended_.exchange(true)) {
    std::fprintf(stderr,
                 "pyalloc: a CUDA graph capture into pool (%llu, %llu) on device %d was never "
                 "ended (end_allocate_to_pool: did cudaStreamEndCapture fail?); %s, so it no "
                 "longer counts as a capture underway\n",
                 static_cast<unsigned long long>(route.id.first),
                 static_cast<unsigned long long>(route.id.second), device_.index(), why);
  }
}

void GraphPools::heal_routes() {
  if (watched_.load(std::memory_order_acquire) == 0) return;
  {
    // Probing is legal during any capture; only a route found over takes the lock exclusively.
    std::shared_lock<std::shared_mutex> g(mu_);
    bool any = false;
    for (Route& route : routes_) any = route_abandoned_locked(route) || any;
    if (!any) return;
  }
  std::unique_lock<std::shared_mutex> g(mu_);
  for (Route& route : routes_)
    if (route_abandoned_locked(route)) retire_locked(route, "its streams stopped capturing", true);
  end_abandoned_marks_locked();
}

// ---------------------------------------------------------------------------
// Memory

uintptr_t GraphPools::malloc(size_t size, Stream stream, uint64_t context, bool* routed) {
  std::shared_lock<std::shared_mutex> g(mu_);
  Pool* pool = nullptr;
  Route* route = nullptr;
  // Newest first, as PyTorch's allocator searches its routes: use_mem_pool(P)
  // inside torch.cuda.graph(g) sends the capture's allocations to P.
  for (auto r = routes_.rbegin(); r != routes_.rend(); ++r) {
    if (r->filter && r->filter(stream)) {
      pool = pools_.at(r->id).get();
      route = &*r;
      break;
    }
  }
  if (pool == nullptr) return 0;
  *routed = true;
  // Remember a capturing stream, so that no pool of the process releases
  // memory until its capture is over (capture.h); and the route it served,
  // so that the route (or its capture's mark) heals if PyTorch never ends it.
  // A route waiting for a mark that serves a stream not capturing routes no
  // capture (use_mem_pool): it counts as one no longer.
  CaptureState cap = device_.captures().probe(stream);
  if (cap.capturing || route->until_marked) {
    std::lock_guard<std::mutex> s(seen_mu_);
    if (!cap.capturing) {
      if (route->declared) uncount_held(*route, false, nullptr);  // until_marked: holds no mark
    } else if (route->declared || route->marked) {
      auto key = std::make_pair(stream, cap.id);
      if (std::find(route->seen.begin(), route->seen.end(), key) == route->seen.end()) {
        if (route->seen.empty()) watched_.fetch_add(1, std::memory_order_acq_rel);
        route->seen.push_back(key);
      }
      route->ended = 0;
    }
  }
  uintptr_t ptr = pool->alloc->malloc(size, stream, context);
  std::lock_guard<std::mutex> b(pool->mu);
  pool->blocks.insert(ptr);
  return ptr;
}

uintptr_t GraphPools::malloc_on_oom(size_t size, Stream stream, uint64_t context) {
  if (use_on_oom_.load(std::memory_order_acquire) == 0) return 0;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) {
    if (!pool->use_on_oom) continue;
    // Its cache only, by the pool's own rules (no_split included): the pool
    // grows for its own allocations alone.
    uintptr_t ptr = pool->alloc->malloc_cached(size, stream, context);
    if (ptr == 0) continue;
    std::lock_guard<std::mutex> b(pool->mu);
    pool->blocks.insert(ptr);  // its free comes back to this pool
    return ptr;
  }
  return 0;
}

bool GraphPools::free(uintptr_t ptr, uint64_t context) {
  if (!exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) {
    {
      std::lock_guard<std::mutex> b(pool->mu);
      if (pool->blocks.erase(ptr) == 0) continue;
    }
    pool->alloc->free(ptr, context);  // back to its own pool, for the pool's next allocations
    // A pool whose last use is gone and whose last block this was is not
    // reclaimed here: this runs in a tensor's deleter, where waiting for the
    // device and cuMemFree have no place. reclaim() gives it back.
    return true;
  }
  return false;
}

bool GraphPools::record_stream(uintptr_t ptr, Stream stream) {
  if (!exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) {
    {
      std::lock_guard<std::mutex> b(pool->mu);
      if (pool->blocks.count(ptr) == 0) continue;
    }
    pool->alloc->record_stream(ptr, stream);
    return true;
  }
  return false;
}

bool GraphPools::segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  if (!exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_)
    if (pool->alloc->segment_of(ptr, base, size)) return true;
  return false;
}

bool GraphPools::base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  if (!exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_)
    if (pool->alloc->base_allocation(ptr, base, size)) return true;
  return false;
}

bool GraphPools::share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why) {
  if (!exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) {
    if (pool->alloc->share(ptr, out, why)) return true;
    if (!out->empty()) return false;  // its allocation, refused by its backend
  }
  return false;
}

// ---------------------------------------------------------------------------
// Checkpoints

int GraphPools::use_count(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) throw no_such_pool(id);
  return it->second->uses;
}

std::vector<uintptr_t> GraphPools::live_blocks(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) throw no_such_pool(id);
  std::vector<uintptr_t> out;
  {
    std::lock_guard<std::mutex> b(it->second->mu);
    out.assign(it->second->blocks.begin(), it->second->blocks.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<GraphPools::LiveBlock> GraphPools::checkpoint(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(mu_);
  std::vector<LiveBlock> out;
  auto it = pools_.find(id);
  if (it == pools_.end()) return out;
  const Pool& pool = *it->second;
  std::vector<uintptr_t> ptrs;
  {
    std::lock_guard<std::mutex> b(it->second->mu);
    ptrs.assign(pool.blocks.begin(), pool.blocks.end());
  }
  for (uintptr_t ptr : ptrs) {
    LiveBlock b{ptr, 0, 0};
    if (pool.alloc->live_block(ptr, &b.size, &b.stream)) out.push_back(b);
  }
  std::sort(out.begin(), out.end(), [](const LiveBlock& a, const LiveBlock& b) { return a.ptr < b.ptr; });
  return out;
}

namespace {

using LiveBlock = GraphPools::LiveBlock;

// What restore() can tell of `blocks` before it changes anything, so that
// bad input is refused without freeing and making blocks to undo: each block
// has a size, none overlaps another, and each lies within one segment of the
// pool.
void check_restorable(const Allocator& alloc, const std::vector<LiveBlock>& blocks) {
  std::vector<std::pair<uintptr_t, size_t>> ranges;
  for (const LiveBlock& b : blocks) {
    auto refuse = [&](const char* why) {
      throw std::invalid_argument("cannot restore a block at " + format_ptr(b.ptr) + " of " +
                                  std::to_string(b.size) + " bytes: " + why);
    };
    if (b.size == 0 || b.size > kMaxRequest) refuse("its size is out of range");
    size_t rounded = round_up(b.size, kGranularity);
    uintptr_t base;
    size_t size;
    if (!alloc.segment_of(b.ptr, &base, &size) || rounded > base + size - b.ptr)
      refuse("it does not lie within one segment of the pool");
    ranges.emplace_back(b.ptr, rounded);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].first + ranges[i - 1].second)
      throw std::invalid_argument("cannot restore blocks at " + format_ptr(ranges[i - 1].first) + " and " +
                                  format_ptr(ranges[i].first) +
                                  ": they overlap, so the memory of one is not free for the other");
}

// A live block the checkpoint does not hold as it is, as it was: to make it
// again exactly, should the restore fail.
struct Dropped {
  uintptr_t ptr;
  Allocator::LiveBlockInfo info;
};

// What restore() does, decided before it changes anything.
struct RestorePlan {
  std::vector<Dropped> dropped;         // live now, not in the checkpoint as they are
  std::vector<const LiveBlock*> to_make;  // in the checkpoint, not live now as they are
  std::vector<uintptr_t> kept;          // live now and in the checkpoint as they are
  // The dropped blocks whose memory a new block takes, freed before the new
  // blocks are made; the others, freed once all are made.
  std::vector<const Dropped*> freed_first, freed_last;
};

RestorePlan plan_restore(const Allocator& alloc, const std::unordered_set<uintptr_t>& live,
                         const std::vector<LiveBlock>& blocks) {
  RestorePlan plan;
  std::unordered_map<uintptr_t, const LiveBlock*> wanted;
  for (const LiveBlock& b : blocks) wanted.emplace(b.ptr, &b);
  // What the checkpoint did not hold is freed, so that its blocks' memory
  // is free again; the blocks to make are those not live already.
  std::unordered_set<uintptr_t> dropped_ptrs;
  for (uintptr_t ptr : live) {
    Dropped d{ptr, {}};
    alloc.live_block_info(ptr, &d.info);
    auto w = wanted.find(ptr);
    if (w == wanted.end() || d.info.requested != w->second->size || d.info.stream != w->second->stream) {
      plan.dropped.push_back(std::move(d));
      dropped_ptrs.insert(ptr);
    }
  }
  for (const LiveBlock& b : blocks) {
    if (live.count(b.ptr) != 0 && dropped_ptrs.count(b.ptr) == 0) plan.kept.push_back(b.ptr);
    else plan.to_make.push_back(&b);
  }
  // A failure halfway is undone by making the dropped blocks again, which
  // needs their memory free: a dropped block whose memory a new block takes
  // is freed at once, or the restore is refused before anything changes if
  // a stream record_stream() named still has work queued on it (its free
  // would wait, and the new block could not be made, nor the dropped one
  // again). The other dropped blocks are freed only once every new block is
  // made: a free that waits on a stream cannot be taken back.
  // The new blocks overlap no other (check_restorable()): in address order,
  // the one starting last before a dropped block's end is the only one that
  // can overlap it. A dropped block's end is its own (an oversize block
  // holds more than its request).
  std::vector<std::pair<uintptr_t, uintptr_t>> new_ranges;
  for (const LiveBlock* b : plan.to_make)
    new_ranges.emplace_back(b->ptr, b->ptr + round_up(b->size, kGranularity));
  std::sort(new_ranges.begin(), new_ranges.end());
  for (const Dropped& d : plan.dropped) {
    uintptr_t end = d.ptr + d.info.size;
    auto r = std::lower_bound(new_ranges.begin(), new_ranges.end(), std::make_pair(end, uintptr_t{0}));
    bool needed = r != new_ranges.begin() && std::prev(r)->second > d.ptr;
    (needed ? plan.freed_first : plan.freed_last).push_back(&d);
  }
  return plan;
}

}  // namespace

void GraphPools::restore(PoolId id, const std::vector<LiveBlock>& blocks, std::vector<uintptr_t>* freed,
                         std::vector<uintptr_t>* allocated) {
  // mu_ is held exclusively throughout: no other allocation or free reaches
  // a graph pool (or its list of blocks) meanwhile, so a failure can be
  // undone exactly.
  std::unique_lock<std::shared_mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end())
    throw std::invalid_argument("cannot restore " + pool_name(id) + ": it no longer exists");
  Pool& pool = *it->second;
  check_restorable(*pool.alloc, blocks);
  RestorePlan plan = plan_restore(*pool.alloc, pool.blocks, blocks);
  std::vector<uintptr_t> made;
  size_t undone = 0;  // freed_first blocks freed so far
  try {
    for (const Dropped* d : plan.freed_first) {
      if (!pool.alloc->free_at_once(d->ptr))
        throw std::invalid_argument(
            "cannot restore graph pool: the block at " + format_ptr(d->ptr) +
            ", live now and not in the checkpoint, holds memory of a checkpointed block, and a stream "
            "it was recorded on (record_stream) still has work queued that may use it");
      pool.blocks.erase(d->ptr);
      undone++;
    }
    for (const LiveBlock* b : plan.to_make) {
      pool.alloc->allocate_at(b->ptr, b->size, b->stream);
      pool.blocks.insert(b->ptr);
      made.push_back(b->ptr);
    }
  } catch (...) {
    // Back to the state before the call, each dropped block as it was (its
    // bytes, tag and recorded streams): PyTorch keeps its storages as they were.
    for (uintptr_t ptr : made) {
      pool.alloc->free(ptr);
      pool.blocks.erase(ptr);
    }
    for (size_t i = 0; i < undone; ++i) {
      pool.alloc->reinstate(plan.freed_first[i]->ptr, plan.freed_first[i]->info);
      pool.blocks.insert(plan.freed_first[i]->ptr);
    }
    throw;
  }
  for (const Dropped* d : plan.freed_last) {
    pool.alloc->free(d->ptr);
    pool.blocks.erase(d->ptr);
  }
  for (const Dropped* d : plan.freed_first) freed->push_back(d->ptr);
  for (const Dropped* d : plan.freed_last) freed->push_back(d->ptr);
  // A block live before and after is in both lists, as PyTorch's allocator
  // gives it (it frees every block and allocates every checkpointed one):
  // CUDA-graph trees give a live storage its deleter back only if its
  // pointer is among those allocated.
  freed->insert(freed->end(), plan.kept.begin(), plan.kept.end());
  *allocated = std::move(made);
  allocated->insert(allocated->end(), plan.kept.begin(), plan.kept.end());
}

// ---------------------------------------------------------------------------
// Reading

std::vector<GraphPools::Info> GraphPools::info() const {
  std::shared_lock<std::shared_mutex> g(mu_);
  std::vector<Info> out;
  for (const auto& [id, pool] : pools_) {
    Stats st = pool->alloc->stats();
    out.push_back({id, pool->uses, st.allocated_bytes.all.current, st.reserved_bytes.all.current});
  }
  return out;
}

void GraphPools::for_each(const std::function<void(PoolId, Allocator&)>& fn) {
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) fn(id, *pool->alloc);
}

Stats GraphPools::device_stats(std::vector<Stats> others) const {
  std::shared_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) others.push_back(pool->alloc->stats());
  return sink_.read(others);
}

std::vector<std::pair<PoolId, StatArray>> GraphPools::reserved() const {
  std::shared_lock<std::shared_mutex> g(mu_);
  std::map<PoolId, StatArray> out(released_reserved_);
  for (const auto& [id, pool] : pools_) out[id] = pool->alloc->stats().reserved_bytes;
  return {out.begin(), out.end()};
}

void GraphPools::reset_peak_stats() {
  std::unique_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) pool->alloc->reset_peak_stats();
  released_reserved_.clear();
}

void GraphPools::record_history(bool enabled, size_t max_entries) {
  std::unique_lock<std::shared_mutex> g(mu_);
  history_ = enabled && max_entries > 0;
  history_max_ = history_ ? max_entries : 0;
  for (const auto& [id, pool] : pools_) pool->alloc->record_history(history_, history_max_);
}

void GraphPools::check_invariants() const {
  // Exclusively: an allocation or free holds mu_ shared from its allocator's
  // call to its entry in the pool's list.
  std::unique_lock<std::shared_mutex> g(mu_);
  for (const auto& [id, pool] : pools_) {
    pool->alloc->check_invariants();
    std::string name = pool_name(id);
    std::lock_guard<std::mutex> b(pool->mu);
    for (uintptr_t ptr : pool->blocks) {
      size_t requested;
      Stream stream;
      if (!pool->alloc->live_block(ptr, &requested, &stream))
        throw InvariantError(name + " lists " + format_ptr(ptr) + ", which is no live allocation of it");
    }
    auto live = static_cast<size_t>(pool->alloc->stats().allocation.all.current);
    if (live != pool->blocks.size())
      throw InvariantError(name + " lists " + std::to_string(pool->blocks.size()) + " blocks; its allocator has " +
                           std::to_string(live) + " live");
  }
}

}  // namespace pyalloc
