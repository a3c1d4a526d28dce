// Asymmetric scan of packed scalar codes with a fused per-block top-k. Meaning: lut_scan_ref in
// tqvec/ops/ref.py: score_i = mult_i * <qr, c[idx_i]> + add_i, the best k per query.
//
// Grid (chunks, query groups). A block scans one contiguous chunk of rows for up to QB_MAX
// queries at once (every code byte read once per query group), and keeps, per query, the best k
// of its chunk in shared memory; it writes them to out (nq, chunks, k). The caller merges the
// chunks' candidates (chunks * k per query, a few thousand) with one small top-k. No score
// matrix is ever written to device memory.
//
// Per tile of TR rows: the tile's bytes (contiguous in memory) are copied to shared memory with
// 16-byte loads; G = 2^g_log2 lanes share a row, each summing cpt coordinates (cpt a multiple of
// 8, so a lane's slice starts on a byte: 8 indices = b bytes, gathered into one 64-bit word),
// then a warp shuffle reduces the G partial sums. The caller picks G so a lane's slice is about
// 8 bytes: the lanes of a warp then read nearly consecutive bytes (<= 2-way bank conflicts).
// The queries sit in shared memory as [query][lane][cpt + 1] (the +1 staggers the lanes over
// the banks), zero-padded past d, so the padding contributes exactly 0.
//
// Selection: per query a buffer of 2*kp (kp = pow2 >= k, <= 256): [best kp | queue kp]. Rows
// scoring above the current k-th best are appended to the queue (shared atomics); a full queue is
// merged by a bitonic sort of the 2*kp entries (larger score first, then smaller row), which
// raises the threshold; after the first tiles almost no row passes it, so selection costs little.
//
// Summation order differs from the reference GEMM (fp32 FMAs): scores agree within float
// rounding, not bit for bit; ties may pick different rows.
//
// Dynamic shared memory (bytes; computed by tqvec/ops/cuda.py, same order):
//   queries qb*G*(cpt+1)*4 | centroids 256*4 | scores qb*TR*4 | sel values qb*2kp*4 |
//   sel rows qb*2kp*4 | counters qb*4 | thresholds qb*4 | tile TR*rb + 64 bytes (alignment
//   and the over-read of a row's last 8-index group)

typedef unsigned char tq_u8;
typedef long long tq_i64;

#define TQ_THREADS 256
#define TQ_QB_MAX 8

__device__ __forceinline__ bool tq_better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && (unsigned)ia < (unsigned)ib);  // row -1 (empty) sorts last
}

// Sort v/ix[0:m] (m a power of two) best first.
__device__ void tq_bitonic(float* v, int* ix, int m) {
  for (int size = 2; size <= m; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < (m >> 1); t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1));
        const int hi = lo + stride;
        const bool best_first = (lo & size) == 0;
        const bool swap = best_first ? tq_better(v[hi], ix[hi], v[lo], ix[lo])
                                     : tq_better(v[lo], ix[lo], v[hi], ix[hi]);
        if (swap) {
          const float tv = v[lo]; v[lo] = v[hi]; v[hi] = tv;
          const int ti = ix[lo]; ix[lo] = ix[hi]; ix[hi] = ti;
        }
      }
      __syncthreads();
    }
  }
}

