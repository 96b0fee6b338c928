// CPU implementation of dilated_attention::piece_fwd and dilated_attention::piece_bwd: the pieces
// of a segment that spans ranks (dilated_attention.ring).
//
// A piece is dense attention of nq queries over nk keys, both already sparsified (one head phase of
// one segment): q (B, nq, Hq, D), k and v (B, nk, Hkv, D), query head h reading key/value head
// h / (Hq / Hkv). With is_causal, key j is visible to query i when j <= i + causal_offset; key
// tiles that no query of a tile sees are skipped, and a query that sees no key gets out = 0 and
// lse = -inf. The backward takes any out and lse (the ring passes those merged over all the keys
// a row reads) and computes this piece's share of the exact gradients, as the op's bwd does.
//
//   forward  (b, h, tile of QT queries): key tiles of KF with the online softmax of the op's
//            forward (queries in vector lanes).
//   backward (b, key/value head): FlashAttention-2 order, key tiles of KB outer, the group's query
//            heads and query tiles inner (from the first query that sees the tile); dk and dv
//            accumulate in the tile, dq in a head-major accumulator. Tasks write disjoint rows.
//
// Cost: forward 2 * D multiply-adds per visible (query, key) pair, backward 5 * D and D
// subtractions (float16 and bfloat16: 2 * D more, the forward once more for a float32 out).
// Memory: the outputs and the head-major copies of the op (forward 3, backward 8 tensors of
// B * H * n * Dp values), O(threads * (QT + KB) * Dp) scratch.
//
// A translation unit of its own on the op's kernel parts: the micro-kernel (microgemm.h), the
// tile steps (softmax.h), the scratch and tasks (forward.h, backward.h, tasks.h), the head-major
// copies (head_major.h) and the instruction-set dispatch (isa.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <stdint.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "../checks.h"
#include "../dilated_attention.h"
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

template <typename T>
struct PieceArgs {
  const T *q, *k, *v, *dout;  // rows of Dp values (zero padded past D)
  const T* out;               // backward: rows of Dp values at dout's strides (rows_like)
  T *dq, *dk, *dv;            // backward accumulators, rows of Dp values
  int64_t q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, do_sb, do_sn, do_sh;
  int64_t dq_sb, dq_sn, dq_sh, dk_sb, dk_sn, dk_sh, dv_sb, dv_sn, dv_sh;
  const double* lse;  // (B, Hq, nq) in double, backward only
  const T* delta;     // (B, Hq, nq), backward only
  int64_t nq, nk, Hq, Hkv, D, Dp;
  int causal;
  int64_t offset;   // key j is visible to query i when j <= i + offset (causal only)
  T scale, scale2;  // softmax_scale, and softmax_scale * log2(e)
  double unit;      // softmax_scale / scale2: natural units per base-2 unit of the scores
};

/*
 * Forward of one (batch b, head h, query tile starting at qt0): leaves the tile's max (the reference
 * pair s->mt + s->mtlo, online_softmax), denominator and unnormalised output in s->lt, s->acct. Cost: 2 * D multiply-adds and one exp per
 * visible (query, key) pair of the tile.
 */
