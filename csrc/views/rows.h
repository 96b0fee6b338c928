// Whole-row moves of the views driver on CUDA, and its forward's marks of non-finite input rows
// (rows_kernel.cuh): up to kRowPairs tensors in one launch.
#pragma once

namespace dilated_attention {
namespace views {

// Tensors one launch moves at the most (rows_kernel.cuh RowJob: 8 pairs of 208 bytes each, in
// the kernel's 4 KiB of arguments); the driver's launch count reads it too (_C.row_pairs).
constexpr int kRowPairs = 8;

}  // namespace views
}  // namespace dilated_attention

#ifdef DILATED_ATTENTION_WITH_CUDA
#include <ATen/ATen.h>

#include <vector>

namespace dilated_attention {
namespace views {

// dst[i] = src[i] (add: dst[i] += src[i]) for every pair, on CUDA tensors of at most kRowDims (six) dims
// whose last dim is the row and whose sizes agree pair by pair, dsts not overlapping. One launch
// for up to kRowPairs pairs that fit the kernel (a copy of dtypes of 2, 4 or 8 bytes with
// contiguous rows; an add of float32, bfloat16 or float16 sources into float32, where a source of
// one more dim than its dst, (..., group, len), adds the sum over its group dim, in float32); a
// pair that does not fit is moved by at::Tensor::copy_ / add_ (rows_cuda.cu).
void move_rows_cuda_(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool add);

// Sets flags[i][...row] = 1 for every row of xs[i] (1 to 3 CUDA tensors of one dtype, float32,
// bfloat16 or float16, at most kRowDims dims, the last the row) that holds a NaN or an infinity, and
// any[0] = 1 where some row does: one launch, nothing read back to the host. flags[i] (int32, xs[i]'s
// sizes without the last) and any (int32, one element) hold 0 before. False where xs do not fit
// the kernel (nothing launched).
bool mark_nonfinite_rows_cuda_(const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& flags,
                               const at::Tensor& any);
}  // namespace views
}  // namespace dilated_attention
#endif
