// The sm90 kernels (float16/bfloat16, sm_90a): the forward, dq and dk/dv passes of tc_kernels.cuh on
// the warpgroup MMA.
//
// A thread block is one warpgroup (4 warps, 128 threads) owning 64 rows of one head, as in
// tc_kernels.cuh, and walks the same work (common.cuh's Walk over every branch, segment and chunk
// of keys, the causal skip, one online softmax per row over every branch). What changes is the
// matrix products: S = Q K^T is one wgmma.mma_async m64n{KT}k16 per 16 columns of the head dim,
// both operands read from shared memory by descriptors (no ldmatrix), and O += P V one
// m64n{DP}k16 per 16 keys, P from registers (the accumulators of S turned into A fragments, as
// mma.sync takes them) and V from shared memory. Tiles are stored in the swizzled layout of
// sm90.cuh (Sw90). The chunks of the other side arrive by the tensor copy engine (tma.h: one
// strided box per panel, thread 0 issuing, an mbarrier per stage) or, where no tensor map reaches
// them, by cp.async from the dilated positions, handed to the MMAs through fence.proxy.async and
// a barrier; the next chunk loads while this one is computed. Each pass issues a chunk's products
// with probabilities together with the next chunk's products of two tiles and computes that
// chunk's softmax (or dS) while they run (FlashAttention-3's overlap within a warpgroup): three
// stages of tiles.
//
// Every warp of the warpgroup takes part in each MMA, so a chunk runs when any warp of the block
// has work in it (the sm80 kernel skips per warp); the rows of a warp that would have skipped it
// are masked (their probabilities are 0). A chunk whose masked pairs meet a non-finite value of V
// is summed on CUDA cores, skipping the zero probabilities, in every warp of the block
// (tc_gemm_pb_skip_zero), so that the value reaches only the rows that read it.
//
// The backward's two passes are those of tc_kernels.cuh the same way: dq (rows = queries) has
// S = Q K^T and dP = dO V^T from shared memory and dQ += dS K with dS from registers; dk/dv (rows =
// keys, over the G query heads of the group) S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and
// dK += dS^T Q, head dims above 128 split over two thread blocks by columns. Results are the sm80
// kernels' (the same roundings and f32 accumulation; the sums' order inside an MMA may differ), so
// either pass may follow either forward.
#pragma once

#include "sm90.cuh"
#include "tc_kernels.cuh"
#include "tma.h"

#if defined(DA_CUDA_EMULATION) && !defined(__grid_constant__)
#define __grid_constant__
#endif

