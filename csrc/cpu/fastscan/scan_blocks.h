// The block scans' vector path, chosen per CPU and TQVEC_SIMD (../kernels.h): AVX2 by default,
// AVX-512 (b in {1, 2, 4}) on request, or the portable loops. Every path gives the same bits.
#pragma once
#include <cstdint>

#include "../kernels.h"
#include "block_sums.h"
#include "block_sums512.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec::fastscan {

// Queries per pass of the multi-query scan: AVX2 3 (four queries' accumulators, tables and
// temporaries overflow the 16 registers), 2 for b = 3 (its pair tables take more registers);
// AVX-512 4 (32 registers).
inline int queries_per_pass(int b) {
  if (b == 3) return 2;
  return simd_avx512() ? 4 : 3;
}

// Scans the first count queries of the lut/shortlist arrays (count a multiple of nq, which is
// queries_per_pass) over blocks [j0, j1), nq at a time, with per-query offsets off.
inline void scan_query_groups(int nq, const Lut* const* L, Shortlist* const* sl, int64_t count,
                              const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                              int64_t j1, const float* mult, const float* add,
                              const float* off) {
  for (int64_t g = 0; g + nq <= count; g += nq) {
    if (nq == 4)
      scan_blocksq_avx512<4>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else if (nq == 2)
      scan_blocksq_avx2<2>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else
      scan_blocksq_avx2<3>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
  }
}

inline void scan_blocks(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                        int64_t j1, const float* mult, const float* add, float off,
                        Shortlist& sl) {
  if (L.b != 3 && simd_avx512())
    scan_blocks_avx512(L, blocked, rb, n, j0, j1, mult, add, off, sl);
  else if (simd_avx2())
    scan_blocks_avx2(L, blocked, rb, n, j0, j1, mult, add, off, sl);
  else
    scan_blocks_scalar(L, blocked, rb, n, j0, j1, mult, add, off, sl);
}

}  // namespace tqvec::fastscan
