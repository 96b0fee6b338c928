// dilated_attention::views_varlen_fwd and views_varlen_bwd: the views driver on packed sequences
// (FlashAttention's varlen convention, SPEC section 7), one op each way.
//
// q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,) on q's device; sequence i is the
// rows [cu_seqlens[i], cu_seqlens[i + 1]) and attends as a sequence of its own: its rows run
// views_fwd / views_bwd (views.h) as a batch of one of their own length, on views of the packed
// tensors, and their results are written into the packed out (T, Hq, D), lse (Hq, T) and
// gradients. cu_seqlens is read on the host once per call (one small copy that waits for the
// stream on CUDA), and checked as the native varlen op checks it (checks.h varlen_sequences).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "views/views.h"

namespace dilated_attention {
namespace views {
namespace {

std::vector<Sequence> packed_sequences(const char* op, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                                       at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                       bool is_causal, double softmax_scale) {
  const Problem P = check_varlen_inputs(q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates,
                                        is_causal, softmax_scale);
  TORCH_CHECK(q.is_cpu() || q.is_cuda(), "dilated_attention::", op,
              ": q, k, v must be on the CPU or CUDA, got ", q.device());
  return varlen_sequences(cu_seqlens, P.N, max_seqlen);
}

// Rows [start, start + len) of a packed (T, H, D) tensor as a (1, len, H, D) batch.
at::Tensor rows(const at::Tensor& x, const Sequence& s) {
  return x.narrow(0, s.start, s.len).unsqueeze(0);
}

}  // namespace

// out (T, Hq, D) in q's dtype and lse (Hq, T) float32 (float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> views_varlen_fwd(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& cu_seqlens,
                                                    int64_t max_seqlen, at::IntArrayRef segment_lengths,
                                                    at::IntArrayRef dilation_rates, bool is_causal,
                                                    double softmax_scale) {
  const std::vector<Sequence> seqs =
      packed_sequences("views_varlen_fwd", q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates,
                       is_causal, softmax_scale);
  const at::Tensor out = at::empty(q.sizes(), q.options());
  const at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype(q.scalar_type())));
  for (const Sequence& s : seqs) {
    if (s.len == 0) continue;
    auto [o, l] = views_fwd(rows(q, s), rows(k, s), rows(v, s), segment_lengths, dilation_rates, is_causal,
                            softmax_scale);
    out.narrow(0, s.start, s.len).copy_(o[0]);
    lse.narrow(1, s.start, s.len).copy_(l[0]);
  }
  return {out, lse};
}

// (dq, dk, dv) in the inputs' dtypes from the packed merged out and lse (and dlse (Hq, T)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> views_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale) {
  const std::vector<Sequence> seqs =
      packed_sequences("views_varlen_bwd", q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates,
                       is_causal, softmax_scale);
  check_varlen_backward_shapes(q, dout, out, lse, dlse);
  const bool has_dlse = dlse.has_value() && dlse->defined();
  const at::Tensor dq = at::zeros(q.sizes(), q.options());
  const at::Tensor dk = at::zeros(k.sizes(), k.options());
  const at::Tensor dv = at::zeros(v.sizes(), v.options());
  for (const Sequence& s : seqs) {
    if (s.len == 0) continue;
    const std::optional<at::Tensor> dl =
        has_dlse ? std::optional<at::Tensor>(dlse->narrow(1, s.start, s.len).unsqueeze(0)) : std::nullopt;
    auto [gq, gk, gv] = views_bwd(rows(dout, s), rows(q, s), rows(k, s), rows(v, s), rows(out, s),
                                  lse.narrow(1, s.start, s.len).unsqueeze(0), dl, segment_lengths,
                                  dilation_rates, is_causal, softmax_scale);
    dq.narrow(0, s.start, s.len).copy_(gq[0]);
    dk.narrow(0, s.start, s.len).copy_(gk[0]);
    dv.narrow(0, s.start, s.len).copy_(gv[0]);
  }
  return {dq, dk, dv};
}

}  // namespace views

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("views_varlen_fwd", &views::views_varlen_fwd);
  m.impl("views_varlen_bwd", &views::views_varlen_bwd);
}

#ifdef DILATED_ATTENTION_WITH_CUDA
TORCH_LIBRARY_IMPL(dilated_attention, CUDA, m) {
  m.impl("views_varlen_fwd", &views::views_varlen_fwd);
  m.impl("views_varlen_bwd", &views::views_varlen_bwd);
}
#endif

}  // namespace dilated_attention