namespace dilated_attention {
namespace cuda {

template <int DP>
struct Tc90FwdCfg {
  static constexpr int KT = TcFwdCfg<DP>::KT;  // keys per step: 64 (DP <= 128), 32 (192), 16 (256)
  static constexpr int STAGES = 3;             // V of one chunk is read while K of the next is
  static constexpr int Q_BYTES = kTcRows * DP * 2, KV_BYTES = KT * DP * 2;  // multiples of 1024
  // + 8 * STAGES: an mbarrier per stage (the tensor copies of its tiles); + 1024: the tiles start on a
  // 1024-byte boundary of the dynamic shared memory.
  static constexpr int SMEM = Q_BYTES + STAGES * 2 * KV_BYTES + 8 * STAGES + 1024;
};

template <int DP>
struct Tc90DqCfg {
  // Keys per step: 64 (DP <= 64), 32 (96, 128), 16 (above): S, dP, dQ and the previous dS stay in
  // registers (64 keys spilled at 96).
  static constexpr int KT = DP <= 64 ? 64 : (DP <= 128 ? 32 : 16);
  static constexpr int STAGES = 3;  // K of one chunk is read while K and V of the next are
  static constexpr int ROW_BYTES = kTcRows * DP * 2, KV_BYTES = KT * DP * 2;
  static constexpr int SMEM = 2 * ROW_BYTES + STAGES * 2 * KV_BYTES + 8 * STAGES + 1024;
};

template <int DP>
struct Tc90DkvCfg {
  // Queries per step: 32 (DP <= 32), 16 (above): the accumulators of dK and dV, of S^T and dP^T
  // and the A fragments of two products stay in registers (QT = 32 spilled at DP = 128).
  static constexpr int QT = DP <= 32 ? 32 : 16;
  static constexpr int DC = TcDkvCfg<DP>::DC, CHUNKS = TcDkvCfg<DP>::CHUNKS;  // accumulator columns
  static constexpr int STAGES = 3;  // q and dout of one chunk are read while those of the next are
  // Panels of 64 columns where both DP and the column chunks allow, else 32 (DP = 192: DC = 96).
  static constexpr int PW = DP % 64 == 0 && DC % 64 == 0 ? 64 : 32;
  static constexpr int ROW_BYTES = kTcRows * DP * 2, Q_BYTES = QT * DP * 2;
  static constexpr int SMEM =
      2 * ROW_BYTES + STAGES * 2 * Q_BYTES + STAGES * 2 * QT * (int)sizeof(float) + 8 * STAGES + 1024;
};

// The dynamic shared memory from its first 1024-byte boundary (the swizzle works on addresses).
__device__ __forceinline__ unsigned char* tc90_smem(unsigned char* raw) {
  return raw + ((1024 - (smem_address(raw) & 1023)) & 1023);
}

// Loads `rows` rows of DP columns (D of them real) into a Sw90 tile L with cp.async; row_offset(i)
// gives the element offset of row i in src or -1 for a zero row.
template <typename T, typename L, typename RowOffset>
__device__ __forceinline__ void tc90_load_rows(T* dst, const T* src, int rows, int64_t D,
                                               RowOffset row_offset) {
  constexpr int CH = L::DP / 8;  // 16-byte chunks per row
  unsigned char* base = reinterpret_cast<unsigned char*>(dst);
  for (int idx = threadIdx.x; idx < rows * CH; idx += kTcThreads) {
    const int row = idx / CH, ch = idx % CH;
    const int64_t off = row_offset(row);
    const bool ok = off >= 0 && ch * 8 < D;
    cp_async16(base + L::chunk_offset(rows, row, ch), ok ? src + off + ch * 8 : src, ok);
  }
}

// The block's 64 rows (tiling.h) of a (B, N, H, D) tensor t, head h, into a Sw90 tile L.
template <typename T, typename L>
__device__ __forceinline__ void tc90_load_block_rows(T* dst, const Tensor4& t, const SeqRows& sq, int64_t h,
                                                     const da_tiling& tl, int64_t base, int64_t D) {
  const T* src = static_cast<const T*>(t.data) + sq.b * t.sb + sq.start * t.sn + h * t.sh;
  tc90_load_rows<T, L>(dst, src, kTcRows, D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < sq.N ? x * t.sn : -1;
  });
}

// The walk's current chunk of the other side (o0 .. o0 + rows - 1 of its segment; zero rows past
// o_end) of a tensor whose head h starts at src, into a Sw90 tile L.
template <typename T, typename L>
__device__ __forceinline__ void tc90_load_chunk(T* dst, const T* src, int64_t sn, const Walk<2>& w, int rows,
                                                int64_t D) {
  tc90_load_rows<T, L>(dst, src, rows, D, [&](int jj) -> int64_t {
    const int j = w.o0 + jj;
    return j < w.o_end ? w.other_position(j) * sn : -1;
  });
}

// The map of `maps` for rate r, or -1 (the same in every thread).
__device__ __forceinline__ int tc90_map_index(const TmaMaps& maps, int64_t r) {
  int found = -1;
  for (int i = 0; i < maps.count; ++i) found = maps.rate[i] == r ? i : found;
  return found;
}

// Loads the walk's current chunk (`rows` indices of the other side from o0; rows past o_end are
// not used) of tensors a and b (head `head`) into the Sw90 tiles ta and tb. With the tensor copy
// engine where maps has the chunk's rate and reaches its last used row (tma.h): thread 0 issues
// one box per panel and tensor, completing on bar, and the result is true (the caller waits on
// bar before reading); else with cp.async from every thread (zero rows past o_end), false. Rows
// past o_end that a box loads hold other positions' values: the kernels mask them.
template <typename T, typename L>
__device__ __forceinline__ bool tc90_load_pair(T* ta, T* tb, const Tensor4& a, const Tensor4& b, int64_t head,
                                               const SeqRows& sq, const Walk<2>& w, int rows, int64_t D,
                                               const TmaMaps& maps, uint64_t* bar) {
  const int64_t r = w.st.r, g0 = sq.start + w.other_position(w.o0);  // the chunk's first row in a, b
  const int mi = tc90_map_index(maps, r);
  const int used = min(rows, w.o_end - w.o0);
  if (mi >= 0 && g0 / r + used <= maps.J[mi]) {
    if (threadIdx.x == 0) {
      fence_proxy_async();  // the tiles' generic reads of the previous use, before the copy engine's writes
      mbar_arrive_expect_tx(bar, (uint32_t)(2 * rows * L::DP * 2));
      int32_t c[5] = {0, (int32_t)head, (int32_t)(g0 % r), (int32_t)(g0 / r), (int32_t)sq.b};
#pragma unroll
      for (int pn = 0; pn < L::PANELS; ++pn) {
        c[0] = pn * L::PW;
        tma_load_5d(ta + pn * rows * L::PW, maps.map[0][mi], c, bar);
        tma_load_5d(tb + pn * rows * L::PW, maps.map[1][mi], c, bar);
      }
    }
    return true;
  }
  const T* pa = static_cast<const T*>(a.data) + sq.b * a.sb + sq.start * a.sn + head * a.sh;
  const T* pb = static_cast<const T*>(b.data) + sq.b * b.sb + sq.start * b.sn + head * b.sh;
  tc90_load_chunk<T, L>(ta, pa, a.sn, w, rows, D);
  tc90_load_chunk<T, L>(tb, pb, b.sn, w, rows, D);
  return false;
}

// The stages' mbarriers (one arrival: thread 0's, with the bytes of the stage's copies), set up
// before the walk; then a barrier.
__device__ __forceinline__ void tc90_init_stage_barriers(uint64_t* bars, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&bars[s], 1);
    fence_barrier_init();
  }
  __syncthreads();
}

