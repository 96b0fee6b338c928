// Tensor-core kernels (sm80+, float16 and bfloat16): forward, dq, and dk/dv.
//
// Each thread block has 4 warps and owns 64 rows of one head (see tiling.h): queries for the
// forward and dq, keys for dk/dv. A warp computes 16 rows with mma.sync m16n8k16 (f32
// accumulators) from shared-memory tiles read by ldmatrix; tiles of the other side (keys, or
// queries) are read from their dilated positions by cp.async straight from q/k/v (strided
// addressing, no gathered copies) into a double buffer, so that the next tile loads while the
// current one is computed. The head dimension is padded to DP (a multiple of 32) with zeros.
//
// Forward: one online softmax per row over every key of every branch (FlashAttention 2's loop,
// run over the walk of tiling.h instead of one key range): S = Q K^T, P = exp2(S * scale * log2 e
// - m), O += P V; out = O / l, lse = (m + log2 l) ln 2.
//   Cost: 4 * DP * (pairs, rounded up to the 64 x KT tiles of the active warps) FLOPs.
// Backward, deterministic by construction (no atomics):
//   dq pass (rows = queries): P = exp(S - lse), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
//   dk/dv pass (rows = keys, over the G query heads of the key's group): the same P and dS,
//   transposed, dV += P^T dO, dK += dS^T Q. Head dims above 128 split the dK/dV columns over
//   two thread blocks (each recomputes P and dS) to keep the accumulators in registers.
//   Cost: 7 matrix products per (row tile, key tile) for the two passes together, against the
//   forward's 2 (3.5 x; an atomic-dq backward would do 5 but would not be reproducible).
//
// Masking: a pair is computed only if the branch contains it (pair_active). Tiles where every row
// of a warp is active, the tile is full and causal order holds everywhere skip the mask; a warp
// with no active row skips the tile. Masked probabilities are exactly 0; in a masked chunk whose
// B tile (v, k, or q and dout) holds an inf or NaN, the product with them is summed on CUDA cores
// without the zero probabilities (tc_gemm_pb_masked), so the value reaches only its readers.
// lse is formed in double and read back into base 2 in double (common.cuh).
//
// Attention dropout (p.drop, common.cuh da_dropout_factor): the forward multiplies P by the pairs'
// keep flags after its row sums went into l (lse is that before dropout) and the output by
// 1 / (1 - p) when it stores it; the dq pass multiplies dP by the factors, the dk/dv pass dP and,
// for dV, P. One Philox call per element of the thread's fragments, in the
// kernels' instantiations with DROPOUT = true only (tc_dropout): those without are the kernels as
// they were, with their registers.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace dilated_attention {
namespace cuda {

constexpr int kTcWarps = 4;
constexpr int kTcThreads = 128;
constexpr int kTcRows = 64;  // rows per thread block, 16 per warp

// Padded head dimension of the tensor-core kernels.
inline int tc_padded_dim(int64_t D) {
  return D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : D <= 192 ? 192 : 256;
}

template <int DP>
struct TcFwdCfg {
  static constexpr int LDS = DP + 8;  // shared-memory row stride (elements): conflict-free ldmatrix
  static constexpr int KT = DP <= 128 ? 64 : (DP <= 192 ? 32 : 16);  // keys per step
  static constexpr int STAGES = 2;
  static constexpr int SMEM = (kTcRows * LDS + STAGES * 2 * KT * LDS) * 2;
};

template <int DP>
struct TcDqCfg {
  static constexpr int LDS = DP + 8;
  static constexpr int KT = DP <= 96 ? 64 : (DP <= 128 ? 32 : 16);
  static constexpr int STAGES = DP <= 192 ? 2 : 1;
  static constexpr int SMEM = (2 * kTcRows * LDS + STAGES * 2 * KT * LDS) * 2;
};

template <int DP>
struct TcDkvCfg {
  static constexpr int LDS = DP + 8;
  static constexpr int QT = DP <= 64 ? 64 : (DP <= 128 ? 32 : 16);  // queries per step
  static constexpr int STAGES = DP <= 192 ? 2 : 1;
  static constexpr int DC = DP <= 128 ? DP : DP / 2;  // accumulator columns per thread block
  static constexpr int CHUNKS = DP / DC;
  static constexpr int SMEM =
      (2 * kTcRows * LDS + STAGES * 2 * QT * LDS) * 2 + STAGES * 3 * QT * (int)sizeof(float);
};

// Loads `rows` rows of DP columns (D of them real) into a shared tile of stride LDS with
// cp.async; row_offset(i) gives the element offset of row i in src or -1 for a zero row.
template <typename T, int DP, int LDS, typename RowOffset>
__device__ __forceinline__ void tc_load_rows(T* dst, const T* src, int rows, int64_t D,
                                             RowOffset row_offset) {
  constexpr int CH = DP / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < rows * CH; idx += kTcThreads) {
    const int row = idx / CH, ch = idx % CH;
    const int64_t off = row_offset(row);
    const bool ok = off >= 0 && ch * 8 < D;
    cp_async16(dst + row * LDS + ch * 8, ok ? src + off + ch * 8 : src, ok);
  }
}

