// A fused fp8 decode GEMM for the mid range (issue #13's 65-1024 tokens), warp-specialized, to time
// against escha's paths there: one producer warpgroup decodes the trellis into e4m3(64 T) tiles in
// shared memory while two consumer warpgroups multiply them, fp8 wgmma with both operands in
// shared memory, against x' e4m3 tiles brought by TMA. benchmarks/probe_fused_fp8.py builds it with
// nvcc for sm_90a, launches it through the driver API, gates it and times it beside the paths it
// would replace (dequantize_core to e4m3 + fp8 GEMM; decode_fp8) (docs/KERNELS.md, "A fused fp8
// decode GEMM with the decode in its own warps").
//
// Contract (the plain-core path's, escha/kernels/dequant_once.py dequant_core_fp8): x' e4m3
// [M, Kp] with per-token scales xscale (run_actquant), the core T [Np, Kp] decoded as e4m3(64 T)
// (dequantize_core's bytes, bit for bit), z[tok, row] = bf16(sum_k x'[tok, k] e4m3(64 T)[row, k] *
// xscale[tok] / 64), then transforms.hadamard_output_dense(z) as that path does.
//
// Program: BM = 128 weight rows x BN = 256 tokens, the k-blocks of 128 in a ring of STAGES stages.
// Warpgroup 0 (producer): the k-blocks' row windows (row_windows, 8 KB a k-block) arrive by TMA in
// a ring of their own WSTAGES deep; each thread reads its 8 tile rows' 64-bit windows (two tile
// rows in one 16-byte load), decodes each 16-weight tile row with the exact 3INST
// codec (decode_wgmma's pair form: columns c and c + 8 from one funnel shift), multiplies by 64
// (exact), converts to e4m3 (cvt.rn.satfinite: round to nearest even; |64 T| < 448) and stores
// the tile row's 16 bytes in the 128-byte swizzled layout wgmma reads; thread 0 also issues the
// stage's x' copy. Warpgroups 1 and 2 (consumers, weight rows 64 c .. 64 c + 63): four
// m64n256k32 MMAs a stage, one group in flight (each stage is released when the next one's MMAs
// are issued). With DUMP_CORE the producer also writes its tiles to global memory (the gate).
#include "probe_sm90.cuh"
#include <cuda_bf16.h>

#define BM 128
#ifndef BN
#define BN 256                             // tokens a program: 256, or 128 (PRODUCERS = 2)
#endif
#ifndef PRODUCERS
#define PRODUCERS 1                        // producer warpgroups: 1, or 2 (BN = 128: 128 registers)
#endif
#define PRODUCER_WARPS (4 * PRODUCERS)
#define TILES_PER_WARP (8 / PRODUCER_WARPS)  // 16-row tiles a producer warp decodes a stage
#define STAGES 3
#define THREADS (128 * (PRODUCERS + 2))
#define W_BYTES (BM * 128)                 // a stage's e4m3 weight tile [128 rows, 128 k]
#define X_BYTES (BN * 128)                 // a stage's x' tile [256 tokens, 128 k]
#define STAGE_BYTES (W_BYTES + X_BYTES)
#define WSTAGES 4                          // the producer's own ring of row windows, by TMA
#define WIN_BYTES (BM / 16 * 8 * 128)      // a k-block's windows: 8 row tiles x 8 k tiles x 128 bytes

// e4m3(64 T) of columns c and c + 8 of a K = 2 tile row, t = funnel(hi, lo, 2c): the exact 3INST
// values (decode_wgmma's _PAIR_VALUES_ASM), times 64 in fp16 (exact), both rounded to e4m3 at once.
// The 16-bit result: column c in its low byte, c + 8 in its high byte.
__device__ __forceinline__ uint16_t pair_e4m3(uint32_t t) {
  uint16_t out;
  asm("{\n .reg .b32 sa, xa, xb, lo, hi, v, k;\n"
      " mul.hi.u32 sa, %1, 65536;\n"
      " mad.lo.u32 xa, sa, 89226354, 64248484;\n"
      " mad.lo.u32 xb, %1, 89226354, 1584945828;\n"
      " mad.lo.u32 xb, xa, 0xFFFF0000, xb;\n"
      " lop3.b32 xa, xa, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n"
      " lop3.b32 xb, xb, 0x8FFF8FFF, 0x3B603B60, 0x6A;\n"
      " prmt.b32 lo, xa, xb, 0x5410;\n"
      " prmt.b32 hi, xa, xb, 0x7632;\n"
      " add.rn.f16x2 v, lo, hi;\n"
      " mov.b32 k, 0x54005400;\n"  // 64.0 twice
      " mul.rn.f16x2 v, v, k;\n"
      " cvt.rn.satfinite.e4m3x2.f16x2 %0, v;\n}"
      : "=h"(out)
      : "r"(t));
  return out;
}

