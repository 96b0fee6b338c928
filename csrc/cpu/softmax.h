// The steps of a score tile between the products: the unit of the base-2 scores (score_unit), the
// causal mask (mask_future), the forward's online softmax (online_softmax, with the reference of
// its exponents at large scores: pair_ge, pair_ref_lo), attention dropout (dropout_tile), and the
// backward's P and dS (lse_base2, lse_slack, snap_exponent, ds_tile).
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
 * The reference of a row's exponents, for scores of float rows held as pairs hi + lo (microgemm.h).
 * The forward takes 2^(s - m) as 2^((hi - m) + (lo - mlo)) against a reference pair (m, mlo); every
 * exponent must stay <= 0 up to rounding, or the weights leave [0, 1]: with mlo = 0 and m the largest
 * hi, the largest score's exponent is its own lo, up to half a unit in the last place of m, which
 * reaches 128 at |m| = 2^31 (2^31 / log2(e) ~ 1.5e9 natural units, and softmax_scale goes up to
 * ~1.7e38): exp2v clamps there (the weights lose their ratios) and sums of 2^127 overflow (inf lse,
 * wrong out). So where the row's largest hi reaches PAIR_FROM, the reference is the row's largest
 * pair, lexicographically (rounding is monotone: a larger hi is a larger score, equal his are ordered
 * by lo), and every exponent is <= 0 up to the rounding of (hi - m) + (lo - mlo); below PAIR_FROM,
 * mlo = 0 as before, an excess of at most half a unit in the last place of m, 2^-13, and the common
 * path unchanged bit for bit (one vector test per tile column). Float64 rows have no lo: mlo = 0.
 */
enum { PAIR_FROM = 1 << 12 };

/* Whether pair (a, alo) is at least pair (b, blo) (pairs of the same rounding: hi first, then lo). */
template <typename T>
DA_INLINE bool pair_ge(T a, T alo, T b, T blo) {
  return a > b || (a == b && alo >= blo);
}

/*
 * mlo of the reference pair (mu, mlo) of the lanes of tile column u (st, stlo: nk keys at stride
 * ld), mu the lanes' largest hi over the previous pair (m_old, mlo_old) and the tile: the largest lo
 * among the tile's scores whose hi is mu and the previous pair's where m_old is mu, in lanes with
 * |mu| >= PAIR_FROM; 0 elsewhere (and in every lane when none reaches PAIR_FROM: no pass).
 */
template <typename T, int B>
DA_INLINE typename Vec<T, B>::v pair_ref_lo(const T* st, const T* stlo, int64_t ld, int64_t nk, int64_t u,
                                            typename Vec<T, B>::v mu, typename Vec<T, B>::v m_old,
                                            typename Vec<T, B>::v mlo_old) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = X::W;
  const V zero = V{}, ninf = X::set(neg_inf<T>()), from = X::set((T)PAIR_FROM);
  const auto big = (mu >= from) | (mu <= -from);
  bool any = false;
  for (int i = 0; i < W; ++i) any |= big[i] != 0;
  if (!any) return zero;
  V lo = m_old == mu ? mlo_old : ninf;
  for (int64_t j = 0; j < nk; ++j) {
    const V s = X::load(st + j * ld + u * W), sl = X::load(stlo + j * ld + u * W);
    lo = (s == mu) & (sl > lo) ? sl : lo;
  }
  return big & (lo != ninf) ? lo : zero;
}

/*
 * Online softmax over a (nk keys x lanes) score tile, queries in lanes: updates the running
 * reference pair (mt, mtlo: the max, pair_ref_lo) and the denominator lt, replaces scores by
 * 2^(score - reference) and leaves in corr the factor the previous accumulator must be multiplied
 * by. stlo null (float64 rows): scores without low parts, mtlo left alone (0). Cost: 2 * nk * nv
 * vector passes, nk * nv exps (a third pass in tile columns with a score of magnitude PAIR_FROM).
 */
