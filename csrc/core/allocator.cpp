// The allocator's policy: allocation, free, streams, growth and release.
// Introspection (stats, snapshot, fragmentation, invariants) lives in
// allocator_inspect.cpp, the history in history.cpp.
#include "allocator.h"

#include <algorithm>

namespace pyalloc {
namespace {

// PyTorch's rule: a request below max_split_size never takes an oversize
// block, and an oversize request never wastes more than this on a block.
constexpr size_t kOversizeSlack = size_t(20) << 20;

}  // namespace

const char* trace_action_name(TraceEntry::Action a) {
  switch (a) {
    case TraceEntry::kAlloc: return "alloc";
    case TraceEntry::kFreeRequested: return "free_requested";
    case TraceEntry::kFreeCompleted: return "free_completed";
    case TraceEntry::kSegmentAlloc: return "segment_alloc";
    case TraceEntry::kSegmentFree: return "segment_free";
    case TraceEntry::kSegmentMap: return "segment_map";
    case TraceEntry::kSegmentUnmap: return "segment_unmap";
    case TraceEntry::kOom: return "oom";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// Construction

Allocator::Allocator(std::unique_ptr<Backend> backend, const Config& config)
    : backend_(std::move(backend)), cfg_(config) {
  try {
    init();
  } catch (...) {
    release_all();  // no destructor runs for an object whose constructor threw
    throw;
  }
}

void Allocator::init() {
  OpEnd end{this};
  cfg_.validate();
  stats_.max_split_size = cfg_.max_split_size == 0 ? -1 : static_cast<int64_t>(cfg_.max_split_size);
  if (cfg_.strategy == Strategy::kVmm) {
    init_vmm();
    if (vmm_) return;
    cfg_.strategy = Strategy::kBestFit;  // the backend has no virtual memory
  }
  if (cfg_.pool_size > 0) {
    size_t size = round_up(cfg_.pool_size, kSegmentAlign);
    // Blocks tile a segment in granules: a cap off the granularity cuts it down to one.
    if (cfg_.max_pool_size != 0) size = std::min(size, cfg_.max_pool_size / kGranularity * kGranularity);
    if (size < cfg_.pool_size)
      throw OutOfMemoryError("out of memory: could not reserve pool_size (" + format_bytes(cfg_.pool_size) +
                             "): max_pool_size " + format_bytes(cfg_.max_pool_size) +
                             " would be exceeded");
    uintptr_t base = device_reserve(size);
    if (base == 0)
      throw OutOfMemoryError("out of memory: could not reserve pool_size (" + format_bytes(size) +
                             ") from the " + backend_->name() + " backend");
    add_segment(base, size, 0);
  }
}

Allocator::~Allocator() { release_all(); }

void Allocator::release_all() {
  for (PendingFree& pf : pending_)
    for (EventId e : pf.events) backend_->event_free(e);
  for (auto& [stream, st] : streams_)
    for (auto& [event, seq] : st->syncs) backend_->event_free(event);
  for (Segment* c : chunks_) delete c;
  for (auto& [base, seg] : segments_) {
    if (seg->vmm) backend_->vmm_release(seg->base, seg->size);
    else backend_->release(seg->base, seg->size);
    delete seg;
  }
  segments_.clear();
  chunks_.clear();
}

Allocator::StreamState& Allocator::state_slow(Stream s) {
  auto it = streams_.find(s);
  if (it == streams_.end()) {
    it = streams_.emplace(s, std::make_unique<StreamState>(s)).first;
    // Under vmm the large pool places blocks as PyTorch's does (free_index.h).
    if (vmm_) it->second->free[kLargePool].lowest_ties();
  }
  last_stream_ = s;
  last_state_ = it->second.get();
  return *last_state_;
}

void Allocator::add_block_slab() {
  // Everything that may throw first, the slab owned meanwhile: nothing leaks.
  std::unique_ptr<Block[]> slab(new Block[kSlab]);
  spare_blocks_.reserve(spare_blocks_.size() + kSlab);
  block_slabs_.push_back(std::move(slab));
  for (size_t i = 0; i < kSlab; ++i) spare_blocks_.push_back(&block_slabs_.back()[i]);
  if (vmm_) block_floor_ = map_floor_ = vmm_floor();
}

void Allocator::prepare_slow() {
  while (spare_blocks_.size() < block_floor_) add_block_slab();
  live_.make_room();
  map_nodes_.reserve(map_floor_);
}

void Allocator::drop_block(Block* b) {
  // Back to a default Block (keeping the capacity of `uses`) for reuse.
  b->uses.clear();
  std::vector<Stream> uses = std::move(b->uses);
  *b = Block();
  b->uses = std::move(uses);
  spare_blocks_.push_back(b);
}

// ---------------------------------------------------------------------------
// malloc

uintptr_t Allocator::malloc(size_t size, Stream s, uint64_t context) {
  if (size == 0) return 0;
  // A refusal is not yet the caller's error: the owner's retry comes first (oom.h).
  bool retried = false;
  try {
    return malloc_once(size, s, context, &retried);
  } catch (const Refused& refused) {
    return malloc_refused(size, s, context, refused.failure, &retried);
  }
}

// Inlined into malloc(), the hot path.
[[gnu::always_inline]] inline uintptr_t Allocator::malloc_once(size_t size, Stream s, uint64_t context,
                                                                bool* retried) {
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  // As PyTorch answers such a request (its cudaMalloc fails): out of memory,
  // here at once, since no device could hold it.
  if (size > kMaxRequest)
    refuse(size, size, s, "larger than any device could hold (limit " + format_bytes(kMaxRequest) + ")" +
           kNoRetry, true, true);
  prepare(s);
  size_t rounded = round_up(size, kGranularity);
  if (!pending_.empty() && !backend_->is_capturing(s)) process_pending(false);
  // Segment events this request causes carry its tag (until it returns or throws).
  ContextScope scope(&trace_context_, context);
  Block* b;
  if (rounded <= cfg_.small_size) {
    b = alloc_small(rounded, s, size, retried);
  } else {
    if (bool small = rounded <= kSmallArea; small != small_area_) set_area(small);
    b = alloc_large(rounded, s, size, retried);
  }
  return hand_out(b, size, s, context);
}

uintptr_t Allocator::malloc_refused(size_t size, Stream s, uint64_t context, OomFailure failure, bool* retried) {
  // The owner may hold memory this pool could take (the other pools of a
  // device): given back with none of this pool's locks held, one more try.
  // Never for a request no release could make room for: the others keep their cache.
  if (oom_policy_ != nullptr && !failure.hopeless && oom_policy_->release_elsewhere(*this) > 0) {
    try {
      return malloc_once(size, s, context, retried);
    } catch (const Refused& again) {
      failure = again.failure;
    }
  }
  if (oom_policy_ != nullptr)
    if (uintptr_t p = oom_policy_->serve_elsewhere(*this, failure, context)) return p;
  throw_oom(failure, context);
}

uintptr_t Allocator::hand_out(Block* b, size_t size, Stream s, uint64_t context) {
  b->requested = size;
  b->context = context;
  live_.insert(b->addr, b);
  Pool pool = b->segment->pool;
  int64_t bytes = static_cast<int64_t>(b->size);
  stats_.allocation.add(pool, 1);
  stats_.allocated_bytes.add(pool, bytes);
  stats_.active.add(pool, 1);
  stats_.active_bytes.add(pool, bytes);
  stats_.requested_bytes.add(pool, static_cast<int64_t>(size));
  if (cfg_.max_split_size != 0 && b->size >= cfg_.max_split_size) stats_.oversize_allocations.add(1);
  if (history_on_) trace(TraceEntry::kAlloc, b->addr, size, s);
  return b->addr;
}

// ---------------------------------------------------------------------------
// Allocation at a given address (restoring a checkpoint)

uintptr_t Allocator::allocate_at(uintptr_t addr, size_t size, Stream s, uint64_t context) {
  if (size == 0 || size > kMaxRequest)
    throw std::invalid_argument("allocate_at: size " + std::to_string(size) + " is out of range");
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  ContextScope scope(&trace_context_, context);
  size_t rounded = round_up(size, kGranularity);
  std::string where = "allocate_at(" + format_ptr(addr) + ", " + std::to_string(size) + "): ";
  Block* b = carve_at(addr, rounded, rounded, s, where);
  return hand_out(b, size, s, context);
}

void Allocator::reinstate(uintptr_t addr, const LiveBlockInfo& info) {
  if (info.requested == 0 || info.size < round_up(info.requested, kGranularity) || info.size > kMaxRequest ||
      info.size % kGranularity != 0)
    throw std::invalid_argument("reinstate: a block of " + std::to_string(info.size) + " bytes for " +
                                std::to_string(info.requested) + " requested is no block this pool makes");
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  ContextScope scope(&trace_context_, info.context);
  std::string where = "reinstate(" + format_ptr(addr) + ", " + std::to_string(info.size) + "): ";
  std::vector<Stream> uses = info.uses;  // copied before anything changes
  Block* b = carve_at(addr, info.size, round_up(info.requested, kGranularity), info.stream, where);
  b->uses.swap(uses);
  hand_out(b, info.requested, info.stream, info.context);
}

Block* Allocator::carve_at(uintptr_t addr, size_t extent, size_t rounded, Stream s, const std::string& where) {
  prepare(s);
  // Frees waiting on streams that have since finished complete first, as
  // for malloc(): their memory is free for the block.
  if (!pending_.empty() && !backend_->is_capturing(s)) process_pending(false);
  Block* b = block_at(addr);
  if (b == nullptr) throw std::invalid_argument(where + "no memory of this pool is there");
  // The range must be free, in one block or in neighbours of several
  // streams: the caller orders the work on it (a checkpoint's block, made
  // again as it was), so the streams' labels do not keep it apart. Only the
  // free memory around the range keeps its labels.
  uintptr_t end_addr = addr + extent;
  Block* last = b;
  bool free_run = b->free_mapped();
  while (free_run && last->end() < end_addr) {
    last = last->next;
    free_run = last != nullptr && last->free_mapped();
  }
  if (!free_run) throw std::invalid_argument(where + "that range is not free");
  if ((addr - b->segment->base) % kGranularity != 0)
    throw std::invalid_argument(where + "the address is not on a block boundary");
  // The small pool keeps small requests: memory that moved between the pools
  // since the checkpoint cannot be given back as it was.
  if ((rounded <= cfg_.small_size) != (b->segment->pool == kSmallPool))
    throw std::invalid_argument(where + "that memory now belongs to the other size pool");
  if (b->addr < addr) {
    Block* rest = split_free_at(b, addr);
    if (last == b) last = rest;
    b = rest;
  }
  if (end_addr < last->end()) split_free_at(last, end_addr);
  // b to last tile the range exactly now: out of their free indexes, one
  // block, to the caller's stream.
  Pool pool = b->segment->pool;
  state(b->stream).free[pool].remove(b);
  track_inactive_split(b, -1);
  bool mixed = false;
  while (b->end() < end_addr) {
    Block* n = b->next;
    state(n->stream).free[pool].remove(n);
    track_inactive_split(n, -1);
    mixed = mixed || n->stream != b->stream;
    b->size += n->size;
    take_place_of(b, n);
  }
  if (mixed || b->stream != s) {
    b->stream = s;
    b->free_seq = 0;
  }
  b->state = BlockState::kAllocated;
  return b;
}

Block* Allocator::block_at(uintptr_t ptr) const {
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin() || ptr >= std::prev(it)->second->base + std::prev(it)->second->size)
    return nullptr;
  Block* b = std::prev(it)->second->first;
  while (true) {
    while (b != nullptr && ptr >= b->end()) b = b->next;
    if (b == nullptr || b->chunk == nullptr) return b;
    b = b->chunk->first;  // descend into the small-pool chunk
  }
}

Block* Allocator::split_free_at(Block* b, uintptr_t at) {
  Pool pool = b->segment->pool;
  FreeIndex& index = state(b->stream).free[pool];
  bool was_split = b->is_split();
  Block* n = new_block();
  n->addr = at;
  n->size = b->end() - at;
  n->segment = b->segment;
  n->stream = b->stream;
  n->free_seq = b->free_seq;
  n->state = BlockState::kFree;
  n->prev = b;
  n->next = b->next;
  if (b->next != nullptr) b->next->prev = n;
  b->next = n;
  index.resize(b, at - b->addr);
  index.insert(n);
  // Both halves are free blocks of a split segment now.
  change_inactive_split(pool, was_split ? 1 : 2, was_split ? 0 : static_cast<int64_t>(b->size + n->size));
  return n;
}

Block* Allocator::alloc_small(size_t size, Stream s, size_t request, bool* retried) {
  Block* b = find_free(kSmallPool, size, s);
  if (b != nullptr) return take(b, size, s);

  // Borrow a chunk from the large pool (its small area, under vmm); it
  // keeps the parent's stream label. Its bookkeeping is made first.
  auto owned = std::make_unique<Segment>();
  if (chunks_.size() == chunks_.capacity()) chunks_.reserve(std::max<size_t>(8, 2 * chunks_.size()));
  Block* parent;
  {
    AreaScope area(*this, true);
    parent = alloc_large(cfg_.small_chunk_size, s, request, retried);
  }
  Segment* chunk = owned.release();
  chunk->base = parent->addr;
  chunk->size = parent->size;
  chunk->pool = kSmallPool;
  chunk->parent = parent;
  chunk->id = next_segment_id_++;
  chunk->stream = s;
  chunk->index = chunks_.size();
  chunks_.push_back(chunk);
  lend_chunk_stats(parent, chunk, +1);
  parent->chunk = chunk;

  Block* cb = new_block();
  cb->addr = chunk->base;
  cb->size = chunk->size;
  cb->segment = chunk;
  cb->stream = s;
  cb->free_seq = parent->free_seq;
  cb->state = BlockState::kFree;
  chunk->first = cb;
  state(s).free[kSmallPool].insert(cb);
  return take(cb, size, s);
}

void Allocator::run_extent(const Block* b, uintptr_t* lo, uintptr_t* hi) {
  const Block* first = b;
  while (large_mem(first->prev)) first = first->prev;
  const Block* last = b;
  while (large_mem(last->next)) last = last->next;
  *lo = first->addr;
  *hi = last->end();
}

void Allocator::lend_chunk_stats(Block* parent, Segment* chunk, int sign) {
  // Lending (sign +1, parent still large memory) splits parent's run of
  // large memory into the parts beside it, if any, and adds a small-pool
  // segment; taking the chunk back (sign -1, parent large memory again)
  // undoes that.
  int64_t cs = static_cast<int64_t>(chunk->size);
  int64_t runs = (large_mem(parent->prev) ? 1 : 0) + (large_mem(parent->next) ? 1 : 0) - 1;
  if (sign > 0) {
    stats_.reserved_bytes.move(kLargePool, kSmallPool, cs);
    if (runs < 0) stats_.segment.add(kLargePool, runs);
    stats_.segment.add(kSmallPool, 1);
    if (runs > 0) stats_.segment.add(kLargePool, runs);
  } else {
    stats_.reserved_bytes.move(kSmallPool, kLargePool, cs);
    stats_.segment.add(kSmallPool, -1);
    if (runs != 0) stats_.segment.add(kLargePool, -runs);
  }
  if (!history_on_) return;
  try {
    trace_lend(parent, chunk, sign);
  } catch (const std::bad_alloc&) {  // left out of the history (history.cpp); the pool is whole
  }
}

Block* Allocator::alloc_large(size_t size, Stream s, size_t request, bool* retried) {
  // Where the pool grows comes last: after every other free block, and
  // after the wholly free chunks the small pool can give back.
  Block* frontier = nullptr;
  Block* b = find_large(size, s, &frontier);
  if (b == nullptr && free_chunks_ > 0 && reclaim_free_chunks() > 0) b = find_large(size, s, &frontier);
  if (b == nullptr) b = frontier;
  if (b != nullptr) return take(b, size, s);

  // The pool must grow. A request it can never hold fails here, before any
  // page is mapped or any cached memory is thrown away for nothing.
  std::string why;
  size_t room = kUnknownRoom;
  bool hopeless = false;
  if (!may_grow(size, &room, &why, &hopeless)) refuse(request, size, s, why, true, hopeless);
  if (vmm_ && takes_other_area(size, room, s)) {
    // Where growing would move pages out of holes (the cap or the device is
    // reached), take the pool past pool_size, or may map nothing (a
    // capture), a free block of the other area serves it in place, with no
    // device call: pool_size serves requests of both areas.
    AreaScope other(*this, !small_area_);
    b = find_large(size, s, &frontier);
    if (b == nullptr) b = frontier;
    if (b != nullptr) return take(b, size, s);
  }
  b = vmm_ ? map_for(size, s, &why, room) : grow(size, s, &why, room);
  if (b == nullptr && !backend_->is_capturing(s) && !backend_->capture_underway()) {
    // Give back everything cached and try once more, as PyTorch does. The
    // handles unmapped wait as spares (as pages moving out of holes do:
    // map_for()), so the retry maps them again rather than create new ones;
    // what it has no use for is released at the end.
    // Once per malloc: a second attempt (after the owner gave memory back,
    // malloc_refused()) may come here again.
    if (!*retried) stats_.num_alloc_retries++;
    *retried = true;
    try {
      {
        if (vmm_) spare_nodes_.reserve(handles_.size());  // each handle unmapped may wait as a spare
        KeepHandles keep(keep_handles_, vmm_ && backend_->vmm_moves());
        release_cached();
      }
      b = find_free(kLargePool, size, s);
      if (b == nullptr && may_grow(size, &room, &why, &hopeless))
        b = vmm_ ? map_for(size, s, &why, room) : grow(size, s, &why, room);
    } catch (...) {
      drop_spares();
      throw;
    }
    drop_spares();
  }
  if (b == nullptr) refuse(request, size, s, why, false, hopeless);
  return take(b, size, s);
}

bool Allocator::may_grow(size_t size, size_t* room, std::string* why, bool* hopeless) {
  // What no release can give back: the allocated bytes. Pending frees are
  // not counted: the out-of-memory path waits for them.
  size_t held = static_cast<size_t>(stats_.allocated_bytes.all.current);
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t cap = cfg_.max_pool_size;
  // Beyond the pool's own cap, or the device's, nothing given back helps:
  // hopeless, and no other pool gives back its cache for nothing.
  *hopeless = true;
  if (cap != 0 && (size > cap || held > cap - size)) {
    *why = "the allocated memory and this request would exceed the pool's cap" + std::string(kNoRetry);
    return false;
  }
  // One question to the backend: a driver call per growth, never per cache hit.
  size_t dev_free = 0, dev_total = 0;
  backend_->mem_info(&dev_free, &dev_total);
  *room = kUnknownRoom;
  if (dev_total == 0) return true;  // unbounded, or not known during a capture
  if (size > dev_total) {
    *why = "larger than the device's total memory (" + format_bytes(dev_total) + ")" + kNoRetry;
    return false;
  }
  if (size_t shared = backend_->shared_cap(); shared != 0 && size > shared) {
    *why = "larger than the memory fraction lets all of the device's pools reserve (" + format_bytes(shared) +
           ")" + kNoRetry;
    return false;
  }
  *hopeless = false;
  // Spare handles (an out-of-memory retry's) hold memory the mapping takes first.
  for (size_t h : spares_) dev_free += h;
  *room = dev_free;
  size_t give_back = reserved - std::min(held, reserved);
  if (size > dev_free && size - dev_free > give_back) {
    *why = std::string("the ") + backend_->name() + " backend cannot provide it, even with all of the "
           "pool's unallocated memory given back";
    return false;
  }
  return true;
}

bool Allocator::takes_other_area(size_t size, size_t room, Stream s) {
  if ((backend_->is_capturing(s) || backend_->capture_underway()) && !backend_->grows_while_capturing())
    return true;
  size_t pages = round_up(size, page_);
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t keep = kept_pool_size();
  return (cfg_.max_pool_size != 0 && reserved + pages > cfg_.max_pool_size) ||
         (room != kUnknownRoom && pages > room) ||
         (keep != 0 && reserved <= keep && reserved + pages > keep);
}

size_t Allocator::kept_pool_size() const {
  size_t keep = cfg_.pool_size;
  if (keep == 0) return 0;
  keep = vmm_ ? round_up(keep, page_) : round_up(keep, kSegmentAlign);
  // A segment of a cap off the granularity would hold a block no granule tiles.
  if (cfg_.max_pool_size != 0) keep = std::min(keep, cfg_.max_pool_size / kGranularity * kGranularity);
  return keep;
}

bool Allocator::fits_split_rule(const Block* b, size_t size) const {
  // A bestfit rule: under vmm, splitting a big block strands no memory (its
  // free pages can be unmapped), and map_for() relies on best fit taking any
  // mapped block that fits.
  size_t limit = cfg_.max_split_size;
  if (limit == 0 || vmm_ || b->segment->pool == kSmallPool) return true;
  if (size < limit) return b->size < limit;
  return b->size < size + kOversizeSlack;
}

bool Allocator::held_back(const Block* x, Block** frontier) const {
  if (frontier == nullptr || !at_frontier(x)) return false;
  // Of the frontier blocks that fit, the smallest (then the lowest).
  const Block* f = *frontier;
  if (f == nullptr || x->size < f->size || (x->size == f->size && x->addr < f->addr))
    *frontier = const_cast<Block*>(x);
  return true;
}

Block* Allocator::find_free(Pool pool, size_t size, Stream s) {
  StreamState& st = state(s);
  // Small-pool blocks (chunks') are of any area.
  Block* b = st.free[pool].best_fit(size, [&](const Block* x) {
    return (pool == kSmallPool || in_area(x)) && fits_split_rule(x, size);
  });
  if (b != nullptr || streams_.size() == 1) return b;
  return find_other_streams(pool, size, s, nullptr);
}

Block* Allocator::find_large(size_t size, Stream s, Block** frontier) {
  FreeIndex& index = state(s).free[kLargePool];
  auto fits = [&](const Block* x) { return in_area(x) && fits_split_rule(x, size); };
  *frontier = nullptr;
  Block* b = index.best_fit(size, fits);
  if (b != nullptr && at_frontier(b)) {
    // The smallest block that fits is at the frontier (seldom, but always in
    // a cache-hit loop, where it is the only free block): look again without
    // the frontier, and keep it for last.
    *frontier = b;
    b = index.count() == 1 ? nullptr : index.best_fit(size, [&](const Block* x) {
      return fits(x) && !at_frontier(x);
    });
  }
  if (b != nullptr || streams_.size() == 1) return b;
  return find_other_streams(kLargePool, size, s, frontier);
}

Block* Allocator::find_other_streams(Pool pool, size_t size, Stream s, Block** frontier) {
  Block* best = nullptr;
  for (auto& [stream, stp] : streams_) {
    StreamState& o = *stp;
    if (stream == s || o.free[pool].empty()) continue;
    auto ready = [&](const Block* x) {
      return x->free_seq <= o.ready_seq && (pool == kSmallPool || in_area(x)) && fits_split_rule(x, size) &&
             !held_back(x, frontier);
    };
    poll_syncs(o, false);
    Block* b = o.free[pool].best_fit(size, ready);
    if (b == nullptr && o.synced_seq < o.last_free_seq && !backend_->is_capturing(o.stream)) {
      // Mark how far o's queue has got; an idle stream passes it at once.
      add_sync(o);
      poll_syncs(o, false);
      b = o.free[pool].best_fit(size, ready);
    }
    if (b != nullptr && (best == nullptr || b->size < best->size)) best = b;
  }
  return best;
}

Block* Allocator::take(Block* b, size_t size, Stream s) {
  Pool pool = b->segment->pool;
  FreeIndex& index = state(b->stream).free[pool];
  size_t rest = b->size - size;
  // A large remainder too small for any large request is kept whole, as in
  // PyTorch, except under vmm: there it keeps whole pages from being mapped.
  bool split = !cfg_.no_split &&
               (pool == kSmallPool ? rest >= kGranularity
                                   : rest > (vmm_ ? kGranularity - 1 : cfg_.small_size) &&
                                         (cfg_.max_split_size == 0 || vmm_ || size < cfg_.max_split_size));
  if (!split) {
    track_inactive_split(b, -1);
    index.remove(b);
    if (b->stream != s) {
      // Taken from another stream only once safe for every stream.
      b->stream = s;
      b->free_seq = 0;
    }
    b->state = BlockState::kAllocated;
    return b;
  }
  // The front becomes a new block; b stays listed as the remainder, in
  // place unless its bin changes.
  bool was_split = b->is_split();
  Block* a = new_block();
  a->addr = b->addr;
  a->size = size;
  a->segment = b->segment;
  a->prev = b->prev;
  a->next = b;
  if (b->prev != nullptr) b->prev->next = a;
  else b->segment->first = a;
  b->prev = a;
  b->addr += size;
  index.resize(b, rest);
  // b stays an inactive split block, `size` smaller (or becomes one).
  if (was_split) change_inactive_split(pool, 0, -static_cast<int64_t>(size));
  else change_inactive_split(pool, 1, static_cast<int64_t>(rest));
  a->stream = s;
  a->free_seq = b->stream == s ? b->free_seq : 0;
  a->state = BlockState::kAllocated;
  return a;
}

Block* Allocator::grow(size_t size, Stream s, std::string* why, size_t room) {
  if (backend_->is_capturing(s) && !backend_->grows_while_capturing()) {
    *why = "the stream is being captured into a CUDA graph and the pool cannot grow during "
           "capture; reserve the memory before capture (pyalloc reserve())";
    return nullptr;
  }
  size_t exact = round_up(size, kSegmentAlign);
  // A pool that never splits would hand the whole segment to this request.
  size_t want = cfg_.no_split ? exact : std::max(round_up(cfg_.segment_size, kSegmentAlign), exact);
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t cap = cfg_.max_pool_size;
  if (cap != 0) {
    if (reserved + want > cap) want = exact;
    if (reserved + want > cap) want = size;
    if (reserved + want > cap) {
      *why = "growing the pool would exceed its cap";
      return nullptr;
    }
  }
  // Sizes the device has no room for are not asked for.
  if (want > room && want > exact) want = exact;
  uintptr_t base = want <= room ? device_reserve(want) : 0;
  if (base == 0 && want > exact) {
    want = exact;
    base = device_reserve(want);
  }
  if (base == 0) {
    *why = std::string("the ") + backend_->name() + " backend could not provide a " + format_bytes(want) +
           " segment";
    return nullptr;
  }
  return add_segment(base, want, s);
}

Block* Allocator::add_segment(uintptr_t base, size_t size, Stream s) {
  // Listed before anything changes; if that fails, the memory goes back.
  std::unique_ptr<Segment> owned;
  try {
    state(s);
    owned = std::make_unique<Segment>();
    segments_.emplace(base, owned.get());
  } catch (...) {
    backend_->release(base, size);
    stats_.num_driver_calls++;
    throw;
  }
  Segment* seg = owned.release();
  seg->base = base;
  seg->size = size;
  seg->pool = kLargePool;
  seg->id = next_segment_id_++;
  seg->stream = s;
  Block* b = new_block();
  b->addr = base;
  b->size = size;
  b->segment = seg;
  b->stream = s;
  b->free_seq = 0;  // fresh memory: no stream has used it
  b->state = BlockState::kFree;
  seg->first = b;
  state(s).free[kLargePool].insert(b);
  stats_.segment.add(kLargePool, 1);
  stats_.reserved_bytes.add(kLargePool, static_cast<int64_t>(size));
  stats_.num_device_alloc++;
  if (cfg_.max_split_size != 0 && size >= cfg_.max_split_size) stats_.oversize_segments.add(1);
  if (history_on_) trace(TraceEntry::kSegmentAlloc, base, size, s);
  return b;
}

// ---------------------------------------------------------------------------
// free

void Allocator::free(uintptr_t ptr, uint64_t context) {
  if (try_free(ptr, context)) return;
  std::lock_guard<Lock> guard(mu_);
  throw InvalidPointerError(describe_bad_pointer(ptr, "free"));
}

// Inlined into try_free(), the hot path: out of line it cost some 17
// instructions a free (callgrind, cache-hit pairs).
[[gnu::always_inline]] inline void Allocator::free_locked(uintptr_t ptr, Block* b, uint64_t context) {
  if (!b->uses.empty()) return free_pending(ptr, b, context);
  release_live(ptr, b, context);
  finish_free(b);
}

[[gnu::always_inline]] inline void Allocator::release_live(uintptr_t ptr, Block* b, uint64_t context) {
  live_.erase(ptr);
  Pool pool = b->segment->pool;
  stats_.allocation.add(pool, -1);
  stats_.allocated_bytes.add(pool, -static_cast<int64_t>(b->size));
  if (cfg_.max_split_size != 0 && b->size >= cfg_.max_split_size) stats_.oversize_allocations.add(-1);
  if (history_on_) {
    ContextScope scope(&trace_context_, context != 0 ? context : b->context);
    trace(TraceEntry::kFreeRequested, b->addr, b->requested, b->stream);
  }
}

void Allocator::free_pending(uintptr_t ptr, Block* b, uint64_t context) {
  // Other streams may still read it: free once their queued work is done.
  // Room and events first: if either fails, the block is still live.
  if (pending_.size() == pending_.capacity()) pending_.reserve(std::max<size_t>(8, 2 * pending_.size()));
  PendingFree pf{b, {}};
  pf.events.reserve(b->uses.size());
  try {
    for (Stream u : b->uses) pf.events.push_back(backend_->record_event(u));
  } catch (...) {
    for (EventId e : pf.events) backend_->event_free(e);
    throw;
  }
  release_live(ptr, b, context);
  b->state = BlockState::kPendingFree;
  pending_.push_back(std::move(pf));
}

bool Allocator::try_free(uintptr_t ptr, uint64_t context) {
  if (ptr == 0) return true;  // free(nullptr) is a no-op, as for malloc(0)
  std::lock_guard<Lock> guard(mu_);
  Block* b = live_.find(ptr);
  if (b == nullptr) return false;
  OpEnd end{this};
  free_locked(ptr, b, context);
  return true;
}

bool Allocator::free_at_once(uintptr_t ptr) {
  std::lock_guard<Lock> guard(mu_);
  Block* b = live_.find(ptr);
  if (b == nullptr) throw InvalidPointerError(describe_bad_pointer(ptr, "free"));
  OpEnd end{this};
  // An event recorded on each stream the block was also used on now: done
  // means every kernel queued there before this free has finished, which
  // is all the pending free would wait for. A capturing stream's work runs
  // only at replay: no event tells.
  for (Stream u : b->uses) {
    if (backend_->is_capturing(u)) return false;
    EventId e = backend_->record_event(u);
    bool done = backend_->event_done(e);
    backend_->event_free(e);
    if (!done) return false;
  }
  b->uses.clear();
  free_locked(ptr, b, 0);
  return true;
}

void Allocator::record_stream(uintptr_t ptr, Stream s) {
  if (ptr == 0) return;
  std::lock_guard<Lock> guard(mu_);
  Block* b = live_.find(ptr);
  if (b == nullptr) throw InvalidPointerError(describe_bad_pointer(ptr, "record_stream"));
  if (s == b->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), s) == b->uses.end()) b->uses.push_back(s);
}

