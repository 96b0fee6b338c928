// What the host side of the CUDA op passes to the kernels, and the launchers that each .cu file
// defines. Plain structs, passed to the kernels by value.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "../dilated_attention.h"
#include "../dropout.h"
#include "decode_params.h"
#include "tiling.h"

namespace dilated_attention {
namespace cuda {

// A (B, N, H, D) tensor whose last dimension is contiguous, read through its strides (elements).
struct Tensor4 {
  void* data;
  int64_t sb, sn, sh;
};

// Everything one launch needs. acc_t below is float for float16/bfloat16/float32 inputs and
// double for float64 inputs; lse and delta are (B, Hq, N) contiguous arrays of acc_t.
struct Params {
  Tensor4 q, k, v;  // inputs; (B, N, Hq, D) and (B, N, Hkv, D)
  Tensor4 out;      // forward: written; backward (delta kernel): the forward's output, read
  int out_f32;      // out holds float (acc_t), not scalar_t: the backward's float32 recomputation
                    // of a float16/bfloat16 forward's out, which the delta kernel then reads
  Tensor4 dout;     // backward: gradient of out
  Tensor4 dq, dk, dv;
  void* lse;                    // forward: written; backward: read; acc_t, or double (lse_f64)
  int lse_f64;                  // lse holds double whatever acc_t (the op's float64_lse)
  void* delta;                  // backward: rowsum(dout * out) - dlse
  const void* dlse;             // backward: gradient of lse, or nullptr
  int64_t B, N, Hq, Hkv, D, G;  // G = Hq / Hkv; B, N of the tensors (a packed call: 1 and T)
  // The sequences, one per blockIdx.z (sequence_rows in common.cuh): num_seqs = B sequences of N
  // rows when cu_seqlens is null; else num_seqs = S packed sequences of the (1, T, ...) tensors,
  // sequence i the rows [cu_seqlens[i], cu_seqlens[i + 1]) (int32, on the device).
  const int32_t* cu_seqlens;
  int64_t num_seqs;
  da_branches br;
  // A piece (piece_fwd/piece_bwd, tiling.h): N = piece.nq queries over piece.nk keys, k and v of
  // (B, nk, Hkv, D), one branch (w = max(nq, nk), r = 1); the dk/dv kernel's rows are the nk keys.
  // piece.nk = 0 (zeroed Params): the op.
  da_piece piece;
  int is_causal;
  double scale;  // softmax scale
  // Attention dropout (dropout.h), keyed by the rows of the (B, N, ...) tensors (a sequence's start
  // plus the position) and head b * Hq + h; drop.threshold = 0: none (always for a piece).
  da_dropout drop;
  da_tiling tiling;  // how rows are cut into thread blocks (tiling.h)
  int other_tile;    // SIMT kernels: keys (or queries) per step, <= 32
  int tma;           // sm90 kernels: load by the tensor copy engine where they can (tma.h)
};

enum class DType { kHalf, kBFloat16, kFloat, kDouble };

// Tensor-core kernels (sm80+, float16/bfloat16, D % 8 == 0, 32 <= D <= 256; tc_kernels.cuh).
// Each returns its launch configuration; nothing runs unless `launch` is true.
struct TcConfig {
  int rows_per_warp;  // 16
  int warps;          // 4
  int smem_bytes;     // dynamic shared memory per thread block
  int d_chunks;       // dk/dv: thread blocks per (tile, kv head) along the head dim
};
TcConfig tc_fwd_f16(const Params& p, bool launch, cudaStream_t stream);
TcConfig tc_fwd_bf16(const Params& p, bool launch, cudaStream_t stream);
TcConfig tc_dq_f16(const Params& p, bool launch, cudaStream_t stream);
TcConfig tc_dq_bf16(const Params& p, bool launch, cudaStream_t stream);
TcConfig tc_dkv_f16(const Params& p, bool launch, cudaStream_t stream);
TcConfig tc_dkv_bf16(const Params& p, bool launch, cudaStream_t stream);
// The sm90 kernels (tc90_kernels.cuh, wgmma; sm_90a code only) of pass `kernel` (kFwd, kDq, kDkv
// below), float16 (half) or bfloat16: the same results as the tc_* kernels. tc90_available says
// whether the device runs their sm_90a code (a probe launched once per device).
TcConfig tc90_call(int kernel, bool half, const Params& p, bool launch, cudaStream_t stream);
bool tc90_available(int device);
// Whether the driver has refused a tensor map of theirs in this process (their chunks then load by
// cp.async; tma.h).
bool tma_refused();

// SIMT kernels (any arch, every dtype, 1 <= D <= 256; simt.cu). rows_per_warp (<= 4) comes from
// the tiling and other_tile (<= 32) from the params; simt_smem_bytes says what they need.
// The three kernels of the op: forward, the dq pass and the dk/dv pass of the backward.
enum { kFwd = 0, kDq = 1, kDkv = 2 };
int simt_smem_bytes(int64_t D, DType t, int64_t rows_per_warp, int other_tile, int kernel);
void simt_fwd(const Params& p, DType t, cudaStream_t stream);
void simt_dq(const Params& p, DType t, cudaStream_t stream);
void simt_dkv(const Params& p, DType t, cudaStream_t stream);
void delta_kernel(const Params& p, DType t, cudaStream_t stream);

// The decode step (decode.cuh, decode_launch.cu): its three launches (write the token, partial
// results per head, branch and split of the keys, merge) on `stream`, for inputs of dtype t.
void decode_launch(const DecodeParams& p, DType t, cudaStream_t stream);

#ifndef DA_CUDA_EMULATION
// Above 48 KiB of dynamic shared memory a kernel must be allowed more first
// (cudaFuncAttributeMaxDynamicSharedMemorySize). The attribute stays set for the life of the
// process, so each kernel asks once per device, and again only for a larger size: one SmemOptIn
// per kernel (a function-local static of its launcher) remembers what each device granted.
struct SmemOptIn {
  static constexpr int kDevices = 64;  // devices beyond this many ask on every call
  std::atomic<int> granted[kDevices] = {};
};

// Whether `kernel` may be launched with `smem` bytes of dynamic shared memory on the current
// device. When the device refuses, nothing is launched and the refusal is the CUDA runtime's last
// error, which the caller's C10_CUDA_KERNEL_LAUNCH_CHECK (cudaGetLastError) raises. The host code
// checks the sizes against the device's limit beforehand, so a refusal is not expected.
template <typename Kernel>
inline bool smem_opt_in(SmemOptIn& state, Kernel kernel, int smem) {
  if (smem <= 48 * 1024) return true;
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  std::atomic<int>* granted = dev >= 0 && dev < SmemOptIn::kDevices ? &state.granted[dev] : nullptr;
  if (granted != nullptr && granted->load(std::memory_order_acquire) >= smem) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return false;
  if (granted != nullptr) {
    int seen = granted->load(std::memory_order_relaxed);
    while (seen < smem && !granted->compare_exchange_weak(seen, smem, std::memory_order_release)) {}
  }
  return true;
}
#endif  // DA_CUDA_EMULATION

}  // namespace cuda
}  // namespace dilated_attention
