// The sm90 kernels (float16/bfloat16, sm_90a): the forward, dq and dk/dv passes of tc_kernels.cuh on
// the warpgroup MMA, warp-specialised as in FlashAttention-3.
//
// A thread block is three warpgroups (384 threads) owning 128 rows of one head (a tiling of 8 warps
// of 16 rows, tiling.h). Warpgroup 0 is the producer: it gives back registers (setmaxnreg) and one
// warp of it walks the block's rows (tiling.h's walk over every branch and segment, its position
// and the block's constants kept in shared memory, Tc90Walker), and for each chunk of the other
// side that some row of the block works on (the causal skip) waits for a free stage of shared
// memory, publishes the chunk (its position in the walk) there and loads its tiles: by the tensor copy engine (tma.h: one strided box per panel, completing on the stage's
// mbarrier) or, where no tensor map reaches them, by cp.async completing on the same mbarrier. The
// two consumer warpgroups take more registers, each owning 64 of the rows; each waits for a stage,
// adopts the published position (rescanning its rows where the segment changed), computes the
// chunk, and releases the stage (an mbarrier of one arrival per consumer warpgroup) once its MMAs
// have read it.
// Five stages: a consumer holds two (the chunk it computes and the previous one, whose product with
// probabilities still runs), the producer fills the other three ahead (dq at 256 takes 218 KB of
// shared memory's 227, dk/dv at 256 220); four (two ahead) where wider chunks leave no room for
// five: the forward at head dim 256, dq at 128 and 192, dk/dv at 192 (their Cfg's STAGES,
// tc90_pipe.cuh).
//
// What a consumer computes is the warpgroup kernel's chunk: S = Q K^T is one wgmma.mma_async
// m64n{KT}k16 per 16 columns of the head dim, both operands read from shared memory by descriptors
// (no ldmatrix), and O += P V one m64n{DP}k16 per 16 keys, P from registers (the accumulators of S
// turned into A fragments, as mma.sync takes them) and V from shared memory. Tiles are stored in
// the swizzled layout of sm90.cuh (Sw90). Each pass issues a chunk's products with probabilities
// together with the next chunk's products of two tiles and computes that chunk's softmax (or dS)
// while they run (FlashAttention-3's overlap within a warpgroup).
//
// Every warp of a warpgroup takes part in each MMA, so a warpgroup skips a chunk only where none of
// its 64 rows meets it (the producer flags those chunks per warpgroup in the slot; the sm80 kernel
// skips per warp): a skipping warpgroup runs its pending product with probabilities (which holds
// the previous stage, so that the producer can go on) and releases the stage, with no MMA, softmax
// or scan of the chunk. In a chunk it computes, the rows of a warp with no active pair in it are
// masked (their probabilities are 0), and every step issues both groups of MMAs (ptxas serialises
// MMAs under conditions), a zero product where none is pending. A chunk whose masked
// pairs meet a non-finite value of V is summed on CUDA cores, skipping the zero probabilities, in
// every warp of the warpgroup (tc_gemm_pb_skip_zero), so that the value reaches only the rows that
// read it. That warpgroup-wide decision uses a named barrier per warpgroup; nothing after the roles
// split synchronises the block.
//
// The backward's two passes are those of tc_kernels.cuh the same way: dq (rows = queries) has
// S = Q K^T and dP = dO V^T from shared memory and dQ += dS K with dS from registers; dk/dv (rows =
// keys, over the G query heads of the group; the producer warp also copies the queries' lse and
// delta, by cp.async, and a second warp of its warpgroup turns lse into base 2, hi and lo, once
// they landed)
// S^T = K Q^T, dP^T = V dO^T, dV += P^T dO and dK += dS^T Q, head dims above 128 split over two
// thread blocks by columns. Results are the sm80 kernels' (the same roundings and f32
// accumulation; the sums' order inside an MMA may differ), so either pass may follow either
// forward.
#pragma once

#include "tc90_pipe.cuh"

#if defined(DA_CUDA_EMULATION) && !defined(__grid_constant__)
#define __grid_constant__
#endif

