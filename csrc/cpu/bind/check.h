// The bindings' argument checks: every array's shape is checked by check_shape before a kernel
// reads it, so that a wrong call raises ValueError (naming the function, the parameter, the
// shape expected and the one that came) and can never read or write out of bounds. Value checks
// (NaN, ranges) happen once in tqvec/_validate.py, but for what a kernel indexes by.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../kernels.h"

namespace tqvec::bind {

namespace nb = nanobind;

template <class T>
using CArr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// One extent of check_shape: a number, or kAny (any extent). The wildcard is a type of its
// own, not a value: a caller's negative number (d = -1) matches no array, where a -1 wildcard
// let unpack_bits(d=-1) pass its checks and copy SIZE_MAX bytes.
struct Extent {
  struct AnyTag {};
  int64_t value = 0;
  bool any = false;
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  constexpr Extent(I v) : value(static_cast<int64_t>(v)) {}  // NOLINT: implicit by design
  constexpr Extent(AnyTag) : any(true) {}                      // NOLINT
};
inline constexpr Extent::AnyTag kAny{};

// Raises std::invalid_argument (ValueError) unless ok. The message is built only on failure: a
// std::string argument would be constructed, and past 15 characters heap-allocated, on every
// call - a heavy cost per one-query rotation, whose loop checks each permutation entry.
template <class... Parts>
void require(bool ok, const Parts&... parts) {
  if (ok) return;
  std::string msg;
  (msg.append(parts), ...);
  throw std::invalid_argument(msg);
}

// "(3, *, 32)" for check_shape's messages.
std::string shape_text(std::initializer_list<Extent> dims);
template <class A>
std::string shape_text(const A& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i)
    s += (i ? ", " : "") + std::to_string(a.shape(i)) + (a.ndim() == 1 ? "," : "");
  return s + ")";
}

// The one shape check: a has exactly dims.size() dimensions, each equal to dims (kAny: any).
template <class A>
void check_shape(const A& a, std::initializer_list<Extent> dims, const char* op,
                 const char* name) {
  bool ok = a.ndim() == dims.size();
  size_t i = 0;
  for (const Extent& e : dims) {
    if (!ok) break;
    ok = e.any || (e.value >= 0 && a.shape(i) == static_cast<size_t>(e.value));
    ++i;
  }
  require(ok, op, ": ", name, " must have shape ", shape_text(dims), ", got ", shape_text(a));
}

// An extent as int64_t.
template <class A>
int64_t dim(const A& a, size_t i) {
  return static_cast<int64_t>(a.shape(i));
}

inline int64_t packed_row_bytes(int64_t d, int b) { return (d * b + 7) / 8; }

inline void check_bits(int b, int max_bits, const char* op) {
  require(b >= 1 && b <= max_bits, op, ": bits must be in 1..", std::to_string(max_bits),
          ", got ", std::to_string(b));
}

// A two-stage scan's SignBound: sigma finite and >= 0 (0: none), gain and cnorm finite and > 0.
inline SignBound sign_bound(float sigma, float gain, float cnorm, float min_sin,
                            const char* op) {
  require(std::isfinite(sigma) && sigma >= 0.0f, op, ": bound_sigma must be finite and >= 0");
  require(std::isfinite(gain) && gain > 0.0f && std::isfinite(cnorm) && cnorm > 0.0f, op,
          ": bound_gain and bound_cnorm must be finite and > 0");
  require(min_sin >= 0.0f && min_sin <= 1.0f, op, ": bound_min_sin must be in [0, 1]");
  return SignBound{sigma, gain, cnorm, min_sin};
}

inline void check_metric(int metric, const char* op) {
  require(metric >= 0 && metric <= 2, op, ": metric must be 0, 1 or 2 (ip, l2, cosine)");
}

// Every entry of an index array (n entries) within [lo, hi).
inline void check_entries(const int64_t* x, int64_t n, int64_t lo, int64_t hi, const char* op,
                          const char* name) {
  bool ok = true;
  for (int64_t t = 0; t < n; ++t) ok &= x[t] >= lo && x[t] < hi;
  require(ok, op, ": ", name, " holds an entry outside [", std::to_string(lo), ", ",
          std::to_string(hi), ")");
}

// The coordinates a two-stage scan's sign plane (nb, bytes, 32) covers, d1 <= d.
int64_t sign_plane_dims(const CArr<const uint8_t>& signs, int64_t d, const char* op);

// Inverted lists as block ranges: (nlist + 1) non-decreasing offsets from 0 to at most nb.
void check_list_blocks(const CArr<const int64_t>& lb, int64_t nlist, int64_t nb, const char* op);

// A code table (kernels.h CodeTable) from its arrays, checked: packed (n, ceil(d b / 8)) or
// blocked (ceil(n / 32), fs_row_bytes(d, b), 32) codes of n rows, 2^b centroids, mult and add
// (n) - or, for padded IVF lists, (32 blocks).
CodeTable packed_table(const CArr<const uint8_t>& packed, int64_t d, int b,
                       const CArr<const float>& centroids, const CArr<const float>& mult,
                       const CArr<const float>& add, const char* op);
CodeTable blocked_table(const CArr<const uint8_t>& blocked, int64_t n, int64_t d, int b,
                        const CArr<const float>& centroids, const CArr<const float>& mult,
                        const CArr<const float>& add, const char* op);

// A top-k output pair (nq, k).
TopKOut topk_out(CArr<float>& vals, CArr<int64_t>& idx, int64_t nq, int64_t k, const char* op);

// A Hadamard rotation's parameters for d coordinates: perms, signs (rounds, d), block p.
RotationArgs rotation_args(const CArr<const int64_t>& perms, const CArr<const float>& signs,
                           int64_t p, int64_t d, const char* op);

// A Hadamard rotation: perms, signs (rounds, d), block p (bound as Rotation in searchers.cpp).
struct Rotation {
  CArr<const int64_t> perms;
  CArr<const float> signs;
  RotationArgs args;
};

// Whether every one of n floats is finite (the one-call searches check their queries here: a
// numpy isfinite pass per one-query search ran cache-cold after the previous scan).
// Whether every row of x (n, d) is finite and its squared norm fits in float32 (a NaN or an
// infinity anywhere makes its row's sum of squares non-finite): what an index's add requires of
// its rows, so that a query of norm 1e20 is reported (the caller's general path), not scored.
inline bool rows_finite(const float* x, int64_t n, int64_t d) {
  bool ok = true;
  for (int64_t r = 0; r < n; ++r) {
    float sq = 0.0f;
    for (int64_t i = 0; i < d; ++i) sq += x[r * d + i] * x[r * d + i];
    ok &= std::isfinite(sq);
  }
  return ok;
}

void bind_codes(nb::module_& m);
void bind_scans(nb::module_& m);
void bind_attention(nb::module_& m);
void bind_searchers(nb::module_& m);
void bind_graph(nb::module_& m);

}  // namespace tqvec::bind
