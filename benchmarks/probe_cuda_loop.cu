// The register-operand decode GEMM's loop in CUDA C++ (sm_90a), to time against the Gluon kernel
// it mirrors (escha/kernels/decode_wgmma.py at the rule's 8-token build: K = 2, the halves codec,
// one 64-row fragment a step, a ring of 3 stages). benchmarks/probe_cuda_loop.py builds it with
// nvcc, launches it through the driver API, gates its partials bit for bit against the Gluon
// kernel's, and times both (docs/KERNELS.md, "The loop in CUDA C++").
//
// What differs from the Gluon kernel is the structure around the codec, not the arithmetic: a
// producer warp (warp 4) whose elected lane issues the ring's TMA copies and waits on each
// stage's "empty" mbarrier, so the consumer warpgroup (warps 0-3) has no CTA barrier in its loop;
// the loop unrolled over the ring's stages, so each stage's shared-memory addresses and MMA
// descriptors are constants. Same operands, same MMAs in the same order (the 8 k-slices against
// x' copy 0, then the 8 against copy 1, as Triton splits the two warpgroup_mma), so the fp32
// partials are the Gluon kernel's bit for bit.
//
// Layouts as decode_wgmma.py: pack_words' words (a thread's 8 in two 16-byte runs, one [8, 128]
// int32 box a step), x' in the halves order ([M, 2 Kp] fp16; a step reads two [BN, 128] tiles,
// each as two 128-byte-swizzled boxes of 64 columns, 1024 bytes each at BN = 8), the even split
// of row tiles x k-blocks over the programs, and the partials [segments, M, Np] fp32.
// MINB (compile-time): programs an SM the register budget is set for (160 threads a program).
#include "probe_sm90.cuh"

#ifndef MINB
#define MINB 4
#endif
#define STAGES 3
#define BN 8
#define THREADS 160
#define X_BOX_BYTES (BN * 64 * 2)                 // one [BN, 64] fp16 box
#define STAGE_BYTES (4 * X_BOX_BYTES + 1024 * 4)  // two copies of x' (two boxes each) + the words

// The halves codec of one 64-bit row window (hi, lo) at tile column s: the lop3 words of columns
// s and s + 8, which are the A registers themselves (their fp16 halves lo, hi). decode_wgmma's
// _PAIR_HALVES_ASM, instruction for instruction.
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
      " wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

