// A best-fit index over the free blocks of one pool and one stream.
//
// Blocks sit in intrusive lists, one per size bin. Bins are exact below
// 16 KiB (32 units of 512 B) and 32 to an octave above, so one bin spans at
// most 3.1% of sizes. Bin edges sit one unit above the round sizes, so that a
// power-of-two block and what is left of it after a small split share a bin,
// and resize() keeps the block where it is: on the malloc+free hot path a
// split and its merge then touch no list. (With 64 bins to an octave, a 4 KiB
// split of a 512 KiB chunk changed bins twice per pair: +23% instructions.)
// A two-level bitmap finds the next non-empty bin in a few instructions.
// best_fit() is exact: it scans the request's own bin for the smallest block
// that fits and, failing that, the next non-empty bin, all of whose blocks
// fit, for its smallest. Scans stop at an exact fit, unless the index breaks
// ties by address (lowest_ties()): then the lowest of the exact fits, as
// PyTorch's allocator picks among free blocks of one size. In the vmm
// strategy's large pool the choice decides where the pool grows next, and
// any first exact fit made it grow at other times than expandable segments'
// on the same trace (two more device calls in the second half of
// gpt2-varlen-train, in replay); the small pool's exact bins may hold
// thousands of blocks of one size, so it stops at the first.
#pragma once

#include <cstddef>
#include <cstdint>

#include "block.h"

namespace pyalloc {

class FreeIndex {
 public:
  static constexpr int kSubBinBits = 5;
  static constexpr int kSubBins = 1 << kSubBinBits;
  static constexpr int kNumBins = 1664;  // any size_t: units of 512 B below 2^55
  static constexpr int kWords = kNumBins / 64;
  static_assert(kWords <= 64, "the summary word has one bit per word of bins");

  FreeIndex();

  static int bin_of(size_t size);

  void insert(Block* b);
  void remove(Block* b);
  /// Changes a listed block's size, moving it only if its bin changes (to
  /// the head of its new bin, as remove() then insert() would).
  void resize(Block* b, size_t size) {
    int bin = bin_of(size);
    bytes_ += size - b->size;
    b->size = size;
    if (bin != b->bin) relink(b, bin);
  }

  /// Of the blocks of the smallest size that fits, best_fit() returns the
  /// lowest from now on (not the first found).
  void lowest_ties() { lowest_ties_ = true; }

  /// The smallest block of at least `size` that `accept` takes, or null.
  template <typename Accept>
  Block* best_fit(size_t size, Accept accept) const;

  size_t count() const { return count_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return count_ == 0; }
  Block* head(int bin) const { return heads_[bin]; }
  /// Whether the bitmap marks exactly the non-empty bins (for invariants).
  bool marks_match() const;
  /// Largest block in the index (linear in the bins; for stats).
  Block* largest() const;

  /// Calls f on every block in the bins that can hold min_size or more
  /// (blocks a little smaller may be included: callers check sizes).
  template <typename F>
  void for_each_from(size_t min_size, F f) const {
    for (int bin = next_nonempty(bin_of(min_size)); bin >= 0; bin = next_nonempty(bin + 1))
      for (Block* b = heads_[bin]; b != nullptr; b = b->bin_next) f(b);
  }

  template <typename F>
  void for_each(F f) const {
    for (int w = 0; w < kWords; ++w)
      for (uint64_t bits = words_[w]; bits != 0; bits &= bits - 1)
        for (Block* b = heads_[(w << 6) + __builtin_ctzll(bits)]; b != nullptr; b = b->bin_next) f(b);
  }

 private:
  int next_nonempty(int from) const;
  // The list and bitmap steps of remove() and insert(), without the counts:
  // a split or merge that changes a block's bin (a 20 MiB page split for an
  // 8 MiB request) moves it on every malloc+free pair.
  void unlink(Block* b);
  void link(Block* b, int bin);
  void relink(Block* b, int bin);

  Block* heads_[kNumBins];
  uint64_t words_[kWords];
  uint64_t summary_;
  size_t count_ = 0;
  size_t bytes_ = 0;
  bool lowest_ties_ = false;
};

inline int FreeIndex::bin_of(size_t size) {
  uint64_t u = size / kGranularity - 1;
  if (u < kSubBins) return static_cast<int>(u);
  int fl = 63 - __builtin_clzll(u);
  int sl = static_cast<int>((u >> (fl - kSubBinBits)) & (kSubBins - 1));
  return (fl - kSubBinBits + 1) * kSubBins + sl;
}

inline int FreeIndex::next_nonempty(int from) const {
  if (from >= kNumBins) return -1;
  int w = from >> 6;
  uint64_t bits = words_[w] & (~uint64_t(0) << (from & 63));
  if (bits) return (w << 6) + __builtin_ctzll(bits);
  if (w + 1 >= kWords) return -1;
  uint64_t rest = summary_ & (~uint64_t(0) << (w + 1));
  if (!rest) return -1;
  w = __builtin_ctzll(rest);
  return (w << 6) + __builtin_ctzll(words_[w]);
}

template <typename Accept>
Block* FreeIndex::best_fit(size_t size, Accept accept) const {
  for (int bin = next_nonempty(bin_of(size)); bin >= 0; bin = next_nonempty(bin + 1)) {
    Block* best = nullptr;
    for (Block* b = heads_[bin]; b != nullptr; b = b->bin_next) {
      if (b->size < size || !accept(b)) continue;
      if (best == nullptr || b->size < best->size ||
          (b->size == best->size && b->addr < best->addr)) {
        best = b;
        if (b->size == size && !lowest_ties_) break;  // nothing fits better
      }
    }
    if (best != nullptr) return best;
  }
  return nullptr;
}

}  // namespace pyalloc
