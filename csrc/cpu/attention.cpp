// Decode attention over TurboQuant-mse key and value codes on the CPU (the meaning is
// decode_attention_ref in tqvec/ops/ref.py; csrc/cuda/attention.cu is the GPU version). Layouts:
//   qr      (BH, G, d)        float32  rotated queries, G query rows per KV head
//   qbias   (BH, G)           float32  added to every score of its row
//   kpacked (BH, T, rbk)      uint8    key codes, rbk = ceil(d kb / 8) (kernels.h bit order)
//   vpacked (BH, T, rbv)      uint8    value codes
//   knorm, vnorm (BH, T)      float32
//   kcent (2^kb), vcent (2^vb) float32
//   lo, hi (BH)               int32    tokens [lo, hi) count
//   m, l (BH, G), acc (BH, G, d) float32: max score, sum of exp(s - m), sum of exp(s - m) times
//   the value (rotated domain, unnormalized); m = -inf, l = 0, acc = 0 for an empty range.
// Each KV head's tokens split into parts (threads take parts, not only heads); per part the key
// rows scored for the G query rows (with AVX2 and b <= 4: eight indices per step, shifted into
// their lanes and looked up in the centroids by one vpermps - two and a blend at b = 4 -, eight
// tokens' dot lanes reduced together), the softmax of each row (exp_softmax: one polynomial
// exp for both paths, 8 lanes at a time with AVX2), then each value row decoded once and added
// to all G rows; the parts' softmax states merged per head. The AVX2 and portable paths do the
// same float operations in the same order (same bits); scores are summed in another order than
// the reference's GEMM and exp is not libm's: equal within float rounding.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "arch.h"
#include "attention_rows.h"
#include "kernels.h"
#include "parallel.h"
#include "rescore_codes.h"

