// The narrow interface between the allocator core and whatever provides memory.
//
// Contract, for every backend:
// - reserve(size) returns the base of `size` fresh bytes, aligned to at least
//   kGranularity, or 0 when the memory is not available. It never throws for
//   lack of memory; the core decides what an out-of-memory means.
// - release(base, size) takes back exactly a range reserve() returned.
// - Events order the host against a stream: record_event(s) marks the point
//   reached by the work queued on s so far; event_done() says whether s has
//   passed it; event_wait() blocks until it has, and returns false if it
//   cannot wait (the event could not be recorded yet): the event is then not
//   done; event_free() recycles it.
//   An event recorded later on a stream completes no earlier than one
//   recorded before it.
// - is_capturing(s): true while s is being captured into a CUDA graph. The
//   core then calls none of reserve/release/record/query/wait for that stream.
//   capture_underway(): a capture is underway anywhere in the process (CUDA's
//   global capture mode): the core then releases and unmaps nothing.
//   grows_while_capturing(): reserve() and vmm_map() may still be called
//   then (the backend makes them legal during a capture), so a capture can
//   grow the pool; events and releases stay forbidden.
// - Virtual memory (optional; vmm_page_size() == 0 means none): an address
//   range is reserved without memory (vmm_reserve), and physical memory is
//   mapped into page-aligned parts of it: vmm_map maps one physical
//   allocation (a handle) of the given size, a multiple of the page (false
//   when no memory is left; nothing is mapped then), not yet accessible;
//   vmm_access then makes a range of consecutive handles vmm_map mapped
//   accessible at once (one cuMemSetAccess for all of them, as PyTorch's
//   expandable segments call it; false when no memory is left: the core then
//   unmaps those handles, except during a capture, when they stay mapped,
//   parked, as they do when vmm_access throws then, until the core unmaps
//   them after it); vmm_unmap takes one such handle out whole (the
//   addr and size vmm_map was given) and returns its memory to the backend.
//   The core unmaps only pages no queued work can still touch.
//   Moving a handle (optional; vmm_moves() false: the core never asks):
//   vmm_detach unmaps one handle whole as vmm_unmap does but keeps its
//   memory as a spare of its size (cuMemUnmap without cuMemRelease; false:
//   the handle is unmapped and released, as by vmm_unmap, and kept as none);
//   vmm_attach maps a spare of exactly `size` at addr (cuMemMap; not yet
//   accessible, as after vmm_map; false, with no driver call made, when it
//   may not map now (a capture underway) or holds no spare of that size; a
//   failed mapping throws, the handle still a spare); vmm_drop returns the
//   memory of one spare of `size` to the backend (cuMemRelease). A spare's
//   memory stays in use by the process.
// - take_uncounted_calls(): the driver calls made (positive) or not made
//   (negative) since last asked, beyond what the core counts for the calls
//   it makes: one cuMemAlloc per reserve(), one cuMemCreate for a vmm_map
//   that returns false, a cuMemCreate and a cuMemMap for one that maps, none
//   for one that throws, one cuMemSetAccess per vmm_access, a cuMemMap per
//   vmm_attach that maps, none for one that refuses or throws. The core adds
//   them to num_driver_calls, so that it counts what the driver was asked.
// - Sharing with another process (optional; the defaults refuse, saying
//   why): share_segment(base, size) makes a segment reserve() returned
//   shareable as a whole, as an opaque token of the backend's;
//   vmm_share(addr, size) makes one handle vmm_map mapped shareable, as a
//   file descriptor the caller owns. The core asks only while a live
//   allocation lies in that memory (Allocator::share), so the memory stays
//   where it is meanwhile.
// - The core calls a backend with its own lock held, from any thread; a
//   backend needs a lock of its own only for state that tests or other
//   callers touch from outside the core.
//
// The core never reads or writes the memory it manages: addresses are numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common.h"

namespace pyalloc {

using EventId = uint64_t;
class SimStreams;

/// Backend memory made shareable with another process (Backend::share_segment,
/// Backend::vmm_share): the range [addr, addr + size) of this process, and what
/// another process needs to open it: the backend's opaque token, or a file
/// descriptor that the caller owns (closes).
struct SharedMemory {
  uintptr_t addr = 0;
  size_t size = 0;
  std::string token;
  int fd = -1;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual const char* name() const = 0;

  virtual uintptr_t reserve(size_t size) = 0;
  virtual void release(uintptr_t base, size_t size) = 0;

  /// Free and total memory of the device behind the backend, for messages
  /// and caps; total == 0 means unbounded.
  virtual void mem_info(size_t* free_bytes, size_t* total_bytes) = 0;
  /// The most all of the pools on this backend's device may reserve together
  /// (PyTorch's memory fraction), below the device's total; 0: no such cap.
  virtual size_t shared_cap() { return 0; }

  virtual EventId record_event(Stream stream) = 0;
  virtual bool event_done(EventId event) = 0;
  virtual bool event_wait(EventId event) = 0;
  virtual void event_free(EventId event) = 0;

  virtual bool is_capturing(Stream /*stream*/) { return false; }
  virtual bool capture_underway() { return false; }
  virtual bool grows_while_capturing() { return false; }

  virtual size_t vmm_page_size() { return 0; }
  // Mapping is known to work (the backend mapped a trial page itself, or
  // cannot fail to): the core maps no trial page of its own per pool.
  virtual bool vmm_proven() { return false; }
  virtual uintptr_t vmm_reserve(size_t /*size*/) { return 0; }
  virtual void vmm_release(uintptr_t /*base*/, size_t /*size*/) {}
  virtual bool vmm_map(uintptr_t /*addr*/, size_t /*size*/) { return false; }
  // No default: a backend that wraps another must pass this call on.
  virtual bool vmm_access(uintptr_t addr, size_t size) = 0;
  virtual void vmm_unmap(uintptr_t /*addr*/, size_t /*size*/) {}
  virtual bool vmm_moves() { return false; }
  virtual bool vmm_detach(uintptr_t /*addr*/, size_t /*size*/) { return false; }
  virtual bool vmm_attach(uintptr_t /*addr*/, size_t /*size*/) { return false; }
  virtual void vmm_drop(size_t /*size*/) {}
  virtual int64_t take_uncounted_calls() { return 0; }

  /// False, with *why, when the memory cannot be shared (the default).
  virtual bool share_segment(uintptr_t /*base*/, size_t /*size*/, SharedMemory* /*out*/,
                             std::string* why) {
    *why = std::string("memory of the ") + name() + " backend cannot be shared with another process";
    return false;
  }
  virtual bool vmm_share(uintptr_t /*addr*/, size_t /*size*/, SharedMemory* /*out*/, std::string* why) {
    *why = std::string("pages of the ") + name() + " backend cannot be shared with another process";
    return false;
  }

  /// The test-controllable streams of a simulated backend; null on a device.
  virtual SimStreams* sim_streams() { return nullptr; }
};

/// Real host memory (mmap), with simulated streams: see sim_streams.h.
std::unique_ptr<Backend> make_host_backend(size_t capacity);

/// Addresses only: nothing is mapped, nothing is touched. `capacity` bounds
/// the bytes reserved at once (0 = unbounded). For trace replay of any size.
/// `page_size`: the granularity of its virtual-memory pages, CUDA's 2 MiB
/// unless asked otherwise (a power of two from 4 KiB to 1 GiB: what-if
/// replays of a device with other pages); std::invalid_argument otherwise.
std::unique_ptr<Backend> make_virtual_backend(size_t capacity, size_t page_size = kSegmentAlign);

}  // namespace pyalloc
