// The micro-kernel: every product of the kernels (gemm, in register blocks of MR x NV vectors), the
// scores of float rows summed in double (gemm_scores), the P V of the backward's float32
// recomputation in double (gemm_wide_acc), and the tile copies around them (pack_transposed,
// widen_operand, widen_rows, add_rows). All of it is always inlined into the kernels' per-ISA
// entry points.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace dilated_attention {
namespace cpu {

/*
 * C[i][0 : R*W] (+)= alpha * sum_{k < K} A[i * as + k * ak] * B[k * ldb + 0 : R*W]  for i < M
 * (alpha != 1 only without accumulate); with Sub, B[k * ldb + j] - O[i * as + k * ak] in place of
 * B[k * ldb + j] (O laid out as A). A register block of M x R vectors: per k, R vector loads of B's
 * row k and M broadcasts of A (and of O). Cost: M * R * K vector multiply-adds (and as many
 * subtractions with Sub).
 */
template <typename T, int B, int M, int R, bool Sub>
DA_INLINE void micro(T* C, int64_t ldc, const T* A, int64_t as, int64_t ak, const T* Bm, int64_t ldb,
                     int64_t K, bool accumulate, T* cmax, T alpha, const T* O) {
  typedef Vec<T, B> X;
  typedef typename X::v V;
  const int W = X::W;
  V c[M][R];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) c[i][j] = accumulate ? X::load(C + i * ldc + j * W) : V{};
  for (int64_t k = 0; k < K; ++k) {
    V b[R];
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) b[j] = X::load(Bm + k * ldb + j * W);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const T a = A[i * as + k * ak];  // scalar * vector: one broadcast from memory
      if constexpr (Sub) {
        const T o = O[i * as + k * ak];
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) c[i][j] += a * (b[j] - o);
      } else {
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) c[i][j] += a * b[j];
      }
    }
  }
  if (alpha != 1)
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) c[i][j] *= alpha;
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) X::store(C + i * ldc + j * W, c[i][j]);
  if (cmax) {  // running column max over the rows (NaN ignored)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      V mx = X::load(cmax + j * W);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) mx = c[i][j] > mx ? c[i][j] : mx;
      X::store(cmax + j * W, mx);
    }
  }
}

template <typename T, int B, int R, bool Sub>
DA_INLINE void gemm_rows(T* C, int64_t ldc, const T* A, int64_t as, int64_t ak, const T* Bm, int64_t ldb,
                         int64_t m, int64_t K, bool accumulate, T* cmax, T alpha, const T* O) {
  const int MR = Vec<T, B>::MR;
  int64_t i = 0;
  for (; i + MR <= m; i += MR)
    micro<T, B, MR, R, Sub>(C + i * ldc, ldc, A + i * as, as, ak, Bm, ldb, K, accumulate, cmax, alpha,
                            Sub ? O + i * as : O);
  for (; i < m; ++i)
    micro<T, B, 1, R, Sub>(C + i * ldc, ldc, A + i * as, as, ak, Bm, ldb, K, accumulate, cmax, alpha,
                           Sub ? O + i * as : O);
}

/*
 * C (m x nv*W) (+)= A (m x K) * B (K x nv*W): rows of C at stride ldc, A[i][k] = A[i*as + k*ak],
 * rows of B at stride ldb; without accumulate, the products are multiplied by alpha once summed
 * (the scores: softmax_scale * log2(e) times the rounded dot product, as plain PyTorch scales its
 * scores, rather than a dot product of scaled queries, whose roundings cost up to 4x the gradient
 * error at large logits). With Sub, C = A (B - O): row i of A times B's columns less row i of O
 * (O laid out as A; see micro). Every product of the kernels is one of these, in column panels of
 * NV vectors. Cost: m * K * nv * W multiply-adds.
 */