void Allocator::finish_free(Block* b) {
  Pool pool = b->segment->pool;
  stats_.active.add(pool, -1);
  stats_.active_bytes.add(pool, -static_cast<int64_t>(b->size));
  stats_.requested_bytes.add(pool, -static_cast<int64_t>(b->requested));  // with active, as PyTorch does
  if (history_on_) {
    ContextScope scope(&trace_context_, b->context);
    trace(TraceEntry::kFreeCompleted, b->addr, b->requested, b->stream);
  }
  b->uses.clear();
  b->requested = 0;
  b->context = 0;
  StreamState& st = state(b->stream);
  b->free_seq = ++free_seq_;
  st.last_free_seq = b->free_seq;
  insert_free(b);
}

bool Allocator::is_ready(const Block* b) { return b->free_seq <= state(b->stream).ready_seq; }

Block* Allocator::insert_free(Block* b) {
  Block* prev = b->prev;
  Block* next = b->next;
  bool prev_free = prev != nullptr && prev->free_mapped();
  bool next_free = next != nullptr && next->free_mapped();
  if (prev_free != next_free) {
    // The common case: one free neighbour, of the same stream, absorbs b in
    // place, unless its far side is free too (then the general path decides).
    Block* m = prev_free ? prev : next;
    Block* far = prev_free ? m->prev : m->next;
    if (m->stream == b->stream && (far == nullptr || !far->free_mapped())) {
      int64_t before_blocks = 1, before_bytes = static_cast<int64_t>(m->size);  // m is split
      m->free_seq = std::max(m->free_seq, b->free_seq);
      Pool pool = m->segment->pool;
      state(m->stream).free[pool].resize(m, m->size + b->size);
      take_place_of(m, b);
      bool split = m->is_split();
      change_inactive_split(pool, (split ? 1 : 0) - before_blocks,
                            (split ? static_cast<int64_t>(m->size) : 0) - before_bytes);
      if (!split && pool == kSmallPool) free_chunks_++;
      return m;
    }
  }
  // Merging can bring b next to another mergeable block (one of its own
  // stream behind a neighbour of another stream), so merge until none is.
  while (merge_neighbour(b, b->prev) || merge_neighbour(b, b->next)) {
  }
  b->state = BlockState::kFree;
  state(b->stream).free[b->segment->pool].insert(b);
  track_inactive_split(b, +1);
  if (b->segment->pool == kSmallPool && !b->is_split()) free_chunks_++;
  return b;
}

