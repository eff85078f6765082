// The per-stream best-fit index: see free_index.h.
#include "free_index.h"

#include <cstring>

namespace pyalloc {

FreeIndex::FreeIndex() {
  std::memset(heads_, 0, sizeof(heads_));
  std::memset(words_, 0, sizeof(words_));
  summary_ = 0;
}

inline void FreeIndex::link(Block* b, int bin) {
  b->bin = bin;
  b->bin_prev = nullptr;
  b->bin_next = heads_[bin];
  if (heads_[bin] != nullptr) heads_[bin]->bin_prev = b;
  heads_[bin] = b;
  words_[bin >> 6] |= uint64_t(1) << (bin & 63);
  summary_ |= uint64_t(1) << (bin >> 6);
}

inline void FreeIndex::unlink(Block* b) {
  int bin = b->bin;
  if (b->bin_prev != nullptr) {
    b->bin_prev->bin_next = b->bin_next;
  } else {
    heads_[bin] = b->bin_next;
  }
  if (b->bin_next != nullptr) b->bin_next->bin_prev = b->bin_prev;
  if (heads_[bin] == nullptr) {
    words_[bin >> 6] &= ~(uint64_t(1) << (bin & 63));
    if (words_[bin >> 6] == 0) summary_ &= ~(uint64_t(1) << (bin >> 6));
  }
}

void FreeIndex::insert(Block* b) {
  link(b, bin_of(b->size));
  count_++;
  bytes_ += b->size;
}

void FreeIndex::remove(Block* b) {
  unlink(b);
  b->bin = -1;
  b->bin_prev = b->bin_next = nullptr;
  count_--;
  bytes_ -= b->size;
}

void FreeIndex::relink(Block* b, int bin) {
  unlink(b);
  link(b, bin);
}

bool FreeIndex::marks_match() const {
  uint64_t summary = 0;
  for (int w = 0; w < kWords; ++w) {
    uint64_t word = 0;
    for (int i = 0; i < 64; ++i)
      if (heads_[(w << 6) + i] != nullptr) word |= uint64_t(1) << i;
    if (word != words_[w]) return false;
    if (word != 0) summary |= uint64_t(1) << w;
  }
  return summary == summary_;
}

Block* FreeIndex::largest() const {
  for (int w = kWords - 1; w >= 0; --w) {
    if (words_[w] == 0) continue;
    int bin = (w << 6) + 63 - __builtin_clzll(words_[w]);
    Block* best = nullptr;
    for (Block* b = heads_[bin]; b != nullptr; b = b->bin_next) {
      if (best == nullptr || b->size > best->size) best = b;
    }
    return best;
  }
  return nullptr;
}

}  // namespace pyalloc
