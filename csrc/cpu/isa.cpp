// The instruction set the CPU kernels run with (isa.h): what this CPU has, and the choice, made
// once per process.
#include <c10/util/Exception.h>

#include <stdlib.h>

#include <string>

#include "isa.h"

namespace dilated_attention {
namespace cpu {
namespace {

static const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "baseline";
}

static bool cpu_has(Isa isa) {
#ifdef DA_X86_DISPATCH
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
  if (isa == Isa::avx2) return avx2;
  if (isa == Isa::avx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#endif
  return isa == Isa::baseline;
}

}  // namespace

Isa cpu_isa() {
  static const Isa chosen = [] {
    const char* env = getenv("DILATED_ATTENTION_CPU_ISA");
    const std::string want = env ? env : "auto";
    if (want.empty() || want == "auto") {
      for (Isa isa : {Isa::avx512, Isa::avx2})
        if (cpu_has(isa)) return isa;
      return Isa::baseline;
    }
    for (Isa isa : {Isa::avx512, Isa::avx2, Isa::baseline}) {
      if (want != isa_name(isa)) continue;
      TORCH_CHECK(cpu_has(isa), "dilated_attention: DILATED_ATTENTION_CPU_ISA=", want,
                  " names an instruction set this CPU does not have");
      return isa;
    }
    TORCH_CHECK(false, "dilated_attention: DILATED_ATTENTION_CPU_ISA must be one of auto, avx512, ",
                "avx2, baseline; got '", want, "'");
    return Isa::baseline;  // not reached
  }();
  return chosen;
}

}  // namespace cpu

const char* cpu_kernel_isa() {
  return cpu::isa_name(cpu::cpu_isa());
}

}  // namespace dilated_attention
