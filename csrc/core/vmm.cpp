// The virtual-memory strategy ("vmm"): the large pool is one reserved
// virtual range whose pages are mapped and unmapped as needed.
//
// Blocks tile the whole range. A free block is "mapped" (physical pages under
// all of it, in the free index like any other) or "unmapped" (page-aligned,
// no pages, kept in unmapped_ only). Mapped free blocks are a cache: nothing
// is unmapped on free. Pages are mapped when a request fits no mapped free
// block, in the unmapped block (plus its usable free neighbours) needing the
// fewest new pages. Only when the cap or the device would be exceeded are the
// interiors of free blocks that every stream is done with unmapped first:
// physical memory stranded in holes moves to where it is needed. Doing so
// while the pool can still grow costs a map and an unmap on every pass of a
// loop whose holes are used again (the steady state of a training step);
// what it saved in replay is what the pool holds when nothing else wants the
// memory (benchmarks/results/fragmentation.md).
//
// Physical memory comes in handles (one cuMemCreate and one cuMemMap each),
// mapped and unmapped whole, each range mapped at once made accessible in one
// cuMemSetAccess: large while the device has room (fewer driver calls), of
// any number of pages while the pool holds at most a quarter of what it could,
// aligned powers of two of pages otherwise, small near a limit (holes give up
// their pages); one per growth during a capture (a refused one leaves none
// mapped to undo; one refused access stays mapped, parked, never handed out,
// until the capture's end (release_parked(), from the device's pools), or the
// first growth, reserve() or release of cached memory once no capture is
// underway: unpark()).
// The range has two areas (allocator.h): the large one from its start, the
// small one from its middle, each growing upward, as PyTorch's large and
// small expandable segments do. While the pool holds at most a quarter of
// what the device (and the cap) could give it, growth maps ahead, in the
// request's handles: in the large area to the next boundary of expandable
// segments' 20 MiB pages, one page per stream, in the small one a share of
// the pool; beyond, the same in one-page handles while the room left is
// ample.
#include <algorithm>
#include <exception>
#include <vector>

#include "allocator.h"

