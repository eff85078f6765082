// The process's pools and the logic behind PyTorch's hooks: see registry.h.
#include "registry.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "oom_observers.h"

namespace pyalloc {

// ---------------------------------------------------------------------------
// PoolRegistry

PoolRegistry::PoolRegistry() = default;

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

DevicePools& PoolRegistry::make(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::invalid_argument("invalid CUDA device index " + std::to_string(device));
  std::lock_guard<std::mutex> g(mu_);
  DevicePools* p = pools_[device].load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Config c = config_locked();
  std::unique_ptr<Device> dev = fake_ ? open_fake_device(device, fake_capacity_) : open_cuda_device(device);
  auto pools = std::make_unique<DevicePools>(std::move(dev), c, *this);
  if (history_) pools->record_history(true, history_max_);
  p = pools.release();
  pools_[device].store(p, std::memory_order_release);
  only_.store(only_.load() == nullptr ? p : reinterpret_cast<DevicePools*>(kSeveral),
              std::memory_order_release);
  return *p;
}

void PoolRegistry::wait_for_pools_being_made() { std::lock_guard<std::mutex> g(mu_); }

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
  for (const auto& slot : pools_)
    if (DevicePools* p = slot.load()) p->record_history(history_, history_max_);
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
  drop_fake_pools();
  // A test's observers end with its fake devices; dropped with no lock held,
  // as dropping one may run its owner's code (a Python callable's last reference).
  detach_all_oom_observers();
}

void PoolRegistry::drop_fake_pools() {
  std::lock_guard<std::mutex> g(mu_);
  if (!fake_) throw std::runtime_error("only fake pools can be dropped");
  only_.store(nullptr);
  for (auto& slot : pools_) delete slot.exchange(nullptr);
  configured_ = false;
  config_ = Config();
  history_ = false;
  history_max_ = 0;
  route_ = kNotInstalled;
  told_of_captures_ = false;
  captures_marked_ = false;
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

// The device's pools, made on a request of `size` bytes. Apart from
// malloc(), whose common case (pools made, no error) is then a few
// instructions. Failing to make them (pool_size does not fit) is an
// out-of-memory error of the request, told to the observers as any other.
[[gnu::noinline]] DevicePools& first_pools(int device, size_t size) {
  try {
    return PoolRegistry::instance().get(device);
  } catch (const OutOfMemoryError& e) {
    OutOfMemoryError error("CUDA out of memory. pyalloc could not create its pool on device " +
                           std::to_string(device) + ": " + e.what());
    raise_observed(error, report_of(error, device, size));
  }
}

// An out-of-memory error of the device's pools, once no lock of theirs is
// held: its observers are told (oom_observers.h), then the caller gets it.
[[noreturn, gnu::noinline]] void raise_told(DevicePools& pools, size_t size, const OutOfMemoryError& e) {
  raise_observed(e, pools.oom_report(size, e.rejected()));
}

[[gnu::noinline]] void raise_device_error(DevicePools& pools) {
  if (std::string error = pools.device().take_error(); !error.empty()) throw std::runtime_error(error);
}

// free_checked() of a pointer the hinted device's pools do not hold live.
[[gnu::noinline]] bool free_elsewhere(uintptr_t ptr, DevicePools* hinted, uint64_t context, std::string* why) {
  // The device is a hint: the pointer's owner decides. Only the devices
  // whose address range holds it are asked (may_hold() takes no lock).
  PoolRegistry& r = PoolRegistry::instance();
  uintptr_t base;
  size_t size;
  std::string owner_why;
  for (DevicePools* p : r.all()) {
    if (p == hinted || !p->may_hold(ptr)) continue;
    std::string w;
    if (p->free(ptr, &w, context)) return true;
    // Its memory, but no live block there: its answer (a double free, say).
    if (owner_why.empty() && p->segment_of(ptr, &base, &size)) owner_why = w;
  }
  if (!owner_why.empty()) {
    *why = owner_why;
    return false;
  }
  // The hinted device's own answer (a double free, say) if the pointer is in its memory.
  if (hinted == nullptr || !hinted->segment_of(ptr, &base, &size) || why->empty())
    *why = "free(" + format_ptr(ptr) + "): not a pointer from pyalloc's pools";
  return false;
}

}  // namespace

