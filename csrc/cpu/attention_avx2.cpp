// The row functions of decode attention with AVX2 (attention_rows.h): the portable
// functions' float operations lane by lane, in the same order.

#include "arch.h"

#ifdef TQVEC_X86
#include <cstring>
#include <vector>

#include "attention_rows.h"
#include "kernels.h"
#include "rescore_codes.h"

namespace tqvec {
namespace attn {

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

}  // namespace attn
}  // namespace tqvec
#endif
