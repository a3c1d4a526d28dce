// Multi-round randomized Hadamard rotation for any d (the meaning is hadamard_rotate_ref in
// tqvec/ops/ref.py). Round r: z = x[perm_r] * signs_r; then the unnormalized Walsh-Hadamard
// butterflies on z[0:p] and, if p < d, on the overlapping block z[d-p:d], each followed by one
// float32 multiply by 1/sqrt(p). Butterflies run in the same order as the reference (stage
// h = 1, 2, 4, ...; pairs (j, j+h)), so results are bit-identical: only + and - are rounded.
// Layouts: see kernels.h.
#include <cmath>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

__attribute__((target_clones("avx2", "default")))
void fwht_block(float* x, int64_t p, float inv_sqrt_p) {
  for (int64_t h = 1; h < p; h <<= 1) {
    for (int64_t i = 0; i < p; i += 2 * h) {
      float* a = x + i;
      float* b = x + i + h;
      for (int64_t j = 0; j < h; ++j) {
        const float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
      }
    }
  }
  for (int64_t j = 0; j < p; ++j) x[j] *= inv_sqrt_p;
}

}  // namespace

void hadamard_rotate(const float* x, int64_t n, int64_t d, const int64_t* perms,
                     const float* signs, int rounds, int64_t p, bool inverse, float* out,
                     int nthreads) {
  // The same float32 constant as the reference: float(1/sqrt(p)) rounded once from double.
  const float inv_sqrt_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)));
  parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
    std::vector<float> z(static_cast<size_t>(d)), w(static_cast<size_t>(d));
    for (int64_t i = lo; i < hi; ++i) {
      const float* xi = x + i * d;
      for (int64_t j = 0; j < d; ++j) z[j] = xi[j];
      for (int rr = 0; rr < rounds; ++rr) {
        const int r = inverse ? rounds - 1 - rr : rr;
        const int64_t* perm = perms + static_cast<int64_t>(r) * d;
        const float* sg = signs + static_cast<int64_t>(r) * d;
        if (!inverse) {
          for (int64_t j = 0; j < d; ++j) w[j] = z[perm[j]] * sg[j];
          fwht_block(w.data(), p, inv_sqrt_p);
          if (p < d) fwht_block(w.data() + (d - p), p, inv_sqrt_p);
          z.swap(w);
        } else {
          if (p < d) fwht_block(z.data() + (d - p), p, inv_sqrt_p);
          fwht_block(z.data(), p, inv_sqrt_p);
          for (int64_t j = 0; j < d; ++j) w[perm[j]] = z[j] * sg[j];
          z.swap(w);
        }
      }
      float* oi = out + i * d;
      for (int64_t j = 0; j < d; ++j) oi[j] = z[j];
    }
  });
}

}  // namespace tqvec
