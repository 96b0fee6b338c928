// CUDA host side of dilated_attention::decode_step (schema and CPU kernel in csrc/cpu/decode_cpu.cpp,
// kernels in decode.cuh, launched by decode_launch.cu): the shared checks, then three launches on
// the current stream (write the token, partial results per head, branch and split of the keys,
// merge). The positions are checked against the slots on the host (one copy of B int64 values).
// Host code only (compiled by the C++ compiler, as dilated_attention_cuda.cpp is).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../checks.h"
#include "launch.h"

namespace dilated_attention {

void check_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& pos, at::IntArrayRef segs,
                       at::IntArrayRef rates, at::IntArrayRef lengths, double softmax_scale);

namespace {

cuda::DType decode_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return cuda::DType::kHalf;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kFloat: return cuda::DType::kFloat;
    case at::kDouble: return cuda::DType::kDouble;
    default: TORCH_CHECK(false, "decode_step: unsupported dtype ", dtype_name(t));
  }
}

std::tuple<at::Tensor, at::Tensor> decode_step_cuda(const at::Tensor& q_, const at::Tensor& k_,
                                                    const at::Tensor& v_, at::Tensor& k_cache,
                                                    at::Tensor& v_cache, const at::Tensor& pos_,
                                                    at::IntArrayRef segment_lengths,
                                                    at::IntArrayRef dilation_rates,
                                                    at::IntArrayRef slot_lengths, double softmax_scale) {
  check_decode_step(q_, k_, v_, k_cache, v_cache, pos_, segment_lengths, dilation_rates, slot_lengths,
                    softmax_scale);
  const int64_t nbr = (int64_t)segment_lengths.size(), D = q_.size(2);
  TORCH_CHECK(nbr <= DA_MAX_BRANCHES, "decode_step: at most ", DA_MAX_BRANCHES, " branches on CUDA, got ",
              nbr);
  TORCH_CHECK(D <= cuda::kDecodeMaxD, "decode_step: head dim at most ", (int)cuda::kDecodeMaxD,
              " on CUDA, got ", D);
  const c10::cuda::CUDAGuard guard(q_.device());
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), pos = pos_.contiguous();
  const at::Tensor pos_host = pos.cpu();
  const int64_t* P = pos_host.data_ptr<int64_t>();
  cuda::DecodeParams p{};
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.Hkv = k_cache.size(1);
  p.D = D;
  p.T = k_cache.size(2);
  p.G = p.Hq / p.Hkv;
  p.nbr = nbr;
  int64_t off = 0;
  for (int64_t i = 0; i < nbr; ++i) {
    p.w[i] = segment_lengths[i];
    p.r[i] = dilation_rates[i];
    p.rows[i] = std::min(p.G, p.r[i]);
    p.len[i] = slot_lengths[i];
    p.off[i] = off;
    off += p.rows[i] * p.len[i];
    for (int64_t b = 0; b < p.B; ++b)
      TORCH_CHECK(P[b] < 0 || (P[b] % p.w[i]) / p.r[i] < p.len[i], "decode_step: position ", P[b],
                  " of sequence ", b, " is beyond the cache's slots (", p.len[i], " for branch w=", p.w[i],
                  ", r=", p.r[i], ")");
  }
  // Split the rows so that about two blocks per multiprocessor have work (FlashDecoding's split-K).
  int sms = 1;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.get_device()));
  const int64_t blocks = std::max<int64_t>(1, p.B * p.Hkv * nbr * p.G);
  p.S = std::clamp<int64_t>((2 * sms + blocks - 1) / blocks, 1, 64);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor part = at::empty({p.B * p.Hkv * nbr * p.G * p.S * (D + 2)}, q.options().dtype(acc));
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({p.B, p.Hq}, q.options().dtype(acc));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.kc = k_cache.data_ptr();
  p.vc = v_cache.data_ptr();
  p.pos = pos.data_ptr<int64_t>();
  p.part = part.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.scale = softmax_scale;
  if (p.B == 0) return {out, lse};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  cuda::decode_launch(p, decode_dtype(q.scalar_type()), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(dilated_attention, CUDA, m) {
  m.impl("decode_step", &decode_step_cuda);
}

}  // namespace dilated_attention
