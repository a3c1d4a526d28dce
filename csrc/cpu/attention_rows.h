// The row functions of decode attention over codes (attention.cpp drives them): scores of
// key rows, the softmax of score rows, value rows added to accumulators. One portable set
// (attention_rows.cpp) and one per instruction set in a file of its own (attention_avx2.cpp),
// each doing the same float operations in the same order, so every path gives the same bits;
// row_ops() resolves which set runs once per process. An AVX-512 or NEON set is one more file
// and one more line in row_ops().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "arch.h"

namespace tqvec {
namespace attn {

// The sum of 8 lanes in the order the AVX2 paths reduce them (two horizontal adds, then the
// 128-bit halves): ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float sum8(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// <a, b> over d floats in 16 independent lanes (chunk c of 8 coordinates into lanes
// 8 (c mod 2) ..: two chains of adds, so that the SIMD path is bound by throughput, not by the
// add latency; an element-wise loop the compiler vectorizes without reassociating), lanes u and
// u + 8 added, those 8 summed by sum8, then the tail.
inline float dot16(const float* __restrict a, const float* __restrict b, int64_t d) {
  float lane[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= d; j += 8) {
    float* l = lane + (j / 8 % 2) * 8;
    for (int u = 0; u < 8; ++u) l[u] += a[j + u] * b[j + u];
  }
  float tail = 0.f;
  for (; j < d; ++j) tail += a[j] * b[j];
  for (int u = 0; u < 8; ++u) lane[u] += lane[u + 8];
  return sum8(lane) + tail;
}

// exp(x) in float operations that the AVX2 path repeats lane by lane (libm's expf differs
// between builds and has no 8-lane form here): x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-6 polynomial (relative error ~1e-7), times 2^n. x below -87.3 (where e^x
// leaves the normal floats) gives 0, NaN gives 0, x is capped at 88 (softmax passes x <= 0).
constexpr float kExpLo = -87.33654f, kExpHi = 88.0f, kLog2e = 1.44269504088896341f,
                kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f, kRound = 12582912.0f;  // 1.5 2^23
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
inline float exp_softmax(float x) {
  if (!(x >= kExpLo)) return 0.0f;
  x = std::min(x, kExpHi);
  const float n = (x * kLog2e + kRound) - kRound;  // round to nearest (even)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float y = (p * (r * r) + r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y * two_n;
}


// The portable row functions.
void softmax_rows(float* s, int64_t g, int64_t n, float* m, float* l);
void decode_row(const uint8_t* row, int64_t d, int b, const float* cent, float* out);
void key_dots(const float* q, int64_t g, const uint8_t* kh, int64_t rb, int64_t n, int64_t d,
              int b, const float* cent, float* row, float* out);
void add_row(const float* w, int64_t g, const uint8_t* packed, int64_t d, int b,
             const float* cent, float* row, float* acc);
void add_rows(const float* w, int64_t n, int64_t g, const uint8_t* packed, int64_t rb,
              int64_t d, int b, const float* cent, std::vector<float>& scratch, float* acc);

#ifdef TQVEC_X86
// The same with AVX2 (attention_avx2.cpp).
__attribute__((target("avx2"))) void key_dots_avx2(const float* q, int64_t g, const uint8_t* kh,
                                                   int64_t rb, int64_t n, int64_t d, int b,
                                                   const float* cent, float* row, float* out);
__attribute__((target("avx2"))) void softmax_rows_avx2(float* s, int64_t g, int64_t n, float* m,
                                                       float* l);
__attribute__((target("avx2"))) void add_rows_avx2(const float* w, int64_t n, int64_t g,
                                                   const uint8_t* packed, int64_t rb, int64_t d,
                                                   int b, const float* cent,
                                                   std::vector<float>& scratch, float* acc);
#endif

// One set of row functions.
struct RowOps {
  void (*dots)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int,
               const float*, float*, float*);
  void (*softmax)(float*, int64_t, int64_t, float*, float*);
  void (*add)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int,
              const float*, std::vector<float>&, float*);
};

// The set of the instruction sets present (kernels.h: simd_avx2), chosen at the first call.
const RowOps& row_ops();

}  // namespace attn
}  // namespace tqvec
