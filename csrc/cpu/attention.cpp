// Decode attention over TurboQuant-mse key and value codes on the CPU (the meaning is
// decode_attention_ref in tqvec/ops/ref.py; csrc/cuda/attention.cu is the GPU version). Layouts:
//   qr      (BH, G, d)        float32  rotated queries, G query rows per KV head
//   qbias   (BH, G)           float32  added to every score of its row
//   kpacked (BH, T, rbk)      uint8    key codes, rbk = ceil(d kb / 8) (kernels.h bit order)
//   vpacked (BH, T, rbv)      uint8    value codes
//   knorm, vnorm (BH, T)      float32
//   kcent (2^kb), vcent (2^vb) float32
//   lo, hi (BH)               int32    tokens [lo, hi) count
//   m, l (BH, G), acc (BH, G, d) float32: max score, sum of exp(s - m), sum of exp(s - m) times
//   the value (rotated domain, unnormalized); m = -inf, l = 0, acc = 0 for an empty range.
// Each KV head's tokens split into parts (threads take parts, not only heads); per part the key
// rows scored for the G query rows (with AVX2 and b <= 4: eight indices per step, shifted into
// their lanes and looked up in the centroids by one vpermps - two and a blend at b = 4 -, eight
// tokens' dot lanes reduced together), the softmax of each row (exp_softmax: one polynomial
// exp for both paths, 8 lanes at a time with AVX2), then each value row decoded once and added
// to all G rows; the parts' softmax states merged per head. The AVX2 and portable paths do the
// same float operations in the same order (same bits); scores are summed in another order than
// the reference's GEMM and exp is not libm's: equal within float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "arch.h"
#include "kernels.h"
#include "parallel.h"
#include "rescore_codes.h"

namespace tqvec {
namespace {

// The sum of 8 lanes in the order the AVX2 paths reduce them (two horizontal adds, then the
// 128-bit halves): ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float sum8(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// <a, b> over d floats in 16 independent lanes (chunk c of 8 coordinates into lanes
// 8 (c mod 2) ..: two chains of adds, so that the SIMD path is bound by throughput, not by the
// add latency; an element-wise loop the compiler vectorizes without reassociating), lanes u and
// u + 8 added, those 8 summed by sum8, then the tail.
inline float dot16(const float* __restrict a, const float* __restrict b, int64_t d) {
  float lane[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    float* l = lane + (j / 8 % 2) * 8;
    for (int u = 0; u < 8; ++u) l[u] += a[j + u] * b[j + u];
  }
  float tail = 0.f;
  for (; j < d; ++j) tail += a[j] * b[j];
  for (int u = 0; u < 8; ++u) lane[u] += lane[u + 8];
  return sum8(lane) + tail;
}

// exp(x) in float operations that the AVX2 path repeats lane by lane (libm's expf differs
// between builds and has no 8-lane form here): x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-6 polynomial (relative error ~1e-7), times 2^n. x below -87.3 (where e^x
// leaves the normal floats) gives 0, NaN gives 0, x is capped at 88 (softmax passes x <= 0).
constexpr float kExpLo = -87.33654f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f,
                kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kRound = 12582912.0f;  // 1.5 2^23
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline float exp_softmax(float x) {
  if (!(x >= kExpLo)) return 0.0f;
  x = std::min(x, kExpHi);
  const float n = (x * kLog2e + kRound) - kRound;  // round to nearest (even)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float y = (p * (r * r) + r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y * two_n;
}

// Row r of s (g rows of n scores, row-major) replaced by exp(s - ref), ref its max where
// finite (else 0); m[r] = the max, l[r] = the sum of the exps: full groups of 8 summed per lane
// i mod 8, the lanes by sum8, then the rest in order.
void softmax_rows(float* s, int64_t g, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < g; ++r) {
    float* sr = s + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
    const float ref = std::isfinite(mx) ? mx : 0.0f;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t n8 = n / 8 * 8;
    for (int64_t i = 0; i < n8; i += 8)
      for (int u = 0; u < 8; ++u) lane[u] += (sr[i + u] = exp_softmax(sr[i + u] - ref));
    float sum = sum8(lane);
    for (int64_t i = n8; i < n; ++i) sum += (sr[i] = exp_softmax(sr[i] - ref));
    m[r] = mx;
    l[r] = sum;
  }
}

// One packed row of b-bit indices (kernels.h bit order) decoded to its centroids:
// out[j] = cent[index j], eight indices (b bytes) at a time, then the tail.
void decode_row(const uint8_t* row, int64_t d, int b, const float* cent, float* out) {
  const int64_t rb = (d * b + 7) / 8, d8 = d / 8 * 8;
  uint32_t v[8];
  for (int64_t j = 0; j < d8; j += 8) {
    unpack8(row, rb, b, j, v);
    for (int u = 0; u < 8; ++u) out[j + u] = cent[v[u]];
  }
  for (int64_t j = d8; j < d; ++j) out[j] = cent[code_at(row, b, j)];
}

// n consecutive key rows (kh, rb bytes each) against g query rows q[r d ..]: out[r n + i] =
// dot16(q_r, key row i decoded). Scratch: row (d floats).
void key_dots(const float* q, int64_t g, const uint8_t* kh, int64_t rb, int64_t n, int64_t d,
              int b, const float* cent, float* row, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    decode_row(kh + i * rb, d, b, cent, row);
    for (int64_t r = 0; r < g; ++r) out[r * n + i] = dot16(q + r * d, row, d);
  }
}

