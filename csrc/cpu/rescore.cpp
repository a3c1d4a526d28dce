// Exact re-ranking of a candidate list against float32 vectors (the meaning is rescore_topk_ref
// in tqvec/ops/ref.py): the refinement step of Refine(Flat). Layouts:
//   q     (nq, d)   float32  queries
//   x     (n, d)    float32  the stored exact vectors
//   rows  (nq, kk)  int64    candidate rows of each query, -1 = none
//   vals, idx (nq, k) the best k candidates by the metric's similarity, best first
// Gathering the candidates into a (nq, kk, d) tensor first (what torch indexing does) writes and
// re-reads kk * d * 4 bytes per query; here each candidate row is read once, both sums from the
// same load, and the next candidate's row is prefetched while this one is summed. The metric and
// the top-k run here too: the same dozen steps in numpy cost several times the sums.
#include "arch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"
#include "topk.h"

namespace tqvec {
namespace {

// Lane l of each accumulator sums the terms j = l (mod 8), then the tail and the lanes are added
// in order: the same float operations in the AVX2 and the portable version. (GCC left the
// portable loop scalar even in an AVX2 clone.)
#ifdef TQVEC_X86
__attribute__((target("avx2"))) void dot_and_sqnorm_avx2(const float* __restrict q,
                                                         const float* __restrict x, int64_t d,
                                                         float* dot, float* sqn) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    const __m256 xv = _mm256_loadu_ps(x + j);
    a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(q + j), xv));
    b = _mm256_add_ps(b, _mm256_mul_ps(xv, xv));
  }
  alignas(32) float la[8], lb[8];
  _mm256_store_ps(la, a);
  _mm256_store_ps(lb, b);
  float sa = 0.f, sb = 0.f;
  for (; j < d; ++j) {
    sa += q[j] * x[j];
    sb += x[j] * x[j];
  }
  for (int l = 0; l < 8; ++l) {
    sa += la[l];
    sb += lb[l];
  }
  *dot = sa;
  *sqn = sb;
}
#endif

void dot_and_sqnorm_portable(const float* __restrict q, const float* __restrict x, int64_t d,
                             float* dot, float* sqn) {
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

// <q, x> alone with four independent 8-lane accumulators (lane l of accumulator u sums the
// terms j = 8u + l (mod 32); the 8-wide blocks past the last 32 go to accumulator 0, the tail
// to a scalar; then the tail and the lanes, u-major, in order): one accumulator is an add
// latency per 8 terms, which made a probe of 256 x 784 centroids latency-bound.
#ifdef TQVEC_X86
__attribute__((target("avx2"))) float dot_avx2(const float* __restrict q,
                                               const float* __restrict x, int64_t d) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  int64_t j = 0;
  for (; j + 32 <= d; j += 32)
    for (int u = 0; u < 4; ++u)
      a[u] = _mm256_add_ps(a[u], _mm256_mul_ps(_mm256_loadu_ps(q + j + 8 * u),
                                               _mm256_loadu_ps(x + j + 8 * u)));
  for (; j + 8 <= d; j += 8)
    a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(x + j)));
  alignas(32) float la[4][8];
  for (int u = 0; u < 4; ++u) _mm256_store_ps(la[u], a[u]);
  float s = 0.f;
  for (; j < d; ++j) s += q[j] * x[j];
  for (int u = 0; u < 4; ++u)
    for (int l = 0; l < 8; ++l) s += la[u][l];
  return s;
}
#endif

// The probe's product <q, c_l>: one 8-lane accumulator per (query, list) pair, updated by a
// fused multiply-add per 8-wide block (lane l sums the terms j = l (mod 8)), then the scalar
// tail by fmaf, then the lanes in order — the float operations of dot1_portable. A tile of
// Q queries x C lists shares its loads and keeps Q * C independent chains in flight, so any tile
// shape (4 x 3 for batches, 1 x 8 for a query alone, 1 x 1 for the leftovers) gives a pair the
// same bits: a query probed alone or within a batch gets the same lists. 4 x 3 with FMA is the
// widest tile whose 12 accumulators and 3 rows fit the 16 registers (with a separate multiply
// and add the product needs one more and the query loads fold into the multiplies); its
// throughput against other tiles is in docs/search.md.
// out[a * ldo + c] = <q_a, x_c>.
#ifdef TQVEC_X86
template <int Q, int C>
__attribute__((target("avx2,fma"))) void dot_tile_avx2(const float* q, const float* x, int64_t d,
                                                       float* out, int64_t ldo) {
  __m256 acc[Q][C];
  for (int a = 0; a < Q; ++a)
    for (int c = 0; c < C; ++c) acc[a][c] = _mm256_setzero_ps();
  const int64_t end8 = d / 8 * 8;
  for (int64_t j = 0; j < end8; j += 8) {
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x + c * d + j);
    for (int a = 0; a < Q; ++a) {
      const __m256 qv = _mm256_loadu_ps(q + a * d + j);
      for (int c = 0; c < C; ++c) acc[a][c] = _mm256_fmadd_ps(qv, xv[c], acc[a][c]);
    }
  }
  alignas(32) float la[8];
  for (int a = 0; a < Q; ++a)
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(la, acc[a][c]);
      float s = 0.f;
      for (int64_t j = end8; j < d; ++j) s = std::fmaf(q[a * d + j], x[c * d + j], s);
      for (int l = 0; l < 8; ++l) s += la[l];
      out[a * ldo + c] = s;
    }
}
#endif

