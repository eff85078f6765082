// C++ test driver over the allocator core, run under AddressSanitizer +
// UndefinedBehaviorSanitizer and (the thread stress) ThreadSanitizer by
// tests/cpp/run.sh. It drives the core directly, with no Python in between,
// so the sanitizers see every path: split, merge, chunks, streams, OOM,
// release, and the error paths.
//
// Usage: test_core [all|threads]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/allocator.h"
#include "backends/sim_streams.h"
#include "replay/replay.h"
#include "replay/torch_model.h"

using namespace pyalloc;

namespace {

int failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                          \
    }                                                                      \
  } while (0)

template <typename E, typename F>
bool throws(F f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}

constexpr size_t KiB = 1024, MiB = 1024 * 1024;

std::unique_ptr<Allocator> make(const char* backend, const std::string& conf, size_t capacity = 0) {
  auto b = std::string(backend) == "host" ? make_host_backend(capacity) : make_virtual_backend(capacity);
  return std::make_unique<Allocator>(std::move(b), parse_config(conf));
}

void test_basics(const char* backend) {
  auto a = make(backend, "pool_size:64MiB");
  CHECK(a->malloc(0, 0) == 0);
  uintptr_t p = a->malloc(1000, 0), q = a->malloc(5 * MiB, 0);
  CHECK(p % 512 == 0 && q % 512 == 0 && p != q);
  a->check_invariants();
  a->free(p);
  CHECK(throws<InvalidPointerError>([&] { a->free(p); }));
  CHECK(throws<InvalidPointerError>([&] { a->free(q + 512); }));
  CHECK(throws<InvalidPointerError>([&] { a->free(0x1000); }));
  // No device could hold it: out of memory at once (a rejection), as PyTorch answers it.
  try {
    a->malloc(kMaxRequest + 1, 0);
    CHECK(false);
  } catch (const OutOfMemoryError& e) {
    CHECK(e.rejected());
  }
  CHECK(a->stats().num_oom_rejections == 1);
  a->free(q);
  a->check_invariants();
  CHECK(a->empty_cache() == 0);  // pool_size stays reserved
  CHECK(a->stats().reserved_bytes.all.current == 64 * MiB);
}

void test_oom(const char* backend) {
  auto a = make(backend, "max_pool_size:32MiB,segment_size:2MiB");
  std::vector<uintptr_t> live;
  for (int i = 0; i < 3; ++i) live.push_back(a->malloc(10 * MiB, 0));
  CHECK(throws<OutOfMemoryError>([&] { a->malloc(4 * MiB, 0); }));
  a->check_invariants();
  CHECK(a->stats().num_ooms == 1);
  for (uintptr_t p : live) a->free(p);
  a->check_invariants();
}

void test_streams(const char* backend) {
  auto a = make(backend, "segment_size:2MiB");
  SimStreams* ss = a->backend().sim_streams();
  uintptr_t p = a->malloc(4 * MiB, 1);
  ss->set_busy(1);
  a->free(p);
  uintptr_t q = a->malloc(4 * MiB, 2);
  CHECK(q != p);
  ss->complete(1);
  uintptr_t r = a->malloc(4 * MiB, 2);
  CHECK(r == p);
  a->record_stream(r, 3);
  ss->set_busy(3);
  a->free(r);
  CHECK(a->stats().active.all.current == 2);
  a->check_invariants();
  a->free(q);
  a->empty_cache();
  CHECK(a->stats().reserved_bytes.all.current == 0);
  CHECK(ss->live_events() == 0);
  a->check_invariants();
}

// Random operations with invariants after each; host memory gets patterns.
void test_random(const char* backend, const std::string& conf, unsigned seed, int steps) {
  bool host = std::string(backend) == "host";
  auto a = make(backend, conf, 96 * MiB);
  SimStreams* ss = a->backend().sim_streams();
  std::mt19937_64 rng(seed);
  struct Live {
    size_t size;
    unsigned char byte;
  };
  std::unordered_map<uintptr_t, Live> live;
  std::vector<uintptr_t> keys;
  auto pick = [&]() -> uintptr_t { return keys[rng() % keys.size()]; };
  for (int step = 0; step < steps; ++step) {
    unsigned op = rng() % 100;
    Stream s = rng() % 3;
    if (op < 50 || keys.empty()) {
      size_t size = (rng() % 4 == 0) ? MiB + rng() % (12 * MiB) : 1 + rng() % (64 * KiB);
      try {
        uintptr_t p = a->malloc(size, s);
        unsigned char byte = static_cast<unsigned char>(step % 251 + 1);
        if (host) std::memset(reinterpret_cast<void*>(p), byte, size);
        CHECK(live.find(p) == live.end());
        live[p] = Live{size, byte};
        keys.push_back(p);
      } catch (const OutOfMemoryError&) {
      }
    } else if (op < 85) {
      size_t i = rng() % keys.size();
      uintptr_t p = keys[i];
      keys[i] = keys.back();
      keys.pop_back();
      if (host) {
        const unsigned char* m = reinterpret_cast<const unsigned char*>(p);
        for (size_t k = 0; k < live[p].size; k += 997) CHECK(m[k] == live[p].byte);
      }
      live.erase(p);
      a->free(p);
    } else if (op < 90) {
      a->record_stream(pick(), s);
    } else if (op < 95) {
      ss->set_busy(s);
    } else if (op < 99) {
      ss->complete(s);
    } else {
      a->empty_cache();
    }
    a->check_invariants();
  }
  for (uintptr_t p : keys) a->free(p);
  for (Stream s = 0; s < 3; ++s) ss->complete(s);
  a->empty_cache();
  a->check_invariants();
  CHECK(a->stats().reserved_bytes.all.current == static_cast<int64_t>(a->config().pool_size));
}

