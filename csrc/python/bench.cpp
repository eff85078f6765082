// C++ timing loops for benchmarks/bench_core.py: malloc+free pairs driven
// without Python in the loop, optionally from several threads at once.
#include <pybind11/stl.h>

#include <chrono>
#include <thread>
#include <vector>

#include "core/allocator.h"
#include "cuda/bridge_api.h"
#include "cuda/registry.h"
#include "py_bindings.h"

namespace py = pybind11;

namespace pyalloc {
namespace {

// Each thread keeps `window` allocations live: every step frees the oldest
// and allocates the next size. window == 1 is an alloc followed by its free.
double run_pairs(Allocator& a, const std::vector<size_t>& sizes, size_t iterations,
                 int threads, size_t window) {
  auto body = [&](int t) {
    std::vector<uintptr_t> ring(window, 0);
    size_t n = sizes.size();
    for (size_t i = 0; i < iterations; ++i) {
      uintptr_t& slot = ring[i % window];
      if (slot != 0) a.free(slot);
      slot = a.malloc(sizes[(i + static_cast<size_t>(t) * 7919) % n], static_cast<Stream>(0));
    }
    for (uintptr_t p : ring)
      if (p != 0) a.free(p);
  };
  auto start = std::chrono::steady_clock::now();
  if (threads <= 1) {
    body(0);
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
    for (std::thread& th : pool) th.join();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A cache-hit pair through a device's pools as PyTorch reaches them: the C
// hooks' functions, or the bridge's C table (what the bridge calls, minus
// torch). Run over fake devices (no GPU): the cost of the CUDA layer.
double run_device_pairs(const std::string& via, size_t size, size_t iterations) {
  const pyalloc_bridge_api* api = pyalloc_bridge_api_get(PYALLOC_BRIDGE_API_VERSION);
  bool table = via == "bridge_api";
  if (!table && via != "hooks")
    throw std::invalid_argument("via must be 'hooks' or 'bridge_api', not '" + via + "'");
  auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < iterations; ++i) {
    if (table) {
      void* p = nullptr;
      if (api->malloc(0, size, nullptr, 0, &p, nullptr) != PYALLOC_OK || api->free(p, 0) != PYALLOC_OK)
        throw std::runtime_error(api->last_error());
    } else {
      hooks::free(hooks::malloc(size, 0, 0), 0);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void bind_bench(py::module_& m) {
  m.def("bench_device_pairs", &run_device_pairs, py::arg("via"), py::arg("size"), py::arg("iterations"),
        py::call_guard<py::gil_scoped_release>(),
        "Runs iterations malloc+free pairs on device 0's pools through 'hooks' (the C hooks' "
        "logic) or 'bridge_api' (the bridge's C table); returns wall seconds. Use fake devices.");
  m.def("bench_pairs", &run_pairs, py::arg("allocator"), py::arg("sizes"), py::arg("iterations"),
        py::arg("threads") = 1, py::arg("window") = 1,
        py::call_guard<py::gil_scoped_release>(),
        "Runs iterations malloc+free pairs per thread in C++; returns wall seconds.");
}

}  // namespace pyalloc
