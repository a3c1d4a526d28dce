// Per-query lookup tables of the fast scan (layouts: fastscan/tables.h and ../fastscan.h).
#include "tables.h"

#include "../kernels.h"

#include "../arch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace tqvec::fastscan {
namespace {

// Table row m: T[m][v] = sum_t q[m per + t] * c[index t of nibble value v], with cv[t][v] the
// centroid of index t of v precomputed, so the 16 entries are plain vector multiply-adds.
template <int PER>
void fill_rows(const float* q, int64_t d, const float* cv, int64_t M, float* f) {
  for (int64_t m = 0; m < M; ++m) {
    float qj[PER];
    for (int t = 0; t < PER; ++t) qj[t] = m * PER + t < d ? q[m * PER + t] : 0.0f;
    float* row = f + m * 16;
    for (int v = 0; v < 16; ++v) {
      float s = qj[0] * cv[v];
      for (int t = 1; t < PER; ++t) s += qj[t] * cv[t * 16 + v];
      row[v] = s;
    }
  }
}

#ifdef TQVEC_X86
// fill_rows with AVX2 intrinsics: each table row is two 8-float vectors, summed over t in the
// same order with the same operations (multiply, then add; no FMA) as the portable loop.
// (A template called from build_lut's target_clones is compiled for the baseline ISA only.)
template <int PER>
__attribute__((target("avx2"))) void fill_rows_avx2(const float* q, int64_t d, const float* cv,
                                                    int64_t M, float* f) {
  for (int64_t m = 0; m < M; ++m) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int t = 0; t < PER; ++t) {
      const __m256 qt = _mm256_set1_ps(m * PER + t < d ? q[m * PER + t] : 0.0f);
      const __m256 a = _mm256_mul_ps(qt, _mm256_loadu_ps(cv + t * 16));
      const __m256 b = _mm256_mul_ps(qt, _mm256_loadu_ps(cv + t * 16 + 8));
      lo = t == 0 ? a : _mm256_add_ps(lo, a);
      hi = t == 0 ? b : _mm256_add_ps(hi, b);
    }
    _mm256_storeu_ps(f + m * 16, lo);
    _mm256_storeu_ps(f + m * 16 + 8, hi);
  }
}
#endif

template <int PER>
void fill_rows_best(const float* q, int64_t d, const float* cv, int64_t M, float* f) {
#ifdef TQVEC_X86
  if (simd_avx2()) return fill_rows_avx2<PER>(q, d, cv, M, f);
#endif
  fill_rows<PER>(q, d, cv, M, f);
}

// b = 3: T[p][lo][hi] = q[2p] c[idx0] + q[2p+1] c[idx1] for the pair layout above.
void fill_pairs3(const float* q, int64_t d, const float* c, int64_t M, float* f) {
  for (int64_t p = 0; p < M; ++p) {
    const float q0 = 2 * p < d ? q[2 * p] : 0.0f, q1 = 2 * p + 1 < d ? q[2 * p + 1] : 0.0f;
    float* row = f + p * 64;
    for (int lo = 0; lo < 4; ++lo)
      for (int hi = 0; hi < 16; ++hi)
        row[lo * 16 + hi] =
            q0 * c[((hi & 3) << 1) | (lo & 1)] + q1 * c[((hi >> 2) << 1) | (lo >> 1)];
  }
}

