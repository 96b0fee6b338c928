// dilated_attention::views_fwd and views_bwd: the sdpa backend's driver in one op each way.
//
// Every branch is a handful of dense attention calls on strided views of q, k and v (plan.h; the
// calls of a branch's phases run as one, their index as the kernel's batch dim, gathered into one
// contiguous batch where the segments or batch entries are several too: Run, Moves); a call's
// (out, lse) is merged by log-sum-exp into one accumulator (merge.h). The backward feeds each
// call the *merged* out and lse of its rows (as ring attention does) and adds its gradients into
// strided views of float32 (float64) dq, dk and dv. A branch the plan puts on k and v repeated to
// q's heads (plan.h Plan::repeated: grouped-query heads that would split it into more calls) reads
// them from one copy made per direction for every such branch (g = Hq / Hkv times k's and v's size;
// the forward also repeats the non-finite flags and, with causal masking, v as the inputs hold it),
// and the backward adds its gradients into float32 (float64) dk and dv of q's heads, summed per
// key/value head once at the end. Only the per-call kernel differs:
//
// * CPU: aten::_scaled_dot_product_flash_attention_for_cpu forward (grouped-query attention in
//   the kernel); the backward is the exact matmul formula in float32 (float64), in chunks, with
//   delta and the row normalisation summed over every call first (the row dots of
//   dilated_attention/backends/accumulated.py), which keeps float32 and bfloat16 within SPEC section 4.
// * CUDA: aten::_scaled_dot_product_cudnn_attention (sm_90+, float16/bfloat16, head dim a
//   multiple of 8 and <= 128) or aten::_scaled_dot_product_flash_attention (sm_80+, head dim a
//   multiple of 8 and <= 256), else aten::_scaled_dot_product_efficient_attention (float32,
//   float16; bfloat16 on sm_80+), and their backward operators, key/value heads repeated to q's in
//   the move that gives the kernel its operands (Moves::operand). The efficient kernel's backward
//   gets out and dout contiguous (B, M, H, D): it steps out's rows by H D, whatever the strides.
//   cuDNN's backward always gets out and dout contiguous (B, H, M, D) and the statistics contiguous
//   (B, H, M, 1): PyTorch caches a cuDNN backward graph per shapes and strides of q, k and v while
//   the graph bakes in the strides of out, dout and the statistics. A call of one row and one key
//   runs in closed form (cuDNN refuses s_q = s_kv = 1): out = v, lse = scale (q . k).
//
// Non-finite inputs take the corrections of backends/driver.py's _NonFinite, without a read back to the
// host: one pass flags the rows of q, k and v that hold a NaN or an infinity, and the merge of
// every call corrects its rows from the flags (only where some flag is set): causal masking's
// 0 * inf is kept out of the kernel, and a row that reads a non-finite query or key gets NaN (the
// CPU kernel turns NaN scores into weight 0). Nothing in either direction synchronises with the
// host or allocates by data on CUDA, so a step can be captured into a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "views/merge.h"
#include "views/plan.h"
#include "views/rows.h"
#include "views/views.h"

#ifdef DILATED_ATTENTION_WITH_CUDA
namespace dilated_attention {
namespace views {
int cuda_kernel_kind(const at::Tensor& q);  // merge_cuda.cu: 2 cuDNN, 1 flash, 3 efficient, 0 none
bool cuda_capturing();                      // merge_cuda.cu: the current stream is being captured
}  // namespace views
}  // namespace dilated_attention
#endif

namespace dilated_attention {
namespace views {

namespace {

// Score-chunk budget of the CPU backward, in elements (float32: 16 MiB per buffer).
constexpr int64_t kChunkElements = 4 * 1024 * 1024;

// A kernel call of the driver (plan.h DriverCall) and its views of the tensors.
struct Run : DriverCall {
  // The strided view (count, Bb, m, n, E) of x (B, N, H, E) at the rows of the run and the heads s
  // (c.q or c.kv, or a view of the same heads; step_c: their head step per index): the run's
  // count calls, each over all batch entries folded with the segments (b < 0) or over batch entry
  // b's segments. x's batch and sequence dims must fold (x.stride(0) == N * x.stride(1) where B > 1
  // and the call's segments do not stand alone), which the driver's contiguous tensors satisfy.
  at::Tensor view(const at::Tensor& x, const Strided& s, int64_t step_c) const {
    const int64_t B = x.size(0), sB = x.stride(0), sN = x.stride(1), sH = x.stride(2), sE = x.stride(3);
    const Part& p = c.part;
    const int64_t Bb = batch(B), sBb = b < 0 && p.rows == 1 ? sB : p.length * sN;
    const int64_t off = x.storage_offset() + (p.start + s.p0) * sN + s.c0 * sH + (b >= 0 ? b * sB : 0);
    return x.as_strided({count, Bb, c.m, s.n, x.size(3)},
                        {step_p * sN + step_c * sH, sBb, c.r * sN, s.dp * sN + s.dc * sH, sE}, off);
  }

  at::Tensor q(const at::Tensor& x) const { return view(x, c.q, step_q); }
  at::Tensor kv(const at::Tensor& x) const { return view(x, c.kv, step_kv); }
  // q and kv of a (B, N, H) tensor: (count, Bb, m, n).
  at::Tensor q3(const at::Tensor& x) const { return view(x.unsqueeze(-1), c.q, step_q).select(-1, 0); }
  at::Tensor kv3(const at::Tensor& x) const { return view(x.unsqueeze(-1), c.kv, step_kv).select(-1, 0); }