// Which stages hold tensor copies (bit s) and the parity of each stage's next phase: the stage's
// tiles have landed once its cp.async groups (tc90_tiles_landed) and, where loaded by TMA, its
// mbarrier's phase have completed.
struct Tc90Stages {
  uint32_t tma = 0, parity = 0;
  __device__ __forceinline__ void loaded(int stage, bool by_tma) {
    tma = by_tma ? tma | (1u << stage) : tma & ~(1u << stage);
  }
  __device__ __forceinline__ void wait(uint64_t* bars, int stage) {
    if ((tma >> stage) & 1) {
      mbar_wait(&bars[stage], (parity >> stage) & 1);
      parity ^= 1u << stage;
    }
  }
};

// Hands the tiles that this thread's cp.async copies filled to the MMAs: waits for all but the
// newest N groups and fences them to the async proxy; the caller's barrier then covers every thread.
template <int N>
__device__ __forceinline__ void tc90_tiles_landed() {
  cp_async_wait<N>();
  fence_proxy_async();
}

// Issues S (the warpgroup's 64 rows x N, mma C fragments) = A B^T, A the 64 rows of a Sw90 tile L
// and B its N rows of another, all DP columns (zero past D): one wgmma per 16 columns, committed as
// one group. The caller waits (wgmma_wait) before it reads S.
template <typename T, typename L, int N>
__device__ __forceinline__ void tc90_gemm_abt(float (&S)[N / 8][4], const T* sA, const T* sB) {
#pragma unroll
  for (int kk = 0; kk < L::DP / 16; ++kk)
    wgmma_ss<T, N>(S, desc_k_major<L>(sA, kTcRows, kk), desc_k_major<L>(sB, N, kk), kk > 0);
}

