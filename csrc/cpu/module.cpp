// nanobind bindings for tqvec._C. Shapes are re-checked here (cheaply) so that a wrong call can
// never write out of bounds; value checks (NaN, ranges) happen once in tqvec/_validate.py, but
// for the one-call searchers' queries (all_finite).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace nb = nanobind;

template <class T>
using CArr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

namespace {

// The message is built only on failure: a std::string argument would be constructed (and, past
// 15 characters, heap-allocated) on every call - 20 us per one-query rotation, whose loop checks
// each permutation entry.
template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::string msg;
  (msg.append(parts), ...);
  throw std::invalid_argument(msg);
}

int64_t rb(int64_t d, int b) { return (d * b + 7) / 8; }

void check_bits(int b) { require(b >= 1 && b <= 8, "bits must be in 1..8"); }

// A scan's 2^b centroids and its (nq, k) top-k outputs.
void check_centroids(const CArr<const float>& c, int b, const char* op) {
  require(c.ndim() == 1 && c.shape(0) == static_cast<size_t>(1 << b),
          op, ": centroids");
}

void check_topk_out(const CArr<float>& vals, const CArr<int64_t>& idx, int64_t nq, int64_t k,
                    const char* op) {
  require(k >= 1 && vals.shape(0) == static_cast<size_t>(nq) &&
              vals.shape(1) == static_cast<size_t>(k) && idx.shape(0) == static_cast<size_t>(nq) &&
              idx.shape(1) == static_cast<size_t>(k),
          op, ": outputs");
}

// A rotation's parameters for the one-call searches, checked once (rounds x d permutations).
tqvec::RotationArgs checked_rotation(const CArr<const int64_t>& perms,
                                     const CArr<const float>& signs, int64_t p, int64_t d,
                                     const char* op) {
  const int64_t rounds = perms.shape(0);
  require(perms.shape(1) == static_cast<size_t>(d) && signs.shape(0) == perms.shape(0) &&
              signs.shape(1) == perms.shape(1), op, ": perms/signs shape");
  require(p >= 1 && (p & (p - 1)) == 0 && p <= d && 2 * p >= d, op, ": block size");
  for (int64_t t = 0; t < rounds * d; ++t)
    require(perms.data()[t] >= 0 && perms.data()[t] < d, op, ": perm out of range");
  return {perms.data(), signs.data(), static_cast<int>(rounds), p};
}

// A refinement by TurboQuant-mse codes for the one-call searches, checked once: n rows packed
// (n, ceil(d b / 8)), their rotation, centroids, mult and add (n,). packed empty: none.
tqvec::CodedRefine coded_refine(const CArr<const uint8_t>& packed, int b,
                                const CArr<const int64_t>& perms, const CArr<const float>& signs,
                                int64_t p, const CArr<const float>& cent,
                                const CArr<const float>& mult, const CArr<const float>& add,
                                int64_t n, int64_t d, const tqvec::RotationArgs& base,
                                const char* op) {
  tqvec::CodedRefine r{};
  if (packed.ndim() != 2 || packed.shape(0) == 0) return r;
  check_bits(b);
  require(packed.shape(0) == static_cast<size_t>(n) &&
              packed.shape(1) == static_cast<size_t>(rb(d, b)) && mult.ndim() == 1 &&
              add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
              add.shape(0) == static_cast<size_t>(n),
          op, ": ref_packed must be (n, ceil(d ref_b / 8)), ref_mult and ref_add (n,)");
  check_centroids(cent, b, op);
  r.packed = packed.data();
  r.b = b;
  r.rot = checked_rotation(perms, signs, p, d, op);
  // the scan's own rotation (a refinement made with the codes' seed, as index_factory does):
  // the scan's rotated queries serve the re-scoring too
  const size_t rd = static_cast<size_t>(r.rot.rounds) * static_cast<size_t>(d);
  r.same_rotation = r.rot.p == base.p && r.rot.rounds == base.rounds &&
                    std::equal(r.rot.perms, r.rot.perms + rd, base.perms) &&
                    std::equal(r.rot.signs, r.rot.signs + rd, base.signs);
  r.cent = cent.data();
  r.mult = mult.data();
  r.add = add.data();
  return r;
}

// The coordinates a two-stage scan's sign plane (nb, bytes, 32) covers: all d where bytes =
// ceil(d / 8), else the first 8 * bytes (a prefix: 1-bit codes' coarse pass); 0 if bytes is
// too many.
template <class Arr>
int64_t sign_plane_dims(const Arr& signs, int64_t d) {
  if (signs.ndim() != 3) return 0;
  const int64_t bytes = static_cast<int64_t>(signs.shape(1));
  if (bytes == tqvec::fs_row_bytes(d, 1)) return d;
  return bytes >= 1 && 8 * bytes < d ? 8 * bytes : 0;
}

// flat_search's prepared state: the index's arrays, validated once, kept alive by this object.
struct FlatSearcher {
  CArr<const int64_t> perms, ids;
  CArr<const float> signs, codebook, mult, add, cfull, add1, center, ip_center;
  CArr<const uint8_t> blocked, packed;
  CArr<const float> ref_x;
  CArr<const uint8_t> ref_packed;
  CArr<const int64_t> ref_perms;
  CArr<const float> ref_signs, ref_cent, ref_mult, ref_add;
  tqvec::FlatSearchArgs args;
};

