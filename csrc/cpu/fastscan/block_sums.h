// Table sums of 32-row blocks and the scans that admit rows into shortlists, portable and
// AVX2 (NEON: block_sums_neon.h; layouts: ../fastscan.h); the exact score and the re-score of a query's candidates.
#pragma once
#include "../arch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "../kernels.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec::fastscan {

// Table sums of the 32 rows of one block (portable loop).
inline void block_sums_scalar(const Lut& L, const uint8_t* blk, int64_t rb, uint32_t* tot) {
  for (int t = 0; t < kRows; ++t) tot[t] = 0;
  if (L.b == 3) {
    for (int64_t g = 0; g < rb / 3; ++g) {
      const uint8_t* c0 = blk + 3 * g * kRows;
      const uint8_t* c1 = c0 + kRows;
      const uint8_t* c2 = c1 + kRows;
      const uint8_t* T = L.q8.data() + 4 * g * 64;
      for (int t = 0; t < kRows; ++t) {
        const int lo = c2[t];
        tot[t] += T[(lo & 3) * 16 + (c0[t] & 15)] + T[64 + ((lo >> 2) & 3) * 16 + (c0[t] >> 4)] +
                  T[128 + ((lo >> 4) & 3) * 16 + (c1[t] & 15)] +
                  T[192 + (lo >> 6) * 16 + (c1[t] >> 4)];
      }
    }
    return;
  }
  for (int64_t p = 0; p < rb; ++p) {
    const uint8_t* c = blk + p * kRows;
    const uint8_t* t0 = L.q8.data() + (2 * p) * 16;
    const uint8_t* t1 = t0 + 16;
    for (int t = 0; t < kRows; ++t) tot[t] += t0[c[t] & 15] + t1[c[t] >> 4];
  }
}

inline void scan_blocks_scalar(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                        int64_t j1, const float* mult, const float* add, float off,
                        Shortlist& sl) {
  uint32_t tot[kRows];
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_scalar(L, blocked + j * rb * kRows, rb, tot);
    const int64_t base = j * kRows, rows = std::min(kRows, n - base);
    for (int64_t t = 0; t < rows; ++t) consider(L, tot[t], base + t, mult, add, off, sl);
  }
}

#ifdef TQVEC_X86
// 16-bit lane sums (all = even row + 256 odd row, odd) of one block -> its u32 totals t[4].
__attribute__((target("avx2"), always_inline)) inline void flush_one(__m256i all, __m256i o,
                                                                      __m256i* t) {
  const __m256i even = _mm256_sub_epi16(all, _mm256_slli_epi16(o, 8));
  t[0] = _mm256_add_epi32(t[0], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(even)));
  t[1] = _mm256_add_epi32(t[1], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(even, 1)));
  t[2] = _mm256_add_epi32(t[2], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(o)));
  t[3] = _mm256_add_epi32(t[3], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(o, 1)));
}

template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void flush_u16(
    __m256i (&all)[NQ][NB], __m256i (&odd)[NQ][NB], __m256i (&tt)[NQ][NB][4]) {
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j) flush_one(all[q][j], odd[q][j], tt[q][j]);
}

// 16-bit lane i held rows 2i and 2i+1: interleave back to row order; rows of block j for
// query q land at tot[(q * NB + j) * 32 ...].
template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void store_totals(
    __m256i (&tt)[NQ][NB][4], uint32_t* tot) {
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i e = tt[q][j][h], o = tt[q][j][2 + h];
        const __m256i a = _mm256_unpacklo_epi32(e, o), b = _mm256_unpackhi_epi32(e, o);
        uint32_t* dst = tot + (q * NB + j) * kRows + h * 16;
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst),
                           _mm256_permute2x128_si256(a, b, 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 8),
                           _mm256_permute2x128_si256(a, b, 0x31));
      }
}