extern "C" __global__ void __launch_bounds__(THREADS, MINB)
    decode_loop_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                       float* __restrict__ ws, int M, int Np, int NKB, int STEPS, int PROGRAMS) {
  extern __shared__ __align__(1024) uint8_t raw[];
  // Stage i: x' copy c box b at base + i STAGE_BYTES + (2 c + b) X_BOX_BYTES (1024-byte aligned for
  // the swizzle), its words after them; the mbarriers after the ring. Dynamic shared memory starts
  // after the 1 KB the system reserves a program, so its base is 1024-aligned (checked: rounding a
  // run-time address up would take the descriptors out of the constants).
  const uint32_t base = smem_u32(raw);
  if (base & 1023u) __trap();
  const uint32_t bars = base + STAGES * STAGE_BYTES;  // full[i] at bars + 8 i, empty[i] at bars + 8 (STAGES + i)
  const int p = blockIdx.x;
  const int row0 = blockIdx.y * BN;
  const int s0 = static_cast<int>(static_cast<long long>(p) * STEPS / PROGRAMS);
  const int n = static_cast<int>(static_cast<long long>(p + 1) * STEPS / PROGRAMS) - s0;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(bars + 8 * i, 1);
      mbar_init(bars + 8 * (STAGES + i), 4);  // one arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 4) {  // the producer
    if (lane == 0) {
      int tile = s0 / NKB, kb = s0 - (s0 / NKB) * NKB, stage = 0;
      uint32_t phase = 0;
      for (int i = 0; i < n; ++i) {
        if (i >= STAGES) mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
        const uint32_t full = bars + 8 * stage, dst = base + stage * STAGE_BYTES;
        mbar_expect(full, STAGE_BYTES);
        tma_2d(dst + 4 * X_BOX_BYTES, &w_map, full, 0, (((tile / 2) * NKB + kb) * 2 + tile % 2) * 8);
        for (int c = 0; c < 2; ++c)
          for (int b = 0; b < 2; ++b)
            tma_2d(dst + (2 * c + b) * X_BOX_BYTES, &x_map, full, (kb * 2 + c) * 128 + b * 64, row0);
        if (++kb == NKB) kb = 0, ++tile;
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // The consumer warpgroup: thread (warp w, lane 4 g + t).
  const int g = lane / 4, t = lane % 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int tile = s0 / NKB, kb = s0 - (s0 / NKB) * NKB;
  uint32_t phase = 0;
  for (int i0 = 0; i0 < n; i0 += STAGES) {
#pragma unroll
    for (int stage = 0; stage < STAGES; ++stage) {
      const int i = i0 + stage;
      if (i >= n) break;
      const uint32_t carry = (kb != 0) && (i != 0);  // false at the first step of a tile's part
      const uint32_t dst = base + stage * STAGE_BYTES;
      mbar_wait(bars + 8 * stage, phase);
      uint4 w0, w1;  // row halves mh = 0, 1: {hi, lo} of tile halves h = 0, 1
      const uint32_t wa = dst + 4 * X_BOX_BYTES + ((warp * 2) * 32 + lane) * 16;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w0.x), "=r"(w0.y), "=r"(w0.z), "=r"(w0.w) : "r"(wa) : "memory");
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(w1.x), "=r"(w1.y), "=r"(w1.z), "=r"(w1.w) : "r"(wa + 32 * 16) : "memory");
      // A register r = mh + 2 h of each k-slice: row g + 8 mh, tile 2t + h
      const uint32_t hi[4] = {w0.x, w1.x, w0.z, w1.z};
      const uint32_t lo[4] = {w0.y, w1.y, w0.w, w1.w};
      // The whole fragment first (64 registers), then its 16 MMAs: A registers defined between
      // wgmmas make ptxas serialize them (C7519).
      uint32_t a[8][4], b[8][4];
#pragma unroll
      for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) halves(hi[r], lo[r], s, a[s][r], b[s][r]);
      const uint64_t d0 = smem_desc(dst), d1 = smem_desc(dst + 2 * X_BOX_BYTES);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      // k-slice s: bytes 32 (s % 4) of the 128-byte rows of box s / 4 (added to the address field)
#pragma unroll
      for (int s = 0; s < 8; ++s)
        wgmma_n8(acc, a[s], d0 + (((s / 4) * X_BOX_BYTES + (s % 4) * 32) >> 4), carry | (s > 0));
#pragma unroll
      for (int s = 0; s < 8; ++s) wgmma_n8(acc, b[s], d1 + (((s / 4) * X_BOX_BYTES + (s % 4) * 32) >> 4), 1);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      if (lane == 0) mbar_arrive(bars + 8 * (STAGES + stage));
      if (kb == NKB - 1 || i == n - 1) {  // this program's part of the tile ends: its segment
        // first_program(tile): the largest q with q STEPS / PROGRAMS <= tile * NKB
        const int seg =
            p - static_cast<int>(((static_cast<long long>(tile) * NKB + 1) * PROGRAMS + STEPS - 1) / STEPS) + 1;
        float* out = ws + (static_cast<long long>(seg) * M + row0) * Np;
        const int row = tile * 64 + warp * 16 + g;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 2 * t + (e & 1);
          if (tok < M - row0) out[static_cast<long long>(tok) * Np + row + 8 * (e >> 1)] = acc[e];
        }
      }
      if (++kb == NKB) kb = 0, ++tile;
    }
    phase ^= 1;
  }
}
