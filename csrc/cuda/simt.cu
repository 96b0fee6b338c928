// SIMT kernels (any architecture, every dtype, 1 <= D <= 256): forward, dq, dk/dv, and the
// backward's delta = rowsum(dout * out) - dlse (read by the dq and dk/dv passes with dropout, and
// by float64's always; the tensor-core kernels read it too).
//
// A thread block has 4 warps; a warp follows rows_per_warp (<= 4) rows of one head, one at a time,
// and a lane takes one of `other_tile` (<= 32) keys (queries for dk/dv) of the current step: it
// computes that pair's score with a dot product over D from shared memory, the warp combines the
// lanes' values with shuffles, and each lane accumulates output columns d = lane + 32 t. The rows'
// tiles and the other side's tiles are read from their dilated positions (strided addressing) and
// converted to the accumulation type acc_t (float, or double for float64) in shared memory.
// Pairs with probability 0 are skipped, as in the CPU kernel, so non-finite values only reach the
// rows that read them. As in the CPU kernel, every pass computes a pair's score as the same dot
// product, in the same order, times scale * log2 e (simt_score), so the backward's probabilities
// match the forward's lse, and float accumulators sum in levels (kSumSteps) whose error does not grow with
// the segment length. Attention dropout (p.drop) scales each lane's weight by its pair's factor
// (common.cuh da_dropout_factor): in the forward after the weight went into the denominator, in the
// backward dP and, for dV, P; P V and P^T dO skip a dropped weight as they skip a masked one.
//
// With float accumulators the backward's dS = P (dP - delta) is formed as the CPU kernels form it
// (docs/cpu-kernel.md): P (dout . (v - out) + dlse), v - out subtracted per column before the dot
// product with dout (simt_dot_sub), so that a row whose weight sits on one key (large logits),
// where v - out is tiny, gets a tiny error, where dout . v and delta, two dot products rounded
// apart, would leave ~2^-24 |dout| |v| of their difference in dS, times P ~ 1 (up to 6.5x SPEC
// section 4's rule in dq and dk at huge scores). With dropout, dP = M (dout . v) and dS = P (dP -
// delta) as before (out's rows in shared memory are then zeros: dout . (v - 0) is dout . v bit for
// bit). Double accumulators (float64) keep dP - delta, whose cancellation is 2^-53 |dout| |v|, and
// no out rows (simt_sub_out: their shared memory would leave no plan for float64 at head dim 256
// on sm_75, 192 on sm_60).
//
// Cost per (query, key) pair: forward 2 D multiply-adds; backward (dq pass + dk/dv pass) 5 D, and
// 2 D subtractions with float accumulators; with dropout, one Philox call more in each of the three
// passes.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common.cuh"

