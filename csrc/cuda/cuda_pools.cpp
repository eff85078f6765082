// The pools of each CUDA device and the logic behind PyTorch's hooks: see cuda_pools.h.
#include "cuda_pools.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace pyalloc {

// ---------------------------------------------------------------------------
// DevicePools

namespace {

// The buffer pool grows by exactly what a buffer needs (in the core's 2 MiB
// segment unit) and splits off every remainder worth a block, so that each
// buffer costs what it holds and the rest of its segment serves the next.
Config buffer_config() {
  Config b;
  b.segment_size = kSegmentAlign;
  b.small_size = kGranularity;
  return b;
}

}  // namespace

DevicePools::DevicePools(std::unique_ptr<Device> device, const Config& config)
    : device_(std::move(device)), config_(config) {
  general_ = std::make_unique<Allocator>(device_->make_backend(), config_);
  buffers_ = std::make_unique<Allocator>(device_->make_backend(), buffer_config());
  // Asked for vmm, got bestfit (no virtual memory, or the driver refused it):
  // said once per process; reports name the strategy in use (general()).
  static std::atomic<bool> told{false};
  if (config_.strategy == Strategy::kVmm && general_->config().strategy != Strategy::kVmm &&
      !told.exchange(true)) {
    std::string why = device_->vmm_unavailable();
    std::fprintf(stderr,
                 "pyalloc: device %d cannot use strategy vmm (%s); its pools use strategy "
                 "bestfit\n",
                 index(), why.empty() ? "the trial mapping failed" : why.c_str());
  }
}

uintptr_t DevicePools::malloc(size_t size, Stream stream) {
  if (size == 0) return 0;
  CaptureState cap = device_->captures().probe(stream);
  if (cap.capturing) return capture_malloc(size, stream, cap.id);
  try {
    return general_->malloc(size, stream);
  } catch (const OutOfMemoryError& e) {
    throw_oom(*general_, "general", size, e.what(), device_->captures().underway());
  }
}

bool DevicePools::free(uintptr_t ptr, std::string* why) {
  if (capture_free(ptr)) return true;
  try {
    general_->free(ptr);
    return true;
  } catch (const InvalidPointerError& e) {
    *why = e.what();
    return false;
  }
}

bool DevicePools::record_stream(uintptr_t ptr, Stream stream) {
  uintptr_t base;
  size_t size;
  // Look before calling, so that a pointer of another pool costs no exception.
  for (Allocator* pool : {general_.get(), buffers_.get()}) {
    if (!pool->segment_of(ptr, &base, &size)) continue;
    if (pool == general_.get()) capture_record_stream(ptr);
    try {
      pool->record_stream(ptr, stream);
      return true;
    } catch (const InvalidPointerError&) {
      return false;
    }
  }
  return false;
}

bool DevicePools::segment_of(uintptr_t ptr, uintptr_t* base, size_t* size) const {
  return general_->segment_of(ptr, base, size) || buffers_->segment_of(ptr, base, size);
}

uintptr_t DevicePools::malloc_buffer(size_t size, Stream stream) {
  try {
    return buffers_->malloc(size, stream);
  } catch (const OutOfMemoryError& e) {
    throw_oom(*buffers_, "buffer", size, e.what(), device_->captures().underway());
  }
}

void DevicePools::free_buffer(uintptr_t ptr) { buffers_->free(ptr); }

size_t DevicePools::empty_cache() {
  if (device_->captures().underway()) return 0;
  size_t released = general_->empty_cache() + buffers_->empty_cache();
  // pool_size is a floor: torch.cuda.graph() empties the cache right before
  // it captures, and a capture can only use memory already reserved.
  size_t restored = 0;
  size_t reserved = static_cast<size_t>(general_->stats().reserved_bytes.all.current);
  if (reserved < config_.pool_size) {
    try {
      restored = general_->reserve(config_.pool_size - reserved);
    } catch (const std::exception&) {
      // Best effort: the memory may have gone to another process meanwhile.
    }
  }
  return released > restored ? released - restored : 0;
}

void DevicePools::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw std::invalid_argument("memory fraction must be between 0 and 1, got " +
                                std::to_string(fraction));
  size_t free_bytes = 0, total = 0;
  device_->mem_info(&free_bytes, &total);
  if (total == 0)
    throw std::runtime_error("cannot apply a memory fraction to device " + std::to_string(index()) +
                             ": its total memory is unknown (a CUDA graph capture is underway?)");
  double limit = fraction * static_cast<double>(total);
  // 0 would mean "no cap" to the core; 1 byte lets nothing more be reserved.
  size_t cap = limit < 1.0 ? 1 : static_cast<size_t>(limit);
  if (config_.max_pool_size != 0 && config_.max_pool_size < cap) cap = config_.max_pool_size;
  general_->set_max_pool_size(cap);
}

// ---------------------------------------------------------------------------
// CUDA graphs

