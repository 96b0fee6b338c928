// CPU implementation of dilated_attention::fwd and dilated_attention::bwd.
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
// All products go through one register-blocked micro-kernel (gemm below) written with GCC vector
// extensions. The kernels are templates over the vector width and are compiled three times, each at
// the width of one instruction set's registers: AVX-512 (64 bytes), AVX2 + FMA (32) and the
// baseline (16: SSE2, or NEON on ARM). The widest set the CPU has is chosen once per process
// (cpu_isa below), so one build runs well on every x86-64 CPU. Scores are kept in base 2 (dot products times softmax_scale *
// log2(e)) and exponentiated by a vectorised 2^x (degree-6 polynomial, relative error about 1e-7);
// float64 calls libm's exp2. For float rows every score sums its D products in double and is kept
// as a float and its float remainder (micro_scores), and the forward merges its tiles and branches
// into a per-position state in double, out = acc / l rounded once. NaN propagates, -inf scores add
// nothing, a row that no branch covers gets out = 0 and lse = -inf.
//
// The kernels read q, k, v (and dout) as head-major rows: one (B, H, N, Dp) copy of each, in float32
// (float64 for float64 inputs), zero padded to Dp, a multiple of the widest vector (head_major_rows);
// inputs that already are such rows are read in place. The backward accumulates dq, dk and dv in
// the same layout and converts them back to (B, N, H, D) at the end.
//
// Cost: forward 2 * D multiply-adds per (query, key) pair with multiplicity, backward 5 * D (S, dP,
// dV, dK, dQ) and D subtractions (dP as dout . (v - out), see Backward below); the forward once more
// in the backward (2 * D): for float32 inputs (without dropout) with its out unrounded, for delta
// (compute_delta_wide), for float16 and bfloat16 for a float32 out (out_for_backward). The scores of
// float rows and that float32 recomputation's P V sum in double (half the vector width).
// Memory: the outputs, the head-major copies (forward 3, backward 8
// tensors of B * H * N * Dp values), the (B, Hq, N) delta of the backward, and
// O(threads * (QB + QT + KB) * Dp) scratch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <math.h>
#include <cmath>
#include <stdint.h>
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../dilated_attention.h"
#include "../dropout.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DA_NO_ISA_DISPATCH)
#define DA_X86_DISPATCH 1
#define DA_TARGET_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2"), noinline))
#define DA_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2"), noinline))
#endif
#if defined(__GNUC__) && !defined(__clang__)
// The vector helpers below are always inlined into the per-ISA entry points, so no vector crosses a
// call boundary and the ABI note GCC gives for wide vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define DA_INLINE static inline __attribute__((always_inline))

namespace dilated_attention {
namespace {

// Tile sizes: QT queries (forward: vector lanes) against KF keys in the forward; KB keys (vector
// lanes) against QT queries in the backward. A forward block spans QB positions (see
// block_size()). Rows are padded to PAD_BYTES, the widest vector, whatever width a call runs at.
enum { QT = 64, KB = 64, KF = 64, PAD_BYTES = 64 };

// Long sums go in two levels, so that their rounding error does not grow with the segment length:
// the forward merges a query tile's online-softmax state into the block's every SUM_TILES key
// tiles, and the backward adds a key tile's dk and dv into their rows every SUM_TILES query tiles
// (and each key tile's share of dq on its own). 8 tiles are 512 keys or queries.
enum { SUM_TILES = 8 };

/* ------------------------------------------------------------------------------------------ */
/* Vectors                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/*
 * Vectors of B bytes (GCC vector extensions): 64 for AVX-512, 32 for AVX2, 16 for SSE2 and NEON.
 * The kernels are templates over B, instantiated once per instruction set at the width of its
 * registers (see the entry points at the end): a vector wider than the registers is split into
 * pieces that spill, and broadcasts to it are built lane by lane. MR x NV is the micro-kernel's
 * register block (MR rows of C, NV vectors each): MR * NV accumulators, NV loads of B and one
 * broadcast of A about fill the 32 (AVX-512, NEON) or 16 (AVX2, SSE2) vector registers.
 */
template <typename T, int B>
struct Vec {
  enum { W = B / (int)sizeof(T) };
  typedef T v __attribute__((vector_size(B)));
  typedef T vu __attribute__((vector_size(B), aligned(sizeof(T)), may_alias));
  typedef std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t> U;
  typedef U vi __attribute__((vector_size(B)));
#if defined(__x86_64__)
  // AVX2: 3 x 4 (one spill at most) was the fastest of 2x4, 2x8, 3x4, 4x2, 4x3, 4x4, 6x2, 8x1 on a
  // Zen 1 EPYC, by 15-25% over the next.
  enum { MR = B == 64 ? 4 : B == 32 ? 3 : 4, NV = B == 64 ? 4 : B == 32 ? 4 : 2 };
#else
  enum { MR = 4, NV = B == 16 ? 4 : 2 };
#endif

