// A pass over a pickle's opcodes before CPython's unpickler reads it, for the
// one thing in a pickle of plain data that costs memory out of all proportion
// to the file: a memo index. CPython's unpickler keeps its memo in an array
// as long as the largest index stored (PUT, BINPUT, LONG_BINPUT), so nine
// bytes storing at index 2^27 take 2 GiB, and at 2^31 more memory than most
// machines have. A pickler numbers its memo entries in order (0, 1, 2, ...:
// the memo's length at each store), so an index past the number of entries
// stored before it never comes from one: the pass refuses it.
//
// Everything else is left to the unpickler, which reports it: an unknown
// opcode, a truncated argument, a class (pyalloc's unpickler refuses every
// one). The pass stops at the first STOP, as the unpickler does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyalloc {

/// Empty if the unpickler may read `data`; else why not, with the offset of
/// the opcode at fault.
std::string scan_pickle_memo(const uint8_t* data, size_t size);

}  // namespace pyalloc