// The 16 e4m3 bytes of one tile row (columns 0..15 in order) from its 64-bit window (hi, lo).
__device__ __forceinline__ uint4 tile_row_e4m3(uint32_t hi, uint32_t lo) {
  uint32_t q[4];  // q[i]: pairs 2i and 2i + 1 -> bytes (c, c + 8, c + 1, c + 9), c = 2i
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t p0 = pair_e4m3(__funnelshift_l(lo, hi, 4 * i));
    const uint32_t p1 = pair_e4m3(__funnelshift_l(lo, hi, 4 * i + 2));
    q[i] = p0 | (p1 << 16);
  }
  uint4 r;
  r.x = __byte_perm(q[0], q[1], 0x6420);  // columns 0..3
  r.y = __byte_perm(q[2], q[3], 0x6420);  // 4..7
  r.z = __byte_perm(q[0], q[1], 0x7531);  // 8..11
  r.w = __byte_perm(q[2], q[3], 0x7531);  // 12..15
  return r;
}

// One m64n256k32 e4m3 MMA, A and B from shared memory (descriptors), fp32 accumulators d.
__device__ __forceinline__ void wgmma_m64n256k32(float (&d)[128], uint64_t da, uint64_t db, uint32_t accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}

// One m64n128k32 e4m3 MMA (BN = 128), as above.
__device__ __forceinline__ void wgmma_m64nk32(float (&d)[64], uint64_t da, uint64_t db, uint32_t accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}

#if BN == 256
#define WGMMA wgmma_m64n256k32
#else
#define WGMMA wgmma_m64nk32
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    fused_fp8_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                     const float* __restrict__ xscale, __nv_bfloat16* __restrict__ z, uint4* __restrict__ core,
                     int M, int Np, int Kp) {
  extern __shared__ __align__(1024) uint8_t raw[];
  const uint32_t base = smem_u32(raw);
  if (base & 1023u) __trap();  // the swizzle needs 1024-byte aligned tiles (see probe_cuda_loop.cu)
  // stage i: its weight tile at base + i STAGE_BYTES, its x' tile W_BYTES after; the windows' ring
  // after the stages, then the mbarriers: full[i] at bars + 8 i, empty[i] at bars + 8 (STAGES + i),
  // the windows' wfull[j] at bars + 8 (2 STAGES + j)
  const uint32_t wins = base + STAGES * STAGE_BYTES;
  const uint32_t bars = wins + WSTAGES * WIN_BYTES;
  const int NKB = Kp / 128;
  const int row0 = blockIdx.x * BM, tok0 = blockIdx.y * BN;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int pwarp = threadIdx.x / 32;  // a producer warp's index, 0 .. PRODUCER_WARPS - 1
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(bars + 8 * i, PRODUCER_WARPS + 1);  // the producer warps and the x' copy's expect
      mbar_init(bars + 8 * (STAGES + i), 2);      // one arrival a consumer warpgroup
    }
    for (int j = 0; j < WSTAGES; ++j) mbar_init(bars + 8 * (2 * STAGES + j), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg < PRODUCERS) {  // the producers: warp w decodes row tiles TILES_PER_WARP w .. TILES_PER_WARP (w + 1) - 1
    if (threadIdx.x == 0) {  // the first WSTAGES k-blocks' windows
      for (int j = 0; j < WSTAGES && j < NKB; ++j) {
        mbar_expect(bars + 8 * (2 * STAGES + j), WIN_BYTES);
        tma_2d(wins + j * WIN_BYTES, &w_map, bars + 8 * (2 * STAGES + j), j * 256, row0 / 16);
      }
    }
    for (int kb = 0; kb < NKB; ++kb) {
      const int stage = kb % STAGES, ws = kb % WSTAGES;
      const uint32_t phase = (kb / STAGES) & 1;
      if (kb >= STAGES) mbar_wait(bars + 8 * (STAGES + stage), phase ^ 1);
      const uint32_t wdst = base + stage * STAGE_BYTES;
      if (threadIdx.x == 0) {
        mbar_expect(bars + 8 * stage, X_BYTES);
        tma_2d(wdst + W_BYTES, &x_map, bars + 8 * stage, kb * 128, tok0);
      }
      // load i of a thread: row tile TILES_PER_WARP w + i / 2, k tile (i % 2) 4 + lane / 8, tile
      // rows 2 (lane % 8) and + 1 (the box: [8 row tiles, 8 k tiles x 16 rows x (hi, lo)] int32)
      mbar_wait(bars + 8 * (2 * STAGES + ws), (kb / WSTAGES) & 1);
      uint4 cur[2 * TILES_PER_WARP];
#pragma unroll
      for (int i = 0; i < 2 * TILES_PER_WARP; ++i) {
        const uint32_t src = wins + ws * WIN_BYTES + (TILES_PER_WARP * pwarp + i / 2) * 1024 +
                             ((i % 2) * 4 + lane / 8) * 128 + (lane % 8) * 16;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(cur[i].x), "=r"(cur[i].y), "=r"(cur[i].z), "=r"(cur[i].w) : "r"(src) : "memory");
      }
      // every producer thread has its windows: thread 0 refills the buffer (WSTAGES k-blocks ahead)
      asm volatile("bar.sync 1, %0;" ::"n"(128 * PRODUCERS) : "memory");
      if (threadIdx.x == 0 && kb + WSTAGES < NKB) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        mbar_expect(bars + 8 * (2 * STAGES + ws), WIN_BYTES);
        tma_2d(wins + ws * WIN_BYTES, &w_map, bars + 8 * (2 * STAGES + ws), (kb + WSTAGES) * 256, row0 / 16);
      }
