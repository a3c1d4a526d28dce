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
    if (static_cast<int64_t>(best.size()) < k) {
      best.push_back(v);
      std::push_heap(best.begin(), best.end(), std::greater<float>());
    } else if (v > best.front()) {
      std::pop_heap(best.begin(), best.end(), std::greater<float>());
      best.back() = v;
      std::push_heap(best.begin(), best.end(), std::greater<float>());
    }
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

// The rows i with s[i] >= t and s[i] > -inf, in order, of s[0, n) (AVX2: 8 at a time, a
// compare and a mask; the portable loop the tail and all of it elsewhere).
#ifdef TQVEC_X86
__attribute__((target("avx2"))) inline int64_t rows_at_least_avx2(const float* s, int64_t n,
                                                                  float t,
                                                                  std::vector<int64_t>& rows) {
  const __m256 vt = _mm256_set1_ps(t), ninf = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    int bits = _mm256_movemask_ps(
        _mm256_and_ps(_mm256_cmp_ps(v, vt, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ)));
    while (bits) {
      rows.push_back(i + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  return i;
}
#endif

inline void rows_at_least(const float* s, int64_t n, float t, std::vector<int64_t>& rows) {
  rows.clear();
  int64_t i = 0;
#ifdef TQVEC_X86
  if (simd_avx2()) i = rows_at_least_avx2(s, n, t, rows);
#endif
  for (; i < n; ++i)
    if (s[i] >= t && s[i] > -std::numeric_limits<float>::infinity()) rows.push_back(i);
}

// The rows whose score s[i] (n of them) reaches the k-th largest finite score (ties included;
// all finite rows where fewer than k): what a shortlist of k approximate scores keeps
// (final_threshold, then ub >= th). A threshold from a strided sample first (its r-th largest,
// r chosen for ~2k survivors), one pass keeping the rows at or above it, and the exact select
// among those; a sample that leaves fewer than k survivors is retried at a 4x larger rank.
inline void rows_reaching_kth(const float* s, int64_t n, int64_t k, std::vector<int64_t>& rows) {
  constexpr int64_t kStride = 64;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<float> sample, vals, tmp;
  sample.clear();
  for (int64_t i = 0; i < n; i += kStride)
    if (s[i] > ninf) sample.push_back(s[i]);  // finite (no NaN: a NaN fails the test too)
  const int64_t m = static_cast<int64_t>(sample.size());
  int64_t r = std::min(m, 2 * ((k + kStride - 1) / kStride) + 8);
  for (;;) {
    const float t = r >= 1 && r < m ? select_kth_largest(sample.data(), m, r, tmp) : ninf;
    rows_at_least(s, n, t, rows);
    if (static_cast<int64_t>(rows.size()) >= k || t == ninf) break;
    r = 4 * r;  // too few survivors: a lower threshold (the sample was reordered, not changed)
  }
  const int64_t c = static_cast<int64_t>(rows.size());
  if (c <= k) return;
  vals.resize(static_cast<size_t>(c));
  for (int64_t i = 0; i < c; ++i) vals[i] = s[rows[i]];
  const float th = select_kth_largest(vals.data(), c, k, tmp);
  int64_t w = 0;
  for (int64_t i = 0; i < c; ++i) {
    rows[w] = rows[i];
    w += s[rows[i]] >= th;
  }
  rows.resize(static_cast<size_t>(w));
}

}  // namespace tqvec::fastscan
