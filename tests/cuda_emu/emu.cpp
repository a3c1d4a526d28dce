// A CPU emulation of the CUDA execution model, just enough to run tqvec's header-free kernels
// (csrc/cuda/*.cu) on a machine with no GPU: every thread of a block is a std::thread, blocks
// run one after another, __syncthreads is a std::barrier, __syncthreads_or and the warp
// shuffles are block-wide exchanges (the kernels call them block-uniformly), shared memory is
// one static buffer per extern __shared__ array. It checks the kernels' logic (indexing, bit
// layout, the selection protocol, barriers), not GPU specifics (memory model, warp timing).
// Built by tests/test_cuda.py with g++ -std=c++20.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct tq_dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static tq_dim3 blockIdx, blockDim, gridDim;
static thread_local tq_dim3 threadIdx;
static std::barrier<>* tq_bar = nullptr;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

static inline void __syncthreads() { tq_bar->arrive_and_wait(); }

static std::atomic<int> tq_or_acc[2];
static thread_local int tq_or_phase = 0;
static inline int __syncthreads_or(int p) {
  const int ph = tq_or_phase;
  tq_or_phase ^= 1;
  if (p) tq_or_acc[ph].fetch_or(1);
  tq_bar->arrive_and_wait();
  const int r = tq_or_acc[ph].load();
  tq_bar->arrive_and_wait();
  if (threadIdx.x == 0) tq_or_acc[ph].store(0);
  return r;
}

static float tq_xchg[1024];
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  tq_xchg[threadIdx.x] = v;
  tq_bar->arrive_and_wait();
  const float r = tq_xchg[threadIdx.x ^ off];
  tq_bar->arrive_and_wait();
  return r;
}

static int tq_ixchg[1024];
static inline int __any_sync(unsigned, int pred) {
  tq_ixchg[threadIdx.x] = pred != 0;
  tq_bar->arrive_and_wait();
  int r = 0;
  for (unsigned l = threadIdx.x & ~31u; l < (threadIdx.x & ~31u) + 32; ++l) r |= tq_ixchg[l];
  tq_bar->arrive_and_wait();
  return r;
}

static inline void __syncwarp() { tq_bar->arrive_and_wait(); }  // warps run in lockstep here

// mma.sync m16n8k16 (f16 x f16 -> f32) as a block-wide exchange of the fragments: lane l of
// warp w reads its partners' registers (PTX ISA fragment layouts: A row-major 16x16, B
// column-major 16x8, C/D 16x8; groupID = lane / 4, thread-in-group = lane % 4).
static unsigned tq_mma_x[1024][6];
static inline float tq_h2f(unsigned bits16) {
  return static_cast<float>(std::bit_cast<_Float16>(static_cast<unsigned short>(bits16)));
}
static inline unsigned tq_h2(float lo, float hi) {
  const unsigned l = std::bit_cast<unsigned short>(static_cast<_Float16>(lo));
  const unsigned h = std::bit_cast<unsigned short>(static_cast<_Float16>(hi));
  return l | (h << 16);
}
static inline float tq_f16_round(float x) {
  return static_cast<float>(static_cast<_Float16>(x));
}
static inline void tq_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  const int t = threadIdx.x, w0 = t & ~31, g = (t & 31) >> 2, tig = t & 3;
  for (int i = 0; i < 4; ++i) tq_mma_x[t][i] = a[i];
  tq_mma_x[t][4] = b[0];
  tq_mma_x[t][5] = b[1];
  tq_bar->arrive_and_wait();
  auto half = [](unsigned v, int k) { return tq_h2f((k & 1) ? v >> 16 : v & 0xffffu); };
  auto A = [&](int r, int k) {
    return half(tq_mma_x[w0 + (r & 7) * 4 + ((k & 7) >> 1)][(r >= 8) + 2 * (k >= 8)], k);
  };
  auto B = [&](int k, int n) {
    return half(tq_mma_x[w0 + n * 4 + ((k & 7) >> 1)][4 + (k >= 8)], k);
  };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1), c = 2 * tig + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, c);
    out[i] = acc;
  }
  tq_bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

static inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
static inline uint4 __ldg(const uint4* p) { return *p; }
static inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
static inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
using std::exp2f;
using std::fmaf;
using std::fmaxf;
using std::min;
using std::max;

// extern __shared__ arrays: one static buffer each (blocks run one at a time).
alignas(16) unsigned char tq_smem[1 << 18];
alignas(16) float tq_row[1 << 16];
alignas(16) float thr_s[1 << 10];
alignas(16) unsigned char tqa_smem[1 << 18];

#define TQ_EMU 1
#include "../../csrc/cuda/common.cuh"
#include "../../csrc/cuda/pack.cu"
#include "../../csrc/cuda/hadamard.cu"
#include "../../csrc/cuda/scan.cu"
#include "../../csrc/cuda/attention.cu"

static void run_grid(int gx, int gy, int bx, const std::function<void()>& body) {
  gridDim = {static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1};
  blockDim = {static_cast<unsigned>(bx), 1, 1};
  for (int y = 0; y < gy; ++y) {
    for (int x = 0; x < gx; ++x) {
      blockIdx = {static_cast<unsigned>(x), static_cast<unsigned>(y), 0};
      std::barrier<> bar(bx);
      tq_bar = &bar;
      std::vector<std::thread> ts;
      ts.reserve(bx);
      for (int t = 0; t < bx; ++t)
        ts.emplace_back([t, &body] {
          threadIdx = {static_cast<unsigned>(t), 0, 0};
          tq_or_phase = 0;
          body();
        });
      for (auto& t : ts) t.join();
    }
  }
}

template <typename T> static T A(void** a, int i) { return *static_cast<T*>(a[i]); }

// The compile-time shape of the next tq_decode_attention / tq_mma_scan launch (NVRTC's -D
// options on a GPU).
static int tq_variant[5] = {128, 3, 3, 4, 0};
extern "C" void emu_variant(int a, int b, int c, int d, int e) {
  tq_variant[0] = a;
  tq_variant[1] = b;
  tq_variant[2] = c;
  tq_variant[3] = d;
  tq_variant[4] = e;
}

