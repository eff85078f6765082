// The pools of each CUDA device and the logic behind PyTorch's hooks: see cuda_pools.h.
#include "cuda_pools.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>
#include <unordered_set>

#include "ipc.h"

namespace pyalloc {

// ---------------------------------------------------------------------------
// DevicePools

namespace {

// The buffer pool grows by exactly what a buffer needs (in the core's 2 MiB
// segment unit) and splits off every remainder worth a block, so that each
// buffer costs what it holds and the rest of its segment serves the next.
Config buffer_config(const Config& general) {
  Config b;
  b.strategy = general.strategy;  // strategy:bestfit means no virtual memory at all
  b.segment_size = kSegmentAlign;
  b.small_size = kGranularity;
  return b;
}

// A graph pool's segments, as PyTorch's allocator gives its private pools:
// plain segments, whose memory no page remapping can move away from under a
// graph.
Config graph_pool_config(const Config& general) {
  Config g = general;
  g.strategy = Strategy::kBestFit;
  g.pool_size = 0;
  // One size pool: memory never moves between the small and large pools, so
  // a block freed in a graph pool can always be given back at its address
  // (restore_pool, for torch.compile's CUDA-graph trees).
  g.small_size = 0;
  return g;
}

}  // namespace

struct DevicePools::GraphPool {
  PoolId id;
  std::unique_ptr<Allocator> alloc;
  PoolBackend* backend = nullptr;  // owned by alloc
  int uses = 0;                    // changed under pools_mu_ held exclusively
  std::mutex mu;                   // guards blocks
  std::unordered_set<uintptr_t> blocks;  // its live allocations
};

std::unique_ptr<Backend> DevicePools::make_backend(bool held, PoolId id) {
  return std::make_unique<PoolBackend>(device_->make_backend(), budget_, held, device_->index(), id);
}

DevicePools::DevicePools(std::unique_ptr<Device> device, const Config& config)
    : device_(std::move(device)), config_(config) {
  general_ = std::make_unique<Allocator>(make_backend(false, {0, 0}), config_);
  buffers_ = std::make_unique<Allocator>(make_backend(false, kBufferPoolId), buffer_config(config_));
  general_->set_oom_policy(&general_oom_);
  buffers_->set_oom_policy(&buffer_oom_);
  general_->set_stats_sink(&device_stats_);
  buffers_->set_stats_sink(&device_stats_);
  general_->share_history();  // one device trace for all of its pools
  buffers_->share_history();
  max_split_size_ = general_->stats().max_split_size;
  // Asked for vmm, got bestfit (the device says why it has no virtual
  // memory, or it offers it and the trial mapping failed): said once per
  // process; reports name the strategy in use (general()). A device that
  // offers no virtual memory and says nothing of it (the fake device) is no
  // news.
  static std::atomic<bool> told{false};
  std::string why = device_->vmm_unavailable();
  bool offered = general_->backend().vmm_page_size() != 0;
  if (config_.strategy == Strategy::kVmm && general_->config().strategy != Strategy::kVmm &&
      (offered || !why.empty()) && !told.exchange(true)) {
    std::fprintf(stderr,
                 "pyalloc: device %d cannot use strategy vmm (%s); its pools use strategy "
                 "bestfit\n",
                 index(), why.empty() ? "the trial mapping failed" : why.c_str());
  }
}

DevicePools::~DevicePools() {
  // Fake devices are dropped by tests: what this device declared open closes with it.
  for (const PoolRoute& route : routes_)
    if (route.declared) device_->captures().close();
  for (int i = 0; i < marks_; ++i) device_->captures().close();
}

uintptr_t DevicePools::malloc(size_t size, Stream stream, uint64_t context) {
  if (size == 0) return 0;
  if (routing_.load(std::memory_order_acquire)) {
    heal_routes();  // a capture whose route was never ended stops counting as one
    bool routed = false;
    uintptr_t p = routed_malloc(size, stream, context, &routed);
    if (routed) return p;
  }
  // Without PyTorch's pool calls, each allocation asks whether its stream is capturing.
  if (!told_of_captures_.load(std::memory_order_acquire) &&
      !PoolRegistry::instance().told_of_captures()) {
    CaptureState cap = device_->captures().probe(stream);
    if (cap.capturing) return capture_malloc(size, stream, cap.id, context);
  }
  // Out of memory, it retries once the other pools have given back their
  // cache (PoolOom::release_elsewhere), then raises the error itself.
  return general_->malloc(size, stream, context);
}

size_t DevicePools::release_others(const Allocator& pool) {
  // Nothing may be released while a capture is underway (the core says so too).
  heal_routes();
  if (device_->captures().underway()) return 0;
  size_t released = 0;
  if (&pool != general_.get()) released += general_->empty_cache();
  if (&pool != buffers_.get()) released += buffers_->empty_cache();
  if (pools_exist_.load(std::memory_order_acquire)) released += reclaim_pools();
  return released;
}

bool DevicePools::free(uintptr_t ptr, std::string* why, uint64_t context) {
  ipc::forget(index(), ptr);  // an export of its pages ends before they can be reused
  if (capture_free(ptr)) return true;
  // The general pool's own lock alone: no device-wide lock on the common path.
  if (general_->try_free(ptr, context)) return true;
  if (pools_exist_.load(std::memory_order_acquire) && pool_free(ptr, context)) return true;
  try {
    general_->free(ptr, context);  // says what ptr is (a double free, a foreign pointer)
    return true;
  } catch (const InvalidPointerError& e) {
    *why = e.what();
    return false;
  }
}

bool DevicePools::record_stream(uintptr_t ptr, Stream stream) {
  if (pools_exist_.load(std::memory_order_acquire)) {
    std::shared_lock<std::shared_mutex> g(pools_mu_);
    for (const auto& [id, pool] : pools_) {
      {
        std::lock_guard<std::mutex> b(pool->mu);
        if (pool->blocks.count(ptr) == 0) continue;
      }
      pool->alloc->record_stream(ptr, stream);
      return true;
    }
  }
  uintptr_t base;
  size_t size;
  // Look before calling, so that a pointer of another pool costs no exception.
  for (Allocator* pool : {general_.get(), buffers_.get()}) {
    if (!pool->segment_of(ptr, &base, &size)) continue;
    if (pool == general_.get()) capture_record_stream(ptr);
    try {
      pool->record_stream(ptr, stream);
      return true;
    } catch (const InvalidPointerError&) {
      return false;
    }
  }
  return false;
}

bool DevicePools::segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  if (general_->segment_of(ptr, base, size) || buffers_->segment_of(ptr, base, size)) return true;
  if (!pools_exist_.load(std::memory_order_acquire)) return false;
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  for (const auto& [id, pool] : pools_)
    if (pool->alloc->segment_of(ptr, base, size)) return true;
  return false;
}

