// Tensor-core backward kernels (dq and dk/dv) for __nv_bfloat16 (see tc_kernels.cuh).
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

TcConfig tc_dq_bf16(const Params& p, bool launch,
                    cudaStream_t stream){DA_TC_DISPATCH_DP(p.D, tc_dq_dp, __nv_bfloat16, p, launch, stream)}

TcConfig tc_dkv_bf16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dkv_dp, __nv_bfloat16, p, launch, stream)
}

}  // namespace cuda
}  // namespace dilated_attention
