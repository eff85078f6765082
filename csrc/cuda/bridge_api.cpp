// The C interface of bridge_api.h over the pools of registry.h and cuda_pools.h.
//
// Each function catches every exception and turns it into a status and a
// per-thread message: nothing C++ crosses into the bridge, which may be
// built with another compiler and C++ ABI.
#include "bridge_api.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "registry.h"
#include "ipc.h"
#include "oom_observers.h"
#include "segment_watch.h"
#include "streams.h"

#define PYALLOC_EXPORT extern "C" __attribute__((visibility("default")))

namespace pyalloc {
namespace {

thread_local std::string last_error_message;

// A handle as the pools know it, and back (streams.h): cudaStreamPerThread
// is the calling thread's own.
Stream stream_of(void* s) { return streams::from_handle(reinterpret_cast<uintptr_t>(s)); }
void* stream_ptr(Stream s) { return reinterpret_cast<void*>(streams::handle(s)); }
uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
PoolRegistry& registry() { return PoolRegistry::instance(); }

// Runs f; any exception becomes a status, its message the thread's last error.
template <class F>
int guarded(F&& f) noexcept {
  try {
    f();
    last_error_message.clear();
    return PYALLOC_OK;
  } catch (const OutOfMemoryError& e) {
    last_error_message = e.what();
    return PYALLOC_OUT_OF_MEMORY;
  } catch (const std::invalid_argument& e) {  // InvalidPointerError too
    last_error_message = e.what();
    return PYALLOC_INVALID;
  } catch (const std::exception& e) {
    last_error_message = e.what();
    return PYALLOC_ERROR;
  } catch (...) {
    last_error_message = "pyalloc: unknown error";
    return PYALLOC_ERROR;
  }
}

// The pools of `device`, or an exception naming it. With create false, null
// while the device has none (nothing to report, nothing to do).
DevicePools* pools_of(int device, bool create) {
  if (device < 0 || device >= PoolRegistry::kMaxDevices)
    throw std::invalid_argument("invalid CUDA device index " + std::to_string(device));
  return create ? &registry().get(device) : registry().find(device);
}

// The devices a call with `device` is about: one, or every one with pools (-1).
std::vector<DevicePools*> devices_of(int device) {
  if (device == -1) return registry().all();
  DevicePools* p = pools_of(device, false);
  return p != nullptr ? std::vector<DevicePools*>{p} : std::vector<DevicePools*>{};
}

// Steady-clock microseconds (the history's clock) to the Unix epoch.
int64_t epoch_offset_us() {
  using namespace std::chrono;
  int64_t sys = duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
  int64_t steady = duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
  return sys - steady;
}

pyalloc_stat to_c(const Stat& s) { return pyalloc_stat{s.current, s.peak, s.allocated, s.freed}; }
pyalloc_stat_array to_c(const StatArray& a) {
  return pyalloc_stat_array{to_c(a.all), to_c(a.small), to_c(a.large)};
}

// ---------------------------------------------------------------------------
// The table's functions

const char* api_last_error() { return last_error_message.c_str(); }

int api_malloc(int device, uint64_t size, void* stream, uint64_t context, void** out,
               pyalloc_oom_info* oom) {
  *out = nullptr;
  return guarded([&] {
    try {
      *out = reinterpret_cast<void*>(hooks::malloc(size, device, stream_of(stream), context));
    } catch (const OutOfMemoryError& e) {
      // The figures pyalloc's observers were told: PyTorch's hear the same.
      if (oom != nullptr) {
        OomReport r = report_of(e, device, size);
        *oom = pyalloc_oom_info{r.requested, r.allocated, r.reserved, r.device_free, r.device_total,
                                r.rejected ? 1 : 0};
      }
      throw;
    }
  });
}

// Version 1's pyalloc_oom_info ends before `rejected`: a bridge of version 1
// gives room for no more.
int api_malloc_v1(int device, uint64_t size, void* stream, uint64_t context, void** out,
                  pyalloc_oom_info* oom) {
  pyalloc_oom_info full{};
  int status = api_malloc(device, size, stream, context, out, oom != nullptr ? &full : nullptr);
  if (oom != nullptr && status == PYALLOC_OUT_OF_MEMORY)
    std::memcpy(oom, &full, offsetof(pyalloc_oom_info, rejected));
  return status;
}

int api_free(void* ptr, uint64_t context) {
  return guarded([&] {
    std::string why;
    if (!hooks::free_checked(addr(ptr), -1, context, &why)) throw InvalidPointerError(why);
  });
}

int api_record_stream(void* ptr, void* stream) {
  return guarded([&] { hooks::record_stream(addr(ptr), stream_of(stream)); });
}

int api_record_stream_on(void* ptr, void* stream, int device, int owner) {
  return guarded([&] {
    if (ptr == nullptr || owner == PYALLOC_OWNER_NONE) return;
    if (owner == PYALLOC_OWNER_POOLS) {
      for (DevicePools* p : registry().all())
        if (p->record_stream(addr(ptr), stream_of(stream), device)) return;
      throw std::invalid_argument("record_stream(" + format_ptr(addr(ptr)) +
                                  "): no live allocation of pyalloc's is there, though the storage "
                                  "has pyalloc's deleter");
    }
    if (owner != PYALLOC_OWNER_OTHER)
      throw std::invalid_argument("record_stream: unknown owner " + std::to_string(owner));
    // Of memory with another deleter, only reserve_buffer()'s tensors (DLPack)
    // are pyalloc's; the rest (other libraries', from_blob) is left alone.
    uintptr_t base;
    size_t size;
    for (DevicePools* p : registry().all()) {
      Allocator& buffers = p->buffers();
      if (!buffers.segment_of(addr(ptr), &base, &size)) continue;
      size_t requested;
      Stream s;
      if (buffers.live_block(addr(ptr), &requested, &s))
        buffers.record_stream(addr(ptr), streams::on_device(stream_of(stream), device, p->index()));
      return;
    }
  });
}

int api_record_stream_owned(void* ptr, void* stream, int owner) { return api_record_stream_on(ptr, stream, -1, owner); }

int api_block_context(void* ptr, uint64_t* context) {
  return guarded([&] {
    *context = 0;
    if (ptr == nullptr) return;
    size_t requested;
    Stream s;
    for (DevicePools* p : registry().all()) {
      bool found = false;
      p->for_each_pool([&](DevicePools::PoolId, Allocator& a) {
        if (!found) found = a.live_block(addr(ptr), &requested, &s, context);
      });
      if (found) return;
    }
  });
}

int api_memory_usage(int device, void* ptr, pyalloc_memory_usage* out) {
  return guarded([&] {
    *out = pyalloc_memory_usage{device, 0, 0, 0};
    if (ptr != nullptr) {
      // Asked about one device: its pools alone (the profiler asks at every malloc and free).
      for (DevicePools* p : devices_of(device)) {
        Allocator::LiveBlockInfo info;
        bool found = false;
        p->for_each_pool([&](DevicePools::PoolId, Allocator& a) {
          if (!found) found = a.live_block_info(addr(ptr), &info);
        });
        if (!found) continue;
        out->device = p->index();
        out->size = info.size;
        break;
      }
    }
    int of = device == -1 ? out->device : device;
    if (of == -1) return;  // no allocation at ptr, and no device asked about
    if (DevicePools* p = pools_of(of, false)) {
      Stats s = p->stats();
      out->allocated = static_cast<uint64_t>(s.allocated_bytes.all.current);
      out->reserved = static_cast<uint64_t>(s.reserved_bytes.all.current);
    }
  });
}

void* api_base_alloc(void* ptr, uint64_t* size) {
  size_t bytes = 0;
  uintptr_t base = hooks::base_alloc(addr(ptr), &bytes);
  if (size != nullptr) *size = bytes;  // 0 where pyalloc has no segment at ptr
  return reinterpret_cast<void*>(base);
}

int api_empty_cache(int device) {
  return guarded([&] {
    for (DevicePools* p : devices_of(device)) p->empty_cache();
  });
}

int api_set_memory_fraction(int device, double fraction) {
  return guarded([&] { pools_of(device, true)->set_memory_fraction(fraction); });
}

int api_memory_fraction(int device, double* out) {
  return guarded([&] {
    DevicePools* p = pools_of(device, false);
    *out = p != nullptr ? p->memory_fraction() : 1.0;
  });
}

int api_cache_info(int device, uint64_t* largest) {
  return guarded([&] { *largest = pools_of(device, true)->cache_info(); });
}

int api_device_stats(int device, pyalloc_device_stats* out) {
  return guarded([&] {
    DevicePools* p = pools_of(device, false);
    Stats s;
    if (p != nullptr) s = p->stats();
    else s.max_split_size = -1;  // PyTorch's "no limit"
    *out = pyalloc_device_stats{
        to_c(s.allocation),      to_c(s.segment),        to_c(s.active),
        to_c(s.inactive_split),  to_c(s.allocated_bytes), to_c(s.reserved_bytes),
        to_c(s.active_bytes),    to_c(s.inactive_split_bytes), to_c(s.requested_bytes),
        to_c(s.oversize_allocations), to_c(s.oversize_segments),
        s.num_alloc_retries,     s.num_ooms,             s.num_sync_all_streams,
        s.num_device_alloc,      s.num_device_free,      s.num_oom_rejections,
        s.max_split_size};
  });
}

int api_reset_peak_stats(int device) {
  return guarded([&] {
    if (DevicePools* p = pools_of(device, false)) p->reset_peak_stats();
  });
}

int api_reset_accumulated_stats(int device) {
  return guarded([&] {
    if (DevicePools* p = pools_of(device, false)) p->reset_accumulated_stats();
  });
}

int api_pool_reserved(int device, pyalloc_pool_stat_fn fn, void* user) {
  return guarded([&] {
    DevicePools* p = pools_of(device, false);
    if (p == nullptr) return;
    for (const auto& [id, reserved] : p->pool_reserved()) {
      pyalloc_stat_array r = to_c(reserved);
      fn(user, id.first, id.second, &r);
    }
  });
}

// One pool of a device as both snapshots (by segment, by mapped unit) read it: gathered
// first, so that their callbacks run with no lock of pyalloc's held.
struct GatheredPool {
  DevicePools::PoolId id;
  std::vector<SnapshotSegment> segments;
  std::vector<int64_t> counters;  // each segment's registration_counter
  std::vector<MappedUnit> units;
};

// The pools of one device, or the one pool_id names (when not null).
std::vector<GatheredPool> gather_pools(DevicePools* p, const uint64_t* pool_id) {
  std::vector<GatheredPool> all;
  p->for_each_pool_units([&](DevicePools::PoolId id, Allocator& a, const MappedUnits& units) {
    if (pool_id != nullptr && (pool_id[0] != id.first || pool_id[1] != id.second)) return;
    GatheredPool pool{id, a.snapshot(), {}, units.list()};
    for (const SnapshotSegment& s : pool.segments) pool.counters.push_back(units.counter_at(s.address));
    all.push_back(std::move(pool));
  });
  return all;
}

// A snapshot block as the C table gives it: the core's state names mapped to the flags.
pyalloc_block_info block_info(const SnapshotBlock& b) {
  bool allocated = std::strcmp(b.state, "active_allocated") == 0;
  bool active = allocated || std::strcmp(b.state, "active_pending_free") == 0;
  return pyalloc_block_info{b.size, b.requested, allocated, active, b.context};
}

int api_snapshot(int device, const uint64_t* pool_id, pyalloc_segment_fn fn, void* user) {
  return guarded([&] {
    for (DevicePools* p : devices_of(device)) {
      std::vector<pyalloc_block_info> blocks;
      for (const GatheredPool& pool : gather_pools(p, pool_id)) {
        for (size_t i = 0; i < pool.segments.size(); ++i) {
          const SnapshotSegment& s = pool.segments[i];
          pyalloc_segment_info info{p->index(),    s.address,         s.total_size,
                                    s.allocated_size, s.active_size,   s.requested_size,
                                    stream_ptr(s.stream), s.pool == kLargePool, s.expandable,
                                    {pool.id.first, pool.id.second}, pool.counters[i]};
          blocks.clear();
          for (const SnapshotBlock& b : s.blocks) blocks.push_back(block_info(b));
          fn(user, &info, blocks.data(), blocks.size());
        }
      }
    }
  });
}

int api_history(int device, pyalloc_trace_fn fn, void* user) {
  return guarded([&] {
    DevicePools* p = pools_of(device, false);
    if (p == nullptr) return;
    std::vector<std::pair<TraceEntry, DevicePools::PoolId>> events;
    p->for_each_pool([&](DevicePools::PoolId id, Allocator& a) {
      for (const TraceEntry& e : a.history()) events.emplace_back(e, id);
    });
    // Each pool's history is in order; together, by time (ties keep pool order).
    std::stable_sort(events.begin(), events.end(), [](const auto& a, const auto& b) {
      return a.first.time_us < b.first.time_us;
    });
    int64_t offset = epoch_offset_us();
    for (const auto& [e, id] : events) {
      pyalloc_trace_entry out{static_cast<int>(e.action), e.addr, e.size, stream_ptr(e.stream),
                              e.time_us + offset, e.context, {id.first, id.second}};
      fn(user, &out);
    }
  });
}

int api_record_history(int enabled, uint64_t max_entries, int clear) {
  return guarded([&] {
    if (enabled && max_entries == 0) throw std::invalid_argument("max_entries must be positive");
    registry().record_history(enabled != 0, enabled ? max_entries : 0);
    if (clear)
      for (DevicePools* p : registry().all())
        p->for_each_pool([](DevicePools::PoolId, Allocator& a) { a.clear_history(); });
  });
}

int api_contexts_in_use(pyalloc_value_fn fn, void* user) {
  return guarded([&] {
    std::vector<uint64_t> tags;
    for (DevicePools* p : registry().all())
      p->for_each_pool([&](DevicePools::PoolId, Allocator& a) { a.contexts_in_use(&tags); });
    std::sort(tags.begin(), tags.end());
    tags.erase(std::unique(tags.begin(), tags.end()), tags.end());
    for (uint64_t t : tags) fn(user, t);
  });
}

int api_begin_allocate_to_pool(int device, uint64_t id0, uint64_t id1,
                               pyalloc_stream_filter_fn filter, void* user) {
  return guarded([&] {
    DevicePools::StreamFilter accepts;
    if (filter != nullptr)
      accepts = [filter, user](Stream s) { return filter(user, stream_ptr(s)) != 0; };
    else
      accepts = [](Stream) { return true; };
    hooks::begin_allocate_to_pool(device, {id0, id1}, std::move(accepts));
  });
}

int api_end_allocate_to_pool(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] {
    if (DevicePools* p = pools_of(device, false)) p->end_allocate_to_pool({id0, id1});
  });
}

