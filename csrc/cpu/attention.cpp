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
// Each KV head's tokens split into parts (threads take parts, not only heads); per part each
// key row decoded once (with AVX2: eight indices per step, shifted into their lanes and looked
// up in the centroids by one vpermps) and scored for its G query rows by 8-lane dots, the exp
// weights, then each value row decoded once and added to all G rows; the parts' softmax states
// merged per head. The AVX2 and portable paths do the same float operations in the same order
// (same bits); scores are summed in another order than the reference's GEMM: equal within
// float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "arch.h"
#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

// The indices of one packed row (kernels.h bit order) -> idx[0 .. d): whole groups of 8
// indices (b bytes, read as one little-endian 64-bit word) at a time, then the tail.
void unpack_row(const uint8_t* row, int64_t d, int b, uint8_t* idx) {
  const uint64_t mask = (1u << b) - 1u;
  const int64_t rb = (d * b + 7) / 8;
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    // 8 indices = b bytes; an 8-byte load where the row has them (a fixed-size copy is one
    // load: a copy of b bytes was a library call per group, a third of the kernel's time)
    const int64_t at = (j * b) / 8;
    uint64_t w = 0;
    if (at + 8 <= rb) {
      std::memcpy(&w, row + at, 8);  // bits past 8 b are never read below
    } else {  // the row's last groups: byte by byte (a b-byte memcpy is a library call)
      for (int y = 0; y < b; ++y) w |= static_cast<uint64_t>(row[at + y]) << (8 * y);
    }
    for (int u = 0; u < 8; ++u) idx[j + u] = static_cast<uint8_t>((w >> (u * b)) & mask);
  }
  for (; j < d; ++j) {
    const int64_t bit = j * b;
    const uint32_t lo8 = row[bit >> 3];
    const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
    idx[j] = static_cast<uint8_t>((((hi8 << 8) | lo8) >> (bit & 7)) & mask);
  }
}

// <a, b> over d floats in 8 independent lanes (an element-wise loop the compiler vectorizes
// without reassociating), the lanes then added in order.
inline float dot8(const float* __restrict a, const float* __restrict b, int64_t d) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8)
    for (int u = 0; u < 8; ++u) lane[u] += a[j + u] * b[j + u];
  float s = 0.f;
  for (; j < d; ++j) s += a[j] * b[j];
  for (int u = 0; u < 8; ++u) s += lane[u];
  return s;
}

// One packed row of b-bit indices decoded to its centroids: out[j] = cent[index j].
void decode_row(const uint8_t* row, int64_t d, int b, const float* cent, uint8_t* idx,
                float* out) {
  unpack_row(row, d, b, idx);
  for (int64_t j = 0; j < d; ++j) out[j] = cent[idx[j]];
}

// A key row against g query rows q[r d ..]: dots[r] = dot8(q_r, the decoded row). Scratch:
// idx, row (d each).
void score_row(const float* q, int64_t g, const uint8_t* packed, int64_t d, int b,
               const float* cent, uint8_t* idx, float* row, float* dots) {
  decode_row(packed, d, b, cent, idx, row);
  for (int64_t r = 0; r < g; ++r) dots[r] = dot8(q + r * d, row, d);
}

// A value row added to g accumulator rows: acc[r d + j] += w[r] x the decoded row's j-th value,
// rows with w[r] = 0 left alone.
void add_row(const float* w, int64_t g, const uint8_t* packed, int64_t d, int b,
             const float* cent, uint8_t* idx, float* row, float* acc) {
  decode_row(packed, d, b, cent, idx, row);
  for (int64_t r = 0; r < g; ++r) {
    if (w[r] == 0.0f) continue;
    float* out = acc + r * d;
    for (int64_t j = 0; j < d; ++j) out[j] += w[r] * row[j];
  }
}