// Table sums of NB consecutive blocks for NQ queries (NB * NQ <= 4 accumulator pairs fit in the
// 16 vector registers); rows of block j for query q land at tot[(q * NB + j) * 32 ...]. Several
// blocks per pass load each pair of tables once for 32 * NB rows; several queries per pass
// load and split each code byte once for NQ tables (batch search).
template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void block_sums_avx2(
    const uint8_t* blk, int64_t rb, const uint8_t* const* q8, uint32_t* tot) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256i tt[NQ][NB][4];  // u32 totals: even rows 0-15 / 16-31, odd rows 0-15 / 16-31
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j)
      for (int u = 0; u < 4; ++u) tt[q][j][u] = _mm256_setzero_si256();
  for (int64_t p0 = 0; p0 < rb; p0 += kFlushBytes) {
    const int64_t p1 = std::min(rb, p0 + kFlushBytes);
    // Both nibbles of a byte belong to the same row and table entries are <= 127, so their
    // two lookups add in 8 bits. 16-bit lanes then collect `all` = even row + 256 * odd row
    // (mod 2^16) and `odd` = odd row; even = all - 256 * odd.
    __m256i all[NQ][NB], odd[NQ][NB];
    for (int q = 0; q < NQ; ++q)
      for (int j = 0; j < NB; ++j) all[q][j] = odd[q][j] = _mm256_setzero_si256();
    for (int64_t p = p0; p < p1; ++p) {
      if constexpr (NQ == 1) {
        // One query: its two tables first, then each block's code byte split, looked up and
        // added in turn - 2 NB accumulators + 2 tables + a few temporaries stay in the 16
        // registers (splitting all NB blocks first spilled accumulators to the stack).
        const __m256i t0 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q8[0] + 2 * p * 16)));
        const __m256i t1 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q8[0] + (2 * p + 1) * 16)));
        for (int j = 0; j < NB; ++j) {
          const __m256i c = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + (j * rb + p) * kRows));
          const __m256i r = _mm256_add_epi8(
              _mm256_shuffle_epi8(t0, _mm256_and_si256(c, low4)),
              _mm256_shuffle_epi8(t1, _mm256_and_si256(_mm256_srli_epi16(c, 4), low4)));
          all[0][j] = _mm256_add_epi16(all[0][j], r);
          odd[0][j] = _mm256_add_epi16(odd[0][j], _mm256_srli_epi16(r, 8));
        }
        continue;
      }
      __m256i lo[NB], hi[NB];
      for (int j = 0; j < NB; ++j) {
        const __m256i c = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + (j * rb + p) * kRows));
        lo[j] = _mm256_and_si256(c, low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
      }
      for (int q = 0; q < NQ; ++q) {
        const __m256i t0 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q8[q] + 2 * p * 16)));
        const __m256i t1 = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q8[q] + (2 * p + 1) * 16)));
        for (int j = 0; j < NB; ++j) {
          const __m256i r =
              _mm256_add_epi8(_mm256_shuffle_epi8(t0, lo[j]), _mm256_shuffle_epi8(t1, hi[j]));
          all[q][j] = _mm256_add_epi16(all[q][j], r);
          odd[q][j] = _mm256_add_epi16(odd[q][j], _mm256_srli_epi16(r, 8));
        }
      }
    }
    flush_u16<NB, NQ>(all, odd, tt);
  }
  store_totals<NB, NQ>(tt, tot);
}

// The four 16-entry quarters of a pair's 64-entry table, each broadcast to both lanes.
__attribute__((target("avx2"), always_inline)) inline void load_pair_tables(const uint8_t* t,
                                                                             __m256i (&tt)[4]) {
  for (int u = 0; u < 4; ++u)
    tt[u] = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 16 * u)));
}

// A pair's table value for 32 rows: hi nibbles hv pick within each quarter, bits of lo (moved to
// bit 7 of each byte in m0 / m1) pick the quarter.
__attribute__((target("avx2"), always_inline)) inline __m256i pair_lookup(
    const __m256i (&tt)[4], __m256i hv, __m256i m0, __m256i m1) {
  const __m256i a = _mm256_blendv_epi8(_mm256_shuffle_epi8(tt[0], hv),
                                       _mm256_shuffle_epi8(tt[1], hv), m0);
  const __m256i c = _mm256_blendv_epi8(_mm256_shuffle_epi8(tt[2], hv),
                                       _mm256_shuffle_epi8(tt[3], hv), m0);
  return _mm256_blendv_epi8(a, c, m1);
}

