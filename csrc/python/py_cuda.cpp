// Python bindings of the CUDA pools (registry.h, cuda_pools.h): configuration, per-device
// stats, fragmentation, snapshots and history, cache control, and buffers
// handed to PyTorch as DLPack capsules. pyalloc/cuda.py builds the public
// API on these. The `_testing_` functions drive the same code over fake
// devices of host memory, for CI without a GPU.
#include <Python.h>
#include <pybind11/stl.h>

#include <dlfcn.h>

#include <cstdio>
#include <functional>
#include <set>
#include <utility>

#include "cuda/cuda_driver.h"
#include "cuda/registry.h"
#include "cuda/segment_watch.h"
#include "cuda/ipc.h"
#include "py_bindings.h"
#include "py_convert.h"
#include "backends/sim_streams.h"
#include "cuda/streams.h"

namespace py = pybind11;

struct CUstream_st;  // the CUDA runtime's stream type (cudaStream_t is CUstream_st*)

namespace pyalloc {
namespace {

PoolRegistry& registry() { return PoolRegistry::instance(); }

/// The named pool of a device, or null while the device has no pools.
Allocator* pool_of(int device, const std::string& which) {
  if (which != "general" && which != "buffers")
    throw std::invalid_argument("unknown pool '" + which + "'; the pools are 'general' and 'buffers'");
  DevicePools* p = registry().find(device);
  if (p == nullptr) return nullptr;
  return which == "general" ? &p->general() : &p->buffers();
}

// ---------------------------------------------------------------------------
// DLPack: the few structs of dlpack.h (v0.8 ABI, the "dltensor" capsule),
// declared here as they are fixed by that ABI.

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLUInt = 1
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

/// One reserve_buffer() block: what the tensor's deleter needs to free it.
struct BufferHandle {
  DLManagedTensor managed{};
  int64_t shape[1] = {0};
  int64_t strides[1] = {1};
  int device = 0;
  uintptr_t ptr = 0;
};

// Runs when the tensor made from the capsule dies, on whatever thread
// releases it, without the GIL: it touches only the pool.
void free_buffer(DLManagedTensor* self) {
  auto* h = static_cast<BufferHandle*>(self->manager_ctx);
  try {
    if (DevicePools* p = registry().find(h->device)) p->free_buffer(h->ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pyalloc: freeing a reserved buffer failed: %s\n", e.what());
  }
  delete h;
}

void capsule_destructor(PyObject* capsule) {
  // A capsule never consumed (still named "dltensor") owns its buffer.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    m->deleter(m);
  }
}

// Snapshot or history entries with the handles PyTorch passed for their
// streams (a thread's cudaStreamPerThread is 0x2 again: streams.h).
py::list with_handles(py::list entries) {
  for (py::handle e : entries) e["stream"] = streams::handle(e["stream"].cast<Stream>());
  return entries;
}

py::object buffer_capsule(int device, size_t nbytes, Stream stream) {
  if (nbytes == 0) throw std::invalid_argument("reserve_buffer needs at least one byte");
  uintptr_t ptr;
  {
    py::gil_scoped_release nogil;
    ptr = hooks::malloc_buffer(nbytes, device, stream);
  }
  DevicePools* pools = registry().find(device);
  auto* h = new BufferHandle();
  h->device = device;
  h->ptr = ptr;
  h->shape[0] = static_cast<int64_t>(nbytes);
  DLTensor& t = h->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = DLDevice{pools->device().dlpack_device_type(), device};
  t.ndim = 1;
  t.dtype = DLDataType{1, 8, 1};
  t.shape = h->shape;
  t.strides = h->strides;
  t.byte_offset = 0;
  h->managed.manager_ctx = h;
  h->managed.deleter = &free_buffer;
  PyObject* capsule = PyCapsule_New(&h->managed, "dltensor", &capsule_destructor);
  if (capsule == nullptr) {
    free_buffer(&h->managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::register_exception<drv::DriverError>(m, "CudaDriverError", PyExc_RuntimeError);
  auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("library_path", &library_path,
        "The file of this library, which holds the pyalloc_* functions PyTorch calls.");
  m.def(
      "cuda_check_driver", [] { return drv::driver().version; },
      "Loads libcuda.so.1 and runs cuInit; returns the driver's CUDA version (e.g. 13000). "
      "Raises CudaDriverError (a RuntimeError) saying why it cannot.");
  m.def("cuda_device_count", &cuda_device_count, "The number of CUDA devices the driver sees.");
  m.def(
      "cuda_describe_device",
      [](int index) {
        CudaDeviceInfo i = describe_cuda_device(index);
        py::dict d;
        d["index"] = i.index;
        d["name"] = i.name;
        d["total_bytes"] = i.total_bytes;
        d["free_bytes"] = i.free_bytes;
        d["vmm"] = i.vmm_page != 0;
        d["vmm_granularity"] = i.vmm_page;
        d["vmm_why"] = i.vmm_why;
        d["peers"] = i.peers;
        d["peers_why"] = i.peers_why;
        return d;
      },
      py::arg("index"),
      "For pyalloc doctor: a device's name, memory, virtual memory support (a trial mapping) "
      "and peers. Retains the device's primary context. Raises CudaDriverError.");

  m.def(
      "cuda_configure", [](const std::string& text) { registry().configure(text); },
      py::arg("conf"),
      "Sets the pools' configuration ('key:value,...') before their first use. ValueError for "
      "a bad one; RuntimeError if pools already use a different one.");
  m.def(
      "cuda_config",
      [] {
        py::dict d = config_dict(registry().config());
        // The strategy in use: bestfit where a device's pools could not use vmm.
        for (DevicePools* p : registry().all())
          if (p->general().config().strategy != registry().config().strategy)
            d["strategy"] = strategy_name(p->general().config().strategy);
        return d;
      },
      "The pools' effective configuration, in bytes; 'strategy' is the one in use.");
  m.def(
      "cuda_set_route",
      [](const std::string& route) {
        if (route == "hooks") registry().set_route(PoolRegistry::kHooks);
        else if (route == "bridge") registry().set_route(PoolRegistry::kBridge);
        else if (route == "none") registry().set_route(PoolRegistry::kNotInstalled);
        else throw std::invalid_argument("unknown route '" + route + "'; the routes are 'hooks', 'bridge' and 'none'");
      },
      py::arg("route"),
      "Records how install() made pyalloc PyTorch's allocator: 'hooks', 'bridge' (or 'none').");
  m.def(
      "cuda_route",
      [] {
        switch (registry().route()) {
          case PoolRegistry::kHooks: return "hooks";
          case PoolRegistry::kBridge: return "bridge";
          default: return "none";
        }
      },
      "How PyTorch reaches pyalloc in this process: 'hooks', 'bridge' or 'none'.");
  m.def(
      "cuda_set_told_of_captures", [](bool told) { registry().set_told_of_captures(told); },
      py::arg("told"),
      "PyTorch calls the graph-pool hooks around every capture: allocations stop asking the "
      "driver whether their stream is capturing.");
  m.def(
      "cuda_is_installed", [] { return registry().installed(); },
      "Whether pyalloc is PyTorch's CUDA allocator in this process.");
  m.def(
      "cuda_hook_device_count", [] { return registry().device_count(); },
      "The device count PyTorch's init hook passed (-1 before it ran).");
  m.def(
      "cuda_devices",
      [] {
        std::vector<int> out;
        for (DevicePools* p : registry().all()) out.push_back(p->index());
        return out;
      },
      "The devices whose pools exist.");

  m.def(
      "cuda_stats",
      [](int device, const std::string& pool) {
        Allocator* a = pool_of(device, pool);
        if (a != nullptr) return stats_dict(a->stats());
        Stats none;
        none.max_split_size = -1;  // PyTorch's "no limit", as a pool without one reports
        return stats_dict(none);
      },
      py::arg("device"), py::arg("pool") = "general",
      "torch.cuda.memory_stats() keys for one pool of a device (zeros before its first use).");
  m.def(
      "cuda_device_stats",
      [](int device) {
        DevicePools* p = registry().find(device);
        Stats none;
        none.max_split_size = -1;  // PyTorch's "no limit", as a pool without one reports
        py::dict d = stats_dict(p != nullptr ? p->stats() : none);
        if (p == nullptr) return d;
        // PyTorch's nested reserved_bytes_by_private_pools, flattened as
        // torch.cuda.memory_stats() flattens it: (a, b) -> "a_b".
        const std::pair<const char*, Stat StatArray::*> pools[] = {
            {"all", &StatArray::all}, {"small_pool", &StatArray::small}, {"large_pool", &StatArray::large}};
        for (const auto& [id, reserved] : p->pool_reserved()) {
          std::string prefix = "reserved_bytes_by_private_pools." + std::to_string(id.first) + "_" +
                               std::to_string(id.second) + ".";
          for (const auto& [name, member] : pools) {
            const Stat& st = reserved.*member;
            std::string k = prefix + name + ".";
            d[py::str(k + "current")] = st.current;
            d[py::str(k + "peak")] = st.peak;
            d[py::str(k + "allocated")] = st.allocated;
            d[py::str(k + "freed")] = st.freed;
          }
        }
        return d;
      },
      py::arg("device"),
      "torch.cuda.memory_stats() keys for a device: all its pools (general, buffers, graph "
      "pools) counted together, each peak the device's own, and each graph pool's "
      "reserved_bytes_by_private_pools (zeros before the device's first use).");
  m.def(
      "cuda_reset_peak_stats",
      [](int device) {
        if (DevicePools* p = registry().find(device)) p->reset_peak_stats();
      },
      py::arg("device"), "Sets every peak statistic of every pool of a device to its current value.");
  m.def(
      "cuda_reset_accumulated_stats",
      [](int device) {
        if (DevicePools* p = registry().find(device)) p->reset_accumulated_stats();
      },
      py::arg("device"), "Sets every allocated / freed sum and counter of a device's pools to 0.");
  m.def(
      "cuda_fragmentation",
      [](int device, const std::string& pool) {
        Allocator* a = pool_of(device, pool);
        return fragmentation_dict(a != nullptr ? a->fragmentation() : FragmentationInfo());
      },
      py::arg("device"), py::arg("pool") = "general",
      "Free bytes, largest free block and free blocks by size of one pool of a device.");
  m.def(
      "cuda_snapshot_segments",
      [](int device, const std::string& pool) {
        if (pool == "graph") {
          py::list out;
          DevicePools* p = registry().find(device);
          if (p == nullptr) return out;
          std::vector<std::pair<DevicePools::PoolId, std::vector<SnapshotSegment>>> pools;
          p->for_each_pool([&](DevicePools::PoolId id, Allocator& a) {
            if (&a != &p->general() && &a != &p->buffers()) pools.emplace_back(id, a.snapshot());
          });
          for (const auto& [id, segs] : pools) {
            for (py::handle seg : snapshot_list(segs, device)) {
              seg["segment_pool_id"] = py::make_tuple(id.first, id.second);
              out.append(seg);
            }
          }
          return with_handles(out);
        }
        Allocator* a = pool_of(device, pool);
        return a != nullptr ? with_handles(snapshot_list(a->snapshot(), device)) : py::list();
      },
      py::arg("device"), py::arg("pool") = "general",
      "One pool's segments in the layout of torch.cuda.memory._snapshot()['segments']; "
      "pool 'graph': every graph pool's, each with its pool id as segment_pool_id.");
  m.def(
      "cuda_history",
      [](int device, const std::string& pool) {
        if (pool == "graph") {
          DevicePools* p = registry().find(device);
          std::vector<TraceEntry> events;
          if (p != nullptr)
            p->for_each_pool([&](DevicePools::PoolId, Allocator& a) {
              if (&a == &p->general() || &a == &p->buffers()) return;
              std::vector<TraceEntry> h = a.history();
              events.insert(events.end(), h.begin(), h.end());
            });
          return with_handles(history_list(events));
        }
        Allocator* a = pool_of(device, pool);
        return a != nullptr ? with_handles(history_list(a->history())) : py::list();
      },
      py::arg("device"), py::arg("pool") = "general",
      "One pool's recorded events, oldest first, as a snapshot's device_traces entries "
      "(pool 'graph': the graph pools' events).");
  m.def(
      "cuda_record_history",
      [](bool enabled, size_t max_entries) { registry().record_history(enabled, max_entries); },
      py::arg("enabled"), py::arg("max_entries"),
      "Keeps the last max_entries events of every pool, present and future.");
  m.def(
      "cuda_check_invariants",
      [](int device) {
        if (DevicePools* p = registry().find(device)) p->check_invariants();
      },
      py::arg("device"), nogil,
      "Verifies every pool of a device (general, buffers, graph pools); raises InvariantError "
      "if anything is off.");

  m.def(
      "cuda_empty_cache",
      [](int device) -> size_t {
        DevicePools* p = registry().find(device);
        return p != nullptr ? p->empty_cache() : 0;
      },
      py::arg("device"), nogil,
      "Releases the device's cached segments (keeping pool_size); the bytes released.");
  m.def(
      "cuda_reserve",
      [](int device, size_t nbytes) { return registry().get(device).general().reserve(nbytes); },
      py::arg("device"), py::arg("nbytes"), nogil,
      "Grows the device's general pool so that nbytes are free in one range; the bytes reserved.");
  m.def("cuda_buffer", &buffer_capsule, py::arg("device"), py::arg("nbytes"), py::arg("stream"),
        "A DLPack capsule of nbytes uint8 from the device's buffer pool; the tensor made from it "
        "frees the buffer when it dies.");
  m.def(
      "cuda_graph_memory",
      [](int device) {
        DevicePools* p = registry().find(device);
        return p != nullptr ? p->graph_memory() : std::pair<size_t, size_t>(0, 0);
      },
      py::arg("device"), "(blocks, bytes) held for CUDA graphs on the device.");
  m.def(
      "cuda_release_graph_memory",
      [](int device) -> size_t {
        DevicePools* p = registry().find(device);
        return p != nullptr ? p->release_graph_memory() : 0;
      },
      py::arg("device"), nogil,
      "Returns the blocks held for CUDA graphs to the general pool; the bytes. Only once no "
      "graph captured so far will run again.");

  m.def(
      "cuda_graph_pools",
      [](int device) {
        std::vector<py::dict> out;
        DevicePools* p = registry().find(device);
        if (p == nullptr) return out;
        for (const GraphPools::Info& info : p->graphs().info()) {
          py::dict d;
          d["id"] = py::make_tuple(info.id.first, info.id.second);
          d["use_count"] = info.uses;
          d["allocated_bytes"] = info.allocated_bytes;
          d["reserved_bytes"] = info.reserved_bytes;
          out.push_back(d);
        }
        return out;
      },
      py::arg("device"),
      "The device's graph pools (CUDA graphs, torch.cuda.MemPool): id, use_count, "
      "allocated_bytes, reserved_bytes.");
  m.def(
      "cuda_pool_live_blocks",
      [](int device, std::pair<uint64_t, uint64_t> id) {
        DevicePools* p = registry().find(device);
        if (p == nullptr) throw GraphPools::no_such_pool(id);
        return p->graphs().live_blocks(id);
      },
      py::arg("device"), py::arg("pool_id"),
      "The live allocations of a graph pool, by address; ValueError if there is no such pool.");
  m.def(
      "_testing_pool_hook",
      [](const std::string& name, int device, std::pair<unsigned long long, unsigned long long> id,
         std::vector<Stream> streams) {
        // Called exactly as PyTorch's CUDAPluggableAllocator calls them: the
        // exported symbol, cast to the setter's function type.
        using Filter = std::function<bool(CUstream_st*)>;
        using Id = std::pair<unsigned long long, unsigned long long>;
        void* lib = dlopen(library_path().c_str(), RTLD_NOW | RTLD_NOLOAD);
        void* fn = lib != nullptr ? dlsym(lib, ("pyalloc_" + name).c_str()) : nullptr;
        if (lib != nullptr) dlclose(lib);
        if (fn == nullptr) throw std::invalid_argument("no hook pyalloc_" + name);
        if (name == "begin_allocate_to_pool") {
          std::set<Stream> accepted(streams.begin(), streams.end());
          Filter filter = [accepted](CUstream_st* s) {
            return accepted.count(static_cast<Stream>(reinterpret_cast<uintptr_t>(s))) != 0;
          };
          std::function<void(int, Id, Filter)> call = reinterpret_cast<void (*)(int, Id, Filter)>(fn);
          call(device, id, filter);
        } else {
          std::function<void(int, Id)> call = reinterpret_cast<void (*)(int, Id)>(fn);
          call(device, id);
        }
      },
      py::arg("name"), py::arg("device"), py::arg("pool_id"), py::arg("streams") = std::vector<Stream>(),
      py::call_guard<py::gil_scoped_release>(),
      "Tests: calls a graph-pool hook (begin_allocate_to_pool, end_allocate_to_pool, "
      "release_pool) as PyTorch does; begin's filter accepts `streams`.");
  m.def(
      "_testing_pool",
      [](const std::string& what, int device, std::pair<uint64_t, uint64_t> id) {
        DevicePools& p = registry().get(device);
        if (what == "create_or_incref") p.create_or_incref_pool(id);
        else if (what == "release") p.release_pool(id);
        else if (what == "end") p.end_allocate_to_pool(id);
        else if (what != "use_count") throw std::invalid_argument("unknown pool call " + what);
        for (const GraphPools::Info& pool : p.graphs().info())
          if (pool.id == id) return pool.uses;
        return 0;  // no such pool (any more)
      },
      py::arg("what"), py::arg("device"), py::arg("pool_id"),
      "Tests: DevicePools' pool calls (create_or_incref, release, end, use_count); the use count "
      "after it (0: no such pool).");

  m.def(
      "_testing_use_fake_devices",
      [](size_t capacity) { registry().use_fake_devices(capacity); }, py::arg("capacity"),
      "Tests: pools created from now on live on fake devices of host memory.");
  m.def(
      "_testing_reset", [] { registry().reset_fake(); },
      "Tests: drops every fake pool and the configuration.");
  m.def(
      "_testing_fake_devices", [] { return registry().fake(); },
      "Tests: whether pools are made on fake devices (then every device index has pools to read).");
  m.def(
      "cuda_route_heal_grace", [] { return GraphPools::kRouteHealGrace; },
      "Seconds a graph-pool route left open must have seen its capture over before it stops "
      "counting as a capture underway (a failed cudaStreamEndCapture leaves it open).");
  m.def("_testing_set_capture", &set_fake_capture, py::arg("stream"), py::arg("capture_id"),
        "Tests: a fake device stream captures (id > 0) or not (0).");
  m.def(
      "_testing_stream",
      [](int device, Stream stream, bool busy) {
        DevicePools* p = registry().find(device);
        SimStreams* sim = p != nullptr ? p->general().backend().sim_streams() : nullptr;
        if (sim == nullptr) throw std::invalid_argument("no fake device " + std::to_string(device));
        if (busy) sim->set_busy(stream);
        else sim->complete(stream);
      },
      py::arg("device"), py::arg("stream"), py::arg("busy"),
      "Tests: work is queued on a fake device's stream (busy) or has finished.");
  m.def(
      "cuda_ipc_counts",
      [] {
        ipc::Counts c = ipc::counts();
        py::dict d;
        d["exports"] = c.exports;
        d["handles_exported"] = c.handles_exported;
        d["frees_locked"] = c.frees_locked;
        d["served"] = c.served;
        d["refused"] = c.refused;
        d["mappings"] = c.mappings;
        d["mapped_bytes"] = c.mapped_bytes;
        d["deferred_unmaps"] = c.deferred_unmaps;
        return d;
      },
      "CUDA IPC in this process: allocations whose pages are exported now, requests for them "
      "served and refused, and the handles of other processes opened here (mappings, "
      "mapped_bytes: bytes of pages, 0 for segments, whose size their handle does not say; "
      "deferred_unmaps: those closed during a CUDA graph capture, unmapped after it).");
  m.def(
      "_testing_ipc_process_id", [](uint32_t pid) { ipc::set_process_id_for_tests(pid); }, py::arg("pid"),
      "Tests: the process id written into this process's CUDA IPC handles of pages from its first "
      "export on (0: its own).");
  m.def(
      "_testing_queued_segment_events", [] { return queued_segment_events(); },
      "Tests: the events for the segment watcher queued under the pools' locks and not yet told "
      "(segment_watch.h).");
  m.def(
      "_testing_hook_malloc",
      [](size_t size, int device, Stream stream) {
        return hooks::malloc(size, device, streams::from_handle(static_cast<uintptr_t>(stream)));
      },
      py::arg("size"), py::arg("device"), py::arg("stream"), nogil,
      "Tests: what pyalloc_malloc does, with its exceptions raised in Python.");
  m.def(
      "_testing_per_thread_stream", [] { return streams::from_handle(streams::kPerThreadHandle); },
      "Tests: the stream the pools take the calling thread's cudaStreamPerThread (0x2) for.");
}

}  // namespace pyalloc
