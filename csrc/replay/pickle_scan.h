// A pass over a pickle's opcodes before CPython's unpickler reads them, for
// what in a pickle of plain data costs memory out of all proportion to the
// file. First, a memo index: CPython's unpickler keeps its memo in an array
// as long as the largest index stored (PUT, BINPUT, LONG_BINPUT), so nine
// bytes storing at index 2^27 take 2 GiB, and at 2^31 more memory than most
// machines have. A pickler numbers its memo entries in order (0, 1, 2, ...:
// the memo's length at each store), so an index past the number of entries
// stored before it never comes from one: the pass refuses it. Then the
// objects: one byte can build a 216-byte set, so the pass adds up the least
// memory the load takes (the pickle's bytes, the memo, the objects) and
// refuses the pickle once that passes what the caller allows (the memory
// available), and an argument longer than the file before it is read.
//
// Everything else is left to the unpickler, which reports it: an unknown
// opcode, a truncated argument, a class (pyalloc's unpickler refuses every
// one). The pass stops at the first STOP, as the unpickler does, so that a
// reader feeding it chunk by chunk reads no further than the unpickler would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyalloc {

/// Where a pass over a pickle stands, between calls that each see more of it.
struct PickleScan {
  uint64_t stored = 0;  // memo stores stepped over so far
  size_t done = 0;      // bytes of whole opcodes stepped over
  bool end = false;     // a STOP, or an opcode the unpickler will refuse: no need to read on
  std::string why;      // refused: why (end is set too)
  /// The most bytes the pickle may have: an argument longer than what is
  /// left of it is refused as truncated, rather than waited for (or asked
  /// of memory whole by the unpickler).
  uint64_t limit = UINT64_MAX;
  /// A lower bound of the memory the unpickler's objects and memo take
  /// (bytes), and the most the load may take, the pickle's own bytes
  /// included: past it the pickle is refused, before the unpickler builds
  /// them. One byte of pickle can build 216 bytes of objects (a set), so a
  /// small compressed file can ask for more memory than a machine has.
  uint64_t objects = 0;
  uint64_t memory = UINT64_MAX;
  /// The unpickler's memo array, in slots, as CPython grows it.
  uint64_t memo_slots = 0;
  /// The opcode at `done` waits for its line's end: no '\n' lies before
  /// line_from (and its first line ends at first_line, for GLOBAL and INST).
  size_t line_from = 0;
  size_t first_line = 0;
};

/// Steps over the whole opcodes of data[scan->done, size), leaving
/// scan->done at the first one not yet whole (call again with more data
/// appended), or setting scan->end (and scan->why if the pickle is refused).
void scan_pickle(const uint8_t* data, size_t size, PickleScan* scan);

}  // namespace pyalloc
