// The allocator core: one pool per Allocator, over one Backend.
//
// Policy, in one place for every backend:
// - Sizes round up to 512 B. Requests of at most small_size go to the small
//   pool, the rest to the large pool, so small churn never cuts up the large
//   free ranges: the small pool borrows whole chunks (small_chunk_size) from
//   the large pool and gives a chunk back only once it is wholly free and the
//   large pool needs room (or on empty_cache / out of memory).
// - The large pool is the backend's segments: pool_size reserved at start,
//   then growth by at least segment_size, never past max_pool_size.
// - Best fit (free_index.h) over the free blocks of the caller's stream, then
//   over other streams' blocks that are safe to take; the remainder of a fit
//   is split off when it is worth keeping; a freed block merges with free
//   neighbours of its segment (never across segments).
// - Streams. A freed block stays labelled with its stream S and a sequence
//   number. S may reuse it at once (its queued work is ordered). Another
//   stream may take it only once an event recorded on S after the free has
//   completed: the core records such an event lazily, when another stream
//   first looks for memory, so the free path makes no backend call.
//   record_stream(p, T) makes free(p) wait for an event on T as well before
//   the block becomes free at all ("pending free", as in PyTorch).
// - Out of memory: release every cached free segment (after waiting for all
//   events), retry once; then, if the owner's policy gives back memory held
//   elsewhere (oom.h), once more; only then raise OutOfMemoryError saying
//   why, counted and traced here, once. Nothing live is moved or touched. A
//   request the pool can never hold (beyond max_pool_size with what stays
//   allocated, or beyond the device's free memory plus everything the pool
//   could give back: one mem_info() per growth tells) is refused at once,
//   before anything is mapped or released.
// - Strategy "vmm" (backends with virtual memory): the large pool is one
//   virtual range; physical pages are mapped under a block when it is taken
//   and stay mapped while free (a cache). When a request fits no mapped free
//   block, pages are mapped in the unmapped range that needs the fewest; only
//   when that would pass max_pool_size (or the device is full) are wholly
//   free pages of holes unmapped first, so free memory in holes can back a
//   new large allocation. A free block beside unmapped pages (the frontier,
//   where the pool grows) is taken only when no other free block fits. So a
//   loop that repeats exactly puts each block where its first pass did, into
//   pages that pass mapped: after it, the loop maps and unmaps nothing.
//   The range has two areas, each growing upward from its start, as PyTorch
//   keeps a large and a small expandable segment: requests of at most
//   kSmallArea (PyTorch's small requests) and the small pool's chunks in the
//   upper one, larger requests in the lower one; a request takes free blocks
//   and maps pages only in its own area, so small blocks never wall in the
//   large ones. Pages move between the areas only as they move out of holes.
//   Pages are mapped in handles (backend.h), unmapped only whole: up to
//   32 MiB with room on the device, one page near a limit (vmm.cpp).
// - Host memory. The core's own bookkeeping (blocks, the pointer map, the
//   maps of the vmm range, chunk and pending-free lists, stream states) is
//   made before an operation changes anything (prepare(), node_reserve.h),
//   so that host memory running out fails the operation with
//   std::bad_alloc, the pool as it was: no half-listed block, nothing
//   leaked. It stays std::bad_alloc (Python's MemoryError), not
//   OutOfMemoryError: that one is the device's, and giving back device
//   memory, the answer to it, cannot help. The history alone drops an entry
//   it has no room for (history.cpp). tests/cpp's injection run fails every
//   allocation of a mixed workload in turn.
//
// Thread safety: every public method takes the allocator's lock (lock.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.h"
#include "block.h"
#include "config.h"
#include "free_index.h"
#include "lock.h"
#include "node_reserve.h"
#include "oom.h"
#include "ptr_map.h"
#include "stats.h"

