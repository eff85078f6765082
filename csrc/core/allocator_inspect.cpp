// Looking at the allocator without changing it: stats, fragmentation,
// snapshots in PyTorch's layout, and check_invariants(), which recomputes
// everything from the blocks and compares it with what the core maintains.
#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "allocator.h"

namespace pyalloc {

Stats Allocator::stats() const {
  std::lock_guard<Lock> guard(mu_);
  return stats_;
}

void Allocator::reset_peak_stats() {
  std::lock_guard<Lock> guard(mu_);
  stats_.reset_peak();
}

void Allocator::reset_accumulated_stats() {
  std::lock_guard<Lock> guard(mu_);
  stats_.reset_accumulated();
}

void Allocator::quiesce() const { std::lock_guard<Lock> guard(mu_); }

Config Allocator::config() const {
  std::lock_guard<Lock> guard(mu_);
  return cfg_;
}

size_t Allocator::largest_free_block() const {
  std::lock_guard<Lock> guard(mu_);
  return std::max(largest_free_locked(kSmallPool), largest_free_locked(kLargePool));
}

bool Allocator::live_block(uintptr_t ptr, size_t* requested, Stream* stream,
                           uint64_t* context) const {
  std::lock_guard<Lock> guard(mu_);
  const Block* b = live_.find(ptr);
  if (b == nullptr || b->state != BlockState::kAllocated) return false;
  *requested = b->requested;
  *stream = b->stream;
  if (context != nullptr) *context = b->context;
  return true;
}

bool Allocator::live_block_info(uintptr_t ptr, LiveBlockInfo* out) const {
  std::lock_guard<Lock> guard(mu_);
  const Block* b = live_.find(ptr);
  if (b == nullptr || b->state != BlockState::kAllocated) return false;
  *out = LiveBlockInfo{b->size, b->requested, b->stream, b->context, b->uses};
  return true;
}

void Allocator::set_stats_sink(StatsSink* sink) {
  std::lock_guard<Lock> guard(mu_);
  sink_ = sink;
  pushed_ = Stats();
  if (sink_ != nullptr) sink_->push(this, stats_, &pushed_);
}

void Allocator::join_sink() {
  std::lock_guard<Lock> guard(mu_);
  if (sink_ != nullptr) sink_->join(this, stats_, &pushed_);
}

size_t Allocator::largest_free_in_area() const {
  size_t largest = 0;
  for (const auto& [stream, st] : streams_)
    st->free[kLargePool].for_each([&](const Block* b) {
      if (in_area(b)) largest = std::max(largest, b->size);
    });
  return largest;
}

size_t Allocator::largest_free_locked(Pool pool) const {
  size_t largest = 0;
  for (const auto& [stream, st] : streams_) {
    const Block* b = st->free[pool].largest();
    if (b != nullptr) largest = std::max(largest, b->size);
  }
  return largest;
}

bool Allocator::segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  std::lock_guard<Lock> guard(mu_);
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) return false;
  const Segment* seg = std::prev(it)->second;
  if (ptr >= seg->base + seg->size) return false;
  *base = seg->base;
  *size = seg->size;
  return true;
}

bool Allocator::base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  if (!vmm_) return segment_of(ptr, base, size);
  std::lock_guard<Lock> guard(mu_);
  const Block* b = block_at(ptr);  // a walk of the range's blocks: a rare call (IPC)
  if (b == nullptr) return false;
  if (b->segment->parent != nullptr) b = b->segment->parent;  // a chunk: the pages under it
  if (!b->mapped) return false;
  // Mapped pages are tiled by handles (vmm.cpp): from the one holding b's start.
  auto it = std::prev(handles_.upper_bound(b->addr));
  *base = it->first;
  uintptr_t end = *base;
  for (; it != handles_.end() && it->first < b->end(); ++it) end = it->first + it->second;
  *size = end - *base;
  return true;
}

bool Allocator::share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why) {
  std::lock_guard<Lock> guard(mu_);
  const Block* b = live_.find(ptr);
  if (b == nullptr || b->state != BlockState::kAllocated) {
    *why = describe_bad_pointer(ptr, "share");
    return false;
  }
  const Segment* seg = b->segment;
  while (seg->parent != nullptr) seg = seg->parent->segment;  // a chunk: the segment it was cut from
  if (!seg->vmm) {
    out->emplace_back();
    return backend_->share_segment(seg->base, seg->size, &out->back(), why);
  }
  // The handles under [b->addr, b->end()): every page under a live block is
  // mapped (block.h), and mapped pages are tiled by handles.
  auto it = handles_.upper_bound(b->addr);
  if (it == handles_.begin()) throw InvariantError("share: no handle under " + format_ptr(b->addr));
  for (--it; it != handles_.end() && it->first < b->end(); ++it) {
    out->emplace_back();
    if (!backend_->vmm_share(it->first, it->second, &out->back(), why)) return false;
  }
  return true;
}

