// The instruction sets a build can hold, and their intrinsics: x86-64 builds carry AVX2 /
// AVX-512 functions chosen at run time (simd_avx2, simd_avx512 in kernels.h); aarch64 builds
// carry NEON ones (NEON is part of every ARMv8-A CPU); anything else builds the portable loops.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define TQVEC_X86 1
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#define TQVEC_NEON 1
#endif

#ifdef TQVEC_X86
#include <immintrin.h>
// A plain loop compiled twice, for AVX2 and baseline x86-64, picked at load time.
#define TQVEC_CLONES_AVX2 __attribute__((target_clones("avx2", "default")))
#else
#define TQVEC_CLONES_AVX2
#endif
#ifdef TQVEC_NEON
#include <arm_neon.h>
#endif
