// The allocator's history (PyTorch's trace entries): recording, and the
// segment events told so that PyTorch's memory viewer, which undoes the
// history backwards from the final segments, draws the pool as it was.
// An entry that host memory cannot hold is left out (trace()): the history
// is a record, and an operation it would fail has already changed the pool.
#include <chrono>
#include <new>

#include "allocator.h"

namespace pyalloc {
namespace {

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void Allocator::trace_lend(Block* parent, Segment* chunk, int sign) {
  Stream rs = parent->segment->stream;
  if (!parent->segment->vmm) {
    // A run of a backend segment: the run and the pieces it becomes (or the
    // pieces and the run), each a segment_free / segment_alloc of its own, so
    // that trace_plot -s, which pairs those by address and draws nothing
    // else, draws the bytes reserved (see trace_replace).
    uintptr_t a = 0, e = 0;
    run_extent(parent, &a, &e);
    std::vector<TracePiece> run{{a, e - a, rs}}, pieces;
    if (a < chunk->base) pieces.push_back({a, chunk->base - a, rs});
    pieces.push_back({chunk->base, chunk->size, chunk->stream});
    uintptr_t hi = chunk->base + chunk->size;
    if (hi < e) pieces.push_back({hi, e - hi, rs});
    if (sign > 0) trace_replace(a, e, run, pieces);
    else trace_replace(a, e, pieces, run);
    return;
  }
  // In a vmm segment, in the words of PyTorch's viewer, which replays the
  // history backwards from the final segments: the chunk is a segment_alloc /
  // segment_free of its own; the run gives up the chunk's range (trace_unmap)
  // and takes it back as a segment_map (undone by cutting it out of the
  // segment holding it).
  if (sign < 0) {
    // Undone, the map is cut out of the run first, so what lies above the
    // chunk then is the rest of the run, if any, or the next segment.
    uintptr_t a = 0, e = 0;
    run_extent(parent, &a, &e);
    trace_segment_free(chunk->base, chunk->size, chunk->stream,
                       parent->end() == e && !segment_from(e) && segment_below(chunk->base));
    trace(TraceEntry::kSegmentMap, chunk->base, chunk->size, rs);
    return;
  }
  trace_unmap(parent, parent->addr, parent->end());
  trace(TraceEntry::kSegmentAlloc, chunk->base, chunk->size, chunk->stream);
}

void Allocator::trace_unmap(const Block* b, uintptr_t lo, uintptr_t hi) {
  // PyTorch's viewer undoes a segment_unmap by merging the range with the
  // segments of the event's stream it touches, which cannot be relied on:
  // where every event is on stream 0, the viewer drops the events' streams
  // but not the final segments', and a range brought back never merges with
  // a final segment beside it (an earlier segment_map over both then lies in
  // no segment). So a segment_unmap is told only for a whole run with no
  // segment beside it, where no merge is wanted; otherwise the run's pieces
  // are allocated and the run freed, which the viewer undoes without merging.
  const Block* first = b;
  while (large_mem(first->prev)) first = first->prev;
  const Block* last = b;
  while (large_mem(last->next)) last = last->next;
  auto beside = [](const Block* n) { return n != nullptr && n->mapped; };  // a chunk
  if (lo == first->addr && hi == last->end() && !beside(first->prev) && !beside(last->next))
    trace(TraceEntry::kSegmentUnmap, lo, hi - lo, b->segment->stream);
  else
    trace_split(b, lo, hi);
}

void Allocator::trace_split(const Block* b, uintptr_t lo, uintptr_t hi) {
  // The pieces first, then the run: undone backwards, the run comes back
  // before its pieces go, so no live block is ever outside every segment.
  uintptr_t a = 0, e = 0;
  run_extent(b, &a, &e);
  Stream rs = b->segment->stream;
  if (a < lo) trace(TraceEntry::kSegmentAlloc, a, lo - a, rs);
  if (hi < e) trace(TraceEntry::kSegmentAlloc, hi, e - hi, rs);
  trace_segment_free(a, e - a, rs, hi == e && !segment_from(e) && segment_below(lo));
}

void Allocator::trace_replace(uintptr_t a, uintptr_t e, const std::vector<TracePiece>& before,
                              const std::vector<TracePiece>& after) {
  // [a, e) held the segments `before` and holds `after` (each listed by
  // address). trace_plot -s pairs a segment_alloc with the next segment_free
  // at its address, so each is freed and the new ones allocated; PyTorch's
  // viewer, which undoes the history from the final segments, then lacks a
  // segment over the live blocks of [a, e) between the two. A segment over
  // all of [a, e) covers them meanwhile: a segment_map (undone by cutting it
  // out of the first segment holding it, which is this one: undone, the old
  // segments go in after it) and a segment_unmap at the end (undone by
  // inserting it and merging it with the segments it touches of its stream:
  // kShadowStream, none's). The old ones go bottom up and the new ones come
  // top down, so that the viewer's binary search for a block's segment,
  // which the overlap may mislead, always meets one holding the block.
  trace(TraceEntry::kSegmentMap, a, e - a, kShadowStream);
  bool top = !segment_from(e);
  for (size_t i = 0; i < before.size(); i++) {
    const TracePiece& p = before[i];
    trace_segment_free(p.addr, p.size, p.stream, top && i + 1 == before.size());
  }
  for (auto it = after.rbegin(); it != after.rend(); ++it)
    trace(TraceEntry::kSegmentAlloc, it->addr, it->size, it->stream);
  trace(TraceEntry::kSegmentUnmap, a, e - a, kShadowStream);
}

bool Allocator::segment_from(uintptr_t addr) const {
  // Another backend segment, or in the one holding addr a chunk or the
  // start of a run at addr or above.
  if (segments_.lower_bound(addr) != segments_.end()) return true;
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return false;
  for (const Block* b = std::prev(it)->second->first; b != nullptr; b = b->next)
    if (b->addr >= addr && b->mapped && (b->chunk != nullptr || !large_mem(b->prev))) return true;
  return false;
}

bool Allocator::segment_below(uintptr_t addr) const {
  if (history_shared_) return true;  // another pool's may be
  for (const auto& [base, seg] : segments_) {
    if (base >= addr) break;
    for (const Block* b = seg->first; b != nullptr && b->addr < addr; b = b->next)
      if (b->mapped) return true;
  }
  return false;
}

void Allocator::trace_segment_free(uintptr_t addr, size_t size, Stream s, bool top) {
  // PyTorch's viewer undoes a segment_free by inserting the segment before
  // the first one above it, or, when there is none, before the last one
  // (JavaScript's splice(-1, 0, x)): its list then leaves address order, and
  // a later undo of a segment_unmap merges with the wrong neighbours. So
  // above a segment freed at the top (with others below it) goes an empty
  // segment at its end for that moment: undone, the empty one is appended
  // (segment_unmap), the freed one inserted before it, and the empty one
  // removed (segment_alloc). Both are 0 bytes: no reserved figure moves.
  if (!top) {
    trace(TraceEntry::kSegmentFree, addr, size, s);
    return;
  }
  trace(TraceEntry::kSegmentAlloc, addr + size, 0, s);
  trace(TraceEntry::kSegmentFree, addr, size, s);
  trace(TraceEntry::kSegmentUnmap, addr + size, 0, s);
}

// ---------------------------------------------------------------------------
// History

void Allocator::trace(TraceEntry::Action a, uintptr_t addr, size_t size, Stream s) {
  if (history_max_ == 0) return;
  TraceEntry e{a, addr, size, s, now_us(), trace_context_};
  if (history_.size() < history_max_) {
    try {
      history_.push_back(e);
    } catch (const std::bad_alloc&) {
      return;  // left out (see above)
    }
  } else {
    history_[history_next_] = e;
  }
  history_next_ = (history_next_ + 1) % history_max_;
}

void Allocator::record_history(bool enabled, size_t max_entries) {
  std::lock_guard<Lock> guard(mu_);
  history_on_ = enabled && max_entries > 0;
  if (max_entries != history_max_) {
    history_.clear();
    history_next_ = 0;
    history_max_ = max_entries;
  }
  if (!enabled) {
    history_.clear();
    history_next_ = 0;
  }
}

void Allocator::clear_history() {
  std::lock_guard<Lock> guard(mu_);
  history_.clear();
  history_next_ = 0;
}

void Allocator::contexts_in_use(std::vector<uint64_t>* out) const {
  std::lock_guard<Lock> guard(mu_);
  live_.for_each([out](uintptr_t, const Block* b) {
    if (b->context != 0) out->push_back(b->context);
  });
  for (const PendingFree& pf : pending_)
    if (pf.block->context != 0) out->push_back(pf.block->context);
  for (const TraceEntry& e : history_)
    if (e.context != 0) out->push_back(e.context);
}

std::vector<TraceEntry> Allocator::history() const {
  std::lock_guard<Lock> guard(mu_);
  if (history_.size() < history_max_) return history_;
  std::vector<TraceEntry> out(history_.begin() + history_next_, history_.end());
  out.insert(out.end(), history_.begin(), history_.begin() + history_next_);
  return out;
}

}  // namespace pyalloc
