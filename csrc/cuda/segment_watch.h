// Who learns of the memory pyalloc's pools map, as the driver maps it:
// PyTorch's allocator trace trackers, through the bridge. ProcessGroupNCCL
// attaches two (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, or a MemPool
// registered with a process group) that register each SEGMENT_ALLOC's range
// with NCCL and deregister it, by its address, at its SEGMENT_FREE; and it
// registers the segments of a snapshot when a communicator is made.
//
// So the units told are the units the driver maps and unmaps whole: a
// segment reserve() returned (bestfit, graph pools, the buffer pool) and a
// handle of pages (vmm). Each is told "mapped" once usable (a segment at
// once; a handle once its access is set: vmm_access), and "unmapping" before
// it is released, unmapped or detached to move elsewhere (vmm moves a handle
// as an unmapping here and a mapping there). A handle whose access was never
// set (refused, parked during a capture) is told nothing. So a range is
// registered once, and deregistered before its memory goes.
//
// Watchers run on the thread that maps or unmaps, with that pool's lock
// held: they must not allocate from pyalloc or call into its pools.
//
// Each unit also gets a number when it is mapped, from one count of the
// process: PyTorch's registration_counter (SegmentInfo), which it assigns
// when it obtains new memory from the driver (cudaMalloc, a new expandable
// segment) and by which ProcessGroupNCCL's registerMemPool orders the
// segments it registers, so that every rank registers them in the order they
// were made, whatever their addresses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace pyalloc {

struct SegmentEvent {
  int device;
  uintptr_t addr;
  size_t size;
  std::pair<uint64_t, uint64_t> pool;  // PyTorch's MempoolId_t of the pool ({0, 0}: the general pool)
  bool mapped;                         // false: about to be unmapped
};
using SegmentWatcher = void (*)(void* user, const SegmentEvent& event);

/// Sets the process's one watcher (nullptr: none). Returns once no call to
/// the previous one is under way.
void watch_segments(SegmentWatcher fn, void* user);

/// A unit mapped, and its number (the order of the mappings in the process).
struct MappedUnit {
  uintptr_t addr;
  size_t size;
  int64_t counter;
};

/// The units of one pool's backend that are mapped and told (PoolBackend's).
/// Its own lock: listed from outside the pool's lock (snapshots).
class MappedUnits {
 public:
  MappedUnits(int device, std::pair<uint64_t, uint64_t> pool) : device_(device), pool_(pool) {}

  /// A segment, usable now: told at once.
  void segment_mapped(uintptr_t addr, size_t size);
  /// A handle mapped at addr, not yet accessible: told once access() covers it.
  void handle_mapped(uintptr_t addr, size_t size);
  /// Access was set over [addr, addr + size): the handles mapped in it are told.
  void access(uintptr_t addr, size_t size);
  /// The unit at addr is about to go (released, unmapped, detached): told if
  /// it was told mapped; forgotten either way.
  void unmapping(uintptr_t addr);
  /// Every unit in [base, base + size) is about to go (a virtual range released).
  void unmapping_range(uintptr_t base, size_t size);
  /// The told units, by address.
  std::vector<MappedUnit> list() const;
  /// The number of the mapped unit (told or not) holding addr; -1 if none does.
  int64_t counter_at(uintptr_t addr) const;

 private:
  struct Unit {
    size_t size;
    int64_t counter;
  };
  void tell(uintptr_t addr, size_t size, bool mapped) const;

  int device_;
  std::pair<uint64_t, uint64_t> pool_;
  mutable std::mutex mu_;
  std::map<uintptr_t, Unit> told_;     // mapped and told
  std::map<uintptr_t, Unit> waiting_;  // mapped, waiting for access
};

}  // namespace pyalloc
