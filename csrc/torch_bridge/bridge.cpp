// The bridge: pyalloc as PyTorch's CUDA allocator, answering every method of
// PyTorch's allocator interface (c10/cuda/CUDACachingAllocator.h,
// CUDAAllocator) from pyalloc's pools.
//
// It subclasses torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator
// (torch/csrc/cuda/CUDAPluggableAllocator.h, in every torch wheel) and is
// built against the installed torch by pyalloc/bridge.py with
// torch.utils.cpp_extension. The pools live in pyalloc._C; this library
// reaches them only through the C table of csrc/cuda/bridge_api.h, since the
// two may be built by different compilers with different C++ ABIs. So there
// is one set of pools per device in the process, shared with pyalloc's
// Python API.
//
// What the plain pluggable route (C hooks) cannot give and this does:
// cacheInfo (cuDNN benchmark mode), c10::OutOfMemoryError (which Python
// sees as torch.cuda.OutOfMemoryError and cuDNN's algorithm fallbacks
// catch), out-of-memory and OOM rejection observers, device stats read by
// torch itself (torch.cuda's and torch.accelerator's), snapshots, memory
// history and allocation tracebacks with PyTorch's recorded stack traces,
// private pools for CUDA graphs, MemPool and torch.compile's CUDA-graph
// trees, and cross-device copies with cudaMemcpyPeerAsync. The allocation
// path calls pyalloc directly: no std::function, mutex or pointer map of its
// own.
//
// PyTorch releases differ in this interface; the differences are handled
// with torch's version macros below. Checked against the headers of torch
// 2.9 to 2.14 (2.14.1 adds only virtuals with defaults: user metadata and
// memory annotations, which pyalloc's history does not record).
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/UniqueVoidPtr.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "cuda/bridge_api.h"
#include "torch_bridge/allocate.h"
#include "torch_bridge/segment_fields.h"

#define PYALLOC_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// getContextForPointer: a virtual of PyTorch's allocator interface from 2.12
// on (perhaps 2.11); before, the bridge's method of that name overrides nothing.
#if PYALLOC_TORCH_AT_LEAST(2, 12)
#define PYALLOC_OVERRIDE_SINCE_2_12 override
#else
#define PYALLOC_OVERRIDE_SINCE_2_12
#endif

#if !PYALLOC_TORCH_AT_LEAST(2, 9)
#error "pyalloc's bridge needs torch 2.9 or newer; install(bridge=False) uses the C hooks instead"
#endif

namespace pyalloc_bridge {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::GatheredContext;
using MempoolId = c10::cuda::MempoolId_t;

const pyalloc_bridge_api* api = nullptr;  // set once by install()

std::string last_error() { return api->last_error(); }

// An error from pyalloc as PyTorch's exception: out of memory as
// c10::OutOfMemoryError (torch.cuda.OutOfMemoryError in Python), the rest
// as c10::Error (RuntimeError). The message is pyalloc's own, read by the
// caller right after the failed call (the next call on this thread clears it).
[[noreturn]] void raise(int status, const std::string& msg) {
  if (status == PYALLOC_OUT_OF_MEMORY) TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  TORCH_CHECK(false, msg.rfind("pyalloc", 0) == 0 ? msg : "pyalloc: " + msg);
}

void check(int status) {
  if (status != PYALLOC_OK) raise(status, last_error());
}

// Whether this pyalloc._C's table has `member` (members appended to version 2).
#define PYALLOC_API_HAS(member) \
  (api->size >= offsetof(pyalloc_bridge_api, member) + sizeof(api->member) && api->member != nullptr)

// Whether this pyalloc._C fills `member` of pyalloc_segment_info (members appended to it).
#define PYALLOC_SEGMENT_INFO_HAS(member)                                                              \
  (api->size >= offsetof(pyalloc_bridge_api, segment_info_size) + sizeof(api->segment_info_size) && \
   api->segment_info_size >= offsetof(pyalloc_segment_info, member) + sizeof(pyalloc_segment_info::member))

// PyTorch's profiler (torch.profiler.profile(profile_memory=True), its memory
// timeline) hears of every allocation and free from PyTorch's own allocator:
// the pointer, the block's bytes (negative for a free), the device's
// allocated and reserved bytes after it, and the device. The bridge tells it
// the same, asking pyalloc for the figures only while it listens.
bool profiling_memory() { return c10::memoryProfilingEnabled() && PYALLOC_API_HAS(memory_usage); }

void tell_profiler_of_malloc(void* ptr, DeviceIndex device) {
  pyalloc_memory_usage block{};
  if (api->memory_usage(device, ptr, &block) != PYALLOC_OK || block.size == 0) return;
  c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(block.size), block.allocated,
                                   block.reserved, c10::Device(c10::DeviceType::CUDA, device));
}

// `block`: memory_usage's answer for ptr, asked before the free forgot it.
void tell_profiler_of_free(void* ptr, const pyalloc_memory_usage& block) {
  pyalloc_memory_usage after{};
  if (api->memory_usage(block.device, nullptr, &after) != PYALLOC_OK) return;
  auto device = static_cast<DeviceIndex>(block.device);
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(block.size), after.allocated,
                                   after.reserved, c10::Device(c10::DeviceType::CUDA, device));
}

// For callers that must not throw (deleters, destructors): said on stderr.
void report(int status, const char* what) {
  if (status != PYALLOC_OK) std::fprintf(stderr, "pyalloc: %s: %s\n", what, api->last_error());
}