template <typename T, int B, bool Sub = false>
DA_INLINE void gemm(T* C, int64_t ldc, const T* A, int64_t as, int64_t ak, const T* Bm, int64_t ldb,
                    int64_t m, int64_t nv, int64_t K, bool accumulate, T* cmax = nullptr, T alpha = 1,
                    const T* O = nullptr) {
  typedef Vec<T, B> X;
  const int W = X::W, NV = X::NV;
  for (int64_t v0 = 0; v0 < nv; v0 += NV) {
    T* c = C + v0 * W;
    const T* bb = Bm + v0 * W;
    T* cm = cmax ? cmax + v0 * W : nullptr;
    switch (std::min<int64_t>(NV, nv - v0)) {
      case 1: gemm_rows<T, B, 1, Sub>(c, ldc, A, as, ak, bb, ldb, m, K, accumulate, cm, alpha, O); break;
      case 2:
        gemm_rows<T, B, (NV >= 2 ? 2 : 1), Sub>(c, ldc, A, as, ak, bb, ldb, m, K, accumulate, cm, alpha, O);
        break;
      case 3:
        gemm_rows<T, B, (NV >= 3 ? 3 : 1), Sub>(c, ldc, A, as, ak, bb, ldb, m, K, accumulate, cm, alpha, O);
        break;
      default: gemm_rows<T, B, NV, Sub>(c, ldc, A, as, ak, bb, ldb, m, K, accumulate, cm, alpha, O); break;
    }
  }
}

/* A vector register of doubles (d), and the floats of half a float vector that convert into it
 * (v; vu for unaligned loads and stores). */
template <int B>
struct HalfVec {
  typedef double d __attribute__((vector_size(B)));
  typedef double du __attribute__((vector_size(B), aligned(8), may_alias));
  typedef float v __attribute__((vector_size(B / 2)));
  typedef float vu __attribute__((vector_size(B / 2), aligned(4), may_alias));
};

/*
 * The scores of float rows: C (m x R*W) = alpha * A (m x K) * B (K x R*W), every product and sum in
 * double, times alpha in double, rounded to float in C and the rest, rounded to float, in Clo (0
 * for an infinite or NaN score; cmax: the running column max of C, as in micro). The kernels take
 * a score as C + Clo (about 48 bits): 2^(s - m) is computed as 2^((C - m) + Clo), where C - m is
 * exact for the scores that matter. A float sum of the D products of a score rounds D times, and a
 * score rounded to float once still errs by half a unit in its last place, several float32
 * epsilons of |s| (logits of tens): at large logits that error, through the exps, was the largest
 * part of the gradients' error, and of plain PyTorch's, which rounds its scores in its own order.
 * Two implementations of the same rounding quality then differ by more than 2x in a few percent
 * of random cases (logit standard deviations 32-64), past the 2x of SPEC section 4; with the
 * scores' error gone, the kernels' is a small part of plain PyTorch's. Forward and backward sum in
 * the same order, so the backward recomputes the forward's scores bit for bit.
 */
template <int B, int M, int R, bool Wide>
DA_INLINE void micro_scores(float* C, float* Clo, int64_t ldc, const float* A, int64_t as, int64_t ak,
                            const float* Bm, const double* Bw, int64_t ldb, int64_t K, float* cmax,
                            float alpha) {
  typedef Vec<float, B> X;
  typedef typename X::v V;
  typedef typename HalfVec<B>::d VD;
  typedef typename HalfVec<B>::du VDu;
  typedef typename HalfVec<B>::v VH;
  typedef typename HalfVec<B>::vu VHu;
  const int W = X::W, H = W / 2;
  VD c[M][R][2];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) c[i][j][0] = c[i][j][1] = VD{};
  for (int64_t k = 0; k < K; ++k) {
    VD b[R][2];
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      if constexpr (Wide) {  // B already in double (widen_operand)
        b[j][0] = *(const VDu*)(Bw + k * ldb + j * W);
        b[j][1] = *(const VDu*)(Bw + k * ldb + j * W + H);
      } else {
        const VH lo = *(const VHu*)(Bm + k * ldb + j * W), hi = *(const VHu*)(Bm + k * ldb + j * W + H);
        b[j][0] = __builtin_convertvector(lo, VD);
        b[j][1] = __builtin_convertvector(hi, VD);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const double a = A[i * as + k * ak];
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) {
        c[i][j][0] += a * b[j][0];
        c[i][j][1] += a * b[j][1];
      }
    }
  }
  const double al = alpha;
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j)
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {
        const VD x = c[i][j][e] * al;
        const VH hi = __builtin_convertvector(x, VH);
        VD lo = x - __builtin_convertvector(hi, VD);
        lo = lo - lo == 0 ? lo : VD{};  // an infinite or NaN score: lo 0 (the score itself says it)
        *(VHu*)(C + i * ldc + j * W + e * H) = hi;
        *(VHu*)(Clo + i * ldc + j * W + e * H) = __builtin_convertvector(lo, VH);
      }
  if (cmax) {
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      V mx = X::load(cmax + j * W);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const V x = X::load(C + i * ldc + j * W);
        mx = x > mx ? x : mx;
      }
      X::store(cmax + j * W, mx);
    }
  }
}