// A value row added to g accumulator rows: acc[r d + j] += w[r] x the decoded row's j-th value,
// rows with w[r] = 0 left alone.
void add_row(const float* w, int64_t g, const uint8_t* packed, int64_t d, int b,
             const float* cent, float* row, float* acc) {
  decode_row(packed, d, b, cent, row);
  for (int64_t r = 0; r < g; ++r) {
    if (w[r] == 0.0f) continue;
    float* out = acc + r * d;
    for (int64_t j = 0; j < d; ++j) out[j] += w[r] * row[j];
  }
}

// add_row for n value rows (packed, rb bytes each) with their weights w (n, g), in token order.
void add_rows(const float* w, int64_t n, int64_t g, const uint8_t* packed, int64_t rb,
              int64_t d, int b, const float* cent, std::vector<float>& scratch, float* acc) {
  scratch.resize(static_cast<size_t>(d));
  for (int64_t i = 0; i < n; ++i)
    add_row(w + i * g, g, packed + i * rb, d, b, cent, scratch.data(), acc);
}

#ifdef TQVEC_X86
// key_dots, softmax_rows and add_row with AVX2 and the same float operations per lane, in the same order
// (mul then add, no FMA). The row is decoded eight coordinates per step in registers
// (indices8_avx2 / centroids8_avx2: one vpermps for b <= 3), B a constant - for b <= 4 while
// it is scored, without storing it; its dots with up to 4 query rows run side by side, two
// chains each (dot16).
template <int B>
__attribute__((target("avx2"))) void decode_row_avx2(const uint8_t* row, int64_t d,
                                                     const float* cent, float* out) {
  const int64_t rb = (d * B + 7) / 8, d8 = d / 8 * 8;
  alignas(32) float tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const float* c = cent;
  if constexpr (B <= 4) {  // the permutes read 8 (16) floats: a shorter codebook padded
    std::memcpy(tab, cent, sizeof(float) << B);
    c = tab;
  }
  for (int64_t j = 0; j < d8; j += 8)
    _mm256_storeu_ps(out + j, centroids8_avx2(indices8_avx2(row, rb, j, B), B, c));
  for (int64_t j = d8; j < d; ++j) out[j] = cent[code_at(row, B, j)];
}

__attribute__((target("avx2"))) void decode_any_avx2(const uint8_t* row, int64_t d, int b,
                                                     const float* cent, float* out) {
  switch (b) {
    case 1: return decode_row_avx2<1>(row, d, cent, out);
    case 2: return decode_row_avx2<2>(row, d, cent, out);
    case 3: return decode_row_avx2<3>(row, d, cent, out);
    case 4: return decode_row_avx2<4>(row, d, cent, out);
    case 5: return decode_row_avx2<5>(row, d, cent, out);
    case 6: return decode_row_avx2<6>(row, d, cent, out);
    case 7: return decode_row_avx2<7>(row, d, cent, out);
    default: return decode_row_avx2<8>(row, d, cent, out);
  }
}

// indices8_avx2 for B <= 4: one 4-byte load where the row holds 4 bytes from the chunk's
// first (all chunks but the row's last one or two), else byte by byte.
template <int B>
__attribute__((target("avx2"), always_inline)) inline __m256i indices8_fast_avx2(
    const uint8_t* row, int64_t rb, int64_t j) {
  const int64_t off = j / 8 * B;
  __m256i w;
  if (__builtin_expect(off + 4 <= rb, 1)) {
    w = _mm256_broadcastd_epi32(_mm_loadu_si32(row + off));  // one vpbroadcastd from memory
  } else {
    uint32_t v = 0;
    for (int t = 0; t < B; ++t) v |= static_cast<uint32_t>(row[off + t]) << (8 * t);
    w = _mm256_set1_epi32(static_cast<int>(v));
  }
  const __m256i sh = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
  return _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32((1 << B) - 1));
}

