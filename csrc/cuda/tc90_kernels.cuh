// The sm90 forward (float16/bfloat16, sm_90a): tc_fwd_kernel's algorithm on the warpgroup MMA.
//
// A thread block is one warpgroup (4 warps, 128 threads) owning 64 rows of one head, as in
// tc_kernels.cuh, and walks the same work (common.cuh's Walk over every branch, segment and chunk
// of keys, the causal skip, one online softmax per row over every branch). What changes is the
// matrix products: S = Q K^T is one wgmma.mma_async m64n{KT}k16 per 16 columns of the head dim,
// both operands read from shared memory by descriptors (no ldmatrix), and O += P V one
// m64n{DP}k16 per 16 keys, P from registers (the accumulators of S turned into A fragments, as
// mma.sync takes them) and V from shared memory. Tiles are stored in the swizzled layout of
// sm90.cuh (Sw90), filled by cp.async from the dilated positions (strided addressing, a double
// buffer: the next chunk loads while this one is computed) and handed to the MMAs through
// fence.proxy.async and a barrier.
//
// Every warp of the warpgroup takes part in each MMA, so a chunk runs when any warp of the block
// has work in it (the sm80 kernel skips per warp); the rows of a warp that would have skipped it
// are masked (their probabilities are 0). A chunk whose masked pairs meet a non-finite value of V
// is summed on CUDA cores, skipping the zero probabilities, in every warp of the block
// (tc_gemm_pb_skip_zero), so that the value reaches only the rows that read it.
//
// Results: out and lse as the sm80 forward's (the same rounding of every probability to T before
// P V, f32 accumulation; the sums' order inside an MMA may differ), so the sm80 backward (tc_dq_kernel,
// tc_dkv_kernel) follows it unchanged.
#pragma once

#include "sm90.cuh"
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

template <int DP>
struct Tc90FwdCfg {
  static constexpr int KT = TcFwdCfg<DP>::KT;  // keys per step: 64 (DP <= 128), 32 (192), 16 (256)
  static constexpr int STAGES = 2;
  static constexpr int Q_BYTES = kTcRows * DP * 2, KV_BYTES = KT * DP * 2;  // multiples of 1024
  // + 1024: the tiles start on a 1024-byte boundary of the dynamic shared memory.
  static constexpr int SMEM = Q_BYTES + STAGES * 2 * KV_BYTES + 1024;
};

// Loads `rows` rows of DP columns (D of them real) into a Sw90<DP> tile with cp.async; row_offset(i)
// gives the element offset of row i in src or -1 for a zero row.
template <typename T, int DP, typename RowOffset>
__device__ __forceinline__ void tc90_load_rows(T* dst, const T* src, int rows, int64_t D,
                                               RowOffset row_offset) {
  constexpr int CH = DP / 8;  // 16-byte chunks per row
  unsigned char* base = reinterpret_cast<unsigned char*>(dst);
  for (int idx = threadIdx.x; idx < rows * CH; idx += kTcThreads) {
    const int row = idx / CH, ch = idx % CH;
    const int64_t off = row_offset(row);
    const bool ok = off >= 0 && ch * 8 < D;
    cp_async16(base + Sw90<DP>::chunk_offset(rows, row, ch), ok ? src + off + ch * 8 : src, ok);
  }
}