namespace dilated_attention {
namespace cuda {
namespace {

constexpr int kSimtThreads = 128;
constexpr int kSimtWarps = 4;
constexpr int kMaxRowsPerWarp = 4;
constexpr int kMaxCols = DA_MAX_HEAD_DIM / 32;  // accumulator columns per lane

// float accumulators sum in levels, so that their rounding error does not grow with the length of
// a segment (as the CPU kernel's): each step's products (up to 32) are summed afresh and added to a
// partial sum in registers; every kSumSteps steps of the walk (up to 512 keys or queries) the
// partial sum is folded into the row's total, kept in shared memory (each lane its own columns of
// its warp's rows: no barrier, no bank conflict), and started afresh. double accumulators (float64
// inputs) sum the steps in one level and need no totals.
constexpr int kSumSteps = 16;
template <typename acc_t>
struct TwoLevel {
  static constexpr bool value = sizeof(acc_t) == 4;
};

// The warp's rows of a total in shared memory (row stride D), each lane its own columns d = lane +
// 32 t, as everywhere the totals are touched: no barrier. Zeroed, or += part with part zeroed.
template <typename acc_t>
__device__ __forceinline__ void simt_zero_total(acc_t* tot, int64_t rpw, int64_t D, int lane) {
  for (int64_t i = 0; i < rpw; ++i)
    for (int64_t d = lane; d < D; d += 32) tot[i * D + d] = 0;
}
template <typename acc_t>
__device__ __forceinline__ void simt_fold_total(acc_t* tot, acc_t (&part)[kMaxRowsPerWarp][kMaxCols],
                                                int64_t rpw, int64_t D, int lane) {
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i)
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) {
      const int64_t d = lane + 32 * t;
      if (i < rpw && d < D) tot[i * D + d] += part[i][t];
      part[i][t] = 0;
    }
}

// Accumulator rows of the totals in shared memory: forward out, dq, dk and dv (float only).
template <typename acc_t>
__host__ __device__ inline int64_t simt_total_rows(int kernel) {
  return TwoLevel<acc_t>::value ? (kernel == kDkv ? 2 : 1) : 0;
}

// Shared-memory row stride for tiles read one row per lane: odd, so that the lanes' rows fall in
// different banks.
__host__ __device__ inline int simt_lds(int64_t D) {
  return (int)(D % 2 == 0 ? D + 1 : D);
}

// Whether the backward forms dP - delta as dout . (v - out) + dlse (float accumulators), with out's
// rows (dq) or tile (dk/dv) in shared memory, or as dout . v - delta (double).
template <typename acc_t>
__host__ __device__ constexpr bool simt_sub_out() {
  return sizeof(acc_t) == 4;
}

template <typename acc_t>
__host__ __device__ inline int64_t simt_smem_elems(int64_t D, int64_t rpw, int ot, int kernel) {
  const int64_t M = kSimtWarps * rpw, ld = simt_lds(D), totals = simt_total_rows<acc_t>(kernel) * M * D;
  const int64_t o = simt_sub_out<acc_t>() ? 1 : 0;
  switch (kernel) {
    case kFwd: return M * D + ot * ld + ot * D + totals;      // Q rows, K tile, V tile
    case kDq: return (2 + o) * M * D + 2 * ot * ld + totals;  // Q, dO (, out) rows; K, V tiles
    default:  // K, V rows; Q, dO (, out) tiles; lse hi, lo, lo2, delta (or -dlse)
      return 2 * M * D + (2 + o) * ot * ld + 4 * ot + totals;
  }
}

// Dot product of two rows of D values in shared memory.
template <typename acc_t>
__device__ __forceinline__ acc_t simt_dot(const acc_t* a, const acc_t* b, int64_t D) {
  acc_t s = 0;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// dout . (v - out) of rows in shared memory: dP less rowsum(dout * out), each column's difference
// rounded before its product (exact where v and out are within a factor 2 of each other).
template <typename acc_t>
__device__ __forceinline__ acc_t simt_dot_sub(const acc_t* dout, const acc_t* v, const acc_t* out,
                                              int64_t D) {
  acc_t s = 0;
  for (int64_t d = 0; d < D; ++d) s += dout[d] * (v[d] - out[d]);
  return s;
}

// Element `at` of the backward's out rows (simt_sub_out): scalar_t, or acc_t (p.out_f32, the float32
// out of a float16/bfloat16 call). 0 with dropout (dP = M dout . v, less delta: out is not read).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t simt_out_at(const Params& p, int64_t at) {
  if (p.drop.threshold != 0u) return (acc_t)0;
  return p.out_f32 ? static_cast<const acc_t*>(p.out.data)[at]
                   : (acc_t) static_cast<const scalar_t*>(p.out.data)[at];
}

// What the backward subtracts from a row's dP (dS = P (dP - dl)): delta = rowsum(dout * out) - dlse
// with dropout or double accumulators, else -dlse (dP then is dout . (v - out)), 0 without dlse.
template <typename acc_t>
__device__ __forceinline__ acc_t simt_row_dl(const Params& p, int64_t at) {
  if (!simt_sub_out<acc_t>() || p.drop.threshold != 0u) return static_cast<const acc_t*>(p.delta)[at];
  return p.dlse ? -static_cast<const acc_t*>(p.dlse)[at] : (acc_t)0;
}

// The largest head dim whose float scores sum in float (as the CPU kernel's: within SPEC section
// 4 up to D = 64 at large logits, not always above).
constexpr int64_t kFloatScoresMaxHeadDim = 64;

// Whether float scores sum in double (simt_score): on GPUs whose double multiply-add runs at half
// the float rate (sm_60 GP100, sm_70 V100, sm_80 A100, sm_90 H100/H200, sm_100 B200); elsewhere
// (GeForce/RTX parts, 1/32-1/64 of the float rate) in compensated float. The emulation runs either.
__device__ __forceinline__ bool simt_scores_in_double() {
#if defined(DA_CUDA_EMULATION)
  return !da_emu::options().compensated_scores;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 600 || __CUDA_ARCH__ == 700 || __CUDA_ARCH__ == 800 || \
                                 __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
  return true;
#else
  return false;
#endif
}

// Rounded float sum and difference, never contracted with a neighbouring product into an FMA
// (compensated sums depend on every rounding as written).
#if defined(DA_CUDA_EMULATION)
__device__ __forceinline__ float da_add_rn(float a, float b) {
  return a + b;
}
__device__ __forceinline__ float da_sub_rn(float a, float b) {
  return a - b;
}
#else
__device__ __forceinline__ float da_add_rn(float a, float b) {
  return __fadd_rn(a, b);
}
__device__ __forceinline__ float da_sub_rn(float a, float b) {
  return __fsub_rn(a, b);
}
#endif

// A pair's score: the dot product of two rows in shared memory times sl2 = scale * log2 e, the
// same bits in every pass. float rows sum their D products exactly enough to round once: in double
// (each product of two floats is exact there), or, where doubles are slow, in compensated float
// (each product split into its rounded value and its exact error by an FMA, summed with the
// error of every addition kept: Ogita, Rump and Oishi's Dot2). A float sum of the D products
// rounds D times, and at large logits that rounding, through the exps, is the largest part of the
// gradients' error (up to 2.5x plain PyTorch's at D = 256, past SPEC section 4's 2x). Cost: the D
// multiply-adds in double, or about 10 float operations per product. Head dims up to
// kFloatScoresMaxHeadDim sum in float.
template <typename acc_t>
__device__ __forceinline__ acc_t simt_score(const acc_t* a, const acc_t* b, int64_t D, acc_t sl2) {
  if constexpr (sizeof(acc_t) == 4) {
    if (D <= kFloatScoresMaxHeadDim) return da_mul_rn(simt_dot(a, b, D), sl2);
    if (simt_scores_in_double()) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s = fma((double)a[d], (double)b[d], s);
      return (float)(s * (double)sl2);
    }
    float s = 0, c = 0;
    for (int64_t d = 0; d < D; ++d) {
      const float x = a[d], y = b[d];
      const float p = da_mul_rn(x, y);
      const float e = fmaf(x, y, -p);  // x * y = p + e exactly
      const float t = da_add_rn(s, p);
      const float z = da_sub_rn(t, s);  // s + p = t + ((s - (t - z)) + (p - z)) exactly
      c = da_add_rn(c, da_add_rn(da_add_rn(da_sub_rn(s, da_sub_rn(t, z)), da_sub_rn(p, z)), e));
      s = t;
    }
    return da_mul_rn(da_add_rn(s, c), sl2);
  } else {
    return da_mul_rn(simt_dot(a, b, D), sl2);
  }
}

