// Table sums with AVX-512 (layouts: ../fastscan.h): VBMI + VNNI for b in {1, 2, 4}
// (block_sums_vnni, the default where the CPU has them) and VBMI for b = 3 (block_sums3_vbmi);
// F + BW alone for b in {1, 2, 4} on request (block_sums_avx512, TQVEC_SIMD=avx512: one 64-byte
// load holds code bytes p and p + 1 of a block's 32 rows, the tables of both positions sit in
// the low and high 256 bits of the lookup registers - the Lut's q8x layout - and the two
// halves' 16-bit sums are added at each flush and flushed by the AVX2 code). Every kernel's
// totals are the AVX2 path's, bit for bit.
#pragma once
#include "../arch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

#define TQVEC_VNNI_SUMS \
  __attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"), always_inline)) inline

// Byte 4t + u of the gathered registers: code byte p + u of row t (h = 0) or 16 + t (h = 1),
// from bytes p, p + 1 (a: 64 bytes, 32 rows each) and p + 2, p + 3 (b: index bit 6).
struct RowDwords {
  alignas(64) uint8_t idx[2][64];
  constexpr RowDwords() : idx{} {
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 16; ++t)
        for (int u = 0; u < 4; ++u) idx[h][4 * t + u] = static_cast<uint8_t>(32 * u + 16 * h + t);
  }
};
inline constexpr RowDwords kRowDwords{};

// Table sums for b in {1, 2, 4} with VBMI and VNNI, four code bytes p .. p + 3 at a time: their
// 32 rows' bytes are gathered so that each 32-bit lane holds one row's four bytes (two
// vpermt2b per block, shared by the NQ queries); a nibble's index is its value with its byte's
// place in the lane in bits 4-5, so that one vpermb looks up four positions' 16-entry tables
// (the Lut's q8v), and one vpdpbusd with ones adds a row's four looked-up bytes (lo + hi
// nibble, <= 254 each) to its 32-bit total. Per query and 128 code bytes: four lookups, two
// byte adds and two dot products, where the 16-bit lanes (block_sums_avx2) take eight lookups
// and four adds, four shifts and eight adds. No flushes: the totals are exact in 32 bits, the
// other paths' totals bit for bit. Missing positions (p + u >= rb) load as zero code bytes and
// meet the zero tables that pad q8v. Rows of block j for query q land at tot[(q * NB + j) * 32
// ...].
template <int NB, int NQ>
TQVEC_VNNI_SUMS void block_sums_vnni(const uint8_t* blk, int64_t rb, const uint8_t* const* q8v,
                                     uint32_t* tot) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), place = _mm512_set1_epi32(0x30201000);
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i g0 = _mm512_load_si512(kRowDwords.idx[0]);
  const __m512i g1 = _mm512_load_si512(kRowDwords.idx[1]);
  __m512i acc[NQ][NB][2];
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j) acc[q][j][0] = acc[q][j][1] = _mm512_setzero_si512();
  for (int64_t p = 0; p < rb; p += 4) {
    // bytes p + u >= rb masked off (32 per position)
    const __mmask64 ma = p + 1 < rb ? ~__mmask64{0} : __mmask64{0xffffffffu};
    const __mmask64 mb = p + 3 < rb   ? ~__mmask64{0}
                         : p + 2 < rb ? __mmask64{0xffffffffu}
                                      : __mmask64{0};
    __m512i idx[NB][4];  // lo / hi nibble indices of rows 0-15, then of rows 16-31
    for (int j = 0; j < NB; ++j) {
      const uint8_t* c = blk + (j * rb + p) * kRows;
      const __m512i a = _mm512_maskz_loadu_epi8(ma, c);
      const __m512i b = _mm512_maskz_loadu_epi8(mb, c + 2 * kRows);
      for (int h = 0; h < 2; ++h) {
        const __m512i x = _mm512_permutex2var_epi8(a, h == 0 ? g0 : g1, b);
        // 0xea: (x & low4) | place
        idx[j][2 * h] = _mm512_ternarylogic_epi32(x, low4, place, 0xea);
        idx[j][2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 4), low4, place, 0xea);
      }
    }
    for (int q = 0; q < NQ; ++q) {
      const __m512i tl = _mm512_loadu_si512(q8v[q] + p * 32);
      const __m512i th = _mm512_loadu_si512(q8v[q] + p * 32 + 64);
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m512i r = _mm512_add_epi8(_mm512_permutexvar_epi8(idx[j][2 * h], tl),
                                            _mm512_permutexvar_epi8(idx[j][2 * h + 1], th));
          acc[q][j][h] = _mm512_dpbusd_epi32(acc[q][j][h], r, ones);
        }
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h)
        _mm512_storeu_si512(tot + (q * NB + j) * kRows + 16 * h, acc[q][j][h]);
}

