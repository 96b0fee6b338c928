// The kernels' instruction sets: how code is compiled for each, and the one that runs.
//
// Every kernel (forward.cpp, backward.cpp, piece.cpp) is a template over the vector width with one
// entry point per instruction set: the template instantiated at the width of the set's registers
// inside a function with the set's target attribute (DA_TARGET_AVX512, DA_TARGET_AVX2; none for
// the baseline), and a switch over cpu_isa() (isa.cpp) that calls the one that runs.
#pragma once

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(DA_NO_ISA_DISPATCH)
#define DA_X86_DISPATCH 1
#define DA_TARGET_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2"), noinline))
#define DA_TARGET_AVX2 __attribute__((target("avx2,fma,bmi2"), noinline))
#endif
#if defined(__GNUC__) && !defined(__clang__)
// The vector helpers (vec.h, microgemm.h, softmax.h) are always inlined into the per-ISA entry
// points, so no vector crosses a call boundary and the ABI note GCC gives for wide vector arguments
// does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#define DA_INLINE static inline __attribute__((always_inline))

namespace dilated_attention {
namespace cpu {

/* The kernels' instruction sets, widest last: baseline is SSE2 on x86-64 (16-byte vectors) and the
 * compiler's default elsewhere (16-byte vectors: NEON on ARM). */
enum class Isa { baseline, avx2, avx512 };

/*
 * The instruction set the kernels run with, decided once per process: the widest this CPU has, or
 * the one the environment variable DILATED_ATTENTION_CPU_ISA names (auto, avx512, avx2, baseline),
 * which this CPU must have. Every set computes the same function; the variable is for tests and
 * for comparing them.
 */
Isa cpu_isa();

}  // namespace cpu
}  // namespace dilated_attention
