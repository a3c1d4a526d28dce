// Multi-round randomized Hadamard rotation for any d (the meaning is hadamard_rotate_ref in
// tqvec/ops/ref.py). Round r: z = x[perm_r] * signs_r; then the unnormalized Walsh-Hadamard
// butterflies on z[0:p] and, if p < d, on the overlapping block z[d-p:d], each followed by one
// float32 multiply by 1/sqrt(p). Layouts: see kernels.h.
//
// Speed: kLanes rows are interleaved (w[j * kLanes + lane]) so that every butterfly stage,
// including h = 1, 2, 4, is a vertical SIMD add/sub over the lanes, and a permutation moves
// whole lane vectors. Each lane performs exactly the reference's scalar float32 operations in
// the reference's order (stage h = 1, 2, 4, ...; pairs (j, j+h)); only + and - and one multiply
// are rounded, so the result is bit-identical to the torch reference.
#include "arch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

constexpr int kLanes = 8;

void fwht_lanes_portable(float* __restrict w, int64_t p, float inv_sqrt_p) {
  for (int64_t h = 1; h < p; h <<= 1) {
    for (int64_t i = 0; i < p; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        float* __restrict a = w + j * kLanes;
        float* __restrict b = w + (j + h) * kLanes;
        for (int l = 0; l < kLanes; ++l) {
          const float u = a[l], v = b[l];
          a[l] = u + v;
          b[l] = u - v;
        }
      }
    }
  }
  for (int64_t k = 0; k < p * kLanes; ++k) w[k] *= inv_sqrt_p;
}

#ifdef TQVEC_X86
// fwht_lanes with AVX2, three stages per pass over the block (h, 2h, 4h on the 8 lane vectors
// j + t h, t = 0..7, held in registers; then one or two stages for what log2 p leaves), the
// 1/sqrt(p) multiply fused into the last pass. Each element sees the portable loop's additions
// and subtractions in its order (stages only mix elements within such groups of 8), so the same
// bits; a third of the loads and stores of stage-by-stage passes (p = 512: 3 passes, not 10).
__attribute__((target("avx2"), always_inline)) inline void bfly(__m256& u, __m256& v) {
  const __m256 a = _mm256_add_ps(u, v), b = _mm256_sub_ps(u, v);
  u = a;
  v = b;
}

__attribute__((target("avx2"))) void fwht_lanes_avx2(float* __restrict w, int64_t p,
                                                     float inv_sqrt_p) {
  const __m256 s = _mm256_set1_ps(inv_sqrt_p);
  int stages = 0;
  while ((int64_t{1} << stages) < p) ++stages;
  if (stages == 0) {
    for (int64_t k = 0; k < p * kLanes; k += 8)
      _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), s));
    return;
  }
  int done = 0;
  while (done < stages) {
    const int take = std::min(3, stages - done);
    const bool last = done + take == stages;
    const int64_t h = int64_t{1} << done, span = h << take;
    for (int64_t i = 0; i < p; i += span)
      for (int64_t j = i; j < i + h; ++j) {
        __m256 v[8];
        for (int t = 0; t < (1 << take); ++t) v[t] = _mm256_loadu_ps(w + (j + t * h) * kLanes);
        if (take == 3) {
          bfly(v[0], v[1]), bfly(v[2], v[3]), bfly(v[4], v[5]), bfly(v[6], v[7]);
          bfly(v[0], v[2]), bfly(v[1], v[3]), bfly(v[4], v[6]), bfly(v[5], v[7]);
          bfly(v[0], v[4]), bfly(v[1], v[5]), bfly(v[2], v[6]), bfly(v[3], v[7]);
        } else if (take == 2) {
          bfly(v[0], v[1]), bfly(v[2], v[3]);
          bfly(v[0], v[2]), bfly(v[1], v[3]);
        } else {
          bfly(v[0], v[1]);
        }
        for (int t = 0; t < (1 << take); ++t)
          _mm256_storeu_ps(w + (j + t * h) * kLanes, last ? _mm256_mul_ps(v[t], s) : v[t]);
      }
    done += take;
  }
}
#endif

