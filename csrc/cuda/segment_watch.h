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
// Watchers run with no pool lock held, so that one may allocate, free or take
// a lock that a thread waiting on a pool holds (PyTorch calls its trackers
// under its allocator's recursive mutex: there a tracker that allocates
// re-enters the allocator mid-operation, and one that takes a lock another
// thread holds while it allocates deadlocks). The pools queue each event
// under their lock, in the order they map and unmap, and every pools
// operation that queued one tells the queue, in that order, once it has
// released the pool's lock and before it returns (TellQueuedSegments),
// unless another thread is telling it then: that thread tells these too,
// and this one never waits for it (its watcher may be waiting for a lock
// this thread's caller holds). So:
// - a unit is told mapped before the operation that mapped it returns, or
//   while another thread tells the queue, right after that thread's current
//   event (until then NCCL sees the buffer unregistered: its slower path);
// - a unit is told unmapping before any unit mapped after it is told (one
//   order for the process), so before pyalloc maps anything at its address
//   again; but after the driver has the memory back, not before (PyTorch
//   tells SEGMENT_FREE before its cudaFree, and SEGMENT_UNMAP of an
//   expandable segment after it unmaps). A watcher must not touch the memory
//   of an unmapping unit; NCCL's deregistration does not. The exception is
//   a segment of a MemPool's own allocator (ncclMemAlloc): its free waits in
//   the queue behind its event, so it is deregistered before ncclMemFree, as
//   NCCL asks; the pool's budget counts it free from the release on.
// A watcher that allocates through pyalloc from inside its call gets its
// memory at once; the units that call maps are told after the watcher
// returns, by the same loop, still in order.
//
// Each unit also gets a number when it is mapped, from one count of the
// process: PyTorch's registration_counter (SegmentInfo), which it assigns
// when it obtains new memory from the driver (cudaMalloc, a new expandable
// segment) and by which ProcessGroupNCCL's registerMemPool orders the
// segments it registers, so that every rank registers them in the order they
// were made, whatever their addresses.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
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

/// Tells the watcher, on this thread, every event queued so far if this
/// thread queued one not yet told; call with no pool lock held. If another
/// thread is telling meanwhile (or this one is, inside a watcher's call),
/// returns at once: that loop tells the rest, in order.
void tell_queued_segments() noexcept;

/// Tells the queued events when it goes: the first line of every pools
/// operation that may map or unmap, so that they are told once its locks are
/// released. While nothing is queued, two loads.
namespace segment_watch_detail {
// The number of the last event queued, and of the last told (segment_watch.cpp).
extern std::atomic<uint64_t> queued_so_far;
extern std::atomic<uint64_t> told;
}  // namespace segment_watch_detail

class TellQueuedSegments {
 public:
  TellQueuedSegments() = default;
  // Inline, and no thread-local read, while every event queued is told: the
  // common case, and a cost on every malloc and free.
  ~TellQueuedSegments() {
    if (segment_watch_detail::queued_so_far.load(std::memory_order_acquire) >
        segment_watch_detail::told.load(std::memory_order_acquire))
      tell_queued_segments();
  }
  TellQueuedSegments(const TellQueuedSegments&) = delete;
  TellQueuedSegments& operator=(const TellQueuedSegments&) = delete;
};

/// Tests: the events queued and not yet told (all threads).
size_t queued_segment_events();

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
  /// it was told mapped; forgotten either way. `then`, if given, releases it:
  /// run once it is told (a MemPool's own allocator's free, which must come
  /// after the deregistration), or at once if nothing is to be told.
  void unmapping(uintptr_t addr, std::function<void()> then = {});
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
