// Binding of the graph search (graph.cpp): a GraphSearcher holds one graph's layers, checked
// once when it is built (every neighbour, slot and the entry in range, every upper-layer
// neighbour present in that layer), so that a search reads them without a per-call scan.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "check.h"

namespace tqvec::bind {

namespace {

struct GraphSearcher {
  std::vector<CArr<const int32_t>> nbr, slot;
  std::vector<CArr<const uint8_t>> codes;
  std::vector<CArr<const float>> mult, add;
  CArr<const float> centroids;
  CArr<const uint8_t> entry_codes;
  CArr<const float> entry_mult, entry_add;
  std::vector<GraphLayer> layers;
  GraphArgs args{};
  // the whole search (search_full), where a rotation and ids were given
  std::optional<Rotation> rotation;
  std::optional<CArr<const int64_t>> ids;
  std::optional<CArr<const float>> refine_x;
  GraphSearchArgs full{};
};

void build_graph(GraphSearcher* self, std::vector<CArr<const int32_t>> nbr,
                 std::vector<CArr<const uint8_t>> codes, std::vector<CArr<const float>> mult,
                 std::vector<CArr<const float>> add, std::vector<CArr<const int32_t>> slot,
                 int64_t n, int64_t d, int b, CArr<const float> centroids, int64_t entry,
                 CArr<const uint8_t> entry_codes, CArr<const float> entry_mult,
                 CArr<const float> entry_add, const Rotation* rotation, std::optional<CArr<const int64_t>> ids, int metric,
                 bool normalize, std::optional<CArr<const float>> refine_x) {
  const char* op = "GraphSearcher";
  const size_t L = nbr.size();
  require(L >= 1 && L <= 64 && codes.size() == L && mult.size() == L && add.size() == L &&
              slot.size() == L,
          op, ": 1 to 64 layers, each with neighbours, codes, multipliers, offsets and slots");
  require(n >= 1 && n < (int64_t{1} << 31), op, ": n must be in 1..2^31-1");
  require(d >= 1, op, ": d must be >= 1");
  require(b >= 1 && b <= 4, op, ": bits must be in 1..4");
  check_shape(centroids, {int64_t{1} << b}, op, "centroids");
  require(entry >= 0 && entry < n, op, ": entry must be a row");
  const int64_t rb = fs_row_bytes(d, b);
  check_shape(entry_codes, {1, 1, rb, 32}, op, "entry_codes");
  check_shape(entry_mult, {1, 32}, op, "entry_mult");
  check_shape(entry_add, {1, 32}, op, "entry_add");
  new (self) GraphSearcher{nbr, slot, codes, mult, add, centroids, entry_codes, entry_mult,
                           entry_add, {}, {}, {}, ids, refine_x, {}};
  for (size_t l = 0; l < L; ++l) {
    check_shape(nbr[l], {kAny, kAny}, op, "neighbours");
    const int64_t nodes = dim(nbr[l], 0), R = dim(nbr[l], 1);
    require(R >= 32 && R % 32 == 0, op, ": a layer's degree must be a positive multiple of 32");
    check_shape(codes[l], {nodes, R / 32, rb, 32}, op, "codes");
    check_shape(mult[l], {nodes, R}, op, "mult");
    check_shape(add[l], {nodes, R}, op, "add");
    const int32_t* sl = nullptr;
    if (l == 0) {
      require(nodes == n, op, ": layer 0 must hold every row");
      require(slot[0].size() == 0, op, ": layer 0 has no slots (node = row)");
    } else {
      check_shape(slot[l], {n}, op, "slot");
      sl = slot[l].data();
      for (int64_t r = 0; r < n; ++r)
        require(sl[r] >= -1 && sl[r] < nodes, op, ": slot entries must be -1 or nodes");
    }
    const int32_t* nb = nbr[l].data();
    for (int64_t e = 0; e < nodes * R; ++e) {
      require(nb[e] >= -1 && nb[e] < n, op, ": neighbours must be -1 or rows");
      require(nb[e] < 0 || sl == nullptr || sl[nb[e]] >= 0, op,
              ": an upper layer's neighbours must be nodes of that layer");
    }
    self->layers.push_back({nodes, R, nb, codes[l].data(), mult[l].data(), add[l].data(), sl});
  }
  require(L == 1 || self->layers[L - 1].slot[entry] >= 0, op,
          ": entry must be a node of the top layer");
  self->args = {self->layers.data(), static_cast<int>(L), n, d, b, centroids.data(), entry,
                self->entry_codes.data(), self->entry_mult.data(), self->entry_add.data(),
                nullptr, nullptr, 0};
  require((rotation == nullptr) == !ids, op, ": the whole search needs a rotation and ids");
  if (rotation != nullptr) {
    require(dim(rotation->perms, 1) == d, op, ": the rotation must be of the d coordinates");
    check_shape(*ids, {n}, op, "ids");
    check_metric(metric, op);
    self->rotation = *rotation;
    self->full = {self->args, rotation->args, ids->data(), metric, normalize, nullptr};
    if (refine_x) {
      check_shape(*refine_x, {n, d}, op, "refine_x");
      self->full.ref_x = refine_x->data();
    }
  }
}

}  // namespace

void bind_graph(nb::module_& m) {
  using nb::arg;
  nb::class_<GraphSearcher>(m, "GraphSearcher")
      .def("__init__", &build_graph, nb::kw_only(), arg("neighbours"), arg("codes"),
           arg("mult"), arg("add"), arg("slots"), arg("n"), arg("d"), arg("bits"),
           arg("centroids"), arg("entry"), arg("entry_codes"), arg("entry_mult"),
           arg("entry_add"), arg("rotation").none() = nb::none(),
           arg("ids").none() = nb::none(), arg("metric") = 0, arg("normalize") = false,
           arg("refine_x").none() = nb::none())
      .def("search", [](const GraphSearcher& s, CArr<const float> qr, int64_t ef,
                        CArr<float> out_vals, CArr<int64_t> out_idx, int nthreads,
                        std::optional<CArr<const uint8_t>> allowed,
                        std::optional<CArr<const float>> q,
                        std::optional<CArr<const float>> qsq) {
        const char* op = "GraphSearcher.search";
        check_shape(qr, {kAny, s.args.d}, op, "qr");
        const int64_t nq = dim(qr, 0);
        const int64_t k = out_vals.ndim() == 2 ? dim(out_vals, 1) : 0;
        const TopKOut out = topk_out(out_vals, out_idx, nq, k, op);
        require(ef >= out.k && ef >= 1, op, ": ef must be >= 1 and >= the k results asked");
        GraphArgs a = s.args;
        if (allowed) {
          check_shape(*allowed, {s.args.n}, op, "allowed");
          a.allowed = allowed->data();
        }
        const float *qp = nullptr, *qs = nullptr;
        if (q) {  // exact scores of the expanded nodes by the searcher's refine_x
          require(s.full.ref_x != nullptr, op, ": exact scores need a searcher with refine_x");
          check_shape(*q, {nq, s.args.d}, op, "q");
          qp = q->data();
          a.exact_x = s.full.ref_x;
          a.exact_metric = s.full.metric;
          if (s.full.metric == kRescoreL2) {
            require(qsq.has_value(), op, ": an L2 search needs qsq");
            check_shape(*qsq, {nq}, op, "qsq");
            qs = qsq->data();
          }
        }
        nb::gil_scoped_release rel;
        graph_search(a, qr.data(), qp, qs, nq, ef, out, nthreads);
      }, arg("qr"), arg("ef"), arg("out_vals"), arg("out_idx"), arg("nthreads"),
         arg("allowed").none() = nb::none(), arg("q").none() = nb::none(),
         arg("qsq").none() = nb::none())
      .def("search_full", [](const GraphSearcher& s, CArr<const float> q, int64_t kk,
                             int64_t ef, CArr<float> D, CArr<int64_t> I, int nthreads) {
        const char* op = "GraphSearcher.search_full";
        require(s.rotation.has_value(), op, ": built without a rotation and ids");
        check_shape(q, {kAny, s.args.d}, op, "q");
        const int64_t nq = dim(q, 0);
        check_shape(D, {nq, kAny}, op, "D");
        const int64_t k = dim(D, 1);
        check_shape(I, {nq, k}, op, "I");
        require(k >= 1 && kk >= 1 && kk <= s.args.n && ef >= kk, op,
                ": need k >= 1, 1 <= kk <= n and ef >= kk (results past kk are padding)");
        if (!rows_finite(q.data(), nq, s.args.d)) return false;  // the caller reports it
        nb::gil_scoped_release rel;
        graph_index_search(s.full, q.data(), nq, k, kk, ef, D.data(), I.data(), nthreads);
        return true;
      }, arg("q"), arg("kk"), arg("ef"), arg("D"), arg("I"), arg("nthreads"));
}

}  // namespace tqvec::bind