// A callback of PyTorch's or a tracker's, called by pyalloc through its C
// table (often with a pool's lock held), failed: nothing may unwind into
// pyalloc, so it is caught, whatever it threw, and counted here. Said on
// stderr the first time and at each power of two, so that a callback failing
// on every event neither floods stderr nor goes unseen.
std::atomic<uint64_t> callback_failures{0};

void callback_failed(const std::string& what_failed, const char* why) {
  uint64_t n = callback_failures.fetch_add(1, std::memory_order_relaxed) + 1;
  if ((n & (n - 1)) != 0) return;
  std::fprintf(stderr, "pyalloc: %s: %s (%llu failure%s of PyTorch's callbacks so far)\n",
               what_failed.c_str(), why, static_cast<unsigned long long>(n), n == 1 ? "" : "s");
}

// Calls fn() as a callback pyalloc made; false if it threw (callback_failed()).
template <class F>
bool guard_callback(const char* what, F&& fn) {
  try {
    fn();
    return true;
  } catch (const std::exception& e) {
    callback_failed(std::string(what) + " failed", e.what());
  } catch (...) {
    callback_failed(std::string(what) + " failed", "an exception of unknown type");
  }
  return false;
}

[[noreturn]] void unsupported(const std::string& feature, const std::string& workaround) {
  TORCH_CHECK(false, "pyalloc does not support ", feature, ". ", workaround);
}

// ---------------------------------------------------------------------------
// Recorded contexts. PyTorch's recorder gives each allocation (and, with
// context "all", each free) a GatheredContext: its stack trace. pyalloc keeps
// a 64-bit tag instead, on the block and on history entries; this table maps
// tags to contexts. Contexts that no live block and no history entry holds
// any more are dropped now and then (every time the table has doubled).

class Contexts {
 public:
  uint64_t add(std::shared_ptr<GatheredContext> ctx) {
    if (!ctx) return 0;
    std::lock_guard<std::mutex> g(mu_);
    uint64_t tag = next_++;
    map_.emplace(tag, std::move(ctx));
    if (map_.size() >= prune_at_) prune_locked();
    return tag;
  }

  std::shared_ptr<GatheredContext> get(uint64_t tag) const {
    if (tag == 0) return nullptr;
    std::lock_guard<std::mutex> g(mu_);
    auto it = map_.find(tag);
    return it != map_.end() ? it->second : nullptr;
  }

 private:
  // The newest tags are kept whatever pyalloc says: their malloc or free may
  // still be on its way in on another thread.
  static constexpr uint64_t kInFlight = 4096;
  static constexpr size_t kMinPrune = 1 << 16;

  void prune_locked() {
    std::unordered_set<uint64_t> in_use;
    int status = api->contexts_in_use(
        [](void* user, uint64_t tag) { static_cast<std::unordered_set<uint64_t>*>(user)->insert(tag); },
        &in_use);
    if (status == PYALLOC_OK) {
      uint64_t recent = next_ > kInFlight ? next_ - kInFlight : 0;
      for (auto it = map_.begin(); it != map_.end();) {
        if (it->first < recent && in_use.count(it->first) == 0) it = map_.erase(it);
        else ++it;
      }
    }
    prune_at_ = std::max(2 * map_.size(), kMinPrune);
  }

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<GatheredContext>> map_;
  uint64_t next_ = 1;
  size_t prune_at_ = kMinPrune;
};

// ---------------------------------------------------------------------------
// The allocator

void delete_block(void* ptr);

class PyallocAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

  // The base class's own malloc / free (used by none of the methods below)
  // go to the same pools.
  PyallocAllocator()
      : Base([this](size_t size, int device, cudaStream_t stream) {
               return alloc(size, static_cast<DeviceIndex>(device), stream);
             },
             [](void* ptr, size_t, int, cudaStream_t) { delete_block(ptr); }) {}

  // -- allocation ----------------------------------------------------------

  void* alloc(size_t size, DeviceIndex device, cudaStream_t stream) {
    uint64_t tag = 0;
    if (recording(cca::RecordContext::STATE)) tag = contexts_.add(gather());
    void* out = nullptr;
    AllocFailure failure;
    int status = pyalloc_bridge::allocate(api, device, size, stream, tag, &out, &failure,
                                          [&](const AllocFailure& f) {
      // As PyTorch's allocator does, before its observers and the error.
      if (c10::memoryProfilingEnabled())
        c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(f.oom.requested), f.oom.allocated,
                                         f.oom.reserved, c10::Device(c10::DeviceType::CUDA, device));
      tell_observers(device, f.oom);
    });
    if (status != PYALLOC_OK) raise(failure.status, failure.message);
    if (out != nullptr && profiling_memory()) tell_profiler_of_malloc(out, device);
    return out;
  }

  // As PyTorch's allocator does, before the error. A request refused at once
  // (pyalloc counted it in num_oom_rejections) is what PyTorch's
  // throw_on_cudamalloc_oom refuses: its rejection observers get (device,
  // requested, total_allocated_memory, device total), where PyTorch's
  // total_allocated_memory is the bytes it holds from the driver, that is
  // reserved, not allocated to tensors. Then every out-of-memory observer
  // (the OOM dumps of torch.cuda.memory._record_memory_history among them)
  // gets (device, requested, device total, device free).
  void tell_observers(DeviceIndex device, const pyalloc_oom_info& oom) {
    std::vector<cca::OutOfMemoryObserver> observers;
#if PYALLOC_TORCH_AT_LEAST(2, 12)
    std::vector<cca::OomRejectionObserver> rejection_observers;
#endif
    {
      std::lock_guard<std::mutex> g(observers_mu_);
      observers = oom_observers_;
#if PYALLOC_TORCH_AT_LEAST(2, 12)
      if (oom.rejected) rejection_observers = rejection_observers_;
#endif
    }
#if PYALLOC_TORCH_AT_LEAST(2, 12)
    for (const auto& observer : rejection_observers)
      observer(device, oom.requested, oom.reserved, oom.device_total);
#endif
    for (const auto& observer : observers)
      observer(device, oom.requested, oom.device_total, oom.device_free);
  }

  void free_block(void* ptr, bool strict) {
    if (ptr == nullptr) return;
    uint64_t tag = 0;
    if (recording(cca::RecordContext::ALL)) tag = contexts_.add(gather());
    pyalloc_memory_usage block{};  // its bytes and device, for the profiler
    bool profiled = profiling_memory() && api->memory_usage(-1, ptr, &block) == PYALLOC_OK &&
                    block.size != 0;
    int status = api->free(ptr, tag);
    if (strict) check(status);
    else report(status, "freeing a block for PyTorch");
    if (status == PYALLOC_OK && profiled) tell_profiler_of_free(ptr, block);
  }

  c10::DataPtr allocate(size_t size) override {
    DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* ptr = size != 0 ? alloc(size, device, stream) : nullptr;
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void* raw_alloc(size_t nbytes) override {
    DeviceIndex device = c10::cuda::current_device();
    return alloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return alloc(nbytes, c10::cuda::current_device(), stream);
  }

  void raw_delete(void* ptr) override { free_block(ptr, true); }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Only memory pyalloc handed out, as PyTorch's allocator acts only on
    // its own deleter's. get_deleter() is never null: a storage that owns
    // nothing has c10::detail::deleteNothing (the outputs torch.compile's
    // CUDA-graph trees make over a live block of their pool, from_blob), and
    // an event recorded for it would pin the pool's block. Another deleter
    // may still be pyalloc's memory: reserve_buffer()'s tensors come through
    // DLPack; pyalloc tells those from the rest.
    if (ptr.get() == nullptr) return;
    c10::DeleterFnPtr deleter = ptr.get_deleter();
    int owner = deleter == &delete_block                                    ? PYALLOC_OWNER_POOLS
                : deleter == nullptr || deleter == &c10::detail::deleteNothing ? PYALLOC_OWNER_NONE
                                                                               : PYALLOC_OWNER_OTHER;
    if (owner == PYALLOC_OWNER_NONE) return;
    // With the stream's device: a default stream's handle (NULL) names each
    // device's own, and PyTorch records a use's event on the stream's device.
    check(api->record_stream_on(ptr.get(), stream.stream(), stream.device_index(), owner));
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
    uint64_t bytes = 0;
    void* base = api->base_alloc(ptr, &bytes);
    if (size != nullptr) *size = bytes;
    return base;
  }

  // -- set-up and limits ---------------------------------------------------

  void init(int device_count) override {
    check(api->init(device_count));
    initialized_ = true;
  }

  double getMemoryFraction(DeviceIndex device) override {
    double fraction = 1.0;
    check(api->memory_fraction(device, &fraction));
    return fraction;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    check(api->set_memory_fraction(device, fraction));
  }

  void emptyCache(MempoolId mempool_id) override {
    // A private pool's memory goes back as soon as it has no use and nothing
    // live (MemPool's destructor asks after releasing it): nothing to do.
    if (mempool_id.first != 0 || mempool_id.second != 0) return;
    check(api->empty_cache(-1));
  }

  void cacheInfo(DeviceIndex device, size_t* largestBlock) override {
    uint64_t largest = 0;
    check(api->cache_info(device, &largest));
    *largestBlock = largest;
  }

#if PYALLOC_TORCH_AT_LEAST(2, 10)
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex) override {
    return {};  // PyTorch's expandable segments: pyalloc has its own vmm strategy
  }
#endif

  // -- statistics ----------------------------------------------------------

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    pyalloc_device_stats s{};
    check(api->device_stats(device, &s));
    c10::CachingDeviceAllocator::DeviceStats out;
    auto stat = [](const pyalloc_stat& in, c10::CachingAllocator::Stat& o) {
      o.current = in.current;
      o.peak = in.peak;
      o.allocated = in.allocated;
      o.freed = in.freed;
    };
    auto array = [&](const pyalloc_stat_array& in, c10::CachingAllocator::StatArray& o) {
      using T = c10::CachingAllocator::StatType;
      stat(in.all, o[static_cast<size_t>(T::AGGREGATE)]);
      stat(in.small_pool, o[static_cast<size_t>(T::SMALL_POOL)]);
      stat(in.large_pool, o[static_cast<size_t>(T::LARGE_POOL)]);
    };
    array(s.allocation, out.allocation);
    array(s.segment, out.segment);
    array(s.active, out.active);
    array(s.inactive_split, out.inactive_split);
    array(s.allocated_bytes, out.allocated_bytes);
    array(s.reserved_bytes, out.reserved_bytes);
    array(s.active_bytes, out.active_bytes);
    array(s.inactive_split_bytes, out.inactive_split_bytes);
    array(s.requested_bytes, out.requested_bytes);
    stat(s.oversize_allocations, out.oversize_allocations);
    stat(s.oversize_segments, out.oversize_segments);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
#if PYALLOC_TORCH_AT_LEAST(2, 12)
    out.num_oom_rejections = s.num_oom_rejections;
