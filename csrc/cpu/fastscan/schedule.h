// The fast scans' thread schedules, in one place: every flat scan spreads its queries over the
// threads when there are enough of them (or too few blocks to split), else splits each query's
// blocks between the threads and merges their shortlists (``threads_over_queries``).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "../parallel.h"
#include "scan_blocks.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec::fastscan {

// Blocks per thread below which splitting one query's blocks does not pay.
constexpr int64_t kMinBlocksPerSplit = 64;

inline bool threads_over_queries(int64_t nq, int64_t nb, int64_t t) {
  return nq >= t || nb < kMinBlocksPerSplit;
}

// fn(qi) for every query, the queries dealt to min(t, nq) threads.
template <class F>
void for_each_query(int64_t nq, int64_t t, F&& fn) {
  const int64_t tq = std::min<int64_t>(t, nq);
  run_workers(tq, [&](int64_t w) {
    for (int64_t qi = w; qi < nq; qi += tq) fn(qi);
  });
}

// One query's blocks [0, nb) split between t threads, each scanned by scan(j0, j1, shortlist)
// into its own shortlist (finish() merges them).
template <class Scan>
std::vector<Shortlist> split_blocks(int64_t nb, int64_t t, int64_t k, Scan&& scan) {
  std::vector<Shortlist> sls(static_cast<size_t>(t), Shortlist(k));
  const int64_t chunk = (nb + t - 1) / t;
  run_workers(t, [&](int64_t w) {
    scan(std::min(nb, w * chunk), std::min(nb, (w + 1) * chunk), sls[static_cast<size_t>(w)]);
  });
  return sls;
}

inline std::vector<Shortlist*> pointers(std::vector<Shortlist>& sls) {
  std::vector<Shortlist*> parts;
  for (auto& s : sls) parts.push_back(&s);
  return parts;
}

// fast_scan's query/thread schedule with the shortlist length k_scan and a finisher
// fin(qi, lut, shortlists) that writes query qi's results. approx: tables without the exact
// float copy and with a zero error bound, so a shortlist holds the rows of the best
// approximate (quantized-table) scores, each with that score as its bound.
// qstride: floats between consecutive queries (>= d: a two-stage scan's first pass reads the
// first d coordinates of its queries).
template <class Finish>
void fast_scan_impl(const float* qr, int64_t nq, int64_t d, int64_t qstride,
                    const uint8_t* blocked, int64_t n, int b, const float* centroids,
                    const float* mult, const float* add, int64_t k_scan, bool approx,
                    int nthreads, Finish&& fin) {
  const int64_t rb = fs_row_bytes(d, b);
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t t = std::max(1, nthreads);
  auto lut = [&](int64_t qi) {
    Lut L = build_lut(qr + qi * qstride, d, b, centroids, rb, !approx);
    if (approx) L.err = 0.0f;
    if (uses_dot(b, !approx)) add_dot(L, rb);
    return L;
  };
  if (threads_over_queries(nq, nb, t)) {
    // Threads over queries. A chunk of blocks that fits in L2 is scanned for a group of queries
    // before moving on, so codes come from memory once per group, not once per query.
    // a multiple of the queries per pass (2, 3, 4: 12; the dot form's 8: 24 - 24 tables of the
    // 3-bit scan measured 3 % slower than 12)
    const int qpp = queries_per_pass(b, !approx);
    const int64_t group = qpp == 8 ? 24 : 12;
    const int64_t chunk_blocks = std::max<int64_t>(1, (192 * 1024) / (rb * kRows));
    const int64_t tq = std::min<int64_t>(t, nq);
    auto work = [&](int64_t w) {
      for (int64_t g0 = w * group; g0 < nq; g0 += tq * group) {
        const int64_t g1 = std::min(nq, g0 + group);
        std::vector<Lut> luts;
        std::vector<Shortlist> sls;
        for (int64_t qi = g0; qi < g1; ++qi) {
          luts.push_back(lut(qi));
          sls.emplace_back(k_scan);
        }
        const size_t ng = luts.size();
        std::vector<const Lut*> lp;
        std::vector<Shortlist*> sp;
        for (size_t g = 0; g < ng; ++g) lp.push_back(&luts[g]), sp.push_back(&sls[g]);
        const std::vector<float> zero(ng, 0.0f);
        const size_t grouped = qpp > 0 ? ng / qpp * qpp : 0;
        for (int64_t c0 = 0; c0 < nb; c0 += chunk_blocks) {
          const int64_t c1 = std::min(nb, c0 + chunk_blocks);
          scan_query_groups(qpp, lp.data(), sp.data(), static_cast<int64_t>(grouped), blocked,
                            rb, n, c0, c1, mult, add, zero.data());
          for (size_t g = grouped; g < ng; ++g)
            scan_blocks(luts[g], blocked, rb, n, c0, c1, mult, add, 0.f, sls[g]);
        }
        for (size_t g = 0; g < luts.size(); ++g)
          fin(g0 + static_cast<int64_t>(g), luts[g], std::vector<Shortlist*>{&sls[g]});
      }
    };
    run_workers(tq, work);
    return;
  }
  // Few queries: split the blocks between threads, merge their shortlists.
  for (int64_t qi = 0; qi < nq; ++qi) {
    const Lut L = lut(qi);
    std::vector<Shortlist> sls = split_blocks(nb, t, k_scan, [&](int64_t j0, int64_t j1,
                                                                 Shortlist& sl) {
      scan_blocks(L, blocked, rb, n, j0, j1, mult, add, 0.f, sl);
    });
    fin(qi, L, pointers(sls));
  }
}

}  // namespace tqvec::fastscan
