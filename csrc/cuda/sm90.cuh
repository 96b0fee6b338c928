// sm90 primitives of the warpgroup kernels (tc90_kernels.cuh): shared-memory matrix descriptors,
// the swizzled tile layout they describe, wgmma.mma_async (wgmma_ops.cuh) and its fences, the
// proxy fence between cp.async's writes and wgmma's reads of shared memory, mbarriers and the
// tensor copy engine's box loads (tma.h). The instructions exist
// only in code compiled for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL): elsewhere DA_SM90A is 0 and the
// kernels compile to nothing (the host checks which code the GPU runs, tc90_available). Under
// DA_CUDA_EMULATION they run on the CPU (tests/cuda_emulation/cuda_emulation.h).
#pragma once

#include "common.cuh"
#include "wgmma_ops.cuh"

#if defined(DA_CUDA_EMULATION)
#define DA_SM90A 1
#elif defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DA_SM90A 1
#else
#define DA_SM90A 0
#endif

namespace dilated_attention {
namespace cuda {

/*
 * The tiles the warpgroup MMAs read: `rows` rows of DP 16-bit elements, stored as DP / PW panels of
 * PW columns (by default 64 where DP is a multiple of 64, else 32), each panel `rows` rows of PW * 2 =
 * W bytes (128 or 64), the 16-byte chunks of a row XOR-swizzled by the row's address bits [7, 10)
 * (W = 128) or [7, 9) (W = 64): the canonical "128B" or "64B swizzle" layout of the PTX ISA, in
 * which both ldmatrix-free MMA operands (Q, K as K-major, V as MN-major) are read without bank
 * conflicts. A tile starts on a 1024-byte boundary (the swizzle works on absolute addresses).
 */
template <int DP_, int PW_ = (DP_ % 64 == 0 ? 64 : 32)>
struct Sw90 {
  static_assert((PW_ == 64 || PW_ == 32) && DP_ % PW_ == 0, "panels of 64 or 32 columns");
  static constexpr int DP = DP_;                 // columns (the padded head dim)
  static constexpr int PW = PW_;                 // columns per panel
  static constexpr int W = PW * 2;               // bytes per row of a panel
  static constexpr int MODE = PW == 64 ? 1 : 2;  // descriptor swizzle mode: 1 = 128B, 2 = 64B
  static constexpr int PANELS = DP / PW;

  // Byte offset of the 16-byte chunk `ch` (columns 8 ch .. 8 ch + 7) of row `row` in a tile of
  // `rows` rows.
  __host__ __device__ static __forceinline__ uint32_t chunk_offset(int rows, int row, int ch) {
    const int panel = ch / (PW / 8), c = ch % (PW / 8);
    const uint32_t a = (uint32_t)(panel * rows * W + row * W + c * 16);
    return a ^ (((a >> 7) & (uint32_t)(PW / 8 - 1)) << 4);
  }
  // Element offset of (row, col).
  __host__ __device__ static __forceinline__ uint32_t elem(int rows, int row, int col) {
    return chunk_offset(rows, row, col / 8) / 2 + col % 8;
  }
};

__device__ __forceinline__ uint32_t smem_address(const void* p) {
#if defined(DA_CUDA_EMULATION)
  return da_emu::shared_address(p);
#else
  return (uint32_t)__cvta_generic_to_shared(p);
#endif
}

// A matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (each in units of 16 bytes, 14 bits), base offset 0, swizzle mode in bits 62-63.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t start, uint32_t lbo, uint32_t sbo, int mode) {
  return (uint64_t)((start >> 4) & 0x3fff) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3fff) << 32) | ((uint64_t)mode << 62);
}

// K-major operand (A of 64 rows, or B of n rows) of a Sw90 tile L: columns 16 kk .. 16 kk + 15.
// Rows of 8 are W * 8 bytes apart (SBO); the leading offset is unused by swizzled K-major layouts.
template <typename L>
__device__ __forceinline__ uint64_t desc_k_major(const void* tile, int rows, int kk) {
  const int col = 16 * kk, panel = col / L::PW;
  const uint32_t start = smem_address(tile) + (uint32_t)(panel * rows * L::W + (col % L::PW) * 2);
  return wgmma_desc(start, 16, 8 * L::W, L::MODE);
}

// MN-major B operand of a Sw90 tile L (rows = the reduction index): rows 16 kk .. 16 kk + 15, the
// columns from c0 (a multiple of L::PW) on. Panels are rows * W bytes apart (LBO), groups of 8 rows
// W * 8 (SBO).
template <typename L>
__device__ __forceinline__ uint64_t desc_mn_major(const void* tile, int rows, int kk, int c0 = 0) {
  const uint32_t start = smem_address(tile) + (uint32_t)((c0 / L::PW) * rows * L::W + 16 * kk * L::W);
  return wgmma_desc(start, (uint32_t)(rows * L::W), 8 * L::W, L::MODE);
}

// Makes this thread's cp.async writes to shared memory (generic proxy) visible to wgmma's reads
// (async proxy); then a barrier, so that every thread's are.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(DA_CUDA_EMULATION)
  da_emu::fence_proxy_async();