/* micro_scores over the panels of C: MR rows by half of gemm's vectors (its double accumulators take
 * twice the registers), the last vectors one by one. */
template <int B, bool Wide>
DA_INLINE void scores_panels(float* C, float* Clo, int64_t ldc, const float* A, int64_t as, int64_t ak,
                             const float* Bm, const double* Bw, int64_t ldb, int64_t m, int64_t nv, int64_t K,
                             float* cmax, float alpha) {
  const int W = Vec<float, B>::W, MR = Vec<float, B>::MR,
            NV = Vec<float, B>::NV > 1 ? Vec<float, B>::NV / 2 : 1;
  for (int64_t v0 = 0; v0 < nv;) {
    const bool full = v0 + NV <= nv;  // a panel of NV vectors, else the last ones one by one
    float* c = C + v0 * W;
    float* cl = Clo + v0 * W;
    const float* bb = Bm + v0 * W;
    const double* bw = Wide ? Bw + v0 * W : nullptr;
    float* cm = cmax ? cmax + v0 * W : nullptr;
    int64_t i = 0;
    for (; i + MR <= m; i += MR)
      full ? micro_scores<B, MR, NV, Wide>(c + i * ldc, cl + i * ldc, ldc, A + i * as, as, ak, bb, bw, ldb, K,
                                           cm, alpha)
           : micro_scores<B, MR, 1, Wide>(c + i * ldc, cl + i * ldc, ldc, A + i * as, as, ak, bb, bw, ldb, K,
                                          cm, alpha);
    for (; i < m; ++i)
      full ? micro_scores<B, 1, NV, Wide>(c + i * ldc, cl + i * ldc, ldc, A + i * as, as, ak, bb, bw, ldb, K,
                                          cm, alpha)
           : micro_scores<B, 1, 1, Wide>(c + i * ldc, cl + i * ldc, ldc, A + i * as, as, ak, bb, bw, ldb, K,
                                         cm, alpha);
    v0 += full ? NV : 1;
  }
}

/* The reused operand B of the scores (K x ld floats: packed queries in the forward, keys in the
 * backward) in double, once per tile, for micro_scores (float rows), so that its inner loop loads
 * doubles instead of converting every step; nullptr for double rows. */
template <typename T>
DA_INLINE const double* widen_operand(const T* src, int64_t K, int64_t ld, std::vector<double>& dst) {
  if constexpr (std::is_same<T, double>::value) {
    return nullptr;
  } else {
    dst.resize((size_t)(K * ld));
    for (int64_t i = 0; i < K * ld; ++i) dst[(size_t)i] = (double)src[i];
    return dst.data();
  }
}

/*
 * C (m x nv*W doubles, rows at stride ldc) += A (m x K floats) * B (K x nv*W doubles), every
 * product and sum in double: the P V of the backward's recomputation of the forward for float32
 * inputs (Fwd::wide), whose output must carry more than float's bits. Register blocks as
 * scores_panels (gemm_wide_acc).
 */
template <int B, int M, int R>
DA_INLINE void micro_wide_acc(double* C, int64_t ldc, const float* A, int64_t as, int64_t ak,
                              const double* Bm, int64_t ldb, int64_t K) {
  typedef typename HalfVec<B>::d VD;
  typedef typename HalfVec<B>::du VDu;
  const int W = Vec<float, B>::W, H = W / 2;
  VD c[M][R][2];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      c[i][j][0] = *(const VDu*)(C + i * ldc + j * W);
      c[i][j][1] = *(const VDu*)(C + i * ldc + j * W + H);
    }
  for (int64_t k = 0; k < K; ++k) {
    VD b[R][2];
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      b[j][0] = *(const VDu*)(Bm + k * ldb + j * W);
      b[j][1] = *(const VDu*)(Bm + k * ldb + j * W + H);
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const double a = A[i * as + k * ak];
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) {
        c[i][j][0] += a * b[j][0];
        c[i][j][1] += a * b[j][1];
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) {
      *(VDu*)(C + i * ldc + j * W) = c[i][j][0];
      *(VDu*)(C + i * ldc + j * W + H) = c[i][j][1];
    }
}