namespace dilated_attention {
namespace cuda {

/* ------------------------------------------------------------------------------------------ */
/* The consumers                                                                                */
/* ------------------------------------------------------------------------------------------ */

// A consumer thread's place in the pipe of STAGES stages: the stage it reads next and the parity of
// each stage's next phase of full.
template <int STAGES>
struct Tc90Reader {
  int stage = 0;
  uint32_t parity = 0;

  // The next published chunk (waits for its stage). Returns false at the end; else *skip says
  // whether no row of consumer warpgroup g meets the chunk (the producer's flag, the same in the
  // whole warpgroup), and the walk adopts the chunk where it does. Tiles loaded by cp.async are
  // fenced to the MMAs here.
  template <int ROWS, typename I>
  __device__ __forceinline__ bool next(Tc90Pipe* pipe, Walk<ROWS, I>& cur, int g, bool* skip) {
    mbar_wait(&pipe->full[stage], (parity >> stage) & 1);
    parity ^= 1u << stage;
    const Tc90Chunk& c = pipe->slot[stage];
    const int flags = __shfl_sync(DA_FULL_MASK, c.flags, 0);  // (known uniform: the loop holds MMAs)
    if (flags & kTc90Done) return false;
    if (!(flags & kTc90Tma)) fence_proxy_async();
    *skip = (flags & (kTc90Skip << g)) != 0;
    if (!*skip) cur.adopt(c.at, c.o0);  // (a skipped chunk's segment is adopted with the next one used)
    return true;
  }
  __device__ __forceinline__ void advance() { stage = stage + 1 == STAGES ? 0 : stage + 1; }
};

// This warpgroup's release of a stage: one arrival, by its thread 0 (wtid), once every thread of
// the warpgroup is done with the stage, which the callers ensure without a barrier of their own:
// the stage's MMAs waited for (a warpgroup's MMA is one operation of its four warps, complete for
// all of them when one waits for it, as CUTLASS's consumer_release takes it), and its reads on
// CUDA cores (the slot, lse and delta, the non-finite scan) made before a named barrier of the
// warpgroup that thread 0 has passed: that of Tc90Deferred::take in the chunk's step, the one
// after a product on CUDA cores, or the skip's. The producer reuses the stage once both consumer
// warpgroups have released it.
__device__ __forceinline__ void tc90_release(Tc90Pipe* pipe, int stage, int wtid) {
  if (wtid == 0) mbar_arrive(&pipe->empty[stage]);
}

// The end of a chunk that no row of the warpgroup meets (its pending products already ran): once
// every warp has read the slot, the chunk's stage goes back and the reader moves on.
template <typename Reader>
__device__ __forceinline__ void tc90_skip_stage(Tc90Pipe* pipe, Reader& rd, int bar, int wtid) {
  named_barrier_or(bar, 128, false);  // every warp has read the slot (tc90_release)
  tc90_release(pipe, rd.stage, wtid);
  rd.advance();
}

// A consumer thread's walk: 32-bit, as the producer's (tiling.h: every index is below 2 N < 2^31),
// so that it holds fewer registers and its divisions (da_row_index, where a segment changes) are
// 32-bit ones. Whatever a walk field enters that is an element offset or a row of lse and delta is
// formed in 64 bits: the helpers of tc_kernels.cuh read the positions into int64_t, and multiply
// them only by the tensors' int64_t strides.
using Tc90Walk = Walk<2, int32_t>;

// The consumer's walk: the rows of warp cw (0 .. 7) of the tiling (padding rows held at N), before
// its first chunk.
__device__ __forceinline__ Tc90Walk tc90_consumer_walk(const Params& p, const da_tiling& tl, int64_t N,
                                                       int64_t base, int64_t h0, int G, int rows_are,
                                                       int other_tile, int cw, int lane) {
  Tc90Walk w = tc_walk_init<2, int32_t>(p, tl, N, base, h0, G, rows_are, other_tile);
  tc_thread_rows(tl, base, cw, lane, N, w.pos);
  return w;
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

// A product acc += P B whose MMAs are deferred to the next chunk's (the overlap of the kernels
// below): P's A fragments. They must not change until the MMAs issued from them are waited for.
// The caller keeps the stage of B's tile. Every step issues a deferred product, so that the
// kernels' MMAs are not under conditions (ptxas serialises the MMAs of a loop whose products are
// conditional, C7514): where none is pending (the first chunk, or after a chunk summed on CUDA
// cores) the fragments are zero and B the block's zero tile, which adds exact zeros.
template <typename T, typename L, int NT, int CT>
struct Tc90Deferred {
  uint32_t a[NT / 2][4];
  bool pending = false;

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) a[kk][0] = a[kk][1] = a[kk][2] = a[kk][3] = 0u;
    pending = false;
  }
  // Pins the fragments in their registers (before the caller's wgmma_fence).
  __device__ __forceinline__ void pin() { wgmma_fence_operands(a); }
  // Issues the product (after the caller's wgmma_fence; the caller commits): B the rows of `tile`
  // where one is pending, else of `zero`; columns from c0.
  __device__ __forceinline__ void issue(float (&acc)[CT][4], const T* tile, const T* zero, int c0) const {
    tc90_issue_pb<T, L, NT, CT>(acc, a, pending ? tile : zero, c0);
  }
  // A chunk's product with its tile B: summed on CUDA cores now, where a masked pair meets an inf
  // or NaN of the tile anywhere in the warpgroup (the MMA would spread 0 * inf to the rows of every
  // warp; the OR of the warpgroup's named barrier `bar`), else deferred. The previous one must have
  // been waited for.
  __device__ __forceinline__ void take(float (&acc)[CT][4], const float (&P)[NT][4], const T* tile, int c0,
                                       bool need_mask, int lane, int64_t D, int bar) {
    if (named_barrier_or(bar, 128, need_mask && tc_tile_nonfinite<T, L::DP, L::DP>(tile, 8 * NT, lane))) {
      tc_gemm_pb_skip_zero<T, NT, CT, true>(
          acc, P, [&](int key, int d) { return tile[L::elem(8 * NT, key, d)]; }, c0, lane, D);
      named_barrier_or(bar, 128, false);  // every warp's reads of the tile made (tc90_release)
      clear();
    } else {
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) c_to_a<T>(a[kk], P[2 * kk], P[2 * kk + 1]);
      pending = true;
    }
  }
  // The last deferred product, issued and waited for.
  __device__ __forceinline__ void flush(float (&acc)[CT][4], const T* tile, int c0) {
    if (!pending) return;
    pin();
    wgmma_fence_operands(acc);
    wgmma_fence();
    tc90_issue_pb<T, L, NT, CT>(acc, a, tile, c0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    pending = false;
  }
};

// Zeroes the block's zero tile (`bytes`, by all its threads, before the roles split: the barrier of
// tc90_role follows), fenced for the MMAs.
__device__ __forceinline__ void tc90_zero_tile(void* tile, int bytes) {
  uint4* t = reinterpret_cast<uint4*>(tile);
  for (int i = threadIdx.x; i < bytes / 16; i += kTc90Threads) t[i] = make_uint4(0u, 0u, 0u, 0u);
  fence_proxy_async();
}

#if defined(DA_CUDA_EMULATION)
// The chunks that consumer warpgroups skipped (one count per warpgroup) and computed, per pass
// (kFwd, kDq, kDkv): the emulated tests check that a chunk none of a warpgroup's rows meets is
// skipped.
inline long long (&tc90_emu_chunks())[3][2] {
  static long long n[3][2] = {};
  return n;
}
#define DA_TC90_COUNT(pass, skipped, wtid)                         \
  do {                                                             \
    if ((wtid) == 0) ++tc90_emu_chunks()[pass][(skipped) ? 0 : 1]; \
  } while (0)
#else
#define DA_TC90_COUNT(pass, skipped, wtid) \
  do {                                     \
  } while (0)
#endif

// The roles of a block's threads, after its barriers are set up: warpgroup 0 produces (only its
// warp 0 works), 1 and 2 consume. Each role's code starts with its setmaxnreg (tc90_producer_regs,
// tc90_consumer_regs), which must dominate it: ptxas gives the code after it that many registers.
struct Tc90Role {
  int g;     // consumer warpgroup (0, 1), or -1 for the producer warpgroup
  int wtid;  // thread in its warpgroup
  int warp;  // warp in its warpgroup
  int lane;
};

__device__ __forceinline__ void tc90_producer_regs() {
  setmaxnreg_dec<kTc90ProducerRegs>();
}
__device__ __forceinline__ void tc90_consumer_regs() {
  setmaxnreg_inc<kTc90ConsumerRegs>();
}

__device__ __forceinline__ Tc90Role tc90_role(Tc90Pipe* pipe, int full_arrivals = 32) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kTc90Stages; ++s) {
      mbar_init(&pipe->full[s], full_arrivals);  // the producer warp's lanes (dk/dv: and the stats warp's)
      mbar_init(&pipe->stats[s], 32);
      mbar_init(&pipe->empty[s], kTc90Consumers);  // one arrival per consumer warpgroup
    }
    fence_barrier_init();
  }
  __syncthreads();
  // The warpgroup and warp indices broadcast from lane 0, so that the compiler knows them uniform in
  // each warp (the roles' branches do not diverge; a wgmma in a divergent path is serialised).
  const int wg = __shfl_sync(DA_FULL_MASK, (int)threadIdx.x / 128, 0);
  const int warp = __shfl_sync(DA_FULL_MASK, ((int)threadIdx.x % 128) >> 5, 0);
  return Tc90Role{wg - 1, (int)threadIdx.x % 128, warp, (int)threadIdx.x & 31};
}