#ifdef TQVEC_X86
// 16-entry tables (b = 1, 2, 4) with AVX2 intrinsics: the per-row min and max (exact, so any
// reduction order gives the bits of the portable loop) and the rounding below, 16 entries as two
// vectors (the compiler leaves build_lut's loops scalar or 4 wide even in its AVX2 clone).
__attribute__((target("avx2"))) void row_min_max16_avx2(const float* table, int64_t M, float* mn,
                                                        float* mx) {
  for (int64_t m = 0; m < M; ++m) {
    const __m256 a = _mm256_loadu_ps(table + m * 16), b = _mm256_loadu_ps(table + m * 16 + 8);
    __m256 lo = _mm256_min_ps(a, b), hi = _mm256_max_ps(a, b);
    lo = _mm256_min_ps(lo, _mm256_permute2f128_ps(lo, lo, 1));
    hi = _mm256_max_ps(hi, _mm256_permute2f128_ps(hi, hi, 1));
    lo = _mm256_min_ps(lo, _mm256_shuffle_ps(lo, lo, 0x4e));
    hi = _mm256_max_ps(hi, _mm256_shuffle_ps(hi, hi, 0x4e));
    lo = _mm256_min_ps(lo, _mm256_shuffle_ps(lo, lo, 0xb1));
    hi = _mm256_max_ps(hi, _mm256_shuffle_ps(hi, hi, 0xb1));
    mn[m] = _mm256_cvtss_f32(lo);
    mx[m] = _mm256_cvtss_f32(hi);
  }
}

__attribute__((target("avx2"))) void quantize_rows16_avx2(const float* table, int64_t M,
                                                          const float* lo, float inv,
                                                          uint8_t* q8) {
  const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f);
  const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(kLevels);
  for (int64_t m = 0; m < M; ++m) {
    const __m256 base = _mm256_set1_ps(lo[m]);
    __m256i v[2];
    for (int h = 0; h < 2; ++h) {
      // (t - base) * inv + 0.5, then r < 0 ? 0 : r and r > kLevels ? kLevels : r, truncated
      __m256 r = _mm256_add_ps(
          _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(table + m * 16 + 8 * h), base), vinv),
          half);
      r = _mm256_blendv_ps(r, zero, _mm256_cmp_ps(r, zero, _CMP_LT_OQ));
      r = _mm256_blendv_ps(r, top, _mm256_cmp_ps(r, top, _CMP_GT_OQ));
      v[h] = _mm256_cvttps_epi32(r);
    }
    // 16 int32 in [0, 127] -> 16 bytes in order
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xd8);
    const __m128i b8 = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + m * 16), b8);
  }
}
#endif

}  // namespace

