// Python bindings of the allocator core: the Allocator class over a host or
// virtual backend, configuration parsing, and the error types.
#include <pybind11/stl.h>

#include "core/allocator.h"
#include "py_bindings.h"
#include "py_convert.h"
#include "backends/sim_streams.h"

namespace py = pybind11;

namespace pyalloc {
namespace {

std::unique_ptr<Backend> make_backend(const std::string& name, size_t capacity, size_t page_size) {
  if (name != "host" && name != "virtual")
    throw std::invalid_argument("unknown backend '" + name +
                                "'; valid backends here: 'host', 'virtual'");
  if (name == "virtual") return make_virtual_backend(capacity, page_size != 0 ? page_size : kSegmentAlign);
  if (page_size != 0)
    throw std::invalid_argument("page_size applies to the virtual backend only (the host backend maps " +
                                format_bytes(kSegmentAlign) + " pages)");
  return make_host_backend(capacity);
}

SimStreams& sim_streams(Allocator& a) {
  SimStreams* s = a.backend().sim_streams();
  if (s == nullptr)
    throw std::invalid_argument(std::string("the ") + a.backend().name() +
                                " backend has real streams; only host and virtual streams "
                                "can be driven by hand");
  return *s;
}

}  // namespace

py::dict config_dict(const Config& c) {
  py::dict d;
  d["strategy"] = strategy_name(c.strategy);
  d["pool_size"] = c.pool_size;
  d["max_pool_size"] = c.max_pool_size;
  d["segment_size"] = c.segment_size;
  d["small_size"] = c.small_size;
  d["small_chunk_size"] = c.small_chunk_size;
  d["max_split_size"] = c.max_split_size;
  return d;
}

py::dict stats_dict(const Stats& s) {
  py::dict d;
  for (const auto& [key, value] : s.flatten()) d[py::str(key)] = value;
  return d;
}

py::dict fragmentation_dict(const FragmentationInfo& f) {
  py::dict d;
  d["reserved_bytes"] = f.reserved_bytes;
  d["allocated_bytes"] = f.allocated_bytes;
  d["pending_free_bytes"] = f.pending_free_bytes;
  d["free_bytes"] = f.free_bytes;
  d["largest_free_block"] = f.largest_free_block;
  d["free_blocks"] = f.free_blocks;
  d["external_fragmentation"] =
      f.free_bytes == 0 ? 0.0 : 1.0 - double(f.largest_free_block) / double(f.free_bytes);
  d["large_pool_free_bytes"] = f.large_free_bytes;
  d["large_pool_largest_free_block"] = f.large_largest_free_block;
  d["small_pool_free_bytes"] = f.small_free_bytes;
  d["small_pool_largest_free_block"] = f.small_largest_free_block;
  d["free_small_chunks"] = f.free_small_chunks;
  py::list hist;
  for (const auto& [lo, count, bytes] : f.histogram) {
    py::dict h;
    h["min_size"] = lo;
    h["max_size"] = lo * 2 - 1;
    h["count"] = count;
    h["bytes"] = bytes;
    hist.append(h);
  }
  d["histogram"] = hist;
  return d;
}

py::list snapshot_list(const std::vector<SnapshotSegment>& segs, int device) {
  py::list out;
  for (const SnapshotSegment& s : segs) {
    py::dict seg;
    seg["device"] = device;
    seg["address"] = s.address;
    seg["total_size"] = s.total_size;
    seg["allocated_size"] = s.allocated_size;
    seg["active_size"] = s.active_size;
    seg["requested_size"] = s.requested_size;
    seg["stream"] = s.stream;
    seg["segment_type"] = s.pool == kSmallPool ? "small" : "large";
    seg["segment_pool_id"] = py::make_tuple(0, 0);
    seg["is_expandable"] = s.expandable;
    seg["frames"] = py::list();
    py::list blocks;
    for (const SnapshotBlock& b : s.blocks) {
      py::dict blk;
      blk["address"] = b.addr;
      blk["size"] = b.size;
      blk["requested_size"] = b.requested;
      blk["state"] = b.state;
      blk["frames"] = py::list();
      blocks.append(blk);
    }
    seg["blocks"] = blocks;
    out.append(seg);
  }
  return out;
}

py::list history_list(const std::vector<TraceEntry>& entries) {
  py::list out;
  for (const TraceEntry& e : entries) {
    py::dict d;
    d["action"] = trace_action_name(e.action);
    if (e.action == TraceEntry::kOom) d["device_free"] = e.addr;
    else d["addr"] = e.addr;
    d["size"] = e.size;
    d["stream"] = e.stream;
    d["time_us"] = e.time_us;
    d["frames"] = py::list();
    out.append(d);
  }
  return out;
}

void bind_core(py::module_& m) {
  py::register_exception<OutOfMemoryError>(m, "OutOfMemoryError", PyExc_RuntimeError);
  py::register_exception<InvalidPointerError>(m, "InvalidPointerError", PyExc_ValueError);
  py::register_exception<InvariantError>(m, "InvariantError", PyExc_AssertionError);

  m.def("config_keys", &config_keys, "The valid configuration keys.");
  m.def(
      "parse_config", [](const std::string& text) { return config_dict(parse_config(text)); },
      py::arg("text"), "Parses 'key:value,...' into a dict of byte counts (ValueError if bad).");
  m.def("parse_size", &parse_size, py::arg("text"), "'2GiB' -> 2147483648.");
  m.def("format_bytes", &format_bytes, py::arg("n"));

  using A = Allocator;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<A>(m, "Allocator", "The allocator core over a host or virtual backend.")
      .def(py::init([](const std::string& backend, const std::string& conf, size_t capacity, size_t page_size) {
             std::unique_ptr<Backend> made = make_backend(backend, capacity, page_size);
             Config config = parse_config(conf);
             if (page_size != 0 && config.strategy != Strategy::kVmm)
               throw std::invalid_argument(std::string("page_size applies to strategy vmm only (strategy ") +
                                           strategy_name(config.strategy) + " maps no pages)");
             return std::make_unique<A>(std::move(made), config);
           }),
           py::arg("backend"), py::arg("conf") = "", py::arg("capacity") = 0, py::arg("page_size") = 0,
           "page_size (virtual backend only; 0: CUDA's 2 MiB): the granularity of the pages the "
           "vmm strategy maps, a power of two from 4 KiB to 1 GiB, for what-if replays.")
      .def(
          "malloc", [](A& a, size_t size, Stream stream, uint64_t context) { return a.malloc(size, stream, context); },
          py::arg("size"), py::arg("stream") = 0, py::arg("context") = 0, nogil,
           "Allocates size bytes for use on stream; returns the address (0 for size 0). "
           "context: an opaque tag the history carries for this allocation.")
      .def("free", &A::free, py::arg("ptr"), py::arg("context") = 0, nogil)
      .def("allocate_at", &A::allocate_at, py::arg("addr"), py::arg("size"), py::arg("stream") = 0,
           py::arg("context") = 0, nogil,
           "Allocates exactly [addr, addr + size) out of one free block (restoring a "
           "checkpoint); ValueError if that range is not free.")
      .def("record_stream", &A::record_stream, py::arg("ptr"), py::arg("stream"), nogil)
      .def("empty_cache", &A::empty_cache, nogil, "Releases wholly free segments; bytes released.")
      .def("reserve", &A::reserve, py::arg("nbytes"), nogil, "Grows the pool; bytes reserved.")
      .def("set_max_pool_size", &A::set_max_pool_size, py::arg("nbytes"))
      .def("stats", [](const A& a) { return stats_dict(a.stats()); })
      .def("reset_peak_stats", &A::reset_peak_stats)
      .def("fragmentation", [](const A& a) { return fragmentation_dict(a.fragmentation()); })
      .def("snapshot_segments", [](const A& a, int device) { return snapshot_list(a.snapshot(), device); },
           py::arg("device") = 0)
      .def("check_invariants", &A::check_invariants, nogil)
      .def("record_history", &A::record_history, py::arg("enabled"), py::arg("max_entries"))
      .def("history", [](const A& a) { return history_list(a.history()); })
      .def("config", [](const A& a) { return config_dict(a.config()); })
      .def_property_readonly(
          "page_size",
          [](A& a) { return a.config().strategy == Strategy::kVmm ? a.backend().vmm_page_size() : size_t(0); },
          "The size of the pages the vmm strategy maps (0: the pool uses plain segments).")
      .def_property_readonly("backend", [](A& a) { return std::string(a.backend().name()); })
      .def("segment_of",
           [](const A& a, uintptr_t ptr) -> py::object {
             uintptr_t base;
             size_t size;
             if (!a.segment_of(ptr, &base, &size)) return py::none();
             return py::make_tuple(base, size);
           },
           py::arg("ptr"))
      .def("base_allocation",
           [](const A& a, uintptr_t ptr) -> py::object {
             uintptr_t base;
             size_t size;
             if (!a.base_allocation(ptr, &base, &size)) return py::none();
             return py::make_tuple(base, size);
           },
           py::arg("ptr"),
           "PyTorch's getBaseAllocation: (base, size) of the backend's allocations the block "
           "holding ptr lies in (vmm: the handles under it), or None.")
      .def("stream_set_busy", [](A& a, Stream s) { sim_streams(a).set_busy(s); }, py::arg("stream"),
           "Simulated backends: work is queued on stream; its events stay pending.")
      .def("stream_fail", [](A& a, Stream s) { sim_streams(a).fail(s); }, py::arg("stream"),
           "Simulated backends: the work queued on stream failed: its events stay pending and "
           "cannot be waited for, until stream_complete.")
      .def("stream_complete", [](A& a, Stream s) { sim_streams(a).complete(s); }, py::arg("stream"),
           "Simulated backends: the work queued on stream has finished.")
      .def("live_events", [](A& a) { return sim_streams(a).live_events(); });
}

}  // namespace pyalloc
