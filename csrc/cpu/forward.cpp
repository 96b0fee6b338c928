// The forward of dilated_attention::fwd and varlen_fwd (ops.h says how the kernels work): Fwd, the
// forward of one (batch, head, block of QB positions) at the width of each instruction set
// (fwd_block_impl and its per-ISA entry points), and fwd_sequences, which runs those blocks over the
// sequences of a call and writes out and lse; the backward runs it again for its recomputations.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <stdint.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../dilated_attention.h"
#include "../dropout.h"
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
struct Fwd {
  const T *q, *k, *v;  // rows of Dp values (zero padded past D)
  int64_t q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh;
  int64_t N, Hq, Hkv, D, Dp, QB;
  da_branches br;
  int causal;
  T scale2;         // softmax_scale * log2(e): the forward keeps scores, max and lse in base 2
  da_dropout drop;  // attention dropout (drop.threshold 0: none), keyed by rows start + position
  int64_t start;    // the sequence's first row in the (B, N, ...) tensors
  int wide;         // float rows: sum P V and the denominator in double, out unrounded (the
                    // backward's recomputation for float32 inputs, compute_delta_wide)
};

/* Whether rows[j * stride + d] is finite for j < n, d < D. */
template <typename T>
DA_INLINE bool rows_finite(const T* rows, int64_t stride, int64_t n, int64_t D) {
  bool ok = true;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d)
      ok &= rows[j * stride + d] - rows[j * stride + d] == 0;  // NaN for inf, NaN
  return ok;
}

/* Merge a query tile's state (reference pair m2 + mlo2, l2, acc2) into the block's rows row0 + i * step,
 * against the larger reference pair (pair_ge, softmax.h). */
template <typename T, typename A>
DA_INLINE void merge_tile(T* m, T* mlo, double* l, double* acc, const T* m2, const T* mlo2, const T* l2,
                          const A* acc2, int64_t n, int64_t row0, int64_t step, int64_t Dp,
                          double* lw = nullptr, const double* lw2 = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    if (l2[i] == 0) continue;  // only -inf scores: nothing to add
    const int64_t row = row0 + i * step;
    double* a = acc + row * Dp;
    const A* b = acc2 + i * Dp;
    if (l[row] == 0) {
      m[row] = m2[i];
      mlo[row] = mlo2[i];
      l[row] = l2[i];
      if (lw) lw[row] = lw2[i];
      for (int64_t d = 0; d < Dp; ++d) a[d] = b[d];
      continue;
    }
    const bool first = pair_ge(m[row], mlo[row], m2[i], mlo2[i]);
    const T mx = first ? m[row] : m2[i], mxlo = first ? mlo[row] : mlo2[i];
    const double ca = ::exp2(((double)m[row] - (double)mx) + ((double)mlo[row] - (double)mxlo)),
                 cb = ::exp2(((double)m2[i] - (double)mx) + ((double)mlo2[i] - (double)mxlo));
    m[row] = mx;
    mlo[row] = mxlo;
    l[row] = l[row] * ca + l2[i] * cb;
    if (lw) lw[row] = lw[row] * ca + lw2[i] * cb;
    for (int64_t d = 0; d < Dp; ++d) a[d] = a[d] * ca + b[d] * cb;
  }
}

/*
 * Forward of one (batch b, head h, block [a0, a1) of positions): leaves the block's max,
 * denominator and unnormalised output per position in s (rows a0..a1). Cost: 2 * D multiply-adds
 * and one exp per (query, key) pair of the block's queries, all branches.
 */
