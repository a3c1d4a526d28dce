// fast_scan_two_stage: a first pass over the sign plane (or a prefix of 1-bit codes), then the
// full codes of its best rows (layouts: ../fastscan.h).
#include "../arch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "../kernels.h"
#include "../parallel.h"
#include "block_sums.h"
#include "schedule.h"
#include "shortlist.h"
#include "tables.h"
#include "terms.h"

namespace tqvec {
namespace fastscan {
namespace {

// The approximate scores (8-bit table sums, as consider() forms them) of the rows of blocks
// [j0, j1), written to s[row - 32 j0]: a two-stage scan's first pass at a few queries, which
// keeps the k1 best of them by rows_reaching_kth (a shortlist of k1 rows would compact itself
// every k1 admissions; a store per 8 rows and a pass over them in L1 cost less).
#ifdef TQVEC_X86
__attribute__((target("avx2"))) void approx_scores_avx2(const Lut& L, const uint8_t* blocked,
                                                        int64_t rb, int64_t n, int64_t j0,
                                                        int64_t j1, const float* mult,
                                                        const float* add, float* s) {
  alignas(32) uint32_t tot[4 * kRows];
  const uint8_t* q8[1] = {L.q8.data()};
  const __m256 vdelta = _mm256_set1_ps(L.delta), vbias = _mm256_set1_ps(L.bias);
  for (int64_t j = j0; j < j1;) {
    const int nb = j + 4 <= j1 ? 4 : 1;
    if (!L.q8v.empty())
      block_sums_vnni_any(L, blocked + j * rb * kRows, rb, nb, tot);
    else if (nb == 4)
      block_sums_avx2<4, 1>(blocked + j * rb * kRows, rb, q8, tot);
    else
      block_sums<1, 1>(L.b, blocked + j * rb * kRows, rb, q8, tot);
    for (int u = 0; u < nb; ++u, ++j) {
      const int64_t base = j * kRows, rows = std::min(kRows, n - base);
      const uint32_t* bt = tot + u * kRows;
      float* out = s + (j - j0) * kRows;
      if (rows < kRows) {  // last, partial block: consider()'s float operations
        for (int64_t t = 0; t < rows; ++t)
          out[t] =
              mult[base + t] * (L.delta * static_cast<float>(bt[t]) + L.bias) + add[base + t];
        continue;
      }
      for (int g = 0; g < kRows; g += 8) {
        const __m256 sum =
            _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bt + g)));
        const __m256 v =
            _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(mult + base + g),
                                        _mm256_add_ps(_mm256_mul_ps(vdelta, sum), vbias)),
                          _mm256_loadu_ps(add + base + g));
        _mm256_storeu_ps(out + g, v);
      }
    }
  }
}
#endif

// approx_scores_avx2's values through block_sums_one (NEON and portable builds).
void approx_scores_any(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                       int64_t j1, const float* mult, const float* add, float* s) {
#ifdef TQVEC_X86
  if (simd_avx2()) return approx_scores_avx2(L, blocked, rb, n, j0, j1, mult, add, s);
#endif
  alignas(32) uint32_t tot[kRows];
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_one(L, blocked + j * rb * kRows, rb, tot);
    const int64_t base = j * kRows, rows = std::min(kRows, n - base);
    for (int64_t t = 0; t < rows; ++t)
      s[(j - j0) * kRows + t] =
          mult[base + t] * (L.delta * static_cast<float>(tot[t]) + L.bias) + add[base + t];
  }
}

// A row of a bounded first pass: its upper bound and estimate (the pass's score).
struct BoundedRow {
  float ub, est;
  int64_t row;
};

// One worker's part of a bounded first pass: the k best lower bounds among its rows (a min-heap)
// and the rows whose upper bound reached the k-th of them when they were scored.
struct BoundedPart {
  std::vector<float> best;
  std::vector<BoundedRow> cand;
};

// The bounds lb, ub of rows [0, rows) with first-pass scores s (multipliers m, offsets a):
// s -+ e, e = |m| (wq sin + err), sin the row's angle to the query as s gives it
// (cos = cs (s - a) / m; sin^2 >= sin2); a row with an offset of -inf (removed or filtered out)
// gets -inf for both, so it never enters.
TQVEC_CLONES_AVX2
void row_bounds(const float* s, const float* m, const float* a, int64_t rows, float cs, float wq,
                float sin2, float err, float* lb, float* ub) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < rows; ++t) {
    const float cos = cs * (s[t] - a[t]) / (m[t] != 0.0f ? m[t] : 1.0f);
    const float e = std::fabs(m[t]) * (wq * std::sqrt(std::max(sin2, 1.0f - cos * cos)) + err);
    const bool live = a[t] > ninf;
    lb[t] = live ? s[t] - e : ninf;
    ub[t] = live ? s[t] + e : ninf;
  }
}

