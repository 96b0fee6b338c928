// Argument checks shared by the CPU and CUDA implementations of the op. Each check names the
// tensor or argument, what was expected and what was given. Python normalises arguments first;
// these checks guard the op when it is called directly through torch.ops.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dilated_attention.h"
#include "dropout.h"

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

// A dtype as Python names it (torch.float32 -> "float32"), so that the errors name dtypes as the
// user wrote them (and as the fake kernels' checks, dilated_attention/_validation.py and op/checks.py, do).
inline const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return c10::toString(t);
  }
}

inline void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.dtype() == b.dtype(), "dilated_attention: ", a_name, " and ", b_name,
              " must have the same dtype, got ", dtype_name(a.scalar_type()), " and ",
              dtype_name(b.scalar_type()));
  TORCH_CHECK(a.device() == b.device(), "dilated_attention: ", a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

// q's dtype: one of those the kernels take (errors prefixed with `who`).
inline void check_dtype(const at::Tensor& q, const char* who) {
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16, who,
              ": q, k, v must be float16, bfloat16, float32 or float64, got ", dtype_name(st));
}

// softmax_scale must be finite in the dtype the scores are computed in (float32 for float16,
// bfloat16 and float32 inputs, float64 for float64), with room for the kernels' base-2 factor
// log2(e) (|scale| <= max / 2): otherwise the scaled queries overflow and every score of a row is
// inf or NaN. The functional API's rule (_validation.check_scale_for_dtype); ValueError.
inline void check_scale(double softmax_scale, at::ScalarType dtype, const char* who) {
  const bool f64 = dtype == at::kDouble;
  const double limit =
      (f64 ? std::numeric_limits<double>::max() : (double)std::numeric_limits<float>::max()) / 2;
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && std::fabs(softmax_scale) <= limit, who,
                    ": softmax_scale must be finite in the compute dtype ", f64 ? "float64" : "float32",
                    " of ", dtype_name(dtype), " inputs (|softmax_scale| <= ", limit, "), got ",
                    softmax_scale);
}

// Attention dropout's parameters (dropout.h): dropout_p in [0, 1) (ValueError naming it), the
// generator's seed and offset.
inline da_dropout dropout_params(double dropout_p, int64_t seed, int64_t offset) {
  TORCH_CHECK_VALUE(dropout_p >= 0 && dropout_p < 1, "dilated_attention: dropout_p must be in [0, 1), got ",
                    dropout_p);
  return da_dropout_make(dropout_p, (uint64_t)seed, (uint64_t)offset);
}

// The Problem of q (B, N, Hq, D) and k (B, ., Hkv, D), whose ranks, dtypes and B and D were
// checked: the heads, the head dim and the softmax scale checked here (errors prefixed with `who`).
// No branches, not causal.
inline Problem make_problem(const at::Tensor& q, const at::Tensor& k, double softmax_scale, const char* who) {
  Problem p;
  p.B = q.size(0);
  p.N = q.size(1);
  p.Hq = q.size(2);
  p.Hkv = k.size(2);
  p.D = q.size(3);
  TORCH_CHECK(p.Hkv >= 1 && p.Hq >= 1 && p.Hq % p.Hkv == 0, who, ": the number of query heads (", p.Hq,
              ") must be a positive multiple of the number of key/value heads (", p.Hkv, ")");
  TORCH_CHECK(p.D >= 1 && p.D <= DA_MAX_HEAD_DIM, who, ": head dim must be in [1, ", DA_MAX_HEAD_DIM,
              "], got ", p.D);
  check_scale(softmax_scale, q.scalar_type(), who);
  p.branches.n = 0;
  p.is_causal = false;
  p.scale = softmax_scale;
  return p;
}

inline Problem check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal,
                            double softmax_scale) {
  TORCH_CHECK(q.dim() == 4, "dilated_attention: q must be 4-D (B, N, Hq, D), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "dilated_attention: k must be 4-D (B, N, Hkv, D), got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "dilated_attention: v must be 4-D (B, N, Hkv, D), got shape ", v.sizes());
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  check_dtype(q, "dilated_attention");
  TORCH_CHECK(k.sizes() == v.sizes(), "dilated_attention: k and v must have the same shape, got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "dilated_attention: q (B, N, Hq, D) and k (B, N, Hkv, D) must agree in B, N and D, "
              "got q ",
              q.sizes(), " and k ", k.sizes());
  Problem p = make_problem(q, k, softmax_scale, "dilated_attention");
  check_branches(segment_lengths, dilation_rates, &p.branches);
  p.is_causal = is_causal;
  return p;
}

