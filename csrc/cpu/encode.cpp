// TurboQuant-mse encoding and decoding in one call each (their meaning: the codec's steps,
// TurboQuant.encode_block and decode_block in tqvec/codecs/turbo.py). Encoding of float32 rows:
// the rows rotated (hadamard_rotate), scaled by 1 / their norm (0 for a zero row) and quantized
// (quantize_pack), and with `fit` each row's least-squares multiplier norm <u, c> / ||c||^2 from
// centroid_stats. Decoding: the codes' centroids times the row multipliers (dequantize_rows),
// rotated back (hadamard_rotate, inverse). The same kernels in the same order, so the same bits;
// one call where the steps cost a few dozen torch operations around them - more than their
// arithmetic on a KV cache's 16-64-token blocks or one added vector - and chunk by chunk, so that
// the rotated rows between two steps stay in cache.
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {

namespace {
// Rows per chunk of the one-call encode and decode: a chunk's rotated-domain rows (64 KB of
// float32) stay in the core's L2 between the rotation and the step after it.
int64_t chunk_rows(int64_t d) {
  return std::max<int64_t>(8, ((int64_t{1} << 14) / std::max<int64_t>(1, d)) & ~int64_t{7});
}
}  // namespace

void turbo_mse_encode(const float* x, const float* nrm, int64_t n, int64_t d,
                      const RotationArgs& rot, const float* thr, const float* centroids, int b,
                      uint8_t* packed, float* fit, int nthreads) {
  const int64_t chunk = chunk_rows(d);
  const int64_t rb = (d * b + 7) / 8;
  parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
    const int64_t rows = std::min(chunk, hi - lo);
    std::vector<float> y(static_cast<size_t>(rows * d)), inv(static_cast<size_t>(rows));
    std::vector<float> csq(fit ? static_cast<size_t>(rows) : 0), dot(csq.size());
    for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
      const int64_t m = std::min(chunk, hi - c0);
      hadamard_rotate(x + c0 * d, m, d, rot.perms, rot.signs, rot.rounds, rot.p, false, y.data(),
                      1);
      // what inverse_norms computes: 1 / norm (one IEEE division), 0 for a zero (or NaN) norm
      for (int64_t i = 0; i < m; ++i) inv[i] = nrm[c0 + i] > 0.0f ? 1.0f / nrm[c0 + i] : 0.0f;
      quantize_pack(y.data(), inv.data(), m, d, thr, b, packed + c0 * rb, 1);
      if (fit == nullptr) continue;
      centroid_stats(packed + c0 * rb, m, d, b, centroids, y.data(), inv.data(), csq.data(),
                     dot.data(), 1);
      // nrm * dot / csq, left to right in float32 as torch evaluates it
      for (int64_t i = 0; i < m; ++i) fit[c0 + i] = nrm[c0 + i] * dot[i] / csq[i];
    }
  }, 64);
}

void turbo_mse_decode(const uint8_t* packed, const float* mult, int64_t n, int64_t d,
                      const RotationArgs& rot, const float* centroids, int b, float* out,
                      int nthreads) {
  const int64_t chunk = chunk_rows(d);
  const int64_t rb = (d * b + 7) / 8;
  parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
    std::vector<float> y(static_cast<size_t>(std::min(chunk, hi - lo) * d));
    for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
      const int64_t m = std::min(chunk, hi - c0);
      dequantize_rows(packed + c0 * rb, mult + c0, m, d, b, centroids, y.data());
      hadamard_rotate(y.data(), m, d, rot.perms, rot.signs, rot.rounds, rot.p, true,
                      out + c0 * d, 1);
    }
  }, 64);
}

}  // namespace tqvec