// Fills the fixed fields of a SIMT walk; the warp's rows are its rows_per_warp rows. The walk's
// integer type I (common.cuh Walk) is int32_t in the forward and the dk/dv pass: every index is below
// 2 N < 2^31 (tiling.h), a padding row's position is clamped to N before it is narrowed (every
// position at or past N means the same), and the kernels widen a position or head to int64_t before
// it enters an offset. ptxas, sm_80: the 64-bit walk spilled 20 bytes in the float dk/dv kernels and
// 96 in the float64 forward at the 168 registers it allots them; the dq kernel keeps int64_t (none
// spilled there, and its float64 kernel spilled 20 bytes on sm_90 with int32_t).
template <typename W>
__device__ __forceinline__ void simt_walk_init(W& w, const Params& p, int64_t N, int64_t base, int64_t last,
                                               int64_t h0, int G, int rows_are, int warp) {
  typedef decltype(w.N) I;  // int32_t: every index is below 2 N < 2^31 (tiling.h)
  w.N = (I)N;
  w.base = (I)base;
  w.last = (I)last;
  w.h0 = (I)h0;
  w.G = G;
  w.is_causal = p.is_causal;
  w.rows_are = rows_are;
  w.other_tile = p.other_tile;
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i)
    w.pos[i] = (I)(i < p.tiling.rows_per_warp ? da_min64(da_row_position(&p.tiling, base, warp, i), N) : N);
}

