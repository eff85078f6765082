// The allocator's statistics, declared once, with PyTorch's names and
// meanings (torch.cuda.memory_stats()).
//
// A count (Stat) has current / peak / allocated (sum of increments) / freed
// (sum of decrements). A StatArray keeps one count per pool plus their sum
// ("all", "small_pool", "large_pool"); "all" is a count of its own, so its
// peak is the peak of the sum, as in PyTorch, not the sum of the peaks. The
// counters only grow.
//
// Peaks are settled once per operation (Stats::settle(), at the end of each
// public call of the Allocator): one malloc may grow a segment and lend part
// of it to the small pool, or map pages and split them, and the steps in
// between are no state anyone can observe. PyTorch applies such changes with
// their net effect too. Only a count that rose can pass its peak, so only the
// arrays an increment touched since the last settle are settled: a free, which
// mostly lowers counts, settles next to nothing (callgrind: a quarter of a
// cached 4 KiB malloc+free pair went to settling every peak twice).
//
// Meanings, as in PyTorch:
//   allocation / allocated_bytes   user blocks not yet freed by the caller
//   active / active_bytes          user blocks not yet reusable (allocated,
//                                  or freed but waiting on streams)
//   segment / reserved_bytes       large pool: memory from the backend, minus
//                                  the chunks lent to the small pool, counted
//                                  as contiguous runs (as a snapshot lists
//                                  them: one per backend segment, or per
//                                  mapped run of the vmm range, split by the
//                                  chunks in it); small pool: those chunks
//   num_oom_rejections             OOMs refused at once, before anything was tried (the cap, the
//                                  device's known free memory, a size no device holds)
//   inactive_split(_bytes)         free blocks in segments that are split
//                                  (none under vmm: PyTorch leaves out its
//                                  expandable segments, whose free pages
//                                  empty_cache gives back)
//   requested_bytes                sizes as requested, before rounding, of
//                                  the active blocks (pending frees too)
//   oversize_*                     blocks / segments of max_split_size or more
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "block.h"
#include "lock.h"

namespace pyalloc {

class Allocator;

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;  // sum of increments
  int64_t freed = 0;      // sum of decrements

  void add(int64_t n) {
    current += n;
    if (n > 0) allocated += n;
    else freed -= n;
  }
  void settle() { peak = current > peak ? current : peak; }
  void reset_peak() { peak = current; }
  /// allocated and freed start again from 0 (PyTorch's resetAccumulatedStats).
  void reset_accumulated() { allocated = freed = 0; }
};

struct StatArray {
  Stat all, small, large;
  bool risen = false;  // an increment since the last settle()

  void add(Pool pool, int64_t n) {
    all.add(n);
    (pool == kSmallPool ? small : large).add(n);
    if (n > 0) risen = true;
  }
  /// n moves from one pool to the other: `all` sees it leave and come back,
  /// keeping all = small + large for current, allocated and freed.
  void move(Pool from, Pool to, int64_t n) {
    add(from, -n);
    add(to, n);
  }
  /// The peaks catch up with the counts, if any rose since the last settle.
  void settle() {
    if (!risen) return;
    risen = false;
    all.settle();
    small.settle();
    large.settle();
  }
  void reset_peak() {
    all.reset_peak();
    small.reset_peak();
    large.reset_peak();
  }
  void reset_accumulated() {
    all.reset_accumulated();
    small.reset_accumulated();
    large.reset_accumulated();
  }
};

struct Stats {
  StatArray allocation, segment, active, inactive_split;
  StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes,
      requested_bytes;
  Stat oversize_allocations, oversize_segments;
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
  int64_t num_sync_all_streams = 0;
  int64_t num_device_alloc = 0;
  int64_t num_device_free = 0;
  // The driver calls the CUDA backend makes for the device calls above:
  // cuMemAlloc or cuMemFree per segment (refused ones too); per mapped handle
  // cuMemCreate and cuMemMap (a refused mapping: one cuMemCreate), one
  // cuMemSetAccess per range of handles mapped at once, per unmapped handle
  // cuMemUnmap and cuMemRelease (a handle moving out of a hole: cuMemUnmap,
  // then cuMemMap at its new address, or cuMemRelease if the new range has
  // no use for it); cuMemAddressReserve for the virtual range. The core
  // counts by these rules on every backend, and a backend that asked the
  // driver more or less on some path (a refused cuMemMap, peers refused, a
  // refusal with no call; on CUDA, the device's trial mapping, once, in the
  // first of its pools to map or reserve) says so
  // (Backend::take_uncounted_calls()). Not in torch.
  int64_t num_driver_calls = 0;
  int64_t num_oom_rejections = 0;  // OOMs refused at once (OutOfMemoryError::rejected())
  int64_t max_split_size = 0;