  // A kernel's result (count Bb, ...) as the run's (count, Bb, ...).
  at::Tensor split(const at::Tensor& y) const { return y.unflatten(0, {count, y.size(0) / count}); }
};

// Whether a run's views (count, Bb, ...) are strided views of one batch dim as they are: one of
// the two is 1 (not DriverCall::gathers). Otherwise no one stride spans them and the kernel reads a
// gathered copy.
bool folds(const at::Tensor& view) {
  return view.size(0) == 1 || view.size(1) == 1;
}

// Row moves collected over a branch's runs and made together (run()): on CUDA by the rows kernel,
// up to kRowPairs tensors a launch (rows.h), on the CPU by copy_ / add_.
class Moves {
 public:
  // dst <- src (add: dst += src) when run() is called, both of the same sizes, or for an add src
  // (..., group, len) of one more dim than dst (..., len), whose sum over the group is added.
  void push(const at::Tensor& dst, const at::Tensor& src) {
    if (dst.stride(-1) == 1 && src.stride(-1) == 1) {
      dst_.push_back(dst);
      src_.push_back(src);
      return;
    }
    // rows of one element; a group dim stays the one before the row
    const at::Tensor s = src.unsqueeze(-1);
    dst_.push_back(dst.unsqueeze(-1));
    src_.push_back(src.dim() > dst.dim() ? s.movedim(-3, -2) : s);
  }

  // A run's view (count, Bb, ...) as a kernel reads it, (count Bb, ...): the view itself where it
  // folds, else a contiguous tensor that run() gathers its rows into. heads > 0: the key/value
  // heads of a view (count, Bb, mk, hk, D) repeated to q's heads (query head t reads key/value
  // head t / (heads / hk)) in the same move, for a kernel that takes as many as q has.
  at::Tensor operand(const at::Tensor& view, int64_t heads = 0) {
    const int64_t hk = view.size(3);
    const bool repeat = heads > 0 && hk != heads;
    if (!repeat && folds(view)) return view.flatten(0, 1);  // a view: a dim of size 1
    std::vector<int64_t> sizes = view.sizes().vec();
    at::Tensor src = view;
    if (repeat) {
      sizes.insert(sizes.begin() + 4, heads / hk);
      src = view.unsqueeze(4).expand(sizes);
      sizes.erase(sizes.begin() + 4);
      sizes[3] = heads;
    }
    const at::Tensor x = at::empty(src.sizes(), src.options());
    push(x, src);
    return x.view(sizes).flatten(0, 1);
  }

  // A run's view (count, Bb, m, n, ...) as (count Bb, m, n, ...), contiguous, filled by run(): the
  // layout the efficient kernel's backward reads out in (its rows a stride of n D apart).
  at::Tensor packed(const at::Tensor& view) {
    const at::Tensor x = at::empty(view.sizes(), view.options());
    push(x, view);
    return x.flatten(0, 1);
  }

  // A run's view (count, Bb, m, n, ...) as (count Bb, n, m, ...), contiguous, filled by run(): the
  // layout cuDNN's backward takes dout, out and the statistics in. into: where to put it, (count,
  // Bb, n, >= m, ...) (its rows past m left as they are); undefined: a tensor of its own.
  at::Tensor heads_first(const at::Tensor& view, const at::Tensor& into = at::Tensor()) {
    std::vector<int64_t> sizes = view.sizes().vec();
    std::swap(sizes[2], sizes[3]);
    const at::Tensor x = into.defined() ? into : at::empty(sizes, view.options());
    push(x.narrow(3, 0, view.size(2)).transpose(2, 3), view);
    return x.flatten(0, 1);
  }

  void run(bool add) {
    if (dst_.empty()) return;
#ifdef DILATED_ATTENTION_WITH_CUDA
    if (dst_[0].is_cuda()) {
      move_rows_cuda_(dst_, src_, add);
      dst_.clear();
      src_.clear();
      return;
    }
#endif
    for (size_t i = 0; i < dst_.size(); ++i) {
      if (!add)
        dst_[i].copy_(src_[i]);
      else if (src_[i].dim() > dst_[i].dim())
        dst_[i].add_(at::sum(src_[i], {-2}, false, dst_[i].scalar_type()));
      else
        dst_[i].add_(src_[i]);
    }
    dst_.clear();
    src_.clear();
  }