// b = 3 (pair layout): per group of 8 coordinates, pair P's value is a 64-entry table looked
// up as four 16-entry shuffles on its hi nibble, merged by two byte blends on its lo bits
// (bit 2P of the lo byte selects within each pair of tables, bit 2P+1 between the pairs); the
// two pairs of a byte add in 8 bits as in the 4-bit scan. A group adds <= 2 * 254 per row to a
// 16-bit lane, so the lanes flush every 128 groups.
template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void block_sums3_avx2(
    const uint8_t* blk, int64_t rb, const uint8_t* const* q8, uint32_t* tot) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const int64_t G = rb / 3;
  __m256i tt[NQ][NB][4];
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j)
      for (int u = 0; u < 4; ++u) tt[q][j][u] = _mm256_setzero_si256();
  for (int64_t g0 = 0; g0 < G; g0 += kFlushGroups3) {
    const int64_t g1 = std::min(G, g0 + kFlushGroups3);
    __m256i all[NQ][NB], odd[NQ][NB];
    for (int q = 0; q < NQ; ++q)
      for (int j = 0; j < NB; ++j) all[q][j] = odd[q][j] = _mm256_setzero_si256();
    for (int64_t g = g0; g < g1; ++g) {
      if constexpr (NQ == 1) {
        // One query: pair by pair, its four tables, then each block's codes (re-read from L1)
        // looked up in turn; keeping all blocks' code vectors live spilled to the stack.
        for (int h = 0; h < 2; ++h) {
          __m256i r[NB];
          for (int s = 0; s < 2; ++s) {
            const int P = 2 * h + s;
            const __m128i sh0 = _mm_cvtsi32_si128(7 - 2 * P), sh1 = _mm_cvtsi32_si128(6 - 2 * P);
            __m256i tt[4];
            load_pair_tables(q8[0] + (4 * g + P) * 64, tt);
            for (int j = 0; j < NB; ++j) {
              const uint8_t* src = blk + (j * rb + 3 * g) * kRows;
              const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + h * kRows));
              const __m256i cl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * kRows));
              const __m256i hv = s == 0 ? _mm256_and_si256(c, low4)
                                        : _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
              const __m256i v = pair_lookup(tt, hv, _mm256_sll_epi16(cl, sh0),
                                            _mm256_sll_epi16(cl, sh1));
              r[j] = s == 0 ? v : _mm256_add_epi8(r[j], v);
            }
          }
          for (int j = 0; j < NB; ++j) {
            all[0][j] = _mm256_add_epi16(all[0][j], r[j]);
            odd[0][j] = _mm256_add_epi16(odd[0][j], _mm256_srli_epi16(r[j], 8));
          }
        }
        continue;
      }
      __m256i cb[NB][2], cl[NB];
      for (int j = 0; j < NB; ++j) {
        const uint8_t* src = blk + (j * rb + 3 * g) * kRows;
        cb[j][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        cb[j][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kRows));
        cl[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * kRows));
      }
      for (int h = 0; h < 2; ++h) {
        __m256i r[NQ][NB];
        for (int s = 0; s < 2; ++s) {
          const int P = 2 * h + s;
          // bit 2P (2P+1) of the lo byte moved to bit 7 of its byte, where blendv looks
          const __m128i sh0 = _mm_cvtsi32_si128(7 - 2 * P), sh1 = _mm_cvtsi32_si128(6 - 2 * P);
          __m256i hv[NB], m0[NB], m1[NB];
          for (int j = 0; j < NB; ++j) {
            hv[j] = s == 0 ? _mm256_and_si256(cb[j][h], low4)
                           : _mm256_and_si256(_mm256_srli_epi16(cb[j][h], 4), low4);
            m0[j] = _mm256_sll_epi16(cl[j], sh0);
            m1[j] = _mm256_sll_epi16(cl[j], sh1);
          }
          for (int q = 0; q < NQ; ++q) {
            __m256i tt[4];
            load_pair_tables(q8[q] + (4 * g + P) * 64, tt);
            for (int j = 0; j < NB; ++j) {
              const __m256i v = pair_lookup(tt, hv[j], m0[j], m1[j]);
              r[q][j] = s == 0 ? v : _mm256_add_epi8(r[q][j], v);
            }
          }
        }
        for (int q = 0; q < NQ; ++q)
          for (int j = 0; j < NB; ++j) {
            all[q][j] = _mm256_add_epi16(all[q][j], r[q][j]);
            odd[q][j] = _mm256_add_epi16(odd[q][j], _mm256_srli_epi16(r[q][j], 8));
          }
      }
    }
    flush_u16<NB, NQ>(all, odd, tt);
  }
  store_totals<NB, NQ>(tt, tot);
}

template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void block_sums(
    int b, const uint8_t* blk, int64_t rb, const uint8_t* const* q8, uint32_t* tot) {
  if (b == 3)
    block_sums3_avx2<NB, NQ>(blk, rb, q8, tot);
  else
    block_sums_avx2<NB, NQ>(blk, rb, q8, tot);
}