  /// Every peak catches up with its current value: the end of an operation.
  void settle() {
    allocation.settle();
    segment.settle();
    active.settle();
    inactive_split.settle();
    allocated_bytes.settle();
    reserved_bytes.settle();
    active_bytes.settle();
    inactive_split_bytes.settle();
    requested_bytes.settle();
    oversize_allocations.settle();
    oversize_segments.settle();
  }
  void reset_peak();
  /// Counters and every allocated / freed sum start again from 0.
  void reset_accumulated();
  /// Flat "family.pool.metric" -> value pairs, sorted by key like torch's.
  std::vector<std::pair<std::string, int64_t>> flatten() const;
};

/// The stats of several allocators as one, as PyTorch keeps one DeviceStats
/// for all the pools of a device. Only the current counts go through the
/// sink, at the end of every operation of each allocator: the peaks of their
/// sum must be taken as they happen (never a sum of the allocators' peaks).
/// The sums that only grow (allocated, freed, the counters) are added up when
/// read, from the allocators' own stats and those of allocators retired.
///
/// While one allocator (the device's general pool: set_solo()) is the only
/// one with any count, the sum is its own stats, peaks included, and it
/// pushes nothing: a cached malloc+free pair through a device's pools cost
/// 1700 instructions against the core's 940, 400 of them carrying 33 counts
/// to the sink twice (callgrind, benchmarks/bench_core_instructions.py).
/// The first push of another allocator with a count ends that for good: it
/// takes the solo allocator's lock and gives the sink its counts and peaks
/// (Allocator::join_sink), then carries its own as usual.
class StatsSink {
 public:
  /// `solo` (set before any other allocator counts anything) need not push
  /// while the others have no count; its stats stand for the sum.
  void set_solo(Allocator* solo) { solo_.store(solo, std::memory_order_release); }
  /// Whether `pusher` may skip its push: it is the solo allocator. Read
  /// under `pusher`'s lock, under which join() ends solo.
  bool skips(const Allocator* pusher) const { return solo_.load(std::memory_order_acquire) == pusher; }
  /// Adds the change of the current counts from `*last` to `now`, settles
  /// the peaks, and brings `*last`'s current counts to `now`'s. Called under
  /// the pushing allocator's lock; takes only the sink's own, and the solo
  /// allocator's when this push ends solo (the solo allocator never waits
  /// for another allocator's lock under its own).
  void push(const Allocator* pusher, const Stats& now, Stats* last);
  /// Ends solo, under the solo allocator's lock: the sink takes its current
  /// counts and peaks (`now`, whose peaks are the sum's so far) and `*last`
  /// becomes `now`. Nothing if `solo` is not (any more) the solo allocator.
  void join(const Allocator* solo, const Stats& now, Stats* last);
  /// The allocators' stats as one: the sink's current counts and peaks (the
  /// solo allocator's, pools.front(), while it is alone), the sums of
  /// `pools` (each allocator's stats(), the solo one's first) and of the
  /// retired ones. max_split_size is left to the caller.
  Stats read(const std::vector<Stats>& pools) const;
  /// An allocator detached for good (its current counts all 0): its sums
  /// stay in the device's.
  void retire(const Stats& final);
  void reset_peak();
  /// The retired allocators' sums start again from 0 (each live allocator
  /// resets its own).
  void reset_accumulated();

 private:
  mutable Lock mu_;
  std::atomic<Allocator*> solo_{nullptr};
  Stats total_;    // current counts and their peaks (once solo has ended)
  Stats retired_;  // allocated / freed sums and counters of retired allocators
};

}  // namespace pyalloc