// The thread's two rows: row g and g + 8 of its warp's 16.
__device__ __forceinline__ void tc_thread_rows(const da_tiling& tl, int64_t base, int warp, int lane,
                                               int64_t (&pos)[2]) {
  pos[0] = da_row_position(&tl, base, warp, lane >> 2);
  pos[1] = da_row_position(&tl, base, warp, (lane >> 2) + 8);
}

// The same for a 32-bit walk (the sm90 consumers): a padding row's position, which may pass 2^31
// (base + 127 R with R up to 2^30), is clamped to N in 64 bits before it is narrowed (Walk), as
// every position at or past N means the same.
__device__ __forceinline__ void tc_thread_rows(const da_tiling& tl, int64_t base, int warp, int lane,
                                               int64_t N, int32_t (&pos)[2]) {
  pos[0] = (int32_t)da_min64(da_row_position(&tl, base, warp, lane >> 2), N);
  pos[1] = (int32_t)da_min64(da_row_position(&tl, base, warp, (lane >> 2) + 8), N);
}

// A walk over the rows of a thread block from `base` (tiling.h), its thread following the rows of
// pos: over head h0 (G = 1) or the G query heads from h0 (dk/dv), `other_tile` indices of the other
// side per step; before its first segment (start or adopt moves it).
template <int ROWS, typename I = int64_t>
__device__ __forceinline__ Walk<ROWS, I> tc_walk_init(const Params& p, const da_tiling& tl, int64_t N,
                                                      int64_t base, int64_t h0, int G, int rows_are,
                                                      int other_tile) {
  Walk<ROWS, I> w;
  w.N = (I)N;  // (I = int32_t: every index is below 2 N < 2^31, tiling.h)
  w.base = (I)base;
  w.last = (I)da_tile_last(&tl, base, N);
  w.h0 = (I)h0;
  w.G = G;
  w.is_causal = p.is_causal;
  w.rows_are = rows_are;
  w.other_tile = other_tile;
  w.begin(p);
  return w;
}

// The walk of a thread block of 64 rows, its threads following their two rows (tc_thread_rows).
// Block-wide (the walk may synchronise).
__device__ __forceinline__ Walk<2> tc_walk_start(const Params& p, const da_tiling& tl, int64_t N,
                                                 int64_t base, int64_t h0, int G, int rows_are,
                                                 int other_tile, int warp, int lane) {
  Walk<2> w = tc_walk_init<2>(p, tl, N, base, h0, G, rows_are, other_tile);
  tc_thread_rows(tl, base, warp, lane, w.pos);
  w.find(p.br);
  return w;
}

// S (16 x 8*NT per warp) = A_rows (16 x DP, from sA at warp rows) * B^T (B rows = sB rows).
template <typename T, int DP, int LDS, int NT>
__device__ __forceinline__ void tc_gemm_abt(float (&S)[NT][4], const T* sA, const T* sB, int warp, int lane,
                                            int64_t D) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    if (kk * 16 < D) {  // columns past D are zero padding
      uint32_t a[4];
      ldsm_x4(a, a_frag_addr(sA, LDS, warp * 16, kk * 16, lane));
#pragma unroll
      for (int nn = 0; nn < NT / 2; ++nn) {
        uint32_t b[4];
        ldsm_x4(b, bt_frag_addr(sB, LDS, nn * 16, kk * 16, lane));
        mma16816<T>(S[2 * nn], a, b[0], b[1]);
        mma16816<T>(S[2 * nn + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc (16 x 8*CT per warp) += P (16 x 8*NT, f32 C fragments) * sB[rows 0..8*NT, cols c0..c0+8*CT]
template <typename T, int LDS, int NT, int CT>
__device__ __forceinline__ void tc_gemm_pb(float (&acc)[CT][4], const float (&P)[NT][4], const T* sB, int c0,
                                           int lane, int64_t D) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4];
    c_to_a<T>(a, P[2 * kk], P[2 * kk + 1]);
#pragma unroll
    for (int dn = 0; dn < CT / 2; ++dn) {
      if (c0 + dn * 16 < D) {
        uint32_t b[4];
        ldsm_x4_t(b, b_frag_addr(sB, LDS, kk * 16, c0 + dn * 16, lane));
        mma16816<T>(acc[2 * dn], a, b[0], b[1]);
        mma16816<T>(acc[2 * dn + 1], a, b[2], b[3]);
      }
    }
  }
}

// Whether a shared tile of `rows` rows x DP columns (stride LDS) holds an inf or NaN, in every lane
// of the warp: 16-byte reads, an exponent of all ones in either half of a 32-bit word.
// Cost: rows * DP / 256 16-byte reads per lane.
template <typename T, int DP, int LDS>
__device__ __forceinline__ bool tc_tile_nonfinite(const T* tile, int rows, int lane) {
  constexpr uint32_t kExp = sizeof(T) == 2 && std::is_same<T, __half>::value ? 0x7c007c00u : 0x7f807f80u;
  constexpr uint32_t kLo = kExp & 0xffffu, kHi = kExp & 0xffff0000u;
  constexpr int CH = DP / 8;
  bool bad = false;
  for (int idx = lane; idx < rows * CH; idx += 32) {
    const uint4 w = *reinterpret_cast<const uint4*>(tile + (idx / CH) * LDS + (idx % CH) * 8);
    const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) bad |= (x[u] & kLo) == kLo || (x[u] & kHi) == kHi;
  }
  return __any_sync(DA_FULL_MASK, bad);
}

