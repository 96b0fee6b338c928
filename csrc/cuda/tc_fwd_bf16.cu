// Tensor-core forward kernels for __nv_bfloat16 (see tc_kernels.cuh), one instantiation per padded head dim.
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

TcConfig tc_fwd_bf16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_fwd_dp, __nv_bfloat16, p, launch, stream)
}

}  // namespace cuda
}  // namespace dilated_attention