// dot_tile_avx2's float operations without SIMD (std::fmaf: one rounding per multiply-add, as
// the fused instruction; a library call where the CPU lacks FMA, which only the portable build
// of a CPU without AVX2 meets).
float dot1_portable(const float* __restrict q, const float* __restrict x, int64_t d) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8)
    for (int l = 0; l < 8; ++l) a[l] = std::fmaf(q[j + l], x[j + l], a[l]);
  float s = 0.f;
  for (; j < d; ++j) s = std::fmaf(q[j], x[j], s);
  for (int l = 0; l < 8; ++l) s += a[l];
  return s;
}

float dot_portable(const float* __restrict q, const float* __restrict x, int64_t d) {
  float a[4][8] = {};
  int64_t j = 0;
  for (; j + 32 <= d; j += 32)
    for (int u = 0; u < 4; ++u)
      for (int l = 0; l < 8; ++l) a[u][l] += q[j + 8 * u + l] * x[j + 8 * u + l];
  for (; j + 8 <= d; j += 8)
    for (int l = 0; l < 8; ++l) a[0][l] += q[j + l] * x[j + l];
  float s = 0.f;
  for (; j < d; ++j) s += q[j] * x[j];
  for (int u = 0; u < 4; ++u)
    for (int l = 0; l < 8; ++l) s += a[u][l];
  return s;
}

// The AVX2 versions where they run, else the portable ones (the same float operations).
using DotFn = float (*)(const float*, const float*, int64_t);
using DotSqnFn = void (*)(const float*, const float*, int64_t, float*, float*);
DotFn pick_dot() {
#ifdef TQVEC_X86
  if (simd_avx2()) return dot_avx2;
#endif
  return dot_portable;
}
DotSqnFn pick_dot_and_sqnorm() {
#ifdef TQVEC_X86
  if (simd_avx2()) return dot_and_sqnorm_avx2;
#endif
  return dot_and_sqnorm_portable;
}

}  // namespace

void dot_and_sqnorm(const float* q, const float* x, int64_t d, float* dot, float* sqn) {
  static const DotSqnFn fn = pick_dot_and_sqnorm();
  fn(q, x, d, dot, sqn);
}

void row_sqnorms(const float* x, int64_t n, int64_t d, float* out) {
  const DotFn dot = pick_dot();
  for (int64_t i = 0; i < n; ++i) out[i] = dot(x + i * d, x + i * d, d);
}

void row_dots(const float* x, int64_t n, int64_t d, const float* v, float* out) {
  const DotFn dot = pick_dot();
  for (int64_t i = 0; i < n; ++i) out[i] = dot(x + i * d, v, d);
}

namespace {

// Rows [0, R) of x W over 8 C columns: W points at the tile's first column, its rows ldw
// floats apart; out likewise, ldo apart. R x C accumulators of 8 columns, j in order, each
// step one fused multiply-add - the portable loop's std::fmaf, the same bits.
#ifdef TQVEC_X86
template <int R, int C>
__attribute__((target("avx2,fma"))) void project_tile(const float* x, int64_t d, const float* W,
                                                      int64_t ldw, float* out, int64_t ldo) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; ++j) {
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm256_loadu_ps(W + j * ldw + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * d + j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * ldo + 8 * c, acc[r][c]);
}

// Columns [c0, c1) of one row: tiles of 8 C columns, then 8, then single columns.
template <int C>
__attribute__((target("avx2,fma"))) void project_row(const float* x, int64_t d, const float* W,
                                                     int64_t m, int64_t c0, int64_t c1,
                                                     float* out) {
  for (; c0 + 8 * C <= c1; c0 += 8 * C) project_tile<1, C>(x, d, W + c0, m, out + c0, m);
  for (; c0 + 8 <= c1; c0 += 8) project_tile<1, 1>(x, d, W + c0, m, out + c0, m);
  for (; c0 < c1; ++c0) {
    float s = 0.0f;
    for (int64_t j = 0; j < d; ++j) s = std::fmaf(x[j], W[j * m + c0], s);
    out[c0] = s;
  }
}