// Attention dropout's keep flags of the warp's rows (bit i: row i) against the lane's index
// o0 + lane of the other side, in the step's head bh; ~0u without dropout (common.cuh).
template <typename W>
__device__ __forceinline__ uint32_t simt_dropout_keep(const W& cur, const Params& p, int64_t bh,
                                                      int64_t start, int lane) {
  if (p.drop.threshold == 0u) return ~0u;
  return cur.dropout_keep(p.drop, bh, start, (int)p.tiling.rows_per_warp, [&](int i, int* slot, int* jj) {
    *slot = i;
    *jj = lane;
  });
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kSimtThreads) simt_fwd_kernel(const Params p) {
  DA_EXTERN_SMEM(smem_raw);
  const int64_t D = p.D, rpw = p.tiling.rows_per_warp, M = kSimtWarps * rpw;
  const int KT = p.other_tile, ld = simt_lds(D);
  acc_t* sQ = reinterpret_cast<acc_t*>(smem_raw);  // [M][D]
  acc_t* sK = sQ + M * D;                          // [KT][ld]
  acc_t* sV = sK + KT * ld;                        // [KT][D]
  acc_t* sO = sV + KT * D;                         // [M][D] the rows' totals (float only)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const int64_t base = da_tile_base(&p.tiling, blockIdx.x);
  if (base >= N) return;
  const int64_t last = da_tile_last(&p.tiling, base, N);
  const scalar_t* q = static_cast<const scalar_t*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn + h * p.q.sh;
  const scalar_t* k = static_cast<const scalar_t*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const scalar_t* v = static_cast<const scalar_t*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;
  const acc_t sl2 = (acc_t)(p.scale * DA_LOG2E);

  for (int64_t row = warp; row < M; row += kSimtWarps) {
    const int64_t x = da_row_position(&p.tiling, base, row / rpw, row % rpw);
    const scalar_t* src = x < N ? q + x * p.q.sn : nullptr;
    for (int64_t d = lane; d < D; d += 32) sQ[row * D + d] = src ? (acc_t)src[d] : (acc_t)0;
  }

  Walk<kMaxRowsPerWarp, int32_t> cur;
  simt_walk_init(cur, p, N, base, last, h, 1, DA_ROWS_ARE_QUERIES, warp);
  cur.start(p);

  // Partial state (m, l, acc) of the last kSumSteps steps and the rows' totals (mt, lt, and sO).
  acc_t m[kMaxRowsPerWarp], l[kMaxRowsPerWarp], acc[kMaxRowsPerWarp][kMaxCols];
  acc_t mt[kMaxRowsPerWarp], lt[kMaxRowsPerWarp];
  auto restart = [&]() {
#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      m[i] = -da_inf<acc_t>();
      l[i] = 0;
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) acc[i][t] = 0;
    }
  };
  // Folds the partial state into the totals (the CPU kernel's merge_tile), then starts afresh.
  auto fold = [&]() {
#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      if (l[i] == (acc_t)0) continue;  // only -inf scores (or no row): nothing to add
      acc_t* tot = sO + (warp * rpw + i) * D;
      const bool first = lt[i] == (acc_t)0;
      const acc_t mx = first ? m[i] : da_max(mt[i], m[i]);
      const acc_t ca = first ? (acc_t)0 : da_exp2(mt[i] - mx), cb = first ? (acc_t)1 : da_exp2(m[i] - mx);
      mt[i] = mx;
      lt[i] = first ? l[i] : lt[i] * ca + l[i] * cb;
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) {
        const int64_t d = lane + 32 * t;
        if (d < D) tot[d] = first ? acc[i][t] : tot[d] * ca + acc[i][t] * cb;
      }
    }
    restart();
  };
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    mt[i] = -da_inf<acc_t>();
    lt[i] = 0;
  }
  restart();

  int steps = 0;  // the same in every thread
  while (!cur.done) {
    if (TwoLevel<acc_t>::value && steps > 0 && steps % kSumSteps == 0) fold();
    ++steps;
    __syncthreads();  // the previous step's tiles are no longer read
    for (int64_t idx = threadIdx.x; idx < (int64_t)KT * D; idx += kSimtThreads) {
      const int jj = (int)(idx / D);
      const int64_t d = idx % D;
      const int j = cur.o0 + jj;
      acc_t kv = 0, vv = 0;
      if (j < cur.o_end) {
        const int64_t x = cur.other_position(j);
        kv = (acc_t)k[x * p.k.sn + d];
        vv = (acc_t)v[x * p.v.sn + d];
      }
      sK[jj * ld + d] = kv;
      sV[jj * D + d] = vv;
    }
    const uint32_t keep = simt_dropout_keep(cur, p, b * p.Hq + h, sq.start, lane);
    __syncthreads();

#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      if (cur.jrow[i] < 0) continue;  // same for the whole warp
      const int j = cur.o0 + lane;
      const bool ok = lane < KT && cur.pair_active(cur.jrow[i], j);
      const acc_t s = ok ? simt_score(sQ + (warp * rpw + i) * D, sK + lane * ld, D, sl2) : -da_inf<acc_t>();
      const acc_t m_new = da_max(m[i], warp_max(s));
      const acc_t m_use = m_new == -da_inf<acc_t>() ? (acc_t)0 : m_new;
      const acc_t corr = da_exp2(m[i] - m_use);
      m[i] = m_new;
      const acc_t pr = da_exp2(s - m_use);
      l[i] = l[i] * corr + warp_sum(pr);                                // the weights before dropout
      const acc_t pd = pr * da_dropout_factor<acc_t>(p.drop, keep, i);  // and after
      acc_t step[kMaxCols];                                             // this step's P V, summed afresh
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) step[t] = 0;
      for (int jj = 0; jj < KT; ++jj) {
        const acc_t pj = __shfl_sync(DA_FULL_MASK, pd, jj);
        if (pj == (acc_t)0) continue;
#pragma unroll
        for (int t = 0; t < kMaxCols; ++t) {
          const int64_t d = lane + 32 * t;
          if (d < D) step[t] += pj * sV[jj * D + d];
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) acc[i][t] = acc[i][t] * corr + step[t];
    }
    cur.next(p.br);
  }
  if (TwoLevel<acc_t>::value) fold();

  // out rows of scalar_t, or of acc_t (p.out_f32): offsets in elements of either
  scalar_t* out =
      p.out_f32 ? reinterpret_cast<scalar_t*>(static_cast<acc_t*>(p.out.data) + b * p.out.sb +
                                              sq.start * p.out.sn + h * p.out.sh)
                : static_cast<scalar_t*>(p.out.data) + b * p.out.sb + sq.start * p.out.sn + h * p.out.sh;
  const int64_t lse_row = (b * p.Hq + h) * p.N + sq.start;
  const double unit = da_score_unit(p.scale, sl2);
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    const int64_t x = cur.pos[i];
    if (x >= N) continue;
    const acc_t mf = TwoLevel<acc_t>::value ? mt[i] : m[i], lf = TwoLevel<acc_t>::value ? lt[i] : l[i];
    const bool empty = lf == (acc_t)0;
    const acc_t inv = empty ? (acc_t)0 : (acc_t)1 / lf;
    const acc_t* tot = sO + (warp * rpw + i) * D;
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < D) {
        const acc_t a = TwoLevel<acc_t>::value ? tot[d] : acc[i][t];
        const acc_t o = empty ? (acc_t)0 : a * inv;
        if (p.out_f32)
          reinterpret_cast<acc_t*>(out)[x * p.out.sn + d] = o;
        else
          out[x * p.out.sn + d] = (scalar_t)o;
      }
    }
    if (lane == 0)
      da_set_lse<acc_t>(p, lse_row + x, empty ? -(double)INFINITY : da_lse_natural(mf, lf, unit));
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: delta, dq, dk/dv                                                                   */
/* ------------------------------------------------------------------------------------------ */

