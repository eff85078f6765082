// The model of PyTorch's caching allocator: see torch_model.h.
#include "torch_model.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

namespace pyalloc {
namespace {

constexpr size_t kMinBlockSize = 512;          // every size rounds up to this
constexpr size_t kSmallSize = 1 << 20;         // the largest small-pool request
constexpr size_t kSmallBuffer = 2 << 20;       // small-pool segment, and its page
constexpr size_t kMinLargeAlloc = 10 << 20;    // below: a large_segment_size segment
constexpr size_t kRoundLarge = 2 << 20;
constexpr int kRoundUpFirstInterval = 20;      // roundup_power2_divisions' intervals start at 1 MiB
// Where the model's device addresses live, and an expandable range when there
// is no capacity to take 9/8 of.
constexpr uintptr_t kAddressTop = uintptr_t(1) << 52;
constexpr size_t kUnboundedRange = size_t(1) << 40;  // 1 TiB, more than any device has
constexpr uintptr_t kAlignment = 2 << 20;  // of the model's cudaMalloc and reservation addresses

size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

int floor_log2(size_t n) { return 63 - __builtin_clzll(n); }  // n > 0

struct ExpandableSegment;

// A block as PyTorch keeps it (TorchBlock: core/block.h has pyalloc's Block): a piece of a segment, linked to its neighbours.
struct TorchBlock {
  uintptr_t ptr = 0;
  size_t size = 0;
  Stream stream = 0;
  bool small = false;
  bool allocated = false;
  bool mapped = true;  // false only inside an expandable segment
  bool free_requested = false;  // allocated, its free waiting on other streams (record_stream)
  TorchBlock* prev = nullptr;
  TorchBlock* next = nullptr;
  ExpandableSegment* segment = nullptr;  // the expandable range it lies in, if any
};

struct BySize {  // PyTorch's BlockComparatorSize
  bool operator()(const TorchBlock* a, const TorchBlock* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

struct ByAddress {  // BlockComparatorAddress
  bool operator()(const TorchBlock* a, const TorchBlock* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->ptr < b->ptr;
  }
};

struct Pool {
  bool small;
  std::set<TorchBlock*, BySize> blocks;       // free, mapped blocks
  std::set<TorchBlock*, ByAddress> unmapped;  // unmapped ranges of expandable segments
};

struct ExpandableSegment {
  uintptr_t base;
  size_t size;
  size_t page;
};

// The device's address space: free ranges, from which cudaMalloc and
// cuMemAddressReserve take the highest that fits, unless told where.
class AddressSpace {
 public:
  AddressSpace() { free_[0x100000000] = kAddressTop - 0x100000000; }

  /// Takes [addr, addr + size) if it is wholly free.
  bool take_at(uintptr_t addr, size_t size) {
    auto it = free_.upper_bound(addr);
    if (it == free_.begin()) return false;
    --it;
    uintptr_t start = it->first, end = it->first + it->second;
    if (addr < start || addr + size > end || addr + size < addr) return false;
    free_.erase(it);
    if (addr > start) free_[start] = addr - start;
    if (addr + size < end) free_[addr + size] = end - addr - size;
    return true;
  }

  /// The top of the highest free range that holds size, 2 MiB aligned as the
  /// driver's are; 0 if none does.
  uintptr_t take_highest(size_t size) {
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->second < size) continue;
      uintptr_t addr = (it->first + it->second - size) / kAlignment * kAlignment;
      if (addr < it->first) continue;
      take_at(addr, size);
      return addr;
    }
    return 0;
  }

  void give(uintptr_t addr, size_t size) {
    auto next = free_.lower_bound(addr);
    if (next != free_.end() && next->first == addr + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == addr) {
        prev->second += size;
        return;
      }
    }
    free_[addr] = size;
  }

 private:
  std::map<uintptr_t, size_t> free_;  // start -> length
};

class Model {
 public:
  Model(const TorchModelOptions& o) : opt_(o) {
    small_.small = true;
    large_.small = false;
  }