// x, hidden from the compiler's analysis where it is taken (an empty volatile asm): what is computed
// from it is computed there, not hoisted out of the loop around it and held in registers.
__device__ __forceinline__ int tc_opaque(int x) {
#if !defined(DA_CUDA_EMULATION)
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
#endif
  return x;
}

// tc_gemm_pb for a chunk with masked pairs whose B tile holds a non-finite value: the same sum
// with CUDA cores, skipping the pairs whose P is exactly 0, so that an inf or NaN of B reaches only
// the rows that read it (no 0 * inf of the matrix product; the CPU and SIMT kernels do the same).
// P[row][key] of the warp's rows g and g + 8 comes from lane 4g + key % 8 / 2 by shuffles. Rare:
// only for chunks that need the mask and hold a non-finite value. Inlined: an out-of-line call
// would take the accumulators out of registers (the call passes them through memory).
// b_at(key, d) is element d of the key's row of B (a shared tile in any layout). OPAQUE: the
// thread's columns (c0 + 2 tq + 8 ct + f) are computed where they are used, from a first column
// hidden from the compiler (tc_opaque); as loop invariants the compiler computed them once before
// the kernels' loop over chunks and held them in registers through it for this rare path (ptxas,
// sm_90a, dk/dv at head dim 192: 48 registers of the consumers' 232; sm_80: dk/dv at 128 spilled
// 72 bytes, 8 with it, the forward at 64 with dropout 4, none). Not for the sm80 dq pass, where the
// compiler's own choice is better (head dim 32: 48 bytes spilled with it, none without).
template <typename T, int NT, int CT, bool OPAQUE, typename BAt>
__device__ __forceinline__ void tc_gemm_pb_skip_zero(float (&acc)[CT][4], const float (&P)[NT][4], BAt b_at,
                                                     int c0, int lane, int64_t D) {
  const int tq = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      for (int src = 0; src < 4; ++src) {
        // Rounded to T, as the tensor-core product takes them.
        const float p0 = round_to<T>(__shfl_sync(DA_FULL_MASK, P[nt][e], (lane & ~3) | src));
        const float p1 = round_to<T>(__shfl_sync(DA_FULL_MASK, P[nt][2 + e], (lane & ~3) | src));
        if (p0 == 0.f && p1 == 0.f) continue;
        const int key = nt * 8 + 2 * src + e;
        const int d0 = OPAQUE ? tc_opaque(c0 + 2 * tq) : c0 + 2 * tq;  // (see above)
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
#pragma unroll
          for (int f = 0; f < 2; ++f) {
            const int d = d0 + ct * 8 + f;
            if (d < D) {
              const float bv = to_float<T>(b_at(key, d));
              if (p0 != 0.f) acc[ct][f] += p0 * bv;
              if (p1 != 0.f) acc[ct][2 + f] += p1 * bv;
            }
          }
        }
      }
    }
  }
}

// acc += P B, on the tensor cores unless the chunk has masked pairs and B a non-finite value
// (OPAQUE: tc_gemm_pb_skip_zero's).
template <typename T, int DP, int LDS, int NT, int CT, bool OPAQUE = true>
__device__ __forceinline__ void tc_gemm_pb_masked(float (&acc)[CT][4], const float (&P)[NT][4], const T* sB,
                                                  int c0, int lane, int64_t D, bool need_mask) {
  if (need_mask && tc_tile_nonfinite<T, DP, LDS>(sB, 8 * NT, lane))
    tc_gemm_pb_skip_zero<T, NT, CT, OPAQUE>(
        acc, P, [&](int key, int d) { return sB[key * LDS + d]; }, c0, lane, D);
  else
    tc_gemm_pb<T, LDS, NT, CT>(acc, P, sB, c0, lane, D);
}

// Attention dropout's keep flags of the thread's elements of a warp's C fragments [NT][4] of the
// chunk at cur.o0 (bit nt * 4 + e: row slot e >> 1, column nt * 8 + 2 * tq + (e & 1)), in head bh
// (common.cuh).
template <int NT, typename I>
__device__ __forceinline__ uint32_t tc_dropout_keep(const Walk<2, I>& cur, const Params& p, int64_t bh,
                                                    int64_t start, int tq) {
  static_assert(NT * 4 <= 32, "one bit per element");
  return cur.dropout_keep(p.drop, bh, start, NT * 4, [&](int i, int* slot, int* jj) {
    *slot = (i >> 1) & 1;
    *jj = (i >> 2) * 8 + 2 * tq + (i & 1);
  });
}

