#include "check.h"

namespace tqvec::bind {

std::string shape_text(std::initializer_list<Extent> dims) {
  std::string s = "(";
  size_t i = 0;
  for (const Extent& e : dims) {
    s += (i++ ? ", " : "") + (e.any ? std::string("*") : std::to_string(e.value));
    if (dims.size() == 1) s += ",";
  }
  return s + ")";
}

int64_t sign_plane_dims(const CArr<const uint8_t>& signs, int64_t d, const char* op) {
  // all d where bytes = ceil(d / 8), else the first 8 * bytes (a prefix: 1-bit codes' coarse
  // pass)
  const int64_t bytes = signs.ndim() == 3 ? dim(signs, 1) : 0;
  const int64_t d1 = bytes == fs_row_bytes(d, 1) ? d : (bytes >= 1 && 8 * bytes < d ? 8 * bytes : 0);
  require(d1 >= 1, op, ": signs must have shape (ceil(n / 32), bytes, 32), the sign plane of "
          "all d coordinates (bytes = ceil(d / 8)) or of a prefix (fewer bytes), got ",
          shape_text(signs));
  return d1;
}

void check_list_blocks(const CArr<const int64_t>& lb, int64_t nlist, int64_t nb, const char* op) {
  check_shape(lb, {nlist + 1}, op, "list_blocks");
  const int64_t* x = lb.data();
  bool ok = x[0] == 0;
  for (int64_t l = 0; l < nlist; ++l) ok &= x[l] <= x[l + 1] && x[l + 1] <= nb;
  require(ok, op, ": list_blocks must rise from 0 to at most the ", std::to_string(nb),
          " blocks");
}

CodeTable packed_table(const CArr<const uint8_t>& packed, int64_t d, int b,
                       const CArr<const float>& centroids, const CArr<const float>& mult,
                       const CArr<const float>& add, const char* op) {
  check_bits(b, 8, op);
  require(d >= 1, op, ": d must be >= 1");
  check_shape(packed, {kAny, packed_row_bytes(d, b)}, op, "packed codes");
  const int64_t n = dim(packed, 0);
  check_shape(centroids, {int64_t{1} << b}, op, "centroids");
  check_shape(mult, {n}, op, "mult");
  check_shape(add, {n}, op, "add");
  return {packed.data(), n, d, b, centroids.data(), mult.data(), add.data()};
}

CodeTable blocked_table(const CArr<const uint8_t>& blocked, int64_t n, int64_t d, int b,
                        const CArr<const float>& centroids, const CArr<const float>& mult,
                        const CArr<const float>& add, const char* op) {
  check_bits(b, 4, op);
  require(n >= 0 && d >= 1, op, ": n must be >= 0 and d >= 1");
  check_shape(blocked, {(n + 31) / 32, fs_row_bytes(d, b), 32}, op, "blocked codes");
  check_shape(centroids, {int64_t{1} << b}, op, "centroids");
  check_shape(mult, {n}, op, "mult");
  check_shape(add, {n}, op, "add");
  return {blocked.data(), n, d, b, centroids.data(), mult.data(), add.data()};
}

TopKOut topk_out(CArr<float>& vals, CArr<int64_t>& idx, int64_t nq, int64_t k, const char* op) {
  require(k >= 1, op, ": k must be >= 1");
  check_shape(vals, {nq, k}, op, "out_vals");
  check_shape(idx, {nq, k}, op, "out_idx");
  return {k, vals.data(), idx.data()};
}

RotationArgs rotation_args(const CArr<const int64_t>& perms, const CArr<const float>& signs,
                           int64_t p, int64_t d, const char* op) {
  check_shape(perms, {kAny, d}, op, "perms");
  check_shape(signs, {dim(perms, 0), d}, op, "signs");
  require(p >= 1 && (p & (p - 1)) == 0 && p <= d && 2 * p >= d, op,
          ": block size p must be a power of two with d / 2 <= p <= d");
  const int64_t rounds = dim(perms, 0);
  check_entries(perms.data(), rounds * d, 0, d, op, "perms");
  return {perms.data(), signs.data(), static_cast<int>(rounds), p};
}

}  // namespace tqvec::bind
