// Exact scores of a few packed rows against one query (lut_rescore, and the second stage of
// the two-stage fast scan): a table only where it pays for a small multiple of k rows — 16
// entries per nibble for b = 1, 2 (2 rb x 16 floats; rescore_rows8_avx2 scores
// 8 rows at a time) — and none for b >= 3, whose centroids are looked up in registers (b = 3,
// 4), decoded affinely (a grid codebook: grid_half_step, a call's one test) or gathered.
#pragma once
#include "arch.h"

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
    T.resize(static_cast<size_t>(M * 16));
    float cv[4][16];  // cv[t][v]: the centroid of index t of nibble value v
    for (int t = 0; t < per; ++t)
      for (int v = 0; v < 16; ++v) cv[t][v] = c[(v >> (t * b)) & mask];
    for (int64_t m = 0; m < M; ++m) {
      float* row = T.data() + m * 16;
      for (int v = 0; v < 16; ++v) row[v] = 0.0f;
      for (int t = 0; t < per; ++t) {
        const int64_t j = m * per + t;
        if (j >= d) break;
        const float qj = q[j];
        for (int v = 0; v < 16; ++v) row[v] += qj * cv[t][v];
      }
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

// Half the step hs of a grid codebook c[i] = hs (2 i - K + 1) (tqvec.codebooks'
// sphere_grid_codebook: hs a float, every entry exactly that product), else 0.
inline float grid_half_step(const float* c, int b) {
  const int K = 1 << b;
  const float hs = c[K / 2];
  if (!(hs > 0.0f)) return 0.0f;
  for (int i = 0; i < K; ++i)
    if (c[i] != static_cast<float>(static_cast<double>(hs) * (2 * i - K + 1))) return 0.0f;
  return hs;
}

// The 8 indices of coordinates j0 .. j0 + 7 (j0 a multiple of 8) of a packed row of rb bytes.
inline void unpack8(const uint8_t* row, int64_t rb, int b, int64_t j0, uint32_t* v) {
  const int64_t off = j0 / 8 * b;  // 8 indices fill b whole bytes
  uint64_t w = 0;                  // little-endian; a whole 8-byte load where the row has them
  if (off + 8 <= rb)
    std::memcpy(&w, row + off, 8);
  else
    for (int t = 0; t < b; ++t) w |= static_cast<uint64_t>(row[off + t]) << (8 * t);
  for (int t = 0; t < 8; ++t) v[t] = static_cast<uint32_t>((w >> (t * b)) & ((1u << b) - 1u));
}

// b >= 3: a[16] += q_j v_j over the first d8 coordinates (d8 a multiple of 8), lane
// 8 ((j / 8) mod 2) + (j mod 8), where v_j = c[idx_j], or for a grid codebook (hs > 0) the
// integer 2 idx_j - K + 1 as a float (the row's sum is multiplied by hs once, at the end). A
// multiply then an add (no FMA, as everywhere here): the same float operations in the portable
// and the AVX2 versions. Two sets of 8 lanes, so the adds of consecutive steps do not wait on
// each other.
inline void row_lanes_portable(float* a, const float* q, const uint8_t* row, int64_t rb,
                               int64_t d8, int b, const float* c, bool grid) {
  const int km1 = (1 << b) - 1;
  uint32_t v[8];
  for (int64_t j = 0; j < d8; j += 8) {
    if (b == 8)
      for (int t = 0; t < 8; ++t) v[t] = row[j + t];
    else
      unpack8(row, rb, b, j, v);
    float* acc = a + ((j >> 3) & 1) * 8;
    for (int t = 0; t < 8; ++t)
      acc[t] += q[j + t] * (grid ? static_cast<float>(static_cast<int>(2 * v[t]) - km1) : c[v[t]]);
  }
}

#ifdef TQVEC_X86
// T[m][v] of each lane's nibble v in [0, 16): the 8-float half of the entry's row picked by v's
// top bit.
__attribute__((target("avx2"), always_inline)) inline __m256 nibble_lookup8(const float* T,
                                                                            int64_t m, __m256i v) {
  const __m256 lo8 = _mm256_loadu_ps(T + m * 16), hi8 = _mm256_loadu_ps(T + m * 16 + 8);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo8, v), _mm256_permutevar8x32_ps(hi8, v),
                          _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}

// The 8 indices of coordinates j .. j + 7 (j a multiple of 8) of a packed row of rb bytes, one
// per 32-bit lane.
__attribute__((target("avx2"), always_inline)) inline __m256i indices8_avx2(const uint8_t* row,
                                                                           int64_t rb, int64_t j,
                                                                           int b) {
  if (b == 8)
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j)));
  if (b <= 4) {  // the 8 indices lie in one 32-bit word, lane t at bit t b
    const int64_t off = j / 8 * b;
    uint32_t w = 0;
    if (off + 4 <= rb)
      std::memcpy(&w, row + off, 4);
    else
      for (int t = 0; t < b; ++t) w |= static_cast<uint32_t>(row[off + t]) << (8 * t);
    const __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(b));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh),
                            _mm256_set1_epi32((1 << b) - 1));
  }
  alignas(32) uint32_t vb[8];
  unpack8(row, rb, b, j, vb);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(vb));
}

// c[v] of the 8 indices v: b <= 3 by one register permute (c holds at least 8 floats: pad a
// shorter codebook), b = 4 two and a blend, wider a gather (of 8 floats: several times the
// cost of the permutes).
__attribute__((target("avx2"), always_inline)) inline __m256 centroids8_avx2(__m256i v, int b,
                                                                            const float* c) {
  if (b <= 3) return _mm256_permutevar8x32_ps(_mm256_loadu_ps(c), v);
  if (b == 4) return nibble_lookup8(c, 0, v);
  return _mm256_i32gather_ps(c, v, 4);
}

