// Python bindings of the trace replayer (replay.h). The trace comes in as four
// flat integer buffers (array.array, numpy arrays, bytes) so that a trace of
// millions of events crosses into C++ in one call.
#include <cctype>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "py_bindings.h"
#include "replay/pickle_scan.h"
#include "replay/replay.h"
#include "replay/torch_model.h"

namespace py = pybind11;

namespace pyalloc {
namespace {

// The elements of a one-dimensional buffer of integers of any width.
std::vector<uint64_t> read_ints(const py::buffer& buf, const char* name) {
  py::buffer_info info = buf.request();
  if (info.ndim != 1)
    throw std::invalid_argument(std::string(name) + ": expected a one-dimensional buffer");
  std::string fmt = info.format;
  if (!fmt.empty() && std::string("@=<").find(fmt[0]) != std::string::npos) fmt.erase(0, 1);
  if (fmt.size() != 1 || std::string("bBhHiIlLqQ").find(fmt[0]) == std::string::npos)
    throw std::invalid_argument(std::string(name) + ": expected integers, got buffer format '" +
                                info.format + "'");
  bool is_signed = std::islower(static_cast<unsigned char>(fmt[0])) != 0;
  std::vector<uint64_t> out(static_cast<size_t>(info.shape[0]));
  const char* base = static_cast<const char*>(info.ptr);
  for (size_t i = 0; i < out.size(); ++i) {
    const char* p = base + static_cast<py::ssize_t>(i) * info.strides[0];
    int64_t v = 0;
    if (is_signed) {
      switch (info.itemsize) {
        case 1: v = *reinterpret_cast<const int8_t*>(p); break;
        case 2: v = *reinterpret_cast<const int16_t*>(p); break;
        case 4: v = *reinterpret_cast<const int32_t*>(p); break;
        case 8: v = *reinterpret_cast<const int64_t*>(p); break;
        default: throw std::invalid_argument(std::string(name) + ": unsupported integer width");
      }
    } else {
      switch (info.itemsize) {
        case 1: v = *reinterpret_cast<const uint8_t*>(p); break;
        case 2: v = *reinterpret_cast<const uint16_t*>(p); break;
        case 4: v = *reinterpret_cast<const uint32_t*>(p); break;
        case 8: v = static_cast<int64_t>(*reinterpret_cast<const uint64_t*>(p)); break;
        default: throw std::invalid_argument(std::string(name) + ": unsupported integer width");
      }
    }
    if (is_signed && v < 0)
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] is negative");
    out[i] = static_cast<uint64_t>(v);
  }
  return out;
}

std::unique_ptr<ReplayTrace> make_trace(const py::buffer& kinds, const py::buffer& ids,
                                        const py::buffer& sizes, const py::buffer& streams) {
  std::vector<uint64_t> k = read_ints(kinds, "kinds"), id = read_ints(ids, "ids"),
                        sz = read_ints(sizes, "sizes"), st = read_ints(streams, "streams");
  if (id.size() != k.size() || sz.size() != k.size() || st.size() != k.size())
    throw std::invalid_argument("kinds, ids, sizes and streams must have the same length (" +
                                std::to_string(k.size()) + ", " + std::to_string(id.size()) +
                                ", " + std::to_string(sz.size()) + ", " +
                                std::to_string(st.size()) + ")");
  std::vector<ReplayOp> ops(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    if (k[i] != ReplayOp::kAlloc && k[i] != ReplayOp::kFree && k[i] != ReplayOp::kFreeRequested)
      throw std::invalid_argument("kinds[" + std::to_string(i) + "] is " + std::to_string(k[i]) +
                                  "; valid kinds: 1 (alloc), 2 (free), 3 (free requested)");
    if (id[i] >= k.size() || id[i] >= UINT32_MAX)
      throw std::invalid_argument("ids[" + std::to_string(i) + "] is " + std::to_string(id[i]) +
                                  "; ids must be below the number of ops and 2**32 - 1");
    ops[i] = ReplayOp{static_cast<ReplayOp::Kind>(k[i]), static_cast<uint32_t>(id[i]),
                      static_cast<size_t>(sz[i]), static_cast<Stream>(st[i])};
  }
  return std::make_unique<ReplayTrace>(std::move(ops));
}

// PyTorch's allocator settings, by keyword as pyalloc.replay.settings.TorchSettings
// gives them; 0 (or None) for PyTorch's default.
TorchAllocatorSettings model_settings(size_t max_split_size, size_t max_non_split_rounding,
                                      size_t large_segment_size, const py::object& divisions) {
  TorchAllocatorSettings s;
  if (max_split_size != 0) s.max_split_size = max_split_size;
  s.max_non_split_rounding = max_non_split_rounding;
  if (large_segment_size != 0) s.large_segment_size = large_segment_size;
  if (!divisions.is_none()) {
    for (py::handle h : divisions) {
      auto d = h.cast<uint64_t>();
      if (d != 0 && (d & (d - 1)) != 0)
        throw std::invalid_argument("roundup_power2_divisions must be 0 or powers of two, got " +
                                    std::to_string(d));
      s.roundup_power2_divisions.push_back(static_cast<size_t>(d));
    }
  }
  return s;
}

py::dict run_model(const ReplayTrace& trace, bool expandable, size_t capacity, bool stop_on_oom,
                   bool record_calls, const py::object& seed, const py::object& place_at,
                   const py::object& releases, const py::object& malloc_hints, size_t max_split_size,
                   size_t max_non_split_rounding, size_t large_segment_size,
                   const py::object& roundup_power2_divisions) {
  TorchModelOptions opt;
  opt.expandable = expandable;
  opt.settings = model_settings(max_split_size, max_non_split_rounding, large_segment_size,
                                roundup_power2_divisions);
  opt.capacity = capacity;
  opt.stop_on_oom = stop_on_oom;
  opt.record_calls = record_calls;
  if (!seed.is_none())
    for (py::handle h : seed) {
      auto t = h.cast<std::tuple<uint64_t, uint64_t, uint64_t, bool>>();
      opt.seed.push_back(SeedSegment{static_cast<uintptr_t>(std::get<0>(t)),
                                     static_cast<size_t>(std::get<1>(t)), std::get<2>(t),
                                     std::get<3>(t)});
    }
  if (!place_at.is_none())
    for (uint64_t a : read_ints(place_at.cast<py::buffer>(), "place_at"))
      opt.place_at.push_back(static_cast<uintptr_t>(a));
  if (!releases.is_none())
    for (uint64_t op : read_ints(releases.cast<py::buffer>(), "releases")) opt.releases.push_back(op);
  if (!malloc_hints.is_none())
    for (py::handle h : malloc_hints) {
      auto t = h.cast<std::pair<uint64_t, uint64_t>>();
      opt.malloc_hints.emplace_back(static_cast<size_t>(t.first), static_cast<uintptr_t>(t.second));
    }
  TorchModelResult r;
  {
    py::gil_scoped_release release;
    r = run_torch_model(trace, opt);
  }
  py::dict out;
  out["completed"] = r.completed;
  out["ooms"] = r.ooms;
  out["first_oom_op"] = r.first_oom_op;
  out["peak_reserved_bytes"] = r.peak_reserved;
  out["device_calls"] = r.device_calls;
  out["second_half_device_calls"] =
      r.second_half_device_calls < 0 ? py::object(py::none()) : py::object(py::int_(r.second_half_device_calls));
  out["driver_calls"] = r.driver_calls;
  out["retries"] = r.retries;
  out["early_frees"] = r.early_frees;
  out["misplaced"] = r.misplaced;
  out["seconds"] = r.seconds;
  py::list calls;
  for (const ModelCall& c : r.calls)
    calls.append(py::make_tuple(static_cast<int>(c.kind), c.op, c.addr, c.size));
  out["calls"] = calls;
  return out;
}

}  // namespace

