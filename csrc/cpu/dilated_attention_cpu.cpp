// CPU implementation of dilated_attention::fwd and dilated_attention::bwd.
//
// Fused: no N x N matrix, no gathered copies of q/k/v, no per-branch outputs. Work is split over
// (batch, head, block of QB consecutive positions). A query block keeps one online-softmax state
// per query (running max m, denominator l, fp32/fp64 accumulator acc[D]) that every branch adds
// its keys to, so all branches of a query share one softmax (SPEC section 3).
//
// Inside a block, branch (w, r) and phase o = h % r select the covered queries of each segment;
// those queries share the segment's covered keys (an arithmetic progression read by strided
// addressing), which are visited in tiles of KB keys packed into small contiguous buffers.
//
// Cost: forward 2 * D multiply-adds per (query, key) pair with multiplicity; backward recomputes
// the scores twice (once for dq, once for dk/dv) for 5 * D multiply-adds per pair. Memory: the
// outputs plus O(threads * QB * D) scratch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <math.h>

#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../dilated_attention.h"

namespace dilated_attention {
namespace {

enum { QB = 64, KB = 64 };

// A (B, N, H, D) tensor with a contiguous last dimension, read through its strides.
template <typename T>
struct View {
  T* data;
  int64_t sb, sn, sh;
  T* at(int64_t b, int64_t n, int64_t h) const { return data + b * sb + n * sn + h * sh; }
};

template <typename T>
static View<T> view_of(const at::Tensor& t) {
  return View<T>{(T*)t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

template <typename acc_t>
static inline acc_t neg_inf() {
  return -INFINITY;
}

/* Copy one row of D values into acc_t, multiplied by s. */
template <typename scalar_t, typename acc_t>
static inline void load_row(acc_t* dst, const scalar_t* src, int64_t D, acc_t s) {
  for (int64_t d = 0; d < D; ++d) dst[d] = (acc_t)src[d] * s;
}

/* Copy one row of D values into column jj of a (D, ld) transposed tile, multiplied by s. */
template <typename scalar_t, typename acc_t>
static inline void load_col(acc_t* dst, int64_t ld, int64_t jj, const scalar_t* src, int64_t D,
                            acc_t s) {
  for (int64_t d = 0; d < D; ++d) dst[d * ld + jj] = (acc_t)src[d] * s;
}

/* out[j] = sum_d x[d] * tile[d * ld + j] for j in [j0, j1): one row against a transposed tile. */
template <typename acc_t>
static inline void row_times_tile(acc_t* out, const acc_t* x, const acc_t* tile, int64_t ld,
                                  int64_t D, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) out[j] = 0;
  for (int64_t d = 0; d < D; ++d) {
    const acc_t xd = x[d];
    const acc_t* t = tile + d * ld;
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) out[j] += xd * t[j];
  }
}

/* y[d] += sum_j c[j] * rows[j * D + d] for j in [j0, j1). */
template <typename acc_t>
static inline void axpy_rows(acc_t* y, const acc_t* c, const acc_t* rows, int64_t D, int64_t j0,
                             int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const acc_t cj = c[j];
    if (cj == 0) continue;
    const acc_t* row = rows + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] += cj * row[d];
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

template <typename acc_t>
struct FwdScratch {
  std::vector<acc_t> m, l, acc, qp, kt, vr, sc;
  explicit FwdScratch(int64_t D)
      : m(QB), l(QB), acc(QB * D), qp(QB * D), kt(D * KB), vr(KB * D), sc(KB) {}
};

/*
 * Online-softmax update of one query row with the scores sc[0..n) of keys whose values are the
 * rows of vr: m, l, acc hold the row's running max, denominator and unnormalised output.
 * NaN scores propagate into l and acc; -inf scores add nothing.
 */
template <typename acc_t>
static inline void softmax_update(acc_t* m, acc_t* l, acc_t* acc, acc_t* sc, const acc_t* vr,
                                  int64_t n, int64_t D) {
  acc_t mx = *m;
  for (int64_t j = 0; j < n; ++j) mx = sc[j] > mx ? sc[j] : mx;
  if (mx == neg_inf<acc_t>()) {  // every score is -inf or NaN: only NaN contributes
    for (int64_t j = 0; j < n; ++j) sc[j] = sc[j] != sc[j] ? sc[j] : 0;
  } else {
    const acc_t corr = *m == neg_inf<acc_t>() ? 0 : exp(*m - mx);
    if (corr != 1) {
      *l *= corr;
      for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
    }
    *m = mx;
    for (int64_t j = 0; j < n; ++j) sc[j] = exp(sc[j] - mx);
  }
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += sc[j];
  *l += sum;
  axpy_rows(acc, sc, vr, D, 0, n);
}

/* One (batch b, head h, block [a0, a1)) of the forward: out and lse for those positions. */
template <typename scalar_t, typename acc_t>
static void fwd_block(const Problem& P, View<const scalar_t> q, View<const scalar_t> k,
                      View<const scalar_t> v, View<scalar_t> out, acc_t* lse, int64_t b,
                      int64_t h, int64_t a0, int64_t a1, FwdScratch<acc_t>* s) {
  const int64_t D = P.D, hk = h / (P.Hq / P.Hkv);
  const acc_t scale = (acc_t)P.scale;
  for (int64_t i = 0; i < a1 - a0; ++i) {
    s->m[i] = neg_inf<acc_t>();
    s->l[i] = 0;
  }
  for (int64_t i = 0; i < (a1 - a0) * D; ++i) s->acc[i] = 0;

  for (int64_t bi = 0; bi < P.branches.n; ++bi) {
    const int64_t w = P.branches.w[bi], r = P.branches.r[bi], o = h % r;
    for (int64_t seg = da_first_segment(a0, w); seg <= da_last_segment(a1, w); ++seg) {
      da_group g;
      da_group_at(seg, a0, a1, P.N, w, r, o, &g);
      if (g.count == 0) continue;
      for (int64_t qi = 0; qi < g.count; ++qi)
        load_row(&s->qp[qi * D], q.at(b, g.first + qi * r, h), D, scale);
      const int64_t nk_total =
          P.is_causal ? da_min64(g.seg_count, g.j0 + g.count) : g.seg_count;
      for (int64_t kt0 = 0; kt0 < nk_total; kt0 += KB) {
        const int64_t nk = da_min64(KB, nk_total - kt0);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const int64_t x = g.seg_first + (kt0 + jj) * r;
          load_col(s->kt.data(), KB, jj, k.at(b, x, hk), D, (acc_t)1);
          load_row(&s->vr[jj * D], v.at(b, x, hk), D, (acc_t)1);
        }
        for (int64_t qi = 0; qi < g.count; ++qi) {
          const int64_t jq = g.j0 + qi;
          const int64_t lim = P.is_causal ? da_min64(nk, jq + 1 - kt0) : nk;
          if (lim <= 0) continue;
          const int64_t row = g.first + qi * r - a0;
          row_times_tile(s->sc.data(), &s->qp[qi * D], s->kt.data(), KB, D, 0, lim);
          softmax_update(&s->m[row], &s->l[row], &s->acc[row * D], s->sc.data(), s->vr.data(),
                         lim, D);
        }
      }
    }
  }

