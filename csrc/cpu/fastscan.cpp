// Fast-scan of packed 1/2/3/4-bit codes: 7-bit lookup tables in SIMD registers (the FAISS PQ
// fast-scan idea applied to our scalar codebooks), then an exact float re-score of a shortlist,
// so the result has the meaning of lut_scan_ref (tqvec/ops/ref.py) within float rounding.
// Layouts:
//   packed    (n, rb)        uint8   rows as in kernels.h, rb = ceil(d*b/8), b in {1, 2, 3, 4}
//   blocked   (nb, fb, 32)   uint8   nb = ceil(n/32); blocked[j][p][t] = row[32j+t][p], rows
//                                    past n are zero. One 32-byte load = byte p of 32 rows.
//                                    row = the packed row for b in {1, 2, 4} (fb = rb); for b = 3
//                                    the pair-plane row below (fb = 3 ceil(d/8)).
// b = 3: 3-bit indices never fill a nibble, so each group of 8 coordinates (3 bytes, 4 pairs)
// is stored as byte 0 = hi(pair 0) | hi(pair 1) << 4, byte 1 = hi(pair 2) | hi(pair 3) << 4,
// byte 2 = lo(pair 0) | lo(pair 1) << 2 | lo(pair 2) << 4 | lo(pair 3) << 6, where pair p holds
// coordinates 2p, 2p+1, hi = (idx_2p >> 1) | (idx_2p+1 >> 1) << 2 and lo = (idx_2p & 1) |
// (idx_2p+1 & 1) << 1 — still exactly 3 bits per coordinate. A pair's 6 bits index a 64-entry
// table, looked up as four 16-entry shuffles on `hi` and two byte blends on the bits of `lo`.
//   qr        (nq, d)        float32 queries in the codes' (rotated) domain
//   centroids (2^b)          float32
//   mult, add (n)            float32 score_i = mult_i * <qr, c[idx_i]> + add_i (add may be -inf)
//   out_vals  (nq, k)        float32 best first, -inf where fewer than k finite scores
//   out_idx   (nq, k)        int64   row positions, -1 where missing
// For b in {1, 2, 4} every nibble of a row (bits [4m, 4m+4) of its stream) holds 4/b whole
// indices, so <qr, c[idx]> = sum_m T[m][nibble_m] with a 16-entry table per nibble position
// (b = 3: a 64-entry table per pair). T is quantized to 7 bits with one step `delta` for all
// positions (per-position offsets), summed with 16-bit lanes (pshufb lookups, flushed to 32
// bits every 256 bytes so nothing overflows) and
// the approximation error is bounded (see build_lut: the worst case delta * M / 2 for small M,
// else a Hoeffding bound that fails with probability < 1e-9 per row). A row can only be in the
// top k if its upper bound reaches the k-th best lower bound seen so far; those rows (typically
// a few k) are re-scored exactly with the float table.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <cstdlib>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "rescore_codes.h"
#include "topk.h"