#endif
#if PYALLOC_TORCH_AT_LEAST(2, 13)
    struct Pools {
      decltype(out.reserved_bytes_by_private_pools)* map;
      decltype(array)* convert;
    } pools{&out.reserved_bytes_by_private_pools, &array};
    check(api->pool_reserved(
        device,
        [](void* user, uint64_t id0, uint64_t id1, const pyalloc_stat_array* reserved) {
          auto* p = static_cast<Pools*>(user);
          (*p->convert)(*reserved, (*p->map)[MempoolId{id0, id1}]);
        },
        &pools));
#endif
    return out;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    check(api->reset_accumulated_stats(device));
  }

  void resetPeakStats(DeviceIndex device) override { check(api->reset_peak_stats(device)); }

  // -- snapshots and history -----------------------------------------------

#if PYALLOC_TORCH_AT_LEAST(2, 11)
  cca::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override {
    return make_snapshot(mempool_id, include_traces);
  }
#else
  cca::SnapshotInfo snapshot(MempoolId mempool_id) override { return make_snapshot(mempool_id, true); }
#endif

#if PYALLOC_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear,
                     const std::vector<std::string>& skip_actions) override {
    set_history(enabled, recorder, max_entries, when, clear, skip_actions);
  }
#else
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                     cca::RecordContext when, bool clear) override {
    set_history(enabled, recorder, max_entries, when, clear, {});
  }
#endif

  bool isHistoryEnabled() override { return history_on_.load(); }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mu_);
    oom_observers_.push_back(std::move(observer));
  }

#if PYALLOC_TORCH_AT_LEAST(2, 12)
  // PyTorch calls these when its throw_on_cudamalloc_oom policy refuses a
  // request before trying; pyalloc calls them for every request it refuses
  // at once from figures already known (tell_observers).
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mu_);
    rejection_observers_.push_back(std::move(observer));
  }
#endif

  // torch.cuda.memory._allocation_traceback: the context recorded when the
  // allocation starting at ptr was made (history on with context "state" or
  // more), or none. Declared without `override`: the hook came during 2.11's
  // development, and on a torch without it this is a method of our own.
  std::shared_ptr<GatheredContext> getContextForPointer(const void* ptr) PYALLOC_OVERRIDE_SINCE_2_12 {
    uint64_t tag = 0;
    if (api->block_context(const_cast<void*>(ptr), &tag) != PYALLOC_OK) return nullptr;
    return contexts_.get(tag);
  }

  // ProcessGroupNCCL's trackers (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1,
  // or a MemPool registered with a process group) register each
  // SEGMENT_ALLOC's range with NCCL and deregister it, by address, at its
  // SEGMENT_FREE. pyalloc tells them of the units the driver maps and unmaps
  // whole (segments; vmm's handles, moves included), each once usable and
  // again as it goes, in order, with no pool lock held
  // (csrc/cuda/segment_watch.h); and from the first
  // tracker on, snapshots list those units, which is what a new
  // communicator registers (its snapshot).
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    if (!PYALLOC_API_HAS(watch_segments) || !PYALLOC_API_HAS(snapshot_units))
      unsupported("allocator trace trackers (ProcessGroupNCCL registers one when "
                  "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) with this pyalloc._C",
                  "Rebuild pyalloc and its bridge from the same version (pyalloc bridge build).");
    {
      std::lock_guard<std::mutex> g(trackers_mu_);
      trackers_.push_back(std::move(tracker));
    }
    // Not under trackers_mu_: an event under way holds the watcher, and waits for it.
    std::call_once(watching_once_, [this] { check(api->watch_segments(&tell_trackers, this)); });
    watching_.store(true);
  }

  // With a pool's lock held in pyalloc: trackers must not allocate (as PyTorch
  // says of its own, called under its allocator's lock), nor throw into pyalloc.
  static void tell_trackers(void* user, int device, int mapped, uint64_t addr, uint64_t size,
                            const uint64_t* pool) noexcept {
    auto* self = static_cast<PyallocAllocator*>(user);
    // "an allocator trace tracker failed" is what test_gpu.py looks for on stderr.
    const char* what = mapped ? "telling the allocator trace trackers of a segment_alloc"
                              : "telling the allocator trace trackers of a segment_free";
    std::vector<cca::AllocatorTraceTracker> trackers;
    std::unique_ptr<cca::TraceEntry> te;
    bool ready = guard_callback(what, [&] {
      {
        std::lock_guard<std::mutex> g(self->trackers_mu_);
        trackers = self->trackers_;
      }
      te = std::make_unique<cca::TraceEntry>(
          mapped ? cca::TraceEntry::SEGMENT_ALLOC : cca::TraceEntry::SEGMENT_FREE,
          static_cast<DeviceIndex>(device), addr, size, nullptr, MempoolId{pool[0], pool[1]}, 0, nullptr);
    });
    if (!ready) return;
    for (const auto& t : trackers) {  // each tracker is told, whatever the others do
      auto failed = [&](const char* why) {
        char at[32];
        std::snprintf(at, sizeof(at), "0x%llx", static_cast<unsigned long long>(addr));
        callback_failed(std::string("an allocator trace tracker failed on ") +
                            (mapped ? "segment_alloc" : "segment_free") + " of " + std::to_string(size) +
                            " bytes at " + at,
                        why);
      };
      try {
        t(*te);
      } catch (const std::exception& e) {
        failed(e.what());
      } catch (...) {
        failed("an exception of unknown type");
      }
    }
  }

  // -- private pools: CUDA graphs, MemPool, torch.compile ------------------

  void beginAllocateToPool(DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
    auto kept = std::make_unique<std::function<bool(cudaStream_t)>>(std::move(filter));
    std::lock_guard<std::mutex> g(filters_mu_);
    check(api->begin_allocate_to_pool(
        device, id.first, id.second,
        [](void* user, void* stream) noexcept {
          // PyTorch's filters may throw (a CUDA error asking about a capture);
          // nothing may unwind into pyalloc: the stream is then not routed.
          int routed = 0;
          guard_callback("a private pool's stream filter", [&] {
            routed = (*static_cast<std::function<bool(cudaStream_t)>*>(user))(static_cast<cudaStream_t>(stream))
                         ? 1
                         : 0;
          });
          return routed;
        },
        kept.get()));
    // A pool has one route at a time in pyalloc, as in PyTorch's allocator (a
    // second begin raised above): a filter still kept for the pool is that of
    // a failed capture's route, which pyalloc dropped for this one.
    auto key = std::make_tuple(int(device), id.first, id.second);
    filters_.erase(key);
    filters_.emplace(key, std::move(kept));
  }

  void endAllocateToPool(DeviceIndex device, MempoolId id) override {
    std::lock_guard<std::mutex> g(filters_mu_);
    check(api->end_allocate_to_pool(device, id.first, id.second));
    filters_.erase(std::make_tuple(int(device), id.first, id.second));  // pyalloc calls them no more
  }

