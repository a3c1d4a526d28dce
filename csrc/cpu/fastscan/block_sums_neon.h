// Table sums of 32-row blocks with NEON (aarch64; layouts: ../fastscan.h): `tbl` lookups of
// 16-entry tables (b = 1, 2, 4) and of the 64-entry pair tables of b = 3 in one instruction
// (vqtbl4q: four registers, what the AVX2 path does with four shuffles and two blends). The
// integer sums are the portable loop's, so the totals - and every score and admission after
// them - are the same bits as the scalar and AVX2 paths.
#pragma once
#include "../arch.h"

#ifdef TQVEC_NEON
#include <algorithm>
#include <cstdint>
#include <limits>

#include "shortlist.h"
#include "tables.h"

namespace tqvec::fastscan {

// Adds the 16-bit row sums acc (rows 8u .. 8u + 7 in acc[u]) to the 32-bit totals tot[0, 32).
inline void flush_neon(const uint16x8_t (&acc)[4], uint32_t* tot) {
  for (int u = 0; u < 4; ++u) {
    uint32_t* t = tot + 8 * u;
    vst1q_u32(t, vaddw_u16(vld1q_u32(t), vget_low_u16(acc[u])));
    vst1q_u32(t + 4, vaddw_high_u16(vld1q_u32(t + 4), acc[u]));
  }
}

// Widens the 8-bit sums of rows 0-15 (r0) and 16-31 (r1) into the 16-bit row sums.
inline void widen_add(uint16x8_t (&acc)[4], uint8x16_t r0, uint8x16_t r1) {
  acc[0] = vaddw_u8(acc[0], vget_low_u8(r0));
  acc[1] = vaddw_high_u8(acc[1], r0);
  acc[2] = vaddw_u8(acc[2], vget_low_u8(r1));
  acc[3] = vaddw_high_u8(acc[3], r1);
}

// Table sums of one block for NQ queries (tables q8[q]); query q's 32 row totals land at
// tot[q * 32 ...]. b in {1, 2, 4}: both nibbles of a code byte belong to one row and table
// entries are <= 127, so their two lookups add in 8 bits; 16-bit lanes hold kFlushBytes bytes'
// sums (<= 254 each) before a flush to 32 bits. The totals live in memory between flushes:
// the registers go to NQ queries' accumulators.
template <int NQ>
inline void block_sums_neon(const uint8_t* blk, int64_t rb, const uint8_t* const* q8,
                            uint32_t* tot) {
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  std::fill(tot, tot + NQ * kRows, 0u);
  for (int64_t p0 = 0; p0 < rb; p0 += kFlushBytes) {
    const int64_t p1 = std::min(rb, p0 + kFlushBytes);
    uint16x8_t acc[NQ][4];
    for (int q = 0; q < NQ; ++q)
      for (int u = 0; u < 4; ++u) acc[q][u] = vdupq_n_u16(0);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8x16_t c0 = vld1q_u8(blk + p * kRows), c1 = vld1q_u8(blk + p * kRows + 16);
      const uint8x16_t lo0 = vandq_u8(c0, low4), hi0 = vshrq_n_u8(c0, 4);
      const uint8x16_t lo1 = vandq_u8(c1, low4), hi1 = vshrq_n_u8(c1, 4);
      for (int q = 0; q < NQ; ++q) {
        const uint8x16_t t0 = vld1q_u8(q8[q] + 2 * p * 16);
        const uint8x16_t t1 = vld1q_u8(q8[q] + (2 * p + 1) * 16);
        widen_add(acc[q], vaddq_u8(vqtbl1q_u8(t0, lo0), vqtbl1q_u8(t1, hi0)),
                  vaddq_u8(vqtbl1q_u8(t0, lo1), vqtbl1q_u8(t1, hi1)));
      }
    }
    for (int q = 0; q < NQ; ++q) flush_neon(acc[q], tot + q * kRows);
  }
}

// b = 3 (pair layout): per group of 8 coordinates, code bytes c0, c1 hold the hi nibbles of
// pairs 0, 1 and 2, 3 and byte cl their 2 lo bits each; pair P's table (64 entries at lo * 16 +
// hi) is one vqtbl4q lookup with index lo << 4 | hi. Pairs add two at a time in 8 bits (<= 254);
// a group adds <= 508 per row, so the 16-bit lanes flush every kFlushGroups3 groups.
template <int NQ>
inline void block_sums3_neon(const uint8_t* blk, int64_t rb, const uint8_t* const* q8,
                             uint32_t* tot) {
  const uint8x16_t low4 = vdupq_n_u8(0x0f), m3 = vdupq_n_u8(0x03), m0c = vdupq_n_u8(0x0c);
  const uint8x16_t m30 = vdupq_n_u8(0x30), mc0 = vdupq_n_u8(0xc0);
  const int64_t G = rb / 3;
  std::fill(tot, tot + NQ * kRows, 0u);
  for (int64_t g0 = 0; g0 < G; g0 += kFlushGroups3) {
    const int64_t g1 = std::min(G, g0 + kFlushGroups3);
    uint16x8_t acc[NQ][4];
    for (int q = 0; q < NQ; ++q)
      for (int u = 0; u < 4; ++u) acc[q][u] = vdupq_n_u16(0);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* src = blk + 3 * g * kRows;
      uint8x16_t ix[2][4];  // [half of the rows][pair]: the 6-bit table index
      for (int h = 0; h < 2; ++h) {
        const uint8x16_t c0 = vld1q_u8(src + 16 * h), c1 = vld1q_u8(src + kRows + 16 * h);
        const uint8x16_t cl = vld1q_u8(src + 2 * kRows + 16 * h);
        ix[h][0] = vorrq_u8(vshlq_n_u8(vandq_u8(cl, m3), 4), vandq_u8(c0, low4));
        ix[h][1] = vorrq_u8(vshlq_n_u8(vandq_u8(cl, m0c), 2), vshrq_n_u8(c0, 4));
        ix[h][2] = vorrq_u8(vandq_u8(cl, m30), vandq_u8(c1, low4));
        ix[h][3] = vorrq_u8(vshrq_n_u8(vandq_u8(cl, mc0), 2), vshrq_n_u8(c1, 4));
      }
      for (int q = 0; q < NQ; ++q) {
        uint8x16_t r[2][2];  // [half][pairs 0 + 1, pairs 2 + 3]
        for (int P = 0; P < 4; ++P) {
          const uint8x16x4_t T = vld1q_u8_x4(q8[q] + (4 * g + P) * 64);
          for (int h = 0; h < 2; ++h) {
            const uint8x16_t v = vqtbl4q_u8(T, ix[h][P]);
            r[h][P / 2] = P % 2 == 0 ? v : vaddq_u8(r[h][P / 2], v);
          }
        }
        widen_add(acc[q], r[0][0], r[1][0]);
        widen_add(acc[q], r[0][1], r[1][1]);
      }
    }
    for (int q = 0; q < NQ; ++q) flush_neon(acc[q], tot + q * kRows);
  }
}

