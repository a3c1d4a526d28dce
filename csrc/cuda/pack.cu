// Bit packing and scalar quantization on the GPU. Meaning: pack_bits_ref, unpack_bits_ref and
// quantize_pack_ref in tqvec/ops/ref.py; results are bit-exact with them.
//
// Layout: a row of d indices of b bits (1 <= b <= 8) is an LSB-first bit stream of
// rb = ceil(d*b/8) bytes: index j occupies stream bits [j*b, (j+1)*b), stream bit t is bit t % 8
// of byte t / 8, trailing pad bits are 0.
//
// Header-free (compiled at run time by NVRTC; see tqvec/ops/cuda.py). Sizes come as int (the
// launcher passes Python ints as 32-bit C ints); offsets are computed in 64 bits. One thread per
// output element, grid-stride loops, so any grid size is correct.


// idx (n, d) uint8 -> out (n, rb) uint8. One thread per output byte: gathers its 8 stream bits.
extern "C" __global__ void tq_pack_bits(const tq_u8* __restrict__ idx, tq_u8* __restrict__ out,
                                        int n, int d, int b) {
  const int rb = (d * b + 7) >> 3;
  const tq_i64 total = (tq_i64)n * rb;
  const tq_i64 step = (tq_i64)gridDim.x * blockDim.x;
  for (tq_i64 t = (tq_i64)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
    const tq_i64 r = t / rb;
    const int p = (int)(t - r * rb);
    const tq_u8* row = idx + r * d;
    unsigned v = 0;
    for (int s = 0; s < 8; ++s) {
      const int bit = p * 8 + s;
      const int j = bit / b;
      if (j >= d) break;
      v |= ((unsigned)(row[j] >> (bit - j * b)) & 1u) << s;
    }
    out[t] = (tq_u8)v;
  }
}

// packed (n, rb) uint8 -> idx (n, d) uint8. One thread per index: an index spans <= 2 bytes.
extern "C" __global__ void tq_unpack_bits(const tq_u8* __restrict__ packed,
                                          tq_u8* __restrict__ idx, int n, int d, int b) {
  const int rb = (d * b + 7) >> 3;
  const tq_i64 total = (tq_i64)n * d;
  const tq_i64 step = (tq_i64)gridDim.x * blockDim.x;
  const unsigned mask = (1u << b) - 1u;
  for (tq_i64 t = (tq_i64)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
    const tq_i64 r = t / d;
    const int j = (int)(t - r * d);
    const tq_u8* row = packed + r * rb;
    const int bit = j * b;
    const int byte = bit >> 3, sh = bit & 7;
    unsigned w = row[byte];
    if (sh + b > 8) w |= (unsigned)row[byte + 1] << 8;
    idx[t] = (tq_u8)((w >> sh) & mask);
  }
}

// Number of thresholds <= v (torch.searchsorted(..., right=True)) over nthr ascending values.
__device__ __forceinline__ unsigned tq_bucket(const float* thr, int nthr, float v) {
  int lo = 0, hi = nthr;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (thr[mid] <= v) lo = mid + 1; else hi = mid;
  }
  return (unsigned)lo;
}

// y (n, d) float32, scale (n,) float32, thr (nthr,) ascending float32 -> out (n, rb) uint8:
// index_j = #{t : thr[t] <= y_j * scale} packed to b bits. The product is rounded once
// (__fmul_rn), exactly as the reference's float32 multiply. One thread per output byte; an index
// that straddles two bytes is computed by both of their threads (same value).
// Dynamic shared memory: nthr floats.
extern "C" __global__ void tq_quantize_pack(const float* __restrict__ y,
                                            const float* __restrict__ scale,
                                            const float* __restrict__ thr, int nthr,
                                            tq_u8* __restrict__ out, int n, int d, int b) {
  extern __shared__ float thr_s[];
  for (int i = threadIdx.x; i < nthr; i += blockDim.x) thr_s[i] = thr[i];
  __syncthreads();
  const int rb = (d * b + 7) >> 3;
  const tq_i64 total = (tq_i64)n * rb;
  const tq_i64 step = (tq_i64)gridDim.x * blockDim.x;
  for (tq_i64 t = (tq_i64)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
    const tq_i64 r = t / rb;
    const int p = (int)(t - r * rb);
    const float* row = y + r * d;
    const float sc = scale[r];
    unsigned v = 0, q = 0;
    int last = -1;
    for (int s = 0; s < 8; ++s) {
      const int bit = p * 8 + s;
      const int j = bit / b;
      if (j >= d) break;
      if (j != last) {
        q = tq_bucket(thr_s, nthr, __fmul_rn(row[j], sc));
        last = j;
      }
      v |= ((q >> (bit - j * b)) & 1u) << s;
    }
    out[t] = (tq_u8)v;
  }
}
