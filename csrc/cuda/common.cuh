// Device helpers shared by the CUDA kernels: warp reductions, the walk over (head, branch,
// segment, tile of the other side) that every kernel runs, and the sm80 primitives (cp.async,
// ldmatrix, mma.sync) of the tensor-core kernels, written as inline PTX.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <climits>

#include "launch.h"
#include "tiling.h"

#if defined(DA_CUDA_EMULATION)
// The kernels run on the CPU for tests (tests/cuda_emulation/cuda_emulation.h); never part of the extension.
#include "cuda_emulation.h"  // tests/cuda_emulation, on the tests' include path
#endif

namespace dilated_attention {
namespace cuda {

#define DA_FULL_MASK 0xffffffffu
#define DA_LOG2E 1.4426950408889634
#define DA_LN2 0.6931471805599453

#if defined(DA_CUDA_EMULATION)
#define DA_SM80 1
#define DA_EXTERN_SMEM(name) unsigned char* name = da_emu::shared_memory()
#else
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DA_SM80 1
#else
#define DA_SM80 0
#endif
// The block's dynamic shared memory.
#define DA_EXTERN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

/* ------------------------------------------------------------------------------------------ */
/* Math and warp reductions                                                                     */
/* ------------------------------------------------------------------------------------------ */

template <typename acc_t>
__device__ __forceinline__ acc_t da_inf() {
  return (acc_t)INFINITY;
}

__device__ __forceinline__ float da_exp2(float x) {
  return exp2f(x);
}
__device__ __forceinline__ double da_exp2(double x) {
  return exp2(x);
}
__device__ __forceinline__ float da_log2(float x) {
  return log2f(x);
}
__device__ __forceinline__ double da_log2(double x) {
  return log2(x);
}
// a * b rounded on its own, never contracted with a following add into an FMA: a score is the
// rounded dot product times scale * log2(e), the same bits wherever a kernel recomputes it.
#if defined(DA_CUDA_EMULATION)
__device__ __forceinline__ float da_mul_rn(float a, float b) {
  return a * b;
}
__device__ __forceinline__ double da_mul_rn(double a, double b) {
  return a * b;
}
#else
__device__ __forceinline__ float da_mul_rn(float a, float b) {
  return __fmul_rn(a, b);
}
__device__ __forceinline__ double da_mul_rn(double a, double b) {
  return __dmul_rn(a, b);
}
#endif
// Maximum that ignores NaN (like the CPU kernel's `a > b ? a : b` scan from -inf).
__device__ __forceinline__ float da_max(float a, float b) {
  return fmaxf(a, b);
}
__device__ __forceinline__ double da_max(double a, double b) {
  return fmax(a, b);
}

/*
 * The kernels keep scores in base 2: q (or its tile) times sl2 = (acc_t)(softmax_scale * log2(e)).
 * unit = softmax_scale / sl2 turns them back into natural units: ln 2, corrected for the rounding
 * of sl2 to acc_t, which would otherwise scale lse by up to one unit in the last place (ln 2
 * itself where sl2 is 0). lse = m * unit + ln(l) is formed in double and rounded once (to acc_t, or
 * not at all where the op returns a float64 lse, p.lse_f64), and the backward turns it back into
 * base 2 in double, split into hi + lo (da_lse_base2), so that p = 2^((s - hi) - lo) is as
 * consistent with the forward's own normalisation as the saved lse allows (as the CPU kernel does).
 * Once per row (or per row of a tile of the other side): the double arithmetic costs nothing
 * measurable next to the pairs.
 */
template <typename acc_t>
__host__ __device__ __forceinline__ double da_score_unit(double scale, acc_t sl2) {
  return sl2 != (acc_t)0 ? scale / (double)sl2 : DA_LN2;
}

/*
 * Rows at huge scores (the CPU kernels' rule, csrc/cpu/softmax.h lse_slack and snap_exponent):
 * softmax_scale goes up to ~1.7e38, and where a row's base-2 lse hi reaches 2^22 the rounding of L
 * (double) and of its low part reaches the rounding of P (float rows; float64 rows, whose P no
 * double lse can then give to float64's rule, below it keep their exponents as L gives them). There
 * the forward writes L with one rounding (da_lse_natural), the backward reads it beyond double
 * (da_lse_base2: the division's remainder by fma) and rounds each exponent to what a double lse
 * can tell (da_snap_exponent): within da_lse_slack(hi) = |hi| 2^-50 of 0 it becomes 0, within it of
 * -log2(c) for a whole c (the keys at the row's largest score times the branches that read each)
 * it becomes -log2(c), so P = 1 / c exactly where L's rounding put up to 2^-9 into P at 1e12 and,
 * past ~1e15, any exponent at all (P = 0 or inf). The slack is 0 in every other row: the common
 * path is unchanged but for one compare. Past ~5e14 a double lse cannot hold ln(l): rows whose
 * largest key is read through several branches get P = 1 per branch there (as on the CPU).
 */
template <typename acc_t>
__device__ __forceinline__ acc_t da_lse_slack(acc_t hi) {
  const acc_t a = fabs(hi);
  return a >= (acc_t)0x1p22 && a < da_inf<acc_t>() ? a * (acc_t)0x1p-50 : (acc_t)0;
}

// An exponent x of a row with slack > 0 (da_lse_slack) rounded to what its lse can tell: 0 within
// the slack of 0, -log2(c) within it of -log2(c) for c = 2 .. 2^8 (c the nearest to 2^-x), else x.
template <typename acc_t>
__device__ __forceinline__ acc_t da_snap_exponent(acc_t x, acc_t slack) {
  if (x >= -slack && x <= slack) return (acc_t)0;
  if (x < -slack && x >= (acc_t)-8 - slack) {
    const acc_t c = rint(da_exp2(-x)), t = -da_log2(c);
    if (c >= (acc_t)2 && fabs(x - t) <= slack) return t;
  }
  return x;
}

// A backward exponent x, P = 2^x, from the pair's score s (the forward's, bit for bit) and the
// row's lse hi + lo + lo2 (da_lse_base2): (s - hi) - lo, and in a large row (slack > 0) less lo2
// and snapped (da_snap_exponent). LOW = false (float16/bfloat16 kernels, whose P is rounded to 16
// bits): s - hi outside large rows, as before (lo is far below their rounding there); lo2 = 0
// where a kernel keeps no third part (at most 2^-24 |lo| then, ~2^-19 in the rows where the slack
// matters: |lo| = log2 of the row's denominator once hi's unit in the last place passes 64).
template <bool LOW = true, typename acc_t>
__device__ __forceinline__ acc_t da_exponent(acc_t s, acc_t hi, acc_t lo, acc_t lo2 = (acc_t)0) {
  const acc_t slack = da_lse_slack(hi);
  if (slack != (acc_t)0) return da_snap_exponent(((s - hi) - lo) - lo2, slack);
  return LOW ? (s - hi) - lo : s - hi;
}

// lse in natural units from the base-2 running max m and denominator l (l > 0), in double: with
// one rounding (fma) in the rows that da_lse_slack calls large, which the backward reads back.
template <typename acc_t>
__device__ __forceinline__ double da_lse_natural(acc_t m, acc_t l, double unit) {
  return da_lse_slack(m) == (acc_t)0 ? (double)m * unit + log((double)l)
                                     : fma((double)m, unit, log((double)l));
}

// Row i of the saved lse (B, Hq, N): acc_t, or double where p.lse_f64.
template <typename acc_t>
__device__ __forceinline__ void da_set_lse(const Params& p, int64_t i, double L) {
  if (p.lse_f64)
    static_cast<double*>(p.lse)[i] = L;
  else
    static_cast<acc_t*>(p.lse)[i] = (acc_t)L;
}
template <typename acc_t>
__device__ __forceinline__ double da_get_lse(const Params& p, int64_t i) {
  return p.lse_f64 ? static_cast<const double*>(p.lse)[i] : (double)static_cast<const acc_t*>(p.lse)[i];
}

// The backward's base-2 lse of a saved natural-unit lse L, as hi + *lo: hi = L / unit rounded to
// acc_t, lo the rest, so that 2^((s - hi) - lo) does not inherit the rounding of L / unit to acc_t
// (up to half a unit in the last place of |L / unit|, tens of float epsilons for large logits).
// In rows that da_lse_slack calls large, L / unit beyond double (the division's remainder, by
// fma), and what lo leaves in *lo2 (where given; 0 elsewhere): lo alone would round the exponent to
// 2^-48 |hi| (2^-18 at scores ~1e9). -inf gives hi = +inf and lo = 0, so that 2^(s - hi) = 0.
template <typename acc_t>
__device__ __forceinline__ acc_t da_lse_base2(double L, double unit, acc_t* lo, acc_t* lo2 = nullptr) {
  *lo = (acc_t)0;
  if (lo2) *lo2 = (acc_t)0;
  if (L == -(double)INFINITY) return da_inf<acc_t>();
  const double L2 = L / unit;
  const acc_t hi = (acc_t)L2;
  if (L2 - L2 != 0.0) return hi;                                    // not finite
  double r = L2 - (double)hi;                                       // exact: hi is L2 rounded
  if (da_lse_slack(hi) != (acc_t)0) r += fma(-L2, unit, L) / unit;  // L - L2 unit exactly, over unit
  *lo = (acc_t)r;
  if (lo2) *lo2 = (acc_t)(r - (double)*lo);
  return hi;
}

/*
 * Attention dropout (dropout.h, as the CPU kernel applies it): the forward multiplies the normalised
 * weights by their pairs' factors, 0 (dropped) or 1 / (1 - p) (kept), after their sum went into the
 * denominator (lse is that before dropout); the backward multiplies dP = dO . v by them, and P for
 * dV. A step draws the keep flags of the pairs it computes into the bits of a word (Walk::
 * dropout_keep; ~0u without dropout) and takes each pair's factor from its bit: 1 / (1 - p) or 0,
 * and d.scale = 1 without dropout.
 */
template <typename acc_t>
__device__ __forceinline__ acc_t da_dropout_factor(const da_dropout& d, uint32_t keep, int bit) {
  const acc_t scale = sizeof(acc_t) == 8 ? (acc_t)d.scale64 : (acc_t)d.scale;
  return (keep >> bit) & 1u ? scale : (acc_t)0;
}

template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(DA_FULL_MASK, v, off);
  return v;
}

template <typename V>
__device__ __forceinline__ V warp_max(V v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = da_max(v, __shfl_xor_sync(DA_FULL_MASK, v, off));
  return v;
}

__device__ __forceinline__ int warp_min_int(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = min(v, __shfl_xor_sync(DA_FULL_MASK, v, off));
  return v;
}

__device__ __forceinline__ int warp_max_int(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(DA_FULL_MASK, v, off));
  return v;
}

