// Multi-round randomized Hadamard rotation of the rows of x on the GPU. Meaning:
// hadamard_rotate_ref in tqvec/ops/ref.py (see tqvec.random.HadamardRotation); the result is
// bit-exact with it: the same butterflies in the same order (h = 1, 2, 4, ...; pairs (j, j + h)
// in blocks of 2h), each rounded once (__fadd_rn / __fsub_rn / __fmul_rn, no contraction).
//
//   forward round r: z = x[perm_r] * sign_r; z[:p] = H z[:p] * s; if p < d: z[d-p:] = H z[d-p:] * s
//   inverse: the rounds backwards, each undoing the above (H/sqrt(p) is its own inverse).
//
// One block per row (grid-stride over rows), the row in shared memory (2*d floats, dynamic).
// Inputs: float32, float16 or bfloat16 rows (read raw, converted to float32 on load: no header
// needed); the output is float32. s = float32(1/sqrt(p)) is passed as a double, computed by the
// caller exactly as the reference computes it.


__device__ __forceinline__ float tq_load(const float* p, tq_i64 i) { return p[i]; }

__device__ __forceinline__ float tq_load(const unsigned short* p, tq_i64 i, int is_bf16) {
  const unsigned short h = p[i];
  if (is_bf16) return __uint_as_float(((unsigned)h) << 16);
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else  // host compilation (tests/cuda_emu): the same conversion in integer arithmetic
  const unsigned sign = (unsigned)(h >> 15) << 31, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
  const float sub = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
  return sign ? -sub : sub;
#endif
}

// In-place unnormalized Walsh-Hadamard transform of a[0:p], then a *= s.
__device__ void tq_fwht(float* a, int p, float s) {
  for (int h = 1; h < p; h <<= 1) {
    for (int i = threadIdx.x; i < (p >> 1); i += blockDim.x) {
      const int blk = i / h;
      const int lo = blk * 2 * h + (i - blk * h);
      const float u = a[lo], v = a[lo + h];
      a[lo] = __fadd_rn(u, v);
      a[lo + h] = __fsub_rn(u, v);
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < p; i += blockDim.x) a[i] = __fmul_rn(a[i], s);
  __syncthreads();
}

// z holds the row (float32, shared); runs every round, leaves the result in the returned buffer.
__device__ float* tq_rotate_rounds(float* z, float* tmp, const tq_i64* __restrict__ perms,
                                   const float* __restrict__ signs, int d, int p, int rounds,
                                   int inverse, float s) {
  for (int k = 0; k < rounds; ++k) {
    const int r = inverse ? rounds - 1 - k : k;
    const tq_i64* perm = perms + (tq_i64)r * d;
    const float* sign = signs + (tq_i64)r * d;
    if (!inverse) {
      for (int j = threadIdx.x; j < d; j += blockDim.x)
        tmp[j] = __fmul_rn(z[perm[j]], sign[j]);
      __syncthreads();
      tq_fwht(tmp, p, s);
      if (p < d) tq_fwht(tmp + (d - p), p, s);
    } else {
      if (p < d) tq_fwht(z + (d - p), p, s);
      tq_fwht(z, p, s);
      for (int j = threadIdx.x; j < d; j += blockDim.x)
        tmp[perm[j]] = __fmul_rn(z[j], sign[j]);
      __syncthreads();
    }
    float* t = z; z = tmp; tmp = t;
  }
  return z;
}

template <typename T>
__device__ void tq_hadamard_rows(const T* __restrict__ x, const tq_i64* __restrict__ perms,
                                 const float* __restrict__ signs, float* __restrict__ out, int n,
                                 int d, int p, int rounds, int inverse, double s_d, int is_bf16) {
  extern __shared__ float tq_row[];
  const float s = (float)s_d;
  for (tq_i64 r = blockIdx.x; r < n; r += gridDim.x) {
    float* z = tq_row;
    float* tmp = tq_row + d;
    const T* src = x + r * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      if constexpr (sizeof(T) == 4) z[j] = tq_load(reinterpret_cast<const float*>(src), j);
      else z[j] = tq_load(reinterpret_cast<const unsigned short*>(src), j, is_bf16);
    }
    __syncthreads();
    z = tq_rotate_rounds(z, tmp, perms, signs, d, p, rounds, inverse, s);
    float* dst = out + r * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = z[j];
    __syncthreads();  // the next row reuses the shared buffers
  }
}

extern "C" __global__ void tq_hadamard_f32(const float* __restrict__ x,
                                           const tq_i64* __restrict__ perms,
                                           const float* __restrict__ signs,
                                           float* __restrict__ out, int n, int d, int p,
                                           int rounds, int inverse, double s) {
  tq_hadamard_rows<float>(x, perms, signs, out, n, d, p, rounds, inverse, s, 0);
}

// 16-bit inputs: is_bf16 = 0 for float16, 1 for bfloat16.
extern "C" __global__ void tq_hadamard_h16(const unsigned short* __restrict__ x,
                                           const tq_i64* __restrict__ perms,
                                           const float* __restrict__ signs,
                                           float* __restrict__ out, int n, int d, int p,
                                           int rounds, int inverse, double s, int is_bf16) {
  tq_hadamard_rows<unsigned short>(x, perms, signs, out, n, d, p, rounds, inverse, s, is_bf16);
}
