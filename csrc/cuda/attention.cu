// Decode attention over compressed keys and values (TurboQuant-mse codes), flash-decoding style.
// Meaning: decode_attention_ref in tqvec/ops/ref.py. For each (batch * KV head) `bh` and each of
// its G query heads q (GQA: G = query heads per KV head), over the stored tokens t in
// [lo[bh], hi[bh]):
//   s_qt = scale * knorm_t * <qr_q, ck[kidx_t]> + qbias_q        (keys never decoded)
//   m_q = max_t s_qt,  l_q = sum_t exp(s_qt - m_q),  acc_q = sum_t exp(s_qt - m_q) vnorm_t cv[vidx_t]
// returned unnormalized, in the rotated domain, so the caller merges them with the exact
// full-precision window in one softmax (log-sum-exp merge) and rotates back once.
//
// Grid (splits, BH); block 256 threads; a block handles tokens [split * per_split, ...) of one bh
// for all G <= 8 queries and writes its partial (m, l, acc); the caller merges the splits.
// Per tile of TR tokens: key and value bytes staged in shared memory (16-byte loads), scores as
// in scan.cu (G_l = 2^g_log2 lanes per key row, queries [q][lane][cpt + 1] in shared memory),
// then an online-softmax update per query (thread q scans the tile: TR exps), then every thread
// accumulates its own coordinates j = tid, tid + 256 (d <= 512) over the tile's tokens.
//
// Dynamic shared memory (bytes; tqvec/ops/cuda.py computes it in this order):
//   q G*G_l*(cpt+1)*4 | ck 256*4 | cv 256*4 | p G*TR*4 | vn TR*4 | alpha G*4 | m G*4 | l G*4 |
//   key tile TR*rbk + 64 | value tile TR*rbv + 64

typedef unsigned char tq_u8;
typedef long long tq_i64;

#define TQA_THREADS 256
#define TQA_G_MAX 8
#define TQA_JPT 2  // coordinates per thread: d <= 512

// Copy nbytes from g to shared memory so that s = base + (g % 16) keeps 16-byte alignment;
// returns s. No read outside [g, g + nbytes).
__device__ __forceinline__ const tq_u8* tqa_stage(tq_u8* base, const tq_u8* g, int nbytes) {
  const int mis = (int)(reinterpret_cast<unsigned long long>(g) & 15);
  tq_u8* s = base + mis;
  const int head = min(nbytes, (16 - mis) & 15);
  const int body = (nbytes - head) >> 4;
  for (int i = threadIdx.x; i < head; i += TQA_THREADS) s[i] = g[i];
  const uint4* gb = reinterpret_cast<const uint4*>(g + head);
  uint4* sb = reinterpret_cast<uint4*>(s + head);
  for (int i = threadIdx.x; i < body; i += TQA_THREADS) sb[i] = __ldg(gb + i);
  for (int i = head + (body << 4) + threadIdx.x; i < nbytes; i += TQA_THREADS) s[i] = g[i];
  return s;
}

__device__ __forceinline__ tq_u8* tqa_align16(tq_u8* p) {
  return p + ((16 - (reinterpret_cast<unsigned long long>(p) & 15)) & 15);
}