uintptr_t DevicePools::malloc_buffer(size_t size, Stream stream) { return buffers_->malloc(size, stream); }

void DevicePools::free_buffer(uintptr_t ptr) {
  ipc::forget(index(), ptr);
  buffers_->free(ptr);
}

bool DevicePools::share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why) {
  // Only the pool with a live allocation at ptr asks its backend (fills out).
  for (Allocator* pool : {general_.get(), buffers_.get()}) {
    if (pool->share(ptr, out, why)) return true;
    if (!out->empty()) return false;
  }
  if (pools_exist_.load(std::memory_order_acquire)) {
    std::shared_lock<std::shared_mutex> g(pools_mu_);
    for (const auto& [id, pool] : pools_) {
      if (pool->alloc->share(ptr, out, why)) return true;
      if (!out->empty()) return false;
    }
  }
  *why = "no pool of device " + std::to_string(index()) + " has a live allocation at " + format_ptr(ptr);
  return false;
}

void DevicePools::quiesce() const {
  general_->quiesce();
  buffers_->quiesce();
  // Graph pools are reclaimed only with pools_mu_ held exclusively.
  { std::unique_lock<std::shared_mutex> g(pools_mu_); }
  // Driver calls made outside every lock (cuMemGetInfo for an out-of-memory
  // message or the cache info) go through the tracker.
  device_->captures().drain();
}

size_t DevicePools::empty_cache() {
  // A capture may be underway from begin_allocate_to_pool on, before any of
  // its allocations has shown its stream: release nothing while a route is open.
  heal_routes();
  if (declared_routes_.load(std::memory_order_acquire) > 0 || device_->captures().underway())
    return 0;
  size_t released = general_->empty_cache() + buffers_->empty_cache();
  if (pools_exist_.load(std::memory_order_acquire)) released += reclaim_pools();
  // pool_size is a floor: torch.cuda.graph() empties the cache right before
  // it captures, and a capture can only use memory already reserved.
  size_t restored = 0;
  size_t reserved = static_cast<size_t>(general_->stats().reserved_bytes.all.current);
  if (reserved < config_.pool_size) {
    try {
      restored = general_->reserve(config_.pool_size - reserved);
    } catch (const std::exception&) {
      // Best effort: the memory may have gone to another process meanwhile.
    }
  }
  return released > restored ? released - restored : 0;
}

void DevicePools::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw std::invalid_argument("memory fraction must be between 0 and 1, got " +
                                std::to_string(fraction));
  // The device's size, not its free memory: known during a capture too.
  size_t total = device_->total_bytes();
  if (total == 0)
    throw std::runtime_error("cannot apply a memory fraction to device " + std::to_string(index()) +
                             ": the driver does not say how much memory it has");
  double limit = fraction * static_cast<double>(total);
  // 0 would mean "no cap" to the core; 1 byte lets nothing more be reserved.
  size_t cap = limit < 1.0 ? 1 : static_cast<size_t>(limit);
  // Every pool of the device together (graph pools, buffers), as PyTorch's
  // fraction caps its private pools too; the whole device is no cap.
  budget_.cap.store(fraction >= 1.0 ? 0 : cap, std::memory_order_release);
  // The general pool's own cap as well, so that its refusals say why.
  if (config_.max_pool_size != 0 && config_.max_pool_size < cap) cap = config_.max_pool_size;
  general_->set_max_pool_size(cap);
  fraction_.store(fraction, std::memory_order_relaxed);
}

void DevicePools::for_each_pool(const std::function<void(PoolId, Allocator&)>& fn) {
  fn(PoolId{0, 0}, *general_);
  fn(kBufferPoolId, *buffers_);
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  for (const auto& [id, pool] : pools_) fn(id, *pool->alloc);
}

void DevicePools::reset_accumulated_stats() {
  for_each_pool([](PoolId, Allocator& a) { a.reset_accumulated_stats(); });
  device_stats_.reset_accumulated();
}

size_t DevicePools::largest_free_block() {
  size_t largest = 0;
  for_each_pool([&](PoolId, Allocator& a) { largest = std::max(largest, a.largest_free_block()); });
  return largest;
}