template <typename T, int B>
DA_INLINE void piece_fwd_tile_impl(const PieceArgs<T>& P, int64_t b, int64_t h, int64_t qt0,
                                   FwdScratch<T>* s) {
  const int W = Vec<T, B>::W;
  const int64_t D = P.D, Dp = P.Dp, hk = h / (P.Hq / P.Hkv);
  const int64_t nq = da_min64(QT, P.nq - qt0), nv = da_ceil_div(nq, W), ld = nv * W;
  pack_transposed(s->qt, ld, P.q + b * P.q_sb + qt0 * P.q_sn + h * P.q_sh, P.q_sn, nq, D, (T)1);
  const double* qt_wide = widen_operand(s->qt, D, ld, s->wide);
  for (int64_t i = 0; i < ld; ++i) {
    s->mt[i] = neg_inf<T>();
    s->mtlo[i] = 0;
    s->lt[i] = 0;
  }
  for (int64_t i = 0; i < nq * Dp; ++i) s->acct[i] = 0;
  const T* kp = P.k + b * P.k_sb + hk * P.k_sh;
  const T* vp = P.v + b * P.v_sb + hk * P.v_sh;
  // keys that the tile's last query sees: j <= qt0 + nq - 1 + offset
  const int64_t nk_all = P.causal ? da_max64(0, da_min64(P.nk, qt0 + nq + P.offset)) : P.nk;
  for (int64_t kt0 = 0; kt0 < nk_all; kt0 += KF) {
    const int64_t nk = da_min64(KF, nk_all - kt0);
    const bool diag = P.causal && kt0 + nk - 1 > qt0 + P.offset;  // the first query misses some
    for (int64_t i = 0; i < ld; ++i) s->tmax[i] = neg_inf<T>();
    gemm_scores<T, B>(s->st, s->stlo, ld, kp + kt0 * P.k_sn, P.k_sn, 1, s->qt, ld, nk, nv, D,
                      diag ? nullptr : s->tmax, P.scale2, qt_wide);  // S^T = scale2 K Q^T and its column max
    if (diag) mask_future<T, B>(s->st, ld, nk, nv, kt0 - qt0 - P.offset);
    online_softmax<T, B>(s->st, std::is_same<T, float>::value ? s->stlo : nullptr, ld, nk, nv, s->mt, s->mtlo,
                         s->lt, s->corr, diag ? nullptr : s->tmax);
    for (int64_t i = 0; i < nq; ++i) {
      const T c = s->corr[i];
      if (c != 1)
        for (int64_t d = 0; d < Dp; ++d) s->acct[i * Dp + d] *= c;
    }
    gemm<T, B>(s->acct, Dp, s->st, 1, ld, vp + kt0 * P.v_sn, P.v_sn, nq, Dp / W, nk, true);  // += P V
  }
}

template <typename T>
__attribute__((noinline)) static void piece_fwd_tile_baseline(const PieceArgs<T>& P, int64_t b, int64_t h,
                                                              int64_t qt0, FwdScratch<T>* s) {
  piece_fwd_tile_impl<T, 16>(P, b, h, qt0, s);
}
#ifdef DA_X86_DISPATCH
template <typename T>
DA_TARGET_AVX2 static void piece_fwd_tile_avx2(const PieceArgs<T>& P, int64_t b, int64_t h, int64_t qt0,
                                               FwdScratch<T>* s) {
  piece_fwd_tile_impl<T, 32>(P, b, h, qt0, s);
}
template <typename T>
DA_TARGET_AVX512 static void piece_fwd_tile_avx512(const PieceArgs<T>& P, int64_t b, int64_t h, int64_t qt0,
                                                   FwdScratch<T>* s) {
  piece_fwd_tile_impl<T, 64>(P, b, h, qt0, s);
}
#endif
template <typename T>
static void piece_fwd_tile(Isa isa, const PieceArgs<T>& P, int64_t b, int64_t h, int64_t qt0,
                           FwdScratch<T>* s) {
  switch (isa) {
#ifdef DA_X86_DISPATCH
    case Isa::avx512: return piece_fwd_tile_avx512<T>(P, b, h, qt0, s);
    case Isa::avx2: return piece_fwd_tile_avx2<T>(P, b, h, qt0, s);
#endif
    default: return piece_fwd_tile_baseline<T>(P, b, h, qt0, s);
  }
}

/*
 * Backward of one (batch b, key/value head hk): adds this piece's dq for the group's query heads
 * and its dk, dv for head hk. Cost: 5 * D multiply-adds and one exp per visible (query, key) pair.
 */