// admit_block_avx2 16 rows at a time (the same float operations, so the same bounds and
// admissions): half the instructions of the per-row test.
template <class Sc>
__attribute__((target("avx2,avx512f,avx512bw"), always_inline)) inline void admit_block_avx512(
    const Sc& L, const uint32_t* bt, int64_t j, int64_t n, const float* mult, const float* add,
    float off, Shortlist& sl) {
  if (admit_partial_block(L, bt, j, n, mult, add, off, sl)) return;  // the last, partial block
  const int64_t base = j * kRows;
  const __m512 vdelta = _mm512_set1_ps(L.delta), vbias = _mm512_set1_ps(L.bias);
  const __m512 voff = _mm512_set1_ps(off);
  const __m512 verr = _mm512_set1_ps(L.err), ninf = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < kRows; g += 16) {
    const __m512 m = _mm512_loadu_ps(mult + base + g), a = _mm512_loadu_ps(add + base + g);
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_loadu_si512(bt + g));
    const __m512 s = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(m, _mm512_add_ps(_mm512_mul_ps(vdelta, sum), vbias)), a),
        voff);
    const __m512 e = _mm512_mul_ps(_mm512_abs_ps(m), verr);
    const __m512 ub = _mm512_add_ps(s, e);
    __mmask16 bits = _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(a, ninf, _CMP_GT_OQ), ub,
                                             _mm512_set1_ps(sl.threshold()), _CMP_GE_OQ);
    if (!bits) continue;
    alignas(64) float lbv[16], ubv[16];
    _mm512_store_ps(lbv, _mm512_sub_ps(s, e));
    _mm512_store_ps(ubv, ub);
    for (unsigned b = bits; b; b &= b - 1) {
      const int t = __builtin_ctz(b);
      if (ubv[t] >= sl.threshold()) sl.admit(lbv[t], ubv[t], base + g + t, off);
    }
  }
}

// The range of the per-row terms over rows [r0, r1): every row's score bound is at most
// (u >= 0 ? mmax u : mmin u) + amax + off + mmax err for its table value u = delta S + bias
// (multipliers >= 0). NaN terms are skipped (their rows are never admitted).
struct RowTerms {
  float mmin, mmax, amax;
};

__attribute__((target("avx2,avx512f"))) inline RowTerms row_terms(const float* mult,
                                                                 const float* add, int64_t r0,
                                                                 int64_t r1) {
  const float inf = std::numeric_limits<float>::infinity();
  __m512 mn = _mm512_set1_ps(inf), mx = _mm512_set1_ps(-inf), ax = _mm512_set1_ps(-inf);
  int64_t r = r0;
  // min/max(v, acc) return acc where v is NaN
  for (; r + 16 <= r1; r += 16) {
    const __m512 m = _mm512_loadu_ps(mult + r);
    mn = _mm512_min_ps(m, mn), mx = _mm512_max_ps(m, mx);
    ax = _mm512_max_ps(_mm512_loadu_ps(add + r), ax);
  }
  RowTerms t{_mm512_reduce_min_ps(mn), _mm512_reduce_max_ps(mx), _mm512_reduce_max_ps(ax)};
  for (; r < r1; ++r) {
    if (mult[r] < t.mmin) t.mmin = mult[r];
    if (mult[r] > t.mmax) t.mmax = mult[r];
    if (add[r] > t.amax) t.amax = add[r];
  }
  return t;
}

