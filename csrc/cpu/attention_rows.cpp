// The portable row functions of decode attention (attention_rows.h) and the choice of a set.

#include <vector>

#include "attention_rows.h"
#include "kernels.h"
#include "rescore_codes.h"

namespace tqvec {
namespace attn {

// Row r of s (g rows of n scores, row-major) replaced by exp(s - ref), ref its max where
// finite (else 0); m[r] = the max, l[r] = the sum of the exps: full groups of 8 summed per lane
// i mod 8, the lanes by sum8, then the rest in order.
void softmax_rows(float* s, int64_t g, int64_t n, float* m, float* l) {
  for (int64_t r = 0; r < g; ++r) {
    float* sr = s + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
    const float ref = std::isfinite(mx) ? mx : 0.0f;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t n8 = n / 8 * 8;
    for (int64_t i = 0; i < n8; i += 8)
      for (int u = 0; u < 8; ++u) lane[u] += (sr[i + u] = exp_softmax(sr[i + u] - ref));
    float sum = sum8(lane);
    for (int64_t i = n8; i < n; ++i) sum += (sr[i] = exp_softmax(sr[i] - ref));
    m[r] = mx;
    l[r] = sum;
  }
}

// One packed row of b-bit indices (kernels.h bit order) decoded to its centroids:
// out[j] = cent[index j], eight indices (b bytes) at a time, then the tail.
void decode_row(const uint8_t* row, int64_t d, int b, const float* cent, float* out) {
  const int64_t rb = (d * b + 7) / 8, d8 = d / 8 * 8;
  uint32_t v[8];
  for (int64_t j = 0; j < d8; j += 8) {
    unpack8(row, rb, b, j, v);
    for (int u = 0; u < 8; ++u) out[j + u] = cent[v[u]];
  }
  for (int64_t j = d8; j < d; ++j) out[j] = cent[code_at(row, b, j)];
}

// n consecutive key rows (kh, rb bytes each) against g query rows q[r d ..]: out[r n + i] =
// dot16(q_r, key row i decoded). Scratch: row (d floats).
void key_dots(const float* q, int64_t g, const uint8_t* kh, int64_t rb, int64_t n, int64_t d,
              int b, const float* cent, float* row, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    decode_row(kh + i * rb, d, b, cent, row);
    for (int64_t r = 0; r < g; ++r) out[r * n + i] = dot16(q + r * d, row, d);
  }
}

// A value row added to g accumulator rows: acc[r d + j] += w[r] x the decoded row's j-th value,
// rows with w[r] = 0 left alone.
void add_row(const float* w, int64_t g, const uint8_t* packed, int64_t d, int b,
             const float* cent, float* row, float* acc) {
  decode_row(packed, d, b, cent, row);
  for (int64_t r = 0; r < g; ++r) {
    if (w[r] == 0.0f) continue;
    float* out = acc + r * d;
    for (int64_t j = 0; j < d; ++j) out[j] += w[r] * row[j];
  }
}

// add_row for n value rows (packed, rb bytes each) with their weights w (n, g), in token order.
void add_rows(const float* w, int64_t n, int64_t g, const uint8_t* packed, int64_t rb,
              int64_t d, int b, const float* cent, std::vector<float>& scratch, float* acc) {
  scratch.resize(static_cast<size_t>(d));
  for (int64_t i = 0; i < n; ++i)
    add_row(w + i * g, g, packed + i * rb, d, b, cent, scratch.data(), acc);
}


const RowOps& row_ops() {
  static const RowOps ops = [] {
    RowOps o{key_dots, softmax_rows, add_rows};
#ifdef TQVEC_X86
    if (simd_avx2()) o = {key_dots_avx2, softmax_rows_avx2, add_rows_avx2};
#endif
    return o;
  }();
  return ops;
}

}  // namespace attn
}  // namespace tqvec
