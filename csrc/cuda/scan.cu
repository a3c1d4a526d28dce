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

// ---------------------------------------------------------------------------------------------
// The same scan on the tensor cores (mma.sync m16n8k16), for D % 32 == 0, 1 <= B <= 4 and
// k <= K <= 32 (compile-time TQS_D, TQS_B, TQS_K; TQS_WARPS warps per block).
//
// Grid (chunks, query tiles of 16). Every warp scores tiles of 16 rows of its block's chunk
// (dealt round-robin) against the tile's 16 queries: scores (16 queries x 8 rows) += Q (16 x 16
// coordinates) . C^T (16 coordinates x 8 rows), C the rows' centroids. A lane's two adjacent
// coordinates of one row are one 2B-bit field of the packed code, looked up in a table of
// centroid pairs. float32 accuracy from fp16 operands by splitting both sides into a high and a
// low fp16 part: q.c ~ qh.ch + qh.cl + ql.ch (the dropped ql.cl is ~2^-22 relative). The caller
// scales each query by a power of two (qscale, exact) so that its largest coordinate lies in
// [0.5, 1]: no query overflows fp16, whatever the data's scale.
// Selection without barriers: each lane keeps, for each of its two queries (rows g and g + 8 of
// the tile), the best K of the rows it scores in registers (an insertion only when a score beats
// its K-th); every lane's list is written out (nq, chunks * warps * 4, K) and the caller takes
// the best k of them. The union of the lists holds the best k of every query (each list holds
// the best K >= k of its own rows).
//
// Dynamic shared memory (bytes; tqvec/ops/cuda.py computes it in this order):
//   pairs (hi, lo) 8 << 2B | Q fragments (hi, lo) 2 * (D/16) * 32 * 16 |
//   per warp: tile 16 * RB + 16
#ifndef TQS_D
#define TQS_D 128
#endif
#ifndef TQS_B
#define TQS_B 4
#endif
#ifndef TQS_K
#define TQS_K 16
#endif
#ifndef TQS_WARPS
#define TQS_WARPS 8
#endif

// Insert (v, i) into the best-first list (lv, li) of length K when v beats its last entry.
template <int K>
__device__ __forceinline__ void tqs_insert(float (&lv)[K], int (&li)[K], float v, int i) {
  if (!(v > lv[K - 1])) return;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const bool take = v > lv[j];
    const float tv = lv[j];
    const int ti = li[j];
    lv[j] = take ? v : tv;
    li[j] = take ? i : ti;
    v = take ? tv : v;
    i = take ? ti : i;
  }
}