/* ------------------------------------------------------------------------------------------ */
/* Sequences                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/*
 * The rows that the thread blocks of grid index z (blockIdx.z) work on: one sequence, the rows
 * [start, start + N) of batch entry b. A fixed-length call has B sequences (z, 0, p.N); a packed
 * call has S sequences (0, cu_seqlens[z], cu_seqlens[z + 1] - cu_seqlens[z]) of its (1, T, ...)
 * tensors. Every kernel sees its sequence as a sequence of its own (positions, segments, phases
 * and causal masking from its first row); lse and delta rows stay at b * Hq * p.N + h * p.N +
 * start + x. A piece (tiling.h) has B sequences of p.N query rows and p.piece.nk key rows.
 */
struct SeqRows {
  int64_t b, start, N;
};

__device__ __forceinline__ SeqRows sequence_rows(const Params& p, int64_t z, int rows_are) {
  if (p.piece.nk > 0) return SeqRows{z, 0, rows_are == DA_ROWS_ARE_KEYS ? p.piece.nk : p.N};  // a piece
  if (p.cu_seqlens == nullptr) return SeqRows{z, 0, p.N};
  const int64_t start = p.cu_seqlens[z];
  return SeqRows{0, start, (int64_t)p.cu_seqlens[z + 1] - start};
}