// delta[b, h, n] = sum_d dout * out - dlse, one warp per row; out of scalar_t, or of acc_t (p.out_f32).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kSimtThreads) delta_kernel_impl(const Params p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t rows = p.B * p.N * p.Hq;
  const scalar_t* dout = static_cast<const scalar_t*>(p.dout.data);
  const scalar_t* out = static_cast<const scalar_t*>(p.out.data);
  const acc_t* out_acc = static_cast<const acc_t*>(p.out.data);
  const acc_t* dlse = static_cast<const acc_t*>(p.dlse);
  acc_t* delta = static_cast<acc_t*>(p.delta);
  for (int64_t row = (int64_t)blockIdx.x * kSimtWarps + warp; row < rows;
       row += (int64_t)gridDim.x * kSimtWarps) {
    const int64_t h = row % p.Hq, n = (row / p.Hq) % p.N, b = row / (p.Hq * p.N);
    const scalar_t* x = dout + b * p.dout.sb + n * p.dout.sn + h * p.dout.sh;
    const int64_t y = b * p.out.sb + n * p.out.sn + h * p.out.sh;
    acc_t s = 0;
    for (int64_t d = lane; d < p.D; d += 32)
      s += (acc_t)x[d] * (p.out_f32 ? out_acc[y + d] : (acc_t)out[y + d]);
    s = warp_sum(s);
    const int64_t at = (b * p.Hq + h) * p.N + n;
    if (lane == 0) delta[at] = s - (dlse ? dlse[at] : (acc_t)0);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kSimtThreads) simt_dq_kernel(const Params p) {
  DA_EXTERN_SMEM(smem_raw);
  const int64_t D = p.D, rpw = p.tiling.rows_per_warp, M = kSimtWarps * rpw;
  const int KT = p.other_tile, ld = simt_lds(D);
  acc_t* sQ = reinterpret_cast<acc_t*>(smem_raw);        // [M][D]
  acc_t* sdO = sQ + M * D;                               // [M][D]
  acc_t* sO = sdO + M * D;                               // [M][D] out (simt_sub_out; zeros with dropout)
  acc_t* sK = sO + (simt_sub_out<acc_t>() ? M * D : 0);  // [KT][ld]
  acc_t* sV = sK + KT * ld;                              // [KT][ld]
  acc_t* sDq = sV + KT * ld;                             // [M][D] the rows' totals (float only)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const int64_t base = da_tile_base(&p.tiling, blockIdx.x);
  if (base >= N) return;
  const int64_t last = da_tile_last(&p.tiling, base, N);
  const scalar_t* q = static_cast<const scalar_t*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn + h * p.q.sh;
  const scalar_t* dout =
      static_cast<const scalar_t*>(p.dout.data) + b * p.dout.sb + sq.start * p.dout.sn + h * p.dout.sh;
  const scalar_t* k = static_cast<const scalar_t*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const scalar_t* v = static_cast<const scalar_t*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;
  const int64_t lse_row = (b * p.Hq + h) * p.N + sq.start;
  const int64_t out_row = b * p.out.sb + sq.start * p.out.sn + h * p.out.sh;
  const acc_t sl2 = (acc_t)(p.scale * DA_LOG2E);

  for (int64_t row = warp; row < M; row += kSimtWarps) {
    const int64_t x = da_row_position(&p.tiling, base, row / rpw, row % rpw);
    const bool ok = x < N;
    for (int64_t d = lane; d < D; d += 32) {
      sQ[row * D + d] = ok ? (acc_t)q[x * p.q.sn + d] : (acc_t)0;
      sdO[row * D + d] = ok ? (acc_t)dout[x * p.dout.sn + d] : (acc_t)0;
      if constexpr (simt_sub_out<acc_t>())
        sO[row * D + d] = ok ? simt_out_at<scalar_t, acc_t>(p, out_row + x * p.out.sn + d) : (acc_t)0;
    }
  }

  Walk<kMaxRowsPerWarp> cur;
  simt_walk_init(cur, p, N, base, last, h, 1, DA_ROWS_ARE_QUERIES, warp);
  cur.start(p);

  // dq: the partial sum of the last kSumSteps steps; sDq: the rows' totals.
  const double unit = da_score_unit(p.scale, sl2);
  acc_t lse2[kMaxRowsPerWarp], lse2lo[kMaxRowsPerWarp], lse2lo2[kMaxRowsPerWarp], dl[kMaxRowsPerWarp],
      dq[kMaxRowsPerWarp][kMaxCols];
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    const int64_t x = cur.pos[i];
    lse2[i] =
        da_lse_base2<acc_t>(x < N ? da_get_lse<acc_t>(p, lse_row + x) : 0.0, unit, &lse2lo[i], &lse2lo2[i]);
    dl[i] = x < N ? simt_row_dl<acc_t>(p, lse_row + x) : (acc_t)0;
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) dq[i][t] = 0;
  }
  const int64_t my_rows = (int64_t)warp * rpw * D;  // this warp's rows of the totals
  if (TwoLevel<acc_t>::value) simt_zero_total(sDq + my_rows, rpw, D, lane);
  auto fold = [&]() { simt_fold_total(sDq + my_rows, dq, rpw, D, lane); };

  int steps = 0;  // the same in every thread
  while (!cur.done) {
    if (TwoLevel<acc_t>::value && steps > 0 && steps % kSumSteps == 0) fold();
    ++steps;
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < (int64_t)KT * D; idx += kSimtThreads) {
      const int jj = (int)(idx / D);
      const int64_t d = idx % D;
      const int j = cur.o0 + jj;
      acc_t kv = 0, vv = 0;
      if (j < cur.o_end) {
        const int64_t x = cur.other_position(j);
        kv = (acc_t)k[x * p.k.sn + d];
        vv = (acc_t)v[x * p.v.sn + d];
      }
      sK[jj * ld + d] = kv;
      sV[jj * ld + d] = vv;
    }
    const uint32_t keep = simt_dropout_keep(cur, p, b * p.Hq + h, sq.start, lane);
    __syncthreads();