// Merge the queue of query slot qi into its best list; threshold := k-th best.
__device__ void tq_merge(float* sv, int* si, int* cnt, float* thr, int qi, int k, int kp) {
  float* v = sv + qi * 2 * kp;
  int* ix = si + qi * 2 * kp;
  const int used = min(cnt[qi], kp);
  for (int t = threadIdx.x; t < kp; t += blockDim.x)
    if (t >= used) { v[kp + t] = -__int_as_float(0x7f800000); ix[kp + t] = -1; }
  __syncthreads();
  tq_bitonic(v, ix, 2 * kp);
  if (threadIdx.x == 0) {
    cnt[qi] = 0;
    thr[qi] = v[k - 1];
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(TQ_THREADS)
tq_lut_scan(const float* __restrict__ qr, const tq_u8* __restrict__ packed,
            const float* __restrict__ cent, const float* __restrict__ mult,
            const float* __restrict__ add, int nq, int n, int d, int b, int k, int kp, int qb,
            int g_log2, int rows_per_chunk, float* __restrict__ out_v,
            tq_i64* __restrict__ out_i) {
  extern __shared__ __align__(16) unsigned char tq_smem[];
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int G = 1 << g_log2;
  const int TR = TQ_THREADS >> g_log2;             // rows per tile
  const int rb = (d * b + 7) >> 3;                 // bytes per row
  const int cpt = (((d + G - 1) >> g_log2) + 7) & ~7;  // coordinates per lane
  const int qpitch = cpt + 1;                      // floats per (query, lane) in q_s
  const int qstride = qpitch << g_log2;            // floats per query in q_s
  const int nchunks = gridDim.x;
  const int chunk = blockIdx.x;
  const int q0 = blockIdx.y * qb;
  const int nqb = min(qb, nq - q0);                // live queries in this block

  float* q_s = reinterpret_cast<float*>(tq_smem);
  float* c_s = q_s + qb * qstride;
  float* sc = c_s + 256;
  float* sv = sc + qb * TR;
  int* si = reinterpret_cast<int*>(sv + qb * 2 * kp);
  int* cnt = si + qb * 2 * kp;
  float* thr = reinterpret_cast<float*>(cnt + qb);
  tq_u8* tile = reinterpret_cast<tq_u8*>(thr + qb);
  tile += (16 - (reinterpret_cast<unsigned long long>(tile) & 15)) & 15;  // 16-byte aligned

  for (int i = threadIdx.x; i < qb * qstride; i += TQ_THREADS) {
    const int qi = i / qstride, r = i - qi * qstride;
    const int ln = r / qpitch, c = r - ln * qpitch;
    const int j = ln * cpt + c;
    q_s[i] = (qi < nqb && c < cpt && j < d) ? qr[(tq_i64)(q0 + qi) * d + j] : 0.0f;
  }
  for (int i = threadIdx.x; i < 256; i += TQ_THREADS) c_s[i] = i < (1 << b) ? cent[i] : 0.0f;
  for (int i = threadIdx.x; i < qb * 2 * kp; i += TQ_THREADS) { sv[i] = NEG_INF; si[i] = -1; }
  for (int i = threadIdx.x; i < qb; i += TQ_THREADS) { cnt[i] = 0; thr[i] = NEG_INF; }
  __syncthreads();

  const tq_i64 row_lo = (tq_i64)chunk * rows_per_chunk;
  const tq_i64 row_hi = min((tq_i64)n, row_lo + rows_per_chunk);
  const int lane_row = threadIdx.x >> g_log2;
  const int lane = threadIdx.x & (G - 1);
  const unsigned long long bmask = (1ull << b) - 1ull;

  for (tq_i64 t0 = row_lo; t0 < row_hi; t0 += TR) {
    const int rows = (int)min((tq_i64)TR, row_hi - t0);
    // -- stage the tile's bytes: byte head, 16-byte body, byte tail (no read past the rows) --
    const tq_u8* g = packed + t0 * rb;
    const int nbytes = rows * rb;
    const int mis = (int)(reinterpret_cast<unsigned long long>(g) & 15);
    tq_u8* s = tile + mis;  // s and g agree modulo 16
    const int head = min(nbytes, (16 - mis) & 15);
    const int body = (nbytes - head) >> 4;
    for (int i = threadIdx.x; i < head; i += TQ_THREADS) s[i] = g[i];
    const uint4* gb = reinterpret_cast<const uint4*>(g + head);
    uint4* sb = reinterpret_cast<uint4*>(s + head);
    for (int i = threadIdx.x; i < body; i += TQ_THREADS) sb[i] = __ldg(gb + i);
    for (int i = head + (body << 4) + threadIdx.x; i < nbytes; i += TQ_THREADS) s[i] = g[i];
    __syncthreads();

    // -- partial dot products: lane `lane` of row `lane_row` sums coordinates [j0, j0 + cpt) --
    float acc[TQ_QB_MAX];
#pragma unroll
    for (int qi = 0; qi < TQ_QB_MAX; ++qi) acc[qi] = 0.0f;
    if (lane_row < rows) {
      const tq_u8* row = s + lane_row * rb;
      const int j0 = lane * cpt;
      const int jend = min(j0 + cpt, d);
      const float* ql = q_s + lane * qpitch - j0;  // ql[qi * qstride + j] = query qi, coord j
      for (int j = j0; j < jend; j += 8) {
        const tq_u8* src = row + (j >> 3) * b;  // 8 indices = b bytes, LSB first
        unsigned long long w = 0;
        for (int t = 0; t < b; ++t) w |= (unsigned long long)src[t] << (8 * t);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const float cv = c_s[(w >> (t * b)) & bmask];
#pragma unroll
          for (int qi = 0; qi < TQ_QB_MAX; ++qi)
            if (qi < qb) acc[qi] = fmaf(ql[qi * qstride + j + t], cv, acc[qi]);
        }
      }
    }
#pragma unroll
    for (int qi = 0; qi < TQ_QB_MAX; ++qi)
      for (int off = G >> 1; off > 0; off >>= 1)
        acc[qi] += __shfl_xor_sync(0xffffffffu, acc[qi], off);
    if (lane == 0) {
      const bool live = lane_row < rows;
      const tq_i64 r = t0 + lane_row;
      const float m = live ? mult[r] : 0.0f, a = live ? add[r] : NEG_INF;
#pragma unroll
      for (int qi = 0; qi < TQ_QB_MAX; ++qi)
        if (qi < qb) sc[qi * TR + lane_row] = live ? fmaf(m, acc[qi], a) : NEG_INF;
    }
    __syncthreads();

    // -- selection, one query slot at a time (block-uniform control flow) --
    for (int qi = 0; qi < nqb; ++qi) {
      const float v = (int)threadIdx.x < TR ? sc[qi * TR + threadIdx.x] : NEG_INF;
      const int pos = (int)(t0 + threadIdx.x);
      bool pend = v > thr[qi];
      while (__syncthreads_or(pend)) {
        if (pend) {
          const int slot = atomicAdd(&cnt[qi], 1);
          if (slot < kp) {
            sv[qi * 2 * kp + kp + slot] = v;
            si[qi * 2 * kp + kp + slot] = pos;
            pend = false;
          }
        }
        __syncthreads();
        if (cnt[qi] >= kp) {
          tq_merge(sv, si, cnt, thr, qi, k, kp);
          pend = pend && v > thr[qi];
        }
      }
    }
    // (the loop's last __syncthreads_or also orders these reads before the next tile's copy)
  }
  for (int qi = 0; qi < nqb; ++qi) {
    if (cnt[qi] > 0) tq_merge(sv, si, cnt, thr, qi, k, kp);
    for (int t = threadIdx.x; t < k; t += TQ_THREADS) {
      const tq_i64 o = ((tq_i64)(q0 + qi) * nchunks + chunk) * k + t;
      const float v = sv[qi * 2 * kp + t];
      const int ix = si[qi * 2 * kp + t];
      out_v[o] = v;
      out_i[o] = (v > NEG_INF && ix >= 0) ? (tq_i64)ix : -1;
    }
  }
}
