// The fused log-sum-exp merge of kernel calls' results into the driver's accumulators (SPEC
// section 3), one pass over a call's rows, no buffer per branch:
//
//     lse = logaddexp(lse_acc, lse_c),    out = exp(lse_acc - lse) out_acc + exp(lse_c - lse) out_c
//
// with out = 0 and lse = -inf where neither part covers a row (never NaN from the merge itself).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "views/merge_rule.h"

namespace dilated_attention {
namespace views {

// The non-finite corrections of one call (merge_rule.h's NonFiniteRows) as tensors: int32 flags
// any (1,), qbad (C, Bb, m, n), kbad and vbad (C, Bb, mk, nk) (vbad undefined without causal
// masking), the values v (C, Bb, mk, nk, D) in out_c's dtype; query head t reads key/value head
// t / g.
struct CallNonFinite {
  at::Tensor any, qbad, kbad, vbad, v;
  int64_t g;
  bool causal;
};

// The rows of fix for the kernels (no corrections where fix is null).
template <typename scalar_t>
NonFiniteRows<scalar_t> nonfinite_rows(const CallNonFinite* fix) {
  NonFiniteRows<scalar_t> r{};
  if (fix == nullptr) return r;
  r.any = fix->any.const_data_ptr<int>();
  r.qbad = fix->qbad.const_data_ptr<int>();
  r.kbad = fix->kbad.const_data_ptr<int>();
  for (int i = 0; i < 4; ++i) r.sq[i] = fix->qbad.stride(i), r.sk[i] = fix->kbad.stride(i);
  if (fix->vbad.defined()) {
    r.vbad = fix->vbad.const_data_ptr<int>();
    r.v = fix->v.const_data_ptr<scalar_t>();
    for (int i = 0; i < 4; ++i) r.sv[i] = fix->vbad.stride(i);
    for (int i = 0; i < 5; ++i) r.svv[i] = fix->v.stride(i);
  }
  r.Bb = fix->kbad.size(1);
  r.mk = fix->kbad.size(2);
  r.g = fix->g;
  r.causal = fix->causal;
  return r;
}

// One kernel call's merge: its out_c (C, Bb, n, m, D), any strides, and lse_c (C, Bb, n, m) merged
// into strided views of the accumulators out_acc (C, Bb, m, n, D) and lse_acc (C, Bb, m, n), in
// place (two batch dims: a run's calls and their batch entries and segments, views.cpp Run); both
// accumulators in float32 or float64 (lse_c is converted to their dtype), out_c float16, bfloat16,
// float32 or float64. fix: the call's non-finite corrections, applied to its rows first (null:
// none; it must outlive the merge).
struct MergeCall {
  at::Tensor out_acc, lse_acc, out_c, lse_c;
  const CallNonFinite* fix = nullptr;
};

// Merges every call of calls, on the device of their tensors (all on one device). first: the
// accumulators hold nothing yet at the calls' rows, so the calls' values are copied. The caller
// promises that no two calls share a row of the accumulators (the runs of one branch, views.cpp):
// on CUDA up to kMergeCalls (merge_kernel.cuh) calls are merged by one launch, in no order among
// them. Each call is checked (dtypes, shapes, devices, its corrections); an error names the call.
void merge_calls_(const std::vector<MergeCall>& calls, bool first);

#ifdef DILATED_ATTENTION_WITH_CUDA
// merge_calls_ on CUDA tensors (merge_cuda.cu), for calls checked and with lse_c in the
// accumulators' dtype.
void merge_calls_cuda_(const std::vector<MergeCall>& calls, bool first);
#endif

}  // namespace views
}  // namespace dilated_attention