namespace tqvec {
namespace {

constexpr int64_t kRows = 32;         // rows per block
constexpr int64_t kFlushBytes = 256;  // <= 254 per byte and row: 256 * 254 < 65536
constexpr int64_t kFlushGroups3 = 128;  // b = 3: <= 508 per group and row: 128 * 508 < 65536
constexpr float kLevels = 127.0f;     // table entries are 7-bit: two of them add in 8 bits

// Per query: the quantized table, and for the flat scan also the float table, which makes the
// exact re-score of a candidate M lookups instead of d multiply-adds with index arithmetic
// (Fashion-MNIST, 4 bits: ~300 candidates of 784 coordinates per query at k = 10). The IVF
// scan drops it for batches of more than 64 queries (32 rb bytes per query, not 160 rb); their
// re-score reads the query and centroids.
struct Lut {
  int64_t M = 0;                 // table positions: nibbles (2 rb), or pairs for b = 3
  int64_t E = 16;                // entries per position: 16, or 64 for b = 3 ((lo, hi) order)
  std::vector<uint8_t> q8;       // (M, E) quantized: T ~ delta * q8 + offset[m]
  std::vector<float> f;          // (M, E) the float table, or empty
  float delta = 1.0f, bias = 0.0f, err = 0.0f;  // S ~ delta * sum q8 + bias, |error| <= err
  const float* q = nullptr;      // (d) the query, rotated
  const float* c = nullptr;      // (2^b) centroids
  int64_t d = 0;
  int b = 0;
};

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

// 16-entry tables (b = 1, 2, 4) with AVX2 intrinsics: the per-row min and max (exact, so any
// reduction order gives the bits of the portable loop) and the rounding below, 16 entries as two
// vectors. GCC left build_lut's loops scalar or 4 wide even in its AVX2 clone: ~3 us per query
// at d = 784, 1 bit, 18 % of a batched IVF scan.
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

// rb: bytes per row of the blocked layout (fs_row_bytes). AVX2 clone: the fill, min/max and
// rounding loops vectorize 8 wide (at d = 784, 4 bits: 12,544 entries per query, a quarter of
// a one-query IVF scan with the baseline 4-wide build).
__attribute__((target_clones("avx2", "default")))
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
    const bool avx2 = simd_avx2();
    if (per == 1)
      (avx2 ? fill_rows_avx2<1> : fill_rows<1>)(q, d, cv, L.M, table.data());
    else if (per == 2)
      (avx2 ? fill_rows_avx2<2> : fill_rows<2>)(q, d, cv, L.M, table.data());
    else
      (avx2 ? fill_rows_avx2<4> : fill_rows<4>)(q, d, cv, L.M, table.data());
  }
  std::vector<float> lo(static_cast<size_t>(L.M));
  float span = 0.0f;
  double bias = 0.0, absmax = 0.0;
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
  // batched IVF search (~100 us per query at d = 784, b = 4).
  // Local restrict pointers and counts: a uint8_t store may alias anything, so through L the
  // compiler reloaded the table pointers after every store and left the loop scalar.
  if (rows16) {
    quantize_rows16_avx2(table.data(), L.M, lo.data(), inv, L.q8.data());
  } else {
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

// Per query: the lower bounds of the rows admitted so far (at least the k best of them), the
// admission threshold (the k-th best lower bound at the last compaction: it only lags behind,
// which admits a few extra rows, never loses one), and the admitted rows with their upper
// bounds. Admission is two appends; every k admissions a compaction (select_kth_largest over
// <= 2k bounds) raises the threshold and drops the rows it excludes - O(1) per admission where
// a heap of k bounds cost O(log k) (at k = 100-200, the first pass of a two-stage scan, the
// heap work had grown to half the scan).
struct Shortlist {
  int64_t k;
  float th = -std::numeric_limits<float>::infinity();
  std::vector<float> lbs, tmp;
  struct Cand {
    // Built in place by emplace_back: a braced temporary was assembled on the stack by scalar
    // stores and copied by a 16-byte load that stalled on store forwarding (11 % of a batched
    // IVF scan's samples sat on it; ~250 admissions per query at k = 40). Removing the stall
    // moved those samples to the compaction that follows: no net time change was measured.
    Cand(float u, int64_t r, float o) : ub(u), row(r), off(o) {}
    float ub;
    int64_t row;
    float off;  // the row's range offset (ivf_fast_scan), added again at the exact re-score
  };
  std::vector<Cand> cand;
  explicit Shortlist(int64_t kk) : k(kk) { lbs.reserve(static_cast<size_t>(2 * kk + 1)); }
  float threshold() const { return th; }
  void admit(float lb, float ub, int64_t i, float off) {
    cand.emplace_back(ub, i, off);
    lbs.push_back(lb);
    if (static_cast<int64_t>(lbs.size()) >= 2 * k) compact();
  }
  void compact() {
    th = std::max(th, select_kth_largest(lbs.data(), static_cast<int64_t>(lbs.size()), k, tmp));
    lbs.resize(static_cast<size_t>(k));
    // Branch-free filter (every row copied, the write position advanced by the test): about
    // half of the rows go either way, and remove_if's branch mispredicted on them (16 % of a
    // batched IVF scan).
    const float t = th;
    size_t w = 0;
    for (size_t r = 0; r < cand.size(); ++r) {
      cand[w] = cand[r];
      w += !(cand[r].ub < t);  // as remove_if(ub < t): a NaN bound stays
    }
    cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(w), cand.end());
  }
};

// Approximate score and bound of row i from its table sum; admits it if it can reach the top k.
// `off` is added to every score of the rows being scanned (0 for a flat scan; the query's
// offset of the inverted list in ivf_fast_scan).
inline void consider(const Lut& L, uint32_t tot, int64_t i, const float* mult, const float* add,
                     float off, Shortlist& sl) {
  const float a = add[i];
  if (!(a > -std::numeric_limits<float>::infinity())) return;
  const float s = mult[i] * (L.delta * static_cast<float>(tot) + L.bias) + a + off;
  const float e = std::fabs(mult[i]) * L.err;
  if (s + e >= sl.threshold()) sl.admit(s - e, s + e, i, off);
}

// Table sums of the 32 rows of one block (portable loop).
void block_sums_scalar(const Lut& L, const uint8_t* blk, int64_t rb, uint32_t* tot) {
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

void scan_blocks_scalar(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                        int64_t j1, const float* mult, const float* add, float off,
                        Shortlist& sl) {
  uint32_t tot[kRows];
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_scalar(L, blocked + j * rb * kRows, rb, tot);
    const int64_t base = j * kRows, rows = std::min(kRows, n - base);
    for (int64_t t = 0; t < rows; ++t) consider(L, tot[t], base + t, mult, add, off, sl);
  }
}

// 16-bit lane sums (all = even row + 256 odd row, odd) -> the u32 totals tt.
template <int NB, int NQ>
__attribute__((target("avx2"), always_inline)) inline void flush_u16(
    __m256i (&all)[NQ][NB], __m256i (&odd)[NQ][NB], __m256i (&tt)[NQ][NB][4]) {
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < NB; ++j) {
      const __m256i o = odd[q][j];
      const __m256i even = _mm256_sub_epi16(all[q][j], _mm256_slli_epi16(o, 8));
      __m256i* t = tt[q][j];
      t[0] = _mm256_add_epi32(t[0], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(even)));
      t[1] = _mm256_add_epi32(t[1], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(even, 1)));
      t[2] = _mm256_add_epi32(t[2], _mm256_cvtepu16_epi32(_mm256_castsi256_si128(o)));
      t[3] = _mm256_add_epi32(t[3], _mm256_cvtepu16_epi32(_mm256_extracti128_si256(o, 1)));
    }
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

