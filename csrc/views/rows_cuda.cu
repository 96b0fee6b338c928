// The launch of rows_kernel.cuh for views.cpp (rows.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

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

void launch(const RowJob& job, RowOp op, const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const dim3 grid(static_cast<unsigned>((job.max_warps * 32 + kRowThreads - 1) / kRowThreads),
                  static_cast<unsigned>(job.count));
  with_rows_kernel(op, [&](auto kernel) { kernel<<<grid, kRowThreads, 0, stream>>>(job); });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void move_rows_cuda_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool add) {
  TORCH_CHECK(dst.size() == src.size(), "move_rows_cuda_: as many dsts as srcs, got ", dst.size(), " and ",
              src.size());
  RowJob job;
  auto flush = [&] {
    if (job.max_warps > 0) launch(job, add ? RowOp::kAdd : RowOp::kCopy, dst[0].device());
    job = RowJob();
  };
  for (size_t i = 0; i < dst.size(); ++i) {
    // an add's source may hold a group dim before the row, summed: (..., group, len)
    const bool grouped = add && src[i].dim() == dst[i].dim() + 1;
    const at::Tensor first = grouped ? src[i].select(-2, 0) : src[i];
    TORCH_CHECK(dst[i].sizes() == first.sizes() && dst[i].dim() <= kRowDims && dst[i].is_cuda() &&
                    src[i].device() == dst[i].device(),
                "move_rows_cuda_: pair ", i, " has sizes ", dst[i].sizes(), " and ", src[i].sizes());
    const std::optional<RowSource> source = row_source(src[i].scalar_type());
    // a copy moves words of any dtype; an add reads float32, bfloat16 or float16 into float32
    bool fits = add ? dst[i].scalar_type() == at::kFloat && source.has_value()
                    : dst[i].scalar_type() == src[i].scalar_type();
    if (fits && job.count == kRowPairs) flush();
    fits = fits && add_row_pair(job, row_tensor(dst[i]), row_tensor(first), add ? RowOp::kAdd : RowOp::kCopy,
                                source.value_or(RowSource::kFloat), grouped ? src[i].size(-2) : 1,
                                grouped ? src[i].stride(-2) : 0);
    if (fits) continue;
    if (!add)  // moved by ATen
      dst[i].copy_(src[i]);
    else if (grouped)
      dst[i].add_(at::sum(src[i], {-2}, false, at::kFloat));
    else
      dst[i].add_(src[i]);
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
    fits = add_row_pair(job, dst, row_tensor(x), RowOp::kCheck, *source);
  }
  if (!fits) return false;
  if (job.max_warps > 0) launch(job, RowOp::kCheck, xs[0].device());
  return true;
}

}  // namespace views
}  // namespace dilated_attention
