// fast_scan over every row and the blocked layout (layouts and method: ../fastscan.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "../kernels.h"
#include "../parallel.h"
#include "block_sums.h"
#include "schedule.h"
#include "shortlist.h"
#include "tables.h"

namespace tqvec {

using namespace fastscan;  // NOLINT: the kernel's own internals

void block_codes(const uint8_t* packed, int64_t n, int64_t d, int b, uint8_t* blocked,
                 int nthreads) {
  block_code_rows(packed, nullptr, n, d, b, blocked, nthreads);
}

void block_code_rows(const uint8_t* packed, const int32_t* rows_of, int64_t n, int64_t d, int b,
                     uint8_t* blocked, int nthreads) {
  const int64_t nb = (n + kRows - 1) / kRows;
  const int64_t rb = (d * b + 7) / 8, fb = fs_row_bytes(d, b);
  auto work = [&](int64_t j0, int64_t j1) {
    const std::vector<uint8_t> zero(static_cast<size_t>(b != 3 ? rb : 0), 0);  // a padding row
    for (int64_t j = j0; j < j1; ++j) {
      uint8_t* out = blocked + j * fb * kRows;
      const int64_t rows = std::min(kRows, n - j * kRows);
      if (b != 3) {  // a transpose of 32 rows: written in order, read from L1
        const uint8_t* src[kRows];
        for (int64_t t = 0; t < kRows; ++t) {
          const int64_t r = t >= rows ? -1 : rows_of == nullptr ? j * kRows + t
                                                                : rows_of[j * kRows + t];
          src[t] = r < 0 ? zero.data() : packed + r * rb;
        }
        for (int64_t p = 0; p < rb; ++p)
          for (int64_t t = 0; t < kRows; ++t) out[p * kRows + t] = src[t][p];
        continue;
      }
      if (rows < kRows || rows_of != nullptr) std::memset(out, 0, static_cast<size_t>(fb * kRows));
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t src = rows_of == nullptr ? j * kRows + t : rows_of[j * kRows + t];
        if (src < 0) continue;  // a zero row
        const uint8_t* row = packed + src * rb;
        if (b != 3) {
          for (int64_t p = 0; p < rb; ++p) out[p * kRows + t] = row[p];
          continue;
        }
        // 8 indices = 24 bits = bytes 3g .. 3g+2 of the LSB-first stream -> the pair layout
        for (int64_t g = 0; g < fb / 3; ++g) {
          uint32_t w = 0;
          for (int u = 0; u < 3; ++u)
            if (3 * g + u < rb) w |= static_cast<uint32_t>(row[3 * g + u]) << (8 * u);
          const int64_t valid = std::min<int64_t>(8, d - 8 * g);  // padding indices are 0
          if (valid < 8) w &= (1u << (3 * valid)) - 1;
          uint32_t hi = 0, lo = 0;
          for (int u = 0; u < 8; ++u) {
            const uint32_t idx = (w >> (3 * u)) & 7;
            hi |= (idx >> 1) << (2 * u);
            lo |= (idx & 1) << u;
          }
          out[(3 * g) * kRows + t] = static_cast<uint8_t>(hi & 0xff);
          out[(3 * g + 1) * kRows + t] = static_cast<uint8_t>(hi >> 8);
          out[(3 * g + 2) * kRows + t] = static_cast<uint8_t>(lo);
        }
      }
    }
  };
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(nthreads, nb / kMinBlocksPerSplit));
  const int64_t chunk = (nb + t - 1) / t;
  run_workers(t, [&](int64_t w) { work(std::min(nb, w * chunk), std::min(nb, (w + 1) * chunk)); });
}

void fast_scan(const float* qr, int64_t nq, const CodeTable& t, bool approx, const TopKOut& out,
               int nthreads) {
  const int64_t rb = fs_row_bytes(t.d, t.b), k = out.k;
  fast_scan_impl(qr, nq, t.d, t.d, t.codes, t.n, t.b, t.centroids, t.mult, t.add, k, approx,
                 nthreads, [&](int64_t qi, const Lut& L, std::vector<Shortlist*> parts) {
                   if (approx)
                     finish_approx(parts, k, out.vals_of(qi), out.idx_of(qi));
                   else
                     finish(L, t.codes, rb, t.mult, t.add, std::move(parts), k, out.vals_of(qi),
                            out.idx_of(qi));
                 });
}

}  // namespace tqvec