// Block j's rows through consider() where it is the last, partial block (then true).
template <class Sc>
__attribute__((always_inline)) inline bool admit_partial_block(const Sc& L, const uint32_t* bt,
                                                               int64_t j, int64_t n,
                                                               const float* mult,
                                                               const float* add, float off,
                                                               Shortlist& sl) {
  const int64_t base = j * kRows;
  if (n - base >= kRows) return false;
  for (int64_t t = 0; t < n - base; ++t) consider(L, bt[t], base + t, mult, add, off, sl);
  return true;
}

// Bounds of the 32 rows of block j (sums bt) against the query's threshold, 8 rows at a time;
// only rows that pass (a few per query in all, once the heap is full) leave the vector path.
// Sc: a Lut or a SumScale (consider()); the sums convert as signed 32-bit integers.
template <class Sc>
__attribute__((target("avx2"), always_inline)) inline void admit_block_avx2(
    const Sc& L, const uint32_t* bt, int64_t j, int64_t n, const float* mult, const float* add,
    float off, Shortlist& sl) {
  if (admit_partial_block(L, bt, j, n, mult, add, off, sl)) return;  // the last, partial block
  const int64_t base = j * kRows;
  const __m256 vdelta = _mm256_set1_ps(L.delta), vbias = _mm256_set1_ps(L.bias);
  const __m256 voff = _mm256_set1_ps(off);
  const __m256 verr = _mm256_set1_ps(L.err), ninf = _mm256_set1_ps(-INFINITY);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int g = 0; g < kRows; g += 8) {
    const __m256 m = _mm256_loadu_ps(mult + base + g), a = _mm256_loadu_ps(add + base + g);
    const __m256 sum =
        _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bt + g)));
    const __m256 s = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(m, _mm256_add_ps(_mm256_mul_ps(vdelta, sum), vbias)), a),
        voff);
    const __m256 e = _mm256_mul_ps(_mm256_and_ps(m, absmask), verr);
    const __m256 ub = _mm256_add_ps(s, e);
    const __m256 th = _mm256_set1_ps(sl.threshold());
    int bits = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ub, th, _CMP_GE_OQ),
                                                _mm256_cmp_ps(a, ninf, _CMP_GT_OQ)));
    if (!bits) continue;
    // consider()'s float operations, lane by lane: the passing rows are admitted from these
    // vectors (re-deriving each score in scalar code cost more than the admission itself).
    // An admission can raise the threshold, so each row is tested against the current one.
    alignas(32) float lbv[8], ubv[8];
    _mm256_store_ps(lbv, _mm256_sub_ps(s, e));
    _mm256_store_ps(ubv, ub);
    while (bits) {
      const int t = __builtin_ctz(bits);
      bits &= bits - 1;
      if (ubv[t] >= sl.threshold()) sl.admit(lbv[t], ubv[t], base + g + t, off);
    }
  }
}

__attribute__((target("avx2"))) inline void scan_blocks_avx2(const Lut& L, const uint8_t* blocked,
                                                      int64_t rb, int64_t n, int64_t j0,
                                                      int64_t j1, const float* mult,
                                                      const float* add, float off,
                                                      Shortlist& sl) {
  alignas(32) uint32_t tot[4 * kRows];
  const uint8_t* q8[1] = {L.q8.data()};
  // b = 3 holds 2 blocks per pass in registers, b = 1, 2, 4 four
  const int wide = L.b == 3 ? 2 : 4;
  for (int64_t j = j0; j < j1;) {
    const int nb = j + wide <= j1 ? wide : 1;
    if (nb == 4)
      block_sums_avx2<4, 1>(blocked + j * rb * kRows, rb, q8, tot);
    else if (nb == 2)
      block_sums3_avx2<2, 1>(blocked + j * rb * kRows, rb, q8, tot);
    else
      block_sums<1, 1>(L.b, blocked + j * rb * kRows, rb, q8, tot);
    for (int u = 0; u < nb; ++u, ++j)
      admit_block_avx2(L, tot + u * kRows, j, n, mult, add, off, sl);
  }
}