template <int NQ>
inline void block_sums_neon_any(int b, const uint8_t* blk, int64_t rb, const uint8_t* const* q8,
                                uint32_t* tot) {
  if (b == 3)
    block_sums3_neon<NQ>(blk, rb, q8, tot);
  else
    block_sums_neon<NQ>(blk, rb, q8, tot);
}

// consider() for the 32 rows of block j (sums bt), 4 rows per compare: the same float
// operations in the same order, so the same admissions; rows that pass leave the vector path.
inline void admit_block_neon(const Lut& L, const uint32_t* bt, int64_t j, int64_t n,
                             const float* mult, const float* add, float off, Shortlist& sl) {
  const int64_t base = j * kRows;
  if (n - base < kRows) {  // last, partial block
    for (int64_t t = 0; t < n - base; ++t) consider(L, bt[t], base + t, mult, add, off, sl);
    return;
  }
  const float32x4_t vdelta = vdupq_n_f32(L.delta), vbias = vdupq_n_f32(L.bias);
  const float32x4_t voff = vdupq_n_f32(off), verr = vdupq_n_f32(L.err);
  const float32x4_t ninf = vdupq_n_f32(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < kRows; g += 4) {
    const float32x4_t m = vld1q_f32(mult + base + g), a = vld1q_f32(add + base + g);
    const float32x4_t sum = vcvtq_f32_u32(vld1q_u32(bt + g));
    // separate multiplies and adds (vmulq, vaddq; the build forbids contraction into fma)
    const float32x4_t s =
        vaddq_f32(vaddq_f32(vmulq_f32(m, vaddq_f32(vmulq_f32(vdelta, sum), vbias)), a), voff);
    const float32x4_t e = vmulq_f32(vabsq_f32(m), verr);
    const float32x4_t ub = vaddq_f32(s, e);
    const uint32x4_t pass = vandq_u32(vcgeq_f32(ub, vdupq_n_f32(sl.threshold())),
                                      vcgtq_f32(a, ninf));
    if (vmaxvq_u32(pass) == 0) continue;
    alignas(16) float lbv[4], ubv[4];
    alignas(16) uint32_t pv[4];
    vst1q_f32(lbv, vsubq_f32(s, e));
    vst1q_f32(ubv, ub);
    vst1q_u32(pv, pass);
    // an admission can raise the threshold: each row is tested against the current one
    for (int t = 0; t < 4; ++t)
      if (pv[t] && ubv[t] >= sl.threshold()) sl.admit(lbv[t], ubv[t], base + g + t, off);
  }
}

inline void scan_blocks_neon(const Lut& L, const uint8_t* blocked, int64_t rb, int64_t n,
                             int64_t j0, int64_t j1, const float* mult, const float* add,
                             float off, Shortlist& sl) {
  alignas(16) uint32_t tot[kRows];
  const uint8_t* q8[1] = {L.q8.data()};
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_neon_any<1>(L.b, blocked + j * rb * kRows, rb, q8, tot);
    admit_block_neon(L, tot, j, n, mult, add, off, sl);
  }
}

// NQ queries over the same blocks: each code byte is loaded and split once for NQ tables.
template <int NQ>
void scan_blocksq_neon(const Lut* const* L, const uint8_t* blocked, int64_t rb, int64_t n,
                       int64_t j0, int64_t j1, const float* mult, const float* add,
                       const float* off, Shortlist* const* sl) {
  alignas(16) uint32_t tot[NQ * kRows];
  const uint8_t* q8[NQ];
  for (int q = 0; q < NQ; ++q) q8[q] = L[q]->q8.data();
  for (int64_t j = j0; j < j1; ++j) {
    block_sums_neon_any<NQ>(L[0]->b, blocked + j * rb * kRows, rb, q8, tot);
    for (int q = 0; q < NQ; ++q)
      admit_block_neon(*L[q], tot + q * kRows, j, n, mult, add, off[q], *sl[q]);
  }
}

}  // namespace tqvec::fastscan
#endif  // TQVEC_NEON
