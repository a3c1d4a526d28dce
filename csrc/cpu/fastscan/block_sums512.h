// Table sums with AVX-512 (F + BW) for b in {1, 2, 4} (layouts: ../fastscan.h). One 64-byte
// load holds code bytes p and p + 1 of a block's 32 rows; the tables of positions p and p + 1
// sit in the low and high 256 bits of the lookup registers (the Lut's q8x layout), so every
// instruction does the work of two AVX2 ones. The two halves' 16-bit sums are added at each flush (<= 256 positions
// per flush between them, as in the AVX2 loop) and flushed by the AVX2 code: the totals are
// the AVX2 path's, bit for bit.
#pragma once
#include "../arch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "block_sums.h"
#include "shortlist.h"
#include "tables.h"

#ifdef TQVEC_X86
namespace tqvec::fastscan {

#define TQVEC_AVX512 __attribute__((target("avx2,avx512f,avx512bw"), always_inline)) inline

// The lookup registers of code bytes p, p + 1 (p even) from the Lut's q8x: t0 = (lo_p, lo_p,
// lo_p+1, lo_p+1), t1 = (hi_p, hi_p, hi_p+1, hi_p+1) in 128-bit lanes - two plain loads (a
// shuffle here would compete with the lookups for the shuffle ports).
TQVEC_AVX512 void pair_tables(const uint8_t* q8x, int64_t p, __m512i& t0, __m512i& t1) {
  t0 = _mm512_loadu_si512(q8x + (p / 2) * 128);
  t1 = _mm512_loadu_si512(q8x + (p / 2) * 128 + 64);
}

// Table sums of NB consecutive blocks for NQ queries (q8x: their Luts' q8x); rows of block j
// for query q land at tot[(q * NB + j) * 32 ...], as block_sums_avx2.
template <int NB, int NQ>
TQVEC_AVX512 void block_sums_avx512(const uint8_t* blk, int64_t rb, const uint8_t* const* q8,
                                    uint32_t* tot) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m256i tt[NQ][NB][4];
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j)
      for (int u = 0; u < 4; ++u) tt[q][j][u] = _mm256_setzero_si256();
  for (int64_t p0 = 0; p0 < rb; p0 += kFlushBytes) {
    const int64_t p1 = std::min(rb, p0 + kFlushBytes);
    __m512i all[NQ][NB], odd[NQ][NB];
    for (int q = 0; q < NQ; ++q)
      for (int j = 0; j < NB; ++j) all[q][j] = odd[q][j] = _mm512_setzero_si512();
    for (int64_t p = p0; p < p1; p += 2) {
      const __mmask64 m = p + 1 < p1 ? ~__mmask64{0} : __mmask64{0xffffffffu};
      __m512i lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i c = _mm512_maskz_loadu_epi8(m, blk + (j * rb + p) * kRows);
        lo[j] = _mm512_and_si512(c, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
      }
      for (int q = 0; q < NQ; ++q) {
        __m512i t0, t1;
        pair_tables(q8[q], p, t0, t1);
        for (int j = 0; j < NB; ++j) {
          const __m512i r = _mm512_add_epi8(_mm512_shuffle_epi8(t0, lo[j]),
                                            _mm512_shuffle_epi8(t1, hi[j]));
          all[q][j] = _mm512_add_epi16(all[q][j], r);
          odd[q][j] = _mm512_add_epi16(odd[q][j], _mm512_srli_epi16(r, 8));
        }
      }
    }
    for (int q = 0; q < NQ; ++q)
      for (int j = 0; j < NB; ++j) {
        const __m512i a = all[q][j], o = odd[q][j];
        flush_one(_mm256_add_epi16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1)),
                  _mm256_add_epi16(_mm512_castsi512_si256(o), _mm512_extracti64x4_epi64(o, 1)),
                  tt[q][j]);
      }
  }
  store_totals<NB, NQ>(tt, tot);
}