size_t DevicePools::cache_info() {
  size_t largest = largest_free_block();
  size_t dev_free = 0, dev_total = 0;
  device_->mem_info(&dev_free, &dev_total);
  size_t cap = general_->config().max_pool_size;
  if (cap != 0) {
    auto reserved = static_cast<size_t>(general_->stats().reserved_bytes.all.current);
    dev_free = std::min(dev_free, cap > reserved ? cap - reserved : 0);
  }
  if (size_t all = device_cap(); all != 0) {
    size_t reserved = device_reserved();
    dev_free = std::min(dev_free, all > reserved ? all - reserved : 0);
  }
  return std::max(largest, dev_free);
}


// ---------------------------------------------------------------------------
// Graph pools

uintptr_t DevicePools::routed_malloc(size_t size, Stream stream, uint64_t context, bool* routed) {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  GraphPool* pool = nullptr;
  PoolRoute* route = nullptr;
  for (PoolRoute& r : routes_) {
    if (r.filter && r.filter(stream)) {
      pool = pools_.at(r.id).get();
      route = &r;
      break;
    }
  }
  if (pool == nullptr) return 0;
  *routed = true;
  // Remember a capturing stream, so that no pool of the process releases
  // memory until its capture is over (capture.h); and the route it served,
  // so that the route heals if PyTorch never ends it.
  CaptureState cap = device_->captures().probe(stream);
  if (cap.capturing && route->declared) {
    std::lock_guard<std::mutex> s(seen_mu_);
    auto key = std::make_pair(stream, cap.id);
    if (std::find(route->seen.begin(), route->seen.end(), key) == route->seen.end()) {
      if (route->seen.empty()) watched_.fetch_add(1, std::memory_order_acq_rel);
      route->seen.push_back(key);
    }
    route->ended = 0;
  }
  // Out of memory, nothing is given back to make room: the route counts as
  // a capture underway (capture.h).
  uintptr_t ptr = pool->alloc->malloc(size, stream, context);
  std::lock_guard<std::mutex> b(pool->mu);
  pool->blocks.insert(ptr);
  return ptr;
}

bool DevicePools::pool_free(uintptr_t ptr, uint64_t context) {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  for (const auto& [id, pool] : pools_) {
    {
      std::lock_guard<std::mutex> b(pool->mu);
      if (pool->blocks.erase(ptr) == 0) continue;
    }
    pool->alloc->free(ptr, context);  // back to its own pool, for the pool's next allocations
    // A pool whose last use is gone and whose last block this was is not
    // reclaimed here: this runs in a tensor's deleter, where waiting for the
    // device and cuMemFree have no place. empty_cache() and the
    // out-of-memory path give it back (reclaim_pools()).
    return true;
  }
  return false;
}

DevicePools::GraphPool& DevicePools::pool_incref_locked(PoolId id, SegmentSource source) {
  auto it = pools_.find(id);
  if (it != pools_.end()) {
    GraphPool& pool = *it->second;
    if (pool.uses++ == 0) pool.backend->set_held(true);  // released, not yet reclaimed
    return pool;
  }
  auto pool = std::make_unique<GraphPool>();
  pool->id = id;
  auto backend = std::make_unique<PoolBackend>(device_->make_backend(), budget_, true, device_->index(), id,
                                               std::move(source));
  pool->backend = backend.get();
  pool->alloc = std::make_unique<Allocator>(std::move(backend), graph_pool_config(config_));
  pool->alloc->set_oom_policy(&graph_oom_);
  pool->alloc->set_stats_sink(&device_stats_);
  pool->alloc->share_history();
  if (history_) pool->alloc->record_history(true, history_max_);
  released_reserved_.erase(id);  // reported live again
  pool->uses = 1;
  GraphPool& ref = *pool;
  pools_.emplace(id, std::move(pool));
  pools_exist_.store(true, std::memory_order_release);
  return ref;
}

bool DevicePools::reclaim_locked(GraphPool& pool) {
  if (pool.uses != 0 || !pool.blocks.empty()) return false;
  for (const PoolRoute& route : routes_)
    if (route.id == pool.id) return false;
  // Nothing may be released while any capture is underway: later, then.
  if (device_->captures().underway()) return false;
  pool.backend->set_held(false);
  pool.alloc->empty_cache();  // waits for the streams that used its blocks
  if (pool.alloc->stats().reserved_bytes.all.current != 0) return false;
  pool.alloc->set_stats_sink(nullptr);  // all it added is given back by now
  Stats final = pool.alloc->stats();
  device_stats_.retire(final);  // its sums stay the device's
  released_reserved_[pool.id] = final.reserved_bytes;
  pools_.erase(pool.id);
  pools_exist_.store(!pools_.empty(), std::memory_order_release);
  return true;
}

size_t DevicePools::reclaim_pools() {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  size_t released = 0;
  std::vector<GraphPool*> idle;
  for (const auto& [id, pool] : pools_)
    if (pool->uses == 0 && pool->blocks.empty()) idle.push_back(pool.get());
  for (GraphPool* pool : idle) {
    auto reserved = static_cast<size_t>(pool->alloc->stats().reserved_bytes.all.current);
    if (reclaim_locked(*pool)) released += reserved;
  }
  return released;
}

void DevicePools::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  // The same pool may be routed to more than once at a time, as PyTorch's
  // allocator allows (use_mem_pool on several threads): each is a use.
  told_of_captures_.store(true, std::memory_order_release);
  // A route to this pool that healed (its capture was seen over, never ended)
  // would shadow the new one: its filter would match first, and the new
  // capture's end would close it instead of the new route.
  routes_.erase(std::remove_if(routes_.begin(), routes_.end(),
                               [&](const PoolRoute& r) { return r.id == id && !r.declared; }),
                routes_.end());
  pool_incref_locked(id);
  PoolRoute route;
  route.id = id;
  route.filter = std::move(filter);
  routes_.push_back(std::move(route));
  // PyTorch begins the capture only after this returns: from now on, a
  // capture counts as underway, for every thread (capture.h).
  device_->captures().open();
  declared_routes_.fetch_add(1, std::memory_order_acq_rel);
  routing_.store(true, std::memory_order_release);
}

