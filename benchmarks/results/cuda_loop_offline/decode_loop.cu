// Census prototype (sm_90a, not run): the register-operand decode GEMM's loop written in CUDA C++,
// to count what a hand-written loop keeps of the Gluon kernel's instructions a k-block
// (docs/KERNELS.md, "The next structural step: the loop in CUDA C++"). K = 2, the halves codec,
// 8 tokens, one 64-row fragment a step, a ring of STAGES stages. One consumer warpgroup (warps
// 0-3) decodes and multiplies; warp 4 is the producer: one elected lane waits on a stage's
// "empty" mbarrier, posts its bytes on "full" and issues its TMA copies. No CTA barrier in the
// loop. Layouts as decode_wgmma.py: pack_words' words (a thread's 8 in two 16-byte runs), the
// halves order of x' (two [8, 128] fp16 tiles a k-block, each two 128-byte-swizzled boxes of 64
// columns). The even split and the partials' store follow decode_wgmma's kernel.
#include <cuda.h>
#include <stdint.h>

#define STAGES 3
#define BN 8
#define MUL 89226354u

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// One k-slice of the halves codec for one 64-bit row window (hi, lo) at tile column s: the lop3
// words of columns s and s + 8, which are the A registers themselves (their fp16 halves lo, hi).
__device__ __forceinline__ void halves(uint32_t hi, uint32_t lo, int s, uint32_t& xa, uint32_t& xb) {
  const uint32_t t = __funnelshift_l(lo, hi, 2 * s);  // states of columns s (high half) and s + 8
  asm("{\n .reg .b32 sa;\n"
      " mul.hi.u32 sa, %2, 65536;\n"
      " mad.lo.u32 %0, sa, 89226354, 64248484;\n"
      " mad.lo.u32 %1, %2, 89226354, 1584945828;\n"
      " mad.lo.u32 %1, %0, 0xFFFF0000, %1;\n"
      " lop3.b32 %0, %0, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n"
      " lop3.b32 %1, %1, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n}"
      : "=&r"(xa), "=&r"(xb)
      : "r"(t));
}

__device__ __forceinline__ void wgmma_n8(float (&d)[4], const uint32_t (&a)[4], uint64_t desc, uint32_t accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

// K-major B operand in 128-byte-swizzled 8 x 64 fp16 boxes: start address, LBO 16 B (unused when
// swizzled), SBO 1024 B (the next 8 rows), 128-byte swizzle.
__device__ __forceinline__ uint64_t b_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

struct __align__(1024) Smem {
  uint16_t x[STAGES][2][2][BN * 64];  // stage, copy of x' (halves), 64-column box
  uint32_t w[STAGES][1024];           // the fragment's words
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};

extern "C" __global__ void __launch_bounds__(160) decode_loop_kernel(
    const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map, float* ws, int M, int Np,
    int NKB, int STEPS, int PROGRAMS) {
  extern __shared__ __align__(1024) uint8_t raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw);
  const int p = blockIdx.x;
  const int row0 = blockIdx.y * BN;
  const int s0 = static_cast<int>(static_cast<long long>(p) * STEPS / PROGRAMS);
  const int n = static_cast<int>(static_cast<long long>(p + 1) * STEPS / PROGRAMS) - s0;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], 4);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4) {  // the producer
    if (lane == 0) {
      int tile = s0 / NKB, kb = s0 - (s0 / NKB) * NKB, stage = 0;
      uint32_t phase = 0;
      for (int i = 0; i < n; ++i) {
        if (i >= STAGES) mbar_wait(&sm.empty[stage], phase ^ 1);
        mbar_expect(&sm.full[stage], 4 * BN * 64 * 2 + 1024 * 4);
        for (int c = 0; c < 2; ++c)
          for (int b = 0; b < 2; ++b) tma_2d(sm.x[stage][c][b], &x_map, &sm.full[stage], (kb * 2 + c) * 128 + b * 64, row0);
        tma_2d(sm.w[stage], &w_map, &sm.full[stage], 0, (((tile / 2) * NKB + kb) * 2 + tile % 2) * 8);
        if (++kb == NKB) kb = 0, ++tile;
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // The consumer warpgroup: thread (warp w, lane 4 g + t); its words: two 16-byte runs. The loop
  // is unrolled over the ring's stages, so each stage's shared-memory addresses, and the MMAs'
  // descriptors built from them, are constants (computed at run time from a stage index, ptxas
  // kept them in vector registers and moved them to uniform ones twice an MMA).
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int tile = s0 / NKB, kb = s0 - (s0 / NKB) * NKB;
  uint32_t phase = 0;
  for (int i0 = 0; i0 < n; i0 += STAGES) {
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      const int i = i0 + stage;
      if (i >= n) break;
      const uint32_t carry = (kb != 0) && (i != 0);
      mbar_wait(&sm.full[stage], phase);
      const uint4 w0 = reinterpret_cast<const uint4*>(sm.w[stage])[(warp * 2 + 0) * 32 + lane];
      const uint4 w1 = reinterpret_cast<const uint4*>(sm.w[stage])[(warp * 2 + 1) * 32 + lane];
      // row windows (mh, h): register r = mh + 2 h of each k-slice's A operand
      const uint32_t hi[4] = {w0.x, w1.x, w0.z, w1.z};
      const uint32_t lo[4] = {w0.y, w1.y, w0.w, w1.w};
      // The whole fragment first (64 registers), then its 16 MMAs: A registers defined between
      // wgmmas make ptxas insert a warpgroup.arrive before each (C7519).
      uint32_t a[8][4], b[8][4];
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) halves(hi[r], lo[r], s, a[s][r], b[s][r]);
      const uint64_t da = b_desc(smem_u32(sm.x[stage][0][0]));
      const uint64_t db = b_desc(smem_u32(sm.x[stage][1][0]));
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        // MMA k-slice s: bytes 32 s of the 128-byte rows, the second box from slice 4 (a constant
        // added to the descriptor's address field)
        const uint64_t off = ((s / 4) * BN * 64 * 2 + (s % 4) * 32) >> 4;
        wgmma_n8(acc, a[s], da + off, carry | (s > 0));
        wgmma_n8(acc, b[s], db + off, 1);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (lane == 0) mbar_arrive(&sm.empty[stage]);
      if (kb == NKB - 1 || i == n - 1) {  // the program's part of this tile ends: its segment of the partials
        const int seg =
            p - static_cast<int>(((static_cast<long long>(tile) * NKB + 1) * PROGRAMS + STEPS - 1) / STEPS) + 1;
        const int g = lane / 4, t = lane % 4;
        float* base = ws + (static_cast<long long>(seg) * M + row0) * Np;
        const int rows = tile * 64 + warp * 16 + g;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 2 * t + (e & 1), row = rows + 8 * (e >> 1);
          if (tok < M - row0) base[static_cast<long long>(tok) * Np + row] = acc[e];
        }
      }
      if (++kb == NKB) kb = 0, ++tile;
    }
    phase ^= 1;
  }
}