int api_release_pool(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] {
    if (DevicePools* p = pools_of(device, false)) p->release_pool({id0, id1});
  });
}

int api_create_or_incref_pool(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] { pools_of(device, true)->create_or_incref_pool({id0, id1}); });
}

// A device without pools has no graph pool either.
GraphPools& graph_pools_holding(int device, DevicePools::PoolId id) {
  DevicePools* p = pools_of(device, false);
  if (p == nullptr) throw GraphPools::no_such_pool(id);
  return p->graphs();
}

int api_pool_use_count(int device, uint64_t id0, uint64_t id1, int* out) {
  return guarded([&] { *out = graph_pools_holding(device, {id0, id1}).use_count({id0, id1}); });
}

int api_set_pool_use_on_oom(int device, uint64_t id0, uint64_t id1, int use_on_oom) {
  return guarded([&] {
    if (use_on_oom != 0) graph_pools_holding(device, {id0, id1}).set_use_on_oom({id0, id1}, true);
    else if (DevicePools* p = pools_of(device, false)) p->graphs().set_use_on_oom({id0, id1}, false);
  });
}

int api_set_pool_no_split(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] { graph_pools_holding(device, {id0, id1}).set_no_split({id0, id1}); });
}

int api_pool_live_blocks(int device, uint64_t id0, uint64_t id1, pyalloc_value_fn fn, void* user) {
  return guarded([&] {
    for (uintptr_t b : graph_pools_holding(device, {id0, id1}).live_blocks({id0, id1})) fn(user, b);
  });
}