// The producer warpgroup of the forward and dq passes (rows = queries of head h): its registers
// given back, then its first warp loads K and V (head h / G) of each chunk into the stages' tiles
// sK, sV (KT rows each) of STAGES stages.
template <typename T, typename L, int KT, int STAGES>
__device__ __forceinline__ void tc90_produce_kv(const Params& p, const TmaMaps& maps, const SeqRows& sq,
                                                const da_tiling& tl, int64_t base, int64_t h, T* sK, T* sV,
                                                Tc90Pipe* pipe, const Tc90Role& role) {
  tc90_producer_regs();
  if (role.warp != 0) return;
  const int lane = role.lane;
  const int32_t hk = (int32_t)(h / p.G);
  Tc90Walker& wk = pipe->walker;
  tc90_walker_init(wk, sq, tl, base, h, 1, lane);
  tc90_produce<KT, DA_ROWS_ARE_QUERIES, STAGES, false>(
      p, pipe, lane, [&](int32_t o0) { return tc90_chunk_map(maps, wk, o0, KT); },
      [&](int stage, int32_t o0, int mi) {
        tc90_load_pair<T, L>(sK + stage * KT * L::DP, sV + stage * KT * L::DP, p.k, p.v, hk, wk, o0, KT, p.D,
                             maps, mi, &pipe->full[stage], lane);
      });
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                      */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTc90Threads, 1)
    tc90_fwd_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90FwdCfg<DP>;
  using L = Sw90<DP>;
  constexpr int KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(tc90_smem(smem_raw));  // [consumer][64 rows]
  T* sK = sQ + kTc90Consumers * kTcRows * DP;         // [stage][KT rows]
  T* sV = sK + Cfg::STAGES * KT * DP;                 // [stage][KT rows]
  T* sZ = sV + Cfg::STAGES * KT * DP;                 // [KT rows] of zeros
  Tc90Pipe* pipe = reinterpret_cast<Tc90Pipe*>(sZ + KT * DP);

  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;
  tc90_zero_tile(sZ, KT * DP * 2);
  const Tc90Role role = tc90_role(pipe);
  const int lane = role.lane, tq = lane & 3;

  if (role.g < 0) {  // the producer: K and V of each chunk
    tc90_produce_kv<T, L, KT, Cfg::STAGES>(p, maps, sq, tl, base, h, sK, sV, pipe, role);
    return;
  }

  tc90_consumer_regs();
  const int g = role.g, bar = 1 + g;
  T* sQg = sQ + g * kTcRows * DP;
  tc90_load_group_rows<T, L>(sQg, p.q, sq, h, tl, base, p.D, g, role.wtid);
  tc90_group_tiles_landed(g);
  Tc90Walk cur = tc90_consumer_walk(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, 4 * g + role.warp, lane);

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float O[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) O[dt][0] = O[dt][1] = O[dt][2] = O[dt][3] = 0.f;

  // The product P V of a chunk is issued with the next chunk's S = Q K^T and runs while the
  // softmax of that S is computed (FlashAttention-3's overlap within a warpgroup). pv holds the
  // previous chunk's P until then, its tiles in pv_stage (released once it has run).
  int pv_stage = 0;
  float S[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.f;
  Tc90Deferred<T, L, NT, DT> pv;
  pv.clear();
  Tc90Reader<Cfg::STAGES> rd;
  bool skip;
  while (rd.next(pipe, cur, g, &skip)) {
    const int stage = rd.stage;
    DA_TC90_COUNT(kFwd, skip, role.wtid);
    if (skip) {  // no row of the warpgroup meets the chunk: the pending P V runs now, the stages go back
      if (pv.pending) {
        pv.flush(O, sV + pv_stage * KT * DP, 0);
        tc90_release(pipe, pv_stage, role.wtid);
      }
      tc90_skip_stage(pipe, rd, bar, role.wtid);
      continue;
    }
    // A warp with no active pair in the chunk masks all of it (its probabilities are 0: the
    // chunk changes nothing in its rows).
    const bool need_mask = cur.skip_chunk() || cur.chunk_needs_mask();
    const T* sKs = sK + stage * KT * DP;
    const T* sVs = sV + stage * KT * DP;
    wgmma_fence_operands(S);
    wgmma_fence_operands(O);
    pv.pin();
    wgmma_fence();
    tc90_gemm_abt<T, L, KT>(S, sQg, sKs);
    wgmma_commit();
    pv.issue(O, sV + pv_stage * KT * DP, sZ, 0);
    wgmma_commit();
    const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
    wgmma_wait<1>();  // S (the older group); the previous P V may still run
    wgmma_fence_operands(S);
    float corr[2];
    tc_fwd_probs<NT, DROPOUT>(S, m, l, cur, need_mask, sl2, tq, p, keep, corr);
    wgmma_wait<0>();  // the previous P V: O is complete, its stage read
    wgmma_fence_operands(O);
    if (pv.pending) tc90_release(pipe, pv_stage, role.wtid);
    tc_rescale<DT>(O, corr);
    pv.take(O, S, sVs, 0, need_mask, lane, p.D, bar);
    if (pv.pending)
      pv_stage = stage;
    else
      tc90_release(pipe, stage, role.wtid);
    rd.advance();
  }
  pv.flush(O, sV + pv_stage * KT * DP, 0);
  tc_fwd_store<T, DT>(p, sq, h, cur, m, l, O, sl2, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dq                                                                                 */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTc90Threads, 1)
    tc90_dq_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90DqCfg<DP>;
  using L = Sw90<DP>;
  constexpr int KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sQ = reinterpret_cast<T*>(tc90_smem(smem_raw));  // [consumer][64 rows]
  T* sdO = sQ + kTc90Consumers * kTcRows * DP;        // [consumer][64 rows]
  T* sK = sdO + kTc90Consumers * kTcRows * DP;        // [stage][KT rows]
  T* sV = sK + Cfg::STAGES * KT * DP;                 // [stage][KT rows]
  T* sZ = sV + Cfg::STAGES * KT * DP;                 // [KT rows] of zeros
  Tc90Pipe* pipe = reinterpret_cast<Tc90Pipe*>(sZ + KT * DP);

  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;
  tc90_zero_tile(sZ, KT * DP * 2);
  const Tc90Role role = tc90_role(pipe);
  const int lane = role.lane, tq = lane & 3;

  if (role.g < 0) {  // the producer: K and V of each chunk
    tc90_produce_kv<T, L, KT, Cfg::STAGES>(p, maps, sq, tl, base, h, sK, sV, pipe, role);
    return;
  }

  tc90_consumer_regs();
  const int g = role.g, bar = 1 + g;
  T* sQg = sQ + g * kTcRows * DP;
  T* sdOg = sdO + g * kTcRows * DP;
  tc90_load_group_rows<T, L>(sQg, p.q, sq, h, tl, base, p.D, g, role.wtid);
  tc90_load_group_rows<T, L>(sdOg, p.dout, sq, h, tl, base, p.D, g, role.wtid);
  tc90_group_tiles_landed(g);
  Tc90Walk cur = tc90_consumer_walk(p, tl, N, base, h, 1, DA_ROWS_ARE_QUERIES, KT, 4 * g + role.warp, lane);

  const float sl2 = (float)(p.scale * DA_LOG2E);
  float lse2[2], lse2lo[2], dl[2];
  tc_dq_row_stats(p, sq, h, cur, sl2, lse2, lse2lo, dl);

  float dQ[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) dQ[dt][0] = dQ[dt][1] = dQ[dt][2] = dQ[dt][3] = 0.f;

  // As the forward: a chunk's dQ += dS K is issued with the next chunk's S and dP and runs while
  // that chunk's dS is computed (which does not touch dQ).
  int pv_stage = 0;
  float S[NT][4], dP[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.f;
    dP[nt][0] = dP[nt][1] = dP[nt][2] = dP[nt][3] = 0.f;
  }
  Tc90Deferred<T, L, NT, DT> pv;
  pv.clear();
  Tc90Reader<Cfg::STAGES> rd;
  bool skip;
  while (rd.next(pipe, cur, g, &skip)) {
    const int stage = rd.stage;
    DA_TC90_COUNT(kDq, skip, role.wtid);
    if (skip) {  // (as the forward)
      if (pv.pending) {
        pv.flush(dQ, sK + pv_stage * KT * DP, 0);
        tc90_release(pipe, pv_stage, role.wtid);
      }
      tc90_skip_stage(pipe, rd, bar, role.wtid);
      continue;
    }
    const bool need_mask = cur.skip_chunk() || cur.chunk_needs_mask();  // (as the forward)
    const T* sKs = sK + stage * KT * DP;
    const T* sVs = sV + stage * KT * DP;
    // Dropout's draws, while S and dP run (or before they are issued, Cfg::DRAW_FIRST).
    uint32_t keep = 0u;
    if (DROPOUT && Cfg::DRAW_FIRST) keep = tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq);
    wgmma_fence_operands(S);
    wgmma_fence_operands(dP);
    wgmma_fence_operands(dQ);
    pv.pin();
    wgmma_fence();
    tc90_gemm_abt<T, L, KT>(S, sQg, sKs);
    tc90_gemm_abt<T, L, KT>(dP, sdOg, sVs);
    wgmma_commit();
    pv.issue(dQ, sK + pv_stage * KT * DP, sZ, 0);
    wgmma_commit();
    if (DROPOUT && !Cfg::DRAW_FIRST) keep = tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq);
    wgmma_wait<1>();  // S and dP (the older group); the previous dS K may still run
    wgmma_fence_operands(S);
    wgmma_fence_operands(dP);
    tc_dq_scores<NT, DROPOUT>(S, dP, cur, need_mask, sl2, lse2, lse2lo, dl, tq, p, keep);
    wgmma_wait<0>();  // the previous dS K: dQ is complete, the fragments free, its stage read
    wgmma_fence_operands(dQ);
    if (pv.pending) tc90_release(pipe, pv_stage, role.wtid);
    pv.take(dQ, S, sKs, 0, need_mask, lane, p.D, bar);
    if (pv.pending)
      pv_stage = stage;
    else
      tc90_release(pipe, stage, role.wtid);
    rd.advance();
  }
  pv.flush(dQ, sK + pv_stage * KT * DP, 0);
  tc_dq_store<T, DT>(p, sq, h, cur, dQ, tq);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Backward: dk, dv                                                                             */
