// Asymmetric scan of packed scalar-quantized codes with a fused top-k (meaning: lut_scan_ref in
// tqvec/ops/ref.py). Layouts:
//   qr        (nq, d)        float32  queries in the codes' (rotated) domain
//   packed    (n, rb)        uint8    rb = ceil(d*b/8), LSB-first indices (kernels.h)
//   centroids (2^b)          float32  value of each index
//   mult, add (n)            float32  score_i = mult_i * <qr, c[idx_i]> + add_i (add may be -inf)
//   out_vals  (nq, k)        float32  best first; -inf where fewer than k finite scores
//   out_idx   (nq, k)        int64    row positions, -1 where missing
// Per query a lookup table turns the dot product into one table lookup per code byte (b = 1, 2,
// 4, 8: T[byte position][byte value] sums the 8/b coordinates the byte holds) or per coordinate
// (other b). Scores are summed in a different order than the reference GEMM: equal within float
// rounding, not bit-exact. Threads split queries, or the database when there are few queries.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "prefetch.h"
#include "topk.h"
#include "rescore_codes.h"

namespace tqvec {
namespace {

// Min-heap of the k best hits (std::greater: the smallest kept score sits on top).
struct TopK {
  int64_t k;
  std::vector<Hit> heap;
  explicit TopK(int64_t kk) : k(kk) { heap.reserve(static_cast<size_t>(kk)); }
  inline void push(float s, int64_t i) {
    if (!(s > -std::numeric_limits<float>::infinity())) return;
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(s, i);
      std::push_heap(heap.begin(), heap.end(), std::greater<Hit>());
    } else if (s > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<Hit>());
      heap.back() = Hit(s, i);
      std::push_heap(heap.begin(), heap.end(), std::greater<Hit>());
    }
  }
};

struct Table {
  bool bytewise;
  std::vector<float> t;
};

Table build_table(const float* q, int64_t d, int b, const float* c) {
  const int K = 1 << b;
  Table tab;
  tab.bytewise = (8 % b == 0);
  if (tab.bytewise) {
    const int per = 8 / b;
    const int64_t rb = (d * b + 7) / 8;
    tab.t.assign(static_cast<size_t>(rb * 256), 0.0f);
    for (int64_t p = 0; p < rb; ++p) {
      for (int v = 0; v < 256; ++v) {
        float s = 0.0f;
        for (int t = 0; t < per; ++t) {
          const int64_t j = p * per + t;
          if (j < d) s += q[j] * c[(v >> (t * b)) & (K - 1)];
        }
        tab.t[static_cast<size_t>(p * 256 + v)] = s;
      }
    }
  } else {
    tab.t.resize(static_cast<size_t>(d * K));
    for (int64_t j = 0; j < d; ++j)
      for (int v = 0; v < K; ++v) tab.t[static_cast<size_t>(j * K + v)] = q[j] * c[v];
  }
  return tab;
}

void scan_range(const Table& tab, const uint8_t* packed, int64_t lo, int64_t hi, int64_t d,
                int b, const float* mult, const float* add, TopK& top) {
  const int64_t rb = (d * b + 7) / 8;
  const float* T = tab.t.data();
  if (tab.bytewise) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = packed + i * rb;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      int64_t p = 0;
      for (; p + 4 <= rb; p += 4) {
        s0 += T[(p + 0) * 256 + row[p + 0]];
        s1 += T[(p + 1) * 256 + row[p + 1]];
        s2 += T[(p + 2) * 256 + row[p + 2]];
        s3 += T[(p + 3) * 256 + row[p + 3]];
      }
      for (; p < rb; ++p) s0 += T[p * 256 + row[p]];
      top.push(((s0 + s1) + (s2 + s3)) * mult[i] + add[i], i);
    }
  } else {
    const int K = 1 << b;
    const uint32_t mask = static_cast<uint32_t>(K - 1);
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = packed + i * rb;
      float s = 0.f;
      for (int64_t j = 0; j < d; ++j) {
        const int64_t bit = j * b;
        const uint32_t lo8 = row[bit >> 3];
        const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
        s += T[j * K + ((((hi8 << 8) | lo8) >> (bit & 7)) & mask)];
      }
      top.push(s * mult[i] + add[i], i);
    }
  }
}

}  // namespace

void lut_rescore(const float* qr, int64_t nq, const CodeTable& c, const int64_t* rows, int64_t r,
                 const TopKOut& out, int nthreads) {
  const uint8_t* packed = c.codes;
  const int64_t n = c.n, d = c.d, k = out.k;
  const int b = c.b;
  const float *centroids = c.centroids, *mult = c.mult, *add = c.add;
  const int64_t rb = (d * b + 7) / 8;
  // threads over queries; a query's candidates are few (a small multiple of k)
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, nq * r / 256));
  const float hs = b >= 3 ? grid_half_step(centroids, b) : 0.0f;
  run_workers(t, [&](int64_t w) {
    std::vector<float> T;
    for (int64_t qi = w; qi < nq; qi += t) {
      const float* q = qr + qi * d;
      rescore_table(q, d, b, centroids, T);
      TopK top(k);
      for (int64_t c = 0; c < r; ++c) {
        // the candidates are scattered rows: request the next one's while this one is scored
        const int64_t nxt = c + 1 < r ? rows[qi * r + c + 1] : -1;
        if (nxt >= 0 && nxt < n)
          prefetch_span(packed + nxt * rb, rb);
        const int64_t i = rows[qi * r + c];
        if (i < 0 || i >= n) continue;
        top.push(rescore_row(q, T.data(), packed + i * rb, d, b, centroids, hs) * mult[i] + add[i],
                 i);
      }
      write_topk(top.heap, k, out.vals_of(qi), out.idx_of(qi));
    }
  });
}

void lut_scan(const float* qr, int64_t nq, const CodeTable& c, const TopKOut& out, int nthreads) {
  const uint8_t* packed = c.codes;
  const int64_t n = c.n, d = c.d, k = out.k;
  const int b = c.b;
  const float *centroids = c.centroids, *mult = c.mult, *add = c.add;
  if (nq >= nthreads || n < 4096) {
    // Threads over queries (strided): each builds its table and scans the whole database.
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, nq));
    auto work = [&](int64_t w) {
      for (int64_t qi = w; qi < nq; qi += t) {
        Table tab = build_table(qr + qi * d, d, b, centroids);
        TopK top(k);
        scan_range(tab, packed, 0, n, d, b, mult, add, top);
        write_topk(top.heap, k, out.vals_of(qi), out.idx_of(qi));
      }
    };
    run_workers(t, work);
    return;
  }
  // Few queries: split the database between threads, merge their top-k.
  for (int64_t qi = 0; qi < nq; ++qi) {
    Table tab = build_table(qr + qi * d, d, b, centroids);
    const int t = std::max(1, nthreads);
    std::vector<TopK> tops(static_cast<size_t>(t), TopK(k));
    const int64_t chunk = (n + t - 1) / t;
    run_workers(t, [&](int64_t w) {
      scan_range(tab, packed, std::min(n, w * chunk), std::min(n, (w + 1) * chunk), d, b, mult,
                 add, tops[static_cast<size_t>(w)]);
    });
    std::vector<Hit> all;
    for (auto& tp : tops) all.insert(all.end(), tp.heap.begin(), tp.heap.end());
    write_topk(all, k, out.vals_of(qi), out.idx_of(qi));
  }
}

}  // namespace tqvec