/* ------------------------------------------------------------------------------------------ */
/* The walk                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/*
 * A thread block's walk over its work: for each query head of the group (dk/dv only: G heads; the
 * forward and dq walk their one head), each branch, each segment that the block's rows touch and
 * that holds at least one active row, and each chunk of `other_tile` indices of the other side.
 * Every decision is the same in all threads of the block (it depends on block-wide values and on
 * __syncthreads_or), so the walk may be advanced between barriers by all threads together.
 *
 * ROWS is the number of rows each thread follows (the rows whose results it holds); pos[] are
 * their positions (>= N for padding rows). After each step, jrow[i] is the dilated index of row i
 * in the current segment or -1, and the warp_* fields summarise the warp's rows. I is the walk's
 * integer type (tiling.h): int64_t (the sm80 kernels), or int32_t where registers are scarce (the
 * sm90 kernels' producer warp and consumer warpgroups). With int32_t, padding rows' positions must
 * be clamped to N before they are narrowed (tc_thread_rows), and a field that enters an element
 * offset or a row of lse (a position, a head) is widened to int64_t before it is multiplied.
 */
// The OR of a value over the threads that walk together: the whole block, or one warp (a producer
// warp that walks the rows of the block by itself).
struct BlockAny {
  __device__ static __forceinline__ bool any(bool v) { return __syncthreads_or(v) != 0; }
};
struct WarpAny {
  __device__ static __forceinline__ bool any(bool v) { return __any_sync(DA_FULL_MASK, v); }
};