  void seed(const SeedSegment& s) {
    if (!addresses_.take_at(s.addr, s.size))
      throw std::invalid_argument("seed segments overlap (or lie outside the modelled address space)");
    TorchBlock* b = new_block(s.addr, s.size, s.stream, s.small);
    pool_of(s.small).blocks.insert(b);
    add_reserved(static_cast<int64_t>(s.size));
  }

  /// An allocation at a known address inside a seeded segment; nullptr if no
  /// free block holds that address.
  TorchBlock* place(uintptr_t addr, size_t requested, Stream stream) {
    size_t size = round_size(requested);
    Pool& pool = pool_for(size);
    for (auto it = pool.blocks.begin(); it != pool.blocks.end(); ++it) {
      TorchBlock* b = *it;
      if (b->stream != stream || addr < b->ptr || addr >= b->ptr + b->size ||
          b->ptr + b->size - addr < size)
        continue;
      pool.blocks.erase(it);
      if (addr > b->ptr) {  // the free part in front stays free
        TorchBlock* front = new_block(b->ptr, addr - b->ptr, b->stream, b->small);
        front->segment = b->segment;
        splice(front, b->prev, b);
        b->ptr = addr;
        b->size -= front->size;
        pool.blocks.insert(front);
      }
      return take(b, size, pool);
    }
    return nullptr;
  }

  TorchBlock* malloc(size_t requested, Stream stream, uint64_t op) {
    size_t size = round_size(requested);
    Pool& pool = pool_for(size);
    TorchBlock* b = get_free_block(pool, stream, size);
    if (b == nullptr) {
      b = alloc_block(pool, stream, size, op);
      if (b == nullptr && release_available_cached_blocks(pool, stream, size, op))
        b = alloc_block(pool, stream, size, op);
      if (b == nullptr) {
        // The out-of-memory path: release what is cached everywhere, try once more.
        retries_++;
        release_cached_blocks(op);
        b = alloc_block(pool, stream, size, op);
        if (b == nullptr) return nullptr;
      }
    }
    return take(b, size, pool);
  }

  void free(TorchBlock* b) {
    Pool& pool = pool_of(b->small);
    b->allocated = false;
    b->free_requested = false;
    try_merge(b, b->prev, pool);
    try_merge(b, b->next, pool);
    pool.blocks.insert(b);
  }

  void release_cached_blocks(uint64_t op) {
    synchronize_and_free_events();
    release_blocks(large_, op);
    release_blocks(small_, op);
  }

