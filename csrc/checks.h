// Argument checks shared by the CPU and CUDA implementations of the op. Each check names the
// tensor or argument, what was expected and what was given. Python normalises arguments first;
// these checks guard the op when it is called directly through torch.ops.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "dilated_attention.h"

namespace dilated_attention {

struct Problem {
  int64_t B, N, Hq, Hkv, D;
  da_branches branches;
  bool is_causal;
  double scale;
};

inline void check_branches(at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                           da_branches* out) {
  TORCH_CHECK(segment_lengths.size() >= 1, "dilated_attention: segment_lengths must not be empty");
  TORCH_CHECK(segment_lengths.size() == dilation_rates.size(),
              "dilated_attention: segment_lengths and dilation_rates must have the same length, got ",
              segment_lengths.size(), " segment lengths ", segment_lengths, " and ", dilation_rates.size(),
              " dilation rates ", dilation_rates);
  TORCH_CHECK(segment_lengths.size() <= DA_MAX_BRANCHES, "dilated_attention: at most ", DA_MAX_BRANCHES,
              " branches are supported, got ", segment_lengths.size());
  out->n = (int64_t)segment_lengths.size();
  for (size_t i = 0; i < segment_lengths.size(); ++i) {
    const int64_t w = segment_lengths[i], r = dilation_rates[i];
    TORCH_CHECK(w >= 1, "dilated_attention: segment_lengths[", i, "] must be >= 1, got ", w);
    TORCH_CHECK(r >= 1, "dilated_attention: dilation_rates[", i, "] must be >= 1, got ", r);
    TORCH_CHECK(r <= w, "dilated_attention: dilation_rates[", i, "] = ", r,
                " must not exceed segment_lengths[", i, "] = ", w);
    // Index arithmetic (segment start + w, position + r) must not overflow int64. The Python API
    // brings larger branches down to equivalent ones (_validation.effective_branches).
    TORCH_CHECK(w <= ((int64_t)1 << 40), "dilated_attention: segment_lengths[", i, "] = ", w,
                " exceeds 2^40; use an equivalent w = max(N, r) (the whole sequence is one segment)");
    out->w[i] = w;
    out->r[i] = r;
  }
}

inline void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.dtype() == b.dtype(), "dilated_attention: ", a_name, " and ", b_name,
              " must have the same dtype, got ", a.dtype(), " and ", b.dtype());
  TORCH_CHECK(a.device() == b.device(), "dilated_attention: ", a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

inline Problem check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal,
                            double softmax_scale) {
  TORCH_CHECK(q.dim() == 4, "dilated_attention: q must be 4-D (B, N, Hq, D), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "dilated_attention: k must be 4-D (B, N, Hkv, D), got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "dilated_attention: v must be 4-D (B, N, Hkv, D), got shape ", v.sizes());
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
              "dilated_attention: q, k, v must be float16, bfloat16, float32 or float64, got ", q.dtype());
  TORCH_CHECK(k.sizes() == v.sizes(), "dilated_attention: k and v must have the same shape, got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "dilated_attention: q (B, N, Hq, D) and k (B, N, Hkv, D) must agree in B, N and D, "
              "got q ",
              q.sizes(), " and k ", k.sizes());
  Problem p;
  p.B = q.size(0);
  p.N = q.size(1);
  p.Hq = q.size(2);
  p.Hkv = k.size(2);
  p.D = q.size(3);
  TORCH_CHECK(p.Hkv >= 1 && p.Hq >= 1 && p.Hq % p.Hkv == 0, "dilated_attention: the number of query heads (",
              p.Hq, ") must be a positive multiple of the number of key/value heads (", p.Hkv, ")");
  TORCH_CHECK(p.D >= 1 && p.D <= DA_MAX_HEAD_DIM, "dilated_attention: head dim must be in [1, ",
              DA_MAX_HEAD_DIM, "], got ", p.D);
  TORCH_CHECK(std::isfinite(softmax_scale), "dilated_attention: softmax_scale must be finite, got ",
              softmax_scale);
  check_branches(segment_lengths, dilation_rates, &p.branches);
  p.is_causal = is_causal;
  p.scale = softmax_scale;
  return p;
}

// The layout of the log-sum-exp: (B, Hq, N), float32 (float64 for float64 inputs).
inline at::ScalarType lse_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// Checks of the extra tensors the backward takes.
inline void check_backward_inputs(const Problem& p, const at::Tensor& q, const at::Tensor& dout,
                                  const at::Tensor& out, const at::Tensor& lse,
                                  const c10::optional<at::Tensor>& dlse) {
  TORCH_CHECK(dout.sizes() == q.sizes(), "dilated_attention backward: dout must have q's shape ", q.sizes(),
              ", got ", dout.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "dilated_attention backward: out must have q's shape ", q.sizes(),
              ", got ", out.sizes());
  check_same(q, "q", dout, "dout");
  check_same(q, "q", out, "out");
  const std::vector<int64_t> lse_shape = {p.B, p.Hq, p.N};
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape),
              "dilated_attention backward: lse must have shape (B, Hq, N) = ", lse_shape, ", got ",
              lse.sizes());
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()), "dilated_attention backward: lse must be ",
              c10::toString(lse_dtype(q.scalar_type())), ", got ", lse.dtype());
  TORCH_CHECK(lse.device() == q.device(), "dilated_attention backward: lse must be on ", q.device(), ", got ",
              lse.device());
  if (dlse.has_value() && dlse->defined()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes(), "dilated_attention backward: dlse must have shape ",
                lse.sizes(), ", got ", dlse->sizes());
    TORCH_CHECK(dlse->device() == q.device(), "dilated_attention backward: dlse must be on ", q.device(),
                ", got ", dlse->device());
  }
}

// A view whose last dimension is contiguous; copies only when it is not.
inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace dilated_attention
