// The fast scan's per-query lookup tables (layouts and method: ../fastscan.h).
#pragma once
#include <cstdint>
#include <vector>

namespace tqvec::fastscan {

constexpr int64_t kRows = 32;         // rows per block
constexpr int64_t kFlushBytes = 256;  // <= 254 per byte and row: 256 * 254 < 65536
constexpr int64_t kFlushGroups3 = 128;  // b = 3: <= 508 per group and row: 128 * 508 < 65536
constexpr float kLevels = 127.0f;     // table entries are 7-bit: two of them add in 8 bits

// A row's approximate score from its integer sum S: delta * S + bias, |error| <= err.
struct SumScale {
  float delta = 1.0f, bias = 0.0f, err = 0.0f;
};

// Per query: the quantized table, and where a scan re-scores candidates also the float table,
// which makes a candidate's exact score M lookups instead of d multiply-adds with index
// arithmetic (an IVF batch of many queries drops it: 160 rb bytes per query).
struct Lut {
  int64_t M = 0;                 // table positions: nibbles (2 rb), or pairs for b = 3
  int64_t E = 16;                // entries per position: 16, or 64 for b = 3 ((lo, hi) order)
  std::vector<uint8_t> q8;       // (M, E) quantized: T ~ delta * q8 + offset[m]
  std::vector<float> f;          // (M, E) the float table, or empty
  // q8 as the AVX-512 scans read it (b in {1, 2, 4} where they run, else empty): per pair of
  // code bytes p, p + 1 (nibble positions 2p .. 2p + 3), 128 bytes = the 16-entry tables
  // lo_p, lo_p, lo_p+1, lo_p+1, hi_p, hi_p, hi_p+1, hi_p+1 (lo_p = q8 row 2p, hi_p = 2p + 1),
  // so that two plain loads fill the lookup registers; a last unpaired byte's p + 1 tables
  // are zero.
  std::vector<uint8_t> q8x;
  // q8 as the VNNI sums read it (b in {1, 2, 4} where uses_vnni_sums, else empty): per four
  // code bytes p .. p + 3, 128 bytes = the 16-entry tables lo_p .. lo_p+3, then hi_p ..
  // hi_p+3, so that one vpermb looks up all four; zero tables past the last byte.
  std::vector<uint8_t> q8v;
  float delta = 1.0f, bias = 0.0f, err = 0.0f;  // S ~ delta * sum q8 + bias, |error| <= err
  // The dot form (b = 4, exact scans, where the VNNI scan runs; add_dot): <q, c[idx]> ~
  // dot.delta * sum_j w_j lev[idx_j] + dot.bias, the query as int8 weights w (zero past d, to
  // 4 bytes past the last code byte pair) and the centroids as 8-bit levels lev (the 16 of
  // them in each 16-byte lane of 64).
  std::vector<int8_t> w;
  uint8_t lev[64] = {};
  SumScale dot;
  const float* q = nullptr;      // (d) the query, rotated
  const float* c = nullptr;      // (2^b) centroids
  int64_t d = 0;
  int b = 0;
};

// The query's tables over codes of b bits (rb bytes per row of the blocked layout), with the
// approximation error bound err; keep_float keeps the float table too.
Lut build_lut(const float* q, int64_t d, int b, const float* c, int64_t rb, bool keep_float);

// Whether a scan of b-bit codes takes the dot form (dot_sums_vnni) for its groups of queries:
// b = 4, an exact scan (its shortlist re-scored), and the CPU's VNNI path (simd_vnni).
bool uses_dot(int b, bool exact);

// Whether the block sums of b-bit codes take VBMI and VNNI (block_sums_vnni): b in {1, 2, 4},
// simd_vnni, and not the opt-in AVX-512 F + BW path (TQVEC_SIMD=avx512, which keeps its own).
bool uses_vnni_sums(int b);

// Adds the dot form to a 4-bit query's Lut (rb code bytes per row).
void add_dot(Lut& L, int64_t rb);

}  // namespace tqvec::fastscan
