// Runs the CUDA kernels of dilated_attention::decode_step (csrc/cuda/decode.cuh) on the CPU through
// cuda_emulation.h, for tests without a GPU (tests/test_decode_cuda.py loads it with ctypes). It
// launches them as csrc/cuda/decode_launch.cu does, for contiguous tensors, the partial results in a
// scratch buffer filled with NaN bytes first (so that a result a kernel does not write shows).
// Build:
//   c++ -std=c++17 -O1 -shared -fPIC -DDA_CUDA_EMULATION -I<csrc> -I<tests/cuda_emulation> -I<cuda include> -I<torch include>
//       tests/cuda_emulation/run_decode.cpp -o run_decode.so
#ifndef DA_CUDA_EMULATION
#error "build with -DDA_CUDA_EMULATION"
#endif

#include <string.h>

#include <algorithm>
#include <vector>

#include "cuda/decode.cuh"

namespace dilated_attention {
namespace cuda {
namespace {

template <typename Kernel>
void run_grid(Kernel kernel, dim3 grid, const DecodeParams& p) {
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        da_emu::run_block(grid, dim3(x, y, z), kDecodeLanes, [&] { kernel(p); });
}

template <typename scalar_t, typename acc_t>
void run(DecodeParams p) {
  std::vector<acc_t> part((size_t)(p.B * p.Hkv * p.nbr * p.G * p.S * (p.D + 2)));
  memset(part.data(), 0xff, part.size() * sizeof(acc_t));
  p.part = part.data();
  run_grid(decode_write_kernel<scalar_t>, dim3((unsigned)p.B), p);
  run_grid(decode_partial_kernel<scalar_t, acc_t>,
           dim3((unsigned)(p.B * p.Hkv), (unsigned)std::min<int64_t>(p.nbr * p.G, 65535), (unsigned)p.S), p);
  run_grid(decode_merge_kernel<scalar_t, acc_t>, dim3((unsigned)(p.B * p.Hq)), p);
}

}  // namespace
}  // namespace cuda
}  // namespace dilated_attention

// dtype: 0 float16, 1 bfloat16, 2 float32, 3 float64. The caches are written in place; out
// (B, Hq, D) in the dtype, lse (B, Hq) in float32 (float64 for float64).
extern "C" int da_emu_decode(int dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t T, int64_t nbr,
                             int64_t S, const int64_t* w, const int64_t* r, const int64_t* len, double scale,
                             const void* q, const void* k, const void* v, void* kc, void* vc,
                             const int64_t* pos, void* out, void* lse) {
  using namespace dilated_attention::cuda;
  if (nbr < 1 || nbr > DA_MAX_BRANCHES || D > kDecodeMaxD || Hq % Hkv) return 1;
  DecodeParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.kc = kc;
  p.vc = vc;
  p.pos = pos;
  p.out = out;
  p.lse = lse;
  p.B = B;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.D = D;
  p.T = T;
  p.G = Hq / Hkv;
  p.nbr = nbr;
  p.S = S;
  p.scale = scale;
  int64_t off = 0;
  for (int64_t i = 0; i < nbr; ++i) {
    p.w[i] = w[i];
    p.r[i] = r[i];
    p.rows[i] = p.G < r[i] ? p.G : r[i];
    p.len[i] = len[i];
    p.off[i] = off;
    off += p.rows[i] * len[i];
  }
  if (off != T) return 2;
  switch (dtype) {
    case 0: run<c10::Half, float>(p); break;
    case 1: run<c10::BFloat16, float>(p); break;
    case 2: run<float, float>(p); break;
    default: run<double, double>(p); break;
  }
  return 0;
}
