// The pools of one CUDA device: see cuda_pools.h.
#include "cuda_pools.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <mutex>
#include <sstream>

#include "ipc.h"
#include "streams.h"

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

}  // namespace

std::unique_ptr<Backend> DevicePools::make_backend(PoolId id) {
  return std::make_unique<PoolBackend>(device_->make_backend(), budget_, false, device_->index(), id);
}

DevicePools::DevicePools(std::unique_ptr<Device> device, const Config& config, ProcessPools& process)
    : device_(std::move(device)),
      index_(device_->index()),
      config_(config),
      process_(process),
      general_(std::make_unique<Allocator>(make_backend({0, 0}), config_)),
      buffers_(std::make_unique<Allocator>(make_backend(kBufferPoolId), buffer_config(config_))),
      graphs_(*device_, budget_, device_stats_, config_, graph_oom_) {
  general_->set_oom_policy(&general_oom_);
  buffers_->set_oom_policy(&buffer_oom_);
  general_->set_stats_sink(&device_stats_);
  buffers_->set_stats_sink(&device_stats_);
  device_stats_.set_solo(general_.get());  // the device's counts are its own until another pool's
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

uintptr_t DevicePools::malloc(size_t size, Stream stream, uint64_t context) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  // The common case, PyTorch's hot path: no route, and captures announced
  // (the general pool answers 0 bytes with nullptr itself).
  if (!graphs_.routing() && (graphs_.told_of_captures() || process_.told_of_captures()))
    return general_->malloc(size, stream, context);
  return malloc_routed(size, stream, context);
}

uintptr_t DevicePools::malloc_routed(size_t size, Stream stream, uint64_t context) {
  if (size == 0) return 0;
  if (graphs_.routing()) {
    heal_routes();  // a capture whose route was never ended stops counting as one
    bool routed = false;
    uintptr_t p = graphs_.malloc(size, stream, context, &routed);
    if (routed) return p;
  }
  // Without PyTorch's pool calls, each allocation asks whether its stream is capturing.
  if (!graphs_.told_of_captures() && !process_.told_of_captures()) {
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
  released += graphs_.reclaim();
  return released;
}

// A free of a general-pool block takes that pool's lock alone: no
// device-wide lock on the common path. One of a graph-pool block takes the
// graph pools' lock shared (graph_pools.h).
bool DevicePools::free(uintptr_t ptr, std::string* why, uint64_t context) {
  ipc::forget(index(), ptr);  // an export of its pages ends before they can be reused
  // The common path: no block is held for a graph, and a free into the
  // general pool maps and unmaps nothing, so it has no segment event to tell.
  if (!graph_any_.load(std::memory_order_acquire) && general_->try_free(ptr, context)) return true;
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  if (capture_free(ptr)) return true;
  if (general_->try_free(ptr, context)) return true;
  return free_other(ptr, why, context);
}

bool DevicePools::free_other(uintptr_t ptr, std::string* why, uint64_t context) {
  if (graphs_.free(ptr, context)) return true;
  try {
    general_->free(ptr, context);  // says what ptr is (a double free, a foreign pointer)
    return true;
  } catch (const InvalidPointerError& e) {
    *why = e.what();
    return false;
  }
}

bool DevicePools::record_stream(uintptr_t ptr, Stream stream, int device) {
  // Another device's stream is tagged with it: its events go to that device.
  stream = streams::on_device(stream, device, index());
  if (graphs_.record_stream(ptr, stream)) return true;
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
  return general_->segment_of(ptr, base, size) || buffers_->segment_of(ptr, base, size) ||
         graphs_.segment_of(ptr, base, size);
}

bool DevicePools::base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  return general_->base_allocation(ptr, base, size) || buffers_->base_allocation(ptr, base, size) ||
         graphs_.base_allocation(ptr, base, size);
}

uintptr_t DevicePools::malloc_buffer(size_t size, Stream stream) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  return buffers_->malloc(size, stream);
}

