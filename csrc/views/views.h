// The views driver's two ops (views.cpp), for the packed form (varlen.cpp) that runs them per
// sequence.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace dilated_attention {
namespace views {

// Whether q, k and v hold only finite values, which spares the forward its corrections for
// non-finite inputs: one launch and one device synchronisation on CUDA (for the packed form, which
// reads its cu_seqlens on the host anyway); false while a CUDA graph is captured (the corrections
// are then applied, exact either way).
bool inputs_finite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// dilated_attention::views_fwd: out (B, N, Hq, D) in q's dtype and lse (B, Hq, N) float32
// (float64 for float64 inputs) of every branch merged (SPEC sections 2-3). finite: true where the
// caller knows that these inputs are finite (the packed form checks its whole tensors once), which
// spares the forward its corrections for non-finite inputs; false or nullopt: the rows holding
// non-finite entries are flagged on the device and corrected in the merge, without a read back to
// the host.
std::tuple<at::Tensor, at::Tensor> views_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                             at::IntArrayRef dilation_rates, bool is_causal,
                                             double softmax_scale, std::optional<bool> finite);

// dilated_attention::views_bwd: (dq, dk, dv) in the inputs' dtypes, the exact gradients of out
// (and of lse, dlse given) through the mixing weights, from the merged out and lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> views_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale);

}  // namespace views
}  // namespace dilated_attention