// Rows of blocks [j0, j1) into part with SignBound's bounds: each row's first-pass score s (the
// tables' approximate one) estimates its full score within
// e = |mult| (sigma ||q|| sin / gain + the tables' error), sin the row's angle to the query as
// that score gives it (cos = gain (s - add) / (mult cnorm ||q||); sin >= min_sin).
void bounded_rows(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n, int64_t j0,
                  int64_t j1, const float* mult, const float* add, const SignBound& bound,
                  float qn, int64_t k, BoundedPart& part) {
  constexpr int64_t kChunk = 16;  // blocks per pass: 2 KB of scores
  alignas(32) float s[kChunk * kRows], lb[kChunk * kRows], ub[kChunk * kRows];
  const float wq = bound.sigma * qn / bound.gain;
  const float cs = qn > 0.0f ? bound.gain / (bound.cnorm * qn) : 0.0f;
  const float ninf = -std::numeric_limits<float>::infinity();
  auto& best = part.best;
  auto& cand = part.cand;
  size_t kept = 0;  // candidates after the last compaction
  for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
    const int64_t c1 = std::min(j1, c0 + kChunk);
    approx_scores_any(L, blocked, rb, n, c0, c1, mult, add, s);
    const int64_t base = c0 * kRows, rows = std::min(n, c1 * kRows) - base;
    row_bounds(s, mult + base, add + base, rows, cs, wq, bound.min_sin * bound.min_sin, L.err,
               lb, ub);
    for (int64_t g = 0; g < rows; g += 8) {
      const int64_t ge = std::min(rows, g + 8);
      float top = ninf;
      for (int64_t t = g; t < ge; ++t) top = std::max(top, ub[t]);
      // 8 rows none of which reaches the threshold (lb <= ub) are passed over
      if (top == ninf || (static_cast<int64_t>(best.size()) == k && top < best.front())) continue;
      for (int64_t t = g; t < ge; ++t) {
        const float th = static_cast<int64_t>(best.size()) < k ? ninf : best.front();
        if (lb[t] > th) keep_largest(best, k, lb[t]);
        if (ub[t] >= th && ub[t] > ninf) cand.push_back({ub[t], s[t], base + t});
      }
    }
    // the threshold rises as rows come: the candidates below it dropped whenever they doubled
    if (static_cast<int64_t>(best.size()) == k && cand.size() > 2 * kept + 256) {
      const float th = best.front();
      cand.erase(std::remove_if(cand.begin(), cand.end(),
                                [th](const BoundedRow& c) { return c.ub < th; }),
                 cand.end());
      kept = cand.size();
    }
  }
}

}  // namespace
}  // namespace fastscan

using namespace fastscan;  // NOLINT: the kernel's own internals