 private:
  std::vector<at::Tensor> dst_, src_;
};

// The run's views xs (count, Bb, ...) as a kernel reads them (Moves::operand), gathered at once.
std::vector<at::Tensor> operands(const std::vector<at::Tensor>& xs) {
  Moves moves;
  std::vector<at::Tensor> out;
  for (const at::Tensor& x : xs) out.push_back(moves.operand(x));
  moves.run(false);
  return out;
}

// x (B, N, H, E) or (B, N, H), batch and sequence dims that fold, with every head repeated G times
// (head h of the result, contiguous, is head h / G of x), filled by moves.run(): the key/value
// heads of the branches planned on them (plan.h Plan::repeated), one 6-D expand as
// Moves::operand's.
at::Tensor repeat_heads(Moves& moves, const at::Tensor& x, int64_t G) {
  const at::Tensor y = x.dim() == 3 ? x.unsqueeze(-1) : x;
  const int64_t B = y.size(0), N = y.size(1), H = y.size(2), E = y.size(3);
  const at::Tensor rows =
      y.as_strided({1, B * N, 1, H, E}, {0, y.stride(1), 0, y.stride(2), y.stride(3)}, y.storage_offset());
  const at::Tensor out = moves.operand(rows, H * G).view({B, N, H * G, E});
  return x.dim() == 3 ? out.squeeze(-1) : out;
}

// Runs f on the (count Bb, ...) tensors that a CPU kernel adds into for the run's views xs of
// accumulators: the views themselves where they fold, else zeroed tensors added into xs after.
template <typename F>
void add_into(const std::vector<at::Tensor>& xs, F&& f) {
  std::vector<at::Tensor> flat;
  if (folds(xs[0])) {
    for (const at::Tensor& x : xs) flat.push_back(x.flatten(0, 1));
    f(flat);
    return;
  }
  Moves adds;
  for (const at::Tensor& x : xs) {
    const at::Tensor sum = at::zeros(x.sizes(), x.options());
    adds.push(x, sum);
    flat.push_back(sum.flatten(0, 1));
  }
  f(flat);
  adds.run(true);
}

// The driver's kernel calls of a branch's plan calls (plan.h driver_calls), with their views.
std::vector<Run> runs(const std::vector<Call>& calls, int64_t B, int64_t N) {
  std::vector<Run> out;
  for (const DriverCall& d : driver_calls(calls, B, N)) out.push_back(Run{d});
  return out;
}

// q' and scale' > 0 with q' scale' == q scale exactly, and the sign that maps the kernel's dq
// back (PyTorch's fused CPU kernel returns NaN for a causal call with scale <= 0): a negative
// scale moves its sign into q, a zero scale makes every score 0, as q' = 0 with scale' = 1 does.
std::tuple<at::Tensor, double, double> positive_scale(const at::Tensor& q, double scale) {
  if (scale > 0) return {q, scale, 1.0};
  if (scale < 0) return {q.neg(), -scale, -1.0};
  return {at::zeros_like(q), 1.0, 0.0};
}

// x (B, N, H, D) itself where the driver's strided views can read it in place: the head dim
// contiguous, the heads one after another, rows that do not overlap, batch and sequence dims that
// fold (x.stride(0) == N x.stride(1)) and, on CUDA, strides that are multiples of 8 elements from a
// 16-byte aligned start (what cuDNN and flash attention take); else a contiguous copy. The views
// of a fused projection (q, k, v = qkv.split(...)) are read in place.
at::Tensor driver_layout(const at::Tensor& x) {
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  bool in_place = x.stride(3) == 1 && x.stride(2) == D && x.stride(1) >= H * D &&
                  (B == 1 || x.stride(0) == N * x.stride(1));
  if (in_place && x.is_cuda())
    in_place = D % 8 == 0 && x.stride(1) % 8 == 0 && x.stride(0) % 8 == 0 &&
               reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  return in_place ? x : x.contiguous();
}

// Whether the current CUDA stream of q is being captured into a graph.
bool capturing(const at::Tensor& q) {
#ifdef DILATED_ATTENTION_WITH_CUDA
  return q.is_cuda() && cuda_capturing();
#else
  (void)q;
  return false;
#endif
}

// flags (x's sizes without the last) = 1 at every row of the CPU tensor x (at most four dims) that
// holds a NaN or an infinity: one pass over x, the rows in parallel (at::isfinite(x).all(-1) is
// several times slower).
void mark_rows_cpu(const at::Tensor& x, const at::Tensor& flags) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4 && flags.is_contiguous(),
              "dilated_attention views: rows of 1 to 4 dims to check, got ", x.sizes());
  int64_t size[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < x.dim(); ++i)
    size[4 - x.dim() + i] = x.size(i), stride[4 - x.dim() + i] = x.stride(i);
  const int64_t rows = size[0] * size[1] * size[2], len = size[3];
  int* f = flags.data_ptr<int>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "views_mark_rows", [&] {
    const scalar_t* base = x.const_data_ptr<scalar_t>();
    at::parallel_for(
        0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(len, 1)), [&](int64_t lo, int64_t hi) {
          for (int64_t r = lo; r < hi; ++r) {
            const scalar_t* row = base + (r / (size[1] * size[2])) * stride[0] +
                                  (r / size[2] % size[1]) * stride[1] + (r % size[2]) * stride[2];
            bool bad = false;
            for (int64_t e = 0; e < len; ++e) {
              const auto y = static_cast<at::opmath_type<scalar_t>>(row[e * stride[3]]);
              bad |= !(y - y == 0);  // inf - inf and NaN - NaN are NaN
            }
            f[r] = bad;
          }
        });
  });
}

// Flags of the rows of xs (1 to 3 tensors of one dtype, the last dim the row) that hold a NaN or
// an infinity: {any (1,), flags of xs[0], ...}, int32, 1 where the row (any: some row) holds one.
// On CUDA one launch and no read back to the host.
std::vector<at::Tensor> mark_nonfinite(const std::vector<at::Tensor>& xs) {
  std::vector<int64_t> counts;
  int64_t total = 1;
  for (const at::Tensor& x : xs) {
    counts.push_back(x.numel() / std::max<int64_t>(1, x.size(-1)));
    total += counts.back();
  }
  const at::Tensor flags = at::zeros({total}, xs[0].options().dtype(at::kInt));
  std::vector<at::Tensor> out = {flags.narrow(0, 0, 1)};
  int64_t at = 1;
  for (size_t i = 0; i < xs.size(); ++i) {
    out.push_back(flags.narrow(0, at, counts[i]).view(xs[i].sizes().slice(0, xs[i].dim() - 1)));
    at += counts[i];
  }
#ifdef DILATED_ATTENTION_WITH_CUDA
  if (xs[0].is_cuda() && mark_nonfinite_rows_cuda_(xs, {out.begin() + 1, out.end()}, out[0])) return out;
#endif
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].is_cpu())
      mark_rows_cpu(xs[i], out[i + 1]);
    else
      out[i + 1].copy_(at::isfinite(xs[i]).all(-1).logical_not());
  }
  out[0].copy_(flags.narrow(0, 1, total - 1).any());
  return out;
}

// Non-finite inputs (backends/driver.py's _NonFinite), marked on the device (mark_nonfinite) and corrected
// by the merge of every call (merge_rule.h NonFiniteRows): no value is read back to the host on
// CUDA. v_kernel: with causal masking, the values the kernels read, v with its non-finite entries
// taken as 0 (masking's 0 * inf kept out of the kernel); on the CPU v itself where every row is
// finite (the CPU reads the flag for free).
struct NonFinite {
  at::Tensor any, qbad, kbad, vbad, v, v_kernel;
  bool causal;