uintptr_t malloc(size_t size, int device, Stream stream, uint64_t context) {
  // PyTorch may ask for 0 bytes; like its own allocator, answer nullptr.
  // Said to be rare: sharing its return with the common case would cost the
  // common case two moves around the call the catch below keeps from being a jump.
  if (__builtin_expect(size == 0, 0)) return 0;
  DevicePools* pools = PoolRegistry::instance().find(device);
  if (pools == nullptr) pools = &first_pools(device, size);
  // A failed event left memory out of use: say so where the user sees it.
  if (pools->device().has_error()) raise_device_error(*pools);
  try {
    return pools->malloc(size, stream, context);
  } catch (const OutOfMemoryError& e) {
    raise_told(*pools, size, e);
  }
}

uintptr_t malloc_buffer(size_t size, int device, Stream stream) {
  DevicePools* pools = PoolRegistry::instance().find(device);
  if (pools == nullptr) pools = &first_pools(device, size);
  try {
    return pools->malloc_buffer(size, stream);
  } catch (const OutOfMemoryError& e) {
    raise_told(*pools, size, e);
  }
}

bool free_checked(uintptr_t ptr, int device, uint64_t context, std::string* why) {
  if (ptr == 0) return true;
  PoolRegistry& r = PoolRegistry::instance();
  DevicePools* hinted = r.find(device);
  if (hinted == nullptr && device < 0) hinted = r.only();  // one device: no search
  if (hinted != nullptr && hinted->free(ptr, why, context)) return true;
  return free_elsewhere(ptr, hinted, context, why);
}

void free(uintptr_t ptr, int device) noexcept {
  try {
    std::string why;
    if (!free_checked(ptr, device, 0, &why)) report_bad_free(ptr, why);
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
    if (p->base_allocation(ptr, &base, &bytes)) {
      if (size != nullptr) *size = bytes;
      return base;
    }
  }
  return ptr;  // PyTorch's answer when no hook is set
}

void empty_cache() {
  // A route left open on one device blocks every device: heal them all first.
  for (DevicePools* p : PoolRegistry::instance().all()) p->heal_routes();
  for (DevicePools* p : PoolRegistry::instance().all()) p->empty_cache();
}

void set_memory_fraction(double fraction, int device) {
  PoolRegistry::instance().get(device).set_memory_fraction(fraction);
}

void init(int device_count) noexcept { PoolRegistry::instance().set_device_count(device_count); }

namespace {
// A capture is declared underway (capture.h) from here on; PyTorch begins it
// once the call returns. An operation of another thread that decided before
// the declaration that it may touch the device (release memory, query an
// event) may still be doing so: wait for every pool of every device to
// finish what it is doing, since CUDA's global capture mode forbids those
// calls from any thread while any stream of the process is capturing.
void wait_for_operations_under_way() {
  PoolRegistry::instance().wait_for_pools_being_made();
  for (DevicePools* p : PoolRegistry::instance().all()) p->quiesce();
}
}  // namespace

void begin_allocate_to_pool(int device, DevicePools::PoolId id, DevicePools::StreamFilter filter) {
  PoolRegistry::instance().get(device).begin_allocate_to_pool(id, std::move(filter));
  wait_for_operations_under_way();
}

void end_allocate_to_pool(int device, DevicePools::PoolId id) noexcept {
  try {
    if (DevicePools* p = PoolRegistry::instance().find(device)) p->end_allocate_to_pool(id);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pyalloc: ending allocations to a graph pool failed: %s\n", e.what());
  }
}

void release_pool(int device, DevicePools::PoolId id) noexcept {
  try {
    if (DevicePools* p = PoolRegistry::instance().find(device)) p->release_pool(id);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pyalloc: releasing a graph pool failed: %s\n", e.what());
  }
}

void mark_capture(int device, bool begin) {
  // A begin creates the device's pools, so that its end finds them.
  if (begin) {
    PoolRegistry::instance().get(device).mark_capture(true);
    wait_for_operations_under_way();
  } else if (DevicePools* p = PoolRegistry::instance().find(device)) p->mark_capture(false);
}

}  // namespace hooks
}  // namespace pyalloc