// scan_blocks_avx2 with the AVX-512 sums (b in {1, 2, 4}).
__attribute__((target("avx2,avx512f,avx512bw"))) inline void scan_blocks_avx512(
    const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
    const float* mult, const float* add, float off, Shortlist& sl) {
  alignas(32) uint32_t tot[4 * kRows];
  const uint8_t* q8[1] = {L.q8x.data()};
  for (int64_t j = j0; j < j1;) {
    const int nb = j + 4 <= j1 ? 4 : 1;
    if (nb == 4)
      block_sums_avx512<4, 1>(blocked + j * rb * kRows, rb, q8, tot);
    else
      block_sums_avx512<1, 1>(blocked + j * rb * kRows, rb, q8, tot);
    for (int u = 0; u < nb; ++u, ++j)
      admit_block_avx2(L, tot + u * kRows, j, n, mult, add, off, sl);
  }
}

// scan_blocksq_avx2 with the AVX-512 sums: NQ queries over the same blocks.
template <int NQ>
__attribute__((target("avx2,avx512f,avx512bw"))) void scan_blocksq_avx512(
    const Lut* const* L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
    const float* mult, const float* add, const float* off, Shortlist* const* sl) {
  alignas(32) uint32_t tot[NQ * kRows];
  const uint8_t* q8[NQ];
  for (int q = 0; q < NQ; ++q) q8[q] = L[q]->q8x.data();
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_avx512<1, NQ>(blocked + j * rb * kRows, rb, q8, tot);
    for (int q = 0; q < NQ; ++q)
      admit_block_avx2(*L[q], tot + q * kRows, j, n, mult, add, off[q], *sl[q]);
  }
}

#undef TQVEC_AVX512

#define TQVEC_VBMI \
  __attribute__((target("avx2,avx512f,avx512bw,avx512vbmi"), always_inline)) inline

// Code bytes off .. off + 31 of two blocks' 32 rows in one register (block 0 low, block 1 high).
TQVEC_VBMI __m512i load_two_blocks(const uint8_t* b0, const uint8_t* b1, int64_t off) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + off))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + off)), 1);
}

