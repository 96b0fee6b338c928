// Small blocks of the warp-specialised pattern of tc90_kernels.cuh (a producer warp filling a tile
// with cp.async that completes on an mbarrier, a consumer warpgroup waiting there and reading the
// tile with wgmma; named barriers; setmaxnreg) run on the CPU through cuda_emulation.h, so that
// tests/test_cuda.py can check that the emulation enforces the rules the sm90 kernels rely on: a
// broken variant must abort with the rule's message (run in a child process), the correct one
// must give the product. Also tells the tests the sm90 kernels' tile sizes (da_emu_tc90_tiles), from
// which they derive the chunks each pass walks, and runs the sm90 consumers' 32-bit walk and the
// helpers that turn its positions into offsets at lengths near 2^30 (da_emu_tc90_walk_rows,
// da_emu_tc90_row_offsets). Build as run_kernels.cpp.
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include <string.h>

#include <type_traits>

#include "cuda/sm90.cuh"
#include "cuda/tc90_kernels.cuh"

using namespace dilated_attention::cuda;

namespace {

using L = Sw90<32>;  // 64 rows of A and 16 rows of B, 32 columns (16 of them used)

// A (B, N, H, D) tensor's description (contiguous) from its data pointer.
Tensor4 contiguous_at(void* data, int64_t N, int64_t H, int64_t D) {
  return Tensor4{data, N * H * D, H * D, D};
}

// Variants of the pattern; each breaks one rule unless kOk.
enum Case {
  kOk = 0,
  kNoFence,               // the consumer skips fence.proxy.async after the wait
  kNoWait,                // the consumer reads the tile without waiting on the mbarrier
  kNamedCounts,           // threads of a named barrier give different thread counts
  kSetmaxnregCount,       // setmaxnreg with a count that is not a multiple of 8
  kProducerSkipsArrival,  // one producer lane does not arrive: the consumers wait forever
};

}  // namespace

// Runs one block of 256 threads: warpgroup 0's warp 0 loads A (64 x 32) and B (16 x 32), float16,
// from a and b (row-major, 16 values a row, the rest 0) into Sw90 tiles with cp.async completing on
// an mbarrier; warpgroup 1 waits, fences and computes C = A B^T (64 x 16) with one wgmma, written
// to c (row-major). Also checks that a named barrier returns the OR over its threads. Returns 0 (a
// broken case aborts the process with the emulation's message).
extern "C" int da_emu_pipeline(int which, const uint16_t* a, const uint16_t* b, float* c) {
  const Case cs = (Case)which;
  da_emu::run_block(dim3(1, 1, 1), dim3(0, 0, 0), 256, [&] {
    unsigned char* smem = da_emu::shared_memory();
    __half* sA = reinterpret_cast<__half*>(smem + ((1024 - (smem_address(smem) & 1023)) & 1023));
    __half* sB = sA + 64 * 32;
    uint64_t* full = reinterpret_cast<uint64_t*>(sB + 16 * 32);
    const int t = threadIdx.x, wg = t / 128, lane = t & 31;
    if (t == 0) mbar_init(full, 32);
    __syncthreads();
    if (wg == 0) {
      setmaxnreg_dec<40>();
      if (t >= 32) return;
      for (int idx = lane; idx < (64 + 16) * 4; idx += 32) {  // 4 chunks of 8 columns a row
        const int row = idx / 4, ch = idx % 4;
        const bool is_a = row < 64, ok = ch < 2;
        const int r = is_a ? row : row - 64;
        const uint16_t* src = (is_a ? a : b) + r * 16 + ch * 8;
        __half* dst = is_a ? sA : sB;
        cp_async16(reinterpret_cast<unsigned char*>(dst) + L::chunk_offset(is_a ? 64 : 16, r, ch),
                   ok ? src : (is_a ? a : b), ok);
      }
      cp_async_mbar_arrive(full);
      if (!(cs == kProducerSkipsArrival && lane == 5)) mbar_arrive(full);
      return;
    }
    if (cs == kSetmaxnregCount)
      setmaxnreg_inc<236>();
    else
      setmaxnreg_inc<232>();
    const int wt = t - 128;
    const bool any = named_barrier_or(1, cs == kNamedCounts && wt == 7 ? 96 : 128, wt == 77);
    if (!any) da_emu::fail("named barrier: the OR over its threads was lost");
    if (cs != kNoWait) mbar_wait(full, 0);
    if (cs != kNoFence) fence_proxy_async();
    float S[2][4];
    wgmma_fence();
    wgmma_ss<__half, 16>(S, desc_k_major<L>(sA, 64, 0), desc_k_major<L>(sB, 16, 0), 0);
    wgmma_commit();
    wgmma_wait<0>();
    if (cs == kNoWait) mbar_wait(full, 0);  // (the copies must still be waited for)
    const int warp = wt / 32, g = lane / 4, tq = lane % 4;
    for (int i = 0; i < 2; ++i)
      for (int e = 0; e < 4; ++e) c[(16 * warp + g + 8 * (e >> 1)) * 16 + 8 * i + 2 * tq + (e & 1)] = S[i][e];
  });
  return 0;
}

