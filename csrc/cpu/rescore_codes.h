// Exact scores of a few packed rows against one query (lut_rescore, and the second stage of
// the two-stage fast scan): a table only where it pays for a small multiple of k rows — 16
// entries per nibble for b = 1, 2 (2 rb x 16 floats, ~1 us to build) — and none for b >= 3.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace tqvec {

inline void rescore_table(const float* q, int64_t d, int b, const float* c,
                          std::vector<float>& T) {
  if (b == 1 || b == 2) {
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
  }
}

// Index j of a packed row of b-bit indices.
inline uint32_t code_at(const uint8_t* row, int b, int64_t j) {
  const int64_t bit = j * b;
  const uint32_t lo8 = row[bit >> 3];
  const uint32_t hi8 = ((bit & 7) + b > 8) ? row[(bit >> 3) + 1] : 0u;
  return (((hi8 << 8) | lo8) >> (bit & 7)) & ((1u << b) - 1u);
}

// Lane l of a[8] += q_j c[idx_j] for j = l (mod 8), j < n (a multiple of 8): a multiply then an
// add (no FMA, as everywhere here) — the same float operations in the AVX2 version (one gather
// of 8 centroids per step) and the portable one.
inline void lanes8_portable(float* a, const float* q, const uint8_t* idx, int64_t n,
                            const float* c) {
  for (int64_t j = 0; j < n; j += 8)
    for (int l = 0; l < 8; ++l) a[l] += q[j + l] * c[idx[j + l]];
}

__attribute__((target("avx2"))) inline void lanes8_avx2(float* a, const float* q,
                                                        const uint8_t* idx, int64_t n,
                                                        const float* c) {
  __m256 acc = _mm256_loadu_ps(a);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx + j)));
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + j), _mm256_i32gather_ps(c, v, 4)));
  }
  _mm256_storeu_ps(a, acc);
}

// <q, c[idx]> of one packed row (rb = ceil(d b / 8) bytes). b = 1, 2: through the nibble table of
// rescore_table, in eight independent partial sums (byte p mod 4, low and high nibble) added in
// order at the end. b >= 3: the products of lanes8 (indices unpacked to bytes a chunk at a
// time), then the tail and the lanes in order. One running sum over a table per coordinate made
// every row a chain of d dependent adds (~0.9 us at d = 784), and the 16-entry-per-nibble table
// of b = 4 cost as much to build, 16 d products per query, as scoring 16 rows directly:
// lut_rescore of 30 rows per query at d = 784 took 19 ms per 1,000 queries at 4 bits, 13 at 8
// (Refine(TQ8) was slower than Refine(Flat)).
inline float rescore_row(const float* q, const float* T, const uint8_t* row, int64_t d, int b,
                         const float* c) {
  const int64_t rb = (d * b + 7) / 8;
  if (b == 1 || b == 2) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t p = 0;
    for (; p + 4 <= rb; p += 4)
      for (int u = 0; u < 4; ++u) {
        s[2 * u] += T[(2 * (p + u)) * 16 + (row[p + u] & 15)];
        s[2 * u + 1] += T[(2 * (p + u) + 1) * 16 + (row[p + u] >> 4)];
      }
    for (; p < rb; ++p) {
      s[0] += T[(2 * p) * 16 + (row[p] & 15)];
      s[1] += T[(2 * p + 1) * 16 + (row[p] >> 4)];
    }
    float t = 0.f;
    for (int u = 0; u < 8; ++u) t += s[u];
    return t;
  }
  const bool avx2 = simd_avx2();
  constexpr int64_t kChunk = 256;
  alignas(32) uint8_t ib[kChunk];
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t d8 = d / 8 * 8;
  for (int64_t j0 = 0; j0 < d8; j0 += kChunk) {
    const int64_t n = std::min(kChunk, d8 - j0);
    const uint8_t* idx = row + j0;
    if (b == 4) {
      for (int64_t j = 0; j < n; j += 2) {
        const uint8_t v = row[(j0 + j) >> 1];
        ib[j] = v & 15;
        ib[j + 1] = v >> 4;
      }
      idx = ib;
    } else if (b != 8) {  // 8 indices in b whole bytes (j0 + j is a multiple of 8)
      const uint64_t mask = (1u << b) - 1u;
      for (int64_t j = 0; j < n; j += 8) {
        const int64_t off = (j0 + j) / 8 * b;
        uint64_t w = 0;  // little-endian; a whole 8-byte load where the row has them
        if (off + 8 <= rb)
          std::memcpy(&w, row + off, 8);
        else
          for (int t = 0; t < b; ++t) w |= static_cast<uint64_t>(row[off + t]) << (8 * t);
        for (int t = 0; t < 8; ++t) ib[j + t] = static_cast<uint8_t>((w >> (t * b)) & mask);
      }
      idx = ib;
    }
    if (avx2)
      lanes8_avx2(a, q + j0, idx, n, c);
    else
      lanes8_portable(a, q + j0, idx, n, c);
  }
  float s = 0.f;
  for (int64_t j = d8; j < d; ++j) s += q[j] * c[code_at(row, b, j)];
  for (int l = 0; l < 8; ++l) s += a[l];
  return s;
}

}  // namespace tqvec
