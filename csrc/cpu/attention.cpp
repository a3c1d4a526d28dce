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
// Per KV head: each key row unpacked once and scored for its G query rows from per-row
// (d, 2^kb) tables, the exp weights, then each value row unpacked once and added to all G rows.
// Scores are summed in another order than the reference's GEMM: equal within float rounding.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

// The indices of one packed row (kernels.h bit order) -> idx[0 .. d): whole groups of 8
// indices (b bytes, read as one little-endian 64-bit word) at a time, then the tail.
void unpack_row(const uint8_t* row, int64_t d, int b, uint8_t* idx) {
  const uint64_t mask = (1u << b) - 1u;
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    uint64_t w = 0;
    std::memcpy(&w, row + (j * b) / 8, static_cast<size_t>(b));  // 8 indices = b bytes
    for (int u = 0; u < 8; ++u) idx[j + u] = static_cast<uint8_t>((w >> (u * b)) & mask);
  }
  for (; j < d; ++j) {
    const int64_t bit = j * b;
    const uint32_t lo8 = row[bit >> 3];
    const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
    idx[j] = static_cast<uint8_t>((((hi8 << 8) | lo8) >> (bit & 7)) & mask);
  }
}

}  // namespace

void decode_attention(const float* qr, const float* qbias, int64_t bh, int64_t g, int64_t d,
                      const uint8_t* kpacked, const float* knorm, const float* kcent, int kb,
                      const uint8_t* vpacked, const float* vnorm, const float* vcent, int vb,
                      int64_t t, const int32_t* lo, const int32_t* hi, float scale, float* m,
                      float* l, float* acc, int nthreads) {
  const int64_t rbk = (d * kb + 7) / 8, rbv = (d * vb + 7) / 8;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(nthreads, bh));
  run_workers(workers, [&](int64_t w) {
    std::vector<float> qtab, scores, vrow(static_cast<size_t>(d));
    std::vector<uint8_t> kidx(static_cast<size_t>(d)), vidx(static_cast<size_t>(d));
    for (int64_t h = w; h < bh; h += workers) {
      const int64_t a = std::clamp<int64_t>(lo[h], 0, t), b = std::clamp<int64_t>(hi[h], a, t);
      const int64_t n = b - a;
      float* mh = m + h * g;
      float* lh = l + h * g;
      float* acch = acc + h * g * d;
      std::fill(acch, acch + g * d, 0.0f);
      if (n == 0) {
        std::fill(mh, mh + g, -std::numeric_limits<float>::infinity());
        std::fill(lh, lh + g, 0.0f);
        continue;
      }
      scores.resize(static_cast<size_t>(g * n));
      const uint8_t* kh = kpacked + h * t * rbk;
      const float* knh = knorm + h * t;
      // <q_r, c[idx]> for every row r of the head: each key's indices unpacked once, then one
      // lookup per coordinate and row in the (d, 2^kb) table of q_r (c[v] q_r[j] at j*K + v).
      const int K = 1 << kb;
      qtab.resize(static_cast<size_t>(g * d * K));
      for (int64_t r = 0; r < g; ++r) {
        const float* q = qr + (h * g + r) * d;
        float* T = qtab.data() + r * d * K;
        for (int64_t j = 0; j < d; ++j)
          for (int v = 0; v < K; ++v) T[j * K + v] = q[j] * kcent[v];
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = a + i;
        unpack_row(kh + tok * rbk, d, kb, kidx.data());
        for (int64_t r = 0; r < g; ++r) {
          const float* T = qtab.data() + r * d * K;
          float s0 = 0.f, s1 = 0.f;
          int64_t j = 0;
          for (; j + 2 <= d; j += 2) {
            s0 += T[j * K + kidx[static_cast<size_t>(j)]];
            s1 += T[(j + 1) * K + kidx[static_cast<size_t>(j + 1)]];
          }
          if (j < d) s0 += T[j * K + kidx[static_cast<size_t>(j)]];
          scores[static_cast<size_t>(r * n + i)] = scale * (knh[tok] * (s0 + s1)) + qbias[h * g + r];
        }
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
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = a + i;
        unpack_row(vh + tok * rbv, d, vb, vidx.data());
        for (int64_t j = 0; j < d; ++j) vrow[static_cast<size_t>(j)] = vcent[vidx[static_cast<size_t>(j)]];
        for (int64_t r = 0; r < g; ++r) {
          const float wgt = scores[static_cast<size_t>(r * n + i)] * vnh[tok];
          if (wgt == 0.0f) continue;
          float* out = acch + r * d;
          for (int64_t j = 0; j < d; ++j) out[j] += wgt * vrow[static_cast<size_t>(j)];
        }
      }
    }
  });
}

}  // namespace tqvec