#ifdef TQVEC_X86
// score_row and add_row with AVX2 and the same float operations per lane, in the same order
// (mul then add, no FMA). The row is decoded eight coordinates per step - the step's B bytes
// broadcast and shifted into the lanes, then looked up in the centroids (zero-padded to 16) by
// one vpermps (two and a blend for B = 4), or gathered for B = 8 - and its dots with up to 8
// query rows run side by side (one row's chain of dependent adds would bound the loop by the
// add latency). Other widths take the portable functions.
template <int B>
__attribute__((target("avx2"))) void decode_row_avx2(const uint8_t* row, int64_t d,
                                                     const float* cent, float* out) {
  const int64_t rb = (d * B + 7) / 8, d8 = d / 8 * 8;
  if constexpr (B == 8) {
    for (int64_t j = 0; j < d8; j += 8) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j));
      _mm256_storeu_ps(out + j, _mm256_i32gather_ps(cent, _mm256_cvtepu8_epi32(b8), 4));
    }
  } else {
    alignas(32) float tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tab, cent, sizeof(float) << B);
    const __m256 t0 = _mm256_load_ps(tab), t1 = _mm256_load_ps(tab + 8);
    const __m256i shift = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
    const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
    for (int64_t j = 0; j < d8; j += 8) {
      const int64_t at = j * B / 8;  // the step's B bytes; 4 loaded where the row has them
      uint32_t w = 0;
      if (at + 4 <= rb)
        std::memcpy(&w, row + at, 4);
      else
        for (int y = 0; y < B; ++y) w |= static_cast<uint32_t>(row[at + y]) << (8 * y);
      const __m256i ix = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shift), mask);
      __m256 v = _mm256_permutevar8x32_ps(t0, ix);
      if constexpr (B == 4)  // indices 8-15: the upper table, picked by bit 3 moved to the sign
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(t1, ix),
                             _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28)));
      _mm256_storeu_ps(out + j, v);
    }
  }
  for (int64_t j = d8; j < d; ++j) {
    const int64_t bit = j * B;
    const uint32_t lo8 = row[bit >> 3];
    const uint32_t hi8 = ((bit & 7) + B > 8) ? row[(bit >> 3) + 1] : 0u;
    out[j] = cent[(((hi8 << 8) | lo8) >> (bit & 7)) & ((1u << B) - 1u)];
  }
}

// false where the width has no vector decode
__attribute__((target("avx2"))) bool decode_any_avx2(const uint8_t* row, int64_t d, int b,
                                                     const float* cent, float* out) {
  switch (b) {
    case 1: decode_row_avx2<1>(row, d, cent, out); return true;
    case 2: decode_row_avx2<2>(row, d, cent, out); return true;
    case 3: decode_row_avx2<3>(row, d, cent, out); return true;
    case 4: decode_row_avx2<4>(row, d, cent, out); return true;
    case 8: decode_row_avx2<8>(row, d, cent, out); return true;
    default: return false;
  }
}

template <int G>
__attribute__((target("avx2"))) void dots_avx2(const float* q, int64_t d, const float* x,
                                               float* dots) {
  __m256 acc[G];
  for (int r = 0; r < G; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t d8 = d / 8 * 8;
  for (int64_t j = 0; j < d8; j += 8) {
    const __m256 x8 = _mm256_loadu_ps(x + j);
    for (int r = 0; r < G; ++r)
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_loadu_ps(q + r * d + j), x8));
  }
  for (int r = 0; r < G; ++r) {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, acc[r]);
    float s = 0.f;
    for (int64_t j = d8; j < d; ++j) s += q[r * d + j] * x[j];
    for (int u = 0; u < 8; ++u) s += lane[u];
    dots[r] = s;
  }
}

template <int G>
__attribute__((target("avx2"))) void add_rows_avx2(const float* w, int64_t d, const float* x,
                                                   float* acc) {
  const int64_t d8 = d / 8 * 8;
  for (int r = 0; r < G; ++r) {
    if (w[r] == 0.0f) continue;
    const __m256 vw = _mm256_set1_ps(w[r]);
    float* out = acc + r * d;
    for (int64_t j = 0; j < d8; j += 8)
      _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(out + j),
                                              _mm256_mul_ps(vw, _mm256_loadu_ps(x + j))));
    for (int64_t j = d8; j < d; ++j) out[j] += w[r] * x[j];
  }
}

__attribute__((target("avx2"))) void score_row_avx2(const float* q, int64_t g,
                                                    const uint8_t* packed, int64_t d, int b,
                                                    const float* cent, uint8_t* idx, float* row,
                                                    float* dots) {
  if (!decode_any_avx2(packed, d, b, cent, row)) decode_row(packed, d, b, cent, idx, row);
  for (int64_t r0 = 0; r0 < g; r0 += 4) {  // 4 rows at a time: 4 chains cover the add latency
    const float* qq = q + r0 * d;
    switch (std::min<int64_t>(4, g - r0)) {
      case 1: dots_avx2<1>(qq, d, row, dots + r0); break;
      case 2: dots_avx2<2>(qq, d, row, dots + r0); break;
      case 3: dots_avx2<3>(qq, d, row, dots + r0); break;
      default: dots_avx2<4>(qq, d, row, dots + r0); break;
    }
  }
}

__attribute__((target("avx2"))) void add_row_avx2(const float* w, int64_t g,
                                                  const uint8_t* packed, int64_t d, int b,
                                                  const float* cent, uint8_t* idx, float* row,
                                                  float* acc) {
  if (!decode_any_avx2(packed, d, b, cent, row)) decode_row(packed, d, b, cent, idx, row);
  add_rows_avx2<1>(w, d, row, acc);
  for (int64_t r = 1; r < g; ++r) add_rows_avx2<1>(w + r, d, row, acc + r * d);
}
#endif