#if PYALLOC_TORCH_AT_LEAST(2, 13)
  // The capture itself, within the pool's route: counted as underway like
  // the route (csrc/cuda/capture.h). The member is appended to the table:
  // an older pyalloc._C lacks it, and the route alone then covers the capture.
  void markCaptureBegin(DeviceIndex device) override { mark_capture(device, 1); }
  void markCaptureEnd(DeviceIndex device) override { mark_capture(device, 0); }

  void mark_capture(DeviceIndex device, int begin) {
    if (!PYALLOC_API_HAS(mark_capture)) return;
    if (begin) check(api->mark_capture(device, 1));
    else report(api->mark_capture(device, 0), "ending a capture");  // in capture_end: never throws
  }
#endif

  void releasePool(DeviceIndex device, MempoolId id) override {
    // Runs in CUDA graphs' and MemPools' destructors: never throws.
    report(api->release_pool(device, id.first, id.second), "releasing a private pool");
  }

#if PYALLOC_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(DeviceIndex device, MempoolId id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    if (allocator != nullptr && allocator.get() != this) {
      // Kept once per allocator, not once per call: MemPools and their increfs
      // come and go for the process's life, their allocators are few.
      std::lock_guard<std::mutex> g(trackers_mu_);
      pool_allocators_.emplace(allocator.get(), allocator);  // the pool's segments go back to it
    }
    create_or_incref_pool(device, id, allocator.get());
  }
#else
  void createOrIncrefPool(DeviceIndex device, MempoolId id, cca::CUDAAllocator* allocator) override {
    create_or_incref_pool(device, id, allocator);
  }
#endif

  // A MemPool with an allocator of its own (ProcessGroupNCCL's mem_allocator,
  // over ncclMemAlloc): its pool's segments come from that allocator, as
  // PyTorch's allocator takes them (raw_alloc / raw_delete), and pyalloc
  // splits and caches them like any pool's. The allocator is kept alive by
  // the bridge for the process's life: the pool may outlive the MemPool.
  void create_or_incref_pool(DeviceIndex device, MempoolId id, cca::CUDAAllocator* allocator) {
    if (allocator == nullptr || allocator == this) {
      check(api->create_or_incref_pool(device, id.first, id.second));
      return;
    }
    if (!PYALLOC_API_HAS(create_or_incref_pool_with))
      unsupported("a torch.cuda.MemPool with an allocator of its own with this pyalloc._C",
                  "Rebuild pyalloc and its bridge from the same version (pyalloc bridge build).");
    check(api->create_or_incref_pool_with(device, id.first, id.second, &source_alloc, &source_free,
                                          allocator));
  }

  static int source_alloc(void* user, int device, uint64_t size, void** out) noexcept {
    *out = nullptr;
    bool out_of_memory = false;
    bool ok = guard_callback("a MemPool's allocator (raw_alloc)", [&] {
      try {
        c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
        *out = static_cast<cca::CUDAAllocator*>(user)->raw_alloc(size);  // nullptr: none left
      } catch (const c10::OutOfMemoryError&) {
        out_of_memory = true;  // none left: pyalloc's out-of-memory path, not a failure
      }
    });
    if (out_of_memory) *out = nullptr;
    return ok ? PYALLOC_OK : PYALLOC_ERROR;
  }

  static void source_free(void* user, int device, void* ptr, uint64_t) noexcept {
    guard_callback("a MemPool's allocator (raw_delete)", [&] {
      c10::cuda::CUDAGuard guard(static_cast<DeviceIndex>(device));
      static_cast<cca::CUDAAllocator*>(user)->raw_delete(ptr);
    });
  }

  // torch.cuda.MemPool(use_on_oom=True, no_split=True): MemPool's constructor
  // sets them once its pool exists; its destructor turns use_on_oom off
  // (never throws then) before it releases the pool.
#if PYALLOC_TORCH_AT_LEAST(2, 11)
  void setUseOnOOM(DeviceIndex device, MempoolId id, bool use_on_oom) override {
    set_use_on_oom(device, id, use_on_oom);
  }
#else
  void setUseOnOOM(DeviceIndex device, MempoolId id) override { set_use_on_oom(device, id, true); }
#endif

