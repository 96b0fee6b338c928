// The tensor-core launchers of launch.h: each picks the instantiation of tc_fwd_dp, tc_dq_dp or
// tc_dkv_dp (tc_kernels.cuh) for its dtype and the padded head dim. The instantiations are only
// declared here: each is compiled in a file of its own, csrc/cuda/tc/<pass>_<dtype>_d<DP>.cu
// (written by scripts/generate_tc_instances.py), so that the build compiles them in parallel.
#include "tc_kernels.cuh"

namespace dilated_attention {
namespace cuda {

#define DA_TC_EXTERN(FN, T)                                               \
  extern template TcConfig FN<T, 32>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 64>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 96>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig FN<T, 128>(const Params&, bool, cudaStream_t); \
  extern template TcConfig FN<T, 192>(const Params&, bool, cudaStream_t); \
  extern template TcConfig FN<T, 256>(const Params&, bool, cudaStream_t);
DA_TC_EXTERN(tc_fwd_dp, __half)
DA_TC_EXTERN(tc_fwd_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dq_dp, __half)
DA_TC_EXTERN(tc_dq_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dkv_dp, __half)
DA_TC_EXTERN(tc_dkv_dp, __nv_bfloat16)
#undef DA_TC_EXTERN

// Returns FN<T, DP>(...) for the padded head dimension DP of D.
#define DA_TC_DISPATCH_DP(D, FN, T, ...)      \
  switch (tc_padded_dim(D)) {                 \
    case 32: return FN<T, 32>(__VA_ARGS__);   \
    case 64: return FN<T, 64>(__VA_ARGS__);   \
    case 96: return FN<T, 96>(__VA_ARGS__);   \
    case 128: return FN<T, 128>(__VA_ARGS__); \
    case 192: return FN<T, 192>(__VA_ARGS__); \
    default: return FN<T, 256>(__VA_ARGS__);  \
  }

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

#undef DA_TC_DISPATCH_DP

}  // namespace cuda
}  // namespace dilated_attention
