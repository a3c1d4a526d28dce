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
// Per (KV head, row): the small key table of rescore_codes.h (nibble tables at 1, 2, 4 bits),
// every score, then the exp weights; each value row is unpacked once and added to all G rows.
// Scores are summed in another order than the reference's GEMM: equal within float rounding.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "rescore_codes.h"

namespace tqvec {
namespace {

// Indices of one packed row -> float centroids (d values).
void unpack_values(const uint8_t* row, int64_t d, int b, const float* c, float* out) {
  if (b == 8) {
    for (int64_t j = 0; j < d; ++j) out[j] = c[row[j]];
    return;
  }
  const uint32_t mask = (1u << b) - 1u;
  for (int64_t j = 0; j < d; ++j) {
    const int64_t bit = j * b;
    const uint32_t lo8 = row[bit >> 3];
    const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
    out[j] = c[(((hi8 << 8) | lo8) >> (bit & 7)) & mask];
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
    std::vector<float> table, scores, vrow(static_cast<size_t>(d));
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
      for (int64_t r = 0; r < g; ++r) {
        const float* q = qr + (h * g + r) * d;
        rescore_table(q, d, kb, kcent, table);
        float* s = scores.data() + r * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) {
          const int64_t tok = a + i;
          s[i] = scale * (knh[tok] * rescore_row(q, table.data(), kh + tok * rbk, d, kb, kcent)) +
                 qbias[h * g + r];
          mx = std::max(mx, s[i]);
        }
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
        unpack_values(vh + tok * rbv, d, vb, vcent, vrow.data());
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
