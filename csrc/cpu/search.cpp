// Whole searches in one call: the indexes' short paths for float32 numpy queries. The meaning
// of each is the composition of the kernels that the index's general path calls one by one —
// flat: hadamard_rotate, fast_scan (or fast_scan_two_stage); IVF: ivf_probe, hadamard_rotate,
// ivf_fast_scan, rescore_topk — with the same float operations for the steps between them, so
// the two paths agree bit for bit (tested). At one query the Python steps between the kernels
// cost as much as the kernels themselves (docs/search.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {

namespace {

// The nq rows of q (nq, d) scaled to unit norm into qc (the float operations of the index's
// _unit_rows), their squared norms left in qsq; returns qc's data.
const float* unit_rows(const float* q, int64_t nq, int64_t d, std::vector<float>& qsq,
                       std::vector<float>& qc) {
  const size_t nqs = static_cast<size_t>(nq);
  qsq.resize(nqs);
  row_sqnorms(q, nq, d, qsq.data());
  qc.resize(nqs * d);
  for (size_t i = 0; i < nqs; ++i) {
    const float s = std::max(std::sqrt(qsq[i]), 1e-30f);
    for (int64_t j = 0; j < d; ++j) qc[i * d + j] = q[i * d + j] / s;
  }
  return qc.data();
}

// The queries as an index scores them (the general path's float operations): unit rows
// (normalize), or q - center (the torch subtraction), in qc; <q, ip_center> per query in qoff
// (a centred inner product); ||q||^2 in qsq for l2 (in Python these steps weighed on a
// one-query search). Returns the queries to use.
const float* prepare_queries(const float* q, int64_t nq, int64_t d, bool normalize,
                             const float* center, const float* ip_center, bool l2,
                             std::vector<float>& qc, std::vector<float>& qsq,
                             std::vector<float>& qoff) {
  const size_t nqs = static_cast<size_t>(nq);
  if (normalize) {
    q = unit_rows(q, nq, d, qsq, qc);
  } else if (center != nullptr) {
    qc.resize(nqs * d);
    for (size_t i = 0; i < nqs; ++i)
      for (int64_t j = 0; j < d; ++j) qc[i * d + j] = q[i * d + j] - center[j];
    q = qc.data();
  }
  if (ip_center != nullptr) {
    qoff.resize(nqs);
    row_dots(q, nq, d, ip_center, qoff.data());
  }
  if (l2) {
    qsq.resize(nqs);
    row_sqnorms(q, nq, d, qsq.data());
  }
  return q;
}

// faiss's output from best-first (vals, idx) of m columns per query: L2 as distances, plus a
// per-query offset where one is given (a centred index's <q, mu>), ids, padding (+-FLT_MAX, -1)
// past m and wherever a value is not finite.
void write_results(const float* vals, const int64_t* idx, int64_t nq, int64_t m, int64_t k,
                   bool l2, const float* qoff, const int64_t* ids, float* D, int64_t* I) {
  const float fill = (l2 ? 1.f : -1.f) * std::numeric_limits<float>::max();
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t r = 0; r < k; ++r) {
      float v = r < m ? (l2 ? -vals[i * m + r] : vals[i * m + r]) : fill;
      if (qoff != nullptr && r < m) v = v + qoff[i];
      const bool ok = r < m && std::isfinite(v);
      D[i * k + r] = ok ? v : fill;
      I[i * k + r] = ok ? ids[idx[i * m + r]] : -1;
    }
}

// The best m of each query's kc candidate rows (-1 = none) by the codes of r: lut_rescore of
// the query rotated for them; qsq (nq) or nullptr: subtracted (L2: -||q - x_hat||^2), as the
// flat index's _rerank_np does with ops.row_sqnorms.
void refine_by_codes(const CodedRefine& r, const float* q, const float* qr, int64_t nq,
                     const int64_t* rows, int64_t kc, const float* qsq, const TopKOut& out,
                     int nthreads) {
  const int64_t d = r.codes.d, m = out.k;
  std::vector<float> q2;
  if (!r.same_rotation) {  // qr: q rotated by the scan's rotation
    q2.resize(static_cast<size_t>(nq * d));
    hadamard_rotate(q, nq, d, r.rot.perms, r.rot.signs, r.rot.rounds, r.rot.p, false, q2.data(),
                    nthreads);
    qr = q2.data();
  }
  lut_rescore(qr, nq, r.codes, rows, kc, out, nthreads);
  if (qsq != nullptr)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t t = 0; t < m; ++t) out.vals[i * m + t] = out.vals[i * m + t] - qsq[i];
}

}  // namespace