// cuLaunchKernel-like entry: args[i] points at the i-th argument's value. Returns 0 on success,
// 1 for an unknown kernel, 2 when the dynamic shared memory does not fit the static buffer,
// 3 for an attention variant the emulation was not built with.
extern "C" int emu_launch(const char* name, int gx, int gy, int bx, long long smem, void** a) {
  using u8 = unsigned char;
  using i64 = long long;
  const std::string n(name);
  if (n == "tq_lut_scan") {
    if (smem > static_cast<long long>(sizeof(tq_smem))) return 2;
    run_grid(gx, gy, bx, [&] {
      tq_lut_scan(A<const float*>(a, 0), A<const u8*>(a, 1), A<const float*>(a, 2),
                  A<const float*>(a, 3), A<const float*>(a, 4), A<int>(a, 5), A<int>(a, 6),
                  A<int>(a, 7), A<int>(a, 8), A<int>(a, 9), A<int>(a, 10), A<int>(a, 11),
                  A<int>(a, 12), A<int>(a, 13), A<float*>(a, 14), A<i64*>(a, 15));
    });
  } else if (n == "tq_mma_scan") {
    if (smem > static_cast<long long>(sizeof(tq_smem))) return 2;
    auto body = [&](auto f) {
      run_grid(gx, gy, bx, [&] {
        f(A<const float*>(a, 0), A<const u8*>(a, 1), A<const float*>(a, 2),
          A<const float*>(a, 3), A<const float*>(a, 4), A<const float*>(a, 5), A<int>(a, 6),
          A<int>(a, 7), A<int>(a, 8), A<float*>(a, 9), A<i64*>(a, 10), tq_smem);
      });
    };
    // the (D, B, K) variants the tests use, 8 warps per block
#define TQS_VARIANT(D_, B_, K_) \
    if (tq_variant[0] == D_ && tq_variant[1] == B_ && tq_variant[2] == K_ && \
        tq_variant[3] == 8) { \
      body(tqs_body<D_, B_, K_, 8>); return 0; }
    TQS_VARIANT(128, 4, 16) TQS_VARIANT(96, 3, 16) TQS_VARIANT(64, 2, 1) TQS_VARIANT(256, 1, 32)
    TQS_VARIANT(32, 4, 8) TQS_VARIANT(128, 4, 32) TQS_VARIANT(128, 4, 8)
    TQS_VARIANT(64, 3, 8)
#undef TQS_VARIANT
    return 3;
  } else if (n == "tq_pack_bits") {
    run_grid(gx, gy, bx, [&] {
      tq_pack_bits(A<const u8*>(a, 0), A<u8*>(a, 1), A<int>(a, 2), A<int>(a, 3), A<int>(a, 4));
    });
  } else if (n == "tq_unpack_bits") {
    run_grid(gx, gy, bx, [&] {
      tq_unpack_bits(A<const u8*>(a, 0), A<u8*>(a, 1), A<int>(a, 2), A<int>(a, 3),
                     A<int>(a, 4));
    });
  } else if (n == "tq_quantize_pack") {
    if (smem > static_cast<long long>(sizeof(thr_s))) return 2;
    run_grid(gx, gy, bx, [&] {
      tq_quantize_pack(A<const float*>(a, 0), A<const float*>(a, 1), A<const float*>(a, 2),
                       A<int>(a, 3), A<u8*>(a, 4), A<int>(a, 5), A<int>(a, 6), A<int>(a, 7));
    });
  } else if (n == "tq_hadamard_f32" || n == "tq_hadamard_h16") {
    if (smem > static_cast<long long>(sizeof(tq_row))) return 2;
    const bool h16 = n == "tq_hadamard_h16";
    run_grid(gx, gy, bx, [&] {
      if (h16)
        tq_hadamard_h16(A<const unsigned short*>(a, 0), A<const i64*>(a, 1),
                        A<const float*>(a, 2), A<float*>(a, 3), A<int>(a, 4), A<int>(a, 5),
                        A<int>(a, 6), A<int>(a, 7), A<int>(a, 8), A<double>(a, 9),
                        A<int>(a, 10));
      else
        tq_hadamard_f32(A<const float*>(a, 0), A<const i64*>(a, 1), A<const float*>(a, 2),
                        A<float*>(a, 3), A<int>(a, 4), A<int>(a, 5), A<int>(a, 6),
                        A<int>(a, 7), A<int>(a, 8), A<double>(a, 9));
    });
  } else if (n == "tq_decode_attention") {
    if (smem > static_cast<long long>(sizeof(tqa_smem))) return 2;
    auto body = [&](auto f) {
      run_grid(gx, gy, bx, [&] {
        f(A<const float*>(a, 0), A<const float*>(a, 1), A<const u8*>(a, 2),
          A<const float*>(a, 3), A<const float*>(a, 4), A<const u8*>(a, 5),
          A<const float*>(a, 6), A<const float*>(a, 7), A<const int*>(a, 8),
          A<const int*>(a, 9), A<int>(a, 10), A<int>(a, 11), A<int>(a, 12), A<double>(a, 13),
          A<float*>(a, 14), A<float*>(a, 15), A<float*>(a, 16), tqa_smem);
      });
    };
    // the (D, KB, VB, warps, Q in registers) variants the tests use (on a GPU: one NVRTC compile
    // per variant)
#define TQA_VARIANT(D_, KB_, VB_, W_, Q_) \
    if (tq_variant[0] == D_ && tq_variant[1] == KB_ && tq_variant[2] == VB_ && \
        tq_variant[3] == W_ && tq_variant[4] == Q_) { \
      body(tqa_body<D_, KB_, VB_, W_, Q_ != 0>); return 0; }
    TQA_VARIANT(128, 3, 3, 8, 0) TQA_VARIANT(128, 3, 3, 4, 1) TQA_VARIANT(64, 4, 2, 8, 0)
    TQA_VARIANT(96, 2, 4, 4, 1) TQA_VARIANT(256, 4, 4, 8, 0) TQA_VARIANT(32, 1, 1, 4, 0)
    TQA_VARIANT(64, 3, 3, 8, 0) TQA_VARIANT(160, 3, 1, 8, 0) TQA_VARIANT(32, 3, 2, 8, 0)
#undef TQA_VARIANT
    return 3;
  } else {
    return 1;
  }
  return 0;
}
