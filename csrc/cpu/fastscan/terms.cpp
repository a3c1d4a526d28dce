// fast_scan_terms: several codes per row (layouts: ../fastscan.h, terms.h).
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
#include "../prefetch.h"
#include "../rescore_codes.h"
#include "../topk.h"
#include "block_sums.h"
#include "schedule.h"
#include "shortlist.h"
#include "tables.h"
#include "terms.h"

namespace tqvec {
namespace fastscan {
namespace {


void admit_terms_scalar(const std::vector<TermScan>& ts, uint32_t (*tot)[4 * kRows], int u,
                        int64_t j, int64_t n, const float* add, Shortlist& sl) {
  const int64_t base = j * kRows, rows = std::min(kRows, n - base);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t i = base + t;
    const float a = add[i];
    if (!(a > -std::numeric_limits<float>::infinity())) continue;
    float s = a, e = 0.0f;
    for (size_t x = 0; x < ts.size(); ++x) {
      const Lut& L = ts[x].L;
      const float m = ts[x].mult[i];
      s += m * (L.delta * static_cast<float>(tot[x][u * kRows + t]) + L.bias);
      e += std::fabs(m) * L.err;
    }
    if (s + e >= sl.threshold()) sl.admit(s - e, s + e, i, 0.0f);
  }
}

#ifdef TQVEC_X86
__attribute__((target("avx2"))) void admit_terms_avx2(const std::vector<TermScan>& ts,
                                                      uint32_t (*tot)[4 * kRows], int u,
                                                      int64_t j, int64_t n, const float* add,
                                                      Shortlist& sl) {
  const int64_t base = j * kRows;
  if (n - base < kRows) {
    admit_terms_scalar(ts, tot, u, j, n, add, sl);
    return;
  }
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int g = 0; g < kRows; g += 8) {
    const __m256 a = _mm256_loadu_ps(add + base + g);
    __m256 s = a, e = _mm256_setzero_ps();
    for (size_t x = 0; x < ts.size(); ++x) {
      const Lut& L = ts[x].L;
      const __m256 m = _mm256_loadu_ps(ts[x].mult + base + g);
      const __m256 sum = _mm256_cvtepi32_ps(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(tot[x] + u * kRows + g)));
      s = _mm256_add_ps(s, _mm256_mul_ps(m, _mm256_add_ps(
                                                _mm256_mul_ps(_mm256_set1_ps(L.delta), sum),
                                                _mm256_set1_ps(L.bias))));
      e = _mm256_add_ps(e, _mm256_mul_ps(_mm256_and_ps(m, absmask), _mm256_set1_ps(L.err)));
    }
    const __m256 ub = _mm256_add_ps(s, e);
    const __m256 th = _mm256_set1_ps(sl.threshold());
    int bits = _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(ub, th, _CMP_GE_OQ),
                                                _mm256_cmp_ps(a, ninf, _CMP_GT_OQ)));
    if (!bits) continue;
    // the few rows that pass leave the vector path (scalar, same arithmetic order per term)
    alignas(32) float sv[8], ev[8];
    _mm256_store_ps(sv, s);
    _mm256_store_ps(ev, e);
    while (bits) {
      const int t = __builtin_ctz(bits);
      bits &= bits - 1;
      if (sv[t] + ev[t] >= sl.threshold())
        sl.admit(sv[t] - ev[t], sv[t] + ev[t], base + g + t, 0.0f);
    }
  }
}

// b = 3 takes its 4 blocks as two passes of 2: its pair tables leave registers for only two
// blocks' accumulators (4 spilled them to the stack, as scan_blocks_avx2 notes).
__attribute__((target("avx2"))) void term_sums_avx2(const TermScan& T, int64_t j, int nb,
                                                    uint32_t* tot) {
  const uint8_t* q8[1] = {T.L.q8.data()};
  const uint8_t* blk = T.blocked + j * T.rb * kRows;
  if (T.L.b == 3 && simd_vbmi()) {
    for (int u = 0; u < nb; u += 2)
      block_sums3_two_vbmi(T.L, blk + u * T.rb * kRows, blk + (u + (nb > 1)) * T.rb * kRows,
                           T.rb, tot + u * kRows);
  } else if (!T.L.q8v.empty()) {
    block_sums_vnni_any(T.L, blk, T.rb, nb, tot);
  } else if (nb == 4 && T.L.b == 3) {
    block_sums3_avx2<2, 1>(blk, T.rb, q8, tot);
    block_sums3_avx2<2, 1>(blk + 2 * T.rb * kRows, T.rb, q8, tot + 2 * kRows);
  } else if (nb == 4) {
    block_sums<4, 1>(T.L.b, blk, T.rb, q8, tot);
  } else {
    block_sums<1, 1>(T.L.b, blk, T.rb, q8, tot);
  }
}