template <typename T, int B>
DA_INLINE void fwd_block_impl(const Fwd<T>& P, int64_t b, int64_t h, int64_t a0, int64_t a1,
                              FwdScratch<T>* s) {
  const int W = Vec<T, B>::W;
  const int64_t D = P.D, Dp = P.Dp, hk = h / (P.Hq / P.Hkv), rows = a1 - a0;
  constexpr bool can_widen = std::is_same<T, float>::value;
  const bool wide = can_widen && P.wide;
  for (int64_t i = 0; i < rows; ++i) {
    s->m[i] = neg_inf<T>();
    s->mlo[i] = 0;
    s->l[i] = 0;
    s->lw[i] = 0;
  }
  for (int64_t i = 0; i < rows * Dp; ++i) s->acc[i] = 0;
  // the tile state afresh: max, denominator and output (in double too, wide)
  auto restart = [&](int64_t nq, int64_t ld) {
    for (int64_t i = 0; i < ld; ++i) {
      s->mt[i] = neg_inf<T>();
      s->mtlo[i] = 0;
      s->lt[i] = 0;
    }
    if (wide) {
      for (int64_t i = 0; i < ld; ++i) s->ltw[i] = 0;
      for (int64_t i = 0; i < nq * Dp; ++i) s->acctw[i] = 0;
    } else {
      for (int64_t i = 0; i < nq * Dp; ++i) s->acct[i] = 0;
    }
  };
  auto merge = [&](int64_t nq, int64_t row0, int64_t step) {
    if (wide)
      merge_tile(s->m, s->mlo, s->l, s->acc, s->mt, s->mtlo, s->lt, s->acctw, nq, row0, step, Dp, s->lw,
                 s->ltw);
    else
      merge_tile(s->m, s->mlo, s->l, s->acc, s->mt, s->mtlo, s->lt, s->acct, nq, row0, step, Dp);
  };

  for (int64_t bi = 0; bi < P.br.n; ++bi) {
    const int64_t w = P.br.w[bi], r = P.br.r[bi], o = h % r;
    for (int64_t seg = da_first_segment(a0, w); seg <= da_last_segment(a1, w); ++seg) {
      da_group g;
      da_group_at(seg, a0, a1, P.N, w, r, o, &g);
      const T* kp = P.k + b * P.k_sb + g.seg_first * P.k_sn + hk * P.k_sh;
      const T* vp = P.v + b * P.v_sb + g.seg_first * P.v_sn + hk * P.v_sh;
      const int64_t ks = r * P.k_sn, vs = r * P.v_sn;
      for (int64_t q0 = 0; q0 < g.count; q0 += QT) {
        const int64_t nq = da_min64(QT, g.count - q0), nv = da_ceil_div(nq, W), ld = nv * W;
        const int64_t jq0 = g.j0 + q0;  // dilated index of the tile's first query
        const T* qp = P.q + b * P.q_sb + (g.first + q0 * r) * P.q_sn + h * P.q_sh;
        pack_transposed(s->qt, ld, qp, r * P.q_sn, nq, D, (T)1);
        const double* qt_wide = widen_operand(s->qt, D, ld, s->wide);
        restart(nq, ld);
        const int64_t nk_all = P.causal ? da_min64(g.seg_count, jq0 + nq) : g.seg_count;
        for (int64_t kt0 = 0; kt0 < nk_all; kt0 += KF) {
          const int64_t nk = da_min64(KF, nk_all - kt0);
          const bool diag = P.causal && kt0 + nk - 1 > jq0;
          for (int64_t i = 0; i < ld; ++i) s->tmax[i] = neg_inf<T>();
          gemm_scores<T, B>(s->st, s->stlo, ld, kp + kt0 * ks, ks, 1, s->qt, ld, nk, nv, D,
                            diag ? nullptr : s->tmax, P.scale2, qt_wide);  // S^T = scale2 K Q^T, column max
          if (diag) mask_future<T, B>(s->st, ld, nk, nv, kt0 - jq0);
          online_softmax<T, B>(s->st, std::is_same<T, float>::value ? s->stlo : nullptr, ld, nk, nv, s->mt,
                               s->mtlo, s->lt, s->corr, diag ? nullptr : s->tmax);
          if (wide) {  // the same weights and corrections, summed in double
            for (int64_t i = 0; i < nq; ++i) {
              const double c = s->corr[i];
              if (c == 1) continue;
              s->ltw[i] *= c;
              for (int64_t d = 0; d < Dp; ++d) s->acctw[i * Dp + d] *= c;
            }
            for (int64_t j = 0; j < nk; ++j)
              for (int64_t i = 0; i < nq; ++i) s->ltw[i] += s->st[j * ld + i];
          } else {
            for (int64_t i = 0; i < nq; ++i) {
              const T c = s->corr[i];
              if (c != 1)
                for (int64_t d = 0; d < Dp; ++d) s->acct[i * Dp + d] *= c;
            }
          }
          if (P.drop.threshold)  // the denominator has the weights; the output their kept share
            dropout_tile(P.drop, b * P.Hq + h, s->st, 1, ld, nq, P.start + g.first + q0 * r, r, nk,
                         P.start + g.seg_first + kt0 * r, r);
          if (diag && !rows_finite(vp + kt0 * vs, vs, nk, D)) {
            // A non-finite value must reach only the queries that see its key, not the earlier
            // ones through 0 * inf in a masked lane: each query row takes only its own keys.
            for (int64_t i = 0; i < nq; ++i) {
              const int64_t nki = da_min64(nk, jq0 + i - kt0 + 1);
              if (nki <= 0) continue;
              if constexpr (can_widen) {
                if (wide) {
                  widen_rows(s->vw, vp + kt0 * vs, vs, nki, Dp);
                  gemm_wide_acc<B>(s->acctw + i * Dp, Dp, s->st + i, 1, ld, s->vw, Dp, 1, Dp / W, nki);
                  continue;
                }
              }
              gemm<T, B>(s->acct + i * Dp, Dp, s->st + i, 1, ld, vp + kt0 * vs, vs, 1, Dp / W, nki, true);
            }
          } else {
            bool done = false;
            if constexpr (can_widen) {
              if (wide) {  // += P V in double
                widen_rows(s->vw, vp + kt0 * vs, vs, nk, Dp);
                gemm_wide_acc<B>(s->acctw, Dp, s->st, 1, ld, s->vw, Dp, nq, Dp / W, nk);
                done = true;
              }
            }
            if (!done)
              gemm<T, B>(s->acct, Dp, s->st, 1, ld, vp + kt0 * vs, vs, nq, Dp / W, nk, true);  // += P V
          }
          if (kt0 / KF % SUM_TILES == SUM_TILES - 1 && kt0 + KF < nk_all) {  // a partial sum, then afresh
            merge(nq, g.first + q0 * r - a0, r);
            restart(nq, ld);
          }
        }
        merge(nq, g.first + q0 * r - a0, r);
      }
    }
  }
}