#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      if (cur.jrow[i] < 0) continue;
      const int j = cur.o0 + lane;
      const bool ok = lane < KT && cur.pair_active(cur.jrow[i], j);
      acc_t ds = 0;
      if (ok) {
        const int64_t row = warp * rpw + i;
        const acc_t s = simt_score(sQ + row * D, sK + lane * ld, D, sl2);
        const acc_t dp =
            (simt_sub_out<acc_t>() ? simt_dot_sub(sdO + row * D, sV + lane * ld, sO + row * D, D)
                                   : simt_dot(sdO + row * D, sV + lane * ld, D)) *
            da_dropout_factor<acc_t>(p.drop, keep, i);  // dO (V - O)^T or dO V^T; dropout: M dO V^T
        const acc_t pr = da_exp2(da_exponent(s, lse2[i], lse2lo[i], lse2lo2[i]));
        ds = pr * (dp - dl[i]);
      }
      acc_t step[kMaxCols];  // this step's dS K, summed afresh
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) step[t] = 0;
      for (int jj = 0; jj < KT; ++jj) {
        const acc_t c = __shfl_sync(DA_FULL_MASK, ds, jj);
        if (c == (acc_t)0) continue;
#pragma unroll
        for (int t = 0; t < kMaxCols; ++t) {
          const int64_t d = lane + 32 * t;
          if (d < D) step[t] += c * sK[jj * ld + d];
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) dq[i][t] += step[t];
    }
    cur.next(p.br);
  }
  if (TwoLevel<acc_t>::value) fold();

  scalar_t* dqp = static_cast<scalar_t*>(p.dq.data) + b * p.dq.sb + sq.start * p.dq.sn + h * p.dq.sh;
  const acc_t scale = (acc_t)p.scale;
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    const int64_t x = cur.pos[i];
    if (x >= N) continue;
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < D)
        dqp[x * p.dq.sn + d] =
            (scalar_t)((TwoLevel<acc_t>::value ? sDq[my_rows + i * D + d] : dq[i][t]) * scale);
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kSimtThreads) simt_dkv_kernel(const Params p) {
  DA_EXTERN_SMEM(smem_raw);
  const int64_t D = p.D, rpw = p.tiling.rows_per_warp, M = kSimtWarps * rpw;
  const int QT = p.other_tile, ld = simt_lds(D);
  acc_t* sK = reinterpret_cast<acc_t*>(smem_raw);          // [M][D]
  acc_t* sV = sK + M * D;                                  // [M][D]
  acc_t* sQ = sV + M * D;                                  // [QT][ld]
  acc_t* sdO = sQ + QT * ld;                               // [QT][ld]
  acc_t* sO = sdO + QT * ld;                               // [QT][ld] out (simt_sub_out; zeros with dropout)
  acc_t* sL = sO + (simt_sub_out<acc_t>() ? QT * ld : 0);  // [QT] lse, log2 domain (hi)
  acc_t* sLlo = sL + QT;                                   // [QT] and its low parts (da_lse_base2)
  acc_t* sLlo2 = sLlo + QT;                                // [QT]
  acc_t* sDl = sLlo2 + QT;                                 // [QT] delta or -dlse (simt_row_dl)
  acc_t* sDk = sDl + QT;                                   // [M][D] the rows' totals of dk (float only)
  acc_t* sDv = sDk + M * D;                                // [M][D] and of dv

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_KEYS);
  const int64_t N = sq.N, b = sq.b, hk = blockIdx.y;
  const int64_t base = da_tile_base(&p.tiling, blockIdx.x);
  if (base >= N) return;
  const int64_t last = da_tile_last(&p.tiling, base, N);
  const scalar_t* k = static_cast<const scalar_t*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const scalar_t* v = static_cast<const scalar_t*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;
  const scalar_t* q_all = static_cast<const scalar_t*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn;
  const scalar_t* do_all = static_cast<const scalar_t*>(p.dout.data) + b * p.dout.sb + sq.start * p.dout.sn;
  const int64_t lse_all = b * p.Hq * p.N + sq.start;
  const int64_t out_all = b * p.out.sb + sq.start * p.out.sn;
  const acc_t sl2 = (acc_t)(p.scale * DA_LOG2E);
  const double unit = da_score_unit(p.scale, sl2);

  for (int64_t row = warp; row < M; row += kSimtWarps) {
    const int64_t x = da_row_position(&p.tiling, base, row / rpw, row % rpw);
    const bool ok = x < N;
    for (int64_t d = lane; d < D; d += 32) {
      sK[row * D + d] = ok ? (acc_t)k[x * p.k.sn + d] : (acc_t)0;
      sV[row * D + d] = ok ? (acc_t)v[x * p.v.sn + d] : (acc_t)0;
    }
  }

  Walk<kMaxRowsPerWarp, int32_t> cur;
  simt_walk_init(cur, p, N, base, last, hk * p.G, (int)p.G, DA_ROWS_ARE_KEYS, warp);
  cur.start(p);

  // dk, dv: the partial sums of the last kSumSteps steps; sDk, sDv: the rows' totals.
  acc_t dk[kMaxRowsPerWarp][kMaxCols], dv[kMaxRowsPerWarp][kMaxCols];
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i)
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) dk[i][t] = dv[i][t] = 0;
  const int64_t my_rows = (int64_t)warp * rpw * D;  // this warp's rows of the totals
  if (TwoLevel<acc_t>::value) {
    simt_zero_total(sDk + my_rows, rpw, D, lane);
    simt_zero_total(sDv + my_rows, rpw, D, lane);
  }
  auto fold = [&]() {
    simt_fold_total(sDk + my_rows, dk, rpw, D, lane);
    simt_fold_total(sDv + my_rows, dv, rpw, D, lane);
  };

  int steps = 0;  // the same in every thread
  while (!cur.done) {
    if (TwoLevel<acc_t>::value && steps > 0 && steps % kSumSteps == 0) fold();
    ++steps;
    __syncthreads();
    const int64_t h = cur.head();
    const scalar_t* q = q_all + h * p.q.sh;
    const scalar_t* dout = do_all + h * p.dout.sh;
    const int64_t out_h = out_all + h * p.out.sh;
    for (int64_t idx = threadIdx.x; idx < (int64_t)QT * D; idx += kSimtThreads) {
      const int jj = (int)(idx / D);
      const int64_t d = idx % D;
      const int j = cur.o0 + jj;
      acc_t qv = 0, dv_ = 0, ov = 0;
      if (j < cur.o_end) {
        const int64_t x = cur.other_position(j);
        qv = (acc_t)q[x * p.q.sn + d];
        dv_ = (acc_t)dout[x * p.dout.sn + d];
        if constexpr (simt_sub_out<acc_t>()) ov = simt_out_at<scalar_t, acc_t>(p, out_h + x * p.out.sn + d);
      }
      sQ[jj * ld + d] = qv;
      sdO[jj * ld + d] = dv_;
      if constexpr (simt_sub_out<acc_t>()) sO[jj * ld + d] = ov;
    }
    for (int jj = threadIdx.x; jj < QT; jj += kSimtThreads) {
      const int j = cur.o0 + jj;
      acc_t L = da_inf<acc_t>(), lo = 0, lo2 = 0, dlt = 0;
      if (j < cur.o_end) {
        const int64_t x = cur.other_position(j);
        L = da_lse_base2<acc_t>(da_get_lse<acc_t>(p, lse_all + h * p.N + x), unit, &lo, &lo2);
        dlt = simt_row_dl<acc_t>(p, lse_all + h * p.N + x);
      }
      sL[jj] = L;
      sLlo[jj] = lo;
      sLlo2[jj] = lo2;
      sDl[jj] = dlt;
    }
    const uint32_t keep = simt_dropout_keep(cur, p, b * p.Hq + h, sq.start, lane);
    __syncthreads();

#pragma unroll
    for (int i = 0; i < kMaxRowsPerWarp; ++i) {
      if (cur.jrow[i] < 0) continue;
      const int j = cur.o0 + lane;
      const bool ok = lane < QT && cur.pair_active(cur.jrow[i], j);
      acc_t pr = 0, ds = 0;
      if (ok) {
        const int64_t row = warp * rpw + i;
        const acc_t s = simt_score(sQ + lane * ld, sK + row * D, D, sl2);  // the forward's, bit for bit
        const acc_t dp = simt_sub_out<acc_t>()
                             ? simt_dot_sub(sdO + lane * ld, sV + row * D, sO + lane * ld, D)
                             : simt_dot(sV + row * D, sdO + lane * ld, D);  // dO (V - O)^T, or dO V^T
        const acc_t f = da_dropout_factor<acc_t>(p.drop, keep, i);  // dropout: M dO V^T, and P M for dV
        pr = da_exp2(da_exponent(s, sL[lane], sLlo[lane], sLlo2[lane]));
        ds = pr * (dp * f - sDl[lane]);
        pr *= f;
      }
      acc_t step_k[kMaxCols], step_v[kMaxCols];  // this step's dS^T Q and P^T dO, summed afresh
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) step_k[t] = step_v[t] = 0;
      for (int jj = 0; jj < QT; ++jj) {
        const acc_t a = __shfl_sync(DA_FULL_MASK, pr, jj);
        const acc_t c = __shfl_sync(DA_FULL_MASK, ds, jj);
        if (a != (acc_t)0) {
#pragma unroll
          for (int t = 0; t < kMaxCols; ++t) {
            const int64_t d = lane + 32 * t;
            if (d < D) step_v[t] += a * sdO[jj * ld + d];
          }
        }
        if (c != (acc_t)0) {
#pragma unroll
          for (int t = 0; t < kMaxCols; ++t) {
            const int64_t d = lane + 32 * t;
            if (d < D) step_k[t] += c * sQ[jj * ld + d];
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kMaxCols; ++t) {
        dk[i][t] += step_k[t];
        dv[i][t] += step_v[t];
      }
    }
    cur.next(p.br);
  }
  if (TwoLevel<acc_t>::value) fold();

  scalar_t* dkp = static_cast<scalar_t*>(p.dk.data) + b * p.dk.sb + sq.start * p.dk.sn + hk * p.dk.sh;
  scalar_t* dvp = static_cast<scalar_t*>(p.dv.data) + b * p.dv.sb + sq.start * p.dv.sn + hk * p.dv.sh;
  const acc_t scale = (acc_t)p.scale;  // dk = softmax_scale * dS^T q
#pragma unroll
  for (int i = 0; i < kMaxRowsPerWarp; ++i) {
    const int64_t x = cur.pos[i];
    if (x >= N) continue;
#pragma unroll
    for (int t = 0; t < kMaxCols; ++t) {
      const int64_t d = lane + 32 * t;
      if (d < D) {
        const bool two = TwoLevel<acc_t>::value;
        dkp[x * p.dk.sn + d] = (scalar_t)((two ? sDk[my_rows + i * D + d] : dk[i][t]) * scale);
        dvp[x * p.dv.sn + d] = (scalar_t)(two ? sDv[my_rows + i * D + d] : dv[i][t]);
      }
    }
  }
}

