// Bit packing and the scalar-quantize-and-pack step of encoding. Layouts: see kernels.h.
// Quantization must equal torch.searchsorted(thr, y * scale, right=True) bit for bit:
// the product is one float32 multiply (no FMA: built with -ffp-contract=off), and the index is
// the number of thresholds <= v: for b <= 4 by compare-and-add passes over the K-1 thresholds,
// above by a binary search (gathered thresholds, 8 coordinates per vector, with AVX2).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace tqvec {
namespace {

inline int64_t row_bytes(int64_t d, int b) { return (d * b + 7) / 8; }

// Appends `count` indices of width b to a zeroed byte row, LSB-first.
template <int B>
inline void pack_row_fixed(const uint8_t* idx, int64_t d, uint8_t* out) {
  if constexpr (B == 8) {
    std::memcpy(out, idx, static_cast<size_t>(d));
  } else if constexpr (8 % B == 0) {
    constexpr int per = 8 / B;
    int64_t full = d / per;
    for (int64_t i = 0; i < full; ++i) {
      uint8_t v = 0;
      for (int k = 0; k < per; ++k) v |= static_cast<uint8_t>(idx[i * per + k] << (k * B));
      out[i] = v;
    }
    if (full * per < d) {
      uint8_t v = 0;
      for (int64_t k = 0; full * per + k < d; ++k)
        v |= static_cast<uint8_t>(idx[full * per + k] << (k * B));
      out[full] = v;
    }
  } else {
    uint64_t acc = 0;
    int nbits = 0;
    int64_t o = 0;
    for (int64_t j = 0; j < d; ++j) {
      acc |= static_cast<uint64_t>(idx[j]) << nbits;
      nbits += B;
      while (nbits >= 8) {
        out[o++] = static_cast<uint8_t>(acc);
        acc >>= 8;
        nbits -= 8;
      }
    }
    if (nbits > 0) out[o] = static_cast<uint8_t>(acc);
  }
}

template <int B>
inline void unpack_row_fixed(const uint8_t* in, int64_t d, uint8_t* idx) {
  constexpr uint32_t mask = (1u << B) - 1u;
  if constexpr (B == 8) {
    std::memcpy(idx, in, static_cast<size_t>(d));
  } else if constexpr (8 % B == 0) {
    constexpr int per = 8 / B;
    for (int64_t j = 0; j < d; ++j)
      idx[j] = static_cast<uint8_t>((in[j / per] >> ((j % per) * B)) & mask);
  } else {
    for (int64_t j = 0; j < d; ++j) {
      int64_t bit = j * B;
      uint32_t lo = in[bit >> 3];
      uint32_t hi = ((bit & 7) + B > 8) ? in[(bit >> 3) + 1] : 0u;
      idx[j] = static_cast<uint8_t>((((hi << 8) | lo) >> (bit & 7)) & mask);
    }
  }
}

template <class F>
void with_bits(int b, F&& f) {
  switch (b) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// #{t : thr[t] <= v} over the 2^B - 1 ascending thresholds by a binary search (NaN: 0).
template <int B>
inline int search_one(float v, const float* thr) {
  int k = 0;
  for (int step = (1 << B) >> 1; step > 0; step >>= 1) k += (v >= thr[k + step - 1]) ? step : 0;
  return k;
}

#ifdef TQVEC_X86
// search_one for the first d / 8 * 8 values, 8 per vector and 4 vectors side by side: each
// step's threshold gathered per lane and compared (ordered >=: NaN counts nothing, as the
// scalar compare). The scalar loop's data-dependent steps mispredict or wait on each load;
// here the 4 vectors' gathers overlap. Returns the values done.
template <int B>
__attribute__((target("avx2"))) int64_t search_avx2(const float* v, int64_t d, const float* thr,
                                                    uint8_t* idx) {
  constexpr int U = 4;
  const int64_t d8 = d / 8 * 8;
  int64_t j = 0;
  alignas(32) int32_t k32[8 * U];
  for (; j < d8; j += 8 * U) {
    const int u_n = static_cast<int>(std::min<int64_t>(U, (d8 - j) / 8));
    __m256 x[U];
    __m256i k[U];
    for (int u = 0; u < U; ++u) {
      x[u] = u < u_n ? _mm256_loadu_ps(v + j + 8 * u) : _mm256_setzero_ps();
      k[u] = _mm256_setzero_si256();
    }
    for (int step = (1 << B) >> 1; step > 0; step >>= 1) {
      const __m256i off = _mm256_set1_epi32(step - 1), inc = _mm256_set1_epi32(step);
      for (int u = 0; u < U; ++u) {
        const __m256 t = _mm256_i32gather_ps(thr, _mm256_add_epi32(k[u], off), 4);
        const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(x[u], t, _CMP_GE_OQ));
        k[u] = _mm256_add_epi32(k[u], _mm256_and_si256(ge, inc));
      }
    }
    for (int u = 0; u < u_n; ++u) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(k32 + 8 * u), k[u]);
      for (int l = 0; l < 8; ++l) idx[j + 8 * u + l] = static_cast<uint8_t>(k32[8 * u + l]);
    }
  }
  return d8;
}
#endif

