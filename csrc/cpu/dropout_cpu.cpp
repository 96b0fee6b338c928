// dilated_attention::dropout_mask(B, H, Nq, Nk, dropout_p, dropout_seed, dropout_offset) -> Tensor:
// the keep mask of attention dropout (csrc/dropout.h) that the kernels apply, as a bool (B, H, Nq, Nk)
// CPU tensor: element [b, h, q, x] says whether the weight of query row q and key row x of head h
// of batch entry b is kept. For tests and references that apply the kernels' own mask.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "../dropout.h"

namespace dilated_attention {
namespace {

at::Tensor dropout_mask_cpu(int64_t B, int64_t H, int64_t Nq, int64_t Nk, double dropout_p, int64_t seed,
                            int64_t offset) {
  TORCH_CHECK_VALUE(B >= 0 && H >= 0 && Nq >= 0 && Nk >= 0,
                    "dilated_attention::dropout_mask: sizes must be >= 0, got B=", B, ", H=", H, ", Nq=", Nq,
                    ", Nk=", Nk);
  const da_dropout d = dropout_params(dropout_p, seed, offset);
  at::Tensor mask = at::empty({B, H, Nq, Nk}, at::TensorOptions().dtype(at::kBool));
  bool* m = mask.data_ptr<bool>();
  at::parallel_for(0, B * H * Nq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / Nq, q = row % Nq;
      for (int64_t x = 0; x < Nk; ++x) m[row * Nk + x] = da_dropout_keep(&d, bh, q, x) != 0;
    }
  });
  return mask;
}

}  // namespace

TORCH_LIBRARY_IMPL(dilated_attention, CompositeExplicitAutograd, m) {
  m.impl("dropout_mask", &dropout_mask_cpu);
}

}  // namespace dilated_attention