// The least table sum S a row of these terms needs for its bound to reach the threshold th
// (query tables L, score offset off), lowered to absorb float rounding; 0 where nothing can be
// excluded (no threshold yet, a negative multiplier). A block whose sums all fall below it has
// no row to admit: skipping it changes no admission, and saves the per-row test on most blocks
// once the threshold has settled.
template <class Sc>
inline uint32_t least_sum(const Sc& L, const RowTerms& t, float off, float th) {
  if (!(th > -std::numeric_limits<float>::infinity()) || !(t.mmin >= 0.0f) ||
      !(t.mmax > 0.0f) || !(t.amax < std::numeric_limits<float>::infinity()) ||
      !(L.delta > 0.0f))
    return 0;
  const double rest = static_cast<double>(t.amax) + off + static_cast<double>(t.mmax) * L.err;
  const double slack = 1e-5 * (std::fabs(static_cast<double>(th)) + std::fabs(rest) +
                               std::fabs(static_cast<double>(t.mmax) * L.bias)) + 1e-30;
  const double need = static_cast<double>(th) - rest - slack;  // what m u must reach
  double u;
  if (need >= 0.0)
    u = need / t.mmax;
  else if (t.mmin > 0.0f)
    u = need / t.mmin;
  else
    return 0;
  const double s = std::ceil((u - L.bias) / L.delta) - 1.0;
  if (!(s > 0.0)) return 0;
  return s >= 2147483647.0 ? 2147483647u : static_cast<uint32_t>(s);
}

// The row totals of nb (1 or 4) consecutive blocks by the VNNI sums into tot[0, 32 nb) (the
// Lut has q8v), callable from code compiled for other instruction sets.
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"))) inline void
block_sums_vnni_any(const Lut& L, const uint8_t* blk, int64_t rb, int nb, uint32_t* tot) {
  const uint8_t* q8[1] = {L.q8v.data()};
  if (nb == 4)
    block_sums_vnni<4, 1>(blk, rb, q8, tot);
  else
    block_sums_vnni<1, 1>(blk, rb, q8, tot);
}

// scan_blocks_avx2 with the VNNI sums (b in {1, 2, 4}): four blocks per pass.
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"))) inline void
scan_blocks_vnni(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                 int64_t j1, const float* mult, const float* add, float off, Shortlist& sl) {
  alignas(64) uint32_t tot[4 * kRows];
  for (int64_t j = j0; j < j1;) {
    const int nb = j + 4 <= j1 ? 4 : 1;
    block_sums_vnni_any(L, blocked + j * rb * kRows, rb, nb, tot);
    for (int u = 0; u < nb; ++u, ++j)
      admit_block_avx512(L, tot + u * kRows, j, n, mult, add, off, sl);
  }
}

// NQ queries (b in {1, 2, 4}) over the same blocks, by the VNNI sums.
template <int NQ>
__attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,avx512vnni"))) void scan_blocksq_vnni(
    const Lut* const* L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
    const float* mult, const float* add, const float* off, Shortlist* const* sl) {
  alignas(64) uint32_t tot[NQ * kRows];
  const uint8_t* q8[NQ];
  for (int q = 0; q < NQ; ++q) q8[q] = L[q]->q8v.data();
  const RowTerms terms = row_terms(mult, add, j0 * kRows, std::min(n, j1 * kRows));
  float th[NQ];
  __m512i least[NQ];
  for (int q = 0; q < NQ; ++q) {
    th[q] = sl[q]->threshold();
    least[q] = _mm512_set1_epi32(static_cast<int32_t>(least_sum(*L[q], terms, off[q], th[q])));
  }
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_vnni<1, NQ>(blocked + j * rb * kRows, rb, q8, tot);
    for (int q = 0; q < NQ; ++q) {
      const uint32_t* bt = tot + q * kRows;
      if (sl[q]->threshold() != th[q]) {  // raised by a compaction
        th[q] = sl[q]->threshold();
        least[q] =
            _mm512_set1_epi32(static_cast<int32_t>(least_sum(*L[q], terms, off[q], th[q])));
      }
      if (!(_mm512_cmpge_epu32_mask(_mm512_load_si512(bt), least[q]) |
            _mm512_cmpge_epu32_mask(_mm512_load_si512(bt + 16), least[q])))
        continue;
      admit_block_avx512(*L[q], bt, j, n, mult, add, off[q], *sl[q]);
    }
  }
}

#undef TQVEC_VNNI_SUMS

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