// Bounds of the 32 rows of block j (sums bt) against the query's threshold, 8 rows at a time;
// only rows that pass (a few per query in all, once the heap is full) leave the vector path.
__attribute__((target("avx2"), always_inline)) inline void admit_block_avx2(
    const Lut& L, const uint32_t* bt, int64_t j, int64_t n, const float* mult, const float* add,
    float off, Shortlist& sl) {
  const int64_t base = j * kRows;
  if (n - base < kRows) {  // last, partial block
    for (int64_t t = 0; t < n - base; ++t) consider(L, bt[t], base + t, mult, add, off, sl);
    return;
  }
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

__attribute__((target("avx2"))) void scan_blocks_avx2(const Lut& L, const uint8_t* blocked,
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

// Queries per pass of the multi-query scan: 3 (four queries' 8 accumulators plus tables and
// temporaries overflowed the 16 registers: two accumulators lived on the stack, a store-to-load
// forwarding delay per byte; 3 per pass was 10-14 % faster at b = 1, 2, 4, MiniLM batch), 2 for
// b = 3 (its pair tables take more registers).
inline int queries_per_pass(int b) { return b == 3 ? 2 : 3; }

// Scans the first count queries of the lut/shortlist arrays (count a multiple of nq, which is
// queries_per_pass: 2 or 3) over blocks [j0, j1), nq at a time, with per-query offsets off.
void scan_query_groups(int nq, const Lut* const* L, Shortlist* const* sl, int64_t count,
                       const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0, int64_t j1,
                       const float* mult, const float* add, const float* off) {
  for (int64_t g = 0; g + nq <= count; g += nq) {
    if (nq == 2)
      scan_blocksq_avx2<2>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
    else
      scan_blocksq_avx2<3>(L + g, blocked, rb, n, j0, j1, mult, add, off + g, sl + g);
  }
}

}  // namespace

bool simd_avx2() {
  static const bool avx2 = [] {
    const char* v = std::getenv("TQVEC_SIMD");
    return __builtin_cpu_supports("avx2") && !(v != nullptr && std::string(v) == "scalar");
  }();
  return avx2;
}

namespace {

void scan_blocks(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                 int64_t j1, const float* mult, const float* add, float off, Shortlist& sl) {
  if (simd_avx2())
    scan_blocks_avx2(L, blocked, rb, n, j0, j1, mult, add, off, sl);
  else
    scan_blocks_scalar(L, blocked, rb, n, j0, j1, mult, add, off, sl);
}

// <q, c[idx]> of row i in float32, summed per nibble as the table would (low, high nibble in
// two accumulators).
float exact_score(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t i) {
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

// One query's blocks [0, nb) split between t threads, each scanned by scan(j0, j1, shortlist)
// into its own shortlist (finish() merges them).
template <class Scan>
std::vector<Shortlist> split_blocks(int64_t nb, int64_t t, int64_t k, Scan&& scan) {
  std::vector<Shortlist> sls(static_cast<size_t>(t), Shortlist(k));
  const int64_t chunk = (nb + t - 1) / t;
  run_workers(t, [&](int64_t w) {
    scan(std::min(nb, w * chunk), std::min(nb, (w + 1) * chunk), sls[static_cast<size_t>(w)]);
  });
  return sls;
}

std::vector<Shortlist*> pointers(std::vector<Shortlist>& sls) {
  std::vector<Shortlist*> parts;
  for (auto& s : sls) parts.push_back(&s);
  return parts;
}

// The k-th best lower bound over a query's shortlists: rows whose upper bound is below it
// cannot be in the top k.
float final_threshold(const std::vector<Shortlist*>& parts, int64_t k) {
  std::vector<float> lbs;
  for (auto* s : parts) lbs.insert(lbs.end(), s->lbs.begin(), s->lbs.end());
  if (static_cast<int64_t>(lbs.size()) < k) return -std::numeric_limits<float>::infinity();
  std::vector<float> tmp;
  return select_kth_largest(lbs.data(), static_cast<int64_t>(lbs.size()), k, tmp);
}

// The admitted rows whose upper bound reaches the final threshold, highest bound first, are
// re-scored by score(row) until k exact scores exceed every remaining bound (a row's exact
// score never exceeds its bound, so the rest cannot enter). IVF's short lists keep bounds loose
// next to the score gaps: re-scoring every admitted row was 36 % of a batched IVF search.
// Writes the top k.
template <class Score>
void rescore_best_first(const std::vector<Shortlist*>& parts, int64_t k, Score&& score,
                        float* vals, int64_t* idx) {
  const float th = final_threshold(parts, k);
  std::vector<const Shortlist::Cand*> order;
  for (auto* s : parts)
    for (const auto& c : s->cand)
      if (c.ub >= th) order.push_back(&c);
  std::sort(order.begin(), order.end(), [](const Shortlist::Cand* a, const Shortlist::Cand* b) {
    return a->ub > b->ub || (a->ub == b->ub && a->row < b->row);
  });
  std::vector<Hit> hits;
  std::vector<float> best;  // min-heap of the k best exact scores so far
  best.reserve(static_cast<size_t>(k));
  for (const auto* c : order) {
    // strictly greater: a row whose bound equals the k-th score could still tie it
    if (static_cast<int64_t>(best.size()) == k && best.front() > c->ub) break;
    const float v = score(*c);
    hits.emplace_back(v, c->row);
    if (!(v > -std::numeric_limits<float>::infinity())) continue;
    if (static_cast<int64_t>(best.size()) < k) {
      best.push_back(v);
      std::push_heap(best.begin(), best.end(), std::greater<float>());
    } else if (v > best.front()) {
      std::pop_heap(best.begin(), best.end(), std::greater<float>());
      best.back() = v;
      std::push_heap(best.begin(), best.end(), std::greater<float>());
    }
  }
  write_topk(hits, k, vals, idx);
}

void finish(const Lut& L, const uint8_t* blocked, int64_t rb, const float* mult, const float* add,
            std::vector<Shortlist*> parts, int64_t k, float* vals, int64_t* idx) {
  rescore_best_first(parts, k, [&](const Shortlist::Cand& c) {
    return mult[c.row] * exact_score(L, blocked, rb, c.row) + add[c.row] + c.off;
  }, vals, idx);
}

// Approximate results (tables with a zero error bound: lb = ub = the table score): the top k
// admitted rows by that score, written as it is.
void finish_approx(const std::vector<Shortlist*>& parts, int64_t k, float* vals, int64_t* idx) {
  const float th = final_threshold(parts, k);
  std::vector<Hit> hits;
  for (auto* s : parts)
    for (const auto& c : s->cand)
      if (c.ub >= th) hits.emplace_back(c.ub, c.row);
  write_topk(hits, k, vals, idx);
}

// ---- several terms per row (fast_scan_terms) ------------------------------------------------
// score_i = add_i + sum_t mult_t[i] <qr_t, c_t[idx_t,i]>: each term has its own codes, width,
// table and multiplier; a row's bound is the sum of the terms' bounds.
struct TermScan {
  Lut L;
  const uint8_t* blocked;
  int64_t rb;
  const float* mult;
};

constexpr int kMaxTerms = 8;  // = ops.MAX_SCAN_TERMS (mixed-width codes: one term per run)

void admit_terms_scalar(const std::vector<TermScan>& ts, uint32_t (*tot)[4 * kRows], int u,
                        int64_t j, int64_t n, const float* add, Shortlist& sl) {
  const int64_t base = j * kRows, rows = std::min(kRows, n - base);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t i = base + t;
    const float a = add[i];
    if (!(a > -std::numeric_limits<float>::infinity())) continue;
    float s = a, e = 0.0f;
    for (size_t x = 0; x < ts.size(); ++x) {
      const Lut& L = ts[x].L;
      const float m = ts[x].mult[i];
      s += m * (L.delta * static_cast<float>(tot[x][u * kRows + t]) + L.bias);
      e += std::fabs(m) * L.err;
    }
    if (s + e >= sl.threshold()) sl.admit(s - e, s + e, i, 0.0f);
  }
}

__attribute__((target("avx2"))) void admit_terms_avx2(const std::vector<TermScan>& ts,
                                                      uint32_t (*tot)[4 * kRows], int u,
                                                      int64_t j, int64_t n, const float* add,
                                                      Shortlist& sl) {
  const int64_t base = j * kRows;
  if (n - base < kRows) {
    admit_terms_scalar(ts, tot, u, j, n, add, sl);
    return;
  }
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int g = 0; g < kRows; g += 8) {
    const __m256 a = _mm256_loadu_ps(add + base + g);
    __m256 s = a, e = _mm256_setzero_ps();
    for (size_t x = 0; x < ts.size(); ++x) {
      const Lut& L = ts[x].L;
      const __m256 m = _mm256_loadu_ps(ts[x].mult + base + g);
      const __m256 sum = _mm256_cvtepi32_ps(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(tot[x] + u * kRows + g)));
      s = _mm256_add_ps(s, _mm256_mul_ps(m, _mm256_add_ps(
                                                _mm256_mul_ps(_mm256_set1_ps(L.delta), sum),
                                                _mm256_set1_ps(L.bias))));
      e = _mm256_add_ps(e, _mm256_mul_ps(_mm256_and_ps(m, absmask), _mm256_set1_ps(L.err)));
    }
    const __m256 ub = _mm256_add_ps(s, e);
    const __m256 th = _mm256_set1_ps(sl.threshold());
    int bits = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ub, th, _CMP_GE_OQ),
                                                _mm256_cmp_ps(a, ninf, _CMP_GT_OQ)));
    if (!bits) continue;
    // the few rows that pass leave the vector path (scalar, same arithmetic order per term)
    alignas(32) float sv[8], ev[8];
    _mm256_store_ps(sv, s);
    _mm256_store_ps(ev, e);
    while (bits) {
      const int t = __builtin_ctz(bits);
      bits &= bits - 1;
      if (sv[t] + ev[t] >= sl.threshold())
        sl.admit(sv[t] - ev[t], sv[t] + ev[t], base + g + t, 0.0f);
    }
  }
}

