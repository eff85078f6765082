// Trace replay: runs a whole allocation trace against an Allocator without
// Python in the loop, so that recorded traces of millions of events replay in
// a fraction of a second and a budget search can replay them many times.
//
// A ReplayTrace is the trace reduced to allocator calls: "alloc id (size,
// stream)", "free id", and "free requested id": a free asked for while other
// streams still used the block (record_stream), whose "free id" comes later,
// when that work is done. Turning a PyTorch snapshot (addresses reused over
// time, blocks live before the ring buffer began) into this form is the
// Python side's job (pyalloc/replay/run.py); here ids are slots, checked once.
//
// A Replayer runs a ReplayTrace against one Allocator, in steps if the caller
// wants to look at the allocator at a given point (run(stop) then inspect, then
// run() on). A block whose free is requested stays allocated until its free,
// unless an allocation fails first: then, as an allocator's out-of-memory path
// does after waiting for the streams (pyalloc's release_cached, PyTorch's
// synchronize_and_free_events), every such block is freed at once and the
// allocation tried again; its later free does nothing. An allocation the
// allocator still cannot serve is counted and skipped, together with its later
// free; with stop_on_oom the replay stops there instead (a budget search only
// needs to know whether the trace fits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "core/allocator.h"

namespace pyalloc {

struct ReplayOp {
  /// kFreeRequested: the free of a live block was asked for while other
  /// streams still used it; its kFree (if any) follows when their work is done.
  enum Kind : uint8_t { kAlloc = 1, kFree = 2, kFreeRequested = 3 };
  Kind kind;
  uint32_t id;
  size_t size;    // requested bytes; for a free (requested), the size its alloc requested
  Stream stream;  // alloc only
};

class ReplayTrace {
 public:
  /// Checks that ids are below the number of ops, that every alloc names a
  /// free slot, every free a live one and every free request a live one whose
  /// free was not requested yet, and fills each free's size from its alloc.
  /// Throws std::invalid_argument naming the first bad op.
  explicit ReplayTrace(std::vector<ReplayOp> ops);

  const std::vector<ReplayOp>& ops() const { return ops_; }
  size_t size() const { return ops_.size(); }
  /// One more than the largest id used.
  size_t slots() const { return slots_; }
  size_t allocs() const { return allocs_; }

 private:
  std::vector<ReplayOp> ops_;
  size_t slots_ = 0;
  size_t allocs_ = 0;
};

/// A sample of the replay, taken every (trace size / points) ops.
struct TimelinePoint {
  uint64_t op;            // the last op of the interval
  int64_t live_max;       // the most requested bytes live during the interval
  int64_t reserved;       // reserved bytes after `op`
  int64_t allocated;      // allocated (rounded) bytes after `op`
};

class Replayer {
 public:
  /// Both must outlive the Replayer.
  Replayer(Allocator& allocator, const ReplayTrace& trace, bool stop_on_oom,
           size_t timeline_points);

  /// Runs ops [position(), stop). Returns false if it stopped at an
  /// out-of-memory (stop_on_oom only); every later call then does nothing.
  bool run(size_t stop);

  size_t position() const { return pos_; }
  uint64_t mallocs() const { return mallocs_; }
  /// Blocks freed (by their free op, or early: early_frees()).
  uint64_t frees() const { return frees_; }
  /// Blocks whose free was requested, freed before their free op because an
  /// allocation failed (their free op then does nothing).
  uint64_t early_frees() const { return early_frees_; }
  uint64_t ooms() const { return ooms_; }
  /// Frees not made because their allocation had failed.
  uint64_t skipped_frees() const { return skipped_frees_; }
  /// The op of the first out-of-memory, -1 if none.
  int64_t first_oom_op() const { return first_oom_op_; }
  /// Requested bytes of the allocations the allocator holds for the trace.
  int64_t live_bytes() const { return live_; }
  int64_t peak_live_bytes() const { return peak_live_; }
  /// Wall seconds spent in run().
  double seconds() const { return seconds_; }
  /// The allocator's num_device_alloc and num_device_free when the replay
  /// reached op size() / 2 (before running it); {-1, -1} until then.
  std::pair<int64_t, int64_t> device_calls_at_half() const { return calls_at_half_; }
  std::vector<TimelinePoint> timeline() const;

 private:
  /// False when the allocator could not serve it, even after the blocks
  /// whose free was requested were freed.
  bool alloc_one(const ReplayOp& op);
  bool try_alloc(const ReplayOp& op);
  void free_one(uint32_t id);
  /// Frees every block whose free was requested; false if there was none.
  bool free_requested_now();
  void sample(size_t op);

  Allocator& alloc_;
  const ReplayTrace& trace_;
  bool stop_on_oom_;
  size_t bucket_ = 0;  // ops per timeline point; 0: no timeline
  mutable std::mutex mu_;  // one run() at a time

  enum Held : uint8_t { kNotHeld, kHeld, kFreeWaits, kFreedEarly };
  std::vector<uintptr_t> ptr_;  // by id; 0 when not held
  std::vector<size_t> size_;    // by id: requested bytes of the block held
  std::vector<uint8_t> held_;   // by id, a Held: kHeld and kFreeWaits are held (size 0 included)
  std::vector<uint32_t> requested_;  // ids of kFreeRequested ops, in order (some freed since)
  size_t waiting_ = 0;               // ids in kFreeWaits
  size_t pos_ = 0;
  bool stopped_ = false;
  uint64_t mallocs_ = 0, frees_ = 0, early_frees_ = 0, ooms_ = 0, skipped_frees_ = 0;
  int64_t first_oom_op_ = -1;
  int64_t live_ = 0, peak_live_ = 0, bucket_live_max_ = 0;
  size_t half_ = 0;
  std::pair<int64_t, int64_t> calls_at_half_{-1, -1};
  double seconds_ = 0;
  std::vector<TimelinePoint> timeline_;
};

}  // namespace pyalloc