int api_pool_checkpoint(int device, uint64_t id0, uint64_t id1, pyalloc_live_block_fn fn,
                        void* user) {
  return guarded([&] {
    DevicePools* p = pools_of(device, false);
    if (p == nullptr) return;
    for (const GraphPools::LiveBlock& b : p->graphs().checkpoint({id0, id1})) {
      pyalloc_live_block out{b.ptr, b.size, stream_ptr(b.stream)};
      fn(user, &out);
    }
  });
}

int api_pool_restore(int device, uint64_t id0, uint64_t id1, const pyalloc_live_block* blocks,
                     uint64_t num_blocks, pyalloc_value_fn freed_fn, pyalloc_value_fn allocated_fn,
                     void* user) {
  return guarded([&] {
    std::vector<GraphPools::LiveBlock> wanted;
    for (uint64_t i = 0; i < num_blocks; ++i)
      wanted.push_back({blocks[i].ptr, blocks[i].size, stream_of(blocks[i].stream)});
    std::vector<uintptr_t> freed, allocated;
    pools_of(device, true)->graphs().restore({id0, id1}, wanted, &freed, &allocated);
    for (uintptr_t ptr : freed) freed_fn(user, ptr);
    for (uintptr_t ptr : allocated) allocated_fn(user, ptr);
  });
}

