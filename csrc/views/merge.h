// The fused log-sum-exp merge of one kernel call's result into the driver's accumulators (SPEC
// section 3), one pass per call, no buffer per branch:
//
//     lse = logaddexp(lse_acc, lse_c),    out = exp(lse_acc - lse) out_acc + exp(lse_c - lse) out_c
//
// with out = 0 and lse = -inf where neither part covers a row (never NaN from the merge itself).
#pragma once

#include <ATen/ATen.h>

namespace dilated_attention {
namespace views {

// Merges a call's out_c (Bb, n, m, D), any strides, and lse_c (Bb, n, m) into strided views of
// the accumulators out_acc (Bb, m, n, D) and lse_acc (Bb, m, n), in place; both accumulators in
// float32 or float64 (lse_c is converted to their dtype). first: the accumulators hold nothing
// yet at these rows, so the call's values are copied. Runs on the device of the tensors.
void merge_call_(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& out_c,
                 const at::Tensor& lse_c, bool first);

#ifdef DILATED_ATTENTION_WITH_CUDA
// merge_call_ on CUDA tensors (merge_cuda.cu).
void merge_call_cuda_(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& out_c,
                      const at::Tensor& lse_c, bool first);
#endif

}  // namespace views
}  // namespace dilated_attention
