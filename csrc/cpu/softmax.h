// The steps of a score tile between the products: the unit of the base-2 scores (score_unit), the
// causal mask (mask_future), the forward's online softmax (online_softmax), attention dropout
// (dropout_tile), and the backward's P and dS (lse_base2, ds_tile).
#pragma once

#include <stdint.h>

#include <cmath>

#include "../dilated_attention.h"
#include "../dropout.h"
#include "vec.h"

namespace dilated_attention {
namespace cpu {

/* softmax_scale / scale2: ln 2, up to the rounding of scale2 (ln 2 itself where scale2 is 0). */
template <typename T>
static double score_unit(double scale, T scale2) {
  return scale2 != 0 ? scale / (double)scale2 : 0.69314718055994530942;
}

/* Scores of key j against query lane i get -inf where key index kt0 + j > query index jq0 + i,
 * i.e. for lanes i < off + j with off = kt0 - jq0. */
template <typename T, int B>
DA_INLINE void mask_future(T* st, int64_t ld, int64_t nk, int64_t nv, int64_t off) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = Vec<T, B>::W;
  const V iota = X::iota(), ninf = X::set(neg_inf<T>());
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t thr = off + j;
    if (thr <= 0) continue;
    for (int64_t u = 0; u < nv && u * W < thr; ++u) {
      V s = X::load(st + j * ld + u * W);
      s = iota + (T)(u * W) < (T)thr ? ninf : s;
      X::store(st + j * ld + u * W, s);
    }
  }
}

/*
 * Online softmax over a (nk keys x lanes) score tile, queries in lanes: updates the running max
 * mt and denominator lt, replaces scores by 2^(score - max) and leaves in corr the factor the
 * previous accumulator must be multiplied by. Cost: 2 * nk * nv vector passes, nk * nv exps.
 */
template <typename T, int B>
DA_INLINE void online_softmax(T* st, const T* stlo, int64_t ld, int64_t nk, int64_t nv, T* mt, T* lt, T* corr,
                              const T* tmax) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = Vec<T, B>::W;
  const V ninf = X::set(neg_inf<T>()), zero = V{};
  for (int64_t u = 0; u < nv; ++u) {
    const V m_old = X::load(mt + u * W);
    V mx = m_old;
    if (tmax) {
      const V t = X::load(tmax + u * W);
      mx = t > mx ? t : mx;
    } else {
      for (int64_t j = 0; j < nk; ++j) {
        const V s = X::load(st + j * ld + u * W);
        mx = s > mx ? s : mx;  // ignores NaN, which then propagates through exp
      }
    }
    const V mu = mx == ninf ? zero : mx;  // a lane with only -inf scores: exp(-inf - 0) = 0
    const V c = X::exp2v(m_old - mu);
    V sum = zero;
    for (int64_t j = 0; j < nk; ++j) {
      V x = X::load(st + j * ld + u * W) - mu;  // exact where it matters (within a factor 2 of mu)
      if (stlo) x += X::load(stlo + j * ld + u * W);
      const V p = X::exp2v(x);
      X::store(st + j * ld + u * W, p);
      sum += p;
    }
    X::store(lt + u * W, X::load(lt + u * W) * c + sum);
    X::store(mt + u * W, mx);
    X::store(corr + u * W, c);
  }
}

/*
 * Attention dropout on a tile of weights: t[i * si + j * sj] *= (kept ? 1 / (1 - p) : 0) for query
 * rows q0 + i * qs (i < nq) and key rows x0 + j * xs (j < nk) of head bh (dropout.h). One Philox
 * call serves the four keys of a group x / 4 (all of them when xs = 1). Cost: nq * nk / 4 to
 * nq * nk Philox calls.
 */
template <typename T>
static void dropout_tile(const da_dropout& d, int64_t bh, T* t, int64_t si, int64_t sj, int64_t nq,
                         int64_t q0, int64_t qs, int64_t nk, int64_t x0, int64_t xs) {
  const T keep = sizeof(T) == 8 ? (T)d.scale64 : (T)d.scale;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t q = q0 + i * qs;
    uint32_t r[4];
    int64_t group = -1;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t x = x0 + j * xs;
      if (x >> 2 != group) {
        group = x >> 2;
        da_dropout_draws(&d, bh, q, group, r);
      }
      t[i * si + j * sj] *= r[x & 3] >= d.threshold ? keep : (T)0;
    }
  }
}

/*
 * A row's natural lse L (double) in base 2, L / unit, as hi + lo: hi rounded to T and lo the rest
 * (rounded to T), so that 2^((s2 - hi) - lo) is as accurate as with L / unit itself: s2 - hi is
 * exact for the scores that matter (within a factor 2 of hi) and lo is tiny. With hi alone, every
 * probability of the row would inherit the rounding of L / unit to T, up to half a unit in the last
 * place of |L / unit| (for logits of standard deviation 10, |L| ~ 40: ~60 times float32's epsilon,
 * relative), which plain PyTorch, differentiating its own softmax, never sees. -inf: (-inf, 0).
 */
template <typename T>
DA_INLINE void lse_base2(double L, double unit, T* hi, T* lo) {
  const double L2 = L / unit;
  *hi = (T)L2;
  *lo = std::isfinite(L2) ? (T)(L2 - (double)*hi) : (T)0;
}

/*
 * From base-2 scores s2 and dP (nq rows x ld key lanes): s <- P = 2^(s2 - lse2), dp <- dS = scale * P *
 * (dP - delta), with P = dS = 0 for key lanes past nk and, when causal, for keys after the query (key
 * kt0 + j > query qt0 + i, off = qt0 - kt0). s2 is bit for bit the forward's score (same scaled
 * queries, same order of summation), so the rounding of the score cancels against the lse the
 * forward computed from it, as it does in the forward's own normalisation. Cost: nq * ld exps.
 */
template <typename T, int B>
DA_INLINE void ds_tile(T* s, const T* slo, T* dp, int64_t ld, int64_t nq, int64_t nk, int causal, int64_t off,
                       const T* lse2, const T* lse2lo, const T* delta, T scale) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = Vec<T, B>::W;
  const V iota = X::iota(), zero = V{};
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t last = causal ? da_min64(nk - 1, off + i) : nk - 1;  // last key lane it sees
    const T l = lse2[i], lo = lse2lo[i], dl = delta[i];
    for (int64_t u = 0; u * W < ld; ++u) {
      T* sp = s + i * ld + u * W;
      T* dpp = dp + i * ld + u * W;
      // (s - hi) is exact for the scores that matter, and the low parts are tiny
      const V x = (X::load(sp) - l) + (slo ? X::load(slo + i * ld + u * W) - lo : X::set(-lo));
      V p = l == neg_inf<T>() ? zero : X::exp2v(x);
      if ((u + 1) * W - 1 > last) p = iota + (T)(u * W) > (T)last ? zero : p;
      X::store(sp, p);
      X::store(dpp, p * scale * (X::load(dpp) - dl));
    }
  }
}

}  // namespace cpu
}  // namespace dilated_attention