/* The forward of one block at the vector width of each instruction set, and the dispatch. */
template <typename T>
__attribute__((noinline)) static void fwd_block_baseline(const Fwd<T>& P, int64_t b, int64_t h, int64_t a0,
                                                         int64_t a1, FwdScratch<T>* s) {
  fwd_block_impl<T, 16>(P, b, h, a0, a1, s);
}
#ifdef DA_X86_DISPATCH
template <typename T>
DA_TARGET_AVX2 static void fwd_block_avx2(const Fwd<T>& P, int64_t b, int64_t h, int64_t a0, int64_t a1,
                                          FwdScratch<T>* s) {
  fwd_block_impl<T, 32>(P, b, h, a0, a1, s);
}
template <typename T>
DA_TARGET_AVX512 static void fwd_block_avx512(const Fwd<T>& P, int64_t b, int64_t h, int64_t a0, int64_t a1,
                                              FwdScratch<T>* s) {
  fwd_block_impl<T, 64>(P, b, h, a0, a1, s);
}
#endif
template <typename T>
static void fwd_block(Isa isa, const Fwd<T>& P, int64_t b, int64_t h, int64_t a0, int64_t a1,
                      FwdScratch<T>* s) {
  switch (isa) {
#ifdef DA_X86_DISPATCH
    case Isa::avx512: return fwd_block_avx512<T>(P, b, h, a0, a1, s);
    case Isa::avx2: return fwd_block_avx2<T>(P, b, h, a0, a1, s);
#endif
    default: return fwd_block_baseline<T>(P, b, h, a0, a1, s);
  }
}

/* out = acc / l and lse = (m + mlo) * unit + ln(l) for the block's rows, in double (rounded once, to L:
 * float, or double for a float64 lse); uncovered rows: 0 and -inf. unit = softmax_scale / scale2
 * turns the base-2 scores back into natural ones: ln 2, corrected for the rounding of scale2 to T,
 * which would otherwise scale lse by up to one unit in the last place of T. */
