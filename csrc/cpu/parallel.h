// Row-parallel loop over [0, n) with plain std::threads (no OpenMP runtime to clash with torch's).
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace tqvec {

// Rows below this count per thread are not worth a thread start (~20 us).
constexpr int64_t kMinRowsPerThread = 512;

// Runs fn(w) for the workers w = 0 .. t-1, w = 0 on the calling thread.
template <class F>
void run_workers(int64_t t, F&& fn) {
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(std::max<int64_t>(0, t - 1)));
  for (int64_t w = 1; w < t; ++w) pool.emplace_back([&fn, w] { fn(w); });
  fn(int64_t{0});
  for (auto& th : pool) th.join();
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
  int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, n / per));
  if (t <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t - 1));
  int64_t chunk = (n + t - 1) / t;
  for (int64_t i = 1; i < t; ++i) {
    int64_t lo = i * chunk, hi = std::min(n, lo + chunk);
    if (lo < hi) pool.emplace_back([&fn, lo, hi] { fn(lo, hi); });
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

}  // namespace tqvec