void flat_search(const FlatSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                 int64_t* I, int nthreads) {
  const int64_t d = a.d, n = a.scan.n, kk = std::min(k, n);
  const size_t nqs = static_cast<size_t>(nq);
  std::vector<float> qr(nqs * d), qc, qsq, qoff;
  q = prepare_queries(q, nq, d, a.normalize, a.center, a.ip_center, a.metric == kRescoreL2, qc,
                      qsq, qoff);
  hadamard_rotate(q, nq, d, a.rot.perms, a.rot.signs, a.rot.rounds, a.rot.p, false, qr.data(),
                  nthreads);
  const bool l2 = a.metric == kRescoreL2;
  const float* off = qoff.empty() ? nullptr : qoff.data();
  if (a.ref_x != nullptr || a.ref_codes.codes.codes != nullptr) {
    // kk = k_factor k candidates by the tables alone, then the refinement's best min(k, kk)
    const int64_t kc = capped_product(k, a.k_factor, n), m = std::min(k, kc);
    std::vector<float> cv(nqs * kc), rv(nqs * m);
    std::vector<int64_t> ci(nqs * kc), ri(nqs * m);
    fast_scan(qr.data(), nq, a.scan, true, {kc, cv.data(), ci.data()}, nthreads);
    for (size_t t = 0; t < nqs * kc; ++t)  // the general path's rows: -1 where not finite
      if (!std::isfinite(cv[t])) ci[t] = -1;
    if (a.ref_x != nullptr)
      rescore_topk(q, nq, d, a.ref_x, ci.data(), kc, a.metric, m, rv.data(), ri.data(),
                   nthreads);
    else
      refine_by_codes(a.ref_codes, q, qr.data(), nq, ci.data(), kc, l2 ? qsq.data() : nullptr,
                      {m, rv.data(), ri.data()}, nthreads);
    write_results(rv.data(), ri.data(), nq, m, k, l2, off, a.ids, D, I);
    return;
  }
  std::vector<float> vals(nqs * kk);
  std::vector<int64_t> idx(nqs * kk);
  const TopKOut out{kk, vals.data(), idx.data()};
  if (a.full.codes != nullptr)  // a prefilter: the sign plane, then the full codes of its best
    fast_scan_two_stage(qr.data(), nq, a.scan, a.full,
                        capped_product(std::max<int64_t>(a.prefilter, 1), kk, n), out, nthreads,
                        a.prefilter_bound);
  else
    fast_scan(qr.data(), nq, a.scan, false, out, nthreads);
  if (l2)  // the similarity -||q - x||^2 = score - ||q||^2 (then reported negated)
    for (size_t i = 0; i < nqs; ++i)
      for (int64_t r = 0; r < kk; ++r) vals[i * kk + r] = vals[i * kk + r] - qsq[i];
  write_results(vals.data(), idx.data(), nq, kk, k, l2, off, a.ids, D, I);
}

void terms_search(const TermsSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                  int64_t* I, int nthreads) {
  const int64_t d = a.d, m = a.m, n = a.n, kk = std::min(k, n);
  const size_t nqs = static_cast<size_t>(nq);
  std::vector<float> qc, qsq, qoff, t(nqs * m);
  const bool l2 = a.metric == kRescoreL2;
  q = prepare_queries(q, nq, d, a.normalize, a.center, a.ip_center, l2, qc, qsq, qoff);
  row_project(q, nq, d, a.W, m, t.data(), nthreads);
  // each term's queries as contiguous rows (one query: a view of t)
  std::vector<ScanTerm> terms = a.terms;
  std::vector<std::vector<float>> tq(terms.size());
  for (size_t x = 0; x < terms.size(); ++x) {
    const int64_t dt = terms[x].d;
    if (nq == 1) {
      terms[x].qr = t.data() + a.cols[x];
      continue;
    }
    tq[x].resize(nqs * dt);
    for (size_t i = 0; i < nqs; ++i)
      std::copy_n(t.data() + i * m + a.cols[x], dt, tq[x].data() + i * dt);
    terms[x].qr = tq[x].data();
  }
  std::vector<float> vals(nqs * kk);
  std::vector<int64_t> idx(nqs * kk);
  fast_scan_terms(terms.data(), static_cast<int>(terms.size()), nq, n, a.add,
                  {kk, vals.data(), idx.data()}, nthreads, a.nfirst,
                  a.nfirst > 0 ? capped_product(a.prefilter, kk, n) : 0);
  if (l2)
    for (size_t i = 0; i < nqs; ++i)
      for (int64_t r = 0; r < kk; ++r) vals[i * kk + r] = vals[i * kk + r] - qsq[i];
  write_results(vals.data(), idx.data(), nq, kk, k, l2, qoff.empty() ? nullptr : qoff.data(),
                a.ids, D, I);
}

