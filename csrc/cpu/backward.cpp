// The backward of dilated_attention::bwd and varlen_bwd (ops.h says how the kernels work): Bwd,
// the backward of one (branch, batch, key/value head, segment, phase) task at the width of each
// instruction set (bwd_task_impl and its per-ISA entry points), and bwd_sequences, which runs those
// tasks over the sequences of a call, branch by branch, after delta (compute_delta_wide for float32
// inputs).

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                     */
/*   P = exp(s - lse), dS = P * (dout . (v - out) - delta), delta = dout . (out64 - out) - dlse  */
/*   (float32 inputs, out64 the forward's out unrounded: compute_delta_wide; else -dlse)         */
/*   dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dout                                   */
/*   With dropout (mask M of 0 and 1 / (1 - p)): dS = P * (M * (dout . v) - delta),            */
/*   delta = rowsum(dout * out) - dlse, and dv = (P * M)^T dout                                 */
/*                                                                                              */
/*   dout . (v - out) is dP - rowsum(dout * out) with the subtraction before the rounding: for a  */
/*   row whose weight sits on one key (large logits), v - out is tiny there and so is the error,  */
/*   where dP and the rowsum, two dot products rounded apart, would leave their difference's      */
/*   rounding (and out's) in dS, times P ~ 1: several times the error of plain PyTorch, whose     */
/*   softmax backward subtracts rowsum(P * dP) from the same rounded dP. out's own rounding      */
/*   stays in dout . (v - out), and float32 inputs take it back out through delta.              */
/* ------------------------------------------------------------------------------------------ */
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../dilated_attention.h"
#include "../dropout.h"
#include "backward.h"
#include "forward.h"
#include "head_major.h"
#include "isa.h"
#include "microgemm.h"
#include "ops.h"
#include "softmax.h"
#include "tasks.h"
#include "vec.h"