#endif

// Table sums of the terms [0, nt) over blocks j .. j + nb - 1 (nb = 4 where AVX2 and 4 blocks
// remain, else 1) into tot[x].
void term_sums(const std::vector<TermScan>& ts, size_t nt, int64_t j, [[maybe_unused]] int nb,
               [[maybe_unused]] bool simd,
               uint32_t (*tot)[4 * kRows]) {
  for (size_t x = 0; x < nt; ++x) {
#ifdef TQVEC_X86
    if (simd) {
      term_sums_avx2(ts[x], j, nb, tot[x]);
      continue;
    }
#endif
    block_sums_one(ts[x].L, ts[x].blocked + j * ts[x].rb * kRows, ts[x].rb, tot[x]);
  }
}

void scan_terms(const std::vector<TermScan>& ts, int64_t n, int64_t j0, int64_t j1,
                const float* add, Shortlist& sl) {
  alignas(32) uint32_t tot[kMaxTerms][4 * kRows];
  const bool simd = simd_avx2();
  for (int64_t j = j0; j < j1;) {
    const int nb = simd && j + 3 < j1 ? 4 : 1;
    term_sums(ts, ts.size(), j, nb, simd, tot);
    for (int u = 0; u < nb; ++u, ++j) {
#ifdef TQVEC_X86
      if (simd) {
        admit_terms_avx2(ts, tot, u, j, n, add, sl);
        continue;
      }
#endif
      admit_terms_scalar(ts, tot, u, j, n, add, sl);
    }
  }
}

#ifdef TQVEC_X86
// One full block's first-pass scores (below) with AVX2 intrinsics: first_scores_terms' float
// operations in its order, 8 rows per vector, straight from add to out (no copy through a row
// array, which compiles to `rep movs`).
__attribute__((target("avx2"))) void first_scores_block_avx2(const std::vector<TermScan>& ts,
                                                             size_t nfirst,
                                                             uint32_t (*tot)[4 * kRows], int u,
                                                             int64_t base, const float* add,
                                                             float* out) {
  for (int g = 0; g < kRows; g += 8) {
    __m256 acc = _mm256_loadu_ps(add + base + g);
    for (size_t x = 0; x < nfirst; ++x) {
      const __m256 sum = _mm256_cvtepi32_ps(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(tot[x] + u * kRows + g)));
      const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(ts[x].L.delta), sum),
                                     _mm256_set1_ps(ts[x].L.bias));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(ts[x].mult + base + g), v));
    }
    _mm256_storeu_ps(out + g, acc);
  }
}
#endif

// The first pass of a two-stage scan over several terms: the approximate (8-bit table) scores
// of rows [32 j0, 32 j1) from the leading nfirst terms only, s_i = add_i + sum_{t < nfirst}
// mult_t[i] (delta_t tot_t + bias_t), added in term order, written to s[i - 32 j0] - no bound:
// the second pass re-scores what it keeps.
void first_scores_terms(const std::vector<TermScan>& ts, size_t nfirst, int64_t n, int64_t j0,
                        int64_t j1, const float* add, float* s) {
  alignas(32) uint32_t tot[kMaxTerms][4 * kRows];
  const bool simd = simd_avx2();
  for (int64_t j = j0; j < j1;) {
    const int nb = simd && j + 3 < j1 ? 4 : 1;
    term_sums(ts, nfirst, j, nb, simd, tot);
    for (int u = 0; u < nb; ++u, ++j) {
      const int64_t base = j * kRows, rows = std::min(kRows, n - base);
      float* out = s + (j - j0) * kRows;
#ifdef TQVEC_X86
      if (simd && rows == kRows) {
        first_scores_block_avx2(ts, nfirst, tot, u, base, add, out);
        continue;
      }
#endif
      for (int64_t t = 0; t < rows; ++t) {
        float acc = add[base + t];
        for (size_t x = 0; x < nfirst; ++x)
          acc += ts[x].mult[base + t] *
                 (ts[x].L.delta * static_cast<float>(static_cast<int32_t>(tot[x][u * kRows + t])) +
                  ts[x].L.bias);
        out[t] = acc;
      }
    }
  }
}

