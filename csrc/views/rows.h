// Whole-row moves of the views driver's CUDA backward, and its forward's check for non-finite
// inputs (rows_kernel.cuh): up to three tensors in one launch.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace dilated_attention {
namespace views {

#ifdef DILATED_ATTENTION_WITH_CUDA
// dst[i] = src[i] (add: dst[i] += src[i]) for every pair, on CUDA tensors of at most four dims
// whose last dim is the row and whose sizes agree pair by pair, dsts not overlapping. One launch
// where the pairs fit the kernel (a copy of dtypes of 2, 4 or 8 bytes with contiguous rows; an add
// of float32, bfloat16 or float16 into float32 sources of one dtype), else at::Tensor::copy_ /
// add_ pair by pair (rows_cuda.cu).
void move_rows_cuda_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool add);

// Whether every entry of xs (1 to 3 CUDA tensors of one dtype, at most four dims) is finite: one
// launch and one read of the flag back to the host (at::isfinite and all per tensor elsewhere).
bool all_finite_cuda(const std::vector<at::Tensor>& xs);
#endif

}  // namespace views
}  // namespace dilated_attention