template <typename scalar_t, typename T, typename L>
static void fwd_write(const FwdScratch<T>& s, scalar_t* out, int64_t out_sn, L* lse, int64_t a0, int64_t a1,
                      int64_t D, int64_t Dp, double unit, bool wide = false) {
  for (int64_t p = a0; p < a1; ++p) {
    const int64_t row = p - a0;
    const double l = s.l[row];
    scalar_t* o = out + p * out_sn;
    if (l == 0) {
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)0;
      lse[p] = neg_inf<L>();
    } else if (wide) {  // double, unrounded
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(s.acc[row * Dp + d] / s.lw[row]);
      lse[p] = (L)lse_natural(s.m[row], s.mlo[row], unit, l);
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(T)(s.acc[row * Dp + d] / l);
      lse[p] = (L)lse_natural(s.m[row], s.mlo[row], unit, l);
    }
  }
}

/* Positions per forward block: enough that the most dilated branch still has QT queries in it,
 * but small enough to give every thread several blocks. */
static int64_t block_size(const Problem& P, const std::vector<Sequence>& seqs) {
  int64_t rmax = 1;
  for (int64_t i = 0; i < P.branches.n; ++i) rmax = da_max64(rmax, P.branches.r[i]);
  int64_t qb = da_min64(QT * rmax, 1024);
  const int64_t want = 8 * (int64_t)at::get_num_threads();
  auto blocks = [&](int64_t qb) {
    int64_t n = 0;
    for (const Sequence& sq : seqs) n += P.Hq * da_ceil_div(sq.len, qb);
    return n;
  };
  while (qb > QT && blocks(qb) < want) qb /= 2;
  return da_max64(qb, 1);
}

}  // namespace

