// The CPU kernels without Python: deterministic inputs through every public scan, re-score and
// rotation of ../../csrc/cpu/kernels.h, each output written as one line "name hex-bytes". The
// vector path is the process's (TQVEC_SIMD), so two runs on one machine under different paths
// must print the same lines - and a run under user-mode emulation of another architecture
// (tests/test_arch.py: aarch64 and its NEON path under qemu) the same lines as its scalar run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/cpu/kernels.h"

namespace {

// splitmix64: the same numbers on every platform and standard library
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) / 16777216.0f; }  // [0, 1)
  float normal() {  // the sum of 4 uniforms, centred: smooth enough for scores with ties rare
    return (uniform() + uniform() + uniform() + uniform() - 2.0f) * 1.7f;
  }
  int64_t below(int64_t m) { return static_cast<int64_t>(next() % static_cast<uint64_t>(m)); }
};

template <class T>
void emit(const std::string& name, const std::vector<T>& v) {
  std::printf("%s ", name.c_str());
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(T); ++i) std::printf("%02x", p[i]);
  std::printf("\n");
}

std::vector<float> normals(Rng& r, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = r.normal();
  return v;
}

struct Codes {
  int64_t n, d;
  int b;
  std::vector<uint8_t> packed, blocked;
  std::vector<float> c;
};

Codes make_codes(Rng& r, int64_t n, int64_t d, int b, int nthreads) {
  Codes k{n, d, b, {}, {}, {}};
  std::vector<uint8_t> idx(static_cast<size_t>(n * d));
  for (auto& x : idx) x = static_cast<uint8_t>(r.below(int64_t{1} << b));
  k.packed.resize(static_cast<size_t>(n * ((d * b + 7) / 8)));
  tqvec::pack_bits(idx.data(), n, d, b, k.packed.data(), nthreads);
  const int64_t nb = (n + 31) / 32;
  if (b <= 4) {
    k.blocked.resize(static_cast<size_t>(nb * tqvec::fs_row_bytes(d, b) * 32));
    tqvec::block_codes(k.packed.data(), n, d, b, k.blocked.data(), nthreads);
  }
  k.c = normals(r, int64_t{1} << b);
  std::sort(k.c.begin(), k.c.end());
  return k;
}

