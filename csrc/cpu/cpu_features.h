// What the CPU can run, read once per process: every kernel's instruction-set choice asks these
// (a kernel picks its functions from them once, e.g. attention_rows.h's row_ops). TQVEC_SIMD
// narrows the choice for the tests and for measurements: "scalar" (the portable loops),
// "avx2" (no AVX-512 anywhere), "avx512" (also the opt-in AVX-512 block sums).
#pragma once

#include "arch.h"

namespace tqvec {

// The flags below, read once while the extension loads (cpu_features.cpp): a kernel's check is
// one load, not a call, wherever it sits in a loop.
struct CpuFeatures {
  bool avx2, neon, avx512, vbmi, vnni, f16c, fma;
};
extern const CpuFeatures kCpuFeatures;

// Whether the AVX2 loops run: the CPU has AVX2 and TQVEC_SIMD is not "scalar" (which forces the
// portable loops; the tests compare the paths). Read once per process. False off x86.
inline bool simd_avx2() { return kCpuFeatures.avx2; }
// Whether the NEON block scans run (aarch64 builds, TQVEC_SIMD not "scalar"); the rest of an
// aarch64 build runs the portable loops as the compiler vectorizes them.
inline bool simd_neon() { return kCpuFeatures.neon; }
// Whether the AVX-512 (F + BW) block sums run where they exist (the fast scans of 1, 2 and
// 4-bit codes; the rest stays on AVX2): the CPU has them and TQVEC_SIMD is "avx512". Opt-in:
// on Zen 4 (512-bit ops split in two 256-bit halves) the lookups are bound by the shuffle
// ports either way and the path was no faster than the AVX2 one (docs/kernel-costs.md).
inline bool simd_avx512() { return kCpuFeatures.avx512; }
// Whether the 3-bit block sums take AVX-512 VBMI (vpermb: a pair's 64-entry table in one
// lookup): the CPU has F, BW and VBMI, the AVX2 loops run and TQVEC_SIMD is not "avx2" (which
// keeps every scan on AVX2). On by default: the same bits as the AVX2 path, and faster.
inline bool simd_vbmi() { return kCpuFeatures.vbmi; }
// Whether VNNI's vpdpbusd runs (simd_vbmi and the CPU has AVX-512 VNNI): the 1, 2 and 4-bit
// table sums gather a row's four code bytes per 32-bit lane and add its lookups in one
// instruction (fastscan/block_sums512.h), and batched exact scans of 4-bit codes score rows by
// an int8 dot product instead of table lookups (fastscan/dot.h).
inline bool simd_vnni() { return kCpuFeatures.vnni; }
// Whether F16C's half <-> float conversions run (the AVX2 loops run and the CPU has F16C).
inline bool simd_f16c() { return kCpuFeatures.f16c; }
// Whether FMA3 runs (the AVX2 loops run and the CPU has it), for the loops whose reference
// fuses multiply and add itself (torch's GEMMs).
inline bool simd_fma() { return kCpuFeatures.fma; }

}  // namespace tqvec