// Whether a chunk's product P B with the rows 0 .. 8 NT of the Sw90 tile L at `tile` is summed on
// CUDA cores: where a masked pair meets an inf or NaN of the tile anywhere in the block (the MMA
// would spread 0 * inf to the rows of every warp). Block-wide (a barrier).
template <typename T, typename L, int NT>
__device__ __forceinline__ bool tc90_pb_on_cuda_cores(const T* tile, bool need_mask, int lane) {
  return __syncthreads_or(need_mask && tc_tile_nonfinite<T, L::DP, L::DP>(tile, 8 * NT, lane));
}

// acc += P B on CUDA cores, skipping the zero probabilities (tc_gemm_pb_skip_zero on a Sw90 tile).
template <typename T, typename L, int NT, int CT>
__device__ __forceinline__ void tc90_gemm_pb_cuda_cores(float (&acc)[CT][4], const float (&P)[NT][4],
                                                        const T* tile, int c0, int lane, int64_t D) {
  tc_gemm_pb_skip_zero<T, NT, CT>(
      acc, P, [&](int key, int d) { return tile[L::elem(8 * NT, key, d)]; }, c0, lane, D);
}

// Issues acc (the warpgroup's 64 rows x 8 CT columns from c0) += P B, P as A fragments a (NT / 2
// of them, P rounded to T) and B the rows 0 .. 8 NT of the Sw90 tile L: one wgmma per 16 rows of
// B. The caller fences before, commits and waits.
template <typename T, typename L, int NT, int CT>
__device__ __forceinline__ void tc90_issue_pb(float (&acc)[CT][4], const uint32_t (&a)[NT / 2][4],
                                              const T* tile, int c0) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk)
    wgmma_rs<T, 8 * CT>(acc, a[kk], desc_mn_major<L>(tile, 8 * NT, kk, c0), 1);
}

// P (C fragments) as the A fragments of tc90_issue_pb.
template <typename T, int NT>
__device__ __forceinline__ void tc90_p_fragments(uint32_t (&a)[NT / 2][4], const float (&P)[NT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) c_to_a<T>(a[kk], P[2 * kk], P[2 * kk + 1]);
}

// A product acc += P B whose MMAs are deferred to the next chunk's (the overlap of the kernels
// below): P's A fragments. They must not change until the MMAs issued from them are waited for.
// The caller keeps the stage of B's tile.
template <typename T, typename L, int NT, int CT>
struct Tc90Deferred {
  uint32_t a[NT / 2][4];
  bool pending = false;

