// The allocator's lock: a futex-backed mutex whose uncontended lock and
// unlock are one atomic instruction each, against about fifty instructions
// for pthread_mutex_lock/unlock, which the malloc+free hot path pays twice.
//
// States: 0 free, 1 held, 2 held with (possible) sleepers. A contended lock
// spins briefly, then sleeps in the kernel; unlock wakes one sleeper only if
// the state says there may be one. Meets BasicLockable (std::lock_guard).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

namespace pyalloc {

class Lock {
 public:
  void lock() {
    int expected = 0;
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire)) return;
    lock_slow();
  }

  void unlock() {
    if (state_.exchange(0, std::memory_order_release) == 2) wake_one();
  }

 private:
  void lock_slow() {
    // A short spin: the critical sections are tens of nanoseconds, and longer
    // spins measured slower with two threads on two cores (bench_core.py).
    for (int i = 0; i < 16; ++i) {
      int expected = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_weak(expected, 1, std::memory_order_acquire))
        return;
      __builtin_ia32_pause();
    }
    // Announce a sleeper; whoever unlocks will wake us.
    while (state_.exchange(2, std::memory_order_acquire) != 0)
      syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
  }

  void wake_one() {
    syscall(SYS_futex, reinterpret_cast<int*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  }

  std::atomic<int> state_{0};
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "futex needs a plain int");
};

}  // namespace pyalloc