bool Allocator::merge_neighbour(Block* b, Block* n) {
  if (n == nullptr || !n->free_mapped()) return false;
  if (n->stream == b->stream) {
    b->free_seq = std::max(b->free_seq, n->free_seq);
  } else if (!is_ready(n)) {
    // n may still be in use by its stream: merge only if b is safe there.
    if (!is_ready(b)) return false;
    b->stream = n->stream;
    b->free_seq = n->free_seq;
  }
  state(n->stream).free[b->segment->pool].remove(n);
  track_inactive_split(n, -1);
  b->size += n->size;
  take_place_of(b, n);
  return true;
}

void Allocator::take_place_of(Block* b, Block* n) {
  if (n == b->prev) {
    b->addr = n->addr;
    b->prev = n->prev;
    if (n->prev != nullptr) n->prev->next = b;
    else b->segment->first = b;
  } else {
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
  }
  drop_block(n);
}

// ---------------------------------------------------------------------------
// Events

void Allocator::add_sync(StreamState& st) {
  EventId e = backend_->record_event(st.stream);
  try {
    st.syncs.emplace_back(e, st.last_free_seq);
  } catch (...) {
    backend_->event_free(e);
    throw;
  }
  st.synced_seq = st.last_free_seq;
}

void Allocator::poll_syncs(StreamState& st, bool wait) {
  if (wait && st.synced_seq < st.last_free_seq) add_sync(st);
  while (!st.syncs.empty()) {
    auto [event, seq] = st.syncs.front();
    if (wait ? !backend_->event_wait(event) : !backend_->event_done(event)) break;
    backend_->event_free(event);
    st.ready_seq = std::max(st.ready_seq, seq);
    st.syncs.pop_front();
  }
}

