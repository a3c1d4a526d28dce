// Bindings of the one-call searches (search.cpp): their arguments come as keywords and small
// argument objects (Rotation, Prefilter, CodeRefinement), checked once when the searcher is
// built, kept alive by it, and read by every search.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "check.h"

namespace tqvec::bind {

namespace {

using OptF = std::optional<CArr<const float>>;

// A flat index's prefilter: keep * k rows of the first pass over the sign plane (with row
// offsets first_add and multipliers first_mult, or the scan's mult) re-scored by the full codes
// (packed, bits, centroids; the scan's mult and add) - or with bound > 0 every row whose error
// bound reaches the k-th (fast_scan_two_stage's bound; keep unused).
struct Prefilter {
  int64_t keep;
  CArr<const uint8_t> packed;
  int bits;
  CArr<const float> centroids, first_add;
  OptF first_mult;
  float bound_sigma = 0.0f, bound_gain = 1.0f, bound_cnorm = 1.0f, bound_min_sin = 0.0f;
};

// A refinement by TurboQuant-mse codes: packed rows, their rotation and table terms.
struct CodeRefinement {
  Rotation rotation;
  CArr<const uint8_t> packed;
  int bits;
  CArr<const float> centroids, mult, add;
};

CodedRefine coded_refine(const CodeRefinement* r, int64_t n, int64_t d, const RotationArgs& base,
                         const char* op) {
  CodedRefine c{};
  if (r == nullptr) return c;
  require(r->rotation.args.perms != nullptr && dim(r->rotation.perms, 1) == d, op,
          ": the refinement's rotation must be of the d coordinates");
  c.codes = packed_table(r->packed, d, r->bits, r->centroids, r->mult, r->add, op);
  require(c.codes.n == n, op, ": the refinement must hold codes of the n rows");
  c.rot = r->rotation.args;
  // the scan's own rotation (a refinement made with the codes' seed, as index_factory does):
  // the scan's rotated queries serve the re-scoring too
  const size_t rd = static_cast<size_t>(c.rot.rounds) * static_cast<size_t>(d);
  c.same_rotation = c.rot.p == base.p && c.rot.rounds == base.rounds &&
                    std::equal(c.rot.perms, c.rot.perms + rd, base.perms) &&
                    std::equal(c.rot.signs, c.rot.signs + rd, base.signs);
  return c;
}

const float* exact_refinement(const OptF& x, int64_t n, int64_t d, const char* op) {
  if (!x) return nullptr;
  check_shape(*x, {n, d}, op, "refine_x");
  return x->data();
}

const float* optional_vector(const OptF& v, int64_t d, const char* op, const char* name) {
  if (!v) return nullptr;
  check_shape(*v, {d}, op, name);
  return v->data();
}

// (nq, k) of a one-call search's queries q (nq, d) and outputs D, I (nq, k), checked.
std::pair<int64_t, int64_t> search_shape(const CArr<const float>& q, const CArr<float>& D,
                                         const CArr<int64_t>& I, int64_t d, const char* op) {
  check_shape(q, {kAny, d}, op, "q");
  const int64_t nq = dim(q, 0);
  check_shape(D, {nq, kAny}, op, "D");
  check_shape(I, {nq, dim(D, 1)}, op, "I");
  require(dim(D, 1) >= 1, op, ": k must be >= 1");
  return {nq, dim(D, 1)};
}

struct FlatSearcher {
  Rotation rotation;
  CArr<const uint8_t> blocked;
  CArr<const float> centroids, mult, add;
  CArr<const int64_t> ids;
  std::optional<Prefilter> prefilter;
  OptF center, ip_center, refine_x;
  std::optional<CodeRefinement> refine_codes;
  FlatSearchArgs args;
};

struct IvfSearcher {
  CArr<const float> centroids, centroid_norms;
  Rotation rotation;
  CArr<const uint8_t> blocked;
  CArr<const float> codebook, mult, add;
  CArr<const int64_t> list_blocks, pos, ids;
  OptF refine_x;
  std::optional<CodeRefinement> refine_codes;
  IvfSearchArgs args;
};

// A flat index over several terms whose queries are one product x W (PCA,TQ{b}): W (d, m),
// each term's first column, blocked codes, centroids, multipliers and width; with nfirst > 0
// every term's packed rows too (two stages).
struct TermsSearcher {
  CArr<const float> W;
  std::vector<CArr<const uint8_t>> blocked, packed;
  std::vector<CArr<const float>> centroids, mults;
  CArr<const float> add;
  CArr<const int64_t> ids;
  OptF center, ip_center;
  TermsSearchArgs args;
};

void build_terms(TermsSearcher* self, CArr<const float> W, std::vector<int64_t> cols,
                 std::vector<CArr<const uint8_t>> blocked, std::vector<CArr<const float>> centroids,
                 std::vector<CArr<const float>> mults, std::vector<int> bits, int64_t n,
                 CArr<const float> add, CArr<const int64_t> ids, int metric, int nfirst,
                 int64_t prefilter, std::vector<CArr<const uint8_t>> packed, OptF center,
                 bool normalize, OptF ip_center) {
  const char* op = "TermsSearcher";
  check_shape(W, {kAny, kAny}, op, "W");
  const int64_t d = dim(W, 0), m = dim(W, 1);
  const size_t T = cols.size();
  require(T >= 1 && T <= 8 && blocked.size() == T && centroids.size() == T &&
              mults.size() == T && bits.size() == T,
          op, ": 1 to 8 terms, each with a first column, blocked codes, centroids, "
          "multipliers and bits");
  require(n >= 1, op, ": n must be >= 1");
  check_shape(add, {n}, op, "add");
  check_shape(ids, {n}, op, "ids");
  check_metric(metric, op);
  require(nfirst >= 0 && nfirst <= static_cast<int>(T) &&
              (nfirst == 0 || (packed.size() == T && prefilter >= 1)),
          op, ": nfirst must be 0, or 1 to the number of terms with packed codes for every "
          "term and prefilter >= 1");
  TermsSearchArgs a{};
  a.d = d, a.m = m, a.n = n, a.W = W.data(), a.add = add.data(), a.ids = ids.data();
  a.nfirst = nfirst, a.prefilter = prefilter, a.metric = metric;
  require(!(normalize && center), op, ": normalize or center, not both");
  require(!ip_center || metric != kRescoreL2, op, ": ip_center goes with ip or cosine");
  a.center = optional_vector(center, d, op, "center");
  a.normalize = normalize;
  a.ip_center = optional_vector(ip_center, d, op, "ip_center");
  int64_t covered = 0;  // the terms' columns lie side by side in W
  for (size_t x = 0; x < T; ++x) {
    require(cols[x] >= 0 && cols[x] < m, op, ": each term's first column must lie in W");
    const int64_t end = x + 1 < T ? cols[x + 1] : m;
    const int64_t dt = end - cols[x];
    require(dt >= 1, op, ": the terms' columns must be increasing");
    const CodeTable c = blocked_table(blocked[x], n, dt, bits[x], centroids[x], mults[x], add, op);
    const uint8_t* rows = nullptr;
    if (nfirst > 0) {
      check_shape(packed[x], {n, packed_row_bytes(dt, c.b)}, op, "packed codes");
      rows = packed[x].data();
    }
    a.terms.push_back({nullptr, dt, c.codes, c.b, c.centroids, c.mult, rows});
    covered += dt;
  }
  require(cols[0] == 0 && covered == m, op, ": the terms' columns must cover W's");
  a.cols = cols;
  new (self) TermsSearcher{W, blocked, packed, centroids, mults, add, ids, center, ip_center, a};
}

void build_flat(FlatSearcher* self, const Rotation& rotation, CArr<const uint8_t> blocked,
                int64_t n, int bits, CArr<const float> centroids, CArr<const float> mult,
                CArr<const float> add, CArr<const int64_t> ids, int metric,
                const Prefilter* prefilter, OptF center, bool normalize, OptF ip_center,
                OptF refine_x, const CodeRefinement* refine_codes) {
  const char* op = "FlatSearcher";
  const int64_t d = dim(rotation.perms, 1);
  require(n >= 1, op, ": n must be >= 1");
  check_shape(ids, {n}, op, "ids");
  check_metric(metric, op);
  FlatSearchArgs a{};
  a.rot = rotation.args;
  a.d = d;
  if (prefilter != nullptr) {
    // the scan is the sign plane of the first d1 <= d coordinates; the full codes re-score
    a.prefilter_bound = sign_bound(prefilter->bound_sigma, prefilter->bound_gain,
                                   prefilter->bound_cnorm, prefilter->bound_min_sin, op);
    require(bits == 1 && (prefilter->keep >= 1 || a.prefilter_bound.sigma > 0.0f), op,
            ": a prefilter scans 1-bit signs and keeps >= 1 rows per result or has a bound");
    a.scan = blocked_table(blocked, n, sign_plane_dims(blocked, d, op), 1, centroids,
                           prefilter->first_mult ? *prefilter->first_mult : mult,
                           prefilter->first_add, op);
    a.full = packed_table(prefilter->packed, d, prefilter->bits, prefilter->centroids, mult, add,
                          op);
    require(a.full.n == n, op, ": the prefilter's codes must hold the n rows");
    a.prefilter = prefilter->keep;
  } else {
    a.scan = blocked_table(blocked, n, d, bits, centroids, mult, add, op);
  }
  a.ids = ids.data();
  a.metric = metric;
  require(!(normalize && center), op, ": normalize or center, not both");
  a.center = optional_vector(center, d, op, "center");
  a.normalize = normalize;
  require(!ip_center || (metric == kRescoreIP && !center), op,
          ": ip_center goes with the ip metric and no center");
  a.ip_center = optional_vector(ip_center, d, op, "ip_center");
  // a refinement: exact vectors (n, d), or TurboQuant-mse codes with their rotation
  require(!(refine_x && refine_codes) && (!(refine_x || refine_codes) || !prefilter), op,
          ": one refinement, and not with a prefilter");
  a.ref_x = exact_refinement(refine_x, n, d, op);
  a.ref_codes = coded_refine(refine_codes, n, d, a.rot, op);
  a.k_factor = 1;
  new (self) FlatSearcher{rotation,  blocked, centroids,
                          mult,      add,     ids,
                          prefilter ? std::optional<Prefilter>(*prefilter) : std::nullopt,
                          center,    ip_center, refine_x,
                          refine_codes ? std::optional<CodeRefinement>(*refine_codes)
                                       : std::nullopt,
                          a};
}

void build_ivf(IvfSearcher* self, CArr<const float> centroids, CArr<const float> centroid_norms,
               const Rotation& rotation, CArr<const uint8_t> blocked, int bits,
               CArr<const float> codebook, CArr<const float> mult, CArr<const float> add,
               CArr<const int64_t> list_blocks, CArr<const int64_t> pos,
               CArr<const int64_t> ids, int metric, OptF refine_x,
               const CodeRefinement* refine_codes) {
  const char* op = "IVFSearcher";
  const int64_t d = dim(rotation.perms, 1);
  check_shape(centroids, {kAny, d}, op, "centroids");
  const int64_t nlist = dim(centroids, 0);
  require(nlist >= 1, op, ": at least one list");
  check_shape(centroid_norms, {nlist}, op, "centroid_norms");
  check_shape(blocked, {kAny, kAny, 32}, op, "blocked codes");
  const int64_t nb = dim(blocked, 0), npad = 32 * nb;
  require(nb >= 1, op, ": at least one block of codes");
  IvfSearchArgs a{};
  a.scan = blocked_table(blocked, npad, d, bits, codebook, mult, add, op);
  check_list_blocks(list_blocks, nlist, nb, op);
  check_shape(ids, {kAny}, op, "ids");
  const int64_t n = dim(ids, 0);
  check_shape(pos, {npad}, op, "pos");
  check_entries(pos.data(), npad, -1, n, op, "pos");
  check_metric(metric, op);
  require(!(refine_x && refine_codes), op, ": one refinement");
  a.d = d;
  a.nlist = nlist;
  a.centroids = centroids.data();
  a.csq = centroid_norms.data();
  a.rot = rotation.args;
  a.list_blocks = list_blocks.data();
  a.pos = pos.data();
  a.ids = ids.data();
  a.n = n;
  a.ref = exact_refinement(refine_x, n, d, op);
  a.ref_codes = coded_refine(refine_codes, n, d, a.rot, op);
  a.metric = metric;
  new (self) IvfSearcher{centroids,   centroid_norms, rotation, blocked,  codebook,
                         mult,        add,            list_blocks, pos,   ids,
                         refine_x,
                         refine_codes ? std::optional<CodeRefinement>(*refine_codes)
                                      : std::nullopt,
                         a};
}

}  // namespace

void bind_searchers(nb::module_& m) {
  using nb::arg;

  nb::class_<Rotation>(m, "Rotation")
      .def("__init__", [](Rotation* self, CArr<const int64_t> perms, CArr<const float> signs,
                          int64_t p) {
        check_shape(perms, {kAny, kAny}, "Rotation", "perms");
        const RotationArgs r = rotation_args(perms, signs, p, dim(perms, 1), "Rotation");
        new (self) Rotation{perms, signs, r};
      }, arg("perms"), arg("signs"), arg("p"));

  nb::class_<Prefilter>(m, "Prefilter")
      .def("__init__", [](Prefilter* self, int64_t keep, CArr<const uint8_t> packed, int bits,
                          CArr<const float> centroids, CArr<const float> first_add,
                          OptF first_mult, float bound_sigma, float bound_gain,
                          float bound_cnorm, float bound_min_sin) {
        new (self) Prefilter{keep,       packed,      bits,       centroids,   first_add,
                             first_mult, bound_sigma, bound_gain, bound_cnorm, bound_min_sin};
      }, nb::kw_only(), arg("keep"), arg("packed"), arg("bits"), arg("centroids"),
         arg("first_add"), arg("first_mult").none() = nb::none(), arg("bound_sigma") = 0.0f,
         arg("bound_gain") = 1.0f, arg("bound_cnorm") = 1.0f, arg("bound_min_sin") = 0.0f);

  nb::class_<CodeRefinement>(m, "CodeRefinement")
      .def("__init__", [](CodeRefinement* self, const Rotation& rotation,
                          CArr<const uint8_t> packed, int bits, CArr<const float> centroids,
                          CArr<const float> mult, CArr<const float> add) {
        new (self) CodeRefinement{rotation, packed, bits, centroids, mult, add};
      }, nb::kw_only(), arg("rotation"), arg("packed"), arg("bits"), arg("centroids"),
         arg("mult"), arg("add"));

  nb::class_<IvfSearcher>(m, "IVFSearcher")
      .def("__init__", &build_ivf, nb::kw_only(), arg("centroids"), arg("centroid_norms"),
           arg("rotation"), arg("blocked"), arg("bits"), arg("codebook"), arg("mult"),
           arg("add"), arg("list_blocks"), arg("pos"), arg("ids"), arg("metric"),
           arg("refine_x").none() = nb::none(), arg("refine_codes").none() = nb::none())
      .def("search", [](IvfSearcher& s, CArr<const float> q, int64_t nprobe, int64_t kk,
                        CArr<float> D, CArr<int64_t> I, int nthreads) {
        const char* op = "IVFSearcher.search";
        const auto [nq, k] = search_shape(q, D, I, s.args.d, op);
        require(nprobe >= 1 && nprobe <= s.args.nlist, op, ": nprobe must be in 1..nlist");
        require(kk >= 1, op, ": kk must be >= 1");
        IvfSearchArgs a = s.args;
        a.nprobe = nprobe;
        a.kk = std::min(kk, std::max<int64_t>(a.n, 1));  // at most one candidate per row
        nb::gil_scoped_release rel;
        if (!rows_finite(q.data(), nq, a.d)) return false;  // the caller reports it
        if (nq) ivf_search(a, q.data(), nq, k, D.data(), I.data(), nthreads);
        return true;
      }, arg("q"), arg("nprobe"), arg("kk"), arg("D"), arg("I"), arg("nthreads"))
      .def("candidates", [](IvfSearcher& s, CArr<const float> q, int64_t nprobe,
                            std::optional<CArr<const int64_t>> probes,
                            std::optional<CArr<const float>> offsets, CArr<float> scan,
                            CArr<float> final_, CArr<int64_t> I, int nthreads) {
        const char* op = "IVFSearcher.candidates";
        check_shape(q, {kAny, s.args.d}, op, "q");
        const int64_t nq = dim(q, 0);
        require(nprobe >= 1 && nprobe <= s.args.nlist, op, ": nprobe must be in 1..nlist");
        // given probes: lists outside 0..nlist-1 are none (ivf_fast_scan skips them)
        require(probes.has_value() == offsets.has_value(), op,
                ": probes and offsets come together");
        if (probes) {
          check_shape(*probes, {nq, nprobe}, op, "probes");
          check_shape(*offsets, {nq, nprobe}, op, "offsets");
        }
        check_shape(scan, {nq, kAny}, op, "scan");
        const int64_t kk = dim(scan, 1);
        require(kk >= 1 && kk <= std::max<int64_t>(s.args.n, 1), op,
                ": kk must be in 1..max(rows, 1)");
        check_shape(final_, {nq, kk}, op, "final");
        check_shape(I, {nq, kk}, op, "I");
        IvfSearchArgs a = s.args;
        a.nprobe = nprobe;
        a.kk = kk;
        const int64_t* p = probes ? probes->data() : nullptr;
        const float* o = offsets ? offsets->data() : nullptr;
        nb::gil_scoped_release rel;
        if (!rows_finite(q.data(), nq, a.d)) return false;  // the caller reports it
        if (nq)
          ivf_candidates(a, q.data(), nq, p, o, scan.data(), final_.data(), I.data(), nthreads);
        return true;
      }, arg("q"), arg("nprobe"), arg("probes").none(), arg("offsets").none(), arg("scan"),
         arg("final"), arg("I"), arg("nthreads"));

  nb::class_<TermsSearcher>(m, "TermsSearcher")
      .def("__init__", &build_terms, nb::kw_only(), arg("W"), arg("cols"), arg("blocked"),
           arg("centroids"), arg("mults"), arg("bits"), arg("n"), arg("add"), arg("ids"),
           arg("metric"), arg("nfirst"), arg("prefilter"), arg("packed"),
           arg("center").none() = nb::none(), arg("normalize") = false,
           arg("ip_center").none() = nb::none())
      .def("search", [](TermsSearcher& s, CArr<const float> q, CArr<float> D, CArr<int64_t> I,
                        int nthreads) {
        const auto [nq, k] = search_shape(q, D, I, s.args.d, "TermsSearcher.search");
        nb::gil_scoped_release rel;
        if (!rows_finite(q.data(), nq, s.args.d)) return false;  // the caller reports it
        if (nq) terms_search(s.args, q.data(), nq, k, D.data(), I.data(), nthreads);
        return true;
      }, arg("q"), arg("D"), arg("I"), arg("nthreads"));

  nb::class_<FlatSearcher>(m, "FlatSearcher")
      .def("__init__", &build_flat, nb::kw_only(), arg("rotation"), arg("blocked"), arg("n"),
           arg("bits"), arg("centroids"), arg("mult"), arg("add"), arg("ids"), arg("metric"),
           arg("prefilter").none() = nb::none(), arg("center").none() = nb::none(),
           arg("normalize") = false, arg("ip_center").none() = nb::none(),
           arg("refine_x").none() = nb::none(), arg("refine_codes").none() = nb::none())
      .def("search", [](FlatSearcher& s, CArr<const float> q, CArr<float> D, CArr<int64_t> I,
                        int nthreads, int64_t k_factor) {
        require(k_factor >= 1, "FlatSearcher.search", ": k_factor must be >= 1");
        const auto [nq, k] = search_shape(q, D, I, s.args.d, "FlatSearcher.search");
        nb::gil_scoped_release rel;
        if (!rows_finite(q.data(), nq, s.args.d)) return false;  // the caller reports it
        FlatSearchArgs a = s.args;  // the index's k_factor may change between searches
        a.k_factor = k_factor;
        if (nq) flat_search(a, q.data(), nq, k, D.data(), I.data(), nthreads);
        return true;
      }, arg("q"), arg("D"), arg("I"), arg("nthreads"), arg("k_factor"));
}

}  // namespace tqvec::bind
