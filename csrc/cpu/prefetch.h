// Software prefetch of a byte range: every cache line it overlaps, from the line holding its
// first byte to the one holding its last (a range that starts mid-line spans one more line than
// bytes / 64).
#pragma once

#include <cstdint>

namespace tqvec {

// Where a prefetch puts a line: L1 (and the outer caches), or the outer caches only (L2 on
// x86) - for kilobytes requested at once, whose lines would otherwise wait on L1's few miss
// buffers.
enum class Cache { L1, L2 };

// One cache line. Inline assembly, not __builtin_prefetch: GCC 12's dead-code elimination
// removed whole loops of the builtin (every prefetch of the graph search was gone), and a
// volatile asm statement is never removed.
template <Cache C = Cache::L1>
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (C == Cache::L1) asm volatile("prefetcht0 (%0)" : : "r"(p));
  else asm volatile("prefetcht1 (%0)" : : "r"(p));
#elif defined(__aarch64__)
  if constexpr (C == Cache::L1) asm volatile("prfm pldl1keep, [%0]" : : "r"(p));
  else asm volatile("prfm pldl2keep, [%0]" : : "r"(p));
#else
  __builtin_prefetch(p, 0, C == Cache::L1 ? 3 : 2);
#endif
}

template <Cache C = Cache::L1>
inline void prefetch_span(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = a & ~uintptr_t{63}; line < a + static_cast<uintptr_t>(bytes); line += 64)
    prefetch_line<C>(reinterpret_cast<const void*>(line));
}

// One byte of every cache line of a byte range, summed: a load where a prefetch does not do.
// A software prefetch may be dropped (e.g. where its page is not in the TLB, as for candidate
// rows scattered over megabytes of codes right after a scan of other megabytes); a load is not,
// and loads issued back to back for a batch of rows miss in parallel. Pass the sum to keep() so
// the loads stay.
inline uint32_t touch_span(const void* p, int64_t bytes) {
  if (bytes <= 0) return 0;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), end = a + static_cast<uintptr_t>(bytes);
  uint32_t s = *reinterpret_cast<const volatile uint8_t*>(a);
  for (uintptr_t line = (a & ~uintptr_t{63}) + 64; line < end; line += 64)
    s += *reinterpret_cast<const volatile uint8_t*>(line);
  return s;
}

inline void keep(uint32_t v) { asm volatile("" : : "r"(v)); }

}  // namespace tqvec