  NonFinite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v_in, bool is_causal)
      : v(v_in), v_kernel(v_in), causal(is_causal) {
    const std::vector<at::Tensor> m = mark_nonfinite({q, k, v});
    any = m[0];
    qbad = m[1];
    kbad = m[2];
    vbad = m[3];
    if (is_causal && (q.is_cuda() || any.item<int>() != 0))  // .item on the CPU only
      v_kernel = at::nan_to_num(v, 0.0, 0.0, 0.0);
  }

  // The corrections of a run (views as Run takes them).
  CallNonFinite call(const Run& r) const {
    CallNonFinite f{any, r.q3(qbad), r.kv3(kbad), at::Tensor(), at::Tensor(), r.c.q.n / r.c.kv.n, causal};
    if (causal) {
      f.vbad = r.kv3(vbad);
      f.v = r.kv(v);
    }
    return f;
  }

  // The corrections of the branches planned on k and v repeated G times (repeat_heads): the flags
  // of k and v and, with causal masking, the values repeated as those, filled by moves.run();
  // v_kernel: the kernel's values repeated.
  NonFinite repeated(Moves& moves, int64_t G, const at::Tensor& v_kernel_rep) const {
    NonFinite r = *this;
    r.kbad = repeat_heads(moves, kbad, G);
    if (causal) {
      r.vbad = repeat_heads(moves, vbad, G);
      r.v = v_kernel.is_same(v) ? v_kernel_rep : repeat_heads(moves, v, G);
    }
    r.v_kernel = v_kernel_rep;
    return r;
  }
};

// ---------------------------------------------------------------------------------------------
// CPU kernels
// ---------------------------------------------------------------------------------------------

// (c, nr, h, E) -> (c hk, g nr, E) in dtype ct: the rows of every query head of a key/value head
// together, as one batched matmul takes them.
at::Tensor heads_first(const at::Tensor& x, int64_t hk, at::ScalarType ct) {
  const int64_t c = x.size(0), nr = x.size(1), h = x.size(2), E = x.size(3);
  return x.to(ct).permute({0, 2, 1, 3}).reshape({c * hk, (h / hk) * nr, E});
}

// (c hk, g nr, E) -> (c, nr, h, E): heads_first's rows back in the (B, m, h) layout.
at::Tensor rows_last(const at::Tensor& y, int64_t c, int64_t hk, int64_t nr) {
  const int64_t g = y.size(1) / nr, E = y.size(2);
  return y.view({c, hk, g, nr, E}).permute({0, 3, 1, 2, 4}).reshape({c, nr, hk * g, E});
}

// Runs f(b0, c, i0, nr, kh, vh, p) over the chunks of a call of q (Bb, m, h, D), k and v
// (Bb, mk, hk, D) and its merged lse (Bb, m, h): batch entries [b0, b0 + c) and rows
// [i0, i0 + nr) of at most kChunkElements scores, kh and vh (c hk, mk, D) and
// P = exp(scale (q k^T) - lse) (c hk, g nr, mk) in lse's dtype, causal top-left aligned (as the
// fused operator). The same inputs give the same P bit for bit.
template <typename F>
void cpu_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                bool is_causal, double scale, F&& f) {
  const at::ScalarType ct = lse.scalar_type();
  const int64_t Bb = q.size(0), m = q.size(1), h = q.size(2), D = q.size(3);
  const int64_t mk = k.size(1), hk = k.size(2);
  const int64_t per_row = std::max<int64_t>(1, h * mk);
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(m, kChunkElements / per_row));
  const int64_t nb =
      std::max<int64_t>(1, std::min<int64_t>(Bb, kChunkElements / std::max<int64_t>(1, per_row * rows)));
  for (int64_t b0 = 0; b0 < Bb; b0 += nb) {
    const int64_t c = std::min(nb, Bb - b0);
    const at::Tensor kh = k.narrow(0, b0, c).to(ct).permute({0, 2, 1, 3}).reshape({c * hk, mk, D});
    const at::Tensor vh = v.narrow(0, b0, c).to(ct).permute({0, 2, 1, 3}).reshape({c * hk, mk, D});
    for (int64_t i0 = 0; i0 < m; i0 += rows) {
      const int64_t nr = std::min(rows, m - i0);
      at::Tensor lc = heads_first(lse.narrow(0, b0, c).narrow(1, i0, nr).unsqueeze(-1), hk, ct);
      lc = lc.masked_fill(lc.isneginf(), 0);
      // the dot products scaled once rounded, as PyTorch's own scores
      at::Tensor p = at::bmm(heads_first(q.narrow(0, b0, c).narrow(1, i0, nr), hk, ct), kh.transpose(1, 2))
                         .mul_(scale)
                         .sub_(lc)
                         .exp_();
      if (is_causal) {
        const at::Tensor future = at::ones({nr, mk}, q.options().dtype(at::kBool)).triu_(i0 + 1);
        p.view({c * hk, h / hk, nr, mk}).masked_fill_(future, 0);
      }
      f(b0, c, i0, nr, kh, vh, p);
    }
  }
}

// Adds a call's (sum_x P(p, x) (dout_p . v_x), sum_x P(p, x)) into dots and total (Bb, m, h).
void cpu_row_dots(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& lse, bool is_causal, double scale, const at::Tensor& dots,
                  const at::Tensor& total) {
  const int64_t hk = k.size(2);
  const at::ScalarType ct = lse.scalar_type();
  cpu_chunks(
      q, k, v, lse, is_causal, scale,
      [&](int64_t b0, int64_t c, int64_t i0, int64_t nr, const at::Tensor&, const at::Tensor& vh,
          at::Tensor& p) {
        total.narrow(0, b0, c).narrow(1, i0, nr).add_(rows_last(p.sum(-1, true), c, hk, nr).select(-1, 0));
        const at::Tensor dov =
            at::bmm(heads_first(dout.narrow(0, b0, c).narrow(1, i0, nr), hk, ct), vh.transpose(1, 2));
        dots.narrow(0, b0, c).narrow(1, i0, nr).add_(
            rows_last(p.mul_(dov).sum(-1, true), c, hk, nr).select(-1, 0));
      });
}