void finish_terms(const std::vector<TermScan>& ts, const float* add,
                  std::vector<Shortlist*> parts, int64_t k, float* vals, int64_t* idx) {
  rescore_best_first(parts, k, [&](const Shortlist::Cand& c) {
    float v = 0.0f;
    for (const auto& T : ts) v += T.mult[c.row] * exact_score(T.L, T.blocked, T.rb, c.row);
    return v + add[c.row];
  }, vals, idx);
}

}  // namespace

// The second pass: query qi's exact scores of the candidate rows with every term, read from the
// terms' packed (row-major) codes - a few cache lines per row and term where the blocked layout
// spreads a row over rb lines - each chunk of rows loaded (touch_span) before the chunk before
// it is scored, so the misses overlap. With bounds ub (rows sorted by them, largest first) the
// pass stops at the first row, or group of 8 rows, whose bound is below the k-th best score so
// far (rescore_best_first's rule): the rows after it cannot enter.
void rescore_terms(const ScanTerm* terms, int nterms, int64_t qi, const std::vector<int64_t>& rows,
                   const float* add, int64_t k, float* vals, int64_t* idx, const float* ub) {
  thread_local std::vector<float> tables[kMaxTerms];
  const float* q[kMaxTerms];
  int64_t rbs[kMaxTerms];
  float hs[kMaxTerms];
  for (int x = 0; x < nterms; ++x) {
    const ScanTerm& T = terms[x];
    q[x] = T.qr + qi * T.d;
    rbs[x] = (T.d * T.b + 7) / 8;
    rescore_table(q[x], T.d, T.b, T.centroids, tables[x]);
    hs[x] = T.b >= 3 ? grid_half_step(T.centroids, T.b) : 0.0f;
  }
  // the rows' lines loaded a chunk ahead of their scoring (touch_span)
  constexpr size_t kChunk = 32;
  auto touch = [&](size_t r0) {
    uint32_t s = 0;
    for (size_t r = r0; r < std::min(rows.size(), r0 + kChunk); ++r) {
      for (int x = 0; x < nterms; ++x)
        s += touch_span(terms[x].packed + rows[r] * rbs[x], rbs[x]) +
             touch_span(terms[x].mult + rows[r], 4);
      s += touch_span(add + rows[r], 4);
    }
    keep(s);
  };
  touch(0);
  std::vector<Hit> hits;
  hits.reserve(ub ? std::min(rows.size(), static_cast<size_t>(4 * k + 64)) : rows.size());
  std::vector<float> best;  // with bounds: a min-heap of the k best scores so far
  auto admit = [&](float v, int64_t i) {
    hits.emplace_back(v, i);
    if (ub && v > -std::numeric_limits<float>::infinity()) keep_largest(best, k, v);
  };
  // strictly greater: a row whose bound equals the k-th score could still tie it
  auto done = [&](size_t r) {
    return ub && static_cast<int64_t>(best.size()) == k && best.front() > ub[r];
  };
  size_t r0 = 0, end = rows.size();
#ifdef TQVEC_X86
  // 8 rows at a time, terms of 1 and 2 bits (tables) by rescore_rows8_avx2, the others row by
  // row: each row's terms add in the same order as below, so its value is the same
  bool tabled = false;
  for (int x = 0; x < nterms; ++x) tabled = tabled || terms[x].b == 1 || terms[x].b == 2;
  tabled = tabled && simd_avx2();
  for (; tabled && r0 + 8 <= end; r0 += 8) {
    if (done(r0)) {
      end = r0;
      break;
    }
    if (r0 % kChunk == 0) touch(r0 + kChunk);
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sc[8];
    for (int x = 0; x < nterms; ++x) {
      const ScanTerm& T = terms[x];
      const uint8_t* rp[8];
      for (int u = 0; u < 8; ++u) rp[u] = T.packed + rows[r0 + u] * rbs[x];
      if (T.b == 1 || T.b == 2)
        rescore_rows8_avx2(tables[x].data(), rp, rbs[x], sc);
      else
        for (int u = 0; u < 8; ++u)
          sc[u] = rescore_row(q[x], tables[x].data(), rp[u], T.d, T.b, T.centroids, hs[x]);
      for (int u = 0; u < 8; ++u) v[u] += T.mult[rows[r0 + u]] * sc[u];
    }
    for (int u = 0; u < 8; ++u) admit(v[u] + add[rows[r0 + u]], rows[r0 + u]);
  }
#endif
  for (size_t r = r0; r < end; ++r) {
    if (done(r)) break;
    if (r % kChunk == 0) touch(r + kChunk);
    const int64_t i = rows[r];
    float v = 0.0f;
    for (int x = 0; x < nterms; ++x) {
      const ScanTerm& T = terms[x];
      v += T.mult[i] * rescore_row(q[x], tables[x].data(), T.packed + i * rbs[x], T.d, T.b,
                                   T.centroids, hs[x]);
    }
    admit(v + add[i], i);
  }
  write_topk(hits, k, vals, idx);
}

}  // namespace fastscan