// b = 3 takes its 4 blocks as two passes of 2: its pair tables leave registers for only two
// blocks' accumulators (4 spilled them to the stack, as scan_blocks_avx2 notes).
__attribute__((target("avx2"))) void term_sums_avx2(const TermScan& T, int64_t j, int nb,
                                                    uint32_t* tot) {
  const uint8_t* q8[1] = {T.L.q8.data()};
  const uint8_t* blk = T.blocked + j * T.rb * kRows;
  if (nb == 4 && T.L.b == 3) {
    block_sums3_avx2<2, 1>(blk, T.rb, q8, tot);
    block_sums3_avx2<2, 1>(blk + 2 * T.rb * kRows, T.rb, q8, tot + 2 * kRows);
  } else if (nb == 4) {
    block_sums<4, 1>(T.L.b, blk, T.rb, q8, tot);
  } else {
    block_sums<1, 1>(T.L.b, blk, T.rb, q8, tot);
  }
}

// Table sums of the terms [0, nt) over blocks j .. j + nb - 1 (nb = 4 where SIMD and 4 blocks
// remain, else 1) into tot[x].
void term_sums(const std::vector<TermScan>& ts, size_t nt, int64_t j, int nb, bool simd,
               uint32_t (*tot)[4 * kRows]) {
  for (size_t x = 0; x < nt; ++x) {
    if (simd)
      term_sums_avx2(ts[x], j, nb, tot[x]);
    else
      block_sums_scalar(ts[x].L, ts[x].blocked + j * ts[x].rb * kRows, ts[x].rb, tot[x]);
  }
}

void scan_terms(const std::vector<TermScan>& ts, int64_t n, int64_t j0, int64_t j1,
                const float* add, Shortlist& sl) {
  alignas(32) uint32_t tot[kMaxTerms][4 * kRows];
  const bool simd = simd_avx2();
  for (int64_t j = j0; j < j1;) {
    const int nb = simd && j + 3 < j1 ? 4 : 1;
    term_sums(ts, ts.size(), j, nb, simd, tot);
    for (int u = 0; u < nb; ++u, ++j) {
      if (simd)
        admit_terms_avx2(ts, tot, u, j, n, add, sl);
      else
        admit_terms_scalar(ts, tot, u, j, n, add, sl);
    }
  }
}

// The first pass of a two-stage scan over several terms: the approximate (8-bit table) scores
// of rows [32 j0, 32 j1) from the leading nfirst terms only, s_i = add_i + sum_{t < nfirst}
// mult_t[i] (delta_t tot_t + bias_t) - no bound: the second pass re-scores what it keeps.
__attribute__((target_clones("avx2", "default")))
void first_scores_terms(const std::vector<TermScan>& ts, size_t nfirst, int64_t n, int64_t j0,
                        int64_t j1, const float* add, float* s) {
  alignas(32) uint32_t tot[kMaxTerms][4 * kRows];
  const bool simd = simd_avx2();
  for (int64_t j = j0; j < j1;) {
    const int nb = simd && j + 3 < j1 ? 4 : 1;
    term_sums(ts, nfirst, j, nb, simd, tot);
    for (int u = 0; u < nb; ++u, ++j) {
      const int64_t base = j * kRows, rows = std::min(kRows, n - base);
      float acc[kRows];
      for (int64_t t = 0; t < rows; ++t) acc[t] = add[base + t];
      for (size_t x = 0; x < nfirst; ++x) {  // terms outer: the row loop vectorizes
        const float delta = ts[x].L.delta, bias = ts[x].L.bias;
        const float* m = ts[x].mult + base;
        const uint32_t* tt = tot[x] + u * kRows;
        for (int64_t t = 0; t < rows; ++t)
          acc[t] += m[t] * (delta * static_cast<float>(static_cast<int32_t>(tt[t])) + bias);
      }
      std::memcpy(s + base, acc, static_cast<size_t>(rows) * sizeof(float));
    }
  }
}