// A few rows: each row by tiles of 64 columns (8 accumulators cover the FMA latency). More:
// W's panels of 16 columns copied once into contiguous, aligned d x 16 blocks (W comes from
// memory once per block of 64 rows, each panel from L2, one cache line per step), and each
// tile of 4 rows of a block runs through a panel before the next panel; the columns past the
// last whole panel row by row.
__attribute__((target("avx2,fma"))) void project_rows_avx2(const float* x, int64_t n, int64_t d,
                                                           const float* W, int64_t m,
                                                           float* out) {
  constexpr int64_t kBlock = 64, kPack = 8;  // rows per block; fewer than kPack: no packing
  if (n < kPack) {
    for (int64_t i = 0; i < n; ++i) project_row<8>(x + i * d, d, W, m, 0, m, out + i * m);
    return;
  }
  const int64_t panels = m / 16;
  std::vector<float> buf(static_cast<size_t>(panels * d * 16 + 16));
  float* packed = buf.data() + (16 - (reinterpret_cast<uintptr_t>(buf.data()) / 4) % 16) % 16;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t j = 0; j < d; ++j)
      std::copy_n(W + j * m + 16 * p, 16, packed + (p * d + j) * 16);
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    for (int64_t p = 0; p < panels; ++p) {
      const float* panel = packed + p * d * 16;
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4)
        project_tile<4, 2>(x + i * d, d, panel, 16, out + i * m + 16 * p, m);
      for (; i < i1; ++i) project_tile<1, 2>(x + i * d, d, panel, 16, out + i * m + 16 * p, m);
    }
    for (int64_t i = i0; i < i1; ++i)
      project_row<1>(x + i * d, d, W, m, 16 * panels, m, out + i * m);
  }
}
#endif

void project_rows_portable(const float* x, int64_t n, int64_t d, const float* W, int64_t m,
                           float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float* o = out + i * m;
    std::fill(o, o + m, 0.0f);
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[i * d + j];
      const float* w = W + j * m;
      for (int64_t c = 0; c < m; ++c) o[c] = std::fmaf(xj, w[c], o[c]);
    }
  }
}

void project_rows(const float* x, int64_t n, int64_t d, const float* W, int64_t m, float* out) {
#ifdef TQVEC_X86
  if (simd_fma()) return project_rows_avx2(x, n, d, W, m, out);
#endif
  project_rows_portable(x, n, d, W, m, out);
}

}  // namespace

void row_project(const float* x, int64_t n, int64_t d, const float* W, int64_t m, float* out,
                 int nthreads) {
  // many rows: a contiguous share per thread (each reads W once per block of 64 rows)
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, n / 16));
  const int64_t per = (n + t - 1) / t;
  run_workers(t, [&](int64_t w) {
    const int64_t lo = std::min(n, w * per), hi = std::min(n, lo + per);
    project_rows(x + lo * d, hi - lo, d, W, m, out + lo * m);
  });
}

constexpr int64_t kAhead = 4;  // candidate rows requested ahead of the one summed

void rescore_topk(const float* q, int64_t nq, int64_t d, const float* x, const int64_t* rows,
                  int64_t kk, int metric, int64_t k, float* vals, int64_t* idx, int nthreads) {
  const DotFn dot = pick_dot();
  const DotSqnFn dot_sqn = pick_dot_and_sqnorm();
  auto work = [&](int64_t lo, int64_t hi) {
    std::vector<Hit> hits;
    hits.reserve(static_cast<size_t>(kk));
    for (int64_t i = lo; i < hi; ++i) {
      const float* qi = q + i * d;
      const float qsq = metric == kRescoreL2 ? dot(qi, qi, d) : 0.f;
      hits.clear();
      // The candidates are scattered rows: without a prefetch each one starts with a cache
      // miss the hardware prefetcher cannot foresee. The row kAhead candidates on is requested
      // into L2 while this one is summed (the first kAhead as the query starts).
      const int64_t* cand = rows + i * kk;
      auto request = [&](int64_t r) {
        if (r < kk && cand[r] >= 0) prefetch_span<Cache::L2>(x + cand[r] * d, d * 4);
      };
      for (int64_t r = 0; r < kAhead; ++r) request(r);
      for (int64_t r = 0; r < kk; ++r) {
        const int64_t j = cand[r];
        request(r + kAhead);
        if (j < 0) continue;
        float dot, sqn;
        dot_sqn(qi, x + j * d, d, &dot, &sqn);
        // the float operations of the reference, in its order
        const float s = rescore_similarity(dot, sqn, qsq, metric);
        hits.emplace_back(s, r);  // ties: the earlier candidate (the first stage's order)
      }
      float* vi = vals + i * k;
      int64_t* ii = idx + i * k;
      write_topk(hits, k, vi, ii);
      for (int64_t r = 0; r < k; ++r)
        if (ii[r] >= 0) ii[r] = rows[i * kk + ii[r]];
    }
  };
  // a thread start pays from ~64k multiply-adds of work per thread (docs/kernel-costs.md)
  const int64_t t = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(nthreads), nq, nq * kk * d / 65536}));
  const int64_t chunk = (nq + t - 1) / t;
  run_workers(t, [&](int64_t w) { work(std::min(nq, w * chunk), std::min(nq, (w + 1) * chunk)); });
}

