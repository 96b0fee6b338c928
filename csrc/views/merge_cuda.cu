// The launches of the fused merge of merge.h on CUDA (merge_kernel.cuh: up to kMergeCalls calls a
// launch), and the choice of the attention operator the views driver runs on CUDA.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "views/merge.h"
#include "views/merge_kernel.cuh"

namespace dilated_attention {
namespace views {

namespace {

// Call c of merge_calls_ as merge_kernel takes it (lse_c in acc_t).
template <typename scalar_t, typename acc_t>
MergeTensors<scalar_t, acc_t> merge_tensors(const MergeCall& c) {
  MergeTensors<scalar_t, acc_t> t;
  t.oa = c.out_acc.data_ptr<acc_t>();
  t.la = c.lse_acc.data_ptr<acc_t>();
  t.oc = c.out_c.const_data_ptr<scalar_t>();
  t.lc = c.lse_c.const_data_ptr<acc_t>();
  t.Bb = c.out_acc.size(1);
  t.m = c.out_acc.size(2);
  t.n = c.out_acc.size(3);
  t.D = c.out_acc.size(4);
  t.rows = c.out_acc.size(0) * t.Bb * t.m * t.n;
  for (int i = 0; i < 5; ++i) t.so[i] = c.out_acc.stride(i), t.sc[i] = c.out_c.stride(i);
  for (int i = 0; i < 4; ++i) t.sl[i] = c.lse_acc.stride(i), t.slc[i] = c.lse_c.stride(i);
  t.nf = nonfinite_rows<scalar_t>(c.fix);
  return t;
}

}  // namespace

// The operator views.cpp runs for q on its GPU, as dilated_attention.backends.sdpa_kernels.
// cuda_kernel chooses: 2 cuDNN (sm_90+, float16/bfloat16, head dim a multiple of 8 and <= 128,
// cuDNN attention available and enabled), 1 flash (sm_80+, head dim a multiple of 8 and <= 256,
// enabled), else 3 efficient (float32, float16, bfloat16; PyTorch's operator refuses what it does
// not take), 0 for any other dtype.
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
  const at::ScalarType t = q.scalar_type();
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 ? 3 : 0;
}

// Whether the current CUDA stream is being captured into a graph (no value can be read then).
bool cuda_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

void merge_calls_cuda_(const std::vector<MergeCall>& calls, bool first) {
  if (calls.empty()) return;
  const c10::cuda::CUDAGuard guard(calls[0].out_acc.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // the calls of each pair of dtypes (the views driver's: one), in launches of kMergeCalls
  std::vector<bool> done(calls.size(), false);
  for (size_t i = 0; i < calls.size(); ++i) {
    if (done[i]) continue;
    const at::ScalarType acc = calls[i].out_acc.scalar_type(), src = calls[i].out_c.scalar_type();
    std::vector<size_t> group;
    for (size_t k = i; k < calls.size(); ++k)
      if (!done[k] && calls[k].out_acc.scalar_type() == acc && calls[k].out_c.scalar_type() == src) {
        group.push_back(k);
        done[k] = true;
      }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src, "views_merge_cuda", [&] {
      auto run = [&](auto zero) {
        using acc_t = decltype(zero);
        merge_in_jobs<scalar_t, acc_t>(
            static_cast<int64_t>(group.size()), first,
            [&](int64_t g) { return merge_tensors<scalar_t, acc_t>(calls[group[g]]); },
            [&](const MergeJob<scalar_t, acc_t>& job) {
              merge_kernel<scalar_t, acc_t><<<merge_grid(job), kMergeThreads, 0, stream>>>(job);
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
      };
      if (acc == at::kDouble)
        run(double(0));
      else
        run(float(0));
    });
  }
}

}  // namespace views
}  // namespace dilated_attention