// The row functions of the path present (kernels.h: simd_avx2).
struct RowOps {
  void (*score)(const float*, int64_t, const uint8_t*, int64_t, int, const float*, uint8_t*,
                float*, float*) = score_row;
  void (*add)(const float*, int64_t, const uint8_t*, int64_t, int, const float*, uint8_t*,
              float*, float*) = add_row;
  RowOps() {
#ifdef TQVEC_X86
    if (simd_avx2()) score = score_row_avx2, add = add_row_avx2;
#endif
  }
};

}  // namespace

void decode_attention(const float* qr, const float* qbias, int64_t bh, int64_t g, int64_t d,
                      const uint8_t* kpacked, const float* knorm, const float* kcent, int kb,
                      const uint8_t* vpacked, const float* vnorm, const float* vcent, int vb,
                      int64_t t, const int32_t* lo, const int32_t* hi, float scale, float* m,
                      float* l, float* acc, int nthreads) {
  const int64_t rbk = (d * kb + 7) / 8, rbv = (d * vb + 7) / 8;
  // Work units: each head's tokens in P parts (flash-decoding's split), so that a few KV heads
  // still keep every thread busy; each part's softmax state is merged per head at the end.
  constexpr int64_t kMinPart = 512;  // tokens per part below which a split costs more than it saves
  const int64_t workers0 = std::max<int64_t>(1, nthreads);
  const int64_t P = std::clamp<int64_t>((4 * workers0 + bh - 1) / bh, 1,
                                        std::max<int64_t>(1, t / kMinPart));  // t bounds every head's count
  const int64_t units = bh * P;
  const int64_t workers = std::min(workers0, units);
  std::vector<float> pm(static_cast<size_t>(units * g)), pl(static_cast<size_t>(units * g));
  std::vector<float> pacc(static_cast<size_t>(units * g * d));
  std::atomic<int64_t> next{0};
  const RowOps ops;
  run_workers(workers, [&](int64_t) {
    std::vector<float> scores, tdots, twgt, krow(static_cast<size_t>(d)),
        vrow(static_cast<size_t>(d));
    std::vector<uint8_t> kidx(static_cast<size_t>(d)), vidx(static_cast<size_t>(d));
    for (int64_t u; (u = next.fetch_add(1)) < units;) {
      const int64_t h = u / P, part = u % P;
      const int64_t a0 = std::clamp<int64_t>(lo[h], 0, t), b0 = std::clamp<int64_t>(hi[h], a0, t);
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
      const uint8_t* kh = kpacked + h * t * rbk;
      const float* knh = knorm + h * t;
      // each key decoded once and scored for the g query rows (their dots kept token-major)
      std::vector<float>& dots = tdots;
      dots.resize(static_cast<size_t>(g));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = a + i;
        ops.score(qr + h * g * d, g, kh + tok * rbk, d, kb, kcent, kidx.data(), krow.data(),
                  dots.data());
        for (int64_t r = 0; r < g; ++r)
          scores[static_cast<size_t>(r * n + i)] =
              scale * (knh[tok] * dots[static_cast<size_t>(r)]) + qbias[h * g + r];
      }
      for (int64_t r = 0; r < g; ++r) {
        float* s = scores.data() + r * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
        const float ref = std::isfinite(mx) ? mx : 0.0f;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - ref);
          sum += s[i];
        }
        mh[r] = mx;
        lh[r] = sum;
      }
      const uint8_t* vh = vpacked + h * t * rbv;
      const float* vnh = vnorm + h * t;
      std::vector<float>& wgt = twgt;
      wgt.resize(static_cast<size_t>(g));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = a + i;
        for (int64_t r = 0; r < g; ++r)
          wgt[static_cast<size_t>(r)] = scores[static_cast<size_t>(r * n + i)] * vnh[tok];
        ops.add(wgt.data(), g, vh + tok * rbv, d, vb, vcent, vidx.data(), vrow.data(), acch);
      }
    }
  });
  // the parts of each head merged: m = max m_p, l = sum l_p e^(m_p - m), acc likewise
  for (int64_t h = 0; h < bh; ++h)
    for (int64_t r = 0; r < g; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < P; ++p) mx = std::max(mx, pm[static_cast<size_t>((h * P + p) * g + r)]);
      float* out = acc + (h * g + r) * d;
      std::fill(out, out + d, 0.0f);
      float sum = 0.0f;
      for (int64_t p = 0; p < P; ++p) {
        const size_t at = static_cast<size_t>((h * P + p) * g + r);
        const float lp = pl[at];
        if (lp == 0.0f) continue;
        const float w = P == 1 ? 1.0f : std::exp(pm[at] - mx);
        sum += w * lp;
        const float* src = pacc.data() + at * d;
        for (int64_t j = 0; j < d; ++j) out[j] += w * src[j];
      }
      m[h * g + r] = mx;
      l[h * g + r] = sum;
    }
}

}  // namespace tqvec