// Checks of a piece's q (B, nq, Hq, D), k and v (B, nk, Hkv, D) (dilated_attention::piece_fwd and
// piece_bwd); the Problem's N is nq, it has no branches and is_causal is false (a piece's causal
// order is its own). The device is the caller's to check.
inline Problem check_piece_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  double softmax_scale) {
  TORCH_CHECK(q.dim() == 4, "dilated_attention piece: q must be 4-D (B, nq, Hq, D), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "dilated_attention piece: k must be 4-D (B, nk, Hkv, D), got shape ", k.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "dilated_attention piece: k and v must have the same shape, got ",
              k.sizes(), " and ", v.sizes());
  check_same(q, "q", k, "k");
  check_same(q, "q", v, "v");
  check_dtype(q, "dilated_attention piece");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
              "dilated_attention piece: q (B, nq, Hq, D) and k (B, nk, Hkv, D) must agree in B and D, got q ",
              q.sizes(), " and k ", k.sizes());
  return make_problem(q, k, softmax_scale, "dilated_attention piece");
}

// A piece's causal offset as the kernels take it: clamped to [-nq, nk], where it means the same
// (no key visible to any query, every key visible to every query) and index arithmetic with it
// cannot overflow; 0 without causal masking.
inline int64_t piece_offset(bool is_causal, int64_t causal_offset, int64_t nq, int64_t nk) {
  if (!is_causal) return 0;
  return causal_offset < -nq ? -nq : (causal_offset > nk ? nk : causal_offset);
}

// The layout of the log-sum-exp: (B, Hq, N), float32 (float64 for float64 inputs), or float64
// whatever the inputs when the forward is asked for it (float64_lse): the backward then recomputes
// the probabilities 2^(s - lse) without the rounding of lse to float32, whose error (up to half a
// unit in the last place of |lse|, large for large logits) every probability would inherit.
inline at::ScalarType lse_dtype(at::ScalarType input, bool float64_lse = false) {
  return input == at::kDouble || float64_lse ? at::kDouble : at::kFloat;
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
              "dilated_attention backward: lse must have shape (B, Hq, N) = ", at::IntArrayRef(lse_shape),
              ", got ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == lse_dtype(q.scalar_type()) || lse.scalar_type() == at::kDouble,
              "dilated_attention backward: lse must be ", dtype_name(lse_dtype(q.scalar_type())),
              " or float64, got ", dtype_name(lse.scalar_type()));
  TORCH_CHECK(lse.device() == q.device(), "dilated_attention backward: lse must be on ", q.device(), ", got ",
              lse.device());
  if (dlse.has_value() && dlse->defined()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes(), "dilated_attention backward: dlse must have shape ",
                lse.sizes(), ", got ", dlse->sizes());
    TORCH_CHECK(dlse->device() == q.device(), "dilated_attention backward: dlse must be on ", q.device(),
                ", got ", dlse->device());
  }
}

// One sequence of a call: rows [start, start + len) of batch entry b. A fixed-length batch
// (B, N, ...) is B sequences (b, 0, N); a packed batch (T, ...) is seen as (1, T, ...) and its
// cu_seqlens give the sequences (0, cu_seqlens[i], cu_seqlens[i + 1] - cu_seqlens[i]).
struct Sequence {
  int64_t b, start, len;
};

inline std::vector<Sequence> fixed_sequences(int64_t B, int64_t N) {
  std::vector<Sequence> seqs;
  for (int64_t b = 0; b < B; ++b) seqs.push_back({b, 0, N});
  return seqs;
}