namespace pyalloc {

namespace {
constexpr size_t kMaxHandle = size_t(32) << 20;
constexpr size_t kHandleHeadroom = 1024;
constexpr size_t kAheadRoom = 3;
constexpr size_t kSnugAheadRoom = 16;
// PyTorch's expandable segments map the large pool in pages of this size.
constexpr size_t kExpandablePage = size_t(20) << 20;
// The small area maps ahead up to this share of the pool, and at most this.
constexpr size_t kSmallAheadShare = 256;
constexpr size_t kSmallAheadMax = size_t(8) << 20;
}  // namespace

void Allocator::init_vmm() {
  size_t page = backend_->vmm_page_size();
  if (page == 0) return;
  size_t range = vmm_range_size(page);
  stats_.num_driver_calls++;  // cuMemAddressReserve
  uintptr_t base = backend_->vmm_reserve(range);
  if (base == 0) return;
  // Map and unmap one page first, unless the backend has: if it cannot map
  // at all, the pool stays on plain segments rather than failing every request.
  // During a capture (another device's: the backend skipped its own trial
  // then) unmapping would break it, so the trial page stays mapped, as the
  // pool's first (below), or parked if the device refuses access to it.
  bool mappable = backend_->vmm_proven();
  bool keep_trial = !mappable && backend_->capture_underway();
  if (!mappable && !keep_trial) mappable = vmm_trial_map(base, page);
  if (!mappable && !keep_trial) {
    backend_->vmm_release(base, range);
    return;
  }
  Block* b = open_vmm_range(base, range, page);
  if (keep_trial && !map_trial_page(page)) {
    close_vmm_range(base, range, b);
    return;
  }
  map_pool_size(base, range, b);
}

// init_vmm()'s first step: the size of the range to reserve, from the cap or the device.
size_t Allocator::vmm_range_size(size_t page) {
  size_t dev_free = 0, dev_total = 0;
  backend_->mem_info(&dev_free, &dev_total);
  size_t basis = cfg_.max_pool_size != 0 ? cfg_.max_pool_size : dev_total;
  // Address space is cheap: room for the pool four times over (twice in
  // each area), so that holes in the range never make it run out.
  size_t range = basis != 0 ? std::max(std::min(basis, size_t(1) << 44) * 4, size_t(64) << 30)
                            : size_t(1) << 42;
  return round_up(range, page);
}

// init_vmm()'s trial: whether the backend can map, make accessible and unmap a page at base.
bool Allocator::vmm_trial_map(uintptr_t base, size_t page) {
  bool mappable = false;
  try {
    mappable = backend_->vmm_map(base, page);
    stats_.num_driver_calls += mappable ? 2 : 1;  // cuMemCreate (refused), cuMemMap
    if (mappable) {
      stats_.num_driver_calls += 3;  // cuMemSetAccess; cuMemUnmap, cuMemRelease
      try {
        mappable = backend_->vmm_access(base, page);
      } catch (...) {
        backend_->vmm_unmap(base, page);  // the page goes back (and a pool's budget with it)
        throw;
      }
      backend_->vmm_unmap(base, page);
    }
  } catch (const std::exception&) {
    mappable = false;
  }
  stats_.num_driver_calls += backend_->take_uncounted_calls();
  return mappable;
}

// init_vmm()'s step that puts the pool on vmm: the range as its segment, one unmapped block (returned).
Block* Allocator::open_vmm_range(uintptr_t base, size_t range, size_t page) {
  vmm_ = true;
  page_ = page;
  // The upper half of the range is the small area (allocator.h).
  small_floor_ = base + round_up(range / 2, page);
  // Handles of up to 32 MiB: a GiB mapped is some 100 driver calls, not the
  // 1500 of 2 MiB ones (cuMemCreate, cuMemMap, cuMemSetAccess each; the
  // same again to unmap).
  max_handle_ = page;
  while (max_handle_ * 2 <= kMaxHandle) max_handle_ *= 2;
  handle_limit_ = page;
  block_floor_ = map_floor_ = vmm_floor();
  // The range listed before anything else may throw, or it goes back.
  std::unique_ptr<Segment> owned;
  try {
    prepare_bookkeeping();
    owned = std::make_unique<Segment>();
    segments_.emplace(base, owned.get());
  } catch (...) {
    backend_->vmm_release(base, range);
    throw;
  }
  vmm_seg_ = owned.release();
  vmm_seg_->base = base;
  vmm_seg_->size = range;
  vmm_seg_->pool = kLargePool;
  vmm_seg_->vmm = true;
  vmm_seg_->id = next_segment_id_++;
  Block* b = new_block();
  b->addr = base;
  b->size = range;
  b->segment = vmm_seg_;
  b->mapped = false;
  b->state = BlockState::kFree;
  vmm_seg_->first = b;
  map_nodes_.put(unmapped_, base, b);
  return b;
}

// Undoes open_vmm_range() (b its block), init_vmm()'s way out when nothing could be mapped.
// While nothing is mapped: the range goes back, and the pool uses plain
// segments (or throws).
void Allocator::close_vmm_range(uintptr_t base, size_t range, Block* b) {
  unmapped_.clear();
  segments_.erase(base);
  drop_block(b);
  delete vmm_seg_;
  vmm_seg_ = nullptr;
  vmm_ = false;
  block_floor_ = kOpBlocks;  // bestfit's again
  map_floor_ = 0;
  page_ = 0;
  small_floor_ = 0;
  backend_->vmm_release(base, range);
}

// init_vmm()'s step for a capture: maps the kept trial page as the pool's first; whether the pool opens.
bool Allocator::map_trial_page(size_t page) {
  std::string why;
  Block* m = nullptr;
  try {
    m = map_for(page, 0, &why, kUnknownRoom, /*exact=*/true);
  } catch (const std::exception&) {
    m = nullptr;
  }
  // A page the device refused access to stays mapped, parked: the pool
  // opens with it.
  return m != nullptr || !parked_.empty();
}

// init_vmm()'s last step: maps pool_size, or gives the range back and throws if nothing could be mapped.
void Allocator::map_pool_size(uintptr_t base, size_t range, Block* b) {
  // pool_size: what the kept trial page does not cover already.
  size_t have = static_cast<size_t>(stats_.reserved_bytes.all.current);
  size_t want = round_up(cfg_.pool_size, kGranularity);
  if (want > have) {
    // Nothing is mapped for it on failure, unless the device refused access
    // to it during a capture (parked). A kept trial page or parked pages
    // cannot be unmapped during the capture, and a pool that throws here is
    // never destroyed: the pool opens with them, and empty_cache() maps
    // pool_size once the capture is over.
    std::string why;
    std::exception_ptr error;
    Block* m = nullptr;
    try {
      m = map_for(want - have, 0, &why, kUnknownRoom, /*exact=*/true, /*fresh=*/true);
    } catch (const std::exception&) {
      error = std::current_exception();
    }
    if (m != nullptr || have != 0 || !parked_.empty()) return;
    close_vmm_range(base, range, b);
    if (error) std::rethrow_exception(error);
    throw OutOfMemoryError("out of memory: could not map pool_size (" + format_bytes(cfg_.pool_size) +
                           "): " + why);
  }
}

Block* Allocator::usable_neighbour(Block* n, Stream s) {
  if (n == nullptr || !n->free_mapped()) return nullptr;
  return n->stream == s || is_ready(n) ? n : nullptr;
}

Block* Allocator::map_for(size_t size, Stream s, std::string* why, size_t room, bool exact, bool fresh) {
  Block* m = nullptr;
  try {
    m = map_for_moving(size, s, why, room, exact, fresh);
  } catch (...) {
    drop_spares();
    throw;
  }
  drop_spares();
  return m;
}

size_t Allocator::unpark() {
  if (parked_.empty() || backend_->capture_underway()) return 0;
  // No work was ever queued on these pages: they go back at once, as
  // unmapped pages (a cuMemUnmap and a cuMemRelease a handle, or a spare
  // during the out-of-memory retry), whatever the streams are doing.
  std::map<uintptr_t, Block*> parked;
  parked.swap(parked_);
  size_t bytes = 0;
  for (auto& [addr, b] : parked) {
    bytes += b->size;
    b->state = BlockState::kFree;
    state(b->stream).free[kLargePool].insert(b);
    track_inactive_split(b, +1);
    unmap_range(b, b->addr, b->end());
  }
  return bytes;
}

size_t Allocator::release_parked() {
  std::lock_guard<Lock> guard(mu_);
  OpEnd end{this};
  prepare_bookkeeping();
  return unpark();
}

size_t Allocator::unmap_free_pages_kept(size_t want, uintptr_t keep_lo, uintptr_t keep_hi) {
  spare_nodes_.reserve(handles_.size());  // each handle unmapped may wait as a spare
  KeepHandles keep(keep_handles_, backend_->vmm_moves());
  return unmap_free_pages(want, keep_lo, keep_hi, /*wait=*/true, /*all_or_none=*/true);
}

void Allocator::drop_spares() {
  // Forgotten first: a backend that throws midway is not asked twice.
  std::multiset<size_t> spares;
  spares.swap(spares_);
  for (size_t size : spares) {
    backend_->vmm_drop(size);
    stats_.num_driver_calls++;  // cuMemRelease
  }
}

// Where map_for_moving() maps: the unmapped block u, its part in the
// request's area [u_lo, u_hi), the pages [lo, hi) of need bytes, and
// [keep_lo, keep_hi), next to u, where nothing may be unmapped meanwhile.
struct Allocator::MapPlan {
  Block* u = nullptr;
  uintptr_t lo = 0, hi = 0, u_lo = 0, u_hi = 0, keep_lo = 0, keep_hi = 0;
  size_t need = SIZE_MAX;
};

Block* Allocator::map_for_moving(size_t size, Stream s, std::string* why, size_t room, bool exact,
                                 bool fresh) {
  // During a capture only fresh pages may be mapped: unmap_free_pages()
  // moves none then.
  if ((backend_->is_capturing(s) || backend_->capture_underway()) &&
      !backend_->grows_while_capturing()) {
    *why = "the stream is being captured into a CUDA graph and no pages can be mapped during "
           "capture; reserve the memory before capture (pyalloc reserve())";
    return nullptr;
  }
  // Wholly free chunks hold mapped pages the large pool can use.
  if (free_chunks_ > 0) reclaim_free_chunks();
  // Parked pages go back first (the device has them again, as for pages
  // moved out of holes below).
  if (size_t unparked = unpark(); unparked != 0 && room != kUnknownRoom) room += unparked;

  MapPlan plan;
  if (!pick_unmapped(size, s, fresh, &plan)) {
    *why = "the virtual address range of the pool is exhausted";
    return nullptr;
  }
  size_t reserved = 0;
  if (!fit_cap(plan, &room, &reserved, why)) return nullptr;
  size_t headroom = size_handles(room, reserved);
  uintptr_t ext_lo = 0, ext_hi = 0;
  map_ahead_extent(plan, headroom, room, reserved, exact, &ext_lo, &ext_hi);
  if (!map_pages(&plan, ext_lo, ext_hi, room, s, why)) return nullptr;
  Block* m = add_mapped(plan, s);
  return m->size >= size ? m : nullptr;
}

// map_for_moving()'s search step: picks the unmapped block and the pages to map (false: none fits).
bool Allocator::pick_unmapped(size_t size, Stream s, bool fresh, MapPlan* plan) {
  auto& [u, lo, hi, u_lo, u_hi, keep_lo, keep_hi, need] = *plan;
  // The unmapped block needing the fewest new pages in the request's area
  // (its part there: [u_lo, u_hi)), mapped from the side whose usable free
  // neighbour of that area is larger; in the block the small area starts in,
  // from the area's start: both areas grow upward. Only if the area's own
  // address space is exhausted, anywhere in the range. `fresh`: size new
  // bytes, whatever is free beside them (the pool filled back up to
  // pool_size, in the large area).
  for (int pass = 0; pass < 2 && u == nullptr; ++pass) {
    bool anywhere = pass == 1 || small_floor_ == 0;
    for (auto& [addr, cand] : unmapped_) {
      uintptr_t a0 = cand->addr, a1 = cand->end();
      if (!anywhere) {
        if (small_area_) a0 = std::max(a0, small_floor_);
        else a1 = std::min(a1, small_floor_);
        if (a0 >= a1) continue;
      }
      Block* left = fresh || a0 != cand->addr ? nullptr : usable_neighbour(cand->prev, s);
      Block* right = fresh || a1 != cand->end() ? nullptr : usable_neighbour(cand->next, s);
      if (!anywhere && left != nullptr && !in_area(left)) left = nullptr;
      if (!anywhere && right != nullptr && !in_area(right)) right = nullptr;
      size_t lsz = left ? left->size : 0, rsz = right ? right->size : 0;
      if (lsz + (a1 - a0) + rsz < size) continue;
      size_t from_left = size <= lsz ? 0 : round_up(size - lsz, page_);
      size_t from_right = size <= rsz ? 0 : round_up(size - rsz, page_);
      size_t n = std::min(std::min(from_left, from_right), a1 - a0);
      if (n == 0 || n >= need) continue;  // n == 0: a mapped block fits; best fit saw it
      need = n;
      u = cand;
      u_lo = a0;
      u_hi = a1;
      if (n == a1 - a0) {
        lo = a0;
        hi = a1;
      } else if (from_left <= from_right) {
        lo = a0;
        hi = a0 + n;
      } else {
        lo = a1 - n;
        hi = a1;
      }
      // Nothing next to u may be unmapped meanwhile: it would merge into u.
      keep_lo = cand->prev != nullptr ? cand->prev->addr : cand->addr;
      keep_hi = cand->next != nullptr ? cand->next->end() : cand->end();
    }
  }
  return u != nullptr;
}

// map_for_moving()'s cap step: room under the cap for the plan's pages (false, with why, if none).
bool Allocator::fit_cap(const MapPlan& plan, size_t* room_io, size_t* reserved_out, std::string* why) {
  size_t need = plan.need;
  uintptr_t keep_lo = plan.keep_lo, keep_hi = plan.keep_hi;
  size_t& room = *room_io;
  size_t& reserved = *reserved_out;
  // Grow while the cap and the device allow: pages moved out of holes now
  // would be mapped again when the holes are used again (a training step's
  // next pass), so recycling waits until the pool cannot grow.
  size_t cap = cfg_.max_pool_size;
  reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
  if (cap != 0 && reserved + need > cap) {
    size_t moved = unmap_free_pages_kept(reserved + need - cap, keep_lo, keep_hi);
    // The device has the pages back (or they wait as spares, mapped again
    // or given back before any new handle takes memory): without this the
    // device's room, read before, sent the mapping below into a second
    // search of the holes, which found them emptied, and the request into
    // the out-of-memory retry.
    if (room != kUnknownRoom) room += moved;
    reserved = static_cast<size_t>(stats_.reserved_bytes.all.current);
    if (reserved + need > cap) {
      *why = "mapping the pages it needs would exceed the pool's cap";
      return false;
    }
  }
  return true;
}

// map_for_moving()'s handle step: sizes the mapping's handles from the room left; returns that room.
size_t Allocator::size_handles(size_t room, size_t reserved) {
  size_t cap = cfg_.max_pool_size;
  // Handles as large as max_handle_ while the device (and the cap) has room
  // to spare, smaller as it fills: a handle is given up only whole, so under
  // pressure, when holes give up their pages, large handles partly under
  // live blocks would stay. A handle at most 1/1024 of the room left kept
  // every trace's smallest budget where one-page handles had it (1/64:
  // mercuryb1-qwen2.5-7b needed 1.030x peak live against 1.006x; 1/256 1.012x).
  size_t headroom = room;
  if (cap != 0) headroom = std::min(headroom, cap - std::min(cap, reserved));
  handle_limit_ = max_handle_;
  if (headroom != kUnknownRoom)
    while (handle_limit_ > page_ && handle_limit_ > headroom / kHandleHeadroom) handle_limit_ /= 2;
  // Growth while the pool holds at most a quarter of what the device and
  // the cap could give it (room at least kAheadRoom times what is reserved;
  // or the room unknown) goes on ahead of the request. In the large area, to
  // the next boundary of expandable segments' 20 MiB pages (kExpandablePage,
  // from the range's start): with the same placement as theirs (best fit,
  // ties to the lowest address, the frontier last) the area then holds what
  // expandable segments' large segment holds, no more, and grows when it
  // does, no more often. In replay, bert_infer (H200) reserved 1.220 x peak
  // live (expandable segments 1.220; 1.273 with the grain of 12 MiB to 1/16
  // of the pool this replaced) and made no device call in its second half
  // (1; theirs 0). Smaller grains for small pools (4, 10 or 12 MiB under
  // 256 MiB reserved, holding less than their 20 MiB pages) made more calls
  // than theirs: tiny-gpt-varlen 4 against 3 in the second half, vit-mixedres
  // 7 against 5 (10 MiB up to 512 MiB), jaspersolt-cnn 40 to 58 driver calls
  // against 29. So a small pool reserves what expandable segments do
  // (convnet-mixedres 1.213 x, encoder-dynbatch 1.553 x; 1.100 and 1.243
  // with 12 MiB grains) and needs a smaller device than theirs (the budget).
  // In the small area, a page boundary and on, beyond the request, the
  // largest power of two of pages up to 1/256 of what is reserved (at most
  // kSmallAheadMax): the small pool's chunks hold their blocks apart where
  // PyTorch's small segment packs them, and grew a page more often; without
  // it, 10 of 30 unseen one-stream random workloads (seeds 100 to 129) made
  // one device call more than expandable segments in their second half, with
  // it none of 60 (seeds 100 to 159), each reserving within 0.006 x peak
  // live of theirs (1/128 held 0.004 x more on average).
  // With several streams, expandable segments keep a range per stream, each
  // growing to its own stream's high-water mark in its own 20 MiB pages:
  // they hold more (1.34 to 1.62 x peak live on unseen random workloads of
  // two to four streams, seeds 100 to 159) but stop growing earlier. The
  // large area's grain is one of their pages per stream the pool serves:
  // with one page whatever the streams, 12 of those 180 workloads made 1 to
  // 5 device calls more than theirs in the second half; with one a stream,
  // 5, for reserved 1.22 to 1.25 x peak live against 1.21 to 1.23 x (two of
  // them above theirs + 0.02 x either way: fragmentation.md).
  //
  // With room to spare (the pool at most a quarter of what the device and
  // the cap could give it, as for mapping ahead; or the room unknown) a
  // mapping is cut into handles of the limit and one of the rest, of any
  // number of pages: a 6 MiB growth is one cuMemCreate, not a 4 and a 2 MiB
  // buddy (cs336-2.7b's driver calls fell from 11430 to 7062, tinyllama's
  // from 1872 to 981); beyond, aligned buddies again, whose small ends holes
  // can give up. A pool that fills much of its device passes that limit
  // early: in replay, with handles of any size only up to a ninth of the
  // device, cs336-2.7b made 7860 driver calls on an 80 GiB device against
  // expandable segments' 6187, and tinyllama 1339 on a 24 GiB device against
  // 865; up to a quarter, 5925 and 895, for cs336-2.7b's smallest budget at
  // 1.0067x peak live against 1.0058x and constructor-sun's device 2 at
  // 1.0068x against 1.0062x, every other budget unchanged (to 0.1%;
  // mercuryb1-qwen2.5-7b's, the most sensitive to small holes inside larger
  // handles, at 1.0022x either way).
  //
  // Past that quarter, once handles are down to one page, growth still maps
  // ahead, as above (to a 20 MiB boundary in the large area), while
  // the room left is at least 16 times the growth and the grain: one-page
  // handles leave holes page by page at the cap, so no smallest budget
  // moved (in replay, bisected to 0.1%), and on a snug device (peak live +
  // 10%, rounded up to a GiB) the second half's device calls fell from 33
  // to 18 on gpt2-varlen-train and from 10 to 4 on vit-mixedres-train
  // (expandable segments 18 and 5). With handles of any size, cs336-2.7b's
  // smallest budget rose from 1.0067 to 1.0083x peak live; of up to 4 MiB,
  // maphsge4-llama7b made 26517 driver calls on expandable segments'
  // smallest device, not 26328. With the room only 8 times, reserved on the
  // snug device rose from 1.023 to 1.029x peak live on gpt2-varlen-train
  // and from 1.149 to 1.166x on random-1-stream-seed3.
  roomy_ = headroom == kUnknownRoom || headroom / kAheadRoom >= reserved;
  // During a capture a growth is one handle: the device's free memory is
  // not asked then, and a handle refused after others were mapped would
  // leave them to unmap and release, which the capture forbids. A refused
  // one-handle mapping maps nothing (the backend releases the handle it
  // could not map, as PyTorch does).
  whole_ = backend_->capture_underway();
  return headroom;
}

// map_for_moving()'s map-ahead step: the pages mapped beside [lo, hi), [*ext_lo, *ext_hi) (empty: none).
void Allocator::map_ahead_extent(const MapPlan& plan, size_t headroom, size_t room, size_t reserved, bool exact,
                                 uintptr_t* ext_lo_out, uintptr_t* ext_hi_out) {
  size_t cap = cfg_.max_pool_size;
  size_t need = plan.need;
  uintptr_t lo = plan.lo, hi = plan.hi, u_lo = plan.u_lo, u_hi = plan.u_hi;
  uintptr_t& ext_lo = *ext_lo_out;
  uintptr_t& ext_hi = *ext_hi_out;
  size_t large_page = round_up(kExpandablePage, page_);
  bool snug_ahead = !roomy_ && handle_limit_ == page_ && headroom / kSnugAheadRoom >= need + large_page;
  if (!exact && need < u_hi - u_lo && (roomy_ || snug_ahead)) {
    // In the large area one 20 MiB page per stream the pool serves, as
    // expandable segments keep a range (rounded up to its pages) per stream.
    size_t grain = small_area_ ? page_ : large_page * std::max<size_t>(1, streams_.size());
    size_t ahead = 0;
    if (small_area_)
      for (size_t x = page_; x <= kSmallAheadMax && x * kSmallAheadShare <= reserved; x *= 2) ahead = x;
    uintptr_t base = vmm_seg_->base;
    if (lo == u_lo) {
      ext_lo = hi;
      ext_hi = std::min(u_hi, base + round_up(hi + ahead - base, grain));
    } else {
      uintptr_t from = lo - std::min(ahead, lo - u_lo);
      ext_lo = std::max(u_lo, base + (from - base) / grain * grain);
      ext_hi = lo;
    }
    size_t more = ext_hi - ext_lo;
    if (more == 0 || (cap != 0 && reserved + need + more > cap) ||
        (room != kUnknownRoom && need + more > room))
      ext_lo = ext_hi = 0;
  }
}

// map_for_moving()'s mapping step: maps the plan's pages (false, with why, if it cannot); widens the plan.
bool Allocator::map_pages(MapPlan* plan, uintptr_t ext_lo, uintptr_t ext_hi, size_t room, Stream s,
                          std::string* why) {
  auto& [u, lo, hi, u_lo, u_hi, keep_lo, keep_hi, need] = *plan;
  // Where the device has no room for the pages (as `room` says, or a refused
  // mapping shows), the pages the mapping needs move out of free holes
  // (moving only the shortfall left the range more cut up: in replay,
  // encoder-dynbatch-infer then needed a 3% larger device), and the mapping
  // is tried once more: never page after page into a device known to be full.
  // Pages the device mapped during a capture but refused access to stay
  // mapped (see unpark()), cut out of u, and the request fails (with the
  // driver's error, if it was one): once `kept`, nothing more is mapped.
  bool kept = false;
  auto park = [&](uintptr_t a, size_t n) {
    map_nodes_.put(parked_, a, cut_mapped(u, a, a + n, s));
    *why = "the device refused access to " + format_bytes(n) +
           " of new pages during a CUDA graph capture (cuMemSetAccess failed); they stay reserved, "
           "unused, until the first growth or empty_cache() after the capture";
  };
  auto map_or_park = [&](uintptr_t a, size_t n) {
    bool mapped = false;
    try {
      mapped = map_handles(a, n, &kept);
    } catch (...) {
      if (kept) park(a, n);
      throw;
    }
    if (kept) park(a, n);
    return mapped;
  };
  bool merged = false;
  if (ext_hi > ext_lo) {  // need + the extra fit the room (above)
    uintptr_t a = std::min(lo, ext_lo);
    try {  // a driver error here only maps none ahead: the request alone is tried below
      merged = map_or_park(a, need + ext_hi - ext_lo);
    } catch (const std::logic_error&) {
      throw;  // a range the core got wrong is no driver's error
    } catch (const std::exception&) {
      if (kept) throw;
      merged = false;
    }
    if (kept) return false;
    if (merged) {
      need += ext_hi - ext_lo;
      lo = a;
      hi = std::max(hi, ext_hi);
    }
  }
  if (!merged && (need > room || !map_or_park(lo, need))) {
    if (kept) return false;
    if (unmap_free_pages_kept(need, keep_lo, keep_hi) < need || !map_or_park(lo, need)) {
      if (kept) return false;
      *why = std::string("the ") + backend_->name() + " backend could not map " + format_bytes(need) +
             " of pages";
      return false;
    }
  }
  return true;
}

// map_for_moving()'s last step: the mapped pages as a free block of s, merged with usable neighbours.
Block* Allocator::add_mapped(const MapPlan& plan, Stream s) {
  uintptr_t lo = plan.lo;
  Block* m = cut_mapped(plan.u, lo, plan.hi, s);
  // Merge only with neighbours s may use: fresh pages are safe anywhere and
  // would otherwise merge into (and take the label of) a block another
  // stream may still be using; and only inside the area.
  auto mergeable = [&](Block* n) {
    bool same_area = small_floor_ == 0 || (n != nullptr && (n->addr >= small_floor_) == (lo >= small_floor_));
    return same_area && usable_neighbour(n, s) != nullptr;
  };
  while ((mergeable(m->prev) && merge_neighbour(m, m->prev)) ||
         (mergeable(m->next) && merge_neighbour(m, m->next))) {
  }
  m->state = BlockState::kFree;
  state(m->stream).free[kLargePool].insert(m);
  track_inactive_split(m, +1);
  return m;
}

Block* Allocator::cut_mapped(Block* u, uintptr_t lo, uintptr_t hi, Stream s) {
  // Each contiguous run of mapped large-pool memory is a segment, as in
  // PyTorch's snapshots of expandable segments: the new pages start one or
  // join the runs beside them. The range's events and runs carry one stream
  // (the stream of the request that first mapped memory into it).
  if (stats_.reserved_bytes.large.current + stats_.reserved_bytes.small.current == 0)
    vmm_seg_->stream = s;
  int64_t runs = 1 - (lo == u->addr && large_mem(u->prev) ? 1 : 0) -
                 (hi == u->end() && large_mem(u->next) ? 1 : 0);
  if (runs != 0) stats_.segment.add(kLargePool, runs);
  stats_.reserved_bytes.add(kLargePool, static_cast<int64_t>(hi - lo));
  stats_.num_device_alloc++;
  if (history_on_) trace(TraceEntry::kSegmentMap, lo, hi - lo, vmm_seg_->stream);

  // Cut the mapped piece out of u; fresh pages are safe for every stream.
  Block* m;
  if (lo == u->addr && hi == u->end()) {
    map_nodes_.erase_key(unmapped_, u->addr);
    m = u;
  } else {
    m = new_block();
    m->segment = u->segment;
    if (lo == u->addr) {
      map_nodes_.erase_key(unmapped_, u->addr);
      m->prev = u->prev;
      m->next = u;
      if (u->prev != nullptr) u->prev->next = m;
      else u->segment->first = m;
      u->prev = m;
      u->addr = hi;
      map_nodes_.put(unmapped_, u->addr, u);
    } else if (hi == u->end()) {
      m->prev = u;
      m->next = u->next;
      if (u->next != nullptr) u->next->prev = m;
      u->next = m;
    } else {
      // From the middle (the small area's first pages): what lies above the
      // new pages stays unmapped, a block of its own.
      Block* t = new_block();
      t->segment = u->segment;
      t->addr = hi;
      t->size = u->end() - hi;
      t->mapped = false;
      t->state = BlockState::kFree;
      t->prev = m;
      t->next = u->next;
      if (u->next != nullptr) u->next->prev = t;
      m->prev = u;
      m->next = t;
      u->next = m;
      map_nodes_.put(unmapped_, t->addr, t);
      u->size -= t->size;
    }
    u->size -= hi - lo;
  }
  m->addr = lo;
  m->size = hi - lo;
  m->mapped = true;
  m->stream = s;
  m->free_seq = 0;
  m->state = BlockState::kAllocated;
  return m;
}

size_t Allocator::unmap_free_pages(size_t want, uintptr_t keep_lo, uintptr_t keep_hi, bool wait,
                                   bool all_or_none, bool at_most) {
  if (!vmm_ || backend_->capture_underway()) return 0;
  // A page may be unmapped only once no queued work can touch it: mark how
  // far each stream has got (waiting for it only if asked to).
  for (auto& [stream, st] : streams_) {
    if (backend_->is_capturing(stream)) continue;
    if (st->synced_seq < st->last_free_seq && !wait) {
      add_sync(*st);
    }
    poll_syncs(*st, wait);
  }
  if (wait) stats_.num_sync_all_streams++;
  // Only free blocks of a page or more can hold a whole page: take them from
  // the free indexes rather than walking every block of the range. They are
  // unmapped in address order: largest-first measured worse in replay
  // (encoder-dynbatch-infer reserved 1.21x peak live against 1.14x).
  std::vector<Block*> candidates;
  for (auto& [stream, st] : streams_) {
    st->free[kLargePool].for_each_from(page_, [&](Block* b) {
      if (!(b->addr < keep_hi && b->end() > keep_lo) && is_ready(b)) candidates.push_back(b);
    });
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Block* x, const Block* y) { return x->addr < y->addr; });
  size_t done = 0;
  if (all_or_none) {
    size_t movable = 0;
    uintptr_t lo, hi;
    for (const Block* b : candidates) movable += whole_handles(b, &lo, &hi);
    if (movable < want) return 0;
  }
  // unmap_range() changes only the block it is given (and drops unmapped
  // neighbours, which are no candidates), so the list stays valid.
  for (Block* b : candidates) {
    if (done >= want) break;
    uintptr_t lo, hi;
    if (whole_handles(b, &lo, &hi) == 0) continue;
    if (at_most) {
      // The last handles of the run, none that would pass want (the small
      // handles of a buddy run are at its ends).
      uintptr_t start = hi;
      while (start > lo) {
        auto it = std::prev(handles_.upper_bound(start - 1));
        if (hi - start + it->second > want - done) break;
        start = it->first;
      }
      if (start == hi) continue;
      done += hi - start;
      unmap_range(b, start, hi);
      continue;
    }
    // The first handles of the run, as many as the rest of want needs.
    uintptr_t end = lo;
    for (auto it = handles_.find(lo); end < hi && end - lo < want - done; ++it) end += it->second;
    done += end - lo;
    unmap_range(b, lo, end);
  }
  return done;
}