// b = 3 with VBMI: a pair's 6 bits (hi nibble | lo bits << 4, the order of its 64-entry table)
// index the table in one vpermb, which reads the low 6 bits of each index byte - one
// instruction where AVX2 takes four shuffles and three blends - for 64 rows at once, the 32 of
// block b0 and the 32 of block b1 (b1 may be b0: one block, its sums written twice). Each
// index is one bit-select of the hi nibble (bits 0-3) and the lo byte shifted so the pair's
// two bits sit at bits 4-5. The sums and their flushes are block_sums3_avx2's (the same
// 16-bit lanes per block, flushed by its code): rows of block u for query q land at
// tot[(q * 2 + u) * 32 ...], bit for bit the AVX2 path's totals.
template <int NQ>
TQVEC_VBMI void block_sums3_vbmi(const uint8_t* b0, const uint8_t* b1, int64_t rb,
                                 const uint8_t* const* q8, uint32_t* tot) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const int64_t G = rb / 3;
  __m256i tt[NQ][2][4];
  for (int q = 0; q < NQ; ++q)
    for (int u = 0; u < 2; ++u)
      for (int w = 0; w < 4; ++w) tt[q][u][w] = _mm256_setzero_si256();
  for (int64_t g0 = 0; g0 < G; g0 += kFlushGroups3) {
    const int64_t g1 = std::min(G, g0 + kFlushGroups3);
    __m512i all[NQ], odd[NQ];
    for (int q = 0; q < NQ; ++q) all[q] = odd[q] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g1; ++g) {
      const __m512i c0 = load_two_blocks(b0, b1, 3 * g * kRows);
      const __m512i c1 = load_two_blocks(b0, b1, (3 * g + 1) * kRows);
      const __m512i cl = load_two_blocks(b0, b1, (3 * g + 2) * kRows);
      // 0xca: low4 ? first : second, bit by bit
      const __m512i i0 = _mm512_ternarylogic_epi32(low4, c0, _mm512_slli_epi16(cl, 4), 0xca);
      const __m512i i1 = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi16(c0, 4),
                                                   _mm512_slli_epi16(cl, 2), 0xca);
      const __m512i i2 = _mm512_ternarylogic_epi32(low4, c1, cl, 0xca);
      const __m512i i3 = _mm512_ternarylogic_epi32(low4, _mm512_srli_epi16(c1, 4),
                                                   _mm512_srli_epi16(cl, 2), 0xca);
      for (int q = 0; q < NQ; ++q) {
        const uint8_t* T = q8[q] + 4 * g * 64;
        const __m512i r0 = _mm512_add_epi8(_mm512_permutexvar_epi8(i0, _mm512_loadu_si512(T)),
                                           _mm512_permutexvar_epi8(i1, _mm512_loadu_si512(T + 64)));
        const __m512i r1 =
            _mm512_add_epi8(_mm512_permutexvar_epi8(i2, _mm512_loadu_si512(T + 128)),
                            _mm512_permutexvar_epi8(i3, _mm512_loadu_si512(T + 192)));
        all[q] = _mm512_add_epi16(_mm512_add_epi16(all[q], r0), r1);
        odd[q] = _mm512_add_epi16(_mm512_add_epi16(odd[q], _mm512_srli_epi16(r0, 8)),
                                  _mm512_srli_epi16(r1, 8));
      }
    }
    for (int q = 0; q < NQ; ++q)
      for (int u = 0; u < 2; ++u)
        flush_one(_mm512_extracti64x4_epi64(all[q], u), _mm512_extracti64x4_epi64(odd[q], u),
                  tt[q][u]);
  }
  store_totals<2, NQ>(tt, tot);
}

// NQ queries (b = 3) over the same blocks, two blocks per pass (NQ = 1: one query's scan).
template <int NQ>
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi"))) void scan_blocksq3_vbmi(
    const Lut* const* L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
    const float* mult, const float* add, const float* off, Shortlist* const* sl) {
  alignas(32) uint32_t tot[NQ * 2 * kRows];
  const uint8_t* q8[NQ];
  for (int q = 0; q < NQ; ++q) q8[q] = L[q]->q8.data();
  for (int64_t j = j0; j < j1; j += 2) {
    const uint8_t* b0 = blocked + j * rb * kRows;
    block_sums3_vbmi<NQ>(b0, j + 1 < j1 ? b0 + rb * kRows : b0, rb, q8, tot);
    for (int q = 0; q < NQ; ++q)
      for (int u = 0; u < 2 && j + u < j1; ++u)
        admit_block_avx2(*L[q], tot + (q * 2 + u) * kRows, j + u, n, mult, add, off[q], *sl[q]);
  }
}

// The row totals of blocks b0 and b1 (b = 3) into tot[0, 64), callable from code compiled for
// other instruction sets.
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi"))) inline void block_sums3_two_vbmi(
    const Lut& L, const uint8_t* b0, const uint8_t* b1, int64_t rb, uint32_t* tot) {
  const uint8_t* q8[1] = {L.q8.data()};
  block_sums3_vbmi<1>(b0, b1, rb, q8, tot);
}

// The 32 row totals of one block (b = 3).
inline void block_sums3_one_vbmi(const Lut& L, const uint8_t* blk, int64_t rb, uint32_t* tot) {
  alignas(32) uint32_t both[2 * kRows];
  block_sums3_two_vbmi(L, blk, blk, rb, both);
  std::memcpy(tot, both, sizeof(uint32_t) * kRows);
}

#undef TQVEC_VBMI

}  // namespace tqvec::fastscan
#endif  // TQVEC_X86