// The sm90 kernels' chunk of the other side at padded head dim dp (32, 64, 96, 128, 192, 256):
// out = {forward keys, dq keys, dk/dv queries} per chunk (tc90_pipe.cuh's Cfg structs). Returns 0,
// or -1 for another dp.
extern "C" int da_emu_tc90_tiles(int dp, int* out) {
  auto put = [out](auto dp_constant) {
    constexpr int DP = decltype(dp_constant)::value;
    out[0] = Tc90FwdCfg<DP>::KT;
    out[1] = Tc90DqCfg<DP>::KT;
    out[2] = Tc90DkvCfg<DP>::QT;
    return 0;
  };
  switch (dp) {
    case 32: return put(std::integral_constant<int, 32>{});
    case 64: return put(std::integral_constant<int, 64>{});
    case 96: return put(std::integral_constant<int, 96>{});
    case 128: return put(std::integral_constant<int, 128>{});
    case 192: return put(std::integral_constant<int, 192>{});
    case 256: return put(std::integral_constant<int, 256>{});
    default: return -1;
  }
}

// The sm90 consumers' walks of tile `tile` of a sequence of N rows under the tiling (R, interleaved)
// of the sm90 blocks (8 warps of 16 rows): pos[2 (32 cw + lane) + ri] the positions of consumer
// warp cw's thread `lane` (tc90_consumer_walk, 32-bit: padding rows held at N), fields = the walk's
// N, base and last. Returns 0, or 1 where the tile is empty (base >= N).
extern "C" int da_emu_tc90_walk_rows(int64_t N, int64_t R, int64_t interleaved, int64_t tile, int32_t* pos,
                                     int32_t* fields) {
  const da_tiling tl = da_make_tiling(N, R, interleaved, kTc90Warps, 16);
  const int64_t base = da_tile_base(&tl, tile);
  if (base >= N) return 1;
  Params p;
  memset(&p, 0, sizeof(p));
  p.N = N;
  for (int cw = 0; cw < kTc90Warps; ++cw)
    for (int lane = 0; lane < 32; ++lane) {
      const Tc90Walk w = tc90_consumer_walk(p, tl, N, base, 0, 1, DA_ROWS_ARE_QUERIES, 64, cw, lane);
      pos[2 * (32 * cw + lane)] = w.pos[0];
      pos[2 * (32 * cw + lane) + 1] = w.pos[1];
      if (cw == 0 && lane == 0) {
        fields[0] = w.N;
        fields[1] = w.base;
        fields[2] = w.last;
      }
    }
  return 0;
}