// Which instantiation of a kernel runs: with attention dropout (DROPOUT = true) or without. They
// are compiled apart, so that the kernels without dropout keep their registers (the draws of
// tc_dropout_keep would take some and spill the forward and dk/dv kernels at head dim 64).
inline int tc_dropout(const Params& p) {
  return p.drop.threshold != 0u ? 1 : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

// One chunk of the forward's online softmax, without the output: S (the warp's 16 rows x 8 NT keys,
// mma C fragments) scaled to base 2 by sl2, masked where need_mask (pair_active), turned into
// probabilities against the updated running max m, times their dropout factors where DROPOUT; l
// rescaled and summed; corr[ri], the factor by which the output accumulators must be rescaled.
template <int NT, bool DROPOUT, typename I>
__device__ __forceinline__ void tc_fwd_probs(float (&S)[NT][4], float (&m)[2], float (&l)[2],
                                             const Walk<2, I>& cur, bool need_mask, float sl2, int tq,
                                             const Params& p, uint32_t keep, float (&corr)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float s = S[nt][e] * sl2;
      if (need_mask) {
        const int j = cur.o0 + nt * 8 + 2 * tq + (e & 1);
        if (!cur.pair_active(cur.jrow[e >> 1], j)) s = -INFINITY;
      }
      S[nt][e] = s;
    }
  }

  // Online softmax of this warp's two row slots (each row's values live in a quad).
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(S[nt][2 * ri], S[nt][2 * ri + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(DA_FULL_MASK, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(DA_FULL_MASK, mx, 2));
    const float m_new = fmaxf(m[ri], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked: exp2(-inf) = 0
    corr[ri] = exp2f(m[ri] - m_use);
    m[ri] = m_new;
    l[ri] *= corr[ri];
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      S[nt][2 * ri] = exp2f(S[nt][2 * ri] - m_use);
      S[nt][2 * ri + 1] = exp2f(S[nt][2 * ri + 1] - m_use);
      sum += S[nt][2 * ri] + S[nt][2 * ri + 1];
    }
    l[ri] += sum;  // this thread's columns; the quad is summed at the end
  }
  if (DROPOUT) {  // the denominator has the weights, the output their kept share (times 1 / (1 - p) at
                  // the end, tc_fwd_store: P / (1 - p) rounded to 16 bits for the MMA would differ
                  // from the backward's exact factor, and dq of a one-key row would not be 0)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[nt][e] = (keep >> (nt * 4 + e)) & 1u ? S[nt][e] : 0.f;
  }
}

// The output accumulators' rows ri times corr[ri].
template <int DT>
__device__ __forceinline__ void tc_rescale(float (&O)[DT][4], const float (&corr)[2]) {
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    O[dt][0] *= corr[0];
    O[dt][1] *= corr[0];
    O[dt][2] *= corr[1];
    O[dt][3] *= corr[1];
  }
}

// One chunk of the forward's online softmax (tc_fwd_probs) with the output accumulators O rescaled.
template <int NT, int DT, bool DROPOUT, typename I>
__device__ __forceinline__ void tc_fwd_softmax(float (&S)[NT][4], float (&O)[DT][4], float (&m)[2],
                                               float (&l)[2], const Walk<2, I>& cur, bool need_mask,
                                               float sl2, int tq, const Params& p, uint32_t keep) {
  float corr[2];
  tc_fwd_probs<NT, DROPOUT>(S, m, l, cur, need_mask, sl2, tq, p, keep, corr);
  tc_rescale<DT>(O, corr);
}