#if PYALLOC_TORCH_AT_LEAST(2, 10)
  void setNoSplit(DeviceIndex device, MempoolId id) override {
    if (!PYALLOC_API_HAS(set_pool_no_split))
      unsupported("a torch.cuda.MemPool whose blocks are never split (no_split=True) with this pyalloc._C",
                  "Rebuild pyalloc and its bridge from the same version (pyalloc bridge build).");
    check(api->set_pool_no_split(device, id.first, id.second));
  }
#endif

  void set_use_on_oom(DeviceIndex device, MempoolId id, bool use_on_oom) {
    if (!PYALLOC_API_HAS(set_pool_use_on_oom)) {
      if (!use_on_oom) return;  // nothing was set
      unsupported("a torch.cuda.MemPool used when the rest of the device is out of memory "
                  "(use_on_oom=True) with this pyalloc._C",
                  "Rebuild pyalloc and its bridge from the same version (pyalloc bridge build).");
    }
    if (use_on_oom) check(api->set_pool_use_on_oom(device, id.first, id.second, 1));
    else report(api->set_pool_use_on_oom(device, id.first, id.second, 0), "turning a MemPool's use_on_oom off");
  }

  int getPoolUseCount(DeviceIndex device, MempoolId id) override {
    int count = 0;
    check(api->pool_use_count(device, id.first, id.second, &count));
    return count;
  }

  bool checkPoolLiveAllocations(DeviceIndex device, MempoolId id,
                                const std::unordered_set<void*>& expected) override {
    std::unordered_set<void*> live;
    check(api->pool_live_blocks(
        device, id.first, id.second,
        [](void* user, uint64_t ptr) {
          static_cast<std::unordered_set<void*>*>(user)->insert(reinterpret_cast<void*>(ptr));
        },
        &live));
    return live == expected;
  }

  // torch.compile's CUDA-graph trees take a checkpoint of a private pool after
  // each recording and, when they switch paths, put the pool back to it: the
  // blocks live then are allocated again at their addresses, the others freed.
  struct PoolCheckpoint : cca::AllocatorState {
    DeviceIndex device = 0;
    MempoolId id{0, 0};
    std::vector<pyalloc_live_block> blocks;
  };

  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex device, MempoolId id) override {
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->id = id;
    check(api->pool_checkpoint(
        device, id.first, id.second,
        [](void* user, const pyalloc_live_block* b) {
          static_cast<std::vector<pyalloc_live_block>*>(user)->push_back(*b);
        },
        &state->blocks));
    return state;
  }

  cca::CheckpointDelta setCheckpointPoolState(DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override {
    auto* state = dynamic_cast<PoolCheckpoint*>(pps.get());
    TORCH_CHECK(state != nullptr && state->device == device,
                "pyalloc: this checkpoint was not taken by pyalloc on device ", device);
    struct Delta {
      cca::CheckpointDelta out;
      DeviceIndex device;
    } delta{{}, device};
    check(api->pool_restore(
        device, state->id.first, state->id.second, state->blocks.data(), state->blocks.size(),
        [](void* user, uint64_t ptr) {
          static_cast<Delta*>(user)->out.ptrs_freed.push_back(reinterpret_cast<void*>(ptr));
        },
        [](void* user, uint64_t ptr) {
          auto* d = static_cast<Delta*>(user);
          void* p = reinterpret_cast<void*>(ptr);
          d->out.dataptrs_allocd.emplace_back(p, p, &delete_block,
                                              c10::Device(c10::DeviceType::CUDA, d->device));
        },
        &delta));
    return std::move(delta.out);
  }

  // -- devices -------------------------------------------------------------

  // CUDA IPC (csrc/cuda/ipc.h): torch.multiprocessing's reductions call
  // shareIpcHandle(storage's pointer) in the sender and getIpcDevPtr(handle)
  // in the receiver, on the storage's device. A segment's handle is
  // PyTorch's own layout (a receiver with PyTorch's allocator opens it too);
  // pages of strategy vmm travel as file descriptors over pyalloc's socket.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    if (!PYALLOC_API_HAS(ipc_open)) unsupported_ipc();
    void* ptr = nullptr;
    check(api->ipc_open(c10::cuda::current_device(), handle.data(), handle.size(), &ptr));
    // The last storage over the mapping gone: one use less (the last unmaps).
    return std::shared_ptr<void>(
        ptr, [](void* p) { report(api->ipc_close(p), "closing CUDA memory of another process"); });
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    if (!PYALLOC_API_HAS(ipc_share)) unsupported_ipc();
    char buf[256];
    uint64_t length = 0, offset = 0;
    check(api->ipc_share(ptr, buf, sizeof(buf), &length, &offset));
    return cca::ShareableHandle{static_cast<ptrdiff_t>(offset), std::string(buf, length)};
  }

  [[noreturn]] void unsupported_ipc() {
    unsupported("CUDA IPC handles (sharing CUDA tensors between processes) with this pyalloc._C",
                "Rebuild pyalloc and its bridge from the same version (pyalloc bridge build).");
  }

  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    // pyalloc's pages are mapped for every peer that can access them already;
    // this turns on peer access for memory of other allocators too.
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    // Pages mapped with the virtual-memory API are no cudaMalloc memory:
    // without peer access, only cudaMemcpyPeerAsync copies them across devices.
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "pyalloc"; }

 private:
  bool recording(cca::RecordContext level) const {
    return history_on_.load(std::memory_order_relaxed) &&
           static_cast<int>(when_.load(std::memory_order_relaxed)) >= static_cast<int>(level);
  }

  std::shared_ptr<GatheredContext> gather() const {
    cca::CreateContextFn recorder = recorder_.load();
    return recorder != nullptr ? recorder() : nullptr;
  }

  void set_history(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                   cca::RecordContext when, bool clear, const std::vector<std::string>& skip) {
    {
      std::lock_guard<std::mutex> g(skip_mu_);
      skip_actions_ = std::set<std::string>(skip.begin(), skip.end());
    }
    recorder_.store(recorder);
    when_.store(when);
    check(api->record_history(enabled ? 1 : 0, enabled ? std::max<size_t>(max_entries, 1) : 0,
                              clear ? 1 : 0));
    history_on_.store(enabled);
  }

  cca::SnapshotInfo make_snapshot(MempoolId mempool_id, bool include_traces) {
    cca::SnapshotInfo result;
    struct Gather {
      PyallocAllocator* self;
      cca::SnapshotInfo* out;
    } gather_state{this, &result};
    uint64_t pool[2] = {mempool_id.first, mempool_id.second};
    bool every_pool = pool[0] == 0 && pool[1] == 0;
    // Once a tracker listens, the segments are the units it hears of.
    auto snapshot_fn = watching_.load() ? api->snapshot_units : api->snapshot;
    check(snapshot_fn(
        -1, every_pool ? nullptr : pool,
        [](void* user, const pyalloc_segment_info* s, const pyalloc_block_info* blocks, size_t n) {
          auto* st = static_cast<Gather*>(user);
          cca::SegmentInfo seg;
          seg.device = static_cast<DeviceIndex>(s->device);
          seg.address = s->address;
          seg.total_size = s->total_size;
          seg.requested_size = s->requested_size;
          seg.allocated_size = s->allocated_size;
          seg.active_size = s->active_size;
          seg.stream = static_cast<decltype(seg.stream)>(s->stream);
          seg.is_large = s->is_large != 0;
          seg.is_expandable = s->is_expandable != 0;
          seg.owner_private_pool_id = {s->pool_id[0], s->pool_id[1]};
          // Left at -1, registerMemPool (ProcessGroupNCCL.register_mem_pool) refuses the pool.
          if (PYALLOC_SEGMENT_INFO_HAS(registration_counter))
            set_registration_counter(seg, s->registration_counter);
          for (size_t i = 0; i < n; ++i) {
            cca::BlockInfo b;
            b.size = blocks[i].size;
            b.requested_size = blocks[i].requested_size;
            b.allocated = blocks[i].allocated != 0;
            b.active = blocks[i].active != 0;
            b.context_when_allocated = st->self->contexts_.get(blocks[i].context);
            seg.blocks.push_back(std::move(b));
          }
          st->out->segments.push_back(std::move(seg));
        },
        &gather_state));

    if (include_traces) {
      int devices = c10::cuda::device_count();
      result.device_traces.resize(devices);
      std::set<std::string> skip;
      {
        std::lock_guard<std::mutex> g(skip_mu_);
        skip = skip_actions_;
      }
      bool with_context = recording(cca::RecordContext::ALLOC);
      for (int d = 0; d < devices; ++d) {
        struct Trace {
          PyallocAllocator* self;
          std::vector<cca::TraceEntry>* out;
          const std::set<std::string>* skip;
          int device;
          bool with_context;
        } trace_state{this, &result.device_traces[d], &skip, d, with_context};
        check(api->history(
            d,
            [](void* user, const pyalloc_trace_entry* e) {
              auto* st = static_cast<Trace*>(user);
              static const std::pair<const char*, cca::TraceEntry::Action> kActions[] = {
                  {"alloc", cca::TraceEntry::ALLOC},
                  {"free_requested", cca::TraceEntry::FREE_REQUESTED},
                  {"free_completed", cca::TraceEntry::FREE_COMPLETED},
                  {"segment_alloc", cca::TraceEntry::SEGMENT_ALLOC},
                  {"segment_free", cca::TraceEntry::SEGMENT_FREE},
                  {"segment_map", cca::TraceEntry::SEGMENT_MAP},
                  {"segment_unmap", cca::TraceEntry::SEGMENT_UNMAP},
                  {"oom", cca::TraceEntry::OOM},
              };
              if (e->action < 0 || e->action >= 8) return;
              const auto& [name, action] = kActions[e->action];
              if (st->skip->count(name) != 0) return;
              cca::TraceEntry te(action, static_cast<DeviceIndex>(st->device), e->addr, e->size,
                                 static_cast<cudaStream_t>(e->stream),
                                 MempoolId{e->pool_id[0], e->pool_id[1]}, 0,
                                 st->with_context ? st->self->contexts_.get(e->context) : nullptr);
              te.time_.t_ = static_cast<time_t>(e->time_us);  // what PyTorch reports as time_us
              st->out->push_back(std::move(te));
            },
            &trace_state));
      }
    }

    // allocator_settings in the snapshot: pyalloc's, with the strategy in use.
    char settings[512] = {0};
    std::string text = api->settings(settings, sizeof(settings)) == PYALLOC_OK ? settings : "";
    cca::AllocatorConfigInfo& c = result.config_metadata;
    c = cca::AllocatorConfigInfo{};
    c.last_allocator_settings = "pyalloc: " + text;
    c.expandable_segments = text.find("strategy:vmm") != std::string::npos;
    pyalloc_device_stats stats{};
    if (api->device_stats(c10::cuda::current_device(), &stats) == PYALLOC_OK && stats.max_split_size > 0)
      c.max_split_size = static_cast<size_t>(stats.max_split_size);
    else
      c.max_split_size = SIZE_MAX;
    return result;
  }

  Contexts contexts_;
  std::atomic<bool> history_on_{false};
  std::atomic<cca::RecordContext> when_{cca::RecordContext::NEVER};
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::mutex skip_mu_;
  std::set<std::string> skip_actions_;

  std::mutex observers_mu_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if PYALLOC_TORCH_AT_LEAST(2, 12)
  std::vector<cca::OomRejectionObserver> rejection_observers_;
