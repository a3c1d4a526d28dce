// Exact scores of a few packed rows against one query (lut_rescore, and the second stage of
// the two-stage fast scan): the table is the small one - 16 entries per nibble for b = 1, 2, 4
// (2 rb x 16 floats, ~1 us to build), 2^b per coordinate for other b, none for b = 8 - since
// only a small multiple of k rows is scored, not every row of the database.
#pragma once
#include <cstdint>
#include <vector>

namespace tqvec {

inline void rescore_table(const float* q, int64_t d, int b, const float* c,
                          std::vector<float>& T) {
  if (b == 1 || b == 2 || b == 4) {
    const int per = 4 / b, mask = (1 << b) - 1;
    const int64_t M = 2 * ((d * b + 7) / 8);
    T.assign(static_cast<size_t>(M * 16), 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int v = 0; v < 16; ++v) {
        float s = 0.0f;
        for (int t = 0; t < per; ++t) {
          const int64_t j = m * per + t;
          if (j < d) s += q[j] * c[(v >> (t * b)) & mask];
        }
        T[static_cast<size_t>(m * 16 + v)] = s;
      }
  } else if (b != 8) {
    const int K = 1 << b;
    T.resize(static_cast<size_t>(d * K));
    for (int64_t j = 0; j < d; ++j)
      for (int v = 0; v < K; ++v) T[static_cast<size_t>(j * K + v)] = q[j] * c[v];
  }
}

// <q, c[idx]> of one packed row (rb = ceil(d b / 8) bytes) with the table of rescore_table.
inline float rescore_row(const float* q, const float* T, const uint8_t* row, int64_t d, int b,
                         const float* c) {
  const int64_t rb = (d * b + 7) / 8;
  if (b == 1 || b == 2 || b == 4) {
    float s0 = 0.f, s1 = 0.f;
    for (int64_t p = 0; p < rb; ++p) {
      s0 += T[(2 * p) * 16 + (row[p] & 15)];
      s1 += T[(2 * p + 1) * 16 + (row[p] >> 4)];
    }
    return s0 + s1;
  }
  float s = 0.f;
  if (b == 8) {
    for (int64_t j = 0; j < d; ++j) s += q[j] * c[row[j]];
    return s;
  }
  const uint32_t mask = (1u << b) - 1u;
  const int K = 1 << b;
  for (int64_t j = 0; j < d; ++j) {
    const int64_t bit = j * b;
    const uint32_t lo8 = row[bit >> 3];
    const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
    s += T[j * K + ((((hi8 << 8) | lo8) >> (bit & 7)) & mask)];
  }
  return s;
}

}  // namespace tqvec
