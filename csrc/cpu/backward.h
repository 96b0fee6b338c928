// What the backward (backward.cpp) shares with the pieces' (piece.cpp): a thread's backward scratch,
// the out it reads (out_for_backward) and delta (compute_delta).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <stdint.h>

#include <vector>

#include "../checks.h"
#include "tasks.h"
#include "vec.h"

namespace dilated_attention {
namespace cpu {

template <typename T>
struct BwdScratch {
  Arena<T> arena;
  T *kt, *vt;                // (D, KB) keys and values of the tile, transposed
  T *dkt, *dvt;              // (KB, Dp) their gradients
  T *s, *dp;                 // (QT, KB): scores then P; dout . v then dS
  T* slo;                    // (QT, KB): the scores' low parts (float rows)
  T *lse, *lselo, *lselo2;   // (QT): lse in base 2 (lse / unit) as hi + lo + lo2 (lse_base2)
  T* delta;                  // (QT)
  T* dqt;                    // (QT, Dp): one key tile's share of dq
  T* mask;                   // (QT, KB): dropout's factors (0 or 1 / (1 - p)) of the tile
  std::vector<double> wide;  // kt in double, for the scores of float rows (widen_operand)
  BwdScratch(int64_t D, int64_t Dp)
      : arena(Arena<T>::need({(size_t)(D * KB), (size_t)(D * KB), (size_t)(KB * Dp), (size_t)(KB * Dp),
                              QT * KB, QT * KB, QT * KB, QT, QT, QT, QT, (size_t)(QT * Dp), QT * KB})) {
    kt = arena.take(D * KB);
    vt = arena.take(D * KB);
    dkt = arena.take(KB * Dp);
    dvt = arena.take(KB * Dp);
    s = arena.take(QT * KB);
    dp = arena.take(QT * KB);
    slo = arena.take(QT * KB);
    lse = arena.take(QT);
    lselo = arena.take(QT);
    lselo2 = arena.take(QT);
    delta = arena.take(QT);
    dqt = arena.take(QT * Dp);
    mask = arena.take(QT * KB);
  }
};

/*
 * The out that the backward reads (out_for_backward): for float16 and bfloat16 inputs, out in
 * float32. Rounded to float16 or bfloat16, out would leave its rounding in dout . (v - out) (delta,
 * with dropout), times P ~ 1 for a row whose weight sits on one key: half a unit in the last place
 * of out times |dout|, summed over D, where the exact difference is tiny and plain PyTorch's softmax
 * backward, which subtracts rowsum(P * dP) from the same dP, leaves no such error (2.7x the rule's
 * bound in dq for one-branch causal inputs with large logits).
 */

/*
 * out for the backward of inputs q: out itself, except for float16 and bfloat16 inputs, whose
 * backward reads a float32 out: recompute(out32, lse32) writes the forward's float32 out (the
 * same values before their rounding), which is taken where its rounding is the given out, and the
 * given out elsewhere (an out the forward did not compute, such as rows merged with other keys:
 * the backward takes any out). Cost: one forward for float16 and bfloat16 inputs.
 */
template <typename Recompute>
static at::Tensor out_for_backward(const at::Tensor& q, const at::Tensor& out, const Recompute& recompute) {
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) return last_dim_contiguous(out);
  at::Tensor out32 = at::empty(out.sizes(), out.options().dtype(at::kFloat));
  at::Tensor lse32 = at::empty({out.size(0), out.size(2), out.size(1)}, out32.options());
  recompute(out32, lse32);
  return at::where(out32.to(out.scalar_type()) == out, out32, out.to(at::kFloat));
}

/* delta[b, h, p] = sum_d dout * out - dlse (with_out) or -dlse, one value per query row; out in T
 * (out_for_backward). Cost: B * Hq * N * D. */
template <typename scalar_t, typename T>
static void compute_delta(const Problem& P, const at::Tensor& dout, const at::Tensor& out, const T* dlse,
                          bool with_out, T* delta) {
  const scalar_t* dp = dout.data_ptr<scalar_t>();
  const T* op = with_out ? out.data_ptr<T>() : nullptr;
  at::parallel_for(0, P.B * P.Hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.Hq, h = bh % P.Hq;
      for (int64_t p = 0; p < P.N; ++p) {
        const scalar_t* x = dp + b * dout.stride(0) + p * dout.stride(1) + h * dout.stride(2);
        const T* y = with_out ? op + b * out.stride(0) + p * out.stride(1) + h * out.stride(2) : nullptr;
        T sum = 0;
        for (int64_t d = 0; with_out && d < P.D; ++d) sum += (T)x[d] * (T)y[d];
        delta[bh * P.N + p] = sum - (dlse ? dlse[bh * P.N + p] : (T)0);
      }
    }
  });
}

}  // namespace cpu
}  // namespace dilated_attention