// The second pass: query qi's exact scores of the candidate rows with every term, read from the
// terms' packed (row-major) codes - a few cache lines per row and term where the blocked layout
// spreads a row over rb lines - with a few rows fetched ahead so the misses overlap.
void rescore_terms(const ScanTerm* terms, int nterms, int64_t qi, const std::vector<int64_t>& rows,
                   const float* add, int64_t k, float* vals, int64_t* idx) {
  thread_local std::vector<float> tables[kMaxTerms];
  const float* q[kMaxTerms];
  int64_t rbs[kMaxTerms];
  float hs[kMaxTerms];
  for (int x = 0; x < nterms; ++x) {
    const ScanTerm& T = terms[x];
    q[x] = T.qr + qi * T.d;
    rbs[x] = (T.d * T.b + 7) / 8;
    rescore_table(q[x], T.d, T.b, T.centroids, tables[x]);
    hs[x] = T.b >= 3 ? grid_half_step(T.centroids, T.b) : 0.0f;
  }
  constexpr size_t kAhead = 8;
  auto fetch = [&](size_t r) {
    for (int x = 0; x < nterms; ++x) {
      const uint8_t* p = terms[x].packed + rows[r] * rbs[x];
      for (int64_t o = 0; o < rbs[x]; o += 64) __builtin_prefetch(p + o);
    }
  };
  for (size_t r = 0; r < std::min(kAhead, rows.size()); ++r) fetch(r);
  std::vector<Hit> hits;
  hits.reserve(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    if (r + kAhead < rows.size()) fetch(r + kAhead);
    const int64_t i = rows[r];
    float v = 0.0f;
    for (int x = 0; x < nterms; ++x) {
      const ScanTerm& T = terms[x];
      v += T.mult[i] * rescore_row(q[x], tables[x].data(), T.packed + i * rbs[x], T.d, T.b,
                                   T.centroids, hs[x]);
    }
    hits.emplace_back(v + add[i], i);
  }
  write_topk(hits, k, vals, idx);
}

void finish_terms(const std::vector<TermScan>& ts, const float* add,
                  std::vector<Shortlist*> parts, int64_t k, float* vals, int64_t* idx) {
  rescore_best_first(parts, k, [&](const Shortlist::Cand& c) {
    float v = 0.0f;
    for (const auto& T : ts) v += T.mult[c.row] * exact_score(T.L, T.blocked, T.rb, c.row);
    return v + add[c.row];
  }, vals, idx);
}

}  // namespace

void block_codes(const uint8_t* packed, int64_t n, int64_t d, int b, uint8_t* blocked,
                 int nthreads) {
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t rb = (d * b + 7) / 8, fb = fs_row_bytes(d, b);
  auto work = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* out = blocked + j * fb * kRows;
      const int64_t rows = std::min(kRows, n - j * kRows);
      if (rows < kRows) std::memset(out, 0, static_cast<size_t>(fb * kRows));
      for (int64_t t = 0; t < rows; ++t) {
        const uint8_t* row = packed + (j * kRows + t) * rb;
        if (b != 3) {
          for (int64_t p = 0; p < rb; ++p) out[p * kRows + t] = row[p];
          continue;
        }
        // 8 indices = 24 bits = bytes 3g .. 3g+2 of the LSB-first stream -> the pair layout
        for (int64_t g = 0; g < fb / 3; ++g) {
          uint32_t w = 0;
          for (int u = 0; u < 3; ++u)
            if (3 * g + u < rb) w |= static_cast<uint32_t>(row[3 * g + u]) << (8 * u);
          const int64_t valid = std::min<int64_t>(8, d - 8 * g);  // padding indices are 0
          if (valid < 8) w &= (1u << (3 * valid)) - 1;
          uint32_t hi = 0, lo = 0;
          for (int u = 0; u < 8; ++u) {
            const uint32_t idx = (w >> (3 * u)) & 7;
            hi |= (idx >> 1) << (2 * u);
            lo |= (idx & 1) << u;
          }
          out[(3 * g) * kRows + t] = static_cast<uint8_t>(hi & 0xff);
          out[(3 * g + 1) * kRows + t] = static_cast<uint8_t>(hi >> 8);
          out[(3 * g + 2) * kRows + t] = static_cast<uint8_t>(lo);
        }
      }
    }
  };
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, nb / 64));
  const int64_t chunk = (nb + t - 1) / t;
  run_workers(t, [&](int64_t w) { work(std::min(nb, w * chunk), std::min(nb, (w + 1) * chunk)); });
}

namespace {

// fast_scan's query/thread schedule with the shortlist length k_scan and a finisher
// fin(qi, lut, shortlists) that writes query qi's results. approx: tables without the exact
// float copy and with a zero error bound, so a shortlist holds the rows of the best
// approximate (quantized-table) scores, each with that score as its bound.
// qstride: floats between consecutive queries (>= d: a two-stage scan's first pass reads the
// first d coordinates of its queries).
template <class Finish>
void fast_scan_impl(const float* qr, int64_t nq, int64_t d, int64_t qstride,
                    const uint8_t* blocked, int64_t n, int b, const float* centroids,
                    const float* mult, const float* add, int64_t k_scan, bool approx,
                    int nthreads, Finish&& fin) {
  const int64_t rb = fs_row_bytes(d, b);
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t t = std::max(1, nthreads);
  auto lut = [&](int64_t qi) {
    Lut L = build_lut(qr + qi * qstride, d, b, centroids, rb, !approx);
    if (approx) L.err = 0.0f;
    return L;
  };
  if (nq >= t || nb < 64) {
    // Threads over queries. A chunk of blocks that fits in L2 is scanned for a group of queries
    // before moving on, so codes come from memory once per group, not once per query.
    const int64_t group = 12;  // a multiple of 2 and 3 queries per pass
    const int64_t chunk_blocks = std::max<int64_t>(1, (192 * 1024) / (rb * kRows));
    const int64_t tq = std::min<int64_t>(t, nq);
    auto work = [&](int64_t w) {
      for (int64_t g0 = w * group; g0 < nq; g0 += tq * group) {
        const int64_t g1 = std::min(nq, g0 + group);
        std::vector<Lut> luts;
        std::vector<Shortlist> sls;
        for (int64_t qi = g0; qi < g1; ++qi) {
          luts.push_back(lut(qi));
          sls.emplace_back(k_scan);
        }
        const size_t ng = luts.size();
        std::vector<const Lut*> lp;
        std::vector<Shortlist*> sp;
        for (size_t g = 0; g < ng; ++g) lp.push_back(&luts[g]), sp.push_back(&sls[g]);
        const std::vector<float> zero(ng, 0.0f);
        const int qpp = queries_per_pass(b);
        const size_t grouped = simd_avx2() ? ng / qpp * qpp : 0;
        for (int64_t c0 = 0; c0 < nb; c0 += chunk_blocks) {
          const int64_t c1 = std::min(nb, c0 + chunk_blocks);
          scan_query_groups(qpp, lp.data(), sp.data(), static_cast<int64_t>(grouped), blocked,
                            rb, n, c0, c1, mult, add, zero.data());
          for (size_t g = grouped; g < ng; ++g)
            scan_blocks(luts[g], blocked, rb, n, c0, c1, mult, add, 0.f, sls[g]);
        }
        for (size_t g = 0; g < luts.size(); ++g)
          fin(g0 + static_cast<int64_t>(g), luts[g], std::vector<Shortlist*>{&sls[g]});
      }
    };
    run_workers(tq, work);
    return;
  }
  // Few queries: split the blocks between threads, merge their shortlists.
  for (int64_t qi = 0; qi < nq; ++qi) {
    const Lut L = lut(qi);
    std::vector<Shortlist> sls = split_blocks(nb, t, k_scan, [&](int64_t j0, int64_t j1,
                                                                 Shortlist& sl) {
      scan_blocks(L, blocked, rb, n, j0, j1, mult, add, 0.f, sl);
    });
    fin(qi, L, pointers(sls));
  }
}

}  // namespace