template <typename T, int DP, bool DROPOUT>
__global__ void __launch_bounds__(kTcThreads) tc90_fwd_kernel(const Params p) {
#if DA_SM90A
  using Cfg = Tc90FwdCfg<DP>;
  constexpr int KT = Cfg::KT, NT = KT / 8, DT = DP / 8;
  DA_EXTERN_SMEM(smem_raw);
  unsigned char* aligned = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(aligned);                 // Sw90<DP> [64 rows]
  T* sK = reinterpret_cast<T*>(aligned + Cfg::Q_BYTES);  // [STAGES] Sw90<DP> [KT rows]
  T* sV = sK + Cfg::STAGES * KT * DP;                    // [STAGES] Sw90<DP> [KT rows]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  const SeqRows sq = sequence_rows(p, blockIdx.z, DA_ROWS_ARE_QUERIES);
  const int64_t N = sq.N, b = sq.b, h = blockIdx.y, hk = h / p.G;
  const da_tiling tl = p.tiling;
  const int64_t base = da_tile_base(&tl, blockIdx.x);
  if (base >= N) return;
  const int64_t last = da_tile_last(&tl, base, N);

  const T* q = static_cast<const T*>(p.q.data) + b * p.q.sb + sq.start * p.q.sn + h * p.q.sh;
  const T* k = static_cast<const T*>(p.k.data) + b * p.k.sb + sq.start * p.k.sn + hk * p.k.sh;
  const T* v = static_cast<const T*>(p.v.data) + b * p.v.sb + sq.start * p.v.sn + hk * p.v.sh;

  tc90_load_rows<T, DP>(sQ, q, kTcRows, p.D, [&](int row) -> int64_t {
    const int64_t x = da_row_position(&tl, base, row >> 4, row & 15);
    return x < N ? x * p.q.sn : -1;
  });
  cp_async_commit();

  Walk<2> cur;
  cur.N = N;
  cur.base = base;
  cur.last = last;
  cur.h0 = h;
  cur.G = 1;
  cur.is_causal = p.is_causal;
  cur.rows_are = DA_ROWS_ARE_QUERIES;
  cur.other_tile = KT;
  tc_thread_rows(tl, base, warp, lane, cur.pos);
  cur.start(p);

  auto load_kv = [&](const Walk<2>& w, int stage) {
    auto off_k = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.k.sn : -1;
    };
    auto off_v = [&](int jj) -> int64_t {
      const int j = w.o0 + jj;
      return j < w.o_end ? w.other_position(j) * p.v.sn : -1;
    };
    tc90_load_rows<T, DP>(sK + stage * KT * DP, k, KT, p.D, off_k);
    tc90_load_rows<T, DP>(sV + stage * KT * DP, v, KT, p.D, off_v);
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
    fence_proxy_async();
    const bool skip = cur.skip_chunk();
    if (__syncthreads_or(!skip)) {  // some warp has work in the chunk: the warpgroup multiplies
      const T* sKs = sK + stage * KT * DP;
      const T* sVs = sV + stage * KT * DP;
      const uint32_t keep = DROPOUT ? tc_dropout_keep<NT>(cur, p, b * p.Hq + h, sq.start, tq) : 0u;
      float S[NT][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < DP / 16; ++kk)  // columns past D are zeros (no branch between the MMAs)
        wgmma_ss<T, KT>(S, desc_k_major<DP>(sQ, kTcRows, kk), desc_k_major<DP>(sKs, KT, kk), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(S);

      const bool need_mask = skip || cur.chunk_needs_mask();
      tc_fwd_softmax<NT, DT, DROPOUT>(S, O, m, l, cur, need_mask, sl2, tq, p, keep);

      // A masked pair meeting an inf or NaN of V anywhere in the block: the block sums on CUDA
      // cores (the MMA would spread 0 * inf to the rows of every warp).
      if (__syncthreads_or(need_mask && tc_tile_nonfinite<T, DP, DP>(sVs, KT, lane))) {
        tc_gemm_pb_skip_zero<T, NT, DT>(
            O, S, [&](int key, int d) { return sVs[Sw90<DP>::elem(KT, key, d)]; }, 0, lane, p.D);
      } else {
        uint32_t a[KT / 16][4];
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) c_to_a<T>(a[kk], S[2 * kk], S[2 * kk + 1]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) wgmma_rs<T, DP>(O, a[kk], desc_mn_major<DP>(sVs, KT, kk), 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(O);
      }
    }
    __syncthreads();  // the buffer of `stage` is free for the prefetch of the next iteration
    cur = nxt;
    stage ^= 1;
  }
  cp_async_wait<0>();
  tc_fwd_store<T, DT>(p, sq, h, cur, m, l, O, sl2, tq);
#endif
}

#ifndef DA_CUDA_EMULATION  // the CPU emulation of the tests calls the kernels itself

template <typename T, int DP>
TcConfig tc_fwd90_dp(const Params& p, bool launch, cudaStream_t stream) {
  const TcConfig cfg{16, kTcWarps, Tc90FwdCfg<DP>::SMEM, 1};
  if (launch) {
    const dim3 grid((unsigned)da_num_tiles(&p.tiling), (unsigned)p.Hq, (unsigned)p.num_seqs);
    static SmemOptIn opt_in[2];  // without and with dropout
    tc_launch(tc_dropout(p) ? tc90_fwd_kernel<T, DP, true> : tc90_fwd_kernel<T, DP, false>, grid,
              cfg.smem_bytes, p, stream, opt_in[tc_dropout(p)]);
  }
  return cfg;
}

#endif  // DA_CUDA_EMULATION

}  // namespace cuda
}  // namespace dilated_attention
