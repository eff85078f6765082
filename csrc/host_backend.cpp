// The host backend: segments are anonymous private mappings of real host
// memory, so tests can write through every block the core hands out and prove
// that no two live blocks overlap. Pages are committed only when written
// (MAP_NORESERVE), so a large pool costs nothing until used. Streams and
// events are simulated (sim_streams.h).
#include <sys/mman.h>

#include <mutex>

#include "backend.h"
#include "sim_streams.h"

namespace pyalloc {
namespace {

class HostBackend final : public Backend {
 public:
  explicit HostBackend(size_t capacity) : capacity_(capacity) {}

  const char* name() const override { return "host"; }

  uintptr_t reserve(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    if (capacity_ != 0 && size > capacity_ - used_) return 0;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 0;
    used_ += size;
    return reinterpret_cast<uintptr_t>(p);
  }

  void release(uintptr_t base, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    munmap(reinterpret_cast<void*>(base), size);
    used_ -= size;
  }

  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    std::lock_guard<std::mutex> g(mu_);
    *total_bytes = capacity_;
    *free_bytes = capacity_ == 0 ? 0 : capacity_ - used_;
  }

  EventId record_event(Stream s) override { return streams_.record(s); }
  bool event_done(EventId e) override { return streams_.done(e); }
  void event_wait(EventId e) override { streams_.wait(e); }
  void event_free(EventId e) override { streams_.release(e); }
  SimStreams* sim_streams() override { return &streams_; }

 private:
  std::mutex mu_;
  size_t capacity_;
  size_t used_ = 0;
  SimStreams streams_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(size_t capacity) {
  return std::make_unique<HostBackend>(capacity);
}

}  // namespace pyalloc