void fast_scan(const float* qr, int64_t nq, int64_t d, const uint8_t* blocked, int64_t n, int b,
               const float* centroids, const float* mult, const float* add, int64_t k,
               bool approx, float* out_vals, int64_t* out_idx, int nthreads) {
  const int64_t rb = fs_row_bytes(d, b);
  fast_scan_impl(qr, nq, d, d, blocked, n, b, centroids, mult, add, k, approx, nthreads,
                 [&](int64_t qi, const Lut& L, std::vector<Shortlist*> parts) {
                   if (approx)
                     finish_approx(parts, k, out_vals + qi * k, out_idx + qi * k);
                   else
                     finish(L, blocked, rb, mult, add, std::move(parts), k, out_vals + qi * k,
                            out_idx + qi * k);
                 });
}

namespace {

// The approximate scores (8-bit table sums, as consider() forms them) of the rows
// of blocks [j0, j1), written to s[row]: a two-stage scan's first pass at a few queries, which
// keeps the k1 best of them. At one query (MiniLM 60k x 384, 1 bit, first half of the
// coordinates) a shortlist of k1 = 100..400 rows admitted thousands of rows and compacted
// itself every k1 admissions: half of the pass's time, ~0.5 us per unit of k1. Writing every
// score and selecting once costs a store per 8 rows and one pass over n floats (L2-resident).
__attribute__((target("avx2"))) void approx_scores_avx2(const Lut& L, const uint8_t* blocked,
                                                        int64_t rb, int64_t n, int64_t j0,
                                                        int64_t j1, const float* mult,
                                                        const float* add, float* s) {
  alignas(32) uint32_t tot[4 * kRows];
  const uint8_t* q8[1] = {L.q8.data()};
  const __m256 vdelta = _mm256_set1_ps(L.delta), vbias = _mm256_set1_ps(L.bias);
  for (int64_t j = j0; j < j1;) {
    const int nb = j + 4 <= j1 ? 4 : 1;
    if (nb == 4)
      block_sums_avx2<4, 1>(blocked + j * rb * kRows, rb, q8, tot);
    else
      block_sums<1, 1>(L.b, blocked + j * rb * kRows, rb, q8, tot);
    for (int u = 0; u < nb; ++u, ++j) {
      const int64_t base = j * kRows, rows = std::min(kRows, n - base);
      const uint32_t* bt = tot + u * kRows;
      if (rows < kRows) {  // last, partial block: consider()'s float operations
        for (int64_t t = 0; t < rows; ++t)
          s[base + t] =
              mult[base + t] * (L.delta * static_cast<float>(bt[t]) + L.bias) + add[base + t];
        continue;
      }
      for (int g = 0; g < kRows; g += 8) {
        const __m256 sum =
            _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bt + g)));
        const __m256 v =
            _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(mult + base + g),
                                        _mm256_add_ps(_mm256_mul_ps(vdelta, sum), vbias)),
                          _mm256_loadu_ps(add + base + g));
        _mm256_storeu_ps(s + base + g, v);
      }
    }
  }
}

// The rows i with s[i] >= t and s[i] > -inf, in order: 8 at a time, a compare and a mask
// (a scalar loop's branch on each of 60,000 scores cost ~70 us).
__attribute__((target("avx2"))) void rows_at_least(const float* s, int64_t n, float t,
                                                   std::vector<int64_t>& rows) {
  rows.clear();
  const __m256 vt = _mm256_set1_ps(t), ninf = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    int bits = _mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(v, vt, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ)));
    while (bits) {
      rows.push_back(i + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; i < n; ++i)
    if (s[i] >= t && s[i] > -std::numeric_limits<float>::infinity()) rows.push_back(i);
}

// The rows whose score s[i] (n of them) reaches the k-th largest finite score (ties included;
// all finite rows where fewer than k): what a shortlist of k approximate scores keeps
// (final_threshold, then ub >= th). A threshold from a strided sample first (its r-th largest,
// r chosen for ~2k survivors), one pass keeping the rows at or above it, and the exact select
// among those; a sample that leaves fewer than k survivors is retried at a 4x larger rank.
void rows_reaching_kth(const float* s, int64_t n, int64_t k, std::vector<int64_t>& rows) {
  constexpr int64_t kStride = 64;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> sample, vals, tmp;
  sample.clear();
  for (int64_t i = 0; i < n; i += kStride)
    if (s[i] > ninf) sample.push_back(s[i]);  // finite (no NaN: a NaN fails the test too)
  const int64_t m = static_cast<int64_t>(sample.size());
  int64_t r = std::min(m, 2 * ((k + kStride - 1) / kStride) + 8);
  for (;;) {
    const float t = r >= 1 && r < m ? select_kth_largest(sample.data(), m, r, tmp) : ninf;
    rows_at_least(s, n, t, rows);
    if (static_cast<int64_t>(rows.size()) >= k || t == ninf) break;
    r = 4 * r;  // too few survivors: a lower threshold (the sample was reordered, not changed)
  }
  const int64_t c = static_cast<int64_t>(rows.size());
  if (c <= k) return;
  vals.resize(static_cast<size_t>(c));
  for (int64_t i = 0; i < c; ++i) vals[i] = s[rows[i]];
  const float th = select_kth_largest(vals.data(), c, k, tmp);
  int64_t w = 0;
  for (int64_t i = 0; i < c; ++i) {
    rows[w] = rows[i];
    w += s[rows[i]] >= th;
  }
  rows.resize(static_cast<size_t>(w));
}

}  // namespace