FragmentationInfo Allocator::fragmentation() const {
  std::lock_guard<Lock> guard(mu_);
  FragmentationInfo f;
  f.reserved_bytes = static_cast<size_t>(stats_.reserved_bytes.all.current);
  f.allocated_bytes = static_cast<size_t>(stats_.allocated_bytes.all.current);
  f.pending_free_bytes = static_cast<size_t>(stats_.active_bytes.all.current) - f.allocated_bytes;
  std::vector<std::pair<size_t, size_t>> buckets(64);  // (count, bytes) by log2
  for (const auto& [stream, st] : streams_) {
    for (Pool pool : {kSmallPool, kLargePool}) {
      st->free[pool].for_each([&](const Block* b) {
        f.free_bytes += b->size;
        f.free_blocks++;
        f.largest_free_block = std::max(f.largest_free_block, b->size);
        if (pool == kLargePool) {
          f.large_free_bytes += b->size;
          f.large_largest_free_block = std::max(f.large_largest_free_block, b->size);
        } else {
          f.small_free_bytes += b->size;
          f.small_largest_free_block = std::max(f.small_largest_free_block, b->size);
        }
        int bucket = 63 - __builtin_clzll(b->size);
        buckets[bucket].first++;
        buckets[bucket].second += b->size;
      });
    }
  }
  for (const Segment* c : chunks_) f.free_small_chunks += c->wholly_free() ? 1 : 0;
  for (int i = 0; i < 64; ++i)
    if (buckets[i].first != 0)
      f.histogram.emplace_back(size_t(1) << i, buckets[i].first, buckets[i].second);
  return f;
}

