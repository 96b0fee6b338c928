// The launch of rows_kernel.cuh for views.cpp (rows.h).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>

#include "views/rows.h"
#include "views/rows_kernel.cuh"

namespace dilated_attention {
namespace views {

namespace {

RowTensor row_tensor(const at::Tensor& t) {
  RowTensor r{t.data_ptr(), static_cast<int64_t>(t.element_size()), {}, {}};
  const int64_t pad = kRowDims - t.dim();
  for (int64_t i = 0; i < pad; ++i) r.size[i] = 1;
  for (int64_t i = 0; i < t.dim(); ++i) {
    r.size[pad + i] = t.size(i);
    r.stride[pad + i] = t.stride(i);
  }
  return r;
}

std::optional<RowSource> row_source(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return RowSource::kFloat;
    case at::kBFloat16: return RowSource::kBFloat16;
    case at::kHalf: return RowSource::kHalf;
    default: return std::nullopt;
  }
}

void launch(const RowJob& job, RowOp op, RowSource source, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const dim3 grid(static_cast<unsigned>((job.max_warps * 32 + kRowThreads - 1) / kRowThreads),
                  static_cast<unsigned>(job.count));
  with_rows_kernel(op, source, [&](auto kernel) { kernel<<<grid, kRowThreads, 0, stream>>>(job); });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void move_rows_cuda_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool add) {
  TORCH_CHECK(dst.size() == src.size(), "move_rows_cuda_: as many dsts as srcs, got ", dst.size(), " and ",
              src.size());
  // the adds grouped by source dtype (a launch reads one), the dsts being disjoint
  std::vector<size_t> order(dst.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (add)
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return src[a].scalar_type() < src[b].scalar_type(); });
  RowJob job;
  std::optional<RowSource> source;  // of the job's adds
  auto flush = [&] {
    if (job.max_warps > 0)
      launch(job, add ? RowOp::kAdd : RowOp::kCopy, source.value_or(RowSource::kFloat), dst[0].device());
    job = RowJob();
    source.reset();
  };
  for (const size_t i : order) {
    TORCH_CHECK(dst[i].sizes() == src[i].sizes() && dst[i].dim() <= kRowDims && dst[i].is_cuda() &&
                    src[i].device() == dst[i].device(),
                "move_rows_cuda_: pair ", i, " has sizes ", dst[i].sizes(), " and ", src[i].sizes());
    const std::optional<RowSource> s = row_source(src[i].scalar_type());
    // a copy moves words of any dtype; the adds of a job read sources of one dtype into float32
    bool fits = add ? dst[i].scalar_type() == at::kFloat && s.has_value()
                    : dst[i].scalar_type() == src[i].scalar_type();
    if (fits && add && source.has_value() && *source != *s) flush();
    if (fits && job.count == kRowPairs) flush();
    fits = fits && add_row_pair(job, row_tensor(dst[i]), row_tensor(src[i]), !add);
    if (!fits) {  // moved by ATen
      if (add)
        dst[i].add_(src[i]);
      else
        dst[i].copy_(src[i]);
      continue;
    }
    if (add) source = s;
  }
  flush();
}

bool mark_nonfinite_rows_cuda_(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& flags,
                               const at::Tensor& any) {
  TORCH_CHECK(!xs.empty() && xs.size() == flags.size(), "mark_nonfinite_rows_cuda_: 1 to ", kRowPairs,
              " tensors and as many flags, got ", xs.size(), " and ", flags.size());
  const std::optional<RowSource> source = row_source(xs[0].scalar_type());
  RowJob job;
  job.any = any.data_ptr<int>();
  bool fits = source.has_value() && xs.size() <= static_cast<size_t>(kRowPairs);
  for (size_t i = 0; fits && i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    fits = x.dim() <= kRowDims && x.is_cuda() && x.scalar_type() == xs[0].scalar_type() &&
           flags[i].scalar_type() == at::kInt && flags[i].dim() == x.dim() - 1;
    if (!fits) break;
    // the row's flag, read at every element of the row (stride 0)
    RowTensor dst = row_tensor(flags[i].unsqueeze(-1).expand(x.sizes()));
    fits = add_row_pair(job, dst, row_tensor(x), false);
  }
  if (!fits) return false;
  if (job.max_warps > 0) launch(job, RowOp::kCheck, *source, xs[0].device());
  return true;
}

}  // namespace views
}  // namespace dilated_attention