uintptr_t DevicePools::capture_malloc(size_t size, Stream stream, uint64_t capture) {
  size_t rounded = round_up(size, kGranularity);
  if (capture != 0) {
    std::lock_guard<std::mutex> g(graph_mu_);
    auto it = graph_idle_.find(GraphKey{capture, stream, rounded});
    if (it != graph_idle_.end()) {
      uintptr_t ptr = it->second;
      graph_idle_.erase(it);
      graph_live_.emplace(ptr, GraphBlock{capture, stream, rounded});
      return ptr;
    }
  }
  uintptr_t ptr;
  try {
    ptr = general_->malloc(size, stream);
  } catch (const OutOfMemoryError& e) {
    throw_oom(*general_, "general", size, e.what(), true);
  }
  std::lock_guard<std::mutex> g(graph_mu_);
  graph_live_.emplace(ptr, GraphBlock{capture, stream, rounded});
  graph_bytes_ += rounded;
  graph_any_.store(true, std::memory_order_release);
  return ptr;
}

bool DevicePools::capture_free(uintptr_t ptr) {
  if (!graph_any_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> g(graph_mu_);
  auto it = graph_live_.find(ptr);
  if (it == graph_live_.end()) return false;
  const GraphBlock& b = it->second;
  graph_idle_.emplace(GraphKey{b.capture, b.stream, b.size}, ptr);
  graph_live_.erase(it);
  return true;
}

void DevicePools::capture_record_stream(uintptr_t ptr) {
  if (!graph_any_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> g(graph_mu_);
  auto it = graph_live_.find(ptr);
  // Another stream uses it: reuse on the capture stream alone is no longer ordered.
  if (it != graph_live_.end()) it->second.capture = 0;
}

std::pair<size_t, size_t> DevicePools::graph_memory() const {
  std::lock_guard<std::mutex> g(graph_mu_);
  return {graph_live_.size() + graph_idle_.size(), graph_bytes_};
}

size_t DevicePools::release_graph_memory() {
  std::vector<uintptr_t> idle;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> g(graph_mu_);
    for (const auto& [key, ptr] : graph_idle_) {
      idle.push_back(ptr);
      bytes += std::get<2>(key);
    }
    graph_idle_.clear();
    // Blocks PyTorch still holds become ordinary: freed later, they go back at once.
    graph_live_.clear();
    graph_bytes_ = 0;
    graph_any_.store(false, std::memory_order_release);
  }
  for (uintptr_t p : idle) general_->free(p);
  return bytes;
}

// ---------------------------------------------------------------------------
// Errors

void DevicePools::throw_oom(Allocator& pool, const char* which, size_t size,
                            const std::string& why, bool capturing) {
  Stats st = pool.stats();
  FragmentationInfo f = pool.fragmentation();
  size_t dev_free = 0, dev_total = 0;
  device_->mem_info(&dev_free, &dev_total);
  int d = index();
  std::ostringstream m;
  // The first words are what batch-size finders (accelerate, Lightning) look for.
  m << "CUDA out of memory. Tried to allocate " << format_bytes(size) << " on device " << d
    << " (pyalloc " << which << " pool). ";
  if (dev_total != 0)
    m << "GPU " << d << " has a total capacity of " << format_bytes(dev_total) << " of which "
      << format_bytes(dev_free) << " is free. ";
  m << "pyalloc has " << format_bytes(static_cast<size_t>(st.allocated_bytes.all.current))
    << " allocated and " << format_bytes(static_cast<size_t>(st.reserved_bytes.all.current))
    << " reserved in this pool; " << format_bytes(f.free_bytes)
    << " of the reserved memory is free, the largest free block is "
    << format_bytes(f.largest_free_block) << ". ";
  if (capturing)
    m << "A CUDA graph capture is underway, and captures are served only from memory already "
         "reserved; torch.cuda.graph() empties the cache before it captures, so keep memory "
         "reserved with the pool_size setting (pyalloc.install(pool_size=...) or "
         "PYALLOC_CONF=pool_size:...). ";
  m << "Details: " << why;
  throw OutOfMemoryError(m.str());
}

// ---------------------------------------------------------------------------
// PoolRegistry

PoolRegistry::PoolRegistry() = default;

PoolRegistry& PoolRegistry::instance() {
  // Never destroyed: PyTorch frees tensors during interpreter shutdown.
  static PoolRegistry* r = new PoolRegistry();
  return *r;
}

void PoolRegistry::configure(const std::string& text) {
  Config c = parse_config(text);
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& slot : pools_) {
    if (slot.load() != nullptr && c.to_string() != config_.to_string())
      throw std::runtime_error(
          "pyalloc's CUDA pools already exist with the settings '" + config_.to_string() +
          "'; they cannot change to '" + c.to_string() + "' once memory has been allocated");
  }
  config_ = c;
  configured_ = true;
}

Config PoolRegistry::config_locked() {
  if (!configured_) {
    const char* env = std::getenv("PYALLOC_CONF");
    try {
      config_ = parse_config(env != nullptr ? env : "");
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("PYALLOC_CONF: ") + e.what());
    }
    configured_ = true;
  }
  return config_;
}

Config PoolRegistry::config() {
  std::lock_guard<std::mutex> g(mu_);
  return config_locked();
}