void DevicePools::end_allocate_to_pool(PoolId id) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  // The first route to the pool that still counts as a capture ends, as
  // PyTorch's allocator ends the first of its captures underway with that
  // pool; a healed one only if there is no other.
  auto ending = routes_.end(), healed = routes_.end();
  for (auto it = routes_.begin(); it != routes_.end(); ++it) {
    if (it->id != id) continue;
    if (it->declared) {
      ending = it;
      break;
    }
    if (healed == routes_.end()) healed = it;
  }
  if (ending == routes_.end()) ending = healed;
  if (ending != routes_.end()) {
    undeclare_locked(*ending, nullptr);  // the capture, if any, ended before this call
    // Healed routes to the pool begun before it end with it (their captures
    // failed: no end comes for them). The bridge drops the filter of the
    // pool's oldest route at each end, as PyTorch ends its oldest capture:
    // a route left behind would call a filter already freed.
    auto last = std::next(ending);
    routes_.erase(std::remove_if(routes_.begin(), last, [&](const PoolRoute& r) { return r.id == id; }),
                  last);
  }
  routing_.store(!routes_.empty(), std::memory_order_release);
  auto it = pools_.find(id);
  if (it != pools_.end()) reclaim_locked(*it->second);  // released while routed
  g.unlock();
  release_parked_everywhere();
}

void DevicePools::release_parked() {
  if (device_->captures().underway()) return;  // each pool checks again, under its lock
  for_each_pool([](PoolId, Allocator& a) { a.release_parked(); });
}

void DevicePools::release_parked_everywhere() {
  // The capture tracker is the process's: a capture on one device parks the
  // pages of another's growth too. No pools lock is held here. One device's
  // failure is said and leaves the others to go on.
  auto release = [](DevicePools* p) {
    try {
      p->release_parked();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: device %d: releasing pages parked during a capture failed: %s\n",
                   p->index(), e.what());
    }
  };
  release(this);
  for (DevicePools* p : PoolRegistry::instance().all())
    if (p != this) release(p);
}

void DevicePools::mark_capture(bool begin) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  if (begin) {
    marks_++;
    device_->captures().open();
  } else if (marks_ > 0) {
    marks_--;
    device_->captures().close();
    g.unlock();
    release_parked_everywhere();
  }
}

void DevicePools::release_pool(PoolId id) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  auto it = pools_.find(id);
  if (it == pools_.end() || it->second->uses == 0) return;  // nothing left to release
  GraphPool& pool = *it->second;
  if (--pool.uses != 0) return;
  // Every use is gone, the graphs that routed to the pool included: a route
  // still open to it was never ended (its capture failed, capture.h).
  for (auto r = routes_.begin(); r != routes_.end();) {
    if (r->id != id) {
      ++r;
      continue;
    }
    undeclare_locked(*r, "its pool was released while it was open");
    r = routes_.erase(r);
  }
  routing_.store(!routes_.empty(), std::memory_order_release);
  reclaim_locked(pool);
  g.unlock();
  release_parked_everywhere();  // a route it ended may have been the last capture
}