/* ------------------------------------------------------------------------------------------ */

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTc90Threads, 1)
    tc90_dkv_kernel(const Params p, const __grid_constant__ TmaMaps maps) {
#if DA_SM90A
  using Cfg = Tc90DkvCfg<DP>;
  using L = Sw90<DP, Cfg::PW>;
  constexpr int QT = Cfg::QT, NT = QT / 8, DC = Cfg::DC, CT = DC / 8;
  DA_EXTERN_SMEM(smem_raw);
  T* sK = reinterpret_cast<T*>(tc90_smem(smem_raw));                      // [consumer][64 rows]
  T* sV = sK + kTc90Consumers * kTcRows * DP;                             // [consumer][64 rows]
  T* sQ = sV + kTc90Consumers * kTcRows * DP;                             // [stage][QT rows]
  T* sdO = sQ + Cfg::STAGES * QT * DP;                                    // [stage][QT rows]
  T* sZ = sdO + Cfg::STAGES * QT * DP;                                    // [QT rows] of zeros
  unsigned char* sLraw = reinterpret_cast<unsigned char*>(sZ + QT * DP);  // [stage][QT] lse as saved
  float* sL = reinterpret_cast<float*>(sLraw + Cfg::STAGES * QT * 8);     // [stage][QT] lse, log2 domain
  float* sLlo = sL + Cfg::STAGES * QT;                                    // [stage][QT] its low part
  float* sDl = sLlo + Cfg::STAGES * QT;                                   // [stage][QT] delta
  Tc90Pipe* pipe = reinterpret_cast<Tc90Pipe*>(sDl + Cfg::STAGES * QT);

  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_KEYS);
  const int64_t N = sq.N, b = sq.b, hk = blockIdx.y / Cfg::CHUNKS;
  const int c0 = (int)(blockIdx.y % Cfg::CHUNKS) * DC;  // first accumulator column
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;
  tc90_zero_tile(sZ, QT * DP * 2);
  const Tc90Role role = tc90_role(pipe, 64);
  const int lane = role.lane, tq = lane & 3;
  const float sl2 = (float)(p.scale * DA_LOG2E);

  // The producer: warp 0 copies q and dout of each chunk, and the queries' lse and delta, which
  // warp 1 (the stats warp) turns into base 2 once landed.
  if (role.g < 0) {
    tc90_producer_regs();
    if (role.warp == 1) {
      tc90_convert_stats<QT, Cfg::STAGES>(p, pipe, sLraw, sL, sLlo, sl2, lane);
      return;
    }
    if (role.warp != 0) return;
    Tc90Walker& wk = pipe->walker;
    tc90_walker_init(wk, sq, tl, base, hk * p.G, (int)p.G, lane);
    tc90_produce<QT, DA_ROWS_ARE_KEYS, Cfg::STAGES, true>(
        p, pipe, lane, [&](int32_t o0) { return tc90_chunk_map(maps, wk, o0, QT); },
        [&](int stage, int32_t o0, int mi) {
          tc90_load_stats<QT>(p, wk, o0, sLraw + stage * QT * 8, sDl + stage * QT, &pipe->stats[stage], lane);
          tc90_load_pair<T, L>(sQ + stage * QT * DP, sdO + stage * QT * DP, p.q, p.dout, wk.h0 + wk.at.gi, wk,
                               o0, QT, p.D, maps, mi, &pipe->full[stage], lane);
        });
    return;
  }

  tc90_consumer_regs();
  const int g = role.g, bar = 1 + g;
  T* sKg = sK + g * kTcRows * DP;
  T* sVg = sV + g * kTcRows * DP;
  tc90_load_group_rows<T, L>(sKg, p.k, sq, hk, tl, base, p.D, g, role.wtid);
  tc90_load_group_rows<T, L>(sVg, p.v, sq, hk, tl, base, p.D, g, role.wtid);
  tc90_group_tiles_landed(g);
  Tc90Walk cur =
      tc90_consumer_walk(p, tl, N, base, hk * p.G, (int)p.G, DA_ROWS_ARE_KEYS, QT, 4 * g + role.warp, lane);

  float dK[CT][4], dV[CT][4];