void fast_scan_two_stage(const float* qr, int64_t nq, const CodeTable& signs_t,
                         const CodeTable& full_t, int64_t k1, const TopKOut& out, int nthreads,
                         const SignBound& bound) {
  const int64_t d = full_t.d, d1 = signs_t.d, n = full_t.n, k = out.k;
  const uint8_t* signs = signs_t.codes;
  const float *c1 = signs_t.centroids, *mult1 = signs_t.mult, *add1 = signs_t.add;
  // the exact full-code scores of query qi's candidate rows -> its top k (the full codes as
  // the one term of rescore_terms)
  const ScanTerm full{qr, d, nullptr, full_t.b, full_t.centroids, full_t.mult, full_t.codes};
  auto second = [&](int64_t qi, const std::vector<int64_t>& rows) {
    rescore_terms(&full, 1, qi, rows, full_t.add, k, out.vals_of(qi), out.idx_of(qi));
  };
  const int64_t t = std::max(1, nthreads), nb = (n + kRows - 1) / kRows;
  if (bound.sigma > 0.0f) {
    // Every row whose error bound reaches the k-th best lower bound (SignBound), query by
    // query: threads over queries, or over one query's blocks where the queries are few
    const int64_t rb1 = fs_row_bytes(d1, 1);
    auto one_query = [&](int64_t qi, int64_t workers) {
      const float* q = qr + qi * d;
      double s2 = 0.0;
      for (int64_t j = 0; j < d1; ++j) s2 += static_cast<double>(q[j]) * q[j];
      const float qn = static_cast<float>(std::sqrt(s2));
      const Lut L = build_lut(q, d1, 1, c1, rb1, false);
      const int64_t w = std::max<int64_t>(1, workers), per = (nb + w - 1) / w;
      std::vector<BoundedPart> parts(static_cast<size_t>(w));
      run_workers(w, [&](int64_t x) {
        bounded_rows(L, signs, rb1, n, std::min(nb, x * per), std::min(nb, (x + 1) * per),
                     mult1, add1, bound, qn, k, parts[static_cast<size_t>(x)]);
      });
      // the k-th best lower bound over every row: among the parts' k best
      std::vector<float> lbs;
      for (const auto& p : parts) lbs.insert(lbs.end(), p.best.begin(), p.best.end());
      std::vector<float> tmp;
      const float th = static_cast<int64_t>(lbs.size()) < k
                           ? -std::numeric_limits<float>::infinity()
                           : select_kth_largest(lbs.data(), static_cast<int64_t>(lbs.size()), k,
                                                tmp);
      // The k best estimates first, then the rest by bound, largest first (ties by the lower
      // row), re-scored until none can enter. The first k's k-th score (at most the final
      // k-th) drops every row whose bound is below it - the rows the stop would pass over -
      // before the sort.
      std::vector<BoundedRow> cand;
      for (const auto& p : parts)
        for (const auto& c : p.cand)
          if (c.ub >= th) cand.push_back(c);
      std::vector<int64_t> rows;
      std::vector<float> ubs;
      if (static_cast<int64_t>(cand.size()) > k) {
        std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(),
                         [](const BoundedRow& a, const BoundedRow& b) {
                           return a.est > b.est || (a.est == b.est && a.row < b.row);
                         });
        for (int64_t r = 0; r < k; ++r) rows.push_back(cand[static_cast<size_t>(r)].row);
        std::vector<float> sv(static_cast<size_t>(k));
        std::vector<int64_t> si(static_cast<size_t>(k));
        rescore_terms(&full, 1, qi, rows, full_t.add, k, sv.data(), si.data());
        const float kth = sv[static_cast<size_t>(k - 1)];
        ubs.assign(static_cast<size_t>(k), std::numeric_limits<float>::infinity());
        cand.erase(std::remove_if(cand.begin() + k, cand.end(),
                                  [kth](const BoundedRow& c) { return c.ub < kth; }),
                   cand.end());
      }
      const auto by_bound = [](const BoundedRow& a, const BoundedRow& b) {
        return a.ub > b.ub || (a.ub == b.ub && a.row < b.row);
      };
      std::sort(cand.begin() + static_cast<int64_t>(rows.size()), cand.end(), by_bound);
      for (size_t r = rows.size(); r < cand.size(); ++r) {
        rows.push_back(cand[r].row);
        ubs.push_back(cand[r].ub);
      }
      rescore_terms(&full, 1, qi, rows, full_t.add, k, out.vals_of(qi), out.idx_of(qi),
                    ubs.data());
    };
    if (threads_over_queries(nq, nb, t))
      for_each_query(nq, t, [&](int64_t qi) { one_query(qi, 1); });
    else
      for (int64_t qi = 0; qi < nq; ++qi) one_query(qi, std::min<int64_t>(t, nb / kMinBlocksPerSplit));
    return;
  }
  if ((simd_avx2() || simd_neon()) && nq < 3 * t && nb >= kMinBlocksPerSplit) {
    // A few queries: the first pass's scores a chunk at a time (threads over blocks), the
    // rows of the k1 best kept as they come (rows_reaching_kth)
    const int64_t rb1 = fs_row_bytes(d1, 1);
    std::vector<int64_t> rows;
    for (int64_t qi = 0; qi < nq; ++qi) {
      Lut L = build_lut(qr + qi * d, d1, 1, c1, rb1, false);
      rows_reaching_kth(n, k1, std::min<int64_t>(t, nb / kMinBlocksPerSplit),
                        [&](int64_t j0, int64_t j1, float* s) {
                          approx_scores_any(L, signs, rb1, n, j0, j1, mult1, add1, s);
                        },
                        rows);
      second(qi, rows);
    }
    return;
  }
  fast_scan_impl(qr, nq, d1, d, signs, n, 1, c1, mult1, add1, k1, true, nthreads,
                 [&](int64_t qi, const Lut&, std::vector<Shortlist*> parts) {
                   // the rows of the k1 best approximate sign scores (ties included), then
                   // their exact full-code scores
                   const float th = final_threshold(parts, k1);
                   std::vector<int64_t> rows;
                   for (auto* sl : parts)
                     for (const auto& c : sl->cand)
                       if (c.ub >= th) rows.push_back(c.row);
                   second(qi, rows);
                 });
}

}  // namespace tqvec