#ifndef DA_CUDA_EMULATION  // the CPU emulation of the tests calls the kernels itself

// `opt_in` belongs to the kernel: a function-local static of simt_run (launch.h).
template <typename Kernel>
void simt_launch(Kernel kernel, dim3 grid, int smem, const Params& p, cudaStream_t stream,
                 SmemOptIn& opt_in) {
  if (!smem_opt_in(opt_in, kernel, smem)) return;  // no launch; the caller's launch check raises the error
  kernel<<<grid, kSimtThreads, smem, stream>>>(p);
}

template <typename scalar_t, typename acc_t>
void simt_run(const Params& p, int kernel, cudaStream_t stream) {
  const int smem = (int)(simt_smem_elems<acc_t>(p.D, p.tiling.rows_per_warp, p.other_tile, kernel) *
                         (int64_t)sizeof(acc_t));
  const unsigned tiles = (unsigned)da_num_tiles(&p.tiling);
  static SmemOptIn opt_in[3];  // one per kernel of this dtype
  switch (kernel) {
    case kFwd:
      simt_launch(simt_fwd_kernel<scalar_t, acc_t>, dim3(tiles, (unsigned)p.Hq, (unsigned)p.num_seqs), smem,
                  p, stream, opt_in[kFwd]);
      break;
    case kDq:
      simt_launch(simt_dq_kernel<scalar_t, acc_t>, dim3(tiles, (unsigned)p.Hq, (unsigned)p.num_seqs), smem, p,
                  stream, opt_in[kDq]);
      break;
    default:
      simt_launch(simt_dkv_kernel<scalar_t, acc_t>, dim3(tiles, (unsigned)p.Hkv, (unsigned)p.num_seqs), smem,
                  p, stream, opt_in[kDkv]);
      break;
  }
}