// rb: bytes per row of the blocked layout (fs_row_bytes). The AVX2 clone vectorizes the fill,
// min/max and rounding loops 8 wide.
TQVEC_CLONES_AVX2
Lut build_lut(const float* q, int64_t d, int b, const float* c, int64_t rb, bool keep_float) {
  Lut L;
  L.M = b == 3 ? 4 * (rb / 3) : 2 * rb;
  L.E = b == 3 ? 64 : 16;
  L.q = q;
  L.c = c;
  L.d = d;
  L.b = b;
  // the exact table: kept in the Lut, or in a per-thread buffer reused across queries (no page
  // faults per call)
  thread_local std::vector<float> scratch;
  std::vector<float>& table = keep_float ? L.f : scratch;
  table.resize(static_cast<size_t>(L.M * L.E));
  L.q8.resize(static_cast<size_t>(L.M * L.E));
  if (b == 3) {
    fill_pairs3(q, d, c, L.M, table.data());
  } else {
    const int per = 4 / b;
    const int mask = (1 << b) - 1;
    float cv[4 * 16];
    for (int t = 0; t < per; ++t)
      for (int v = 0; v < 16; ++v) cv[t * 16 + v] = c[(v >> (t * b)) & mask];
    if (per == 1)
      fill_rows_best<1>(q, d, cv, L.M, table.data());
    else if (per == 2)
      fill_rows_best<2>(q, d, cv, L.M, table.data());
    else
      fill_rows_best<4>(q, d, cv, L.M, table.data());
  }
  std::vector<float> lo(static_cast<size_t>(L.M));
  float span = 0.0f;
  double bias = 0.0, absmax = 0.0;
#ifdef TQVEC_X86
  const bool rows16 = L.E == 16 && simd_avx2();
  if (rows16) {
    std::vector<float> hi(static_cast<size_t>(L.M));
    row_min_max16_avx2(table.data(), L.M, lo.data(), hi.data());
    for (int64_t m = 0; m < L.M; ++m) {  // the portable loop's float and double operations
      const float mn = lo[static_cast<size_t>(m)], mx = hi[static_cast<size_t>(m)];
      span = std::max(span, mx - mn);
      bias += mn;
      absmax += std::max(std::fabs(mn), std::fabs(mx));
    }
  }
#else
  constexpr bool rows16 = false;
#endif
  for (int64_t m = 0; !rows16 && m < L.M; ++m) {
    const float* row = &table[static_cast<size_t>(m * L.E)];
    // 8 independent lanes (E is 16 or 64): element-wise min/max vectorize, a scalar
    // running min/max (a loop-carried dependency) does not
    float lmn[8], lmx[8];
    for (int l = 0; l < 8; ++l) lmn[l] = lmx[l] = row[l];
    for (int v = 8; v < L.E; v += 8)
      for (int l = 0; l < 8; ++l) {
        lmn[l] = row[v + l] < lmn[l] ? row[v + l] : lmn[l];
        lmx[l] = row[v + l] > lmx[l] ? row[v + l] : lmx[l];
      }
    float mn = lmn[0], mx = lmx[0];
    for (int l = 1; l < 8; ++l) {
      mn = std::min(mn, lmn[l]);
      mx = std::max(mx, lmx[l]);
    }
    lo[static_cast<size_t>(m)] = mn;
    span = std::max(span, mx - mn);
    bias += mn;
    absmax += std::max(std::fabs(mn), std::fabs(mx));
  }
  L.delta = span > 0.0f ? span / kLevels : 1.0f;
  const float inv = 1.0f / L.delta;
  // Round to nearest by +0.5 and truncation (the values are >= 0): std::nearbyint is a libm
  // call that saves and restores the FP environment, and it made table building dominate
  // batched IVF search.
  // Local restrict pointers and counts: a uint8_t store may alias anything, so through L the
  // compiler reloaded the table pointers after every store and left the loop scalar.
#ifdef TQVEC_X86
  if (rows16) {
    quantize_rows16_avx2(table.data(), L.M, lo.data(), inv, L.q8.data());
  } else
#endif
  {
    const int64_t M = L.M, E = L.E;
    const float* __restrict tf = table.data();
    const float* __restrict lop = lo.data();
    uint8_t* __restrict q8 = L.q8.data();
    for (int64_t m = 0; m < M; ++m) {
      const float base = lop[m];
      for (int64_t v = 0; v < E; ++v) {  // branch-free, so that it vectorizes
        float r = (tf[m * E + v] - base) * inv + 0.5f;
        r = r < 0.0f ? 0.0f : r;
        r = r > kLevels ? kLevels : r;
        q8[m * E + v] = static_cast<uint8_t>(static_cast<int32_t>(r));
      }
    }
  }
  if (b != 3 && simd_avx512()) {
    const int64_t rb = L.M / 2, pairs = (rb + 1) / 2;
    L.q8x.assign(static_cast<size_t>(pairs * 128), 0);
    for (int64_t p = 0; p < rb; ++p)
      for (int h = 0; h < 2; ++h)  // h = 0: the low-nibble table, 1: the high-nibble one
        for (int u = 0; u < 2; ++u)
          std::memcpy(L.q8x.data() + (p / 2) * 128 + h * 64 + (p % 2) * 32 + u * 16,
                      L.q8.data() + (2 * p + h) * 16, 16);
  }
  if (uses_vnni_sums(b)) {
    const int64_t rb = L.M / 2;
    L.q8v.assign(static_cast<size_t>((rb + 3) / 4 * 128), 0);
    for (int64_t p = 0; p < rb; ++p)
      for (int h = 0; h < 2; ++h)  // h = 0: the low-nibble table, 1: the high-nibble one
        std::memcpy(L.q8v.data() + (p / 4) * 128 + h * 64 + (p % 4) * 16,
                    L.q8.data() + (2 * p + h) * 16, 16);
  }
  L.bias = static_cast<float>(bias);
  // Rounding moves each entry by at most delta/2, so a row's error is a sum of M bounded terms
  // that depend on its codes. The worst case (M * delta / 2) is far too loose to prune with at
  // large M; Hoeffding's inequality, P(|err| >= t) <= 2 exp(-2 t^2 / (M delta^2)), gives
  // t = delta * sqrt(M * ln(2 / 1e-9) / 2) for a miss probability below 1e-9 per row (codes
  // behave as random draws here: the rotation makes coordinates exchangeable). The min() keeps
  // the exact bound where it is tighter (small M). The rest covers float rounding of the exact
  // and approximate sums (relative 1e-5 of the largest possible |S|).
  const double M = static_cast<double>(L.M);
  const double hoeffding = L.delta * std::sqrt(M * std::log(2.0 / 1e-9) / 2.0);
  L.err = static_cast<float>(std::min(0.5 * L.delta * M, hoeffding) * 1.001 + 1e-5 * absmax);
  return L;
}

