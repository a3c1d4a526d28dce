// The CPU features of cpu_features.h, read once when the extension loads (no static
// initializer of the extension reads them: every kernel asks at run time).
#include "cpu_features.h"

#include <cstdlib>
#include <string>

namespace tqvec {

namespace {

std::string simd_request() {
  const char* v = std::getenv("TQVEC_SIMD");
  return v != nullptr ? std::string(v) : std::string();
}

CpuFeatures read_features() {
  CpuFeatures f{};
  const std::string request = simd_request();
#ifdef TQVEC_X86
  __builtin_cpu_init();  // before __builtin_cpu_supports in a static initializer
  f.avx2 = __builtin_cpu_supports("avx2") && request != "scalar";
  const bool avx512bw = f.avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw");
  f.avx512 = avx512bw && request == "avx512";
  f.vbmi = avx512bw && __builtin_cpu_supports("avx512vbmi") && request != "avx2";
  f.vnni = f.vbmi && __builtin_cpu_supports("avx512vnni");
  f.f16c = f.avx2 && __builtin_cpu_supports("f16c");
  f.fma = f.avx2 && __builtin_cpu_supports("fma");
#endif
#ifdef TQVEC_NEON
  f.neon = request != "scalar";
#endif
  return f;
}

}  // namespace

const CpuFeatures kCpuFeatures = read_features();

}  // namespace tqvec
