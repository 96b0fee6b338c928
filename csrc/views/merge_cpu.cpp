// The fused merge of merge.h on the CPU (a loop over rows, at::parallel_for), and the device
// dispatch of merge_call_.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "views/merge.h"

namespace dilated_attention {
namespace views {

namespace {

// merge_call_ on CPU tensors: one row (bb, j, t) of D values per step, bb over both batch dims.
template <typename scalar_t, typename acc_t>
void merge_cpu(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& out_c,
               const at::Tensor& lse_c, bool first, const CallNonFinite* fix) {
  const int64_t Bb = out_acc.size(1), m = out_acc.size(2), n = out_acc.size(3), D = out_acc.size(4);
  acc_t* oa = out_acc.data_ptr<acc_t>();
  acc_t* la = lse_acc.data_ptr<acc_t>();
  const scalar_t* oc = out_c.const_data_ptr<scalar_t>();
  const acc_t* lc = lse_c.const_data_ptr<acc_t>();
  const int64_t *so = out_acc.strides().data(), *sl = lse_acc.strides().data(), *sc = out_c.strides().data(),
                *slc = lse_c.strides().data();
  const NonFiniteRows<scalar_t> nf = nonfinite_rows<scalar_t>(fix);
  at::parallel_for(0, out_acc.size(0) * Bb * m * n, std::max<int64_t>(1, 4096 / std::max<int64_t>(D, 1)),
                   [&](int64_t lo, int64_t hi) {
                     for (int64_t i = lo; i < hi; ++i) {
                       const int64_t bb = i / (m * n), j = (i / n) % m, t = i % n;
                       acc_t* o = oa + batch_offset(bb, Bb, so) + j * so[2] + t * so[3];
                       acc_t* l = la + batch_offset(bb, Bb, sl) + j * sl[2] + t * sl[3];
                       const scalar_t* c = oc + batch_offset(bb, Bb, sc) + t * sc[2] + j * sc[3];
                       const CorrectedRow<scalar_t, acc_t> row(nf, bb, j, t);
                       const acc_t b = row.lse(lc[batch_offset(bb, Bb, slc) + t * slc[2] + j * slc[3]]);
                       if (first) {
                         for (int64_t d = 0; d < D; ++d) o[d * so[4]] = row.out((acc_t)c[d * sc[4]], d);
                         *l = b;
                         continue;
                       }
                       acc_t lse, wa, wb;
                       merge_weights<acc_t>(*l, b, &lse, &wa, &wb);
                       for (int64_t d = 0; d < D; ++d)
                         o[d * so[4]] = o[d * so[4]] * wa + row.out((acc_t)c[d * sc[4]], d) * wb;
                       *l = lse;
                     }
                   });
}

}  // namespace

void merge_call_(const at::Tensor& out_acc, const at::Tensor& lse_acc, const at::Tensor& out_c,
                 const at::Tensor& lse_c, bool first, const CallNonFinite* fix) {
  TORCH_CHECK(out_acc.scalar_type() == lse_acc.scalar_type() &&
                  (out_acc.scalar_type() == at::kFloat || out_acc.scalar_type() == at::kDouble),
              "dilated_attention views merge: the accumulators must be float32 or float64, got ",
              out_acc.scalar_type(), " and ", lse_acc.scalar_type());
  TORCH_CHECK(out_acc.dim() == 5 && lse_acc.dim() == 4 && out_c.dim() == 5 && lse_c.dim() == 4 &&
                  out_c.sizes() == out_acc.transpose(2, 3).sizes() &&
                  lse_c.sizes() == lse_acc.transpose(2, 3).sizes() &&
                  lse_acc.sizes() == out_acc.sizes().slice(0, 4),
              "dilated_attention views merge: a call's out (C, Bb, n, m, D) ", out_c.sizes(), " and lse ",
              lse_c.sizes(), " do not match the accumulators (C, Bb, m, n, D) ", out_acc.sizes(), " and ",
              lse_acc.sizes());
  const at::Tensor lc =
      lse_c.scalar_type() == out_acc.scalar_type() ? lse_c : lse_c.to(out_acc.scalar_type());
#ifdef DILATED_ATTENTION_WITH_CUDA
  if (out_acc.is_cuda()) {
    merge_call_cuda_(out_acc, lse_acc, out_c, lc, first, fix);
    return;
  }
#endif
  TORCH_CHECK(out_acc.is_cpu(), "dilated_attention views merge: unsupported device ", out_acc.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_c.scalar_type(), "views_merge", [&] {
    if (out_acc.scalar_type() == at::kDouble)
      merge_cpu<scalar_t, double>(out_acc, lse_acc, out_c, lc, first, fix);
    else
      merge_cpu<scalar_t, float>(out_acc, lse_acc, out_c, lc, first, fix);
  });
}

}  // namespace views
}  // namespace dilated_attention