int api_init(int device_count) {
  return guarded([&] { hooks::init(device_count); });
}

int api_set_route(int route) {
  return guarded([&] {
    if (route < PoolRegistry::kNotInstalled || route > PoolRegistry::kBridge)
      throw std::invalid_argument("unknown route " + std::to_string(route));
    registry().set_route(static_cast<PoolRegistry::Route>(route));
  });
}

int api_settings(char* buf, uint64_t len) {
  return guarded([&] {
    Config c = registry().config();
    // The strategy in use: bestfit where a device's pools could not use vmm.
    for (DevicePools* p : registry().all())
      if (p->general().config().strategy != c.strategy) c.strategy = p->general().config().strategy;
    std::string text = c.to_string();
    if (len == 0 || text.size() >= len)
      throw std::invalid_argument("a buffer of " + std::to_string(text.size() + 1) +
                                  " bytes is needed for the settings");
    std::memcpy(buf, text.c_str(), text.size() + 1);
  });
}

int api_mark_capture(int device, int begin) {
  return guarded([&] { hooks::mark_capture(device, begin != 0); });
}

int api_set_captures_marked(int marked) {
  return guarded([&] { registry().set_captures_marked(marked != 0); });
}

int api_ipc_share(void* ptr, char* buf, uint64_t capacity, uint64_t* length, uint64_t* offset) {
  *length = 0;
  *offset = 0;
  return guarded([&] {
    std::string handle;
    std::string why = "pyalloc cannot share " + format_ptr(addr(ptr)) + ": no pool of pyalloc's holds it";
    bool found = false;
    for (DevicePools* p : registry().all()) {
      if (!p->may_hold(addr(ptr))) continue;
      try {
        handle = ipc::share(*p, addr(ptr), offset);
        found = true;
        break;
      } catch (const std::invalid_argument& e) {  // not this device's: another may hold it
        why = e.what();
      }
    }
    if (!found) throw std::invalid_argument(why);
    *length = handle.size();
    if (handle.size() > capacity)
      throw std::invalid_argument("pyalloc: a CUDA IPC handle of " + std::to_string(handle.size()) +
                                  " bytes does not fit in " + std::to_string(capacity));
    std::memcpy(buf, handle.data(), handle.size());
  });
}