namespace {

bool refines(const IvfSearchArgs& a) {
  return a.ref != nullptr || a.ref_codes.codes.codes != nullptr;
}

// What an IVF search ranks, for nq queries: the probes (given: probes_in /
// offsets_in (nq, np), the coordinator's; or probed here), the scan's best kk positions by the
// tables (the 8-bit ones under a refinement), cosine as 1 + 0.5 (-d^2); with a refinement the
// best m of those kk by it. vals / pos (nq, m) best first; scan_of (nq, m) or nullptr: each
// ranked row's scan similarity (the row's own where there is no refinement).
void ivf_rank(const IvfSearchArgs& a, const float* q, int64_t nq, const int64_t* probes_in,
              const float* offsets_in, int64_t m, float* vals_out, int64_t* pos_out,
              float* scan_of, int nthreads) {
  const int64_t d = a.d, np = a.nprobe, kk = a.kk;
  const size_t nqs = static_cast<size_t>(nq);
  std::vector<int64_t> probes, idx(nqs * kk);
  std::vector<float> offsets, qr(nqs * d), vals(nqs * kk);
  if (probes_in == nullptr) {
    probes.resize(nqs * np);
    offsets.resize(nqs * np);
    // l2 and cosine (unit vectors) probe by -||q - c||^2, inner product by <q, c>
    ivf_probe(q, nq, d, a.centroids, a.nlist, a.csq, a.metric != kRescoreIP, np, probes.data(),
              offsets.data(), nthreads);
    probes_in = probes.data();
    offsets_in = offsets.data();
  }
  hadamard_rotate(q, nq, d, a.rot.perms, a.rot.signs, a.rot.rounds, a.rot.p, false, qr.data(),
                  nthreads);
  // with a refinement, which re-ranks them, the candidates by the 8-bit tables alone
  const bool refine = refines(a);
  ivf_fast_scan(qr.data(), nq, a.scan, a.list_blocks, a.nlist, {probes_in, offsets_in, np},
                refine, {kk, vals.data(), idx.data()}, nthreads);
  for (size_t t = 0; t < nqs * kk; ++t) {
    if (idx[t] >= 0) idx[t] = a.pos[idx[t]];  // padded row -> add-order position
    // cosine is ranked by the l2 estimate on unit vectors and reported as 1 - d^2 / 2
    if (a.metric == kRescoreCosine) vals[t] = 1.f + 0.5f * vals[t];
  }
  if (!refine) {  // m == kk: the scan's rows are the result
    std::copy(vals.begin(), vals.end(), vals_out);
    std::copy(idx.begin(), idx.end(), pos_out);
    if (scan_of != nullptr) std::copy(vals.begin(), vals.end(), scan_of);
    return;
  }
  std::vector<int64_t> rows(nqs * kk);
  for (size_t t = 0; t < nqs * kk; ++t) rows[t] = std::isfinite(vals[t]) ? idx[t] : -1;
  if (a.ref != nullptr) {
    rescore_topk(q, nq, d, a.ref, rows.data(), kk, a.metric, m, vals_out, pos_out, nthreads);
  } else {
    std::vector<float> qsq;
    if (a.metric == kRescoreL2) {
      qsq.resize(nqs);
      row_sqnorms(q, nq, d, qsq.data());
    }
    refine_by_codes(a.ref_codes, q, qr.data(), nq, rows.data(), kk,
                    qsq.empty() ? nullptr : qsq.data(), {m, vals_out, pos_out}, nthreads);
  }
  if (scan_of == nullptr) return;
  // each ranked row's scan similarity: its candidates sorted by position (distinct within a
  // query), then a binary search per ranked row - O(kk log kk), not O(m kk) for a large k
  const float none = -std::numeric_limits<float>::infinity();
  std::vector<std::pair<int64_t, float>> by_pos(static_cast<size_t>(kk));
  for (size_t i = 0; i < nqs; ++i) {
    for (int64_t j = 0; j < kk; ++j) by_pos[j] = {rows[i * kk + j], vals[i * kk + j]};
    std::sort(by_pos.begin(), by_pos.end());
    for (int64_t t = 0; t < m; ++t) {
      const int64_t p = pos_out[i * m + t];
      const auto it = std::lower_bound(by_pos.begin(), by_pos.end(), std::make_pair(p, none));
      scan_of[i * m + t] = p >= 0 && it != by_pos.end() && it->first == p ? it->second : none;
    }
  }
}

}  // namespace