void DevicePools::free_buffer(uintptr_t ptr) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  ipc::forget(index(), ptr);
  buffers_->free(ptr);
}

bool DevicePools::share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why) {
  // Only the pool with a live allocation at ptr asks its backend (fills out).
  for (Allocator* pool : {general_.get(), buffers_.get()}) {
    if (pool->share(ptr, out, why)) return true;
    if (!out->empty()) return false;
  }
  if (graphs_.share(ptr, out, why)) return true;
  if (!out->empty()) return false;
  *why = "no pool of device " + std::to_string(index()) + " has a live allocation at " + format_ptr(ptr);
  return false;
}

// The capture window (graph_pools.h): a route's opening returns only once
// every pool of every device has finished the operation it was in, so that
// another thread's release or event query begun before the declaration
// cannot run into the capture. Each pool decides under its own lock whether
// it may touch the device; the calls made outside the pools' locks
// (cuMemGetInfo for an out-of-memory message or the cache info) go through
// the capture tracker (CaptureTracker::unless_underway).
void DevicePools::quiesce() const {
  general_->quiesce();
  buffers_->quiesce();
  graphs_.quiesce();
  device_->captures().drain();
}

size_t DevicePools::empty_cache() {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  // A capture may be underway from begin_allocate_to_pool on, before any of
  // its allocations has shown its stream: release nothing while a route is open.
  heal_routes();
  if (graphs_.capture_declared() || device_->captures().underway()) return 0;
  size_t released = general_->empty_cache() + buffers_->empty_cache();
  released += graphs_.reclaim();
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
  graphs_.for_each(fn);
}

void DevicePools::for_each_pool_units(const std::function<void(PoolId, Allocator&, const MappedUnits&)>& fn) {
  for_each_pool([&](PoolId id, Allocator& a) {
    fn(id, a, static_cast<const PoolBackend&>(a.backend()).units());  // every pool's backend is one
  });
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

void DevicePools::check_invariants() const {
  general_->check_invariants();
  buffers_->check_invariants();
  graphs_.check_invariants();
}

// ---------------------------------------------------------------------------
// Graph pools: PyTorch's calls, passed on (graph_pools.h)

void DevicePools::begin_allocate_to_pool(PoolId id, StreamFilter filter) {
  graphs_.begin_route(id, std::move(filter), process_.captures_marked());
}

void DevicePools::end_allocate_to_pool(PoolId id) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  graphs_.end_route(id);
  release_parked_everywhere();
}

void DevicePools::mark_capture(bool begin) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  if (graphs_.mark_capture(begin)) release_parked_everywhere();
}

void DevicePools::release_pool(PoolId id) {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
  // A route its last use ended may have been the last capture.
  if (graphs_.release(id)) release_parked_everywhere();
}

void DevicePools::create_or_incref_pool(PoolId id, SegmentSource source) {
  graphs_.create_or_incref(id, std::move(source));
}

void DevicePools::release_parked() {
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
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
  for (DevicePools* p : process_.all())
    if (p != this) release(p);
  ipc::unmap_deferred();  // memory of other processes closed during the capture
}

// ---------------------------------------------------------------------------
// CUDA graphs without PyTorch's pool calls
//
// Without those calls (a torch whose pluggable allocator lacks the setters),
// every allocation asks the device whether its stream is capturing, and a
// block allocated during a capture is held: when PyTorch frees it, it stays
// allocated in the general pool, to be reused only by a later allocation of
// the same rounded size in the same capture sequence (which the graph orders
// after the earlier use), until release_graph_memory() says the graphs are
// gone. Blocks named in record_stream() are never reused that way. The first
// route or MemPool on a device stops those queries for good.

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