// Adds a call's gradients into dq (Bb, m, h, D), dk and dv (Bb, mk, hk, D) (views in lse's dtype):
// P = exp(scale q k^T - lse) * norm, dV = P^T dout, dS = P (dout v^T - delta), dQ = scale dS k,
// dK = scale dS^T q; delta and norm (Bb, m, h) summed over every call of the rows.
void cpu_exact_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& norm,
                        bool is_causal, double scale, const at::Tensor& dq, const at::Tensor& dk,
                        const at::Tensor& dv) {
  const int64_t hk = k.size(2), D = q.size(3), mk = k.size(1);
  const at::ScalarType ct = lse.scalar_type();
  cpu_chunks(q, k, v, lse, is_causal, scale,
             [&](int64_t b0, int64_t c, int64_t i0, int64_t nr, const at::Tensor& kh, const at::Tensor& vh,
                 at::Tensor& p) {
               auto rows = [&](const at::Tensor& x) { return x.narrow(0, b0, c).narrow(1, i0, nr); };
               const at::Tensor qh = heads_first(rows(q), hk, ct), doh = heads_first(rows(dout), hk, ct);
               p.mul_(heads_first(rows(norm).unsqueeze(-1), hk, ct));
               const at::Tensor dvh = at::bmm(p.transpose(1, 2), doh);
               const at::Tensor ds =
                   at::baddbmm(heads_first(rows(delta).unsqueeze(-1), hk, ct), doh, vh.transpose(1, 2), -1, 1)
                       .mul_(p);  // dS / scale
               rows(dq).add_(rows_last(at::bmm(ds, kh).mul_(scale), c, hk, nr));
               const at::Tensor dkh = at::bmm(ds.transpose(1, 2), qh).mul_(scale);
               dk.narrow(0, b0, c).add_(dkh.view({c, hk, mk, D}).transpose(1, 2));
               dv.narrow(0, b0, c).add_(dvh.view({c, hk, mk, D}).transpose(1, 2));
             });
}

// ---------------------------------------------------------------------------------------------
// CUDA kernels
// ---------------------------------------------------------------------------------------------

#ifdef DILATED_ATTENTION_WITH_CUDA
// A call's (out (Bb, n, m, D), lse (Bb, n, >= m) float32) on the CUDA operator kind (2 cuDNN,
// 1 flash, 3 efficient: its lse padded to a multiple of 32 rows); q (Bb, m, n, D), k and v with n
// heads (repeated).
std::pair<at::Tensor, at::Tensor> cuda_forward(int kind, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, bool is_causal, double scale) {
  if (q.size(1) == 1 && k.size(1) == 1) {  // one row, one key: the weight is 1
    const at::Tensor s = (q.to(at::kFloat) * k.to(at::kFloat)).sum(-1).mul(scale);  // (Bb, 1, n)
    return {v.transpose(1, 2).to(q.scalar_type()), s.transpose(1, 2).contiguous()};
  }
  if (kind == 2) {
    auto res =
        at::_scaled_dot_product_cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                std::nullopt, true, 0.0, is_causal, false, scale);
    const at::Tensor stats = std::get<1>(res);
    return {std::get<0>(res), stats.dim() == 4 ? stats.squeeze(-1) : stats};
  }
  if (kind == 3) {
    auto res = at::_scaled_dot_product_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), std::nullopt, true, 0.0, is_causal, scale);
    return {std::get<0>(res), std::get<1>(res)};
  }
  auto res = at::_scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     0.0, is_causal, false, scale);
  return {std::get<0>(res), std::get<1>(res)};
}

// A call's (dq, dk, dv) ((Bb, m, n, D) each) on the CUDA operator kind, fed the merged out and
// lse of its rows: d_o and o (Bb, n, m, D) (contiguous for cuDNN; for the efficient kernel the
// transpose of contiguous (Bb, m, n, D): its backward takes out's rows n D apart, whatever the
// strides say), lt (Bb, n, m) contiguous (the efficient kernel's: (Bb, n, m rounded up to 32)), dl
// (Bb, m, n) (undefined: no dlse term); q, k, v (Bb, m, n, D) (k and v repeated); the dlse term
// from a second backward call with v = 0, out = e_0 and dout = -dlse e_0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(int kind, const at::Tensor& d_o,
                                                             const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& o,
                                                             const at::Tensor& lt, const at::Tensor& dl,
                                                             bool is_causal, double scale) {
  const int64_t m = q.size(1), mk = k.size(1);
  if (m == 1 && mk == 1) {  // closed form: P = exp(scale (q . k) - lse)
    const at::Tensor qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat),
                     dof = d_o.transpose(1, 2).to(at::kFloat);
    const at::Tensor p =
        ((qf * kf).sum(-1, true).mul(scale) - lt.narrow(2, 0, 1).transpose(1, 2).to(at::kFloat).unsqueeze(-1))
            .exp();
    at::Tensor t = (dof * vf).sum(-1, true) - (dof * o.transpose(1, 2).to(at::kFloat)).sum(-1, true);
    if (dl.defined()) t = t + dl.to(at::kFloat).unsqueeze(-1);
    const at::Tensor ds = p * t;
    return {ds * kf * scale, ds * qf * scale, p * dof};
  }
  // dy and y (Bb, n, m, D), stats (Bb, n, m): for cuDNN contiguous, for flash any strides
  auto run = [&](const at::Tensor& dy, const at::Tensor& vv, const at::Tensor& y,
                 const at::Tensor& stats) -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    const at::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2), vt = vv.transpose(1, 2);
    if (kind == 3) {  // its random-number state is read only with dropout
      const at::Tensor none = at::empty({}, q.options().dtype(at::kLong));
      auto g = at::_scaled_dot_product_efficient_attention_backward(
          dy, qt, kt, vt, at::Tensor(), y, stats, none, none, 0.0, {true, true, true, false}, is_causal,
          scale);
      return {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
    }
    if (kind == 2) {
      const at::Tensor seed = at::empty({}, q.options().dtype(at::kLong));
      const at::Tensor offset = at::empty({}, q.options().dtype(at::kLong));
      return at::_scaled_dot_product_cudnn_attention_backward(dy, qt, kt, vt, y, stats.unsqueeze(-1), seed,
                                                              offset, at::Tensor(), at::Tensor(),
                                                              at::Tensor(), m, mk, 0.0, is_causal, scale);
    }
    const at::Tensor seed = at::empty({}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor offset = at::empty({}, at::TensorOptions().dtype(at::kLong));
    return at::_scaled_dot_product_flash_attention_backward(
        dy, qt, kt, vt, y, stats, at::Tensor(), at::Tensor(), m, mk, 0.0, is_causal, seed, offset, scale);
  };
  // (Bb, m, n, D) contiguous -> (Bb, n, m, D) as the kernel reads it
  auto for_kernel = [&](const at::Tensor& x) {
    return kind == 2 ? x.transpose(1, 2).contiguous() : x.transpose(1, 2);
  };
  auto g = run(d_o, v, o, lt);
  // in the inputs' dtype, added into the float32 accumulators as they are (one rounding less
  // than a cast first); the dlse term summed with them in float32
  at::Tensor dq = std::get<0>(g).transpose(1, 2), dk = std::get<1>(g).transpose(1, 2);
  const at::Tensor dv = std::get<2>(g).transpose(1, 2);
  if (dl.defined()) {
    at::Tensor unit = at::zeros_like(q, at::MemoryFormat::Contiguous);
    unit.select(-1, 0).fill_(1);
    at::Tensor d_unit = at::zeros_like(q, at::MemoryFormat::Contiguous);
    d_unit.select(-1, 0).copy_(dl.neg());
    auto e = run(for_kernel(d_unit), at::zeros_like(v, at::MemoryFormat::Contiguous), for_kernel(unit), lt);
    dq = dq.to(at::kFloat).add_(std::get<0>(e).transpose(1, 2));
    dk = dk.to(at::kFloat).add_(std::get<1>(e).transpose(1, 2));
  }
  return {dq, dk, dv};
}
#endif