size_t Allocator::handle_size(uintptr_t addr, uintptr_t end) const {
  // With room to spare, handles of the limit and the rest in one (see
  // map_for()). Otherwise aligned powers of two, as in a buddy system: a run
  // is mapped in the largest handles that fit, with the small ones at its ends.
  if (whole_) return end - addr;
  if (roomy_) return std::min(handle_limit_, end - addr);
  size_t off = addr - vmm_seg_->base, h = page_;
  while (h < handle_limit_ && off % (2 * h) == 0 && end - addr >= 2 * h) h *= 2;
  return h;
}

bool Allocator::map_handles(uintptr_t lo, size_t size, bool* kept) {
  // A node for every handle it may map (of a page at least), before any is.
  handle_nodes_.reserve(size / page_ + 1);
  Recount recount{*this};
  uintptr_t a = lo, end = lo + size;
  auto undo = [&]() {
    unmap_handles(lo, a);
    a = lo;
  };
  try {
    while (a < end) {
      // A spare handle that fits moves here; spares that fit nowhere go
      // back to the device before any new handle takes its memory.
      // A moved handle keeps its size, whatever the handle limit now: its
      // memory is the process's either way (in replay, every smallest
      // budget as it was, to 0.5%).
      auto sp = spares_.upper_bound(end - a);
      if (sp != spares_.begin()) {
        size_t h = *std::prev(sp);
        // Still the core's spare while the backend may throw: dropped then
        // like the others (map_for()).
        if (backend_->vmm_attach(a, h)) {
          spare_nodes_.erase(spares_, std::prev(sp));
          stats_.num_driver_calls++;  // cuMemMap
          handle_nodes_.put(handles_, a, h);
          a += h;
          continue;
        }
        // Refused, with no driver call made (backend.h): the spares go back
        // below like any that fit nowhere.
      }
      drop_spares();
      size_t h = handle_size(a, end);
      if (!backend_->vmm_map(a, h)) {
        stats_.num_driver_calls++;  // the refused cuMemCreate
        undo();
        return false;
      }
      stats_.num_driver_calls += 2;  // cuMemCreate, cuMemMap
      handle_nodes_.put(handles_, a, h);
      a += h;
    }
    // One cuMemSetAccess for the whole range, as PyTorch's mapAndSetAccess:
    // 2k+1 calls for k handles, not 3k.
    stats_.num_driver_calls++;
    // Refused (or failed) during a capture, given `kept`: the handles stay.
    bool keep = kept != nullptr && backend_->capture_underway();
    bool accessible = false;
    try {
      accessible = backend_->vmm_access(lo, size);
    } catch (...) {
      if (keep) *kept = true;
      throw;
    }
    if (!accessible) {
      if (keep) *kept = true;
      else undo();
      return false;
    }
  } catch (...) {
    if (kept == nullptr || !*kept) undo();
    throw;
  }
  return true;
}