bool DevicePools::capture_free_held(uintptr_t ptr) {
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
  TellQueuedSegments told;  // once this call's locks are released (segment_watch.h)
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
//
// The pools of a device count together, as PyTorch's one DeviceStats per
// device counts its private pools with the rest: each pool pushes its
// changes to the device's StatsSink at the end of every operation, so
// torch.cuda.memory_stats() reads one set of counts whose peaks are the
// device's own. Each graph pool's reserved bytes are also reported apart
// (pool_reserved(): PyTorch's reserved_bytes_by_private_pools).

Stats DevicePools::stats() const {
  Stats s = graphs_.device_stats({general_->stats(), buffers_->stats()});
  s.max_split_size = max_split_size_;
  return s;
}

void DevicePools::reset_peak_stats() {
  general_->reset_peak_stats();
  buffers_->reset_peak_stats();
  graphs_.reset_peak_stats();
  device_stats_.reset_peak();
}

void DevicePools::record_history(bool enabled, size_t max_entries) {
  bool on = enabled && max_entries > 0;
  general_->record_history(on, on ? max_entries : 0);
  buffers_->record_history(on, on ? max_entries : 0);
  graphs_.record_history(enabled, max_entries);
}

// ---------------------------------------------------------------------------
// Out of memory

OomReport DevicePools::oom_report(size_t request, bool rejected) const {
  OomReport r;
  r.device = index_;
  r.requested = request;
  r.rejected = rejected;
  Stats st = stats();
  r.allocated = static_cast<uint64_t>(st.allocated_bytes.all.current);
  r.reserved = static_cast<uint64_t>(st.reserved_bytes.all.current);
  size_t dev_free = 0, dev_total = 0;
  device_->mem_info(&dev_free, &dev_total);
  r.device_free = dev_free;
  r.device_total = dev_total;
  return r;
}

size_t DevicePools::PoolOom::release_elsewhere(Allocator& pool) {
  // Never for a graph pool: its route counts as a capture underway.
  if (!relieved_) return 0;
  // PyTorch's free-memory callbacks first, as its allocator runs them when no
  // cached block fits (it does so before it grows; the pools learn of a miss
  // only here, once their own cache is given back): the blocks they free come
  // back to these pools. Then graph pools with no use left and the other
  // pools' caches.
  bool freed = run_free_memory_hook();
  size_t released = pools_.release_others(pool);
  return released > 0 ? released : freed ? 1 : 0;  // nonzero: worth another try
}

// PyTorch's last resort before an out-of-memory error (DeviceCachingAllocator::
// malloc, use_on_oom_pools): an allocation routed to no pool takes a free
// block of a use_on_oom MemPool. Not for one routed to a pool ("if already
// trying to use a mempool, then just oom"), nor for the buffer pool's.
uintptr_t DevicePools::PoolOom::serve_elsewhere(Allocator& pool, const OomFailure& failure, uint64_t context) {
  if (&pool != pools_.general_.get()) return 0;
  return pools_.graphs_.malloc_on_oom(failure.request, failure.stream, context);
}

namespace {

std::mutex free_memory_mu;
FreeMemoryHook free_memory_fn = nullptr;
void* free_memory_user = nullptr;
thread_local bool inside_free_memory = false;

}  // namespace

void set_free_memory_hook(FreeMemoryHook fn, void* user) {
  std::lock_guard<std::mutex> g(free_memory_mu);
  free_memory_fn = fn;
  free_memory_user = user;
}

bool run_free_memory_hook() {
  FreeMemoryHook fn;
  void* user;
  {
    std::lock_guard<std::mutex> g(free_memory_mu);
    fn = free_memory_fn;
    user = free_memory_user;
  }
  if (fn == nullptr || inside_free_memory) return false;
  inside_free_memory = true;
  int freed = 0;
  try {
    freed = fn(user);
  } catch (...) {  // a C function pointer: nothing should cross it, but an out-of-memory path must not break
  }
  inside_free_memory = false;
  return freed != 0;
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

}  // namespace pyalloc