namespace pyalloc {

/// One entry of the allocation history, in PyTorch's trace vocabulary.
struct TraceEntry {
  enum Action : uint8_t {
    kAlloc,
    kFreeRequested,
    kFreeCompleted,
    kSegmentAlloc,
    kSegmentFree,
    kSegmentMap,
    kSegmentUnmap,
    kOom,
  };
  Action action;
  uintptr_t addr;  // for kOom: the device's free bytes
  size_t size;     // requested size for alloc / free; segment size otherwise
  Stream stream;
  int64_t time_us;  // steady clock
  // The caller's tag (Allocator::malloc): alloc, oom and the segment events
  // the request caused carry the allocation's; free_requested the free's,
  // else the allocation's; free_completed the allocation's. 0: none.
  uint64_t context;
};

const char* trace_action_name(TraceEntry::Action a);

struct FragmentationInfo {
  size_t reserved_bytes = 0;
  size_t allocated_bytes = 0;
  size_t free_bytes = 0;           // free blocks in both pools
  size_t pending_free_bytes = 0;   // freed, waiting on record_stream streams
  size_t largest_free_block = 0;
  size_t free_blocks = 0;
  size_t large_free_bytes = 0;
  size_t large_largest_free_block = 0;
  size_t small_free_bytes = 0;
  size_t small_largest_free_block = 0;
  size_t free_small_chunks = 0;    // wholly free chunks the large pool could take back
  /// Free blocks by size: (lower bound of a power-of-two bucket, count, bytes).
  std::vector<std::tuple<size_t, size_t, size_t>> histogram;
};

struct SnapshotBlock {
  uintptr_t addr;
  size_t size;
  size_t requested;
  const char* state;  // "active_allocated", "active_pending_free", "inactive"
  uint64_t context;   // the allocation's tag (0 for free blocks)
};

struct SnapshotSegment {
  uintptr_t address = 0;
  size_t total_size = 0;
  size_t allocated_size = 0;
  size_t active_size = 0;
  size_t requested_size = 0;
  Stream stream = 0;
  Pool pool = kLargePool;   // small: a chunk lent to the small pool
  bool expandable = false;  // a mapped run of the virtual range (strategy vmm)
  std::vector<SnapshotBlock> blocks;
};

class Allocator {
 public:
  Allocator(std::unique_ptr<Backend> backend, const Config& config);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  /// `size` bytes usable on `stream`; 0 for size 0. Throws OutOfMemoryError
  /// once every retry failed (oom.h), worded by the OomPolicy if one is set;
  /// std::bad_alloc, with nothing changed, if host memory for the pool's
  /// bookkeeping runs out (as may every operation).
  /// `context` is an opaque tag the history and snapshot() carry for this
  /// allocation (PyTorch's recorded stack traces, kept by the caller); 0 for
  /// none.
  uintptr_t malloc(size_t size, Stream stream, uint64_t context = 0);
  /// malloc() from the pool's free blocks alone: 0, with nothing changed,
  /// if none fits, where malloc() would grow the pool or give back its
  /// cache. Never an out-of-memory error (another pool's out-of-memory path
  /// asks it: torch.cuda.MemPool(use_on_oom=True)).
  uintptr_t malloc_cached(size_t size, Stream stream, uint64_t context = 0);
  /// Allocates exactly [addr, addr + size rounded) for `stream`, which must
  /// be free memory of this pool, in one free block or in neighbouring ones
  /// of any streams (restoring a checkpoint of a pool, as PyTorch's
  /// CUDA-graph trees do: the caller orders the work on it); frees whose
  /// streams have finished complete first. std::invalid_argument if it is not.
  uintptr_t allocate_at(uintptr_t addr, size_t size, Stream stream, uint64_t context = 0);
  /// A live allocation as the pool holds it, for making it again exactly
  /// after a free (reinstate()).
  struct LiveBlockInfo {
    size_t size = 0;       // the block's bytes: its request rounded, or more (a remainder not worth splitting off)
    size_t requested = 0;  // what the caller asked for
    Stream stream = 0;
    uint64_t context = 0;
    std::vector<Stream> uses;  // the streams record_stream() added
  };
  /// false if ptr is no live allocation.
  bool live_block_info(uintptr_t ptr, LiveBlockInfo* out) const;
  /// Makes the block `info` describes live at addr again, as it was before
  /// its free (its bytes, request, stream, tag and recorded streams), from
  /// free memory as allocate_at() does: undoing a free exactly.
  /// std::invalid_argument if that range is not free in this pool.
  void reinstate(uintptr_t addr, const LiveBlockInfo& info);
  /// Throws InvalidPointerError for anything but a live allocation.
  /// `context`: the tag of this free for the history (0: the allocation's).
  void free(uintptr_t ptr, uint64_t context = 0);
  /// free() of a pointer that may belong to another pool: false, with
  /// nothing done, if ptr is no live allocation of this one.
  bool try_free(uintptr_t ptr, uint64_t context = 0);
  /// free() of ptr only if it completes now: false, with nothing changed, if
  /// a stream record_stream() named still has work queued (or is being
  /// captured), so that the block would wait as a pending free. Throws
  /// InvalidPointerError for anything but a live allocation.
  bool free_at_once(uintptr_t ptr);
  /// The block of `ptr` is also used on `stream`: on free, wait for it too.
  void record_stream(uintptr_t ptr, Stream stream);

