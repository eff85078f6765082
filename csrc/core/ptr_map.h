// Address -> Block map for live allocations: open addressing with linear
// probing and backward-shift deletion (no tombstones), so lookups on the
// free() path touch one or two cache lines and never allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "block.h"

namespace pyalloc {

class PtrMap {
 public:
  PtrMap() { rehash(64); }

  Block* find(uintptr_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == 0) return nullptr;
    }
  }

  /// Grows the table now if the next insert() would: insert() then never
  /// allocates (std::bad_alloc here leaves the map as it was).
  void make_room() {
    if (full()) rehash(slots_.size() * 2);
  }
  bool full() const { return (count_ + 1) * 2 > slots_.size(); }

  void insert(uintptr_t key, Block* value) {
    make_room();
    place(key, value);
    count_++;
  }

  bool erase(uintptr_t key) {
    size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) break;
      if (slots_[i].key == 0) return false;
    }
    // Shift later members of the probe run back over the hole.
    for (size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      size_t h = home(slots_[j].key);
      bool h_in_hole_to_j = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!h_in_hole_to_j) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = Slot{};
    count_--;
    return true;
  }

  size_t size() const { return count_; }

  template <typename F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.key != 0) f(s.key, s.value);
  }

 private:
  struct Slot {
    uintptr_t key = 0;
    Block* value = nullptr;
  };

  size_t home(uintptr_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void place(uintptr_t key, Block* value) {
    size_t i = home(key);
    while (slots_[i].key != 0) i = (i + 1) & mask_;
    slots_[i] = Slot{key, value};
  }

  void rehash(size_t capacity) {
    std::vector<Slot> grown(capacity);  // first: if it throws, nothing has moved
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.swap(grown);
    mask_ = capacity - 1;
    shift_ = 64 - __builtin_ctzll(capacity);
    for (const Slot& s : old)
      if (s.key != 0) place(s.key, s.value);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 0;
  size_t count_ = 0;
};

}  // namespace pyalloc
