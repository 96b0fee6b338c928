// The launches of dilated_attention::decode_step's kernels (decode.cuh) on a stream; the host side
// (checks, tensors, the split of the keys) is decode_cuda.cpp, which checks the launches.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "decode.cuh"
#include "launch.h"

namespace dilated_attention {
namespace cuda {
namespace {

template <typename scalar_t, typename acc_t>
void launch(const DecodeParams& p, cudaStream_t stream) {
  decode_write_kernel<scalar_t><<<(unsigned)p.B, kDecodeLanes, 0, stream>>>(p);
  const dim3 grid((unsigned)(p.B * p.Hkv), (unsigned)std::min<int64_t>(p.nbr * p.G, 65535), (unsigned)p.S);
  decode_partial_kernel<scalar_t, acc_t><<<grid, kDecodeLanes, 0, stream>>>(p);
  decode_merge_kernel<scalar_t, acc_t><<<(unsigned)(p.B * p.Hq), kDecodeLanes, 0, stream>>>(p);
}

}  // namespace

void decode_launch(const DecodeParams& p, DType t, cudaStream_t stream) {
  switch (t) {
    case DType::kHalf: launch<c10::Half, float>(p, stream); break;
    case DType::kBFloat16: launch<c10::BFloat16, float>(p, stream); break;
    case DType::kFloat: launch<float, float>(p, stream); break;
    case DType::kDouble: launch<double, double>(p, stream); break;
  }
}

}  // namespace cuda
}  // namespace dilated_attention