extern "C" __global__ void __launch_bounds__(TQA_THREADS)
tq_decode_attention(const float* __restrict__ qr, const float* __restrict__ qbias,
                    const tq_u8* __restrict__ kpacked, const float* __restrict__ knorm,
                    const float* __restrict__ kcent, const tq_u8* __restrict__ vpacked,
                    const float* __restrict__ vnorm, const float* __restrict__ vcent,
                    const int* __restrict__ lo_t, const int* __restrict__ hi_t, int G, int d,
                    int T, int kb, int vb, int g_log2, int per_split, double scale_d,
                    float* __restrict__ out_m, float* __restrict__ out_l,
                    float* __restrict__ out_acc) {
  extern __shared__ __align__(16) unsigned char tqa_smem[];
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float scale = (float)scale_d;
  const int GL = 1 << g_log2;
  const int TR = TQA_THREADS >> g_log2;
  const int rbk = (d * kb + 7) >> 3, rbv = (d * vb + 7) >> 3;
  const int cpt = (((d + GL - 1) >> g_log2) + 7) & ~7;
  const int qpitch = cpt + 1, qstride = qpitch << g_log2;
  const int split = blockIdx.x, nsplit = gridDim.x;
  const tq_i64 bh = blockIdx.y;

  float* q_s = reinterpret_cast<float*>(tqa_smem);
  float* ck_s = q_s + G * qstride;
  float* cv_s = ck_s + 256;
  float* p_s = cv_s + 256;
  float* vn_s = p_s + G * TR;
  float* alpha_s = vn_s + TR;
  float* m_s = alpha_s + G;
  float* l_s = m_s + G;
  tq_u8* ktile = tqa_align16(reinterpret_cast<tq_u8*>(l_s + G));
  tq_u8* vtile = tqa_align16(ktile + TR * rbk + 64);

  for (int i = threadIdx.x; i < G * qstride; i += TQA_THREADS) {
    const int qi = i / qstride, r = i - qi * qstride;
    const int ln = r / qpitch, c = r - ln * qpitch;
    const int j = ln * cpt + c;
    q_s[i] = (c < cpt && j < d) ? qr[(bh * G + qi) * d + j] : 0.0f;
  }
  for (int i = threadIdx.x; i < 256; i += TQA_THREADS) {
    ck_s[i] = i < (1 << kb) ? kcent[i] : 0.0f;
    cv_s[i] = i < (1 << vb) ? vcent[i] : 0.0f;
  }
  for (int i = threadIdx.x; i < G; i += TQA_THREADS) { m_s[i] = NEG_INF; l_s[i] = 0.0f; }
  float acc[TQA_G_MAX][TQA_JPT];
#pragma unroll
  for (int qi = 0; qi < TQA_G_MAX; ++qi)
#pragma unroll
    for (int u = 0; u < TQA_JPT; ++u) acc[qi][u] = 0.0f;
  __syncthreads();

  const int lo = max(lo_t[bh], split * per_split);
  const int hi = min(min(hi_t[bh], T), (split + 1) * per_split);
  const int lane_row = threadIdx.x >> g_log2;
  const int lane = threadIdx.x & (GL - 1);
  const unsigned long long kmask = (1ull << kb) - 1ull;
  const unsigned vmask = (1u << vb) - 1u;

  for (int t0 = lo; t0 < hi; t0 += TR) {
    const int rows = min(TR, hi - t0);
    const tq_u8* ks = tqa_stage(ktile, kpacked + (bh * T + t0) * rbk, rows * rbk);
    const tq_u8* vs = tqa_stage(vtile, vpacked + (bh * T + t0) * rbv, rows * rbv);
    for (int i = threadIdx.x; i < TR; i += TQA_THREADS)
      vn_s[i] = i < rows ? vnorm[bh * T + t0 + i] : 0.0f;
    __syncthreads();

    // -- scores: lane `lane` of key row `lane_row` sums coordinates [j0, j0 + cpt) --
    float dot[TQA_G_MAX];
#pragma unroll
    for (int qi = 0; qi < TQA_G_MAX; ++qi) dot[qi] = 0.0f;
    if (lane_row < rows) {
      const tq_u8* row = ks + lane_row * rbk;
      const int j0 = lane * cpt;
      const int jend = min(j0 + cpt, d);
      const float* ql = q_s + lane * qpitch - j0;
      for (int j = j0; j < jend; j += 8) {
        const tq_u8* src = row + (j >> 3) * kb;
        unsigned long long w = 0;
        for (int t = 0; t < kb; ++t) w |= (unsigned long long)src[t] << (8 * t);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const float cv = ck_s[(w >> (t * kb)) & kmask];
#pragma unroll
          for (int qi = 0; qi < TQA_G_MAX; ++qi)
            if (qi < G) dot[qi] = fmaf(ql[qi * qstride + j + t], cv, dot[qi]);
        }
      }
    }
#pragma unroll
    for (int qi = 0; qi < TQA_G_MAX; ++qi)
      for (int off = GL >> 1; off > 0; off >>= 1)
        dot[qi] += __shfl_xor_sync(0xffffffffu, dot[qi], off);
    if (lane == 0) {
      const bool live = lane_row < rows;
      const float kn = live ? knorm[bh * T + t0 + lane_row] : 0.0f;
#pragma unroll
      for (int qi = 0; qi < TQA_G_MAX; ++qi)
        if (qi < G)
          p_s[qi * TR + lane_row] = live ? fmaf(scale * kn, dot[qi], qbias[bh * G + qi])
                                         : NEG_INF;
    }
    __syncthreads();

    // -- online softmax: thread qi rescans its query's tile scores --
    if ((int)threadIdx.x < G) {
      const int qi = threadIdx.x;
      float* ps = p_s + qi * TR;
      float mt = NEG_INF;
      for (int t = 0; t < rows; ++t) mt = fmaxf(mt, ps[t]);
      const float m_old = m_s[qi];
      const float m_new = fmaxf(m_old, mt);
      float sum = 0.0f;
      for (int t = 0; t < TR; ++t) {
        const float e = (t < rows && m_new > NEG_INF) ? expf(ps[t] - m_new) : 0.0f;
        sum += e;
        ps[t] = e * vn_s[t];  // the weight of value t (its norm folded in)
      }
      const float a = (m_old > NEG_INF) ? expf(m_old - m_new) : 0.0f;
      alpha_s[qi] = a;
      l_s[qi] = l_s[qi] * a + sum;
      m_s[qi] = m_new;
    }
    __syncthreads();

    // -- values: thread owns coordinates j = tid + u * 256 --
#pragma unroll
    for (int u = 0; u < TQA_JPT; ++u) {
      const int j = threadIdx.x + u * TQA_THREADS;
      if (j < d) {
#pragma unroll
        for (int qi = 0; qi < TQA_G_MAX; ++qi)
          if (qi < G) acc[qi][u] *= alpha_s[qi];
        const int bit = j * vb, byte = bit >> 3, sh = bit & 7;
        for (int t = 0; t < rows; ++t) {
          const tq_u8* row = vs + t * rbv;
          unsigned w = row[byte];
          if (sh + vb > 8) w |= (unsigned)row[byte + 1] << 8;
          const float c = cv_s[(w >> sh) & vmask];
#pragma unroll
          for (int qi = 0; qi < TQA_G_MAX; ++qi)
            if (qi < G) acc[qi][u] = fmaf(p_s[qi * TR + t], c, acc[qi][u]);
        }
      }
    }
    __syncthreads();  // the next tile overwrites the staged bytes and p_s
  }

  const tq_i64 o = (bh * nsplit + split) * G;
  for (int qi = threadIdx.x; qi < G; qi += TQA_THREADS) {
    out_m[o + qi] = m_s[qi];
    out_l[o + qi] = l_s[qi];
  }
#pragma unroll
  for (int u = 0; u < TQA_JPT; ++u) {
    const int j = threadIdx.x + u * TQA_THREADS;
    if (j < d) {
#pragma unroll
      for (int qi = 0; qi < TQA_G_MAX; ++qi)
        if (qi < G) out_acc[(o + qi) * d + j] = acc[qi][u];
    }
  }
}