void fast_scan_two_stage(const float* qr, int64_t nq, int64_t d, const uint8_t* signs,
                         int64_t d1, int64_t n, const float* c1, const uint8_t* packed, int b,
                         const float* centroids, const float* mult, const float* add,
                         const float* add1, int64_t k1, int64_t k, float* out_vals,
                         int64_t* out_idx, int nthreads) {
  // the exact full-code scores of query qi's candidate rows -> its top k (the full codes as
  // the one term of rescore_terms)
  const ScanTerm full{qr, d, nullptr, b, centroids, mult, packed};
  auto second = [&](int64_t qi, const std::vector<int64_t>& rows) {
    rescore_terms(&full, 1, qi, rows, add, k, out_vals + qi * k, out_idx + qi * k);
  };
  const int64_t t = std::max(1, nthreads), nb = (n + kRows - 1) / kRows;
  if (simd_avx2() && nq < 3 * t && nb >= 64) {
    // A few queries: every first-pass score stored (threads over blocks), one select
    const int64_t rb1 = fs_row_bytes(d1, 1);
    std::vector<float> s(static_cast<size_t>(n));
    std::vector<int64_t> rows;
    for (int64_t qi = 0; qi < nq; ++qi) {
      Lut L = build_lut(qr + qi * d, d1, 1, c1, rb1, false);
      const int64_t tb = std::min<int64_t>(t, nb / 64), chunk = (nb + tb - 1) / tb;
      run_workers(tb, [&](int64_t w) {
        const int64_t j0 = std::min(nb, w * chunk), j1 = std::min(nb, (w + 1) * chunk);
        approx_scores_avx2(L, signs, rb1, n, j0, j1, mult, add1, s.data());
      });
      rows_reaching_kth(s.data(), n, k1, rows);
      second(qi, rows);
    }
    return;
  }
  fast_scan_impl(qr, nq, d1, d, signs, n, 1, c1, mult, add1, k1, true, nthreads,
                 [&](int64_t qi, const Lut&, std::vector<Shortlist*> parts) {
                   // the rows of the k1 best approximate sign scores (ties included), then
                   // their exact full-code scores
                   const float th = final_threshold(parts, k1);
                   std::vector<int64_t> rows;
                   for (auto* sl : parts)
                     for (const auto& c : sl->cand)
                       if (c.ub >= th) rows.push_back(c.row);
                   second(qi, rows);
                 });
}

void ivf_fast_scan(const float* qr, int64_t nq, int64_t d, const uint8_t* blocked, int64_t n,
                   int b, const float* centroids, const float* mult, const float* add,
                   const int64_t* list_blocks, int64_t nlist, const int64_t* probes,
                   const float* offsets, int64_t nprobe, int64_t k, bool approx,
                   float* out_vals, int64_t* out_idx, int nthreads) {
  // Many queries: each thread takes a contiguous share of them, lists and all. Splitting the
  // lists between threads instead gave every query a shortlist per thread, each filling its own
  // k from half the rows (1.7x the admissions), and scaled 1.55x on 2 threads.
  if (split_queries(nq, nthreads, 64, [&](int64_t lo, int64_t hi) {
        ivf_fast_scan(qr + lo * d, hi - lo, d, blocked, n, b, centroids, mult, add, list_blocks,
                      nlist, probes + lo * nprobe, offsets + lo * nprobe, nprobe, k, approx,
                      out_vals + lo * k, out_idx + lo * k, 1);
      }))
    return;
  const int64_t rb = fs_row_bytes(d, b);
  // Queries are handled in batches whose tables (5 bytes * 16 * 2 rb each) stay within 64 MB;
  // within a batch the probes are inverted so that each probed list is read once for all the
  // queries that probe it, four tables per pass, as faiss's IVF fast-scan does. Big batches
  // matter: with nq * nprobe / nlist queries per list, 256 queries left most groups of four
  // unfilled (1.6x slower on Fashion-MNIST, nlist 256, nprobe 4).
  const int64_t batch = std::clamp<int64_t>((64 << 20) / (160 * rb), 256, 8192);
  for (int64_t q0 = 0; q0 < nq; q0 += batch) {
    const int64_t q1 = std::min(nq, q0 + batch), m = q1 - q0;
    std::vector<Lut> luts(static_cast<size_t>(m));
    // (query in batch, offset) per list; lists ordered by the best rank at which any query
    // probes them, so each shortlist meets its nearest lists first and its threshold rises early.
    std::vector<std::vector<std::pair<int64_t, float>>> by_list(static_cast<size_t>(nlist));
    std::vector<int64_t> rank(static_cast<size_t>(nlist), nprobe);
    int64_t work_blocks = 0;
    for (int64_t qi = 0; qi < m; ++qi)
      for (int64_t r = 0; r < nprobe; ++r) {
        const int64_t l = probes[(q0 + qi) * nprobe + r];
        if (l < 0 || l >= nlist) continue;
        by_list[static_cast<size_t>(l)].emplace_back(qi, offsets[(q0 + qi) * nprobe + r]);
        rank[static_cast<size_t>(l)] = std::min(rank[static_cast<size_t>(l)], r);
        work_blocks += list_blocks[l + 1] - list_blocks[l];
      }
    std::vector<int64_t> order;
    for (int64_t l = 0; l < nlist; ++l)
      if (!by_list[static_cast<size_t>(l)].empty() && list_blocks[l + 1] > list_blocks[l])
        order.push_back(l);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
      return rank[static_cast<size_t>(a)] < rank[static_cast<size_t>(c)];
    });
    const int64_t t = std::max<int64_t>(
        1, std::min<int64_t>({static_cast<int64_t>(std::max(1, nthreads)),
                              static_cast<int64_t>(order.size()),
                              std::max<int64_t>(1, (work_blocks + m) / 32)}));
    // Shortlists per (thread, query): no locks; finish() merges a query's parts.
    std::vector<std::vector<Shortlist>> sls(static_cast<size_t>(t));
    for (auto& v : sls) v.assign(static_cast<size_t>(m), Shortlist(k));
    // Few queries keep the float tables: each candidate's re-score is then M lookups, not d
    // multiply-adds with index arithmetic (one query, Fashion-MNIST 4 bits, nprobe 4: the
    // re-score was most of the kernel's 115 us). Thousands of queries drop them (160 rb bytes
    // each, written and read once).
    // approx (a first stage before a refinement): no float tables and a zero error bound, so
    // the shortlists hold the rows of the best table scores and nothing is re-scored exactly
    // (the exact re-score was 2.4x the scan itself at 1 bit, k = 40: the 1-bit tables' bounds
    // are loose).
    const bool keep_float = m <= 64 && !approx;
    std::atomic<int64_t> next_lut{0}, next_list{0};
    auto build = [&] {
      for (int64_t qi; (qi = next_lut.fetch_add(1)) < m;) {
        Lut& L = luts[static_cast<size_t>(qi)];
        L = build_lut(qr + (q0 + qi) * d, d, b, centroids, rb, keep_float);
        if (approx) L.err = 0.0f;
      }
    };
    auto scan = [&](int64_t w) {
      auto& mine = sls[static_cast<size_t>(w)];
      std::vector<const Lut*> lp;
      std::vector<Shortlist*> sp;
      std::vector<float> off;
      for (int64_t o; (o = next_list.fetch_add(1)) < static_cast<int64_t>(order.size());) {
        const int64_t l = order[static_cast<size_t>(o)];
        const auto& qs = by_list[static_cast<size_t>(l)];
        const int64_t j0 = list_blocks[l], j1 = list_blocks[l + 1];
        const int qpp = queries_per_pass(b);
        const size_t grouped = simd_avx2() ? qs.size() / qpp * qpp : 0;
        lp.clear(), sp.clear(), off.clear();
        for (size_t g = 0; g < grouped; ++g) {
          lp.push_back(&luts[static_cast<size_t>(qs[g].first)]);
          sp.push_back(&mine[static_cast<size_t>(qs[g].first)]);
          off.push_back(qs[g].second);
        }
        scan_query_groups(qpp, lp.data(), sp.data(), static_cast<int64_t>(grouped), blocked, rb,
                          n, j0, j1, mult, add, off.data());
        for (size_t g = grouped; g < qs.size(); ++g)
          scan_blocks(luts[static_cast<size_t>(qs[g].first)], blocked, rb, n, j0, j1, mult, add,
                      qs[g].second, mine[static_cast<size_t>(qs[g].first)]);
      }
    };
    auto finish_all = [&](int64_t w) {
      for (int64_t qi = w; qi < m; qi += t) {
        std::vector<Shortlist*> parts;
        for (auto& v : sls) parts.push_back(&v[static_cast<size_t>(qi)]);
        if (approx)
          finish_approx(parts, k, out_vals + (q0 + qi) * k, out_idx + (q0 + qi) * k);
        else
          finish(luts[static_cast<size_t>(qi)], blocked, rb, mult, add, parts, k,
                 out_vals + (q0 + qi) * k, out_idx + (q0 + qi) * k);
      }
    };
    run_workers(t, [&](int64_t) { build(); });
    run_workers(t, scan);
    run_workers(t, finish_all);
  }
}