void fwd_sequences(const Problem& P, const std::vector<Sequence>& seqs, const at::Tensor& q_in,
                   const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& out, at::Tensor& lse,
                   const da_dropout& drop) {
  const int64_t QB = block_size(P, seqs);
  const TaskSplit split(seqs, [&](const Sequence& sq) { return P.Hq * da_ceil_div(sq.len, QB); });
  if (split.total() == 0) return;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q_in.scalar_type(), "dilated_attention_fwd", [&] {
    using T = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const int64_t Dp = da_ceil_div(P.D, pad_values<T>()) * pad_values<T>();
    const Isa isa = cpu_isa();
    const at::ScalarType st = c10::CppTypeToScalarType<T>::value;
    const at::Tensor q = head_major_rows(q_in, st, Dp), k = head_major_rows(k_in, st, Dp),
                     v = head_major_rows(v_in, st, Dp);
    Fwd<T> F;
    point_qkv<T>(&F, q, k, v);
    F.N = P.N;
    F.Hq = P.Hq;
    F.Hkv = P.Hkv;
    F.D = P.D;
    F.Dp = Dp;
    F.QB = QB;
    F.br = P.branches;
    F.causal = P.is_causal;
    F.scale2 = (T)(P.scale * 1.44269504088896340736);
    F.drop = drop;
    F.start = 0;
    // out is in the inputs' dtype, or in T (the backward's float32 recomputation for float16 and
    // bfloat16 inputs: the same values before their rounding), or in double for float rows (the
    // backward's recomputation for float32 inputs, Fwd::wide: P V and the denominator summed in
    // double, out not rounded; the same lse bit for bit).
    const bool wide = std::is_same<T, float>::value && out.scalar_type() == at::kDouble;
    TORCH_INTERNAL_ASSERT(!wide || !drop.threshold);
    F.wide = wide;
    double* out_w = wide ? out.data_ptr<double>() : nullptr;
    scalar_t* out_p = !wide && out.scalar_type() == q_in.scalar_type() ? out.data_ptr<scalar_t>() : nullptr;
    T* out_t = wide || out_p ? nullptr : out.data_ptr<T>();
    // lse is float32, or float64 (float64 inputs, or a float64 lse asked for): written as such.
    T* lse_t = lse.scalar_type() == st ? lse.data_ptr<T>() : nullptr;
    double* lse_d = lse_t ? nullptr : lse.data_ptr<double>();
    parallel_tasks(
        split.total(), [&] { return FwdScratch<T>(QB, P.D, Dp); },
        [&](int64_t task, FwdScratch<T>& s) {
          int64_t i, local;
          split.locate(task, &i, &local);
          const Sequence& sq = seqs[i];
          const int64_t nblocks = da_ceil_div(sq.len, QB), blk = local % nblocks, h = local / nblocks;
          const int64_t a0 = blk * QB, a1 = da_min64(a0 + QB, sq.len);
          Fwd<T> S = F;  // the sequence's rows as a sequence of their own
          S.q += sq.start * F.q_sn;
          S.k += sq.start * F.k_sn;
          S.v += sq.start * F.v_sn;
          S.N = sq.len;
          S.start = sq.start;
          fwd_block(isa, S, sq.b, h, a0, a1, &s);
          const int64_t ot = sq.b * out.stride(0) + sq.start * out.stride(1) + h * out.stride(2);
          const int64_t at = sq.b * lse.stride(0) + h * lse.stride(1) + sq.start;
          const double unit = score_unit(P.scale, F.scale2);
          if (out_w && lse_t)
            fwd_write<double, T>(s, out_w + ot, out.stride(1), lse_t + at, a0, a1, P.D, Dp, unit, true);
          else if (out_w)
            fwd_write<double, T>(s, out_w + ot, out.stride(1), lse_d + at, a0, a1, P.D, Dp, unit, true);
          else if (out_t && lse_t)
            fwd_write<T, T>(s, out_t + ot, out.stride(1), lse_t + at, a0, a1, P.D, Dp, unit);
          else if (out_t)
            fwd_write<T, T>(s, out_t + ot, out.stride(1), lse_d + at, a0, a1, P.D, Dp, unit);
          else if (lse_t)
            fwd_write<scalar_t, T>(s, out_p + ot, out.stride(1), lse_t + at, a0, a1, P.D, Dp, unit);
          else
            fwd_write<scalar_t, T>(s, out_p + ot, out.stride(1), lse_d + at, a0, a1, P.D, Dp, unit);
        });
  });
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                           at::IntArrayRef dilation_rates, bool is_causal,
                                           double softmax_scale, bool float64_lse, double dropout_p,
                                           int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ", q_in.device());
  at::Tensor out = at::empty({P.B, P.N, P.Hq, P.D}, q_in.options());
  at::Tensor lse =
      at::empty({P.B, P.Hq, P.N}, q_in.options().dtype(lse_dtype(q_in.scalar_type(), float64_lse)));
  if (P.B == 0 || P.N == 0) return {out, lse};
  fwd_sequences(P, fixed_sequences(P.B, P.N), q_in, k_in, v_in, out, lse, drop);
  return {out, lse};
}

// The packed form: q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,); out (T, Hq, D) and
// lse (Hq, T). Rows of empty sequences do not exist; every row belongs to one sequence.
std::tuple<at::Tensor, at::Tensor> varlen_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                  const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                  int64_t max_seqlen, at::IntArrayRef segment_lengths,
                                                  at::IntArrayRef dilation_rates, bool is_causal,
                                                  double softmax_scale, bool float64_lse, double dropout_p,
                                                  int64_t dropout_seed, int64_t dropout_offset) {
  const Problem P = check_varlen_inputs(q_in, k_in, v_in, cu_seqlens, max_seqlen, segment_lengths,
                                        dilation_rates, is_causal, softmax_scale);
  const da_dropout drop = dropout_params(dropout_p, dropout_seed, dropout_offset);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ", q_in.device());
  const std::vector<Sequence> seqs = varlen_sequences(cu_seqlens, P.N, max_seqlen);
  at::Tensor out = at::empty({P.N, P.Hq, P.D}, q_in.options());
  at::Tensor lse = at::empty({P.Hq, P.N}, q_in.options().dtype(lse_dtype(q_in.scalar_type(), float64_lse)));
  if (P.N == 0) return {out, lse};
  at::Tensor out4 = out.unsqueeze(0), lse3 = lse.unsqueeze(0);
  fwd_sequences(P, seqs, q_in.unsqueeze(0), k_in.unsqueeze(0), v_in.unsqueeze(0), out4, lse3, drop);
  return {out, lse};
}

}  // namespace cpu
}  // namespace dilated_attention
