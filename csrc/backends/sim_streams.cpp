// Simulated streams and events: see sim_streams.h for the model.
#include "sim_streams.h"

namespace pyalloc {

EventId SimStreams::record(Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  StreamClock& c = clocks_[s];
  c.recorded++;
  if (!c.busy) c.completed = c.recorded;
  EventId id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = events_.size();
    events_.emplace_back();
  }
  events_[id] = Event{s, c.recorded, true};
  live_++;
  return id;
}

bool SimStreams::done(EventId e) {
  std::lock_guard<std::mutex> g(mu_);
  const Event& ev = events_.at(e);
  return clocks_[ev.stream].completed >= ev.seq;
}

bool SimStreams::wait(EventId e) {
  std::lock_guard<std::mutex> g(mu_);
  const Event& ev = events_.at(e);
  StreamClock& c = clocks_[ev.stream];
  if (c.completed >= ev.seq) return true;
  if (c.failed) return false;
  c.completed = ev.seq;
  return true;
}

void SimStreams::release(EventId e) {
  std::lock_guard<std::mutex> g(mu_);
  Event& ev = events_.at(e);
  if (!ev.live) return;
  ev.live = false;
  free_ids_.push_back(e);
  live_--;
}

void SimStreams::set_busy(Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  clocks_[s].busy = true;
}

void SimStreams::fail(Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  StreamClock& c = clocks_[s];
  c.busy = true;
  c.failed = true;
}

void SimStreams::complete(Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  StreamClock& c = clocks_[s];
  c.completed = c.recorded;
  c.busy = false;
  c.failed = false;
}

size_t SimStreams::live_events() {
  std::lock_guard<std::mutex> g(mu_);
  return live_;
}

}  // namespace pyalloc
