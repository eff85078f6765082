// Simulated streams and events for the backends that have no device (host,
// virtual), so that tests can hold a stream "busy" and watch the core wait.
//
// Model: each stream has a count of events recorded and a count completed.
// While a stream is idle its work is done at once, so an event recorded on it
// completes at once. set_busy(s) says work is queued on s: events recorded from
// then on stay pending until complete(s) finishes that work (and makes s idle).
// event_wait() stands for the host waiting on the stream, so it completes it,
// unless fail(s) said the stream's work failed: its pending events then never
// complete and cannot be waited for (as a CUDA event whose query failed), until
// complete(s).
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/backend.h"

namespace pyalloc {

class SimStreams {
 public:
  EventId record(Stream s);
  bool done(EventId e);
  /// False (nothing done) if the event's stream failed (fail()).
  bool wait(EventId e);
  void release(EventId e);

  /// Work is queued on `s`: events recorded from now on stay pending.
  void set_busy(Stream s);
  /// The work queued on `s` failed: events recorded from now on stay
  /// pending, and waiting for them fails, until complete(s).
  void fail(Stream s);
  /// The work queued on `s` finished: every event recorded so far is done.
  void complete(Stream s);
  /// Events recorded and not yet released (tests check they are recycled).
  size_t live_events();

 private:
  struct StreamClock {
    uint64_t recorded = 0;
    uint64_t completed = 0;
    bool busy = false;
    bool failed = false;
  };
  struct Event {
    Stream stream = 0;
    uint64_t seq = 0;
    bool live = false;
  };
  std::mutex mu_;
  std::unordered_map<Stream, StreamClock> clocks_;
  std::vector<Event> events_;
  std::vector<EventId> free_ids_;
  size_t live_ = 0;
};

}  // namespace pyalloc
