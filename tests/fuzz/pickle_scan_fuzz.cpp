// A coverage-guided libFuzzer target for the pickle pre-scan (csrc/replay/pickle_scan.h),
// which reads the bytes of snapshot files users download, before CPython's unpickler does.
// Built with ASan and UBSan by tests/fuzz/run.sh: a read past the data, an overflow or a
// loop that never ends shows up as a crash or a timeout.
//
// Besides not crashing, the scan must give one answer however the bytes arrive:
// pyalloc/replay/snapshot_io.py feeds it 1 MiB at a time, so the input is scanned whole and again in
// chunks (their size taken from the input's first byte), and the two must agree on where
// they stopped, why, and what they counted. The memory cap is left off for that
// comparison (a line not yet ended counts the bytes held so far, which depends on the
// chunks); a second, whole pass runs under a small cap so that the refusals are reached.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "replay/pickle_scan.h"

namespace {

using pyalloc::PickleScan;
using pyalloc::scan_pickle;

[[noreturn]] void mismatch(const char* what, const PickleScan& whole, const PickleScan& parts, size_t chunk) {
  std::fprintf(stderr,
               "pickle_scan_fuzz: %s differs with %zu-byte chunks: whole done=%zu end=%d stored=%llu "
               "objects=%llu why='%s'; chunked done=%zu end=%d stored=%llu objects=%llu why='%s'\n",
               what, chunk, whole.done, whole.end, static_cast<unsigned long long>(whole.stored),
               static_cast<unsigned long long>(whole.objects), whole.why.c_str(), parts.done, parts.end,
               static_cast<unsigned long long>(parts.stored), static_cast<unsigned long long>(parts.objects),
               parts.why.c_str());
  std::abort();
}

// The scan never claims more than it saw, and a refusal always ends it.
void check_bounds(const PickleScan& scan, size_t size) {
  if (scan.done > size || (!scan.why.empty() && !scan.end)) {
    std::fprintf(stderr, "pickle_scan_fuzz: done=%zu of %zu, end=%d, why='%s'\n", scan.done, size, scan.end,
                 scan.why.c_str());
    std::abort();
  }
}

// Scans data[0, size) handing it over `chunk` bytes at a time, each call seeing all the
// bytes so far (as _read_scanned does), in a buffer of exactly that length so that ASan
// sees any read past it.
PickleScan scan_in_chunks(const uint8_t* data, size_t size, size_t chunk, uint64_t limit) {
  PickleScan scan;
  scan.limit = limit;
  for (size_t have = 0; have < size && !scan.end;) {
    have = size - have < chunk ? size : have + chunk;
    std::vector<uint8_t> seen(data, data + have);
    scan_pickle(seen.data(), seen.size(), &scan);
    check_bounds(scan, have);
  }
  return scan;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t input_size) {
  if (input_size == 0) return 0;
  size_t chunk = 1 + input[0] % 16;
  const uint8_t* data = input + 1;
  size_t size = input_size - 1;
  std::vector<uint8_t> copy(data, data + size);  // exactly `size` bytes, for ASan

  PickleScan whole;
  whole.limit = size;  // as for an uncompressed file: the pickle is no longer than it
  scan_pickle(copy.data(), copy.size(), &whole);
  check_bounds(whole, size);

  PickleScan parts = scan_in_chunks(data, size, chunk, size);
  if (parts.done != whole.done) mismatch("done", whole, parts, chunk);
  if (parts.end != whole.end) mismatch("end", whole, parts, chunk);
  if (parts.why != whole.why) mismatch("why", whole, parts, chunk);
  if (parts.stored != whole.stored) mismatch("stored", whole, parts, chunk);
  if (parts.objects != whole.objects) mismatch("objects", whole, parts, chunk);

  // Under a cap a few times the input's size, the memory refusals are reached too.
  PickleScan capped;
  capped.limit = UINT64_MAX;  // as for a gzip stream: no bound from the file's size
  capped.memory = 64 * (size + 1);
  scan_pickle(copy.data(), copy.size(), &capped);
  check_bounds(capped, size);
  return 0;
}