void Allocator::process_pending(bool wait) {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    PendingFree& pf = pending_[i];
    bool done = true;
    for (EventId e : pf.events) {
      if (wait ? !backend_->event_wait(e) : !backend_->event_done(e)) {
        done = false;
        break;
      }
    }
    if (!done) {
      if (kept != i) pending_[kept] = std::move(pf);
      kept++;
      continue;
    }
    for (EventId e : pf.events) backend_->event_free(e);
    finish_free(pf.block);
  }
  pending_.resize(kept);
}

// ---------------------------------------------------------------------------
// Giving memory back

size_t Allocator::reclaim_free_chunks() {
  size_t reclaimed = 0;
  for (size_t i = 0; i < chunks_.size();) {
    Segment* chunk = chunks_[i];
    if (!chunk->wholly_free()) {
      ++i;
      continue;
    }
    Block* cb = chunk->first;
    state(cb->stream).free[kSmallPool].remove(cb);
    Block* parent = chunk->parent;
    parent->chunk = nullptr;
    parent->stream = cb->stream;
    parent->free_seq = cb->free_seq;
    lend_chunk_stats(parent, chunk, -1);
    chunks_[i] = chunks_.back();
    chunks_[i]->index = i;
    chunks_.pop_back();
    drop_block(cb);
    delete chunk;
    insert_free(parent);
    reclaimed++;
  }
  free_chunks_ = 0;
  return reclaimed;
}