void run(int nthreads) {
  Rng r{20251124};
  const std::string t = "t" + std::to_string(nthreads) + ".";
  const int64_t k = 10;
  struct Case { int b; int64_t d, n, nq; };
  // 13 queries: groups of several queries per pass and a remainder; d = 786 at 4 bits: an odd
  // byte count past a 16-bit flush; d = 1100 at 3 bits: past the 128-group flush
  const Case cases[] = {{1, 100, 1000, 3}, {2, 96, 777, 13}, {3, 100, 999, 13},
                        {3, 1100, 300, 2}, {4, 384, 2000, 3}, {4, 786, 1100, 13}};
  for (const Case& cs : cases) {
    const std::string tag = t + "b" + std::to_string(cs.b) + "d" + std::to_string(cs.d) + ".";
    const int64_t n = cs.n, d = cs.d, nq = cs.nq;
    Codes K = make_codes(r, n, d, cs.b, nthreads);
    const std::vector<float> qr = normals(r, nq * d);
    std::vector<float> mult(static_cast<size_t>(n)), add(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      mult[i] = 0.5f + 1.5f * r.uniform();
      add[i] = i % 13 == 0 ? -INFINITY : r.normal();
    }
    const tqvec::CodeTable tab{K.blocked.data(), n, d, cs.b, K.c.data(), mult.data(),
                               add.data()};
    std::vector<float> vals(static_cast<size_t>(nq * k));
    std::vector<int64_t> idx(static_cast<size_t>(nq * k));
    const tqvec::TopKOut out{k, vals.data(), idx.data()};
    for (bool approx : {false, true}) {
      tqvec::fast_scan(qr.data(), nq, tab, approx, out, nthreads);
      emit(tag + (approx ? "fast_scan_approx.v" : "fast_scan.v"), vals);
      emit(tag + (approx ? "fast_scan_approx.i" : "fast_scan.i"), idx);
    }
    // inverted lists: four block ranges, rows past n padded with add = -inf
    const int64_t nb = (n + 31) / 32;
    std::vector<float> m2(mult), a2(add);
    m2.resize(static_cast<size_t>(32 * nb), 1.0f);
    a2.resize(static_cast<size_t>(32 * nb), -INFINITY);
    const tqvec::CodeTable tab2{K.blocked.data(), 32 * nb, d, cs.b, K.c.data(), m2.data(),
                                a2.data()};
    const std::vector<int64_t> lb = {0, nb / 4, nb / 2, nb / 2 + 1, nb};
    std::vector<int64_t> lists(static_cast<size_t>(nq * 2));
    for (int64_t q = 0; q < nq; ++q) {
      lists[2 * q] = r.below(4);
      lists[2 * q + 1] = q % 5 == 4 ? -1 : (lists[2 * q] + 1 + r.below(3)) % 4;
    }
    const std::vector<float> offs = normals(r, nq * 2);
    tqvec::ivf_fast_scan(qr.data(), nq, tab2, lb.data(), 4, {lists.data(), offs.data(), 2},
                         false, out, nthreads);
    emit(tag + "ivf.v", vals);
    emit(tag + "ivf.i", idx);
    // two terms: these codes and 1-bit signs of a prefix, exact and two-stage
    const int64_t d1 = d / 2;
    Codes S = make_codes(r, n, d1, 1, nthreads);
    S.c = {-1.0f, 1.0f};
    std::vector<float> m1(static_cast<size_t>(n), -0.5f);
    const tqvec::ScanTerm terms[2] = {
        {qr.data(), d, K.blocked.data(), cs.b, K.c.data(), mult.data(), K.packed.data()},
        {nullptr, d1, S.blocked.data(), 1, S.c.data(), m1.data(), S.packed.data()}};
    std::vector<float> qr1(static_cast<size_t>(nq * d1));
    for (int64_t q = 0; q < nq; ++q)
      std::memcpy(&qr1[q * d1], &qr[q * d], sizeof(float) * d1);
    tqvec::ScanTerm tt[2] = {terms[0], terms[1]};
    tt[1].qr = qr1.data();
    tqvec::fast_scan_terms(tt, 2, nq, n, add.data(), out, nthreads);
    emit(tag + "terms.v", vals);
    emit(tag + "terms.i", idx);
    tqvec::fast_scan_terms(tt, 2, nq, n, add.data(), out, nthreads, 1, 40);
    emit(tag + "terms2.v", vals);
    emit(tag + "terms2.i", idx);
    // prefilter: the sign plane of the prefix, then these codes packed
    const tqvec::CodeTable signs{S.blocked.data(), n, d1, 1, S.c.data(), m1.data(), add.data()};
    const tqvec::CodeTable full{K.packed.data(), n, d, cs.b, K.c.data(), mult.data(),
                                add.data()};
    tqvec::fast_scan_two_stage(qr.data(), nq, signs, full, 50, out, nthreads);
    emit(tag + "two_stage.v", vals);
    emit(tag + "two_stage.i", idx);
    // the exact re-score of listed rows (packed codes)
    std::vector<int64_t> rows(static_cast<size_t>(nq * 30));
    for (auto& x : rows) x = r.below(n + 1) - 1;
    tqvec::lut_rescore(qr.data(), nq, full, rows.data(), 30, out, nthreads);
    emit(tag + "lut_rescore.v", vals);
    emit(tag + "lut_rescore.i", idx);
    // exact vectors: re-rank, norms, dots, a probe
    const std::vector<float> x = normals(r, n * d);
    for (int metric : {tqvec::kRescoreIP, tqvec::kRescoreL2, tqvec::kRescoreCosine}) {
      tqvec::rescore_topk(qr.data(), nq, d, x.data(), rows.data(), 30, metric, k, vals.data(),
                          idx.data(), nthreads);
      emit(tag + "rescore" + std::to_string(metric) + ".v", vals);
      emit(tag + "rescore" + std::to_string(metric) + ".i", idx);
    }
    std::vector<float> sq(static_cast<size_t>(nq));
    tqvec::row_sqnorms(qr.data(), nq, d, sq.data());
    emit(tag + "sqnorms", sq);
    tqvec::row_dots(qr.data(), nq, d, x.data(), sq.data());
    emit(tag + "dots", sq);
    const int64_t nlist = 11, nprobe = 3;
    std::vector<float> csq(static_cast<size_t>(nlist));
    tqvec::row_sqnorms(x.data(), nlist, d, csq.data());
    std::vector<int64_t> pr(static_cast<size_t>(nq * nprobe));
    std::vector<float> po(static_cast<size_t>(nq * nprobe));
    tqvec::ivf_probe(qr.data(), nq, d, x.data(), nlist, csq.data(), true, nprobe, pr.data(),
                     po.data(), nthreads);
    emit(tag + "probe.i", pr);
    emit(tag + "probe.v", po);
    // a graph over these rows: 32 random neighbours each (a few missing), one upper layer of
    // every 8th row, searched by estimates and with exact vectors
    if (cs.b != 3) {
      const int64_t R = 32, rbb = tqvec::fs_row_bytes(d, cs.b), rbp = (d * cs.b + 7) / 8;
      auto layer = [&](int64_t nodes, auto row_of, std::vector<int32_t>& nbr,
                       std::vector<uint8_t>& codes, std::vector<float>& em,
                       std::vector<float>& ea) {
        nbr.assign(static_cast<size_t>(nodes * R), -1);
        for (int64_t v = 0; v < nodes; ++v)
          for (int64_t e = 0; e < R; ++e)
            if (r.below(8) != 0) nbr[v * R + e] = static_cast<int32_t>(row_of(r.below(nodes)));
        std::vector<uint8_t> gathered(static_cast<size_t>(nodes * R * rbp), 0);
        em.assign(static_cast<size_t>(nodes * R), 0.0f);
        ea.assign(static_cast<size_t>(nodes * R), -INFINITY);
        for (int64_t e = 0; e < nodes * R; ++e)
          if (nbr[e] >= 0) {
            std::memcpy(&gathered[e * rbp], &K.packed[nbr[e] * rbp], rbp);
            em[e] = mult[nbr[e]];
            ea[e] = std::isfinite(add[nbr[e]]) ? add[nbr[e]] : 0.0f;
          }
        codes.resize(static_cast<size_t>(nodes * R * rbb));
        tqvec::block_codes(gathered.data(), nodes * R, d, cs.b, codes.data(), nthreads);
      };
      std::vector<int32_t> nb0, nb1, slot(static_cast<size_t>(n), -1);
      std::vector<uint8_t> c0, c1;
      std::vector<float> m0, a0, m1, a1;
      layer(n, [](int64_t v) { return v; }, nb0, c0, m0, a0);
      const int64_t up = (n + 7) / 8;
      for (int64_t v = 0; v < up; ++v) slot[8 * v] = static_cast<int32_t>(v);
      layer(up, [](int64_t v) { return 8 * v; }, nb1, c1, m1, a1);
      const tqvec::GraphLayer layers[2] = {
          {n, R, nb0.data(), c0.data(), m0.data(), a0.data(), nullptr},
          {up, R, nb1.data(), c1.data(), m1.data(), a1.data(), slot.data()}};
      // the entry (row 0) as a block of its own: its code in slot 0
      std::vector<uint8_t> eg(static_cast<size_t>(R * rbp), 0), ec(static_cast<size_t>(R * rbb));
      std::memcpy(eg.data(), K.packed.data(), rbp);
      tqvec::block_codes(eg.data(), R, d, cs.b, ec.data(), nthreads);
      std::vector<float> emul(static_cast<size_t>(R), 0.0f), eadd(static_cast<size_t>(R), -INFINITY);
      emul[0] = mult[0];
      eadd[0] = std::isfinite(add[0]) ? add[0] : 0.0f;
      tqvec::GraphArgs ga{layers, 2, n, d, cs.b, K.c.data(), 0, ec.data(), emul.data(),
                          eadd.data(), nullptr, nullptr, 0};
      tqvec::graph_search(ga, qr.data(), nullptr, nullptr, nq, 40, out, nthreads);
      emit(tag + "graph.v", vals);
      emit(tag + "graph.i", idx);
      std::vector<float> qsq(static_cast<size_t>(nq));
      tqvec::row_sqnorms(qr.data(), nq, d, qsq.data());
      ga.exact_x = x.data();
      ga.exact_metric = tqvec::kRescoreL2;
      tqvec::graph_search(ga, qr.data(), qr.data(), qsq.data(), nq, 40, out, nthreads);
      emit(tag + "graph_exact.v", vals);
      emit(tag + "graph_exact.i", idx);
    }
    // a Hadamard rotation, forward and inverse
    int64_t p = 1;  // the largest power of two <= d
    while (2 * p <= d) p <<= 1;
    std::vector<int64_t> perm(static_cast<size_t>(2 * d));
    std::vector<float> sg(static_cast<size_t>(2 * d));
    for (int rr = 0; rr < 2; ++rr) {
      for (int64_t j = 0; j < d; ++j) perm[rr * d + j] = j;
      for (int64_t j = d - 1; j > 0; --j) std::swap(perm[rr * d + j], perm[rr * d + r.below(j + 1)]);
      for (int64_t j = 0; j < d; ++j) sg[rr * d + j] = r.next() & 1 ? 1.0f : -1.0f;
    }
    std::vector<float> rot(static_cast<size_t>(nq * d));
    for (bool inverse : {false, true}) {
      tqvec::hadamard_rotate(qr.data(), nq, d, perm.data(), sg.data(), 2, p, inverse, rot.data(),
                             nthreads);
      emit(tag + (inverse ? "hadamard_inv" : "hadamard"), rot);
    }
  }
}

}  // namespace

int main() {
  std::fprintf(stderr, "simd path: %s\n",
               tqvec::simd_neon()      ? "neon"
               : tqvec::simd_avx512() ? "avx512"
               : tqvec::simd_vnni()   ? "avx2+vbmi+vnni"
               : tqvec::simd_vbmi()   ? "avx2+vbmi"
               : tqvec::simd_avx2()   ? "avx2"
                                      : "scalar");
  run(1);
  run(2);
  return 0;
}