DevicePools& PoolRegistry::get(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::invalid_argument("invalid CUDA device index " + std::to_string(device));
  DevicePools* p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  std::lock_guard<std::mutex> g(mu_);
  p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Config c = config_locked();
  std::unique_ptr<Device> dev = fake_ ? open_fake_device(device, fake_capacity_) : open_cuda_device(device);
  auto pools = std::make_unique<DevicePools>(std::move(dev), c);
  if (history_) {
    pools->general().record_history(true, history_max_);
    pools->buffers().record_history(true, history_max_);
  }
  p = pools.release();
  pools_[device].store(p, std::memory_order_release);
  return *p;
}

DevicePools* PoolRegistry::find(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return pools_[device].load(std::memory_order_acquire);
}

std::vector<DevicePools*> PoolRegistry::all() const {
  std::vector<DevicePools*> out;
  for (const auto& slot : pools_)
    if (DevicePools* p = slot.load(std::memory_order_acquire)) out.push_back(p);
  return out;
}

void PoolRegistry::record_history(bool enabled, size_t max_entries) {
  std::lock_guard<std::mutex> g(mu_);
  history_ = enabled && max_entries > 0;
  history_max_ = history_ ? max_entries : 0;
  for (const auto& slot : pools_) {
    if (DevicePools* p = slot.load()) {
      p->general().record_history(history_, history_max_);
      p->buffers().record_history(history_, history_max_);
    }
  }
}

void PoolRegistry::use_fake_devices(size_t capacity) {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& slot : pools_)
    if (slot.load() != nullptr && !fake_)
      throw std::runtime_error("fake devices are for tests: CUDA pools already exist");
  fake_ = true;
  fake_capacity_ = capacity;
}

void PoolRegistry::reset_fake() {
  std::lock_guard<std::mutex> g(mu_);
  if (!fake_) throw std::runtime_error("only fake pools can be dropped");
  for (auto& slot : pools_) delete slot.exchange(nullptr);
  configured_ = false;
  config_ = Config();
  history_ = false;
  history_max_ = 0;
  installed_ = false;
  device_count_ = -1;
  fake_ = false;
  fake_capacity_ = 0;
}

// ---------------------------------------------------------------------------
// Hooks

namespace hooks {
namespace {

void report_bad_free(uintptr_t ptr, const std::string& why) {
  // Called from PyTorch's deleters, where nothing may be thrown.
  std::fprintf(stderr, "pyalloc: ignoring a free from PyTorch: %s\n",
               why.empty() ? format_ptr(ptr).c_str() : why.c_str());
}

}  // namespace

uintptr_t malloc(size_t size, int device, Stream stream) {
  // PyTorch may ask for 0 bytes; like its own allocator, answer nullptr.
  if (size == 0) return 0;
  DevicePools* pools;
  try {
    pools = &PoolRegistry::instance().get(device);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError("CUDA out of memory. pyalloc could not create its pool on device " +
                           std::to_string(device) + ": " + e.what());
  }
  // A failed event left memory out of use: say so where the user sees it.
  std::string error = pools->device().take_error();
  if (!error.empty()) throw std::runtime_error(error);
  return pools->malloc(size, stream);
}

void free(uintptr_t ptr, int device) noexcept {
  if (ptr == 0) return;
  try {
    PoolRegistry& r = PoolRegistry::instance();
    std::string why;
    DevicePools* hinted = r.find(device);
    if (hinted != nullptr && hinted->free(ptr, &why)) return;
    // The device PyTorch passed is a hint: the pointer's owner decides.
    uintptr_t base;
    size_t size;
    for (DevicePools* p : r.all()) {
      if (!p->segment_of(ptr, &base, &size)) continue;
      if (p != hinted && p->free(ptr, &why)) return;
      report_bad_free(ptr, why);
      return;
    }
    report_bad_free(ptr, "free(" + format_ptr(ptr) + "): not a pointer from pyalloc's pools");
  } catch (const std::exception& e) {
    report_bad_free(ptr, e.what());
  }
}

void record_stream(uintptr_t ptr, Stream stream) {
  if (ptr == 0) return;
  // PyTorch passes every tensor here, its foreign ones (from_blob, DLPack) too.
  for (DevicePools* p : PoolRegistry::instance().all())
    if (p->record_stream(ptr, stream)) return;
}

uintptr_t base_alloc(uintptr_t ptr, size_t* size) noexcept {
  uintptr_t base;
  size_t bytes;
  for (DevicePools* p : PoolRegistry::instance().all()) {
    if (p->segment_of(ptr, &base, &bytes)) {
      if (size != nullptr) *size = bytes;
      return base;
    }
  }
  return ptr;  // PyTorch's answer when no hook is set
}

void empty_cache() {
  for (DevicePools* p : PoolRegistry::instance().all()) p->empty_cache();
}

void set_memory_fraction(double fraction, int device) {
  PoolRegistry::instance().get(device).set_memory_fraction(fraction);
}

void init(int device_count) noexcept { PoolRegistry::instance().set_device_count(device_count); }

}  // namespace hooks
}  // namespace pyalloc