void bind_replay(py::module_& m) {
  py::class_<ReplayTrace>(m, "ReplayTrace",
                          "An allocation trace as allocator calls, ready to replay in C++.")
      .def(py::init(&make_trace), py::arg("kinds"), py::arg("ids"), py::arg("sizes"),
           py::arg("streams"),
           "Four equal-length integer buffers, one entry per call: kind (1 alloc, 2 free, 3 free "
           "requested: the block waits on other streams (record_stream) until its free, which an "
           "out-of-memory path may make early), id (a slot naming the allocation, below the number of "
           "ops), size (requested bytes; ignored for frees) and stream (for allocs). ValueError names "
           "the first bad entry.")
      .def("__len__", &ReplayTrace::size)
      .def_property_readonly("allocs", &ReplayTrace::allocs, "Alloc ops in the trace.")
      .def_property_readonly("slots", &ReplayTrace::slots, "One more than the largest id.");

  py::class_<Replayer>(m, "Replayer",
                       "Runs a ReplayTrace against an Allocator, wholly in C++.")
      .def(py::init<Allocator&, const ReplayTrace&, bool, size_t>(), py::arg("allocator"),
           py::arg("trace"), py::arg("stop_on_oom") = false, py::arg("timeline_points") = 0,
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
           "stop_on_oom: stop at the first allocation that fails (after the blocks whose free was "
           "requested are freed and it is tried again) instead of skipping it (and its free). "
           "timeline_points: how many samples of (live, reserved) to keep.")
      .def(
          "run",
          [](Replayer& r, py::object stop) {
            size_t s = stop.is_none() ? SIZE_MAX : stop.cast<size_t>();
            py::gil_scoped_release release;
            return r.run(s);
          },
          py::arg("stop") = py::none(),
          "Runs the ops from position up to stop (default: the end), without the GIL. "
          "False if it stopped at an out-of-memory (stop_on_oom).")
      .def_property_readonly("position", &Replayer::position, "The next op to run.")
      .def_property_readonly("mallocs", &Replayer::mallocs, "Allocations served.")
      .def_property_readonly("frees", &Replayer::frees, "Blocks freed (early_frees included).")
      .def_property_readonly("early_frees", &Replayer::early_frees,
                             "Blocks whose free was requested (kind 3), freed before their free because "
                             "an allocation failed; their free then does nothing.")
      .def_property_readonly("ooms", &Replayer::ooms, "Allocations the allocator refused.")
      .def_property_readonly("skipped_frees", &Replayer::skipped_frees,
                             "Frees of refused allocations, not made.")
      .def_property_readonly("first_oom_op", &Replayer::first_oom_op, "-1 if none.")
      .def_property_readonly("live_bytes", &Replayer::live_bytes,
                             "Requested bytes the allocator holds for the trace now.")
      .def_property_readonly("peak_live_bytes", &Replayer::peak_live_bytes)
      .def_property_readonly("seconds", &Replayer::seconds, "Wall seconds spent in run().")
      .def_property_readonly("device_calls_at_half", &Replayer::device_calls_at_half,
                             "(num_device_alloc, num_device_free) of the allocator when the replay "
                             "reached op len(trace) // 2; (-1, -1) before.")
      .def(
          "timeline",
          [](const Replayer& r) {
            py::list out;
            for (const TimelinePoint& p : r.timeline())
              out.append(py::make_tuple(p.op, p.live_max, p.reserved, p.allocated));
            return out;
          },
          "[(op, most live bytes since the previous point, reserved bytes, allocated bytes)]");

  m.def("run_torch_model", &run_model, py::arg("trace"), py::arg("expandable") = false,
        py::arg("capacity") = 0, py::arg("stop_on_oom") = false, py::arg("record_calls") = false,
        py::arg("seed") = py::none(), py::arg("place_at") = py::none(),
        py::arg("releases") = py::none(), py::arg("malloc_hints") = py::none(),
        py::arg("max_split_size") = 0, py::arg("max_non_split_rounding") = 0,
        py::arg("large_segment_size") = 0, py::arg("roundup_power2_divisions") = py::none(),
        "Replays a ReplayTrace through the model of PyTorch's caching allocator "
        "(csrc/replay/torch_model.h), default or expandable_segments:True, on a device of "
        "`capacity` bytes (0: unbounded), without the GIL. seed: [(address, bytes, stream, "
        "small_pool)] segments present before op 0; place_at: per op, the address a pre-trace "
        "alloc had (0: none); releases: ascending ops before which release_cached_blocks runs; "
        "malloc_hints: [(bytes, address)] the driver's answers by cudaMalloc ordinal. "
        "max_split_size, max_non_split_rounding, large_segment_size (bytes; 0: PyTorch's "
        "default) and roundup_power2_divisions (per interval from 1 MiB; None: none): PyTorch's "
        "allocator settings (pyalloc.replay.settings.TorchSettings.model_options()). Returns a "
        "dict: completed, ooms, first_oom_op, peak_reserved_bytes, device_calls, "
        "second_half_device_calls, driver_calls, retries, early_frees (blocks whose free was "
        "requested, freed by an out-of-memory retry before their free), misplaced, seconds, and calls: "
        "[(action code 3-6, op, address, bytes)] when record_calls.");

  py::class_<PickleScan>(m, "PickleScan",
                         "Where a pass over a pickle's opcodes stands (csrc/replay/pickle_scan.h).")
      .def(py::init([](uint64_t limit, uint64_t memory) {
             PickleScan scan;
             scan.limit = limit;
             scan.memory = memory;
             return scan;
           }),
           py::arg("limit") = UINT64_MAX, py::arg("memory") = UINT64_MAX,
           "limit: the most bytes the pickle may have; memory: the most bytes its load may take.")
      .def_readonly("objects", &PickleScan::objects, "the least memory its objects and memo take so far (bytes)")
      .def_readonly("stored", &PickleScan::stored, "memo stores stepped over so far")
      .def_readonly("done", &PickleScan::done, "bytes of whole opcodes stepped over")
      .def_readonly("end", &PickleScan::end, "a STOP or an opcode the unpickler refuses: read no further")
      .def_readonly("why", &PickleScan::why, "why the pickle is refused; '' if it is not");
  m.def(
      "scan_pickle",
      [](const py::buffer& data, PickleScan& scan) {
        py::buffer_info info = data.request();
        if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1)
          throw std::invalid_argument("scan_pickle: expected contiguous bytes");
        const auto* bytes = static_cast<const uint8_t*>(info.ptr);
        auto size = static_cast<size_t>(info.shape[0]);
        if (scan.done > size) throw std::invalid_argument("scan_pickle: the data is shorter than before");
        py::gil_scoped_release unlocked;
        scan_pickle(bytes, size, &scan);
      },
      py::arg("data"), py::arg("scan"),
      "Steps over the whole opcodes of data[scan.done:] (the same pickle, with more appended "
      "at each call), refusing (scan.why) a memo index far past the entries stored before it, an "
      "argument longer than scan.limit, or a load needing more than scan.memory bytes "
      "(pickle_scan.h).");
}

}  // namespace pyalloc
