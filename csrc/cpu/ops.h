// CPU implementation of dilated_attention::fwd and dilated_attention::bwd (and of varlen_fwd,
// varlen_bwd, piece_fwd and piece_bwd): the entry points, registered in register.cpp.
//
// Fused: no N x N matrix and no per-branch outputs. For one head, one branch and one segment, the
// covered positions form an arithmetic progression (dilated index j, position seg_first + j * r),
// and the covered queries attend densely to the covered keys of the same progression. The kernels
// read those rows in place through a stride of r rows, in tiles:
//
//   forward  (b, h, block of QB positions): for every branch and segment the block's covered
//            queries go in tiles of QT (queries in vector lanes, transposed into a small buffer),
//            against key tiles of KB with an online softmax; each tile's result is merged into the
//            block's per-position state (max m, denominator l, unnormalised output), so all
//            branches of a query share one softmax (SPEC section 3).
//   backward (branch, b, key/value head, segment, phase): FlashAttention-2 order, key tiles outer
//            (K, V transposed into small buffers, keys in vector lanes), query tiles inner; dk and
//            dv accumulate in registers/tiles, dq in the output. Tasks of one branch touch disjoint
//            rows, so they run in parallel without atomics; branches run one after another.
//
// All products go through one register-blocked micro-kernel (gemm, microgemm.h) written with GCC
// vector extensions. The kernels are templates over the vector width and are compiled three times,
// each at the width of one instruction set's registers: AVX-512 (64 bytes), AVX2 + FMA (32) and the
// baseline (16: SSE2, or NEON on ARM); see isa.h. The widest set the CPU has is chosen once per
// process (cpu_isa, isa.cpp), so one build runs well on every x86-64 CPU. Scores are kept in base 2
// (dot products times softmax_scale * log2(e)) and exponentiated by a vectorised 2^x (degree-6
// polynomial, relative error about 1e-7); float64 calls libm's exp2. For float rows every score
// sums its D products in double and is kept as a float and its float remainder (micro_scores), and
// the forward merges its tiles and branches into a per-position state in double, out = acc / l
// rounded once. NaN propagates, -inf scores add nothing, a row that no branch covers gets out = 0
// and lse = -inf.
//
// The kernels read q, k, v (and dout) as head-major rows: one (B, H, N, Dp) copy of each, in float32
// (float64 for float64 inputs), zero padded to Dp, a multiple of the widest vector (head_major_rows,
// head_major.cpp); inputs that already are such rows are read in place. The backward accumulates
// dq, dk and dv in the same layout and converts them back to (B, N, H, D) at the end.
//
// Cost: forward 2 * D multiply-adds per (query, key) pair with multiplicity, backward 5 * D (S, dP,
// dV, dK, dQ) and D subtractions (dP as dout . (v - out), see backward.cpp); the forward once more
// in the backward (2 * D): for float32 inputs (without dropout) with its out unrounded, for delta
// (compute_delta_wide), for float16 and bfloat16 for a float32 out (out_for_backward). The scores of
// float rows and that float32 recomputation's P V sum in double (half the vector width).
// Memory: the outputs, the head-major copies (forward 3, backward 8
// tensors of B * H * N * Dp values), the (B, Hq, N) delta of the backward, and
// O(threads * (QB + QT + KB) * Dp) scratch.
//
// The files of this folder:
//   ops.h          the entry points of the op's CPU kernels (this file), registered in register.cpp
//   forward.cpp    fwd, varlen_fwd: the forward (forward.h: its scratch and fwd_sequences, shared)
//   backward.cpp   bwd, varlen_bwd: the backward (backward.h: its scratch, out_for_backward and
//                  compute_delta, shared with the pieces)
//   piece.cpp      piece_fwd, piece_bwd: the pieces of a segment that spans ranks (the ring)
//   isa.h/.cpp     the instruction sets: target attributes, detection and choice (cpu_isa)
//   vec.h          tile sizes, the vectors (Vec) and 2^x
//   microgemm.h    the micro-kernel (gemm, gemm_scores, gemm_wide_acc) and tile copies
//   softmax.h      the steps between the products: masks, online softmax, dropout, P and dS
//   tasks.h        threads: scratch arenas, parallel_tasks, TaskSplit
//   head_major.h/.cpp  the head-major copies and zeroed buffers
//   register.cpp   TORCH_LIBRARY_IMPL(dilated_attention, CPU)
//   decode_cpu.cpp, dropout_cpu.cpp  decode_step and dropout_mask, on their own
//
// The headers' helpers are templates, static or always inlined (DA_INLINE) as when the kernels
// were one file: each .cpp file instantiates its own copies, and the per-ISA entry points inline
// the vector helpers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <stdint.h>

#include <tuple>

namespace dilated_attention {
namespace cpu {

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                           at::IntArrayRef dilation_rates, bool is_causal,
                                           double softmax_scale, bool float64_lse, double dropout_p,
                                           int64_t dropout_seed, int64_t dropout_offset);

std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                  const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                  int64_t max_seqlen, at::IntArrayRef segment_lengths,
                                                  at::IntArrayRef dilation_rates, bool is_causal,
                                                  double softmax_scale, bool float64_lse, double dropout_p,
                                                  int64_t dropout_seed, int64_t dropout_offset);

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset);

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset);

std::tuple<at::Tensor, at::Tensor> piece_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, bool is_causal,
                                                 int64_t causal_offset, double softmax_scale,
                                                 bool float64_lse);

std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    bool is_causal, int64_t causal_offset, double softmax_scale);

}  // namespace cpu
}  // namespace dilated_attention