// The forward's last step, for both the sm80 and the sm90 kernels: each row's out = O / l (0
// where no branch covers the row) in T, or in float where p.out_f32, and its lse.
template <typename T, int DT, typename I>
__device__ __forceinline__ void tc_fwd_store(const Params& p, const SeqRows& sq, int64_t h,
                                             const Walk<2, I>& cur, const float (&m)[2], const float (&l)[2],
                                             const float (&O)[DT][4], float sl2, int tq) {
  const int64_t N = sq.N, b = sq.b;
  // out rows of T, or of float (p.out_f32: the backward's recomputation); offsets in elements
  const int64_t out_at = b * p.out.sb + sq.start * p.out.sn + h * p.out.sh;
  T* out = static_cast<T*>(p.out.data) + out_at;
  float* out_f = static_cast<float*>(p.out.data) + out_at;
  const int64_t lse_row = (b * p.Hq + h) * p.N + sq.start;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    float lsum = l[ri];
    lsum += __shfl_xor_sync(DA_FULL_MASK, lsum, 1);
    lsum += __shfl_xor_sync(DA_FULL_MASK, lsum, 2);
    const int64_t x = cur.pos[ri];
    if (x >= N) continue;
    const bool empty = lsum == 0.f;  // no branch covers the row (or every score was -inf)
    const float inv = empty ? 0.f : p.drop.scale / lsum;  // (dropout's 1 / (1 - p); 1 without)
    T* o = out + x * p.out.sn;
    float* of = out_f + x * p.out.sn;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int d = dt * 8 + 2 * tq;
      if (d >= p.D) continue;
      const float a = empty ? 0.f : O[dt][2 * ri] * inv, c = empty ? 0.f : O[dt][2 * ri + 1] * inv;
      if (p.out_f32) {
        of[d] = a;
        of[d + 1] = c;
      } else {
        store2<T>(o + d, a, c);
      }
    }
    if (tq == 0)
      da_set_lse<float>(p, lse_row + x,
                        empty ? -(double)INFINITY : da_lse_natural(m[ri], lsum, da_score_unit(p.scale, sl2)));
  }
}

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads) tc_fwd_kernel(const Params p) {
#if DA_SM80
  using Cfg = TcFwdCfg<DP>;
  constexpr int LDS = Cfg::LDS, KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [64][LDS]
  T* sK = sQ + kTcRows * LDS;              // [STAGES][KT][LDS]
  T* sV = sK + Cfg::STAGES * KT * LDS;     // [STAGES][KT][LDS]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn + h * p.q.sh;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;

  tc_load_rows<T, DP, LDS>(sQ, q, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.q.sn : -1;
  });
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, warp, lane);

  auto load_kv = [&](const Walk<2>& w, int stage) {
    auto off_k = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.k.sn : -1;
    };
    auto off_v = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.v.sn : -1;
    };
    tc_load_rows<T, DP, LDS>(sK + stage * KT * LDS, k, KT, p.D, off_k);
    tc_load_rows<T, DP, LDS>(sV + stage * KT * LDS, v, KT, p.D, off_v);
  };

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float O[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) O[dt][0] = O[dt][1] = O[dt][2] = O[dt][3] = 0.f;

  int stage = 0;
  if (!cur.done) load_kv(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    nxt.next(p.br);  // block-wide: may synchronise
    if (!nxt.done) load_kv(nxt, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();  // everything but the prefetch just issued has landed
    __syncthreads();

    if (!cur.skip_chunk()) {
      const T* sKs = sK + stage * KT * LDS;
      const T* sVs = sV + stage * KT * LDS;
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
      float S[NT][4];
      tc_gemm_abt<T, DP, LDS, NT>(S, sQ, sKs, warp, lane, p.D);

      const bool need_mask = cur.chunk_needs_mask();
      tc_fwd_softmax<NT, DT, DROPOUT>(S, O, m, l, cur, need_mask, sl2, tq, p, keep);
      tc_gemm_pb_masked<T, DP, LDS, NT, DT>(O, S, sVs, 0, lane, p.D, need_mask);
    }
    __syncthreads();  // the buffer of `stage` is free for the prefetch of the next iteration
    cur = nxt;
    stage ^= 1;
  }
  cp_async_wait<0>();

  tc_fwd_store<T, DT>(p, sq, h, cur, m, l, O, sl2, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dq                                                                                 */
/* ------------------------------------------------------------------------------------------ */

// The dq pass's rows: their lse (log2 domain, hi + lo: da_lse_base2; +inf for -inf so that
// exp2(s - lse) = 0) and delta. (float16/bfloat16 only: lo is far below their rounding and read
// only in the rows at huge scores, da_exponent.)
template <typename I>
__device__ __forceinline__ void tc_dq_row_stats(const Params& p, const SeqRows& sq, int64_t h,
                                                const Walk<2, I>& cur, float sl2, float (&lse2)[2],
                                                float (&lse2lo)[2], float (&dl)[2]) {
  const int64_t lse_row = (sq.b * p.Hq + h) * p.N + sq.start;
  const float* delta = static_cast<const float*>(p.delta) + lse_row;
  const double unit = da_score_unit(p.scale, sl2);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int64_t x = cur.pos[ri];
    lse2[ri] = da_lse_base2<float>(x < sq.N ? da_get_lse<float>(p, lse_row + x) : 0.0, unit, &lse2lo[ri]);
    dl[ri] = x < sq.N ? delta[x] : 0.f;
  }
}

// The dq pass's chunk, for both the sm80 and the sm90 kernels: S (scores of the warp's 16 rows
// x 8 NT keys) becomes dS = P (dP - delta) in place, P = 2^(S sl2 - lse2) on the active pairs
// (need_mask: pair_active) and 0 elsewhere, S sl2 rounded as the forward's score (da_mul_rn) and
// the exponent da_exponent's; with dropout dP is the kept share (M dO V^T).
template <int NT, bool DROPOUT, typename I>
__device__ __forceinline__ void tc_dq_scores(float (&S)[NT][4], const float (&dP)[NT][4],
                                             const Walk<2, I>& cur, bool need_mask, float sl2,
                                             const float (&lse2)[2], const float (&lse2lo)[2],
                                             const float (&dl)[2], int tq, const Params& p, uint32_t keep) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = e >> 1;
      bool ok = true;
      if (need_mask) {
        const int j = cur.o0 + nt * 8 + 2 * tq + (e & 1);
        ok = cur.pair_active(cur.jrow[ri], j);
      }
      const float f =
          DROPOUT ? da_dropout_factor<float>(p.drop, keep, nt * 4 + e) : 1.f;  // dropout: M dO V^T
      const float pr = ok ? exp2f(da_exponent<false>(da_mul_rn(S[nt][e], sl2), lse2[ri], lse2lo[ri])) : 0.f;
      S[nt][e] = ok ? pr * (dP[nt][e] * f - dl[ri]) : 0.f;  // dS
    }
  }
}

