// The sm90 kernels' launcher (launch.h): tc90_call picks the instantiation of tc_fwd90_dp,
// tc_dq90_dp or tc_dkv90_dp (tc90_kernels.cuh, each compiled in csrc/cuda/tc/<pass>90_<dtype>_d<DP>.cu)
// for the dtype and the padded head dim; and the probe that says whether the GPU runs the sm_90a
// code of these kernels.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

#include "tc90_kernels.cuh"

namespace dilated_attention {
namespace cuda {

DA_TC_EXTERN(tc_fwd90_dp, __half)
DA_TC_EXTERN(tc_fwd90_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dq90_dp, __half)
DA_TC_EXTERN(tc_dq90_dp, __nv_bfloat16)
DA_TC_EXTERN(tc_dkv90_dp, __half)
DA_TC_EXTERN(tc_dkv90_dp, __nv_bfloat16)

TcConfig tc90_call(int kernel, bool half, const Params& p, bool launch, cudaStream_t stream) {
  if (kernel == kFwd) {
    if (half) DA_TC_DISPATCH_DP(p.D, tc_fwd90_dp, __half, p, launch, stream)
    DA_TC_DISPATCH_DP(p.D, tc_fwd90_dp, __nv_bfloat16, p, launch, stream)
  }
  if (kernel == kDq) {
    if (half) DA_TC_DISPATCH_DP(p.D, tc_dq90_dp, __half, p, launch, stream)
    DA_TC_DISPATCH_DP(p.D, tc_dq90_dp, __nv_bfloat16, p, launch, stream)
  }
  if (half) DA_TC_DISPATCH_DP(p.D, tc_dkv90_dp, __half, p, launch, stream)
  DA_TC_DISPATCH_DP(p.D, tc_dkv90_dp, __nv_bfloat16, p, launch, stream)
}

namespace {
std::atomic<bool> g_tma_refused{false};

// The maps encoded so far, by description: the encoding is a function of the description alone
// (pointer, dims, strides, box, swizzle), so a launch with the same tensors and rates takes the
// bytes encoded before instead of calling the driver again. Bounded: emptied when full.
using MapKey = std::array<uint64_t, 16>;
using MapBytes = std::array<unsigned char, 128>;
constexpr size_t kMaxCachedMaps = 1024;
std::mutex g_maps_mutex;
std::map<MapKey, MapBytes> g_maps;

MapKey map_key(const TmaBox& b) {
  MapKey k{};
  k[0] = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(b.base));
  for (int i = 0; i < 5; ++i) k[1 + i] = b.dims[i];
  for (int i = 0; i < 4; ++i) k[6 + i] = b.strides[i];
  for (int i = 0; i < 5; ++i) k[10 + i] = b.box[i];
  k[15] = static_cast<uint64_t>(b.swizzle_bytes);
  return k;
}
}  // namespace

bool tma_refused() {
  return g_tma_refused.load(std::memory_order_relaxed);
}

bool tma_encode(const TmaBox& b, void* map) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) {
    g_tma_refused.store(true, std::memory_order_relaxed);
    return false;
  }
  const MapKey key = map_key(b);
  {
    std::lock_guard<std::mutex> lock(g_maps_mutex);
    const auto it = g_maps.find(key);
    if (it != g_maps.end()) {
      std::memcpy(map, it->second.data(), it->second.size());
      return true;
    }
  }
  cuuint64_t dims[5], strides[4];
  cuuint32_t box[5], steps[5] = {1, 1, 1, 1, 1};
  for (int i = 0; i < 5; ++i) {
    dims[i] = b.dims[i];
    box[i] = b.box[i];
  }
  for (int i = 0; i < 4; ++i) strides[i] = b.strides[i];
  const CUresult r =
      encode(static_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(b.base),
             dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
             b.swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    g_tma_refused.store(true, std::memory_order_relaxed);
    return false;
  }
  std::lock_guard<std::mutex> lock(g_maps_mutex);
  if (g_maps.size() >= kMaxCachedMaps) g_maps.clear();
  MapBytes bytes;
  std::memcpy(bytes.data(), map, bytes.size());
  g_maps.emplace(key, bytes);
  return true;
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