  DA_INLINE v load(const T* p) { return *(const vu*)p; }
  DA_INLINE void store(T* p, v x) { *(vu*)p = x; }
  DA_INLINE v set(T x) { return v{} + x; }  // outside hot loops: -0 becomes +0
  DA_INLINE v iota() {
    v x;
    for (int i = 0; i < W; ++i) x[i] = (T)i;
    return x;
  }

  /* 2^x. float: n = round(x) (x + 1.5 * 2^23 puts it in the low mantissa bits), f = x - n exactly,
   * 2^f by a degree-6 polynomial (relative error about 1e-7 in float arithmetic), times 2^n built in
   * the exponent bits; x <= -127 gives 0 (so -inf gives 0), NaN stays NaN; 15 vector operations.
   * double (for gradcheck): libm's exp2, lane by lane. */
  DA_INLINE v exp2v(v x) {
    if constexpr (sizeof(T) == 4) {
      const v lo = set(-127.0f), hi = set(127.0f), magic = set(12582912.0f);  // 1.5 * 2^23
      x = x < lo ? lo : x;  // NaN compares false and stays NaN
      x = x > hi ? hi : x;
      const v t = x + magic;
      const v f = x - (t - magic);
      v p = set(1.5353361959569156e-4f);
      p = p * f + 1.3398875016719103e-3f;
      p = p * f + 9.6184369176626205e-3f;
      p = p * f + 5.5503323674201965e-2f;
      p = p * f + 2.4022647738456726e-1f;
      p = p * f + 6.9314718246459961e-1f;
      p = p * f + 1.0f;
      return p * (v)(((vi)t - 0x4B400000u + 127u) << 23);
    } else {
      for (int i = 0; i < W; ++i) x[i] = ::exp2(x[i]);
      return x;
    }
  }
};

/* Rows are padded to this many values of T (PAD_BYTES), a multiple of every vector width. */
template <typename T>
constexpr int64_t pad_values() {
  return PAD_BYTES / (int64_t)sizeof(T);
}

template <typename T>
DA_INLINE T neg_inf() {
  return -INFINITY;
}

/* ------------------------------------------------------------------------------------------ */
/* Instruction sets                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* The kernels' instruction sets, widest last: baseline is SSE2 on x86-64 (16-byte vectors) and the
 * compiler's default elsewhere (16-byte vectors: NEON on ARM). */
enum class Isa { baseline, avx2, avx512 };

static const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "baseline";
}

static bool cpu_has(Isa isa) {
#ifdef DA_X86_DISPATCH
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
  if (isa == Isa::avx2) return avx2;
  if (isa == Isa::avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
  return isa == Isa::baseline;
}

/*
 * The instruction set the kernels run with, decided once per process: the widest this CPU has, or
 * the one the environment variable DILATED_ATTENTION_CPU_ISA names (auto, avx512, avx2, baseline),
 * which this CPU must have. Every set computes the same function; the variable is for tests and
 * for comparing them.
 */
static Isa cpu_isa() {
  static const Isa chosen = [] {
    const char* env = getenv("DILATED_ATTENTION_CPU_ISA");
    const std::string want = env ? env : "auto";
    if (want.empty() || want == "auto") {
      for (Isa isa : {Isa::avx512, Isa::avx2})
        if (cpu_has(isa)) return isa;
      return Isa::baseline;
    }
    for (Isa isa : {Isa::avx512, Isa::avx2, Isa::baseline}) {
      if (want != isa_name(isa)) continue;
      TORCH_CHECK(cpu_has(isa), "dilated_attention: DILATED_ATTENTION_CPU_ISA=", want,
                  " names an instruction set this CPU does not have");
      return isa;
    }
    TORCH_CHECK(false, "dilated_attention: DILATED_ATTENTION_CPU_ISA must be one of auto, avx512, ",
                "avx2, baseline; got '", want, "'");
    return Isa::baseline;  // not reached
  }();
  return chosen;
}

/* ------------------------------------------------------------------------------------------ */
/* The micro-kernel                                                                             */
/* ------------------------------------------------------------------------------------------ */

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

/* Scratch memory of one thread: slices of one 64-byte aligned buffer. */
template <typename T>
struct Arena {
  std::vector<T> mem;
  size_t used;
  explicit Arena(size_t n) : mem(n + 64), used(0) {
    const uintptr_t p = (uintptr_t)mem.data();
    used = (size_t)(((p + 63) & ~(uintptr_t)63) - p) / sizeof(T);
  }
  T* take(size_t n) {
    T* p = mem.data() + used;
    used += (n + 15) & ~(size_t)15;
    TORCH_INTERNAL_ASSERT(used <= mem.size());
    return p;
  }
  static size_t need(std::initializer_list<size_t> sizes) {
    size_t total = 0;
    for (size_t s : sizes) total += (s + 15) & ~(size_t)15;
    return total;
  }
};

/*
 * Run fn(task, scratch) for task in [0, n) on all threads. Thread i owns the i-th contiguous
 * share of the tasks (neighbouring tasks read the same keys and values, so threads that work on
 * different shares touch different memory) and, when done, takes the remaining tasks of the
 * other shares one at a time.
 */
template <typename MakeScratch, typename Fn>
static void parallel_tasks(int64_t n, const MakeScratch& make, const Fn& fn) {
  if (n <= 0) return;
  struct alignas(64) Share {
    std::atomic<int64_t> next;
    int64_t end;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<Share> shares(workers);
  for (int64_t i = 0; i < workers; ++i) {
    shares[i].next.store(n * i / workers);
    shares[i].end = n * (i + 1) / workers;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make();
    for (int64_t me = begin; me < end; ++me)
      for (int64_t j = 0; j < workers; ++j) {
        Share& sh = shares[(me + j) % workers];
        for (int64_t t = sh.next.fetch_add(1); t < sh.end; t = sh.next.fetch_add(1)) fn(t, scratch);
      }
  });
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

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

template <typename T>
struct FwdScratch {
  Arena<T> arena;
  T* m;                      // block state per position: the max (QB), and in double
  double *l, *acc;           // the denominator (QB) and the unnormalised output (QB, Dp)
  double *lw, *acctw, *ltw;  // Fwd::wide: the denominator summed in double (QB); acct and lt in double
  double* vw;                // Fwd::wide: the key tile's values in double (KF, Dp)
  std::vector<double> dbl;   // l, acc, lw, acctw, ltw, vw
  T *qt, *st, *stlo;         // (D, QT) queries, transposed; (KF, QT) scores, then weights; (KF, QT)
                             // the scores' low parts (float rows: the score is st + stlo)
  T *mt, *lt, *corr, *tmax;  // (QT) tile state
  T* acct;                   // (QT, Dp)
  std::vector<double> wide;  // qt in double, for the scores of float rows (widen_operand)
  FwdScratch(int64_t QB, int64_t D, int64_t Dp)
      : arena(Arena<T>::need({(size_t)QB, (size_t)(D * QT), (size_t)(KF * QT), (size_t)(KF * QT), QT, QT, QT,
                              QT, (size_t)(QT * Dp)})),
        dbl((size_t)(QB * (Dp + 2) + QT * (Dp + 1) + KF * Dp)) {
    m = arena.take(QB);
    l = dbl.data();
    acc = l + QB;
    lw = acc + QB * Dp;
    acctw = lw + QB;
    ltw = acctw + QT * Dp;
    vw = ltw + QT;
    qt = arena.take(D * QT);
    st = arena.take(KF * QT);
    stlo = arena.take(KF * QT);
    mt = arena.take(QT);
    lt = arena.take(QT);
    corr = arena.take(QT);
    tmax = arena.take(QT);
    acct = arena.take(QT * Dp);
  }
};

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

/* Whether rows[j * stride + d] is finite for j < n, d < D. */
template <typename T>
DA_INLINE bool rows_finite(const T* rows, int64_t stride, int64_t n, int64_t D) {
  bool ok = true;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d)
      ok &= rows[j * stride + d] - rows[j * stride + d] == 0;  // NaN for inf, NaN
  return ok;
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

/* Merge a query tile's state (m2, l2, acc2) into the block's rows row0 + i * step. */
template <typename T, typename A>
DA_INLINE void merge_tile(T* m, double* l, double* acc, const T* m2, const T* l2, const A* acc2, int64_t n,
                          int64_t row0, int64_t step, int64_t Dp, double* lw = nullptr,
                          const double* lw2 = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    if (l2[i] == 0) continue;  // only -inf scores: nothing to add
    const int64_t row = row0 + i * step;
    double* a = acc + row * Dp;
    const A* b = acc2 + i * Dp;
    if (l[row] == 0) {
      m[row] = m2[i];
      l[row] = l2[i];
      if (lw) lw[row] = lw2[i];
      for (int64_t d = 0; d < Dp; ++d) a[d] = b[d];
      continue;
    }
    const T mx = m[row] > m2[i] ? m[row] : m2[i];
    const double ca = ::exp2((double)m[row] - (double)mx), cb = ::exp2((double)m2[i] - (double)mx);
    m[row] = mx;
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
    s->l[i] = 0;
    s->lw[i] = 0;
  }
  for (int64_t i = 0; i < rows * Dp; ++i) s->acc[i] = 0;
  // the tile state afresh: max, denominator and output (in double too, wide)
  auto restart = [&](int64_t nq, int64_t ld) {
    for (int64_t i = 0; i < ld; ++i) {
      s->mt[i] = neg_inf<T>();
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
      merge_tile(s->m, s->l, s->acc, s->mt, s->lt, s->acctw, nq, row0, step, Dp, s->lw, s->ltw);
    else
      merge_tile(s->m, s->l, s->acc, s->mt, s->lt, s->acct, nq, row0, step, Dp);
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
                               s->lt, s->corr, diag ? nullptr : s->tmax);
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

/* out = acc / l and lse = m * unit + ln(l) for the block's rows, in double (rounded once, to L:
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
      lse[p] = (L)((double)s.m[row] * unit + ::log((double)l));
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = (scalar_t)(T)(s.acc[row * Dp + d] / l);
      lse[p] = (L)((double)s.m[row] * unit + ::log((double)l));
    }
  }
}

/* softmax_scale / scale2: ln 2, up to the rounding of scale2 (ln 2 itself where scale2 is 0). */
template <typename T>
static double score_unit(double scale, T scale2) {
  return scale2 != 0 ? scale / (double)scale2 : 0.69314718055994530942;
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

/*
 * The tasks of a call, sequence by sequence: sequence i owns the task ids [first[i], first[i + 1]).
 * locate(task) gives the sequence and the task's index inside it (a binary search).
 */
struct TaskSplit {
  std::vector<int64_t> first;
  TaskSplit(const std::vector<Sequence>& seqs, const std::function<int64_t(const Sequence&)>& count) {
    first.push_back(0);
    for (const Sequence& sq : seqs) first.push_back(first.back() + count(sq));
  }
  int64_t total() const { return first.back(); }
  void locate(int64_t task, int64_t* seq, int64_t* local) const {
    *seq = (int64_t)(std::upper_bound(first.begin(), first.end(), task) - first.begin()) - 1;
    *local = task - first[*seq];
  }
};

/*
 * A zeroed CPU tensor for the kernels' own buffers (the head-major copies and accumulators). On
 * Linux, one of 2 MiB or more is mapped afresh with MADV_HUGEPAGE (where the kernel's transparent
 * huge pages allow it): its first touch then faults once per 2 MiB rather than once per 4 KiB page,
 * and the mapping comes zeroed. Elsewhere, and if the mapping fails, at::zeros.
 */
static at::Tensor zeroed_buffer(at::IntArrayRef sizes, const at::TensorOptions& opt) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t huge = (size_t)2 << 20;
  const size_t bytes = (size_t)c10::multiply_integers(sizes) * opt.dtype().itemsize();
  if (bytes >= huge) {
    const size_t len = bytes + huge;  // room to start on a 2 MiB boundary
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      char* p = (char*)(((uintptr_t)base + huge - 1) & ~(uintptr_t)(huge - 1));
      madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without it the buffer works the same
      return at::from_blob(p, sizes, [base, len](void*) { munmap(base, len); }, opt);
    }
  }
#endif
  return at::zeros(sizes, opt);
}

/*
 * t (B, N, H, D) as a (B, N, H, Dp) view of a head-major (B, H, N, Dp) tensor of type st, rows zero
 * padded past D; t itself when it already is one. The kernels walk one head's rows at a stride of r
 * rows: head-major, those rows lie r * Dp values apart rather than r * H * Dp (a power of two apart
 * for the usual H and D, so they fall into a few cache sets and on a new page each). With the copies
 * included, the forward took about 12% and the backward about 11% less time with two threads on a
 * 2-core AVX-512 VM (B=1, H=8, D=64, N=16K, medians of 4 interleaved runs). Cost: one pass over t,
 * and a copy of B * H * N * Dp values.
 */
static at::Tensor head_major_rows(const at::Tensor& t, at::ScalarType st, int64_t Dp) {
  const at::Tensor th = t.transpose(1, 2);  // (B, H, N, D)
  if (t.scalar_type() == st && t.size(3) == Dp && th.is_contiguous()) return t;
  at::Tensor rows = zeroed_buffer({t.size(0), t.size(2), t.size(1), Dp}, t.options().dtype(st));
  rows.narrow(3, 0, t.size(3)).copy_(th);
  return rows.transpose(1, 2);
}

template <typename T>
static void set_strides(const at::Tensor& t, int64_t* sb, int64_t* sn, int64_t* sh) {
  *sb = t.stride(0);
  *sn = t.stride(1);
  *sh = t.stride(2);
}

/* Point an argument struct (Fwd, Bwd, PieceArgs) at its q, k, v rows. */
template <typename T, typename Args>
static void point_qkv(Args* A, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  A->q = q.data_ptr<T>();
  A->k = k.data_ptr<T>();
  A->v = v.data_ptr<T>();
  set_strides<T>(q, &A->q_sb, &A->q_sn, &A->q_sh);
  set_strides<T>(k, &A->k_sb, &A->k_sn, &A->k_sh);
  set_strides<T>(v, &A->v_sb, &A->v_sn, &A->v_sh);
}

/* Point a backward's argument struct (Bwd, PieceArgs) at its rows and gradient accumulators. */
template <typename T, typename Args>
static void point_backward(Args* A, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                           const at::Tensor& dv) {
  point_qkv<T>(A, q, k, v);
  A->dout = dout.data_ptr<T>();
  A->dq = dq.data_ptr<T>();
  A->dk = dk.data_ptr<T>();
  A->dv = dv.data_ptr<T>();
  set_strides<T>(dout, &A->do_sb, &A->do_sn, &A->do_sh);
  set_strides<T>(dq, &A->dq_sb, &A->dq_sn, &A->dq_sh);
  set_strides<T>(dk, &A->dk_sb, &A->dk_sn, &A->dk_sh);
  set_strides<T>(dv, &A->dv_sb, &A->dv_sn, &A->dv_sh);
}

/* out's head-major rows (head_major_rows) at the strides of dout's, so that one offset finds a row
 * of either (the backward's dO (V - O)^T). */
static at::Tensor rows_like(const at::Tensor& out, const at::Tensor& dout, at::ScalarType st, int64_t Dp) {
  at::Tensor rows = head_major_rows(out, st, Dp);
  if (rows.strides() == dout.strides()) return rows;
  at::Tensor same = at::empty_strided(dout.sizes(), dout.strides(), dout.options());
  return same.copy_(rows);
}

/*
 * The forward of every sequence of a call, into out (B, N, Hq, D) and lse (B, Hq, N) (a packed call
 * passes its (1, T, ...) views): tasks (sequence, head, block of QB positions), each run by
 * fwd_block on the sequence's rows as a sequence of its own (positions, segments, phases and causal
 * masking start at its first row).
 */
static void fwd_sequences(const Problem& P, const std::vector<Sequence>& seqs, const at::Tensor& q_in,
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

/*
 * The out that the backward reads (out_for_backward, below): for float16 and bfloat16 inputs, out in
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

template <typename T>
struct BwdScratch {
  Arena<T> arena;
  T *kt, *vt;                // (D, KB) keys and values of the tile, transposed
  T *dkt, *dvt;              // (KB, Dp) their gradients
  T *s, *dp;                 // (QT, KB): scores then P; dout . v then dS
  T* slo;                    // (QT, KB): the scores' low parts (float rows)
  T *lse, *lselo;            // (QT): lse in base 2 (lse / unit) as hi + lo (lse_base2)
  T* delta;                  // (QT)
  T* dqt;                    // (QT, Dp): one key tile's share of dq
  T* mask;                   // (QT, KB): dropout's factors (0 or 1 / (1 - p)) of the tile
  std::vector<double> wide;  // kt in double, for the scores of float rows (widen_operand)
  BwdScratch(int64_t D, int64_t Dp)
      : arena(Arena<T>::need({(size_t)(D * KB), (size_t)(D * KB), (size_t)(KB * Dp), (size_t)(KB * Dp),
                              QT * KB, QT * KB, QT * KB, QT, QT, QT, (size_t)(QT * Dp), QT * KB})) {
    kt = arena.take(D * KB);
    vt = arena.take(D * KB);
    dkt = arena.take(KB * Dp);
    dvt = arena.take(KB * Dp);
    s = arena.take(QT * KB);
    dp = arena.take(QT * KB);
    slo = arena.take(QT * KB);
    lse = arena.take(QT);
    lselo = arena.take(QT);
    delta = arena.take(QT);
    dqt = arena.take(QT * Dp);
    mask = arena.take(QT * KB);
  }
};

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

/* rows[j * stride] += t[j * Dp] for j < n (Dp values each). */
template <typename T, int B>
DA_INLINE void add_rows(T* rows, int64_t stride, const T* t, int64_t n, int64_t Dp) {
  typedef Vec<T, B> X;
  const int W = X::W;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dp; d += W)
      X::store(rows + j * stride + d, X::load(rows + j * stride + d) + X::load(t + j * Dp + d));
}

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
          lse_base2<T>(lse_h[(qt0 + i) * r], P.unit, &s->lse[i], &s->lselo[i]);
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
                      qt0 - kt0, s->lse, s->lselo, s->delta, P.scale);
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

#include "piece_cpu.h"  // the pieces of a segment that spans ranks, on the kernels above

}  // namespace

const char* cpu_kernel_isa() {
  return isa_name(cpu_isa());
}

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("varlen_fwd", &varlen_fwd_cpu);
  m.impl("varlen_bwd", &varlen_bwd_cpu);
}

}  // namespace dilated_attention