void ivf_search(const IvfSearchArgs& a, const float* q, int64_t nq, int64_t k, float* D,
                int64_t* I, int nthreads) {
  const int64_t m = refines(a) ? std::min(k, a.kk) : a.kk;
  // many queries: each thread runs the whole search for a contiguous share of them (one thread
  // start, not one per step, and each share's candidates re-ranked while still cached); few:
  // the kernels split each step
  auto run = [&](int64_t lo, int64_t hi, int threads) {
    const size_t n = static_cast<size_t>(hi - lo);
    std::vector<float> vals(n * m);
    std::vector<int64_t> pos(n * m);
    ivf_rank(a, q + lo * a.d, hi - lo, nullptr, nullptr, m, vals.data(), pos.data(), nullptr,
             threads);
    write_results(vals.data(), pos.data(), hi - lo, m, k, a.metric == kRescoreL2, nullptr,
                  a.ids, D + lo * k, I + lo * k);
  };
  if (!split_queries(nq, nthreads, 64, [&](int64_t lo, int64_t hi) { run(lo, hi, 1); }))
    run(0, nq, nthreads);
}

void ivf_candidates(const IvfSearchArgs& a, const float* q, int64_t nq, const int64_t* probes,
                    const float* offsets, float* scan, float* final_, int64_t* I,
                    int nthreads) {
  const int64_t kk = a.kk;
  auto run = [&](int64_t lo, int64_t hi, int threads) {
    const int64_t np = a.nprobe;
    ivf_rank(a, q + lo * a.d, hi - lo, probes ? probes + lo * np : nullptr,
             offsets ? offsets + lo * np : nullptr, kk, final_ + lo * kk, I + lo * kk,
             scan + lo * kk, threads);
    for (int64_t t = lo * kk; t < hi * kk; ++t) {  // positions -> ids; nothing where not finite
      const bool ok = std::isfinite(final_[t]);
      if (!ok) scan[t] = final_[t] = -std::numeric_limits<float>::infinity();
      I[t] = ok ? a.ids[std::max<int64_t>(I[t], 0)] : -1;
    }
  };
  if (!split_queries(nq, nthreads, 64, [&](int64_t lo, int64_t hi) { run(lo, hi, 1); }))
    run(0, nq, nthreads);
}

void graph_index_search(const GraphSearchArgs& a, const float* q, int64_t nq, int64_t k,
                        int64_t kk, int64_t ef, float* D, int64_t* I, int nthreads) {
  const int64_t d = a.graph.d;
  const size_t nqs = static_cast<size_t>(nq);
  std::vector<float> qr(nqs * d), qc, qsq;
  const bool l2 = a.metric == kRescoreL2;
  if (a.normalize) q = unit_rows(q, nq, d, qsq, qc);
  if (l2) {
    qsq.resize(nqs);
    row_sqnorms(q, nq, d, qsq.data());
  }
  hadamard_rotate(q, nq, d, a.rot.perms, a.rot.signs, a.rot.rounds, a.rot.p, false, qr.data(),
                  nthreads);
  std::vector<float> cv(nqs * kk);
  std::vector<int64_t> ci(nqs * kk);
  // with exact vectors the graph search scores what it expands exactly (no re-rank pass)
  GraphArgs g = a.graph;
  g.exact_x = a.ref_x;
  g.exact_metric = a.metric;
  graph_search(g, qr.data(), q, l2 ? qsq.data() : nullptr, nq, ef, {kk, cv.data(), ci.data()},
               nthreads);
  if (l2 && a.ref_x == nullptr)  // the estimates: minus ||q||^2 as the flat scan's
    for (size_t i = 0; i < nqs; ++i)
      for (int64_t r = 0; r < kk; ++r) cv[i * kk + r] = cv[i * kk + r] - qsq[i];
  write_results(cv.data(), ci.data(), nq, kk, k, l2, nullptr, a.ids, D, I);
}

}  // namespace tqvec
