// The fused merge of merge.h on CUDA (one warp per row (bb, j, t), its lanes over the head dim),
// and the choice of the attention operator the views driver runs on CUDA.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "views/merge.h"

namespace dilated_attention {
namespace views {

namespace {

// Sizes and strides of the merge's four tensors (elements); two batch dims (C, Bb).
struct MergeShape {
  int64_t C, Bb, m, n, D;
  int64_t so[5], sl[4], sc[5], slc[4];
};

// merge_call_'s rows: warp w of the grid merges row w; lane 0 stores the merged lse after every
// lane has read the old one.
template <typename scalar_t, typename acc_t>
__global__ void merge_kernel(acc_t* __restrict__ oa, acc_t* __restrict__ la, const scalar_t* __restrict__ oc,
                             const acc_t* __restrict__ lc, MergeShape s, bool first,
                             NonFiniteRows<scalar_t> nf) {
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= s.C * s.Bb * s.m * s.n) return;
  const int64_t bb = row / (s.m * s.n), j = (row / s.n) % s.m, t = row % s.n;
  acc_t* o = oa + batch_offset(bb, s.Bb, s.so) + j * s.so[2] + t * s.so[3];
  acc_t* l = la + batch_offset(bb, s.Bb, s.sl) + j * s.sl[2] + t * s.sl[3];
  const scalar_t* c = oc + batch_offset(bb, s.Bb, s.sc) + t * s.sc[2] + j * s.sc[3];
  const CorrectedRow<scalar_t, acc_t> corrected(nf, bb, j, t);
  const acc_t b = corrected.lse(lc[batch_offset(bb, s.Bb, s.slc) + t * s.slc[2] + j * s.slc[3]]);
  acc_t lse = b, wa = 0, wb = 1;
  if (!first) merge_weights<acc_t>(*l, b, &lse, &wa, &wb);
  for (int64_t d = lane; d < s.D; d += 32) {
    const acc_t v = corrected.out((acc_t)c[d * s.sc[4]], d) * wb;
    o[d * s.so[4]] = first ? v : o[d * s.so[4]] * wa + v;
  }
  __syncwarp();
  if (lane == 0) *l = lse;
}

}  // namespace

// The operator views.cpp runs for q on its GPU, as dilated_attention.backends.sdpa_kernels.
// cuda_kernel chooses: 2 cuDNN (sm_90+, float16/bfloat16, head dim a multiple of 8 and <= 128,
// cuDNN attention available and enabled), 1 flash (sm_80+, head dim a multiple of 8 and <= 256,
// enabled), 0 neither.
int cuda_kernel_kind(const at::Tensor& q) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
  const int cap = major * 10 + minor;
  const int64_t D = q.size(-1);
  const bool half = (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) && D % 8 == 0;
  auto& ctx = at::globalContext();
  if (half && cap >= 90 && D <= 128 && ctx.hasCuDNN() && ctx.userEnabledCuDNNSDP()) return 2;
  if (half && cap >= 80 && D <= 256 && ctx.userEnabledFlashSDP()) return 1;
  return 0;
}

// Whether the current CUDA stream is being captured into a graph (no value can be read then).
bool cuda_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

void merge_call_cuda_(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& out_c,
                      const at::Tensor& lse_c, bool first, const CallNonFinite* fix) {
  const c10::cuda::CUDAGuard guard(out_acc.device());
  MergeShape s;
  s.C = out_acc.size(0);
  s.Bb = out_acc.size(1);
  s.m = out_acc.size(2);
  s.n = out_acc.size(3);
  s.D = out_acc.size(4);
  for (int i = 0; i < 5; ++i) s.so[i] = out_acc.stride(i), s.sc[i] = out_c.stride(i);
  for (int i = 0; i < 4; ++i) s.sl[i] = lse_acc.stride(i), s.slc[i] = lse_c.stride(i);
  const int64_t rows = s.C * s.Bb * s.m * s.n;
  if (rows == 0) return;
  const int threads = 256;
  const int64_t blocks = (rows * 32 + threads - 1) / threads;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_c.scalar_type(), "views_merge_cuda", [&] {
    if (out_acc.scalar_type() == at::kDouble)
      merge_kernel<scalar_t, double><<<blocks, threads, 0, stream>>>(
          out_acc.data_ptr<double>(), lse_acc.data_ptr<double>(), out_c.const_data_ptr<scalar_t>(),
          lse_c.const_data_ptr<double>(), s, first, nonfinite_rows<scalar_t>(fix));
    else
      merge_kernel<scalar_t, float><<<blocks, threads, 0, stream>>>(
          out_acc.data_ptr<float>(), lse_acc.data_ptr<float>(), out_c.const_data_ptr<scalar_t>(),
          lse_c.const_data_ptr<float>(), s, first, nonfinite_rows<scalar_t>(fix));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace views
}  // namespace dilated_attention