  // Issues the pending product (after the caller's wgmma_fence; the caller commits), B the rows
  // of `tile`, columns from c0.
  __device__ __forceinline__ void issue(float (&acc)[CT][4], const T* tile, int c0) const {
    if (pending) tc90_issue_pb<T, L, NT, CT>(acc, a, tile, c0);
  }
  // A chunk's product with its tile B: summed on CUDA cores now (tc90_pb_on_cuda_cores,
  // block-wide), or deferred. The previous one must have been waited for.
  __device__ __forceinline__ void take(float (&acc)[CT][4], const float (&P)[NT][4], const T* tile, int c0,
                                       bool need_mask, int lane, int64_t D) {
    pending = false;
    if (tc90_pb_on_cuda_cores<T, L, NT>(tile, need_mask, lane)) {
      tc90_gemm_pb_cuda_cores<T, L, NT, CT>(acc, P, tile, c0, lane, D);
    } else {
      tc90_p_fragments<T, NT>(a, P);
      pending = true;
    }
  }
  // The last deferred product, issued and waited for.
  __device__ __forceinline__ void flush(float (&acc)[CT][4], const T* tile, int c0) {
    if (!pending) return;
    wgmma_fence();
    issue(acc, tile, c0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    pending = false;
  }
};

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads)
    tc90_fwd_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90FwdCfg<DP>;
  using L = Sw90<DP>;
  constexpr int KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(tc90_smem(smem_raw));                         // [64 rows]
  T* sK = sQ + kTcRows * DP;                                                 // [STAGES][KT rows]
  T* sV = sK + Cfg::STAGES * KT * DP;                                        // [STAGES][KT rows]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + Cfg::STAGES * KT * DP);  // [STAGES]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  tc90_init_stage_barriers(bars, Cfg::STAGES);
  tc90_load_block_rows<T, L>(sQ, p.q, sq, h, tl, base, p.D);
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, warp, lane);
  Tc90Stages stages;
  auto load_kv = [&](const Walk<2>& w, int stage) {
    stages.loaded(stage, tc90_load_pair<T, L>(sK + stage * KT * DP, sV + stage * KT * DP, p.k, p.v, hk, sq, w,
                                              KT, p.D, maps, &bars[stage]));
  };

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float O[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) O[dt][0] = O[dt][1] = O[dt][2] = O[dt][3] = 0.f;

  // The product P V of a chunk is issued with the next chunk's S = Q K^T and runs while the
  // softmax of that S is computed (FlashAttention-3's overlap within a warpgroup): three stages of
  // tiles, since V of the previous chunk is read while K of this one is. pv holds the previous
  // chunk's P until then, its tiles in pv_stage.
  int stage = 0, pv_stage = 0;
  float S[NT][4];
  Tc90Deferred<T, L, NT, DT> pv;
  if (!cur.done) load_kv(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    nxt.next(p.br);  // block-wide: may synchronise
    const int next_stage = stage + 1 == Cfg::STAGES ? 0 : stage + 1;
    if (!nxt.done) load_kv(nxt, next_stage);  // the stage of the chunk before the previous one
    cp_async_commit();
    tc90_tiles_landed<1>();  // everything but the prefetch just issued
    stages.wait(bars, stage);
    const bool skip = cur.skip_chunk();
    const bool work = __syncthreads_or(!skip);  // some warp has work in the chunk
    const T* sKs = sK + stage * KT * DP;
    const T* sVs = sV + stage * KT * DP;
    wgmma_fence();
    if (work) {
      tc90_gemm_abt<T, L, KT>(S, sQ, sKs);
      wgmma_commit();
    }
    if (pv.pending) {
      pv.issue(O, sV + pv_stage * KT * DP, 0);
      wgmma_commit();
    }
    float corr[2] = {1.f, 1.f};
    bool need_mask = false;
    if (work) {
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
      if (pv.pending)
        wgmma_wait<1>();  // S (the older group); the previous P V may still run
      else
        wgmma_wait<0>();
      wgmma_fence_operands(S);
      need_mask = skip || cur.chunk_needs_mask();
      tc_fwd_probs<NT, DROPOUT>(S, m, l, cur, need_mask, sl2, tq, p, keep, corr);
    }
    wgmma_wait<0>();  // the previous P V: O is complete
    wgmma_fence_operands(O);
    pv.pending = false;
    if (work) {
      tc_rescale<DT>(O, corr);
      pv.take(O, S, sVs, 0, need_mask, lane, p.D);
      pv_stage = stage;
    }
    cur = nxt;
    stage = next_stage;
  }
  pv.flush(O, sV + pv_stage * KT * DP, 0);
  cp_async_wait<0>();
  tc_fwd_store<T, DT>(p, sq, h, cur, m, l, O, sl2, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dq                                                                                 */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads)
    tc90_dq_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90DqCfg<DP>;
  using L = Sw90<DP>;
  constexpr int KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(tc90_smem(smem_raw));                         // [64 rows]
  T* sdO = sQ + kTcRows * DP;                                                // [64 rows]
  T* sK = sdO + kTcRows * DP;                                                // [STAGES][KT rows]
  T* sV = sK + Cfg::STAGES * KT * DP;                                        // [STAGES][KT rows]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + Cfg::STAGES * KT * DP);  // [STAGES]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  tc90_init_stage_barriers(bars, Cfg::STAGES);
  tc90_load_block_rows<T, L>(sQ, p.q, sq, h, tl, base, p.D);
  tc90_load_block_rows<T, L>(sdO, p.dout, sq, h, tl, base, p.D);
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, warp, lane);

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float lse2[2], dl[2];
  tc_dq_row_stats(p, sq, h, cur, sl2, lse2, dl);

  Tc90Stages stages;
  auto load_kv = [&](const Walk<2>& w, int stage) {
    stages.loaded(stage, tc90_load_pair<T, L>(sK + stage * KT * DP, sV + stage * KT * DP, p.k, p.v, hk, sq, w,
                                              KT, p.D, maps, &bars[stage]));
  };

  float dQ[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) dQ[dt][0] = dQ[dt][1] = dQ[dt][2] = dQ[dt][3] = 0.f;

  // As the forward: a chunk's dQ += dS K is issued with the next chunk's S and dP and runs while
  // that chunk's dS is computed (which does not touch dQ); three stages of tiles, since K of the
  // previous chunk is read while K and V of this one are.
  int stage = 0, pv_stage = 0;
  float S[NT][4], dP[NT][4];
  Tc90Deferred<T, L, NT, DT> pv;
  if (!cur.done) load_kv(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    nxt.next(p.br);
    const int next_stage = stage + 1 == Cfg::STAGES ? 0 : stage + 1;
    if (!nxt.done) load_kv(nxt, next_stage);  // the stage of the chunk before the previous one
    cp_async_commit();
    tc90_tiles_landed<1>();
    stages.wait(bars, stage);
    const bool skip = cur.skip_chunk();
    const bool work = __syncthreads_or(!skip);
    const T* sKs = sK + stage * KT * DP;
    const T* sVs = sV + stage * KT * DP;
    wgmma_fence();
    if (work) {
      tc90_gemm_abt<T, L, KT>(S, sQ, sKs);
      tc90_gemm_abt<T, L, KT>(dP, sdO, sVs);
      wgmma_commit();
    }
    if (pv.pending) {
      pv.issue(dQ, sK + pv_stage * KT * DP, 0);
      wgmma_commit();
    }
    bool need_mask = false;
    if (work) {
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
      if (pv.pending)
        wgmma_wait<1>();  // S and dP (the older group); the previous dS K may still run
      else
        wgmma_wait<0>();
      wgmma_fence_operands(S);
      wgmma_fence_operands(dP);
      need_mask = skip || cur.chunk_needs_mask();
      tc_dq_scores<NT, DROPOUT>(S, dP, cur, need_mask, sl2, lse2, dl, tq, p, keep);
    }
    wgmma_wait<0>();  // the previous dS K: dQ is complete and the fragments free
    wgmma_fence_operands(dQ);
    pv.pending = false;
    if (work) {
      pv.take(dQ, S, sKs, 0, need_mask, lane, p.D);
      pv_stage = stage;
    }
    cur = nxt;
    stage = next_stage;
  }
  pv.flush(dQ, sK + pv_stage * KT * DP, 0);
  cp_async_wait<0>();
  tc_dq_store<T, DT>(p, sq, h, cur, dQ, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dk, dv                                                                             */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads)
    tc90_dkv_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90DkvCfg<DP>;
  using L = Sw90<DP, Cfg::PW>;
  constexpr int QT = Cfg::QT, NT = QT / 8, DC = Cfg::DC, CT = DC / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sK = reinterpret_cast<T*>(tc90_smem(smem_raw));                     // [64 rows]
  T* sV = sK + kTcRows * DP;                                             // [64 rows]
  T* sQ = sV + kTcRows * DP;                                             // [STAGES][QT rows]
  T* sdO = sQ + Cfg::STAGES * QT * DP;                                   // [STAGES][QT rows]
  float* sL = reinterpret_cast<float*>(sdO + Cfg::STAGES * QT * DP);     // [STAGES][QT] lse, log2 domain
  float* sDl = sL + Cfg::STAGES * QT;                                    // [STAGES][QT] delta
  uint64_t* bars = reinterpret_cast<uint64_t*>(sDl + Cfg::STAGES * QT);  // [STAGES]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_KEYS);
  const int64_t N = sq.N, b = sq.b, hk = blockIdx.y / Cfg::CHUNKS;
  const int c0 = (int)(blockIdx.y % Cfg::CHUNKS) * DC;  // first accumulator column
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;

  tc90_init_stage_barriers(bars, Cfg::STAGES);
  tc90_load_block_rows<T, L>(sK, p.k, sq, hk, tl, base, p.D);
  tc90_load_block_rows<T, L>(sV, p.v, sq, hk, tl, base, p.D);
  cp_async_commit();

  Walk<2> cur = tc_walk_start(p, tl, N, base, hk * p.G, (int)p.G, DA_ROWS_ARE_KEYS, QT, warp, lane);

  const int64_t lse_all = b * p.Hq * p.N + sq.start;
  const float* delta_all = static_cast<const float*>(p.delta) + b * p.Hq * p.N + sq.start;
  const float sl2 = (float)(p.scale * DA_LOG2E);
  const double unit = da_score_unit(p.scale, sl2);

  // Queries o0 .. o0+QT-1 of the walk's current head and segment: q and dout rows, lse, delta.
  Tc90Stages stages;
  auto load_q = [&](const Walk<2>& w, int stage) {
    stages.loaded(stage, tc90_load_pair<T, L>(sQ + stage * QT * DP, sdO + stage * QT * DP, p.q, p.dout,
                                              w.head(), sq, w, QT, p.D, maps, &bars[stage]));
    tc_dkv_load_stats(p, w, QT, lse_all, delta_all, unit, sL + stage * QT, sDl + stage * QT);
  };

  float dK[CT][4], dV[CT][4];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    dK[ct][0] = dK[ct][1] = dK[ct][2] = dK[ct][3] = 0.f;
    dV[ct][0] = dV[ct][1] = dV[ct][2] = dV[ct][3] = 0.f;
  }

  // As the forward: a chunk's dV += P^T dO and dK += dS^T Q are issued with the next chunk's S^T
  // and dP^T and run while that chunk's P^T and dS^T are computed; three stages of tiles.
  int stage = 0, pv_stage = 0;
  float St[NT][4], dPt[NT][4];  // (the warpgroup's 64 keys) x (QT queries)
  Tc90Deferred<T, L, NT, CT> pv_v, pv_k;
  if (!cur.done) load_q(cur, 0);
  cp_async_commit();
  while (!cur.done) {
    Walk<2> nxt = cur;
    nxt.next(p.br);
    const int next_stage = stage + 1 == Cfg::STAGES ? 0 : stage + 1;
    if (!nxt.done) load_q(nxt, next_stage);  // the stage of the chunk before the previous one
    cp_async_commit();
    tc90_tiles_landed<1>();
    stages.wait(bars, stage);
    const bool skip = cur.skip_chunk();
    const bool work = __syncthreads_or(!skip);  // (the barrier also publishes sL, sDl)
    const T* sQs = sQ + stage * QT * DP;
    const T* sdOs = sdO + stage * QT * DP;
    wgmma_fence();
    if (work) {
      tc90_gemm_abt<T, L, QT>(St, sK, sQs);
      tc90_gemm_abt<T, L, QT>(dPt, sV, sdOs);
      wgmma_commit();
    }
    const bool pv = pv_v.pending || pv_k.pending;
    pv_v.issue(dV, sdO + pv_stage * QT * DP, c0);
    pv_k.issue(dK, sQ + pv_stage * QT * DP, c0);
    if (pv) wgmma_commit();
    bool need_mask = false;
    if (work) {
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + cur.head(), sq.start, tq) : 0u;
      if (pv)
        wgmma_wait<1>();  // S^T and dP^T (the older group); the previous products may still run
      else
        wgmma_wait<0>();
      wgmma_fence_operands(St);
      wgmma_fence_operands(dPt);
      need_mask = skip || cur.chunk_needs_mask();
      tc_dkv_scores<NT, DROPOUT>(St, dPt, cur, need_mask, sl2, sL + stage * QT, sDl + stage * QT, tq, p,
                                 keep);
    }
    wgmma_wait<0>();  // the previous products: dV and dK complete, the fragments free
    wgmma_fence_operands(dV);
    wgmma_fence_operands(dK);
    pv_v.pending = pv_k.pending = false;
    if (work) {
      pv_v.take(dV, St, sdOs, c0, need_mask, lane, p.D);
      pv_k.take(dK, dPt, sQs, c0, need_mask, lane, p.D);
      pv_stage = stage;
    }
    cur = nxt;
    stage = next_stage;
  }
  pv_v.flush(dV, sdO + pv_stage * QT * DP, c0);
  pv_k.flush(dK, sQ + pv_stage * QT * DP, c0);
  cp_async_wait<0>();
  tc_dkv_store<T, CT>(p, sq, hk, c0, cur, dK, dV, tq);