template <int ROWS, typename I = int64_t>
struct Walk {
  // Fixed for the block.
  I N, base, last, h0;
  int G, is_causal, rows_are, other_tile;
  da_piece pc;  // a piece, or nk = 0 (start)
  I off;        // the causal offset (da_causal_offset)
  I pos[ROWS];
  // Where the walk is (tiling.h).
  da_walk_of<I> st;
  int o_end, o0;  // dilated indices of the other side: < N < 2^30
  int jrow[ROWS];
  bool warp_any, warp_all;
  int warp_jmin, warp_jmax;
  bool done;

  template <typename Any = BlockAny>
  __device__ __forceinline__ void start(const Params& p) {
    begin(p);
    find<Any>(p.br);
  }

  // The walk before its first segment (a consumer then adopts the positions a producer publishes).
  __device__ __forceinline__ void begin(const Params& p) {
    pc = p.piece;
    off = (I)da_causal_offset(&pc);
    da_walk_begin(&st);  // (s = -1: before any segment, which adopt tells apart)
    done = false;
  }

  // Next chunk of the other side, or the next (head, branch, segment) with an active row.
  template <typename Any = BlockAny>
  __device__ __forceinline__ void next(const da_branches& br) {
    o0 += other_tile;
    if (o0 < o_end) return;
    ++st.s;
    find<Any>(br);
  }

  // Position of the other side's index j in the current segment.
  __device__ __forceinline__ I other_position(int j) const { return st.seg_first + (I)j * st.r; }

  // Current query head (dk/dv walk) or the block's head (forward, dq).
  __device__ __forceinline__ I head() const { return h0 + st.gi; }

