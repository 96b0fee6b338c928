// dilated_attention::views_varlen_fwd and views_varlen_bwd: the views driver on packed sequences
// (FlashAttention's varlen convention, SPEC section 7), one op each way.
//
// q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,) on q's device; sequence i is the
// rows [cu_seqlens[i], cu_seqlens[i + 1]) and attends as a sequence of its own: consecutive
// sequences of one length run views_fwd / views_bwd (views.h) as one batch (a sequence of its
// own length is a batch of one), on views of the packed tensors, and their results are written into
// the packed out (T, Hq, D), lse (Hq, T) and gradients. cu_seqlens is read on the host once per
// call (one small copy that waits for the stream on CUDA), and checked as the native varlen op
// checks it (checks.h varlen_sequences).
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

// A run of `count` consecutive sequences of one length `len` from row `start`: one batch of the
// fixed-length driver.
struct Run {
  int64_t start, count, len;
};

// The non-empty sequences grouped into runs of equal lengths (a packing of sequences of one
// length is one batched call, not one call per sequence).
std::vector<Run> runs_of(const std::vector<Sequence>& seqs) {
  std::vector<Run> runs;
  for (const Sequence& s : seqs) {
    if (s.len == 0) continue;
    if (!runs.empty() && runs.back().len == s.len && runs.back().start + runs.back().count * s.len == s.start)
      ++runs.back().count;
    else
      runs.push_back({s.start, 1, s.len});
  }
  return runs;
}

// The rows of a run of a packed (T, H, D) tensor as a (count, len, H, D) batch.
at::Tensor rows(const at::Tensor& x, const Run& r) {
  return x.narrow(0, r.start, r.count * r.len).unflatten(0, {r.count, r.len});
}

// The columns of a run of a packed (H, T) lse as (count, H, len).
at::Tensor cols(const at::Tensor& x, const Run& r) {
  return x.narrow(1, r.start, r.count * r.len).unflatten(1, {r.count, r.len}).transpose(0, 1);
}

}  // namespace

// out (T, Hq, D) in q's dtype and lse (Hq, T) float32 (float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> views_varlen_fwd(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& cu_seqlens,
                                                    int64_t max_seqlen, at::IntArrayRef segment_lengths,
                                                    at::IntArrayRef dilation_rates, bool is_causal,
                                                    double softmax_scale) {
  // the op's own ATen calls: no autograd history (views.cpp)
  const at::AutoDispatchBelowADInplaceOrView guard;
  const std::vector<Sequence> seqs =
      packed_sequences("views_varlen_fwd", q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates,
                       is_causal, softmax_scale);
  const at::Tensor out = at::empty(q.sizes(), q.options());
  const at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype(q.scalar_type())));
  const bool finite = inputs_finite(q, k, v);  // once for every run
  for (const Run& r : runs_of(seqs)) {
    auto [o, l] = views_fwd(rows(q, r), rows(k, r), rows(v, r), segment_lengths, dilation_rates, is_causal,
                            softmax_scale, finite);
    rows(out, r).copy_(o);
    cols(lse, r).copy_(l);
  }
  return {out, lse};
}

// (dq, dk, dv) in the inputs' dtypes from the packed merged out and lse (and dlse (Hq, T)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> views_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, at::IntArrayRef segment_lengths,
    at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale) {
  // the op's own ATen calls: no autograd history (views.cpp)
  const at::AutoDispatchBelowADInplaceOrView guard;
  const std::vector<Sequence> seqs =
      packed_sequences("views_varlen_bwd", q, k, v, cu_seqlens, max_seqlen, segment_lengths, dilation_rates,
                       is_causal, softmax_scale);
  check_varlen_backward_shapes(q, dout, out, lse, dlse);
  const bool has_dlse = dlse.has_value() && dlse->defined();
  // every row belongs to one non-empty sequence (cu_seqlens covers 0..T), so every row is written
  const at::Tensor dq = at::empty(q.sizes(), q.options());
  const at::Tensor dk = at::empty(k.sizes(), k.options());
  const at::Tensor dv = at::empty(v.sizes(), v.options());
  for (const Run& r : runs_of(seqs)) {
    const std::optional<at::Tensor> dl = has_dlse ? std::optional<at::Tensor>(cols(*dlse, r)) : std::nullopt;
    auto [gq, gk, gv] =
        views_bwd(rows(dout, r), rows(q, r), rows(k, r), rows(v, r), rows(out, r), cols(lse, r), dl,
                  segment_lengths, dilation_rates, is_causal, softmax_scale);
    rows(dq, r).copy_(gq);
    rows(dk, r).copy_(gk);
    rows(dv, r).copy_(gv);
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