  /// Returns wholly free segments (under vmm: free pages) to the backend,
  /// keeping pool_size reserved; the bytes released.
  size_t empty_cache();
  /// Grows the pool so that a free range of at least nbytes exists (under
  /// vmm, in the area a request of nbytes takes); the bytes newly reserved.
  size_t reserve(size_t nbytes);
  /// Unmaps the pages parked during a capture (their access refused: see
  /// unpark()) once no capture is underway; the bytes given back (0 during a
  /// capture). The device's pools call it when a capture ends, so that they
  /// do not wait for the next growth or release of cached memory.
  size_t release_parked();
  /// Changes max_pool_size (0: no cap); does not release anything.
  void set_max_pool_size(size_t bytes);
  /// Config::no_split from now on: blocks split before stay as they are.
  /// std::invalid_argument under strategy vmm (its pages are the unit).
  void set_no_split() {
    std::lock_guard<Lock> guard(mu_);
    if (vmm_) throw std::invalid_argument("a pool of strategy vmm cannot be made never to split its blocks");
    cfg_.no_split = true;
  }

  Stats stats() const;
  void reset_peak_stats();
  /// Every allocated / freed sum and counter starts again from 0.
  void reset_accumulated_stats();
  /// The largest mapped free block of either pool (bytes), without the
  /// rest of fragmentation()'s survey.
  size_t largest_free_block() const;
  /// From now on every operation also adds its changes to `sink` (which
  /// gets what the pool holds now at once); nullptr stops that. The sink
  /// must outlive the allocator or be detached first.
  void set_stats_sink(StatsSink* sink);
  /// The sink takes this pool's counts and peaks, under its lock, as the
  /// pool stops being the sink's solo allocator (StatsSink::join).
  void join_sink();
  FragmentationInfo fragmentation() const;
  /// The pool's memory as PyTorch reports it: one segment per contiguous run
  /// of large-pool memory (a backend segment, or a mapped run of the virtual
  /// range, less the chunks lent to the small pool) and one per small-pool
  /// chunk, each tiled exactly by its blocks. Matches stats()' segment and
  /// reserved_bytes counts pool by pool.
  std::vector<SnapshotSegment> snapshot() const;
  /// Throws InvariantError describing the first inconsistency found.
  void check_invariants() const;
  /// Returns once no operation of this allocator is under way (it takes and
  /// drops the lock). Every operation decides under the lock whether it may
  /// touch the device (backend_->capture_underway()), so a caller that has
  /// just declared a capture underway knows, once this returns, that no
  /// operation begun before the declaration is still releasing memory or
  /// querying events.
  void quiesce() const;

  /// A live allocation's requested size and stream, and (context not null)
  /// the tag malloc was given: false if ptr is none.
  bool live_block(uintptr_t ptr, size_t* requested, Stream* stream,
                  uint64_t* context = nullptr) const;
  /// The backend segment holding ptr: false if none does.
  bool segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// PyTorch's getBaseAllocation: the backend's allocations the block holding
  /// ptr lies in. Bestfit: its segment (cudaMalloc's). Vmm: the handles of
  /// pages under the block, which stay mapped while it is not free; not the
  /// virtual range, mostly unmapped. False if ptr is in no segment, or in
  /// unmapped pages.
  bool base_allocation(uintptr_t ptr, uintptr_t* base, size_t* size) const;
  /// The memory under the live allocation at ptr made shareable with
  /// another process, asked of the backend under the lock (the allocation
  /// keeps it where it is meanwhile): the backend segment holding it
  /// (Backend::share_segment, one entry), or, in the virtual range, each
  /// handle under its bytes in address order (Backend::vmm_share). False,
  /// with *why, if ptr is no live allocation of this pool or the backend
  /// refuses; *out then holds what was made shareable before the refusal
  /// (file descriptors for the caller to close).
  bool share(uintptr_t ptr, std::vector<SharedMemory>* out, std::string* why);

  void record_history(bool enabled, size_t max_entries);
  /// The history goes into one device trace with other allocators' (a
  /// device's pools): segments this allocator does not see may lie below
  /// its own in PyTorch's viewer (see trace_segment_free).
  void share_history() { history_shared_ = true; }
  /// Forgets the recorded history; recording goes on as it was.
  void clear_history();
  std::vector<TraceEntry> history() const;
  /// Appends every context tag still referenced: by a live block or by an
  /// entry of the history (so a caller can drop the contexts of the rest).
  void contexts_in_use(std::vector<uint64_t>* out) const;

  Backend& backend() { return *backend_; }
  Config config() const;

  /// The owner's part of the out-of-memory path (oom.h); null: none. Set
  /// before the allocator is used; the policy must outlive it.
  void set_oom_policy(OomPolicy* policy) { oom_policy_ = policy; }