// The dq pass's last step: dq = dQ * scale for the thread's rows.
template <typename T, int DT, typename I>
__device__ __forceinline__ void tc_dq_store(const Params& p, const SeqRows& sq, int64_t h,
                                            const Walk<2, I>& cur, const float (&dQ)[DT][4], int tq) {
  T* dq = static_cast<T*>(p.dq.data) + sq.b * p.dq.sb + sq.start * p.dq.sn + h * p.dq.sh;
  const float scale = (float)p.scale;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int64_t x = cur.pos[ri];
    if (x >= sq.N) continue;
    T* o = dq + x * p.dq.sn;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      const int d = dt * 8 + 2 * tq;
      if (d < p.D) store2<T>(o + d, dQ[dt][2 * ri] * scale, dQ[dt][2 * ri + 1] * scale);
    }
  }
}

// The dk/dv pass's chunk (rows = keys, 8 NT queries): St becomes P^T (times the dropout factors,
// for dV) and dPt dS^T = P^T (dP^T - delta), with the queries' lse (base 2: hi from sLs, lo from
// sLlos, da_exponent) and delta from sDls.
template <int NT, bool DROPOUT, typename I>
__device__ __forceinline__ void tc_dkv_scores(float (&St)[NT][4], float (&dPt)[NT][4], const Walk<2, I>& cur,
                                              bool need_mask, float sl2, const float* sLs, const float* sLlos,
                                              const float* sDls, int tq, const Params& p, uint32_t keep) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int qc = nt * 8 + 2 * tq + (e & 1);
      bool ok = true;
      if (need_mask) ok = cur.pair_active(cur.jrow[e >> 1], cur.o0 + qc);
      // Dropout: M dO V^T, and P M for dV.
      const float f = DROPOUT ? da_dropout_factor<float>(p.drop, keep, nt * 4 + e) : 1.f;
      const float pr = ok ? exp2f(da_exponent<false>(da_mul_rn(St[nt][e], sl2), sLs[qc], sLlos[qc])) : 0.f;
      St[nt][e] = pr * f;
      dPt[nt][e] = ok ? pr * (dPt[nt][e] * f - sDls[qc]) : 0.f;  // dS^T
    }
  }
}

// The lse (base 2, hi + lo: da_lse_base2; +inf where the query is outside the segment, so that
// P = 0) and delta of the queries o0 .. o0 + QT - 1 of the walk's current head and segment, into
// sL[QT], sLlo[QT] and sDl[QT], by the `threads` threads numbered `tid` (the block, or a producer warp).
template <int ROWS, typename I>
__device__ __forceinline__ void tc_dkv_load_stats(const Params& p, const Walk<ROWS, I>& w, int QT,
                                                  int64_t lse_all, const float* delta_all, double unit,
                                                  float* sL, float* sLlo, float* sDl, int tid = threadIdx.x,
                                                  int threads = kTcThreads) {
  const int64_t h = w.head();
  for (int jj = tid; jj < QT; jj += threads) {
    const int j = w.o0 + jj;
    float L = INFINITY, dlt = 0.f, lo = 0.f;
    if (j < w.o_end) {
      const int64_t x = w.other_position(j);
      L = da_lse_base2<float>(da_get_lse<float>(p, lse_all + h * p.N + x), unit, &lo);
      dlt = delta_all[h * p.N + x];
    }
    sL[jj] = L;
    sLlo[jj] = lo;
    sDl[jj] = dlt;
  }
}