// Whether every one of n floats is finite (the one-call searches check their queries here: a
// numpy isfinite pass cost ~2 us per one-query search, cache-cold after the previous scan).
bool all_finite(const float* x, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(x[i]);
  return ok;
}

// ivf_search's prepared state: the index's arrays, validated once here (the position map alone
// is 60k entries, too many to check per one-query search) and kept alive by this object.
struct IvfSearcher {
  CArr<const float> centroids, csq, signs, codebook, mult, add, ref;
  CArr<const int64_t> perms, list_blocks, pos, ids;
  CArr<const uint8_t> blocked, ref_packed;
  CArr<const int64_t> ref_perms;
  CArr<const float> ref_signs, ref_cent, ref_mult, ref_add;
  tqvec::IvfSearchArgs args;
};

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "tqvec compiled CPU kernels (see csrc/cpu/kernels.h for layouts)";

  m.def("pack_bits", [](CArr<const uint8_t> idx, int b, CArr<uint8_t> out, int nthreads) {
    check_bits(b);
    require(idx.ndim() == 2 && out.ndim() == 2, "pack_bits: 2-D arrays expected");
    const int64_t n = idx.shape(0), d = idx.shape(1);
    require(out.shape(0) == static_cast<size_t>(n) && out.shape(1) == static_cast<size_t>(rb(d, b)),
            "pack_bits: out has the wrong shape");
    nb::gil_scoped_release rel;
    tqvec::pack_bits(idx.data(), n, d, b, out.data(), nthreads);
  });

  m.def("unpack_bits", [](CArr<const uint8_t> packed, int64_t d, int b, CArr<uint8_t> out,
                          int nthreads) {
    check_bits(b);
    require(packed.ndim() == 2 && out.ndim() == 2, "unpack_bits: 2-D arrays expected");
    const int64_t n = packed.shape(0);
    require(packed.shape(1) == static_cast<size_t>(rb(d, b)), "unpack_bits: packed row size");
    require(out.shape(0) == static_cast<size_t>(n) && out.shape(1) == static_cast<size_t>(d),
            "unpack_bits: out has the wrong shape");
    nb::gil_scoped_release rel;
    tqvec::unpack_bits(packed.data(), n, d, b, out.data(), nthreads);
  });

  m.def("quantize_pack", [](CArr<const float> y, CArr<const float> scale, CArr<const float> thr,
                            int b, CArr<uint8_t> out, int nthreads) {
    check_bits(b);
    require(y.ndim() == 2 && out.ndim() == 2 && scale.ndim() == 1 && thr.ndim() == 1,
            "quantize_pack: bad ranks");
    const int64_t n = y.shape(0), d = y.shape(1);
    require(scale.shape(0) == static_cast<size_t>(n), "quantize_pack: scale length");
    require(thr.shape(0) == static_cast<size_t>((1 << b) - 1), "quantize_pack: thresholds");
    require(out.shape(0) == static_cast<size_t>(n) && out.shape(1) == static_cast<size_t>(rb(d, b)),
            "quantize_pack: out has the wrong shape");
    nb::gil_scoped_release rel;
    tqvec::quantize_pack(y.data(), scale.data(), n, d, thr.data(), b, out.data(), nthreads);
  });

  m.def("centroid_stats", [](CArr<const uint8_t> packed, int64_t d, int b,
                             CArr<const float> centroids, std::optional<CArr<const float>> y,
                             std::optional<CArr<const float>> scale, CArr<float> csq,
                             std::optional<CArr<float>> dot, int nthreads) {
    check_bits(b);
    require(packed.ndim() == 2 && centroids.ndim() == 1 && csq.ndim() == 1,
            "centroid_stats: bad ranks");
    const int64_t n = packed.shape(0);
    require(packed.shape(1) == static_cast<size_t>(rb(d, b)), "centroid_stats: packed row size");
    require(centroids.shape(0) == static_cast<size_t>(1 << b), "centroid_stats: centroids");
    require(csq.shape(0) == static_cast<size_t>(n), "centroid_stats: csq length");
    require(y.has_value() == scale.has_value() && y.has_value() == dot.has_value(),
            "centroid_stats: y, scale and dot go together");
    if (y) {
      require(y->ndim() == 2 && y->shape(0) == static_cast<size_t>(n) &&
                  y->shape(1) == static_cast<size_t>(d),
              "centroid_stats: y must be (n, d)");
      require(scale->ndim() == 1 && scale->shape(0) == static_cast<size_t>(n),
              "centroid_stats: scale length");
      require(dot->ndim() == 1 && dot->shape(0) == static_cast<size_t>(n),
              "centroid_stats: dot length");
    }
    nb::gil_scoped_release rel;
    tqvec::centroid_stats(packed.data(), n, d, b, centroids.data(), y ? y->data() : nullptr,
                          scale ? scale->data() : nullptr, csq.data(),
                          dot ? dot->data() : nullptr, nthreads);
  });

  m.def("lut_scan", [](CArr<const float> qr, CArr<const uint8_t> packed,
                       CArr<const float> centroids, CArr<const float> mult, CArr<const float> add,
                       int b, int64_t k, CArr<float> out_vals, CArr<int64_t> out_idx,
                       int nthreads) {
    check_bits(b);
    require(qr.ndim() == 2 && packed.ndim() == 2 && out_vals.ndim() == 2 && out_idx.ndim() == 2,
            "lut_scan: bad ranks");
    const int64_t nq = qr.shape(0), d = qr.shape(1), n = packed.shape(0);
    require(packed.shape(1) == static_cast<size_t>(rb(d, b)), "lut_scan: packed row size");
    check_centroids(centroids, b, "lut_scan");
    require(mult.ndim() == 1 && add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
                add.shape(0) == static_cast<size_t>(n), "lut_scan: mult/add length");
    check_topk_out(out_vals, out_idx, nq, k, "lut_scan");
    nb::gil_scoped_release rel;
    tqvec::lut_scan(qr.data(), nq, d, packed.data(), n, b, centroids.data(), mult.data(),
                    add.data(), k, out_vals.data(), out_idx.data(), nthreads);
  });

  m.def("lut_rescore", [](CArr<const float> qr, CArr<const uint8_t> packed,
                          CArr<const float> centroids, CArr<const float> mult,
                          CArr<const float> add, CArr<const int64_t> rows, int b, int64_t k,
                          CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads) {
    check_bits(b);
    require(qr.ndim() == 2 && packed.ndim() == 2 && rows.ndim() == 2 && out_vals.ndim() == 2 &&
                out_idx.ndim() == 2, "lut_rescore: bad ranks");
    const int64_t nq = qr.shape(0), d = qr.shape(1), n = packed.shape(0), r = rows.shape(1);
    require(packed.shape(1) == static_cast<size_t>(rb(d, b)), "lut_rescore: packed row size");
    require(rows.shape(0) == static_cast<size_t>(nq), "lut_rescore: rows per query");
    check_centroids(centroids, b, "lut_rescore");
    require(mult.ndim() == 1 && add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
                add.shape(0) == static_cast<size_t>(n), "lut_rescore: mult/add length");
    check_topk_out(out_vals, out_idx, nq, k, "lut_rescore");
    nb::gil_scoped_release rel;
    tqvec::lut_rescore(qr.data(), nq, d, packed.data(), n, b, centroids.data(), mult.data(),
                       add.data(), rows.data(), r, k, out_vals.data(), out_idx.data(), nthreads);
  });

  m.def("decode_attention", [](CArr<const float> qr, CArr<const float> qbias,
                               CArr<const uint8_t> kpacked, CArr<const float> knorm,
                               CArr<const float> kcent, int kb, CArr<const uint8_t> vpacked,
                               CArr<const float> vnorm, CArr<const float> vcent, int vb,
                               CArr<const int32_t> lo, CArr<const int32_t> hi, float scale,
                               CArr<float> m, CArr<float> l, CArr<float> acc, int nthreads) {
    check_bits(kb);
    check_bits(vb);
    require(qr.ndim() == 3 && qbias.ndim() == 2 && kpacked.ndim() == 3 && vpacked.ndim() == 3 &&
                knorm.ndim() == 2 && vnorm.ndim() == 2 && lo.ndim() == 1 && hi.ndim() == 1 &&
                m.ndim() == 2 && l.ndim() == 2 && acc.ndim() == 3,
            "decode_attention: bad ranks");
    const int64_t bh = qr.shape(0), g = qr.shape(1), d = qr.shape(2), t = kpacked.shape(1);
    const auto B = static_cast<size_t>(bh), G = static_cast<size_t>(g), T = static_cast<size_t>(t);
    require(qbias.shape(0) == B && qbias.shape(1) == G, "decode_attention: qbias shape");
    require(kpacked.shape(0) == B && kpacked.shape(2) == static_cast<size_t>(rb(d, kb)) &&
                vpacked.shape(0) == B && vpacked.shape(1) == T &&
                vpacked.shape(2) == static_cast<size_t>(rb(d, vb)),
            "decode_attention: packed codes shape");
    require(knorm.shape(0) == B && knorm.shape(1) == T && vnorm.shape(0) == B &&
                vnorm.shape(1) == T, "decode_attention: norms shape");
    check_centroids(kcent, kb, "decode_attention");
    check_centroids(vcent, vb, "decode_attention");
    require(lo.shape(0) == B && hi.shape(0) == B, "decode_attention: lo/hi length");
    require(m.shape(0) == B && m.shape(1) == G && l.shape(0) == B && l.shape(1) == G &&
                acc.shape(0) == B && acc.shape(1) == G && acc.shape(2) == static_cast<size_t>(d),
            "decode_attention: outputs");
    nb::gil_scoped_release rel;
    tqvec::decode_attention(qr.data(), qbias.data(), bh, g, d, kpacked.data(), knorm.data(),
                            kcent.data(), kb, vpacked.data(), vnorm.data(), vcent.data(), vb, t,
                            lo.data(), hi.data(), scale, m.data(), l.data(), acc.data(),
                            nthreads);
  });

  m.def("block_codes", [](CArr<const uint8_t> packed, int64_t d, int b, CArr<uint8_t> blocked,
                          int nthreads) {
    require(packed.ndim() == 2 && blocked.ndim() == 3, "block_codes: bad ranks");
    require(b >= 1 && b <= 8 && d >= 1, "block_codes: need 1 <= b <= 8 and d >= 1");
    const int64_t n = packed.shape(0);
    require(packed.shape(1) == static_cast<size_t>(rb(d, b)), "block_codes: packed row size");
    require(blocked.shape(0) == static_cast<size_t>((n + 31) / 32) &&
                blocked.shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d, b)) &&
                blocked.shape(2) == 32,
            "block_codes: blocked must be (ceil(n/32), fs_row_bytes(d, b), 32)");
    nb::gil_scoped_release rel;
    tqvec::block_codes(packed.data(), n, d, b, blocked.data(), nthreads);
  });

  m.def("fast_scan", [](CArr<const float> qr, CArr<const uint8_t> blocked, int64_t n,
                        CArr<const float> centroids, CArr<const float> mult,
                        CArr<const float> add, int b, int64_t k, bool approx,
                        CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads) {
    require(b >= 1 && b <= 4, "fast_scan: bits must be 1, 2, 3 or 4");
    require(qr.ndim() == 2 && blocked.ndim() == 3 && out_vals.ndim() == 2 &&
                out_idx.ndim() == 2, "fast_scan: bad ranks");
    const int64_t nq = qr.shape(0), d = qr.shape(1);
    require(n >= 0 && blocked.shape(0) == static_cast<size_t>((n + 31) / 32) &&
                blocked.shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d, b)) &&
                blocked.shape(2) == 32,
            "fast_scan: blocked must be (ceil(n/32), fs_row_bytes(d, b), 32)");
    check_centroids(centroids, b, "fast_scan");
    require(mult.ndim() == 1 && add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
                add.shape(0) == static_cast<size_t>(n), "fast_scan: mult/add length");
    check_topk_out(out_vals, out_idx, nq, k, "fast_scan");
    nb::gil_scoped_release rel;
    tqvec::fast_scan(qr.data(), nq, d, blocked.data(), n, b, centroids.data(), mult.data(),
                     add.data(), k, approx, out_vals.data(), out_idx.data(), nthreads);
  });

  m.def("fast_scan_two_stage", [](CArr<const float> qr, CArr<const uint8_t> signs, int64_t n,
                                  CArr<const float> c1, CArr<const uint8_t> packed, int b,
                                  CArr<const float> centroids, CArr<const float> mult,
                                  CArr<const float> add, CArr<const float> add1, int64_t k1,
                                  int64_t k,
                                  CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads) {
    check_bits(b);
    require(qr.ndim() == 2 && signs.ndim() == 3 && packed.ndim() == 2 && out_vals.ndim() == 2 &&
                out_idx.ndim() == 2, "fast_scan_two_stage: bad ranks");
    const int64_t nq = qr.shape(0), d = qr.shape(1);
    // the sign plane covers the first d1 coordinates: all d, or 8 per byte of a shorter row
    const int64_t d1 = sign_plane_dims(signs, d);
    require(n >= 0 && signs.shape(0) == static_cast<size_t>((n + 31) / 32) && d1 >= 1 &&
                signs.shape(2) == 32,
            "fast_scan_two_stage: signs must be (ceil(n/32), ceil(d1/8), 32), d1 <= d");
    require(packed.shape(0) == static_cast<size_t>(n) &&
                packed.shape(1) == static_cast<size_t>(rb(d, b)),
            "fast_scan_two_stage: packed must be (n, ceil(d b / 8))");
    check_centroids(c1, 1, "fast_scan_two_stage");
    check_centroids(centroids, b, "fast_scan_two_stage");
    require(mult.ndim() == 1 && add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
                add.shape(0) == static_cast<size_t>(n) && add1.ndim() == 1 &&
                add1.shape(0) == static_cast<size_t>(n),
            "fast_scan_two_stage: mult/add/add1 length");
    require(k1 >= 1, "fast_scan_two_stage: k1 must be >= 1");
    check_topk_out(out_vals, out_idx, nq, k, "fast_scan_two_stage");
    k1 = std::min(k1, n);  // more candidates than rows: every row
    nb::gil_scoped_release rel;
    tqvec::fast_scan_two_stage(qr.data(), nq, d, signs.data(), d1, n, c1.data(), packed.data(), b,
                               centroids.data(), mult.data(), add.data(), add1.data(), k1, k,
                               out_vals.data(), out_idx.data(), nthreads);
  });

  m.def("fast_scan_terms", [](std::vector<CArr<const float>> qrs,
                              std::vector<CArr<const uint8_t>> blocked,
                              std::vector<CArr<const float>> centroids,
                              std::vector<CArr<const float>> mults, std::vector<int> bits,
                              int64_t n, CArr<const float> add, int64_t k, CArr<float> out_vals,
                              CArr<int64_t> out_idx, int nthreads,
                              std::vector<CArr<const uint8_t>> packed, int nfirst, int64_t k1) {
    const size_t T = qrs.size();
    require(T >= 1 && T <= 8 && blocked.size() == T && centroids.size() == T &&
                mults.size() == T && bits.size() == T,
            "fast_scan_terms: 1 to 8 terms, each with queries, blocked codes, centroids, "
            "multipliers and bits");
    require(add.ndim() == 1 && add.shape(0) == static_cast<size_t>(n) && n >= 0,
            "fast_scan_terms: add length");
    require(out_vals.ndim() == 2 && out_idx.ndim() == 2, "fast_scan_terms: bad ranks");
    const int64_t nq = qrs[0].ndim() == 2 ? qrs[0].shape(0) : -1;
    require(nfirst >= 0 && nfirst <= static_cast<int>(T) &&
                (nfirst == 0 || (packed.size() == T && k1 >= 1)),
            "fast_scan_terms: nfirst must be 0, or 1 to the number of terms with packed codes "
            "for every term and k1 >= 1");
    std::vector<tqvec::ScanTerm> terms;
    for (size_t t = 0; t < T; ++t) {
      const int b = bits[t];
      require(b >= 1 && b <= 4, "fast_scan_terms: bits must be 1, 2, 3 or 4");
      require(qrs[t].ndim() == 2 && static_cast<int64_t>(qrs[t].shape(0)) == nq,
              "fast_scan_terms: queries must be (nq, d_t), the same nq for every term");
      const int64_t d = qrs[t].shape(1);
      require(blocked[t].ndim() == 3 && blocked[t].shape(0) == static_cast<size_t>((n + 31) / 32) &&
                  blocked[t].shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d, b)) &&
                  blocked[t].shape(2) == 32,
              "fast_scan_terms: blocked must be (ceil(n/32), fs_row_bytes(d, b), 32)");
      check_centroids(centroids[t], b, "fast_scan_terms");
      require(mults[t].ndim() == 1 && mults[t].shape(0) == static_cast<size_t>(n),
              "fast_scan_terms: mult length");
      const uint8_t* rows = nullptr;
      if (nfirst > 0) {
        require(packed[t].ndim() == 2 && packed[t].shape(0) == static_cast<size_t>(n) &&
                    packed[t].shape(1) == static_cast<size_t>((d * b + 7) / 8),
                "fast_scan_terms: packed must be (n, ceil(d b / 8)) for each term");
        rows = packed[t].data();
      }
      terms.push_back({qrs[t].data(), d, blocked[t].data(), b, centroids[t].data(),
                       mults[t].data(), rows});
    }
    check_topk_out(out_vals, out_idx, nq, k, "fast_scan_terms");
    k1 = std::min(k1, n);  // more candidates than rows: every row
    nb::gil_scoped_release rel;
    tqvec::fast_scan_terms(terms.data(), static_cast<int>(T), nq, n, add.data(), k,
                           out_vals.data(), out_idx.data(), nthreads, nfirst, k1);
  });

  m.def("ivf_fast_scan", [](CArr<const float> qr, CArr<const uint8_t> blocked,
                            CArr<const float> centroids, CArr<const float> mult,
                            CArr<const float> add, CArr<const int64_t> list_blocks,
                            CArr<const int64_t> probes, CArr<const float> offsets, int b,
                            int64_t k, bool approx, CArr<float> out_vals, CArr<int64_t> out_idx,
                            int nthreads) {
    require(b >= 1 && b <= 4, "ivf_fast_scan: bits must be 1, 2, 3 or 4");
    require(qr.ndim() == 2 && blocked.ndim() == 3 && probes.ndim() == 2 && offsets.ndim() == 2 &&
                list_blocks.ndim() == 1 && out_vals.ndim() == 2 && out_idx.ndim() == 2,
            "ivf_fast_scan: bad ranks");
    const int64_t nq = qr.shape(0), d = qr.shape(1), nb = blocked.shape(0);
    const int64_t n = 32 * nb, nlist = static_cast<int64_t>(list_blocks.shape(0)) - 1;
    require(blocked.shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d, b)) &&
                blocked.shape(2) == 32,
            "ivf_fast_scan: blocked must be (nb, fs_row_bytes(d, b), 32)");
    check_centroids(centroids, b, "ivf_fast_scan");
    require(mult.ndim() == 1 && add.ndim() == 1 && mult.shape(0) == static_cast<size_t>(n) &&
                add.shape(0) == static_cast<size_t>(n), "ivf_fast_scan: mult/add length");
    require(nlist >= 0 && (nlist == 0 || list_blocks.data()[0] == 0), "ivf_fast_scan: lists");
    for (int64_t l = 0; l < nlist; ++l)
      require(list_blocks.data()[l] <= list_blocks.data()[l + 1] &&
                  list_blocks.data()[l + 1] <= nb, "ivf_fast_scan: list_blocks not monotone");
    require(probes.shape(0) == static_cast<size_t>(nq) && offsets.shape(0) == probes.shape(0) &&
                offsets.shape(1) == probes.shape(1), "ivf_fast_scan: probes/offsets shape");
    check_topk_out(out_vals, out_idx, nq, k, "ivf_fast_scan");
    nb::gil_scoped_release rel;
    tqvec::ivf_fast_scan(qr.data(), nq, d, blocked.data(), n, b, centroids.data(), mult.data(),
                         add.data(), list_blocks.data(), nlist, probes.data(), offsets.data(),
                         static_cast<int64_t>(probes.shape(1)), k, approx, out_vals.data(),
                         out_idx.data(), nthreads);
  });

  m.def("row_sqnorms", [](CArr<const float> x, CArr<float> out) {
    require(x.ndim() == 2 && out.ndim() == 1 && out.shape(0) == x.shape(0),
            "row_sqnorms: x must be (n, d) and out (n,)");
    nb::gil_scoped_release rel;
    tqvec::row_sqnorms(x.data(), x.shape(0), x.shape(1), out.data());
  });
  m.def("row_dots", [](CArr<const float> x, CArr<const float> v, CArr<float> out) {
    require(x.ndim() == 2 && v.ndim() == 1 && v.shape(0) == x.shape(1) && out.ndim() == 1 &&
                out.shape(0) == x.shape(0),
            "row_dots: x must be (n, d), v (d,) and out (n,)");
    nb::gil_scoped_release rel;
    tqvec::row_dots(x.data(), x.shape(0), x.shape(1), v.data(), out.data());
  });
  m.def("rescore_topk", [](CArr<const float> q, CArr<const float> x, CArr<const int64_t> rows,
                           int metric, int64_t k, CArr<float> vals, CArr<int64_t> idx,
                           int nthreads) {
    require(q.ndim() == 2 && x.ndim() == 2 && rows.ndim() == 2 && vals.ndim() == 2 &&
                idx.ndim() == 2, "rescore_topk: bad ranks");
    const int64_t nq = q.shape(0), d = q.shape(1), n = x.shape(0), kk = rows.shape(1);
    require(x.shape(1) == static_cast<size_t>(d) && rows.shape(0) == static_cast<size_t>(nq),
            "rescore_topk: shapes");
    require(metric >= 0 && metric <= 2, "rescore_topk: metric must be 0, 1 or 2");
    check_topk_out(vals, idx, nq, k, "rescore_topk");
    for (int64_t i = 0; i < nq * kk; ++i)
      require(rows.data()[i] >= -1 && rows.data()[i] < n, "rescore_topk: row out of range");
    nb::gil_scoped_release rel;
    tqvec::rescore_topk(q.data(), nq, d, x.data(), rows.data(), kk, metric, k, vals.data(),
                        idx.data(), nthreads);
  });

  m.def("ivf_probe", [](CArr<const float> q, CArr<const float> c, CArr<const float> csq, bool l2,
                        CArr<int64_t> probes, CArr<float> offsets, int nthreads) {
    require(q.ndim() == 2 && c.ndim() == 2 && csq.ndim() == 1 && probes.ndim() == 2 &&
                offsets.ndim() == 2, "ivf_probe: bad ranks");
    const int64_t nq = q.shape(0), d = q.shape(1), nlist = c.shape(0), np_ = probes.shape(1);
    require(c.shape(1) == static_cast<size_t>(d) && csq.shape(0) == c.shape(0),
            "ivf_probe: centroids must be (nlist, d) with nlist norms");
    require(probes.shape(0) == static_cast<size_t>(nq) && offsets.shape(0) == probes.shape(0) &&
                offsets.shape(1) == probes.shape(1) && np_ >= 1 && np_ <= nlist,
            "ivf_probe: outputs must be (nq, nprobe), 1 <= nprobe <= nlist");
    nb::gil_scoped_release rel;
    tqvec::ivf_probe(q.data(), nq, d, c.data(), nlist, csq.data(), l2, np_, probes.data(),
                     offsets.data(), nthreads);
  });

  m.def("hadamard_rotate", [](CArr<const float> x, CArr<const int64_t> perms,
                              CArr<const float> signs, int64_t p, bool inverse,
                              CArr<float> out, int nthreads) {
    require(x.ndim() == 2 && out.ndim() == 2 && perms.ndim() == 2 && signs.ndim() == 2,
            "hadamard_rotate: bad ranks");
    const int64_t n = x.shape(0), d = x.shape(1);
    const int64_t rounds = perms.shape(0);
    require(perms.shape(1) == static_cast<size_t>(d) && signs.shape(0) == perms.shape(0) &&
                signs.shape(1) == static_cast<size_t>(d),
            "hadamard_rotate: perms/signs shape");
    require(p >= 1 && (p & (p - 1)) == 0 && p <= d && 2 * p >= d, "hadamard_rotate: block size");
    require(out.shape(0) == static_cast<size_t>(n) && out.shape(1) == static_cast<size_t>(d),
            "hadamard_rotate: out has the wrong shape");
    for (int64_t k = 0; k < rounds * d; ++k)
      require(perms.data()[k] >= 0 && perms.data()[k] < d, "hadamard_rotate: perm out of range");
    nb::gil_scoped_release rel;
    tqvec::hadamard_rotate(x.data(), n, d, perms.data(), signs.data(), static_cast<int>(rounds),
                           p, inverse, out.data(), nthreads);
  });

  nb::class_<IvfSearcher>(m, "IVFSearcher")
      .def("__init__",
           [](IvfSearcher* self, CArr<const float> centroids, CArr<const float> csq,
              CArr<const int64_t> perms, CArr<const float> signs, int64_t p,
              CArr<const uint8_t> blocked, int b, CArr<const float> codebook,
              CArr<const float> mult, CArr<const float> add, CArr<const int64_t> list_blocks,
              CArr<const int64_t> pos, CArr<const int64_t> ids, CArr<const float> ref,
              int metric, CArr<const uint8_t> ref_packed, int ref_b,
              CArr<const int64_t> ref_perms, CArr<const float> ref_signs, int64_t ref_p,
              CArr<const float> ref_cent, CArr<const float> ref_mult,
              CArr<const float> ref_add) {
             require(centroids.ndim() == 2 && csq.ndim() == 1 && perms.ndim() == 2 &&
                         signs.ndim() == 2 && blocked.ndim() == 3 && codebook.ndim() == 1 &&
                         mult.ndim() == 1 && add.ndim() == 1 && list_blocks.ndim() == 1 &&
                         pos.ndim() == 1 && ids.ndim() == 1 && ref.ndim() == 2,
                     "IVFSearcher: bad ranks");
             const int64_t nlist = centroids.shape(0), d = centroids.shape(1);
             const int64_t nb_ = blocked.shape(0), npad = 32 * nb_;
             const int64_t n = ids.shape(0);
             require(nlist >= 1 && csq.shape(0) == centroids.shape(0),
                     "IVFSearcher: centroids must be (nlist, d) with nlist norms");
             const tqvec::RotationArgs rot = checked_rotation(perms, signs, p, d, "IVFSearcher");
             require(b >= 1 && b <= 4 && nb_ >= 1 &&
                         blocked.shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d, b)) &&
                         blocked.shape(2) == 32,
                     "IVFSearcher: blocked must be (nb >= 1, fs_row_bytes(d, b), 32)");
             check_centroids(codebook, b, "IVFSearcher");
             require(mult.shape(0) == static_cast<size_t>(npad) &&
                         add.shape(0) == static_cast<size_t>(npad) &&
                         pos.shape(0) == static_cast<size_t>(npad),
                     "IVFSearcher: mult/add/pos length");
             require(list_blocks.shape(0) == static_cast<size_t>(nlist + 1) &&
                         list_blocks.data()[0] == 0, "IVFSearcher: list_blocks");
             for (int64_t l = 0; l < nlist; ++l)
               require(list_blocks.data()[l] <= list_blocks.data()[l + 1] &&
                           list_blocks.data()[l + 1] <= nb_,
                       "IVFSearcher: list_blocks not monotone");
             for (int64_t t = 0; t < npad; ++t)
               require(pos.data()[t] >= -1 && pos.data()[t] < n, "IVFSearcher: pos out of range");
             require(ref.shape(0) == 0 || (ref.shape(0) == static_cast<size_t>(n) &&
                                           ref.shape(1) == static_cast<size_t>(d)),
                     "IVFSearcher: ref must be (n, d) or empty");
             require(metric >= 0 && metric <= 2, "IVFSearcher: metric must be 0, 1 or 2");
             const tqvec::CodedRefine rc =
                 coded_refine(ref_packed, ref_b, ref_perms, ref_signs, ref_p, ref_cent, ref_mult,
                              ref_add, n, d, rot, "IVFSearcher");
             require(!(rc.packed && ref.shape(0)), "IVFSearcher: one refinement");
             tqvec::IvfSearchArgs a{};
             a.d = d;
             a.nlist = nlist;
             a.centroids = centroids.data();
             a.csq = csq.data();
             a.rot = rot;
             a.blocked = blocked.data();
             a.npad = npad;
             a.b = b;
             a.codebook = codebook.data();
             a.mult = mult.data();
             a.add = add.data();
             a.list_blocks = list_blocks.data();
             a.pos = pos.data();
             a.ids = ids.data();
             a.ref = ref.shape(0) ? ref.data() : nullptr;
             a.ref_codes = rc;
             a.ref_n = n;
             a.metric = metric;
             new (self) IvfSearcher{centroids, csq,        signs,     codebook,  mult,
                                    add,       ref,        perms,     list_blocks, pos,
                                    ids,       blocked,    ref_packed, ref_perms, ref_signs,
                                    ref_cent,  ref_mult,   ref_add,   a};
           })
      .def("search", [](IvfSearcher& s, CArr<const float> q, int64_t nprobe, int64_t kk,
                        CArr<float> D, CArr<int64_t> I, int nthreads) {
        require(q.ndim() == 2 && D.ndim() == 2 && I.ndim() == 2, "IVFSearcher.search: bad ranks");
        const int64_t nq = q.shape(0), k = D.shape(1);
        require(q.shape(1) == static_cast<size_t>(s.args.d), "IVFSearcher.search: q must be (nq, d)");
        require(nprobe >= 1 && nprobe <= s.args.nlist, "IVFSearcher.search: nprobe");
        require(kk >= 1 && k >= 1, "IVFSearcher.search: kk and k must be >= 1");
        require(D.shape(0) == static_cast<size_t>(nq) && I.shape(0) == static_cast<size_t>(nq) &&
                    I.shape(1) == D.shape(1), "IVFSearcher.search: outputs");
        tqvec::IvfSearchArgs a = s.args;
        a.nprobe = nprobe;
        a.kk = std::min(kk, std::max<int64_t>(a.ref_n, 1));  // at most one candidate per row
        nb::gil_scoped_release rel;
        if (!all_finite(q.data(), nq * a.d)) return false;  // the caller reports it
        if (nq) tqvec::ivf_search(a, q.data(), nq, k, D.data(), I.data(), nthreads);
        return true;
      });

  nb::class_<FlatSearcher>(m, "FlatSearcher")
      .def("__init__",
           [](FlatSearcher* self, CArr<const int64_t> perms, CArr<const float> signs, int64_t p,
              CArr<const uint8_t> blocked, int64_t n, int b, CArr<const float> codebook,
              CArr<const float> mult, CArr<const float> add, CArr<const int64_t> ids,
              CArr<const uint8_t> packed, int bfull, CArr<const float> cfull,
              CArr<const float> add1, int64_t prefilter, int metric, CArr<const float> center,
              bool normalize, CArr<const float> ip_center, CArr<const float> ref_x,
              CArr<const uint8_t> ref_packed, int ref_b, CArr<const int64_t> ref_perms,
              CArr<const float> ref_signs, int64_t ref_p, CArr<const float> ref_cent,
              CArr<const float> ref_mult, CArr<const float> ref_add) {
             require(perms.ndim() == 2 && signs.ndim() == 2 && blocked.ndim() == 3 &&
                         codebook.ndim() == 1 && mult.ndim() == 1 && add.ndim() == 1 &&
                         ids.ndim() == 1 && packed.ndim() == 2 && cfull.ndim() == 1 &&
                         add1.ndim() == 1, "FlatSearcher: bad ranks");
             const int64_t d = perms.shape(1);
             const tqvec::RotationArgs rot = checked_rotation(perms, signs, p, d, "FlatSearcher");
             const bool two = packed.shape(0) > 0;
             require(b >= 1 && b <= 4 && (!two || b == 1), "FlatSearcher: bits");
             // two-stage: blocked is the sign plane of the first d1 coordinates
             const int64_t d1 = two ? sign_plane_dims(blocked, d) : d;
             require(n >= 1 && blocked.shape(0) == static_cast<size_t>((n + 31) / 32) &&
                         d1 >= 1 &&
                         blocked.shape(1) == static_cast<size_t>(tqvec::fs_row_bytes(d1, b)) &&
                         blocked.shape(2) == 32,
                     "FlatSearcher: blocked must be (ceil(n/32), fs_row_bytes(d, b), 32), or "
                     "with a prefilter (ceil(n/32), ceil(d1/8), 32), d1 <= d");
             check_centroids(codebook, b, "FlatSearcher");
             require(mult.shape(0) == static_cast<size_t>(n) &&
                         add.shape(0) == static_cast<size_t>(n) &&
                         ids.shape(0) == static_cast<size_t>(n),
                     "FlatSearcher: mult/add/ids length");
             if (two) {
               check_bits(bfull);
               require(packed.shape(0) == static_cast<size_t>(n) &&
                           packed.shape(1) == static_cast<size_t>(rb(d, bfull)) &&
                           add1.shape(0) == static_cast<size_t>(n) && prefilter >= 1,
                       "FlatSearcher: two-stage arrays");
               check_centroids(cfull, bfull, "FlatSearcher");
             }
             require(metric >= 0 && metric <= 2, "FlatSearcher: metric must be 0, 1 or 2");
             require(center.ndim() == 1 && (center.shape(0) == 0 ||
                                            center.shape(0) == static_cast<size_t>(d)),
                     "FlatSearcher: center must be empty or (d,)");
             require(!(normalize && center.shape(0)), "FlatSearcher: normalize or center");
             require(ip_center.ndim() == 1 &&
                         (ip_center.shape(0) == 0 ||
                          (ip_center.shape(0) == static_cast<size_t>(d) && metric == 0 &&
                           center.shape(0) == 0)),
                     "FlatSearcher: ip_center must be empty or (d,), with the ip metric");
             // a refinement: exact vectors (n, d), or TurboQuant-mse codes with their rotation
             const bool rx = ref_x.ndim() == 2 && ref_x.shape(0) > 0;
             const tqvec::CodedRefine rc =
                 coded_refine(ref_packed, ref_b, ref_perms, ref_signs, ref_p, ref_cent, ref_mult,
                              ref_add, n, d, rot, "FlatSearcher");
             require(!(rx && rc.packed) && (!(rx || rc.packed) || !two),
                     "FlatSearcher: one refinement, and not with a prefilter");
             require(!rx || (ref_x.shape(0) == static_cast<size_t>(n) &&
                             ref_x.shape(1) == static_cast<size_t>(d)),
                     "FlatSearcher: ref_x must be (n, d)");
             tqvec::FlatSearchArgs a{};
             a.d = d;
             a.n = n;
             a.rot = rot;
             a.blocked = blocked.data();
             a.b = b;
             a.codebook = codebook.data();
             a.mult = mult.data();
             a.add = add.data();
             a.packed = two ? packed.data() : nullptr;
             a.d1 = d1;
             a.bfull = bfull;
             a.cfull = cfull.data();
             a.add1 = add1.data();
             a.prefilter = prefilter;
             a.ids = ids.data();
             a.metric = metric;
             a.center = center.shape(0) ? center.data() : nullptr;
             a.normalize = normalize;
             a.ip_center = ip_center.shape(0) ? ip_center.data() : nullptr;
             a.ref_x = rx ? ref_x.data() : nullptr;
             a.ref_codes = rc;
             a.k_factor = 1;
             new (self) FlatSearcher{perms,     ids,       signs,      codebook,  mult,
                                     add,       cfull,     add1,       center,    ip_center,
                                     blocked,   packed,    ref_x,      ref_packed, ref_perms,
                                     ref_signs, ref_cent,  ref_mult,   ref_add,   a};
           })
      .def("search", [](FlatSearcher& s, CArr<const float> q, CArr<float> D, CArr<int64_t> I,
                        int nthreads, int64_t k_factor) {
        require(k_factor >= 1, "FlatSearcher.search: k_factor must be >= 1");
        require(q.ndim() == 2 && D.ndim() == 2 && I.ndim() == 2,
                "FlatSearcher.search: bad ranks");
        const int64_t nq = q.shape(0), k = D.shape(1);
        require(q.shape(1) == static_cast<size_t>(s.args.d),
                "FlatSearcher.search: q must be (nq, d)");
        require(k >= 1 && D.shape(0) == static_cast<size_t>(nq) &&
                    I.shape(0) == static_cast<size_t>(nq) && I.shape(1) == D.shape(1),
                "FlatSearcher.search: outputs");
        nb::gil_scoped_release rel;
        if (!all_finite(q.data(), nq * s.args.d)) return false;  // the caller reports it
        tqvec::FlatSearchArgs a = s.args;  // the index's k_factor may change between searches
        a.k_factor = k_factor;
        if (nq) tqvec::flat_search(a, q.data(), nq, k, D.data(), I.data(), nthreads);
        return true;
      });
}
