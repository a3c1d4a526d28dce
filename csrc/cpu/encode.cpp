// TurboQuant-mse encoding of float32 rows in one call (its meaning: the codec's steps,
// TurboQuant.encode_block in tqvec/codecs/turbo.py): the rows rotated (hadamard_rotate), scaled
// by 1 / their norm (0 for a zero row) and quantized (quantize_pack), and with `fit` each row's
// least-squares multiplier norm <u, c> / ||c||^2 from centroid_stats. The same kernels in the
// same order, so the same bits; one call where the steps cost a few dozen torch operations
// around them - more than their arithmetic on a KV cache's 16-64-token blocks or one added
// vector.
#include <vector>

#include "kernels.h"

namespace tqvec {

void turbo_mse_encode(const float* x, const float* nrm, int64_t n, int64_t d,
                      const RotationArgs& rot, const float* thr, const float* centroids, int b,
                      uint8_t* packed, float* fit, int nthreads) {
  std::vector<float> y(static_cast<size_t>(n * d)), inv(static_cast<size_t>(n));
  hadamard_rotate(x, n, d, rot.perms, rot.signs, rot.rounds, rot.p, false, y.data(), nthreads);
  // what inverse_norms computes: 1 / norm (one IEEE division), 0 for a zero (or NaN) norm
  for (int64_t i = 0; i < n; ++i) inv[i] = nrm[i] > 0.0f ? 1.0f / nrm[i] : 0.0f;
  quantize_pack(y.data(), inv.data(), n, d, thr, b, packed, nthreads);
  if (fit == nullptr) return;
  std::vector<float> csq(static_cast<size_t>(n)), dot(static_cast<size_t>(n));
  centroid_stats(packed, n, d, b, centroids, y.data(), inv.data(), csq.data(), dot.data(),
                 nthreads);
  // nrm * dot / csq, left to right in float32 as torch evaluates it
  for (int64_t i = 0; i < n; ++i) fit[i] = nrm[i] * dot[i] / csq[i];
}

}  // namespace tqvec