#endif

  std::mutex trackers_mu_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::once_flag watching_once_;
  std::atomic<bool> watching_{false};
  std::unordered_map<cca::CUDAAllocator*, std::shared_ptr<cca::CUDAAllocator>> pool_allocators_;

  std::mutex filters_mu_;
  std::map<std::tuple<int, uint64_t, uint64_t>, std::unique_ptr<std::function<bool(cudaStream_t)>>>
      filters_;
};

PyallocAllocator* instance = nullptr;  // the installed one (never destroyed)

void delete_block(void* ptr) {
  if (ptr != nullptr) instance->free_block(ptr, false);
}

// ---------------------------------------------------------------------------
// Installing

const pyalloc_bridge_api* find_api(const std::string& pyalloc_library) {
  // pyalloc._C is loaded already (Python imported it): the same handle, the same pools.
  void* lib = dlopen(pyalloc_library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  TORCH_CHECK(lib != nullptr, "pyalloc's bridge: ", pyalloc_library,
              " is not loaded in this process (import pyalloc first)");
  auto get = reinterpret_cast<pyalloc_bridge_api_get_fn>(dlsym(lib, PYALLOC_BRIDGE_API_SYMBOL));
  TORCH_CHECK(get != nullptr, "pyalloc's bridge: ", pyalloc_library, " has no ",
              PYALLOC_BRIDGE_API_SYMBOL, "; pyalloc and its bridge are from different versions");
  const pyalloc_bridge_api* table = get(PYALLOC_BRIDGE_API_VERSION);
  TORCH_CHECK(table != nullptr && table->size >= sizeof(pyalloc_bridge_api),
              "pyalloc's bridge needs version ", PYALLOC_BRIDGE_API_VERSION,
              " of pyalloc's C interface, which this pyalloc does not offer; rebuild the "
              "bridge (pyalloc bridge build)");
  return table;
}

// changeCurrentAllocator swaps only the pointer torch.cuda's calls go
// through. torch.accelerator's (memory_stats, memory_allocated, empty_cache)
// and everything else that asks c10::GetAllocator(kCUDA) find the allocator
// registered for the device type, which libc10_cuda's static initializer set
// to its own with priority 0. The same priority replaces it (an equal one
// wins) and leaves a later installer of torch's able to replace pyalloc, as
// changeCurrentAllocator does. pyalloc is never uninstalled (PyTorch's
// allocator cannot be swapped back once CUDA is in use), so nothing is put
// back. An allocator registered with a higher priority keeps the place: then
// torch.accelerator's calls do not reach pyalloc, and the user is told.
void register_for_device_type(PyallocAllocator* allocator) {
  c10::SetAllocator(c10::DeviceType::CUDA, allocator, /*priority=*/0);
  if (c10::GetAllocator(c10::DeviceType::CUDA) != allocator)
    TORCH_WARN("pyalloc: another CUDA allocator is registered for the device type with a higher "
               "priority; torch.accelerator's memory functions will not reach pyalloc (torch.cuda's "
               "do)");
}

// PyTorch's allocator runs every callback of FreeCudaMemoryCallbacksRegistry
// when no cached block fits: torch's own, "cuda_ipc_collect", frees the
// blocks sent to other processes that every receiver has let go (what
// torch.cuda.ipc_collect() frees). pyalloc runs them on its out-of-memory
// path, with none of its locks held (their frees come back through free()),
// and tries once more when one freed memory. Nothing may cross the C table.
int free_memory_callbacks(void*) noexcept {
  bool freed = false;
  guard_callback("a free-memory callback of PyTorch's (FreeCudaMemoryCallbacksRegistry)", [&] {
    for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys())
      freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
  });
  return freed ? 1 : 0;
}

