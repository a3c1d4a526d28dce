// Exact re-scoring of a candidate list against float32 vectors (the meaning is rescore_rows_ref
// in tqvec/ops/ref.py): the refinement step of Refine(Flat). Layouts:
//   q     (nq, d)   float32  queries
//   x     (n, d)    float32  the stored exact vectors
//   rows  (nq, kk)  int64    candidate rows of each query, -1 = none
//   dot, sqn (nq, kk) float32 <q_i, x_j> and ||x_j||^2 (0 for -1)
// Gathering the candidates into a (nq, kk, d) tensor first (what torch indexing does) writes and
// re-reads kk * d * 4 bytes per query; here each candidate row is read once, both sums from the
// same load. Eight independent partial sums per row vectorize without reassociation flags.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

__attribute__((target_clones("avx2", "default")))
void dot_and_sqnorm(const float* __restrict q, const float* __restrict x, int64_t d, float* dot,
                    float* sqn) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8)
    for (int l = 0; l < 8; ++l) {
      a[l] += q[j + l] * x[j + l];
      b[l] += x[j + l] * x[j + l];
    }
  float sa = 0.f, sb = 0.f;
  for (; j < d; ++j) {
    sa += q[j] * x[j];
    sb += x[j] * x[j];
  }
  for (int l = 0; l < 8; ++l) {
    sa += a[l];
    sb += b[l];
  }
  *dot = sa;
  *sqn = sb;
}

}  // namespace

void rescore_rows(const float* q, int64_t nq, int64_t d, const float* x, const int64_t* rows,
                  int64_t kk, float* dot, float* sqn, int nthreads) {
  auto work = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t r = 0; r < kk; ++r) {
        const int64_t j = rows[i * kk + r];
        if (j < 0) {
          dot[i * kk + r] = 0.f;
          sqn[i * kk + r] = 0.f;
        } else {
          dot_and_sqnorm(q + i * d, x + j * d, d, dot + i * kk + r, sqn + i * kk + r);
        }
      }
  };
  // a thread start (~20 us) pays from ~64k multiply-adds of work per thread
  const int64_t t = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(nthreads), nq, nq * kk * d / 65536}));
  const int64_t chunk = (nq + t - 1) / t;
  run_workers(t, [&](int64_t w) { work(std::min(nq, w * chunk), std::min(nq, (w + 1) * chunk)); });
}

}  // namespace tqvec
