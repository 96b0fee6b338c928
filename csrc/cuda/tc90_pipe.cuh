// The pipeline of the sm90 kernels (tc90_kernels.cuh): the block's shape, the register split of
// its warpgroups, the stages of shared memory and what each carries, and the producer warp that
// walks the block's rows and fills the stages (its walk kept in shared memory, Tc90Walker). The
// consumers, the kernels and their launchers are in tc90_kernels.cuh.
#pragma once

#include "sm90.cuh"
#include "tc_kernels.cuh"
#include "tma.h"

namespace dilated_attention {
namespace cuda {

constexpr int kTc90Consumers = 2;                         // consumer warpgroups per block
constexpr int kTc90Threads = 128 * (1 + kTc90Consumers);  // and the producer warpgroup
constexpr int kTc90Warps = 4 * kTc90Consumers;            // warps that own rows (the tiling's)
constexpr int kTc90Rows = kTcRows * kTc90Consumers;       // rows per block
// Stages of shared memory: 5, or fewer where a pass's tiles need it (its Cfg's STAGES).
constexpr int kTc90Stages = 5;
// Registers per thread after setmaxnreg, within the launch's 384 x 168 = 64512: 128 x 40 + 256 x 232
// = 64512. The producer holds little in registers: its walk is 32-bit and keeps its position and
// the block's constants in shared memory (Tc90Walker), and it steps through a segment's chunks
// without per-chunk decisions (tc90_next_segment); at 32 the forward's fits, dk/dv's (which also
// loads lse and delta) spills a few bytes. The consumers of every pass and head dim fit in 232
// (scripts/check_sm90a.sh). (FlashAttention-3: 24 and 240.)
constexpr int kTc90ProducerRegs = 40, kTc90ConsumerRegs = 232;
constexpr int kTc90LaunchRegs = 168;  // 65536 / 384 rounded down to a multiple of 8
static_assert(128 * kTc90ProducerRegs + 128 * kTc90Consumers * kTc90ConsumerRegs <=
                  kTc90Threads * kTc90LaunchRegs,
              "setmaxnreg's split fits in the registers the block starts with");

// One chunk that the producer publishes in a stage: the walk's position and the chunk's first
// index of the other side; flags: the walk has ended (no chunk), the tiles came by tensor copies,
// and per consumer warpgroup g (bit kTc90Skip << g) that none of its 64 rows meets the chunk (it
// skips the chunk's work, tc90_next_segment).
enum { kTc90Done = 1, kTc90Tma = 2, kTc90Skip = 4 };
struct Tc90Chunk {
  da_walk_of<int32_t> at;  // the producer's walk (Tc90Walker)
  int o0, flags;
};

// What the producer warp's walk reads, in shared memory (Tc90Pipe) rather than in registers, so
// that the producer warpgroup needs few: the block's rows and heads, its sequence, and the walk's
// current segment, in 32-bit arithmetic (tiling.h: every index is below 2 N < 2^31, and N < 2^30
// is checked at the op's entry; a packed sequence's start row is below 2^30 as well). The walk
// itself is the sm80 kernels' (tiling.h's da_walk_candidate and da_row_index), its decisions the
// warp's: lane l follows the rows 4 l .. 4 l + 3.
struct Tc90Walker {
  int32_t N, base, last, h0, G;  // the block's rows [base, last] of N (tiling.h), heads h0 .. h0 + G - 1
  int32_t b, start;              // the sequence (SeqRows)
  int32_t pos[kTc90Rows];        // the rows' positions, padding rows (at or past N) held at N
  da_walk_of<int32_t> at;        // the current segment (a fresh walker: before the first)
  // Per consumer warpgroup, the current segment's chunks [glo, ghi) that some row of its 64 meets
  // (empty where none of them is active in the segment: [o_end, o_begin)).
  int32_t glo[kTc90Consumers], ghi[kTc90Consumers];
};

// The pipeline's barriers and slots (after the tiles in shared memory; a pass with fewer stages uses
// the first STAGES of them): full[s] completes when the producer warp's 32 threads have arrived
// and the stage's copies have landed (dk/dv: and the 32 of the stats warp, tc90_convert_stats);
// empty[s] when the two consumer warpgroups have released the stage (one arrival each,
// tc90_release); stats[s] (dk/dv) when the producer warp's copies of the stage's lse and delta have
// landed. walker: the producer's walk.
struct Tc90Pipe {
  uint64_t full[kTc90Stages], empty[kTc90Stages], stats[kTc90Stages];
  Tc90Chunk slot[kTc90Stages];
  Tc90Walker walker;
};

template <int DP>
struct Tc90FwdCfg {
  // Keys per step: 64 (DP <= 128), 32 (192, 256). A consumer thread holds O (DP / 2 floats), S
  // (KT / 2) and the previous chunk's P as A fragments (KT / 4) in registers: at 256, 32 keys (the
  // sm80 kernel takes 16) use 189 of the 232 registers, 192 with dropout (ptxas, sm_90a, CUDA
  // 13.0; 177 and 181 with 16), with no spill. Shared memory holds four stages at 256 (214,976
  // bytes; five would not fit next to the 64 rows of Q of each consumer: 245,760 of tiles alone).
  static constexpr int KT = DP <= 128 ? 64 : 32;
  static constexpr int STAGES = DP == 256 ? 4 : kTc90Stages;
  static constexpr int Q_BYTES = kTcRows * DP * 2, KV_BYTES = KT * DP * 2;  // multiples of 1024
  // Q of each consumer, K and V of each stage, the pipe; + 1024: the tiles start on a 1024-byte
  // boundary of the dynamic shared memory.
  static constexpr int SMEM =
      kTc90Consumers * Q_BYTES + (2 * STAGES + 1) * KV_BYTES + (int)sizeof(Tc90Pipe) + 1024;
};

template <int DP>
struct Tc90DqCfg {
  // Keys per step: 64 (DP <= 128), 32 (192), 16 (256). A consumer thread holds S and dP (KT / 2
  // floats each), dQ (DP / 2) and the previous chunk's dS as A fragments (KT / 4) in registers,
  // with the walk (32-bit). At 232 registers (ptxas, sm_90a, CUDA 13.0) each fits with no spill,
  // where at DP = 128 dropout's draws come before the chunk's MMAs are issued (DRAW_FIRST; drawn
  // while S and dP run, as at the other sizes, they spilled 4 bytes with a 64-bit walk; at 216
  // registers KT = 64 at DP = 128 spills 4 bytes, none with dropout (12 and 8 with a 64-bit
  // walk): the margin is small). Shared memory holds four stages at
  // 128 and 192 (five would not fit next to the 64 rows of Q and dO of each consumer); at 256 a
  // chunk of 32 would leave two.
  static constexpr int KT = DP <= 128 ? 64 : (DP <= 192 ? 32 : 16);
  static constexpr int STAGES = DP == 128 || DP == 192 ? 4 : kTc90Stages;
  static constexpr bool DRAW_FIRST = DP == 128;
  static constexpr int ROW_BYTES = kTcRows * DP * 2, KV_BYTES = KT * DP * 2;
  static constexpr int SMEM =
      kTc90Consumers * 2 * ROW_BYTES + (2 * STAGES + 1) * KV_BYTES + (int)sizeof(Tc90Pipe) + 1024;
};

template <int DP>
struct Tc90DkvCfg {
  // Queries per step: 64 (DP <= 64), 32 (96, 192), 16 (128, 256). A consumer thread holds dK and
  // dV (DC / 2 floats each: DC = DP up to 128, DP / 2 above), S^T and dP^T (QT / 2 each) and the A
  // fragments of the two deferred products (QT / 4 each) in registers, with the walk (32-bit).
  // At 232 registers (ptxas, sm_90a, CUDA 13.0) QT = 64 fits at DP <= 64 and QT = 32 at DP = 96
  // and 192 (DC = 96) with no spill (at 216 registers QT = 64 at DP = 64 spills 12 bytes, 16 with
  // a 64-bit walk); QT = 32 at DP = 128 spilled 56 bytes (8 with dropout; 132 and 60 with a 64-bit
  // walk) while the sums on CUDA cores held their columns in registers through the loop
  // (tc_gemm_pb_skip_zero), so 128 keeps 16 (32 now fits: 212 registers used, 213 with
  // dropout, not yet timed), and so does 256 (DC = 128 as well; and three stages of 32 would not
  // fit in shared memory). Shared memory holds four stages at 192.
  static constexpr int QT = DP <= 64 ? 64 : (DP == 96 || DP == 192 ? 32 : 16);
  static constexpr int STAGES = DP == 192 ? 4 : kTc90Stages;
  static constexpr int DC = TcDkvCfg<DP>::DC, CHUNKS = TcDkvCfg<DP>::CHUNKS;  // accumulator columns
  // Panels of 64 columns where both DP and the column chunks allow, else 32 (DP = 192: DC = 96).
  static constexpr int PW = DP % 64 == 0 && DC % 64 == 0 ? 64 : 32;
  static constexpr int ROW_BYTES = kTcRows * DP * 2, Q_BYTES = QT * DP * 2;
  // + the queries' lse as saved (8 bytes each: float or double), in base 2 (hi and lo,
  // da_lse_base2), and delta, per stage
  static constexpr int SMEM = kTc90Consumers * 2 * ROW_BYTES + (2 * STAGES + 1) * Q_BYTES +
                              STAGES * QT * (8 + 3 * (int)sizeof(float)) + (int)sizeof(Tc90Pipe) + 1024;
};

// sm_90's opt-in maximum of dynamic shared memory per block.
constexpr int kTc90MaxSmem = 232448;
static_assert(Tc90FwdCfg<128>::SMEM <= kTc90MaxSmem && Tc90FwdCfg<256>::SMEM <= kTc90MaxSmem &&
                  Tc90DqCfg<128>::SMEM <= kTc90MaxSmem && Tc90DqCfg<192>::SMEM <= kTc90MaxSmem &&
                  Tc90DqCfg<256>::SMEM <= kTc90MaxSmem && Tc90DkvCfg<192>::SMEM <= kTc90MaxSmem &&
                  Tc90DkvCfg<256>::SMEM <= kTc90MaxSmem,
              "the sm90 kernels' tiles fit in shared memory");

// The dynamic shared memory from its first 1024-byte boundary (the swizzle works on addresses).
__device__ __forceinline__ unsigned char* tc90_smem(unsigned char* raw) {
  return raw + ((1024 - (smem_address(raw) & 1023)) & 1023);
}

// Loads `rows` rows of DP columns (D of them real) into a Sw90 tile L with cp.async, by the
// `threads` threads numbered tid; row_offset(i) gives the element offset of row i in src or -1 for
// a zero row.
template <typename T, typename L, typename RowOffset>
__device__ __forceinline__ void tc90_load_rows(T* dst, const T* src, int rows, int64_t D,
                                               RowOffset row_offset, int tid, int threads) {
  constexpr int CH = L::DP / 8;  // 16-byte chunks per row
  unsigned char* base = reinterpret_cast<unsigned char*>(dst);
  for (int idx = tid; idx < rows * CH; idx += threads) {
    const int row = idx / CH, ch = idx % CH;
    const int64_t off = row_offset(row);
    const bool ok = off >= 0 && ch * 8 < D;
    cp_async16(base + L::chunk_offset(rows, row, ch), ok ? src + off + ch * 8 : src, ok);
  }
}

// The 64 rows of consumer warpgroup g (warps 4g .. 4g + 3 of the tiling) of a (B, N, H, D) tensor
// t, head h, into a Sw90 tile L, by the warpgroup's threads (wtid 0..127); then the tile is the
// MMAs' (cp.async landed, fenced, the warpgroup's named barrier).
template <typename T, typename L>
__device__ __forceinline__ void tc90_load_group_rows(T* dst, const Tensor4& t, const SeqRows& sq, int64_t h,
                                                     const da_tiling& tl, int64_t base, int64_t D, int g,
                                                     int wtid) {
  const T* src = static_cast<const T*>(t.data) + sq.b * t.sb + sq.start * t.sn + h * t.sh;
  tc90_load_rows<T, L>(
      dst, src, kTcRows, D,
      [&](int row) -> int64_t {
        const int64_t x = da_row_position(&tl, base, 4 * g + (row >> 4), row & 15);
        return x < sq.N ? x * t.sn : -1;
      },
      wtid, 128);
}

// Hands the tiles that this thread's cp.async copies filled to its warpgroup's MMAs.
__device__ __forceinline__ void tc90_group_tiles_landed(int g) {
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  named_barrier_or(1 + g, 128, false);
}

// The map of `maps` for rate r, or -1 (the same in every thread).
__device__ __forceinline__ int tc90_map_index(const TmaMaps& maps, int64_t r) {
  int found = -1;
  for (int i = 0; i < maps.count; ++i) found = maps.rate[i] == r ? i : found;
  return found;
}

/* ------------------------------------------------------------------------------------------ */
/* The producer                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static_assert(kTc90Rows == 32 * 4, "the producer warp walks the block's rows, four per lane");

// The producer warp's walker over the block's rows from `base` (tiling tl, sequence sq), heads
// h0 .. h0 + G - 1: set up by the warp, before its first segment.
__device__ __forceinline__ void tc90_walker_init(Tc90Walker& wk, const SeqRows& sq, const da_tiling& tl,
                                                 int64_t base, int64_t h0, int G, int lane) {
  if (lane == 0) {
    wk.N = (int32_t)sq.N;
    wk.base = (int32_t)base;
    wk.last = (int32_t)da_tile_last(&tl, base, sq.N);
    wk.h0 = (int32_t)h0;
    wk.G = G;
    wk.b = (int32_t)sq.b;
    wk.start = (int32_t)sq.start;
    da_walk_begin(&wk.at);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j = 4 * lane + k;
    wk.pos[j] = (int32_t)da_min64(da_row_position(&tl, base, j >> 4, j & 15), sq.N);
  }
  __syncwarp();
}

// The chunks [*lo, *hi) of the walker's segment st (`OT` indices of the other side each, from
// st.o_begin) that rows whose least and largest dilated indices are jmin and jmax (jmax >= 0) work
// on: a causal segment's chunks beyond the rows' reach are left out (those that the consumers'
// walks skip, da_chunk_skip).
template <int OT, int ROWS_ARE>
__device__ __forceinline__ void tc90_chunk_range(const Params& p, const da_walk_of<int32_t>& st, int32_t jmin,
                                                 int32_t jmax, int32_t* lo, int32_t* hi) {
  const int32_t off = (int32_t)da_causal_offset(&p.piece);
  *lo = st.o_begin;
  *hi = st.o_end;
  if (p.is_causal && ROWS_ARE == DA_ROWS_ARE_QUERIES) {
    *hi = min(*hi, jmax + off + 1);  // no row reaches a chunk from jmax + off + 1 on
  } else if (p.is_causal) {
    const int32_t x = jmin - off - st.o_begin;  // no row reaches the chunks that end below jmin - off
    if (x > 0) *lo += x / OT * OT;
  }
}

// Moves the walker to its next segment in which some row of the block is active and returns the
// range [*lo, *hi) of the segment's chunks that some row of the block works on: the union of
// each consumer warpgroup's range (tc90_chunk_range of its rows), which goes to wk.glo, wk.ghi
// (lane l follows rows of warpgroup l / 16; lanes 0 and 16 write; a warpgroup with no active row
// has the empty range [o_end, o_begin)). False where the walk has ended.
template <int OT, int ROWS_ARE>
__device__ __forceinline__ bool tc90_next_segment(const Params& p, Tc90Walker& wk, int lane, int32_t* lo,
                                                  int32_t* hi) {
  static_assert(kTc90Consumers == 2, "a half warp per consumer warpgroup");
  da_walk_of<int32_t> st = wk.at;
  if (st.s >= 0) ++st.s;  // (a fresh walker's s = -1: da_walk_candidate starts at base's segment)
  const int32_t N = wk.N;
  for (;;) {
    if (!da_walk_candidate<int32_t>(&st, &p.br, wk.G, wk.h0, wk.base, wk.last, N, p.is_causal, ROWS_ARE,
                                    &p.piece))
      return false;
    int jmin = INT_MAX, jmax = -1;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int32_t j = da_row_index<int32_t>(wk.pos[4 * lane + k], N, st.s, st.w, st.r, st.o);
      if (j >= 0) {
        jmin = min(jmin, j);
        jmax = max(jmax, j);
      }
    }
    if (__any_sync(DA_FULL_MASK, jmax >= 0)) {
#pragma unroll
      for (int d = 1; d < 16; d <<= 1) {  // over the half warp: the warpgroup's rows
        jmin = min(jmin, __shfl_xor_sync(DA_FULL_MASK, jmin, d));
        jmax = max(jmax, __shfl_xor_sync(DA_FULL_MASK, jmax, d));
      }
      __syncwarp();
      if ((lane & 15) == 0) {
        int32_t glo = st.o_end, ghi = st.o_begin;  // no row of the warpgroup active: no chunk
        if (jmax >= 0) tc90_chunk_range<OT, ROWS_ARE>(p, st, jmin, jmax, &glo, &ghi);
        wk.glo[lane >> 4] = glo;
        wk.ghi[lane >> 4] = ghi;
      }
      if (lane == 0) wk.at = st;
      __syncwarp();
      *lo = min(wk.glo[0], wk.glo[1]);
      *hi = max(wk.ghi[0], wk.ghi[1]);
      return true;
    }
    ++st.s;
  }
}

// The row of the tensor (B, rows, H, D) that holds the other side's index j of the walker's
// segment: below 2^30, as every row.
__device__ __forceinline__ int32_t tc90_other_row(const Tc90Walker& wk, int32_t j) {
  return wk.start + wk.at.seg_first + j * wk.at.r;
}

// The tensor map (index into maps) that loads the walker's chunk of `rows` indices from o0, or
// -1: where maps has the segment's rate and reaches the chunk's last used row. (The walk's rate
// is clamped to the sequence's length, da_branch_at: a rate beyond it finds no map, or the map of
// the rate N, which loads the one position of the segment as well.)
__device__ __forceinline__ int tc90_chunk_map(const TmaMaps& maps, const Tc90Walker& wk, int32_t o0,
                                              int rows) {
  const int32_t r = wk.at.r, g0 = tc90_other_row(wk, o0);
  const int mi = tc90_map_index(maps, r);
  return mi >= 0 && g0 / r + min(rows, wk.at.o_end - o0) <= maps.J[mi] ? mi : -1;
}

// Loads the walker's chunk (`rows` indices of the other side from o0; those at or past at.o_end
// are not used) of tensors a and b (head `head`) into the Sw90 tiles ta and tb, completing on bar:
// with the tensor copy engine and map mi (tc90_chunk_map; lane 0 issues one box per panel and
// tensor; rows past o_end that a box loads hold other positions' values, which the kernels mask),
// or with cp.async from the warp's lanes where mi is -1 (zero rows past o_end). Every lane
// arrives on bar once, after its own writes of the stage.
template <typename T, typename L>
__device__ __forceinline__ void tc90_load_pair(T* ta, T* tb, const Tensor4& a, const Tensor4& b, int32_t head,
                                               const Tc90Walker& wk, int32_t o0, int rows, int64_t D,
                                               const TmaMaps& maps, int mi, uint64_t* bar, int lane) {
  if (mi >= 0) {
    if (lane == 0) {
      const int32_t r = wk.at.r, g0 = tc90_other_row(wk, o0);
      fence_proxy_async();  // the consumers' generic reads of the tiles' last use, before the copy engine's writes
      mbar_arrive_expect_tx(bar, (uint32_t)(2 * rows * L::DP * 2));
      int32_t c[5] = {0, head, g0 % r, g0 / r, wk.b};
#pragma unroll
      for (int pn = 0; pn < L::PANELS; ++pn) {
        c[0] = pn * L::PW;
        tma_load_5d(ta + pn * rows * L::PW, maps.map[0][mi], c, bar);
        tma_load_5d(tb + pn * rows * L::PW, maps.map[1][mi], c, bar);
      }
    } else {
      mbar_arrive(bar);
    }
    return;
  }
  auto chunk_row = [&wk, o0](int64_t sn) {
    return [&wk, o0, sn](int jj) -> int64_t {
      const int32_t j = o0 + jj;
      return j < wk.at.o_end ? (int64_t)tc90_other_row(wk, j) * sn : -1;
    };
  };
  tc90_load_rows<T, L>(ta, static_cast<const T*>(a.data) + wk.b * a.sb + head * a.sh, rows, D,
                       chunk_row(a.sn), lane, 32);
  tc90_load_rows<T, L>(tb, static_cast<const T*>(b.data) + wk.b * b.sb + head * b.sh, rows, D,
                       chunk_row(b.sn), lane, 32);
  cp_async_mbar_arrive(bar);
  mbar_arrive(bar);
}

// The dk/dv producer's copies of the queries' lse (as saved: float, or double where p.lse_f64) and
// delta of the walker's chunk's QT queries from o0 (zeros at or past at.o_end) into raw (8 bytes a
// query) and sDl, by the warp's lanes with cp.async of 4 or 8 bytes (any rate: the queries' rows
// are r apart), completing on bar: the producer does not wait for them; the stats warp turns lse
// into base 2 once they have landed (tc90_convert_stats).
template <int QT>
__device__ __forceinline__ void tc90_load_stats(const Params& p, const Tc90Walker& wk, int32_t o0,
                                                unsigned char* raw, float* sDl, uint64_t* bar, int lane) {
  const int64_t head_row = ((int64_t)wk.b * p.Hq + wk.h0 + wk.at.gi) * p.N;
  for (int jj = lane; jj < QT; jj += 32) {
    const int32_t j = o0 + jj;
    const bool ok = j < wk.at.o_end;
    const int64_t i = ok ? head_row + tc90_other_row(wk, j) : 0;
    if (p.lse_f64)
      cp_async_small<8>(raw + 8 * jj, static_cast<const double*>(p.lse) + i, ok);
    else
      cp_async_small<4>(raw + 8 * jj, static_cast<const float*>(p.lse) + i, ok);
    cp_async_small<4>(sDl + jj, static_cast<const float*>(p.delta) + i, ok);
  }
  cp_async_mbar_arrive(bar);
  mbar_arrive(bar);
}

// The dk/dv producer warpgroup's stats warp: for each stage in turn, once the producer warp's
// copies of lse and delta have landed (stats), the chunk's lse (raw, tc90_load_stats) in base 2
// (da_lse_base2, as the sm80 kernel takes it: hi into sL, +inf at or past the segment's end, so
// that P = 0; lo into sLlo, which the consumers read per use for the rule of rows at huge scores,
// da_exponent), and its 32 arrivals on full; at the producer's last slot (done) only the arrivals.
template <int QT, int STAGES>
__device__ __forceinline__ void tc90_convert_stats(const Params& p, Tc90Pipe* pipe, const unsigned char* raw,
                                                   float* sL, float* sLlo, float sl2, int lane) {
  const double unit = da_score_unit(p.scale, sl2);
  int stage = 0;
  uint32_t parity = 0;
  for (;;) {
    mbar_wait(&pipe->stats[stage], (parity >> stage) & 1);
    parity ^= 1u << stage;
    const Tc90Chunk& c = pipe->slot[stage];
    if (c.flags & kTc90Done) {
      mbar_arrive(&pipe->full[stage]);
      return;
    }
    const int32_t n = c.at.o_end - c.o0;  // the chunk's queries in the segment
    for (int jj = lane; jj < QT; jj += 32) {
      const unsigned char* x = raw + 8 * (stage * QT + jj);
      const double L = p.lse_f64 ? *reinterpret_cast<const double*>(x) : *reinterpret_cast<const float*>(x);
      float lo = 0.f;
      sL[stage * QT + jj] = jj < n ? da_lse_base2<float>(L, unit, &lo) : INFINITY;
      sLlo[stage * QT + jj] = lo;
    }
    mbar_arrive(&pipe->full[stage]);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
}

// The producer warp's loop: for each chunk of the walker's segments that some row of the block
// works on (OT indices of the other side each), a free stage (empty), the chunk published in its
// slot, load(stage, o0, mi) issuing its copies (map mi = map_for(o0), or -1: by cp.async) and
// every lane's arrival on full (and on stats, STATS: dk/dv); at the end a slot that says so, and a
// wait for this lane's copies.
template <int OT, int ROWS_ARE, int STAGES, bool STATS, typename MapFor, typename Load>
__device__ __forceinline__ void tc90_produce(const Params& p, Tc90Pipe* pipe, int lane, MapFor map_for,
                                             Load load) {
  Tc90Walker& wk = pipe->walker;
  int stage = 0;
  uint32_t parity = (1u << STAGES) - 1;  // a fresh barrier's previous phase counts as complete
  int32_t lo, hi;
  while (tc90_next_segment<OT, ROWS_ARE>(p, wk, lane, &lo, &hi)) {
    for (int32_t o0 = lo; o0 < hi; o0 += OT) {
      mbar_wait(&pipe->empty[stage], (parity >> stage) & 1);
      parity ^= 1u << stage;
      const int mi = map_for(o0);
      if (lane == 0) {
        Tc90Chunk& c = pipe->slot[stage];
        c.at = wk.at;
        c.o0 = o0;
        int flags = mi >= 0 ? kTc90Tma : 0;
#pragma unroll
        for (int g = 0; g < kTc90Consumers; ++g)
          if (o0 < wk.glo[g] || o0 >= wk.ghi[g]) flags |= kTc90Skip << g;
        c.flags = flags;
      }
      load(stage, o0, mi);
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
  }
  mbar_wait(&pipe->empty[stage], (parity >> stage) & 1);
  if (lane == 0) pipe->slot[stage].flags = kTc90Done;
  if (STATS) mbar_arrive(&pipe->stats[stage]);  // (the stats warp reads the slot, tc90_convert_stats)
  mbar_arrive(&pipe->full[stage]);
  cp_async_wait_all();  // the copies of the last chunks, before this warp returns
}

}  // namespace cuda
}  // namespace dilated_attention