 private:
  struct StreamState {
    explicit StreamState(Stream s) : stream(s) {}
    Stream stream;
    FreeIndex free[2];
    uint64_t ready_seq = 0;      // frees up to this are done on the device
    uint64_t last_free_seq = 0;  // the newest free on this stream
    uint64_t synced_seq = 0;     // frees covered by the newest sync event
    std::deque<std::pair<EventId, uint64_t>> syncs;  // (event, free_seq covered)
  };
  struct PendingFree {
    Block* block;
    std::vector<EventId> events;
  };
  // check_invariants()' steps, one per structure it verifies
  // (allocator_inspect.cpp); InvariantTally is what the block walk counts.
  struct InvariantTally;
  void check_segments(InvariantTally& t) const;
  void check_segment(const Segment* seg, InvariantTally& t) const;
  void check_unmapped_block(const Segment* seg, const Block* b, const Block* prev, const std::string& at,
                            InvariantTally& t) const;
  void check_mapped_block(const Segment* seg, const Block* b, const std::string& at, InvariantTally& t) const;
  void check_allocated_block(const Segment* seg, const Block* b, const std::string& at, InvariantTally& t) const;
  void check_handles() const;
  void check_chunk_index() const;
  void check_pending_frees(const InvariantTally& t) const;
  void check_ptr_map(const InvariantTally& t) const;
  void check_free_indexes(const InvariantTally& t) const;
  size_t check_free_index(Stream stream, Pool pool, const FreeIndex& idx, const InvariantTally& t) const;
  void check_stats(const InvariantTally& t) const;

  // Declared right after a public operation's lock guard, so that it runs
  // under the lock on every way out, exceptions included: the peaks settle
  // on the state the operation leaves (stats.h).
  struct OpEnd {
    Allocator* self;
    ~OpEnd() {
      self->stats_.settle();
      if (self->sink_ != nullptr && !self->sink_->skips(self)) self->sink_->push(self, self->stats_, &self->pushed_);
    }
  };

  // Sets a tag (trace_context_) for the duration of a scope; restores the
  // previous one after.
  class ContextScope {
   public:
    ContextScope(uint64_t* slot, uint64_t value) : slot_(slot), saved_(*slot) { *slot = value; }
    ~ContextScope() { *slot_ = saved_; }
    ContextScope(const ContextScope&) = delete;
    ContextScope& operator=(const ContextScope&) = delete;

   private:
    uint64_t* slot_;
    uint64_t saved_;
  };

  StreamState& state(Stream s) {
    if (last_state_ != nullptr && last_stream_ == s) return *last_state_;
    return state_slow(s);
  }
  StreamState& state_slow(Stream s);
  // Host memory for the core's own bookkeeping (blocks, the pointer map,
  // nodes of the vmm maps, s's stream state) made before an operation
  // changes anything, so that std::bad_alloc fails it with the pool as it
  // was. What an operation may take: kOpBlocks blocks under bestfit; under
  // vmm, where unmapping splits every free block it touches, twice the
  // blocks in use and as many map nodes (block_floor_). Two compares when
  // all is ready.
  void prepare(Stream s) {
    prepare_bookkeeping();
    state(s);
  }
  void prepare_bookkeeping() {
    if (spare_blocks_.size() < block_floor_ || map_nodes_.ready() < map_floor_ || live_.full()) prepare_slow();
  }
  void prepare_slow();
  // block_floor_ under vmm: 3 spare >= 2 total + kOpBlocks (spares for twice the blocks in use).
  size_t vmm_floor() const { return (2 * block_slabs_.size() * kSlab + kOpBlocks + 2) / 3; }
  static constexpr size_t kSlab = 256;
  static constexpr size_t kOpBlocks = 16;
  size_t block_floor_ = kOpBlocks;
  size_t map_floor_ = 0;
  // Inline: a split takes a block on the malloc+free hot path of a request
  // smaller than its free block (out of line, 18 instructions a pair).
  Block* new_block() {
    if (spare_blocks_.empty()) add_block_slab();
    Block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    return b;
  }
  void add_block_slab();
  void drop_block(Block* b);