  // Attention dropout's keep flags (dropout.h) of n <= 32 pairs of the current chunk of head bh:
  // bit i for pair(i, &slot, &jj), the row pos[slot] and the other side's index o0 + jj, their rows
  // being the sequence's `start` plus their positions. One Philox call per pair, in a loop that is
  // not unrolled, in 32-bit arithmetic (the rows are below 2^30, and the generator takes the low 32
  // bits of its counter words): the draws take few registers next to the kernels' accumulators.
  template <typename Pair>
  __device__ __forceinline__ uint32_t dropout_keep(const da_dropout& d, int64_t bh, int64_t start, int n,
                                                   Pair pair) const {
    uint32_t rows[ROWS];
#pragma unroll
    for (int k = 0; k < ROWS; ++k) rows[k] = (uint32_t)(start + pos[k]);
    const uint32_t other0 = (uint32_t)(start + other_position(o0)), r32 = (uint32_t)st.r;
    const bool rows_are_queries = rows_are == DA_ROWS_ARE_QUERIES;
    uint32_t bits = 0;
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
      int slot, jj;
      pair(i, &slot, &jj);
      uint32_t row = rows[0];  // rows[slot] without indexing at run time (no local memory)
#pragma unroll
      for (int k = 1; k < ROWS; ++k) row = slot == k ? rows[k] : row;
      const uint32_t other = other0 + (uint32_t)jj * r32;
      const uint32_t q = rows_are_queries ? row : other, x = rows_are_queries ? other : row;
      uint32_t w[4];
      da_dropout_draws(&d, (uint32_t)bh, q, x >> 2, w);
      const uint32_t draw = x & 2 ? (x & 1 ? w[3] : w[2]) : (x & 1 ? w[1] : w[0]);  // w[x & 3]
      bits |= (uint32_t)(draw >= d.threshold) << i;
    }
    return bits;
  }

  // Whether this warp skips the current chunk / must mask it (tiling.h).
  __device__ __forceinline__ bool skip_chunk() const {
    return da_chunk_skip<I>(rows_are, is_causal, o0, other_tile, warp_any, warp_jmin, warp_jmax, off);
  }
  __device__ __forceinline__ bool chunk_needs_mask() const {
    return da_chunk_needs_mask<I>(rows_are, is_causal, o0, other_tile, o_end, warp_all, warp_jmin, warp_jmax,
                                  off);
  }

  // Whether row index jrow (-1: inactive) meets index j of the other side in the current segment
  // (32-bit form of da_pair_active).
  __device__ __forceinline__ bool pair_active(int jrow, int j) const {
    if (jrow < 0 || j >= o_end) return false;
    if (!is_causal) return true;
    return rows_are == DA_ROWS_ARE_QUERIES ? (I)j <= jrow + off : (I)jrow <= j + off;
  }

  // The rows' dilated indices (jrow) in the walk's current segment; whether any of this thread's
  // rows is active, the warp summaries set from them (warp_*: warp collectives).
  __device__ __forceinline__ bool scan_rows(bool summarise) {
    bool mine = false, all = true;
    int jmin = INT_MAX, jmax = -1;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int j = (int)da_row_index(pos[i], N, st.s, st.w, st.r, st.o);
      jrow[i] = j;
      if (j >= 0) {
        mine = true;
        jmin = min(jmin, j);
        jmax = max(jmax, j);
      } else {
        all = false;
      }
    }
    if (summarise) {
      warp_any = __any_sync(DA_FULL_MASK, mine);
      warp_all = __all_sync(DA_FULL_MASK, all);
      warp_jmin = warp_min_int(jmin);
      warp_jmax = warp_max_int(jmax);
    }
    return mine;
  }

  // From the walk's position on, the first segment with an active row in this block. Any::any(v)
  // is the OR of v over the threads that hold the block's rows (BlockAny: the whole block).
  template <typename Any = BlockAny>
  __device__ void find(const da_branches& br) {
    for (;;) {
      if (!da_walk_candidate(&st, &br, G, h0, base, last, N, is_causal, rows_are, &pc)) {
        done = true;
        return;
      }
      const bool mine = scan_rows(false);
      if (Any::any(mine)) {  // the same answer in every thread
        scan_rows(true);
        o0 = (int)st.o_begin;
        o_end = (int)st.o_end;
        return;
      }
      ++st.s;
    }
  }

  // Moves to a position that another walk over the same rows reached (a chunk that a producer
  // warp published, in its integer type J): its segment (rows rescanned where it changed) and chunk.
  template <typename J>
  __device__ __forceinline__ void adopt(const da_walk_of<J>& at, int chunk_o0) {
    const bool same = at.gi == st.gi && at.bi == st.bi && at.s == st.s;
    st = da_walk_of<I>{at.gi, at.bi, at.s, at.s_end, at.w, at.r, at.o, at.seg_first, at.o_begin, at.o_end};
    o0 = chunk_o0;
    o_end = (int)at.o_end;
    if (!same) scan_rows(true);
  }
};