namespace tqvec {
namespace {

using attn::dot16;
using attn::RowOps;

// One code segment's flash-decoding inputs and softmax-state outputs (decode_attention's
// arguments): qr, qbias (bh, g) rows; key and value codes (bh, t, *) with their float32
// multipliers (bh, t); tokens [lo[h], hi[h]) count; m, l (bh, g), acc (bh, g, d).
struct StateArgs {
  const float* qr;
  const float* qbias;
  const uint8_t* kpacked;
  const float* knorm;
  const float* kcent;
  int kb;
  const uint8_t* vpacked;
  const float* vnorm;
  const float* vcent;
  int vb;
  int64_t t;
  const int32_t* lo;
  const int32_t* hi;
  float* m;
  float* l;
  float* acc;
};

// The softmax states of several code segments in one run of the workers (units: every
// segment's heads, each in P parts - flash-decoding's split, so that a few KV heads still keep
// every thread busy); each part's state merged per head at the end.
void softmax_states(const StateArgs* segs, int nseg, int64_t bh, int64_t g, int64_t d,
                    float scale, int nthreads) {
  constexpr int64_t kMinPart = 512;  // tokens per part below which a split costs more than it saves
  // A second thread only for work worth waking it: a parked worker is slow to start in a
  // virtual machine (futex wake of a halted vCPU, or one that torch's OpenMP threads spin on),
  // about as slow as a 1k-token head of 4 x 256 query coordinates (docs/kernel-costs.md).
  // kMinWork: visible tokens x query rows x d per thread (about twice that work).
  constexpr int64_t kMinWork = int64_t{1} << 21;
  int64_t work = 0;
  for (int s = 0; s < nseg; ++s)
    for (int64_t h = 0; h < bh; ++h) {
      const int64_t a = std::clamp<int64_t>(segs[s].lo[h], 0, segs[s].t);
      work += std::clamp<int64_t>(segs[s].hi[h], a, segs[s].t) - a;
    }
  work *= g * d;
  const int64_t workers0 = std::clamp<int64_t>(work / kMinWork, 1, std::max(1, nthreads));
  std::vector<int64_t> parts(static_cast<size_t>(nseg)), first(static_cast<size_t>(nseg) + 1, 0);
  for (int s = 0; s < nseg; ++s) {
    parts[s] = std::clamp<int64_t>((4 * workers0 + bh - 1) / bh, 1,
                                   std::max<int64_t>(1, segs[s].t / kMinPart));  // t bounds every head's count
    first[s + 1] = first[s] + bh * parts[s];
  }
  const int64_t units = first[nseg];
  const int64_t workers = std::min(workers0, units);
  std::vector<float> pm(static_cast<size_t>(units * g)), pl(static_cast<size_t>(units * g));
  std::vector<float> pacc(static_cast<size_t>(units * g * d));
  std::atomic<int64_t> next{0};
  const RowOps& ops = attn::row_ops();
  run_workers(workers, [&](int64_t) {
    std::vector<float> scores, wgt, krow(static_cast<size_t>(d)), vrow;
    for (int64_t u; (u = next.fetch_add(1)) < units;) {
      int s = 0;
      while (u >= first[s + 1]) ++s;
      const StateArgs& S = segs[s];
      const int64_t P = parts[s], t = S.t;
      const int64_t rbk = (d * S.kb + 7) / 8, rbv = (d * S.vb + 7) / 8;
      const int64_t h = (u - first[s]) / P, part = (u - first[s]) % P;
      const int64_t a0 = std::clamp<int64_t>(S.lo[h], 0, t),
                    b0 = std::clamp<int64_t>(S.hi[h], a0, t);
      const int64_t per = (b0 - a0 + P - 1) / P;
      const int64_t a = std::min(b0, a0 + part * per), b = std::min(b0, a + per);
      const int64_t n = b - a;
      float* mh = pm.data() + u * g;
      float* lh = pl.data() + u * g;
      float* acch = pacc.data() + u * g * d;
      std::fill(acch, acch + g * d, 0.0f);
      if (n == 0) {
        std::fill(mh, mh + g, -std::numeric_limits<float>::infinity());
        std::fill(lh, lh + g, 0.0f);
        continue;
      }
      scores.resize(static_cast<size_t>(g * n));
      // each key decoded once and scored for the g query rows
      ops.dots(S.qr + h * g * d, g, S.kpacked + (h * t + a) * rbk, rbk, n, d, S.kb, S.kcent,
               krow.data(), scores.data());
      const float* knh = S.knorm + h * t + a;
      for (int64_t r = 0; r < g; ++r) {
        float* sr = scores.data() + r * n;
        const float qb = S.qbias[h * g + r];
        for (int64_t i = 0; i < n; ++i) sr[i] = scale * (knh[i] * sr[i]) + qb;
      }
      ops.softmax(scores.data(), g, n, mh, lh);
      const uint8_t* vh = S.vpacked + h * t * rbv;
      const float* vnh = S.vnorm + h * t;
      wgt.resize(static_cast<size_t>(n * g));  // (n, g): each token's weights
      for (int64_t i = 0; i < n; ++i)
        for (int64_t r = 0; r < g; ++r)
          wgt[static_cast<size_t>(i * g + r)] =
              scores[static_cast<size_t>(r * n + i)] * vnh[a + i];
      ops.add(wgt.data(), n, g, vh + a * rbv, rbv, d, S.vb, S.vcent, vrow, acch);
    }
  });
  // the parts of each head merged: m = max m_p, l = sum l_p e^(m_p - m), acc likewise
  for (int s = 0; s < nseg; ++s) {
    const StateArgs& S = segs[s];
    const int64_t P = parts[s];
    for (int64_t h = 0; h < bh; ++h)
      for (int64_t r = 0; r < g; ++r) {
        const size_t base = static_cast<size_t>(first[s] + h * P);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < P; ++p) mx = std::max(mx, pm[(base + p) * g + r]);
        float* out = S.acc + (h * g + r) * d;
        std::fill(out, out + d, 0.0f);
        float sum = 0.0f;
        for (int64_t p = 0; p < P; ++p) {
          const size_t at = (base + p) * g + r;
          const float lp = pl[at];
          if (lp == 0.0f) continue;
          const float w = P == 1 ? 1.0f : std::exp(pm[at] - mx);
          sum += w * lp;
          const float* src = pacc.data() + at * d;
          for (int64_t j = 0; j < d; ++j) out[j] += w * src[j];
        }
        S.m[h * g + r] = mx;
        S.l[h * g + r] = sum;
      }
  }
}

// IEEE half -> float, exactly (subnormals, infinities and NaN included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element i of a full-precision row buffer as float32 (kernels.h KVExact dtypes).
inline float element(const void* x, int dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dtype == kBF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  return half_to_float(h);
}

// half -> float of n values, exactly (half_to_float's values).
void halves_to_floats(const uint16_t* h, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
}

#ifdef TQVEC_X86
// The same with F16C: its conversion is exact too, 8 values per instruction.
__attribute__((target("avx2,f16c"))) void halves_to_floats_f16c(const uint16_t* h, int64_t n,
                                                                float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}
#endif

// A side's per-token multipliers of tokens [lo, hi) of every head, as float32 (bh, t).
void side_norms(const KVCodeSide& side, int64_t bh, int64_t t, int64_t lo, int64_t hi,
                std::vector<float>& out) {
  out.resize(static_cast<size_t>(bh * t));
  auto convert = halves_to_floats;
#ifdef TQVEC_X86
  if (simd_f16c()) convert = halves_to_floats_f16c;
#endif
  for (int64_t h = 0; h < bh; ++h) {
    float* o = out.data() + h * t;
    if (side.norm8) {
      for (int64_t i = lo; i < hi; ++i) o[i] = side.norm_table[side.norm8[h * t + i]];
    } else {
      convert(side.norm16 + h * t + lo, hi - lo, o + lo);
    }
  }
}


}  // namespace

