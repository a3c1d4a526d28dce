// Row-parallel loops over [0, n) on a pool of parked std::threads (no OpenMP runtime to clash
// with torch's). Starting a thread costs as much as a whole single-query scan of a few thousand
// rows (docs/kernel-costs.md), so the workers are started once and reused.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace tqvec {

// Rows below this count per thread are not worth a second worker (waking one, sharing the
// output cache lines).
constexpr int64_t kMinRowsPerThread = 512;

namespace pool {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The caller's fn, by reference: it lives on the caller's stack until every worker is done.
struct Task {
  void* ctx = nullptr;
  void (*call)(void*, int64_t) = nullptr;
};

// Workers 1 .. size() wait for a run; a run publishes (generation, thread count) in one atomic
// word so that a worker late to one run cannot mistake the next run's count for its own. After
// a run the workers spin for kSpin before they sleep: back-to-back calls (one query after
// another) then start without a futex wake.
class Workers {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(100);

  // The process's pool. After fork() the child has none of the parent's threads: it starts a
  // pool of its own (the parent's object is left alone; its locks may be held).
  static Workers& get() {
    static std::atomic<Workers*> inst{nullptr};
    static std::mutex make;
    Workers* w = inst.load(std::memory_order_acquire);
    if (w && w->pid_ == getpid()) return *w;
    std::lock_guard<std::mutex> lk(make);
    w = inst.load(std::memory_order_acquire);
    if (!w || w->pid_ != getpid()) {
      w = new Workers();  // kept for the process's life: workers park forever, exit ends them
      inst.store(w, std::memory_order_release);
    }
    return *w;
  }

  // Runs task(w) for w = 0 .. t-1, w = 0 on the calling thread. false (nothing run) when the
  // pool is in use: a nested call from a worker, or another thread's concurrent search. An
  // exception thrown by any worker is rethrown here once all of them are done (the caller's
  // own first).
  bool run(int64_t t, Task task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || t > kMaxThreads) return false;
    const uint64_t prev = state_.load(std::memory_order_relaxed);
    while (static_cast<int64_t>(threads_.size()) < t - 1) {
      // a new worker starts from the state before this run, so it takes part in it
      const int64_t w = static_cast<int64_t>(threads_.size()) + 1;
      threads_.emplace_back([this, w, prev] { loop(w, prev); });
    }
    task_ = task;
    worker_err_ = nullptr;
    pending_.store(t - 1, std::memory_order_relaxed);
    const uint64_t next = ((prev >> 16) + 1) << 16;
    {
      std::lock_guard<std::mutex> lk(m_);
      state_.store(next | static_cast<uint64_t>(t), std::memory_order_release);
    }
    wake_.notify_all();
    std::exception_ptr err;
    try {
      task.call(task.ctx, 0);
    } catch (...) {
      err = std::current_exception();  // the workers still use the caller's frame: wait first
    }
    wait_done();
    if (!err) {
      std::lock_guard<std::mutex> lk(err_m_);
      err = std::exchange(worker_err_, nullptr);
    }
    if (err) std::rethrow_exception(err);
    return true;
  }

 private:
  static constexpr int64_t kMaxThreads = 0xffff;

  Workers() : pid_(getpid()) {}

  void wait_done() {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (pending_.load(std::memory_order_acquire) != 0) {
      if (std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lk(m_);
        done_.wait(lk, [&] { return pending_.load(std::memory_order_acquire) == 0; });
        return;
      }
      for (int i = 0; i < 32; ++i) cpu_relax();
    }
  }

  void loop(int64_t w, uint64_t seen) {
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (s == seen && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 32; ++i) cpu_relax();
        s = state_.load(std::memory_order_acquire);
      }
      if (s == seen) {
        std::unique_lock<std::mutex> lk(m_);
        wake_.wait(lk, [&] { return (s = state_.load(std::memory_order_acquire)) != seen; });
      }
      seen = s;
      if (w >= static_cast<int64_t>(s & 0xffff)) continue;  // not part of this run
      try {  // an exception leaving a thread's function would std::terminate the process
        task_.call(task_.ctx, w);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_m_);
        if (!worker_err_) worker_err_ = std::current_exception();
      }
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lk(m_);
        done_.notify_one();
      }
    }
  }

  const pid_t pid_;
  std::mutex busy_;  // held by the calling thread for a whole run
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> state_{0};  // generation << 16 | threads of the run
  std::atomic<int64_t> pending_{0};
  Task task_;
  std::mutex err_m_;
  std::exception_ptr worker_err_;  // the first exception a worker threw in this run
};

}  // namespace pool

// Runs fn(w) for the workers w = 0 .. t-1, w = 0 on the calling thread, on the pool's parked
// threads (fresh threads when the pool is in use: nested or concurrent calls).
template <class F>
void run_workers(int64_t t, F&& fn) {
  if (t <= 1) {
    fn(int64_t{0});
    return;
  }
  using Fn = std::remove_reference_t<F>;
  pool::Task task{const_cast<void*>(static_cast<const void*>(&fn)),
                  [](void* ctx, int64_t w) { (*static_cast<Fn*>(ctx))(w); }};
  if (pool::Workers::get().run(t, task)) return;
  std::vector<std::thread> extra;
  extra.reserve(static_cast<size_t>(t - 1));
  std::mutex err_m;
  std::exception_ptr err;
  auto guarded = [&](int64_t w) {
    try {
      fn(w);
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_m);
      if (!err) err = std::current_exception();
    }
  };
  for (int64_t w = 1; w < t; ++w) extra.emplace_back([&guarded, w] { guarded(w); });
  guarded(int64_t{0});
  for (auto& th : extra) th.join();
  if (err) std::rethrow_exception(err);
}

// Many queries (at least min_per_thread per thread): fn(lo, hi) for contiguous shares of
// [0, nq), one per thread, each to be run single-threaded; returns false (and runs nothing) for
// fewer, where the caller parallelizes inside one call instead.
template <class F>
bool split_queries(int64_t nq, int nthreads, int64_t min_per_thread, F&& fn) {
  if (nthreads <= 1 || nq < min_per_thread * int64_t{nthreads}) return false;
  const int64_t t = nthreads, chunk = (nq + t - 1) / t;
  run_workers(t, [&](int64_t w) {
    const int64_t lo = std::min(nq, w * chunk), hi = std::min(nq, lo + chunk);
    if (lo < hi) fn(lo, hi);
  });
  return true;
}

// min_rows: the rows per thread below which one thread does it all (kMinRowsPerThread suits
// rows of a few hundred bytes of work; pass fewer for heavier rows).
template <class F>
void parallel_rows(int64_t n, int nthreads, F&& fn, int64_t min_rows = kMinRowsPerThread) {
  const int64_t per = std::max<int64_t>(1, min_rows);
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, n / per));
  if (t <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + t - 1) / t;
  run_workers(t, [&](int64_t w) {
    const int64_t lo = std::min(n, w * chunk), hi = std::min(n, lo + chunk);
    if (lo < hi) fn(lo, hi);
  });
}

}  // namespace tqvec