// lanes u and u + 8 of two 8-lane chains added, then summed as sum8: two horizontal adds
// leave ((l0 + l1) + (l2 + l3)) in lane 0 and ((l4 + l5) + (l6 + l7)) in lane 4.
__attribute__((target("avx2"), always_inline)) inline float reduce16_avx2(__m256 a0, __m256 a1) {
  const __m256 v = _mm256_add_ps(a0, a1);
  const __m256 p = _mm256_hadd_ps(v, v);
  const __m256 h = _mm256_hadd_ps(p, p);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Eight such sums at once: lane t = reduce16_avx2 of v[t] (already the added chain pair), the
// same operations on each (hadds pair adjacent lanes of two vectors at a time).
__attribute__((target("avx2"), always_inline)) inline __m256 reduce8x8_avx2(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// dot16 of up to 4 query rows with one key row at a time, side by side: row r's 16 lanes in
// acc[0][r] (even chunks) and acc[1][r] (odd chunks); the key row loaded decoded, or decoded on
// the fly (B <= 4: no store of the row and load back).
template <int G>
__attribute__((target("avx2"))) inline void finish_dots(const __m256 (&acc)[2][G],
                                                        const float* tail, float* dots) {
  for (int r = 0; r < G; ++r) dots[r] = reduce16_avx2(acc[0][r], acc[1][r]) + tail[r];
}

// The 8 values of coordinates j .. j + 7 of the key row: B = 0 loaded from the decoded row x,
// B <= 4 decoded from the packed row (rb bytes) by the padded codebook tab.
template <int B>
__attribute__((target("avx2"), always_inline)) inline __m256 key8(const float* x,
                                                                  const uint8_t* packed,
                                                                  int64_t rb, const float* tab,
                                                                  int64_t j) {
  if constexpr (B == 0) return _mm256_loadu_ps(x + j);
  return centroids8_avx2(indices8_fast_avx2<B>(packed, rb, j), B, tab);
}

template <int B, int G>
__attribute__((target("avx2"), always_inline)) inline void lanes_avx2(
    const float* q, int64_t d, const float* x, const uint8_t* packed, int64_t rb,
    const float* tab, __m256 (&acc)[2][G]) {
  for (int p = 0; p < 2; ++p)
    for (int r = 0; r < G; ++r) acc[p][r] = _mm256_setzero_ps();
  const int64_t d8 = d / 8 * 8;
  int64_t j = 0;
  for (; j + 16 <= d8; j += 16) {
    const __m256 x0 = key8<B>(x, packed, rb, tab, j), x1 = key8<B>(x, packed, rb, tab, j + 8);
    for (int r = 0; r < G; ++r) {
      acc[0][r] = _mm256_add_ps(acc[0][r], _mm256_mul_ps(_mm256_loadu_ps(q + r * d + j), x0));
      acc[1][r] =
          _mm256_add_ps(acc[1][r], _mm256_mul_ps(_mm256_loadu_ps(q + r * d + j + 8), x1));
    }
  }
  if (j < d8) {
    const __m256 x0 = key8<B>(x, packed, rb, tab, j);
    for (int r = 0; r < G; ++r)
      acc[0][r] = _mm256_add_ps(acc[0][r], _mm256_mul_ps(_mm256_loadu_ps(q + r * d + j), x0));
  }
}

template <int G>
__attribute__((target("avx2"))) void dots_avx2(const float* q, int64_t d, const float* x,
                                               float* dots) {
  __m256 acc[2][G];
  lanes_avx2<0, G>(q, d, x, nullptr, 0, nullptr, acc);
  float tail[G];
  for (int r = 0; r < G; ++r) {
    tail[r] = 0.f;
    for (int64_t j = d / 8 * 8; j < d; ++j) tail[r] += q[r * d + j] * x[j];
  }
  finish_dots<G>(acc, tail, dots);
}

// Dots of n consecutive key rows (rb bytes each, B <= 4) with G query rows: out[r ld + i].
// Eight tokens at a time: each token's chain pair per row added (lanes u, u + 8), the eight
// tokens' vectors reduced together (reduce8x8_avx2: the per-token horizontal sums cost more
// than the 4-8 chunks of a 32-64 wide row), then each tail added.
template <int B, int G>
__attribute__((target("avx2"))) void dots_block_avx2(const float* q, int64_t d,
                                                     const uint8_t* kh, int64_t rb, int64_t n,
                                                     const float* tab, const float* cent,
                                                     float* out, int64_t ld) {
  const int64_t d8 = d / 8 * 8;
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - i0);
    __m256 v[G][8];
    for (int64_t t = 0; t < 8; ++t) {
      if (t < m) {
        __m256 acc[2][G];
        lanes_avx2<B, G>(q, d, nullptr, kh + (i0 + t) * rb, rb, tab, acc);
        for (int r = 0; r < G; ++r) v[r][t] = _mm256_add_ps(acc[0][r], acc[1][r]);
      } else {
        for (int r = 0; r < G; ++r) v[r][t] = _mm256_setzero_ps();
      }
    }
    for (int r = 0; r < G; ++r) {
      alignas(32) float sums[8];
      _mm256_store_ps(sums, reduce8x8_avx2(v[r]));
      for (int64_t t = 0; t < m; ++t) {
        float tail = 0.f;
        for (int64_t j = d8; j < d; ++j)
          tail += q[r * d + j] * cent[code_at(kh + (i0 + t) * rb, B, j)];
        out[r * ld + i0 + t] = sums[t] + tail;
      }
    }
  }
}