// The dk/dv pass's last step: dk = dK * scale and dv = dV, columns c0 .. c0 + 8 CT.
template <typename T, int CT, typename I>
__device__ __forceinline__ void tc_dkv_store(const Params& p, const SeqRows& sq, int64_t hk, int c0,
                                             const Walk<2, I>& cur, const float (&dK)[CT][4],
                                             const float (&dV)[CT][4], int tq) {
  T* dk = static_cast<T*>(p.dk.data) + sq.b * p.dk.sb + sq.start * p.dk.sn + hk * p.dk.sh;
  T* dv = static_cast<T*>(p.dv.data) + sq.b * p.dv.sb + sq.start * p.dv.sn + hk * p.dv.sh;
  const float scale = (float)p.scale;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int64_t x = cur.pos[ri];
    if (x >= sq.N) continue;
#pragma unroll
    for (int ct = 0; ct < CT; ++ct) {
      const int d = c0 + ct * 8 + 2 * tq;
      if (d < p.D) {
        store2<T>(dk + x * p.dk.sn + d, dK[ct][2 * ri] * scale, dK[ct][2 * ri + 1] * scale);
        store2<T>(dv + x * p.dv.sn + d, dV[ct][2 * ri], dV[ct][2 * ri + 1]);
      }
    }
  }
}

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads) tc_dq_kernel(const Params p) {
#if DA_SM80
  using Cfg = TcDqCfg<DP>;
  constexpr int LDS = Cfg::LDS, KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  constexpr int STAGES = Cfg::STAGES;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [64][LDS]
  T* sdO = sQ + kTcRows * LDS;             // [64][LDS]
  T* sK = sdO + kTcRows * LDS;             // [STAGES][KT][LDS]
  T* sV = sK + STAGES * KT * LDS;          // [STAGES][KT][LDS]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn + h * p.q.sh;
  const T* dout = static_cast<const T*>(p.dout.data) + b * p.dout.sb + sq.start * p.dout.sn + h * p.dout.sh;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;

  tc_load_rows<T, DP, LDS>(sQ, q, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.q.sn : -1;
  });
  tc_load_rows<T, DP, LDS>(sdO, dout, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.dout.sn : -1;
  });
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, warp, lane);

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float lse2[2], lse2lo[2], dl[2];
  tc_dq_row_stats(p, sq, h, cur, sl2, lse2, lse2lo, dl);

  auto load_kv = [&](const Walk<2>& w, int stage) {
    auto off_k = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.k.sn : -1;
    };
    auto off_v = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.v.sn : -1;
    };
    tc_load_rows<T, DP, LDS>(sK + stage * KT * LDS, k, KT, p.D, off_k);
    tc_load_rows<T, DP, LDS>(sV + stage * KT * LDS, v, KT, p.D, off_v);
  };

  float dQ[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) dQ[dt][0] = dQ[dt][1] = dQ[dt][2] = dQ[dt][3] = 0.f;

  int stage = 0;
  if (!cur.done) load_kv(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    if (STAGES == 2) {
      nxt.next(p.br);
      if (!nxt.done) load_kv(nxt, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (!cur.skip_chunk()) {
      const T* sKs = sK + stage * KT * LDS;
      const T* sVs = sV + stage * KT * LDS;
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
      float S[NT][4], dP[NT][4];
      tc_gemm_abt<T, DP, LDS, NT>(S, sQ, sKs, warp, lane, p.D);
      tc_gemm_abt<T, DP, LDS, NT>(dP, sdO, sVs, warp, lane, p.D);
      const bool need_mask = cur.chunk_needs_mask();
      tc_dq_scores<NT, DROPOUT>(S, dP, cur, need_mask, sl2, lse2, lse2lo, dl, tq, p, keep);
      tc_gemm_pb_masked<T, DP, LDS, NT, DT, false>(dQ, S, sKs, 0, lane, p.D, need_mask);
    }
    __syncthreads();
    if (STAGES == 1) {
      nxt.next(p.br);
      if (!nxt.done) load_kv(nxt, 0);
      cp_async_commit();
    } else {
      stage ^= 1;
    }
    cur = nxt;
  }
  cp_async_wait<0>();

  tc_dq_store<T, DT>(p, sq, h, cur, dQ, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dk, dv                                                                             */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads) tc_dkv_kernel(const Params p) {
#if DA_SM80
  using Cfg = TcDkvCfg<DP>;
  constexpr int LDS = Cfg::LDS, QT = Cfg::QT, NT = QT / 8, DC = Cfg::DC, CT = DC / 8;
  constexpr int STAGES = Cfg::STAGES;
  DA_EXTERN_SMEM(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw);                         // [64][LDS]
  T* sV = sK + kTcRows * LDS;                                     // [64][LDS]
  T* sQ = sV + kTcRows * LDS;                                     // [STAGES][QT][LDS]
  T* sdO = sQ + STAGES * QT * LDS;                                // [STAGES][QT][LDS]
  float* sL = reinterpret_cast<float*>(sdO + STAGES * QT * LDS);  // [STAGES][QT] lse, log2 domain
  float* sDl = sL + STAGES * QT;                                  // [STAGES][QT] delta
  float* sLlo = sDl + STAGES * QT;                                // [STAGES][QT] lse's low part

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_KEYS);
  const int64_t N = sq.N, b = sq.b, hk = blockIdx.y / Cfg::CHUNKS;
  const int c0 = (int)(blockIdx.y % Cfg::CHUNKS) * DC;  // first accumulator column
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;
  tc_load_rows<T, DP, LDS>(sK, k, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.k.sn : -1;
  });
  tc_load_rows<T, DP, LDS>(sV, v, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.v.sn : -1;
  });
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, hk * p.G, (int)p.G, DA_ROWS_ARE_KEYS, QT, warp, lane);

  const T* q_all = static_cast<const T*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn;
  const T* do_all = static_cast<const T*>(p.dout.data) + b * p.dout.sb + sq.start * p.dout.sn;
  const int64_t lse_all = b * p.Hq * p.N + sq.start;
  const float* delta_all = static_cast<const float*>(p.delta) + b * p.Hq * p.N + sq.start;
  const float sl2 = (float)(p.scale * DA_LOG2E);
  const double unit = da_score_unit(p.scale, sl2);

  // Queries o0 .. o0+QT-1 of the walk's current head and segment: q and dout rows, lse, delta.
  auto load_q = [&](const Walk<2>& w, int stage) {
    const int64_t h = w.head();
    const T* q = q_all + h * p.q.sh;
    const T* dout = do_all + h * p.dout.sh;
    tc_load_rows<T, DP, LDS>(sQ + stage * QT * LDS, q, QT, p.D, [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.q.sn : -1;
    });
    tc_load_rows<T, DP, LDS>(sdO + stage * QT * LDS, dout, QT, p.D, [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.dout.sn : -1;
    });
    tc_dkv_load_stats(p, w, QT, lse_all, delta_all, unit, sL + stage * QT, sLlo + stage * QT,
                      sDl + stage * QT);
  };

  float dK[CT][4], dV[CT][4];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    dK[ct][0] = dK[ct][1] = dK[ct][2] = dK[ct][3] = 0.f;
    dV[ct][0] = dV[ct][1] = dV[ct][2] = dV[ct][3] = 0.f;
  }

  int stage = 0;
  if (!cur.done) load_q(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    if (STAGES == 2) {
      nxt.next(p.br);
      if (!nxt.done) load_q(nxt, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    if (!cur.skip_chunk()) {
      const T* sQs = sQ + stage * QT * LDS;
      const T* sdOs = sdO + stage * QT * LDS;
      const float* sLs = sL + stage * QT;
      const float* sDls = sDl + stage * QT;
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + cur.head(), sq.start, tq) : 0u;
      float St[NT][4], dPt[NT][4];  // (this warp's 16 keys) x (QT queries)
      tc_gemm_abt<T, DP, LDS, NT>(St, sK, sQs, warp, lane, p.D);
      tc_gemm_abt<T, DP, LDS, NT>(dPt, sV, sdOs, warp, lane, p.D);
      const bool need_mask = cur.chunk_needs_mask();
      tc_dkv_scores<NT, DROPOUT>(St, dPt, cur, need_mask, sl2, sLs, sLlo + stage * QT, sDls, tq, p, keep);
      tc_gemm_pb_masked<T, DP, LDS, NT, CT>(dV, St, sdOs, c0, lane, p.D, need_mask);
      tc_gemm_pb_masked<T, DP, LDS, NT, CT>(dK, dPt, sQs, c0, lane, p.D, need_mask);
    }
    __syncthreads();
    if (STAGES == 1) {
      nxt.next(p.br);
      if (!nxt.done) load_q(nxt, 0);
      cp_async_commit();
    } else {
      stage ^= 1;
    }
    cur = nxt;
  }
  cp_async_wait<0>();

  tc_dkv_store<T, CT>(p, sq, hk, c0, cur, dK, dV, tq);
#endif
}

