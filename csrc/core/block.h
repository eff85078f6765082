// Blocks and segments: the bookkeeping the core keeps beside (never inside)
// the memory it manages.
//
// A Segment is a contiguous range: either memory reserved from the backend
// (a large-pool segment) or a small-pool chunk carved out of a large-pool
// block. Its blocks tile it in address order through prev/next.
//
// Invariants (check_invariants() verifies every one):
// - the blocks of a segment tile it: first->addr == base, each block starts
//   where its predecessor ends, the sizes sum to the segment's size;
// - no two address-adjacent free blocks belong to the same stream (they are
//   merged on free; blocks of different streams merge only once one of them
//   is safe for the other's stream, so such neighbours may wait);
// - a block is in exactly one free index iff it is free, the index of its
//   pool and stream, in the bin of its size;
// - every allocated or pending-free user block is in the pointer map, and
//   nothing else is;
// - a chunk's parent is an allocated large block of the same range whose
//   `chunk` points back at it, and is not in the pointer map;
// - in a virtual-memory segment, unmapped blocks are free, page-aligned, in
//   the allocator's unmapped map and no free index, and never adjacent to
//   another unmapped block; every page under a non-free block is mapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"

namespace pyalloc {

enum class BlockState : uint8_t {
  kFree,         // in a free index, reusable
  kAllocated,    // handed out (a user allocation, or a chunk's parent)
  kPendingFree,  // freed by the user; waits for streams from record_stream()
};

enum Pool : int { kSmallPool = 0, kLargePool = 1 };

struct Segment;

struct Block {
  uintptr_t addr = 0;
  size_t size = 0;        // rounded, a multiple of kGranularity
  size_t requested = 0;   // what the caller asked for (user blocks only)
  Block* prev = nullptr;  // address neighbours inside the segment
  Block* next = nullptr;
  Block* bin_prev = nullptr;  // free-index list links (free blocks only)
  Block* bin_next = nullptr;
  Segment* segment = nullptr;
  // Allocated: the stream it was allocated on. Free: the stream whose queued
  // work may still use it; other streams may take it once
  // free_seq <= that stream's ready_seq (see allocator.h).
  Stream stream = 0;
  uint64_t free_seq = 0;
  int32_t bin = -1;        // free-index bin while free
  BlockState state = BlockState::kFree;
  Segment* chunk = nullptr;  // large blocks lent to the small pool: the chunk
  // False only for free, page-aligned ranges of a virtual-memory segment that
  // have no physical pages behind them; such blocks are in no free index.
  bool mapped = true;
  // User blocks: the caller's tag for the allocation (a stack trace the
  // caller keeps, e.g. PyTorch's memory-history context); 0 for none.
  uint64_t context = 0;
  std::vector<Stream> uses;  // extra streams from record_stream()

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool free_mapped() const { return state == BlockState::kFree && mapped; }
  uintptr_t end() const { return addr + size; }
};

struct Segment {
  uintptr_t base = 0;
  size_t size = 0;
  Pool pool = kLargePool;
  Block* first = nullptr;
  Block* parent = nullptr;  // chunks only: the large block holding this chunk
  bool vmm = false;         // a virtual range whose pages are mapped on demand
  uint64_t id = 0;
  Stream stream = 0;        // the stream whose request created it
  size_t index = 0;         // chunks: position in the allocator's chunk list

  bool wholly_free() const {
    return first->state == BlockState::kFree && first->next == nullptr;
  }
};

}  // namespace pyalloc
