// The fast scan's candidates: a query's shortlist of rows that can still reach its top k, and
// the selections over them (layouts: ../fastscan.h).
#pragma once
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
#include "../topk.h"
#include "tables.h"

namespace tqvec::fastscan {

// Per query: the lower bounds of the rows admitted so far (at least the k best of them), the
// admission threshold (the k-th best lower bound at the last compaction: it only lags behind,
// which admits a few extra rows, never loses one), and the admitted rows with their upper
// bounds. Admission is two appends; every 2k admissions a compaction (select_kth_largest over
// 3k bounds) raises the threshold and drops the rows it excludes - O(1) per admission (a heap
// of k bounds costs O(log k)). Compacting at 3k rather than 2k selects over 1.5 bounds per
// admission instead of 2, for a threshold that lags a little more.
struct Shortlist {
  int64_t k;
  float th = -std::numeric_limits<float>::infinity();
  std::vector<float> lbs, tmp;
  struct Cand {
    // built in place by emplace_back (a braced temporary stalls on store forwarding)
    Cand(float u, int64_t r, float o) : ub(u), row(r), off(o) {}
    float ub;
    int64_t row;
    float off;  // the row's range offset (ivf_fast_scan), added again at the exact re-score
  };
  std::vector<Cand> cand;
  explicit Shortlist(int64_t kk) : k(kk) { lbs.reserve(static_cast<size_t>(3 * kk + 1)); }
  float threshold() const { return th; }
  // Starts the threshold at t (only ever raised) for a shortlist of scores without error
  // bounds (lb = ub): every row scoring at least t is admitted, so the result is the same as
  // from -inf wherever at least k rows reach t - short_of_k() says where they did not.
  void start_at(float t) { th = std::max(th, t); }
  bool short_of_k() const { return static_cast<int64_t>(lbs.size()) < k; }
  void admit(float lb, float ub, int64_t i, float off) {
    cand.emplace_back(ub, i, off);
    lbs.push_back(lb);
    if (static_cast<int64_t>(lbs.size()) >= 3 * k) compact();
  }
  void compact() {
    th = std::max(th, select_kth_largest(lbs.data(), static_cast<int64_t>(lbs.size()), k, tmp));
    lbs.resize(static_cast<size_t>(k));
    // Branch-free filter (every row copied, the write position advanced by the test): about
    // half of the rows go either way, which a branch mispredicts.
    const float t = th;
    size_t w = 0;
    for (size_t r = 0; r < cand.size(); ++r) {
      cand[w] = cand[r];
      w += !(cand[r].ub < t);  // as remove_if(ub < t): a NaN bound stays
    }
    cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(w), cand.end());
  }
};

// Approximate score and bound of row i from its table sum; admits it if it can reach the top k.
// `off` is added to every score of the rows being scanned (0 for a flat scan; the query's
// offset of the inverted list in ivf_fast_scan).
// Sc: a Lut (table sums, < 2^31) or a SumScale (the dot form's signed sums, as uint32 bits).
template <class Sc>
inline void consider(const Sc& L, uint32_t tot, int64_t i, const float* mult, const float* add,
                     float off, Shortlist& sl) {
  const float a = add[i];
  if (!(a > -std::numeric_limits<float>::infinity())) return;
  const float s =
      mult[i] * (L.delta * static_cast<float>(static_cast<int32_t>(tot)) + L.bias) + a + off;
  const float e = std::fabs(mult[i]) * L.err;
  if (s + e >= sl.threshold()) sl.admit(s - e, s + e, i, off);
}

// The k-th best lower bound over a query's shortlists: rows whose upper bound is below it
// cannot be in the top k.
inline float final_threshold(const std::vector<Shortlist*>& parts, int64_t k) {
  std::vector<float> lbs;
  for (auto* s : parts) lbs.insert(lbs.end(), s->lbs.begin(), s->lbs.end());
  if (static_cast<int64_t>(lbs.size()) < k) return -std::numeric_limits<float>::infinity();
  std::vector<float> tmp;
  return select_kth_largest(lbs.data(), static_cast<int64_t>(lbs.size()), k, tmp);
}