template <int B>
__attribute__((target("avx2"))) void dots_rows_avx2(const float* q, int64_t g, const uint8_t* kh,
                                                    int64_t rb, int64_t n, int64_t d,
                                                    const float* cent, float* out) {
  alignas(32) float tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tab, cent, sizeof(float) << B);
  for (int64_t r0 = 0; r0 < g; r0 += 4) {
    const float* qq = q + r0 * d;
    float* o = out + r0 * n;
    switch (std::min<int64_t>(4, g - r0)) {
      case 1: dots_block_avx2<B, 1>(qq, d, kh, rb, n, tab, cent, o, n); break;
      case 2: dots_block_avx2<B, 2>(qq, d, kh, rb, n, tab, cent, o, n); break;
      case 3: dots_block_avx2<B, 3>(qq, d, kh, rb, n, tab, cent, o, n); break;
      default: dots_block_avx2<B, 4>(qq, d, kh, rb, n, tab, cent, o, n); break;
    }
  }
}

// key_dots with AVX2: b <= 4 decoded on the fly in blocks of tokens, wider rows decoded to
// `row` one at a time and dotted 4 query rows at once.
__attribute__((target("avx2"))) void key_dots_avx2(const float* q, int64_t g, const uint8_t* kh,
                                                   int64_t rb, int64_t n, int64_t d, int b,
                                                   const float* cent, float* row, float* out) {
  switch (b) {
    case 1: return dots_rows_avx2<1>(q, g, kh, rb, n, d, cent, out);
    case 2: return dots_rows_avx2<2>(q, g, kh, rb, n, d, cent, out);
    case 3: return dots_rows_avx2<3>(q, g, kh, rb, n, d, cent, out);
    case 4: return dots_rows_avx2<4>(q, g, kh, rb, n, d, cent, out);
    default: break;
  }
  float dots[4];
  for (int64_t i = 0; i < n; ++i) {
    decode_any_avx2(kh + i * rb, d, b, cent, row);
    for (int64_t r0 = 0; r0 < g; r0 += 4) {
      const float* qq = q + r0 * d;
      const int64_t k = std::min<int64_t>(4, g - r0);
      switch (k) {
        case 1: dots_avx2<1>(qq, d, row, dots); break;
        case 2: dots_avx2<2>(qq, d, row, dots); break;
        case 3: dots_avx2<3>(qq, d, row, dots); break;
        default: dots_avx2<4>(qq, d, row, dots); break;
      }
      for (int64_t r = 0; r < k; ++r) out[(r0 + r) * n + i] = dots[r];
    }
  }
}

// exp_softmax on 8 lanes, the same operations.
__attribute__((target("avx2"), always_inline)) inline __m256 exp8_avx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_GE_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHi));
  const __m256 rnd = _mm256_set1_ps(kRound);
  const __m256 n =
      _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), rnd), rnd);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
                                 _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

// softmax_rows with AVX2: the same maxima, exps and lane sums.
__attribute__((target("avx2"))) void softmax_rows_avx2(float* s, int64_t g, int64_t n, float* m,
                                                       float* l) {
  const int64_t n8 = n / 8 * 8;
  for (int64_t r = 0; r < g; ++r) {
    float* sr = s + r * n;
    __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n8; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sr + i));
    alignas(32) float lane[8];
    _mm256_store_ps(lane, mx8);
    float mx = lane[0];
    for (int u = 1; u < 8; ++u) mx = std::max(mx, lane[u]);
    for (int64_t i = n8; i < n; ++i) mx = std::max(mx, sr[i]);
    const float ref = std::isfinite(mx) ? mx : 0.0f;
    const __m256 ref8 = _mm256_set1_ps(ref);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 e = exp8_avx2(_mm256_sub_ps(_mm256_loadu_ps(sr + i), ref8));
      _mm256_storeu_ps(sr + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    _mm256_store_ps(lane, acc);
    float sum = sum8(lane);
    for (int64_t i = n8; i < n; ++i) sum += (sr[i] = exp_softmax(sr[i] - ref));
    m[r] = mx;
    l[r] = sum;
  }
}

__attribute__((target("avx2"))) void add_row_avx2(const float* w, int64_t g,
                                                  const uint8_t* packed, int64_t d, int b,
                                                  const float* cent, float* row, float* acc) {
  decode_any_avx2(packed, d, b, cent, row);
  const int64_t d8 = d / 8 * 8;
  for (int64_t r = 0; r < g; ++r) {
    if (w[r] == 0.0f) continue;
    const __m256 vw = _mm256_set1_ps(w[r]);
    float* out = acc + r * d;
    for (int64_t j = 0; j < d8; j += 8)
      _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(out + j),
                                              _mm256_mul_ps(vw, _mm256_loadu_ps(row + j))));
    for (int64_t j = d8; j < d; ++j) out[j] += w[r] * row[j];
  }
}