template <typename F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::kHalf: f(c10::Half(), float()); break;
    case DType::kBFloat16: f(c10::BFloat16(), float()); break;
    case DType::kFloat: f(float(), float()); break;
    default: f(double(), double()); break;
  }
}

#endif  // DA_CUDA_EMULATION

}  // namespace

int simt_smem_bytes(int64_t D, DType t, int64_t rows_per_warp, int other_tile, int kernel) {
  const int64_t elems = t == DType::kDouble
                            ? simt_smem_elems<double>(D, rows_per_warp, other_tile, kernel) * 8
                            : simt_smem_elems<float>(D, rows_per_warp, other_tile, kernel) * 4;
  return (int)elems;
}

#ifndef DA_CUDA_EMULATION

void simt_fwd(const Params& p, DType t, cudaStream_t stream) {
  dispatch_dtype(t, [&](auto s, auto a) { simt_run<decltype(s), decltype(a)>(p, kFwd, stream); });
}

void simt_dq(const Params& p, DType t, cudaStream_t stream) {
  dispatch_dtype(t, [&](auto s, auto a) { simt_run<decltype(s), decltype(a)>(p, kDq, stream); });
}

void simt_dkv(const Params& p, DType t, cudaStream_t stream) {
  dispatch_dtype(t, [&](auto s, auto a) { simt_run<decltype(s), decltype(a)>(p, kDkv, stream); });
}

void delta_kernel(const Params& p, DType t, cudaStream_t stream) {
  const int64_t rows = p.B * p.N * p.Hq;
  const unsigned blocks = (unsigned)da_min64(da_ceil_div(rows, kSimtWarps), (int64_t)1 << 20);
  dispatch_dtype(t, [&](auto s, auto a) {
    delta_kernel_impl<decltype(s), decltype(a)><<<blocks, kSimtThreads, 0, stream>>>(p);
  });
}

#endif  // DA_CUDA_EMULATION

}  // namespace cuda
}  // namespace dilated_attention
