// Bindings of the coding kernels: bit packing, quantization, centroid statistics, the Hadamard
// rotation, the blocked layout and the per-row norms and dots.
#include <nanobind/stl/optional.h>

#include <optional>

#include "check.h"

namespace tqvec::bind {

void bind_codes(nb::module_& m) {
  m.def("pack_bits", [](CArr<const uint8_t> idx, int b, CArr<uint8_t> out, int nthreads) {
    check_bits(b, 8, "pack_bits");
    check_shape(idx, {kAny, kAny}, "pack_bits", "idx");
    const int64_t n = dim(idx, 0), d = dim(idx, 1);
    check_shape(out, {n, packed_row_bytes(d, b)}, "pack_bits", "out");
    nb::gil_scoped_release rel;
    pack_bits(idx.data(), n, d, b, out.data(), nthreads);
  });

  m.def("unpack_bits", [](CArr<const uint8_t> packed, int64_t d, int b, CArr<uint8_t> out,
                          int nthreads) {
    check_bits(b, 8, "unpack_bits");
    require(d >= 1, "unpack_bits: d must be >= 1");
    check_shape(packed, {kAny, packed_row_bytes(d, b)}, "unpack_bits", "packed");
    const int64_t n = dim(packed, 0);
    check_shape(out, {n, d}, "unpack_bits", "out");
    nb::gil_scoped_release rel;
    unpack_bits(packed.data(), n, d, b, out.data(), nthreads);
  });

  m.def("quantize_pack", [](CArr<const float> y, CArr<const float> scale, CArr<const float> thr,
                            int b, CArr<uint8_t> out, int nthreads) {
    check_bits(b, 8, "quantize_pack");
    check_shape(y, {kAny, kAny}, "quantize_pack", "y");
    const int64_t n = dim(y, 0), d = dim(y, 1);
    check_shape(scale, {n}, "quantize_pack", "scale");
    check_shape(thr, {(int64_t{1} << b) - 1}, "quantize_pack", "thresholds");
    check_shape(out, {n, packed_row_bytes(d, b)}, "quantize_pack", "out");
    nb::gil_scoped_release rel;
    quantize_pack(y.data(), scale.data(), n, d, thr.data(), b, out.data(), nthreads);
  });

  m.def("centroid_stats", [](CArr<const uint8_t> packed, int64_t d, int b,
                             CArr<const float> centroids, std::optional<CArr<const float>> y,
                             std::optional<CArr<const float>> scale, CArr<float> csq,
                             std::optional<CArr<float>> dot, int nthreads) {
    const char* op = "centroid_stats";
    check_bits(b, 8, op);
    require(d >= 1, op, ": d must be >= 1");
    check_shape(packed, {kAny, packed_row_bytes(d, b)}, op, "packed");
    const int64_t n = dim(packed, 0);
    check_shape(centroids, {int64_t{1} << b}, op, "centroids");
    check_shape(csq, {n}, op, "csq");
    require(y.has_value() == scale.has_value() && y.has_value() == dot.has_value(), op,
            ": y, scale and dot go together");
    if (y) {
      check_shape(*y, {n, d}, op, "y");
      check_shape(*scale, {n}, op, "scale");
      check_shape(*dot, {n}, op, "dot");
    }
    nb::gil_scoped_release rel;
    centroid_stats(packed.data(), n, d, b, centroids.data(), y ? y->data() : nullptr,
                   scale ? scale->data() : nullptr, csq.data(), dot ? dot->data() : nullptr,
                   nthreads);
  });

  m.def("hadamard_rotate", [](CArr<const float> x, CArr<const int64_t> perms,
                              CArr<const float> signs, int64_t p, bool inverse,
                              CArr<float> out, int nthreads) {
    check_shape(x, {kAny, kAny}, "hadamard_rotate", "x");
    const int64_t n = dim(x, 0), d = dim(x, 1);
    const RotationArgs r = rotation_args(perms, signs, p, d, "hadamard_rotate");
    check_shape(out, {n, d}, "hadamard_rotate", "out");
    nb::gil_scoped_release rel;
    hadamard_rotate(x.data(), n, d, r.perms, r.signs, r.rounds, r.p, inverse, out.data(),
                    nthreads);
  });

  m.def("turbo_mse_encode", [](CArr<const float> x, CArr<const float> nrm,
                               CArr<const int64_t> perms, CArr<const float> signs, int64_t p,
                               CArr<const float> thr, CArr<const float> centroids, int b,
                               CArr<uint8_t> packed, std::optional<CArr<float>> fit,
                               int nthreads) {
    const char* op = "turbo_mse_encode";
    check_bits(b, 8, op);
    check_shape(x, {kAny, kAny}, op, "x");
    const int64_t n = dim(x, 0), d = dim(x, 1);
    check_shape(nrm, {n}, op, "nrm");
    const RotationArgs r = rotation_args(perms, signs, p, d, op);
    check_shape(thr, {(int64_t{1} << b) - 1}, op, "thresholds");
    check_shape(centroids, {int64_t{1} << b}, op, "centroids");
    check_shape(packed, {n, packed_row_bytes(d, b)}, op, "packed");
    if (fit) check_shape(*fit, {n}, op, "fit");
    nb::gil_scoped_release rel;
    turbo_mse_encode(x.data(), nrm.data(), n, d, r, thr.data(), centroids.data(), b,
                     packed.data(), fit ? fit->data() : nullptr, nthreads);
  });

  m.def("turbo_mse_decode", [](CArr<const uint8_t> packed, CArr<const float> mult,
                               CArr<const int64_t> perms, CArr<const float> signs, int64_t p,
                               CArr<const float> centroids, int b, CArr<float> out,
                               int nthreads) {
    const char* op = "turbo_mse_decode";
    check_bits(b, 8, op);
    check_shape(out, {kAny, kAny}, op, "out");
    const int64_t n = dim(out, 0), d = dim(out, 1);
    check_shape(packed, {n, packed_row_bytes(d, b)}, op, "packed");
    check_shape(mult, {n}, op, "mult");
    const RotationArgs r = rotation_args(perms, signs, p, d, op);
    check_shape(centroids, {int64_t{1} << b}, op, "centroids");
    nb::gil_scoped_release rel;
    turbo_mse_decode(packed.data(), mult.data(), n, d, r, centroids.data(), b, out.data(),
                     nthreads);
  });

  m.def("block_codes", [](CArr<const uint8_t> packed, int64_t d, int b, CArr<uint8_t> blocked,
                          int nthreads) {
    check_bits(b, 8, "block_codes");
    require(d >= 1, "block_codes: d must be >= 1");
    check_shape(packed, {kAny, packed_row_bytes(d, b)}, "block_codes", "packed");
    const int64_t n = dim(packed, 0);
    check_shape(blocked, {(n + 31) / 32, fs_row_bytes(d, b), 32}, "block_codes", "blocked");
    nb::gil_scoped_release rel;
    block_codes(packed.data(), n, d, b, blocked.data(), nthreads);
  });

  m.def("block_code_rows", [](CArr<const uint8_t> packed, CArr<const int32_t> rows, int64_t d,
                              int b, CArr<uint8_t> blocked, int nthreads) {
    const char* op = "block_code_rows";
    check_bits(b, 8, op);
    require(d >= 1, op, ": d must be >= 1");
    check_shape(packed, {kAny, packed_row_bytes(d, b)}, op, "packed");
    check_shape(rows, {kAny}, op, "rows");
    const int64_t n = dim(rows, 0), have = dim(packed, 0);
    const int32_t* r = rows.data();
    for (int64_t i = 0; i < n; ++i)
      require(r[i] >= -1 && r[i] < have, op, ": rows must be -1 or rows of packed");
    check_shape(blocked, {(n + 31) / 32, fs_row_bytes(d, b), 32}, op, "blocked");
    nb::gil_scoped_release rel;
    block_code_rows(packed.data(), r, n, d, b, blocked.data(), nthreads);
  });

  m.def("row_sqnorms", [](CArr<const float> x, CArr<float> out) {
    check_shape(x, {kAny, kAny}, "row_sqnorms", "x");
    check_shape(out, {dim(x, 0)}, "row_sqnorms", "out");
    nb::gil_scoped_release rel;
    row_sqnorms(x.data(), dim(x, 0), dim(x, 1), out.data());
  });

  m.def("row_dots", [](CArr<const float> x, CArr<const float> v, CArr<float> out) {
    check_shape(x, {kAny, kAny}, "row_dots", "x");
    check_shape(v, {dim(x, 1)}, "row_dots", "v");
    check_shape(out, {dim(x, 0)}, "row_dots", "out");
    nb::gil_scoped_release rel;
    row_dots(x.data(), dim(x, 0), dim(x, 1), v.data(), out.data());
  });

  m.def("row_project", [](CArr<const float> x, CArr<const float> W, CArr<float> out,
                          int nthreads) {
    check_shape(x, {kAny, kAny}, "row_project", "x");
    check_shape(W, {dim(x, 1), kAny}, "row_project", "W");
    check_shape(out, {dim(x, 0), dim(W, 1)}, "row_project", "out");
    nb::gil_scoped_release rel;
    row_project(x.data(), dim(x, 0), dim(x, 1), W.data(), dim(W, 1), out.data(), nthreads);
  });
}

}  // namespace tqvec::bind