/* ------------------------------------------------------------------------------------------ */
/* sm80 primitives                                                                              */
/* ------------------------------------------------------------------------------------------ */

// 16-byte asynchronous copy global -> shared; zero-fills the destination when !valid (src is then
// not read but must still be a valid address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_async(smem, valid ? gmem : nullptr);
#elif DA_SM80
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_commit();
#elif DA_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_wait(N);
#elif DA_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Waits for every cp.async copy this thread issued, committed or not: a thread that returns waits
// first, so that no copy of its own outlives it.
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(DA_CUDA_EMULATION)
  da_emu::cp_commit();
  da_emu::cp_wait(0);
#elif DA_SM80
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Four 8x8 b16 matrices; thread t gives the address of row t % 8 of matrix t / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem) {
#if defined(DA_CUDA_EMULATION)
  da_emu::ldsm(r, smem, false);
#elif DA_SM80
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* smem) {
#if defined(DA_CUDA_EMULATION)
  da_emu::ldsm(r, smem, true);
#elif DA_SM80
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
#endif
}

// c (16x8, f32) += a (16x16) * b (16x8) for T = __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mma(c, a, b0, b1, false);
#elif DA_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
#if defined(DA_CUDA_EMULATION)
  da_emu::mma(c, a, b0, b1, true);
#elif DA_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats as one register of two T (lo in the low half: the lower column index).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 t = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&t);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&t);
}

// x rounded to T (as pack2 rounds it).
template <typename T>
__device__ __forceinline__ float round_to(float x);
template <>
__device__ __forceinline__ float round_to<__half>(float x) {
  return __half2float(__float2half_rn(x));
}
template <>
__device__ __forceinline__ float round_to<__nv_bfloat16>(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// Store two adjacent values (4-byte aligned destination).
template <typename T>
__device__ __forceinline__ void store2(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<T>(a, b);
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

/*
 * The m16n8k16 fragment layouts used below (g = lane / 4, t = lane % 4):
 *   A (16x16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
 *   B (16x8, k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
 *   C (16x8, f32):        c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
 * The C fragments of two adjacent n8 tiles are the A fragment of one k16 step (FlashAttention 2's
 * register reuse), see c_to_a.
 */

// Shared-memory address for the A fragment (rows r0..r0+15, columns k0..k0+15) of a row-major
// tile with row stride lds, as ldsm_x4 wants it.
template <typename T>
__device__ __forceinline__ const T* a_frag_addr(const T* tile, int lds, int r0, int k0, int lane) {
  return tile + (r0 + (lane & 15)) * lds + k0 + ((lane >> 4) << 3);
}

// Address for two B fragments (n-tiles n0..n0+7 and n0+8..n0+15, k0..k0+15) when B[k][n] is
// stored as rows n of a row-major tile (B = X^T): ldsm_x4 then gives {b0, b1} of n-tile n0 in
// r[0], r[1] and of n-tile n0+8 in r[2], r[3].
template <typename T>
__device__ __forceinline__ const T* bt_frag_addr(const T* tile, int lds, int n0, int k0, int lane) {
  return tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * lds + k0 + (((lane >> 3) & 1) << 3);
}

// Address for two B fragments (k0..k0+15, n-tiles n0..n0+7 and n0+8..n0+15) when B[k][n] is
// stored row-major as rows k: ldsm_x4_t gives {b0, b1} of n-tile n0 in r[0], r[1] and of n0+8
// in r[2], r[3].
template <typename T>
__device__ __forceinline__ const T* b_frag_addr(const T* tile, int lds, int k0, int n0, int lane) {
  return tile + (k0 + (lane & 15)) * lds + n0 + ((lane >> 4) << 3);
}

// The A fragment of k16 step kk from the f32 C fragments c[2kk] and c[2kk+1].
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

}  // namespace cuda
}  // namespace dilated_attention