bool uses_dot(int b, bool exact) { return exact && b == 4 && simd_vnni(); }

bool uses_vnni_sums(int b) { return (b == 1 || b == 2 || b == 4) && simd_vnni() && !simd_avx512(); }

void add_dot(Lut& L, int64_t rb) {
  const int64_t d = L.d;
  // levels: the 16 centroids on 255 steps of their range
  float cmin = L.c[0], cmax = L.c[0];
  for (int v = 1; v < 16; ++v) cmin = std::min(cmin, L.c[v]), cmax = std::max(cmax, L.c[v]);
  const double sl = cmax > cmin ? (static_cast<double>(cmax) - cmin) / 255.0 : 1.0;
  double ec = 0.0, chat = 0.0;  // the largest level error |c - c^| and level |c^|
  for (int v = 0; v < 16; ++v) {
    const double l = std::min(255.0, std::max(0.0, std::floor((L.c[v] - cmin) / sl + 0.5)));
    for (int lane = 0; lane < 4; ++lane) L.lev[lane * 16 + v] = static_cast<uint8_t>(l);
    const double ch = cmin + sl * l;
    ec = std::max(ec, std::fabs(L.c[v] - ch));
    chat = std::max(chat, std::fabs(ch));
  }
  // weights: the query on 127 steps of its largest coordinate, zero past d
  double qmax = 0.0;
  for (int64_t j = 0; j < d; ++j) qmax = std::max(qmax, static_cast<double>(std::fabs(L.q[j])));
  const double sw = qmax > 0.0 ? qmax / 127.0 : 1.0;
  L.w.assign(static_cast<size_t>(2 * rb + 4), 0);
  double wsum = 0.0, a1 = 0.0, a2 = 0.0, absmax = 0.0;
  for (int64_t j = 0; j < d; ++j) {
    const double wj = std::min(127.0, std::max(-127.0, std::floor(L.q[j] / sw + 0.5)));
    L.w[static_cast<size_t>(j)] = static_cast<int8_t>(wj);
    wsum += wj;
    // q c - q^ c^ = q (c - c^) + c^ (q - q^): at most a_j per coordinate
    const double a = std::fabs(L.q[j]) * ec + chat * std::fabs(L.q[j] - sw * wj);
    a1 += a, a2 += a * a;
    absmax += std::fabs(L.q[j]) * std::max(std::fabs(cmin), std::fabs(cmax));
  }
  L.dot.delta = static_cast<float>(sw * sl);
  L.dot.bias = static_cast<float>(sw * cmin * wsum);
  // The table bound's argument (build_lut): the worst case, or Hoeffding's with terms in
  // [-a_j, a_j] at a miss probability below 1e-9 per row; then float rounding - of the sum's
  // conversion where |S| can pass 2^24, and of the exact and approximate scores.
  const double hoeffding = std::sqrt(2.0 * a2 * std::log(2.0 / 1e-9));
  const double smax = 255.0 * 127.0 * static_cast<double>(d);
  L.dot.err = static_cast<float>(std::min(a1, hoeffding) * 1.001 + 1e-5 * absmax +
                                 sw * sl * smax * std::ldexp(1.0, -24));
}

}  // namespace tqvec::fastscan