int api_ipc_open(int device, const char* handle, uint64_t length, void** out) {
  *out = nullptr;
  return guarded([&] {
    if (device < 0 || device >= PoolRegistry::kMaxDevices)
      throw std::invalid_argument("invalid CUDA device index " + std::to_string(device));
    *out = reinterpret_cast<void*>(ipc::open(device, std::string(handle, length)));
  });
}

int api_ipc_close(void* ptr) {
  return guarded([&] { ipc::close(addr(ptr)); });
}

struct SegmentWatch {
  pyalloc_segment_event_fn fn;
  void* user;
};

int api_set_free_memory_hook(pyalloc_free_memory_fn fn, void* user) {
  return guarded([&] { set_free_memory_hook(fn, user); });
}

int api_watch_segments(pyalloc_segment_event_fn fn, void* user) {
  return guarded([&] {
    static SegmentWatch watch{nullptr, nullptr};  // read by the watcher; set only here
    if (fn == nullptr) {
      watch_segments(nullptr, nullptr);
      return;
    }
    watch_segments(nullptr, nullptr);  // waits for calls under way before `watch` changes
    watch = SegmentWatch{fn, user};
    watch_segments(
        [](void* w, const SegmentEvent& e) {
          auto* sw = static_cast<SegmentWatch*>(w);
          uint64_t pool[2] = {e.pool.first, e.pool.second};
          sw->fn(sw->user, e.device, e.mapped ? 1 : 0, e.addr, e.size, pool);
        },
        &watch);
  });
}