  /// The free of *slot was requested while other streams still used it
  /// (record_stream): it stays allocated until the caller frees it, or until
  /// release_cached_blocks waits for those streams, frees it and clears *slot.
  void request_free(TorchBlock** slot) {
    (*slot)->free_requested = true;
    if (waiting_.size() >= compact_waiting_at_) {
      // Most entries are blocks freed since by their caller: drop those.
      waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                    [](const auto& w) { return !still_waiting(w); }),
                     waiting_.end());
      compact_waiting_at_ = std::max<size_t>(1024, 2 * waiting_.size());
    }
    waiting_.emplace_back(slot, *slot);
  }

  uint64_t device_calls() const { return device_allocs_ + device_frees_; }
  uint64_t driver_calls() const { return driver_calls_; }
  uint64_t retries() const { return retries_; }
  uint64_t early_frees() const { return early_frees_; }
  int64_t peak_reserved() const { return peak_reserved_; }
  std::vector<ModelCall>& calls() { return calls_; }

 private:
  // PyTorch's round_size: up to 512 B, or up to the next power-of-two division
  // where roundup_power2_divisions asks for more than one in the size's
  // interval and the size is above 512 B times that many.
  size_t round_size(size_t size) const {
    if (size < kMinBlockSize) return kMinBlockSize;
    size_t divisions = divisions_for(size);
    if (divisions > 1 && size > kMinBlockSize * divisions) return roundup_power2_next_division(size, divisions);
    return round_up(size, kMinBlockSize);
  }

  // AllocatorConfig::roundup_power2_divisions(size): the setting of the size's
  // interval [2^k, 2^(k+1)) MiB, sizes under 1 MiB in the first, the last open-ended.
  size_t divisions_for(size_t size) const {
    const std::vector<size_t>& d = opt_.settings.roundup_power2_divisions;
    if (d.empty()) return 0;
    int index = std::clamp(floor_log2(size) - kRoundUpFirstInterval, 0, static_cast<int>(d.size()) - 1);
    return d[index];
  }

  // Up to the next of `divisions` (a power of two) equal steps between the
  // powers of two around size; powers of two stay.
  static size_t roundup_power2_next_division(size_t size, size_t divisions) {
    if ((size & (size - 1)) == 0) return size;
    size_t floor = size_t(1) << floor_log2(size);
    size_t step = floor >> floor_log2(divisions);
    return step == 0 ? floor << 1 : round_up(size, step);
  }

  size_t allocation_size(size_t size) const {
    if (size <= kSmallSize) return kSmallBuffer;
    if (size < kMinLargeAlloc) return opt_.settings.large_segment_size;
    return round_up(size, kRoundLarge);
  }

  // PyTorch's synchronize_and_free_events: wait for every stream, then free
  // the blocks whose free waited on them, in the order it was requested.
  void synchronize_and_free_events() {
    for (const auto& w : waiting_) {
      if (!still_waiting(w)) continue;
      *w.first = nullptr;
      free(w.second);
      early_frees_++;
    }
    waiting_.clear();
  }

  // Not freed since by its caller (whose slot then holds another block, or
  // this one recycled and not waiting).
  static bool still_waiting(const std::pair<TorchBlock**, TorchBlock*>& w) {
    return *w.first == w.second && w.second->allocated && w.second->free_requested;
  }

  Pool& pool_for(size_t rounded) { return rounded <= kSmallSize ? small_ : large_; }
  Pool& pool_of(bool small) { return small ? small_ : large_; }

  bool should_split(const TorchBlock* b, size_t size) const {
    size_t remaining = b->size - size;
    if (b->small || opt_.expandable) return remaining >= kMinBlockSize;
    return size < opt_.settings.max_split_size && remaining > kSmallSize;
  }

  // The most a block of max_split_size or more may exceed a request it serves.
  size_t max_non_split_rounding() const {
    const TorchAllocatorSettings& s = opt_.settings;
    return s.max_non_split_rounding != 0 ? s.max_non_split_rounding : s.large_segment_size;
  }

  // Marks b (out of every set) allocated, splitting the rest off behind it.
  TorchBlock* take(TorchBlock* b, size_t size, Pool& pool) {
    if (should_split(b, size)) {
      TorchBlock* rest = new_block(b->ptr + size, b->size - size, b->stream, b->small);
      rest->segment = b->segment;
      splice(rest, b, b->next);
      b->size = size;
      pool.blocks.insert(rest);
    }
    b->allocated = true;
    return b;
  }

  TorchBlock* get_free_block(Pool& pool, Stream stream, size_t size) {
    TorchBlock key;
    key.stream = stream;
    key.size = size;
    auto it = pool.blocks.lower_bound(&key);
    if (it == pool.blocks.end() || (*it)->stream != stream) return nullptr;
    if ((*it)->segment != nullptr) {
      // A free block followed by unmapped space counts as that much bigger, so
      // holes inside the mapped range are used before the range grows.
      auto expandable_size = [](const TorchBlock* b) {
        return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
      };
      auto next = std::next(it);
      while ((*it)->segment != nullptr && next != pool.blocks.end() && (*next)->stream == stream &&
             expandable_size(*next) < expandable_size(*it))
        it = next++;
    }
    // Oversize blocks (max_split_size or more) serve only requests as large,
    // and only within max_non_split_rounding of their size.
    size_t max_split = opt_.settings.max_split_size;
    if (size < max_split && (*it)->size >= max_split) return nullptr;
    if (size >= max_split && (*it)->size >= size + max_non_split_rounding()) return nullptr;
    TorchBlock* b = *it;
    pool.blocks.erase(it);
    return b;
  }

  TorchBlock* alloc_block(Pool& pool, Stream stream, size_t size, uint64_t op) {
    if (opt_.expandable) return alloc_expandable(pool, stream, size, op);
    size_t bytes = allocation_size(size);
    driver_calls_++;  // the cudaMalloc, whether or not it succeeds
    if (opt_.capacity != 0 && static_cast<size_t>(reserved_) + bytes > opt_.capacity) return nullptr;
    uintptr_t addr = 0;
    if (mallocs_ < opt_.malloc_hints.size()) {
      const auto& hint = opt_.malloc_hints[mallocs_];
      if (hint.first == bytes && addresses_.take_at(hint.second, bytes)) addr = hint.second;
    }
    if (addr == 0) addr = addresses_.take_highest(bytes);
    if (addr == 0) return nullptr;  // the modelled address space is full: out of memory too
    mallocs_++;
    device_allocs_++;
    add_reserved(static_cast<int64_t>(bytes));
    record(ModelCall::kSegmentAlloc, op, addr, bytes);
    return new_block(addr, bytes, stream, pool.small);
  }

  void release_blocks(Pool& pool, uint64_t op) {
    std::vector<TorchBlock*> to_unmap;
    for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
      TorchBlock* b = *it++;
      if (b->segment != nullptr) {
        to_unmap.push_back(b);  // unmapping changes the set: gather first
      } else if (b->prev == nullptr && b->next == nullptr) {
        free_segment(b, pool, op);
      }
    }
    for (TorchBlock* b : to_unmap) {
      unmap_block(b, pool, op);
      if (b->prev == nullptr && b->next == nullptr && !b->mapped) {
        // The whole range is unmapped: give the reservation back.
        pool.unmapped.erase(b);
        driver_calls_++;  // cuMemAddressFree
        addresses_.give(b->segment->base, b->segment->size);
        segments_.remove_if([&](const ExpandableSegment& s) { return &s == b->segment; });
        delete_block(b);
      }
    }
  }

  // PyTorch's release_block: cudaFree of a wholly free segment.
  void free_segment(TorchBlock* b, Pool& pool, uint64_t op) {
    pool.blocks.erase(b);
    device_frees_++;
    driver_calls_++;  // cudaFree
    add_reserved(-static_cast<int64_t>(b->size));
    addresses_.give(b->ptr, b->size);
    record(ModelCall::kSegmentFree, op, b->ptr, b->size);
    delete_block(b);
  }

  // PyTorch's release_available_cached_blocks, under max_split_size: frees the
  // smallest oversize block of the stream that holds max(size, max_split_size),
  // else the largest oversize ones down until they add up to it. Whether that
  // was done, that is, whether another cudaMalloc is worth trying.
  bool release_available_cached_blocks(Pool& pool, Stream stream, size_t size, uint64_t op) {
    size_t max_split = opt_.settings.max_split_size;
    if (max_split == SIZE_MAX) return false;
    TorchBlock key;
    key.stream = stream;
    key.size = std::max(size, max_split);
    auto it = pool.blocks.lower_bound(&key);
    if (it != pool.blocks.end() && (*it)->stream == stream && (*it)->segment == nullptr) {
      release_whole(*it, pool, op);
      return true;
    }
    if (it == pool.blocks.begin()) return false;
    size_t released = 0;
    --it;  // the largest block below the key: of this stream, if any is
    while (released < key.size && (*it)->size >= max_split && (*it)->stream == stream) {
      TorchBlock* b = *it;
      bool first = it == pool.blocks.begin();
      if (!first) --it;
      if (b->segment == nullptr) released += release_whole(b, pool, op);
      if (first) break;
    }
    return released >= key.size;
  }

  // Frees b if it is a whole segment, as an oversize block always is in
  // PyTorch (requests of max_split_size or more do not split); its size, or 0.
  size_t release_whole(TorchBlock* b, Pool& pool, uint64_t op) {
    if (b->prev != nullptr || b->next != nullptr) return 0;  // a seeded segment's piece
    size_t size = b->size;
    free_segment(b, pool, op);
    return size;
  }

  // ---- expandable segments ----

  TorchBlock* alloc_expandable(Pool& pool, Stream stream, size_t size, uint64_t op) {
    TorchBlock* c = find_expandable_block(pool, stream, size);
    if (c == nullptr) return nullptr;
    if (!c->mapped && !map_block(c, std::min(c->size, size), pool, op)) return nullptr;
    while (c->size < size) {
      // c is free and mapped, followed by unmapped space: map what it lacks.
      TorchBlock* next = c->next;
      if (!map_block(next, std::min(size - c->size, next->size), pool, op)) return nullptr;
      c = next;  // map_block merged c into it
    }
    pool.blocks.erase(c);
    return c;
  }

  static bool allocatable(const TorchBlock* b) { return b != nullptr && !b->allocated; }

  // The lowest run of free and unmapped blocks that holds size, or a new range.
  TorchBlock* find_expandable_block(Pool& pool, Stream stream, size_t size) {
    TorchBlock key;
    key.stream = stream;
    for (auto it = pool.unmapped.lower_bound(&key); it != pool.unmapped.end() && (*it)->stream == stream;
         ++it) {
      TorchBlock* c = *it;
      if (allocatable(c->prev)) c = c->prev;
      size_t bytes = 0;
      for (TorchBlock* b = c; bytes < size && allocatable(b); b = b->next) bytes += b->size;
      if (bytes >= size) return c;
    }
    size_t page = pool.small ? kSmallBuffer : opt_.settings.large_segment_size;
    // PyTorch reserves 9/8 of the device's memory for each range.
    size_t range = opt_.capacity != 0 ? round_up(opt_.capacity + opt_.capacity / 8, page)
                                      : std::max(kUnboundedRange, round_up(size, page));
    // A request larger than a whole range is out of memory: alloc_expandable
    // would run off the range's end looking for pages to map.
    if (range < size) return nullptr;
    uintptr_t base = addresses_.take_highest(range);
    if (base == 0) return nullptr;
    driver_calls_++;  // cuMemAddressReserve, once for the range's life
    segments_.push_back(ExpandableSegment{base, range, page});
    TorchBlock* b = new_block(base, range, stream, pool.small);
    b->mapped = false;
    b->segment = &segments_.back();
    pool.unmapped.insert(b);
    return b;
  }

  // Maps the pages under [b->ptr, b->ptr + size) of the unmapped block b; the
  // mapped part joins its free neighbours.
  bool map_block(TorchBlock* b, size_t size, Pool& pool, uint64_t op) {
    size_t page = b->segment->page;
    size_t bytes = round_up(size, page);
    size_t pages = bytes / page;
    if (opt_.capacity != 0 && static_cast<size_t>(reserved_) + bytes > opt_.capacity) {
      // cuMemCreate page by page until one fails, then the ones made are released.
      size_t room = static_cast<size_t>(reserved_) < opt_.capacity ? opt_.capacity - reserved_ : 0;
      size_t made = room / page;
      driver_calls_ += 2 * made + 1;
      return false;
    }
    // cuMemCreate and cuMemMap per page, one cuMemSetAccess over the range
    // mapped (PyTorch's mapAndSetAccess; one more per peer, none modelled).
    driver_calls_ += 2 * pages + 1;
    uintptr_t at = b->ptr;
    pool.unmapped.erase(b);
    b->mapped = true;
    if (bytes < b->size) {
      TorchBlock* rest = new_block(b->ptr + bytes, b->size - bytes, b->stream, b->small);
      rest->mapped = false;
      rest->segment = b->segment;
      splice(rest, b, b->next);
      b->size = bytes;
      pool.unmapped.insert(rest);
    }
    try_merge(b, b->prev, pool);
    try_merge(b, b->next, pool);
    pool.blocks.insert(b);
    device_allocs_++;
    add_reserved(static_cast<int64_t>(bytes));
    record(ModelCall::kSegmentMap, op, at, bytes);
    return true;
  }

  // Unmaps every whole page inside the free block b.
  void unmap_block(TorchBlock* b, Pool& pool, uint64_t op) {
    // Pages are counted from the start of the range, as PyTorch's segmentLeft/Right do.
    size_t page = b->segment->page;
    uintptr_t base = b->segment->base;
    uintptr_t lo = base + round_up(b->ptr - base, page);
    uintptr_t hi = base + (b->ptr + b->size - base) / page * page;
    if (hi <= lo) return;
    pool.blocks.erase(b);
    if (lo > b->ptr) {
      TorchBlock* before = new_block(b->ptr, lo - b->ptr, b->stream, b->small);
      before->segment = b->segment;
      splice(before, b->prev, b);
      pool.blocks.insert(before);
    }
    if (hi < b->ptr + b->size) {
      TorchBlock* after = new_block(hi, b->ptr + b->size - hi, b->stream, b->small);
      after->segment = b->segment;
      splice(after, b, b->next);
      pool.blocks.insert(after);
    }
    b->ptr = lo;
    b->size = hi - lo;
    b->mapped = false;
    try_merge(b, b->prev, pool);
    try_merge(b, b->next, pool);
    pool.unmapped.insert(b);
    device_frees_++;
    driver_calls_ += 2 * ((hi - lo) / page);  // cuMemUnmap, cuMemRelease
    add_reserved(-static_cast<int64_t>(hi - lo));
    record(ModelCall::kSegmentUnmap, op, lo, hi - lo);
  }

  // ---- blocks ----

  // Merges src (a free neighbour of dst of the same mapping) into dst; dst is
  // in no set while this runs.
  void try_merge(TorchBlock* dst, TorchBlock* src, Pool& pool) {
    if (src == nullptr || src->allocated || src->mapped != dst->mapped) return;
    if (src->mapped)
      pool.blocks.erase(src);
    else
      pool.unmapped.erase(src);
    if (dst->prev == src) {
      dst->ptr = src->ptr;
      dst->prev = src->prev;
      if (dst->prev) dst->prev->next = dst;
    } else {
      dst->next = src->next;
      if (dst->next) dst->next->prev = dst;
    }
    dst->size += src->size;
    delete_block(src);
  }

  static void splice(TorchBlock* b, TorchBlock* prev, TorchBlock* next) {
    b->prev = prev;
    b->next = next;
    if (prev) prev->next = b;
    if (next) next->prev = b;
  }

  TorchBlock* new_block(uintptr_t ptr, size_t size, Stream stream, bool small) {
    TorchBlock* b;
    if (!spare_.empty()) {
      b = spare_.back();
      spare_.pop_back();
      *b = TorchBlock();
    } else {
      storage_.emplace_back();
      b = &storage_.back();
    }
    b->ptr = ptr;
    b->size = size;
    b->stream = stream;
    b->small = small;
    return b;
  }

  void delete_block(TorchBlock* b) { spare_.push_back(b); }

  void add_reserved(int64_t delta) {
    reserved_ += delta;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }

  void record(ModelCall::Kind kind, uint64_t op, uintptr_t addr, size_t size) {
    if (opt_.record_calls) calls_.push_back(ModelCall{kind, op, addr, size});
  }

  const TorchModelOptions& opt_;
  Pool small_, large_;
  AddressSpace addresses_;
  std::deque<TorchBlock> storage_;  // stable addresses; freed blocks are reused
  std::vector<TorchBlock*> spare_;
  std::list<ExpandableSegment> segments_;
  int64_t reserved_ = 0, peak_reserved_ = 0;
  uint64_t device_allocs_ = 0, device_frees_ = 0, driver_calls_ = 0, retries_ = 0, mallocs_ = 0;
  uint64_t early_frees_ = 0;
  // Blocks whose free waits on other streams, with where the caller keeps them;
  // entries the caller freed since stay until compacted.
  std::vector<std::pair<TorchBlock**, TorchBlock*>> waiting_;
  size_t compact_waiting_at_ = 1024;
  std::vector<ModelCall> calls_;
};

}  // namespace