// The helpers that the sm90 consumers call with their 32-bit walk to store and read their rows,
// for row x of head h of batch entry b of contiguous (b + 1, N, Hq, D) float16 tensors out, dq, dk
// and dv (Hkv = Hq) and float32 (b + 1, Hq, N) lse and delta, where the element offsets pass 2^31
// (N near 2^30): no tensor is allocated, each tensor's pointer is set so that its row (b, x, h)
// (its lse and delta row) is out[D] .. dv[D] (lse[0], delta[0]), so a helper that formed an
// offset in 32 bits would write or read elsewhere (and crash: run it in a child process). D = 128,
// scale 0.5. One warp (tc_fwd_store sums l over a quad): every thread holds row x (slot 0; slot 1
// padding), O = dQ = dK = column + 1, dV = column + 2, m = 0, l = 0.5 a thread (2 a row).
// got = {the base-2 lse and the delta that tc_dq_row_stats read}. Returns 0.
extern "C" int da_emu_tc90_row_offsets(int64_t N, int64_t Hq, int64_t b, int64_t h, int64_t x, __half* out,
                                       __half* dq, __half* dk, __half* dv, float* lse, float* delta,
                                       float* got) {
  constexpr int D = 128, DT = D / 8;
  Params p;
  memset(&p, 0, sizeof(p));
  p.B = b + 1;
  p.N = N;
  p.Hq = p.Hkv = Hq;
  p.G = 1;
  p.D = D;
  p.scale = 0.5;
  p.drop.scale = 1.f;
  p.num_seqs = p.B;
  // Element offsets of the row, in 64 bits; each pointer is set back by them.
  const int64_t row = b * N * Hq * D + x * Hq * D + h * D, stat = (b * Hq + h) * N + x;
  auto at = [](void* buf, int64_t elems, size_t size) {
    return (void*)((uintptr_t)buf - (uintptr_t)elems * (uintptr_t)size);
  };
  p.out = contiguous_at(at(out, row, 2), N, Hq, D);
  p.dq = contiguous_at(at(dq, row, 2), N, Hq, D);
  p.dk = contiguous_at(at(dk, row, 2), N, Hq, D);
  p.dv = contiguous_at(at(dv, row, 2), N, Hq, D);
  p.lse = at(lse, stat, 4);
  p.delta = at(delta, stat, 4);
  const SeqRows sq = sequence_rows(p, b, DA_ROWS_ARE_QUERIES);
  const da_tiling tl = da_make_tiling(N, 1, 0, kTc90Warps, 16);
  da_emu::run_block(dim3(1, 1, (unsigned)p.B), dim3(0, 0, (unsigned)b), 32, [&] {
    const int tq = threadIdx.x & 3;
    Tc90Walk w = tc_walk_init<2, int32_t>(p, tl, N, 0, h, 1, DA_ROWS_ARE_QUERIES, 64);
    w.pos[0] = (int32_t)x;
    w.pos[1] = (int32_t)N;  // padding: not stored
    float O[DT][4], dV[DT][4], m[2] = {0.f, 0.f}, l[2] = {0.5f, 0.5f};
    for (int dt = 0; dt < DT; ++dt)
      for (int e = 0; e < 4; ++e) {
        const int d = dt * 8 + 2 * tq + (e & 1);
        O[dt][e] = (float)(d + 1);
        dV[dt][e] = (float)(d + 2);
      }
    const float sl2 = (float)(p.scale * DA_LOG2E);
    tc_fwd_store<__half, DT>(p, sq, h, w, m, l, O, sl2, tq);
    tc_dq_store<__half, DT>(p, sq, h, w, O, tq);
    tc_dkv_store<__half, DT>(p, sq, h, 0, w, O, dV, tq);
    float lse2[2], lse2lo[2], dl[2];
    tc_dq_row_stats(p, sq, h, w, sl2, lse2, lse2lo, dl);
    if (threadIdx.x == 0) {
      got[0] = lse2[0];
      got[1] = dl[0];
    }
  });
  return 0;
}
