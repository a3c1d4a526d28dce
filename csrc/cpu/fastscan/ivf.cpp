// ivf_fast_scan: the fast scan over inverted lists (layouts: ../fastscan.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>
#include <atomic>

#include "../kernels.h"
#include "../parallel.h"
#include "scan_blocks.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec {

using namespace fastscan;  // NOLINT: the kernel's own internals

void ivf_fast_scan(const float* qr, int64_t nq, const CodeTable& t, const int64_t* list_blocks,
                   int64_t nlist, const Probes& pr, bool approx, const TopKOut& out,
                   int nthreads) {
  const int64_t d = t.d, n = t.n, nprobe = pr.nprobe, k = out.k;
  // Many queries: each thread takes a contiguous share of them, lists and all (splitting the
  // lists between threads would give every query a shortlist per thread, each filling its own
  // k from part of the rows).
  if (split_queries(nq, nthreads, 64, [&](int64_t lo, int64_t hi) {
        ivf_fast_scan(qr + lo * d, hi - lo, t, list_blocks, nlist,
                      {pr.lists + lo * nprobe, pr.offsets + lo * nprobe, nprobe}, approx,
                      {k, out.vals_of(lo), out.idx_of(lo)}, 1);
      }))
    return;
  const uint8_t* blocked = t.codes;
  const int b = t.b;
  const float *centroids = t.centroids, *mult = t.mult, *add = t.add;
  const int64_t* probes = pr.lists;
  const float* offsets = pr.offsets;
  float* const out_vals = out.vals;
  int64_t* const out_idx = out.idx;
  const int64_t rb = fs_row_bytes(d, b);
  // Queries are handled in batches whose tables (5 bytes * 16 * 2 rb each) stay within 64 MB;
  // within a batch the probes are inverted so that each probed list is read once for all the
  // queries that probe it, several tables per pass, as faiss's IVF fast-scan does; big batches
  // fill those groups (a list is probed by nq * nprobe / nlist queries).
  const int64_t batch = std::clamp<int64_t>((64 << 20) / (160 * rb), 256, 8192);
  for (int64_t q0 = 0; q0 < nq; q0 += batch) {
    const int64_t q1 = std::min(nq, q0 + batch), m = q1 - q0;
    std::vector<Lut> luts(static_cast<size_t>(m));
    // (query in batch, offset) per list; lists ordered by the best rank at which any query
    // probes them, so each shortlist meets its nearest lists first and its threshold rises early.
    std::vector<std::vector<std::pair<int64_t, float>>> by_list(static_cast<size_t>(nlist));
    std::vector<int64_t> rank(static_cast<size_t>(nlist), nprobe);
    int64_t work_blocks = 0;
    for (int64_t qi = 0; qi < m; ++qi)
      for (int64_t r = 0; r < nprobe; ++r) {
        const int64_t l = probes[(q0 + qi) * nprobe + r];
        if (l < 0 || l >= nlist) continue;
        by_list[static_cast<size_t>(l)].emplace_back(qi, offsets[(q0 + qi) * nprobe + r]);
        rank[static_cast<size_t>(l)] = std::min(rank[static_cast<size_t>(l)], r);
        work_blocks += list_blocks[l + 1] - list_blocks[l];
      }
    std::vector<int64_t> order;
    for (int64_t l = 0; l < nlist; ++l)
      if (!by_list[static_cast<size_t>(l)].empty() && list_blocks[l + 1] > list_blocks[l])
        order.push_back(l);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
      return rank[static_cast<size_t>(a)] < rank[static_cast<size_t>(c)];
    });
    const int64_t t = std::max<int64_t>(
        1, std::min<int64_t>({static_cast<int64_t>(std::max(1, nthreads)),
                              static_cast<int64_t>(order.size()),
                              std::max<int64_t>(1, (work_blocks + m) / 32)}));
    // Shortlists per (thread, query): no locks; finish() merges a query's parts.
    std::vector<std::vector<Shortlist>> sls(static_cast<size_t>(t));
    for (auto& v : sls) v.assign(static_cast<size_t>(m), Shortlist(k));
    // Few queries keep the float tables (a candidate's re-score is then M lookups); thousands
    // drop them (160 rb bytes each, written and read once). approx (a first stage before a
    // refinement): no float tables and a zero error bound, so the shortlists hold the rows of
    // the best table scores and nothing is re-scored exactly (the 1-bit tables' bounds are
    // loose: the exact re-score would cost more than the scan).
    const bool keep_float = m <= 64 && !approx;
    std::atomic<int64_t> next_lut{0}, next_list{0};
    auto build = [&] {
      for (int64_t qi; (qi = next_lut.fetch_add(1)) < m;) {
        Lut& L = luts[static_cast<size_t>(qi)];
        L = build_lut(qr + (q0 + qi) * d, d, b, centroids, rb, keep_float);
        if (approx) L.err = 0.0f;
        if (uses_dot(b, !approx)) add_dot(L, rb);
      }
    };
    auto scan = [&](int64_t w) {
      auto& mine = sls[static_cast<size_t>(w)];
      std::vector<const Lut*> lp;
      std::vector<Shortlist*> sp;
      std::vector<float> off;
      for (int64_t o; (o = next_list.fetch_add(1)) < static_cast<int64_t>(order.size());) {
        const int64_t l = order[static_cast<size_t>(o)];
        const auto& qs = by_list[static_cast<size_t>(l)];
        const int64_t j0 = list_blocks[l], j1 = list_blocks[l + 1];
        const int qpp = queries_per_pass(b, !approx);
        const size_t grouped = qpp > 0 ? qs.size() / qpp * qpp : 0;
        lp.clear(), sp.clear(), off.clear();
        for (size_t g = 0; g < grouped; ++g) {
          lp.push_back(&luts[static_cast<size_t>(qs[g].first)]);
          sp.push_back(&mine[static_cast<size_t>(qs[g].first)]);
          off.push_back(qs[g].second);
        }
        scan_query_groups(qpp, lp.data(), sp.data(), static_cast<int64_t>(grouped), blocked, rb,
                          n, j0, j1, mult, add, off.data());
        for (size_t g = grouped; g < qs.size(); ++g)
          scan_blocks(luts[static_cast<size_t>(qs[g].first)], blocked, rb, n, j0, j1, mult, add,
                      qs[g].second, mine[static_cast<size_t>(qs[g].first)]);
      }
    };
    auto finish_all = [&](int64_t w) {
      for (int64_t qi = w; qi < m; qi += t) {
        std::vector<Shortlist*> parts;
        for (auto& v : sls) parts.push_back(&v[static_cast<size_t>(qi)]);
        if (approx)
          finish_approx(parts, k, out_vals + (q0 + qi) * k, out_idx + (q0 + qi) * k);
        else
          finish(luts[static_cast<size_t>(qi)], blocked, rb, mult, add, parts, k,
                 out_vals + (q0 + qi) * k, out_idx + (q0 + qi) * k);
      }
    };
    run_workers(t, [&](int64_t) { build(); });
    run_workers(t, scan);
    run_workers(t, finish_all);
  }
}

}  // namespace tqvec
