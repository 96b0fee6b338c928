// The sm90 forward's launchers (launch.h): each picks the instantiation of tc_fwd90_dp
// (tc90_kernels.cuh, compiled in csrc/cuda/tc/fwd90_<dtype>_d<DP>.cu) for the padded head dim, and
// the probe that says whether the GPU runs the sm_90a code of these kernels.
#include <atomic>

#include "tc90_kernels.cuh"

namespace dilated_attention {
namespace cuda {

#define DA_TC90_EXTERN(T)                                                          \
  extern template TcConfig tc_fwd90_dp<T, 32>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig tc_fwd90_dp<T, 64>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig tc_fwd90_dp<T, 96>(const Params&, bool, cudaStream_t);  \
  extern template TcConfig tc_fwd90_dp<T, 128>(const Params&, bool, cudaStream_t); \
  extern template TcConfig tc_fwd90_dp<T, 192>(const Params&, bool, cudaStream_t); \
  extern template TcConfig tc_fwd90_dp<T, 256>(const Params&, bool, cudaStream_t);
DA_TC90_EXTERN(__half)
DA_TC90_EXTERN(__nv_bfloat16)
#undef DA_TC90_EXTERN

template <typename T>
TcConfig tc90_fwd(const Params& p, bool launch, cudaStream_t stream) {
  switch (tc_padded_dim(p.D)) {
    case 32: return tc_fwd90_dp<T, 32>(p, launch, stream);
    case 64: return tc_fwd90_dp<T, 64>(p, launch, stream);
    case 96: return tc_fwd90_dp<T, 96>(p, launch, stream);
    case 128: return tc_fwd90_dp<T, 128>(p, launch, stream);
    case 192: return tc_fwd90_dp<T, 192>(p, launch, stream);
    default: return tc_fwd90_dp<T, 256>(p, launch, stream);
  }
}

TcConfig tc90_fwd_f16(const Params& p, bool launch, cudaStream_t stream) {
  return tc90_fwd<__half>(p, launch, stream);
}

TcConfig tc90_fwd_bf16(const Params& p, bool launch, cudaStream_t stream) {
  return tc90_fwd<__nv_bfloat16>(p, launch, stream);
}

__global__ void tc90_probe_kernel(int* flag) {
  *flag = DA_SM90A ? 1 : 2;
}

// Launches the probe once per device, on a stream of its own and in the relaxed capture mode, so
// that a first call inside a CUDA-graph capture on another stream neither breaks the capture nor is
// captured. Any failure reads as "not available" (the sm80 kernels run).
bool tc90_available(int device) {
  static std::atomic<int> known[64] = {};  // 0 not probed, 1 sm_90a code, 2 none
  if (device < 0 || device >= 64) return false;
  int seen = known[device].load(std::memory_order_acquire);
  if (seen != 0) return seen == 1;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  int answer = 2, current = -1, host = 0;
  int* flag = nullptr;
  cudaStream_t s = nullptr;
  if (cudaGetDevice(&current) == cudaSuccess && cudaSetDevice(device) == cudaSuccess &&
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
      cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    tc90_probe_kernel<<<1, 1, 0, s>>>(flag);
    if (cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, s) == cudaSuccess &&
        cudaStreamSynchronize(s) == cudaSuccess && host == 1)
      answer = 1;
  }
  cudaGetLastError();  // a failure above is not the caller's error
  if (flag) cudaFree(flag);
  if (s) cudaStreamDestroy(s);
  if (current >= 0) cudaSetDevice(current);
  cudaThreadExchangeStreamCaptureMode(&mode);
  known[device].store(answer, std::memory_order_release);
  return answer == 1;
}

}  // namespace cuda
}  // namespace dilated_attention