  for (int64_t p = a0; p < a1; ++p) {
    const int64_t row = p - a0;
    const acc_t l = s->l[row];
    scalar_t* o = out.at(b, p, h);
    if (l == 0) {  // covered by no branch
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)0;
      lse[p] = neg_inf<acc_t>();
    } else {
      const acc_t inv = (acc_t)1 / l;
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(s->acc[row * D + d] * inv);
      lse[p] = s->m[row] + log(l);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                           at::IntArrayRef dilation_rates, bool is_causal,
                                           double softmax_scale) {
  const Problem P =
      check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ",
              q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty({P.B, P.N, P.Hq, P.D}, q.options());
  at::Tensor lse = at::empty({P.B, P.Hq, P.N}, q.options().dtype(lse_dtype(q.scalar_type())));
  if (P.B == 0 || P.N == 0) return {out, lse};
  const int64_t nblocks = da_ceil_div(P.N, QB);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dilated_attention_fwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const auto qv = view_of<const scalar_t>(q), kv = view_of<const scalar_t>(k),
               vv = view_of<const scalar_t>(v);
    const auto ov = view_of<scalar_t>(out);
    acc_t* lse_p = lse.data_ptr<acc_t>();
    at::parallel_for(0, P.B * P.Hq * nblocks, 1, [&](int64_t begin, int64_t end) {
      FwdScratch<acc_t> s(P.D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t blk = task % nblocks, bh = task / nblocks;
        const int64_t h = bh % P.Hq, b = bh / P.Hq;
        const int64_t a0 = blk * QB, a1 = da_min64(a0 + QB, P.N);
        fwd_block<scalar_t, acc_t>(P, qv, kv, vv, ov, lse_p + bh * P.N, b, h, a0, a1, &s);
      }
    });
  });
  return {out, lse};
}

