// Decode attention over compressed keys and values (TurboQuant-mse codes), flash-decoding style,
// on the tensor cores. Meaning: decode_attention_ref in tqvec/ops/ref.py. For each (batch * KV
// head) `bh` and each of its G <= 16 query heads q, over the stored tokens t in [lo[bh], hi[bh]):
//   s_qt = scale * knorm_t * <qr_q, ck[kidx_t]> + qbias_q   (keys never decoded to memory)
//   m_q = max_t s_qt, l_q = sum_t exp(s_qt - m_q), acc_q = sum_t exp(s_qt - m_q) vnorm_t cv[vidx_t]
// returned unnormalized, in the rotated domain, so the caller merges them with the exact
// full-precision window in one softmax (log-sum-exp merge) and rotates back once.
//
// Layout of the work: grid (splits, BH), TQA_WARPS warps per block; every warp is one partial
// (its own online softmax over tiles of 16 tokens, tiles dealt round-robin to the block's warps),
// written to out_m / out_l / out_acc[bh][split * TQA_WARPS + warp]; the caller merges partials.
// No block-wide barrier after the prologue: a warp stages its own tile (16 rows of key and value
// codes, coalesced 4-byte loads into its private shared memory) and reads it after __syncwarp.
//
// Per tile, with mma.sync m16n8k16 (fp16 operands, fp32 accumulation):
//   scores  S (16 query rows x 8 tokens) += Q (16 x 16 coordinates) . K^T (16 coordinates x 8
//           tokens), two token blocks per tile; Q's fragments are built once (shared memory), the
//           key fragments come straight from the codes: a lane's two adjacent coordinates of one
//           token are one 2*KB-bit field, looked up in a table of centroid pairs (f16x2);
//   softmax in the base-2 domain per query row (the 4 lanes of a row reduce by shuffles), with
//           the tile's scores scaled by scale * knorm_t and the weights multiplied by vnorm_t;
//   values  O (16 rows x 8 coordinates) += P (16 rows x 16 tokens) . V (16 tokens x 8 coords):
//           P's fragments are the score accumulators' registers (same layout), V's are two tokens'
//           codes of one coordinate, again one pair-table lookup.
// Rows >= G are zero queries (wasted lanes of the 16-row tile, never written out).
//
// Compile-time shape (NVRTC -D options, one variant per (D, KB, VB) and launch shape): D % 32 == 0,
// D <= 256, 1 <= KB, VB <= 4 (a 16-coordinate key field and an 8-coordinate value field fit in
// 64 bits); TQA_WARPS warps per block, TQA_MINB blocks per multiprocessor (a register cap),
// TQA_QREG where Q's fragments live.
//
// Dynamic shared memory (bytes; tqvec/ops/cuda.py computes it in this order):
//   key pairs 4 << 2KB | value pairs 4 << 2VB | Q fragments (D/16) * 32 * 16 |
//   per warp: key tile 16 * RBK + 16 | value tile 16 * RBV + 16

#ifndef TQA_D
#define TQA_D 128
#endif
#ifndef TQA_KB
#define TQA_KB 3
#endif
#ifndef TQA_VB
#define TQA_VB 3
#endif
#ifndef TQA_WARPS
#define TQA_WARPS 8  // warps per block
#endif
#ifndef TQA_MINB
#define TQA_MINB 1  // blocks per multiprocessor the register allocation must allow
#endif
#ifndef TQA_QREG
#define TQA_QREG 0  // 1: Q's fragments held in registers (D <= 128), 0: read from shared memory
#endif