#pragma unroll
  for (int ct = 0; ct < CT; ++ct) {
    dK[ct][0] = dK[ct][1] = dK[ct][2] = dK[ct][3] = 0.f;
    dV[ct][0] = dV[ct][1] = dV[ct][2] = dV[ct][3] = 0.f;
  }

  // As the forward: a chunk's dV += P^T dO and dK += dS^T Q are issued with the next chunk's S^T
  // and dP^T and run while that chunk's P^T and dS^T are computed.
  int pv_stage = 0;
  float St[NT][4], dPt[NT][4];  // (the warpgroup's 64 keys) x (QT queries)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    St[nt][0] = St[nt][1] = St[nt][2] = St[nt][3] = 0.f;
    dPt[nt][0] = dPt[nt][1] = dPt[nt][2] = dPt[nt][3] = 0.f;
  }
  Tc90Deferred<T, L, NT, CT> pv_v, pv_k;
  pv_v.clear();
  pv_k.clear();
  Tc90Reader<Cfg::STAGES> rd;
  bool skip;
  while (rd.next(pipe, cur, g, &skip)) {
    const int stage = rd.stage;
    DA_TC90_COUNT(kDkv, skip, role.wtid);
    if (skip) {  // no key of the warpgroup is seen by the chunk's queries (as the forward)
      if (pv_v.pending || pv_k.pending) {
        pv_v.flush(dV, sdO + pv_stage * QT * DP, c0);
        pv_k.flush(dK, sQ + pv_stage * QT * DP, c0);
        tc90_release(pipe, pv_stage, role.wtid);
      }
      tc90_skip_stage(pipe, rd, bar, role.wtid);
      continue;
    }
    const bool need_mask = cur.skip_chunk() || cur.chunk_needs_mask();  // (as the forward)
    const T* sQs = sQ + stage * QT * DP;
    const T* sdOs = sdO + stage * QT * DP;
    wgmma_fence_operands(St);
    wgmma_fence_operands(dPt);
    wgmma_fence_operands(dV);
    wgmma_fence_operands(dK);
    pv_v.pin();
    pv_k.pin();
    wgmma_fence();
    tc90_gemm_abt<T, L, QT>(St, sKg, sQs);
    tc90_gemm_abt<T, L, QT>(dPt, sVg, sdOs);
    wgmma_commit();
    pv_v.issue(dV, sdO + pv_stage * QT * DP, sZ, c0);
    pv_k.issue(dK, sQ + pv_stage * QT * DP, sZ, c0);
    wgmma_commit();
    const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + cur.head(), sq.start, tq) : 0u;
    wgmma_wait<1>();  // S^T and dP^T (the older group); the previous products may still run
    wgmma_fence_operands(St);
    wgmma_fence_operands(dPt);
    // P^T and dS^T as the sm80 kernel's: the queries' lse hi + lo (da_exponent: the rule of rows
    // at huge scores), read from the stage per use
    tc_dkv_scores<NT, DROPOUT>(St, dPt, cur, need_mask, sl2, sL + stage * QT, sLlo + stage * QT,
                               sDl + stage * QT, tq, p, keep);
    wgmma_wait<0>();  // the previous products: dV and dK complete, the fragments free, their stage read
    wgmma_fence_operands(dV);
    wgmma_fence_operands(dK);
    if (pv_v.pending || pv_k.pending) tc90_release(pipe, pv_stage, role.wtid);
    pv_v.take(dV, St, sdOs, c0, need_mask, lane, p.D, bar);
    pv_k.take(dK, dPt, sQs, c0, need_mask, lane, p.D, bar);
    if (pv_v.pending || pv_k.pending)
      pv_stage = stage;
    else
      tc90_release(pipe, stage, role.wtid);
    rd.advance();
  }
  pv_v.flush(dV, sdO + pv_stage * QT * DP, c0);
  pv_k.flush(dK, sQ + pv_stage * QT * DP, c0);
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
  kernel<<<grid, kTc90Threads, smem, stream>>>(p, maps);
}

template <typename T, int DP>
TcConfig tc_fwd90_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTc90Warps, Tc90FwdCfg<DP>::SMEM, 1};
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
  const TcConfig cfg{16, kTc90Warps, Tc90DqCfg<DP>::SMEM, 1};
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
  const TcConfig cfg{16, kTc90Warps, Tc90DkvCfg<DP>::SMEM, Tc90DkvCfg<DP>::CHUNKS};
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
