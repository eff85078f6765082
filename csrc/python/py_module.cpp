// The pybind11 module pyalloc._C. The same shared library is what PyTorch
// loads as a pluggable allocator, so it must import without CUDA or torch.
#include "py_bindings.h"

#ifndef PYALLOC_VERSION
#define PYALLOC_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyalloc's C++ allocator core";
  m.attr("__version__") = PYALLOC_VERSION;
  pyalloc::bind_core(m);
  pyalloc::bind_bench(m);
  pyalloc::bind_replay(m);
  pyalloc::bind_cuda(m);
  pyalloc::bind_oom_observers(m);
}