/* dst[j * Dp + d] = src[j * stride + d] in double, for j < n, d < Dp. */
template <typename T>
DA_INLINE void widen_rows(double* dst, const T* src, int64_t stride, int64_t n, int64_t Dp) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dp; ++d) dst[j * Dp + d] = (double)src[j * stride + d];
}

template <int B>
DA_INLINE void gemm_wide_acc(double* C, int64_t ldc, const float* A, int64_t as, int64_t ak, const double* Bm,
                             int64_t ldb, int64_t m, int64_t nv, int64_t K) {
  const int W = Vec<float, B>::W, MR = Vec<float, B>::MR,
            NV = Vec<float, B>::NV > 1 ? Vec<float, B>::NV / 2 : 1;
  for (int64_t v0 = 0; v0 < nv;) {
    const bool full = v0 + NV <= nv;
    double* c = C + v0 * W;
    const double* bb = Bm + v0 * W;
    int64_t i = 0;
    for (; i + MR <= m; i += MR)
      full ? micro_wide_acc<B, MR, NV>(c + i * ldc, ldc, A + i * as, as, ak, bb, ldb, K)
           : micro_wide_acc<B, MR, 1>(c + i * ldc, ldc, A + i * as, as, ak, bb, ldb, K);
    for (; i < m; ++i)
      full ? micro_wide_acc<B, 1, NV>(c + i * ldc, ldc, A + i * as, as, ak, bb, ldb, K)
           : micro_wide_acc<B, 1, 1>(c + i * ldc, ldc, A + i * as, as, ak, bb, ldb, K);
    v0 += full ? NV : 1;
  }
}

/*
 * S = alpha * A B (m x nv*W), the scores of the forward (S^T = scale2 K Q^T, with the column max)
 * and of the backward (S2 = scale2 Q K^T), K = D: gemm for double rows; for float rows micro_scores
 * (sums in double, the score as C + Clo) in scores_panels, reading B from Bw when it is given (B in
 * double: widen_operand). Clo is not written for double rows.
 */
template <typename T, int B>
DA_INLINE void gemm_scores(T* C, T* Clo, int64_t ldc, const T* A, int64_t as, int64_t ak, const T* Bm,
                           int64_t ldb, int64_t m, int64_t nv, int64_t K, T* cmax, T alpha,
                           const double* Bw = nullptr) {
  if constexpr (std::is_same<T, double>::value) {
    gemm<T, B>(C, ldc, A, as, ak, Bm, ldb, m, nv, K, false, cmax, alpha);
  } else {
    if (Bw)
      scores_panels<B, true>(C, Clo, ldc, A, as, ak, Bm, Bw, ldb, m, nv, K, cmax, alpha);
    else
      scores_panels<B, false>(C, Clo, ldc, A, as, ak, Bm, Bw, ldb, m, nv, K, cmax, alpha);
  }
}

/* dst[d * ld + i] = src[i * stride + d] * s for i < n, d < D; lanes n..ld zeroed. */
template <typename T>
DA_INLINE void pack_transposed(T* dst, int64_t ld, const T* src, int64_t stride, int64_t n, int64_t D, T s) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = n; i < ld; ++i) dst[d * ld + i] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = src + i * stride;
    for (int64_t d = 0; d < D; ++d) dst[d * ld + i] = row[d] * s;
  }
}

/* rows[j * stride] += t[j * Dp] for j < n (Dp values each). */
template <typename T, int B>
DA_INLINE void add_rows(T* rows, int64_t stride, const T* t, int64_t n, int64_t Dp) {
  typedef Vec<T, B> X;
  const int W = X::W;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dp; d += W)
      X::store(rows + j * stride + d, X::load(rows + j * stride + d) + X::load(t + j * Dp + d));
}

}  // namespace cpu
}  // namespace dilated_attention
