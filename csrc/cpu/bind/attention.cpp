// Bindings of decode attention over TurboQuant-mse key/value codes: one segment's softmax state
// (decode_attention) and a whole decode step of a cache layer (attention_step: per-side
// constants prepared once as a KVSide, a layer's code buffers once as a KVStepPlan).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "check.h"

namespace tqvec::bind {
namespace {

using AnyArr = nb::ndarray<nb::c_contig, nb::device::cpu>;

// A code segment side's constants (kernels.h KVCodeSide less its per-call buffers): the codec's
// rotation, centroids and bits, an optional channel scale (mu, sc: (heads, d)) and, for
// multipliers stored as 8-bit codes, their table (256).
struct KVSide {
  Rotation rotation;
  CArr<const float> centroids;
  int bits;
  std::optional<CArr<const float>> mu, sc, norm_table;
  int64_t d, heads;
};

// A decode step's prepared code segments and fixed full-precision rows (the class KVStepPlan;
// the segments' ranges set per step).
struct KVStepPlan {
  int64_t heads, bh, d;
  int exact_dtype;
  std::vector<nb::object> sides;  // held: the segments point into them and into the arrays
  std::vector<CArr<const uint8_t>> packed;
  std::vector<AnyArr> norms, exact;
  std::vector<KVCodeSegment> segs;
  std::vector<KVExact> fixed;
};

// Full-precision (keys, values) pairs (bh, n, d) of exact_dtype's width as KVExact.
void exact_rows(const std::vector<AnyArr>& exact, int64_t bh, int64_t d, int exact_dtype,
                const char* op, std::vector<KVExact>& out) {
  require(exact.size() % 2 == 0, op, ": exact must hold (keys, values) pairs");
  const int bits = exact_dtype == kF32 ? 32 : 16;
  for (size_t e = 0; e < exact.size(); e += 2) {
    const AnyArr& k = exact[e];
    const AnyArr& v = exact[e + 1];
    require(k.ndim() == 3 && v.ndim() == 3 && dim(k, 0) == bh && dim(k, 2) == d &&
                dim(v, 0) == bh && dim(v, 1) == dim(k, 1) && dim(v, 2) == d, op,
            ": exact keys and values must have shape (bh, n, d)");
    require(k.dtype().bits == bits && v.dtype().bits == bits, op,
            ": exact rows must have exact_dtype's width");
    out.push_back(KVExact{k.data(), v.data(), exact_dtype, dim(k, 1)});
  }
}

bool is(const AnyArr& a, uint8_t code, int bits) {
  return a.dtype().code == code && a.dtype().bits == bits && a.dtype().lanes == 1;
}

// A side with this call's codes (bh, t, row bytes) and multipliers (bh, t): float16, or uint8
// codes when the side has a norm table.
KVCodeSide code_side(const KVSide& s, const CArr<const uint8_t>& packed, const AnyArr& norms,
                     int64_t bh, int64_t t, const char* op) {
  check_shape(packed, {bh, t, packed_row_bytes(s.d, s.bits)}, op, "packed");
  require(norms.ndim() == 2 && dim(norms, 0) == bh && dim(norms, 1) == t, op,
          ": norms must have the codes' (bh, t) shape");
  KVCodeSide out{packed.data(), nullptr, nullptr, nullptr, s.centroids.data(), s.bits,
                 s.rotation.args, s.mu ? s.mu->data() : nullptr, s.sc ? s.sc->data() : nullptr};
  if (s.norm_table) {
    require(is(norms, static_cast<uint8_t>(nb::dlpack::dtype_code::UInt), 8), op,
            ": a side with a norm table takes uint8 norm codes");
    out.norm8 = static_cast<const uint8_t*>(norms.data());
    out.norm_table = s.norm_table->data();
  } else {
    require(is(norms, static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16), op,
            ": norms must be float16");
    out.norm16 = static_cast<const uint16_t*>(norms.data());
  }
  return out;
}

}  // namespace

void bind_attention(nb::module_& m) {
  using nb::arg;
  m.def("decode_attention", [](CArr<const float> qr, CArr<const float> qbias,
                               CArr<const uint8_t> kpacked, CArr<const float> knorm,
                               CArr<const float> kcent, int kb, CArr<const uint8_t> vpacked,
                               CArr<const float> vnorm, CArr<const float> vcent, int vb,
                               CArr<const int32_t> lo, CArr<const int32_t> hi, float scale,
                               CArr<float> m, CArr<float> l, CArr<float> acc, int nthreads) {
    const char* op = "decode_attention";
    check_bits(kb, 8, op);
    check_bits(vb, 8, op);
    check_shape(qr, {kAny, kAny, kAny}, op, "qr");
    const int64_t bh = dim(qr, 0), g = dim(qr, 1), d = dim(qr, 2);
    check_shape(kpacked, {bh, kAny, packed_row_bytes(d, kb)}, op, "kpacked");
    const int64_t t = dim(kpacked, 1);
    check_shape(qbias, {bh, g}, op, "qbias");
    check_shape(vpacked, {bh, t, packed_row_bytes(d, vb)}, op, "vpacked");
    check_shape(knorm, {bh, t}, op, "knorm");
    check_shape(vnorm, {bh, t}, op, "vnorm");
    check_shape(kcent, {int64_t{1} << kb}, op, "kcent");
    check_shape(vcent, {int64_t{1} << vb}, op, "vcent");
    check_shape(lo, {bh}, op, "lo");
    check_shape(hi, {bh}, op, "hi");
    check_shape(m, {bh, g}, op, "m");
    check_shape(l, {bh, g}, op, "l");
    check_shape(acc, {bh, g, d}, op, "acc");
    nb::gil_scoped_release rel;
    decode_attention(qr.data(), qbias.data(), bh, g, d, kpacked.data(), knorm.data(),
                     kcent.data(), kb, vpacked.data(), vnorm.data(), vcent.data(), vb, t,
                     lo.data(), hi.data(), scale, m.data(), l.data(), acc.data(), nthreads);
  });

  nb::class_<KVSide>(m, "KVSide")
      .def("__init__", [](KVSide* self, const Rotation& rotation, CArr<const float> centroids,
                          int bits, std::optional<CArr<const float>> mu,
                          std::optional<CArr<const float>> sc,
                          std::optional<CArr<const float>> norm_table) {
        const char* op = "KVSide";
        check_bits(bits, 8, op);
        check_shape(centroids, {int64_t{1} << bits}, op, "centroids");
        const int64_t d = dim(rotation.perms, 1);
        int64_t heads = 0;
        require(mu.has_value() == sc.has_value(), op, ": mu and sc come together");
        if (mu) {
          check_shape(*mu, {kAny, d}, op, "mu");
          heads = dim(*mu, 0);
          check_shape(*sc, {heads, d}, op, "sc");
        }
        if (norm_table) check_shape(*norm_table, {256}, op, "norm_table");
        new (self) KVSide{rotation, centroids, bits, mu, sc, norm_table, d, heads};
      }, nb::kw_only(), arg("rotation"), arg("centroids"), arg("bits"),
         arg("mu").none() = nb::none(), arg("sc").none() = nb::none(),
         arg("norm_table").none() = nb::none());

  // A decode step's code segments prepared once for as long as their buffers live: sides
  // (key, value per segment), codes (bh, t, row bytes) and multipliers (bh, t) checked and held
  // (the arrays kept alive by the plan), and full-precision (keys, values) pairs that stay
  // (bh, n, d; exact_dtype kernels.h kF32 / kBF16 / kF16: float32 or the 16-bit bits of
  // bfloat16 / float16), so that a step converts only its queries, the ranges and the rows
  // that change. bh rows of queries per step, d their width.
  nb::class_<KVStepPlan>(m, "KVStepPlan")
      .def("__init__", [](KVStepPlan* self, int64_t heads, int64_t bh, int64_t d,
                          std::vector<nb::object> sides, std::vector<CArr<const uint8_t>> packed,
                          std::vector<AnyArr> norms, std::vector<AnyArr> exact,
                          int exact_dtype) {
        const char* op = "KVStepPlan";
        require(d >= 1, op, ": d must be >= 1");
        require(heads >= 1 && bh >= 0 && bh % heads == 0, op,
                ": heads must be positive and divide bh");
        require(sides.size() % 2 == 0 && packed.size() == sides.size() &&
                    norms.size() == sides.size(), op,
                ": sides, packed and norms must hold a (key, value) pair per code segment");
        require(exact_dtype >= kF32 && exact_dtype <= kF16, op,
                ": exact_dtype must be 0, 1 or 2");
        const size_t nseg = sides.size() / 2;
        KVStepPlan plan{heads, bh, d, exact_dtype, sides, packed, norms, exact, {}, {}};
        for (size_t s = 0; s < nseg; ++s) {
          const KVSide* ks = nb::cast<const KVSide*>(sides[2 * s]);
          const KVSide* vs = nb::cast<const KVSide*>(sides[2 * s + 1]);
          require(ks && vs, op, ": a side is None");
          require(ks->d == d && vs->d == d, op, ": the sides' dimension (", std::to_string(ks->d),
                  ", ", std::to_string(vs->d), ") must equal the queries' (", std::to_string(d),
                  ")");
          require((!ks->mu || ks->heads == heads) && (!vs->mu || vs->heads == heads), op,
                  ": a side's channel scale must have one row per KV head");
          check_shape(packed[2 * s], {bh, kAny, kAny}, op, "packed");
          const int64_t t = dim(packed[2 * s], 1);
          plan.segs.push_back(KVCodeSegment{code_side(*ks, packed[2 * s], norms[2 * s], bh, t, op),
                                            code_side(*vs, packed[2 * s + 1], norms[2 * s + 1],
                                                      bh, t, op),
                                            t, 0, 0});
        }
        exact_rows(exact, bh, d, exact_dtype, op, plan.fixed);
        new (self) KVStepPlan(std::move(plan));
      }, arg("heads"), arg("bh"), arg("d"), arg("sides"), arg("packed"), arg("norms"),
         arg("exact"), arg("exact_dtype"))
      .def_ro("exact_dtype", &KVStepPlan::exact_dtype)
      // One step: q (bh, g, d) float32 -> out (bh, g, d); ranges (lo, hi) per code segment;
      // exact: this step's full-precision (keys, values) pairs, after the plan's own.
      .def("run", [](const KVStepPlan& p, CArr<const float> q, float scale,
                     std::vector<int64_t> ranges, std::vector<AnyArr> exact, CArr<float> out,
                     int nthreads) {
        const char* op = "attention_step";
        check_shape(q, {p.bh, kAny, kAny}, op, "q");
        const int64_t g = dim(q, 1), d = dim(q, 2);
        require(d == p.d, op, ": the sides' dimension (", std::to_string(p.d),
                ") must equal the queries' (", std::to_string(d), ")");
        check_shape(out, {p.bh, g, d}, op, "out");
        require(ranges.size() == 2 * p.segs.size(), op,
                ": ranges must hold a (lo, hi) pair per code segment");
        std::vector<KVCodeSegment> segs = p.segs;
        for (size_t s = 0; s < segs.size(); ++s) {
          const int64_t lo = ranges[2 * s], hi = ranges[2 * s + 1];
          require(0 <= lo && lo <= hi && hi <= segs[s].t, op,
                  ": a range must satisfy 0 <= lo <= hi <= t");
          segs[s].lo = lo;
          segs[s].hi = hi;
        }
        std::vector<KVExact> ex = p.fixed;
        exact_rows(exact, p.bh, d, p.exact_dtype, op, ex);
        nb::gil_scoped_release rel;
        attention_step(q.data(), p.bh, p.heads, g, d, scale, segs.data(),
                       static_cast<int>(segs.size()), ex.data(), static_cast<int>(ex.size()),
                       out.data(), nthreads);
      }, arg("q"), arg("scale"), arg("ranges"), arg("exact"), arg("out"), arg("nthreads"));
}

}  // namespace tqvec::bind