// A block of a snapshot with its address, for cutting at units' edges.
struct PlacedBlock {
  uintptr_t addr;
  pyalloc_block_info info;
  const SnapshotSegment* segment;
};

int api_snapshot_units(int device, const uint64_t* pool_id, pyalloc_segment_fn fn, void* user) {
  return guarded([&] {
    for (DevicePools* p : devices_of(device)) {
      for (const GatheredPool& pool : gather_pools(p, pool_id)) {
        std::vector<PlacedBlock> placed;
        for (const SnapshotSegment& s : pool.segments)
          for (const SnapshotBlock& b : s.blocks) placed.push_back(PlacedBlock{b.addr, block_info(b), &s});
        std::sort(placed.begin(), placed.end(),
                  [](const PlacedBlock& a, const PlacedBlock& b) { return a.addr < b.addr; });
        std::vector<uint64_t> requested_left(placed.size());
        for (size_t i = 0; i < placed.size(); ++i) requested_left[i] = placed[i].info.requested_size;
        std::vector<pyalloc_block_info> blocks;
        for (const MappedUnit& unit : pool.units) {
          uintptr_t lo = unit.addr, hi = unit.addr + unit.size;
          pyalloc_segment_info info{p->index(), lo, unit.size, 0, 0, 0, nullptr, 1, 0,
                                    {pool.id.first, pool.id.second}, unit.counter};
          blocks.clear();
          uintptr_t at = lo;
          auto first = std::upper_bound(placed.begin(), placed.end(), lo,
                                        [](uintptr_t a, const PlacedBlock& b) { return a < b.addr; });
          if (first != placed.begin()) --first;
          bool seen_segment = false;
          for (auto it = first; it != placed.end() && it->addr < hi; ++it) {
            uintptr_t b_lo = std::max<uintptr_t>(it->addr, lo);
            uintptr_t b_hi = std::min<uintptr_t>(it->addr + it->info.size, hi);
            if (b_lo >= b_hi) continue;
            if (b_lo > at) blocks.push_back(pyalloc_block_info{b_lo - at, 0, 0, 0, 0});  // not in the snapshot
            pyalloc_block_info piece = it->info;
            piece.size = b_hi - b_lo;
            uint64_t& left = requested_left[it - placed.begin()];
            piece.requested_size = std::min<uint64_t>(left, piece.size);
            left -= piece.requested_size;
            blocks.push_back(piece);
            info.allocated_size += piece.allocated ? piece.size : 0;
            info.active_size += piece.active ? piece.size : 0;
            info.requested_size += piece.requested_size;
            if (!seen_segment) {
              info.stream = stream_ptr(it->segment->stream);
              info.is_expandable = it->segment->expandable;
              seen_segment = true;
            }
            at = b_hi;
          }
          if (at < hi) blocks.push_back(pyalloc_block_info{hi - at, 0, 0, 0, 0});
          fn(user, &info, blocks.data(), blocks.size());
        }
      }
    }
  });
}

