// graph_search: best-first search of a proximity graph whose nodes carry their neighbours'
// codes (kernels.h has the layout). An expansion scores all of a node's neighbours with one
// fast-scan pass over their 32-row blocks - the code bytes, multipliers and offsets it reads
// are contiguous and prefetched while the previous node is scored - instead of one random
// read per neighbour (the layout SymphonyQG showed; the graph itself is any, here faiss's HNSW).
// Scores are the fast scan's 8-bit table estimates; with exact vectors each expanded node is
// also scored exactly and the results are the best expanded nodes (SymphonyQG's implicit
// re-ranking: no second pass of random reads).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "fastscan/scan_blocks.h"
#include "fastscan/tables.h"
#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"

namespace tqvec {
namespace {

using fastscan::kRows;
using fastscan::Lut;

// The search pool: the ef best estimates seen, sorted best first, each marked once expanded
// (and once its record was prefetched); `next` is the first unexpanded one. An insertion is a
// binary search and a move of the worse entries (NSG's and DiskANN's search list): best-first
// search with a bounded pool needs no separate candidate heap, since a candidate that falls
// out of the pool would never be expanded.
struct Pool {
  std::vector<float> s;
  std::vector<int32_t> row;
  std::vector<uint8_t> done, fetched;
  int64_t size = 0, cap = 0, next = 0;
  void reset(int64_t ef) {
    cap = ef;
    size = next = 0;
    s.resize(static_cast<size_t>(ef + 1));
    row.resize(static_cast<size_t>(ef + 1));
    done.resize(static_cast<size_t>(ef + 1));
    fetched.resize(static_cast<size_t>(ef + 1));
  }
  // the score an entry must beat to enter
  float worst() const {
    return size < cap ? -std::numeric_limits<float>::infinity() : s[static_cast<size_t>(size - 1)];
  }
  void insert(float v, int32_t r) {
    // first position whose score is below v (ties: after the equal ones, earlier first)
    int64_t lo = 0, hi = size;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (s[static_cast<size_t>(mid)] >= v) lo = mid + 1; else hi = mid;
    }
    const int64_t m = std::min(size, cap - 1) - lo;  // entries moved down (the last may drop)
    if (m > 0) {
      std::memmove(&s[static_cast<size_t>(lo + 1)], &s[static_cast<size_t>(lo)], m * 4);
      std::memmove(&row[static_cast<size_t>(lo + 1)], &row[static_cast<size_t>(lo)], m * 4);
      std::memmove(&done[static_cast<size_t>(lo + 1)], &done[static_cast<size_t>(lo)], m);
      std::memmove(&fetched[static_cast<size_t>(lo + 1)], &fetched[static_cast<size_t>(lo)], m);
    }
    s[static_cast<size_t>(lo)] = v;
    row[static_cast<size_t>(lo)] = r;
    done[static_cast<size_t>(lo)] = 0;
    fetched[static_cast<size_t>(lo)] = 0;
    size = std::min(size + 1, cap);
    next = std::min(next, lo);
  }
  // the best unexpanded entry (marked expanded), or -1 when none is left
  int64_t pop() {
    while (next < size && done[static_cast<size_t>(next)]) ++next;
    if (next >= size) return -1;
    done[static_cast<size_t>(next)] = 1;
    return next++;
  }
  // Calls fetch(row) for the best unexpanded entry - again where fetched before, which is
  // faster (perhaps a prefetch dropped on a full miss queue is made again) - and for
  // each of the next depth - 1 not fetched before.
  template <class Fetch>
  void fetch_next(int depth, Fetch&& fetch) {
    for (int64_t i = next, j = 0; i < size && j < depth; ++i) {
      if (done[static_cast<size_t>(i)]) continue;
      if (j++ == 0 || !fetched[static_cast<size_t>(i)]) fetch(row[static_cast<size_t>(i)]);
      fetched[static_cast<size_t>(i)] = 1;
    }
  }
};

struct Scored {
  float s;
  int32_t row;
};

// Per-thread state reused across queries: visit stamps (a query's are those equal to its
// stamp, so nothing is cleared per query), the pool and the exact results.
struct Scratch {
  std::vector<uint32_t> seen;
  uint32_t stamp = 0;
  Pool pool;
  std::vector<Scored> res;
  std::vector<float> s;  // one expansion's neighbour scores
  void start(int64_t n, int64_t ef) {
    if (static_cast<int64_t>(seen.size()) != n || ++stamp == 0) {
      seen.assign(static_cast<size_t>(n), 0);
      stamp = 1;
    }
    pool.reset(ef);
    res.clear();
  }
  bool visit(int32_t r) {
    if (seen[static_cast<size_t>(r)] == stamp) return false;
    seen[static_cast<size_t>(r)] = stamp;
    return true;
  }
};

const auto worst_first = [](const Scored& a, const Scored& b) { return a.s > b.s; };  // min-heap

// A node's record (kilobytes) into L2, in the order its expansion reads it: the codes first,
// the exact vector (scored last) after them. Into L1 the lines would queue on its few miss
// buffers and stall the expansion that requests them.
inline void prefetch_node(const GraphArgs& g, const GraphLayer& L, int64_t node, int64_t rb) {
  const int64_t R = L.degree;
  prefetch_span<Cache::L2>(L.codes + node * R * rb, R * rb);
  prefetch_span<Cache::L2>(L.mult + node * R, R * 4);
  prefetch_span<Cache::L2>(L.add + node * R, R * 4);
  prefetch_span<Cache::L2>(L.nbr + node * R, R * 4);
  if (g.exact_x != nullptr) prefetch_span<Cache::L2>(g.exact_x + node * g.d, g.d * 4);
}

// The estimated scores of node `node`'s R neighbours (-inf for padding) into s.
inline void score_neighbours(const GraphLayer& L, int64_t node, const Lut& lut, int64_t rb,
                             float* s) {
  alignas(64) uint32_t tot[kRows];
  const int64_t R = L.degree;
  const uint8_t* blk = L.codes + node * R * rb;
  const float* m = L.mult + node * R;
  const float* a = L.add + node * R;
  for (int64_t j = 0; j < R / kRows; ++j) {
    fastscan::block_sums_one(lut, blk + j * rb * kRows, rb, tot);
    for (int64_t t = 0; t < kRows; ++t) {
      const int64_t e = j * kRows + t;
      s[e] = m[e] * (lut.delta * static_cast<float>(tot[t]) + lut.bias) + a[e];
    }
  }
}

inline int64_t node_of(const GraphLayer& L, int32_t row) {
  return L.slot == nullptr ? row : L.slot[row];
}

// The best k of v (best first, ties: the lower row) into row qi of out, padded.
void write_best(std::vector<Scored>& v, const TopKOut& out, int64_t qi) {
  std::sort(v.begin(), v.end(), [](const Scored& a, const Scored& b) {
    return a.s > b.s || (a.s == b.s && a.row < b.row);
  });
  float* vals = out.vals_of(qi);
  int64_t* idx = out.idx_of(qi);
  for (int64_t r = 0; r < out.k; ++r) {
    const bool has = r < static_cast<int64_t>(v.size());
    vals[r] = has ? v[static_cast<size_t>(r)].s : -std::numeric_limits<float>::infinity();
    idx[r] = has ? v[static_cast<size_t>(r)].row : -1;
  }
}

// Kept out of the worker loop and out of interprocedural constant propagation: inlined, or
// cloned with the thread_local scratch as a constant, every use of it went through
// __tls_get_addr, once per neighbour.
#if defined(__clang__)
__attribute__((noinline))
#else
__attribute__((noipa))
#endif
void search_one(const GraphArgs& g, const float* qr, const float* q,
                                          float qsq, int64_t ef, const TopKOut& out, int64_t qi,
                                          Scratch& sc) {
  const int64_t rb = fs_row_bytes(g.d, g.b);
  const Lut lut = fastscan::build_lut(qr, g.d, g.b, g.centroids, rb, false);
  sc.start(g.n, ef);
  std::vector<float>& s = sc.s;
  for (int l = 0; l < g.nlayers; ++l)
    s.resize(std::max(s.size(), static_cast<size_t>(g.layers[l].degree)));
  // The upper layers, then the base layer once: greedy moves to the best-scored neighbour
  // while it improves, from the entry's own estimate.
  int32_t cur = static_cast<int32_t>(g.entry);
  float cur_s;
  {
    alignas(64) uint32_t tot[kRows];
    fastscan::block_sums_one(lut, g.entry_codes, rb, tot);
    cur_s = g.entry_mult[0] * (lut.delta * static_cast<float>(tot[0]) + lut.bias) + g.entry_add[0];
  }
  for (int l = g.nlayers - 1; l >= 0; --l) {
    const GraphLayer& L = g.layers[l];
    for (;;) {
      const int64_t node = node_of(L, cur);
      score_neighbours(L, node, lut, rb, s.data());
      int64_t best = -1;
      for (int64_t e = 0; e < L.degree; ++e)
        if (L.nbr[node * L.degree + e] >= 0 && s[e] > cur_s && (best < 0 || s[e] > s[best]))
          best = e;
      if (best < 0) break;
      cur = L.nbr[node * L.degree + best];
      cur_s = s[best];
      if (l == 0) break;  // the base layer's search starts here
    }
  }
  // The base layer: best-first by the estimates with a pool of the ef best seen; with exact
  // vectors each expanded node's exact similarity enters the results as it is expanded (its
  // vector was prefetched with its record), and no re-rank pass follows. A filter leaves the
  // traversal as it is and admits only allowed rows to the results.
  const GraphLayer& B = g.layers[0];
  const int64_t R = B.degree;
  const bool exact = g.exact_x != nullptr;
  auto allowed = [&](int32_t r) { return g.allowed == nullptr || g.allowed[r] != 0; };
  Pool& pool = sc.pool;
  auto score_exactly = [&](int32_t r) {
    float dot, sqn;
    dot_and_sqnorm(q, g.exact_x + static_cast<int64_t>(r) * g.d, g.d, &dot, &sqn);
    sc.res.push_back({rescore_similarity(dot, sqn, qsq, g.exact_metric), r});
    std::push_heap(sc.res.begin(), sc.res.end(), worst_first);
    if (static_cast<int64_t>(sc.res.size()) > out.k) {
      std::pop_heap(sc.res.begin(), sc.res.end(), worst_first);
      sc.res.pop_back();
    }
  };
  sc.visit(cur);
  pool.insert(cur_s, cur);
  for (int64_t at; (at = pool.pop()) >= 0;) {
    const int32_t c = pool.row[static_cast<size_t>(at)];
    score_neighbours(B, c, lut, rb, s.data());
    const int32_t* nb = B.nbr + static_cast<int64_t>(c) * R;
    for (int64_t e = 0; e < R; ++e) {
      const float v = s[e];
      if (!(v > pool.worst())) continue;  // below the pool (or padding, -inf): not a candidate
      const int32_t r = nb[e];
      if (!sc.visit(r)) continue;
      pool.insert(v, r);
    }
    // The node expanded next is known now (often a neighbour just found), and the one after
    // it likely: their records and vectors are requested before this node's exact score.
    pool.fetch_next(2, [&](int32_t r) { prefetch_node(g, B, r, rb); });
    if (exact && allowed(c)) score_exactly(c);
  }
  if (!exact)  // the pool's allowed rows, by their estimates
    for (int64_t i = 0; i < pool.size; ++i)
      if (allowed(pool.row[static_cast<size_t>(i)]))
        sc.res.push_back({pool.s[static_cast<size_t>(i)], pool.row[static_cast<size_t>(i)]});
  write_best(sc.res, out, qi);
}

}  // namespace

void graph_search(const GraphArgs& g, const float* qr, const float* q, const float* qsq,
                  int64_t nq, int64_t ef, const TopKOut& out, int nthreads) {
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, nq));
  run_workers(t, [&](int64_t w) {
    thread_local Scratch sc;
    for (int64_t qi = w; qi < nq; qi += t)
      search_one(g, qr + qi * g.d, q == nullptr ? nullptr : q + qi * g.d,
                 qsq == nullptr ? 0.0f : qsq[qi], ef, out, qi, sc);
  });
}

}  // namespace tqvec