void Allocator::merge_ready_neighbours() {
  // Called once every stream has been waited for, so nearly every free block
  // is safe for every stream. Not a block whose wait failed (a failed event;
  // a capture declared since the check): it merges only as merge_neighbour()
  // lets it, so that its memory never reaches another stream before its own
  // is done with it.
  auto merge_runs = [&](Segment* seg) {
    for (Block* b = seg->first; b != nullptr; b = b->next) {
      if (!b->free_mapped() || b->next == nullptr || !b->next->free_mapped()) continue;
      state(b->stream).free[seg->pool].remove(b);
      track_inactive_split(b, -1);
      while (merge_neighbour(b, b->next)) {
      }
      state(b->stream).free[seg->pool].insert(b);
      track_inactive_split(b, +1);
      if (seg->pool == kSmallPool && !b->is_split()) free_chunks_++;
    }
  };
  for (Segment* c : chunks_) merge_runs(c);
  for (auto& [base, seg] : segments_) merge_runs(seg);
}

size_t Allocator::release_cached(size_t keep) {
  // Nothing may be waited for or returned while a graph is being captured.
  if (backend_->capture_underway()) return 0;
  size_t released = unpark();
  // Wait for every stream so that every free block is safe anywhere (but
  // those whose wait failed: merge_ready_neighbours()).
  process_pending(true);
  for (auto& [stream, st] : streams_) poll_syncs(*st, true);
  stats_.num_sync_all_streams++;
  merge_ready_neighbours();
  reclaim_free_chunks();
  // Whatever would take the pool below `keep` stays reserved.
  auto above_keep = [&]() -> size_t {
    size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
    return reserved > keep ? reserved - keep : 0;
  };
  if (vmm_) {
    size_t want = keep == 0 ? SIZE_MAX : above_keep() / page_ * page_;
    // All waited for above; above keep, never below it.
    if (want > 0) released += unmap_free_pages(want, 0, 0, /*wait=*/false, false, /*at_most=*/keep != 0);
    // Handles too large to stop at `keep` (a run's last handle larger than
    // what is above it) go too, and empty_cache() maps the pool back up to
    // it: otherwise a pool whose handles fell that way kept a whole cache
    // above pool_size.
    if (keep != 0 && (want = above_keep() / page_ * page_) > 0)
      released += unmap_free_pages(want, 0, 0, /*wait=*/false, false, /*at_most=*/false);
  }
  // Oldest first (the pool reserved at the start, if it is still there),
  // a free segment stays while it fits under `keep` with what stays already.
  std::vector<Segment*> free_segments;
  size_t kept = 0;
  for (auto& [base, seg] : segments_) {
    if (seg->vmm) continue;
    if (seg->wholly_free()) free_segments.push_back(seg);
    else kept += seg->size;
  }
  std::sort(free_segments.begin(), free_segments.end(),
            [](const Segment* x, const Segment* y) { return x->id < y->id; });
  for (Segment* seg : free_segments) {
    if (kept + seg->size <= keep) {
      kept += seg->size;
      continue;
    }
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

void Allocator::release_segment(Segment* seg) {
  Block* b = seg->first;
  state(b->stream).free[kLargePool].remove(b);
  segments_.erase(seg->base);
  backend_->release(seg->base, seg->size);
  stats_.num_driver_calls++;
  stats_.segment.add(kLargePool, -1);
  stats_.reserved_bytes.add(kLargePool, -static_cast<int64_t>(seg->size));
  stats_.num_device_free++;
  if (cfg_.max_split_size != 0 && seg->size >= cfg_.max_split_size) stats_.oversize_segments.add(-1);
  if (history_on_) trace_segment_free(seg->base, seg->size, seg->stream,
                                     !segment_from(seg->base) && segment_below(seg->base));
  drop_block(b);
  delete seg;
}

size_t Allocator::empty_cache() {
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  set_area(false);  // pool_size, if mapped again, is the large area's
  prepare_bookkeeping();
  size_t keep = kept_pool_size();
  if (keep == 0 || backend_->capture_underway()) return release_cached(0);
  size_t released = release_cached(keep);
  // Below pool_size (the out-of-memory path released it, or what was free
  // did not add up to it): reserve the rest again, as far as the backend lets.
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  if (reserved >= keep) return released;
  size_t want = keep - reserved;
  std::string why;
  prepare(0);
  if (vmm_) {
    map_for(want, 0, &why, kUnknownRoom, /*exact=*/true, /*fresh=*/true);
  } else if (uintptr_t base = device_reserve(want); base != 0) {
    add_segment(base, want, 0);
  }
  reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t restored = reserved > keep - want ? reserved - (keep - want) : 0;
  return released > restored ? released - restored : 0;
}

size_t Allocator::reserve(size_t nbytes) {
  if (nbytes == 0) return 0;
  if (nbytes > kMaxRequest)
    throw std::invalid_argument("cannot reserve " + std::to_string(nbytes) + " bytes: too large");
  size_t want = round_up(nbytes, kSegmentAlign);
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  // Under vmm, a free range of the area a request of nbytes takes.
  AreaScope area(*this, vmm_ && round_up(nbytes, kGranularity) <= kSmallArea);
  if (largest_free_in_area() >= round_up(nbytes, kGranularity)) return 0;
  prepare(0);
  if (vmm_) {
    unpark();  // first: map_for() would, and they are no part of what this reserves
    int64_t before = stats_.reserved_bytes.all.current;
    std::string why;
    if (map_for(round_up(nbytes, kGranularity), 0, &why, kUnknownRoom, /*exact=*/true) == nullptr)
      throw OutOfMemoryError("out of memory: reserve(" + format_bytes(nbytes) + "): " + why);
    // Under a cap, pages moved out of holes for it leave reserved as it was.
    return static_cast<size_t>(std::max<int64_t>(0, stats_.reserved_bytes.all.current - before));
  }
  size_t reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  if (cfg_.max_pool_size != 0 && reserved + want > cfg_.max_pool_size)
    throw OutOfMemoryError("out of memory: reserve(" + format_bytes(nbytes) + ") would exceed " +
                           "max_pool_size " + format_bytes(cfg_.max_pool_size) + " (reserved " +
                           format_bytes(reserved) + ")");
  uintptr_t base = device_reserve(want);
  if (base == 0)
    throw OutOfMemoryError(std::string("out of memory: reserve(") + format_bytes(nbytes) +
                           "): the " + backend_->name() + " backend could not provide " +
                           format_bytes(want));
  add_segment(base, want, 0);
  return want;
}

void Allocator::set_max_pool_size(size_t bytes) {
  std::lock_guard<Lock> guard(mu_);
  cfg_.max_pool_size = bytes;
}

// ---------------------------------------------------------------------------
// Errors

std::string Allocator::describe_bad_pointer(uintptr_t ptr, const char* op) const {
  std::string where = std::string(op) + "(" + format_ptr(ptr) + "): ";
  const Block* b = block_at(ptr);
  if (b == nullptr)
    return where + "not a pointer from this allocator (it lies outside every segment of its pool)";
  if (b != nullptr && b->state != BlockState::kAllocated)
    return where + "double free or stale pointer: the memory at this address is already free";
  if (b != nullptr && b->addr != ptr)
    return where + "points " + std::to_string(ptr - b->addr) + " bytes into the allocation at " +
           format_ptr(b->addr) + "; pass the pointer malloc() returned";
  return where + "not a live allocation";
}

}  // namespace pyalloc