template <typename T, int B>
DA_INLINE void piece_bwd_task_impl(const PieceArgs<T>& P, int64_t b, int64_t hk, BwdScratch<T>* s) {
  const int W = Vec<T, B>::W;
  const int64_t G = P.Hq / P.Hkv, D = P.D, Dp = P.Dp;
  const T* kp = P.k + b * P.k_sb + hk * P.k_sh;
  const T* vp = P.v + b * P.v_sb + hk * P.v_sh;
  T* dkp = P.dk + b * P.dk_sb + hk * P.dk_sh;
  T* dvp = P.dv + b * P.dv_sb + hk * P.dv_sh;
  for (int64_t kt0 = 0; kt0 < P.nk; kt0 += KB) {
    const int64_t q_first = P.causal ? da_max64(0, kt0 - P.offset) : 0;  // first query that sees key kt0
    if (q_first >= P.nq) break;  // no query sees this tile or any later one
    const int64_t nk = da_min64(KB, P.nk - kt0), nv = da_ceil_div(nk, W), ld = nv * W;
    pack_transposed(s->kt, ld, kp + kt0 * P.k_sn, P.k_sn, nk, D, (T)1);
    const double* kt_wide = widen_operand(s->kt, D, ld, s->wide);
    pack_transposed(s->vt, ld, vp + kt0 * P.v_sn, P.v_sn, nk, D, (T)1);
    for (int64_t i = 0; i < nk * Dp; ++i) s->dkt[i] = s->dvt[i] = 0;
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
      const T* qp = P.q + b * P.q_sb + h * P.q_sh;
      const T* dop = P.dout + b * P.do_sb + h * P.do_sh;
      T* dqp = P.dq + b * P.dq_sb + h * P.dq_sh;
      const double* lse_h = P.lse + (b * P.Hq + h) * P.nq;
      const T* delta_h = P.delta + (b * P.Hq + h) * P.nq;
      for (int64_t qt0 = q_first; qt0 < P.nq; qt0 += QT) {
        const int64_t nq = da_min64(QT, P.nq - qt0);
        for (int64_t i = 0; i < nq; ++i) {
          lse_base2<T>(lse_h[qt0 + i], P.unit, &s->lse[i], &s->lselo[i], &s->lselo2[i]);
          s->delta[i] = delta_h[qt0 + i];
        }
        const T* qi = qp + qt0 * P.q_sn;
        const T* doi = dop + qt0 * P.do_sn;
        // the forward's scores bit for bit, so that they cancel its lse
        gemm_scores<T, B>(s->s, s->slo, ld, qi, P.q_sn, 1, s->kt, ld, nq, nv, D, nullptr, P.scale2,
                          kt_wide);  // S2 = scale2 Q K^T
        gemm<T, B, true>(s->dp, ld, doi, P.do_sn, 1, s->vt, ld, nq, nv, D, false, nullptr, (T)1,
                         P.out + (doi - P.dout));  // dO (V - O)^T
        ds_tile<T, B>(s->s, std::is_same<T, float>::value ? s->slo : nullptr, s->dp, ld, nq, nk, P.causal,
                      qt0 + P.offset - kt0, s->lse, s->lselo, s->lselo2, s->delta, P.scale);
        gemm<T, B>(s->dvt, Dp, s->s, 1, ld, doi, P.do_sn, nk, Dp / W, nq, true);  // dV += P^T dO
        gemm<T, B>(s->dkt, Dp, s->dp, 1, ld, qi, P.q_sn, nk, Dp / W, nq, true);   // dK += dS^T Q
        gemm<T, B>(dqp + qt0 * P.dq_sn, P.dq_sn, s->dp, ld, 1, kp + kt0 * P.k_sn, P.k_sn, nq, Dp / W, nk,
                   true);  // dQ += dS K
      }
    }
    add_rows<T, B>(dkp + kt0 * P.dk_sn, P.dk_sn, s->dkt, nk, Dp);
    add_rows<T, B>(dvp + kt0 * P.dv_sn, P.dv_sn, s->dvt, nk, Dp);
  }
}

template <typename T>
__attribute__((noinline)) static void piece_bwd_task_baseline(const PieceArgs<T>& P, int64_t b, int64_t hk,
                                                              BwdScratch<T>* s) {
  piece_bwd_task_impl<T, 16>(P, b, hk, s);
}
#ifdef DA_X86_DISPATCH
template <typename T>
DA_TARGET_AVX2 static void piece_bwd_task_avx2(const PieceArgs<T>& P, int64_t b, int64_t hk,
                                               BwdScratch<T>* s) {
  piece_bwd_task_impl<T, 32>(P, b, hk, s);
}
template <typename T>
DA_TARGET_AVX512 static void piece_bwd_task_avx512(const PieceArgs<T>& P, int64_t b, int64_t hk,
                                                   BwdScratch<T>* s) {
  piece_bwd_task_impl<T, 64>(P, b, hk, s);
}
#endif
template <typename T>
static void piece_bwd_task(Isa isa, const PieceArgs<T>& P, int64_t b, int64_t hk, BwdScratch<T>* s) {
  switch (isa) {
#ifdef DA_X86_DISPATCH
    case Isa::avx512: return piece_bwd_task_avx512<T>(P, b, hk, s);
    case Isa::avx2: return piece_bwd_task_avx2<T>(P, b, hk, s);
#endif
    default: return piece_bwd_task_baseline<T>(P, b, hk, s);
  }
}