// The CUDA operator a call runs on: 2 cuDNN, 1 flash, 3 efficient; an error naming the unsupported
// case.
int cuda_kind(const at::Tensor& q) {
#ifdef DILATED_ATTENTION_WITH_CUDA
  const int kind = cuda_kernel_kind(q);
  TORCH_CHECK(kind > 0,
              "dilated_attention::views_fwd on CUDA takes float32, float16 or bfloat16 inputs, got ",
              dtype_name(q.scalar_type()));
  return kind;
#else
  TORCH_CHECK(false, "dilated_attention::views_fwd: this build has no CUDA kernels, got a tensor on ",
              q.device());
  return 0;
#endif
}

// Checks shared by both directions: q, k, v as the op takes them, on the CPU or CUDA.
Problem check_views_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal,
                           double softmax_scale) {
  Problem p = check_inputs(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale);
  TORCH_CHECK(q.is_cpu() || q.is_cuda(),
              "dilated_attention::views_fwd: q, k, v must be on the CPU or CUDA, got ", q.device());
  return p;
}

}  // namespace

// inputs_finite (views.h).
bool inputs_finite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (capturing(q)) return false;
  return mark_nonfinite({q, k, v})[0].item<int>() == 0;  // the one read back: the packed form's
}

// dilated_attention::views_fwd (views.h).
std::tuple<at::Tensor, at::Tensor> views_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& v_in, at::IntArrayRef segment_lengths,
                                             at::IntArrayRef dilation_rates, bool is_causal,
                                             double softmax_scale, std::optional<bool> finite) {
  // The ATen calls below are the op's own work, not autograd's: a caller may hand it tensors that
  // require grad (the backward op has no autograd formula), and its results carry no history.
  const at::AutoDispatchBelowADInplaceOrView guard;
  const Problem P =
      check_views_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  const bool cuda = q_in.is_cuda();
  const int kind = cuda ? cuda_kind(q_in) : 0;
  (void)kind;  // read by the CUDA kernels only
  const at::Tensor k = driver_layout(k_in), v = driver_layout(v_in);
  auto [q, scale, sign] = positive_scale(driver_layout(q_in), softmax_scale);
  (void)sign;
  const at::ScalarType acc = lse_dtype(q.scalar_type());
  const at::Tensor out_acc = at::zeros({P.B, P.N, P.Hq, P.D}, q.options().dtype(acc));
  const at::Tensor lse_acc =
      at::full({P.B, P.N, P.Hq}, -std::numeric_limits<double>::infinity(), q.options().dtype(acc));
  const std::optional<NonFinite> nf =
      finite.value_or(false) ? std::nullopt : std::make_optional<NonFinite>(q, k, v, is_causal);
  const at::Tensor& v_kernel = nf ? nf->v_kernel : v;
  const auto plan = plan_branches(P.N, P.Hq, P.Hkv, segment_lengths, dilation_rates, true, true);
  // k and v (and their non-finite flags) with their heads repeated to q's, once for every branch
  // planned on them (plan.h Plan::repeated), in one move
  at::Tensor k_rep, v_rep;
  std::optional<NonFinite> nf_rep;
  if (plan->any_repeated()) {
    Moves moves;
    k_rep = repeat_heads(moves, k, P.Hq / P.Hkv);
    v_rep = repeat_heads(moves, v_kernel, P.Hq / P.Hkv);
    if (nf) nf_rep = nf->repeated(moves, P.Hq / P.Hkv, v_rep);
    moves.run(false);
  }
  for (size_t br = 0; br < plan->branches.size(); ++br) {
    const bool rep = plan->repeated[br];
    const at::Tensor &kb = rep ? k_rep : k, &vb = rep ? v_rep : v_kernel;
    const NonFinite* nfb = nf ? (rep ? &*nf_rep : &*nf) : nullptr;
    const std::vector<Run> rs = runs(plan->branches[br], P.B, P.N);
    Moves gather;  // the branch's gathers in one launch (on CUDA, up to two runs)
    std::vector<std::array<at::Tensor, 3>> x;
    for (const Run& run : rs) {
      // grouped-query calls as planned: the CPU kernel takes them, on CUDA the key/value heads are
      // repeated to q's in the move that gives the kernel its operands
      const int64_t heads = cuda ? run.c.q.n : 0;
      x.push_back(
          {gather.operand(run.q(q)), gather.operand(run.kv(kb), heads), gather.operand(run.kv(vb), heads)});
    }
    gather.run(false);
    // on CUDA the branch's runs merged at once (their rows are disjoint): one launch for up to
    // kMergeCalls runs; on the CPU each as it comes (no launch to save, and its result freed)
    std::vector<CallNonFinite> fixes;
    fixes.reserve(rs.size());  // (the merges point into it)
    std::vector<MergeCall> merges;
    for (size_t i = 0; i < rs.size(); ++i) {
      const Run& run = rs[i];
      const at::Tensor &qv = x[i][0], &kv = x[i][1], &vv = x[i][2];
      at::Tensor og, lg;
      if (!cuda) {
        std::tie(og, lg) = at::_scaled_dot_product_flash_attention_for_cpu(
            qv.transpose(1, 2), kv.transpose(1, 2), vv.transpose(1, 2), 0.0, is_causal, std::nullopt, scale);
      } else {
#ifdef DILATED_ATTENTION_WITH_CUDA
        std::tie(og, lg) = cuda_forward(kind, qv, kv, vv, is_causal, scale);
#endif
      }
      if (nfb) fixes.push_back(nfb->call(run));
      merges.push_back({run.q(out_acc), run.q3(lse_acc), run.split(og), run.split(lg.narrow(2, 0, run.c.m)),
                        nfb ? &fixes.back() : nullptr});
      if (!cuda) {
        merge_calls_(merges, br == 0);
        merges.clear();
      }
    }
    merge_calls_(merges, br == 0);
  }
  return {out_acc.to(q.scalar_type()), lse_acc.permute({0, 2, 1}).contiguous()};
}