#pragma unroll
      for (int i = 0; i < 2 * TILES_PER_WARP; ++i) {
        const int kt = (i % 2) * 4 + lane / 8;  // k tile inside the block: the 16-byte chunk of a row
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = (TILES_PER_WARP * pwarp + i / 2) * 16 + 2 * (lane % 8) + h;  // row inside the stage's tile
          const uint4 v = h == 0 ? tile_row_e4m3(cur[i].x, cur[i].y) : tile_row_e4m3(cur[i].z, cur[i].w);
          const uint32_t dst = wdst + r * 128 + ((kt ^ (r & 7)) << 4);
          asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                       : "memory");
#ifdef DUMP_CORE
          core[(static_cast<long long>(row0 + r) * Kp + kb * 128 + kt * 16) / 16] = v;
#endif
        }
      }
      // the tiles' generic-proxy stores, visible to the MMAs' async proxy, then one arrival a warp
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) mbar_arrive(bars + 8 * stage);
    }
    return;
  }

  // The consumers: warpgroup c multiplies weight rows 64 c .. 64 c + 63 by the BN tokens.
  const int c = wg - PRODUCERS;
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < NKB; ++kb) {
    const int stage = kb % STAGES;
    mbar_wait(bars + 8 * stage, (kb / STAGES) & 1);
    const uint32_t wsrc = base + stage * STAGE_BYTES;
    const uint64_t da = smem_desc(wsrc + c * 64 * 128), db = smem_desc(wsrc + W_BYTES);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < 4; ++s) WGMMA(acc, da + 2 * s, db + 2 * s, (kb > 0) | (s > 0));  // +32 bytes a k-step
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // the previous stage's MMAs are done
    if (kb > 0 && threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (kb - 1) % STAGES));
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");

  // z[tok, row] = bf16(acc * xscale[tok] / 64). Accumulator j of a thread (warp w, lane 4 g + t):
  // row 16 w + g + 8 ((j / 2) % 2), token 8 (j / 4) + 2 t + j % 2.
  const int g = lane / 4, t = lane % 4;
  const int row = row0 + c * 64 + warp * 16 + g;
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) {
    const int tok = tok0 + 8 * (j / 4) + 2 * t + (j % 2);
    if (tok < M)
      z[static_cast<long long>(tok) * Np + row + 8 * ((j / 2) % 2)] =
          __float2bfloat16_rn(acc[j] * xscale[tok] * 0.015625f);
  }
}