// Checks of a packed (varlen) call: q (T, Hq, D), k and v (T, Hkv, D), cu_seqlens int32 (S + 1,)
// on q's device, max_seqlen >= 0; then the checks of check_inputs on the (1, T, H, D) views.
inline Problem check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cu_seqlens, int64_t max_seqlen,
                                   at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates,
                                   bool is_causal, double softmax_scale) {
  TORCH_CHECK(q.dim() == 3, "dilated_attention varlen: q must be 3-D (T, Hq, D), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3, "dilated_attention varlen: k must be 3-D (T, Hkv, D), got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 3, "dilated_attention varlen: v must be 3-D (T, Hkv, D), got shape ", v.sizes());
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt,
              "dilated_attention varlen: cu_seqlens must be int32, got ",
              dtype_name(cu_seqlens.scalar_type()));
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1,
              "dilated_attention varlen: cu_seqlens must be 1-D of shape (S + 1,), got shape ",
              cu_seqlens.sizes());
  TORCH_CHECK(cu_seqlens.device() == q.device(),
              "dilated_attention varlen: cu_seqlens must be on q's device ", q.device(), ", got ",
              cu_seqlens.device());
  TORCH_CHECK(max_seqlen >= 0, "dilated_attention varlen: max_seqlen must be >= 0, got ", max_seqlen);
  TORCH_CHECK(q.size(0) <= INT32_MAX, "dilated_attention varlen: T must fit in int32 (cu_seqlens), got ",
              q.size(0));
  return check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), segment_lengths, dilation_rates,
                      is_causal, softmax_scale);
}

// The sequences of cu_seqlens, checked in this order: cu_seqlens[0] = 0, non-decreasing,
// cu_seqlens[S] = T, then no sequence longer than max_seqlen (so a cu_seqlens that is not a packing
// at all is named as such, not by the length it happens to give). Reads the S + 1 values on the
// host (on CUDA: one small copy that waits for the stream).
inline std::vector<Sequence> varlen_sequences(const at::Tensor& cu_seqlens, int64_t T, int64_t max_seqlen) {
  const at::Tensor c = cu_seqlens.to(at::kCPU).contiguous();
  const int32_t* cu = c.data_ptr<int32_t>();
  const int64_t S = c.size(0) - 1;
  TORCH_CHECK(cu[0] == 0, "dilated_attention varlen: cu_seqlens[0] must be 0, got ", cu[0]);
  for (int64_t i = 0; i < S; ++i)
    TORCH_CHECK(cu[i + 1] >= cu[i],
                "dilated_attention varlen: cu_seqlens must be non-decreasing, got cu_seqlens[", i,
                "] = ", cu[i], " > cu_seqlens[", i + 1, "] = ", cu[i + 1]);
  TORCH_CHECK(cu[S] == T, "dilated_attention varlen: cu_seqlens[", S, "] (the last) must equal T = ", T,
              " (the rows of q), got ", cu[S]);
  std::vector<Sequence> seqs;
  seqs.reserve(S);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t len = (int64_t)cu[i + 1] - cu[i];
    TORCH_CHECK(len <= max_seqlen, "dilated_attention varlen: sequence ", i, " has length ", len,
                " > max_seqlen = ", max_seqlen);
    seqs.push_back({0, cu[i], len});
  }
  return seqs;
}

// The shapes of the extra tensors of the packed backward: dout and out (T, Hq, D), lse and dlse (Hq, T).
inline void check_varlen_backward_shapes(const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out,
                                         const at::Tensor& lse, const c10::optional<at::Tensor>& dlse) {
  TORCH_CHECK(dout.dim() == 3 && out.dim() == 3,
              "dilated_attention varlen backward: dout and out must be 3-D (T, Hq, D), got shapes ",
              dout.sizes(), " and ", out.sizes());
  const std::vector<int64_t> lse_shape = {q.size(1), q.size(0)};
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape),
              "dilated_attention varlen backward: lse must have shape (Hq, T) = ", at::IntArrayRef(lse_shape),
              ", got ", lse.sizes());
  if (dlse.has_value() && dlse->defined())
    TORCH_CHECK(dlse->sizes() == lse.sizes(), "dilated_attention varlen backward: dlse must have shape ",
                lse.sizes(), ", got ", dlse->sizes());
}

// Checks of the extra tensors of the packed backward: their shapes, then those of
// check_backward_inputs on their (1, ...) views. Returns dlse's (1, Hq, T) view.
inline c10::optional<at::Tensor> check_varlen_backward_inputs(const Problem& P, const at::Tensor& q,
                                                              const at::Tensor& dout, const at::Tensor& out,
                                                              const at::Tensor& lse,
                                                              const c10::optional<at::Tensor>& dlse) {
  check_varlen_backward_shapes(q, dout, out, lse, dlse);
  c10::optional<at::Tensor> dlse3;
  if (dlse.has_value() && dlse->defined()) dlse3 = dlse->unsqueeze(0);
  check_backward_inputs(P, q.unsqueeze(0), dout.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), dlse3);
  return dlse3;
}

// A view whose last dimension is contiguous; copies only when it is not.
inline at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace dilated_attention
