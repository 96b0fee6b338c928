// Small blocks of the warp-specialised pattern of tc90_kernels.cuh (a producer warp filling a tile
// with cp.async that completes on an mbarrier, a consumer warpgroup waiting there and reading the
// tile with wgmma; named barriers; setmaxnreg) run on the CPU through cuda_emulation.h, so that
// tests/test_cuda.py can check that the emulation enforces the rules the sm90 kernels rely on: a
// broken variant must abort with the rule's message (run in a child process), the correct one
// must give the product. Also tells the tests the sm90 kernels' tile sizes (da_emu_tc90_tiles), from
// which they derive the chunks each pass walks. Build as run_kernels.cpp.
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include <string.h>

#include <type_traits>

#include "cuda/sm90.cuh"
#include "cuda/tc90_pipe.cuh"

using namespace dilated_attention::cuda;

namespace {

using L = Sw90<32>;  // 64 rows of A and 16 rows of B, 32 columns (16 of them used)

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
