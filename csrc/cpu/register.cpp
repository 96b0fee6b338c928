// The op's CPU kernels (ops.h) for torch's dispatcher: dilated_attention::fwd, bwd, varlen_fwd,
// varlen_bwd, piece_fwd and piece_bwd on CPU tensors. (decode_step: decode_cpu.cpp; dropout_mask:
// dropout_cpu.cpp.)
#include <torch/library.h>

#include "ops.h"

namespace dilated_attention {

TORCH_LIBRARY_IMPL(dilated_attention, CPU, m) {
  m.impl("fwd", &cpu::fwd_cpu);
  m.impl("bwd", &cpu::bwd_cpu);
  m.impl("varlen_fwd", &cpu::varlen_fwd_cpu);
  m.impl("varlen_bwd", &cpu::varlen_bwd_cpu);
  m.impl("piece_fwd", &cpu::piece_fwd_cpu);
  m.impl("piece_bwd", &cpu::piece_bwd_cpu);
}

}  // namespace dilated_attention
