// pyalloc's own out-of-memory observers: who hears of each out-of-memory
// error of a device's pools, whatever route the request came by (PyTorch's C
// hooks, the bridge's C table, the buffer pool of the Python API). A watcher
// that keeps the snapshot of a failing run attaches one (the Python binding
// wraps a callable: csrc/python/py_oom_observers.cpp).
//
// As PyTorch's allocator calls its OutOfMemoryObservers (c10/cuda/
// CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc): once per error,
// on the allocating thread, with every lock of the pools released (an
// observer takes the GIL, takes a snapshot, may allocate), before the error
// reaches the caller, whose error an observer never changes. The list is
// copied under its own lock and called outside it, so an observer may attach
// or detach observers, and one detached during a call finishes that call.
// A thread already inside an observer tells no one of its own errors: an
// observer that allocates and fails is not called again, and again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/common.h"

namespace pyalloc {

/// What the observers hear of an out-of-memory error, figures read once the
/// error was final: those the bridge passes to PyTorch's observers too
/// (bridge_api.h's pyalloc_oom_info).
struct OomReport {
  int device = -1;
  uint64_t requested = 0;     // bytes asked for
  uint64_t allocated = 0;     // bytes allocated on the device by pyalloc (all its pools)
  uint64_t reserved = 0;      // bytes reserved on the device by pyalloc
  uint64_t device_free = 0;   // the driver's free bytes (0 when unknown)
  uint64_t device_total = 0;  // the device's memory (0 when unknown)
  bool rejected = false;      // refused at once (OutOfMemoryError::rejected())
};

using OomObserver = std::function<void(const OomReport&)>;

/// Adds fn at the end of the list; the id that detaches it.
uint64_t attach_oom_observer(OomObserver fn);
/// Removes the observer of that id; false if none has it (detached already).
bool detach_oom_observer(uint64_t id);
/// Removes every observer (tests' reset; the Python binding at interpreter exit).
void detach_all_oom_observers();
/// The observers attached now, oldest first, with their ids.
std::vector<std::pair<uint64_t, std::shared_ptr<const OomObserver>>> oom_observers();

/// Calls every observer with `report`, oldest first, unless this thread is
/// inside an observer already. What one throws is said on stderr and goes no
/// further. Call it with no lock of the pools held.
void tell_oom_observers(const OomReport& report);

/// An out-of-memory error of a device's pools that its observers were told
/// of, with what they were told (the bridge's C table passes it on).
class DeviceOutOfMemoryError : public OutOfMemoryError {
 public:
  DeviceOutOfMemoryError(const std::string& what, const OomReport& report)
      : OutOfMemoryError(what, report.rejected), report_(report) {}
  const OomReport& report() const { return report_; }

 private:
  OomReport report_;
};

/// Tells the observers of `report` and throws the error `e` as a
/// DeviceOutOfMemoryError carrying it. An error told already goes on as it is.
[[noreturn]] void raise_observed(const OutOfMemoryError& e, const OomReport& report);

/// What the observers were told of `e`; for an error they were not told of,
/// the request alone (the figures unknown).
OomReport report_of(const OutOfMemoryError& e, int device, size_t requested);

}  // namespace pyalloc
