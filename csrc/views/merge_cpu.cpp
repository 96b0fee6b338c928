// The fused merge of merge.h on the CPU (a loop over each call's rows, at::parallel_for), the checks
// of merge_calls_ and its device dispatch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "views/merge.h"

namespace dilated_attention {
namespace views {

namespace {

// One call of merge_calls_ on CPU tensors: one row (bb, j, t) of D values per step, bb over both batch dims.
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

// Checks call i of count for merge_calls_ (on device, as call 0), naming it in the error.
void check_call(const MergeCall& c, size_t i, size_t count, const at::Device& device) {
  const at::Tensor &out_acc = c.out_acc, &lse_acc = c.lse_acc, &out_c = c.out_c, &lse_c = c.lse_c;
  TORCH_CHECK(out_acc.defined() && lse_acc.defined() && out_c.defined() && lse_c.defined(),
              "dilated_attention views merge: call ", i, " of ", count, " lacks a tensor");
  TORCH_CHECK(out_acc.scalar_type() == lse_acc.scalar_type() &&
                  (out_acc.scalar_type() == at::kFloat || out_acc.scalar_type() == at::kDouble),
              "dilated_attention views merge: call ", i, " of ", count,
              ": the accumulators must be float32 or float64, got ", out_acc.scalar_type(), " and ",
              lse_acc.scalar_type());
  const at::ScalarType oc = out_c.scalar_type();
  TORCH_CHECK((oc == at::kHalf || oc == at::kBFloat16 || oc == at::kFloat || oc == at::kDouble) &&
                  at::isFloatingType(lse_c.scalar_type()),
              "dilated_attention views merge: call ", i, " of ", count,
              ": its out must be float16, bfloat16, float32 or float64 and its lse floating, got ", oc,
              " and ", lse_c.scalar_type());
  TORCH_CHECK(out_acc.dim() == 5 && lse_acc.dim() == 4 && out_c.dim() == 5 && lse_c.dim() == 4 &&
                  out_c.sizes() == out_acc.transpose(2, 3).sizes() &&
                  lse_c.sizes() == lse_acc.transpose(2, 3).sizes() &&
                  lse_acc.sizes() == out_acc.sizes().slice(0, 4),
              "dilated_attention views merge: call ", i, " of ", count, ": its out (C, Bb, n, m, D) ",
              out_c.sizes(), " and lse ", lse_c.sizes(), " do not match the accumulators (C, Bb, m, n, D) ",
              out_acc.sizes(), " and ", lse_acc.sizes());
  TORCH_CHECK(out_acc.device() == device && lse_acc.device() == device && out_c.device() == device &&
                  lse_c.device() == device,
              "dilated_attention views merge: call ", i, " of ", count, " has tensors on ", out_acc.device(),
              ", ", lse_acc.device(), ", ", out_c.device(), " and ", lse_c.device(), ", not all on ", device);
  if (c.fix == nullptr) return;
  const CallNonFinite& f = *c.fix;
  const bool causal = f.vbad.defined();
  TORCH_CHECK(f.any.defined() && f.qbad.defined() && f.kbad.defined() && (!causal || f.v.defined()),
              "dilated_attention views merge: call ", i, " of ", count,
              " lacks a flag of its non-finite corrections");
  TORCH_CHECK(f.any.scalar_type() == at::kInt && f.qbad.scalar_type() == at::kInt &&
                  f.kbad.scalar_type() == at::kInt && f.qbad.sizes() == lse_acc.sizes() &&
                  f.kbad.dim() == 4 && f.kbad.size(0) == lse_acc.size(0) &&
                  f.kbad.size(1) == lse_acc.size(1) && f.g > 0 && f.kbad.size(3) * f.g == lse_acc.size(3) &&
                  f.any.device() == device && f.qbad.device() == device && f.kbad.device() == device &&
                  (!causal ||
                   (f.vbad.scalar_type() == at::kInt && f.vbad.sizes() == f.kbad.sizes() &&
                    f.v.scalar_type() == oc && f.v.dim() == 5 && f.v.sizes().slice(0, 4) == f.kbad.sizes() &&
                    f.v.size(4) == out_acc.size(4) && f.vbad.device() == device && f.v.device() == device)),
              "dilated_attention views merge: call ", i, " of ", count,
              ": its non-finite corrections do not match it (int32 flags qbad ", f.qbad.sizes(), ", kbad ",
              f.kbad.sizes(), ", key/value heads a group ", f.g, "; values of its out's dtype ", oc, ")");
}

}  // namespace

void merge_calls_(const std::vector<MergeCall>& calls, bool first) {
  if (calls.empty()) return;
  const at::Device device = calls[0].out_acc.defined() ? calls[0].out_acc.device() : at::Device(at::kCPU);
  std::vector<MergeCall> cs;
  cs.reserve(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    check_call(calls[i], i, calls.size(), device);
    MergeCall c = calls[i];
    if (c.lse_c.scalar_type() != c.out_acc.scalar_type()) c.lse_c = c.lse_c.to(c.out_acc.scalar_type());
    cs.push_back(std::move(c));
  }
#ifdef DILATED_ATTENTION_WITH_CUDA
  if (device.is_cuda()) {
    merge_calls_cuda_(cs, first);
    return;
  }
#endif
  TORCH_CHECK(device.is_cpu(), "dilated_attention views merge: unsupported device ", device);
  for (const MergeCall& c : cs)
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.out_c.scalar_type(), "views_merge", [&] {
      if (c.out_acc.scalar_type() == at::kDouble)
        merge_cpu<scalar_t, double>(c.out_acc, c.lse_acc, c.out_c, c.lse_c, first, c.fix);
      else
        merge_cpu<scalar_t, float>(c.out_acc, c.lse_acc, c.out_c, c.lse_c, first, c.fix);
    });
}

}  // namespace views
}  // namespace dilated_attention
