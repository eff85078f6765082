// The core's results as Python objects, shared by the bindings of the host
// and virtual Allocator (py_core.cpp) and of the CUDA pools (py_cuda.cpp),
// so that both speak PyTorch's vocabulary the same way.
#pragma once

#include <pybind11/pybind11.h>

#include <vector>

#include "core/allocator.h"

namespace pyalloc {

pybind11::dict config_dict(const Config& c);
/// torch.cuda.memory_stats() keys -> values.
pybind11::dict stats_dict(const Stats& s);
pybind11::dict fragmentation_dict(const FragmentationInfo& f);
/// Segments in the layout of torch.cuda.memory._snapshot()["segments"].
pybind11::list snapshot_list(const std::vector<SnapshotSegment>& segs, int device);
/// Trace entries in the layout of a snapshot's device_traces[device].
pybind11::list history_list(const std::vector<TraceEntry>& entries);

}  // namespace pyalloc