namespace {
double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

bool DevicePools::route_abandoned_locked(PoolRoute& route) {
  if (!route.declared) return false;
  std::lock_guard<std::mutex> s(seen_mu_);
  if (route.seen.empty()) return false;
  for (const auto& [stream, capture] : route.seen) {
    CaptureState st = device_->captures().probe(stream);
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

void DevicePools::undeclare_locked(PoolRoute& route, const char* why) {
  if (!route.declared) return;
  route.declared = false;
  {
    std::lock_guard<std::mutex> s(seen_mu_);
    if (!route.seen.empty()) watched_.fetch_sub(1, std::memory_order_acq_rel);
    route.seen.clear();
  }
  declared_routes_.fetch_sub(1, std::memory_order_acq_rel);
  device_->captures().close();
  if (why != nullptr && !told_unended_.exchange(true)) {
    std::fprintf(stderr,
                 "pyalloc: a CUDA graph capture into pool (%llu, %llu) on device %d was never "
                 "ended (end_allocate_to_pool: did cudaStreamEndCapture fail?); %s, so it no "
                 "longer counts as a capture underway\n",
                 static_cast<unsigned long long>(route.id.first),
                 static_cast<unsigned long long>(route.id.second), index(), why);
  }
}

void DevicePools::heal_routes() {
  if (watched_.load(std::memory_order_acquire) == 0) return;
  {
    // Probing is legal during any capture; only a route found over takes the lock exclusively.
    std::shared_lock<std::shared_mutex> g(pools_mu_);
    bool any = false;
    for (PoolRoute& route : routes_) any = route_abandoned_locked(route) || any;
    if (!any) return;
  }
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  for (PoolRoute& route : routes_)
    if (route_abandoned_locked(route)) undeclare_locked(route, "its streams stopped capturing");
}

void DevicePools::create_or_incref_pool(PoolId id, SegmentSource source) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  told_of_captures_.store(true, std::memory_order_release);
  pool_incref_locked(id, std::move(source));
}

void DevicePools::for_each_pool_units(
    const std::function<void(PoolId, Allocator&, const std::vector<std::pair<uintptr_t, size_t>>&)>& fn) {
  for_each_pool([&](PoolId id, Allocator& a) {
    fn(id, a, static_cast<const PoolBackend&>(a.backend()).units().list());  // every pool's backend is one
  });
}

int DevicePools::pool_use_count(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  auto it = pools_.find(id);
  return it == pools_.end() ? 0 : it->second->uses;
}

std::vector<uintptr_t> DevicePools::pool_live_blocks(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  std::vector<uintptr_t> out;
  auto it = pools_.find(id);
  if (it != pools_.end()) {
    std::lock_guard<std::mutex> b(it->second->mu);
    out.assign(it->second->blocks.begin(), it->second->blocks.end());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<DevicePools::LiveBlock> DevicePools::pool_checkpoint(PoolId id) const {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  std::vector<LiveBlock> out;
  auto it = pools_.find(id);
  if (it == pools_.end()) return out;
  const GraphPool& pool = *it->second;
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
// What restore_pool() can tell of `blocks` before it changes anything, so
// that bad input is refused without freeing and making blocks to undo: each
// block has a size, none overlaps another, and each lies within one segment
// of the pool.
void check_restorable(const Allocator& alloc, const std::vector<DevicePools::LiveBlock>& blocks) {
  std::vector<std::pair<uintptr_t, size_t>> ranges;
  for (const DevicePools::LiveBlock& b : blocks) {
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
                                  format_ptr(ranges[i].first) + ": they overlap, so the memory of one is not free for the other");
}
}  // namespace

void DevicePools::restore_pool(PoolId id, const std::vector<LiveBlock>& blocks,
                               std::vector<uintptr_t>* freed, std::vector<uintptr_t>* allocated) {
  // pools_mu_ is held throughout: no other allocation or free reaches a graph
  // pool meanwhile, so a failure can be undone exactly.
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  auto it = pools_.find(id);
  if (it == pools_.end())
    throw std::invalid_argument("cannot restore graph pool (" + std::to_string(id.first) + ", " +
                                std::to_string(id.second) + "): it no longer exists");
  GraphPool& pool = *it->second;
  check_restorable(*pool.alloc, blocks);
  std::unordered_map<uintptr_t, const LiveBlock*> wanted;
  for (const LiveBlock& b : blocks) wanted.emplace(b.ptr, &b);
  // What the checkpoint did not hold is freed, so that its blocks' memory
  // is free again; the blocks to make are those not live already.
  struct Dropped {
    uintptr_t ptr;
    Allocator::LiveBlockInfo info;  // to make it again exactly, should the restore fail
  };
  std::vector<Dropped> dropped;
  std::unordered_set<uintptr_t> dropped_ptrs;
  // pools_mu_ held exclusively: no other thread is in any pool's blocks.
  for (uintptr_t ptr : pool.blocks) {
    Dropped d{ptr, {}};
    pool.alloc->live_block_info(ptr, &d.info);
    auto w = wanted.find(ptr);
    if (w == wanted.end() || d.info.requested != w->second->size || d.info.stream != w->second->stream) {
      dropped.push_back(std::move(d));
      dropped_ptrs.insert(ptr);
    }
  }
  std::vector<const LiveBlock*> to_make;
  std::vector<uintptr_t> kept;
  for (const LiveBlock& b : blocks) {
    if (pool.blocks.count(b.ptr) != 0 && dropped_ptrs.count(b.ptr) == 0) kept.push_back(b.ptr);
    else to_make.push_back(&b);
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
  for (const LiveBlock* b : to_make) new_ranges.emplace_back(b->ptr, b->ptr + round_up(b->size, kGranularity));
  std::sort(new_ranges.begin(), new_ranges.end());
  std::vector<const Dropped*> freed_first, freed_last;
  for (const Dropped& d : dropped) {
    uintptr_t end = d.ptr + d.info.size;
    auto r = std::lower_bound(new_ranges.begin(), new_ranges.end(), std::make_pair(end, uintptr_t{0}));
    bool needed = r != new_ranges.begin() && std::prev(r)->second > d.ptr;
    (needed ? freed_first : freed_last).push_back(&d);
  }
  std::vector<uintptr_t> made;
  size_t undone = 0;  // freed_first blocks freed so far
  try {
    for (const Dropped* d : freed_first) {
      if (!pool.alloc->free_at_once(d->ptr))
        throw std::invalid_argument(
            "cannot restore graph pool: the block at " + format_ptr(d->ptr) +
            ", live now and not in the checkpoint, holds memory of a checkpointed block, and a stream "
            "it was recorded on (record_stream) still has work queued that may use it");
      pool.blocks.erase(d->ptr);
      undone++;
    }
    for (const LiveBlock* b : to_make) {
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
      pool.alloc->reinstate(freed_first[i]->ptr, freed_first[i]->info);
      pool.blocks.insert(freed_first[i]->ptr);
    }
    throw;
  }
  for (const Dropped* d : freed_last) {
    pool.alloc->free(d->ptr);
    pool.blocks.erase(d->ptr);
  }
  for (const Dropped* d : freed_first) freed->push_back(d->ptr);
  for (const Dropped* d : freed_last) freed->push_back(d->ptr);
  // A block live before and after is in both lists, as PyTorch's allocator
  // gives it (it frees every block and allocates every checkpointed one):
  // CUDA-graph trees give a live storage its deleter back only if its
  // pointer is among those allocated.
  freed->insert(freed->end(), kept.begin(), kept.end());
  *allocated = std::move(made);
  allocated->insert(allocated->end(), kept.begin(), kept.end());
}

void DevicePools::check_invariants() const {
  general_->check_invariants();
  buffers_->check_invariants();
  // Exclusively: a graph-pool allocation or free holds pools_mu_ shared from
  // its allocator's call to its entry in the pool's list.
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  for (const auto& [id, pool] : pools_) {
    pool->alloc->check_invariants();
    std::string name = "graph pool (" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
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

std::vector<DevicePools::GraphPoolInfo> DevicePools::graph_pools() const {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  std::vector<GraphPoolInfo> out;
  for (const auto& [id, pool] : pools_) {
    Stats st = pool->alloc->stats();
    out.push_back({id, pool->uses, st.allocated_bytes.all.current, st.reserved_bytes.all.current});
  }
  return out;
}

// ---------------------------------------------------------------------------
// CUDA graphs

uintptr_t DevicePools::capture_malloc(size_t size, Stream stream, uint64_t capture,
                                      uint64_t context) {
  size_t rounded = round_up(size, kGranularity);
  if (capture != 0) {
    std::lock_guard<std::mutex> g(graph_mu_);
    auto it = graph_idle_.find(GraphKey{capture, stream, rounded});
    if (it != graph_idle_.end()) {
      uintptr_t ptr = it->second;
      graph_idle_.erase(it);
      graph_live_.emplace(ptr, GraphBlock{capture, stream, rounded});
      return ptr;
    }
  }
  uintptr_t ptr = general_->malloc(size, stream, context);
  std::lock_guard<std::mutex> g(graph_mu_);
  graph_live_.emplace(ptr, GraphBlock{capture, stream, rounded});
  graph_bytes_ += rounded;
  graph_any_.store(true, std::memory_order_release);
  return ptr;
}

bool DevicePools::capture_free(uintptr_t ptr) {
  if (!graph_any_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> g(graph_mu_);
  auto it = graph_live_.find(ptr);
  if (it == graph_live_.end()) return false;
  const GraphBlock& b = it->second;
  graph_idle_.emplace(GraphKey{b.capture, b.stream, b.size}, ptr);
  graph_live_.erase(it);
  return true;
}

void DevicePools::capture_record_stream(uintptr_t ptr) {
  if (!graph_any_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> g(graph_mu_);
  auto it = graph_live_.find(ptr);
  // Another stream uses it: reuse on the capture stream alone is no longer ordered.
  if (it != graph_live_.end()) it->second.capture = 0;
}

std::pair<size_t, size_t> DevicePools::graph_memory() const {
  std::lock_guard<std::mutex> g(graph_mu_);
  return {graph_live_.size() + graph_idle_.size(), graph_bytes_};
}

size_t DevicePools::release_graph_memory() {
  std::vector<uintptr_t> idle;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> g(graph_mu_);
    for (const auto& [key, ptr] : graph_idle_) {
      idle.push_back(ptr);
      bytes += std::get<2>(key);
    }
    graph_idle_.clear();
    // Blocks PyTorch still holds become ordinary: freed later, they go back at once.
    graph_live_.clear();
    graph_bytes_ = 0;
    graph_any_.store(false, std::memory_order_release);
  }
  for (uintptr_t p : idle) general_->free(p);
  return bytes;
}

// ---------------------------------------------------------------------------
// Statistics and history of the device

Stats DevicePools::stats() const {
  std::vector<Stats> pools{general_->stats(), buffers_->stats()};
  // Read while no graph pool can be retired (its sums would count twice).
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  for (const auto& [id, pool] : pools_) pools.push_back(pool->alloc->stats());
  Stats s = device_stats_.read(pools);
  s.max_split_size = max_split_size_;
  return s;
}

std::vector<std::pair<DevicePools::PoolId, StatArray>> DevicePools::pool_reserved() const {
  std::shared_lock<std::shared_mutex> g(pools_mu_);
  std::map<PoolId, StatArray> out(released_reserved_);
  for (const auto& [id, pool] : pools_) out[id] = pool->alloc->stats().reserved_bytes;
  return {out.begin(), out.end()};
}

void DevicePools::reset_peak_stats() {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  general_->reset_peak_stats();
  buffers_->reset_peak_stats();
  for (const auto& [id, pool] : pools_) pool->alloc->reset_peak_stats();
  released_reserved_.clear();
  device_stats_.reset_peak();
}

void DevicePools::record_history(bool enabled, size_t max_entries) {
  std::unique_lock<std::shared_mutex> g(pools_mu_);
  history_ = enabled && max_entries > 0;
  history_max_ = history_ ? max_entries : 0;
  general_->record_history(history_, history_max_);
  buffers_->record_history(history_, history_max_);
  for (const auto& [id, pool] : pools_) pool->alloc->record_history(history_, history_max_);
}

// ---------------------------------------------------------------------------
// Errors

size_t DevicePools::PoolOom::release_elsewhere(Allocator& pool) {
  // Graph pools with no use left and the other pools' caches may still hold
  // memory. Never for a graph pool: its route counts as a capture underway.
  return relieved_ ? pools_.release_others(pool) : 0;
}

std::string DevicePools::PoolOom::describe(Allocator& pool, const OomFailure& failure) {
  Stats st = pool.stats();
  FragmentationInfo f = pool.fragmentation();
  size_t dev_free = 0, dev_total = 0;
  pools_.device_->mem_info(&dev_free, &dev_total);
  int d = pools_.index();
  size_t size = failure.request;
  const std::string& why = failure.why;
  bool capturing = pools_.device_->captures().underway();
  auto reserved = static_cast<size_t>(st.reserved_bytes.all.current);
  std::ostringstream m;
  // The first words are what batch-size finders (accelerate, Lightning) look for.
  // Each figure once, named for what it is: `why`, the core's reason, names none.
  m << "CUDA out of memory. Tried to allocate " << format_bytes(size) << " on device " << d
    << " (pyalloc " << which_ << " pool). ";
  if (dev_total != 0)
    m << "GPU " << d << " has a total capacity of " << format_bytes(dev_total) << " of which "
      << format_bytes(dev_free) << " is free. ";
  size_t cap = pools_.device_cap();
  size_t own_cap = pool.config().max_pool_size;
  m << "pyalloc has " << format_bytes(static_cast<size_t>(st.allocated_bytes.all.current))
    << " allocated and " << format_bytes(reserved) << " reserved in this pool";
  if (own_cap != 0 && own_cap != cap) m << ", under its cap of " << format_bytes(own_cap) << " (max_pool_size)";
  m << "; " << format_bytes(f.free_bytes) << " of the reserved memory is free, the largest free block is "
    << format_bytes(f.largest_free_block) << ". ";
  if (f.free_bytes >= size && f.largest_free_block < size)
    m << "The free memory is fragmented: no free block is large enough. ";
  if (cap != 0) {
    size_t held = pools_.device_reserved();
    m << "The memory fraction " << pools_.memory_fraction() << " caps all of pyalloc's pools on device " << d
      << " at " << format_bytes(cap);
    if (held != reserved) m << ", of which they hold " << format_bytes(held);
    m << ": " << format_bytes(cap > held ? cap - held : 0) << " more can be reserved under the cap. ";
  }
  if (capturing && !pool.backend().grows_while_capturing())
    m << "A CUDA graph capture is underway, and this driver lets captures be served only from "
         "memory already reserved; torch.cuda.graph() empties the cache before it captures, so "
         "keep memory reserved with the pool_size setting (pyalloc.install(pool_size=...) or "
         "PYALLOC_CONF=pool_size:...). ";
  else if (capturing)
    m << "A CUDA graph capture is underway: nothing cached can be released to make room. ";
  m << "Why: " << why << ".";
  return m.str();
}

// ---------------------------------------------------------------------------
// PoolRegistry

PoolRegistry::PoolRegistry() = default;

PoolRegistry& PoolRegistry::instance() {
  // Never destroyed: PyTorch frees tensors during interpreter shutdown.
  static PoolRegistry* r = new PoolRegistry();
  return *r;
}

void PoolRegistry::configure(const std::string& text) {
  Config c = parse_config(text);
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& slot : pools_) {
    if (slot.load() != nullptr && c.to_string() != config_.to_string())
      throw std::runtime_error(
          "pyalloc's CUDA pools already exist with the settings '" + config_.to_string() +
          "'; they cannot change to '" + c.to_string() + "' once memory has been allocated");
  }
  config_ = c;
  configured_ = true;
}

Config PoolRegistry::config_locked() {
  if (!configured_) {
    const char* env = std::getenv("PYALLOC_CONF");
    try {
      config_ = parse_config(env != nullptr ? env : "");
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("PYALLOC_CONF: ") + e.what());
    }
    configured_ = true;
  }
  return config_;
}

Config PoolRegistry::config() {
  std::lock_guard<std::mutex> g(mu_);
  return config_locked();
}

DevicePools& PoolRegistry::get(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::invalid_argument("invalid CUDA device index " + std::to_string(device));
  DevicePools* p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  std::lock_guard<std::mutex> g(mu_);
  p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Config c = config_locked();
  std::unique_ptr<Device> dev = fake_ ? open_fake_device(device, fake_capacity_) : open_cuda_device(device);
  auto pools = std::make_unique<DevicePools>(std::move(dev), c);
  if (history_) pools->record_history(true, history_max_);
  p = pools.release();
  pools_[device].store(p, std::memory_order_release);
  only_.store(only_.load() == nullptr ? p : reinterpret_cast<DevicePools*>(kSeveral),
              std::memory_order_release);
  return *p;
}

void PoolRegistry::wait_for_pools_being_made() { std::lock_guard<std::mutex> g(mu_); }

DevicePools* PoolRegistry::find(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return pools_[device].load(std::memory_order_acquire);
}

std::vector<DevicePools*> PoolRegistry::all() const {
  std::vector<DevicePools*> out;
  for (const auto& slot : pools_)
    if (DevicePools* p = slot.load(std::memory_order_acquire)) out.push_back(p);
  return out;
}

void PoolRegistry::record_history(bool enabled, size_t max_entries) {
  std::lock_guard<std::mutex> g(mu_);
  history_ = enabled && max_entries > 0;
  history_max_ = history_ ? max_entries : 0;
  for (const auto& slot : pools_)
    if (DevicePools* p = slot.load()) p->record_history(history_, history_max_);
}

void PoolRegistry::use_fake_devices(size_t capacity) {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& slot : pools_)
    if (slot.load() != nullptr && !fake_)
      throw std::runtime_error("fake devices are for tests: CUDA pools already exist");
  fake_ = true;
  fake_capacity_ = capacity;
}

void PoolRegistry::reset_fake() {
  std::lock_guard<std::mutex> g(mu_);
  if (!fake_) throw std::runtime_error("only fake pools can be dropped");
  only_.store(nullptr);
  for (auto& slot : pools_) delete slot.exchange(nullptr);
  configured_ = false;
  config_ = Config();
  history_ = false;
  history_max_ = 0;
  route_ = kNotInstalled;
  told_of_captures_ = false;
  device_count_ = -1;
  fake_ = false;
  fake_capacity_ = 0;
}

// ---------------------------------------------------------------------------
// Hooks

namespace hooks {
namespace {

void report_bad_free(uintptr_t ptr, const std::string& why) {
  // Called from PyTorch's deleters, where nothing may be thrown.
  std::fprintf(stderr, "pyalloc: ignoring a free from PyTorch: %s\n",
               why.empty() ? format_ptr(ptr).c_str() : why.c_str());
}

}  // namespace

uintptr_t malloc(size_t size, int device, Stream stream, uint64_t context) {
  // PyTorch may ask for 0 bytes; like its own allocator, answer nullptr.
  if (size == 0) return 0;
  DevicePools* pools;
  try {
    pools = &PoolRegistry::instance().get(device);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError("CUDA out of memory. pyalloc could not create its pool on device " +
                           std::to_string(device) + ": " + e.what());
  }
  // A failed event left memory out of use: say so where the user sees it.
  std::string error = pools->device().take_error();
  if (!error.empty()) throw std::runtime_error(error);
  return pools->malloc(size, stream, context);
}

bool free_checked(uintptr_t ptr, int device, uint64_t context, std::string* why) {
  if (ptr == 0) return true;
  PoolRegistry& r = PoolRegistry::instance();
  DevicePools* hinted = r.find(device);
  if (hinted == nullptr && device < 0) hinted = r.only();  // one device: no search
  if (hinted != nullptr && hinted->free(ptr, why, context)) return true;
  // The device is a hint: the pointer's owner decides. Only the devices
  // whose address range holds it are asked (may_hold() takes no lock).
  uintptr_t base;
  size_t size;
  std::string owner_why;
  for (DevicePools* p : r.all()) {
    if (p == hinted || !p->may_hold(ptr)) continue;
    std::string w;
    if (p->free(ptr, &w, context)) return true;
    // Its memory, but no live block there: its answer (a double free, say).
    if (owner_why.empty() && p->segment_of(ptr, &base, &size)) owner_why = w;
  }
  if (!owner_why.empty()) {
    *why = owner_why;
    return false;
  }
  // The hinted device's own answer (a double free, say) if the pointer is in its memory.
  if (hinted == nullptr || !hinted->segment_of(ptr, &base, &size) || why->empty())
    *why = "free(" + format_ptr(ptr) + "): not a pointer from pyalloc's pools";
  return false;
}

void free(uintptr_t ptr, int device) noexcept {
  try {
    std::string why;
    if (!free_checked(ptr, device, 0, &why)) report_bad_free(ptr, why);
  } catch (const std::exception& e) {
    report_bad_free(ptr, e.what());
  }
}

void record_stream(uintptr_t ptr, Stream stream) {
  if (ptr == 0) return;
  // PyTorch passes every tensor here, its foreign ones (from_blob, DLPack) too.
  for (DevicePools* p : PoolRegistry::instance().all())
    if (p->record_stream(ptr, stream)) return;
}

uintptr_t base_alloc(uintptr_t ptr, size_t* size) noexcept {
  uintptr_t base;
  size_t bytes;
  for (DevicePools* p : PoolRegistry::instance().all()) {
    if (p->segment_of(ptr, &base, &bytes)) {
      if (size != nullptr) *size = bytes;
      return base;
    }
  }
  return ptr;  // PyTorch's answer when no hook is set
}

void empty_cache() {
  // A route left open on one device blocks every device: heal them all first.
  for (DevicePools* p : PoolRegistry::instance().all()) p->heal_routes();
  for (DevicePools* p : PoolRegistry::instance().all()) p->empty_cache();
}

void set_memory_fraction(double fraction, int device) {
  PoolRegistry::instance().get(device).set_memory_fraction(fraction);
}

void init(int device_count) noexcept { PoolRegistry::instance().set_device_count(device_count); }

namespace {
// A capture is declared underway (capture.h) from here on; PyTorch begins it
// once the call returns. An operation of another thread that decided before
// the declaration that it may touch the device (release memory, query an
// event) may still be doing so: wait for every pool of every device to
// finish what it is doing, since CUDA's global capture mode forbids those
// calls from any thread while any stream of the process is capturing.
void wait_for_operations_under_way() {
  PoolRegistry::instance().wait_for_pools_being_made();
  for (DevicePools* p : PoolRegistry::instance().all()) p->quiesce();
}
}  // namespace

void begin_allocate_to_pool(int device, DevicePools::PoolId id, DevicePools::StreamFilter filter) {
  PoolRegistry::instance().get(device).begin_allocate_to_pool(id, std::move(filter));
  wait_for_operations_under_way();
}

void end_allocate_to_pool(int device, DevicePools::PoolId id) noexcept {
  try {
    if (DevicePools* p = PoolRegistry::instance().find(device)) p->end_allocate_to_pool(id);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pyalloc: ending allocations to a graph pool failed: %s\n", e.what());
  }
}

void release_pool(int device, DevicePools::PoolId id) noexcept {
  try {
    if (DevicePools* p = PoolRegistry::instance().find(device)) p->release_pool(id);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pyalloc: releasing a graph pool failed: %s\n", e.what());
  }
}

void mark_capture(int device, bool begin) {
  // A begin creates the device's pools, so that its end finds them.
  if (begin) {
    PoolRegistry::instance().get(device).mark_capture(true);
    wait_for_operations_under_way();
  } else if (DevicePools* p = PoolRegistry::instance().find(device)) p->mark_capture(false);
}

}  // namespace hooks
}  // namespace pyalloc
