// The host backend: real host memory, so tests can write through every block
// the core hands out and prove that no two live blocks overlap.
//
// Segments are anonymous private mappings. Virtual memory is real too: a
// range is reserved with PROT_NONE, and "physical pages" are pages of one
// memfd, mapped into the range with mmap(MAP_FIXED | MAP_SHARED), PROT_NONE
// until vmm_access() makes them readable and writable, and taken out
// by mapping the reservation back over them. A page that moves to another
// address keeps its bytes, as a cuMemCreate handle does. Pages are committed
// only when written (MAP_NORESERVE), so a large pool costs nothing until used.
// Streams and events are simulated (sim_streams.h).
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "sim_streams.h"

namespace pyalloc {
namespace {

class HostBackend final : public Backend {
 public:
  HostBackend(size_t capacity, size_t page) : capacity_(capacity), page_(page) {}

  ~HostBackend() override {
    if (fd_ >= 0) close(fd_);
  }

  const char* name() const override { return "host"; }

  uintptr_t reserve(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    if (!fits(size)) return 0;
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
  bool event_wait(EventId e) override { return streams_.wait(e); }
  void event_free(EventId e) override { streams_.release(e); }
  SimStreams* sim_streams() override { return &streams_; }

  size_t vmm_page_size() override { return page_; }

  uintptr_t vmm_reserve(size_t size) override {
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? 0 : reinterpret_cast<uintptr_t>(p);
  }

  void vmm_release(uintptr_t base, size_t size) override {
    munmap(reinterpret_cast<void*>(base), size);
  }

  bool vmm_map(uintptr_t addr, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    if (!fits(size)) return false;
    if (fd_ < 0) {
      fd_ = memfd_create("pyalloc-host-pages", MFD_CLOEXEC);
      if (fd_ < 0) return false;
    }
    // Room for every page to come back to spare_: unmapping never allocates.
    spare_.reserve(spare_.size() + page_of_.size() + size / page_);
    for (size_t off = 0; off < size; off += page_) {
      size_t phys;
      if (!spare_.empty()) {
        phys = spare_.back();
        spare_.pop_back();
      } else {
        phys = file_size_;
        if (ftruncate(fd_, static_cast<off_t>(file_size_ + page_)) != 0) {
          unmap_locked(addr, off);
          return false;
        }
        file_size_ += page_;
      }
      void* want = reinterpret_cast<void*>(addr + off);
      // Not accessible until vmm_access(), as cuMemMap's pages are not until
      // cuMemSetAccess: a core that forgot it faults in the tests.
      void* got = mmap(want, page_, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_, static_cast<off_t>(phys));
      if (got != want) {
        spare_.push_back(phys);
        unmap_locked(addr, off);
        return false;
      }
      page_of_[addr + off] = phys;
    }
    used_ += size;
    return true;
  }

  bool vmm_access(uintptr_t addr, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    // As cuMemSetAccess: only over pages that are all mapped.
    for (size_t off = 0; off < size; off += page_)
      if (page_of_.count(addr + off) == 0)
        throw std::logic_error("vmm_access over a page that is not mapped");
    return mprotect(reinterpret_cast<void*>(addr), size, PROT_READ | PROT_WRITE) == 0;
  }

  void vmm_unmap(uintptr_t addr, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    unmap_locked(addr, size);
    used_ -= size;
  }

  // A detached handle keeps its pages, in order, until attached elsewhere
  // (with its bytes, as a cuMemCreate handle mapped at another address) or
  // dropped; its memory stays counted against the capacity meanwhile.
  bool vmm_moves() override { return true; }

  bool vmm_detach(uintptr_t addr, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<size_t> pages;
    for (size_t off = 0; off < size; off += page_) {
      auto it = page_of_.find(addr + off);
      if (it == page_of_.end()) throw std::logic_error("vmm_detach over a page that is not mapped");
    }
    try {
      auto handle = detached_.emplace(size, std::vector<size_t>());
      try {
        for (size_t off = 0; off < size; off += page_) handle->second.push_back(page_of_.find(addr + off)->second);
      } catch (...) {
        detached_.erase(handle);
        throw;
      }
      unmap_locked(addr, size);
      spare_.resize(spare_.size() - handle->second.size());  // unmap_locked freed them: they stay the handle's
    } catch (const std::bad_alloc&) {
      // No room to keep it: released, as backend.h lets a failed detach be.
      unmap_locked(addr, size);
      used_ -= size;
      return false;
    }
    return true;
  }

  bool vmm_attach(uintptr_t addr, size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = detached_.find(size);
    if (it == detached_.end()) return false;
    const std::vector<size_t>& pages = it->second;
    for (size_t i = 0; i < pages.size(); ++i) {
      void* want = reinterpret_cast<void*>(addr + i * page_);
      void* got = mmap(want, page_, PROT_NONE, MAP_SHARED | MAP_FIXED, fd_, static_cast<off_t>(pages[i]));
      if (got != want) {
        // Put back what was mapped; the handle stays a spare (backend.h).
        for (size_t j = 0; j < i; ++j) {
          mmap(reinterpret_cast<void*>(addr + j * page_), page_, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
          page_of_.erase(addr + j * page_);
        }
        throw std::runtime_error("mmap of a moved page failed");
      }
      page_of_[addr + i * page_] = pages[i];
    }
    detached_.erase(it);
    return true;
  }

  void vmm_drop(size_t size) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = detached_.find(size);
    if (it == detached_.end()) throw std::logic_error("vmm_drop: no spare handle of that size");
    spare_.insert(spare_.end(), it->second.begin(), it->second.end());
    detached_.erase(it);
    used_ -= size;
  }

 private:
  bool fits(size_t size) const { return capacity_ == 0 || size <= capacity_ - used_; }

  // Puts the reservation back over [addr, addr+size) and keeps the pages.
  void unmap_locked(uintptr_t addr, size_t size) {
    for (size_t off = 0; off < size; off += page_) {
      auto it = page_of_.find(addr + off);
      if (it == page_of_.end()) continue;
      mmap(reinterpret_cast<void*>(addr + off), page_, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
      spare_.push_back(it->second);
      page_of_.erase(it);
    }
  }

  std::mutex mu_;
  size_t capacity_;
  size_t page_;
  size_t used_ = 0;
  int fd_ = -1;
  size_t file_size_ = 0;
  std::vector<size_t> spare_;                       // memfd offsets not mapped anywhere
  std::unordered_map<uintptr_t, size_t> page_of_;   // mapped address -> memfd offset
  std::multimap<size_t, std::vector<size_t>> detached_;  // spare handles: size -> their pages
  SimStreams streams_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(size_t capacity) {
  return std::make_unique<HostBackend>(capacity, kSegmentAlign);
}

}  // namespace pyalloc
