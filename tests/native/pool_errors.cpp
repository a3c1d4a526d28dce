// The worker pool (../../csrc/cpu/parallel.h) with a task that throws on a worker other than the
// calling thread: the exception must reach the caller (it once left the worker's thread function
// and ended the process in std::terminate). Prints one line per case.
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "../../csrc/cpu/parallel.h"

namespace {

void throw_on(int64_t w, int64_t bad) {
  if (w == bad) throw std::runtime_error("worker " + std::to_string(w));
}

void expect(const char* name, int64_t t, int64_t bad) {
  try {
    tqvec::run_workers(t, [&](int64_t w) { throw_on(w, bad); });
    std::printf("%s: no exception\n", name);
  } catch (const std::runtime_error& e) {
    std::printf("%s: caught %s\n", name, e.what());
  }
}

}  // namespace

int main() {
  expect("pool worker", 4, 2);
  expect("pool caller", 4, 0);
  expect("pool again", 4, 3);  // the pool still runs after a worker's exception
  // the pool busy (a run from inside a run): fresh threads, same rule
  tqvec::run_workers(2, [&](int64_t w) {
    if (w == 0) expect("fresh threads", 3, 1);
  });
  expect("no error", 4, -1);
  return 0;
}