// add_rows for B <= 4 with AVX2: accumulators held in registers over a block of tokens,
// coordinate chunk by chunk; each token's chunk decoded once (one vpermps, two and a blend at
// B = 4) and multiplied by each row's weight. Each accumulator lane adds the same products
// w x c[k] in the same token order as add_row, so the same bits: a row whose w is 0 adds +-0 to
// a lane that starts at +0 and so can never be -0, which leaves it unchanged, as add_row's skip
// does. The n tokens at packed + rows[k] rb, their weights w (n, g); tab: the codebook padded.
template <int B, int G>
__attribute__((target("avx2"))) void add_block_avx2(const float* w, const int64_t* rows,
                                                    int64_t n, int64_t g, const uint8_t* packed,
                                                    int64_t rb, int64_t d, const float* tab,
                                                    const float* cent, float* acc) {
  const int64_t d8 = d / 8 * 8;
  int64_t j = 0;
  // two chunks per pass: 2 G independent chains of adds instead of G (their latency, not the
  // adds' throughput, bounds a pass over the tokens)
  for (; j + 16 <= d8; j += 16) {
    __m256 a[G], b[G];
    for (int r = 0; r < G; ++r) {
      a[r] = _mm256_loadu_ps(acc + r * d + j);
      b[r] = _mm256_loadu_ps(acc + r * d + j + 8);
    }
    for (int64_t k = 0; k < n; ++k) {
      const uint8_t* row = packed + rows[k] * rb;
      const __m256 c0 = centroids8_avx2(indices8_fast_avx2<B>(row, rb, j), B, tab);
      const __m256 c1 = centroids8_avx2(indices8_fast_avx2<B>(row, rb, j + 8), B, tab);
      for (int r = 0; r < G; ++r) {
        const __m256 wk = _mm256_set1_ps(w[k * g + r]);
        a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(wk, c0));
        b[r] = _mm256_add_ps(b[r], _mm256_mul_ps(wk, c1));
      }
    }
    for (int r = 0; r < G; ++r) {
      _mm256_storeu_ps(acc + r * d + j, a[r]);
      _mm256_storeu_ps(acc + r * d + j + 8, b[r]);
    }
  }
  if (j < d8) {
    __m256 a[G];
    for (int r = 0; r < G; ++r) a[r] = _mm256_loadu_ps(acc + r * d + j);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 c8 = centroids8_avx2(indices8_fast_avx2<B>(packed + rows[k] * rb, rb, j), B,
                                        tab);
      for (int r = 0; r < G; ++r)
        a[r] = _mm256_add_ps(a[r], _mm256_mul_ps(_mm256_set1_ps(w[k * g + r]), c8));
    }
    for (int r = 0; r < G; ++r) _mm256_storeu_ps(acc + r * d + j, a[r]);
  }
  for (int64_t k = 0; k < n; ++k)  // the tail coordinates
    for (int r = 0; r < G; ++r)
      for (int64_t j = d8; j < d; ++j)
        acc[r * d + j] += w[k * g + r] * cent[code_at(packed + rows[k] * rb, B, j)];
}

template <int B>
__attribute__((target("avx2"))) void add_rows_blocked_avx2(const float* w, int64_t n, int64_t g,
                                                       const uint8_t* packed, int64_t rb,
                                                       int64_t d, const float* cent,
                                                       std::vector<float>& scratch,
                                                       float* acc) {
  constexpr int64_t kBlock = 64;  // tokens per block
  scratch.resize(static_cast<size_t>(kBlock * g));
  alignas(32) float tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tab, cent, sizeof(float) << B);
  int64_t rows[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    // the block's tokens with a weight for some row (the others would add only zeros)
    int64_t m = 0;
    for (int64_t i = i0; i < std::min(n, i0 + kBlock); ++i) {
      bool any = false;
      for (int64_t r = 0; r < g; ++r) any |= w[i * g + r] != 0.0f;
      if (!any) continue;
      std::copy(w + i * g, w + (i + 1) * g, scratch.data() + m * g);
      rows[m++] = i;
    }
    for (int64_t r0 = 0; r0 < g; r0 += 4) {
      const float* wr = scratch.data() + r0;
      switch (std::min<int64_t>(4, g - r0)) {
        case 1: add_block_avx2<B, 1>(wr, rows, m, g, packed, rb, d, tab, cent, acc + r0 * d); break;
        case 2: add_block_avx2<B, 2>(wr, rows, m, g, packed, rb, d, tab, cent, acc + r0 * d); break;
        case 3: add_block_avx2<B, 3>(wr, rows, m, g, packed, rb, d, tab, cent, acc + r0 * d); break;
        default: add_block_avx2<B, 4>(wr, rows, m, g, packed, rb, d, tab, cent, acc + r0 * d); break;
      }
    }
  }
}

__attribute__((target("avx2"))) void add_rows_avx2(const float* w, int64_t n, int64_t g,
                                                   const uint8_t* packed, int64_t rb, int64_t d,
                                                   int b, const float* cent,
                                                   std::vector<float>& scratch, float* acc) {
  switch (b) {
    case 1: return add_rows_blocked_avx2<1>(w, n, g, packed, rb, d, cent, scratch, acc);
    case 2: return add_rows_blocked_avx2<2>(w, n, g, packed, rb, d, cent, scratch, acc);
    case 3: return add_rows_blocked_avx2<3>(w, n, g, packed, rb, d, cent, scratch, acc);
    case 4: return add_rows_blocked_avx2<4>(w, n, g, packed, rb, d, cent, scratch, acc);
    default: break;
  }
  scratch.resize(static_cast<size_t>(d));
  for (int64_t i = 0; i < n; ++i)
    add_row_avx2(w + i * g, g, packed + i * rb, d, b, cent, scratch.data(), acc);
}
#endif

