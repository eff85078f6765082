// A stand-in for a CUDA device, so the PyTorch hooks and the pool registry
// run in CI without a GPU: its pools are host memory (host_backend.cpp, with
// simulated streams) and its captures are whatever the test says. Its
// backend answers for captures exactly as the CUDA backend does over a
// driver that has relaxed capture mode. As a GPU's streams, its simulated
// streams are the device's: every pool of the device records its events on
// them, so a stream a test holds busy is busy for the graph pools too. A
// stream tagged with another device (streams.h: record_stream) is that
// device's: its events go to that device's simulated streams, as the CUDA
// backend records them in that device's context.
#include <map>
#include <memory>
#include <mutex>

#include "cuda_backend.h"
#include "ipc.h"
#include "streams.h"

namespace pyalloc {
namespace {

std::mutex fake_mu;
std::map<Stream, uint64_t>& fake_captures() {
  static auto* m = new std::map<Stream, uint64_t>();
  return *m;
}

CaptureState fake_probe(Stream s) {
  std::lock_guard<std::mutex> g(fake_mu);
  auto it = fake_captures().find(s);
  CaptureState st;
  if (it != fake_captures().end()) {
    st.capturing = true;
    st.id = it->second;
  }
  return st;
}

// Process-wide, as for CUDA devices (cuda_backend.h).
CaptureTracker& fake_tracker() {
  static CaptureTracker* tracker = new CaptureTracker(&fake_probe);
  return *tracker;
}

// Each fake device's simulated streams, by index, for the events of streams
// tagged with another device; the latest device made with that index.
std::map<int, std::weak_ptr<Backend>>& fake_streams() {
  static auto* m = new std::map<int, std::weak_ptr<Backend>>();
  return *m;
}

std::shared_ptr<Backend> streams_of(int device) {
  std::lock_guard<std::mutex> g(fake_mu);
  auto it = fake_streams().find(device);
  return it != fake_streams().end() ? it->second.lock() : nullptr;
}

// An event recorded on another device's streams: that device + 1 in the
// EventId's top byte (an own device's EventIds are small indices).
constexpr int kEventDeviceShift = 56;
constexpr EventId kEventMask = (EventId{1} << kEventDeviceShift) - 1;

class FakeBackend final : public Backend {
 public:
  // streams: the device's backend whose simulated streams every pool's events go to.
  FakeBackend(std::unique_ptr<Backend> host, std::shared_ptr<Backend> streams, CaptureTracker& captures)
      : host_(std::move(host)), streams_(std::move(streams)), captures_(captures) {}

  const char* name() const override { return "fake-cuda"; }
  // Like the CUDA backend over a driver with relaxed capture mode, it may
  // grow during a capture.
  uintptr_t reserve(size_t size) override { return host_->reserve(size); }
  bool grows_while_capturing() override { return true; }
  void release(uintptr_t base, size_t size) override { host_->release(base, size); }
  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    host_->mem_info(free_bytes, total_bytes);
  }
  EventId record_event(Stream s) override {
    int device = streams::device_of(s);
    std::shared_ptr<Backend> other = device >= 0 ? streams_of(device) : nullptr;
    // A device no pool was made on has no work a test queued: any event is done.
    if (other == nullptr) return streams_->record_event(s);
    EventId e = other->record_event(streams::without_device(s));
    return e | (static_cast<EventId>(device + 1) << kEventDeviceShift);
  }
  bool event_done(EventId e) override {
    if (captures_.underway()) return false;
    std::shared_ptr<Backend> b = streams_for(e);
    return b == nullptr || b->event_done(e & kEventMask);
  }
  bool event_wait(EventId e) override {
    if (captures_.underway()) return false;
    std::shared_ptr<Backend> b = streams_for(e);
    return b == nullptr || b->event_wait(e & kEventMask);
  }
  void event_free(EventId e) override {
    if (std::shared_ptr<Backend> b = streams_for(e)) b->event_free(e & kEventMask);
  }
  bool is_capturing(Stream s) override { return captures_.blocks(s); }
  bool capture_underway() override { return captures_.underway(); }
  SimStreams* sim_streams() override { return streams_->sim_streams(); }
  // A token that a simulated receiver in this process opens (ipc.h).
  bool share_segment(uintptr_t base, size_t size, SharedMemory* out, std::string*) override {
    *out = SharedMemory{base, size, ipc::fake_token(base), -1};
    return true;
  }
  // No virtual memory (vmm_page_size() is 0): never called; passed on all the same.
  bool vmm_access(uintptr_t addr, size_t size) override { return host_->vmm_access(addr, size); }

 private:
  // The streams event e was recorded on: this device's, or another's (its
  // tag); null if that device is gone, and its work with it.
  std::shared_ptr<Backend> streams_for(EventId e) const {
    int device = static_cast<int>(e >> kEventDeviceShift) - 1;
    return device < 0 ? streams_ : streams_of(device);
  }

  std::unique_ptr<Backend> host_;
  std::shared_ptr<Backend> streams_;
  CaptureTracker& captures_;
};

class FakeDevice final : public Device {
 public:
  FakeDevice(int index, size_t capacity)
      : index_(index), capacity_(capacity), captures_(fake_tracker()) {
    std::lock_guard<std::mutex> g(fake_mu);
    fake_streams()[index] = streams_;
  }

  int index() const override { return index_; }
  std::unique_ptr<Backend> make_backend() override {
    return std::make_unique<FakeBackend>(make_host_backend(capacity_), streams_, captures_);
  }
  CaptureTracker& captures() override { return captures_; }
  void mem_info(size_t* free_bytes, size_t* total_bytes) override {
    *free_bytes = *total_bytes = capacity_;
  }
  size_t total_bytes() override { return capacity_; }
  int dlpack_device_type() const override { return 1; }  // kDLCPU: host memory

 private:
  int index_;
  size_t capacity_;
  // A backend of no memory, for its simulated streams alone: shared with
  // every backend made (a pool may outlive the device's entry).
  std::shared_ptr<Backend> streams_ = make_host_backend(0);
  CaptureTracker& captures_;
};

}  // namespace

std::unique_ptr<Device> open_fake_device(int index, size_t capacity) {
  return std::make_unique<FakeDevice>(index, capacity);
}

void set_fake_capture(Stream stream, uint64_t id) {
  std::lock_guard<std::mutex> g(fake_mu);
  if (id == 0) fake_captures().erase(stream);
  else fake_captures()[stream] = id;
}

}  // namespace pyalloc