/* ------------------------------------------------------------------------------------------ */
/* Backward                                                                                     */
/*   P = exp(s - lse), dP = dout . v, dS = P * (dP - delta), delta = rowsum(dout * out) - dlse  */
/*   dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dout                                   */
/* ------------------------------------------------------------------------------------------ */

/* delta[b, h, p] = sum_d dout * out - dlse, one value per query row. */
template <typename scalar_t, typename acc_t>
static void compute_delta(const Problem& P, View<const scalar_t> dout, View<const scalar_t> out,
                          const acc_t* dlse, acc_t* delta) {
  at::parallel_for(0, P.B * P.Hq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / P.Hq, h = bh % P.Hq;
      for (int64_t p = 0; p < P.N; ++p) {
        const scalar_t* x = dout.at(b, p, h);
        const scalar_t* y = out.at(b, p, h);
        acc_t sum = 0;
        for (int64_t d = 0; d < P.D; ++d) sum += (acc_t)x[d] * (acc_t)y[d];
        delta[bh * P.N + p] = sum - (dlse ? dlse[bh * P.N + p] : (acc_t)0);
      }
    }
  });
}

/* dS for one query row against n keys: sc holds scores in, dS out; dp holds dout . v. */
template <typename acc_t>
static inline void row_ds(acc_t* sc, const acc_t* dp, acc_t lse, acc_t delta, int64_t j0,
                          int64_t j1, acc_t* p_out) {
  for (int64_t j = j0; j < j1; ++j) {
    const acc_t p = lse == neg_inf<acc_t>() ? 0 : exp(sc[j] - lse);
    if (p_out) p_out[j] = p;
    sc[j] = p * (dp[j] - delta);
  }
}

template <typename acc_t>
struct DqScratch {
  std::vector<acc_t> qp, dop, dq, kt, vt, kr, sc, dp;
  explicit DqScratch(int64_t D)
      : qp(QB * D), dop(QB * D), dq(QB * D), kt(D * KB), vt(D * KB), kr(KB * D), sc(KB), dp(KB) {}
};

/* dq for one (batch b, head h, block [a0, a1)). */
template <typename scalar_t, typename acc_t>
static void dq_block(const Problem& P, View<const scalar_t> q, View<const scalar_t> k,
                     View<const scalar_t> v, View<const scalar_t> dout, const acc_t* lse,
                     const acc_t* delta, View<scalar_t> dq, int64_t b, int64_t h, int64_t a0,
                     int64_t a1, DqScratch<acc_t>* s) {
  const int64_t D = P.D, hk = h / (P.Hq / P.Hkv);
  const acc_t scale = (acc_t)P.scale;
  for (int64_t i = 0; i < (a1 - a0) * D; ++i) s->dq[i] = 0;

  for (int64_t bi = 0; bi < P.branches.n; ++bi) {
    const int64_t w = P.branches.w[bi], r = P.branches.r[bi], o = h % r;
    for (int64_t seg = da_first_segment(a0, w); seg <= da_last_segment(a1, w); ++seg) {
      da_group g;
      da_group_at(seg, a0, a1, P.N, w, r, o, &g);
      if (g.count == 0) continue;
      for (int64_t qi = 0; qi < g.count; ++qi) {
        const int64_t p = g.first + qi * r;
        load_row(&s->qp[qi * D], q.at(b, p, h), D, scale);
        load_row(&s->dop[qi * D], dout.at(b, p, h), D, (acc_t)1);
      }
      const int64_t nk_total =
          P.is_causal ? da_min64(g.seg_count, g.j0 + g.count) : g.seg_count;
      for (int64_t kt0 = 0; kt0 < nk_total; kt0 += KB) {
        const int64_t nk = da_min64(KB, nk_total - kt0);
        for (int64_t jj = 0; jj < nk; ++jj) {
          const int64_t x = g.seg_first + (kt0 + jj) * r;
          load_col(s->kt.data(), KB, jj, k.at(b, x, hk), D, (acc_t)1);
          load_row(&s->kr[jj * D], k.at(b, x, hk), D, (acc_t)1);
          load_col(s->vt.data(), KB, jj, v.at(b, x, hk), D, (acc_t)1);
        }
        for (int64_t qi = 0; qi < g.count; ++qi) {
          const int64_t jq = g.j0 + qi;
          const int64_t lim = P.is_causal ? da_min64(nk, jq + 1 - kt0) : nk;
          if (lim <= 0) continue;
          const int64_t p = g.first + qi * r, row = p - a0;
          row_times_tile(s->sc.data(), &s->qp[qi * D], s->kt.data(), KB, D, 0, lim);
          row_times_tile(s->dp.data(), &s->dop[qi * D], s->vt.data(), KB, D, 0, lim);
          row_ds(s->sc.data(), s->dp.data(), lse[p], delta[p], 0, lim, (acc_t*)nullptr);
          axpy_rows(&s->dq[row * D], s->sc.data(), s->kr.data(), D, 0, lim);
        }
      }
    }
  }
  for (int64_t p = a0; p < a1; ++p) {
    scalar_t* o = dq.at(b, p, h);
    for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(s->dq[(p - a0) * D + d] * scale);
  }
}