// The row functions of the path present (kernels.h: simd_avx2).
struct RowOps {
  void (*dots)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int,
               const float*, float*, float*) = key_dots;
  void (*softmax)(float*, int64_t, int64_t, float*, float*) = softmax_rows;
  void (*add)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int,
              const float*, std::vector<float>&, float*) = add_rows;
  RowOps() {
#ifdef TQVEC_X86
    if (simd_avx2()) dots = key_dots_avx2, softmax = softmax_rows_avx2, add = add_rows_avx2;
#endif
  }
};

// One code segment's flash-decoding inputs and softmax-state outputs (decode_attention's
// arguments): qr, qbias (bh, g) rows; key and value codes (bh, t, *) with their float32
// multipliers (bh, t); tokens [lo[h], hi[h]) count; m, l (bh, g), acc (bh, g, d).
struct StateArgs {
  const float* qr;
  const float* qbias;
  const uint8_t* kpacked;
  const float* knorm;
  const float* kcent;
  int kb;
  const uint8_t* vpacked;
  const float* vnorm;
  const float* vcent;
  int vb;
  int64_t t;
  const int32_t* lo;
  const int32_t* hi;
  float* m;
  float* l;
  float* acc;
};

// The softmax states of several code segments in one run of the workers (units: every
// segment's heads, each in P parts - flash-decoding's split, so that a few KV heads still keep
// every thread busy); each part's state merged per head at the end.
void softmax_states(const StateArgs* segs, int nseg, int64_t bh, int64_t g, int64_t d,
                    float scale, int nthreads) {
  constexpr int64_t kMinPart = 512;  // tokens per part below which a split costs more than it saves
  // A second thread only for work worth waking it: a parked worker takes ~0.1-0.25 ms to start
  // in a virtual machine (futex wake of a halted vCPU, or one that torch's OpenMP threads spin
  // on), while a 1k-token head of 4 x 256 query coordinates is ~0.15 ms of one core's work.
  // kMinWork: visible tokens x query rows x d per thread (~0.3 ms of one core's work).
  constexpr int64_t kMinWork = int64_t{1} << 21;
  int64_t work = 0;
  for (int s = 0; s < nseg; ++s)
    for (int64_t h = 0; h < bh; ++h) {
      const int64_t a = std::clamp<int64_t>(segs[s].lo[h], 0, segs[s].t);
      work += std::clamp<int64_t>(segs[s].hi[h], a, segs[s].t) - a;
    }
  work *= g * d;
  const int64_t workers0 = std::clamp<int64_t>(work / kMinWork, 1, std::max(1, nthreads));
  std::vector<int64_t> parts(static_cast<size_t>(nseg)), first(static_cast<size_t>(nseg) + 1, 0);
  for (int s = 0; s < nseg; ++s) {
    parts[s] = std::clamp<int64_t>((4 * workers0 + bh - 1) / bh, 1,
                                   std::max<int64_t>(1, segs[s].t / kMinPart));  // t bounds every head's count
    first[s + 1] = first[s] + bh * parts[s];
  }
  const int64_t units = first[nseg];
  const int64_t workers = std::min(workers0, units);
  std::vector<float> pm(static_cast<size_t>(units * g)), pl(static_cast<size_t>(units * g));
  std::vector<float> pacc(static_cast<size_t>(units * g * d));
  std::atomic<int64_t> next{0};
  const RowOps ops;
  run_workers(workers, [&](int64_t) {
    std::vector<float> scores, wgt, krow(static_cast<size_t>(d)), vrow;
    for (int64_t u; (u = next.fetch_add(1)) < units;) {
      int s = 0;
      while (u >= first[s + 1]) ++s;
      const StateArgs& S = segs[s];
      const int64_t P = parts[s], t = S.t;
      const int64_t rbk = (d * S.kb + 7) / 8, rbv = (d * S.vb + 7) / 8;
      const int64_t h = (u - first[s]) / P, part = (u - first[s]) % P;
      const int64_t a0 = std::clamp<int64_t>(S.lo[h], 0, t),
                    b0 = std::clamp<int64_t>(S.hi[h], a0, t);
      const int64_t per = (b0 - a0 + P - 1) / P;
      const int64_t a = std::min(b0, a0 + part * per), b = std::min(b0, a + per);
      const int64_t n = b - a;
      float* mh = pm.data() + u * g;
      float* lh = pl.data() + u * g;
      float* acch = pacc.data() + u * g * d;
      std::fill(acch, acch + g * d, 0.0f);
      if (n == 0) {
        std::fill(mh, mh + g, -std::numeric_limits<float>::infinity());
        std::fill(lh, lh + g, 0.0f);
        continue;
      }
      scores.resize(static_cast<size_t>(g * n));
      // each key decoded once and scored for the g query rows
      ops.dots(S.qr + h * g * d, g, S.kpacked + (h * t + a) * rbk, rbk, n, d, S.kb, S.kcent,
               krow.data(), scores.data());
      const float* knh = S.knorm + h * t + a;
      for (int64_t r = 0; r < g; ++r) {
        float* sr = scores.data() + r * n;
        const float qb = S.qbias[h * g + r];
        for (int64_t i = 0; i < n; ++i) sr[i] = scale * (knh[i] * sr[i]) + qb;
      }
      ops.softmax(scores.data(), g, n, mh, lh);
      const uint8_t* vh = S.vpacked + h * t * rbv;
      const float* vnh = S.vnorm + h * t;
      wgt.resize(static_cast<size_t>(n * g));  // (n, g): each token's weights
      for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < g; ++r)
          wgt[static_cast<size_t>(i * g + r)] =
              scores[static_cast<size_t>(r * n + i)] * vnh[a + i];
      ops.add(wgt.data(), n, g, vh + a * rbv, rbv, d, S.vb, S.vcent, vrow, acch);
    }
  });
  // the parts of each head merged: m = max m_p, l = sum l_p e^(m_p - m), acc likewise
  for (int s = 0; s < nseg; ++s) {
    const StateArgs& S = segs[s];
    const int64_t P = parts[s];
    for (int64_t h = 0; h < bh; ++h)
      for (int64_t r = 0; r < g; ++r) {
        const size_t base = static_cast<size_t>(first[s] + h * P);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < P; ++p) mx = std::max(mx, pm[(base + p) * g + r]);
        float* out = S.acc + (h * g + r) * d;
        std::fill(out, out + d, 0.0f);
        float sum = 0.0f;
        for (int64_t p = 0; p < P; ++p) {
          const size_t at = (base + p) * g + r;
          const float lp = pl[at];
          if (lp == 0.0f) continue;
          const float w = P == 1 ? 1.0f : std::exp(pm[at] - mx);
          sum += w * lp;
          const float* src = pacc.data() + at * d;
          for (int64_t j = 0; j < d; ++j) out[j] += w * src[j];
        }
        S.m[h * g + r] = mx;
        S.l[h * g + r] = sum;
      }
  }
}