template <typename T, int B>
DA_INLINE void online_softmax(T* st, const T* stlo, int64_t ld, int64_t nk, int64_t nv, T* mt, T* mtlo, T* lt,
                              T* corr, const T* tmax) {
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
    if (stlo) {
      const V mlo_old = X::load(mtlo + u * W);
      const V mulo = pair_ref_lo<T, B>(st, stlo, ld, nk, u, mu, m_old, mlo_old);
      const V c = X::exp2v((m_old - mu) + (mlo_old - mulo));
      V sum = zero;
      for (int64_t j = 0; j < nk; ++j) {
        // hi - mu is exact where it matters (within a factor 2 of mu), and the low parts are tiny
        const V x = (X::load(st + j * ld + u * W) - mu) + (X::load(stlo + j * ld + u * W) - mulo);
        const V p = X::exp2v(x);
        X::store(st + j * ld + u * W, p);
        sum += p;
      }
      X::store(lt + u * W, X::load(lt + u * W) * c + sum);
      X::store(mtlo + u * W, mulo);
      X::store(corr + u * W, c);
    } else {
      const V c = X::exp2v(m_old - mu);
      V sum = zero;
      for (int64_t j = 0; j < nk; ++j) {
        const V p = X::exp2v(X::load(st + j * ld + u * W) - mu);
        X::store(st + j * ld + u * W, p);
        sum += p;
      }
      X::store(lt + u * W, X::load(lt + u * W) * c + sum);
      X::store(corr + u * W, c);
    }
    X::store(mt + u * W, mx);
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
 * How far from its true value the exponent of a row's largest score may come out in the backward
 * (ds_tile), in base 2, for a row whose lse is the forward's, and 0 where the row is not large. The
 * scores are the forward's bit for bit; the error is L's rounding to double, which the forward
 * computes from its reference pair with one rounding (lse_natural) and the backward reads back
 * beyond double (lse_base2): about 2^-52 |L / unit|. The slack is four times that, |hi| * 2^-50, in
 * rows with |hi| >= 2^22, where the rounding of lo (float rows) would reach the rounding of P, and
 * which lse_base2 and lse_natural compute beyond double. Float64 rows take the same bound: below it
 * rounding their exponents to the slack would cost more than L's own rounding (a key of weight
 * 1 - e with e under the slack would get 1: dv off by 3e-10 at scores of 1e5), above it no double
 * lse gives their P to float64's rule either way, and the rounding makes the usual rows, whose
 * weight sits on their largest scores, exact. 0 in the others (the common path, unchanged). At scores ~1e12
 * (|hi| ~ 2^42) the slack is 2^-8: L's rounding alone would put 2^-9 into P, where plain PyTorch,
 * whose softmax normalises its own weights, errs by float's rounding (snap_exponent).
 */
template <typename T>
DA_INLINE T lse_slack(T hi) {
  const T a = std::fabs(hi);
  return a >= (T)0x1p22 ? a * (T)0x1p-50 : (T)0;
}

/*
 * The exponents x of a large row (slack > 0, lse_slack), rounded to what the row's lse can tell. At
 * such magnitudes a row's weight sits on its largest score: l, the row's denominator over it, is a
 * whole number c (the keys at that score, times the branches that read each) plus what the other
 * keys weigh, nearly always far below the slack, and the exponent of each key at the largest score
 * is -log2(c). An exponent within the slack of 0 becomes 0, else one within the slack of -log2(c)
 * for a whole c from 2 to about 2^8 (c the nearest to 2^-x) becomes -log2(c): P = 1 / c, as plain
 * PyTorch's softmax gives it, where L's rounding would put up to the slack into P. Any other
 * exponent stays. An exponent moves by at most the slack, so its error stays within twice the slack
 * in any row, and no exponent exceeds the slack: P <= 1 at any magnitude. From |hi| = 2^50 (scores ~8e14) the slack
 * reaches 1 = log2(2), and past 2^53 a double lse cannot hold ln(l) at all: it cannot tell a row
 * whose weight sits on one key (c = 1) from one where that key is read through two branches, or two
 * keys tie (c = 2); there the exponents near 0 become 0, and rows of c >= 2 get P = 1 per key and
 * branch. Cost: a vector select, and a scalar step for the lanes within 8 + slack below 0 (the
 * row's largest scores).
 */
template <typename T, int B>
DA_INLINE typename Vec<T, B>::v snap_exponent(typename Vec<T, B>::v x, T slack) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = X::W;
  const V lo = X::set(-slack);
  V y = (x >= lo) & (x <= X::set(slack)) ? V{} : x;
  const auto near = (y < lo) & (y >= X::set((T)-8 - slack));
  bool any = false;
  for (int i = 0; i < W; ++i) any |= near[i] != 0;
  if (any)
    for (int i = 0; i < W; ++i) {
      if (!near[i]) continue;
      const T c = std::nearbyint(std::exp2(-y[i])), t = -std::log2(c);
      if (c >= 2 && std::fabs(y[i] - t) <= slack) y[i] = t;
    }
  return y;
}