// dilated_attention::views_bwd (views.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> views_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    at::IntArrayRef segment_lengths, at::IntArrayRef dilation_rates, bool is_causal, double softmax_scale) {
  // The ATen calls below are the op's own work, not autograd's: a caller may hand it tensors that
  // require grad (the backward op has no autograd formula), and its results carry no history.
  const at::AutoDispatchBelowADInplaceOrView guard;
  const Problem P =
      check_views_inputs(q_in, k_in, v_in, segment_lengths, dilation_rates, is_causal, softmax_scale);
  check_backward_inputs(P, q_in, dout_in, out_in, lse, dlse);
  const bool cuda = q_in.is_cuda();
  const int kind = cuda ? cuda_kind(q_in) : 0;
  (void)kind;  // read by the CUDA kernels only
  const at::Tensor k = driver_layout(k_in), dout = driver_layout(dout_in);
  // The values the kernels read (accumulated.py's kernel_values): with causal masking, a non-finite
  // v[x] taken as 0, as the forward's kernels took it, so that 0 * inf does not carry it into the
  // dout . v of the rows before x, nor through delta into the gradients of their other branches'
  // keys (dv reads no v). A copy only where v has such entries; on CUDA always, since looking
  // first would synchronise with the host.
  const bool zero_nonfinite = is_causal && (cuda || !at::isfinite(v_in).all().item<bool>());
  const at::Tensor v =
      zero_nonfinite ? at::nan_to_num(v_in, 0.0, 0.0, 0.0).contiguous() : driver_layout(v_in);
  auto [q, scale, sign] = positive_scale(driver_layout(q_in), softmax_scale);
  const at::ScalarType acc = lse_dtype(q.scalar_type());
  const at::Tensor lse_bnh = lse.to(acc).permute({0, 2, 1}).contiguous();
  const bool has_dlse = dlse.has_value() && dlse->defined();
  const at::Tensor dlse_bnh = has_dlse ? dlse->to(acc).permute({0, 2, 1}).contiguous() : at::Tensor();
  const at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(acc));
  const at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc));
  const at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc));
  const auto plan = plan_branches(P.N, P.Hq, P.Hkv, segment_lengths, dilation_rates, true, true);
  // k and v with their heads repeated to q's for the branches planned on them (plan.h
  // Plan::repeated), and their gradients, summed per key/value head into dk and dv at the end
  at::Tensor k_rep, v_rep, dk_rep, dv_rep;
  if (plan->any_repeated()) {
    Moves moves;
    k_rep = repeat_heads(moves, k, P.Hq / P.Hkv);
    v_rep = repeat_heads(moves, v, P.Hq / P.Hkv);
    moves.run(false);
    const at::Tensor g = at::zeros({2, P.B, P.N, P.Hq, P.D}, dk.options());  // zeroed once
    dk_rep = g[0];
    dv_rep = g[1];
  }
  // branch br's k, v, dk and dv
  auto kv_of = [&](size_t br) {
    const bool rep = plan->repeated[br];
    return std::array<at::Tensor, 4>{rep ? k_rep : k, rep ? v_rep : v, rep ? dk_rep : dk, rep ? dv_rep : dv};
  };
  if (!cuda) {
    // delta and norm of every row over the keys of every call, then the gradients
    const at::Tensor dots = at::zeros({P.B, P.N, P.Hq}, q.options().dtype(acc));
    const at::Tensor total = at::zeros({P.B, P.N, P.Hq}, q.options().dtype(acc));
    for (size_t br = 0; br < plan->branches.size(); ++br)
      for (const Run& r : runs(plan->branches[br], P.B, P.N)) {
        const auto [kb, vb, dkb, dvb] = kv_of(br);
        const std::vector<at::Tensor> x = operands({r.q(dout), r.q(q)}), y = operands({r.kv(kb), r.kv(vb)});
        const at::Tensor l = operands({r.q3(lse_bnh)})[0];
        add_into({r.q3(dots), r.q3(total)}, [&](const std::vector<at::Tensor>& o) {
          cpu_row_dots(x[0], x[1], y[0], y[1], l, is_causal, scale, o[0], o[1]);
        });
      }
    const at::Tensor norm = at::where(total > 0, total.reciprocal(), at::ones_like(total));
    at::Tensor delta = dots.mul_(norm);
    if (has_dlse) delta.sub_(dlse_bnh);
    for (size_t br = 0; br < plan->branches.size(); ++br)
      for (const Run& r : runs(plan->branches[br], P.B, P.N)) {
        const auto [kb, vb, dkb, dvb] = kv_of(br);
        const std::vector<at::Tensor> x = operands({r.q(dout), r.q(q)}), y = operands({r.kv(kb), r.kv(vb)}),
                                      z = operands({r.q3(lse_bnh), r.q3(delta), r.q3(norm)});
        add_into({r.q(dq), r.kv(dkb), r.kv(dvb)}, [&](const std::vector<at::Tensor>& o) {
          cpu_exact_backward(x[0], x[1], y[0], y[1], z[0], z[1], z[2], is_causal, scale, o[0], o[1], o[2]);
        });
      }
  } else {
#ifdef DILATED_ATTENTION_WITH_CUDA
    const at::Tensor out = out_in.contiguous();
    std::vector<std::vector<Run>> runs_of;  // per branch
    for (const auto& calls : plan->branches) runs_of.push_back(runs(calls, P.B, P.N));
    // The efficient kernel's backward reads a call's lse rows rounded up to 32 (the layout of its
    // forward, whose rows past m are +inf: weight 0), at head and batch strides that are multiples
    // of 8: one buffer for every run, filled once.
    at::Tensor lse_rows;
    int64_t lse_used = 0;
    auto padded = [](int64_t m) { return (m + 31) / 32 * 32; };
    if (kind == 3) {
      int64_t total = 0;
      for (const auto& rs : runs_of)
        for (const Run& r : rs) total += r.count * r.batch(P.B) * r.c.q.n * padded(r.c.m);
      lse_rows = at::full({total}, std::numeric_limits<double>::infinity(), lse_bnh.options());
    }
    for (size_t br = 0; br < plan->branches.size(); ++br) {
      // The branch's moves in as few launches as the rows kernel takes: the inputs of every run
      // (gathers, and cuDNN's contiguous dout, out and statistics), then its gradients' adds.
      const std::vector<Run>& rs = runs_of[br];
      const auto [kb, vb, dkb, dvb] = kv_of(br);
      Moves in, adds;
      std::vector<std::array<at::Tensor, 7>> x;  // q, k, v, d_o, o, lt, dl as the kernel reads them
      for (const Run& r : rs) {
        const int64_t n = r.c.q.n;
        std::array<at::Tensor, 7> a = {in.operand(r.q(q)), in.operand(r.kv(kb), n), in.operand(r.kv(vb), n)};
        const at::Tensor dy = r.q(dout), y = r.q(out);
        if (kind == 3) {  // the efficient kernel reads out's rows n D apart
          a[3] = in.packed(dy).transpose(1, 2);
          a[4] = in.packed(y).transpose(1, 2);
        } else if (kind == 2 || !folds(dy)) {  // cuDNN's backward graph bakes in their strides
          a[3] = in.heads_first(dy);
          a[4] = in.heads_first(y);
        } else {
          a[3] = dy.flatten(0, 1).transpose(1, 2);
          a[4] = y.flatten(0, 1).transpose(1, 2);
        }
        at::Tensor into;
        if (kind == 3) {
          const int64_t rows = r.count * r.batch(P.B) * n * padded(r.c.m);
          into = lse_rows.narrow(0, lse_used, rows).view({r.count, r.batch(P.B), n, padded(r.c.m)});
          lse_used += rows;
        }
        a[5] = in.heads_first(r.q3(lse_bnh), into);
        if (has_dlse) a[6] = in.operand(r.q3(dlse_bnh));
        x.push_back(a);
      }
      in.run(false);
      for (size_t i = 0; i < rs.size(); ++i) {
        const Run& r = rs[i];
        const Call& c = r.c;
        const int64_t n = c.q.n, hk = c.kv.n;
        auto [gq, gk, gv] = cuda_backward(kind, x[i][3], x[i][0], x[i][1], x[i][2], x[i][4], x[i][5], x[i][6],
                                          is_causal, scale);
        gq = r.split(gq);
        gk = r.split(gk);
        gv = r.split(gv);
        if (hk != n) {  // grouped-query heads: summed over the query heads of a key/value head by the add
          gk = gk.unflatten(3, {hk, n / hk});
          gv = gv.unflatten(3, {hk, n / hk});
        }
        // the runs of a branch add into disjoint rows of dq, and of dk and dv but where grouped-query
        // runs share key/value rows: the adds before such a run go first (plan.h adds_first)
        if (r.adds_first) adds.run(true);
        adds.push(r.q(dq), gq);
        adds.push(r.kv(dkb), gk);
        adds.push(r.kv(dvb), gv);
      }
      adds.run(true);
    }
#endif
  }
  if (dk_rep.defined()) {  // the gradients of the repeated heads summed per key/value head
    Moves sums;
    const int64_t G = P.Hq / P.Hkv;
    sums.push(dk, dk_rep.view({P.B, P.N, P.Hkv, G, P.D}));
    sums.push(dv, dv_rep.view({P.B, P.N, P.Hkv, G, P.D}));
    sums.run(true);
  }
  if (sign != 1.0) dq.mul_(sign);
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

}  // namespace views

namespace views {
namespace {
// The op views_fwd: the forward checking its own inputs for non-finite entries.
std::tuple<at::Tensor, at::Tensor> views_fwd_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                at::IntArrayRef segment_lengths,
                                                at::IntArrayRef dilation_rates, bool is_causal,
                                                double softmax_scale) {
  return views_fwd(q, k, v, segment_lengths, dilation_rates, is_causal, softmax_scale, std::nullopt);
}
}  // namespace
}  // namespace views

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("views_fwd", &views::views_fwd_op);
  m.impl("views_bwd", &views::views_bwd);
}

#ifdef DILATED_ATTENTION_WITH_CUDA
TORCH_LIBRARY_IMPL(dilated_attention, CUDA, m) {
  m.impl("views_fwd", &views::views_fwd_op);
  m.impl("views_bwd", &views::views_bwd);
}
#endif

}  // namespace dilated_attention