// IEEE half -> float, exactly (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element i of a full-precision row buffer as float32 (kernels.h KVExact dtypes).
inline float element(const void* x, int dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dtype == kBF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return half_to_float(h);
}

// half -> float of n values, exactly (half_to_float's values).
void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}

#ifdef TQVEC_X86
// The same with F16C: its conversion is exact too, 8 values per instruction.
__attribute__((target("avx2,f16c"))) void halves_to_floats_f16c(const uint16_t* h, int64_t n,
                                                                float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}
#endif

// A side's per-token multipliers of tokens [lo, hi) of every head, as float32 (bh, t).
void side_norms(const KVCodeSide& side, int64_t bh, int64_t t, int64_t lo, int64_t hi,
                std::vector<float>& out) {
  out.resize(static_cast<size_t>(bh * t));
  auto convert = halves_to_floats;
#ifdef TQVEC_X86
  static const bool f16c = simd_avx2() && __builtin_cpu_supports("f16c");
  if (f16c) convert = halves_to_floats_f16c;
#endif
  for (int64_t h = 0; h < bh; ++h) {
    float* o = out.data() + h * t;
    if (side.norm8) {
      for (int64_t i = lo; i < hi; ++i) o[i] = side.norm_table[side.norm8[h * t + i]];
    } else {
      convert(side.norm16 + h * t + lo, hi - lo, o + lo);
    }
  }
}

}  // namespace

void decode_attention(const float* qr, const float* qbias, int64_t bh, int64_t g, int64_t d,
                      const uint8_t* kpacked, const float* knorm, const float* kcent, int kb,
                      const uint8_t* vpacked, const float* vnorm, const float* vcent, int vb,
                      int64_t t, const int32_t* lo, const int32_t* hi, float scale, float* m,
                      float* l, float* acc, int nthreads) {
  const StateArgs s{qr, qbias, kpacked, knorm, kcent, kb, vpacked, vnorm, vcent, vb,
                    t, lo, hi, m, l, acc};
  softmax_states(&s, 1, bh, g, d, scale, nthreads);
}

