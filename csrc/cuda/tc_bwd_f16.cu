// Tensor-core backward kernels (dq and dk/dv) for __half (see tc_kernels.cuh).
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

TcConfig tc_dq_f16(const Params& p, bool launch,
                   cudaStream_t stream){DA_TC_DISPATCH_DP(p.D, tc_dq_dp, __half, p, launch, stream)}

TcConfig tc_dkv_f16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dkv_dp, __half, p, launch, stream)
}

}  // namespace cuda
}  // namespace dilated_attention