/*
 * The piece's forward into out (B, nq, Hq, D), in the inputs' dtype or in the accumulation type
 * (the backward's float32 recomputation for float16 and bfloat16 inputs), and lse (B, Hq, nq).
 */
static void piece_fwd_into(const Problem& P, const at::Tensor& q_in, const at::Tensor& k_in,
                           const at::Tensor& v_in, bool is_causal, int64_t causal_offset, at::Tensor& out,
                           at::Tensor& lse) {
  const int64_t nq = P.N, nk = k_in.size(1);
  if (P.B == 0 || nq == 0) return;
  const int64_t ntiles = da_ceil_div(nq, QT);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q_in.scalar_type(), "dilated_attention_piece_fwd", [&] {
        using T = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
        const int64_t Dp = da_ceil_div(P.D, pad_values<T>()) * pad_values<T>();
        const Isa isa = cpu_isa();
        const at::ScalarType st = c10::CppTypeToScalarType<T>::value;
        const at::Tensor q = head_major_rows(q_in, st, Dp), k = head_major_rows(k_in, st, Dp),
                         v = head_major_rows(v_in, st, Dp);
        PieceArgs<T> A{};
        point_qkv<T>(&A, q, k, v);
        A.nq = nq;
        A.nk = nk;
        A.Hq = P.Hq;
        A.Hkv = P.Hkv;
        A.D = P.D;
        A.Dp = Dp;
        A.causal = is_causal;
        A.offset = piece_offset(is_causal, causal_offset, nq, nk);
        A.scale2 = (T)(P.scale * 1.44269504088896340736);
        A.unit = score_unit(P.scale, A.scale2);
        scalar_t* out_p = out.scalar_type() == q_in.scalar_type() ? out.data_ptr<scalar_t>() : nullptr;
        T* out_t = out_p ? nullptr : out.data_ptr<T>();                    // the float32 recomputation
        T* lse_t = lse.scalar_type() == st ? lse.data_ptr<T>() : nullptr;  // else a float64 lse
        double* lse_d = lse_t ? nullptr : lse.data_ptr<double>();
        parallel_tasks(
            P.B * P.Hq * ntiles, [&] { return FwdScratch<T>(1, P.D, Dp); },
            [&](int64_t task, FwdScratch<T>& s) {
              const int64_t tile = task % ntiles, bh = task / ntiles;
              const int64_t h = bh % P.Hq, b = bh / P.Hq, qt0 = tile * QT, n = da_min64(QT, nq - qt0);
              piece_fwd_tile(isa, A, b, h, qt0, &s);
              for (int64_t i = 0; i < n;
                   ++i) {  // out = acc / l, lse = (m + mlo) unit + ln l; no key: 0, -inf
                const int64_t ot = b * out.stride(0) + (qt0 + i) * out.stride(1) + h * out.stride(2);
                const T l = s.lt[i];
                const T inv = l == 0 ? (T)0 : (T)1 / l;
                for (int64_t d = 0; d < P.D; ++d) {
                  const T x = l == 0 ? (T)0 : s.acct[i * Dp + d] * inv;
                  if (out_t)
                    out_t[ot + d] = x;
                  else
                    out_p[ot + d] = (scalar_t)x;
                }
                const double L = l == 0 ? -INFINITY : lse_natural(s.mt[i], s.mtlo[i], A.unit, (double)l);
                if (lse_t)
                  lse_t[bh * nq + qt0 + i] = (T)L;
                else
                  lse_d[bh * nq + qt0 + i] = L;
              }
            });
      });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> piece_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, bool is_causal,
                                                 int64_t causal_offset, double softmax_scale,
                                                 bool float64_lse) {
  const Problem P = check_piece_inputs(q_in, k_in, v_in, softmax_scale);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention piece: expected CPU tensors, got ", q_in.device());
  at::Tensor out = at::empty({P.B, P.N, P.Hq, P.D}, q_in.options());
  at::Tensor lse =
      at::empty({P.B, P.Hq, P.N}, q_in.options().dtype(lse_dtype(q_in.scalar_type(), float64_lse)));
  piece_fwd_into(P, q_in, k_in, v_in, is_causal, causal_offset, out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> piece_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const c10::optional<at::Tensor>& dlse_in,
    bool is_causal, int64_t causal_offset, double softmax_scale) {
  const Problem P = check_piece_inputs(q_in, k_in, v_in, softmax_scale);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention piece: expected CPU tensors, got ", q_in.device());
  check_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  const int64_t nq = P.N, nk = k_in.size(1);
  const at::Tensor dout_c = last_dim_contiguous(dout_in);
  const at::Tensor lse = lse_in.to(at::kDouble).contiguous();  // read in double (lse_base2)
  const at::ScalarType acc = lse_dtype(q_in.scalar_type());
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) dlse = dlse_in->to(acc).contiguous();
  if (P.B == 0 || nq == 0 || nk == 0)
    return {at::zeros_like(q_in), at::zeros_like(k_in), at::zeros_like(v_in)};
  const at::Tensor out_c = out_for_backward(q_in, out_in, [&](at::Tensor& out32, at::Tensor& lse32) {
    piece_fwd_into(P, q_in, k_in, v_in, is_causal, causal_offset, out32, lse32);
  });
  at::Tensor delta = at::empty(lse.sizes(), lse.options().dtype(acc));
  at::Tensor dq, dk, dv;

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, q_in.scalar_type(), "dilated_attention_piece_bwd", [&] {
        using T = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
        const int64_t Dp = da_ceil_div(P.D, pad_values<T>()) * pad_values<T>();
        const Isa isa = cpu_isa();
        const at::ScalarType st = c10::CppTypeToScalarType<T>::value;
        compute_delta<scalar_t, T>(P, dout_c, out_c, dlse.defined() ? dlse.data_ptr<T>() : nullptr, false,
                                   delta.data_ptr<T>());  // -dlse: dS = P (dO (V - O)^T + dlse)
        at::Tensor q = head_major_rows(q_in, st, Dp), k = head_major_rows(k_in, st, Dp),
                   v = head_major_rows(v_in, st, Dp), dout = head_major_rows(dout_c, st, Dp),
                   out = rows_like(out_c, dout, st, Dp);
        const at::TensorOptions opt = q_in.options().dtype(st);
        const at::Tensor dq_acc = zeroed_buffer({P.B, P.Hq, nq, Dp}, opt).transpose(1, 2),
                         dk_acc = zeroed_buffer({P.B, P.Hkv, nk, Dp}, opt).transpose(1, 2),
                         dv_acc = zeroed_buffer({P.B, P.Hkv, nk, Dp}, opt).transpose(1, 2);
        PieceArgs<T> A{};
        point_backward<T>(&A, q, k, v, dout, dq_acc, dk_acc, dv_acc);
        A.out = out.data_ptr<T>();
        A.lse = lse.data_ptr<double>();
        A.delta = delta.data_ptr<T>();
        A.nq = nq;
        A.nk = nk;
        A.Hq = P.Hq;
        A.Hkv = P.Hkv;
        A.D = P.D;
        A.Dp = Dp;
        A.causal = is_causal;
        A.offset = piece_offset(is_causal, causal_offset, nq, nk);
        A.scale = (T)P.scale;
        A.scale2 = (T)(P.scale * 1.44269504088896340736);
        A.unit = score_unit(P.scale, A.scale2);
        parallel_tasks(
            P.B * P.Hkv, [&] { return BwdScratch<T>(P.D, Dp); },
            [&](int64_t task, BwdScratch<T>& s) { piece_bwd_task(isa, A, task / P.Hkv, task % P.Hkv, &s); });
        q = k = v = dout = out = at::Tensor();
        dq = dq_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
        dk = dk_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
        dv = dv_acc.narrow(3, 0, P.D).to(q_in.scalar_type()).contiguous();
      });
  return {dq, dk, dv};
}

}  // namespace cpu
}  // namespace dilated_attention