#elif DA_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(DA_CUDA_EMULATION)
  da_emu::wgmma_simple(da_emu::kWgFence, 0);
#elif DA_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(DA_CUDA_EMULATION)
  da_emu::wgmma_simple(da_emu::kWgCommit, 0);
#elif DA_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(DA_CUDA_EMULATION)
  da_emu::wgmma_simple(da_emu::kWgWait, N);
#elif DA_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of an accumulator (or of A fragments) across a
// wgmma wait, or register moves into them between wgmma_fence and the MMAs (ptxas would then
// insert a fence of its own, C7519): called after each wait and before each wgmma_fence.
template <int NT>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[NT][4]) {
#if !defined(DA_CUDA_EMULATION) && DA_SM90A
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
#endif
}

template <int NT>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[NT][4]) {
#if !defined(DA_CUDA_EMULATION) && DA_SM90A
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
#endif
}

// d (64 x N, f32, the mma C layout per warp and 8 columns) = A B (+ d when scale_d): A and B
// K-major descriptors.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int scale_d) {
#if defined(DA_CUDA_EMULATION)
  da_emu::wgmma(&d[0][0], N, nullptr, da, db, scale_d, std::is_same<T, __nv_bfloat16>::value, false);
#elif DA_SM90A
  WgmmaPtx<T, N>::ss(d, da, db, scale_d);
#endif
}

// The same with A from registers (the warp's mma.m16n8k16 A fragment) and B MN-major.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db,
                                         int scale_d) {
#if defined(DA_CUDA_EMULATION)
  da_emu::wgmma(&d[0][0], N, a, 0, db, scale_d, std::is_same<T, __nv_bfloat16>::value, true);
#elif DA_SM90A
  WgmmaPtx<T, N>::rs(d, a, db, scale_d);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Warp specialisation: named barriers and register reallocation                                */
/* ------------------------------------------------------------------------------------------ */

// Named barrier `id` (1..15) of the `count` threads (whole warps) that use it; returns whether
// pred holds in any of them.
__device__ __forceinline__ bool named_barrier_or(int id, int count, bool pred) {
#if defined(DA_CUDA_EMULATION)
  return da_emu::named_barrier(id, count, pred) != 0;
#elif DA_SM90A
  int out;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(out)
      : "r"((int)pred), "r"(id), "r"(count)
      : "memory");
  return __shfl_sync(DA_FULL_MASK, out, 0) != 0;  // (the compiler then knows it uniform in the warp)
#else
  return pred;
#endif
}

// Gives back registers (every thread of the warpgroup, the same count) / takes them up to count.
template <int COUNT>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(DA_CUDA_EMULATION)
  da_emu::setmaxnreg(COUNT);
#elif DA_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(COUNT));
#endif
}

template <int COUNT>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(DA_CUDA_EMULATION)
  da_emu::setmaxnreg(COUNT);
#elif DA_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(COUNT));
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* mbarrier and the tensor copy engine (TMA)                                                    */
/* ------------------------------------------------------------------------------------------ */

// An mbarrier in shared memory (8 bytes) expecting `count` arrivals per phase. Then
// fence_barrier_init and a barrier, before any thread uses it.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mbar_init(bar, count);
#elif DA_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void fence_barrier_init() {
#if !defined(DA_CUDA_EMULATION) && DA_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// This thread's arrival on bar, announcing `bytes` that copies will complete in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mbar_arrive_expect_tx(bar, bytes);
#elif DA_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
#endif
}

// This thread's arrival on bar (release: its earlier shared-memory writes are seen by the threads
// that wait on the phase).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mbar_arrive(bar);
#elif DA_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
#endif
}

// This thread's cp.async copies issued so far complete on bar: its current phase expects one more
// arrival, made when they have landed. The threads that wait on the phase then execute
// fence_proxy_async before a wgmma reads the copies.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_async_mbar_arrive(bar);
#elif DA_SM90A
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
#endif
}

// Asynchronous copy of BYTES (4 or 8) global -> shared, both aligned to BYTES; zero-fills the
// destination when !valid (gmem is then not read but must still be a valid address). It completes
// as cp_async16's do (on an mbarrier by cp_async_mbar_arrive, or by the thread's wait).
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void* smem, const void* gmem, bool valid) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_async(smem, valid ? gmem : nullptr, BYTES);
#elif DA_SM90A
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "n"(BYTES), "r"(valid ? BYTES : 0)
               : "memory");
#endif
}

// Waits until the phase of parity `parity` of bar has completed (its arrivals and bytes).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mbar_wait(bar, parity);
#elif DA_SM90A
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
#endif
}

// The box of tensor map `map` (a TmaMaps entry, in kernel parameter space) at coordinates c, into
// shared memory at dst (swizzled as the map says), completing its bytes on bar.
__device__ __forceinline__ void tma_load_5d(void* dst, const void* map, const int32_t (&c)[5],
                                            uint64_t* bar) {
#if defined(DA_CUDA_EMULATION)
  da_emu::tma_load(dst, map, c, bar);
#elif DA_SM90A
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
      "%4, "
      "%5, %6}], [%7];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]),
      "r"(smem_address(bar))
      : "memory");
#endif
}

}  // namespace cuda
}  // namespace dilated_attention
