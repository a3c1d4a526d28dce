// The top-k output shared by the scan kernels: hits (score, row) -> best-first (vals, idx) of
// length k, ties broken by the lower row (as torch.topk on the reference's score matrix), padded
// with -inf / -1 when fewer than k hits exist.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace tqvec {

using Hit = std::pair<float, int64_t>;  // (score, row position)

inline void write_topk(std::vector<Hit>& hits, int64_t k, float* vals, int64_t* idx) {
  const int64_t m = std::min<int64_t>(k, static_cast<int64_t>(hits.size()));
  std::partial_sort(hits.begin(), hits.begin() + m, hits.end(), [](const Hit& a, const Hit& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (int64_t r = 0; r < k; ++r) {
    vals[r] = r < m ? hits[static_cast<size_t>(r)].first
                    : -std::numeric_limits<float>::infinity();
    idx[r] = r < m ? hits[static_cast<size_t>(r)].second : -1;
  }
}

}  // namespace tqvec