std::vector<SnapshotSegment> Allocator::snapshot() const {
  std::lock_guard<Lock> guard(mu_);
  std::vector<SnapshotSegment> out;
  auto add = [this](SnapshotSegment& s, const Block* b) {
    s.total_size += b->size;
    // A parked block (vmm.cpp) is reserved memory no one holds: inactive.
    bool held = b->state != BlockState::kFree && !parked(b);
    const char* st = !held                                  ? "inactive"
                     : b->state == BlockState::kPendingFree ? "active_pending_free"
                                                            : "active_allocated";
    s.blocks.push_back(SnapshotBlock{b->addr, b->size, b->requested, st, b->context});
    if (!held) return;
    if (b->state == BlockState::kAllocated) s.allocated_size += b->size;
    s.active_size += b->size;
    s.requested_size += b->requested;  // a pending free's too, as PyTorch's snapshot counts it
  };
  for (const auto& [base, seg] : segments_) {
    // One segment per run of large-pool memory: unmapped pages and chunks
    // lent to the small pool end a run; each chunk is a segment of its own.
    bool open = false;
    for (const Block* b = seg->first; b != nullptr; b = b->next) {
      if (!large_mem(b)) open = false;
      if (!b->mapped) continue;  // no memory behind it
      if (b->chunk != nullptr) {
        SnapshotSegment c;
        c.address = b->chunk->base;
        c.stream = b->chunk->stream;
        c.pool = kSmallPool;
        for (const Block* x = b->chunk->first; x != nullptr; x = x->next) add(c, x);
        out.push_back(std::move(c));
        continue;
      }
      if (!open) {
        SnapshotSegment r;
        r.address = b->addr;
        r.stream = seg->stream;
        r.expandable = seg->vmm;
        out.push_back(std::move(r));
        open = true;
      }
      add(out.back(), b);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Invariants

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw InvariantError("allocator invariant violated: " + what);
}

void expect_stat(const char* name, const StatArray& a, const int64_t (&v)[2]) {
  const std::pair<const char*, std::pair<int64_t, int64_t>> rows[] = {
      {"small_pool", {a.small.current, v[kSmallPool]}},
      {"large_pool", {a.large.current, v[kLargePool]}},
      {"all", {a.all.current, v[0] + v[1]}},
  };
  for (const auto& [pool, pair] : rows)
    if (pair.first != pair.second)
      fail(std::string(name) + "." + pool + ".current is " + std::to_string(pair.first) +
           " but the blocks say " + std::to_string(pair.second));
  // Between operations every peak has caught up (Stats::settle()). The sum
  // of increments is no bound on current: reset_accumulated_stats() zeroes
  // it while blocks stay allocated.
  for (const auto& [pool, s] : {std::pair<const char*, const Stat*>{"all", &a.all},
                                {"small_pool", &a.small}, {"large_pool", &a.large}})
    if (s->peak < s->current)
      fail(std::string(name) + "." + pool + " has peak " + std::to_string(s->peak) +
           " below current " + std::to_string(s->current));
}

}  // namespace

// What check_invariants() recomputes from the blocks, to compare with the
// counters, maps and lists the core maintains.
struct Allocator::InvariantTally {
  int64_t allocation[2] = {0, 0};
  int64_t allocated_bytes[2] = {0, 0};
  int64_t requested_bytes[2] = {0, 0};
  int64_t active[2] = {0, 0};
  int64_t active_bytes[2] = {0, 0};
  int64_t inactive_split[2] = {0, 0};
  int64_t inactive_split_bytes[2] = {0, 0};
  int64_t segment[2] = {0, 0};
  int64_t reserved_bytes[2] = {0, 0};
  size_t pending = 0;
  size_t chunks = 0;
  size_t free_chunks = 0;
  size_t unmapped = 0;
  size_t parked = 0;
  std::unordered_set<const Block*> free_blocks;
};

void Allocator::check_invariants() const {
  std::lock_guard<Lock> guard(mu_);
  InvariantTally t;
  check_segments(t);
  if (vmm_) check_handles();
  check_chunk_index();
  check_pending_frees(t);
  check_ptr_map(t);
  check_free_indexes(t);
  check_stats(t);
}

// Blocks/segments step: walks every segment, then matches the chunk, unmapped and parked maps to it.
void Allocator::check_segments(InvariantTally& t) const {
  for (const auto& [base, seg] : segments_) {
    if (seg->base != base || seg->pool != kLargePool) fail("segment map entry mismatch");
    check_segment(seg, t);
  }
  if (t.chunks != chunks_.size()) fail("chunk list does not match the chunks in the segments");
  if (t.free_chunks > free_chunks_)
    fail(std::to_string(t.free_chunks) + " wholly free chunks, counted as at most " +
         std::to_string(free_chunks_));
  if (t.unmapped != unmapped_.size()) fail("unmapped map does not match the unmapped blocks");
  if (t.parked != parked_.size()) fail("parked map does not match the parked blocks");
}

// Walks one segment (a backend segment or a chunk), tallying its blocks.
void Allocator::check_segment(const Segment* seg, InvariantTally& t) const {
  Pool pool = seg->pool;
  uintptr_t expect = seg->base;
  const Block* prev = nullptr;
  std::string where = (pool == kLargePool ? "segment " : "chunk ") + format_ptr(seg->base);
  int64_t mapped_bytes = 0;
  if (seg->first == nullptr || seg->first->prev != nullptr) fail(where + " has a bad first block");
  for (const Block* b = seg->first; b != nullptr; prev = b, b = b->next) {
    std::string at = where + " block " + format_ptr(b->addr);
    if (b->segment != seg) fail(at + " points at another segment");
    if (b->prev != prev) fail(at + " has a broken prev link");
    if (b->addr != expect) fail(at + " does not start where its predecessor ends");
    if (b->size == 0 || b->size % kGranularity != 0) fail(at + " has a bad size");
    if (b->end() > seg->base + seg->size) fail(at + " runs past the end of its segment");
    if (prev != nullptr && prev->free_mapped() && b->free_mapped() && prev->stream == b->stream)
      fail(at + " is free next to a free block of the same stream (not merged)");
    if (!b->mapped) {
      check_unmapped_block(seg, b, prev, at, t);
    } else {
      mapped_bytes += static_cast<int64_t>(b->size);
      check_mapped_block(seg, b, at, t);
    }
    expect = b->end();
  }
  if (expect != seg->base + seg->size) fail(where + ": its blocks do not cover it");
  if (pool == kSmallPool) {
    t.segment[pool]++;
  } else {  // each run of large-pool memory is a segment
    for (const Block* b = seg->first; b != nullptr; b = b->next)
      if (large_mem(b) && !large_mem(b->prev)) t.segment[pool]++;
  }
  t.reserved_bytes[pool] += seg->vmm ? mapped_bytes : static_cast<int64_t>(seg->size);
  if (pool == kSmallPool) t.reserved_bytes[kLargePool] -= static_cast<int64_t>(seg->size);
}

// One unmapped block: a free, page-aligned hole of the range, in the unmapped map.
void Allocator::check_unmapped_block(const Segment* seg, const Block* b, const Block* prev,
                                     const std::string& at, InvariantTally& t) const {
  if (!seg->vmm || b->state != BlockState::kFree || b->bin != -1)
    fail(at + " is unmapped but not a free block of a virtual-memory segment");
  if ((b->addr - seg->base) % page_ != 0 || b->size % page_ != 0)
    fail(at + " is unmapped but not page-aligned");
  if (prev != nullptr && !prev->mapped) fail(at + " is unmapped next to an unmapped block");
  auto u = unmapped_.find(b->addr);
  if (u == unmapped_.end() || u->second != b) fail(at + " is missing from the unmapped map");
  t.unmapped++;
}

// One mapped block, checked and tallied by its state (the walk's per-block step).
void Allocator::check_mapped_block(const Segment* seg, const Block* b, const std::string& at,
                                   InvariantTally& t) const {
  Pool pool = seg->pool;
  auto it = streams_.find(b->stream);
  const StreamState* st = it == streams_.end() ? nullptr : it->second.get();
  switch (b->state) {
    case BlockState::kFree:
      if (st == nullptr || b->free_seq > st->last_free_seq)
        fail(at + " is free with a sequence number its stream never issued");
      if (b->bin != FreeIndex::bin_of(b->size)) fail(at + " is in the wrong bin");
      t.free_blocks.insert(b);
      if (pool == kSmallPool && !b->is_split()) t.free_chunks++;
      if (b->is_split() && !vmm_) {  // change_inactive_split()
        t.inactive_split[pool]++;
        t.inactive_split_bytes[pool] += static_cast<int64_t>(b->size);
      }
      break;
    case BlockState::kAllocated:
      check_allocated_block(seg, b, at, t);
      break;
    case BlockState::kPendingFree:
      if (live_.find(b->addr) != nullptr) fail(at + " is pending free but still in the map");
      t.active[pool]++;
      t.active_bytes[pool] += static_cast<int64_t>(b->size);
      t.requested_bytes[pool] += static_cast<int64_t>(b->requested);
      t.pending++;
      break;
  }
}

// One allocated block: parked, carrying a chunk (walked in turn), or a live allocation.
void Allocator::check_allocated_block(const Segment* seg, const Block* b, const std::string& at,
                                      InvariantTally& t) const {
  Pool pool = seg->pool;
  if (parked(b)) {
    if (pool != kLargePool || !seg->vmm || b->chunk != nullptr || live_.find(b->addr) == b)
      fail(at + " is parked but not a plain block of a virtual-memory segment");
    t.parked++;
    return;
  }
  if (b->chunk != nullptr) {
    if (pool != kLargePool || b->chunk->parent != b || b->chunk->base != b->addr ||
        b->chunk->size != b->size)
      fail(at + " carries a chunk that does not match it");
    if (live_.find(b->addr) == b) fail(at + " is a chunk but is in the pointer map");
    t.chunks++;
    check_segment(b->chunk, t);
    return;
  }
  if (live_.find(b->addr) != b) fail(at + " is allocated but not in the pointer map");
  t.allocation[pool]++;
  t.allocated_bytes[pool] += static_cast<int64_t>(b->size);
  t.requested_bytes[pool] += static_cast<int64_t>(b->requested);
  t.active[pool]++;
  t.active_bytes[pool] += static_cast<int64_t>(b->size);
  if (b->requested > b->size || round_up(b->requested, kGranularity) > b->size)
    fail(at + " is smaller than its request");
}

// Vmm ranges step: the handles never overlap and tile exactly the mapped runs and parked blocks.
void Allocator::check_handles() const {
  // The handles tile the mapped memory of the range: none under unmapped
  // blocks, none past the ends of a run of mapped blocks.
  uintptr_t at = 0;
  for (const auto& [addr, size] : handles_) {
    if (size == 0 || size % page_ != 0 || addr < at) fail("handle " + format_ptr(addr) + " overlaps or is empty");
    at = addr + size;
  }
  auto covered = [&](uintptr_t lo, uintptr_t hi) {  // exactly by handles
    auto it = handles_.find(lo);
    if (it == handles_.end()) return false;
    while (it != handles_.end() && it->first < hi) {
      if (it->first != lo) return false;
      lo += it->second;
      ++it;
    }
    return lo == hi;
  };
  size_t handled = 0;
  for (const Block* b = vmm_seg_->first; b != nullptr; b = b->next) {
    if (!b->mapped || (b->prev != nullptr && b->prev->mapped)) continue;
    uintptr_t hi = b->end();
    for (const Block* n = b->next; n != nullptr && n->mapped; n = n->next) hi = n->end();
    if (!covered(b->addr, hi)) fail("mapped run " + format_ptr(b->addr) + " is not tiled by handles");
    handled += hi - b->addr;
  }
  // unpark() unmaps a parked block's handles: they lie inside it.
  for (const auto& [addr, b] : parked_)
    if (!covered(b->addr, b->end())) fail("parked block " + format_ptr(addr) + " is not tiled by handles");
  size_t total = 0;
  for (const auto& [addr, size] : handles_) total += size;
  if (total != handled) fail("handles map memory outside the mapped blocks");
}

// Chunk list step: each chunk knows its place in the list.
void Allocator::check_chunk_index() const {
  for (size_t i = 0; i < chunks_.size(); ++i)
    if (chunks_[i]->index != i) fail("chunk list index out of date");
}

// Pending frees step: the list holds exactly the blocks pending free.
void Allocator::check_pending_frees(const InvariantTally& t) const {
  if (t.pending != pending_.size()) fail("pending-free list does not match the blocks");
}

// Pointer map step: one entry per live allocation.
void Allocator::check_ptr_map(const InvariantTally& t) const {
  if (live_.size() != static_cast<size_t>(t.allocation[0] + t.allocation[1]))
    fail("pointer map holds " + std::to_string(live_.size()) + " entries for " +
         std::to_string(t.allocation[0] + t.allocation[1]) + " allocations");
}

// Free index step: every free block is in exactly its own index, and the indexes hold nothing else.
void Allocator::check_free_indexes(const InvariantTally& t) const {
  size_t indexed = 0;
  for (const auto& [stream, st] : streams_) {
    if (st->ready_seq > st->last_free_seq || st->synced_seq > st->last_free_seq)
      fail("stream " + std::to_string(stream) + " sequence numbers out of order");
    for (Pool pool : {kSmallPool, kLargePool}) indexed += check_free_index(stream, pool, st->free[pool], t);
  }
  if (indexed != t.free_blocks.size())
    fail(std::to_string(t.free_blocks.size()) + " free blocks but " + std::to_string(indexed) +
         " in the free indexes");
}

// One stream's index of one pool agrees with itself and holds only its own free blocks; returns its count.
size_t Allocator::check_free_index(Stream stream, Pool pool, const FreeIndex& idx,
                                   const InvariantTally& t) const {
  size_t count = 0, bytes = 0;
  for (int bin = 0; bin < FreeIndex::kNumBins; ++bin) {
    const Block* prev = nullptr;
    for (const Block* b = idx.head(bin); b != nullptr; prev = b, b = b->bin_next) {
      if (b->bin_prev != prev) fail("free list links broken");
      if (b->state != BlockState::kFree || b->stream != stream || b->bin != bin ||
          b->segment == nullptr || b->segment->pool != pool || !t.free_blocks.count(b))
        fail("free index of stream " + std::to_string(stream) + " holds block " +
             format_ptr(b->addr) + " that does not belong there");
      count++;
      bytes += b->size;
    }
  }
  if (count != idx.count() || bytes != idx.bytes()) fail("free index counters are off");
  if (!idx.marks_match()) fail("free index bitmap does not match its bins");
  return count;
}

// Stats step: every current value is what the blocks add up to.
void Allocator::check_stats(const InvariantTally& t) const {
  expect_stat("allocation", stats_.allocation, t.allocation);
  expect_stat("allocated_bytes", stats_.allocated_bytes, t.allocated_bytes);
  expect_stat("requested_bytes", stats_.requested_bytes, t.requested_bytes);
  expect_stat("active", stats_.active, t.active);
  expect_stat("active_bytes", stats_.active_bytes, t.active_bytes);
  expect_stat("inactive_split", stats_.inactive_split, t.inactive_split);
  expect_stat("inactive_split_bytes", stats_.inactive_split_bytes, t.inactive_split_bytes);
  expect_stat("segment", stats_.segment, t.segment);
  expect_stat("reserved_bytes", stats_.reserved_bytes, t.reserved_bytes);
}

}  // namespace pyalloc