#endif
}

// The tensor maps of pass `kernel` (kFwd, kDq: k and v; kDkv: q and dout), boxes of box_rows rows
// of the Sw90 layout L's panels, encoded by encode(const TmaBox&, void* map) -> bool (the driver's
// cuTensorMapEncodeTiled on the GPU, the emulation's own encoding in the tests).
template <typename L, typename Encode>
inline void tc90_maps(TmaMaps* m, int kernel, const Params& p, int box_rows, Encode encode) {
  if (kernel == kDkv)
    tma_make_maps(m, p.br, p.q, p.dout, p.B, p.N, p.Hq, p.D, L::PW, box_rows, encode);
  else
    tma_make_maps(m, p.br, p.k, p.v, p.B, p.piece.nk > 0 ? p.piece.nk : p.N, p.Hkv, p.D, L::PW, box_rows,
                  encode);
}

#ifndef DA_CUDA_EMULATION  // the CPU emulation of the tests calls the kernels itself

/* ------------------------------------------------------------------------------------------ */
/* Launchers                                                                                    */
/* ------------------------------------------------------------------------------------------ */

// Encodes a tensor map with the driver's cuTensorMapEncodeTiled (tc90_dispatch.cu); false where
// the driver has none or refuses the description (those chunks then load with cp.async).
bool tma_encode(const TmaBox& box, void* map);