void attention_step(const float* q, int64_t bh, int64_t heads, int64_t g, int64_t d,
                    float scale, const KVCodeSegment* segs, int nseg, const KVExact* exact,
                    int nexact, float* out, int nthreads) {
  const int64_t rows = bh * g;
  const size_t nrd = static_cast<size_t>(rows * d), nr = static_cast<size_t>(rows);
  std::vector<std::vector<float>> qr(nseg), qbias(nseg), knorm(nseg), vnorm(nseg), m(nseg),
      l(nseg), acc(nseg);
  std::vector<std::vector<int32_t>> lo(nseg), hi(nseg);
  std::vector<StateArgs> states(static_cast<size_t>(nseg));
  std::vector<float> qk(nrd);
  for (int s = 0; s < nseg; ++s) {
    const KVCodeSegment& S = segs[s];
    const KVCodeSide& K = S.key;
    // <q, k> = <q, mu> + <q sc, (k - mu) / sc>: the codes hold (k - mu) / sc
    qbias[s].assign(nr, 0.0f);
    for (int64_t i = 0; i < rows; ++i) {
      const float* qi = q + i * d;
      const int64_t head = (i / g) % heads;
      float* qki = qk.data() + i * d;
      if (K.sc == nullptr) {
        std::copy(qi, qi + d, qki);
        continue;
      }
      const float* sc = K.sc + head * d;
      const float* mu = K.mu + head * d;
      float b = 0.0f;
      for (int64_t j = 0; j < d; ++j) {
        qki[j] = qi[j] * sc[j];
        b += qi[j] * mu[j];
      }
      qbias[s][static_cast<size_t>(i)] = scale * b;
    }
    qr[s].resize(nrd);
    hadamard_rotate(qk.data(), rows, d, K.rot.perms, K.rot.signs, K.rot.rounds, K.rot.p, false,
                    qr[s].data(), 1);
    side_norms(K, bh, S.t, S.lo, S.hi, knorm[s]);
    side_norms(S.value, bh, S.t, S.lo, S.hi, vnorm[s]);
    lo[s].assign(static_cast<size_t>(bh), static_cast<int32_t>(S.lo));
    hi[s].assign(static_cast<size_t>(bh), static_cast<int32_t>(S.hi));
    m[s].resize(nr);
    l[s].resize(nr);
    acc[s].resize(nrd);
    states[s] = StateArgs{qr[s].data(), qbias[s].data(), K.packed, knorm[s].data(), K.cent,
                          K.b, S.value.packed, vnorm[s].data(), S.value.cent, S.value.b,
                          S.t, lo[s].data(), hi[s].data(), m[s].data(), l[s].data(),
                          acc[s].data()};
  }
  softmax_states(states.data(), nseg, bh, g, d, scale, nthreads);
  // each segment's value sums back from its rotated domain: sum_t p_t (sc y_t + mu)
  for (int s = 0; s < nseg; ++s) {
    const KVCodeSide& V = segs[s].value;
    hadamard_rotate(acc[s].data(), rows, d, V.rot.perms, V.rot.signs, V.rot.rounds, V.rot.p,
                    true, qk.data(), 1);
    for (int64_t i = 0; i < rows; ++i) {
      float* a = acc[s].data() + i * d;
      const float* y = qk.data() + i * d;
      if (V.sc == nullptr) {
        std::copy(y, y + d, a);
        continue;
      }
      const int64_t head = (i / g) % heads;
      const float* sc = V.sc + head * d;
      const float* mu = V.mu + head * d;
      const float li = l[s][static_cast<size_t>(i)];
      for (int64_t j = 0; j < d; ++j) a[j] = y[j] * sc[j] + li * mu[j];
    }
  }
  // one softmax over the code segments' states and the exact segments' scores; each head's
  // full-precision rows converted to float32 once for its g query rows
  int64_t nx = 0;
  for (int e = 0; e < nexact; ++e) nx += exact[e].n;
  std::vector<float> xk(static_cast<size_t>(nx * d)), xv(static_cast<size_t>(nx * d)),
      xs(static_cast<size_t>(nx));
  for (int64_t h = 0; h < bh; ++h) {
    int64_t at = 0;
    for (int e = 0; e < nexact; ++e) {
      const KVExact& E = exact[e];
      for (int64_t j = 0; j < E.n * d; ++j, ++at) {
        xk[static_cast<size_t>(at)] = element(E.k, E.dtype, h * E.n * d + j);
        xv[static_cast<size_t>(at)] = element(E.v, E.dtype, h * E.n * d + j);
      }
    }
    for (int64_t r = 0; r < g; ++r) {
      const int64_t i = h * g + r;
      const float* qi = q + i * d;
      float top = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < nseg; ++s) top = std::max(top, m[s][static_cast<size_t>(i)]);
      for (int64_t t = 0; t < nx; ++t) {
        xs[static_cast<size_t>(t)] = dot16(qi, xk.data() + t * d, d) * scale;
        top = std::max(top, xs[static_cast<size_t>(t)]);
      }
      const float ref = std::isfinite(top) ? top : 0.0f;
      float* o = out + i * d;
      std::fill(o, o + d, 0.0f);
      float total = 0.0f;
      for (int s = 0; s < nseg; ++s) {
        const float w = std::exp(m[s][static_cast<size_t>(i)] - ref);
        total += l[s][static_cast<size_t>(i)] * w;
        const float* a = acc[s].data() + i * d;
        for (int64_t j = 0; j < d; ++j) o[j] += a[j] * w;
      }
      for (int64_t t = 0; t < nx; ++t) {
        const float p = std::exp(xs[static_cast<size_t>(t)] - ref);
        total += p;
        const float* vt = xv.data() + t * d;
        for (int64_t j = 0; j < d; ++j) o[j] += p * vt[j];
      }
      // a row with no visible key gives 0
      if (total > 0.0f) {
        for (int64_t j = 0; j < d; ++j) o[j] /= total;
      } else {
        std::fill(o, o + d, 0.0f);
      }
    }
  }
}

}  // namespace tqvec
