// pyalloc's own out-of-memory observers: see oom_observers.h.
#include "oom_observers.h"

#include <cxxabi.h>

#include <cstdio>
#include <exception>
#include <mutex>

namespace pyalloc {
namespace {

struct Observers {
  std::mutex mu;
  uint64_t next_id = 1;
  std::vector<std::pair<uint64_t, std::shared_ptr<const OomObserver>>> list;
};

// Never destroyed: a thread may run out of memory while the process exits,
// and the Python binding drops its observers itself, with the GIL.
Observers& observers() {
  static Observers* o = new Observers();
  return *o;
}

thread_local bool inside_observer = false;

// Marks this thread as inside an observer while it lives, whatever leaves it.
struct InsideObserver {
  InsideObserver() { inside_observer = true; }
  ~InsideObserver() { inside_observer = false; }
};

}  // namespace

uint64_t attach_oom_observer(OomObserver fn) {
  auto shared = std::make_shared<const OomObserver>(std::move(fn));
  Observers& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  uint64_t id = o.next_id++;
  o.list.emplace_back(id, std::move(shared));
  return id;
}

bool detach_oom_observer(uint64_t id) {
  std::shared_ptr<const OomObserver> dropped;  // released once the lock is: its owner may take locks of its own
  Observers& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  for (auto it = o.list.begin(); it != o.list.end(); ++it) {
    if (it->first != id) continue;
    dropped = std::move(it->second);
    o.list.erase(it);
    return true;
  }
  return false;
}

void detach_all_oom_observers() {
  std::vector<std::pair<uint64_t, std::shared_ptr<const OomObserver>>> dropped;
  Observers& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  dropped.swap(o.list);
}

std::vector<std::pair<uint64_t, std::shared_ptr<const OomObserver>>> oom_observers() {
  Observers& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  return o.list;
}

void tell_oom_observers(const OomReport& report) {
  if (inside_observer) return;
  InsideObserver inside;
  for (const auto& [id, fn] : oom_observers()) {
    try {
      (*fn)(report);
    } catch (abi::__forced_unwind&) {
      throw;  // a thread ended where it stands (Python ends its threads so at exit): let it go
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pyalloc: out-of-memory observer %llu failed: %s\n",
                   static_cast<unsigned long long>(id), e.what());
    } catch (...) {
      std::fprintf(stderr, "pyalloc: out-of-memory observer %llu failed\n", static_cast<unsigned long long>(id));
    }
  }
}

void raise_observed(const OutOfMemoryError& e, const OomReport& report) {
  if (const auto* told = dynamic_cast<const DeviceOutOfMemoryError*>(&e)) throw *told;
  tell_oom_observers(report);
  throw DeviceOutOfMemoryError(e.what(), report);
}

OomReport report_of(const OutOfMemoryError& e, int device, size_t requested) {
  if (const auto* told = dynamic_cast<const DeviceOutOfMemoryError*>(&e)) return told->report();
  OomReport r;
  r.device = device;
  r.requested = requested;
  r.rejected = e.rejected();
  return r;
}

}  // namespace pyalloc
