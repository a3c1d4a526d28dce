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
// key row unpacked and decoded once and scored for its G query rows by 8-lane dots, the exp
// weights, then each value row decoded once and added to all G rows; the parts' softmax states
// merged per head. Scores are summed in another order than the reference's GEMM: equal within
// float rounding.
#include <algorithm>
#include <atomic>
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
  run_workers(workers, [&](int64_t) {
    std::vector<float> scores, krow(static_cast<size_t>(d)), vrow(static_cast<size_t>(d));
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
      // each key decoded once to floats (its centroids), then one 8-lane dot per query row
      for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = a + i;
        unpack_row(kh + tok * rbk, d, kb, kidx.data());
        for (int64_t j = 0; j < d; ++j) krow[static_cast<size_t>(j)] = kcent[kidx[static_cast<size_t>(j)]];
        for (int64_t r = 0; r < g; ++r)
          scores[static_cast<size_t>(r * n + i)] =
              scale * (knh[tok] * dot8(qr + (h * g + r) * d, krow.data(), d)) + qbias[h * g + r];
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