#ifndef DA_CUDA_EMULATION  // the CPU emulation of the tests calls the kernels itself

/* ------------------------------------------------------------------------------------------ */
/* Launchers                                                                                    */
/* ------------------------------------------------------------------------------------------ */

// Declares the instantiations of launcher FN for dtype T at every padded head dim: each is
// compiled in a file of its own (csrc/cuda/tc/, scripts/generate_tc_instances.py), and the
// dispatchers (tc_dispatch.cu, tc90_dispatch.cu) only call them.
#define DA_TC_EXTERN(FN, T)                                               \
  extern template TcConfig FN<T, 32>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 64>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 96>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 128>(const Params&, bool, cudaStream_t); \
  extern template TcConfig FN<T, 192>(const Params&, bool, cudaStream_t); \
  extern template TcConfig FN<T, 256>(const Params&, bool, cudaStream_t);

// Returns FN<T, DP>(...) for the padded head dimension DP of D.
#define DA_TC_DISPATCH_DP(D, FN, T, ...)      \
  switch (tc_padded_dim(D)) {                 \
    case 32: return FN<T, 32>(__VA_ARGS__);   \
    case 64: return FN<T, 64>(__VA_ARGS__);   \
    case 96: return FN<T, 96>(__VA_ARGS__);   \
    case 128: return FN<T, 128>(__VA_ARGS__); \
    case 192: return FN<T, 192>(__VA_ARGS__); \
    default: return FN<T, 256>(__VA_ARGS__);  \
  }

// Each instantiation of tc_fwd_dp, tc_dq_dp and tc_dkv_dp below (with its two kernels) is compiled
// in a file of its own, csrc/cuda/tc/<pass>_<dtype>_d<DP>.cu (scripts/generate_tc_instances.py), so
// that the build compiles them in parallel; tc_dispatch.cu declares them and picks one per call.

// `opt_in` belongs to the kernel: its launcher's function-local static (launch.h).
template <typename Kernel>
inline void tc_launch(Kernel kernel, dim3 grid, int smem, const Params& p, cudaStream_t stream,
                      SmemOptIn& opt_in) {
  if (!smem_opt_in(opt_in, kernel, smem)) return;  // no launch; the caller's launch check raises the error
  kernel<<<grid, kTcThreads, smem, stream>>>(p);
}

template <typename T, int DP>
TcConfig tc_fwd_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, TcFwdCfg<DP>::SMEM, 1};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];  // without and with dropout
    tc_launch(tc_dropout(p) ? tc_fwd_kernel<T, DP, true> : tc_fwd_kernel<T, DP, false>, grid, cfg.smem_bytes,
              p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

template <typename T, int DP>
TcConfig tc_dq_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, TcDqCfg<DP>::SMEM, 1};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];  // without and with dropout
    tc_launch(tc_dropout(p) ? tc_dq_kernel<T, DP, true> : tc_dq_kernel<T, DP, false>, grid, cfg.smem_bytes, p,
              stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

template <typename T, int DP>
TcConfig tc_dkv_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, TcDkvCfg<DP>::SMEM, TcDkvCfg<DP>::CHUNKS};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)(p.Hkv * cfg.d_chunks),
                    (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];  // without and with dropout
    tc_launch(tc_dropout(p) ? tc_dkv_kernel<T, DP, true> : tc_dkv_kernel<T, DP, false>, grid, cfg.smem_bytes,
              p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

#endif  // DA_CUDA_EMULATION

}  // namespace cuda
}  // namespace dilated_attention