void decode_attention(const float* qr, const float* qbias, int64_t bh, int64_t g, int64_t d,
                      const uint8_t* kpacked, const float* knorm, const float* kcent, int kb,
                      const uint8_t* vpacked, const float* vnorm, const float* vcent, int vb,
                      int64_t t, const int32_t* lo, const int32_t* hi, float scale, float* m,
                      float* l, float* acc, int nthreads) {
  const StateArgs s{qr, qbias, kpacked, knorm, kcent, kb, vpacked, vnorm, vcent, vb,
                    t, lo, hi, m, l, acc};
  softmax_states(&s, 1, bh, g, d, scale, nthreads);
}

void attention_step(const float* q, int64_t bh, int64_t heads, int64_t g, int64_t d,
                    float scale, const KVCodeSegment* segs, int nseg, const KVExact* exact,
                    int nexact, float* out, int nthreads) {
  const int64_t rows = bh * g;
  const size_t nrd = static_cast<size_t>(rows * d), nr = static_cast<size_t>(rows);
  std::vector<std::vector<float>> qr(nseg), qbias(nseg), knorm(nseg), vnorm(nseg), m(nseg),
      l(nseg), acc(nseg);
  std::vector<std::vector<int32_t>> lo(nseg), hi(nseg);
  std::vector<StateArgs> states(static_cast<size_t>(nseg));
  std::vector<float> qk(nrd);
  for (int s = 0; s < nseg; ++s) {
    const KVCodeSegment& S = segs[s];
    const KVCodeSide& K = S.key;
    // <q, k> = <q, mu> + <q sc, (k - mu) / sc>: the codes hold (k - mu) / sc
    qbias[s].assign(nr, 0.0f);
    for (int64_t i = 0; i < rows; ++i) {
      const float* qi = q + i * d;
      const int64_t head = (i / g) % heads;
      float* qki = qk.data() + i * d;
      if (K.sc == nullptr) {
        std::copy(qi, qi + d, qki);
        continue;
      }
      const float* sc = K.sc + head * d;
      const float* mu = K.mu + head * d;
      float b = 0.0f;
      for (int64_t j = 0; j < d; ++j) {
        qki[j] = qi[j] * sc[j];
        b += qi[j] * mu[j];
      }
      qbias[s][static_cast<size_t>(i)] = scale * b;
    }
    qr[s].resize(nrd);
    hadamard_rotate(qk.data(), rows, d, K.rot.perms, K.rot.signs, K.rot.rounds, K.rot.p, false,
                    qr[s].data(), 1);
    side_norms(K, bh, S.t, S.lo, S.hi, knorm[s]);
    side_norms(S.value, bh, S.t, S.lo, S.hi, vnorm[s]);
    lo[s].assign(static_cast<size_t>(bh), static_cast<int32_t>(S.lo));
    hi[s].assign(static_cast<size_t>(bh), static_cast<int32_t>(S.hi));
    m[s].resize(nr);
    l[s].resize(nr);
    acc[s].resize(nrd);
    states[s] = StateArgs{qr[s].data(), qbias[s].data(), K.packed, knorm[s].data(), K.cent,
                          K.b, S.value.packed, vnorm[s].data(), S.value.cent, S.value.b,
                          S.t, lo[s].data(), hi[s].data(), m[s].data(), l[s].data(),
                          acc[s].data()};
  }
  softmax_states(states.data(), nseg, bh, g, d, scale, nthreads);
  // each segment's value sums back from its rotated domain: sum_t p_t (sc y_t + mu)
  for (int s = 0; s < nseg; ++s) {
    const KVCodeSide& V = segs[s].value;
    hadamard_rotate(acc[s].data(), rows, d, V.rot.perms, V.rot.signs, V.rot.rounds, V.rot.p,
                    true, qk.data(), 1);
    for (int64_t i = 0; i < rows; ++i) {
      float* a = acc[s].data() + i * d;
      const float* y = qk.data() + i * d;
      if (V.sc == nullptr) {
        std::copy(y, y + d, a);
        continue;
      }
      const int64_t head = (i / g) % heads;
      const float* sc = V.sc + head * d;
      const float* mu = V.mu + head * d;
      const float li = l[s][static_cast<size_t>(i)];
      for (int64_t j = 0; j < d; ++j) a[j] = y[j] * sc[j] + li * mu[j];
    }
  }
  // one softmax over the code segments' states and the exact segments' scores; each head's
  // full-precision rows converted to float32 once for its g query rows
  int64_t nx = 0;
  for (int e = 0; e < nexact; ++e) nx += exact[e].n;
  std::vector<float> xk(static_cast<size_t>(nx * d)), xv(static_cast<size_t>(nx * d)),
      xs(static_cast<size_t>(nx));
  for (int64_t h = 0; h < bh; ++h) {
    int64_t at = 0;
    for (int e = 0; e < nexact; ++e) {
      const KVExact& E = exact[e];
      for (int64_t j = 0; j < E.n * d; ++j, ++at) {
        xk[static_cast<size_t>(at)] = element(E.k, E.dtype, h * E.n * d + j);
        xv[static_cast<size_t>(at)] = element(E.v, E.dtype, h * E.n * d + j);
      }
    }
    for (int64_t r = 0; r < g; ++r) {
      const int64_t i = h * g + r;
      const float* qi = q + i * d;
      float top = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < nseg; ++s) top = std::max(top, m[s][static_cast<size_t>(i)]);
      for (int64_t t = 0; t < nx; ++t) {
        xs[static_cast<size_t>(t)] = dot16(qi, xk.data() + t * d, d) * scale;
        top = std::max(top, xs[static_cast<size_t>(t)]);
      }
      const float ref = std::isfinite(top) ? top : 0.0f;
      float* o = out + i * d;
      std::fill(o, o + d, 0.0f);
      float total = 0.0f;
      for (int s = 0; s < nseg; ++s) {
        const float w = std::exp(m[s][static_cast<size_t>(i)] - ref);
        total += l[s][static_cast<size_t>(i)] * w;
        const float* a = acc[s].data() + i * d;
        for (int64_t j = 0; j < d; ++j) o[j] += a[j] * w;
      }
      for (int64_t t = 0; t < nx; ++t) {
        const float p = std::exp(xs[static_cast<size_t>(t)] - ref);
        total += p;
        const float* vt = xv.data() + t * d;
        for (int64_t j = 0; j < d; ++j) o[j] += p * vt[j];
      }
      // a row with no visible key gives 0
      if (total > 0.0f) {
        for (int64_t j = 0; j < d; ++j) o[j] /= total;
      } else {
        std::fill(o, o + d, 0.0f);
      }
    }
  }
}

}  // namespace tqvec