using namespace fastscan;  // NOLINT: the kernel's own internals

void fast_scan_terms(const ScanTerm* terms, int nterms, int64_t nq, int64_t n, const float* add,
                     const TopKOut& out, int nthreads, int nfirst, int64_t k1) {
  const int64_t k = out.k;
  float* const out_vals = out.vals;
  int64_t* const out_idx = out.idx;
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t t = std::max(1, nthreads);
  auto make = [&](int64_t qi, int upto, bool keep_float) {
    std::vector<TermScan> ts;
    for (int x = 0; x < upto; ++x) {
      const ScanTerm& T = terms[x];
      const int64_t rb = fs_row_bytes(T.d, T.b);
      ts.push_back({build_lut(T.qr + qi * T.d, T.d, T.b, T.centroids, rb, keep_float),
                    T.blocked, rb, T.mult});
    }
    return ts;
  };
  if (nfirst > 0) {
    // Two stages: the first nfirst terms' table scores, the rows of the k1 best kept as they
    // come (rows_reaching_kth), then their exact scores with every term.
    auto two_stage = [&](int64_t qi, int64_t workers) {
      const auto ts = make(qi, nfirst, false);
      thread_local std::vector<int64_t> rows;
      rows_reaching_kth(n, k1, workers,
                        [&](int64_t j0, int64_t j1, float* s) {
                          first_scores_terms(ts, static_cast<size_t>(nfirst), n, j0, j1, add, s);
                        },
                        rows);
      rescore_terms(terms, nterms, qi, rows, add, k, out_vals + qi * k, out_idx + qi * k);
    };
    if (threads_over_queries(nq, nb, t)) {
      for_each_query(nq, t, [&](int64_t qi) { two_stage(qi, 1); });
    } else {  // few queries: threads over blocks for the first pass
      const int64_t workers = std::min<int64_t>(t, nb / kMinBlocksPerSplit);
      for (int64_t qi = 0; qi < nq; ++qi) two_stage(qi, workers);
    }
    return;
  }
  if (threads_over_queries(nq, nb, t)) {
    for_each_query(nq, t, [&](int64_t qi) {
      const auto ts = make(qi, nterms, true);
      Shortlist sl(k);
      scan_terms(ts, n, 0, nb, add, sl);
      finish_terms(ts, add, {&sl}, k, out_vals + qi * k, out_idx + qi * k);
    });
    return;
  }
  for (int64_t qi = 0; qi < nq; ++qi) {  // few queries: threads over blocks, shortlists merged
    const auto ts = make(qi, nterms, true);
    std::vector<Shortlist> sls = split_blocks(nb, t, k, [&](int64_t j0, int64_t j1, Shortlist& sl) {
      scan_terms(ts, n, j0, j1, add, sl);
    });
    finish_terms(ts, add, pointers(sls), k, out_vals + qi * k, out_idx + qi * k);
  }
}

}  // namespace tqvec