void install(const std::string& pyalloc_library) {
  TORCH_CHECK(instance == nullptr, "pyalloc's bridge is installed already");
  api = find_api(pyalloc_library);
  auto allocator = std::make_shared<PyallocAllocator>();
  // Throws "Can't swap an already initialized allocator" once CUDA is in use.
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  instance = allocator.get();  // PyTorch keeps the shared_ptr for the process's life
  register_for_device_type(instance);
  check(api->set_free_memory_hook(&free_memory_callbacks, nullptr));  // only once PyTorch's pools are pyalloc's
  check(api->set_route(2));
#if PYALLOC_TORCH_AT_LEAST(2, 13)
  // PyTorch marks each capture (markCaptureBegin/End, passed on above): a
  // pool route alone, as use_mem_pool makes, is then no capture.
  if (PYALLOC_API_HAS(set_captures_marked)) check(api->set_captures_marked(1));
#endif
}

}  // namespace
}  // namespace pyalloc_bridge

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyalloc's bridge to PyTorch's CUDA allocator interface (csrc/torch_bridge/).";
  m.def("install", &pyalloc_bridge::install, pybind11::arg("pyalloc_library"),
        "Makes pyalloc PyTorch's CUDA allocator through the bridge; pyalloc_library is the "
        "file of pyalloc._C. Raises RuntimeError once CUDA is initialized.");
  m.attr("api_version") = PYALLOC_BRIDGE_API_VERSION;
  m.attr("torch_version") = TORCH_VERSION;
}