namespace dilated_attention {
namespace cpu {
namespace {

/*
 * delta[b, h, p] = dout . (out64 - out) - dlse for float32 inputs, so that dS = P (dout . (v - out)
 * - delta) = P (dout . (v - out64) + dlse): out64 is the row's output recomputed with P V and the
 * denominator summed in double, not rounded (Fwd::wide). It is taken where the recomputed lse is
 * the given one bit for bit and the given out lies within 2^-10 of out64 (the forward's own rows:
 * the Python layer hands the backward the forward's float64 lse); elsewhere (rows merged with other
 * keys, or any other out: the backward takes any out) the term is 0, as before. out rounded to
 * float leaves its rounding in dout . (v - out), times P ~ 1 for a row whose weight sits on one key
 * (large logits), where plain PyTorch's softmax backward subtracts rowsum(P * dP) from the same dP:
 * comparable errors, so that the backward's exceeded twice plain PyTorch's (SPEC section 4) in
 * about 1% of random cases at logit standard deviations of 32-64. Cost: B * Hq * N * D.
 */
static void compute_delta_wide(const Problem& P, const at::Tensor& dout, const at::Tensor& out,
                               const at::Tensor& out64, const at::Tensor& lse, const at::Tensor& lse64,
                               const float* dlse, float* delta) {
  const float* dp = dout.data_ptr<float>();
  const float* op = out.data_ptr<float>();
  const double* wp = out64.data_ptr<double>();
  const double* lp = lse.data_ptr<double>();
  const double* rp = lse64.data_ptr<double>();
  at::parallel_for(0, P.B * P.Hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.Hq, h = bh % P.Hq;
      for (int64_t p = 0; p < P.N; ++p) {
        const int64_t at = b * lse.stride(0) + h * lse.stride(1) + p;
        double c = 0;
        if (std::isfinite(lp[at]) && lp[at] == rp[b * lse64.stride(0) + h * lse64.stride(1) + p]) {
          const float* x = dp + b * dout.stride(0) + p * dout.stride(1) + h * dout.stride(2);
          const float* y = op + b * out.stride(0) + p * out.stride(1) + h * out.stride(2);
          const double* z = wp + b * out64.stride(0) + p * out64.stride(1) + h * out64.stride(2);
          double far = 0, size = 0;  // how far out is from out64, and the size of out64
          for (int64_t d = 0; d < P.D; ++d) {
            far = std::max(far, std::fabs(z[d] - (double)y[d]));
            size = std::max(size, std::fabs(z[d]));
            c += (double)x[d] * (z[d] - (double)y[d]);
          }
          if (!std::isfinite(c) || !(far <= size * 0x1p-10)) c = 0;
        }
        delta[bh * P.N + p] = (float)(c - (dlse ? (double)dlse[bh * P.N + p] : 0.0));
      }
    }
  });
}

template <typename T>
struct Bwd {
  const T *q, *k, *v, *dout;  // rows of Dp values (zero padded past D)
  const T* out;               // rows of Dp values at dout's strides (rows_like); null with dropout
  T *dq, *dk, *dv;            // accumulators, rows of Dp values
  int64_t q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, do_sb, do_sn, do_sh;
  int64_t dq_sb, dq_sn, dq_sh, dk_sb, dk_sn, dk_sh, dv_sb, dv_sn, dv_sh;
  const double* lse;  // (B, Hq, N) in double, row p of head h of batch entry b at b * lse_sb + h * lse_sh + p
  const T* delta;     // (B, Hq, N), as lse
  int64_t lse_sb, lse_sh;
  int64_t N, Hq, Hkv, D, Dp;
  da_branches br;
  int causal;
  T scale, scale2;  // softmax_scale, and softmax_scale * log2(e) as the forward rounds it
  double unit;      // softmax_scale / scale2: natural units per base-2 unit of the scores
  da_dropout drop;  // the forward's dropout (drop.threshold 0: none)
  int64_t start;    // the sequence's first row
};

/*
 * Backward of branch bi for one (batch b, key/value head hk, segment seg) and the query heads of
 * the group whose phase h % r is that of head hk * G + ph: adds this branch's share of dq, dk and
 * dv for the segment's covered rows. Cost: 5 * D multiply-adds and one exp per (query, key) pair.
 */
template <typename T, int B>
DA_INLINE void bwd_task_impl(const Bwd<T>& P, int64_t bi, int64_t b, int64_t hk, int64_t seg, int64_t ph,
                             BwdScratch<T>* s) {
  const int W = Vec<T, B>::W;
  const int64_t w = P.br.w[bi], r = P.br.r[bi], G = P.Hq / P.Hkv, D = P.D, Dp = P.Dp;
  const int64_t h0 = hk * G + ph;
  da_group g;
  da_group_at(seg, seg * w, da_min64(seg * w + w, P.N), P.N, w, r, h0 % r, &g);
  const int64_t c = g.seg_count;
  const T* kp = P.k + b * P.k_sb + g.seg_first * P.k_sn + hk * P.k_sh;
  const T* vp = P.v + b * P.v_sb + g.seg_first * P.v_sn + hk * P.v_sh;
  T* dkp = P.dk + b * P.dk_sb + g.seg_first * P.dk_sn + hk * P.dk_sh;
  T* dvp = P.dv + b * P.dv_sb + g.seg_first * P.dv_sn + hk * P.dv_sh;
  const int64_t ks = r * P.k_sn, vs = r * P.v_sn, qs = r * P.q_sn, dos = r * P.do_sn, dqs = r * P.dq_sn;
  for (int64_t kt0 = 0; kt0 < c; kt0 += KB) {
    const int64_t nk = da_min64(KB, c - kt0), nv = da_ceil_div(nk, W), ld = nv * W;
    pack_transposed(s->kt, ld, kp + kt0 * ks, ks, nk, D, (T)1);
    const double* kt_wide = widen_operand(s->kt, D, ld, s->wide);
    pack_transposed(s->vt, ld, vp + kt0 * vs, vs, nk, D, (T)1);
    for (int64_t i = 0; i < nk * Dp; ++i) s->dkt[i] = s->dvt[i] = 0;
    int64_t tiles = 0;  // query tiles summed into dkt and dvt
    for (int64_t h = h0; h < (hk + 1) * G; h += r) {
      const T* qp = P.q + b * P.q_sb + g.seg_first * P.q_sn + h * P.q_sh;
      const T* dop = P.dout + b * P.do_sb + g.seg_first * P.do_sn + h * P.do_sh;
      T* dqp = P.dq + b * P.dq_sb + g.seg_first * P.dq_sn + h * P.dq_sh;
      const double* lse_h = P.lse + b * P.lse_sb + h * P.lse_sh + g.seg_first;
      const T* delta_h = P.delta + b * P.lse_sb + h * P.lse_sh + g.seg_first;
      for (int64_t qt0 = P.causal ? kt0 : 0; qt0 < c; qt0 += QT) {
        const int64_t nq = da_min64(QT, c - qt0);
        for (int64_t i = 0; i < nq; ++i) {
          lse_base2<T>(lse_h[(qt0 + i) * r], P.unit, &s->lse[i], &s->lselo[i], &s->lselo2[i]);
          s->delta[i] = delta_h[(qt0 + i) * r];
        }
        const T* qi = qp + qt0 * qs;
        const T* doi = dop + qt0 * dos;
        gemm_scores<T, B>(s->s, s->slo, ld, qi, qs, 1, s->kt, ld, nq, nv, D, nullptr, P.scale2,
                          kt_wide);  // S2 = scale2 Q K^T
        if (P.out)                   // dO (V - O)^T
          gemm<T, B, true>(s->dp, ld, doi, dos, 1, s->vt, ld, nq, nv, D, false, nullptr, (T)1,
                           P.out + (doi - P.dout));
        else  // dP = dO V^T
          gemm<T, B>(s->dp, ld, doi, dos, 1, s->vt, ld, nq, nv, D, false);
        if (P.drop.threshold) {  // dP = M dO V^T; after ds_tile, P M for dV
          for (int64_t i = 0; i < nq * ld; ++i) s->mask[i] = 1;
          dropout_tile(P.drop, b * P.Hq + h, s->mask, ld, 1, nq, P.start + g.seg_first + qt0 * r, r, nk,
                       P.start + g.seg_first + kt0 * r, r);
          for (int64_t i = 0; i < nq * ld; ++i) s->dp[i] *= s->mask[i];
        }
        ds_tile<T, B>(s->s, std::is_same<T, float>::value ? s->slo : nullptr, s->dp, ld, nq, nk, P.causal,
                      qt0 - kt0, s->lse, s->lselo, s->lselo2, s->delta, P.scale);
        if (P.drop.threshold)
          for (int64_t i = 0; i < nq * ld; ++i) s->s[i] *= s->mask[i];
        gemm<T, B>(s->dvt, Dp, s->s, 1, ld, doi, dos, nk, Dp / W, nq, true);             // dV += P^T dO
        gemm<T, B>(s->dkt, Dp, s->dp, 1, ld, qi, qs, nk, Dp / W, nq, true);              // dK += dS^T Q
        gemm<T, B>(s->dqt, Dp, s->dp, ld, 1, kp + kt0 * ks, ks, nq, Dp / W, nk, false);  // dS K
        add_rows<T, B>(dqp + qt0 * dqs, dqs, s->dqt, nq, Dp);                            // dQ += dS K
        if (++tiles % SUM_TILES == 0) {  // a partial sum of dk and dv, then afresh
          add_rows<T, B>(dkp + kt0 * r * P.dk_sn, r * P.dk_sn, s->dkt, nk, Dp);
          add_rows<T, B>(dvp + kt0 * r * P.dv_sn, r * P.dv_sn, s->dvt, nk, Dp);
          for (int64_t i = 0; i < nk * Dp; ++i) s->dkt[i] = s->dvt[i] = 0;
        }
      }
    }
    add_rows<T, B>(dkp + kt0 * r * P.dk_sn, r * P.dk_sn, s->dkt, nk, Dp);
    add_rows<T, B>(dvp + kt0 * r * P.dv_sn, r * P.dv_sn, s->dvt, nk, Dp);
  }
}

/* The backward of one task at the vector width of each instruction set, and the dispatch. */
template <typename T>
__attribute__((noinline)) static void bwd_task_baseline(const Bwd<T>& P, int64_t bi, int64_t b, int64_t hk,
                                                        int64_t seg, int64_t ph, BwdScratch<T>* s) {
  bwd_task_impl<T, 16>(P, bi, b, hk, seg, ph, s);
}
#ifdef DA_X86_DISPATCH
template <typename T>
DA_TARGET_AVX2 static void bwd_task_avx2(const Bwd<T>& P, int64_t bi, int64_t b, int64_t hk, int64_t seg,
                                         int64_t ph, BwdScratch<T>* s) {
  bwd_task_impl<T, 32>(P, bi, b, hk, seg, ph, s);
}
template <typename T>
DA_TARGET_AVX512 static void bwd_task_avx512(const Bwd<T>& P, int64_t bi, int64_t b, int64_t hk, int64_t seg,
                                             int64_t ph, BwdScratch<T>* s) {
  bwd_task_impl<T, 64>(P, bi, b, hk, seg, ph, s);
}
#endif
template <typename T>
static void bwd_task(Isa isa, const Bwd<T>& P, int64_t bi, int64_t b, int64_t hk, int64_t seg, int64_t ph,
                     BwdScratch<T>* s) {
  switch (isa) {
#ifdef DA_X86_DISPATCH
    case Isa::avx512: return bwd_task_avx512<T>(P, bi, b, hk, seg, ph, s);
    case Isa::avx2: return bwd_task_avx2<T>(P, bi, b, hk, seg, ph, s);
#endif
    default: return bwd_task_baseline<T>(P, bi, b, hk, seg, ph, s);
  }
}

/*
 * The backward of every sequence of a call: dq (B, N, Hq, D), dk and dv (B, N, Hkv, D) from the
 * (B, N, ...) inputs, out, lse (B, Hq, N) and dlse (a packed call passes its (1, T, ...) views).
 * Branch by branch, tasks (sequence, key/value head, segment, phase) run bwd_task on the
 * sequence's rows as a sequence of their own; within one branch they write disjoint rows.
 */
static std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_sequences(
    const Problem& P, const std::vector<Sequence>& seqs, const at::Tensor& dout_in, const at::Tensor& q_in,
    const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const c10::optional<at::Tensor>& dlse_in, const da_dropout& drop) {
  const at::Tensor dout_c = last_dim_contiguous(dout_in);
  // lse read in double (float32 or float64, lse_base2); dlse and delta in the accumulation type.
  const at::Tensor lse = lse_in.to(at::kDouble).contiguous();
  const at::ScalarType acc = lse_dtype(q_in.scalar_type());
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) dlse = dlse_in->to(acc).contiguous();
  if (P.B == 0 || P.N == 0) return {at::zeros_like(q_in), at::zeros_like(k_in), at::zeros_like(v_in)};
  const at::Tensor out_c = out_for_backward(q_in, out_in, [&](at::Tensor& out32, at::Tensor& lse32) {
    fwd_sequences(P, seqs, q_in, k_in, v_in, out32, lse32, drop);
  });
  at::Tensor delta = at::empty(lse.sizes(), lse.options().dtype(acc));
  at::Tensor dq, dk, dv;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q_in.scalar_type(), "dilated_attention_bwd", [&] {
    using T = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const int64_t Dp = da_ceil_div(P.D, pad_values<T>()) * pad_values<T>();
    const Isa isa = cpu_isa();
    const at::ScalarType st = c10::CppTypeToScalarType<T>::value;
    // float32 without dropout: the forward once more, its out unrounded (compute_delta_wide)
    const bool wide = std::is_same<scalar_t, float>::value && !drop.threshold;
    if (wide) {
      at::Tensor out64 = at::empty(out_c.sizes(), out_c.options().dtype(at::kDouble));
      at::Tensor lse64 = at::empty(lse.sizes(), lse.options());
      fwd_sequences(P, seqs, q_in, k_in, v_in, out64, lse64, drop);
      compute_delta_wide(P, dout_c, out_c, out64, lse, lse64,
                         dlse.defined() ? dlse.data_ptr<float>() : nullptr, delta.data_ptr<float>());
    } else {
      compute_delta<scalar_t, T>(P, dout_c, out_c, dlse.defined() ? dlse.data_ptr<T>() : nullptr,
                                 drop.threshold != 0, delta.data_ptr<T>());
    }
    at::Tensor q = head_major_rows(q_in, st, Dp), k = head_major_rows(k_in, st, Dp),
               v = head_major_rows(v_in, st, Dp), dout = head_major_rows(dout_c, st, Dp);
    at::Tensor out = drop.threshold ? at::Tensor() : rows_like(out_c, dout, st, Dp);
    const at::TensorOptions opt = q_in.options().dtype(st);
    // Accumulators, head-major as the inputs: (B, H, N, Dp) seen as (B, N, H, Dp).
    const at::Tensor dq_acc = zeroed_buffer({P.B, P.Hq, P.N, Dp}, opt).transpose(1, 2),
                     dk_acc = zeroed_buffer({P.B, P.Hkv, P.N, Dp}, opt).transpose(1, 2),
                     dv_acc = zeroed_buffer({P.B, P.Hkv, P.N, Dp}, opt).transpose(1, 2);
    Bwd<T> A;
    point_backward<T>(&A, q, k, v, dout, dq_acc, dk_acc, dv_acc);
    A.out = out.defined() ? out.data_ptr<T>() : nullptr;
    A.lse = lse.data_ptr<double>();
    A.delta = delta.data_ptr<T>();
    A.lse_sb = lse.stride(0);
    A.lse_sh = lse.stride(1);
    A.N = P.N;
    A.Hq = P.Hq;
    A.Hkv = P.Hkv;
    A.D = P.D;
    A.Dp = Dp;
    A.br = P.branches;
    A.causal = P.is_causal;
    A.scale = (T)P.scale;
    A.scale2 = (T)(P.scale * 1.44269504088896340736);  // as the forward's
    A.unit = score_unit(P.scale, A.scale2);
    A.drop = drop;
    A.start = 0;
    const int64_t G = P.Hq / P.Hkv;
    // Branch by branch: within one, tasks (sequence, hk, segment, phase) write disjoint rows.
    for (int64_t bi = 0; bi < P.branches.n; ++bi) {
      const int64_t w = P.branches.w[bi];
      const int64_t nph = da_min64(G, P.branches.r[bi]);
      const TaskSplit split(seqs, [&](const Sequence& sq) { return P.Hkv * da_ceil_div(sq.len, w) * nph; });
      parallel_tasks(
          split.total(), [&] { return BwdScratch<T>(P.D, Dp); },
          [&](int64_t task, BwdScratch<T>& s) {
            int64_t i, local;
            split.locate(task, &i, &local);
            const Sequence& sq = seqs[i];
            const int64_t nseg = da_ceil_div(sq.len, w);
            const int64_t ph = local % nph, seg = (local / nph) % nseg, hk = local / (nph * nseg);
            Bwd<T> S = A;  // the sequence's rows as a sequence of their own
            S.q += sq.start * A.q_sn;
            S.k += sq.start * A.k_sn;
            S.v += sq.start * A.v_sn;
            S.dout += sq.start * A.do_sn;
            if (S.out) S.out += sq.start * A.do_sn;
            S.dq += sq.start * A.dq_sn;
            S.dk += sq.start * A.dk_sn;
            S.dv += sq.start * A.dv_sn;
            S.lse += sq.start;
            S.delta += sq.start;
            S.N = sq.len;
            S.start = sq.start;
            bwd_task(isa, S, bi, sq.b, hk, seg, ph, &s);
          });
    }
    // Back to the inputs' dtype and (B, N, H, D) layout, the input copies released first.
    q = k = v = dout = out = at::Tensor();
    dq = dq_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
    dk = dk_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
    dv = dv_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
  });
  return {dq, dk, dv};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale,
    double dropout_p, int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  check_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ", q_in.device());
  return bwd_sequences(P, fixed_sequences(P.B, P.N), dout_in, q_in, k_in, v_in, out_in, lse_in, dlse_in,
                       drop);
}

// The packed form: dout and out (T, Hq, D), lse and dlse (Hq, T); dq (T, Hq, D), dk and dv (T, Hkv, D).
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale, double dropout_p,
    int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_varlen_inputs(q_in, k_in, v_in, cu_seqlens, max_seqlen, segment_lengths,
                                        dilation_rates, is_causal, softmax_scale);
  const c10::optional<at::Tensor> dlse =
      check_varlen_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ", q_in.device());
  const std::vector<Sequence> seqs = varlen_sequences(cu_seqlens, P.N, max_seqlen);
  auto grads = bwd_sequences(P, seqs, dout_in.unsqueeze(0), q_in.unsqueeze(0), k_in.unsqueeze(0),
                             v_in.unsqueeze(0), out_in.unsqueeze(0), lse_in.unsqueeze(0), dlse, drop);
  return {std::get<0>(grads).squeeze(0), std::get<1>(grads).squeeze(0), std::get<2>(grads).squeeze(0)};
}

}  // namespace cpu
}  // namespace dilated_attention