template <int D, int B, int K, int W>
__device__ __forceinline__ void tqs_body(const float* __restrict__ qr,
                                         const tq_u8* __restrict__ packed,
                                         const float* __restrict__ cent,
                                         const float* __restrict__ mult,
                                         const float* __restrict__ add,
                                         const float* __restrict__ qscale, int nq, int n,
                                         int rows_per_chunk, float* __restrict__ out_v,
                                         tq_i64* __restrict__ out_i, unsigned char* smem) {
  constexpr int WB = D * B / 32;  // row words
  constexpr int KS = D / 16;
  // Coordinates dealt to the fragments so that a lane reads one contiguous run of a row: lane
  // (g, t) of step ks holds coordinates t * CR + 4 ks + (0, 1) and (2, 3) of row g (as in
  // attention.cu; a dot product allows any permutation).
  constexpr int CR = D / 4, RK = (CR * B + 31) / 32;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int chunk = blockIdx.x, q0 = blockIdx.y * 16;

  uint2* pairs = reinterpret_cast<uint2*>(smem);  // (hi, lo) f16x2 pairs of centroids
  unsigned* qfr = reinterpret_cast<unsigned*>(pairs + (1 << (2 * B)));  // [KS][32][hi 4, lo 4]
  unsigned* tile = qfr + KS * 32 * 8 + warp * (16 * WB + 4);

  for (int i = threadIdx.x; i < (1 << (2 * B)); i += blockDim.x) {
    const float c0 = cent[i & ((1 << B) - 1)], c1 = cent[i >> B];
    const float h0 = tq_f16_round(c0), h1 = tq_f16_round(c1);
    uint2 v;
    v.x = tq_h2(h0, h1);
    v.y = tq_h2(c0 - h0, c1 - h1);
    pairs[i] = v;
  }
  for (int i = threadIdx.x; i < KS * 32; i += blockDim.x) {
    const int ks = i >> 5, ln = i & 31, rg = ln >> 2, c = (ln & 3) * CR + 4 * ks;
    float h[2][4], l[2][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // query rows rg and rg + 8 of the tile
      const int q = q0 + rg + 8 * r;
      const float* src = qr + (tq_i64)q * D;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float x = q < nq ? src[c + u] : 0.0f;
        h[r][u] = tq_f16_round(x);
        l[r][u] = x - h[r][u];
      }
    }
    unsigned* f = qfr + 8 * i;
    f[0] = tq_h2(h[0][0], h[0][1]);
    f[1] = tq_h2(h[1][0], h[1][1]);
    f[2] = tq_h2(h[0][2], h[0][3]);
    f[3] = tq_h2(h[1][2], h[1][3]);
    f[4] = tq_h2(l[0][0], l[0][1]);
    f[5] = tq_h2(l[1][0], l[1][1]);
    f[6] = tq_h2(l[0][2], l[0][3]);
    f[7] = tq_h2(l[1][2], l[1][3]);
  }
  __syncthreads();

  float lv0[K], lv1[K];
  int li0[K], li1[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    lv0[j] = lv1[j] = NEG_INF;
    li0[j] = li1[j] = -1;
  }
  const bool live0 = q0 + g < nq, live1 = q0 + g + 8 < nq;
  const float qs0 = live0 ? qscale[q0 + g] : 0.0f, qs1 = live1 ? qscale[q0 + g + 8] : 0.0f;
  const int start = chunk * rows_per_chunk, end = min(n, start + rows_per_chunk);
  const int iters = (rows_per_chunk + 16 * W - 1) / (16 * W);  // uniform in the grid
  const unsigned* base = reinterpret_cast<const unsigned*>(packed);

  for (int it = 0; it < iters; ++it) {
    const int t0 = start + (it * W + warp) * 16;
    const int valid = max(0, min(16, end - t0));  // rows [t0, t0 + valid) exist
    for (int i = lane; i < 16 * WB; i += 32)
      tile[i] = i < valid * WB ? base[(tq_i64)t0 * WB + i] : 0u;
    float mu[4], ad[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = 2 * tig + (u & 1) + 8 * (u >> 1);
      mu[u] = r < valid ? mult[t0 + r] : 0.0f;  // (score * qscale) * mult + add
      ad[u] = r < valid ? add[t0 + r] : NEG_INF;
    }
    __syncwarp();
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    unsigned run[2][RK];  // this lane's run of rows g and 8 + g
    tq_run<RK>(tile + g * WB, tig * CR * B, run[0]);
    tq_run<RK>(tile + (8 + g) * WB, tig * CR * B, run[1]);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint4 ah = reinterpret_cast<const uint4*>(qfr)[2 * (ks * 32 + lane)];
      const uint4 al = reinterpret_cast<const uint4*>(qfr)[2 * (ks * 32 + lane) + 1];
      const unsigned ahi[4] = {ah.x, ah.y, ah.z, ah.w}, alo[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        const uint2 p0 = pairs[tq_field(run[blk], 4 * ks * B, 2 * B)];
        const uint2 p1 = pairs[tq_field(run[blk], (4 * ks + 2) * B, 2 * B)];
        const unsigned bh[2] = {p0.x, p1.x}, bl[2] = {p0.y, p1.y};
        tq_mma(s[blk], ahi, bh);
        tq_mma(s[blk], ahi, bl);
        tq_mma(s[blk], alo, bh);
      }
    }
    // s[blk][c]: query g, row 8 blk + 2tig + c; s[blk][2 + c]: query g + 8, same row
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int blk = u >> 1, c = u & 1, r = 2 * tig + c + 8 * blk;
      if (live0) tqs_insert<K>(lv0, li0, (s[blk][c] * qs0) * mu[u] + ad[u], t0 + r);
      if (live1) tqs_insert<K>(lv1, li1, (s[blk][2 + c] * qs1) * mu[u] + ad[u], t0 + r);
    }
    __syncwarp();  // the next tile overwrites the staged rows
  }

  const tq_i64 lists = (tq_i64)gridDim.x * W * 4;
  const tq_i64 list = ((tq_i64)chunk * W + warp) * 4 + tig;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (live0) {
      out_v[((q0 + g) * lists + list) * K + j] = lv0[j];
      out_i[((q0 + g) * lists + list) * K + j] = li0[j];
    }
    if (live1) {
      out_v[((q0 + g + 8) * lists + list) * K + j] = lv1[j];
      out_i[((q0 + g + 8) * lists + list) * K + j] = li1[j];
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * TQS_WARPS)
tq_mma_scan(const float* __restrict__ qr, const tq_u8* __restrict__ packed,
            const float* __restrict__ cent, const float* __restrict__ mult,
            const float* __restrict__ add, const float* __restrict__ qscale, int nq, int n,
            int rows_per_chunk, float* __restrict__ out_v, tq_i64* __restrict__ out_i) {
  extern __shared__ __align__(16) unsigned char tq_smem[];
  tqs_body<TQS_D, TQS_B, TQS_K, TQS_WARPS>(qr, packed, cent, mult, add, qscale, nq, n,
                                          rows_per_chunk, out_v, out_i, tq_smem);
}