template <int D, int KB, int VB, int W, bool QREG>
__device__ __forceinline__ void tqa_body(
    const float* __restrict__ qr, const float* __restrict__ qbias,
    const tq_u8* __restrict__ kpacked, const float* __restrict__ knorm,
    const float* __restrict__ kcent, const tq_u8* __restrict__ vpacked,
    const float* __restrict__ vnorm, const float* __restrict__ vcent,
    const int* __restrict__ lo_t, const int* __restrict__ hi_t, int G, int T, int per_split,
    double scale_d, float* __restrict__ out_m, float* __restrict__ out_l,
    float* __restrict__ out_acc, unsigned char* smem) {
  constexpr int RBK = D * KB / 8, RBV = D * VB / 8;  // row bytes (multiples of 4)
  constexpr int WK = RBK / 4, WV = RBV / 4;          // row words
  constexpr int KS = D / 16, NT = D / 8;             // k-steps of the scores, value n-tiles
  // Coordinates are dealt to the mma fragments so that every lane reads one contiguous run of
  // each code row (a dot product and the output's order allow any permutation): in the scores,
  // lane (g, t) of step ks holds coordinates t * CR + 4 ks + (0, 1) and (2, 3) of token g, a
  // run of CR coordinates per token; in the values, column g of n-tile nt is coordinate
  // g * NT + nt, a run of NT coordinates per token.
  constexpr int CR = D / 4;
  constexpr int RK = (CR * KB + 31) / 32, RV = (NT * VB + 31) / 32;  // words of a lane's runs
  const float NEG_INF = -__int_as_float(0x7f800000);
  const float LOG2E = 1.4426950408889634f;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates
  const int split = blockIdx.x;
  const tq_i64 bh = blockIdx.y;

  unsigned* kpair = reinterpret_cast<unsigned*>(smem);
  unsigned* vpair = kpair + (1 << (2 * KB));
  unsigned* qfrag = vpair + (1 << (2 * VB));  // [KS][32 lanes][4]
  unsigned* tiles = qfrag + KS * 32 * 4;
  unsigned* ktile = tiles + warp * (16 * (WK + WV) + 8);  // 16 rows of WK words (+ 4 pad)
  unsigned* vtile = ktile + 16 * WK + 4;

  for (int i = threadIdx.x; i < (1 << (2 * KB)); i += blockDim.x)
    kpair[i] = tq_h2(kcent[i & ((1 << KB) - 1)], kcent[i >> KB]);
  for (int i = threadIdx.x; i < (1 << (2 * VB)); i += blockDim.x)
    vpair[i] = tq_h2(vcent[i & ((1 << VB) - 1)], vcent[i >> VB]);
  for (int i = threadIdx.x; i < KS * 32; i += blockDim.x) {
    // lane (rg, t) of step ks: coordinates t * CR + 4 ks + (0, 1 | 2, 3) (see CR)
    const int ks = i >> 5, ln = i & 31, rg = ln >> 2, c = (ln & 3) * CR + 4 * ks;
    float q[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows rg and rg + 8
      const int row = rg + 8 * h;
      const float* src = qr + (bh * G + row) * D;
      const bool ok = row < G;
#pragma unroll
      for (int u = 0; u < 4; ++u) q[h][u] = ok ? src[c + u] : 0.0f;
    }
    qfrag[4 * i + 0] = tq_h2(q[0][0], q[0][1]);
    qfrag[4 * i + 1] = tq_h2(q[1][0], q[1][1]);
    qfrag[4 * i + 2] = tq_h2(q[0][2], q[0][3]);
    qfrag[4 * i + 3] = tq_h2(q[1][2], q[1][3]);
  }
  __syncthreads();

  // Base-2 softmax: s2 = dot * (scale * log2e * knorm_t) + qbias * log2e.
  const float sc2 = (float)scale_d * LOG2E;
  const float bias0 = g < G ? qbias[bh * G + g] * LOG2E : 0.0f;
  const float bias1 = g + 8 < G ? qbias[bh * G + g + 8] * LOG2E : 0.0f;
  const bool two_halves = G > 8;  // rows g + 8 hold queries
  // Q's fragments: in registers (QREG, D <= 128: 4 D / 16 registers), else read from shared
  // memory at each use (fewer registers, more shared-memory traffic)
  constexpr bool QINREG = QREG && KS <= 8;
  constexpr int QR = QINREG ? KS : 1;
  unsigned qreg[QR][4];
#pragma unroll
  for (int ks = 0; ks < QR; ++ks) {
    const uint4 qa = reinterpret_cast<const uint4*>(qfrag)[ks * 32 + lane];
    qreg[ks][0] = qa.x;
    qreg[ks][1] = qa.y;
    qreg[ks][2] = qa.z;
    qreg[ks][3] = qa.w;
  }
  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  const int lo = max(lo_t[bh], split * per_split);
  const int hi = min(min(hi_t[bh], T), (split + 1) * per_split);
  const int iters = (per_split + 16 * W - 1) / (16 * W);  // uniform in the grid
  const unsigned* kbase = reinterpret_cast<const unsigned*>(kpacked + bh * T * RBK);
  const unsigned* vbase = reinterpret_cast<const unsigned*>(vpacked + bh * T * RBV);

  for (int it = 0; it < iters; ++it) {
    const int t0 = split * per_split + (it * W + warp) * 16;
    // -- stage the tile's rows [t0, t0 + 16) that lie in [lo, hi); zeros elsewhere --
    const int r0 = max(lo, t0), r1 = min(hi, t0 + 16);
    const int wlo = r0 < r1 ? (r0 - t0) : 16, whi = r0 < r1 ? (r1 - t0) : 16;
    for (int i = lane; i < 16 * WK; i += 32) {
      const int r = i / WK;
      ktile[i] = (r >= wlo && r < whi) ? kbase[(tq_i64)t0 * WK + i] : 0u;
    }
    for (int i = lane; i < 16 * WV; i += 32) {
      const int r = i / WV;
      vtile[i] = (r >= wlo && r < whi) ? vbase[(tq_i64)t0 * WV + i] : 0u;
    }
    // this lane's four tokens: 2tig, 2tig + 1 (first block), 8 + 2tig, 9 + 2tig (second)
    float kn[4], vn[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int r = 2 * tig + (u & 1) + 8 * (u >> 1);
      const bool live = r >= wlo && r < whi;
      kn[u] = live ? knorm[bh * T + t0 + r] * sc2 : 0.0f;
      vn[u] = live ? vnorm[bh * T + t0 + r] : 0.0f;
    }
    __syncwarp();

    // -- scores: two blocks of 8 tokens (token g of the block is this lane's B column) --
    float s[2][4];
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      s[blk][0] = s[blk][1] = s[blk][2] = s[blk][3] = 0.0f;
      unsigned run[RK];
      tq_run<RK>(ktile + (8 * blk + g) * WK, tig * CR * KB, run);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const unsigned b[2] = {kpair[tq_field(run, 4 * ks * KB, 2 * KB)],
                               kpair[tq_field(run, (4 * ks + 2) * KB, 2 * KB)]};
        if (QINREG) {
          tq_mma(s[blk], qreg[QINREG ? ks : 0], b);
        } else {
          const uint4 qa = reinterpret_cast<const uint4*>(qfrag)[ks * 32 + lane];
          const unsigned a[4] = {qa.x, qa.y, qa.z, qa.w};
          tq_mma(s[blk], a, b);
        }
      }
    }
    // s[blk][0..1]: row g, tokens 8 blk + 2tig (+1); s[blk][2..3]: row g + 8, same tokens.
    float p0[4], p1[4];  // rows g and g + 8, tokens 2tig, 2tig + 1, 8 + 2tig, 9 + 2tig
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int blk = u >> 1, c = u & 1;
      const int r = 2 * tig + c + 8 * blk;
      const bool live = r >= wlo && r < whi;
      p0[u] = live ? fmaf(s[blk][c], kn[u], bias0) : NEG_INF;
      p1[u] = live ? fmaf(s[blk][2 + c], kn[u], bias1) : NEG_INF;
    }
    float t0max = fmaxf(fmaxf(p0[0], p0[1]), fmaxf(p0[2], p0[3]));
    float t1max = fmaxf(fmaxf(p1[0], p1[1]), fmaxf(p1[2], p1[3]));
    t0max = fmaxf(t0max, __shfl_xor_sync(0xffffffffu, t0max, 1));
    t0max = fmaxf(t0max, __shfl_xor_sync(0xffffffffu, t0max, 2));
    t1max = fmaxf(t1max, __shfl_xor_sync(0xffffffffu, t1max, 1));
    t1max = fmaxf(t1max, __shfl_xor_sync(0xffffffffu, t1max, 2));
    const float n0 = fmaxf(m0, t0max), n1 = fmaxf(m1, t1max);
    // a row that has seen no token keeps m = -inf: its weights are 0, its rescale 1
    const float a0 = n0 == NEG_INF ? 1.0f : exp2f(m0 - n0);
    const float a1 = n1 == NEG_INF ? 1.0f : exp2f(m1 - n1);
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      p0[u] = n0 == NEG_INF ? 0.0f : exp2f(p0[u] - n0);
      p1[u] = (two_halves && n1 != NEG_INF) ? exp2f(p1[u] - n1) : 0.0f;
      sum0 += p0[u];
      sum1 += p1[u];
    }
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
    m0 = n0;
    m1 = n1;
    // P (rows g, g + 8; tokens 2tig, 2tig + 1 | 8 + 2tig, 9 + 2tig) with vnorm folded in
    const unsigned pa[4] = {tq_h2(p0[0] * vn[0], p0[1] * vn[1]),
                            tq_h2(p1[0] * vn[0], p1[1] * vn[1]),
                            tq_h2(p0[2] * vn[2], p0[3] * vn[3]),
                            tq_h2(p1[2] * vn[2], p1[3] * vn[3])};

    // -- values: coordinate g * NT + nt of tokens 2tig, 2tig + 1 and 8 + 2tig, 9 + 2tig --
    if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {  // a new max somewhere: rescale
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[nt][0] *= a0;
        o[nt][1] *= a0;
        o[nt][2] *= a1;
        o[nt][3] *= a1;
      }
    }
    unsigned ra[RV], rb[RV], rc[RV], rd[RV];
    const unsigned* va = vtile + (2 * tig) * WV;
    tq_run<RV>(va, g * NT * VB, ra);
    tq_run<RV>(va + WV, g * NT * VB, rb);
    tq_run<RV>(va + 8 * WV, g * NT * VB, rc);
    tq_run<RV>(va + 9 * WV, g * NT * VB, rd);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned b[2] = {
          vpair[tq_field(ra, nt * VB, VB) | (tq_field(rb, nt * VB, VB) << VB)],
          vpair[tq_field(rc, nt * VB, VB) | (tq_field(rd, nt * VB, VB) << VB)]};
      tq_mma(o[nt], pa, b);
    }
    __syncwarp();  // the next tile overwrites the staged rows
  }

  // -- this warp's partial: l summed over the row's 4 lanes; m back in natural units --
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float LN2 = 0.6931471805599453f;
  const tq_i64 part = (bh * gridDim.x + split) * W + warp;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    if (row < G) {
      const tq_i64 o_row = part * G + row;
      if (tig == 0) {
        const float m = h ? m1 : m0;
        out_m[o_row] = m == NEG_INF ? NEG_INF : m * LN2;
        out_l[o_row] = h ? l1 : l0;
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {  // columns 2tig, 2tig + 1: coordinates (2tig + c) NT + nt
        out_acc[o_row * D + 2 * tig * NT + nt] = o[nt][2 * h];
        out_acc[o_row * D + (2 * tig + 1) * NT + nt] = o[nt][2 * h + 1];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(32 * TQA_WARPS, TQA_MINB)
tq_decode_attention(const float* __restrict__ qr, const float* __restrict__ qbias,
                    const tq_u8* __restrict__ kpacked, const float* __restrict__ knorm,
                    const float* __restrict__ kcent, const tq_u8* __restrict__ vpacked,
                    const float* __restrict__ vnorm, const float* __restrict__ vcent,
                    const int* __restrict__ lo_t, const int* __restrict__ hi_t, int G, int T,
                    int per_split, double scale, float* __restrict__ out_m,
                    float* __restrict__ out_l, float* __restrict__ out_acc) {
  extern __shared__ __align__(16) unsigned char tqa_smem[];
  tqa_body<TQA_D, TQA_KB, TQA_VB, TQA_WARPS, TQA_QREG != 0>(qr, qbias, kpacked, knorm, kcent, vpacked, vnorm,
                                             vcent, lo_t, hi_t, G, T, per_split, scale, out_m,
                                             out_l, out_acc, tqa_smem);
}