void Allocator::unmap_handles(uintptr_t lo, uintptr_t hi) {
  auto it = handles_.lower_bound(lo);
  while (it != handles_.end() && it->first < hi) {
    if (keep_handles_ && backend_->vmm_detach(it->first, it->second)) {
      spare_nodes_.add(spares_, it->second);
      stats_.num_driver_calls++;  // cuMemUnmap
    } else {
      // A detach that failed has released the handle already (backend.h).
      if (!keep_handles_) backend_->vmm_unmap(it->first, it->second);
      stats_.num_driver_calls += 2;  // cuMemUnmap, cuMemRelease
    }
    it = handle_nodes_.erase(handles_, it);
  }
}

size_t Allocator::whole_handles(const Block* b, uintptr_t* lo, uintptr_t* hi) const {
  // The handles under b are consecutive: from the first that starts in b,
  // as long as they end in it.
  auto it = handles_.lower_bound(b->addr);
  *lo = *hi = it != handles_.end() ? it->first : b->addr;
  for (; it != handles_.end() && it->first + it->second <= b->end(); ++it) *hi = it->first + it->second;
  return *hi - *lo;
}

Block* Allocator::unmap_range(Block* f, uintptr_t lo, uintptr_t hi) {
  // The run of mapped memory around f splits into what stays on either side.
  bool left = lo > f->addr || large_mem(f->prev), right = hi < f->end() || large_mem(f->next);
  int64_t runs = (left ? 1 : 0) + (right ? 1 : 0) - 1;
  if (history_on_) trace_unmap(f, lo, hi);
  StreamState& st = state(f->stream);
  st.free[kLargePool].remove(f);
  track_inactive_split(f, -1);
  // What stays mapped on either side keeps f's stream label.
  auto piece = [&](uintptr_t addr, size_t size) {
    Block* p = new_block();
    p->addr = addr;
    p->size = size;
    p->segment = f->segment;
    p->stream = f->stream;
    p->free_seq = f->free_seq;
    p->state = BlockState::kFree;
    return p;
  };
  Block* head = lo > f->addr ? piece(f->addr, lo - f->addr) : nullptr;
  Block* tail = hi < f->end() ? piece(hi, f->end() - hi) : nullptr;
  if (head != nullptr) {
    head->prev = f->prev;
    head->next = f;
    if (f->prev != nullptr) f->prev->next = head;
    else f->segment->first = head;
    f->prev = head;
  }
  if (tail != nullptr) {
    tail->prev = f;
    tail->next = f->next;
    if (f->next != nullptr) f->next->prev = tail;
    f->next = tail;
  }
  f->addr = lo;
  f->size = hi - lo;
  f->mapped = false;
  unmap_handles(lo, hi);
  stats_.reserved_bytes.add(kLargePool, -static_cast<int64_t>(hi - lo));
  if (runs != 0) stats_.segment.add(kLargePool, runs);
  stats_.num_device_free++;
  for (Block* p : {head, tail}) {
    if (p == nullptr) continue;
    state(p->stream).free[kLargePool].insert(p);
    track_inactive_split(p, +1);
  }
  // Unmapped neighbours become one block.
  for (Block* n : {f->prev, f->next}) {
    if (n == nullptr || n->mapped) continue;
    map_nodes_.erase_key(unmapped_, n->addr);
    f->size += n->size;
    take_place_of(f, n);
  }
  map_nodes_.put(unmapped_, f->addr, f);
  return tail != nullptr ? tail : f;
}

}  // namespace pyalloc