// Launches a kernel of this file with its tensor maps for pass `kernel`.
template <typename L, typename Kernel>
inline void tc90_launch(Kernel kernel, int pass, int box_rows, dim3 grid, int smem, const Params& p,
                        cudaStream_t stream, SmemOptIn& opt_in) {
  if (!smem_opt_in(opt_in, kernel, smem)) return;  // no launch; the caller's launch check raises the error
  TmaMaps maps;
  maps.count = 0;
  if (p.tma) tc90_maps<L>(&maps, pass, p, box_rows, tma_encode);  // none: every chunk by cp.async
  kernel<<<grid, kTcThreads, smem, stream>>>(p, maps);
}

template <typename T, int DP>
TcConfig tc_fwd90_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, Tc90FwdCfg<DP>::SMEM, 1};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];  // without and with dropout
    tc90_launch<Sw90<DP>>(tc_dropout(p) ? tc90_fwd_kernel<T, DP, true> : tc90_fwd_kernel<T, DP, false>, kFwd,
                          Tc90FwdCfg<DP>::KT, grid, cfg.smem_bytes, p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

template <typename T, int DP>
TcConfig tc_dq90_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, Tc90DqCfg<DP>::SMEM, 1};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];
    tc90_launch<Sw90<DP>>(tc_dropout(p) ? tc90_dq_kernel<T, DP, true> : tc90_dq_kernel<T, DP, false>, kDq,
                          Tc90DqCfg<DP>::KT, grid, cfg.smem_bytes, p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

template <typename T, int DP>
TcConfig tc_dkv90_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, Tc90DkvCfg<DP>::SMEM, Tc90DkvCfg<DP>::CHUNKS};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)(p.Hkv * cfg.d_chunks),
                    (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];
    tc90_launch<Sw90<DP, Tc90DkvCfg<DP>::PW>>(
        tc_dropout(p) ? tc90_dkv_kernel<T, DP, true> : tc90_dkv_kernel<T, DP, false>, kDkv,
        Tc90DkvCfg<DP>::QT, grid, cfg.smem_bytes, p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

#endif  // DA_CUDA_EMULATION

}  // namespace cuda
}  // namespace dilated_attention
