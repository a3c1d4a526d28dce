// The block scans' vector path, chosen per CPU and TQVEC_SIMD (../kernels.h): AVX2 by default
// on x86 (b = 3 by VBMI's vpermb where the CPU has it, b in {1, 2, 4} by VBMI + VNNI where it
// has those; AVX-512 F + BW for b in {1, 2, 4} on request),
// NEON on aarch64, or the portable loops. Every path gives the same bits.
#pragma once
#include <cstdint>

#include "../kernels.h"
#include "block_sums.h"
#include "block_sums512.h"
#include "block_sums_neon.h"
#include "dot.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec::fastscan {

// Queries per pass of the multi-query scan, 0 where there is none (the portable build scans
// query by query): AVX2 3 (four queries' accumulators, tables and temporaries overflow the 16
// registers), 2 for b = 3 (its pair tables take more registers); AVX-512 4 (32 registers; b = 3
// with VBMI too: 8 ran slower); the VNNI sums 6 (4 ran slower, 8 no faster;
// 12 accumulators); the dot form 8 (uses_dot: exact scans of 4-bit codes with
// VNNI; 16 accumulators); NEON 4, 2 for b = 3 (32 registers; the totals stay in memory between
// flushes). exact: the scan re-scores its shortlists (not an approximate first stage).
inline int queries_per_pass(int b, bool exact) {
  if (uses_dot(b, exact)) return 8;
  if (simd_neon()) return b == 3 ? 2 : 4;
  if (!simd_avx2()) return 0;
  if (b == 3) return simd_vbmi() ? 4 : 2;
  if (uses_vnni_sums(b)) return 6;
  return simd_avx512() ? 4 : 3;
}

// Scans the first count queries of the lut/shortlist arrays (count a multiple of nq, which is
// queries_per_pass; 8: the dot form) over blocks [j0, j1), nq at a time, with per-query
// offsets off.
inline void scan_query_groups(int nq, const Lut* const* L, Shortlist* const* sl, int64_t count,
                              const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                              int64_t j1, const float* mult, const float* add,
                              const float* off) {
  if (nq <= 0) return;
  for (int64_t g = 0; g + nq <= count; g += nq) {
#ifdef TQVEC_X86
    // by the tables' form (the Luts of one call share it)
    if (!L[g]->w.empty())
      scan_blocks_dot<8>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else if (!L[g]->q8v.empty())
      scan_blocksq_vnni<6>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else if (L[g]->b == 3 && nq == 4)
      scan_blocksq3_vbmi<4>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else if (nq == 4)
      scan_blocksq_avx512<4>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else if (nq == 2)
      scan_blocksq_avx2<2>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else
      scan_blocksq_avx2<3>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
#elif defined(TQVEC_NEON)
    if (nq == 4)
      scan_blocksq_neon<4>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else
      scan_blocksq_neon<2>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
#else
    (void)L, (void)sl, (void)blocked, (void)rb, (void)n, (void)j0, (void)j1, (void)mult,
        (void)add, (void)off;
#endif
  }
}

inline void scan_blocks(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                        int64_t j1, const float* mult, const float* add, float off,
                        Shortlist& sl) {
#ifdef TQVEC_X86
  if (L.b == 3 && simd_vbmi()) {
    const Lut* lp = &L;
    Shortlist* sp = &sl;
    return scan_blocksq3_vbmi<1>(&lp, blocked, rb, n, j0, j1, mult, add, &off, &sp);
  }
  if (!L.q8v.empty()) return scan_blocks_vnni(L, blocked, rb, n, j0, j1, mult, add, off, sl);
  if (L.b != 3 && simd_avx512())
    return scan_blocks_avx512(L, blocked, rb, n, j0, j1, mult, add, off, sl);
  if (simd_avx2()) return scan_blocks_avx2(L, blocked, rb, n, j0, j1, mult, add, off, sl);
#endif
#ifdef TQVEC_NEON
  if (simd_neon()) return scan_blocks_neon(L, blocked, rb, n, j0, j1, mult, add, off, sl);
#endif
  scan_blocks_scalar(L, blocked, rb, n, j0, j1, mult, add, off, sl);
}

// The 32 row totals of one block (tot[0, 32)) by the vector path present.
inline void block_sums_one(const Lut& L, const uint8_t* blk, int64_t rb, uint32_t* tot) {
#ifdef TQVEC_X86
  if (L.b == 3 && simd_vbmi()) return block_sums3_one_vbmi(L, blk, rb, tot);
  if (!L.q8v.empty()) return block_sums_vnni_any(L, blk, rb, 1, tot);
  if (simd_avx2()) return block_sums1_avx2(L, blk, rb, tot);
#endif
#ifdef TQVEC_NEON
  const uint8_t* q8[1] = {L.q8.data()};
  if (simd_neon()) return block_sums_neon_any<1>(L.b, blk, rb, q8, tot);
#endif
  block_sums_scalar(L, blk, rb, tot);
}

}  // namespace tqvec::fastscan
