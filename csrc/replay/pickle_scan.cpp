// The pass over a pickle's opcodes before the unpickler's: see pickle_scan.h. The opcodes and
// their arguments are those of pickle protocols 0 to 5 (CPython's
// Lib/pickletools.py lists them).
#include "pickle_scan.h"

#include <cstring>

namespace pyalloc {
namespace {

// How an opcode's argument is laid out after it.
enum class Arg {
  kNone,
  kFixed,     // `width` bytes
  kCounted,   // a little-endian length of `width` bytes, then that many bytes
  kLine,      // up to and including '\n'
  kTwoLines,  // GLOBAL and INST: module and name
  kUnknown,
};

struct Op {
  Arg arg;
  int width;
};

Op op_of(uint8_t code) {
  switch (code) {
    // No argument.
    case '(': case '.': case '0': case '1': case '2': case 'N': case 'Q': case 'R':
    case 'a': case 'b': case 'd': case '}': case 'e': case 'l': case ']': case 'o':
    case 's': case 't': case ')': case 'u': case 0x81: case 0x85: case 0x86: case 0x87:
    case 0x88: case 0x89: case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93:
    case 0x94: case 0x97: case 0x98:
      return {Arg::kNone, 0};
    // Fixed width: BININT1, BINGET, BINPUT, PROTO, EXT1; BININT2, EXT2;
    // BININT, LONG_BINGET, LONG_BINPUT, EXT4; BINFLOAT, FRAME.
    case 'K': case 'h': case 'q': case 0x80: case 0x82:
      return {Arg::kFixed, 1};
    case 'M': case 0x83:
      return {Arg::kFixed, 2};
    case 'J': case 'j': case 'r': case 0x84:
      return {Arg::kFixed, 4};
    case 'G': case 0x95:
      return {Arg::kFixed, 8};
    // Counted: SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE, LONG1;
    // BINSTRING, BINUNICODE, BINBYTES, LONG4; BINUNICODE8, BINBYTES8, BYTEARRAY8.
    case 'U': case 'C': case 0x8c: case 0x8a:
      return {Arg::kCounted, 1};
    case 'T': case 'X': case 'B': case 0x8b:
      return {Arg::kCounted, 4};
    case 0x8d: case 0x8e: case 0x96:
      return {Arg::kCounted, 8};
    // A line: FLOAT, INT, LONG, PERSID, STRING, UNICODE, GET, PUT.
    case 'F': case 'I': case 'L': case 'P': case 'S': case 'V': case 'g': case 'p':
      return {Arg::kLine, 0};
    case 'c': case 'i':
      return {Arg::kTwoLines, 0};
    default:
      return {Arg::kUnknown, 0};
  }
}

uint64_t little_endian(const uint8_t* p, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The end of the line starting at `pos` (just past its '\n'), or 0 if none.
size_t line_end(const uint8_t* data, size_t size, size_t pos) {
  const void* nl = std::memchr(data + pos, '\n', size - pos);
  return nl == nullptr ? 0 : static_cast<size_t>(static_cast<const uint8_t*>(nl) - data) + 1;
}

// A memo store at `index`, unless it lies far past the entries stored so
// far: up to twice their number (and a little) is let through. What the
// unpickler's memo array grows by is counted as memory: CPython sizes it at
// 32 slots, and at twice an index that does not fit (8 bytes a slot).
bool store(PickleScan* scan, uint64_t index, size_t at) {
  if (index > 2 * scan->stored + 1024) {
    scan->why = "stores memo entry " + std::to_string(index) + " at byte " + std::to_string(at) + " after " +
                std::to_string(scan->stored) +
                " entries: a pickler numbers its memo in order, and the unpickler would take memory for " +
                "every index up to it";
    scan->end = true;
    return false;
  }
  scan->stored++;
  if (scan->memo_slots == 0) scan->memo_slots = 32;
  if (index >= scan->memo_slots) {
    scan->objects += 8 * (2 * index - scan->memo_slots);
    scan->memo_slots = 2 * index;
  }
  return true;
}

// PUT's index: the digits of [pos, end) less the '\n'. A pickler writes plain
// decimal digits; CPython's unpickler also takes a sign, spaces and '_',
// which no pickler writes: refused, as they would hide an index from the pass.
bool put_index(const uint8_t* data, size_t pos, size_t end, uint64_t* index) {
  size_t n = end - 1 - pos;
  if (n == 0 || n > 19) return false;  // 19 digits: below 2^64
  *index = 0;
  for (size_t i = pos; i + 1 < end; ++i) {
    if (data[i] < '0' || data[i] > '9') return false;
    *index = *index * 10 + (data[i] - '0');
  }
  return true;
}

// The least memory, in bytes, that CPython (64-bit) takes for what the
// opcode builds, given its argument's value or length `n` (memo slots are
// counted by store()). A lower bound: objects CPython shares (small ints,
// strings and bytes of at most one character, the empty tuple) count 0, a
// character takes at least half its UTF-8 bytes (a third of its escape in a
// text pickle), and containers over-allocate.
uint64_t builds(uint8_t code, uint64_t n) {
  switch (code) {
    case '}': case 'd': return 64;                         // dict
    case ']': case 'l': return 56;                         // list
    case 0x8f: case 0x91: return 216;                      // set, frozenset
    case 0x85: return 48;                                  // TUPLE1
    case 0x86: return 56;                                  // TUPLE2
    case 0x87: return 64;                                  // TUPLE3
    case 'a': case 's': return 8;                          // one more item
    case 'G': case 'F': return 24;                         // float
    case 'J': return n >= 257 && n < 0xFFFFFFFBull ? 28 : 0;  // ints from -5 to 256 are shared
    case 'M': return n >= 257 ? 28 : 0;
    case 0x8a: case 0x8b: return n <= 2 ? 0 : 24 + n;      // int of n bytes
    case 'L': return n <= 4 ? 0 : 24 + 2 * n / 5;          // int of n digits (and an 'L')
    case 'X': case 0x8c: case 0x8d: return n <= 2 ? 0 : 40 + n / 2;  // str, n bytes of UTF-8
    case 'V': return n <= 2 ? 0 : 40 + n / 3;              // str, escaped
    case 'T': case 'U': case 'B': case 'C': case 0x8e: return n <= 1 ? 0 : 33 + n;  // bytes (or str)
    case 'S': return n <= 4 ? 0 : 33 + n / 4;              // quoted, escaped
    case 0x96: return 56 + n;                              // bytearray
    default: return 0;
  }
}

// Memory the pass can already tell the load takes, counting `held` bytes of
// pickle: they are read into memory, copied once for the unpickler, and the
// reader's copy dropped before it builds anything.
uint64_t saturating_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

// Refuses the pickle if its load needs more than scan->memory: its `held`
// bytes twice (the reader's and the unpickler's copy), or once beside the
// objects built so far and `extra` more.
bool over_memory(PickleScan* scan, uint64_t extra, uint64_t held, size_t at) {
  uint64_t twice = saturating_add(held, held);
  uint64_t built = saturating_add(held, saturating_add(scan->objects, extra));
  uint64_t want = twice > built ? twice : built;
  if (want <= scan->memory) return false;
  scan->why = "takes at least " + std::to_string(want) + " bytes of memory to load (its " +
              std::to_string(held) + " bytes and the objects built by byte " + std::to_string(at) +
              "), more than the " + std::to_string(scan->memory) + " bytes it may take";
  scan->end = true;
  return true;
}

}  // namespace

void scan_pickle(const uint8_t* data, size_t size, PickleScan* scan) {
  size_t pos = scan->done;
  while (!scan->end && pos < size) {
    size_t at = pos;
    uint8_t code = data[pos++];
    Op op = op_of(code);
    size_t left = size - pos;
    uint64_t arg = 0;  // the argument's value, or its length
    switch (op.arg) {
      case Arg::kUnknown:
        scan->end = true;  // the unpickler says what is wrong
        break;
      case Arg::kNone:
        if (code == '.') scan->end = true;  // STOP: the unpickler reads no further
        if (code == 0x94 && !store(scan, scan->stored, at)) return;  // MEMOIZE: the next entry
        break;
      case Arg::kFixed: {
        if (left < static_cast<size_t>(op.width)) return;  // more to come
        uint64_t v = little_endian(data + pos, op.width);
        if ((code == 'q' || code == 'r') && !store(scan, v, at)) return;  // BINPUT, LONG_BINPUT
        arg = v;
        pos += static_cast<size_t>(op.width);
        break;
      }
      case Arg::kCounted: {
        if (left < static_cast<size_t>(op.width)) return;
        uint64_t n = little_endian(data + pos, op.width);
        uint64_t after = pos + static_cast<uint64_t>(op.width);
        if (after > scan->limit || n > scan->limit - after) {
          // Longer than the pickle can be: the unpickler would ask for it all first.
          scan->why = "an argument at byte " + std::to_string(at) + " of " + std::to_string(n) +
                      " bytes is longer than the file: truncated";
          scan->end = true;
          return;
        }
        // Refused before its bytes are read, if holding them is too much already.
        if (over_memory(scan, builds(code, n), after + n, at)) return;
        if (n > size - after) return;  // its bytes are still to come
        arg = n;
        pos += static_cast<size_t>(op.width) + static_cast<size_t>(n);
        break;
      }
      case Arg::kLine: {
        // A line not ended yet is searched on from where the last call stopped.
        size_t end = line_end(data, size, pos > scan->line_from ? pos : scan->line_from);
        if (end == 0) {
          scan->line_from = size;
          over_memory(scan, 0, size, at);
          return;
        }
        if (code == 'p') {  // PUT
          uint64_t index = 0;
          if (!put_index(data, pos, end, &index)) {
            scan->why = "stores a memo entry at byte " + std::to_string(at) +
                        " whose index is not plain decimal digits, as no pickler writes it";
            scan->end = true;
            return;
          }
          if (!store(scan, index, at)) return;
        }
        arg = end - pos - 1;
        pos = end;
        break;
      }
      case Arg::kTwoLines: {
        size_t first = scan->first_line != 0
                           ? scan->first_line
                           : line_end(data, size, pos > scan->line_from ? pos : scan->line_from);
        size_t second = first == 0 ? 0 : line_end(data, size, first > scan->line_from ? first : scan->line_from);
        if (second == 0) {
          scan->first_line = first;
          scan->line_from = size;
          over_memory(scan, 0, size, at);
          return;
        }
        pos = second;
        break;
      }
    }
    if (scan->end && code != '.') return;
    scan->done = pos;
    scan->line_from = scan->first_line = 0;
    scan->objects += builds(code, arg);
    if (over_memory(scan, 0, pos, at)) return;
  }
}

}  // namespace pyalloc