template <typename acc_t>
struct DkvScratch {
  std::vector<acc_t> dk, dv, kp, vp, qt, qr, dot, dor, lse, delta, sc, dp, pr;
  explicit DkvScratch(int64_t D)
      : dk(QB * D), dv(QB * D), kp(QB * D), vp(QB * D), qt(D * KB), qr(KB * D), dot(D * KB),
        dor(KB * D), lse(KB), delta(KB), sc(KB), dp(KB), pr(KB) {}
};

/* dk and dv for one (batch b, key/value head hk, block [x0, x1) of key positions). */
template <typename scalar_t, typename acc_t>
static void dkv_block(const Problem& P, View<const scalar_t> q, View<const scalar_t> k,
                      View<const scalar_t> v, View<const scalar_t> dout, const acc_t* lse,
                      const acc_t* delta, View<scalar_t> dk, View<scalar_t> dv, int64_t b,
                      int64_t hk, int64_t x0, int64_t x1, DkvScratch<acc_t>* s) {
  const int64_t D = P.D, G = P.Hq / P.Hkv;
  const acc_t scale = (acc_t)P.scale;
  for (int64_t i = 0; i < (x1 - x0) * D; ++i) s->dk[i] = s->dv[i] = 0;

  for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
    const acc_t* lse_h = lse + (b * P.Hq + h) * P.N;
    const acc_t* delta_h = delta + (b * P.Hq + h) * P.N;
    for (int64_t bi = 0; bi < P.branches.n; ++bi) {
      const int64_t w = P.branches.w[bi], r = P.branches.r[bi], o = h % r;
      for (int64_t seg = da_first_segment(x0, w); seg <= da_last_segment(x1, w); ++seg) {
        da_group g;
        da_group_at(seg, x0, x1, P.N, w, r, o, &g);
        if (g.count == 0) continue;
        for (int64_t kk = 0; kk < g.count; ++kk) {
          const int64_t x = g.first + kk * r;
          load_row(&s->kp[kk * D], k.at(b, x, hk), D, (acc_t)1);
          load_row(&s->vp[kk * D], v.at(b, x, hk), D, (acc_t)1);
        }
        for (int64_t qt0 = da_first_query_for_key(g.j0, P.is_causal); qt0 < g.seg_count;
             qt0 += KB) {
          const int64_t nq = da_min64(KB, g.seg_count - qt0);
          for (int64_t jj = 0; jj < nq; ++jj) {
            const int64_t p = g.seg_first + (qt0 + jj) * r;
            load_col(s->qt.data(), KB, jj, q.at(b, p, h), D, scale);
            load_row(&s->qr[jj * D], q.at(b, p, h), D, scale);
            load_col(s->dot.data(), KB, jj, dout.at(b, p, h), D, (acc_t)1);
            load_row(&s->dor[jj * D], dout.at(b, p, h), D, (acc_t)1);
            s->lse[jj] = lse_h[p];
            s->delta[jj] = delta_h[p];
          }
          for (int64_t kk = 0; kk < g.count; ++kk) {
            const int64_t jk = g.j0 + kk;
            const int64_t start =
                P.is_causal ? da_max64(0, da_first_query_for_key(jk, 1) - qt0) : 0;
            if (start >= nq) continue;
            const int64_t row = g.first + kk * r - x0;
            row_times_tile(s->sc.data(), &s->kp[kk * D], s->qt.data(), KB, D, start, nq);
            row_times_tile(s->dp.data(), &s->vp[kk * D], s->dot.data(), KB, D, start, nq);
            for (int64_t jj = start; jj < nq; ++jj) {
              const acc_t p = s->lse[jj] == neg_inf<acc_t>() ? 0 : exp(s->sc[jj] - s->lse[jj]);
              s->pr[jj] = p;
              s->sc[jj] = p * (s->dp[jj] - s->delta[jj]);
            }
            axpy_rows(&s->dv[row * D], s->pr.data(), s->dor.data(), D, start, nq);
            axpy_rows(&s->dk[row * D], s->sc.data(), s->qr.data(), D, start, nq);
          }
        }
      }
    }
  }
  for (int64_t x = x0; x < x1; ++x) {
    scalar_t* a = dk.at(b, x, hk);
    scalar_t* c = dv.at(b, x, hk);
    for (int64_t d = 0; d < D; ++d) {
      a[d] = (scalar_t)s->dk[(x - x0) * D + d];
      c[d] = (scalar_t)s->dv[(x - x0) * D + d];
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const c10::optional<at::Tensor>& dlse_in, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale, bool deterministic) {
  (void)deterministic;  // the CPU backward is always deterministic
  const Problem P =
      check_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  check_backward_inputs(P, q_in, dout_in, out_in, lse_in, dlse_in);
  TORCH_CHECK(q_in.device().is_cpu(), "dilated_attention: expected CPU tensors, got ",
              q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in), dout = last_dim_contiguous(dout_in),
                   out = last_dim_contiguous(out_in);
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined())
    dlse = dlse_in->to(lse.scalar_type()).contiguous();
  at::Tensor dq = at::empty({P.B, P.N, P.Hq, P.D}, q.options());
  at::Tensor dk = at::empty({P.B, P.N, P.Hkv, P.D}, q.options());
  at::Tensor dv = at::empty({P.B, P.N, P.Hkv, P.D}, q.options());
  if (P.B == 0 || P.N == 0) return {dq, dk, dv};
  at::Tensor delta = at::empty_like(lse);
  const int64_t nblocks = da_ceil_div(P.N, QB);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "dilated_attention_bwd",
                                  [&] {
    using acc_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const auto qv = view_of<const scalar_t>(q), kv = view_of<const scalar_t>(k),
               vv = view_of<const scalar_t>(v), dov = view_of<const scalar_t>(dout),
               outv = view_of<const scalar_t>(out);
    const auto dqv = view_of<scalar_t>(dq), dkv = view_of<scalar_t>(dk),
               dvv = view_of<scalar_t>(dv);
    const acc_t* lse_p = lse.data_ptr<acc_t>();
    acc_t* delta_p = delta.data_ptr<acc_t>();
    compute_delta<scalar_t, acc_t>(P, dov, outv, dlse.defined() ? dlse.data_ptr<acc_t>() : nullptr,
                                   delta_p);
    at::parallel_for(0, P.B * P.Hq * nblocks, 1, [&](int64_t begin, int64_t end) {
      DqScratch<acc_t> s(P.D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t blk = task % nblocks, bh = task / nblocks;
        const int64_t h = bh % P.Hq, b = bh / P.Hq;
        const int64_t a0 = blk * QB, a1 = da_min64(a0 + QB, P.N);
        dq_block<scalar_t, acc_t>(P, qv, kv, vv, dov, lse_p + bh * P.N, delta_p + bh * P.N, dqv,
                                  b, h, a0, a1, &s);
      }
    });
    at::parallel_for(0, P.B * P.Hkv * nblocks, 1, [&](int64_t begin, int64_t end) {
      DkvScratch<acc_t> s(P.D);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t blk = task % nblocks, bh = task / nblocks;
        const int64_t hk = bh % P.Hkv, b = bh / P.Hkv;
        const int64_t x0 = blk * QB, x1 = da_min64(x0 + QB, P.N);
        dkv_block<scalar_t, acc_t>(P, qv, kv, vv, dov, lse_p, delta_p, dkv, dvv, b, hk, x0, x1,
                                   &s);
      }
    });
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

}  // namespace dilated_attention