// NQ queries over the same blocks: each code byte is loaded and split once for NQ tables.
template <int NQ>
__attribute__((target("avx2"))) void scan_blocksq_avx2(const Lut* const* L, const uint8_t* blocked,
                                                       int64_t rb, int64_t n, int64_t j0,
                                                       int64_t j1, const float* mult,
                                                       const float* add, const float* off,
                                                       Shortlist* const* sl) {
  alignas(32) uint32_t tot[4 * kRows];
  const uint8_t* q8[NQ];
  for (int q = 0; q < NQ; ++q) q8[q] = L[q]->q8.data();
  for (int64_t j = j0; j < j1; ++j) {
    block_sums<1, NQ>(L[0]->b, blocked + j * rb * kRows, rb, q8, tot);
    for (int q = 0; q < NQ; ++q)
      admit_block_avx2(*L[q], tot + q * kRows, j, n, mult, add, off[q], *sl[q]);
  }
}

// The 32 row totals of one block, callable from code compiled for the baseline ISA.
__attribute__((target("avx2"))) inline void block_sums1_avx2(const Lut& L, const uint8_t* blk,
                                                             int64_t rb, uint32_t* tot) {
  const uint8_t* q8[1] = {L.q8.data()};
  block_sums<1, 1>(L.b, blk, rb, q8, tot);
}
#endif  // TQVEC_X86

// <q, c[idx]> of row i in float32, summed per nibble as the table would (low, high nibble in
// two accumulators).
inline float exact_score(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t i) {
  const uint8_t* blk = blocked + (i / kRows) * rb * kRows + (i % kRows);
  if (!L.f.empty()) {  // the float table: one lookup per position, two accumulators
    const float* f = L.f.data();
    float s[2] = {0.f, 0.f};
    if (L.b == 3) {
      for (int64_t g = 0; g < rb / 3; ++g) {
        const int c0 = blk[3 * g * kRows], c1 = blk[(3 * g + 1) * kRows];
        const int lo = blk[(3 * g + 2) * kRows];
        const float* T = f + 4 * g * 64;
        s[0] += T[(lo & 3) * 16 + (c0 & 15)] + T[128 + ((lo >> 4) & 3) * 16 + (c1 & 15)];
        s[1] += T[64 + ((lo >> 2) & 3) * 16 + (c0 >> 4)] + T[192 + (lo >> 6) * 16 + (c1 >> 4)];
      }
    } else {
      for (int64_t p = 0; p < rb; ++p) {
        const int byte = blk[p * kRows];
        s[0] += f[(2 * p) * 16 + (byte & 15)];
        s[1] += f[(2 * p + 1) * 16 + (byte >> 4)];
      }
    }
    return s[0] + s[1];
  }
  if (L.b == 3) {
    float s[2] = {0.f, 0.f};
    for (int64_t g = 0; g < rb / 3; ++g) {
      const int c0 = blk[3 * g * kRows], c1 = blk[(3 * g + 1) * kRows];
      const int lo = blk[(3 * g + 2) * kRows];
      for (int P = 0; P < 4; ++P) {
        const int hi = ((P < 2 ? c0 : c1) >> (4 * (P & 1))) & 15, l = (lo >> (2 * P)) & 3;
        const int64_t j = 8 * g + 2 * P;
        float t = 0.f;
        if (j < L.d) t += L.q[j] * L.c[((hi & 3) << 1) | (l & 1)];
        if (j + 1 < L.d) t += L.q[j + 1] * L.c[((hi >> 2) << 1) | (l >> 1)];
        s[P & 1] += t;
      }
    }
    return s[0] + s[1];
  }
  const int per = 4 / L.b, mask = (1 << L.b) - 1;
  float s[2] = {0.f, 0.f};
  for (int64_t p = 0; p < rb; ++p) {
    const int byte = blk[p * kRows];
    for (int h = 0; h < 2; ++h) {
      const int nib = (byte >> (4 * h)) & 15;
      const int64_t j0 = (2 * p + h) * per;
      float t = 0.f;
      for (int u = 0; u < per && j0 + u < L.d; ++u)
        t += L.q[j0 + u] * L.c[(nib >> (u * L.b)) & mask];
      s[h] += t;
    }
  }
  return s[0] + s[1];
}

inline void finish(const Lut& L, const uint8_t* blocked, int64_t rb, const float* mult, const float* add,
            std::vector<Shortlist*> parts, int64_t k, float* vals, int64_t* idx) {
  rescore_best_first(parts, k, [&](const Shortlist::Cand& c) {
    return mult[c.row] * exact_score(L, blocked, rb, c.row) + add[c.row] + c.off;
  }, vals, idx);
}

}  // namespace tqvec::fastscan
