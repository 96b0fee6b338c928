// One row of the log-sum-exp merge (merge.h), shared by the CPU loop and the CUDA kernel.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define DA_MERGE_HD __host__ __device__ __forceinline__
#else
#define DA_MERGE_HD inline
#endif

namespace dilated_attention {
namespace views {

// The merged lse of a (accumulator) and b (call) and the weights exp(a - lse), exp(b - lse) of
// the two parts: weights 0 where both are -inf, NaN where either is NaN (as torch.logaddexp).
template <typename acc_t>
DA_MERGE_HD void merge_weights(acc_t a, acc_t b, acc_t* lse, acc_t* wa, acc_t* wb) {
  if (a != a || b != b) {
    *lse = a + b;
    *wa = *lse;
    *wb = *lse;
    return;
  }
  const acc_t mx = a > b ? a : b;
  if (mx == -INFINITY) {
    *lse = mx;
    *wa = 0;
    *wb = 0;
    return;
  }
  if (a == b && mx == INFINITY) {
    *lse = mx;
  } else {
    const acc_t d = a > b ? b - a : a - b;
    *lse = mx + log1p(exp(d));
  }
  *wa = exp(a - *lse);
  *wb = exp(b - *lse);
}

}  // namespace views
}  // namespace dilated_attention