/*
 * A row's natural lse L (double) in base 2, L / unit, as hi + lo: hi rounded to T and lo the rest
 * (rounded to T), so that 2^((s2 - hi) - lo) is as accurate as with L / unit itself: s2 - hi is
 * exact for the scores that matter (within a factor 2 of hi) and lo is tiny. With hi alone, every
 * probability of the row would inherit the rounding of L / unit to T, up to half a unit in the last
 * place of |L / unit| (for logits of standard deviation 10, |L| ~ 40: ~60 times float32's epsilon,
 * relative), which plain PyTorch, differentiating its own softmax, never sees. -inf: (-inf, 0, 0).
 * Rows that lse_slack calls large (|hi| >= 2^22 for float rows) take L / unit beyond double (the
 * division's remainder, by fma) and keep what lo leaves in lo2, for ds_tile: there lo alone would
 * round the exponent to 2^-48 |hi| (2^-18 at scores ~1e9, where a row's largest key read through
 * three branches has exponent -log2(3)); lo2 is 0 elsewhere.
 */
template <typename T>
DA_INLINE void lse_base2(double L, double unit, T* hi, T* lo, T* lo2) {
  const double L2 = L / unit;
  *hi = (T)L2;
  *lo2 = 0;
  if (!std::isfinite(L2)) {
    *lo = 0;
    return;
  }
  double r = L2 - (double)*hi;  // exact: hi is L2 rounded (to float; or L2 itself)
  if (lse_slack(*hi) == 0) {
    *lo = (T)r;
    return;
  }
  r += std::fma(-L2, unit, L) / unit;  // L - L2 unit exactly, over unit
  *lo = (T)r;
  *lo2 = (T)(r - (double)*lo);
}

/* The natural lse (m + mlo) unit + ln(l) of a row's reference pair (m, mlo) and denominator l (> 0),
 * in double: with one rounding (fma) in the rows that lse_slack calls large, whose exponents the
 * backward recovers from it (lse_base2). */
template <typename T>
DA_INLINE double lse_natural(T m, T mlo, double unit, double l) {
  const double mm = (double)m + (double)mlo;
  return lse_slack(m) == 0 ? mm * unit + ::log(l) : std::fma(mm, unit, ::log(l));
}

/*
 * From base-2 scores s2 and dP (nq rows x ld key lanes): s <- P = 2^(s2 - lse2), dp <- dS = scale * P *
 * (dP - delta), with P = dS = 0 for key lanes past nk and, when causal, for keys after the query (key
 * kt0 + j > query qt0 + i, off = qt0 - kt0). s2 is bit for bit the forward's score (same scaled
 * queries, same order of summation), so the rounding of the score cancels against the lse the
 * forward computed from it, as it does in the forward's own normalisation; in a large row
 * (lse_slack) the exponents are rounded to what its lse can tell (snap_exponent). Cost: nq * ld exps.
 */
template <typename T, int B>
DA_INLINE void ds_tile(T* s, const T* slo, T* dp, int64_t ld, int64_t nq, int64_t nk, int causal, int64_t off,
                       const T* lse2, const T* lse2lo, const T* lse2lo2, const T* delta, T scale) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = Vec<T, B>::W;
  const V iota = X::iota(), zero = V{};
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t last = causal ? da_min64(nk - 1, off + i) : nk - 1;  // last key lane it sees
    const T l = lse2[i], lo = lse2lo[i], lo2 = lse2lo2[i], dl = delta[i], slack = lse_slack(l);
    for (int64_t u = 0; u * W < ld; ++u) {
      T* sp = s + i * ld + u * W;
      T* dpp = dp + i * ld + u * W;
      // (s - hi) is exact for the scores that matter, and the low parts are tiny
      V x = (X::load(sp) - l) + (slo ? X::load(slo + i * ld + u * W) - lo : X::set(-lo));
      if (slack != 0) x = snap_exponent<T, B>(x - lo2, slack);  // a large row: lse_base2's lo2
      V p = l == neg_inf<T>() ? zero : X::exp2v(x);
      if ((u + 1) * W - 1 > last) p = iota + (T)(u * W) > (T)last ? zero : p;
      X::store(sp, p);
      X::store(dpp, p * scale * (X::load(dpp) - dl));
    }
  }
}

}  // namespace cpu
}  // namespace dilated_attention