// Four threads, 100k operations in all, two streams, then every stat at zero.
void test_threads(const char* backend, const char* conf) {
  auto a = make(backend, conf);
  auto body = [&](unsigned seed) {
    std::mt19937_64 rng(seed);
    std::vector<uintptr_t> mine;
    Stream s = seed % 2;
    for (int i = 0; i < 25000; ++i) {
      if (!mine.empty() && (rng() % 2 == 0 || mine.size() > 64)) {
        size_t k = rng() % mine.size();
        a->free(mine[k]);
        mine[k] = mine.back();
        mine.pop_back();
      } else {
        size_t size = rng() % 2 ? 1 + rng() % (32 * KiB) : MiB + rng() % (5 * MiB);
        mine.push_back(a->malloc(size, s));
      }
      if (i % 5000 == 0) a->stats();
    }
    for (uintptr_t p : mine) a->free(p);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < 4; ++t) pool.emplace_back(body, t + 1);
  for (auto& th : pool) th.join();
  a->check_invariants();
  a->empty_cache();
  Stats s = a->stats();
  CHECK(s.allocation.all.current == 0);
  CHECK(s.active_bytes.all.current == 0);
  CHECK(s.reserved_bytes.all.current == 0);
  CHECK(s.segment.all.current == 0);
  CHECK(s.allocation.all.freed == s.allocation.all.allocated);
}

}  // namespace

// The model of PyTorch's allocator over a random trace of three streams, default
// and expandable, with and without a capacity and with releases between ops:
// run under the sanitizers, its block lists are walked hard.
void test_torch_model(unsigned seed, int steps) {
  std::mt19937_64 rng(seed);
  std::vector<ReplayOp> ops;
  std::vector<uint32_t> live;
  uint32_t next_id = 0;
  for (int i = 0; i < steps; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      size_t k = rng() % live.size();
      ops.push_back(ReplayOp{ReplayOp::kFree, live[k], 0, 0});
      live[k] = live.back();
      live.pop_back();
    } else {
      size_t size = rng() % 4 == 0 ? rng() % (48 * MiB) : rng() % (2 * MiB);
      ops.push_back(ReplayOp{ReplayOp::kAlloc, next_id, size, static_cast<Stream>(rng() % 3)});
      live.push_back(next_id++);
    }
  }
  ReplayTrace trace(ops);
  for (bool expandable : {false, true}) {
    for (size_t capacity : {size_t(0), 512 * MiB, 96 * MiB}) {
      TorchModelOptions opt;
      opt.expandable = expandable;
      opt.capacity = capacity;
      opt.record_calls = true;
      for (size_t op = 0; op < ops.size(); op += 97) opt.releases.push_back(op);
      TorchModelResult r = run_torch_model(trace, opt);
      CHECK(r.completed == (r.ooms == 0));
      CHECK(r.calls.size() == r.device_calls);
      int64_t reserved = 0, peak = 0;
      for (const ModelCall& c : r.calls) {
        bool grows = c.kind == ModelCall::kSegmentAlloc || c.kind == ModelCall::kSegmentMap;
        CHECK(grows || c.kind == ModelCall::kSegmentFree || c.kind == ModelCall::kSegmentUnmap);
        CHECK(expandable == (c.kind == ModelCall::kSegmentMap || c.kind == ModelCall::kSegmentUnmap));
        reserved += grows ? int64_t(c.size) : -int64_t(c.size);
        CHECK(reserved >= 0);
        peak = std::max(peak, reserved);
      }
      CHECK(peak == r.peak_reserved);
      if (capacity != 0) CHECK(r.peak_reserved <= int64_t(capacity));
    }
  }
}

int main(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "all";
  for (const char* backend : {"host", "virtual"}) {
    if (what == "all") {
      test_basics(backend);
      test_oom(backend);
      test_streams(backend);
      test_random(backend, "", 1, 3000);
      test_random(backend, "max_split_size:4MiB,segment_size:2MiB", 2, 3000);
      test_random(backend, "pool_size:32MiB,small_size:64KiB,small_chunk_size:512KiB", 3, 3000);
      test_random(backend, "strategy:vmm", 4, 3000);
      test_random(backend, "strategy:vmm,max_pool_size:48MiB", 5, 3000);
    }
    test_threads(backend, "segment_size:8MiB");
    test_threads(backend, "strategy:vmm");
  }
  if (what == "all") {
    test_torch_model(11, 4000);
    test_torch_model(12, 4000);
  }
  if (failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_core %s: all checks passed\n", what.c_str());
  return 0;
}
