// The top-k output shared by the scan kernels: hits (score, row) -> best-first (vals, idx) of
// length k, ties broken by the lower row (as torch.topk on the reference's score matrix), padded
// with -inf / -1 when fewer than k hits exist.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace tqvec {

using Hit = std::pair<float, int64_t>;  // (score, row position)

// v into heap, a min-heap of the r largest values so far (heap.front() is the r-th once it
// holds r): pushed while it holds fewer, else in place of the front where v exceeds it.
inline void keep_largest(std::vector<float>& heap, int64_t r, float v) {
  const auto greater = std::greater<float>();
  if (static_cast<int64_t>(heap.size()) < r) {
    heap.push_back(v);
    std::push_heap(heap.begin(), heap.end(), greater);
  } else if (v > heap.front()) {
    std::pop_heap(heap.begin(), heap.end(), greater);
    heap.back() = v;
    std::push_heap(heap.begin(), heap.end(), greater);
  }
}

// The k-th largest of a[0 .. n) (1 <= k <= n, no NaN), with a rearranged so that a[0 .. k) holds
// the k largest: what std::nth_element(a, a + k - 1, a + n, std::greater<float>()) gives, by a
// quickselect whose partitions are branch-free (three-way, through tmp). On the random scores
// of a shortlist nth_element's comparisons mispredict half the time, which made it a tenth
// of a batched IVF search.
inline float select_kth_largest(float* a, int64_t n, int64_t k, std::vector<float>& tmp) {
  int64_t lo = 0, hi = n;
  k -= 1;  // 0-based rank within [lo, hi)
  if (static_cast<int64_t>(tmp.size()) < n) tmp.resize(static_cast<size_t>(n));
  while (hi - lo > 16) {
    const int64_t m = hi - lo;
    float x0 = a[lo], x1 = a[lo + m / 2], x2 = a[hi - 1];  // pivot: median of three
    if (x0 > x1) std::swap(x0, x1);
    const float p = std::max(x0, std::min(x1, x2));
    float* t = tmp.data();
    int64_t g = 0, l = m;  // t[0, g): > p, t[l, m): < p; g <= l - 1 before each element
    for (int64_t i = 0; i < m; ++i) {
      const float x = a[lo + i];
      t[g] = x;
      t[l - 1] = x;
      g += x > p;
      l -= x < p;
    }
    for (int64_t i = 0; i < g; ++i) a[lo + i] = t[i];
    for (int64_t i = g; i < l; ++i) a[lo + i] = p;
    for (int64_t i = l; i < m; ++i) a[lo + i] = t[i];
    if (k < g) {
      hi = lo + g;
    } else if (k < l) {
      return p;
    } else {
      k -= l;
      lo += l;
    }
  }
  std::sort(a + lo, a + hi, std::greater<float>());
  return a[lo + k];
}

inline void write_topk(std::vector<Hit>& hits, int64_t k, float* vals, int64_t* idx) {
  const auto better = [](const Hit& a, const Hit& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t n = static_cast<int64_t>(hits.size()), m = std::min<int64_t>(k, n);
  bool no_nan = true;  // the select and std::sort need a strict weak order
  for (int64_t i = 0; no_nan && i < n; ++i) no_nan = hits[i].first == hits[i].first;
  if (!no_nan) {
    std::partial_sort(hits.begin(), hits.begin() + m, hits.end(), better);
  } else {
    if (n > m) {
      // Only the hits that reach the m-th best score (the branch-free select) are sorted:
      // partial_sort's heap (O(n log m) mispredicted comparisons) weighed on a batched IVF
      // scan at k = 40 over ~100 hits, and its partial sort of all n a heap sort. Ties at the
      // m-th score all pass and sort by row: the same m hits, in the same order.
      thread_local std::vector<float> sc, tmp;
      sc.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) sc[i] = hits[i].first;
      const float th = select_kth_largest(sc.data(), n, m, tmp);
      int64_t w = 0;
      for (int64_t i = 0; i < n; ++i) {
        hits[w] = hits[i];
        w += hits[i].first >= th;
      }
      hits.resize(static_cast<size_t>(w));
    }
    std::sort(hits.begin(), hits.end(), better);
  }
  for (int64_t r = 0; r < k; ++r) {
    vals[r] = r < m ? hits[static_cast<size_t>(r)].first
                    : -std::numeric_limits<float>::infinity();
    idx[r] = r < m ? hits[static_cast<size_t>(r)].second : -1;
  }
}

}  // namespace tqvec