  // A block found for a request becomes the caller's: pointer map, stats, history.
  uintptr_t hand_out(Block* b, size_t size, Stream s, uint64_t context);
  // The block (of either pool) whose range holds ptr, or null.
  Block* block_at(uintptr_t ptr) const;
  // allocate_at() and reinstate(): [addr, addr + extent) out of free memory
  // as one allocated block on stream s (rounded: the request's size, for
  // its pool); std::invalid_argument, prefixed with `where`, if it cannot be.
  Block* carve_at(uintptr_t addr, size_t extent, size_t rounded, Stream s, const std::string& where);
  // Splits free block b at `at`; returns the free block [at, b's old end).
  Block* split_free_at(Block* b, uintptr_t at);
  // *retried: whether this malloc has counted its out-of-memory retry
  // (num_alloc_retries counts each malloc that retried once, as PyTorch's
  // does, however many of its attempts reach the retry).
  Block* alloc_small(size_t size, Stream s, size_t request, bool* retried);
  Block* alloc_large(size_t size, Stream s, size_t request, bool* retried);
  // Best fit over the caller's stream, then over other streams' blocks that
  // are safe to take.
  Block* find_free(Pool pool, size_t size, Stream s);
  // find_free() in the large pool passing over blocks at the frontier
  // (at_frontier): the one to take last is left in *frontier.
  Block* find_large(size_t size, Stream s, Block** frontier);
  // With `frontier`, blocks at the frontier are passed over, as find_large().
  Block* find_other_streams(Pool pool, size_t size, Stream s, Block** frontier);
  // The frontier (vmm): a free block beside unmapped pages of the range,
  // where the pool grows. Taken only when no other free block fits, as
  // dlmalloc preserves its top chunk: a loop that repeats exactly then puts
  // each block where its first pass did, into memory that pass mapped.
  // The small area's first block grows only upward: the unmapped pages below
  // it are the large area's.
  bool at_frontier(const Block* b) const {
    return vmm_ && ((b->prev != nullptr && !b->prev->mapped && b->addr != small_floor_) ||
                    (b->next != nullptr && !b->next->mapped));
  }
  // Requests of at most this many bytes (rounded) go to the range's small
  // area, as PyTorch's small pool serves requests of up to 1 MiB.
  static constexpr size_t kSmallArea = size_t(1) << 20;
  // Whether the large-pool block b lies in the area of the request underway
  // (always but under vmm); one compare, on the cache-hit path.
  bool in_area(const Block* b) const { return b->addr - area_lo_ < area_len_; }
  // The area of the request underway (small: the small area), kept until
  // the next request sets its own: malloc() sets it only when it changes.
  void set_area(bool small) {
    small_area_ = small;
    if (small_floor_ == 0) return;
    area_lo_ = small ? small_floor_ : 0;
    area_len_ = small ? UINTPTR_MAX - small_floor_ : small_floor_;
  }
  // The area set for a scope inside a request, the request's restored after.
  struct AreaScope {
    Allocator& a;
    bool saved;
    AreaScope(Allocator& al, bool small) : a(al), saved(al.small_area_) { a.set_area(small); }
    ~AreaScope() { a.set_area(saved); }
  };
  // x is at the frontier: noted in *frontier if it is the one to take last.
  bool held_back(const Block* x, Block** frontier) const;
  bool fits_split_rule(const Block* b, size_t size) const;
  Block* take(Block* b, size_t size, Stream s);
  // The device's free bytes when a growth needs them; kUnknownRoom when the
  // backend does not say (unbounded, or a capture is underway).
  static constexpr size_t kUnknownRoom = SIZE_MAX;
  // Whether the pool could grow by size (the cap; the device's free memory
  // plus what the pool could give back); *room: the device's free bytes, and
  // those of the spare handles an out-of-memory retry holds.
  // *hopeless: refused where no memory given back anywhere could make room.
  bool may_grow(size_t size, size_t* room, std::string* why, bool* hopeless);
  // Ends the reason of a hopeless refusal (OomFailure::hopeless).
  static constexpr const char* kNoRetry =
      "; no retry was tried: no cached memory given back, by this pool or any other, could make room for it";
  // Whether a request of stream s the area of which has no free block for
  // size bytes takes one of the other area (vmm) rather than grow: size more
  // bytes of pages would pass the cap or the device's room (may_grow()'s),
  // so that pages would move out of holes, or take the pool past pool_size;
  // or no page may be mapped for s now (a capture the backend cannot grow
  // during).
  bool takes_other_area(size_t size, size_t room, Stream s);
  // What the pool keeps of pool_size: rounded up to whole pages (vmm) or
  // segment alignment, within max_pool_size's granules; 0 for none.
  size_t kept_pool_size() const;
  Block* grow(size_t size, Stream s, std::string* why, size_t room = kUnknownRoom);
  Block* add_segment(uintptr_t base, size_t size, Stream s);
  Block* insert_free(Block* b);
  bool merge_neighbour(Block* b, Block* n);
  // b takes n's place in the address list (b->size already covers n); n is dropped.
  void take_place_of(Block* b, Block* n);
  // Virtual memory (strategy vmm)
  void init();  // the constructor's work
  void init_vmm();
  // init_vmm()'s steps (vmm.cpp): size the range, try one page, turn the
  // range into the pool's segment (or back), map the kept trial page, map pool_size.
  size_t vmm_range_size(size_t page);
  bool vmm_trial_map(uintptr_t base, size_t page);
  Block* open_vmm_range(uintptr_t base, size_t range, size_t page);
  void close_vmm_range(uintptr_t base, size_t range, Block* b);
  bool map_trial_page(size_t page);
  void map_pool_size(uintptr_t base, size_t range, Block* b);
  // exact: nothing mapped ahead (pool_size, reserve(), what empty_cache() restores of pool_size).
  Block* map_for(size_t size, Stream s, std::string* why, size_t room = kUnknownRoom, bool exact = false,
                 bool fresh = false);
  Block* usable_neighbour(Block* n, Stream s);
  // Unmaps up to `want` bytes of whole free pages outside [keep_lo, keep_hi)
  // that every stream is done with (waiting for the streams if asked), in
  // address order; with all_or_none, nothing unless want can be reached;
  // whole handles, so more than want unless at_most.
  size_t unmap_free_pages(size_t want, uintptr_t keep_lo, uintptr_t keep_hi, bool wait,
                          bool all_or_none = false, bool at_most = false);
  Block* unmap_range(Block* f, uintptr_t lo, uintptr_t hi);
  // Handles: the physical allocations under the mapped pages (one
  // cuMemCreate each), mapped (vmm_map, then one vmm_access per range) and
  // unmapped (vmm_unmap) whole.
  // map_handles() maps [lo, lo+size) as handles and makes them accessible
  // in one call, or maps nothing and returns false; except that, given
  // `kept`, handles whose access is refused (or fails: it throws then)
  // during a capture stay mapped (unmapping them would break it) and *kept
  // says so: the caller parks them.
  // unmap_handles() unmaps the handles tiling [lo, hi).
  bool map_handles(uintptr_t lo, size_t size, bool* kept = nullptr);
  void unmap_handles(uintptr_t lo, uintptr_t hi);
  // The block of [lo, hi), mapped in u just now, cut out of u and counted
  // as reserved (a segment's run, history); allocated, on stream s.
  Block* cut_mapped(Block* u, uintptr_t lo, uintptr_t hi, Stream s);
  // Pages mapped during a capture whose access the device refused: held as
  // allocated blocks in no pointer map (never handed out, counted as
  // reserved), and unmapped once no capture is underway (unpark(), at the
  // capture's end: release_parked(), or the next mapping or release of cached
  // memory; returns the bytes unmapped).
  size_t unpark();
  bool parked(const Block* b) const {
    auto p = parked_.find(b->addr);
    return p != parked_.end() && p->second == b;
  }
  // Pages moving out of holes for a mapping (map_for()), where the backend
  // can move a handle (vmm_moves()): while keep_handles_ is set,
  // unmap_handles() detaches the handles and keeps them as spares_, which
  // map_handles() maps again before it creates any (cuMemUnmap and cuMemMap
  // for a handle that moves, not cuMemUnmap, cuMemRelease, cuMemCreate and
  // cuMemMap). map_for() drops whatever is left when it returns or throws;
  // so does the out-of-memory retry (alloc_large()), whose release_cached()
  // keeps the handles it unmaps for the mapping it retries.
  Block* map_for_moving(size_t size, Stream s, std::string* why, size_t room, bool exact, bool fresh);
  // map_for_moving()'s steps (vmm.cpp), in order: pick the unmapped block
  // and pages (MapPlan), make room under the cap, size the handles, extend
  // the mapping ahead, map, add the mapped block to the free index.
  struct MapPlan;
  bool pick_unmapped(size_t size, Stream s, bool fresh, MapPlan* plan);
  bool fit_cap(const MapPlan& plan, size_t* room, size_t* reserved, std::string* why);
  size_t size_handles(size_t room, size_t reserved);
  void map_ahead_extent(const MapPlan& plan, size_t headroom, size_t room, size_t reserved, bool exact,
                        uintptr_t* ext_lo, uintptr_t* ext_hi);
  bool map_pages(MapPlan* plan, uintptr_t ext_lo, uintptr_t ext_hi, size_t room, Stream s, std::string* why);
  Block* add_mapped(const MapPlan& plan, Stream s);
  // keep_handles_ set for a scope, cleared however it ends.
  struct KeepHandles {
    bool& flag;
    KeepHandles(bool& f, bool on) : flag(f) { flag = on; }
    ~KeepHandles() { flag = false; }
  };
  size_t unmap_free_pages_kept(size_t want, uintptr_t keep_lo, uintptr_t keep_hi);
  void drop_spares();
  // The size of the handle mapped at addr when [addr, end) is mapped.
  size_t handle_size(uintptr_t addr, uintptr_t end) const;
  // The run of whole handles inside the free mapped block b: [*lo, *hi).
  size_t whole_handles(const Block* b, uintptr_t* lo, uintptr_t* hi) const;
  // Adds what the backend asked the driver beyond what the core counted
  // (Backend::take_uncounted_calls()) when it goes, however the call ends.
  struct Recount {
    Allocator& a;
    ~Recount() { a.stats_.num_driver_calls += a.backend_->take_uncounted_calls(); }
  };
  // The backend's segments, their driver calls counted (stats.h).
  uintptr_t device_reserve(size_t size) {
    Recount recount{*this};
    stats_.num_driver_calls++;  // cuMemAlloc
    return backend_->reserve(size);
  }
  // free() of the live block b at ptr, under the lock.
  void free_locked(uintptr_t ptr, Block* b, uint64_t context);
  // Out of the pointer map and the allocated counts (free_locked()).
  void release_live(uintptr_t ptr, Block* b, uint64_t context);
  // free_locked() of a block record_stream() gave other streams: a pending
  // free, its events recorded before anything changes.
  void free_pending(uintptr_t ptr, Block* b, uint64_t context);
  // An event on st's stream covering its frees so far, listed in st.syncs;
  // the event is freed again if listing it fails.
  void add_sync(StreamState& st);
  // The destructor's work; also the constructor's when it throws.
  void release_all();
  void finish_free(Block* b);
  bool is_ready(const Block* b);
  void poll_syncs(StreamState& st, bool wait);
  void process_pending(bool wait);
  size_t reclaim_free_chunks();
  // Everything cached above `keep` reserved bytes goes back to the backend
  // (unmapped handles wait as spares instead while keep_handles_ is set).
  size_t release_cached(size_t keep = 0);
  void merge_ready_neighbours();
  void release_segment(Segment* seg);
  void track_inactive_split(const Block* b, int sign) {
    if (b->is_split()) change_inactive_split(b->segment->pool, sign, sign * static_cast<int64_t>(b->size));
  }
  // Applied once per operation with the net change, as PyTorch does. Under
  // vmm, never: inactive_split is memory empty_cache cannot give back, and
  // PyTorch leaves its expandable segments out of it (their free pages go
  // back), so its memory_summary() calls none of that cache non-releasable.
  void change_inactive_split(Pool pool, int64_t blocks, int64_t bytes) {
    if (vmm_) return;
    if (blocks != 0) stats_.inactive_split.add(pool, blocks);
    if (bytes != 0) stats_.inactive_split_bytes.add(pool, bytes);
  }
  // Large-pool "segments" are contiguous runs of large-pool memory (what a
  // snapshot lists): is b such memory (mapped, not lent as a chunk)?
  static bool large_mem(const Block* b) { return b != nullptr && b->mapped && b->chunk == nullptr; }
  // The run of large-pool memory around b (b itself must be large_mem).
  static void run_extent(const Block* b, uintptr_t* lo, uintptr_t* hi);
  // A chunk of parent's range moves between the pools: stats and history.
  void lend_chunk_stats(Block* parent, Segment* chunk, int sign);
  // Its history (history.cpp); may throw std::bad_alloc, the stats settled.
  void trace_lend(Block* parent, Segment* chunk, int sign);
  // History: the run of b loses [lo, hi), told as its pieces allocated
  // and the run freed (see lend_chunk_stats).
  void trace_split(const Block* b, uintptr_t lo, uintptr_t hi);
  // History: the run of b loses [lo, hi) (unmapped, or lent as a chunk),
  // told as PyTorch's viewer can undo it whatever the streams.
  void trace_unmap(const Block* b, uintptr_t lo, uintptr_t hi);
  struct TracePiece {
    uintptr_t addr;
    size_t size;
    Stream stream;
  };
  // The stream of the segment trace_replace lays over [a, e) meanwhile.
  static constexpr Stream kShadowStream = ~Stream{0};
  // History: the segments `before` of [a, e) become `after`.
  void trace_replace(uintptr_t a, uintptr_t e, const std::vector<TracePiece>& before,
                     const std::vector<TracePiece>& after);
  // Does a segment of the snapshot (a run, a chunk) start at addr or above?
  bool segment_from(uintptr_t addr) const;
  // ... or below addr?
  bool segment_below(uintptr_t addr) const;
  // History: the segment [addr, addr + size) freed; top: when the viewer
  // undoes the event, no segment lies above it and some lie below.
  void trace_segment_free(uintptr_t addr, size_t size, Stream s, bool top);
  // malloc() under the lock, once; throws Refused when the pool cannot serve it.
  uintptr_t malloc_once(size_t size, Stream s, uint64_t context, bool* retried);
  // The rest of the out-of-memory path (oom.h): the owner's retry, then the error.
  uintptr_t malloc_refused(size_t size, Stream s, uint64_t context, OomFailure failure, bool* retried);
  // Thrown out of malloc_once(), caught in malloc(): not yet the caller's error.
  struct Refused {
    OomFailure failure;
  };
  /// rejected: refused at once, before anything was mapped, reserved or
  /// released (counted in num_oom_rejections, OutOfMemoryError::rejected()).
  /// hopeless: no memory given back anywhere could help (OomFailure::hopeless).
  [[noreturn]] void refuse(size_t request, size_t size, Stream s, std::string why, bool rejected = false,
                           bool hopeless = false);
  // The final error: counted, traced and worded, once (oom.cpp).
  [[noreturn]] void throw_oom(const OomFailure& failure, uint64_t context);
  std::string describe_oom_locked(const OomFailure& failure, size_t dev_free, size_t dev_total) const;
  std::string describe_bad_pointer(uintptr_t ptr, const char* op) const;
  void trace(TraceEntry::Action a, uintptr_t addr, size_t size, Stream s);
  size_t largest_free_locked(Pool pool) const;
  // The largest free large-pool block in the area of the request underway.
  size_t largest_free_in_area() const;

