// The tensor-core launchers of launch.h: each picks the instantiation of tc_fwd_dp, tc_dq_dp or
// tc_dkv_dp (tc_kernels.cuh) for its dtype and the padded head dim. The instantiations are only
// declared here: each is compiled in a file of its own, csrc/cuda/tc/<pass>_<dtype>_d<DP>.cu
// (written by scripts/generate_tc_instances.py), so that the build compiles them in parallel.
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

DA_TC_EXTERN(tc_fwd_dp, __half)
DA_TC_EXTERN(tc_fwd_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dq_dp, __half)
DA_TC_EXTERN(tc_dq_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dkv_dp, __half)
DA_TC_EXTERN(tc_dkv_dp, __nv_bfloat16)

TcConfig tc_fwd_f16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_fwd_dp, __half, p, launch, stream);
}

TcConfig tc_fwd_bf16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_fwd_dp, __nv_bfloat16, p, launch, stream);
}

TcConfig tc_dq_f16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dq_dp, __half, p, launch, stream);
}

TcConfig tc_dq_bf16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dq_dp, __nv_bfloat16, p, launch, stream);
}

TcConfig tc_dkv_f16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dkv_dp, __half, p, launch, stream);
}

TcConfig tc_dkv_bf16(const Params& p, bool launch, cudaStream_t stream) {
  DA_TC_DISPATCH_DP(p.D, tc_dkv_dp, __nv_bfloat16, p, launch, stream);
}

}  // namespace cuda
}  // namespace dilated_attention
