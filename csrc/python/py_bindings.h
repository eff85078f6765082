// Each part of the pybind11 module registers itself through one of these, so
// the module's parts stay in the files of the code they expose.
#pragma once

#include <pybind11/pybind11.h>

namespace pyalloc {

void bind_core(pybind11::module_& m);   // py_core.cpp: Allocator, config, errors
void bind_bench(pybind11::module_& m);  // bench.cpp: C++ timing loops
void bind_replay(pybind11::module_& m);  // py_replay.cpp: trace replay
void bind_cuda(pybind11::module_& m);   // py_cuda.cpp: the CUDA pools behind PyTorch
void bind_oom_observers(pybind11::module_& m);  // py_oom_observers.cpp: out-of-memory observers

}  // namespace pyalloc