void fwht_lanes(float* __restrict w, int64_t p, float inv_sqrt_p) {
#ifdef TQVEC_X86
  if (simd_avx2()) return fwht_lanes_avx2(w, p, inv_sqrt_p);
#endif
  fwht_lanes_portable(w, p, inv_sqrt_p);
}

TQVEC_CLONES_AVX2
void permute_sign_lanes(const float* __restrict z, const int64_t* __restrict perm,
                        const float* __restrict sg, int64_t d, float* __restrict w) {
  for (int64_t j = 0; j < d; ++j) {
    const float* src = z + perm[j] * kLanes;
    float* dst = w + j * kLanes;
    const float s = sg[j];
    for (int l = 0; l < kLanes; ++l) dst[l] = src[l] * s;
  }
}

TQVEC_CLONES_AVX2
void sign_unpermute_lanes(const float* __restrict z, const int64_t* __restrict perm,
                          const float* __restrict sg, int64_t d, float* __restrict w) {
  for (int64_t j = 0; j < d; ++j) {
    const float* src = z + j * kLanes;
    float* dst = w + perm[j] * kLanes;
    const float s = sg[j];
    for (int l = 0; l < kLanes; ++l) dst[l] = src[l] * s;
  }
}

// One row (a query): the same butterflies over contiguous floats, vectorized along j for
// h >= 8; the per-element operations and their order are those of fwht_lanes.
void fwht_row_portable(float* __restrict w, int64_t p, float inv_sqrt_p) {
  for (int64_t h = 1; h < p; h <<= 1) {
    for (int64_t i = 0; i < p; i += 2 * h) {
      float* __restrict a = w + i;
      float* __restrict b = w + i + h;
      for (int64_t j = 0; j < h; ++j) {
        const float u = a[j], v = b[j];
        a[j] = u + v;
        b[j] = u - v;
      }
    }
  }
  for (int64_t k = 0; k < p; ++k) w[k] *= inv_sqrt_p;
}

#ifdef TQVEC_X86
// AVX2: the stages h = 1, 2, 4 inside each group of 8 floats, in registers (a swap of pairs,
// of pairs of pairs, of halves, then u + v in the first and u - v in the second element of
// each pair - the same two float operations per pair as the portable loop, so the same bits),
// then h >= 8 across 8-float vectors. At d = 784 (p = 512) the scalar h < 8 stages were most
// of a one-query rotation.
__attribute__((target("avx2"))) void fwht_row_avx2(float* __restrict w, int64_t p,
                                                   float inv_sqrt_p) {
  if (p < 8) {
    fwht_row_portable(w, p, inv_sqrt_p);
    return;
  }
  for (int64_t i = 0; i < p; i += 8) {
    __m256 v = _mm256_loadu_ps(w + i);
    __m256 sw = _mm256_permute_ps(v, 0xB1);  // h = 1: (1, 0, 3, 2, ...)
    v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xAA);
    sw = _mm256_permute_ps(v, 0x4E);  // h = 2: (2, 3, 0, 1, ...)
    v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xCC);
    sw = _mm256_permute2f128_ps(v, v, 0x01);  // h = 4: the two halves swapped
    v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xF0);
    _mm256_storeu_ps(w + i, v);
  }
  for (int64_t h = 8; h < p; h <<= 1)
    for (int64_t i = 0; i < p; i += 2 * h)
      for (int64_t j = i; j < i + h; j += 8) {
        const __m256 u = _mm256_loadu_ps(w + j), v = _mm256_loadu_ps(w + j + h);
        _mm256_storeu_ps(w + j, _mm256_add_ps(u, v));
        _mm256_storeu_ps(w + j + h, _mm256_sub_ps(u, v));
      }
  const __m256 s = _mm256_set1_ps(inv_sqrt_p);
  for (int64_t k = 0; k < p; k += 8)
    _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), s));
}
#endif

void fwht_row(float* w, int64_t p, float inv_sqrt_p) {
#ifdef TQVEC_X86
  if (simd_avx2()) return fwht_row_avx2(w, p, inv_sqrt_p);
#endif
  fwht_row_portable(w, p, inv_sqrt_p);
}

