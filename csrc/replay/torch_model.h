// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp,
// as in torch 2.11-2.13), default and with expandable_segments:True, under the
// settings a snapshot records (TorchAllocatorSettings), run over the same
// ReplayTrace as pyalloc's replay, so that the replay can set pyalloc beside the
// allocator a user would otherwise run, at equal budgets.
//
// It is a policy of its own, not pyalloc's core: it keeps PyTorch's blocks
// (two pools, free blocks ordered by stream, size, address; blocks split and
// merged inside their segment) and models the device's addresses itself, so it
// needs no Backend. What it reproduces, and how it is checked against real
// snapshots (the recorded segment_alloc / segment_free / segment_map /
// segment_unmap calls, in order), is written in csrc/replay/README.md.
//
// Policy, in short:
// - Requests round up to 512 B (or to a power-of-two division, with
//   roundup_power2_divisions); rounded <= 1 MiB go to the small pool, the
//   rest to the large pool. Free blocks are reused only on their own stream:
//   best fit by size, ties to the lowest address; with max_split_size_mb,
//   blocks of that size or more serve only requests as large, within
//   max_non_split_rounding, and are not split.
// - Default: a miss calls cudaMalloc for a segment of 2 MiB (small pool),
//   20 MiB (requests under 10 MiB; large_segment_size_mb) or the request
//   rounded up to 2 MiB. A block is split when the rest is >= 512 B (small
//   pool) or > 1 MiB (large pool, requests under max_split_size).
// - Expandable: one virtual range per (pool, stream), pages of 2 MiB (small)
//   or 20 MiB (large; large_segment_size_mb) mapped on demand; a miss maps
//   only what the lowest free run in front of unmapped space lacks; best fit
//   counts a free block followed by unmapped space as that much bigger; rests
//   of 512 B or more are split off.
// - Out of memory (a capacity given): with max_split_size_mb,
//   release_available_cached_blocks (oversize free segments, enough to cover
//   the request) and a try; then release_cached_blocks (first the blocks whose
//   free was requested while other streams used them are freed, as PyTorch's
//   synchronize_and_free_events does once it has waited for the streams; then
//   every wholly free segment of every pool and stream, or every whole page
//   inside a free block, is released) and one more try, then the allocation is
//   refused. Such a block is otherwise freed at its kFree op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/common.h"
#include "replay/replay.h"

namespace pyalloc {

/// A device call of the model, with the action codes of a snapshot's trace
/// (pyalloc/replay/snapshot_io.py): 3 segment_alloc, 4 segment_free, 5 segment_map,
/// 6 segment_unmap.
struct ModelCall {
  enum Kind : uint8_t { kSegmentAlloc = 3, kSegmentFree = 4, kSegmentMap = 5, kSegmentUnmap = 6 };
  Kind kind;
  uint64_t op;     // the trace op being served, or before which a release ran
  uintptr_t addr;
  size_t size;
};

/// A segment that exists before the trace's first op (default policy only).
struct SeedSegment {
  uintptr_t addr;
  size_t size;
  Stream stream;
  bool small;  // in the small pool
};

/// The settings of PyTorch's allocator (PYTORCH_CUDA_ALLOC_CONF) the model
/// honours, as a snapshot records them; the defaults are PyTorch's.
struct TorchAllocatorSettings {
  /// max_split_size_mb: free blocks of at least this size serve only requests of
  /// at least this size, within max_non_split_rounding, and are never split;
  /// SIZE_MAX: unset.
  size_t max_split_size = SIZE_MAX;
  /// max_non_split_rounding_mb; 0: large_segment_size (PyTorch's default).
  size_t max_non_split_rounding = 0;
  /// large_segment_size_mb: the segment of requests of 1-10 MiB and the large
  /// pool's expandable page.
  size_t large_segment_size = 20 << 20;
  /// roundup_power2_divisions per power-of-two interval from 1 MiB (16 of them,
  /// the last open-ended); empty, 0 or 1: sizes round up to 512 B only.
  std::vector<size_t> roundup_power2_divisions;
};

struct TorchModelOptions {
  bool expandable = false;
  TorchAllocatorSettings settings;
  /// Device bytes; 0: unbounded (cudaMalloc and page mapping never fail).
  size_t capacity = 0;
  /// Stop at the first refused allocation (a budget search only needs to know).
  bool stop_on_oom = false;
  /// Keep every device call in the result (for validation against a snapshot).
  bool record_calls = false;
  /// Segments present before op 0, counted neither as calls nor in the
  /// second half; default policy only.
  std::vector<SeedSegment> seed;
  /// By op: for an alloc, the address it had in the recording (non-zero: the
  /// block is placed there, inside a seeded segment); empty for none.
  std::vector<uintptr_t> place_at;
  /// Ops before which release_cached_blocks runs: the recording run's own
  /// releases (empty_cache, its out-of-memory retries), ascending.
  std::vector<uint64_t> releases;
  /// The addresses the driver returned, by cudaMalloc ordinal: (size, address).
  /// Used for the k-th cudaMalloc when the sizes agree and the range is free;
  /// otherwise the model takes the highest free range (the Linux driver hands
  /// out successive addresses mostly downwards).
  std::vector<std::pair<size_t, uintptr_t>> malloc_hints;
};

struct TorchModelResult {
  bool completed = true;
  uint64_t ooms = 0;
  int64_t first_oom_op = -1;
  int64_t peak_reserved = 0;
  /// Segments and page ranges reserved (cudaMalloc, map_block) plus released
  /// (cudaFree, unmap_block): PyTorch's num_device_alloc + num_device_free.
  uint64_t device_calls = 0;
  /// The same from op size() / 2 on; -1 if the replay stopped before.
  int64_t second_half_device_calls = -1;
  /// cudaMalloc / cudaFree (a refused cudaMalloc included); cuMemAddressReserve
  /// per expandable range; cuMemCreate / cuMemMap per page mapped and one
  /// cuMemSetAccess per mapping (2k + 1 for k pages, as PyTorch's
  /// mapAndSetAccess); cuMemUnmap / cuMemRelease per page unmapped (and the
  /// creates and releases of a mapping that failed).
  uint64_t driver_calls = 0;
  /// Out-of-memory retries taken (release_cached_blocks, then try again).
  uint64_t retries = 0;
  /// Blocks whose free was requested (kFreeRequested), freed by
  /// release_cached_blocks before their free op.
  uint64_t early_frees = 0;
  /// Seeded allocs that found no free block at their address (served normally).
  uint64_t misplaced = 0;
  double seconds = 0;
  std::vector<ModelCall> calls;
};

/// Replays `trace` through the model. Throws std::invalid_argument for
/// options that do not fit the trace (place_at of another length, unsorted
/// releases, seeds with expandable segments, overlapping seeds).
TorchModelResult run_torch_model(const ReplayTrace& trace, const TorchModelOptions& options);

}  // namespace pyalloc