// The 8 products q_j v_j of coordinates j .. j + 7 (row_lanes' terms; b >= 3).
template <bool Grid>
__attribute__((target("avx2"))) inline __m256 row_term_avx2(const float* q, const uint8_t* row,
                                                            int64_t rb, int64_t j, int b,
                                                            const float* c) {
  const __m256i v = indices8_avx2(row, rb, j, b);
  // grid: 2 idx - (K - 1), exactly, as a float
  const __m256 cv =
      Grid ? _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(v, v),
                                                 _mm256_set1_epi32((1 << b) - 1)))
           : centroids8_avx2(v, b, c);
  return _mm256_mul_ps(_mm256_loadu_ps(q + j), cv);
}

template <bool Grid>
__attribute__((target("avx2"))) inline void row_lanes_avx2(float* a, const float* q,
                                                           const uint8_t* row, int64_t rb,
                                                           int64_t d8, int b, const float* c) {
  // two named accumulators (an array indexed by the step's parity lived on the stack: every
  // add then waited on a store and a load)
  __m256 acc0 = _mm256_loadu_ps(a), acc1 = _mm256_loadu_ps(a + 8);
  int64_t j = 0;
  for (; j + 16 <= d8; j += 16) {
    acc0 = _mm256_add_ps(acc0, row_term_avx2<Grid>(q, row, rb, j, b, c));
    acc1 = _mm256_add_ps(acc1, row_term_avx2<Grid>(q, row, rb, j + 8, b, c));
  }
  if (j < d8) acc0 = _mm256_add_ps(acc0, row_term_avx2<Grid>(q, row, rb, j, b, c));
  _mm256_storeu_ps(a, acc0);
  _mm256_storeu_ps(a + 8, acc1);
}
#endif

#ifdef TQVEC_X86
// rescore_row's table path (b = 1, 2: the 16-entry nibble tables T of rescore_table) for 8
// packed rows at once, one row per lane: the same eight partial sums (byte p mod 4, low and high
// nibble) in the same order, each lookup a vpermps of the entry's 8-float half picked by the
// nibble's top bit - so each lane's float operations, and result, are rescore_row's.
__attribute__((target("avx2"))) inline void rescore_rows8_avx2(const float* T,
                                                               const uint8_t* const* row,
                                                               int64_t rb, float* out) {
  __m256 s[8];
  for (auto& x : s) x = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15), byte = _mm256_set1_epi32(255);
  int64_t p = 0;
  for (; p + 4 <= rb; p += 4) {
    int32_t w[8];
    for (int r = 0; r < 8; ++r) std::memcpy(&w[r], row[r] + p, 4);
    const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    for (int u = 0; u < 4; ++u) {
      const __m256i b8 = _mm256_and_si256(_mm256_srli_epi32(g, 8 * u), byte);
      const __m256 lo = nibble_lookup8(T, 2 * (p + u), _mm256_and_si256(b8, low4));
      const __m256 hi = nibble_lookup8(T, 2 * (p + u) + 1, _mm256_srli_epi32(b8, 4));
      s[2 * u] = _mm256_add_ps(s[2 * u], lo);
      s[2 * u + 1] = _mm256_add_ps(s[2 * u + 1], hi);
    }
  }
  for (; p < rb; ++p) {
    const __m256i b8 = _mm256_setr_epi32(row[0][p], row[1][p], row[2][p], row[3][p], row[4][p],
                                         row[5][p], row[6][p], row[7][p]);
    s[0] = _mm256_add_ps(s[0], nibble_lookup8(T, 2 * p, _mm256_and_si256(b8, low4)));
    s[1] = _mm256_add_ps(s[1], nibble_lookup8(T, 2 * p + 1, _mm256_srli_epi32(b8, 4)));
  }
  __m256 t = _mm256_setzero_ps();
  for (int u = 0; u < 8; ++u) t = _mm256_add_ps(t, s[u]);
  _mm256_storeu_ps(out, t);
}
#endif

// <q, c[idx]> of one packed row (rb = ceil(d b / 8) bytes). b = 1, 2: through the nibble table of
// rescore_table, in eight independent partial sums (byte p mod 4, low and high nibble) added in
// order at the end. b >= 3: row_lanes (no table; indices unpacked in registers for b = 3, 4, 8),
// then the tail and the 16 lanes in order; a grid codebook (hs > 0, see grid_half_step) decodes
// affinely instead of gathering c[idx]: hs (sum q_j (2 idx_j - K + 1)). One running sum over a
// table per coordinate made every row a chain of d dependent adds (latency-bound), and the
// 16-entry-per-nibble table of b = 4 cost as much to build, 16 d products per query, as scoring
// 16 rows directly.
inline float rescore_row(const float* q, const float* T, const uint8_t* row, int64_t d, int b,
                         const float* c, float hs = 0.0f) {
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
  const bool grid = hs > 0.0f;
  float a[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t d8 = d / 8 * 8;
#ifdef TQVEC_X86
  if (simd_avx2() && grid)
    row_lanes_avx2<true>(a, q, row, rb, d8, b, c);
  else if (simd_avx2())
    row_lanes_avx2<false>(a, q, row, rb, d8, b, c);
  else
#endif
    row_lanes_portable(a, q, row, rb, d8, b, c, grid);
  const int km1 = (1 << b) - 1;
  float s = 0.f;
  for (int64_t j = d8; j < d; ++j) {
    const uint32_t v = code_at(row, b, j);
    s += q[j] * (grid ? static_cast<float>(static_cast<int>(2 * v) - km1) : c[v]);
  }
  for (int l = 0; l < 16; ++l) s += a[l];
  return grid ? hs * s : s;
}

}  // namespace tqvec
