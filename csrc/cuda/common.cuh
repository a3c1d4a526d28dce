// Device helpers shared by the kernels. Not compiled alone: tqvec/ops/cuda.py puts this text in
// front of each .cu source before NVRTC compiles it (the kernels stay header-free: no include
// path at run time), and tests/cuda_emu/emu.cpp includes it before the kernels.

typedef unsigned char tq_u8;
typedef long long tq_i64;
typedef unsigned long long tq_u64;

#ifndef TQ_EMU
// D (16x8, f32) += A (16x16, f16, row-major fragments) . B (16x8, f16, column-major fragments)
// (PTX ISA, mma.m16n8k16: with groupID = lane / 4 and t = lane % 4, a lane holds A rows groupID
// and groupID + 8 at columns 2t, 2t + 1, 2t + 8, 2t + 9; B rows 2t, 2t + 1, 2t + 8, 2t + 9 of
// column groupID; D rows groupID, groupID + 8 at columns 2t, 2t + 1).
__device__ __forceinline__ void tq_mma(float (&d)[4], const unsigned (&a)[4],
                                       const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats as f16x2 (round to nearest even): lo in the low half.
__device__ __forceinline__ unsigned tq_h2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// x rounded to f16 (nearest even) and back.
__device__ __forceinline__ float tq_f16_round(float x) {
  unsigned short h;
  float r;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(r) : "h"(h));
  return r;
}
#endif

// The N words of bits [start, start + 32 N) of a row of 32-bit words (bit i of the row is bit
// i % 32 of word i / 32), moved down to bit 0. Reads the row up to word start / 32 + N.
template <int N>
__device__ __forceinline__ void tq_run(const unsigned* row, int start, unsigned (&out)[N]) {
  const int w = start >> 5, off = start & 31;
  unsigned prev = row[w];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const unsigned next = row[w + i + 1];
    out[i] = (unsigned)((((tq_u64)next << 32) | prev) >> off);
    prev = next;
  }
}

// Bits [off, off + width) of a run from tq_run (off and width compile-time after unrolling).
template <int N>
__device__ __forceinline__ unsigned tq_field(const unsigned (&run)[N], int off, int width) {
  const int w = off >> 5;
  const unsigned lo = run[w], hi = (w + 1 < N) ? run[w + 1] : 0u;
  return (unsigned)((((tq_u64)hi << 32) | lo) >> (off & 31)) & ((1u << width) - 1u);
}
