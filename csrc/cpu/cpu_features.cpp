// The CPU features of cpu_features.h.
#include "cpu_features.h"

#include <cstdlib>
#include <string>

namespace tqvec {

namespace {
std::string simd_request() {
  const char* v = std::getenv("TQVEC_SIMD");
  return v != nullptr ? std::string(v) : std::string();
}
}  // namespace

bool simd_avx2() {
#ifdef TQVEC_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && simd_request() != "scalar";
  return avx2;
#else
  return false;
#endif
}

bool simd_avx512() {
#ifdef TQVEC_X86
  static const bool avx512 = simd_avx2() && __builtin_cpu_supports("avx512f") &&
                             __builtin_cpu_supports("avx512bw") && simd_request() == "avx512";
  return avx512;
#else
  return false;
#endif
}

bool simd_vbmi() {
#ifdef TQVEC_X86
  static const bool vbmi = simd_avx2() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vbmi") && simd_request() != "avx2";
  return vbmi;
#else
  return false;
#endif
}

bool simd_vnni() {
#ifdef TQVEC_X86
  static const bool vnni = simd_vbmi() && __builtin_cpu_supports("avx512vnni");
  return vnni;
#else
  return false;
#endif
}

bool simd_neon() {
#ifdef TQVEC_NEON
  static const bool neon = simd_request() != "scalar";
  return neon;
#else
  return false;
#endif
}

bool simd_f16c() {
#ifdef TQVEC_X86
  static const bool f16c = simd_avx2() && __builtin_cpu_supports("f16c");
  return f16c;
#else
  return false;
#endif
}

bool simd_fma() {
#ifdef TQVEC_X86
  static const bool fma = simd_avx2() && __builtin_cpu_supports("fma");
  return fma;
#else
  return false;
#endif
}

}  // namespace tqvec
