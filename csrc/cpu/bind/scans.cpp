// Bindings of the scans: LUT scans of packed codes, the fast scans of blocked codes (one term,
// several terms, two stages, inverted lists), the IVF probe and the exact re-ranking.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "check.h"

namespace tqvec::bind {

void bind_scans(nb::module_& m) {
  m.def("simd_path",
        [] {
          return simd_neon()     ? "neon"
                 : simd_avx512() ? "avx512"
                 : simd_vnni()   ? "avx2+vbmi+vnni"
                 : simd_vbmi()   ? "avx2+vbmi"
                 : simd_avx2()   ? "avx2"
                                 : "scalar";
        },
        "The vector path the fast scans take on this CPU: avx2 (the x86 default where the CPU "
        "has it), avx2+vbmi (the default where it also has AVX-512 F, BW and VBMI: 3-bit scans "
        "by vpermb), avx2+vbmi+vnni (and VNNI: 1, 2 and 4-bit table sums by vpermb and "
        "vpdpbusd, batched exact 4-bit scans by int8 dot products), "
        "avx512 (TQVEC_SIMD=avx512, where the CPU has F and BW; 3-bit scans by "
        "vpermb where it has VBMI), neon (aarch64) or scalar (TQVEC_SIMD=scalar, or no AVX2); "
        "TQVEC_SIMD=avx2 keeps every scan on AVX2.");

  m.def("lut_scan", [](CArr<const float> qr, CArr<const uint8_t> packed,
                       CArr<const float> centroids, CArr<const float> mult, CArr<const float> add,
                       int b, int64_t k, CArr<float> out_vals, CArr<int64_t> out_idx,
                       int nthreads) {
    check_shape(qr, {kAny, kAny}, "lut_scan", "qr");
    const CodeTable t = packed_table(packed, dim(qr, 1), b, centroids, mult, add, "lut_scan");
    const TopKOut out = topk_out(out_vals, out_idx, dim(qr, 0), k, "lut_scan");
    nb::gil_scoped_release rel;
    lut_scan(qr.data(), dim(qr, 0), t, out, nthreads);
  });

  m.def("lut_rescore", [](CArr<const float> qr, CArr<const uint8_t> packed,
                          CArr<const float> centroids, CArr<const float> mult,
                          CArr<const float> add, CArr<const int64_t> rows, int b, int64_t k,
                          CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads) {
    const char* op = "lut_rescore";
    check_shape(qr, {kAny, kAny}, op, "qr");
    const int64_t nq = dim(qr, 0);
    const CodeTable t = packed_table(packed, dim(qr, 1), b, centroids, mult, add, op);
    check_shape(rows, {nq, kAny}, op, "rows");
    const TopKOut out = topk_out(out_vals, out_idx, nq, k, op);
    nb::gil_scoped_release rel;
    lut_rescore(qr.data(), nq, t, rows.data(), dim(rows, 1), out, nthreads);
  });

  m.def("fast_scan", [](CArr<const float> qr, CArr<const uint8_t> blocked, int64_t n,
                        CArr<const float> centroids, CArr<const float> mult,
                        CArr<const float> add, int b, int64_t k, bool approx,
                        CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads) {
    check_shape(qr, {kAny, kAny}, "fast_scan", "qr");
    const CodeTable t =
        blocked_table(blocked, n, dim(qr, 1), b, centroids, mult, add, "fast_scan");
    const TopKOut out = topk_out(out_vals, out_idx, dim(qr, 0), k, "fast_scan");
    nb::gil_scoped_release rel;
    fast_scan(qr.data(), dim(qr, 0), t, approx, out, nthreads);
  });

  m.def("fast_scan_two_stage", [](CArr<const float> qr, CArr<const uint8_t> signs, int64_t n,
                                  CArr<const float> c1, CArr<const uint8_t> packed, int b,
                                  CArr<const float> centroids, CArr<const float> mult,
                                  CArr<const float> add, CArr<const float> add1, int64_t k1,
                                  int64_t k, CArr<float> out_vals, CArr<int64_t> out_idx,
                                  int nthreads, std::optional<CArr<const float>> mult1,
                                  float bound_sigma, float bound_gain, float bound_cnorm,
                                  float bound_min_sin) {
    const char* op = "fast_scan_two_stage";
    check_shape(qr, {kAny, kAny}, op, "qr");
    const int64_t nq = dim(qr, 0), d = dim(qr, 1);
    const CodeTable full = packed_table(packed, d, b, centroids, mult, add, op);
    require(full.n == n, op, ": packed must hold the n rows");
    // the first pass's multipliers: its own (mult1), or the full codes'
    const CodeTable first = blocked_table(signs, n, sign_plane_dims(signs, d, op), 1, c1,
                                          mult1 ? *mult1 : mult, add1, op);
    require(k1 >= 1, op, ": k1 must be >= 1");
    const SignBound bound =
        sign_bound(bound_sigma, bound_gain, bound_cnorm, bound_min_sin, op);
    const TopKOut out = topk_out(out_vals, out_idx, nq, k, op);
    k1 = std::min(k1, n);  // more candidates than rows: every row
    nb::gil_scoped_release rel;
    fast_scan_two_stage(qr.data(), nq, first, full, k1, out, nthreads, bound);
  }, nb::arg("qr"), nb::arg("signs"), nb::arg("n"), nb::arg("c1"), nb::arg("packed"),
     nb::arg("b"), nb::arg("centroids"), nb::arg("mult"), nb::arg("add"), nb::arg("add1"),
     nb::arg("k1"), nb::arg("k"), nb::arg("out_vals"), nb::arg("out_idx"),
     nb::arg("nthreads"), nb::arg("mult1").none() = nb::none(), nb::arg("bound_sigma") = 0.0f,
     nb::arg("bound_gain") = 1.0f, nb::arg("bound_cnorm") = 1.0f,
     nb::arg("bound_min_sin") = 0.0f);

  m.def("fast_scan_terms", [](std::vector<CArr<const float>> qrs,
                              std::vector<CArr<const uint8_t>> blocked,
                              std::vector<CArr<const float>> centroids,
                              std::vector<CArr<const float>> mults, std::vector<int> bits,
                              int64_t n, CArr<const float> add, int64_t k, CArr<float> out_vals,
                              CArr<int64_t> out_idx, int nthreads,
                              std::vector<CArr<const uint8_t>> packed, int nfirst, int64_t k1) {
    const char* op = "fast_scan_terms";
    const size_t T = qrs.size();
    require(T >= 1 && T <= 8 && blocked.size() == T && centroids.size() == T &&
                mults.size() == T && bits.size() == T,
            op, ": 1 to 8 terms, each with queries, blocked codes, centroids, multipliers and "
            "bits");
    require(n >= 0, op, ": n must be >= 0");
    check_shape(add, {n}, op, "add");
    check_shape(qrs[0], {kAny, kAny}, op, "queries");
    const int64_t nq = dim(qrs[0], 0);
    require(nfirst >= 0 && nfirst <= static_cast<int>(T) &&
                (nfirst == 0 || (packed.size() == T && k1 >= 1)),
            op, ": nfirst must be 0, or 1 to the number of terms with packed codes for every "
            "term and k1 >= 1");
    std::vector<ScanTerm> terms;
    for (size_t t = 0; t < T; ++t) {
      check_shape(qrs[t], {nq, kAny}, op, "queries");
      const int64_t d = dim(qrs[t], 1);
      // each term's table: its own multipliers, the shared add
      const CodeTable c = blocked_table(blocked[t], n, d, bits[t], centroids[t], mults[t], add, op);
      const uint8_t* rows = nullptr;
      if (nfirst > 0) {
        check_shape(packed[t], {n, packed_row_bytes(d, c.b)}, op, "packed codes");
        rows = packed[t].data();
      }
      terms.push_back({qrs[t].data(), d, c.codes, c.b, c.centroids, c.mult, rows});
    }
    const TopKOut out = topk_out(out_vals, out_idx, nq, k, op);
    k1 = std::min(k1, n);  // more candidates than rows: every row
    nb::gil_scoped_release rel;
    fast_scan_terms(terms.data(), static_cast<int>(T), nq, n, add.data(), out, nthreads, nfirst,
                    k1);
  });

  m.def("ivf_fast_scan", [](CArr<const float> qr, CArr<const uint8_t> blocked,
                            CArr<const float> centroids, CArr<const float> mult,
                            CArr<const float> add, CArr<const int64_t> list_blocks,
                            CArr<const int64_t> probes, CArr<const float> offsets, int b,
                            int64_t k, bool approx, CArr<float> out_vals, CArr<int64_t> out_idx,
                            int nthreads) {
    const char* op = "ivf_fast_scan";
    check_shape(qr, {kAny, kAny}, op, "qr");
    check_shape(blocked, {kAny, kAny, 32}, op, "blocked codes");
    const int64_t nq = dim(qr, 0), nb = dim(blocked, 0);
    const CodeTable t = blocked_table(blocked, 32 * nb, dim(qr, 1), b, centroids, mult, add, op);
    check_shape(list_blocks, {kAny}, op, "list_blocks");
    const int64_t nlist = dim(list_blocks, 0) - 1;
    require(nlist >= 0, op, ": list_blocks must hold nlist + 1 offsets");
    check_list_blocks(list_blocks, nlist, nb, op);
    check_shape(probes, {nq, kAny}, op, "probes");
    check_shape(offsets, {nq, dim(probes, 1)}, op, "offsets");
    const TopKOut out = topk_out(out_vals, out_idx, nq, k, op);
    nb::gil_scoped_release rel;
    ivf_fast_scan(qr.data(), nq, t, list_blocks.data(), nlist,
                  {probes.data(), offsets.data(), dim(probes, 1)}, approx, out, nthreads);
  });

  m.def("ivf_probe", [](CArr<const float> q, CArr<const float> c, CArr<const float> csq, bool l2,
                        CArr<int64_t> probes, CArr<float> offsets, int nthreads) {
    const char* op = "ivf_probe";
    check_shape(q, {kAny, kAny}, op, "q");
    const int64_t nq = dim(q, 0), d = dim(q, 1);
    check_shape(c, {kAny, d}, op, "centroids");
    const int64_t nlist = dim(c, 0);
    check_shape(csq, {nlist}, op, "centroid norms");
    check_shape(probes, {nq, kAny}, op, "probes");
    const int64_t nprobe = dim(probes, 1);
    require(nprobe >= 1 && nprobe <= nlist, op, ": nprobe must be in 1..nlist");
    check_shape(offsets, {nq, nprobe}, op, "offsets");
    nb::gil_scoped_release rel;
    ivf_probe(q.data(), nq, d, c.data(), nlist, csq.data(), l2, nprobe, probes.data(),
              offsets.data(), nthreads);
  });

  m.def("rescore_topk", [](CArr<const float> q, CArr<const float> x, CArr<const int64_t> rows,
                           int metric, int64_t k, CArr<float> vals, CArr<int64_t> idx,
                           int nthreads) {
    const char* op = "rescore_topk";
    check_shape(q, {kAny, kAny}, op, "q");
    const int64_t nq = dim(q, 0), d = dim(q, 1);
    check_shape(x, {kAny, d}, op, "x");
    check_shape(rows, {nq, kAny}, op, "rows");
    check_metric(metric, op);
    const TopKOut out = topk_out(vals, idx, nq, k, op);
    const int64_t n = dim(x, 0), kk = dim(rows, 1);
    check_entries(rows.data(), nq * kk, -1, n, op, "rows");
    nb::gil_scoped_release rel;
    rescore_topk(q.data(), nq, d, x.data(), rows.data(), kk, metric, out.k, out.vals, out.idx,
                 nthreads);
  });
}

}  // namespace tqvec::bind