  std::unique_ptr<Backend> backend_;
  Config cfg_;
  mutable Lock mu_;

  PtrMap live_;
  std::map<uintptr_t, Segment*> segments_;  // backend segments by base
  std::vector<Segment*> chunks_;             // small-pool chunks
  // At least the number of wholly free chunks (counted when one becomes
  // wholly free, zeroed when they are given back): while 0, no scan of
  // chunks_ for them is needed.
  size_t free_chunks_ = 0;
  std::unordered_map<Stream, std::unique_ptr<StreamState>> streams_;
  Stream last_stream_ = 0;
  StreamState* last_state_ = nullptr;
  std::vector<PendingFree> pending_;
  uint64_t free_seq_ = 0;
  uint64_t next_segment_id_ = 0;
  Stats stats_;
  StatsSink* sink_ = nullptr;
  Stats pushed_;  // the current counts sink_ has of stats_

  std::vector<std::unique_ptr<Block[]>> block_slabs_;
  std::vector<Block*> spare_blocks_;

  bool vmm_ = false;
  size_t page_ = 0;
  Segment* vmm_seg_ = nullptr;
  uintptr_t small_floor_ = 0;             // where the range's small area starts (vmm; 0: none)
  bool small_area_ = false;               // the request underway is placed in the small area
  uintptr_t area_lo_ = 0;                 // its area's addresses: [area_lo_, area_lo_ + area_len_)
  uintptr_t area_len_ = UINTPTR_MAX;
  std::map<uintptr_t, Block*> unmapped_;  // unmapped blocks of vmm_seg_ by address
  std::map<uintptr_t, size_t> handles_;   // mapped handles of vmm_seg_: address -> size
  size_t max_handle_ = 0;                 // the largest handle (a power-of-two number of pages)
  size_t handle_limit_ = 0;               // the largest handle of the mapping underway
  bool roomy_ = false;                    // the mapping underway has room to spare: handles of any size
  bool whole_ = false;                    // the mapping underway is one handle (during a capture)
  bool keep_handles_ = false;             // unmap_handles() detaches handles as spares_
  std::multiset<size_t> spares_;          // sizes of the handles detached for the mapping underway
  std::map<uintptr_t, Block*> parked_;    // mapped blocks no device may access yet (unpark())
  // Nodes made ahead (node_reserve.h): unmapped_ and parked_, handles_, spares_.
  NodeReserve<std::map<uintptr_t, Block*>> map_nodes_;
  NodeReserve<std::map<uintptr_t, size_t>> handle_nodes_;
  NodeReserve<std::multiset<size_t>> spare_nodes_;

  bool history_on_ = false;
  OomPolicy* oom_policy_ = nullptr;
  bool history_shared_ = false;
  uint64_t trace_context_ = 0;  // the tag of the malloc / free underway (history)
  size_t history_max_ = 0;
  size_t history_next_ = 0;
  std::vector<TraceEntry> history_;
};

}  // namespace pyalloc