template <int B>
TQVEC_CLONES_AVX2
void quantize_rows(const float* y, const float* scale, int64_t lo, int64_t hi, int64_t d,
                   const float* thr, float* vbuf, uint8_t* idx_buf, uint8_t* out, int64_t rb) {
  constexpr int K = 1 << B;
#ifdef TQVEC_X86
  const bool avx2 = B > 4 && simd_avx2();
#endif
  for (int64_t i = lo; i < hi; ++i) {
    const float* yi = y + i * d;
    const float s = scale[i];
    for (int64_t j = 0; j < d; ++j) vbuf[j] = yi[j] * s;
    if constexpr (B <= 4) {
      // k = #{t : thr[t] <= v}, as K-1 vectorizable compare-and-add passes.
      for (int64_t j = 0; j < d; ++j) idx_buf[j] = 0;
      for (int t = 0; t < K - 1; ++t) {
        const float th = thr[t];
        for (int64_t j = 0; j < d; ++j) idx_buf[j] += static_cast<uint8_t>(vbuf[j] >= th);
      }
    } else {
      // Same count by a binary search (b steps instead of 2^b - 1 compares)
      int64_t j = 0;
#ifdef TQVEC_X86
      if (avx2) j = search_avx2<B>(vbuf, d, thr, idx_buf);
#endif
      for (; j < d; ++j) idx_buf[j] = static_cast<uint8_t>(search_one<B>(vbuf[j], thr));
    }
    pack_row_fixed<B>(idx_buf, d, out + i * rb);
  }
}

}  // namespace

void centroid_stats(const uint8_t* packed, int64_t n, int64_t d, int b, const float* centroids,
                    const float* y, const float* scale, float* csq, float* dot, int nthreads) {
  const int64_t rb = row_bytes(d, b);
  const int K = 1 << b;
  // Squared centroids once; the sums run in double (the reference's order is not ours, and
  // float64 partial sums make the rounded float32 results agree with it in all but ties).
  std::vector<double> c(static_cast<size_t>(K)), c2(static_cast<size_t>(K));
  for (int k = 0; k < K; ++k) {
    c[k] = centroids[k];
    c2[k] = c[k] * c[k];
  }
  with_bits(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> idx(static_cast<size_t>(d));
      for (int64_t i = lo; i < hi; ++i) {
        unpack_row_fixed<B>(packed + i * rb, d, idx.data());
        double s2 = 0.0;
        for (int64_t j = 0; j < d; ++j) s2 += c2[idx[j]];
        csq[i] = static_cast<float>(s2);
        if (y != nullptr) {
          const float* yi = y + i * d;
          const float si = scale[i];
          double s1 = 0.0;
          // v = y * scale as one float32 multiply: the value the quantizer compared
          for (int64_t j = 0; j < d; ++j) s1 += static_cast<double>(yi[j] * si) * c[idx[j]];
          dot[i] = static_cast<float>(s1);
        }
      }
    });
  });
}

void dequantize_rows(const uint8_t* packed, const float* mult, int64_t n, int64_t d, int b,
                     const float* centroids, float* y) {
  const int64_t rb = row_bytes(d, b);
  with_bits(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    constexpr uint64_t mask = (uint64_t{1} << B) - 1u;
    const int64_t full = d / 8;  // groups of 8 indices: B whole bytes each (LSB-first)
    std::vector<uint8_t> idx(static_cast<size_t>(d));
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* in = packed + i * rb;
      // one float32 multiply per element, as centroids[idx] * mult[:, None] in torch
      const float m = mult[i];
      float* yi = y + i * d;
      for (int64_t g = 0; g < full; ++g) {
        uint64_t v = 0;
        std::memcpy(&v, in + g * B, B);  // little-endian hosts (x86, arm64)
        for (int k = 0; k < 8; ++k) yi[g * 8 + k] = centroids[(v >> (k * B)) & mask] * m;
      }
      if (full * 8 < d) {
        unpack_row_fixed<B>(in, d, idx.data());
        for (int64_t j = full * 8; j < d; ++j) yi[j] = centroids[idx[j]] * m;
      }
    }
  });
}

void pack_bits(const uint8_t* idx, int64_t n, int64_t d, int b, uint8_t* out, int nthreads) {
  const int64_t rb = row_bytes(d, b);
  with_bits(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        std::memset(out + i * rb, 0, static_cast<size_t>(rb));
        pack_row_fixed<B>(idx + i * d, d, out + i * rb);
      }
    });
  });
}

void unpack_bits(const uint8_t* packed, int64_t n, int64_t d, int b, uint8_t* out,
                 int nthreads) {
  const int64_t rb = row_bytes(d, b);
  with_bits(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) unpack_row_fixed<B>(packed + i * rb, d, out + i * d);
    });
  });
}

void quantize_pack(const float* y, const float* scale, int64_t n, int64_t d, const float* thr,
                   int b, uint8_t* out, int nthreads) {
  const int64_t rb = row_bytes(d, b);
  with_bits(b, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    parallel_rows(n, nthreads, [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> buf(static_cast<size_t>(d));
      std::vector<float> vbuf(static_cast<size_t>(d));
      for (int64_t i = lo; i < hi; ++i) std::memset(out + i * rb, 0, static_cast<size_t>(rb));
      quantize_rows<B>(y, scale, lo, hi, d, thr, vbuf.data(), buf.data(), out, rb);
    });
  });
}

}  // namespace tqvec