// The admitted rows whose upper bound reaches the final threshold, highest bound first, are
// re-scored by score(row) until k exact scores exceed every remaining bound (a row's exact
// score never exceeds its bound, so the rest cannot enter; short IVF lists keep bounds loose next
// to the score gaps). Writes the top k.
template <class Score>
void rescore_best_first(const std::vector<Shortlist*>& parts, int64_t k, Score&& score,
                        float* vals, int64_t* idx) {
  const float th = final_threshold(parts, k);
  std::vector<const Shortlist::Cand*> order;
  for (auto* s : parts)
    for (const auto& c : s->cand)
      if (c.ub >= th) order.push_back(&c);
  std::sort(order.begin(), order.end(), [](const Shortlist::Cand* a, const Shortlist::Cand* b) {
    return a->ub > b->ub || (a->ub == b->ub && a->row < b->row);
  });
  std::vector<Hit> hits;
  std::vector<float> best;  // min-heap of the k best exact scores so far
  best.reserve(static_cast<size_t>(k));
  for (const auto* c : order) {
    // strictly greater: a row whose bound equals the k-th score could still tie it
    if (static_cast<int64_t>(best.size()) == k && best.front() > c->ub) break;
    const float v = score(*c);
    hits.emplace_back(v, c->row);
    if (!(v > -std::numeric_limits<float>::infinity())) continue;
    keep_largest(best, k, v);
  }
  write_topk(hits, k, vals, idx);
}

// Approximate results (tables with a zero error bound: lb = ub = the table score): the top k
// admitted rows by that score, written as it is.
inline void finish_approx(const std::vector<Shortlist*>& parts, int64_t k, float* vals, int64_t* idx) {
  const float th = final_threshold(parts, k);
  std::vector<Hit> hits;
  for (auto* s : parts)
    for (const auto& c : s->cand)
      if (c.ub >= th) hits.emplace_back(c.ub, c.row);
  write_topk(hits, k, vals, idx);
}

// A threshold sampled before a scan: the r-th best score over kSampleRuns runs of
// nb / kSampleBlocks blocks spread over the rows, r a little above the k m / n of the k best
// expected among the sample's m rows (by three standard deviations), so that at least k rows
// reach it unless the rows are ordered - which the caller checks, scanning again from -inf.
constexpr int64_t kSampleRuns = 8, kSampleBlocks = 16 * kSampleRuns;

inline int64_t sample_rank(int64_t k, int64_t m, int64_t n) {
  const double mu = static_cast<double>(k) * static_cast<double>(m) / static_cast<double>(n);
  return std::min<int64_t>(k, static_cast<int64_t>(std::ceil(mu + 3.0 * std::sqrt(mu))) + 1);
}

// Appends rows base + i of s[0, m) with s[i] >= t and s[i] > -inf, and their scores, in order:
// one compare with max(t, -FLT_MAX) (a NaN fails it too) - AVX-512 16 rows at a time, AVX2 8,
// the portable loop the tail and all of it elsewhere.
#ifdef TQVEC_X86
__attribute__((target("avx2,avx512f"))) inline int64_t append_at_least_avx512(
    const float* s, int64_t m, float t, int64_t base, std::vector<int64_t>& rows,
    std::vector<float>& vals) {
  const __m512 vt = _mm512_set1_ps(t);
  int64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    for (unsigned bits = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), vt, _CMP_GE_OQ); bits;
         bits &= bits - 1) {
      const int u = __builtin_ctz(bits);
      rows.push_back(base + i + u);
      vals.push_back(s[i + u]);
    }
  }
  return i;
}

__attribute__((target("avx2"))) inline int64_t append_at_least_avx2(
    const float* s, int64_t m, float t, int64_t base, std::vector<int64_t>& rows,
    std::vector<float>& vals) {
  const __m256 vt = _mm256_set1_ps(t);
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), vt, _CMP_GE_OQ));
    for (; bits; bits &= bits - 1) {
      const int u = __builtin_ctz(bits);
      rows.push_back(base + i + u);
      vals.push_back(s[i + u]);
    }
  }
  return i;
}
#endif

inline void append_at_least(const float* s, int64_t m, float t, int64_t base,
                            std::vector<int64_t>& rows, std::vector<float>& vals) {
  t = std::max(t, std::numeric_limits<float>::lowest());
  int64_t i = 0;
#ifdef TQVEC_X86
  if (simd_vbmi() || simd_avx512())
    i = append_at_least_avx512(s, m, t, base, rows, vals);
  else if (simd_avx2())
    i = append_at_least_avx2(s, m, t, base, rows, vals);
#endif
  for (; i < m; ++i)
    if (s[i] >= t) {
      rows.push_back(base + i);
      vals.push_back(s[i]);
    }
}

// The r-th largest of the finite values of s[0, m) (-inf where fewer than r), by a min-heap of
// the r best so far: one compare per value for the small r of a sampled threshold.
inline float rth_largest_finite(const float* s, int64_t m, int64_t r, std::vector<float>& heap) {
  heap.clear();
  for (int64_t i = 0; i < m; ++i) {
    const float v = s[i];
    if (!(v > -std::numeric_limits<float>::infinity())) continue;  // -inf, NaN
    keep_largest(heap, r, v);
  }
  return static_cast<int64_t>(heap.size()) < r ? -std::numeric_limits<float>::infinity()
                                               : heap.front();
}