void fast_scan_terms(const ScanTerm* terms, int nterms, int64_t nq, int64_t n, const float* add,
                     int64_t k, float* out_vals, int64_t* out_idx, int nthreads, int nfirst,
                     int64_t k1) {
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t t = std::max(1, nthreads);
  auto make = [&](int64_t qi, int upto, bool keep_float) {
    std::vector<TermScan> ts;
    for (int x = 0; x < upto; ++x) {
      const ScanTerm& T = terms[x];
      const int64_t rb = fs_row_bytes(T.d, T.b);
      ts.push_back({build_lut(T.qr + qi * T.d, T.d, T.b, T.centroids, rb, keep_float),
                    T.blocked, rb, T.mult});
    }
    return ts;
  };
  if (nfirst > 0) {
    // Two stages: the first nfirst terms' table scores of every row stored, the rows of the k1
    // best selected once (rows_reaching_kth), then their exact scores with every term.
    auto two_stage = [&](int64_t qi, std::vector<float>& s, int workers) {
      const auto ts = make(qi, nfirst, false);
      const int64_t chunk = (nb + workers - 1) / workers;
      run_workers(workers, [&](int64_t w) {
        first_scores_terms(ts, static_cast<size_t>(nfirst), n, std::min(nb, w * chunk),
                           std::min(nb, (w + 1) * chunk), add, s.data());
      });
      thread_local std::vector<int64_t> rows;
      rows_reaching_kth(s.data(), n, k1, rows);
      rescore_terms(terms, nterms, qi, rows, add, k, out_vals + qi * k, out_idx + qi * k);
    };
    if (nq >= t || nb < 64) {  // threads over queries
      const int64_t tq = std::min<int64_t>(t, nq);
      run_workers(tq, [&](int64_t w) {
        std::vector<float> s(static_cast<size_t>(n));
        for (int64_t qi = w; qi < nq; qi += tq) two_stage(qi, s, 1);
      });
    } else {  // few queries: threads over blocks for the first pass
      std::vector<float> s(static_cast<size_t>(n));
      const int workers = static_cast<int>(std::min<int64_t>(t, nb / 64));
      for (int64_t qi = 0; qi < nq; ++qi) two_stage(qi, s, workers);
    }
    return;
  }
  if (nq >= t || nb < 64) {  // threads over queries
    const int64_t tq = std::min<int64_t>(t, nq);
    auto work = [&](int64_t w) {
      for (int64_t qi = w; qi < nq; qi += tq) {
        const auto ts = make(qi, nterms, true);
        Shortlist sl(k);
        scan_terms(ts, n, 0, nb, add, sl);
        finish_terms(ts, add, {&sl}, k, out_vals + qi * k, out_idx + qi * k);
      }
    };
    run_workers(tq, work);
    return;
  }
  for (int64_t qi = 0; qi < nq; ++qi) {  // few queries: threads over blocks, shortlists merged
    const auto ts = make(qi, nterms, true);
    std::vector<Shortlist> sls = split_blocks(nb, t, k, [&](int64_t j0, int64_t j1, Shortlist& sl) {
      scan_terms(ts, n, j0, j1, add, sl);
    });
    finish_terms(ts, add, pointers(sls), k, out_vals + qi * k, out_idx + qi * k);
  }
}

}  // namespace tqvec
