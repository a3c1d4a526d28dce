// The fast scan's per-query lookup tables (layouts and method: ../fastscan.h).
#pragma once
#include <cstdint>
#include <vector>

namespace tqvec::fastscan {

constexpr int64_t kRows = 32;         // rows per block
constexpr int64_t kFlushBytes = 256;  // <= 254 per byte and row: 256 * 254 < 65536
constexpr int64_t kFlushGroups3 = 128;  // b = 3: <= 508 per group and row: 128 * 508 < 65536
constexpr float kLevels = 127.0f;     // table entries are 7-bit: two of them add in 8 bits

// Per query: the quantized table, and where a scan re-scores candidates also the float table,
// which makes a candidate's exact score M lookups instead of d multiply-adds with index
// arithmetic (an IVF batch of many queries drops it: 160 rb bytes per query).
struct Lut {
  int64_t M = 0;                 // table positions: nibbles (2 rb), or pairs for b = 3
  int64_t E = 16;                // entries per position: 16, or 64 for b = 3 ((lo, hi) order)
  std::vector<uint8_t> q8;       // (M, E) quantized: T ~ delta * q8 + offset[m]
  std::vector<float> f;          // (M, E) the float table, or empty
  float delta = 1.0f, bias = 0.0f, err = 0.0f;  // S ~ delta * sum q8 + bias, |error| <= err
  const float* q = nullptr;      // (d) the query, rotated
  const float* c = nullptr;      // (2^b) centroids
  int64_t d = 0;
  int b = 0;
};

// The query's tables over codes of b bits (rb bytes per row of the blocked layout), with the
// approximation error bound err; keep_float keeps the float table too.
Lut build_lut(const float* q, int64_t d, int b, const float* c, int64_t rb, bool keep_float);

}  // namespace tqvec::fastscan