// The rows of [0, n) whose score reaches the k-th largest finite score (ties included; every
// finite row where fewer than k) - what a shortlist of k approximate scores keeps
// (final_threshold, then ub >= th), in no particular order - without storing the n scores:
// scores(j0, j1, out) writes those of blocks [j0, j1) (rows 32 j0 ..) to out. The sample runs
// (sample_rank) are scored first and give the threshold; the other blocks follow, `workers`
// threads over them, each chunk's scores in L1, and only the rows reaching it are kept (~2-3 k).
// Where fewer than k rows reach it, every block is scored again from -inf. The exact selection
// among the kept rows follows.
template <class Scores>
void rows_reaching_kth(int64_t n, int64_t k, int64_t workers, Scores&& scores,
                       std::vector<int64_t>& rows) {
  constexpr int64_t kChunk = 16;  // blocks per call: 2 KB of scores
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t nb = (n + kRows - 1) / kRows;
  auto rows_in = [&](int64_t c0, int64_t c1) { return std::min(n, c1 * kRows) - c0 * kRows; };
  thread_local std::vector<float> buf_tls, vals_tls, tmp_tls;
  std::vector<float>& buf = buf_tls;  // references: a thread_local costs a call per use
  std::vector<float>& vals = vals_tls;
  std::vector<float>& tmp = tmp_tls;
  rows.clear(), vals.clear();
  std::vector<int64_t> runs;  // the sample runs' first blocks; each is nb / kSampleBlocks long
  const int64_t run = nb / kSampleBlocks;
  float t = ninf;
  if (run > 0) {
    buf.resize(static_cast<size_t>(kSampleRuns * run * kRows));
    int64_t m = 0;
    for (int64_t i = 0; i < kSampleRuns; ++i) {
      runs.push_back(i * nb / kSampleRuns);
      scores(runs.back(), runs.back() + run, buf.data() + m);
      m += rows_in(runs.back(), runs.back() + run);
    }
    t = rth_largest_finite(buf.data(), m, sample_rank(k, m, n), tmp);
    for (int64_t i = 0, at = 0; i < kSampleRuns; ++i) {
      const int64_t c0 = runs[i], mi = rows_in(c0, c0 + run);
      append_at_least(buf.data() + at, mi, t, c0 * kRows, rows, vals);
      at += mi;
    }
  }
  const int64_t w = std::max<int64_t>(1, std::min(workers, nb));
  std::vector<std::vector<int64_t>> wrows(static_cast<size_t>(w));
  std::vector<std::vector<float>> wvals(static_cast<size_t>(w));
  for (;;) {
    const int64_t per = (nb + w - 1) / w;
    run_workers(w, [&](int64_t x) {
      std::vector<float> out(static_cast<size_t>(kChunk * kRows));
      std::vector<int64_t>& rx = wrows[static_cast<size_t>(x)];
      std::vector<float>& vx = wvals[static_cast<size_t>(x)];
      rx.clear(), vx.clear();
      rx.reserve(static_cast<size_t>(4 * k)), vx.reserve(static_cast<size_t>(4 * k));
      const int64_t j1 = std::min(nb, (x + 1) * per);
      size_t r = 0;  // the next sample run that may lie ahead
      for (int64_t c0 = std::min(nb, x * per); c0 < j1;) {
        while (r < runs.size() && runs[r] + run <= c0) ++r;
        if (r < runs.size() && runs[r] <= c0) {  // inside a sample run: scored already
          c0 = runs[r] + run;
          continue;
        }
        const int64_t c1 = std::min({j1, c0 + kChunk, r < runs.size() ? runs[r] : nb});
        scores(c0, c1, out.data());
        append_at_least(out.data(), rows_in(c0, c1), t, c0 * kRows, rx, vx);
        c0 = c1;
      }
    });
    size_t got = rows.size();
    for (const auto& rx : wrows) got += rx.size();
    if (static_cast<int64_t>(got) >= k || t == ninf) break;
    t = ninf;  // too few rows reach the sample's threshold (ordered rows): every block again
    runs.clear(), rows.clear(), vals.clear();
  }
  for (int64_t x = 0; x < w; ++x) {
    rows.insert(rows.end(), wrows[x].begin(), wrows[x].end());
    vals.insert(vals.end(), wvals[x].begin(), wvals[x].end());
  }
  const int64_t c = static_cast<int64_t>(rows.size());
  if (c <= k) return;
  tmp.assign(vals.begin(), vals.end());
  const float th = select_kth_largest(tmp.data(), c, k, buf);
  int64_t kept = 0;
  for (int64_t i = 0; i < c; ++i) {
    rows[kept] = rows[i];
    kept += vals[i] >= th;
  }
  rows.resize(static_cast<size_t>(kept));
}

}  // namespace tqvec::fastscan
