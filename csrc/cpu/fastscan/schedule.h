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

// A long approximate shortlist (a two-stage scan's first pass keeps k1 = 100 or more rows)
// admits ~k (1 + ln(n / k)) rows from a threshold that starts at -inf and lags behind the
// compactions - ~1,000 for k = 100 of 60,000 rows, each an append and a share of a selection.
// Started instead from a threshold sampled on a few runs of blocks (sample_rank), it admits
// ~2-3 k rows; one that came out too high (ordered rows) is caught by short_of_k and the query
// scanned again.
constexpr int64_t kSampledMinK = 32;  // shorter shortlists admit few rows anyway

// scan(shortlists, c0, c1) scans blocks [c0, c1) of every query into its shortlist.
template <class Scan>
void start_from_sample(int64_t nb, int64_t n, int64_t k, std::vector<Shortlist>& sls,
                       Scan&& scan) {
  const int64_t run = nb / kSampleBlocks;
  const int64_t r = sample_rank(k, kSampleRuns * run * kRows, n);
  std::vector<Shortlist> probe(sls.size(), Shortlist(r));
  std::vector<Shortlist*> pp = pointers(probe);
  for (int64_t i = 0; i < kSampleRuns; ++i) {
    const int64_t c0 = i * nb / kSampleRuns;
    scan(pp.data(), c0, c0 + run);
  }
  for (size_t g = 0; g < sls.size(); ++g) sls[g].start_at(final_threshold({pp[g]}, r));
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
    // 3-bit scan were slower than 12)
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
        auto scan = [&](Shortlist* const* to, int64_t c0, int64_t c1) {
          scan_query_groups(qpp, lp.data(), to, static_cast<int64_t>(grouped), blocked, rb, n,
                            c0, c1, mult, add, zero.data());
          for (size_t g = grouped; g < ng; ++g)
            scan_blocks(luts[g], blocked, rb, n, c0, c1, mult, add, 0.f, *to[g]);
        };
        const bool sampled = approx && k_scan >= kSampledMinK && nb >= kSampleBlocks;
        if (sampled) start_from_sample(nb, n, k_scan, sls, scan);
        for (int64_t c0 = 0; c0 < nb; c0 += chunk_blocks)
          scan(sp.data(), c0, std::min(nb, c0 + chunk_blocks));
        for (size_t g = 0; sampled && g < ng; ++g)
          if (sls[g].short_of_k()) {  // the sample's threshold was too high: scan again from -inf
            sls[g] = Shortlist(k_scan);
            scan_blocks(luts[g], blocked, rb, n, 0, nb, mult, add, 0.f, sls[g]);
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
