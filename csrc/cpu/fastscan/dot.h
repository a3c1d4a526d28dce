// The dot form of the 4-bit scan (layouts: ../fastscan.h; the form: Lut::w, lev, dot in
// tables.h): with AVX-512 VNNI a group of queries scores a block by int8 dot products instead
// of table lookups. Each code byte pair is decoded once for the group - both nibbles to their
// 8-bit centroid levels (one vpshufb each), the four levels of a row gathered into its 32-bit
// lane (two vpermt2b) - and each query then adds a row's four products in one vpdpbusd with
// its four int8 weights: two instructions per query for 64 code bytes, where the tables take
// two lookups, two loads and four adds. The sums are exact 32-bit integers; the approximation
// (query and levels rounded to 8 bits) is bounded in add_dot, and the shortlist re-scores the
// rows that can reach the top k with the float table, as the table scans do: a query's results
// are the same on every path.
#pragma once
#include "../arch.h"

#include <cstdint>

#include "block_sums.h"
#include "shortlist.h"
#include "tables.h"

#ifdef TQVEC_X86
namespace tqvec::fastscan {

#define TQVEC_VNNI \
  __attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"), always_inline)) inline

// Byte 4t + u of the gathered lanes: for rows t (x0) and 16 + t (x1) of a block, the levels of
// coordinates 2p, 2p + 1, 2p + 2, 2p + 3 - lo and hi nibble of code byte p (bytes 0-31 of the
// decoded registers) and of byte p + 1 (bytes 32-63); index bit 6 picks the hi register.
alignas(64) inline constexpr uint8_t kGather[2][64] = {
    {0,  64, 32, 96,  1,  65, 33, 97,  2,  66, 34, 98,  3,  67, 35, 99,
     4,  68, 36, 100, 5,  69, 37, 101, 6,  70, 38, 102, 7,  71, 39, 103,
     8,  72, 40, 104, 9,  73, 41, 105, 10, 74, 42, 106, 11, 75, 43, 107,
     12, 76, 44, 108, 13, 77, 45, 109, 14, 78, 46, 110, 15, 79, 47, 111},
    {16, 80, 48, 112, 17, 81, 49, 113, 18, 82, 50, 114, 19, 83, 51, 115,
     20, 84, 52, 116, 21, 85, 53, 117, 22, 86, 54, 118, 23, 87, 55, 119,
     24, 88, 56, 120, 25, 89, 57, 121, 26, 90, 58, 122, 27, 91, 59, 123,
     28, 92, 60, 124, 29, 93, 61, 125, 30, 94, 62, 126, 31, 95, 63, 127}};

// tot[q * 32 + t] = sum_j w_q[j] lev[idx_tj] over the rows t of one block (rb code bytes per
// row), as 32-bit integers; every query's Lut has the dot form, all of one codebook.
template <int NQ>
TQVEC_VNNI void dot_sums_vnni(const uint8_t* blk, int64_t rb, const Lut* const* L,
                              uint32_t* tot) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i lev = _mm512_loadu_si512(L[0]->lev);
  const __m512i g0 = _mm512_load_si512(kGather[0]), g1 = _mm512_load_si512(kGather[1]);
  const int8_t* w[NQ];
  __m512i acc[NQ][2];
  for (int q = 0; q < NQ; ++q) {
    w[q] = L[q]->w.data();
    acc[q][0] = acc[q][1] = _mm512_setzero_si512();
  }
  for (int64_t p = 0; p < rb; p += 2) {
    // a last unpaired byte: its pair's second half loads as zeros, whose levels meet the zero
    // weights past the last coordinate
    const __m512i c = p + 1 < rb ? _mm512_loadu_si512(blk + p * kRows)
                                 : _mm512_maskz_loadu_epi8(0xffffffffull, blk + p * kRows);
    const __m512i lo = _mm512_shuffle_epi8(lev, _mm512_and_si512(c, low4));
    const __m512i hi = _mm512_shuffle_epi8(lev, _mm512_and_si512(_mm512_srli_epi16(c, 4), low4));
    const __m512i x0 = _mm512_permutex2var_epi8(lo, g0, hi);
    const __m512i x1 = _mm512_permutex2var_epi8(lo, g1, hi);
    for (int q = 0; q < NQ; ++q) {
      int32_t four;
      __builtin_memcpy(&four, w[q] + 2 * p, 4);
      const __m512i wq = _mm512_set1_epi32(four);
      acc[q][0] = _mm512_dpbusd_epi32(acc[q][0], x0, wq);
      acc[q][1] = _mm512_dpbusd_epi32(acc[q][1], x1, wq);
    }
  }
  for (int q = 0; q < NQ; ++q) {
    _mm512_storeu_si512(tot + q * kRows, acc[q][0]);
    _mm512_storeu_si512(tot + q * kRows + 16, acc[q][1]);
  }
}

// NQ queries (b = 4, the dot form) over blocks [j0, j1): each block's sums, then every query's
// admissions by its dot scale.
template <int NQ>
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"))) void scan_blocks_dot(
    const Lut* const* L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
    const float* mult, const float* add, const float* off, Shortlist* const* sl) {
  alignas(64) uint32_t tot[NQ * kRows];
  for (int64_t j = j0; j < j1; ++j) {
    dot_sums_vnni<NQ>(blocked + j * rb * kRows, rb, L, tot);
    for (int q = 0; q < NQ; ++q)
      admit_block_avx2(L[q]->dot, tot + q * kRows, j, n, mult, add, off[q], *sl[q]);
  }
}

#undef TQVEC_VNNI

}  // namespace tqvec::fastscan
#endif  // TQVEC_X86