void rotate_row(const float* x, int64_t d, const int64_t* perms, const float* signs, int rounds,
                int64_t p, bool inverse, float inv_sqrt_p, float* z, float* w, float* out) {
  std::memcpy(z, x, sizeof(float) * static_cast<size_t>(d));
  for (int rr = 0; rr < rounds; ++rr) {
    const int r = inverse ? rounds - 1 - rr : rr;
    const int64_t* perm = perms + static_cast<int64_t>(r) * d;
    const float* sg = signs + static_cast<int64_t>(r) * d;
    if (!inverse) {
      for (int64_t j = 0; j < d; ++j) w[j] = z[perm[j]] * sg[j];
      fwht_row(w, p, inv_sqrt_p);
      if (p < d) fwht_row(w + (d - p), p, inv_sqrt_p);
    } else {
      if (p < d) fwht_row(z + (d - p), p, inv_sqrt_p);
      fwht_row(z, p, inv_sqrt_p);
      for (int64_t j = 0; j < d; ++j) w[perm[j]] = z[j] * sg[j];
    }
    std::swap(z, w);
  }
  std::memcpy(out, z, sizeof(float) * static_cast<size_t>(d));
}

}  // namespace

void hadamard_rotate(const float* x, int64_t n, int64_t d, const int64_t* perms,
                     const float* signs, int rounds, int64_t p, bool inverse, float* out,
                     int nthreads) {
  // The same float32 constant as the reference: float(1/sqrt(p)) rounded once from double.
  const float inv_sqrt_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)));
  const int64_t groups = (n + kLanes - 1) / kLanes;
  // Threads split whole groups of kLanes rows (never one group between two threads).
  // Threads pay from ~64k butterflies each (a thread's start costs about that much work:
  // docs/kernel-costs.md); a fixed 512 rows per thread left a 1,000-query batch on one.
  const int64_t min_groups =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kLanes * d * rounds));
  parallel_rows(groups, nthreads, [&](int64_t glo, int64_t ghi) {
    // a partial group alone (one query) needs one row's buffers, not kLanes (zero-filling
    // 2 x 25 KB cost as much as rotating a 784-vector)
    const int64_t lanes = ghi - glo == 1 && n - glo * kLanes < kLanes ? 1 : kLanes;
    std::vector<float> zb(static_cast<size_t>(d * lanes)), wb(static_cast<size_t>(d * lanes));
    float* z = zb.data();
    float* w = wb.data();
    for (int64_t g = glo; g < ghi; ++g) {
      const int64_t r0 = g * kLanes;
      const int rows = static_cast<int>(std::min<int64_t>(kLanes, n - r0));
      if (rows < kLanes) {  // a partial group (one query, the tail): row by row, no idle lanes
        for (int l = 0; l < rows; ++l)
          rotate_row(x + (r0 + l) * d, d, perms, signs, rounds, p, inverse, inv_sqrt_p, z, w,
                     out + (r0 + l) * d);
        continue;
      }
      for (int l = 0; l < rows; ++l) {
        const float* xi = x + (r0 + l) * d;
        for (int64_t j = 0; j < d; ++j) z[j * kLanes + l] = xi[j];
      }
      for (int rr = 0; rr < rounds; ++rr) {
        const int r = inverse ? rounds - 1 - rr : rr;
        const int64_t* perm = perms + static_cast<int64_t>(r) * d;
        const float* sg = signs + static_cast<int64_t>(r) * d;
        if (!inverse) {
          permute_sign_lanes(z, perm, sg, d, w);
          fwht_lanes(w, p, inv_sqrt_p);
          if (p < d) fwht_lanes(w + (d - p) * kLanes, p, inv_sqrt_p);
        } else {
          if (p < d) fwht_lanes(z + (d - p) * kLanes, p, inv_sqrt_p);
          fwht_lanes(z, p, inv_sqrt_p);
          sign_unpermute_lanes(z, perm, sg, d, w);
        }
        std::swap(z, w);
      }
      for (int l = 0; l < rows; ++l) {
        float* oi = out + (r0 + l) * d;
        for (int64_t j = 0; j < d; ++j) oi[j] = z[j * kLanes + l];
      }
    }
  }, min_groups);
}

}  // namespace tqvec