int api_create_or_incref_pool_with(int device, uint64_t id0, uint64_t id1, pyalloc_source_alloc_fn alloc,
                                   pyalloc_source_free_fn free_fn, void* user) {
  return guarded([&] {
    if (alloc == nullptr || free_fn == nullptr)
      throw std::invalid_argument("a MemPool's allocator needs alloc and free");
    DevicePools::SegmentSource source;
    source.reserve = [alloc, user, device](size_t size) {
      void* out = nullptr;
      int status = alloc(user, device, size, &out);
      if (status != PYALLOC_OK)
        throw std::runtime_error("a MemPool's own allocator failed to allocate " + std::to_string(size) +
                                 " bytes on device " + std::to_string(device));
      return addr(out);
    };
    source.release = [free_fn, user, device](uintptr_t base, size_t size) {
      free_fn(user, device, reinterpret_cast<void*>(base), size);
    };
    pools_of(device, true)->create_or_incref_pool({id0, id1}, std::move(source));
  });
}

const pyalloc_bridge_api kApi = {
    PYALLOC_BRIDGE_API_VERSION,
    sizeof(pyalloc_bridge_api),
#ifdef PYALLOC_VERSION
    PYALLOC_VERSION,
#else
    "unknown",
#endif
    &api_last_error,
    &api_malloc,
    &api_free,
    &api_record_stream,
    &api_base_alloc,
    &api_empty_cache,
    &api_set_memory_fraction,
    &api_memory_fraction,
    &api_cache_info,
    &api_device_stats,
    &api_reset_peak_stats,
    &api_reset_accumulated_stats,
    &api_pool_reserved,
    &api_snapshot,
    &api_history,
    &api_record_history,
    &api_contexts_in_use,
    &api_begin_allocate_to_pool,
    &api_end_allocate_to_pool,
    &api_release_pool,
    &api_create_or_incref_pool,
    &api_pool_use_count,
    &api_pool_live_blocks,
    &api_pool_checkpoint,
    &api_pool_restore,
    &api_init,
    &api_set_route,
    &api_settings,
    &api_record_stream_owned,
    &api_block_context,
    &api_mark_capture,
    &api_memory_usage,
    &api_ipc_share,
    &api_ipc_open,
    &api_ipc_close,
    &api_watch_segments,
    &api_snapshot_units,
    &api_create_or_incref_pool_with,
    &api_set_free_memory_hook,
    &api_set_captures_marked,
    &api_record_stream_on,
    sizeof(pyalloc_segment_info),
    &api_set_pool_use_on_oom,
    &api_set_pool_no_split,
};

// Version 1: the members before record_stream_owned, and a malloc that fills
// version 1's pyalloc_oom_info.
pyalloc_bridge_api make_v1() {
  pyalloc_bridge_api t = kApi;
  t.version = 1;
  t.size = offsetof(pyalloc_bridge_api, record_stream_owned);
  t.malloc = &api_malloc_v1;
  t.record_stream_owned = nullptr;
  t.block_context = nullptr;
  t.mark_capture = nullptr;
  t.memory_usage = nullptr;
  t.ipc_share = nullptr;
  t.ipc_open = nullptr;
  t.ipc_close = nullptr;
  t.watch_segments = nullptr;
  t.snapshot_units = nullptr;
  t.create_or_incref_pool_with = nullptr;
  t.set_free_memory_hook = nullptr;
  t.set_captures_marked = nullptr;
  t.record_stream_on = nullptr;
  t.segment_info_size = 0;
  t.set_pool_use_on_oom = nullptr;
  t.set_pool_no_split = nullptr;
  return t;
}

const pyalloc_bridge_api kApiV1 = make_v1();

}  // namespace
}  // namespace pyalloc

PYALLOC_EXPORT const pyalloc_bridge_api* pyalloc_bridge_api_get(uint32_t version) {
  if (version == 1) return &pyalloc::kApiV1;
  return version == PYALLOC_BRIDGE_API_VERSION ? &pyalloc::kApi : nullptr;
}