TorchModelResult run_torch_model(const ReplayTrace& trace, const TorchModelOptions& opt) {
  const std::vector<ReplayOp>& ops = trace.ops();
  if (!opt.place_at.empty() && opt.place_at.size() != ops.size())
    throw std::invalid_argument("place_at must have one entry per op (" + std::to_string(ops.size()) +
                                "), got " + std::to_string(opt.place_at.size()));
  if (!std::is_sorted(opt.releases.begin(), opt.releases.end()))
    throw std::invalid_argument("releases must be in ascending op order");
  if (opt.expandable && (!opt.seed.empty() || !opt.place_at.empty()))
    throw std::invalid_argument("seeding expandable segments is not modelled");

  auto start = std::chrono::steady_clock::now();
  Model model(opt);
  for (const SeedSegment& s : opt.seed) model.seed(s);

  TorchModelResult r;
  std::vector<TorchBlock*> block(trace.slots(), nullptr);
  std::vector<uint8_t> held(trace.slots(), 0);
  size_t half = ops.size() / 2, next_release = 0;
  uint64_t calls_at_half = 0;
  bool reached_half = false;
  for (size_t pos = 0; pos < ops.size(); ++pos) {
    if (pos == half) {
      calls_at_half = model.device_calls();
      reached_half = true;
    }
    if (next_release < opt.releases.size() && opt.releases[next_release] <= pos) {
      model.release_cached_blocks(pos);
      while (next_release < opt.releases.size() && opt.releases[next_release] <= pos) next_release++;
    }
    const ReplayOp& op = ops[pos];
    if (op.kind == ReplayOp::kFreeRequested) {
      if (block[op.id] != nullptr) model.request_free(&block[op.id]);
      continue;
    }
    if (op.kind == ReplayOp::kFree) {
      // nullptr: size 0, refused, or freed early by an out-of-memory retry.
      if (held[op.id] && block[op.id] != nullptr) model.free(block[op.id]);
      held[op.id] = 0;
      block[op.id] = nullptr;
      continue;
    }
    if (op.size == 0) {  // PyTorch hands out no memory for 0 bytes
      held[op.id] = 1;
      continue;
    }
    TorchBlock* b = nullptr;
    if (!opt.place_at.empty() && opt.place_at[pos] != 0) {
      b = model.place(opt.place_at[pos], op.size, op.stream);
      if (b == nullptr) r.misplaced++;
    }
    if (b == nullptr) b = model.malloc(op.size, op.stream, pos);
    if (b == nullptr) {
      r.ooms++;
      if (r.first_oom_op < 0) r.first_oom_op = static_cast<int64_t>(pos);
      if (opt.stop_on_oom) break;
      continue;
    }
    block[op.id] = b;
    held[op.id] = 1;
  }
  // Releases after the last op (an empty_cache at the end of the recording).
  if (next_release < opt.releases.size() && !(opt.stop_on_oom && r.ooms != 0))
    model.release_cached_blocks(ops.size());
  if (ops.empty()) reached_half = true;
  r.completed = r.ooms == 0;
  r.peak_reserved = model.peak_reserved();
  r.device_calls = model.device_calls();
  if (reached_half && !(opt.stop_on_oom && r.ooms != 0))
    r.second_half_device_calls = static_cast<int64_t>(model.device_calls() - calls_at_half);
  r.driver_calls = model.driver_calls();
  r.retries = model.retries();
  r.early_frees = model.early_frees();
  r.calls = std::move(model.calls());
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace pyalloc