// The nprobe nearest lists of each query (ivf_probe_ref): score_l = <q, c_l>, or for l2
// 2 <q, c_l> - csq_l - ||q||^2 = -||q - c_l||^2; the best first (ties: lower l). One call for
// what took numpy steps costing more than the product itself at one query.
void ivf_probe(const float* q, int64_t nq, int64_t d, const float* c, int64_t nlist,
               const float* csq, bool l2, int64_t nprobe, int64_t* probes, float* offsets,
               int nthreads) {
#ifdef TQVEC_X86
  const bool fma = simd_fma();
#else
  const bool fma = false;
#endif
  const DotFn dot = pick_dot();
  constexpr int64_t kQ = 4, kC = 3;  // tile: kQ queries x kC lists
  [[maybe_unused]] constexpr int64_t kBlockC = 16 * kC;
  // queries [lo, hi): <q, c_l> for every list — 4 x 3 register tiles over blocks of kBlockC
  // lists that stay in L2 while all the queries pass (reading all the centroids from L3 per
  // tile of queries bound the tiles by L3 bandwidth); queries past
  // the last whole tile 8 lists at a time, leftover lists pair by pair (the same bits) — then
  // each query's scores and top nprobe
  auto work = [&](int64_t lo, int64_t hi) {
    const int64_t m = hi - lo;
    [[maybe_unused]] const int64_t m_tiled = fma ? m / kQ * kQ : 0;
    std::vector<float> ip(static_cast<size_t>(m * nlist));
    const float* qs = q + lo * d;
#ifdef TQVEC_X86
    if (fma) {
      const int64_t l3 = nlist / kC * kC, l8 = nlist / 8 * 8;
      for (int64_t b0 = 0; b0 < l3; b0 += kBlockC)
        for (int64_t a = 0; a < m_tiled; a += kQ)
          for (int64_t l = b0; l < std::min(l3, b0 + kBlockC); l += kC)
            dot_tile_avx2<kQ, kC>(qs + a * d, c + l * d, d, ip.data() + a * nlist + l, nlist);
      for (int64_t a = 0; a < m; ++a) {
        int64_t l = a < m_tiled ? l3 : 0;
        if (a >= m_tiled)
          for (; l < l8; l += 8)
            dot_tile_avx2<1, 8>(qs + a * d, c + l * d, d, ip.data() + a * nlist + l, nlist);
        for (; l < nlist; ++l)
          dot_tile_avx2<1, 1>(qs + a * d, c + l * d, d, ip.data() + a * nlist + l, nlist);
      }
    } else
#endif
    {
      for (int64_t a = 0; a < m; ++a)
        for (int64_t l = 0; l < nlist; ++l)
          ip[static_cast<size_t>(a * nlist + l)] = dot1_portable(qs + a * d, c + l * d, d);
    }
    std::vector<int64_t> order(static_cast<size_t>(nlist));
    for (int64_t a = 0; a < m; ++a) {
      const int64_t i = lo + a;
      const float* qi = q + i * d;
      float* score = ip.data() + a * nlist;
      const float qsq = l2 ? dot(qi, qi, d) : 0.f;
      for (int64_t l = 0; l < nlist; ++l) {
        if (l2) score[l] = 2.f * score[l] - csq[l] - qsq;
        order[static_cast<size_t>(l)] = l;
      }
      std::partial_sort(order.begin(), order.begin() + nprobe, order.end(),
                        [&](int64_t x, int64_t y) {
                          return score[x] > score[y] || (score[x] == score[y] && x < y);
                        });
      for (int64_t r = 0; r < nprobe; ++r) {
        probes[i * nprobe + r] = order[static_cast<size_t>(r)];
        offsets[i * nprobe + r] = score[order[static_cast<size_t>(r)]];
      }
    }
  };
  // a thread start pays from ~64k multiply-adds of work per thread; whole tiles each
  const int64_t t = std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(nthreads), (nq + kQ - 1) / kQ,
                            nq * nlist * d / 65536}));
  const int64_t chunk = (nq + t * kQ - 1) / (t * kQ) * kQ;
  run_workers(t, [&](int64_t w) { work(std::min(nq, w * chunk), std::min(nq, (w + 1) * chunk)); });
}

}  // namespace tqvec
